//! The GEMM kernels (Linear, LinearGradInput, LinearGradWeight, MatMul) and the fused
//! attention kernels against references in f64 on the operands the kernels actually
//! multiply: every GEMM and attention matmul operand rounded to bf16 (nearest even), as
//! the kernels round them when they load them.
//!
//! Tolerances (per element, derived, not tuned):
//! * GEMM. With operands already bf16 each product a·b is exact in f32, so the only errors
//!   are the f32 accumulation and the output rounding. Summing K terms in f32 errs by at
//!   most γ_K·Σ|a||b| in the worst case (linear in K); for independent random signs the
//!   rounding errors add like a random walk (Higham & Mary 2019), ~sqrt(K)·u·Σ|a||b|.
//!   The tensor core may truncate rather than round its internal sums (u = 2^-23, not
//!   2^-24), split-K adds one rounding per split: we allow
//!   |got − want| ≤ 2^-23·|want| + 4·2^-22·sqrt(K)·Σ_k |a_k||b_k|,
//!   i.e. rtol 2^-23 (output rounding, bias add) and an atol four times the random-walk
//!   estimate with the doubled unit. A kernel that skipped the bf16 rounding, or dropped
//!   or doubled one product, misses this by orders of magnitude.
//! * Attention. Besides f32 accumulation, the kernels round the probabilities P (forward
//!   and dV) and dS (dQ, dK) to bf16, which no reference can reproduce: that rounding
//!   (u_b = 2^-8 relative) bounds the error, e.g. |Δo_ic| ≤ u_b·Σ_j p_ij|v_jc|. Each bound
//!   below is that worst case plus the f32 terms (scores, exp2, row sums, accumulation of
//!   n terms: acc(n) = (n/16 + 2)·2^-22 relative to the sum of magnitudes).

use super::{arg, device, handle_with, rand_f32, run_cpu, run_gpu, Arg};
use erase::graph::{DType, Op, Shape};
use erase::ops::cuda::GemmTile;
use erase::ops::Buffer;

/// bf16 round-to-nearest-even of an f32, as `__float2bfloat16_rn`, back in f32.
fn bf16(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    let b = x.to_bits();
    f32::from_bits(b.wrapping_add(0x7fff + ((b >> 16) & 1)) & 0xffff_0000)
}

fn rounded(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| bf16(v) as f64).collect()
}

fn f32s(b: &Buffer) -> &[f32] {
    b.as_f32().expect("an f32 buffer")
}

/// `f(i)` for `i < n` on all cores, in order.
fn par_map<T: Send>(n: usize, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
    let threads = std::thread::available_parallelism()
        .map_or(1, |t| t.get())
        .clamp(1, n.max(1));
    let chunk = n.div_ceil(threads);
    let f = &f;
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads)
            .map(|t| {
                s.spawn(move || {
                    (t * chunk..((t + 1) * chunk).min(n))
                        .map(f)
                        .collect::<Vec<T>>()
                })
            })
            .collect();
        hs.into_iter()
            .flat_map(|h| h.join().expect("reference thread"))
            .collect()
    })
}

/// Asserts `|got_i − want_i| ≤ tol_i` (NaN fails), naming the worst element.
fn assert_within(what: &str, got: &[f64], want: &[f64], tol: &[f64]) {
    assert_eq!(
        got.len(),
        want.len(),
        "{what}: {} values, expected {}",
        got.len(),
        want.len()
    );
    let mut worst = (0usize, 0.0f64);
    for (i, ((&g, &w), &t)) in got.iter().zip(want).zip(tol).enumerate() {
        let err = (g - w).abs();
        assert!(
            err <= t,
            "{what}[{i}]: got {g}, want {w} (|err| {err:.3e}, tolerance {t:.3e})"
        );
        if t > 0.0 && err / t > worst.1 {
            worst = (i, err / t);
        }
    }
    println!(
        "{what}: ok ({} values, worst at [{}] = {:.3} of tolerance)",
        got.len(),
        worst.0,
        worst.1
    );
}

// ---- GEMM ------------------------------------------------------------------------------

/// `C[b] = op(A[b])·op(B[b])` (+ bias) in f64 on bf16-rounded operands, and the tolerance
/// of each element. `a` is `[batch, m, k]` (`[batch, k, m]` when `ta`), `b` is
/// `[batch, k, n]` (`[batch, n, k]` when `tb`).
#[allow(clippy::too_many_arguments)]
fn gemm_ref(
    (batch, m, n, k): (usize, usize, usize, usize),
    a: &[f32],
    ta: bool,
    b: &[f32],
    tb: bool,
    bias: Option<&[f32]>,
) -> (Vec<f64>, Vec<f64>) {
    let (ar, br) = (rounded(a), rounded(b));
    // row-major A[b][i][kk] and Bᵀ[b][j][kk], so the inner loops are contiguous
    let at: Vec<f64> = (0..batch * m * k)
        .map(|x| {
            let (bi, i, kk) = (x / (m * k), x / k % m, x % k);
            if ta {
                ar[bi * m * k + kk * m + i]
            } else {
                ar[x]
            }
        })
        .collect();
    let bt: Vec<f64> = (0..batch * n * k)
        .map(|x| {
            let (bi, j, kk) = (x / (n * k), x / k % n, x % k);
            if tb {
                br[x]
            } else {
                br[bi * k * n + kk * n + j]
            }
        })
        .collect();
    let rows = par_map(batch * m, |r| {
        let bi = r / m;
        let arow = &at[r * k..(r + 1) * k];
        (0..n)
            .map(|j| {
                let brow = &bt[(bi * n + j) * k..(bi * n + j + 1) * k];
                let (mut s, mut sa) = (0.0f64, 0.0f64);
                for (x, y) in arow.iter().zip(brow) {
                    s += x * y;
                    sa += (x * y).abs();
                }
                let s = s + bias.map_or(0.0, |bv| bv[j] as f64);
                let tol = 2f64.powi(-23) * s.abs() + 4.0 * 2f64.powi(-22) * (k as f64).sqrt() * sa;
                (s, tol)
            })
            .collect::<Vec<_>>()
    });
    rows.into_iter().flatten().unzip()
}

fn f32_arg(shape: &[usize], seed: u64, lo: f32, hi: f32) -> (Arg, Vec<f32>) {
    let v = rand_f32(seed, shape.iter().product(), lo, hi);
    (arg(shape, Buffer::F32(v.clone())), v)
}

#[test]
fn linear_matches_the_bf16_reference() {
    let Some(dev) = device("linear_matches_the_bf16_reference") else {
        return;
    };
    // (leading dims of x, N, K, bias): K in {1, 13, 31, 33, 351, 1729}, N = 1, odd M,
    // 64/128 tile edges, a rank-3 input, split-K (K = 1729 on 2 tiles, bias applied by
    // the reduction; 99 x 41 outputs, not a multiple of 4, take its scalar loads) and
    // the 128x128 tile (2049 x 1100 outputs fill a wave); the tall kernels (at least
    // 33792 rows): AutoInt's projections (K 64, N 192 and 64, a rank-3 input), N = 250 on
    // the widest with K = 33 (rows not 16-byte aligned: 4-byte copies), K = 96 on N = 100
    let cases: &[(&[usize], usize, usize, bool)] = &[
        (&[40_001], 192, 64, true),
        (&[1300, 27], 64, 64, true),
        (&[34_000], 250, 33, true),
        (&[34_000], 100, 96, false),
        (&[1], 1, 1, true),
        (&[37], 1, 13, true),
        (&[129], 65, 31, false),
        (&[65], 127, 33, true),
        (&[4, 27], 64, 13, true),
        (&[301], 17, 351, true),
        (&[99], 40, 1729, true),
        (&[99], 41, 1729, true),
        (&[2049], 1100, 65, true),
    ];
    for (seed, &(lead, n, k, bias)) in cases.iter().enumerate() {
        check_linear(dev, lead, n, k, bias, 100 + 10 * seed as u64);
    }
}

/// Linear on `x [lead.., K]`, `w [N, K]` (and a bias) against the bf16 reference, without
/// and with the ReLU epilogue (in the GEMM, or after the split-K sum): relu is
/// 1-Lipschitz, so the same tolerance holds.
fn check_linear(
    dev: &erase::runtime::cuda::CudaDevice,
    lead: &[usize],
    n: usize,
    k: usize,
    bias: bool,
    seed: u64,
) {
    let m: usize = lead.iter().product();
    let xshape: Vec<usize> = lead.iter().copied().chain([k]).collect();
    let (x, xv) = f32_arg(&xshape, seed, -1.0, 1.0);
    let (w, wv) = f32_arg(&[n, k], seed + 1, -1.0, 1.0);
    let (b, bv) = f32_arg(&[n], seed + 2, -1.0, 1.0);
    let mut ins = vec![x, w];
    if bias {
        ins.push(b);
    }
    let yshape: Vec<usize> = lead.iter().copied().chain([n]).collect();
    let outs: [(&[usize], DType); 1] = [(&yshape, DType::F32)];
    let (want, tol) = gemm_ref((1, m, n, k), &xv, false, &wv, true, bias.then_some(&bv[..]));
    for relu in [false, true] {
        let got = run_gpu(dev, &Op::Linear { bias, relu }, &ins, &outs, &mut []);
        assert_within(
            &format!("linear {lead:?}x{k} -> {n} bias {bias} relu {relu}"),
            &got[0].to_f64(),
            &relu_if(relu, &want),
            &tol,
        );
    }
}

/// LinearAdd, y = x·wᵀ (+ b) + r, against the bf16 reference plus r: the tall kernels (the
/// residual added as they store; AutoInt's output projection, rows not a multiple of 64,
/// N not a multiple of 4) and the other paths (a GEMM into scratch, then an add launch).
#[test]
fn linear_add_matches_the_bf16_reference() {
    let Some(dev) = device("linear_add_matches_the_bf16_reference") else {
        return;
    };
    let cases: &[(&[usize], usize, usize, bool)] = &[
        (&[1300, 27], 64, 64, true),
        (&[34_001], 62, 40, false),
        (&[300], 40, 65, false),
        (&[2049], 1100, 65, true),
    ];
    for (i, &(lead, n, k, bias)) in cases.iter().enumerate() {
        let seed = 1700 + 10 * i as u64;
        let m: usize = lead.iter().product();
        let xshape: Vec<usize> = lead.iter().copied().chain([k]).collect();
        let yshape: Vec<usize> = lead.iter().copied().chain([n]).collect();
        let (x, xv) = f32_arg(&xshape, seed, -1.0, 1.0);
        let (w, wv) = f32_arg(&[n, k], seed + 1, -1.0, 1.0);
        let (b, bv) = f32_arg(&[n], seed + 2, -1.0, 1.0);
        let (r, rv) = f32_arg(&yshape, seed + 3, -4.0, 4.0);
        let mut ins = vec![x, w];
        if bias {
            ins.push(b);
        }
        ins.push(r);
        let outs: [(&[usize], DType); 1] = [(&yshape, DType::F32)];
        let (y, tol) = gemm_ref((1, m, n, k), &xv, false, &wv, true, bias.then_some(&bv[..]));
        // plus the residual, and the f32 rounding of that sum
        let want: Vec<f64> = y.iter().zip(&rv).map(|(a, &b)| a + f64::from(b)).collect();
        let tol: Vec<f64> = tol
            .iter()
            .zip(&want)
            .map(|(t, w)| t + 2f64.powi(-23) * w.abs())
            .collect();
        let got = run_gpu(dev, &Op::LinearAdd { bias }, &ins, &outs, &mut []);
        let what = format!("linear_add {lead:?}x{k} -> {n} bias {bias}");
        assert_within(&what, &got[0].to_f64(), &want, &tol);
    }
}

/// `max(x, 0)` elementwise when `relu`.
fn relu_if(relu: bool, x: &[f64]) -> Vec<f64> {
    x.iter()
        .map(|&v| {
            if relu {
                if v > 0.0 {
                    v
                } else {
                    0.0
                }
            } else {
                v
            }
        })
        .collect()
}

#[test]
fn linear_grad_input_matches_the_bf16_reference() {
    let Some(dev) = device("linear_grad_input_matches_the_bf16_reference") else {
        return;
    };
    // (M, N, K) of dx[M,K] = dy[M,N]·w[N,K]: the GEMM's inner dim is N
    let cases = [
        (37, 1, 13),
        (129, 13, 1),
        (63, 31, 65),
        (33, 33, 129),
        (31, 351, 7),
        (17, 1729, 40),
        (2049, 64, 1300),
        // the pipelined path, without and with split-K
        (4096, 256, 1728),
        (512, 4096, 512),
        // AutoInt's two projections' dx (the general kernels for K = 192, the tall ones
        // for K = 64), and N = 33 (4-byte copies of dy's rows) on the widest tall kernel
        // (K = 250)
        (40_000, 192, 64),
        (40_000, 64, 64),
        (35_001, 33, 250),
    ];
    for (seed, &(m, n, k)) in cases.iter().enumerate() {
        let seed = 200 + 10 * seed as u64;
        let (dy, dyv) = f32_arg(&[m, n], seed, -1.0, 1.0);
        let (w, wv) = f32_arg(&[n, k], seed + 1, -1.0, 1.0);
        let outs: [(&[usize], DType); 1] = [(&[m, k], DType::F32)];
        let (want, tol) = gemm_ref((1, m, k, n), &dyv, false, &wv, false, None);
        let op = Op::LinearGradInput {
            relu_mask: false,
            residual: false,
        };
        let got = run_gpu(dev, &op, &[dy.clone(), w.clone()], &outs, &mut []);
        let what = format!("linear_grad_input M {m} N {n} K {k}");
        assert_within(&what, &got[0].to_f64(), &want, &tol);
        // with the ReLU gradient's mask: y a ReLU's output (about half exact zeros)
        let (_, yv) = f32_arg(&[m, k], seed + 2, -1.0, 1.0);
        let yv: Vec<f32> = yv.iter().map(|&v| v.max(0.0)).collect();
        let y = arg(&[m, k], Buffer::F32(yv.clone()));
        let op = Op::LinearGradInput {
            relu_mask: true,
            residual: false,
        };
        let got = run_gpu(dev, &op, &[dy, w, y], &outs, &mut []);
        let masked: Vec<f64> = want
            .iter()
            .zip(&yv)
            .map(|(&v, &y)| if y > 0.0 { v } else { 0.0 })
            .collect();
        let got = got[0].to_f64();
        assert_within(&format!("{what} masked"), &got, &masked, &tol);
        if let Some(i) = (0..got.len()).find(|&i| yv[i] <= 0.0 && got[i].to_bits() != 0) {
            panic!("{what} masked: dx[{i}] = {} where y = {}", got[i], yv[i]);
        }
    }
}

/// LinearGradInput with a residual (x's gradient, the product summed with x's other
/// contribution in the GEMM's epilogue) is, bit for bit, the data gradient without it
/// plus r in f32, from poisoned outputs: DCNv2's cross layer with an f32 and a bf16 dy
/// (the pipelined 128x128 tile reading r through `bias`), a long K split in a cluster, a
/// ragged width (scalar loads of r), a tall data gradient (the tall store's residual), the
/// warp-specialized tile, and a small one (an add launch after the GEMM).
#[test]
fn a_data_gradient_with_a_residual_is_the_product_plus_the_residual() {
    let Some(dev) = device("a_data_gradient_with_a_residual_is_the_product_plus_the_residual")
    else {
        return;
    };
    let ws = handle_with(erase::ops::cuda::PlanOptions {
        gemm_ws: true,
        ..dev.plan_options()
    });
    // (M, N, K) of dx[M,K] = dy[M,N]·w[N,K] + r, a bf16 dy, and the warp-specialized tile
    let cases = [
        (4096usize, 512usize, 3456usize, false, false),
        (4096, 512, 3456, true, false),
        // a loss head's data gradient (N = 1: the thin kernel's outer product)
        (4096, 1, 3456, false, false),
        (4096, 4096, 256, true, false),
        (1000, 384, 1001, false, false),
        (40_000, 64, 64, false, false),
        (4096, 1728, 256, true, true),
        (300, 64, 32, false, false),
    ];
    for (i, &(m, n, k, bf16_dy, warp_specialized)) in cases.iter().enumerate() {
        let seed = 1500 + 10 * i as u64;
        let dyv = rand_f32(seed, m * n, -1.0, 1.0);
        let dy = if bf16_dy {
            bf16_copy(&[m, n], &dyv)
        } else {
            arg(&[m, n], Buffer::F32(dyv))
        };
        let (w, _) = f32_arg(&[n, k], seed + 1, -1.0, 1.0);
        let (r, rv) = f32_arg(&[m, k], seed + 2, -4.0, 4.0);
        let h = if warp_specialized { &ws } else { dev };
        let outs: [(&[usize], DType); 1] = [(&[m, k], DType::F32)];
        let plain = Op::LinearGradInput {
            relu_mask: false,
            residual: false,
        };
        let dx = run_gpu(h, &plain, &[dy.clone(), w.clone()], &outs, &mut []);
        let summed = Op::LinearGradInput {
            relu_mask: false,
            residual: true,
        };
        let got = run_gpu(h, &summed, &[dy, w, r], &outs, &mut []);
        let what = format!("linear_grad_input M {m} N {n} K {k} bf16 dy {bf16_dy} + r");
        let want: Vec<u32> = f32s(&dx[0])
            .iter()
            .zip(&rv)
            .map(|(&a, &b)| (a + b).to_bits())
            .collect();
        let got = bits(&got[0]);
        if let Some(e) = (0..m * k).find(|&e| got[e] != want[e]) {
            panic!(
                "{what}: [{}, {}] = {} against dx + r = {}",
                e / k,
                e % k,
                f32::from_bits(got[e]),
                f32::from_bits(want[e])
            );
        }
    }
}

#[test]
fn linear_grad_weight_matches_the_bf16_reference() {
    let Some(dev) = device("linear_grad_weight_matches_the_bf16_reference") else {
        return;
    };
    // (rows, N, K, bias) of dw[N,K] = dyᵀ·x (+ db = dy's column sums): the GEMM's inner
    // dim is the rows, long like the model's 4096·27 (split-K with a fixed-order
    // reduction); AutoInt's output projection (hundreds of splits, reduced by 32 lanes a
    // column group). With the bias gradient: summed while the pipelined path rounds dyᵀ
    // (the cross layers' 4096 x 256 x 1728, ragged rows and N), past 256 partials of 64
    // rows (20000 rows), and while the single-launch kernels stage dy
    let cases = [
        (1, 5, 7, false),
        (30_000, 1, 351, false),
        (30_000, 64, 13, false),
        (4097, 33, 31, false),
        (1729, 130, 129, false),
        (2001, 1, 1, false),
        (110_592, 64, 64, false),
        (4096, 256, 1728, true),
        (4001, 300, 1000, true),
        (20_000, 300, 1000, true),
        (4096, 64, 13, true),
        // the single-launch kernels summing dy's columns as they stage it: one split,
        // an aux head's N = 1, AutoInt's QKV projection, the 128x128 tile with ragged N
        (5, 7, 3, true),
        (4096, 1, 256, true),
        (110_592, 192, 64, true),
        (200, 1501, 1500, true),
    ];
    // the 128x128 single-launch case (9·10^8 FLOPs) on a handle whose pipelined path
    // starts at 2^31, as the default's did before: at 2^29 it would be pipelined
    let single = handle_with(erase::ops::cuda::PlanOptions {
        gemm_pipe_min_flops: 1 << 31,
        ..dev.plan_options()
    });
    for (seed, &(rows, n, k, bias)) in cases.iter().enumerate() {
        let dev = if (rows, n, k) == (200, 1501, 1500) {
            &single
        } else {
            dev
        };
        let seed = 300 + 10 * seed as u64;
        let (dy, dyv) = f32_arg(&[rows, n], seed, -1.0, 1.0);
        let (x, xv) = f32_arg(&[rows, k], seed + 1, -1.0, 1.0);
        let (dw_shape, db_shape) = ([n, k], [n]);
        let mut outs: Vec<(&[usize], DType)> = vec![(&dw_shape, DType::F32)];
        if bias {
            outs.push((&db_shape, DType::F32));
        }
        let ins = [dy, x];
        let op = Op::LinearGradWeight { bias };
        let got = run_gpu(dev, &op, &ins, &outs, &mut []);
        let (want, tol) = gemm_ref((1, n, k, rows), &dyv, true, &xv, false, None);
        let what = format!("linear_grad_weight rows {rows} N {n} K {k} bias {bias}");
        assert_within(&what, &got[0].to_f64(), &want, &tol);
        if bias {
            // db[j] = Σ_r dy[r, j] in f64; f32 sums in any order: within rows·2^-24·Σ|dy|
            let (mut db, mut mag) = (vec![0.0f64; n], vec![0.0f64; n]);
            for r in 0..rows {
                for j in 0..n {
                    let v = f64::from(dyv[r * n + j]);
                    db[j] += v;
                    mag[j] += v.abs();
                }
            }
            let tol: Vec<f64> = mag
                .iter()
                .map(|m| rows as f64 * 2f64.powi(-24) * m)
                .collect();
            assert_within(&format!("{what}: db"), &got[1].to_f64(), &db, &tol);
        }
        // split-K and the partial sums are deterministic: a second run gives the same bits
        let again = run_gpu(dev, &op, &ins, &outs, &mut []);
        for (a, b) in got.iter().zip(&again) {
            assert_eq!(bits(a), bits(b), "{what}: two runs differ");
        }
    }
}

#[test]
fn linear_on_positive_data_matches_the_bf16_reference() {
    let Some(dev) = device("linear_on_positive_data_matches_the_bf16_reference") else {
        return;
    };
    // all terms positive: no cancellation, rounding errors of one sign
    let (m, n, k) = (257, 70, 351);
    let (x, xv) = f32_arg(&[m, k], 401, 0.25, 2.0);
    let (w, wv) = f32_arg(&[n, k], 402, 0.25, 2.0);
    let (b, bv) = f32_arg(&[n], 403, -1.0, 1.0);
    let outs: [(&[usize], DType); 1] = [(&[m, n], DType::F32)];
    let got = run_gpu(
        dev,
        &Op::Linear {
            bias: true,
            relu: false,
        },
        &[x, w, b],
        &outs,
        &mut [],
    );
    let (want, tol) = gemm_ref((1, m, n, k), &xv, false, &wv, true, Some(&bv));
    assert_within(
        "linear positive 257x351 -> 70",
        &got[0].to_f64(),
        &want,
        &tol,
    );
}

#[test]
fn batched_matmul_matches_the_bf16_reference_for_every_transpose() {
    let Some(dev) = device("batched_matmul_matches_the_bf16_reference_for_every_transpose") else {
        return;
    };
    // (batch, M, N, K): small tiles, the 128x128 tile (15 x 5 x 3 tiles), a batched
    // split-K, and unbatched
    let shapes = [
        (3, 37, 65, 33),
        (15, 513, 257, 17),
        (2, 5, 7, 1729),
        (1, 1, 1, 1),
        (1, 127, 1, 13),
    ];
    let mut seed = 500;
    for (batch, m, n, k) in shapes {
        for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
            seed += 10;
            let lead = |r: usize, c: usize| {
                if batch == 1 {
                    vec![r, c]
                } else {
                    vec![batch, r, c]
                }
            };
            let ashape = if ta { lead(k, m) } else { lead(m, k) };
            let bshape = if tb { lead(n, k) } else { lead(k, n) };
            let cshape = lead(m, n);
            let (a, av) = f32_arg(&ashape, seed, -1.0, 1.0);
            let (b, bv) = f32_arg(&bshape, seed + 1, -1.0, 1.0);
            let outs: [(&[usize], DType); 1] = [(&cshape, DType::F32)];
            let got = run_gpu(dev, &Op::MatMul { ta, tb }, &[a, b], &outs, &mut []);
            let (want, tol) = gemm_ref((batch, m, n, k), &av, ta, &bv, tb, None);
            let what = format!("matmul ta {ta} tb {tb} {ashape:?} x {bshape:?}");
            assert_within(&what, &got[0].to_f64(), &want, &tol);
        }
    }
}

fn bits(b: &Buffer) -> Vec<u32> {
    f32s(b).iter().map(|x| x.to_bits()).collect()
}

// ---- attention -------------------------------------------------------------------------

/// `[B, S, H·Dh]` geometry.
#[derive(Clone, Copy)]
struct Geo {
    b: usize,
    h: usize,
    s: usize,
    dh: usize,
    causal: bool,
}

impl Geo {
    fn n(&self) -> usize {
        self.b * self.s * self.h * self.dh
    }
    fn shape(&self) -> [usize; 3] {
        [self.b, self.s, self.h * self.dh]
    }
    /// Offset of row `i` of head `hh` in batch `bi`.
    fn at(&self, bi: usize, i: usize, hh: usize) -> usize {
        ((bi * self.s + i) * self.h + hh) * self.dh
    }
    fn scale(&self) -> f64 {
        1.0 / (self.dh as f64).sqrt()
    }
    fn visible(&self, i: usize, j: usize) -> bool {
        !self.causal || j <= i
    }
    /// (batch, head, row) of row `r` of the `[B, H, S]` layout.
    fn split(&self, r: usize) -> (usize, usize, usize) {
        (r / (self.h * self.s), r / self.s % self.h, r % self.s)
    }
}

const UB: f64 = 1.0 / 256.0; // bf16 unit roundoff, 2^-8

/// f32 accumulation error of an `n`-term tensor-core dot product, relative to Σ|terms|.
fn acc(n: usize) -> f64 {
    (n as f64 / 16.0 + 2.0) * 2f64.powi(-22)
}

fn dot(x: &[f64], y: &[f64]) -> (f64, f64) {
    x.iter()
        .zip(y)
        .fold((0.0, 0.0), |(s, a), (p, q)| (s + p * q, a + (p * q).abs()))
}

/// Scores of row `i` (natural units, `scale·q_i·k_j`), their Σ|q||k|·scale, and the bound
/// δ_ij on the error of the exponent the kernel evaluates: the f32 dot product, the f32
/// products and differences with the row's max or lse (≤ 2^-23 of each), exp2's 2^-22.
fn scores(
    g: &Geo,
    q: &[f64],
    k: &[f64],
    bi: usize,
    hh: usize,
    i: usize,
    lse: f64,
) -> Vec<(usize, f64, f64)> {
    let qi = &q[g.at(bi, i, hh)..][..g.dh];
    let raw: Vec<(usize, f64, f64)> = (0..g.s)
        .filter(|&j| g.visible(i, j))
        .map(|j| {
            let (s, a) = dot(qi, &k[g.at(bi, j, hh)..][..g.dh]);
            (j, s * g.scale(), a * g.scale())
        })
        .collect();
    let smax = raw.iter().fold(0.0f64, |m, r| m.max(r.1.abs()));
    raw.into_iter()
        .map(|(j, s, a)| {
            (
                j,
                s,
                acc(g.dh) * a + 2f64.powi(-21) * (s.abs() + smax + lse.abs() + 1.0),
            )
        })
        .collect()
}

struct AttnData {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    d_o: Vec<f32>,
}

fn attn_data(g: &Geo, seed: u64) -> AttnData {
    let n = g.n();
    AttnData {
        // queries larger than keys: scores spread over several units, softmax far from uniform
        q: rand_f32(seed, n, -2.0, 2.0),
        k: rand_f32(seed + 1, n, -1.0, 1.0),
        v: rand_f32(seed + 2, n, -1.0, 1.0),
        d_o: rand_f32(seed + 3, n, -1.0, 1.0),
    }
}

fn f64_arg(shape: &[usize], v: Vec<f64>) -> Arg {
    arg(shape, Buffer::F64(v))
}

/// Forward: GPU against the CPU reference in f64 on bf16-rounded q, k, v. Returns the
/// reference o and lse (f64) for the backward test.
fn check_attention_forward(
    dev: &erase::runtime::cuda::CudaDevice,
    g: Geo,
    d: &AttnData,
) -> (Vec<f64>, Vec<f64>) {
    let shape = g.shape();
    let lse_shape = [g.b, g.h, g.s];
    let op = Op::Attention {
        heads: g.h,
        causal: g.causal,
        packed: false,
    };
    let ins = vec![
        arg(&shape, Buffer::F32(d.q.clone())),
        arg(&shape, Buffer::F32(d.k.clone())),
        arg(&shape, Buffer::F32(d.v.clone())),
    ];
    let outs: [(&[usize], DType); 2] = [(&shape, DType::F32), (&lse_shape, DType::F32)];
    let got = run_gpu(dev, &op, &ins, &outs, &mut []);
    let again = run_gpu(dev, &op, &ins, &outs, &mut []);
    let name = format!(
        "attention B {} H {} S {} Dh {} causal {}",
        g.b, g.h, g.s, g.dh, g.causal
    );
    assert!(
        bits(&got[0]) == bits(&again[0]) && bits(&got[1]) == bits(&again[1]),
        "{name}: two runs differ"
    );

    let (q, k, v) = (rounded(&d.q), rounded(&d.k), rounded(&d.v));
    let rins = vec![
        f64_arg(&shape, q.clone()),
        f64_arg(&shape, k.clone()),
        f64_arg(&shape, v.clone()),
    ];
    let routs: [(&[usize], DType); 2] = [(&shape, DType::F64), (&lse_shape, DType::F64)];
    let want = run_cpu(&op, &rins, &routs, &mut []);
    let (o_ref, lse_ref) = (want[0].to_f64(), want[1].to_f64());

    // o_i = Σ_j p_ij v_j with P rounded to bf16 (u_b), each p_ij off by its exponent's
    // error and the row sum's (≤ S+16 f32 additions and rescalings), accumulated over S:
    // |Δo_ic| ≤ (ε_i + u_b + acc(S))·Σ_j p_ij|v_jc|, ε_i = 2·max_j δ_ij + (S+16)·2^-23;
    // |Δlse_i| ≤ max_j δ_ij + (S+16)·2^-23 + 2^-22·(|lse_i| + 1).
    let rows = par_map(g.b * g.h * g.s, |r| {
        let (bi, hh, i) = g.split(r);
        let sc = scores(&g, &q, &k, bi, hh, i, lse_ref[r]);
        let dmax = sc.iter().fold(0.0f64, |m, x| m.max(x.2));
        let lsum = (g.s as f64 + 16.0) * 2f64.powi(-23);
        let mut pv = vec![0.0f64; g.dh];
        for &(j, s, _) in &sc {
            let p = (s - lse_ref[r]).exp();
            for (t, x) in pv.iter_mut().zip(&v[g.at(bi, j, hh)..][..g.dh]) {
                *t += p * x.abs();
            }
        }
        let f = 2.0 * dmax + lsum + UB + acc(g.s);
        let o_tol: Vec<f64> = pv.iter().map(|t| f * t).collect();
        (
            o_tol,
            dmax + lsum + 2f64.powi(-22) * (lse_ref[r].abs() + 1.0),
        )
    });
    let mut o_tol = vec![0.0; g.n()];
    let mut lse_tol = vec![0.0; g.b * g.h * g.s];
    for (r, (ot, lt)) in rows.into_iter().enumerate() {
        let (bi, hh, i) = g.split(r);
        for (c, t) in ot.into_iter().enumerate() {
            o_tol[g.at(bi, i, hh) + c] = t + 2f64.powi(-23) * o_ref[g.at(bi, i, hh) + c].abs();
        }
        lse_tol[r] = lt;
    }
    assert_within(&format!("{name} o"), &got[0].to_f64(), &o_ref, &o_tol);
    assert_within(&format!("{name} lse"), &got[1].to_f64(), &lse_ref, &lse_tol);
    (o_ref, lse_ref)
}

/// Backward: GPU (on f32 do, q, k, v and the reference's o, lse rounded to f32) against the
/// CPU reference in f64 on bf16-rounded do, q, k, v and the same o, lse.
fn check_attention_backward(
    dev: &erase::runtime::cuda::CudaDevice,
    g: Geo,
    d: &AttnData,
    o_ref: &[f64],
    lse_ref: &[f64],
) {
    let shape = g.shape();
    let lse_shape = [g.b, g.h, g.s];
    let o32: Vec<f32> = o_ref.iter().map(|&x| x as f32).collect();
    let lse32: Vec<f32> = lse_ref.iter().map(|&x| x as f32).collect();
    let op = Op::AttentionGrad {
        heads: g.h,
        causal: g.causal,
        packed: false,
    };
    let ins = vec![
        arg(&shape, Buffer::F32(d.d_o.clone())),
        arg(&shape, Buffer::F32(d.q.clone())),
        arg(&shape, Buffer::F32(d.k.clone())),
        arg(&shape, Buffer::F32(d.v.clone())),
        arg(&shape, Buffer::F32(o32.clone())),
        arg(&lse_shape, Buffer::F32(lse32.clone())),
    ];
    let outs: [(&[usize], DType); 3] = [
        (&shape, DType::F32),
        (&shape, DType::F32),
        (&shape, DType::F32),
    ];
    let got = run_gpu(dev, &op, &ins, &outs, &mut []);
    let again = run_gpu(dev, &op, &ins, &outs, &mut []);
    let name = format!(
        "attention_grad B {} H {} S {} Dh {} causal {}",
        g.b, g.h, g.s, g.dh, g.causal
    );
    for (x, y) in got.iter().zip(&again) {
        assert_eq!(bits(x), bits(y), "{name}: two runs differ");
    }

    let (d_o, q, k, v) = (rounded(&d.d_o), rounded(&d.q), rounded(&d.k), rounded(&d.v));
    let o: Vec<f64> = o32.iter().map(|&x| x as f64).collect();
    let lse: Vec<f64> = lse32.iter().map(|&x| x as f64).collect();
    let rins = vec![
        f64_arg(&shape, d_o.clone()),
        f64_arg(&shape, q.clone()),
        f64_arg(&shape, k.clone()),
        f64_arg(&shape, v.clone()),
        f64_arg(&shape, o.clone()),
        f64_arg(&lse_shape, lse.clone()),
    ];
    let routs: [(&[usize], DType); 3] = [
        (&shape, DType::F64),
        (&shape, DType::F64),
        (&shape, DType::F64),
    ];
    let want = run_cpu(&op, &rins, &routs, &mut []);

    // Per pair (i, j): p = exp(s − lse) off by δ_ij (relative), dp = do_i·v_j and
    // D_i = do_i·o_i off by acc(Dh)·Σ|do||v| and acc(Dh)·Σ|do||o|, and dS = p(dp − D)
    // rounded to bf16:  |ΔdS_ij| ≤ F_ij = (δ_ij + u_b + 2^-22)|dS_ij| + p_ij·acc(Dh)·(Σ|do_i||v_j| + Σ|do_i||o_i|).
    // Then |Δdq_ic| ≤ scale·Σ_j (F_ij + acc(S)|dS_ij|)|k_jc|, |Δdk_jc| ≤ scale·Σ_i (F_ij + acc(S)|dS_ij|)|q_ic|,
    // |Δdv_jc| ≤ Σ_i p_ij(δ_ij + u_b + acc(S))|do_ic|, each plus 2^-23 of the value and
    // 2^-6 of itself for the second-order terms.
    let (sn, dh, scale) = (g.s, g.dh, g.scale());
    let mut tol = [vec![0.0; g.n()], vec![0.0; g.n()], vec![0.0; g.n()]];
    for bh in 0..g.b * g.h {
        let (bi, hh) = (bh / g.h, bh % g.h);
        // per query row: the coefficients of dq's bound, and of dk's and dv's (by key)
        let rows = par_map(sn, |i| {
            let r = bh * sn + i;
            let doi = &d_o[g.at(bi, i, hh)..][..dh];
            let (di, dabs) = dot(doi, &o[g.at(bi, i, hh)..][..dh]);
            let mut gk = Vec::new(); // (j, coefficient of dq's and dk's bound, of dv's)
            for (j, s, delta) in scores(&g, &q, &k, bi, hh, i, lse[r]) {
                let p = (s - lse[r]).exp();
                let (dp, dpabs) = dot(doi, &v[g.at(bi, j, hh)..][..dh]);
                let ds = (p * (dp - di)).abs();
                let f = (delta + UB + 2f64.powi(-22)) * ds + p * acc(dh) * (dpabs + dabs);
                gk.push((j, scale * (f + acc(sn) * ds), p * (delta + UB + acc(sn))));
            }
            let mut dq_tol = vec![0.0f64; dh];
            for &(j, c, _) in &gk {
                for (t, x) in dq_tol.iter_mut().zip(&k[g.at(bi, j, hh)..][..dh]) {
                    *t += c * x.abs();
                }
            }
            (dq_tol, gk)
        });
        for (i, (dq_tol, _)) in rows.iter().enumerate() {
            tol[0][g.at(bi, i, hh)..][..dh].copy_from_slice(dq_tol);
        }
        // dk, dv by key: sum over the query rows that see key j
        let mut by_key: Vec<Vec<(usize, f64, f64)>> = vec![Vec::new(); sn];
        for (i, (_, gk)) in rows.iter().enumerate() {
            for &(j, ck, cv) in gk {
                by_key[j].push((i, ck, cv));
            }
        }
        let cols = par_map(sn, |j| {
            let (mut tk, mut tv) = (vec![0.0f64; dh], vec![0.0f64; dh]);
            for &(i, ck, cv) in &by_key[j] {
                let (qi, doi) = (&q[g.at(bi, i, hh)..][..dh], &d_o[g.at(bi, i, hh)..][..dh]);
                for c in 0..dh {
                    tk[c] += ck * qi[c].abs();
                    tv[c] += cv * doi[c].abs();
                }
            }
            (tk, tv)
        });
        for (j, (tk, tv)) in cols.into_iter().enumerate() {
            tol[1][g.at(bi, j, hh)..][..dh].copy_from_slice(&tk);
            tol[2][g.at(bi, j, hh)..][..dh].copy_from_slice(&tv);
        }
    }
    for (x, (gotx, wantx)) in ["dq", "dk", "dv"].iter().zip(got.iter().zip(&want)) {
        let w = wantx.to_f64();
        let t = match *x {
            "dq" => &tol[0],
            "dk" => &tol[1],
            _ => &tol[2],
        };
        let t: Vec<f64> = t
            .iter()
            .zip(&w)
            .map(|(t, w)| t * (1.0 + 2f64.powi(-6)) + 2f64.powi(-23) * w.abs())
            .collect();
        assert_within(&format!("{name} {x}"), &gotx.to_f64(), &w, &t);
    }
}

fn attention_case(test: &str, b: usize, h: usize, s: usize, dh: usize, seed: u64) {
    let Some(dev) = device(test) else { return };
    for causal in [false, true] {
        let g = Geo {
            b,
            h,
            s,
            dh,
            causal,
        };
        let d = attn_data(&g, seed + u64::from(causal));
        let (o, lse) = check_attention_forward(dev, g, &d);
        check_attention_backward(dev, g, &d, &o, &lse);
        check_packed_attention(dev, g, &d, &o, &lse);
    }
}

/// `[rows, w]` tensors side by side in one `[rows, 3·w]` tensor.
fn pack3<T: Copy>(parts: [&[T]; 3], w: usize) -> Vec<T> {
    let rows = parts[0].len() / w;
    let mut y = Vec::with_capacity(3 * parts[0].len());
    for r in 0..rows {
        for p in parts {
            y.extend_from_slice(&p[r * w..(r + 1) * w]);
        }
    }
    y
}

/// Packed attention (q, k, v read from one `[B, S, 3·W]` tensor, one `dqkv` written) gives
/// the bits of the three-tensor kernels, whose results the checks above hold against the
/// reference, and the CPU reference's packed op gives the bits of its three-tensor op.
/// Every output is poisoned first, so a column the packed kernels leave unwritten fails.
fn check_packed_attention(
    dev: &erase::runtime::cuda::CudaDevice,
    g: Geo,
    d: &AttnData,
    o_ref: &[f64],
    lse_ref: &[f64],
) {
    let w = g.h * g.dh;
    let shape = g.shape();
    let packed_shape = [g.b, g.s, 3 * w];
    let lse_shape = [g.b, g.h, g.s];
    let name = format!(
        "packed attention B {} H {} S {} Dh {} causal {}",
        g.b, g.h, g.s, g.dh, g.causal
    );
    let op = |packed| Op::Attention {
        heads: g.h,
        causal: g.causal,
        packed,
    };
    let grad_op = |packed| Op::AttentionGrad {
        heads: g.h,
        causal: g.causal,
        packed,
    };
    let qkv = pack3([&d.q, &d.k, &d.v], w);
    let outs: [(&[usize], DType); 2] = [(&shape, DType::F32), (&lse_shape, DType::F32)];
    let three = vec![
        arg(&shape, Buffer::F32(d.q.clone())),
        arg(&shape, Buffer::F32(d.k.clone())),
        arg(&shape, Buffer::F32(d.v.clone())),
    ];
    let want = run_gpu(dev, &op(false), &three, &outs, &mut []);
    let got = run_gpu(
        dev,
        &op(true),
        &[arg(&packed_shape, Buffer::F32(qkv.clone()))],
        &outs,
        &mut [],
    );
    assert_eq!(bits(&got[0]), bits(&want[0]), "{name}: o");
    assert_eq!(bits(&got[1]), bits(&want[1]), "{name}: lse");
    let fwd = got;

    let o32: Vec<f32> = o_ref.iter().map(|&x| x as f32).collect();
    let lse32: Vec<f32> = lse_ref.iter().map(|&x| x as f32).collect();
    let (d_o, o, lse) = (
        arg(&shape, Buffer::F32(d.d_o.clone())),
        arg(&shape, Buffer::F32(o32)),
        arg(&lse_shape, Buffer::F32(lse32)),
    );
    let mut three_ins = vec![d_o.clone()];
    three_ins.extend(three);
    three_ins.extend([o.clone(), lse.clone()]);
    let grads: [(&[usize], DType); 3] = [
        (&shape, DType::F32),
        (&shape, DType::F32),
        (&shape, DType::F32),
    ];
    let want = run_gpu(dev, &grad_op(false), &three_ins, &grads, &mut []);
    let want: Vec<f32> = pack3(
        [
            want[0].as_f32().expect("f32"),
            want[1].as_f32().expect("f32"),
            want[2].as_f32().expect("f32"),
        ],
        w,
    );
    let got = run_gpu(
        dev,
        &grad_op(true),
        &[
            d_o.clone(),
            arg(&packed_shape, Buffer::F32(qkv.clone())),
            o.clone(),
            lse.clone(),
        ],
        &[(&packed_shape, DType::F32)],
        &mut [],
    );
    assert_eq!(
        bits(&got[0]),
        bits(&Buffer::F32(want)),
        "{name}: dqkv against dq, dk, dv side by side"
    );
    // dqkv written in bf16 (the `_bo` kernels; a cast after the staged ones): the f32
    // gradient rounded to nearest even, bit for bit
    let got16 = run_gpu(
        dev,
        &grad_op(true),
        &[
            d_o,
            arg(&packed_shape, Buffer::F32(qkv.clone())),
            o.clone(),
            lse.clone(),
        ],
        &[(&packed_shape, DType::Bf16)],
        &mut [],
    );
    assert_eq!(got16[0].dtype(), DType::Bf16, "{name}: dqkv's type");
    let want16 = Buffer::from_f64(DType::Bf16, &got[0].to_f64());
    if let Some(i) = (0..want16.len())
        .find(|&i| got16[0].bytes()[2 * i..2 * i + 2] != want16.bytes()[2 * i..2 * i + 2])
    {
        panic!(
            "{name}: bf16 dqkv[{i}] = {} against the f32 one rounded, {}",
            got16[0].to_f64()[i],
            want16.to_f64()[i]
        );
    }

    // qkv stored in bf16 (Graph::linear_for_attention; S ≤ 64): the `_bi` kernels read the
    // values the f32 kernels round to, so every output has the f32 qkv's bits (o, lse;
    // dqkv in f32 and in bf16), from poisoned outputs
    if g.s <= 64 {
        let qkv16 = Buffer::from_f64(
            DType::Bf16,
            &qkv.iter().map(|&x| f64::from(x)).collect::<Vec<_>>(),
        );
        let fwd16 = run_gpu(
            dev,
            &op(true),
            &[arg(&packed_shape, qkv16.clone())],
            &outs,
            &mut [],
        );
        assert_eq!(bits(&fwd16[0]), bits(&fwd[0]), "{name}: o from a bf16 qkv");
        assert_eq!(
            bits(&fwd16[1]),
            bits(&fwd[1]),
            "{name}: lse from a bf16 qkv"
        );
        let ins16 = [
            arg(&shape, Buffer::F32(d.d_o.clone())),
            arg(&packed_shape, qkv16),
            o.clone(),
            lse.clone(),
        ];
        let got32 = run_gpu(
            dev,
            &grad_op(true),
            &ins16,
            &[(&packed_shape, DType::F32)],
            &mut [],
        );
        assert_eq!(
            bits(&got32[0]),
            bits(&got[0]),
            "{name}: f32 dqkv from a bf16 qkv"
        );
        let got_bo = run_gpu(
            dev,
            &grad_op(true),
            &ins16,
            &[(&packed_shape, DType::Bf16)],
            &mut [],
        );
        assert_eq!(
            got_bo[0].bytes(),
            got16[0].bytes(),
            "{name}: bf16 dqkv from a bf16 qkv"
        );
    }

    // the CPU reference: packed and three-tensor ops agree bit for bit (f64, bf16 rounding)
    let (q, k, v) = (rounded(&d.q), rounded(&d.k), rounded(&d.v));
    let rq = run_cpu(
        &op(false),
        &[
            f64_arg(&shape, q.clone()),
            f64_arg(&shape, k.clone()),
            f64_arg(&shape, v.clone()),
        ],
        &[(&shape, DType::F64), (&lse_shape, DType::F64)],
        &mut [],
    );
    let rp = run_cpu(
        &op(true),
        &[f64_arg(&packed_shape, pack3([&q, &k, &v], w))],
        &[(&shape, DType::F64), (&lse_shape, DType::F64)],
        &mut [],
    );
    assert_eq!(rq[0].to_f64(), rp[0].to_f64(), "{name}: CPU o");
    assert_eq!(rq[1].to_f64(), rp[1].to_f64(), "{name}: CPU lse");
}

#[test]
fn attention_b3_h2_s27_dh32_matches_the_bf16_reference() {
    attention_case(
        "attention_b3_h2_s27_dh32_matches_the_bf16_reference",
        3,
        2,
        27,
        32,
        600,
    );
}

#[test]
fn attention_b1_h2_s100_dh64_matches_the_bf16_reference() {
    attention_case(
        "attention_b1_h2_s100_dh64_matches_the_bf16_reference",
        1,
        2,
        100,
        64,
        700,
    );
}

#[test]
fn attention_b1_h1_s2047_dh64_matches_the_bf16_reference() {
    attention_case(
        "attention_b1_h1_s2047_dh64_matches_the_bf16_reference",
        1,
        1,
        2047,
        64,
        800,
    );
}

#[test]
fn attention_tile_edges_match_the_bf16_reference() {
    // S = 1; S = 32, the longest of the two-heads-a-CTA kernels, with an odd head count
    // (a CTA's second head past the last), and one past it; exactly one tile (the fused
    // S ≤ 64 backward, Dh 64); one past a tile (the staged kernels of 128-row CTAs, both
    // head dims); a second CTA whose last 64-row tile is partly past S, several batches
    // and heads (the staged copies are head-major); whole tiles only (the staged kernels'
    // unmasked path on every tile but the causal diagonal's)
    for (i, &(b, h, s, dh)) in [
        (1, 1, 1, 32),
        (2, 3, 32, 64),
        (3, 1, 32, 32),
        (1, 2, 33, 32),
        (2, 1, 64, 64),
        (1, 2, 65, 64),
        (2, 3, 129, 32),
        (2, 2, 200, 64),
        (1, 2, 256, 64),
    ]
    .iter()
    .enumerate()
    {
        attention_case(
            "attention_tile_edges_match_the_bf16_reference",
            b,
            h,
            s,
            dh,
            1000 + 10 * i as u64,
        );
    }
}

#[test]
fn attention_with_an_unsupported_head_dim_is_refused() {
    let Some(dev) = device("attention_with_an_unsupported_head_dim_is_refused") else {
        return;
    };
    let shape = [1usize, 4, 48];
    let x = || arg(&shape, Buffer::F32(rand_f32(900, 4 * 48, -1.0, 1.0)));
    let in_refs_owned = [x(), x(), x()];
    let in_refs: Vec<(&erase::graph::Shape, &Buffer)> =
        in_refs_owned.iter().map(|a| (&a.shape, &a.value)).collect();
    let outs = [
        (erase::graph::Shape::new(&shape), DType::F32),
        (erase::graph::Shape::new(&[1, 1, 4]), DType::F32),
    ];
    let e = dev.run_node(
        &Op::Attention {
            heads: 1,
            causal: false,
            packed: false,
        },
        &in_refs,
        &outs,
        &mut [],
    );
    assert!(
        e.is_err_and(|e| e.to_string().contains("head dim 48")),
        "head dim 48 must be refused by the plan"
    );
}

#[test]
fn large_gemms_on_the_pipelined_path_match_the_bf16_reference() {
    let Some(dev) = device("large_gemms_on_the_pipelined_path_match_the_bf16_reference") else {
        return;
    };
    // shapes large enough for the bf16 pre-rounding and the cp.async pipeline (2·M·N·K
    // ≥ 2^29): ragged M, N, K against the tiles and K = 1337 (odd leading dims, scalar
    // conversion) with bias; the model's deep forward (float4 conversion)
    let cases: &[(usize, usize, usize, bool)] = &[
        (1101, 730, 1337, true),
        (2048, 512, 1728, true),
        // K under one k step of 64 more (padded), on a QKV-projection-like shape
        (60_001, 192, 100, true),
    ];
    for (seed, &(m, n, k, bias)) in cases.iter().enumerate() {
        check_linear(dev, &[m], n, k, bias, 600 + 10 * seed as u64);
    }
    // dx = dy·w: w converted through the transposing kernel (N = 777 ragged)
    let (m, n, k) = (1500, 1024, 777);
    let (dy, dyv) = f32_arg(&[m, n], 650, -1.0, 1.0);
    let (w, wv) = f32_arg(&[n, k], 651, -1.0, 1.0);
    let outs: [(&[usize], DType); 1] = [(&[m, k], DType::F32)];
    let got = run_gpu(
        dev,
        &Op::LinearGradInput {
            relu_mask: false,
            residual: false,
        },
        &[dy, w],
        &outs,
        &mut [],
    );
    let (want, tol) = gemm_ref((1, m, k, n), &dyv, false, &wv, false, None);
    assert_within("pipelined linear_grad_input", &got[0].to_f64(), &want, &tol);
    // dw = dyᵀ·x over 4100 rows: both operands transposed, few tiles, so split-K; the
    // fixed-order reduction gives the same bits twice
    let (rows, n, k) = (4100, 300, 1000);
    let (dy, dyv) = f32_arg(&[rows, n], 660, -1.0, 1.0);
    let (x, xv) = f32_arg(&[rows, k], 661, -1.0, 1.0);
    let outs: [(&[usize], DType); 1] = [(&[n, k], DType::F32)];
    let ins = [dy, x];
    let got = run_gpu(
        dev,
        &Op::LinearGradWeight { bias: false },
        &ins,
        &outs,
        &mut [],
    );
    let (want, tol) = gemm_ref((1, n, k, rows), &dyv, true, &xv, false, None);
    assert_within(
        "pipelined linear_grad_weight",
        &got[0].to_f64(),
        &want,
        &tol,
    );
    let again = run_gpu(
        dev,
        &Op::LinearGradWeight { bias: false },
        &ins,
        &outs,
        &mut [],
    );
    assert_eq!(
        bits(&got[0]),
        bits(&again[0]),
        "pipelined linear_grad_weight: two runs differ"
    );
    // every transpose, batched (split-K partials and the reduction launch) and at batch 1
    // (64 tiles: two splits summed inside a cluster on sm_90a), ragged M, N and K, with
    // splits of at least 512 k (the H200's 1024 would leave these K whole)
    let split = handle_with(erase::ops::cuda::PlanOptions {
        gemm_pipe_min_k_per_split: 512,
        ..dev.plan_options()
    });
    let dev = &split;
    for (i, (batch, ta, tb)) in [false, true]
        .into_iter()
        .flat_map(|ta| [false, true].map(|tb| (ta, tb)))
        .flat_map(|(ta, tb)| [(2, ta, tb), (1, ta, tb)])
        .enumerate()
    {
        let (m, n, k) = if batch == 1 {
            (1001, 901, 1403)
        } else {
            (700, 600, 1300)
        };
        let seed = 670 + 10 * i as u64;
        let ashape = if ta { [batch, k, m] } else { [batch, m, k] };
        let bshape = if tb { [batch, n, k] } else { [batch, k, n] };
        let (a, av) = f32_arg(&ashape, seed, -1.0, 1.0);
        let (b, bv) = f32_arg(&bshape, seed + 1, -1.0, 1.0);
        let outs: [(&[usize], DType); 1] = [(&[batch, m, n], DType::F32)];
        let got = run_gpu(dev, &Op::MatMul { ta, tb }, &[a, b], &outs, &mut []);
        let (want, tol) = gemm_ref((batch, m, n, k), &av, ta, &bv, tb, None);
        let what = format!("pipelined matmul ta {ta} tb {tb} {ashape:?} x {bshape:?}");
        assert_within(&what, &got[0].to_f64(), &want, &tol);
    }
}

/// A linear layer stored in bf16 (`Graph::linear_for_attention`: AutoInt's QKV projection):
/// the tall kernels' `_bo` store, and elsewhere f32 C and a cast, give the layer's f32
/// output (itself checked against the bf16 reference) rounded to nearest even, bit for bit,
/// from poisoned outputs: AutoInt's shape, a ragged N (scalar stores) with a ReLU, and a
/// layer too short for the tall kernels.
#[test]
fn a_linear_stored_in_bf16_is_its_f32_output_rounded() {
    let Some(dev) = device("a_linear_stored_in_bf16_is_its_f32_output_rounded") else {
        return;
    };
    for (i, &(m, n, k, relu)) in [
        (4096usize * 27, 192usize, 64usize, false),
        (40_001, 98, 40, true),
        (512, 192, 64, false),
    ]
    .iter()
    .enumerate()
    {
        let seed = 1300 + 10 * i as u64;
        let xv = rand_f32(seed, m * k, -1.0, 1.0);
        let wv = rand_f32(seed + 1, n * k, -1.0, 1.0);
        let (b, bv) = f32_arg(&[n], seed + 2, -1.0, 1.0);
        let ins = [
            arg(&[m, k], Buffer::F32(xv.clone())),
            arg(&[n, k], Buffer::F32(wv.clone())),
            b,
        ];
        let op = Op::Linear { bias: true, relu };
        let what = format!("linear {m}x{n}x{k} relu {relu} stored in bf16");
        let wide = run_gpu(dev, &op, &ins, &[(&[m, n], DType::F32)], &mut []);
        let (want, tol) = gemm_ref((1, m, n, k), &xv, false, &wv, true, Some(&bv[..]));
        let want: Vec<f64> = relu_if(relu, &want);
        assert_within(&what, &wide[0].to_f64(), &want, &tol);
        let got = run_gpu(dev, &op, &ins, &[(&[m, n], DType::Bf16)], &mut []);
        assert_eq!(got[0].dtype(), DType::Bf16, "{what}");
        let rounded = Buffer::from_f64(DType::Bf16, &wide[0].to_f64());
        if let Some(e) = (0..m * n)
            .find(|&e| got[0].bytes()[2 * e..2 * e + 2] != rounded.bytes()[2 * e..2 * e + 2])
        {
            panic!(
                "{what}: [{}, {}] = {} against the f32 output rounded, {}",
                e / n,
                e % n,
                got[0].to_f64()[e],
                rounded.to_f64()[e]
            );
        }
    }
}

/// A cross layer stored in bf16 (`Graph::linear_stored_bf16`: bf16 copies of both operands
/// in, bf16 C out): the pipelined kernels' copy epilogue stores C alone (flags bit 6, the
/// plan asserted: one launch of a `_c_` kernel), and from poisoned outputs it is, bit for
/// bit, the copy the same kernel writes beside its f32 C, and within a bf16 rounding of
/// the reference: DCNv2's and the spec model's shapes, a ragged one (edge tiles) and one
/// of odd N (the epilogues' scalar stores), on the TMA and the cp.async kernels.
#[test]
fn a_linear_of_bf16_copies_stored_in_bf16_is_its_copy_alone() {
    let Some(dev) = device("a_linear_of_bf16_copies_stored_in_bf16_is_its_copy_alone") else {
        return;
    };
    let cp_async = handle_with(erase::ops::cuda::PlanOptions {
        gemm_tma: false,
        ..dev.plan_options()
    });
    for (i, &(m, n, k)) in [
        (4096usize, 3456usize, 512usize),
        (4096, 1728, 256),
        (1000, 200, 192),
        (515, 203, 128),
    ]
    .iter()
    .enumerate()
    {
        let seed = 1400 + 10 * i as u64;
        let bf = |v: Vec<f32>| {
            Buffer::from_f64(
                DType::Bf16,
                &v.iter().map(|&x| f64::from(x)).collect::<Vec<_>>(),
            )
        };
        let xb = bf(rand_f32(seed, m * k, -1.0, 1.0));
        let wb = bf(rand_f32(seed + 1, n * k, -1.0, 1.0));
        let (xv, wv): (Vec<f32>, Vec<f32>) = (
            xb.to_f64().iter().map(|&x| x as f32).collect(),
            wb.to_f64().iter().map(|&x| x as f32).collect(),
        );
        let (b, bv) = f32_arg(&[n], seed + 2, -1.0, 1.0);
        let ins = [arg(&[m, k], xb), arg(&[n, k], wb), b];
        let op = Op::Linear {
            bias: true,
            relu: false,
        };
        let (want, tol) = gemm_ref((1, m, n, k), &xv, false, &wv, true, Some(&bv[..]));
        for (path, d) in [("tma", dev), ("cp.async", &cp_async)] {
            let what = format!("linear {m}x{n}x{k} of bf16 copies stored in bf16 ({path})");
            // the plan this device runs: one copy-form launch with bit 6, or the test
            // would pass through the scratch-and-cast fallback without running bit 6
            let shapes = [
                Shape::new(&[m, k]),
                Shape::new(&[n, k]),
                Shape::new(&[n]),
                Shape::new(&[m, n]),
            ];
            let plan = erase::ops::cuda::cuda_plan(
                &op,
                &erase::ops::cuda::Operands {
                    opts: d.plan_options(),
                    ins: &[&shapes[0], &shapes[1], &shapes[2]],
                    in_dtypes: &[DType::Bf16, DType::Bf16, DType::F32],
                    outs: &[&shapes[3]],
                    out_dtypes: &[DType::Bf16],
                    upd: &[],
                },
            )
            .expect("a linear stored in bf16 plans");
            assert_eq!(plan.calls.len(), 1, "{what}: {:?}", plan.calls);
            let c = &plan.calls[0];
            let flags = if c.kernel.starts_with("gemm_bf16t") {
                &c.args[9]
            } else {
                &c.args[16]
            };
            assert!(
                c.kernel.contains("_c_")
                    && matches!(flags, erase::ops::cuda::KArg::I32(f) if f & 64 != 0),
                "{what}: {} {flags:?}",
                c.kernel
            );
            let both = run_gpu(
                d,
                &op,
                &ins,
                &[(&[m, n], DType::F32), (&[m, n], DType::Bf16)],
                &mut [],
            );
            assert_within(&what, &both[0].to_f64(), &want, &tol);
            let got = run_gpu(d, &op, &ins, &[(&[m, n], DType::Bf16)], &mut []);
            assert_eq!(got[0].dtype(), DType::Bf16, "{what}");
            // against the reference too (so an element left unwritten by both launches
            // fails): within the f32 bound plus one bf16 rounding of the value
            let tol_b16: Vec<f64> = tol
                .iter()
                .zip(&want)
                .map(|(t, w)| t + w.abs() * 2f64.powi(-8))
                .collect();
            assert_within(&what, &got[0].to_f64(), &want, &tol_b16);
            if let Some(e) = (0..m * n)
                .find(|&e| got[0].bytes()[2 * e..2 * e + 2] != both[1].bytes()[2 * e..2 * e + 2])
            {
                panic!(
                    "{what}: [{}, {}] = {} against the copy beside f32 C, {}",
                    e / n,
                    e % n,
                    got[0].to_f64()[e],
                    both[1].to_f64()[e]
                );
            }
        }
    }
}

/// The CTR model's own large GEMMs (the deep and cross blocks at batch 4096), which take
/// the pipelined path: forward with bias, data gradient, weight gradient (split-K).
#[test]
fn the_ctr_models_large_gemms_match_the_bf16_reference() {
    let Some(dev) = device("the_ctr_models_large_gemms_match_the_bf16_reference") else {
        return;
    };
    // the CTR model's layers on the pipelined path: the large ones, the mid-size ones
    // over its FLOP bound (K = 351 and 384 ragged against the k step), and a narrow
    // output whose weight gradient splits its 4096 rows 64 ways (a few output tiles)
    for (i, &(m, n, k)) in [
        (4096usize, 1024usize, 1728usize),
        (4096, 256, 1728),
        (4096, 256, 351),
        (4096, 512, 384),
        (4096, 256, 512),
        (4096, 1, 256),
    ]
    .iter()
    .enumerate()
    {
        check_linear_passes(dev, (m, n, k), 900 + 10 * i as u64);
    }
}

#[test]
fn narrow_gemms_on_the_pipelined_path_match_the_bf16_reference() {
    let Some(shared) = device("narrow_gemms_on_the_pipelined_path_match_the_bf16_reference") else {
        return;
    };
    // outputs of 64 columns (and a weight gradient of 64 rows) on the pipelined path,
    // their tiles padded to 128
    let narrow = handle_with(erase::ops::cuda::PlanOptions {
        gemm_pipe_min_mn: 64,
        ..shared.plan_options()
    });
    for (i, &(m, n, k)) in [(4096usize, 64usize, 1728usize), (1000, 64, 4500)]
        .iter()
        .enumerate()
    {
        check_linear_passes(&narrow, (m, n, k), 960 + 10 * i as u64);
    }
}

/// A linear layer x [m, k] -> [m, n] with a bias, its data gradient and its weight
/// gradient on `dev`, each against the bf16 reference (outputs poisoned by `run_gpu`).
fn check_linear_passes(
    dev: &erase::runtime::cuda::CudaDevice,
    (m, n, k): (usize, usize, usize),
    seed: u64,
) {
    let (x, xv) = f32_arg(&[m, k], seed, -1.0, 1.0);
    let (w, wv) = f32_arg(&[n, k], seed + 1, -1.0, 1.0);
    let (b, bv) = f32_arg(&[n], seed + 2, -1.0, 1.0);
    let (dy, dyv) = f32_arg(&[m, n], seed + 3, -1.0, 1.0);
    // y = x·wᵀ + b
    let outs: [(&[usize], DType); 1] = [(&[m, n], DType::F32)];
    let got = run_gpu(
        dev,
        &Op::Linear {
            bias: true,
            relu: false,
        },
        &[x.clone(), w.clone(), b],
        &outs,
        &mut [],
    );
    let (want, tol) = gemm_ref((1, m, n, k), &xv, false, &wv, true, Some(&bv[..]));
    assert_within(
        &format!("linear {m}x{k} -> {n}"),
        &got[0].to_f64(),
        &want,
        &tol,
    );
    // dx = dy·w
    let outs: [(&[usize], DType); 1] = [(&[m, k], DType::F32)];
    let got = run_gpu(
        dev,
        &Op::LinearGradInput {
            relu_mask: false,
            residual: false,
        },
        &[dy.clone(), w],
        &outs,
        &mut [],
    );
    let (want, tol) = gemm_ref((1, m, k, n), &dyv, false, &wv, false, None);
    assert_within(
        &format!("linear dx {m}x{n} -> {k}"),
        &got[0].to_f64(),
        &want,
        &tol,
    );
    // dw = dyᵀ·x
    let outs: [(&[usize], DType); 1] = [(&[n, k], DType::F32)];
    let got = run_gpu(
        dev,
        &Op::LinearGradWeight { bias: false },
        &[dy, x],
        &outs,
        &mut [],
    );
    let (want, tol) = gemm_ref((1, n, k, m), &dyv, true, &xv, false, None);
    assert_within(
        &format!("linear dw {n}x{k} over {m}"),
        &got[0].to_f64(),
        &want,
        &tol,
    );
}

/// `x` rounded to bf16 by RoundBf16 on the CPU: the copy a GEMM reads in place.
fn bf16_copy(shape: &[usize], x: &[f32]) -> Arg {
    let out = run_cpu(
        &Op::RoundBf16 { col_sums: false },
        &[arg(shape, Buffer::F32(x.to_vec()))],
        &[(shape, DType::Bf16)],
        &mut [],
    );
    arg(shape, out[0].clone())
}

/// Output 1 of `got` is output 0 (of `shape`) rounded to bf16, bit for bit: the copy a
/// GEMM's epilogue writes beside its f32 output.
fn assert_copy_is_rounding(what: &str, shape: &[usize], got: &[Buffer]) {
    let copy = bf16_copy(shape, f32s(&got[0]));
    assert!(
        got[1].bytes() == copy.value.bytes(),
        "{what}: the copy is not the output rounded to bf16"
    );
}

/// y = x·wᵀ + b (ReLU'd with `relu`) written with its bf16 copy, x [m, k] and w [n, k]
/// random from `seed` (b from seed + 2), read as bf16 copies with `copies` (else f32):
/// y against the bf16 reference, the copy bit for bit its rounding.
fn check_linear_with_copy(
    dev: &erase::runtime::cuda::CudaDevice,
    what: &str,
    (m, n, k): (usize, usize, usize),
    seed: u64,
    relu: bool,
    copies: bool,
) {
    let xv = rand_f32(seed, m * k, -1.0, 1.0);
    let wv = rand_f32(seed + 1, n * k, -1.0, 1.0);
    let (b, bv) = f32_arg(&[n], seed + 2, -1.0, 1.0);
    let (x, w) = if copies {
        (bf16_copy(&[m, k], &xv), bf16_copy(&[n, k], &wv))
    } else {
        (
            arg(&[m, k], Buffer::F32(xv.clone())),
            arg(&[n, k], Buffer::F32(wv.clone())),
        )
    };
    let outs: [(&[usize], DType); 2] = [(&[m, n], DType::F32), (&[m, n], DType::Bf16)];
    let op = Op::Linear { bias: true, relu };
    let got = run_gpu(dev, &op, &[x, w, b], &outs, &mut []);
    let (want, tol) = gemm_ref((1, m, n, k), &xv, false, &wv, true, Some(&bv[..]));
    let want: Vec<f64> = if relu {
        want.iter().map(|v| v.max(0.0)).collect()
    } else {
        want
    };
    assert_within(what, &got[0].to_f64(), &want, &tol);
    assert_copy_is_rounding(what, &[m, n], &got);
}

/// A bf16 dy with f32 weights and inputs (AutoInt's dqkv, written in bf16 by its
/// attention gradient), too small a GEMM for the pipelined path: the data gradient in the
/// tall kernel (K = 192 and 64) and the single-launch kernels (K not a multiple of 8, a
/// 128x128 tile, ragged edges), the weight gradient in the single-launch kernels with the
/// bias gradient summed from the bf16 values (one split, split-K, the 128x128 tile);
/// against the bf16 reference, and bit-identical on a second run.
#[test]
fn a_bf16_dy_alone_matches_the_bf16_reference() {
    let Some(dev) = device("a_bf16_dy_alone_matches_the_bf16_reference") else {
        return;
    };
    // (M, N, K) of dx[M,K] = dy[M,N]·w[N,K]
    for (i, &(m, n, k)) in [
        (40_000, 192, 64),
        (40_000, 64, 64),
        (35_001, 40, 250),
        (40_000, 190, 64),
        (37, 13, 65),
        (8192, 100, 512),
    ]
    .iter()
    .enumerate()
    {
        let seed = 1500 + 10 * i as u64;
        let dyv = rand_f32(seed, m * n, -1.0, 1.0);
        let (w, wv) = f32_arg(&[n, k], seed + 1, -1.0, 1.0);
        let outs: [(&[usize], DType); 1] = [(&[m, k], DType::F32)];
        let op = Op::LinearGradInput {
            relu_mask: false,
            residual: false,
        };
        let ins = [bf16_copy(&[m, n], &dyv), w];
        let got = run_gpu(dev, &op, &ins, &outs, &mut []);
        let (want, tol) = gemm_ref((1, m, k, n), &dyv, false, &wv, false, None);
        let what = format!("linear_grad_input, bf16 dy, M {m} N {n} K {k}");
        assert_within(&what, &got[0].to_f64(), &want, &tol);
        let again = run_gpu(dev, &op, &ins, &outs, &mut []);
        assert_eq!(bits(&got[0]), bits(&again[0]), "{what}: two runs differ");
    }
    // (rows, N, K) of dw[N,K] = dyᵀ·x, db = dy's column sums
    for (i, &(rows, n, k)) in [
        (110_592, 192, 64),
        (4097, 33, 31),
        (5, 7, 3),
        (200, 1501, 1500),
    ]
    .iter()
    .enumerate()
    {
        let seed = 1600 + 10 * i as u64;
        let dyv = rand_f32(seed, rows * n, -1.0, 1.0);
        let (x, xv) = f32_arg(&[rows, k], seed + 1, -1.0, 1.0);
        let outs: [(&[usize], DType); 2] = [(&[n, k], DType::F32), (&[n], DType::F32)];
        let op = Op::LinearGradWeight { bias: true };
        let ins = [bf16_copy(&[rows, n], &dyv), x];
        let got = run_gpu(dev, &op, &ins, &outs, &mut []);
        let (want, tol) = gemm_ref((1, n, k, rows), &dyv, true, &xv, false, None);
        let what = format!("linear_grad_weight, bf16 dy, rows {rows} N {n} K {k}");
        assert_within(&what, &got[0].to_f64(), &want, &tol);
        // db: the sums of the bf16 values (f64), f32 sums in any order within
        // rows·2^-24 of the magnitudes
        let (mut db, mut mag) = (vec![0f64; n], vec![0f64; n]);
        for (j, &v) in dyv.iter().enumerate() {
            let v = f64::from(bf16(v));
            db[j % n] += v;
            mag[j % n] += v.abs();
        }
        let tol: Vec<f64> = mag
            .iter()
            .map(|m| rows as f64 * 2f64.powi(-24) * m)
            .collect();
        assert_within(&format!("{what}: db"), &got[1].to_f64(), &db, &tol);
        let again = run_gpu(dev, &op, &ins, &outs, &mut []);
        for (a, b) in got.iter().zip(&again) {
            assert_eq!(bits(a), bits(b), "{what}: two runs differ");
        }
    }
}

/// RoundBf16 (the plain and the column-summing kernel) bit for bit against the CPU's
/// rounding, the sums against f64; then the GEMMs reading bf16 copies in place: Linear's x
/// and LinearGradInput's dy K-major with ragged rows (read as the last row past M), and
/// LinearGradWeight's dy and x MN-major with ragged M and N (whole 8-element chunks), on
/// the split and cluster paths; with copies of the weights, Linear's w K-major and
/// LinearGradInput's w MN-major; against the bf16 reference.
#[test]
fn bf16_copies_read_in_place_match_the_bf16_reference() {
    let Some(dev) = device("bf16_copies_read_in_place_match_the_bf16_reference") else {
        return;
    };
    for (i, &(rows, cols, sums)) in [
        (200usize, 1736usize, false),
        (1001, 264, true),
        (4096, 1728, true),
    ]
    .iter()
    .enumerate()
    {
        let (x, xv) = f32_arg(&[rows, cols], 1200 + i as u64, -2.0, 2.0);
        let (copy_shape, sums_shape) = ([rows, cols], [cols]);
        let mut outs: Vec<(&[usize], DType)> = vec![(&copy_shape, DType::Bf16)];
        if sums {
            outs.push((&sums_shape, DType::F32));
        }
        let op = Op::RoundBf16 { col_sums: sums };
        let got = run_gpu(dev, &op, std::slice::from_ref(&x), &outs, &mut []);
        let want = run_cpu(
            &Op::RoundBf16 { col_sums: false },
            &[x],
            &outs[..1],
            &mut [],
        );
        assert!(
            got[0].bytes() == want[0].bytes(),
            "round_bf16 [{rows}, {cols}]: the copy differs from the CPU's rounding"
        );
        if sums {
            let (mut s, mut sa) = (vec![0f64; cols], vec![0f64; cols]);
            for (j, &v) in xv.iter().enumerate() {
                s[j % cols] += v as f64;
                sa[j % cols] += (v as f64).abs();
            }
            // f32 sums of `rows` terms: at most rows·2^-24 of the magnitudes (worst case)
            let tol: Vec<f64> = sa
                .iter()
                .map(|a| rows as f64 * 2f64.powi(-24) * a)
                .collect();
            assert_within(
                &format!("round_bf16 column sums [{rows}, {cols}]"),
                &got[1].to_f64(),
                &s,
                &tol,
            );
        }
    }
    // y = x·wᵀ + b, x a bf16 copy [1001, 1728] (K-major, ragged rows)
    let (m, n, k) = (1001, 300, 1728);
    let xv = rand_f32(1300, m * k, -1.0, 1.0);
    let (w, wv) = f32_arg(&[n, k], 1301, -1.0, 1.0);
    let (b, bv) = f32_arg(&[n], 1302, -1.0, 1.0);
    let outs: [(&[usize], DType); 1] = [(&[m, n], DType::F32)];
    let op = Op::Linear {
        bias: true,
        relu: false,
    };
    let got = run_gpu(dev, &op, &[bf16_copy(&[m, k], &xv), w, b], &outs, &mut []);
    let (want, tol) = gemm_ref((1, m, n, k), &xv, false, &wv, true, Some(&bv[..]));
    assert_within("linear, bf16 x", &got[0].to_f64(), &want, &tol);
    // dx = dy·w, dy a bf16 copy [1001, 256]; w [256, 777] rounded by the transposing kernel
    let (m, n, k) = (1001, 256, 777);
    let dyv = rand_f32(1310, m * n, -1.0, 1.0);
    let (w, wv) = f32_arg(&[n, k], 1311, -1.0, 1.0);
    let outs: [(&[usize], DType); 1] = [(&[m, k], DType::F32)];
    let op = Op::LinearGradInput {
        relu_mask: false,
        residual: false,
    };
    let got = run_gpu(dev, &op, &[bf16_copy(&[m, n], &dyv), w], &outs, &mut []);
    let (want, tol) = gemm_ref((1, m, k, n), &dyv, false, &wv, false, None);
    assert_within("linear_grad_input, bf16 dy", &got[0].to_f64(), &want, &tol);
    // copies of the weights too: y = x·wᵀ + b with no rounding launch, and dx = dy·w
    // with w read MN-major (the _km kernels), the ReLU mask in its epilogue
    let (m, n, k) = (1001, 1024, 1728);
    let xv = rand_f32(1340, m * k, -1.0, 1.0);
    let wv = rand_f32(1341, n * k, -1.0, 1.0);
    let (b, bv) = f32_arg(&[n], 1342, -1.0, 1.0);
    let outs: [(&[usize], DType); 1] = [(&[m, n], DType::F32)];
    let op = Op::Linear {
        bias: true,
        relu: false,
    };
    let ins = [bf16_copy(&[m, k], &xv), bf16_copy(&[n, k], &wv), b];
    let got = run_gpu(dev, &op, &ins, &outs, &mut []);
    let (want, tol) = gemm_ref((1, m, n, k), &xv, false, &wv, true, Some(&bv[..]));
    assert_within("linear, bf16 x and w", &got[0].to_f64(), &want, &tol);
    let dyv = rand_f32(1343, m * n, -1.0, 1.0);
    let (y, yv) = f32_arg(&[m, k], 1344, -1.0, 1.0);
    let outs: [(&[usize], DType); 1] = [(&[m, k], DType::F32)];
    let op = Op::LinearGradInput {
        relu_mask: true,
        residual: false,
    };
    let ins = [bf16_copy(&[m, n], &dyv), bf16_copy(&[n, k], &wv), y];
    let got = run_gpu(dev, &op, &ins, &outs, &mut []);
    let (want, tol) = gemm_ref((1, m, k, n), &dyv, false, &wv, false, None);
    let masked: Vec<f64> = want
        .iter()
        .zip(&yv)
        .map(|(&d, &y)| if y > 0.0 { d } else { 0.0 })
        .collect();
    assert_within(
        "linear_grad_input, bf16 dy and w, masked",
        &got[0].to_f64(),
        &masked,
        &tol,
    );
    // a linear layer that writes its output's bf16 copy too (a later GEMM reads it): from
    // the pipelined epilogue (one CTA a tile; a cluster of split-K CTAs), and from a cast
    // after a single-launch GEMM; the copy is bit for bit the rounding of the output
    for (i, &(m, n, k, copies)) in [
        (1001usize, 1024usize, 1728usize, true),
        (4096, 256, 1728, true),
        (300, 40, 72, false),
    ]
    .iter()
    .enumerate()
    {
        let what = format!("linear {m}x{k} -> {n} with its output's bf16 copy");
        check_linear_with_copy(dev, &what, (m, n, k), 1350 + 10 * i as u64, true, copies);
    }
    // a data gradient that writes its bf16 copy too (the dy of a copied layer below it):
    // dy and w bf16 copies, w read MN-major (the _kmc kernels): cross's [4096, 1728] ·
    // [1728, 256], one CTA a tile, and a ragged [1001, 1024] · [1024, 1736] (K = 1024:
    // split-K in a cluster); the copy bit for bit the rounding of dx
    for (i, &(m, n, k)) in [(4096usize, 1728usize, 256usize), (1001, 1024, 1736)]
        .iter()
        .enumerate()
    {
        let seed = 1390 + 10 * i as u64;
        let dyv = rand_f32(seed, m * n, -1.0, 1.0);
        let wv = rand_f32(seed + 1, n * k, -1.0, 1.0);
        let ins = [bf16_copy(&[m, n], &dyv), bf16_copy(&[n, k], &wv)];
        let outs: [(&[usize], DType); 2] = [(&[m, k], DType::F32), (&[m, k], DType::Bf16)];
        let op = Op::LinearGradInput {
            relu_mask: false,
            residual: false,
        };
        let got = run_gpu(dev, &op, &ins, &outs, &mut []);
        let (want, tol) = gemm_ref((1, m, k, n), &dyv, false, &wv, false, None);
        let what = format!("linear_grad_input {m}x{n} · {n}x{k} with its bf16 copy");
        assert_within(&what, &got[0].to_f64(), &want, &tol);
        assert_copy_is_rounding(&what, &[m, k], &got);
    }
    // dw = dyᵀ·x over 4096 rows, both bf16 copies read MN-major: ragged [1000, 1736]
    // (split-K in a cluster), the model's [256, 1728] and [1024, 1728]
    for (i, &(rows, n, k)) in [
        (4096usize, 1000usize, 1736usize),
        (4096, 256, 1728),
        (4096, 1024, 1728),
    ]
    .iter()
    .enumerate()
    {
        let seed = 1320 + 10 * i as u64;
        let dyv = rand_f32(seed, rows * n, -1.0, 1.0);
        let xv = rand_f32(seed + 1, rows * k, -1.0, 1.0);
        let ins = [bf16_copy(&[rows, n], &dyv), bf16_copy(&[rows, k], &xv)];
        let outs: [(&[usize], DType); 1] = [(&[n, k], DType::F32)];
        let op = Op::LinearGradWeight { bias: false };
        let got = run_gpu(dev, &op, &ins, &outs, &mut []);
        let (want, tol) = gemm_ref((1, n, k, rows), &dyv, true, &xv, false, None);
        assert_within(
            &format!("linear_grad_weight, bf16 dy and x, [{n}, {k}] over {rows}"),
            &got[0].to_f64(),
            &want,
            &tol,
        );
        let again = run_gpu(dev, &op, &ins, &outs, &mut []);
        assert_eq!(
            bits(&got[0]),
            bits(&again[0]),
            "linear_grad_weight on bf16 copies: two runs differ"
        );
    }
}

/// The 128x256 pipelined tile (the one that keeps a k step's wgmma running while the next
/// is issued), forced on every pipelined GEMM through a second handle on the device (see
/// [`check_forced_tile`]).
#[test]
fn the_wide_pipelined_tile_matches_the_bf16_reference() {
    let Some(shared) = device("the_wide_pipelined_tile_matches_the_bf16_reference") else {
        return;
    };
    check_forced_tile(shared, GemmTile { n: 256, ws: false }, "wide tile");
}

/// The warp-specialized tile (`gemm_bf16w_*_128x64`: a loader warpgroup, two wgmma
/// warpgroups, mbarriers between them, two CTAs an SM) forced on every pipelined GEMM (see
/// [`check_forced_tile`]); sm_90a only, so skipped where the sm_80 PTX runs.
#[test]
fn the_warp_specialized_tile_matches_the_bf16_reference() {
    let Some(shared) = device("the_warp_specialized_tile_matches_the_bf16_reference") else {
        return;
    };
    let ws = handle_with(erase::ops::cuda::PlanOptions {
        gemm_ws: true,
        ..shared.plan_options()
    });
    if !ws.plan_options().gemm_ws {
        println!("the sm_80 PTX runs: it has no warp-specialized kernels to check");
        return;
    }
    check_forced_tile(&ws, GemmTile { n: 64, ws: true }, "ws 128x64 tile");
}

/// The TMA kernels (`gemm_bf16t_*`: operands brought by the tensor memory accelerator,
/// mbarriers instead of a CTA barrier a k step) on every pipelined GEMM of batch 1, each
/// tile (128x128, 128x256, 128x64), unsplit and split in clusters, against the bf16 reference with outputs poisoned
/// by the runner: Linear on rounded scratch, ragged in M, N and K with a bias; Linear on
/// bf16 copies with its output's copy (`_c`), at K = 4096 too; the data gradient on copies
/// (`_km`, `_kmc`); the weight gradient on copies (`_mm`), twice with the same bits.
/// sm_90a only.
#[test]
fn the_tma_gemms_match_the_bf16_reference() {
    let Some(shared) = device("the_tma_gemms_match_the_bf16_reference") else {
        return;
    };
    for n_tile in [128, 256, 64] {
        // no splits, then splits of at least 512 k: the dw over 2048 rows and the K = 4096
        // linear split in clusters
        for min_k in [1 << 30, 512] {
            let dev = handle_with(erase::ops::cuda::PlanOptions {
                gemm_tma: true,
                gemm_tma_n64: erase::ops::cuda::LaunchSet::ALL,
                gemm_tile: Some(GemmTile {
                    n: n_tile,
                    ws: false,
                }),
                gemm_pipe_min_k_per_split: min_k,
                ..shared.plan_options()
            });
            if !dev.plan_options().gemm_tma {
                println!("the sm_80 PTX runs: it has no TMA kernels to check");
                return;
            }
            let what = format!("TMA 128x{n_tile} (splits of {min_k})");
            let dev = &dev;
            for (m, n, k, seed) in [(1001, 700, 1620, 3000), (800, 300, 640, 3010)] {
                let (x, xv) = f32_arg(&[m, k], seed, -1.0, 1.0);
                let (w, wv) = f32_arg(&[n, k], seed + 1, -1.0, 1.0);
                let (b, bv) = f32_arg(&[n], seed + 2, -1.0, 1.0);
                let outs: [(&[usize], DType); 1] = [(&[m, n], DType::F32)];
                let op = Op::Linear {
                    bias: true,
                    relu: false,
                };
                let got = run_gpu(dev, &op, &[x, w, b], &outs, &mut []);
                let (want, tol) = gemm_ref((1, m, n, k), &xv, false, &wv, true, Some(&bv[..]));
                assert_within(
                    &format!("{what}: linear {m}x{n}x{k}"),
                    &got[0].to_f64(),
                    &want,
                    &tol,
                );
            }
            check_linear_with_copy(
                dev,
                &format!("{what}: linear on copies"),
                (1001, 3456, 512),
                3020,
                true,
                true,
            );
            check_dx_on_copies(
                dev,
                &format!("{what}: linear_grad_input"),
                (1001, 512, 1736),
                3030,
                true,
            );
            let (rows, n, k) = (2048, 256, 1736);
            let dyv = rand_f32(3040, rows * n, -1.0, 1.0);
            let xv = rand_f32(3041, rows * k, -1.0, 1.0);
            let ins = [bf16_copy(&[rows, n], &dyv), bf16_copy(&[rows, k], &xv)];
            let outs: [(&[usize], DType); 1] = [(&[n, k], DType::F32)];
            let op = Op::LinearGradWeight { bias: false };
            let (want, tol) = gemm_ref((1, n, k, rows), &dyv, true, &xv, false, None);
            let got = run_gpu(dev, &op, &ins, &outs, &mut []);
            assert_within(
                &format!("{what}: linear_grad_weight"),
                &got[0].to_f64(),
                &want,
                &tol,
            );
            let again = run_gpu(dev, &op, &ins, &outs, &mut []);
            assert_eq!(
                bits(&got[0]),
                bits(&again[0]),
                "{what}: linear_grad_weight, two runs differ"
            );
            check_linear_with_copy(
                dev,
                &format!("{what}: linear on copies, K = 4096"),
                (1000, 300, 4096),
                3050,
                false,
                true,
            );
        }
    }
}

/// `tile` forced on every pipelined GEMM through a second handle on the device: Linear on
/// rounded scratch with ragged M, N, K and a bias; on bf16 copies with the output's copy
/// (`_c`); the data gradient on copies, w MN-major (`_km`) and with dx's copy (`_kmc`);
/// the weight gradient on copies, both MN-major (`_mm`), split-K summed in a cluster and
/// through partials; a split linear with a bias and its copy and a split data gradient, in
/// clusters (`_c_..._k<S>`, `_km_..._k<S>`); each against the bf16 reference, outputs
/// poisoned by the runner, and the copies bit for bit the rounding of the outputs.
fn check_forced_tile(shared: &erase::runtime::cuda::CudaDevice, tile: GemmTile, what: &str) {
    // splits of at least 512 k, so that the K = 4096 cases split in clusters
    // the cp.async kernels (the TMA ones are the_tma_gemms_match_the_bf16_reference's)
    let forced = handle_with(erase::ops::cuda::PlanOptions {
        gemm_tile: Some(tile),
        gemm_ws: tile.ws,
        gemm_tma: false,
        gemm_pipe_min_k_per_split: 512,
        ..shared.plan_options()
    });
    assert_eq!(
        forced.plan_options().gemm_tile,
        Some(tile),
        "{what}: the handle's tile"
    );
    let dev = &forced;
    // scratch operands: y = x·wᵀ + b, ragged against 128 x 256 and K = 1620 (padded; 2·M·N·K
    // over the pipelined path's bound)
    let (m, n, k) = (1001, 700, 1620);
    let (x, xv) = f32_arg(&[m, k], 2000, -1.0, 1.0);
    let (w, wv) = f32_arg(&[n, k], 2001, -1.0, 1.0);
    let (b, bv) = f32_arg(&[n], 2002, -1.0, 1.0);
    let outs: [(&[usize], DType); 1] = [(&[m, n], DType::F32)];
    let op = Op::Linear {
        bias: true,
        relu: false,
    };
    let got = run_gpu(dev, &op, &[x, w, b], &outs, &mut []);
    let (want, tol) = gemm_ref((1, m, n, k), &xv, false, &wv, true, Some(&bv[..]));
    assert_within(&format!("{what}: linear"), &got[0].to_f64(), &want, &tol);
    // copies: y = relu(x·wᵀ + b) and its bf16 copy, DCNv2's cross shape at fewer rows
    check_linear_with_copy(
        dev,
        &format!("{what}: linear on copies"),
        (1001, 3456, 512),
        2010,
        true,
        true,
    );
    // dx = dy·w on copies (w MN-major), without and with dx's copy
    check_dx_on_copies(
        dev,
        &format!("{what}: linear_grad_input"),
        (1001, 512, 1736),
        2020,
        true,
    );
    // dw = dyᵀ·x over 2048 rows on copies (both MN-major): few tiles for every tile, so
    // split-K, summed in a cluster and (clusters off) through partials, the same bits twice
    let (rows, n, k) = (2048, 256, 1736);
    let dyv = rand_f32(2030, rows * n, -1.0, 1.0);
    let xv = rand_f32(2031, rows * k, -1.0, 1.0);
    let ins = [bf16_copy(&[rows, n], &dyv), bf16_copy(&[rows, k], &xv)];
    let outs: [(&[usize], DType); 1] = [(&[n, k], DType::F32)];
    let op = Op::LinearGradWeight { bias: false };
    let (want, tol) = gemm_ref((1, n, k, rows), &dyv, true, &xv, false, None);
    let partials = handle_with(erase::ops::cuda::PlanOptions {
        gemm_cluster: false,
        ..forced.plan_options()
    });
    for (how, d) in [("in a cluster", &forced), ("through partials", &partials)] {
        let got = run_gpu(d, &op, &ins, &outs, &mut []);
        assert_within(
            &format!("{what}: linear_grad_weight {how}"),
            &got[0].to_f64(),
            &want,
            &tol,
        );
        let again = run_gpu(d, &op, &ins, &outs, &mut []);
        assert_eq!(
            bits(&got[0]),
            bits(&again[0]),
            "{what}: linear_grad_weight {how}, two runs differ"
        );
    }
    // split linear on copies, y = x·wᵀ + b and its copy: 16 tiles, K = 4096 in 8 splits
    let (m, k) = (1000, 4096);
    check_linear_with_copy(
        dev,
        &format!("{what}: split linear on copies"),
        (m, 300, k),
        2040,
        false,
        true,
    );
    // split dx = dy·w on copies (w MN-major, rows of whole 16-byte chunks): dy [1000,
    // 4096], dx [1000, 304]
    check_dx_on_copies(
        dev,
        &format!("{what}: split linear_grad_input"),
        (m, k, 304),
        2050,
        false,
    );
}

/// dx [m, k] = dy [m, n] · w [n, k] from bf16 copies of dy and w (w MN-major) on `dev`,
/// against the bf16 reference; with `with_copy`, again with dx's bf16 copy as a second
/// output, the copy bit for bit the rounding of dx.
fn check_dx_on_copies(
    dev: &erase::runtime::cuda::CudaDevice,
    what: &str,
    (m, n, k): (usize, usize, usize),
    seed: u64,
    with_copy: bool,
) {
    let dyv = rand_f32(seed, m * n, -1.0, 1.0);
    let wv = rand_f32(seed + 1, n * k, -1.0, 1.0);
    let ins = [bf16_copy(&[m, n], &dyv), bf16_copy(&[n, k], &wv)];
    let (want, tol) = gemm_ref((1, m, k, n), &dyv, false, &wv, false, None);
    let op = Op::LinearGradInput {
        relu_mask: false,
        residual: false,
    };
    let outs: [(&[usize], DType); 1] = [(&[m, k], DType::F32)];
    let got = run_gpu(dev, &op, &ins, &outs, &mut []);
    assert_within(what, &got[0].to_f64(), &want, &tol);
    if with_copy {
        let outs: [(&[usize], DType); 2] = [(&[m, k], DType::F32), (&[m, k], DType::Bf16)];
        let got = run_gpu(dev, &op, &ins, &outs, &mut []);
        let what = format!("{what} with its copy");
        assert_within(&what, &got[0].to_f64(), &want, &tol);
        assert_copy_is_rounding(&what, &[m, k], &got);
    }
}

/// The thin kernels (a loss head's linear layer of one output and its gradients) against
/// the bf16 reference, outputs poisoned by the runner, at the heads' sizes (DCNv2's
/// 3456 -> 1 and the CTR model's 1728 -> 1 at 4096 rows) and ragged ones (K or N not a
/// multiple of 4: scalar loads and stores): y = x·wᵀ + b (ReLU, and its bf16 copy bit for
/// bit), dx = dy·w (the ReLU mask, the copy), dw = dyᵀ·x with db in splits of rows summed
/// in a fixed order (the same bits twice), and the tiled kernels' results within the same
/// tolerance.
#[test]
fn the_thin_gemms_match_the_bf16_reference() {
    let Some(dev) = device("the_thin_gemms_match_the_bf16_reference") else {
        return;
    };
    assert!(
        dev.plan_options().gemm_thin,
        "the thin kernels are on by default"
    );
    let tiled = handle_with(erase::ops::cuda::PlanOptions {
        gemm_thin: false,
        ..dev.plan_options()
    });
    for (i, &(m, k)) in [(4096usize, 3456usize), (4096, 1728), (1001, 1731), (37, 5)]
        .iter()
        .enumerate()
    {
        let seed = 2500 + 20 * i as u64;
        // forward, N = 1
        let (x, xv) = f32_arg(&[m, k], seed, -1.0, 1.0);
        let (w, wv) = f32_arg(&[1, k], seed + 1, -1.0, 1.0);
        let (b, bv) = f32_arg(&[1], seed + 2, -1.0, 1.0);
        let (want, tol) = gemm_ref((1, m, 1, k), &xv, false, &wv, true, Some(&bv));
        for relu in [false, true] {
            let op = Op::Linear { bias: true, relu };
            let outs: [(&[usize], DType); 2] = [(&[m, 1], DType::F32), (&[m, 1], DType::Bf16)];
            let ins = [x.clone(), w.clone(), b.clone()];
            let got = run_gpu(dev, &op, &ins, &outs, &mut []);
            let what = format!("thin linear {m}x{k} -> 1 relu {relu}");
            assert_within(&what, &got[0].to_f64(), &relu_if(relu, &want), &tol);
            assert_copy_is_rounding(&what, &[m, 1], &got);
            let t = run_gpu(&tiled, &op, &ins, &outs[..1], &mut []);
            assert_within(
                &format!("{what}, tiled"),
                &t[0].to_f64(),
                &relu_if(relu, &want),
                &tol,
            );
        }
        // data gradient, K = 1: dx[m, k] = dy[m]·w[k], with the ReLU mask, and the copy
        let (dy, dyv) = f32_arg(&[m, 1], seed + 3, -1.0, 1.0);
        let (want, tol) = gemm_ref((1, m, k, 1), &dyv, false, &wv, false, None);
        let (_, yv) = f32_arg(&[m, k], seed + 4, -1.0, 1.0);
        let yv: Vec<f32> = yv.iter().map(|&v| v.max(0.0)).collect();
        let y = arg(&[m, k], Buffer::F32(yv.clone()));
        let what = format!("thin linear_grad_input {m} x 1 -> {k}");
        let op = Op::LinearGradInput {
            relu_mask: false,
            residual: false,
        };
        let outs: [(&[usize], DType); 2] = [(&[m, k], DType::F32), (&[m, k], DType::Bf16)];
        let got = run_gpu(dev, &op, &[dy.clone(), w.clone()], &outs, &mut []);
        assert_within(&what, &got[0].to_f64(), &want, &tol);
        assert_copy_is_rounding(&what, &[m, k], &got);
        let op = Op::LinearGradInput {
            relu_mask: true,
            residual: false,
        };
        let got = run_gpu(dev, &op, &[dy.clone(), w.clone(), y], &outs[..1], &mut []);
        let masked: Vec<f64> = want
            .iter()
            .zip(&yv)
            .map(|(&v, &y)| if y > 0.0 { v } else { 0.0 })
            .collect();
        assert_within(&format!("{what} masked"), &got[0].to_f64(), &masked, &tol);
        // weight gradient, M = 1, with the bias gradient: the same bits twice
        let op = Op::LinearGradWeight { bias: true };
        let outs: [(&[usize], DType); 2] = [(&[1, k], DType::F32), (&[1], DType::F32)];
        let ins = [dy, x];
        let got = run_gpu(dev, &op, &ins, &outs, &mut []);
        let (want, tol) = gemm_ref((1, 1, k, m), &dyv, true, &xv, false, None);
        let what = format!("thin linear_grad_weight rows {m} -> [1, {k}]");
        assert_within(&what, &got[0].to_f64(), &want, &tol);
        let db: f64 = dyv.iter().map(|&v| f64::from(v)).sum();
        let mag: f64 = dyv.iter().map(|&v| f64::from(v).abs()).sum();
        let db_tol = m as f64 * 2f64.powi(-24) * mag;
        assert_within(&format!("{what}: db"), &got[1].to_f64(), &[db], &[db_tol]);
        let again = run_gpu(dev, &op, &ins, &outs, &mut []);
        for (a, b) in got.iter().zip(&again) {
            assert_eq!(bits(a), bits(b), "{what}: two runs differ");
        }
        let t = run_gpu(&tiled, &op, &ins, &outs, &mut []);
        assert_within(&format!("{what}, tiled"), &t[0].to_f64(), &want, &tol);
    }
}

/// The fused cross update (`LinearMulAdd`: y = x·wᵀ + b stored in f32 or in bf16, then
/// z = a ⊙ y + c and z's bf16 copy) against the bf16 reference and against itself taken
/// apart, outputs poisoned by the runner: y within the GEMM's tolerance (plus a bf16
/// rounding where stored so); z, bit for bit, the product and sum of a, the stored y and
/// c in f32 (no FMA); the copy z rounded to nearest even; and every output's bits those
/// of the update's own launch after the GEMM (`gemm_mul_add_epilogue` off). At DCNv2's
/// shape the plan is one `_ma` launch; a ragged shape (edge tiles) and an odd N (scalar
/// stores) too, on fresh random operands of both signs (never zero).
#[test]
fn a_fused_cross_update_matches_its_layer_and_update_apart() {
    let Some(dev) = device("a_fused_cross_update_matches_its_layer_and_update_apart") else {
        return;
    };
    let apart = handle_with(erase::ops::cuda::PlanOptions {
        gemm_mul_add_epilogue: false,
        ..dev.plan_options()
    });
    let op = Op::LinearMulAdd { bias: true };
    for (i, &(m, n, k)) in [
        (4096usize, 3456usize, 512usize),
        (1000, 200, 192),
        (515, 203, 128),
    ]
    .iter()
    .enumerate()
    {
        let seed = 3100 + 10 * i as u64;
        let bf = |v: Vec<f32>| {
            Buffer::from_f64(
                DType::Bf16,
                &v.iter().map(|&x| f64::from(x)).collect::<Vec<_>>(),
            )
        };
        let signed = |s: u64| -> Vec<f32> {
            let mag = rand_f32(s, m * n, 0.05, 1.0);
            let sign = rand_f32(s ^ 0x5151, m * n, 0.0, 1.0);
            mag.iter()
                .zip(sign)
                .map(|(&v, s)| if s < 0.5 { -v } else { v })
                .collect()
        };
        let xb = bf(rand_f32(seed, m * k, -1.0, 1.0));
        let wb = bf(rand_f32(seed + 1, n * k, -1.0, 1.0));
        let (xv, wv): (Vec<f32>, Vec<f32>) = (
            xb.to_f64().iter().map(|&x| x as f32).collect(),
            wb.to_f64().iter().map(|&x| x as f32).collect(),
        );
        let (b, bv) = f32_arg(&[n], seed + 2, -1.0, 1.0);
        let (av, cv) = (signed(seed + 3), signed(seed + 4));
        let ins = [
            arg(&[m, k], xb),
            arg(&[n, k], wb),
            b,
            arg(&[m, n], Buffer::F32(av.clone())),
            arg(&[m, n], Buffer::F32(cv.clone())),
        ];
        let (want, tol) = gemm_ref((1, m, n, k), &xv, false, &wv, true, Some(&bv[..]));
        for y_dtype in [DType::Bf16, DType::F32] {
            for copy in [true, false] {
                let what = format!("linear_mul_add {m}x{n}x{k}, y {y_dtype}, z's copy {copy}");
                let mn = [m, n];
                let mut outs: Vec<(&[usize], DType)> = vec![(&mn, y_dtype), (&mn, DType::F32)];
                if copy {
                    outs.push((&mn, DType::Bf16));
                }
                if m == 4096 {
                    let shapes: Vec<Shape> = [&[m, k][..], &[n, k], &[n], &[m, n], &[m, n]]
                        .iter()
                        .map(|d| Shape::new(d))
                        .collect();
                    let out_shapes: Vec<Shape> = outs.iter().map(|(d, _)| Shape::new(d)).collect();
                    let out_dtypes: Vec<DType> = outs.iter().map(|o| o.1).collect();
                    let plan = erase::ops::cuda::cuda_plan(
                        &op,
                        &erase::ops::cuda::Operands {
                            opts: dev.plan_options(),
                            ins: &shapes.iter().collect::<Vec<_>>(),
                            in_dtypes: &[
                                DType::Bf16,
                                DType::Bf16,
                                DType::F32,
                                DType::F32,
                                DType::F32,
                            ],
                            outs: &out_shapes.iter().collect::<Vec<_>>(),
                            out_dtypes: &out_dtypes,
                            upd: &[],
                        },
                    )
                    .expect("the fused update plans");
                    let names: Vec<&str> = plan.calls.iter().map(|c| c.kernel).collect();
                    assert!(
                        names.len() == 1 && names[0].ends_with("_128x128_ma"),
                        "{what}: {names:?}"
                    );
                }
                let got = run_gpu(dev, &op, &ins, &outs, &mut []);
                let y = got[0].to_f64();
                let tol_y: Vec<f64> = if y_dtype == DType::Bf16 {
                    tol.iter()
                        .zip(&want)
                        .map(|(t, w)| t + w.abs() * 2f64.powi(-8))
                        .collect()
                } else {
                    tol.clone()
                };
                assert_within(&format!("{what}: y"), &y, &want, &tol_y);
                // z from the stored y, as MulAdd computes it: one rounding a product, one a sum
                let z = f32s(&got[1]);
                for e in 0..m * n {
                    let expect = av[e] * (y[e] as f32) + cv[e];
                    assert!(
                        z[e].to_bits() == expect.to_bits(),
                        "{what}: z[{}, {}] = {} against a·y + c = {expect}",
                        e / n,
                        e % n,
                        z[e]
                    );
                }
                if copy {
                    assert_copy_is_rounding(&format!("{what}: z"), &[m, n], &got[1..]);
                }
                let sep = run_gpu(&apart, &op, &ins, &outs, &mut []);
                for (o, (f, s)) in got.iter().zip(&sep).enumerate() {
                    assert!(
                        f.bytes() == s.bytes(),
                        "{what}: output {o} differs from the update's own launch"
                    );
                }
            }
        }
    }
}
