//! Real training data: Criteo-layout logs and user-described TSV/CSV logs, parsed once
//! into a column store and cached as a binary file that later runs memory-map.
//!
//! ```text
//! --data criteo:PATH   Criteo Kaggle/terabyte lines: label, I1..I13, C1..C26 (8-hex-digit ids)
//! --data tsv:PATH      any separated-values log described by a [`TsvSchema`]
//! ```
//!
//! `PATH` is a file, a folder (all regular files in it that do not start with `.`, sorted
//! by name) or a glob whose file-name part may hold `*` and `?`. Files may be plain or
//! gzip (told by their first two bytes, not by their names).
//!
//! Every example holds `num_dense` floats (`ln(1 + max(x, 0))`, 0 when missing),
//! `num_sparse` 32-bit ids (Criteo's hex value, or [`hash_category`] of a TSV field's
//! bytes; a missing value is flagged, not given an id) and a 0/1 label. A batch maps
//! each id to `id mod rows` and a missing one to row 0 (`shared/spec/ctr-model.md`,
//! "Inputs").
//!
//! Malformed lines are counted and skipped, the first [`MAX_REPORTED_ERRORS`] kept as
//! `file:line: what is wrong`; with [`LoadOptions::strict`] the first one is the error.
//! Blank lines are neither examples nor malformed.

use std::fmt;
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{anyhow, bail, Result};
use memmap2::Mmap;
use serde::{Deserialize, Deserializer};

use super::{cache, criteo, tsv};

/// Malformed lines kept in [`LoadReport::first_errors`].
pub const MAX_REPORTED_ERRORS: usize = 5;

/// Where examples come from.
#[derive(Clone, Debug, PartialEq)]
pub enum DataSource {
    /// Criteo Kaggle/terabyte layout: `label \t I1..I13 \t C1..C26`.
    Criteo { path: String },
    /// A separated-values log described by a schema.
    Tsv { path: String, schema: TsvSchema },
}

impl DataSource {
    /// The `PATH` part.
    pub fn path(&self) -> &str {
        match self {
            DataSource::Criteo { path } | DataSource::Tsv { path, .. } => path,
        }
    }
}

/// How to read a user's separated-values log, e.g. from a `[data.schema]` TOML table:
///
/// ```toml
/// separator = "\t"
/// header = true               # first line of every file names the columns
/// label = "rating"            # a name, or a 0-based index
/// label_threshold = 4.0       # label = value >= 4 (without it the value must be 0 or 1)
/// dense = ["timestamp"]       # numbers, fed as ln(1 + max(x, 0)); empty = 0
/// categorical = ["user_id", "item_id"]  # any text, hashed to u32; empty = missing
/// time = "timestamp"          # optional: eval = the latest `eval_fraction` by time
/// eval_fraction = 0.1
/// list_separator = "|"        # optional: a categorical field holds a list ("12|7|99")
/// mean = ["genres"]           # optional: these lists are mean-pooled (default: sum)
/// max_list = 1024             # optional: a longer list makes its line malformed
/// ```
///
/// A column is found by its header name, where a RecBole-style `name:type` header also
/// answers to `name`; failing that, a number is a 0-based column index. Fields are split
/// on the separator only: quotes are not special.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TsvSchema {
    /// One ASCII character (default tab).
    #[serde(default = "default_separator")]
    pub separator: char,
    /// Whether the first line of every file is a header (default true).
    #[serde(default = "default_true")]
    pub header: bool,
    #[serde(deserialize_with = "name_or_index")]
    pub label: String,
    #[serde(default)]
    pub label_threshold: Option<f64>,
    #[serde(default, deserialize_with = "names_or_indices")]
    pub dense: Vec<String>,
    #[serde(default, deserialize_with = "names_or_indices")]
    pub categorical: Vec<String>,
    #[serde(default, deserialize_with = "opt_name_or_index")]
    pub time: Option<String>,
    /// Separates the values of one categorical field (`"12|7|99"`): every categorical
    /// field is then a bag of any number of ids (multi-hot), sum-pooled; none: one value
    /// a field.
    #[serde(default)]
    pub list_separator: Option<char>,
    /// Categorical columns pooled by the mean of their bag instead of the sum.
    #[serde(default, deserialize_with = "names_or_indices")]
    pub mean: Vec<String>,
    /// The most ids one field's list may hold (default 1024): every example's bag of a
    /// field gets as many slots as the longest list of the data, so one runaway line
    /// would size them all; a longer list makes its line malformed.
    #[serde(default = "default_max_list")]
    pub max_list: usize,
    /// Share of examples held out for evaluation (default 0.1): the latest by `time`, or
    /// without it the last lines read.
    #[serde(default = "default_eval_fraction")]
    pub eval_fraction: f64,
}

fn default_separator() -> char {
    '\t'
}
fn default_true() -> bool {
    true
}
fn default_eval_fraction() -> f64 {
    0.1
}
fn default_max_list() -> usize {
    1024
}

#[derive(Deserialize)]
#[serde(untagged)]
enum NameOrIndex {
    Name(String),
    Index(u64),
}

impl From<NameOrIndex> for String {
    fn from(c: NameOrIndex) -> String {
        match c {
            NameOrIndex::Name(s) => s,
            NameOrIndex::Index(i) => i.to_string(),
        }
    }
}

fn name_or_index<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    NameOrIndex::deserialize(d).map(String::from)
}
fn opt_name_or_index<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    Option::<NameOrIndex>::deserialize(d).map(|c| c.map(String::from))
}
fn names_or_indices<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    Vec::<NameOrIndex>::deserialize(d).map(|v| v.into_iter().map(String::from).collect())
}

impl TsvSchema {
    /// A schema from TOML text: the `[data.schema]` table of a config, or a document
    /// that is the schema itself.
    pub fn from_toml(text: &str) -> Result<TsvSchema> {
        let doc: toml::Table =
            toml::from_str(text).map_err(|e| anyhow!("schema: not valid TOML: {e}"))?;
        let table = match doc.get("data") {
            Some(toml::Value::Table(data)) => match data.get("schema") {
                Some(toml::Value::Table(t)) => t.clone(),
                Some(_) => bail!("schema: [data.schema] must be a table"),
                None => bail!("schema: the config has [data] but no [data.schema] table"),
            },
            _ => doc,
        };
        let schema: TsvSchema = table.try_into().map_err(|e| anyhow!("schema: {e}"))?;
        schema.validate()?;
        Ok(schema)
    }

    /// Checks what can be checked without the data.
    pub fn validate(&self) -> Result<()> {
        if !self.separator.is_ascii() || matches!(self.separator, '\n' | '\r') {
            bail!(
                "schema: separator {:?} must be one ASCII character other than a line break",
                self.separator
            );
        }
        if let Some(c) = self.mean.iter().find(|c| !self.categorical.contains(c)) {
            bail!("schema: mean lists '{c}', which is not a categorical column");
        }
        if let Some(c) = self.list_separator {
            if !c.is_ascii() || c == self.separator || matches!(c, '\n' | '\r') {
                bail!(
                    "schema: list_separator {c:?} must be one ASCII character other than the separator and a line break"
                );
            }
        }
        if let Some(t) = self.label_threshold {
            if !t.is_finite() {
                bail!("schema: label_threshold {t} is not finite");
            }
        }
        if self.max_list == 0 {
            bail!("schema: max_list must be at least 1");
        }
        if !(self.eval_fraction > 0.0 && self.eval_fraction < 1.0) {
            bail!(
                "schema: eval_fraction {} must lie strictly between 0 and 1",
                self.eval_fraction
            );
        }
        if self.dense.contains(&self.label) || self.categorical.contains(&self.label) {
            bail!(
                "schema: the label column '{}' is also a feature",
                self.label
            );
        }
        let mut seen = std::collections::HashSet::new();
        for c in self.dense.iter().chain(&self.categorical) {
            if !seen.insert(c) {
                bail!("schema: column '{c}' is listed twice among dense and categorical");
            }
        }
        if self.categorical.is_empty() {
            bail!("schema: no categorical columns; the model embeds at least one field (dense columns may be none)");
        }
        Ok(())
    }
}

/// How to load.
#[derive(Clone, Debug, Default)]
pub struct LoadOptions {
    /// Stop at the first malformed line (its `file:line: message` is the error).
    pub strict: bool,
    /// Folder of the binary cache (created if absent); `None`: no cache.
    pub cache_dir: Option<PathBuf>,
    /// Threads to parse on (`None` or 0: every core). Files, and pieces of a plain file,
    /// are parsed in parallel; the examples keep the files' order either way.
    pub threads: Option<usize>,
    /// Parse straight into the cache (which needs `cache_dir`), holding only the pieces
    /// being parsed in memory, and train from the mapped file: for data larger than
    /// memory. `None`: when the text is more than half the memory available. Not for a
    /// split by time, which needs every example at once.
    pub stream: Option<bool>,
    /// Print the parse's progress on stderr while it runs (after its first 2 s: every
    /// half second on a terminal, rewriting one line, else every 10 s).
    pub progress: bool,
}

/// The first bytes of a gzip and of a zstd stream.
const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];
const ZSTD_MAGIC: [u8; 4] = [0x28, 0xb5, 0x2f, 0xfd];

/// Whether a file starts as a gzip or zstd stream (`None`: it cannot be read).
fn is_compressed(f: &Path) -> Option<bool> {
    std::fs::File::open(f)
        .and_then(|mut h| {
            let mut m = [0u8; 4];
            std::io::Read::read(&mut h, &mut m)
                .map(|n| m[..n].starts_with(&GZIP_MAGIC) || m[..n].starts_with(&ZSTD_MAGIC))
        })
        .ok()
}

/// Whether `files` would take more than half the available memory once parsed (a
/// parsed example is about as large as its text; compressed files count four times).
fn larger_than_memory(files: &[PathBuf]) -> bool {
    let text: u64 = files
        .iter()
        .map(|f| {
            let len = std::fs::metadata(f).map_or(0, |m| m.len());
            let compressed = is_compressed(f).unwrap_or(false);
            if compressed {
                len * 4
            } else {
                len
            }
        })
        .sum();
    let available = std::fs::read_to_string("/proc/meminfo").ok().and_then(|t| {
        let line = t
            .lines()
            .find(|l| l.starts_with("MemAvailable:"))?
            .to_string();
        line.split_whitespace().nth(1)?.parse::<u64>().ok()
    });
    available.is_some_and(|kb| text > kb * 1024 / 2)
}

/// What a load did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LoadReport {
    pub files: usize,
    /// Data lines read (no header or blank lines): `examples + malformed`.
    pub lines: u64,
    /// Examples kept, training and evaluation together.
    pub examples: u64,
    /// Of `examples`, those in the evaluation split.
    pub eval_examples: u64,
    pub malformed: u64,
    /// `file:line: what is wrong` for the first few malformed lines.
    pub first_errors: Vec<String>,
    pub from_cache: bool,
    /// The cache file used or written, if any.
    pub cache_path: Option<PathBuf>,
    /// Things that did not stop the load: a stale or corrupt cache rebuilt, a cache
    /// that could not be written, entries of a data folder that are not files.
    pub warnings: Vec<String>,
    /// Seconds spent reading and parsing the text (0 when loaded from the cache).
    pub parse_secs: f64,
    /// Bytes of text parsed (after decompression).
    pub parse_bytes: u64,
    /// Threads the text was parsed on.
    pub parse_threads: usize,
}

impl LoadReport {
    /// Data lines parsed per second, when the text was parsed.
    pub fn lines_per_sec(&self) -> Option<f64> {
        (self.parse_secs > 0.0 && !self.from_cache).then(|| self.lines as f64 / self.parse_secs)
    }
}

impl fmt::Display for LoadReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} file{}, {} lines: {} examples",
            self.files,
            if self.files == 1 { "" } else { "s" },
            self.lines,
            self.examples
        )?;
        if self.eval_examples > 0 {
            write!(
                f,
                " ({} train, {} eval)",
                self.examples - self.eval_examples,
                self.eval_examples
            )?;
        }
        write!(f, ", {} malformed skipped", self.malformed)?;
        if let Some(rate) = self.lines_per_sec() {
            write!(
                f,
                "; parsed in {:.2} s on {} thread{} ({:.0}k lines/s, {:.0} MB/s)",
                self.parse_secs,
                self.parse_threads,
                if self.parse_threads == 1 { "" } else { "s" },
                rate / 1e3,
                self.parse_bytes as f64 / self.parse_secs / 1e6
            )?;
        }
        if self.from_cache {
            if let Some(p) = &self.cache_path {
                write!(f, " (from cache {})", p.display())?;
            }
        }
        for e in &self.first_errors {
            write!(f, "\n  {e}")?;
        }
        if self.malformed > self.first_errors.len() as u64 {
            write!(
                f,
                "\n  ... and {} more",
                self.malformed - self.first_errors.len() as u64
            )?;
        }
        for w in &self.warnings {
            write!(f, "\n  warning: {w}")?;
        }
        Ok(())
    }
}

/// `synthetic` → `None`; `criteo:PATH`; `tsv:PATH`, which needs `schema` (from the
/// config's `[data.schema]`).
pub fn parse_data_arg(s: &str, schema: Option<&TsvSchema>) -> Result<Option<DataSource>> {
    if s == "synthetic" {
        return Ok(None);
    }
    if let Some(path) = s.strip_prefix("criteo:") {
        if path.is_empty() {
            bail!("--data criteo:PATH: the path is empty");
        }
        return Ok(Some(DataSource::Criteo {
            path: path.to_string(),
        }));
    }
    if let Some(path) = s.strip_prefix("tsv:") {
        if path.is_empty() {
            bail!("--data tsv:PATH: the path is empty");
        }
        let schema = schema.ok_or_else(|| {
            anyhow!("--data {s}: a TSV source needs a [data.schema] table in the config")
        })?;
        schema.validate()?;
        return Ok(Some(DataSource::Tsv {
            path: path.to_string(),
            schema: schema.clone(),
        }));
    }
    bail!("--data {s}: expected 'synthetic', 'criteo:PATH' or 'tsv:PATH'")
}

/// The fixed hash of a categorical TSV field: FNV-1a (64-bit) of its bytes, finished by
/// splitmix64, top 32 bits. The same on every run and platform.
pub fn hash_category(bytes: &[u8]) -> u32 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    (super::synthetic::splitmix64(h) >> 32) as u32
}

/// The dense transform of the spec: `ln(1 + max(x, 0))` in f64, rounded to f32.
#[inline]
pub fn dense_transform(x: f64) -> f32 {
    x.max(0.0).ln_1p() as f32
}

/// Column storage of examples being built (row-major per example).
#[derive(Clone, Debug, Default)]
pub(crate) struct Columns {
    pub num_dense: usize,
    pub num_sparse: usize,
    pub len: usize,
    pub dense: Vec<f32>,
    pub ids: Vec<u32>,
    /// Bit `i*num_sparse + j` set: field `j` of example `i` is missing (for multi-hot
    /// data: its bag is empty).
    pub missing: Vec<u8>,
    pub labels: Vec<f32>,
    /// Multi-hot data: the end in `ids` of bag `i*num_sparse + j` (its start is the end
    /// of the bag before, or 0), so a field holds any number of ids; `None`: one id per
    /// field, `ids[i*num_sparse + j]`.
    pub ends: Option<Vec<u64>>,
}

impl Columns {
    pub fn new(num_dense: usize, num_sparse: usize) -> Self {
        Columns {
            num_dense,
            num_sparse,
            ..Default::default()
        }
    }

    /// Columns of multi-hot examples (see [`Columns::ends`]).
    pub fn new_multi(num_dense: usize, num_sparse: usize) -> Self {
        Columns {
            ends: Some(Vec::new()),
            ..Columns::new(num_dense, num_sparse)
        }
    }

    /// Empty columns of the same kind (single or multi-hot).
    fn like(&self) -> Self {
        Columns {
            ends: self.ends.as_ref().map(|_| Vec::new()),
            ..Columns::new(self.num_dense, self.num_sparse)
        }
    }

    pub fn push(&mut self, row: &Row) {
        self.dense.extend_from_slice(&row.dense);
        let base = self.len * self.num_sparse;
        self.missing.resize((base + self.num_sparse).div_ceil(8), 0);
        if let Some(ends) = self.ends.as_mut() {
            let mut at = 0usize;
            for (j, &n) in row.lens.iter().enumerate() {
                let n = n as usize;
                self.ids.extend_from_slice(&row.multi[at..at + n]);
                at += n;
                ends.push(self.ids.len() as u64);
                if n == 0 {
                    let bit = base + j;
                    self.missing[bit / 8] |= 1 << (bit % 8);
                }
            }
            self.labels.push(row.label);
            self.len += 1;
            return;
        }
        for (j, (&id, &miss)) in row.ids.iter().zip(&row.missing).enumerate() {
            self.ids.push(if miss { 0 } else { id });
            if miss {
                let bit = base + j;
                self.missing[bit / 8] |= 1 << (bit % 8);
            }
        }
        self.labels.push(row.label);
        self.len += 1;
    }

    fn is_missing(&self, i: usize, j: usize) -> bool {
        bit(&self.missing, i * self.num_sparse + j)
    }

    /// Appends `other`'s examples after these.
    pub fn append(&mut self, other: &Columns) {
        let base = self.len * self.num_sparse;
        if let (Some(ends), Some(theirs)) = (self.ends.as_mut(), other.ends.as_ref()) {
            let shift = self.ids.len() as u64;
            ends.extend(theirs.iter().map(|&e| e + shift));
        }
        self.dense.extend_from_slice(&other.dense);
        self.ids.extend_from_slice(&other.ids);
        self.labels.extend_from_slice(&other.labels);
        self.len += other.len;
        self.missing
            .resize((self.len * self.num_sparse).div_ceil(8), 0);
        if base.is_multiple_of(8) {
            let at = base / 8;
            self.missing[at..at + other.missing.len()].copy_from_slice(&other.missing);
        } else {
            for (k, &byte) in other.missing.iter().enumerate().filter(|(_, b)| **b != 0) {
                for j in 0..8 {
                    if byte >> j & 1 == 1 {
                        let b = base + k * 8 + j;
                        self.missing[b / 8] |= 1 << (b % 8);
                    }
                }
            }
        }
    }

    /// The examples whose `keep` flag equals `which`, in order.
    /// The ids of bag `(i, j)`.
    fn bag(&self, i: usize, j: usize) -> &[u32] {
        let k = i * self.num_sparse + j;
        match &self.ends {
            Some(ends) => {
                let start = if k == 0 { 0 } else { ends[k - 1] as usize };
                &self.ids[start..ends[k] as usize]
            }
            None => &self.ids[k..k + 1],
        }
    }

    fn select(&self, keep: &[bool], which: bool) -> Columns {
        let mut out = self.like();
        let mut row = Row::new(self.num_dense, self.num_sparse);
        for (i, &k) in keep.iter().enumerate() {
            if k != which {
                continue;
            }
            row.dense
                .copy_from_slice(&self.dense[i * self.num_dense..(i + 1) * self.num_dense]);
            row.multi.clear();
            row.lens.clear();
            for j in 0..self.num_sparse {
                row.missing[j] = self.is_missing(i, j);
                if self.ends.is_some() {
                    let bag = self.bag(i, j);
                    row.multi.extend_from_slice(bag);
                    row.lens.push(bag.len() as u32);
                } else {
                    row.ids[j] = self.ids[i * self.num_sparse + j];
                }
            }
            row.label = self.labels[i];
            out.push(&row);
        }
        out
    }
}

#[inline]
fn bit(bits: &[u8], k: usize) -> bool {
    bits[k / 8] >> (k % 8) & 1 == 1
}

/// One parsed line.
#[derive(Clone, Debug)]
pub(crate) struct Row {
    pub dense: Vec<f32>,
    pub ids: Vec<u32>,
    pub missing: Vec<bool>,
    pub label: f32,
    pub time: f64,
    /// Multi-hot rows: every field's ids, field after field ...
    pub multi: Vec<u32>,
    /// ... and how many each field has (0: missing).
    pub lens: Vec<u32>,
}

impl Row {
    pub fn new(num_dense: usize, num_sparse: usize) -> Self {
        Row {
            dense: vec![0.0; num_dense],
            ids: vec![0; num_sparse],
            missing: vec![false; num_sparse],
            label: 0.0,
            time: 0.0,
            multi: Vec::new(),
            lens: Vec::new(),
        }
    }
}

/// A reader of one text format. `Clone` gives each parsing thread its own, after the
/// first file's header (and, without one, the field count) is known.
pub(crate) trait LineParser: Clone + Send {
    fn num_dense(&self) -> usize;
    fn num_sparse(&self) -> usize;
    /// Whether the first line of every file is a header.
    fn has_header(&self) -> bool {
        false
    }
    /// Whether [`Row::time`] is set (the examples get a time split).
    fn has_time(&self) -> bool {
        false
    }
    /// Whether a field may hold several ids ([`Row::multi`] and [`Row::lens`] are set).
    fn is_multi(&self) -> bool {
        false
    }
    /// Empty columns for this reader's rows.
    fn columns(&self) -> Columns {
        if self.is_multi() {
            Columns::new_multi(self.num_dense(), self.num_sparse())
        } else {
            Columns::new(self.num_dense(), self.num_sparse())
        }
    }
    /// The header line of a file (CR/LF and a UTF-8 BOM stripped).
    fn header(&mut self, _line: &[u8]) -> Result<()> {
        Ok(())
    }
    /// Parses a data line (CR/LF stripped, not empty) into `row`; `Err` says what is
    /// wrong with it.
    fn parse(&mut self, line: &[u8], row: &mut Row) -> std::result::Result<(), String>;
}

/// Examples: row-major dense features, ids with missing flags, labels; in memory or
/// memory-mapped from the cache.
pub struct Examples {
    pub num_dense: usize,
    pub num_sparse: usize,
    len: usize,
    store: Store,
    /// [`Examples::digest`], once computed.
    digest: std::sync::OnceLock<u64>,
    /// Mapped examples: where this view starts among the file's examples (0 for the
    /// whole file; the held-out tail of a mapped cache is a view, not a copy).
    first: usize,
}

enum Store {
    Owned(Columns),
    Mapped {
        map: Arc<Mmap>,
        dense: Range<usize>,
        ids: Range<usize>,
        missing: Range<usize>,
        labels: Range<usize>,
        /// Multi-hot data: the bags' ends (u64).
        ends: Option<Range<usize>>,
    },
}

impl fmt::Debug for Examples {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Examples")
            .field("len", &self.len)
            .field("num_dense", &self.num_dense)
            .field("num_sparse", &self.num_sparse)
            .field("mapped", &matches!(self.store, Store::Mapped { .. }))
            .finish()
    }
}

/// `bytes` as `T`s. Checked: the cache aligns every section to 8 bytes of a page-aligned
/// map, and `cache::open` refuses a file where this would fail.
fn cast<T: Plain>(bytes: &[u8]) -> &[T] {
    // SAFETY: `T` is `f32` or `u32` (sealed by `Plain`): every bit pattern is a valid
    // value, and `align_to` only yields the correctly aligned middle part.
    let (head, mid, tail) = unsafe { bytes.align_to::<T>() };
    assert!(
        head.is_empty() && tail.is_empty(),
        "cache section misaligned (checked when the cache was opened)"
    );
    mid
}

/// Types with no invalid bit patterns that the cache stores.
pub(crate) trait Plain: Copy {}
impl Plain for f32 {}
impl Plain for u32 {}
impl Plain for u64 {}

impl Examples {
    pub(crate) fn from_columns(c: Columns) -> Examples {
        Examples {
            num_dense: c.num_dense,
            num_sparse: c.num_sparse,
            len: c.len,
            store: Store::Owned(c),
            digest: Default::default(),
            first: 0,
        }
    }

    /// Examples over sections of a mapped cache file (already validated by the caller:
    /// in bounds, 4-byte aligned, of the right lengths).
    pub(crate) fn mapped(
        map: Arc<Mmap>,
        num_dense: usize,
        num_sparse: usize,
        len: usize,
        sections: [Range<usize>; 4],
        ends: Option<Range<usize>>,
    ) -> Examples {
        let [dense, ids, missing, labels] = sections;
        Examples {
            num_dense,
            num_sparse,
            len,
            store: Store::Mapped {
                map,
                dense,
                ids,
                missing,
                labels,
                ends,
            },
            digest: Default::default(),
            first: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the data lives in a memory-mapped cache file.
    pub fn is_mapped(&self) -> bool {
        matches!(self.store, Store::Mapped { .. })
    }

    /// `[len, num_dense]`, transformed.
    pub fn dense(&self) -> &[f32] {
        match &self.store {
            Store::Owned(c) => &c.dense,
            Store::Mapped { map, dense, .. } => {
                let nd = self.num_dense;
                &cast(&map[dense.clone()])[self.first * nd..(self.first + self.len) * nd]
            }
        }
    }

    /// `[len, num_sparse]` ids (0 where missing: see [`Examples::is_missing`]).
    pub fn ids(&self) -> &[u32] {
        match &self.store {
            Store::Owned(c) => &c.ids,
            Store::Mapped { map, ids, ends, .. } => {
                let all: &[u32] = cast(&map[ids.clone()]);
                match ends {
                    // multi-hot: the bag ends index the whole section
                    Some(_) => all,
                    None => {
                        let ns = self.num_sparse;
                        &all[self.first * ns..(self.first + self.len) * ns]
                    }
                }
            }
        }
    }

    /// `[len]`, 0.0 or 1.0.
    pub fn labels(&self) -> &[f32] {
        match &self.store {
            Store::Owned(c) => &c.labels,
            Store::Mapped { map, labels, .. } => {
                &cast(&map[labels.clone()])[self.first..self.first + self.len]
            }
        }
    }

    /// Multi-hot data: the end in [`Examples::ids`] of each bag `i*num_sparse + j`.
    pub fn bag_ends(&self) -> Option<&[u64]> {
        match &self.store {
            Store::Owned(c) => c.ends.as_deref(),
            Store::Mapped { map, ends, .. } => ends.as_ref().map(|r| {
                let ns = self.num_sparse;
                &cast(&map[r.clone()])[self.first * ns..(self.first + self.len) * ns]
            }),
        }
    }

    /// Where in [`Examples::ids`] this view's first bag starts (0 but for a mapped tail).
    fn ends_before(&self) -> u64 {
        match &self.store {
            Store::Mapped {
                map, ends: Some(r), ..
            } if self.first > 0 => {
                let all: &[u64] = cast(&map[r.clone()]);
                all[self.first * self.num_sparse - 1]
            }
            _ => 0,
        }
    }

    /// The index in [`Examples::missing_bits`] of this view's first bit.
    fn bit_base(&self) -> usize {
        self.first * self.num_sparse
    }

    /// Whether a field may hold several ids (the schema has a `list_separator`).
    pub fn is_multi_hot(&self) -> bool {
        self.bag_ends().is_some()
    }

    /// The ids of field `j` of example `i` (empty where missing; one id for one-hot data).
    pub fn bag(&self, i: usize, j: usize) -> &[u32] {
        let k = i * self.num_sparse + j;
        match self.bag_ends() {
            Some(ends) => {
                let start = if k == 0 {
                    self.ends_before() as usize
                } else {
                    ends[k - 1] as usize
                };
                &self.ids()[start..ends[k] as usize]
            }
            None if self.is_missing(i, j) => &[],
            None => &self.ids()[k..k + 1],
        }
    }

    /// The longest bag of each field: the slots a model needs for it (1 for one-hot data).
    pub fn max_bag_lens(&self) -> Vec<usize> {
        let ns = self.num_sparse;
        let Some(ends) = self.bag_ends() else {
            return vec![1; ns];
        };
        let mut out = vec![0; ns];
        let mut prev = self.ends_before();
        for (k, &e) in ends.iter().enumerate() {
            out[k % ns] = out[k % ns].max((e - prev) as usize);
            prev = e;
        }
        out.iter().map(|&n| n.max(1)).collect()
    }

    fn missing_bits(&self) -> &[u8] {
        match &self.store {
            Store::Owned(c) => &c.missing,
            Store::Mapped { map, missing, .. } => &map[missing.clone()],
        }
    }

    /// Splits off the last `fraction` of the examples (by position) as a held-out set,
    /// for sources without a split of their own.
    pub fn split_tail(&self, fraction: f64) -> Result<(Examples, Examples)> {
        if !(fraction > 0.0 && fraction < 1.0) {
            bail!("the held-out fraction must be in (0, 1), got {fraction}");
        }
        let cut = ((self.len as f64) * (1.0 - fraction)).round() as usize;
        if cut == 0 || cut == self.len {
            bail!(
                "{} examples are too few to hold out {fraction} of them",
                self.len
            );
        }
        if let Store::Mapped {
            map,
            dense,
            ids,
            missing,
            labels,
            ends,
        } = &self.store
        {
            // views of the mapped file: a data set larger than memory stays on disk
            let view = |first: usize, len: usize| {
                let sections = [dense.clone(), ids.clone(), missing.clone(), labels.clone()];
                let mut v = Examples::mapped(
                    map.clone(),
                    self.num_dense,
                    self.num_sparse,
                    len,
                    sections,
                    ends.clone(),
                );
                v.first = self.first + first;
                v
            };
            return Ok((view(0, cut), view(cut, self.len - cut)));
        }
        let part = |range: std::ops::Range<usize>| {
            let mut c = match self.bag_ends() {
                Some(_) => Columns::new_multi(self.num_dense, self.num_sparse),
                None => Columns::new(self.num_dense, self.num_sparse),
            };
            let mut row = Row::new(self.num_dense, self.num_sparse);
            let (nd, ns) = (self.num_dense, self.num_sparse);
            for i in range {
                row.dense
                    .copy_from_slice(&self.dense()[i * nd..(i + 1) * nd]);
                row.multi.clear();
                row.lens.clear();
                for j in 0..ns {
                    row.missing[j] = self.is_missing(i, j);
                    if self.is_multi_hot() {
                        let bag = self.bag(i, j);
                        row.multi.extend_from_slice(bag);
                        row.lens.push(bag.len() as u32);
                    } else {
                        row.ids[j] = self.ids()[i * ns + j];
                    }
                }
                row.label = self.labels()[i];
                c.push(&row);
            }
            Examples::from_columns(c)
        };
        Ok((part(0..cut), part(cut..self.len)))
    }

    /// Whether field `j` of example `i` is missing.
    pub fn is_missing(&self, i: usize, j: usize) -> bool {
        assert!(i < self.len && j < self.num_sparse, "index out of range");
        bit(
            self.missing_bits(),
            self.bit_base() + i * self.num_sparse + j,
        )
    }

    /// The id of field `j` of example `i`, `None` where missing.
    pub fn id(&self, i: usize, j: usize) -> Option<u32> {
        (!self.is_missing(i, j)).then(|| self.ids()[i * self.num_sparse + j])
    }

    /// A checksum of the examples' content (dense features, ids, missing flags, labels):
    /// the same data gives the same value whatever its path, compression or cache.
    pub fn digest(&self) -> u64 {
        *self.digest.get_or_init(|| {
            let shape = [
                self.len as u64,
                self.num_dense as u64,
                self.num_sparse as u64,
            ];
            let base = self.bit_base();
            let all = self.missing_bits();
            let bits: Vec<u8> = if base == 0 {
                all.to_vec()
            } else {
                let n = self.len * self.num_sparse;
                let mut v = vec![0u8; n.div_ceil(8)];
                for k in (0..n).filter(|&k| bit(all, base + k)) {
                    v[k / 8] |= 1 << (k % 8);
                }
                v
            };
            let n_bits = (self.len * self.num_sparse).div_ceil(8);
            let (bag_lens, ids): (Vec<u64>, &[u32]) = match self.bag_ends() {
                // the view's own bags: lengths and ids, wherever they sit in the file
                Some(ends) => {
                    let mut prev = self.ends_before();
                    let lens = ends
                        .iter()
                        .map(|&e| {
                            let l = e - prev;
                            prev = e;
                            l
                        })
                        .collect();
                    let (a, b) = (self.ends_before() as usize, prev as usize);
                    (lens, &self.ids()[a..b])
                }
                None => (Vec::new(), self.ids()),
            };
            super::checksum(&[
                bytemuck::cast_slice(&shape),
                bytemuck::cast_slice(self.dense()),
                bytemuck::cast_slice(ids),
                &bits[..n_bits],
                bytemuck::cast_slice(self.labels()),
                bytemuck::cast_slice(&bag_lens),
            ])
        })
    }

    /// Share of examples with label 1.
    pub fn positive_rate(&self) -> f64 {
        if self.len == 0 {
            return f64::NAN;
        }
        let pos = self.labels().iter().filter(|&&l| l > 0.5).count();
        pos as f64 / self.len as f64
    }

    /// Examples `first .. first + batch`, wrapping around at the end, into row-major
    /// buffers: `dense` `[batch, num_dense]`, `rows` `[batch, num_sparse]` (one id per
    /// field: `id mod rows_per_table`, 0 where missing), `labels` `[batch]`.
    ///
    /// # Panics
    /// If there are no examples, `rows_per_table` is 0 or a buffer's length is not the
    /// one above.
    pub fn fill_batch(
        &self,
        first: u64,
        batch: usize,
        rows_per_table: usize,
        dense: &mut [f32],
        rows: &mut [u32],
        labels: &mut [f32],
    ) {
        let field_rows = vec![rows_per_table; self.num_sparse];
        self.fill_batch_rows(first, batch, &field_rows, None, dense, rows, labels);
    }

    /// As [`Examples::fill_batch`], with field `j`'s ids taken `mod field_rows[j]`, and
    /// (multi-hot data) each example's field `j` in `slots[j]` entries of `rows`, the
    /// bag's ids first and [`crate::model::ctr::PAD_ROW`] after them; `rows` is then
    /// `[batch, Σ slots]`.
    #[allow(clippy::too_many_arguments)]
    pub fn fill_batch_rows(
        &self,
        first: u64,
        batch: usize,
        field_rows: &[usize],
        slots: Option<&[usize]>,
        dense: &mut [f32],
        rows: &mut [u32],
        labels: &mut [f32],
    ) {
        assert!(self.len > 0, "fill_batch: no examples");
        let start = (first % self.len as u64) as usize;
        let n = self.len;
        self.fill(
            (0..batch).map(|k| (start + k) % n),
            batch,
            field_rows,
            slots,
            dense,
            rows,
            labels,
        );
    }

    /// As [`Examples::fill_batch`], for the examples at `indices` (each `< len`), e.g.
    /// a shuffled order.
    pub fn fill_batch_indices(
        &self,
        indices: &[usize],
        rows_per_table: usize,
        dense: &mut [f32],
        rows: &mut [u32],
        labels: &mut [f32],
    ) {
        let field_rows = vec![rows_per_table; self.num_sparse];
        self.fill_batch_indices_rows(indices, &field_rows, None, dense, rows, labels);
    }

    /// As [`Examples::fill_batch_indices`], with one table size and (multi-hot data) one
    /// bag size a field, as [`Examples::fill_batch_rows`].
    pub fn fill_batch_indices_rows(
        &self,
        indices: &[usize],
        field_rows: &[usize],
        slots: Option<&[usize]>,
        dense: &mut [f32],
        rows: &mut [u32],
        labels: &mut [f32],
    ) {
        assert!(
            indices.iter().all(|&i| i < self.len),
            "fill_batch_indices: index out of range"
        );
        self.fill(
            indices.iter().copied(),
            indices.len(),
            field_rows,
            slots,
            dense,
            rows,
            labels,
        );
    }

    #[allow(clippy::too_many_arguments)]
    fn fill(
        &self,
        indices: impl Iterator<Item = usize>,
        batch: usize,
        field_rows: &[usize],
        slots: Option<&[usize]>,
        dense: &mut [f32],
        rows: &mut [u32],
        labels: &mut [f32],
    ) {
        let (nd, ns) = (self.num_dense, self.num_sparse);
        assert_eq!(field_rows.len(), ns, "fill_batch: one table size per field");
        assert!(
            field_rows.iter().all(|&r| r > 0),
            "fill_batch: a table of 0 rows"
        );
        let ones = vec![1; ns];
        let slots = slots.unwrap_or(&ones);
        assert_eq!(slots.len(), ns, "fill_batch: one bag size per field");
        let per: usize = slots.iter().sum();
        assert_eq!(
            dense.len(),
            batch * nd,
            "fill_batch: dense must be [batch, num_dense]"
        );
        assert_eq!(
            rows.len(),
            batch * per,
            "fill_batch: rows must be [batch, slots of a batch's example]"
        );
        assert_eq!(labels.len(), batch, "fill_batch: labels must be [batch]");
        let (src_dense, src_ids, src_labels, bits) =
            (self.dense(), self.ids(), self.labels(), self.missing_bits());
        let base = self.bit_base();
        let rpt: Vec<u32> = field_rows
            .iter()
            .map(|&r| u32::try_from(r).unwrap_or(u32::MAX))
            .collect();
        let multi = self.is_multi_hot() || slots.iter().any(|&h| h != 1);
        for (k, i) in indices.enumerate() {
            dense[k * nd..(k + 1) * nd].copy_from_slice(&src_dense[i * nd..(i + 1) * nd]);
            if multi {
                // each field's bag in its slots, the rest padding
                let mut at = k * per;
                for j in 0..ns {
                    let bag = self.bag(i, j);
                    let n = bag.len().min(slots[j]);
                    for (slot, &id) in rows[at..at + n].iter_mut().zip(bag) {
                        *slot = id % rpt[j];
                    }
                    rows[at + n..at + slots[j]].fill(crate::model::ctr::PAD_ROW);
                    at += slots[j];
                }
            } else {
                for j in 0..ns {
                    let g = i * ns + j;
                    rows[k * ns + j] = if bit(bits, base + g) {
                        0
                    } else {
                        src_ids[g] % rpt[j]
                    };
                }
            }
            labels[k] = src_labels[i];
        }
    }

    /// Distinct ids of each field (missing values not counted), counted in parallel.
    pub fn distinct_ids(&self) -> Vec<usize> {
        use rayon::prelude::*;
        let ns = self.num_sparse;
        (0..ns)
            .into_par_iter()
            .map(|j| {
                let mut seen = std::collections::HashSet::new();
                for i in 0..self.len {
                    seen.extend(self.bag(i, j).iter().copied());
                }
                seen.len()
            })
            .collect()
    }
}

/// Loads `src`: from the cache when a valid one matches the files and schema, else by
/// parsing (then writing the cache). Returns the training examples, the evaluation split
/// if the schema asks for one (`time`), and a report.
pub fn load(
    src: &DataSource,
    opts: &LoadOptions,
) -> Result<(Examples, Option<Examples>, LoadReport)> {
    let (files, skipped) = resolve_path_noted(src.path())?;
    let mut parser = match src {
        DataSource::Criteo { .. } => Parser::Criteo(criteo::CriteoParser::new()),
        DataSource::Tsv { schema, .. } => {
            schema.validate()?;
            Parser::Tsv(Box::new(tsv::TsvParser::new(schema.clone())?))
        }
    };
    let mut report = LoadReport {
        files: files.len(),
        warnings: skipped,
        ..Default::default()
    };

    let key = match &opts.cache_dir {
        Some(dir) => Some(cache::CacheKey::new(dir, src, &files)?),
        None => None,
    };
    if let Some(key) = &key {
        report.cache_path = Some(key.path.clone());
        match cache::open(key) {
            Ok(Some(hit)) => {
                if opts.strict && hit.report.malformed > 0 {
                    let first = hit.report.first_errors.first().cloned().unwrap_or_default();
                    bail!("{first}");
                }
                let mut r = hit.report;
                r.from_cache = true;
                r.cache_path = Some(key.path.clone());
                return Ok((hit.train, hit.eval, r));
            }
            Ok(None) => {}
            Err(why) => report.warnings.push(format!(
                "cache {} not used ({why:#}); rebuilt",
                key.path.display()
            )),
        }
    }

    let t0 = std::time::Instant::now();
    if let Some(key) = key.as_ref().filter(|_| !parser.has_time()) {
        if opts.stream.unwrap_or_else(|| larger_than_memory(&files)) {
            let mut w = cache::StreamWriter::new(
                key,
                parser.num_dense(),
                parser.num_sparse(),
                parser.is_multi(),
            )?;
            let parsed = read_files(&files, &mut parser, opts, &mut report, &mut w);
            report.parse_secs = t0.elapsed().as_secs_f64();
            report.examples = w.len() as u64;
            let n = w.len();
            let joined = parsed.and_then(|()| {
                if too_few_examples(n as u64, &report) {
                    bail!("{}", no_examples(src, &report));
                }
                w.finish(key, &report)
            });
            joined?;
            let hit = cache::open(key)?
                .ok_or_else(|| anyhow!("the cache {} just written is gone", key.path.display()))?;
            return Ok((hit.train, hit.eval, report));
        }
    }
    let mut sink = InMemory {
        cols: parser.columns(),
        times: parser.has_time().then(Vec::new),
    };
    read_files(&files, &mut parser, opts, &mut report, &mut sink)?;
    let (cols, times) = (sink.cols, sink.times);
    report.parse_secs = t0.elapsed().as_secs_f64();
    if too_few_examples(cols.len as u64, &report) {
        bail!("{}", no_examples(src, &report));
    }
    report.examples = cols.len as u64;
    let (train, eval) = match (src, times) {
        (DataSource::Tsv { schema, .. }, Some(times)) => {
            let keep = latest_by_time(&times, schema.eval_fraction);
            let eval = cols.select(&keep, true);
            let train = cols.select(&keep, false);
            (train, Some(eval))
        }
        _ => (cols, None),
    };
    report.eval_examples = eval.as_ref().map_or(0, |e| e.len as u64);

    if let Some(key) = &key {
        if let Err(e) = cache::write(key, &train, eval.as_ref(), &report) {
            report.warnings.push(format!(
                "could not write cache {}: {e:#}",
                key.path.display()
            ));
        }
    }
    Ok((
        Examples::from_columns(train),
        eval.filter(|e| e.len > 0).map(Examples::from_columns),
        report,
    ))
}

/// Whether a load found no examples, or fewer than malformed lines: data in another
/// format than the one asked for (a folder of other files, the wrong separator), which
/// skipping would turn into a run on the few lines that happen to parse.
fn too_few_examples(examples: u64, report: &LoadReport) -> bool {
    examples == 0 || report.malformed > examples
}

/// The error of a load that found no examples, or mostly malformed lines.
fn no_examples(src: &DataSource, report: &LoadReport) -> String {
    let examples = report.lines.saturating_sub(report.malformed);
    let first = report
        .first_errors
        .first()
        .map(String::as_str)
        .unwrap_or("");
    if report.malformed > 0 && examples > 0 {
        return format!(
            "{} of the {} lines of {} are malformed, more than parse: is the data in this format? (skipping is for a few bad lines; first: {first})",
            report.malformed,
            report.lines,
            src.path()
        );
    }
    let mut msg = format!("no examples in {}", src.path());
    if report.malformed > 0 {
        msg += &format!(
            " ({} malformed lines skipped; first: {first})",
            report.malformed
        );
    }
    msg
}

/// `true` for the latest `round(n * fraction)` examples by time (ties by position), at
/// least one and leaving at least one when `n >= 2`.
fn latest_by_time(times: &[f64], fraction: f64) -> Vec<bool> {
    let n = times.len();
    let mut k = ((n as f64) * fraction).round() as usize;
    if n >= 2 {
        k = k.clamp(1, n - 1);
    } else {
        k = 0;
    }
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| times[a].total_cmp(&times[b]).then(a.cmp(&b)));
    let mut keep = vec![false; n];
    for &i in &order[n - k..] {
        keep[i] = true;
    }
    keep
}

/// The readers of the text formats, one type for every parsing thread.
#[derive(Clone)]
pub(crate) enum Parser {
    Criteo(criteo::CriteoParser),
    Tsv(Box<tsv::TsvParser>),
}

/// `$e` with `$p` bound to whichever reader `$s` is.
macro_rules! each_parser {
    ($s:expr, $p:ident => $e:expr) => {
        match $s {
            Parser::Criteo($p) => $e,
            Parser::Tsv($p) => $e,
        }
    };
}

impl LineParser for Parser {
    fn num_dense(&self) -> usize {
        each_parser!(self, p => p.num_dense())
    }
    fn num_sparse(&self) -> usize {
        each_parser!(self, p => p.num_sparse())
    }
    fn has_header(&self) -> bool {
        each_parser!(self, p => p.has_header())
    }
    fn has_time(&self) -> bool {
        each_parser!(self, p => p.has_time())
    }
    fn is_multi(&self) -> bool {
        each_parser!(self, p => p.is_multi())
    }
    fn header(&mut self, line: &[u8]) -> Result<()> {
        each_parser!(self, p => p.header(line))
    }
    fn parse(&mut self, line: &[u8], row: &mut Row) -> std::result::Result<(), String> {
        each_parser!(self, p => p.parse(line, row))
    }
}

/// Pieces of a plain file are about this large, so that every thread has work.
const PIECE_BYTES: usize = 8 << 20;

/// What one thread parsed: a whole file, or a piece of a plain one.
struct Piece {
    file: usize,
    /// Line breaks before the piece in its file (so its first line is `lines_before + 1`);
    /// known only once the pieces before it are counted.
    lines_before: u64,
    /// Line breaks in the piece.
    newlines: u64,
    cols: Columns,
    times: Option<Vec<f64>>,
    data_lines: u64,
    bytes: u64,
    malformed: u64,
    /// (line within the piece, 1-based; message) of the first malformed lines.
    errors: Vec<(u64, String)>,
    /// Stop at the first malformed line.
    strict: bool,
}

/// A line of text with its line break (LF, CR LF) cut off.
fn trim_eol(mut line: &[u8]) -> &[u8] {
    if let Some(l) = line.strip_suffix(b"\n") {
        line = l;
    }
    if let Some(l) = line.strip_suffix(b"\r") {
        line = l;
    }
    line
}

impl Piece {
    fn new(file: usize, parser: &Parser, strict: bool) -> Piece {
        Piece {
            file,
            lines_before: 0,
            newlines: 0,
            cols: parser.columns(),
            times: parser.has_time().then(Vec::new),
            data_lines: 0,
            bytes: 0,
            malformed: 0,
            errors: Vec::new(),
            strict,
        }
    }

    /// One line (without its break), the `k`-th of the piece (1-based); `first_of_file`:
    /// it is the file's line 1 (a BOM and the header are handled there).
    fn line(
        &mut self,
        parser: &mut Parser,
        row: &mut Row,
        mut line: &[u8],
        k: u64,
        first_of_file: bool,
        name: &str,
    ) -> Result<bool> {
        if first_of_file {
            if let Some(l) = line.strip_prefix(b"\xEF\xBB\xBF") {
                line = l;
            }
            if parser.has_header() {
                parser
                    .header(line)
                    .map_err(|e| anyhow!("{name}:1: header: {e:#}"))?;
                return Ok(true);
            }
        }
        if line.is_empty() {
            return Ok(true);
        }
        self.data_lines += 1;
        match parser.parse(line, row) {
            Ok(()) => {
                self.cols.push(row);
                if let Some(t) = self.times.as_mut() {
                    t.push(row.time);
                }
            }
            Err(msg) => {
                self.malformed += 1;
                if self.errors.len() < MAX_REPORTED_ERRORS {
                    self.errors.push((k, msg));
                }
                if self.strict {
                    return Ok(false);
                }
            }
        }
        Ok(true)
    }

    /// Parses `text`, a run of whole lines of file `name` (the file's start when
    /// `at_start`).
    fn parse_text(
        &mut self,
        parser: &mut Parser,
        text: &[u8],
        at_start: bool,
        name: &str,
    ) -> Result<()> {
        let mut row = Row::new(parser.num_dense(), parser.num_sparse());
        self.bytes = text.len() as u64;
        let mut k = 0u64;
        for raw in text.split_inclusive(|&b| b == b'\n') {
            k += 1;
            if raw.last() == Some(&b'\n') {
                self.newlines += 1;
            }
            if !self.line(parser, &mut row, trim_eol(raw), k, at_start && k == 1, name)? {
                break;
            }
        }
        Ok(())
    }
}

/// A file's bytes as they are read: memory-mapped plain text, or a decompressing stream.
enum Text {
    Plain(Mmap),
    Empty,
    Stream(Box<dyn BufRead + Send>),
}

/// Opens `path`: plain text is mapped; gzip and zstd (told by their first bytes, not by
/// the name) are decompressed as they are read; other compressions are refused by name.
fn open_text(path: &Path) -> Result<Text> {
    let file = File::open(path).map_err(|e| anyhow!("cannot open {}: {e}", path.display()))?;
    let mut reader = BufReader::with_capacity(1 << 20, file);
    let head = reader
        .fill_buf()
        .map_err(|e| anyhow!("cannot read {}: {e}", path.display()))?
        .to_vec();
    if head.starts_with(&GZIP_MAGIC) {
        let gz = flate2::bufread::MultiGzDecoder::new(reader);
        return Ok(Text::Stream(Box::new(BufReader::with_capacity(
            1 << 20,
            gz,
        ))));
    }
    if head.starts_with(&ZSTD_MAGIC) {
        let zs = zstd::stream::read::Decoder::with_buffer(reader)
            .map_err(|e| anyhow!("{}: not a readable zstd stream: {e}", path.display()))?;
        return Ok(Text::Stream(Box::new(BufReader::with_capacity(
            1 << 20,
            zs,
        ))));
    }
    let unsupported = [
        (&b"BZh"[..], "bzip2", "bunzip2 -k"),
        (&[0xfd, b'7', b'z', b'X', b'Z', 0][..], "xz", "unxz -k"),
        (&[0x04, 0x22, 0x4d, 0x18][..], "lz4", "lz4 -d"),
        (&b"PK\x03\x04"[..], "a zip archive", "unzip"),
        (
            &[b'7', b'z', 0xbc, 0xaf, 0x27, 0x1c][..],
            "a 7z archive",
            "7z x",
        ),
    ];
    for (magic, what, tool) in unsupported {
        if head.starts_with(magic) {
            bail!(
                "{} is {what}, which is not supported: decompress it first ({tool}), or \
                 recompress it with gzip or zstd, which are read as they are",
                path.display()
            );
        }
    }
    drop(reader);
    let file = File::open(path).map_err(|e| anyhow!("cannot open {}: {e}", path.display()))?;
    if file.metadata().map(|m| m.len()).unwrap_or(0) == 0 {
        return Ok(Text::Empty);
    }
    // SAFETY: the map is read-only and lives only while this load parses it, and the
    // parser reads it only as bytes (any value is valid). What could still go wrong: a
    // program truncating the data file while it is mapped (reads past the end raise
    // SIGBUS, as for the cache) or rewriting it (the load then sees wrong values or
    // malformed lines).
    let map =
        unsafe { Mmap::map(&file) }.map_err(|e| anyhow!("cannot map {}: {e}", path.display()))?;
    Ok(Text::Plain(map))
}

/// The pieces of plain text `map`: ranges of whole lines, about [`PIECE_BYTES`] each.
fn pieces_of(map: &[u8]) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let mut start = 0;
    while start < map.len() {
        let mut end = (start + PIECE_BYTES).min(map.len());
        if end < map.len() {
            end = match map[end..].iter().position(|&b| b == b'\n') {
                Some(k) => end + k + 1,
                None => map.len(),
            };
        }
        out.push(start..end);
        start = end;
    }
    out
}

/// Where parsed pieces go, in the files' order.
pub(crate) trait Sink {
    fn add(&mut self, cols: &Columns, times: Option<&[f64]>) -> Result<()>;
}

/// Every example in memory (and the times, for a split by time).
pub(crate) struct InMemory {
    pub cols: Columns,
    pub times: Option<Vec<f64>>,
}

impl Sink for InMemory {
    fn add(&mut self, cols: &Columns, times: Option<&[f64]>) -> Result<()> {
        self.cols.append(cols);
        if let (Some(t), Some(pt)) = (self.times.as_mut(), times) {
            t.extend_from_slice(pt);
        }
        Ok(())
    }
}

/// A run of whole lines of one file, to parse on one thread: a slice of a mapped plain
/// file, or a block read from a decompressing stream.
struct Chunk<'a> {
    file: usize,
    /// The file's start (its line 1 is in this chunk).
    at_start: bool,
    text: std::borrow::Cow<'a, [u8]>,
}

/// The chunks of `files` in order, each about [`PIECE_BYTES`]: mapped files are cut at
/// line breaks without copying; streams are read a block at a time.
struct Chunks<'a> {
    /// Each file's map (plain text), or `None`.
    maps: Vec<Option<&'a [u8]>>,
    /// Each file's decompressing stream, or `None`.
    streams: Vec<Option<Box<dyn BufRead + Send>>>,
    names: &'a [String],
    file: usize,
    /// Pieces of the current mapped file still to hand out.
    pieces: std::vec::IntoIter<Range<usize>>,
    /// The current stream's unfinished last line, and whether its start was handed out.
    carry: Vec<u8>,
    started: bool,
}

impl<'a> Chunks<'a> {
    fn new(texts: &'a mut [Text], names: &'a [String]) -> Self {
        let mut streams = Vec::new();
        for t in texts.iter_mut() {
            match std::mem::replace(t, Text::Empty) {
                Text::Stream(s) => streams.push(Some(s)),
                other => {
                    *t = other;
                    streams.push(None);
                }
            }
        }
        let texts: &'a [Text] = texts;
        let maps = texts
            .iter()
            .map(|t| match t {
                Text::Plain(map) => Some(&map[..]),
                _ => None,
            })
            .collect();
        Chunks {
            maps,
            streams,
            names,
            file: 0,
            pieces: Vec::new().into_iter(),
            carry: Vec::new(),
            started: false,
        }
    }

    /// The next chunk, or `None` after the last file.
    fn next_chunk(&mut self) -> Result<Option<Chunk<'a>>> {
        while self.file < self.maps.len() {
            let f = self.file;
            if let Some(map) = self.maps[f] {
                if !self.started {
                    self.pieces = pieces_of(map).into_iter();
                    self.started = true;
                }
                if let Some(r) = self.pieces.next() {
                    return Ok(Some(Chunk {
                        file: f,
                        at_start: r.start == 0,
                        text: std::borrow::Cow::Borrowed(&map[r]),
                    }));
                }
            } else if let Some(s) = self.streams[f].as_mut() {
                let mut buf = std::mem::take(&mut self.carry);
                let name = &self.names[f];
                // at least a piece's worth of text and a line break in it, or the end
                let mut eof = false;
                while buf.len() < PIECE_BYTES
                    || !buf[buf.len().saturating_sub(PIECE_BYTES)..].contains(&b'\n')
                {
                    let got = s
                        .fill_buf()
                        .map_err(|e| anyhow!("{name}: read error: {e}"))?;
                    if got.is_empty() {
                        eof = true;
                        break;
                    }
                    let n = got.len();
                    buf.extend_from_slice(got);
                    s.consume(n);
                }
                if !buf.is_empty() {
                    let cut = match buf.iter().rposition(|&b| b == b'\n') {
                        Some(k) if !eof => k + 1,
                        _ => buf.len(),
                    };
                    self.carry = buf.split_off(cut);
                    let at_start = !self.started;
                    self.started = true;
                    return Ok(Some(Chunk {
                        file: f,
                        at_start,
                        text: std::borrow::Cow::Owned(buf),
                    }));
                }
            }
            self.file += 1;
            self.started = false;
        }
        Ok(None)
    }
}

/// Parses every line of `files`, in parallel (pieces of plain files, blocks of streamed
/// ones), into `sink` in the files' order. At most a few pieces per thread are held at
/// once, so a sink that writes to disk bounds the memory a load takes.
fn read_files(
    files: &[PathBuf],
    parser: &mut Parser,
    opts: &LoadOptions,
    report: &mut LoadReport,
    sink: &mut dyn Sink,
) -> Result<()> {
    use rayon::prelude::*;
    let strict = opts.strict;
    let mut texts: Vec<Text> = files.iter().map(|f| open_text(f)).collect::<Result<_>>()?;
    let names: Vec<String> = files.iter().map(|f| f.display().to_string()).collect();

    // The first file's header names the columns every thread resolves; without a
    // header, the first data line gives the field count every later line must have.
    prime(parser, &texts, files)?;

    let threads = match opts.threads {
        Some(n) if n > 0 => n,
        _ => std::thread::available_parallelism().map_or(1, |n| n.get()),
    };
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .map_err(|e| anyhow!("cannot start {threads} parsing threads: {e}"))?;
    let proto = parser.clone();
    let window = threads * 3;
    let mut progress = opts.progress.then(|| ParseProgress::new(&texts));
    let mut chunks = Chunks::new(&mut texts, &names);
    // line breaks before the next piece of its file
    let (mut before, mut last_file) = (0u64, usize::MAX);
    let mut pieces_done = 0usize;
    loop {
        let mut batch = Vec::with_capacity(window);
        while batch.len() < window {
            match chunks.next_chunk()? {
                Some(c) => batch.push(c),
                None => break,
            }
        }
        if batch.is_empty() {
            break;
        }
        let parsed: Vec<Piece> = pool.install(|| {
            batch
                .par_iter()
                .map(|c| -> Result<Piece> {
                    let mut p = proto.clone();
                    let mut piece = Piece::new(c.file, &p, strict);
                    piece.parse_text(&mut p, &c.text, c.at_start, &names[c.file])?;
                    Ok(piece)
                })
                .collect::<Result<Vec<Piece>>>()
        })?;
        pieces_done += parsed.len();
        for mut piece in parsed {
            if piece.file != last_file {
                before = 0;
                last_file = piece.file;
            }
            piece.lines_before = before;
            before += piece.newlines;
            report.lines += piece.data_lines;
            report.parse_bytes += piece.bytes;
            report.malformed += piece.malformed;
            for (k, msg) in piece.errors.drain(..) {
                let e = format!("{}:{}: {msg}", names[piece.file], piece.lines_before + k);
                if strict {
                    bail!(e);
                }
                if report.first_errors.len() < MAX_REPORTED_ERRORS {
                    report.first_errors.push(e);
                }
            }
            sink.add(&piece.cols, piece.times.as_deref())?;
        }
        if let Some(p) = &mut progress {
            p.show(report);
        }
    }
    if let Some(p) = &mut progress {
        p.done();
    }
    report.parse_threads = threads.min(pieces_done.max(1));
    Ok(())
}

/// The progress of a long parse, on stderr.
struct ParseProgress {
    t0: std::time::Instant,
    last: Option<std::time::Instant>,
    terminal: bool,
    /// The files' bytes on disk, where none is compressed (a share can then be given).
    plain_bytes: Option<u64>,
    shown: bool,
}

impl ParseProgress {
    /// For `texts` as `open_text` opened them: their size is known where none is a
    /// decompressed stream.
    fn new(texts: &[Text]) -> Self {
        use std::io::IsTerminal;
        let total = texts.iter().try_fold(0u64, |t, x| match x {
            Text::Plain(m) => Some(t + m.len() as u64),
            Text::Empty => Some(t),
            Text::Stream(_) => None,
        });
        ParseProgress {
            t0: std::time::Instant::now(),
            last: None,
            terminal: std::io::stderr().is_terminal(),
            plain_bytes: total,
            shown: false,
        }
    }

    fn show(&mut self, report: &LoadReport) {
        let Some(line) = self.line(report, std::time::Instant::now()) else {
            return;
        };
        if self.terminal {
            eprint!("\r{line}\x1b[K");
        } else {
            eprintln!("{line}");
        }
        self.shown = true;
    }

    /// The line to print at `now`, if one is due.
    fn line(&mut self, report: &LoadReport, now: std::time::Instant) -> Option<String> {
        let since = |t: std::time::Instant| now.saturating_duration_since(t).as_secs_f64();
        let every = if self.terminal { 0.5 } else { 10.0 };
        if since(self.t0) < 2.0 || self.last.is_some_and(|t| since(t) < every) {
            return None;
        }
        self.last = Some(now);
        let secs = since(self.t0);
        let share = self
            .plain_bytes
            .filter(|&t| t > 0)
            .map(|t| {
                format!(
                    " of {:.0} MB ({:.0} %)",
                    t as f64 / 1e6,
                    100.0 * report.parse_bytes as f64 / t as f64
                )
            })
            .unwrap_or_default();
        Some(format!(
            "parsing: {} lines, {:.0} MB{share}, {:.0}k lines/s, {} malformed",
            report.lines,
            report.parse_bytes as f64 / 1e6,
            report.lines as f64 / secs / 1e3,
            report.malformed
        ))
    }

    fn done(&mut self) {
        if self.terminal && self.shown {
            eprintln!();
        }
    }
}

/// Gives `parser` what every thread must share before parsing starts: the first file's
/// header, or (without a header) the field count of the first data line.
fn prime(parser: &mut Parser, texts: &[Text], files: &[PathBuf]) -> Result<()> {
    let Some((i, first)) = texts
        .iter()
        .enumerate()
        .find(|(_, t)| !matches!(t, Text::Empty))
    else {
        return Ok(());
    };
    let name = files[i].display().to_string();
    let first_line = |want: usize| -> Result<Vec<Vec<u8>>> {
        // the first `want` lines of the first file (streams are reopened for it)
        let mut out = Vec::new();
        match first {
            Text::Plain(m) => {
                for raw in m.split_inclusive(|&b| b == b'\n').take(want) {
                    out.push(trim_eol(raw).to_vec());
                }
            }
            _ => {
                let mut r = match open_text(&files[i])? {
                    Text::Stream(s) => s,
                    _ => return Ok(out),
                };
                let mut buf = Vec::new();
                for _ in 0..want {
                    buf.clear();
                    if r.read_until(b'\n', &mut buf)
                        .map_err(|e| anyhow!("{name}: read error: {e}"))?
                        == 0
                    {
                        break;
                    }
                    out.push(trim_eol(&buf).to_vec());
                }
            }
        }
        Ok(out)
    };
    if parser.has_header() {
        if let Some(h) = first_line(1)?.first() {
            let h = h.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(h);
            parser
                .header(h)
                .map_err(|e| anyhow!("{name}:1: header: {e:#}"))?;
        }
    } else if let Parser::Tsv(_) = parser {
        // the first non-empty line fixes the field count (its errors are reported when
        // its thread parses it again)
        for line in first_line(64)? {
            let line = line.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(&line);
            if !line.is_empty() {
                let mut row = Row::new(parser.num_dense(), parser.num_sparse());
                let _ = parser.parse(line, &mut row);
                break;
            }
        }
    }
    Ok(())
}

/// Whether `name` matches `pattern` (`*`: any run of characters, `?`: one character).
pub fn glob_match(pattern: &str, name: &str) -> bool {
    let (p, s): (Vec<char>, Vec<char>) = (pattern.chars().collect(), name.chars().collect());
    let (mut pi, mut si) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while si < s.len() {
        if pi < p.len() && (p[pi] == '?' || p[pi] == s[si]) {
            pi += 1;
            si += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some((pi, si));
            pi += 1;
        } else if let Some((sp, ss)) = star {
            pi = sp + 1;
            si = ss + 1;
            star = Some((sp, ss + 1));
        } else {
            return false;
        }
    }
    while pi < p.len() && p[pi] == '*' {
        pi += 1;
    }
    pi == p.len()
}

/// The files of a data path: a file, a folder's regular files (not starting with `.`),
/// or a glob on the file-name part; sorted by name.
pub fn resolve_path(path: &str) -> Result<Vec<PathBuf>> {
    resolve_path_noted(path).map(|(files, _)| files)
}

/// As [`resolve_path`], with a note for each entry of a folder that is not read: a
/// subfolder, a broken link, a FIFO or another special file.
pub fn resolve_path_noted(path: &str) -> Result<(Vec<PathBuf>, Vec<String>)> {
    let p = Path::new(path);
    let name = p.file_name().map(|n| n.to_string_lossy().into_owned());
    let is_glob = name
        .as_deref()
        .is_some_and(|n| n.contains('*') || n.contains('?'));
    if !is_glob {
        let meta = std::fs::metadata(p).map_err(|e| anyhow!("data path {path}: {e}"))?;
        if meta.is_file() {
            return Ok((vec![p.to_path_buf()], Vec::new()));
        }
        if meta.is_dir() {
            let (files, notes) = list_dir(p, |n| !n.starts_with('.'))?;
            if files.is_empty() {
                bail!("data folder {path} holds no files");
            }
            return Ok((files, notes));
        }
        bail!("data path {path} is neither a file nor a folder (a FIFO or device cannot be read twice, as training needs)");
    }
    let pattern = name.unwrap_or_default();
    let dir = match p.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let dir_text = dir.to_string_lossy();
    if dir_text.contains('*') || dir_text.contains('?') {
        bail!("data path {path}: wildcards are allowed only in the file name");
    }
    let (files, notes) = list_dir(dir, |n| {
        (pattern.starts_with('.') || !n.starts_with('.')) && glob_match(&pattern, n)
    })
    .map_err(|e| anyhow!("data path {path}: {e:#}"))?;
    if files.is_empty() {
        bail!("no files match {path}");
    }
    Ok((files, notes))
}

fn list_dir(dir: &Path, want: impl Fn(&str) -> bool) -> Result<(Vec<PathBuf>, Vec<String>)> {
    let mut out = Vec::new();
    let mut notes = Vec::new();
    let entries =
        std::fs::read_dir(dir).map_err(|e| anyhow!("cannot list {}: {e}", dir.display()))?;
    for entry in entries {
        let entry = entry.map_err(|e| anyhow!("cannot list {}: {e}", dir.display()))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if !want(&name) || cache::is_cache_file_name(&name) {
            continue;
        }
        let path = entry.path();
        // Follows symbolic links: a link to a regular file counts as one.
        match std::fs::metadata(&path) {
            Ok(m) if m.is_file() => out.push(path),
            Ok(m) if m.is_dir() => notes.push(format!(
                "skipped {}: a folder (data folders are not read recursively)",
                path.display()
            )),
            Ok(_) => notes.push(format!(
                "skipped {}: not a regular file (a FIFO, socket or device)",
                path.display()
            )),
            Err(e) => notes.push(format!("skipped {}: {e} (a broken link?)", path.display())),
        }
    }
    out.sort();
    notes.sort();
    Ok((out, notes))
}

/// A field for an error message: lossy UTF-8, cut to 40 characters.
pub(crate) fn show(field: &[u8]) -> String {
    let s = String::from_utf8_lossy(field);
    let mut out: String = s.chars().take(40).collect();
    if s.chars().count() > 40 {
        out.push('…');
    }
    format!("'{}'", out.escape_debug())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_progress_is_quiet_for_2_s_then_shows_the_share_every_interval() {
        let t0 = std::time::Instant::now();
        let mut p = ParseProgress {
            t0,
            last: None,
            terminal: false,
            plain_bytes: Some(1_000_000),
            shown: false,
        };
        let report = LoadReport {
            lines: 5000,
            parse_bytes: 250_000,
            ..Default::default()
        };
        let at = |s: f64| t0 + std::time::Duration::from_secs_f64(s);
        assert_eq!(p.line(&report, at(1.0)), None);
        let line = p.line(&report, at(2.5)).expect("due after 2 s");
        assert!(
            line.contains("5000 lines") && line.contains("(25 %)"),
            "{line}"
        );
        assert_eq!(p.line(&report, at(5.0)), None, "within the interval");
        assert!(p.line(&report, at(12.6)).is_some());
        // a compressed file: no share
        p.plain_bytes = None;
        let line = p.line(&report, at(30.0)).expect("due");
        assert!(!line.contains('%'), "{line}");
    }
}
