//! The CTR training loop: build the model, make it trainable, partition and schedule the
//! step, plan its memory, prove the plan, then run steps on synthetic data with
//! evaluation on the held-out stream.

use std::io::Write as _;
use std::time::Instant;

use anyhow::{bail, Context, Result};

use crate::data::loader::{Loader, SlotMem};
use crate::data::synthetic::{SyntheticConfig, SyntheticCtr};
use crate::metrics::{auc, qps_summary, NeState, QpsSummary};
use crate::model::ctr::{build_with, CtrConfig, CtrModel, Variant};
use erase_graph::Tensor;
use erase_graph::{make_trainable, partition, DType, OptimizerConfig, Partition, Phase, Training};
use erase_ops::Buffer;
use erase_runtime::cpu::buffer_from_bytes;
use erase_runtime::cpu::runner::ProgramRunner;
use erase_runtime::cuda::feed::InputLayout;
use erase_runtime::cuda::program::CudaProgram;
use erase_runtime::cuda::CudaDevice;
use erase_runtime::program::hb;
use erase_runtime::program::memory::{plan_memory, MemoryPlan};
use erase_runtime::program::occupancy::DeviceModel;
use erase_runtime::program::schedule::{
    schedule, Priorities, ScheduleConfig, ScheduleKind, StepProgram,
};
use erase_runtime::trace::MeasuredStep;
use erase_runtime::trace::Trace;

/// The occupancy rule: whether a device-filling launch is ordered against the other
/// streams.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Occupancy {
    /// No ordering for occupancy: streams overlap wherever the data allows.
    Off,
    /// Every launch that fills a wave and runs long runs alone (the blunt rule).
    On,
    /// The occupancy model decides: such a launch runs alone only where the simulator
    /// predicts the step shorter for it (`simulate::choose_occupancy`).
    #[default]
    Auto,
}

impl Occupancy {
    pub fn as_str(self) -> &'static str {
        match self {
            Occupancy::Off => "off",
            Occupancy::On => "on",
            Occupancy::Auto => "auto",
        }
    }
}

/// Schedules `part` of `g` with the occupancy rule as `mode` says; with `Auto`, the
/// configuration and choice of [`erase_runtime::program::simulate::choose_occupancy`], predicted
/// with the kernels' measured rates on the device (graph dispatch: no host time).
pub fn schedule_with_occupancy(
    g: &erase_graph::Graph,
    part: &Partition,
    mut scfg: ScheduleConfig,
    mode: Occupancy,
    priorities: Option<Priorities>,
) -> (
    StepProgram,
    Option<erase_runtime::program::simulate::OccupancyChoice>,
) {
    scfg.exclusive_only = None;
    match mode {
        Occupancy::Off | Occupancy::On => {
            scfg.occupancy = mode == Occupancy::On;
            scfg.priorities = priorities.unwrap_or(Priorities::RANKED);
            (schedule(g, part, &scfg), None)
        }
        Occupancy::Auto => {
            // on an H200, the rates Erase's kernels reach there (what `plan` predicts with)
            let device = if scfg.device
                == (DeviceModel {
                    contention: scfg.device.contention,
                    ..DeviceModel::h200()
                }) {
                DeviceModel {
                    contention: scfg.device.contention,
                    ..DeviceModel::h200_measured()
                }
            } else {
                scfg.device.clone()
            };
            let sim = erase_runtime::program::simulate::SimConfig {
                device,
                host_per_launch_s: 0.0,
            };
            let sets = match priorities {
                Some(p) => vec![p],
                None => erase_runtime::program::simulate::PRIORITY_CANDIDATES.to_vec(),
            };
            let (chosen, choice) =
                erase_runtime::program::simulate::choose_occupancy(g, part, &scfg, &sim, &sets);
            (schedule(g, part, &chosen), Some(choice))
        }
    }
}

/// How the step is scheduled.
#[derive(Clone, Debug)]
pub struct ScheduleOptions {
    pub side_streams: usize,
    pub occupancy: Occupancy,
    pub device: DeviceModel,
    /// Each early block's dense parameters updated right after its backward, on its
    /// stream, instead of in the single update after the whole backward.
    pub early_updates: bool,
    /// The last early backward program on a side stream of its own, one priority level
    /// below main (see `ScheduleConfig::late_stream`).
    pub late_stream: bool,
    /// The early programs' weight gradients on companion streams of their side streams
    /// (see `ScheduleConfig::weight_grad_streams`).
    pub weight_grad_streams: bool,
    /// Each early block's own forward on a forward stream of its own at main's priority
    /// (see `ScheduleConfig::forward_streams`).
    pub forward_streams: bool,
    /// Each large layer's GEMM operands rounded to bf16 once, by RoundBf16 nodes, and read
    /// in place by its GEMMs (see `Graph::set_bf16_copies`), instead of rounded by every
    /// GEMM that reads them. The values of the CUDA kernels, in fewer passes; the CPU
    /// backend, whose GEMMs are f32 unless asked, plans without them.
    pub bf16_copies: bool,
    /// Least FLOPs of a layer given copies (default [`BF16_COPY_MIN_FLOPS`]).
    pub bf16_copy_min_flops: usize,
    /// The cross layers' up-projections stored in bf16 where they take copies, as
    /// autocast stores them (see `Graph::set_bf16_storage`): half the bytes for their
    /// GEMMs' stores and the cross updates' reads, the values rounded once.
    pub bf16_storage: bool,
    /// With `bf16_storage`, the cross networks' updates read x0 and the previous update
    /// from their bf16 copies and store the inner updates in bf16 (see
    /// `Graph::set_bf16_cross`): half the bytes of the networks' elementwise passes,
    /// forward and backward, each update rounded once.
    pub bf16_cross: bool,
    /// With `bf16_cross`, the first cross update's gradient (`x0 ⊙ v + x0`) writes x0's two
    /// contributions as one tensor (`Graph::set_fold_plus_dy`): one pass fewer over it
    /// for x0's sum to read. The same sum in another order. On by default: on an H100 with
    /// `bf16_x0`, DCNv2's erase step 1.8 % faster, the spec model's 0.3 % (this alone).
    pub cross_grad_fold: bool,
    /// With `bf16_cross`, DCNv2's concatenated fields (its cross network's x0, which only
    /// the network's bf16 layers read) stored in bf16 alone (`Graph::set_bf16_x0`): the
    /// concat's pass writes no f32 tensor. The same values. On by default (measured with
    /// `cross_grad_fold`: DCNv2's erase step 1.8 % faster on an H100).
    pub bf16_x0: bool,
    /// Each cross update (`MulAdd`) fused with the linear layer whose output it reads
    /// (`erase_graph::fuse_cross_updates`): the CUDA plans compute the update in the
    /// GEMM's epilogue. The same values either way. Off by default: on an H100 it made
    /// the spec model's erase step 0.5 % faster at batch 4096 but 1.2 % slower at 16384,
    /// and DCNv2's 0.45 % slower (BENCHMARKS.md). An update of a network stored in bf16
    /// (`bf16_cross`) stays apart from its layer.
    pub fuse_cross_updates: bool,
    /// The weights' bf16 copies written by Adam beside the updated weights, kept across
    /// steps (`OptimizerConfig::copies_in_update`), instead of made by a RoundBf16 launch
    /// each in the next forward. The same bits either way.
    pub weight_copies_in_update: bool,
    /// Under ERASE, no join before the updates: each waits only for the gradients it
    /// reads, and the embedding tables' update runs beside the dense one (see
    /// `ScheduleConfig::updates_by_data`). Data-parallel steps join (they all-reduce there).
    pub updates_by_data: bool,
    /// The streams' priority levels; `None`: the occupancy model's choice under
    /// `Occupancy::Auto`, [`Priorities::RANKED`] otherwise.
    pub priorities: Option<Priorities>,
    /// The kernel paths the cost model plans each launch with (`--kernel-paths`; see
    /// `ScheduleConfig::plan_options`); `None`: the H200's defaults and the environment.
    pub plan_options: Option<erase_ops::cuda::PlanOptions>,
}

/// Least FLOPs of a layer given bf16 operand copies: the size from which the CUDA plans
/// round GEMM operands in passes of their own (the pipelined kernels).
pub const BF16_COPY_MIN_FLOPS: usize = 1 << 29;

impl Default for ScheduleOptions {
    fn default() -> Self {
        ScheduleOptions {
            side_streams: 5,
            occupancy: Occupancy::Auto,
            device: DeviceModel::h200(),
            early_updates: false,
            late_stream: true,
            weight_grad_streams: true,
            forward_streams: true,
            bf16_copies: true,
            bf16_copy_min_flops: BF16_COPY_MIN_FLOPS,
            bf16_storage: true,
            bf16_cross: true,
            cross_grad_fold: true,
            bf16_x0: true,
            fuse_cross_updates: false,
            weight_copies_in_update: true,
            updates_by_data: true,
            priorities: None,
            plan_options: None,
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
    /// What the occupancy model chose (with `--occupancy auto`).
    pub occupancy: Option<erase_runtime::program::simulate::OccupancyChoice>,
}

/// The schedule kind of a variant: `erase` starts backward programs early.
pub fn schedule_kind(v: Variant) -> ScheduleKind {
    match v {
        Variant::Erase => ScheduleKind::Early,
        Variant::Baseline | Variant::Detached => ScheduleKind::Serial,
    }
}

/// [`plan_step`] for one rank of data-parallel training. Each table's update sorts the
/// ids it gathers from every rank, so no `EmbeddingSort` of the local ids runs before it;
/// and an early program's gradients are all-reduced after its last launch, on that
/// launch's stream, so a program stays on one stream (no weight-gradient companions), and
/// the forward stays on the main stream (no forward streams: not measured across GPUs).
pub fn plan_step_data_parallel(
    cfg: &CtrConfig,
    float: DType,
    opt: &OptimizerConfig,
    sched: &ScheduleOptions,
) -> Result<StepPlan> {
    let opt = OptimizerConfig {
        presort_ids: false,
        ..*opt
    };
    let sched = ScheduleOptions {
        weight_grad_streams: false,
        updates_by_data: false,
        forward_streams: false,
        ..sched.clone()
    };
    plan_step(cfg, float, &opt, &sched)
}

/// Builds, differentiates, partitions, schedules and plans the model; proves the plan.
pub fn plan_step(
    cfg: &CtrConfig,
    float: DType,
    opt: &OptimizerConfig,
    sched: &ScheduleOptions,
) -> Result<StepPlan> {
    cfg.validate()?;
    let opt = &OptimizerConfig {
        copies_in_update: opt.copies_in_update && sched.weight_copies_in_update,
        ..*opt
    };
    let copies = sched.bf16_copies.then_some(sched.bf16_copy_min_flops);
    let storage = crate::model::ctr::Storage {
        products: sched.bf16_storage,
        cross: sched.bf16_cross,
        fold_plus_dy: sched.cross_grad_fold,
        x0: sched.bf16_x0,
    };
    let mut model = build_with(cfg, float, copies, storage).context("building the CTR model")?;
    let mut training = if sched.early_updates {
        erase_graph::make_trainable_early_updates(&mut model.graph, opt)
    } else {
        make_trainable(&mut model.graph, opt)
    }
    .context("differentiating the CTR model")?;
    if sched.fuse_cross_updates {
        erase_graph::fuse_cross_updates(&mut model.graph, &mut training);
    }
    let partition = partition(&model.graph, &training.grads);
    let scfg = ScheduleConfig {
        kind: schedule_kind(cfg.variant),
        side_streams: sched.side_streams.max(1),
        occupancy: sched.occupancy == Occupancy::On,
        exclusive_only: None,
        device: sched.device.clone(),
        kernels: Some(crate::kernels::library()).filter(|l| !l.modules.is_empty()),
        plan_options: sched.plan_options,
        late_stream: sched.late_stream,
        weight_grad_streams: sched.weight_grad_streams,
        forward_streams: sched.forward_streams,
        updates_by_data: sched.updates_by_data,
        priorities: Priorities::RANKED,
    };
    let (program, occupancy) = schedule_with_occupancy(
        &model.graph,
        &partition,
        scfg,
        sched.occupancy,
        sched.priorities,
    );
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
        occupancy,
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
    /// Held-out examples (stream 2, from index 0): exactly this many on one process (or
    /// all there are), whole global batches (at least one) with several ranks.
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
    /// Measure a kernel trace of these steps (CUDA only).
    pub trace: Option<TraceWindow>,
    /// Where the embedding tables live with several ranks (`--sharding`).
    pub sharding: crate::sharding::Sharding,
    /// Bytes of tables a rank may hold (`--rank-memory`), what the sharding plans for.
    pub rank_memory: u64,
    /// Set (by a signal, see [`crate::interrupt`]) to end the run after the step under
    /// way, with a checkpoint where one is asked for.
    pub stop: Option<&'static crate::interrupt::StopFlag>,
}

/// Which steps a measured trace covers: `steps` steps from step `start` (0-based).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceWindow {
    pub start: usize,
    pub steps: usize,
    /// Print the measured per-kernel table with this many longest launches (0: none).
    pub kernels: usize,
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
    /// `steps` steps of `model` on the synthetic data with every other setting at its
    /// default: seeds 0, evaluation at the end on one batch, one thread, the default
    /// schedule and optimizer, no warm-up, checkpoint or trace, blocking dispatch.
    pub fn new(model: CtrConfig, steps: usize) -> Self {
        TrainConfig {
            eval_examples: model.batch,
            model,
            steps,
            seed: 0,
            data_seed: 0,
            eval_every: 0,
            threads: 1,
            schedule: ScheduleOptions::default(),
            optimizer: OptimizerConfig::default(),
            warmup: 0,
            checkpoint: None,
            checkpoint_every: 0,
            resume: None,
            dispatch: Dispatch::default(),
            data: Data::default(),
            trace: None,
            sharding: crate::sharding::Sharding::Auto,
            rank_memory: crate::sharding::DEFAULT_RANK_MEMORY,
            stop: None,
        }
    }

    /// What must match between a checkpoint and the run that resumes it, key by key:
    /// the model's sizes and variant, the optimizer, the seeds, and the training data by
    /// its content (a checksum of the parsed examples), not by its path.
    pub fn identity(&self) -> Vec<(String, String)> {
        let mut v = vec![("variant".to_string(), self.model.variant.to_string())];
        v.extend(crate::checkpoint::flatten_debug(
            "model",
            &format!("{:?}", self.model),
        ));
        // where the weights' bf16 copies are made changes no value: a checkpoint resumes
        // under either (and those written before the switch existed)
        v.extend(
            crate::checkpoint::flatten_debug("optimizer", &format!("{:?}", self.optimizer))
                .into_iter()
                .filter(|(k, _)| k != "optimizer.copies_in_update"),
        );
        v.push(("seed".into(), self.seed.to_string()));
        v.push(("data_seed".into(), self.data_seed.to_string()));
        v.push((
            "data".into(),
            match &self.data {
                Data::Synthetic => "synthetic".to_string(),
                Data::Table { train, .. } => format!(
                    "{} training examples, content checksum {:016x}",
                    train.len(),
                    train.digest()
                ),
            },
        ));
        v
    }

    /// [`TrainConfig::identity`] as one line (`key = value; ...`), for rendezvous tags.
    pub fn identity_text(&self) -> String {
        self.identity()
            .iter()
            .map(|(k, v)| format!("{k} = {v}"))
            .collect::<Vec<_>>()
            .join("; ")
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

/// The batches of `b` that evaluate exactly `n` examples (at least 1) on one process,
/// and how many of the last one's count: its tail (wrapped around to the first
/// examples) is left out.
pub(crate) fn eval_batches(n: usize, b: usize) -> (usize, usize) {
    let n = n.max(1);
    let batches = n.div_ceil(b);
    (batches, n - (batches - 1) * b)
}

/// An evaluation's examples (the held-out ones, or `eval --examples all`'s): each one's
/// main logit and label, in the order evaluated.
#[derive(Clone, Debug, Default)]
pub struct Scored {
    pub logits: Vec<f64>,
    pub labels: Vec<f64>,
}

#[derive(Clone, Debug)]
pub struct TrainReport {
    pub losses: Vec<f64>,
    /// Each step's time in seconds, in step order (traced steps included).
    pub step_secs: Vec<f64>,
    pub evals: Vec<Eval>,
    pub qps: Option<QpsSummary>,
    pub arena_bytes: usize,
    pub launches: usize,
    /// Seconds the steps waited for the loader thread in all.
    pub loader_stall_secs: f64,
    /// The measured trace, when asked for.
    pub trace: Option<Trace>,
    /// Where the traced steps' time went (see [`crate::profile`]), when asked for.
    pub kernel_table: Option<String>,
    /// The step after which the run was stopped (`TrainConfig::stop`) before its last.
    pub interrupted: Option<usize>,
    /// Whether a stopped run wrote its checkpoint (not over a file that was there before
    /// the run and that the run had not written yet).
    pub interrupted_saved: bool,
}

/// Where progress goes: a live line on a terminal, plain lines otherwise.
pub trait Progress {
    fn step(&mut self, step: usize, steps: usize, loss: f64, qps: f64);
    fn eval(&mut self, e: &Eval);
}

/// Progress that goes nowhere (the ranks other than 0, tests).
pub struct Quiet;

impl Progress for Quiet {
    fn step(&mut self, _: usize, _: usize, _: f64, _: f64) {}
    fn eval(&mut self, _: &Eval) {}
}

/// One data-parallel rank's share of every global batch: examples `i` of it with
/// `i mod world = rank`, in order (the spec's split).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Share {
    pub rank: usize,
    pub world: usize,
}

impl Share {
    /// This rank's examples of the global batch `all` into `mine` (each buffer row-major
    /// per example; `per` is the dense values and the ids of one example).
    fn take(
        self,
        per: (usize, usize),
        all: (&[f32], &[u32], &[f32]),
        mine: (&mut [f32], &mut [u32], &mut [f32]),
    ) {
        let ((nd, ns), (gd, gr, gy), (d, r, y)) = (per, all, mine);
        for (j, i) in (self.rank..gy.len()).step_by(self.world).enumerate() {
            d[j * nd..(j + 1) * nd].copy_from_slice(&gd[i * nd..(i + 1) * nd]);
            r[j * ns..(j + 1) * ns].copy_from_slice(&gr[i * ns..(i + 1) * ns]);
            y[j] = gy[i];
        }
    }
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
    /// One whole step, finished; returns its time in seconds (device time where there is
    /// one).
    fn step(&mut self) -> Result<f64>;
    /// Only the given launches (indices into the program), in order, then wait.
    fn run_launches(&mut self, which: &[usize]) -> Result<()>;
    fn get(&self, t: Tensor) -> Result<Buffer>;
    /// Sets up stepping from packed batches (see [`crate::data::loader`]): returns `n` slots of
    /// `layout.bytes` for a loader to fill; each step reads back `readback` (scalars).
    fn slots(
        &mut self,
        layout: &InputLayout,
        readback: &[Tensor],
        n: usize,
    ) -> Result<Vec<SlotMem>>;
    /// Issues step `step` on the packed batch in `mem` (slot `slot`); may return before
    /// the step has run.
    fn issue(&mut self, step: u64, slot: usize, mem: &SlotMem) -> Result<()>;
    /// Waits for step `step` (the latest or the one before it) and returns its read-back
    /// values and its time in seconds (device time where there is a device).
    fn finish(&mut self, step: u64) -> Result<(Vec<f64>, f64)>;
    /// The next step's time starts afresh (an evaluation or a checkpoint came between).
    fn restart_timing(&mut self) {}
    /// Traces the steps issued from now on (`true`), or stops tracing.
    fn set_tracing(&mut self, _on: bool) -> Result<()> {
        bail!("a measured trace needs a CUDA device (`erase-ctr plan --trace` writes the predicted one)")
    }
    /// Traces (`true`) the launches `which` of the steps issued from now on, besides
    /// those traced already; `false` stops tracing.
    fn set_tracing_of(&mut self, _on: bool, _which: &[usize]) -> Result<()> {
        bail!("a measured trace needs a CUDA device")
    }
    /// The last traced step's times, once it has finished.
    fn traced_step(&self) -> Result<MeasuredStep> {
        bail!("a measured trace needs a CUDA device")
    }
}

/// The CPU runner with what stepping from packed batches needs.
pub struct CpuExec<'a> {
    runner: ProgramRunner<'a>,
    layout: Option<InputLayout>,
    readback: Vec<Tensor>,
    done: Vec<(u64, Vec<f64>, f64)>,
}

impl<'a> CpuExec<'a> {
    pub fn new(runner: ProgramRunner<'a>) -> Self {
        CpuExec {
            runner,
            layout: None,
            readback: Vec::new(),
            done: Vec::new(),
        }
    }

    /// The runner the step runs on.
    pub(crate) fn runner(&mut self) -> &mut ProgramRunner<'a> {
        &mut self.runner
    }

    /// Feeds the step's inputs from a loader slot.
    pub(crate) fn load(&mut self, mem: &SlotMem) -> Result<()> {
        let layout = self
            .layout
            .as_ref()
            .ok_or_else(|| anyhow::anyhow!("stepping from batches needs slots first"))?;
        for (k, &(t, _, _)) in layout.inputs.iter().enumerate() {
            let dt = self.runner.graph().dtype(t);
            self.runner
                .feed(t, buffer_from_bytes(dt, &mem[layout.range(k)]))?;
        }
        Ok(())
    }

    /// Records step `step` as done in `secs`, with its read-back values as they are now.
    pub(crate) fn done_at(&mut self, step: u64, secs: f64) {
        let values = self
            .readback
            .iter()
            .map(|&t| {
                self.runner
                    .get(t)
                    .and_then(|x| x.to_f64().first().copied())
                    .unwrap_or(f64::NAN)
            })
            .collect();
        self.done.push((step, values, secs));
    }
}

impl crate::checkpoint::TensorStore for CpuExec<'_> {
    fn read(&self, t: Tensor) -> Result<Buffer> {
        crate::checkpoint::TensorStore::read(&self.runner, t)
    }
    fn visit(&self, t: Tensor, f: &mut dyn FnMut(&Buffer) -> Result<()>) -> Result<()> {
        crate::checkpoint::TensorStore::visit(&self.runner, t, f)
    }
    fn write(&mut self, t: Tensor, b: Buffer) -> Result<()> {
        crate::checkpoint::TensorStore::write(&mut self.runner, t, b)
    }
}

impl StepExec for CpuExec<'_> {
    fn feed(&mut self, t: Tensor, b: Buffer) -> Result<()> {
        Ok(self.runner.feed(t, b)?)
    }
    fn step(&mut self) -> Result<f64> {
        let t0 = Instant::now();
        self.runner.run()?;
        Ok(t0.elapsed().as_secs_f64())
    }
    fn run_launches(&mut self, which: &[usize]) -> Result<()> {
        Ok(self.runner.run_order(which)?)
    }
    fn get(&self, t: Tensor) -> Result<Buffer> {
        self.runner
            .get(t)
            .ok_or_else(|| anyhow::anyhow!("'{}' has no value", t.index()))
    }
    fn slots(
        &mut self,
        layout: &InputLayout,
        readback: &[Tensor],
        n: usize,
    ) -> Result<Vec<SlotMem>> {
        self.layout = Some(layout.clone());
        self.readback = readback.to_vec();
        Ok((0..n)
            .map(|_| SlotMem::Host(vec![0; layout.bytes]))
            .collect())
    }
    fn issue(&mut self, step: u64, _slot: usize, mem: &SlotMem) -> Result<()> {
        self.load(mem)?;
        let t0 = Instant::now();
        self.runner.run()?;
        self.done_at(step, t0.elapsed().as_secs_f64());
        Ok(())
    }
    fn finish(&mut self, step: u64) -> Result<(Vec<f64>, f64)> {
        let i = self
            .done
            .iter()
            .position(|d| d.0 == step)
            .ok_or_else(|| anyhow::anyhow!("step {step} was not issued"))?;
        let (_, v, secs) = self.done.remove(i);
        Ok((v, secs))
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
    fn slots(
        &mut self,
        layout: &InputLayout,
        readback: &[Tensor],
        n: usize,
    ) -> Result<Vec<SlotMem>> {
        let inputs: Vec<Tensor> = layout.inputs.iter().map(|x| x.0).collect();
        let mine = self.enable_pipeline(&inputs, n, readback)?;
        if mine != *layout {
            bail!("the device's input layout differs from the loader's");
        }
        (0..n)
            .map(|_| Ok(SlotMem::Pinned(self.device().pinned(layout.bytes)?)))
            .collect()
    }
    fn issue(&mut self, step: u64, slot: usize, mem: &SlotMem) -> Result<()> {
        match mem {
            SlotMem::Pinned(p) => Ok(self.step_from(step, slot, p)?),
            SlotMem::Host(_) => bail!("the CUDA step copies batches from pinned memory only"),
        }
    }
    fn finish(&mut self, step: u64) -> Result<(Vec<f64>, f64)> {
        let v = self.step_values(step)?;
        Ok((
            v.values.iter().map(|&x| f64::from(x)).collect(),
            f64::from(v.ms) * 1e-3,
        ))
    }
    fn restart_timing(&mut self) {
        CudaProgram::restart_timing(self);
    }
    fn set_tracing(&mut self, on: bool) -> Result<()> {
        Ok(CudaProgram::set_tracing(self, on)?)
    }
    fn set_tracing_of(&mut self, on: bool, which: &[usize]) -> Result<()> {
        Ok(CudaProgram::set_tracing_of(self, on, which)?)
    }
    fn traced_step(&self) -> Result<MeasuredStep> {
        Ok(CudaProgram::traced_step(self)?)
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
    // a checkpoint that cannot be written must fail now, not after every step is trained
    if let Some(p) = &cfg.checkpoint {
        crate::checkpoint::check_writable(p).context("--checkpoint")?;
    }
    // the CPU's GEMMs are f32: no bf16 copies of their operands there
    let sched = ScheduleOptions {
        bf16_copies: cfg.schedule.bf16_copies && dev.is_some(),
        ..cfg.schedule.clone()
    };
    let plan = plan_step(&cfg.model, DType::F32, &cfg.optimizer, &sched)?;
    run_training(cfg, &plan, dev, progress)
}

#[derive(Clone)]
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

/// Where a run's batches come from: the spec's generator, or loaded examples (checked
/// against the model `mc`: its fields, its bags, at least one batch of each split).
fn source_of(data: &Data, mc: &CtrConfig, data_seed: u64) -> Result<Source> {
    Ok(match data {
        Data::Synthetic => Source::Synthetic(
            SyntheticCtr::try_new(SyntheticConfig {
                seed: data_seed,
                rows: mc.rows,
                hot: mc.hot,
            })
            .map_err(|e| anyhow::anyhow!("synthetic data: {e}"))?,
        ),
        Data::Table { train, eval, .. } => {
            let one_hot = mc.bag_slots().iter().all(|&h| h == 1);
            if train.num_dense != mc.num_dense
                || train.num_sparse != mc.num_sparse
                || (!train.is_multi_hot() && !one_hot)
            {
                bail!(
                    "the data has {} dense and {} categorical fields ({}); the model expects {} and {} (bag slots {:?})",
                    train.num_dense,
                    train.num_sparse,
                    if train.is_multi_hot() { "multi-hot" } else { "one id each" },
                    mc.num_dense,
                    mc.num_sparse,
                    mc.bag_slots()
                );
            }
            // training draws whole batches from its split; an evaluation reads any count
            // (its last batch's tail wraps around, left out). One set as both is `eval
            // --examples all`, which trains on nothing.
            let evaluation_only = std::sync::Arc::ptr_eq(train, eval);
            if eval.is_empty() || (!evaluation_only && train.len() < mc.batch) {
                bail!(
                    "{} training and {} held-out examples: training needs at least one batch of {}, evaluation one example",
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
    })
}

/// The batches of a run, as the single-process trainer takes them: global batch `k` of
/// the training data is examples `k·B ..` of the spec's stream 1, or of this epoch's
/// shuffled order of the loaded examples. Data-parallel ranks take their shards of it.
pub struct BatchSource {
    src: Source,
}

impl BatchSource {
    /// The batches of `data` for the model `global` (its batch the global batch).
    pub fn new(data: &Data, global: &CtrConfig, data_seed: u64) -> Result<BatchSource> {
        Ok(BatchSource {
            src: source_of(data, global, data_seed)?,
        })
    }

    /// Training batch `step` of `cfg.batch` examples into row-major buffers (as
    /// `CtrModel::batch_buffers` takes them).
    pub fn fill(
        &mut self,
        cfg: &CtrConfig,
        step: usize,
        (dense, rows, labels): (&mut [f32], &mut [u32], &mut [f32]),
    ) {
        let (fr, slots) = (cfg.field_rows(), cfg.bag_slots());
        fill_from(
            &mut self.src,
            (cfg.batch, &fr, &slots),
            1,
            (step * cfg.batch) as u64,
            (dense, rows, labels),
        );
    }
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

/// Fills `dense`, `rows` and `labels` with batch `first / batch` of the training data
/// (stream 1) or of the held-out data (stream 2).
fn fill_from(
    src: &mut Source,
    (batch, field_rows, slots): (usize, &[usize], &[usize]),
    stream: u64,
    first: u64,
    (dense, rows, labels): (&mut [f32], &mut [u32], &mut [f32]),
) {
    let b = batch;
    match src {
        Source::Synthetic(gen) => {
            gen.fill_batch(stream, first, b, dense, rows, labels);
            // per-field sizes smaller than the generator's `rows`: field j's row mod its size
            let ns = field_rows.len();
            if field_rows.iter().any(|&r| r != gen.rows()) && ns > 0 {
                let hot = rows.len() / (b * ns).max(1);
                for (i, r) in rows.iter_mut().enumerate() {
                    *r %= field_rows[(i / hot) % ns] as u32;
                }
            }
        }
        Source::Table { eval, .. } if stream == 2 => {
            let slots = eval.is_multi_hot().then_some(slots);
            eval.fill_batch_rows(first, b, field_rows, slots, dense, rows, labels)
        }
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
            train.fill_batch_indices_rows(
                &order[i * b..(i + 1) * b],
                field_rows,
                train.is_multi_hot().then_some(slots),
                dense,
                rows,
                labels,
            );
        }
    }
}

/// One finished training step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepResult {
    /// Steps done once this one is (1 for the first).
    pub step: usize,
    /// The main loss.
    pub loss: f64,
    /// The step's time in seconds (on a device: from the previous step's end to this
    /// one's, on the main stream).
    pub secs: f64,
}

/// Batches the loader keeps: one being read back, one running, two being prepared.
const LOADER_SLOTS: usize = 4;

/// A step program on a device with its data: steps and evaluations one at a time.
///
/// Training steps are pipelined: [`Session::train_step`] issues a step on a batch the
/// loader thread prepared, and hands back the step before it (on a CUDA device; on the
/// CPU every step is finished when issued). [`Session::drain`] waits for the last one.
pub struct Session<'a> {
    plan: &'a StepPlan,
    // declared before the loader: dropping it waits for the device, after which the
    // loader's pinned slots may be freed
    exec: Box<dyn StepExec + 'a>,
    loader: Option<Loader>,
    /// Issued steps not yet finished, with their slots (oldest first).
    in_flight: std::collections::VecDeque<(u64, usize, SlotMem)>,
    /// How many steps may be in flight before the oldest is waited for.
    depth: usize,
    src: Source,
    /// The rank's share of each global batch it trains on (`None`: all of it).
    share: Option<Share>,
    forward: Vec<usize>,
    dense: Vec<f32>,
    rows: Vec<u32>,
    labels: Vec<f32>,
    /// Steps issued.
    pub step: usize,
    /// Whether a rank evaluates its own replica after the last step (a rank of sharded
    /// tables, whose whole model may not fit one device) instead of rank 0 evaluating
    /// the gathered replica at the global batch.
    pub evaluate_at_end: bool,
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
        let (exec, depth): (Box<dyn StepExec + 'a>, usize) = match (dev, dispatch) {
            (None, Dispatch::Blocking) => (
                Box::new(CpuExec::new(ProgramRunner::new(
                    &m.graph,
                    &plan.program,
                    &plan.memory,
                    seed,
                    threads,
                )?)),
                1,
            ),
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
                (Box::new(p), 2)
            }
        };
        Self::with_exec(plan, exec, depth, data, data_seed, None)
    }

    /// A session on a step executor of the caller's (a data-parallel rank's, say) that
    /// may run `depth` steps ahead; with `share`, each training batch is that rank's
    /// share of the global batch (the plan's batch times the world).
    pub fn with_exec(
        plan: &'a StepPlan,
        exec: Box<dyn StepExec + 'a>,
        depth: usize,
        data: &Data,
        data_seed: u64,
        share: Option<Share>,
    ) -> Result<Self> {
        let mc = &plan.model.cfg;
        let global = CtrConfig {
            batch: mc.batch * share.map_or(1, |s| s.world),
            ..mc.clone()
        };
        let src = source_of(data, &global, data_seed)?;
        let m = &plan.model;
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
            loader: None,
            in_flight: Default::default(),
            depth: depth.max(1),
            src,
            share,
            forward,
            dense: vec![0.0; mc.batch * mc.num_dense],
            rows: vec![0; mc.ids_per_batch()],
            labels: vec![0.0; mc.batch],
            step: 0,
            evaluate_at_end: false,
        })
    }

    /// The ranks the global batch is shared by (1: one process).
    fn world(&self) -> usize {
        self.share.map_or(1, |s| s.world)
    }

    /// Starts the loader thread at the next step's batch, with the device's slots.
    fn start_loader(&mut self) -> Result<()> {
        let m = &self.plan.model;
        let layout = InputLayout::new(&m.graph, &m.inputs.in_batch_order());
        let mut readback = vec![m.main_loss];
        readback.extend(m.aux_losses.iter().map(|x| x.1));
        let slots = self.exec.slots(&layout, &readback, LOADER_SLOTS)?;
        let mut src = self.src.clone();
        let (cfg, float, share) = (m.cfg.clone(), m.float, self.share);
        let (mut dense, mut rows, mut labels) = (
            vec![0f32; cfg.batch * cfg.num_dense],
            vec![0u32; cfg.ids_per_batch()],
            vec![0f32; cfg.batch],
        );
        // a rank fills the whole global batch, then takes its share of it
        let gb = cfg.batch * self.world();
        let per = (cfg.num_dense, cfg.slots_per_example());
        let mut all = share.map(|_| {
            (
                vec![0f32; gb * per.0],
                vec![0u32; gb * per.1],
                vec![0f32; gb],
            )
        });
        let (field_rows, bag_slots) = (cfg.field_rows(), cfg.bag_slots());
        let fill = move |k: u64, out: &mut [u8]| -> Result<()> {
            match (share, all.as_mut()) {
                (Some(sh), Some((gd, gr, gy))) => {
                    fill_from(
                        &mut src,
                        (gb, &field_rows, &bag_slots),
                        1,
                        k * gb as u64,
                        (gd, gr, gy),
                    );
                    sh.take(per, (gd, gr, gy), (&mut dense, &mut rows, &mut labels));
                }
                _ => fill_from(
                    &mut src,
                    (cfg.batch, &field_rows, &bag_slots),
                    1,
                    k * cfg.batch as u64,
                    (&mut dense, &mut rows, &mut labels),
                ),
            }
            let (d, i, o, l) =
                crate::model::ctr::batch_buffers(&cfg, float, &dense, &rows, &labels)?;
            for (j, b) in [d, i, o, l].iter().enumerate() {
                let r = layout.range(j);
                if r.len() != b.bytes().len() {
                    bail!(
                        "input {j} has {} bytes, its slot {}",
                        b.bytes().len(),
                        r.len()
                    );
                }
                out[r].copy_from_slice(b.bytes());
            }
            Ok(())
        };
        self.loader = Some(Loader::start(slots, self.step as u64, Box::new(fill))?);
        Ok(())
    }

    /// Feeds batch `first / batch` of the training data (stream 1) or of the held-out
    /// data (stream 2), synchronously (evaluation; training goes through the loader).
    fn feed(&mut self, stream: u64, first: u64) -> Result<()> {
        let m = &self.plan.model;
        fill_from(
            &mut self.src,
            (m.cfg.batch, &m.cfg.field_rows(), &m.cfg.bag_slots()),
            stream,
            first,
            (&mut self.dense, &mut self.rows, &mut self.labels),
        );
        let (d, i, o, l) = m.batch_buffers(&self.dense, &self.rows, &self.labels)?;
        self.exec.feed(m.inputs.dense, d)?;
        self.exec.feed(m.inputs.ids, i)?;
        self.exec.feed(m.inputs.offsets, o)?;
        self.exec.feed(m.inputs.label, l)?;
        Ok(())
    }

    /// Issues the next training step on the loader's next batch, and returns the oldest
    /// step in flight once more are in flight than the device runs ahead (on a CUDA
    /// device the step before this one, so the losses are read one step late without
    /// stopping the GPU; on the CPU this one). A non-finite loss is an error naming the
    /// step and the block.
    pub fn train_step(&mut self) -> Result<Option<StepResult>> {
        if self.loader.is_none() {
            self.start_loader()?;
        }
        let loader = self
            .loader
            .as_mut()
            .ok_or_else(|| anyhow::anyhow!("no loader"))?;
        let f = loader.next_batch()?;
        let step = self.step as u64;
        if f.batch != step {
            bail!("the loader gave batch {} for step {step}", f.batch);
        }
        // the range's name is only built when a profiler listens
        let range = erase_runtime::cuda::nvtx::enabled()
            .then(|| erase_runtime::cuda::nvtx::range(&format!("step {step}")));
        self.exec
            .issue(step, f.slot, &f.mem)
            .with_context(|| format!("step {step}"))?;
        drop(range);
        self.in_flight.push_back((step, f.slot, f.mem));
        self.step += 1;
        if self.in_flight.len() >= self.depth {
            return self.finish_oldest().map(Some);
        }
        Ok(None)
    }

    /// Waits for the steps in flight; returns the last one's result.
    pub fn drain(&mut self) -> Result<Option<StepResult>> {
        let mut last = None;
        while !self.in_flight.is_empty() {
            last = Some(self.finish_oldest()?);
        }
        self.exec.restart_timing();
        Ok(last)
    }

    /// [`Session::train_step`] and [`Session::drain`]: one whole step, finished.
    pub fn train_step_now(&mut self) -> Result<StepResult> {
        let a = self.train_step()?;
        let b = self.drain()?;
        b.or(a)
            .ok_or_else(|| anyhow::anyhow!("the step gave no result"))
    }

    /// Runs `steps` training steps traced (one at a time: each is waited for before the
    /// next, so the marks of one step are read before the next overwrites them) and
    /// returns their measured trace and results. CUDA only.
    pub fn trace_steps(&mut self, steps: usize) -> Result<(Trace, Vec<StepResult>)> {
        let mut results = Vec::new();
        if let Some(r) = self.drain()? {
            results.push(r);
        }
        let mut trace = Trace::new(&self.plan.program, "measured (CUDA events)");
        self.exec.set_tracing(true)?;
        let traced = (|| -> Result<()> {
            for _ in 0..steps {
                let step = self.step;
                results.extend(self.train_step()?);
                results.extend(self.drain()?);
                let m = self.exec.traced_step()?;
                trace.push_measured(&self.plan.program, &self.plan.model.graph, step, &m);
            }
            Ok(())
        })();
        self.exec.set_tracing(false)?;
        traced?;
        Ok((trace, results))
    }

    /// A tensor's value now (a parameter, a state); no step may be in flight.
    pub fn read(&self, t: Tensor) -> Result<Buffer> {
        if !self.in_flight.is_empty() {
            bail!(
                "read: {} steps in flight; drain them first",
                self.in_flight.len()
            );
        }
        self.exec.get(t)
    }

    /// The time training waited for the loader so far.
    pub fn loader_stall(&self) -> std::time::Duration {
        self.loader
            .as_ref()
            .map_or(std::time::Duration::ZERO, |l| l.stalled)
    }

    fn finish_oldest(&mut self) -> Result<StepResult> {
        let (step, slot, mem) = self
            .in_flight
            .pop_front()
            .ok_or_else(|| anyhow::anyhow!("no step in flight"))?;
        let (values, secs) = self
            .exec
            .finish(step)
            .with_context(|| format!("step {step}"))?;
        if let Some(l) = self.loader.as_mut() {
            l.give_back(slot, mem);
        }
        let m = &self.plan.model;
        let loss = values.first().copied().unwrap_or(f64::NAN);
        if !loss.is_finite() {
            bail!("step {step}: the main loss (block 'top') is {loss}; training stopped");
        }
        for ((block, _), &a) in m.aux_losses.iter().zip(values.iter().skip(1)) {
            if !a.is_finite() {
                bail!(
                    "step {step}: the auxiliary loss of block '{block}' is {a}; training stopped"
                );
            }
        }
        Ok(StepResult {
            step: step as usize + 1,
            loss,
            secs,
        })
    }

    /// NE and AUC on `examples` held-out examples (stream 2, whole batches). Waits for
    /// the steps in flight first.
    pub fn evaluate(&mut self, examples: usize) -> Result<Eval> {
        self.evaluate_with(examples, &mut |_, _| {})
    }

    /// [`Session::evaluate`], calling `progress(done, total)` with the examples evaluated
    /// after each batch.
    pub fn evaluate_with(
        &mut self,
        examples: usize,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Eval> {
        self.evaluate_scored(examples, progress).map(|(e, _)| e)
    }

    /// [`Session::evaluate_with`], with each evaluated example's main logit and label, in
    /// the order evaluated (for `eval --predictions`).
    pub fn evaluate_scored(
        &mut self,
        examples: usize,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<(Eval, Scored)> {
        let _range = erase_runtime::cuda::nvtx::range("eval");
        if !self.in_flight.is_empty() {
            bail!(
                "evaluate: {} steps in flight; drain them first",
                self.in_flight.len()
            );
        }
        let m = &self.plan.model;
        let b = m.cfg.batch;
        let mut ne = NeState::default();
        let (mut scores, mut ys) = (Vec::new(), Vec::new());
        let available = match &self.src {
            Source::Synthetic(_) => examples,
            Source::Table { eval, .. } => examples.min(eval.len()),
        };
        // one process: exactly `available` examples, the last batch's tail (wrapped
        // around to the first examples) left out; ranks: whole global batches, so that a
        // rank evaluates the examples one process would
        let world = self.world();
        let (batches, last) = if world == 1 {
            eval_batches(available, b)
        } else {
            ((available / (b * world)).max(1) * world, b)
        };
        let total = (batches - 1) * b + last;
        for k in 0..batches {
            progress(k * b, total);
            self.feed(2, (k * b) as u64)?;
            self.exec.run_launches(&self.forward)?;
            let keep = if k + 1 == batches { last } else { b };
            let mut logits = self.exec.get(m.logit)?.to_f64();
            let mut lab = self.exec.get(m.inputs.label)?.to_f64();
            logits.truncate(keep);
            lab.truncate(keep);
            ne.update(&logits, &lab);
            scores.extend(logits);
            ys.extend(lab);
        }
        self.exec.restart_timing();
        if let Some(class) = one_class(&ys) {
            if ys.len() < 100 {
                bail!(
                    "the {} held-out examples are all {class}: NE and AUC are undefined on one class; evaluate more examples (--eval-examples)",
                    ys.len()
                );
            }
            bail!(
                "the {} held-out examples are all {class}: NE and AUC are undefined on one class (is the label right? a rating needs label_threshold in the schema)",
                ys.len()
            );
        }
        let e = Eval {
            step: self.step,
            ne: ne.ne().unwrap_or(f64::NAN),
            auc: auc(&scores, &ys).unwrap_or(f64::NAN),
            examples: ys.len(),
        };
        Ok((
            e,
            Scored {
                logits: scores,
                labels: ys,
            },
        ))
    }

    /// Sets a tensor of the program (a parameter or optimizer state, say); the step's
    /// next run reads it.
    pub fn write_tensor(&mut self, t: Tensor, b: Buffer) -> Result<()> {
        self.drain()?;
        self.exec.write(t, b)
    }

    pub fn save(&self, path: &std::path::Path, identity: &[(String, String)]) -> Result<()> {
        if !self.in_flight.is_empty() {
            bail!(
                "save: {} steps in flight; drain them first",
                self.in_flight.len()
            );
        }
        let global = self.plan.model.cfg.batch * self.world();
        let st = crate::checkpoint::CheckpointState {
            step: self.step as u64,
            next_example: (self.step * global) as u64,
            identity: identity.to_vec(),
        };
        crate::checkpoint::save(path, &self.plan.model.graph, self.exec.as_ref(), &st)
    }

    pub fn resume(&mut self, path: &std::path::Path, identity: &[(String, String)]) -> Result<()> {
        self.drain()?;
        let st = crate::checkpoint::load(
            path,
            &self.plan.model.graph,
            self.exec.as_mut(),
            Some(identity),
        )?;
        self.step = st.step as usize;
        // the loader restarts at the resumed step's batch
        self.loader = None;
        Ok(())
    }

    /// Loads a checkpoint's tensors for evaluation: shapes must fit, the training
    /// configuration may differ. Returns the step it was written at.
    pub fn load_weights(&mut self, path: &std::path::Path) -> Result<u64> {
        self.drain()?;
        let st = crate::checkpoint::load(path, &self.plan.model.graph, self.exec.as_mut(), None)?;
        Ok(st.step)
    }
}

/// Floating-point operations of one training step of `plan`: the sum over its launches
/// of their cost estimates' FLOPs (forward, backward and updates), the count MFU is
/// quoted with.
pub fn step_flops(plan: &StepPlan) -> f64 {
    plan.program
        .launches
        .iter()
        .filter_map(|l| l.spec.as_ref().map(|s| s.flops))
        .sum()
}

/// `Some("positive")` or `Some("negative")` when every label is of that class.
pub fn one_class(labels: &[f64]) -> Option<&'static str> {
    let pos = labels.iter().filter(|&&y| y > 0.5).count();
    match pos {
        0 => Some("negative (label 0)"),
        n if n == labels.len() => Some("positive (label 1)"),
        _ => None,
    }
}

/// Bytes a step plan holds: its persistent tensors (parameters, embedding tables and
/// their optimizer state, the weights' bf16 copies) and its arena; and of those, the
/// embedding tables'.
pub fn plan_bytes(plan: &StepPlan) -> (u64, u64) {
    let g = &plan.model.graph;
    let tables = plan.model.table;
    let (mut all, mut emb) = (plan.memory.arena_bytes as u64, 0u64);
    // the weights' bf16 copies too: kept across steps, though not checkpointed
    let kept = |t: Tensor| {
        g.is_persistent(t) || matches!(g.leaf(t), Some(erase_graph::Leaf::ParamCopy { .. }))
    };
    for t in g.tensors().filter(|&t| kept(t)) {
        let b = (g.shape(t).numel() * g.dtype(t).size_bytes()) as u64;
        all += b;
        // the tables and the row-wise state beside them (same rows)
        if t == tables || g.shape(t).dims().first() == g.shape(tables).dims().first() {
            emb += b;
        }
    }
    (all, emb)
}

/// Memory this machine (`None`) or device has for a run, in bytes, if it can tell.
pub(crate) fn available_memory(dev: Option<&CudaDevice>) -> Option<u64> {
    match dev {
        Some(d) => d.memory_info().ok().map(|(free, _)| free as u64),
        None => {
            let text = std::fs::read_to_string("/proc/meminfo").ok()?;
            let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
            let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
            Some(kb * 1024)
        }
    }
}

/// Refuses, before anything is allocated, a plan larger than the memory there is.
pub fn check_memory(plan: &StepPlan, dev: Option<&CudaDevice>) -> Result<()> {
    let (need, tables) = plan_bytes(plan);
    let Some(have) = available_memory(dev) else {
        return Ok(());
    };
    if need > have {
        let c = &plan.model.cfg;
        let gb = |b: u64| b as f64 / 1e9;
        bail!(
            "the model needs {:.1} GB, of which the embedding tables ({} fields, {} rows in all, dim {}, with their optimizer state) take {:.1} GB, but {} has {:.1} GB free; {}",
            gb(need),
            c.num_sparse,
            c.field_rows().iter().sum::<usize>(),
            c.dim,
            gb(tables),
            if dev.is_some() { "the GPU" } else { "this machine" },
            gb(have),
            if tables * 2 >= need {
                "use fewer rows per table (--rows, or per-field sizes)"
            } else {
                "the dense layers and their activations take most of it: use a smaller batch (--batch) or narrower layers"
            }
        );
    }
    Ok(())
}

fn run_training(
    cfg: &TrainConfig,
    plan: &StepPlan,
    dev: Option<&CudaDevice>,
    progress: &mut dyn Progress,
) -> Result<TrainReport> {
    erase_runtime::cuda::nvtx::name_os_thread("erase-main");
    check_memory(plan, dev)?;
    let mut s = Session::with_dispatch(
        plan,
        dev,
        cfg.dispatch,
        &cfg.data,
        cfg.seed,
        cfg.data_seed,
        cfg.threads,
    )?;
    drive(cfg, &mut s, progress, None)
}

/// The training loop, for one device and for every data-parallel rank alike: resume,
/// steps through the loader, the trace window, periodic held-out evaluation,
/// checkpoints (atomically; with several ranks rank 0 writes them, at the global
/// batch's position), progress. A rank (`rank` given) leaves the final evaluation to
/// the run's report, which evaluates the replica at the global batch.
pub fn drive(
    cfg: &TrainConfig,
    s: &mut Session<'_>,
    progress: &mut dyn Progress,
    rank: Option<Share>,
) -> Result<TrainReport> {
    let plan = s.plan;
    let b = cfg.model.batch;
    let mut report = TrainReport {
        losses: Vec::with_capacity(cfg.steps),
        step_secs: Vec::with_capacity(cfg.steps),
        evals: Vec::new(),
        qps: None,
        arena_bytes: plan.memory.arena_bytes,
        launches: plan.program.launches.len(),
        interrupted: None,
        interrupted_saved: false,
        loader_stall_secs: 0.0,
        trace: None,
        kernel_table: None,
    };
    let writes = rank.is_none_or(|r| r.rank == 0);
    if writes {
        if let Some(p) = &cfg.checkpoint {
            crate::checkpoint::check_writable(p).context("--checkpoint")?;
        }
    }
    let mut qps = Vec::new();
    // computed once: it reads every training example for the data's checksum
    let identity = if cfg.resume.is_some() || cfg.checkpoint.is_some() {
        cfg.identity()
    } else {
        Vec::new()
    };
    let who = rank.map_or(String::new(), |r| format!("rank {}: ", r.rank));
    if let Some(path) = &cfg.resume {
        s.resume(path, &identity)
            .with_context(|| format!("{who}resuming"))?;
        if s.step >= cfg.steps {
            bail!(
                "{} is already at step {}; ask for more --steps than that",
                path.display(),
                s.step
            );
        }
        if writes {
            eprintln!("resumed from {} at step {}", path.display(), s.step);
        }
    }
    let mut record = |r: StepResult, report: &mut TrainReport, progress: &mut dyn Progress| {
        report.losses.push(r.loss);
        report.step_secs.push(r.secs);
        let q = b as f64 / r.secs.max(1e-12);
        if r.step > cfg.warmup {
            qps.push(q);
        }
        progress.step(r.step, cfg.steps, r.loss, q);
    };
    let mut evals = Vec::new();
    let window = cfg.trace.map(|w| {
        let start = w.start.min(cfg.steps.saturating_sub(1));
        (start, w.steps.clamp(1, cfg.steps - start))
    });
    // a stopped run writes its checkpoint where it is its own: a file it resumed from or
    // has written, or none that was there before
    let ours_from_start = cfg
        .checkpoint
        .as_ref()
        .is_some_and(|p| !p.exists() || cfg.resume.as_ref() == Some(p));
    let mut saved_once = false;
    if let Some(f) = cfg.stop {
        f.arm(true);
    }
    while s.step < cfg.steps {
        if let Some((start, n)) = window.filter(|w| w.0 == s.step) {
            let (trace, results) = s.trace_steps(n)?;
            for r in results {
                if r.step > start {
                    // traced steps carry the marks' cost: not in the throughput figures
                    report.losses.push(r.loss);
                    report.step_secs.push(r.secs);
                    progress.step(r.step, cfg.steps, r.loss, b as f64 / r.secs.max(1e-12));
                } else {
                    record(r, &mut report, progress);
                }
            }
            if let Some(w) = cfg.trace.filter(|w| w.kernels > 0) {
                report.kernel_table = Some(crate::profile::render(
                    &plan.program,
                    &plan.model.graph,
                    &trace,
                    &DeviceModel::h200(),
                    w.kernels,
                ));
            }
            report.trace = Some(trace);
        } else if let Some(r) = s.train_step()? {
            record(r, &mut report, progress);
        }
        let step = s.step;
        let last = step == cfg.steps;
        let save = writes
            && cfg.checkpoint.is_some()
            && (last || (cfg.checkpoint_every > 0 && step.is_multiple_of(cfg.checkpoint_every)));
        let eval = (last && (rank.is_none() || s.evaluate_at_end))
            || (cfg.eval_every > 0 && step.is_multiple_of(cfg.eval_every));
        if save || eval {
            if let Some(r) = s.drain()? {
                record(r, &mut report, progress);
            }
        }
        if save {
            if let Some(path) = &cfg.checkpoint {
                s.save(path, &identity)
                    .with_context(|| format!("{who}step {step}: checkpoint"))?;
                saved_once = true;
            }
        }
        if eval {
            evals.push(s.evaluate(cfg.eval_examples)?);
            if let Some(e) = evals.last() {
                progress.eval(e);
            }
        }
        if cfg.stop.is_some_and(|f| f.requested()) && !last {
            if let Some(r) = s.drain()? {
                record(r, &mut report, progress);
            }
            if writes && (ours_from_start || saved_once) {
                if let Some(path) = &cfg.checkpoint {
                    if !save {
                        s.save(path, &identity)
                            .with_context(|| format!("{who}step {step}: checkpoint"))?;
                    }
                    report.interrupted_saved = true;
                }
            }
            report.interrupted = Some(step);
            break;
        }
    }
    if let Some(f) = cfg.stop {
        f.arm(false);
    }
    if let Some(r) = s.drain()? {
        record(r, &mut report, progress);
    }
    report.evals = evals;
    report.qps = qps_summary(&qps);
    report.loader_stall_secs = s.loader_stall().as_secs_f64();
    Ok(report)
}

/// Progress on a terminal (one line rewritten in place) or as plain lines.
pub struct ConsoleProgress {
    pub terminal: bool,
    pub jsonl: Option<std::fs::File>,
    last_print: Option<Instant>,
    /// The first failed write of the metrics file (warned about once, when it happened).
    pub write_error: Option<std::io::Error>,
}

impl ConsoleProgress {
    pub fn new(jsonl: Option<std::fs::File>) -> Self {
        use std::io::IsTerminal;
        ConsoleProgress {
            terminal: std::io::stderr().is_terminal(),
            jsonl,
            last_print: None,
            write_error: None,
        }
    }

    /// Writes one line of the metrics file; the first failure is warned about and kept
    /// (later lines are not tried: the file is incomplete from there).
    fn metric(&mut self, line: std::fmt::Arguments) {
        let Some(f) = &mut self.jsonl else { return };
        if self.write_error.is_some() {
            return;
        }
        if let Err(e) = writeln!(f, "{line}") {
            eprintln!("erase-ctr: warning: --metrics: a write failed ({e}); the file is incomplete from here");
            self.write_error = Some(e);
        }
    }
}

impl Progress for ConsoleProgress {
    fn step(&mut self, step: usize, steps: usize, loss: f64, qps: f64) {
        self.metric(format_args!(
            "{{\"step\":{step},\"loss\":{loss},\"qps\":{qps:.1}}}"
        ));
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
        self.metric(format_args!(
            "{{\"eval_step\":{},\"ne\":{},\"auc\":{},\"examples\":{}}}",
            e.step, e.ne, e.auc, e.examples
        ));
        if self.terminal {
            eprint!("\r\x1b[K");
        }
        eprintln!(
            "eval @ step {}: NE {:.4}  AUC {:.4}  ({} held-out examples)",
            e.step, e.ne, e.auc, e.examples
        );
    }
}
