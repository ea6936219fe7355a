//! Moving data between tensors: `Concat`, `Slice`, `Split`, `Pad`.
//!
//! Everything of the family in one place: the CPU reference (`cpu`, what every CUDA
//! kernel is tested against), the CUDA launch plans (`cuda`) and the cost estimate the
//! scheduler reads (`cost`).

// ---- the CPU reference ----
pub mod cpu {
    //! The CPU reference of the shape ops: concat, slice, split and pad.

    use crate::cpu::*;

    /// The shape ops' storage forms: a concat with its bf16 copy beside it, the one a GEMM
    /// reads (`Graph::copy_output`), or of f32 parts stored in bf16 alone
    /// (`Graph::concat_stored`). `None` for the plain forms.
    pub(crate) fn exec_stored(
        call: &NodeCall,
        ins: &[&Buffer],
        outs: &mut [Buffer],
        upd: &mut [Buffer],
    ) -> Option<Result<(), OpError>> {
        if !matches!(call.op, Op::Concat { .. }) {
            return None;
        }
        if copy_last(outs, 2) {
            return Some(with_copy(call, ins, outs, upd, 1));
        }
        let stored = outs.len() == 1
            && outs[0].dtype() == DType::Bf16
            && ins.iter().all(|b| b.dtype() == DType::F32);
        stored.then(|| rounded(call, ins, outs, upd))
    }

    /// Concat, slice, split and pad.
    pub(crate) fn exec_shape<T: Elem>(
        call: &NodeCall,
        ins: &[&Buffer],
        outs: &mut [Buffer],
        _upd: &mut [Buffer],
    ) -> Result<(), String> {
        let ish = |i: usize| call.in_shapes[i];
        let osh = |i: usize| call.out_shapes[i];
        match call.op {
            Op::Concat { axis } => {
                let total = osh(0).dims()[*axis];
                let v = AxisView::new(osh(0).dims(), *axis);
                let o = out::<T>(&mut outs[0])?;
                let mut start = 0;
                for (i, b) in ins.iter().enumerate() {
                    let len = ish(i).dims()[*axis];
                    kernels::place(get::<T>(b, "input")?, o, v, start, len, total);
                    start += len;
                }
            }
            Op::Slice { axis, start, len } => {
                let total = ish(0).dims()[*axis];
                let v = AxisView::new(ish(0).dims(), *axis);
                kernels::take(
                    get::<T>(ins[0], "x")?,
                    out(&mut outs[0])?,
                    v,
                    *start,
                    *len,
                    total,
                );
            }
            Op::Split { axis, sizes } => {
                let total = ish(0).dims()[*axis];
                let v = AxisView::new(ish(0).dims(), *axis);
                let x = get::<T>(ins[0], "x")?;
                if outs.len() != sizes.len() || sizes.iter().sum::<usize>() != total {
                    return Err(format!(
                        "split: {} parts of {sizes:?} from an axis of {total}",
                        outs.len()
                    ));
                }
                let mut start = 0;
                for (o, &len) in outs.iter_mut().zip(sizes) {
                    kernels::take(x, out(o)?, v, start, len, total);
                    start += len;
                }
            }
            Op::Pad { axis, start, full } => {
                let len = ish(0).dims()[*axis];
                let v = AxisView::new(osh(0).dims(), *axis);
                let o = out::<T>(&mut outs[0])?;
                o.iter_mut().for_each(|x| *x = T::ZERO);
                kernels::place(get::<T>(ins[0], "dy")?, o, v, *start, len, *full);
            }
            other => return Err(format!("shape: no CPU implementation of {}", other.name())),
        }
        Ok(())
    }
}

// ---- the CUDA launch plans ----
pub(crate) mod cuda {
    //! Shape ops (`kernels-cuda/elementwise.cu`'s row copies): concat, split, slice, pad, and
    //! the one-launch copies of several parts.

    use crate::cuda::common::*;
    use crate::cuda::elementwise::cast_f32_bf16_call;
    use crate::cuda::elementwise::copy_kernels;
    use crate::cuda::{CudaPlan, KArg, KernelCall, Operands};
    use erase_graph::{DType, Op, Shape};
    use KArg::{Out, I32};

    /// Kernels these plans launch.
    pub(crate) const KERNELS: &[&str] = &[
        "ew_parts_rows_f32_bf16",
        "ew_parts_rows_f32_to_bf16",
        "ew_parts_rows_u32",
        "ew_parts_rows_u16",
        "ew_parts_rows_u128",
    ];

    /// Elements before and after `axis` of `dims`.
    pub(crate) fn around(op: &Op, s: &Shape, axis: usize) -> Result<(usize, usize, usize), String> {
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
    pub(crate) fn concat(op: &Op, o: &Operands, axis: usize) -> Result<CudaPlan, String> {
        let d = *o.out_dtypes.first().ok_or("concat: no output")?;
        // f32 parts stored in bf16 alone (Graph::concat_stored): the copy kernel's pass
        // without its f32 stores
        let bf = DType::Bf16;
        if o.outs.len() == 1 && d == bf && o.in_dtypes.iter().all(|&t| t == F) {
            expect(op, o, &vec![F; o.ins.len()], &[bf])?;
            return parts_rows(op, F, o.outs[0], o.ins, axis, false, Some(Out(0)))
                .and_then(|p| bf16_alone(op, p));
        }
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

    /// A concat-with-copy plan (`ew_parts_rows_f32_bf16`, the copy its second argument)
    /// turned into the concat stored in bf16 alone (`ew_parts_rows_f32_to_bf16`, no f32
    /// tensor): the same calls without their first argument. Only where every part's row
    /// is a whole number of float4 units (the fused kernel's form).
    fn bf16_alone(op: &Op, mut p: CudaPlan) -> Result<CudaPlan, String> {
        if p.calls.iter().any(|c| c.kernel != "ew_parts_rows_f32_bf16") {
            return Err(format!(
                "{}: a concat stored in bf16 needs each part's rows to be a multiple of 4 floats",
                op.name()
            ));
        }
        for c in &mut p.calls {
            c.kernel = "ew_parts_rows_f32_to_bf16";
            c.args.remove(0);
        }
        Ok(p)
    }

    pub(crate) fn split(
        op: &Op,
        o: &Operands,
        axis: usize,
        sizes: &[usize],
    ) -> Result<CudaPlan, String> {
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

    pub(crate) fn slice(
        op: &Op,
        o: &Operands,
        axis: usize,
        start: usize,
        len: usize,
    ) -> Result<CudaPlan, String> {
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

    pub(crate) fn pad(
        op: &Op,
        o: &Operands,
        axis: usize,
        start: usize,
        full: usize,
    ) -> Result<CudaPlan, String> {
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
}

// ---- the cost estimate ----
pub(crate) mod cost {
    pub(crate) use crate::family::elementwise::cost::map;
}
