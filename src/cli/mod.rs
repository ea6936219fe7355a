//! The `erase-ctr` command line: the bundled CTR trainer. Trains the spec's reference
//! model (six dense subarchitectures over 26 embedding tables) as `baseline`, `detached`
//! or `erase`, evaluates checkpoints, benchmarks the variants and prints the ERASE step
//! plan. One file per subcommand; [`main`] is the whole program.

mod bench;
mod config;
mod data;
mod eval;
mod plan;
mod train;

use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::model::ctr::{CtrConfig, Variant};
use crate::runtime::program::occupancy::DeviceModel;
use crate::runtime::program::schedule::Priorities;
use crate::runtime::trace::Trace;
use crate::train::{Dispatch, ScheduleOptions};

use bench::BenchArgs;
use data::DataArgs;
use eval::EvalArgs;
use plan::PlanArgs;
use train::TrainArgs;

/// More pool streams than this buy nothing: a step has few blocks to overlap (the CTR
/// model six), and each stream costs the plan's printout and events.
const MAX_SIDE_STREAMS: usize = 32;

/// Checks, before a command does its work, that the file `flag` names can be written:
/// not a folder, in a folder that exists.
pub(super) fn check_output(flag: &str, path: &std::path::Path) -> Result<()> {
    if path.is_dir() {
        bail!("{flag} {} is a folder; give a file name", path.display());
    }
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(std::path::Path::new("."));
    if !dir.is_dir() {
        bail!(
            "{flag} {}: the folder {} does not exist",
            path.display(),
            dir.display()
        );
    }
    Ok(())
}

/// The held-out examples an evaluation reads for `--eval-examples n`: at least 2 (NE and
/// AUC need both classes), checked before any training. One process evaluates exactly
/// that many (or as many as there are); ranks evaluate whole global batches.
pub(super) fn eval_count(n: usize, batch: usize) -> Result<usize> {
    if n < 2 {
        bail!("--eval-examples {n} with --batch {batch}: NE and AUC need at least 2 held-out examples (both classes); ask for more");
    }
    Ok(n)
}

/// A count flag that must be at least 1 (`--threads 0` is a mistake, not "none").
fn at_least_one(s: &str) -> std::result::Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".to_string()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("not a count: {e}")),
    }
}

/// A positive, finite number of GB (`--rank-memory`), in bytes.
pub(super) fn gigabytes(v: &str) -> Result<u64, String> {
    match v.parse::<f64>() {
        Ok(x) if x > 0.0 && x.is_finite() => Ok((x * 1e9) as u64),
        _ => Err(format!("'{v}': expected a positive number of GB")),
    }
}

/// `--contention CC,CM,MM`: three finite numbers above -1.
fn contention_costs(v: &str) -> Result<[f64; 3], String> {
    let parts: Vec<&str> = v.split(',').map(str::trim).collect();
    let bad =
        || format!("'{v}': expected three costs CC,CM,MM (shares above -1, such as 0.05,-0.2,0)");
    if parts.len() != 3 {
        return Err(bad());
    }
    let mut out = [0.0; 3];
    for (o, p) in out.iter_mut().zip(&parts) {
        let x: f64 = p.parse().map_err(|_| bad())?;
        if !x.is_finite() || x <= -1.0 {
            return Err(bad());
        }
        *o = x;
    }
    Ok(out)
}

/// `--side-streams`: 1 to [`MAX_SIDE_STREAMS`].
fn side_stream_count(s: &str) -> std::result::Result<usize, String> {
    let n = at_least_one(s)?;
    if n > MAX_SIDE_STREAMS {
        return Err(format!(
            "at most {MAX_SIDE_STREAMS}: more pool streams than blocks to overlap buy nothing"
        ));
    }
    Ok(n)
}

#[derive(Parser)]
#[command(
    name = "erase-ctr",
    args_override_self = true,
    version,
    about = "Train a CTR model with early backward (ERASE), or print its step plan",
    long_about = "Train a CTR model (--model: the spec's, a bottom MLP, DLRM interaction, DCNv2 cross, \
AutoInt, deep MLP and MaskNet over 26 embedding tables, then a top MLP; or dlrm, dcnv2, \
deepfm, or your own) on synthetic data or your files, as one of three variants:\n\
  baseline  one graph, one backward at the end of the step\n\
  detached  each block cut off by a detach, with an auxiliary loss per block\n\
  erase     as detached, with each block's backward started early on a pool stream\n\n\
Runs on the CUDA device when there is one (graph dispatch, the fastest measured), else on the \
CPU backend."
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Train on synthetic data or your files (`--data`) and report loss, NE, AUC and examples per second.
    Train(Box<TrainArgs>),
    /// Evaluate a checkpoint: NE and AUC of its main logit on held-out data or a test file
    /// (and, with --predictions, each example's score).
    Eval(EvalArgs),
    /// Run baseline, detached and erase side by side (interleaved) and print QPS
    /// p50/p90, the gain over baseline, NE, AUC and the NE gap.
    Bench(BenchArgs),
    /// Inspect a data source: how fast it parses on 1, 2 and all cores, its fields, and
    /// (--counts) each field's distinct ids; or write a Criteo-layout file of any size.
    Data(DataArgs),
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
enum WeightCopiesArg {
    Update,
    Forward,
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

#[derive(Args, Clone)]
struct ModelArgs {
    /// A TOML file of settings: the keys of its [model] table, and [data]'s data,
    /// cache_dir, strict and data_seed, are flags of every command that has them; those of
    /// [train], [eval], [bench] and [plan] (and [data]'s others, for `data`) flags of that
    /// command alone (e.g. `[train] steps = 500`); flags given on the command line win.
    /// `[data.schema]` describes the columns of `--data tsv:PATH`.
    #[arg(long, value_name = "FILE")]
    config: Option<std::path::PathBuf>,
    /// The model: `spec` (the spec's six-block CTR model), `dlrm`, `dcnv2` (MLPerf's
    /// DLRM-DCNv2 shape), `deepfm`, or one of your own (see `erase::cli::main_with`).
    #[arg(long, value_name = "NAME")]
    model: Option<String>,
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
    /// H200, see docs/benchmarks-history.md).
    #[arg(long, default_value_t = 5, value_parser = side_stream_count)]
    side_streams: usize,
    /// The occupancy rule for launches that fill the device for long: `auto` (the
    /// default) orders one against the other streams only where the simulator predicts
    /// the step shorter for it, and chooses the streams' priorities (`plan` lists each
    /// constraint it kept, the priorities it tried and the predicted gains); `on` orders
    /// every such launch (the blunt rule: 16 % slower on the CTR model on an H200); `off`
    /// never. `on` and `off` run the ranked priorities unless --stream-priorities says
    /// otherwise.
    #[arg(long, value_enum, default_value = "auto")]
    occupancy: OccupancyArg,
    /// What the occupancy model charges two launches that oversubscribe the device for
    /// sharing it, as a share of their time one after the other: `CC,CM,MM` for two
    /// compute-bound launches, a compute- beside a memory-bound one, two memory-bound ones
    /// (default: the H200's, measured by `cargo bench --bench kernels -- --contention`).
    /// To see what `--occupancy auto` would choose on another device.
    #[arg(long, value_name = "CC,CM,MM", value_parser = contention_costs, allow_hyphen_values = true)]
    contention: Option<[f64; 3]>,
    /// The streams' priorities: `auto` (the default) lets the occupancy model choose
    /// (under `--occupancy auto`; `plan` prints what it tried); `ranked` is main, then the
    /// late stream, the pool, the weight-gradient companions (what `--occupancy off` and
    /// `on` run by default); `main-first` puts main above the side streams, which share one level;
    /// `flat` gives every stream one priority (2-3 % slower on an H200 at batch 4096).
    /// For comparison.
    #[arg(long, value_enum, default_value = "auto")]
    stream_priorities: PrioritiesArg,
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
    /// weight gradient does not): the block that ends last ends sooner (1.3 % faster on
    /// an H200, see docs/benchmarks-history.md). Only under ERASE.
    #[arg(long, value_enum, default_value = "on")]
    weight_grad_streams: OnOff,
    /// Each early block's own forward (its layers and its local loss head) on a forward
    /// stream of its own, at the main stream's priority: the blocks read the shared
    /// embeddings but not each other, so their forwards run side by side instead of one
    /// after the other on the main stream (2.9 % faster on an H200, see BENCHMARKS.md).
    /// `off`: the whole forward on the main stream, as the paper's schedule. Only under
    /// ERASE; the same bits either way.
    #[arg(long, value_enum, default_value = "on")]
    forward_streams: OnOff,
    /// `on`: every stream joins the main stream before the updates start (as a
    /// data-parallel step always does: it all-reduces there); `off`: each update waits
    /// only for the gradients it reads, and the embedding tables' update runs on the
    /// stream that wrote their gradient, beside the dense update (with the companions'
    /// lower priority, 0.9 % faster on an H200, see docs/benchmarks-history.md). Only under ERASE.
    #[arg(long, value_enum, default_value = "off")]
    update_join: OnOff,
    /// Round each large layer's GEMM operands (its input, its output's gradient) to bf16
    /// once, in a pass of their own that every GEMM reading them shares, instead of in
    /// each GEMM: the same values in fewer passes. CUDA only (the CPU's GEMMs are f32).
    #[arg(long, value_enum, default_value = "on")]
    bf16_copies: OnOff,
    /// Least FLOPs (2 x rows x inputs x outputs) of a layer given bf16 copies by
    /// --bf16-copies (its sizes must also be multiples of 64, at least 128).
    #[arg(long, value_name = "FLOPS", default_value_t = crate::train::BF16_COPY_MIN_FLOPS)]
    bf16_copy_min_flops: usize,
    /// Store the cross layers' up-projections (the factor of each cross update
    /// x0 * v + x) in bf16 where they take bf16 copies, as PyTorch's autocast stores a
    /// linear layer's output: their GEMMs store half the bytes and the updates read half,
    /// forward and backward; the values are rounded once. `off` keeps them in f32. CUDA
    /// only, with --bf16-copies on.
    #[arg(long, value_enum, default_value = "on")]
    bf16_storage: OnOff,
    /// With --bf16-storage on, each cross network's updates read x0 and the previous
    /// update from their bf16 copies (the ones its GEMMs read) and store the inner
    /// updates in bf16 (the last, the network's output, stays f32): half the bytes of the
    /// network's elementwise passes forward and backward (DCNv2's erase step 6.0 % and the spec
    /// model's 2.7 % faster on an H100), each update rounded once (PyTorch's
    /// autocast keeps them in f32; NE moved by at most 0.2 % on an H100). `off` keeps them in f32.
    #[arg(long, value_enum, default_value = "on")]
    bf16_cross: OnOff,
    /// With --bf16-cross on, the first cross layer's update (x0 * v + x0, x0 read from one
    /// copy) gets one gradient for x0: dy * v + dy in its gradient's pass, one tensor
    /// fewer for x0's sum to read (a pass over 4096 x 3456 f32 less on DCNv2). The same sum
    /// in another order. On an H100 the spec model's erase step 0.3 % faster, DCNv2's 1.8 %
    /// with --bf16-x0.
    #[arg(long, value_enum, default_value = "on")]
    cross_grad_fold: OnOff,
    /// With --bf16-cross on, DCNv2's concatenated fields (its cross network's x0, which
    /// only the network's bf16 layers read) stored in bf16 alone: the concat writes no
    /// f32 tensor (57 MB a step fewer at batch 4096). The same values. With
    /// --cross-grad-fold, DCNv2's erase step 1.8 % faster on an H100 (baseline 1.75 %).
    #[arg(long, value_enum, default_value = "on")]
    bf16_x0: OnOff,
    /// Fuse each cross update (x0 * v + x, the cross layers') with the linear layer that
    /// makes its factor v: on CUDA the GEMM's epilogue computes the update, one launch
    /// and one pass over v fewer. The same values either way. Off by default: on an H100
    /// it made the spec model's erase step 0.5 % faster at batch 4096, 1.2 % slower at
    /// 16384, and DCNv2's 0.45 % slower (the epilogue's extra traffic outweighs the pass).
    /// Only with --bf16-cross off (the fused epilogue reads f32 operands).
    #[arg(long, value_enum, default_value = "off")]
    fuse_cross_updates: OnOff,
    /// Where the weights' bf16 copies (of the layers --bf16-copies gives copies) are
    /// made: `update`: by Adam, beside each updated weight in the same pass, kept from one
    /// step to the next (no launch in the forward); `forward`: by a rounding launch each
    /// at the start of every step. The same bits either way.
    #[arg(long, value_enum, default_value = "update")]
    weight_copies: WeightCopiesArg,
    /// Rows of each categorical field's table, instead of --rows for all: a list in field
    /// order (`3,1000,100000,..`), `NAME=ROWS` pairs by column name (`C1=3,C7=1000`; the
    /// other fields keep --rows; Criteo's fields are C1..C26), or `auto`: each field's
    /// distinct ids in the training data, at most --rows-cap. In a config, a list or a
    /// `[model.table_rows]` table of NAME = ROWS.
    #[arg(long, value_name = "LIST|auto")]
    table_rows: Option<String>,
    /// With --table-rows auto: the most rows one table gets (default: --rows).
    #[arg(long, value_name = "N", value_parser = at_least_one)]
    rows_cap: Option<usize>,
    /// CUDA kernel paths to switch off, comma separated, to compare them on a model
    /// (default: every fast path); `plan` predicts the step with them too:
    /// `no-pipeline` (the GEMMs on the single-launch kernels, but for those that read
    /// bf16 operand copies, which only the pipelined kernels read: every GEMM with
    /// --bf16-copies off), `no-cluster` (split-K partials and a reduction launch instead of
    /// thread-block clusters), `no-tall` (no persistent tall GEMMs), `tall-store-direct`
    /// (the tall GEMMs store from registers), `no-node-priority` (captured graphs without
    /// stream priorities per node). The environment's ERASE_GEMM_PIPELINE=0,
    /// ERASE_GEMM_CLUSTER=0, ERASE_GEMM_TALL=0, ERASE_GEMM_TALL_STORE=direct and
    /// ERASE_GRAPH_NODE_PRIORITY=0 do the same.
    #[arg(long, value_enum, value_delimiter = ',', value_name = "LIST")]
    kernel_paths: Vec<KernelPath>,
}

/// A CUDA kernel path `--kernel-paths` switches off (or on, for `tall-store-direct`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum KernelPath {
    NoPipeline,
    NoCluster,
    NoTall,
    TallStoreDirect,
    NoNodePriority,
}

/// The table sizes `spec` (--table-rows) gives fields named `names`, where every other
/// field has `rows`; `counts` (distinct ids per field) are asked for only by `auto`.
fn table_rows(
    spec: &str,
    names: &[String],
    rows: usize,
    cap: usize,
    counts: impl FnOnce() -> Result<Vec<usize>>,
) -> Result<Vec<usize>> {
    if spec.trim() == "auto" {
        return Ok(counts()?.into_iter().map(|n| n.clamp(1, cap)).collect());
    }
    let parts: Vec<&str> = spec.split(',').map(str::trim).collect();
    if parts.iter().all(|p| !p.contains('=')) {
        let sizes: Vec<usize> = parts
            .iter()
            .map(|p| at_least_one(p).map_err(|e| anyhow::anyhow!("--table-rows: '{p}' {e}")))
            .collect::<Result<_>>()?;
        if sizes.len() != names.len() {
            bail!(
                "--table-rows gives {} sizes, the data has {} categorical fields ({}); give one per field, or NAME=ROWS pairs",
                sizes.len(),
                names.len(),
                names.join(", ")
            );
        }
        return Ok(sizes);
    }
    let mut sizes = vec![rows; names.len()];
    let mut given = vec![false; names.len()];
    for p in parts {
        let Some((name, n)) = p.split_once('=') else {
            bail!("--table-rows: '{p}' is not NAME=ROWS (a list cannot mix both forms)");
        };
        let (name, n) = (name.trim(), n.trim());
        let j = names.iter().position(|c| c == name).ok_or_else(|| {
            anyhow::anyhow!(
                "--table-rows: '{name}' is not a categorical field (fields: {})",
                names.join(", ")
            )
        })?;
        if std::mem::replace(&mut given[j], true) {
            bail!("--table-rows: '{name}' is given twice");
        }
        sizes[j] = at_least_one(n).map_err(|e| anyhow::anyhow!("--table-rows: {name}={n}: {e}"))?;
    }
    Ok(sizes)
}

/// Prints the embedding tables' sizes and memory.
fn print_tables(model: &CtrConfig, how: &str, names: &[String]) {
    let rows = model.field_rows();
    let (w, acc) = model.table_bytes();
    let shown: Vec<String> = names
        .iter()
        .zip(&rows)
        .take(8)
        .map(|(n, r)| format!("{n} {r}"))
        .collect();
    let detail = if shown.is_empty() {
        String::new()
    } else {
        format!(
            " ({how}{}{})",
            shown.join(", "),
            if rows.len() > 8 { ", .." } else { "" }
        )
    };
    eprintln!(
        "tables: {} fields, {} rows in all{detail}, dim {}: {:.1} MB, {:.1} MB with the Adagrad state",
        rows.len(),
        rows.iter().sum::<usize>(),
        model.dim,
        w as f64 / 1e6,
        (w + acc) as f64 / 1e6
    );
}

/// Distinct ids per field of `train`, from the sidecar of the data cache when it was
/// counted for the same content before (`<cache>.counts`), else counted and kept there.
fn distinct_counts(
    train: &crate::data::Examples,
    cache: Option<&std::path::Path>,
) -> Result<Vec<usize>> {
    let sidecar = cache.map(|c| {
        let mut p = c.as_os_str().to_os_string();
        p.push(".counts");
        std::path::PathBuf::from(p)
    });
    let digest = format!("{:016x}", train.digest());
    if let Some(text) = sidecar
        .as_ref()
        .and_then(|p| std::fs::read_to_string(p).ok())
    {
        let mut lines = text.lines();
        if lines.next() == Some(digest.as_str()) {
            let counts: Vec<usize> = lines.filter_map(|l| l.trim().parse().ok()).collect();
            if counts.len() == train.num_sparse {
                return Ok(counts);
            }
        }
    }
    let counts = train.distinct_ids();
    if let Some(p) = &sidecar {
        let text = std::iter::once(digest)
            .chain(counts.iter().map(|c| c.to_string()))
            .collect::<Vec<_>>()
            .join("\n");
        // a cache that cannot be written costs a recount next time, nothing more
        let tmp = p.with_extension(format!("counts.tmp.{}", std::process::id()));
        if std::fs::write(&tmp, text + "\n").is_ok() && std::fs::rename(&tmp, p).is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
    }
    Ok(counts)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum OccupancyArg {
    Auto,
    On,
    Off,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum PrioritiesArg {
    Auto,
    Ranked,
    MainFirst,
    Flat,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum UpdateArg {
    End,
    Early,
}

impl ModelArgs {
    /// The plan options: the environment's overrides, then `--kernel-paths`.
    fn plan_options(&self) -> Result<crate::ops::cuda::PlanOptions> {
        let mut o = crate::ops::cuda::PlanOptions::H200
            .with_env(|k| std::env::var(k).ok())
            .map_err(anyhow::Error::msg)?;
        for p in &self.kernel_paths {
            match p {
                KernelPath::NoPipeline => o.gemm_pipeline = false,
                KernelPath::NoCluster => o.gemm_cluster = false,
                KernelPath::NoTall => o.gemm_tall = false,
                KernelPath::TallStoreDirect => o.gemm_tall_store_direct = true,
                KernelPath::NoNodePriority => o.graph_node_priority = false,
            }
        }
        Ok(o)
    }

    /// These arguments with the other preset (`small` for `spec` and back).
    fn with_other_preset(&self) -> ModelArgs {
        ModelArgs {
            preset: match self.preset {
                Preset::Small => Preset::Spec,
                Preset::Spec => Preset::Small,
            },
            ..self.clone()
        }
    }

    fn preset_name(&self) -> &'static str {
        match self.preset {
            Preset::Small => "small",
            Preset::Spec => "spec",
        }
    }

    fn config(&self, variant: Variant) -> Result<CtrConfig> {
        let mut c = match self.preset {
            Preset::Small => CtrConfig::small(),
            Preset::Spec => CtrConfig::default(),
        };
        c.variant = variant;
        let name = self
            .model
            .clone()
            .or_else(|| DEFAULT_MODEL.get().cloned())
            .unwrap_or_else(|| "spec".to_string());
        c = crate::model::api::configure(&name, c, self.preset == Preset::Spec)
            .context("--model")?;
        if let Some(b) = self.batch {
            c.batch = b;
        }
        if let Some(r) = self.rows {
            c.rows = r;
        }
        c.validate()
            .context("invalid model size (see --preset, --batch, --rows)")?;
        Ok(c)
    }

    /// [`ModelArgs::config`] with the table sizes of --table-rows, for synthetic data
    /// (its fields are named C1..Cn): what `train` without --data, `plan` and `bench` run.
    fn synthetic_config(&self, variant: Variant) -> Result<CtrConfig> {
        self.check_rows_cap()?;
        let mut model = self.config(variant)?;
        if let Some(spec) = &self.table_rows {
            if spec.trim() == "auto" {
                bail!("--table-rows auto counts ids in the data; synthetic data has none to count (give sizes; `train` and `eval` count them in their --data)");
            }
            let names: Vec<String> = (1..=model.num_sparse).map(|j| format!("C{j}")).collect();
            model.table_rows = table_rows(spec, &names, model.rows, model.rows, || Ok(vec![]))?;
            model.validate().context("--table-rows")?;
            // once, though `plan` and `bench` ask for each variant's model
            static SHOWN: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
            if !SHOWN.swap(true, std::sync::atomic::Ordering::Relaxed) {
                print_tables(&model, "given: ", &names);
            }
        }
        Ok(model)
    }

    /// --rows-cap bounds the sizes --table-rows auto counts; with any other sizes it
    /// would do nothing.
    fn check_rows_cap(&self) -> Result<()> {
        let auto = self
            .table_rows
            .as_deref()
            .is_some_and(|s| s.trim() == "auto");
        if let (Some(cap), false) = (self.rows_cap, auto) {
            bail!("--rows-cap {cap} bounds the sizes of --table-rows auto, which is not given; drop it, or use --table-rows auto with the --data of `train` or `eval`");
        }
        Ok(())
    }

    /// The schedule the flags ask for; its cost model plans the launches with
    /// `--kernel-paths` (and the environment's overrides).
    fn schedule(&self) -> Result<ScheduleOptions> {
        if self.fuse_cross_updates == OnOff::On
            && self.bf16_cross == OnOff::On
            && self.bf16_storage == OnOff::On
        {
            bail!("--fuse-cross-updates on fuses cross updates of f32 operands, and --bf16-cross on (the default) reads them from their bf16 copies: add --bf16-cross off to fuse them");
        }
        Ok(ScheduleOptions {
            side_streams: self.side_streams,
            occupancy: match self.occupancy {
                OccupancyArg::Off => crate::train::Occupancy::Off,
                OccupancyArg::On => crate::train::Occupancy::On,
                OccupancyArg::Auto => crate::train::Occupancy::Auto,
            },
            device: DeviceModel {
                contention: self
                    .contention
                    .unwrap_or(crate::runtime::program::occupancy::H200_CONTENTION),
                ..DeviceModel::h200()
            },
            early_updates: self.optimizer_update == UpdateArg::Early,
            late_stream: self.late_stream == OnOff::On,
            weight_grad_streams: self.weight_grad_streams == OnOff::On,
            forward_streams: self.forward_streams == OnOff::On,
            updates_by_data: self.update_join == OnOff::Off,
            priorities: match self.stream_priorities {
                PrioritiesArg::Auto => None,
                PrioritiesArg::Ranked => Some(Priorities::RANKED),
                PrioritiesArg::MainFirst => Some(Priorities::MAIN_FIRST),
                PrioritiesArg::Flat => Some(Priorities::FLAT),
            },
            bf16_copies: self.bf16_copies == OnOff::On,
            bf16_copy_min_flops: self.bf16_copy_min_flops,
            weight_copies_in_update: self.weight_copies == WeightCopiesArg::Update,
            plan_options: Some(self.plan_options()?),
            bf16_storage: self.bf16_storage == OnOff::On,
            bf16_cross: self.bf16_cross == OnOff::On,
            cross_grad_fold: self.cross_grad_fold == OnOff::On,
            bf16_x0: self.bf16_x0 == OnOff::On,
            fuse_cross_updates: self.fuse_cross_updates == OnOff::On,
        })
    }
}

/// The model sized for the data, and the data: synthetic, or loaded (with a held-out
/// part) from `--data criteo:PATH | tsv:PATH`.
/// The share of a source's examples held out for evaluation where the source does not
/// split them itself: the schema's eval_fraction, a tenth of Criteo data.
fn held_out_fraction(src: &crate::data::DataSource) -> f64 {
    match src {
        crate::data::DataSource::Tsv { schema, .. } => schema.eval_fraction,
        crate::data::DataSource::Criteo { .. } => 0.1,
    }
}

fn model_and_data(
    m: &ModelArgs,
    variant: Variant,
    data: &str,
    strict: bool,
    cache_dir: Option<&std::path::Path>,
    threads: Option<usize>,
    whole: bool,
) -> Result<(CtrConfig, crate::train::Data)> {
    let schema = match &m.config {
        Some(p) => {
            let text =
                std::fs::read_to_string(p).with_context(|| format!("--config {}", p.display()))?;
            let table: toml::Table = text
                .parse()
                .with_context(|| format!("{} is not valid TOML", p.display()))?;
            match table.get("data").and_then(|d| d.get("schema")) {
                Some(_) => Some(
                    crate::data::TsvSchema::from_toml(&text)
                        .with_context(|| format!("{}: [data.schema]", p.display()))?,
                ),
                None => None,
            }
        }
        None => None,
    };
    let source = crate::data::parse_data_arg(data, schema.as_ref()).context("--data")?;
    if let (Some(crate::data::DataSource::Criteo { .. }), Some(_), Some(p)) =
        (&source, &schema, &m.config)
    {
        bail!(
            "{}: [data.schema] describes the columns of tsv: data, but --data {data} has \
             Criteo's fixed layout; use --data tsv:PATH, or drop [data.schema]",
            p.display()
        );
    }
    m.check_rows_cap()?;
    let Some(src) = source else {
        return Ok((m.synthetic_config(variant)?, crate::train::Data::Synthetic));
    };
    let mut model = m.config(variant)?;
    if let Some(p) = cache_dir.filter(|p| p.exists() && !p.is_dir()) {
        bail!(
            "--cache-dir {} is a file; the cache is a folder (created if absent)",
            p.display()
        );
    }
    let opts = crate::data::LoadOptions {
        strict,
        cache_dir: cache_dir.map(|p| p.to_path_buf()),
        threads,
        stream: None,
        progress: true,
    };
    let t0 = std::time::Instant::now();
    let (train, eval, report) = crate::data::load(&src, &opts)?;
    eprintln!("{report}");
    eprintln!(
        "loaded {} training examples in {:.1} s",
        train.len(),
        t0.elapsed().as_secs_f64()
    );
    let (train, eval) = match eval {
        Some(_) if whole => bail!(
            "--examples all: {data} splits its examples itself ([data.schema]'s time column); evaluate its held-out part (--examples held-out), or drop `time` from the schema to read the file in order"
        ),
        // every example, in the order read: a test file of its own (`eval --examples all`)
        None if whole => {
            let all = std::sync::Arc::new(train);
            (all.clone(), all)
        }
        Some(e) => (std::sync::Arc::new(train), std::sync::Arc::new(e)),
        None => {
            // no split in the source: hold out the last lines read (a tenth, or the
            // schema's eval_fraction)
            let fraction = held_out_fraction(&src);
            let (tr, ev) = train.split_tail(fraction).with_context(|| {
                format!("holding out {fraction} of the examples for evaluation")
            })?;
            (std::sync::Arc::new(tr), std::sync::Arc::new(ev))
        }
    };
    let parts: &[(&str, &std::sync::Arc<crate::data::Examples>)] = if whole {
        &[("", &eval)]
    } else {
        &[("training ", &train), ("held-out ", &eval)]
    };
    for &(what, ex) in parts {
        let rate = ex.positive_rate();
        if rate == 0.0 || rate == 1.0 {
            bail!(
                "{data}: all {} {what}examples are {}{}: a model cannot learn, nor NE be measured, on one class (does the label need label_threshold in [data.schema]?)",
                ex.len(),
                if rate == 1.0 { "positive" } else { "negative" },
                if report.malformed > 0 {
                    format!(" ({} malformed lines were skipped; first: {})", report.malformed, report.first_errors.first().map_or("", String::as_str))
                } else {
                    String::new()
                }
            );
        }
    }
    model.num_dense = train.num_dense;
    model.num_sparse = train.num_sparse;
    model.hot = 1;
    if let crate::data::DataSource::Tsv { schema, .. } = &src {
        if !schema.mean.is_empty() {
            model.mean_fields = schema
                .categorical
                .iter()
                .map(|c| schema.mean.contains(c))
                .collect();
        }
    }
    if train.is_multi_hot() {
        // each field's bag gets as many slots as its longest list, train or held-out
        let (a, b) = (train.max_bag_lens(), eval.max_bag_lens());
        model.field_hot = a.iter().zip(&b).map(|(&x, &y)| x.max(y)).collect();
        eprintln!(
            "multi-hot fields: bag slots per field {:?} ({} id slots an example)",
            model.field_hot,
            model.field_hot.iter().sum::<usize>()
        );
    }
    let names: Vec<String> = match &src {
        crate::data::DataSource::Tsv { schema, .. } => schema.categorical.clone(),
        crate::data::DataSource::Criteo { .. } => {
            (1..=model.num_sparse).map(|j| format!("C{j}")).collect()
        }
    };
    if let Some(spec) = &m.table_rows {
        let cap = m.rows_cap.unwrap_or(model.rows);
        let t0 = std::time::Instant::now();
        model.table_rows = table_rows(spec, &names, model.rows, cap, || {
            distinct_counts(&train, report.cache_path.as_deref())
        })?;
        let how = if spec.trim() == "auto" {
            format!(
                "counted in {:.1} s, at most {cap}: ",
                t0.elapsed().as_secs_f64()
            )
        } else {
            "given: ".to_string()
        };
        model.validate().context("--table-rows")?;
        print_tables(&model, &how, &names);
    } else {
        print_tables(&model, "", &[]);
    }
    model.validate().context("the model for this data")?;
    if whole {
        eprintln!(
            "data: {} examples, {} dense and {} categorical fields, {:.2} % positive",
            eval.len(),
            eval.num_dense,
            eval.num_sparse,
            100.0 * eval.positive_rate()
        );
    } else {
        eprintln!(
            "data: {} train / {} held-out examples, {} dense and {} categorical fields, {:.2} % positive",
            train.len(),
            eval.len(),
            train.num_dense,
            train.num_sparse,
            100.0 * train.positive_rate()
        );
    }
    Ok((
        model,
        crate::train::Data::Table {
            train,
            eval,
            source: data.to_string(),
        },
    ))
}

/// The device `device` asks for (none: the CPU), its plans following `m`'s options.
fn open(device: DeviceArg, m: &ModelArgs) -> Result<Option<crate::runtime::cuda::CudaDevice>> {
    let plan = m.plan_options()?;
    let mut dev = match device {
        DeviceArg::Cpu => None,
        DeviceArg::Cuda => Some(crate::gpu::open_device().context("--device cuda")?),
        DeviceArg::Auto => match crate::gpu::open_device() {
            Ok(d) => Some(d),
            Err(e) => {
                eprintln!("erase-ctr: no usable CUDA device ({e:#}); running on the CPU");
                None
            }
        },
    };
    if let Some(d) = dev.as_mut() {
        d.set_plan_options(plan);
    }
    Ok(dev)
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
fn print_overlap(what: &str, o: &crate::runtime::trace::Overlap) {
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

/// The model `--model` defaults to (set by [`main_with`]).
static DEFAULT_MODEL: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// The whole `erase-ctr` command line (train, eval, bench, plan, data) for a model of
/// your own: it is registered under its name and is the default `--model`.
///
/// ```no_run
/// # use std::sync::Arc;
/// # struct MyModel;
/// # impl erase::model::api::Model for MyModel {
/// #     fn name(&self) -> &str { "mine" }
/// #     fn build(&self, g: &mut erase::graph::Graph, x: &erase::model::api::ModelInputs,
/// #              _: &erase::model::ctr::CtrConfig, _: &mut erase::model::api::Blocks)
/// #              -> anyhow::Result<erase::graph::Tensor> {
/// #         let f = g.flatten(x.fields)?; let y = g.linear(f, 1)?; Ok(g.reshape(y, &[x.batch])?)
/// #     }
/// # }
/// fn main() -> std::process::ExitCode {
///     erase::cli::main_with(Arc::new(MyModel))
/// }
/// ```
pub fn main_with(model: std::sync::Arc<dyn crate::model::api::Model>) -> ExitCode {
    let _ = DEFAULT_MODEL.set(model.name().to_string());
    if let Err(e) = crate::model::api::register(model) {
        eprintln!("erase-ctr: error: {e:#}");
        return ExitCode::FAILURE;
    }
    main()
}

/// The `erase-ctr` program: parses the command line (after `--config` expansion) and
/// runs the subcommand; errors are printed, and make the exit code 1.
pub fn main() -> ExitCode {
    let expanded = match config::expand_config(std::env::args_os().collect()) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("erase-ctr: error: {e:#}");
            return ExitCode::FAILURE;
        }
    };
    // clap prints --help, --version and usage errors itself (and exits)
    let cli = Cli::parse_from(expanded.args.clone());
    for n in &expanded.notes {
        eprintln!("erase-ctr: note: {n}");
    }
    match dispatch(&cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.downcast_ref::<crate::interrupt::Interrupted>().is_some() => {
            eprintln!("erase-ctr: {e:#}");
            ExitCode::from(130)
        }
        Err(e) => {
            eprintln!("erase-ctr: error: {}", expanded.annotate(format!("{e:#}")));
            ExitCode::FAILURE
        }
    }
}

/// The program on `args` (the program name first), as a value: what [`main`] does, with
/// usage errors returned instead of printed (for tests and embedding).
pub fn run(args: Vec<std::ffi::OsString>) -> Result<()> {
    let expanded = config::expand_config(args)?;
    let cli = Cli::try_parse_from(expanded.args.clone()).map_err(|e| anyhow::anyhow!("{e}"))?;
    for n in &expanded.notes {
        eprintln!("erase-ctr: note: {n}");
    }
    dispatch(&cli).map_err(|e| anyhow::anyhow!("{}", expanded.annotate(format!("{e:#}"))))
}

fn dispatch(cli: &Cli) -> Result<()> {
    match &cli.cmd {
        Cmd::Train(a) => train::run(a),
        Cmd::Plan(a) => plan::run(a),
        Cmd::Bench(a) => bench::run(a),
        Cmd::Eval(a) => eval::run(a),
        Cmd::Data(a) => data::run(a),
    }
}
