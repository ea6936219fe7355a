//! Maps over elements: `Add`, `Mul`, `MulAdd`, `Scale`, the activations and their gradients, `MulGrad`, `Cast`, `Reshape`/`Detach` copies.
//!
//! Everything of the family in one place: the CPU reference (`cpu`, what every CUDA
//! kernel is tested against), the CUDA launch plans (`cuda`) and the cost estimate the
//! scheduler reads (`cost`).

// ---- the CPU reference ----
pub mod cpu {
    //! The CPU reference of the elementwise ops: elementwise ops, activations and their gradients.

    use crate::cpu::*;

    /// The elementwise ops' storage forms: `a ⊙ b + c` and its gradient with a factor
    /// stored in bf16 (`Graph::linear_stored_bf16`), read as its f32 values; a product (or
    /// `a ⊙ b + c`) with its bf16 copy beside it, the one a GEMM reads
    /// (`Graph::copy_output`); the product's gradient whose `db` is a copied linear
    /// layer's dy: only its bf16 copy, and with a third output its column sums (the
    /// layer's bias gradient), as RoundBf16 of the f32 db gives them; `a ⊙ b + c` stored
    /// in bf16 (`Graph::set_bf16_cross`). `None` for the plain forms.
    pub(crate) fn exec_stored(
        call: &NodeCall,
        ins: &[&Buffer],
        outs: &mut [Buffer],
        upd: &mut [Buffer],
    ) -> Option<Result<(), OpError>> {
        match call.op {
            // a cross update stored in bf16 (Graph::set_bf16_cross): the f32 values rounded
            Op::MulAdd if outs.len() == 1 && outs[0].dtype() == DType::Bf16 => {
                Some(rounded(call, ins, outs, upd))
            }
            Op::MulAdd | Op::MulGrad { .. } if any_bf16(ins) => Some(widened(call, ins, outs, upd)),
            Op::MulAdd | Op::Mul if copy_last(outs, 2) => Some(with_copy(call, ins, outs, upd, 1)),
            Op::MulGrad { .. } if outs.len() >= 2 && outs[1].dtype() == DType::Bf16 => {
                Some(mul_grad_copied(call, ins, outs, upd))
            }
            _ => None,
        }
    }

    fn mul_grad_copied(
        call: &NodeCall,
        ins: &[&Buffer],
        outs: &mut [Buffer],
        upd: &mut [Buffer],
    ) -> Result<(), OpError> {
        let err = |msg: String| call.error(msg);
        let mut two = [outs[0].clone(), Buffer::F32(vec![0.0; outs[1].len()])];
        execute(&call.first_outputs(2), ins, &mut two, upd)?;
        let [da, db] = two;
        outs[1] = cast(&db, DType::Bf16);
        if let Some(s) = outs.get_mut(2) {
            let db = get::<f32>(&db, "db").map_err(err)?;
            kernels::sum_to_shape(db, out(s).map_err(err)?);
        }
        outs[0] = da;
        Ok(())
    }

    /// Elementwise ops, activations and their gradients.
    pub(crate) fn exec_elementwise<T: Elem>(
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
            Op::MulGrad { plus_dy } => {
                let (dy, a, b) = (
                    get::<T>(ins[0], "dy")?,
                    get::<T>(ins[1], "a")?,
                    get::<T>(ins[2], "b")?,
                );
                let [da, db] = outs else {
                    return Err("expected two outputs".into());
                };
                if *plus_dy {
                    // a's other contribution, dy itself, summed in the same pass
                    kernels::map_index(out(da)?, |i| dy[i] * b[i] + dy[i]);
                } else {
                    kernels::map_index(out(da)?, |i| dy[i] * b[i]);
                }
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
            Op::Silu => {
                let x = get::<T>(ins[0], "x")?;
                kernels::map_index(out(&mut outs[0])?, |i| silu(x[i]));
            }
            Op::SiluGrad => {
                let (dy, x) = (get::<T>(ins[0], "dy")?, get::<T>(ins[1], "x")?);
                kernels::map_index(out(&mut outs[0])?, |i| dy[i] * silu_grad(x[i]));
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

    /// SiLU: `x · sigmoid(x)`, as `ew_silu` computes it.
    fn silu<T: Real>(x: T) -> T {
        x * kernels::sigmoid(x)
    }

    /// SiLU's derivative: `s · (1 + x · (1 - s))` with `s = sigmoid(x)`, as
    /// `ew_silu_grad` computes it.
    fn silu_grad<T: Real>(x: T) -> T {
        let s = kernels::sigmoid(x);
        s * (T::ONE + x * (T::ONE - s))
    }

    /// The copies of any element type: a reshape or a detach (the input as it is) and a
    /// cast (each element converted; to bf16 rounded to nearest even).
    pub(crate) fn exec_copy(
        call: &NodeCall,
        ins: &[&Buffer],
        outs: &mut [Buffer],
    ) -> Result<(), String> {
        let ([x], [y]) = (ins, outs) else {
            return Err("expected one input and one output".into());
        };
        match call.op {
            Op::Reshape | Op::Detach => *y = (*x).clone(),
            Op::Cast { to } => *y = cast(x, *to),
            other => return Err(format!("elementwise: {} is not a copy", other.name())),
        }
        Ok(())
    }
}

// ---- the CUDA launch plans ----
pub(crate) mod cuda {
    //! Elementwise ops and activations (`kernels-cuda/elementwise.cu`): add, mul and their
    //! bf16-pair forms, mul-add, scale, ReLU/GELU/sigmoid/SiLU and their gradients, casts, copies.

    use crate::cuda::common::*;
    use crate::cuda::reduce::colsum_final_call;
    use crate::cuda::{CudaPlan, KArg, KernelCall, Operands};
    use erase_graph::{DType, Op};
    use KArg::{Out, Scratch, F32, I32, I64};

    /// Kernels these plans launch.
    pub(crate) const KERNELS: &[&str] = &[
        "ew_add",
        "ew_mul",
        "ew_mul_add",
        "ew_mul_add_bf16",
        "ew_mul_add_b16",
        "ew_mul_add_bf16_b16",
        "ew_mul_add_s16",
        "ew_mul_add_s16_f32",
        "ew_mul_add_s16_f32c",
        "ew_mul_bf16",
        "ew_mul_grad",
        "ew_mul_grad_bf16",
        "ew_mul_grad_bf16_b16",
        "ew_mul_grad_bf16_a16_b16",
        "ew_mul_grad_bf16_a16_b16_dy",
        "ew_scale",
        "ew_relu",
        "ew_gelu",
        "ew_sigmoid",
        "ew_silu",
        "ew_relu_grad",
        "ew_gelu_grad",
        "ew_sigmoid_grad",
        "ew_silu_grad",
        "ew_cast",
        "ew_copy_u32",
        "ew_copy_u16",
        "ew_copy_rows_u32",
        "ew_copy_rows_u16",
        "ew_pad_rows_u32",
        "ew_pad_rows_u16",
    ];

    pub(crate) fn binary(op: &Op, o: &Operands, kernel: &'static str) -> Result<CudaPlan, String> {
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
    /// (Graph::set_bf16_copies puts it on the producer) written by the same pass; b may be
    /// bf16 (a linear layer stored in bf16, Graph::linear_stored_bf16: the `_b16` forms).
    /// With a, b and c all bf16 (a cross network stored in bf16, Graph::set_bf16_cross:
    /// the `_s16` forms), y is bf16, or f32 with or without its copy.
    pub(crate) fn mul_add(op: &Op, o: &Operands) -> Result<CudaPlan, String> {
        let bf = DType::Bf16;
        let stored = o.in_dtypes.len() == 3 && o.in_dtypes.iter().all(|&d| d == bf);
        let outs: &[DType] = match (o.outs.len(), o.out_dtypes.first()) {
            (2, _) => &[F, bf],
            (_, Some(&DType::Bf16)) if stored => &[bf],
            _ => &[F],
        };
        let b16 = o.in_dtypes.get(1) == Some(&bf);
        let ins: &[DType] = if stored {
            &[bf, bf, bf]
        } else if b16 {
            &[F, bf, F]
        } else {
            &[F, F, F]
        };
        expect(op, o, ins, outs)?;
        let n = one_shape(op, o, outs.len())?;
        let mut args = vec![KArg::In(0), KArg::In(1), KArg::In(2), Out(0)];
        if outs.len() == 2 {
            args.push(Out(1));
        }
        args.push(n64(n));
        let kernel = match (outs, stored, b16) {
            ([_, _], true, _) => "ew_mul_add_s16_f32c",
            ([DType::Bf16], true, _) => "ew_mul_add_s16",
            (_, true, _) => "ew_mul_add_s16_f32",
            ([_, _], false, false) => "ew_mul_add_bf16",
            (_, false, false) => "ew_mul_add",
            ([_, _], false, true) => "ew_mul_add_bf16_b16",
            (_, false, true) => "ew_mul_add_b16",
        };
        Ok(plan_of(vec![ew(kernel, n.div_ceil(4), args)], vec![]))
    }

    /// `[a, b] -> [a ⊙ b, bf16(a ⊙ b)]` of same-shape tensors in one pass (a product with
    /// the bf16 copy a GEMM reads).
    pub(crate) fn mul_bf16(op: &Op, o: &Operands) -> Result<CudaPlan, String> {
        expect(op, o, &[F, F], &[F, DType::Bf16])?;
        let n = one_shape(op, o, 2)?;
        let args = vec![KArg::In(0), KArg::In(1), Out(0), Out(1), n64(n)];
        Ok(plan_of(
            vec![ew("ew_mul_bf16", n.div_ceil(4), args)],
            vec![],
        ))
    }

    /// `[dy, a, b] -> [dy ⊙ b, dy ⊙ a]`.
    pub(crate) fn mul_grad(op: &Op, o: &Operands) -> Result<CudaPlan, String> {
        if o.out_dtypes.get(1) == Some(&DType::Bf16) {
            return mul_grad_bf16(op, o);
        }
        if matches!(op, Op::MulGrad { plus_dy: true }) {
            return Err(
                "mul_grad: dy added to da only where db is a layer's bf16 dy (its plan takes the bf16 forms)"
                    .into(),
            );
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
    /// RoundBf16 of the f32 db would make them. b may be bf16 (that layer's output stored
    /// in bf16, Graph::linear_stored_bf16: `ew_mul_grad_bf16_b16`), and a with it (x0's
    /// copy, Graph::set_bf16_cross: `ew_mul_grad_bf16_a16_b16`).
    fn mul_grad_bf16(op: &Op, o: &Operands) -> Result<CudaPlan, String> {
        let sums = o.outs.len() == 3;
        let outs: &[DType] = if sums {
            &[F, DType::Bf16, F]
        } else {
            &[F, DType::Bf16]
        };
        let b16 = o.in_dtypes.get(2) == Some(&DType::Bf16);
        // a in bf16 too: x0 read from its copy (Graph::set_bf16_cross), with a bf16 b
        let a16 = b16 && o.in_dtypes.get(1) == Some(&DType::Bf16);
        let bf = |on: bool| if on { DType::Bf16 } else { F };
        // plus_dy: dy added to da (`_dy`, with a and b bf16 only)
        let res = matches!(op, Op::MulGrad { plus_dy: true });
        if res && !a16 {
            return Err(format!(
                "{}: dy added to da with an f32 a or b: the kernels add it only where a and b are bf16",
                op.name()
            ));
        }
        expect(op, o, &[F, bf(a16), bf(b16)], outs)?;
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
        let (col_blocks, iters, slices) = colsum_geometry(rows, cols, o.opts.sms);
        let part = if sums { Scratch(0) } else { I64(0) }; // a null pointer: no sums
        let args = vec![
            KArg::In(0),
            KArg::In(1),
            KArg::In(2),
            Out(0),
            Out(1),
            part,
            I32(ri),
            I32(ci),
            I32(iters as i32),
        ];
        let mut calls = vec![kc(
            match (res, a16, b16) {
                (true, _, _) => "ew_mul_grad_bf16_a16_b16_dy",
                (false, true, _) => "ew_mul_grad_bf16_a16_b16",
                (false, false, true) => "ew_mul_grad_bf16_b16",
                (false, false, false) => "ew_mul_grad_bf16",
            },
            [col_blocks as u32, slices as u32, 1],
            [256, 1, 1],
            0,
            args,
        )];
        let mut scratch = vec![];
        if sums {
            calls.push(colsum_final_call(Scratch(0), Out(2), slices, cols));
            scratch.push(slices * cols * 4);
        }
        Ok(CudaPlan { calls, scratch })
    }

    pub(crate) fn unary(op: &Op, o: &Operands, kernel: &'static str) -> Result<CudaPlan, String> {
        expect(op, o, &[F], &[F])?;
        let n = o.outs[0].numel();
        Ok(plan_of(
            vec![ew(kernel, n, vec![KArg::In(0), Out(0), n64(n)])],
            vec![],
        ))
    }

    pub(crate) fn unary_grad(
        op: &Op,
        o: &Operands,
        kernel: &'static str,
    ) -> Result<CudaPlan, String> {
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

    pub(crate) fn cast(op: &Op, o: &Operands, to: DType) -> Result<CudaPlan, String> {
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
    pub(crate) fn copy_kernels(op: &Op, d: DType) -> Result<[&'static str; 3], String> {
        match d.size_bytes() {
            4 => Ok(["ew_copy_u32", "ew_copy_rows_u32", "ew_pad_rows_u32"]),
            2 => Ok(["ew_copy_u16", "ew_copy_rows_u16", "ew_pad_rows_u16"]),
            _ => Err(format!("{}: no CUDA copy of {d} elements", op.name())),
        }
    }

    /// Reshape/detach (and a cast to the same type): a plain copy (the runtime may alias
    /// instead of launching it).
    pub(crate) fn copy(op: &Op, o: &Operands) -> Result<CudaPlan, String> {
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

    /// `y = factor * x`.
    pub(crate) fn scale(op: &Op, o: &Operands, factor: f64) -> Result<CudaPlan, String> {
        expect(op, o, &[F], &[F])?;
        let n = o.outs[0].numel();
        Ok(plan_of(
            vec![ew(
                "ew_scale",
                n,
                vec![KArg::In(0), Out(0), n64(n), F32(factor as f32)],
            )],
            vec![],
        ))
    }
}

// ---- the cost estimate ----
pub(crate) mod cost {
    use crate::launch::{elementwise, Cost, LaunchSpec};

    /// Every operand read or written once, as a map.
    pub(crate) fn map(c: &Cost) -> LaunchSpec {
        elementwise("elementwise", c.out0(), c.moved())
    }
}
