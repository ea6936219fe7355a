//! Fused attention: `Attention` and `AttentionGrad`.
//!
//! Everything of the family in one place: the CPU reference (`cpu`, what every CUDA
//! kernel is tested against), the CUDA launch plans (`cuda`) and the cost estimate the
//! scheduler reads (`cost`).

// ---- the CPU reference ----
pub mod cpu {
    //! The CPU reference of the attention ops: fused attention and its gradient.

    use crate::cpu::*;

    /// The attention ops' storage forms, packed q, k, v only: the gradient dqkv stored in
    /// bf16 (a projection's GEMMs read it: the f32 gradient rounded); a q, k, v stored in
    /// bf16 (`Graph::linear_for_attention`) read as its f32 values. `None` for the plain
    /// forms.
    pub(crate) fn exec_stored(
        call: &NodeCall,
        ins: &[&Buffer],
        outs: &mut [Buffer],
        upd: &mut [Buffer],
    ) -> Option<Result<(), OpError>> {
        match call.op {
            Op::AttentionGrad { packed: true, .. } if copy_last(outs, 1) => {
                Some(rounded(call, ins, outs, upd))
            }
            Op::Attention { packed: true, .. } | Op::AttentionGrad { packed: true, .. }
                if any_bf16(ins) =>
            {
                Some(widened(call, ins, outs, upd))
            }
            _ => None,
        }
    }

    /// Fused attention and its gradient.
    pub(crate) fn exec_attention<T: Elem>(
        call: &NodeCall,
        ins: &[&Buffer],
        outs: &mut [Buffer],
        _upd: &mut [Buffer],
    ) -> Result<(), String> {
        let ish = |i: usize| call.in_shapes[i];
        match call.op {
            Op::Attention {
                heads,
                causal,
                packed: true,
            } => {
                let d = ish(0).dims();
                let a = AttnDims {
                    s: d[1],
                    heads: *heads,
                    dh: d[2] / 3 / heads,
                    causal: *causal,
                    bf16: call.bf16_gemm,
                };
                let [q, k, v] = unpack3(get::<T>(ins[0], "qkv")?, d[2] / 3);
                let [o, lse] = outs else {
                    return Err("expected two outputs".into());
                };
                kernels::attention(&q, &k, &v, out(o)?, out(lse)?, a);
            }
            Op::AttentionGrad {
                heads,
                causal,
                packed: true,
            } => {
                let d = ish(1).dims();
                let w = d[2] / 3;
                let a = AttnDims {
                    s: d[1],
                    heads: *heads,
                    dh: w / heads,
                    causal: *causal,
                    bf16: call.bf16_gemm,
                };
                let [q, k, v] = unpack3(get::<T>(ins[1], "qkv")?, w);
                let x = AttnGradIn {
                    d_o: get::<T>(ins[0], "do")?,
                    q: &q,
                    k: &k,
                    v: &v,
                    o: get::<T>(ins[2], "o")?,
                    lse: get::<T>(ins[3], "lse")?,
                };
                let n = q.len();
                let (mut dq, mut dk, mut dv) =
                    (vec![T::ZERO; n], vec![T::ZERO; n], vec![T::ZERO; n]);
                kernels::attention_grad(x, &mut dq, &mut dk, &mut dv, a);
                pack3([&dq, &dk, &dv], w, out(&mut outs[0])?);
            }
            Op::Attention { heads, causal, .. } => {
                let d = ish(0).dims();
                let a = AttnDims {
                    s: d[1],
                    heads: *heads,
                    dh: d[2] / heads,
                    causal: *causal,
                    bf16: call.bf16_gemm,
                };
                let (q, k, v) = (
                    get::<T>(ins[0], "q")?,
                    get::<T>(ins[1], "k")?,
                    get::<T>(ins[2], "v")?,
                );
                let [o, lse] = outs else {
                    return Err("expected two outputs".into());
                };
                kernels::attention(q, k, v, out(o)?, out(lse)?, a);
            }
            Op::AttentionGrad { heads, causal, .. } => {
                let d = ish(1).dims();
                let a = AttnDims {
                    s: d[1],
                    heads: *heads,
                    dh: d[2] / heads,
                    causal: *causal,
                    bf16: call.bf16_gemm,
                };
                let x = AttnGradIn {
                    d_o: get::<T>(ins[0], "do")?,
                    q: get::<T>(ins[1], "q")?,
                    k: get::<T>(ins[2], "k")?,
                    v: get::<T>(ins[3], "v")?,
                    o: get::<T>(ins[4], "o")?,
                    lse: get::<T>(ins[5], "lse")?,
                };
                let (dq, dk, dv) = three::<T>(outs)?;
                kernels::attention_grad(x, dq, dk, dv, a);
            }
            other => {
                return Err(format!(
                    "attention: no CPU implementation of {}",
                    other.name()
                ))
            }
        }
        Ok(())
    }
}

// ---- the CUDA launch plans ----
pub(crate) mod cuda {
    //! Fused attention (`kernels-cuda/attention.cu`, FlashAttention-2's schedule): the forward
    //! and backward on `[B, S, H·Dh]` tensors (or packed QKV), short sequences two heads a CTA,
    //! long ones on bf16 copies staged once and streamed through a cp.async ring.

    use crate::cuda::common::i32_of;
    use crate::cuda::gemm::{check_f32, GRID_YZ};
    use crate::cuda::{blocks, CudaPlan, KArg, KernelCall, Operands};
    use erase_graph::{DType, Shape};

    /// Kernels these plans launch.
    pub(crate) const KERNELS: &[&str] = &[
        "attn_fwd_d32",
        "attn_fwd_d64",
        "attn_stage_bf16",
        "attn_fwd_st_d32",
        "attn_fwd_st_d64",
        "attn_bwd_dkdv_st_d32",
        "attn_bwd_dkdv_st_d64",
        "attn_bwd_dq_st_d32",
        "attn_bwd_dq_st_d64",
        "attn_bwd_small_d32",
        "attn_bwd_small_d64",
        "attn_fwd_packed_d32",
        "attn_fwd_packed_d64",
        "attn_bwd_small_packed_d32",
        "attn_bwd_small_packed_d64",
        "attn_fwd_tiny_d32",
        "attn_fwd_tiny_d64",
        "attn_bwd_tiny_d32",
        "attn_bwd_tiny_d64",
        "attn_fwd_tiny_packed_d32",
        "attn_fwd_tiny_packed_d64",
        "attn_bwd_tiny_packed_d32",
        "attn_bwd_tiny_packed_d64",
        "attn_bwd_small_packed_bo_d32",
        "attn_bwd_small_packed_bo_d64",
        "attn_bwd_tiny_packed_bo_d32",
        "attn_bwd_tiny_packed_bo_d64",
        "attn_fwd_packed_bi_d32",
        "attn_fwd_packed_bi_d64",
        "attn_fwd_tiny_packed_bi_d32",
        "attn_fwd_tiny_packed_bi_d64",
        "attn_bwd_small_packed_bi_d32",
        "attn_bwd_small_packed_bi_d64",
        "attn_bwd_tiny_packed_bi_d32",
        "attn_bwd_tiny_packed_bi_d64",
        "attn_bwd_small_packed_bi_bo_d32",
        "attn_bwd_small_packed_bi_bo_d64",
        "attn_bwd_tiny_packed_bi_bo_d32",
        "attn_bwd_tiny_packed_bi_bo_d64",
    ];

    /// Sequences up to this long use the attention kernels of 32-row tiles, two heads a CTA
    /// (`attn_*_tiny_*`): half the padding of the 64-row tile and twice the heads an SM.
    const ATTN_TINY_S: usize = 32;
    /// Longer sequences than this (more than one 64-row tile) use the staged kernels
    /// (`attn_*_st_*`): q, k, v (and do) rounded to bf16 once into head-major scratch, tiles
    /// streamed through a cp.async ring, 128 rows a CTA.
    const ATTN_STAGED_S: usize = 64;

    /// The backward's extra operands of `attn_stage_bf16`: do and o (f32 `[B, S, H·Dh]`),
    /// lse, and where D and lse·log2(e) go.
    struct StageGrad {
        d_o: KArg,
        o: KArg,
        lse: KArg,
        d: KArg,
        lb: KArg,
    }

    /// Geometry of an attention node: `[B, S, H·Dh]`.
    struct Attn {
        b: usize,
        s: usize,
        heads: usize,
        dh: usize,
        packed: bool,
    }

    impl Attn {
        /// From q's shape `[B, S, H·Dh]`, or packed q, k, v's `[B, S, 3·H·Dh]`.
        fn new(x: &Shape, heads: usize, packed: bool) -> Result<Self, String> {
            let [b, s, w] = *x.dims() else {
                return Err(format!("q must be [B, S, H·Dh], got {x}"));
            };
            let w = if packed {
                if w % 3 != 0 {
                    return Err(format!("packed q, k, v {x}: last dim is not 3 widths"));
                }
                w / 3
            } else {
                w
            };
            if heads == 0 || w % heads != 0 {
                return Err(format!("width {w} is not a multiple of {heads} heads"));
            }
            let dh = w / heads;
            if dh != 32 && dh != 64 {
                return Err(format!("head dim {dh} has no CUDA kernel (32 and 64 do)"));
            }
            if heads > GRID_YZ || b > GRID_YZ {
                return Err(format!(
                    "{b} batches of {heads} heads need more CTAs than a grid holds"
                ));
            }
            i32_of(3 * s * heads * dh, "3·S·H·Dh")?;
            i32_of(b * heads * s, "B·H·S")?;
            Ok(Attn {
                b,
                s,
                heads,
                dh,
                packed,
            })
        }

        fn empty(&self) -> bool {
            self.b * self.s == 0
        }

        fn tiny(&self) -> bool {
            self.s <= ATTN_TINY_S
        }

        fn staged(&self) -> bool {
            self.s > ATTN_STAGED_S
        }

        /// Query tiles (of 128 rows for the staged kernels, 64 otherwise), heads (two a CTA
        /// for the tiny kernels), batch.
        fn grid(&self) -> [u32; 3] {
            if self.tiny() {
                [1, blocks(self.heads, 2), self.b as u32]
            } else if self.staged() {
                [blocks(self.s, 128), self.heads as u32, self.b as u32]
            } else {
                [blocks(self.s, 64), self.heads as u32, self.b as u32]
            }
        }

        /// Bytes of one bf16 head-major copy `[B, H, S, Dh]` of q, k, v or do.
        fn bf16_bytes(&self) -> usize {
            self.b * self.heads * self.s * self.dh * 2
        }

        /// `attn_stage_bf16` of q, k, v (the node's operands from `qkv`, see [`Attn::three`])
        /// into scratch buffers `first ..`; with `grad`, also do into the next one, and the
        /// backward's D and lse·log2(e) where `grad` says.
        fn stage(&self, qkv: [KArg; 3], grad: Option<StageGrad>, first: usize) -> KernelCall {
            let n = self.b * self.s * self.heads * self.dh;
            let tensors = if grad.is_some() { 4 } else { 3 };
            let [q, k, v] = qkv;
            // the forward's stage reads and writes nothing of the fourth tensor's arguments:
            // they repeat q and its copy
            let g = grad.unwrap_or(StageGrad {
                d_o: q,
                o: q,
                lse: q,
                d: KArg::Scratch(first),
                lb: KArg::Scratch(first),
            });
            let mut args = vec![q, k, v, g.d_o];
            args.extend((0..tensors).map(|i| KArg::Scratch(first + i)));
            if tensors == 3 {
                args.push(KArg::Scratch(first));
            }
            args.extend([
                g.o,
                g.lse,
                g.d,
                g.lb,
                // q, k and v's rows are as far apart as the gradients'
                self.ldo(),
                KArg::I32(self.b as i32),
                KArg::I32(self.s as i32),
                KArg::I32(self.heads as i32),
                KArg::I32(self.dh as i32),
            ]);
            KernelCall {
                kernel: "attn_stage_bf16",
                grid: [blocks(n.div_ceil(4), 256), tensors as u32, 1],
                block: [256, 1, 1],
                smem: 0,
                args,
            }
        }

        /// The staged kernels' output stride (and the stage's input stride): H·Dh, or 3·H·Dh
        /// into a packed tensor.
        fn ldo(&self) -> KArg {
            let w = self.heads * self.dh;
            KArg::I32((if self.packed { 3 * w } else { w }) as i32)
        }

        /// The kernels' trailing arguments: S, H, causal, scale.
        fn tail(&self, causal: bool) -> [KArg; 4] {
            [
                KArg::I32(self.s as i32),
                KArg::I32(self.heads as i32),
                KArg::I32(i32::from(causal)),
                KArg::F32((1.0 / (self.dh as f64).sqrt()) as f32),
            ]
        }

        /// q, k and v (or dq, dk, dv) for the kernels: three tensors from operand `first` on,
        /// or pointers 0, H·Dh and 2·H·Dh floats into the one packed operand `first`.
        fn three(
            &self,
            arg: fn(usize) -> KArg,
            at: fn(usize, u64) -> KArg,
            first: usize,
        ) -> [KArg; 3] {
            self.three_of(arg, at, first, 4)
        }

        /// [`Attn::three`] for elements of `size` bytes.
        fn three_of(
            &self,
            arg: fn(usize) -> KArg,
            at: fn(usize, u64) -> KArg,
            first: usize,
            size: usize,
        ) -> [KArg; 3] {
            if self.packed {
                let w = (self.heads * self.dh * size) as u64;
                [arg(first), at(first, w), at(first, 2 * w)]
            } else {
                [arg(first), arg(first + 1), arg(first + 2)]
            }
        }

        /// The kernel `{stem}[_packed]_d{Dh}`.
        fn kernel(&self, stem: &str) -> Result<&'static str, String> {
            self.kernel_d(&format!(
                "{stem}{}",
                if self.packed { "_packed" } else { "" }
            ))
        }

        /// The kernel `{stem}_d{Dh}` (the staged kernels: one form for packed and not).
        fn kernel_d(&self, stem: &str) -> Result<&'static str, String> {
            let name = format!("{stem}_d{}", self.dh);
            KERNELS
                .iter()
                .copied()
                .find(|k| *k == name)
                .ok_or_else(|| format!("no attention kernel {name}"))
        }

        /// A launch of the staged kernel `{stem}_d{Dh}`: 256 threads, grid [`Attn::grid`].
        fn staged_call(&self, stem: &str, args: Vec<KArg>) -> Result<KernelCall, String> {
            Ok(KernelCall {
                kernel: self.kernel_d(stem)?,
                grid: self.grid(),
                block: [256, 1, 1],
                smem: 0,
                args,
            })
        }
    }

    fn same_shapes(o: &Operands, idx: &[usize], what: &str) -> Result<(), String> {
        let first = o.ins[idx[0]];
        match idx.iter().find(|&&i| o.ins[i] != first) {
            Some(&i) => Err(format!(
                "{what}: input {i} is {}, input {} is {first}",
                o.ins[i], idx[0]
            )),
            None => Ok(()),
        }
    }

    /// `[q, k, v] -> [o, lse]`, or packed `[qkv] -> [o, lse]`.
    pub(crate) fn attention(
        o: &Operands,
        heads: usize,
        causal: bool,
        packed: bool,
    ) -> Result<CudaPlan, String> {
        // a packed qkv in bf16 (its projection stored it so): the fused kernels' `_bi` forms
        let bf16_in = packed && o.in_dtypes == [DType::Bf16];
        if packed {
            let checked = Operands {
                in_dtypes: if bf16_in { &[DType::F32] } else { o.in_dtypes },
                ..*o
            };
            check_f32(&checked, 1, 2)?;
        } else {
            check_f32(o, 3, 2)?;
            same_shapes(o, &[0, 1, 2], "q, k and v differ")?;
        }
        let a = Attn::new(o.ins[0], heads, packed)?;
        if a.empty() {
            return Ok(CudaPlan::default());
        }
        if bf16_in && a.staged() {
            return Err(format!(
                "a bf16 q, k, v needs a sequence of at most {ATTN_STAGED_S}, got {}",
                a.s
            ));
        }
        if a.staged() {
            let mut args: Vec<KArg> = (0..3).map(KArg::Scratch).collect();
            args.extend([KArg::Out(0), KArg::Out(1)]);
            args.extend(a.tail(causal));
            return Ok(CudaPlan {
                calls: vec![
                    a.stage(a.three(KArg::In, KArg::InAt, 0), None, 0),
                    a.staged_call("attn_fwd_st", args)?,
                ],
                scratch: vec![a.bf16_bytes(); 3],
            });
        }
        let mut args = a
            .three_of(KArg::In, KArg::InAt, 0, if bf16_in { 2 } else { 4 })
            .to_vec();
        args.extend([KArg::Out(0), KArg::Out(1)]);
        args.extend(a.tail(causal));
        let stem = if a.tiny() {
            "attn_fwd_tiny"
        } else {
            "attn_fwd"
        };
        let kernel = if bf16_in {
            a.kernel_d(&format!("{stem}_packed_bi"))?
        } else {
            a.kernel(stem)?
        };
        Ok(CudaPlan {
            calls: vec![KernelCall {
                kernel,
                grid: a.grid(),
                block: [128, 1, 1],
                smem: 0,
                args,
            }],
            scratch: vec![],
        })
    }

    /// `[do, q, k, v, o, lse] -> [dq, dk, dv]` (packed: `[do, qkv, o, lse] -> [dqkv]`, dqkv
    /// f32 or bf16): for S ≤ 64 one fused kernel; else `attn_stage_bf16` (q, k, v, do to bf16
    /// scratch, with D = rowsum(bf16(do)∘o)), then dk/dv by key tile and dq by query tile (a
    /// bf16 dqkv: into f32 scratch, then cast).
    pub(crate) fn attention_grad(
        o: &Operands,
        heads: usize,
        causal: bool,
        packed: bool,
    ) -> Result<CudaPlan, String> {
        // a packed dqkv in bf16: the projection's GEMMs read it (see the autodiff rule)
        let bf16_out = packed && o.out_dtypes == [DType::Bf16];
        // a packed qkv in bf16 (its projection stored it so): the fused kernels' `_bi` forms
        let bf16_in = packed && o.in_dtypes.get(1) == Some(&DType::Bf16);
        // (the other inputs f32, as check_f32 sees them with qkv's type set aside)
        let mut in_dtypes = o.in_dtypes.to_vec();
        if bf16_in {
            in_dtypes[1] = DType::F32;
        }
        // input positions of o and lse
        let (io, il) = if packed {
            check_f32(
                &Operands {
                    out_dtypes: if bf16_out {
                        &[DType::F32]
                    } else {
                        o.out_dtypes
                    },
                    in_dtypes: &in_dtypes,
                    ..*o
                },
                4,
                1,
            )?;
            if o.ins[0] != o.ins[2] {
                return Err(format!("do {} and o {} differ", o.ins[0], o.ins[2]));
            }
            (2, 3)
        } else {
            check_f32(o, 6, 3)?;
            same_shapes(o, &[0, 1, 2, 3, 4], "do, q, k, v and o differ")?;
            (4, 5)
        };
        let a = Attn::new(o.ins[1], heads, packed)?;
        if o.ins[il].numel() != a.b * a.heads * a.s {
            return Err(format!(
                "lse {} is not [B, H, S] = [{}, {}, {}]",
                o.ins[il], a.b, a.heads, a.s
            ));
        }
        if a.empty() {
            return Ok(CudaPlan::default());
        }
        if bf16_in && a.staged() {
            return Err(format!(
                "a bf16 q, k, v needs a sequence of at most {ATTN_STAGED_S}, got {}",
                a.s
            ));
        }
        let qkv = a.three_of(KArg::In, KArg::InAt, 1, if bf16_in { 2 } else { 4 });
        if !a.staged() {
            // one tile of queries and keys: D, dk, dv and dq in one CTA per (batch, head)
            let [dq, dk, dv] = a.three_of(KArg::Out, KArg::OutAt, 0, if bf16_out { 2 } else { 4 });
            let mut args = vec![KArg::In(0)];
            args.extend(qkv);
            args.extend([KArg::In(io), KArg::In(il), dq, dk, dv]);
            args.extend(a.tail(causal));
            let stem = if a.tiny() {
                "attn_bwd_tiny"
            } else {
                "attn_bwd_small"
            };
            let kernel = match (bf16_in, bf16_out) {
                (true, true) => a.kernel_d(&format!("{stem}_packed_bi_bo"))?,
                (true, false) => a.kernel_d(&format!("{stem}_packed_bi"))?,
                (false, true) => a.kernel_d(&format!("{stem}_packed_bo"))?,
                (false, false) => a.kernel(stem)?,
            };
            return Ok(CudaPlan {
                calls: vec![KernelCall {
                    kernel,
                    grid: a.grid(),
                    block: [128, 1, 1],
                    smem: 0,
                    args,
                }],
                scratch: vec![],
            });
        }
        // S > 64: bf16 head-major copies of q, k, v and do into scratch 2 ..= 5, with
        // D = rowsum(bf16(do)∘o) into scratch 0 and lse·log2(e) into scratch 1; then dk, dv
        // by key tiles and dq by query tiles
        let rows = a.b * a.heads * a.s;
        let stage = a.stage(
            qkv,
            Some(StageGrad {
                d_o: KArg::In(0),
                o: KArg::In(io),
                lse: KArg::In(il),
                d: KArg::Scratch(0),
                lb: KArg::Scratch(1),
            }),
            2,
        );
        // do, q, k, v (bf16), lse·log2(e), D
        let ins = [
            KArg::Scratch(5),
            KArg::Scratch(2),
            KArg::Scratch(3),
            KArg::Scratch(4),
            KArg::Scratch(1),
            KArg::Scratch(0),
        ];
        // dq, dk, dv: the output, or for a bf16 dqkv f32 scratch 6 (the compute dwarfs the
        // cast after it at these lengths)
        let [dq, dk, dv] = if bf16_out {
            a.three(KArg::Scratch, KArg::ScratchAt, 6)
        } else {
            a.three(KArg::Out, KArg::OutAt, 0)
        };
        let mut dkdv_args = ins.to_vec();
        dkdv_args.extend([dk, dv, a.ldo()]);
        dkdv_args.extend(a.tail(causal));
        let mut dq_args = ins.to_vec();
        dq_args.extend([dq, a.ldo()]);
        dq_args.extend(a.tail(causal));
        let mut scratch = vec![rows * 4; 2];
        scratch.extend([a.bf16_bytes(); 4]);
        let mut calls = vec![
            stage,
            a.staged_call("attn_bwd_dkdv_st", dkdv_args)?,
            a.staged_call("attn_bwd_dq_st", dq_args)?,
        ];
        if bf16_out {
            let n = o.outs[0].numel();
            scratch.push(n * 4);
            calls.push(crate::cuda::elementwise::cast_f32_bf16_call(
                KArg::Scratch(6),
                KArg::Out(0),
                n,
            ));
        }
        Ok(CudaPlan { calls, scratch })
    }
}

// ---- the cost estimate ----
pub(crate) mod cost {
    use crate::launch::{ceil, Cost, LaunchSpec};

    /// The forward (`bwd` false: q is input 0) or the backward (q is input 1). A causal
    /// mask skips the 64 x 64 blocks above the diagonal: about half the work.
    pub(crate) fn attention(
        c: &Cost,
        heads: usize,
        packed: bool,
        causal: bool,
        bwd: bool,
    ) -> LaunchSpec {
        let d = c.ins[usize::from(bwd)].dims();
        let (b, s) = (d[0], d[1]);
        let w = if packed { d[2] / 3 } else { d[2] };
        let dh = w / heads;
        let blocks = s.div_ceil(64) as f64;
        let share = if causal {
            (blocks + 1.0) / (2.0 * blocks)
        } else {
            1.0
        };
        let fwd = share * 4.0 * (b * heads * s * s * dh) as f64;
        LaunchSpec {
            kernel: if bwd {
                "attention_bwd"
            } else {
                "attention_fwd"
            },
            grid: (b * heads) as u64 * ceil(s, 64),
            block: 128,
            regs_per_thread: if bwd { 168 } else { 128 },
            smem_bytes: (if bwd { 4 } else { 3 } * 64 * dh.max(32) * 2) as u32,
            flops: if bwd { 2.5 * fwd } else { fwd },
            bytes: c.moved(),
            tensor_core: true,
            copies: false,
            attention: true,
            extra_launches: 0,
        }
    }
}
