//! The binary cache of parsed examples: written once (a temporary file in the cache
//! folder, then a rename), memory-mapped by later loads.
//!
//! File `<stem>-<16 hex>.erase-cache`, the hex an FNV-1a hash of the format version, the
//! reader, the schema and the canonical source paths. All integers little-endian:
//!
//! ```text
//!   0  [u8; 8]  magic "ERASEDS\0"
//!   8  u32      format version (2)
//!  12  u32      flags: bit 0 set = multi-hot (fields hold bags of any length)
//!  16  u64      header_len: where the payload starts (a multiple of 8)
//!  24  u64      total_len: the file's exact length
//!  32  u64      num_dense
//!  40  u64      num_sparse
//!  48  u64      train examples
//!  56  u64      eval examples
//!  64  u64      files
//!  72  u64      lines
//!  80  u64      malformed
//!  88  u64      key_len
//!  96  u64      errors_len
//! 104  u64      payload checksum
//! 112  u64      header checksum (bytes 0..112, then the key and the errors)
//! 120  key      UTF-8: version, reader, schema, then each source's canonical path,
//!               size and mtime (ns)
//!      errors   the report's first errors, separated by NUL; zero padding to 8
//! header_len:   the train split, then the eval split, each as
//!               dense f32[n*num_dense], (multi-hot only) bag ends u64[n*num_sparse]
//!               (the end in ids of each bag), ids u32[n*num_sparse, or the last bag
//!               end], missing bits u8[ceil(n*num_sparse/8)] (bit k of byte k/8, LSB
//!               first), labels f32[n]; every section zero-padded to a multiple of 8
//!               bytes.
//! ```
//!
//! A load uses the file only if the magic, version, header checksum, key (so the
//! sources' sizes and mtimes), exact length and payload checksum all match; otherwise it
//! says why and the caller rebuilds it. Checksums: 4-lane xxHash64-style rounds.

use std::fs::File;
use std::io::{Seek, SeekFrom, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::UNIX_EPOCH;

use anyhow::{anyhow, bail, Result};
use memmap2::Mmap;

use super::table::{Columns, DataSource, Examples, LoadReport};

const MAGIC: [u8; 8] = *b"ERASEDS\0";
const VERSION: u32 = 2;
const FIXED: usize = 120;
const SUFFIX: &str = ".erase-cache";

/// Whether a file name is a cache file or a cache being written (never data).
pub(crate) fn is_cache_file_name(name: &str) -> bool {
    name.ends_with(SUFFIX) || name.contains(".erase-cache.tmp")
}

/// Where the cache of a source lives and what it must have been built from.
pub(crate) struct CacheKey {
    pub path: PathBuf,
    key: String,
}

fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

impl CacheKey {
    pub fn new(dir: &Path, src: &DataSource, files: &[PathBuf]) -> Result<CacheKey> {
        let mut ident = format!("erase data cache v{VERSION}\n");
        match src {
            DataSource::Criteo { .. } => ident += "criteo\n",
            DataSource::Tsv { schema, .. } => ident += &format!("tsv {schema:?}\n"),
        }
        let mut stats = String::new();
        for f in files {
            let canon = f
                .canonicalize()
                .map_err(|e| anyhow!("data file {}: {e}", f.display()))?;
            let meta =
                std::fs::metadata(&canon).map_err(|e| anyhow!("data file {}: {e}", f.display()))?;
            let mtime = meta
                .modified()
                .ok()
                .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
                .map_or(0, |d| d.as_nanos());
            ident += &format!("{}\n", canon.display());
            stats += &format!("{} {} {}\n", canon.display(), meta.len(), mtime);
        }
        let stem: String = Path::new(src.path())
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '.' || c == '_' {
                    c
                } else {
                    '_'
                }
            })
            .take(48)
            .collect();
        let stem = stem.trim_start_matches('.');
        let name = format!("{stem}-{:016x}{SUFFIX}", fnv1a(ident.as_bytes()));
        Ok(CacheKey {
            path: dir.join(name),
            key: ident + &stats,
        })
    }
}

/// A valid cache, mapped.
pub(crate) struct Hit {
    pub train: Examples,
    pub eval: Option<Examples>,
    pub report: LoadReport,
}

/// xxHash64-style checksum over 4 lanes of 8-byte words, streamed.
struct Checksum {
    lanes: [u64; 4],
    buf: [u8; 32],
    fill: usize,
    total: u64,
}

const P1: u64 = 0x9E37_79B1_85EB_CA87;
const P2: u64 = 0xC2B2_AE3D_27D4_EB4F;

impl Checksum {
    fn new() -> Self {
        Checksum {
            lanes: [P1.wrapping_add(P2), P2, 0, P1.wrapping_neg()],
            buf: [0; 32],
            fill: 0,
            total: 0,
        }
    }

    #[inline]
    fn block(lanes: &mut [u64; 4], b: &[u8]) {
        for (l, w) in lanes.iter_mut().zip(b.chunks_exact(8)) {
            let w = u64::from_le_bytes([w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]]);
            *l = l
                .wrapping_add(w.wrapping_mul(P2))
                .rotate_left(31)
                .wrapping_mul(P1);
        }
    }

    fn update(&mut self, mut data: &[u8]) {
        self.total += data.len() as u64;
        if self.fill > 0 {
            let take = (32 - self.fill).min(data.len());
            self.buf[self.fill..self.fill + take].copy_from_slice(&data[..take]);
            self.fill += take;
            data = &data[take..];
            if self.fill < 32 {
                return;
            }
            let buf = self.buf;
            Self::block(&mut self.lanes, &buf);
            self.fill = 0;
        }
        let mut blocks = data.chunks_exact(32);
        for b in &mut blocks {
            Self::block(&mut self.lanes, b);
        }
        let rest = blocks.remainder();
        self.buf[..rest.len()].copy_from_slice(rest);
        self.fill = rest.len();
    }

    fn finish(mut self) -> u64 {
        if self.fill > 0 {
            self.buf[self.fill..].fill(0);
            let buf = self.buf;
            Self::block(&mut self.lanes, &buf);
        }
        let mut h = self.total.wrapping_mul(P1);
        for l in self.lanes {
            h = super::synthetic::splitmix64(h ^ l);
        }
        h
    }
}

/// The checksum of `parts` read as one byte string (also the data's identity in checkpoints).
pub(crate) fn checksum(parts: &[&[u8]]) -> u64 {
    let mut c = Checksum::new();
    for p in parts {
        c.update(p);
    }
    c.finish()
}

fn pad8(n: usize) -> Option<usize> {
    n.checked_add(7).map(|x| x & !7)
}

/// One split's sections: [dense, ids, missing, labels], the bag ends of multi-hot data.
type Sections = ([Range<usize>; 4], Option<Range<usize>>);

/// Byte ranges of one split's sections starting at `at`, and the end. `ids`: how many ids
/// (for multi-hot data, read from the bag ends: `ids_of(ends)`).
fn layout(
    at: usize,
    n: usize,
    nd: usize,
    ns: usize,
    multi: bool,
    ids_of: impl FnOnce(Range<usize>) -> Option<usize>,
) -> Option<(Sections, usize)> {
    let mut pos = at;
    let mut take = |bytes: usize| -> Option<Range<usize>> {
        let end = pos.checked_add(bytes)?;
        let r = pos..end;
        pos = pad8(end)?;
        Some(r)
    };
    let dense = take(n.checked_mul(nd)?.checked_mul(4)?)?;
    let (ends, n_ids) = if multi {
        let ends = take(n.checked_mul(ns)?.checked_mul(8)?)?;
        let n_ids = ids_of(ends.clone())?;
        (Some(ends), n_ids)
    } else {
        (None, n.checked_mul(ns)?)
    };
    let ids = take(n_ids.checked_mul(4)?)?;
    let missing = take(n.checked_mul(ns)?.div_ceil(8))?;
    let labels = take(n.checked_mul(4)?)?;
    Some((([dense, ids, missing, labels], ends), pos))
}

/// The ids of a multi-hot split: its last bag end (0 without bags), read from `b`.
fn last_end(b: &[u8], ends: Range<usize>) -> Option<usize> {
    if ends.is_empty() {
        return Some(0);
    }
    if ends.end > b.len() {
        return None;
    }
    usize::try_from(u64_at(b, ends.end - 8)).ok()
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(w)
}

fn usize_at(b: &[u8], at: usize, what: &str) -> Result<usize> {
    usize::try_from(u64_at(b, at)).map_err(|_| anyhow!("corrupt header: {what} too large"))
}

/// The cache of `key`: `Ok(None)` if there is none, `Err(why)` if there is one that
/// cannot be used (stale, truncated, corrupt).
pub(crate) fn open(key: &CacheKey) -> Result<Option<Hit>> {
    if cfg!(target_endian = "big") {
        bail!("the cache format is little-endian; this machine is big-endian");
    }
    let file = match File::open(&key.path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => bail!("cannot open: {e}"),
    };
    let len = file
        .metadata()
        .map_err(|e| anyhow!("cannot stat: {e}"))?
        .len();
    if len < FIXED as u64 {
        bail!("truncated: {len} bytes, shorter than the header");
    }
    // SAFETY: the map is read-only and we only map cache files, which this module
    // writes whole and then renames into place (never rewriting a file in place), so
    // nothing we do changes the file while it is mapped. What could still go wrong: a
    // person or another program truncating or rewriting this file while it is mapped
    // (reads past a truncation raise SIGBUS; a rewrite changes the data under us). The
    // sources' sizes and mtimes in the key and the checksums guard against stale or
    // damaged files at open time only.
    let map = unsafe { Mmap::map(&file) }.map_err(|e| anyhow!("cannot map: {e}"))?;
    let b = &map[..];
    if b[0..8] != MAGIC {
        bail!("not a cache file (bad magic)");
    }
    let version = u32::from_le_bytes([b[8], b[9], b[10], b[11]]);
    if version != VERSION {
        bail!("format version {version}, expected {VERSION}");
    }
    let header_len = usize_at(b, 16, "header_len")?;
    let total_len = u64_at(b, 24);
    if total_len != len {
        bail!("truncated or extended: {len} bytes, the header says {total_len}");
    }
    let key_len = usize_at(b, 88, "key_len")?;
    let errors_len = usize_at(b, 96, "errors_len")?;
    let text_end = FIXED
        .checked_add(key_len)
        .and_then(|x| x.checked_add(errors_len))
        .filter(|&e| e <= header_len && header_len <= b.len() && header_len & 7 == 0)
        .ok_or_else(|| anyhow!("corrupt header: lengths out of range"))?;
    if checksum(&[&b[..112], &b[FIXED..text_end]]) != u64_at(b, 112) {
        bail!("corrupt header: checksum mismatch");
    }
    let stored_key = &b[FIXED..FIXED + key_len];
    if stored_key != key.key.as_bytes() {
        bail!("stale: the source files or the schema changed");
    }
    let nd = usize_at(b, 32, "num_dense")?;
    let ns = usize_at(b, 40, "num_sparse")?;
    let n_train = usize_at(b, 48, "train examples")?;
    let n_eval = usize_at(b, 56, "eval examples")?;
    let multi = u32::from_le_bytes([b[12], b[13], b[14], b[15]]) & 1 == 1;
    let (train_sec, mid) = layout(header_len, n_train, nd, ns, multi, |r| last_end(b, r))
        .ok_or_else(|| anyhow!("corrupt header: counts"))?;
    let (eval_sec, end) = layout(mid, n_eval, nd, ns, multi, |r| last_end(b, r))
        .ok_or_else(|| anyhow!("corrupt header: counts"))?;
    if end as u64 != len {
        bail!("corrupt: {len} bytes, the counts need {end}");
    }
    if (b.as_ptr() as usize) & 7 != 0 {
        bail!("map is not 8-byte aligned");
    }
    if checksum(&[&b[header_len..]]) != u64_at(b, 104) {
        bail!("corrupt payload: checksum mismatch");
    }
    let errors = &b[FIXED + key_len..text_end];
    let first_errors = if errors.is_empty() {
        Vec::new()
    } else {
        errors
            .split(|&c| c == 0)
            .map(|e| String::from_utf8_lossy(e).into_owned())
            .collect()
    };
    let report = LoadReport {
        files: usize_at(b, 64, "files")?,
        lines: u64_at(b, 72),
        examples: (n_train + n_eval) as u64,
        eval_examples: n_eval as u64,
        malformed: u64_at(b, 80),
        first_errors,
        ..Default::default()
    };
    let map = Arc::new(map);
    let train = Examples::mapped(map.clone(), nd, ns, n_train, train_sec.0, train_sec.1);
    let eval = (n_eval > 0).then(|| Examples::mapped(map, nd, ns, n_eval, eval_sec.0, eval_sec.1));
    Ok(Some(Hit {
        train,
        eval,
        report,
    }))
}

/// A writer that checksums what passes through it.
struct Hashing<W: Write> {
    inner: W,
    sum: Checksum,
    written: usize,
}

impl<W: Write> Hashing<W> {
    fn put(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.sum.update(bytes);
        self.written += bytes.len();
        self.inner.write_all(bytes)
    }

    fn pad(&mut self) -> std::io::Result<()> {
        let zeros = [0u8; 8];
        let n = pad8(self.written).unwrap_or(self.written) - self.written;
        self.put(&zeros[..n])
    }

    fn words<T: Copy>(&mut self, xs: &[T], le: impl Fn(T) -> [u8; 4]) -> std::io::Result<()> {
        let mut buf = Vec::with_capacity(4 * 4096);
        for chunk in xs.chunks(4096) {
            buf.clear();
            for &x in chunk {
                buf.extend_from_slice(&le(x));
            }
            self.put(&buf)?;
        }
        self.pad()
    }

    fn split(&mut self, c: &Columns) -> std::io::Result<()> {
        self.words(&c.dense, f32::to_le_bytes)?;
        if let Some(ends) = &c.ends {
            for chunk in ends.chunks(4096) {
                let bytes: Vec<u8> = chunk.iter().flat_map(|e| e.to_le_bytes()).collect();
                self.put(&bytes)?;
            }
            self.pad()?;
        }
        self.words(&c.ids, u32::to_le_bytes)?;
        let bits = (c.len * c.num_sparse).div_ceil(8);
        self.put(&c.missing[..bits])?;
        self.pad()?;
        self.words(&c.labels, f32::to_le_bytes)
    }
}

/// Writes the cache of `key` atomically (a temporary file beside it, then a rename).
pub(crate) fn write(
    key: &CacheKey,
    train: &Columns,
    eval: Option<&Columns>,
    report: &LoadReport,
) -> Result<()> {
    if cfg!(target_endian = "big") {
        bail!("the cache format is little-endian; this machine is big-endian");
    }
    let dir = key
        .path
        .parent()
        .ok_or_else(|| anyhow!("no cache folder"))?;
    std::fs::create_dir_all(dir).map_err(|e| anyhow!("cannot create {}: {e}", dir.display()))?;
    let nanos = std::time::SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    // the temporary files of writers that were killed (`<name>.tmp.<pid>.<nanos>`)
    let stale = format!(
        "{}.tmp.",
        key.path.file_name().unwrap_or_default().to_string_lossy()
    );
    crate::checkpoint::remove_stale_temps(dir, &stale, &['.']);
    let mut tmp_name = key.path.file_name().unwrap_or_default().to_os_string();
    tmp_name.push(format!(".tmp.{}.{nanos}", std::process::id()));
    let tmp = dir.join(tmp_name);
    let result = write_to(&tmp, key, train, eval, report).and_then(|()| {
        std::fs::rename(&tmp, &key.path).map_err(|e| anyhow!("cannot rename into place: {e}"))
    });
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// The header of a cache of these splits (its checksums still to fill), where its
/// text ends, and the file's total length.
fn build_header(
    key: &CacheKey,
    report: &LoadReport,
    (nd, ns, multi): (usize, usize, bool),
    train: (usize, usize),
    eval: (usize, usize),
) -> Result<(Vec<u8>, usize, usize)> {
    let errors = report.first_errors.join("\0");
    let text_end = FIXED + key.key.len() + errors.len();
    let header_len = pad8(text_end).ok_or_else(|| anyhow!("header too large"))?;
    let (_, mid) = layout(header_len, train.0, nd, ns, multi, |_| Some(train.1))
        .ok_or_else(|| anyhow!("too large"))?;
    let (_, total) =
        layout(mid, eval.0, nd, ns, multi, |_| Some(eval.1)).ok_or_else(|| anyhow!("too large"))?;
    let mut header = vec![0u8; header_len];
    header[0..8].copy_from_slice(&MAGIC);
    header[8..12].copy_from_slice(&VERSION.to_le_bytes());
    header[12..16].copy_from_slice(&u32::from(multi).to_le_bytes());
    let fields = [
        header_len as u64,
        total as u64,
        nd as u64,
        ns as u64,
        train.0 as u64,
        eval.0 as u64,
        report.files as u64,
        report.lines,
        report.malformed,
        key.key.len() as u64,
        errors.len() as u64,
    ];
    for (k, v) in fields.iter().enumerate() {
        header[16 + 8 * k..24 + 8 * k].copy_from_slice(&v.to_le_bytes());
    }
    header[FIXED..FIXED + key.key.len()].copy_from_slice(key.key.as_bytes());
    header[FIXED + key.key.len()..text_end].copy_from_slice(errors.as_bytes());
    Ok((header, text_end, total))
}

/// Fills in the payload and header checksums and writes the header over the start.
fn seal(
    file: &mut File,
    header: &mut [u8],
    text_end: usize,
    payload_sum: u64,
) -> std::io::Result<()> {
    header[104..112].copy_from_slice(&payload_sum.to_le_bytes());
    let header_sum = checksum(&[&header[..112], &header[FIXED..text_end]]);
    header[112..120].copy_from_slice(&header_sum.to_le_bytes());
    file.seek(SeekFrom::Start(0))?;
    file.write_all(&header[..FIXED])?;
    file.sync_all()
}

fn write_to(
    tmp: &Path,
    key: &CacheKey,
    train: &Columns,
    eval: Option<&Columns>,
    report: &LoadReport,
) -> Result<()> {
    let empty = match train.ends {
        Some(_) => Columns::new_multi(train.num_dense, train.num_sparse),
        None => Columns::new(train.num_dense, train.num_sparse),
    };
    let eval = eval.unwrap_or(&empty);
    let multi = train.ends.is_some();
    let (mut header, text_end, total) = build_header(
        key,
        report,
        (train.num_dense, train.num_sparse, multi),
        (train.len, train.ids.len()),
        (eval.len, eval.ids.len()),
    )?;
    let header_len = header.len();
    let file = File::create(tmp).map_err(|e| anyhow!("cannot create {}: {e}", tmp.display()))?;
    let io = |e: std::io::Error| anyhow!("cannot write {}: {e}", tmp.display());
    let mut w = Hashing {
        inner: std::io::BufWriter::with_capacity(1 << 20, file),
        sum: Checksum::new(),
        written: header_len,
    };
    w.inner.write_all(&header).map_err(io)?;
    w.split(train).map_err(io)?;
    w.split(eval).map_err(io)?;
    if w.written != total {
        bail!("wrote {} bytes, expected {total}", w.written);
    }
    let payload_sum = w.sum.finish();
    let mut file = w.inner.into_inner().map_err(|e| io(e.into_error()))?;
    seal(&mut file, &mut header, text_end, payload_sum).map_err(io)?;
    Ok(())
}

/// A cache written as examples are parsed, so that a data set larger than memory is
/// parsed once into a file that training then maps: each section goes to a temporary
/// file of its own beside the cache, and `finish` joins them behind the header. No
/// split by time (that needs every example at once); the held-out part is the tail.
pub(crate) struct StreamWriter {
    key_path: PathBuf,
    parts: Vec<(PathBuf, std::io::BufWriter<File>)>,
    nd: usize,
    ns: usize,
    multi: bool,
    n: usize,
    n_ids: u64,
    /// Missing bits not yet written: a partial byte and how many of its bits are used.
    bits: (u8, u32),
}

impl StreamWriter {
    /// Section files `<cache>.tmp.<pid>.<nanos>.<k>` (stale ones of killed writers are
    /// removed, as for the cache itself).
    pub fn new(key: &CacheKey, nd: usize, ns: usize, multi: bool) -> Result<StreamWriter> {
        let dir = key
            .path
            .parent()
            .ok_or_else(|| anyhow!("no cache folder"))?
            .to_path_buf();
        std::fs::create_dir_all(&dir)
            .map_err(|e| anyhow!("cannot create {}: {e}", dir.display()))?;
        let name = key
            .path
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned();
        crate::checkpoint::remove_stale_temps(&dir, &format!("{name}.tmp."), &['.']);
        let nanos = std::time::SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let mut parts = Vec::new();
        for k in 0..5 {
            let p = dir.join(format!("{name}.tmp.{}.{nanos}.{k}", std::process::id()));
            let f = File::create(&p).map_err(|e| anyhow!("cannot create {}: {e}", p.display()))?;
            parts.push((p, std::io::BufWriter::with_capacity(1 << 20, f)));
        }
        Ok(StreamWriter {
            key_path: key.path.clone(),
            parts,
            nd,
            ns,
            multi,
            n: 0,
            n_ids: 0,
            bits: (0, 0),
        })
    }

    /// Appends parsed examples: dense, bag ends, ids, missing bits, labels.
    pub fn push(&mut self, c: &Columns) -> Result<()> {
        let io = |e: std::io::Error| anyhow!("writing the cache: {e}");
        let le = |xs: &[u32]| -> Vec<u8> { xs.iter().flat_map(|x| x.to_le_bytes()).collect() };
        let dense: Vec<u8> = c.dense.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.parts[0].1.write_all(&dense).map_err(io)?;
        if let Some(ends) = &c.ends {
            let shifted: Vec<u8> = ends
                .iter()
                .flat_map(|e| (e + self.n_ids).to_le_bytes())
                .collect();
            self.parts[1].1.write_all(&shifted).map_err(io)?;
        }
        self.parts[2].1.write_all(&le(&c.ids)).map_err(io)?;
        // the missing bits continue where the last push stopped, LSB first
        let nbits = c.len * c.num_sparse;
        let mut out = Vec::with_capacity(nbits / 8 + 1);
        let (mut byte, mut used) = self.bits;
        for k in 0..nbits {
            if c.missing[k / 8] >> (k % 8) & 1 == 1 {
                byte |= 1 << used;
            }
            used += 1;
            if used == 8 {
                out.push(byte);
                (byte, used) = (0, 0);
            }
        }
        self.bits = (byte, used);
        self.parts[3].1.write_all(&out).map_err(io)?;
        let labels: Vec<u8> = c.labels.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.parts[4].1.write_all(&labels).map_err(io)?;
        self.n += c.len;
        self.n_ids += c.ids.len() as u64;
        Ok(())
    }

    /// Examples written so far.
    pub fn len(&self) -> usize {
        self.n
    }

    /// Joins the sections into the cache file (atomically) and removes them.
    pub fn finish(mut self, key: &CacheKey, report: &LoadReport) -> Result<()> {
        let result = self.join(key, report);
        for (p, _) in &self.parts {
            let _ = std::fs::remove_file(p);
        }
        result
    }

    fn join(&mut self, key: &CacheKey, report: &LoadReport) -> Result<()> {
        let io = |e: std::io::Error| anyhow!("writing the cache: {e}");
        if self.bits.1 > 0 {
            let b = [self.bits.0];
            self.parts[3].1.write_all(&b).map_err(io)?;
        }
        for (_, w) in &mut self.parts {
            w.flush().map_err(io)?;
        }
        let n_ids = usize::try_from(self.n_ids).map_err(|_| anyhow!("too many ids"))?;
        let (mut header, text_end, total) = build_header(
            key,
            report,
            (self.nd, self.ns, self.multi),
            (self.n, n_ids),
            (0, 0),
        )?;
        let name = self
            .key_path
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned();
        let tmp = self
            .key_path
            .with_file_name(format!("{name}.tmp.{}.joined", std::process::id()));
        let file =
            File::create(&tmp).map_err(|e| anyhow!("cannot create {}: {e}", tmp.display()))?;
        let mut w = Hashing {
            inner: std::io::BufWriter::with_capacity(1 << 20, file),
            sum: Checksum::new(),
            written: header.len(),
        };
        let parts = &self.parts;
        let multi = self.multi;
        let tmp_path = &tmp;
        let r = (move || -> Result<()> {
            w.inner.write_all(&header).map_err(io)?;
            // dense, (ends), ids, missing, labels: each padded to 8 bytes
            let order: &[usize] = if multi {
                &[0, 1, 2, 3, 4]
            } else {
                &[0, 2, 3, 4]
            };
            let mut buf = vec![0u8; 1 << 20];
            for &k in order {
                let mut f = File::open(&parts[k].0).map_err(io)?;
                loop {
                    let n = std::io::Read::read(&mut f, &mut buf).map_err(io)?;
                    if n == 0 {
                        break;
                    }
                    w.put(&buf[..n]).map_err(io)?;
                }
                w.pad().map_err(io)?;
            }
            let Hashing {
                inner,
                sum,
                written,
            } = w;
            if written != total {
                bail!("wrote {written} bytes, expected {total}");
            }
            let payload_sum = sum.finish();
            let mut file = inner.into_inner().map_err(|e| io(e.into_error()))?;
            seal(&mut file, &mut header, text_end, payload_sum).map_err(io)?;
            std::fs::rename(tmp_path, &key.path)
                .map_err(|e| anyhow!("cannot rename into place: {e}"))
        })();
        if r.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        r
    }
}

impl super::table::Sink for StreamWriter {
    fn add(&mut self, cols: &Columns, _times: Option<&[f64]>) -> Result<()> {
        self.push(cols)
    }
}
