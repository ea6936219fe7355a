//! `erase-ctr`: the bundled CTR trainer. Trains the spec's reference model (six dense
//! subarchitectures over 26 embedding tables) as `baseline`, `detached` or `erase`, and
//! prints the ERASE step plan.

use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand, ValueEnum};

use erase::graph::{DType, OptimizerConfig, Phase};
use erase::model::ctr::{CtrConfig, Variant};
use erase::runtime::occupancy::DeviceModel;
use erase::runtime::simulate::{simulate, SimConfig};
use erase::runtime::trace::Trace;
use erase::train::{plan_step, train_on, ConsoleProgress, Dispatch, ScheduleOptions, TrainConfig};

#[derive(Parser)]
#[command(
    name = "erase-ctr",
    args_override_self = true,
    version,
    about = "Train the reference CTR model with early backward (ERASE), or print its step plan",
    long_about = "Train the reference CTR model of the spec (bottom MLP, DLRM interaction, DCNv2 cross, \
AutoInt, deep MLP and MaskNet over 26 embedding tables, then a top MLP) on synthetic data, \
as one of three variants:\n\
  baseline  one graph, one backward at the end of the step\n\
  detached  each block cut off by a detach, with an auxiliary loss per block\n\
  erase     as detached, with each block's backward started early on a pool stream\n\n\
Runs on the CUDA device when there is one (blocking dispatch), else on the CPU backend."
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Train on synthetic data and report loss, NE, AUC and examples per second.
    Train(Box<TrainArgs>),
    /// Evaluate a checkpoint: NE and AUC of its main logit on held-out data.
    Eval(EvalArgs),
    /// Run baseline, detached and erase side by side (interleaved) and print QPS
    /// p50/p90, the gain over baseline, NE, AUC and the NE gap.
    Bench(BenchArgs),
    /// Print the step program (streams, events and why), peak memory, the
    /// happens-before check, and the simulator's predicted step time per variant.
    Plan(PlanArgs),
}

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
enum Preset {
    /// A lightweight size that trains in seconds on a CPU (batch 256, 1000 rows, dim 16).
    Small,
    /// The spec's sizes (batch 4096, 100000 rows per table, dim 64).
    Spec,
}

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
enum DeviceArg {
    /// The CUDA device if this build and machine have one, else the CPU.
    Auto,
    Cpu,
    Cuda,
}

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq, Debug)]
enum DispatchArg {
    /// One host thread issues every launch in schedule order.
    Blocking,
    /// Pool streams' launches issued by a dispatcher thread (CUDA only).
    Threaded,
    /// The whole step captured once as a CUDA graph and replayed (CUDA only).
    Graph,
}

impl From<DispatchArg> for Dispatch {
    fn from(d: DispatchArg) -> Self {
        match d {
            DispatchArg::Blocking => Dispatch::Blocking,
            DispatchArg::Threaded => Dispatch::Threaded,
            DispatchArg::Graph => Dispatch::Graph,
        }
    }
}

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
enum Rates {
    Measured,
    Peak,
}

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
enum OnOff {
    On,
    Off,
}

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
enum VariantArg {
    Baseline,
    Detached,
    Erase,
}

impl From<VariantArg> for Variant {
    fn from(v: VariantArg) -> Self {
        match v {
            VariantArg::Baseline => Variant::Baseline,
            VariantArg::Detached => Variant::Detached,
            VariantArg::Erase => Variant::Erase,
        }
    }
}

#[derive(Args)]
struct ModelArgs {
    /// A TOML file of settings: keys of its [model], [train], [bench], [plan] and [data]
    /// tables are this command's flags (e.g. `steps = 500`); flags given on the command
    /// line win. `[data.schema]` describes the columns of `--data tsv:PATH`.
    #[arg(long, value_name = "FILE")]
    config: Option<std::path::PathBuf>,
    /// Model sizes to start from; the flags below override single sizes.
    #[arg(long, value_enum, default_value = "small")]
    preset: Preset,
    /// Examples per step.
    #[arg(long)]
    batch: Option<usize>,
    /// Rows of each of the 26 embedding tables.
    #[arg(long)]
    rows: Option<usize>,
    /// Pool (side) streams for early backward programs (the paper used 4; with 5 the CTR
    /// model's MaskNet backward no longer queues behind AutoInt's, 0.3 % faster on an
    /// H200, see BENCHMARKS.md).
    #[arg(long, default_value_t = 5)]
    side_streams: usize,
    /// The occupancy rule: a launch that fills the device for long is not overlapped.
    /// Off by default: on an H200 the CTR model's erase step measured 17 % faster
    /// without it (see BENCHMARKS.md).
    #[arg(long, value_enum, default_value = "off")]
    occupancy: OnOff,
    /// When the dense parameters are updated: `end`, one update of all of them after the
    /// whole backward; `early`, each early block's right after its backward, on its side
    /// stream (the remainder's at the end). Same bits either way.
    #[arg(long, value_enum, default_value = "end")]
    optimizer_update: UpdateArg,
    /// The last early backward program (readied last, so with the least time before
    /// the step's end) on a side stream of its own, one priority level below the main
    /// stream; `off` shares the pool round-robin among all early programs. With
    /// --side-streams 1 there is no stream to spare and this does nothing.
    #[arg(long, value_enum, default_value = "on")]
    late_stream: OnOff,
    /// Each side stream's weight gradients on a companion stream of their own, beside the
    /// block's chain of data gradients (which the next layer's gradient waits for and the
    /// weight gradient does not): the block that ends last ends sooner (1.2 % faster on
    /// an H200, see BENCHMARKS.md). Only under ERASE.
    #[arg(long, value_enum, default_value = "on")]
    weight_grad_streams: OnOff,
    /// `on`: every stream joins the main stream before the updates start (as a
    /// data-parallel step always does: it all-reduces there); `off`: each update waits
    /// only for the gradients it reads, and the embedding tables' update runs on the
    /// stream that wrote their gradient, beside the dense update (with the companions'
    /// lower priority, 0.9 % faster on an H200, see BENCHMARKS.md). Only under ERASE.
    #[arg(long, value_enum, default_value = "off")]
    update_join: OnOff,
    /// Round each large layer's GEMM operands (its input, its output's gradient) to bf16
    /// once, in a pass of their own that every GEMM reading them shares, instead of in
    /// each GEMM: the same values in fewer passes. CUDA only (the CPU's GEMMs are f32).
    #[arg(long, value_enum, default_value = "on")]
    bf16_copies: OnOff,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum UpdateArg {
    End,
    Early,
}

impl ModelArgs {
    fn config(&self, variant: Variant) -> Result<CtrConfig> {
        let mut c = match self.preset {
            Preset::Small => CtrConfig::small(),
            Preset::Spec => CtrConfig::default(),
        };
        c.variant = variant;
        if let Some(b) = self.batch {
            c.batch = b;
        }
        if let Some(r) = self.rows {
            c.rows = r;
        }
        if self.side_streams == 0 {
            bail!("--side-streams must be at least 1");
        }
        c.validate()
            .context("invalid model size (see --preset, --batch, --rows)")?;
        Ok(c)
    }

    fn schedule(&self) -> ScheduleOptions {
        ScheduleOptions {
            side_streams: self.side_streams,
            occupancy: self.occupancy == OnOff::On,
            device: DeviceModel::h200(),
            early_updates: self.optimizer_update == UpdateArg::Early,
            late_stream: self.late_stream == OnOff::On,
            weight_grad_streams: self.weight_grad_streams == OnOff::On,
            updates_by_data: self.update_join == OnOff::Off,
            bf16_copies: self.bf16_copies == OnOff::On,
            ..ScheduleOptions::default()
        }
    }
}

#[derive(Args)]
struct TrainArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Which variant to train.
    #[arg(long, value_enum, default_value = "erase")]
    variant: VariantArg,
    /// Training steps.
    #[arg(long, default_value_t = 300)]
    steps: usize,
    /// How launches are issued on a CUDA device.
    #[arg(long, value_enum, default_value = "blocking")]
    dispatch: DispatchArg,
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
    /// Seed of parameter initialisation.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Seed of the synthetic data.
    #[arg(long, default_value_t = 0)]
    data_seed: u64,
    /// Evaluate on held-out data every N steps (0: only at the end).
    #[arg(long, default_value_t = 100)]
    eval_every: usize,
    /// Held-out examples per evaluation (rounded down to whole batches).
    #[arg(long, default_value_t = 20_000)]
    eval_examples: usize,
    /// CPU threads (default: all cores).
    #[arg(long)]
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
    /// split evenly; gradients are all-reduced and the replicas stay bit-identical.
    /// Synthetic data only for now.
    #[arg(long, value_name = "N")]
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
}

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
enum AllReduceArg {
    Early,
    End,
}

#[derive(Args)]
struct EvalArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The checkpoint to evaluate (written by `train --checkpoint`).
    #[arg(long, value_name = "FILE")]
    checkpoint: std::path::PathBuf,
    /// The variant the checkpoint was trained as (its tensors must fit).
    #[arg(long, value_enum, default_value = "erase")]
    variant: VariantArg,
    /// Held-out data, as for train (for synthetic: stream 2 of --data-seed).
    #[arg(long, default_value = "synthetic")]
    data: String,
    /// Seed of the synthetic data.
    #[arg(long, default_value_t = 0)]
    data_seed: u64,
    /// Stop at the first malformed line.
    #[arg(long)]
    strict: bool,
    /// Keep a binary cache of parsed data here.
    #[arg(long, value_name = "DIR")]
    cache_dir: Option<std::path::PathBuf>,
    /// Held-out examples to evaluate (rounded down to whole batches).
    #[arg(long, default_value_t = 20_000)]
    eval_examples: usize,
    /// Where to run.
    #[arg(long, value_enum, default_value = "auto")]
    device: DeviceArg,
    /// CPU threads (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
}

#[derive(Args)]
struct BenchArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Untimed steps per variant first.
    #[arg(long, default_value_t = 50)]
    warmup: usize,
    /// Timed steps per variant.
    #[arg(long, default_value_t = 200)]
    steps: usize,
    /// Steps of one variant before the next takes over.
    #[arg(long, default_value_t = 10)]
    chunk: usize,
    /// Where to run (as for train).
    #[arg(long, value_enum, default_value = "auto")]
    device: DeviceArg,
    /// Dispatch modes to measure, comma separated (graph needs a CUDA device).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "blocking")]
    dispatch: Vec<DispatchArg>,
    /// Held-out examples for NE and AUC at the end.
    #[arg(long, default_value_t = 20_000)]
    eval_examples: usize,
    /// CPU threads (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
    /// Also write the rows as JSON to this file.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// Steps traced after the timed ones (CUDA) for the measured overlap figure; 0: none.
    #[arg(long, value_name = "N", default_value_t = 3)]
    trace_steps: usize,
    /// With traced steps: print each variant's measured per-kernel table (the N longest
    /// launches against the H200's ceilings, and the time per op).
    #[arg(long, value_name = "N", default_value_t = 0)]
    kernels: usize,
    /// Write each variant's and dispatch's measured trace here (`<variant>-<dispatch>.json`
    /// and `.svg`).
    #[arg(long, value_name = "DIR")]
    trace_dir: Option<std::path::PathBuf>,
}

#[derive(Args)]
struct PlanArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The rates the simulator predicts with: `measured`, what Erase's kernels reached on
    /// an H200 (GEMM 125 TFLOP/s, 250 reading bf16 copies in place, memory 3.2 TB/s), or `peak`, what cuBLAS and a copy reach
    /// (736 TFLOP/s, 4.22 TB/s).
    #[arg(long, value_enum, default_value = "measured")]
    rates: Rates,
    /// The variant whose program is printed (the predicted times cover all three).
    #[arg(long, value_enum, default_value = "erase")]
    variant: VariantArg,
    /// Print every launch, not only the cross-stream edges.
    #[arg(long)]
    full: bool,
    /// Write the simulator's predicted timeline of the printed variant as a picture: SVG,
    /// or PNG when FILE ends in `.png`; `-` prints it as text instead.
    #[arg(long, value_name = "FILE")]
    timeline: Option<std::path::PathBuf>,
    /// Write the predicted timeline of the printed variant as Chrome / Perfetto
    /// trace-event JSON (open it in ui.perfetto.dev or chrome://tracing).
    #[arg(long, value_name = "FILE")]
    trace: Option<std::path::PathBuf>,
    /// Print the N launches the cost model predicts to take longest.
    #[arg(long, value_name = "N")]
    kernels: Option<usize>,
    /// Also predict data-parallel steps on this many GPUs (NVLink, ring collectives),
    /// with each block's gradients all-reduced early and with one all-reduce at the end.
    #[arg(long, value_name = "N")]
    gpus: Option<usize>,
    /// Predict with kernel times measured on a GPU instead of the cost model's: a trace
    /// written by `train --trace` or `bench --trace-dir` (best of a serial variant, whose
    /// kernels ran alone). Launches it lacks keep the model's time.
    #[arg(long, value_name = "TRACE.json")]
    measured: Option<std::path::PathBuf>,
    /// Also predict the `erase` step for every side-stream count from 1 to N (with the
    /// occupancy rule as set) and name the fastest: how the simulator chooses the pool.
    #[arg(long, value_name = "N")]
    sweep_side_streams: Option<usize>,
}

/// The model sized for the data, and the data: synthetic, or loaded (with a held-out
/// part) from `--data criteo:PATH | tsv:PATH`.
fn model_and_data(
    m: &ModelArgs,
    variant: Variant,
    data: &str,
    strict: bool,
    cache_dir: Option<&std::path::Path>,
) -> Result<(CtrConfig, erase::train::Data)> {
    let schema = match &m.config {
        Some(p) => {
            let text =
                std::fs::read_to_string(p).with_context(|| format!("--config {}", p.display()))?;
            let table: toml::Table = text
                .parse()
                .with_context(|| format!("{} is not valid TOML", p.display()))?;
            match table.get("data").and_then(|d| d.get("schema")) {
                Some(_) => Some(
                    erase::data::TsvSchema::from_toml(&text)
                        .with_context(|| format!("{}: [data.schema]", p.display()))?,
                ),
                None => None,
            }
        }
        None => None,
    };
    let source = erase::data::parse_data_arg(data, schema.as_ref()).context("--data")?;
    let mut model = m.config(variant)?;
    let Some(src) = source else {
        return Ok((model, erase::train::Data::Synthetic));
    };
    let opts = erase::data::LoadOptions {
        strict,
        cache_dir: cache_dir.map(|p| p.to_path_buf()),
    };
    let t0 = std::time::Instant::now();
    let (train, eval, report) = erase::data::load(&src, &opts)?;
    eprintln!("{report}");
    eprintln!(
        "loaded {} training examples in {:.1} s",
        train.len(),
        t0.elapsed().as_secs_f64()
    );
    let (train, eval) = match eval {
        Some(e) => (std::sync::Arc::new(train), std::sync::Arc::new(e)),
        None => {
            // no split in the source: hold out the last tenth
            let (tr, ev) = train
                .split_tail(0.1)
                .context("holding out a tenth for evaluation")?;
            (std::sync::Arc::new(tr), std::sync::Arc::new(ev))
        }
    };
    model.num_dense = train.num_dense;
    model.num_sparse = train.num_sparse;
    model.hot = 1;
    model.validate().context("the model for this data")?;
    eprintln!(
        "data: {} train / {} held-out examples, {} dense and {} categorical fields, {:.2} % positive",
        train.len(),
        eval.len(),
        train.num_dense,
        train.num_sparse,
        100.0 * train.positive_rate()
    );
    Ok((
        model,
        erase::train::Data::Table {
            train,
            eval,
            source: data.to_string(),
        },
    ))
}

fn run_eval(a: &EvalArgs) -> Result<()> {
    let dev = open(a.device)?;
    let variant = Variant::from(a.variant);
    let (model, data) =
        model_and_data(&a.model, variant, &a.data, a.strict, a.cache_dir.as_deref())?;
    let threads = a
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let plan = plan_step(
        &model,
        erase::graph::DType::F32,
        &OptimizerConfig::default(),
        &a.model.schedule(),
    )?;
    let mut s = erase::train::Session::with_dispatch(
        &plan,
        dev.as_ref(),
        Dispatch::Blocking,
        &data,
        0,
        a.data_seed,
        threads,
    )?;
    let step = s.load_weights(&a.checkpoint)?;
    let e = s.evaluate(a.eval_examples.max(model.batch))?;
    println!(
        "{}: step {step}, NE {:.4}, AUC {:.4} on {} held-out examples",
        a.checkpoint.display(),
        e.ne,
        e.auc,
        e.examples
    );
    Ok(())
}

fn run_train(a: &TrainArgs) -> Result<()> {
    if a.steps == 0 {
        bail!("--steps must be at least 1");
    }
    // a worker of a data-parallel job (RANK and WORLD_SIZE set), or its supervisor
    let rank_env = erase::runtime::rendezvous::RankEnv::from_env().map_err(anyhow::Error::msg)?;
    if let (None, Some(n)) = (&rank_env, a.gpus) {
        // refuse what every worker would refuse, once, before starting them
        if matches!(a.device, DeviceArg::Cpu) && !matches!(a.dispatch, DispatchArg::Blocking) {
            bail!("--gpus {n} --device cpu runs CPU ranks, which dispatch blocking; drop --dispatch or use --device cuda");
        }
        if a.trace.is_some() || a.timeline.is_some() || a.kernels.is_some() {
            bail!("--trace, --timeline and --kernels trace one process; run them without --gpus");
        }
        if a.model.optimizer_update == UpdateArg::Early {
            bail!("--optimizer-update early updates a block before its gradients are all-reduced; with --gpus use end");
        }
        let args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
        return erase::launch::supervise(n, &args);
    }
    let dev = match rank_env {
        Some(_) => None, // the worker opens device LOCAL_RANK
        None => open(a.device)?,
    };
    let variant = Variant::from(a.variant);
    let (model, data) =
        model_and_data(&a.model, variant, &a.data, a.strict, a.cache_dir.as_deref())?;
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
        eval_examples: a.eval_examples.max(model.batch),
        threads,
        schedule: a.model.schedule(),
        optimizer: OptimizerConfig::default(),
        warmup: a.warmup.min(a.steps.saturating_sub(1)),
        checkpoint: a.checkpoint.clone(),
        checkpoint_every: a.checkpoint_every,
        resume: a.resume.clone(),
        dispatch: a.dispatch.into(),
        data,
        trace: (a.trace.is_some() || a.timeline.is_some() || a.kernels.is_some()).then(|| {
            erase::train::TraceWindow {
                start: a.trace_from.unwrap_or(a.warmup),
                steps: a.trace_steps.max(1),
                kernels: a.kernels.unwrap_or(0),
            }
        }),
    };
    if (a.trace.is_some() || a.timeline.is_some() || a.kernels.is_some()) && dev.is_none() {
        bail!("--trace, --timeline and --kernels measure kernels on a CUDA device; this run is on the CPU (`erase-ctr plan --trace/--timeline` gives the simulator's prediction)");
    }
    if a.checkpoint_every > 0 && a.checkpoint.is_none() {
        bail!("--checkpoint-every needs --checkpoint FILE");
    }
    let jsonl = match &a.metrics {
        Some(p) => Some(
            std::fs::File::create(p)
                .with_context(|| format!("--metrics {}: cannot create the file", p.display()))?,
        ),
        None => None,
    };
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
        let opts = erase::launch::WorkerOptions {
            device: match a.device {
                DeviceArg::Auto => erase::launch::WorkerDevice::Auto,
                DeviceArg::Cpu => erase::launch::WorkerDevice::Cpu,
                DeviceArg::Cuda => erase::launch::WorkerDevice::Cuda,
            },
            allreduce: match a.allreduce {
                AllReduceArg::Early => erase::distributed::AllReduce::Early,
                AllReduceArg::End => erase::distributed::AllReduce::End,
            },
            timeout: std::time::Duration::from_secs_f64(a.collective_timeout),
            collective_log: a.collective_log.clone(),
        };
        return erase::launch::run_worker(&cfg, env, &opts);
    }
    let where_ = match &dev {
        Some(d) => format!(
            "{} ({} dispatch)",
            d.name,
            Dispatch::from(a.dispatch).as_str()
        ),
        None => format!("the CPU ({threads} threads)"),
    };
    eprintln!(
        "erase-ctr: training '{variant}' on {where_}: batch {}, {} tables x {} rows x dim {}, {} steps, data {} (seed {})",
        model.batch, model.num_sparse, model.rows, model.dim, a.steps, a.data, a.data_seed
    );
    if let Some(n) = a.cpu_ranks {
        if !matches!(cfg.data, erase::train::Data::Synthetic) {
            bail!("--cpu-ranks: only synthetic data for now");
        }
        let t0 = std::time::Instant::now();
        let results = erase::distributed::train_data_parallel_cpu(
            &cfg,
            n,
            std::time::Duration::from_secs(120),
            None,
        )?;
        let mut ok = Vec::new();
        for r in results {
            ok.push(r?);
        }
        let same = ok.iter().all(|r| r.state == ok[0].state);
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
            "  replicas {}",
            if same { "bit-identical" } else { "DIFFER" }
        );
        if !same {
            bail!("the replicas differ after training");
        }
        let e = erase::distributed::evaluate_replica(&cfg, &ok[0], None)?;
        println!(
            "  held-out NE {:.4}  AUC {:.4} ({} examples, rank 0's replica at the global batch)",
            e.ne, e.auc, e.examples
        );
        return Ok(());
    }
    let mut progress = ConsoleProgress::new(jsonl);
    let r = train_on(&cfg, dev.as_ref(), &mut progress)?;
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
    Ok(())
}

fn open(device: DeviceArg) -> Result<Option<erase::runtime::cuda::CudaDevice>> {
    Ok(match device {
        DeviceArg::Cpu => None,
        DeviceArg::Cuda => Some(erase::gpu::open_device().context("--device cuda")?),
        DeviceArg::Auto => match erase::gpu::open_device() {
            Ok(d) => Some(d),
            Err(e) => {
                eprintln!("erase-ctr: no usable CUDA device ({e:#}); running on the CPU");
                None
            }
        },
    })
}

fn run_bench(a: &BenchArgs) -> Result<()> {
    if a.steps == 0 {
        bail!("--steps must be at least 1");
    }
    let model = a.model.config(Variant::Erase)?;
    let dev = open(a.device)?;
    let threads = a
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let cfg = erase::bench::BenchConfig {
        model: model.clone(),
        variants: Variant::ALL.to_vec(),
        warmup: a.warmup,
        steps: a.steps,
        chunk: a.chunk,
        seed: 0,
        data_seed: 0,
        eval_examples: a.eval_examples.max(model.batch),
        threads,
        schedule: a.model.schedule(),
        optimizer: OptimizerConfig::default(),
        dispatch: a.dispatch.iter().map(|&d| d.into()).collect(),
        trace_steps: if dev.is_some() { a.trace_steps } else { 0 },
        kernels: a.kernels,
    };
    let name = dev
        .as_ref()
        .map_or_else(|| format!("CPU ({threads} threads)"), |d| d.name.clone());
    eprintln!("erase-ctr bench on {name}: {} warm-up + {} timed steps per variant, interleaved in chunks of {}", a.warmup, a.steps, a.chunk);
    let rows = erase::bench::bench(&cfg, dev.as_ref(), &mut |m| eprintln!("  {m}"))?;
    print!("{}", erase::bench::render(&rows, &name, model.batch));
    if let Some(p) = &a.json {
        std::fs::write(p, erase::bench::to_json(&rows))
            .with_context(|| format!("--json {}", p.display()))?;
    }
    for r in rows.iter().filter(|r| r.kernel_table.is_some()) {
        println!("\n== {} ({} dispatch) ==", r.variant.as_str(), r.dispatch);
        print!("{}", r.kernel_table.as_deref().unwrap_or_default());
    }
    if let Some(dir) = &a.trace_dir {
        std::fs::create_dir_all(dir).with_context(|| format!("--trace-dir {}", dir.display()))?;
        for r in &rows {
            if let Some(t) = &r.trace {
                let stem = format!("{}-{}", r.variant.as_str(), r.dispatch);
                let title = format!(
                    "erase-ctr {}: measured step on {name} (batch {}, {} dispatch)",
                    r.variant.as_str(),
                    model.batch,
                    r.dispatch
                );
                write_trace_files(
                    t,
                    Some(&dir.join(format!("{stem}.json"))),
                    Some(&dir.join(format!("{stem}.svg"))),
                    &title,
                    "measured",
                )?;
            }
        }
    }
    Ok(())
}

/// (join time, optimizer time, communication buckets) of one simulated step.
type DpInputs = (f64, f64, Vec<erase::runtime::simulate::Bucket>);

/// What a data-parallel prediction needs from a one-GPU simulation: when the backward
/// work is joined, how long the optimizer takes, and the communication buckets (one per
/// backward program's dense gradients; the tables' sparse gradients gathered).
fn data_parallel_inputs(
    p: &erase::train::StepPlan,
    r: &erase::runtime::simulate::SimResult,
) -> DpInputs {
    use erase::graph::{Grad, Phase};
    use erase::runtime::simulate::Bucket;
    let g = &p.model.graph;
    let launch_of: std::collections::BTreeMap<_, _> = p
        .program
        .launches
        .iter()
        .enumerate()
        .map(|(i, l)| (l.node, i))
        .collect();
    // where a data-parallel step joins: after the last launch before the updates (the
    // single-GPU ERASE plan has no join of its own: its updates wait by data)
    let join = p
        .program
        .launches
        .iter()
        .enumerate()
        .filter(|(_, l)| g.node(l.node).phase != Phase::Optimizer)
        .map(|(i, _)| r.launches[i].end)
        .fold(0.0, f64::max);
    let end_of = |prog: usize| -> f64 {
        p.partition.programs[prog]
            .nodes
            .iter()
            .filter_map(|n| launch_of.get(n).map(|&i| r.launches[i].end))
            .fold(0.0, f64::max)
    };
    let mut by_prog: std::collections::BTreeMap<usize, f64> = Default::default();
    let mut buckets = Vec::new();
    for (param, grad) in &p.training.grads.by_param {
        let Some(&prog) = p.partition.grad_complete.get(param) else {
            continue;
        };
        match grad {
            Grad::Dense(t) => *by_prog.entry(prog).or_default() += (g.shape(*t).numel() * 4) as f64,
            Grad::Sparse {
                ids,
                offsets,
                dpooled,
                ..
            } => buckets.push(Bucket {
                bytes: ((g.shape(*ids).numel()
                    + g.shape(*offsets).numel()
                    + g.shape(*dpooled).numel())
                    * 4) as f64,
                ready_s: end_of(prog),
                gather: true,
            }),
        }
    }
    for (prog, bytes) in by_prog {
        buckets.push(Bucket {
            bytes,
            ready_s: end_of(prog),
            gather: false,
        });
    }
    (join, r.step_s - join, buckets)
}

fn run_plan(a: &PlanArgs) -> Result<()> {
    let mut dp: Vec<(Variant, DpInputs)> = Vec::new();
    let sched = a.model.schedule();
    let sim = SimConfig {
        device: match a.rates {
            Rates::Measured => DeviceModel::h200_measured(),
            Rates::Peak => sched.device.clone(),
        },
        host_per_launch_s: 0.0,
    };
    let shown = Variant::from(a.variant);
    let mut rows = Vec::new();
    let mut erase_overlap = None;
    let measured = match &a.measured {
        Some(path) => Some(
            erase::profile::load_measured(path)
                .with_context(|| format!("--measured {}", path.display()))?,
        ),
        None => None,
    };
    for v in Variant::ALL {
        let cfg = a.model.config(v)?;
        let p = plan_step(&cfg, DType::F32, &OptimizerConfig::default(), &sched)?;
        let r = match &measured {
            None => simulate(&p.program, &sim),
            Some(m) => {
                let (work, found) =
                    erase::profile::measured_work(&p.program, &p.model.graph, m, &sim.device);
                let kernels = p
                    .program
                    .launches
                    .iter()
                    .filter(|l| l.spec.is_some())
                    .count();
                println!("{v}: {found} of {kernels} launches take their measured time");
                erase::runtime::simulate::simulate_with(&p.program, &sim, &work)
            }
        };
        let g = &p.model.graph;
        if v == shown {
            println!(
                "== {v}: batch {}, {} side stream(s), occupancy rule {} ==",
                cfg.batch,
                sched.side_streams,
                if sched.occupancy { "on" } else { "off" }
            );
            let early: Vec<_> = p.partition.programs.iter().filter(|x| x.early).collect();
            println!(
                "backward programs: {} early, {} remainder",
                early.len(),
                p.partition.programs.len() - early.len()
            );
            for bp in &p.partition.programs {
                let after = g.node(p.partition.forward[bp.ready_after]).name.clone();
                println!(
                    "  {:<12} {:4} nodes, ready after forward #{} '{}'",
                    bp.name,
                    bp.nodes.len(),
                    bp.ready_after,
                    after
                );
            }
            println!("streams (runs of launches in issue order):");
            print!("{}", p.program.render_streams());
            if a.full {
                print!("{}", p.program.render(g));
            } else {
                println!("cross-stream edges ({} events):", p.program.events);
                for (i, r, w) in p.program.edges() {
                    let (li, lr) = (&p.program.launches[i], &p.program.launches[r]);
                    println!(
                        "  {} #{i} waits for {} #{r}: {}",
                        li.stream, lr.stream, w.why
                    );
                }
            }
            let trace = Trace::from_simulation(&p.program, &r, g);
            let title = format!(
                "erase-ctr {v}: predicted step on {} (batch {}, {} stream(s))",
                sched.device.name, cfg.batch, p.program.streams
            );
            let text = a.timeline.as_deref().is_some_and(|p| p.as_os_str() == "-");
            if let Some(path) = a.timeline.as_deref().filter(|_| !text) {
                let png = path
                    .extension()
                    .is_some_and(|e| e.eq_ignore_ascii_case("png"));
                let bytes = if png {
                    let h = 40 + 44 * trace.stream_count().max(1) as u32;
                    trace.to_png(0, 1600, h)
                } else {
                    trace.to_svg(0, &title).into_bytes()
                };
                std::fs::write(path, bytes)
                    .with_context(|| format!("--timeline {}", path.display()))?;
                println!("predicted timeline written to {}", path.display());
            }
            if let Some(path) = &a.trace {
                std::fs::write(path, trace.to_chrome_json())
                    .with_context(|| format!("--trace {}", path.display()))?;
                println!("predicted trace written to {}", path.display());
            }
            if text {
                println!("predicted timeline on {} (µs):", sched.device.name);
                for (i, l) in p.program.launches.iter().enumerate() {
                    let s = r.launches[i];
                    if l.spec.is_some() {
                        println!(
                            "  {:>9.1} {:>9.1}  {:<6} {}",
                            s.start * 1e6,
                            s.end * 1e6,
                            l.stream.to_string(),
                            l.label
                        );
                    }
                }
            }
            if let Some(n) = a.kernels {
                let mut by_time: Vec<(f64, usize)> = p
                    .program
                    .launches
                    .iter()
                    .enumerate()
                    .filter_map(|(i, l)| l.spec.as_ref().map(|s| (sched.device.duration_s(s), i)))
                    .collect();
                by_time.sort_by(|a, b| b.0.total_cmp(&a.0));
                let total: f64 = by_time.iter().map(|x| x.0).sum();
                println!(
                    "longest launches predicted (alone) on {}; all launches add up to {:.1} µs:",
                    sched.device.name,
                    total * 1e6
                );
                println!(
                    "  {:>8}  {:>6}  {:>8}  {:>9}  {:>9}  kernel / launch",
                    "µs", "share", "grid", "GFLOP", "MB"
                );
                for (t, i) in by_time.into_iter().take(n) {
                    let l = &p.program.launches[i];
                    let s = l.spec.as_ref().map_or((0, 0.0, 0.0, String::new()), |s| {
                        let k = erase::profile::kernels_of(g, l.node);
                        let k = if k.is_empty() {
                            s.kernel.to_string()
                        } else {
                            k
                        };
                        (s.grid, s.flops, s.bytes, k)
                    });
                    println!(
                        "  {:8.1}  {:5.1}%  {:8}  {:9.3}  {:9.2}  {} ({}) '{}'",
                        t * 1e6,
                        100.0 * t / total,
                        s.0,
                        s.1 / 1e9,
                        s.2 / 1e6,
                        s.3,
                        l.label,
                        g.node(l.node).name
                    );
                }
            }
            let fwd = p
                .program
                .launches
                .iter()
                .filter(|l| g.node(l.node).phase == Phase::Forward)
                .count();
            println!(
                "{} launches ({fwd} forward); arena {:.1} MiB (without reuse {:.1} MiB); happens-before check: no hazards",
                p.program.launches.len(),
                p.memory.arena_bytes as f64 / (1 << 20) as f64,
                p.memory.total_bytes as f64 / (1 << 20) as f64
            );
            println!();
        }
        if v == Variant::Erase {
            erase_overlap = Some(Trace::from_simulation(&p.program, &r, g).overlap_step(0));
        }
        if a.gpus.is_some() {
            dp.push((v, data_parallel_inputs(&p, &r)));
        }
        rows.push((v, r.step_s, p.memory.arena_bytes, r.busy_s));
    }
    if let Some(max) = a.sweep_side_streams {
        let cfg = a.model.config(Variant::Erase)?;
        println!(
            "erase step by side streams (occupancy rule {}), {}:",
            if sched.occupancy { "on" } else { "off" },
            if measured.is_some() {
                "measured kernel times"
            } else {
                "cost model"
            }
        );
        let mut best: Option<(usize, f64)> = None;
        for k in 1..=max.max(1) {
            let sk = ScheduleOptions {
                side_streams: k,
                ..sched.clone()
            };
            let p = plan_step(&cfg, DType::F32, &OptimizerConfig::default(), &sk)?;
            let r = match &measured {
                None => simulate(&p.program, &sim),
                Some(m) => {
                    let (work, _) =
                        erase::profile::measured_work(&p.program, &p.model.graph, m, &sim.device);
                    erase::runtime::simulate::simulate_with(&p.program, &sim, &work)
                }
            };
            println!(
                "  {k} side stream(s): {:8.1} µs, {} streams used",
                r.step_s * 1e6,
                p.program.streams
            );
            if best.is_none_or(|b| r.step_s < b.1 * (1.0 - 1e-3)) {
                best = Some((k, r.step_s));
            }
        }
        if let Some((k, t)) = best {
            println!(
                "  fastest: {k} side stream(s), {:.1} µs (fewer streams win ties)",
                t * 1e6
            );
        }
    }
    if let Some(n) = a.gpus {
        use erase::runtime::simulate::{predict_data_parallel, LinkModel};
        if n == 0 {
            bail!("--gpus must be at least 1");
        }
        let link = LinkModel::nvlink_h200();
        let batch = a.model.config(Variant::Erase)?.batch;
        println!(
            "predicted data-parallel steps ({} examples per GPU; ring collectives at {:.0} GB/s bus bandwidth, {:.0} µs per hop):",
            batch,
            link.bus_bw / 1e9,
            link.latency_s * 1e6
        );
        for (v, (join, opt, buckets)) in &dp {
            for (early, label) in [
                (true, "early all-reduce"),
                (false, "one all-reduce at the end"),
            ] {
                let one = predict_data_parallel(*join, *opt, buckets, &link, 1, early);
                let pn = predict_data_parallel(*join, *opt, buckets, &link, n, early);
                println!(
                    "  {:<9} {:<26} {n} GPUs: {:8.1} µs, {:>9.0} ex/s, scaling {:5.1} %, exposed communication {:7.1} µs of {:7.1}",
                    v.as_str(),
                    label,
                    pn.step_s * 1e6,
                    (n * batch) as f64 / pn.step_s,
                    100.0 * one.step_s / pn.step_s,
                    pn.exposed_comm_s * 1e6,
                    pn.comm_s * 1e6
                );
            }
        }
        if let Some((_, (_, _, buckets))) = dp.first() {
            let gathered: f64 = buckets.iter().filter(|b| b.gather).map(|b| b.bytes).sum();
            let mc = a.model.config(Variant::Erase)?;
            let pooled = (batch * mc.num_sparse * mc.dim * 4) as f64;
            println!(
                "  replicated tables: each rank gathers {:.1} MB of (ids, gradients) from every other rank, {:.1} µs at {n} GPUs and growing with N;",
                gathered / 1e6,
                link.all_gather_s(gathered, n) * 1e6
            );
            println!(
                "  sharded tables (all-to-all of pooled embeddings forward and their gradients backward) would move {:.1} MB per rank each way, {:.1} µs, about flat in N",
                pooled / 1e6,
                2.0 * link.all_to_all_s(pooled, n) * 1e6
            );
        }
    }
    println!(
        "predicted step time on {} (simulator, graph dispatch):",
        sim.device.name
    );
    let base = rows[0].1;
    for (v, t, mem, busy) in &rows {
        let qps = a.model.config(*v)?.batch as f64 / t;
        let busy: Vec<String> = busy.iter().map(|b| format!("{:.0}", b * 1e6)).collect();
        println!(
            "  {:<9} {:8.1} µs  {:>9.0} ex/s  {:+6.1} % vs baseline   arena {:7.1} MiB   busy µs per stream [{}]",
            v.as_str(),
            t * 1e6,
            qps,
            (base / t - 1.0) * 100.0,
            *mem as f64 / (1 << 20) as f64,
            busy.join(", ")
        );
    }
    if let Some(o) = erase_overlap {
        println!(
            "predicted overlap (erase): early backward {:.1} µs, of which {:.1} µs ({:.1} %) ran while forward work ran on another stream",
            o.early_backward_us,
            o.overlapped_us,
            100.0 * o.fraction
        );
        let busy: Vec<String> = o
            .streams
            .iter()
            .map(|b| format!("{} {:.0} %", b.name, 100.0 * b.busy_fraction))
            .collect();
        println!(
            "  busy share of the {:.1} µs step per stream: {}",
            o.span_us,
            busy.join(", ")
        );
    }
    Ok(())
}

/// Writes a trace as Chrome / Perfetto JSON and its last step as a picture (SVG or PNG).
fn write_trace_files(
    trace: &Trace,
    json: Option<&std::path::Path>,
    picture: Option<&std::path::Path>,
    title: &str,
    what: &str,
) -> Result<()> {
    let step = trace.steps().last().copied().unwrap_or(0);
    if let Some(path) = picture {
        let png = path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("png"));
        let bytes = if png {
            let h = 40 + 44 * trace.stream_count().max(1) as u32;
            trace.to_png(step, 1600, h)
        } else {
            trace.to_svg(step, title).into_bytes()
        };
        std::fs::write(path, bytes).with_context(|| format!("--timeline {}", path.display()))?;
        println!("{what} timeline written to {}", path.display());
    }
    if let Some(path) = json {
        std::fs::write(path, trace.to_chrome_json())
            .with_context(|| format!("--trace {}", path.display()))?;
        println!("{what} trace written to {}", path.display());
    }
    Ok(())
}

/// The overlap figure of a trace, as `train` and `bench` print it.
fn print_overlap(what: &str, o: &erase::runtime::trace::Overlap) {
    println!(
        "  {what} overlap: early backward {:.1} µs over {} step(s), of which {:.1} µs ({:.1} %) ran while forward work ran on another stream",
        o.early_backward_us,
        o.steps.len(),
        o.overlapped_us,
        100.0 * o.fraction
    );
    if let Some(last) = o.steps.last() {
        let busy: Vec<String> = last
            .streams
            .iter()
            .map(|b| format!("{} {:.0} %", b.name, 100.0 * b.busy_fraction))
            .collect();
        println!(
            "  busy share of the {:.1} µs step {} per stream: {}",
            last.span_us,
            last.step,
            busy.join(", ")
        );
    }
}

/// Puts the flags a `--config FILE` holds before the command line's own, so that the
/// command line wins (later flags override earlier ones).
fn expand_config(args: Vec<std::ffi::OsString>) -> Result<Vec<std::ffi::OsString>> {
    let strs: Vec<String> = args
        .iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    let pos = strs
        .iter()
        .position(|a| a == "--config" || a.starts_with("--config="));
    let Some(pos) = pos else { return Ok(args) };
    let path = match strs[pos].strip_prefix("--config=") {
        Some(p) => p.to_string(),
        None => strs
            .get(pos + 1)
            .cloned()
            .ok_or_else(|| anyhow::anyhow!("--config needs a FILE"))?,
    };
    let text = std::fs::read_to_string(&path).with_context(|| format!("--config {path}"))?;
    let table: toml::Table = text
        .parse()
        .with_context(|| format!("{path} is not valid TOML"))?;
    let sub = strs.get(1).cloned().unwrap_or_default();
    let cmd = <Cli as clap::CommandFactory>::command();
    let subcmd = cmd
        .find_subcommand(&sub)
        .ok_or_else(|| anyhow::anyhow!("--config must follow a subcommand"))?;
    let mut extra: Vec<std::ffi::OsString> = Vec::new();
    for (section, body) in &table {
        let Some(body) = body.as_table() else {
            bail!("{path}: `{section}` must be a table such as [train]");
        };
        for (key, value) in body {
            if section == "data" && key == "schema" {
                continue; // read by the data loader
            }
            let flag = key.replace('_', "-");
            let Some(arg) = subcmd
                .get_arguments()
                .find(|a| a.get_long() == Some(flag.as_str()))
            else {
                bail!(
                    "{path}: [{section}] {key} is not a setting of `erase-ctr {sub}` (see --help)"
                );
            };
            let takes_value = arg.get_action().takes_values();
            match value {
                toml::Value::Boolean(b) if !takes_value => {
                    if *b {
                        extra.push(format!("--{flag}").into());
                    }
                }
                toml::Value::String(v) => extra.extend([format!("--{flag}").into(), v.into()]),
                toml::Value::Integer(v) => {
                    extra.extend([format!("--{flag}").into(), v.to_string().into()])
                }
                toml::Value::Float(v) => {
                    extra.extend([format!("--{flag}").into(), v.to_string().into()])
                }
                toml::Value::Boolean(v) => extra.extend([
                    format!("--{flag}").into(),
                    if *v { "on" } else { "off" }.into(),
                ]),
                toml::Value::Array(items) => {
                    let parts: Vec<String> = items
                        .iter()
                        .map(|i| i.as_str().map_or_else(|| i.to_string(), str::to_string))
                        .collect();
                    extra.extend([format!("--{flag}").into(), parts.join(",").into()]);
                }
                other => bail!("{path}: [{section}] {key} = {other} is not a flag value"),
            }
        }
    }
    let mut out: Vec<std::ffi::OsString> = args[..2.min(args.len())].to_vec();
    out.extend(extra);
    out.extend(args.into_iter().skip(2));
    Ok(out)
}

fn main() -> ExitCode {
    let args = match expand_config(std::env::args_os().collect()) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("erase-ctr: error: {e:#}");
            return ExitCode::FAILURE;
        }
    };
    let cli = Cli::parse_from(args);
    let r = match &cli.cmd {
        Cmd::Train(a) => run_train(a),
        Cmd::Plan(a) => run_plan(a),
        Cmd::Bench(a) => run_bench(a),
        Cmd::Eval(a) => run_eval(a),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("erase-ctr: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
