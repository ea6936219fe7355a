//! Everything but GEMMs and attention: elementwise ops, activations, layer norm, shape ops,
//! the DLRM interaction, embedding bags, losses, reductions and optimizers.
//!
//! Kernels live in `kernels-cuda/{elementwise,norm,reduce,interaction,loss,optim,
//! embedding_bag}.cu`; each file's header says how it tiles the work. Launch-argument
//! conventions: element counts and strides are `I64` (`long long`), small dims `I32`,
//! hyper-parameters `F32` rounded from the op's f64 the way the CPU reference rounds them,
//! except where the reference computes in f64 (Adam's learning rate and betas), which
//! travel bit for bit as `I64(f64::to_bits)`.

use super::{blocks, CudaPlan, KArg, KernelCall, Operands, SMS};
use erase_graph::{DType, Op, Shape};
use KArg::{Out, Scratch, Upd, F32, I32, I64};

/// Kernels these plans launch.
pub(crate) const KERNELS: &[&str] = &[
    // elementwise.cu
    "ew_add",
    "ew_mul",
    "ew_mul_add",
    "ew_mul_add_bf16",
    "ew_mul_bf16",
    "ew_parts_rows_f32_bf16",
    "ew_mul_grad",
    "ew_mul_grad_bf16",
    "ew_scale",
    "ew_relu",
    "ew_gelu",
    "ew_sigmoid",
    "ew_relu_grad",
    "ew_gelu_grad",
    "ew_sigmoid_grad",
    "ew_cast",
    "ew_slice_sum",
    "ew_slice_sum4",
    "ew_fill_scaled",
    "ew_fill_u32",
    "step_increment",
    "ew_copy_u32",
    "ew_copy_u16",
    "ew_copy_rows_u32",
    "ew_parts_rows_u32",
    "ew_parts_rows_u16",
    "ew_parts_rows_u128",
    "ew_copy_rows_u16",
    "ew_pad_rows_u32",
    "ew_pad_rows_u16",
    // norm.cu
    "layer_norm_fwd",
    "layer_norm_bwd_dx",
    "layer_norm_bwd_dx_bf16",
    "layer_norm_bwd_dgb_partial",
    "layer_norm_fwd_v4",
    "layer_norm_bwd_v4",
    // reduce.cu
    "sum_to_shape_partial",
    "colsum_final",
    // interaction.cu
    "pairwise_dot_fwd",
    "pairwise_dot_fwd_gmem",
    "pairwise_dot_bwd",
    "pairwise_dot_bwd_gmem",
    // loss.cu
    "loss_partial",
    "loss_partial_f64",
    "loss_final",
    "softmax_xent_rows",
    "bce_grad",
    "softmax_xent_grad",
    // optim.cu
    "optim_table_build",
    "adam_multi_tensor",
    "sgd_multi_tensor",
    // embedding_bag.cu
    "emb_meta_build",
    "embedding_bag_fwd",
    "embedding_bag_fwd_v4",
    "embedding_bag_fwd_fields",
    "emb_sort_keys",
    "emb_radix_hist",
    "emb_radix_scan",
    "emb_radix_scatter",
    "emb_seg_chunks",
    "emb_seg_tails",
    "emb_adagrad_apply",
    "emb_bag_mean",
];

/// Threads of a 1-D elementwise CTA.
const EW_THREADS: u32 = 256;
/// Grid-stride kernels launch at most this many CTAs (8 waves of a 132-SM H200 at 8
/// CTAs an SM); larger tensors loop.
const MAX_BLOCKS: u32 = 8192;
/// Rows of de a thread of `pairwise_dot_bwd` computes (`PD_KB9` in interaction.cu).
const PD_ROWS: usize = 9;
/// Default dynamic shared memory limit (no opt-in attribute needed below it).
const SMEM_DEFAULT: usize = 48 * 1024;
/// Tensors per optimizer-table or embedding-meta builder launch (the kernels' signature).
const BUILD_SLOTS: usize = 32;
/// Elements per optimizer chunk (`OPT_CHUNK` in optim.cu).
const OPT_CHUNK: usize = 1024;
/// Bytes of one optimizer table record (`OptRec` in optim.cu: 4 pointers, 2 i64).
const OPT_REC_BYTES: usize = 48;
/// Pairs per radix-sort tile (`EMB_TILE`) and sorted positions per segment chunk
/// (`EMB_CHUNK`) in embedding_bag.cu.
const EMB_TILE: usize = 2048;
const EMB_CHUNK: usize = 32;
/// Bags a lane group looks up at once in `embedding_bag_fwd_fields` (`EMB_FWD_BAGS`).
const EMB_FWD_BAGS: usize = 4;
/// CTAs an SM of `embedding_bag_fwd_fields` (its launch bounds, `EMB_FWD_CTAS`): the grid
/// is one wave of them, each walking several chunks of bags, the next chunk's indices
/// loaded while this chunk's rows are in flight.
const EMB_FWD_CTAS: usize = 3;

fn kc(
    kernel: &'static str,
    grid: [u32; 3],
    block: [u32; 3],
    smem: u32,
    args: Vec<KArg>,
) -> KernelCall {
    KernelCall {
        kernel,
        grid,
        block,
        smem,
        args,
    }
}

/// A 1-D grid-stride launch over `n` elements.
fn ew(kernel: &'static str, n: usize, args: Vec<KArg>) -> KernelCall {
    kc(
        kernel,
        [blocks(n, EW_THREADS as usize).min(MAX_BLOCKS), 1, 1],
        [EW_THREADS, 1, 1],
        0,
        args,
    )
}

/// A warp-per-row launch over `rows` rows (8 warps a CTA).
fn warp_rows(kernel: &'static str, rows: usize, args: Vec<KArg>) -> KernelCall {
    kc(
        kernel,
        [blocks(rows, 8).min(MAX_BLOCKS), 1, 1],
        [256, 1, 1],
        0,
        args,
    )
}

fn n64(n: usize) -> KArg {
    I64(n as i64)
}

fn i32_of(v: usize, what: &str) -> Result<i32, String> {
    i32::try_from(v).map_err(|_| format!("{what} = {v} does not fit the kernels' i32"))
}

/// `(column blocks, iters, row slices)` of the kernels that write a [rows][cols] tensor's
/// column sums as partials from their own pass, in the layout of `gemm_round_colsum`
/// (grid (column blocks, row slices), 64 columns and 32·iters rows a CTA): 256 rows a
/// CTA, fewer where that leaves under two CTAs an SM (a narrow tensor). Part of the
/// summation order: every such kernel must take it from here.
pub(crate) fn colsum_geometry(rows: usize, cols: usize) -> (usize, usize, usize) {
    let col_blocks = cols.div_ceil(64);
    let iters = [8usize, 4, 2]
        .into_iter()
        .find(|i| col_blocks * rows.div_ceil(32 * i) >= 2 * SMS)
        .unwrap_or(1);
    (col_blocks, iters, rows.div_ceil(32 * iters))
}

fn plan_of(calls: Vec<KernelCall>, scratch: Vec<usize>) -> CudaPlan {
    CudaPlan { calls, scratch }
}

/// Checks the operand counts and element types.
fn expect(op: &Op, o: &Operands, ins: &[DType], outs: &[DType]) -> Result<(), String> {
    if o.ins.len() != ins.len()
        || o.in_dtypes.len() != ins.len()
        || o.outs.len() != outs.len()
        || o.out_dtypes.len() != outs.len()
    {
        return Err(format!(
            "{}: expected {} inputs and {} outputs, got {} and {}",
            op.name(),
            ins.len(),
            outs.len(),
            o.ins.len(),
            o.outs.len()
        ));
    }
    for (i, (got, want)) in o.in_dtypes.iter().zip(ins).enumerate() {
        if got != want {
            return Err(format!(
                "{}: input {i} is {got}, the CUDA kernel takes {want}",
                op.name()
            ));
        }
    }
    for (i, (got, want)) in o.out_dtypes.iter().zip(outs).enumerate() {
        if got != want {
            return Err(format!(
                "{}: output {i} is {got}, the CUDA kernel writes {want}",
                op.name()
            ));
        }
    }
    Ok(())
}

const F: DType = DType::F32;
const I: DType = DType::I32;

pub(crate) fn plan(op: &Op, o: &Operands) -> Option<Result<CudaPlan, String>> {
    let p = match op {
        Op::Leaf(_)
        | Op::Linear { .. }
        | Op::LinearAdd { .. }
        | Op::LinearGradInput { .. }
        | Op::LinearGradWeight { .. }
        | Op::MatMul { .. }
        | Op::RoundBf16 { .. }
        | Op::Attention { .. }
        | Op::AttentionGrad { .. } => return None,
        Op::Add => binary(op, o, "ew_add"),
        Op::Mul if o.outs.len() == 2 => mul_bf16(op, o),
        Op::Mul => binary(op, o, "ew_mul"),
        Op::MulAdd => mul_add(op, o),
        Op::MulGrad => mul_grad(op, o),
        Op::Scale { factor } => expect(op, o, &[F], &[F]).map(|_| {
            let n = o.outs[0].numel();
            plan_of(
                vec![ew(
                    "ew_scale",
                    n,
                    vec![KArg::In(0), Out(0), n64(n), F32(*factor as f32)],
                )],
                vec![],
            )
        }),
        Op::Relu => unary(op, o, "ew_relu"),
        Op::Gelu => unary(op, o, "ew_gelu"),
        Op::Sigmoid => unary(op, o, "ew_sigmoid"),
        Op::ReluGrad => unary_grad(op, o, "ew_relu_grad"),
        Op::GeluGrad => unary_grad(op, o, "ew_gelu_grad"),
        Op::SigmoidGrad => unary_grad(op, o, "ew_sigmoid_grad"),
        Op::Cast { to } => cast(op, o, *to),
        Op::Reshape | Op::Detach => copy(op, o),
        Op::Concat { axis } => concat(op, o, *axis),
        Op::Slice { axis, start, len } => slice(op, o, *axis, *start, *len),
        Op::Split { axis, sizes } => split(op, o, *axis, sizes),
        Op::Pad { axis, start, full } => pad(op, o, *axis, *start, *full),
        Op::LayerNorm { eps } => layer_norm(op, o, *eps),
        Op::LayerNormGrad => layer_norm_grad(op, o),
        Op::SumToShape => sum_to_shape(op, o),
        Op::PairwiseDot => pairwise_dot(op, o, false),
        Op::PairwiseDotGrad => pairwise_dot(op, o, true),
        Op::EmbeddingBag { field_rows } => embedding_bag(op, o, field_rows),
        Op::BagMean { mean } => bag_mean(op, o, mean),
        Op::EmbeddingBagGradDense { field_rows } => embedding_bag_grad_dense(op, o, field_rows),
        Op::EmbeddingSort { field_rows } => embedding_sort(op, o, field_rows),
        Op::RowwiseAdagrad {
            lr,
            eps,
            field_rows,
        } => rowwise_adagrad(op, o, *lr, *eps, field_rows),
        Op::BceWithLogits => bce(op, o),
        Op::BceWithLogitsGrad => expect(op, o, &[F, F, F], &[F]).map(|_| {
            let n = o.ins[1].numel();
            plan_of(
                vec![ew(
                    "bce_grad",
                    n,
                    vec![KArg::In(0), KArg::In(1), KArg::In(2), Out(0), n64(n)],
                )],
                vec![],
            )
        }),
        Op::SoftmaxCrossEntropy => softmax_xent(op, o),
        Op::SoftmaxCrossEntropyGrad => softmax_xent_grad(op, o),
        Op::Sum => full_sum(op, o, false),
        Op::Mean => full_sum(op, o, true),
        Op::Broadcast { scale } => expect(op, o, &[F], &[F]).map(|_| {
            let n = o.outs[0].numel();
            plan_of(
                vec![ew(
                    "ew_fill_scaled",
                    n,
                    vec![KArg::In(0), Out(0), n64(n), F32(*scale as f32)],
                )],
                vec![],
            )
        }),
        Op::GradSum => grad_sum(op, o),
        Op::SliceSum { axis, start, len } => slice_sum(op, o, *axis, *start, *len),
        Op::StepIncrement => step_increment(op, o),
        Op::Sgd { lr } => sgd(op, o, *lr),
        Op::Adam {
            lr,
            beta1,
            beta2,
            eps,
        } => adam(op, o, *lr, *beta1, *beta2, *eps),
    };
    Some(p)
}

// ---- elementwise -------------------------------------------------------------------------

fn binary(op: &Op, o: &Operands, kernel: &'static str) -> Result<CudaPlan, String> {
    expect(op, o, &[F, F], &[F])?;
    let (n, nb) = (o.ins[0].numel(), o.ins[1].numel());
    if o.outs[0].numel() != n || (n > 0 && (nb == 0 || !n.is_multiple_of(nb))) {
        return Err(format!(
            "{}: b {} must be a suffix of a {} and c {} must be a's shape",
            op.name(),
            o.ins[1],
            o.ins[0],
            o.outs[0]
        ));
    }
    Ok(plan_of(
        vec![ew(
            kernel,
            n,
            vec![KArg::In(0), KArg::In(1), Out(0), n64(n), n64(nb)],
        )],
        vec![],
    ))
}

/// The element count when every input and all `outs` outputs have input 0's shape.
fn one_shape(op: &Op, o: &Operands, outs: usize) -> Result<usize, String> {
    let s = o.ins[0];
    if let Some(t) = o.ins.iter().chain(o.outs.iter()).find(|t| **t != s) {
        return Err(format!(
            "{}: every operand must have one shape, {t} is not {s}",
            op.name()
        ));
    }
    if o.outs.len() != outs {
        return Err(format!("{}: expected {outs} outputs", op.name()));
    }
    Ok(s.numel())
}

/// `[a, b, c] -> [a ⊙ b + c]`, or `-> [y, bf16(y)]` with the bf16 copy a GEMM reads
/// (Graph::set_bf16_copies puts it on the producer) written by the same pass.
fn mul_add(op: &Op, o: &Operands) -> Result<CudaPlan, String> {
    let outs: &[DType] = if o.outs.len() == 2 {
        &[F, DType::Bf16]
    } else {
        &[F]
    };
    expect(op, o, &[F, F, F], outs)?;
    let n = one_shape(op, o, outs.len())?;
    let mut args = vec![KArg::In(0), KArg::In(1), KArg::In(2), Out(0)];
    if outs.len() == 2 {
        args.push(Out(1));
    }
    args.push(n64(n));
    let kernel = if outs.len() == 2 {
        "ew_mul_add_bf16"
    } else {
        "ew_mul_add"
    };
    Ok(plan_of(vec![ew(kernel, n.div_ceil(4), args)], vec![]))
}

/// `[a, b] -> [a ⊙ b, bf16(a ⊙ b)]` of same-shape tensors in one pass (a product with
/// the bf16 copy a GEMM reads).
fn mul_bf16(op: &Op, o: &Operands) -> Result<CudaPlan, String> {
    expect(op, o, &[F, F], &[F, DType::Bf16])?;
    let n = one_shape(op, o, 2)?;
    let args = vec![KArg::In(0), KArg::In(1), Out(0), Out(1), n64(n)];
    Ok(plan_of(
        vec![ew("ew_mul_bf16", n.div_ceil(4), args)],
        vec![],
    ))
}

/// `[dy, a, b] -> [dy ⊙ b, dy ⊙ a]`.
fn mul_grad(op: &Op, o: &Operands) -> Result<CudaPlan, String> {
    if o.out_dtypes.get(1) == Some(&DType::Bf16) {
        return mul_grad_bf16(op, o);
    }
    expect(op, o, &[F, F, F], &[F, F])?;
    let n = one_shape(op, o, 2)?;
    let args = vec![
        KArg::In(0),
        KArg::In(1),
        KArg::In(2),
        Out(0),
        Out(1),
        n64(n),
    ];
    Ok(plan_of(
        vec![ew("ew_mul_grad", n.div_ceil(4), args)],
        vec![],
    ))
}

/// MulGrad `[dy, a, b] -> [da, dbb]` or `[da, dbb, s]`: db = dy ⊙ a is a copied linear
/// layer's dy, written only as its bf16 copy, with its column sums (the bias gradient)
/// from the same pass (`ew_mul_grad_bf16`'s partials, then colsum_final in order), as
/// RoundBf16 of the f32 db would make them.
fn mul_grad_bf16(op: &Op, o: &Operands) -> Result<CudaPlan, String> {
    let sums = o.outs.len() == 3;
    let outs: &[DType] = if sums {
        &[F, DType::Bf16, F]
    } else {
        &[F, DType::Bf16]
    };
    expect(op, o, &[F, F, F], outs)?;
    let n = o.ins[0];
    if o.ins.iter().chain(&o.outs[..2]).any(|t| *t != n) {
        return Err(format!(
            "{}: dy, a, b, da and db must have one shape",
            op.name()
        ));
    }
    let (rows, cols) = (n.rows(), n.last());
    if n.rank() < 2 || !cols.is_multiple_of(8) {
        return Err(format!(
            "mul_grad with a bf16 db: the tensors {n} must be at least 2-D with a last dim that is a multiple of 8"
        ));
    }
    if sums && o.outs[2].numel() != cols {
        return Err(format!(
            "mul_grad: the column sums {} do not match {n}",
            o.outs[2]
        ));
    }
    let (ri, ci) = (i32_of(rows, "rows")?, i32_of(cols, "columns")?);
    let (col_blocks, iters, slices) = colsum_geometry(rows, cols);
    let part = if sums { Scratch(0) } else { I64(0) }; // a null pointer: no sums
    let mut calls = vec![kc(
        "ew_mul_grad_bf16",
        [col_blocks as u32, slices as u32, 1],
        [256, 1, 1],
        0,
        vec![
            KArg::In(0),
            KArg::In(1),
            KArg::In(2),
            Out(0),
            Out(1),
            part,
            I32(ri),
            I32(ci),
            I32(iters as i32),
        ],
    )];
    let mut scratch = vec![];
    if sums {
        calls.push(colsum_final_call(Scratch(0), Out(2), slices, cols));
        scratch.push(slices * cols * 4);
    }
    Ok(CudaPlan { calls, scratch })
}

fn unary(op: &Op, o: &Operands, kernel: &'static str) -> Result<CudaPlan, String> {
    expect(op, o, &[F], &[F])?;
    let n = o.outs[0].numel();
    Ok(plan_of(
        vec![ew(kernel, n, vec![KArg::In(0), Out(0), n64(n)])],
        vec![],
    ))
}

fn unary_grad(op: &Op, o: &Operands, kernel: &'static str) -> Result<CudaPlan, String> {
    expect(op, o, &[F, F], &[F])?;
    let n = o.outs[0].numel();
    Ok(plan_of(
        vec![ew(
            kernel,
            n,
            vec![KArg::In(0), KArg::In(1), Out(0), n64(n)],
        )],
        vec![],
    ))
}

/// The element-type code of `ew_cast` (0 f32, 1 bf16, 2 i32).
fn cast_code(d: DType) -> Result<i32, String> {
    match d {
        DType::F32 => Ok(0),
        DType::Bf16 => Ok(1),
        DType::I32 => Ok(2),
        DType::F64 => Err("the CUDA backend has no f64 tensors".into()),
    }
}

fn cast(op: &Op, o: &Operands, to: DType) -> Result<CudaPlan, String> {
    let from = *o.in_dtypes.first().ok_or("cast: no input")?;
    expect(op, o, &[from], &[to])?;
    if from == to {
        return copy(op, o);
    }
    let n = o.outs[0].numel();
    Ok(plan_of(
        vec![ew(
            "ew_cast",
            n,
            vec![
                KArg::In(0),
                Out(0),
                n64(n),
                I32(cast_code(from)?),
                I32(cast_code(to)?),
            ],
        )],
        vec![],
    ))
}

/// `y = a + b` over n f32 elements of one shape (`ew_add`).
pub(crate) fn add_call(a: KArg, b: KArg, y: KArg, n: usize) -> KernelCall {
    ew("ew_add", n, vec![a, b, y, n64(n), n64(n)])
}

/// `dst = bf16(src)` over `n` f32 elements (ew_cast).
pub(crate) fn cast_f32_bf16_call(src: KArg, dst: KArg, n: usize) -> KernelCall {
    ew("ew_cast", n, vec![src, dst, n64(n), I32(0), I32(1)])
}

/// The copy kernels for an element type: (flat, rows, pad).
fn copy_kernels(op: &Op, d: DType) -> Result<[&'static str; 3], String> {
    match d.size_bytes() {
        4 => Ok(["ew_copy_u32", "ew_copy_rows_u32", "ew_pad_rows_u32"]),
        2 => Ok(["ew_copy_u16", "ew_copy_rows_u16", "ew_pad_rows_u16"]),
        _ => Err(format!("{}: no CUDA copy of {d} elements", op.name())),
    }
}

/// Reshape/detach (and a cast to the same type): a plain copy (the runtime may alias
/// instead of launching it).
fn copy(op: &Op, o: &Operands) -> Result<CudaPlan, String> {
    let d = *o
        .in_dtypes
        .first()
        .ok_or_else(|| format!("{}: no input", op.name()))?;
    expect(op, o, &[d], &[d])?;
    let n = o.outs[0].numel();
    if o.ins[0].numel() != n {
        return Err(format!(
            "{}: {} and {} differ in size",
            op.name(),
            o.ins[0],
            o.outs[0]
        ));
    }
    let [flat, _, _] = copy_kernels(op, d)?;
    Ok(plan_of(
        vec![ew(flat, n, vec![KArg::In(0), Out(0), n64(n)])],
        vec![],
    ))
}

/// Elements before and after `axis` of `dims`.
fn around(op: &Op, s: &Shape, axis: usize) -> Result<(usize, usize, usize), String> {
    let d = s.dims();
    if axis >= d.len() {
        return Err(format!("{}: axis {axis} out of range for {s}", op.name()));
    }
    Ok((
        d[..axis].iter().product(),
        d[axis],
        d[axis + 1..].iter().product(),
    ))
}

/// `y[o·dst_row + dst_off + c] = x[o·src_row + src_off + c]` for `o < outer, c < chunk`.
#[allow(clippy::too_many_arguments)]
fn copy_rows(
    kernel: &'static str,
    src: KArg,
    outer: usize,
    chunk: usize,
    src_row: usize,
    src_off: usize,
    dst_row: usize,
    dst_off: usize,
) -> KernelCall {
    ew(
        kernel,
        outer * chunk,
        vec![
            src,
            Out(0),
            n64(outer),
            n64(chunk),
            n64(src_row),
            n64(src_off),
            n64(dst_row),
            n64(dst_off),
        ],
    )
}

/// Parts a launch of `ew_parts_rows_*` takes (`EW_PARTS` in elementwise.cu).
const EW_PARTS: usize = 8;

/// Concat (`split` false: the parts are the inputs, the big tensor the output) or Split
/// (the big tensor the input, the parts the outputs) along `axis`, `EW_PARTS` parts a
/// launch; `parts` are the parts' shapes. With `copy` (a concat of f32 parts), the big
/// tensor's bf16 copy there too: by the same launches where the rows are whole float4
/// units (`ew_parts_rows_f32_bf16`), else by a cast after them.
fn parts_rows(
    op: &Op,
    d: DType,
    big: &Shape,
    parts: &[&Shape],
    axis: usize,
    split: bool,
    copy: Option<KArg>,
) -> Result<CudaPlan, String> {
    if copy.is_some() && (split || d != F) {
        return Err(format!("{}: a bf16 copy of a split or of {d}", op.name()));
    }
    let size = d.size_bytes();
    if size != 4 && size != 2 {
        return Err(format!("{}: no CUDA copy of {d} elements", op.name()));
    }
    let (outer, total, inner) = around(op, big, axis)?;
    let mut lens = Vec::with_capacity(parts.len());
    for (i, s) in parts.iter().enumerate() {
        let (_, len, _) = around(op, s, axis)?;
        if s.numel() != outer * len * inner {
            return Err(format!(
                "{}: part {i} {s} does not fit {big} along axis {axis}",
                op.name()
            ));
        }
        lens.push(len);
    }
    if lens.iter().sum::<usize>() != total {
        return Err(format!(
            "{}: the parts hold {} entries of axis {axis}, {big} {total}",
            op.name(),
            lens.iter().sum::<usize>()
        ));
    }
    // 16-byte units where every part's row, hence every offset, is a whole number of them
    // (the arena aligns each tensor to 256 bytes)
    let per16 = 16 / size;
    let (kernel, unit) = if lens.iter().all(|l| (l * inner).is_multiple_of(per16)) {
        let k = if copy.is_some() {
            "ew_parts_rows_f32_bf16"
        } else {
            "ew_parts_rows_u128"
        };
        (k, per16)
    } else if size == 4 {
        ("ew_parts_rows_u32", 1)
    } else {
        ("ew_parts_rows_u16", 1)
    };
    let (big_arg, part_arg): (KArg, fn(usize) -> KArg) = if split {
        (KArg::In(0), Out)
    } else {
        (Out(0), KArg::In)
    };
    let mut calls = Vec::new();
    let mut start = 0;
    for (g, group) in lens.chunks(EW_PARTS).enumerate() {
        let width: usize = group.iter().sum();
        if outer * width * inner > 0 {
            let mut args = vec![big_arg];
            let fused = kernel == "ew_parts_rows_f32_bf16";
            // the copy kernel takes the copy second and no `split` flag
            args.extend(copy.filter(|_| fused));
            args.extend([
                n64(outer),
                n64(total * inner / unit),
                n64(start * inner / unit),
            ]);
            if !fused {
                args.push(I32(i32::from(split)));
            }
            args.push(I32(group.len() as i32));
            for j in 0..EW_PARTS {
                match group.get(j) {
                    Some(&len) => {
                        args.extend([part_arg(g * EW_PARTS + j), n64(len * inner / unit)])
                    }
                    None => args.extend([big_arg, n64(0)]),
                }
            }
            calls.push(ew(kernel, outer * width * inner / unit, args));
        }
        start += width;
    }
    if let (Some(c), false) = (copy, kernel == "ew_parts_rows_f32_bf16") {
        calls.push(cast_f32_bf16_call(big_arg, c, big.numel()));
    }
    Ok(plan_of(calls, vec![]))
}

/// `[x1, x2, ..] -> [y]`, or `-> [y, bf16(y)]` (f32 parts) with the copy a GEMM reads.
fn concat(op: &Op, o: &Operands, axis: usize) -> Result<CudaPlan, String> {
    let d = *o.out_dtypes.first().ok_or("concat: no output")?;
    let want: Vec<DType> = vec![d; o.ins.len()];
    let copy = o.outs.len() == 2;
    let outs = if copy { vec![F, DType::Bf16] } else { vec![d] };
    expect(op, o, &want, &outs)?;
    if copy && o.outs[1] != o.outs[0] {
        return Err(format!(
            "concat: the copy {} is not the output's shape {}",
            o.outs[1], o.outs[0]
        ));
    }
    parts_rows(op, d, o.outs[0], o.ins, axis, false, copy.then_some(Out(1)))
}

fn split(op: &Op, o: &Operands, axis: usize, sizes: &[usize]) -> Result<CudaPlan, String> {
    let d = *o.in_dtypes.first().ok_or("split: no input")?;
    let want: Vec<DType> = vec![d; sizes.len()];
    expect(op, o, &[d], &want)?;
    for (i, (s, &len)) in o.outs.iter().zip(sizes).enumerate() {
        if around(op, s, axis)?.1 != len {
            return Err(format!(
                "split: part {i} {s} is not {len} entries of axis {axis}"
            ));
        }
    }
    parts_rows(op, d, o.ins[0], o.outs, axis, true, None)
}

fn slice(op: &Op, o: &Operands, axis: usize, start: usize, len: usize) -> Result<CudaPlan, String> {
    let d = *o.in_dtypes.first().ok_or("slice: no input")?;
    expect(op, o, &[d], &[d])?;
    let [_, rows, _] = copy_kernels(op, d)?;
    let (outer, total, inner) = around(op, o.ins[0], axis)?;
    if start + len > total || o.outs[0].numel() != outer * len * inner {
        return Err(format!(
            "slice: {start}+{len} of axis {axis} of {} into {}",
            o.ins[0], o.outs[0]
        ));
    }
    let calls = if outer * len * inner > 0 {
        vec![copy_rows(
            rows,
            KArg::In(0),
            outer,
            len * inner,
            total * inner,
            start * inner,
            len * inner,
            0,
        )]
    } else {
        vec![]
    };
    Ok(plan_of(calls, vec![]))
}

fn pad(op: &Op, o: &Operands, axis: usize, start: usize, full: usize) -> Result<CudaPlan, String> {
    let d = *o.in_dtypes.first().ok_or("pad: no input")?;
    expect(op, o, &[d], &[d])?;
    let [_, _, padk] = copy_kernels(op, d)?;
    let (outer, total, inner) = around(op, o.outs[0], axis)?;
    let len = around(op, o.ins[0], axis)?.1;
    if total != full || start + len > full || o.ins[0].numel() != outer * len * inner {
        return Err(format!(
            "pad: {} at {start} of axis {axis} into {}",
            o.ins[0], o.outs[0]
        ));
    }
    let n = outer * full * inner;
    Ok(plan_of(
        vec![ew(
            padk,
            n,
            vec![
                KArg::In(0),
                Out(0),
                n64(outer),
                n64(full * inner),
                n64(len * inner),
                n64(start * inner),
            ],
        )],
        vec![],
    ))
}

/// The sum of the inputs in input order: the slice_sum kernels over one row.
fn grad_sum(op: &Op, o: &Operands) -> Result<CudaPlan, String> {
    let k = o.ins.len();
    if k == 0 {
        return Err("grad_sum: no inputs".into());
    }
    expect(op, o, &vec![F; k], &[F])?;
    let n = o.outs[0].numel();
    if let Some(s) = o.ins.iter().find(|s| s.numel() != n) {
        return Err(format!(
            "grad_sum: input {s} differs from the output {}",
            o.outs[0]
        ));
    }
    Ok(plan_of(sum_calls(k, n, n, n, 0), vec![]))
}

/// The launches of `y[r·w + c] = Σ_j in_j[r·ld + off + c]` over `n` outputs, in input
/// order: float4 lanes where every row, stride and offset allows; the first call takes
/// inputs 0..8, each next call the running sum (row w, offset 0) and 7 more inputs.
fn sum_calls(k: usize, n: usize, w: usize, ld: usize, off: usize) -> Vec<KernelCall> {
    if n == 0 {
        return Vec::new();
    }
    let vec4 = w.is_multiple_of(4) && ld.is_multiple_of(4) && off.is_multiple_of(4);
    let (kernel, lanes) = if vec4 {
        ("ew_slice_sum4", n / 4)
    } else {
        ("ew_slice_sum", n)
    };
    let mut calls = Vec::new();
    let mut next = 0;
    while next < k {
        let mut ptrs: Vec<KArg> = Vec::with_capacity(8);
        let (ld0, off0) = if next > 0 {
            ptrs.push(Out(0));
            (w, 0)
        } else {
            (ld, off)
        };
        while ptrs.len() < 8 && next < k {
            ptrs.push(KArg::In(next));
            next += 1;
        }
        let used = ptrs.len() as i32;
        while ptrs.len() < 8 {
            ptrs.push(ptrs[0]);
        }
        let mut args = vec![
            Out(0),
            n64(n),
            n64(w),
            n64(ld0),
            n64(off0),
            n64(ld),
            n64(off),
            I32(used),
        ];
        args.extend(ptrs);
        calls.push(ew(kernel, lanes, args));
    }
    calls
}

/// The window `start..start+len` of `axis` of the sum of the inputs, one pass over the
/// window, summed in input order (see sum_calls).
fn slice_sum(
    op: &Op,
    o: &Operands,
    axis: usize,
    start: usize,
    len: usize,
) -> Result<CudaPlan, String> {
    let k = o.ins.len();
    if k == 0 {
        return Err("slice_sum: no inputs".into());
    }
    expect(op, o, &vec![F; k], &[F])?;
    if let Some(s) = o.ins.iter().find(|s| s.dims() != o.ins[0].dims()) {
        return Err(format!(
            "slice_sum: contribution {s} differs from contribution 0 {}",
            o.ins[0]
        ));
    }
    let (outer, total, inner) = around(op, o.ins[0], axis)?;
    let (w, ld, off) = (len * inner, total * inner, start * inner);
    if start + len > total || o.outs[0].numel() != outer * w {
        return Err(format!(
            "slice_sum: {start}+{len} of axis {axis} of {} into {}",
            o.ins[0], o.outs[0]
        ));
    }
    Ok(plan_of(sum_calls(k, outer * w, w, ld, off), vec![]))
}

fn step_increment(op: &Op, o: &Operands) -> Result<CudaPlan, String> {
    expect(op, o, &[], &[])?;
    if o.upd.len() != 1 || o.upd[0].numel() != 1 {
        return Err("step_increment: the step counter must be one i32".into());
    }
    Ok(plan_of(
        vec![kc("step_increment", [1, 1, 1], [32, 1, 1], 0, vec![Upd(0)])],
        vec![],
    ))
}

// ---- layer norm and column reductions ---------------------------------------------------------

/// Row slices of a deterministic two-pass column reduction over `rows × cols`: enough
/// CTAs to fill the GPU, at least 64 rows (8 a thread) per slice, at most 256 slices (the
/// second pass adds a column's slices with 8 threads: 1024 made it a 17 µs serial chain
/// on a 64-wide layer norm). A function of the shape only, so the summation order never
/// changes. Returns (slices, rows per slice).
fn col_slices(rows: usize, cols: usize) -> (usize, usize) {
    let col_blocks = cols.div_ceil(32).max(1);
    let s = rows
        .div_ceil(64)
        .min((2048 / col_blocks).max(1))
        .clamp(1, 256);
    let per = rows.div_ceil(s).max(1);
    (rows.div_ceil(per).max(1), per)
}

/// `colsum_final`: `out[j] = Σ_{s < slices} part[s·n + j]` in a fixed order.
pub(crate) fn colsum_final_call(part: KArg, out: KArg, slices: usize, n: usize) -> KernelCall {
    kc(
        "colsum_final",
        [blocks(n, 32), 1, 1],
        [32, 8, 1],
        0,
        vec![part, out, I32(slices as i32), n64(n)],
    )
}

/// The launches of SumToShape over `rows × n` at `src` into `out`, appended to a plan
/// (the bias gradient of a weight gradient that could not fuse it).
pub(crate) fn append_column_sums(
    calls: &mut Vec<KernelCall>,
    scratch: &mut Vec<usize>,
    src: KArg,
    rows: usize,
    n: usize,
    out: KArg,
) {
    column_reduce(calls, scratch, rows, n, &[out], |s, per, t| {
        kc(
            "sum_to_shape_partial",
            [blocks(n, 32), s, 1],
            [32, 8, 1],
            0,
            vec![src, t[0], n64(rows), n64(n), n64(per)],
        )
    });
}

/// Pass 1 into `part` (or straight into the outputs when one slice suffices) and pass 2.
/// `partial(slices, rows_per_slice, targets)` makes pass 1 given where it writes.
fn column_reduce(
    calls: &mut Vec<KernelCall>,
    scratch: &mut Vec<usize>,
    rows: usize,
    cols: usize,
    outs: &[KArg],
    partial: impl Fn(u32, usize, &[KArg]) -> KernelCall,
) {
    let (s, per) = col_slices(rows, cols);
    if s == 1 {
        calls.push(partial(1, per, outs));
        return;
    }
    let parts: Vec<KArg> = outs
        .iter()
        .map(|_| {
            scratch.push(s * cols * 4);
            Scratch(scratch.len() - 1)
        })
        .collect();
    calls.push(partial(s as u32, per, &parts));
    for (p, out) in parts.iter().zip(outs) {
        calls.push(colsum_final_call(*p, *out, s, cols));
    }
}

fn layer_norm(op: &Op, o: &Operands, eps: f64) -> Result<CudaPlan, String> {
    expect(op, o, &[F, F, F], &[F, F, F])?;
    let d = o.ins[1].numel();
    let n = o.ins[0].numel();
    if d == 0 || !n.is_multiple_of(d) || o.ins[2].numel() != d || o.outs[0].numel() != n {
        return Err(format!(
            "layer_norm: x {} with gamma {}",
            o.ins[0], o.ins[1]
        ));
    }
    let rows = n / d;
    if o.outs[1].numel() != rows || o.outs[2].numel() != rows {
        return Err(format!(
            "layer_norm: mean {} / rstd {} must hold {rows} rows",
            o.outs[1], o.outs[2]
        ));
    }
    let args = vec![
        KArg::In(0),
        KArg::In(1),
        KArg::In(2),
        Out(0),
        Out(1),
        Out(2),
        n64(rows),
        I32(i32_of(d, "layer_norm width")?),
        F32(eps as f32),
    ];
    Ok(plan_of(vec![ln_fwd_call(rows, d, args)], vec![]))
}

/// The most CTAs of `layer_norm_bwd_v4` (two an SM of the H200): each writes a partial
/// of dgamma and dbeta, and colsum_final adds them.
const LN_BWD_CTAS: u32 = 264;

/// Whether a layer-norm width takes the `_v4` kernels: a lane group of pow2 >= d/4 lanes
/// a row, two rows a group.
fn ln_v4(d: usize) -> bool {
    d.is_multiple_of(4) && d <= 128
}

/// log2 of the lanes a row of the `_v4` kernels, and the CTAs that cover `rows` once
/// (8 warps a CTA, 32/lanes rows a warp, two rows a lane group).
fn ln_v4_geometry(rows: usize, d: usize) -> (i32, u32) {
    let lanes = (d / 4).next_power_of_two();
    (
        lanes.trailing_zeros() as i32,
        blocks(rows, 8 * 2 * (32 / lanes)),
    )
}

/// The layer-norm forward: the `_v4` kernel where the width allows (its lanes_log2
/// appended to `args`), else a warp a row.
fn ln_fwd_call(rows: usize, d: usize, mut args: Vec<KArg>) -> KernelCall {
    if !ln_v4(d) {
        return warp_rows("layer_norm_fwd", rows, args);
    }
    let (lanes_log2, ctas) = ln_v4_geometry(rows, d);
    args.push(I32(lanes_log2));
    kc(
        "layer_norm_fwd_v4",
        [ctas.min(MAX_BLOCKS), 1, 1],
        [256, 1, 1],
        0,
        args,
    )
}

/// LayerNormGrad with dx's bf16 copy and column sums (outputs 3 and 4: dx is a copied
/// linear layer's dy): for d ≤ 1536 outside the `_v4` form, from dx's own pass
/// (`layer_norm_bwd_dx_bf16`'s partials, then colsum_final), else a cast and a column
/// sum after the plain plan.
fn layer_norm_grad_copy(op: &Op, o: &Operands) -> Result<CudaPlan, String> {
    expect(op, o, &[F, F, F, F, F], &[F, F, F, DType::Bf16, F])?;
    let d = o.ins[2].numel();
    let n = o.ins[1].numel();
    if o.outs[3] != o.outs[0] || o.outs[4].numel() != d {
        return Err(format!(
            "layer_norm_grad: dx's copy {} and sums {} do not match dx {}",
            o.outs[3], o.outs[4], o.outs[0]
        ));
    }
    let plain = Operands {
        outs: &o.outs[..3],
        out_dtypes: &o.out_dtypes[..3],
        ..*o
    };
    let mut plan = layer_norm_grad(op, &plain)?;
    let rows = n / d;
    if ln_v4(d) || d > 1536 {
        plan.calls.push(cast_f32_bf16_call(Out(0), Out(3), n));
        append_column_sums(&mut plan.calls, &mut plan.scratch, Out(0), rows, d, Out(4));
        return Ok(plan);
    }
    // the plain plan's first launch is layer_norm_bwd_dx: this one takes its place
    let first = plan
        .calls
        .first()
        .filter(|c| c.kernel == "layer_norm_bwd_dx")
        .ok_or("layer_norm_grad: expected layer_norm_bwd_dx first")?
        .clone();
    let ctas = first.grid[0] as usize;
    let part = plan.scratch.len();
    plan.scratch.push(ctas * d * 4);
    let mut args = first.args[..6].to_vec();
    args.extend([Out(3), Scratch(part)]);
    args.extend_from_slice(&first.args[6..]);
    plan.calls[0] = kc(
        "layer_norm_bwd_dx_bf16",
        first.grid,
        first.block,
        (8 * d * 4) as u32,
        args,
    );
    plan.calls
        .insert(1, colsum_final_call(Scratch(part), Out(4), ctas, d));
    Ok(plan)
}

fn layer_norm_grad(op: &Op, o: &Operands) -> Result<CudaPlan, String> {
    if o.outs.len() == 5 {
        return layer_norm_grad_copy(op, o);
    }
    expect(op, o, &[F, F, F, F, F], &[F, F, F])?;
    let d = o.ins[2].numel();
    let n = o.ins[1].numel();
    if d == 0 || !n.is_multiple_of(d) || o.ins[0].numel() != n || o.outs[0].numel() != n {
        return Err(format!(
            "layer_norm_grad: x {} with gamma {}",
            o.ins[1], o.ins[2]
        ));
    }
    let rows = n / d;
    if o.ins[3].numel() != rows
        || o.ins[4].numel() != rows
        || o.outs[1].numel() != d
        || o.outs[2].numel() != d
    {
        return Err(format!(
            "layer_norm_grad: statistics or parameter gradients do not fit {} rows of {d}",
            rows
        ));
    }
    let di = i32_of(d, "layer_norm width")?;
    // dy, x, gamma, mean, rstd, then dx
    let ins_dx = [
        KArg::In(0),
        KArg::In(1),
        KArg::In(2),
        KArg::In(3),
        KArg::In(4),
        Out(0),
    ];
    let (rows_arg, inv_d) = (n64(rows), F32((1.0 / d as f64) as f32));
    if ln_v4(d) {
        // dx, dgamma and dbeta from one pass over dy and x: a partial of dgamma and dbeta
        // a CTA (at most two CTAs an SM, so that the second pass adds few), summed in CTA
        // order by colsum_final
        let (lanes_log2, ctas) = ln_v4_geometry(rows, d);
        let ctas = ctas.clamp(1, LN_BWD_CTAS);
        let (mut calls, mut scratch) = (Vec::new(), Vec::new());
        let parts = if ctas == 1 {
            [Out(1), Out(2)]
        } else {
            scratch.extend([ctas as usize * d * 4; 2]);
            [Scratch(0), Scratch(1)]
        };
        calls.push(kc(
            "layer_norm_bwd_v4",
            [ctas, 1, 1],
            [256, 1, 1],
            0,
            [
                &ins_dx[..],
                &[
                    parts[0],
                    parts[1],
                    rows_arg,
                    I32(di),
                    inv_d,
                    I32(lanes_log2),
                ],
            ]
            .concat(),
        ));
        if ctas > 1 {
            calls.push(colsum_final_call(parts[0], Out(1), ctas as usize, d));
            calls.push(colsum_final_call(parts[1], Out(2), ctas as usize, d));
        }
        return Ok(plan_of(calls, scratch));
    }
    let mut calls = vec![warp_rows(
        "layer_norm_bwd_dx",
        rows,
        [&ins_dx[..], &[rows_arg, I32(di), inv_d]].concat(),
    )];
    let mut scratch = Vec::new();
    column_reduce(
        &mut calls,
        &mut scratch,
        rows,
        d,
        &[Out(1), Out(2)],
        |s, per, t| {
            kc(
                "layer_norm_bwd_dgb_partial",
                [blocks(d, 32), s, 1],
                [32, 8, 1],
                0,
                vec![
                    KArg::In(0),
                    KArg::In(1),
                    KArg::In(3),
                    KArg::In(4),
                    t[0],
                    t[1],
                    n64(rows),
                    I32(di),
                    n64(per),
                ],
            )
        },
    );
    Ok(plan_of(calls, scratch))
}

fn sum_to_shape(op: &Op, o: &Operands) -> Result<CudaPlan, String> {
    expect(op, o, &[F], &[F])?;
    let n = o.outs[0].numel();
    let total = o.ins[0].numel();
    if n == 0 {
        return Ok(plan_of(vec![], vec![]));
    }
    if !total.is_multiple_of(n) {
        return Err(format!(
            "sum_to_shape: {} does not reduce to {}",
            o.ins[0], o.outs[0]
        ));
    }
    let rows = total / n;
    let mut calls = Vec::new();
    let mut scratch = Vec::new();
    append_column_sums(&mut calls, &mut scratch, KArg::In(0), rows, n, Out(0));
    Ok(plan_of(calls, scratch))
}

// ---- interaction -------------------------------------------------------------------------------

fn pairwise_dot(op: &Op, o: &Operands, grad: bool) -> Result<CudaPlan, String> {
    if grad {
        expect(op, o, &[F, F], &[F])?;
    } else {
        expect(op, o, &[F], &[F])?;
    }
    let e = o.ins[usize::from(grad)];
    let [b, f, d] = e.dims() else {
        return Err(format!("{}: e {e} must be [B, F, D]", op.name()));
    };
    let (b, f, d) = (*b, *f, *d);
    let pairs = f * f.saturating_sub(1) / 2;
    let out_n = if grad { b * f * d } else { b * pairs };
    if o.outs[0].numel() != out_n || (grad && o.ins[0].numel() != b * pairs) {
        return Err(format!("{}: shapes do not fit e {e}", op.name()));
    }
    if out_n == 0 {
        return Ok(plan_of(vec![], vec![]));
    }
    let ld = d | 1;
    // the gradient's G [F][F rounded up to 4] after e, at a 16-byte aligned offset
    let smem = if grad {
        ((f * ld).next_multiple_of(4) + f * f.next_multiple_of(4)) * 4
    } else {
        f * ld * 4
    };
    let fits = smem <= SMEM_DEFAULT;
    let kernel = match (grad, fits) {
        (false, true) => "pairwise_dot_fwd",
        (false, false) => "pairwise_dot_fwd_gmem",
        (true, true) => "pairwise_dot_bwd",
        (true, false) => "pairwise_dot_bwd_gmem",
    };
    let mut args = if grad {
        vec![KArg::In(0), KArg::In(1)]
    } else {
        vec![KArg::In(0)]
    };
    args.extend([
        Out(0),
        n64(b),
        I32(i32_of(f, "fields")?),
        I32(i32_of(d, "dim")?),
    ]);
    // the shared-memory kernels: a thread a pair (fwd) or a column of PD_ROWS rows of de
    // (bwd), and as many CTAs as the SMs hold at once (2048 threads an SM), each walking
    // several examples with the next one's loads in flight; the gmem forms, a CTA an example
    let (grid, threads) = if fits {
        let work = if grad { f.div_ceil(PD_ROWS) * d } else { pairs };
        let threads = work.next_multiple_of(32).clamp(64, 1024);
        (b.min(SMS * (2048 / threads)), threads)
    } else {
        (b.min(1 << 20), if grad { 256 } else { 128 })
    };
    let (grid, threads) = (grid as u32, threads as u32);
    Ok(plan_of(
        vec![kc(
            kernel,
            [grid, 1, 1],
            [threads, 1, 1],
            if fits { smem as u32 } else { 0 },
            args,
        )],
        vec![],
    ))
}

// ---- losses and full reductions ---------------------------------------------------------------

/// CTAs of a two-pass f64 reduction over `n` values: ~8 values a thread, at most 2048.
fn loss_blocks(n: usize) -> usize {
    n.div_ceil(256 * 8).clamp(1, 2048)
}

/// `loss_partial` (mode 0 sum of x, 1 BCE terms) then `loss_final`.
fn reduce_to_scalar(x: KArg, y: KArg, n: usize, mode: i32, mean: bool) -> CudaPlan {
    let g = loss_blocks(n);
    plan_of(
        vec![
            kc(
                "loss_partial",
                [g as u32, 1, 1],
                [256, 1, 1],
                0,
                vec![x, y, n64(n), I32(mode), Scratch(0)],
            ),
            kc(
                "loss_final",
                [1, 1, 1],
                [256, 1, 1],
                0,
                vec![
                    Scratch(0),
                    I32(g as i32),
                    Out(0),
                    I32(i32::from(mean)),
                    n64(n),
                ],
            ),
        ],
        vec![8 * g],
    )
}

fn scalar_out(op: &Op, o: &Operands) -> Result<(), String> {
    if o.outs[0].numel() != 1 {
        return Err(format!(
            "{}: the output {} must be a scalar",
            op.name(),
            o.outs[0]
        ));
    }
    Ok(())
}

fn full_sum(op: &Op, o: &Operands, mean: bool) -> Result<CudaPlan, String> {
    expect(op, o, &[F], &[F])?;
    scalar_out(op, o)?;
    Ok(reduce_to_scalar(
        KArg::In(0),
        KArg::In(0),
        o.ins[0].numel(),
        0,
        mean,
    ))
}

fn bce(op: &Op, o: &Operands) -> Result<CudaPlan, String> {
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

fn softmax_xent(op: &Op, o: &Operands) -> Result<CudaPlan, String> {
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

fn softmax_xent_grad(op: &Op, o: &Operands) -> Result<CudaPlan, String> {
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

// ---- optimizers ----------------------------------------------------------------------------------

/// The table of (param, grad, m, v, numel, first chunk) records in scratch 0, built by
/// `optim_table_build` launches of 32 records each; returns the calls and the total
/// number of chunks.
fn optim_table(tensors: &[[KArg; 4]], numels: &[usize]) -> (Vec<KernelCall>, usize) {
    let mut calls = Vec::new();
    let mut starts = Vec::with_capacity(numels.len());
    let mut total = 0;
    for &n in numels {
        starts.push(total);
        total += n.div_ceil(OPT_CHUNK);
    }
    for first in (0..tensors.len()).step_by(BUILD_SLOTS) {
        let count = BUILD_SLOTS.min(tensors.len() - first);
        let mut args = vec![Scratch(0), I32(first as i32), I32(count as i32)];
        for k in 0..BUILD_SLOTS {
            // unused slots repeat the first record (never written: k >= count)
            let i = if k < count { first + k } else { first };
            args.extend(tensors[i]);
            args.push(n64(numels[i]));
            args.push(n64(starts[i]));
        }
        calls.push(kc("optim_table_build", [1, 1, 1], [32, 1, 1], 0, args));
    }
    (calls, total)
}

fn check_pairs(op: &Op, o: &Operands, grads: &[&Shape], n: usize) -> Result<(), String> {
    if o.upd.len() != n * if matches!(op, Op::Adam { .. }) { 3 } else { 1 } {
        return Err(format!(
            "{}: {} updated tensors for {n} gradients",
            op.name(),
            o.upd.len()
        ));
    }
    for (i, g) in grads.iter().enumerate() {
        let same = o
            .upd
            .iter()
            .skip(i)
            .step_by(n.max(1))
            .all(|u| u.numel() == g.numel());
        if !same {
            return Err(format!(
                "{}: gradient {i} {g} does not match its parameter/state",
                op.name()
            ));
        }
    }
    Ok(())
}

fn sgd(op: &Op, o: &Operands, lr: f64) -> Result<CudaPlan, String> {
    let n = o.ins.len();
    expect(op, o, &vec![F; n], &[])?;
    check_pairs(op, o, o.ins, n)?;
    let numels: Vec<usize> = o.ins.iter().map(|s| s.numel()).collect();
    let recs: Vec<[KArg; 4]> = (0..n)
        .map(|i| [Upd(i), KArg::In(i), Upd(i), Upd(i)])
        .collect();
    let (mut calls, chunks) = optim_table(&recs, &numels);
    if chunks == 0 {
        return Ok(plan_of(vec![], vec![]));
    }
    calls.push(kc(
        "sgd_multi_tensor",
        [chunks as u32, 1, 1],
        [256, 1, 1],
        0,
        vec![
            Scratch(0),
            I32(i32_of(n, "tensors")?),
            n64(chunks),
            F32(lr as f32),
        ],
    ));
    Ok(plan_of(calls, vec![OPT_REC_BYTES * n]))
}

fn adam(
    op: &Op,
    o: &Operands,
    lr: f64,
    beta1: f64,
    beta2: f64,
    eps: f64,
) -> Result<CudaPlan, String> {
    let n = o.ins.len().saturating_sub(1);
    let mut want = vec![I];
    want.extend(vec![F; n]);
    expect(op, o, &want, &[])?;
    if o.ins[0].numel() != 1 {
        return Err(format!("adam: the step {} must be one i32", o.ins[0]));
    }
    check_pairs(op, o, &o.ins[1..], n)?;
    let numels: Vec<usize> = o.ins[1..].iter().map(|s| s.numel()).collect();
    let recs: Vec<[KArg; 4]> = (0..n)
        .map(|i| [Upd(i), KArg::In(1 + i), Upd(n + i), Upd(2 * n + i)])
        .collect();
    let (mut calls, chunks) = optim_table(&recs, &numels);
    if chunks == 0 {
        return Ok(plan_of(vec![], vec![]));
    }
    calls.push(kc(
        "adam_multi_tensor",
        [chunks as u32, 1, 1],
        [256, 1, 1],
        0,
        vec![
            Scratch(0),
            I32(i32_of(n, "tensors")?),
            n64(chunks),
            KArg::In(0),
            I64(lr.to_bits() as i64),
            I64(beta1.to_bits() as i64),
            I64(beta2.to_bits() as i64),
            F32(eps as f32),
        ],
    ));
    Ok(plan_of(calls, vec![OPT_REC_BYTES * n]))
}

// ---- embedding bags --------------------------------------------------------------------------------

/// Field geometry: the `emb_meta_build` calls writing (base, rows) per field into
/// `Scratch(0)` (16 bytes a field), and the total rows.
fn emb_meta(op: &Op, field_rows: &[usize]) -> Result<(Vec<KernelCall>, usize), String> {
    if field_rows.is_empty() {
        return Err(format!("{}: no fields", op.name()));
    }
    let total: usize = field_rows.iter().sum();
    if total >= i32::MAX as usize {
        return Err(format!(
            "{}: {total} table rows do not fit the kernels' i32 row keys",
            op.name()
        ));
    }
    let mut calls = Vec::new();
    for first in (0..field_rows.len()).step_by(BUILD_SLOTS) {
        let count = BUILD_SLOTS.min(field_rows.len() - first);
        let mut args = vec![Scratch(0), I32(first as i32), I32(count as i32)];
        args.extend(emb_field_args(field_rows, first));
        calls.push(kc("emb_meta_build", [1, 1, 1], [32, 1, 1], 0, args));
    }
    Ok((calls, total))
}

/// The (base row, rows) pairs of fields `first ..` (at most BUILD_SLOTS; the slots past
/// the last field repeat field `first`), as the kernels with field arguments take them.
fn emb_field_args(field_rows: &[usize], first: usize) -> Vec<KArg> {
    let base = |i: usize| field_rows[..i].iter().sum::<usize>();
    let count = BUILD_SLOTS.min(field_rows.len() - first);
    (0..BUILD_SLOTS)
        .flat_map(|k| {
            let i = if k < count { first + k } else { first };
            [n64(base(i)), n64(field_rows[i])]
        })
        .collect()
}

/// Ids and offsets must be i32 vectors; returns (ids, offsets) counts.
fn emb_ids(op: &Op, ids: &Shape, offsets: &Shape) -> Result<(usize, usize), String> {
    let n_ids = ids.numel();
    if n_ids >= i32::MAX as usize {
        return Err(format!("{}: {n_ids} ids do not fit i32 offsets", op.name()));
    }
    Ok((n_ids, offsets.numel()))
}

/// The width D of a stacked table `[Σ rows, D]`, checking its rows against the fields'.
fn emb_table_width(op: &Op, what: &str, table: &Shape, total: usize) -> Result<usize, String> {
    match table.dims() {
        [rows, d] if *rows == total => Ok(*d),
        [_, _] => Err(format!(
            "{}: {what} {table} must have Σ rows = {total}",
            op.name()
        )),
        _ => Err(format!("{}: {what} {table} must be [rows, D]", op.name())),
    }
}

/// `emb_bag_mean`: a warp per bag counts its ids and scales its row (see the kernel).
fn bag_mean(op: &Op, o: &Operands, mean: &[bool]) -> Result<CudaPlan, String> {
    expect(op, o, &[F, I, I], &[F])?;
    let dims = o.ins[0].dims();
    let (n_ids, n_off) = emb_ids(op, o.ins[1], o.ins[2])?;
    let d = dims.last().copied().unwrap_or(0);
    let n_bags = o.outs[0].numel() / d.max(1);
    if d == 0 || n_bags == 0 {
        return Ok(plan_of(vec![], vec![]));
    }
    if mean.len() > 64 {
        return Err(format!(
            "{}: at most 64 fields (the mask of mean fields is one 64-bit argument), got {}",
            op.name(),
            mean.len()
        ));
    }
    let mask = mean
        .iter()
        .enumerate()
        .fold(0u64, |m, (f, &on)| if on { m | 1 << f } else { m });
    let args = vec![
        KArg::In(0),
        KArg::In(1),
        KArg::In(2),
        Out(0),
        n64(n_ids),
        n64(n_off),
        n64(n_bags),
        I32(i32_of(mean.len(), "fields")?),
        I32(i32_of(d, "embedding dim")?),
        I64(mask as i64),
    ];
    Ok(plan_of(
        vec![warp_rows("emb_bag_mean", n_bags, args)],
        vec![],
    ))
}

fn embedding_bag(op: &Op, o: &Operands, field_rows: &[usize]) -> Result<CudaPlan, String> {
    expect(op, o, &[F, I, I], &[F])?;
    let (mut calls, total) = emb_meta(op, field_rows)?;
    let d = emb_table_width(op, "table", o.ins[0], total)?;
    let (n_ids, n_off) = emb_ids(op, o.ins[1], o.ins[2])?;
    let out_n = o.outs[0].numel();
    if d == 0 || out_n == 0 {
        return Ok(plan_of(vec![], vec![]));
    }
    let n_bags = out_n / d;
    // the sizes every lookup kernel takes after its pointers
    let sizes = [
        n64(n_ids),
        n64(n_off),
        n64(n_bags),
        I32(field_rows.len() as i32),
        I32(i32_of(d, "embedding dim")?),
        n64(total),
    ];
    // D % 4 == 0: a group of `lanes` lanes (a power of two <= 32) per bag, float4 columns
    let lanes = (d / 4).next_power_of_two().min(32);
    if d % 4 == 0 && field_rows.len() <= BUILD_SLOTS {
        // one launch: the fields' (base, rows) as arguments, EMB_FWD_BAGS bags a group
        let mut args = vec![KArg::In(0), KArg::In(1), KArg::In(2), Out(0)];
        args.extend(sizes);
        args.push(I32(lanes.trailing_zeros() as i32));
        args.extend(emb_field_args(field_rows, 0));
        let per_cta = EMB_FWD_BAGS * 256 / lanes;
        return Ok(plan_of(
            vec![kc(
                "embedding_bag_fwd_fields",
                [
                    blocks(n_bags, per_cta).min((SMS * EMB_FWD_CTAS) as u32),
                    1,
                    1,
                ],
                [256, 1, 1],
                0,
                args,
            )],
            vec![],
        ));
    }
    let mut args = vec![KArg::In(0), KArg::In(1), KArg::In(2), Scratch(0), Out(0)];
    args.extend(sizes);
    if d % 4 == 0 {
        args.push(I32(lanes.trailing_zeros() as i32));
        let per_cta = 256 / lanes;
        calls.push(kc(
            "embedding_bag_fwd_v4",
            [blocks(n_bags, per_cta).min(MAX_BLOCKS), 1, 1],
            [256, 1, 1],
            0,
            args,
        ));
    } else {
        calls.push(warp_rows("embedding_bag_fwd", n_bags, args));
    }
    Ok(plan_of(calls, vec![16 * field_rows.len()]))
}

/// Where the segment sums of the backward go.
enum SegDst {
    /// `dtable[row]`: the dense gradient (output 0).
    Dense,
    /// `G[run start]` in the given scratch buffer, for Adagrad.
    ByPosition(usize),
}

/// The occurrences sorted by row: their keys (`emb_sort_keys`: global row, or `total` for
/// an id outside its table, and the bag), then LSD radix passes of 8 bits over the bits
/// the keys use (the sentinel is the largest key), stable, ping-ponging between scratch
/// pairs. `calls` must hold emb_meta's launches, which write the meta into scratch 0:
/// this adds that buffer as the first of the plan's scratch. The last pass writes into
/// `dst` (rows, bags) when given, else into scratch. Returns where the sorted rows and
/// bags are.
#[allow(clippy::too_many_arguments)]
fn emb_sort(
    calls: &mut Vec<KernelCall>,
    scratch: &mut Vec<usize>,
    field_rows: &[usize],
    total: usize,
    (ids, offsets): (KArg, KArg),
    n: usize,
    n_bags: usize,
    dst: Option<(KArg, KArg)>,
) -> Result<(KArg, KArg), String> {
    let sentinel = total as i32;
    let tiles = n.div_ceil(EMB_TILE).max(1);
    let nb = i32_of(n_bags, "bags")?;
    debug_assert!(scratch.is_empty(), "the meta is scratch 0");
    scratch.push(16 * field_rows.len());
    let first = scratch.len();
    scratch.extend([
        4 * n,           // keys a
        4 * n,           // values a
        4 * n,           // keys b
        4 * n,           // values b
        4 * 256 * tiles, // histogram
    ]);
    let hist = Scratch(first + 4);
    calls.push(ew(
        "emb_sort_keys",
        n,
        vec![
            ids,
            offsets,
            Scratch(0),
            Scratch(first),
            Scratch(first + 1),
            I32(n as i32),
            I32(nb),
            I32(field_rows.len() as i32),
            I32(sentinel),
        ],
    ));
    // LSD passes of 8 bits over the bits the keys use (the sentinel is the largest key);
    // at least one, so that `dst` is always written
    let bits = 32 - (sentinel as u32).leading_zeros();
    let passes = bits.div_ceil(8).max(1);
    let (mut k_in, mut v_in) = (Scratch(first), Scratch(first + 1));
    let (mut k_out, mut v_out) = (Scratch(first + 2), Scratch(first + 3));
    for p in 0..passes {
        if p + 1 == passes {
            if let Some((rows, bags)) = dst {
                (k_out, v_out) = (rows, bags);
            }
        }
        let shift = I32(8 * p as i32);
        calls.push(kc(
            "emb_radix_hist",
            [tiles as u32, 1, 1],
            [256, 1, 1],
            0,
            vec![k_in, I32(n as i32), shift, hist],
        ));
        calls.push(kc(
            "emb_radix_scan",
            [1, 1, 1],
            [1024, 1, 1],
            0,
            vec![hist, n64(256 * tiles)],
        ));
        calls.push(kc(
            "emb_radix_scatter",
            [tiles as u32, 1, 1],
            [256, 1, 1],
            0,
            vec![k_in, v_in, k_out, v_out, I32(n as i32), shift, hist],
        ));
        std::mem::swap(&mut k_in, &mut k_out);
        std::mem::swap(&mut v_in, &mut v_out);
    }
    Ok((k_in, v_in))
}

/// The chunked segment sums of `dy` over the sorted occurrences (`rows`, `bags`), into
/// `dst`; their partials in two scratch buffers appended to `scratch`.
#[allow(clippy::too_many_arguments)]
fn emb_segments(
    calls: &mut Vec<KernelCall>,
    scratch: &mut Vec<usize>,
    total: usize,
    (rows, bags, dy): (KArg, KArg, KArg),
    n: usize,
    n_bags: usize,
    d: usize,
    dst: SegDst,
) -> Result<(), String> {
    let sentinel = total as i32;
    let chunks = n.div_ceil(EMB_CHUNK).max(1);
    let col_tiles = d.div_ceil(32);
    let di = i32_of(d, "embedding dim")?;
    let nb = i32_of(n_bags, "bags")?;
    let first = scratch.len();
    scratch.extend([
        4 * chunks * d, // part_first
        4 * chunks * d, // part_last
    ]);
    let (dst_arg, by_row) = match dst {
        SegDst::Dense => (Out(0), 1),
        SegDst::ByPosition(s) => (Scratch(s), 0),
    };
    let warps = chunks * col_tiles;
    calls.push(warp_rows(
        "emb_seg_chunks",
        warps,
        vec![
            rows,
            bags,
            dy,
            I32(n as i32),
            I32(di),
            I32(nb),
            I32(sentinel),
            Scratch(first),
            Scratch(first + 1),
            dst_arg,
            I32(by_row),
        ],
    ));
    calls.push(warp_rows(
        "emb_seg_tails",
        warps,
        vec![
            rows,
            I32(n as i32),
            I32(di),
            I32(sentinel),
            Scratch(first),
            Scratch(first + 1),
            dst_arg,
            I32(by_row),
        ],
    ));
    Ok(())
}

/// `EmbeddingSort`: meta, keys and the radix passes, the last into the two outputs.
fn embedding_sort(op: &Op, o: &Operands, field_rows: &[usize]) -> Result<CudaPlan, String> {
    expect(op, o, &[I, I], &[I, I])?;
    let (mut calls, total) = emb_meta(op, field_rows)?;
    let (n_ids, n_off) = emb_ids(op, o.ins[0], o.ins[1])?;
    if o.outs.iter().any(|s| s.numel() != n_ids) {
        return Err(format!(
            "embedding_sort: outputs {} and {} for {n_ids} ids",
            o.outs[0], o.outs[1]
        ));
    }
    if n_ids == 0 {
        return Ok(plan_of(vec![], vec![]));
    }
    let mut scratch = Vec::new();
    emb_sort(
        &mut calls,
        &mut scratch,
        field_rows,
        total,
        (KArg::In(0), KArg::In(1)),
        n_ids,
        n_off.saturating_sub(1),
        Some((Out(0), Out(1))),
    )?;
    Ok(plan_of(calls, scratch))
}

fn embedding_bag_grad_dense(
    op: &Op,
    o: &Operands,
    field_rows: &[usize],
) -> Result<CudaPlan, String> {
    expect(op, o, &[F, I, I], &[F])?;
    let (mut calls, total) = emb_meta(op, field_rows)?;
    let d = emb_table_width(op, "dtable", o.outs[0], total)?;
    let (n_ids, n_off) = emb_ids(op, o.ins[1], o.ins[2])?;
    let zero = ew(
        "ew_fill_u32",
        total * d,
        vec![Out(0), n64(total * d), KArg::U32(0)],
    );
    if n_ids == 0 || d == 0 {
        return Ok(plan_of(vec![zero], vec![]));
    }
    let n_bags = (o.ins[0].numel() / d).min(n_off.saturating_sub(1));
    let mut scratch = Vec::new();
    calls.push(zero);
    let (rows, bags) = emb_sort(
        &mut calls,
        &mut scratch,
        field_rows,
        total,
        (KArg::In(1), KArg::In(2)),
        n_ids,
        n_bags,
        None,
    )?;
    emb_segments(
        &mut calls,
        &mut scratch,
        total,
        (rows, bags, KArg::In(0)),
        n_ids,
        n_bags,
        d,
        SegDst::Dense,
    )?;
    Ok(plan_of(calls, scratch))
}

/// Row-wise Adagrad: the occurrences sorted by row (here, or by an `EmbeddingSort` whose
/// outputs are inputs 3 and 4), each row's gradient summed over them in that order into
/// G at the run's first position, then `emb_adagrad_apply` a warp per run.
fn rowwise_adagrad(
    op: &Op,
    o: &Operands,
    lr: f64,
    eps: f64,
    field_rows: &[usize],
) -> Result<CudaPlan, String> {
    let presorted = o.ins.len() == 5;
    if presorted {
        expect(op, o, &[I, I, F, I, I], &[])?;
    } else {
        expect(op, o, &[I, I, F], &[])?;
    }
    let (meta_calls, total) = emb_meta(op, field_rows)?;
    let d = o.ins[2].last();
    if o.upd.len() != 2 || o.upd[0].dims() != [total, d] || o.upd[1].numel() != total {
        return Err(format!(
            "rowwise_adagrad: table and accumulator must be [{total}, {d}] and [{total}] for dpooled {}",
            o.ins[2]
        ));
    }
    let (n_ids, n_off) = emb_ids(op, o.ins[0], o.ins[1])?;
    if presorted && (o.ins[3].numel() != n_ids || o.ins[4].numel() != n_ids) {
        return Err(format!(
            "rowwise_adagrad: sorted rows {} and bags {} for {n_ids} ids",
            o.ins[3], o.ins[4]
        ));
    }
    if n_ids == 0 || d == 0 {
        return Ok(plan_of(vec![], vec![]));
    }
    let n_bags = (o.ins[2].numel() / d).min(n_off.saturating_sub(1));
    let mut calls = Vec::new();
    let mut scratch = Vec::new();
    let (rows, bags) = if presorted {
        (KArg::In(3), KArg::In(4))
    } else {
        calls = meta_calls;
        emb_sort(
            &mut calls,
            &mut scratch,
            field_rows,
            total,
            (KArg::In(0), KArg::In(1)),
            n_ids,
            n_bags,
            None,
        )?
    };
    let g = scratch.len();
    scratch.push(4 * n_ids * d);
    emb_segments(
        &mut calls,
        &mut scratch,
        total,
        (rows, bags, KArg::In(2)),
        n_ids,
        n_bags,
        d,
        SegDst::ByPosition(g),
    )?;
    calls.push(warp_rows(
        "emb_adagrad_apply",
        n_ids,
        vec![
            rows,
            Scratch(g),
            I32(n_ids as i32),
            I32(i32_of(d, "embedding dim")?),
            I32(total as i32),
            Upd(0),
            Upd(1),
            F32(lr as f32),
            F32(eps as f32),
            F32((1.0 / d as f64) as f32),
        ],
    ));
    Ok(plan_of(calls, scratch))
}
