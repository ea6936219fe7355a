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
// layer_norm_fwd_v4 / layer_norm_bwd_v4 (d % 4 == 0, d <= 128: the CTR model's
// widths): a group of L = pow2 >= d/4 lanes per row, one float4 of the row a lane, held in
// registers (x read once); 32/L rows a warp and two rows a group in flight (rows r and
// r + stride), so a warp has 2·32/L rows' loads outstanding where the warp-per-row kernel
// has one row's. Row sums: each lane's four elements in order, then the xor tree over
// the group. The loop runs per warp (its first row decides), so the shuffles never
// diverge.
//
// Numerics follow ops/src/cpu/kernels.rs: mean = Σx / d, var = Σ(x-μ)² / d, rstd =
// 1/sqrt(var + eps), y = (x-μ)·rstd·γ + β, written without FMA contraction where the
// reference rounds each step; only the order of the row sums differs (tree, not serial).
#include "common.cuh"

#define LN_ROWS_PER_CTA 8  // 256 threads = 8 warps, one row each

ERASE_KERNEL void layer_norm_fwd(const float* __restrict__ x, const float* __restrict__ gamma,
                                 const float* __restrict__ beta, float* __restrict__ y, float* __restrict__ mean,
                                 float* __restrict__ rstd, long long rows, int d, float eps) { ERASE_PDL_ENTER();
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

// One row of the layer norm's data gradient, for the warp that owns it: the row's two
// means (lanes over columns, then the warp's fixed tree), then dx at any column c:
// rstd · (dy·γ − mean(dy·γ) − xhat · mean(dy·γ·xhat)).
struct LnBwdRow {
    const float* xr;
    const float* dyr;
    float mu, rs, m1, m2;
    __device__ __forceinline__ LnBwdRow(const float* __restrict__ dy, const float* __restrict__ x,
                                        const float* __restrict__ gamma, const float* __restrict__ mean,
                                        const float* __restrict__ rstd, long long r, int d, float inv_d, int lane)
        : xr(x + r * d), dyr(dy + r * d), mu(mean[r]), rs(rstd[r]) {
        float s1 = 0.0f, s2 = 0.0f;
        for (int c = lane; c < d; c += 32) {
            const float xh = erase_mul(erase_sub(xr[c], mu), rs);
            const float g = erase_mul(dyr[c], __ldg(gamma + c));
            s1 += g;
            s2 = fmaf(g, xh, s2);
        }
        m1 = erase_mul(erase_warp_sum(s1), inv_d);
        m2 = erase_mul(erase_warp_sum(s2), inv_d);
    }
    __device__ __forceinline__ float dx(const float* __restrict__ gamma, int c) const {
        const float xh = erase_mul(erase_sub(xr[c], mu), rs);
        const float g = erase_mul(dyr[c], __ldg(gamma + c));
        return erase_mul(rs, erase_sub(erase_sub(g, m1), erase_mul(xh, m2)));
    }
};

// dx = rstd · (dy·γ − mean(dy·γ) − xhat · mean(dy·γ·xhat)), one warp per row.
ERASE_KERNEL void layer_norm_bwd_dx(const float* __restrict__ dy, const float* __restrict__ x,
                                    const float* __restrict__ gamma, const float* __restrict__ mean,
                                    const float* __restrict__ rstd, float* __restrict__ dx, long long rows, int d,
                                    float inv_d) { ERASE_PDL_ENTER();
    const int lane = threadIdx.x & 31;
    const long long warps = (long long)gridDim.x * (blockDim.x >> 5);
    for (long long r = erase_gtid() >> 5; r < rows; r += warps) {
        const LnBwdRow row(dy, x, gamma, mean, rstd, r, d, inv_d, lane);
        float* dxr = dx + r * d;
        for (int c = lane; c < d; c += 32) dxr[c] = row.dx(gamma, c);
    }
}

// layer_norm_bwd_dx whose dx is a linear layer's dy (Graph::set_bf16_copies): also
// dxb = bf16(dx), and part[b·d + c] = the sum of dx[r][c] over the rows CTA b's warps
// visit (each warp over its rows in visit order into its own row of shared memory, then
// the 8 warps' sums in warp order; colsum_final adds the gridDim.x partials in CTA
// order: the grid is a function of the shape only). Block 256, dynamic shared memory
// 8·d floats.
ERASE_KERNEL void __launch_bounds__(256)
    layer_norm_bwd_dx_bf16(const float* __restrict__ dy, const float* __restrict__ x,
                           const float* __restrict__ gamma, const float* __restrict__ mean,
                           const float* __restrict__ rstd, float* __restrict__ dx, __nv_bfloat16* __restrict__ dxb,
                           float* __restrict__ part, long long rows, int d, float inv_d) { ERASE_PDL_ENTER();
    extern __shared__ float cs[];
    const int lane = threadIdx.x & 31;
    float* mine = cs + (threadIdx.x >> 5) * d;
    for (int c = lane; c < d; c += 32) mine[c] = 0.f;
    const long long warps = (long long)gridDim.x * (blockDim.x >> 5);
    for (long long r = erase_gtid() >> 5; r < rows; r += warps) {
        const LnBwdRow row(dy, x, gamma, mean, rstd, r, d, inv_d, lane);
        for (int c = lane; c < d; c += 32) {
            const float v = row.dx(gamma, c);
            dx[r * d + c] = v;
            dxb[r * d + c] = __float2bfloat16_rn(v);
            mine[c] = erase_add(mine[c], v);
        }
    }
    __syncthreads();
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float t = 0.f;
        for (int q = 0; q < (int)(blockDim.x >> 5); ++q) t = erase_add(t, cs[q * d + c]);
        part[(long long)blockIdx.x * d + c] = t;
    }
}

// Pass 1 of dgamma/dbeta: grid (ceil(d/32), S), block (32, 8). Slice s covers rows
// [s·rows_per_slice, min((s+1)·rows_per_slice, rows)).
ERASE_KERNEL void layer_norm_bwd_dgb_partial(const float* __restrict__ dy, const float* __restrict__ x,
                                             const float* __restrict__ mean, const float* __restrict__ rstd,
                                             float* __restrict__ part_g, float* __restrict__ part_b, long long rows,
                                             int d, long long rows_per_slice) { ERASE_PDL_ENTER();
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

// ---- d % 4 == 0, d <= 128: lane groups ----------------------------------------------------

__device__ __forceinline__ float ln_group_sum(float v, int L) {
    for (int o = L >> 1; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float4 ln_load4(const float* p, bool ok) {
    return ok ? __ldg(reinterpret_cast<const float4*>(p)) : make_float4(0.f, 0.f, 0.f, 0.f);
}

// The row statistics and y of one row held as a float4 a lane (`ok`: the lane's columns
// exist in this row).
__device__ __forceinline__ void ln_fwd_row(float4 v, bool ok, bool row_ok, const float4 gm, const float4 bt,
                                           float* __restrict__ y, float* __restrict__ mean, float* __restrict__ rstd,
                                           long long r, int d, float fd, float eps, int L, int sub) {
    float s = ok ? erase_add(erase_add(erase_add(v.x, v.y), v.z), v.w) : 0.f;
    const float mu = erase_div(ln_group_sum(s, L), fd);
    float q = 0.f;
    if (ok) {
        const float t0 = erase_sub(v.x, mu), t1 = erase_sub(v.y, mu), t2 = erase_sub(v.z, mu), t3 = erase_sub(v.w, mu);
        q = fmaf(t0, t0, q);
        q = fmaf(t1, t1, q);
        q = fmaf(t2, t2, q);
        q = fmaf(t3, t3, q);
    }
    const float var = erase_div(ln_group_sum(q, L), fd);
    const float rs = erase_div(1.0f, erase_sqrt(erase_add(var, eps)));
    if (ok && row_ok) {
        float4 o;
        o.x = erase_add(erase_mul(erase_mul(erase_sub(v.x, mu), rs), gm.x), bt.x);
        o.y = erase_add(erase_mul(erase_mul(erase_sub(v.y, mu), rs), gm.y), bt.y);
        o.z = erase_add(erase_mul(erase_mul(erase_sub(v.z, mu), rs), gm.z), bt.z);
        o.w = erase_add(erase_mul(erase_mul(erase_sub(v.w, mu), rs), gm.w), bt.w);
        *reinterpret_cast<float4*>(y + r * d + 4 * sub) = o;
    }
    if (row_ok && sub == 0) {
        mean[r] = mu;
        rstd[r] = rs;
    }
}

// Block 256; rows of warp w: w·R + g and w·R + g + warps·R (R = 32/L rows a warp, g the
// lane's group), then on by 2·warps·R. Rows are 16-byte aligned: d % 4 == 0 and the runtime's arena
// aligns tensors to 256 bytes.
ERASE_KERNEL void layer_norm_fwd_v4(const float* __restrict__ x, const float* __restrict__ gamma,
                                    const float* __restrict__ beta, float* __restrict__ y, float* __restrict__ mean,
                                    float* __restrict__ rstd, long long rows, int d, float eps, int lanes_log2) { ERASE_PDL_ENTER();
    const int L = 1 << lanes_log2, R = 32 >> lanes_log2;
    const int lane = threadIdx.x & 31, sub = lane & (L - 1), grp = lane >> lanes_log2;
    const long long warps = (long long)gridDim.x * (blockDim.x >> 5);
    const long long step = warps * R;
    const bool ok = 4 * sub < d;
    const float4 gm = ln_load4(gamma + 4 * sub, ok), bt = ln_load4(beta + 4 * sub, ok);
    const float fd = (float)d;
    for (long long w0 = (erase_gtid() >> 5) * R; w0 < rows; w0 += 2 * step) {
        const long long ra = w0 + grp, rb = ra + step;
        const bool oka = ra < rows, okb = rb < rows;
        const float4 va = ln_load4(x + ra * d + 4 * sub, ok && oka);
        const float4 vb = ln_load4(x + rb * d + 4 * sub, ok && okb);
        ln_fwd_row(va, ok, oka, gm, bt, y, mean, rstd, ra, d, fd, eps, L, sub);
        ln_fwd_row(vb, ok, okb, gm, bt, y, mean, rstd, rb, d, fd, eps, L, sub);
    }
}

__device__ __forceinline__ void ln_bwd_row(float4 g4, float4 x4, bool ok, bool row_ok, const float4 gm, float mu,
                                           float rs, float* __restrict__ dx, long long r, int d, float inv_d, int L,
                                           int sub, float4& ag, float4& ab) {
    float xh[4], g[4];
    const float xs[4] = {x4.x, x4.y, x4.z, x4.w}, dys[4] = {g4.x, g4.y, g4.z, g4.w};
    const float gms[4] = {gm.x, gm.y, gm.z, gm.w};
    float s1 = 0.f, s2 = 0.f;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        xh[e] = erase_mul(erase_sub(xs[e], mu), rs);
        g[e] = erase_mul(dys[e], gms[e]);
        if (ok) {
            s1 += g[e];
            s2 = fmaf(g[e], xh[e], s2);
        }
    }
    const float m1 = erase_mul(ln_group_sum(s1, L), inv_d);
    const float m2 = erase_mul(ln_group_sum(s2, L), inv_d);
    if (ok && row_ok) {
        // this lane's share of dgamma = Σ dy·xhat and dbeta = Σ dy, row after row
        ag.x = fmaf(dys[0], xh[0], ag.x);
        ag.y = fmaf(dys[1], xh[1], ag.y);
        ag.z = fmaf(dys[2], xh[2], ag.z);
        ag.w = fmaf(dys[3], xh[3], ag.w);
        ab.x += dys[0];
        ab.y += dys[1];
        ab.z += dys[2];
        ab.w += dys[3];
        float o[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) o[e] = erase_mul(rs, erase_sub(erase_sub(g[e], m1), erase_mul(xh[e], m2)));
        *reinterpret_cast<float4*>(dx + r * d + 4 * sub) = make_float4(o[0], o[1], o[2], o[3]);
    }
}

// dx of layer_norm_bwd_dx with the lane groups of layer_norm_fwd_v4, and dgamma, dbeta
// from the same loads: each lane sums its four columns over the rows it visits (in visit
// order), the CTA's lanes of a column are added in thread order, and CTA b writes
// part_g[b·d + j], part_b[b·d + j] (the outputs themselves when the grid is one CTA;
// else colsum_final adds the gridDim.x partials in CTA order). The grid is a function of
// the shape only: a fixed order.
ERASE_KERNEL void __launch_bounds__(256)
    layer_norm_bwd_v4(const float* __restrict__ dy, const float* __restrict__ x, const float* __restrict__ gamma,
                      const float* __restrict__ mean, const float* __restrict__ rstd, float* __restrict__ dx,
                      float* __restrict__ part_g, float* __restrict__ part_b, long long rows, int d, float inv_d,
                      int lanes_log2) { ERASE_PDL_ENTER();
    __shared__ float4 sg[256], sb[256];
    const int L = 1 << lanes_log2, R = 32 >> lanes_log2;
    const int lane = threadIdx.x & 31, sub = lane & (L - 1), grp = lane >> lanes_log2;
    const long long warps = (long long)gridDim.x * (blockDim.x >> 5);
    const long long step = warps * R;
    const bool ok = 4 * sub < d;
    const float4 gm = ln_load4(gamma + 4 * sub, ok);
    float4 ag = make_float4(0.f, 0.f, 0.f, 0.f), ab = ag;
    for (long long w0 = (erase_gtid() >> 5) * R; w0 < rows; w0 += 2 * step) {
        const long long ra = w0 + grp, rb = ra + step;
        const bool oka = ra < rows, okb = rb < rows;
        const float4 ga = ln_load4(dy + ra * d + 4 * sub, ok && oka), xa = ln_load4(x + ra * d + 4 * sub, ok && oka);
        const float4 gb = ln_load4(dy + rb * d + 4 * sub, ok && okb), xb = ln_load4(x + rb * d + 4 * sub, ok && okb);
        const float mua = oka ? __ldg(mean + ra) : 0.f, rsa = oka ? __ldg(rstd + ra) : 0.f;
        const float mub = okb ? __ldg(mean + rb) : 0.f, rsb = okb ? __ldg(rstd + rb) : 0.f;
        ln_bwd_row(ga, xa, ok, oka, gm, mua, rsa, dx, ra, d, inv_d, L, sub, ag, ab);
        ln_bwd_row(gb, xb, ok, okb, gm, mub, rsb, dx, rb, d, inv_d, L, sub, ag, ab);
    }
    sg[threadIdx.x] = ag;
    sb[threadIdx.x] = ab;
    __syncthreads();
    // threads sub, sub + L, sub + 2L, ... hold column chunk sub
    if (threadIdx.x < L && ok) {
        float4 tg = sg[threadIdx.x], tb = sb[threadIdx.x];
        for (int q = threadIdx.x + L; q < (int)blockDim.x; q += L) {
            const float4 u = sg[q], v = sb[q];
            tg.x += u.x;
            tg.y += u.y;
            tg.z += u.z;
            tg.w += u.w;
            tb.x += v.x;
            tb.y += v.y;
            tb.z += v.z;
            tb.w += v.w;
        }
        const long long at = (long long)blockIdx.x * d + 4 * sub;
        *reinterpret_cast<float4*>(part_g + at) = tg;
        *reinterpret_cast<float4*>(part_b + at) = tb;
    }
}
