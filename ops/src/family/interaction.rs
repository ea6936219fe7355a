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
            (b.min(o.opts.sms * (2048 / threads)), threads)
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
        }
    }
}
