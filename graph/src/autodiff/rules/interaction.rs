//! The gradient rules of the interaction family: the pairwise dots of the DLRM interaction.

use super::Rule;
use crate::autodiff::Builder;
use crate::{Op, Result};

pub(in crate::autodiff) fn interaction(b: &mut Builder, r: &Rule) -> Result<()> {
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
