//! bf16 copies of GEMM operands (`Graph::set_bf16_copies`, `--bf16-copies`): where the
//! CTR model gets them, and that they change no value beyond summation order: a step on
//! the CPU that rounds GEMM operands as the kernels do gives the same loss and gradients
//! with and without them.

use erase::data::synthetic::{SyntheticConfig, SyntheticCtr};
use erase::graph::{DType, Grad, Leaf, Op, OptimizerConfig, Phase, Tensor};
use erase::model::ctr::{CtrConfig, Variant};
use erase::runtime::cpu::runner::ProgramRunner;
use erase::runtime::program::memory::plan_memory;
use erase::train::{plan_step, ScheduleOptions, StepPlan};

/// The spec's model at batch 128 (every large layer has 128 rows: the least that gets
/// copies), with copies for every layer of 128-multiple sizes, or none.
fn plan(variant: Variant, copies: bool) -> StepPlan {
    plan_model("spec", variant, copies)
}

/// [`plan`] of the zoo model `model`.
fn plan_model(model: &str, variant: Variant, copies: bool) -> StepPlan {
    plan_full(model, variant, copies, true, true)
}

// (these plans keep the cross updates apart from their layers, as the graph builds them:
// `cross_updates_fused_with_their_layers_train_to_the_same_bits` fuses them)

/// [`plan_model`] with the cross layers' up-projections stored in bf16 or not.
fn plan_stored(model: &str, variant: Variant, copies: bool, storage: bool) -> StepPlan {
    plan_full(model, variant, copies, storage, true)
}

/// [`plan_model`], the weights' copies made by Adam (`in_update`, the default) or by
/// RoundBf16 launches in the forward.
fn plan_with(model: &str, variant: Variant, copies: bool, in_update: bool) -> StepPlan {
    plan_full(model, variant, copies, true, in_update)
}

fn plan_full(
    model: &str,
    variant: Variant,
    copies: bool,
    storage: bool,
    in_update: bool,
) -> StepPlan {
    plan_sched(
        model,
        variant,
        ScheduleOptions {
            bf16_copies: copies,
            bf16_copy_min_flops: 0,
            bf16_storage: storage,
            // the cross networks in f32 but for their up-projections (see
            // `cross_networks_stored_in_bf16_...` for them in bf16)
            bf16_cross: false,
            weight_copies_in_update: in_update,
            fuse_cross_updates: false,
            ..Default::default()
        },
    )
}

/// The relative L2 distance of `a` from `b`.
fn rel_l2(a: &[f64], b: &[f64]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    (num / den.max(1e-300)).sqrt()
}

/// The plan of `model` at batch 128 (1000 rows a table) under `sched`.
fn plan_sched(model: &str, variant: Variant, sched: ScheduleOptions) -> StepPlan {
    let mut cfg = CtrConfig {
        model: model.to_string(),
        ..CtrConfig::default()
    }
    .with_variant(variant);
    cfg.batch = 128;
    cfg.rows = 1000;
    plan_step(&cfg, DType::F32, &OptimizerConfig::default(), &sched).unwrap()
}

#[test]
fn the_ctr_models_large_layers_share_one_rounding_of_each_operand() {
    let p = plan(Variant::Erase, true);
    let g = &p.model.graph;
    let rounds: Vec<_> = g
        .nodes()
        .iter()
        .filter(|n| matches!(n.op, Op::RoundBf16 { .. }))
        .collect();
    let forward = rounds.iter().filter(|n| n.phase == Phase::Forward).count();
    let backward: Vec<_> = rounds
        .iter()
        .filter(|n| n.phase == Phase::Backward)
        .collect();
    // the weights' copies, kept by Adam (Leaf::ParamCopy): the weight of each of the 14
    // layers with sizes that are multiples of 64, at least 128 (read by its forward and
    // data gradient); no forward RoundBf16 node is left; backward: the
    // dy of each of them (the bottom's second, the 3 + 3 cross, 2 deep, 3 MaskNet and 2
    // top layers) but the 4 whose dy an elementwise product's gradient writes as the copy
    // (cross's three up-projections, MaskNet's mask) and the 3 whose dy the data
    // gradient of the layer above writes as the copy from its epilogue (cross's three
    // low-rank layers) and the 1 whose dy a layer norm's gradient writes as the copy
    // (MaskNet's projection before its layer norm)
    let names: Vec<&str> = rounds
        .iter()
        .filter(|n| n.phase == Phase::Forward)
        .map(|n| n.name.as_str())
        .collect();
    let weights = g
        .tensors()
        .filter(|&t| matches!(g.leaf(t), Some(Leaf::ParamCopy { .. })))
        .count();
    assert_eq!(weights, 14, "weight copies");
    assert_eq!(forward, 0, "forward copies: {names:?}");
    assert_eq!(backward.len(), 6, "backward copies");
    // MaskNet's normalised projection's dy from its layer norm's gradient, with the sums
    let by_norm: Vec<(&str, usize)> = g
        .nodes()
        .iter()
        .filter(|n| matches!(n.op, Op::LayerNormGrad) && n.outputs.len() == 5)
        .map(|n| (n.name.as_str(), n.outputs.len()))
        .collect();
    assert_eq!(by_norm, [("masknet/layer_norm0.grad", 5)]);
    let by_gemm: Vec<&str> = g
        .nodes()
        .iter()
        .filter(|n| matches!(n.op, Op::LinearGradInput { .. }) && n.outputs.len() == 2)
        .map(|n| n.name.as_str())
        .collect();
    assert_eq!(
        by_gemm,
        ["cross/linear5.dx", "cross/linear3.dx", "cross/linear1.dx"]
    );
    let by_product: Vec<(&str, usize)> = g
        .nodes()
        .iter()
        .filter(|n| matches!(n.op, Op::MulGrad { .. }) && g.dtype(n.outputs[1]) == DType::Bf16)
        .map(|n| (n.name.as_str(), n.outputs.len()))
        .collect();
    // each with its column sums: the layer's bias gradient
    assert_eq!(
        by_product,
        [
            ("masknet/mul0.grad", 3),
            ("cross/mul_add2.grad", 3),
            ("cross/mul_add1.grad", 3),
            ("cross/mul_add0.grad", 3)
        ]
    );
    // every activation they read is copied by the node that makes it, in the same pass:
    // the concats (E, the top's input), the elementwise products (cross's x1 and x2,
    // MaskNet's masked input) and the linear layers (the bottom MLP's first hidden layer,
    // cross's three low-rank outputs, MaskNet's and deep's hidden layers, the top's
    // hidden layer)
    let fused: Vec<&str> = g
        .nodes()
        .iter()
        .filter(|n| g.copy_output(n).is_some())
        .map(|n| n.name.as_str())
        .collect();
    assert_eq!(
        fused,
        [
            "bottom/linear0",
            "embedding/concat0",
            "cross/linear0",
            "cross/mul_add0",
            "cross/linear2",
            "cross/mul_add1",
            "cross/linear4",
            "masknet/linear0",
            "masknet/mul0",
            "deep/linear0",
            "top/concat0",
            "top/linear0"
        ]
    );
    // a ReLU layer's copy still lets the next layer's data gradient apply its mask
    let masked_dx = |g: &erase::graph::Graph| {
        g.nodes()
            .iter()
            .filter(|n| {
                matches!(
                    n.op,
                    Op::LinearGradInput {
                        relu_mask: true,
                        ..
                    }
                )
            })
            .count()
    };
    let off = plan(Variant::Erase, false);
    assert_eq!(masked_dx(g), masked_dx(&off.model.graph));
    // E's one copy is read by three forward GEMMs and their three weight gradients
    let e = g.find("embedding/concat0").expect("E");
    let copy = g.copy_output(g.producer(e)).expect("a copy of E");
    // the copy and its reshaped views
    let mut views = vec![copy];
    for n in g.nodes() {
        if matches!(n.op, Op::Reshape) && views.contains(&n.inputs[0]) {
            views.push(n.outputs[0]);
        }
    }
    let readers: Vec<&Op> = g
        .nodes()
        .iter()
        .filter(|n| !matches!(n.op, Op::Reshape) && n.inputs.iter().any(|t| views.contains(t)))
        .map(|n| &n.op)
        .collect();
    assert_eq!(
        readers
            .iter()
            .filter(|o| matches!(o, Op::Linear { .. }))
            .count(),
        3
    );
    assert_eq!(
        readers
            .iter()
            .filter(|o| matches!(o, Op::LinearGradWeight { bias: false }))
            .count(),
        3
    );
    // a layer with a bias takes its bias gradient from its dy's rounding pass
    assert!(backward
        .iter()
        .any(|n| matches!(n.op, Op::RoundBf16 { col_sums: true }) && n.outputs.len() == 2));
    // a weight gradient sums a bias from a bf16 dy only where an attention gradient
    // wrote dy in bf16 (AutoInt's QKV projections, whose x is f32): one per layer
    let from_bf16: Vec<&str> = g
        .nodes()
        .iter()
        .filter(|n| {
            matches!(n.op, Op::LinearGradWeight { bias: true })
                && g.dtype(n.inputs[0]) == DType::Bf16
        })
        .map(|n| {
            let dy = g.producer(n.inputs[0]);
            assert!(
                matches!(dy.op, Op::AttentionGrad { packed: true, .. }),
                "{}: a bf16 dy from {}",
                n.name,
                dy.name
            );
            assert_eq!(g.dtype(n.inputs[1]), DType::F32, "{}: x", n.name);
            n.name.as_str()
        })
        .collect();
    assert_eq!(from_bf16.len(), 2, "{from_bf16:?}");
    // AutoInt's QKV projections store their output in bf16 (Graph::linear_for_attention):
    // the attention reads it as it is, forward and backward, and rounds q, k, v anyway;
    // the cross layers' up-projections too (Graph::linear_stored_bf16), read by their
    // cross update and its gradient
    let (cross, stored): (Vec<&erase::graph::Node>, Vec<&erase::graph::Node>) = g
        .nodes()
        .iter()
        .filter(|n| matches!(n.op, Op::Linear { .. }) && g.dtype(n.outputs[0]) == DType::Bf16)
        .partition(|n| n.name.starts_with("cross/"));
    let cross: Vec<&str> = cross
        .into_iter()
        .map(|n| {
            let readers: Vec<&Op> = g
                .nodes()
                .iter()
                .filter(|r| r.inputs.contains(&n.outputs[0]))
                .map(|r| &r.op)
                .collect();
            // (the first update's gradient folds x0's two contributions: plus_dy,
            // `cross_grad_fold`, on by default)
            assert!(
                matches!(readers[..], [&Op::MulAdd, &Op::MulGrad { .. }]),
                "{}: the cross update and its gradient: {readers:?}",
                n.name
            );
            assert!(
                n.inputs[..2].iter().all(|&t| g.dtype(t) == DType::Bf16),
                "{}: stored in bf16 from its operands' copies",
                n.name
            );
            n.name.as_str()
        })
        .collect();
    assert_eq!(cross, ["cross/linear1", "cross/linear3", "cross/linear5"]);
    let stored: Vec<&str> = stored
        .into_iter()
        .map(|n| {
            let readers: Vec<&Op> = g
                .nodes()
                .iter()
                .filter(|r| r.inputs.contains(&n.outputs[0]))
                .map(|r| &r.op)
                .collect();
            assert!(
                readers.iter().all(|o| matches!(
                    o,
                    Op::Attention { packed: true, .. } | Op::AttentionGrad { packed: true, .. }
                )),
                "{}: a bf16 output read by {readers:?}",
                n.name
            );
            assert_eq!(
                readers.len(),
                2,
                "{}: the attention and its gradient",
                n.name
            );
            n.name.as_str()
        })
        .collect();
    assert_eq!(stored, ["autoint/linear0", "autoint/linear1"]);
    assert!(off
        .model
        .graph
        .nodes()
        .iter()
        .all(|n| !matches!(n.op, Op::Linear { .. })
            || off.model.graph.dtype(n.outputs[0]) == DType::F32));
    // and without copies every attention gradient stays f32
    assert!(off.model.graph.nodes().iter().all(|n| {
        !matches!(n.op, Op::AttentionGrad { .. })
            || off.model.graph.dtype(n.outputs[0]) == DType::F32
    }));
    // no copies when off
    assert!(off
        .model
        .graph
        .nodes()
        .iter()
        .all(|n| !matches!(n.op, Op::RoundBf16 { .. })));
}

/// One step on the golden-style batch with GEMM operands rounded as the kernels round
/// them; returns the runner and the dense gradients by parameter name.
fn step(p: &StepPlan) -> (Vec<f64>, Vec<(String, Vec<f64>)>) {
    let m = &p.model;
    let g = &m.graph;
    let mut keep = vec![m.logit, m.main_loss];
    let mut grads: Vec<(String, Tensor)> = Vec::new();
    for (&param, grad) in &p.training.grads.by_param {
        if let Grad::Dense(t) = grad {
            keep.push(*t);
            grads.push((g.name(param).to_string(), *t));
        }
    }
    let memory = plan_memory(g, &p.program, &keep);
    let mut r = ProgramRunner::new(g, &p.program, &memory, 7, 2).unwrap();
    r.bf16_gemm = true;
    let gen = SyntheticCtr::new(SyntheticConfig {
        seed: 0,
        rows: 1000,
        hot: 1,
    });
    let b = 128;
    let (mut d, mut ids, mut y) = (vec![0f32; b * 13], vec![0u32; b * 26], vec![0f32; b]);
    gen.fill_batch(1, 0, b, &mut d, &mut ids, &mut y);
    let (bd, bi, bo, bl) = m.batch_buffers(&d, &ids, &y).unwrap();
    for (t, buf) in [
        (m.inputs.dense, bd),
        (m.inputs.ids, bi),
        (m.inputs.offsets, bo),
        (m.inputs.label, bl),
    ] {
        r.feed(t, buf).unwrap();
    }
    r.run().unwrap();
    let logits = r.get(m.logit).unwrap().to_f64();

    let mut out: Vec<(String, Vec<f64>)> = grads
        .into_iter()
        .map(|(n, t)| (n, r.get(t).unwrap().to_f64()))
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    (logits, out)
}

#[test]
fn bf16_copies_give_the_values_of_rounding_in_every_gemm() {
    // (DCNv2: the top reads its copy of the detached cross network's output)
    // (the cross layers' outputs in f32, as without copies: their bf16 storage is
    // another rounding, below)
    for (model, variant) in [
        ("spec", Variant::Baseline),
        ("spec", Variant::Erase),
        ("dcnv2", Variant::Erase),
    ] {
        let (logits_on, on) = step(&plan_stored(model, variant, true, false));
        let (logits_off, off) = step(&plan_model(model, variant, false));
        // the forward multiplies the same bf16 values in the same order
        assert_eq!(logits_on, logits_off, "{model} {variant}: logits");
        assert_eq!(on.len(), off.len());
        let mut worst = 0f64;
        for ((name, a), (name_b, b)) in on.iter().zip(&off) {
            assert_eq!(name, name_b);
            // the same products; only the order in which a shared input's gradient
            // contributions are summed differs (f32: a few units in the last place)
            let rel = rel_l2(a, b);
            // except AutoInt's QKV biases: their dy (dqkv) is written in bf16, as its
            // GEMMs read it, and the bias gradient sums those values (as autocast does
            // in PyTorch): each term within 2^-9 of the f32 one
            let tol = if name.starts_with("autoint/qkv.") && name.ends_with(".bias") {
                2f64.powi(-8)
            } else {
                1e-5
            };
            assert!(
                rel <= tol,
                "{model} {variant}: gradient of {name}: relative L2 difference {rel:.2e}"
            );
            if tol == 1e-5 {
                worst = worst.max(rel);
            }
        }
        println!(
            "{model} {variant}: gradients within {worst:.2e} (relative L2) of rounding in \
             every GEMM, AutoInt's QKV biases aside"
        );
    }
}

/// Made in the forward (`--weight-copies forward`), under ERASE the weights' copies
/// (forward work that reads only parameters) run on the first side stream behind the
/// step's first forward launch, off the main stream that carries the forward; the serial
/// schedules keep them on the main stream.
#[test]
fn weight_copies_run_beside_the_forward_under_erase() {
    use erase::runtime::program::schedule::{EdgeKind, StreamId};
    let cfg = CtrConfig::default().with_variant(Variant::Erase);
    let forward = ScheduleOptions {
        weight_copies_in_update: false,
        ..Default::default()
    };
    let p = plan_step(&cfg, DType::F32, &OptimizerConfig::default(), &forward).unwrap();
    let g = &p.model.graph;
    let copies: Vec<usize> = p
        .program
        .launches
        .iter()
        .enumerate()
        .filter(|(_, l)| {
            let n = g.node(l.node);
            matches!(n.op, Op::RoundBf16 { .. }) && g.leaf(n.inputs[0]).is_some()
        })
        .map(|(i, _)| i)
        .collect();
    let names: Vec<&str> = copies
        .iter()
        .map(|&i| g.node(p.program.launches[i].node).name.as_str())
        .collect();
    // the spec's layers of at least 2^29 FLOPs: cross U and V (3 each), MaskNet's three,
    // deep's first two, top's first two
    assert_eq!(
        copies.len(),
        13,
        "weight copies at the CUDA threshold: {names:?}"
    );
    assert!(copies
        .iter()
        .all(|&i| p.program.launches[i].stream == StreamId(1)));
    let first = &p.program.launches[copies[0]];
    assert!(
        first.waits.iter().any(|w| w.kind == EdgeKind::Start),
        "the first weight copy waits for the step's first forward launch"
    );
    assert_eq!(copies[0], 1, "right behind the first forward launch");
    let base = plan_step(
        &cfg.clone().with_variant(Variant::Baseline),
        DType::F32,
        &OptimizerConfig::default(),
        &forward,
    )
    .unwrap();
    assert!(base
        .program
        .launches
        .iter()
        .all(|l| l.stream == StreamId::MAIN));
}

/// A data-parallel plan with copies (the defaults) keeps each backward program on one
/// stream: its gradients, the bias gradients from the dy copies included, are all-reduced
/// after its last launch, on that launch's stream.
#[test]
fn data_parallel_plans_with_copies_keep_each_program_on_one_stream() {
    let cfg = CtrConfig::default().with_variant(Variant::Erase);
    let p = erase::train::plan_step_data_parallel(
        &cfg,
        DType::F32,
        &OptimizerConfig::default(),
        &ScheduleOptions::default(),
    )
    .unwrap();
    let g = &p.model.graph;
    assert!(g
        .nodes()
        .iter()
        .any(|n| matches!(n.op, Op::RoundBf16 { col_sums: true })));
    for prog in &p.partition.programs {
        let streams: std::collections::BTreeSet<_> = p
            .program
            .launches
            .iter()
            .filter(|l| prog.nodes.contains(&l.node))
            .map(|l| l.stream)
            .collect();
        assert!(
            streams.len() <= 1,
            "program {} runs on {streams:?}",
            prog.name
        );
    }
}

/// A detached block's output that a large layer reads (DCNv2's cross network, read by
/// the top's first layer) gets its bf16 copy from the block's last op, in the same pass,
/// through a detach of that op's copy: no RoundBf16 launch after the block.
#[test]
fn a_detached_blocks_output_gets_its_copy_from_the_blocks_last_op() {
    for variant in [Variant::Detached, Variant::Erase] {
        let p = plan_model("dcnv2", variant, true);
        let g = &p.model.graph;
        let detach_of_copy = g
            .nodes()
            .iter()
            .find(|n| matches!(n.op, Op::Detach) && g.dtype(n.inputs[0]) == DType::Bf16);
        let Some(d) = detach_of_copy else {
            panic!("{variant}: no detach of a bf16 copy")
        };
        let src = g.producer(d.inputs[0]);
        assert!(
            matches!(src.op, Op::MulAdd) && src.outputs.get(1) == Some(&d.inputs[0]),
            "{variant}: the copy is {} of {}",
            g.name(d.inputs[0]),
            src.name
        );
        // the top's first layer reads it
        assert!(g
            .nodes()
            .iter()
            .any(|n| matches!(n.op, Op::Linear { .. }) && n.inputs[0] == d.outputs[0]));
        for n in g.nodes() {
            if matches!(n.op, Op::RoundBf16 { .. }) {
                assert!(
                    !matches!(g.producer(n.inputs[0]).op, Op::Detach),
                    "{variant}: {} rounds a detached output",
                    n.name
                );
            }
        }
    }
}

/// The cross layers' up-projections stored in bf16 (`ScheduleOptions::bf16_storage`, as
/// autocast stores them): the step is that of rounding each to bf16 once, so the logits
/// and gradients move by bf16 rounding's own size, not more, and not at all without
/// copies (the CPU's plans).
#[test]
fn cross_layers_stored_in_bf16_move_the_step_by_one_rounding() {
    for (model, variant) in [("spec", Variant::Erase), ("dcnv2", Variant::Baseline)] {
        let stored = plan_stored(model, variant, true, true);
        let g = &stored.model.graph;
        let n = g
            .nodes()
            .iter()
            .filter(|n| {
                n.name.starts_with("cross/")
                    && matches!(n.op, Op::Linear { .. })
                    && g.dtype(n.outputs[0]) == DType::Bf16
            })
            .count();
        assert_eq!(n, 3, "{model}: three up-projections stored in bf16");
        let (logits_s, grads_s) = step(&stored);
        let (logits_f, grads_f) = step(&plan_stored(model, variant, true, false));
        let l = rel_l2(&logits_s, &logits_f);
        assert!(l > 0.0, "{model}: the stored values are rounded");
        assert!(l <= 2f64.powi(-8), "{model}: logits move by {l:.2e}");
        let mut worst = 0f64;
        for ((name, a), (name_b, b)) in grads_s.iter().zip(&grads_f) {
            assert_eq!(name, name_b);
            let r = rel_l2(a, b);
            assert!(
                r <= 2f64.powi(-5),
                "{model}: gradient of {name} moves by {r:.2e}"
            );
            worst = worst.max(r);
        }
        println!("{model} {variant}: logits {l:.2e}, gradients at most {worst:.2e} (relative L2)");
        // without copies there is nothing to store in bf16
        let plain = plan_stored(model, variant, false, true);
        assert!(plain
            .model
            .graph
            .nodes()
            .iter()
            .all(|n| !matches!(n.op, Op::Linear { .. })
                || plain.model.graph.dtype(n.outputs[0]) == DType::F32));
    }
}

/// By default Adam keeps the weights' copies: no launch of the step rounds a weight; each
/// copy is a `Leaf::ParamCopy` of its weight, read in place by the GEMMs and written by
/// the dense update past its moments, in the order of the weights it follows.
#[test]
fn adam_keeps_the_weights_copies_from_one_step_to_the_next() {
    for variant in [Variant::Baseline, Variant::Erase] {
        let cfg = CtrConfig::default().with_variant(variant);
        let p = plan_step(
            &cfg,
            DType::F32,
            &OptimizerConfig::default(),
            &ScheduleOptions::default(),
        )
        .unwrap();
        let g = &p.model.graph;
        let rounds_a_weight = |l: &erase::runtime::program::schedule::Launch| {
            let n = g.node(l.node);
            matches!(n.op, Op::RoundBf16 { .. }) && g.leaf(n.inputs[0]).is_some()
        };
        assert!(
            !p.program.launches.iter().any(rounds_a_weight),
            "{variant}: a launch rounds a weight"
        );
        let adam = g
            .nodes()
            .iter()
            .find(|n| matches!(n.op, Op::Adam { .. }))
            .expect("the dense update");
        let n = adam.inputs.len() - 1;
        let copies = &adam.updates[3 * n..];
        // the 13 layers of at least 2^29 FLOPs, as `weight_copies_run_beside_the_forward_under_erase`
        assert_eq!(copies.len(), 13, "{variant}");
        for (k, &c) in copies.iter().enumerate() {
            let of = adam.updates[k];
            assert_eq!(
                g.leaf(c),
                Some(&Leaf::ParamCopy { of }),
                "{variant}: copy {k}"
            );
            assert_eq!(g.param_copy(of), Some(c));
            assert_eq!(g.dtype(c), DType::Bf16);
            assert_eq!(g.shape(c), g.shape(of));
            let readers: Vec<&Op> = g
                .nodes()
                .iter()
                .filter(|r| r.inputs.contains(&c))
                .map(|r| &r.op)
                .collect();
            assert!(
                !readers.is_empty()
                    && readers.iter().all(|o| matches!(
                        o,
                        Op::Linear { .. } | Op::LinearMulAdd { .. } | Op::LinearGradInput { .. }
                    )),
                "{}: read by {readers:?}",
                g.name(c)
            );
            assert!(!g.is_persistent(c), "a copy is not checkpointed");
        }
        // the weights without copies follow, and every one of them has no copy
        assert!(adam.updates[copies.len()..n]
            .iter()
            .all(|&w| g.param_copy(w).is_none()));
    }
}

/// Runs `steps` training steps of `p` on the CPU with GEMM operands rounded as the
/// kernels round them, each on its own batch; returns the runner and each step's logits.
fn train<'a>(
    p: &'a StepPlan,
    memory: &'a erase::runtime::program::memory::MemoryPlan,
    steps: usize,
) -> (ProgramRunner<'a>, Vec<Vec<f64>>) {
    let m = &p.model;
    let mut r = ProgramRunner::new(&m.graph, &p.program, memory, 7, 2).unwrap();
    r.bf16_gemm = true;
    let gen = SyntheticCtr::new(SyntheticConfig {
        seed: 0,
        rows: 1000,
        hot: 1,
    });
    let b = 128;
    let mut logits = Vec::new();
    for s in 0..steps {
        let (mut d, mut ids, mut y) = (vec![0f32; b * 13], vec![0u32; b * 26], vec![0f32; b]);
        gen.fill_batch(1, (s * b) as u64, b, &mut d, &mut ids, &mut y);
        let (bd, bi, bo, bl) = m.batch_buffers(&d, &ids, &y).unwrap();
        for (t, buf) in [
            (m.inputs.dense, bd),
            (m.inputs.ids, bi),
            (m.inputs.offsets, bo),
            (m.inputs.label, bl),
        ] {
            r.feed(t, buf).unwrap();
        }
        r.run().unwrap();
        logits.push(r.get(m.logit).unwrap().to_f64());
    }
    (r, logits)
}

/// Copies kept by Adam train to the bits of copies made in each forward, step after
/// step: the same logits and the same parameters; each copy is its weight rounded after
/// every update, and again after the weight is set from outside (a checkpoint loaded).
#[test]
fn copies_kept_by_adam_train_to_the_bits_of_copies_made_each_step() {
    for model in ["spec", "dcnv2"] {
        let kept = plan_with(model, Variant::Erase, true, true);
        let made = plan_with(model, Variant::Erase, true, false);
        let g = &kept.model.graph;
        let copies: Vec<(Tensor, Tensor)> = g
            .tensors()
            .filter_map(|c| match g.leaf(c) {
                Some(Leaf::ParamCopy { of }) => Some((c, *of)),
                _ => None,
            })
            .collect();
        assert!(copies.len() >= 9, "{model}: {} copies", copies.len());
        assert!(made
            .model
            .graph
            .tensors()
            .all(|t| !matches!(made.model.graph.leaf(t), Some(Leaf::ParamCopy { .. }))));
        let keep = [kept.model.logit];
        let mem_kept = plan_memory(g, &kept.program, &keep);
        let mem_made = plan_memory(&made.model.graph, &made.program, &[made.model.logit]);
        let (mut rk, lk) = train(&kept, &mem_kept, 3);
        let (mut rm, lm) = train(&made, &mem_made, 3);
        assert_eq!(lk, lm, "{model}: logits of the three steps");
        let rounded = |r: &ProgramRunner, w: Tensor| r.get(w).unwrap().to_bf16();
        for &(c, w) in &copies {
            let got = rk.get(c).unwrap();
            assert_eq!(
                got.bytes(),
                rounded(&rk, w).bytes(),
                "{model}: {} is not its weight rounded after three updates",
                g.name(c)
            );
        }
        for w in g.params() {
            let other = made.model.graph.find(g.name(w)).unwrap();
            assert_eq!(
                rk.get(w).unwrap().bytes(),
                rm.get(other).unwrap().bytes(),
                "{model}: {} after three steps",
                g.name(w)
            );
        }
        // a weight set from outside: its copy follows
        let (c, w) = copies[0];
        let halved: Vec<f32> = rk
            .get(w)
            .unwrap()
            .as_f32()
            .unwrap()
            .iter()
            .map(|x| x * 0.5 + 1e-3)
            .collect();
        let halved = erase::ops::Buffer::F32(halved);
        rk.write(w, &halved).unwrap();
        assert_eq!(rk.get(c).unwrap().bytes(), halved.to_bf16().bytes());
        rk.feed(w, halved.clone()).unwrap();
        assert_eq!(rk.get(c).unwrap().bytes(), halved.to_bf16().bytes());
        let other = made.model.graph.find(g.name(w)).unwrap();
        rm.write(other, &halved).unwrap();
        let step = |r: &mut ProgramRunner| {
            r.run().unwrap();
            r.get(kept.model.logit).map(|b| b.to_f64())
        };
        let after_kept = step(&mut rk);
        rm.run().unwrap();
        let after_made = rm.get(made.model.logit).map(|b| b.to_f64());
        assert_eq!(
            after_kept, after_made,
            "{model}: the step after the weight was set"
        );
    }
}

/// Each cross update fused with the layer that makes its factor (`LinearMulAdd`,
/// `ScheduleOptions::fuse_cross_updates`, `--fuse-cross-updates on`) trains to the bits of the two
/// nodes apart: the same logits step after step and the same parameters, with the
/// factor stored in f32 or in bf16, under every variant. DCNv2 has three such pairs, the
/// spec model's cross block three; the plans stay free of hazards (plan_step checks).
#[test]
fn cross_updates_fused_with_their_layers_train_to_the_same_bits() {
    for (model, variant, storage) in [
        ("dcnv2", Variant::Erase, true),
        ("dcnv2", Variant::Baseline, false),
        ("dcnv2", Variant::Detached, true),
        ("spec", Variant::Erase, true),
    ] {
        let sched = |fuse: bool| ScheduleOptions {
            bf16_copy_min_flops: 0,
            bf16_storage: storage,
            // (a cross update reading bf16 operands stays apart from its layer)
            bf16_cross: false,
            fuse_cross_updates: fuse,
            ..Default::default()
        };
        let fused = plan_sched(model, variant, sched(true));
        let apart = plan_sched(model, variant, sched(false));
        let g = &fused.model.graph;
        let what = format!("{model} {variant}, stored in bf16: {storage}");
        let nodes: Vec<&erase::graph::Node> = g
            .nodes()
            .iter()
            .filter(|n| matches!(n.op, Op::LinearMulAdd { .. }))
            .collect();
        assert_eq!(nodes.len(), 3, "{what}: fused pairs");
        assert!(!g.nodes().iter().any(|n| n.op == Op::MulAdd), "{what}");
        for n in &nodes {
            // [x, w, b, a, c] -> [y, z (, bf16(z))]: the layer's output as the layer
            // stored it, the update and its copy where a GEMM reads one (DCNv2's every
            // update; the spec model's last goes to a layer too small for copies)
            assert_eq!(n.inputs.len(), 5, "{what}: {}", n.name);
            let y_dtype = if storage { DType::Bf16 } else { DType::F32 };
            assert_eq!(g.dtype(n.outputs[0]), y_dtype, "{what}: {}", n.name);
            let copy = n.outputs.get(2).copied();
            assert!(
                n.outputs.len() == 3 || model == "spec",
                "{what}: {}",
                n.name
            );
            assert_eq!(g.copy_output(n), copy, "{what}: {}", n.name);
            for &t in &n.outputs {
                assert_eq!(g.info(t).producer, n.id, "{what}: {}", g.name(t));
            }
        }
        // ids are positions, origins and producers point at nodes that exist
        for (i, n) in g.nodes().iter().enumerate() {
            assert_eq!(n.id.index(), i, "{what}");
            if let Some(o) = n.origin {
                assert!(o.index() < g.nodes().len(), "{what}: {}", n.name);
            }
        }
        for &u in fused
            .training
            .updates
            .dense
            .iter()
            .chain(&fused.training.updates.sparse)
        {
            assert!(g.node(u).op.is_optimizer(), "{what}: {}", g.node(u).name);
        }
        assert_eq!(
            g.nodes().len() + 3,
            apart.model.graph.nodes().len(),
            "{what}: three nodes fewer"
        );
        let mem_f = plan_memory(g, &fused.program, &[fused.model.logit]);
        let mem_a = plan_memory(&apart.model.graph, &apart.program, &[apart.model.logit]);
        let (rf, lf) = train(&fused, &mem_f, 3);
        let (ra, la) = train(&apart, &mem_a, 3);
        assert_eq!(lf, la, "{what}: logits of the three steps");
        for w in g.params() {
            let other = apart.model.graph.find(g.name(w)).unwrap();
            assert_eq!(
                rf.get(w).unwrap().bytes(),
                ra.get(other).unwrap().bytes(),
                "{what}: {} after three steps",
                g.name(w)
            );
        }
    }
}

/// The cross networks stored in bf16 (`ScheduleOptions::bf16_cross`, on by default): each
/// update reads x0 and the previous update from their bf16 copies, the inner updates are
/// stored in bf16 and the last in f32, and the updates' gradients read x0's copy too. The
/// step is that of rounding those operands once: the logits and gradients move by
/// bf16 rounding's size, not more; with the up-projections in f32, or without copies
/// (the CPU's plans), nothing is stored in bf16.
#[test]
fn cross_networks_stored_in_bf16_read_copies_and_move_the_step_by_rounding() {
    let sched = |cross: bool, storage: bool, copies: bool| ScheduleOptions {
        bf16_copies: copies,
        bf16_copy_min_flops: 0,
        bf16_storage: storage,
        bf16_cross: cross,
        cross_grad_fold: true,
        // (DCNv2's x0 stored in bf16 alone: bf16_x0's own test)
        bf16_x0: false,
        fuse_cross_updates: false,
        ..Default::default()
    };
    let cross_updates = |p: &StepPlan| -> Vec<erase::graph::Node> {
        let g = &p.model.graph;
        g.nodes()
            .iter()
            .filter(|n| n.name.starts_with("cross/") && n.op == Op::MulAdd)
            .cloned()
            .collect()
    };
    for (model, variant) in [
        ("spec", Variant::Erase),
        ("dcnv2", Variant::Baseline),
        ("dcnv2", Variant::Erase),
    ] {
        let what = format!("{model} {variant}");
        let stored = plan_sched(model, variant, sched(true, true, true));
        let g = &stored.model.graph;
        let ups = cross_updates(&stored);
        assert_eq!(ups.len(), 3, "{what}: three cross updates");
        for (l, n) in ups.iter().enumerate() {
            for k in 0..3 {
                assert_eq!(
                    g.dtype(n.inputs[k]),
                    DType::Bf16,
                    "{what}: update {l} reads input {k} in f32"
                );
            }
            let want = if l < 2 { DType::Bf16 } else { DType::F32 };
            assert_eq!(g.dtype(n.outputs[0]), want, "{what}: update {l}'s output");
        }
        // the first update reads x0's copy twice, the one its layer's GEMM reads
        assert_eq!(ups[0].inputs[0], ups[0].inputs[2], "{what}");
        let grads: Vec<_> = g
            .nodes()
            .iter()
            .filter(|n| matches!(n.op, Op::MulGrad { .. }) && n.name.starts_with("cross/"))
            .collect();
        assert_eq!(grads.len(), 3, "{what}: three update gradients");
        for n in &grads {
            assert_eq!(g.dtype(n.inputs[1]), DType::Bf16, "{what}: {}", n.name);
            assert_eq!(
                n.inputs[1], ups[0].inputs[0],
                "{what}: {} reads x0's copy",
                n.name
            );
            // the first update, x0 ⊙ v + x0: its gradient adds dy to da (x0's two
            // contributions in one tensor); the others leave c's to x_l's own sum
            let first = n.name.starts_with(&format!("{}.", ups[0].name));
            assert_eq!(n.op, Op::MulGrad { plus_dy: first }, "{what}: {}", n.name);
        }
        // the same launches as the f32 network: the stores change, not the passes
        let f32_net = plan_sched(model, variant, sched(false, true, true));
        assert_eq!(
            stored.program.launches.len(),
            f32_net.program.launches.len(),
            "{what}: launches"
        );
        let (logits_s, grads_s) = step(&stored);
        let (logits_f, grads_f) = step(&f32_net);
        let l = rel_l2(&logits_s, &logits_f);
        assert!(l > 0.0, "{what}: the stored values are rounded");
        assert!(l <= 2f64.powi(-6), "{what}: logits move by {l:.2e}");
        let mut worst = 0f64;
        for ((name, a), (name_b, b)) in grads_s.iter().zip(&grads_f) {
            assert_eq!(name, name_b);
            let r = rel_l2(a, b);
            assert!(
                r <= 2f64.powi(-4),
                "{what}: gradient of {name} moves by {r:.2e}"
            );
            worst = worst.max(r);
        }
        println!("{what}: logits {l:.2e}, gradients at most {worst:.2e} (relative L2)");
        // the first update's gradient folded or not (`cross_grad_fold`, off by default):
        // the same sums in another order
        let unfolded = plan_sched(
            model,
            variant,
            ScheduleOptions {
                cross_grad_fold: false,
                ..sched(true, true, true)
            },
        );
        assert!(unfolded
            .model
            .graph
            .nodes()
            .iter()
            .all(|n| !matches!(n.op, Op::MulGrad { plus_dy: true })));
        // (a view of dy fewer among x0's contributions)
        assert!(
            stored.program.launches.len() <= unfolded.program.launches.len(),
            "{what}"
        );
        let (logits_u, grads_u) = step(&unfolded);
        assert!(rel_l2(&logits_u, &logits_s) <= 1e-6, "{what}: logits");
        for ((name, a), (_, b)) in grads_u.iter().zip(&grads_s) {
            let r = rel_l2(a, b);
            assert!(
                r <= 1e-5,
                "{what}: folding moves {name}'s gradient by {r:.2e}"
            );
        }
        // nothing of the network in bf16 with the up-projections in f32 or without copies
        for (storage, copies) in [(false, true), (true, false)] {
            let p = plan_sched(model, variant, sched(true, storage, copies));
            let g = &p.model.graph;
            for n in cross_updates(&p) {
                assert!(
                    n.inputs
                        .iter()
                        .chain(&n.outputs[..1])
                        .all(|&t| g.dtype(t) == DType::F32),
                    "{what}, storage {storage}, copies {copies}: {}",
                    n.name
                );
            }
        }
    }
}

/// A cross network stored in bf16 trains: the same graph under `detached` and `erase`
/// gives the same bits step after step (the schedule moves launches, not values), and
/// the f32 network's logits stay within bf16 rounding of it over three steps.
#[test]
fn cross_networks_stored_in_bf16_train_to_the_same_bits_under_detached_and_erase() {
    for model in ["dcnv2", "spec"] {
        let sched = |cross: bool| ScheduleOptions {
            bf16_copy_min_flops: 0,
            bf16_cross: cross,
            cross_grad_fold: cross,
            ..Default::default()
        };
        let erase = plan_sched(model, Variant::Erase, sched(true));
        let detached = plan_sched(model, Variant::Detached, sched(true));
        let f32_net = plan_sched(model, Variant::Erase, sched(false));
        let mem = |p: &StepPlan| plan_memory(&p.model.graph, &p.program, &[p.model.logit]);
        let (me, md, mf) = (mem(&erase), mem(&detached), mem(&f32_net));
        let (re, le) = train(&erase, &me, 3);
        let (rd, ld) = train(&detached, &md, 3);
        let (_, lf) = train(&f32_net, &mf, 3);
        assert_eq!(le, ld, "{model}: erase and detached logits");
        for w in erase.model.graph.params() {
            let other = detached
                .model
                .graph
                .find(erase.model.graph.name(w))
                .unwrap();
            assert_eq!(
                re.get(w).unwrap().bytes(),
                rd.get(other).unwrap().bytes(),
                "{model}: {} after three steps",
                erase.model.graph.name(w)
            );
        }
        for (s, (a, b)) in le.iter().zip(&lf).enumerate() {
            let r = rel_l2(a, b);
            assert!(
                r > 0.0 && r <= 2f64.powi(-6),
                "{model}: step {s}'s logits move by {r:.2e}"
            );
        }
    }
}

/// DCNv2's concatenated fields stored in bf16 alone (`ScheduleOptions::bf16_x0`): the
/// concat writes only what the cross network reads (its layers read x0's copy), so the
/// step is the same bits as with the f32 concat and its copy, in every variant, step
/// after step, with the same launches but the copy's view; without copies (the CPU's plans) or with the
/// network in f32 the concat stays f32.
#[test]
fn dcnv2s_x0_stored_in_bf16_alone_trains_to_the_same_bits() {
    let sched = |x0: bool, cross: bool| ScheduleOptions {
        bf16_copy_min_flops: 0,
        bf16_cross: cross,
        bf16_x0: x0,
        cross_grad_fold: true,
        ..Default::default()
    };
    let concat_dtypes = |p: &StepPlan| -> Vec<DType> {
        let g = &p.model.graph;
        g.nodes()
            .iter()
            .filter(|n| matches!(n.op, Op::Concat { .. }) && n.phase == Phase::Forward)
            .map(|n| g.dtype(n.outputs[0]))
            .collect()
    };
    for variant in [Variant::Baseline, Variant::Erase] {
        let stored = plan_sched("dcnv2", variant, sched(true, true));
        let plain = plan_sched("dcnv2", variant, sched(false, true));
        assert_eq!(concat_dtypes(&stored), [DType::Bf16], "{variant}");
        assert_eq!(concat_dtypes(&plain), [DType::F32], "{variant}");
        // (the copy's own view of x0 is gone: x0 is its copy)
        assert_eq!(
            stored.program.launches.len() + 1,
            plain.program.launches.len(),
            "{variant}"
        );
        let mem = |p: &StepPlan| plan_memory(&p.model.graph, &p.program, &[p.model.logit]);
        let (ms, mp) = (mem(&stored), mem(&plain));
        let (rs, ls) = train(&stored, &ms, 2);
        let (rp, lp) = train(&plain, &mp, 2);
        assert_eq!(ls, lp, "{variant}: logits");
        for w in stored.model.graph.params() {
            let other = plain.model.graph.find(stored.model.graph.name(w)).unwrap();
            assert_eq!(
                rs.get(w).unwrap().bytes(),
                rp.get(other).unwrap().bytes(),
                "{variant}: {} after two steps",
                stored.model.graph.name(w)
            );
        }
    }
    let f32_net = plan_sched("dcnv2", Variant::Erase, sched(true, false));
    assert_eq!(concat_dtypes(&f32_net), [DType::F32]);
    let no_copies = plan_sched(
        "dcnv2",
        Variant::Erase,
        ScheduleOptions {
            bf16_copies: false,
            ..sched(true, true)
        },
    );
    assert_eq!(concat_dtypes(&no_copies), [DType::F32]);
}
