//! The gradient rules of the embedding family: embedding bags (their tables get sparse
//! gradients) and mean pooling.

use super::Rule;
use crate::autodiff::Builder;
use crate::{Op, Result};

pub(in crate::autodiff) fn embedding(b: &mut Builder, r: &Rule) -> Result<()> {
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
