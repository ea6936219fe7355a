//! `erase-ctr bench`: the three variants side by side, interleaved, in every dispatch mode asked for.

use anyhow::{bail, Context, Result};
use clap::Args;

use super::{open, write_trace_files, DeviceArg, DispatchArg, ModelArgs};
use crate::graph::OptimizerConfig;
use crate::model::ctr::Variant;

#[derive(Args)]
pub(crate) struct BenchArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Untimed steps per variant first.
    #[arg(long, default_value_t = 50)]
    warmup: usize,
    /// Timed steps per variant.
    #[arg(long, default_value_t = 200)]
    steps: usize,
    /// Steps of one variant before the next takes over.
    #[arg(long, default_value_t = 10, value_parser = super::at_least_one)]
    chunk: usize,
    /// Where to run (as for train).
    #[arg(long, value_enum, default_value = "auto")]
    device: DeviceArg,
    /// Dispatch modes to measure, comma separated (graph and threaded need a CUDA
    /// device; default: graph on a CUDA device, blocking on the CPU).
    #[arg(long, value_enum, value_delimiter = ',')]
    dispatch: Vec<DispatchArg>,
    /// Held-out examples for NE and AUC at the end.
    #[arg(long, default_value_t = 20_000)]
    eval_examples: usize,
    /// CPU threads (default: all cores; at least 1).
    #[arg(long, value_parser = super::at_least_one)]
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

pub(super) fn run(a: &BenchArgs) -> Result<()> {
    if a.steps == 0 {
        bail!("--steps must be at least 1");
    }
    if let Some(p) = &a.json {
        super::check_output("--json", p)?;
    }
    for (i, d) in a.dispatch.iter().enumerate() {
        if a.dispatch[..i].contains(d) {
            bail!(
                "--dispatch {} is given twice; name each mode once",
                crate::train::Dispatch::from(*d).as_str()
            );
        }
    }
    let model = a.model.synthetic_config(Variant::Erase)?;
    let dev = open(a.device, &a.model)?;
    if dev.is_none() && (a.kernels > 0 || a.trace_dir.is_some()) {
        bail!("--kernels and --trace-dir read the traced steps of a CUDA device; the CPU backend traces none (drop them, or run on a GPU)");
    }
    if let Some(dir) = &a.trace_dir {
        std::fs::create_dir_all(dir).with_context(|| format!("--trace-dir {}", dir.display()))?;
    }
    let threads = a
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let cfg = crate::bench::BenchConfig {
        model: model.clone(),
        variants: Variant::ALL.to_vec(),
        warmup: a.warmup,
        steps: a.steps,
        chunk: a.chunk,
        seed: 0,
        data_seed: 0,
        eval_examples: super::eval_count(a.eval_examples, model.batch)?,
        threads,
        schedule: a.model.schedule()?,
        optimizer: OptimizerConfig::default(),
        dispatch: if a.dispatch.is_empty() {
            // the fastest measured mode on a CUDA device; the CPU backend's only one
            vec![if dev.is_some() {
                crate::train::Dispatch::Graph
            } else {
                crate::train::Dispatch::Blocking
            }]
        } else {
            a.dispatch.iter().map(|&d| d.into()).collect()
        },
        trace_steps: if dev.is_some() { a.trace_steps } else { 0 },
        kernels: a.kernels,
    };
    let name = dev
        .as_ref()
        .map_or_else(|| format!("CPU ({threads} threads)"), |d| d.name.clone());
    eprintln!("erase-ctr bench on {name}: synthetic data (the spec's generator), {} warm-up + {} timed steps per variant, interleaved in chunks of {}", a.warmup, a.steps, a.chunk);
    if let Some(d) = dev.as_ref() {
        eprintln!(
            "  kernels: {:?} PTX, launched {}",
            d.target,
            d.pdl().describe()
        );
    }
    let mut rows = crate::bench::bench(&cfg, dev.as_ref(), &mut |m| eprintln!("  {m}"))?;
    // each variant's FLOPs from its own plan (the detached heads are work too)
    for v in Variant::ALL {
        let plan = crate::train::plan_step(
            &model.clone().with_variant(v),
            crate::graph::DType::F32,
            &OptimizerConfig::default(),
            &cfg.schedule,
        )?;
        let per = crate::train::step_flops(&plan) / model.batch as f64;
        for r in rows.iter_mut().filter(|r| r.variant == v) {
            r.flops_per_example = Some(per);
        }
    }
    print!(
        "{}",
        crate::bench::render(&rows, &name, model.batch, dev.is_some())
    );
    if let Some(p) = &a.json {
        std::fs::write(p, crate::bench::to_json(&rows))
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
