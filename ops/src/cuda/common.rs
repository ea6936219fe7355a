//! Helpers every op family's launch plans share: the launch shapes (1-D grid-stride, a warp a
//! row), the argument constructors, operand checks and the column-sum geometry.

use super::{blocks, CudaPlan, KArg, KernelCall, Operands};
use erase_graph::{DType, Op};
use KArg::I64;

/// Threads of a 1-D elementwise CTA.
pub(crate) const EW_THREADS: u32 = 256;

/// Grid-stride kernels launch at most this many CTAs (8 waves of a 132-SM H200 at 8
/// CTAs an SM); larger tensors loop.
pub(crate) const MAX_BLOCKS: u32 = 8192;

/// Default dynamic shared memory limit (no opt-in attribute needed below it).
pub(crate) const SMEM_DEFAULT: usize = 48 * 1024;

/// Tensors per optimizer-table or embedding-meta builder launch (the kernels' signature).
pub(crate) const BUILD_SLOTS: usize = 32;

pub(crate) fn kc(
    kernel: &'static str,
    grid: [u32; 3],
    block: [u32; 3],
    smem: u32,
    args: Vec<KArg>,
) -> KernelCall {
    KernelCall {
        kernel,
        grid,
        block,
        smem,
        args,
    }
}

/// A 1-D grid-stride launch over `n` elements.
pub(crate) fn ew(kernel: &'static str, n: usize, args: Vec<KArg>) -> KernelCall {
    kc(
        kernel,
        [blocks(n, EW_THREADS as usize).min(MAX_BLOCKS), 1, 1],
        [EW_THREADS, 1, 1],
        0,
        args,
    )
}

/// A warp-per-row launch over `rows` rows (8 warps a CTA).
pub(crate) fn warp_rows(kernel: &'static str, rows: usize, args: Vec<KArg>) -> KernelCall {
    kc(
        kernel,
        [blocks(rows, 8).min(MAX_BLOCKS), 1, 1],
        [256, 1, 1],
        0,
        args,
    )
}

pub(crate) fn n64(n: usize) -> KArg {
    I64(n as i64)
}

pub(crate) fn i32_of(v: usize, what: &str) -> Result<i32, String> {
    i32::try_from(v).map_err(|_| format!("{what} = {v} does not fit the kernels' i32"))
}

/// `(column blocks, iters, row slices)` of the kernels that write a [rows][cols] tensor's
/// column sums as partials from their own pass, in the layout of `gemm_round_colsum`
/// (grid (column blocks, row slices), 64 columns and 32·iters rows a CTA): 256 rows a
/// CTA, fewer where that leaves under two CTAs an SM (a narrow tensor). Part of the
/// summation order: every such kernel must take it from here.
pub(crate) fn colsum_geometry(rows: usize, cols: usize, sms: usize) -> (usize, usize, usize) {
    let col_blocks = cols.div_ceil(64);
    let iters = [8usize, 4, 2]
        .into_iter()
        .find(|i| col_blocks * rows.div_ceil(32 * i) >= 2 * sms)
        .unwrap_or(1);
    (col_blocks, iters, rows.div_ceil(32 * iters))
}

pub(crate) fn plan_of(calls: Vec<KernelCall>, scratch: Vec<usize>) -> CudaPlan {
    CudaPlan { calls, scratch }
}

/// Checks the operand counts and element types.
pub(crate) fn expect(op: &Op, o: &Operands, ins: &[DType], outs: &[DType]) -> Result<(), String> {
    if o.ins.len() != ins.len()
        || o.in_dtypes.len() != ins.len()
        || o.outs.len() != outs.len()
        || o.out_dtypes.len() != outs.len()
    {
        return Err(format!(
            "{}: expected {} inputs and {} outputs, got {} and {}",
            op.name(),
            ins.len(),
            outs.len(),
            o.ins.len(),
            o.outs.len()
        ));
    }
    for (i, (got, want)) in o.in_dtypes.iter().zip(ins).enumerate() {
        if got != want {
            return Err(format!(
                "{}: input {i} is {got}, the CUDA kernel takes {want}",
                op.name()
            ));
        }
    }
    for (i, (got, want)) in o.out_dtypes.iter().zip(outs).enumerate() {
        if got != want {
            return Err(format!(
                "{}: output {i} is {got}, the CUDA kernel writes {want}",
                op.name()
            ));
        }
    }
    Ok(())
}

pub(crate) const F: DType = DType::F32;

pub(crate) const I: DType = DType::I32;
