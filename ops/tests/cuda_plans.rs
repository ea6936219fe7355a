//! The CUDA plans of the fused and single-launch forms, checked without a GPU: which
//! kernels an op launches, with which flags and sizes, and which shapes it refuses. (The
//! kernels themselves are checked against the CPU on a GPU, in tests/gpu.)

use erase_graph::{DType, Op, Shape};
use erase_ops::cuda::{
    cuda_plan, CudaPlan, GemmTile, KArg, LaunchAt, LaunchSet, Operands, PlanOptions, TmaBase,
    TmaMatrix,
};

fn plan(
    op: &Op,
    ins: &[(&[usize], DType)],
    outs: &[(&[usize], DType)],
) -> Result<CudaPlan, String> {
    plan_with(PlanOptions::H200, op, ins, outs)
}

fn plan_with(
    opts: PlanOptions,
    op: &Op,
    ins: &[(&[usize], DType)],
    outs: &[(&[usize], DType)],
) -> Result<CudaPlan, String> {
    let in_shapes: Vec<Shape> = ins.iter().map(|(d, _)| Shape::new(d)).collect();
    let out_shapes: Vec<Shape> = outs.iter().map(|(d, _)| Shape::new(d)).collect();
    let ins_ref: Vec<&Shape> = in_shapes.iter().collect();
    let outs_ref: Vec<&Shape> = out_shapes.iter().collect();
    let in_dtypes: Vec<DType> = ins.iter().map(|x| x.1).collect();
    let out_dtypes: Vec<DType> = outs.iter().map(|x| x.1).collect();
    cuda_plan(
        op,
        &Operands {
            opts,
            ins: &ins_ref,
            in_dtypes: &in_dtypes,
            outs: &outs_ref,
            out_dtypes: &out_dtypes,
            upd: &[],
        },
    )
}

fn kernels(p: &CudaPlan) -> Vec<&'static str> {
    p.calls.iter().map(|c| c.kernel).collect()
}

/// Whether a kernel is a pipelined GEMM of 256 threads: the TMA form (`gemm_bf16t*`, the
/// default on sm_90a) or the cp.async one (`gemm_bf16p*`).
fn pipelined(k: &str) -> bool {
    k.starts_with("gemm_bf16t") || k.starts_with("gemm_bf16p")
}

/// That no kernel of `p` is a TMA GEMM (`gemm_bf16t*`).
fn assert_no_tma(p: &CudaPlan) {
    assert!(
        kernels(p).iter().all(|k| !k.starts_with("gemm_bf16t")),
        "{:?}",
        kernels(p)
    );
}

const F: DType = DType::F32;

#[test]
fn concat_and_split_take_one_launch_per_eight_parts_in_the_widest_unit() {
    // 11 parts of widths 1..4: two launches of 4-byte units (8 parts, then 3)
    let widths: Vec<usize> = (0..11).map(|i| 1 + i % 4).collect();
    let total: usize = widths.iter().sum();
    let parts: Vec<Vec<usize>> = widths.iter().map(|&w| vec![5, w]).collect();
    let ins: Vec<(&[usize], DType)> = parts.iter().map(|p| (&p[..], F)).collect();
    let p = plan(&Op::Concat { axis: 1 }, &ins, &[(&[5, total], F)]).unwrap();
    assert_eq!(kernels(&p), ["ew_parts_rows_u32"; 2]);
    // the second launch starts at the ninth part's offset and takes three parts
    let off: usize = widths[..8].iter().sum();
    assert_eq!(p.calls[1].args[3], KArg::I64(off as i64));
    assert_eq!(p.calls[1].args[5], KArg::I32(3));
    // the embedding concat (64 and 1664 floats a row): 16-byte units
    let p = plan(
        &Op::Split {
            axis: 1,
            sizes: vec![26, 1],
        },
        &[(&[4096, 27, 64], F)],
        &[(&[4096, 26, 64], F), (&[4096, 1, 64], F)],
    )
    .unwrap();
    assert_eq!(kernels(&p), ["ew_parts_rows_u128"]);
    assert_eq!(
        p.calls[0].args[2],
        KArg::I64(27 * 64 / 4),
        "big row in 16-byte units"
    );
    assert_eq!(p.calls[0].args[4], KArg::I32(1), "split, not concat");
    // a concat that writes its output's bf16 copy: each launch writes both where the rows
    // are whole float4 units (E's shape, and 11 parts of 4-float widths: two launches),
    // else the concat launches and then one cast
    let bf = DType::Bf16;
    let p = plan(
        &Op::Concat { axis: 1 },
        &[(&[4096, 26, 64], F), (&[4096, 1, 64], F)],
        &[(&[4096, 27, 64], F), (&[4096, 27, 64], bf)],
    )
    .unwrap();
    assert_eq!(kernels(&p), ["ew_parts_rows_f32_bf16"]);
    assert_eq!(p.calls[0].args[1], KArg::Out(1), "the copy second");
    assert_eq!(
        p.calls[0].args[5],
        KArg::I32(2),
        "no split flag: the part count"
    );
    let wide: Vec<Vec<usize>> = widths.iter().map(|&w| vec![5, 4 * w]).collect();
    let ins: Vec<(&[usize], DType)> = wide.iter().map(|p| (&p[..], F)).collect();
    let outs: [(&[usize], DType); 2] = [(&[5, 4 * total], F), (&[5, 4 * total], bf)];
    let p = plan(&Op::Concat { axis: 1 }, &ins, &outs).unwrap();
    assert_eq!(kernels(&p), ["ew_parts_rows_f32_bf16"; 2]);
    let outs: [(&[usize], DType); 2] = [(&[5, total], F), (&[5, total], bf)];
    let ins: Vec<(&[usize], DType)> = parts.iter().map(|p| (&p[..], F)).collect();
    let p = plan(&Op::Concat { axis: 1 }, &ins, &outs).unwrap();
    assert_eq!(
        kernels(&p),
        ["ew_parts_rows_u32", "ew_parts_rows_u32", "ew_cast"]
    );
    // stored in bf16 alone (Graph::concat_stored): the fused pass without the f32 tensor,
    // its copy first; refused where the rows are not whole float4 units
    let p = plan(
        &Op::Concat { axis: 1 },
        &[(&[4096, 26, 128], F), (&[4096, 1, 128], F)],
        &[(&[4096, 27, 128], bf)],
    )
    .unwrap();
    assert_eq!(kernels(&p), ["ew_parts_rows_f32_to_bf16"]);
    assert_eq!(p.calls[0].args[0], KArg::Out(0), "the copy first");
    assert_eq!(p.calls[0].args[4], KArg::I32(2), "the part count");
    let e = plan(&Op::Concat { axis: 1 }, &ins, &[(&[5, total], bf)]).unwrap_err();
    assert!(e.contains("multiple of 4 floats"), "{e}");
    // a split whose parts do not fill the axis is refused, naming the op
    let e = plan(
        &Op::Split {
            axis: 1,
            sizes: vec![2, 2],
        },
        &[(&[3, 5], F)],
        &[(&[3, 2], F), (&[3, 2], F)],
    )
    .unwrap_err();
    assert!(e.contains("split"), "{e}");
}

#[test]
fn the_masked_input_gradient_flags_its_epilogue_and_checks_the_mask() {
    let gemm_flags = |p: &CudaPlan| -> Vec<i32> {
        p.calls
            .iter()
            .filter(|c| c.kernel.starts_with("gemm_bf16") || c.kernel == "gemm_splitk_reduce")
            .map(|c| {
                // the reduction's flags are its 8th argument (its row-sum arguments follow)
                let flags = if c.kernel == "gemm_splitk_reduce" {
                    c.args.get(7)
                } else {
                    c.args.iter().rev().find(|a| matches!(a, KArg::I32(_)))
                };
                match flags {
                    Some(KArg::I32(f)) => *f,
                    _ => -1,
                }
            })
            .collect()
    };
    // (rows, N, K) of dx[rows, K] = dy[rows, N]·w[N, K]: a single launch, split K, and
    // the pipelined path; the mask's flag (8) lands on the launch that writes dx
    for (m, n, k) in [(64, 32, 48), (17, 1729, 40), (4096, 256, 1728)] {
        let masked = plan(
            &Op::LinearGradInput {
                relu_mask: true,
                residual: false,
            },
            &[(&[m, n], F), (&[n, k], F), (&[m, k], F)],
            &[(&[m, k], F)],
        )
        .unwrap();
        let plain = plan(
            &Op::LinearGradInput {
                relu_mask: false,
                residual: false,
            },
            &[(&[m, n], F), (&[n, k], F)],
            &[(&[m, k], F)],
        )
        .unwrap();
        assert_eq!(kernels(&masked), kernels(&plain), "{m}x{n}x{k}");
        let flags = gemm_flags(&masked);
        assert_eq!(
            flags.last().map(|f| f & 8),
            Some(8),
            "{m}x{n}x{k}: {flags:?}"
        );
        assert!(gemm_flags(&plain).iter().all(|f| f & 8 == 0));
    }
    let e = plan(
        &Op::LinearGradInput {
            relu_mask: true,
            residual: false,
        },
        &[(&[8, 4], F), (&[4, 6], F), (&[8, 5], F)],
        &[(&[8, 6], F)],
    )
    .unwrap_err();
    assert!(e.contains("ReLU output"), "{e}");
}

#[test]
fn the_single_launch_weight_gradient_sums_the_bias_gradient_itself() {
    // AutoInt's QKV projection and a small dense layer: no SumToShape pass over dy
    for (rows, n, k) in [(110_592, 192, 64), (4096, 64, 13), (5, 7, 3)] {
        let p = plan(
            &Op::LinearGradWeight { bias: true },
            &[(&[rows, n], F), (&[rows, k], F)],
            &[(&[n, k], F), (&[n], F)],
        )
        .unwrap();
        let ks = kernels(&p);
        assert!(ks[0].starts_with("gemm_bf16_tn"), "{ks:?}");
        assert!(
            !ks.contains(&"sum_to_shape_partial"),
            "{rows}x{n}x{k}: {ks:?}"
        );
        // one split writes db directly; more add their partials in split order, in the
        // launch that reduces dw's partials (no launch of their own)
        let splits = p.calls[0].grid[2];
        assert!(!ks.contains(&"colsum_final"), "{ks:?}");
        if splits > 1 {
            assert_eq!(ks, ["gemm_bf16_tn_64x64", "gemm_splitk_reduce"]);
            let r = &p.calls[1];
            assert_eq!(r.args[9], KArg::Out(1), "db from the reduction");
            assert_eq!(r.args[10], KArg::I32(splits as i32));
            assert_eq!(r.args[11], KArg::I64(n as i64));
            // element groups of 4 by `width` threads, 256 in all where the lanes are few
            let (width, lanes) = (r.block[0] as usize, r.block[1] as usize);
            assert_eq!(width, (256 / lanes).max(32), "{rows}x{n}x{k}");
            assert_eq!(r.smem as usize, width * lanes * 16, "the lanes' sums");
            let c_blocks = (n * k).div_ceil(4 * width) as u32;
            assert_eq!(r.grid[0], c_blocks + n.div_ceil(width) as u32);
        }
    }
    // no input features: no GEMM launch to sum in, db still written by SumToShape
    let p = plan(
        &Op::LinearGradWeight { bias: true },
        &[(&[4, 8], F), (&[4, 0], F)],
        &[(&[8, 0], F), (&[8], F)],
    )
    .unwrap();
    assert_eq!(kernels(&p), ["sum_to_shape_partial"]);
    assert!(
        p.calls[0].args.contains(&KArg::Out(1)),
        "db written in the one pass: {:?}",
        p.calls[0].args
    );
}

#[test]
fn short_sequences_take_the_two_heads_a_cta_attention_kernels() {
    let (b, h, dh) = (4096, 2, 32);
    for (s, fwd, grid) in [
        (27, "attn_fwd_tiny_packed_d32", [1, 1, 4096]),
        (32, "attn_fwd_tiny_packed_d32", [1, 1, 4096]),
        (33, "attn_fwd_packed_d32", [1, 2, 4096]),
    ] {
        let p = plan(
            &Op::Attention {
                heads: h,
                causal: false,
                packed: true,
            },
            &[(&[b, s, 3 * h * dh], F)],
            &[(&[b, s, h * dh], F), (&[b, h, s], F)],
        )
        .unwrap();
        assert_eq!(kernels(&p), [fwd], "S = {s}");
        assert_eq!(p.calls[0].grid, grid, "S = {s}");
    }
    // three heads: the second CTA holds one real head and one past the last
    let p = plan(
        &Op::Attention {
            heads: 3,
            causal: true,
            packed: false,
        },
        &[(&[2, 20, 96], F), (&[2, 20, 96], F), (&[2, 20, 96], F)],
        &[(&[2, 20, 96], F), (&[2, 3, 20], F)],
    )
    .unwrap();
    assert_eq!(p.calls[0].grid, [1, 2, 2]);
}

#[test]
fn layer_norm_and_the_lookup_take_their_single_pass_kernels_where_shapes_allow() {
    let ln_grad = |rows: usize, d: usize| {
        plan(
            &Op::LayerNormGrad,
            &[
                (&[rows, d], F),
                (&[rows, d], F),
                (&[d], F),
                (&[rows], F),
                (&[rows], F),
            ],
            &[(&[rows, d], F), (&[d], F), (&[d], F)],
        )
        .unwrap()
    };
    let p = ln_grad(110_592, 64);
    assert_eq!(
        kernels(&p),
        ["layer_norm_bwd_v4", "colsum_final", "colsum_final"]
    );
    assert!(p.calls[0].grid[0] <= 264, "{:?}", p.calls[0].grid);
    // one CTA: dgamma and dbeta straight to their outputs
    assert_eq!(kernels(&ln_grad(7, 12)), ["layer_norm_bwd_v4"]);
    // d not a multiple of 4: a warp a row and the column reduction
    assert_eq!(
        kernels(&ln_grad(300, 37))[..2],
        ["layer_norm_bwd_dx", "layer_norm_bwd_dgb_partial"]
    );

    let bag_of = |batch: usize, fields: usize, d: usize| {
        let n = batch * fields;
        plan(
            &Op::EmbeddingBag {
                field_rows: vec![10; fields],
            },
            &[
                (&[10 * fields, d], F),
                (&[n], DType::I32),
                (&[n + 1], DType::I32),
            ],
            &[(&[batch, fields, d], F)],
        )
        .unwrap()
    };
    let bag = |fields: usize, d: usize| bag_of(64, fields, d);
    let p = bag(26, 64);
    assert_eq!(kernels(&p), ["embedding_bag_fwd_fields"]);
    assert!(p.scratch.is_empty());
    // the spec's batch: one wave of three CTAs an SM (64 bags each), groups walking on
    let p = bag_of(4096, 26, 64);
    assert_eq!(p.calls[0].grid, [3 * 132, 1, 1]);
    // past 32 fields the geometry goes through the meta table
    let p = bag(40, 64);
    assert_eq!(
        kernels(&p),
        ["emb_meta_build", "emb_meta_build", "embedding_bag_fwd_v4"]
    );
}

#[test]
fn a_layer_norm_gradient_that_is_a_layers_dy_writes_its_copy_and_sums() {
    const B: DType = DType::Bf16;
    for (rows, d) in [(4096usize, 256usize), (4096, 64)] {
        let (x, row, col): (&[usize], &[usize], &[usize]) = (&[rows, d], &[rows], &[d]);
        let ins = [(x, F), (x, F), (col, F), (row, F), (row, F)];
        let p = plan(
            &Op::LayerNormGrad,
            &ins,
            &[(x, F), (col, F), (col, F), (x, B), (col, F)],
        )
        .unwrap();
        let k = kernels(&p);
        if d == 256 {
            // dx's pass writes the copy and the sums' partials (8·d floats of shared
            // memory), summed by colsum_final; then dgamma and dbeta as before
            assert_eq!(k[..2], ["layer_norm_bwd_dx_bf16", "colsum_final"], "{k:?}");
            assert_eq!(p.calls[0].smem, 8 * 256 * 4);
            assert_eq!(p.calls[0].args[6], KArg::Out(3));
            assert_eq!(p.calls[1].args[1], KArg::Out(4));
        } else {
            // the one-pass form (d ≤ 128) keeps its kernel: a cast and a column sum after
            assert_eq!(k[0], "layer_norm_bwd_v4", "{k:?}");
            assert!(k.contains(&"ew_cast"), "{k:?}");
        }
        // the copy must be dx's shape, the sums d wide
        let e = plan(
            &Op::LayerNormGrad,
            &ins,
            &[(x, F), (col, F), (col, F), (x, B), (row, F)],
        )
        .unwrap_err();
        assert!(e.contains("do not match"), "{e}");
    }
}

/// The pipelined weight gradient with `gemm_cluster: false` (the switch that keeps the
/// split-K partials and the reduction launch, for comparing the two forms).
#[test]
fn without_clusters_the_reduction_launch_also_adds_the_bias_gradient() {
    // dw [1024, 1728] over 4096 rows, with db: two splits, so partials and a reduction
    let (rows, n, k) = (4096, 1024, 1728);
    let opts = PlanOptions {
        gemm_cluster: false,
        ..PlanOptions::H200
    };
    let p = plan_with(
        opts,
        &Op::LinearGradWeight { bias: true },
        &[(&[rows, n], F), (&[rows, k], F)],
        &[(&[n, k], F), (&[n], F)],
    )
    .unwrap();
    let names: Vec<&str> = p.calls.iter().map(|c| c.kernel).collect();
    assert_eq!(
        names,
        [
            "gemm_to_bf16_pair",
            "gemm_bf16p_128x128",
            "gemm_splitk_reduce"
        ],
        "no colsum_final launch of its own"
    );
    // dy's column sums: one partial per 64 rows (scratch 3, after the two bf16 operands
    // and the GEMM's partials), added into db by the reduction's extra CTAs
    let r = &p.calls[2];
    assert_eq!(r.args[8], KArg::Scratch(3));
    assert_eq!(r.args[9], KArg::Out(1));
    assert_eq!(r.args[10], KArg::I32((rows / 64) as i32));
    assert_eq!(r.args[11], KArg::I64(n as i64));
    assert_eq!(p.scratch[3], rows / 64 * n * 4);
    // the two splits summed by one lane: 256 threads of element groups of 4
    assert_eq!((r.block[0], r.block[1]), (256, 1));
    assert_eq!(r.grid[0] as usize, (n * k).div_ceil(1024) + n.div_ceil(256));
}

#[test]
fn plan_options_switch_paths_and_follow_the_device() {
    // dw [1024, 1728] over 4096 rows: the cluster form by default, partials without it
    let op = Op::LinearGradWeight { bias: false };
    let ins: [(&[usize], DType); 2] = [(&[4096, 1024], F), (&[4096, 1728], F)];
    let outs: [(&[usize], DType); 1] = [(&[1024, 1728], F)];
    let on = kernels(&plan(&op, &ins, &outs).unwrap());
    assert!(
        on.iter().any(|k| pipelined(k) && k.contains("_128x128_k")),
        "{on:?}"
    );
    let off = PlanOptions {
        gemm_pipeline: false,
        ..PlanOptions::H200
    };
    let single = kernels(&plan_with(off, &op, &ins, &outs).unwrap());
    assert!(single.iter().all(|k| !pipelined(k)), "{single:?}");
    // a tall projection: the persistent kernel, unless switched off
    let op = Op::Linear {
        bias: true,
        relu: false,
    };
    let ins: [(&[usize], DType); 3] = [(&[110_592, 64], F), (&[192, 64], F), (&[192], F)];
    let outs: [(&[usize], DType); 1] = [(&[110_592, 192], F)];
    let tall = kernels(&plan(&op, &ins, &outs).unwrap());
    assert!(
        tall.iter().any(|k| k.starts_with("gemm_tall_n")),
        "{tall:?}"
    );
    let no_tall = PlanOptions {
        gemm_tall: false,
        ..PlanOptions::H200
    };
    let other = kernels(&plan_with(no_tall, &op, &ins, &outs).unwrap());
    assert!(
        other.iter().all(|k| !k.starts_with("gemm_tall")),
        "{other:?}"
    );
    // the SM count sizes the persistent grid: one wave of the device's SMs
    let half = plan_with(PlanOptions::H200.with_sms(66), &op, &ins, &outs).unwrap();
    let full = plan(&op, &ins, &outs).unwrap();
    assert_eq!(full.calls[0].grid[0], 2 * half.calls[0].grid[0]);
}

#[test]
fn a_forced_pipelined_tile_is_taken_by_every_large_gemm() {
    // DCNv2's cross layer: y [4096, 3456] = u [4096, 512]·wᵀ, its data gradient and
    // weight gradient; each takes the forced tile whatever the wave model would choose
    type Args<const N: usize> = [(&'static [usize], DType); N];
    let cases: [(Op, Args<2>, Args<1>); 3] = [
        (
            Op::Linear {
                bias: false,
                relu: false,
            },
            [(&[4096, 512], F), (&[3456, 512], F)],
            [(&[4096, 3456], F)],
        ),
        (
            Op::LinearGradInput {
                relu_mask: false,
                residual: false,
            },
            [(&[4096, 512], F), (&[512, 3456], F)],
            [(&[4096, 3456], F)],
        ),
        (
            Op::LinearGradWeight { bias: false },
            [(&[4096, 3456], F), (&[4096, 512], F)],
            [(&[3456, 512], F)],
        ),
    ];
    for (op, ins, outs) in &cases {
        for (name, tile) in GemmTile::ALL {
            let o = PlanOptions {
                gemm_tile: Some(tile),
                gemm_ws: tile.ws,
                gemm_tma_n64: if !tile.ws && tile.n == 64 {
                    LaunchSet::ALL
                } else {
                    LaunchSet::NONE
                },
                ..PlanOptions::H200
            };
            let p = plan_with(o, op, ins, outs).unwrap();
            // the warp-specialized kernels are gemm_bf16w_*, 384 threads; the others
            // gemm_bf16t_* (TMA) or gemm_bf16p_*, 256
            let threads = if tile.ws { 384 } else { 256 };
            let main: Vec<_> = p
                .calls
                .iter()
                .filter(|c| pipelined(c.kernel) || c.kernel.starts_with("gemm_bf16w"))
                .collect();
            assert_eq!(main.len(), 1, "{op:?}: {:?}", kernels(&p));
            let k = main[0].kernel;
            assert!(
                k.starts_with("gemm_bf16w") == tile.ws && k.contains(&format!("_128x{}", tile.n)),
                "{op:?} with the {name} tile forced: {:?}",
                kernels(&p)
            );
            assert_eq!(main[0].block, [threads, 1, 1], "{k}");
        }
    }
}

#[test]
fn the_warp_specialized_tile_is_a_candidate_only_where_switched_on() {
    // the cross layer's U at batch 4096 (64 tiles of 128x128 over 1728 k): the wave model
    // takes a warp-specialized tile when it may, a 256-thread one otherwise; and a ws tile
    // forced while ws is off (the sm_80 PTX) falls back to the model's choice
    let op = Op::Linear {
        bias: true,
        relu: false,
    };
    let ins: [(&[usize], DType); 3] = [(&[4096, 1728], F), (&[256, 1728], F), (&[256], F)];
    let outs: [(&[usize], DType); 1] = [(&[4096, 256], F)];
    let main = |o: PlanOptions| {
        let p = plan_with(o, &op, &ins, &outs).unwrap();
        p.calls[p.calls.len() - 1].kernel
    };
    let on = PlanOptions {
        gemm_ws: true,
        ..PlanOptions::H200
    };
    let off = PlanOptions {
        gemm_ws: false,
        ..PlanOptions::H200
    };
    assert!(main(on).starts_with("gemm_bf16w_"), "{}", main(on));
    assert!(pipelined(main(off)), "{}", main(off));
    let forced_off = PlanOptions {
        gemm_tile: Some(GemmTile { n: 64, ws: true }),
        ..off
    };
    assert!(pipelined(main(forced_off)), "{}", main(forced_off));
}

#[test]
fn split_gemms_of_either_tile_sum_their_splits_in_a_cluster() {
    // few tiles and a long K: MLPerf DCNv2's top layer's weight gradient, dw [1024, 1024]
    // over 4096 rows, splits of either tile summed on chip, or through partials and the
    // reduction launch when clusters are switched off
    let op = Op::LinearGradWeight { bias: false };
    let ins: [(&[usize], DType); 2] = [(&[4096, 1024], F), (&[4096, 1024], F)];
    let outs: [(&[usize], DType); 1] = [(&[1024, 1024], F)];
    for n in [128, 256] {
        for cluster in [true, false] {
            let o = PlanOptions {
                gemm_tile: Some(GemmTile { n, ws: false }),
                gemm_cluster: cluster,
                ..PlanOptions::H200
            };
            let ks = kernels(&plan_with(o, &op, &ins, &outs).unwrap());
            let main: Vec<_> = ks.iter().filter(|k| pipelined(k)).collect();
            assert_eq!(main.len(), 1, "{ks:?}");
            let tile = format!("_128x{n}");
            assert!(main[0].contains(&tile), "128x{n}: {ks:?}");
            assert_eq!(
                main[0].contains(&format!("{tile}_k")),
                cluster,
                "128x{n}, clusters {cluster}: {ks:?}"
            );
            assert_eq!(
                ks.contains(&"gemm_splitk_reduce"),
                !cluster,
                "128x{n}, clusters {cluster}: {ks:?}"
            );
        }
    }
}

#[test]
fn plan_options_read_the_documented_overrides_and_name_a_bad_one() {
    let env = |pairs: &'static [(&'static str, &'static str)]| {
        move |k: &str| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    };
    assert_eq!(PlanOptions::H200.with_env(env(&[])), Ok(PlanOptions::H200));
    let o = PlanOptions::H200
        .with_env(env(&[
            ("ERASE_GEMM_PIPELINE", "0"),
            ("ERASE_GEMM_CLUSTER", "0"),
            ("ERASE_GEMM_TALL", "0"),
            ("ERASE_GEMM_TALL_STORE", "direct"),
            ("ERASE_GRAPH_NODE_PRIORITY", "0"),
            ("ERASE_GEMM_TILE", "128x256"),
            ("ERASE_GEMM_TMA", "0"),
            ("ERASE_GEMM_MIN_K_SPLIT", "128"),
            ("ERASE_GEMM_MIN_K_SPLIT_FEW", "32"),
            ("ERASE_GEMM_PIPE_MIN_K_SPLIT", "256"),
            ("ERASE_GEMM_PIPE_MIN_FLOPS", "0"),
            ("ERASE_GEMM_PIPE_MIN_MN", "64"),
        ]))
        .unwrap();
    assert_eq!(
        (
            o.gemm_min_k_per_split,
            o.gemm_min_k_per_split_few,
            o.gemm_pipe_min_k_per_split,
            o.gemm_pipe_min_flops,
            o.gemm_pipe_min_mn
        ),
        (128, 32, 256, 0, 64)
    );
    for (name, bad) in [
        ("ERASE_GEMM_PIPE_MIN_FLOPS", "2^29"),
        ("ERASE_GEMM_MIN_K_SPLIT", "0"),
        ("ERASE_GEMM_PIPE_MIN_MN", "8"),
    ] {
        let pairs: &'static [(&'static str, &'static str)] =
            Box::leak(vec![(name, bad)].into_boxed_slice());
        let e = PlanOptions::H200.with_env(env(pairs)).unwrap_err();
        assert!(
            e.contains(&format!("{name}={bad}")) && e.contains("whole number"),
            "{e}"
        );
    }
    assert!(!o.gemm_pipeline && !o.gemm_cluster && !o.gemm_tall && !o.graph_node_priority);
    assert!(o.gemm_tall_store_direct);
    assert!(!o.gemm_tma);
    let e = PlanOptions::H200
        .with_env(env(&[("ERASE_GEMM_TMA", "on")]))
        .unwrap_err();
    assert!(
        e.contains("ERASE_GEMM_TMA=on") && e.contains("0 or 1"),
        "{e}"
    );
    assert_eq!(o.gemm_tile, Some(GemmTile { n: 256, ws: false }));
    let e = PlanOptions::H200
        .with_env(env(&[("ERASE_GEMM_TILE", "256x128")]))
        .unwrap_err();
    assert!(
        e.contains("ERASE_GEMM_TILE=256x128") && e.contains("ws128x64"),
        "{e}"
    );
    let ws = PlanOptions::H200
        .with_env(env(&[("ERASE_GEMM_TILE", "ws128x64")]))
        .unwrap();
    assert_eq!(ws.gemm_tile, Some(GemmTile { n: 64, ws: true }));
    assert!(ws.gemm_ws, "a forced ws tile turns the ws kernels on");
    let t64 = PlanOptions::H200
        .with_env(env(&[("ERASE_GEMM_TILE", "t128x64")]))
        .unwrap();
    assert_eq!(t64.gemm_tile, Some(GemmTile { n: 64, ws: false }));
    assert!(t64.gemm_tma_n64 == LaunchSet::ALL && !t64.gemm_ws);
    let n64 = |pairs: &'static [(&'static str, &'static str)]| {
        PlanOptions::H200
            .with_env(env(pairs))
            .map(|o| o.gemm_tma_n64)
    };
    assert_eq!(n64(&[("ERASE_GEMM_TMA_N64", "0")]), Ok(LaunchSet::NONE));
    assert_eq!(n64(&[("ERASE_GEMM_TMA_N64", "1")]), Ok(LaunchSet::ALL));
    let both = n64(&[("ERASE_GEMM_TMA_N64", "main,fwd")]).unwrap();
    assert!(both.main && both.forward && !both.all);
    let main_only = n64(&[("ERASE_GEMM_TMA_N64", "main")]).unwrap();
    assert!(main_only.main && !main_only.forward && !main_only.all);
    for bad in ["yes", "main,bwd", ""] {
        assert_eq!(LaunchSet::parse(bad), None, "{bad:?}");
    }
    let e = n64(&[("ERASE_GEMM_TMA_N64", "yes")]).unwrap_err();
    assert!(
        e.contains("ERASE_GEMM_TMA_N64=yes") && e.contains("main"),
        "{e}"
    );
    assert_eq!(
        n64(&[("ERASE_GEMM_TMA_N64", "serial")]),
        Ok(LaunchSet::SERIAL)
    );
    // a step's launch: in the set, every GEMM of it may take the tile; else none
    let at = |main: bool, forward: bool, serial: bool| LaunchAt {
        main,
        forward,
        serial,
        examples: 4096,
    };
    let resolved = |set: LaunchSet, a: LaunchAt| {
        PlanOptions {
            gemm_tma_n64: set,
            ..PlanOptions::H200
        }
        .at_launch(a)
        .gemm_tma_n64
    };
    assert_eq!(resolved(main_only, at(true, false, false)), LaunchSet::ALL);
    assert_eq!(resolved(main_only, at(false, true, false)), LaunchSet::NONE);
    let fwd = LaunchSet::parse("fwd").unwrap();
    assert_eq!(resolved(fwd, at(false, true, false)), LaunchSet::ALL);
    assert_eq!(resolved(fwd, at(true, false, true)), LaunchSet::NONE);
    // the overlapped programs' split bounds: replace the others at their launches only
    let h = PlanOptions::H200;
    let b = h.gemm_overlapped_splits.expect("on by default");
    let erase_launch = h.at_launch(at(false, false, false));
    assert_eq!(
        (
            erase_launch.gemm_min_k_per_split,
            erase_launch.gemm_min_k_per_split_few,
            erase_launch.gemm_pipe_min_k_per_split
        ),
        (b.min_k, b.min_k_few, b.pipe_min_k)
    );
    assert!(b.min_k > h.gemm_min_k_per_split && b.pipe_min_k > h.gemm_pipe_min_k_per_split);
    let serial_launch = h.at_launch(at(true, true, true));
    assert_eq!(
        (
            serial_launch.gemm_min_k_per_split,
            serial_launch.gemm_pipe_min_k_per_split
        ),
        (h.gemm_min_k_per_split, h.gemm_pipe_min_k_per_split)
    );
    // a larger step scales them (a weight gradient over its rows splits as often); a
    // smaller or unknown one keeps them; the serial programs' never scale
    let at_examples = |serial: bool, examples: usize| LaunchAt {
        examples,
        ..at(false, false, serial)
    };
    let big = h.at_launch(at_examples(false, 16384));
    assert_eq!(
        (
            big.gemm_min_k_per_split,
            big.gemm_min_k_per_split_few,
            big.gemm_pipe_min_k_per_split
        ),
        (4 * b.min_k, 4 * b.min_k_few, 4 * b.pipe_min_k)
    );
    for examples in [0, 256, 4096] {
        assert_eq!(
            h.at_launch(at_examples(false, examples)),
            erase_launch,
            "{examples}"
        );
    }
    assert_eq!(
        h.at_launch(at_examples(true, 16384))
            .gemm_pipe_min_k_per_split,
        h.gemm_pipe_min_k_per_split
    );
    // (whole multiples of 64, never below the bound)
    let odd = b.for_examples(6000);
    assert_eq!(odd.min_k, 1024 * 6000 / 4096 / 64 * 64);
    assert!(odd.min_k_few >= b.min_k_few && odd.min_k_few.is_multiple_of(64));
    let same = PlanOptions::H200
        .with_env(env(&[("ERASE_GEMM_OVERLAPPED_SPLITS", "0")]))
        .unwrap();
    assert_eq!(same.gemm_overlapped_splits, None);
    assert_eq!(
        same.at_launch(at(false, false, false)).gemm_min_k_per_split,
        h.gemm_min_k_per_split
    );
    let e = PlanOptions::H200
        .with_env(env(&[("ERASE_GEMM_OVERLAPPED_SPLITS", "yes")]))
        .unwrap_err();
    assert!(e.contains("ERASE_GEMM_OVERLAPPED_SPLITS=yes"), "{e}");
    // the default: the serial programs' launches, wherever they run
    assert_eq!(PlanOptions::H200.gemm_tma_n64, LaunchSet::SERIAL);
    let default = PlanOptions::H200.gemm_tma_n64;
    assert_eq!(resolved(default, at(true, true, true)), LaunchSet::ALL);
    assert_eq!(resolved(default, at(true, true, false)), LaunchSet::NONE);
    assert_eq!(
        resolved(LaunchSet::ALL, at(false, false, false)),
        LaunchSet::ALL
    );
    let off = PlanOptions::H200
        .with_env(env(&[("ERASE_GEMM_WS", "0")]))
        .unwrap();
    assert!(!off.gemm_ws);
    let e = PlanOptions::H200
        .with_env(env(&[("ERASE_GEMM_WS", "yes")]))
        .unwrap_err();
    assert!(e.contains("ERASE_GEMM_WS=yes"), "{e}");
    assert_eq!(o.sms, 132);
    let e = PlanOptions::H200
        .with_env(env(&[("ERASE_GEMM_TALL", "off")]))
        .unwrap_err();
    assert!(
        e.contains("ERASE_GEMM_TALL=off") && e.contains("0 or 1"),
        "{e}"
    );
}

/// A GEMM's two operands and its output, shapes and dtypes.
type GemmCase = (
    [(&'static [usize], DType); 2],
    [(&'static [usize], DType); 1],
);

/// What the GPU tests' second handles rely on: with splits of at least 512 k the ragged
/// pipelined GEMMs of `large_gemms_on_the_pipelined_path_match_the_bf16_reference` split
/// (batched: partials and the reduction launch; batch 1: two splits in a cluster), and
/// with the H200's 1024 they do not.
#[test]
fn the_pipelined_split_bound_decides_the_split_forms() {
    let op = Op::MatMul {
        ta: false,
        tb: false,
    };
    let batched: GemmCase = (
        [(&[2, 700, 1300], F), (&[2, 1300, 600], F)],
        [(&[2, 700, 600], F)],
    );
    let single: GemmCase = (
        [(&[1, 1001, 1403], F), (&[1, 1403, 901], F)],
        [(&[1, 1001, 901], F)],
    );
    let old = PlanOptions {
        gemm_pipe_min_k_per_split: 512,
        ..PlanOptions::H200
    };
    let ks = kernels(&plan_with(old, &op, &batched.0, &batched.1).unwrap());
    assert!(ks.contains(&"gemm_splitk_reduce"), "{ks:?}");
    let ks = kernels(&plan_with(old, &op, &single.0, &single.1).unwrap());
    assert!(ks.iter().any(|k| k.ends_with("_k2")), "{ks:?}");
    for (ins, outs) in [&batched, &single] {
        let ks = kernels(&plan(&op, ins, outs).unwrap());
        assert!(
            !ks.contains(&"gemm_splitk_reduce")
                && !ks
                    .iter()
                    .any(|k| ["_k2", "_k4", "_k8"].iter().any(|s| k.ends_with(s))),
            "{ks:?}"
        );
    }
}

#[test]
fn the_interaction_stages_a_few_examples_a_small_cta() {
    // the spec's [4096, 27, 64]: two examples a CTA of 96 threads (45 blocks of 3x3 dots
    // each), 2 · 27 · 65 floats of shared memory, the batch over 2048 CTAs
    let p = plan(
        &Op::PairwiseDot,
        &[(&[4096, 27, 64], F)],
        &[(&[4096, 351], F)],
    )
    .unwrap();
    assert_eq!(kernels(&p), ["pairwise_dot_fwd"]);
    let c = &p.calls[0];
    assert_eq!((c.grid[0], c.block[0], c.smem), (2048, 96, 2 * 27 * 65 * 4));
    assert_eq!(c.args.last(), Some(&KArg::I32(2)), "examples a CTA");
    // its gradient: an example a CTA of 192 threads (3 · 64 columns of 9 rows of de)
    let p = plan(
        &Op::PairwiseDotGrad,
        &[(&[4096, 351], F), (&[4096, 27, 64], F)],
        &[(&[4096, 27, 64], F)],
    )
    .unwrap();
    assert_eq!(kernels(&p), ["pairwise_dot_bwd"]);
    assert_eq!((p.calls[0].grid[0], p.calls[0].block[0]), (4096, 192));
    // 200 fields: 2278 blocks of dots, more than a CTA's threads: the gmem form
    let p = plan(&Op::PairwiseDot, &[(&[3, 200, 4], F)], &[(&[3, 19900], F)]).unwrap();
    assert_eq!(kernels(&p), ["pairwise_dot_fwd_gmem"]);
}

#[test]
fn a_packed_qkv_stored_in_bf16_is_written_and_read_as_it_is() {
    const B: DType = DType::Bf16;
    // AutoInt's projection (4096 x 27 rows, 64 -> 192) stored in bf16: the tall kernel's
    // bf16 store, no cast launch
    let rows = 4096 * 27;
    let lin = Op::Linear {
        bias: true,
        relu: false,
    };
    let p = plan(
        &lin,
        &[(&[rows, 64], F), (&[192, 64], F), (&[192], F)],
        &[(&[rows, 192], B)],
    )
    .unwrap();
    assert_eq!(kernels(&p), ["gemm_tall_n192_c_bo"]);
    assert!(p.calls[0].args.contains(&KArg::Out(0)));
    // too few rows for the tall kernels: f32 C into scratch, then one cast into the output
    let p = plan(
        &lin,
        &[(&[512, 64], F), (&[192, 64], F), (&[192], F)],
        &[(&[512, 192], B)],
    )
    .unwrap();
    let ks = kernels(&p);
    assert!(ks.len() >= 2 && !ks[0].ends_with("_bo"), "{ks:?}");
    assert!(p.calls[..ks.len() - 1]
        .iter()
        .all(|c| !c.args.contains(&KArg::Out(0))));
    assert!(p.calls[ks.len() - 1].args.contains(&KArg::Out(0)));
    assert_eq!(p.scratch, [512 * 192 * 4]);
    // one bf16 operand and a bf16 output are no layer Erase makes (both: a cross layer
    // stored in bf16, a_linear_stored_in_bf16_writes_its_copy_alone_and_its_readers_read_it)
    assert!(plan(
        &lin,
        &[(&[rows, 64], B), (&[192, 64], F), (&[192], F)],
        &[(&[rows, 192], B)],
    )
    .is_err());

    // the attention reads it in place: k and v 2·H·Dh and 4·H·Dh bytes into qkv
    let (b, h, dh) = (4096, 2, 32);
    let w = h * dh;
    let att = |packed| Op::Attention {
        heads: h,
        causal: false,
        packed,
    };
    let grad = Op::AttentionGrad {
        heads: h,
        causal: false,
        packed: true,
    };
    for (s, fwd, bwd) in [
        (
            27,
            "attn_fwd_tiny_packed_bi_d32",
            "attn_bwd_tiny_packed_bi_bo_d32",
        ),
        (
            64,
            "attn_fwd_packed_bi_d32",
            "attn_bwd_small_packed_bi_bo_d32",
        ),
    ] {
        let qkv: &[usize] = &[b, s, 3 * w];
        let o: &[usize] = &[b, s, w];
        let lse: &[usize] = &[b, h, s];
        let p = plan(&att(true), &[(qkv, B)], &[(o, F), (lse, F)]).unwrap();
        assert_eq!(kernels(&p), [fwd], "S = {s}");
        assert_eq!(
            p.calls[0].args[..3],
            [
                KArg::In(0),
                KArg::InAt(0, 2 * w as u64),
                KArg::InAt(0, 4 * w as u64)
            ]
        );
        let p = plan(&grad, &[(o, F), (qkv, B), (o, F), (lse, F)], &[(qkv, B)]).unwrap();
        assert_eq!(kernels(&p), [bwd], "S = {s}");
        assert_eq!(p.calls[0].args[2], KArg::InAt(1, 2 * w as u64));
        assert_eq!(p.calls[0].args[7], KArg::OutAt(0, 2 * w as u64));
        // an f32 dqkv from a bf16 qkv
        let p = plan(&grad, &[(o, F), (qkv, B), (o, F), (lse, F)], &[(qkv, F)]).unwrap();
        assert_eq!(kernels(&p), [bwd.replace("_bo", "").as_str()], "S = {s}");
        assert_eq!(p.calls[0].args[7], KArg::OutAt(0, 4 * w as u64));
    }
    // past one tile the staged kernels round f32 q, k, v themselves: a bf16 qkv is refused
    let err = plan(
        &att(true),
        &[(&[2, 65, 3 * w], B)],
        &[(&[2, 65, w], F), (&[2, h, 65], F)],
    )
    .unwrap_err();
    assert!(err.contains("at most 64"), "{err}");
    // only q, k, v may be bf16
    assert!(plan(
        &grad,
        &[
            (&[2, 27, w], B),
            (&[2, 27, 3 * w], B),
            (&[2, 27, w], F),
            (&[2, h, 27], F)
        ],
        &[(&[2, 27, 3 * w], B)],
    )
    .is_err());
}

#[test]
fn tma_gemms_take_descriptors_of_their_operands() {
    // the cross layer's U at batch 4096 (f32 operands rounded into scratch) and at 800 rows;
    // a weight gradient on bf16 copies (both MN-major) read in place, unsplit and split in
    // a cluster; batched GEMMs and partials keep the cp.async kernels
    let bf = DType::Bf16;
    let lin = Op::Linear {
        bias: true,
        relu: false,
    };
    let tma = PlanOptions {
        gemm_tile: Some(GemmTile { n: 128, ws: false }),
        ..PlanOptions::H200
    };
    assert!(tma.gemm_tma, "on by default");
    let main = |p: &CudaPlan| p.calls[p.calls.len() - 1].clone();
    for rows in [4096, 800] {
        let ins: [(&[usize], DType); 3] = [(&[rows, 1728], F), (&[256, 1728], F), (&[256], F)];
        let outs: [(&[usize], DType); 1] = [(&[rows, 256], F)];
        let p = plan_with(tma, &lin, &ins, &outs).unwrap();
        let c = main(&p);
        assert_eq!(c.kernel, "gemm_bf16t_128x128", "{rows} rows");
        assert_eq!(c.grid, [rows.div_ceil(128) as u32, 2, 1]);
        // the rounded operands: [Mp][Kp] and [Np][Kp], K padded to 1728 (27 steps of 64)
        let mp = rows.next_multiple_of(128) as u64;
        assert_eq!(
            c.args[..2],
            [
                KArg::TensorMap(TmaMatrix {
                    base: TmaBase::Scratch(0),
                    inner: 1728,
                    outer: mp,
                    ld: 1728,
                }),
                KArg::TensorMap(TmaMatrix {
                    base: TmaBase::Scratch(1),
                    inner: 1728,
                    outer: 256,
                    ld: 1728,
                })
            ]
        );
        assert_eq!(c.args[2], KArg::Out(0));
        assert_eq!(c.args[9], KArg::I32(1), "the bias flag");
    }
    // dw [256, 1728] = dyᵀ·x over 4096 rows from copies: A = dy [4096][256] and B = x
    // [4096][1728], both MN-major, read in place
    let op = Op::LinearGradWeight { bias: false };
    let ins: [(&[usize], DType); 2] = [(&[4096, 256], bf), (&[4096, 1728], bf)];
    let outs: [(&[usize], DType); 1] = [(&[256, 1728], F)];
    let maps = [
        KArg::TensorMap(TmaMatrix {
            base: TmaBase::In(0),
            inner: 256,
            outer: 4096,
            ld: 256,
        }),
        KArg::TensorMap(TmaMatrix {
            base: TmaBase::In(1),
            inner: 1728,
            outer: 4096,
            ld: 1728,
        }),
    ];
    let unsplit = PlanOptions {
        gemm_pipe_min_k_per_split: 1 << 20,
        ..tma
    };
    let p = plan_with(unsplit, &op, &ins, &outs).unwrap();
    assert_eq!(kernels(&p), ["gemm_bf16t_mm_128x128"]);
    assert_eq!(main(&p).args[..2], maps);
    // 28 tiles over 4096 k: four splits of 1024 in a cluster
    let p = plan_with(tma, &op, &ins, &outs).unwrap();
    assert_eq!(kernels(&p), ["gemm_bf16t_mm_128x128_k4"]);
    let c = main(&p);
    assert_eq!(c.args[..2], maps);
    assert_eq!((c.grid[2], c.args[8]), (4, KArg::I32(1024)));
    // clusters off: partials and the reduction, on the cp.async kernels
    let partials = PlanOptions {
        gemm_cluster: false,
        ..tma
    };
    assert_no_tma(&plan_with(partials, &op, &ins, &outs).unwrap());
    // switched off, the cp.async kernels
    let off = PlanOptions {
        gemm_tma: false,
        ..tma
    };
    let p = plan_with(off, &op, &ins, &outs).unwrap();
    assert_eq!(kernels(&p), ["gemm_bf16p_mm_128x128_k4"]);
}

#[test]
fn the_tma_128x64_tile_takes_outputs_that_leave_sms_idle() {
    // the CTR model's 4096 x 256 x 1728 layer: 64 CTAs of 128x128 on 132 SMs, 128 of
    // 128x64 (one wave of either, half the k work a CTA); 4096 x 1024 fills a wave of
    // 128x128 CTAs and keeps them
    let lin = Op::Linear {
        bias: true,
        relu: false,
    };
    let on = PlanOptions {
        gemm_tma_n64: LaunchSet::ALL,
        ..PlanOptions::H200
    };
    let main = |p: &CudaPlan| p.calls[p.calls.len() - 1].clone();
    let run = |opts: PlanOptions, n: usize| {
        let (w, b, y) = ([n, 1728], [n], [4096, n]);
        let ins: [(&[usize], DType); 3] = [(&[4096, 1728], F), (&w, F), (&b, F)];
        let outs: [(&[usize], DType); 1] = [(&y, F)];
        main(&plan_with(opts, &lin, &ins, &outs).unwrap())
    };
    let c = run(on, 256);
    assert_eq!(c.kernel, "gemm_bf16t_128x64");
    assert_eq!(c.grid, [32, 4, 1]);
    assert_eq!(c.smem, 4 * (128 + 64) * 64 * 2 + 1024);
    assert_eq!(c.block, [256, 1, 1]);
    assert!(matches!(c.args[0], KArg::TensorMap(_)));
    assert_eq!(run(on, 1024).kernel, "gemm_bf16t_128x128");
    // not in a plan outside the launch set (the default's outside a serial program), and
    // without the TMA kernels (sm_80, or switched off) never taken
    assert_eq!(run(PlanOptions::H200, 256).kernel, "gemm_bf16t_128x128");
    let no_tma = PlanOptions {
        gemm_tma: false,
        ..on
    };
    assert_eq!(run(no_tma, 256).kernel, "gemm_bf16p_128x128");
    // forced, it names its kernels; a split one sums in a cluster (`_k<S>`)
    let forced = PlanOptions {
        gemm_tile: Some(GemmTile { n: 64, ws: false }),
        gemm_pipe_min_k_per_split: 512,
        ..on
    };
    let c = run(forced, 256);
    assert_eq!(c.kernel, "gemm_bf16t_128x64_k2");
    assert_eq!((c.grid, c.args[8]), ([32, 4, 2], KArg::I32(896)));
    // the wave model takes it only at one CTA an SM: the 4096 x 512 x 1024 layer (128
    // CTAs of 128x128, 256 of 128x64) keeps 128x128, though both make one wave
    assert_eq!(run(on, 512).kernel, "gemm_bf16t_128x128");
    // the weight gradient on copies (both MN-major): 2 x 8 tiles of 128x64, four splits
    // of 1024 rows in a cluster (64 CTAs); at [256, 1728] 216 CTAs, so 128x128 (112)
    let op = Op::LinearGradWeight { bias: false };
    let bf = DType::Bf16;
    let ins: [(&[usize], DType); 2] = [(&[4096, 256], bf), (&[4096, 512], bf)];
    let outs: [(&[usize], DType); 1] = [(&[256, 512], F)];
    let c = main(&plan_with(on, &op, &ins, &outs).unwrap());
    assert_eq!((c.kernel, c.grid), ("gemm_bf16t_mm_128x64_k4", [2, 8, 4]));
    let wide: [(&[usize], DType); 2] = [(&[4096, 256], bf), (&[4096, 1728], bf)];
    let wide_out: [(&[usize], DType); 1] = [(&[256, 1728], F)];
    let c = main(&plan_with(on, &op, &wide, &wide_out).unwrap());
    assert_eq!((c.kernel, c.grid), ("gemm_bf16t_mm_128x128_k4", [2, 14, 4]));
    // clusters off, a split needs partials, which the TMA kernels do not write: the
    // 128x64 tile is not a candidate there
    let partials = PlanOptions {
        gemm_cluster: false,
        ..on
    };
    assert_no_tma(&plan_with(partials, &op, &ins, &outs).unwrap());
}

/// A one-output linear layer (a detached block's loss head, 3456 -> 1 at 4096 rows) runs
/// the thin kernels: the forward one launch with its bias, the data gradient one (its
/// residual and bf16 copy in the same launch), the weight gradient a split of the rows
/// with the bias gradient's partials, summed in one reduction; `gemm_thin: false` gives
/// the tiled kernels back, and bf16 operands are never the thin kernels'.
#[test]
fn a_loss_heads_gemms_run_the_thin_kernels() {
    let f = DType::F32;
    let fwd = Op::Linear {
        bias: true,
        relu: false,
    };
    let fwd_ins: &[(&[usize], DType)] = &[(&[4096, 3456], f), (&[1, 3456], f), (&[1], f)];
    let y: &[(&[usize], DType)] = &[(&[4096, 1], f)];
    let p = plan(&fwd, fwd_ins, y).expect("forward");
    assert_eq!(kernels(&p), ["gemm_thin_n1"]);
    assert_eq!(p.calls[0].grid, [512, 1, 1]);
    // flags: the bias alone; float4 loads (K a multiple of 4)
    assert_eq!(p.calls[0].args[11], KArg::I32(1));
    assert_eq!(p.calls[0].args[12], KArg::I32(1));
    let dx = Op::LinearGradInput {
        relu_mask: false,
        residual: true,
    };
    let dx_ins: &[(&[usize], DType)] = &[(&[4096, 1], f), (&[1, 3456], f), (&[4096, 3456], f)];
    let dx_outs: &[(&[usize], DType)] = &[(&[4096, 3456], f)];
    let p = plan(&dx, dx_ins, dx_outs).expect("data gradient");
    assert_eq!(kernels(&p), ["gemm_thin_k1"]);
    assert_eq!(p.calls[0].grid, [4096 * 3456 / 1024, 1, 1]);
    // the residual (bit 4), read by the one launch
    assert_eq!(p.calls[0].args[11], KArg::I32(16));
    assert_eq!(p.calls[0].args[5], KArg::In(2));
    // or, without it, the bf16 copy (bit 5) written by it
    let copied = Op::LinearGradInput {
        relu_mask: false,
        residual: false,
    };
    let copy_outs: &[(&[usize], DType)] = &[(&[4096, 3456], f), (&[4096, 3456], DType::Bf16)];
    let p = plan(&copied, &dx_ins[..2], copy_outs).expect("data gradient with a copy");
    assert_eq!(kernels(&p), ["gemm_thin_k1"]);
    assert_eq!(p.calls[0].args[11], KArg::I32(32));
    assert_eq!(p.calls[0].args[6], KArg::Out(1));
    let dw = Op::LinearGradWeight { bias: true };
    let dw_ins: &[(&[usize], DType)] = &[(&[4096, 1], f), (&[4096, 3456], f)];
    let dw_outs: &[(&[usize], DType)] = &[(&[1, 3456], f), (&[1], f)];
    let p = plan(&dw, dw_ins, dw_outs).expect("weight gradient");
    assert_eq!(kernels(&p), ["gemm_thin_m1", "gemm_splitk_reduce"]);
    // 4096 rows in 32 splits of 128, 108 column blocks of 32
    assert_eq!(p.calls[0].grid, [108, 32, 1]);
    assert_eq!(p.scratch, vec![32 * 3456 * 4, 32 * 4]);
    // the reduction sums the bias gradient's 32 partials into output 1
    assert_eq!(p.calls[1].args[9], KArg::Out(1));
    assert_eq!(p.calls[1].args[10], KArg::I32(32));
    // a small one: one split, straight to the outputs
    let small_ins: &[(&[usize], DType)] = &[(&[100, 1], f), (&[100, 64], f)];
    let small_outs: &[(&[usize], DType)] = &[(&[1, 64], f), (&[1], f)];
    let p = plan(&dw, small_ins, small_outs).expect("small weight gradient");
    assert_eq!(kernels(&p), ["gemm_thin_m1"]);
    assert_eq!(p.calls[0].args[2], KArg::Out(0));
    assert_eq!(p.calls[0].args[3], KArg::Out(1));
    assert!(p.scratch.is_empty());
    // off: the tiled kernels
    let tiled = PlanOptions {
        gemm_thin: false,
        ..PlanOptions::H200
    };
    for (op, ins, outs) in [
        (&fwd, fwd_ins, y),
        (&dx, dx_ins, dx_outs),
        (&dw, dw_ins, dw_outs),
    ] {
        let p = plan_with(tiled, op, ins, outs).expect("tiled");
        assert!(
            kernels(&p).iter().all(|k| !k.starts_with("gemm_thin")),
            "{:?}",
            kernels(&p)
        );
    }
    // a bf16 operand: not the thin kernels' (they read f32)
    let bf16_x: &[(&[usize], DType)] = &[(&[4096, 1], f), (&[4096, 3456], DType::Bf16)];
    let dw_plain = Op::LinearGradWeight { bias: false };
    let p = plan(&dw_plain, bf16_x, &dw_outs[..1]).expect("bf16 x");
    assert!(kernels(&p).iter().all(|k| !k.starts_with("gemm_thin")));
    // and the environment turns them off
    let env = PlanOptions::H200
        .with_env(|v| (v == "ERASE_GEMM_THIN").then(|| "0".to_string()))
        .expect("env");
    assert!(!env.gemm_thin);
    let bad = PlanOptions::H200.with_env(|v| (v == "ERASE_GEMM_THIN").then(|| "2".to_string()));
    assert!(bad.unwrap_err().contains("ERASE_GEMM_THIN=2"));
}

/// A cross layer's up-projection stored in bf16 (Graph::linear_stored_bf16): one launch of
/// the pipelined kernels' copy form stores C in bf16 alone (flags bit 6, the output passed
/// as C and as the copy), and the cross update and its gradient read it as it is (`_b16`).
#[test]
fn a_linear_stored_in_bf16_writes_its_copy_alone_and_its_readers_read_it() {
    let b = DType::Bf16;
    let fwd = Op::Linear {
        bias: true,
        relu: false,
    };
    for opts in [
        PlanOptions::H200,
        PlanOptions {
            gemm_tma: false,
            ..PlanOptions::H200
        },
    ] {
        // DCNv2's (4096 x 512 -> 3456) and the spec model's (4096 x 256 -> 1728), and the
        // GPU test's ragged shapes (edge tiles; an odd N, the epilogues' scalar stores)
        for (m, k, n) in [
            (4096, 512, 3456),
            (4096, 256, 1728),
            (1000, 192, 200),
            (515, 128, 203),
        ] {
            let ins: &[(&[usize], DType)] = &[(&[m, k], b), (&[n, k], b), (&[n], F)];
            let outs: &[(&[usize], DType)] = &[(&[m, n], b)];
            let p = plan_with(opts, &fwd, ins, outs).expect("stored in bf16");
            assert_eq!(p.calls.len(), 1, "{:?}", kernels(&p));
            let c = &p.calls[0];
            assert!(
                pipelined(c.kernel) && c.kernel.contains("_c_"),
                "{}",
                c.kernel
            );
            let (flags, copy) = if c.kernel.starts_with("gemm_bf16t") {
                (&c.args[9], &c.args[10])
            } else {
                (&c.args[16], &c.args[17])
            };
            // bias (bit 0) and C alone in bf16 (bit 6)
            assert_eq!(*flags, KArg::I32(1 | 64), "{}", c.kernel);
            assert_eq!(c.args[2], KArg::Out(0));
            assert_eq!(*copy, KArg::Out(0));
            assert!(p.scratch.is_empty());
        }
    }
    // f32 operands stored in bf16 keep their path (C to scratch and a cast, or the tall
    // kernels' own bf16 store): no bit 6 anywhere
    let ins: &[(&[usize], DType)] = &[(&[4096, 512], F), (&[3456, 512], F), (&[3456], F)];
    let p = plan(&fwd, ins, &[(&[4096, 3456], b)]).expect("f32 operands");
    assert!(kernels(&p).contains(&"ew_cast"), "{:?}", kernels(&p));
    // the cross update reads b in bf16, with and without its own copy
    let s: &[usize] = &[4096, 3456];
    let p = plan(&Op::MulAdd, &[(s, F), (s, b), (s, F)], &[(s, F)]).expect("mul_add");
    assert_eq!(kernels(&p), ["ew_mul_add_b16"]);
    let p = plan(&Op::MulAdd, &[(s, F), (s, b), (s, F)], &[(s, F), (s, b)]).expect("with a copy");
    assert_eq!(kernels(&p), ["ew_mul_add_bf16_b16"]);
    let p = plan(&Op::MulAdd, &[(s, F), (s, F), (s, F)], &[(s, F)]).expect("f32");
    assert_eq!(kernels(&p), ["ew_mul_add"]);
    // and its gradient: [dy, x0, v] -> [dx0, dv in bf16, dv's column sums]
    let p = plan(
        &Op::MulGrad { plus_dy: false },
        &[(s, F), (s, F), (s, b)],
        &[(s, F), (s, b), (&[3456], F)],
    )
    .expect("mul_grad");
    assert_eq!(kernels(&p), ["ew_mul_grad_bf16_b16", "colsum_final"]);
    // a bf16 a (the other factor) alone is not a form the kernels have
    let e = plan(&Op::MulAdd, &[(s, b), (s, F), (s, F)], &[(s, F)]).unwrap_err();
    assert!(e.contains("input 0 is bf16"), "{e}");
    // a cross network stored in bf16 (Graph::set_bf16_cross): a, b and c bf16, the update
    // in bf16, or in f32 with or without its copy; x0's copy read by the gradient too
    let all: &[(&[usize], DType)] = &[(s, b), (s, b), (s, b)];
    for (outs, k) in [
        (vec![(s, b)], "ew_mul_add_s16"),
        (vec![(s, F)], "ew_mul_add_s16_f32"),
        (vec![(s, F), (s, b)], "ew_mul_add_s16_f32c"),
    ] {
        let p = plan(&Op::MulAdd, all, &outs).expect("stored in bf16");
        assert_eq!(kernels(&p), [k]);
        assert_eq!(p.calls[0].args[3], KArg::Out(0));
    }
    let p = plan(
        &Op::MulGrad { plus_dy: false },
        &[(s, F), (s, b), (s, b)],
        &[(s, F), (s, b), (&[3456], F)],
    )
    .expect("mul_grad of x0's copy");
    assert_eq!(kernels(&p), ["ew_mul_grad_bf16_a16_b16", "colsum_final"]);
    // with dy added to da (the first cross layer's x0 ⊙ v + x0)
    let plus = Op::MulGrad { plus_dy: true };
    let p = plan(
        &plus,
        &[(s, F), (s, b), (s, b)],
        &[(s, F), (s, b), (&[3456], F)],
    )
    .expect("mul_grad plus dy");
    assert_eq!(kernels(&p), ["ew_mul_grad_bf16_a16_b16_dy", "colsum_final"]);
    let e = plan(
        &plus,
        &[(s, F), (s, F), (s, b)],
        &[(s, F), (s, b), (&[3456], F)],
    )
    .unwrap_err();
    assert!(e.contains("dy added to da"), "{e}");
    let e = plan(&plus, &[(s, F), (s, F), (s, F)], &[(s, F), (s, F)]).unwrap_err();
    assert!(e.contains("dy added to da"), "{e}");
    // a bf16 update of f32 operands is refused, naming it
    let e = plan(&Op::MulAdd, &[(s, F), (s, b), (s, F)], &[(s, b)]).unwrap_err();
    assert!(e.contains("output 0 is bf16"), "{e}");
}

/// The fused cross update (`LinearMulAdd`): the update in the epilogue of the one TMA
/// launch that writes the layer's output (f32, or bf16 alone), z's copy where the node
/// has one (flags bit 7); switched off, or where the GEMM is not that launch, the
/// update's own launch after the GEMM, its operands named as the node's.
#[test]
fn a_fused_cross_update_runs_in_its_gemms_epilogue_where_one_tma_launch_writes_y() {
    let bf = DType::Bf16;
    let op = Op::LinearMulAdd { bias: true };
    // DCNv2's up-projection at batch 4096: u [4096, 512] and w [3456, 512] as bf16
    // copies, then x0 and x; y stored in bf16 or in f32
    let (rows, width) = (4096usize, 3456usize);
    let ins = |copies: bool| -> Vec<(&'static [usize], DType)> {
        let t = if copies { bf } else { F };
        let leak = |v: Vec<usize>| -> &'static [usize] { Box::leak(v.into_boxed_slice()) };
        vec![
            (leak(vec![rows, 512]), t),
            (leak(vec![width, 512]), t),
            (leak(vec![width]), F),
            (leak(vec![rows, width]), F),
            (leak(vec![rows, width]), F),
        ]
    };
    let y: &[usize] = &[rows, width];
    for (y_dtype, kernel, bf16_only) in [
        (bf, "gemm_bf16t_c_128x128_ma", 64),
        (F, "gemm_bf16t_128x128_ma", 0),
    ] {
        for copy in [true, false] {
            let mut outs: Vec<(&[usize], DType)> = vec![(y, y_dtype), (y, F)];
            if copy {
                outs.push((y, bf));
            }
            let p = plan(&op, &ins(true), &outs).unwrap();
            assert_eq!(kernels(&p), [kernel], "y {y_dtype}, copy {copy}");
            let c = &p.calls[0];
            assert_eq!(c.grid, [32, 27, 1]);
            let copy_flag = if copy { 128 } else { 0 };
            assert_eq!(c.args[9], KArg::I32(1 | bf16_only | copy_flag));
            let z_copy = if copy { KArg::Out(2) } else { KArg::Out(1) };
            assert_eq!(
                c.args[11..],
                [KArg::In(3), KArg::In(4), KArg::Out(1), z_copy],
                "a, c, z and z's copy"
            );
            assert_eq!(c.args.len(), 15);
            // switched off: the layer's own plan, then the update reading y as it is
            let off = PlanOptions {
                gemm_mul_add_epilogue: false,
                ..PlanOptions::H200
            };
            let p = plan_with(off, &op, &ins(true), &outs).unwrap();
            let update = match (copy, y_dtype == bf) {
                (true, true) => "ew_mul_add_bf16_b16",
                (false, true) => "ew_mul_add_b16",
                (true, false) => "ew_mul_add_bf16",
                (false, false) => "ew_mul_add",
            };
            let ks = kernels(&p);
            assert_eq!(ks.last(), Some(&update), "{ks:?}");
            assert!(
                ks[..ks.len() - 1].iter().all(|k| k.starts_with("gemm_")),
                "{ks:?}"
            );
            let u = &p.calls[p.calls.len() - 1];
            let mut want = vec![KArg::In(3), KArg::Out(0), KArg::In(4), KArg::Out(1)];
            if copy {
                want.push(KArg::Out(2));
            }
            assert_eq!(u.args[..want.len()], want[..]);
        }
    }
    // f32 operands on the single-launch kernels (a small layer): the update's own launch
    let small = |n: usize| -> Vec<(&'static [usize], DType)> {
        let leak = |v: Vec<usize>| -> &'static [usize] { Box::leak(v.into_boxed_slice()) };
        vec![
            (leak(vec![64, 32]), F),
            (leak(vec![n, 32]), F),
            (leak(vec![n]), F),
            (leak(vec![64, n]), F),
            (leak(vec![64, n]), F),
        ]
    };
    let p = plan(&op, &small(48), &[(&[64, 48], F), (&[64, 48], F)]).unwrap();
    assert_eq!(kernels(&p).last(), Some(&"ew_mul_add"), "{:?}", kernels(&p));
    assert!(!kernels(&p).iter().any(|k| k.ends_with("_ma")));
    // a wrong operand list is refused, naming what it expected
    let e = plan(&op, &small(48)[..4], &[(&[64, 48], F), (&[64, 48], F)]).unwrap_err();
    assert!(e.contains("expected 5 inputs"), "{e}");
}
