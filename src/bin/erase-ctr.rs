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
use erase::train::{plan_step, train, ConsoleProgress, ScheduleOptions, TrainConfig};

#[derive(Parser)]
#[command(
    name = "erase-ctr",
    version,
    about = "Train the reference CTR model with early backward (ERASE), or print its step plan",
    long_about = "Train the reference CTR model of the spec (bottom MLP, DLRM interaction, DCNv2 cross, \
AutoInt, deep MLP and MaskNet over 26 embedding tables, then a top MLP) on synthetic data, \
as one of three variants:\n\
  baseline  one graph, one backward at the end of the step\n\
  detached  each block cut off by a detach, with an auxiliary loss per block\n\
  erase     as detached, with each block's backward started early on a pool stream\n\n\
This build runs on the CPU backend; the CUDA backend is not part of it yet."
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Train on synthetic data and report loss, NE, AUC and examples per second.
    Train(TrainArgs),
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
    /// Model sizes to start from; the flags below override single sizes.
    #[arg(long, value_enum, default_value = "small")]
    preset: Preset,
    /// Examples per step.
    #[arg(long)]
    batch: Option<usize>,
    /// Rows of each of the 26 embedding tables.
    #[arg(long)]
    rows: Option<usize>,
    /// Pool (side) streams for early backward programs (the paper used 4).
    #[arg(long, default_value_t = 4)]
    side_streams: usize,
    /// The occupancy rule: a launch that fills the device for long is not overlapped.
    #[arg(long, value_enum, default_value = "on")]
    occupancy: OnOff,
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
    /// Where to train. This build has only the CPU backend.
    #[arg(long, value_enum, default_value = "auto")]
    device: DeviceArg,
    /// Training data. Only `synthetic` (the spec's generator) in this build.
    #[arg(long, default_value = "synthetic")]
    data: String,
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
}

#[derive(Args)]
struct PlanArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The variant whose program is printed (the predicted times cover all three).
    #[arg(long, value_enum, default_value = "erase")]
    variant: VariantArg,
    /// Print every launch, not only the cross-stream edges.
    #[arg(long)]
    full: bool,
    /// Print the simulator's predicted timeline of the printed variant as text.
    #[arg(long)]
    timeline: bool,
    /// Print the N launches the cost model predicts to take longest.
    #[arg(long, value_name = "N")]
    kernels: Option<usize>,
}

fn run_train(a: &TrainArgs) -> Result<()> {
    match a.device {
        DeviceArg::Cuda => bail!(
            "--device cuda: this build of erase-ctr has no CUDA backend yet; use --device cpu (or auto)"
        ),
        DeviceArg::Auto | DeviceArg::Cpu => {}
    }
    if a.data != "synthetic" {
        bail!(
            "--data {}: only 'synthetic' is supported by this build",
            a.data
        );
    }
    if a.steps == 0 {
        bail!("--steps must be at least 1");
    }
    let variant = Variant::from(a.variant);
    let model = a.model.config(variant)?;
    let threads = a
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
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
    };
    let jsonl = match &a.metrics {
        Some(p) => Some(
            std::fs::File::create(p)
                .with_context(|| format!("--metrics {}: cannot create the file", p.display()))?,
        ),
        None => None,
    };
    eprintln!(
        "erase-ctr: training '{variant}' on the CPU ({threads} threads): batch {}, {} tables x {} rows x dim {}, {} steps, synthetic data (seed {})",
        model.batch, model.num_sparse, model.rows, model.dim, a.steps, a.data_seed
    );
    let mut progress = ConsoleProgress::new(jsonl);
    let r = train(&cfg, &mut progress)?;
    println!();
    println!("summary ({variant}, CPU)");
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
        "  step program      {} launches, arena {:.1} MiB",
        r.launches,
        r.arena_bytes as f64 / (1 << 20) as f64
    );
    Ok(())
}

fn run_plan(a: &PlanArgs) -> Result<()> {
    let sched = a.model.schedule();
    let sim = SimConfig {
        device: sched.device.clone(),
        host_per_launch_s: 0.0,
    };
    let shown = Variant::from(a.variant);
    let mut rows = Vec::new();
    for v in Variant::ALL {
        let cfg = a.model.config(v)?;
        let p = plan_step(&cfg, DType::F32, &OptimizerConfig::default(), &sched)?;
        let r = simulate(&p.program, &sim);
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
            if a.timeline {
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
                    let s = l
                        .spec
                        .as_ref()
                        .map_or((0, 0.0, 0.0, ""), |s| (s.grid, s.flops, s.bytes, s.kernel));
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
        rows.push((v, r.step_s, p.memory.arena_bytes, r.busy_s));
    }
    println!(
        "predicted step time on {} (simulator, graph dispatch):",
        sched.device.name
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
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let r = match &cli.cmd {
        Cmd::Train(a) => run_train(a),
        Cmd::Plan(a) => run_plan(a),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("erase-ctr: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
