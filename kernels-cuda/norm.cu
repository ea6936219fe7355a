// Layer norm over the last dimension, forward and backward.
//
// layer_norm_fwd / layer_norm_bwd_dx: one warp per row (8 rows per 256-thread CTA, rows
// grid-strided). Lanes walk the row with stride 32 (coalesced 128-byte accesses); row sums
// are per-lane sequential sums combined by the fixed xor-shuffle tree, so a row's result
// does not depend on the launch. The row is re-read from L1/L2 for each pass (x is read
// 3 times, from DRAM once). Bound: memory (fwd 8 bytes/element + 8 per row, bwd 12).
//
// layer_norm_bwd_dgb_partial: dgamma[j] = Σ_r dy·xhat, dbeta[j] = Σ_r dy, a column
// reduction done deterministically in two passes. Pass 1: CTA (32 columns) × (slice s of
// the rows), 32×8 threads; thread (tx, ty) sums rows ty, ty+8, ... of the slice in order,
// then the 8 partial sums of a column are added in ty order through shared memory and
// written to partial[s·d + j]. Pass 2 (colsum_final in reduce.cu) adds the S partials of
// each column in slice order. S depends only on the shape, so the order is fixed; with
// S == 1 the plan points pass 1 at the outputs and skips pass 2. Bound: memory (16 bytes
// per element read).
//
// Numerics follow ops/src/cpu/kernels.rs: mean = Σx / d, var = Σ(x-μ)² / d, rstd =
// 1/sqrt(var + eps), y = (x-μ)·rstd·γ + β, written without FMA contraction where the
// reference rounds each step; only the order of the row sums differs (tree, not serial).
#include "common.cuh"

#define LN_ROWS_PER_CTA 8  // 256 threads = 8 warps, one row each

ERASE_KERNEL void layer_norm_fwd(const float* __restrict__ x, const float* __restrict__ gamma,
                                 const float* __restrict__ beta, float* __restrict__ y, float* __restrict__ mean,
                                 float* __restrict__ rstd, long long rows, int d, float eps) {
    const int lane = threadIdx.x & 31;
    const long long warps = (long long)gridDim.x * (blockDim.x >> 5);
    const float fd = (float)d;
    for (long long r = erase_gtid() >> 5; r < rows; r += warps) {
        const float* xr = x + r * d;
        float s = 0.0f;
        for (int c = lane; c < d; c += 32) s += xr[c];
        const float mu = erase_div(erase_warp_sum(s), fd);
        float v = 0.0f;
        for (int c = lane; c < d; c += 32) {
            const float t = erase_sub(xr[c], mu);
            v = fmaf(t, t, v);
        }
        const float var = erase_div(erase_warp_sum(v), fd);
        const float rs = erase_div(1.0f, erase_sqrt(erase_add(var, eps)));
        float* yr = y + r * d;
        for (int c = lane; c < d; c += 32) {
            const float xh = erase_mul(erase_sub(xr[c], mu), rs);
            yr[c] = erase_add(erase_mul(xh, __ldg(gamma + c)), __ldg(beta + c));
        }
        if (lane == 0) {
            mean[r] = mu;
            rstd[r] = rs;
        }
    }
}

// dx = rstd · (dy·γ − mean(dy·γ) − xhat · mean(dy·γ·xhat)), one warp per row.
ERASE_KERNEL void layer_norm_bwd_dx(const float* __restrict__ dy, const float* __restrict__ x,
                                    const float* __restrict__ gamma, const float* __restrict__ mean,
                                    const float* __restrict__ rstd, float* __restrict__ dx, long long rows, int d,
                                    float inv_d) {
    const int lane = threadIdx.x & 31;
    const long long warps = (long long)gridDim.x * (blockDim.x >> 5);
    for (long long r = erase_gtid() >> 5; r < rows; r += warps) {
        const float* xr = x + r * d;
        const float* dyr = dy + r * d;
        const float mu = mean[r], rs = rstd[r];
        float s1 = 0.0f, s2 = 0.0f;
        for (int c = lane; c < d; c += 32) {
            const float xh = erase_mul(erase_sub(xr[c], mu), rs);
            const float g = erase_mul(dyr[c], __ldg(gamma + c));
            s1 += g;
            s2 = fmaf(g, xh, s2);
        }
        const float m1 = erase_mul(erase_warp_sum(s1), inv_d);
        const float m2 = erase_mul(erase_warp_sum(s2), inv_d);
        float* dxr = dx + r * d;
        for (int c = lane; c < d; c += 32) {
            const float xh = erase_mul(erase_sub(xr[c], mu), rs);
            const float g = erase_mul(dyr[c], __ldg(gamma + c));
            dxr[c] = erase_mul(rs, erase_sub(erase_sub(g, m1), erase_mul(xh, m2)));
        }
    }
}

// Pass 1 of dgamma/dbeta: grid (ceil(d/32), S), block (32, 8). Slice s covers rows
// [s·rows_per_slice, min((s+1)·rows_per_slice, rows)).
ERASE_KERNEL void layer_norm_bwd_dgb_partial(const float* __restrict__ dy, const float* __restrict__ x,
                                             const float* __restrict__ mean, const float* __restrict__ rstd,
                                             float* __restrict__ part_g, float* __restrict__ part_b, long long rows,
                                             int d, long long rows_per_slice) {
    __shared__ float sg[8][33], sb[8][33];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int j = blockIdx.x * 32 + tx;
    const long long s = blockIdx.y;
    const long long r0 = s * rows_per_slice;
    const long long r1 = min(rows, r0 + rows_per_slice);
    float ag = 0.0f, ab = 0.0f;
    if (j < d) {
        for (long long r = r0 + ty; r < r1; r += 8) {
            const float g = dy[r * d + j];
            const float xh = erase_mul(erase_sub(x[r * d + j], __ldg(mean + r)), __ldg(rstd + r));
            ag = fmaf(g, xh, ag);
            ab += g;
        }
    }
    sg[ty][tx] = ag;
    sb[ty][tx] = ab;
    __syncthreads();
    if (ty == 0 && j < d) {
        float tg = sg[0][tx], tb = sb[0][tx];
#pragma unroll
        for (int k = 1; k < 8; ++k) {
            tg += sg[k][tx];
            tb += sb[k][tx];
        }
        part_g[s * d + j] = tg;
        part_b[s * d + j] = tb;
    }
}
