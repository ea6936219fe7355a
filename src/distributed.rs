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

use crate::train::{
    drive, plan_step_data_parallel, CpuExec, Progress, Quiet, Session, Share, StepExec, StepPlan,
    TrainConfig,
};
use erase_graph::{DType, Grad, Op, Phase, Tensor};
use erase_ops::{Buffer, NodeCall};
use erase_runtime::collective::{cpu_group, Collective, CollectiveRecord};
use erase_runtime::cpu::runner::ProgramRunner;

/// What one rank ends with.
#[derive(Debug, Clone)]
pub struct RankResult {
    pub rank: usize,
    /// Every persistent tensor's bytes (parameters and optimizer state), in tensor order;
    /// on the ranks other than 0, less the sharded tables (`sharded`), which rank 0 alone
    /// assembles whole.
    pub state: Vec<u8>,
    /// The names of the sharded tables and their state (none when every table is
    /// replicated).
    pub sharded: Vec<String>,
    /// What `state` holds: each tensor's name, element type and element count, in order.
    pub layout: StateLayout,
    /// The main loss of the rank's shard, per step.
    pub losses: Vec<f64>,
    /// Every collective the rank issued.
    pub log: Vec<CollectiveRecord>,
    /// Wall-clock seconds of each step (data, compute and collectives).
    pub step_secs: Vec<f64>,
    /// The periodic held-out evaluations of the rank's replica (`--eval-every`), at the
    /// rank's batch.
    pub evals: Vec<crate::train::Eval>,
    /// Bytes of embedding tables and their row-wise Adagrad state the rank stored while
    /// it trained: the whole tables, or with sharded tables its own rows and the landing
    /// slots of the rows it fetches.
    pub table_bytes: u64,
    /// The rank's own held-out evaluation after the last step, where it makes one (a
    /// rank of sharded tables: its lookups fetch the rows as its steps do); otherwise
    /// rank 0 evaluates the gathered replica at the global batch.
    pub final_eval: Option<crate::train::Eval>,
}

impl RankResult {
    /// The bytes of the persistent tensor `name` in `state`, if this rank holds it.
    pub fn tensor(&self, name: &str) -> Option<&[u8]> {
        self.tensors().find(|(n, _)| *n == name).map(|(_, b)| b)
    }

    /// `state`'s tensors in order: name and bytes (cut short where `state` is).
    fn tensors(&self) -> impl Iterator<Item = (&str, &[u8])> {
        self.layout.iter().scan(0usize, |at, (name, dtype, n)| {
            let end = *at + n * dtype.size_bytes();
            let bytes = self.state.get(*at..end)?;
            *at = end;
            Some((name.as_str(), bytes))
        })
    }

    /// [`crate::launch::fnv64`] of what every rank holds: `state` less the sharded
    /// tables (all of it when none is). Equal on every rank of a run.
    pub fn replicated_fingerprint(&self) -> u64 {
        crate::launch::fnv64_parts(
            self.tensors()
                .filter(|(n, _)| !self.sharded.iter().any(|s| s == n))
                .map(|(_, b)| b),
        )
    }

    /// The run's held-out evaluation: the rank's own after the last step, or `whole`
    /// (the replica's at the global batch).
    pub fn evaluation(
        &self,
        whole: impl FnOnce() -> Result<crate::train::Eval>,
    ) -> Result<(crate::train::Eval, &'static str)> {
        match self.final_eval {
            Some(e) => Ok((e, "each rank's sharded lookup, at the rank's batch")),
            None => Ok((whole()?, "rank 0's replica at the global batch")),
        }
    }
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

/// Trains `cfg` (its `model.batch` is the global batch) on `world` CPU ranks, on its
/// data (synthetic or loaded), with its checkpoints and resume. Returns each rank's
/// result or its error.
pub fn train_data_parallel_cpu(
    cfg: &TrainConfig,
    world: usize,
    timeout: Duration,
    fail: Option<FailAt>,
) -> Result<Vec<Result<RankResult>>> {
    train_data_parallel_cpu_with(cfg, world, timeout, fail, &mut Quiet)
}

/// [`train_data_parallel_cpu`] with rank 0's progress (steps, periodic evaluations)
/// going to `progress`.
pub fn train_data_parallel_cpu_with(
    cfg: &TrainConfig,
    world: usize,
    timeout: Duration,
    fail: Option<FailAt>,
    progress: &mut (dyn Progress + Send),
) -> Result<Vec<Result<RankResult>>> {
    if cfg.schedule.early_updates {
        bail!("--optimizer-update early would update a block before its gradients are all-reduced; data parallelism updates at the end (--optimizer-update end)");
    }
    if world == 0 || !cfg.model.batch.is_multiple_of(world) {
        bail!(
            "--batch {} (the global batch) must split evenly over the {world} ranks of --cpu-ranks",
            cfg.model.batch
        );
    }
    let mut local = cfg.model.clone();
    local.batch = cfg.model.batch / world;
    let comms = cpu_group(world, timeout);
    let mut progress = Some(progress);
    let results = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let local = local.clone();
                let mine = if comm.rank() == 0 {
                    progress.take()
                } else {
                    None
                };
                s.spawn(move || {
                    let mut comm = comm;
                    let mut quiet = Quiet;
                    let p: &mut dyn Progress = match mine {
                        Some(p) => p,
                        None => &mut quiet,
                    };
                    run_rank(cfg, &local, world, &mut comm, fail, AllReduce::Early, p)
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
    progress: &mut dyn Progress,
) -> Result<RankResult> {
    let rank = comm.rank();
    // CPU ranks: f32 GEMMs, no bf16 copies of their operands
    let sched = crate::train::ScheduleOptions {
        bf16_copies: false,
        ..cfg.schedule.clone()
    };
    // where the tables live: a rank of sharded tables stores only its rows (and landing
    // slots for the rows it fetches), and its step graph is built with those sizes
    let store = crate::sharded::Storage::plan(
        &local.field_rows(),
        &local.bag_slots(),
        (local.dim, local.batch),
        (rank, world),
        cfg.rank_memory,
        (cfg.sharding, crate::sharded::Landing::Distinct),
    )
    .with_context(|| format!("rank {rank}: placing the embedding tables"))?;
    let stored = crate::model::ctr::CtrConfig {
        storage_rows: store.as_ref().map_or(Vec::new(), |s| s.stored_rows()),
        ..local.clone()
    };
    let plan = plan_step_data_parallel(&stored, DType::F32, &cfg.optimizer, &sched)?;
    let g = &plan.model.graph;
    check_rank_memory(&plan, local, (store.is_some(), true), comm)?;
    let mut runner = ProgramRunner::new(g, &plan.program, &plan.memory, cfg.seed, 1)?;
    // launches before the optimizer, and the dense optimizer's (row-wise Adagrad is
    // applied by the rank, on the gathered sparse gradients)
    let (mut before, mut dense_opt, mut sparse_opt) = (Vec::new(), Vec::new(), Vec::new());
    for (i, l) in plan.program.launches.iter().enumerate() {
        let n = g.node(l.node);
        match (&n.op, n.phase) {
            (Op::RowwiseAdagrad { .. }, _) => sparse_opt.push(l.node),
            (_, Phase::Optimizer) => dense_opt.push(i),
            _ => before.push(i),
        }
    }
    let share = Share { rank, world };
    let sparse_opt_all = sparse_opt.clone();
    let landing_bytes = store
        .as_ref()
        .map_or(0, |st| (st.landing_rows() * (local.dim + 1) * 4) as u64);
    let sharded = store
        .map(|st| crate::sharded::ShardedTables::new(g, &sparse_opt, st, &mut runner, cfg.seed))
        .transpose()
        .with_context(|| format!("rank {rank}: the sharded embedding tables"))?;
    // sharded tables are updated by their owners, not by the gathered update
    let sharded_run = sharded.is_some();
    if sharded_run {
        sparse_opt.clear();
    }
    let table_bytes = stored_table_bytes(g, &sparse_opt_all);
    if sharded.is_some() {
        eprintln!(
            "rank {rank}: stores {} of embedding tables and their state: {} of the rows it holds (what --rank-memory budgets), {} of landing slots for the rows its batch fetches (the whole tables: {})",
            crate::sharding::size(table_bytes),
            crate::sharding::size(table_bytes.saturating_sub(landing_bytes)),
            crate::sharding::size(landing_bytes),
            crate::sharding::size(local.table_bytes().0 + local.table_bytes().1)
        );
    }
    let sharded_t: Vec<Tensor> = sharded.as_ref().map_or(Vec::new(), |sh| sh.tensors());
    let (report, state, layout) = {
        let exec = RankExec {
            whole_at: WholeAt::of(cfg),
            sharded,
            cpu: CpuExec::new(runner),
            comm: &mut *comm,
            g,
            before,
            dense_opt,
            sparse_opt,
            buckets: buckets(&plan, mode),
            world,
            fail,
        };
        let mut s = Session::with_exec(
            &plan,
            Box::new(exec),
            1,
            &cfg.data,
            cfg.data_seed,
            Some(share),
        )?;
        s.evaluate_at_end = sharded_run;
        let report = drive(cfg, &mut s, progress, Some(share))?;
        let (state, layout) = persistent_state(g, |t| s.read(t), left_out(rank, &sharded_t))?;
        (report, state, layout)
    };
    comm.barrier("end of training")?;
    Ok(RankResult {
        rank,
        state,
        sharded: sharded_t.iter().map(|&t| g.name(t).to_string()).collect(),
        layout,
        losses: report.losses,
        log: comm.log().to_vec(),
        step_secs: report.step_secs,
        final_eval: final_eval(sharded_run, &report.evals, cfg.steps),
        evals: report.evals,
        table_bytes,
    })
}

/// What a rank's plan and the model's tables take of a host's memory, bytes.
#[derive(Debug, Clone, Copy)]
struct RankBytes {
    /// The rank's plan: its state (with its tables, or its share of them) and arena.
    own: u64,
    /// Of `own`, the tables and their state (all of them, or the rank's share).
    own_tables: u64,
    arena: u64,
    /// The model's whole tables and their state.
    whole_tables: u64,
}

impl RankBytes {
    /// The final state's copy with the whole tables.
    fn whole_state(&self) -> u64 {
        self.dense_state() + self.whole_tables
    }

    fn dense_state(&self) -> u64 {
        (self.own - self.own_tables).saturating_sub(self.arena)
    }

    /// What the rank needs of its host: on the CPU its plan, plus at a checkpoint and the
    /// end the final state's copy (the whole tables in it where the rank holds them:
    /// every rank when they are replicated; sharded, `root` alone, which assembles them
    /// beside its rows); a CUDA rank the larger of its initial state and that copy.
    fn need(&self, sharded: bool, root: bool, on_cpu: bool) -> u64 {
        let at_end = match (sharded, root) {
            (false, _) => self.whole_state(),
            (true, true) => self.whole_state() + self.whole_tables,
            (true, false) => self.dense_state(),
        };
        if on_cpu {
            self.own + at_end
        } else {
            at_end.max(self.own.saturating_sub(self.arena))
        }
    }
}

/// What the ranks of one machine need together, of every rank's `needs`: all of them,
/// or, where `local` ranks share a machine (several machines, each running consecutive
/// ranks, as launchers number them), the neediest machine's.
fn machine_need(needs: &[u64], local: Option<usize>) -> u64 {
    match local {
        None => needs.iter().sum(),
        Some(n) => needs
            .chunks(n.max(1))
            .map(|c| c.iter().sum())
            .max()
            .unwrap_or(0),
    }
}

/// Refuses, before any rank allocates, a job whose ranks need more of this machine's
/// memory than it has. Every rank sends what it needs and what it sees free (one
/// all-to-all over `comm`), so every rank reaches the same verdict. A rank needs its
/// plan where it runs on the CPU (its share of the tables, the dense model, the
/// activations; a CUDA rank only makes its initial state here before it uploads it),
/// and, at a checkpoint and the end, a copy of the model's state: whole, on every rank
/// when the tables are replicated; with sharded tables, on rank 0 (which assembles the
/// whole tables beside its own rows), the others' without the tables. The ranks of one machine
/// (threads of this process, or the processes `LOCAL_WORLD_SIZE` counts) share it.
pub(crate) fn check_rank_memory<C: Collective>(
    plan: &StepPlan,
    model: &crate::model::ctr::CtrConfig,
    (sharded, on_cpu): (bool, bool),
    comm: &mut C,
) -> Result<()> {
    let (own, own_tables) = crate::train::plan_bytes(plan);
    let (w, acc) = model.table_bytes();
    let bytes = RankBytes {
        own,
        own_tables,
        arena: plan.memory.arena_bytes as u64,
        whole_tables: w + acc,
    };
    let root = comm.rank() == crate::sharded::WHOLE_RANK;
    let need = bytes.need(sharded, root, on_cpu);
    let (whole_state, whole_tables) = (bytes.whole_state(), bytes.whole_tables);
    let have = crate::train::available_memory(None).unwrap_or(u64::MAX);
    let mine: Vec<u8> = need
        .to_le_bytes()
        .into_iter()
        .chain(have.to_le_bytes())
        .collect();
    // (an all-to-all of the same bytes to every rank: a step's gathers stay its own)
    let world = comm.world();
    let all = comm.all_to_all("memory check", &vec![mine; world])?;
    let word = |b: &[u8], i: usize| {
        b.get(i * 8..i * 8 + 8)
            .and_then(|w| w.try_into().ok())
            .map_or(0, u64::from_le_bytes)
    };
    let local = std::env::var("LOCAL_WORLD_SIZE")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|&n| (1..world).contains(&n));
    let needs: Vec<u64> = all.iter().map(|b| word(b, 0)).collect();
    let have = all.iter().map(|b| word(b, 1)).min().unwrap_or(u64::MAX);
    let total = machine_need(&needs, local);
    if total > have {
        let gb = |b: u64| b as f64 / 1e9;
        let here = local.unwrap_or(world);
        let plan_part = if on_cpu {
            format!(
                "its plan: {:.1} GB, of which {:.1} GB of tables; ",
                gb(own),
                gb(own_tables)
            )
        } else {
            String::new()
        };
        bail!(
            "{here} ranks on this machine need {:.1} GB of its memory in all, but it has \
             {:.1} GB free: each rank needs up to {:.1} GB ({plan_part}at a checkpoint and the \
             end a copy of the model's state, {:.1} GB{}); use fewer ranks, fewer rows \
             (--rows, --table-rows){}",
            gb(total),
            gb(have),
            gb(needs.iter().max().copied().unwrap_or(0)),
            gb(whole_state),
            if sharded {
                format!(
                    ", which rank 0 alone holds with the whole tables assembled beside it, \
                     {:.1} GB; the other ranks hold the state without the tables",
                    gb(whole_tables)
                )
            } else {
                String::new()
            },
            if sharded {
                ""
            } else {
                ", or sharded tables (--sharding)"
            }
        );
    }
    Ok(())
}

/// A CPU rank's step: the program up to the optimizer, the dense gradients' mean over
/// the ranks (one all-reduce per bucket, in program order), the sparse gradients
/// gathered from every rank and applied by the same row-wise Adagrad everywhere, then
/// the dense optimizer.
struct RankExec<'a, C: Collective> {
    cpu: CpuExec<'a>,
    /// The tables' placement when any is sharded (else every rank gathers every
    /// gradient and updates every table).
    sharded: Option<crate::sharded::ShardedTables>,
    whole_at: WholeAt,
    comm: &'a mut C,
    g: &'a erase_graph::Graph,
    before: Vec<usize>,
    dense_opt: Vec<usize>,
    sparse_opt: Vec<erase_graph::NodeId>,
    buckets: Vec<(String, Vec<Tensor>)>,
    world: usize,
    fail: Option<FailAt>,
}

impl<C: Collective> RankExec<'_, C> {
    fn run_step(&mut self, step: u64) -> Result<()> {
        let (g, world) = (self.g, self.world);
        let rank = self.comm.rank();
        let scale = 1.0 / world as f32;
        let runner = self.cpu.runner();
        if let Some(sh) = &mut self.sharded {
            sh.fetch(runner, &mut *self.comm)
                .with_context(|| format!("rank {rank}, step {step}: the sharded lookup"))?;
        }
        runner
            .run_order(&self.before)
            .with_context(|| format!("rank {rank}, step {step}"))?;
        // dense gradients: the mean over ranks, one all-reduce per backward program
        for (name, grads) in &self.buckets {
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
            self.comm.all_reduce_sum(name, &mut flat)?;
            let mut at = 0;
            for &t in grads {
                let n = g.shape(t).numel();
                let mean: Vec<f32> = flat[at..at + n].iter().map(|v| v * scale).collect();
                runner.write(t, &Buffer::F32(mean))?;
                at += n;
            }
        }
        if let Some(sh) = &mut self.sharded {
            sh.update(runner, &mut *self.comm, scale)
                .with_context(|| format!("rank {rank}, step {step}: the sharded update"))?;
        }
        // sparse gradients: every rank gathers every rank's (ids, offsets, pooled
        // gradient) and applies the same row-wise Adagrad to the same rows
        for &node in &self.sparse_opt {
            let n = g.node(node);
            let (ids, offsets, dpooled) = (n.inputs[0], n.inputs[1], n.inputs[2]);
            let get = |t: Tensor| {
                runner
                    .get(t)
                    .ok_or_else(|| anyhow!("'{}' has no value", g.name(t)))
            };
            let (ids_v, off_v, dp_v) = (get(ids)?, get(offsets)?, get(dpooled)?);
            let all_ids = self
                .comm
                .all_gather(&format!("{}.ids", n.name), ids_v.bytes())?;
            let all_off = self
                .comm
                .all_gather(&format!("{}.offsets", n.name), off_v.bytes())?;
            let all_dp = self
                .comm
                .all_gather(&format!("{}.grad", n.name), dp_v.bytes())?;
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
            // the table and its state, taken out of the runner (no copy) and fed back
            let mut upd: Vec<Buffer> = n
                .updates
                .iter()
                .map(|&t| {
                    runner
                        .take_leaf(t)
                        .ok_or_else(|| anyhow!("'{}' has no value", g.name(t)))
                })
                .collect::<Result<_>>()?;
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
            .run_order(&self.dense_opt)
            .with_context(|| format!("rank {rank}, step {step}: optimizer"))?;
        if let Some(sh) = &mut self.sharded {
            if self.whole_at.needs(step as usize + 1) {
                sh.assemble(runner, &mut *self.comm)
                    .with_context(|| format!("rank {rank}, step {step}: the whole tables"))?;
            }
        }
        Ok(())
    }
}

/// What a rank leaves out of its final state: the sharded tables `sharded`, except on
/// the rank that assembles them whole.
pub(crate) fn left_out(rank: usize, sharded: &[Tensor]) -> &[Tensor] {
    if rank == crate::sharded::WHOLE_RANK {
        &[]
    } else {
        sharded
    }
}

/// A rank's own evaluation after the last step (`steps`), when it made one.
pub(crate) fn final_eval(
    made: bool,
    evals: &[crate::train::Eval],
    steps: usize,
) -> Option<crate::train::Eval> {
    evals.last().copied().filter(|e| made && e.step == steps)
}

/// Bytes of the tables (and state) that the row-wise Adagrad updates `nodes` update.
pub(crate) fn stored_table_bytes(g: &erase_graph::Graph, nodes: &[erase_graph::NodeId]) -> u64 {
    nodes
        .iter()
        .flat_map(|&n| g.node(n).updates.iter())
        .map(|&t| (g.shape(t).numel() * g.dtype(t).size_bytes()) as u64)
        .sum()
}

/// After which steps a sharded rank makes its tables whole: before a checkpoint and at
/// the end (so that every replica is whole and identical), as [`drive`] asks for them.
/// An evaluation looks its rows up as a step does.
pub(crate) struct WholeAt {
    steps: usize,
    checkpoint_every: Option<usize>,
}

impl WholeAt {
    pub(crate) fn of(cfg: &TrainConfig) -> WholeAt {
        WholeAt {
            steps: cfg.steps,
            checkpoint_every: cfg.checkpoint.as_ref().map(|_| cfg.checkpoint_every),
        }
    }

    pub(crate) fn needs(&self, done: usize) -> bool {
        let every = |n: usize| n > 0 && done.is_multiple_of(n);
        done == self.steps || self.checkpoint_every.is_some_and(every)
    }
}

impl<C: Collective> crate::checkpoint::TensorStore for RankExec<'_, C> {
    fn read(&self, t: Tensor) -> Result<Buffer> {
        match &self.sharded {
            Some(sh) if sh.holds(t) => sh.read_whole(t),
            _ => self.cpu.read(t),
        }
    }
    fn write(&mut self, t: Tensor, b: Buffer) -> Result<()> {
        match &mut self.sharded {
            Some(sh) if sh.holds(t) => sh.write_whole(self.cpu.runner(), t, b),
            _ => self.cpu.write(t, b),
        }
    }
    fn visit(&self, t: Tensor, f: &mut dyn FnMut(&Buffer) -> Result<()>) -> Result<()> {
        match &self.sharded {
            Some(sh) if sh.holds(t) => f(&sh.read_whole(t)?),
            _ => self.cpu.visit(t, f),
        }
    }
    fn dims(&self, g: &erase_graph::Graph, t: Tensor) -> Vec<usize> {
        match &self.sharded {
            Some(sh) if sh.holds(t) => sh.whole_dims(g, t),
            _ => g.shape(t).dims().to_vec(),
        }
    }
}

impl<C: Collective> StepExec for RankExec<'_, C> {
    fn feed(&mut self, t: Tensor, b: Buffer) -> Result<()> {
        self.cpu.feed(t, b)?;
        if let Some(sh) = self.sharded.as_mut().filter(|sh| sh.ids() == t) {
            sh.fed();
        }
        Ok(())
    }
    fn step(&mut self) -> Result<f64> {
        bail!("a data-parallel rank steps from the loader's batches only")
    }
    fn run_launches(&mut self, which: &[usize]) -> Result<()> {
        // a forward (an evaluation's) looks its rows up as a step does: every rank
        // evaluates the same batches, so every rank issues the same all-to-alls
        if let Some(sh) = &mut self.sharded {
            let rank = self.comm.rank();
            sh.fetch(self.cpu.runner(), &mut *self.comm)
                .with_context(|| format!("rank {rank}: the sharded lookup of a forward"))?;
        }
        self.cpu.run_launches(which)
    }
    fn get(&self, t: Tensor) -> Result<Buffer> {
        match &self.sharded {
            Some(sh) if sh.holds(t) => sh.read_whole(t),
            _ => self.cpu.get(t),
        }
    }
    fn slots(
        &mut self,
        layout: &erase_runtime::cuda::feed::InputLayout,
        readback: &[Tensor],
        n: usize,
    ) -> Result<Vec<crate::data::loader::SlotMem>> {
        self.cpu.slots(layout, readback, n)
    }
    fn issue(&mut self, step: u64, _slot: usize, mem: &crate::data::loader::SlotMem) -> Result<()> {
        FailAt::check(self.fail, self.comm.rank(), step as usize)?;
        self.cpu.load(mem)?;
        if let Some(sh) = &mut self.sharded {
            sh.fed();
        }
        let t0 = std::time::Instant::now();
        self.run_step(step)?;
        self.cpu.done_at(step, t0.elapsed().as_secs_f64());
        Ok(())
    }
    fn finish(&mut self, step: u64) -> Result<(Vec<f64>, f64)> {
        self.cpu.finish(step)
    }
}

/// The persistent tensors of `g` (read through `get`) as one byte string in tensor
/// order, with each one's name, type and length; `left_out` are not read (a sharded
/// table on a rank that holds only its rows).
pub(crate) fn persistent_state(
    g: &erase_graph::Graph,
    get: impl Fn(Tensor) -> Result<Buffer>,
    left_out: &[Tensor],
) -> Result<(Vec<u8>, StateLayout)> {
    let (mut state, mut layout) = (Vec::new(), Vec::new());
    for t in g
        .tensors()
        .filter(|&t| g.is_persistent(t) && !left_out.contains(&t))
    {
        let b = get(t)?;
        state.extend_from_slice(b.bytes());
        layout.push((g.name(t).to_string(), b.dtype(), b.len()));
    }
    Ok((state, layout))
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

#[cfg(test)]
mod tests {
    use super::{machine_need, RankBytes};

    #[test]
    fn sharded_tables_are_whole_on_rank_0_alone_at_the_end() {
        // 4 ranks, 1000 bytes of whole tables, each rank 250 of them in a plan of 400 (50
        // of arena): the dense state is 100
        let b = RankBytes {
            own: 400,
            own_tables: 250,
            arena: 50,
            whole_tables: 1000,
        };
        // CPU ranks: the plan, and rank 0 the state with the whole tables and the whole
        // tables assembled beside its rows; the others the dense state alone
        assert_eq!(b.need(true, true, true), 400 + 1100 + 1000);
        assert_eq!(b.need(true, false, true), 400 + 100);
        let needs: Vec<u64> = (0..4).map(|r| b.need(true, r == 0, true)).collect();
        assert_eq!(machine_need(&needs, None), 2500 + 3 * 500);
        // replicated: every rank's final state holds the whole tables
        assert_eq!(b.need(false, false, true), 400 + 1100);
        // a CUDA rank: the larger of its initial state and the final copy
        assert_eq!(b.need(true, false, false), 350);
        assert_eq!(b.need(true, true, false), 2100);
        // two machines of two ranks: rank 0's machine is the neediest
        assert_eq!(machine_need(&needs, Some(2)), 2500 + 500);
        assert_eq!(machine_need(&[1, 2, 3, 4, 5], Some(2)), 7);
    }
}
