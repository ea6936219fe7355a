//! The CTR training loop: build the model, make it trainable, partition and schedule the
//! step, plan its memory, prove the plan, then run steps on synthetic data with
//! evaluation on the held-out stream.

use std::io::Write as _;
use std::time::Instant;

use anyhow::{bail, Context, Result};

use crate::data::synthetic::{SyntheticConfig, SyntheticCtr};
use crate::metrics::{auc, qps_summary, NeState, QpsSummary};
use crate::model::ctr::{build, CtrConfig, CtrModel, Variant};
use erase_graph::Tensor;
use erase_graph::{make_trainable, partition, DType, OptimizerConfig, Partition, Phase, Training};
use erase_ops::Buffer;
use erase_runtime::cuda::CudaDevice;
use erase_runtime::cuda_program::CudaProgram;
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
            occupancy: false,
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
        kernels: Some(crate::kernels::library()).filter(|l| !l.modules.is_empty()),
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
    /// Write a checkpoint here at the end (and every `checkpoint_every` steps).
    pub checkpoint: Option<std::path::PathBuf>,
    pub checkpoint_every: usize,
    /// Start from this checkpoint (its configuration must match).
    pub resume: Option<std::path::PathBuf>,
    pub dispatch: Dispatch,
    /// Where examples come from.
    pub data: Data,
}

/// Training and evaluation examples.
#[derive(Clone, Default)]
pub enum Data {
    /// The spec's generator (seed `data_seed`): training stream 1, held-out stream 2.
    #[default]
    Synthetic,
    /// Loaded examples: training batches in a fresh shuffled order each epoch (seeded by
    /// `data_seed`), evaluation on `eval` in order.
    Table {
        train: std::sync::Arc<crate::data::Examples>,
        eval: std::sync::Arc<crate::data::Examples>,
        /// Where they came from, for the checkpoint identity.
        source: String,
    },
}

impl std::fmt::Debug for Data {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Data::Synthetic => f.write_str("Synthetic"),
            Data::Table {
                source,
                train,
                eval,
            } => write!(
                f,
                "Table({source}: {} train, {} eval)",
                train.len(),
                eval.len()
            ),
        }
    }
}

impl TrainConfig {
    /// What must match between a checkpoint and the run that resumes it.
    pub fn identity(&self) -> String {
        format!(
            "model {:?}; optimizer {:?}; seed {}; data seed {}; data {}",
            self.model,
            self.optimizer,
            self.seed,
            self.data_seed,
            match &self.data {
                Data::Synthetic => "synthetic".to_string(),
                Data::Table { source, train, .. } => format!("{source} ({} examples)", train.len()),
            }
        )
    }
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

/// Where the step program runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Cpu,
    Cuda,
}

/// A step program bound to a device: the CPU runner or the CUDA program.
pub trait StepExec: crate::checkpoint::TensorStore {
    fn feed(&mut self, t: Tensor, b: Buffer) -> Result<()>;
    /// One whole step; returns its time in seconds (device time where there is one).
    fn step(&mut self) -> Result<f64>;
    /// Only the given launches (indices into the program), in order, then wait.
    fn run_launches(&mut self, which: &[usize]) -> Result<()>;
    fn get(&self, t: Tensor) -> Result<Buffer>;
}

impl StepExec for ProgramRunner<'_> {
    fn feed(&mut self, t: Tensor, b: Buffer) -> Result<()> {
        Ok(ProgramRunner::feed(self, t, b)?)
    }
    fn step(&mut self) -> Result<f64> {
        let t0 = Instant::now();
        self.run()?;
        Ok(t0.elapsed().as_secs_f64())
    }
    fn run_launches(&mut self, which: &[usize]) -> Result<()> {
        Ok(self.run_order(which)?)
    }
    fn get(&self, t: Tensor) -> Result<Buffer> {
        ProgramRunner::get(self, t).ok_or_else(|| anyhow::anyhow!("'{}' has no value", t.0))
    }
}

impl crate::checkpoint::TensorStore for CudaProgram<'_> {
    fn read(&self, t: Tensor) -> Result<Buffer> {
        Ok(CudaProgram::get(self, t)?)
    }
    fn write(&mut self, t: Tensor, b: Buffer) -> Result<()> {
        Ok(CudaProgram::feed(self, t, &b)?)
    }
}

impl StepExec for CudaProgram<'_> {
    fn feed(&mut self, t: Tensor, b: Buffer) -> Result<()> {
        Ok(CudaProgram::feed(self, t, &b)?)
    }
    fn step(&mut self) -> Result<f64> {
        self.run()?;
        Ok(f64::from(self.synchronize()?) * 1e-3)
    }
    fn run_launches(&mut self, which: &[usize]) -> Result<()> {
        self.run_subset(which)?;
        self.synchronize()?;
        Ok(())
    }
    fn get(&self, t: Tensor) -> Result<Buffer> {
        Ok(CudaProgram::get(self, t)?)
    }
}

/// Runs training on the CPU, or on the CUDA device `dev`. Stops with an error naming the
/// step and the block if a loss is not finite.
pub fn train(cfg: &TrainConfig, progress: &mut dyn Progress) -> Result<TrainReport> {
    train_on(cfg, None, progress)
}

/// [`train`] on a chosen device (`None`: the CPU).
pub fn train_on(
    cfg: &TrainConfig,
    dev: Option<&CudaDevice>,
    progress: &mut dyn Progress,
) -> Result<TrainReport> {
    let plan = plan_step(&cfg.model, DType::F32, &cfg.optimizer, &cfg.schedule)?;
    run_training(cfg, &plan, dev, progress)
}

fn scalar(exec: &dyn StepExec, t: Tensor) -> f64 {
    exec.get(t)
        .ok()
        .and_then(|x| x.to_f64().first().copied())
        .unwrap_or(f64::NAN)
}

enum Source {
    Synthetic(SyntheticCtr),
    Table {
        train: std::sync::Arc<crate::data::Examples>,
        eval: std::sync::Arc<crate::data::Examples>,
        seed: u64,
        epoch: usize,
        order: Vec<usize>,
    },
}

/// A permutation of `0..n` (Fisher-Yates on a counter-based generator).
fn shuffled(n: usize, seed: u64) -> Vec<usize> {
    let mut v: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let r =
            erase_runtime::init::splitmix64(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ i as u64);
        v.swap(i, (r % (i as u64 + 1)) as usize);
    }
    v
}

/// A step program on a device with its data: steps and evaluations one at a time.
pub struct Session<'a> {
    plan: &'a StepPlan,
    exec: Box<dyn StepExec + 'a>,
    src: Source,
    forward: Vec<usize>,
    dense: Vec<f32>,
    rows: Vec<u32>,
    labels: Vec<f32>,
    /// Steps done.
    pub step: usize,
}

/// How the host issues a step's launches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Dispatch {
    /// One host thread issues everything in schedule order.
    #[default]
    Blocking,
    /// The pool streams' launches issued by a dispatcher thread.
    Threaded,
    /// The whole step captured once as a CUDA graph, then replayed (one launch a step).
    Graph,
}

impl Dispatch {
    pub fn as_str(self) -> &'static str {
        match self {
            Dispatch::Blocking => "blocking",
            Dispatch::Threaded => "threaded",
            Dispatch::Graph => "graph",
        }
    }
}

impl<'a> Session<'a> {
    pub fn new(
        plan: &'a StepPlan,
        dev: Option<&'a CudaDevice>,
        seed: u64,
        data_seed: u64,
        threads: usize,
    ) -> Result<Self> {
        Self::with_dispatch(
            plan,
            dev,
            Dispatch::Blocking,
            &Data::Synthetic,
            seed,
            data_seed,
            threads,
        )
    }

    pub fn with_dispatch(
        plan: &'a StepPlan,
        dev: Option<&'a CudaDevice>,
        dispatch: Dispatch,
        data: &Data,
        seed: u64,
        data_seed: u64,
        threads: usize,
    ) -> Result<Self> {
        let m = &plan.model;
        let mc = &m.cfg;
        let exec: Box<dyn StepExec + 'a> = match (dev, dispatch) {
            (None, Dispatch::Blocking) => Box::new(ProgramRunner::new(
                &m.graph,
                &plan.program,
                &plan.memory,
                seed,
                threads,
            )?),
            (None, Dispatch::Graph | Dispatch::Threaded) => {
                bail!(
                    "--dispatch {} needs a CUDA device; the CPU backend runs blocking",
                    dispatch.as_str()
                )
            }
            (Some(d), _) => {
                let mut p = CudaProgram::new(d, &m.graph, &plan.program, &plan.memory, seed)?;
                p.set_threaded(dispatch == Dispatch::Threaded);
                if dispatch == Dispatch::Graph {
                    let kernels = p.capture()?;
                    if kernels != p.kernel_launches() {
                        bail!(
                            "the captured step has {kernels} kernels, the eager step {}",
                            p.kernel_launches()
                        );
                    }
                }
                Box::new(p)
            }
        };
        let src = match data {
            Data::Synthetic => Source::Synthetic(
                SyntheticCtr::try_new(SyntheticConfig {
                    seed: data_seed,
                    rows: mc.rows,
                    hot: mc.hot,
                })
                .map_err(|e| anyhow::anyhow!("synthetic data: {e}"))?,
            ),
            Data::Table { train, eval, .. } => {
                if train.num_dense != mc.num_dense
                    || train.num_sparse != mc.num_sparse
                    || mc.hot != 1
                {
                    bail!(
                        "the data has {} dense and {} categorical fields (one id each); the model expects {} and {} (hot {})",
                        train.num_dense,
                        train.num_sparse,
                        mc.num_dense,
                        mc.num_sparse,
                        mc.hot
                    );
                }
                if train.len() < mc.batch || eval.len() < mc.batch {
                    bail!(
                        "{} training and {} held-out examples: both need at least one batch of {}",
                        train.len(),
                        eval.len(),
                        mc.batch
                    );
                }
                Source::Table {
                    train: train.clone(),
                    eval: eval.clone(),
                    seed: data_seed,
                    epoch: usize::MAX,
                    order: Vec::new(),
                }
            }
        };
        let forward = plan
            .program
            .launches
            .iter()
            .enumerate()
            .filter(|(_, l)| m.graph.node(l.node).phase == Phase::Forward)
            .map(|(i, _)| i)
            .collect();
        Ok(Session {
            plan,
            exec,
            src,
            forward,
            dense: vec![0.0; mc.batch * mc.num_dense],
            rows: vec![0; mc.ids_per_batch()],
            labels: vec![0.0; mc.batch],
            step: 0,
        })
    }

    /// Feeds batch `first / batch` of the training data (stream 1) or of the held-out
    /// data (stream 2).
    fn feed(&mut self, stream: u64, first: u64) -> Result<()> {
        let m = &self.plan.model;
        let (b, rows) = (m.cfg.batch, m.cfg.rows);
        match &mut self.src {
            Source::Synthetic(gen) => gen.fill_batch(
                stream,
                first,
                b,
                &mut self.dense,
                &mut self.rows,
                &mut self.labels,
            ),
            Source::Table { eval, .. } if stream == 2 => eval.fill_batch(
                first,
                b,
                rows,
                &mut self.dense,
                &mut self.rows,
                &mut self.labels,
            ),
            Source::Table {
                train,
                seed,
                epoch,
                order,
                ..
            } => {
                // whole batches per epoch; each epoch a fresh permutation
                let per_epoch = train.len() / b;
                let k = (first as usize) / b;
                let (e, i) = (k / per_epoch, k % per_epoch);
                if *epoch != e {
                    *order = shuffled(train.len(), seed.wrapping_add(e as u64));
                    *epoch = e;
                }
                train.fill_batch_indices(
                    &order[i * b..(i + 1) * b],
                    rows,
                    &mut self.dense,
                    &mut self.rows,
                    &mut self.labels,
                );
            }
        }
        let (d, i, o, l) = m.batch_buffers(&self.dense, &self.rows, &self.labels)?;
        self.exec.feed(m.inputs.dense, d)?;
        self.exec.feed(m.inputs.ids, i)?;
        self.exec.feed(m.inputs.offsets, o)?;
        self.exec.feed(m.inputs.label, l)?;
        Ok(())
    }

    /// One training step on the next batch of stream 1; returns (main loss, seconds).
    /// A non-finite loss is an error naming the step and the block.
    pub fn train_step(&mut self) -> Result<(f64, f64)> {
        let m = &self.plan.model;
        let step = self.step;
        self.feed(1, (step * m.cfg.batch) as u64)?;
        let secs = self.exec.step().with_context(|| format!("step {step}"))?;
        let loss = scalar(self.exec.as_ref(), m.main_loss);
        if !loss.is_finite() {
            bail!("step {step}: the main loss (block 'top') is {loss}; training stopped");
        }
        for (block, t) in &m.aux_losses {
            let a = scalar(self.exec.as_ref(), *t);
            if !a.is_finite() {
                bail!(
                    "step {step}: the auxiliary loss of block '{block}' is {a}; training stopped"
                );
            }
        }
        self.step += 1;
        Ok((loss, secs))
    }

    /// NE and AUC on `examples` held-out examples (stream 2, whole batches).
    pub fn evaluate(&mut self, examples: usize) -> Result<Eval> {
        let m = &self.plan.model;
        let b = m.cfg.batch;
        let mut ne = NeState::default();
        let (mut scores, mut ys) = (Vec::new(), Vec::new());
        let available = match &self.src {
            Source::Synthetic(_) => examples,
            Source::Table { eval, .. } => examples.min(eval.len()),
        };
        for k in 0..(available / b).max(1) {
            self.feed(2, (k * b) as u64)?;
            self.exec.run_launches(&self.forward)?;
            let logits = self.exec.get(m.logit)?.to_f64();
            let lab = self.exec.get(m.inputs.label)?.to_f64();
            ne.update(&logits, &lab);
            scores.extend(logits);
            ys.extend(lab);
        }
        Ok(Eval {
            step: self.step,
            ne: ne.ne().unwrap_or(f64::NAN),
            auc: auc(&scores, &ys).unwrap_or(f64::NAN),
            examples: ys.len(),
        })
    }

    pub fn save(&self, path: &std::path::Path, identity: &str) -> Result<()> {
        let st = crate::checkpoint::CheckpointState {
            step: self.step as u64,
            next_example: (self.step * self.plan.model.cfg.batch) as u64,
            config: identity.to_string(),
        };
        crate::checkpoint::save(path, &self.plan.model.graph, self.exec.as_ref(), &st)
    }

    pub fn resume(&mut self, path: &std::path::Path, identity: &str) -> Result<()> {
        let st = crate::checkpoint::load(
            path,
            &self.plan.model.graph,
            self.exec.as_mut(),
            Some(identity),
        )?;
        self.step = st.step as usize;
        Ok(())
    }

    /// Loads a checkpoint's tensors for evaluation: shapes must fit, the training
    /// configuration may differ. Returns the step it was written at.
    pub fn load_weights(&mut self, path: &std::path::Path) -> Result<u64> {
        let st = crate::checkpoint::load(path, &self.plan.model.graph, self.exec.as_mut(), None)?;
        Ok(st.step)
    }
}

fn run_training(
    cfg: &TrainConfig,
    plan: &StepPlan,
    dev: Option<&CudaDevice>,
    progress: &mut dyn Progress,
) -> Result<TrainReport> {
    let mut s = Session::with_dispatch(
        plan,
        dev,
        cfg.dispatch,
        &cfg.data,
        cfg.seed,
        cfg.data_seed,
        cfg.threads,
    )?;
    let b = cfg.model.batch;
    let mut report = TrainReport {
        losses: Vec::with_capacity(cfg.steps),
        evals: Vec::new(),
        qps: None,
        arena_bytes: plan.memory.arena_bytes,
        launches: plan.program.launches.len(),
    };
    let mut qps = Vec::new();
    if let Some(path) = &cfg.resume {
        s.resume(path, &cfg.identity())?;
        if s.step >= cfg.steps {
            bail!(
                "{} is already at step {}; ask for more --steps than that",
                path.display(),
                s.step
            );
        }
        eprintln!("resumed from {} at step {}", path.display(), s.step);
    }
    while s.step < cfg.steps {
        let (loss, secs) = s.train_step()?;
        let step = s.step;
        report.losses.push(loss);
        if step > cfg.warmup {
            qps.push(b as f64 / secs.max(1e-12));
        }
        progress.step(step, cfg.steps, loss, b as f64 / secs.max(1e-12));
        let last = step == cfg.steps;
        if last || (cfg.checkpoint_every > 0 && step % cfg.checkpoint_every == 0) {
            if let Some(path) = &cfg.checkpoint {
                s.save(path, &cfg.identity())?;
            }
        }
        if last || (cfg.eval_every > 0 && step % cfg.eval_every == 0) {
            let e = s.evaluate(cfg.eval_examples)?;
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
