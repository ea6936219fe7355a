//! Planning and running any trainable graph outside the CTR trainer: the paper's other
//! experiments (`mlp30`, `nanochat`) plan their graphs with [`plan_graph`] and run them
//! phase by phase, with timings, through a [`Stepper`] on either backend.

use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use erase_graph::{
    make_trainable, partition, Graph, OptimizerConfig, Partition, Phase, Tensor, Training,
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

use crate::train::StepExec;

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
