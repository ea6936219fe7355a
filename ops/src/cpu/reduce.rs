//! The CPU reference of the reduce ops: sums: to a shape, full, broadcasts, gradient and slice sums.

use super::*;

/// Sums: to a shape, full, broadcasts, gradient and slice sums.
pub(super) fn exec_reduce<T: Elem>(
    call: &NodeCall,
    ins: &[&Buffer],
    outs: &mut [Buffer],
    _upd: &mut [Buffer],
) -> Result<(), String> {
    let ish = |i: usize| call.in_shapes[i];
    let osh = |i: usize| call.out_shapes[i];
    match call.op {
        Op::SumToShape => kernels::sum_to_shape(get::<T>(ins[0], "dy")?, out(&mut outs[0])?),
        Op::Sum | Op::Mean => {
            let x = get::<T>(ins[0], "x")?;
            let s: f64 = x.iter().map(|v| v.to_f64()).sum();
            let v = if matches!(call.op, Op::Mean) {
                s / x.len() as f64
            } else {
                s
            };
            out::<T>(&mut outs[0])?[0] = T::from_f64(v);
        }
        Op::Broadcast { scale } => {
            let v = scalar::<T>(ins[0])? * T::from_f64(*scale);
            out::<T>(&mut outs[0])?.iter_mut().for_each(|o| *o = v);
        }
        Op::GradSum => {
            let n = osh(0).numel();
            sum_rows(ins, out::<T>(&mut outs[0])?, n, n, 0)?;
        }
        Op::SliceSum { axis, start, len } => {
            if ins.is_empty() {
                return Err("slice_sum: no inputs".into());
            }
            let dims = ish(0).dims();
            if *axis >= dims.len() || start + len > dims[*axis] {
                return Err(format!(
                    "slice_sum: {start}+{len} of axis {axis} of {}",
                    ish(0)
                ));
            }
            if let Some(i) = (1..ins.len()).find(|&i| ish(i) != ish(0)) {
                return Err(format!(
                    "slice_sum: contribution {i} is {}, contribution 0 {}",
                    ish(i),
                    ish(0)
                ));
            }
            let v = AxisView::new(dims, *axis);
            let (w, ld, off) = (len * v.inner, dims[*axis] * v.inner, start * v.inner);
            if osh(0).numel() != v.outer * w {
                return Err(format!(
                    "slice_sum: {start}+{len} of axis {axis} of {} into {}",
                    ish(0),
                    osh(0)
                ));
            }
            sum_rows(ins, out::<T>(&mut outs[0])?, w, ld, off)?;
        }
        other => return Err(format!("reduce: no CPU implementation of {}", other.name())),
    }
    Ok(())
}
