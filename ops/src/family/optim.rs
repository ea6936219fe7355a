//! Dense optimizers: `Sgd`, `Adam`, `StepIncrement`.
//!
//! Everything of the family in one place: the CPU reference (`cpu`, what every CUDA
//! kernel is tested against), the CUDA launch plans (`cuda`) and the cost estimate the
//! scheduler reads (`cost`).

// ---- the CPU reference ----
pub mod cpu {
    //! The CPU reference of the optim ops: SGD, Adam and the step counter.

    use crate::cpu::*;

    /// `StepIncrement`: the step counter (one i32, updated in place) plus one.
    pub(crate) fn exec_step_increment(upd: &mut [Buffer]) -> Result<(), String> {
        match upd.first_mut() {
            Some(Buffer::I32(v)) if v.len() == 1 => {
                v[0] = v[0].saturating_add(1);
                Ok(())
            }
            _ => Err("the step counter must be one i32".into()),
        }
    }

    /// SGD and Adam.
    pub(crate) fn exec_optim<T: Elem>(
        call: &NodeCall,
        ins: &[&Buffer],
        _outs: &mut [Buffer],
        upd: &mut [Buffer],
    ) -> Result<(), String> {
        match call.op {
            Op::Sgd { lr } => {
                let lr = T::from_f64(*lr);
                for (gb, pb) in ins.iter().zip(upd.iter_mut()) {
                    let g = get::<T>(gb, "gradient")?;
                    for (p, &gi) in out::<T>(pb)?.iter_mut().zip(g) {
                        *p -= lr * gi;
                    }
                }
            }
            Op::Adam {
                lr,
                beta1,
                beta2,
                eps,
            } => {
                let step = ins[0]
                    .as_i32()
                    .and_then(|s| s.first().copied())
                    .ok_or("adam needs an i32 step")?;
                if step < 1 {
                    return Err(format!(
                        "adam step count is {step}; the step increment must run first"
                    ));
                }
                let h = AdamHyper {
                    lr: *lr,
                    beta1: *beta1,
                    beta2: *beta2,
                    eps: *eps,
                    step,
                };
                let n = ins.len() - 1;
                if upd.len() < 3 * n || upd.len() > 4 * n {
                    return Err(format!(
                        "adam: {} updated tensors for {n} gradients",
                        upd.len()
                    ));
                }
                let (ps, rest) = upd.split_at_mut(n);
                let (ms, rest) = rest.split_at_mut(n);
                let (vs, copies) = rest.split_at_mut(n);
                for i in 0..n {
                    let g = get::<T>(ins[i + 1], "gradient")?;
                    kernels::adam(out(&mut ps[i])?, g, out(&mut ms[i])?, out(&mut vs[i])?, &h);
                    // the parameter's bf16 copy, from its updated value
                    if let Some(c) = copies.get_mut(i) {
                        if c.len() != ps[i].len() {
                            return Err(format!(
                                "adam: the bf16 copy of parameter {i} has {} elements, not {}",
                                c.len(),
                                ps[i].len()
                            ));
                        }
                        *c = cast(&ps[i], DType::Bf16);
                    }
                }
            }
            other => return Err(format!("optim: no CPU implementation of {}", other.name())),
        }
        Ok(())
    }
}

// ---- the CUDA launch plans ----
pub(crate) mod cuda {
    //! Optimizers (`kernels-cuda/optim.cu`): multi-tensor Adam and SGD, the step counter.

    use crate::cuda::common::*;
    use crate::cuda::{CudaPlan, KArg, KernelCall, Operands};
    use erase_graph::{Op, Shape};
    use KArg::{Scratch, Upd, F32, I32, I64};

    /// Kernels these plans launch.
    pub(crate) const KERNELS: &[&str] = &[
        "step_increment",
        "optim_table_build",
        "adam_multi_tensor",
        "sgd_multi_tensor",
    ];

    /// Elements per optimizer chunk (`OPT_CHUNK` in optim.cu).
    const OPT_CHUNK: usize = 1024;

    /// Bytes of one optimizer table record (`OptRec` in optim.cu: 5 pointers, 2 i64).
    const OPT_REC_BYTES: usize = 56;

    pub(crate) fn step_increment(op: &Op, o: &Operands) -> Result<CudaPlan, String> {
        expect(op, o, &[], &[])?;
        if o.upd.len() != 1 || o.upd[0].numel() != 1 {
            return Err("step_increment: the step counter must be one i32".into());
        }
        Ok(plan_of(
            vec![kc("step_increment", [1, 1, 1], [32, 1, 1], 0, vec![Upd(0)])],
            vec![],
        ))
    }

    /// The table of (param, grad, m, v, bf16 copy, numel, first chunk) records in scratch
    /// 0, built by `optim_table_build` launches of 32 records each; returns the calls and
    /// the total number of chunks. A record without a copy passes a null pointer
    /// (`I64(0)`).
    fn optim_table(tensors: &[[KArg; 5]], numels: &[usize]) -> (Vec<KernelCall>, usize) {
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

    /// The updated tensors fit the gradients: SGD's parameters, or Adam's parameters,
    /// moments and the bf16 copies of its first parameters (at most one a parameter).
    fn check_pairs(op: &Op, o: &Operands, grads: &[&Shape], n: usize) -> Result<(), String> {
        let fits = if matches!(op, Op::Adam { .. }) {
            (3 * n..=4 * n).contains(&o.upd.len())
        } else {
            o.upd.len() == n
        };
        if !fits {
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

    pub(crate) fn sgd(op: &Op, o: &Operands, lr: f64) -> Result<CudaPlan, String> {
        let n = o.ins.len();
        expect(op, o, &vec![F; n], &[])?;
        check_pairs(op, o, o.ins, n)?;
        let numels: Vec<usize> = o.ins.iter().map(|s| s.numel()).collect();
        let recs: Vec<[KArg; 5]> = (0..n)
            .map(|i| [Upd(i), KArg::In(i), Upd(i), Upd(i), I64(0)])
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

    pub(crate) fn adam(
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
        // the bf16 copies of the first parameters follow the moments
        let copies = o.upd.len() - 3 * n;
        let recs: Vec<[KArg; 5]> = (0..n)
            .map(|i| {
                let c = if i < copies { Upd(3 * n + i) } else { I64(0) };
                [Upd(i), KArg::In(1 + i), Upd(n + i), Upd(2 * n + i), c]
            })
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
}

// ---- the cost estimate ----
pub(crate) mod cost {
    use crate::launch::{ceil, elementwise, Cost, LaunchSpec};

    /// Adam (`adam`; its first input is the step counter) or SGD over every tensor.
    pub(crate) fn multi_tensor(c: &Cost, adam: bool) -> LaunchSpec {
        let n: usize = c
            .ins
            .iter()
            .skip(usize::from(adam))
            .map(|s| s.numel())
            .sum();
        LaunchSpec {
            kernel: if adam {
                "adam_multi_tensor"
            } else {
                "sgd_multi_tensor"
            },
            grid: ceil(n, 256 * 4).max(1),
            block: 256,
            regs_per_thread: 40,
            smem_bytes: 0,
            flops: 10.0 * n as f64,
            // the gradients and the parameters and moments read (Adam 16 bytes an element,
            // SGD 8), and what it writes: the updated tensors where the launch lists them
            // (the parameters, Adam's moments and bf16 copies), else parameters and moments
            bytes: {
                let (read, written) = if adam { (16.0, 12.0) } else { (8.0, 4.0) };
                let written = if c.outs.is_empty() {
                    written * n as f64
                } else {
                    c.out_bytes()
                };
                read * n as f64 + written
            },
            tensor_core: false,
            copies: false,
            attention: false,
            extra_launches: 0,
        }
    }

    pub(crate) fn step_increment(_: &Cost) -> LaunchSpec {
        elementwise("step_increment", 1, 8.0)
    }
}
