// Part of gemm.cu, the GEMM family's one translation unit: gemm.cu includes it after the parts it
// uses; it is not compiled alone. The TMA wgmma form (`gemm_bf16t_*`, sm_90a).

namespace {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// ---- the TMA wgmma form (sm_90a) --------------------------------------------------------
//
// gemm_bf16t*: gemm_wgmma_body's GEMM (the same tiles, stage layout, wgmma k steps, split-K
// clusters and epilogues) with each stage's operands brought by the tensor memory
// accelerator instead of every thread's cp.async chunks: one thread issues a stage as
// [64][64] bf16 boxes (two of A, BN/64 of B) that the TMA writes in the 128-byte swizzle
// the descriptors name and that complete on the stage's `full` mbarrier (one arrival with
// the stage's bytes expected). The warps wait on `full` instead of a CTA barrier, keep a
// k step's wgmma running while the next is issued (wait_group 1), and each warp releases
// the slot of the step before on its `empty` mbarrier; the issuing thread (thread 0)
// refills that slot once all eight have, STAGES-1 steps ahead. On an H200 this is 5-20 %
// faster than the cp.async kernels on the CTR model's unsplit GEMMs (BENCHMARKS.md).
//
// The operands' descriptors (CUtensorMap, 128 bytes, encoded by the host for each launch
// with 64 x 64 boxes, the 128-byte swizzle and zero fill past either extent) come by
// value as __grid_constant__ parameters: the copies name their address in the parameter
// space. A K-major operand's map is [rows][k] (inner k), an MN-major one's [k][m or n].

__device__ __forceinline__ void gemm_mbar_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

// One [64][64] box of `map` at (c0 inner, c1 outer) into this CTA's `dst`, completing on
// `bar`.
__device__ __forceinline__ void gemm_tma_box(uint32_t dst, const GemmTmap* map, int c0, int c1, uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
        : "memory");
}

// SPLIT > 1: the kernel runs in clusters of SPLIT CTAs along z, split s taking k from
// s·k_split (gemm_wgmma_body's split-K, summed by gemm_cluster_epilogue).
template <int BN, int STAGES, int SPLIT, bool TA, bool TB, bool COPY>
__device__ __forceinline__ void gemm_tma_body(const GemmTmap* __restrict__ map_a, const GemmTmap* __restrict__ map_b,
                                              float* __restrict__ C, const float* __restrict__ bias, int M, int N,
                                              int Kp, long long ldc, int k_split, int flags,
                                              __nv_bfloat16* __restrict__ Cb) {
    constexpr int BM = 128, BK = 64, A_BYTES = BM * BK * 2, STAGE = (BM + BN) * BK * 2, NACC = BN / 2;
    constexpr uint32_t BOX = 64 * 64 * 2;
    static_assert(BN == 64 || BN == 128 || BN == 256, "the TMA tiles are 64, 128 or 256 wide");
    extern __shared__ __align__(16) unsigned char gemm_smem[];
    __shared__ __align__(8) uint64_t gemm_bars[2 * STAGES];
    const uint32_t base = (gemm_smem_addr(gemm_smem) + 1023u) & ~1023u;
    const uint32_t full = gemm_smem_addr(gemm_bars), empty = full + 8 * STAGES;
    const int tid = threadIdx.x, wg = tid >> 7, lane = tid & 31;
    const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN;
    const long long kb = SPLIT > 1 ? static_cast<long long>(blockIdx.z) * k_split : 0;
    const int k_begin = static_cast<int>(kb < Kp ? kb : Kp);
    const int k_end = SPLIT > 1 && k_begin + k_split < Kp ? k_begin + k_split : Kp;
    const int nk = (k_end - k_begin) / BK;

    if (tid == 0) {
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            gemm_mbar_init(full + 8 * s, 1);
            gemm_mbar_init(empty + 8 * s, 8);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    // step kt's boxes into slot kt % STAGES (thread 0 only)
    auto issue = [&](int kt) {
        const int k0 = k_begin + kt * BK;
        const uint32_t sa = base + (kt % STAGES) * STAGE, sb = sa + A_BYTES, bar = full + 8 * (kt % STAGES);
        gemm_mbar_expect_tx(bar, STAGE);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            if (TA) gemm_tma_box(sa + h * BOX, map_a, m0 + 64 * h, k0, bar);
            else gemm_tma_box(sa + h * BOX, map_a, k0, m0 + 64 * h, bar);
        }
#pragma unroll
        for (int j = 0; j < BN / 64; ++j) {
            if (TB) gemm_tma_box(sb + j * BOX, map_b, n0 + 64 * j, k0, bar);
            else gemm_tma_box(sb + j * BOX, map_b, k0, n0 + 64 * j, bar);
        }
    };
    if (tid == 0) {
        for (int kt = 0; kt < STAGES && kt < nk; ++kt) issue(kt);
    }

    float acc[1][BN / 8][4];
    float(&d)[NACC] = reinterpret_cast<float(&)[NACC]>(acc);
#pragma unroll
    for (int i = 0; i < NACC; ++i) d[i] = 0.f;
    gemm_prefetch_residual<BN>(bias, M, N, ldc, m0, n0, flags, tid, 256);

    for (int kt = 0; kt < nk; ++kt) {
        const int slot = kt % STAGES;
        gemm_mbar_wait(full + 8 * slot, (kt / STAGES) & 1);
        // as gemm_wgmma_body: a warpgroup's 64 rows of A, 8192 bytes in
        const uint32_t sa = base + slot * STAGE + wg * 8192, sb = base + slot * STAGE + A_BYTES;
        gemm_wgmma_kstep<BN, TA, TB>(d, sa, sb);
        asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
        gemm_wgmma_hold(d);
        if (kt > 0) {
            // step kt - 1's wgmma are done with their slot: release it, and refill it
            // (thread 0) once every warp has
            const int prev = kt - 1, ps = prev % STAGES;
            if (lane == 0) gemm_mbar_arrive(empty + 8 * ps);
            if (tid == 0 && prev + STAGES < nk) {
                gemm_mbar_wait(empty + 8 * ps, (prev / STAGES) & 1);
                issue(prev + STAGES);
            }
        }
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    gemm_wgmma_hold(d);
    // every box landed (each step's `full` was waited for) and every wgmma is done: the
    // epilogue's first barrier frees the ring for the staged tile
    gemm_wgmma_epilogue<BN, SPLIT, COPY>(acc, C, bias, M, N, ldc, m0, n0, flags, base, gemm_smem, Cb);
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace

// gemm_bf16t<LAYOUT>_128x128, _128x256 and _128x64 (and _k<S>: S splits summed in a
// cluster of S CTAs along z): the TMA form (gemm_tma_body) of the pipelined kernels, batch
// 1, the same layouts, tiles, shared memory (3 stages of 128x128, two CTAs an SM; 4 of
// 128x256) and epilogues; the 128x64 tile (4 stages, two CTAs an SM) is the TMA kernels'
// own, for outputs whose 128x128 grid leaves SMs idle. Arguments: map_a, map_b (the operands' TMA descriptors, by value), C, bias,
// M, N, Kp (i32; Kp a multiple of 64), ldc (i64), k_split (i32, a multiple of 64: a split's
// k range; read by the `_k<S>` kernels only), flags (i32, as the pipelined kernels'), Cb
// (C's bf16 copy, the `_c` and `_kmc` kernels). Grid: (Mp/128, Np/BN, S); block 256.
// sm_90a only (the sm_80 forms trap).
#define ERASE_GEMM_TMA_ARGS                                                                          \
    const __grid_constant__ GemmTmap map_a, const __grid_constant__ GemmTmap map_b, float *__restrict__ C, \
        const float *__restrict__ bias, int M, int N, int Kp, long long ldc, int k_split, int flags,  \
        __nv_bfloat16 *__restrict__ Cb
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define ERASE_GEMM_TMA_KERNEL(LAYOUT, TA, TB, COPY, BN, STAGES, PER_SM, S, SUFFIX)                           \
    ERASE_KERNEL void ERASE_GEMM_SPLIT_CLUSTER_##S __launch_bounds__(256, PER_SM)                               \
        gemm_bf16t##LAYOUT##_128x##BN##SUFFIX(ERASE_GEMM_TMA_ARGS) { ERASE_PDL_ENTER();                      \
        gemm_tma_body<BN, STAGES, S, TA, TB, COPY>(&map_a, &map_b, C, bias, M, N, Kp, ldc, k_split, flags, Cb); \
    }
#else
#define ERASE_GEMM_TMA_KERNEL(LAYOUT, TA, TB, COPY, BN, STAGES, PER_SM, S, SUFFIX)                           \
    ERASE_KERNEL void __launch_bounds__(256, PER_SM) gemm_bf16t##LAYOUT##_128x##BN##SUFFIX(ERASE_GEMM_TMA_ARGS) { \
        ERASE_PDL_ENTER();                                                                                   \
        __trap();                                                                                            \
    }
#endif
#define ERASE_GEMM_TMA_TILE(LAYOUT, TA, TB, COPY, BN, STAGES, PER_SM)       \
    ERASE_GEMM_TMA_KERNEL(LAYOUT, TA, TB, COPY, BN, STAGES, PER_SM, 1, )    \
    ERASE_GEMM_TMA_KERNEL(LAYOUT, TA, TB, COPY, BN, STAGES, PER_SM, 2, _k2) \
    ERASE_GEMM_TMA_KERNEL(LAYOUT, TA, TB, COPY, BN, STAGES, PER_SM, 4, _k4) \
    ERASE_GEMM_TMA_KERNEL(LAYOUT, TA, TB, COPY, BN, STAGES, PER_SM, 8, _k8)
#define ERASE_GEMM_TMA_KERNELS(LAYOUT, TA, TB, COPY)        \
    ERASE_GEMM_TMA_TILE(LAYOUT, TA, TB, COPY, 128, 3, 2)    \
    ERASE_GEMM_TMA_TILE(LAYOUT, TA, TB, COPY, 256, 4, 1)    \
    ERASE_GEMM_TMA_TILE(LAYOUT, TA, TB, COPY, 64, 4, 2)
ERASE_GEMM_TMA_KERNELS(, false, false, false)
ERASE_GEMM_TMA_KERNELS(_mm, true, true, false)
ERASE_GEMM_TMA_KERNELS(_km, false, true, false)
ERASE_GEMM_TMA_KERNELS(_c, false, false, true)
ERASE_GEMM_TMA_KERNELS(_kmc, false, true, true)
