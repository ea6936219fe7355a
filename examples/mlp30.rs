//! The ERASE paper's sanity check: a 30-layer MLP on MNIST, trained `conventional`,
//! `detached` (FF-style local losses) or `erase` (the detached graph with every layer's
//! backward started early on a side stream). The model is `erase::model::mlp30`, the
//! same as `shared/anchors/torch_mlp30.py`.
//!
//! ```sh
//! cargo run --release --example mlp30 -- --data ../shared/data/mnist --mode erase
//! cargo run --release --example mlp30 -- --data ../shared/data/mnist --mode conventional,detached,erase --steps 200
//! cargo run --release --example mlp30 -- --data ../shared/data/mnist --plan --layers 3
//! ```

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Parser, ValueEnum};
use erase::data::mnist::{self, Split};
use erase::graph::{DenseOptimizer, OptimizerConfig};
use erase::model::mlp30::{plan_with, HiddenInit, Mlp30Config, Mlp30Trainer, Mode};
use erase::model::stepper::median;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Opt {
    /// Adam (betas 0.9, 0.999, eps 1e-8).
    Adam,
    /// Plain SGD (torch_mlp30.py's optimizer, with --lr 0.01).
    Sgd,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Device {
    /// The CPU step-program runner (forward, backward and optimizer times measured).
    Cpu,
    /// The CUDA device (blocking dispatch; CUDA events split the step into forward,
    /// backward after the forward, and optimizer, as torch_mlp30.py does).
    Cuda,
}

/// A deep MLP on MNIST, trained conventionally, with detached local losses, or with the
/// ERASE schedule. Prints, per logged step, the loss and where the step's time went, then
/// the test accuracy.
#[derive(Parser, Debug)]
#[command(name = "mlp30", version)]
struct Args {
    /// Folder with train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte
    /// and t10k-labels-idx1-ubyte, each plain or .gz (e.g. ../shared/data/mnist).
    #[arg(long, value_name = "PATH")]
    data: Option<PathBuf>,
    /// conventional, detached or erase; several, comma separated, run one after another
    /// and end with a table.
    #[arg(long, value_delimiter = ',', default_value = "erase")]
    mode: Vec<Mode>,
    /// Hidden width. The paper uses 1024 (on a GPU); the default, 256, is CPU-sized: an epoch
    /// of 30 layers takes about half a minute on two cores.
    #[arg(long, default_value_t = 256)]
    width: usize,
    /// Hidden layers.
    #[arg(long, default_value_t = 30)]
    layers: usize,
    /// Images per step.
    #[arg(long, default_value_t = 256)]
    batch: usize,
    /// Hidden-layer init: he (uniform ±sqrt(6/fan_in), bias 0) or torch (nn.Linear's
    /// default, as torch_mlp30.py; a 30-layer ReLU stack barely learns with it).
    #[arg(long, default_value = "he")]
    init: HiddenInit,
    /// Epochs over the 60 000 training images (whole batches, reshuffled each epoch).
    #[arg(long, default_value_t = 1)]
    epochs: usize,
    /// Train this many steps instead of --epochs.
    #[arg(long)]
    steps: Option<usize>,
    /// CPU threads (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
    /// Optimizer of every parameter.
    #[arg(long, value_enum, default_value = "adam")]
    optimizer: Opt,
    /// Learning rate.
    #[arg(long, default_value_t = 1e-3)]
    lr: f64,
    /// Side streams of the pool (erase).
    #[arg(long, default_value_t = 4)]
    side_streams: usize,
    /// Print a line every this many steps.
    #[arg(long, default_value_t = 10)]
    log_every: usize,
    /// Steps left out of the timing medians.
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// Seed of parameter initialisation (the data order uses seed + 1).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Where to train.
    #[arg(long, value_enum, default_value = "cpu")]
    device: Device,
    /// The occupancy rule: `auto` (the occupancy model orders a device-filling launch
    /// against the other streams only where the simulator predicts a shorter step), `on`
    /// (every such launch) or `off` (none).
    #[arg(long, value_enum, default_value = "auto")]
    occupancy: OccupancyArg,
    /// Print each mode's step plan (backward programs, then every launch with its stream
    /// and cross-stream waits) and exit without training.
    #[arg(long)]
    plan: bool,
}

struct Summary {
    mode: Mode,
    steps: usize,
    loss: f64,
    accuracy: f64,
    total_ms: f64,
    backward_ms: f64,
    exposed_ms: f64,
}

fn main() -> Result<()> {
    let a = Args::parse();
    if a.mode.is_empty() {
        bail!("--mode needs at least one of conventional, detached, erase");
    }
    let dense = match a.optimizer {
        Opt::Adam => DenseOptimizer::Adam {
            lr: a.lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
        },
        Opt::Sgd => DenseOptimizer::Sgd { lr: a.lr },
    };
    let opt = OptimizerConfig {
        dense,
        ..Default::default()
    };
    if a.plan {
        for &mode in &a.mode {
            let cfg = config(&a, mode);
            let p = plan_with(&cfg, &opt, a.side_streams, a.occupancy.into())?;
            println!("== mlp30 {mode}: {} layers of {} ==", cfg.layers, cfg.width);
            print!("{}", p.plan.render());
        }
        return Ok(());
    }
    let Some(data) = &a.data else {
        bail!("give --data PATH: a folder with the MNIST IDX files (e.g. ../shared/data/mnist)");
    };
    let t0 = std::time::Instant::now();
    let train = mnist::load(data, Split::Train).context("--data")?;
    let test = mnist::load(data, Split::Test).context("--data")?;
    eprintln!(
        "MNIST: {} training and {} test images from {} ({:.1} s)",
        train.len(),
        test.len(),
        data.display(),
        t0.elapsed().as_secs_f64()
    );
    let dev = match a.device {
        Device::Cpu => None,
        Device::Cuda => Some(erase::gpu::open_device().context("--device cuda")?),
    };
    let threads = a
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let mut rows = Vec::new();
    for &mode in &a.mode {
        let cfg = config(&a, mode);
        let p = plan_with(&cfg, &opt, a.side_streams, a.occupancy.into())?;
        let mut t = Mlp30Trainer::new(&p, dev.as_ref(), a.seed, a.seed + 1, threads)?;
        let steps = a.steps.unwrap_or(a.epochs * t.steps_per_epoch(&train));
        if steps == 0 {
            bail!("nothing to train: --steps 0 or fewer than one batch per epoch");
        }
        println!(
            "== {mode}: {} layers of {}, batch {}, {steps} steps, {} threads ==",
            cfg.layers, cfg.width, cfg.batch, threads
        );
        print!("{}", p.plan.summary().lines().next().unwrap_or_default());
        println!();
        let (mut total, mut bwd, mut exposed) = (Vec::new(), Vec::new(), Vec::new());
        let mut last = f64::NAN;
        for s in 0..steps {
            let r = t.train_step(&train)?;
            last = r.loss;
            let tm = r.times;
            if s >= a.warmup.min(steps - 1) {
                total.push(tm.total * 1e3);
                bwd.push(tm.backward * 1e3);
                exposed.push(tm.backward_exposed * 1e3);
            }
            if (s + 1) % a.log_every.max(1) == 0 || s + 1 == steps {
                let local = if r.local_mean.is_nan() {
                    String::new()
                } else {
                    format!("  local {:.4}", r.local_mean)
                };
                if tm.phased && tm.backward.is_nan() {
                    println!(
                        "step {:5}  loss {:.4}{local}  batch {:7.2} ms  forward {:6.2} ms  backward after the forward {:6.2} ms  optimizer {:5.2} ms",
                        s + 1,
                        r.loss,
                        tm.total * 1e3,
                        tm.forward * 1e3,
                        tm.backward_exposed * 1e3,
                        tm.optimizer * 1e3
                    );
                } else if tm.phased {
                    println!(
                        "step {:5}  loss {:.4}{local}  batch {:7.1} ms  backward {:7.1} ms (after the forward {:6.1} ms)  forward {:6.1} ms  optimizer {:5.1} ms",
                        s + 1,
                        r.loss,
                        tm.total * 1e3,
                        tm.backward * 1e3,
                        tm.backward_exposed * 1e3,
                        tm.forward * 1e3,
                        tm.optimizer * 1e3
                    );
                } else {
                    println!(
                        "step {:5}  loss {:.4}{local}  batch {:7.2} ms",
                        s + 1,
                        r.loss,
                        tm.total * 1e3
                    );
                }
            }
        }
        let acc = t.accuracy(&test)?;
        println!(
            "{mode}: test accuracy {:.2} % after {steps} steps ({:.2} epochs)",
            100.0 * acc,
            steps as f64 / t.steps_per_epoch(&train) as f64
        );
        rows.push(Summary {
            mode,
            steps,
            loss: last,
            accuracy: acc,
            total_ms: median(&total),
            backward_ms: median(&bwd),
            exposed_ms: median(&exposed),
        });
    }
    println!("\nmode          steps  last loss  test acc  batch ms  backward ms  after-forward ms  (medians; backward ms: - where not measured)");
    for r in &rows {
        let bwd = if r.backward_ms.is_nan() {
            "-".to_string()
        } else {
            format!("{:.1}", r.backward_ms)
        };
        println!(
            "{:<12} {:6}  {:9.4}  {:7.2} %  {:8.2}  {:>11}  {:16.2}",
            r.mode.as_str(),
            r.steps,
            r.loss,
            100.0 * r.accuracy,
            r.total_ms,
            bwd,
            r.exposed_ms
        );
    }
    if a.device == Device::Cpu {
        println!(
            "(CPU: launches run one at a time, so erase saves no time here; its backward after the forward shrinks to the output layer's, which is what overlaps on a GPU)"
        );
    }
    Ok(())
}

fn config(a: &Args, mode: Mode) -> Mlp30Config {
    Mlp30Config {
        mode,
        init: a.init,
        width: a.width,
        layers: a.layers,
        batch: a.batch,
    }
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum OccupancyArg {
    Auto,
    On,
    Off,
}

impl From<OccupancyArg> for erase::train::Occupancy {
    fn from(o: OccupancyArg) -> Self {
        match o {
            OccupancyArg::Auto => erase::train::Occupancy::Auto,
            OccupancyArg::On => erase::train::Occupancy::On,
            OccupancyArg::Off => erase::train::Occupancy::Off,
        }
    }
}
