//! The CPU reference of the optim ops: sGD and Adam.

use super::*;

/// SGD and Adam.
pub(super) fn exec_optim<T: Elem>(
    call: &NodeCall,
    ins: &[&Buffer],
    _outs: &mut [Buffer],
    upd: &mut [Buffer],
) -> Result<(), String> {
    match call.op {
        Op::Sgd { lr } => {
            let lr = T::from_f64(*lr);
            for (gb, pb) in ins.iter().zip(upd.iter_mut()) {
                let g = get::<T>(gb, "gradient")?;
                for (p, &gi) in out::<T>(pb)?.iter_mut().zip(g) {
                    *p -= lr * gi;
                }
            }
        }
        Op::Adam {
            lr,
            beta1,
            beta2,
            eps,
        } => {
            let step = ins[0]
                .as_i32()
                .and_then(|s| s.first().copied())
                .ok_or("adam needs an i32 step")?;
            if step < 1 {
                return Err(format!(
                    "adam step count is {step}; the step increment must run first"
                ));
            }
            let h = AdamHyper {
                lr: *lr,
                beta1: *beta1,
                beta2: *beta2,
                eps: *eps,
                step,
            };
            let n = ins.len() - 1;
            let (ps, rest) = upd.split_at_mut(n);
            let (ms, vs) = rest.split_at_mut(n);
            for i in 0..n {
                let g = get::<T>(ins[i + 1], "gradient")?;
                kernels::adam(out(&mut ps[i])?, g, out(&mut ms[i])?, out(&mut vs[i])?, &h);
            }
        }
        other => return Err(format!("optim: no CPU implementation of {}", other.name())),
    }
    Ok(())
}
