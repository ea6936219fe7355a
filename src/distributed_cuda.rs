//! Data parallelism on CUDA devices with NCCL, one process per GPU: each rank trains a
//! replica on its shard of every global batch (rank `k` of `n` takes examples `i` with
//! `i mod n = k`, as on the CPU), with the collectives inside the step program (see
//! [`erase_runtime::cuda::collective`]). Rank 0 hands out the NCCL id at the rendezvous;
//! the rendezvous connections stay open as a control channel, over which the ranks
//! compare their replicas and collective logs at the end.

use anyhow::{bail, Context, Result};

use crate::data::loader::SlotMem;
use crate::distributed::{AllReduce, FailAt, RankResult};
use crate::launch::{report, WorkerOptions};
use crate::train::{
    drive, plan_step_data_parallel, Dispatch, Progress, Session, Share, StepExec, TrainConfig,
};
use erase_graph::{DType, Tensor};
use erase_ops::Buffer;
use erase_runtime::collective::rendezvous::{rendezvous, RankEnv};
use erase_runtime::collective::tcp::TcpCollective;
use erase_runtime::collective::CollectiveRecord;
use erase_runtime::cuda::collective::DataParallel;
use erase_runtime::cuda::feed::InputLayout;
use erase_runtime::cuda::nccl::{nccl_check, unique_id, NcclComm, Watchdog};
use erase_runtime::cuda::program::CudaProgram;

/// Runs this process as rank `env.rank` on CUDA device `env.local_rank`.
pub fn run_worker_cuda(
    cfg: &TrainConfig,
    env: &RankEnv,
    opts: &WorkerOptions,
    fail: Option<FailAt>,
    progress: &mut dyn Progress,
) -> Result<()> {
    let (rank, world) = (env.rank, env.world);
    if cfg.schedule.early_updates {
        bail!("--optimizer-update early updates a block before its gradients are all-reduced; with several ranks use end");
    }
    // the device first: on a machine without a GPU that is the error to read
    let mut dev = crate::gpu::open_device_ordinal(env.local_rank)
        .with_context(|| format!("rank {rank}: CUDA device {} (LOCAL_RANK)", env.local_rank))?;
    nccl_check().context("--gpus on CUDA needs NCCL")?;
    dev.set_plan_options(opts.plan);
    let blob = if rank == 0 { unique_id()? } else { Vec::new() };
    let tag = format!(
        "backend cuda; world {world}; allreduce {}; dispatch {}; steps {}; {}",
        opts.allreduce.as_str(),
        cfg.dispatch.as_str(),
        cfg.steps,
        cfg.identity_text()
    );
    let rdv = rendezvous(env, &blob, &tag, opts.timeout)?;
    let id = rdv.blobs[0].clone();
    let mut control = TcpCollective::new(rdv, opts.timeout);
    let wd = Watchdog::start(rank, opts.timeout);
    dev.bind()?;
    let mut comm = NcclComm::init(&id, rank, world, &wd)
        .with_context(|| format!("rank {rank} on {}", dev.name))?;
    eprintln!(
        "rank {rank}: {} (device {}), NCCL communicator of {world} ranks",
        dev.name, env.local_rank
    );
    let r = train(
        cfg,
        env,
        opts,
        fail,
        &dev,
        &mut comm,
        &mut control,
        &wd,
        progress,
    );
    comm.unwatch(&wd);
    match r {
        Ok(r) => report(&mut control, &r, cfg, opts, "CUDA", || {
            r.evaluation(|| crate::distributed::evaluate_replica(cfg, &r, Some(&dev)))
        }),
        Err(e) => {
            comm.abort();
            control.abort();
            Err(e.context(format!("rank {rank}")))
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn train(
    cfg: &TrainConfig,
    env: &RankEnv,
    opts: &WorkerOptions,
    fail: Option<FailAt>,
    dev: &erase_runtime::cuda::CudaDevice,
    comm: &mut NcclComm,
    control: &mut TcpCollective,
    wd: &Watchdog,
    progress: &mut dyn Progress,
) -> Result<RankResult> {
    let (rank, world) = (env.rank, env.world);
    let mut local = cfg.model.clone();
    local.batch = cfg.model.batch / world;
    // where the tables live: every rank's storage (a sharded rank holds its rows and a
    // landing block per owner of each field it does not hold whole)
    let storages = crate::sharded::Storage::all_ranks(
        &local.field_rows(),
        &local.bag_slots(),
        (local.dim, local.batch),
        world,
        cfg.rank_memory,
        cfg.sharding,
    )
    .with_context(|| format!("rank {rank}: placing the embedding tables"))?;
    let shards = match storages {
        Some(all) => {
            let slots = local.bag_slots();
            let hot = slots.first().copied().unwrap_or(1);
            if slots.iter().any(|&h| h != hot) {
                bail!("sharded tables on CUDA ranks need bags of one size in every field (field_hot {slots:?}); use --sharding replicated");
            }
            let geo = all[rank].geometry(&all, local.batch, hot)?;
            Some((all[rank].clone(), geo))
        }
        None => None,
    };
    let stored = crate::model::ctr::CtrConfig {
        storage_rows: shards.as_ref().map_or(Vec::new(), |s| s.0.stored_rows()),
        ..local.clone()
    };
    let plan = plan_step_data_parallel(&stored, DType::F32, &cfg.optimizer, &cfg.schedule)?;
    crate::train::check_memory(&plan, Some(dev))?;
    // the host's memory: the initial state, and the whole state at a checkpoint and the end
    crate::distributed::check_rank_memory(&plan, &local, (shards.is_some(), false), control)?;
    let g = &plan.model.graph;
    let sparse: Vec<_> = plan
        .program
        .launches
        .iter()
        .map(|l| l.node)
        .filter(|&n| matches!(g.node(n).op, erase_graph::Op::RowwiseAdagrad { .. }))
        .collect();
    let table_bytes = crate::distributed::stored_table_bytes(g, &sparse);
    let mut prog = CudaProgram::new(dev, g, &plan.program, &plan.memory, cfg.seed)?;
    let sharded = match &shards {
        Some((store, _)) => {
            let &[node] = &sparse[..] else {
                bail!("sharded tables need the trainer's one table; the step has {} row-wise Adagrad updates", sparse.len());
            };
            let n = g.node(node);
            let (Some(&table), Some(&acc)) = (n.updates.first(), n.updates.get(1)) else {
                bail!("'{}' updates no table and state", n.name);
            };
            prog.feed(table, &Buffer::F32(store.initial(g, table, cfg.seed)?))?;
            let landing = (store.landing_rows() * (local.dim + 1) * 4) as u64;
            eprintln!(
                "rank {rank}: stores {} of embedding tables and their state: {} of the rows it holds (what --rank-memory budgets), {} of landing slots for the rows its batch fetches (the whole tables: {})",
                crate::sharding::size(table_bytes),
                crate::sharding::size(table_bytes.saturating_sub(landing)),
                crate::sharding::size(landing),
                crate::sharding::size(local.table_bytes().0 + local.table_bytes().1)
            );
            Some(CudaShards {
                store: store.clone(),
                name: n.name.clone(),
                table,
                acc,
                whole: None,
                whole_at: crate::distributed::WholeAt::of(cfg),
            })
        }
        None => None,
    };
    let sharded_run = sharded.is_some();
    let sharded_t: Vec<Tensor> = sharded
        .as_ref()
        .map_or(Vec::new(), |sh| vec![sh.table, sh.acc]);
    let dp = DataParallel::with_shards(
        &prog,
        &plan.partition,
        &plan.training.grads,
        world,
        opts.allreduce == AllReduce::Early,
        shards.as_ref().map(|s| &s.1),
    )?;
    prog.set_threaded(cfg.dispatch == Dispatch::Threaded);
    let graph = cfg.dispatch == Dispatch::Graph;
    if graph {
        wd.enter("warming up NCCL before the graph capture");
        prog.warm_up_collectives(&dp, comm)?;
        wd.enter("capturing the data-parallel step with its NCCL calls");
        prog.capture_data_parallel(&dp, comm)?;
        wd.leave();
    }
    let share = Share { rank, world };
    // what the rank issued, in order (a captured step's collectives as it replays)
    let mut issued: Vec<Issued> = Vec::new();
    let (report, state, layout) = {
        let what = format!(
            "{} collectives{}",
            dp.per_step.len(),
            dp.per_step
                .first()
                .map_or(String::new(), |c| format!(", first {} '{}'", c.0, c.1))
        );
        let exec = RankExec {
            what,
            prog,
            dp: &dp,
            comm: &mut *comm,
            control: &mut *control,
            wd,
            rank,
            fail,
            sharded,
            issued: &mut issued,
        };
        // two steps in flight, as on one device: the loader's pinned slots feed them
        let mut s = Session::with_exec(
            &plan,
            Box::new(exec),
            2,
            &cfg.data,
            cfg.data_seed,
            Some(share),
        )?;
        s.evaluate_at_end = sharded_run;
        let report = drive(cfg, &mut s, progress, Some(share))?;
        let left_out = crate::distributed::left_out(rank, &sharded_t);
        let (state, layout) = crate::distributed::persistent_state(g, |t| s.read(t), left_out)?;
        (report, state, layout)
    };
    let mut log: Vec<CollectiveRecord> = Vec::new();
    for i in &issued {
        let records = match i {
            Issued::Step => &dp.per_step[..],
            Issued::Lookup => &dp.per_step[..2],
        };
        for (kind, bucket, bytes) in records {
            log.push(CollectiveRecord {
                seq: log.len() as u64,
                kind,
                bucket: bucket.clone(),
                bytes: *bytes,
            });
        }
    }
    if !graph && comm.log().len() != log.len() {
        bail!(
            "rank {rank}: issued {} collectives, the plan says {}",
            comm.log().len(),
            log.len()
        );
    }
    Ok(RankResult {
        rank,
        state,
        sharded: sharded_t.iter().map(|&t| g.name(t).to_string()).collect(),
        layout,
        losses: report.losses,
        log,
        step_secs: report.step_secs,
        final_eval: crate::distributed::final_eval(sharded_run, &report.evals, cfg.steps),
        evals: report.evals,
        table_bytes,
    })
}

/// A CUDA rank's step executor: the program with its collectives (issued, or replayed
/// in the captured graph), fed from the loader's pinned slots; waiting for a step
/// watches NCCL's asynchronous errors, and the watchdog names what hangs.
struct RankExec<'a> {
    prog: CudaProgram<'a>,
    dp: &'a DataParallel,
    comm: &'a mut NcclComm,
    /// The rendezvous' TCP connections: the whole tables are assembled over them.
    control: &'a mut TcpCollective,
    wd: &'a Watchdog,
    rank: usize,
    fail: Option<FailAt>,
    /// The step's collectives, for the watchdog: "N collectives, first KIND 'BUCKET'".
    what: String,
    sharded: Option<CudaShards>,
    issued: &'a mut Vec<Issued>,
}

/// What a CUDA rank issued, for its log of collectives (built once at the end).
enum Issued {
    /// A step: the plan's collectives.
    Step,
    /// A sharded table's lookup alone (an evaluation's): its first two.
    Lookup,
}

/// A CUDA rank's sharded table: its placement, and (rank 0) the whole copy assembled
/// for a checkpoint or the end.
struct CudaShards {
    store: crate::sharded::Storage,
    name: String,
    table: Tensor,
    acc: Tensor,
    whole: Option<(Vec<f32>, Vec<f32>)>,
    whole_at: crate::distributed::WholeAt,
}

impl RankExec<'_> {
    /// Every rank's rows of the sharded table gathered into rank 0's whole copy (after
    /// step `step`, which is waited for), over the TCP connections.
    fn assemble(&mut self, step: u64) -> Result<()> {
        let Some(sh) = self.sharded.as_mut() else {
            return Ok(());
        };
        self.wd
            .enter(format!("step {step}: assembling the whole tables"));
        self.prog.synchronize()?;
        let f32s = |b: Buffer, what: &str| match b {
            Buffer::F32(v) => Ok(v),
            b => Err(anyhow::anyhow!("'{what}' is {}, expected f32", b.dtype())),
        };
        let table = f32s(self.prog.get(sh.table)?, &sh.name)?;
        let acc = f32s(self.prog.get(sh.acc)?, &sh.name)?;
        let d = table.len() / sh.store.stored_rows().iter().sum::<usize>().max(1);
        sh.whole = sh
            .store
            .assemble(&sh.name, &table, &acc, d, &mut *self.control)
            .with_context(|| format!("rank {}, step {step}: the whole tables", self.rank))?;
        self.wd.leave();
        Ok(())
    }
}

impl CudaShards {
    fn read_whole(&self, t: Tensor) -> Result<Buffer> {
        crate::sharded::read_whole(&self.whole, &self.name, t == self.table)
    }
}

impl crate::checkpoint::TensorStore for RankExec<'_> {
    fn read(&self, t: Tensor) -> Result<Buffer> {
        match &self.sharded {
            Some(sh) if t == sh.table || t == sh.acc => sh.read_whole(t),
            _ => crate::checkpoint::TensorStore::read(&self.prog, t),
        }
    }
    fn write(&mut self, t: Tensor, b: Buffer) -> Result<()> {
        match &mut self.sharded {
            Some(sh) if t == sh.table || t == sh.acc => {
                // a resumed whole table: the rows this rank holds, into its storage
                let width = if t == sh.table {
                    self.prog
                        .graph()
                        .shape(t)
                        .dims()
                        .get(1)
                        .copied()
                        .unwrap_or(1)
                } else {
                    1
                };
                let mut local = match self.prog.get(t)? {
                    Buffer::F32(v) => v,
                    other => bail!("'{}' is {}, expected f32", sh.name, other.dtype()),
                };
                sh.store.scatter(&sh.name, &b, width, &mut local)?;
                sh.whole = None;
                Ok(self.prog.feed(t, &Buffer::F32(local))?)
            }
            _ => crate::checkpoint::TensorStore::write(&mut self.prog, t, b),
        }
    }
    fn dims(&self, g: &erase_graph::Graph, t: Tensor) -> Vec<usize> {
        match &self.sharded {
            Some(sh) if t == sh.table || t == sh.acc => sh.store.whole_dims(g, t),
            _ => g.shape(t).dims().to_vec(),
        }
    }
}

impl StepExec for RankExec<'_> {
    fn feed(&mut self, t: Tensor, b: Buffer) -> Result<()> {
        StepExec::feed(&mut self.prog, t, b)
    }
    fn step(&mut self) -> Result<f64> {
        bail!("a data-parallel rank steps from the loader's batches only")
    }
    fn run_launches(&mut self, which: &[usize]) -> Result<()> {
        // a forward (an evaluation's) looks its rows up as a step does: every rank
        // evaluates the same batches, so every rank issues the same exchange
        if self.sharded.is_some() {
            self.wd.enter("an evaluation's sharded lookup");
            self.prog
                .look_up(self.dp, self.comm)
                .with_context(|| format!("rank {}: the sharded lookup of a forward", self.rank))?;
            self.wd.leave();
            self.issued.push(Issued::Lookup);
        }
        StepExec::run_launches(&mut self.prog, which)
    }
    fn get(&self, t: Tensor) -> Result<Buffer> {
        match &self.sharded {
            Some(sh) if t == sh.table || t == sh.acc => sh.read_whole(t),
            _ => StepExec::get(&self.prog, t),
        }
    }
    fn slots(
        &mut self,
        layout: &InputLayout,
        readback: &[Tensor],
        n: usize,
    ) -> Result<Vec<SlotMem>> {
        StepExec::slots(&mut self.prog, layout, readback, n)
    }
    fn issue(&mut self, step: u64, slot: usize, mem: &SlotMem) -> Result<()> {
        FailAt::check(self.fail, self.rank, step as usize)?;
        let SlotMem::Pinned(p) = mem else {
            bail!("the CUDA step copies batches from pinned memory only");
        };
        let (dp, comm) = (self.dp, &mut *self.comm);
        self.wd.enter(format!(
            "step {step}: issuing the step and its {}",
            self.what
        ));
        self.prog
            .step_from_with(step, slot, p, |p| p.run_data_parallel(dp, comm))
            .with_context(|| format!("rank {}, step {step}", self.rank))?;
        self.wd.leave();
        self.issued.push(Issued::Step);
        // a checkpoint or the end needs the whole tables after this step
        if let Some(sh) = self.sharded.as_mut() {
            sh.whole = None;
            if sh.whole_at.needs(step as usize + 1) {
                self.assemble(step)?;
            }
        }
        Ok(())
    }
    fn finish(&mut self, step: u64) -> Result<(Vec<f64>, f64)> {
        self.wd.enter(format!(
            "step {step}: waiting for the step and its {}",
            self.what
        ));
        while !self.prog.step_finished(step)? {
            if let Some(e) = self.comm.async_error() {
                bail!("rank {}, step {step}: NCCL reports {e}", self.rank);
            }
            std::thread::yield_now();
        }
        self.wd.leave();
        StepExec::finish(&mut self.prog, step)
    }
}
