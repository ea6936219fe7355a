//! The reference CTR model ("erase-ctr", `shared/spec/ctr-model.md`), written against the
//! graph DSL. The PyTorch anchor `shared/anchors/torch_ctr.py` is the definition: the
//! classes `Bottom`, `Interaction`, `Cross`, `AutoInt`, `Deep`, `MaskNet`, `CTRModel` and
//! `Trainer.forward_backward` (which fixes exactly what the `detached` variant cuts).
//!
//! ```text
//! pooled = embedding_bag(tables, ids, offsets)            [B, 26, D]
//! b      = bottom(dense)                                  [B, D]       (block 0)
//! E      = concat(pooled, b')                             [B, 27, D]   b' = detach(b) when detached
//! o_k    = block_k(E), k = 1..5                           [B, D]
//! logit  = top(concat(o_1' .. o_5', b'))                  [B]          o' = detach(o) when detached
//! main   = bce(logit, label)
//! aux_k  = bce(head_k(o_k), label), k = 0..5              (detached / erase only)
//! ```
//!
//! Every block's nodes are built inside `g.scoped(BLOCKS[k], ..)`, the top inside
//! `"top"`, aux head `k` inside `"{BLOCKS[k]}_head"`, and the lookup and `E` inside
//! `"embedding"`, so node names say which block they belong to. Parameters are created
//! explicitly: the stacked table first, then the dense ones in PyTorch's
//! `model.parameters()` order (heads last), so the variants share the position, and so
//! the default init, of every shared parameter; [`CtrModel::params`] lists the dense ones
//! with PyTorch's names.

use std::fmt;
use std::str::FromStr;

use anyhow::{anyhow, bail, ensure, Context, Result};
use erase_graph::{DType, Graph, Init, Tensor};
use erase_ops::Buffer;
use erase_runtime::CpuSession;

/// The six dense subarchitectures, in order (block `k` is `BLOCKS[k]`).
pub const BLOCKS: [&str; 6] = [
    "bottom",
    "interaction",
    "cross",
    "autoint",
    "deep",
    "masknet",
];

/// The order the blocks after `bottom` run forward: the early backward of a block starts
/// when its forward ends, so the blocks whose backward is longest go first (AutoInt,
/// cross, then MaskNet, whose chain of data gradients ends last with cross's) and the
/// short deep and interaction MLPs last. On an H200 this measured 0.3 % more erase
/// examples/s than AutoInt, cross, deep, MaskNet, interaction (the simulator ranks the
/// two within 0.1 %), and that 0.3 % more than block order.
const FORWARD_ORDER: [usize; 5] = [3, 2, 5, 4, 1];

/// LayerNorm epsilon (PyTorch's default, as in the anchor).
pub const LAYER_NORM_EPS: f64 = 1e-5;

/// Which variant of the model (spec, "Variants").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Variant {
    /// No detach, no auxiliary heads.
    Baseline,
    /// `b` and every `o_k` detached where they feed `E` / the top; one aux head per block.
    Detached,
    /// The same graph as `Detached`; only the schedule differs (done by the scheduler).
    #[default]
    Erase,
}

impl Variant {
    pub const ALL: [Variant; 3] = [Variant::Baseline, Variant::Detached, Variant::Erase];

    pub fn as_str(self) -> &'static str {
        match self {
            Variant::Baseline => "baseline",
            Variant::Detached => "detached",
            Variant::Erase => "erase",
        }
    }

    /// True when the graph has the cuts and the auxiliary heads (`detached`, `erase`).
    pub fn is_detached(self) -> bool {
        !matches!(self, Variant::Baseline)
    }
}

impl fmt::Display for Variant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Variant {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "baseline" => Ok(Variant::Baseline),
            "detached" => Ok(Variant::Detached),
            "erase" => Ok(Variant::Erase),
            other => bail!("unknown variant '{other}': expected baseline, detached or erase"),
        }
    }
}

/// The model's sizes. `Default` is the spec's (batch 4096, `erase`); every size is a
/// field. Hidden-width lists exclude the block's input and its `dim`-wide output.
#[derive(Clone, Debug, PartialEq)]
pub struct CtrConfig {
    /// Which model: `spec` (this file's, the default) or a name of the model API's
    /// registry (`dlrm`, `dcnv2`, `deepfm`, or one registered by the user).
    pub model: String,
    pub batch: usize,
    /// Dense features per example (13). 0: the data has none (Avazu, say); then there is
    /// no bottom MLP, `E` is the `num_sparse` embeddings alone and the top reads the five
    /// other blocks.
    pub num_dense: usize,
    /// Categorical fields, one table each (26).
    pub num_sparse: usize,
    /// Rows per embedding table, where `table_rows` is empty.
    pub rows: usize,
    /// Rows of each field's table, in field order; empty: every table has `rows`.
    pub table_rows: Vec<usize>,
    /// Rows this process stores of each field's table, where they differ from
    /// [`CtrConfig::field_rows`]: a rank of sharded training holds the rows it owns and a
    /// landing area for the rows it fetches (see `crate::sharded`), and its lookup reads
    /// ids remapped into that storage. Empty: the whole tables. The data and its ids are
    /// always those of the whole tables.
    pub storage_rows: Vec<usize>,
    /// Ids per field (multi-hot bag size, sum-pooled), where `field_hot` is empty.
    pub hot: usize,
    /// Slots of each field's bag, in field order (variable-length multi-hot data: a bag
    /// holds up to this many ids, the rest of its slots padding); empty: `hot` for every
    /// field.
    pub field_hot: Vec<usize>,
    /// Fields pooled by the mean of their bag's ids instead of the sum, in field order;
    /// empty: every field sum-pooled.
    pub mean_fields: Vec<bool>,
    /// Embedding width `D`, also the width of every block output `o_k`.
    pub dim: usize,
    /// Bottom MLP hidden widths: `num_dense -> bottom.. -> dim`.
    pub bottom: Vec<usize>,
    /// Interaction MLP hidden widths: `F(F-1)/2 -> interaction.. -> dim`.
    pub interaction: Vec<usize>,
    pub cross_rank: usize,
    pub cross_layers: usize,
    pub autoint_layers: usize,
    pub heads: usize,
    pub head_dim: usize,
    /// Deep MLP hidden widths: `F·dim -> deep.. -> dim`.
    pub deep: Vec<usize>,
    pub masknet_hidden: usize,
    /// Top MLP hidden widths: `6·dim -> top.. -> 1`.
    pub top: Vec<usize>,
    /// Weight λ of each auxiliary loss (detached / erase).
    pub aux_weight: f64,
    pub variant: Variant,
}

impl Default for CtrConfig {
    fn default() -> Self {
        CtrConfig {
            model: "spec".to_string(),
            batch: 4096,
            num_dense: 13,
            num_sparse: 26,
            rows: 100_000,
            table_rows: Vec::new(),
            storage_rows: Vec::new(),
            hot: 1,
            field_hot: Vec::new(),
            mean_fields: Vec::new(),
            dim: 64,
            bottom: vec![256, 128],
            interaction: vec![256],
            cross_rank: 256,
            cross_layers: 3,
            autoint_layers: 2,
            heads: 2,
            head_dim: 32,
            deep: vec![1024, 512],
            masknet_hidden: 256,
            top: vec![512, 256],
            aux_weight: 1.0,
            variant: Variant::Erase,
        }
    }
}

impl CtrConfig {
    /// A lightweight CPU size with the same structure (all six blocks, 26 fields, 13
    /// dense features): batch 256, 1000 rows per table, dim 16, widths scaled down.
    pub fn small() -> Self {
        CtrConfig {
            model: "spec".to_string(),
            batch: 256,
            num_dense: 13,
            num_sparse: 26,
            rows: 1000,
            table_rows: Vec::new(),
            storage_rows: Vec::new(),
            hot: 1,
            field_hot: Vec::new(),
            mean_fields: Vec::new(),
            dim: 16,
            bottom: vec![64, 32],
            interaction: vec![64],
            cross_rank: 32,
            cross_layers: 3,
            autoint_layers: 2,
            heads: 2,
            head_dim: 32,
            deep: vec![128, 64],
            masknet_hidden: 64,
            top: vec![128, 64],
            aux_weight: 1.0,
            variant: Variant::Erase,
        }
    }

    /// The same configuration with another variant.
    pub fn with_variant(mut self, variant: Variant) -> Self {
        self.variant = variant;
        self
    }

    /// Fields of `E`: the embeddings plus `b` (when there are dense features).
    pub fn num_fields(&self) -> usize {
        self.num_sparse + usize::from(self.has_dense())
    }

    /// Columns of the `dense` input: `num_dense`, or 1 for the placeholder without dense
    /// features (see [`CtrInputs::dense`]).
    pub fn dense_width(&self) -> usize {
        self.num_dense.max(1)
    }

    /// Whether the examples have dense features (and so the model a bottom MLP).
    pub fn has_dense(&self) -> bool {
        self.num_dense > 0
    }

    /// Rows of each field's table: `table_rows`, or `rows` for every field.
    pub fn field_rows(&self) -> Vec<usize> {
        if self.table_rows.is_empty() {
            vec![self.rows; self.num_sparse]
        } else {
            self.table_rows.clone()
        }
    }

    /// Rows of each field's table as this process stores them: `storage_rows`, or the
    /// whole tables.
    pub fn stored_rows(&self) -> Vec<usize> {
        if self.storage_rows.is_empty() {
            self.field_rows()
        } else {
            self.storage_rows.clone()
        }
    }

    /// Bytes of the embedding tables in f32 and of their row-wise Adagrad state.
    pub fn table_bytes(&self) -> (u64, u64) {
        let rows: u64 = self.field_rows().iter().map(|&r| r as u64).sum();
        (rows * self.dim as u64 * 4, rows * 4)
    }

    /// The blocks the model has, by index into [`BLOCKS`]: all six, or five without
    /// dense features (no bottom MLP).
    pub fn blocks(&self) -> Vec<usize> {
        (usize::from(!self.has_dense())..BLOCKS.len()).collect()
    }

    /// Slots of each field's bag: `field_hot`, or `hot` for every field.
    pub fn bag_slots(&self) -> Vec<usize> {
        if self.field_hot.is_empty() {
            vec![self.hot; self.num_sparse]
        } else {
            self.field_hot.clone()
        }
    }

    /// Id slots of one example: the sum of the fields' bag slots.
    pub fn slots_per_example(&self) -> usize {
        self.bag_slots().iter().sum()
    }

    /// Ids per batch: `batch · Σ bag slots` (`batch · num_sparse · hot` with one size).
    pub fn ids_per_batch(&self) -> usize {
        self.batch * self.slots_per_example()
    }

    /// Checks every size, with a message naming the field.
    pub fn validate(&self) -> Result<()> {
        let positive = [
            ("batch", self.batch),
            ("num_sparse", self.num_sparse),
            ("rows", self.rows),
            ("hot", self.hot),
            ("dim", self.dim),
            ("cross_rank", self.cross_rank),
            ("heads", self.heads),
            ("head_dim", self.head_dim),
            ("masknet_hidden", self.masknet_hidden),
        ];
        for (name, v) in positive {
            ensure!(v > 0, "ctr config: {name} must be at least 1, got 0");
        }
        let lists = [
            ("bottom", &self.bottom),
            ("interaction", &self.interaction),
            ("deep", &self.deep),
            ("top", &self.top),
        ];
        for (name, widths) in lists {
            if let Some(i) = widths.iter().position(|&w| w == 0) {
                bail!("ctr config: {name}[{i}] is 0 (hidden widths must be at least 1, got {widths:?})");
            }
        }
        ensure!(
            self.aux_weight.is_finite() && self.aux_weight >= 0.0,
            "ctr config: aux_weight must be finite and non-negative, got {}",
            self.aux_weight
        );
        let i32_max = i32::MAX as usize;
        ensure!(
            self.rows <= i32_max,
            "ctr config: rows = {} does not fit the i32 ids of the lookup (at most {i32_max})",
            self.rows
        );
        if !self.field_hot.is_empty() {
            ensure!(
                self.field_hot.len() == self.num_sparse,
                "ctr config: field_hot gives {} bag sizes for {} categorical fields",
                self.field_hot.len(),
                self.num_sparse
            );
            if let Some(j) = self.field_hot.iter().position(|&h| h == 0) {
                bail!("ctr config: field_hot[{j}] is 0 (a bag has at least one slot)");
            }
        }
        ensure!(
            self.mean_fields.is_empty() || self.mean_fields.len() == self.num_sparse,
            "ctr config: mean_fields gives {} flags for {} categorical fields",
            self.mean_fields.len(),
            self.num_sparse
        );
        if !self.table_rows.is_empty() {
            ensure!(
                self.table_rows.len() == self.num_sparse,
                "ctr config: table_rows gives {} sizes for {} categorical fields",
                self.table_rows.len(),
                self.num_sparse
            );
            if let Some(j) = self.table_rows.iter().position(|&r| r == 0 || r > i32_max) {
                bail!(
                    "ctr config: table_rows[{j}] = {} must be 1 to {i32_max}",
                    self.table_rows[j]
                );
            }
        }
        if !self.storage_rows.is_empty() {
            ensure!(
                self.storage_rows.len() == self.num_sparse
                    && self.storage_rows.iter().all(|&r| r >= 1 && r <= i32_max),
                "ctr config: storage_rows {:?} must give 1 to {i32_max} rows for each of the {} categorical fields",
                self.storage_rows,
                self.num_sparse
            );
        }
        self.batch
            .checked_mul(self.bag_slots().iter().sum::<usize>())
            .filter(|&n| n <= i32_max)
            .ok_or_else(|| {
                anyhow!(
                    "ctr config: batch·num_sparse·hot = {}·{}·{} ids do not fit the i32 offsets",
                    self.batch,
                    self.num_sparse,
                    self.hot
                )
            })?;
        let total: usize = self.field_rows().iter().sum();
        total.checked_mul(self.dim).ok_or_else(|| {
            anyhow!(
                "ctr config: the tables of {total} rows in all of width {} are too large",
                self.dim
            )
        })?;
        Ok(())
    }
}

/// The inputs fed each step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CtrInputs {
    /// Float `[B, num_dense]`. Without dense features a `[B, 1]` placeholder of zeros
    /// that no op reads, so that every model is fed the same four inputs.
    pub dense: Tensor,
    /// I32 `[B·num_sparse·hot]`: rows local to each field's table, bag by bag
    /// (example-major, then field, then the bag's ids).
    pub ids: Tensor,
    /// I32 `[B·num_sparse + 1]`: `0, hot, 2·hot, ..`.
    pub offsets: Tensor,
    /// Float `[B]`, 0 or 1.
    pub label: Tensor,
}

impl CtrInputs {
    /// The inputs in the order [`CtrModel::batch_buffers`] returns their buffers (a
    /// packed batch's layout follows it).
    pub fn in_batch_order(&self) -> [Tensor; 4] {
        [self.dense, self.ids, self.offsets, self.label]
    }
}

/// The forward graph of the model, with its losses registered (main weight 1, each aux
/// loss weight `cfg.aux_weight`) but no backward or optimizer yet: callers run
/// [`erase_graph::make_trainable`] (or `autodiff::backward_with`) with the options they want.
#[derive(Clone, Debug)]
pub struct CtrModel {
    pub graph: Graph,
    pub inputs: CtrInputs,
    /// The stacked embedding tables `[num_sparse·rows, dim]`; table `j`'s row `r` is row
    /// `j·rows + r`.
    pub table: Tensor,
    /// `[B]`.
    pub logit: Tensor,
    pub main_loss: Tensor,
    /// `(block name, aux loss)`, in block order; empty for `baseline`.
    pub aux_losses: Vec<(String, Tensor)>,
    /// Dense parameters in PyTorch's `model.parameters()` order, with PyTorch's names
    /// (`blocks.0.mlp.layers.0.weight`, ..., `top.layers.2.bias`, `heads.5.bias`).
    pub params: Vec<(String, Tensor)>,
    /// `(block name, o_k [B, dim])`, in block order (block 0's output is `b`).
    pub block_outputs: Vec<(String, Tensor)>,
    pub cfg: CtrConfig,
    pub float: DType,
}

impl CtrModel {
    /// A dense parameter by its PyTorch name.
    pub fn param(&self, torch_name: &str) -> Option<Tensor> {
        self.params
            .iter()
            .find(|(n, _)| n == torch_name)
            .map(|&(_, t)| t)
    }

    /// The input buffers of one batch, for this model's sizes and float type.
    pub fn batch_buffers(
        &self,
        dense: &[f32],
        rows: &[u32],
        labels: &[f32],
    ) -> Result<(Buffer, Buffer, Buffer, Buffer)> {
        batch_buffers(&self.cfg, self.float, dense, rows, labels)
    }
}

// ---- parameters ---------------------------------------------------------------------

/// A linear layer's parameters: `w [out, in]`, optional bias `[out]`.
#[derive(Clone, Copy, Debug)]
struct Lin {
    w: Tensor,
    b: Option<Tensor>,
}

#[derive(Clone, Copy, Debug)]
struct Norm {
    gamma: Tensor,
    beta: Tensor,
}

/// Creates parameters in the current scope and records their PyTorch names.
struct Params<'a> {
    list: &'a mut Vec<(String, Tensor)>,
}

impl Params<'_> {
    /// `Linear(i, o)`: weight uniform ±1/sqrt(i), bias zeros. `local` is the graph name
    /// (scoped), `torch` the PyTorch prefix (`{torch}.weight`, `{torch}.bias`).
    fn linear(
        &mut self,
        g: &mut Graph,
        local: &str,
        torch: &str,
        i: usize,
        o: usize,
        bias: bool,
    ) -> Result<Lin> {
        let bound = 1.0 / (i as f64).sqrt();
        let w = g.param(&format!("{local}.weight"), &[o, i], Init::Uniform { bound })?;
        self.list.push((format!("{torch}.weight"), w));
        let b = if bias {
            let b = g.param(&format!("{local}.bias"), &[o], Init::Zeros)?;
            self.list.push((format!("{torch}.bias"), b));
            Some(b)
        } else {
            None
        };
        Ok(Lin { w, b })
    }

    /// `LayerNorm(d)`: gamma ones, beta zeros (PyTorch's `weight`, `bias`).
    fn norm(&mut self, g: &mut Graph, local: &str, torch: &str, d: usize) -> Result<Norm> {
        let gamma = g.param(&format!("{local}.weight"), &[d], Init::Ones)?;
        self.list.push((format!("{torch}.weight"), gamma));
        let beta = g.param(&format!("{local}.bias"), &[d], Init::Zeros)?;
        self.list.push((format!("{torch}.bias"), beta));
        Ok(Norm { gamma, beta })
    }

    /// The anchor's `MLP(dims)`: `{prefix}.layers.{i}`.
    fn mlp(&mut self, g: &mut Graph, local: &str, torch: &str, dims: &[usize]) -> Result<Vec<Lin>> {
        dims.windows(2)
            .enumerate()
            .map(|(i, w)| {
                self.linear(
                    g,
                    &format!("{local}layers.{i}"),
                    &format!("{torch}layers.{i}"),
                    w[0],
                    w[1],
                    true,
                )
            })
            .collect()
    }
}

/// `[first, hidden.., last]`.
fn dims(first: usize, hidden: &[usize], last: usize) -> Vec<usize> {
    let mut d = Vec::with_capacity(hidden.len() + 2);
    d.push(first);
    d.extend_from_slice(hidden);
    d.push(last);
    d
}

struct CrossParams {
    u: Vec<Lin>,
    v: Vec<Lin>,
    out: Lin,
}

struct AutoIntParams {
    qkv: Vec<Lin>,
    o: Vec<Lin>,
    ln: Vec<Norm>,
    out: Lin,
}

struct MaskNetParams {
    m1: Lin,
    m2: Lin,
    h: Lin,
    ln: Norm,
    out: Lin,
}

struct AllParams {
    bottom: Vec<Lin>,
    interaction: Vec<Lin>,
    cross: CrossParams,
    autoint: AutoIntParams,
    deep: Vec<Lin>,
    masknet: MaskNetParams,
    top: Vec<Lin>,
    heads: Vec<Option<Lin>>,
}

/// Every dense parameter, in PyTorch's `model.parameters()` order: blocks 0..5, the
/// top, then the heads (created last in the anchor).
fn make_params(
    g: &mut Graph,
    cfg: &CtrConfig,
    list: &mut Vec<(String, Tensor)>,
) -> Result<AllParams> {
    let mut p = Params { list };
    let d = cfg.dim;
    let f = cfg.num_fields();
    let flat = f * d;
    let pairs = f * (f - 1) / 2;
    let hw = cfg.heads * cfg.head_dim;

    let bottom = if cfg.has_dense() {
        g.scoped(BLOCKS[0], |g| {
            p.mlp(
                g,
                "mlp.",
                "blocks.0.mlp.",
                &dims(cfg.num_dense, &cfg.bottom, d),
            )
        })?
    } else {
        Vec::new()
    };
    let interaction = g.scoped(BLOCKS[1], |g| {
        p.mlp(
            g,
            "mlp.",
            "blocks.1.mlp.",
            &dims(pairs, &cfg.interaction, d),
        )
    })?;
    let cross = g.scoped(BLOCKS[2], |g| -> Result<CrossParams> {
        let mut u = Vec::new();
        for l in 0..cfg.cross_layers {
            u.push(p.linear(
                g,
                &format!("U.{l}"),
                &format!("blocks.2.U.{l}"),
                flat,
                cfg.cross_rank,
                false,
            )?);
        }
        let mut v = Vec::new();
        for l in 0..cfg.cross_layers {
            v.push(p.linear(
                g,
                &format!("V.{l}"),
                &format!("blocks.2.V.{l}"),
                cfg.cross_rank,
                flat,
                true,
            )?);
        }
        let out = p.linear(g, "out", "blocks.2.out", flat, d, true)?;
        Ok(CrossParams { u, v, out })
    })?;
    let autoint = g.scoped(BLOCKS[3], |g| -> Result<AutoIntParams> {
        let n = cfg.autoint_layers;
        let mut qkv = Vec::new();
        for l in 0..n {
            qkv.push(p.linear(
                g,
                &format!("qkv.{l}"),
                &format!("blocks.3.qkv.{l}"),
                d,
                3 * hw,
                true,
            )?);
        }
        let mut o = Vec::new();
        for l in 0..n {
            o.push(p.linear(
                g,
                &format!("o.{l}"),
                &format!("blocks.3.o.{l}"),
                hw,
                d,
                true,
            )?);
        }
        let mut ln = Vec::new();
        for l in 0..n {
            ln.push(p.norm(g, &format!("ln.{l}"), &format!("blocks.3.ln.{l}"), d)?);
        }
        let out = p.linear(g, "out", "blocks.3.out", flat, d, true)?;
        Ok(AutoIntParams { qkv, o, ln, out })
    })?;
    let deep = g.scoped(BLOCKS[4], |g| {
        p.mlp(g, "mlp.", "blocks.4.mlp.", &dims(flat, &cfg.deep, d))
    })?;
    let masknet = g.scoped(BLOCKS[5], |g| -> Result<MaskNetParams> {
        let hid = cfg.masknet_hidden;
        Ok(MaskNetParams {
            m1: p.linear(g, "m1", "blocks.5.m1", flat, hid, true)?,
            m2: p.linear(g, "m2", "blocks.5.m2", hid, flat, true)?,
            h: p.linear(g, "h", "blocks.5.h", flat, hid, true)?,
            ln: p.norm(g, "ln", "blocks.5.ln", hid)?,
            out: p.linear(g, "out", "blocks.5.out", hid, d, true)?,
        })
    })?;
    let blocks = cfg.blocks();
    let top = g.scoped("top", |g| {
        p.mlp(g, "", "top.", &dims(blocks.len() * d, &cfg.top, 1))
    })?;
    // by block index; a block the model lacks (the bottom, without dense features) has none
    let mut heads = Vec::new();
    if cfg.variant.is_detached() {
        for (k, block) in BLOCKS.iter().enumerate() {
            if !blocks.contains(&k) {
                heads.push(None);
                continue;
            }
            let h = g.scoped(&format!("{block}_head"), |g| {
                p.linear(g, "linear", &format!("heads.{k}"), d, 1, true)
            })?;
            heads.push(Some(h));
        }
    }
    Ok(AllParams {
        bottom,
        interaction,
        cross,
        autoint,
        deep,
        masknet,
        top,
        heads,
    })
}

// ---- forward --------------------------------------------------------------------------

fn linear(g: &mut Graph, x: Tensor, l: Lin) -> Result<Tensor> {
    Ok(g.linear_with(x, l.w, l.b)?)
}

/// `relu(linear)` with the ReLU in the GEMM's epilogue.
fn linear_relu(g: &mut Graph, x: Tensor, l: Lin) -> Result<Tensor> {
    Ok(g.linear_relu_with(x, l.w, l.b)?)
}

/// The anchor's `MLP`: ReLU after every layer, the last one too when `last_relu`.
fn mlp(g: &mut Graph, mut x: Tensor, layers: &[Lin], last_relu: bool) -> Result<Tensor> {
    for (i, &l) in layers.iter().enumerate() {
        x = if i + 1 < layers.len() || last_relu {
            linear_relu(g, x, l)?
        } else {
            linear(g, x, l)?
        };
    }
    Ok(x)
}

fn cross(g: &mut Graph, e: Tensor, p: &CrossParams) -> Result<Tensor> {
    let x0 = g.flatten(e)?;
    let mut x = x0;
    let layers = p.u.len();
    for (l, (&u, &v)) in p.u.iter().zip(&p.v).enumerate() {
        let low = linear(g, x, u)?;
        // stored in bf16 where its operands are copies (Graph::linear_stored_bf16)
        let up = g.linear_stored_bf16(low, v.w, v.b)?;
        // x0 ⊙ up + x in one pass; in bf16 where the next layer alone reads it
        // (Graph::set_bf16_cross)
        x = g.mul_add_stored(x0, up, x, l + 1 < layers)?;
    }
    linear_relu(g, x, p.out)
}

fn autoint(g: &mut Graph, e: Tensor, p: &AutoIntParams, cfg: &CtrConfig) -> Result<Tensor> {
    let mut x = e;
    for l in 0..p.qkv.len() {
        // columns [3][heads][head_dim], as the anchor's .view(B, F, 3, heads, dh)
        // (in bf16 where the attention reads it as it is: Graph::linear_for_attention)
        let qkv = g.linear_for_attention(x, p.qkv[l].w, p.qkv[l].b)?;
        // q, k, v read in place from the projection: head h in columns h·dh..(h+1)·dh of
        // each third of qkv, and of the output
        let a = g.attention_packed(qkv, cfg.heads, false)?;
        // x + (a·Woᵀ + bo): the residual added in the projection's epilogue
        let s = g.linear_add_with(a, p.o[l].w, p.o[l].b, x)?;
        x = g.layer_norm_with(s, p.ln[l].gamma, p.ln[l].beta, LAYER_NORM_EPS)?;
    }
    let xf = g.flatten(x)?;
    linear_relu(g, xf, p.out)
}

fn masknet(g: &mut Graph, e: Tensor, p: &MaskNetParams) -> Result<Tensor> {
    let xf = g.flatten(e)?;
    let m = linear_relu(g, xf, p.m1)?;
    let m = linear(g, m, p.m2)?;
    let masked = g.mul(m, xf)?;
    let h = linear(g, masked, p.h)?;
    let h = g.layer_norm_with(h, p.ln.gamma, p.ln.beta, LAYER_NORM_EPS)?;
    let h = g.relu(h)?;
    linear_relu(g, h, p.out)
}

/// `Linear(dim, 1)` + BCE with the label: one auxiliary loss.
fn aux_head(g: &mut Graph, o: Tensor, head: Lin, label: Tensor, batch: usize) -> Result<Tensor> {
    let h = linear(g, o, head)?;
    let h = g.reshape(h, &[batch])?;
    Ok(g.bce_with_logits(h, label)?)
}

/// Builds the forward graph and registers its losses (see [`CtrModel`]). `float` is the
/// type of parameters and activations: F32, or F64 for reference computations.
pub fn build(cfg: &CtrConfig, float: DType) -> Result<CtrModel> {
    build_with(cfg, float, None, Storage::default())
}

/// Which activations a model stores in bf16 where its layers take bf16 operand copies.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Storage {
    /// The cross layers' up-projections (`Graph::set_bf16_storage`).
    pub products: bool,
    /// The cross networks' operands and inner updates, given `products`
    /// (`Graph::set_bf16_cross`).
    pub cross: bool,
    /// With `cross`, the first update's gradient sums x0's two contributions in its pass
    /// (`Graph::set_fold_plus_dy`).
    pub fold_plus_dy: bool,
    /// With `cross`, a cross network's x0 that only its layers read stored in bf16 alone
    /// (`Graph::set_bf16_x0`: DCNv2's concatenated fields).
    pub x0: bool,
}

/// [`build`], with bf16 copies of the GEMM operands of layers of at least `bf16_copies`
/// FLOPs (see `Graph::set_bf16_copies`).
pub fn build_with(
    cfg: &CtrConfig,
    float: DType,
    bf16_copies: Option<usize>,
    storage: Storage,
) -> Result<CtrModel> {
    cfg.validate()?;
    if cfg.model != "spec" {
        let m = super::api::find(&cfg.model)?;
        return build_api(m.as_ref(), cfg, float, bf16_copies, storage);
    }
    let (mut g, inputs, table) = graph_inputs_and_table(cfg, float, bf16_copies, storage)?;
    let (b, d) = (cfg.batch, cfg.dim);
    let detached = cfg.variant.is_detached();

    // The table first and the heads last, so that every variant gives each shared
    // parameter the same position (and so the same default init) in the graph.
    let mut params = Vec::new();
    let p = make_params(&mut g, cfg, &mut params).context("ctr model: parameters")?;

    let pooled = pool(&mut g, cfg, &inputs, table)?;

    let mut outs: Vec<(String, Tensor)> = Vec::with_capacity(6);
    let mut aux_losses = Vec::new();
    let mut head = |g: &mut Graph, k: usize, o: Tensor| -> Result<()> {
        if let (true, Some(Some(h))) = (detached, p.heads.get(k)) {
            let name = BLOCKS[k];
            let l = g.scoped(&format!("{name}_head"), |g| {
                aux_head(g, o, *h, inputs.label, b)
            })?;
            aux_losses.push((name.to_string(), l));
        }
        Ok(())
    };

    // block 0: b, the 27th field of E (absent without dense features)
    let e = match cfg.has_dense().then_some(inputs.dense) {
        Some(dense) => {
            let bottom = g.scoped(BLOCKS[0], |g| mlp(g, dense, &p.bottom, true))?;
            head(&mut g, 0, bottom)?;
            outs.push((BLOCKS[0].to_string(), bottom));
            g.scoped("embedding", |g| -> Result<Tensor> {
                let b_in = if detached { g.detach(bottom)? } else { bottom };
                let b_field = g.reshape(b_in, &[b, 1, d])?;
                Ok(g.concat(&[pooled, b_field], 1)?)
            })?
        }
        None => pooled,
    };

    // blocks 1-5 are independent given E; they are built (hence run forward, and ready
    // their early backward) in FORWARD_ORDER, and `outs` keeps block order for the top
    let mut built: Vec<(usize, (String, Tensor))> = Vec::new();
    for &k in &FORWARD_ORDER {
        let block = BLOCKS[k];
        let o = g.scoped(block, |g| -> Result<Tensor> {
            match k {
                1 => {
                    let z = g.pairwise_dot(e)?;
                    mlp(g, z, &p.interaction, true)
                }
                2 => cross(g, e, &p.cross),
                3 => autoint(g, e, &p.autoint, cfg),
                4 => {
                    let xf = g.flatten(e)?;
                    mlp(g, xf, &p.deep, true)
                }
                _ => masknet(g, e, &p.masknet),
            }
        })?;
        head(&mut g, k, o)?;
        built.push((k, (block.to_string(), o)));
    }
    built.sort_by_key(|x| x.0);
    outs.extend(built.into_iter().map(|x| x.1));

    let (logit, main_loss) = g.scoped("top", |g| -> Result<(Tensor, Tensor)> {
        // concat(o_2 .. o_6, b), each detached in the detached variants (b last; no b
        // without dense features)
        let first = usize::from(cfg.has_dense());
        let mut parts = Vec::with_capacity(6);
        for &(_, o) in outs[first..].iter().chain(&outs[..first]) {
            parts.push(if detached { g.detach(o)? } else { o });
        }
        let x = g.concat(&parts, 1)?;
        let y = mlp(g, x, &p.top, false)?;
        let logit = g.reshape(y, &[b])?;
        let loss = g.bce_with_logits(logit, inputs.label)?;
        Ok((logit, loss))
    })?;

    // the aux losses in block order, whatever order the blocks were built in
    aux_losses.sort_by_key(|(name, _)| BLOCKS.iter().position(|b| b == name));
    g.loss(main_loss, 1.0)?;
    for &(_, l) in &aux_losses {
        g.loss(l, cfg.aux_weight)?;
    }

    Ok(CtrModel {
        graph: g,
        inputs,
        table,
        logit,
        main_loss,
        aux_losses,
        params,
        block_outputs: outs,
        cfg: cfg.clone(),
        float,
    })
}

/// A graph with the trainer's four inputs and the stacked embedding tables, what every
/// CTR model starts from.
fn graph_inputs_and_table(
    cfg: &CtrConfig,
    float: DType,
    bf16_copies: Option<usize>,
    storage: Storage,
) -> Result<(Graph, CtrInputs, Tensor)> {
    ensure!(
        matches!(float, DType::F32 | DType::F64),
        "ctr model: float type must be f32 or f64, got {float}"
    );
    let mut g = Graph::new(float);
    g.set_bf16_copies(bf16_copies);
    g.set_bf16_storage(storage.products);
    g.set_bf16_cross(storage.cross);
    g.set_fold_plus_dy(storage.fold_plus_dy);
    g.set_bf16_x0(storage.x0);
    let (b, ns) = (cfg.batch, cfg.num_sparse);
    let inputs = CtrInputs {
        dense: g.input("dense", &[b, cfg.dense_width()], float)?,
        ids: g.input("ids", &[cfg.ids_per_batch()], DType::I32)?,
        offsets: g.input("offsets", &[b * ns + 1], DType::I32)?,
        label: g.input("label", &[b], float)?,
    };
    let field_rows = cfg.stored_rows();
    let table = g.scoped("embedding", |g| {
        g.embedding_tables("tables", &field_rows, cfg.dim)
    })?;
    Ok((g, inputs, table))
}

/// The fields' pooled embeddings `[B, F, D]`: each bag summed, or mean-pooled for the
/// fields of `cfg.mean_fields`.
fn pool(g: &mut Graph, cfg: &CtrConfig, inputs: &CtrInputs, table: Tensor) -> Result<Tensor> {
    let field_rows = cfg.stored_rows();
    g.scoped("embedding", |g| -> Result<Tensor> {
        let sum = g.embedding_bag(table, inputs.ids, inputs.offsets, &field_rows)?;
        if cfg.mean_fields.iter().any(|&m| m) {
            Ok(g.bag_mean(sum, inputs.ids, inputs.offsets, &cfg.mean_fields)?)
        } else {
            Ok(sum)
        }
    })
}

/// A model of the model API on the trainer's inputs: the same four inputs, tables and
/// lookup as the spec model, the model's dense part, its main loss and the aux losses of
/// the blocks it marked (detached variants).
fn build_api(
    model: &dyn super::api::Model,
    cfg: &CtrConfig,
    float: DType,
    bf16_copies: Option<usize>,
    storage: Storage,
) -> Result<CtrModel> {
    let (mut g, inputs, table) = graph_inputs_and_table(cfg, float, bf16_copies, storage)?;
    let (b, d) = (cfg.batch, cfg.dim);
    let pooled = pool(&mut g, cfg, &inputs, table)?;
    let x = super::api::ModelInputs {
        dense: cfg.has_dense().then_some(inputs.dense),
        fields: pooled,
        label: inputs.label,
        batch: b,
        dim: d,
    };
    let mut blocks = super::api::Blocks::new(cfg.variant.is_detached(), inputs.label, b);
    let logit = model
        .build(&mut g, &x, cfg, &mut blocks)
        .with_context(|| format!("building model '{}'", model.name()))?;
    let fed = [inputs.dense, inputs.ids, inputs.offsets, inputs.label];
    check_api_model(
        &g,
        model.name(),
        logit,
        &x,
        &blocks,
        cfg.variant.is_detached(),
        &fed,
    )?;
    let main_loss = g.scoped("top", |g| g.bce_with_logits(logit, inputs.label))?;
    g.loss(main_loss, 1.0)?;
    for &(_, l) in &blocks.aux_losses {
        g.loss(l, cfg.aux_weight)?;
    }
    Ok(CtrModel {
        graph: g,
        inputs,
        table,
        logit,
        main_loss,
        aux_losses: blocks.aux_losses,
        params: Vec::new(),
        block_outputs: blocks.outputs,
        cfg: cfg.clone(),
        float,
    })
}

/// Every tensor `t` is computed from (itself included), crossing `detach` where
/// `through_detach`, and not past the tensors of `stop`.
fn ancestors_until(
    g: &Graph,
    t: Tensor,
    through_detach: bool,
    stop: &[Tensor],
) -> std::collections::BTreeSet<Tensor> {
    let mut seen = std::collections::BTreeSet::new();
    let mut todo = vec![t];
    while let Some(t) = todo.pop() {
        if !seen.insert(t) || stop.contains(&t) {
            continue;
        }
        let node = g.node(g.info(t).producer);
        if !through_detach && node.op == erase_graph::Op::Detach {
            continue;
        }
        todo.extend(node.inputs.iter().copied());
    }
    seen
}

fn ancestors(g: &Graph, t: Tensor, through_detach: bool) -> std::collections::BTreeSet<Tensor> {
    ancestors_until(g, t, through_detach, &[])
}

/// What a model of the model API returned, checked before it is trained: a logit of
/// this graph, `[batch]`, computed from a parameter and not from the label; in the
/// detached variants, each block's output read only by its head and its cut, and the cut
/// read by the rest (else the block's backward would join the rest's, or the block would
/// train on its local loss alone).
fn check_api_model(
    g: &Graph,
    model: &str,
    logit: Tensor,
    x: &super::api::ModelInputs,
    blocks: &super::api::Blocks,
    detached: bool,
    fed: &[Tensor],
) -> Result<()> {
    let b = x.batch;
    // the trainer feeds its own inputs only
    if let Some(t) = g
        .tensors()
        .find(|&t| matches!(g.leaf(t), Some(erase_graph::Leaf::Input)) && !fed.contains(&t))
    {
        bail!(
            "model '{model}' adds an input '{}'; a model reads what the trainer feeds it (ModelInputs: dense, fields, label)",
            g.name(t)
        );
    }
    ensure!(
        logit.index() < g.num_tensors(),
        "model '{model}' returned tensor #{}, which is not of its graph",
        logit.index()
    );
    let dims = g.shape(logit).dims();
    ensure!(
        dims == [b],
        "model '{model}' returned '{}' of shape {dims:?} as its logit; a logit is [batch] = [{b}]{}",
        g.name(logit),
        if dims.len() == 2 && dims[0] == b && dims[1] == 1 {
            " (g.reshape(logit, &[batch]) makes one of a [batch, 1])"
        } else {
            ""
        }
    );
    let from = ancestors(g, logit, true);
    ensure!(
        !from.contains(&x.label),
        "model '{model}': its logit '{}' is computed from the label, which it must predict",
        g.name(logit)
    );
    ensure!(
        from.iter()
            .any(|&t| matches!(g.leaf(t), Some(erase_graph::Leaf::Param { trainable: true, .. }))),
        "model '{model}': its logit '{}' is computed from no parameter (a constant, or cut off by detach), so training would change nothing",
        g.name(logit)
    );
    let main = ancestors(g, logit, false);
    for ((name, o), marked) in blocks.outputs.iter().zip(&blocks.marked_nodes) {
        let o = *o;
        // its own parameters: not those behind the model's inputs (the tables)
        let inputs: Vec<Tensor> = [Some(x.fields), x.dense].into_iter().flatten().collect();
        let own = ancestors_until(g, o, true, &inputs);
        ensure!(
            own.iter()
                .any(|&t| matches!(g.leaf(t), Some(erase_graph::Leaf::Param { trainable: true, .. }))),
            "model '{model}': block '{name}' has no parameter of its own to train (its output '{}' is computed from the model's inputs alone); mark a block's output, not an input",
            g.name(o)
        );
        // the op that makes a block's output may write its bf16 copy too: a read of either
        let last_op = g.info(o).producer;
        let reads = |set: &std::collections::BTreeSet<Tensor>| {
            set.iter().any(|&t| g.info(t).producer == last_op)
        };
        if !detached {
            ensure!(
                reads(&main),
                "model '{model}': the logit does not read block '{name}' (its output '{}'); use what Blocks::mark returns",
                g.name(o)
            );
            continue;
        }
        // o and its bf16 copies (written beside it by its op, or by a RoundBf16 of it),
        // which the rest may read only through a cut (a Detach)
        let is_copy_of_o = |n: &erase_graph::Node| {
            matches!(n.op, erase_graph::Op::RoundBf16 { .. }) && n.inputs == [o]
        };
        let mut watched = vec![o];
        for n in g.nodes() {
            if n.id == last_op || is_copy_of_o(n) {
                watched.extend(
                    n.outputs.iter().copied().filter(|&t| {
                        t != o && g.dtype(t) == DType::Bf16 && g.shape(t) == g.shape(o)
                    }),
                );
            }
        }
        for n in g.nodes() {
            let cut_or_copy = marked.contains(&n.id.index())
                || n.op == erase_graph::Op::Detach
                || is_copy_of_o(n);
            if cut_or_copy || !n.inputs.iter().any(|t| watched.contains(t)) {
                continue;
            }
            bail!(
                "model '{model}': node '{}' reads block '{name}''s output '{}' itself; read what Blocks::mark returns (the block's cut), or the block's backward joins the rest's",
                n.name,
                g.name(o)
            );
        }
        // read by the rest (`from` crosses cuts), maybe through another block (DCNv2's
        // cross reads the bottom), through its cut or a bf16 copy its last op writes
        ensure!(
            reads(&from),
            "model '{model}': the logit does not read block '{name}' (its output '{}'), which would train on its local loss alone; use what Blocks::mark returns",
            g.name(o)
        );
    }
    Ok(())
}

// ---- feeding ------------------------------------------------------------------------------

/// The row of a padding slot in `rows` (an empty slot of a bag shorter than its field's
/// [`CtrConfig::bag_slots`]); it is fed as the lookup's padding id, -1.
pub const PAD_ROW: u32 = u32::MAX;

/// Offsets of the bags, each as many slots as its field has: `0, hot, 2·hot, ..,
/// batch·num_sparse·hot` with one size.
pub fn offsets(cfg: &CtrConfig) -> Vec<i32> {
    let slots = cfg.bag_slots();
    let mut out = Vec::with_capacity(cfg.batch * cfg.num_sparse + 1);
    let mut at = 0i32;
    out.push(0);
    for _ in 0..cfg.batch {
        for &h in &slots {
            at += h as i32;
            out.push(at);
        }
    }
    out
}

/// The four input buffers of one batch (`dense`, `ids`, `offsets`, `label`), floats in
/// `float`. `dense` is `[batch, num_dense]`, `rows` `[batch, num_sparse, hot]` rows local
/// to each field's table (as `SyntheticCtr::fill_batch` makes them; with per-field bag
/// slots, each example's fields one after the other, empty slots [`PAD_ROW`]), `labels`
/// `[batch]`.
pub fn batch_buffers(
    cfg: &CtrConfig,
    float: DType,
    dense: &[f32],
    rows: &[u32],
    labels: &[f32],
) -> Result<(Buffer, Buffer, Buffer, Buffer)> {
    ensure!(
        dense.len() == cfg.batch * cfg.num_dense,
        "ctr batch: dense has {} values, expected batch·num_dense = {}·{}",
        dense.len(),
        cfg.batch,
        cfg.num_dense
    );
    ensure!(
        rows.len() == cfg.ids_per_batch(),
        "ctr batch: rows has {} ids, expected batch·slots = {}·{}",
        rows.len(),
        cfg.batch,
        cfg.slots_per_example()
    );
    ensure!(
        labels.len() == cfg.batch,
        "ctr batch: labels has {} values, expected batch = {}",
        labels.len(),
        cfg.batch
    );
    let field_rows = cfg.field_rows();
    // the field of each slot of one example
    let slot_field: Vec<usize> = cfg
        .bag_slots()
        .iter()
        .enumerate()
        .flat_map(|(j, &h)| std::iter::repeat_n(j, h))
        .collect();
    let per = slot_field.len().max(1);
    let bad = (0..rows.len())
        .find(|&i| rows[i] != PAD_ROW && rows[i] as usize >= field_rows[slot_field[i % per]]);
    if let Some(i) = bad {
        let j = slot_field[i % per];
        bail!(
            "ctr batch: id {i} (example {}, field {j}) is row {} of a table of {} rows",
            i / per,
            rows[i],
            field_rows[j]
        );
    }
    let placeholder;
    let dense = if cfg.has_dense() {
        dense
    } else {
        placeholder = vec![0f32; cfg.batch];
        &placeholder[..]
    };
    let floats = |v: &[f32]| -> Result<Buffer> {
        Ok(match float {
            DType::F32 => Buffer::F32(v.to_vec()),
            DType::F64 => Buffer::F64(v.iter().map(|&x| x as f64).collect()),
            other => bail!("ctr batch: float type must be f32 or f64, got {other}"),
        })
    };
    // PAD_ROW (u32::MAX) becomes the lookup's padding id -1
    let ids = Buffer::I32(rows.iter().map(|&r| r as i32).collect());
    Ok((
        floats(dense)?,
        ids,
        Buffer::I32(offsets(cfg)),
        floats(labels)?,
    ))
}

/// Feeds one batch (see [`batch_buffers`]) into a session of `m.graph` (or of a graph
/// built from it, which keeps the input tensors).
pub fn feed_batch(
    session: &mut CpuSession,
    m: &CtrModel,
    dense: &[f32],
    rows: &[u32],
    labels: &[f32],
) -> Result<()> {
    let (d, i, o, l) = m.batch_buffers(dense, rows, labels)?;
    session.feed(m.inputs.dense, d)?;
    session.feed(m.inputs.ids, i)?;
    session.feed(m.inputs.offsets, o)?;
    session.feed(m.inputs.label, l)?;
    Ok(())
}
