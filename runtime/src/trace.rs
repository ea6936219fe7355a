//! Traces of training steps, to *see* the overlap: which kernel ran on which stream and
//! when, either predicted by the simulator ([`Trace::from_simulation`]) or measured on a
//! device ([`Trace::push_step`] with the times CUDA events gave).
//!
//! A trace is written as
//! - Chrome / Perfetto trace-event JSON ([`Trace::to_chrome_json`]): open it in
//!   `ui.perfetto.dev` or `chrome://tracing`, one track per stream;
//! - an SVG timeline in the style of the ERASE paper's Figure 2 ([`Trace::to_svg`]): one
//!   lane per stream, kernels as boxes coloured by block, forward solid, backward light
//!   and outlined, optimizer grey;
//! - the same picture as a PNG, without text ([`Trace::to_png`]).
//!
//! and summarised by [`Trace::overlap`]: how much of the early backward work ran while
//! forward work ran on another stream.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::Write as _;

use crate::program::schedule::StepProgram;
use crate::program::simulate::SimResult;
use erase_graph::Graph;

/// One traced step's times, in seconds from the start of the traced window.
#[derive(Clone, Debug, Default)]
pub struct MeasuredStep {
    /// Per launch of the program: (start, end); NaN for launches that issue no kernel.
    pub launches: Vec<(f64, f64)>,
    /// `(what, start, end)` of the copies: `h2d batch` on the copy stream and
    /// `d2d inputs` on the main stream.
    pub copies: Vec<(&'static str, f64, f64)>,
}

/// What an event is on the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TraceKind {
    /// A kernel. Every launch of a step program is one, data-movement ops included.
    Kernel,
    /// A memory copy (`cudaMemcpy*`, e.g. feeding a batch), in measured traces.
    Copy,
}

impl TraceKind {
    pub fn as_str(self) -> &'static str {
        match self {
            TraceKind::Kernel => "kernel",
            TraceKind::Copy => "copy",
        }
    }
}

/// One kernel (or copy) of one step, with its times in µs.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceEvent {
    /// The launch's label, e.g. `bwd:cross linear_grad_weight` or `optim adagrad`.
    pub name: String,
    /// The block: a forward scope (`cross`, `cross_head`), a backward program (`cross`,
    /// `remainder`) or `optim`.
    pub block: String,
    /// `fwd`, `bwd` or `optim`.
    pub phase: String,
    /// The op, e.g. `linear_grad_weight`.
    pub op: String,
    /// The graph node, e.g. `cross/linear0.dw` (may be empty).
    pub node: String,
    /// The launch's main kernel and grid as the program planned them
    /// ([`launch_signature`]; empty for a copy): a node's kernels can differ between
    /// programs (a serial program's GEMM tiles and splits are not ERASE's).
    pub launch: String,
    pub stream: u16,
    pub step: usize,
    pub start_us: f64,
    pub end_us: f64,
    pub kind: TraceKind,
}

impl TraceEvent {
    pub fn duration_us(&self) -> f64 {
        (self.end_us - self.start_us).max(0.0)
    }
}

/// Events of one or more steps on named streams.
#[derive(Clone, Debug, PartialEq)]
pub struct Trace {
    pub events: Vec<TraceEvent>,
    /// Per stream id: its name (`main`, `side1`, ...).
    pub stream_names: Vec<String>,
    /// Where the times come from: `predicted (simulator)` or `measured (CUDA events)`.
    pub source: String,
}

/// Busy time of one stream in one step.
#[derive(Clone, Debug, PartialEq)]
pub struct StreamBusy {
    pub stream: u16,
    pub name: String,
    /// Length of the union of the stream's event intervals (not their sum).
    pub busy_us: f64,
    /// `busy_us / span_us` of the step (0 when the span is 0).
    pub busy_fraction: f64,
}

/// The overlap figures of one step (see [`Trace::overlap`] for the definitions).
#[derive(Clone, Debug, PartialEq)]
pub struct StepOverlap {
    pub step: usize,
    /// From the step's first event start to its last event end.
    pub span_us: f64,
    pub early_backward_us: f64,
    pub overlapped_us: f64,
    /// `overlapped_us / early_backward_us`, 0 when there is no early backward work.
    pub fraction: f64,
    /// One per stream of the trace, in stream order.
    pub streams: Vec<StreamBusy>,
}

/// The overlap figures of a trace: per step, and summed over its steps.
#[derive(Clone, Debug, PartialEq)]
pub struct Overlap {
    pub steps: Vec<StepOverlap>,
    /// Sum over the steps.
    pub early_backward_us: f64,
    /// Sum over the steps.
    pub overlapped_us: f64,
    /// `overlapped_us / early_backward_us` of the sums, 0 when there is no early work.
    pub fraction: f64,
}

/// Sorts and merges intervals into disjoint ones; empty intervals are dropped.
fn union(mut iv: Vec<(f64, f64)>) -> Vec<(f64, f64)> {
    iv.retain(|&(a, b)| b > a);
    iv.sort_by(|x, y| x.0.total_cmp(&y.0).then(x.1.total_cmp(&y.1)));
    let mut out: Vec<(f64, f64)> = Vec::with_capacity(iv.len());
    for (a, b) in iv {
        match out.last_mut() {
            Some(last) if a <= last.1 => last.1 = last.1.max(b),
            _ => out.push((a, b)),
        }
    }
    out
}

fn total(iv: &[(f64, f64)]) -> f64 {
    // folded from +0.0: no interval is 0, not the -0.0 an f64 sum starts at
    iv.iter().fold(0.0, |s, &(a, b)| s + (b - a))
}

/// Length of `[a, b)` covered by the disjoint, sorted intervals `iv`.
fn covered(iv: &[(f64, f64)], a: f64, b: f64) -> f64 {
    iv.iter()
        .map(|&(x, y)| (y.min(b) - x.max(a)).max(0.0))
        .fold(0.0, |s, c| s + c)
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        0.0
    }
}

/// A launch's main kernel and its grid, `kernel/ctas` (e.g. `gemm_bf16t_128x64/128`): what
/// a measured time of the launch holds for.
pub fn launch_signature(spec: &erase_ops::LaunchSpec) -> String {
    format!("{}/{}", spec.kernel, spec.grid)
}

/// The name a stream id gets in a step program (`main`, `side1`, ...).
pub fn stream_name(s: u16) -> String {
    crate::program::schedule::StreamId(s).to_string()
}

impl Trace {
    /// An empty trace with the streams of `prog`.
    pub fn new(prog: &StepProgram, source: &str) -> Trace {
        Trace {
            events: Vec::new(),
            stream_names: (0..prog.streams).map(|s| stream_name(s as u16)).collect(),
            source: source.to_string(),
        }
    }

    /// Adds one step of `prog`: `times[i]` is (start, end) of launch `i` in seconds.
    /// Launches without a kernel (free ops such as reshape) are left out.
    pub fn push_step(&mut self, prog: &StepProgram, g: &Graph, step: usize, times: &[(f64, f64)]) {
        for (l, &(start, end)) in prog.launches.iter().zip(times) {
            let Some(spec) = &l.spec else { continue };
            if !start.is_finite() || !end.is_finite() {
                continue;
            }
            self.events.push(TraceEvent {
                name: l.label.to_string(),
                block: l.label.block.clone(),
                phase: l.label.phase.to_string(),
                op: l.label.op.clone(),
                node: g.node(l.node).name.clone(),
                launch: launch_signature(spec),
                stream: l.stream.0,
                step,
                start_us: start * 1e6,
                end_us: end * 1e6,
                kind: TraceKind::Kernel,
            });
        }
    }

    /// Adds one measured step of `prog` (see `cuda::trace`): its launches, and its batch
    /// copies (the copy to the device on a `copy` lane after the program's streams).
    pub fn push_measured(&mut self, prog: &StepProgram, g: &Graph, step: usize, m: &MeasuredStep) {
        self.push_step(prog, g, step, &m.launches);
        for &(what, start, end) in &m.copies {
            let stream = if what.starts_with("h2d") {
                let s = prog.streams as u16;
                if self.stream_names.len() <= s as usize {
                    self.stream_names.resize(s as usize, String::new());
                    self.stream_names.push("copy".into());
                }
                s
            } else {
                0
            };
            self.events.push(TraceEvent {
                name: format!("copy {what}"),
                block: "data".into(),
                phase: "copy".into(),
                op: what.into(),
                node: String::new(),
                launch: String::new(),
                stream,
                step,
                start_us: start * 1e6,
                end_us: end * 1e6,
                kind: TraceKind::Copy,
            });
        }
    }

    /// The simulator's prediction of one step (step 0) of `prog`.
    pub fn from_simulation(prog: &StepProgram, sim: &SimResult, g: &Graph) -> Trace {
        let mut t = Trace::new(prog, "predicted (simulator)");
        let times: Vec<(f64, f64)> = sim.launches.iter().map(|l| (l.start, l.end)).collect();
        t.push_step(prog, g, 0, &times);
        t
    }

    /// Streams drawn: every named stream, and any stream an event uses beyond them.
    pub fn stream_count(&self) -> usize {
        let used = self.events.iter().map(|e| e.stream as usize + 1).max();
        self.stream_names.len().max(used.unwrap_or(0))
    }

    /// The name of stream `s` (`stream<s>` when the trace has none).
    pub fn stream_label(&self, s: usize) -> String {
        self.stream_names
            .get(s)
            .cloned()
            .unwrap_or_else(|| format!("stream{s}"))
    }

    /// The steps the trace holds, ascending.
    pub fn steps(&self) -> Vec<usize> {
        let mut s: Vec<usize> = self.events.iter().map(|e| e.step).collect();
        s.sort_unstable();
        s.dedup();
        s
    }

    fn step_events(&self, step: usize) -> impl Iterator<Item = &TraceEvent> + '_ {
        self.events.iter().filter(move |e| e.step == step)
    }

    /// (first start, last end) of a step's events; (0, 0) when it has none.
    pub fn step_bounds(&self, step: usize) -> (f64, f64) {
        let mut lo = f64::INFINITY;
        let mut hi = f64::NEG_INFINITY;
        for e in self.step_events(step) {
            lo = lo.min(e.start_us);
            hi = hi.max(e.end_us);
        }
        if lo.is_finite() {
            (lo, hi.max(lo))
        } else {
            (0.0, 0.0)
        }
    }

    /// The overlap figures, per step and summed. Definitions, per step:
    ///
    /// - *early backward* events: events of phase `bwd` that are **not** on the main
    ///   stream (stream 0); under ERASE these are the early backward programs, the
    ///   remainder backward runs on main. `early_backward_us` is the **sum** of their
    ///   durations (two early events running at once on two side streams both count).
    /// - `overlapped_us`: for each early backward event `b`, the length of the part of
    ///   `[b.start, b.end)` during which at least one `fwd` event on a stream other than
    ///   `b`'s was running (the union of those forward intervals, so an interval under
    ///   several forward events counts once), summed over the early events. Hence
    ///   `0 <= overlapped_us <= early_backward_us`.
    /// - `fraction = overlapped_us / early_backward_us` (0 when there is no early work).
    /// - `span_us`: from the step's first event start to its last event end.
    /// - per stream `busy_us`: the length of the union of that stream's event intervals
    ///   (gaps are not busy, nested or overlapping events count once);
    ///   `busy_fraction = busy_us / span_us`.
    ///
    /// Over the whole trace, `early_backward_us` and `overlapped_us` are the sums over
    /// the steps and `fraction` the ratio of the sums.
    pub fn overlap(&self) -> Overlap {
        let streams = self.stream_count();
        let steps: Vec<StepOverlap> = self
            .steps()
            .into_iter()
            .map(|s| self.overlap_of(s, streams))
            .collect();
        let early: f64 = steps.iter().map(|s| s.early_backward_us).sum();
        let over: f64 = steps.iter().map(|s| s.overlapped_us).sum();
        Overlap {
            steps,
            early_backward_us: early,
            overlapped_us: over,
            fraction: ratio(over, early),
        }
    }

    /// The overlap figures of one step (as in [`Trace::overlap`]).
    pub fn overlap_step(&self, step: usize) -> StepOverlap {
        self.overlap_of(step, self.stream_count())
    }

    fn overlap_of(&self, step: usize, streams: usize) -> StepOverlap {
        let (lo, hi) = self.step_bounds(step);
        let span = hi - lo;
        // forward intervals of every stream other than s, merged, per stream s
        let fwd_not_on: Vec<Vec<(f64, f64)>> = (0..streams)
            .map(|s| {
                union(
                    self.step_events(step)
                        .filter(|e| e.phase == "fwd" && e.stream as usize != s)
                        .map(|e| (e.start_us, e.end_us))
                        .collect(),
                )
            })
            .collect();
        let mut early = 0.0;
        let mut over = 0.0;
        for e in self.step_events(step) {
            if e.phase == "bwd" && e.stream != 0 {
                early += e.duration_us();
                over += covered(&fwd_not_on[e.stream as usize], e.start_us, e.end_us);
            }
        }
        let streams = (0..streams)
            .map(|s| {
                let busy = total(&union(
                    self.step_events(step)
                        .filter(|e| e.stream as usize == s)
                        .map(|e| (e.start_us, e.end_us))
                        .collect(),
                ));
                StreamBusy {
                    stream: s as u16,
                    name: self.stream_label(s),
                    busy_us: busy,
                    busy_fraction: ratio(busy, span),
                }
            })
            .collect();
        StepOverlap {
            step,
            span_us: span,
            early_backward_us: early,
            overlapped_us: over,
            fraction: ratio(over, early),
            streams,
        }
    }

    /// Chrome / Perfetto trace-event JSON: one complete (`"ph": "X"`) event per trace
    /// event (`ts` and `dur` in µs, `tid` = stream, `cat` = phase), plus metadata naming
    /// the process and each stream's thread.
    pub fn to_chrome_json(&self) -> String {
        use serde_json::{json, Value};
        const PID: u32 = 1;
        let mut ev: Vec<Value> =
            Vec::with_capacity(self.events.len() + 2 * self.stream_count() + 1);
        ev.push(json!({
            "ph": "M", "name": "process_name", "pid": PID, "tid": 0,
            "args": {"name": format!("erase step: {}", self.source)},
        }));
        for s in 0..self.stream_count() {
            ev.push(json!({
                "ph": "M", "name": "thread_name", "pid": PID, "tid": s,
                "args": {"name": self.stream_label(s)},
            }));
            ev.push(json!({
                "ph": "M", "name": "thread_sort_index", "pid": PID, "tid": s,
                "args": {"sort_index": s},
            }));
        }
        for e in &self.events {
            ev.push(json!({
                "ph": "X",
                "name": e.name,
                "cat": e.phase,
                "pid": PID,
                "tid": e.stream,
                "ts": e.start_us,
                "dur": e.duration_us(),
                "args": {
                    "block": e.block,
                    "phase": e.phase,
                    "step": e.step,
                    "op": e.op,
                    "node": e.node,
                    "launch": e.launch,
                    "kind": e.kind.as_str(),
                },
            }));
        }
        let doc = json!({
            "traceEvents": ev,
            "displayTimeUnit": "ms",
            "otherData": {"source": self.source},
        });
        serde_json::to_string(&doc).expect("a JSON value always serializes")
    }

    /// The blocks of the trace in order of first appearance (by step, then start time),
    /// each with its palette colour. A block's `_head` scope (its auxiliary loss) shares
    /// the block's colour; `optim` work is grey and not listed.
    pub fn block_colours(&self) -> Vec<(String, [u8; 3])> {
        let mut order: Vec<&TraceEvent> =
            self.events.iter().filter(|e| e.phase != "optim").collect();
        order.sort_by(|a, b| {
            a.step
                .cmp(&b.step)
                .then(a.start_us.total_cmp(&b.start_us))
                .then(a.stream.cmp(&b.stream))
        });
        let mut out: Vec<(String, [u8; 3])> = Vec::new();
        for e in order {
            let key = colour_key(&e.block);
            if !out.iter().any(|(k, _)| k == key) {
                let c = PALETTE[out.len() % PALETTE.len()];
                out.push((key.to_string(), c));
            }
        }
        out
    }

    /// The boxes of one step's picture in the given frame.
    fn bars(&self, step: usize, f: &Frame) -> Vec<Bar> {
        let colours: BTreeMap<String, [u8; 3]> = self.block_colours().into_iter().collect();
        let mut bars = Vec::new();
        for (i, e) in self.events.iter().enumerate() {
            if e.step != step {
                continue;
            }
            let (x0, x1) = (f.x(e.start_us), f.x(e.end_us));
            let (y, h) = f.lane(e.stream as usize);
            let base = colours
                .get(colour_key(&e.block))
                .copied()
                .unwrap_or(OPTIM_GREY);
            let (fill, stroke) = match e.phase.as_str() {
                "optim" => (OPTIM_GREY, None),
                "bwd" => (lighten(base, 0.55), Some(base)),
                _ => (base, None),
            };
            bars.push(Bar {
                event: i,
                x: x0,
                w: (x1 - x0).max(f.min_w),
                y: y + f.pad,
                h: h - 2.0 * f.pad,
                fill,
                stroke,
            });
        }
        bars
    }

    /// An SVG timeline of one step, in the style of the ERASE paper's Figure 2: a lane
    /// per stream (each a `<g class="lane">`), kernels as boxes placed by time and
    /// coloured by block (forward solid, backward light with the block's colour as
    /// outline, optimizer grey), a time axis, and a legend of the blocks.
    pub fn to_svg(&self, step: usize, title: &str) -> String {
        let streams = self.stream_count().max(1);
        let (lo, hi) = self.step_bounds(step);
        let width = 1200.0;
        let top = 62.0;
        let lane_h = 34.0;
        let gap = 6.0;
        let f = Frame {
            x0: 90.0,
            x1: width - 24.0,
            t0: lo,
            t1: if hi > lo { hi } else { lo + 1.0 },
            top,
            lane_h,
            gap,
            pad: 3.0,
            min_w: 0.6,
        };
        let lanes_bottom = top + streams as f64 * (lane_h + gap) - gap;
        let axis_y = lanes_bottom + 8.0;
        let colours = self.block_colours();
        let legend_y = axis_y + 54.0;
        let per_row = 9usize;
        let legend_rows = colours.len().div_ceil(per_row).max(1) + 1;
        let height = legend_y + legend_rows as f64 * 20.0 + 10.0;
        let ov = self.overlap_step(step);

        let mut s = String::new();
        let _ = writeln!(
            s,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height:.0}" viewBox="0 0 {width} {height:.0}" font-family="Helvetica, Arial, sans-serif" font-size="12">"#
        );
        let _ = writeln!(
            s,
            r##"<rect class="background" x="0" y="0" width="{width}" height="{height:.0}" fill="#ffffff"/>"##
        );
        let _ = writeln!(
            s,
            r#"<text x="12" y="22" font-size="16" font-weight="bold">{}</text>"#,
            esc(title)
        );
        let mut sub = format!(
            "{} · step {step} · {} · {} stream(s)",
            self.source,
            fmt_duration(hi - lo),
            streams
        );
        if ov.early_backward_us > 0.0 {
            let _ = write!(
                sub,
                " · early backward {} of which {:.0} % under forward work",
                fmt_duration(ov.early_backward_us),
                100.0 * ov.fraction
            );
        }
        let _ = writeln!(
            s,
            r##"<text x="12" y="42" fill="#444444">{}</text>"##,
            esc(&sub)
        );

        // lanes with their kernels
        let bars = self.bars(step, &f);
        for st in 0..streams {
            let (y, h) = f.lane(st);
            let busy = ov.streams.get(st).map_or(0.0, |b| b.busy_fraction);
            let _ = writeln!(s, r#"<g class="lane" data-stream="{st}">"#);
            let _ = writeln!(
                s,
                r##"<rect class="lane-bg" x="{:.2}" y="{y:.2}" width="{:.2}" height="{h:.2}" fill="#f3f3f3"/>"##,
                f.x0,
                f.x1 - f.x0
            );
            let _ = writeln!(
                s,
                r#"<text x="12" y="{:.2}" font-weight="bold">{}</text>"#,
                y + h / 2.0 - 1.0,
                esc(&self.stream_label(st))
            );
            let _ = writeln!(
                s,
                r##"<text x="12" y="{:.2}" font-size="10" fill="#666666">busy {:.0} %</text>"##,
                y + h / 2.0 + 11.0,
                100.0 * busy
            );
            for b in bars
                .iter()
                .filter(|b| self.events[b.event].stream as usize == st)
            {
                let e = &self.events[b.event];
                let stroke = match b.stroke {
                    Some(c) => format!(r#" stroke="{}" stroke-width="0.8""#, hex(c)),
                    None => String::new(),
                };
                let _ = writeln!(
                    s,
                    r#"<rect class="kernel {}" x="{:.3}" y="{:.2}" width="{:.3}" height="{:.2}" fill="{}"{stroke}><title>{} [{}] {:.1}–{:.1} µs</title></rect>"#,
                    esc(&e.phase),
                    b.x,
                    b.y,
                    b.w,
                    b.h,
                    hex(b.fill),
                    esc(&e.name),
                    esc(&e.node),
                    e.start_us - lo,
                    e.end_us - lo
                );
            }
            let _ = writeln!(s, "</g>");
        }

        // time axis
        let _ = writeln!(s, r#"<g class="axis">"#);
        let _ = writeln!(
            s,
            r##"<line x1="{:.2}" y1="{axis_y:.2}" x2="{:.2}" y2="{axis_y:.2}" stroke="#333333"/>"##,
            f.x0, f.x1
        );
        let span = f.t1 - f.t0;
        let (tick, ms) = ticks(span);
        let mut k = 0;
        loop {
            let t = k as f64 * tick;
            if t > span * (1.0 + 1e-9) {
                break;
            }
            let x = f.x(f.t0 + t);
            let _ = writeln!(
                s,
                r##"<line x1="{x:.2}" y1="{axis_y:.2}" x2="{x:.2}" y2="{:.2}" stroke="#333333"/>"##,
                axis_y + 5.0
            );
            let _ = writeln!(
                s,
                r#"<text x="{x:.2}" y="{:.2}" text-anchor="middle" font-size="10">{}</text>"#,
                axis_y + 17.0,
                fmt_tick(t, ms)
            );
            k += 1;
        }
        let _ = writeln!(
            s,
            r#"<text x="{:.2}" y="{:.2}" text-anchor="end" font-size="11">time since step start ({})</text>"#,
            f.x1,
            axis_y + 32.0,
            if ms { "ms" } else { "µs" }
        );
        let _ = writeln!(s, "</g>");

        // legend: blocks, then the phases
        let _ = writeln!(s, r#"<g class="legend">"#);
        for (i, (name, c)) in colours.iter().enumerate() {
            let x = 12.0 + (i % per_row) as f64 * 128.0;
            let y = legend_y + (i / per_row) as f64 * 20.0;
            let _ = writeln!(
                s,
                r#"<rect x="{x:.1}" y="{:.1}" width="14" height="12" fill="{}"/><text x="{:.1}" y="{:.1}">{}</text>"#,
                y - 10.0,
                hex(*c),
                x + 19.0,
                y,
                esc(name)
            );
        }
        let y = legend_y + colours.len().div_ceil(per_row).max(1) as f64 * 20.0;
        let demo = PALETTE[0];
        let _ = writeln!(
            s,
            r#"<rect x="12" y="{:.1}" width="14" height="12" fill="{}"/><text x="31" y="{y:.1}">forward</text>"#,
            y - 10.0,
            hex(demo)
        );
        let _ = writeln!(
            s,
            r#"<rect x="152" y="{:.1}" width="14" height="12" fill="{}" stroke="{}" stroke-width="0.8"/><text x="171" y="{y:.1}">backward (light, outlined)</text>"#,
            y - 10.0,
            hex(lighten(demo, 0.55)),
            hex(demo)
        );
        let _ = writeln!(
            s,
            r#"<rect x="372" y="{:.1}" width="14" height="12" fill="{}"/><text x="391" y="{y:.1}">optimizer</text>"#,
            y - 10.0,
            hex(OPTIM_GREY)
        );
        let _ = writeln!(s, "</g>");
        let _ = writeln!(s, "</svg>");
        s
    }

    /// The picture of [`Trace::to_svg`] as a `width` x `height` RGB PNG, without text:
    /// lanes (a darker strip at the left marks each), kernels as boxes, and tick marks of
    /// the time axis at the bottom.
    pub fn to_png(&self, step: usize, width: u32, height: u32) -> Vec<u8> {
        let (w, h) = (width.max(1), height.max(1));
        let mut img = Canvas::new(w, h, [255, 255, 255]);
        let streams = self.stream_count().max(1);
        let (lo, hi) = self.step_bounds(step);
        let (wf, hf) = (f64::from(w), f64::from(h));
        let axis_h = (hf * 0.08).clamp(4.0, 24.0);
        let top = (hf * 0.03).min(8.0);
        let gap = (hf * 0.015).min(6.0);
        let lane_h = ((hf - top - axis_h - gap * (streams as f64 - 1.0)) / streams as f64).max(1.0);
        let f = Frame {
            x0: (wf * 0.04).min(40.0),
            x1: wf - (wf * 0.01).min(10.0),
            t0: lo,
            t1: if hi > lo { hi } else { lo + 1.0 },
            top,
            lane_h,
            gap,
            pad: (lane_h * 0.08).min(3.0),
            min_w: 1.0,
        };
        for st in 0..streams {
            let (y, lh) = f.lane(st);
            img.fill(f.x0, y, f.x1 - f.x0, lh, [243, 243, 243]);
            img.fill(f.x0 * 0.25, y, f.x0 * 0.5, lh, [120, 120, 120]);
        }
        for b in self.bars(step, &f) {
            img.fill(b.x, b.y, b.w, b.h, b.fill);
            if let Some(c) = b.stroke {
                img.outline(b.x, b.y, b.w, b.h, c);
            }
        }
        let lanes_bottom = f.top + streams as f64 * (lane_h + gap) - gap;
        let axis_y = lanes_bottom + (axis_h * 0.25).max(1.0);
        img.fill(f.x0, axis_y, f.x1 - f.x0, 1.0, [51, 51, 51]);
        let span = f.t1 - f.t0;
        let (tick, _) = ticks(span);
        let mut k = 0;
        loop {
            let t = k as f64 * tick;
            if t > span * (1.0 + 1e-9) {
                break;
            }
            img.fill(
                f.x(f.t0 + t),
                axis_y,
                1.0,
                (axis_h * 0.35).max(1.0),
                [51, 51, 51],
            );
            k += 1;
        }
        img.encode_png()
    }
}

/// Where a picture's lanes and times go.
struct Frame {
    x0: f64,
    x1: f64,
    t0: f64,
    t1: f64,
    top: f64,
    lane_h: f64,
    gap: f64,
    pad: f64,
    min_w: f64,
}

impl Frame {
    fn x(&self, t_us: f64) -> f64 {
        self.x0 + (t_us - self.t0) / (self.t1 - self.t0) * (self.x1 - self.x0)
    }

    /// (top, height) of stream `s`'s lane.
    fn lane(&self, s: usize) -> (f64, f64) {
        (self.top + s as f64 * (self.lane_h + self.gap), self.lane_h)
    }
}

struct Bar {
    event: usize,
    x: f64,
    y: f64,
    w: f64,
    h: f64,
    fill: [u8; 3],
    stroke: Option<[u8; 3]>,
}

/// The fixed block palette (Tableau-like); grey is kept for the optimizer.
const PALETTE: [[u8; 3]; 12] = [
    [0x1f, 0x77, 0xb4],
    [0xff, 0x7f, 0x0e],
    [0x2c, 0xa0, 0x2c],
    [0xd6, 0x27, 0x28],
    [0x94, 0x67, 0xbd],
    [0x8c, 0x56, 0x4b],
    [0xe3, 0x77, 0xc2],
    [0x17, 0xbe, 0xcf],
    [0xbc, 0xbd, 0x22],
    [0x39, 0x3b, 0x79],
    [0xe7, 0xba, 0x52],
    [0x63, 0x79, 0x39],
];
const OPTIM_GREY: [u8; 3] = [0x8c, 0x8c, 0x8c];

fn colour_key(block: &str) -> &str {
    block.strip_suffix("_head").unwrap_or(block)
}

fn lighten(c: [u8; 3], t: f64) -> [u8; 3] {
    c.map(|v| (f64::from(v) + (255.0 - f64::from(v)) * t).round() as u8)
}

fn hex(c: [u8; 3]) -> String {
    format!("#{:02x}{:02x}{:02x}", c[0], c[1], c[2])
}

/// Escapes text for XML content and attribute values.
pub fn esc(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for ch in s.chars() {
        match ch {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&apos;"),
            // characters XML 1.0 does not allow
            c if (c as u32) < 0x20 && !matches!(c, '\t' | '\n' | '\r') => o.push('?'),
            c => o.push(c),
        }
    }
    o
}

/// A "nice" tick spacing (1, 2 or 5 x 10^k µs) giving about 10 ticks over `span_us`, and
/// whether to label in ms.
fn ticks(span_us: f64) -> (f64, bool) {
    let raw = (span_us / 10.0).max(1e-9);
    let mag = 10f64.powf(raw.log10().floor());
    let norm = raw / mag;
    let step = if norm <= 1.0 {
        1.0
    } else if norm <= 2.0 {
        2.0
    } else if norm <= 5.0 {
        5.0
    } else {
        10.0
    } * mag;
    (step, span_us >= 2000.0)
}

fn fmt_tick(t_us: f64, ms: bool) -> String {
    let v = if ms { t_us / 1000.0 } else { t_us };
    let s = format!("{v:.3}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    s.to_string()
}

fn fmt_duration(us: f64) -> String {
    if us >= 2000.0 {
        format!("{:.2} ms", us / 1000.0)
    } else {
        format!("{us:.1} µs")
    }
}

/// A tiny RGB raster with axis-aligned rectangles, and its PNG encoding.
struct Canvas {
    w: u32,
    h: u32,
    px: Vec<u8>,
}

impl Canvas {
    fn new(w: u32, h: u32, bg: [u8; 3]) -> Canvas {
        let n = w as usize * h as usize;
        let mut px = Vec::with_capacity(3 * n);
        for _ in 0..n {
            px.extend_from_slice(&bg);
        }
        Canvas { w, h, px }
    }

    /// Fills the pixels whose area the rectangle touches (so thin boxes stay visible).
    fn fill(&mut self, x: f64, y: f64, w: f64, h: f64, c: [u8; 3]) {
        let clampx = |v: f64| v.clamp(0.0, f64::from(self.w)) as usize;
        let clampy = |v: f64| v.clamp(0.0, f64::from(self.h)) as usize;
        let (xa, xb) = (clampx(x.floor()), clampx((x + w).ceil()));
        let (ya, yb) = (clampy(y.floor()), clampy((y + h).ceil()));
        for row in ya..yb {
            let base = row * self.w as usize * 3;
            for col in xa..xb {
                self.px[base + 3 * col..base + 3 * col + 3].copy_from_slice(&c);
            }
        }
    }

    fn outline(&mut self, x: f64, y: f64, w: f64, h: f64, c: [u8; 3]) {
        self.fill(x, y, w, 1.0, c);
        self.fill(x, y + h - 1.0, w, 1.0, c);
        self.fill(x, y, 1.0, h, c);
        self.fill(x + w - 1.0, y, 1.0, h, c);
    }

    fn encode_png(&self) -> Vec<u8> {
        let mut raw = Vec::with_capacity((3 * self.w as usize + 1) * self.h as usize);
        for row in self.px.chunks_exact(3 * self.w as usize) {
            raw.push(0); // filter: none
            raw.extend_from_slice(row);
        }
        let mut z = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
        z.write_all(&raw).expect("writing to a Vec cannot fail");
        let idat = z.finish().expect("writing to a Vec cannot fail");
        let mut ihdr = Vec::with_capacity(13);
        ihdr.extend_from_slice(&self.w.to_be_bytes());
        ihdr.extend_from_slice(&self.h.to_be_bytes());
        // bit depth 8, colour type 2 (RGB), deflate, adaptive filtering, no interlace
        ihdr.extend_from_slice(&[8, 2, 0, 0, 0]);
        let mut out = b"\x89PNG\r\n\x1a\n".to_vec();
        png_chunk(&mut out, b"IHDR", &ihdr);
        png_chunk(&mut out, b"IDAT", &idat);
        png_chunk(&mut out, b"IEND", &[]);
        out
    }
}

fn png_chunk(out: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) {
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    let start = out.len();
    out.extend_from_slice(kind);
    out.extend_from_slice(data);
    let crc = crc32(&out[start..]);
    out.extend_from_slice(&crc.to_be_bytes());
}

/// CRC-32 (ISO 3309, as PNG uses: reflected polynomial 0xEDB88320).
pub fn crc32(bytes: &[u8]) -> u32 {
    let mut table = [0u32; 256];
    for (n, slot) in table.iter_mut().enumerate() {
        let mut c = n as u32;
        for _ in 0..8 {
            c = if c & 1 != 0 {
                0xEDB8_8320 ^ (c >> 1)
            } else {
                c >> 1
            };
        }
        *slot = c;
    }
    let mut c = 0xFFFF_FFFFu32;
    for &b in bytes {
        c = table[((c ^ u32::from(b)) & 0xFF) as usize] ^ (c >> 8);
    }
    c ^ 0xFFFF_FFFF
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32_of_known_strings() {
        assert_eq!(crc32(b""), 0);
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
        assert_eq!(crc32(b"IEND"), 0xAE42_6082);
    }

    #[test]
    fn union_and_cover() {
        let u = union(vec![
            (5.0, 7.0),
            (0.0, 2.0),
            (1.0, 3.0),
            (3.0, 4.0),
            (8.0, 8.0),
        ]);
        assert_eq!(u, vec![(0.0, 4.0), (5.0, 7.0)]);
        assert_eq!(total(&u), 6.0);
        assert_eq!(covered(&u, 3.5, 6.0), 1.5);
    }

    #[test]
    fn nice_ticks() {
        assert_eq!(ticks(100.0), (10.0, false));
        assert_eq!(ticks(540.0), (100.0, false));
        assert_eq!(ticks(3000.0), (500.0, true));
        assert_eq!(fmt_tick(500.0, true), "0.5");
        assert_eq!(fmt_tick(20.0, false), "20");
    }
}
