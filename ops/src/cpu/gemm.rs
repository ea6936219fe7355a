//! The CPU reference of the gemm ops: linear layers, their gradients and matmul.

use super::*;

/// Linear layers, their gradients and matmul.
pub(super) fn exec_gemm<T: Elem>(
    call: &NodeCall,
    ins: &[&Buffer],
    outs: &mut [Buffer],
    _upd: &mut [Buffer],
) -> Result<(), String> {
    let ish = |i: usize| call.in_shapes[i];
    let osh = |i: usize| call.out_shapes[i];
    match call.op {
        Op::Linear { bias, relu } => {
            let (x, w) = (get::<T>(ins[0], "input")?, get::<T>(ins[1], "weight")?);
            let b = if *bias {
                Some(get::<T>(ins[2], "bias")?)
            } else {
                None
            };
            let (n, k) = (ish(1).dims()[0], ish(1).dims()[1]);
            let y = out(&mut outs[0])?;
            kernels::linear(x, w, b, y, ish(0).rows(), k, n);
            if *relu {
                // as the Relu op (and the GEMM epilogue's fmaxf): x if x > 0, else 0
                y.iter_mut().for_each(|v| {
                    *v = if *v > T::ZERO { *v } else { T::ZERO };
                });
            }
        }
        Op::LinearGradInput { relu_mask } => {
            let (dy, w) = (get::<T>(ins[0], "dy")?, get::<T>(ins[1], "weight")?);
            let (n, k) = (ish(1).dims()[0], ish(1).dims()[1]);
            let dx = out(&mut outs[0])?;
            kernels::linear_grad_input(dy, w, dx, ish(0).rows(), k, n);
            if *relu_mask {
                // as ReluGrad on the product: dx where y > 0, else 0
                let y = get::<T>(ins[2], "y")?;
                if y.len() != dx.len() {
                    return Err(format!("y has {} elements, dx {}", y.len(), dx.len()));
                }
                for (d, &v) in dx.iter_mut().zip(y) {
                    *d = if v > T::ZERO { *d } else { T::ZERO };
                }
            }
        }
        Op::LinearGradWeight { .. } => {
            // db (with `bias`) is summed in exec_typed from the unrounded dy
            let (dy, x) = (get::<T>(ins[0], "dy")?, get::<T>(ins[1], "input")?);
            let (n, k) = (osh(0).dims()[0], osh(0).dims()[1]);
            kernels::linear_grad_weight(dy, x, out(&mut outs[0])?, ish(0).rows(), k, n);
        }
        Op::MatMul { ta, tb } => {
            let (a, b) = (get::<T>(ins[0], "a")?, get::<T>(ins[1], "b")?);
            let (da, db) = (ish(0).dims(), ish(1).dims());
            let r = da.len();
            let batch = if r == 3 { da[0] } else { 1 };
            kernels::matmul(
                a,
                b,
                out(&mut outs[0])?,
                batch,
                (da[r - 2], da[r - 1]),
                (db[r - 2], db[r - 1]),
                *ta,
                *tb,
            );
        }
        other => return Err(format!("gemm: no CPU implementation of {}", other.name())),
    }
    Ok(())
}
