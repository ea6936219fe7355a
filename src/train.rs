//! The CTR training loop: build the model, make it trainable, partition and schedule the
//! step, plan its memory, prove the plan, then run steps on synthetic data with
//! evaluation on the held-out stream.

use std::io::Write as _;
use std::time::Instant;

use anyhow::{bail, Context, Result};

use crate::data::synthetic::{SyntheticConfig, SyntheticCtr};
use crate::metrics::{auc, qps_summary, NeState, QpsSummary};
use crate::model::ctr::{build, CtrConfig, CtrModel, Variant};
use erase_graph::{make_trainable, partition, DType, OptimizerConfig, Partition, Phase, Training};
use erase_runtime::hb;
use erase_runtime::memory::{plan_memory, MemoryPlan};
use erase_runtime::occupancy::DeviceModel;
use erase_runtime::program::ProgramRunner;
use erase_runtime::schedule::{schedule, ScheduleConfig, ScheduleKind, StepProgram};

/// How the step is scheduled.
#[derive(Clone, Debug)]
pub struct ScheduleOptions {
    pub side_streams: usize,
    pub occupancy: bool,
    pub device: DeviceModel,
}

impl Default for ScheduleOptions {
    fn default() -> Self {
        ScheduleOptions {
            side_streams: 4,
            occupancy: true,
            device: DeviceModel::h200(),
        }
    }
}

/// Everything decided before the first step runs.
pub struct StepPlan {
    pub model: CtrModel,
    pub training: Training,
    pub partition: Partition,
    pub program: StepProgram,
    pub memory: MemoryPlan,
}

/// The schedule kind of a variant: `erase` starts backward programs early.
pub fn schedule_kind(v: Variant) -> ScheduleKind {
    match v {
        Variant::Erase => ScheduleKind::Early,
        Variant::Baseline | Variant::Detached => ScheduleKind::Serial,
    }
}

/// Builds, differentiates, partitions, schedules and plans the model; proves the plan.
pub fn plan_step(
    cfg: &CtrConfig,
    float: DType,
    opt: &OptimizerConfig,
    sched: &ScheduleOptions,
) -> Result<StepPlan> {
    cfg.validate()?;
    let mut model = build(cfg, float).context("building the CTR model")?;
    let training =
        make_trainable(&mut model.graph, opt).context("differentiating the CTR model")?;
    let partition = partition(&model.graph, &training.grads);
    let scfg = ScheduleConfig {
        kind: schedule_kind(cfg.variant),
        side_streams: sched.side_streams.max(1),
        occupancy: sched.occupancy,
        device: sched.device.clone(),
    };
    let program = schedule(&model.graph, &partition, &scfg);
    let mut keep = vec![model.logit, model.main_loss];
    keep.extend(model.aux_losses.iter().map(|a| a.1));
    let memory = plan_memory(&model.graph, &program, &keep);
    let hazards = hb::check(&model.graph, &program, &memory);
    if let Some(h) = hazards.first() {
        bail!(
            "internal error: the step plan has {} hazard(s); first: {h}",
            hazards.len()
        );
    }
    Ok(StepPlan {
        model,
        training,
        partition,
        program,
        memory,
    })
}

/// Settings of a training run.
#[derive(Clone, Debug)]
pub struct TrainConfig {
    pub model: CtrConfig,
    pub steps: usize,
    /// Seed of parameter initialisation.
    pub seed: u64,
    /// Seed of the synthetic data.
    pub data_seed: u64,
    /// Evaluate every this many steps (0: only at the end).
    pub eval_every: usize,
    /// Held-out examples (stream 2, from index 0), rounded down to whole batches.
    pub eval_examples: usize,
    pub threads: usize,
    pub schedule: ScheduleOptions,
    pub optimizer: OptimizerConfig,
    /// Steps excluded from the QPS summary.
    pub warmup: usize,
}

/// One evaluation.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Eval {
    pub step: usize,
    pub ne: f64,
    pub auc: f64,
    pub examples: usize,
}

#[derive(Clone, Debug)]
pub struct TrainReport {
    pub losses: Vec<f64>,
    pub evals: Vec<Eval>,
    pub qps: Option<QpsSummary>,
    pub arena_bytes: usize,
    pub launches: usize,
}

/// Where progress goes: a live line on a terminal, plain lines otherwise.
pub trait Progress {
    fn step(&mut self, step: usize, steps: usize, loss: f64, qps: f64);
    fn eval(&mut self, e: &Eval);
}

/// Runs training. Stops with an error naming the step and the block if a loss is not
/// finite.
pub fn train(cfg: &TrainConfig, progress: &mut dyn Progress) -> Result<TrainReport> {
    let plan = plan_step(&cfg.model, DType::F32, &cfg.optimizer, &cfg.schedule)?;
    let m = &plan.model;
    let mc = &cfg.model;
    let gen = SyntheticCtr::try_new(SyntheticConfig {
        seed: cfg.data_seed,
        rows: mc.rows,
        hot: mc.hot,
    })
    .map_err(|e| anyhow::anyhow!("synthetic data: {e}"))?;
    let mut runner =
        ProgramRunner::new(&m.graph, &plan.program, &plan.memory, cfg.seed, cfg.threads)?;
    let forward: Vec<usize> = plan
        .program
        .launches
        .iter()
        .enumerate()
        .filter(|(_, l)| m.graph.node(l.node).phase == Phase::Forward)
        .map(|(i, _)| i)
        .collect();

    let b = mc.batch;
    let mut dense = vec![0f32; b * mc.num_dense];
    let mut rows = vec![0u32; mc.ids_per_batch()];
    let mut labels = vec![0f32; b];
    let mut feed = |runner: &mut ProgramRunner, stream: u64, first: u64| -> Result<()> {
        gen.fill_batch(stream, first, b, &mut dense, &mut rows, &mut labels);
        let (d, i, o, l) = m.batch_buffers(&dense, &rows, &labels)?;
        runner.feed(m.inputs.dense, d)?;
        runner.feed(m.inputs.ids, i)?;
        runner.feed(m.inputs.offsets, o)?;
        runner.feed(m.inputs.label, l)?;
        Ok(())
    };
    let evaluate = |runner: &mut ProgramRunner,
                    feed: &mut dyn FnMut(&mut ProgramRunner, u64, u64) -> Result<()>,
                    step: usize|
     -> Result<Eval> {
        let mut ne = NeState::default();
        let (mut scores, mut ys) = (Vec::new(), Vec::new());
        for k in 0..(cfg.eval_examples / b).max(1) {
            feed(runner, 2, (k * b) as u64)?;
            runner.run_order(&forward)?;
            let logits = runner.get(m.logit).map(|x| x.to_f64()).unwrap_or_default();
            let lab = runner
                .get(m.inputs.label)
                .map(|x| x.to_f64())
                .unwrap_or_default();
            ne.update(&logits, &lab);
            scores.extend(logits);
            ys.extend(lab);
        }
        Ok(Eval {
            step,
            ne: ne.ne().unwrap_or(f64::NAN),
            auc: auc(&scores, &ys).unwrap_or(f64::NAN),
            examples: ys.len(),
        })
    };

    let mut report = TrainReport {
        losses: Vec::with_capacity(cfg.steps),
        evals: Vec::new(),
        qps: None,
        arena_bytes: plan.memory.arena_bytes,
        launches: plan.program.launches.len(),
    };
    let mut qps = Vec::new();
    for step in 0..cfg.steps {
        let t0 = Instant::now();
        feed(&mut runner, 1, (step * b) as u64)?;
        runner.run().with_context(|| format!("step {step}"))?;
        let secs = t0.elapsed().as_secs_f64();
        let loss = runner
            .get(m.main_loss)
            .and_then(|x| x.to_f64().first().copied())
            .unwrap_or(f64::NAN);
        if !loss.is_finite() {
            bail!("step {step}: the main loss (block 'top') is {loss}; training stopped");
        }
        for (block, t) in &m.aux_losses {
            let a = runner
                .get(*t)
                .and_then(|x| x.to_f64().first().copied())
                .unwrap_or(f64::NAN);
            if !a.is_finite() {
                bail!(
                    "step {step}: the auxiliary loss of block '{block}' is {a}; training stopped"
                );
            }
        }
        report.losses.push(loss);
        let q = b as f64 / secs.max(1e-12);
        if step >= cfg.warmup {
            qps.push(q);
        }
        progress.step(step + 1, cfg.steps, loss, q);
        let last = step + 1 == cfg.steps;
        if last || (cfg.eval_every > 0 && (step + 1) % cfg.eval_every == 0) {
            let e = evaluate(&mut runner, &mut feed, step + 1)?;
            progress.eval(&e);
            report.evals.push(e);
        }
    }
    report.qps = qps_summary(&qps);
    Ok(report)
}

/// Progress on a terminal (one line rewritten in place) or as plain lines.
pub struct ConsoleProgress {
    pub terminal: bool,
    pub jsonl: Option<std::fs::File>,
    last_print: Option<Instant>,
}

impl ConsoleProgress {
    pub fn new(jsonl: Option<std::fs::File>) -> Self {
        use std::io::IsTerminal;
        ConsoleProgress {
            terminal: std::io::stderr().is_terminal(),
            jsonl,
            last_print: None,
        }
    }
}

impl Progress for ConsoleProgress {
    fn step(&mut self, step: usize, steps: usize, loss: f64, qps: f64) {
        if let Some(f) = &mut self.jsonl {
            let _ = writeln!(f, "{{\"step\":{step},\"loss\":{loss},\"qps\":{qps:.1}}}");
        }
        let due = self
            .last_print
            .is_none_or(|t| t.elapsed().as_millis() >= if self.terminal { 100 } else { 2000 });
        if !(due || step == steps) {
            return;
        }
        self.last_print = Some(Instant::now());
        let width = 30;
        let filled = width * step / steps.max(1);
        let bar: String = "#".repeat(filled) + &"-".repeat(width - filled);
        if self.terminal {
            eprint!("\r[{bar}] step {step}/{steps}  loss {loss:.4}  {qps:.0} ex/s ");
            if step == steps {
                eprintln!();
            }
        } else {
            eprintln!("step {step}/{steps}  loss {loss:.4}  {qps:.0} ex/s");
        }
    }

    fn eval(&mut self, e: &Eval) {
        if let Some(f) = &mut self.jsonl {
            let _ = writeln!(
                f,
                "{{\"eval_step\":{},\"ne\":{},\"auc\":{},\"examples\":{}}}",
                e.step, e.ne, e.auc, e.examples
            );
        }
        if self.terminal {
            eprint!("\r\x1b[K");
        }
        eprintln!(
            "eval @ step {}: NE {:.4}  AUC {:.4}  ({} held-out examples)",
            e.step, e.ne, e.auc, e.examples
        );
    }
}
