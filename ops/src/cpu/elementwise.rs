//! The CPU reference of the elementwise ops: elementwise ops, activations and their gradients.

use super::*;

/// Elementwise ops, activations and their gradients.
pub(super) fn exec_elementwise<T: Elem>(
    call: &NodeCall,
    ins: &[&Buffer],
    outs: &mut [Buffer],
    _upd: &mut [Buffer],
) -> Result<(), String> {
    match call.op {
        Op::MulAdd => {
            let (a, b, c) = (
                get::<T>(ins[0], "a")?,
                get::<T>(ins[1], "b")?,
                get::<T>(ins[2], "c")?,
            );
            kernels::map_index(out(&mut outs[0])?, |i| a[i] * b[i] + c[i]);
        }
        Op::MulGrad => {
            let (dy, a, b) = (
                get::<T>(ins[0], "dy")?,
                get::<T>(ins[1], "a")?,
                get::<T>(ins[2], "b")?,
            );
            let [da, db] = outs else {
                return Err("expected two outputs".into());
            };
            kernels::map_index(out(da)?, |i| dy[i] * b[i]);
            kernels::map_index(out(db)?, |i| dy[i] * a[i]);
        }
        Op::Add | Op::Mul => {
            let (a, b) = (get::<T>(ins[0], "a")?, get::<T>(ins[1], "b")?);
            kernels::broadcast_binary(a, b, out(&mut outs[0])?, matches!(call.op, Op::Mul));
        }
        Op::Scale { factor } => {
            let x = get::<T>(ins[0], "x")?;
            let f = T::from_f64(*factor);
            kernels::map_index(out(&mut outs[0])?, |i| x[i] * f);
        }
        Op::Relu => {
            let x = get::<T>(ins[0], "x")?;
            kernels::map_index(out(&mut outs[0])?, |i| {
                if x[i] > T::ZERO {
                    x[i]
                } else {
                    T::ZERO
                }
            });
        }
        Op::Gelu => {
            let x = get::<T>(ins[0], "x")?;
            kernels::map_index(out(&mut outs[0])?, |i| kernels::gelu(x[i]));
        }
        Op::Sigmoid => {
            let x = get::<T>(ins[0], "x")?;
            kernels::map_index(out(&mut outs[0])?, |i| kernels::sigmoid(x[i]));
        }
        Op::ReluGrad => {
            let (dy, y) = (get::<T>(ins[0], "dy")?, get::<T>(ins[1], "y")?);
            kernels::map_index(out(&mut outs[0])?, |i| {
                if y[i] > T::ZERO {
                    dy[i]
                } else {
                    T::ZERO
                }
            });
        }
        Op::GeluGrad => {
            let (dy, x) = (get::<T>(ins[0], "dy")?, get::<T>(ins[1], "x")?);
            kernels::map_index(out(&mut outs[0])?, |i| dy[i] * kernels::gelu_grad(x[i]));
        }
        Op::SigmoidGrad => {
            let (dy, y) = (get::<T>(ins[0], "dy")?, get::<T>(ins[1], "y")?);
            kernels::map_index(out(&mut outs[0])?, |i| dy[i] * y[i] * (T::ONE - y[i]));
        }
        other => {
            return Err(format!(
                "elementwise: no CPU implementation of {}",
                other.name()
            ))
        }
    }
    Ok(())
}
