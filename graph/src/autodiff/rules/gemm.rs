//! The gradient rules of the gemm family: linear layers (with their fused ReLU, residual
//! and bf16 copies) and matmul.

use super::Rule;
use crate::autodiff::Builder;
use crate::dtype::DType;
use crate::graph::Phase;
use crate::{GraphError, Op, Result};

pub(in crate::autodiff) fn gemm(b: &mut Builder, r: &Rule) -> Result<()> {
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
