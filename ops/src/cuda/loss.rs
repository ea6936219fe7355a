//! Losses (`kernels-cuda/loss.cu`): BCE with logits, softmax cross-entropy, their gradients.

use super::common::*;
use super::reduce::loss_blocks;
use super::reduce::reduce_to_scalar;
use super::reduce::scalar_out;
use super::{CudaPlan, KArg, Operands};
use erase_graph::{Op, Shape};
use KArg::{Out, Scratch, I32};

/// Kernels these plans launch.
pub(super) const KERNELS: &[&str] = &[
    "bce_grad",
    "loss_partial_f64",
    "softmax_xent_rows",
    "softmax_xent_grad",
];

pub(super) fn bce(op: &Op, o: &Operands) -> Result<CudaPlan, String> {
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

pub(super) fn softmax_xent(op: &Op, o: &Operands) -> Result<CudaPlan, String> {
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

pub(super) fn softmax_xent_grad(op: &Op, o: &Operands) -> Result<CudaPlan, String> {
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
pub(super) fn bce_grad(op: &Op, o: &Operands) -> Result<CudaPlan, String> {
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
