//! The gradient rules of the elementwise family: elementwise ops and activations.

use super::Rule;
use crate::autodiff::{copied_layer_output, Builder};
use crate::dtype::DType;
use crate::graph::Phase;
use crate::{GraphError, Op, Result};

pub(in crate::autodiff) fn elementwise(b: &mut Builder, r: &Rule) -> Result<()> {
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
            // the update `a ⊙ b + a` (a cross network's first layer, its x0 read from one
            // copy for both, Graph::mul_add_stored): a's two contributions, dy ⊙ b and dy,
            // summed by the gradient's own pass (one tensor fewer for x0's sum to read)
            let folded = b.g.fold_plus_dy()
                && matches!(node.op, Op::MulAdd)
                && r.needs(2)
                && ins[0] == ins[2];
            if let Some((k, sums)) = fused {
                // [dy, other, linear output] -> [other's gradient, the layer's dy in
                // bf16 (, its column sums)]
                let (other, lin) = (ins[1 - k], ins[k]);
                let folded = folded && k == 1;
                let f = b.g.float_dtype();
                let mut outs = vec![(s.clone(), f), (s, DType::Bf16)];
                if let Some(bs) = &sums {
                    outs.push((bs.clone(), f));
                }
                let g = b.g.add_derived(
                    Op::MulGrad { plus_dy: folded },
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
                if folded {
                    // c's contribution is in da already
                    return Ok(());
                }
            } else {
                let g = b.add(
                    Op::MulGrad { plus_dy: false },
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
