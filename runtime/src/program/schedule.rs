//! The step program: one training step as an ordered list of launches, each on a named
//! stream, with the events it waits for and the event it records. Forward work runs on
//! the main stream (the highest priority); under the ERASE schedule each early backward
//! program goes to a pool stream right after the forward op that makes it ready (round
//! robin; with `late_stream`, the program readied last gets a pool stream of its own at
//! the priority just below main's; with `weight_grad_streams`, a program's weight
//! gradients go to a companion of its pool stream; a program that reads only the step's
//! inputs, the embedding ids' sort, takes the first pool stream outside the round robin,
//! and so does forward work that reads only parameters, the bf16 copies of the weights).
//! Every cross-stream edge is derived from a data dependency (or the occupancy rule, the
//! join before the optimizer where `updates_by_data` is off, or the start of an
//! inputs-only program) and carries a sentence saying why, so the plan can be audited.
//! Every executor joins all streams into the main stream at the end of a step.
//! Priorities ([`Priorities::RANKED`], what `--occupancy off` runs unless
//! `--stream-priorities` says otherwise): main first, then the
//! late stream, the pool, and the weight-gradient companions last
//! (`StepProgram::stream_rank`); the occupancy model may choose fewer levels
//! (`simulate::choose_occupancy`).
//!
//! The schedule is a deterministic function of the graph and the config: no hash maps
//! are iterated and nothing depends on the process, so every rank issues the same
//! launches in the same order.

use std::collections::BTreeMap;
use std::fmt::{self, Write as _};

use crate::kernels::KernelLibrary;
use crate::program::occupancy::DeviceModel;
use erase_graph::{Graph, NodeId, Partition, Phase, Tensor};
use erase_ops::cuda::{cuda_plan, LaunchAt, Operands};
use erase_ops::{launch_spec_typed, LaunchSpec};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamId(pub u16);

impl StreamId {
    pub const MAIN: StreamId = StreamId(0);
}

impl fmt::Display for StreamId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0 == 0 {
            f.write_str("main")
        } else {
            write!(f, "side{}", self.0)
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EventId(pub u32);

/// Which classes of streams run at a greater priority than which. A priority orders
/// nothing (no event edge): where the device is full, the CTAs of the more urgent
/// stream's kernel are dispatched first as SMs free up, so a main-stream kernel that the
/// critical path waits for goes ahead of early backward work without waiting for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Priorities {
    /// The main stream above every side stream.
    pub main_first: bool,
    /// The late stream (`ScheduleConfig::late_stream`) above the pool.
    pub late_first: bool,
    /// The weight-gradient companions at the least priority, below their pool streams.
    pub companions_last: bool,
}

impl Priorities {
    /// Every level: main, then the late stream, the pool, the companions (the default,
    /// and what `--occupancy off` and `on` run unless `--stream-priorities` says otherwise).
    pub const RANKED: Priorities = Priorities {
        main_first: true,
        late_first: true,
        companions_last: true,
    };
    /// Main above the side streams, which share one level.
    pub const MAIN_FIRST: Priorities = Priorities {
        main_first: true,
        late_first: false,
        companions_last: false,
    };
    /// Every stream of the step at the greatest priority: a full device goes to the launch
    /// that started first. (The data-parallel communication stream and the input copies
    /// stay at the least, so they fall below every compute stream, where under
    /// [`Priorities::RANKED`] they share the companions' level; the model does not see
    /// those streams.)
    pub const FLAT: Priorities = Priorities {
        main_first: false,
        late_first: false,
        companions_last: false,
    };
}

impl Default for Priorities {
    fn default() -> Self {
        Priorities::RANKED
    }
}

impl fmt::Display for Priorities {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let sep = |above: bool| if above { " > " } else { " = " };
        write!(
            f,
            "main{}late{}pool{}companions",
            sep(self.main_first),
            sep(self.late_first),
            sep(self.companions_last)
        )
    }
}

/// The three schedules of the spec's variants.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScheduleKind {
    /// Everything on the main stream: the forward, then one backward, then the updates.
    Serial,
    /// ERASE: early backward programs on pool streams.
    Early,
}

#[derive(Clone, Debug)]
pub struct ScheduleConfig {
    pub kind: ScheduleKind,
    /// Pool (side) streams for early backward programs.
    pub side_streams: usize,
    /// Apply the occupancy rule.
    pub occupancy: bool,
    /// With the rule on, the launches (by node) it applies to; `None`: every launch the
    /// rule names. The occupancy model's choice (`simulate::choose_occupancy`) keeps only
    /// those whose ordering the simulator predicts to shorten the step.
    pub exclusive_only: Option<Vec<NodeId>>,
    pub device: DeviceModel,
    /// The build's kernels: when present, each launch's footprint comes from the kernel
    /// its CUDA plan really launches (grid, block, ptxas's registers and shared memory)
    /// instead of the declared estimate.
    pub kernels: Option<KernelLibrary>,
    /// The kernel paths those plans take (`--kernel-paths`); `None`: the H200's defaults
    /// with the environment's overrides, as a device has them.
    pub plan_options: Option<erase_ops::cuda::PlanOptions>,
    /// With two or more side streams, the last early backward program (the one readied
    /// last, so with the least time to finish before the join) gets the last side stream
    /// to itself, at the priority just below main's; the others share the rest.
    pub late_stream: bool,
    /// Each side stream gets a companion (side `k + side_streams`) for the weight
    /// gradients (LinearGradWeight) of the early programs it runs: nothing in a block's
    /// backward waits for them, so its chain of data gradients (the critical path of the
    /// block that ends last) runs without them, and they fill the device beside it.
    /// The companions run at a lower priority than their side streams (the least the
    /// device has; `StepProgram::stream_rank`), so the chains, which the step's end waits
    /// for in order, go first where they meet.
    pub weight_grad_streams: bool,
    /// No join before the updates (ERASE only): each update waits for the gradients it
    /// reads and nothing else, and the row-wise update of the embedding tables runs on
    /// the stream that wrote their gradient, beside the dense update on the main stream;
    /// the step's end joins every stream. Off where the updates need every stream done
    /// first: a data-parallel step all-reduces the gradients at the join.
    pub updates_by_data: bool,
    /// The streams' priority levels (`Priorities::RANKED` unless the occupancy model
    /// chose fewer).
    pub priorities: Priorities,
    /// Under ERASE, each early block's own forward work (the forward launches that only
    /// its local loss depends on: its layers and its head) on a forward stream of its own
    /// at main's priority, so that the blocks' forwards, which read the shared embeddings
    /// but not each other, run side by side instead of one after the other on the main
    /// stream; what several blocks or the main loss alone read (the embeddings, the
    /// bottom MLP, the top) stays on main.
    pub forward_streams: bool,
}

/// Replaces the declared footprint of `spec` with the real one of the heaviest call of
/// the op's CUDA plan, when the kernel is in `lib`.
fn refine(
    spec: LaunchSpec,
    g: &Graph,
    n: &erase_graph::Node,
    at: LaunchAt,
    (lib, opts): (&KernelLibrary, Option<erase_ops::cuda::PlanOptions>),
) -> LaunchSpec {
    let ins: Vec<_> = n.inputs.iter().map(|&t| g.shape(t)).collect();
    let ind: Vec<_> = n.inputs.iter().map(|&t| g.dtype(t)).collect();
    let outs: Vec<_> = n.outputs.iter().map(|&t| g.shape(t)).collect();
    let outd: Vec<_> = n.outputs.iter().map(|&t| g.dtype(t)).collect();
    let upd: Vec<_> = n.updates.iter().map(|&t| g.shape(t)).collect();
    // the H200 the cost model is of, with the kernel paths asked for (or the
    // environment's overrides, as a device has them)
    let opts = opts.unwrap_or_else(erase_ops::cuda::PlanOptions::from_env);
    let o = Operands {
        opts: opts.at_launch(at),
        ins: &ins,
        in_dtypes: &ind,
        outs: &outs,
        out_dtypes: &outd,
        upd: &upd,
    };
    let Ok(plan) = cuda_plan(&n.op, &o) else {
        return spec;
    };
    let Some(call) = plan.main_call() else {
        return spec;
    };
    let Some(info) = lib.find(call.kernel) else {
        return spec;
    };
    LaunchSpec {
        kernel: info.name,
        grid: u64::from(call.grid[0]) * u64::from(call.grid[1]) * u64::from(call.grid[2]),
        block: call.block[0] * call.block[1] * call.block[2],
        regs_per_thread: info.regs,
        smem_bytes: info.smem + call.smem,
        extra_launches: (plan.calls.len() - 1) as u32,
        ..spec
    }
}

/// Why a cross-stream edge exists.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EdgeKind {
    /// The waiting launch reads what the recording launch wrote, or overwrites what it read.
    Data,
    /// Every pool stream joins the main stream before the optimizer (unless
    /// `updates_by_data`; the step's end joins them in every case).
    Join,
    /// The occupancy rule keeps a device-filling launch from sharing the device. It orders
    /// work for speed only: removing it loses no correctness.
    Occupancy,
    /// An early program that reads nothing the step computes (only its inputs, as the
    /// embedding ids' sort) starts after the forward launch it is placed behind: after
    /// the step's inputs are in place, and never over what the previous step's end still
    /// reads.
    Start,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Wait {
    pub event: EventId,
    pub kind: EdgeKind,
    pub why: String,
}

/// What a launch is, for people and profilers: `fwd:cross`, `bwd:remainder`, `optim`.
#[derive(Clone, Debug, PartialEq)]
pub struct Label {
    pub block: String,
    pub phase: &'static str,
    pub op: String,
}

impl fmt::Display for Label {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.phase == "optim" {
            write!(f, "optim {}", self.op)
        } else {
            write!(f, "{}:{} {}", self.phase, self.block, self.op)
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Launch {
    pub node: NodeId,
    pub stream: StreamId,
    pub waits: Vec<Wait>,
    /// The event recorded on `stream` right after this launch.
    pub record: Option<EventId>,
    pub label: Label,
    /// The kernel launch on a GPU (None for free ops such as reshape).
    pub spec: Option<LaunchSpec>,
    /// The occupancy rule applies to this launch.
    pub exclusive: bool,
}

/// Where a launch on `stream` of a node of `phase` runs in a program of `kind`: the one
/// rule the simulator's kernels (`refine`) and the device's (`StepProgram::launch_at`)
/// are planned by.
fn launch_at(kind: ScheduleKind, stream: StreamId, phase: Phase, examples: usize) -> LaunchAt {
    LaunchAt {
        main: stream == StreamId::MAIN,
        forward: phase == Phase::Forward,
        serial: kind == ScheduleKind::Serial,
        examples,
    }
}

/// The examples of `g`'s step: the rows of its first loss's input (the main logits), 0
/// for a graph without a loss.
pub fn step_examples(g: &Graph) -> usize {
    g.losses()
        .first()
        .and_then(|l| g.producer(l.tensor).inputs.first().copied())
        .and_then(|t| g.shape(t).dims().first().copied())
        .unwrap_or(0)
}

impl StepProgram {
    /// Where launch `l` of this program (of `g`) runs, for the plans that depend on it
    /// ([`erase_ops::cuda::PlanOptions::at_launch`]).
    pub fn launch_at(&self, g: &Graph, l: &Launch) -> LaunchAt {
        launch_at(self.kind, l.stream, g.node(l.node).phase, step_examples(g))
    }
}

/// One training step as launches in issue order.
#[derive(Clone, Debug, PartialEq)]
pub struct StepProgram {
    pub launches: Vec<Launch>,
    pub streams: usize,
    pub events: usize,
    pub kind: ScheduleKind,
    /// The side stream that runs at the priority just below main's (the others lower),
    /// if any.
    pub late_stream: Option<StreamId>,
    /// The first of the weight-gradient companion streams (`ScheduleConfig::
    /// weight_grad_streams`), if any: they and every stream after them run at the least
    /// priority, the pool streams before them higher (see [`StepProgram::stream_rank`]).
    pub weight_grad_from: Option<StreamId>,
    /// Which of those levels the streams really run at.
    pub priorities: Priorities,
    /// The first of the blocks' forward streams (`ScheduleConfig::forward_streams`), if
    /// any: they and every stream after them run at main's priority.
    pub forward_from: Option<StreamId>,
}

fn scope_of(name: &str) -> &str {
    name.split('/').next().unwrap_or(name)
}

/// Vector clocks per launch: `clock[i][s]` = how many launches of stream `s` are ordered
/// before or at launch `i` (stream order plus events).
pub fn vector_clocks(p: &StepProgram) -> Vec<Vec<u32>> {
    let mut stream_clock = vec![vec![0u32; p.streams]; p.streams];
    let mut event_clock: BTreeMap<EventId, Vec<u32>> = BTreeMap::new();
    let mut out = Vec::with_capacity(p.launches.len());
    for l in &p.launches {
        let s = l.stream.0 as usize;
        let mut c = stream_clock[s].clone();
        for w in &l.waits {
            if let Some(ec) = event_clock.get(&w.event) {
                for (a, b) in c.iter_mut().zip(ec) {
                    *a = (*a).max(*b);
                }
            }
        }
        c[s] += 1;
        if let Some(e) = l.record {
            event_clock.insert(e, c.clone());
        }
        stream_clock[s] = c.clone();
        out.push(c);
    }
    out
}

/// `a` happens before `b` (launch indices) under the clocks of [`vector_clocks`].
pub fn happens_before(p: &StepProgram, clocks: &[Vec<u32>], a: usize, b: usize) -> bool {
    if a == b {
        return false;
    }
    let sa = p.launches[a].stream.0 as usize;
    clocks[b][sa] >= clocks[a][sa]
}

struct Builder<'a> {
    g: &'a Graph,
    cfg: &'a ScheduleConfig,
    prog: StepProgram,
    /// Per stream: its current clock (as in `vector_clocks`).
    clock: Vec<Vec<u32>>,
    /// Per launch: its clock.
    launch_clock: Vec<Vec<u32>>,
    /// Per tensor: launches that wrote / read it so far.
    writers: BTreeMap<Tensor, Vec<usize>>,
    readers: BTreeMap<Tensor, Vec<usize>>,
    /// Per stream: an exclusive launch the stream's next launch must wait for.
    pending_exclusive: Vec<Option<usize>>,
    /// Per stream: the last launch on it.
    last_on: Vec<Option<usize>>,
    /// The next launch on main joins every pool stream first.
    join_next: bool,
    /// The launch the next pushed one waits for (EdgeKind::Start), once.
    start_after: Option<usize>,
}

impl Builder<'_> {
    fn event_after(&mut self, i: usize) -> EventId {
        if let Some(e) = self.prog.launches[i].record {
            return e;
        }
        let e = EventId(self.prog.events as u32);
        self.prog.events += 1;
        self.prog.launches[i].record = Some(e);
        e
    }

    /// Makes the launch being built on `s` wait for launch `dep` unless already ordered.
    fn depend(
        &mut self,
        s: usize,
        waits: &mut Vec<Wait>,
        c: &mut [u32],
        dep: usize,
        kind: EdgeKind,
        why: impl FnOnce() -> String,
    ) {
        let ds = self.prog.launches[dep].stream.0 as usize;
        if ds == s || c[ds] >= self.launch_clock[dep][ds] {
            return;
        }
        let event = self.event_after(dep);
        for (a, b) in c.iter_mut().zip(&self.launch_clock[dep]) {
            *a = (*a).max(*b);
        }
        waits.push(Wait {
            event,
            kind,
            why: why(),
        });
    }

    fn label(&self, node: NodeId, block: &str) -> Label {
        let n = self.g.node(node);
        let phase = match n.phase {
            Phase::Forward => "fwd",
            Phase::Backward => "bwd",
            Phase::Optimizer => "optim",
        };
        Label {
            block: block.to_string(),
            phase,
            op: n.op.name().to_string(),
        }
    }

    fn push(&mut self, node: NodeId, stream: StreamId, block: &str) {
        let g = self.g;
        let n = g.node(node);
        let s = stream.0 as usize;
        let i = self.prog.launches.len();
        let label = self.label(node, block);
        let dt = n
            .inputs
            .iter()
            .chain(&n.outputs)
            .map(|&t| g.dtype(t))
            .find(|d| d.is_float())
            .unwrap_or(g.float_dtype());
        let written: Vec<_> = n.outputs.iter().chain(&n.updates).copied().collect();
        let (ins, in_dt): (Vec<_>, Vec<_>) =
            n.inputs.iter().map(|&t| (g.shape(t), g.dtype(t))).unzip();
        let (outs, out_dt): (Vec<_>, Vec<_>) =
            written.iter().map(|&t| (g.shape(t), g.dtype(t))).unzip();
        let mut spec = launch_spec_typed(&n.op, &ins, &in_dt, &outs, &out_dt, dt);
        if let (Some(sp), Some(lib)) = (spec.clone(), self.cfg.kernels.as_ref()) {
            let at = launch_at(self.cfg.kind, stream, n.phase, step_examples(g));
            spec = Some(refine(sp, g, n, at, (lib, self.cfg.plan_options)));
        }
        let exclusive = self.cfg.occupancy
            && spec
                .as_ref()
                .is_some_and(|sp| self.cfg.device.is_exclusive(sp))
            && self
                .cfg
                .exclusive_only
                .as_ref()
                .is_none_or(|only| only.contains(&node));
        let mut c = self.clock[s].clone();
        let mut waits = Vec::new();
        let me = format!("{label} '{}'", n.name);

        // read after write
        for &t in &n.inputs {
            for &w in self.writers.get(&t).cloned().unwrap_or_default().iter() {
                let by = self.prog.launches[w].label.to_string();
                self.depend(s, &mut waits, &mut c, w, EdgeKind::Data, || {
                    format!("{me} reads '{}' written by {by}", g.name(t))
                });
            }
        }
        // write after read and write after write (in-place updates of persistent tensors)
        for &t in &n.updates {
            let prior: Vec<usize> = self
                .readers
                .get(&t)
                .into_iter()
                .flatten()
                .chain(self.writers.get(&t).into_iter().flatten())
                .copied()
                .collect();
            for d in prior {
                let by = self.prog.launches[d].label.to_string();
                self.depend(s, &mut waits, &mut c, d, EdgeKind::Data, || {
                    format!("{me} updates '{}' used by {by}", g.name(t))
                });
            }
        }
        // the join before whatever needs every gradient
        if s == 0 && self.join_next {
            self.join_next = false;
            for other in 1..self.prog.streams {
                if let Some(last) = self.last_on[other] {
                    let by = self.prog.launches[last].label.to_string();
                    let sid = StreamId(other as u16);
                    self.depend(s, &mut waits, &mut c, last, EdgeKind::Join, || {
                        format!("join: {me} waits for {sid}, last {by}")
                    });
                }
            }
        }
        if let Some(x) = self.start_after.take() {
            let by = self.prog.launches[x].label.to_string();
            self.depend(s, &mut waits, &mut c, x, EdgeKind::Start, || {
                format!("start: {me} reads nothing the step computes; it starts after {by}")
            });
        }
        // the occupancy rule, both directions
        if let Some(x) = self.pending_exclusive[s].take() {
            let by = self.prog.launches[x].label.to_string();
            self.depend(s, &mut waits, &mut c, x, EdgeKind::Occupancy, || {
                format!("occupancy: {me} waits for device-filling {by}")
            });
        }
        if exclusive {
            for other in 0..self.prog.streams {
                if other != s {
                    if let Some(last) = self.last_on[other] {
                        let by = self.prog.launches[last].label.to_string();
                        self.depend(s, &mut waits, &mut c, last, EdgeKind::Occupancy, || {
                            format!(
                                "occupancy: device-filling {me} waits for {by} on {}",
                                StreamId(other as u16)
                            )
                        });
                    }
                    self.pending_exclusive[other] = Some(i);
                }
            }
        }
        c[s] += 1;
        self.clock[s] = c.clone();
        self.launch_clock.push(c);
        for &t in &n.inputs {
            self.readers.entry(t).or_default().push(i);
        }
        for &t in n.outputs.iter().chain(&n.updates) {
            self.writers.entry(t).or_default().push(i);
        }
        self.last_on[s] = Some(i);
        self.prog.launches.push(Launch {
            node,
            stream,
            waits,
            record: None,
            label,
            spec,
            exclusive,
        });
    }

    /// Drops waits that order nothing new (their order already follows from others),
    /// then numbers the events that remain densely.
    fn finish(mut self) -> StepProgram {
        let mut p = std::mem::replace(
            &mut self.prog,
            StepProgram {
                launches: Vec::new(),
                streams: 0,
                events: 0,
                kind: ScheduleKind::Serial,
                late_stream: None,
                weight_grad_from: None,
                priorities: Priorities::RANKED,
                forward_from: None,
            },
        );
        let base = vector_clocks(&p);
        for i in 0..p.launches.len() {
            let mut w = 0;
            while w < p.launches[i].waits.len() {
                let removed = p.launches[i].waits.remove(w);
                if vector_clocks(&p) == base {
                    continue;
                }
                p.launches[i].waits.insert(w, removed);
                w += 1;
            }
        }
        let mut used: Vec<EventId> = p
            .launches
            .iter()
            .flat_map(|l| l.waits.iter().map(|w| w.event))
            .collect();
        used.sort();
        used.dedup();
        let renumber: BTreeMap<EventId, EventId> = used
            .iter()
            .enumerate()
            .map(|(i, &e)| (e, EventId(i as u32)))
            .collect();
        for l in &mut p.launches {
            l.record = l.record.and_then(|e| renumber.get(&e).copied());
            for w in &mut l.waits {
                w.event = renumber[&w.event];
            }
        }
        p.events = used.len();
        p
    }
}

/// Builds the step program of a trainable graph.
pub fn schedule(g: &Graph, part: &Partition, cfg: &ScheduleConfig) -> StepProgram {
    let split_dw = cfg.kind == ScheduleKind::Early && cfg.weight_grad_streams;
    let pooled = match cfg.kind {
        ScheduleKind::Serial => 1,
        ScheduleKind::Early if split_dw => 1 + 2 * cfg.side_streams.max(1),
        ScheduleKind::Early => 1 + cfg.side_streams.max(1),
    };
    // each block's own forward launches on a forward stream of the block, after the pool
    // and its companions
    let owners = if cfg.kind == ScheduleKind::Early && cfg.forward_streams {
        block_owners(g, part)
    } else {
        BTreeMap::new()
    };
    let mut blocks: Vec<usize> = Vec::new();
    for &n in &part.forward {
        if let Some(&k) = owners.get(&n) {
            if !blocks.contains(&k) {
                blocks.push(k);
            }
        }
    }
    let streams = pooled + blocks.len();
    let fwd_stream = |n: NodeId| -> StreamId {
        owners
            .get(&n)
            .and_then(|k| blocks.iter().position(|b| b == k))
            .map_or(StreamId::MAIN, |i| StreamId((pooled + i) as u16))
    };
    // the stream of an early program's node on side stream `s`
    let on = |n: NodeId, s: StreamId| -> StreamId {
        if split_dw && matches!(g.node(n).op, erase_graph::Op::LinearGradWeight { .. }) {
            StreamId(s.0 + cfg.side_streams.max(1) as u16)
        } else {
            s
        }
    };
    let mut b = Builder {
        g,
        cfg,
        prog: StepProgram {
            launches: Vec::new(),
            streams,
            events: 0,
            kind: cfg.kind,
            late_stream: None,
            weight_grad_from: None,
            priorities: cfg.priorities,
            forward_from: (!blocks.is_empty()).then_some(StreamId(pooled as u16)),
        },
        clock: vec![vec![0; streams]; streams],
        launch_clock: Vec::new(),
        writers: BTreeMap::new(),
        readers: BTreeMap::new(),
        pending_exclusive: vec![None; streams],
        last_on: vec![None; streams],
        join_next: false,
        start_after: None,
    };
    let fwd_block = |n: NodeId| scope_of(&g.node(n).name).to_string();
    match cfg.kind {
        ScheduleKind::Serial => {
            for &n in &part.forward {
                b.push(n, StreamId::MAIN, &fwd_block(n));
            }
            let mut bwd: Vec<(NodeId, &str)> = part
                .programs
                .iter()
                .flat_map(|p| p.nodes.iter().map(move |&n| (n, p.name.as_str())))
                .collect();
            bwd.sort_by_key(|x| x.0);
            for (n, name) in bwd {
                b.push(n, StreamId::MAIN, name);
            }
        }
        ScheduleKind::Early => {
            // early per-block updates read the step count: increment it first
            if !part.early_updates.is_empty() {
                for &n in &part.optimizer {
                    if matches!(g.node(n).op, erase_graph::Op::StepIncrement) {
                        b.push(n, StreamId::MAIN, "optim");
                    }
                }
            }
            let mut next_side = 0usize;
            let sides = cfg.side_streams.max(1);
            // a program of the step's inputs alone (the ids' sort) ends long before any
            // block's backward begins: it takes the first side stream without a turn of
            // the round robin or of the late stream, which stay the blocks'
            let inputs_only = |p: &erase_graph::BackwardProgram| {
                p.nodes.first().is_some_and(|f| !part.ready.contains_key(f))
            };
            // the last early program, on the last side stream alone when there are two
            let early = (0..part.forward.len())
                .map(|pos| part.ready_at(pos).filter(|(_, p)| !inputs_only(p)).count())
                .sum::<usize>();
            let late = cfg.late_stream && sides >= 2 && early >= 2;
            let shared = if late { sides - 1 } else { sides };
            if late {
                b.prog.late_stream = Some(StreamId(sides as u16));
            }
            if split_dw {
                b.prog.weight_grad_from = Some(StreamId(1 + sides as u16));
            }
            // forward work that reads only parameters (the bf16 copies of the weights)
            // needs nothing the step computes: it runs on the first side stream, idle at
            // the step's start, behind the first forward launch (so after the previous
            // step's update of those parameters), instead of on the main stream
            let param_only = |n: NodeId| {
                let node = g.node(n);
                !node.inputs.is_empty()
                    && node.inputs.iter().all(|&t| {
                        matches!(
                            g.leaf(t),
                            Some(erase_graph::Leaf::Param { .. } | erase_graph::Leaf::Const(_))
                        )
                    })
            };
            let hoisted: Vec<NodeId> = part
                .forward
                .iter()
                .copied()
                .filter(|&n| param_only(n))
                .collect();
            let mut hoist_pending = !hoisted.is_empty();
            let mut placed_early = 0usize;
            let mut fwd_started = vec![false; blocks.len()];
            for (pos, &n) in part.forward.iter().enumerate() {
                if !hoisted.contains(&n) {
                    let mut s = fwd_stream(n);
                    if s != StreamId::MAIN {
                        let first = &mut fwd_started[s.0 as usize - pooled];
                        if !*first {
                            // a forward stream's first launch may read only the step's
                            // inputs and parameters: like the hoisted copies it starts
                            // after a launch on main (after the inputs are in place, never
                            // over the previous step's end); with none yet, it runs on main
                            match b.last_on[0] {
                                Some(m) => {
                                    b.start_after = Some(m);
                                    *first = true;
                                }
                                None => s = StreamId::MAIN,
                            }
                        }
                    }
                    b.push(n, s, &fwd_block(n));
                    if hoist_pending {
                        hoist_pending = false;
                        b.start_after = b.prog.launches.len().checked_sub(1);
                        for &h in &hoisted {
                            b.push(h, StreamId(1), &fwd_block(h));
                        }
                    }
                }
                for (k, prog) in part.ready_at(pos) {
                    let s = if inputs_only(prog) {
                        // it waits for the forward launch it is placed behind
                        b.start_after = b.last_on[0];
                        StreamId(1)
                    } else {
                        placed_early += 1;
                        if late && placed_early == early {
                            StreamId(sides as u16)
                        } else {
                            next_side += 1;
                            StreamId(1 + ((next_side - 1) % shared) as u16)
                        }
                    };
                    for &bn in &prog.nodes {
                        b.push(bn, on(bn, s), &prog.name);
                    }
                    for &un in part.early_updates.get(&k).into_iter().flatten() {
                        b.push(un, s, &prog.name);
                    }
                }
            }
            for prog in part.programs.iter().filter(|p| !p.early) {
                for &bn in &prog.nodes {
                    b.push(bn, StreamId::MAIN, &prog.name);
                }
            }
        }
    }
    let placed: std::collections::BTreeSet<NodeId> = match cfg.kind {
        ScheduleKind::Early if !part.early_updates.is_empty() => part
            .early_updates
            .values()
            .flatten()
            .copied()
            .chain(
                part.optimizer
                    .iter()
                    .copied()
                    .filter(|&n| matches!(g.node(n).op, erase_graph::Op::StepIncrement)),
            )
            .collect(),
        _ => Default::default(),
    };
    // the join comes with the first optimizer launch: a data-parallel step all-reduces
    // the dense gradients there (runtime/src/cuda/collective.rs), so every stream must be
    // done by then (the row-wise update ahead of the join measured no faster on an H200).
    // Without it (updates_by_data), the row-wise update runs on the stream of the last
    // launch that wrote one of its inputs (the embedding gradient's sum), and the dense
    // update on main waits only for its gradients:
    // the embedding gradient's sum, which waits for every block, and the weight
    // gradients, the last of which often end sooner, then run their updates side by side.
    let by_data = cfg.updates_by_data && cfg.kind == ScheduleKind::Early;
    b.join_next = !by_data;
    for &n in part.optimizer.iter().filter(|n| !placed.contains(n)) {
        let mut s = StreamId::MAIN;
        if by_data && matches!(g.node(n).op, erase_graph::Op::RowwiseAdagrad { .. }) {
            let last = g
                .node(n)
                .inputs
                .iter()
                .filter_map(|t| b.writers.get(t).and_then(|w| w.last()))
                .max();
            if let Some(w) = last {
                s = b.prog.launches[*w].stream;
            }
        }
        b.push(n, s, "optim");
    }
    b.finish()
}

/// For each forward launch that exactly one early program's local loss depends on (its
/// block's layers and head), that program's index in `part.programs`. Found from the
/// dependencies alone, as the partition finds its programs: a node's set is the early
/// losses it reaches, so the shared embeddings (every block reads them), the bottom MLP
/// (it is a field of them) and the top (no early loss reads it) belong to none.
fn block_owners(g: &Graph, part: &Partition) -> BTreeMap<NodeId, usize> {
    let mut reach: BTreeMap<NodeId, std::collections::BTreeSet<usize>> = BTreeMap::new();
    for (k, p) in part.programs.iter().enumerate() {
        // a program of the step's inputs alone (the ids' sort) has no loss of its own
        let inputs_only = p.nodes.first().is_some_and(|f| !part.ready.contains_key(f));
        if p.early && !inputs_only {
            if let Some(&head) = part.forward.get(p.ready_after) {
                reach.entry(head).or_default().insert(k);
            }
        }
    }
    // the forward order is topological: every consumer of a node comes after it
    for &n in part.forward.iter().rev() {
        let Some(set) = reach.get(&n).cloned() else {
            continue;
        };
        for &t in &g.node(n).inputs {
            let p = g.info(t).producer;
            let node = g.node(p);
            if node.phase == Phase::Forward && !node.op.is_leaf() {
                reach.entry(p).or_default().extend(set.iter().copied());
            }
        }
    }
    reach
        .into_iter()
        .filter(|(_, s)| s.len() == 1)
        .filter_map(|(n, s)| s.first().map(|&k| (n, k)))
        .collect()
}

impl StepProgram {
    /// The program restricted to the launches `which` (indices in issue order, such as the
    /// forward launches an evaluation runs), each waiting so that every two of them are
    /// ordered as in the whole program. A wait of the whole program can rest on a launch
    /// left out (an order that follows through a backward launch, or through one the
    /// occupancy rule ordered, makes a direct wait redundant there), so the waits are
    /// derived anew: each launch waits, for every other stream, on the last launch of
    /// `which` there that happens before it in the whole program, unless an earlier wait
    /// already orders it. Events are numbered from 0.
    pub fn restricted(&self, which: &[usize]) -> StepProgram {
        let clocks = vector_clocks(self);
        let n = self.streams;
        // per stream, the subset's launches on it so far (positions in `which`)
        let mut on: Vec<Vec<usize>> = vec![Vec::new(); n];
        // per stream, how many subset launches of each stream are ordered before its next
        let mut clock: Vec<Vec<usize>> = vec![vec![0; n]; n];
        let mut sub_clock: Vec<Vec<usize>> = Vec::with_capacity(which.len());
        let mut record: Vec<Option<EventId>> = vec![None; which.len()];
        let mut events = 0u32;
        let mut launches: Vec<Launch> = Vec::with_capacity(which.len());
        for (p, &j) in which.iter().enumerate() {
            let s = self.launches[j].stream.0 as usize;
            let mut c = clock[s].clone();
            let mut waits = Vec::new();
            for t in (0..n).filter(|&t| t != s) {
                // the last subset launch on t ordered before j (order on a stream is a
                // prefix: once one is, every earlier one is)
                let Some(k) = on[t]
                    .iter()
                    .rposition(|&q| happens_before(self, &clocks, which[q], j))
                else {
                    continue;
                };
                if c[t] > k {
                    continue;
                }
                let q = on[t][k];
                let e = *record[q].get_or_insert_with(|| {
                    events += 1;
                    EventId(events - 1)
                });
                for (a, b) in c.iter_mut().zip(&sub_clock[q]) {
                    *a = (*a).max(*b);
                }
                waits.push(Wait {
                    event: e,
                    kind: EdgeKind::Data,
                    why: format!(
                        "restricted: ordered after {} as in the whole step",
                        self.launches[which[q]].label
                    ),
                });
            }
            on[s].push(p);
            c[s] = on[s].len();
            clock[s] = c.clone();
            sub_clock.push(c);
            launches.push(Launch {
                waits,
                record: None,
                ..self.launches[j].clone()
            });
        }
        for (l, r) in launches.iter_mut().zip(record) {
            l.record = r;
        }
        StepProgram {
            launches,
            streams: n,
            events: events as usize,
            kind: self.kind,
            late_stream: self.late_stream,
            weight_grad_from: self.weight_grad_from,
            priorities: self.priorities,
            forward_from: self.forward_from,
        }
    }

    /// How many priority levels below the greatest stream `s` runs (0: the greatest;
    /// `u32::MAX`: the least the device has). With [`Priorities::RANKED`]: the main stream
    /// first, then the late stream, then the pool streams, then their weight-gradient
    /// companions; a level the priorities leave out merges with the one above it, and the
    /// least level of the program (if not main's) is the device's least.
    pub fn stream_rank(&self, s: StreamId) -> u32 {
        let least = (0..self.streams)
            .map(|k| self.stream_level(StreamId(k as u16)))
            .max()
            .unwrap_or(0);
        match self.stream_level(s) {
            l if l == least && l > 0 => u32::MAX,
            l => l,
        }
    }

    /// The level of [`StepProgram::stream_rank`] before the least is mapped to the
    /// device's least.
    fn stream_level(&self, s: StreamId) -> u32 {
        let p = self.priorities;
        let late = u32::from(p.main_first);
        let pool = late + u32::from(p.late_first);
        match s {
            StreamId::MAIN => 0,
            _ if self.forward_from.is_some_and(|f| s >= f) => 0,
            _ if self.late_stream == Some(s) => late,
            _ if self.weight_grad_from.is_none_or(|w| s < w) => pool,
            _ => pool + u32::from(p.companions_last),
        }
    }

    /// The launches of `stream`, by index, in stream order.
    pub fn on_stream(&self, s: StreamId) -> impl Iterator<Item = usize> + '_ {
        self.launches
            .iter()
            .enumerate()
            .filter(move |(_, l)| l.stream == s)
            .map(|(i, _)| i)
    }

    /// For every event, the launch that records it.
    pub fn recorders(&self) -> BTreeMap<EventId, usize> {
        self.launches
            .iter()
            .enumerate()
            .filter_map(|(i, l)| l.record.map(|e| (e, i)))
            .collect()
    }

    /// Each stream's launches, in stream order.
    pub fn stream_queues(&self) -> Vec<Vec<usize>> {
        (0..self.streams)
            .map(|s| self.on_stream(StreamId(s as u16)).collect())
            .collect()
    }

    /// Every cross-stream edge, as (waiting launch, recording launch, wait).
    pub fn edges(&self) -> Vec<(usize, usize, &Wait)> {
        let recorder = self.recorders();
        let mut out = Vec::new();
        for (i, l) in self.launches.iter().enumerate() {
            for w in &l.waits {
                if let Some(&r) = recorder.get(&w.event) {
                    out.push((i, r, w));
                }
            }
        }
        out
    }

    /// Each stream's work as runs of consecutive launches of one block and phase, e.g.
    /// `side1: bwd:bottom x16, bwd:deep x18`.
    pub fn render_streams(&self) -> String {
        let mut s = String::new();
        for sid in 0..self.streams {
            let sid = StreamId(sid as u16);
            let mut runs: Vec<(String, usize)> = Vec::new();
            for i in self.on_stream(sid) {
                let l = &self.launches[i];
                let key = if l.label.phase == "optim" {
                    "optim".to_string()
                } else {
                    format!("{}:{}", l.label.phase, l.label.block)
                };
                match runs.last_mut() {
                    Some((k, n)) if *k == key => *n += 1,
                    _ => runs.push((key, 1)),
                }
            }
            let parts: Vec<String> = runs.iter().map(|(k, n)| format!("{k} x{n}")).collect();
            let _ = writeln!(s, "  {sid}: {}", parts.join(", "));
        }
        s
    }

    /// The program as text, in issue order: each launch with its stream, the events it
    /// waits for (and why) and the event it records.
    pub fn render(&self, g: &Graph) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "step program: {} launches on {} stream(s), {} cross-stream event(s)",
            self.launches.len(),
            self.streams,
            self.events
        );
        for (i, l) in self.launches.iter().enumerate() {
            let rec = l
                .record
                .map_or(String::new(), |e| format!("  -> record e{}", e.0));
            let ex = if l.exclusive {
                "  [fills the device: not overlapped]"
            } else {
                ""
            };
            let _ = writeln!(
                s,
                "{i:5} {:<6} {:<44} '{}'{rec}{ex}",
                l.stream.to_string(),
                l.label.to_string(),
                g.node(l.node).name
            );
            for w in &l.waits {
                let kind = match w.kind {
                    EdgeKind::Data => "data",
                    EdgeKind::Join => "join",
                    EdgeKind::Occupancy => "occupancy",
                    EdgeKind::Start => "start",
                };
                let _ = writeln!(s, "{:12}wait e{} [{kind}] {}", "", w.event.0, w.why);
            }
        }
        s
    }
}
