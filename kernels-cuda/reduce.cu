// Column reductions: sum_to_shape (out[j] = Σ_i dy[i·n + j], the gradient of a broadcast
// operand or a bias) and the fixed-order final pass shared with layer norm's dgamma/dbeta.
//
// Deterministic two passes, no atomics:
//  sum_to_shape_partial: grid (ceil(n/32), S), block (32, 8). CTA (x, s) owns 32
//    consecutive columns and slice s of the rows; thread (tx, ty) sums rows ty, ty+8, ...
//    of the slice in order (each warp reads 128 contiguous bytes of a row per step), the
//    8 partial sums of a column are added in ty order in shared memory, and the result
//    goes to part[s·n + j].
//  colsum_final: 32×8 threads per 32 columns; thread (tx, ty) adds slices ty, ty+8, ...
//    of its column in order, then the 8 sums are added in ty order (coalesced rows of
//    partials, 8 loads in flight a column instead of one long serial chain).
// S is a function of the shape only (ops/src/cuda/misc.rs::col_slices), so the summation
// order is the same on every run; with S == 1 the plan writes the output in pass 1.
// Bound: memory (4 bytes per input element; the partials are S·n floats, S ≤ 256).
#include "common.cuh"

ERASE_KERNEL void sum_to_shape_partial(const float* __restrict__ dy, float* __restrict__ part, long long rows,
                                       long long n, long long rows_per_slice) { ERASE_PDL_ENTER();
    __shared__ float sh[8][33];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const long long j = (long long)blockIdx.x * 32 + tx;
    const long long s = blockIdx.y;
    const long long r0 = s * rows_per_slice;
    const long long r1 = min(rows, r0 + rows_per_slice);
    float a = 0.0f;
    if (j < n)
        for (long long r = r0 + ty; r < r1; r += 8) a += dy[r * n + j];
    sh[ty][tx] = a;
    __syncthreads();
    if (ty == 0 && j < n) {
        float t = sh[0][tx];
#pragma unroll
        for (int k = 1; k < 8; ++k) t += sh[k][tx];
        part[s * n + j] = t;
    }
}

// out[j] = Σ_{s < slices} part[s·n + j]: grid ceil(n/32), block (32, 8). Thread (tx, ty)
// adds slices ty, ty+8, ty+16, ... in order (loads issued four at a time, added in
// order), then the 8 sums of a column are added in ty order: a fixed order for a given
// number of slices.
ERASE_KERNEL void colsum_final(const float* __restrict__ part, float* __restrict__ out, int slices, long long n) { ERASE_PDL_ENTER();
    __shared__ float sh[8][33];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const long long j = (long long)blockIdx.x * 32 + tx;
    float t = 0.0f;
    if (j < n) {
        int s = ty;
        for (; s + 24 < slices; s += 32) {
            const float a = part[(long long)s * n + j], b = part[(long long)(s + 8) * n + j];
            const float c = part[(long long)(s + 16) * n + j], d = part[(long long)(s + 24) * n + j];
            t += a;
            t += b;
            t += c;
            t += d;
        }
        for (; s < slices; s += 8) t += part[(long long)s * n + j];
    }
    sh[ty][tx] = t;
    __syncthreads();
    if (ty == 0 && j < n) {
        float r = sh[0][tx];
#pragma unroll
        for (int k = 1; k < 8; ++k) r += sh[k][tx];
        out[j] = r;
    }
}
