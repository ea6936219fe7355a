// The DLRM interaction: y[b, p] = <e[b,i], e[b,j]> over pairs i < j in row-major upper
// triangle order (p = 0 is (0,1)), e [B, F, D] -> y [B, F(F-1)/2], and its gradient.
//
// Tiling: examples grid-strided over small CTAs, many an SM (pd_fwd_blocked, a few
// examples a CTA at a time; pd_bwd_staged, one). An example's F×D block is staged in
// shared memory with an odd row stride (ld = D | 1) so that a warp reading column c of
// 32 different rows hits 32 different banks.
//  pairwise_dot_fwd: a thread computes a 3×3 block of the F×F dot matrix, each dot a
//    D-long sum in c order.
//  pairwise_dot_bwd: the pair gradients are expanded into a symmetric F×F matrix G in
//    shared memory (zero diagonal); a thread computes de[b, k, c] for 9 consecutive k
//    and one c as Σ_{m ascending} G[k][m] · e[b, m, c]; m ascending is exactly the order
//    in which the CPU reference's pair loop adds into de[b, k, c], so the sums match it.
// Products and sums are written without FMA contraction (erase_mul/erase_add): the result
// is bit-identical to the reference (for finite e). Bound: shared-memory bandwidth and
// FP32 issue (F=27, D=64: 22k multiply-adds per example over 6.9 KB of input); in DRAM
// terms ~7 KB read + 1.4 KB written per example (fwd), so a [4096, 27, 64] batch is
// ~35 MB. The `_gmem` variants read straight from global memory (L1-cached), a CTA an
// example, for examples whose F×D block does not fit the default 48 KB of shared memory.
#include "common.cuh"

// First pair index of row i: pairs (i, i+1), (i, i+2), ... start at i·(2F-1-i)/2.
__device__ __forceinline__ int pd_row_start(int i, int f) { return i * (2 * f - 1 - i) / 2; }

// Index of the pair {k, m} (k != m, either order).
__device__ __forceinline__ int pd_pair_index(int k, int m, int f) {
    return k < m ? pd_row_start(k, f) + (m - k - 1) : pd_row_start(m, f) + (k - m - 1);
}

// Row i and column j of pair p (i < j, row-major upper triangle): closed form, then fixed
// up against rounding.
__device__ __forceinline__ void pd_pair(int p, int f, int& i, int& j) {
    const float q = (float)(2 * f - 1);
    i = (int)((q - sqrtf(fmaxf(q * q - 8.0f * (float)p, 0.0f))) * 0.5f);
    i = max(0, min(i, f - 2));
    while (i > 0 && pd_row_start(i, f) > p) --i;
    while (i < f - 2 && pd_row_start(i + 1, f) <= p) ++i;
    j = i + 1 + (p - pd_row_start(i, f));
}

// ---- the global-memory forms (an example's block too big for shared memory) -----------

// y[b] from e straight from global memory (L1-cached): a CTA an example.
__device__ __forceinline__ void pd_fwd_gmem(const float* __restrict__ e, float* __restrict__ y, long long batch,
                                            int f, int d) {
    const int pairs = f * (f - 1) / 2;
    for (long long b = blockIdx.x; b < batch; b += gridDim.x) {
        const float* src = e + b * f * d;
        for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
            int i, j;
            pd_pair(p, f, i, j);
            const float* a = src + i * d;
            const float* c2 = src + j * d;
            float s = 0.0f;
            for (int c = 0; c < d; ++c) s = erase_add(s, erase_mul(a[c], c2[c]));
            y[b * pairs + p] = s;
        }
    }
}

// de[b] = G·E with G the symmetric F×F matrix of the pair gradients (no diagonal), read
// from dy: thread item (kb, c) computes de[k][c] for the PD_KB rows k = kb·PD_KB ..
// +PD_KB-1 at once, so one load of e[m][c] serves PD_KB outputs.
#define PD_KB 4

__device__ __forceinline__ void pd_bwd_gmem(const float* __restrict__ dy, const float* __restrict__ e,
                                            float* __restrict__ de, long long batch, int f, int d) {
    const int pairs = f * (f - 1) / 2;
    const int kblocks = (f + PD_KB - 1) / PD_KB;
    for (long long b = blockIdx.x; b < batch; b += gridDim.x) {
        const float* src = e + b * f * d;
        const float* gb = dy + b * pairs;
        for (int t = threadIdx.x; t < kblocks * d; t += blockDim.x) {
            const int kb = t / d, c = t - kb * d;
            const int k0 = kb * PD_KB;
            float s[PD_KB];
#pragma unroll
            for (int q = 0; q < PD_KB; ++q) s[q] = 0.0f;
            for (int m = 0; m < f; ++m) {
                const float x = src[m * d + c];
#pragma unroll
                for (int q = 0; q < PD_KB; ++q) {
                    const int k = k0 + q;
                    if (k < f && m != k) {
                        const float gv = gb[pd_pair_index(k, m, f)];
                        s[q] = erase_add(s[q], erase_mul(gv, x));
                    }
                }
            }
#pragma unroll
            for (int q = 0; q < PD_KB; ++q)
                if (k0 + q < f) de[b * f * d + (long long)(k0 + q) * d + c] = s[q];
        }
    }
}

// ---- the shared-memory forms ----------------------------------------------------------
//
// pairwise_dot_fwd: EX examples a CTA at a time (grid-strided), their F×D blocks staged in
// shared memory (a float4 a load where D is a multiple of 4); each thread computes a 3×3
// block of the F×F dot matrix, rows 3I.. and columns 3J.. with I ≤ J (nb(nb+1)/2 blocks an
// example, nb = ⌈F/3⌉), so each c costs six shared loads for nine products instead of two
// for one; it writes the pairs i < j of its block. Each dot still adds its products c
// ascending from 0, unfused: the reference's bits. (The diagonal blocks compute their
// i ≥ j entries for nothing: 405 dots for 351 at F = 27.) One CTA holds 96-128 threads and
// a few KB, so an SM runs a dozen or more, whose loads overlap the others' arithmetic.
//
// pairwise_dot_bwd: an example a CTA at a time (grid-strided): e and G, the symmetric F×F
// matrix of the pair gradients with a zero diagonal, staged in shared memory; a thread
// computes de[k][c] for PD_KB9 rows k and one c as Σ_{m ascending} G[k][m]·e[m][c] (m
// ascending is the order in which the reference's pair loop adds into de[k][c]), four m
// at a time: four loads of e and one float4 of G a row serve 36 multiply-adds. Nothing is
// held in registers across examples (an earlier form prefetched the next example into
// registers and took 96 of them, three CTAs an SM); several CTAs an SM hide the loads.

#define PD_BS 3   // rows and columns of the dot matrix a thread of pairwise_dot_fwd computes
#define PD_KB9 9  // rows of de a thread of pairwise_dot_bwd computes (27 = 3·9; PD_ROWS in interaction.rs)

// e[b0 .. b0+n-1]'s F×D blocks into sm as [n][F][ld] (a float4 a load where it can).
__device__ __forceinline__ void pd_stage(const float* __restrict__ e, long long b0, int n, int f, int d, int ld,
                                         float* sm) {
    const int fd = f * d;
    const float* src = e + b0 * fd;
    if ((d & 3) == 0 && (reinterpret_cast<uintptr_t>(src) & 15) == 0) {
        const float4* s4 = reinterpret_cast<const float4*>(src);
        const int n4 = n * fd / 4;
        for (int q = threadIdx.x; q < n4; q += blockDim.x) {
            const float4 v = __ldg(s4 + q);
            const int k = q * 4, x = k / fd, r = k - x * fd, i = r / d;
            float* dst = sm + (x * f + i) * ld + (r - i * d);
            dst[0] = v.x, dst[1] = v.y, dst[2] = v.z, dst[3] = v.w;
        }
    } else {
        for (int k = threadIdx.x; k < n * fd; k += blockDim.x) {
            const int x = k / fd, r = k - x * fd, i = r / d;
            sm[(x * f + i) * ld + (r - i * d)] = __ldg(src + k);
        }
    }
}

__device__ __forceinline__ void pd_fwd_blocked(const float* __restrict__ e, float* __restrict__ y,
                                               long long batch, int f, int d, int ex, float* sm) {
    const int pairs = f * (f - 1) / 2, ld = d | 1, nb = (f + PD_BS - 1) / PD_BS, tasks = nb * (nb + 1) / 2;
    const int slot = threadIdx.x / tasks;
    // this thread's block (I, J), I ≤ J, row-major over the upper triangle
    int bi = 0, t = threadIdx.x - slot * tasks;
    while (t >= nb - bi) t -= nb - bi, ++bi;
    const int bj = bi + t;
    int ri[PD_BS], rj[PD_BS];
#pragma unroll
    for (int u = 0; u < PD_BS; ++u) {
        ri[u] = min(bi * PD_BS + u, f - 1);  // rows past F read row F-1; their dots are not written
        rj[u] = min(bj * PD_BS + u, f - 1);
    }
    for (long long b0 = static_cast<long long>(blockIdx.x) * ex; b0 < batch;
         b0 += static_cast<long long>(gridDim.x) * ex) {
        const int n = batch - b0 < ex ? static_cast<int>(batch - b0) : ex;
        __syncthreads();  // the previous examples' reads are done
        pd_stage(e, b0, n, f, d, ld, sm);
        __syncthreads();
        if (slot >= n) continue;
        const float* base = sm + slot * f * ld;
        const float *a0 = base + ri[0] * ld, *a1 = base + ri[1] * ld, *a2 = base + ri[2] * ld;
        const float *c0 = base + rj[0] * ld, *c1 = base + rj[1] * ld, *c2 = base + rj[2] * ld;
        float s[PD_BS][PD_BS];
#pragma unroll
        for (int u = 0; u < PD_BS; ++u)
#pragma unroll
            for (int v = 0; v < PD_BS; ++v) s[u][v] = 0.0f;
        for (int c = 0; c < d; ++c) {
            const float x[PD_BS] = {a0[c], a1[c], a2[c]};
            const float z[PD_BS] = {c0[c], c1[c], c2[c]};
#pragma unroll
            for (int u = 0; u < PD_BS; ++u)
#pragma unroll
                for (int v = 0; v < PD_BS; ++v) s[u][v] = erase_add(s[u][v], erase_mul(x[u], z[v]));
        }
        float* out = y + (b0 + slot) * pairs;
#pragma unroll
        for (int u = 0; u < PD_BS; ++u) {
            const int i = bi * PD_BS + u;
#pragma unroll
            for (int v = 0; v < PD_BS; ++v) {
                const int j = bj * PD_BS + v;
                if (i < j && j < f) out[pd_row_start(i, f) + (j - i - 1)] = s[u][v];
            }
        }
    }
}

// The gradient's shared memory: e as [F][D|1], then G as [F][FG] (FG = F rounded up to
// 4, rows 16-byte aligned for float4 reads of 4 consecutive m) from float pd_g_offset.
__device__ __forceinline__ int pd_g_offset(int f, int d) { return (f * (d | 1) + 3) & ~3; }

// The diagonal of G and its padding are zero, so the terms m = k and m ≥ F add 0·e = ±0,
// which leaves a sum unchanged: bit-identical to the reference, which skips them, for
// finite e.
__device__ __forceinline__ void pd_bwd_staged(const float* __restrict__ dy, const float* __restrict__ e,
                                              float* __restrict__ de, long long batch, int f, int d, float* sm) {
    const int pairs = f * (f - 1) / 2, ld = d | 1, kblocks = (f + PD_KB9 - 1) / PD_KB9;
    const int fg = (f + 3) & ~3;
    float* g = sm + pd_g_offset(f, d);
    for (long long b = blockIdx.x; b < batch; b += gridDim.x) {
        __syncthreads();  // the previous example's reads are done
        pd_stage(e, b, 1, f, d, ld, sm);
        const float* gb = dy + b * pairs;
        for (int q = threadIdx.x; q < f * fg; q += blockDim.x) {
            const int k = q / fg, m = q - k * fg;
            g[q] = m < f && m != k ? __ldg(gb + pd_pair_index(k, m, f)) : 0.0f;
        }
        __syncthreads();
        for (int t = threadIdx.x; t < kblocks * d; t += blockDim.x) {
            const int kb = t / d, c = t - kb * d;
            const int k0 = kb * PD_KB9;
            float s[PD_KB9];
#pragma unroll
            for (int q = 0; q < PD_KB9; ++q) s[q] = 0.0f;
            for (int m0 = 0; m0 < f; m0 += 4) {
                float x[4];
#pragma unroll
                for (int u = 0; u < 4; ++u) x[u] = m0 + u < f ? sm[(m0 + u) * ld + c] : 0.0f;
#pragma unroll
                for (int q = 0; q < PD_KB9; ++q) {
                    if (k0 + q >= f) break;
                    const float4 gq = *reinterpret_cast<const float4*>(g + (k0 + q) * fg + m0);
                    // m = k and m ≥ F add 0·x: the same sum as skipping them (s is never
                    // -0 and x is finite; a non-finite e[k][c] would turn de[k][c] NaN)
                    s[q] = erase_add(s[q], erase_mul(gq.x, x[0]));
                    s[q] = erase_add(s[q], erase_mul(gq.y, x[1]));
                    s[q] = erase_add(s[q], erase_mul(gq.z, x[2]));
                    s[q] = erase_add(s[q], erase_mul(gq.w, x[3]));
                }
            }
#pragma unroll
            for (int q = 0; q < PD_KB9; ++q)
                if (k0 + q < f) de[b * f * d + (long long)(k0 + q) * d + c] = s[q];
        }
    }
}

// dynamic shared memory: EX·F·(D|1) floats; at least EX·nb(nb+1)/2 threads (nb = ⌈F/3⌉), any
// grid (EX examples a CTA at a time, grid-strided)
ERASE_KERNEL void pairwise_dot_fwd(const float* __restrict__ e, float* __restrict__ y, long long batch, int f,
                                   int d, int ex) { ERASE_PDL_ENTER();
    extern __shared__ float pd_smem[];
    pd_fwd_blocked(e, y, batch, f, d, ex, pd_smem);
}

ERASE_KERNEL void pairwise_dot_fwd_gmem(const float* __restrict__ e, float* __restrict__ y, long long batch, int f,
                                        int d) { ERASE_PDL_ENTER();
    pd_fwd_gmem(e, y, batch, f, d);
}

// dynamic shared memory: pd_g_offset(F, D) + F·FG floats; any block size, any grid
ERASE_KERNEL void pairwise_dot_bwd(const float* __restrict__ dy, const float* __restrict__ e,
                                   float* __restrict__ de, long long batch, int f, int d) { ERASE_PDL_ENTER();
    extern __shared__ float pd_smem[];
    pd_bwd_staged(dy, e, de, batch, f, d, pd_smem);
}

ERASE_KERNEL void pairwise_dot_bwd_gmem(const float* __restrict__ dy, const float* __restrict__ e,
                                        float* __restrict__ de, long long batch, int f, int d) { ERASE_PDL_ENTER();
    pd_bwd_gmem(dy, e, de, batch, f, d);
}
