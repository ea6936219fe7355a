//! How each op launches on a GPU: kernel, grid, block, the CTA's registers and shared
//! memory, and the work it does (FLOPs, bytes). The scheduler's occupancy model reads
//! these. Register and shared-memory figures are declared estimates until the kernels'
//! ptxas reports replace them.

use erase_graph::{DType, Op, Shape};

/// One kernel launch of an op.
#[derive(Clone, Debug, PartialEq)]
pub struct LaunchSpec {
    pub kernel: &'static str,
    /// CTAs in the grid.
    pub grid: u64,
    /// Threads per CTA.
    pub block: u32,
    pub regs_per_thread: u32,
    pub smem_bytes: u32,
    /// Floating-point operations.
    pub flops: f64,
    /// Bytes read and written in global memory (the minimum the op must move).
    pub bytes: f64,
    /// True when the FLOPs run on tensor cores (bf16 GEMM operands).
    pub tensor_core: bool,
    /// A GEMM whose first operand is a bf16 copy read in place (`Graph::set_bf16_copies`;
    /// in the CTR model its other operand is one too): the pipelined kernels with no
    /// rounding pass, at a rate of their own.
    pub copies: bool,
}

fn ceil(a: usize, b: usize) -> u64 {
    a.div_ceil(b.max(1)) as u64
}

fn gemm(kernel: &'static str, m: usize, n: usize, k: usize) -> LaunchSpec {
    // 128x128 output tiles, 8 warps, a 3-stage bf16 pipeline of 128x64 A and B tiles
    let (m, n, k) = (m as f64, n as f64, k as f64);
    LaunchSpec {
        kernel,
        grid: ceil(m as usize, 128) * ceil(n as usize, 128),
        block: 256,
        regs_per_thread: 128,
        smem_bytes: 3 * (128 * 64 + 128 * 64) * 2,
        flops: 2.0 * m * n * k,
        bytes: 2.0 * (m * k + n * k) + 4.0 * m * n,
        tensor_core: true,
        copies: false,
    }
}

fn elementwise(kernel: &'static str, elems: usize, bytes: f64) -> LaunchSpec {
    LaunchSpec {
        kernel,
        grid: ceil(elems, 256 * 4).max(1),
        block: 256,
        regs_per_thread: 32,
        smem_bytes: 0,
        flops: elems as f64,
        bytes,
        tensor_core: false,
        copies: false,
    }
}

/// The launch of `op` with operand shapes `ins` -> `outs` (element type `dt`).
pub fn launch_spec(op: &Op, ins: &[&Shape], outs: &[&Shape], dt: DType) -> Option<LaunchSpec> {
    let e = dt.size_bytes() as f64;
    let numel = |s: &Shape| s.numel();
    let in_bytes: f64 = ins.iter().map(|s| numel(s) as f64 * e).sum();
    let out_bytes: f64 = outs.iter().map(|s| numel(s) as f64 * e).sum();
    let moved = in_bytes + out_bytes;
    let out0 = outs.first().map_or(1, |s| numel(s));
    let mut spec = match op {
        Op::Leaf(_) | Op::Reshape | Op::Detach => return None,
        Op::Linear { .. } => gemm(
            "gemm_linear",
            ins[0].rows(),
            ins[1].dims()[0],
            ins[1].dims()[1],
        ),
        Op::LinearAdd { .. } => {
            // the layer, and the residual read in its epilogue
            let mut s = gemm(
                "gemm_linear",
                ins[0].rows(),
                ins[1].dims()[0],
                ins[1].dims()[1],
            );
            s.bytes += out_bytes;
            s
        }
        Op::LinearGradInput { .. } => gemm(
            "gemm_linear_dx",
            ins[0].rows(),
            ins[1].dims()[1],
            ins[1].dims()[0],
        ),
        Op::LinearGradWeight { .. } => {
            let mut s = gemm(
                "gemm_linear_dw",
                outs[0].dims()[0],
                outs[0].dims()[1],
                ins[0].rows(),
            );
            // too few output tiles to fill the device: split K (the rows) in slices that a
            // second pass sums in a fixed order
            let split = (132 / s.grid.max(1))
                .clamp(1, 64)
                .min(ceil(ins[0].rows(), 256));
            s.grid *= split;
            s
        }
        Op::MatMul { ta, .. } => {
            let o = outs[0].dims();
            let r = o.len();
            let batch = if r == 3 { o[0] } else { 1 };
            let a = ins[0].dims();
            let k = if *ta { a[r - 2] } else { a[r - 1] };
            let mut s = gemm("gemm_batched", o[r - 2], o[r - 1], k);
            s.grid *= batch as u64;
            s.flops *= batch as f64;
            s.bytes *= batch as f64;
            s
        }
        Op::Attention { heads, .. } | Op::AttentionGrad { heads, .. } => {
            let q = if matches!(op, Op::Attention { .. }) {
                ins[0]
            } else {
                ins[1]
            };
            let d = q.dims();
            let packed = matches!(
                op,
                Op::Attention { packed: true, .. } | Op::AttentionGrad { packed: true, .. }
            );
            let (b, s) = (d[0], d[1]);
            let w = if packed { d[2] / 3 } else { d[2] };
            let dh = w / heads;
            let fwd = 4.0 * (b * heads * s * s * dh) as f64;
            let bwd = matches!(op, Op::AttentionGrad { .. });
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
                bytes: moved,
                tensor_core: true,
                copies: false,
            }
        }
        Op::LayerNorm { .. } | Op::LayerNormGrad => LaunchSpec {
            kernel: if matches!(op, Op::LayerNorm { .. }) {
                "layer_norm_fwd"
            } else {
                "layer_norm_bwd"
            },
            grid: ceil(ins[0].rows().max(ins.get(1).map_or(1, |s| s.rows())), 8),
            block: 256,
            regs_per_thread: 48,
            smem_bytes: 0,
            flops: 8.0 * out0 as f64,
            bytes: moved,
            tensor_core: false,
            copies: false,
        },
        Op::EmbeddingBag { .. } | Op::EmbeddingBagGradDense { .. } => LaunchSpec {
            kernel: "embedding_bag_fwd",
            grid: ceil(out0 / outs[0].last().max(1), 8),
            block: 256,
            regs_per_thread: 40,
            smem_bytes: 0,
            flops: out0 as f64,
            // each looked-up row is read once, each pooled row written once
            bytes: (ins[1].numel() * outs[0].last()) as f64 * e + out_bytes,
            tensor_core: false,
            copies: false,
        },
        // reads y and the offsets and ids once, writes z
        Op::BagMean { .. } => elementwise(
            "emb_bag_mean",
            out0,
            2.0 * out_bytes + (ins[1].numel() + ins[2].numel()) as f64 * 4.0,
        ),
        Op::EmbeddingSort { field_rows } => {
            // the keys, then one 8-bit LSD pass per byte the row keys use, each reading
            // and writing keys and bags
            let n = ins[0].numel();
            let total: usize = field_rows.iter().sum();
            let passes = ((usize::BITS - total.leading_zeros()) as usize)
                .div_ceil(8)
                .max(1);
            LaunchSpec {
                kernel: "emb_radix_scatter",
                grid: ceil(n, 2048).max(1),
                block: 256,
                regs_per_thread: 32,
                smem_bytes: 4 * 1024,
                flops: (8 * n) as f64,
                bytes: (12 * n + passes * 16 * n) as f64,
                tensor_core: false,
                copies: false,
            }
        }
        Op::RowwiseAdagrad { .. } => {
            let d = ins[2].last();
            let n = ins[0].numel();
            LaunchSpec {
                kernel: "embedding_bag_bwd_rowwise_adagrad",
                grid: ceil(n, 8),
                block: 256,
                regs_per_thread: 48,
                smem_bytes: 8 * 1024,
                flops: (4 * n * d) as f64,
                bytes: (3 * n * d) as f64 * 4.0,
                tensor_core: false,
                copies: false,
            }
        }
        Op::PairwiseDot | Op::PairwiseDotGrad => {
            let d = if matches!(op, Op::PairwiseDot) {
                ins[0].dims()
            } else {
                ins[1].dims()
            };
            let (b, f, dim) = (d[0], d[1], d[2]);
            LaunchSpec {
                kernel: if matches!(op, Op::PairwiseDot) {
                    "pairwise_dot_fwd"
                } else {
                    "pairwise_dot_bwd"
                },
                grid: b as u64,
                block: 128,
                regs_per_thread: 64,
                smem_bytes: (f * dim * 4) as u32,
                flops: (b * f * f * dim) as f64,
                bytes: moved,
                tensor_core: false,
                copies: false,
            }
        }
        Op::SumToShape => LaunchSpec {
            kernel: "sum_to_shape",
            // 32 columns per CTA, rows split in up to 64 slices summed in a fixed order
            grid: ceil(out0, 32) * ceil(ins[0].numel() / out0.max(1), 128).clamp(1, 64),
            block: 256,
            regs_per_thread: 32,
            smem_bytes: 4096,
            flops: ins[0].numel() as f64,
            bytes: moved,
            tensor_core: false,
            copies: false,
        },
        Op::Adam { .. } | Op::Sgd { .. } => {
            let n: usize = ins
                .iter()
                .skip(usize::from(matches!(op, Op::Adam { .. })))
                .map(|s| s.numel())
                .sum();
            let per = if matches!(op, Op::Adam { .. }) {
                16.0 + 12.0
            } else {
                12.0
            };
            LaunchSpec {
                kernel: if matches!(op, Op::Adam { .. }) {
                    "adam_multi_tensor"
                } else {
                    "sgd_multi_tensor"
                },
                grid: ceil(n, 256 * 4).max(1),
                block: 256,
                regs_per_thread: 40,
                smem_bytes: 0,
                flops: 10.0 * n as f64,
                bytes: per * n as f64,
                tensor_core: false,
                copies: false,
            }
        }
        // f32 in, bf16 out (and the column sums' partials)
        Op::RoundBf16 { .. } => {
            elementwise("round_bf16", ins[0].numel(), 6.0 * ins[0].numel() as f64)
        }
        Op::StepIncrement => elementwise("step_increment", 1, 8.0),
        Op::BceWithLogits | Op::SoftmaxCrossEntropy | Op::Sum | Op::Mean => LaunchSpec {
            kernel: "reduce_loss",
            grid: 1,
            block: 1024,
            regs_per_thread: 32,
            smem_bytes: 4096,
            flops: 4.0 * ins[0].numel() as f64,
            bytes: moved,
            tensor_core: false,
            copies: false,
        },
        // reads only the window of each contribution
        Op::SliceSum { .. } => {
            elementwise("ew_slice_sum", out0, (ins.len() + 1) as f64 * out_bytes)
        }
        // every operand read or written once, as a map
        Op::Add
        | Op::Mul
        | Op::MulAdd
        | Op::Scale { .. }
        | Op::Relu
        | Op::Gelu
        | Op::Sigmoid
        | Op::Concat { .. }
        | Op::Slice { .. }
        | Op::Split { .. }
        | Op::Cast { .. }
        | Op::ReluGrad
        | Op::GeluGrad
        | Op::MulGrad
        | Op::SigmoidGrad
        | Op::Pad { .. }
        | Op::BceWithLogitsGrad
        | Op::SoftmaxCrossEntropyGrad
        | Op::Broadcast { .. }
        | Op::GradSum => elementwise("elementwise", out0, moved),
    };
    // a GEMM whose operands are bf16 (the copies it reads in place)
    spec.copies = dt == DType::Bf16
        && matches!(
            op,
            Op::Linear { .. } | Op::LinearGradInput { .. } | Op::LinearGradWeight { .. }
        );
    Some(spec)
}
