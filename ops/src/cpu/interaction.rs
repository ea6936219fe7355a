//! The CPU reference of the interaction ops: the pairwise dots of the DLRM interaction and their gradient.

use super::*;

/// The pairwise dots of the DLRM interaction and their gradient.
pub(super) fn exec_interaction<T: Elem>(
    call: &NodeCall,
    ins: &[&Buffer],
    outs: &mut [Buffer],
    _upd: &mut [Buffer],
) -> Result<(), String> {
    let ish = |i: usize| call.in_shapes[i];
    match call.op {
        Op::PairwiseDot => {
            let d = ish(0).dims();
            kernels::pairwise_dot(get::<T>(ins[0], "e")?, out(&mut outs[0])?, d[1], d[2]);
        }
        Op::PairwiseDotGrad => {
            let d = ish(1).dims();
            let (dy, e) = (get::<T>(ins[0], "dy")?, get::<T>(ins[1], "e")?);
            kernels::pairwise_dot_grad(dy, e, out(&mut outs[0])?, d[1], d[2]);
        }
        other => {
            return Err(format!(
                "interaction: no CPU implementation of {}",
                other.name()
            ))
        }
    }
    Ok(())
}
