// Part of gemm.cu, the GEMM family's one translation unit: gemm.cu includes it after the parts it
// uses; it is not compiled alone. The pipelined path's cp.async ring and its mma.sync body
// (gemm_pipe_body: the form `gemm_bf16p_*` run where wgmma is not available).

namespace {

// ---- the pipelined path for large GEMMs ---------------------------------------------
//
// Operands first rounded to bf16 by `gemm_to_bf16` / `gemm_to_bf16_t` into K-major,
// zero-padded scratch (A as [Mp][Kp], B as [Np][Kp]: Mp, Np multiples of the tile, Kp of
// BK), so the main loop has no bounds, no layouts and no conversion: STAGES-deep
// cp.async ring of 16-byte chunks in dynamic shared memory (rows padded by 8 bf16, so
// ldmatrix is conflict-free), ldmatrix + mma.sync, one barrier per k step.

__device__ __forceinline__ void gemm_cp_async16(uint32_t smem, const void* gmem) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem), "l"(gmem) : "memory");
}

__device__ __forceinline__ uint32_t gemm_smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void gemm_cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int N>
__device__ __forceinline__ void gemm_cp_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// One operand's tile of a pipelined k step into shared memory, 16-byte cp.async chunks:
// K-major (TR false): ROWS rows of BK k at src[row·ld + k], row r of the tile at
// dst + r·LDS (rows past `lim` read row lim-1: finite values in C's rows or columns that
// are never stored); MN-major (TR true): BK rows of k, each ROWS m/n wide, at
// src[k·ld + m], row k of the tile at dst + k·LDS (chunks past `lim` read the last whole
// chunk, lim a multiple of 8).
template <int ROWS, int BK, int LDS, int THREADS, bool TR>
__device__ __forceinline__ void gemm_pipe_tile(__nv_bfloat16* dst, const __nv_bfloat16* __restrict__ src,
                                               long long ld, int r0, int lim, int k0, int tid) {
    constexpr int CPR = TR ? ROWS / 8 : BK / 8;  // 16-byte chunks per stored row
    constexpr int CH = ROWS * BK / 8 / THREADS;
    static_assert(ROWS * BK / 8 % THREADS == 0, "tiles must split over the threads");
#pragma unroll
    for (int i = 0; i < CH; ++i) {
        const int id = tid + i * THREADS, r = id / CPR, c = (id % CPR) * 8;
        if (TR) {
            const int m = r0 + c < lim ? r0 + c : lim - 8;
            gemm_cp_async16(gemm_smem_addr(dst + r * LDS + c), src + static_cast<long long>(k0 + r) * ld + m);
        } else {
            const int row = r0 + r < lim ? r0 + r : lim - 1;
            gemm_cp_async16(gemm_smem_addr(dst + r * LDS + c), src + static_cast<long long>(row) * ld + k0 + c);
        }
    }
}

template <int BM, int BN, int BK, int WARPS_M, int WARPS_N, int STAGES, bool TA = false, bool TB = false,
          bool COPY = false>
__device__ __forceinline__ void gemm_pipe_body(const __nv_bfloat16* __restrict__ A,
                                               const __nv_bfloat16* __restrict__ B, float* __restrict__ C,
                                               const float* __restrict__ bias, int M, int N, int Kp,
                                               long long lda, long long ldb, long long ldc, long long batch_a,
                                               long long batch_b, long long batch_c, int batch, int k_split,
                                               long long split_c, int flags, __nv_bfloat16* __restrict__ Cb) {
    constexpr int THREADS = WARPS_M * WARPS_N * 32;
    // shared rows: K-major operands BK (+ pad) wide, MN-major ones BM or BN (+ pad)
    constexpr int LDA = (TA ? BM : BK) + GEMM_PAD, LDB = (TB ? BN : BK) + GEMM_PAD;
    constexpr int A_TILE = (TA ? BK : BM) * LDA, B_TILE = (TB ? BK : BN) * LDB;
    constexpr int WTM = BM / WARPS_M, WTN = BN / WARPS_N;
    constexpr int MI = WTM / 16, NI = WTN / 8;
    static_assert(WTM % 16 == 0 && WTN % 16 == 0, "warp tile must be a multiple of 16x16");
    static_assert(STAGES >= 2, "a pipeline needs two stages");
    extern __shared__ __align__(16) unsigned char gemm_smem[];
    __nv_bfloat16* sA = reinterpret_cast<__nv_bfloat16*>(gemm_smem);  // [STAGES][A_TILE]
    __nv_bfloat16* sB = sA + STAGES * A_TILE;                          // [STAGES][B_TILE]

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm0 = (warp / WARPS_N) * WTM, wn0 = (warp % WARPS_N) * WTN;
    const int split = blockIdx.z / batch, bi = blockIdx.z % batch;
    const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN;
    const long long kb = static_cast<long long>(split) * k_split;
    const int k_begin = static_cast<int>(kb < Kp ? kb : Kp);
    const int k_end = k_begin + k_split < Kp ? k_begin + k_split : Kp;
    A += bi * batch_a;
    B += bi * batch_b;
    C += split * split_c + bi * batch_c;

    auto load_stage = [&](int slot, int kt) {
        const int k0 = k_begin + kt * BK;
        gemm_pipe_tile<BM, BK, LDA, THREADS, TA>(sA + slot * A_TILE, A, lda, m0, M, k0, tid);
        gemm_pipe_tile<BN, BK, LDB, THREADS, TB>(sB + slot * B_TILE, B, ldb, n0, N, k0, tid);
    };

    float acc[MI][NI][4];
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int j = 0; j < NI; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

    auto compute = [&](int slot) {
        const __nv_bfloat16* a = sA + slot * A_TILE;
        const __nv_bfloat16* b = sB + slot * B_TILE;
#pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
            uint32_t af[MI][4], bfr[NI][2];
#pragma unroll
            for (int mi = 0; mi < MI; ++mi) {
                if (TA) {
                    const int kr = kk + (lane & 7) + (lane >> 4) * 8;
                    const int mc = wm0 + mi * 16 + ((lane >> 3) & 1) * 8;
                    gemm_ldsm_x4_trans(af[mi], a + kr * LDA + mc);
                } else {
                    const int mr = wm0 + mi * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
                    const int kc = kk + (lane >> 4) * 8;
                    gemm_ldsm_x4(af[mi], a + mr * LDA + kc);
                }
            }
#pragma unroll
            for (int nj = 0; nj < NI / 2; ++nj) {
                uint32_t r[4];
                if (TB) {
                    const int kr = kk + (lane & 7) + ((lane >> 3) & 1) * 8;
                    const int nc = wn0 + nj * 16 + (lane >> 4) * 8;
                    gemm_ldsm_x4_trans(r, b + kr * LDB + nc);
                } else {
                    const int nr = wn0 + nj * 16 + (lane & 7) + (lane >> 4) * 8;
                    const int kc = kk + ((lane >> 3) & 1) * 8;
                    gemm_ldsm_x4(r, b + nr * LDB + kc);
                }
                bfr[2 * nj][0] = r[0];
                bfr[2 * nj][1] = r[1];
                bfr[2 * nj + 1][0] = r[2];
                bfr[2 * nj + 1][1] = r[3];
            }
#pragma unroll
            for (int mi = 0; mi < MI; ++mi)
#pragma unroll
                for (int ni = 0; ni < NI; ++ni) gemm_mma(acc[mi][ni], af[mi], bfr[ni][0], bfr[ni][1]);
        }
    };

    // tile kt lives in slot kt % STAGES; STAGES-1 tiles are in flight while one is
    // multiplied. The barrier at the top of step kt also says every warp is done with
    // slot (kt-1) % STAGES, which step kt refills. Every step commits a group (empty at
    // the end) so that wait_group counts steps.
    const int nk = (k_end - k_begin) / BK;
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < nk) load_stage(s, s);
        gemm_cp_commit();
    }
    for (int kt = 0; kt < nk; ++kt) {
        gemm_cp_wait<STAGES - 2>();
        __syncthreads();
        const int next = kt + STAGES - 1;
        if (next < nk) load_stage(next % STAGES, next);
        gemm_cp_commit();
        compute(kt % STAGES);
    }
    gemm_cp_wait<0>();

    gemm_epilogue<MI, NI, COPY>(acc, C, bias, M, N, ldc, m0 + wm0, n0 + wn0, lane, flags, Cb);
}

}  // namespace
