//! Checkpoints: every persistent tensor (parameters and optimizer state) in one
//! safetensors file, whose metadata holds a small JSON with the step, the data position
//! and the configuration. Written atomically (a temporary file in the same folder,
//! flushed to disk, then renamed over the old one), so a crash never leaves a half
//! checkpoint under the real name; a truncated or foreign file is refused on load.

use std::collections::HashMap;
use std::io::Write as _;
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use safetensors::tensor::{Dtype, TensorView};

use erase_graph::{DType, Graph, Tensor};
use erase_ops::Buffer;

/// Access to the values of a running step's persistent tensors.
pub trait TensorStore {
    fn read(&self, t: Tensor) -> Result<Buffer>;
    fn write(&mut self, t: Tensor, b: Buffer) -> Result<()>;
}

impl TensorStore for erase_runtime::program::ProgramRunner<'_> {
    fn read(&self, t: Tensor) -> Result<Buffer> {
        self.get(t).ok_or_else(|| anyhow!("tensor has no value"))
    }
    fn write(&mut self, t: Tensor, b: Buffer) -> Result<()> {
        Ok(self.feed(t, b)?)
    }
}

/// What a checkpoint says besides its tensors.
#[derive(Clone, Debug, PartialEq)]
pub struct CheckpointState {
    /// Training steps completed.
    pub step: u64,
    /// Index of the next training example.
    pub next_example: u64,
    /// The configuration that must match on resume (model sizes, variant, optimizer).
    pub config: String,
}

const FORMAT: &str = "erase-checkpoint-1";

fn st_dtype(d: DType) -> Dtype {
    match d {
        DType::F32 => Dtype::F32,
        DType::F64 => Dtype::F64,
        DType::I32 => Dtype::I32,
        DType::Bf16 => Dtype::BF16,
    }
}

/// The persistent tensors of `g`, by their unique names.
fn persistent(g: &Graph) -> Result<Vec<(String, Tensor)>> {
    let mut v: Vec<(String, Tensor)> = g
        .tensors()
        .filter(|&t| g.is_persistent(t))
        .map(|t| (g.name(t).to_string(), t))
        .collect();
    v.sort();
    if let Some(w) = v.windows(2).find(|w| w[0].0 == w[1].0) {
        bail!(
            "two persistent tensors are both named '{}': name them apart to checkpoint",
            w[0].0
        );
    }
    Ok(v)
}

/// Writes a checkpoint of `store` to `path` atomically.
pub fn save(
    path: &Path,
    g: &Graph,
    store: &dyn TensorStore,
    state: &CheckpointState,
) -> Result<()> {
    let names = persistent(g)?;
    let mut bufs = Vec::with_capacity(names.len());
    for (name, t) in &names {
        bufs.push((
            name.clone(),
            *t,
            store
                .read(*t)
                .with_context(|| format!("reading '{name}' for the checkpoint"))?,
        ));
    }
    let views: Vec<(String, TensorView)> = bufs
        .iter()
        .map(|(name, t, b)| {
            let view = TensorView::new(st_dtype(b.dtype()), g.shape(*t).dims().to_vec(), b.bytes())
                .map_err(|e| anyhow!("tensor '{name}': {e}"))?;
            Ok((name.clone(), view))
        })
        .collect::<Result<_>>()?;
    let meta = serde_json::json!({
        "format": FORMAT,
        "step": state.step,
        "next_example": state.next_example,
        "config": state.config,
    });
    let mut info = HashMap::new();
    info.insert("erase".to_string(), meta.to_string());
    let bytes = safetensors::serialize(views, Some(info))
        .map_err(|e| anyhow!("serialising the checkpoint: {e}"))?;

    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let file_name = path
        .file_name()
        .ok_or_else(|| anyhow!("checkpoint path {} has no file name", path.display()))?;
    let tmp = dir.join(format!(
        ".{}.tmp-{}",
        file_name.to_string_lossy(),
        std::process::id()
    ));
    let write = || -> Result<()> {
        let mut f =
            std::fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
        f.write_all(&bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
            .with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))?;
        // make the rename itself durable
        if let Ok(d) = std::fs::File::open(dir) {
            let _ = d.sync_all();
        }
        Ok(())
    };
    let r = write();
    if r.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    r.with_context(|| format!("writing checkpoint {}", path.display()))
}

/// Reads a checkpoint into `store`. Refuses a truncated or foreign file, a missing or
/// misshapen tensor, and (when given) a configuration other than `expect_config`.
pub fn load(
    path: &Path,
    g: &Graph,
    store: &mut dyn TensorStore,
    expect_config: Option<&str>,
) -> Result<CheckpointState> {
    let bytes =
        std::fs::read(path).with_context(|| format!("reading checkpoint {}", path.display()))?;
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| {
        anyhow!(
            "{} is not a complete checkpoint ({e}); was it truncated?",
            path.display()
        )
    })?;
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes)
        .map_err(|e| anyhow!("{}: {e}", path.display()))?;
    let json = meta
        .metadata()
        .as_ref()
        .and_then(|m| m.get("erase"))
        .ok_or_else(|| {
            anyhow!(
                "{} is a safetensors file but not an Erase checkpoint",
                path.display()
            )
        })?;
    let v: serde_json::Value = serde_json::from_str(json)
        .with_context(|| format!("{}: bad checkpoint metadata", path.display()))?;
    if v["format"] != FORMAT {
        bail!(
            "{}: unknown checkpoint format {}",
            path.display(),
            v["format"]
        );
    }
    let config = v["config"].as_str().unwrap_or_default().to_string();
    if let Some(expect) = expect_config.filter(|e| *e != config) {
        bail!(
            "{} was written with another configuration:\n  checkpoint: {config}\n  now:        {expect}",
            path.display()
        );
    }
    let state = CheckpointState {
        step: v["step"]
            .as_u64()
            .ok_or_else(|| anyhow!("{}: no step in the metadata", path.display()))?,
        next_example: v["next_example"]
            .as_u64()
            .ok_or_else(|| anyhow!("{}: no data position", path.display()))?,
        config,
    };
    for (name, t) in persistent(g)? {
        let view = st
            .tensor(&name)
            .map_err(|_| anyhow!("{}: tensor '{name}' is missing", path.display()))?;
        let want = g.shape(t).dims();
        if view.shape() != want || view.dtype() != st_dtype(g.dtype(t)) {
            bail!(
                "{}: tensor '{name}' is {:?} {:?}, the model needs {:?} {}",
                path.display(),
                view.dtype(),
                view.shape(),
                want,
                g.dtype(t)
            );
        }
        let b = erase_runtime::cuda::buffer_from_bytes(g.dtype(t), view.data());
        store
            .write(t, b)
            .with_context(|| format!("restoring '{name}'"))?;
    }
    Ok(state)
}
