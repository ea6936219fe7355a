//! Data parallelism on CUDA devices with NCCL, one process per GPU: each rank trains a
//! replica on its shard of every global batch (rank `k` of `n` takes examples `i` with
//! `i mod n = k`, as on the CPU), with the collectives inside the step program (see
//! [`erase_runtime::cuda::collective`]). Rank 0 hands out the NCCL id at the rendezvous;
//! the rendezvous connections stay open as a control channel, over which the ranks
//! compare their replicas and collective logs at the end.

use anyhow::{bail, Context, Result};

use crate::distributed::{AllReduce, FailAt, RankResult};
use crate::launch::{report, WorkerOptions};
use crate::loader::SlotMem;
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
    nccl_check().context("--gpus on CUDA needs NCCL")?;
    let mut dev = crate::gpu::open_device_ordinal(env.local_rank)
        .with_context(|| format!("rank {rank}: CUDA device {} (LOCAL_RANK)", env.local_rank))?;
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
    let r = train(cfg, env, opts, fail, &dev, &mut comm, &wd, progress);
    comm.unwatch(&wd);
    match r {
        Ok(r) => report(&mut control, &r, cfg, opts, "CUDA", || {
            crate::distributed::evaluate_replica(cfg, &r, Some(&dev))
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
    wd: &Watchdog,
    progress: &mut dyn Progress,
) -> Result<RankResult> {
    let (rank, world) = (env.rank, env.world);
    let mut local = cfg.model.clone();
    local.batch = cfg.model.batch / world;
    let plan = plan_step_data_parallel(&local, DType::F32, &cfg.optimizer, &cfg.schedule)?;
    crate::train::check_memory(&plan, Some(dev))?;
    let g = &plan.model.graph;
    // sharded tables need NCCL's all-to-all in the step, which is not written yet: `auto`
    // replicates where the tables fit, a forced sharding is refused
    let mode = match cfg.sharding {
        crate::sharding::Sharding::Auto => crate::sharding::Sharding::Replicated,
        m => m,
    };
    if crate::sharded::Storage::plan(
        &local.field_rows(),
        &local.bag_slots(),
        (local.dim, local.batch),
        (rank, world),
        cfg.rank_memory,
        mode,
    )?
    .is_some()
    {
        bail!("--sharding {mode:?}: sharded tables train on CPU ranks only for now (CUDA ranks need NCCL's all-to-all in the step); use --sharding replicated or auto");
    }
    let sparse: Vec<_> = plan
        .program
        .launches
        .iter()
        .map(|l| l.node)
        .filter(|&n| matches!(g.node(n).op, erase_graph::Op::RowwiseAdagrad { .. }))
        .collect();
    let table_bytes = crate::distributed::stored_table_bytes(g, &sparse);
    let mut prog = CudaProgram::new(dev, g, &plan.program, &plan.memory, cfg.seed)?;
    let dp = DataParallel::new(
        &prog,
        &plan.partition,
        &plan.training.grads,
        world,
        opts.allreduce == AllReduce::Early,
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
            wd,
            rank,
            fail,
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
        let report = drive(cfg, &mut s, progress, Some(share))?;
        let (state, layout) = crate::distributed::persistent_state(g, |t| s.read(t))?;
        (report, state, layout)
    };
    // every step issued the plan's collectives (a captured step's are logged once)
    let mut log: Vec<CollectiveRecord> = Vec::new();
    for _ in 0..report.losses.len() {
        for (kind, bucket, bytes) in &dp.per_step {
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
        layout,
        losses: report.losses,
        log,
        step_secs: report.step_secs,
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
    wd: &'a Watchdog,
    rank: usize,
    fail: Option<FailAt>,
    /// The step's collectives, for the watchdog: "N collectives, first KIND 'BUCKET'".
    what: String,
}

impl crate::checkpoint::TensorStore for RankExec<'_> {
    fn read(&self, t: Tensor) -> Result<Buffer> {
        crate::checkpoint::TensorStore::read(&self.prog, t)
    }
    fn write(&mut self, t: Tensor, b: Buffer) -> Result<()> {
        crate::checkpoint::TensorStore::write(&mut self.prog, t, b)
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
        StepExec::run_launches(&mut self.prog, which)
    }
    fn get(&self, t: Tensor) -> Result<Buffer> {
        StepExec::get(&self.prog, t)
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
