//! How each op runs on a CUDA device: the kernel launches it takes, with their grids,
//! blocks, shared memory and arguments. The runtime resolves the operand arguments to
//! device pointers and issues the launches in order on one stream.
//!
//! GPU tensors are f32 (and i32 for ids); GEMM and attention kernels round their operands
//! to bf16 as they load them and accumulate in f32, as the spec's mixed precision asks.

mod dense;
mod misc;

use erase_graph::{DType, Op, Shape};

/// One argument of a kernel launch.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KArg {
    /// Device pointer to the node's input `i`.
    In(usize),
    /// Device pointer `bytes` into the node's input `i` (a part of a packed tensor).
    InAt(usize, u64),
    /// Device pointer to the node's output `i`.
    Out(usize),
    /// Device pointer `bytes` into the node's output `i`.
    OutAt(usize, u64),
    /// Device pointer to the node's updated (persistent) tensor `i`.
    Upd(usize),
    /// Device pointer to the node's scratch buffer `i` (see [`CudaPlan::scratch`]).
    Scratch(usize),
    /// Device pointer `bytes` into the node's scratch buffer `i`.
    ScratchAt(usize, u64),
    I32(i32),
    U32(u32),
    I64(i64),
    F32(f32),
}

/// One kernel launch.
#[derive(Clone, Debug, PartialEq)]
pub struct KernelCall {
    /// The `extern "C"` name of the kernel in `kernels-cuda/`.
    pub kernel: &'static str,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    /// Dynamic shared memory, bytes.
    pub smem: u32,
    pub args: Vec<KArg>,
}

/// The launches of one node, issued in order on one stream.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct CudaPlan {
    pub calls: Vec<KernelCall>,
    /// Bytes of each scratch buffer the calls use (contents undefined at the start; a
    /// call that needs zeros clears it itself).
    pub scratch: Vec<usize>,
}

/// Shapes and element types of a node's operands.
#[derive(Clone, Copy, Debug)]
pub struct Operands<'a> {
    pub ins: &'a [&'a Shape],
    pub in_dtypes: &'a [DType],
    pub outs: &'a [&'a Shape],
    pub out_dtypes: &'a [DType],
    pub upd: &'a [&'a Shape],
}

/// The launches of `op`, or why it cannot run on a CUDA device.
pub fn cuda_plan(op: &Op, o: &Operands) -> Result<CudaPlan, String> {
    if let Some(d) = o
        .in_dtypes
        .iter()
        .chain(o.out_dtypes)
        .find(|d| **d == DType::F64)
    {
        return Err(format!(
            "{}: the CUDA backend computes in f32 (with bf16 GEMM operands), not {d}",
            op.name()
        ));
    }
    if let Some(p) = dense::plan(op, o) {
        return p;
    }
    if let Some(p) = misc::plan(op, o) {
        return p;
    }
    Err(format!("{}: no CUDA kernel yet", op.name()))
}

/// Streaming multiprocessors of the target (H200); only tiling and grid heuristics depend
/// on it.
pub(crate) const SMS: usize = 132;

/// Every kernel name any plan uses; a test checks each against the embedded PTX.
pub fn kernel_names() -> Vec<&'static str> {
    let mut v: Vec<&'static str> = dense::KERNELS
        .iter()
        .chain(misc::KERNELS)
        .copied()
        .collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// `ceil(a / b)` as a grid dimension.
pub(crate) fn blocks(a: usize, b: usize) -> u32 {
    a.div_ceil(b.max(1)).max(1) as u32
}
