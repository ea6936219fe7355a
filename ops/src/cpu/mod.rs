//! The CPU backend's execution of one node: typed dispatch to the reference kernels.

pub use crate::family::embedding::cpu as embedding;
pub mod kernels;
pub mod real;

pub(crate) use crate::buffer::Buffer;
pub(crate) use erase_graph::{DType, Op, Shape};
pub(crate) use half::bf16;
pub(crate) use kernels::{AttnDims, AttnGradIn, AxisView};
pub(crate) use real::Real;
use std::fmt;

/// An error raised while executing a node (bad data such as an id out of range, or an
/// unsupported element type), naming the node.
#[derive(Debug, Clone, PartialEq)]
pub struct OpError {
    pub op: &'static str,
    pub node: String,
    pub msg: String,
}

impl fmt::Display for OpError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} node '{}': {}", self.op, self.node, self.msg)
    }
}

impl std::error::Error for OpError {}

/// One node to execute: its op, name and the shapes of its operands.
pub struct NodeCall<'a> {
    pub op: &'a Op,
    pub name: &'a str,
    pub in_shapes: Vec<&'a Shape>,
    pub out_shapes: Vec<&'a Shape>,
    /// Round GEMM operands (linear, its gradients, matmul) to bf16 first, as the CUDA
    /// kernels do, so the CPU can reproduce the GPU's mixed precision.
    pub bf16_gemm: bool,
}

impl<'a> NodeCall<'a> {
    /// An error of this node.
    pub(crate) fn error(&self, msg: String) -> OpError {
        OpError {
            op: self.op.name(),
            node: self.name.to_string(),
            msg,
        }
    }

    /// The same call with only its first `k` outputs: the plain op under one that also
    /// writes copies of an output (computed from the plain op's outputs).
    pub(crate) fn first_outputs(&self, k: usize) -> NodeCall<'a> {
        NodeCall {
            op: self.op,
            name: self.name,
            in_shapes: self.in_shapes.clone(),
            out_shapes: self.out_shapes[..k].to_vec(),
            bf16_gemm: self.bf16_gemm,
        }
    }
}

/// `x` with every element rounded to bf16 (nearest even) and back.
pub(crate) fn round_bf16<T: Real>(x: &[T]) -> Vec<T> {
    x.iter()
        .map(|&v| T::from_f64(bf16_rne(v.to_f64()).to_f64()))
        .collect()
}

/// `x` rounded to the nearest bf16, ties to even (the kernels' `__float2bfloat16_rn`).
/// `half::bf16::from_f64` rounds some values just above a tie down (0x4b488003 as an f32
/// gives 0x4b48), so a value that is an f32 goes through `from_f32`, and any other one
/// first to f32 by rounding to odd (truncated, its last bit set when inexact), which
/// leaves the bf16 rounding of the f32 that of x.
pub(crate) fn bf16_rne(x: f64) -> half::bf16 {
    let f = x as f32;
    if !f.is_finite() || f as f64 == x {
        return half::bf16::from_f32(f);
    }
    let mut bits = f.to_bits();
    if (f as f64).abs() > x.abs() {
        bits -= 1; // the magnitude below x: truncation
    }
    half::bf16::from_f32(f32::from_bits(bits | 1))
}

/// Float types with typed access to a [`Buffer`].
pub trait Elem: Real {
    fn to_buffer(v: Vec<Self>) -> Buffer;
    fn get(b: &Buffer) -> Option<&[Self]>;
    fn get_mut(b: &mut Buffer) -> Option<&mut [Self]>;
}

impl Elem for f32 {
    fn to_buffer(v: Vec<f32>) -> Buffer {
        Buffer::F32(v)
    }
    fn get(b: &Buffer) -> Option<&[f32]> {
        match b {
            Buffer::F32(v) => Some(v),
            _ => None,
        }
    }
    fn get_mut(b: &mut Buffer) -> Option<&mut [f32]> {
        match b {
            Buffer::F32(v) => Some(v),
            _ => None,
        }
    }
}

impl Elem for f64 {
    fn to_buffer(v: Vec<f64>) -> Buffer {
        Buffer::F64(v)
    }
    fn get(b: &Buffer) -> Option<&[f64]> {
        match b {
            Buffer::F64(v) => Some(v),
            _ => None,
        }
    }
    fn get_mut(b: &mut Buffer) -> Option<&mut [f64]> {
        match b {
            Buffer::F64(v) => Some(v),
            _ => None,
        }
    }
}

/// Executes `call`: reads `ins`, writes every element of `outs` (allocated by the caller
/// with the outputs' types and sizes), and rewrites `upd` in place (optimizer updates).
pub fn execute(
    call: &NodeCall,
    ins: &[&Buffer],
    outs: &mut [Buffer],
    upd: &mut [Buffer],
) -> Result<(), OpError> {
    let err = |msg: String| call.error(msg);
    // the ops of any element type first, each in its family
    if let Some(r) = crate::dispatch::exec_untyped(call, ins, outs, upd) {
        return r;
    }
    // the storage forms (a bf16 copy beside an output, an output or an operand in bf16),
    // each in its op's family, composed of the plain form
    if let Some(r) = crate::dispatch::exec_stored(call, ins, outs, upd) {
        return r;
    }
    let float = ins
        .iter()
        .map(|b| b.dtype())
        .chain(upd.iter().map(|b| b.dtype()))
        .find(|d| d.is_float());
    match float {
        Some(DType::F32) => exec_typed::<f32>(call, ins, outs, upd).map_err(err),
        Some(DType::F64) => exec_typed::<f64>(call, ins, outs, upd).map_err(err),
        Some(other) => Err(err(format!(
            "the CPU backend computes {} in f32 or f64, not {other}; cast first",
            call.op.name()
        ))),
        None => Err(err("no floating-point operand".into())),
    }
}

/// A storage form (the families' `exec_stored`): `outs[..plain]` by the plain form, then
/// `outs[plain]`, the bf16 copy of output 0 that a GEMM reads, written beside it
/// (`Graph::copy_output`).
pub(crate) fn with_copy(
    call: &NodeCall,
    ins: &[&Buffer],
    outs: &mut [Buffer],
    upd: &mut [Buffer],
    plain: usize,
) -> Result<(), OpError> {
    execute(&call.first_outputs(plain), ins, &mut outs[..plain], upd)?;
    outs[plain] = cast(&outs[0], DType::Bf16);
    Ok(())
}

/// A storage form: the one output stored in bf16, the f32 output rounded.
pub(crate) fn rounded(
    call: &NodeCall,
    ins: &[&Buffer],
    outs: &mut [Buffer],
    upd: &mut [Buffer],
) -> Result<(), OpError> {
    let mut wide = [Buffer::F32(vec![0.0; outs[0].len()])];
    execute(call, ins, &mut wide, upd)?;
    let [y] = wide;
    outs[0] = cast(&y, DType::Bf16);
    Ok(())
}

/// A storage form: bf16 operands (copies, or activations stored in bf16) read as their f32
/// values.
pub(crate) fn widened(
    call: &NodeCall,
    ins: &[&Buffer],
    outs: &mut [Buffer],
    upd: &mut [Buffer],
) -> Result<(), OpError> {
    let wide: Vec<Option<Buffer>> = ins
        .iter()
        .map(|b| (b.dtype() == DType::Bf16).then(|| cast(b, DType::F32)))
        .collect();
    let refs: Vec<&Buffer> = ins
        .iter()
        .zip(&wide)
        .map(|(b, w)| w.as_ref().unwrap_or(b))
        .collect();
    execute(call, &refs, outs, upd)
}

/// Whether `bufs` has `n` buffers and the last is bf16 (an output's copy).
pub(crate) fn copy_last(bufs: &[Buffer], n: usize) -> bool {
    bufs.len() == n && bufs[n - 1].dtype() == DType::Bf16
}

/// Whether any of `ins` is bf16.
pub(crate) fn any_bf16(ins: &[&Buffer]) -> bool {
    ins.iter().any(|b| b.dtype() == DType::Bf16)
}

/// `y[r·w + c] = Σ_j in_j[r·ld + off + c]`, summed in input order, left to right (as the
/// CUDA kernels do): GradSum (one row) and SliceSum (a window of each row).
pub(crate) fn sum_rows<T: Elem>(
    ins: &[&Buffer],
    y: &mut [T],
    w: usize,
    ld: usize,
    off: usize,
) -> Result<(), String> {
    let parts: Vec<&[T]> = ins
        .iter()
        .map(|b| get::<T>(b, "gradient"))
        .collect::<Result<_, _>>()?;
    if parts.is_empty() {
        return Err("no gradient contributions to sum".into());
    }
    // (w == 0 only with an empty y: nothing is divided by it)
    kernels::map_index(y, |i| {
        let j = (i / w) * ld + off + i % w;
        let mut s = parts[0][j];
        for p in &parts[1..] {
            s += p[j];
        }
        s
    });
    Ok(())
}

pub(crate) fn cast(b: &Buffer, to: DType) -> Buffer {
    match (b, to) {
        (Buffer::F32(v), DType::Bf16) => {
            Buffer::Bf16(v.iter().map(|&x| bf16::from_f32(x)).collect())
        }
        (Buffer::F64(v), DType::Bf16) => Buffer::Bf16(v.iter().map(|&x| bf16_rne(x)).collect()),
        (Buffer::Bf16(v), DType::F32) => Buffer::F32(v.iter().map(|x| x.to_f32()).collect()),
        _ => Buffer::from_f64(to, &b.to_f64()),
    }
}

pub(crate) fn get<'a, T: Elem>(b: &'a Buffer, what: &str) -> Result<&'a [T], String> {
    T::get(b).ok_or_else(|| {
        format!(
            "{what} has element type {}, expected the node's float type",
            b.dtype()
        )
    })
}

pub(crate) fn get_i32<'a>(b: &'a Buffer, what: &str) -> Result<&'a [i32], String> {
    b.as_i32()
        .ok_or_else(|| format!("{what} must be i32, got {}", b.dtype()))
}

pub(crate) fn out<T: Elem>(b: &mut Buffer) -> Result<&mut [T], String> {
    let dt = b.dtype();
    T::get_mut(b).ok_or_else(|| format!("output buffer has element type {dt}"))
}

pub(crate) fn scalar<T: Elem>(b: &Buffer) -> Result<T, String> {
    get::<T>(b, "scalar")?
        .first()
        .copied()
        .ok_or_else(|| "empty scalar".to_string())
}

/// Splits `outs` into three distinct mutable slices.
pub(crate) type Three<'a, T> = (&'a mut [T], &'a mut [T], &'a mut [T]);

pub(crate) fn three<T: Elem>(outs: &mut [Buffer]) -> Result<Three<'_, T>, String> {
    let [a, b, c] = outs else {
        return Err("expected three outputs".into());
    };
    Ok((out::<T>(a)?, out::<T>(b)?, out::<T>(c)?))
}

/// The three `[rows, w]` parts of a `[rows, 3·w]` tensor (packed q, k, v).
pub(crate) fn unpack3<T: Elem>(x: &[T], w: usize) -> [Vec<T>; 3] {
    let part = |i: usize| -> Vec<T> {
        x.chunks(3 * w)
            .flat_map(|r| r[i * w..(i + 1) * w].iter().copied())
            .collect()
    };
    [part(0), part(1), part(2)]
}

/// The inverse of [`unpack3`]: three `[rows, w]` tensors side by side in `y [rows, 3·w]`.
pub(crate) fn pack3<T: Elem>(parts: [&[T]; 3], w: usize, y: &mut [T]) {
    for (r, row) in y.chunks_mut(3 * w).enumerate() {
        for (i, p) in parts.iter().enumerate() {
            row[i * w..(i + 1) * w].copy_from_slice(&p[r * w..(r + 1) * w]);
        }
    }
}

fn exec_typed<T: Elem>(
    call: &NodeCall,
    ins: &[&Buffer],
    outs: &mut [Buffer],
    upd: &mut [Buffer],
) -> Result<(), String> {
    // operands the kernels round to bf16: the two matrices of a GEMM (a bias is added in
    // f32), q, k, v of attention, and do, q, k, v of its backward
    let rounded_inputs = match call.op {
        Op::Linear { .. }
        | Op::LinearGradInput { .. }
        | Op::LinearGradWeight { .. }
        | Op::MatMul { .. } => 2,
        Op::Attention { packed: true, .. } => 1,
        Op::AttentionGrad { packed: true, .. } => 2,
        Op::Attention { .. } => 3,
        Op::AttentionGrad { .. } => 4,
        _ => 0,
    };
    // the fused bias gradient sums dy as it is (SumToShape's kernel and order), before
    // any rounding of the GEMM operands
    if let Op::LinearGradWeight { bias: true } = call.op {
        let [_, db] = outs else {
            return Err("expected two outputs: dw and db".into());
        };
        kernels::sum_to_shape(get::<T>(ins[0], "dy")?, out(db)?);
    }
    if call.bf16_gemm && rounded_inputs > 0 {
        let mut owned: Vec<Buffer> = Vec::with_capacity(ins.len());
        for (i, b) in ins.iter().enumerate() {
            owned.push(if i < rounded_inputs {
                T::to_buffer(round_bf16(get::<T>(b, "operand")?))
            } else {
                (*b).clone()
            });
        }
        let refs: Vec<&Buffer> = owned.iter().collect();
        return crate::dispatch::exec_inner::<T>(call, &refs, outs, upd);
    }
    crate::dispatch::exec_inner::<T>(call, ins, outs, upd)
}

pub(crate) use kernels::AdamHyper;

#[cfg(test)]
mod rounding_tests {
    use super::bf16_rne;

    #[test]
    fn bf16_rounding_is_to_nearest_even() {
        // just above a tie rounds up, a tie to even, from f32 and from f64
        for (bits, want) in [
            (0x4b48_8003u32, 0x4b49u16),
            (0x4b48_8000, 0x4b48),
            (0x4b49_8000, 0x4b4a),
            (0x6a72_8001, 0x6a73),
            (0x4b48_7fff, 0x4b48),
        ] {
            let x = f32::from_bits(bits);
            assert_eq!(bf16_rne(x as f64).to_bits(), want, "{bits:#x}");
            assert_eq!(half::bf16::from_f32(x).to_bits(), want, "{bits:#x}");
        }
        // an f64 between two f32s at a bf16 tie: above it, up; below, down
        let tie = f32::from_bits(0x4b48_8000) as f64;
        assert_eq!(bf16_rne(tie * (1.0 + 1e-12)).to_bits(), 0x4b49);
        assert_eq!(bf16_rne(tie * (1.0 - 1e-12)).to_bits(), 0x4b48);
        assert_eq!(bf16_rne(-tie * (1.0 + 1e-12)).to_bits(), 0xcb49);
    }
}
