//! The spec's deterministic synthetic CTR data ("Synthetic data" in
//! `shared/spec/ctr-model.md`), bit-compatible with `SyntheticCTR` in the PyTorch
//! anchor `shared/anchors/torch_ctr.py`.
//!
//! Everything comes from a counter-based generator, so any example can be made on its
//! own, in any order, on any number of threads:
//!
//! ```text
//! u64(seed, stream, i, slot) = splitmix64(splitmix64(seed*16 + stream) + i*64 + slot)
//! uniform = (u64 >> 11) * 2^-53
//! normal  = sqrt(-2 ln(1 - u1)) * cos(2 pi u2)      (u1, u2 from slots 2t, 2t+1)
//! ```
//!
//! Streams: 0 teacher tables, 1 training examples, 2 held-out evaluation examples,
//! 3 shift calibration. Example `i` of a stream:
//! - dense `t` (13): `x = floor(exp(1.5 + 1.2 n_t))`, feature `ln(1 + max(x, 0))`;
//! - field `j` (26): `rank = #{r : cdf[r] <= u}` for the Zipf(1.1) CDF over `rows`
//!   values and `u` from slot `26 + j`; `id = splitmix64(rank + (j+1)*2^32) >> 1`;
//!   `row = id mod rows` (global row `j*rows + row` in the concatenated table);
//! - label: `u(slot 52) < sigmoid(teacher - shift)`, with an fp64 teacher made of
//!   per-row weights, six factorised field pairs and a linear dense term.
//!
//! `shift` is calibrated by bisection so that the mean teacher probability over the
//! first 2^18 examples of stream 3 is 0.25, exactly as the anchor does it.
//!
//! Matching the anchor: all arithmetic follows the anchor's fp64 expression order
//! (`(2 pi) * u2`, `-2 * log1p(-u1)`, the sequential cumulative sum then division by
//! its last element, the teacher summed field by field, then pair by pair, then the
//! dense term). The CDF is bit-identical to torch's on CPU; torch's CUDA `cumsum`
//! (a parallel scan) differs from it by up to 2e-14, and the teacher's reductions by
//! an ulp or so. Such differences can only change an example whose uniform lies within
//! ~1e-14 of a decision boundary (a CDF step, an integer of `x`, the label threshold):
//! 250_000 examples of streams 1 and 2 made by the anchor on CUDA matched this code
//! exactly (rows, dense bits, labels), and the shift agreed to 5e-16.

use std::fmt;

/// Dense features per example (Criteo's I1..I13).
pub const NUM_DENSE: usize = 13;
/// Categorical fields per example (Criteo's C1..C26), one embedding table each.
pub const NUM_SPARSE: usize = 26;
/// Counter slots reserved per example: `i*64 + slot` keeps examples disjoint.
pub const SLOTS: u64 = 64;
/// First slot of the dense features' 26 uniforms (13 Box-Muller pairs).
pub const SLOT_DENSE: u64 = 0;
/// First slot of the fields' 26 uniforms.
pub const SLOT_SPARSE: u64 = 26;
/// Slot of the label's uniform.
pub const SLOT_LABEL: u64 = 52;
/// Stream of the teacher's tables.
pub const STREAM_TEACHER: u64 = 0;
/// Stream of training examples (`i` = global example index, `step*batch + row`).
pub const STREAM_TRAIN: u64 = 1;
/// Stream of held-out examples (the spec evaluates on examples 0..199_999).
pub const STREAM_EVAL: u64 = 2;
/// Stream of the examples that calibrate the shift.
pub const STREAM_CALIBRATION: u64 = 3;
/// Examples of [`STREAM_CALIBRATION`] that calibrate the shift.
pub const CALIBRATION_EXAMPLES: usize = 1 << 18;
/// Positive rate that the shift is calibrated to.
pub const POS_RATE: f64 = 0.25;
/// Zipf exponent of the categorical ids.
pub const ZIPF_EXPONENT: f64 = 1.1;
/// Field pairs whose factor dot products enter the teacher.
pub const PAIRS: [(usize, usize); 6] = [(0, 1), (2, 3), (4, 9), (5, 12), (6, 18), (10, 25)];
/// Width of the teacher's per-row factors.
pub const FAC_DIM: usize = 4;
/// Row stride between the ids of a multi-hot bag (the anchor's `--hot > 1`).
pub const HOT_STRIDE: u64 = 7919;

/// Bisection bounds and iteration count of the anchor's shift calibration.
const BISECT_LO: f64 = -20.0;
const BISECT_HI: f64 = 20.0;
const BISECT_ITERS: usize = 60;
/// Calibration sums are formed per block of this many examples, then the blocks are
/// added in index order, so the shift does not depend on the number of threads.
const SUM_BLOCK: usize = 4096;
/// Below this many examples `fill_batch` stays on the calling thread.
const PARALLEL_MIN_BATCH: usize = 2048;

/// The splitmix64 finaliser (wrapping 64-bit arithmetic), the anchor's mixing step.
#[inline]
pub fn splitmix64(z: u64) -> u64 {
    let z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    let z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Per-(seed, stream) base of the counter: `splitmix64(seed*16 + stream)`.
#[inline]
pub fn stream_base(seed: u64, stream: u64) -> u64 {
    splitmix64(seed.wrapping_mul(16).wrapping_add(stream))
}

/// The anchor's counter RNG: `splitmix64(splitmix64(seed*16 + stream) + index*64 + slot)`.
/// Public so that golden tests can rebuild parameters with the same rule.
#[inline]
pub fn rng_u64(seed: u64, stream: u64, index: u64, slot: u64) -> u64 {
    counter(stream_base(seed, stream), index, slot)
}

#[inline]
fn counter(base: u64, index: u64, slot: u64) -> u64 {
    splitmix64(
        base.wrapping_add(index.wrapping_mul(SLOTS))
            .wrapping_add(slot),
    )
}

/// Uniform in `[0, 1)` from the top 53 bits, as the anchor's `u64_to_uniform`.
#[inline]
pub fn u64_to_uniform(z: u64) -> f64 {
    (z >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// Box-Muller (cos branch) in the anchor's operation order; `1 - u1 > 0` always.
#[inline]
pub fn box_muller(u1: f64, u2: f64) -> f64 {
    (-2.0 * (-u1).ln_1p()).sqrt() * ((2.0 * std::f64::consts::PI) * u2).cos()
}

/// Standard normal from slots `(slot, slot + 1)` of one counter position.
#[inline]
fn normal_at(base: u64, index: u64, slot: u64) -> f64 {
    box_muller(
        u64_to_uniform(counter(base, index, slot)),
        u64_to_uniform(counter(base, index, slot + 1)),
    )
}

/// `torch.sigmoid` in fp64.
#[inline]
fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// What the generator makes; `Default` is the spec's (seed 0, 100_000 rows, one-hot).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SyntheticConfig {
    /// Data seed (the anchor's `--data-seed`).
    pub seed: u64,
    /// Rows per embedding table; ids map to rows by `id mod rows`.
    pub rows: usize,
    /// Ids per field (multi-hot bag size). The anchor's extra ids are not fresh Zipf
    /// draws: id `h` of a bag is `(row + h*7919) mod rows`, row being the one-hot row;
    /// labels and the teacher depend on the one-hot row only.
    pub hot: usize,
}

impl Default for SyntheticConfig {
    fn default() -> Self {
        SyntheticConfig {
            seed: 0,
            rows: 100_000,
            hot: 1,
        }
    }
}

/// Why a configuration was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SyntheticError {
    /// `rows` must be at least 1.
    ZeroRows,
    /// `hot` must be at least 1.
    ZeroHot,
    /// Per-field rows are `u32`, so `rows` may be at most 2^32.
    TooManyRows(usize),
}

impl fmt::Display for SyntheticError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SyntheticError::ZeroRows => write!(f, "synthetic data: rows must be at least 1"),
            SyntheticError::ZeroHot => write!(f, "synthetic data: hot must be at least 1"),
            SyntheticError::TooManyRows(r) => {
                write!(
                    f,
                    "synthetic data: rows = {r} does not fit per-field u32 rows"
                )
            }
        }
    }
}

impl std::error::Error for SyntheticError {}

/// One example. Multi-hot bags are not stored here: `rows` holds each field's first
/// (Zipf-drawn) row, and [`SyntheticCtr::hot_row`] gives the others.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Example {
    /// `ln(1 + max(x, 0))`, computed in fp64 then rounded to f32 (as the anchor).
    pub dense: [f32; NUM_DENSE],
    /// Row of each field within its own table (`id mod rows`); the global row in the
    /// concatenated table is `field*rows + row`.
    pub rows: [u32; NUM_SPARSE],
    /// 0.0 or 1.0.
    pub label: f32,
    /// The teacher's score before the shift, in fp64 from the fp64 features (the f32
    /// `dense` would not reproduce it exactly); `teacher - shift` is the logit that
    /// drew the label.
    pub teacher: f64,
}

/// The generator: the Zipf CDF, the teacher's tables and the calibrated shift.
#[derive(Clone, Debug)]
pub struct SyntheticCtr {
    cfg: SyntheticConfig,
    threads: usize,
    /// Normalised Zipf(1.1) CDF over ranks 1..=rows; `cdf[rows-1] == 1.0`.
    cdf: Vec<f64>,
    /// `wid[j*rows + r]`: per-row weight of field `j`.
    wid: Vec<f64>,
    /// `fac[(2p + side)*rows + r]`: factors of pair `p`'s field `side` (0 = a, 1 = b).
    /// Only the 12 paired fields have factors that the teacher reads.
    fac: Vec<[f64; FAC_DIM]>,
    /// Weights of the dense features (centred at 1.5).
    wd: [f64; NUM_DENSE],
    shift: f64,
}

impl SyntheticCtr {
    /// Builds the generator on all available cores (the result does not depend on
    /// how many).
    ///
    /// # Panics
    /// On a configuration that [`SyntheticCtr::try_new`] refuses.
    pub fn new(cfg: SyntheticConfig) -> Self {
        match Self::try_new(cfg) {
            Ok(g) => g,
            Err(e) => panic!("{e}"),
        }
    }

    /// Builds the generator, refusing `rows == 0`, `hot == 0` or `rows > 2^32`.
    pub fn try_new(cfg: SyntheticConfig) -> Result<Self, SyntheticError> {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        Self::with_threads(cfg, threads)
    }

    /// As [`SyntheticCtr::try_new`] on `threads` threads (0 counts as 1); every
    /// thread count gives bit-identical tables, shift and examples.
    pub fn with_threads(cfg: SyntheticConfig, threads: usize) -> Result<Self, SyntheticError> {
        if cfg.rows == 0 {
            return Err(SyntheticError::ZeroRows);
        }
        if cfg.hot == 0 {
            return Err(SyntheticError::ZeroHot);
        }
        if cfg.rows as u64 > 1u64 << 32 {
            return Err(SyntheticError::TooManyRows(cfg.rows));
        }
        let threads = threads.max(1);
        let rows = cfg.rows;
        let base = stream_base(cfg.seed, STREAM_TEACHER);

        let cdf = zipf_cdf(rows);

        // wid[j, r] = 0.25 n(stream 0, i = j*rows + r, slots 0, 1)
        let mut wid = vec![0.0f64; NUM_SPARSE * rows];
        par_for_each(&mut wid, threads, |start, out| {
            for (k, w) in out.iter_mut().enumerate() {
                *w = 0.25 * normal_at(base, (start + k) as u64, 0);
            }
        });

        // fac[j, r, c] = 0.35 n(same i, slots 2 + 2c, 3 + 2c)
        let mut fac = vec![[0.0f64; FAC_DIM]; 2 * PAIRS.len() * rows];
        par_for_each(&mut fac, threads, |start, out| {
            for (k, f) in out.iter_mut().enumerate() {
                let flat = start + k;
                let (p, side, r) = (flat / (2 * rows), (flat / rows) % 2, flat % rows);
                let field = if side == 0 { PAIRS[p].0 } else { PAIRS[p].1 };
                let i = (field * rows + r) as u64;
                for (c, v) in f.iter_mut().enumerate() {
                    *v = 0.35 * normal_at(base, i, 2 + 2 * c as u64);
                }
            }
        });

        // wd[t] = 0.15 n(stream 0, i = 26*rows + t, slots 0, 1)
        let mut wd = [0.0f64; NUM_DENSE];
        for (t, w) in wd.iter_mut().enumerate() {
            *w = 0.15 * normal_at(base, (NUM_SPARSE * rows + t) as u64, 0);
        }

        let mut gen = SyntheticCtr {
            cfg,
            threads,
            cdf,
            wid,
            fac,
            wd,
            shift: 0.0,
        };
        gen.shift = gen.calibrate_shift();
        Ok(gen)
    }

    /// The anchor's calibration: 60 bisection steps on [-20, 20], moving `lo` up while
    /// the mean probability is above 0.25, and the midpoint of the final bracket.
    fn calibrate_shift(&self) -> f64 {
        let base = stream_base(self.cfg.seed, STREAM_CALIBRATION);
        let mut teacher = vec![0.0f64; CALIBRATION_EXAMPLES];
        par_for_each(&mut teacher, self.threads, |start, out| {
            for (k, t) in out.iter_mut().enumerate() {
                *t = self.raw(base, (start + k) as u64).teacher;
            }
        });
        let blocks = CALIBRATION_EXAMPLES.div_ceil(SUM_BLOCK);
        let mut partial = vec![0.0f64; blocks];
        let (mut lo, mut hi) = (BISECT_LO, BISECT_HI);
        for _ in 0..BISECT_ITERS {
            let mid = 0.5 * (lo + hi);
            par_for_each(&mut partial, self.threads, |start, out| {
                for (k, s) in out.iter_mut().enumerate() {
                    let b = start + k;
                    let end = ((b + 1) * SUM_BLOCK).min(teacher.len());
                    *s = teacher[b * SUM_BLOCK..end]
                        .iter()
                        .map(|&t| sigmoid(t - mid))
                        .sum();
                }
            });
            let mean = partial.iter().sum::<f64>() / teacher.len() as f64;
            if mean > POS_RATE {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        0.5 * (lo + hi)
    }

    /// The configuration it was built with.
    pub fn config(&self) -> SyntheticConfig {
        self.cfg
    }

    /// Rows per table.
    pub fn rows(&self) -> usize {
        self.cfg.rows
    }

    /// Ids per field.
    pub fn hot(&self) -> usize {
        self.cfg.hot
    }

    /// The calibrated label shift (the anchor reports it as `label_shift`).
    pub fn shift(&self) -> f64 {
        self.shift
    }

    /// Example `index` of `stream`.
    pub fn example(&self, stream: u64, index: u64) -> Example {
        self.raw(stream_base(self.cfg.seed, stream), index)
    }

    /// The logit that drew the example's label: `teacher - shift`.
    pub fn teacher_logit(&self, ex: &Example) -> f64 {
        ex.teacher - self.shift
    }

    /// The probability that drew the example's label: `sigmoid(teacher - shift)`.
    /// Its BCE against the labels is the best achievable NE (about 0.767).
    pub fn teacher_prob(&self, ex: &Example) -> f64 {
        sigmoid(self.teacher_logit(ex))
    }

    /// Row `h` (0-based) of a field's multi-hot bag whose first row is `row`, as the
    /// anchor's `--hot`: `(row + h*7919) mod rows`.
    pub fn hot_row(&self, row: u32, h: usize) -> u32 {
        ((row as u64 + h as u64 * HOT_STRIDE) % self.cfg.rows as u64) as u32
    }

    /// Row of `field`'s `row` in the concatenated `[26*rows, D]` table.
    pub fn global_row(&self, field: usize, row: u32) -> u64 {
        (field * self.cfg.rows) as u64 + row as u64
    }

    /// Examples `first_index .. first_index + batch` of `stream` into row-major
    /// buffers: `dense` `[batch, 13]`, `rows` `[batch, 26, hot]` (per-field rows, the
    /// bag of a field contiguous: the anchor's id order less the field offsets),
    /// `labels` `[batch]`. Large batches are split over the generator's threads.
    ///
    /// # Panics
    /// If a buffer's length is not the one above.
    pub fn fill_batch(
        &self,
        stream: u64,
        first_index: u64,
        batch: usize,
        dense: &mut [f32],
        rows: &mut [u32],
        labels: &mut [f32],
    ) {
        let hot = self.cfg.hot;
        let per_rows = NUM_SPARSE * hot;
        assert_eq!(
            dense.len(),
            batch * NUM_DENSE,
            "fill_batch: dense must be [batch, 13]"
        );
        assert_eq!(
            rows.len(),
            batch * per_rows,
            "fill_batch: rows must be [batch, 26*hot]"
        );
        assert_eq!(labels.len(), batch, "fill_batch: labels must be [batch]");
        let base = stream_base(self.cfg.seed, stream);
        let fill = |start: usize, d: &mut [f32], r: &mut [u32], l: &mut [f32]| {
            for (k, label) in l.iter_mut().enumerate() {
                let ex = self.raw(base, first_index.wrapping_add((start + k) as u64));
                d[k * NUM_DENSE..(k + 1) * NUM_DENSE].copy_from_slice(&ex.dense);
                let bag = &mut r[k * per_rows..(k + 1) * per_rows];
                for (j, &row) in ex.rows.iter().enumerate() {
                    for h in 0..hot {
                        bag[j * hot + h] = self.hot_row(row, h);
                    }
                }
                *label = ex.label;
            }
        };
        let threads = if batch >= PARALLEL_MIN_BATCH {
            self.threads.min(batch)
        } else {
            1
        };
        if threads <= 1 {
            fill(0, dense, rows, labels);
            return;
        }
        let chunk = batch.div_ceil(threads);
        let fill = &fill;
        std::thread::scope(|s| {
            let parts = dense
                .chunks_mut(chunk * NUM_DENSE)
                .zip(rows.chunks_mut(chunk * per_rows))
                .zip(labels.chunks_mut(chunk))
                .enumerate();
            for (c, ((d, r), l)) in parts {
                s.spawn(move || fill(c * chunk, d, r, l));
            }
        });
    }

    /// `teacher - shift` of examples `first_index .. first_index + out.len()` of
    /// `stream`, for scoring the teacher itself (the best achievable NE).
    pub fn fill_teacher_logits(&self, stream: u64, first_index: u64, out: &mut [f64]) {
        let base = stream_base(self.cfg.seed, stream);
        par_for_each(out, self.threads, |start, o| {
            for (k, v) in o.iter_mut().enumerate() {
                let ex = self.raw(base, first_index.wrapping_add((start + k) as u64));
                *v = ex.teacher - self.shift;
            }
        });
    }

    /// One example from its stream's counter base, in the anchor's `_raw` order.
    fn raw(&self, base: u64, index: u64) -> Example {
        let rows_n = self.cfg.rows;

        let mut feat = [0.0f64; NUM_DENSE];
        let mut dense = [0.0f32; NUM_DENSE];
        for t in 0..NUM_DENSE {
            let n = normal_at(base, index, SLOT_DENSE + 2 * t as u64);
            let x = (1.5 + 1.2 * n).exp().floor();
            feat[t] = x.max(0.0).ln_1p();
            dense[t] = feat[t] as f32;
        }

        let mut rows = [0u32; NUM_SPARSE];
        for (j, row) in rows.iter_mut().enumerate() {
            let u = u64_to_uniform(counter(base, index, SLOT_SPARSE + j as u64));
            // torch.searchsorted(cdf, u, right=True).clamp_max(rows - 1)
            let rank = self.cdf.partition_point(|&c| c <= u).min(rows_n - 1) as u64;
            let id = splitmix64(rank.wrapping_add((j as u64 + 1) << 32)) >> 1;
            *row = (id % rows_n as u64) as u32;
        }

        let mut teacher = 0.0f64;
        for (j, &row) in rows.iter().enumerate() {
            teacher += self.wid[j * rows_n + row as usize];
        }
        for (p, &(a, b)) in PAIRS.iter().enumerate() {
            let fa = &self.fac[(2 * p) * rows_n + rows[a] as usize];
            let fb = &self.fac[(2 * p + 1) * rows_n + rows[b] as usize];
            // Left to right; torch's reduction order may differ by an ulp (see above).
            teacher += fa.iter().zip(fb).fold(0.0f64, |acc, (x, y)| acc + x * y);
        }
        let lin = feat
            .iter()
            .zip(&self.wd)
            .fold(0.0f64, |acc, (f, w)| acc + (f - 1.5) * w);
        teacher += lin;

        let ulabel = u64_to_uniform(counter(base, index, SLOT_LABEL));
        let label = if ulabel < sigmoid(teacher - self.shift) {
            1.0
        } else {
            0.0
        };
        Example {
            dense,
            rows,
            label,
            teacher,
        }
    }
}

/// Zipf(1.1) CDF as the anchor builds it: `pmf[r] = (r+1)^-1.1`, a sequential
/// cumulative sum (torch's CPU `cumsum` order), then each entry divided by the last.
fn zipf_cdf(rows: usize) -> Vec<f64> {
    let mut cdf = Vec::with_capacity(rows);
    let mut acc = 0.0f64;
    for r in 1..=rows {
        acc += (r as f64).powf(-ZIPF_EXPONENT);
        cdf.push(acc);
    }
    let total = acc;
    for c in &mut cdf {
        *c /= total;
    }
    cdf
}

/// Runs `f(start, chunk)` over contiguous chunks of `out` on up to `threads` scoped
/// threads; `start` is the chunk's first index. Work is per element, so the result
/// does not depend on the split.
fn par_for_each<T, F>(out: &mut [T], threads: usize, f: F)
where
    T: Send,
    F: Fn(usize, &mut [T]) + Sync,
{
    let threads = threads.clamp(1, out.len().max(1));
    if threads == 1 {
        f(0, out);
        return;
    }
    let chunk = out.len().div_ceil(threads);
    let f = &f;
    std::thread::scope(|s| {
        for (c, part) in out.chunks_mut(chunk).enumerate() {
            s.spawn(move || f(c * chunk, part));
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The anchor's `rng_selftest`, with its expected values taken from the rule.
    #[test]
    fn counter_matches_definition() {
        let base = splitmix64(3 * 16 + 2);
        for i in [0u64, 1, 12345, (1 << 33) + 7] {
            for s in [0u64, 5, 63] {
                let want = splitmix64(base.wrapping_add(i * 64 + s));
                assert_eq!(rng_u64(3, 2, i, s), want);
            }
        }
    }

    #[test]
    fn refuses_empty_config() {
        let cfg = SyntheticConfig {
            rows: 0,
            ..SyntheticConfig::default()
        };
        assert_eq!(
            SyntheticCtr::try_new(cfg).err(),
            Some(SyntheticError::ZeroRows)
        );
    }
}
