//! `erase-ctr eval`: NE and AUC of a checkpoint on held-out data or a test file, and each
//! example's prediction.

use anyhow::{bail, Context, Result};
use clap::Args;

use super::{model_and_data, open, DeviceArg, ModelArgs, VariantArg};
use crate::graph::OptimizerConfig;
use crate::model::ctr::Variant;
use crate::train::{plan_step, Dispatch};

#[derive(Args)]
pub(crate) struct EvalArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The checkpoint to evaluate (written by `train --checkpoint`).
    #[arg(long, value_name = "FILE")]
    checkpoint: std::path::PathBuf,
    /// The variant the checkpoint was trained as (default: the one it records).
    #[arg(long, value_enum)]
    variant: Option<VariantArg>,
    /// Held-out data, as for train (for synthetic: stream 2 of --data-seed).
    #[arg(long, default_value = "synthetic")]
    data: String,
    /// Seed of the synthetic data (default: the one the checkpoint records; another seed
    /// draws examples of another distribution).
    #[arg(long)]
    data_seed: Option<u64>,
    /// Stop at the first malformed line.
    #[arg(long)]
    strict: bool,
    /// Keep a binary cache of parsed data here.
    #[arg(long, value_name = "DIR")]
    cache_dir: Option<std::path::PathBuf>,
    /// Which examples of --data to evaluate: `held-out`, the part train holds out of the
    /// same data (its last tenth, or the split [data.schema] gives), or `all`, every
    /// example in the order read: a test file of its own, such as Criteo's last day.
    #[arg(long, value_enum, default_value = "held-out")]
    examples: ExamplesArg,
    /// Examples to evaluate, from the first (at least 2: NE and AUC need both classes).
    /// Default: 20000 of the held-out part, or with `--examples all` every one.
    #[arg(long)]
    eval_examples: Option<usize>,
    /// Where to run.
    #[arg(long, value_enum, default_value = "auto")]
    device: DeviceArg,
    /// CPU threads (default: all cores; at least 1).
    #[arg(long, value_parser = super::at_least_one)]
    threads: Option<usize>,
    /// Also write each evaluated example's prediction to this file (tab-separated, a
    /// header line, then one line an example in the order evaluated: its index, its
    /// label, the model's logit and its probability, the logit's sigmoid), for metrics of
    /// your own. Written whole or not at all; a link there keeps pointing at it.
    #[arg(long, value_name = "FILE")]
    predictions: Option<std::path::PathBuf>,
}

/// Which examples `eval` reads.
#[derive(Clone, Copy, clap::ValueEnum, PartialEq, Eq)]
enum ExamplesArg {
    HeldOut,
    All,
}

pub(super) fn run(a: &EvalArgs) -> Result<()> {
    let whole = a.examples == ExamplesArg::All;
    if whole && a.data.trim() == "synthetic" {
        bail!("--examples all reads a data file in full; synthetic data has no end (its held-out stream is --examples held-out, the default)");
    }
    let predictions = a
        .predictions
        .as_deref()
        .map(Predictions::create)
        .transpose()?;
    let dev = open(a.device, &a.model)?;
    let recorded = crate::checkpoint::peek(&a.checkpoint)?;
    let variant = match (a.variant, recorded.get("variant")) {
        (Some(v), _) => Variant::from(v),
        (None, Some(v)) => v
            .parse()
            .with_context(|| format!("{}: the variant it records", a.checkpoint.display()))?,
        (None, None) => Variant::Erase,
    };
    // trained on data files: synthetic data (the default) would score it on examples of
    // another distribution
    if let Some(trained_on) = recorded.get("data").filter(|d| *d != "synthetic") {
        if a.data.trim() == "synthetic" {
            bail!(
                "{} was trained on data files ({trained_on}), and this would evaluate it on synthetic data; pass its held-out data with --data (as given to train, e.g. --data criteo:PATH)",
                a.checkpoint.display()
            );
        }
    }
    // synthetic data: the seed it was trained on, where none is given
    let recorded_seed = recorded
        .get("data_seed")
        .and_then(|v| v.parse::<u64>().ok());
    let data_seed = match (a.data_seed, recorded_seed) {
        (Some(s), Some(r)) if s != r && a.data.trim() == "synthetic" => {
            eprintln!(
                "eval: {} was trained on the synthetic data of seed {r}; --data-seed {s} draws examples of another distribution",
                a.checkpoint.display()
            );
            s
        }
        (Some(s), _) => s,
        (None, r) => r.unwrap_or(0),
    };
    // the sizes the checkpoint records, where the command line gives none
    let mut m = a.model.clone();
    let recorded_size = |key: &str| recorded.get(key).and_then(|v| v.parse::<usize>().ok());
    m.batch = m.batch.or_else(|| recorded_size("model.batch"));
    m.rows = m.rows.or_else(|| recorded_size("model.rows"));
    // the model it records (`"dlrm"`), where none is given
    m.model = m.model.or_else(|| {
        recorded
            .get("model.model")
            .map(|v| v.trim_matches('"').to_string())
    });
    // per-field table sizes as recorded (`[3, 1000, ..]`), where none are given
    if m.table_rows.is_none() {
        m.table_rows = recorded
            .get("model.table_rows")
            .map(|v| v.trim_matches(|c| c == '[' || c == ']').replace(' ', ""))
            .filter(|v| !v.is_empty());
    }
    // the other preset, where the flags' preset builds another model and it builds the
    // checkpoint's (a checkpoint of `--preset spec` evaluated without the flag)
    if let Ok(c) = m.synthetic_config(variant) {
        if check_same_model(&a.checkpoint, &recorded.identity, &c).is_err() {
            let other = m.with_other_preset();
            if other
                .synthetic_config(variant)
                .is_ok_and(|c| check_same_model(&a.checkpoint, &recorded.identity, &c).is_ok())
            {
                eprintln!(
                    "eval: {} records the sizes of --preset {}; evaluating with them",
                    a.checkpoint.display(),
                    other.preset_name()
                );
                m = other;
            }
        }
    }
    let (model, data) = model_and_data(
        &m,
        variant,
        &a.data,
        a.strict,
        a.cache_dir.as_deref(),
        a.threads,
        whole,
    )?;
    check_same_model(&a.checkpoint, &recorded.identity, &model)?;
    let threads = a
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let plan = plan_step(
        &model,
        crate::graph::DType::F32,
        &OptimizerConfig::default(),
        &m.schedule()?,
    )?;
    let mut s = crate::train::Session::with_dispatch(
        &plan,
        dev.as_ref(),
        Dispatch::Blocking,
        &data,
        0,
        data_seed,
        threads,
    )?;
    let step = s.load_weights(&a.checkpoint)?;
    // progress on stderr every few seconds: a large --eval-examples takes minutes on a CPU
    let t0 = std::time::Instant::now();
    let mut last = t0;
    let (e, scored) = s.evaluate_scored(
        super::eval_count(
            match (a.eval_examples, &data) {
                (Some(n), _) => n,
                (None, crate::train::Data::Table { eval, .. }) if whole => eval.len(),
                (None, _) => 20_000,
            },
            model.batch,
        )?,
        &mut |done, total| {
            let now = std::time::Instant::now();
            if now.duration_since(last).as_secs_f64() >= 5.0 {
                last = now;
                let secs = now.duration_since(t0).as_secs_f64();
                let rate = done as f64 / secs.max(1e-9);
                eprintln!(
                    "eval: {done} of {total} examples, {:.0} a second, about {:.0} s left",
                    rate,
                    (total - done) as f64 / rate.max(1e-9)
                );
            }
        },
    )?;
    println!(
        "{}: step {step}, NE {:.4}, AUC {:.4} on {} {}",
        a.checkpoint.display(),
        e.ne,
        e.auc,
        e.examples,
        if whole {
            "examples (--examples all: the data from its start)"
        } else {
            "held-out examples"
        }
    );
    if let Some(p) = predictions {
        let shown = p.shown.clone();
        p.finish(&scored)?;
        println!(
            "predictions of the {} examples: {}",
            e.examples,
            shown.display()
        );
    }
    Ok(())
}

/// `--predictions`: its temporary file, created beside the target before the evaluation
/// (an unwritable folder fails then, not after it), written and renamed onto the target
/// (a link there keeps pointing at it) when whole; removed if the evaluation fails.
struct Predictions {
    shown: std::path::PathBuf,
    target: std::path::PathBuf,
    tmp: std::path::PathBuf,
    file: Option<std::fs::File>,
}

impl Predictions {
    fn create(path: &std::path::Path) -> Result<Predictions> {
        let target = crate::checkpoint::target_file("--predictions", path)?;
        let name = target
            .file_name()
            .map_or("predictions".into(), |n| n.to_string_lossy().into_owned());
        let tmp = target.with_file_name(format!(".{name}.tmp-{}", std::process::id()));
        let file = std::fs::File::create(&tmp).with_context(|| {
            format!(
                "--predictions {}: cannot create a file in its folder",
                path.display()
            )
        })?;
        Ok(Predictions {
            shown: path.to_path_buf(),
            target,
            tmp,
            file: Some(file),
        })
    }

    /// Writes `scored` under a header, one line an example: its index in the order
    /// evaluated (0 first; lines skipped as malformed are not counted), its label, the
    /// logit and its sigmoid, in the shortest form that reads back to the same f64.
    fn finish(mut self, scored: &crate::train::Scored) -> Result<()> {
        use std::io::Write as _;
        let Some(file) = self.file.take() else {
            bail!("--predictions {}: written already", self.shown.display());
        };
        let write = || -> std::io::Result<()> {
            let mut f = std::io::BufWriter::new(file);
            writeln!(f, "example\tlabel\tlogit\tprobability")?;
            for (i, (&z, &y)) in scored.logits.iter().zip(&scored.labels).enumerate() {
                writeln!(f, "{i}\t{y}\t{z}\t{}", 1.0 / (1.0 + (-z).exp()))?;
            }
            f.into_inner().map_err(|e| e.into_error())?.sync_all()?;
            std::fs::rename(&self.tmp, &self.target)
        };
        write().with_context(|| format!("--predictions {}", self.shown.display()))
    }
}

impl Drop for Predictions {
    fn drop(&mut self) {
        // unfinished (an error on the way, or the rename failed): no stray temporary file
        let _ = std::fs::remove_file(&self.tmp);
    }
}

/// The model's settings that change what a checkpoint's parameters compute; the batch,
/// the variant (its own flag), the bag slots (the held-out data's longest lists) and the
/// auxiliary losses' weight may differ between training and evaluation.
const SAME_MODEL: [&str; 17] = [
    "model.model",
    "model.num_dense",
    "model.num_sparse",
    "model.rows",
    "model.table_rows",
    "model.mean_fields",
    "model.dim",
    "model.bottom",
    "model.interaction",
    "model.cross_rank",
    "model.cross_layers",
    "model.autoint_layers",
    "model.heads",
    "model.head_dim",
    "model.deep",
    "model.masknet_hidden",
    "model.top",
];

/// Refuses to evaluate a checkpoint with a model other than the one it was trained as
/// (another pooling of a field computes other values from the same parameters), naming
/// each setting that differs. A checkpoint that records none of them is not checked.
fn check_same_model(
    path: &std::path::Path,
    recorded: &[(String, String)],
    model: &crate::model::ctr::CtrConfig,
) -> Result<()> {
    let keep = |v: &[(String, String)]| -> Vec<(String, String)> {
        v.iter()
            .filter(|(k, _)| SAME_MODEL.contains(&k.as_str()))
            .cloned()
            .collect()
    };
    let was = keep(recorded);
    if was.is_empty() {
        return Ok(());
    }
    let now = keep(&crate::checkpoint::flatten_debug(
        "model",
        &format!("{model:?}"),
    ));
    let diff = crate::checkpoint::identity_diff(&was, &now);
    if !diff.is_empty() {
        anyhow::bail!(
            "{} was trained with another model than this command builds; pass the flags and config it was trained with:\n  {}",
            path.display(),
            diff.join("\n  ")
        );
    }
    Ok(())
}
