//! `LayerNorm` and `LayerNormGrad`.
//!
//! Everything of the family in one place: the CPU reference (`cpu`, what every CUDA
//! kernel is tested against), the CUDA launch plans (`cuda`) and the cost estimate the
//! scheduler reads (`cost`).

// ---- the CPU reference ----
pub mod cpu {
    //! The CPU reference of the norm ops: layer norm and its gradient.

    use crate::cpu::*;

    /// The norm ops' storage forms: a layer norm's gradient whose dx is a linear layer's
    /// dy, with dx's bf16 copy and its column sums beside it (`[dx, dgamma, dbeta, dx in
    /// bf16, dx's column sums]`). `None` for the plain forms.
    pub(crate) fn exec_stored(
        call: &NodeCall,
        ins: &[&Buffer],
        outs: &mut [Buffer],
        upd: &mut [Buffer],
    ) -> Option<Result<(), OpError>> {
        (matches!(call.op, Op::LayerNormGrad) && outs.len() == 5).then(|| {
            let err = |msg: String| call.error(msg);
            execute(&call.first_outputs(3), ins, &mut outs[..3], upd)?;
            outs[3] = cast(&outs[0], DType::Bf16);
            let (head, tail) = outs.split_at_mut(4);
            let dx = get::<f32>(&head[0], "dx").map_err(err)?;
            kernels::sum_to_shape(dx, out(&mut tail[0]).map_err(err)?);
            Ok(())
        })
    }

    /// Layer norm and its gradient.
    pub(crate) fn exec_norm<T: Elem>(
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
}

// ---- the CUDA launch plans ----
pub(crate) mod cuda {
    //! Layer norm and its gradient (`kernels-cuda/norm.cu`).

    use crate::cuda::common::*;
    use crate::cuda::elementwise::cast_f32_bf16_call;
    use crate::cuda::reduce::append_column_sums;
    use crate::cuda::reduce::colsum_final_call;
    use crate::cuda::reduce::column_reduce;
    use crate::cuda::{blocks, CudaPlan, KArg, KernelCall, Operands};
    use erase_graph::{DType, Op};
    use KArg::{Out, Scratch, F32, I32};

    /// Kernels these plans launch.
    pub(crate) const KERNELS: &[&str] = &[
        "layer_norm_fwd",
        "layer_norm_bwd_dx",
        "layer_norm_bwd_dx_bf16",
        "layer_norm_bwd_dgb_partial",
        "layer_norm_fwd_v4",
        "layer_norm_bwd_v4",
    ];

    pub(crate) fn layer_norm(op: &Op, o: &Operands, eps: f64) -> Result<CudaPlan, String> {
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

    pub(crate) fn layer_norm_grad(op: &Op, o: &Operands) -> Result<CudaPlan, String> {
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
}

// ---- the cost estimate ----
pub(crate) mod cost {
    use crate::launch::{ceil, Cost, LaunchSpec};

    pub(crate) fn layer_norm(c: &Cost, bwd: bool) -> LaunchSpec {
        let rows = c.ins[0].rows().max(c.ins.get(1).map_or(1, |s| s.rows()));
        LaunchSpec {
            kernel: if bwd {
                "layer_norm_bwd"
            } else {
                "layer_norm_fwd"
            },
            grid: ceil(rows, 8),
            block: 256,
            regs_per_thread: 48,
            smem_bytes: 0,
            flops: 8.0 * c.out0() as f64,
            bytes: c.moved(),
            tensor_core: false,
            copies: false,
            attention: false,
            extra_launches: 0,
        }
    }
}
