//! MNIST from the standard IDX files (`train-images-idx3-ubyte`, `train-labels-idx1-ubyte`,
//! `t10k-images-idx3-ubyte`, `t10k-labels-idx1-ubyte`), each plain or gzip (told by the
//! first two bytes, not by the name: `NAME` and `NAME.gz` are both looked for).
//!
//! ```text
//! images: u32 BE 0x00000803, u32 count, u32 rows (28), u32 cols (28), count·784 bytes
//! labels: u32 BE 0x00000801, u32 count, count bytes (0..=9)
//! ```
//!
//! Pixels are scaled to `[0, 1]`. Every mistake (a missing file, a wrong magic, a wrong
//! size, a truncated file, a label out of range, images and labels of different counts)
//! is an error that names the file.

use std::io::Read as _;
use std::path::{Path, PathBuf};

use anyhow::{bail, ensure, Context, Result};

/// Image side in pixels.
pub const SIDE: usize = 28;
/// Pixels per image.
pub const PIXELS: usize = SIDE * SIDE;
/// Classes (digits).
pub const CLASSES: usize = 10;
/// Magic of an IDX file of unsigned bytes in 3 dimensions (images).
pub const IMAGES_MAGIC: u32 = 0x0000_0803;
/// Magic of an IDX file of unsigned bytes in 1 dimension (labels).
pub const LABELS_MAGIC: u32 = 0x0000_0801;

/// The training (60 000 images) or test (10 000 images) split.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    Train,
    Test,
}

impl Split {
    /// The file-name prefix of the split: `train` or `t10k`.
    pub fn prefix(self) -> &'static str {
        match self {
            Split::Train => "train",
            Split::Test => "t10k",
        }
    }

    /// The images file's name, without `.gz`.
    pub fn images_file(self) -> String {
        format!("{}-images-idx3-ubyte", self.prefix())
    }

    /// The labels file's name, without `.gz`.
    pub fn labels_file(self) -> String {
        format!("{}-labels-idx1-ubyte", self.prefix())
    }
}

/// One split in memory.
#[derive(Clone, Debug, PartialEq)]
pub struct Mnist {
    /// `[n, 784]`, row-major, scaled to `[0, 1]`.
    pub images: Vec<f32>,
    /// `[n]`, digits 0..=9.
    pub labels: Vec<i32>,
    /// Number of examples.
    pub n: usize,
}

/// Loads one split from the folder `dir`.
pub fn load(dir: &Path, split: Split) -> Result<Mnist> {
    if !dir.is_dir() {
        bail!(
            "MNIST folder {} does not exist or is not a folder (it must hold {} and {}, plain or .gz)",
            dir.display(),
            split.images_file(),
            split.labels_file()
        );
    }
    let img_path = find(dir, &split.images_file())?;
    let lab_path = find(dir, &split.labels_file())?;
    let images = parse_images(&read_maybe_gzip(&img_path)?)
        .with_context(|| format!("MNIST images {}", img_path.display()))?;
    let labels = parse_labels(&read_maybe_gzip(&lab_path)?)
        .with_context(|| format!("MNIST labels {}", lab_path.display()))?;
    ensure!(
        images.len() == labels.len() * PIXELS,
        "{} holds {} images but {} holds {} labels",
        img_path.display(),
        images.len() / PIXELS,
        lab_path.display(),
        labels.len()
    );
    Ok(Mnist {
        n: labels.len(),
        images: images.iter().map(|&p| f32::from(p) / 255.0).collect(),
        labels: labels.iter().map(|&l| i32::from(l)).collect(),
    })
}

/// `dir/name` or else `dir/name.gz`.
fn find(dir: &Path, name: &str) -> Result<PathBuf> {
    let plain = dir.join(name);
    if plain.is_file() {
        return Ok(plain);
    }
    let gz = dir.join(format!("{name}.gz"));
    if gz.is_file() {
        return Ok(gz);
    }
    bail!(
        "MNIST file {name} not found: neither {} nor {} exists",
        plain.display(),
        gz.display()
    )
}

/// A file's bytes, gunzipped when it starts with the gzip magic `1f 8b`.
pub fn read_maybe_gzip(path: &Path) -> Result<Vec<u8>> {
    let raw = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    if raw.starts_with(&[0x1f, 0x8b]) {
        let mut out = Vec::with_capacity(raw.len() * 4);
        flate2::read::MultiGzDecoder::new(&raw[..])
            .read_to_end(&mut out)
            .with_context(|| format!("{}: corrupt or truncated gzip data", path.display()))?;
        Ok(out)
    } else {
        Ok(raw)
    }
}

fn be_u32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn check_magic(b: &[u8], want: u32, what: &str) -> Result<()> {
    ensure!(
        b.len() >= 4,
        "truncated: {} bytes, too short for an IDX header",
        b.len()
    );
    let magic = be_u32(b, 0);
    if magic != want {
        let hint = match magic {
            IMAGES_MAGIC => " (an images file)",
            LABELS_MAGIC => " (a labels file)",
            _ if b.starts_with(&[0x1f, 0x8b]) => " (gzip inside gzip?)",
            _ => "",
        };
        bail!("bad magic 0x{magic:08x}{hint}: an IDX {what} file starts with 0x{want:08x}");
    }
    Ok(())
}

/// The pixels of an IDX images file (after gunzip): `count·784` bytes, unscaled.
pub fn parse_images(b: &[u8]) -> Result<Vec<u8>> {
    check_magic(b, IMAGES_MAGIC, "images")?;
    ensure!(
        b.len() >= 16,
        "truncated: {} bytes, an IDX images header has 16",
        b.len()
    );
    let (n, rows, cols) = (
        be_u32(b, 4) as usize,
        be_u32(b, 8) as usize,
        be_u32(b, 12) as usize,
    );
    ensure!(
        rows == SIDE && cols == SIDE,
        "images are {rows}x{cols} pixels, MNIST's are {SIDE}x{SIDE}"
    );
    let want = n * PIXELS;
    let have = b.len() - 16;
    ensure!(
        have >= want,
        "truncated: the header announces {n} images ({want} bytes of pixels), the file holds {have}"
    );
    ensure!(
        have == want,
        "{} bytes after the last of the {n} images the header announces",
        have - want
    );
    Ok(b[16..].to_vec())
}

/// The labels of an IDX labels file (after gunzip).
pub fn parse_labels(b: &[u8]) -> Result<Vec<u8>> {
    check_magic(b, LABELS_MAGIC, "labels")?;
    ensure!(
        b.len() >= 8,
        "truncated: {} bytes, an IDX labels header has 8",
        b.len()
    );
    let n = be_u32(b, 4) as usize;
    let have = b.len() - 8;
    ensure!(
        have >= n,
        "truncated: the header announces {n} labels, the file holds {have}"
    );
    ensure!(
        have == n,
        "{} bytes after the last of the {n} labels the header announces",
        have - n
    );
    if let Some(i) = b[8..].iter().position(|&l| usize::from(l) >= CLASSES) {
        bail!("label {i} is {}, not a digit 0..=9", b[8 + i]);
    }
    Ok(b[8..].to_vec())
}

/// The bytes of an IDX images file holding `pixels` (`count·784` bytes, row-major).
pub fn encode_images(pixels: &[u8]) -> Vec<u8> {
    let n = (pixels.len() / PIXELS) as u32;
    let mut out = Vec::with_capacity(16 + pixels.len());
    for v in [IMAGES_MAGIC, n, SIDE as u32, SIDE as u32] {
        out.extend_from_slice(&v.to_be_bytes());
    }
    out.extend_from_slice(pixels);
    out
}

/// The bytes of an IDX labels file.
pub fn encode_labels(labels: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(8 + labels.len());
    out.extend_from_slice(&LABELS_MAGIC.to_be_bytes());
    out.extend_from_slice(&(labels.len() as u32).to_be_bytes());
    out.extend_from_slice(labels);
    out
}

impl Mnist {
    pub fn len(&self) -> usize {
        self.n
    }

    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// The pixels of example `i`, `[784]`.
    pub fn image(&self, i: usize) -> &[f32] {
        &self.images[i * PIXELS..(i + 1) * PIXELS]
    }

    /// Copies examples `indices` into `images` (`[indices.len(), 784]`) and `labels`.
    pub fn fill_batch(&self, indices: &[usize], images: &mut [f32], labels: &mut [i32]) {
        assert_eq!(images.len(), indices.len() * PIXELS, "images buffer size");
        assert_eq!(labels.len(), indices.len(), "labels buffer size");
        for (k, &i) in indices.iter().enumerate() {
            images[k * PIXELS..(k + 1) * PIXELS].copy_from_slice(self.image(i));
            labels[k] = self.labels[i];
        }
    }

    /// Copies the `labels.len()` examples from `first` on, wrapping around at the end
    /// (so a last, partial batch is padded with the first examples); returns how many
    /// of them are real (not wrapped).
    pub fn fill_range(&self, first: usize, images: &mut [f32], labels: &mut [i32]) -> usize {
        let b = labels.len();
        let idx: Vec<usize> = (first..first + b).map(|i| i % self.n.max(1)).collect();
        self.fill_batch(&idx, images, labels);
        self.n.saturating_sub(first).min(b)
    }

    /// The first `n` examples (for quick runs).
    pub fn truncate(&mut self, n: usize) {
        let n = n.min(self.n);
        self.images.truncate(n * PIXELS);
        self.labels.truncate(n);
        self.n = n;
    }
}

/// A permutation of `0..n` for epoch `epoch` (Fisher-Yates on a counter-based generator,
/// so it is the same on every machine).
pub fn shuffled(n: usize, seed: u64, epoch: u64) -> Vec<usize> {
    let mut v: Vec<usize> = (0..n).collect();
    let base = erase_runtime::init::splitmix64(seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    for i in (1..n).rev() {
        let r = erase_runtime::init::splitmix64(base ^ i as u64);
        v.swap(i, (r % (i as u64 + 1)) as usize);
    }
    v
}
