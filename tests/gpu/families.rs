//! GPU tests of every op family's kernels but GEMM and attention (the plans of
//! ops/src/family/{elementwise,shape,reduce,norm,interaction,loss,optim,embedding}.rs, the
//! kernels of kernels-cuda/{elementwise,norm,reduce,interaction,loss,optim,embedding_bag}.cu)
//! against the CPU reference.
//!
//! Tolerances: maps the kernels compute with the reference's own f32 operations (no FMA
//! contraction: add, mul, scale, relu, casts, copies, grad_sum, the interaction, the
//! embedding lookup, Adam, SGD) must match bit for bit. Maps through expf/tanhf may differ
//! by a few ulps of the libm result (rtol 1e-5, plus a small atol where 1 + tanh cancels).
//! Reductions sum in a different (fixed) order than the reference's serial loop: the
//! reference's own rounding error grows like ε·L·|term| for a length-L sum, so those
//! tolerances scale with L (see `sum_atol`).

use super::{arg, assert_close, device, rand_f32, run_cpu, run_gpu, Arg};
use erase::graph::{DType, Op};
use erase::ops::Buffer;
use erase::runtime::cuda::CudaDevice;

const EXACT: (f64, f64) = (0.0, 0.0);
const F32: DType = DType::F32;

/// Absolute tolerance for an f32 sum of `len` terms of magnitude about `mag`, summed in
/// two different orders: 8·ε·len·mag, a few times the typical error of a serial sum.
fn sum_atol(len: usize, mag: f64) -> f64 {
    8.0 * f32::EPSILON as f64 * len.max(1) as f64 * mag
}

/// `n` values with magnitude in [0.05, 1) and either sign: never zero.
fn signed(seed: u64, n: usize) -> Vec<f32> {
    let m = rand_f32(seed, n, 0.05, 1.0);
    let s = rand_f32(seed ^ 0x5151, n, 0.0, 1.0);
    m.iter()
        .zip(s)
        .map(|(&m, s)| if s < 0.5 { -m } else { m })
        .collect()
}

fn f32_arg(shape: &[usize], v: Vec<f32>) -> Arg {
    arg(shape, Buffer::F32(v))
}

fn rand_arg(shape: &[usize], seed: u64) -> Arg {
    f32_arg(shape, signed(seed, shape.iter().product()))
}

fn dup(a: &Arg) -> Arg {
    arg(a.shape.dims(), a.value.clone())
}

/// `a`'s values rounded to bf16, as a bf16 tensor.
fn bf16_of(a: &Arg) -> Arg {
    arg(
        a.shape.dims(),
        Buffer::from_f64(DType::Bf16, &a.value.to_f64()),
    )
}

/// Runs `op` on both backends and compares every output with its (rtol, atol).
fn compare(
    dev: &CudaDevice,
    what: &str,
    op: &Op,
    ins: &[Arg],
    outs: &[(&[usize], DType)],
    tol: &[(f64, f64)],
) -> Vec<Buffer> {
    let g = run_gpu(dev, op, ins, outs, &mut []);
    let c = run_cpu(op, ins, outs, &mut []);
    for (k, (gb, cb)) in g.iter().zip(&c).enumerate() {
        let (rtol, atol) = tol[k.min(tol.len() - 1)];
        assert_close(
            &format!("{what} output {k}"),
            &gb.to_f64(),
            &cb.to_f64(),
            rtol,
            atol,
        );
    }
    g
}

fn bits(b: &Buffer) -> Vec<u8> {
    b.bytes().to_vec()
}

// ---- elementwise -----------------------------------------------------------------------------

#[test]
fn elementwise_maps_match_cpu() {
    let Some(dev) = device("elementwise_maps_match_cpu") else {
        return;
    };
    let mut seed = 1000;
    let mut next = || {
        seed += 1;
        seed
    };
    for n in [1usize, 7, 33, 1000, 4099, 300_001] {
        let shape = [n];
        let x = rand_arg(&shape, next());
        let y = rand_arg(&shape, next());
        let wide = f32_arg(&shape, rand_f32(next(), n, -4.0, 4.0)); // both signs, the activations' range
        let o: &[(&[usize], DType)] = &[(&shape, F32)];
        compare(
            dev,
            &format!("add [{n}]"),
            &Op::Add,
            &[dup(&x), dup(&y)],
            o,
            &[EXACT],
        );
        compare(
            dev,
            &format!("mul [{n}]"),
            &Op::Mul,
            &[dup(&x), dup(&y)],
            o,
            &[EXACT],
        );
        // the fused products: exact, as mul then add (no FMA); n = 1, 7, 33 and 4099
        // exercise the scalar tail after the float4 lanes
        let z = rand_arg(&shape, next());
        compare(
            dev,
            &format!("mul_add [{n}]"),
            &Op::MulAdd,
            &[dup(&x), dup(&y), dup(&z)],
            o,
            &[EXACT],
        );
        // with the bf16 copy a GEMM reads written beside the output (round to nearest
        // even, bit for bit the CPU's)
        let oc: &[(&[usize], DType)] = &[(&shape, F32), (&shape, DType::Bf16)];
        compare(
            dev,
            &format!("mul_add with its bf16 copy [{n}]"),
            &Op::MulAdd,
            &[dup(&x), dup(&y), dup(&z)],
            oc,
            &[EXACT],
        );
        // b stored in bf16 (a cross layer's up-projection, Graph::linear_stored_bf16),
        // read as its f32 values: bit for bit, with and without the copy
        compare(
            dev,
            &format!("mul_add of a bf16 b [{n}]"),
            &Op::MulAdd,
            &[dup(&x), bf16_of(&y), dup(&z)],
            o,
            &[EXACT],
        );
        compare(
            dev,
            &format!("mul_add of a bf16 b with its bf16 copy [{n}]"),
            &Op::MulAdd,
            &[dup(&x), bf16_of(&y), dup(&z)],
            oc,
            &[EXACT],
        );
        // a cross network stored in bf16 (Graph::set_bf16_cross): a, b and c bf16, the
        // update stored in bf16 (rounded to nearest even), or in f32 with or without its
        // copy: bit for bit (the `_s16` forms)
        let (xb, yb, zb) = (bf16_of(&x), bf16_of(&y), bf16_of(&z));
        let ob: &[(&[usize], DType)] = &[(&shape, DType::Bf16)];
        for (outs, what) in [
            (ob, "stored in bf16"),
            (o, "in f32"),
            (oc, "in f32 with its copy"),
        ] {
            compare(
                dev,
                &format!("mul_add of bf16 a, b, c {what} [{n}]"),
                &Op::MulAdd,
                &[dup(&xb), dup(&yb), dup(&zb)],
                outs,
                &[EXACT],
            );
        }
        compare(
            dev,
            &format!("mul with its bf16 copy [{n}]"),
            &Op::Mul,
            &[dup(&x), dup(&y)],
            oc,
            &[EXACT],
        );
        let o2: &[(&[usize], DType)] = &[(&shape, F32), (&shape, F32)];
        compare(
            dev,
            &format!("mul_grad [{n}]"),
            &Op::MulGrad { plus_dy: false },
            &[dup(&z), dup(&x), dup(&y)],
            o2,
            &[EXACT],
        );
        if n % 8 == 0 || n == 4099 {
            // db a copied linear layer's dy: its bf16 copy (bit for bit the CPU's) and
            // its column sums (a fixed order of its own) from the same pass, on
            // [rows][cols] with cols a multiple of 8; every row count's tail of a CTA's
            // 32·iters rows, with and without the sums
            for (rows, cols) in [(n / 8, 8), (3, 8 * n), (n.div_ceil(72), 72), (4096, 1728)] {
                if rows * cols > 8_000_000 && n != 4099 {
                    continue;
                }
                let sh = [rows, cols];
                let (d, a, b) = (
                    rand_arg(&sh, next()),
                    rand_arg(&sh, next()),
                    rand_arg(&sh, next()),
                );
                for (sums, b16, a16) in [
                    (true, false, false),
                    (false, false, false),
                    (true, true, false),
                    (false, true, false),
                    (true, true, true),
                    (false, true, true),
                ] {
                    let mut outs: Vec<(&[usize], DType)> = vec![(&sh, F32), (&sh, DType::Bf16)];
                    if sums {
                        outs.push((&sh[1..], F32));
                    }
                    // b16: b (the layer's output) stored in bf16 (`ew_mul_grad_bf16_b16`);
                    // a16: a too (x0's copy, `ew_mul_grad_bf16_a16_b16`)
                    let bb = if b16 { bf16_of(&b) } else { dup(&b) };
                    let ab = if a16 { bf16_of(&a) } else { dup(&a) };
                    compare(
                        dev,
                        &format!(
                            "mul_grad with db in bf16 [{rows}, {cols}], sums {sums}, b in bf16 {b16}, a in bf16 {a16}"
                        ),
                        &Op::MulGrad { plus_dy: false },
                        &[dup(&d), dup(&ab), dup(&bb)],
                        &outs,
                        &[EXACT, EXACT, (1e-6, sum_atol(rows, 1.0))],
                    );
                    if a16 {
                        // with dy added to da (`_a16_b16_dy`)
                        compare(
                            dev,
                            &format!("mul_grad plus dy [{rows}, {cols}], sums {sums}"),
                            &Op::MulGrad { plus_dy: true },
                            &[dup(&d), ab, bb],
                            &outs,
                            &[EXACT, EXACT, (1e-6, sum_atol(rows, 1.0))],
                        );
                    }
                }
            }
        }
        compare(
            dev,
            &format!("scale [{n}]"),
            &Op::Scale { factor: -0.3 },
            &[dup(&x)],
            o,
            &[EXACT],
        );
        compare(
            dev,
            &format!("relu [{n}]"),
            &Op::Relu,
            &[dup(&wide)],
            o,
            &[EXACT],
        );
        // expf/tanhf: a few ulps; gelu(x) for x near -4 is 1 + tanh cancelling (atol)
        compare(
            dev,
            &format!("gelu [{n}]"),
            &Op::Gelu,
            &[dup(&wide)],
            o,
            &[(1e-5, 1e-6)],
        );
        let sig = compare(
            dev,
            &format!("sigmoid [{n}]"),
            &Op::Sigmoid,
            &[dup(&wide)],
            o,
            &[(1e-5, 1e-7)],
        );
        // x · sigmoid(x): the sigmoid's few ulps, times x
        compare(
            dev,
            &format!("silu [{n}]"),
            &Op::Silu,
            &[dup(&wide)],
            o,
            &[(1e-5, 1e-7)],
        );
        compare(
            dev,
            &format!("silu_grad [{n}]"),
            &Op::SiluGrad,
            &[dup(&x), dup(&wide)],
            o,
            // 1 + x·(1 - s) cancels near x = -1.28 (atol, as gelu_grad)
            &[(1e-5, 1e-6)],
        );
        let relu_y = run_cpu(&Op::Relu, &[dup(&wide)], o, &mut []);
        compare(
            dev,
            &format!("relu_grad [{n}]"),
            &Op::ReluGrad,
            &[dup(&x), arg(&shape, relu_y[0].clone())],
            o,
            &[EXACT],
        );
        compare(
            dev,
            &format!("gelu_grad [{n}]"),
            &Op::GeluGrad,
            &[dup(&x), dup(&wide)],
            o,
            &[(1e-5, 1e-6)],
        );
        compare(
            dev,
            &format!("sigmoid_grad [{n}]"),
            &Op::SigmoidGrad,
            &[dup(&x), arg(&shape, sig[0].clone())],
            o,
            &[EXACT],
        );
        let s = rand_arg(&[], next());
        compare(
            dev,
            &format!("broadcast [{n}]"),
            &Op::Broadcast { scale: 0.125 },
            &[s],
            o,
            &[EXACT],
        );
        // casts: f32 -> bf16 rounds to nearest even, bf16 -> f32 and i32 <-> f32 exactly as Rust
        let b16 = compare(
            dev,
            &format!("cast bf16 [{n}]"),
            &Op::Cast { to: DType::Bf16 },
            &[dup(&wide)],
            &[(&shape, DType::Bf16)],
            &[EXACT],
        );
        compare(
            dev,
            &format!("cast bf16->f32 [{n}]"),
            &Op::Cast { to: F32 },
            &[arg(&shape, b16[0].clone())],
            o,
            &[EXACT],
        );
        compare(
            dev,
            &format!("cast f32->i32 [{n}]"),
            &Op::Cast { to: DType::I32 },
            &[dup(&wide)],
            &[(&shape, DType::I32)],
            &[EXACT],
        );
        let ints = Buffer::I32(
            rand_f32(next(), n, -70000.0, 70000.0)
                .iter()
                .map(|&v| v as i32)
                .collect(),
        );
        compare(
            dev,
            &format!("cast i32->f32 [{n}]"),
            &Op::Cast { to: F32 },
            &[arg(&shape, ints.clone())],
            o,
            &[EXACT],
        );
        compare(
            dev,
            &format!("cast i32->bf16 [{n}]"),
            &Op::Cast { to: DType::Bf16 },
            &[arg(&shape, ints)],
            &[(&shape, DType::Bf16)],
            &[EXACT],
        );
        // grad_sum: 1, 3, 8 (one launch) and 11, 16 inputs (chained launches), in input order
        for k in [1usize, 3, 8, 11, 16] {
            let parts: Vec<Arg> = (0..k).map(|_| rand_arg(&shape, next())).collect();
            compare(
                dev,
                &format!("grad_sum {k} x [{n}]"),
                &Op::GradSum,
                &parts,
                o,
                &[EXACT],
            );
        }
    }
    // suffix broadcasting, odd shapes
    for (a, b) in [
        (&[3usize, 5][..], &[5usize][..]),
        (&[2, 3, 7], &[3, 7]),
        (&[1000, 33], &[33]),
        (&[4099, 1], &[1]),
        (&[9, 1], &[9, 1]),
    ] {
        let (x, y) = (rand_arg(a, next()), rand_arg(b, next()));
        compare(
            dev,
            &format!("add {a:?}+{b:?}"),
            &Op::Add,
            &[dup(&x), dup(&y)],
            &[(a, F32)],
            &[EXACT],
        );
        compare(
            dev,
            &format!("mul {a:?}*{b:?}"),
            &Op::Mul,
            &[x, y],
            &[(a, F32)],
            &[EXACT],
        );
    }
    // the step counter: += 1 in device memory
    let mut step = [arg(&[], Buffer::I32(vec![41]))];
    run_gpu(dev, &Op::StepIncrement, &[], &[], &mut step);
    run_gpu(dev, &Op::StepIncrement, &[], &[], &mut step);
    assert_eq!(step[0].value, Buffer::I32(vec![43]));
}

#[test]
fn shape_ops_match_cpu() {
    let Some(dev) = device("shape_ops_match_cpu") else {
        return;
    };
    let mut seed = 2000;
    let mut next = || {
        seed += 1;
        seed
    };
    for dims in [[1usize, 1, 1], [3, 5, 7], [2, 33, 64], [7, 1, 129]] {
        for axis in 0..3 {
            // concat of three inputs of lengths 1, dims[axis], 2 along `axis`
            let lens = [1, dims[axis], 2];
            let ins: Vec<Arg> = lens
                .iter()
                .map(|&l| {
                    let mut s = dims;
                    s[axis] = l;
                    rand_arg(&s, next())
                })
                .collect();
            let mut out = dims;
            out[axis] = lens.iter().sum();
            compare(
                dev,
                &format!("concat {dims:?} axis {axis}"),
                &Op::Concat { axis },
                &ins,
                &[(&out, F32)],
                &[EXACT],
            );
            // slice of the middle and pad back
            let full = out[axis];
            let (start, len) = (1, full - 2);
            let x = rand_arg(&out, next());
            let mut sl = out;
            sl[axis] = len;
            compare(
                dev,
                &format!("slice {out:?} axis {axis}"),
                &Op::Slice { axis, start, len },
                &[x],
                &[(&sl, F32)],
                &[EXACT],
            );
            // the same window of a sum of 3 contributions
            let parts: Vec<Arg> = (0..3).map(|_| rand_arg(&out, next())).collect();
            compare(
                dev,
                &format!("slice_sum 3 x {out:?} axis {axis}"),
                &Op::SliceSum { axis, start, len },
                &parts,
                &[(&sl, F32)],
                &[EXACT],
            );
            let dy = rand_arg(&sl, next());
            compare(
                dev,
                &format!("pad {sl:?} axis {axis}"),
                &Op::Pad { axis, start, full },
                &[dy],
                &[(&out, F32)],
                &[EXACT],
            );
            // split back into the concat's parts
            let shapes: Vec<[usize; 3]> = lens
                .iter()
                .map(|&l| {
                    let mut s = dims;
                    s[axis] = l;
                    s
                })
                .collect();
            let outs: Vec<(&[usize], DType)> = shapes.iter().map(|s| (&s[..], F32)).collect();
            compare(
                dev,
                &format!("split {out:?} axis {axis}"),
                &Op::Split {
                    axis,
                    sizes: lens.to_vec(),
                },
                &[rand_arg(&out, next())],
                &outs,
                &[EXACT],
            );
        }
        // the CTR model's embedding gradient (float4 lanes): 26 of 27 fields from 5
        // contributions, and from 11 (two chained launches); the last field alone, and a
        // window that starts one field in (the scalar lanes: the odd shapes above)
        for (k, start, len) in [
            (5usize, 0usize, 26usize),
            (11, 0, 26),
            (5, 26, 1),
            (11, 1, 25),
        ] {
            let full = [dims[0] + 2, 27, 64];
            let parts: Vec<Arg> = (0..k).map(|_| rand_arg(&full, next())).collect();
            compare(
                dev,
                &format!("slice_sum {k} x {full:?} fields {start}+{len}"),
                &Op::SliceSum {
                    axis: 1,
                    start,
                    len,
                },
                &parts,
                &[(&[full[0], len, 64], F32)],
                &[EXACT],
            );
        }
        // with the bf16 copy of the output: E's shape (float4 rows, one fused pass) and
        // ragged rows (the concat, then a cast)
        for (lens, inner) in [(vec![26usize, 1], 64usize), (vec![3, 5], 3)] {
            let shapes: Vec<[usize; 3]> = lens.iter().map(|&l| [dims[0], l, inner]).collect();
            let ins: Vec<Arg> = shapes.iter().map(|s| rand_arg(s, next())).collect();
            let big = [dims[0], lens.iter().sum(), inner];
            compare(
                dev,
                &format!("concat {lens:?} x {inner} with its bf16 copy"),
                &Op::Concat { axis: 1 },
                &ins,
                &[(&big, F32), (&big, DType::Bf16)],
                &[EXACT],
            );
            if inner % 4 == 0 {
                // stored in bf16 alone (`ew_parts_rows_f32_to_bf16`, Graph::concat_stored)
                compare(
                    dev,
                    &format!("concat {lens:?} x {inner} stored in bf16"),
                    &Op::Concat { axis: 1 },
                    &ins,
                    &[(&big, DType::Bf16)],
                    &[EXACT],
                );
            }
        }
        // more parts than one launch takes (8): two launches, into one row and out of it
        let lens: Vec<usize> = (0..11).map(|i| 1 + i % 4).collect();
        let shapes: Vec<[usize; 2]> = lens.iter().map(|&l| [dims[0] * dims[1], l]).collect();
        let ins: Vec<Arg> = shapes.iter().map(|s| rand_arg(s, next())).collect();
        let big = [dims[0] * dims[1], lens.iter().sum()];
        compare(
            dev,
            "concat of 11",
            &Op::Concat { axis: 1 },
            &ins,
            &[(&big, F32)],
            &[EXACT],
        );
        let outs: Vec<(&[usize], DType)> = shapes.iter().map(|s| (&s[..], F32)).collect();
        compare(
            dev,
            "split into 11",
            &Op::Split {
                axis: 1,
                sizes: lens.clone(),
            },
            &[rand_arg(&big, next())],
            &outs,
            &[EXACT],
        );
        let n: usize = dims.iter().product();
        let x = rand_arg(&dims, next());
        compare(
            dev,
            "reshape",
            &Op::Reshape,
            &[dup(&x)],
            &[(&[n], F32)],
            &[EXACT],
        );
        compare(dev, "detach", &Op::Detach, &[x], &[(&dims, F32)], &[EXACT]);
        // bf16 values (made by the reference's cast) move as 16-bit words
        let h = run_cpu(
            &Op::Cast { to: DType::Bf16 },
            &[rand_arg(&dims, next())],
            &[(&dims, DType::Bf16)],
            &mut [],
        );
        compare(
            dev,
            "reshape bf16",
            &Op::Reshape,
            &[arg(&dims, h[0].clone())],
            &[(&[n], DType::Bf16)],
            &[EXACT],
        );
    }
}

// ---- layer norm and column reductions -----------------------------------------------------------

#[test]
fn layer_norm_matches_cpu() {
    let Some(dev) = device("layer_norm_matches_cpu") else {
        return;
    };
    let mut seed = 3000;
    let mut next = || {
        seed += 1;
        seed
    };
    for (rows, d) in [
        (1usize, 64usize),
        (7, 256),
        (300, 37),
        (4100, 64),
        (33, 1),
        (5, 1000),
        // lane groups: a row of 32 lanes (enough rows that the grid loops), three
        // lanes of a four-lane group, one lane a row
        (140_001, 128),
        (77, 12),
        (9, 4),
    ] {
        let xs = [rows, d];
        let x = rand_arg(&xs, next());
        let gamma = rand_arg(&[d], next());
        let beta = rand_arg(&[d], next());
        let outs: &[(&[usize], DType)] = &[(&xs, F32), (&[rows], F32), (&[rows], F32)];
        let op = Op::LayerNorm { eps: 1e-5 };
        // row statistics summed as a tree instead of serially: error ~ ε·d relative
        let row = (1e-5, sum_atol(d, 1.0));
        compare(
            dev,
            &format!("layer_norm [{rows},{d}]"),
            &op,
            &[dup(&x), dup(&gamma), dup(&beta)],
            outs,
            &[row],
        );
        let cpu = run_cpu(&op, &[dup(&x), dup(&gamma), beta], outs, &mut []);
        let dy = rand_arg(&xs, next());
        let ins = [
            dy,
            x,
            gamma,
            arg(&[rows], cpu[1].clone()),
            arg(&[rows], cpu[2].clone()),
        ];
        let gouts: &[(&[usize], DType)] = &[(&xs, F32), (&[d], F32), (&[d], F32)];
        // dx: row sums of d terms; dgamma/dbeta: column sums of `rows` terms of |xhat·dy| ≲ 2
        let tol = [
            (1e-4, sum_atol(d, 4.0)),
            (1e-5, sum_atol(rows, 2.0)),
            (1e-5, sum_atol(rows, 1.0)),
        ];
        compare(
            dev,
            &format!("layer_norm_grad [{rows},{d}]"),
            &Op::LayerNormGrad,
            &ins,
            gouts,
            &tol,
        );
        // dx a copied linear layer's dy: its bf16 copy (the rounding of the GPU's own dx,
        // bit for bit) and its column sums, from dx's pass (d ≤ 1536 outside the _v4
        // form) or a cast and a column sum after it
        let couts: &[(&[usize], DType)] = &[
            (&xs, F32),
            (&[d], F32),
            (&[d], F32),
            (&xs, DType::Bf16),
            (&[d], F32),
        ];
        let what = format!("layer_norm_grad with dx's copy [{rows},{d}]");
        let ins2: Vec<Arg> = ins.iter().map(dup).collect();
        let got = run_gpu(dev, &Op::LayerNormGrad, &ins2, couts, &mut []);
        let want = run_cpu(&Op::LayerNormGrad, &ins2, gouts, &mut []);
        for k in 0..3 {
            let (rtol, atol) = tol[k];
            let w = want[k].to_f64();
            assert_close(
                &format!("{what} output {k}"),
                &got[k].to_f64(),
                &w,
                rtol,
                atol,
            );
        }
        let dx: Vec<f32> = got[0].to_f64().iter().map(|&v| v as f32).collect();
        let copy = run_cpu(
            &Op::Cast { to: DType::Bf16 },
            &[f32_arg(&xs, dx.clone())],
            &[(&xs, DType::Bf16)],
            &mut [],
        );
        assert!(
            got[3].bytes() == copy[0].bytes(),
            "{what}: the copy is not dx rounded to bf16"
        );
        let mut sums = vec![0f64; d];
        for (j, &v) in dx.iter().enumerate() {
            sums[j % d] += v as f64;
        }
        assert_close(
            &format!("{what} column sums"),
            &got[4].to_f64(),
            &sums,
            1e-5,
            sum_atol(rows, 4.0),
        );
    }
}

#[test]
fn sum_to_shape_matches_cpu_and_is_deterministic() {
    let Some(dev) = device("sum_to_shape_matches_cpu_and_is_deterministic") else {
        return;
    };
    let mut seed = 4000;
    for (x, out) in [
        (&[1usize][..], &[1usize][..]),
        (&[7, 33], &[33]),
        (&[1000, 1], &[1]),
        (&[4099, 64], &[64]),
        (&[3, 5, 129], &[5, 129]),
        (&[65, 3000], &[3000]),
        (&[100_000, 3], &[3]),
    ] {
        seed += 1;
        let dy = rand_arg(x, seed);
        let rows = x.iter().product::<usize>() / out.iter().product::<usize>();
        let o: &[(&[usize], DType)] = &[(out, F32)];
        let a = compare(
            dev,
            &format!("sum_to_shape {x:?}->{out:?}"),
            &Op::SumToShape,
            &[dup(&dy)],
            o,
            &[(1e-5, sum_atol(rows, 1.0))],
        );
        let b = run_gpu(dev, &Op::SumToShape, &[dy], o, &mut []);
        assert_eq!(
            bits(&a[0]),
            bits(&b[0]),
            "sum_to_shape {x:?}: two runs differ"
        );
    }
}

// ---- interaction -------------------------------------------------------------------------------------

#[test]
fn pairwise_dot_matches_cpu() {
    let Some(dev) = device("pairwise_dot_matches_cpu") else {
        return;
    };
    let mut seed = 5000;
    // (B, F, D): the DLRM shape, odd ones, F = 1 (no pairs), one too big for shared memory
    // (100·131·4 bytes > 48 KB: the _gmem kernels), and F = 200 (2278 blocks of dots, more
    // than a CTA's threads: the forward's gmem kernel). F not a multiple of 3 (blocks of
    // dots past F), batches not a multiple of the examples a CTA stages (the last CTA's
    // slots past the batch), D = 33 (no float4: staged a float at a time), F = 40 and 50
    // (G of 40·40 and 50·52 entries)
    for (b, f, d) in [
        (1usize, 2usize, 1usize),
        (3, 27, 64),
        (5, 7, 33),
        (2, 1, 8),
        (2, 100, 130),
        (513, 27, 64),
        (4096, 27, 64),
        (5000, 7, 33),
        (3000, 40, 8),
        (700, 50, 16),
        (3, 200, 4),
        (4097, 26, 64),
    ] {
        seed += 2;
        let e = rand_arg(&[b, f, d], seed);
        let p = f * (f - 1) / 2;
        // the same products and sums in the same order as the reference: bit-identical
        compare(
            dev,
            &format!("pairwise_dot [{b},{f},{d}]"),
            &Op::PairwiseDot,
            &[dup(&e)],
            &[(&[b, p], F32)],
            &[EXACT],
        );
        let dy = rand_arg(&[b, p], seed + 1);
        compare(
            dev,
            &format!("pairwise_dot_grad [{b},{f},{d}]"),
            &Op::PairwiseDotGrad,
            &[dy, e],
            &[(&[b, f, d], F32)],
            &[EXACT],
        );
    }
}

// ---- losses ------------------------------------------------------------------------------------------

#[test]
fn losses_match_cpu_and_are_deterministic() {
    let Some(dev) = device("losses_match_cpu_and_are_deterministic") else {
        return;
    };
    let mut seed = 6000;
    let mut next = || {
        seed += 1;
        seed
    };
    let scalar: &[(&[usize], DType)] = &[(&[], F32)];
    // The scalars accumulate in f64 like the reference: only the f64 order differs, so
    // the f32 results agree to an ulp or so.
    let one_ulp = (3e-7, 1e-30);
    for n in [1usize, 7, 4096, 100_003] {
        let logit = f32_arg(&[n, 1], rand_f32(next(), n, -6.0, 6.0));
        let label = f32_arg(
            &[n],
            rand_f32(next(), n, 0.0, 1.0)
                .iter()
                .map(|&u| if u < 0.5 { 0.0 } else { 1.0 })
                .collect(),
        );
        let loss = compare(
            dev,
            &format!("bce [{n}]"),
            &Op::BceWithLogits,
            &[dup(&logit), dup(&label)],
            scalar,
            &[one_ulp],
        );
        let again = run_gpu(
            dev,
            &Op::BceWithLogits,
            &[dup(&logit), dup(&label)],
            scalar,
            &mut [],
        );
        assert_eq!(
            bits(&loss[0]),
            bits(&again[0]),
            "bce [{n}]: two runs differ"
        );
        let dl = rand_arg(&[], next());
        // sigmoid through expf: a few ulps; values ~ 1/n
        compare(
            dev,
            &format!("bce_grad [{n}]"),
            &Op::BceWithLogitsGrad,
            &[dl, logit, label],
            &[(&[n, 1], F32)],
            &[(1e-5, 1e-7 / n as f64)],
        );
        let x = rand_arg(&[n, 3], next());
        for op in [Op::Sum, Op::Mean] {
            let a = compare(
                dev,
                &format!("{} [{n}]", op.name()),
                &op,
                &[dup(&x)],
                scalar,
                &[one_ulp],
            );
            let b = run_gpu(dev, &op, &[dup(&x)], scalar, &mut []);
            assert_eq!(
                bits(&a[0]),
                bits(&b[0]),
                "{} [{n}]: two runs differ",
                op.name()
            );
        }
    }
    for (n, c) in [(1usize, 1usize), (7, 10), (300, 1000), (4096, 3), (33, 77)] {
        let logits = f32_arg(&[n, c], rand_f32(next(), n * c, -5.0, 5.0));
        let labels = Buffer::I32(
            rand_f32(next(), n, 0.0, c as f32)
                .iter()
                .map(|&v| (v as i32).min(c as i32 - 1))
                .collect(),
        );
        let ins = [dup(&logits), arg(&[n], labels.clone())];
        let a = compare(
            dev,
            &format!("softmax_xent [{n},{c}]"),
            &Op::SoftmaxCrossEntropy,
            &ins,
            scalar,
            &[one_ulp],
        );
        let b = run_gpu(dev, &Op::SoftmaxCrossEntropy, &ins, scalar, &mut []);
        assert_eq!(
            bits(&a[0]),
            bits(&b[0]),
            "softmax_xent [{n},{c}]: two runs differ"
        );
        let dl = rand_arg(&[], next());
        // the row's Σ exp in f32, tree vs serial: ε·c relative on p; values ~ 1/n
        let tol = (1e-5, sum_atol(c, 1.0) / n as f64);
        compare(
            dev,
            &format!("softmax_xent_grad [{n},{c}]"),
            &Op::SoftmaxCrossEntropyGrad,
            &[dl, logits, arg(&[n], labels)],
            &[(&[n, c], F32)],
            &[tol],
        );
    }
}

// ---- optimizers ----------------------------------------------------------------------------------------

#[test]
fn adam_and_sgd_over_many_tensors_match_cpu() {
    let Some(dev) = device("adam_and_sgd_over_many_tensors_match_cpu") else {
        return;
    };
    // 37 tensors of odd sizes: two table-builder launches (32 records each), one update
    let sizes = [
        1usize, 7, 33, 1000, 4099, 3, 1025, 1, 64, 257, 5000, 2, 31, 1023, 1024, 77, 9, 130, 4097,
        11, 5, 513, 19, 2049, 1, 6, 700, 8191, 3, 29, 1, 65, 17, 999, 4, 12_345, 2,
    ];
    let n = sizes.len();
    let op = Op::Adam {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
    };
    let mut upd_gpu: Vec<Arg> = Vec::new();
    for (i, &s) in sizes.iter().enumerate() {
        upd_gpu.push(rand_arg(&[s], 7000 + i as u64));
    }
    for &s in &sizes {
        upd_gpu.push(f32_arg(&[s], vec![0.0; s])); // m starts at zero, as the optimizer state does
    }
    for &s in &sizes {
        upd_gpu.push(f32_arg(&[s], vec![0.0; s]));
    }
    let mut upd_cpu: Vec<Arg> = upd_gpu.iter().map(dup).collect();
    let mut step_gpu = [arg(&[], Buffer::I32(vec![0]))];
    let mut step_cpu = [arg(&[], Buffer::I32(vec![0]))];
    for it in 0..3u64 {
        run_gpu(dev, &Op::StepIncrement, &[], &[], &mut step_gpu);
        run_cpu(&Op::StepIncrement, &[], &[], &mut step_cpu);
        assert_eq!(step_gpu[0].value, step_cpu[0].value);
        let mut ins = vec![dup(&step_gpu[0])];
        for (i, &s) in sizes.iter().enumerate() {
            ins.push(rand_arg(&[s], 7100 + 100 * it + i as u64));
        }
        run_gpu(dev, &op, &ins, &[], &mut upd_gpu);
        run_cpu(&op, &ins, &[], &mut upd_cpu);
        // f64 bias corrections from the device step, f32 update without contraction: exact
        for (k, (g, c)) in upd_gpu.iter().zip(&upd_cpu).enumerate() {
            let what = ["p", "m", "v"][k / n];
            assert_close(
                &format!("adam step {} {what}{}", it + 1, k % n),
                &g.value.to_f64(),
                &c.value.to_f64(),
                0.0,
                0.0,
            );
        }
    }
    // SGD over the same tensors
    let sgd = Op::Sgd { lr: 0.05 };
    let grads: Vec<Arg> = sizes
        .iter()
        .enumerate()
        .map(|(i, &s)| rand_arg(&[s], 7900 + i as u64))
        .collect();
    let mut pg: Vec<Arg> = upd_gpu[..n].iter().map(dup).collect();
    let mut pc: Vec<Arg> = upd_cpu[..n].iter().map(dup).collect();
    run_gpu(dev, &sgd, &grads, &[], &mut pg);
    run_cpu(&sgd, &grads, &[], &mut pc);
    for (k, (g, c)) in pg.iter().zip(&pc).enumerate() {
        assert_close(
            &format!("sgd p{k}"),
            &g.value.to_f64(),
            &c.value.to_f64(),
            0.0,
            0.0,
        );
    }
}

/// Adam's bf16 copies (`Leaf::ParamCopy`: the updates past the moments, one for each of
/// the first parameters): the updated parameter rounded to bf16, bit for bit as the CPU
/// makes it, over two table-builder launches, with the parameters past the copies left
/// without one and every copy poisoned before each step.
#[test]
fn adam_writes_the_parameters_bf16_copies_bit_for_bit() {
    let Some(dev) = device("adam_writes_the_parameters_bf16_copies_bit_for_bit") else {
        return;
    };
    let sizes = [
        4099usize, 1, 7, 1000, 33, 3, 1025, 64, 257, 5000, 2, 31, 1023, 1024, 77, 9, 130, 4097, 11,
        5, 513, 19, 2049, 1, 6, 700, 8191, 3, 29, 1, 65, 17, 999, 4, 12_345, 2,
    ];
    let (n, copies) = (sizes.len(), 34);
    let op = Op::Adam {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
    };
    let mut upd_gpu: Vec<Arg> = Vec::new();
    for (i, &s) in sizes.iter().enumerate() {
        upd_gpu.push(rand_arg(&[s], 8000 + i as u64));
    }
    for _ in 0..2 {
        for &s in &sizes {
            upd_gpu.push(f32_arg(&[s], vec![0.0; s]));
        }
    }
    for &s in &sizes[..copies] {
        upd_gpu.push(arg(&[s], Buffer::poison(DType::Bf16, s)));
    }
    let mut upd_cpu: Vec<Arg> = upd_gpu.iter().map(dup).collect();
    let mut step_gpu = [arg(&[], Buffer::I32(vec![0]))];
    let mut step_cpu = [arg(&[], Buffer::I32(vec![0]))];
    for it in 0..2u64 {
        run_gpu(dev, &Op::StepIncrement, &[], &[], &mut step_gpu);
        run_cpu(&Op::StepIncrement, &[], &[], &mut step_cpu);
        for (k, &s) in sizes[..copies].iter().enumerate() {
            upd_gpu[3 * n + k] = arg(&[s], Buffer::poison(DType::Bf16, s));
        }
        let mut ins = vec![dup(&step_gpu[0])];
        for (i, &s) in sizes.iter().enumerate() {
            ins.push(rand_arg(&[s], 8100 + 100 * it + i as u64));
        }
        run_gpu(dev, &op, &ins, &[], &mut upd_gpu);
        run_cpu(&op, &ins, &[], &mut upd_cpu);
        for (k, (g, c)) in upd_gpu.iter().zip(&upd_cpu).enumerate() {
            let what = ["p", "m", "v", "copy"][k / n];
            assert_eq!(
                g.value.bytes(),
                c.value.bytes(),
                "adam step {}: {what}{} differs from the CPU's",
                it + 1,
                k % n
            );
        }
        for k in 0..copies {
            let want = upd_cpu[k].value.to_bf16();
            assert_eq!(
                upd_gpu[3 * n + k].value.bytes(),
                want.bytes(),
                "copy {k} is not its parameter rounded"
            );
        }
    }
}

// ---- embedding bags ------------------------------------------------------------------------------------

/// Multi-hot bags: `batch` examples × the fields of `field_rows`, 0-4 ids a bag (empty
/// bags included), repeats within a bag, and (small tables) many repeats across bags.
/// `hot`: (field, id) put into every example's bag of that field.
fn bags(
    seed: u64,
    batch: usize,
    field_rows: &[usize],
    hot: Option<(usize, i32)>,
) -> (Vec<i32>, Vec<i32>) {
    let f = field_rows.len();
    let u = rand_f32(seed, batch * f * 8, 0.0, 1.0);
    let mut k = 0;
    let mut take = || {
        k += 1;
        u[k - 1]
    };
    let (mut ids, mut offsets) = (Vec::new(), vec![0i32]);
    for _b in 0..batch {
        for (fi, &rows) in field_rows.iter().enumerate() {
            let count = (take() * 5.0) as usize;
            for j in 0..count {
                let id = if j > 0 && take() < 0.3 {
                    *ids.last().unwrap() // a repeat within the bag
                } else {
                    ((take() * rows as f32) as i32).min(rows as i32 - 1)
                };
                ids.push(id);
            }
            if let Some((hf, hid)) = hot {
                if hf == fi {
                    ids.push(hid);
                }
            }
            offsets.push(ids.len() as i32);
        }
    }
    (ids, offsets)
}

#[test]
fn embedding_bag_and_dense_grad_match_cpu() {
    let Some(dev) = device("embedding_bag_and_dense_grad_match_cpu") else {
        return;
    };
    let mut seed = 8000;
    for (batch, field_rows, d, one_hot) in [
        (1usize, vec![5usize], 64usize, false),
        (7, vec![5, 1, 100, 37, 3000], 64, false),
        (64, vec![3, 1000, 17], 33, false),
        (33, vec![2, 9], 130, false),
        (4096, vec![10, 100_000, 1, 500, 26], 64, false),
        // one id a bag (the CTR model's case: the lookup takes a bag's id beside its
        // offsets), an odd count of bags
        (1023, vec![10, 100_000, 1, 500, 26], 64, true),
        // more bags than one wave of the lookup's CTAs takes (3 an SM, 64 bags each, on
        // 132 SMs: 25344): groups walk a second chunk, its indices loaded ahead
        (8192, vec![10, 100_000, 1, 500, 26], 64, true),
        (6000, vec![10, 100_000, 1, 500, 26], 64, false),
        // more fields than one launch's arguments carry: the meta-table kernel
        (5, (0..40).map(|i| 1 + (i * 7) % 23).collect(), 16, false),
        // float4 columns wider than a warp's (two column passes), and 2-lane groups
        (9, vec![7, 300], 256, false),
        (13, vec![4, 4, 4], 8, false),
    ] {
        seed += 10;
        let (ids, offsets) = if one_hot {
            let n = batch * field_rows.len();
            let u = rand_f32(seed, n, 0.0, 1.0);
            let ids = (0..n)
                .map(|i| {
                    let rows = field_rows[i % field_rows.len()];
                    ((u[i] * rows as f32) as i32).min(rows as i32 - 1)
                })
                .collect();
            (ids, (0..=n as i32).collect())
        } else {
            bags(seed, batch, &field_rows, None)
        };
        let total: usize = field_rows.iter().sum();
        let f = field_rows.len();
        let table = rand_arg(&[total, d], seed + 1);
        let (idsa, offa) = (
            arg(&[ids.len()], Buffer::I32(ids.clone())),
            arg(&[offsets.len()], Buffer::I32(offsets.clone())),
        );
        let op = Op::EmbeddingBag {
            field_rows: field_rows.clone(),
        };
        let what = format!(
            "embedding_bag B={batch} tables {field_rows:?} D={d} ({} ids)",
            ids.len()
        );
        // ids added in order, as the reference: bit-identical
        compare(
            dev,
            &what,
            &op,
            &[table, dup(&idsa), dup(&offa)],
            &[(&[batch, f, d], F32)],
            &[EXACT],
        );
        let dy = rand_arg(&[batch, f, d], seed + 2);
        let gop = Op::EmbeddingBagGradDense {
            field_rows: field_rows.clone(),
        };
        // a row's occurrences summed in chunks of 32 sorted positions: tolerance of a sum of
        // as many terms as the busiest row has occurrences
        let most = max_occurrences(&ids, &offsets, &field_rows);
        let out: &[(&[usize], DType)] = &[(&[total, d], F32)];
        let a = compare(
            dev,
            &format!("{what} grad_dense"),
            &gop,
            &[dup(&dy), dup(&idsa), dup(&offa)],
            out,
            &[(1e-5, sum_atol(most, 1.0))],
        );
        let b = run_gpu(dev, &gop, &[dy, idsa, offa], out, &mut []);
        assert_eq!(
            bits(&a[0]),
            bits(&b[0]),
            "{what} grad_dense: two runs differ"
        );
    }
}

/// The most occurrences of any one global row.
fn max_occurrences(ids: &[i32], offsets: &[i32], field_rows: &[usize]) -> usize {
    let f = field_rows.len();
    let mut bases = vec![0usize; f];
    for i in 1..f {
        bases[i] = bases[i - 1] + field_rows[i - 1];
    }
    let mut count = std::collections::HashMap::new();
    for bag in 0..offsets.len() - 1 {
        for &id in &ids[offsets[bag] as usize..offsets[bag + 1] as usize] {
            if id >= 0 {
                *count.entry(bases[bag % f] + id as usize).or_insert(0usize) += 1;
            }
        }
    }
    count.values().copied().max().unwrap_or(0)
}

#[test]
fn rowwise_adagrad_matches_cpu_with_a_hot_row() {
    let Some(dev) = device("rowwise_adagrad_matches_cpu_with_a_hot_row") else {
        return;
    };
    // (batch, tables, D, hot row): the hot (field 1, id 17) occurs once in every example,
    // 4096 times in all (a segment of 128 chunks: longer than any CTA)
    for (batch, field_rows, d, hot) in [
        (
            4096usize,
            vec![10usize, 4000, 7, 50_000],
            64usize,
            Some((1usize, 17i32)),
        ),
        (7, vec![5, 1, 100], 33, None),
        (300, vec![3, 20], 130, Some((0, 2))),
    ] {
        let seed = 9000 + batch as u64;
        let (ids, offsets) = bags(seed, batch, &field_rows, hot);
        let total: usize = field_rows.iter().sum();
        let f = field_rows.len();
        let op = Op::RowwiseAdagrad {
            lr: 0.05,
            eps: 1e-8,
            field_rows: field_rows.clone(),
        };
        let ins = [
            arg(&[ids.len()], Buffer::I32(ids.clone())),
            arg(&[offsets.len()], Buffer::I32(offsets.clone())),
            rand_arg(&[batch, f, d], seed + 1),
        ];
        let table0 = rand_arg(&[total, d], seed + 2);
        let acc0 = f32_arg(&[total], rand_f32(seed + 3, total, 0.01, 1.0));
        let mut ug = [dup(&table0), dup(&acc0)];
        let mut uc = [dup(&table0), dup(&acc0)];
        let mut ug2 = [dup(&table0), dup(&acc0)];
        run_gpu(dev, &op, &ins, &[], &mut ug);
        run_gpu(dev, &op, &ins, &[], &mut ug2);
        run_cpu(&op, &ins, &[], &mut uc);
        let what = format!(
            "rowwise_adagrad B={batch} tables {field_rows:?} D={d} ({} ids)",
            ids.len()
        );
        // the sort as a node of its own: the CPU's (row, bag) pairs exactly, and the
        // update from them the same bits as the update that sorts for itself
        let n = [ids.len()];
        let sorted = compare(
            dev,
            &format!("{what} embedding_sort"),
            &Op::EmbeddingSort {
                field_rows: field_rows.clone(),
            },
            &[dup(&ins[0]), dup(&ins[1])],
            &[(&n, DType::I32), (&n, DType::I32)],
            &[EXACT, EXACT],
        );
        let mut ins5: Vec<Arg> = ins.iter().map(dup).collect();
        ins5.extend(sorted.into_iter().map(|b| arg(&n, b)));
        let mut up = [dup(&table0), dup(&acc0)];
        run_gpu(dev, &op, &ins5, &[], &mut up);
        assert_eq!(
            bits(&up[0].value),
            bits(&ug[0].value),
            "{what}: presorted update differs (table)"
        );
        assert_eq!(
            bits(&up[1].value),
            bits(&ug[1].value),
            "{what}: presorted update differs (acc)"
        );
        assert_eq!(
            bits(&ug[0].value),
            bits(&ug2[0].value),
            "{what}: two runs differ (table)"
        );
        assert_eq!(
            bits(&ug[1].value),
            bits(&ug2[1].value),
            "{what}: two runs differ (acc)"
        );
        // g summed in another order (chunks of 32): relative ε·occurrences on g, hence on
        // mean(g²) and the step; the step is lr·g/sqrt(acc) ≲ lr·sqrt(d)
        let most = max_occurrences(&ids, &offsets, &field_rows);
        let step_tol = sum_atol(most, 1.0) * 0.05 * (d as f64).sqrt();
        assert_close(
            &format!("{what} table"),
            &ug[0].value.to_f64(),
            &uc[0].value.to_f64(),
            1e-6,
            step_tol,
        );
        assert_close(
            &format!("{what} acc"),
            &ug[1].value.to_f64(),
            &uc[1].value.to_f64(),
            1e-5 + sum_atol(most, 2.0),
            0.0,
        );
        // only touched rows move: untouched rows keep their exact bits
        let t0 = table0.value.as_f32().unwrap();
        let tg = ug[0].value.as_f32().unwrap();
        let mut touched = vec![false; total];
        let mut bases = vec![0usize; f];
        for i in 1..f {
            bases[i] = bases[i - 1] + field_rows[i - 1];
        }
        for bag in 0..offsets.len() - 1 {
            for &id in &ids[offsets[bag] as usize..offsets[bag + 1] as usize] {
                touched[bases[bag % f] + id as usize] = true;
            }
        }
        for r in (0..total).filter(|&r| !touched[r]) {
            assert_eq!(
                &tg[r * d..(r + 1) * d],
                &t0[r * d..(r + 1) * d],
                "{what}: untouched row {r} moved"
            );
        }
    }
}

/// Bags of fixed per-field slots, the unused ones padding (-1), as the trainer feeds
/// variable-length multi-hot fields: `slots[f]` slots for field f, 0..=slots ids used.
fn padded_bags(
    seed: u64,
    batch: usize,
    field_rows: &[usize],
    slots: &[usize],
) -> (Vec<i32>, Vec<i32>) {
    let per: usize = slots.iter().sum();
    let u = rand_f32(seed, batch * per * 2 + batch * slots.len(), 0.0, 1.0);
    let mut k = 0;
    let mut take = || {
        k += 1;
        u[k - 1]
    };
    let (mut ids, mut offsets) = (Vec::new(), vec![0i32]);
    for _ in 0..batch {
        for (f, &h) in slots.iter().enumerate() {
            let used = ((take() * (h + 1) as f32) as usize).min(h);
            for j in 0..h {
                ids.push(if j < used {
                    ((take() * field_rows[f] as f32) as i32).min(field_rows[f] as i32 - 1)
                } else {
                    -1
                });
            }
            offsets.push(ids.len() as i32);
        }
    }
    (ids, offsets)
}

#[test]
fn padded_multi_hot_bags_and_bag_mean_match_cpu() {
    let Some(dev) = device("padded_multi_hot_bags_and_bag_mean_match_cpu") else {
        return;
    };
    // (batch, tables of mixed sizes, slots per field, D, mean fields)
    for (batch, field_rows, slots, d, mean) in [
        (
            64usize,
            vec![3usize, 1000, 100_000],
            vec![1usize, 1, 5],
            16usize,
            vec![false, false, true],
        ),
        (
            4096,
            vec![3, 1000, 100_000, 17],
            vec![1, 4, 1, 7],
            64,
            vec![false, true, false, true],
        ),
        (7, vec![5, 9], vec![3, 2], 130, vec![true, true]),
    ] {
        let seed = 12_000 + batch as u64;
        let (ids, offsets) = padded_bags(seed, batch, &field_rows, &slots);
        let f = field_rows.len();
        let total: usize = field_rows.iter().sum();
        let what = format!("padded bags B={batch} tables {field_rows:?} slots {slots:?} D={d}");
        let (idsa, offa) = (
            arg(&[ids.len()], Buffer::I32(ids.clone())),
            arg(&[offsets.len()], Buffer::I32(offsets.clone())),
        );
        let table = rand_arg(&[total, d], seed + 1);
        let op = Op::EmbeddingBag {
            field_rows: field_rows.clone(),
        };
        // padding adds nothing and the rest is summed in order: bit-identical
        let pooled = compare(
            dev,
            &format!("{what} embedding_bag"),
            &op,
            &[table, dup(&idsa), dup(&offa)],
            &[(&[batch, f, d], F32)],
            &[EXACT],
        );
        // the mean: 1/n rounded once and multiplied, as the reference: bit-identical, and
        // its own gradient
        let mop = Op::BagMean { mean: mean.clone() };
        let y = arg(&[batch, f, d], pooled[0].clone());
        compare(
            dev,
            &format!("{what} bag_mean"),
            &mop,
            &[y, dup(&idsa), dup(&offa)],
            &[(&[batch, f, d], F32)],
            &[EXACT],
        );
        let dz = rand_arg(&[batch, f, d], seed + 2);
        compare(
            dev,
            &format!("{what} bag_mean (gradient)"),
            &mop,
            &[dz, dup(&idsa), dup(&offa)],
            &[(&[batch, f, d], F32)],
            &[EXACT],
        );
        // the backward: padding sorts last under the sentinel row and moves no row
        let n = [ids.len()];
        compare(
            dev,
            &format!("{what} embedding_sort"),
            &Op::EmbeddingSort {
                field_rows: field_rows.clone(),
            },
            &[dup(&idsa), dup(&offa)],
            &[(&n, DType::I32), (&n, DType::I32)],
            &[EXACT, EXACT],
        );
        let dy = rand_arg(&[batch, f, d], seed + 3);
        let most = max_occurrences(&ids, &offsets, &field_rows);
        compare(
            dev,
            &format!("{what} grad_dense"),
            &Op::EmbeddingBagGradDense {
                field_rows: field_rows.clone(),
            },
            &[dup(&dy), dup(&idsa), dup(&offa)],
            &[(&[total, d], F32)],
            &[(1e-5, sum_atol(most, 1.0))],
        );
        let aop = Op::RowwiseAdagrad {
            lr: 0.05,
            eps: 1e-8,
            field_rows: field_rows.clone(),
        };
        let ins = [dup(&idsa), dup(&offa), dy];
        let table0 = rand_arg(&[total, d], seed + 4);
        let acc0 = f32_arg(&[total], rand_f32(seed + 5, total, 0.01, 1.0));
        let mut ug = [dup(&table0), dup(&acc0)];
        let mut uc = [dup(&table0), dup(&acc0)];
        run_gpu(dev, &aop, &ins, &[], &mut ug);
        run_cpu(&aop, &ins, &[], &mut uc);
        let step_tol = sum_atol(most, 1.0) * 0.05 * (d as f64).sqrt();
        assert_close(
            &format!("{what} adagrad table"),
            &ug[0].value.to_f64(),
            &uc[0].value.to_f64(),
            1e-6,
            step_tol,
        );
        assert_close(
            &format!("{what} adagrad acc"),
            &ug[1].value.to_f64(),
            &uc[1].value.to_f64(),
            1e-5 + sum_atol(most, 2.0),
            0.0,
        );
    }
}

// ---- timings (not a check: `gpu families::timings --ignored --nocapture`) -----------------------
