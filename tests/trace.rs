//! Traces: the Chrome JSON, the SVG and PNG timelines, and the overlap figures, on
//! hand-made events and on the CTR model's predicted steps.

mod common;

use std::io::Read as _;

use erase::graph::{DType, OptimizerConfig};
use erase::model::ctr::{CtrConfig, Variant};
use erase::runtime::program::occupancy::DeviceModel;
use erase::runtime::program::simulate::{simulate, SimConfig, SimResult};
use erase::runtime::trace::{Trace, TraceEvent, TraceKind};
use erase::train::{plan_step, ScheduleOptions, StepPlan};
use serde_json::Value;

fn ev(
    phase: &str,
    block: &str,
    stream: u16,
    step: usize,
    start_us: f64,
    end_us: f64,
) -> TraceEvent {
    let op = if phase == "bwd" {
        "linear_grad_weight"
    } else {
        "linear"
    };
    TraceEvent {
        name: format!("{phase}:{block} {op}"),
        block: block.to_string(),
        phase: phase.to_string(),
        op: op.to_string(),
        node: format!("{block}/linear0"),
        launch: String::new(),
        stream,
        step,
        start_us,
        end_us,
        kind: TraceKind::Kernel,
    }
}

fn streams(n: usize) -> Vec<String> {
    (0..n)
        .map(|s| {
            if s == 0 {
                "main".to_string()
            } else {
                format!("side{s}")
            }
        })
        .collect()
}

/// Two steps on four streams. Step 0 has forward work on main with a gap (20..30),
/// forward work on side1 and side3 too (side3's overlaps main's), early backward events
/// under one, two or no forward events, one nested in another on side2, a remainder
/// backward on main and an optimizer launch.
fn synthetic() -> Trace {
    let events = vec![
        // step 0
        ev("fwd", "bottom", 0, 0, 0.0, 10.0),
        ev("fwd", "cross", 0, 0, 10.0, 20.0),
        ev("fwd", "deep", 0, 0, 30.0, 40.0),
        ev("bwd", "remainder", 0, 0, 40.0, 50.0),
        ev("optim", "optim", 0, 0, 50.0, 55.0),
        ev("bwd", "bottom", 1, 0, 5.0, 25.0),
        ev("fwd", "odd", 1, 0, 26.0, 28.0),
        ev("bwd", "bottom", 1, 0, 45.0, 50.0),
        ev("bwd", "cross", 2, 0, 18.0, 35.0),
        ev("bwd", "cross", 2, 0, 20.0, 22.0),
        ev("fwd", "odd", 3, 0, 32.0, 38.0),
        ev("bwd", "deep", 3, 0, 38.0, 42.0),
        // step 1
        ev("fwd", "bottom", 0, 1, 100.0, 110.0),
        ev("bwd", "bottom", 1, 1, 105.0, 120.0),
    ];
    Trace {
        events,
        stream_names: streams(4),
        source: "synthetic".to_string(),
    }
}

#[test]
fn overlap_of_hand_made_events_is_exact() {
    let o = synthetic().overlap();
    assert_eq!(o.steps.len(), 2);
    let s0 = &o.steps[0];
    assert_eq!(s0.step, 0);
    assert_eq!(s0.span_us, 55.0);
    // early backward: side1 20 + 5, side2 17 + 2, side3 4 (main's remainder is not early)
    assert_eq!(s0.early_backward_us, 48.0);
    // side1 [5,25): forward elsewhere over [5,20) (two main events) = 15
    // side1 [45,50): none = 0
    // side2 [18,35): main [18,20) + side1 [26,28) + main/side3 [30,35) = 2 + 2 + 5 = 9
    // side2 [20,22): main's gap, side1's own forward does not count elsewhere = 0
    // side3 [38,42): main [38,40) = 2 (side3's own forward before it does not count)
    assert_eq!(s0.overlapped_us, 26.0);
    assert_eq!(s0.fraction, 26.0 / 48.0);
    let busy: Vec<f64> = s0.streams.iter().map(|b| b.busy_us).collect();
    // main [0,20) + [30,55) (a gap); side2's nested event counts once; side3 [32,42)
    assert_eq!(busy, vec![45.0, 27.0, 17.0, 10.0]);
    let frac: Vec<f64> = s0.streams.iter().map(|b| b.busy_fraction).collect();
    assert_eq!(
        frac,
        vec![45.0 / 55.0, 27.0 / 55.0, 17.0 / 55.0, 10.0 / 55.0]
    );
    let names: Vec<&str> = s0.streams.iter().map(|b| b.name.as_str()).collect();
    assert_eq!(names, ["main", "side1", "side2", "side3"]);

    let s1 = &o.steps[1];
    assert_eq!(
        (s1.span_us, s1.early_backward_us, s1.overlapped_us),
        (20.0, 15.0, 5.0)
    );
    assert_eq!(s1.streams[0].busy_us, 10.0);
    assert_eq!(s1.streams[2].busy_us, 0.0);
    assert_eq!(s1.streams[2].busy_fraction, 0.0);

    assert_eq!(o.early_backward_us, 63.0);
    assert_eq!(o.overlapped_us, 31.0);
    assert_eq!(o.fraction, 31.0 / 63.0);
}

#[test]
fn no_early_work_gives_zero_not_nan() {
    let t = Trace {
        events: vec![
            ev("fwd", "a", 0, 0, 0.0, 3.0),
            ev("bwd", "a", 0, 0, 3.0, 5.0),
        ],
        stream_names: streams(1),
        source: "synthetic".to_string(),
    };
    let o = t.overlap();
    assert_eq!(
        (o.early_backward_us, o.overlapped_us, o.fraction),
        (0.0, 0.0, 0.0)
    );
    assert_eq!(o.steps[0].streams[0].busy_fraction, 1.0);
    let empty = Trace {
        events: vec![],
        stream_names: streams(2),
        source: String::new(),
    };
    assert!(empty.overlap().steps.is_empty());
    assert_eq!(empty.overlap().fraction, 0.0);
}

/// Checks the Chrome JSON of `t`: every complete event has ph, ts, dur, pid, tid, name
/// (and cat and args), and each stream's thread is named.
fn check_chrome(t: &Trace) -> Value {
    let v: Value = serde_json::from_str(&t.to_chrome_json()).expect("valid JSON");
    assert_eq!(v["displayTimeUnit"], "ms");
    let evs = v["traceEvents"].as_array().expect("traceEvents array");
    let complete: Vec<&Value> = evs.iter().filter(|e| e["ph"] == "X").collect();
    assert_eq!(complete.len(), t.events.len());
    for e in &complete {
        for k in ["ph", "ts", "dur", "pid", "tid", "name", "cat", "args"] {
            assert!(e.get(k).is_some(), "event without {k}: {e}");
        }
        assert!(e["ts"].is_number() && e["dur"].as_f64().unwrap() >= 0.0);
        assert!(e["tid"].is_u64() && e["pid"].is_u64());
        for k in ["block", "phase", "step", "op"] {
            assert!(e["args"].get(k).is_some(), "args without {k}: {e}");
        }
        assert_eq!(e["cat"], e["args"]["phase"]);
    }
    for (i, (e, j)) in t.events.iter().zip(&complete).enumerate() {
        assert_eq!(j["name"].as_str(), Some(e.name.as_str()), "event {i}");
        assert_eq!(j["tid"].as_u64(), Some(u64::from(e.stream)));
        // serde_json's default parser may be one ulp off the shortest form it wrote
        let ts = j["ts"].as_f64().unwrap();
        assert!((ts - e.start_us).abs() <= 1e-9 * (1.0 + e.start_us.abs()));
        assert_eq!(j["args"]["step"].as_u64(), Some(e.step as u64));
    }
    for s in 0..t.stream_count() {
        let named = evs.iter().any(|e| {
            e["ph"] == "M"
                && e["name"] == "thread_name"
                && e["tid"].as_u64() == Some(s as u64)
                && e["args"]["name"].as_str() == Some(t.stream_label(s).as_str())
        });
        assert!(named, "no thread_name for stream {s}");
    }
    assert!(evs
        .iter()
        .any(|e| e["ph"] == "M" && e["name"] == "process_name"));
    v
}

#[test]
fn chrome_json_has_every_field_and_escapes_names() {
    let mut t = synthetic();
    t.events[0].name = "fwd:\"odd\" <name> & \\ back\tslash é".to_string();
    t.events[0].block = "a<b>&\"c\"".to_string();
    t.stream_names[1] = "side \"one\"".to_string();
    let v = check_chrome(&t);
    let first = v["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["ph"] == "X")
        .unwrap()
        .clone();
    assert_eq!(first["name"], "fwd:\"odd\" <name> & \\ back\tslash é");
    assert_eq!(first["args"]["block"], "a<b>&\"c\"");
    assert_eq!(first["dur"].as_f64(), Some(10.0));
}

/// A minimal XML check: tags balance, attribute values are quoted, `&` starts an entity,
/// and there is one root. Returns the number of elements.
fn check_xml(s: &str) -> usize {
    let mut stack: Vec<String> = Vec::new();
    let mut elements = 0;
    let mut rest = s.trim_start();
    if rest.starts_with("<?xml") {
        rest = &rest[rest.find("?>").unwrap() + 2..];
    }
    let mut roots = 0;
    loop {
        let Some(lt) = rest.find('<') else {
            assert!(rest.trim().is_empty(), "text after the root");
            break;
        };
        check_text(&rest[..lt]);
        if stack.is_empty() {
            assert!(rest[..lt].trim().is_empty(), "text outside the root");
        }
        let gt = rest[lt..].find('>').expect("unterminated tag") + lt;
        let tag = &rest[lt + 1..gt];
        rest = &rest[gt + 1..];
        if let Some(name) = tag.strip_prefix('/') {
            let open = stack.pop().expect("closing tag without opening");
            assert_eq!(open, name.trim(), "mismatched tags");
            continue;
        }
        assert!(!tag.starts_with('!') && !tag.starts_with('?'));
        let self_closing = tag.ends_with('/');
        let body = tag.trim_end_matches('/');
        let name: String = body.chars().take_while(|c| !c.is_whitespace()).collect();
        assert!(
            !name.is_empty()
                && name
                    .chars()
                    .all(|c| c.is_alphanumeric() || c == '-' || c == ':')
        );
        check_attrs(&body[name.len()..]);
        elements += 1;
        if stack.is_empty() {
            roots += 1;
        }
        if !self_closing {
            stack.push(name);
        }
    }
    assert!(stack.is_empty(), "unclosed: {stack:?}");
    assert_eq!(roots, 1);
    elements
}

fn check_text(t: &str) {
    assert!(!t.contains('>'), "unescaped > in {t:?}");
    let mut i = 0;
    while let Some(p) = t[i..].find('&') {
        let at = i + p;
        let semi = t[at..].find(';').expect("& without ;") + at;
        let ent = &t[at + 1..semi];
        assert!(
            ["amp", "lt", "gt", "quot", "apos"].contains(&ent) || ent.starts_with('#'),
            "bad entity &{ent};"
        );
        i = semi + 1;
    }
}

fn check_attrs(mut a: &str) {
    loop {
        a = a.trim_start();
        if a.is_empty() {
            return;
        }
        let eq = a.find('=').expect("attribute without =");
        let name = a[..eq].trim();
        assert!(!name.is_empty() && !name.contains(char::is_whitespace));
        a = &a[eq + 1..];
        assert!(a.starts_with('"'), "unquoted attribute {name}");
        let end = a[1..].find('"').expect("unterminated attribute") + 1;
        let value = &a[1..end];
        assert!(!value.contains('<'), "< in attribute {name}");
        check_text(value);
        a = &a[end + 1..];
    }
}

#[test]
fn svg_is_well_formed_with_one_lane_per_stream() {
    let mut t = synthetic();
    t.events[0].name = "fwd:<odd> & \"name\"".to_string();
    t.events[1].block = "x<&>y".to_string();
    t.stream_names[2] = "side <2> & 'two'".to_string();
    let svg = t.to_svg(0, "a <title> & \"quotes\"");
    assert!(check_xml(&svg) > 10);
    assert!(svg.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""));
    assert_eq!(svg.matches("class=\"lane\"").count(), 4);
    let kernels = svg.matches("<rect class=\"kernel ").count();
    assert_eq!(kernels, t.events.iter().filter(|e| e.step == 0).count());
    assert!(svg.contains("side &lt;2&gt; &amp; &apos;two&apos;"));
    // the legend lists every block once (heads share their block's entry)
    assert!(svg.contains(">x&lt;&amp;&gt;y</text>"));
    // step 1 has one event per stream used, lanes for all four
    let svg1 = t.to_svg(1, "step 1");
    check_xml(&svg1);
    assert_eq!(svg1.matches("class=\"lane\"").count(), 4);
    assert_eq!(svg1.matches("<rect class=\"kernel ").count(), 2);
}

/// Walks the chunks of a PNG, checking every CRC with flate2's CRC32; returns
/// (width, height, bit depth, colour type, the decompressed image data).
fn check_png(png: &[u8]) -> (u32, u32, u8, u8, Vec<u8>) {
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    let mut at = 8;
    let mut kinds = Vec::new();
    let mut ihdr = None;
    let mut idat = Vec::new();
    while at < png.len() {
        let len = u32::from_be_bytes(png[at..at + 4].try_into().unwrap()) as usize;
        let kind = &png[at + 4..at + 8];
        let data = &png[at + 8..at + 8 + len];
        let crc = u32::from_be_bytes(png[at + 8 + len..at + 12 + len].try_into().unwrap());
        let mut c = flate2::Crc::new();
        c.update(&png[at + 4..at + 8 + len]);
        assert_eq!(c.sum(), crc, "CRC of {}", String::from_utf8_lossy(kind));
        kinds.push(String::from_utf8_lossy(kind).into_owned());
        match kind {
            b"IHDR" => ihdr = Some(data.to_vec()),
            b"IDAT" => idat.extend_from_slice(data),
            _ => {}
        }
        at += 12 + len;
    }
    assert_eq!(at, png.len());
    assert_eq!(kinds.first().map(String::as_str), Some("IHDR"));
    assert_eq!(kinds.last().map(String::as_str), Some("IEND"));
    let h = ihdr.unwrap();
    assert_eq!(h.len(), 13);
    let w = u32::from_be_bytes(h[0..4].try_into().unwrap());
    let ht = u32::from_be_bytes(h[4..8].try_into().unwrap());
    assert_eq!(&h[10..13], &[0, 0, 0]);
    let mut raw = Vec::new();
    flate2::read::ZlibDecoder::new(&idat[..])
        .read_to_end(&mut raw)
        .expect("IDAT is zlib");
    (w, ht, h[8], h[9], raw)
}

#[test]
fn png_has_a_valid_header_size_and_crcs() {
    let t = synthetic();
    for (w, h) in [(640u32, 200u32), (97, 31), (1, 1)] {
        let png = t.to_png(0, w, h);
        let (pw, ph, depth, colour, raw) = check_png(&png);
        assert_eq!((pw, ph, depth, colour), (w, h, 8, 2));
        let stride = 1 + 3 * w as usize;
        assert_eq!(raw.len(), stride * h as usize);
        assert!(raw.chunks(stride).all(|r| r[0] == 0));
        if w >= 97 {
            // the picture shows more than the background and lanes
            let mut colours: Vec<[u8; 3]> = raw
                .chunks(stride)
                .flat_map(|r| r[1..].chunks(3).map(|p| [p[0], p[1], p[2]]))
                .collect();
            colours.sort_unstable();
            colours.dedup();
            assert!(colours.len() >= 6, "{} colours", colours.len());
        }
    }
}

/// The small preset's plan of `variant`, simulated on the H200 model (graph dispatch), and
/// its predicted trace.
fn simulated(variant: Variant) -> (StepPlan, SimConfig, SimResult, Trace) {
    let cfg = CtrConfig::small().with_variant(variant);
    let p = plan_step(
        &cfg,
        DType::F32,
        &OptimizerConfig::default(),
        &ScheduleOptions::default(),
    )
    .unwrap();
    let sim_cfg = SimConfig {
        device: DeviceModel::h200(),
        host_per_launch_s: 0.0,
    };
    let sim = simulate(&p.program, &sim_cfg);
    let t = Trace::from_simulation(&p.program, &sim, &p.model.graph);
    (p, sim_cfg, sim, t)
}

fn predicted(variant: Variant) -> (Trace, usize, Vec<f64>) {
    let (p, _, sim, t) = simulated(variant);
    let kernels = p
        .program
        .launches
        .iter()
        .filter(|l| l.spec.is_some())
        .count();
    assert_eq!(t.events.len(), kernels);
    assert_eq!(t.stream_names.len(), p.program.streams);
    (t, p.program.streams, sim.busy_s)
}

#[test]
fn predicted_erase_step_overlaps_and_detached_does_not() {
    let (erase, streams, busy) = predicted(Variant::Erase);
    assert!(streams > 1);
    let o = erase.overlap();
    assert_eq!(o.steps.len(), 1);
    assert!(o.early_backward_us > 0.0);
    assert!(o.overlapped_us > 0.0, "{o:?}");
    assert!(o.overlapped_us <= o.early_backward_us);
    assert!(o.fraction > 0.0 && o.fraction <= 1.0);
    // within a stream the simulator runs launches one after another: busy = its sum
    for (b, s) in o.steps[0].streams.iter().zip(&busy) {
        assert!(
            (b.busy_us - s * 1e6).abs() < 1e-6 * (1.0 + b.busy_us),
            "{b:?} vs {s}"
        );
    }
    check_chrome(&erase);
    let svg = erase.to_svg(0, "erase");
    check_xml(&svg);
    assert_eq!(svg.matches("class=\"lane\"").count(), streams);
    let (w, h, ..) = check_png(&erase.to_png(0, 800, 240));
    assert_eq!((w, h), (800, 240));

    let (detached, streams, _) = predicted(Variant::Detached);
    assert_eq!(streams, 1);
    let o = detached.overlap();
    assert_eq!(o.overlapped_us, 0.0);
    assert_eq!(o.early_backward_us, 0.0);
    assert_eq!(o.fraction, 0.0);
    let svg = detached.to_svg(0, "detached");
    check_xml(&svg);
    assert_eq!(svg.matches("class=\"lane\"").count(), 1);
    check_chrome(&detached);
}

/// The per-kernel table over a trace: every kernel once, the longest first, and the time
/// per op adding up to the kernels' total.
#[test]
fn kernel_table_accounts_for_every_kernel_of_the_trace() {
    let (p, _, _, t) = simulated(Variant::Erase);
    let (rows, span) = erase::profile::kernel_rows(&p.program, &p.model.graph, &t);
    assert_eq!(rows.len(), t.events.len(), "one row per kernel launch");
    let longest = t.events.iter().map(|e| e.duration_us()).fold(0.0, f64::max);
    assert!(
        (rows[0].us - longest).abs() < 1e-9,
        "{} vs {longest}",
        rows[0].us
    );
    assert!(rows.windows(2).all(|w| w[0].us >= w[1].us), "longest first");
    let total: f64 = t.events.iter().map(|e| e.duration_us()).sum();
    let sum: f64 = rows.iter().map(|r| r.us).sum();
    assert!((sum - total).abs() < 1e-6 * total.max(1.0));
    let (lo, hi) = t.step_bounds(0);
    assert!((span - (hi - lo)).abs() < 1e-9);
    let table = erase::profile::render(&p.program, &p.model.graph, &t, &DeviceModel::h200(), 5);
    assert_eq!(
        table.lines().filter(|l| l.contains(" '")).count(),
        5,
        "{table}"
    );
    assert!(
        table.contains("by op:") && table.contains("linear"),
        "{table}"
    );
}

/// A serial variant's trace fed back to the simulator: its kernel times written as JSON and
/// read again predict the same steps, its own and `erase`'s (the round trip of
/// `plan --measured`; a serial trace's times are the kernels' times alone). A launch that
/// `erase` plans with other kernels or another grid than the trace's (fewer split-K
/// splits, a GEMM tile) takes the model's time, not the trace's.
#[test]
fn measured_times_from_a_trace_file_reproduce_the_simulation() {
    let (det, sim_cfg, _, mut t) = simulated(Variant::Detached);
    let (erase, ..) = simulated(Variant::Erase);
    // the simulated times stand in for a GPU's (load_measured refuses a trace that says
    // it is predicted)
    t.source = "measured (CUDA events)".into();
    let dir = common::TempDir::new("measured");
    let path = dir.join("trace.json");
    std::fs::write(&path, t.to_chrome_json()).unwrap();
    let m = erase::profile::load_measured(&path).unwrap();
    let signature = |p: &StepPlan, l: &erase::runtime::program::schedule::Launch| {
        l.spec.as_ref().map(|s| {
            (
                p.model.graph.node(l.node).name.clone(),
                erase::runtime::trace::launch_signature(s),
            )
        })
    };
    let traced: std::collections::BTreeSet<_> = det
        .program
        .launches
        .iter()
        .filter_map(|l| signature(&det, l))
        .collect();
    for p in [&det, &erase] {
        let (work, found) =
            erase::profile::measured_work(&p.program, &p.model.graph, &m, &sim_cfg.device);
        let same = p
            .program
            .launches
            .iter()
            .filter_map(|l| signature(p, l))
            .filter(|s| traced.contains(s))
            .count();
        assert_eq!(
            found, same,
            "every launch the trace has, found by node and kernel"
        );
        let kernels = p
            .program
            .launches
            .iter()
            .filter(|l| l.spec.is_some())
            .count();
        if std::ptr::eq(p, &det) {
            assert_eq!(found, kernels, "the traced program: every launch");
        } else {
            // the weight gradients' splits under ERASE's bounds are not the serial trace's
            assert!(0 < found && found < kernels, "erase: {found} of {kernels}");
        }
        let want = simulate(&p.program, &sim_cfg).step_s;
        let got =
            erase::runtime::program::simulate::simulate_with(&p.program, &sim_cfg, &work).step_s;
        assert!((got - want).abs() < 1e-9 + 1e-6 * want, "{got} vs {want}");
    }
    // a file that is not a trace is refused with a reason
    std::fs::write(&path, "{\"x\": 1}").unwrap();
    let e = erase::profile::load_measured(&path)
        .unwrap_err()
        .to_string();
    assert!(e.contains("traceEvents"), "{e}");
}

/// `erase-ctr plan ARGS`'s output; fails the test if the command does.
fn plan_output(args: &[&str]) -> String {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_erase-ctr"))
        .arg("plan")
        .args(args)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

/// `plan --sweep-side-streams`: every count predicted, the fastest named.
#[test]
fn plan_sweeps_side_streams_and_names_the_fastest() {
    let text = plan_output(&["--preset", "small", "--sweep-side-streams", "3"]);
    for k in 1..=3 {
        assert!(text.contains(&format!("  {k} side stream(s):")), "{text}");
    }
    assert!(text.contains("fastest:"), "{text}");
}

/// `plan --update-join`: the join before the updates only where asked for.
#[test]
fn plan_joins_before_the_updates_only_with_update_join_on() {
    let run = |join: &str| plan_output(&["--preset", "small", "--full", "--update-join", join]);
    let (on, off) = (run("on"), run("off"));
    assert!(on.contains("join: optim"), "{on}");
    assert!(!off.contains("join: "), "{off}");
    // off: the tables' row-wise update waits for their gradient on a side stream
    assert!(
        off.lines()
            .any(|l| l.contains(" side") && l.contains("optim rowwise_adagrad")),
        "{off}"
    );
}

/// `plan --kernels`: the launches are priced at the rates the step is predicted with, so
/// the serial baseline's launches add up to its predicted step (one stream, no host time).
#[test]
fn plan_lists_launches_at_the_rates_of_its_prediction() {
    for rates in ["measured", "peak"] {
        let text = plan_output(&[
            "--preset",
            "small",
            "--variant",
            "baseline",
            "--kernels",
            "1000",
            "--rates",
            rates,
        ]);
        let number_before = |line: &str, unit: &str| -> f64 {
            let head = &line[..line.find(unit).unwrap()];
            head.split_whitespace().last().unwrap().parse().unwrap()
        };
        let listed = text
            .lines()
            .find(|l| l.starts_with("longest launches predicted"))
            .map(|l| number_before(l, " µs:"))
            .unwrap_or_else(|| panic!("no launch list:\n{text}"));
        let step = text
            .lines()
            .find(|l| l.trim_start().starts_with("baseline ") && l.contains(" ex/s"))
            .map(|l| number_before(l, " µs "))
            .unwrap_or_else(|| panic!("no baseline prediction:\n{text}"));
        assert!(
            (listed - step).abs() <= 0.1 + 1e-3 * step,
            "{rates}: the launches add up to {listed} µs, the step is predicted at {step} µs\n{text}"
        );
    }
}

/// The critical path of a predicted step (`simulate::critical_path`): a chain of
/// dependencies (each launch after the one before it on its stream, or after a launch
/// whose event it waits for) from the step's start to its end, each starting as the one
/// before ends, so that with no host time its launches cover the step exactly; and
/// `plan` prints it.
#[test]
fn the_critical_path_runs_the_step_end_to_end() {
    for variant in [Variant::Baseline, Variant::Erase] {
        let (p, _, sim, _) = simulated(variant);
        let path = erase::runtime::program::simulate::critical_path(&p.program, &sim);
        assert!(!path.is_empty(), "{variant}");
        let l = |i: usize| sim.launches[i];
        assert!(
            l(path[0]).start.abs() < 1e-12,
            "{variant}: starts at the step's start"
        );
        let last = *path.last().unwrap();
        assert!(
            (l(last).end - sim.step_s).abs() < 1e-12,
            "{variant}: ends at its end"
        );
        let recorder = p.program.recorders();
        for w in path.windows(2) {
            let (a, b) = (w[0], w[1]);
            let (la, lb) = (&p.program.launches[a], &p.program.launches[b]);
            let same_stream = la.stream == lb.stream
                && p.program.stream_queues()[la.stream.0 as usize]
                    .windows(2)
                    .any(|q| q == [a, b]);
            let waited = lb.waits.iter().any(|x| recorder.get(&x.event) == Some(&a));
            assert!(same_stream || waited, "{variant}: {b} does not follow {a}");
            assert!(
                (l(b).start - l(a).end).abs() < 1e-12,
                "{variant}: a gap at {b}"
            );
        }
        let covered: f64 = path.iter().map(|&i| l(i).end - l(i).start).sum();
        assert!(
            (covered - sim.step_s).abs() < 1e-9 * sim.step_s,
            "{variant}"
        );
        if variant == Variant::Baseline {
            // one stream: every launch of the serial step is on it
            let kernels = p.program.launches.len();
            assert_eq!(path.len(), kernels, "{variant}");
        }
    }
    let text = plan_output(&["--preset", "small"]);
    let line = text
        .lines()
        .find(|l| l.starts_with("critical path (erase): "))
        .unwrap_or_else(|| panic!("no critical path:\n{text}"));
    assert!(
        line.contains(" launches, ") && line.ends_with(" µs"),
        "{line}"
    );
}
