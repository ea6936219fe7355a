//! `erase-ctr bench`: the three variants side by side in one process. Each trains from
//! the same initialisation on the same batches; their steps are interleaved in chunks,
//! so drift in the machine's speed touches all of them alike. Reports per-step QPS
//! (p50, p90, mean), the gain over baseline, and NE, AUC and the NE gap after training.

use anyhow::Result;

use crate::metrics::{qps_summary, QpsSummary};
use crate::model::ctr::{CtrConfig, Variant};
use crate::train::{plan_step, Dispatch, ScheduleOptions, Session};
use erase_graph::{DType, OptimizerConfig};
use erase_runtime::cuda::CudaDevice;

#[derive(Clone, Debug)]
pub struct BenchConfig {
    pub model: CtrConfig,
    pub variants: Vec<Variant>,
    pub warmup: usize,
    pub steps: usize,
    /// Steps of one variant before the next takes over.
    pub chunk: usize,
    pub seed: u64,
    pub data_seed: u64,
    pub eval_examples: usize,
    pub threads: usize,
    pub schedule: ScheduleOptions,
    pub optimizer: OptimizerConfig,
    /// Dispatch modes to measure (each with every variant).
    pub dispatch: Vec<Dispatch>,
    /// Steps traced after the timed ones, for the overlap figure (CUDA; 0: none).
    pub trace_steps: usize,
    /// With traced steps: the per-kernel table's longest launches (0: no table).
    pub kernels: usize,
}

#[derive(Clone, Debug)]
pub struct BenchRow {
    pub variant: Variant,
    pub dispatch: &'static str,
    pub qps: QpsSummary,
    pub ne: f64,
    pub auc: f64,
    pub final_loss: f64,
    /// The measured trace of the traced steps (CUDA).
    pub trace: Option<erase_runtime::trace::Trace>,
    /// Where the traced steps' time went (see [`crate::profile`]).
    pub kernel_table: Option<String>,
    /// The step's floating-point operations per example (its plan's, see
    /// [`crate::train::step_flops`]), for the MFU column.
    pub flops_per_example: Option<f64>,
}

/// The bf16 matrix rate MFU is quoted against: what a large GEMM reaches on an H200
/// (788-798 TFLOP/s measured on random data), not the datasheet's 989.
pub const MFU_PEAK_FLOPS: f64 = 790e12;

impl BenchRow {
    /// Model FLOPs utilisation at the p90 rate, against [`MFU_PEAK_FLOPS`].
    pub fn mfu(&self) -> Option<f64> {
        self.flops_per_example
            .map(|f| f * self.qps.p90 / MFU_PEAK_FLOPS)
    }
}

/// Runs the benchmark; `progress` hears about every finished chunk.
pub fn bench(
    cfg: &BenchConfig,
    dev: Option<&CudaDevice>,
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<BenchRow>> {
    if let Some(d) = dev {
        return bench_cuda(cfg, d, progress);
    }
    // the CPU's GEMMs are f32: no bf16 copies of their operands there
    let sched = ScheduleOptions {
        bf16_copies: false,
        ..cfg.schedule.clone()
    };
    let plans = cfg
        .variants
        .iter()
        .map(|&v| {
            plan_step(
                &cfg.model.clone().with_variant(v),
                DType::F32,
                &cfg.optimizer,
                &sched,
            )
        })
        .collect::<Result<Vec<_>>>()?;
    let mut sessions = Vec::new();
    let mut labels = Vec::new();
    for &d in &cfg.dispatch {
        for (i, p) in plans.iter().enumerate() {
            sessions.push(Session::with_dispatch(
                p,
                dev,
                d,
                &crate::train::Data::Synthetic,
                cfg.seed,
                cfg.data_seed,
                cfg.threads,
            )?);
            labels.push((cfg.variants[i], d));
        }
    }
    let total = cfg.warmup + cfg.steps;
    let mut qps: Vec<Vec<f64>> = vec![Vec::new(); sessions.len()];
    let mut last_loss = vec![f64::NAN; sessions.len()];
    let b = cfg.model.batch as f64;
    let mut done = 0;
    while done < total {
        let n = cfg.chunk.max(1).min(total - done);
        for (i, s) in sessions.iter_mut().enumerate() {
            for _ in 0..n {
                let r = s.train_step_now()?;
                last_loss[i] = r.loss;
                if r.step > cfg.warmup {
                    qps[i].push(b / r.secs.max(1e-12));
                }
            }
        }
        done += n;
        progress(&format!("{done}/{total} steps of each variant"));
    }
    let mut rows = Vec::new();
    for (i, s) in sessions.iter_mut().enumerate() {
        let e = s.evaluate(cfg.eval_examples)?;
        let q = qps_summary(&qps[i])
            .ok_or_else(|| anyhow::anyhow!("no timed steps: ask for --steps > 0"))?;
        let (variant, d) = labels[i];
        rows.push(BenchRow {
            variant,
            dispatch: d.as_str(),
            qps: q,
            ne: e.ne,
            auc: e.auc,
            final_loss: last_loss[i],
            trace: None,
            kernel_table: None,
            flops_per_example: None,
        });
    }
    Ok(rows)
}

/// The table people read.
pub fn render(rows: &[BenchRow], device: &str, batch: usize, gpu: bool) -> String {
    use std::fmt::Write as _;
    let mut s = String::new();
    let base_of = |d: &str| {
        rows.iter()
            .find(|r| r.variant == Variant::Baseline && r.dispatch == d)
    };
    let _ = writeln!(s, "device: {device}, batch {batch}");
    let _ = writeln!(
        s,
        "{:<10} {:<9} {:>12} {:>12} {:>12} {:>10} {:>8} {:>8} {:>9} {:>7}",
        "variant",
        "dispatch",
        "p50 ex/s",
        "p90 ex/s",
        "mean ex/s",
        "p90 gain",
        "NE",
        "AUC",
        "NE gap",
        "MFU"
    );
    for r in rows {
        let (gain, gap) = match base_of(r.dispatch).or_else(|| base_of("blocking")) {
            Some(b) => (
                format!("{:+.1} %", (r.qps.p90 / b.qps.p90 - 1.0) * 100.0),
                format!("{:+.2} %", (r.ne - b.ne) / b.ne * 100.0),
            ),
            None => ("-".into(), "-".into()),
        };
        let _ = writeln!(
            s,
            "{:<10} {:<9} {:>12.0} {:>12.0} {:>12.0} {:>10} {:>8.4} {:>8.4} {:>9} {:>7}",
            r.variant.as_str(),
            r.dispatch,
            r.qps.p50,
            r.qps.p90,
            r.qps.mean,
            gain,
            r.ne,
            r.auc,
            gap,
            r.mfu()
                .filter(|_| gpu)
                .map_or_else(|| "-".to_string(), |m| format!("{:.1} %", m * 100.0))
        );
    }
    // (the MFU of a GPU's rate: on the CPU backend the column stays empty)
    let erase_flops = rows
        .iter()
        .filter(|r| r.variant == Variant::Erase)
        .find_map(|r| r.flops_per_example);
    if let (Some(f), true) = (erase_flops, gpu) {
        let _ = writeln!(
            s,
            "MFU: each variant's plan's FLOPs an example (erase {:.1} MFLOP) at its p90 rate, of {:.0} TFLOP/s (the bf16 rate a large GEMM reaches on an H200)",
            f / 1e6,
            MFU_PEAK_FLOPS / 1e12
        );
    }
    let traced: Vec<&BenchRow> = rows.iter().filter(|r| r.trace.is_some()).collect();
    if !traced.is_empty() {
        let _ = writeln!(
            s,
            "measured overlap (traced steps): share of early backward work that ran beside forward work; busy share per stream"
        );
    }
    for r in traced {
        if let Some(t) = &r.trace {
            let o = t.overlap();
            let busy = o
                .steps
                .last()
                .map(|st| {
                    st.streams
                        .iter()
                        .map(|b| format!("{} {:.0} %", b.name, 100.0 * b.busy_fraction))
                        .collect::<Vec<_>>()
                        .join(", ")
                })
                .unwrap_or_default();
            let _ = writeln!(
                s,
                "  {:<10} {:<9} {:>5.1} % of {:>7.1} µs early backward overlapped; {}",
                r.variant.as_str(),
                r.dispatch,
                100.0 * o.fraction,
                o.early_backward_us / o.steps.len().max(1) as f64,
                busy
            );
        }
    }
    s
}

/// One JSON object per row.
pub fn to_json(rows: &[BenchRow]) -> String {
    let v: Vec<serde_json::Value> = rows
        .iter()
        .map(|r| {
            serde_json::json!({
                "variant": r.variant.as_str(), "dispatch": r.dispatch,
                "qps_p50": r.qps.p50, "qps_p90": r.qps.p90, "qps_mean": r.qps.mean, "steps": r.qps.steps,
                "ne": r.ne, "auc": r.auc, "final_loss": r.final_loss,
                "flops_per_example": r.flops_per_example, "mfu_p90": r.mfu(),
                "overlap_fraction": r.trace.as_ref().map(|t| t.overlap().fraction),
            })
        })
        .collect();
    serde_json::to_string_pretty(&v).unwrap_or_default()
}

/// On a CUDA device, as the anchor measures: every batch generated before timing and
/// staged in device memory; each step copies its batch into the input buffers on the
/// main stream and records an event after the step's final join; the step time is the
/// interval between consecutive events. The host never waits inside a chunk.
fn bench_cuda(
    cfg: &BenchConfig,
    dev: &CudaDevice,
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<BenchRow>> {
    use crate::data::synthetic::{SyntheticConfig, SyntheticCtr};
    use crate::metrics::{auc, NeState};
    use erase_graph::Phase;
    use erase_runtime::cuda::program::CudaProgram;

    let mc = &cfg.model;
    let total = cfg.warmup + cfg.steps;
    let gen = SyntheticCtr::try_new(SyntheticConfig {
        seed: cfg.data_seed,
        rows: mc.rows,
        hot: mc.hot,
    })
    .map_err(|e| anyhow::anyhow!("synthetic data: {e}"))?;
    let b = mc.batch;
    let (mut d, mut r, mut y) = (
        vec![0f32; b * mc.num_dense],
        vec![0u32; mc.ids_per_batch()],
        vec![0f32; b],
    );
    let plans = cfg
        .variants
        .iter()
        .map(|&v| {
            plan_step(
                &mc.clone().with_variant(v),
                DType::F32,
                &cfg.optimizer,
                &cfg.schedule,
            )
        })
        .collect::<Result<Vec<_>>>()?;
    // the same batches for every variant, generated once
    let mut batches = Vec::with_capacity(total + cfg.trace_steps);
    for k in 0..total + cfg.trace_steps {
        gen.fill_batch(1, (k * b) as u64, b, &mut d, &mut r, &mut y);
        let (bd, bi, bo, bl) = plans[0].model.batch_buffers(&d, &r, &y)?;
        batches.push(vec![bd, bi, bo, bl]);
    }
    let mut progs = Vec::new();
    let mut labels = Vec::new();
    for &dispatch in &cfg.dispatch {
        for (i, p) in plans.iter().enumerate() {
            let m = &p.model;
            let mut prog = CudaProgram::new(dev, &m.graph, &p.program, &p.memory, cfg.seed)?;
            prog.stage(&m.inputs.in_batch_order(), &batches)?;
            prog.set_threaded(dispatch == Dispatch::Threaded);
            if dispatch == Dispatch::Graph {
                prog.capture()?;
            }
            progs.push((i, prog));
            labels.push((cfg.variants[i], dispatch));
        }
    }
    let marks = (0..cfg.chunk.max(1) + 1)
        .map(|_| dev.event(true))
        .collect::<Result<Vec<_>, _>>()?;
    let mut qps: Vec<Vec<f64>> = vec![Vec::new(); progs.len()];
    let mut done = 0;
    while done < total {
        let n = cfg.chunk.max(1).min(total - done);
        for (j, (_, prog)) in progs.iter_mut().enumerate() {
            for (k, mark) in marks.iter().take(n).enumerate() {
                prog.run_staged(done + k, mark)?;
            }
            marks[n - 1].synchronize()?;
            for k in 1..n {
                if done + k >= cfg.warmup {
                    let ms = marks[k].elapsed_ms_since(&marks[k - 1])?;
                    qps[j].push(b as f64 / (f64::from(ms) * 1e-3));
                }
            }
        }
        done += n;
        progress(&format!(
            "{done}/{total} steps of each variant and dispatch"
        ));
    }
    let mut rows = Vec::new();
    for (j, (i, prog)) in progs.iter_mut().enumerate() {
        let m = &plans[*i].model;
        let forward: Vec<usize> = plans[*i]
            .program
            .launches
            .iter()
            .enumerate()
            .filter(|(_, l)| m.graph.node(l.node).phase == Phase::Forward)
            .map(|(x, _)| x)
            .collect();
        let final_loss = prog
            .get(m.main_loss)?
            .to_f64()
            .first()
            .copied()
            .unwrap_or(f64::NAN);
        let mut ne = NeState::default();
        let (mut scores, mut ys) = (Vec::new(), Vec::new());
        // exactly eval_examples (as Session::evaluate): the last batch's tail left out
        let (batches, last) = crate::train::eval_batches(cfg.eval_examples, b);
        for k in 0..batches {
            gen.fill_batch(2, (k * b) as u64, b, &mut d, &mut r, &mut y);
            let (bd, bi, bo, bl) = m.batch_buffers(&d, &r, &y)?;
            for (t, v) in [
                (m.inputs.dense, &bd),
                (m.inputs.ids, &bi),
                (m.inputs.offsets, &bo),
                (m.inputs.label, &bl),
            ] {
                prog.feed(t, v)?;
            }
            prog.run_subset(&forward)?;
            prog.synchronize()?;
            let keep = if k + 1 == batches { last } else { b };
            let mut logits = prog.get(m.logit)?.to_f64();
            let mut lab = bl.to_f64();
            logits.truncate(keep);
            lab.truncate(keep);
            ne.update(&logits, &lab);
            scores.extend(logits);
            ys.extend(lab);
        }
        let q = qps_summary(&qps[j])
            .ok_or_else(|| anyhow::anyhow!("no timed steps: ask for --steps > 1"))?;
        let (variant, d) = labels[j];
        rows.push(BenchRow {
            variant,
            dispatch: d.as_str(),
            qps: q,
            ne: ne.ne().unwrap_or(f64::NAN),
            auc: auc(&scores, &ys).unwrap_or(f64::NAN),
            final_loss,
            kernel_table: None,
            flops_per_example: None,
            trace: None,
        });
    }
    // traced steps after the evaluation (the NE is the timed steps' alone), on batches
    // that continue the stream
    if cfg.trace_steps > 0 {
        for (j, (i, prog)) in progs.iter_mut().enumerate() {
            let mut t = erase_runtime::trace::Trace::new(prog.program(), "measured (CUDA events)");
            prog.set_tracing(true)?;
            for k in 0..cfg.trace_steps {
                prog.run_staged(total + k, &marks[0])?;
                prog.synchronize()?;
                let m = prog.traced_step()?;
                t.push_measured(prog.program(), prog.graph(), total + k, &m);
            }
            prog.set_tracing(false)?;
            if cfg.kernels > 0 {
                rows[j].kernel_table = Some(crate::profile::render(
                    &plans[*i].program,
                    &plans[*i].model.graph,
                    &t,
                    &erase_runtime::program::occupancy::DeviceModel::h200(),
                    cfg.kernels,
                ));
            }
            rows[j].trace = Some(t);
        }
    }
    Ok(rows)
}
