// Part of gemm.cu, the GEMM family's one translation unit: gemm.cu includes it after the parts it
// uses; it is not compiled alone. The warp-specialized wgmma form (`gemm_bf16w_*`, sm_90a).

namespace {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// ---- the warp-specialized wgmma form (sm_90a) -------------------------------------------
//
// gemm_bf16w*: gemm_wgmma_body's GEMM (the same operands, arguments, grid, stage layout and
// epilogues) with the loads and the math in different warps: 384 threads, warpgroups 0 and
// 1 multiply (64 rows of the 128 each, as there) and warpgroup 2 only loads. The loader
// keeps a STAGES-deep ring filled ahead: each of its 128 threads' cp.async chunks of a
// stage complete on the stage's `full` mbarrier (cp.async.mbarrier.arrive.noinc: 128
// arrivals a phase), and it refills a slot once the stage's `empty` mbarrier says the math
// warps are done with it (256 arrivals, one a math thread). The math warps wait on `full`,
// issue the stage's four k16 wgmma, keep that step in flight while releasing the one
// before (wait_group 1) and go on: no CTA barrier in the main loop, so the wgmma of a
// CTA run back to back while its own later loads are in flight. (The 256-thread kernel,
// every thread loading and multiplying, waits at a barrier every k step: a third of its
// issue slots at 4096 x 256 x 1728, ncu; one CTA an SM there ran at 40 % of the SM's mma
// rate.) All 384 threads store the epilogue.
//
// Shared memory: the ring (STAGES stages of [128][64] A and [BN][64] B, 128-byte swizzle,
// 1024-aligned: STAGES·(128 + BN)·128 + 1024 dynamic bytes) and the 2·STAGES mbarriers
// (static). The 128x64 tile (the one instantiated) runs two CTAs an SM, so that a CTA's
// epilogue overlaps the other's main loop and a grid of many short CTAs fills the SMs.

__device__ __forceinline__ void gemm_mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void gemm_mbar_wait(uint32_t bar, uint32_t parity) {
    uint32_t done = 0;
    while (!done) {
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    }
}

__device__ __forceinline__ void gemm_mbar_arrive(uint32_t bar) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
}

// Arrives on `bar` once every cp.async this thread issued before it has landed.
__device__ __forceinline__ void gemm_cp_mbar_arrive(uint32_t bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

template <int BN, int STAGES, int CLUSTER = 1, bool TA = false, bool TB = false, bool COPY = false>
__device__ __forceinline__ void gemm_wgmma_ws_body(const __nv_bfloat16* __restrict__ A,
                                                   const __nv_bfloat16* __restrict__ B, float* __restrict__ C,
                                                   const float* __restrict__ bias, int M, int N, int Kp,
                                                   long long lda, long long ldb, long long ldc, long long batch_a,
                                                   long long batch_b, long long batch_c, int batch, int k_split,
                                                   long long split_c, int flags, __nv_bfloat16* __restrict__ Cb) {
    constexpr int BM = 128, BK = 64, THREADS = 384, LOADERS = 128, MATH = 256;
    constexpr int A_BYTES = BM * BK * 2, STAGE = (BM + BN) * BK * 2, NACC = BN / 2;
    static_assert(BN == 64, "the warp-specialized wgmma tile is 128x64");
    extern __shared__ __align__(16) unsigned char gemm_smem[];
    __shared__ __align__(8) uint64_t gemm_bars[2 * STAGES];
    const uint32_t base = (gemm_smem_addr(gemm_smem) + 1023u) & ~1023u;
    const uint32_t full = gemm_smem_addr(gemm_bars), empty = full + 8 * STAGES;

    const int tid = threadIdx.x, wg = tid >> 7;
    const int split = blockIdx.z / batch, bi = blockIdx.z % batch;
    const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN;
    const long long kb = static_cast<long long>(split) * k_split;
    const int k_begin = static_cast<int>(kb < Kp ? kb : Kp);
    const int k_end = k_begin + k_split < Kp ? k_begin + k_split : Kp;
    const int nk = (k_end - k_begin) / BK;
    A += bi * batch_a;
    B += bi * batch_b;
    C += split * split_c + bi * batch_c;

    if (tid == 0) {
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            gemm_mbar_init(full + 8 * s, LOADERS);
            gemm_mbar_init(empty + 8 * s, MATH);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    float acc[1][BN / 8][4];
    float(&d)[NACC] = reinterpret_cast<float(&)[NACC]>(acc);
#pragma unroll
    for (int i = 0; i < NACC; ++i) d[i] = 0.f;

    if (wg == 2) {
        // the loader: k step kt into slot kt % STAGES, once the math warps have released
        // that slot's previous step (kt - STAGES): the (kt / STAGES - 1)-th phase of `empty`
        const int lt = tid - MATH;
        const GemmWgmmaTile<BM, TA, LOADERS> tile_a(A, lda, m0, M, lt);
        const GemmWgmmaTile<BN, TB, LOADERS> tile_b(B, ldb, n0, N, lt);
        for (int kt = 0; kt < nk; ++kt) {
            const int slot = kt % STAGES;
            if (kt >= STAGES) gemm_mbar_wait(empty + 8 * slot, (kt / STAGES - 1) & 1);
            const uint32_t sa = base + slot * STAGE;
            tile_a.load(sa, k_begin + kt * BK, lt);
            tile_b.load(sa + A_BYTES, k_begin + kt * BK, lt);
            gemm_cp_mbar_arrive(full + 8 * slot);
        }
    } else {
        gemm_prefetch_residual<BN>(bias, M, N, ldc, m0, n0, flags, tid, MATH);
        for (int kt = 0; kt < nk; ++kt) {
            const int slot = kt % STAGES;
            gemm_mbar_wait(full + 8 * slot, (kt / STAGES) & 1);
            // the loader's cp.async writes (generic proxy), seen through the mbarrier, are
            // fenced before this thread's wgmma reads them (async proxy)
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
            // as gemm_wgmma_body: a warpgroup's 64 rows of A, 8192 bytes in
            const uint32_t sa = base + slot * STAGE + wg * 8192, sb = base + slot * STAGE + A_BYTES;
            gemm_wgmma_kstep<BN, TA, TB>(d, sa, sb);
            // step kt - 1's wgmma have read their slot: release it to the loader
            asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
            gemm_wgmma_hold(d);
            if (kt > 0) gemm_mbar_arrive(empty + 8 * ((kt - 1) % STAGES));
        }
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        gemm_wgmma_hold(d);
    }
    // every step's data landed (the math warps waited for each) and every wgmma is done:
    // the epilogues' first barrier frees the ring for the staged tile
    gemm_wgmma_epilogue<BN, CLUSTER, COPY, THREADS>(acc, C, bias, M, N, ldc, m0, n0, flags, base, gemm_smem, Cb);
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace

// gemm_bf16w<LAYOUT>_128x64 (and _k<S>, split-K in a cluster of S): the warp-specialized
// form (gemm_wgmma_ws_body) of the pipelined kernels, the same layouts and arguments, block
// 384, two CTAs an SM (80 registers); dynamic shared memory 4·(128 + 64)·128 + 1024 =
// 99328 (4 stages). sm_90a only: the plans take them where the device runs the sm_90a
// PTX (the sm_80 forms trap).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define ERASE_GEMM_WS_KERNEL(LAYOUT, TA, TB, COPY, S, SUFFIX)                                                 \
    ERASE_KERNEL void ERASE_GEMM_SPLIT_CLUSTER_##S __launch_bounds__(384, 2)                                    \
        gemm_bf16w##LAYOUT##_128x64##SUFFIX(ERASE_GEMM_PIPE_ARGS) { ERASE_PDL_ENTER();                       \
        gemm_wgmma_ws_body<64, 4, S, TA, TB, COPY>(ERASE_GEMM_PIPE_PASS);                                    \
    }
// no cluster for one split
#define ERASE_GEMM_SPLIT_CLUSTER_1
#define ERASE_GEMM_SPLIT_CLUSTER_2 __cluster_dims__(1, 1, 2)
#define ERASE_GEMM_SPLIT_CLUSTER_4 __cluster_dims__(1, 1, 4)
#define ERASE_GEMM_SPLIT_CLUSTER_8 __cluster_dims__(1, 1, 8)
#else
#define ERASE_GEMM_WS_KERNEL(LAYOUT, TA, TB, COPY, S, SUFFIX)                                                 \
    ERASE_KERNEL void __launch_bounds__(384, 2) gemm_bf16w##LAYOUT##_128x64##SUFFIX(ERASE_GEMM_PIPE_ARGS) { ERASE_PDL_ENTER(); \
        __trap();                                                                                            \
    }
#endif
#define ERASE_GEMM_WS_KERNELS(LAYOUT, TA, TB, COPY)    \
    ERASE_GEMM_WS_KERNEL(LAYOUT, TA, TB, COPY, 1, )    \
    ERASE_GEMM_WS_KERNEL(LAYOUT, TA, TB, COPY, 2, _k2) \
    ERASE_GEMM_WS_KERNEL(LAYOUT, TA, TB, COPY, 4, _k4) \
    ERASE_GEMM_WS_KERNEL(LAYOUT, TA, TB, COPY, 8, _k8)
ERASE_GEMM_WS_KERNELS(, false, false, false)
ERASE_GEMM_WS_KERNELS(_mm, true, true, false)
ERASE_GEMM_WS_KERNELS(_km, false, true, false)
ERASE_GEMM_WS_KERNELS(_c, false, false, true)
ERASE_GEMM_WS_KERNELS(_kmc, false, true, true)
