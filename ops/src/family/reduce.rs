//! Sums and their transposes: `SumToShape`, `Sum`, `Mean`, `Broadcast`, `GradSum`, `SliceSum`.
//!
//! Everything of the family in one place: the CPU reference (`cpu`, what every CUDA
//! kernel is tested against), the CUDA launch plans (`cuda`) and the cost estimate the
//! scheduler reads (`cost`).

// ---- the CPU reference ----
pub mod cpu {
    //! The CPU reference of the reduce ops: sums: to a shape, full, broadcasts, gradient and slice sums.

    use crate::cpu::*;

    /// Sums: to a shape, full, broadcasts, gradient and slice sums.
    pub(crate) fn exec_reduce<T: Elem>(
        call: &NodeCall,
        ins: &[&Buffer],
        outs: &mut [Buffer],
        _upd: &mut [Buffer],
    ) -> Result<(), String> {
        let ish = |i: usize| call.in_shapes[i];
        let osh = |i: usize| call.out_shapes[i];
        match call.op {
            Op::SumToShape => kernels::sum_to_shape(get::<T>(ins[0], "dy")?, out(&mut outs[0])?),
            Op::Sum | Op::Mean => {
                let x = get::<T>(ins[0], "x")?;
                let s: f64 = x.iter().map(|v| v.to_f64()).sum();
                let v = if matches!(call.op, Op::Mean) {
                    s / x.len() as f64
                } else {
                    s
                };
                out::<T>(&mut outs[0])?[0] = T::from_f64(v);
            }
            Op::Broadcast { scale } => {
                let v = scalar::<T>(ins[0])? * T::from_f64(*scale);
                out::<T>(&mut outs[0])?.iter_mut().for_each(|o| *o = v);
            }
            Op::GradSum => {
                let n = osh(0).numel();
                sum_rows(ins, out::<T>(&mut outs[0])?, n, n, 0)?;
            }
            Op::SliceSum { axis, start, len } => {
                if ins.is_empty() {
                    return Err("slice_sum: no inputs".into());
                }
                let dims = ish(0).dims();
                if *axis >= dims.len() || start + len > dims[*axis] {
                    return Err(format!(
                        "slice_sum: {start}+{len} of axis {axis} of {}",
                        ish(0)
                    ));
                }
                if let Some(i) = (1..ins.len()).find(|&i| ish(i) != ish(0)) {
                    return Err(format!(
                        "slice_sum: contribution {i} is {}, contribution 0 {}",
                        ish(i),
                        ish(0)
                    ));
                }
                let v = AxisView::new(dims, *axis);
                let (w, ld, off) = (len * v.inner, dims[*axis] * v.inner, start * v.inner);
                if osh(0).numel() != v.outer * w {
                    return Err(format!(
                        "slice_sum: {start}+{len} of axis {axis} of {} into {}",
                        ish(0),
                        osh(0)
                    ));
                }
                sum_rows(ins, out::<T>(&mut outs[0])?, w, ld, off)?;
            }
            other => return Err(format!("reduce: no CPU implementation of {}", other.name())),
        }
        Ok(())
    }
}

// ---- the CUDA launch plans ----
pub(crate) mod cuda {
    //! Reductions (`kernels-cuda/reduce.cu`, `loss.cu`'s scalar reductions): gradient sums,
    //! slice sums, sums to a broadcast shape, column sums, full sums and means, broadcasts.

    use crate::cuda::common::*;
    use crate::cuda::shape::around;
    use crate::cuda::{blocks, CudaPlan, KArg, KernelCall, Operands};
    use erase_graph::Op;
    use KArg::{Out, Scratch, F32, I32};

    /// Kernels these plans launch.
    pub(crate) const KERNELS: &[&str] = &[
        "ew_fill_scaled",
        "ew_slice_sum",
        "ew_slice_sum4",
        "sum_to_shape_partial",
        "colsum_final",
        "loss_partial",
        "loss_final",
    ];

    /// The sum of the inputs in input order: the slice_sum kernels over one row.
    pub(crate) fn grad_sum(op: &Op, o: &Operands) -> Result<CudaPlan, String> {
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

    /// The most inputs one slice_sum launch reads (the kernels' eight pointers).
    pub(crate) const SUM_MAX: usize = 8;

    /// The launches of `y[r·w + c] = Σ_j in_j[r·ld + off + c]` over `n` outputs, in input
    /// order: float4 lanes where every row, stride and offset allows; the first call takes
    /// inputs 0..8 ([`SUM_MAX`]), each next call the running sum (row w, offset 0) and 7
    /// more inputs.
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
            while ptrs.len() < SUM_MAX && next < k {
                ptrs.push(KArg::In(next));
                next += 1;
            }
            let used = ptrs.len() as i32;
            while ptrs.len() < SUM_MAX {
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
    pub(crate) fn slice_sum(
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
    pub(crate) fn column_reduce(
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

    pub(crate) fn sum_to_shape(op: &Op, o: &Operands) -> Result<CudaPlan, String> {
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

    /// CTAs of a two-pass f64 reduction over `n` values: ~8 values a thread, at most 2048.
    pub(crate) fn loss_blocks(n: usize) -> usize {
        n.div_ceil(256 * 8).clamp(1, 2048)
    }

    /// `loss_partial` (mode 0 sum of x, 1 BCE terms) then `loss_final`.
    pub(crate) fn reduce_to_scalar(x: KArg, y: KArg, n: usize, mode: i32, mean: bool) -> CudaPlan {
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

    pub(crate) fn scalar_out(op: &Op, o: &Operands) -> Result<(), String> {
        if o.outs[0].numel() != 1 {
            return Err(format!(
                "{}: the output {} must be a scalar",
                op.name(),
                o.outs[0]
            ));
        }
        Ok(())
    }

    pub(crate) fn full_sum(op: &Op, o: &Operands, mean: bool) -> Result<CudaPlan, String> {
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

    /// A scalar broadcast to the output's shape, times `scale`.
    pub(crate) fn broadcast(op: &Op, o: &Operands, scale: f64) -> Result<CudaPlan, String> {
        expect(op, o, &[F], &[F])?;
        let n = o.outs[0].numel();
        Ok(plan_of(
            vec![ew(
                "ew_fill_scaled",
                n,
                vec![KArg::In(0), Out(0), n64(n), F32(scale as f32)],
            )],
            vec![],
        ))
    }
}

// ---- the cost estimate ----
pub(crate) mod cost {
    use crate::launch::{ceil, elementwise, Cost, LaunchSpec};

    pub(crate) use crate::family::elementwise::cost::map;

    /// 32 columns per CTA, rows split in up to 64 slices summed in a fixed order.
    pub(crate) fn sum_to_shape(c: &Cost) -> LaunchSpec {
        let out0 = c.out0();
        LaunchSpec {
            kernel: "sum_to_shape",
            grid: ceil(out0, 32) * ceil(c.ins[0].numel() / out0.max(1), 128).clamp(1, 64),
            block: 256,
            regs_per_thread: 32,
            smem_bytes: 4096,
            flops: c.ins[0].numel() as f64,
            bytes: c.moved(),
            tensor_core: false,
            copies: false,
            attention: false,
            extra_launches: 0,
        }
    }

    /// One CTA reduces everything to a scalar (sums, means, losses).
    pub(crate) fn to_scalar(c: &Cost) -> LaunchSpec {
        LaunchSpec {
            kernel: "reduce_loss",
            grid: 1,
            block: 1024,
            regs_per_thread: 32,
            smem_bytes: 4096,
            flops: 4.0 * c.ins[0].numel() as f64,
            bytes: c.moved(),
            tensor_core: false,
            copies: false,
            attention: false,
            extra_launches: 0,
        }
    }

    /// Reads only the window of each contribution (a `GradSum` reads them whole, the
    /// same kernels); past [`super::cuda::SUM_MAX`] contributions each chained launch
    /// also reads and writes the running sum.
    pub(crate) fn slice_sum(c: &Cost) -> LaunchSpec {
        let ob = c.out_bytes();
        let k = c.ins.len();
        let chained = chained_launches(k);
        let mut spec = elementwise("ew_slice_sum", c.out0(), (k + 1 + 2 * chained) as f64 * ob);
        spec.extra_launches = chained as u32;
        spec
    }

    /// The launches after the first that a sum of `k` contributions chains.
    fn chained_launches(k: usize) -> usize {
        let max = super::cuda::SUM_MAX;
        k.saturating_sub(max).div_ceil(max - 1)
    }

    #[cfg(test)]
    mod tests {
        #[test]
        fn sums_of_up_to_eight_contributions_are_one_launch() {
            // each launch after the first reads the running sum and 7 more (the spec
            // model's embedding gradient, nine contributions, chains one)
            for (k, chained) in [(1, 0), (8, 0), (9, 1), (15, 1), (16, 2)] {
                assert_eq!(super::chained_launches(k), chained, "{k} contributions");
            }
        }
    }
}
