//! The gradient rules of the norm family: layer norm.

use super::Rule;
use crate::autodiff::{copied_layer_output, Builder};
use crate::dtype::{DType, Shape};
use crate::graph::Phase;
use crate::{Op, Result};

pub(in crate::autodiff) fn norm(b: &mut Builder, r: &Rule) -> Result<()> {
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
