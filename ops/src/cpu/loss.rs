//! The CPU reference of the loss ops: losses and their gradients.

use super::*;

/// Losses and their gradients.
pub(super) fn exec_loss<T: Elem>(
    call: &NodeCall,
    ins: &[&Buffer],
    outs: &mut [Buffer],
    _upd: &mut [Buffer],
) -> Result<(), String> {
    let ish = |i: usize| call.in_shapes[i];
    match call.op {
        Op::BceWithLogits => {
            let l =
                kernels::bce_with_logits(get::<T>(ins[0], "logit")?, get::<T>(ins[1], "label")?);
            out::<T>(&mut outs[0])?[0] = T::from_f64(l);
        }
        Op::BceWithLogitsGrad => {
            let dl = scalar::<T>(ins[0])?;
            let (x, y) = (get::<T>(ins[1], "logit")?, get::<T>(ins[2], "label")?);
            kernels::bce_with_logits_grad(dl, x, y, out(&mut outs[0])?);
        }
        Op::SoftmaxCrossEntropy | Op::SoftmaxCrossEntropyGrad => {
            let grad = matches!(call.op, Op::SoftmaxCrossEntropyGrad);
            let off = usize::from(grad);
            let x = get::<T>(ins[off], "logits")?;
            let labels = get_i32(ins[off + 1], "labels")?;
            let c = ish(off).dims()[1];
            if let Some((r, &l)) = labels
                .iter()
                .enumerate()
                .find(|(_, &l)| l < 0 || l as usize >= c)
            {
                return Err(format!(
                    "label {l} of row {r} is out of range for {c} classes"
                ));
            }
            if grad {
                let dl = scalar::<T>(ins[0])?;
                kernels::softmax_cross_entropy_grad(dl, x, labels, out(&mut outs[0])?, c);
            } else {
                let l = kernels::softmax_cross_entropy(x, labels, c);
                out::<T>(&mut outs[0])?[0] = T::from_f64(l);
            }
        }
        other => return Err(format!("loss: no CPU implementation of {}", other.name())),
    }
    Ok(())
}
