//! Tests of the GEMM and attention plans: the paths each shape takes, split-K, the tall
//! kernels, bf16 operands, and that every plan names a listed kernel (the pipelined GEMMs
//! on their cp.async kernels).

use super::gemm::*;
use super::*;
use erase_graph::{DType, Op, Shape};

/// The H200's options with the pipelined GEMMs on their cp.async kernels, whose argument
/// lists these tests read (the TMA kernels' plans are tests/cuda_plans.rs's).
const CP_ASYNC: PlanOptions = PlanOptions {
    gemm_tma: false,
    ..PlanOptions::H200
};

fn plan_of(op: &Op, ins: &[&[usize]], outs: &[&[usize]]) -> Result<CudaPlan, String> {
    plan_of_with(CP_ASYNC, op, ins, outs)
}

fn plan_of_with(
    opts: PlanOptions,
    op: &Op,
    ins: &[&[usize]],
    outs: &[&[usize]],
) -> Result<CudaPlan, String> {
    let ins: Vec<Shape> = ins.iter().map(|d| Shape::new(d)).collect();
    let outs: Vec<Shape> = outs.iter().map(|d| Shape::new(d)).collect();
    let (ir, or): (Vec<&Shape>, Vec<&Shape>) = (ins.iter().collect(), outs.iter().collect());
    let (idt, odt) = (vec![DType::F32; ir.len()], vec![DType::F32; or.len()]);
    let o = Operands {
        opts,
        ins: &ir,
        in_dtypes: &idt,
        outs: &or,
        out_dtypes: &odt,
        upd: &[],
    };
    super::cuda_plan(op, &o)
}

fn attention_grad_plan(s: usize) -> Result<CudaPlan, String> {
    let x: &[usize] = &[1, s, 64];
    let op = Op::AttentionGrad {
        heads: 1,
        causal: false,
        packed: false,
    };
    plan_of(&op, &[x, x, x, x, x, &[1, 1, s]], &[x, x, x])
}

#[test]
fn long_attention_stages_its_operands_to_bf16_once() {
    // S = 65 is past one 64-row tile: the staged kernels, 128 rows a CTA
    let fwd = plan_of(
        &Op::Attention {
            heads: 2,
            causal: true,
            packed: true,
        },
        &[&[3, 65, 192]],
        &[&[3, 65, 64], &[3, 2, 65]],
    )
    .expect("plan");
    let names: Vec<_> = fwd.calls.iter().map(|c| c.kernel).collect();
    assert_eq!(names, ["attn_stage_bf16", "attn_fwd_st_d32"]);
    assert_eq!(fwd.calls[0].grid[1], 3, "q, k and v");
    assert_eq!(fwd.calls[1].grid, [1, 2, 3]);
    assert_eq!(fwd.scratch, vec![3 * 2 * 65 * 32 * 2; 3]);
    // packed: the stage reads rows 3·H·Dh floats apart
    assert!(fwd.calls[0].args.contains(&KArg::I32(192)));

    let grad = attention_grad_plan(300).expect("plan");
    let names: Vec<_> = grad.calls.iter().map(|c| c.kernel).collect();
    assert_eq!(
        names,
        [
            "attn_stage_bf16",
            "attn_bwd_dkdv_st_d64",
            "attn_bwd_dq_st_d64"
        ]
    );
    assert_eq!(grad.calls[0].grid[1], 4, "q, k, v and do");
    assert_eq!(grad.calls[1].grid, [3, 1, 1]);
    let copy = 300 * 64 * 2;
    assert_eq!(grad.scratch, vec![300 * 4, 300 * 4, copy, copy, copy, copy]);
    // S = 64 stays on the one-tile kernels
    let short = attention_grad_plan(64).expect("plan");
    assert_eq!(short.calls.len(), 1);
}

#[test]
fn every_plan_names_a_listed_kernel() {
    let plans = [
        plan_of(
            &Op::Linear {
                bias: true,
                relu: false,
            },
            &[&[4096, 27, 13], &[64, 13], &[64]],
            &[&[4096, 27, 64]],
        ),
        plan_of(
            &Op::LinearGradWeight { bias: false },
            &[&[110_592, 1], &[110_592, 351]],
            &[&[1, 351]],
        ),
        plan_of(
            &Op::MatMul { ta: true, tb: true },
            &[&[3, 5, 7], &[3, 9, 5]],
            &[&[3, 7, 9]],
        ),
        plan_of(
            &Op::Attention {
                heads: 2,
                causal: true,
                packed: false,
            },
            &[&[3, 27, 64], &[3, 27, 64], &[3, 27, 64]],
            &[&[3, 27, 64], &[3, 2, 27]],
        ),
        attention_grad_plan(27),
        attention_grad_plan(100),
        plan_of(
            &Op::Attention {
                heads: 2,
                causal: false,
                packed: true,
            },
            &[&[3, 100, 192]],
            &[&[3, 100, 64], &[3, 2, 100]],
        ),
    ];
    for p in plans {
        let p = p.expect("plan");
        for c in &p.calls {
            assert!(
                kernel_names().contains(&c.kernel),
                "{} is not listed",
                c.kernel
            );
        }
    }
}

#[test]
fn long_reductions_split_k_in_a_fixed_number_of_parts() {
    // (two output rows: one row is the thin kernels', below)
    let p = plan_of(
        &Op::LinearGradWeight { bias: false },
        &[&[110_592, 2], &[110_592, 351]],
        &[&[2, 351]],
    )
    .unwrap();
    assert_eq!(p.calls.len(), 2);
    assert_eq!(p.calls[1].kernel, "gemm_splitk_reduce");
    let KArg::I32(splits) = p.calls[1].args[5] else {
        panic!("splits")
    };
    assert!(splits > 1);
    assert_eq!(p.scratch, vec![splits as usize * 2 * 351 * 4]);
    assert_eq!(p.calls[0].grid[2], splits as u32);
    // one output row: the thin kernel's splits of rows, summed by the same reduction
    let p = plan_of(
        &Op::LinearGradWeight { bias: false },
        &[&[110_592, 1], &[110_592, 351]],
        &[&[1, 351]],
    )
    .unwrap();
    let names: Vec<_> = p.calls.iter().map(|c| c.kernel).collect();
    assert_eq!(names, ["gemm_thin_m1", "gemm_splitk_reduce"]);
    let KArg::I32(splits) = p.calls[1].args[5] else {
        panic!("splits")
    };
    assert_eq!(p.calls[0].grid[1], splits as u32);
    assert_eq!(p.scratch, vec![splits as usize * 351 * 4]);
    // a square GEMM that fills the GPU needs no split
    let p = plan_of(
        &Op::Linear {
            bias: false,
            relu: false,
        },
        &[&[4096, 1024], &[1024, 1024]],
        &[&[4096, 1024]],
    )
    .unwrap();
    assert_eq!(p.calls.len(), 2);
    assert!(p.calls[1].kernel.starts_with("gemm_bf16p_"));
    assert_eq!(p.calls[1].grid[2], 1);
    // a GEMM under the pipelined path's FLOPs stays one launch (2^29 by default: this
    // one's 1.6 GFLOP takes the pipelined path, and stays on one launch under 2^31)
    let (op, ins, outs): (_, [&[usize]; 2], [&[usize]; 1]) = (
        Op::Linear {
            bias: false,
            relu: false,
        },
        [&[4096, 192], &[1024, 192]],
        [&[4096, 1024]],
    );
    let p = plan_of(&op, &ins, &outs).unwrap();
    assert_eq!(kernels(&p)[1], "gemm_bf16p_128x128", "{:?}", kernels(&p));
    let bound_2_31 = PlanOptions {
        gemm_pipe_min_flops: 1 << 31,
        ..CP_ASYNC
    };
    let p = plan_of_with(bound_2_31, &op, &ins, &outs).unwrap();
    assert_eq!(p.calls.len(), 1);
    assert_eq!(p.calls[0].kernel, "gemm_bf16_nt_128x128");
    // the CTR model's mid-size layers (4096 x 256, K = 351 or 512) are over the bound
    for k in [351, 512] {
        let p = plan_of(&op, &[&[4096, k], &[256, k]], &[&[4096, 256]]).unwrap();
        assert_eq!(
            kernels(&p)[0],
            "gemm_to_bf16_pair",
            "{k}: {:?}",
            kernels(&p)
        );
    }
    // a weight gradient of few output tiles splits its rows in parts of 64: 4096 rows
    // of a [2, 256] dw in 64 splits (in parts of 256 beside more tiles: 16; one output row
    // is the thin kernels')
    let dw = Op::LinearGradWeight { bias: false };
    let (ins, outs): ([&[usize]; 2], [&[usize]; 1]) = ([&[4096, 2], &[4096, 256]], [&[2, 256]]);
    for (few, splits) in [(CP_ASYNC.gemm_min_k_per_split_few, 64), (256, 16)] {
        let opts = PlanOptions {
            gemm_min_k_per_split_few: few,
            ..CP_ASYNC
        };
        let p = plan_of_with(opts, &dw, &ins, &outs).unwrap();
        assert_eq!(p.calls[0].grid[2], splits, "{few}: {:?}", p.calls[0].grid);
    }
    // with K of at most 128 (a few k steps) on the 64x64 tile, where it is one launch
    let p = plan_of_with(
        bound_2_31,
        &Op::Linear {
            bias: false,
            relu: false,
        },
        &[&[4096, 128], &[1024, 128]],
        &[&[4096, 1024]],
    )
    .unwrap();
    assert_eq!(p.calls[0].kernel, "gemm_bf16_nt_64x64");
}

#[test]
fn tall_gemms_take_the_persistent_kernels() {
    // AutoInt's QKV projection over 4096 x 27 rows: one launch of the N <= 192
    // kernel, two CTAs an SM, shared memory for two f32 blocks of A and bf16 op(B)
    let p = plan_of(
        &Op::Linear {
            bias: true,
            relu: false,
        },
        &[&[4096, 27, 64], &[192, 64], &[192]],
        &[&[4096, 27, 192]],
    )
    .unwrap();
    assert_eq!(p.calls.len(), 1);
    let c = &p.calls[0];
    assert_eq!(c.kernel, "gemm_tall_n192_c");
    assert_eq!(c.grid, [2 * CP_ASYNC.sms as u32, 1, 1]);
    assert_eq!(
        c.smem as usize,
        2 * 64 * 72 * 4 + 192 * 72 * 2 + TALL_STAGE_SMEM + 192 * 4
    );
    // its output projection's data gradient: three CTAs an SM; the QKV projection's
    // (K = 192) would leave room for one, so it takes the general kernels
    let p = plan_of(
        &Op::LinearGradInput {
            relu_mask: false,
            residual: false,
        },
        &[&[110_592, 64], &[64, 64]],
        &[&[110_592, 64]],
    )
    .unwrap();
    assert_eq!(p.calls[0].kernel, "gemm_tall_n64_c");
    assert_eq!(p.calls[0].grid, [3 * CP_ASYNC.sms as u32, 1, 1]);
    let p = plan_of(
        &Op::LinearGradInput {
            relu_mask: false,
            residual: false,
        },
        &[&[110_592, 192], &[192, 64]],
        &[&[110_592, 64]],
    )
    .unwrap();
    assert!(!p.calls[0].kernel.starts_with("gemm_tall"));
    // 4096 rows are too few, and a weight gradient (transposed A) is not tall
    let p = plan_of(
        &Op::Linear {
            bias: false,
            relu: false,
        },
        &[&[4096, 64], &[192, 64]],
        &[&[4096, 192]],
    )
    .unwrap();
    assert!(!p.calls[0].kernel.starts_with("gemm_tall"));
    let p = plan_of(
        &Op::LinearGradWeight { bias: false },
        &[&[110_592, 192], &[110_592, 64]],
        &[&[192, 64]],
    )
    .unwrap();
    assert!(p.calls.iter().all(|c| !c.kernel.starts_with("gemm_tall")));
}

/// LinearAdd: the tall kernel adds the residual as it stores (flag 16, the residual
/// its last argument); a GEMM on any other path writes to scratch and an add launch
/// sums it with the residual into the output.
#[test]
fn a_residual_is_added_by_the_tall_store_or_a_launch_after() {
    let op = Op::LinearAdd { bias: true };
    let p = plan_of(
        &op,
        &[&[4096, 27, 64], &[64, 64], &[64], &[4096, 27, 64]],
        &[&[4096, 27, 64]],
    )
    .unwrap();
    assert_eq!(p.calls.len(), 1);
    let c = &p.calls[0];
    assert_eq!(c.kernel, "gemm_tall_n64_c");
    assert_eq!(c.args[11], KArg::I32(1 | 16));
    assert_eq!(c.args[12], KArg::In(3));
    assert_eq!(c.args[2], KArg::Out(0));
    let p = plan_of(
        &op,
        &[&[300, 64], &[64, 64], &[64], &[300, 64]],
        &[&[300, 64]],
    )
    .unwrap();
    let last = p.calls.last().unwrap();
    assert_eq!(last.kernel, "ew_add");
    assert_eq!(
        last.args[..3],
        [KArg::Scratch(0), KArg::In(3), KArg::Out(0)]
    );
    assert_eq!(p.scratch, [300 * 64 * 4]);
    assert!(p.calls[..p.calls.len() - 1]
        .iter()
        .all(|c| !c.args.contains(&KArg::Out(0))));
    // a residual of another shape is refused
    let e = plan_of(
        &op,
        &[&[300, 64], &[64, 64], &[64], &[300, 32]],
        &[&[300, 64]],
    )
    .unwrap_err();
    assert!(e.contains("residual"), "{e}");
}

/// LinearGradInput with a residual (x's gradient summed with its other contribution): the
/// pipelined kernel reads it through `bias` and adds it in its epilogue (flag 16), C
/// written whole by that one launch; with split-K partials, a mask, or the single-launch
/// kernels, an add launch after the GEMM sums it from scratch.
#[test]
fn a_data_gradients_residual_is_added_by_the_pipelined_epilogue_or_a_launch_after() {
    let op = Op::LinearGradInput {
        relu_mask: false,
        residual: true,
    };
    // DCNv2's cross layer: dx [4096, 3456] from du [4096, 512]
    let shapes: [&[usize]; 3] = [&[4096, 512], &[512, 3456], &[4096, 3456]];
    let p = plan_of(&op, &shapes, &[&[4096, 3456]]).unwrap();
    let gemm = p
        .calls
        .iter()
        .find(|c| c.kernel.starts_with("gemm_bf16p"))
        .expect("a pipelined GEMM");
    assert_eq!(gemm.args[2], KArg::Out(0));
    assert_eq!(gemm.args[3], KArg::In(2), "the residual through `bias`");
    assert_eq!(gemm.args[16], KArg::I32(16));
    assert!(
        p.calls.iter().all(|c| c.kernel != "ew_add"),
        "{:?}",
        p.calls
    );
    // without clusters the split GEMM writes partials: the residual after the reduction
    let opts = PlanOptions {
        gemm_cluster: false,
        ..CP_ASYNC
    };
    let p = plan_of_with(
        opts,
        &op,
        &[&[4096, 4096], &[4096, 256], &[4096, 256]],
        &[&[4096, 256]],
    )
    .unwrap();
    assert!(p.calls.iter().any(|c| c.kernel == "gemm_splitk_reduce"));
    let last = p.calls.last().unwrap();
    assert_eq!(last.kernel, "ew_add");
    assert_eq!(last.args[1..3], [KArg::In(2), KArg::Out(0)]);
    assert!(p
        .calls
        .iter()
        .all(|c| c.kernel == "ew_add" || !c.args.contains(&KArg::In(2))));
    // with a mask, and on the single-launch kernels: an add launch
    let masked = Op::LinearGradInput {
        relu_mask: true,
        residual: true,
    };
    let p = plan_of(
        &masked,
        &[&[4096, 512], &[512, 3456], &[4096, 3456], &[4096, 3456]],
        &[&[4096, 3456]],
    )
    .unwrap();
    let last = p.calls.last().unwrap();
    assert_eq!(last.kernel, "ew_add");
    assert_eq!(last.args[1..3], [KArg::In(3), KArg::Out(0)]);
    let p = plan_of(&op, &[&[300, 64], &[64, 32], &[300, 32]], &[&[300, 32]]).unwrap();
    assert_eq!(p.calls.last().unwrap().kernel, "ew_add");
    assert_eq!(p.calls.len(), 2);
    // a residual of another shape is refused
    let e = plan_of(&op, &[&[300, 64], &[64, 32], &[300, 16]], &[&[300, 32]]).unwrap_err();
    assert!(e.contains("residual"), "{e}");
}

/// AutoInt's dqkv in bf16: its attention gradient writes it with the `_bo` kernels
/// (pointers 2 bytes an element apart), the QKV data gradient reads it in the tall
/// kernel (K = 192 now fits two CTAs an SM), the weight gradient in the single-launch
/// kernel that sums the bias gradient; a long sequence's gradient is cast from f32.
#[test]
fn a_bf16_dqkv_is_written_and_read_in_bf16() {
    const F: DType = DType::F32;
    const B: DType = DType::Bf16;
    let op = Op::AttentionGrad {
        heads: 2,
        causal: false,
        packed: true,
    };
    let (x, qkv, lse): (&[usize], &[usize], &[usize]) =
        (&[4096, 27, 64], &[4096, 27, 192], &[4096, 2, 27]);
    let p = plan_typed(&op, &[(x, F), (qkv, F), (x, F), (lse, F)], &[(qkv, B)]).unwrap();
    assert_eq!(p.calls.len(), 1);
    let c = &p.calls[0];
    assert_eq!(c.kernel, "attn_bwd_tiny_packed_bo_d32");
    assert_eq!(
        c.args[6..9],
        [KArg::Out(0), KArg::OutAt(0, 128), KArg::OutAt(0, 256)]
    );
    // S = 100: the staged kernels into f32 scratch, then one cast into dqkv
    let (x, qkv, lse): (&[usize], &[usize], &[usize]) =
        (&[2, 100, 128], &[2, 100, 384], &[2, 2, 100]);
    let p = plan_typed(&op, &[(x, F), (qkv, F), (x, F), (lse, F)], &[(qkv, B)]).unwrap();
    let last = p.calls.last().unwrap();
    assert_eq!(last.kernel, "ew_cast");
    assert_eq!(last.args[..2], [KArg::Scratch(6), KArg::Out(0)]);
    assert_eq!(p.scratch[6], 2 * 100 * 384 * 4);
    // dk and dv H·Dh and 2·H·Dh floats into it, dq at its start
    let (dkdv, dq) = (&p.calls[1].args, &p.calls[2].args);
    assert_eq!(
        dkdv[6..8],
        [KArg::ScratchAt(6, 512), KArg::ScratchAt(6, 1024)]
    );
    assert_eq!(dq[6], KArg::Scratch(6));
    let p = plan_typed(
        &Op::LinearGradInput {
            relu_mask: false,
            residual: false,
        },
        &[(&[110_592, 192], B), (&[192, 64], F)],
        &[(&[110_592, 64], F)],
    )
    .unwrap();
    assert_eq!(p.calls.len(), 1);
    assert_eq!(p.calls[0].kernel, "gemm_tall_n64_c_a16");
    assert_eq!(p.calls[0].grid, [2 * CP_ASYNC.sms as u32, 1, 1]);
    assert_eq!(
        p.calls[0].smem as usize,
        2 * 64 * 200 * 2 + 64 * 200 * 2 + TALL_STAGE_SMEM + 64 * 4
    );
    // K not a multiple of 8: the single-launch kernel
    let p = plan_typed(
        &Op::LinearGradInput {
            relu_mask: false,
            residual: false,
        },
        &[(&[110_592, 190], B), (&[190, 64], F)],
        &[(&[110_592, 64], F)],
    )
    .unwrap();
    assert_eq!(p.calls[0].kernel, "gemm_bf16_nn_64x64_a16");
    let p = plan_typed(
        &Op::LinearGradWeight { bias: true },
        &[(&[110_592, 192], B), (&[110_592, 64], F)],
        &[(&[192, 64], F), (&[192], F)],
    )
    .unwrap();
    assert_eq!(p.calls[0].kernel, "gemm_bf16_tn_64x64_a16");
    assert_eq!(p.calls[0].args[16], KArg::I32(4));
}

#[test]
fn large_gemms_round_operands_first_and_split_half_waves() {
    // the CTR model's deep-layer weight gradient: 1024 x 1728 outputs over 4096 rows,
    // half a wave of 128x128 tiles: split in two, summed inside clusters of two CTAs
    let p = plan_of(
        &Op::LinearGradWeight { bias: false },
        &[&[4096, 1024], &[4096, 1728]],
        &[&[1024, 1728]],
    )
    .unwrap();
    let names: Vec<&str> = p.calls.iter().map(|c| c.kernel).collect();
    assert_eq!(names, ["gemm_to_bf16_pair", "gemm_bf16p_128x128_k2"]);
    // both operands transposed: the pair's trans flags (args 7 and 17)
    assert_eq!(p.calls[0].args[7], KArg::I32(1));
    assert_eq!(p.calls[0].args[17], KArg::I32(1));
    assert!(p.calls[1].smem > 48 * 1024);
    assert_eq!(p.calls[1].grid[2], 2);
    // straight into the output, no partials' stride (4096 = 2 splits of 2048)
    assert_eq!(p.calls[1].args[2], KArg::Out(0));
    assert_eq!(p.calls[1].args[14], KArg::I32(2048));
    assert_eq!(p.calls[1].args[15], KArg::I64(0));
    assert_eq!(p.scratch.len(), 2);
    // three splits are taken as a cluster of four (the cross block's U forward, with
    // splits of at least 512 k; the H200's 1024 leaves its K = 1728 whole)
    let (op, ins, outs): (_, [&[usize]; 3], [&[usize]; 1]) = (
        Op::Linear {
            bias: true,
            relu: false,
        },
        [&[4096, 1728], &[256, 1728], &[256]],
        [&[4096, 256]],
    );
    let opts = PlanOptions {
        gemm_pipe_min_k_per_split: 512,
        ..CP_ASYNC
    };
    let p = plan_of_with(opts, &op, &ins, &outs).unwrap();
    assert_eq!(p.calls[1].kernel, "gemm_bf16p_128x128_k4");
    assert_eq!(p.calls[1].grid, [32, 2, 4]);
    let p = plan_of(&op, &ins, &outs).unwrap();
    assert_eq!(p.calls[1].kernel, "gemm_bf16p_128x128");
    assert_eq!(p.calls[1].grid, [32, 2, 1]);
    // a batched GEMM keeps the partials and the fixed-order reduction
    let p = plan_of(
        &Op::MatMul {
            ta: false,
            tb: false,
        },
        &[&[2, 512, 4096], &[2, 4096, 512]],
        &[&[2, 512, 512]],
    )
    .unwrap();
    let names: Vec<&str> = p.calls.iter().map(|c| c.kernel).collect();
    assert_eq!(names.last(), Some(&"gemm_splitk_reduce"), "{names:?}");
    let KArg::I32(splits) = p.calls[2].args[5] else {
        panic!("splits")
    };
    assert!(splits > 1);
    assert_eq!(p.scratch.len(), 3);
    assert_eq!(p.scratch[2], splits as usize * 2 * 512 * 512 * 4);
    // with the bias gradient: dy's column sums from the conversion (64 partials of 64
    // rows in scratch 2), added by colsum_final after the GEMM; no pass of its own
    let p = plan_of(
        &Op::LinearGradWeight { bias: true },
        &[&[4096, 1024], &[4096, 1728]],
        &[&[1024, 1728], &[1024]],
    )
    .unwrap();
    let names: Vec<&str> = p.calls.iter().map(|c| c.kernel).collect();
    assert_eq!(names.last(), Some(&"colsum_final"), "{names:?}");
    assert!(!names.contains(&"sum_to_shape_partial"), "{names:?}");
    let conv = &p.calls[0].args;
    assert_eq!(conv[conv.len() - 2..], [KArg::Scratch(2), KArg::I32(1)]);
    assert_eq!(p.scratch[2], 64 * 1024 * 4);
    // the forward: x·wᵀ reads both operands K-major
    let p = plan_of(
        &Op::Linear {
            bias: true,
            relu: false,
        },
        &[&[4096, 1728], &[1024, 1728], &[1024]],
        &[&[4096, 1024]],
    )
    .unwrap();
    assert_eq!(p.calls[0].kernel, "gemm_to_bf16_pair");
    assert_eq!(p.calls[0].args[7], KArg::I32(0));
    assert_eq!(p.calls[0].args[17], KArg::I32(0));
    assert_eq!(p.calls.len(), 2);
}

#[test]
fn unsupported_head_dims_are_errors() {
    let e = plan_of(
        &Op::Attention {
            heads: 2,
            causal: false,
            packed: false,
        },
        &[&[1, 8, 96], &[1, 8, 96], &[1, 8, 96]],
        &[&[1, 8, 96], &[1, 2, 8]],
    );
    assert!(e.unwrap_err().contains("head dim 48"));
}

/// `plan_of` with input element types.
fn plan_typed(
    op: &Op,
    ins: &[(&[usize], DType)],
    outs: &[(&[usize], DType)],
) -> Result<CudaPlan, String> {
    let in_shapes: Vec<Shape> = ins.iter().map(|(s, _)| Shape::new(s)).collect();
    let out_shapes: Vec<Shape> = outs.iter().map(|(s, _)| Shape::new(s)).collect();
    let in_refs: Vec<&Shape> = in_shapes.iter().collect();
    let out_refs: Vec<&Shape> = out_shapes.iter().collect();
    let in_dt: Vec<DType> = ins.iter().map(|(_, d)| *d).collect();
    let out_dt: Vec<DType> = outs.iter().map(|(_, d)| *d).collect();
    super::cuda_plan(
        op,
        &Operands {
            opts: CP_ASYNC,
            ins: &in_refs,
            in_dtypes: &in_dt,
            outs: &out_refs,
            out_dtypes: &out_dt,
            upd: &[],
        },
    )
}

#[test]
fn bf16_copies_are_read_in_place() {
    const F: DType = DType::F32;
    const B: DType = DType::Bf16;
    // the forward reads its input's copy K-major: only the weight is rounded
    let p = plan_typed(
        &Op::Linear {
            bias: true,
            relu: true,
        },
        &[(&[4096, 1728], B), (&[1024, 1728], F), (&[1024], F)],
        &[(&[4096, 1024], F)],
    )
    .unwrap();
    let names: Vec<&str> = p.calls.iter().map(|c| c.kernel).collect();
    assert_eq!(names, ["gemm_to_bf16", "gemm_bf16p_128x128"], "{names:?}");
    assert_eq!(p.calls[1].args[0], KArg::In(0));
    assert_eq!(p.calls[1].args[7], KArg::I64(1728));
    assert_eq!(p.scratch.len(), 1);
    // the data gradient: dy's copy K-major, the weight through the transposing kernel
    let p = plan_typed(
        &Op::LinearGradInput {
            relu_mask: false,
            residual: false,
        },
        &[(&[4096, 256], B), (&[256, 1728], F)],
        &[(&[4096, 1728], F)],
    )
    .unwrap();
    let names: Vec<&str> = p.calls.iter().map(|c| c.kernel).collect();
    assert_eq!(names[0], "gemm_to_bf16_t");
    assert!(names[1].starts_with("gemm_bf16p_128x"), "{names:?}");
    // the weight gradient: both copies MN-major, no rounding launch
    let p = plan_typed(
        &Op::LinearGradWeight { bias: false },
        &[(&[4096, 1024], B), (&[4096, 1728], B)],
        &[(&[1024, 1728], F)],
    )
    .unwrap();
    let names: Vec<&str> = p.calls.iter().map(|c| c.kernel).collect();
    assert_eq!(names, ["gemm_bf16p_mm_128x128_k2"]);
    assert!(p.scratch.is_empty());
    // a bf16 dy with an f32 x (mixed layouts for the pipelined kernels): the
    // single-launch kernel reads dy as it is, and sums the bias gradient from it
    let p = plan_typed(
        &Op::LinearGradWeight { bias: true },
        &[(&[4096, 1024], B), (&[4096, 1728], F)],
        &[(&[1024, 1728], F), (&[1024], F)],
    )
    .unwrap();
    assert_eq!(p.calls[0].kernel, "gemm_bf16_tn_64x64_a16");
    assert_eq!(p.calls[0].args[16], KArg::I32(4));
    // K not a multiple of 64 (with no single-launch kernel for a bf16 x), and a bias
    // summed from bf16 copies of both dy and x, are refused, naming the problem
    // a copy of the weight too: the forward has no rounding launch, the data gradient
    // reads the weight MN-major
    let p = plan_typed(
        &Op::Linear {
            bias: true,
            relu: false,
        },
        &[(&[4096, 1728], B), (&[1024, 1728], B), (&[1024], F)],
        &[(&[4096, 1024], F)],
    )
    .unwrap();
    assert_eq!(p.calls.len(), 1);
    assert!(p.calls[0].kernel.starts_with("gemm_bf16p_128x"));
    let p = plan_typed(
        &Op::LinearGradInput {
            relu_mask: true,
            residual: false,
        },
        &[(&[4096, 1024], B), (&[1024, 1728], B), (&[4096, 1728], F)],
        &[(&[4096, 1728], F)],
    )
    .unwrap();
    assert_eq!(p.calls.len(), 1);
    assert!(
        p.calls[0].kernel.starts_with("gemm_bf16p_km_128x"),
        "{}",
        p.calls[0].kernel
    );
    let e = plan_typed(
        &Op::Linear {
            bias: false,
            relu: false,
        },
        &[(&[4096, 1000], B), (&[256, 1000], F)],
        &[(&[4096, 256], F)],
    )
    .unwrap_err();
    assert!(e.contains("multiple of 64"), "{e}");
    let e = plan_typed(
        &Op::LinearGradWeight { bias: true },
        &[(&[4096, 1024], B), (&[4096, 1728], B)],
        &[(&[1024, 1728], F), (&[1024], F)],
    )
    .unwrap_err();
    assert!(e.contains("bias gradient"), "{e}");
    // rows too long for the kernels' 32-bit tile offsets are refused, not wrapped
    let k = 1 << 24;
    let e = plan_typed(
        &Op::Linear {
            bias: false,
            relu: false,
        },
        &[(&[128, k], B), (&[128, k], B)],
        &[(&[128, 128], F)],
    )
    .unwrap_err();
    assert!(e.contains("32-bit"), "{e}");
    // a Linear that writes its output's bf16 copy: from the pipelined epilogue (a `_c`
    // kernel, the copy its last argument), or a cast after a single-launch GEMM
    let p = plan_typed(
        &Op::Linear {
            bias: true,
            relu: true,
        },
        &[(&[4096, 1728], B), (&[256, 1728], B), (&[256], F)],
        &[(&[4096, 256], F), (&[4096, 256], B)],
    )
    .unwrap();
    assert_eq!(p.calls.len(), 1);
    assert_eq!(p.calls[0].args.last(), Some(&KArg::Out(1)));
    assert!(
        p.calls[0].kernel.starts_with("gemm_bf16p_c_128x"),
        "{}",
        p.calls[0].kernel
    );
    assert_eq!(p.calls[0].args[16], KArg::I32(1 | 2));
    // a data gradient that is the dy of a copied layer below it (cross's up-projection
    // into its low-rank layer): the copy from the epilogue of the `_km` layout's
    // `_kmc` form
    let p = plan_typed(
        &Op::LinearGradInput {
            relu_mask: false,
            residual: false,
        },
        &[(&[4096, 1728], B), (&[1728, 256], B)],
        &[(&[4096, 256], F), (&[4096, 256], B)],
    )
    .unwrap();
    assert_eq!(p.calls.len(), 1);
    assert_eq!(p.calls[0].args.last(), Some(&KArg::Out(1)));
    assert!(
        p.calls[0].kernel.starts_with("gemm_bf16p_kmc_128x"),
        "{}",
        p.calls[0].kernel
    );
    let p = plan_typed(
        &Op::Linear {
            bias: false,
            relu: false,
        },
        &[(&[300, 72], F), (&[40, 72], F)],
        &[(&[300, 40], F), (&[300, 40], B)],
    )
    .unwrap();
    let names: Vec<&str> = p.calls.iter().map(|c| c.kernel).collect();
    assert_eq!(names.last(), Some(&"ew_cast"), "{names:?}");
    // RoundBf16: one launch, or the column-summing kernel and colsum_final
    let p = plan_typed(
        &Op::RoundBf16 { col_sums: false },
        &[(&[4096, 1728], F)],
        &[(&[4096, 1728], B)],
    )
    .unwrap();
    assert_eq!(p.calls.len(), 1);
    assert_eq!(p.calls[0].kernel, "gemm_to_bf16");
    let p = plan_typed(
        &Op::RoundBf16 { col_sums: true },
        &[(&[4096, 1728], F)],
        &[(&[4096, 1728], B), (&[1728], F)],
    )
    .unwrap();
    let names: Vec<&str> = p.calls.iter().map(|c| c.kernel).collect();
    assert_eq!(names, ["gemm_round_colsum", "colsum_final"]);
    assert_eq!(p.calls[0].grid, [27, 16, 1]);
    assert_eq!(p.scratch, [16 * 1728 * 4]);
    let e = plan_typed(
        &Op::RoundBf16 { col_sums: false },
        &[(&[4096, 13], F)],
        &[(&[4096, 13], B)],
    )
    .unwrap_err();
    assert!(e.contains("multiple of 8"), "{e}");
}

fn kernels(p: &CudaPlan) -> Vec<&'static str> {
    p.calls.iter().map(|c| c.kernel).collect()
}
