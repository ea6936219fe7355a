// The DLRM interaction: y[b, p] = <e[b,i], e[b,j]> over pairs i < j in row-major upper
// triangle order (p = 0 is (0,1)), e [B, F, D] -> y [B, F(F-1)/2], and its gradient.
//
// Tiling: one CTA per example (grid-strided over the batch). The example's F×D block is
// staged in shared memory with an odd row stride (ld = D | 1) so that a warp reading
// column c of 32 different rows hits 32 different banks.
//  pairwise_dot_fwd: 128 threads; thread t computes pairs t, t+128, ...: consecutive
//    threads take consecutive pairs, i.e. one row i (broadcast reads) and consecutive j
//    (conflict-free reads). Each pair is a D-long dot product summed in c order.
//  pairwise_dot_bwd: 256 threads; the pair gradients are expanded into a symmetric F×F
//    matrix G in shared memory; a thread computes de[b, k, c] for 4 consecutive k and one
//    c as Σ_{m ≠ k, m ascending} G[k][m] · e[b, m, c] (one e load serves 4 outputs, G
//    reads are broadcasts); m ascending is exactly the order in which the CPU reference's
//    pair loop adds into de[b, k, c], so the sums match it.
// Products and sums are written without FMA contraction (erase_mul/erase_add): the result
// is bit-identical to the reference. Bound: shared-memory bandwidth and FP32 issue
// (F=27, D=64: 22k multiply-adds per example over 6.9 KB of input); in DRAM terms
// ~7 KB read + 1.4 KB written per example (fwd), so a [4096, 27, 64] batch is ~35 MB.
// The `_gmem` variants read straight from global memory (L1-cached) for examples whose
// F×D block does not fit the default 48 KB of shared memory.
#include "common.cuh"

// First pair index of row i: pairs (i, i+1), (i, i+2), ... start at i·(2F-1-i)/2.
__device__ __forceinline__ int pd_row_start(int i, int f) { return i * (2 * f - 1 - i) / 2; }

template <bool SMEM>
__device__ __forceinline__ void pd_fwd(const float* __restrict__ e, float* __restrict__ y, long long batch, int f,
                                       int d, float* sm) {
    const int pairs = f * (f - 1) / 2;
    const int ld = SMEM ? (d | 1) : d;
    for (long long b = blockIdx.x; b < batch; b += gridDim.x) {
        const float* eb = e + b * f * d;
        const float* src = eb;
        if (SMEM) {
            __syncthreads();  // the previous example's reads are done
            for (int k = threadIdx.x; k < f * d; k += blockDim.x) {
                const int i = k / d;
                sm[i * ld + (k - i * d)] = eb[k];
            }
            __syncthreads();
            src = sm;
        }
        for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
            // row i of pair p: closed form, then fixed up against rounding
            const float q = (float)(2 * f - 1);
            int i = (int)((q - sqrtf(fmaxf(q * q - 8.0f * (float)p, 0.0f))) * 0.5f);
            i = max(0, min(i, f - 2));
            while (i > 0 && pd_row_start(i, f) > p) --i;
            while (i < f - 2 && pd_row_start(i + 1, f) <= p) ++i;
            const int j = i + 1 + (p - pd_row_start(i, f));
            const float* a = src + i * ld;
            const float* c2 = src + j * ld;
            float s = 0.0f;
            for (int c = 0; c < d; ++c) s = erase_add(s, erase_mul(a[c], c2[c]));
            y[b * pairs + p] = s;
        }
    }
}

// de[b] = G·E with G the symmetric F×F matrix of the pair gradients (no diagonal): thread
// item (kb, c) computes de[k][c] for the PD_KB rows k = kb·PD_KB .. +PD_KB-1 at once, so
// one load of e[m][c] serves PD_KB outputs and the G entries are warp broadcasts.
#define PD_KB 4

template <bool SMEM>
__device__ __forceinline__ void pd_bwd(const float* __restrict__ dy, const float* __restrict__ e,
                                       float* __restrict__ de, long long batch, int f, int d, float* sm) {
    const int pairs = f * (f - 1) / 2;
    const int ld = SMEM ? (d | 1) : d;
    const int kblocks = (f + PD_KB - 1) / PD_KB;
    for (long long b = blockIdx.x; b < batch; b += gridDim.x) {
        const float* eb = e + b * f * d;
        const float* gb = dy + b * pairs;
        const float* src = eb;
        if (SMEM) {
            __syncthreads();
            for (int k = threadIdx.x; k < f * d; k += blockDim.x) {
                const int i = k / d;
                sm[i * ld + (k - i * d)] = eb[k];
            }
            // G[k][m] = dy[b, pair(min, max)]
            float* g = sm + f * ld;
            for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
                const float q = (float)(2 * f - 1);
                int i = (int)((q - sqrtf(fmaxf(q * q - 8.0f * (float)p, 0.0f))) * 0.5f);
                i = max(0, min(i, f - 2));
                while (i > 0 && pd_row_start(i, f) > p) --i;
                while (i < f - 2 && pd_row_start(i + 1, f) <= p) ++i;
                const int j = i + 1 + (p - pd_row_start(i, f));
                const float v = gb[p];
                g[i * f + j] = v;
                g[j * f + i] = v;
            }
            __syncthreads();
            src = sm;
        }
        const float* g = SMEM ? sm + f * ld : nullptr;
        for (int t = threadIdx.x; t < kblocks * d; t += blockDim.x) {
            const int kb = t / d, c = t - kb * d;
            const int k0 = kb * PD_KB;
            float s[PD_KB];
#pragma unroll
            for (int q = 0; q < PD_KB; ++q) s[q] = 0.0f;
            for (int m = 0; m < f; ++m) {
                const float x = src[m * ld + c];
#pragma unroll
                for (int q = 0; q < PD_KB; ++q) {
                    const int k = k0 + q;
                    if (k < f && m != k) {
                        // the pair's gradient: from G in shared memory, else from dy
                        const float gv = SMEM ? g[k * f + m]
                                              : gb[m < k ? pd_row_start(m, f) + (k - m - 1)
                                                         : pd_row_start(k, f) + (m - k - 1)];
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

// dynamic shared memory: F·(D|1) floats
ERASE_KERNEL void pairwise_dot_fwd(const float* __restrict__ e, float* __restrict__ y, long long batch, int f,
                                   int d) {
    extern __shared__ float pd_smem[];
    pd_fwd<true>(e, y, batch, f, d, pd_smem);
}

ERASE_KERNEL void pairwise_dot_fwd_gmem(const float* __restrict__ e, float* __restrict__ y, long long batch, int f,
                                        int d) {
    pd_fwd<false>(e, y, batch, f, d, nullptr);
}

// dynamic shared memory: F·(D|1) + F·F floats
ERASE_KERNEL void pairwise_dot_bwd(const float* __restrict__ dy, const float* __restrict__ e,
                                   float* __restrict__ de, long long batch, int f, int d) {
    extern __shared__ float pd_smem[];
    pd_bwd<true>(dy, e, de, batch, f, d, pd_smem);
}

ERASE_KERNEL void pairwise_dot_bwd_gmem(const float* __restrict__ dy, const float* __restrict__ e,
                                        float* __restrict__ de, long long batch, int f, int d) {
    pd_bwd<false>(dy, e, de, batch, f, d, nullptr);
}
