//! The CPU reference of the shape ops: concat, slice, split and pad.

use super::*;

/// Concat, slice, split and pad.
pub(super) fn exec_shape<T: Elem>(
    call: &NodeCall,
    ins: &[&Buffer],
    outs: &mut [Buffer],
    _upd: &mut [Buffer],
) -> Result<(), String> {
    let ish = |i: usize| call.in_shapes[i];
    let osh = |i: usize| call.out_shapes[i];
    match call.op {
        Op::Concat { axis } => {
            let total = osh(0).dims()[*axis];
            let v = AxisView::new(osh(0).dims(), *axis);
            let o = out::<T>(&mut outs[0])?;
            let mut start = 0;
            for (i, b) in ins.iter().enumerate() {
                let len = ish(i).dims()[*axis];
                kernels::place(get::<T>(b, "input")?, o, v, start, len, total);
                start += len;
            }
        }
        Op::Slice { axis, start, len } => {
            let total = ish(0).dims()[*axis];
            let v = AxisView::new(ish(0).dims(), *axis);
            kernels::take(
                get::<T>(ins[0], "x")?,
                out(&mut outs[0])?,
                v,
                *start,
                *len,
                total,
            );
        }
        Op::Split { axis, sizes } => {
            let total = ish(0).dims()[*axis];
            let v = AxisView::new(ish(0).dims(), *axis);
            let x = get::<T>(ins[0], "x")?;
            if outs.len() != sizes.len() || sizes.iter().sum::<usize>() != total {
                return Err(format!(
                    "split: {} parts of {sizes:?} from an axis of {total}",
                    outs.len()
                ));
            }
            let mut start = 0;
            for (o, &len) in outs.iter_mut().zip(sizes) {
                kernels::take(x, out(o)?, v, start, len, total);
                start += len;
            }
        }
        Op::Pad { axis, start, full } => {
            let len = ish(0).dims()[*axis];
            let v = AxisView::new(osh(0).dims(), *axis);
            let o = out::<T>(&mut outs[0])?;
            o.iter_mut().for_each(|x| *x = T::ZERO);
            kernels::place(get::<T>(ins[0], "dy")?, o, v, *start, len, *full);
        }
        other => return Err(format!("shape: no CPU implementation of {}", other.name())),
    }
    Ok(())
}
