// Layer norm over the last dimension, forward and backward.
//
// layer_norm_fwd / layer_norm_bwd_dx: one warp per row, two rows at a time (16 rows per
// 256-thread CTA, rows grid-strided). Lanes walk the row with stride 32 (coalesced 128-byte accesses); row sums
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

// Two rows a warp at a time (rows a and b; b == a when there is no second row, its
// results then not stored): each pass over the rows issues both rows' loads together, so
// twice the bytes are in flight per warp (one row at a time left the kernels bound by load
// latency at d = 64). Each row's arithmetic and order are those of one row alone.
__device__ __forceinline__ void ln_fwd_rows2(const float* __restrict__ xa, const float* __restrict__ xb,
                                             const float* __restrict__ gamma, const float* __restrict__ beta,
                                             float* __restrict__ ya, float* __restrict__ yb, int d, float eps,
                                             int lane, float (&mu)[2], float (&rs)[2]) {
    const float fd = (float)d;
    float sa = 0.0f, sb = 0.0f;
    for (int c = lane; c < d; c += 32) {
        sa += xa[c];
        sb += xb[c];
    }
    mu[0] = erase_div(erase_warp_sum(sa), fd);
    mu[1] = erase_div(erase_warp_sum(sb), fd);
    float va = 0.0f, vb = 0.0f;
    for (int c = lane; c < d; c += 32) {
        const float ta = erase_sub(xa[c], mu[0]), tb = erase_sub(xb[c], mu[1]);
        va = fmaf(ta, ta, va);
        vb = fmaf(tb, tb, vb);
    }
    const float vara = erase_div(erase_warp_sum(va), fd), varb = erase_div(erase_warp_sum(vb), fd);
    rs[0] = erase_div(1.0f, erase_sqrt(erase_add(vara, eps)));
    rs[1] = erase_div(1.0f, erase_sqrt(erase_add(varb, eps)));
    for (int c = lane; c < d; c += 32) {
        const float g = __ldg(gamma + c), be = __ldg(beta + c);
        ya[c] = erase_add(erase_mul(erase_mul(erase_sub(xa[c], mu[0]), rs[0]), g), be);
        if (yb) yb[c] = erase_add(erase_mul(erase_mul(erase_sub(xb[c], mu[1]), rs[1]), g), be);
    }
}

ERASE_KERNEL void layer_norm_fwd(const float* __restrict__ x, const float* __restrict__ gamma,
                                 const float* __restrict__ beta, float* __restrict__ y, float* __restrict__ mean,
                                 float* __restrict__ rstd, long long rows, int d, float eps) {
    const int lane = threadIdx.x & 31;
    const long long warps = (long long)gridDim.x * (blockDim.x >> 5);
    for (long long r = erase_gtid() >> 5; r < rows; r += 2 * warps) {
        const bool two = r + warps < rows;
        const long long r2 = two ? r + warps : r;
        float mu[2], rs[2];
        ln_fwd_rows2(x + r * d, x + r2 * d, gamma, beta, y + r * d, two ? y + r2 * d : nullptr, d, eps, lane, mu,
                     rs);
        if (lane == 0) {
            mean[r] = mu[0];
            rstd[r] = rs[0];
            if (two) {
                mean[r2] = mu[1];
                rstd[r2] = rs[1];
            }
        }
    }
}

// dx = rstd · (dy·γ − mean(dy·γ) − xhat · mean(dy·γ·xhat)), one warp per row, two rows at
// a time as layer_norm_fwd.
ERASE_KERNEL void layer_norm_bwd_dx(const float* __restrict__ dy, const float* __restrict__ x,
                                    const float* __restrict__ gamma, const float* __restrict__ mean,
                                    const float* __restrict__ rstd, float* __restrict__ dx, long long rows, int d,
                                    float inv_d) {
    const int lane = threadIdx.x & 31;
    const long long warps = (long long)gridDim.x * (blockDim.x >> 5);
    for (long long r = erase_gtid() >> 5; r < rows; r += 2 * warps) {
        const bool two = r + warps < rows;
        const long long rb = two ? r + warps : r;
        const float *xa = x + r * d, *xb = x + rb * d, *da = dy + r * d, *db = dy + rb * d;
        const float mua = mean[r], rsa = rstd[r], mub = mean[rb], rsb = rstd[rb];
        float s1a = 0.0f, s2a = 0.0f, s1b = 0.0f, s2b = 0.0f;
        for (int c = lane; c < d; c += 32) {
            const float gm = __ldg(gamma + c);
            const float xha = erase_mul(erase_sub(xa[c], mua), rsa), ga = erase_mul(da[c], gm);
            const float xhb = erase_mul(erase_sub(xb[c], mub), rsb), gb = erase_mul(db[c], gm);
            s1a += ga;
            s2a = fmaf(ga, xha, s2a);
            s1b += gb;
            s2b = fmaf(gb, xhb, s2b);
        }
        const float m1a = erase_mul(erase_warp_sum(s1a), inv_d), m2a = erase_mul(erase_warp_sum(s2a), inv_d);
        const float m1b = erase_mul(erase_warp_sum(s1b), inv_d), m2b = erase_mul(erase_warp_sum(s2b), inv_d);
        for (int c = lane; c < d; c += 32) {
            const float gm = __ldg(gamma + c);
            const float xha = erase_mul(erase_sub(xa[c], mua), rsa), ga = erase_mul(da[c], gm);
            dx[r * d + c] = erase_mul(rsa, erase_sub(erase_sub(ga, m1a), erase_mul(xha, m2a)));
            if (two) {
                const float xhb = erase_mul(erase_sub(xb[c], mub), rsb), gb = erase_mul(db[c], gm);
                dx[rb * d + c] = erase_mul(rsb, erase_sub(erase_sub(gb, m1b), erase_mul(xhb, m2b)));
            }
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
