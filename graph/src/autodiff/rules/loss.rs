//! The gradient rules of the loss family: losses.

use super::Rule;
use crate::autodiff::Builder;
use crate::{Op, Result};

pub(in crate::autodiff) fn loss(b: &mut Builder, r: &Rule) -> Result<()> {
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
