//! Small launches of the GEMM, attention, embedding-bag and interaction kernels, sized
//! so that `compute-sanitizer` (memcheck, racecheck) gets through them quickly:
//! `compute-sanitizer --tool memcheck gpu-tests sanitize`.

use super::{arg, device, handle_with, rand_f32, run_cpu, run_gpu};
use erase::graph::{DType, Op};
use erase::ops::cuda::{GemmTile, LaunchSet, PlanOptions};
use erase::ops::Buffer;

/// `len` values uniform in [-1, 1] (seeded), rounded to bf16.
fn rand_bf16(seed: u64, len: usize) -> Buffer {
    let v: Vec<f64> = rand_f32(seed, len, -1.0, 1.0)
        .iter()
        .map(|&x| f64::from(x))
        .collect();
    Buffer::from_f64(DType::Bf16, &v)
}

fn close(what: &str, got: &Buffer, want: &Buffer, tol: f64) {
    let (g, w) = (got.to_f64(), want.to_f64());
    let scale = w.iter().fold(1e-3f64, |m, x| m.max(x.abs()));
    let worst = g
        .iter()
        .zip(&w)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    assert!(g.iter().all(|x| x.is_finite()), "{what}: non-finite output");
    assert!(
        worst <= tol * scale,
        "{what}: worst |err| {worst:.3e} > {tol} x {scale:.3e}"
    );
}

#[test]
fn sanitize_gemm() {
    let Some(dev) = device("sanitize_gemm") else {
        return;
    };
    for (m, n, k) in [(33, 17, 13), (5, 1, 70), (130, 65, 129)] {
        let ins = vec![
            arg(&[m, k], Buffer::F32(rand_f32(1, m * k, -1.0, 1.0))),
            arg(&[n, k], Buffer::F32(rand_f32(2, n * k, -1.0, 1.0))),
            arg(&[n], Buffer::F32(rand_f32(3, n, -1.0, 1.0))),
        ];
        let outs: [(&[usize], DType); 1] = [(&[m, n], DType::F32)];
        let op = Op::Linear {
            bias: true,
            relu: false,
        };
        let g = run_gpu(dev, &op, &ins, &outs, &mut []);
        let c = run_cpu(&op, &ins, &outs, &mut []);
        close(&format!("linear {m}x{n}x{k}"), &g[0], &c[0], 2e-2);
        let dy = arg(&[m, n], Buffer::F32(rand_f32(4, m * n, -1.0, 1.0)));
        let x = arg(&[m, k], Buffer::F32(rand_f32(5, m * k, -1.0, 1.0)));
        let outs: [(&[usize], DType); 1] = [(&[n, k], DType::F32)];
        let ins = vec![dy, x];
        let g = run_gpu(
            dev,
            &Op::LinearGradWeight { bias: false },
            &ins,
            &outs,
            &mut [],
        );
        let c = run_cpu(&Op::LinearGradWeight { bias: false }, &ins, &outs, &mut []);
        close(&format!("linear dw {m}x{n}x{k}"), &g[0], &c[0], 2e-2);
    }
    // LinearAdd: the residual added by the tall kernel's store, or by a launch after the
    // GEMM (which writes to scratch)
    for (m, n, k) in [(33, 17, 13), (34_000, 16, 8)] {
        let ins = vec![
            arg(&[m, k], Buffer::F32(rand_f32(10, m * k, -1.0, 1.0))),
            arg(&[n, k], Buffer::F32(rand_f32(11, n * k, -1.0, 1.0))),
            arg(&[n], Buffer::F32(rand_f32(12, n, -1.0, 1.0))),
            arg(&[m, n], Buffer::F32(rand_f32(13, m * n, -1.0, 1.0))),
        ];
        let outs: [(&[usize], DType); 1] = [(&[m, n], DType::F32)];
        let op = Op::LinearAdd { bias: true };
        let g = run_gpu(dev, &op, &ins, &outs, &mut []);
        let c = run_cpu(&op, &ins, &outs, &mut []);
        close(&format!("linear_add {m}x{n}x{k}"), &g[0], &c[0], 2e-2);
    }
    // a data gradient with a residual: the pipelined 128x128 tile's epilogue reading r
    // through `bias` (ragged: scalar loads past the last whole float4), whole and split in
    // a cluster, and the tall store's
    for (min_k, (m, n, k)) in [
        (4096, (200, 130, 131)),
        (64, (200, 192, 130)),
        (4096, (34_000, 16, 8)),
    ] {
        let h = handle_with(PlanOptions {
            gemm_pipe_min_flops: 0,
            gemm_pipe_min_mn: 16,
            gemm_pipe_min_k_per_split: min_k,
            ..dev.plan_options()
        });
        let ins = vec![
            arg(&[m, n], Buffer::F32(rand_f32(17, m * n, -1.0, 1.0))),
            arg(&[n, k], Buffer::F32(rand_f32(18, n * k, -1.0, 1.0))),
            arg(&[m, k], Buffer::F32(rand_f32(19, m * k, -1.0, 1.0))),
        ];
        let outs: [(&[usize], DType); 1] = [(&[m, k], DType::F32)];
        let op = Op::LinearGradInput {
            relu_mask: false,
            residual: true,
        };
        let g = run_gpu(&h, &op, &ins, &outs, &mut []);
        let c = run_cpu(&op, &ins, &outs, &mut []);
        close(&format!("linear dx + r {m}x{n}x{k}"), &g[0], &c[0], 2e-2);
    }
    // a linear layer stored in bf16: the tall kernel's `_bo` store (its fewest rows, a
    // ragged N: scalar stores), and f32 C into scratch and a cast elsewhere
    for (m, n, k) in [(34_000, 30, 8), (33, 17, 13)] {
        let ins = vec![
            arg(&[m, k], Buffer::F32(rand_f32(14, m * k, -1.0, 1.0))),
            arg(&[n, k], Buffer::F32(rand_f32(15, n * k, -1.0, 1.0))),
            arg(&[n], Buffer::F32(rand_f32(16, n, -1.0, 1.0))),
        ];
        let outs: [(&[usize], DType); 1] = [(&[m, n], DType::Bf16)];
        let op = Op::Linear {
            bias: true,
            relu: true,
        };
        let g = run_gpu(dev, &op, &ins, &outs, &mut []);
        let c = run_cpu(&op, &ins, &outs, &mut []);
        close(&format!("linear {m}x{n}x{k} in bf16"), &g[0], &c[0], 2e-2);
    }
    // a bf16 dy read as it is: the single-launch `_a16` kernels (dx, and dw with the bias
    // gradient), and the tall one (its fewest rows, K a multiple of 8)
    for (m, n, k) in [(33, 17, 13), (130, 65, 129), (34_000, 16, 8)] {
        let dy16 = |seed| {
            let v: Vec<f64> = rand_f32(seed, m * n, -1.0, 1.0)
                .iter()
                .map(|&x| f64::from(x))
                .collect();
            arg(&[m, n], Buffer::from_f64(DType::Bf16, &v))
        };
        let w = arg(&[n, k], Buffer::F32(rand_f32(7, n * k, -1.0, 1.0)));
        let ins = vec![dy16(6), w];
        let op = Op::LinearGradInput {
            relu_mask: false,
            residual: false,
        };
        let outs: [(&[usize], DType); 1] = [(&[m, k], DType::F32)];
        let g = run_gpu(dev, &op, &ins, &outs, &mut []);
        let c = run_cpu(&op, &ins, &outs, &mut []);
        close(
            &format!("linear dx, bf16 dy, {m}x{n}x{k}"),
            &g[0],
            &c[0],
            2e-2,
        );
        let x = arg(&[m, k], Buffer::F32(rand_f32(8, m * k, -1.0, 1.0)));
        let ins = vec![dy16(9), x];
        let op = Op::LinearGradWeight { bias: true };
        let outs: [(&[usize], DType); 2] = [(&[n, k], DType::F32), (&[n], DType::F32)];
        let g = run_gpu(dev, &op, &ins, &outs, &mut []);
        let c = run_cpu(&op, &ins, &outs, &mut []);
        close(
            &format!("linear dw, bf16 dy, {m}x{n}x{k}"),
            &g[0],
            &c[0],
            2e-2,
        );
        close(
            &format!("linear db, bf16 dy, {m}x{n}x{k}"),
            &g[1],
            &c[1],
            1e-4,
        );
    }
    // the thin kernels (a loss head's layer of one output): the forward with its copy,
    // ragged K (scalar loads); the data gradient with the ReLU mask and with a residual,
    // ragged N (scalar stores) and whole float4s; the weight gradient with its bias
    // gradient, one split and eight (partials, then the reduction)
    for (m, k) in [(1000, 70), (300, 64)] {
        let x = arg(&[m, k], Buffer::F32(rand_f32(20, m * k, -1.0, 1.0)));
        let w = arg(&[1, k], Buffer::F32(rand_f32(21, k, -1.0, 1.0)));
        let b = arg(&[1], Buffer::F32(rand_f32(22, 1, -1.0, 1.0)));
        let dy = arg(&[m, 1], Buffer::F32(rand_f32(23, m, -1.0, 1.0)));
        let y = arg(&[m, k], Buffer::F32(rand_f32(24, m * k, -1.0, 1.0)));
        let op = Op::Linear {
            bias: true,
            relu: true,
        };
        let outs: [(&[usize], DType); 2] = [(&[m, 1], DType::F32), (&[m, 1], DType::Bf16)];
        let ins = [x.clone(), w.clone(), b];
        let g = run_gpu(dev, &op, &ins, &outs, &mut []);
        let c = run_cpu(&op, &ins, &outs, &mut []);
        close(&format!("thin linear {m}x{k}"), &g[0], &c[0], 2e-2);
        for (relu_mask, residual) in [(true, false), (false, true)] {
            let op = Op::LinearGradInput {
                relu_mask,
                residual,
            };
            let ins = [dy.clone(), w.clone(), y.clone()];
            let outs: [(&[usize], DType); 1] = [(&[m, k], DType::F32)];
            let g = run_gpu(dev, &op, &ins, &outs, &mut []);
            let c = run_cpu(&op, &ins, &outs, &mut []);
            close(
                &format!("thin linear dx {m}x{k} mask {relu_mask}"),
                &g[0],
                &c[0],
                2e-2,
            );
        }
        let op = Op::LinearGradWeight { bias: true };
        let outs: [(&[usize], DType); 2] = [(&[1, k], DType::F32), (&[1], DType::F32)];
        let ins = [dy.clone(), x];
        let g = run_gpu(dev, &op, &ins, &outs, &mut []);
        let c = run_cpu(&op, &ins, &outs, &mut []);
        close(&format!("thin linear dw {m}x{k}"), &g[0], &c[0], 2e-2);
        // db = Σ dy, f32 sums in different orders: within m·2^-24·Σ|dy| (the sum itself
        // cancels to far less than its terms)
        let (gd, cd) = (g[1].to_f64()[0], c[1].to_f64()[0]);
        let mag: f64 = rand_f32(23, m, -1.0, 1.0)
            .iter()
            .map(|&v| f64::from(v).abs())
            .sum();
        let tol = m as f64 * 2f64.powi(-24) * mag;
        assert!(
            (gd - cd).abs() <= tol,
            "thin linear db {m}x{k}: {gd} against {cd} (tolerance {tol:.3e})"
        );
    }
}

/// The warp-specialized pipelined kernels (loader and math warpgroups, mbarriers) on small
/// ragged GEMMs: the tile forced, whole and split in a cluster (K in splits of 64, the last
/// of a cluster of 4 empty at K = 192), Linear with a bias and ReLU on rounded scratch and
/// the weight gradient, against the CPU.
#[test]
fn sanitize_warp_specialized_gemm() {
    let Some(dev) = device("sanitize_warp_specialized_gemm") else {
        return;
    };
    let tile = GemmTile { n: 64, ws: true };
    for min_k in [64, 4096] {
        let h = handle_with(PlanOptions {
            gemm_tile: Some(tile),
            gemm_ws: true,
            gemm_pipe_min_flops: 0,
            gemm_pipe_min_mn: 16,
            gemm_pipe_min_k_per_split: min_k,
            ..dev.plan_options()
        });
        if !h.plan_options().gemm_ws {
            println!("the sm_80 PTX runs: it has no warp-specialized kernels to check");
            return;
        }
        stored_in_bf16(&h, &format!("ws 128x{} (splits of {min_k})", tile.n));
        for (m, n, k) in [(200, 130, 192), (130, 65, 129)] {
            let what = format!("ws 128x{} (splits of {min_k}) {m}x{n}x{k}", tile.n);
            let ins = vec![
                arg(&[m, k], Buffer::F32(rand_f32(21, m * k, -1.0, 1.0))),
                arg(&[n, k], Buffer::F32(rand_f32(22, n * k, -1.0, 1.0))),
                arg(&[n], Buffer::F32(rand_f32(23, n, -1.0, 1.0))),
            ];
            let outs: [(&[usize], DType); 1] = [(&[m, n], DType::F32)];
            let op = Op::Linear {
                bias: true,
                relu: true,
            };
            let g = run_gpu(&h, &op, &ins, &outs, &mut []);
            let c = run_cpu(&op, &ins, &outs, &mut []);
            close(&format!("{what}: linear"), &g[0], &c[0], 2e-2);
            let ins = vec![
                arg(&[m, n], Buffer::F32(rand_f32(24, m * n, -1.0, 1.0))),
                arg(&[m, k], Buffer::F32(rand_f32(25, m * k, -1.0, 1.0))),
            ];
            let op = Op::LinearGradWeight { bias: false };
            let outs: [(&[usize], DType); 1] = [(&[n, k], DType::F32)];
            let g = run_gpu(&h, &op, &ins, &outs, &mut []);
            let c = run_cpu(&op, &ins, &outs, &mut []);
            close(&format!("{what}: linear dw"), &g[0], &c[0], 2e-2);
        }
    }
}

/// The TMA pipelined kernels (one thread issuing each stage's boxes, mbarriers) on small
/// ragged GEMMs, the three tiles (128x128, 128x256, 128x64), whole and split in a cluster
/// (K in splits of 64: five of a cluster of 8 at K = 260, the last three empty): Linear
/// with a bias and ReLU on rounded scratch (K of one step too) and the weight gradient,
/// against the CPU.
#[test]
fn sanitize_tma_gemm() {
    let Some(dev) = device("sanitize_tma_gemm") else {
        return;
    };
    for (n_tile, min_k) in [
        (128, 1 << 30),
        (256, 1 << 30),
        (64, 1 << 30),
        (128, 64),
        (256, 64),
        (64, 64),
    ] {
        let h = handle_with(PlanOptions {
            gemm_tile: Some(GemmTile {
                n: n_tile,
                ws: false,
            }),
            gemm_tma: true,
            gemm_tma_n64: LaunchSet::ALL,
            gemm_pipe_min_flops: 0,
            gemm_pipe_min_mn: 16,
            gemm_pipe_min_k_per_split: min_k,
            ..dev.plan_options()
        });
        if !h.plan_options().gemm_tma {
            println!("the sm_80 PTX runs: it has no TMA kernels to check");
            return;
        }
        for (m, n, k) in [(200, 130, 260), (100, 65, 64)] {
            let what = format!("TMA 128x{n_tile} (splits of {min_k}) {m}x{n}x{k}");
            let ins = vec![
                arg(&[m, k], Buffer::F32(rand_f32(31, m * k, -1.0, 1.0))),
                arg(&[n, k], Buffer::F32(rand_f32(32, n * k, -1.0, 1.0))),
                arg(&[n], Buffer::F32(rand_f32(33, n, -1.0, 1.0))),
            ];
            let outs: [(&[usize], DType); 1] = [(&[m, n], DType::F32)];
            let op = Op::Linear {
                bias: true,
                relu: true,
            };
            let g = run_gpu(&h, &op, &ins, &outs, &mut []);
            let c = run_cpu(&op, &ins, &outs, &mut []);
            close(&format!("{what}: linear"), &g[0], &c[0], 2e-2);
            let ins = vec![
                arg(&[m, n], Buffer::F32(rand_f32(34, m * n, -1.0, 1.0))),
                arg(&[m, k], Buffer::F32(rand_f32(35, m * k, -1.0, 1.0))),
            ];
            let op = Op::LinearGradWeight { bias: false };
            let outs: [(&[usize], DType); 1] = [(&[n, k], DType::F32)];
            let g = run_gpu(&h, &op, &ins, &outs, &mut []);
            let c = run_cpu(&op, &ins, &outs, &mut []);
            close(&format!("{what}: linear dw"), &g[0], &c[0], 2e-2);
        }
        stored_in_bf16(&h, &format!("TMA 128x{n_tile} (splits of {min_k})"));
    }
}

/// A layer of bf16 copies stored in bf16 (flags bit 6) on the plan options of `h`: only
/// the bf16 C is written, so an f32 store would fall outside its half-size output (the
/// sanitizer's allocation); N odd for the epilogues' scalar stores.
fn stored_in_bf16(h: &erase::runtime::cuda::CudaDevice, what: &str) {
    for (m, n, k) in [(200, 136, 256), (130, 67, 128)] {
        let ins = vec![
            arg(&[m, k], rand_bf16(36, m * k)),
            arg(&[n, k], rand_bf16(37, n * k)),
            arg(&[n], Buffer::F32(rand_f32(38, n, -1.0, 1.0))),
        ];
        let op = Op::Linear {
            bias: true,
            relu: false,
        };
        let outs: [(&[usize], DType); 1] = [(&[m, n], DType::Bf16)];
        let g = run_gpu(h, &op, &ins, &outs, &mut []);
        let c = run_cpu(&op, &ins, &outs, &mut []);
        close(
            &format!("{what} {m}x{n}x{k}: stored in bf16"),
            &g[0],
            &c[0],
            2e-2,
        );
    }
}

#[test]
fn sanitize_attention() {
    let Some(dev) = device("sanitize_attention") else {
        return;
    };
    for (b, h, s, dh, causal) in [(2, 2, 27, 32, false), (1, 1, 70, 64, true)] {
        let w = h * dh;
        let x = |seed| {
            arg(
                &[b, s, w],
                Buffer::F32(rand_f32(seed, b * s * w, -1.0, 1.0)),
            )
        };
        let ins = vec![x(1), x(2), x(3)];
        let op = Op::Attention {
            heads: h,
            causal,
            packed: false,
        };
        let outs: [(&[usize], DType); 2] = [(&[b, s, w], DType::F32), (&[b, h, s], DType::F32)];
        let g = run_gpu(dev, &op, &ins, &outs, &mut []);
        let c = run_cpu(&op, &ins, &outs, &mut []);
        close("attention o", &g[0], &c[0], 3e-2);
        let bins = vec![
            x(4),
            x(1),
            x(2),
            x(3),
            arg(&[b, s, w], c[0].clone()),
            arg(&[b, h, s], c[1].clone()),
        ];
        let bop = Op::AttentionGrad {
            heads: h,
            causal,
            packed: false,
        };
        let bouts: [(&[usize], DType); 3] = [
            (&[b, s, w], DType::F32),
            (&[b, s, w], DType::F32),
            (&[b, s, w], DType::F32),
        ];
        let g = run_gpu(dev, &bop, &bins, &bouts, &mut []);
        let c = run_cpu(&bop, &bins, &bouts, &mut []);
        for i in 0..3 {
            close(&format!("attention grad {i}"), &g[i], &c[i], 5e-2);
        }

        // packed q, k, v: one [B, S, 3·W] input, one dqkv output, against the CPU's op
        let qkv = arg(
            &[b, s, 3 * w],
            Buffer::F32(rand_f32(5, b * s * 3 * w, -1.0, 1.0)),
        );
        let op = Op::Attention {
            heads: h,
            causal,
            packed: true,
        };
        let ins = vec![qkv.clone()];
        let g = run_gpu(dev, &op, &ins, &outs, &mut []);
        let c = run_cpu(&op, &ins, &outs, &mut []);
        close("packed attention o", &g[0], &c[0], 3e-2);
        let bop = Op::AttentionGrad {
            heads: h,
            causal,
            packed: true,
        };
        let bins = vec![
            x(4),
            qkv,
            arg(&[b, s, w], c[0].clone()),
            arg(&[b, h, s], c[1].clone()),
        ];
        let bouts: [(&[usize], DType); 1] = [(&[b, s, 3 * w], DType::F32)];
        let g = run_gpu(dev, &bop, &bins, &bouts, &mut []);
        let c = run_cpu(&bop, &bins, &bouts, &mut []);
        close("packed attention dqkv", &g[0], &c[0], 5e-2);
        // dqkv written in bf16
        let bouts: [(&[usize], DType); 1] = [(&[b, s, 3 * w], DType::Bf16)];
        let g = run_gpu(dev, &bop, &bins, &bouts, &mut []);
        let c = run_cpu(&bop, &bins, &bouts, &mut []);
        close("packed attention dqkv in bf16", &g[0], &c[0], 5e-2);
        // qkv stored in bf16 (one tile: the `_bi` kernels), dqkv in bf16 and in f32
        if s <= 64 {
            let v: Vec<f64> = rand_f32(5, b * s * 3 * w, -1.0, 1.0)
                .iter()
                .map(|&x| f64::from(x))
                .collect();
            let qkv16 = arg(&[b, s, 3 * w], Buffer::from_f64(DType::Bf16, &v));
            let ins = vec![qkv16.clone()];
            let g = run_gpu(dev, &op, &ins, &outs, &mut []);
            let c = run_cpu(&op, &ins, &outs, &mut []);
            close("packed attention o, bf16 qkv", &g[0], &c[0], 3e-2);
            let bins = vec![
                x(4),
                qkv16,
                arg(&[b, s, w], c[0].clone()),
                arg(&[b, h, s], c[1].clone()),
            ];
            for dt in [DType::Bf16, DType::F32] {
                let bouts: [(&[usize], DType); 1] = [(&[b, s, 3 * w], dt)];
                let g = run_gpu(dev, &bop, &bins, &bouts, &mut []);
                let c = run_cpu(&bop, &bins, &bouts, &mut []);
                close(
                    &format!("packed attention dqkv ({dt}), bf16 qkv"),
                    &g[0],
                    &c[0],
                    5e-2,
                );
            }
        }
    }
}

#[test]
fn sanitize_embedding_bag() {
    let Some(dev) = device("sanitize_embedding_bag") else {
        return;
    };
    let field_rows = vec![7usize, 3, 11];
    let (b, d) = (5usize, 8usize);
    let mut ids = Vec::new();
    let mut offsets = vec![0i32];
    for e in 0..b {
        for (f, &r) in field_rows.iter().enumerate() {
            for h in 0..(e + f) % 3 {
                ids.push(((e * 3 + h * 5 + f) % r) as i32);
            }
            offsets.push(ids.len() as i32);
        }
    }
    let total: usize = field_rows.iter().sum();
    let table = arg(&[total, d], Buffer::F32(rand_f32(1, total * d, -1.0, 1.0)));
    let ids_a = arg(&[ids.len()], Buffer::I32(ids.clone()));
    let off_a = arg(&[offsets.len()], Buffer::I32(offsets.clone()));
    let op = Op::EmbeddingBag {
        field_rows: field_rows.clone(),
    };
    let outs: [(&[usize], DType); 1] = [(&[b, 3, d], DType::F32)];
    let ins = vec![table, ids_a, off_a];
    let g = run_gpu(dev, &op, &ins, &outs, &mut []);
    let c = run_cpu(&op, &ins, &outs, &mut []);
    close("embedding_bag", &g[0], &c[0], 1e-5);
    let dp = arg(&[b, 3, d], Buffer::F32(rand_f32(2, b * 3 * d, -1.0, 1.0)));
    let upd_op = Op::RowwiseAdagrad {
        lr: 0.01,
        eps: 1e-8,
        field_rows,
    };
    let mk = || {
        vec![
            arg(&[total, d], Buffer::F32(rand_f32(3, total * d, -1.0, 1.0))),
            arg(&[total], Buffer::F32(rand_f32(4, total, 0.1, 1.0))),
        ]
    };
    let (mut ug, mut uc) = (mk(), mk());
    let ins = vec![
        arg(&[ids.len()], Buffer::I32(ids)),
        arg(&[offsets.len()], Buffer::I32(offsets)),
        dp,
    ];
    run_gpu(dev, &upd_op, &ins, &[], &mut ug);
    run_cpu(&upd_op, &ins, &[], &mut uc);
    close("rowwise adagrad table", &ug[0].value, &uc[0].value, 1e-5);
    close("rowwise adagrad acc", &ug[1].value, &uc[1].value, 1e-5);
}

/// The interaction's shared-memory kernels over a few examples: several CTAs, each
/// staging examples in turn (the forward two at a time, the last CTA's second slot past
/// the batch), F not a multiple of 3, D a multiple of 4 (float4 staging) and not.
#[test]
fn sanitize_pairwise_dot() {
    let Some(dev) = device("sanitize_pairwise_dot") else {
        return;
    };
    for (b, f, d) in [(5usize, 7usize, 8usize), (3, 27, 64), (4, 5, 9)] {
        let p = f * (f - 1) / 2;
        let e = arg(&[b, f, d], Buffer::F32(rand_f32(1, b * f * d, -1.0, 1.0)));
        let outs: [(&[usize], DType); 1] = [(&[b, p], DType::F32)];
        let g = run_gpu(
            dev,
            &Op::PairwiseDot,
            std::slice::from_ref(&e),
            &outs,
            &mut [],
        );
        let c = run_cpu(&Op::PairwiseDot, std::slice::from_ref(&e), &outs, &mut []);
        close("pairwise_dot", &g[0], &c[0], 0.0);
        let dy = arg(&[b, p], Buffer::F32(rand_f32(2, b * p, -1.0, 1.0)));
        let ins = vec![dy, e];
        let outs: [(&[usize], DType); 1] = [(&[b, f, d], DType::F32)];
        let g = run_gpu(dev, &Op::PairwiseDotGrad, &ins, &outs, &mut []);
        let c = run_cpu(&Op::PairwiseDotGrad, &ins, &outs, &mut []);
        close("pairwise_dot_grad", &g[0], &c[0], 0.0);
    }
}

/// A layer stored in bf16 (flags bit 6) on the cp.async pipelined kernels (wgmma on sm_90a,
/// mma.sync on the sm_80 PTX), whole and split in a cluster: the TMA and warp-specialized
/// forms are checked with their own tests above.
#[test]
fn sanitize_cp_async_gemm_stored_in_bf16() {
    let Some(dev) = device("sanitize_cp_async_gemm_stored_in_bf16") else {
        return;
    };
    for (n_tile, min_k) in [(128, 1 << 30), (256, 1 << 30), (128, 64), (256, 64)] {
        let h = handle_with(PlanOptions {
            gemm_tile: Some(GemmTile {
                n: n_tile,
                ws: false,
            }),
            gemm_tma: false,
            gemm_pipe_min_flops: 0,
            gemm_pipe_min_mn: 16,
            gemm_pipe_min_k_per_split: min_k,
            ..dev.plan_options()
        });
        stored_in_bf16(&h, &format!("cp.async 128x{n_tile} (splits of {min_k})"));
    }
}

/// Adam with the bf16 copies of some parameters: tensors of odd sizes (the scalar tail of
/// each chunk), the copies past the moments, each copy exactly its parameter's size.
#[test]
fn sanitize_adam_copies() {
    let Some(dev) = device("sanitize_adam_copies") else {
        return;
    };
    let sizes = [5usize, 1027, 3, 64];
    let op = Op::Adam {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
    };
    let mut upd = Vec::new();
    for (i, &s) in sizes.iter().enumerate() {
        upd.push(arg(
            &[s],
            Buffer::F32(rand_f32(10 + i as u64, s, -1.0, 1.0)),
        ));
    }
    for _ in 0..2 {
        for &s in &sizes {
            upd.push(arg(&[s], Buffer::F32(vec![0.0; s])));
        }
    }
    for &s in &sizes[..3] {
        upd.push(arg(&[s], Buffer::poison(DType::Bf16, s)));
    }
    let mut cpu_upd = upd.clone();
    let mut ins = vec![arg(&[], Buffer::I32(vec![1]))];
    for (i, &s) in sizes.iter().enumerate() {
        ins.push(arg(
            &[s],
            Buffer::F32(rand_f32(20 + i as u64, s, -1.0, 1.0)),
        ));
    }
    run_gpu(dev, &op, &ins, &[], &mut upd);
    run_cpu(&op, &ins, &[], &mut cpu_upd);
    for (k, (g, c)) in upd.iter().zip(&cpu_upd).enumerate() {
        assert_eq!(g.value.bytes(), c.value.bytes(), "adam update {k}");
    }
}

/// The fused cross update's epilogue (`gemm_bf16t[_c]_128x128_ma`): y in bf16 alone and
/// in f32, z and its copy, on a ragged shape (edge tiles) and an odd N (scalar loads and
/// stores); the plan asserted to be the one `_ma` launch.
#[test]
fn sanitize_fused_cross_update() {
    let Some(dev) = device("sanitize_fused_cross_update") else {
        return;
    };
    let h = handle_with(PlanOptions {
        gemm_tile: Some(GemmTile { n: 128, ws: false }),
        gemm_pipe_min_flops: 0,
        gemm_pipe_min_mn: 16,
        ..dev.plan_options()
    });
    let op = Op::LinearMulAdd { bias: true };
    for (m, n, k) in [(200, 136, 256), (130, 67, 128)] {
        let ins = vec![
            arg(&[m, k], rand_bf16(46, m * k)),
            arg(&[n, k], rand_bf16(47, n * k)),
            arg(&[n], Buffer::F32(rand_f32(48, n, -1.0, 1.0))),
            arg(&[m, n], Buffer::F32(rand_f32(49, m * n, 0.1, 1.0))),
            arg(&[m, n], Buffer::F32(rand_f32(50, m * n, -1.0, -0.1))),
        ];
        for y_dtype in [DType::Bf16, DType::F32] {
            let outs: [(&[usize], DType); 3] = [
                (&[m, n], y_dtype),
                (&[m, n], DType::F32),
                (&[m, n], DType::Bf16),
            ];
            let shapes: Vec<erase::graph::Shape> = [&[m, k][..], &[n, k], &[n], &[m, n], &[m, n]]
                .iter()
                .map(|d| erase::graph::Shape::new(d))
                .collect();
            let y = erase::graph::Shape::new(&[m, n]);
            let plan = erase::ops::cuda::cuda_plan(
                &op,
                &erase::ops::cuda::Operands {
                    opts: h.plan_options(),
                    ins: &shapes.iter().collect::<Vec<_>>(),
                    in_dtypes: &[DType::Bf16, DType::Bf16, DType::F32, DType::F32, DType::F32],
                    outs: &[&y, &y, &y],
                    out_dtypes: &[y_dtype, DType::F32, DType::Bf16],
                    upd: &[],
                },
            )
            .expect("the fused update plans");
            let names: Vec<&str> = plan.calls.iter().map(|c| c.kernel).collect();
            assert!(names.iter().any(|k| k.ends_with("_ma")), "{names:?}");
            let g = run_gpu(&h, &op, &ins, &outs, &mut []);
            let c = run_cpu(&op, &ins, &outs, &mut []);
            for o in 0..3 {
                close(
                    &format!("{m}x{n}x{k}, y {y_dtype}: output {o}"),
                    &g[o],
                    &c[o],
                    2e-2,
                );
            }
        }
    }
}

/// A cross network stored in bf16 (`Graph::set_bf16_cross`): the `_s16` updates (stored
/// in bf16, in f32, in f32 with its copy) and the gradient reading x0's copy
/// (`ew_mul_grad_bf16_a16_b16`, with and without its column sums), on odd sizes (the
/// scalar tail) and a ragged [rows][cols] (a CTA's partial rows), bit for bit the CPU's.
#[test]
fn sanitize_cross_stored_in_bf16() {
    let Some(dev) = device("sanitize_cross_stored_in_bf16") else {
        return;
    };
    for (rows, cols) in [(3usize, 67usize), (37, 72)] {
        let n = rows * cols;
        let s: &[usize] = &[rows, cols];
        let ins = vec![
            arg(s, rand_bf16(61, n)),
            arg(s, rand_bf16(62, n)),
            arg(s, rand_bf16(63, n)),
        ];
        let b16 = DType::Bf16;
        let f32 = DType::F32;
        for outs in [vec![(s, b16)], vec![(s, f32)], vec![(s, f32), (s, b16)]] {
            let g = run_gpu(dev, &Op::MulAdd, &ins, &outs, &mut []);
            let c = run_cpu(&Op::MulAdd, &ins, &outs, &mut []);
            for (k, (gb, cb)) in g.iter().zip(&c).enumerate() {
                close(&format!("mul_add s16 {outs:?} output {k}"), gb, cb, 0.0);
            }
        }
        if cols % 8 != 0 {
            continue;
        }
        let gins = vec![
            arg(s, Buffer::F32(rand_f32(64, n, -1.0, 1.0))),
            arg(s, rand_bf16(65, n)),
            arg(s, rand_bf16(66, n)),
        ];
        // and with dy added to da (`_dy`)
        for plus_dy in [false, true] {
            let what = if plus_dy { " plus dy" } else { "" };
            let op = Op::MulGrad { plus_dy };
            for sums in [true, false] {
                let mut outs: Vec<(&[usize], DType)> = vec![(s, f32), (s, b16)];
                if sums {
                    outs.push((&s[1..], f32));
                }
                let g = run_gpu(dev, &op, &gins, &outs, &mut []);
                let c = run_cpu(&op, &gins, &outs, &mut []);
                for (k, (gb, cb)) in g.iter().zip(&c).enumerate() {
                    let tol = if k == 2 { 1e-5 } else { 0.0 };
                    close(
                        &format!("mul_grad a16 b16{what}, sums {sums}, output {k}"),
                        gb,
                        cb,
                        tol,
                    );
                }
            }
        }
    }
}
