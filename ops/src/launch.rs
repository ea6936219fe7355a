//! How each op launches on a GPU: kernel, grid, block, the CTA's registers and shared
//! memory, and the work it does (FLOPs, bytes). The scheduler's occupancy model reads
//! these. Register and shared-memory figures are declared estimates until the kernels'
//! ptxas reports replace them.

pub use crate::dispatch::{launch_spec, launch_spec_typed};
use erase_graph::Shape;

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
    /// The fused attention kernels, at a rate of their own.
    pub attention: bool,
    /// Launches of the op beside this one (its operands' rounding, a split-K reduction, a
    /// column sum's last pass): set where the op's CUDA plan is known.
    pub extra_launches: u32,
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
        attention: false,
        extra_launches: 0,
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
        attention: false,
        extra_launches: 0,
    }
}

/// What a family's cost estimate reads: the operands' shapes and element sizes.
pub(crate) struct Cost<'a> {
    pub ins: &'a [&'a Shape],
    pub outs: &'a [&'a Shape],
    /// Bytes of one element of the op's float type.
    pub e: f64,
    /// Bytes of one element of each input and output, where known (a bf16 operand is 2);
    /// `e` for those past their end.
    pub in_e: &'a [f64],
    pub out_e: &'a [f64],
}

impl Cost<'_> {
    pub fn out_bytes(&self) -> f64 {
        self.outs
            .iter()
            .enumerate()
            .map(|(i, s)| s.numel() as f64 * self.out_e.get(i).copied().unwrap_or(self.e))
            .sum()
    }

    /// Bytes of every operand, read or written once.
    pub fn moved(&self) -> f64 {
        self.ins
            .iter()
            .enumerate()
            .map(|(i, s)| s.numel() as f64 * self.in_e.get(i).copied().unwrap_or(self.e))
            .sum::<f64>()
            + self.out_bytes()
    }

    /// Elements of the first output.
    pub fn out0(&self) -> usize {
        self.outs.first().map_or(1, |s| s.numel())
    }
}
