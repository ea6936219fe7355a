//! The gradient rules, one function per op family. Each gets the node, the sum of its
//! output's gradient contributions (`dy`) and what the walk knows (which tensors need a
//! gradient, how often each is read), and contributes its inputs' gradients to the
//! builder. [`super::backward_with`] dispatches to them in one exhaustive match.

use super::{bf16_layer_gradient, copied_layer_output, Builder};
use crate::dtype::{DType, Shape};
use crate::graph::{Node, Phase};
use crate::{GraphError, Op, Result, Tensor};

/// What a rule knows of the node it differentiates.
pub(super) struct Rule<'a> {
    pub node: &'a Node,
    /// The gradient of the node's output 0 (the sum of its contributions).
    pub dy: Tensor,
    /// How many contributions `dy` sums.
    pub contributions: usize,
    /// Which tensors need a gradient.
    pub req: &'a [bool],
    /// How many forward nodes (and losses) read each tensor.
    pub uses: &'a [usize],
}

impl Rule<'_> {
    /// Whether input `i` needs a gradient.
    fn needs(&self, i: usize) -> bool {
        self.req[self.node.inputs[i].index()]
    }

    /// Input `i`'s shape.
    fn shape_of(&self, b: &Builder, i: usize) -> Shape {
        b.g.shape(self.node.inputs[i]).clone()
    }

    /// The error of a family's rules handed an op of another family (a dispatch bug).
    fn misrouted(&self, family: &str) -> GraphError {
        GraphError::Structure(format!(
            "autodiff: the {family} rules were asked for {} node '{}'",
            self.node.op.name(),
            self.node.name
        ))
    }
}

/// Linear layers (with their fused ReLU, residual and bf16 copies) and matmul.
pub(super) fn gemm(b: &mut Builder, r: &Rule) -> Result<()> {
    let (node, dy, contributions) = (r.node, r.dy, r.contributions);
    let (req, uses) = (r.req, r.uses);
    let (nm, id, ins) = (node.name.clone(), node.id, node.inputs.clone());
    match &node.op {
        Op::Linear { bias, relu } => {
            // the fused ReLU's gradient first: dy ⊙ (y > 0), y the node's own output,
            // unless the one consumer's dx applied it already
            let y = node.outputs[0];
            let dy = if *relu && b.masked.contains(&y) {
                if contributions != 1 {
                    return Err(GraphError::Structure(format!(
                        "autodiff: '{nm}' has {contributions} gradient contributions, one of them masked"
                    )));
                }
                dy
            } else if *relu {
                let s = b.g.shape(y).clone();
                b.add1(Op::ReluGrad, vec![dy, y], s, format!("{nm}.relu_dx"), id)
            } else {
                dy
            };
            // the forward read a bf16 copy of x (Graph::set_bf16_copies): dy is
            // rounded once too, for both GEMMs, its column sums (the bias gradient)
            // taken in the same pass
            // (x is the copy, or a reshaped view of one). The f32 tensor behind it, and
            // how many other nodes read that f32 tensor or the copy
            let copied = b.g.dtype(ins[0]) == DType::Bf16;
            let copy = b.g.producer(ins[0]);
            let (x_f32, other_readers) = if matches!(copy.op, Op::RoundBf16 { .. }) {
                // a RoundBf16 reads x_f32
                let x = copy.inputs[0];
                (x, uses[x.index()] - 1 + uses[ins[0].index()] - 1)
            } else if b.g.copy_output(copy) == Some(ins[0]) {
                // written beside x_f32 by its producer
                let x = copy.outputs[0];
                (x, uses[x.index()] + uses[ins[0].index()] - 1)
            } else {
                (ins[0], uses[ins[0].index()] - 1)
            };
            let mut db_done = false;
            let dy_gemm = if b.g.dtype(dy) == DType::Bf16 {
                // the copy its producer wrote (a MulGrad), with the bias gradient
                if let Some(sums) = b.dy_sums.remove(&dy) {
                    b.contribute(ins[2], sums);
                    db_done = true;
                } else if *bias && r.needs(2) && (copied || !r.needs(1)) {
                    // (a bf16 dy with an f32 x: the weight gradient sums it)
                    return Err(GraphError::Structure(format!(
                        "autodiff: '{nm}' has a bf16 dy without its column sums"
                    )));
                }
                dy
            } else if copied && (r.needs(0) || r.needs(1)) {
                let col_sums = *bias && r.needs(2);
                let mut outs = vec![(b.g.shape(dy).clone(), DType::Bf16)];
                if col_sums {
                    outs.push((r.shape_of(b, 2), b.g.float_dtype()));
                }
                let r = b.g.add_derived(
                    Op::RoundBf16 { col_sums },
                    vec![dy],
                    outs,
                    format!("{nm}.dy_bf16"),
                    Phase::Backward,
                    Some(id),
                );
                if col_sums {
                    b.contribute(ins[2], r[1]);
                    db_done = true;
                }
                r[0]
            } else {
                dy
            };
            if r.needs(0) {
                // x the output of a ReLU (fused into a Linear or its own node) that
                // only this node reads (through its bf16 copy, if it has one): its
                // gradient's mask goes into this dx's epilogue
                let x = x_f32;
                let producer = b.g.node(b.g.info(x).producer);
                let mask = other_readers == 0
                    && matches!(producer.op, Op::Linear { relu: true, .. } | Op::Relu)
                    && producer.outputs[0] == x;
                // x the output of a linear layer with copies and without a ReLU (or
                // a bias gradient to sum), read by this node alone: dx is that
                // layer's whole dy, and the GEMM's epilogue writes its bf16 copy too
                let below = matches!(
                    producer.op,
                    Op::Linear { bias, relu: false }
                        if !bias || !req[producer.inputs[2].index()]
                ) && copied
                    && other_readers == 0
                    && producer.outputs[0] == x
                    && b.g.dtype(producer.inputs[0]) == DType::Bf16
                    && (req[producer.inputs[0].index()] || req[producer.inputs[1].index()]);
                let s = r.shape_of(b, 0);
                // x's one other gradient contribution, final already: the GEMM's
                // epilogue adds it, and x's gradient is this dx (no GradSum of the two)
                let residual = if mask || below {
                    None
                } else {
                    b.sole_other_contribution(id, x, ins[0], &s)
                };
                let mut inputs = vec![dy_gemm, ins[1]];
                if mask {
                    inputs.push(x);
                    b.masked.insert(x);
                }
                inputs.extend(residual);
                let f = b.g.float_dtype();
                let mut outs = vec![(s.clone(), f)];
                if below {
                    outs.push((s, DType::Bf16));
                }
                let dx = b.g.add_derived(
                    Op::LinearGradInput {
                        relu_mask: mask,
                        residual: residual.is_some(),
                    },
                    inputs,
                    outs,
                    format!("{nm}.dx"),
                    Phase::Backward,
                    Some(id),
                );
                b.contribute(ins[0], dx[usize::from(below)]);
            }
            let owed = (*bias && !db_done).then(|| ins[2]);
            b.weight_grads(&nm, id, [dy_gemm, dy], ins[0], ins[1], owed, req);
        }
        Op::LinearAdd { bias } => {
            // [x, w, b?, r]: dy is r's gradient as it is, and the layer's dy
            let nb = usize::from(*bias);
            if r.needs(2 + nb) {
                b.contribute(ins[2 + nb], dy);
            }
            if r.needs(0) {
                // x's one other gradient contribution, final already (r's, when r is x):
                // summed in the GEMM's epilogue, as for Linear
                let s = r.shape_of(b, 0);
                let residual = b.sole_other_contribution(id, ins[0], ins[0], &s);
                let mut inputs = vec![dy, ins[1]];
                inputs.extend(residual);
                let dx = b.add1(
                    Op::LinearGradInput {
                        relu_mask: false,
                        residual: residual.is_some(),
                    },
                    inputs,
                    s,
                    format!("{nm}.dx"),
                    id,
                );
                b.contribute(ins[0], dx);
            }
            b.weight_grads(&nm, id, [dy, dy], ins[0], ins[1], bias.then(|| ins[2]), req);
        }
        Op::MatMul { ta, tb } => {
            let (ta, tb) = (*ta, *tb);
            if r.needs(0) {
                let (op, i) = if ta {
                    (Op::MatMul { ta: tb, tb: true }, vec![ins[1], dy])
                } else {
                    (Op::MatMul { ta: false, tb: !tb }, vec![dy, ins[1]])
                };
                let da = b.add1(op, i, r.shape_of(b, 0), format!("{nm}.da"), id);
                b.contribute(ins[0], da);
            }
            if r.needs(1) {
                let (op, i) = if tb {
                    (Op::MatMul { ta: true, tb: ta }, vec![dy, ins[0]])
                } else {
                    (Op::MatMul { ta: !ta, tb: false }, vec![ins[0], dy])
                };
                let db = b.add1(op, i, r.shape_of(b, 1), format!("{nm}.db"), id);
                b.contribute(ins[1], db);
            }
        }
        _ => return Err(r.misrouted("gemm")),
    }
    Ok(())
}

/// Elementwise ops and activations.
pub(super) fn elementwise(b: &mut Builder, r: &Rule) -> Result<()> {
    let (node, dy, contributions) = (r.node, r.dy, r.contributions);
    let (req, uses) = (r.req, r.uses);
    let (nm, id, ins) = (node.name.clone(), node.id, node.inputs.clone());
    match &node.op {
        Op::Add => {
            if r.needs(0) {
                b.contribute(ins[0], dy);
            }
            if r.needs(1) {
                let db = b.unbroadcast(dy, ins[1], format!("{nm}.db"), id);
                b.contribute(ins[1], db);
            }
        }
        Op::Mul | Op::MulAdd
            if r.needs(0) && r.needs(1) && b.g.shape(ins[0]) == b.g.shape(ins[1]) =>
        {
            // both factors' gradients in one pass. A factor that is the output of a
            // linear layer with bf16 copies (Graph::set_bf16_copies), read by this
            // node alone: its gradient is that layer's whole dy, which the pass writes
            // as the bf16 copy the layer's GEMMs read (with its column sums, the bias
            // gradient) instead of in f32 for a RoundBf16 of its own
            let copied_dy = |k: usize| copied_layer_output(b.g, uses, req, ins[k]);
            let s = r.shape_of(b, 0);
            let fused = [1, 0]
                .into_iter()
                .find_map(|k| copied_dy(k).map(|sums| (k, sums)));
            if let Some((k, sums)) = fused {
                // [dy, other, linear output] -> [other's gradient, the layer's dy in
                // bf16 (, its column sums)]
                let (other, lin) = (ins[1 - k], ins[k]);
                let f = b.g.float_dtype();
                let mut outs = vec![(s.clone(), f), (s, DType::Bf16)];
                if let Some(bs) = &sums {
                    outs.push((bs.clone(), f));
                }
                let g = b.g.add_derived(
                    Op::MulGrad,
                    vec![dy, other, lin],
                    outs,
                    format!("{nm}.grad"),
                    Phase::Backward,
                    Some(id),
                );
                b.contribute(other, g[0]);
                b.contribute(lin, g[1]);
                if sums.is_some() {
                    b.dy_sums.insert(g[1], g[2]);
                }
            } else {
                let g = b.add(
                    Op::MulGrad,
                    vec![dy, ins[0], ins[1]],
                    vec![s.clone(), s],
                    format!("{nm}.grad"),
                    id,
                );
                b.contribute(ins[0], g[0]);
                b.contribute(ins[1], g[1]);
            }
            if matches!(node.op, Op::MulAdd) && r.needs(2) {
                b.contribute(ins[2], dy);
            }
        }
        Op::MulAdd => {
            let s = r.shape_of(b, 0);
            for (i, other, what) in [(0, 1, "da"), (1, 0, "db")] {
                if r.needs(i) {
                    let d = b.add1(
                        Op::Mul,
                        vec![dy, ins[other]],
                        s.clone(),
                        format!("{nm}.{what}"),
                        id,
                    );
                    b.contribute(ins[i], d);
                }
            }
            if r.needs(2) {
                b.contribute(ins[2], dy);
            }
        }
        Op::Mul => {
            let out_shape = b.g.shape(dy).clone();
            if r.needs(0) {
                let da = b.add1(
                    Op::Mul,
                    vec![dy, ins[1]],
                    out_shape.clone(),
                    format!("{nm}.da"),
                    id,
                );
                b.contribute(ins[0], da);
            }
            if r.needs(1) {
                let full = b.add1(
                    Op::Mul,
                    vec![dy, ins[0]],
                    out_shape,
                    format!("{nm}.db_full"),
                    id,
                );
                let db = b.unbroadcast(full, ins[1], format!("{nm}.db"), id);
                b.contribute(ins[1], db);
            }
        }
        Op::Scale { factor } => {
            let dx = b.add1(
                Op::Scale { factor: *factor },
                vec![dy],
                r.shape_of(b, 0),
                format!("{nm}.dx"),
                id,
            );
            b.contribute(ins[0], dx);
        }
        Op::Relu if b.masked.contains(&node.outputs[0]) => {
            // the one consumer's dx applied the mask: the gradient passes through
            if contributions != 1 {
                return Err(GraphError::Structure(format!(
                    "autodiff: '{nm}' has {contributions} gradient contributions, one of them masked"
                )));
            }
            b.contribute(ins[0], dy);
        }
        Op::Relu | Op::Sigmoid | Op::Gelu | Op::Silu => {
            let (op, saved) = match node.op {
                Op::Relu => (Op::ReluGrad, node.outputs[0]),
                Op::Sigmoid => (Op::SigmoidGrad, node.outputs[0]),
                Op::Silu => (Op::SiluGrad, ins[0]),
                _ => (Op::GeluGrad, ins[0]),
            };
            let dx = b.add1(
                op,
                vec![dy, saved],
                r.shape_of(b, 0),
                format!("{nm}.dx"),
                id,
            );
            b.contribute(ins[0], dx);
        }
        _ => return Err(r.misrouted("elementwise")),
    }
    Ok(())
}

/// Layer norm.
pub(super) fn norm(b: &mut Builder, r: &Rule) -> Result<()> {
    let (node, dy) = (r.node, r.dy);
    let (req, uses) = (r.req, r.uses);
    let (nm, id, ins) = (node.name.clone(), node.id, node.inputs.clone());
    match &node.op {
        Op::LayerNorm { .. } => {
            // x the output of a linear layer with bf16 copies, read by this node
            // alone: dx is that layer's whole dy, which the pass also writes as the
            // bf16 copy the layer's GEMMs read, with its column sums (the layer's
            // bias gradient), as outputs 3 and 4
            let copy = if r.needs(0) {
                copied_layer_output(b.g, uses, req, ins[0])
            } else {
                None
            };
            let f = b.g.float_dtype();
            let mut out_specs = vec![
                (r.shape_of(b, 0), f),
                (r.shape_of(b, 1), f),
                (r.shape_of(b, 2), f),
            ];
            if let Some(sums) = &copy {
                out_specs.push((r.shape_of(b, 0), DType::Bf16));
                // the sums even without a bias to take them: the kernel's one form
                let cols = b.g.shape(ins[0]).last();
                out_specs.push((sums.clone().unwrap_or_else(|| Shape::new(&[cols])), f));
            }
            let outs = b.g.add_derived(
                Op::LayerNormGrad,
                vec![dy, ins[0], ins[1], node.outputs[1], node.outputs[2]],
                out_specs,
                format!("{nm}.grad"),
                Phase::Backward,
                Some(id),
            );
            for i in 0..3 {
                if r.needs(i) {
                    let t = if i == 0 && copy.is_some() {
                        outs[3]
                    } else {
                        outs[i]
                    };
                    b.contribute(ins[i], t);
                }
            }
            if let Some(Some(_)) = &copy {
                b.dy_sums.insert(outs[3], outs[4]);
            }
        }
        _ => return Err(r.misrouted("norm")),
    }
    Ok(())
}

/// Reshapes, detach, bf16 rounding, casts, concat and slice.
pub(super) fn shape(b: &mut Builder, r: &Rule) -> Result<()> {
    let (node, dy) = (r.node, r.dy);
    let (nm, id, ins) = (node.name.clone(), node.id, node.inputs.clone());
    match &node.op {
        Op::Reshape => {
            let dx = b.add1(
                Op::Reshape,
                vec![dy],
                r.shape_of(b, 0),
                format!("{nm}.dx"),
                id,
            );
            b.contribute(ins[0], dx);
        }
        Op::Detach => {}
        // (its contributions were passed on above)
        Op::RoundBf16 { .. } => {}
        Op::Cast { .. } => {
            let to = b.g.dtype(ins[0]);
            let s = r.shape_of(b, 0);
            let dx = b.g.add_derived(
                Op::Cast { to },
                vec![dy],
                vec![(s, to)],
                format!("{nm}.dx"),
                Phase::Backward,
                Some(id),
            )[0];
            b.contribute(ins[0], dx);
        }
        Op::Concat { axis } if (0..ins.len()).filter(|&i| r.needs(i)).count() > 1 => {
            // every part's gradient from one pass over dy
            let shapes: Vec<Shape> = (0..ins.len()).map(|i| r.shape_of(b, i)).collect();
            let sizes = shapes.iter().map(|s| s.dims()[*axis]).collect();
            let parts = b.add(
                Op::Split { axis: *axis, sizes },
                vec![dy],
                shapes,
                format!("{nm}.dx"),
                id,
            );
            for (i, (&input, &part)) in ins.iter().zip(&parts).enumerate() {
                if r.needs(i) {
                    b.contribute(input, part);
                }
            }
        }
        Op::Concat { axis } => {
            let mut start = 0;
            for (i, &input) in ins.iter().enumerate() {
                let s = r.shape_of(b, i);
                let len = s.dims()[*axis];
                if r.needs(i) {
                    let dx = b.add1(
                        Op::Slice {
                            axis: *axis,
                            start,
                            len,
                        },
                        vec![dy],
                        s,
                        format!("{nm}.dx{i}"),
                        id,
                    );
                    b.contribute(input, dx);
                }
                start += len;
            }
        }
        Op::Slice { axis, start, .. } => {
            let s = r.shape_of(b, 0);
            let full = s.dims()[*axis];
            let dx = b.add1(
                Op::Pad {
                    axis: *axis,
                    start: *start,
                    full,
                },
                vec![dy],
                s,
                format!("{nm}.dx"),
                id,
            );
            b.contribute(ins[0], dx);
        }
        _ => return Err(r.misrouted("shape")),
    }
    Ok(())
}

/// The pairwise dots of the DLRM interaction.
pub(super) fn interaction(b: &mut Builder, r: &Rule) -> Result<()> {
    let (node, dy) = (r.node, r.dy);
    let (nm, id, ins) = (node.name.clone(), node.id, node.inputs.clone());
    match &node.op {
        Op::PairwiseDot => {
            let de = b.add1(
                Op::PairwiseDotGrad,
                vec![dy, ins[0]],
                r.shape_of(b, 0),
                format!("{nm}.de"),
                id,
            );
            b.contribute(ins[0], de);
        }
        _ => return Err(r.misrouted("interaction")),
    }
    Ok(())
}

/// Fused attention (packed QKV or separate).
pub(super) fn attention(b: &mut Builder, r: &Rule) -> Result<()> {
    let (node, dy) = (r.node, r.dy);
    let (req, uses) = (r.req, r.uses);
    let (nm, id, ins) = (node.name.clone(), node.id, node.inputs.clone());
    match &node.op {
        Op::Attention {
            heads,
            causal,
            packed: true,
        } => {
            // qkv a projection's output: dqkv is that layer's whole dy, written in
            // bf16 where only its GEMMs read it
            let dt = if bf16_layer_gradient(b.g, uses, req, ins[0]) {
                DType::Bf16
            } else {
                b.g.float_dtype()
            };
            let dqkv = b.g.add_derived(
                Op::AttentionGrad {
                    heads: *heads,
                    causal: *causal,
                    packed: true,
                },
                vec![dy, ins[0], node.outputs[0], node.outputs[1]],
                vec![(r.shape_of(b, 0), dt)],
                format!("{nm}.grad"),
                Phase::Backward,
                Some(id),
            )[0];
            b.contribute(ins[0], dqkv);
        }
        Op::Attention {
            heads,
            causal,
            packed: false,
        } => {
            let s = r.shape_of(b, 0);
            let outs = b.add(
                Op::AttentionGrad {
                    heads: *heads,
                    causal: *causal,
                    packed: false,
                },
                vec![dy, ins[0], ins[1], ins[2], node.outputs[0], node.outputs[1]],
                vec![s.clone(), s.clone(), s],
                format!("{nm}.grad"),
                id,
            );
            for (i, &t) in outs.iter().enumerate() {
                if r.needs(i) {
                    b.contribute(ins[i], t);
                }
            }
        }
        _ => return Err(r.misrouted("attention")),
    }
    Ok(())
}

/// Embedding bags (their tables get sparse gradients) and mean pooling.
pub(super) fn embedding(b: &mut Builder, r: &Rule) -> Result<()> {
    let (node, dy) = (r.node, r.dy);
    let (nm, id, ins) = (node.name.clone(), node.id, node.inputs.clone());
    match &node.op {
        Op::EmbeddingBag { .. } => {
            b.sparse.entry(ins[0]).or_default().push((id, dy));
        }
        Op::BagMean { mean } => {
            // z = y ⊙ s with s fixed by the ids: dy = dz ⊙ s, the same op
            let dx = b.add1(
                Op::BagMean { mean: mean.clone() },
                vec![dy, ins[1], ins[2]],
                r.shape_of(b, 0),
                format!("{nm}.dy"),
                id,
            );
            b.contribute(ins[0], dx);
        }
        _ => return Err(r.misrouted("embedding")),
    }
    Ok(())
}

/// Losses.
pub(super) fn loss(b: &mut Builder, r: &Rule) -> Result<()> {
    let (node, dy) = (r.node, r.dy);
    let (nm, id, ins) = (node.name.clone(), node.id, node.inputs.clone());
    match &node.op {
        Op::BceWithLogits => {
            let dx = b.add1(
                Op::BceWithLogitsGrad,
                vec![dy, ins[0], ins[1]],
                r.shape_of(b, 0),
                format!("{nm}.dlogit"),
                id,
            );
            b.contribute(ins[0], dx);
        }
        Op::SoftmaxCrossEntropy => {
            let dx = b.add1(
                Op::SoftmaxCrossEntropyGrad,
                vec![dy, ins[0], ins[1]],
                r.shape_of(b, 0),
                format!("{nm}.dlogits"),
                id,
            );
            b.contribute(ins[0], dx);
        }
        _ => return Err(r.misrouted("loss")),
    }
    Ok(())
}

/// Full sums and means.
pub(super) fn reduce(b: &mut Builder, r: &Rule) -> Result<()> {
    let (node, dy) = (r.node, r.dy);
    let (nm, id, ins) = (node.name.clone(), node.id, node.inputs.clone());
    match &node.op {
        Op::Sum | Op::Mean => {
            let s = r.shape_of(b, 0);
            let scale = if matches!(node.op, Op::Mean) {
                1.0 / s.numel() as f64
            } else {
                1.0
            };
            let dx = b.add1(Op::Broadcast { scale }, vec![dy], s, format!("{nm}.dx"), id);
            b.contribute(ins[0], dx);
        }
        _ => return Err(r.misrouted("reduce")),
    }
    Ok(())
}
