//! Losses and their gradients: `BceWithLogits`, `SoftmaxCrossEntropy`.
//!
//! Everything of the family in one place: the CPU reference (`cpu`, what every CUDA
//! kernel is tested against), the CUDA launch plans (`cuda`) and the cost estimate the
//! scheduler reads (`cost`).

// ---- the CPU reference ----
pub mod cpu {
    //! The CPU reference of the loss ops: losses and their gradients.

    use crate::cpu::*;

    /// Losses and their gradients.
    pub(crate) fn exec_loss<T: Elem>(
        call: &NodeCall,
        ins: &[&Buffer],
        outs: &mut [Buffer],
        _upd: &mut [Buffer],
    ) -> Result<(), String> {
        let ish = |i: usize| call.in_shapes[i];
        match call.op {
            Op::BceWithLogits => {
                let l = kernels::bce_with_logits(
                    get::<T>(ins[0], "logit")?,
                    get::<T>(ins[1], "label")?,
                );
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
}

// ---- the CUDA launch plans ----
pub(crate) mod cuda {
    //! Losses (`kernels-cuda/loss.cu`): BCE with logits, softmax cross-entropy, their gradients.

    use crate::cuda::common::*;
    use crate::cuda::reduce::loss_blocks;
    use crate::cuda::reduce::reduce_to_scalar;
    use crate::cuda::reduce::scalar_out;
    use crate::cuda::{CudaPlan, KArg, Operands};
    use erase_graph::{Op, Shape};
    use KArg::{Out, Scratch, I32};

    /// Kernels these plans launch.
    pub(crate) const KERNELS: &[&str] = &[
        "bce_grad",
        "loss_partial_f64",
        "softmax_xent_rows",
        "softmax_xent_grad",
    ];

    pub(crate) fn bce(op: &Op, o: &Operands) -> Result<CudaPlan, String> {
        expect(op, o, &[F, F], &[F])?;
        scalar_out(op, o)?;
        let n = o.ins[0].numel();
        if o.ins[1].numel() != n {
            return Err(format!(
                "bce_with_logits: logit {} and label {} differ in size",
                o.ins[0], o.ins[1]
            ));
        }
        Ok(reduce_to_scalar(KArg::In(0), KArg::In(1), n, 1, true))
    }

    /// (rows, classes) of softmax cross-entropy logits with their labels.
    fn xent_dims(op: &Op, logits: &Shape, labels: &Shape) -> Result<(usize, usize), String> {
        let [n, c] = logits.dims() else {
            return Err(format!("{}: logits {logits} must be [N, C]", op.name()));
        };
        if labels.numel() != *n {
            return Err(format!("{}: labels {labels} must hold {n} rows", op.name()));
        }
        Ok((*n, *c))
    }

    pub(crate) fn softmax_xent(op: &Op, o: &Operands) -> Result<CudaPlan, String> {
        expect(op, o, &[F, I], &[F])?;
        scalar_out(op, o)?;
        let (n, c) = xent_dims(op, o.ins[0], o.ins[1])?;
        let g = loss_blocks(n);
        Ok(plan_of(
            vec![
                warp_rows(
                    "softmax_xent_rows",
                    n,
                    vec![
                        KArg::In(0),
                        KArg::In(1),
                        Scratch(0),
                        n64(n),
                        I32(i32_of(c, "classes")?),
                    ],
                ),
                kc(
                    "loss_partial_f64",
                    [g as u32, 1, 1],
                    [256, 1, 1],
                    0,
                    vec![Scratch(0), n64(n), Scratch(1)],
                ),
                kc(
                    "loss_final",
                    [1, 1, 1],
                    [256, 1, 1],
                    0,
                    vec![Scratch(1), I32(g as i32), Out(0), I32(1), n64(n)],
                ),
            ],
            vec![8 * n.max(1), 8 * g],
        ))
    }

    pub(crate) fn softmax_xent_grad(op: &Op, o: &Operands) -> Result<CudaPlan, String> {
        expect(op, o, &[F, F, I], &[F])?;
        let (n, c) = xent_dims(op, o.ins[1], o.ins[2])?;
        if o.outs[0].numel() != n * c {
            return Err(format!(
                "softmax_cross_entropy_grad: dlogits {} must be [{n}, {c}]",
                o.outs[0]
            ));
        }
        Ok(plan_of(
            vec![warp_rows(
                "softmax_xent_grad",
                n,
                vec![
                    KArg::In(0),
                    KArg::In(1),
                    KArg::In(2),
                    Out(0),
                    n64(n),
                    I32(i32_of(c, "classes")?),
                ],
            )],
            vec![],
        ))
    }

    /// The gradient of the mean BCE with logits.
    pub(crate) fn bce_grad(op: &Op, o: &Operands) -> Result<CudaPlan, String> {
        expect(op, o, &[F, F, F], &[F])?;
        let n = o.ins[1].numel();
        Ok(plan_of(
            vec![ew(
                "bce_grad",
                n,
                vec![KArg::In(0), KArg::In(1), KArg::In(2), Out(0), n64(n)],
            )],
            vec![],
        ))
    }
}

// ---- the cost estimate ----
pub(crate) mod cost {
    pub(crate) use crate::family::elementwise::cost::map;
    pub(crate) use crate::family::reduce::cost::to_scalar;
}
