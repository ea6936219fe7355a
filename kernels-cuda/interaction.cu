// The DLRM interaction: y[b, p] = <e[b,i], e[b,j]> over pairs i < j in row-major upper
// triangle order (p = 0 is (0,1)), e [B, F, D] -> y [B, F(F-1)/2], and its gradient.
//
// Tiling: one example at a time per CTA, grid-strided over the batch; the shared-memory
// forms run a few CTAs an SM, each with the next example's loads in flight
// (pd_fwd_multi, pd_bwd_multi). The example's F×D block is staged in shared memory with
// an odd row stride (ld = D | 1) so that a warp reading column c of 32 different rows
// hits 32 different banks.
//  pairwise_dot_fwd: thread t computes pairs t, t+blockDim, ...: consecutive threads
//    take consecutive pairs, i.e. one row i (broadcast reads) and consecutive j
//    (conflict-free reads). Each pair is a D-long dot product summed in c order.
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

// ---- the shared-memory forms, several examples a CTA ------------------------------------
//
// pairwise_dot_fwd / pairwise_dot_bwd walk the examples b = blockIdx.x, + gridDim.x, ..
// (the plan launches a few CTAs an SM). While a CTA computes example b, the next
// example's e (and for the gradient its pair gradients) is already loading into
// registers: a float4 a thread (when D is a multiple of 4 and the block has at most 4
// float4 per thread), stored to shared memory after the example's barrier, so the loads'
// latency hides behind the arithmetic instead of stalling each example. A thread's pair
// (fwd) or G entries (bwd) are the same in every example, so their indices are computed
// once. The arithmetic and its order are those of the gmem forms (bit-identical to the
// reference).

#define PD_PF 4  // float4 of e a thread holds for the next example

// e[b]'s F×D floats: into registers r (prefetch) and from there into sm[F][ld].
struct PdE {
    float4 r[PD_PF];
    __device__ __forceinline__ void fetch(const float* __restrict__ e, long long b, int n4) {
        const float4* s4 = reinterpret_cast<const float4*>(e) + b * n4;
#pragma unroll
        for (int q = 0; q < PD_PF; ++q) {
            const int idx = threadIdx.x + q * blockDim.x;
            if (idx < n4) r[q] = __ldg(s4 + idx);
        }
    }
    __device__ __forceinline__ void put(float* sm, int n4, int d, int ld) const {
#pragma unroll
        for (int q = 0; q < PD_PF; ++q) {
            const int idx = threadIdx.x + q * blockDim.x;
            if (idx < n4) {
                const int k = idx * 4, i = k / d;
                float* dst = sm + i * ld + (k - i * d);
                dst[0] = r[q].x, dst[1] = r[q].y, dst[2] = r[q].z, dst[3] = r[q].w;
            }
        }
    }
};

__device__ __forceinline__ void pd_stage_scalar(const float* __restrict__ eb, float* sm, int f, int d, int ld) {
    for (int k = threadIdx.x; k < f * d; k += blockDim.x) {
        const int i = k / d;
        sm[i * ld + (k - i * d)] = eb[k];
    }
}

__device__ __forceinline__ bool pd_prefetch_ok(const float* e, int f, int d) {
    return (d & 3) == 0 && (reinterpret_cast<uintptr_t>(e) & 15) == 0 && f * d / 4 <= PD_PF * (int)blockDim.x;
}

__device__ __forceinline__ void pd_fwd_multi(const float* __restrict__ e, float* __restrict__ y, long long batch,
                                             int f, int d, float* sm) {
    const int pairs = f * (f - 1) / 2, ld = d | 1, n4 = f * d / 4;
    const bool pf = pd_prefetch_ok(e, f, d);
    int i0 = 0, j0 = 1;
    if ((int)threadIdx.x < pairs) pd_pair(threadIdx.x, f, i0, j0);
    PdE st;
    long long b = blockIdx.x;
    if (pf && b < batch) st.fetch(e, b, n4);
    for (; b < batch; b += gridDim.x) {
        __syncthreads();  // the previous example's reads are done
        if (pf) st.put(sm, n4, d, ld);
        else pd_stage_scalar(e + b * f * d, sm, f, d, ld);
        __syncthreads();
        if (pf && b + gridDim.x < batch) st.fetch(e, b + gridDim.x, n4);
        for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
            int i = i0, j = j0;
            if (p != (int)threadIdx.x) pd_pair(p, f, i, j);
            const float* a = sm + i * ld;
            const float* c2 = sm + j * ld;
            float s = 0.0f;
            for (int c = 0; c < d; ++c) s = erase_add(s, erase_mul(a[c], c2[c]));
            y[b * pairs + p] = s;
        }
    }
}

#define PD_PG 4  // G entries a thread fills (and prefetches)
#define PD_KB9 9  // rows of de a thread of pd_bwd_multi computes (27 = 3·9; PD_ROWS in misc.rs)

// The gradient's shared memory: e as [F][D|1], then G as [F][FG] (FG = F rounded up to
// 4, rows 16-byte aligned for float4 reads of 4 consecutive m) from float pd_g_offset.
__device__ __forceinline__ int pd_g_offset(int f, int d) { return (f * (d | 1) + 3) & ~3; }

// de[k][c] for 9 rows k a thread: per 4 consecutive m, 4 loads of e[m][c] and one float4
// of G a row serve 36 multiply-adds (the earlier shared-memory form, one load of e and
// one of G a multiply-add, was bound by those loads); each output still adds m
// ascending. The diagonal of G and its padding are zero, so the terms m = k and m ≥ F
// add 0·e = ±0, which leaves a sum unchanged: bit-identical to the reference, which
// skips them, for finite e.
__device__ __forceinline__ void pd_bwd_multi(const float* __restrict__ dy, const float* __restrict__ e,
                                             float* __restrict__ de, long long batch, int f, int d, float* sm) {
    const int pairs = f * (f - 1) / 2, ld = d | 1, n4 = f * d / 4, kblocks = (f + PD_KB9 - 1) / PD_KB9;
    const int fg = (f + 3) & ~3;
    const bool pf = pd_prefetch_ok(e, f, d) && f * f <= PD_PG * (int)blockDim.x;
    float* g = sm + pd_g_offset(f, d);
    // this thread's G entries q = tid + r·blockDim: where each goes, and the pair it
    // reads (-1: the diagonal)
    int gp[PD_PG], gpos[PD_PG];
#pragma unroll
    for (int r = 0; r < PD_PG; ++r) {
        const int q = threadIdx.x + r * blockDim.x;
        gp[r] = -1;
        gpos[r] = -1;
        if (q < f * f) {
            const int k = q / f, m = q - k * f;
            gpos[r] = k * fg + m;
            if (k != m) gp[r] = pd_pair_index(k, m, f);
        }
    }
    // G's padding columns m = F .. FG-1 stay zero (no example writes them)
    for (int q = threadIdx.x; q < f * fg; q += blockDim.x)
        if (q % fg >= f) g[q] = 0.0f;
    PdE st;
    float gv[PD_PG];
    auto fetch = [&](long long b) {
        st.fetch(e, b, n4);
#pragma unroll
        for (int r = 0; r < PD_PG; ++r) gv[r] = gp[r] >= 0 ? __ldg(dy + b * pairs + gp[r]) : 0.0f;
    };
    long long b = blockIdx.x;
    if (pf && b < batch) fetch(b);
    for (; b < batch; b += gridDim.x) {
        __syncthreads();
        if (pf) {
            st.put(sm, n4, d, ld);
#pragma unroll
            for (int r = 0; r < PD_PG; ++r)
                if (gpos[r] >= 0) g[gpos[r]] = gv[r];
        } else {
            pd_stage_scalar(e + b * f * d, sm, f, d, ld);
            for (int q = threadIdx.x; q < f * f; q += blockDim.x) {
                const int k = q / f, m = q - k * f;
                g[k * fg + m] = k == m ? 0.0f : dy[b * pairs + pd_pair_index(k, m, f)];
            }
        }
        __syncthreads();
        if (pf && b + gridDim.x < batch) fetch(b + gridDim.x);
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

// dynamic shared memory: F·(D|1) floats; any block size, any grid (examples grid-strided)
ERASE_KERNEL void pairwise_dot_fwd(const float* __restrict__ e, float* __restrict__ y, long long batch, int f,
                                   int d) {
    extern __shared__ float pd_smem[];
    pd_fwd_multi(e, y, batch, f, d, pd_smem);
}

ERASE_KERNEL void pairwise_dot_fwd_gmem(const float* __restrict__ e, float* __restrict__ y, long long batch, int f,
                                        int d) {
    pd_fwd_gmem(e, y, batch, f, d);
}

// dynamic shared memory: pd_g_offset(F, D) + F·FG floats; any block size, any grid
ERASE_KERNEL void pairwise_dot_bwd(const float* __restrict__ dy, const float* __restrict__ e,
                                   float* __restrict__ de, long long batch, int f, int d) {
    extern __shared__ float pd_smem[];
    pd_bwd_multi(dy, e, de, batch, f, d, pd_smem);
}

ERASE_KERNEL void pairwise_dot_bwd_gmem(const float* __restrict__ dy, const float* __restrict__ e,
                                        float* __restrict__ de, long long batch, int f, int d) {
    pd_bwd_gmem(dy, e, de, batch, f, d);
}
