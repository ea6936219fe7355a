//! Host buffers: the CPU backend's storage of one tensor.

use erase_graph::DType;
use half::bf16;

/// The elements of one tensor in host memory.
#[derive(Clone, Debug, PartialEq)]
pub enum Buffer {
    F32(Vec<f32>),
    F64(Vec<f64>),
    Bf16(Vec<bf16>),
    I32(Vec<i32>),
}

impl Buffer {
    /// `n` zero elements of `dtype`.
    pub fn zeros(dtype: DType, n: usize) -> Self {
        match dtype {
            DType::F32 => Buffer::F32(vec![0.0; n]),
            DType::F64 => Buffer::F64(vec![0.0; n]),
            DType::Bf16 => Buffer::Bf16(vec![bf16::ZERO; n]),
            DType::I32 => Buffer::I32(vec![0; n]),
        }
    }

    /// `n` NaNs (or `i32::MIN` for integers): poison that makes an unwritten element show.
    pub fn poison(dtype: DType, n: usize) -> Self {
        match dtype {
            DType::F32 => Buffer::F32(vec![f32::NAN; n]),
            DType::F64 => Buffer::F64(vec![f64::NAN; n]),
            DType::Bf16 => Buffer::Bf16(vec![bf16::NAN; n]),
            DType::I32 => Buffer::I32(vec![i32::MIN; n]),
        }
    }

    /// Values given in f64, converted to `dtype` (rounded for floats, truncated for i32).
    pub fn from_f64(dtype: DType, v: &[f64]) -> Self {
        match dtype {
            DType::F32 => Buffer::F32(v.iter().map(|&x| x as f32).collect()),
            DType::F64 => Buffer::F64(v.to_vec()),
            DType::Bf16 => Buffer::Bf16(v.iter().map(|&x| crate::cpu::bf16_rne(x)).collect()),
            DType::I32 => Buffer::I32(v.iter().map(|&x| x as i32).collect()),
        }
    }

    pub fn dtype(&self) -> DType {
        match self {
            Buffer::F32(_) => DType::F32,
            Buffer::F64(_) => DType::F64,
            Buffer::Bf16(_) => DType::Bf16,
            Buffer::I32(_) => DType::I32,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Buffer::F32(v) => v.len(),
            Buffer::F64(v) => v.len(),
            Buffer::Bf16(v) => v.len(),
            Buffer::I32(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every element rounded to bf16 (nearest even), as RoundBf16 and the kernels round:
    /// a parameter's bf16 copy (`Leaf::ParamCopy`).
    pub fn to_bf16(&self) -> Buffer {
        crate::cpu::cast(self, DType::Bf16)
    }

    /// Every element as f64 (for metrics, checks and printing).
    pub fn to_f64(&self) -> Vec<f64> {
        match self {
            Buffer::F32(v) => v.iter().map(|&x| x as f64).collect(),
            Buffer::F64(v) => v.clone(),
            Buffer::Bf16(v) => v.iter().map(|x| x.to_f64()).collect(),
            Buffer::I32(v) => v.iter().map(|&x| x as f64).collect(),
        }
    }

    pub fn as_f32(&self) -> Option<&[f32]> {
        match self {
            Buffer::F32(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_i32(&self) -> Option<&[i32]> {
        match self {
            Buffer::I32(v) => Some(v),
            _ => None,
        }
    }

    /// The raw bytes, for checksums and bit-identity checks.
    pub fn bytes(&self) -> &[u8] {
        match self {
            Buffer::F32(v) => bytemuck_bytes(v),
            Buffer::F64(v) => bytemuck_bytes(v),
            Buffer::Bf16(v) => bytemuck_bytes(v),
            Buffer::I32(v) => bytemuck_bytes(v),
        }
    }
}

fn bytemuck_bytes<T: bytemuck::Pod>(v: &[T]) -> &[u8] {
    bytemuck::cast_slice(v)
}
