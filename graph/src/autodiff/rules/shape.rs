//! The gradient rules of the shape family: reshapes, detach, bf16 rounding, casts, concat
//! and slice.

use super::Rule;
use crate::autodiff::Builder;
use crate::dtype::Shape;
use crate::graph::Phase;
use crate::{Op, Result};

pub(in crate::autodiff) fn shape(b: &mut Builder, r: &Rule) -> Result<()> {
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
