//! The gradient rules of the attention family: fused attention (packed QKV or separate).

use super::Rule;
use crate::autodiff::{bf16_layer_gradient, Builder};
use crate::dtype::DType;
use crate::graph::Phase;
use crate::{Op, Result};

pub(in crate::autodiff) fn attention(b: &mut Builder, r: &Rule) -> Result<()> {
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
