//! Checkpoints: every persistent tensor (parameters and optimizer state) in one
//! safetensors file, whose metadata holds a small JSON with the step, the data position
//! and the configuration. Written atomically (a temporary file in the same folder,
//! flushed to disk, then renamed over the old one), so a crash never leaves a half
//! checkpoint under the real name; the temporary files of writers that died are removed
//! by the next write. The metadata holds a checksum of every tensor: a truncated,
//! foreign or corrupted file (one flipped bit) is refused on load, and so is a
//! parameter that is not finite, by the tensor's name.

use std::io::Write as _;
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use safetensors::tensor::Dtype;

use erase_graph::{DType, Graph, Tensor};
use erase_ops::Buffer;

/// Access to the values of a running step's persistent tensors.
pub trait TensorStore {
    fn read(&self, t: Tensor) -> Result<Buffer>;
    fn write(&mut self, t: Tensor, b: Buffer) -> Result<()>;
    /// The shape `t` is read and written with: its shape in `g`, unless the store keeps
    /// it otherwise (a sharded rank's tables are read and written whole).
    fn dims(&self, g: &Graph, t: Tensor) -> Vec<usize> {
        g.shape(t).dims().to_vec()
    }
    /// Calls `f` with `t`'s value: borrowed where the store keeps it on the host (no
    /// copy of a large table), else as [`TensorStore::read`] gives it.
    fn visit(&self, t: Tensor, f: &mut dyn FnMut(&Buffer) -> Result<()>) -> Result<()> {
        f(&self.read(t)?)
    }
}

impl TensorStore for erase_runtime::cpu::runner::ProgramRunner<'_> {
    fn read(&self, t: Tensor) -> Result<Buffer> {
        self.get(t).ok_or_else(|| anyhow!("tensor has no value"))
    }
    fn visit(&self, t: Tensor, f: &mut dyn FnMut(&Buffer) -> Result<()>) -> Result<()> {
        match self.leaf(t) {
            Some(b) => f(b),
            None => f(&self.read(t)?),
        }
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
    /// The configuration that must match on resume (model sizes, variant, optimizer,
    /// seeds, the data's content), as `(key, value)` pairs.
    pub identity: Vec<(String, String)>,
}

impl CheckpointState {
    /// The value of an identity key (`variant`, `model.rows`, ...).
    pub fn get(&self, key: &str) -> Option<&str> {
        self.identity
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

const FORMAT: &str = "erase-checkpoint-2";

/// The checksum stored for each tensor in the metadata's `checksums` (of its
/// little-endian bytes, as 16 hex digits).
pub fn tensor_checksum(bytes: &[u8]) -> String {
    format!("{:016x}", crate::data::checksum(&[bytes]))
}

/// Flattens a `Debug` rendering of plain data (`Name { a: 1, b: [2, 3], c: Inner { d: 4 } }`)
/// into `(path, value)` pairs (`a = 1`, `b = [2, 3]`, `c.d = 4`), so that two
/// configurations can be compared field by field. Text that is not a struct is one pair
/// under `prefix`.
pub fn flatten_debug(prefix: &str, text: &str) -> Vec<(String, String)> {
    let text = text.trim();
    let open = text.find('{');
    let inner = match open {
        Some(i) if text.ends_with('}') && !text[..i].contains(['[', '(', '"']) => {
            &text[i + 1..text.len() - 1]
        }
        _ => return vec![(prefix.to_string(), text.to_string())],
    };
    // split on top-level commas
    let (mut parts, mut depth, mut start, mut quoted) = (Vec::new(), 0i32, 0, false);
    let bytes = inner.as_bytes();
    for (i, &b) in bytes.iter().enumerate() {
        match b {
            b'"' if i == 0 || bytes[i - 1] != b'\\' => quoted = !quoted,
            b'{' | b'[' | b'(' if !quoted => depth += 1,
            b'}' | b']' | b')' if !quoted => depth -= 1,
            b',' if depth == 0 && !quoted => {
                parts.push(&inner[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&inner[start..]);
    let mut out = Vec::new();
    for part in parts.into_iter().map(str::trim).filter(|p| !p.is_empty()) {
        match part.split_once(": ") {
            Some((k, v)) if !k.contains([' ', '{', '[', '"']) => {
                let key = if prefix.is_empty() {
                    k.to_string()
                } else {
                    format!("{prefix}.{k}")
                };
                out.extend(flatten_debug(&key, v));
            }
            _ => out.push((prefix.to_string(), part.to_string())),
        }
    }
    out
}

/// The file a checkpoint (or another output, `what` naming its flag) at `path` replaces:
/// `path`, or the file a link there names (the link is kept). Refuses a folder and what
/// is not a regular file (a device, a pipe, a socket), which writing it would replace.
pub(crate) fn target_file(what: &str, path: &Path) -> Result<std::path::PathBuf> {
    let real = match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_symlink() => match std::fs::canonicalize(path) {
            Ok(p) => p,
            // a link to a file not written yet: its target, beside the link
            Err(_) => {
                let to = std::fs::read_link(path)
                    .with_context(|| format!("{what} {}: reading the link", path.display()))?;
                match path.parent() {
                    Some(dir) if to.is_relative() => dir.join(to),
                    _ => to,
                }
            }
        },
        _ => path.to_path_buf(),
    };
    match std::fs::metadata(&real) {
        Ok(m) if m.is_dir() => bail!("{what} {} is a folder; give a file name", path.display()),
        Ok(m) if !m.is_file() => bail!(
            "{what} {} is not a regular file (a device, a pipe or a socket), which writing it would replace; give a file name",
            path.display()
        ),
        _ => Ok(real),
    }
}

/// Checks, before a run spends its steps, that a checkpoint can be written at `path`:
/// a regular file or none, in a folder that exists and takes new files.
pub fn check_writable(path: &Path) -> Result<()> {
    let path = &target_file("checkpoint", path)?;
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    if !dir.is_dir() {
        bail!(
            "checkpoint {}: the folder {} does not exist",
            path.display(),
            dir.display()
        );
    }
    let probe = dir.join(format!(".erase-write-probe-{}", std::process::id()));
    std::fs::File::create(&probe).with_context(|| {
        format!(
            "checkpoint {}: cannot create files in {}",
            path.display(),
            dir.display()
        )
    })?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

/// Whether process `pid` is alive on this host.
pub(crate) fn process_alive(pid: u32) -> bool {
    if pid == std::process::id() {
        return true;
    }
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    // SAFETY: signal 0 only asks whether the process exists; nothing is sent.
    let r = unsafe { libc::kill(pid, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// Removes the files of `dir` whose names start with `prefix` followed by the id of a
/// process that is no longer running (temporary files of writers that were killed).
/// Returns how many it removed.
pub(crate) fn remove_stale_temps(dir: &Path, prefix: &str, pid_end: &[char]) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut removed = 0;
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix(prefix) else {
            continue;
        };
        let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
        let after = &rest[digits.len()..];
        let ends_right = after.is_empty() || after.starts_with(pid_end);
        let stale = ends_right && digits.parse::<u32>().is_ok_and(|pid| !process_alive(pid));
        if stale && std::fs::remove_file(e.path()).is_ok() {
            removed += 1;
        }
    }
    removed
}

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

/// A safetensors header: each tensor's type, shape and byte range, and the metadata
/// (`erase`: `meta` as JSON text), padded with spaces to a multiple of 8 bytes.
fn st_header(
    entries: &[(String, DType, Vec<usize>, usize, usize)],
    meta: &serde_json::Value,
) -> Vec<u8> {
    let mut h = serde_json::Map::new();
    h.insert(
        "__metadata__".into(),
        serde_json::json!({ "erase": meta.to_string() }),
    );
    for (name, d, dims, a, b) in entries {
        h.insert(
            name.clone(),
            serde_json::json!({ "dtype": st_dtype(*d), "shape": dims, "data_offsets": [a, b] }),
        );
    }
    let mut bytes = serde_json::Value::Object(h).to_string().into_bytes();
    bytes.resize(bytes.len().next_multiple_of(8), b' ');
    bytes
}

/// Writes a checkpoint of `store` to `path` atomically, one tensor at a time: each is
/// read (borrowed, from a CPU store), summed and written before the next is read, so
/// the write needs at most the memory of the largest tensor beside the store, not a
/// copy of the whole state. The header is
/// written first with placeholder checksums of the same length and rewritten with the
/// real ones at the end.
pub fn save(
    path: &Path,
    g: &Graph,
    store: &dyn TensorStore,
    state: &CheckpointState,
) -> Result<()> {
    let names = persistent(g)?;
    // every tensor's place in the file, from its type and the shape it is stored with
    let mut entries = Vec::with_capacity(names.len());
    let mut end = 0usize;
    for (name, t) in &names {
        let dims = store.dims(g, *t);
        let len = dims
            .iter()
            .try_fold(g.dtype(*t).size_bytes(), |a, &d| a.checked_mul(d))
            .ok_or_else(|| anyhow!("tensor '{name}' {dims:?} is too large to checkpoint"))?;
        entries.push((name.clone(), g.dtype(*t), dims, end, end + len));
        end += len;
    }
    let identity: serde_json::Map<String, serde_json::Value> = state
        .identity
        .iter()
        .map(|(k, v)| (k.clone(), v.clone().into()))
        .collect();
    let meta_with = |sums: &[String]| {
        let sums: serde_json::Map<String, serde_json::Value> = names
            .iter()
            .zip(sums)
            .map(|((name, _), c)| (name.clone(), c.clone().into()))
            .collect();
        serde_json::json!({
            "format": FORMAT,
            "step": state.step,
            "next_example": state.next_example,
            "identity": identity,
            "checksums": sums,
        })
    };
    // checksums are 16 hex digits: the header keeps its length when they are filled in
    let placeholder = vec!["0".repeat(16); names.len()];
    let header = st_header(&entries, &meta_with(&placeholder));

    let shown = path;
    let path = &target_file("checkpoint", path)
        .with_context(|| format!("writing checkpoint {}", shown.display()))?;
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let file_name = path
        .file_name()
        .ok_or_else(|| anyhow!("checkpoint path {} has no file name", path.display()))?;
    let tmp_prefix = format!(".{}.tmp-", file_name.to_string_lossy());
    remove_stale_temps(dir, &tmp_prefix, &[]);
    let tmp = dir.join(format!("{tmp_prefix}{}", std::process::id()));
    let write = || -> Result<()> {
        use std::io::{Seek as _, SeekFrom};
        let f =
            std::fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
        let mut w = std::io::BufWriter::with_capacity(1 << 20, f);
        w.write_all(&(header.len() as u64).to_le_bytes())?;
        w.write_all(&header)?;
        let mut sums = Vec::with_capacity(names.len());
        for ((name, t), (_, d, _, a, b)) in names.iter().zip(&entries) {
            let mut put = |buf: &Buffer| -> Result<()> {
                if buf.dtype() != *d || buf.bytes().len() != b - a {
                    bail!(
                        "tensor '{name}': the store holds {} bytes of {}, its shape needs {} of {d}",
                        buf.bytes().len(),
                        buf.dtype(),
                        b - a
                    );
                }
                sums.push(tensor_checksum(buf.bytes()));
                Ok(w.write_all(buf.bytes())?)
            };
            store
                .visit(*t, &mut put)
                .with_context(|| format!("reading '{name}' for the checkpoint"))?;
        }
        let final_header = st_header(&entries, &meta_with(&sums));
        if final_header.len() != header.len() {
            bail!("the checkpoint header changed length when its checksums were filled in");
        }
        let mut f = w.into_inner().map_err(|e| e.into_error())?;
        f.seek(SeekFrom::Start(8))?;
        f.write_all(&final_header)?;
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
    r.with_context(|| format!("writing checkpoint {}", shown.display()))
}

/// The metadata of a checkpoint file and its bytes, checked to be an Erase checkpoint.
fn read_meta(path: &Path) -> Result<(Vec<u8>, CheckpointState, serde_json::Value)> {
    if path.is_dir() {
        bail!("{} is a folder, not a checkpoint file", path.display());
    }
    let bytes =
        std::fs::read(path).with_context(|| format!("reading checkpoint {}", path.display()))?;
    safetensors::SafeTensors::deserialize(&bytes).map_err(|e| {
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
    let (state, v) = state_of(path, json)?;
    Ok((bytes, state, v))
}

/// The state an Erase checkpoint's metadata (`json`, the `erase` entry) records.
fn state_of(path: &Path, json: &str) -> Result<(CheckpointState, serde_json::Value)> {
    let v: serde_json::Value = serde_json::from_str(json)
        .with_context(|| format!("{}: bad checkpoint metadata", path.display()))?;
    if v["format"] != FORMAT {
        bail!(
            "{}: checkpoint format {} (this build reads {FORMAT}, with a checksum per tensor)",
            path.display(),
            v["format"]
        );
    }
    let identity = v["identity"]
        .as_object()
        .ok_or_else(|| anyhow!("{}: no identity in the metadata", path.display()))?
        .iter()
        .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_string()))
        .collect();
    let state = CheckpointState {
        step: v["step"]
            .as_u64()
            .ok_or_else(|| anyhow!("{}: no step in the metadata", path.display()))?,
        next_example: v["next_example"]
            .as_u64()
            .ok_or_else(|| anyhow!("{}: no data position", path.display()))?,
        identity,
    };
    Ok((state, v))
}

/// What a checkpoint says besides its tensors, without loading them (to choose the
/// model a checkpoint needs before building it): its header alone is read, and its
/// length checked against the tensors the header lists (a truncated file is refused
/// here; `load` verifies every tensor).
pub fn peek(path: &Path) -> Result<CheckpointState> {
    use std::io::Read as _;
    let incomplete = |why: &str| {
        anyhow!(
            "{} is not a complete checkpoint ({why}); was it truncated?",
            path.display()
        )
    };
    if path.is_dir() {
        bail!("{} is a folder, not a checkpoint file", path.display());
    }
    let mut f = std::fs::File::open(path)
        .with_context(|| format!("reading checkpoint {}", path.display()))?;
    let len = f
        .metadata()
        .with_context(|| format!("reading checkpoint {}", path.display()))?
        .len();
    let mut n = [0u8; 8];
    f.read_exact(&mut n)
        .map_err(|_| incomplete("no header length"))?;
    let n = u64::from_le_bytes(n);
    if n > len.saturating_sub(8) || n > 100 << 20 {
        return Err(incomplete("a header longer than the file"));
    }
    let mut head = vec![0u8; n as usize];
    f.read_exact(&mut head)
        .map_err(|_| incomplete("a short header"))?;
    let header: serde_json::Value = serde_json::from_slice(&head)
        .map_err(|e| anyhow!("{} is not a safetensors file ({e})", path.display()))?;
    let end = header
        .as_object()
        .into_iter()
        .flatten()
        .filter_map(|(_, t)| t["data_offsets"][1].as_u64())
        .max()
        .unwrap_or(0);
    if 8 + n + end != len {
        return Err(incomplete(&format!(
            "{len} bytes, its header lists {}",
            8 + n + end
        )));
    }
    let json = header["__metadata__"]["erase"].as_str().ok_or_else(|| {
        anyhow!(
            "{} is a safetensors file but not an Erase checkpoint",
            path.display()
        )
    })?;
    state_of(path, json).map(|(s, _)| s)
}

/// The keys whose values differ between a checkpoint's identity and a run's, as
/// `key: checkpoint value, this run value` lines.
pub fn identity_diff(ckpt: &[(String, String)], now: &[(String, String)]) -> Vec<String> {
    let get = |v: &[(String, String)], k: &str| {
        v.iter()
            .find(|(key, _)| key == k)
            .map_or("(not set)".to_string(), |(_, x)| x.clone())
    };
    let mut keys: Vec<&str> = ckpt.iter().map(|(k, _)| k.as_str()).collect();
    for (k, _) in now {
        if !keys.contains(&k.as_str()) {
            keys.push(k);
        }
    }
    keys.into_iter()
        .filter_map(|k| {
            let (a, b) = (get(ckpt, k), get(now, k));
            (a != b).then(|| format!("{k}: the checkpoint has {a}, this run has {b}"))
        })
        .collect()
}

/// Reads a checkpoint into `store`. Refuses a truncated, foreign or corrupted file (every
/// tensor's checksum is verified), a missing or misshapen tensor, a parameter that is
/// not finite, and (when given) an identity other than `expect`, naming each key that
/// differs.
pub fn load(
    path: &Path,
    g: &Graph,
    store: &mut dyn TensorStore,
    expect: Option<&[(String, String)]>,
) -> Result<CheckpointState> {
    let (bytes, state, v) = read_meta(path)?;
    if let Some(expect) = expect {
        let diff = identity_diff(&state.identity, expect);
        if !diff.is_empty() {
            bail!(
                "{} was written by another configuration; resume needs the same one:\n  {}",
                path.display(),
                diff.join("\n  ")
            );
        }
    }
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| anyhow!("{}: {e}", path.display()))?;
    let hint = || -> String {
        let mut h = Vec::new();
        if let Some(model) = state.get("model.model") {
            h.push(format!("--model {}", model.trim_matches('"')));
        }
        if let Some(variant) = state.get("variant") {
            h.push(format!("--variant {variant}"));
        }
        for (k, flag) in [("model.batch", "--batch"), ("model.rows", "--rows")] {
            if let Some(x) = state.get(k) {
                h.push(format!("{flag} {x}"));
            }
        }
        if h.is_empty() {
            String::new()
        } else {
            format!(
                " (it was trained with {}: pass the same flags)",
                h.join(" ")
            )
        }
    };
    for (name, t) in persistent(g)? {
        let view = st
            .tensor(&name)
            .map_err(|_| anyhow!("{}: tensor '{name}' is missing{}", path.display(), hint()))?;
        let want = store.dims(g, t);
        if view.shape() != want.as_slice() || view.dtype() != st_dtype(g.dtype(t)) {
            bail!(
                "{}: tensor '{name}' is {:?} {:?}, the model needs {:?} {}{}",
                path.display(),
                view.dtype(),
                view.shape(),
                want,
                g.dtype(t),
                hint()
            );
        }
        let stored = v["checksums"][name.as_str()]
            .as_str()
            .ok_or_else(|| anyhow!("{}: no checksum for tensor '{name}'", path.display()))?;
        if tensor_checksum(view.data()) != stored {
            bail!(
                "{}: tensor '{name}' does not match its checksum: the file is corrupted",
                path.display()
            );
        }
        let b = erase_runtime::cpu::buffer_from_bytes(g.dtype(t), view.data());
        let bad = match &b {
            Buffer::F32(x) => x.iter().position(|v| !v.is_finite()),
            Buffer::F64(x) => x.iter().position(|v| !v.is_finite()),
            _ => None,
        };
        if let Some(i) = bad {
            bail!(
                "{}: tensor '{name}' holds a value that is not finite (element {i}); the run that wrote it diverged",
                path.display()
            );
        }
        store
            .write(t, b)
            .with_context(|| format!("restoring '{name}'"))?;
    }
    Ok(state)
}
