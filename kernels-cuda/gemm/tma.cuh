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

// The cross update computed in a GEMM's epilogue (`gemm_bf16t[_c]_128x128_ma`): with the
// layer's output y = acc (+ bias) stored as the plain kernel stores it (f32 C, or bf16 alone
// in Cb: flags & 64), z = a ⊙ y_stored + c (each product and sum rounded once, as
// ew_mul_add) is stored in z, and with flags & 128 its bf16 copy in zb. a, c and z have
// C's layout (row-major, ldc).
struct GemmMulAdd {
    const float* a;
    const float* c;
    float* z;
    __nv_bfloat16* zb;
};

// Brings the tile's rows of a and c toward L2 while the main loop runs (as
// gemm_prefetch_residual does for a residual).
template <int BN>
__device__ __forceinline__ void gemm_prefetch_mul_add(const GemmMulAdd& ma, int M, int N, long long ldc, int m0,
                                                      int n0, int t, int threads) {
    constexpr int LINES = BN * 4 / 128;
    for (int i = t; i < 128 * LINES; i += threads) {
        const int m = m0 + i / LINES, n = n0 + (i % LINES) * 32;
        if (m < M && n < N) {
            const long long off = static_cast<long long>(m) * ldc + n;
            asm volatile("prefetch.global.L2 [%0];\n" ::"l"(ma.a + off));
            asm volatile("prefetch.global.L2 [%0];\n" ::"l"(ma.c + off));
        }
    }
}

// The staged epilogue (gemm_staged_epilogue's store of the tile through shared memory, a
// float4 a lane) with the cross update: RB rows' a and c loaded before their stores.
template <int BN, bool COPY>
__device__ __forceinline__ void gemm_staged_epilogue_ma(const float (&acc)[1][BN / 8][4], float* __restrict__ C,
                                                        const float* __restrict__ bias, int M, int N, long long ldc,
                                                        int m0, int n0, int flags, uint32_t base, unsigned char* smem,
                                                        __nv_bfloat16* __restrict__ Cb, const GemmMulAdd& ma) {
    constexpr int BM = 128, LDT = BN + 4, C4 = BN / 4, THREADS = 256, ROWS = THREADS / C4, RB = 4;
    const int tid = threadIdx.x;
    const float* T = gemm_stage_tile<BN>(acc, base, smem);
    const int c = (tid % C4) * 4, n = n0 + c;
    float b[4] = {0.f, 0.f, 0.f, 0.f};
    if (flags & 1) {
#pragma unroll
        for (int e = 0; e < 4; ++e)
            if (n + e < N) b[e] = __ldg(bias + n + e);
    }
    __syncthreads();
    const auto al16 = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; };
    const bool vec = (ldc & 3) == 0 && al16(C) && al16(ma.a) && al16(ma.c) && al16(ma.z);
    const bool v4 = vec && n + 3 < N;
    const bool bf16_only = COPY && (flags & 64);
    for (int r0 = tid / C4; r0 < BM; r0 += RB * ROWS) {
        float4 av[RB], cv[RB];
#pragma unroll
        for (int j = 0; j < RB; ++j) {
            const int r = r0 + j * ROWS, m = m0 + r;
            av[j] = make_float4(0.f, 0.f, 0.f, 0.f);
            cv[j] = av[j];
            if (r >= BM || m >= M) continue;
            const long long off = static_cast<long long>(m) * ldc + n;
            if (v4) {
                av[j] = __ldcs(reinterpret_cast<const float4*>(ma.a + off));
                cv[j] = __ldcs(reinterpret_cast<const float4*>(ma.c + off));
            } else {
                float* pa = &av[j].x;
                float* pc = &cv[j].x;
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (n + e < N) {
                        pa[e] = __ldg(ma.a + off + e);
                        pc[e] = __ldg(ma.c + off + e);
                    }
            }
        }
#pragma unroll
        for (int j = 0; j < RB; ++j) {
            const int r = r0 + j * ROWS, m = m0 + r;
            if (r >= BM || m >= M) break;
            const float4 x = *reinterpret_cast<const float4*>(T + r * LDT + c);
            float v[4] = {x.x + b[0], x.y + b[1], x.z + b[2], x.w + b[3]};
            // y as stored: f32 C and its copy, or bf16 alone (the bias is in)
            gemm_store4<COPY>(C, bias, N, ldc, m, n, v, flags & 64, vec, Cb);
            const float* pa = &av[j].x;
            const float* pc = &cv[j].x;
            float z[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float y = bf16_only ? __bfloat162float(__float2bfloat16_rn(v[e])) : v[e];
                z[e] = erase_add(erase_mul(pa[e], y), pc[e]);
            }
            const long long off = static_cast<long long>(m) * ldc + n;
            if (v4) {
                *reinterpret_cast<float4*>(ma.z + off) = make_float4(z[0], z[1], z[2], z[3]);
            } else {
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (n + e < N) ma.z[off + e] = z[e];
            }
            if (flags & 128) gemm_store4_bf16(ma.zb + static_cast<long long>(m) * ldc, N, n, z, vec);
        }
    }
}

// SPLIT > 1: the kernel runs in clusters of SPLIT CTAs along z, split s taking k from
// s·k_split (gemm_wgmma_body's split-K, summed by gemm_cluster_epilogue).
template <int BN, int STAGES, int SPLIT, bool TA, bool TB, bool COPY, bool MA = false>
__device__ __forceinline__ void gemm_tma_body(const GemmTmap* __restrict__ map_a, const GemmTmap* __restrict__ map_b,
                                              float* __restrict__ C, const float* __restrict__ bias, int M, int N,
                                              int Kp, long long ldc, int k_split, int flags,
                                              __nv_bfloat16* __restrict__ Cb, const GemmMulAdd ma = {}) {
    static_assert(!MA || SPLIT == 1, "the cross update's epilogue stores a whole tile");
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
    if constexpr (MA) gemm_prefetch_mul_add<BN>(ma, M, N, ldc, m0, n0, tid, 256);

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
    if constexpr (MA) {
        gemm_staged_epilogue_ma<BN, COPY>(acc, C, bias, M, N, ldc, m0, n0, flags, base, gemm_smem, Cb, ma);
    } else {
        gemm_wgmma_epilogue<BN, SPLIT, COPY>(acc, C, bias, M, N, ldc, m0, n0, flags, base, gemm_smem, Cb);
    }
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

// gemm_bf16t_128x128_ma and gemm_bf16t_c_128x128_ma: the unsplit 128x128 TMA kernels (f32
// C; C's bf16 copy or, flags & 64, C in bf16 alone) with the cross update in the epilogue
// (gemm_staged_epilogue_ma): the TMA kernels' arguments, then a, c, z and zb (z's bf16
// copy, written where flags & 128). Grid: (Mp/128, Np/128, 1); block 256. sm_90a only.
#define ERASE_GEMM_TMA_MA_ARGS                                                                     \
    ERASE_GEMM_TMA_ARGS, const float *__restrict__ ma_a, const float *__restrict__ ma_c, float *__restrict__ ma_z, \
        __nv_bfloat16 *__restrict__ ma_zb
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define ERASE_GEMM_TMA_MA_KERNEL(LAYOUT, COPY)                                                                 \
    ERASE_KERNEL void __launch_bounds__(256, 2) gemm_bf16t##LAYOUT##_128x128_ma(ERASE_GEMM_TMA_MA_ARGS) {      \
        ERASE_PDL_ENTER();                                                                                     \
        gemm_tma_body<128, 3, 1, false, false, COPY, true>(&map_a, &map_b, C, bias, M, N, Kp, ldc, k_split, flags, \
                                                           Cb, GemmMulAdd{ma_a, ma_c, ma_z, ma_zb});          \
    }
#else
#define ERASE_GEMM_TMA_MA_KERNEL(LAYOUT, COPY)                                                            \
    ERASE_KERNEL void __launch_bounds__(256, 2) gemm_bf16t##LAYOUT##_128x128_ma(ERASE_GEMM_TMA_MA_ARGS) { \
        ERASE_PDL_ENTER();                                                                                \
        __trap();                                                                                         \
    }
#endif
ERASE_GEMM_TMA_MA_KERNEL(, false)
ERASE_GEMM_TMA_MA_KERNEL(_c, true)
