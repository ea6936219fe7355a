//! Where a measured step's time goes: per launch and per op, from a measured trace, with
//! the rates each kernel reached against the device's ceilings (the speed work's guide).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use erase_graph::Graph;
use erase_runtime::program::occupancy::DeviceModel;
use erase_runtime::program::schedule::StepProgram;
use erase_runtime::trace::{Trace, TraceKind};

/// The CUDA launch plan of node `node` of `g` launched at `at` (pure data: no device
/// needed).
pub fn node_plan(
    g: &Graph,
    node: erase_graph::NodeId,
    at: erase_ops::cuda::LaunchAt,
) -> Result<erase_ops::cuda::CudaPlan, String> {
    node_plan_with(
        g,
        node,
        erase_ops::cuda::PlanOptions::from_env().at_launch(at),
    )
}

/// The CUDA launch plan of node `node` of `g` under `opts` as they are (resolved for a
/// launch already, or a lone op's).
pub fn node_plan_with(
    g: &Graph,
    node: erase_graph::NodeId,
    opts: erase_ops::cuda::PlanOptions,
) -> Result<erase_ops::cuda::CudaPlan, String> {
    let n = g.node(node);
    let ins: Vec<_> = n.inputs.iter().map(|&t| g.shape(t)).collect();
    let ind: Vec<_> = n.inputs.iter().map(|&t| g.dtype(t)).collect();
    let outs: Vec<_> = n.outputs.iter().map(|&t| g.shape(t)).collect();
    let outd: Vec<_> = n.outputs.iter().map(|&t| g.dtype(t)).collect();
    let upd: Vec<_> = n.updates.iter().map(|&t| g.shape(t)).collect();
    let o = erase_ops::cuda::Operands {
        opts,
        ins: &ins,
        in_dtypes: &ind,
        outs: &outs,
        out_dtypes: &outd,
        upd: &upd,
    };
    erase_ops::cuda::cuda_plan(&n.op, &o)
}

/// The CUDA kernels a node's launch runs, in order, joined by `+` (e.g.
/// `gemm_to_bf16_pair+gemm_bf16p_128x128+gemm_splitk_reduce`), launched at `at`.
pub fn kernels_of(g: &Graph, node: erase_graph::NodeId, at: erase_ops::cuda::LaunchAt) -> String {
    match node_plan(g, node, at) {
        Ok(p) => p
            .calls
            .iter()
            .map(|c| c.kernel)
            .collect::<Vec<_>>()
            .join("+"),
        Err(_) => String::new(),
    }
}

/// One launch's mean over the traced steps.
#[derive(Clone, Debug)]
pub struct KernelRow {
    pub launch: usize,
    pub label: String,
    /// The kernels the launch runs, joined by `+`.
    pub kernel: String,
    pub stream: u16,
    pub us: f64,
    pub flops: f64,
    pub bytes: f64,
    pub tensor_core: bool,
}

/// Per-launch means over the steps of `trace` (kernels only), longest first, and the mean
/// step span in µs.
pub fn kernel_rows(prog: &StepProgram, g: &Graph, trace: &Trace) -> (Vec<KernelRow>, f64) {
    let steps = trace.steps();
    let n = steps.len().max(1) as f64;
    let span: f64 = steps
        .iter()
        .map(|&s| {
            let (a, b) = trace.step_bounds(s);
            b - a
        })
        .sum::<f64>()
        / n;
    // each launch is one graph node: events find their launch by the node's name
    let real: Vec<usize> = (0..prog.launches.len())
        .filter(|&i| prog.launches[i].spec.is_some())
        .collect();
    let by_node: BTreeMap<&str, usize> = real
        .iter()
        .map(|&i| (g.node(prog.launches[i].node).name.as_str(), i))
        .collect();
    let mut us = vec![0.0; prog.launches.len()];
    let mut seen = vec![false; prog.launches.len()];
    for e in trace.events.iter().filter(|e| e.kind == TraceKind::Kernel) {
        if let Some(&i) = by_node.get(e.node.as_str()) {
            us[i] += e.duration_us() / n;
            seen[i] = true;
        }
    }
    let real: Vec<usize> = real.into_iter().filter(|&i| seen[i]).collect();
    let mut rows: Vec<KernelRow> = real
        .iter()
        .filter_map(|&i| {
            let l = &prog.launches[i];
            let s = l.spec.as_ref()?;
            Some(KernelRow {
                launch: i,
                label: format!("{} '{}'", l.label, g.node(l.node).name),
                kernel: {
                    let k = kernels_of(g, l.node, prog.launch_at(g, l));
                    if k.is_empty() {
                        s.kernel.to_string()
                    } else {
                        k
                    }
                },
                stream: l.stream.0,
                us: us[i],
                flops: s.flops,
                bytes: s.bytes,
                tensor_core: s.tensor_core,
            })
        })
        .collect();
    rows.sort_by(|a, b| b.us.total_cmp(&a.us));
    (rows, span)
}

/// The table people read: the `top` longest launches, then the time per op (summed over
/// launches), against `dev`'s ceilings (tensor-core or FP32 FLOP/s, memory bandwidth).
pub fn render(
    prog: &StepProgram,
    g: &Graph,
    trace: &Trace,
    dev: &DeviceModel,
    top: usize,
) -> String {
    let (rows, span) = kernel_rows(prog, g, trace);
    let total: f64 = rows.iter().map(|r| r.us).sum();
    let mut s = String::new();
    let _ = writeln!(
        s,
        "measured kernels, mean of {} traced step(s): step {:.1} µs, kernels add up to {:.1} µs (streams overlap); ceilings {:.0} TFLOP/s tensor, {:.0} TFLOP/s FP32, {:.2} TB/s",
        trace.steps().len(),
        span,
        total,
        dev.tensor_flops / 1e12,
        dev.simt_flops / 1e12,
        dev.mem_bw / 1e12
    );
    let _ = writeln!(
        s,
        "  {:>8} {:>6} {:>9} {:>6} {:>8} {:>6}  stream  launch",
        "µs", "share", "TFLOP/s", "of pk", "GB/s", "of bw"
    );
    let rate = |r: &KernelRow| {
        let secs = r.us * 1e-6;
        let fl = if secs > 0.0 { r.flops / secs } else { 0.0 };
        let by = if secs > 0.0 { r.bytes / secs } else { 0.0 };
        let peak = if r.tensor_core {
            dev.tensor_flops
        } else {
            dev.simt_flops
        };
        (fl, fl / peak, by, by / dev.mem_bw)
    };
    for r in rows.iter().take(top) {
        let (fl, fp, by, bp) = rate(r);
        let _ = writeln!(
            s,
            "  {:8.1} {:5.1}% {:9.1} {:5.0}% {:8.0} {:5.0}%  {:<6}  {} [{}]",
            r.us,
            100.0 * r.us / span.max(1e-9),
            fl / 1e12,
            100.0 * fp,
            by / 1e9,
            100.0 * bp,
            erase_runtime::trace::stream_name(r.stream),
            r.label,
            r.kernel
        );
    }
    // per op: the op is the label's last word (`fwd:cross linear` -> `linear`)
    let mut by_op: BTreeMap<String, (f64, usize, f64, f64)> = BTreeMap::new();
    for r in &rows {
        let op = prog.launches[r.launch].label.op.clone();
        let e = by_op.entry(op).or_default();
        e.0 += r.us;
        e.1 += 1;
        e.2 += r.flops;
        e.3 += r.bytes;
    }
    let mut ops: Vec<_> = by_op.into_iter().collect();
    ops.sort_by(|a, b| b.1 .0.total_cmp(&a.1 .0));
    let _ = writeln!(
        s,
        "  by op: µs (launches, share of all kernel time, TFLOP/s, GB/s)"
    );
    for (op, (us, n, fl, by)) in ops {
        let secs = us * 1e-6;
        let _ = writeln!(
            s,
            "    {:<26} {:8.1} ({:3}, {:4.1}%, {:6.1}, {:6.0})",
            op,
            us,
            n,
            100.0 * us / total.max(1e-9),
            if secs > 0.0 { fl / secs / 1e12 } else { 0.0 },
            if secs > 0.0 { by / secs / 1e9 } else { 0.0 }
        );
    }
    s
}

/// Kernel times per graph node (mean µs over the events of a measured trace in Chrome /
/// Perfetto JSON, as `train --trace` and `bench --trace-dir` write them).
pub fn load_measured(path: &std::path::Path) -> anyhow::Result<BTreeMap<String, f64>> {
    let text = std::fs::read_to_string(path)?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| anyhow::anyhow!("not trace-event JSON: {e}"))?;
    let events = v
        .get("traceEvents")
        .and_then(|e| e.as_array())
        .ok_or_else(|| anyhow::anyhow!("no traceEvents array"))?;
    // a trace this crate wrote says where its times come from
    if let Some(source) = v.pointer("/otherData/source").and_then(|s| s.as_str()) {
        if !source.starts_with("measured") {
            anyhow::bail!(
                "its times are {source}, not measured: give a trace of `train --trace` or `bench --trace-dir` on a GPU"
            );
        }
    }
    let mut sum: BTreeMap<String, (f64, usize)> = BTreeMap::new();
    for e in events {
        let args = e.get("args");
        let node = args.and_then(|a| a.get("node")).and_then(|n| n.as_str());
        let kind = args.and_then(|a| a.get("kind")).and_then(|k| k.as_str());
        let launch = args.and_then(|a| a.get("launch")).and_then(|k| k.as_str());
        let dur = e.get("dur").and_then(|d| d.as_f64());
        if let (Some(node), Some("kernel"), Some(dur)) = (node, kind, dur) {
            if !(dur.is_finite() && dur >= 0.0) {
                anyhow::bail!("kernel '{node}' lasts {dur} µs: a duration must be a finite number, at least 0");
            }
            let x = sum.entry(measured_key(node, launch)).or_default();
            x.0 += dur;
            x.1 += 1;
        }
    }
    if sum.is_empty() {
        anyhow::bail!("the trace has no kernel events with a node");
    }
    Ok(sum
        .into_iter()
        .map(|(k, (t, n))| (k, t / n as f64))
        .collect())
}

/// The key of a node's measured time in [`load_measured`]'s map: `node|launch` where the
/// trace names the launch's kernel and grid (`launch_signature`), else the node alone (a
/// trace written before it did).
fn measured_key(node: &str, launch: Option<&str>) -> String {
    match launch {
        Some(l) if !l.is_empty() => format!("{node}|{l}"),
        _ => node.to_string(),
    }
}

/// Each launch's time alone in seconds: measured where `measured` has its node with the
/// same kernel and grid (or the node alone, from a trace that does not name them), else
/// `dev`'s model (a node whose kernels this program plans otherwise: the serial
/// programs' GEMM tiles and splits are not ERASE's). Returns the times and how many were
/// measured.
pub fn measured_work(
    prog: &StepProgram,
    g: &Graph,
    measured: &BTreeMap<String, f64>,
    dev: &DeviceModel,
) -> (Vec<f64>, usize) {
    let mut found = 0;
    let work = prog
        .launches
        .iter()
        .map(|l| match &l.spec {
            None => 0.0,
            Some(s) => match measured
                .get(&measured_key(
                    &g.node(l.node).name,
                    Some(&erase_runtime::trace::launch_signature(s)),
                ))
                .or_else(|| measured.get(&g.node(l.node).name))
            {
                Some(&us) => {
                    found += 1;
                    us * 1e-6
                }
                None => dev.duration_s(s),
            },
        })
        .collect();
    (work, found)
}
