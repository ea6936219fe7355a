//! `erase-ctr train`: train one variant, on one device or several ranks.

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};

use super::{
    model_and_data, open, print_overlap, write_trace_files, DeviceArg, DispatchArg, ModelArgs,
    UpdateArg, VariantArg,
};
use crate::graph::OptimizerConfig;
use crate::model::ctr::Variant;
use crate::train::{train_on, ConsoleProgress, Dispatch, TrainConfig};

#[derive(Args)]
pub(crate) struct TrainArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Which variant to train.
    #[arg(long, value_enum, default_value = "erase")]
    variant: VariantArg,
    /// Training steps.
    #[arg(long, default_value_t = 300)]
    steps: usize,
    /// How launches are issued: on a CUDA device the whole step as one CUDA graph (graph,
    /// the default there: the fastest measured), a dispatcher thread for the pool streams
    /// (threaded) or one host thread (blocking, the only mode of the CPU backend and the
    /// CPU's default).
    #[arg(long, value_enum)]
    dispatch: Option<DispatchArg>,
    /// Where to train: the CUDA device when there is one (auto), or insist.
    #[arg(long, value_enum, default_value = "auto")]
    device: DeviceArg,
    /// Training data: `synthetic` (the spec's generator), `criteo:PATH` (Criteo's TSV
    /// layout, plain or gzip) or `tsv:PATH` (columns described by `[data.schema]` in
    /// --config). PATH is a file, a glob or a folder.
    #[arg(long, default_value = "synthetic")]
    data: String,
    /// Stop at the first malformed line instead of counting and skipping it.
    #[arg(long)]
    strict: bool,
    /// Keep a binary cache of parsed data here (parsed once, memory-mapped after).
    #[arg(long, value_name = "DIR")]
    cache_dir: Option<std::path::PathBuf>,
    /// Learning rate of the dense parameters' Adam (betas 0.9 and 0.999, eps 1e-8, no
    /// weight decay, as the spec trains them).
    #[arg(long, value_name = "LR", default_value_t = 1e-3, value_parser = learning_rate, allow_hyphen_values = true)]
    lr: f64,
    /// Learning rate of the embedding tables' row-wise Adagrad (eps 1e-8, as the spec).
    #[arg(long, value_name = "LR", default_value_t = 0.01, value_parser = learning_rate, allow_hyphen_values = true)]
    embedding_lr: f64,
    /// Seed of parameter initialisation.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Seed of the synthetic data.
    #[arg(long, default_value_t = 0)]
    data_seed: u64,
    /// Evaluate on held-out data every N steps (0: only at the end).
    #[arg(long, default_value_t = 100)]
    eval_every: usize,
    /// Held-out examples per evaluation (at least 2: NE and AUC need both classes; with
    /// several ranks, rounded down to whole global batches).
    #[arg(long, default_value_t = 20_000)]
    eval_examples: usize,
    /// CPU threads (default: all cores; at least 1).
    #[arg(long, value_parser = super::at_least_one)]
    threads: Option<usize>,
    /// Steps left out of the throughput summary.
    #[arg(long, default_value_t = 5)]
    warmup: usize,
    /// Write one JSON object per step and per evaluation to this file.
    #[arg(long)]
    metrics: Option<std::path::PathBuf>,
    /// Measure a kernel trace (CUDA): every kernel and batch copy of --trace-steps steps
    /// from --trace-from, timed by CUDA events on their own streams, written as Chrome /
    /// Perfetto trace-event JSON (one track per stream; open it in ui.perfetto.dev).
    #[arg(long, value_name = "FILE")]
    trace: Option<std::path::PathBuf>,
    /// Draw the last traced step as a picture (SVG, or PNG by the file's extension): the
    /// streams as lanes, kernels coloured by block and phase. Implies tracing.
    #[arg(long, value_name = "FILE")]
    timeline: Option<std::path::PathBuf>,
    /// The first traced step (0-based; default: the first after --warmup).
    #[arg(long, value_name = "STEP")]
    trace_from: Option<usize>,
    /// How many steps to trace.
    #[arg(long, value_name = "N", default_value_t = 3)]
    trace_steps: usize,
    /// Print where the traced steps' time went: the N longest launches with the rates
    /// they reached against the H200's ceilings, and the time per op. Implies tracing.
    #[arg(long, value_name = "N")]
    kernels: Option<usize>,
    /// Save parameters and optimizer state here at the end (safetensors, written
    /// atomically).
    #[arg(long, value_name = "FILE")]
    checkpoint: Option<std::path::PathBuf>,
    /// Also save the checkpoint every N steps.
    #[arg(long, default_value_t = 0, value_name = "N")]
    checkpoint_every: usize,
    /// Continue from a checkpoint written with the same configuration; the result is
    /// bit-identical to a run that never stopped.
    #[arg(long, value_name = "FILE")]
    resume: Option<std::path::PathBuf>,
    /// Data parallelism on this many CPU ranks (threads): --batch is the global batch,
    /// split evenly (rank k takes examples i with i mod N = k of each); gradients are
    /// all-reduced and the replicas stay bit-identical. Any --data; --checkpoint (rank 0
    /// writes the common replica) and --resume, on any rank count.
    #[arg(long, value_name = "N", value_parser = super::at_least_one)]
    cpu_ranks: Option<usize>,
    /// Data parallelism over N worker processes on this host, one per GPU (NCCL); with
    /// --device cpu each worker is a CPU rank and the collectives go over TCP on
    /// loopback. --batch is the global batch. Each worker runs this command with RANK,
    /// WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT set; a process started with
    /// them set (torchrun style, e.g. on several hosts) is that rank. If one worker
    /// fails, the others are stopped and the error names it.
    #[arg(long, value_name = "N")]
    gpus: Option<usize>,
    /// With --gpus: all-reduce each backward program's gradients as soon as it ends
    /// (early, on a communication stream), or all of them once after the backward (end).
    #[arg(long, value_enum, default_value = "early")]
    allreduce: AllReduceArg,
    /// With --gpus: seconds a collective (or the rendezvous) waits for the other ranks
    /// before the job fails naming the missing rank.
    #[arg(long, default_value_t = 120.0, value_name = "SECS")]
    collective_timeout: f64,
    /// With --gpus: write each rank's log of collectives to DIR/rank-K.log.
    #[arg(long, value_name = "DIR")]
    collective_log: Option<std::path::PathBuf>,
    /// With several ranks: where each embedding table lives (`auto`: by its size, the
    /// ranks' memory and the communication, as `plan --gpus N --sharding` prints;
    /// `replicated`, `table` (whole on one rank) or `row` (rows split over the ranks) to
    /// force one). A rank stores only the rows it holds; the step exchanges ids, rows and
    /// gradients by all-to-all (on CUDA ranks NCCL's, inside the step and its graph).
    /// CPU ranks train to the bits of replicated tables. CUDA ranks exchange fixed blocks
    /// (table-wise about as much as a jagged all-to-all, row-wise growing with the
    /// ranks: `plan --gpus N` predicts both) and, with several of them, group a row's
    /// gradient sums otherwise, so their bits differ slightly from replicated tables.
    #[arg(long, value_enum, default_value = "auto")]
    sharding: super::plan::ShardingArg,
    /// With several ranks: each rank's memory for embedding tables and their optimizer
    /// state, GB (what --sharding plans for; a replicated table set larger than this is
    /// refused). It budgets the rows a rank holds; a sharded rank also stores landing
    /// slots for the rows its batch fetches (batch x slots x (dim + 1) x 4 bytes), which
    /// each rank prints.
    #[arg(long, value_name = "GB", default_value = DEFAULT_RANK_MEMORY, value_parser = super::gigabytes)]
    rank_memory: u64,
}

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
enum AllReduceArg {
    Early,
    End,
}

/// The settings of several ranks, checked together before anything starts: one way to
/// run several ranks, and the settings that only mean
/// something with several (`worker_world`: this process is a worker of that many).
fn check_ranks(a: &TrainArgs, worker_world: Option<usize>) -> Result<()> {
    if let (Some(c), Some(g)) = (a.cpu_ranks, a.gpus) {
        bail!("--cpu-ranks {c} runs ranks as threads of this process and --gpus {g} one process per rank; give one of them");
    }
    if let (Some(c), Some(w)) = (a.cpu_ranks, worker_world) {
        bail!("--cpu-ranks {c} in a worker of a data-parallel job (WORLD_SIZE={w} is set); unset RANK and WORLD_SIZE, or drop --cpu-ranks");
    }
    let ranks = a.cpu_ranks.or(a.gpus).or(worker_world).unwrap_or(1);
    if ranks <= 1 {
        let default_memory = super::gigabytes(DEFAULT_RANK_MEMORY).unwrap_or(0);
        if a.sharding != super::plan::ShardingArg::Auto || a.rank_memory != default_memory {
            bail!("--sharding and --rank-memory place the tables over several ranks; this run has one (add --gpus N or --cpu-ranks N)");
        }
        return Ok(());
    }
    Ok(())
}

/// What every rank of `--cpu-ranks N` or of the workers `--gpus N` starts would refuse,
/// refused once, before any starts.
fn check_rank_options(a: &TrainArgs) -> Result<()> {
    let flag = match (a.cpu_ranks, a.gpus) {
        (Some(n), _) => format!("--cpu-ranks {n}"),
        (None, Some(n)) => format!("--gpus {n}"),
        (None, None) => return Ok(()),
    };
    let cpu_ranks = a.cpu_ranks.is_some() || matches!(a.device, DeviceArg::Cpu);
    if cpu_ranks && a.dispatch.is_some_and(|d| d != DispatchArg::Blocking) {
        bail!("{flag} runs CPU ranks, which dispatch blocking; drop --dispatch (or, with --gpus, use --device cuda)");
    }
    if a.trace.is_some() || a.timeline.is_some() || a.kernels.is_some() {
        bail!("--trace, --timeline and --kernels trace one process; run them without {flag}");
    }
    if a.model.optimizer_update == UpdateArg::Early {
        bail!("--optimizer-update early updates a block before its gradients are all-reduced; with {flag} use end");
    }
    Ok(())
}

/// --rank-memory's default, GB.
const DEFAULT_RANK_MEMORY: &str = "120";

pub(super) fn run(a: &TrainArgs) -> Result<()> {
    if a.steps == 0 {
        bail!("--steps must be at least 1");
    }
    // a worker of a data-parallel job (RANK and WORLD_SIZE set), or its supervisor
    let rank_env =
        crate::runtime::collective::rendezvous::RankEnv::from_env().map_err(anyhow::Error::msg)?;
    check_ranks(a, rank_env.as_ref().map(|e| e.world))?;
    if rank_env.is_none() {
        check_rank_options(a)?;
    }
    if let (None, Some(n)) = (&rank_env, a.gpus) {
        let args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
        return crate::launch::supervise(n, &args);
    }
    let dev = match rank_env {
        Some(_) => None, // the worker opens device LOCAL_RANK
        None => open(a.device, &a.model)?,
    };
    // graph dispatch where the run has a CUDA device (a worker: where its device opens)
    let dispatch = a.dispatch.unwrap_or(match (&rank_env, &dev) {
        (None, Some(_)) => DispatchArg::Graph,
        (None, None) => DispatchArg::Blocking,
        (Some(env), _) => match a.device {
            DeviceArg::Cpu => DispatchArg::Blocking,
            _ if crate::gpu::open_device_ordinal(env.local_rank).is_ok() => DispatchArg::Graph,
            _ => DispatchArg::Blocking,
        },
    });
    let variant = Variant::from(a.variant);
    let (model, data) = model_and_data(
        &a.model,
        variant,
        &a.data,
        a.strict,
        a.cache_dir.as_deref(),
        a.threads,
        false,
    )?;
    // the workers of one host share its cores
    let per_host = match &rank_env {
        Some(e) => std::env::var("LOCAL_WORLD_SIZE")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(e.world),
        None => 1usize,
    };
    let threads = a.threads.unwrap_or_else(|| {
        (std::thread::available_parallelism().map_or(1, |n| n.get()) / per_host.max(1)).max(1)
    });
    let cfg = TrainConfig {
        model: model.clone(),
        steps: a.steps,
        seed: a.seed,
        data_seed: a.data_seed,
        eval_every: a.eval_every,
        eval_examples: super::eval_count(a.eval_examples, model.batch)?,
        threads,
        schedule: a.model.schedule()?,
        optimizer: optimizer(a.lr, a.embedding_lr),
        warmup: a.warmup.min(a.steps.saturating_sub(1)),
        checkpoint: a.checkpoint.clone(),
        checkpoint_every: a.checkpoint_every,
        resume: a.resume.clone(),
        dispatch: dispatch.into(),
        data,
        trace: (a.trace.is_some() || a.timeline.is_some() || a.kernels.is_some()).then(|| {
            crate::train::TraceWindow {
                start: a.trace_from.unwrap_or(a.warmup),
                steps: a.trace_steps.max(1),
                kernels: a.kernels.unwrap_or(0),
            }
        }),
        sharding: a.sharding.into(),
        rank_memory: a.rank_memory,
        stop: None,
    };
    if (a.trace.is_some() || a.timeline.is_some() || a.kernels.is_some()) && dev.is_none() {
        bail!("--trace, --timeline and --kernels measure kernels on a CUDA device; this run is on the CPU (`erase-ctr plan --trace/--timeline` gives the simulator's prediction)");
    }
    if a.checkpoint_every > 0 && a.checkpoint.is_none() {
        bail!("--checkpoint-every needs --checkpoint FILE");
    }
    if let Some(env) = &rank_env {
        if a.gpus.is_some_and(|n| n != env.world) {
            bail!(
                "--gpus {} but WORLD_SIZE={}",
                a.gpus.unwrap_or(0),
                env.world
            );
        }
        if !(a.collective_timeout > 0.0 && a.collective_timeout.is_finite()) {
            bail!("--collective-timeout must be a positive number of seconds");
        }
        let opts = crate::launch::WorkerOptions {
            device: match a.device {
                DeviceArg::Auto => crate::launch::WorkerDevice::Auto,
                DeviceArg::Cpu => crate::launch::WorkerDevice::Cpu,
                DeviceArg::Cuda => crate::launch::WorkerDevice::Cuda,
            },
            allreduce: match a.allreduce {
                AllReduceArg::Early => crate::distributed::AllReduce::Early,
                AllReduceArg::End => crate::distributed::AllReduce::End,
            },
            timeout: std::time::Duration::from_secs_f64(a.collective_timeout),
            collective_log: a.collective_log.clone(),
            plan: a.model.plan_options()?,
            metrics: a.metrics.clone(),
        };
        return crate::launch::run_worker(&cfg, env, &opts);
    }
    let jsonl = match &a.metrics {
        Some(p) => Some(
            std::fs::File::create(p)
                .with_context(|| format!("--metrics {}: cannot create the file", p.display()))?,
        ),
        None => None,
    };
    let where_ = match &dev {
        Some(d) => format!(
            "{} ({} dispatch)",
            d.name,
            Dispatch::from(dispatch).as_str()
        ),
        None => format!("the CPU ({threads} threads)"),
    };
    eprintln!(
        "erase-ctr: training model '{}' ({variant}) on {where_}: batch {}, {} tables of {} rows in all, dim {}, {} dense features, {} steps, data {} (seed {}), Adam lr {}, row-wise Adagrad lr {}",
        model.model,
        model.batch,
        model.num_sparse,
        model.field_rows().iter().sum::<usize>(),
        model.dim,
        model.num_dense,
        a.steps,
        a.data,
        a.data_seed,
        a.lr,
        a.embedding_lr
    );
    if let Some(n) = a.cpu_ranks {
        let t0 = std::time::Instant::now();
        let mut progress = ConsoleProgress::new(jsonl);
        let results = crate::distributed::train_data_parallel_cpu_with(
            &cfg,
            n,
            std::time::Duration::from_secs(120),
            None,
            &mut progress,
        )?;
        println!();
        let mut ok = Vec::new();
        for r in results {
            ok.push(r?);
        }
        let fp = ok[0].replicated_fingerprint();
        let same = ok.iter().all(|r| r.replicated_fingerprint() == fp);
        let secs = t0.elapsed().as_secs_f64();
        println!(
            "data parallel on {n} CPU ranks: {} steps of a global batch of {} in {secs:.1} s",
            cfg.steps, model.batch
        );
        for r in &ok {
            println!(
                "  rank {}: last loss of its shard {:.4}, {} collectives",
                r.rank,
                r.losses.last().copied().unwrap_or(f64::NAN),
                r.log.len()
            );
        }
        println!(
            "  replicas {}{}",
            if same { "bit-identical" } else { "DIFFER" },
            if ok[0].sharded.is_empty() {
                ""
            } else {
                " (the replicated tensors; the sharded tables whole on rank 0)"
            }
        );
        if !same {
            bail!("the replicas differ after training");
        }
        let e = crate::distributed::evaluate_replica(&cfg, &ok[0], None)?;
        println!(
            "  held-out NE {:.4}  AUC {:.4} ({} examples, rank 0's replica at the global batch)",
            e.ne, e.auc, e.examples
        );
        return Ok(());
    }
    let mut progress = ConsoleProgress::new(jsonl);
    // Ctrl-C ends the run after the step under way, with its checkpoint
    let signals = crate::interrupt::install();
    let cfg = crate::train::TrainConfig {
        stop: Some(signals.flag()),
        ..cfg
    };
    let r = train_on(&cfg, dev.as_ref(), &mut progress)?;
    drop(signals);
    println!();
    println!(
        "summary ({variant}, {})",
        if dev.is_some() { "CUDA" } else { "CPU" }
    );
    println!("  steps             {}", r.losses.len());
    println!(
        "  first / last loss {:.4} / {:.4}",
        r.losses.first().copied().unwrap_or(f64::NAN),
        r.losses.last().copied().unwrap_or(f64::NAN)
    );
    if let Some(e) = r.evals.first() {
        println!("  NE  first eval    {:.4} (step {})", e.ne, e.step);
    }
    if let Some(e) = r.evals.last() {
        println!("  NE  final         {:.4} (step {})", e.ne, e.step);
        println!(
            "  AUC final         {:.4} ({} held-out examples)",
            e.auc, e.examples
        );
    }
    if let Some(q) = r.qps {
        println!(
            "  examples/s        p50 {:.0}  p90 {:.0}  mean {:.0} ({} steps after warm-up)",
            q.p50, q.p90, q.mean, q.steps
        );
    }
    println!(
        "  data loader       waited {:.3} s for batches in all",
        r.loader_stall_secs
    );
    if let Some(t) = &r.trace {
        print_overlap("measured", &t.overlap());
        if let Some(k) = &r.kernel_table {
            print!("{k}");
        }
        let title = format!(
            "erase-ctr {variant}: measured step on {} (batch {}, {} dispatch)",
            dev.as_ref().map_or("CPU", |d| d.name.as_str()),
            model.batch,
            cfg.dispatch.as_str()
        );
        write_trace_files(
            t,
            a.trace.as_deref(),
            a.timeline.as_deref(),
            &title,
            "measured",
        )?;
    }
    println!(
        "  step program      {} launches, arena {:.1} MiB",
        r.launches,
        r.arena_bytes as f64 / (1 << 20) as f64
    );
    if let Some(step) = r.interrupted {
        let what = match &cfg.checkpoint {
            Some(p) if r.interrupted_saved => format!(
                "the checkpoint {} holds it: continue with --resume {} (and the same flags)",
                p.display(),
                p.display()
            ),
            Some(p) => format!(
                "{} was there before this run and is kept as it was (this run had not written it yet)",
                p.display()
            ),
            None => "no checkpoint was asked for (--checkpoint FILE keeps one)".to_string(),
        };
        let metrics = match progress.write_error.take() {
            Some(e) => format!("; --metrics: a write failed ({e}), the file is incomplete"),
            None => String::new(),
        };
        return Err(crate::interrupt::Interrupted(format!(
            "interrupted after step {step} of {}; {what}{metrics}",
            cfg.steps
        ))
        .into());
    }
    if let Some(e) = progress.write_error.take() {
        bail!(
            "--metrics {}: a write failed ({e}); training finished, but the metrics file is incomplete",
            a.metrics.as_deref().unwrap_or(std::path::Path::new("?")).display()
        );
    }
    Ok(())
}

/// A learning rate: a positive, finite number.
fn learning_rate(v: &str) -> Result<f64, String> {
    match v.parse::<f64>() {
        Ok(x) if x > 0.0 && x.is_finite() => Ok(x),
        Ok(_) => Err(format!("'{v}': a learning rate is positive and finite")),
        Err(e) => Err(format!("'{v}': not a number: {e}")),
    }
}

/// The spec's optimizers (Adam for the dense parameters, row-wise Adagrad for the
/// tables) at learning rates `dense` and `embedding`.
fn optimizer(dense: f64, embedding: f64) -> OptimizerConfig {
    let spec = OptimizerConfig::default();
    let dense = match spec.dense {
        crate::graph::DenseOptimizer::Adam {
            beta1, beta2, eps, ..
        } => crate::graph::DenseOptimizer::Adam {
            lr: dense,
            beta1,
            beta2,
            eps,
        },
        other => other,
    };
    OptimizerConfig {
        dense,
        rowwise_adagrad: (embedding, spec.rowwise_adagrad.1),
        ..spec
    }
}
