//! The DLRM interaction: `PairwiseDot` and `PairwiseDotGrad`.
//!
//! Everything of the family in one place: the CPU reference (`cpu`, what every CUDA
//! kernel is tested against), the CUDA launch plans (`cuda`) and the cost estimate the
//! scheduler reads (`cost`).

// ---- the CPU reference ----
pub mod cpu {
    //! The CPU reference of the interaction ops: the pairwise dots of the DLRM interaction and their gradient.

    use crate::cpu::*;

    /// The pairwise dots of the DLRM interaction and their gradient.
    pub(crate) fn exec_interaction<T: Elem>(
        call: &NodeCall,
        ins: &[&Buffer],
        outs: &mut [Buffer],
        _upd: &mut [Buffer],
    ) -> Result<(), String> {
        let ish = |i: usize| call.in_shapes[i];
        match call.op {
            Op::PairwiseDot => {
                let d = ish(0).dims();
                kernels::pairwise_dot(get::<T>(ins[0], "e")?, out(&mut outs[0])?, d[1], d[2]);
            }
            Op::PairwiseDotGrad => {
                let d = ish(1).dims();
                let (dy, e) = (get::<T>(ins[0], "dy")?, get::<T>(ins[1], "e")?);
                kernels::pairwise_dot_grad(dy, e, out(&mut outs[0])?, d[1], d[2]);
            }
            other => {
                return Err(format!(
                    "interaction: no CPU implementation of {}",
                    other.name()
                ))
            }
        }
        Ok(())
    }
}

// ---- the CUDA launch plans ----
pub(crate) mod cuda {
    //! The DLRM interaction: the dots of every pair of fields and its gradient
    //! (`kernels-cuda/interaction.cu`).

    use crate::cuda::common::*;
    use crate::cuda::{CudaPlan, KArg, Operands};
    use erase_graph::Op;
    use KArg::{Out, I32};

    /// Kernels these plans launch.
    pub(crate) const KERNELS: &[&str] = &[
        "pairwise_dot_fwd",
        "pairwise_dot_fwd_gmem",
        "pairwise_dot_bwd",
        "pairwise_dot_bwd_gmem",
    ];

    /// Rows of de a thread of `pairwise_dot_bwd` computes (`PD_KB9` in interaction.cu).
    const PD_ROWS: usize = 9;
    /// Rows and columns of the dot matrix a thread of `pairwise_dot_fwd` computes (`PD_BS`).
    const PD_BLOCK: usize = 3;

    pub(crate) fn pairwise_dot(op: &Op, o: &Operands, grad: bool) -> Result<CudaPlan, String> {
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
        // the forward's examples a CTA at a time: about 128 threads of 3x3 blocks of dots
        // (nb(nb+1)/2 an example), as many examples as fit the default shared memory
        let nb = f.div_ceil(PD_BLOCK);
        let tasks = nb * (nb + 1) / 2;
        let ex = (128 / tasks)
            .min(SMEM_DEFAULT / (f * ld * 4).max(1))
            .clamp(1, b.max(1));
        // the gradient's G [F][F rounded up to 4] after e, at a 16-byte aligned offset
        let smem = if grad {
            ((f * ld).next_multiple_of(4) + f * f.next_multiple_of(4)) * 4
        } else {
            ex * f * ld * 4
        };
        // (the forward's threads, a block of dots each, fit a CTA)
        let fits = smem <= SMEM_DEFAULT && (grad || ex * tasks <= 1024);
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
        if kernel == "pairwise_dot_fwd" {
            args.push(I32(i32_of(ex, "examples a CTA")?));
        }
        // the shared-memory kernels: small CTAs (the forward's `ex` examples at a time, a
        // thread a 3x3 block of dots; the gradient's one, a thread a column of PD_ROWS rows
        // of de), many an SM, grid-strided over the batch; the gmem forms, a CTA an example
        let (grid, threads) = if fits && grad {
            (
                b.min(1 << 20),
                (f.div_ceil(PD_ROWS) * d)
                    .next_multiple_of(32)
                    .clamp(64, 1024),
            )
        } else if fits {
            (
                b.div_ceil(ex).min(1 << 20),
                (ex * tasks).next_multiple_of(32).clamp(32, 1024),
            )
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
}

// ---- the cost estimate ----
pub(crate) mod cost {
    use crate::launch::{Cost, LaunchSpec};

    /// The forward reads x (input 0), the backward dy and x (x is input 1).
    pub(crate) fn pairwise_dot(c: &Cost, bwd: bool) -> LaunchSpec {
        let d = c.ins[usize::from(bwd)].dims();
        let (b, f, dim) = (d[0], d[1], d[2]);
        LaunchSpec {
            kernel: if bwd {
                "pairwise_dot_bwd"
            } else {
                "pairwise_dot_fwd"
            },
            grid: b as u64,
            block: 128,
            regs_per_thread: 64,
            smem_bytes: (f * dim * 4) as u32,
            flops: (b * f * f * dim) as f64,
            bytes: c.moved(),
            tensor_core: false,
            copies: false,
            attention: false,
            extra_launches: 0,
        }
    }
}
