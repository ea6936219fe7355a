//! The ERASE paper's sanity check: a deep MLP on MNIST (`examples/mlp30.rs`), the same
//! model as `shared/anchors/torch_mlp30.py` so GPU timings can be compared with it.
//!
//! ```text
//! h_0 = x                                             [B, 784]
//! h_i = relu(hidden_i(h_{i-1}'))      i = 1..L        [B, W]     h' = detach(h) when cut
//! logits = final(h_L')                                [B, 10]    main loss: CE(logits, y)
//! local_i = CE(head_i(h_i), y)        i = 1..L        (detached / erase only, weight 1)
//! ```
//!
//! Three modes: `conventional` (no cuts, no heads: one backward at the end), `detached`
//! (every layer's input detached, a local linear head and cross-entropy per hidden layer;
//! the output layer reads the detached last hidden layer, so it is one more local head,
//! as in `torch_mlp30.py`) and `erase` (the same graph as `detached`, scheduled with each
//! layer's backward started right after its local loss, on a pool of side streams).
//! `detached` and `erase` compute the same function, so they give the same bits; only
//! the schedule differs.
//!
//! Parameters are created in PyTorch's `model.parameters()` order (hidden layers, final,
//! heads), so every mode starts from the same hidden and final weights. Heads and the
//! output layer get PyTorch's default `Linear` init (weight and bias uniform in
//! `±1/sqrt(fan_in)`); hidden layers get He's (weight uniform in `±sqrt(6/fan_in)`, bias
//! 0) by default: under PyTorch's, the input's signal shrinks by about 2.4x a layer and
//! the conventional 30-layer model stays at chance for an epoch ([`HiddenInit::Torch`]
//! keeps the anchor's init).
//!
//! The pieces shared with `nanochat` (planning a graph, running it phase by phase with
//! timings) are here too: [`plan_graph`], [`GraphPlan`], [`Stepper`], [`StepTimes`].

use std::fmt;
use std::str::FromStr;
use std::time::Instant;

use anyhow::{anyhow, bail, ensure, Context, Result};
use erase_graph::{
    make_trainable, partition, DType, Graph, Init, OptimizerConfig, Partition, Phase, Tensor,
    Training,
};
use erase_ops::Buffer;
use erase_runtime::cpu::runner::ProgramRunner;
use erase_runtime::cuda::program::CudaProgram;
use erase_runtime::cuda::CudaDevice;
use erase_runtime::program::hb;
use erase_runtime::program::memory::{plan_memory, MemoryPlan};
use erase_runtime::program::occupancy::DeviceModel;
use erase_runtime::program::schedule::{ScheduleConfig, ScheduleKind, StepProgram, StreamId};
use erase_runtime::trace::Trace;

use crate::data::mnist::{self, Mnist, CLASSES, PIXELS};
use crate::train::StepExec;

/// How the MLP is trained.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Mode {
    /// Full backprop of the final loss, one backward at the end.
    Conventional,
    /// FF-style: every layer cut off by `detach`, a local head and loss per layer; the
    /// backward still runs at the end, on one stream.
    Detached,
    /// The `detached` graph with each layer's backward started early on a side stream.
    #[default]
    Erase,
}

impl Mode {
    pub const ALL: [Mode; 3] = [Mode::Conventional, Mode::Detached, Mode::Erase];

    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Conventional => "conventional",
            Mode::Detached => "detached",
            Mode::Erase => "erase",
        }
    }

    /// True when the graph has the cuts and the local heads.
    pub fn is_detached(self) -> bool {
        self != Mode::Conventional
    }

    /// `erase` schedules early; the others run everything on the main stream.
    pub fn schedule_kind(self) -> ScheduleKind {
        match self {
            Mode::Erase => ScheduleKind::Early,
            Mode::Conventional | Mode::Detached => ScheduleKind::Serial,
        }
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Mode {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "conventional" => Ok(Mode::Conventional),
            "detached" => Ok(Mode::Detached),
            "erase" => Ok(Mode::Erase),
            other => bail!("unknown mode '{other}': expected conventional, detached or erase"),
        }
    }
}

/// The initialisation of the hidden layers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum HiddenInit {
    /// He (Kaiming) uniform for ReLU: weight in `±sqrt(6/fan_in)`, bias 0.
    #[default]
    He,
    /// PyTorch's `nn.Linear` default, as `torch_mlp30.py`: weight and bias in
    /// `±1/sqrt(fan_in)`.
    Torch,
}

impl FromStr for HiddenInit {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "he" => Ok(HiddenInit::He),
            "torch" => Ok(HiddenInit::Torch),
            other => bail!("unknown init '{other}': expected he or torch"),
        }
    }
}

/// The model's sizes.
#[derive(Clone, Debug, PartialEq)]
pub struct Mlp30Config {
    pub mode: Mode,
    pub init: HiddenInit,
    /// Hidden width (the paper: 1024).
    pub width: usize,
    /// Hidden layers (the paper: 30).
    pub layers: usize,
    pub batch: usize,
}

impl Default for Mlp30Config {
    /// The paper's model at a CPU-friendly width (256 instead of 1024).
    fn default() -> Self {
        Mlp30Config {
            mode: Mode::Erase,
            init: HiddenInit::He,
            width: 256,
            layers: 30,
            batch: 256,
        }
    }
}

impl Mlp30Config {
    pub fn validate(&self) -> Result<()> {
        ensure!(
            self.width > 0 && self.layers > 0 && self.batch > 0,
            "mlp30: width ({}), layers ({}) and batch ({}) must all be at least 1",
            self.width,
            self.layers,
            self.batch
        );
        Ok(())
    }
}

/// The forward graph with its losses registered.
pub struct Mlp30 {
    pub cfg: Mlp30Config,
    pub graph: Graph,
    /// f32 `[B, 784]`.
    pub image: Tensor,
    /// i32 `[B]`.
    pub label: Tensor,
    /// The output layer's logits `[B, 10]`.
    pub logits: Tensor,
    pub main_loss: Tensor,
    /// One per hidden layer (`detached` / `erase`), in layer order.
    pub local_losses: Vec<Tensor>,
}

/// The weight and bias of an `inp -> out` linear layer, created now.
fn linear_params(
    g: &mut Graph,
    name: &str,
    inp: usize,
    out: usize,
    init: HiddenInit,
) -> Result<(Tensor, Tensor)> {
    let (wi, bi) = match init {
        HiddenInit::He => (
            Init::Uniform {
                bound: (6.0 / inp as f64).sqrt(),
            },
            Init::Zeros,
        ),
        HiddenInit::Torch => {
            let bound = 1.0 / (inp as f64).sqrt();
            (Init::Uniform { bound }, Init::Uniform { bound })
        }
    };
    let w = g.param(&format!("{name}.weight"), &[out, inp], wi)?;
    let b = g.param(&format!("{name}.bias"), &[out], bi)?;
    Ok((w, b))
}

/// Builds the forward graph of `cfg` in `float`.
pub fn build(cfg: &Mlp30Config, float: DType) -> Result<Mlp30> {
    cfg.validate()?;
    let (b, w, l) = (cfg.batch, cfg.width, cfg.layers);
    let mut g = Graph::new(float);
    let image = g.input("image", &[b, PIXELS], float)?;
    let label = g.input("label", &[b], DType::I32)?;
    // parameters first, in PyTorch's order: hidden.i, final, heads.i
    let mut hidden = Vec::with_capacity(l);
    for i in 0..l {
        let inp = if i == 0 { PIXELS } else { w };
        hidden.push(g.scoped(&layer_scope(i), |g| {
            linear_params(g, &format!("hidden.{i}"), inp, w, cfg.init)
        })?);
    }
    let fin = g.scoped("final", |g| {
        linear_params(g, "final", w, CLASSES, HiddenInit::Torch)
    })?;
    let mut heads = Vec::new();
    if cfg.mode.is_detached() {
        for i in 0..l {
            heads.push(g.scoped(&layer_scope(i), |g| {
                linear_params(g, &format!("heads.{i}"), w, CLASSES, HiddenInit::Torch)
            })?);
        }
    }
    let mut h = image;
    let mut local_losses = Vec::new();
    for (i, &(wi, bi)) in hidden.iter().enumerate() {
        h = g.scoped(&layer_scope(i), |g| -> Result<Tensor> {
            let x = if cfg.mode.is_detached() && i > 0 {
                g.detach(h)?
            } else {
                h
            };
            let z = g.linear_with(x, wi, Some(bi))?;
            let a = g.relu(z)?;
            if let Some(&(hw, hb)) = heads.get(i) {
                let logits = g.linear_with(a, hw, Some(hb))?;
                let ce = g.softmax_cross_entropy(logits, label)?;
                g.loss(ce, 1.0)?;
                local_losses.push(g.set_name(ce, "local_loss"));
            }
            Ok(a)
        })?;
    }
    let (logits, main_loss) = g.scoped("final", |g| -> Result<(Tensor, Tensor)> {
        let x = if cfg.mode.is_detached() {
            g.detach(h)?
        } else {
            h
        };
        let logits = g.linear_with(x, fin.0, Some(fin.1))?;
        let logits = g.set_name(logits, "logits");
        let ce = g.softmax_cross_entropy(logits, label)?;
        g.loss(ce, 1.0)?;
        Ok((logits, g.set_name(ce, "loss")))
    })?;
    Ok(Mlp30 {
        cfg: cfg.clone(),
        graph: g,
        image,
        label,
        logits,
        main_loss,
        local_losses,
    })
}

/// The scope of hidden layer `i` (and its head): `layer07`.
pub fn layer_scope(i: usize) -> String {
    format!("layer{i:02}")
}

// ---- planning and running any graph --------------------------------------------------

/// A trainable graph, partitioned, scheduled, memory-planned and proven free of hazards.
pub struct GraphPlan {
    pub graph: Graph,
    pub training: Training,
    pub partition: Partition,
    pub program: StepProgram,
    pub memory: MemoryPlan,
}

/// How a step is scheduled.
#[derive(Clone, Debug)]
pub struct StepSchedule {
    pub kind: ScheduleKind,
    /// Side streams of the pool (for [`ScheduleKind::Early`]).
    pub side_streams: usize,
    /// The occupancy rule (off, on, or the occupancy model's choice).
    pub occupancy: crate::train::Occupancy,
}

/// Makes `graph` (a forward graph with its losses) trainable and plans its step as
/// [`crate::train::plan_step`] does for the CTR model. `keep` are the tensors read after
/// a step (losses, logits): their bytes are not reused within the step.
pub fn plan_graph(
    mut graph: Graph,
    opt: &OptimizerConfig,
    sched: &StepSchedule,
    keep: &[Tensor],
) -> Result<GraphPlan> {
    let training = make_trainable(&mut graph, opt).context("differentiating the model")?;
    let partition = partition(&graph, &training.grads);
    let scfg = ScheduleConfig {
        kind: sched.kind,
        side_streams: sched.side_streams.max(1),
        occupancy: false,
        exclusive_only: None,
        device: DeviceModel::h200(),
        kernels: Some(crate::kernels::library()).filter(|l| !l.modules.is_empty()),
        plan_options: None,
        late_stream: false,
        weight_grad_streams: false,
        forward_streams: false,
        updates_by_data: false,
        priorities: Default::default(),
    };
    let (program, _) =
        crate::train::schedule_with_occupancy(&graph, &partition, scfg, sched.occupancy, None);
    let memory = plan_memory(&graph, &program, keep);
    let hazards = hb::check(&graph, &program, &memory);
    if let Some(h) = hazards.first() {
        bail!(
            "internal error: the step plan has {} hazard(s); first: {h}",
            hazards.len()
        );
    }
    Ok(GraphPlan {
        graph,
        training,
        partition,
        program,
        memory,
    })
}

impl GraphPlan {
    /// The early backward programs and the side stream each starts on.
    pub fn early_programs(&self) -> Vec<(String, StreamId)> {
        self.partition
            .programs
            .iter()
            .filter(|p| p.early)
            .filter_map(|p| {
                let first = p.nodes.first()?;
                let l = self.program.launches.iter().find(|l| l.node == *first)?;
                Some((p.name.clone(), l.stream))
            })
            .collect()
    }

    /// A summary (programs, streams, arena) followed by [`StepProgram::render`].
    pub fn render(&self) -> String {
        let mut s = self.summary();
        s.push('\n');
        s.push_str(&self.program.render(&self.graph));
        s
    }

    /// Programs, streams, launches and arena, a few lines.
    pub fn summary(&self) -> String {
        use std::fmt::Write as _;
        let mut s = String::new();
        let p = &self.partition;
        let _ = writeln!(
            s,
            "{} backward program(s), {} early; {} launches on {} stream(s), {} event(s); arena {:.2} MiB ({:.2} MiB without reuse)",
            p.programs.len(),
            p.programs.iter().filter(|x| x.early).count(),
            self.program.launches.len(),
            self.program.streams,
            self.program.events,
            self.memory.arena_bytes as f64 / (1 << 20) as f64,
            self.memory.total_bytes as f64 / (1 << 20) as f64,
        );
        let on: std::collections::BTreeMap<String, StreamId> =
            self.early_programs().into_iter().collect();
        for bp in &p.programs {
            let after = self.graph.node(p.forward[bp.ready_after]).name.clone();
            let stream = on
                .get(&bp.name)
                .map_or("main".to_string(), |s| s.to_string());
            let _ = writeln!(
                s,
                "  {:<10} {:>4} nodes, ready after '{after}', on {stream}{}",
                bp.name,
                bp.nodes.len(),
                if bp.early { "" } else { " (remainder)" }
            );
        }
        s
    }
}

/// Where a step's time went, in seconds. On the CPU every part is measured (launches
/// run one after another in issue order); on a GPU only `total` is.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepTimes {
    pub forward: f64,
    /// All backward launches.
    pub backward: f64,
    /// Backward launches issued after the last forward launch: the backward not hidden
    /// behind the forward (`backward_ms` of `torch_mlp30.py`).
    pub backward_exposed: f64,
    pub optimizer: f64,
    /// The whole step.
    pub total: f64,
    /// True when the parts were measured.
    pub phased: bool,
}

/// A planned step bound to a device: runs whole steps (with [`StepTimes`]) or only the
/// forward launches (evaluation, generation).
pub struct Stepper<'a> {
    exec: Box<dyn StepExec + 'a>,
    /// Runs of consecutive launches of one phase: (phase, after the last forward, launches).
    groups: Vec<(Phase, bool, Vec<usize>)>,
    forward: Vec<usize>,
    phased: bool,
    /// CUDA: the launches whose marks split the step (first, last forward, first
    /// optimizer, last).
    cuda_marks: Option<PhaseMarks>,
    launches: usize,
}

type PhaseMarks = (Option<usize>, Option<usize>, Option<usize>, Option<usize>);

/// The launches that bound a step's phases: (first launch, last forward launch, first
/// optimizer launch, last launch), each among the launches that issue kernels.
fn phase_marks(plan: &GraphPlan) -> PhaseMarks {
    let g = &plan.graph;
    let l = &plan.program.launches;
    let real = |i: &usize| l[*i].spec.is_some();
    let phase = |i: usize| g.node(l[i].node).phase;
    let n = l.len();
    (
        (0..n).find(real),
        (0..n)
            .rev()
            .filter(real)
            .find(|&i| phase(i) == Phase::Forward),
        (0..n).filter(real).find(|&i| phase(i) == Phase::Optimizer),
        (0..n).rev().find(real),
    )
}

impl<'a> Stepper<'a> {
    /// On the CPU step-program runner, parameters initialised from `seed`.
    pub fn cpu(plan: &'a GraphPlan, seed: u64, threads: usize) -> Result<Self> {
        let r = ProgramRunner::new(&plan.graph, &plan.program, &plan.memory, seed, threads)?;
        Ok(Self::with_exec(
            plan,
            Box::new(crate::train::CpuExec::new(r)),
            true,
        ))
    }

    /// On a CUDA device (blocking dispatch). CUDA events on the streams mark the end of
    /// the last forward launch and the start of the first optimizer launch, which split
    /// the step as `torch_mlp30.py` does: forward, backward after the forward (not hidden
    /// behind it), optimizer.
    pub fn cuda(plan: &'a GraphPlan, dev: &'a CudaDevice, seed: u64) -> Result<Self> {
        let mut p = CudaProgram::new(dev, &plan.graph, &plan.program, &plan.memory, seed)?;
        let (first, last_fwd, first_opt, last) = phase_marks(plan);
        let marks: Vec<usize> = [first, last_fwd, first_opt, last]
            .into_iter()
            .flatten()
            .collect();
        p.set_tracing_of(true, &marks)?;
        let mut s = Self::with_exec(plan, Box::new(p), false);
        s.cuda_marks = Some((first, last_fwd, first_opt, last));
        Ok(s)
    }

    /// On the CUDA device when `dev` is given, else on the CPU.
    pub fn new(
        plan: &'a GraphPlan,
        dev: Option<&'a CudaDevice>,
        seed: u64,
        threads: usize,
    ) -> Result<Self> {
        match dev {
            Some(d) => Self::cuda(plan, d, seed),
            None => Self::cpu(plan, seed, threads),
        }
    }

    fn with_exec(plan: &'a GraphPlan, exec: Box<dyn StepExec + 'a>, phased: bool) -> Self {
        let g = &plan.graph;
        let phase = |i: usize| g.node(plan.program.launches[i].node).phase;
        let n = plan.program.launches.len();
        let last_forward = (0..n).rev().find(|&i| phase(i) == Phase::Forward);
        let mut groups: Vec<(Phase, bool, Vec<usize>)> = Vec::new();
        for i in 0..n {
            let (p, after) = (phase(i), last_forward.is_some_and(|f| i > f));
            match groups.last_mut() {
                Some((q, a, v)) if *q == p && *a == after => v.push(i),
                _ => groups.push((p, after, vec![i])),
            }
        }
        let forward = (0..n).filter(|&i| phase(i) == Phase::Forward).collect();
        Stepper {
            exec,
            groups,
            forward,
            phased,
            cuda_marks: None,
            launches: n,
        }
    }

    pub fn feed(&mut self, t: Tensor, b: Buffer) -> Result<()> {
        self.exec.feed(t, b)
    }

    pub fn get(&self, t: Tensor) -> Result<Buffer> {
        self.exec.get(t)
    }

    /// A scalar (a loss) as f64.
    pub fn scalar(&self, t: Tensor) -> Result<f64> {
        self.get(t)?
            .to_f64()
            .first()
            .copied()
            .ok_or_else(|| anyhow!("tensor {} is empty", t.index()))
    }

    /// One whole training step on the fed inputs.
    pub fn step(&mut self) -> Result<StepTimes> {
        if !self.phased {
            let total = self.exec.step()?;
            let mut t = StepTimes {
                total,
                ..Default::default()
            };
            if let Some((Some(first), Some(fwd), Some(opt), Some(last))) = self.cuda_marks {
                let m = self.exec.traced_step()?;
                let (start, fwd_end) = (m.launches[first].0, m.launches[fwd].1);
                let (opt_start, end) = (m.launches[opt].0, m.launches[last].1);
                t.forward = fwd_end - start;
                t.backward_exposed = opt_start - fwd_end;
                // the backward hidden behind the forward is not measured on the GPU
                t.backward = f64::NAN;
                t.optimizer = end - opt_start;
                t.phased = true;
            }
            return Ok(t);
        }
        let mut t = StepTimes {
            phased: true,
            ..Default::default()
        };
        let t0 = Instant::now();
        for (phase, after, launches) in &self.groups {
            let s = Instant::now();
            self.exec.run_launches(launches)?;
            let dt = s.elapsed().as_secs_f64();
            match phase {
                Phase::Forward => t.forward += dt,
                Phase::Backward => {
                    t.backward += dt;
                    if *after {
                        t.backward_exposed += dt;
                    }
                }
                Phase::Optimizer => t.optimizer += dt,
            }
        }
        t.total = t0.elapsed().as_secs_f64();
        Ok(t)
    }

    /// Marks every launch of the steps from now on (CUDA), for [`Stepper::last_trace`].
    pub fn trace_all(&mut self) -> Result<()> {
        let all: Vec<usize> = (0..self.launches).collect();
        self.exec.set_tracing_of(true, &all)
    }

    /// The measured trace of the last step (after [`Stepper::trace_all`]), as step `step`.
    pub fn last_trace(&self, plan: &GraphPlan, step: usize) -> Result<Trace> {
        let m = self.exec.traced_step()?;
        let mut t = Trace::new(&plan.program, "measured (CUDA events)");
        t.push_measured(&plan.program, &plan.graph, step, &m);
        Ok(t)
    }

    /// Only the forward launches (no gradients, no update).
    pub fn forward(&mut self) -> Result<()> {
        self.exec.run_launches(&self.forward)
    }
}

/// The median of `v` (NaN when empty).
pub fn median(v: &[f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let m = s.len() / 2;
    if s.len() % 2 == 1 {
        s[m]
    } else {
        0.5 * (s[m - 1] + s[m])
    }
}

// ---- training the MLP --------------------------------------------------------------

/// The MLP of `cfg`, planned: `erase` gets the early schedule on `side_streams`.
pub struct Mlp30Plan {
    pub plan: GraphPlan,
    pub cfg: Mlp30Config,
    pub image: Tensor,
    pub label: Tensor,
    pub logits: Tensor,
    pub main_loss: Tensor,
    pub local_losses: Vec<Tensor>,
}

/// Builds and plans the MLP (the occupancy model deciding, as by default).
pub fn plan(cfg: &Mlp30Config, opt: &OptimizerConfig, side_streams: usize) -> Result<Mlp30Plan> {
    plan_with(cfg, opt, side_streams, crate::train::Occupancy::Auto)
}

/// [`plan`] with the occupancy rule `occupancy`.
pub fn plan_with(
    cfg: &Mlp30Config,
    opt: &OptimizerConfig,
    side_streams: usize,
    occupancy: crate::train::Occupancy,
) -> Result<Mlp30Plan> {
    let m = build(cfg, DType::F32).context("building the MLP")?;
    let mut keep = vec![m.logits, m.main_loss];
    keep.extend(&m.local_losses);
    let sched = StepSchedule {
        kind: cfg.mode.schedule_kind(),
        side_streams,
        occupancy,
    };
    let plan = plan_graph(m.graph, opt, &sched, &keep)?;
    Ok(Mlp30Plan {
        plan,
        cfg: m.cfg,
        image: m.image,
        label: m.label,
        logits: m.logits,
        main_loss: m.main_loss,
        local_losses: m.local_losses,
    })
}

/// One training step's results.
#[derive(Clone, Copy, Debug)]
pub struct Mlp30Step {
    /// The output layer's loss.
    pub loss: f64,
    /// Mean of the local losses (NaN for `conventional`).
    pub local_mean: f64,
    pub times: StepTimes,
}

/// Training of one MLP on MNIST: batches in a fresh shuffled order each epoch.
pub struct Mlp30Trainer<'a> {
    pub m: &'a Mlp30Plan,
    stepper: Stepper<'a>,
    seed: u64,
    order: Vec<usize>,
    epoch: usize,
    images: Vec<f32>,
    labels: Vec<i32>,
    /// Steps done.
    pub step: usize,
}

impl<'a> Mlp30Trainer<'a> {
    /// Parameters from `seed`, data order from `data_seed`.
    pub fn new(
        m: &'a Mlp30Plan,
        dev: Option<&'a CudaDevice>,
        seed: u64,
        data_seed: u64,
        threads: usize,
    ) -> Result<Self> {
        let b = m.cfg.batch;
        Ok(Mlp30Trainer {
            m,
            stepper: Stepper::new(&m.plan, dev, seed, threads)?,
            seed: data_seed,
            order: Vec::new(),
            epoch: usize::MAX,
            images: vec![0.0; b * PIXELS],
            labels: vec![0; b],
            step: 0,
        })
    }

    /// Whole batches per epoch of `train`.
    pub fn steps_per_epoch(&self, train: &Mnist) -> usize {
        train.len() / self.m.cfg.batch
    }

    fn feed(&mut self) -> Result<()> {
        let m = self.m;
        self.stepper
            .feed(m.image, Buffer::F32(self.images.clone()))?;
        self.stepper.feed(m.label, Buffer::I32(self.labels.clone()))
    }

    /// One step on the next batch of `train`. A non-finite loss is an error.
    pub fn train_step(&mut self, train: &Mnist) -> Result<Mlp30Step> {
        let b = self.m.cfg.batch;
        let per_epoch = self.steps_per_epoch(train);
        ensure!(
            per_epoch > 0,
            "{} training examples are fewer than one batch of {b}",
            train.len()
        );
        let (e, k) = (self.step / per_epoch, self.step % per_epoch);
        if e != self.epoch {
            self.order = mnist::shuffled(train.len(), self.seed, e as u64);
            self.epoch = e;
        }
        train.fill_batch(
            &self.order[k * b..(k + 1) * b],
            &mut self.images,
            &mut self.labels,
        );
        self.feed()?;
        let step = self.step;
        let times = self
            .stepper
            .step()
            .with_context(|| format!("step {step}"))?;
        let loss = self.stepper.scalar(self.m.main_loss)?;
        ensure!(
            loss.is_finite(),
            "step {step}: the loss is {loss}; training stopped"
        );
        let mut local = Vec::with_capacity(self.m.local_losses.len());
        for &t in &self.m.local_losses {
            local.push(self.stepper.scalar(t)?);
        }
        self.step += 1;
        Ok(Mlp30Step {
            loss,
            local_mean: if local.is_empty() {
                f64::NAN
            } else {
                local.iter().sum::<f64>() / local.len() as f64
            },
            times,
        })
    }

    /// Accuracy of the output layer on every example of `data` (forward only).
    pub fn accuracy(&mut self, data: &Mnist) -> Result<f64> {
        let b = self.m.cfg.batch;
        let mut correct = 0usize;
        let mut first = 0;
        while first < data.len() {
            let real = data.fill_range(first, &mut self.images, &mut self.labels);
            self.feed()?;
            self.stepper.forward()?;
            let logits = self.stepper.get(self.m.logits)?.to_f64();
            for k in 0..real {
                let row = &logits[k * CLASSES..(k + 1) * CLASSES];
                let pred = (0..CLASSES)
                    .max_by(|&a, &c| row[a].total_cmp(&row[c]).then(c.cmp(&a)))
                    .unwrap_or(0);
                correct += usize::from(pred as i32 == self.labels[k]);
            }
            first += b;
        }
        Ok(correct as f64 / data.len().max(1) as f64)
    }

    /// Every parameter's bytes, in creation order (to compare runs bit for bit).
    pub fn param_bytes(&self) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        for p in self.m.plan.graph.params() {
            out.extend_from_slice(self.stepper.get(p)?.bytes());
        }
        Ok(out)
    }
}
