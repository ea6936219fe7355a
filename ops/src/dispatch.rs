//! The top-level dispatch of every op, one exhaustive `match` each with no fallback: the
//! CPU reference (`exec_untyped` for the ops of any element type and `exec_inner` for the
//! others, both under `cpu::execute`), the CUDA launch plan (`cuda_plan`) and the cost
//! estimate (`launch_spec`). Each line hands an op to its family
//! (`crate::family::<family>`), so a new op does not compile until this file names it in
//! each, and its family file has the three parts.

use crate::cpu::{Buffer, Elem, NodeCall, OpError};
use crate::cuda::{CudaPlan, Operands};
use crate::launch::{Cost, LaunchSpec};
use erase_graph::{DType, Op, Shape};

/// `exec_typed` once the operands are rounded as asked.
pub(crate) fn exec_inner<T: Elem>(
    call: &NodeCall,
    ins: &[&Buffer],
    outs: &mut [Buffer],
    upd: &mut [Buffer],
) -> Result<(), String> {
    use crate::family::{
        attention::cpu as attention, elementwise::cpu as elementwise, embedding::cpu as embedding,
        gemm::cpu as gemm, interaction::cpu as interaction, loss::cpu as loss, norm::cpu as norm,
        optim::cpu as optim, reduce::cpu as reduce, shape::cpu as shape,
    };
    // one arm a family, every op named: a new op does not compile without its reference
    match call.op {
        Op::Linear { .. }
        | Op::LinearGradInput { .. }
        | Op::LinearGradWeight { .. }
        | Op::MatMul { .. } => gemm::exec_gemm::<T>(call, ins, outs, upd),
        Op::MulAdd
        | Op::MulGrad { .. }
        | Op::Add
        | Op::Mul
        | Op::Scale { .. }
        | Op::Relu
        | Op::Gelu
        | Op::Silu
        | Op::Sigmoid
        | Op::ReluGrad
        | Op::GeluGrad
        | Op::SiluGrad
        | Op::SigmoidGrad => elementwise::exec_elementwise::<T>(call, ins, outs, upd),
        Op::LayerNorm { .. } | Op::LayerNormGrad => norm::exec_norm::<T>(call, ins, outs, upd),
        Op::SumToShape
        | Op::Sum
        | Op::Mean
        | Op::Broadcast { .. }
        | Op::GradSum
        | Op::SliceSum { .. } => reduce::exec_reduce::<T>(call, ins, outs, upd),
        Op::Concat { .. } | Op::Slice { .. } | Op::Split { .. } | Op::Pad { .. } => {
            shape::exec_shape::<T>(call, ins, outs, upd)
        }
        Op::PairwiseDot | Op::PairwiseDotGrad => {
            interaction::exec_interaction::<T>(call, ins, outs, upd)
        }
        Op::Attention { .. } | Op::AttentionGrad { .. } => {
            attention::exec_attention::<T>(call, ins, outs, upd)
        }
        Op::EmbeddingBag { .. }
        | Op::BagMean { .. }
        | Op::EmbeddingBagGradDense { .. }
        | Op::RowwiseAdagrad { .. } => embedding::exec_embedding::<T>(call, ins, outs, upd),
        Op::BceWithLogits
        | Op::BceWithLogitsGrad
        | Op::SoftmaxCrossEntropy
        | Op::SoftmaxCrossEntropyGrad => loss::exec_loss::<T>(call, ins, outs, upd),
        Op::Sgd { .. } | Op::Adam { .. } => optim::exec_optim::<T>(call, ins, outs, upd),
        Op::Leaf(_)
        | Op::LinearAdd { .. }
        | Op::LinearMulAdd { .. }
        | Op::Reshape
        | Op::Detach
        | Op::Cast { .. }
        | Op::RoundBf16 { .. }
        | Op::EmbeddingSort { .. }
        | Op::StepIncrement => Err(format!(
            "no typed CPU implementation of {}: exec_untyped runs it",
            call.op.name()
        )),
    }
}

/// The CPU reference of the ops of any element type, in their families: copies and casts,
/// the bf16 copy of a GEMM operand, a linear layer with its residual (two ops composed),
/// the ids' sort and the step counter; `None` for the ops of one float type, which
/// [`exec_inner`] runs once `execute` has found their type.
pub(crate) fn exec_untyped(
    call: &NodeCall,
    ins: &[&Buffer],
    outs: &mut [Buffer],
    upd: &mut [Buffer],
) -> Option<Result<(), OpError>> {
    use crate::family::{
        elementwise::cpu as elementwise, embedding::cpu as embedding, gemm::cpu as gemm,
        optim::cpu as optim,
    };
    let r = match call.op {
        Op::Leaf(_) => Err("leaves are not executed".to_string()),
        Op::Reshape | Op::Detach | Op::Cast { .. } => elementwise::exec_copy(call, ins, outs),
        Op::RoundBf16 { col_sums } => gemm::exec_round_bf16(ins, outs, *col_sums),
        Op::LinearAdd { bias } => return Some(gemm::exec_linear_add(call, ins, outs, upd, *bias)),
        Op::LinearMulAdd { bias } => {
            return Some(gemm::exec_linear_mul_add(call, ins, outs, upd, *bias))
        }
        Op::EmbeddingSort { .. } if ins.len() != 2 => Err(format!(
            "expected ids and offsets, got {} inputs",
            ins.len()
        )),
        Op::EmbeddingSort { field_rows } => embedding::exec_embedding_sort(ins, outs, field_rows),
        Op::StepIncrement => optim::exec_step_increment(upd),
        Op::Linear { .. }
        | Op::LinearGradInput { .. }
        | Op::LinearGradWeight { .. }
        | Op::MatMul { .. }
        | Op::MulAdd
        | Op::MulGrad { .. }
        | Op::Add
        | Op::Mul
        | Op::Scale { .. }
        | Op::Relu
        | Op::Gelu
        | Op::Silu
        | Op::Sigmoid
        | Op::ReluGrad
        | Op::GeluGrad
        | Op::SiluGrad
        | Op::SigmoidGrad
        | Op::LayerNorm { .. }
        | Op::LayerNormGrad
        | Op::SumToShape
        | Op::Sum
        | Op::Mean
        | Op::Broadcast { .. }
        | Op::GradSum
        | Op::SliceSum { .. }
        | Op::Concat { .. }
        | Op::Slice { .. }
        | Op::Split { .. }
        | Op::Pad { .. }
        | Op::PairwiseDot
        | Op::PairwiseDotGrad
        | Op::Attention { .. }
        | Op::AttentionGrad { .. }
        | Op::EmbeddingBag { .. }
        | Op::BagMean { .. }
        | Op::EmbeddingBagGradDense { .. }
        | Op::RowwiseAdagrad { .. }
        | Op::BceWithLogits
        | Op::BceWithLogitsGrad
        | Op::SoftmaxCrossEntropy
        | Op::SoftmaxCrossEntropyGrad
        | Op::Sgd { .. }
        | Op::Adam { .. } => return None,
    };
    Some(r.map_err(|m| call.error(m)))
}

/// The storage forms of the ops that have them, in their families: an output's bf16 copy
/// written beside it, an output or an operand stored in bf16, each composed of the op's
/// plain form (whose reference is the specification) and a rounding; `None` for an op in
/// its plain form, which [`exec_inner`] runs.
pub(crate) fn exec_stored(
    call: &NodeCall,
    ins: &[&Buffer],
    outs: &mut [Buffer],
    upd: &mut [Buffer],
) -> Option<Result<(), OpError>> {
    use crate::family::{
        attention::cpu as attention, elementwise::cpu as elementwise, gemm::cpu as gemm,
        norm::cpu as norm, shape::cpu as shape,
    };
    match call.op {
        Op::Linear { .. } | Op::LinearGradInput { .. } | Op::LinearGradWeight { .. } => {
            gemm::exec_stored(call, ins, outs, upd)
        }
        Op::MulAdd | Op::Mul | Op::MulGrad { .. } => elementwise::exec_stored(call, ins, outs, upd),
        Op::Concat { .. } => shape::exec_stored(call, ins, outs, upd),
        Op::LayerNormGrad => norm::exec_stored(call, ins, outs, upd),
        Op::Attention { .. } | Op::AttentionGrad { .. } => {
            attention::exec_stored(call, ins, outs, upd)
        }
        Op::Leaf(_)
        | Op::Reshape
        | Op::Detach
        | Op::Cast { .. }
        | Op::RoundBf16 { .. }
        | Op::LinearAdd { .. }
        | Op::LinearMulAdd { .. }
        | Op::EmbeddingSort { .. }
        | Op::StepIncrement
        | Op::MatMul { .. }
        | Op::Add
        | Op::Scale { .. }
        | Op::Relu
        | Op::Gelu
        | Op::Silu
        | Op::Sigmoid
        | Op::ReluGrad
        | Op::GeluGrad
        | Op::SiluGrad
        | Op::SigmoidGrad
        | Op::LayerNorm { .. }
        | Op::SumToShape
        | Op::Sum
        | Op::Mean
        | Op::Broadcast { .. }
        | Op::GradSum
        | Op::SliceSum { .. }
        | Op::Slice { .. }
        | Op::Split { .. }
        | Op::Pad { .. }
        | Op::PairwiseDot
        | Op::PairwiseDotGrad
        | Op::EmbeddingBag { .. }
        | Op::BagMean { .. }
        | Op::EmbeddingBagGradDense { .. }
        | Op::RowwiseAdagrad { .. }
        | Op::BceWithLogits
        | Op::BceWithLogitsGrad
        | Op::SoftmaxCrossEntropy
        | Op::SoftmaxCrossEntropyGrad
        | Op::Sgd { .. }
        | Op::Adam { .. } => None,
    }
}

/// The launches of `op`, or why it cannot run on a CUDA device.
pub fn cuda_plan(op: &Op, o: &Operands) -> Result<CudaPlan, String> {
    use crate::family::{
        attention::cuda as attention, elementwise::cuda as elementwise,
        embedding::cuda as embedding, gemm::cuda as gemm, interaction::cuda as interaction,
        loss::cuda as loss, norm::cuda as norm, optim::cuda as optim, reduce::cuda as reduce,
        shape::cuda as shape,
    };
    if let Some(d) = o
        .in_dtypes
        .iter()
        .chain(o.out_dtypes)
        .find(|d| **d == DType::F64)
    {
        return Err(format!(
            "{}: the CUDA backend computes in f32 (with bf16 GEMM operands), not {d}",
            op.name()
        ));
    }
    // one arm an op, no fallback: a new op does not compile until it has its plan
    match op {
        Op::Leaf(_) => Err(format!("{}: a leaf has no kernel", op.name())),
        Op::Linear { bias, relu } => named(op, gemm::linear(o, *bias, *relu, false)),
        Op::LinearAdd { bias } => named(op, gemm::linear(o, *bias, false, true)),
        Op::LinearMulAdd { bias } => named(op, gemm::linear_mul_add(o, *bias)),
        Op::LinearGradInput {
            relu_mask,
            residual,
        } => named(op, gemm::linear_grad_input(o, *relu_mask, *residual)),
        Op::LinearGradWeight { bias } => named(op, gemm::linear_grad_weight(o, *bias)),
        Op::MatMul { ta, tb } => named(op, gemm::matmul(o, *ta, *tb)),
        Op::RoundBf16 { col_sums } => named(op, gemm::round_bf16(o, *col_sums)),
        Op::Attention {
            heads,
            causal,
            packed,
        } => named(op, attention::attention(o, *heads, *causal, *packed)),
        Op::AttentionGrad {
            heads,
            causal,
            packed,
        } => named(op, attention::attention_grad(o, *heads, *causal, *packed)),
        Op::Add => elementwise::binary(op, o, "ew_add"),
        Op::Mul if o.outs.len() == 2 => elementwise::mul_bf16(op, o),
        Op::Mul => elementwise::binary(op, o, "ew_mul"),
        Op::MulAdd => elementwise::mul_add(op, o),
        Op::MulGrad { .. } => elementwise::mul_grad(op, o),
        Op::Scale { factor } => elementwise::scale(op, o, *factor),
        Op::Relu => elementwise::unary(op, o, "ew_relu"),
        Op::Gelu => elementwise::unary(op, o, "ew_gelu"),
        Op::Silu => elementwise::unary(op, o, "ew_silu"),
        Op::Sigmoid => elementwise::unary(op, o, "ew_sigmoid"),
        Op::ReluGrad => elementwise::unary_grad(op, o, "ew_relu_grad"),
        Op::GeluGrad => elementwise::unary_grad(op, o, "ew_gelu_grad"),
        Op::SiluGrad => elementwise::unary_grad(op, o, "ew_silu_grad"),
        Op::SigmoidGrad => elementwise::unary_grad(op, o, "ew_sigmoid_grad"),
        Op::Cast { to } => elementwise::cast(op, o, *to),
        Op::Reshape | Op::Detach => elementwise::copy(op, o),
        Op::Concat { axis } => shape::concat(op, o, *axis),
        Op::Slice { axis, start, len } => shape::slice(op, o, *axis, *start, *len),
        Op::Split { axis, sizes } => shape::split(op, o, *axis, sizes),
        Op::Pad { axis, start, full } => shape::pad(op, o, *axis, *start, *full),
        Op::LayerNorm { eps } => norm::layer_norm(op, o, *eps),
        Op::LayerNormGrad => norm::layer_norm_grad(op, o),
        Op::SumToShape => reduce::sum_to_shape(op, o),
        Op::Sum => reduce::full_sum(op, o, false),
        Op::Mean => reduce::full_sum(op, o, true),
        Op::Broadcast { scale } => reduce::broadcast(op, o, *scale),
        Op::GradSum => reduce::grad_sum(op, o),
        Op::SliceSum { axis, start, len } => reduce::slice_sum(op, o, *axis, *start, *len),
        Op::PairwiseDot => interaction::pairwise_dot(op, o, false),
        Op::PairwiseDotGrad => interaction::pairwise_dot(op, o, true),
        Op::BceWithLogits => loss::bce(op, o),
        Op::BceWithLogitsGrad => loss::bce_grad(op, o),
        Op::SoftmaxCrossEntropy => loss::softmax_xent(op, o),
        Op::SoftmaxCrossEntropyGrad => loss::softmax_xent_grad(op, o),
        Op::StepIncrement => optim::step_increment(op, o),
        Op::Sgd { lr } => optim::sgd(op, o, *lr),
        Op::Adam {
            lr,
            beta1,
            beta2,
            eps,
        } => optim::adam(op, o, *lr, *beta1, *beta2, *eps),
        Op::EmbeddingBag { field_rows } => embedding::embedding_bag(op, o, field_rows),
        Op::BagMean { mean } => embedding::bag_mean(op, o, mean),
        Op::EmbeddingBagGradDense { field_rows } => {
            embedding::embedding_bag_grad_dense(op, o, field_rows)
        }
        Op::EmbeddingSort { field_rows } => embedding::embedding_sort(op, o, field_rows),
        Op::RowwiseAdagrad {
            lr,
            eps,
            field_rows,
        } => embedding::rowwise_adagrad(op, o, *lr, *eps, field_rows),
    }
}

/// A GEMM or attention plan's error, prefixed with the op's name.
fn named(op: &Op, p: Result<CudaPlan, String>) -> Result<CudaPlan, String> {
    p.map_err(|e| format!("{}: {e}", op.name()))
}

/// The launch of `op` with operand shapes `ins` -> `outs` (element type `dt`): one line
/// an op, no fallback, each estimate in its family's `cost`.
pub fn launch_spec(op: &Op, ins: &[&Shape], outs: &[&Shape], dt: DType) -> Option<LaunchSpec> {
    launch_spec_typed(op, ins, &[], outs, &[], dt)
}

/// [`launch_spec`] with each operand's element type (`in_dtypes`, `out_dtypes`; those
/// past their end take `dt`): bytes moved count a bf16 operand's 2 bytes an element.
pub fn launch_spec_typed(
    op: &Op,
    ins: &[&Shape],
    in_dtypes: &[DType],
    outs: &[&Shape],
    out_dtypes: &[DType],
    dt: DType,
) -> Option<LaunchSpec> {
    use crate::family::{
        attention::cost as attention, elementwise::cost as elementwise,
        embedding::cost as embedding, gemm::cost as gemm, interaction::cost as interaction,
        loss::cost as loss, norm::cost as norm, optim::cost as optim, reduce::cost as reduce,
        shape::cost as shape,
    };
    let size = |d: &DType| d.size_bytes() as f64;
    let (in_e, out_e): (Vec<f64>, Vec<f64>) = (
        in_dtypes.iter().map(size).collect(),
        out_dtypes.iter().map(size).collect(),
    );
    let c = &Cost {
        ins,
        outs,
        e: dt.size_bytes() as f64,
        in_e: &in_e,
        out_e: &out_e,
    };
    let mut spec = match op {
        Op::Leaf(_) | Op::Reshape | Op::Detach => return None,
        Op::Linear { .. } => gemm::linear(c),
        Op::LinearAdd { .. } => gemm::linear_add(c),
        Op::LinearMulAdd { .. } => gemm::linear_mul_add(c),
        Op::LinearGradInput { residual, .. } => gemm::linear_grad_input(c, *residual),
        Op::LinearGradWeight { .. } => gemm::linear_grad_weight(c),
        Op::MatMul { ta, .. } => gemm::matmul(c, *ta),
        Op::RoundBf16 { .. } => gemm::round_bf16(c),
        Op::Attention {
            heads,
            packed,
            causal,
        } => attention::attention(c, *heads, *packed, *causal, false),
        Op::AttentionGrad {
            heads,
            packed,
            causal,
        } => attention::attention(c, *heads, *packed, *causal, true),
        Op::Add => elementwise::map(c),
        Op::Mul => elementwise::map(c),
        Op::MulAdd => elementwise::map(c),
        Op::MulGrad { .. } => elementwise::map(c),
        Op::Scale { .. } => elementwise::map(c),
        Op::Relu => elementwise::map(c),
        Op::Gelu => elementwise::map(c),
        Op::Silu => elementwise::map(c),
        Op::Sigmoid => elementwise::map(c),
        Op::ReluGrad => elementwise::map(c),
        Op::GeluGrad => elementwise::map(c),
        Op::SiluGrad => elementwise::map(c),
        Op::SigmoidGrad => elementwise::map(c),
        Op::Cast { .. } => elementwise::map(c),
        Op::Concat { .. } => shape::map(c),
        Op::Slice { .. } => shape::map(c),
        Op::Split { .. } => shape::map(c),
        Op::Pad { .. } => shape::map(c),
        Op::LayerNorm { .. } => norm::layer_norm(c, false),
        Op::LayerNormGrad => norm::layer_norm(c, true),
        Op::SumToShape => reduce::sum_to_shape(c),
        Op::Sum => reduce::to_scalar(c),
        Op::Mean => reduce::to_scalar(c),
        Op::Broadcast { .. } => reduce::map(c),
        // the slice-sum kernels over one row: the same passes, chained ones included
        Op::GradSum => reduce::slice_sum(c),
        Op::SliceSum { .. } => reduce::slice_sum(c),
        Op::PairwiseDot => interaction::pairwise_dot(c, false),
        Op::PairwiseDotGrad => interaction::pairwise_dot(c, true),
        Op::BceWithLogits => loss::to_scalar(c),
        Op::BceWithLogitsGrad => loss::map(c),
        Op::SoftmaxCrossEntropy => loss::to_scalar(c),
        Op::SoftmaxCrossEntropyGrad => loss::map(c),
        Op::StepIncrement => optim::step_increment(c),
        Op::Sgd { .. } => optim::multi_tensor(c, false),
        Op::Adam { .. } => optim::multi_tensor(c, true),
        Op::EmbeddingBag { .. } => embedding::embedding_bag(c),
        Op::EmbeddingBagGradDense { .. } => embedding::embedding_bag(c),
        Op::BagMean { .. } => embedding::bag_mean(c),
        Op::EmbeddingSort { field_rows } => embedding::embedding_sort(c, field_rows),
        Op::RowwiseAdagrad { .. } => embedding::rowwise_adagrad(c),
    };
    // a GEMM whose operands are bf16 (the copies it reads in place)
    spec.copies = dt == DType::Bf16
        && matches!(
            op,
            Op::Linear { .. }
                | Op::LinearMulAdd { .. }
                | Op::LinearGradInput { .. }
                | Op::LinearGradWeight { .. }
        );
    Some(spec)
}
