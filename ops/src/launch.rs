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

pub(crate) fn ceil(a: usize, b: usize) -> u64 {
    a.div_ceil(b.max(1)) as u64
}

/// A GEMM of `m x n x k` on the default kernels.
pub(crate) fn gemm(kernel: &'static str, m: usize, n: usize, k: usize) -> LaunchSpec {
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

/// A map over `elems` elements moving `bytes`.
pub(crate) fn elementwise(kernel: &'static str, elems: usize, bytes: f64) -> LaunchSpec {
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

/// What a family's cost estimate reads: the operands' shapes and the element size.
pub(crate) struct Cost<'a> {
    pub ins: &'a [&'a Shape],
    pub outs: &'a [&'a Shape],
    /// Bytes of one element.
    pub e: f64,
}

impl Cost<'_> {
    pub fn out_bytes(&self) -> f64 {
        self.outs.iter().map(|s| s.numel() as f64 * self.e).sum()
    }

    /// Bytes of every operand, read or written once.
    pub fn moved(&self) -> f64 {
        self.ins
            .iter()
            .map(|s| s.numel() as f64 * self.e)
            .sum::<f64>()
            + self.out_bytes()
    }

    /// Elements of the first output.
    pub fn out0(&self) -> usize {
        self.outs.first().map_or(1, |s| s.numel())
    }
}

/// The launch of `op` with operand shapes `ins` -> `outs` (element type `dt`): one line
/// an op, no fallback, each estimate in its family's `cost`.
pub fn launch_spec(op: &Op, ins: &[&Shape], outs: &[&Shape], dt: DType) -> Option<LaunchSpec> {
    use crate::family::{
        attention::cost as attention, elementwise::cost as elementwise,
        embedding::cost as embedding, gemm::cost as gemm, interaction::cost as interaction,
        loss::cost as loss, norm::cost as norm, optim::cost as optim, reduce::cost as reduce,
        shape::cost as shape,
    };
    let c = &Cost {
        ins,
        outs,
        e: dt.size_bytes() as f64,
    };
    let mut spec = match op {
        Op::Leaf(_) | Op::Reshape | Op::Detach => return None,
        Op::Linear { .. } => gemm::linear(c),
        Op::LinearAdd { .. } => gemm::linear_add(c),
        Op::LinearGradInput { .. } => gemm::linear_grad_input(c),
        Op::LinearGradWeight { .. } => gemm::linear_grad_weight(c),
        Op::MatMul { ta, .. } => gemm::matmul(c, *ta),
        Op::RoundBf16 { .. } => gemm::round_bf16(c),
        Op::Attention { heads, packed, .. } => attention::attention(c, *heads, *packed, false),
        Op::AttentionGrad { heads, packed, .. } => attention::attention(c, *heads, *packed, true),
        Op::Add => elementwise::map(c),
        Op::Mul => elementwise::map(c),
        Op::MulAdd => elementwise::map(c),
        Op::MulGrad => elementwise::map(c),
        Op::Scale { .. } => elementwise::map(c),
        Op::Relu => elementwise::map(c),
        Op::Gelu => elementwise::map(c),
        Op::Sigmoid => elementwise::map(c),
        Op::ReluGrad => elementwise::map(c),
        Op::GeluGrad => elementwise::map(c),
        Op::SigmoidGrad => elementwise::map(c),
        Op::Cast { .. } => elementwise::map(c),
        Op::Concat { .. } => shape::map(c),
        Op::Slice { .. } => shape::map(c),
        Op::Split { .. } => shape::map(c),
        Op::Pad { .. } => shape::map(c),
        Op::LayerNorm { .. } => norm::layer_norm(c, false),
        Op::LayerNormGrad => norm::layer_norm(c, true),
        Op::SumToShape => reduce::sum_to_shape(c),
        Op::Sum => reduce::to_scalar(c),
        Op::Mean => reduce::to_scalar(c),
        Op::Broadcast { .. } => reduce::map(c),
        Op::GradSum => reduce::map(c),
        Op::SliceSum { .. } => reduce::slice_sum(c),
        Op::PairwiseDot => interaction::pairwise_dot(c, false),
        Op::PairwiseDotGrad => interaction::pairwise_dot(c, true),
        Op::BceWithLogits => loss::to_scalar(c),
        Op::BceWithLogitsGrad => loss::map(c),
        Op::SoftmaxCrossEntropy => loss::to_scalar(c),
        Op::SoftmaxCrossEntropyGrad => loss::map(c),
        Op::StepIncrement => optim::step_increment(c),
        Op::Sgd { .. } => optim::multi_tensor(c, false),
        Op::Adam { .. } => optim::multi_tensor(c, true),
        Op::EmbeddingBag { .. } => embedding::embedding_bag(c),
        Op::EmbeddingBagGradDense { .. } => embedding::embedding_bag(c),
        Op::BagMean { .. } => embedding::bag_mean(c),
        Op::EmbeddingSort { field_rows } => embedding::embedding_sort(c, field_rows),
        Op::RowwiseAdagrad { .. } => embedding::rowwise_adagrad(c),
    };
    // a GEMM whose operands are bf16 (the copies it reads in place)
    spec.copies = dt == DType::Bf16
        && matches!(
            op,
            Op::Linear { .. } | Op::LinearGradInput { .. } | Op::LinearGradWeight { .. }
        );
    Some(spec)
}
