//! The CPU reference of the norm ops: layer norm and its gradient.

use super::*;

/// Layer norm and its gradient.
pub(super) fn exec_norm<T: Elem>(
    call: &NodeCall,
    ins: &[&Buffer],
    outs: &mut [Buffer],
    _upd: &mut [Buffer],
) -> Result<(), String> {
    match call.op {
        Op::LayerNorm { eps } => {
            let (x, g, b) = (
                get::<T>(ins[0], "x")?,
                get::<T>(ins[1], "gamma")?,
                get::<T>(ins[2], "beta")?,
            );
            let (y, m, r) = three::<T>(outs)?;
            kernels::layer_norm(x, g, b, y, m, r, *eps);
        }
        Op::LayerNormGrad => {
            let dy = get::<T>(ins[0], "dy")?;
            let (x, g) = (get::<T>(ins[1], "x")?, get::<T>(ins[2], "gamma")?);
            let (m, r) = (get::<T>(ins[3], "mean")?, get::<T>(ins[4], "rstd")?);
            let (dx, dg, db) = three::<T>(outs)?;
            kernels::layer_norm_grad(dy, x, g, m, r, dx, dg, db);
        }
        other => return Err(format!("norm: no CPU implementation of {}", other.name())),
    }
    Ok(())
}
