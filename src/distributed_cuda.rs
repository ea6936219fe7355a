//! Data parallelism on CUDA devices with NCCL, one process per GPU: each rank trains a
//! replica on its shard of every global batch (rank `k` of `n` takes examples `i` with
//! `i mod n = k`, as on the CPU), with the collectives inside the step program (see
//! [`erase_runtime::cuda::collective`]). Rank 0 hands out the NCCL id at the rendezvous;
//! the rendezvous connections stay open as a control channel, over which the ranks
//! compare their replicas and collective logs at the end.

use anyhow::{bail, Context, Result};

use crate::distributed::{AllReduce, FailAt, RankResult, Shard};
use crate::launch::{report, WorkerOptions};
use crate::train::{plan_step_data_parallel, Dispatch, TrainConfig};
use erase_graph::DType;
use erase_runtime::collective::rendezvous::{rendezvous, RankEnv};
use erase_runtime::collective::tcp::TcpCollective;
use erase_runtime::collective::CollectiveRecord;
use erase_runtime::cuda::collective::DataParallel;
use erase_runtime::cuda::nccl::{nccl_check, unique_id, NcclComm, Watchdog};
use erase_runtime::cuda::program::CudaProgram;

/// Runs this process as rank `env.rank` on CUDA device `env.local_rank`.
pub fn run_worker_cuda(
    cfg: &TrainConfig,
    env: &RankEnv,
    opts: &WorkerOptions,
    fail: Option<FailAt>,
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
    let r = train(cfg, env, opts, fail, &dev, &mut comm, &wd);
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

fn train(
    cfg: &TrainConfig,
    env: &RankEnv,
    opts: &WorkerOptions,
    fail: Option<FailAt>,
    dev: &erase_runtime::cuda::CudaDevice,
    comm: &mut NcclComm,
    wd: &Watchdog,
) -> Result<RankResult> {
    let (rank, world) = (env.rank, env.world);
    let mut local = cfg.model.clone();
    local.batch = cfg.model.batch / world;
    let plan = plan_step_data_parallel(&local, DType::F32, &cfg.optimizer, &cfg.schedule)?;
    let m = &plan.model;
    let g = &m.graph;
    let mut prog = CudaProgram::new(dev, g, &plan.program, &plan.memory, cfg.seed)?;
    let dp = DataParallel::new(
        &prog,
        &plan.partition,
        &plan.training.grads,
        world,
        opts.allreduce == AllReduce::Early,
    )?;
    prog.set_threaded(cfg.dispatch == Dispatch::Threaded);
    // before the capture: the step graph reads the restored tensors where they are
    let ck = crate::distributed::RankCheckpoints::resume(cfg, g, &mut prog, rank)?;
    let graph = cfg.dispatch == Dispatch::Graph;
    if graph {
        wd.enter("warming up NCCL before the graph capture");
        prog.warm_up_collectives(&dp, comm)?;
        wd.enter("capturing the data-parallel step with its NCCL calls");
        prog.capture_data_parallel(&dp, comm)?;
        wd.leave();
    }
    let mut src = crate::train::BatchSource::new(&cfg.data, &cfg.model, cfg.data_seed)?;
    let mut shard = Shard::new(&local, cfg.model.batch, rank, world);
    let mut losses = Vec::with_capacity(cfg.steps);
    let mut step_secs = Vec::with_capacity(cfg.steps);
    let mut log: Vec<CollectiveRecord> = Vec::new();
    for step in ck.first..cfg.steps {
        FailAt::check(fail, rank, step)?;
        let (d, r, y) = shard.fill(&mut src, step);
        let (bd, bi, bo, bl) = m.batch_buffers(d, r, y)?;
        wd.enter(format!("step {step}: feeding the batch"));
        prog.feed(m.inputs.dense, &bd)?;
        prog.feed(m.inputs.ids, &bi)?;
        prog.feed(m.inputs.offsets, &bo)?;
        prog.feed(m.inputs.label, &bl)?;
        let first = dp
            .per_step
            .first()
            .map_or(String::new(), |c| format!(", first {} '{}'", c.0, c.1));
        wd.enter(format!(
            "step {step}: issuing the step and its {} collectives{first}",
            dp.per_step.len()
        ));
        prog.run_data_parallel(&dp, comm)
            .with_context(|| format!("rank {rank}, step {step}"))?;
        wd.enter(format!(
            "step {step}: waiting for the step and its {} collectives{first}",
            dp.per_step.len()
        ));
        while !prog.step_done()? {
            if let Some(e) = comm.async_error() {
                bail!("rank {rank}, step {step}: NCCL reports {e}");
            }
            std::thread::yield_now();
        }
        wd.leave();
        step_secs.push(f64::from(prog.step_ms()?) * 1e-3);
        let loss = prog
            .get(m.main_loss)?
            .to_f64()
            .first()
            .copied()
            .unwrap_or(f64::NAN);
        if !loss.is_finite() {
            bail!("rank {rank}, step {step}: the main loss is {loss}; training stopped");
        }
        losses.push(loss);
        for (kind, bucket, bytes) in &dp.per_step {
            log.push(CollectiveRecord {
                seq: log.len() as u64,
                kind,
                bucket: bucket.clone(),
                bytes: *bytes,
            });
        }
        if ck.due(cfg, rank, step + 1) {
            wd.enter(format!("step {}: writing the checkpoint", step + 1));
            ck.save(cfg, g, &prog, step + 1)?;
            wd.leave();
        }
    }
    if !graph && comm.log().len() != log.len() {
        bail!(
            "rank {rank}: issued {} collectives, the plan says {}",
            comm.log().len(),
            log.len()
        );
    }
    let (state, layout) = crate::distributed::persistent_state(g, |t| Ok(prog.get(t)?))?;
    Ok(RankResult {
        rank,
        state,
        layout,
        losses,
        log,
        step_secs,
    })
}
