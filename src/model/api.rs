//! The model API: a CTR model is a Rust type that, given a batch's inputs (the dense
//! features, one pooled embedding per field, the label) and its config, builds its dense
//! part in the graph DSL and returns the main logit. It may mark blocks (a scoped name and
//! an output) that the `detached` and `erase` variants cut off with a local loss head;
//! `baseline` ignores the marks. Everything else is the trainer's: data, the embedding
//! tables and their lookup, optimizers, metrics, checkpoints, data parallelism, `bench`,
//! `plan` and traces.
//!
//! ```no_run
//! use erase::graph::{Graph, Tensor};
//! use erase::model::api::{Blocks, Model, ModelInputs};
//! use erase::model::ctr::CtrConfig;
//!
//! /// A wide & deep model: a linear "wide" part and a deep MLP, the deep one a block.
//! struct WideDeep;
//!
//! impl Model for WideDeep {
//!     fn name(&self) -> &str {
//!         "wide-deep"
//!     }
//!     fn build(&self, g: &mut Graph, x: &ModelInputs, _c: &CtrConfig, b: &mut Blocks) -> anyhow::Result<Tensor> {
//!         let flat = g.flatten(x.fields)?;
//!         let wide = g.scoped("wide", |g| g.linear(flat, 1))?;
//!         let deep = g.scoped("deep", |g| -> anyhow::Result<Tensor> {
//!             let h = g.linear(flat, 256)?;
//!             Ok(g.relu(h)?)
//!         })?;
//!         let deep = b.mark(g, "deep", deep)?;
//!         let d1 = g.scoped("top", |g| g.linear(deep, 1))?;
//!         let sum = g.add(wide, d1)?;
//!         Ok(g.reshape(sum, &[x.batch])?)
//!     }
//! }
//!
//! fn main() -> std::process::ExitCode {
//!     erase::cli::main_with(std::sync::Arc::new(WideDeep))
//! }
//! ```

use std::sync::{Arc, Mutex, OnceLock};

use anyhow::{bail, Result};
use erase_graph::{Graph, Tensor};

use super::ctr::CtrConfig;

/// What a model is given to build on.
#[derive(Clone, Copy, Debug)]
pub struct ModelInputs {
    /// `[B, num_dense]` dense features; `None` when the data has none.
    pub dense: Option<Tensor>,
    /// `[B, num_sparse, dim]`: one pooled embedding per categorical field.
    pub fields: Tensor,
    /// `[B]`, 0 or 1.
    pub label: Tensor,
    pub batch: usize,
    pub dim: usize,
}

/// The blocks a model marks. In the detached variants (`detached`, `erase`) a marked
/// block's output is cut off with `detach` and gets a local loss head (Linear to 1, BCE
/// with the label, weight `aux_weight`), so its backward can start as soon as its forward
/// is done; in `baseline` a mark changes nothing.
pub struct Blocks {
    detached: bool,
    label: Tensor,
    batch: usize,
    /// `(block, aux loss)`, in marking order.
    pub aux_losses: Vec<(String, Tensor)>,
    /// `(block, output)`, in marking order.
    pub outputs: Vec<(String, Tensor)>,
    /// The nodes each mark added (the head and the cut), by index: what may read the
    /// block's output besides the block itself.
    pub marked_nodes: Vec<std::ops::Range<usize>>,
}

impl Blocks {
    pub fn new(detached: bool, label: Tensor, batch: usize) -> Blocks {
        Blocks {
            detached,
            label,
            batch,
            aux_losses: Vec::new(),
            outputs: Vec::new(),
            marked_nodes: Vec::new(),
        }
    }

    /// Marks `o` (`[B, ..]`, built in scope `name`) as the output of block `name`; returns
    /// what the rest of the model must read instead of `o` (reading `o` itself would join
    /// the block's backward to the rest's: refused when the model is built).
    pub fn mark(&mut self, g: &mut Graph, name: &str, o: Tensor) -> Result<Tensor> {
        if name.is_empty() {
            bail!("a block needs a name (Blocks::mark with \"\")");
        }
        if self.outputs.iter().any(|(n, _)| n == name) {
            bail!("block '{name}' is marked twice; give each block its own name");
        }
        if o.index() >= g.num_tensors() {
            bail!(
                "block '{name}': tensor #{} is not of this graph (it has {})",
                o.index(),
                g.num_tensors()
            );
        }
        let dims = g.shape(o).dims().to_vec();
        if dims.len() < 2 || dims[0] != self.batch {
            bail!(
                "block '{name}': its output '{}' is {dims:?}; a block's output is [batch = {}, features..] (a logit [batch] is not a block's output)",
                g.name(o),
                self.batch
            );
        }
        self.outputs.push((name.to_string(), o));
        let first = g.nodes().len();
        if !self.detached {
            self.marked_nodes.push(first..first);
            return Ok(o);
        }
        let (label, batch) = (self.label, self.batch);
        let loss = g.scoped(&format!("{name}_head"), |g| -> Result<Tensor> {
            let flat = if g.shape(o).dims().len() > 2 {
                g.flatten(o)?
            } else {
                o
            };
            let h = g.linear(flat, 1)?;
            let h = g.reshape(h, &[batch])?;
            Ok(g.bce_with_logits(h, label)?)
        })?;
        self.aux_losses.push((name.to_string(), loss));
        let cut = g.detach(o)?;
        self.marked_nodes.push(first..g.nodes().len());
        Ok(cut)
    }
}

/// A CTR model the trainer can train (see the module's documentation).
pub trait Model: Send + Sync {
    /// The name `--model` and `[model] model` select it by.
    fn name(&self) -> &str;
    /// Its sizes at the spec preset (`spec`) or the small one, from the preset's: the
    /// widths it reads from the config (the default keeps them).
    fn sizes(&self, cfg: CtrConfig, _spec: bool) -> CtrConfig {
        cfg
    }
    /// Builds the dense part on `x` and returns the main logit `[B]`.
    fn build(
        &self,
        g: &mut Graph,
        x: &ModelInputs,
        cfg: &CtrConfig,
        blocks: &mut Blocks,
    ) -> Result<Tensor>;
}

fn registry() -> &'static Mutex<Vec<Arc<dyn Model>>> {
    static R: OnceLock<Mutex<Vec<Arc<dyn Model>>>> = OnceLock::new();
    R.get_or_init(|| Mutex::new(super::zoo::models()))
}

/// Makes `model` selectable by its name, replacing a model of the zoo of the same name;
/// `spec`, the spec's model, cannot be replaced, and a name must be one word.
pub fn register(model: Arc<dyn Model>) -> Result<()> {
    let name = model.name();
    if name == "spec" {
        bail!("a model cannot be named 'spec': that is the spec's model, built by the trainer itself; choose another name");
    }
    if name.is_empty() || name.chars().any(|c| c.is_whitespace() || c == ',') {
        bail!("model name '{name}': a name is one word, without spaces or commas");
    }
    let mut r = match registry().lock() {
        Ok(r) => r,
        Err(_) => bail!("the model registry is unusable (a thread panicked holding it)"),
    };
    r.retain(|m| m.name() != name);
    r.push(model);
    Ok(())
}

/// The model named `name`; `spec` is built by `model::ctr` itself and is not here.
pub fn find(name: &str) -> Result<Arc<dyn Model>> {
    let r = match registry().lock() {
        Ok(r) => r,
        Err(_) => bail!("the model registry is unusable (a thread panicked holding it)"),
    };
    if let Some(m) = r.iter().find(|m| m.name() == name) {
        return Ok(m.clone());
    }
    let mut names: Vec<String> = vec!["spec".to_string()];
    names.extend(r.iter().map(|m| m.name().to_string()));
    bail!("unknown model '{name}' (models: {})", names.join(", "))
}

/// `base` made model `name`'s: its sizes (its own at the spec preset when `spec`, else
/// `base`'s as it chooses) and its name; `spec`, the spec's model, leaves `base` as it is.
pub fn configure(name: &str, base: CtrConfig, spec: bool) -> Result<CtrConfig> {
    if name == "spec" {
        return Ok(base);
    }
    let mut c = find(name)?.sizes(base, spec);
    c.model = name.to_string();
    Ok(c)
}

/// Every model name: `spec` and the registered ones.
pub fn names() -> Vec<String> {
    let mut names = vec!["spec".to_string()];
    if let Ok(r) = registry().lock() {
        names.extend(r.iter().map(|m| m.name().to_string()));
    }
    names
}
