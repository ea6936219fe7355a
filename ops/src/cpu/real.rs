//! The float types the CPU reference computes in (f32 for training, f64 for gradient
//! checks), and the matrix product both use.

use rayon::prelude::*;
use std::ops::{Add, AddAssign, Div, Mul, MulAssign, Neg, Sub, SubAssign};

pub trait Real:
    Copy
    + Send
    + Sync
    + PartialOrd
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
    + AddAssign
    + SubAssign
    + MulAssign
    + 'static
{
    const ZERO: Self;
    const ONE: Self;
    fn from_f64(v: f64) -> Self;
    fn to_f64(self) -> f64;
    fn exp(self) -> Self;
    fn ln(self) -> Self;
    fn ln_1p(self) -> Self;
    fn sqrt(self) -> Self;
    fn tanh(self) -> Self;
    fn abs(self) -> Self;
    fn max(self, o: Self) -> Self;
    fn neg_infinity() -> Self;
    fn is_finite(self) -> bool;
    /// `c[M,N] = a[M,K]·b[K,N]` (overwrites `c`) with element strides (row, col) for each.
    ///
    /// # Safety
    /// The pointers with their strides must address valid memory for the given sizes,
    /// and `c` must not overlap `a` or `b`.
    #[allow(clippy::too_many_arguments)]
    unsafe fn gemm_raw(
        m: usize,
        k: usize,
        n: usize,
        a: *const Self,
        rsa: isize,
        csa: isize,
        b: *const Self,
        rsb: isize,
        csb: isize,
        c: *mut Self,
        rsc: isize,
        csc: isize,
    );
}

macro_rules! impl_real {
    ($t:ty, $gemm:path) => {
        impl Real for $t {
            const ZERO: Self = 0.0;
            const ONE: Self = 1.0;
            fn from_f64(v: f64) -> Self {
                v as $t
            }
            fn to_f64(self) -> f64 {
                self as f64
            }
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            fn ln(self) -> Self {
                <$t>::ln(self)
            }
            fn ln_1p(self) -> Self {
                <$t>::ln_1p(self)
            }
            fn sqrt(self) -> Self {
                <$t>::sqrt(self)
            }
            fn tanh(self) -> Self {
                <$t>::tanh(self)
            }
            fn abs(self) -> Self {
                <$t>::abs(self)
            }
            fn max(self, o: Self) -> Self {
                <$t>::max(self, o)
            }
            fn neg_infinity() -> Self {
                <$t>::NEG_INFINITY
            }
            fn is_finite(self) -> bool {
                <$t>::is_finite(self)
            }
            unsafe fn gemm_raw(
                m: usize,
                k: usize,
                n: usize,
                a: *const Self,
                rsa: isize,
                csa: isize,
                b: *const Self,
                rsb: isize,
                csb: isize,
                c: *mut Self,
                rsc: isize,
                csc: isize,
            ) {
                if k == 0 {
                    for i in 0..m {
                        for j in 0..n {
                            // SAFETY: (i, j) lies inside c's m x n extent (caller's contract).
                            unsafe { *c.offset(i as isize * rsc + j as isize * csc) = 0.0 };
                        }
                    }
                    return;
                }
                // SAFETY: forwarded caller contract: valid, non-overlapping operands.
                unsafe { $gemm(m, k, n, 1.0, a, rsa, csa, b, rsb, csb, 0.0, c, rsc, csc) }
            }
        }
    };
}

impl_real!(f32, matrixmultiply::sgemm);
impl_real!(f64, matrixmultiply::dgemm);

/// A strided matrix operand: element (i, j) is at `data[i·rs + j·cs]`.
#[derive(Clone, Copy)]
pub struct Mat<'a, T> {
    pub data: &'a [T],
    pub rs: usize,
    pub cs: usize,
}

impl<'a, T> Mat<'a, T> {
    /// Row-major `[rows, cols]`, optionally viewed transposed.
    pub fn row_major(data: &'a [T], cols: usize, transposed: bool) -> Self {
        if transposed {
            Mat {
                data,
                rs: 1,
                cs: cols,
            }
        } else {
            Mat {
                data,
                rs: cols,
                cs: 1,
            }
        }
    }
}

/// Rows of the output handled by one parallel task: enough work to beat the overhead.
fn rows_per_task(m: usize, k: usize, n: usize) -> usize {
    let work_per_row = (k * n).max(1);
    (1usize << 18).div_ceil(work_per_row).clamp(1, m.max(1))
}

/// `c[M,N] = a·b` (row-major `c`), split by rows of `c` across the current rayon pool.
/// Each element is computed by one task with the same arithmetic whatever the split,
/// so the result does not depend on the number of threads.
pub fn gemm<T: Real>(m: usize, k: usize, n: usize, a: Mat<T>, b: Mat<T>, c: &mut [T]) {
    assert_eq!(c.len(), m * n, "gemm output size");
    if m == 0 || n == 0 {
        return;
    }
    let chunk = rows_per_task(m, k, n);
    let task = |(ci, cc): (usize, &mut [T])| {
        let r0 = ci * chunk;
        let rows = cc.len() / n;
        let a_off = r0 * a.rs;
        // Bounds: the last element read from `a` is ((r0 + rows - 1)·rs + (k - 1)·cs),
        // checked by slicing so the raw call below stays inside the slices.
        let a_need = if k == 0 {
            0
        } else {
            (rows - 1) * a.rs + (k - 1) * a.cs + 1
        };
        let b_need = if k == 0 {
            0
        } else {
            (k - 1) * b.rs + (n - 1) * b.cs + 1
        };
        let a_sl = &a.data[a_off..a_off + a_need];
        let b_sl = &b.data[..b_need];
        // SAFETY: `a_sl`, `b_sl` and `cc` cover every element the product touches (the
        // slicing above panics otherwise), and `cc` is a distinct &mut, so no overlap.
        unsafe {
            T::gemm_raw(
                rows,
                k,
                n,
                a_sl.as_ptr(),
                a.rs as isize,
                a.cs as isize,
                b_sl.as_ptr(),
                b.rs as isize,
                b.cs as isize,
                cc.as_mut_ptr(),
                n as isize,
                1,
            )
        }
    };
    if chunk >= m {
        task((0, c));
    } else {
        c.par_chunks_mut(chunk * n).enumerate().for_each(task);
    }
}
