//! The CPU reference implementation of every op, generic over f32 and f64. These
//! functions are the specification the CUDA kernels are tested against. Parallel work is
//! split by output rows only, and every reduction runs in a fixed order, so results are
//! bit-identical for any number of threads.

use super::real::{gemm, Mat, Real};
use rayon::prelude::*;

/// Elements per parallel task below which a loop stays on one thread.
const GRAIN: usize = 1 << 15;

/// Applies `f(row_index, row)` to every `row_len`-sized row of `out`, in parallel when
/// there is enough work.
pub fn for_rows<T: Send>(out: &mut [T], row_len: usize, f: impl Fn(usize, &mut [T]) + Sync) {
    if row_len == 0 {
        return;
    }
    let rows = out.len() / row_len;
    let per_task = GRAIN.div_ceil(row_len).max(1);
    if rows <= per_task {
        out.chunks_mut(row_len)
            .enumerate()
            .for_each(|(i, r)| f(i, r));
    } else {
        out.par_chunks_mut(row_len * per_task)
            .enumerate()
            .for_each(|(ci, chunk)| {
                for (j, r) in chunk.chunks_mut(row_len).enumerate() {
                    f(ci * per_task + j, r);
                }
            });
    }
}

/// `out[i] = f(i)`, in parallel for large outputs.
pub fn map_index<T: Send>(out: &mut [T], f: impl Fn(usize) -> T + Sync) {
    if out.len() <= GRAIN {
        out.iter_mut().enumerate().for_each(|(i, o)| *o = f(i));
    } else {
        out.par_chunks_mut(GRAIN).enumerate().for_each(|(ci, c)| {
            for (j, o) in c.iter_mut().enumerate() {
                *o = f(ci * GRAIN + j);
            }
        });
    }
}

// ---- dense -------------------------------------------------------------------------

/// `y[M,N] = x[M,K]·w[N,K]ᵀ (+ b[N])`.
pub fn linear<T: Real>(
    x: &[T],
    w: &[T],
    b: Option<&[T]>,
    y: &mut [T],
    m: usize,
    k: usize,
    n: usize,
) {
    gemm(
        m,
        k,
        n,
        Mat::row_major(x, k, false),
        Mat::row_major(w, k, true),
        y,
    );
    if let Some(b) = b {
        for_rows(y, n, |_, row| {
            for (o, &bb) in row.iter_mut().zip(b) {
                *o += bb;
            }
        });
    }
}

/// `dx[M,K] = dy[M,N]·w[N,K]`.
pub fn linear_grad_input<T: Real>(dy: &[T], w: &[T], dx: &mut [T], m: usize, k: usize, n: usize) {
    gemm(
        m,
        n,
        k,
        Mat::row_major(dy, n, false),
        Mat::row_major(w, k, false),
        dx,
    );
}

/// `dw[N,K] = dy[M,N]ᵀ·x[M,K]`.
pub fn linear_grad_weight<T: Real>(dy: &[T], x: &[T], dw: &mut [T], m: usize, k: usize, n: usize) {
    gemm(
        n,
        m,
        k,
        Mat::row_major(dy, n, true),
        Mat::row_major(x, k, false),
        dw,
    );
}

/// Batched `c = op(a)·op(b)`; `a` is `[batch, ra, ca]`, `b` `[batch, rb, cb]`.
#[allow(clippy::too_many_arguments)]
pub fn matmul<T: Real>(
    a: &[T],
    b: &[T],
    c: &mut [T],
    batch: usize,
    (ra, ca): (usize, usize),
    (rb, cb): (usize, usize),
    ta: bool,
    tb: bool,
) {
    let (m, k) = if ta { (ca, ra) } else { (ra, ca) };
    let n = if tb { rb } else { cb };
    for i in 0..batch {
        let asl = &a[i * ra * ca..(i + 1) * ra * ca];
        let bsl = &b[i * rb * cb..(i + 1) * rb * cb];
        let csl = &mut c[i * m * n..(i + 1) * m * n];
        gemm(
            m,
            k,
            n,
            Mat::row_major(asl, ca, ta),
            Mat::row_major(bsl, cb, tb),
            csl,
        );
    }
}

/// `c = a + b` or `a ⊙ b` with `b` repeated over `a` (its shape a suffix of `a`'s).
pub fn broadcast_binary<T: Real>(a: &[T], b: &[T], c: &mut [T], mul: bool) {
    let nb = b.len();
    if mul {
        map_index(c, |i| a[i] * b[i % nb]);
    } else {
        map_index(c, |i| a[i] + b[i % nb]);
    }
}

/// `out[j] = Σ_i dy[i·n + j]`, summed over `i` in order.
pub fn sum_to_shape<T: Real>(dy: &[T], out: &mut [T]) {
    let n = out.len();
    let rows = dy.len() / n;
    // Columns are independent: split them in blocks; each block walks the rows in order.
    const COLS: usize = 64;
    let work = |(bi, blk): (usize, &mut [T])| {
        let c0 = bi * COLS;
        blk.iter_mut().for_each(|o| *o = T::ZERO);
        for r in 0..rows {
            let row = &dy[r * n + c0..r * n + c0 + blk.len()];
            for (o, &v) in blk.iter_mut().zip(row) {
                *o += v;
            }
        }
    };
    if dy.len() <= GRAIN || n <= COLS {
        out.chunks_mut(COLS).enumerate().for_each(work);
    } else {
        out.par_chunks_mut(COLS).enumerate().for_each(work);
    }
}

// ---- activations -----------------------------------------------------------------

const GELU_C: f64 = 0.797_884_560_802_865_4; // sqrt(2/pi)
const GELU_A: f64 = 0.044_715;

pub fn gelu<T: Real>(x: T) -> T {
    let (c, a) = (T::from_f64(GELU_C), T::from_f64(GELU_A));
    let half = T::from_f64(0.5);
    let u = c * (x + a * x * x * x);
    half * x * (T::ONE + u.tanh())
}

pub fn gelu_grad<T: Real>(x: T) -> T {
    let (c, a) = (T::from_f64(GELU_C), T::from_f64(GELU_A));
    let half = T::from_f64(0.5);
    let u = c * (x + a * x * x * x);
    let t = u.tanh();
    half * (T::ONE + t) + half * x * (T::ONE - t * t) * c * (T::ONE + T::from_f64(3.0) * a * x * x)
}

pub fn sigmoid<T: Real>(x: T) -> T {
    if x >= T::ZERO {
        T::ONE / (T::ONE + (-x).exp())
    } else {
        let e = x.exp();
        e / (T::ONE + e)
    }
}

// ---- layer norm ------------------------------------------------------------------

pub fn layer_norm<T: Real>(
    x: &[T],
    gamma: &[T],
    beta: &[T],
    y: &mut [T],
    mean: &mut [T],
    rstd: &mut [T],
    eps: f64,
) {
    let d = gamma.len();
    // statistics first (one value per row), then the normalised rows
    map_index(mean, |r| {
        let row = &x[r * d..(r + 1) * d];
        let mut s = T::ZERO;
        for &v in row {
            s += v;
        }
        s / T::from_f64(d as f64)
    });
    map_index(rstd, |r| {
        let row = &x[r * d..(r + 1) * d];
        let mu = mean[r];
        let mut s = T::ZERO;
        for &v in row {
            s += (v - mu) * (v - mu);
        }
        T::ONE / (s / T::from_f64(d as f64) + T::from_f64(eps)).sqrt()
    });
    for_rows(y, d, |r, out| {
        let row = &x[r * d..(r + 1) * d];
        for i in 0..d {
            out[i] = (row[i] - mean[r]) * rstd[r] * gamma[i] + beta[i];
        }
    });
}

#[allow(clippy::too_many_arguments)]
pub fn layer_norm_grad<T: Real>(
    dy: &[T],
    x: &[T],
    gamma: &[T],
    mean: &[T],
    rstd: &[T],
    dx: &mut [T],
    dgamma: &mut [T],
    dbeta: &mut [T],
) {
    let d = gamma.len();
    let rows = x.len() / d;
    let inv_d = T::from_f64(1.0 / d as f64);
    for_rows(dx, d, |r, out| {
        let (xr, dyr) = (&x[r * d..(r + 1) * d], &dy[r * d..(r + 1) * d]);
        let (mut s1, mut s2) = (T::ZERO, T::ZERO);
        for i in 0..d {
            let xhat = (xr[i] - mean[r]) * rstd[r];
            let g = dyr[i] * gamma[i];
            s1 += g;
            s2 += g * xhat;
        }
        let (m1, m2) = (s1 * inv_d, s2 * inv_d);
        for i in 0..d {
            let xhat = (xr[i] - mean[r]) * rstd[r];
            out[i] = rstd[r] * (dyr[i] * gamma[i] - m1 - xhat * m2);
        }
    });
    dgamma.iter_mut().for_each(|v| *v = T::ZERO);
    dbeta.iter_mut().for_each(|v| *v = T::ZERO);
    for r in 0..rows {
        for i in 0..d {
            let xhat = (x[r * d + i] - mean[r]) * rstd[r];
            dgamma[i] += dy[r * d + i] * xhat;
            dbeta[i] += dy[r * d + i];
        }
    }
}

// ---- shape ops ---------------------------------------------------------------------

/// Geometry of an axis: `outer` blocks of `axis_len · inner` elements.
#[derive(Clone, Copy, Debug)]
pub struct AxisView {
    pub outer: usize,
    pub inner: usize,
}

impl AxisView {
    pub fn new(dims: &[usize], axis: usize) -> Self {
        AxisView {
            outer: dims[..axis].iter().product(),
            inner: dims[axis + 1..].iter().product(),
        }
    }
}

/// `out` (axis of `total` entries) gets `x` (axis of `len` entries) at entry `start`.
pub fn place<T: Copy>(x: &[T], out: &mut [T], v: AxisView, start: usize, len: usize, total: usize) {
    for o in 0..v.outer {
        let src = &x[o * len * v.inner..(o + 1) * len * v.inner];
        let d0 = (o * total + start) * v.inner;
        out[d0..d0 + len * v.inner].copy_from_slice(src);
    }
}

/// `out` (axis of `len` entries) gets entries `start..start+len` of `x` (axis of `total`).
pub fn take<T: Copy>(x: &[T], out: &mut [T], v: AxisView, start: usize, len: usize, total: usize) {
    for o in 0..v.outer {
        let s0 = (o * total + start) * v.inner;
        out[o * len * v.inner..(o + 1) * len * v.inner].copy_from_slice(&x[s0..s0 + len * v.inner]);
    }
}

// ---- interaction -------------------------------------------------------------------

/// `y[b, p] = <e[b,i], e[b,j]>` over pairs `i < j` in row-major order.
pub fn pairwise_dot<T: Real>(e: &[T], y: &mut [T], f: usize, d: usize) {
    let pairs = f * (f - 1) / 2;
    for_rows(y, pairs, |b, out| {
        let eb = &e[b * f * d..(b + 1) * f * d];
        let mut p = 0;
        for i in 0..f {
            for j in i + 1..f {
                let mut s = T::ZERO;
                for c in 0..d {
                    s += eb[i * d + c] * eb[j * d + c];
                }
                out[p] = s;
                p += 1;
            }
        }
    });
}

pub fn pairwise_dot_grad<T: Real>(dy: &[T], e: &[T], de: &mut [T], f: usize, d: usize) {
    let pairs = f * (f - 1) / 2;
    for_rows(de, f * d, |b, out| {
        let eb = &e[b * f * d..(b + 1) * f * d];
        let g = &dy[b * pairs..(b + 1) * pairs];
        out.iter_mut().for_each(|v| *v = T::ZERO);
        let mut p = 0;
        for i in 0..f {
            for j in i + 1..f {
                for c in 0..d {
                    out[i * d + c] += g[p] * eb[j * d + c];
                    out[j * d + c] += g[p] * eb[i * d + c];
                }
                p += 1;
            }
        }
    });
}

// ---- attention ---------------------------------------------------------------------

/// Attention geometry: `[B, S, H·Dh]` tensors.
#[derive(Clone, Copy, Debug)]
pub struct AttnDims {
    pub s: usize,
    pub heads: usize,
    pub dh: usize,
    pub causal: bool,
    /// Round the probabilities (and dS) to bf16 before they multiply, as the CUDA kernel's
    /// tensor-core products do (the caller rounds q, k, v and do).
    pub bf16: bool,
}

impl AttnDims {
    fn width(&self) -> usize {
        self.heads * self.dh
    }
    fn scale<T: Real>(&self) -> T {
        T::from_f64(1.0 / (self.dh as f64).sqrt())
    }
    fn visible(&self, i: usize, j: usize) -> bool {
        !self.causal || j <= i
    }
    fn round<T: Real>(&self, x: T) -> T {
        if self.bf16 {
            T::from_f64(super::bf16_rne(x.to_f64()).to_f64())
        } else {
            x
        }
    }
}

/// Softmax attention per (batch, head); `lse` is `[B, H, S]`.
pub fn attention<T: Real>(q: &[T], k: &[T], v: &[T], o: &mut [T], lse: &mut [T], a: AttnDims) {
    let (s, w, dh) = (a.s, a.width(), a.dh);
    let scale: T = a.scale();
    let per_b = s * w;
    o.par_chunks_mut(per_b)
        .zip(lse.par_chunks_mut(a.heads * s))
        .enumerate()
        .for_each(|(b, (ob, lb))| {
            let base = b * per_b;
            let mut p = vec![T::ZERO; s];
            for h in 0..a.heads {
                for i in 0..s {
                    let qi = &q[base + i * w + h * dh..base + i * w + (h + 1) * dh];
                    let mut mx = T::neg_infinity();
                    for (j, pj) in p.iter_mut().enumerate() {
                        if !a.visible(i, j) {
                            continue;
                        }
                        let kj = &k[base + j * w + h * dh..base + j * w + (h + 1) * dh];
                        let mut sc = T::ZERO;
                        for c in 0..dh {
                            sc += qi[c] * kj[c];
                        }
                        *pj = sc * scale;
                        mx = mx.max(*pj);
                    }
                    let mut sum = T::ZERO;
                    for (j, pj) in p.iter_mut().enumerate() {
                        if a.visible(i, j) {
                            *pj = (*pj - mx).exp();
                            sum += *pj;
                        }
                    }
                    lb[h * s + i] = mx + sum.ln();
                    let oi = &mut ob[i * w + h * dh..i * w + (h + 1) * dh];
                    oi.iter_mut().for_each(|x| *x = T::ZERO);
                    for (j, &pj) in p.iter().enumerate() {
                        if !a.visible(i, j) {
                            continue;
                        }
                        let vj = &v[base + j * w + h * dh..base + j * w + (h + 1) * dh];
                        let pn = a.round(pj) / sum;
                        for c in 0..dh {
                            oi[c] += pn * vj[c];
                        }
                    }
                }
            }
        });
}

pub struct AttnGradIn<'a, T> {
    pub d_o: &'a [T],
    pub q: &'a [T],
    pub k: &'a [T],
    pub v: &'a [T],
    pub o: &'a [T],
    pub lse: &'a [T],
}

/// The attention backward of FlashAttention-2: probabilities recomputed from `lse`,
/// `D_i = do_i·o_i`, `dS = P ⊙ (dP − D)`.
pub fn attention_grad<T: Real>(
    x: AttnGradIn<T>,
    dq: &mut [T],
    dk: &mut [T],
    dv: &mut [T],
    a: AttnDims,
) {
    let (s, w, dh) = (a.s, a.width(), a.dh);
    let scale: T = a.scale();
    let per_b = s * w;
    dq.par_chunks_mut(per_b)
        .zip(dk.par_chunks_mut(per_b))
        .zip(dv.par_chunks_mut(per_b))
        .enumerate()
        .for_each(|(b, ((dqb, dkb), dvb))| {
            let base = b * per_b;
            dqb.iter_mut().for_each(|v| *v = T::ZERO);
            dkb.iter_mut().for_each(|v| *v = T::ZERO);
            dvb.iter_mut().for_each(|v| *v = T::ZERO);
            let row = |t: &[T], i: usize, h: usize| -> Vec<T> {
                t[base + i * w + h * dh..base + i * w + (h + 1) * dh].to_vec()
            };
            for h in 0..a.heads {
                for i in 0..s {
                    let (qi, doi, oi) = (row(x.q, i, h), row(x.d_o, i, h), row(x.o, i, h));
                    let lse = x.lse[b * a.heads * s + h * s + i];
                    let mut di = T::ZERO;
                    for c in 0..dh {
                        di += doi[c] * oi[c];
                    }
                    for j in 0..s {
                        if !a.visible(i, j) {
                            continue;
                        }
                        let (kj, vj) = (row(x.k, j, h), row(x.v, j, h));
                        let mut sc = T::ZERO;
                        let mut dp = T::ZERO;
                        for c in 0..dh {
                            sc += qi[c] * kj[c];
                            dp += doi[c] * vj[c];
                        }
                        let p = (sc * scale - lse).exp();
                        let ds = a.round(p * (dp - di)) * scale;
                        let p = a.round(p);
                        for c in 0..dh {
                            dvb[j * w + h * dh + c] += p * doi[c];
                            dqb[i * w + h * dh + c] += ds * kj[c];
                            dkb[j * w + h * dh + c] += ds * qi[c];
                        }
                    }
                }
            }
        });
}

// ---- losses ------------------------------------------------------------------------

/// Mean BCE with logits, accumulated in f64 in index order.
pub fn bce_with_logits<T: Real>(x: &[T], y: &[T]) -> f64 {
    let mut s = 0.0f64;
    for (&xi, &yi) in x.iter().zip(y) {
        let (xi, yi) = (xi.to_f64(), yi.to_f64());
        s += xi.max(0.0) - xi * yi + (-xi.abs()).exp().ln_1p();
    }
    s / x.len() as f64
}

pub fn bce_with_logits_grad<T: Real>(dl: T, x: &[T], y: &[T], dx: &mut [T]) {
    let scale = dl / T::from_f64(x.len() as f64);
    map_index(dx, |i| (sigmoid(x[i]) - y[i]) * scale);
}

/// Mean softmax cross-entropy; labels already checked to be in range.
pub fn softmax_cross_entropy<T: Real>(x: &[T], labels: &[i32], c: usize) -> f64 {
    let mut s = 0.0f64;
    for (r, &l) in labels.iter().enumerate() {
        let row = &x[r * c..(r + 1) * c];
        let mx = row
            .iter()
            .fold(f64::NEG_INFINITY, |m, &v| m.max(v.to_f64()));
        let z: f64 = row.iter().map(|&v| (v.to_f64() - mx).exp()).sum();
        s += mx + z.ln() - row[l as usize].to_f64();
    }
    s / labels.len() as f64
}

pub fn softmax_cross_entropy_grad<T: Real>(dl: T, x: &[T], labels: &[i32], dx: &mut [T], c: usize) {
    let scale = dl / T::from_f64(labels.len() as f64);
    for_rows(dx, c, |r, out| {
        let row = &x[r * c..(r + 1) * c];
        let mx = row.iter().fold(T::neg_infinity(), |m, &v| m.max(v));
        let mut z = T::ZERO;
        for &v in row {
            z += (v - mx).exp();
        }
        for i in 0..c {
            let p = (row[i] - mx).exp() / z;
            let onehot = if i == labels[r] as usize {
                T::ONE
            } else {
                T::ZERO
            };
            out[i] = (p - onehot) * scale;
        }
    });
}

// ---- optimizers ----------------------------------------------------------------------

pub struct AdamHyper {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub step: i32,
}

/// PyTorch's Adam update (`p -= lr/bc1 · m / (sqrt(v)/sqrt(bc2) + eps)`).
pub fn adam<T: Real>(p: &mut [T], g: &[T], m: &mut [T], v: &mut [T], h: &AdamHyper) {
    let bc1 = 1.0 - h.beta1.powi(h.step);
    let bc2 = 1.0 - h.beta2.powi(h.step);
    let (b1, b2) = (T::from_f64(h.beta1), T::from_f64(h.beta2));
    let step_size = T::from_f64(h.lr / bc1);
    let bc2_sqrt = T::from_f64(bc2.sqrt());
    let eps = T::from_f64(h.eps);
    for i in 0..p.len() {
        m[i] = b1 * m[i] + (T::ONE - b1) * g[i];
        v[i] = b2 * v[i] + (T::ONE - b2) * g[i] * g[i];
        let denom = v[i].sqrt() / bc2_sqrt + eps;
        p[i] -= step_size * m[i] / denom;
    }
}
