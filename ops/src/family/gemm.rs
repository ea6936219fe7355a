//! GEMM-shaped ops: `Linear`, `LinearAdd`, `LinearMulAdd`, `LinearGradInput`, `LinearGradWeight`, `MatMul` and the bf16 operand copies (`RoundBf16`).
//!
//! Everything of the family in one place: the CPU reference (`cpu`, what every CUDA
//! kernel is tested against), the CUDA launch plans (`cuda`) and the cost estimate the
//! scheduler reads (`cost`).

// ---- the CPU reference ----
pub mod cpu {
    //! The CPU reference of the gemm ops: linear layers, their gradients and matmul; a
    //! linear layer with a residual; the bf16 copy of an operand.

    use crate::cpu::*;

    /// The gemm ops' storage forms: a linear layer or its data gradient with its output's
    /// bf16 copy beside it; a linear layer stored in bf16 (`Graph::linear_for_attention`:
    /// the f32 output rounded); bf16 operands (copies, or an
    /// activation stored in bf16) read as their f32 values. `None` for the plain forms.
    pub(crate) fn exec_stored(
        call: &NodeCall,
        ins: &[&Buffer],
        outs: &mut [Buffer],
        upd: &mut [Buffer],
    ) -> Option<Result<(), OpError>> {
        let linear = matches!(call.op, Op::Linear { .. });
        let grad_input = matches!(call.op, Op::LinearGradInput { .. });
        let grad_weight = matches!(call.op, Op::LinearGradWeight { .. });
        if (linear || grad_input) && copy_last(outs, 2) {
            Some(with_copy(call, ins, outs, upd, 1))
        } else if linear && copy_last(outs, 1) {
            Some(rounded(call, ins, outs, upd))
        } else if (linear || grad_input || grad_weight) && any_bf16(ins) {
            Some(widened(call, ins, outs, upd))
        } else {
            None
        }
    }

    /// `RoundBf16`: the bf16 copy of an f32 operand (nearest even), and with `col_sums`
    /// its column sums (a linear layer's bias gradient, from the f32 values) beside it.
    pub(crate) fn exec_round_bf16(
        ins: &[&Buffer],
        outs: &mut [Buffer],
        col_sums: bool,
    ) -> Result<(), String> {
        let [x] = ins else {
            return Err("expected one input".into());
        };
        let first = outs.first_mut().ok_or("expected an output: the copy")?;
        *first = cast(x, DType::Bf16);
        if col_sums {
            let [_, s] = outs else {
                return Err("expected two outputs: the copy and the sums".into());
            };
            kernels::sum_to_shape(get::<f32>(x, "x")?, out(s)?);
        }
        Ok(())
    }

    /// The layer of a fused linear op (`LinearAdd`, `LinearMulAdd`): `Linear { bias }` of
    /// its first `2 + bias` inputs into its output 0, as `Linear` computes and stores it.
    fn exec_layer(
        call: &NodeCall,
        ins: &[&Buffer],
        outs: &mut [Buffer],
        upd: &mut [Buffer],
        bias: bool,
    ) -> Result<(), OpError> {
        let n = 2 + usize::from(bias);
        let linear = Op::Linear { bias, relu: false };
        let layer = NodeCall {
            op: &linear,
            in_shapes: call.in_shapes[..n].to_vec(),
            ..call.first_outputs(1)
        };
        execute(&layer, &ins[..n], outs, upd)
    }

    /// `LinearAdd`: the layer, then the residual (its last input) added to its output, as
    /// `Linear` then `Add` compute them (each through [`execute`]).
    pub(crate) fn exec_linear_add(
        call: &NodeCall,
        ins: &[&Buffer],
        outs: &mut [Buffer],
        upd: &mut [Buffer],
        bias: bool,
    ) -> Result<(), OpError> {
        let n = 2 + usize::from(bias);
        let (Some(r), Some(&r_shape)) = (ins.get(n), call.in_shapes.get(n)) else {
            return Err(call.error(format!("expected {} inputs", n + 1)));
        };
        exec_layer(call, ins, outs, upd, bias)?;
        let y = outs
            .first()
            .ok_or_else(|| call.error("expected an output".into()))?
            .clone();
        let add = NodeCall {
            op: &Op::Add,
            in_shapes: vec![call.out_shapes[0], r_shape],
            ..call.first_outputs(1)
        };
        execute(&add, &[&y, r], outs, upd)
    }

    /// `LinearMulAdd`: the layer into its output 0 (as `Linear` stores it), then the
    /// cross update `a ⊙ y + c` of that stored output into the others (as `MulAdd` writes
    /// them, with its bf16 copy where there is one).
    pub(crate) fn exec_linear_mul_add(
        call: &NodeCall,
        ins: &[&Buffer],
        outs: &mut [Buffer],
        upd: &mut [Buffer],
        bias: bool,
    ) -> Result<(), OpError> {
        let n = 2 + usize::from(bias);
        if ins.len() != n + 2 || call.in_shapes.len() != n + 2 {
            return Err(call.error(format!("expected {} inputs", n + 2)));
        }
        if !(2..=3).contains(&outs.len()) || call.out_shapes.len() != outs.len() {
            return Err(call.error("expected 2 or 3 outputs".into()));
        }
        exec_layer(call, ins, &mut outs[..1], upd, bias)?;
        let y = outs[0].clone();
        let update = NodeCall {
            op: &Op::MulAdd,
            name: call.name,
            in_shapes: vec![call.in_shapes[n], call.out_shapes[0], call.in_shapes[n + 1]],
            out_shapes: call.out_shapes[1..].to_vec(),
            bf16_gemm: call.bf16_gemm,
        };
        execute(&update, &[ins[n], &y, ins[n + 1]], &mut outs[1..], upd)
    }

    /// Linear layers, their gradients and matmul.
    pub(crate) fn exec_gemm<T: Elem>(
        call: &NodeCall,
        ins: &[&Buffer],
        outs: &mut [Buffer],
        _upd: &mut [Buffer],
    ) -> Result<(), String> {
        let ish = |i: usize| call.in_shapes[i];
        let osh = |i: usize| call.out_shapes[i];
        match call.op {
            Op::Linear { bias, relu } => {
                let (x, w) = (get::<T>(ins[0], "input")?, get::<T>(ins[1], "weight")?);
                let b = if *bias {
                    Some(get::<T>(ins[2], "bias")?)
                } else {
                    None
                };
                let (n, k) = (ish(1).dims()[0], ish(1).dims()[1]);
                let y = out(&mut outs[0])?;
                kernels::linear(x, w, b, y, ish(0).rows(), k, n);
                if *relu {
                    // as the Relu op (and the GEMM epilogue's fmaxf): x if x > 0, else 0
                    y.iter_mut().for_each(|v| {
                        *v = if *v > T::ZERO { *v } else { T::ZERO };
                    });
                }
            }
            Op::LinearGradInput {
                relu_mask,
                residual,
            } => {
                let (dy, w) = (get::<T>(ins[0], "dy")?, get::<T>(ins[1], "weight")?);
                let (n, k) = (ish(1).dims()[0], ish(1).dims()[1]);
                let dx = out(&mut outs[0])?;
                kernels::linear_grad_input(dy, w, dx, ish(0).rows(), k, n);
                if *relu_mask {
                    // as ReluGrad on the product: dx where y > 0, else 0
                    let y = get::<T>(ins[2], "y")?;
                    if y.len() != dx.len() {
                        return Err(format!("y has {} elements, dx {}", y.len(), dx.len()));
                    }
                    for (d, &v) in dx.iter_mut().zip(y) {
                        *d = if v > T::ZERO { *d } else { T::ZERO };
                    }
                }
                if *residual {
                    // as Add (GradSum of two) after the product
                    let r = get::<T>(ins[2 + usize::from(*relu_mask)], "residual")?;
                    if r.len() != dx.len() {
                        return Err(format!(
                            "the residual has {} elements, dx {}",
                            r.len(),
                            dx.len()
                        ));
                    }
                    for (d, &v) in dx.iter_mut().zip(r) {
                        *d += v;
                    }
                }
            }
            Op::LinearGradWeight { .. } => {
                // db (with `bias`) is summed in exec_typed from the unrounded dy
                let (dy, x) = (get::<T>(ins[0], "dy")?, get::<T>(ins[1], "input")?);
                let (n, k) = (osh(0).dims()[0], osh(0).dims()[1]);
                kernels::linear_grad_weight(dy, x, out(&mut outs[0])?, ish(0).rows(), k, n);
            }
            Op::MatMul { ta, tb } => {
                let (a, b) = (get::<T>(ins[0], "a")?, get::<T>(ins[1], "b")?);
                let (da, db) = (ish(0).dims(), ish(1).dims());
                let r = da.len();
                let batch = if r == 3 { da[0] } else { 1 };
                kernels::matmul(
                    a,
                    b,
                    out(&mut outs[0])?,
                    batch,
                    (da[r - 2], da[r - 1]),
                    (db[r - 2], db[r - 1]),
                    *ta,
                    *tb,
                );
            }
            other => return Err(format!("gemm: no CPU implementation of {}", other.name())),
        }
        Ok(())
    }
}

// ---- the CUDA launch plans ----
pub(crate) mod cuda {
    //! GEMM-shaped ops: linear and its gradients, matmul, and the bf16 operand copies.
    //!
    //! GEMMs of at least `PlanOptions::gemm_pipe_min_flops` (2^29) FLOPs with K ≥ 64 and
    //! M, N ≥ 128 take the pipelined path: `gemm_to_bf16_pair`
    //! rounds A and B to bf16 into K-major, zero-padded scratch in one launch (transposing an
    //! operand whose K is not its inner dim; for a weight gradient with a bias it also sums
    //! dy's columns over each 64-row block, so the bias gradient costs no pass over dy of its
    //! own), then `gemm_bf16p_<tile>` multiplies them
    //! (wgmma on sm_90a, mma.sync on sm_80; a cp.async ring in dynamic shared memory), the
    //! tile and split count from a wave model of the H200. Tall GEMMs (at least 33792 rows,
    //! N ≤ 256, small K, A not transposed: AutoInt's projections) run `gemm_tall_n<N>`,
    //! persistent CTAs that keep op(B) in shared memory and load the next block of rows
    //! while storing this one. Smaller GEMMs run
    //! `gemm_bf16_<layout>_<tile>` in one launch, rounding as they load: layout
    //! `nn`/`nt`/`tn`/`tt` says which operand is stored transposed (MatMul's `ta`, `tb` on
    //! row-major storage), the tile is 128x128 when the output fills a wave of them, else
    //! 64x64. When the output has too few tiles to fill the GPU and K is long
    //! (LinearGradWeight reduces over all rows), either path splits K over the grid's z (a
    //! split of the single-launch kernels gets at least 256 k, or 64 where the output has
    //! at most `FEW_TILES` 64x64 tiles: a narrow layer's weight gradient): each
    //! split writes an f32 partial to scratch and `gemm_splitk_reduce` sums them in split
    //! order, so the result is deterministic; the pipelined 128x128 tile at batch 1 sums its
    //! 2, 4 or 8 splits inside a thread-block cluster instead (`gemm_bf16p_128x128_k<S>`:
    //! the same fixed order, no partials in memory, no reduction launch).
    //! Where `PlanOptions::gemm_ws` (sm_90a, off by default), the wave model may also take
    //! the warp-specialized 128x64 tile (`gemm_bf16w_*`: a loader warpgroup and two wgmma
    //! warpgroups meeting on mbarriers, two CTAs an SM), the same arguments and layouts.
    //! Where `PlanOptions::gemm_tma` (sm_90a, on by default), a pipelined GEMM of batch 1
    //! whose C one launch writes whole runs the TMA form, `gemm_bf16t_*` (the operands as
    //! descriptors, one thread issuing each stage); with `gemm_tma_n64` the wave model may
    //! also take its own 128x64 tile, for outputs whose 128x128 grid leaves SMs idle.
    //! A bf16 dy beside an f32 operand (AutoInt's dqkv, which its attention gradient writes
    //! in bf16) is read as it is: by the pipelined kernels where they take it, else by the
    //! tall kernels' and the single-launch kernels' `_a16` forms.

    use crate::cuda::common::i32_of;
    use crate::cuda::{blocks, CudaPlan, KArg, KernelCall, Operands, PlanOptions};
    use erase_graph::{DType, Shape};

    /// Helper passes around a GEMM (operand rounding, split-K reduction): not the
    /// launch the cost model sizes the op by.
    pub(crate) const HELPERS: &[&str] = &[
        "gemm_to_bf16",
        "gemm_to_bf16_t",
        "gemm_to_bf16_pair",
        "gemm_splitk_reduce",
    ];

    /// Kernels these plans launch.
    pub(crate) const KERNELS: &[&str] = &[
        "gemm_bf16_nn_128x128",
        "gemm_bf16_nn_64x64",
        "gemm_bf16_nt_128x128",
        "gemm_bf16_nt_64x64",
        "gemm_bf16_tn_128x128",
        "gemm_bf16_tn_64x64",
        "gemm_bf16_tt_128x128",
        "gemm_bf16_tt_64x64",
        "gemm_bf16p_128x128",
        "gemm_bf16p_128x256",
        "gemm_bf16p_128x128_k2",
        "gemm_bf16p_128x128_k4",
        "gemm_bf16p_128x128_k8",
        "gemm_bf16p_128x256_k2",
        "gemm_bf16p_128x256_k4",
        "gemm_bf16p_128x256_k8",
        "gemm_bf16p_mm_128x128",
        "gemm_bf16p_mm_128x256",
        "gemm_bf16p_mm_128x128_k2",
        "gemm_bf16p_mm_128x128_k4",
        "gemm_bf16p_mm_128x128_k8",
        "gemm_bf16p_mm_128x256_k2",
        "gemm_bf16p_mm_128x256_k4",
        "gemm_bf16p_mm_128x256_k8",
        "gemm_bf16p_km_128x128",
        "gemm_bf16p_km_128x256",
        "gemm_bf16p_km_128x128_k2",
        "gemm_bf16p_km_128x128_k4",
        "gemm_bf16p_km_128x128_k8",
        "gemm_bf16p_km_128x256_k2",
        "gemm_bf16p_km_128x256_k4",
        "gemm_bf16p_km_128x256_k8",
        "gemm_bf16p_c_128x128",
        "gemm_bf16p_c_128x256",
        "gemm_bf16p_c_128x128_k2",
        "gemm_bf16p_c_128x128_k4",
        "gemm_bf16p_c_128x128_k8",
        "gemm_bf16p_c_128x256_k2",
        "gemm_bf16p_c_128x256_k4",
        "gemm_bf16p_c_128x256_k8",
        "gemm_bf16p_kmc_128x128",
        "gemm_bf16p_kmc_128x256",
        "gemm_bf16p_kmc_128x128_k2",
        "gemm_bf16p_kmc_128x128_k4",
        "gemm_bf16p_kmc_128x128_k8",
        "gemm_bf16p_kmc_128x256_k2",
        "gemm_bf16p_kmc_128x256_k4",
        "gemm_bf16p_kmc_128x256_k8",
        "gemm_round_colsum",
        "gemm_tall_n64",
        "gemm_tall_n128",
        "gemm_tall_n192",
        "gemm_tall_n256",
        "gemm_tall_n64_c",
        "gemm_tall_n128_c",
        "gemm_tall_n192_c",
        "gemm_tall_n256_c",
        "gemm_to_bf16",
        "gemm_to_bf16_t",
        "gemm_to_bf16_pair",
        "gemm_splitk_reduce",
        "gemm_bf16_nn_128x128_a16",
        "gemm_bf16_nn_64x64_a16",
        "gemm_bf16_tn_128x128_a16",
        "gemm_bf16_tn_64x64_a16",
        "gemm_tall_n64_c_a16",
        "gemm_tall_n128_c_a16",
        "gemm_tall_n192_c_a16",
        "gemm_tall_n256_c_a16",
        "gemm_tall_n64_c_bo",
        "gemm_tall_n128_c_bo",
        "gemm_tall_n192_c_bo",
        "gemm_tall_n256_c_bo",
        "gemm_thin_n1",
        "gemm_thin_k1",
        "gemm_thin_m1",
    ];

    /// The GEMM kernels' k step; a split's K range is a multiple of it.
    const BK: usize = 32;
    /// Grid dimensions y and z are limited to this.
    pub(crate) const GRID_YZ: usize = 65_535;

    /// [`check_f32`], except that the inputs in `bf16_ok` may also be bf16 (RoundBf16 copies
    /// of GEMM operands). Returns which inputs are.
    fn check_gemm_operands(
        o: &Operands,
        ins: usize,
        outs: usize,
        bf16_ok: &[usize],
    ) -> Result<Vec<bool>, String> {
        if o.ins.len() != ins || o.outs.len() != outs {
            return Err(format!(
                "expected {ins} inputs and {outs} outputs, got {} and {}",
                o.ins.len(),
                o.outs.len()
            ));
        }
        let mut bf16 = vec![false; ins];
        for (i, d) in o.in_dtypes.iter().enumerate() {
            match d {
                DType::F32 => {}
                DType::Bf16 if bf16_ok.contains(&i) => bf16[i] = true,
                d => {
                    return Err(format!(
                        "input {i}: the CUDA kernel reads f32 here, not {d}"
                    ))
                }
            }
        }
        for (i, d) in o.out_dtypes.iter().enumerate() {
            // output 1 of a Linear or a LinearGradInput with two: the bf16 copy of output 0
            let copy = i == 1 && o.outs.len() == 2 && o.outs[1] == o.outs[0];
            if *d != DType::F32 && !(copy && *d == DType::Bf16) {
                return Err(format!(
                    "output {i}: the CUDA kernel writes f32 here, not {d}"
                ));
            }
        }
        Ok(bf16)
    }

    pub(crate) fn check_f32(o: &Operands, ins: usize, outs: usize) -> Result<(), String> {
        if o.ins.len() != ins || o.outs.len() != outs {
            return Err(format!(
                "expected {ins} inputs and {outs} outputs, got {} and {}",
                o.ins.len(),
                o.outs.len()
            ));
        }
        match o
            .in_dtypes
            .iter()
            .chain(o.out_dtypes)
            .find(|d| **d != DType::F32)
        {
            Some(d) => Err(format!("the CUDA kernel computes f32 tensors, not {d}")),
            None => Ok(()),
        }
    }

    fn i64_of(v: usize) -> KArg {
        KArg::I64(v as i64)
    }

    /// One (batched) GEMM `C = op(A)·op(B)` (+ bias) over row-major operands.
    #[derive(Clone, Copy)]
    struct Gemm {
        ta: bool,
        tb: bool,
        batch: usize,
        m: usize,
        n: usize,
        k: usize,
        a: KArg,
        b: KArg,
        bias: Option<KArg>,
        /// ReLU in the epilogue (after the bias; after the split-K sum).
        relu: bool,
        /// The ReLU gradient's mask in the epilogue: C ⊙ (y > 0), `y` of C's shape (batch 1).
        mask: Option<KArg>,
        /// Where the sums of op(A)'s rows over K go (a weight gradient's bias gradient),
        /// for a transposed A of batch 1: the pipelined path sums them while rounding A, the
        /// single-launch kernels while staging A's tiles; see [`linear_grad_weight`].
        a_row_sums: Option<KArg>,
        lda: usize,
        ldb: usize,
        batch_a: usize,
        batch_b: usize,
        /// The operand is a bf16 tensor (a RoundBf16 copy) read in place by the pipelined
        /// kernels: K-major (A[m·lda + k], B[n·ldb + k]) where `ta` / `tb` say so (A not
        /// transposed, B transposed), else MN-major.
        a_bf16: bool,
        b_bf16: bool,
        /// Where C's bf16 copy goes (a Linear whose output a later GEMM reads, see
        /// `Graph::copy_output`, or a data gradient that is a copied layer's dy): written by
        /// the epilogue of a `_c` or `_kmc` pipelined kernel, else by a cast launch after the
        /// GEMM.
        copy: Option<KArg>,
        /// A residual of C's layout added after the bias (LinearAdd, or a LinearGradInput
        /// summed with x's other gradient contribution): by the tall kernels' store, by the
        /// pipelined kernels' epilogue (read through `bias`, flags & 16) where the GEMM has no
        /// bias, mask or split-K partials, else by an add launch after the GEMM (which then
        /// writes to scratch).
        residual: Option<KArg>,
        /// C itself is bf16 (a linear layer stored in bf16, `Graph::linear_for_attention`):
        /// the tall kernels' `_c_bo` form stores it so, any other path writes f32 C to
        /// scratch and casts it after the GEMM.
        out_bf16: bool,
        /// The paths and the device the plan is for.
        opts: PlanOptions,
    }

    impl Gemm {
        /// The epilogue flags of the kernels: bit 0 adds the bias, bit 1 applies ReLU.
        fn flags(&self) -> i32 {
            i32::from(self.bias.is_some())
                | (i32::from(self.relu) << 1)
                | (i32::from(self.mask.is_some()) << 3)
        }

        /// The kernels' `bias` argument: the bias, or the mask (a GEMM has at most one),
        /// or any valid pointer.
        fn bias_arg(&self) -> KArg {
            self.bias.or(self.mask).unwrap_or(self.a)
        }

        /// The single-launch kernels' flag for op(A)'s row sums (bit 2).
        fn sums_flag(&self) -> i32 {
            i32::from(self.a_row_sums.is_some()) << 2
        }
    }

    fn gemm_kernel(ta: bool, tb: bool, big: bool) -> &'static str {
        match (ta, tb, big) {
            (false, false, true) => "gemm_bf16_nn_128x128",
            (false, false, false) => "gemm_bf16_nn_64x64",
            (false, true, true) => "gemm_bf16_nt_128x128",
            (false, true, false) => "gemm_bf16_nt_64x64",
            (true, false, true) => "gemm_bf16_tn_128x128",
            (true, false, false) => "gemm_bf16_tn_64x64",
            (true, true, true) => "gemm_bf16_tt_128x128",
            (true, true, false) => "gemm_bf16_tt_64x64",
        }
    }

    /// The single-launch kernel reading a bf16 A (LinearGradInput's and LinearGradWeight's
    /// layouts).
    fn gemm_kernel_a16(ta: bool, tb: bool, big: bool) -> Option<&'static str> {
        match (ta, tb, big) {
            (false, false, true) => Some("gemm_bf16_nn_128x128_a16"),
            (false, false, false) => Some("gemm_bf16_nn_64x64_a16"),
            (true, false, true) => Some("gemm_bf16_tn_128x128_a16"),
            (true, false, false) => Some("gemm_bf16_tn_64x64_a16"),
            _ => None,
        }
    }

    /// Points the plan's launches at a new f32 scratch buffer of C's size instead of the
    /// output (for a launch after them to finish C from it); returns it and C's elements.
    fn c_to_scratch(plan: &mut CudaPlan, g: &Gemm) -> (KArg, usize) {
        let tmp = KArg::Scratch(plan.scratch.len());
        let count = g.batch * g.m * g.n;
        plan.scratch.push(count * 4);
        for c in &mut plan.calls {
            for a in &mut c.args {
                if *a == KArg::Out(0) {
                    *a = tmp;
                }
            }
        }
        (tmp, count)
    }

    fn gemm(g: Gemm) -> Result<CudaPlan, String> {
        if g.out_bf16 && g.residual.is_none() && g.copy.is_none() && g.mask.is_none() {
            if let Some(plan) = gemm_bf16_only(&g) {
                return Ok(plan);
            }
        }
        let mut plan = gemm_any(&g)?;
        // a bf16 C: the tall kernels' `_bo` form stores it (a launch names Out(0) and is
        // one); any other path writes f32 C to scratch and casts it in a launch of its own
        if g.out_bf16 {
            if g.residual.is_some() || g.copy.is_some() || g.mask.is_some() {
                return Err("a GEMM stored in bf16 has no residual, copy or mask".into());
            }
            let stored = plan.calls.iter().any(|c| c.kernel.ends_with("_bo"));
            if !stored && !plan.calls.is_empty() {
                let (tmp, count) = c_to_scratch(&mut plan, &g);
                plan.calls
                    .push(crate::cuda::elementwise::cast_f32_bf16_call(
                        tmp,
                        KArg::Out(0),
                        count,
                    ));
            }
            return Ok(plan);
        }
        // the residual: the tall kernels add it as they store C (a launch names it); any
        // other path writes C to scratch and adds it in a launch of its own
        if let Some(r) = g.residual {
            if g.copy.is_some() {
                return Err("a GEMM with a residual writes no bf16 copy".into());
            }
            if !plan.calls.iter().any(|c| c.args.contains(&r)) {
                let (tmp, count) = c_to_scratch(&mut plan, &g);
                plan.calls.push(crate::cuda::elementwise::add_call(
                    tmp,
                    r,
                    KArg::Out(0),
                    count,
                ));
            }
        }
        // C's bf16 copy: the pipelined kernels write it in their epilogue (one split, or a
        // cluster), any other path casts C after the GEMM
        if let Some(copy) = g.copy {
            // (only a launch that writes the copy names it)
            let written = plan.calls.iter().any(|c| c.args.contains(&copy));
            if !written {
                plan.calls
                    .push(crate::cuda::elementwise::cast_f32_bf16_call(
                        KArg::Out(0),
                        copy,
                        g.batch * g.m * g.n,
                    ));
            }
        }
        Ok(plan)
    }

    /// A bf16 C of bf16 operand copies (Graph::linear_stored_bf16): the pipelined
    /// kernels' copy epilogue stores it alone (flags bit 6: C passed as the copy, no f32
    /// store), where the plan is one such launch writing C whole; else `None` (C to
    /// scratch and a cast, as any bf16 C).
    fn gemm_bf16_only(g: &Gemm) -> Option<CudaPlan> {
        if !(g.a_bf16 && g.b_bf16) {
            return None;
        }
        let plan = gemm_pipe_bf16(&Gemm {
            copy: Some(KArg::Out(0)),
            ..*g
        })
        .ok()?;
        let copy_kernel = |k: &str| k.contains("_c_") || k.contains("_kmc_");
        let writers: Vec<&KernelCall> = plan
            .calls
            .iter()
            .filter(|c| c.args.contains(&KArg::Out(0)))
            .collect();
        (writers.len() == 1 && copy_kernel(writers[0].kernel) && bf16_only_flag(writers[0]))
            .then_some(plan)
    }

    /// Whether a pipelined launch stores its C in bf16 alone (its flags' bit 6).
    fn bf16_only_flag(c: &KernelCall) -> bool {
        // the flags: argument 9 of the TMA kernels, 16 of the cp.async ones
        let at = if c.kernel.starts_with("gemm_bf16t") {
            9
        } else {
            16
        };
        matches!(c.args.get(at), Some(KArg::I32(f)) if f & 64 != 0)
    }

    fn gemm_any(g: &Gemm) -> Result<CudaPlan, String> {
        let g = *g;
        let Gemm { batch, m, n, k, .. } = g;
        if batch * m * n == 0 {
            return Ok(CudaPlan::default());
        }
        // a bf16 A alone (a dy its producer wrote in bf16): the pipelined path where the
        // GEMM is large enough and its kernels can read A as it is (K a multiple of 64, no
        // row sums), else the tall or single-launch kernels read it as it is
        let a16_alone = g.a_bf16 && !g.b_bf16 && gemm_kernel_a16(g.ta, g.tb, false).is_some();
        if a16_alone {
            if pipe_tile(&g).is_some() {
                if let Ok(plan) = gemm_pipe_bf16(&g) {
                    return Ok(plan);
                }
            }
        } else if g.a_bf16 || g.b_bf16 {
            return gemm_pipe_bf16(&g);
        }
        if let Some(plan) = gemm_thin(&g)? {
            return Ok(plan);
        }
        if let Some(plan) = gemm_tall(&g)? {
            return Ok(plan);
        }
        if let Some(t) = pipe_tile(&g).filter(|_| !a16_alone) {
            return gemm_pipe(&g, t);
        }
        let (mi, ni, ki) = (i32_of(m, "M")?, i32_of(n, "N")?, i32_of(k, "K")?);
        // 128x128 tiles when they fill at least one wave of the GPU and K is longer than 128,
        // else 64x64: with a few k steps a CTA is mostly its epilogue, and four 64x64 CTAs an
        // SM overlap one's stores with the others' loads (the CTR model's dx 4096 x 64 x 1728:
        // 29.8 -> 26.8 µs on the H200, the step +0.6 %)
        let big = k > 128
            && m >= 128
            && n >= 128
            && blocks(m, 128) as usize * blocks(n, 128) as usize * batch >= g.opts.sms;
        let (bm, bn, threads) = if big { (128, 128, 256) } else { (64, 64, 128) };
        if blocks(n, bn) as usize > GRID_YZ
            || batch > GRID_YZ
            || batch * m * n / 32 >= i32::MAX as usize
        {
            return Err(format!(
                "a {batch} x [{m}, {n}] output needs more CTAs than a grid holds"
            ));
        }
        // split K when the output tiles leave the GPU idle: a wave is one 128x128 CTA or
        // about four 64x64 CTAs per SM (by their registers); the 128x128 tile is only chosen
        // when it fills a wave, so only the 64x64 tile splits
        let tiles = blocks(m, bm) as usize * blocks(n, bn) as usize * batch;
        let want = if big { g.opts.sms } else { 4 * g.opts.sms };
        let mut splits = 1;
        // (a 128x128 grid fills a wave, so few tiles are 64x64 ones)
        let min_k = if tiles <= crate::cuda::FEW_TILES {
            g.opts.gemm_min_k_per_split_few
        } else {
            g.opts.gemm_min_k_per_split
        }
        .max(1);
        if tiles < want && k >= 2 * min_k {
            splits = want
                .div_ceil(tiles)
                .min(k / min_k)
                .min(GRID_YZ / batch)
                .max(1);
        }
        let k_split = k.div_ceil(splits).div_ceil(BK).max(1) * BK;
        let splits = k.div_ceil(k_split).max(1);
        let flags = g.flags();
        let count = batch * m * n;
        let grid = [blocks(m, bm), blocks(n, bn), (splits * batch) as u32];
        let block = [threads, 1, 1];
        let kernel = if g.a_bf16 {
            gemm_kernel_a16(g.ta, g.tb, big).ok_or_else(|| {
                format!(
                    "a bf16 A with an f32 B has single-launch kernels for dy·w and dyᵀ·x \
                     (A not transposed and B not transposed, or A transposed), not for \
                     ta = {}, tb = {}",
                    g.ta, g.tb
                )
            })?
        } else {
            gemm_kernel(g.ta, g.tb, big)
        };
        if g.a_row_sums.is_some() && (!g.ta || batch != 1) {
            return Err("row sums of op(A) need a transposed A of batch 1".into());
        }
        // op(A)'s row sums: straight to their output with one split, else one partial a
        // split (scratch 1), summed in split order by the reduction launch
        let sums_at = match g.a_row_sums {
            Some(out) if splits == 1 => out,
            Some(_) => KArg::Scratch(1),
            None => g.a,
        };
        let args = |c: KArg, flags: i32| {
            vec![
                g.a,
                g.b,
                c,
                g.bias_arg(),
                KArg::I32(mi),
                KArg::I32(ni),
                KArg::I32(ki),
                i64_of(g.lda),
                i64_of(g.ldb),
                i64_of(n),
                i64_of(g.batch_a),
                i64_of(g.batch_b),
                i64_of(m * n),
                KArg::I32(batch as i32),
                KArg::I32(k_split as i32),
                i64_of(count),
                KArg::I32(flags | g.sums_flag()),
                sums_at,
            ]
        };
        if splits == 1 {
            return Ok(CudaPlan {
                calls: vec![KernelCall {
                    kernel,
                    grid,
                    block,
                    smem: 0,
                    args: args(KArg::Out(0), flags),
                }],
                scratch: vec![],
            });
        }
        // the reduction launch also sums op(A)'s row-sum partials (one per split, scratch 1)
        let reduce = reduce_call(
            &g,
            KArg::Scratch(0),
            splits,
            g.a_row_sums.map(|out| (KArg::Scratch(1), out, splits)),
        );
        let calls = vec![
            KernelCall {
                kernel,
                grid,
                block,
                smem: 0,
                args: args(KArg::Scratch(0), 0),
            },
            reduce,
        ];
        let mut scratch = vec![splits * count * 4];
        if g.a_row_sums.is_some() {
            scratch.push(splits * m * 4);
        }
        Ok(CudaPlan { calls, scratch })
    }

    /// The thin kernels (`gemm_thin_*`, where `PlanOptions::gemm_thin`): a GEMM of f32
    /// operands and batch 1 with N = 1 and A not transposed (a one-output linear layer: a
    /// detached block's loss head), K = 1 (its data gradient, an outer product) or M = 1
    /// with B not transposed (its weight gradient, with the bias gradient as op(A)'s row
    /// sums), at the memory's rate where the tiled kernels compute one useful row or
    /// column of a 64x64 tile. `None`: another path's GEMM.
    fn gemm_thin(g: &Gemm) -> Result<Option<CudaPlan>, String> {
        if !g.opts.gemm_thin || g.batch != 1 || g.a_bf16 || g.b_bf16 || g.out_bf16 {
            return Ok(None);
        }
        let Gemm { m, n, k, .. } = *g;
        // a null pointer (the kernel reads no row sums)
        let none = KArg::I64(0);
        let ptr = |p: Option<KArg>| p.unwrap_or(g.a);
        let flags =
            g.flags() | (i32::from(g.residual.is_some()) << 4) | (i32::from(g.copy.is_some()) << 5);
        // the epilogue's pointers: bias, mask, residual, copy (any valid pointer if unused)
        let epilogue = [ptr(g.bias), ptr(g.mask), ptr(g.residual), ptr(g.copy)];
        let call = |kernel, grid: [u32; 3], block: [u32; 3], args: Vec<KArg>| KernelCall {
            kernel,
            grid,
            block,
            smem: 0,
            args,
        };
        if n == 1 && !g.ta && g.a_row_sums.is_none() {
            let sbk = if g.tb { 1 } else { g.ldb };
            let vec = g.lda.is_multiple_of(4) && k.is_multiple_of(4) && sbk == 1;
            let mut args = vec![g.a, g.b, KArg::Out(0)];
            args.extend(epilogue);
            args.extend([
                KArg::I32(i32_of(m, "M")?),
                KArg::I32(i32_of(k, "K")?),
                i64_of(g.lda),
                i64_of(sbk),
                KArg::I32(flags),
                KArg::I32(i32::from(vec)),
            ]);
            let plan = CudaPlan {
                calls: vec![call(
                    "gemm_thin_n1",
                    [blocks(m, 8), 1, 1],
                    [256, 1, 1],
                    args,
                )],
                scratch: vec![],
            };
            return Ok(Some(plan));
        }
        if k == 1 && g.a_row_sums.is_none() {
            let (sa, sb) = (if g.ta { 1 } else { g.lda }, if g.tb { g.ldb } else { 1 });
            let vec = n.is_multiple_of(4) && sb == 1;
            let mut args = vec![g.a, g.b, KArg::Out(0)];
            args.extend(epilogue);
            args.extend([
                KArg::I32(i32_of(m, "M")?),
                KArg::I32(i32_of(n, "N")?),
                i64_of(sa),
                i64_of(sb),
                KArg::I32(flags),
                KArg::I32(i32::from(vec)),
            ]);
            let grid = blocks(m * n, 1024);
            let plan = CudaPlan {
                calls: vec![call("gemm_thin_k1", [grid, 1, 1], [256, 1, 1], args)],
                scratch: vec![],
            };
            return Ok(Some(plan));
        }
        let plain = g.mask.is_none() && !g.relu && g.residual.is_none() && g.copy.is_none();
        if m == 1 && !g.tb && plain && k >= 1 {
            // rows of K a split: at least 128, a multiple of 8, so at most 256 splits (a
            // grid's y holds them; N fits an i32 below, so its column blocks fit x)
            let rows_per = k.div_ceil(256).max(128).next_multiple_of(8);
            let splits = k.div_ceil(rows_per);
            let sa = if g.ta { g.lda } else { 1 };
            let direct = splits == 1 && g.bias.is_none();
            let (part, rs) = if direct {
                (KArg::Out(0), g.a_row_sums.unwrap_or(none))
            } else {
                (
                    KArg::Scratch(0),
                    if g.a_row_sums.is_some() {
                        KArg::Scratch(1)
                    } else {
                        none
                    },
                )
            };
            let args = vec![
                g.a,
                g.b,
                part,
                rs,
                KArg::I32(i32_of(k, "K")?),
                KArg::I32(i32_of(n, "N")?),
                i64_of(sa),
                i64_of(g.ldb),
                KArg::I32(rows_per as i32),
            ];
            let grid = [blocks(n, 32), splits as u32, 1];
            let mut plan = CudaPlan {
                calls: vec![call("gemm_thin_m1", grid, [32, 8, 1], args)],
                scratch: vec![],
            };
            if !direct {
                plan.scratch.push(splits * n * 4);
                if g.a_row_sums.is_some() {
                    plan.scratch.push(splits * 4);
                }
                plan.calls.push(reduce_call(
                    g,
                    KArg::Scratch(0),
                    splits,
                    g.a_row_sums.map(|out| (KArg::Scratch(1), out, splits)),
                ));
            }
            return Ok(Some(plan));
        }
        Ok(None)
    }

    /// Fewest rows for the tall kernels: two 64-row blocks for each of two CTAs an SM.
    fn tall_min_m(sms: usize) -> usize {
        4 * 64 * sms
    }
    /// Shared memory an SM has for CTAs (bytes; 1 KB of each CTA's is the system's).
    const SM_SMEM: usize = 228 * 1024;
    /// The most dynamic shared memory one CTA may have (bytes).
    const CTA_SMEM: usize = 227 * 1024;
    /// The tall kernels: the most columns each covers, the CTAs an SM holds by their
    /// registers (their launch bounds), and the kernels storing through shared memory (a
    /// float4 a lane, whole 128-byte rows) and straight from the fragments.
    /// Then the coalesced kernel reading a bf16 A, and the one storing a bf16 C.
    const TALL_KERNELS: [(usize, usize, [&str; 4]); 4] = [
        (
            64,
            3,
            [
                "gemm_tall_n64_c",
                "gemm_tall_n64",
                "gemm_tall_n64_c_a16",
                "gemm_tall_n64_c_bo",
            ],
        ),
        (
            128,
            2,
            [
                "gemm_tall_n128_c",
                "gemm_tall_n128",
                "gemm_tall_n128_c_a16",
                "gemm_tall_n128_c_bo",
            ],
        ),
        (
            192,
            2,
            [
                "gemm_tall_n192_c",
                "gemm_tall_n192",
                "gemm_tall_n192_c_a16",
                "gemm_tall_n192_c_bo",
            ],
        ),
        (
            256,
            2,
            [
                "gemm_tall_n256_c",
                "gemm_tall_n256",
                "gemm_tall_n256_c_a16",
                "gemm_tall_n256_c_bo",
            ],
        ),
    ];
    /// Shared memory of the coalesced store: [16][40] f32 for each of the 8 warps (and the
    /// bias, NMAX f32, after them).
    pub(crate) const TALL_STAGE_SMEM: usize = 8 * 16 * 40 * 4;

    /// `gemm_tall_n*` for a tall GEMM (batch 1, A not transposed, many rows, N ≤ 256 and K
    /// small enough for two CTAs an SM, each with two 64-row blocks of A, f32 or bf16, and
    /// all of op(B) in shared memory): persistent CTAs, op(B) staged once, the next block of
    /// A loading while this one is multiplied and stored (kernels-cuda/gemm/tall.cuh). A bf16 A
    /// (an f32 B) needs K and lda multiples of 8 (16-byte copies). `None` for every other
    /// GEMM.
    fn gemm_tall(g: &Gemm) -> Result<Option<CudaPlan>, String> {
        // `gemm_tall: false` leaves tall GEMMs to the other kernels (a way to compare them)
        if !g.opts.gemm_tall {
            return Ok(None);
        }
        if g.batch != 1
            || g.ta
            || g.a_row_sums.is_some()
            || g.m < tall_min_m(g.opts.sms)
            || g.k == 0
        {
            return Ok(None);
        }
        if g.b_bf16 || (g.a_bf16 && !(g.k.is_multiple_of(8) && g.lda.is_multiple_of(8))) {
            return Ok(None);
        }
        let Some(&(nmax, regs_per_sm, kernels)) =
            TALL_KERNELS.iter().find(|(nmax, ..)| g.n <= *nmax)
        else {
            return Ok(None);
        };
        // `gemm_tall_store_direct` stores from the fragments (a way to compare; f32 A, no
        // residual)
        let direct =
            !g.a_bf16 && !g.out_bf16 && g.residual.is_none() && g.opts.gemm_tall_store_direct;
        if g.out_bf16 && (g.a_bf16 || g.mask.is_some() || g.residual.is_some()) {
            return Ok(None);
        }
        let kernel = kernels[if g.out_bf16 {
            3
        } else if g.a_bf16 {
            2
        } else {
            usize::from(direct)
        }];
        let kp = g.k.next_multiple_of(32);
        let a_size = if g.a_bf16 { 2 } else { 4 };
        let smem = 2 * 64 * (kp + 8) * a_size
            + nmax * (kp + 8) * 2
            + if direct {
                0
            } else {
                TALL_STAGE_SMEM + nmax * 4
            };
        if smem > CTA_SMEM {
            return Ok(None);
        }
        // two CTAs an SM at least: with one (AutoInt's QKV data gradient, K = 192), the next
        // block's loads no longer cover a block's stores, and the H200 measured it slower
        // than the general kernels (63.3 against 50.3 µs; a deeper ring did not help)
        let per_sm = (SM_SMEM / (smem + 1024)).min(regs_per_sm);
        if per_sm < 2 {
            return Ok(None);
        }
        let ctas = blocks(g.m, 64).min((g.opts.sms * per_sm) as u32);
        let (mi, ni, ki) = (i32_of(g.m, "M")?, i32_of(g.n, "N")?, i32_of(g.k, "K")?);
        Ok(Some(CudaPlan {
            calls: vec![KernelCall {
                kernel,
                grid: [ctas, 1, 1],
                block: [256, 1, 1],
                smem: smem as u32,
                args: vec![
                    g.a,
                    g.b,
                    KArg::Out(0),
                    g.bias_arg(),
                    KArg::I32(mi),
                    KArg::I32(ni),
                    KArg::I32(ki),
                    i64_of(g.lda),
                    i64_of(g.ldb),
                    i64_of(g.n),
                    KArg::I32(i32::from(g.tb)),
                    KArg::I32(g.flags() | if g.residual.is_some() { 16 } else { 0 }),
                    g.residual.unwrap_or(g.a),
                ],
            }],
            scratch: vec![],
        }))
    }

    /// A tile of the pipelined kernels `gemm_bf16p_*` (operands rounded to bf16 into
    /// K-major, zero-padded scratch first; a `STAGES`-deep cp.async ring in dynamic shared
    /// memory), or of their warp-specialized form `gemm_bf16w_*` (`ws`: 384 threads, one
    /// warpgroup loading; sm_90a only), or the TMA kernels' own (`tma`: `gemm_bf16t_*`).
    #[derive(Clone, Copy, Debug)]
    struct PipeTile {
        ws: bool,
        /// The TMA kernels alone have it (`gemm_bf16t*`: batch 1, C written whole by the
        /// launch, operands a TMA descriptor can describe).
        tma: bool,
        bm: usize,
        bn: usize,
        /// k step: the padded K and a split's K range are multiples of it.
        bk: usize,
        /// Dynamic shared memory, bytes.
        smem: u32,
        /// CTAs an SM holds (by registers and shared memory).
        per_sm: usize,
        /// Throughput relative to the 128x128 tile's, as measured on the H200.
        speed: f64,
    }

    const PIPE_TILES: [PipeTile; 4] = [
        // wgmma on sm_90a (99 KB used), mma.sync otherwise (108 KB)
        PipeTile {
            ws: false,
            tma: false,
            bm: 128,
            bn: 128,
            bk: 64,
            smem: 3 * (128 + 128) * 72 * 2,
            per_sm: 2,
            speed: 1.0,
        },
        // wgmma on sm_90a (4 stages of 64, 1 KB for alignment), mma.sync otherwise (120 KB)
        PipeTile {
            ws: false,
            tma: false,
            bm: 128,
            bn: 256,
            bk: 64,
            smem: 4 * (128 + 256) * 64 * 2 + 1024,
            per_sm: 1,
            // 5-15 % slower than two 128x128 CTAs per SM at the model's shapes and 4096³
            speed: 0.9,
        },
        // warp-specialized (sm_90a): 4 stages of 64 (1 KB for alignment), two CTAs an SM
        PipeTile {
            ws: true,
            tma: false,
            bm: 128,
            bn: 64,
            bk: 64,
            smem: 4 * (128 + 64) * 64 * 2 + 1024,
            per_sm: 2,
            speed: WS_SPEED,
        },
        // the TMA kernels' (sm_90a, `gemm_tma_n64`): 4 stages of 64 (1 KB for alignment),
        // two CTAs an SM, 256 threads
        PipeTile {
            ws: false,
            tma: true,
            bm: 128,
            bn: 64,
            bk: 64,
            smem: 4 * (128 + 64) * 64 * 2 + 1024,
            per_sm: 2,
            speed: WS_SPEED,
        },
    ];

    /// Whether `t` may run `g`: the warp-specialized tile where `gemm_ws`; the TMA kernels'
    /// own where `gemm_tma` and `gemm_tma_n64` is every launch, at batch 1, with its
    /// splits (if any) summed in a cluster (the launch writes C whole). `gemm_pipe` falls
    /// back to the 128x128 tile where an operand has no descriptor.
    fn tile_allowed(t: &PipeTile, g: &Gemm) -> bool {
        if t.ws {
            return g.opts.gemm_ws;
        }
        if t.tma {
            return g.opts.gemm_tma
                && g.opts.gemm_tma_n64.all
                && g.batch == 1
                && (g.opts.gemm_cluster || pipe_splits(t, g).1 == 1);
        }
        true
    }

    /// The warp-specialized tile's rate for a CTA slot against the 256-thread 128x128
    /// tile's (per output element; half the tile, twice the CTAs): under 1, so that the
    /// wave model takes it where it needs fewer waves (a grid of 128x128 tiles short of
    /// filling the device: the CTR model's 4096 x 256 outputs), not where both fill it.
    const WS_SPEED: f64 = 0.9;

    /// The threads of a pipelined tile's CTA.
    fn pipe_threads(t: &PipeTile) -> u32 {
        if t.ws {
            384
        } else {
            256
        }
    }

    /// Least K for the pipelined kernels: one k step. AutoInt's QKV projection (110592 x 192
    /// x 64) measured 0.6-0.7 % more CTR examples/s on it than with the single-launch kernel
    /// (the bound was 256 before).
    const PIPE_MIN_K: usize = 64;
    /// Estimated rates for choosing a tile: one SM's mma rate (FLOP/s) and the memory
    /// bandwidth of the split-K reduction (bytes/s).
    const SM_FLOPS: f64 = 3.0e12;
    const MEM_BW: f64 = 3.0e12;

    /// The k range of one split and the split count for a pipelined tile.
    fn pipe_splits(t: &PipeTile, g: &Gemm) -> (usize, usize) {
        let kp = g.k.next_multiple_of(t.bk);
        let tiles = g.m.div_ceil(t.bm) * g.n.div_ceil(t.bn) * g.batch;
        let slots = g.opts.sms * t.per_sm;
        let mut splits = 1;
        let min_k = g.opts.gemm_pipe_min_k_per_split.max(1);
        if tiles < slots && kp >= 2 * min_k {
            splits = (slots / tiles)
                .min(kp / min_k)
                .min(GRID_YZ / g.batch)
                .max(1);
        }
        let k_split = kp.div_ceil(splits).next_multiple_of(t.bk);
        (k_split, kp.div_ceil(k_split))
    }

    /// Estimated seconds of a pipelined tile: full waves of CTAs (each SM running `per_sm`
    /// at the tile's share of its mma rate) and the split-K reduction's bytes.
    fn pipe_cost(t: &PipeTile, g: &Gemm) -> f64 {
        let (k_split, splits) = pipe_splits(t, g);
        let ctas = g.m.div_ceil(t.bm) * g.n.div_ceil(t.bn) * g.batch * splits;
        let waves = ctas.div_ceil(g.opts.sms * t.per_sm) as f64;
        let wave = 2.0 * (t.bm * t.bn * t.per_sm * k_split) as f64 / (SM_FLOPS * t.speed);
        let reduce = if splits > 1 && cluster_size(&g.opts, g.batch, splits).is_some() {
            // the partials summed in the cluster's shared memory
            1e-6
        } else if splits > 1 {
            (2 * splits + 1) as f64 * (g.m * g.n * g.batch * 4) as f64 / MEM_BW + 2e-6
        } else {
            0.0
        };
        waves * wave + reduce
    }

    /// The pipelined tile for a GEMM large enough to pay for rounding its operands to bf16
    /// in separate launches, or `None` for the single-launch kernels.
    fn pipe_tile(g: &Gemm) -> Option<PipeTile> {
        // `gemm_pipeline: false` keeps every GEMM on the single-launch kernels (a fallback,
        // and a way to compare the two paths on a model)
        if !g.opts.gemm_pipeline {
            return None;
        }
        let (m, n, k, batch) = (g.m, g.n, g.k, g.batch);
        let mn = g.opts.gemm_pipe_min_mn;
        if m < mn || n < mn || k < PIPE_MIN_K || 2 * m * n * k * batch < g.opts.gemm_pipe_min_flops
        {
            return None;
        }
        // grid limits of the conversion and GEMM launches, and i32 sizes in the kernels
        let big = m.max(n).next_multiple_of(256) * k.next_multiple_of(64);
        if k.div_ceil(64) > GRID_YZ || n.div_ceil(64) > GRID_YZ || big >= i32::MAX as usize {
            return None;
        }
        choose_pipe_tile(g)
    }

    /// Whether `t`'s grid for `g` (its splits as the cluster rounds them) has at most one
    /// CTA an SM. Where the 128x128 grid leaves SMs idle, the 128x64 tile puts the idle
    /// SMs to work, each CTA doing half the k work; where it would put two CTAs on an SM,
    /// the two share the SM's L2 bandwidth, which bounds these GEMMs, and it measured
    /// 5-13 % slower on an H200 (the CTR model's 4096 x 512 x 1024 weight gradient, DCNv2's
    /// 4096 x 3456 outputs), so the wave model does not take it there.
    fn one_per_sm(t: &PipeTile, g: &Gemm) -> bool {
        let (_, splits) = pipe_splits(t, g);
        let splits = cluster_size(&g.opts, g.batch, splits).unwrap_or(splits);
        g.m.div_ceil(t.bm) * g.n.div_ceil(t.bn) * g.batch * splits <= g.opts.sms
    }

    /// The tile `opts.gemm_tile` forces (of those [`tile_allowed`]), else the one of least
    /// estimated cost of those allowed, the TMA 128x64 tile where [`one_per_sm`].
    fn choose_pipe_tile(g: &Gemm) -> Option<PipeTile> {
        if let Some(f) = g.opts.gemm_tile {
            if let Some(t) = PIPE_TILES
                .iter()
                .find(|t| t.bn == f.n && t.ws == f.ws && tile_allowed(t, g))
            {
                return Some(*t);
            }
        }
        PIPE_TILES
            .iter()
            .filter(|t| tile_allowed(t, g) && (!t.tma || one_per_sm(t, g)))
            .min_by(|a, b| pipe_cost(a, g).total_cmp(&pipe_cost(b, g)))
            .copied()
    }

    /// The pipelined plan for a GEMM whose operands include a bf16 tensor (a RoundBf16 copy,
    /// read in place): the tile of least estimated cost, whatever the size (the graph gives
    /// copies only to large layers), and the other operand rounded as in [`gemm_pipe`].
    /// Copies are read without padding, so K must be a multiple of 64, rows 16-byte aligned,
    /// and an MN-major operand's m or n a multiple of 8; an MN-major A needs an MN-major B
    /// (the kernels' layouts: both K-major, both MN-major, or A K-major and B MN-major).
    fn gemm_pipe_bf16(g: &Gemm) -> Result<CudaPlan, String> {
        let (a_mn, b_mn) = (g.a_bf16 && g.ta, g.b_bf16 && !g.tb);
        if a_mn && !b_mn {
            return Err("an MN-major bf16 A needs an MN-major B \
                        (a weight gradient takes bf16 copies of both dy and x)"
                .into());
        }
        if !g.k.is_multiple_of(64) {
            return Err(format!(
                "K = {} is not a multiple of 64 (bf16 operand copies are read unpadded)",
                g.k
            ));
        }
        for (bf16, mn, dim, ld, what) in [
            (g.a_bf16, a_mn, g.m, g.lda, "A"),
            (g.b_bf16, b_mn, g.n, g.ldb, "B"),
        ] {
            // the kernels find each chunk's offset from its tile's base in 32 bits: under
            // 256 rows of ld (a K-major operand of the 128x256 tile), or 64 rows of ld plus
            // 256 (an MN-major one)
            if bf16 && 256 * (ld as u64 + 1) > u64::from(u32::MAX) {
                return Err(format!(
                    "bf16 operand {what}: rows of {ld} elements are too long for the kernels' \
                     32-bit tile offsets (at most {})",
                    u64::from(u32::MAX) / 256 - 1
                ));
            }
            if bf16 && (!ld.is_multiple_of(8) || (mn && !dim.is_multiple_of(8))) {
                return Err(format!(
                    "bf16 operand {what}: rows of {ld} elements and {dim} wide are not whole \
                     16-byte chunks"
                ));
            }
        }
        let t = choose_pipe_tile(g).ok_or("no pipelined tile")?;
        gemm_pipe(g, t)
    }

    /// The pipelined kernels' names by layout (K-major operands, both MN-major `_mm`, A
    /// K-major and B MN-major `_km`, K-major with C's bf16 copy `_c`, `_km` with the copy
    /// `_kmc`), tile (128x128, 128x256) and cluster (none, 2, 4 or 8 CTAs: `_k<S>`).
    const PIPE_NAMES: [[[&str; 4]; 2]; 5] = [
        [
            [
                "gemm_bf16p_128x128",
                "gemm_bf16p_128x128_k2",
                "gemm_bf16p_128x128_k4",
                "gemm_bf16p_128x128_k8",
            ],
            [
                "gemm_bf16p_128x256",
                "gemm_bf16p_128x256_k2",
                "gemm_bf16p_128x256_k4",
                "gemm_bf16p_128x256_k8",
            ],
        ],
        [
            [
                "gemm_bf16p_mm_128x128",
                "gemm_bf16p_mm_128x128_k2",
                "gemm_bf16p_mm_128x128_k4",
                "gemm_bf16p_mm_128x128_k8",
            ],
            [
                "gemm_bf16p_mm_128x256",
                "gemm_bf16p_mm_128x256_k2",
                "gemm_bf16p_mm_128x256_k4",
                "gemm_bf16p_mm_128x256_k8",
            ],
        ],
        [
            [
                "gemm_bf16p_km_128x128",
                "gemm_bf16p_km_128x128_k2",
                "gemm_bf16p_km_128x128_k4",
                "gemm_bf16p_km_128x128_k8",
            ],
            [
                "gemm_bf16p_km_128x256",
                "gemm_bf16p_km_128x256_k2",
                "gemm_bf16p_km_128x256_k4",
                "gemm_bf16p_km_128x256_k8",
            ],
        ],
        [
            [
                "gemm_bf16p_c_128x128",
                "gemm_bf16p_c_128x128_k2",
                "gemm_bf16p_c_128x128_k4",
                "gemm_bf16p_c_128x128_k8",
            ],
            [
                "gemm_bf16p_c_128x256",
                "gemm_bf16p_c_128x256_k2",
                "gemm_bf16p_c_128x256_k4",
                "gemm_bf16p_c_128x256_k8",
            ],
        ],
        [
            [
                "gemm_bf16p_kmc_128x128",
                "gemm_bf16p_kmc_128x128_k2",
                "gemm_bf16p_kmc_128x128_k4",
                "gemm_bf16p_kmc_128x128_k8",
            ],
            [
                "gemm_bf16p_kmc_128x256",
                "gemm_bf16p_kmc_128x256_k2",
                "gemm_bf16p_kmc_128x256_k4",
                "gemm_bf16p_kmc_128x256_k8",
            ],
        ],
    ];

    /// The warp-specialized kernels' names (the 128x64 tile), by layout as [`PIPE_NAMES`]
    /// and cluster.
    macro_rules! ws_names {
        ($layout:literal) => {
            [
                concat!("gemm_bf16w", $layout, "_128x64"),
                concat!("gemm_bf16w", $layout, "_128x64_k2"),
                concat!("gemm_bf16w", $layout, "_128x64_k4"),
                concat!("gemm_bf16w", $layout, "_128x64_k8"),
            ]
        };
    }
    const WS_NAMES: [[&str; 4]; 5] = [
        ws_names!(""),
        ws_names!("_mm"),
        ws_names!("_km"),
        ws_names!("_c"),
        ws_names!("_kmc"),
    ];

    /// The TMA kernels' names (`gemm_bf16t*`), by layout as [`PIPE_NAMES`], tile (128x128,
    /// 128x256, 128x64) and cluster (none, 2, 4 or 8 CTAs: `_k<S>`).
    macro_rules! tma_names {
        ($layout:literal) => {
            [
                [
                    concat!("gemm_bf16t", $layout, "_128x128"),
                    concat!("gemm_bf16t", $layout, "_128x128_k2"),
                    concat!("gemm_bf16t", $layout, "_128x128_k4"),
                    concat!("gemm_bf16t", $layout, "_128x128_k8"),
                ],
                [
                    concat!("gemm_bf16t", $layout, "_128x256"),
                    concat!("gemm_bf16t", $layout, "_128x256_k2"),
                    concat!("gemm_bf16t", $layout, "_128x256_k4"),
                    concat!("gemm_bf16t", $layout, "_128x256_k8"),
                ],
                [
                    concat!("gemm_bf16t", $layout, "_128x64"),
                    concat!("gemm_bf16t", $layout, "_128x64_k2"),
                    concat!("gemm_bf16t", $layout, "_128x64_k4"),
                    concat!("gemm_bf16t", $layout, "_128x64_k8"),
                ],
            ]
        };
    }
    const TMA_NAMES: [[[&str; 4]; 3]; 5] = [
        tma_names!(""),
        tma_names!("_mm"),
        tma_names!("_km"),
        tma_names!("_c"),
        tma_names!("_kmc"),
    ];

    /// Every TMA kernel a plan may name.
    pub(crate) fn tma_kernels() -> impl Iterator<Item = &'static str> {
        TMA_NAMES
            .iter()
            .flatten()
            .flatten()
            .copied()
            .chain(["gemm_bf16t_128x128_ma", "gemm_bf16t_c_128x128_ma"])
    }

    /// A TMA kernel's name, as [`pipe_name`] (the tile's width `bn`).
    fn tma_name(a_mn: bool, b_mn: bool, copy: bool, bn: usize, cluster: usize) -> &'static str {
        let tile = match bn {
            256 => 1,
            64 => 2,
            _ => 0,
        };
        TMA_NAMES[pipe_layout(copy, a_mn, b_mn)][tile][cluster_index(cluster)]
    }

    /// The index of a cluster size (1: none) among the kernels' `_k<S>` forms.
    fn cluster_index(cluster: usize) -> usize {
        match cluster {
            0 | 1 => 0,
            2 => 1,
            4 => 2,
            _ => 3,
        }
    }

    /// The index of a pipelined kernel's layout in [`PIPE_NAMES`].
    fn pipe_layout(copy: bool, a_mn: bool, b_mn: bool) -> usize {
        match (copy, a_mn, b_mn) {
            (false, false, false) => 0,
            (false, true, _) => 1,
            (false, false, true) => 2,
            (true, _, false) => 3,
            (true, _, true) => 4,
        }
    }

    /// Every warp-specialized kernel a plan may name.
    pub(crate) fn ws_kernels() -> impl Iterator<Item = &'static str> {
        WS_NAMES.iter().flatten().copied()
    }

    /// A pipelined kernel's name: the operands' layouts (`a_mn`, `b_mn`: MN-major; both, or
    /// B alone), whether the epilogue writes C's bf16 copy (K-major A only), the tile and
    /// the CTAs of its cluster (1: none).
    fn pipe_name(a_mn: bool, b_mn: bool, copy: bool, t: &PipeTile, cluster: usize) -> &'static str {
        let layout = pipe_layout(copy, a_mn, b_mn);
        let c = cluster_index(cluster);
        if t.ws {
            WS_NAMES[layout][c]
        } else {
            PIPE_NAMES[layout][usize::from(t.bn == 256)][c]
        }
    }

    /// The pipelined plan: each f32 operand rounded to bf16 into scratch (K-major, padded
    /// with zeros to whole tiles; both in one launch when both are f32), each bf16 operand
    /// read in place, the GEMM, and for split-K the fixed-order reduction of the partials.
    fn gemm_pipe(g: &Gemm, t: PipeTile) -> Result<CudaPlan, String> {
        let Gemm { batch, m, n, k, .. } = *g;
        let (mut k_split, mut splits) = pipe_splits(&t, g);
        // split-K summed inside a cluster of 2, 4 or 8 CTAs (either tile, batch 1): the
        // split count rounded up to one of those, no partials and no reduction launch
        let cluster = cluster_size(&g.opts, batch, splits);
        if let Some(s) = cluster {
            k_split = k.next_multiple_of(t.bk).div_ceil(s).next_multiple_of(t.bk);
            splits = s;
        }
        let (mp, np, kp) = (
            m.next_multiple_of(t.bm),
            n.next_multiple_of(t.bn),
            k.next_multiple_of(t.bk),
        );
        let (mi, ni, kpi) = (i32_of(m, "M")?, i32_of(n, "N")?, i32_of(kp, "K")?);
        let count = batch * m * n;
        let (a_mn, b_mn) = (g.a_bf16 && g.ta, g.b_bf16 && !g.tb);
        if g.a_row_sums.is_some() && (g.a_bf16 || g.b_bf16) {
            return Err("row sums of op(A) are taken while rounding both f32 operands".into());
        }
        // op(A) as [M][K] and op(B)ᵀ as [N][K]: a plain copy when K is the stored rows' inner
        // dim, else the transposing form; `(args, ctas)` of one operand's part of the launch
        let part = |src: KArg,
                    dst: usize,
                    rows: usize,
                    cols: usize,
                    rp: usize,
                    trans: bool,
                    ld: usize,
                    batch_src: usize| {
            let (gx, ctas) = if trans {
                (blocks(rp, 64), blocks(rp, 64) * blocks(kp, 64))
            } else {
                (1, blocks(rp * kp / 8, 256))
            };
            let args = vec![
                src,
                KArg::Scratch(dst),
                KArg::I32(rows as i32),
                KArg::I32(cols as i32),
                i64_of(ld),
                i64_of(batch_src),
                KArg::I32(rp as i32),
                KArg::I32(i32::from(trans)),
                KArg::I32(gx as i32),
            ];
            (args, ctas)
        };
        let mut scratch = Vec::new();
        let mut calls = Vec::new();
        // each operand: (pointer, ld, batch stride), rounded into the next scratch if f32
        let mut operand = |bf16: bool, arg: KArg, ld: usize, bs: usize, rows_p: usize| {
            if bf16 {
                (arg, ld, bs, None)
            } else {
                scratch.push(batch * rows_p * kp * 2);
                let i = scratch.len() - 1;
                (KArg::Scratch(i), kp, rows_p * kp, Some(i))
            }
        };
        let (a_arg, lda, bsa, a_dst) = operand(g.a_bf16, g.a, g.lda, g.batch_a, mp);
        let (b_arg, ldb, bsb, b_dst) = operand(g.b_bf16, g.b, g.ldb, g.batch_b, np);
        let partials = splits > 1 && cluster.is_none();
        let part_at = partials.then(|| {
            scratch.push(splits * count * 4);
            scratch.len() - 1
        });
        // op(A)'s row sums: one partial per 64 of K, `(partials, out, slices)`, added after
        // the GEMM by the reduction's launch where there is one, else by colsum_final
        let row_sums = g.a_row_sums.map(|out| {
            let slices = kp.div_ceil(64);
            scratch.push(slices * m * 4);
            (KArg::Scratch(scratch.len() - 1), out, slices)
        });
        match (a_dst, b_dst) {
            (Some(da), Some(db)) => {
                let (mut conv_args, ctas_a) = part(g.a, da, m, k, mp, g.ta, g.lda, g.batch_a);
                conv_args.push(KArg::I32(ctas_a as i32));
                let (args_b, ctas_b) = part(g.b, db, n, k, np, !g.tb, g.ldb, g.batch_b);
                conv_args.extend(args_b);
                conv_args.push(KArg::I32(kpi));
                match row_sums {
                    Some((p, _, _)) => conv_args.extend([p, KArg::I32(1)]),
                    None => conv_args.extend([g.a, KArg::I32(0)]),
                }
                calls.push(KernelCall {
                    kernel: "gemm_to_bf16_pair",
                    grid: [ctas_a + ctas_b, 1, batch as u32],
                    block: [256, 1, 1],
                    smem: 0,
                    args: conv_args,
                });
            }
            (Some(d), None) | (None, Some(d)) => {
                // one f32 operand: its own rounding launch (the other is a bf16 copy)
                let a = a_dst.is_some();
                let (src, rows, rp, trans, ld, bs) = if a {
                    (g.a, m, mp, g.ta, g.lda, g.batch_a)
                } else {
                    (g.b, n, np, !g.tb, g.ldb, g.batch_b)
                };
                let (mut args, _) = part(src, d, rows, k, rp, trans, ld, bs);
                args.truncate(7);
                args.push(KArg::I32(kpi));
                let grid = if trans {
                    [blocks(rp, 64), blocks(kp, 64), batch as u32]
                } else {
                    [blocks(rp * kp / 8, 256), 1, batch as u32]
                };
                calls.push(KernelCall {
                    kernel: if trans {
                        "gemm_to_bf16_t"
                    } else {
                        "gemm_to_bf16"
                    },
                    grid,
                    block: [256, 1, 1],
                    smem: 0,
                    args,
                });
            }
            (None, None) => {}
        }
        // a residual without a bias or a mask (a data gradient summed with x's other
        // contribution): read through `bias` and added by the epilogue (flags & 16) where C
        // is written whole by this launch; else `gemm` adds it after the reduction
        let in_epilogue = g
            .residual
            .filter(|_| !partials && g.bias.is_none() && g.mask.is_none());
        let (flags, bias_arg) = match in_epilogue {
            Some(r) => (g.flags() | 16, r),
            None => (g.flags(), g.bias_arg()),
        };
        let out = part_at.map_or(KArg::Out(0), KArg::Scratch);
        // C's bf16 copy from the epilogue: a K-major A, C written whole by one launch
        let fused_copy = g.copy.filter(|_| !partials && !a_mn);
        let copy_arg = fused_copy.unwrap_or(KArg::Out(0));
        // a bf16 C alone (gemm_bf16_only): the copy is the output, no f32 store
        let flags = if g.out_bf16 && fused_copy == Some(KArg::Out(0)) {
            flags | 64
        } else {
            flags
        };
        // the TMA form (batch 1, C written whole by the launch: no split or a cluster's),
        // both operands at the start of their tensors: K-major scratch [Mp][Kp] / [Np][Kp],
        // or bf16 copies read in place, K-major [rows][K] or MN-major [K][M or N]
        let tma_maps = (g.opts.gemm_tma && !t.ws && batch == 1 && !partials)
            .then(|| {
                let map =
                    |arg: KArg, rounded: bool, mn: bool, dim: usize, dim_p: usize, ld: usize| {
                        let (inner, outer) = match (rounded, mn) {
                            (true, _) => (kp, dim_p),
                            (false, true) => (dim, k),
                            (false, false) => (k, dim),
                        };
                        Some(KArg::TensorMap(crate::cuda::TmaMatrix {
                            base: crate::cuda::TmaBase::of(arg)?,
                            inner: inner as u64,
                            outer: outer as u64,
                            ld: ld as u64,
                        }))
                        .filter(|_| ld.is_multiple_of(8))
                    };
                Some((
                    map(a_arg, a_dst.is_some(), a_mn, m, mp, lda)?,
                    map(b_arg, b_dst.is_some(), b_mn, n, np, ldb)?,
                ))
            })
            .flatten();
        if t.tma && tma_maps.is_none() {
            // an operand no descriptor describes: the 128x128 tile of the cp.async kernels
            return gemm_pipe(g, PIPE_TILES[0]);
        }
        if let Some((map_a, map_b)) = tma_maps {
            calls.push(KernelCall {
                kernel: tma_name(a_mn, b_mn, fused_copy.is_some(), t.bn, cluster.unwrap_or(1)),
                grid: [blocks(mp, t.bm), blocks(np, t.bn), splits as u32],
                block: [256, 1, 1],
                smem: t.smem,
                args: vec![
                    map_a,
                    map_b,
                    out,
                    bias_arg,
                    KArg::I32(mi),
                    KArg::I32(ni),
                    KArg::I32(kpi),
                    i64_of(n),
                    KArg::I32(k_split as i32),
                    KArg::I32(flags),
                    copy_arg,
                ],
            });
            if let Some((part, out, slices)) = row_sums {
                calls.push(crate::cuda::reduce::colsum_final_call(part, out, slices, m));
            }
            return Ok(CudaPlan { calls, scratch });
        }
        calls.push(KernelCall {
            kernel: pipe_name(a_mn, b_mn, fused_copy.is_some(), &t, cluster.unwrap_or(1)),
            grid: [blocks(mp, t.bm), blocks(np, t.bn), (splits * batch) as u32],
            block: [pipe_threads(&t), 1, 1],
            smem: t.smem,
            args: vec![
                a_arg,
                b_arg,
                out,
                bias_arg,
                KArg::I32(mi),
                KArg::I32(ni),
                KArg::I32(kpi),
                i64_of(lda),
                i64_of(ldb),
                i64_of(n),
                i64_of(bsa),
                i64_of(bsb),
                i64_of(m * n),
                KArg::I32(batch as i32),
                KArg::I32(k_split as i32),
                // the partials' stride; 0 in the cluster form, whose splits share C
                i64_of(if partials { count } else { 0 }),
                KArg::I32(if partials { 0 } else { flags }),
                // C's bf16 copy (the `_c` kernels), else any valid pointer
                copy_arg,
            ],
        });
        if let Some(p) = part_at {
            calls.push(reduce_call(g, KArg::Scratch(p), splits, row_sums));
        } else if let Some((part, out, slices)) = row_sums {
            calls.push(crate::cuda::reduce::colsum_final_call(part, out, slices, m));
        }
        Ok(CudaPlan { calls, scratch })
    }

    /// `[x] -> [xb]` or `[x] -> [xb, s]` (RoundBf16): x rounded to bf16 in one pass (the
    /// operand rounding of the pipelined GEMMs, `gemm_to_bf16`), and with `col_sums` x's
    /// sums over its rows from the same pass (`gemm_round_colsum`: partials of 256 rows,
    /// then colsum_final in order).
    pub(crate) fn round_bf16(o: &Operands, col_sums: bool) -> Result<CudaPlan, String> {
        let outs = 1 + usize::from(col_sums);
        if o.ins.len() != 1 || o.outs.len() != outs {
            return Err(format!(
                "expected 1 input and {outs} outputs, got {} and {}",
                o.ins.len(),
                o.outs.len()
            ));
        }
        let want_out = if col_sums {
            &[DType::Bf16, DType::F32][..]
        } else {
            &[DType::Bf16][..]
        };
        if o.in_dtypes != [DType::F32] || o.out_dtypes != want_out {
            return Err(format!(
                "rounds f32 to bf16 (with f32 sums), not {:?} to {:?}",
                o.in_dtypes, o.out_dtypes
            ));
        }
        let x = o.ins[0];
        let (rows, cols) = (x.rows(), x.last());
        if x.rank() < 2 || !cols.is_multiple_of(8) {
            return Err(format!(
                "x {x} must be at least 2-D with a last dim that is a multiple of 8"
            ));
        }
        if col_sums && o.outs[1].numel() != cols {
            return Err(format!("the sums {} do not match x {x}", o.outs[1]));
        }
        let (ri, ci) = (i32_of(rows, "rows")?, i32_of(cols, "columns")?);
        if !col_sums {
            return Ok(CudaPlan {
                calls: vec![KernelCall {
                    kernel: "gemm_to_bf16",
                    grid: [blocks(rows * cols / 8, 256), 1, 1],
                    block: [256, 1, 1],
                    smem: 0,
                    args: vec![
                        KArg::In(0),
                        KArg::Out(0),
                        KArg::I32(ri),
                        KArg::I32(ci),
                        i64_of(cols),
                        i64_of(0),
                        KArg::I32(ri),
                        KArg::I32(ci),
                    ],
                }],
                scratch: vec![],
            });
        }
        let (col_blocks, iters, slices) =
            crate::cuda::common::colsum_geometry(rows, cols, o.opts.sms);
        Ok(CudaPlan {
            calls: vec![
                KernelCall {
                    kernel: "gemm_round_colsum",
                    grid: [col_blocks as u32, slices as u32, 1],
                    block: [256, 1, 1],
                    smem: 0,
                    args: vec![
                        KArg::In(0),
                        KArg::Out(0),
                        KArg::Scratch(0),
                        KArg::I32(ri),
                        KArg::I32(ci),
                        KArg::I32(iters as i32),
                    ],
                },
                crate::cuda::reduce::colsum_final_call(
                    KArg::Scratch(0),
                    KArg::Out(1),
                    slices,
                    cols,
                ),
            ],
            scratch: vec![slices * cols * 4],
        })
    }

    /// The CTAs of a cluster that sums a split pipelined GEMM's partials on chip (either
    /// tile, batch 1, 2-8 splits; more are taken as 8), unless `gemm_cluster: false` keeps
    /// the partials and the reduction launch (a way to compare).
    fn cluster_size(opts: &PlanOptions, batch: usize, splits: usize) -> Option<usize> {
        if !opts.gemm_cluster || batch != 1 || splits < 2 {
            return None;
        }
        Some(match splits {
            2 => 2,
            3 | 4 => 4,
            _ => 8,
        })
    }

    /// `gemm_splitk_reduce` of `splits` partials of `g`'s output at `part` into output 0,
    /// with `g`'s epilogue (bias, ReLU, mask); with `sums = (partials, out, slices)` it also
    /// adds op(A)'s row-sum partials (`g.m` each) into `out`, in CTAs after the reduction's.
    fn reduce_call(
        g: &Gemm,
        part: KArg,
        splits: usize,
        sums: Option<(KArg, KArg, usize)>,
    ) -> KernelCall {
        let count = g.batch * g.m * g.n;
        // the reduction reads `lanes` splits of a group of 4 elements at once: a power of two,
        // at most 32, about one split in 2 per lane (few, long chains only when splits are many)
        let lanes = [32, 16, 8, 4, 2, 1]
            .into_iter()
            .find(|&l| l <= splits.div_ceil(2).max(1))
            .unwrap_or(1);
        // and `width` element groups of 4 per lane: 256 threads where lanes are few (a
        // 32-thread CTA cannot fill an SM), the lanes' sums in dynamic shared memory
        let width = (256 / lanes).max(32);
        let (rs_part, rs_out, rs_slices) = sums.unwrap_or((part, part, 0));
        let rs_blocks = if rs_slices > 0 { blocks(g.m, width) } else { 0 };
        KernelCall {
            kernel: "gemm_splitk_reduce",
            grid: [blocks(count, 4 * width) + rs_blocks, 1, 1],
            block: [width as u32, lanes as u32, 1],
            smem: (width * lanes * 16) as u32,
            args: vec![
                part,
                g.bias_arg(),
                KArg::Out(0),
                i64_of(count),
                KArg::I32(g.n as i32),
                KArg::I32(splits as i32),
                i64_of(count),
                KArg::I32(g.flags()),
                rs_part,
                rs_out,
                KArg::I32(rs_slices as i32),
                i64_of(g.m),
            ],
        }
    }

    fn matrix(s: &Shape, what: &str) -> Result<(usize, usize), String> {
        match s.dims() {
            [r, c] => Ok((*r, *c)),
            d => Err(format!("{what} must be a matrix, got shape {d:?}")),
        }
    }

    /// `[x, w, b?] -> [y]`: y[M,N] = x[M,K]·w[N,K]ᵀ (+ b); with `residual` (LinearAdd),
    /// `[x, w, b?, r] -> [y]`: y = x·wᵀ (+ b) + r, f32 operands.
    pub(crate) fn linear(
        o: &Operands,
        bias: bool,
        relu: bool,
        residual: bool,
    ) -> Result<CudaPlan, String> {
        let nb = usize::from(bias);
        // `[y]`, or `[y, bf16(y)]`: the copy a later GEMM reads, from the same epilogue;
        // or `[y]` in bf16 alone (Graph::linear_for_attention), of f32 operands
        let copy = o.outs.len() == 2 && o.out_dtypes.get(1) == Some(&DType::Bf16);
        let out_bf16 = !residual && o.out_dtypes == [DType::Bf16];
        // a bf16 output of bf16 operand copies (Graph::linear_stored_bf16), or of f32
        // operands (Graph::linear_for_attention)
        let bf16_ok: &[usize] = if residual { &[] } else { &[0, 1] };
        let ins = 2 + nb + usize::from(residual);
        let checked = Operands {
            out_dtypes: if out_bf16 {
                &[DType::F32]
            } else {
                o.out_dtypes
            },
            ..*o
        };
        let bf16 = check_gemm_operands(&checked, ins, 1 + usize::from(copy), bf16_ok)?;
        if out_bf16 && bf16[0] != bf16[1] {
            return Err(
                "a layer stored in bf16 reads bf16 copies of both operands or of neither".into(),
            );
        }
        let (n, k) = matrix(o.ins[1], "the weight")?;
        if o.ins[0].last() != k {
            return Err(format!(
                "input {} does not match weight [{n}, {k}]",
                o.ins[0]
            ));
        }
        if bias && o.ins[2].numel() != n {
            return Err(format!(
                "bias {} does not match weight [{n}, {k}]",
                o.ins[2]
            ));
        }
        if residual && o.ins[2 + nb] != o.outs[0] {
            return Err(format!(
                "the residual {} is not the output's shape {}",
                o.ins[2 + nb],
                o.outs[0]
            ));
        }
        let m = o.ins[0].rows();
        gemm(Gemm {
            opts: o.opts,
            ta: false,
            tb: true,
            batch: 1,
            m,
            n,
            k,
            a: KArg::In(0),
            b: KArg::In(1),
            bias: bias.then_some(KArg::In(2)),
            relu,
            mask: None,
            a_row_sums: None,
            lda: k,
            ldb: k,
            batch_a: 0,
            batch_b: 0,
            a_bf16: bf16[0],
            b_bf16: bf16[1],
            copy: copy.then_some(KArg::Out(1)),
            residual: residual.then_some(KArg::In(2 + nb)),
            out_bf16,
        })
    }

    /// `[x, w, b?, a, c] -> [y, z (, bf16(z))]`: the layer as `linear` plans it (y f32, or
    /// bf16 alone where the layer is stored so), and the cross update `z = a ⊙ y + c` from
    /// the stored y: in the GEMM's epilogue where one TMA launch of the 128x128 tile writes
    /// y whole (`gemm_bf16t[_c]_128x128_ma`: a and c read, z and its copy stored beside y,
    /// no pass of its own over y), else by the `MulAdd` launch after the GEMM.
    pub(crate) fn linear_mul_add(o: &Operands, bias: bool) -> Result<CudaPlan, String> {
        let n = 2 + usize::from(bias);
        if o.ins.len() != n + 2 || o.in_dtypes.len() != n + 2 {
            return Err(format!("expected {} inputs", n + 2));
        }
        if !(2..=3).contains(&o.outs.len()) || o.out_dtypes.len() != o.outs.len() {
            return Err("expected 2 or 3 outputs: y, the update and its bf16 copy".into());
        }
        let layer = Operands {
            ins: &o.ins[..n],
            in_dtypes: &o.in_dtypes[..n],
            outs: &o.outs[..1],
            out_dtypes: &o.out_dtypes[..1],
            ..*o
        };
        let mut plan = linear(&layer, bias, false, false)?;
        // the update as `MulAdd` plans it: [a, y, c] -> [z (, copy)]
        let update_ins = [o.ins[n], o.outs[0], o.ins[n + 1]];
        let update_in_dtypes = [o.in_dtypes[n], o.out_dtypes[0], o.in_dtypes[n + 1]];
        let update = Operands {
            ins: &update_ins,
            in_dtypes: &update_in_dtypes,
            outs: &o.outs[1..],
            out_dtypes: &o.out_dtypes[1..],
            ..*o
        };
        let mut separate = crate::cuda::elementwise::mul_add(&erase_graph::Op::MulAdd, &update)?;
        let copy = o.outs.len() == 3;
        // the one launch that writes y, if it can take the update in its epilogue
        let writers: Vec<usize> = (0..plan.calls.len())
            .filter(|&i| plan.calls[i].args.contains(&KArg::Out(0)))
            .collect();
        if let [w] = writers[..] {
            let call = &mut plan.calls[w];
            let fused = match call.kernel {
                "gemm_bf16t_128x128" => Some("gemm_bf16t_128x128_ma"),
                "gemm_bf16t_c_128x128" => Some("gemm_bf16t_c_128x128_ma"),
                _ => None,
            };
            // flags (argument 9): no ReLU, mask or residual; C written whole (grid z 1)
            let flags = match call.args.get(9) {
                Some(KArg::I32(f)) => Some(*f),
                _ => None,
            };
            if let (Some(kernel), Some(f), true) = (fused, flags, o.opts.gemm_mul_add_epilogue) {
                if f & (2 | 8 | 16) == 0 && call.grid[2] == 1 && call.args.len() == 11 {
                    call.kernel = kernel;
                    call.args[9] = KArg::I32(f | if copy { 128 } else { 0 });
                    call.args.extend([
                        KArg::In(n),
                        KArg::In(n + 1),
                        KArg::Out(1),
                        KArg::Out(if copy { 2 } else { 1 }),
                    ]);
                    return Ok(plan);
                }
            }
        }
        // else the update's own launch, its operands named as the fused node's
        let base = plan.scratch.len();
        for c in &mut separate.calls {
            for a in &mut c.args {
                *a = match *a {
                    KArg::In(0) => KArg::In(n),
                    KArg::In(1) => KArg::Out(0),
                    KArg::In(2) => KArg::In(n + 1),
                    KArg::Out(i) => KArg::Out(i + 1),
                    KArg::Scratch(i) => KArg::Scratch(base + i),
                    other => other,
                };
            }
        }
        plan.calls.append(&mut separate.calls);
        plan.scratch.append(&mut separate.scratch);
        Ok(plan)
    }

    /// `[dy, w] -> [dx]`: dx[M,K] = dy[M,N]·w[N,K]; with `relu_mask`, `[dy, w, y] -> [dx]`,
    /// dx zeroed where y (of dx's shape) is not > 0; with `residual`, a last input r of dx's
    /// shape added after them (by the epilogue of the pipelined and tall kernels, else by an
    /// add launch after the GEMM).
    pub(crate) fn linear_grad_input(
        o: &Operands,
        relu_mask: bool,
        residual: bool,
    ) -> Result<CudaPlan, String> {
        // `[dx]`, or `[dx, bf16(dx)]`: dx is the dy of a layer with copies (the one below),
        // and its copy comes from the same epilogue
        let copy = o.outs.len() == 2 && o.out_dtypes.get(1) == Some(&DType::Bf16);
        let r = 2 + usize::from(relu_mask);
        let bf16 =
            check_gemm_operands(o, r + usize::from(residual), 1 + usize::from(copy), &[0, 1])?;
        if residual && o.ins[r] != o.outs[0] {
            return Err(format!(
                "the residual {} is not dx's shape {}",
                o.ins[r], o.outs[0]
            ));
        }
        let (n, k) = matrix(o.ins[1], "the weight")?;
        if o.ins[0].last() != n {
            return Err(format!("dy {} does not match weight [{n}, {k}]", o.ins[0]));
        }
        if relu_mask && o.ins[2] != o.outs[0] {
            return Err(format!(
                "the ReLU output {} does not match dx {}",
                o.ins[2], o.outs[0]
            ));
        }
        gemm(Gemm {
            opts: o.opts,
            ta: false,
            tb: false,
            batch: 1,
            m: o.ins[0].rows(),
            n: k,
            k: n,
            a: KArg::In(0),
            b: KArg::In(1),
            bias: None,
            relu: false,
            mask: relu_mask.then_some(KArg::In(2)),
            a_row_sums: None,
            lda: n,
            ldb: k,
            batch_a: 0,
            batch_b: 0,
            a_bf16: bf16[0],
            b_bf16: bf16[1],
            copy: copy.then_some(KArg::Out(1)),
            residual: residual.then_some(KArg::In(r)),
            out_bf16: false,
        })
    }

    /// `[dy, x] -> [dw]`: dw[N,K] = dy[M,N]ᵀ·x[M,K], K-dimension of the GEMM = the M rows.
    pub(crate) fn linear_grad_weight(o: &Operands, bias: bool) -> Result<CudaPlan, String> {
        let bf16 = check_gemm_operands(o, 2, 1 + usize::from(bias), &[0, 1])?;
        let (n, k) = matrix(o.outs[0], "the weight gradient")?;
        let rows = o.ins[0].rows();
        if o.ins[0].last() != n || o.ins[1].last() != k || o.ins[1].rows() != rows {
            return Err(format!(
                "dy {} and x {} do not match dw [{n}, {k}]",
                o.ins[0], o.ins[1]
            ));
        }
        if bias && o.outs[1].numel() != n {
            return Err(format!("db {} does not match dw [{n}, {k}]", o.outs[1]));
        }
        let mut g = Gemm {
            opts: o.opts,
            ta: true,
            tb: false,
            batch: 1,
            m: n,
            n: k,
            k: rows,
            a: KArg::In(0),
            b: KArg::In(1),
            bias: None,
            relu: false,
            mask: None,
            a_row_sums: None,
            lda: n,
            ldb: k,
            batch_a: 0,
            batch_b: 0,
            a_bf16: bf16[0],
            b_bf16: bf16[1],
            copy: None,
            residual: None,
            out_bf16: false,
        };
        // db = dy's column sums: while the pipelined path rounds dyᵀ (at most 256 partials of
        // 64 rows for the second pass) or the single-launch kernel stages dy's tiles, else by
        // the column reduction of SumToShape
        // (no input features: the GEMM has no launch to sum in, so SumToShape writes db)
        // (a bf16 dy with an f32 x: summed by the single-launch kernels reading it)
        let fused =
            bias && k > 0 && (bf16[0] || pipe_tile(&g).is_none() || rows.div_ceil(64) <= 256);
        if bias && bf16[0] && (bf16[1] || k == 0) {
            // both copies are read by the pipelined kernels, which take no sums
            return Err(
                "the bias gradient of a layer with bf16 copies of dy and x comes from \
                 RoundBf16 with col_sums, not from the weight gradient"
                    .into(),
            );
        }
        if fused {
            g.a_row_sums = Some(KArg::Out(1));
        }
        let mut plan = gemm(g)?;
        if bias && !fused {
            crate::cuda::reduce::append_column_sums(
                &mut plan.calls,
                &mut plan.scratch,
                KArg::In(0),
                rows,
                n,
                KArg::Out(1),
            );
        }
        Ok(plan)
    }

    /// `[a, b] -> [c]`: c = op(a)·op(b) over the last two dims, with an optional equal
    /// leading batch dim.
    pub(crate) fn matmul(o: &Operands, ta: bool, tb: bool) -> Result<CudaPlan, String> {
        check_f32(o, 2, 1)?;
        let (da, db) = (o.ins[0].dims(), o.ins[1].dims());
        let (batch, (ra, ca), (rb, cb)) = match (da, db) {
            ([ra, ca], [rb, cb]) => (1, (*ra, *ca), (*rb, *cb)),
            ([ba, ra, ca], [bb, rb, cb]) if ba == bb => (*ba, (*ra, *ca), (*rb, *cb)),
            _ => {
                return Err(format!(
                    "operands {} and {} are not two matrices or two equal batches",
                    o.ins[0], o.ins[1]
                ))
            }
        };
        let (m, k) = if ta { (ca, ra) } else { (ra, ca) };
        let (kb, n) = if tb { (cb, rb) } else { (rb, cb) };
        if k != kb {
            return Err(format!(
                "inner dims differ: op(a) is [{m}, {k}], op(b) [{kb}, {n}]"
            ));
        }
        gemm(Gemm {
            opts: o.opts,
            ta,
            tb,
            batch,
            m,
            n,
            k,
            a: KArg::In(0),
            b: KArg::In(1),
            bias: None,
            relu: false,
            mask: None,
            a_row_sums: None,
            lda: ca,
            ldb: cb,
            batch_a: ra * ca,
            batch_b: rb * cb,
            a_bf16: false,
            b_bf16: false,
            copy: None,
            residual: None,
            out_bf16: false,
        })
    }
}

// ---- the cost estimate ----
pub(crate) mod cost {
    use crate::launch::{elementwise, gemm, Cost, LaunchSpec};

    pub(crate) fn linear(c: &Cost) -> LaunchSpec {
        gemm(
            "gemm_linear",
            c.ins[0].rows(),
            c.ins[1].dims()[0],
            c.ins[1].dims()[1],
        )
    }

    /// The layer, and the cross update's operands read and its outputs written in the
    /// epilogue: `[x, w, b?, a, c] -> [y, z (, bf16(z))]`.
    pub(crate) fn linear_mul_add(c: &Cost) -> LaunchSpec {
        let mut s = linear(c);
        let n = c.ins.len().saturating_sub(2);
        let bytes = |shapes: &[&erase_graph::Shape], sizes: &[f64], from: usize| -> f64 {
            (from..shapes.len())
                .map(|i| shapes[i].numel() as f64 * sizes.get(i).copied().unwrap_or(c.e))
                .sum()
        };
        s.bytes += bytes(c.ins, c.in_e, n) + bytes(c.outs, c.out_e, 1);
        // the update, as MulAdd counts it (an operation an element)
        s.flops += c.out0() as f64;
        s
    }

    /// The layer, and the residual read in its epilogue.
    pub(crate) fn linear_add(c: &Cost) -> LaunchSpec {
        let mut s = linear(c);
        s.bytes += c.out_bytes();
        s
    }

    /// The product, and with `residual` the residual read in its epilogue.
    pub(crate) fn linear_grad_input(c: &Cost, residual: bool) -> LaunchSpec {
        let mut s = gemm(
            "gemm_linear_dx",
            c.ins[0].rows(),
            c.ins[1].dims()[1],
            c.ins[1].dims()[0],
        );
        if residual {
            s.bytes += c.out_bytes();
        }
        s
    }

    pub(crate) fn linear_grad_weight(c: &Cost) -> LaunchSpec {
        let o = c.outs[0].dims();
        let mut s = gemm("gemm_linear_dw", o[0], o[1], c.ins[0].rows());
        // too few output tiles to fill the device: split K (the rows) in slices that a
        // second pass sums in a fixed order
        let split = (132 / s.grid.max(1))
            .clamp(1, 64)
            .min(c.ins[0].rows().div_ceil(256) as u64);
        s.grid *= split;
        s
    }

    pub(crate) fn matmul(c: &Cost, ta: bool) -> LaunchSpec {
        let o = c.outs[0].dims();
        let r = o.len();
        let batch = if r == 3 { o[0] } else { 1 };
        let a = c.ins[0].dims();
        let k = if ta { a[r - 2] } else { a[r - 1] };
        let mut s = gemm("gemm_batched", o[r - 2], o[r - 1], k);
        s.grid *= batch as u64;
        s.flops *= batch as f64;
        s.bytes *= batch as f64;
        s
    }

    /// f32 in, bf16 out (and the column sums' partials).
    pub(crate) fn round_bf16(c: &Cost) -> LaunchSpec {
        let n = c.ins[0].numel();
        elementwise("round_bf16", n, 6.0 * n as f64)
    }
}
