//! A small byte-level GPT on any text file, cut into three subgraphs by two `detach`
//! points (each of the first two with a local LM head and loss) and trained with the
//! ERASE schedule on three streams. The model is `erase::model::nanochat`.
//!
//! ```sh
//! cargo run --release --example nanochat -- --text README.md --steps 300 --sample 200
//! cargo run --release --example nanochat -- --text README.md --plan
//! ```

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Parser, ValueEnum};
use erase::graph::{DenseOptimizer, OptimizerConfig};
use erase::model::nanochat::{load_text, plan_with, NanoConfig, NanoTrainer};
use erase::model::stepper::median;
use erase::model::stepper::StepSchedule;
use erase::runtime::program::schedule::ScheduleKind;
use erase::train::Occupancy;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Sched {
    /// Early backward programs of the two cut-off segments on side streams.
    Erase,
    /// Everything on the main stream (the same graph and bits, for comparison).
    Serial,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Device {
    /// The CPU step-program runner (forward, backward and optimizer times measured).
    Cpu,
    /// The CUDA device (blocking dispatch; CUDA events split the step into forward,
    /// backward after the forward, and optimizer).
    Cuda,
}

/// A byte-level GPT (vocabulary 256) with two detach points, trained with ERASE. Prints
/// the losses per step and, with --sample, a greedy continuation at the end.
#[derive(Parser, Debug)]
#[command(name = "nanochat", version)]
struct Args {
    /// The training text (any file; its bytes are the tokens).
    #[arg(long, value_name = "PATH")]
    text: Option<PathBuf>,
    /// Training steps.
    #[arg(long, default_value_t = 300)]
    steps: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 64)]
    seq: usize,
    /// Model width.
    #[arg(long, default_value_t = 64)]
    width: usize,
    /// Attention heads (width / heads must be 32 or 64).
    #[arg(long, default_value_t = 2)]
    heads: usize,
    /// Transformer blocks (at least 3: the two cuts make three segments).
    #[arg(long, default_value_t = 3)]
    layers: usize,
    /// Sequences per step.
    #[arg(long, default_value_t = 16)]
    batch: usize,
    /// Adam learning rate.
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    /// Row-wise Adagrad learning rate of the token embedding.
    #[arg(long, default_value_t = 0.05)]
    emb_lr: f64,
    /// Weight of each local loss.
    #[arg(long, default_value_t = 1.0)]
    aux_weight: f64,
    /// How the step is scheduled.
    #[arg(long, value_enum, default_value = "erase")]
    schedule: Sched,
    /// Side streams of the pool.
    #[arg(long, default_value_t = 2)]
    side_streams: usize,
    /// CPU threads (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
    /// Print a line every this many steps.
    #[arg(long, default_value_t = 10)]
    log_every: usize,
    /// Generate this many bytes greedily at the end.
    #[arg(long, default_value_t = 0)]
    sample: usize,
    /// The prompt of --sample (default: the text's first seq/2 bytes).
    #[arg(long)]
    prompt: Option<String>,
    /// Seed of parameter initialisation (the windows use seed + 1).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Where to train.
    #[arg(long, value_enum, default_value = "cpu")]
    device: Device,
    /// Print the step plan (backward programs, then every launch with its stream and
    /// cross-stream waits) and exit without training.
    #[arg(long)]
    plan: bool,
    /// The occupancy rule for launches that fill every SM for long (the fused attention
    /// backward at long sequences): `auto` orders one against the other streams only
    /// where the simulator predicts the step shorter for it; `on` orders every such
    /// launch; `off` never.
    #[arg(long, value_enum, default_value = "auto")]
    occupancy: OccupancyArg,
    /// Measure the last step's kernels (CUDA) and draw them: SVG, or PNG by the extension.
    #[arg(long, value_name = "FILE")]
    timeline: Option<PathBuf>,
    /// Measure the last step's kernels (CUDA) as Chrome / Perfetto trace-event JSON.
    #[arg(long, value_name = "FILE")]
    trace: Option<PathBuf>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum OccupancyArg {
    Auto,
    On,
    Off,
}

fn main() -> Result<()> {
    let a = Args::parse();
    let cfg = NanoConfig {
        seq: a.seq,
        width: a.width,
        heads: a.heads,
        layers: a.layers,
        batch: a.batch,
        aux_weight: a.aux_weight,
    };
    let opt = OptimizerConfig {
        dense: DenseOptimizer::Adam {
            lr: a.lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
        },
        rowwise_adagrad: (a.emb_lr, 1e-8),
        presort_ids: true,
        copies_in_update: true,
    };
    let kind = match a.schedule {
        Sched::Erase => ScheduleKind::Early,
        Sched::Serial => ScheduleKind::Serial,
    };
    let p = plan_with(
        &cfg,
        &opt,
        &StepSchedule {
            kind,
            side_streams: a.side_streams,
            occupancy: match a.occupancy {
                OccupancyArg::Auto => Occupancy::Auto,
                OccupancyArg::On => Occupancy::On,
                OccupancyArg::Off => Occupancy::Off,
            },
        },
    )?;
    if a.plan {
        print!("{}", p.plan.render());
        return Ok(());
    }
    let Some(path) = &a.text else {
        bail!("give --text PATH: the text to train on (any file, e.g. README.md)");
    };
    let text = load_text(path).context("--text")?;
    let dev = match a.device {
        Device::Cpu => None,
        Device::Cuda => Some(erase::gpu::open_device().context("--device cuda")?),
    };
    let threads = a
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let mut t = NanoTrainer::new(&p, &text, dev.as_ref(), a.seed, a.seed + 1, threads)
        .with_context(|| format!("--text {}", path.display()))?;
    let segs: Vec<String> = (0..3)
        .map(|k| {
            let r = cfg.segment(k);
            format!("{}..{}", r.start, r.end)
        })
        .collect();
    println!(
        "nanochat: {} bytes of {}; {} blocks of width {} ({} heads), segments {}, seq {}, batch {}, {} threads",
        text.len(),
        path.display(),
        cfg.layers,
        cfg.width,
        cfg.heads,
        segs.join(" | "),
        cfg.seq,
        cfg.batch,
        threads
    );
    print!("{}", p.plan.summary());
    let (mut first, mut last) = (f64::NAN, f64::NAN);
    let mut totals = Vec::new();
    let tracing = a.timeline.is_some() || a.trace.is_some();
    if tracing && dev.is_none() {
        bail!("--timeline and --trace measure kernels on a CUDA device: add --device cuda");
    }
    for s in 0..a.steps {
        if tracing && s + 1 == a.steps {
            t.trace_all()?;
        }
        let r = t.train_step()?;
        if s == 0 {
            first = r.loss;
        }
        last = r.loss;
        if s >= 3 {
            totals.push(r.times.total * 1e3);
        }
        if s == 0 || (s + 1) % a.log_every.max(1) == 0 || s + 1 == a.steps {
            let tm = r.times;
            let parts = if tm.phased {
                format!(
                    "  (backward {:.1} ms, {:.1} after the forward)",
                    tm.backward * 1e3,
                    tm.backward_exposed * 1e3
                )
            } else {
                String::new()
            };
            println!(
                "step {:5}  loss {:.4}  local {}  {:.1} ms{parts}",
                s + 1,
                r.loss,
                r.aux
                    .iter()
                    .map(|x| format!("{x:.4}"))
                    .collect::<Vec<_>>()
                    .join(" "),
                tm.total * 1e3
            );
        }
    }
    if a.steps > 0 {
        println!(
            "loss {first:.4} -> {last:.4} ({:.0} % of the first) in {} steps; median step {:.1} ms",
            100.0 * last / first,
            a.steps,
            median(&totals)
        );
    }
    if tracing && a.steps > 0 {
        let tr = t.last_trace(a.steps - 1)?;
        let o = tr.overlap();
        println!(
            "measured step {}: early backward {:.1} µs, of which {:.1} µs ({:.1} %) ran beside forward work on another stream",
            a.steps,
            o.early_backward_us,
            o.overlapped_us,
            100.0 * o.fraction
        );
        // the fused attention backward: how much of it had company on other streams
        let step_events: Vec<_> = tr.events.iter().collect();
        for e in step_events
            .iter()
            .filter(|e| e.phase == "bwd" && e.op.contains("attention"))
        {
            let beside: f64 = step_events
                .iter()
                .filter(|x| x.stream != e.stream)
                .map(|x| (x.end_us.min(e.end_us) - x.start_us.max(e.start_us)).max(0.0))
                .sum();
            println!(
                "  {} on {}: {:.1} µs, other streams' kernels beside it for {:.1} µs",
                e.name,
                tr.stream_label(e.stream as usize),
                e.duration_us(),
                beside
            );
        }
        let title = format!(
            "nanochat: measured step on {} ({} layers, seq {}, batch {})",
            dev.as_ref().map_or("CPU", |d| d.name.as_str()),
            cfg.layers,
            cfg.seq,
            cfg.batch
        );
        if let Some(path) = &a.timeline {
            let png = path
                .extension()
                .is_some_and(|e| e.eq_ignore_ascii_case("png"));
            let bytes = if png {
                tr.to_png(a.steps - 1, 1600, 40 + 44 * tr.stream_count().max(1) as u32)
            } else {
                tr.to_svg(a.steps - 1, &title).into_bytes()
            };
            std::fs::write(path, bytes)
                .with_context(|| format!("--timeline {}", path.display()))?;
            println!("measured timeline written to {}", path.display());
        }
        if let Some(path) = &a.trace {
            std::fs::write(path, tr.to_chrome_json())
                .with_context(|| format!("--trace {}", path.display()))?;
            println!("measured trace written to {}", path.display());
        }
    }
    if a.sample > 0 {
        let prompt = match &a.prompt {
            Some(p) => p.as_bytes().to_vec(),
            None => text[..text.len().min((cfg.seq / 2).max(1))].to_vec(),
        };
        if prompt.is_empty() {
            bail!("--prompt is empty");
        }
        let out = t.generate(&prompt, a.sample)?;
        println!(
            "--- prompt ---\n{}\n--- greedy continuation ({} bytes) ---\n{}",
            printable(&prompt),
            out.len(),
            printable(&out)
        );
    }
    Ok(())
}

/// Bytes as text: invalid UTF-8 replaced, control characters other than newline and tab
/// shown as `·`.
fn printable(b: &[u8]) -> String {
    String::from_utf8_lossy(b)
        .chars()
        .map(|c| {
            if c.is_control() && c != '\n' && c != '\t' {
                '·'
            } else {
                c
            }
        })
        .collect()
}
