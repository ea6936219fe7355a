//! The gradient rules of the reduce family: full sums and means.

use super::Rule;
use crate::autodiff::Builder;
use crate::{Op, Result};

pub(in crate::autodiff) fn reduce(b: &mut Builder, r: &Rule) -> Result<()> {
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
