//! Data parallelism with the CPU collective backend: each rank (a thread) trains a replica
//! on its shard of every global batch (rank `k` of `n` takes examples `i` with
//! `i mod n = k`), the dense gradients are all-reduced one bucket per backward program
//! (in program order, so every rank issues the same collectives in the same order), the
//! embedding tables' sparse gradients are all-gathered at a fixed shape, and every rank
//! applies the same updates: replicas stay bit-identical. The CUDA/NCCL path will follow
//! the same plan.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};

use crate::train::{plan_step_data_parallel, StepPlan, TrainConfig};
use erase_graph::{DType, Grad, Op, Phase, Tensor};
use erase_ops::{Buffer, NodeCall};
use erase_runtime::collective::{cpu_group, Collective, CollectiveRecord};
use erase_runtime::cpu::runner::ProgramRunner;

/// What one rank ends with.
#[derive(Debug, Clone)]
pub struct RankResult {
    pub rank: usize,
    /// Every persistent tensor's bytes (parameters and optimizer state), in tensor order.
    pub state: Vec<u8>,
    /// What `state` holds: each tensor's name, element type and element count, in order.
    pub layout: StateLayout,
    /// The main loss of the rank's shard, per step.
    pub losses: Vec<f64>,
    /// Every collective the rank issued.
    pub log: Vec<CollectiveRecord>,
    /// Wall-clock seconds of each step (data, compute and collectives).
    pub step_secs: Vec<f64>,
}

/// The tensors of a replica's state in order: name, element type, element count.
pub type StateLayout = Vec<(String, DType, usize)>;

/// A rank that fails on purpose at a step (to test that the others stop).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FailAt {
    pub rank: usize,
    pub step: usize,
    pub how: FailHow,
}

/// How a rank fails on purpose.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FailHow {
    /// Returns an error (the process exits with a message).
    #[default]
    Error,
    /// Aborts the process (SIGABRT, no message): a crash.
    Abort,
    /// Stops calling collectives (sleeps): the others must time out.
    Hang,
}

impl FailAt {
    /// Reads `ERASE_FAIL_AT_STEP=RANK:STEP[:error|abort|hang]` (a test hook).
    pub fn from_env() -> Result<Option<FailAt>> {
        let Ok(v) = std::env::var("ERASE_FAIL_AT_STEP") else {
            return Ok(None);
        };
        let parts: Vec<&str> = v.split(':').collect();
        let bad = || anyhow!("ERASE_FAIL_AT_STEP={v}: expected RANK:STEP[:error|abort|hang]");
        let (Some(r), Some(st)) = (parts.first(), parts.get(1)) else {
            return Err(bad());
        };
        let how = match parts.get(2).copied() {
            None | Some("error") => FailHow::Error,
            Some("abort") => FailHow::Abort,
            Some("hang") => FailHow::Hang,
            Some(_) => return Err(bad()),
        };
        Ok(Some(FailAt {
            rank: r.parse().map_err(|_| bad())?,
            step: st.parse().map_err(|_| bad())?,
            how,
        }))
    }

    /// Fails here if this is the rank and the step.
    pub fn check(this: Option<FailAt>, rank: usize, step: usize) -> Result<()> {
        let Some(f) = this.filter(|f| f.rank == rank && f.step == step) else {
            return Ok(());
        };
        match f.how {
            FailHow::Error => bail!("rank {rank} failed on purpose at step {step}"),
            FailHow::Abort => {
                eprintln!("rank {rank}: aborting on purpose at step {step}");
                std::process::abort()
            }
            FailHow::Hang => loop {
                std::thread::sleep(Duration::from_secs(3600));
            },
        }
    }
}

/// When the dense gradients are all-reduced.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AllReduce {
    /// One bucket per backward program, as soon as that program ends (on the GPU, on a
    /// communication stream while later work runs).
    #[default]
    Early,
    /// One bucket of every dense gradient, after the whole backward.
    End,
}

impl AllReduce {
    pub fn as_str(self) -> &'static str {
        match self {
            AllReduce::Early => "early",
            AllReduce::End => "end",
        }
    }
}

/// One rank's share of each global batch (of the synthetic stream or of the loaded
/// examples, in the order one process would train them): examples `rank`, `rank +
/// world`, `rank + 2 world`, ... of it, so that the ranks together train on the global
/// batch.
pub(crate) struct Shard {
    rank: usize,
    world: usize,
    /// The model at the global batch (what the global batch is filled for).
    global_cfg: crate::model::ctr::CtrConfig,
    /// Dense features and ids per example.
    per: (usize, usize),
    all: (Vec<f32>, Vec<u32>, Vec<f32>),
    mine: (Vec<f32>, Vec<u32>, Vec<f32>),
}

impl Shard {
    /// `local` is the model one rank trains (its batch a `world`-th of `global`).
    pub(crate) fn new(
        local: &crate::model::ctr::CtrConfig,
        global: usize,
        rank: usize,
        world: usize,
    ) -> Shard {
        let (nd, ns, b) = (local.num_dense, local.slots_per_example(), local.batch);
        let global_cfg = crate::model::ctr::CtrConfig {
            batch: global,
            ..local.clone()
        };
        Shard {
            rank,
            world,
            global_cfg,
            per: (nd, ns),
            all: (
                vec![0.0; global * nd],
                vec![0; global * ns],
                vec![0.0; global],
            ),
            mine: (vec![0.0; b * nd], vec![0; b * ns], vec![0.0; b]),
        }
    }

    /// This rank's examples of global batch `step`: (dense, rows, labels).
    pub(crate) fn fill(
        &mut self,
        src: &mut crate::train::BatchSource,
        step: usize,
    ) -> (&[f32], &[u32], &[f32]) {
        let ((nd, ns), g) = (self.per, self.global_cfg.batch);
        let (gd, gr, gy) = &mut self.all;
        src.fill(&self.global_cfg, step, (gd, gr, gy));
        let (d, r, y) = &mut self.mine;
        for (j, i) in (self.rank..g).step_by(self.world).enumerate() {
            d[j * nd..(j + 1) * nd].copy_from_slice(&gd[i * nd..(i + 1) * nd]);
            r[j * ns..(j + 1) * ns].copy_from_slice(&gr[i * ns..(i + 1) * ns]);
            y[j] = gy[i];
        }
        (d, r, y)
    }
}

/// Trains `cfg` (its `model.batch` is the global batch) on `world` CPU ranks, on its
/// data (synthetic or loaded), with its checkpoints and resume. Returns each rank's
/// result or its error.
pub fn train_data_parallel_cpu(
    cfg: &TrainConfig,
    world: usize,
    timeout: Duration,
    fail: Option<FailAt>,
) -> Result<Vec<Result<RankResult>>> {
    if cfg.schedule.early_updates {
        bail!("early per-block updates would run before the gradients are all-reduced; data parallelism updates at the end");
    }
    if world == 0 || !cfg.model.batch.is_multiple_of(world) {
        bail!(
            "the global batch {} must split evenly over {world} ranks",
            cfg.model.batch
        );
    }
    let mut local = cfg.model.clone();
    local.batch = cfg.model.batch / world;
    let comms = cpu_group(world, timeout);
    let results = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let local = local.clone();
                s.spawn(move || {
                    let mut comm = comm;
                    run_rank(cfg, &local, world, &mut comm, fail, AllReduce::Early)
                })
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow!("rank {rank} panicked")))
            })
            .collect()
    });
    Ok(results)
}

/// The dense gradients of each backward program, in program order: one bucket each
/// (`Early`), or all of them in one bucket named `all` (`End`).
pub fn buckets(plan: &StepPlan, mode: AllReduce) -> Vec<(String, Vec<Tensor>)> {
    let early = early_buckets(plan);
    match mode {
        AllReduce::Early => early,
        AllReduce::End => vec![(
            "all".to_string(),
            early.into_iter().flat_map(|(_, ts)| ts).collect(),
        )],
    }
}

fn early_buckets(plan: &StepPlan) -> Vec<(String, Vec<Tensor>)> {
    let mut by_program: BTreeMap<usize, Vec<Tensor>> = BTreeMap::new();
    for (p, grad) in &plan.training.grads.by_param {
        if let (Grad::Dense(t), Some(&prog)) = (grad, plan.partition.grad_complete.get(p)) {
            by_program.entry(prog).or_default().push(*t);
        }
    }
    by_program
        .into_iter()
        .map(|(i, ts)| (plan.partition.programs[i].name.clone(), ts))
        .collect()
}

/// Trains one rank's replica with `comm` (the in-process or the TCP backend): `local`
/// is the per-rank model (its batch the global batch over `world`).
pub fn run_rank<C: Collective>(
    cfg: &TrainConfig,
    local: &crate::model::ctr::CtrConfig,
    world: usize,
    comm: &mut C,
    fail: Option<FailAt>,
    mode: AllReduce,
) -> Result<RankResult> {
    let rank = comm.rank();
    // CPU ranks: f32 GEMMs, no bf16 copies of their operands
    let sched = crate::train::ScheduleOptions {
        bf16_copies: false,
        ..cfg.schedule.clone()
    };
    let plan = plan_step_data_parallel(local, DType::F32, &cfg.optimizer, &sched)?;
    let m = &plan.model;
    let g = &m.graph;
    let mut runner = ProgramRunner::new(g, &plan.program, &plan.memory, cfg.seed, 1)?;
    let mut src = crate::train::BatchSource::new(&cfg.data, &cfg.model, cfg.data_seed)?;
    let ck = RankCheckpoints::resume(cfg, g, &mut runner, rank)?;
    let first = ck.first;
    // launches before the optimizer, and the dense optimizer's (row-wise Adagrad is
    // applied below, on the gathered sparse gradients)
    let mut before = Vec::new();
    let mut dense_opt = Vec::new();
    let mut sparse_opt = Vec::new();
    for (i, l) in plan.program.launches.iter().enumerate() {
        let n = g.node(l.node);
        match (&n.op, n.phase) {
            (Op::RowwiseAdagrad { .. }, _) => sparse_opt.push(l.node),
            (_, Phase::Optimizer) => dense_opt.push(i),
            _ => before.push(i),
        }
    }
    let buckets = buckets(&plan, mode);
    let mut shard = Shard::new(local, cfg.model.batch, rank, world);
    let scale = 1.0 / world as f32;
    let mut losses = Vec::with_capacity(cfg.steps);
    let mut step_secs = Vec::with_capacity(cfg.steps);
    for step in first..cfg.steps {
        FailAt::check(fail, rank, step)?;
        let t0 = std::time::Instant::now();
        // this rank's shard of the global batch
        let (d, r, y) = shard.fill(&mut src, step);
        let (bd, bi, bo, bl) = m.batch_buffers(d, r, y)?;
        runner.feed(m.inputs.dense, bd)?;
        runner.feed(m.inputs.ids, bi)?;
        runner.feed(m.inputs.offsets, bo)?;
        runner.feed(m.inputs.label, bl)?;
        runner
            .run_order(&before)
            .with_context(|| format!("rank {rank}, step {step}"))?;
        losses.push(
            runner
                .get(m.main_loss)
                .and_then(|x| x.to_f64().first().copied())
                .unwrap_or(f64::NAN),
        );

        // dense gradients: the mean over ranks, one all-reduce per backward program
        for (name, grads) in &buckets {
            let mut flat: Vec<f32> = Vec::new();
            for &t in grads {
                let v = runner
                    .get(t)
                    .ok_or_else(|| anyhow!("gradient '{}' has no value", g.name(t)))?;
                flat.extend(
                    v.as_f32()
                        .ok_or_else(|| anyhow!("gradient '{}' is not f32", g.name(t)))?,
                );
            }
            comm.all_reduce_sum(name, &mut flat)?;
            let mut at = 0;
            for &t in grads {
                let n = g.shape(t).numel();
                let mean: Vec<f32> = flat[at..at + n].iter().map(|v| v * scale).collect();
                runner.write(t, &Buffer::F32(mean))?;
                at += n;
            }
        }
        // sparse gradients: every rank gathers every rank's (ids, offsets, pooled
        // gradient) and applies the same row-wise Adagrad to the same rows
        for &node in &sparse_opt {
            let n = g.node(node);
            let (ids, offsets, dpooled) = (n.inputs[0], n.inputs[1], n.inputs[2]);
            let get = |t: Tensor| {
                runner
                    .get(t)
                    .ok_or_else(|| anyhow!("'{}' has no value", g.name(t)))
            };
            let (ids_v, off_v, dp_v) = (get(ids)?, get(offsets)?, get(dpooled)?);
            let all_ids = comm.all_gather(&format!("{}.ids", n.name), ids_v.bytes())?;
            let all_off = comm.all_gather(&format!("{}.offsets", n.name), off_v.bytes())?;
            let all_dp = comm.all_gather(&format!("{}.grad", n.name), dp_v.bytes())?;
            let (mut gids, mut goff, mut gdp) = (Vec::<i32>::new(), vec![0i32], Vec::<f32>::new());
            for k in 0..world {
                let base = gids.len() as i32;
                gids.extend(bytemuck_vec::<i32>(&all_ids[k]));
                goff.extend(
                    bytemuck_vec::<i32>(&all_off[k])
                        .into_iter()
                        .skip(1)
                        .map(|o| o + base),
                );
                gdp.extend(
                    bytemuck_vec::<f32>(&all_dp[k])
                        .into_iter()
                        .map(|v| v * scale),
                );
            }
            let dp_shape = g.shape(dpooled).dims();
            let global_dp =
                erase_graph::Shape::new(&[dp_shape[0] * world, dp_shape[1], dp_shape[2]]);
            let (ids_s, off_s) = (
                erase_graph::Shape::new(&[gids.len()]),
                erase_graph::Shape::new(&[goff.len()]),
            );
            let mut upd: Vec<Buffer> = n.updates.iter().map(|&t| get(t)).collect::<Result<_>>()?;
            let call = NodeCall {
                op: &n.op,
                name: &n.name,
                in_shapes: vec![&ids_s, &off_s, &global_dp],
                out_shapes: Vec::new(),
                bf16_gemm: false,
            };
            let ins = [Buffer::I32(gids), Buffer::I32(goff), Buffer::F32(gdp)];
            let refs: Vec<&Buffer> = ins.iter().collect();
            erase_ops::execute(&call, &refs, &mut [], &mut upd)?;
            for (&t, v) in n.updates.iter().zip(upd) {
                runner.feed(t, v)?;
            }
        }
        runner
            .run_order(&dense_opt)
            .with_context(|| format!("rank {rank}, step {step}: optimizer"))?;
        step_secs.push(t0.elapsed().as_secs_f64());
        if ck.due(cfg, rank, step + 1) {
            ck.save(cfg, g, &runner, step + 1)?;
        }
    }
    comm.barrier("end of training")?;
    let (state, layout) = persistent_state(g, |t| {
        runner
            .get(t)
            .ok_or_else(|| anyhow!("'{}' has no value", g.name(t)))
    })?;
    Ok(RankResult {
        rank,
        state,
        layout,
        losses,
        log: comm.log().to_vec(),
        step_secs,
    })
}

/// The persistent tensors of `g` (read through `get`) as one byte string in tensor
/// order, with each one's name, type and length.
pub(crate) fn persistent_state(
    g: &erase_graph::Graph,
    get: impl Fn(Tensor) -> Result<Buffer>,
) -> Result<(Vec<u8>, StateLayout)> {
    let (mut state, mut layout) = (Vec::new(), Vec::new());
    for t in g.tensors().filter(|&t| g.is_persistent(t)) {
        let b = get(t)?;
        state.extend_from_slice(b.bytes());
        layout.push((g.name(t).to_string(), b.dtype(), b.len()));
    }
    Ok((state, layout))
}

/// A data-parallel rank's checkpoints (CPU and CUDA ranks alike): the identity they carry
/// is the run's at the global batch, since every rank holds the same replica, so a
/// checkpoint resumes on any rank count; rank 0 writes it.
pub(crate) struct RankCheckpoints {
    identity: Vec<(String, String)>,
    /// The step this rank starts at (that of the checkpoint it resumed, else 0).
    pub first: usize,
}

impl RankCheckpoints {
    /// Restores `--resume`'s checkpoint into `store`, if one is asked for.
    pub(crate) fn resume(
        cfg: &TrainConfig,
        g: &erase_graph::Graph,
        store: &mut dyn crate::checkpoint::TensorStore,
        rank: usize,
    ) -> Result<RankCheckpoints> {
        let identity = if cfg.resume.is_some() || cfg.checkpoint.is_some() {
            cfg.identity()
        } else {
            Vec::new()
        };
        let mut first = 0;
        if let Some(path) = &cfg.resume {
            let st = crate::checkpoint::load(path, g, store, Some(&identity))
                .with_context(|| format!("rank {rank}: resuming"))?;
            first = st.step as usize;
            if first >= cfg.steps {
                bail!(
                    "{} is already at step {first}; ask for more --steps than that",
                    path.display()
                );
            }
        }
        Ok(RankCheckpoints { identity, first })
    }

    /// Whether `rank` writes a checkpoint once `done` steps are complete: rank 0, every
    /// `--checkpoint-every` steps and at the end; the others go on.
    pub(crate) fn due(&self, cfg: &TrainConfig, rank: usize, done: usize) -> bool {
        rank == 0
            && cfg.checkpoint.is_some()
            && (done == cfg.steps
                || (cfg.checkpoint_every > 0 && done.is_multiple_of(cfg.checkpoint_every)))
    }

    /// Writes the replica in `store` after `done` steps (atomically).
    pub(crate) fn save(
        &self,
        cfg: &TrainConfig,
        g: &erase_graph::Graph,
        store: &dyn crate::checkpoint::TensorStore,
        done: usize,
    ) -> Result<()> {
        let Some(path) = &cfg.checkpoint else {
            return Ok(());
        };
        let st = crate::checkpoint::CheckpointState {
            step: done as u64,
            next_example: (done * cfg.model.batch) as u64,
            identity: self.identity.clone(),
        };
        crate::checkpoint::save(path, g, store, &st)
            .with_context(|| format!("rank 0, step {done}: checkpoint"))
    }
}

/// Evaluates a trained replica like `train` does at the end: its persistent tensors
/// (`r.state`, matched by name) are copied into the model at the global batch, on `dev`
/// or the CPU, which then runs its forward over the first `eval_examples` examples of
/// the held-out stream. Every rank ends with the same parameters, so one rank's NE is
/// the run's.
pub fn evaluate_replica(
    cfg: &TrainConfig,
    r: &RankResult,
    dev: Option<&erase_runtime::cuda::CudaDevice>,
) -> Result<crate::train::Eval> {
    let mut tensors = BTreeMap::new();
    let mut at = 0;
    for (name, dtype, n) in &r.layout {
        let end = at + n * dtype.size_bytes();
        let bytes = r
            .state
            .get(at..end)
            .ok_or_else(|| anyhow!("rank {}'s state ends inside '{name}'", r.rank))?;
        if tensors.insert(name.as_str(), (*dtype, *n, bytes)).is_some() {
            bail!("two persistent tensors are both named '{name}': name them apart to evaluate");
        }
        at = end;
    }
    let sched = crate::train::ScheduleOptions {
        bf16_copies: cfg.schedule.bf16_copies && dev.is_some(),
        ..cfg.schedule.clone()
    };
    let plan = plan_step_data_parallel(&cfg.model, DType::F32, &cfg.optimizer, &sched)?;
    let g = &plan.model.graph;
    let mut session = crate::train::Session::with_dispatch(
        &plan,
        dev,
        crate::train::Dispatch::Blocking,
        &cfg.data,
        cfg.seed,
        cfg.data_seed,
        cfg.threads.max(1),
    )?;
    for t in g.tensors().filter(|&t| g.is_persistent(t)) {
        let name = g.name(t);
        let &(dtype, n, bytes) = tensors
            .get(name)
            .ok_or_else(|| anyhow!("the per-rank model has no persistent tensor '{name}'"))?;
        if dtype != g.dtype(t) || n != g.shape(t).numel() {
            bail!(
                "'{name}' is {n} {dtype:?} values in the per-rank model but {:?} {:?} at the global batch",
                g.shape(t).dims(),
                g.dtype(t)
            );
        }
        session.write_tensor(t, erase_runtime::cpu::buffer_from_bytes(dtype, bytes))?;
    }
    session.evaluate(cfg.eval_examples)
}

fn bytemuck_vec<T: bytemuck::Pod>(bytes: &[u8]) -> Vec<T> {
    bytemuck::pod_collect_to_vec(bytes)
}
