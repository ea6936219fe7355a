// Tensor-core GEMM for the dense layers: C[b] = op(A[b])·op(B[b]) (+ bias[n]) (ReLU),
// f32 in global memory, operands rounded to bf16 (round to nearest even) as they are
// loaded, products accumulated in f32 by `mma.sync.m16n8k16.row.col.f32.bf16.bf16.f32`.
//
// Layouts (row-major storage, names as MatMul{ta, tb}: op(a)·op(b)):
//   nn: A[m*lda + k], B[k*ldb + n]     LinearGradInput  dx = dy·w
//   nt: A[m*lda + k], B[n*ldb + k]     Linear           y  = x·wᵀ (+ bias)
//   tn: A[k*lda + m], B[k*ldb + n]     LinearGradWeight dw = dyᵀ·x
//   tt: A[k*lda + m], B[n*ldb + k]
// Each layout comes in two tile shapes (extern "C" names gemm_bf16_<layout>_<BM>x<BN>):
//   128x128: 256 threads = 8 warps as 2 (m) x 4 (n), warp tile 64x32 (4x4 mma tiles),
//   64x64:   128 threads = 4 warps as 2 x 2,          warp tile 32x32 (2x4 mma tiles).
// The k step is BK = 32 (two k16 mma steps). Grid: x = M tiles, y = N tiles,
// z = split * batch + batch index.
//
// Per k step every thread loads its share of a later A and B tile (float4 where the
// leading dimension and base allow, else guarded scalars; zero fill past M, N and the
// split's K range) into registers while the warps compute on the current shared-memory
// tile; the registers are then rounded to bf16 and stored to the other shared buffer
// (double buffering through registers: cp.async cannot round f32 to bf16 on the way, and
// f32 stages deep enough to help do not fit the 48 KB of static shared memory). The
// 64x64 tile loads one step ahead (4 CTAs per SM hide the latency); the 128x128 tile,
// one CTA per SM by its registers, keeps two register sets and loads two steps ahead.
// Shared tiles keep the global
// layout (k-contiguous rows for K-major operands, m/n-contiguous rows otherwise), padded
// by 8 bf16 per row so that ldmatrix (plain for K-major, .trans otherwise) is free of
// bank conflicts. Every warp then runs BK/16 x (MI x NI) mma per k step.
//
// Split-K (a fixed range of k per split, the grid's z) writes f32 partials to scratch;
// `gemm_splitk_reduce` sums them in split order (deterministic, no atomics) and applies
// the bias and ReLU. The pipelined kernels (either tile) instead sum their splits inside
// a thread-block cluster on sm_90 (gemm_bf16p_128x128_k<S>, _128x256_k<S>,
// gemm_cluster_epilogue). Epilogue flags: bit 0 adds bias[n], bit 1 applies ReLU, bit 3
// the ReLU gradient's mask (the `bias` pointer then being the ReLU's output), bit 4 in the
// pipelined kernels a residual added after the product (`bias` then being R, of C's
// layout; a GEMM with neither a bias nor a mask, C written whole by one launch). The direct
// epilogue writes each thread's two adjacent columns as one float2 where C's alignment
// allows; the wgmma tile's (gemm_staged_epilogue) a float4 a lane through shared memory.
//
// Bound: 2·M·N·K FLOPs on tensor cores against 4·(M·K·ceil(N/BN) + N·K·ceil(M/BM) + M·N)
// bytes; the model's small shapes (K = 13..351, N small) are memory-bound and run these
// single-launch kernels.
//
// A bf16 A beside an f32 B (a dy the op that made it wrote in bf16: AutoInt's dqkv) has
// `_a16` forms of the nn and tn kernels, which stage its tiles as they are (and sum a
// transposed A's columns from the bf16 values).
//
// Tall GEMMs (many rows, N ≤ 256, small K) take `gemm_tall_n*` (see gemm_tall_body).
// Large GEMMs (ops/src/cuda/dense.rs decides) take the pipelined path instead: the
// operands are rounded to bf16 once, by `gemm_to_bf16` / `gemm_to_bf16_t`, into K-major
// zero-padded scratch (the same round-to-nearest-even, so the same products), and
// `gemm_bf16p_*` multiplies them through a cp.async ring in dynamic shared memory:
// wgmma on sm_90a, ldmatrix + mma.sync on sm_80 (see gemm_wgmma_body, gemm_pipe_body).
// Rounding in a separate pass costs 6 bytes per operand element once, against re-reading
// f32 tiles from L2 for every output tile and keeping the f32 -> bf16 work and register
// staging out of the main loop.
#include "common.cuh"

// The driver's TMA descriptor (CUtensorMap), opaque here: the TMA kernels take two by
// value (gemm_tma_body).
struct alignas(64) GemmTmap {
    unsigned long long v[16];
};

namespace {

constexpr int GEMM_BK = 32;
constexpr int GEMM_PAD = 8;  // bf16 elements of padding per shared row (16 bytes)

__device__ __forceinline__ uint32_t gemm_pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
}

__device__ __forceinline__ void gemm_ldsm_x4(uint32_t (&r)[4], const __nv_bfloat16* p) {
    const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

__device__ __forceinline__ void gemm_ldsm_x4_trans(uint32_t (&r)[4], const __nv_bfloat16* p) {
    const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

__device__ __forceinline__ void gemm_mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// A ROWS x COLS tile of an f32 matrix whose element (r, c) is src[r*ld + c], staged in
// registers (float4 chunks) and stored to shared memory as bf16 [ROWS][COLS + PAD].
template <int ROWS, int COLS, int THREADS>
struct GemmTileLoader {
    static constexpr int CPR = COLS / 4;  // float4 chunks per row
    static constexpr int PER = ROWS * CPR / THREADS;
    static_assert(ROWS * CPR % THREADS == 0, "tile must split evenly over the threads");
    float4 v[PER];

    __device__ __forceinline__ void load(const float* __restrict__ src, long long ld, int row0, int col0,
                                         int row_lim, int col_lim, bool vec, int tid) {
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            const int id = tid + i * THREADS;
            const int r = row0 + id / CPR, c = col0 + (id % CPR) * 4;
            float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
            if (r < row_lim) {
                const float* p = src + static_cast<long long>(r) * ld + c;
                if (vec && c + 3 < col_lim) {
                    x = __ldg(reinterpret_cast<const float4*>(p));
                } else {
                    if (c < col_lim) x.x = __ldg(p);
                    if (c + 1 < col_lim) x.y = __ldg(p + 1);
                    if (c + 2 < col_lim) x.z = __ldg(p + 2);
                    if (c + 3 < col_lim) x.w = __ldg(p + 3);
                }
            }
            v[i] = x;
        }
    }

    __device__ __forceinline__ void store(__nv_bfloat16 (*dst)[COLS + GEMM_PAD], int tid) const {
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            const int id = tid + i * THREADS;
            const int r = id / CPR, c = (id % CPR) * 4;
            uint2 packed;
            packed.x = gemm_pack_bf16(v[i].x, v[i].y);
            packed.y = gemm_pack_bf16(v[i].z, v[i].w);
            *reinterpret_cast<uint2*>(&dst[r][c]) = packed;
        }
    }

    // chunk i's four values (a transposed A's column sums)
    __device__ __forceinline__ float4 value(int i) const { return v[i]; }
};

// The same tile of a bf16 matrix (an operand rounded once by the op that made it, read
// as it is): 8-byte chunks of four elements where ld and the base allow, else guarded
// 2-byte loads; stored to shared memory unchanged.
template <int ROWS, int COLS, int THREADS>
struct GemmTileLoaderBf16 {
    static constexpr int CPR = COLS / 4;  // 4-element chunks per row
    static constexpr int PER = ROWS * CPR / THREADS;
    static_assert(ROWS * CPR % THREADS == 0, "tile must split evenly over the threads");
    uint2 v[PER];

    __device__ __forceinline__ void load(const __nv_bfloat16* __restrict__ src, long long ld, int row0, int col0,
                                         int row_lim, int col_lim, bool vec, int tid) {
        const unsigned short* s = reinterpret_cast<const unsigned short*>(src);
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            const int id = tid + i * THREADS;
            const int r = row0 + id / CPR, c = col0 + (id % CPR) * 4;
            uint2 x = make_uint2(0u, 0u);
            if (r < row_lim) {
                const long long o = static_cast<long long>(r) * ld + c;
                if (vec && c + 3 < col_lim) {
                    x = __ldg(reinterpret_cast<const uint2*>(s + o));
                } else {
                    unsigned e[4] = {0u, 0u, 0u, 0u};
#pragma unroll
                    for (int j = 0; j < 4; ++j)
                        if (c + j < col_lim) e[j] = __ldg(s + o + j);
                    x = make_uint2(e[0] | (e[1] << 16), e[2] | (e[3] << 16));
                }
            }
            v[i] = x;
        }
    }

    __device__ __forceinline__ void store(__nv_bfloat16 (*dst)[COLS + GEMM_PAD], int tid) const {
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            const int id = tid + i * THREADS;
            *reinterpret_cast<uint2*>(&dst[id / CPR][(id % CPR) * 4]) = v[i];
        }
    }

    __device__ __forceinline__ float4 value(int i) const {
        // a bf16 is the high half of the f32 with the same value
        return make_float4(__uint_as_float(v[i].x << 16), __uint_as_float(v[i].x & 0xffff0000u),
                           __uint_as_float(v[i].y << 16), __uint_as_float(v[i].y & 0xffff0000u));
    }
};

// The tile loader of an operand stored as T (float: rounded as it is staged; bf16: as is).
template <typename T, int ROWS, int COLS, int THREADS>
struct GemmLoaderOf {
    using type = GemmTileLoader<ROWS, COLS, THREADS>;
};
template <int ROWS, int COLS, int THREADS>
struct GemmLoaderOf<__nv_bfloat16, ROWS, COLS, THREADS> {
    using type = GemmTileLoaderBf16<ROWS, COLS, THREADS>;
};

__device__ __forceinline__ bool gemm_vec_ok(const float* p, long long ld) {
    return (ld & 3) == 0 && (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

// A bf16 operand: 8-byte chunks of four elements.
__device__ __forceinline__ bool gemm_vec_ok(const __nv_bfloat16* p, long long ld) {
    return (ld & 3) == 0 && (reinterpret_cast<uintptr_t>(p) & 7) == 0;
}

// Epilogue of a warp tile of MI x NI mma tiles at (row0, col0) of C: the thread holds
// rows g, g+8 and columns 2t, 2t+1 of every mma tile; bias (flags & 1), ReLU (flags & 2),
// the ReLU gradient's mask (flags & 8: zero where mask[m·ldc + n] = bias[m·ldc + n] is
// not > 0, the `bias` pointer then being the ReLU's output, of C's layout, batch 1), two
// adjacent columns as one float2 where C's alignment allows.
template <int MI, int NI, bool MASK, bool COPY = false>
__device__ __forceinline__ void gemm_epilogue_as(const float (&acc)[MI][NI][4], float* __restrict__ C,
                                                 const float* __restrict__ bias, int M, int N, long long ldc,
                                                 int row0, int col0, int lane, int flags,
                                                 __nv_bfloat16* __restrict__ Cb = nullptr) {
    const int g = lane >> 2, t = lane & 3;
    const bool vec_c = (ldc & 1) == 0 && (reinterpret_cast<uintptr_t>(C) & 7) == 0;
    // one pair of C's columns (2t, 2t+1 of mma tile ni) as v, stored as one float2 where C's
    // alignment allows, and its bf16 copy
    auto store = [&](int m, int n, float (&v)[2]) {
        float* crow = C + static_cast<long long>(m) * ldc;
        if (vec_c && n + 1 < N) {
            *reinterpret_cast<float2*>(crow + n) = make_float2(v[0], v[1]);
        } else {
            if (n < N) crow[n] = v[0];
            if (n + 1 < N) crow[n + 1] = v[1];
        }
        if constexpr (COPY) {
            // the bf16 copy of C (C's layout) that a later GEMM reads
            __nv_bfloat16* brow = Cb + static_cast<long long>(m) * ldc;
            if (vec_c && n + 1 < N) {
                *reinterpret_cast<__nv_bfloat162*>(brow + n) = __floats2bfloat162_rn(v[0], v[1]);
            } else {
                if (n < N) brow[n] = __float2bfloat16_rn(v[0]);
                if (n + 1 < N) brow[n + 1] = __float2bfloat16_rn(v[1]);
            }
        }
    };
    if constexpr (!MASK) {
        // a column pair's bias is read once for all the warp's rows (read per element
        // between the stores, each load waited for before its store, it left the epilogue
        // of wide outputs latency-bound)
#pragma unroll
        for (int ni = 0; ni < NI; ++ni) {
            const int n = col0 + ni * 8 + 2 * t;  // even
            float b[2] = {0.f, 0.f};
            if (flags & 1) {
                if (n < N) b[0] = __ldg(bias + n);
                if (n + 1 < N) b[1] = __ldg(bias + n + 1);
            }
#pragma unroll
            for (int mi = 0; mi < MI; ++mi)
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int m = row0 + mi * 16 + g + half * 8;
                    if (m >= M) continue;
                    float v[2];
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        v[e] = acc[mi][ni][half * 2 + e];
                        if (flags & 1) v[e] += b[e];
                        if (flags & 2) v[e] = fmaxf(v[e], 0.f);
                        // the residual (flags & 16, no bias: `bias` is R, C's layout)
                        if ((flags & 16) && n + e < N) v[e] += __ldg(bias + static_cast<long long>(m) * ldc + n + e);
                    }
                    store(m, n, v);
                }
        }
        return;
    }
    // the mask form (no bias: `bias` is the mask): the mask is read NC mma tiles at a time,
    // all loads issued before the stores (one at a time, each load waited for before its
    // store, left the epilogue latency-bound); NC divides NI, so no group runs past the
    // warp's tiles
    constexpr int NC = NI % 4 == 0 ? 4 : (NI % 2 == 0 ? 2 : 1);
#pragma unroll
    for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int m = row0 + mi * 16 + g + half * 8;
            if (m >= M) continue;
#pragma unroll
            for (int n0 = 0; n0 < NI; n0 += NC) {
                float keep[NC][2];
#pragma unroll
                for (int c = 0; c < NC; ++c)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int n = col0 + (n0 + c) * 8 + 2 * t + e;
                        keep[c][e] = n < N ? __ldg(bias + static_cast<long long>(m) * ldc + n) : 1.f;
                    }
#pragma unroll
                for (int c = 0; c < NC; ++c) {
                    const int ni = n0 + c;
                    const int n = col0 + ni * 8 + 2 * t;  // even
                    float v[2];
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        v[e] = acc[mi][ni][half * 2 + e];
                        if (flags & 2) v[e] = fmaxf(v[e], 0.f);
                        if (!(keep[c][e] > 0.f)) v[e] = 0.f;
                    }
                    store(m, n, v);
                }
            }
        }
    }
}

// The epilogue with the mask compiled in only where flags ask for it (the plain form is
// the store-bound path of most GEMMs).
template <int MI, int NI, bool COPY = false>
__device__ __forceinline__ void gemm_epilogue(const float (&acc)[MI][NI][4], float* __restrict__ C,
                                              const float* __restrict__ bias, int M, int N, long long ldc,
                                              int row0, int col0, int lane, int flags,
                                              __nv_bfloat16* __restrict__ Cb = nullptr) {
    if (flags & 8)
        gemm_epilogue_as<MI, NI, true, COPY>(acc, C, bias, M, N, ldc, row0, col0, lane, flags, Cb);
    else
        gemm_epilogue_as<MI, NI, false, COPY>(acc, C, bias, M, N, ldc, row0, col0, lane, flags, Cb);
}

template <int BM, int BN, int WARPS_M, int WARPS_N, int AHEAD, bool TA, bool TB, typename AT = float>
__device__ __forceinline__ void gemm_bf16_body(const AT* __restrict__ A, const float* __restrict__ B,
                                               float* __restrict__ C, const float* __restrict__ bias, int M,
                                               int N, int K, long long lda, long long ldb, long long ldc,
                                               long long batch_a, long long batch_b, long long batch_c,
                                               int batch, int k_split, long long split_c, int flags,
                                               float* __restrict__ asum) {
    constexpr int THREADS = WARPS_M * WARPS_N * 32;
    constexpr int BK = GEMM_BK;
    constexpr int WTM = BM / WARPS_M, WTN = BN / WARPS_N;
    constexpr int MI = WTM / 16, NI = WTN / 8;
    static_assert(WTM % 16 == 0 && WTN % 16 == 0, "warp tile must be a multiple of 16x16");
    // shared tiles in the operands' global layout
    constexpr int A_ROWS = TA ? BK : BM, A_COLS = TA ? BM : BK;
    constexpr int B_ROWS = TB ? BN : BK, B_COLS = TB ? BK : BN;
    __shared__ __align__(16) __nv_bfloat16 sA[2][A_ROWS][A_COLS + GEMM_PAD];
    __shared__ __align__(16) __nv_bfloat16 sB[2][B_ROWS][B_COLS + GEMM_PAD];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm0 = (warp / WARPS_N) * WTM, wn0 = (warp % WARPS_N) * WTN;
    const int split = blockIdx.z / batch, bi = blockIdx.z % batch;
    const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN;
    const long long kb = static_cast<long long>(split) * k_split;
    const int k_begin = static_cast<int>(kb < K ? kb : K);
    const int k_end = k_begin + k_split < K ? k_begin + k_split : K;
    A += bi * batch_a;
    B += bi * batch_b;
    C += split * split_c + bi * batch_c;
    const bool vec_a = gemm_vec_ok(A, lda), vec_b = gemm_vec_ok(B, ldb);

    // staged tiles: set 0, and set 1 when loads run two k steps ahead
    struct Staged {
        typename GemmLoaderOf<AT, A_ROWS, A_COLS, THREADS>::type a;
        GemmTileLoader<B_ROWS, B_COLS, THREADS> b;
    };
    Staged st0, st1;
    auto load = [&](Staged& s, int kt) {
        const int k0 = k_begin + kt * BK;
        if (TA) s.a.load(A, lda, k0, m0, k_end, M, vec_a, tid);
        else s.a.load(A, lda, m0, k0, M, k_end, vec_a, tid);
        if (TB) s.b.load(B, ldb, n0, k0, N, k_end, vec_b, tid);
        else s.b.load(B, ldb, k0, n0, k_end, N, vec_b, tid);
    };
    // flags & 4 (TA only): the sums of A's stored columns over this split's k rows, from
    // the f32 values as they are staged. A thread's chunks of an A tile all lie in the
    // same four columns, (tid % CPR)·4, so a float4 per thread collects them (tile by
    // tile, chunk by chunk: a fixed order), combined across threads after the loop.
    constexpr int A_CPR = A_COLS / 4;
    static_assert(!TA || THREADS % A_CPR == 0, "a thread's A chunks must share their columns");
    const bool sums = TA && (flags & 4);
    float4 colacc = make_float4(0.f, 0.f, 0.f, 0.f);
    auto store = [&](const Staged& s, int buf) {
        s.a.store(sA[buf], tid);
        s.b.store(sB[buf], tid);
        if (TA && sums) {
#pragma unroll
            for (int i = 0; i < decltype(s.a)::PER; ++i) {
                const float4 x = s.a.value(i);
                colacc.x += x.x;
                colacc.y += x.y;
                colacc.z += x.z;
                colacc.w += x.w;
            }
        }
    };

    float acc[MI][NI][4];
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int j = 0; j < NI; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

    auto compute = [&](int buf) {
#pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
            uint32_t af[MI][4], bfr[NI][2];
#pragma unroll
            for (int mi = 0; mi < MI; ++mi) {
                if (TA) {
                    const int kr = kk + (lane & 7) + (lane >> 4) * 8;
                    const int mc = wm0 + mi * 16 + ((lane >> 3) & 1) * 8;
                    gemm_ldsm_x4_trans(af[mi], &sA[buf][kr][mc]);
                } else {
                    const int mr = wm0 + mi * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
                    const int kc = kk + (lane >> 4) * 8;
                    gemm_ldsm_x4(af[mi], &sA[buf][mr][kc]);
                }
            }
#pragma unroll
            for (int nj = 0; nj < NI / 2; ++nj) {
                uint32_t r[4];
                if (TB) {
                    const int nr = wn0 + nj * 16 + (lane & 7) + (lane >> 4) * 8;
                    const int kc = kk + ((lane >> 3) & 1) * 8;
                    gemm_ldsm_x4(r, &sB[buf][nr][kc]);
                } else {
                    const int kr = kk + (lane & 7) + ((lane >> 3) & 1) * 8;
                    const int nc = wn0 + nj * 16 + (lane >> 4) * 8;
                    gemm_ldsm_x4_trans(r, &sB[buf][kr][nc]);
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

    const int nk = (k_end - k_begin + BK - 1) / BK;
    if (AHEAD == 1) {
        // tile kt+1 is loaded into registers during the mma of tile kt, then stored to
        // the other buffer (last read in step kt-1, before that step's barrier)
        if (nk > 0) {
            load(st0, 0);
            store(st0, 0);
            __syncthreads();
        }
        for (int kt = 0; kt < nk; ++kt) {
            if (kt + 1 < nk) load(st0, kt + 1);
            compute(kt & 1);
            if (kt + 1 < nk) store(st0, (kt + 1) & 1);
            __syncthreads();
        }
    } else {
        // two register sets: tile kt+2 is loaded during the mma of tile kt and stored
        // after the mma of tile kt+1, a whole step of latency more (unrolled by two so
        // that each set is a compile-time choice)
        if (nk > 0) load(st0, 0);
        if (nk > 1) load(st1, 1);
        if (nk > 0) {
            store(st0, 0);
            __syncthreads();
        }
        for (int kt = 0; kt < nk; kt += 2) {
            if (kt + 2 < nk) load(st0, kt + 2);
            compute(0);
            if (kt + 1 < nk) store(st1, 1);
            __syncthreads();
            if (kt + 1 >= nk) break;
            if (kt + 3 < nk) load(st1, kt + 3);
            compute(1);
            if (kt + 2 < nk) store(st0, 0);
            __syncthreads();
        }
    }

    gemm_epilogue<MI, NI>(acc, C, bias, M, N, ldc, m0 + wm0, n0 + wn0, lane, flags);

    if (TA && sums) {
        // the THREADS / A_CPR threads of each column group added in thread order; the
        // first N tile writes this split's sums to asum[split·M + m]
        constexpr int GROUPS = TA ? THREADS / A_CPR : 1;
        __shared__ float4 sSum[GROUPS][TA ? A_CPR : 1];
        sSum[tid / A_CPR][tid % A_CPR] = colacc;
        __syncthreads();
        if (tid < A_CPR && blockIdx.y == 0) {
            float4 t = sSum[0][tid];
#pragma unroll
            for (int q = 1; q < GROUPS; ++q) {
                const float4 u = sSum[q][tid];
                t.x += u.x;
                t.y += u.y;
                t.z += u.z;
                t.w += u.w;
            }
            const float tv[4] = {t.x, t.y, t.z, t.w};
            float* dst = asum + static_cast<long long>(split) * M;
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int m = m0 + tid * 4 + e;
                if (m < M) dst[m] = tv[e];
            }
        }
    }
}

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

// ---- tall GEMMs: many rows, the whole of N and K in one CTA -----------------------------
//
// `gemm_tall_n<NMAX>[_c]`: C[M, N] = A[M, K]·op(B) (+ bias)(ReLU)(mask), batch 1, A K-major
// (A[m·lda + k]), N ≤ NMAX, K small (the plan checks the shared memory). AutoInt's
// projections are of this shape (110592 rows, N and K of 64 and 192): memory-bound, with
// a CTA of the general kernels loading, multiplying and storing one tile at a time.
// Here a persistent CTA keeps op(B) in shared memory as bf16 (staged once) and walks
// 64-row blocks of A (CTA i takes blocks i, i + grid, ..): block j+1's f32 rows go in
// flight through cp.async before block j is multiplied and stored, so the loads of the
// next block overlap the mma and the stores of this one. A is read from DRAM once and
// each of its elements rounded once per warp column (two warp columns). The `_c` form
// stores through shared memory (gemm_tall_store), the plain one from the fragments;
// `_c_a16` is the `_c` form for a bf16 A, staged as it is (ldmatrix fragments), half the
// shared memory for A. The kernels are latency-bound (16 warps an SM): the block loop
// keeps its integer work small (no division), and the bias is read from shared memory.
//
// 256 threads: 4 warps along M (16 rows each) x 2 along N (NMAX/2 columns each). Shared:
// two A buffers of [64][Kp + 8] f32 (Kp = K rounded up to 32: fragment float2 reads
// conflict-free, rounded to bf16 as they are read; bf16 for `_a16`) and op(B) as bf16
// [NMAX][Kp + 8] (ldmatrix rows). Dynamic shared memory: 2·64·(Kp + 8)·4 (·2 for `_a16`)
// + NMAX·(Kp + 8)·2 bytes, and
// 8·16·40·4 + NMAX·4 more for `_c` (each warp's [16][40] f32 for the store, the bias).
// Arguments: A, B, C, bias (read when flags & 1 or 8), M, N, K (i32), lda, ldb, ldc
// (i64), tb (i32: B stored [N][K] when 1, [K][N] when 0), flags (1 bias, 2 ReLU, 8 the
// ReLU gradient's mask read through `bias`, as gemm_bf16_*; 16, `_c` only: the residual R
// added after the bias), R (C's layout; read when flags & 16). Grid: x CTAs, any count.

// A thread's chunks of a 64-row block of A: chunk id = tid + 256·i is (row id / cpr,
// column chunk id % cpr); the first found by division once per kernel, the next ones by
// adding 256 = dr·cpr + dc (the block loop issues the same chunks for every block; dr
// and dc found once per block, fewer registers held through the loop).
struct TallChunks {
    int r0, c0, cpr;
    __device__ __forceinline__ TallChunks(int tid, int cpr_) : r0(tid / cpr_), c0(tid % cpr_), cpr(cpr_) {}
};

// Issues the cp.async copies of A's 64-row block at m0 (all Kp columns; zero past M and
// K) into dst[64][ld], 4 f32 a chunk.
__device__ __forceinline__ void gemm_tall_stage(float* dst, int ld, const float* __restrict__ A, long long lda,
                                                int m0, int M, int K, bool vec, const TallChunks& ch) {
    const int dr = 256 / ch.cpr, dc = 256 - dr * ch.cpr;
    for (int r = ch.r0, c4 = ch.c0; r < 64;) {
        const int c = c4 * 4;
        const int gm = m0 + r;
        const uint32_t s = gemm_smem_addr(dst + r * ld + c);
        const bool row_ok = gm < M;
        const float* p = A + static_cast<long long>(row_ok ? gm : 0) * lda;
        if (vec) {
            const int left = K - c;
            const int bytes = row_ok ? (left >= 4 ? 16 : (left > 0 ? left * 4 : 0)) : 0;
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s),
                         "l"(bytes > 0 ? p + c : A), "r"(bytes)
                         : "memory");
        } else {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const bool ok = row_ok && c + e < K;
                asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s + 4 * e),
                             "l"(ok ? p + c + e : A), "r"(ok ? 4 : 0)
                             : "memory");
            }
        }
        r += dr;
        c4 += dc;
        if (c4 >= ch.cpr) {
            c4 -= ch.cpr;
            ++r;
        }
    }
}

// The same for a bf16 A (K a multiple of 8, A 16-byte aligned and lda a multiple of 8:
// the plan checks), 16-byte chunks of 8 elements into dst[64][ld] bf16.
__device__ __forceinline__ void gemm_tall_stage(__nv_bfloat16* dst, int ld, const __nv_bfloat16* __restrict__ A,
                                                long long lda, int m0, int M, int K, bool, const TallChunks& ch) {
    const int dr = 256 / ch.cpr, dc = 256 - dr * ch.cpr;
    for (int r = ch.r0, c8 = ch.c0; r < 64;) {
        const int c = c8 * 8;
        const int gm = m0 + r;
        const bool ok = gm < M && c < K;
        const uint32_t s = gemm_smem_addr(dst + r * ld + c);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s),
                     "l"(ok ? A + static_cast<long long>(gm) * lda + c : A), "r"(ok ? 16 : 0)
                     : "memory");
        r += dr;
        c8 += dc;
        if (c8 >= ch.cpr) {
            c8 -= ch.cpr;
            ++r;
        }
    }
}

// flags & 16 (the pipelined kernels' residual: a GEMM without a bias or a mask, `bias`
// pointing at R of C's layout, f32): columns n .. n+3 of R's row m added to v, after the
// product (dx + r, as the GradSum of the two gives it), one streaming float4 load where
// `vec` and R's row allow it.
__device__ __forceinline__ void gemm_add_residual(float (&v)[4], const float* __restrict__ R, int N, long long ldc,
                                                  int m, int n, int flags, bool vec) {
    if (!(flags & 16)) return;
    const float* rr = R + static_cast<long long>(m) * ldc + n;
    if (vec && n + 3 < N && (reinterpret_cast<uintptr_t>(rr) & 15) == 0) {
        const float4 a = __ldcs(reinterpret_cast<const float4*>(rr));
        v[0] += a.x;
        v[1] += a.y;
        v[2] += a.z;
        v[3] += a.w;
    } else {
#pragma unroll
        for (int e = 0; e < 4; ++e)
            if (n + e < N) v[e] += __ldg(rr + e);
    }
}

// Columns n .. n+3 of a bf16 row (`row` at its column 0): v rounded to nearest even, 8
// bytes at once where `vec` allows and all four lie before N, else one at a time up to N.
__device__ __forceinline__ void gemm_store4_bf16(__nv_bfloat16* __restrict__ row, int N, int n, const float (&v)[4],
                                                 bool vec) {
    if (vec && n + 3 < N) {
        const __nv_bfloat162 lo = __floats2bfloat162_rn(v[0], v[1]), hi = __floats2bfloat162_rn(v[2], v[3]);
        *reinterpret_cast<uint2*>(row + n) =
            make_uint2(*reinterpret_cast<const unsigned*>(&lo), *reinterpret_cast<const unsigned*>(&hi));
    } else {
#pragma unroll
        for (int e = 0; e < 4; ++e)
            if (n + e < N) row[n + e] = __float2bfloat16_rn(v[e]);
    }
}

// Columns n .. n+3 of row m of C (m < M): the epilogue of gemm_epilogue (bias, ReLU, the
// ReLU gradient's mask read through `bias`, a residual read through `bias`) on v, then one
// float4 store where `vec` (C and ldc allow it) and all four columns lie before N, else
// scalar stores up to N.
template <bool COPY = false>
__device__ __forceinline__ void gemm_store4(float* __restrict__ C, const float* __restrict__ bias, int N,
                                            long long ldc, int m, int n, float (&v)[4], int flags, bool vec,
                                            __nv_bfloat16* __restrict__ Cb = nullptr) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        if ((flags & 1) && n + e < N) v[e] += __ldg(bias + n + e);
        if (flags & 2) v[e] = fmaxf(v[e], 0.f);
        if ((flags & 8) && n + e < N && !(__ldg(bias + static_cast<long long>(m) * ldc + n + e) > 0.f)) v[e] = 0.f;
    }
    gemm_add_residual(v, bias, N, ldc, m, n, flags, vec);
    float* crow = C + static_cast<long long>(m) * ldc;
    if (vec && n + 3 < N) {
        *reinterpret_cast<float4*>(crow + n) = make_float4(v[0], v[1], v[2], v[3]);
    } else {
#pragma unroll
        for (int e = 0; e < 4; ++e)
            if (n + e < N) crow[n + e] = v[e];
    }
    // the bf16 copy of C, as gemm_epilogue_as
    if constexpr (COPY) gemm_store4_bf16(Cb + static_cast<long long>(m) * ldc, N, n, v, vec);
}

// C stored in bf16 only (a linear layer whose reader rounds its output to bf16 anyway,
// Graph::linear_for_attention): the same f32 values, bias and ReLU applied, rounded to
// nearest even; no mask.
__device__ __forceinline__ void gemm_store4(__nv_bfloat16* __restrict__ C, const float* __restrict__ bias, int N,
                                            long long ldc, int m, int n, float (&v)[4], int flags, bool vec) {
    (void)bias;
#pragma unroll
    for (int e = 0; e < 4; ++e)
        if (flags & 2) v[e] = fmaxf(v[e], 0.f);
    gemm_store4_bf16(C + static_cast<long long>(m) * ldc, N, n, v, vec);
}

// The coalesced store of a tall kernel's warp tile (rows row0 .. row0+15, columns col0 ..
// col0 + 8·NI - 1 of C): 32 columns at a time through the warp's [16][40] f32 of shared
// memory (the fragments' float2 writes hit banks 8g + 2t), then read back a float4 a
// lane, 4 rows x 128 bytes an instruction (gemm_store4). The direct epilogue writes 8
// rows x 32 bytes an instruction.
// A bias (flags & 1) is read from `sbias`, the CTA's shared copy of bias[0 .. NMAX) (zero
// past N), a float4 a lane, instead of four global loads per stored float4.
// A residual (flags & 16: LinearAdd) is added after the bias, R of C's layout. A bf16 C
// (CT = __nv_bfloat16) is stored in bf16 only, 8 bytes a lane.
template <int NI, typename CT = float>
__device__ __forceinline__ void gemm_tall_store(const float (&acc)[1][NI][4], float* stage, CT* __restrict__ C,
                                                const float* __restrict__ bias, const float* sbias,
                                                const float* __restrict__ R, int M, int N, long long ldc, int row0,
                                                int col0, int lane, int flags) {
    static_assert(NI % 4 == 0, "whole 32-column chunks");
    const int g = lane >> 2, t = lane & 3;
    // (R has C's layout, f32: 16-byte rows where C's f32 ones would be)
    const bool vec = (ldc & 3) == 0 && (reinterpret_cast<uintptr_t>(C) & (4 * sizeof(CT) - 1)) == 0;
#pragma unroll
    for (int c = 0; c < NI / 4; ++c) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            *reinterpret_cast<float2*>(stage + g * 40 + j * 8 + 2 * t) =
                make_float2(acc[0][c * 4 + j][0], acc[0][c * 4 + j][1]);
            *reinterpret_cast<float2*>(stage + (g + 8) * 40 + j * 8 + 2 * t) =
                make_float2(acc[0][c * 4 + j][2], acc[0][c * 4 + j][3]);
        }
        __syncwarp();
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int r = i * 4 + (lane >> 3), q = (lane & 7) * 4;
            const float4 x = *reinterpret_cast<const float4*>(stage + r * 40 + q);
            const int m = row0 + r, n = col0 + c * 32 + q;
            if (m >= M) continue;
            float v[4] = {x.x, x.y, x.z, x.w};
            if (flags & 1) {
                const float4 b = *reinterpret_cast<const float4*>(sbias + n);
                v[0] += b.x;
                v[1] += b.y;
                v[2] += b.z;
                v[3] += b.w;
            }
            gemm_add_residual(v, R, N, ldc, m, n, flags, vec);
            gemm_store4(C, bias, N, ldc, m, n, v, flags & ~17, vec);
        }
        __syncwarp();
    }
}

template <int NMAX, bool COALESCE, typename AT = float, typename CT = float>
__device__ __forceinline__ void gemm_tall_body(const AT* __restrict__ A, const float* __restrict__ B,
                                               CT* __restrict__ C, const float* __restrict__ bias, int M,
                                               int N, int K, long long lda, long long ldb, long long ldc, int tb,
                                               int flags, const float* __restrict__ R) {
    constexpr int NI = NMAX / 16;  // n8 tiles of a warp (two warp columns)
    static_assert(NMAX % 32 == 0, "a warp column must be whole 16-column ldmatrix pairs");
    extern __shared__ __align__(16) unsigned char gemm_smem[];
    const int Kp = (K + 31) / 32 * 32, lda_s = Kp + 8, ldb_s = Kp + 8;
    constexpr bool A16 = sizeof(AT) == 2;  // A is bf16, staged as it is
    AT* sA = reinterpret_cast<AT*>(gemm_smem);
    __nv_bfloat16* sB = reinterpret_cast<__nv_bfloat16*>(sA + 2 * 64 * lda_s);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int wm = (warp >> 1) * 16, wn = (warp & 1) * (NMAX / 2);
    const bool vec = gemm_vec_ok(A, lda);
    const int blocks_m = (M + 63) / 64;

    const TallChunks chunks(tid, Kp / (A16 ? 8 : 4));
    int mb = blockIdx.x;
    if (mb < blocks_m) gemm_tall_stage(sA, lda_s, A, lda, mb * 64, M, K, vec, chunks);
    gemm_cp_commit();
    // op(B)ᵀ as bf16 [n][k], zero past N and K (ordinary loads, made visible by the
    // first block's barrier), lanes along B's stored rows (coalesced), warps across
    // them, many loads in flight per thread: one at a time, this fixed cost of every CTA
    // was a chain of L2 latencies as long as several blocks' work. No division: it was
    // most of the instructions of a CTA that walks a few blocks.
    auto b_at = [&](int n, int k) -> float {
        return n < N && k < K
                   ? __ldg(B + (tb ? static_cast<long long>(n) * ldb + k : static_cast<long long>(k) * ldb + n))
                   : 0.f;
    };
    if (tb) {
        // B[n·ldb + k]: lanes along k (Kp a multiple of 32), warps take n = warp + 8u,
        // 16 loads at a time (more spilled registers in the widest kernel)
        constexpr int U = NMAX / 8 < 16 ? NMAX / 8 : 16;
        for (int k = lane; k < Kp; k += 32) {
#pragma unroll
            for (int u0 = 0; u0 < NMAX / 8; u0 += U) {
                float v[U];
#pragma unroll
                for (int u = 0; u < U; ++u) v[u] = b_at(warp + 8 * (u0 + u), k);
#pragma unroll
                for (int u = 0; u < U; ++u) sB[(warp + 8 * (u0 + u)) * ldb_s + k] = __float2bfloat16_rn(v[u]);
            }
        }
    } else {
        // B[k·ldb + n]: lanes along n, warps take k = k0 + 8u (k0 - warp a multiple of 32)
        for (int k0 = warp; k0 < Kp; k0 += 32) {
            float v[4][NMAX / 32];
#pragma unroll
            for (int u = 0; u < 4; ++u)
#pragma unroll
                for (int j = 0; j < NMAX / 32; ++j) v[u][j] = b_at(lane + 32 * j, k0 + 8 * u);
#pragma unroll
            for (int u = 0; u < 4; ++u)
#pragma unroll
                for (int j = 0; j < NMAX / 32; ++j)
                    sB[(lane + 32 * j) * ldb_s + k0 + 8 * u] = __float2bfloat16_rn(v[u][j]);
        }
    }
    // the coalesced store's bias, after its stage buffers (zero past N)
    float* sbias = reinterpret_cast<float*>(sB + NMAX * ldb_s) + 8 * 16 * 40;
    if (COALESCE && (flags & 1))
        for (int i = tid; i < NMAX; i += 256) sbias[i] = i < N ? __ldg(bias + i) : 0.f;

    for (int it = 0; mb < blocks_m; ++it, mb += gridDim.x) {
        const int next = mb + gridDim.x;
        const AT* a = sA + (it & 1) * 64 * lda_s;
        if (next < blocks_m) gemm_tall_stage(sA + ((it + 1) & 1) * 64 * lda_s, lda_s, A, lda, next * 64, M, K, vec, chunks);
        gemm_cp_commit();
        gemm_cp_wait<1>();
        __syncthreads();

        float acc[1][NI][4];
#pragma unroll
        for (int j = 0; j < NI; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[0][j][e] = 0.f;
        for (int kk = 0; kk < Kp; kk += 16) {
            uint32_t af[4];
            if constexpr (A16) {
                const int mr = wm + (lane & 7) + ((lane >> 3) & 1) * 8, kc = kk + (lane >> 4) * 8;
                gemm_ldsm_x4(af, reinterpret_cast<const __nv_bfloat16*>(a) + mr * lda_s + kc);
            } else {
                const float* ar = reinterpret_cast<const float*>(a) + (wm + g) * lda_s + kk + 2 * t;
                const float2 v0 = *reinterpret_cast<const float2*>(ar);
                const float2 v1 = *reinterpret_cast<const float2*>(ar + 8 * lda_s);
                const float2 v2 = *reinterpret_cast<const float2*>(ar + 8);
                const float2 v3 = *reinterpret_cast<const float2*>(ar + 8 * lda_s + 8);
                af[0] = gemm_pack_bf16(v0.x, v0.y);
                af[1] = gemm_pack_bf16(v1.x, v1.y);
                af[2] = gemm_pack_bf16(v2.x, v2.y);
                af[3] = gemm_pack_bf16(v3.x, v3.y);
            }
#pragma unroll
            for (int nj = 0; nj < NI / 2; ++nj) {
                uint32_t r[4];
                const int nr = wn + nj * 16 + (lane & 7) + (lane >> 4) * 8;
                const int kc = kk + ((lane >> 3) & 1) * 8;
                gemm_ldsm_x4(r, sB + nr * ldb_s + kc);
                gemm_mma(acc[0][2 * nj], af, r[0], r[1]);
                gemm_mma(acc[0][2 * nj + 1], af, r[2], r[3]);
            }
        }
        if constexpr (COALESCE) {
            float* stage = reinterpret_cast<float*>(sB + NMAX * ldb_s) + warp * 16 * 40;
            gemm_tall_store<NI, CT>(acc, stage, C, bias, sbias, R, M, N, ldc, mb * 64 + wm, wn, lane, flags);
        } else {
            static_assert(sizeof(CT) == 4, "a bf16 C is stored through shared memory");
            gemm_epilogue<1, NI>(acc, C, bias, M, N, ldc, mb * 64 + wm, wn, lane, flags);
        }
        // every warp is done with this buffer before the next step but one refills it
        __syncthreads();
    }
    gemm_cp_wait<0>();
}

// ---- the wgmma form of the pipelined path (sm_90a) --------------------------------------
//
// BM = 128 rows as two warpgroups of 64, BK = 64: a shared row of a stage is 128 bytes,
// stored with the 128-byte swizzle (16-byte chunk c of row r at r·128 + ((c ^ r%8)·16),
// stage bases 1024-aligned) that wgmma's descriptors name; cp.async fills it, and each
// k step is four m64nBNk16 wgmma per warpgroup on the stage's descriptors (a k16 step is
// 32 bytes further into the swizzled rows).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// Shared-memory matrix descriptor, 128-byte swizzle: start address, leading byte offset
// (K-major: unused with a swizzle, 16; MN-major: 8192, between the 64-wide m or n blocks
// of a stage, each [64 k][64] as 64 rows of 128 bytes), stride byte offset 1024 (between
// groups of 8 rows: of m or n when K-major, of k when MN-major).
template <bool MN = false>
__device__ __forceinline__ uint64_t gemm_wgmma_desc(uint32_t saddr) {
    constexpr uint64_t lbo = MN ? 8192 : 16;
    return static_cast<uint64_t>((saddr & 0x3FFFF) >> 4) | ((lbo >> 4) << 16) |
           (static_cast<uint64_t>(1024 >> 4) << 32) | (1ull << 62);
}

// D(64x64) += A(64x16)·B(64x16)ᵀ, as gemm_wgmma_n128 (the warp-specialized 128x64 tile).
template <bool TA, bool TB>
__device__ __forceinline__ void gemm_wgmma_n64(float (&d)[32], uint64_t da, uint64_t db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
        "}, %32, %33, p, 1, 1, %35, %36;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(da), "l"(db), "r"(1), "n"(int(TA)), "n"(int(TB)));
}

// D(64x128) += A(64x16)·B(128x16)ᵀ, both in shared memory, 128-byte swizzle; TA, TB: the
// operand is MN-major (the instruction's transpose flags), else K-major.
template <bool TA, bool TB>
__device__ __forceinline__ void gemm_wgmma_n128(float (&d)[64], uint64_t da, uint64_t db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, %64, %65, p, 1, 1, %67, %68;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db), "r"(1), "n"(int(TA)), "n"(int(TB)));
}

// D(64x256) += A(64x16)·B(256x16)ᵀ, as gemm_wgmma_n128.
template <bool TA, bool TB>
__device__ __forceinline__ void gemm_wgmma_n256(float (&d)[128], uint64_t da, uint64_t db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
        "}, %128, %129, p, 1, 1, %131, %132;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
          "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
          "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(da), "l"(db), "r"(1), "n"(int(TA)), "n"(int(TB)));
}

// Keeps the compiler from moving accumulator accesses across wgmma issue and wait.
template <int N>
__device__ __forceinline__ void gemm_wgmma_hold(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// One k step (64 k) of a warpgroup's wgmma on the stage whose A rows start at `sa` and
// whose B tile starts at `sb` (both 128-byte swizzled): four m64nBNk16, committed as one
// group (a k16 step is 32 bytes into K-major rows, 16 rows of 128 bytes down MN-major
// ones). The caller waits for the group.
template <int BN, bool TA, bool TB>
__device__ __forceinline__ void gemm_wgmma_kstep(float (&d)[BN / 2], uint32_t sa, uint32_t sb) {
    constexpr uint32_t KA = TA ? 2048 : 32, KB = TB ? 2048 : 32;
    gemm_wgmma_hold(d);
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
        const uint64_t da = gemm_wgmma_desc<TA>(sa + kk * KA), db = gemm_wgmma_desc<TB>(sb + kk * KB);
        if constexpr (BN == 64) gemm_wgmma_n64<TA, TB>(d, da, db);
        else if constexpr (BN == 128) gemm_wgmma_n128<TA, TB>(d, da, db);
        else gemm_wgmma_n256<TA, TB>(d, da, db);
    }
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

// Split-K inside a cluster: the S splits of an output tile are the S CTAs of one cluster
// (cluster dims (1, 1, S), batch 1). Each CTA writes its f32 partial tile to its own
// shared memory (the ring is free by then), the cluster waits for all of them, and CTA
// rank r sums rows [r·BM/S, (r+1)·BM/S) of the S partials in rank (= split) order
// through distributed shared memory, applies the epilogue and stores them a float4 at a
// time (gemm_store4). The same sum order every run, no partials in global memory and no
// reduction launch. A second cluster barrier keeps every CTA's shared memory alive until
// the others have read it.
__device__ __forceinline__ void gemm_cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// A wgmma tile's f32 accumulators into the free ring at `base` as [128][BN + 4] (the
// fragments' float2 writes, row g and column 2t, hit banks 4g + 2t), after a barrier
// that every warpgroup reaches past its last wgmma; the caller syncs before reading it.
// The accumulators are warps 0-7's (a warp-specialized CTA's loader warps, 8 and up,
// hold none).
template <int BN>
__device__ __forceinline__ float* gemm_stage_tile(const float (&acc)[1][BN / 8][4], uint32_t base,
                                                  unsigned char* smem) {
    constexpr int LDT = BN + 4;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    float* T = reinterpret_cast<float*>(smem + (base - gemm_smem_addr(smem)));
    __syncthreads();  // the ring is free
    if (warp >= 8) return T;
    const int r0 = (warp >> 2) * 64 + (warp & 3) * 16 + g;
#pragma unroll
    for (int ni = 0; ni < BN / 8; ++ni) {
        const int c = ni * 8 + 2 * t;
        *reinterpret_cast<float2*>(T + r0 * LDT + c) = make_float2(acc[0][ni][0], acc[0][ni][1]);
        *reinterpret_cast<float2*>(T + (r0 + 8) * LDT + c) = make_float2(acc[0][ni][2], acc[0][ni][3]);
    }
    return T;
}

template <int BN, int S, bool COPY = false, int THREADS = 256>
__device__ __forceinline__ void gemm_cluster_epilogue(const float (&acc)[1][BN / 8][4], float* __restrict__ C,
                                                      const float* __restrict__ bias, int M, int N, long long ldc,
                                                      int m0, int n0, int flags, uint32_t base,
                                                      unsigned char* smem, __nv_bfloat16* __restrict__ Cb) {
    constexpr int BM = 128, LDT = BN + 4, RP = BM / S, C4 = BN / 4;
    const int tid = threadIdx.x;
    gemm_stage_tile<BN>(acc, base, smem);
    gemm_cluster_sync();
    uint32_t rank;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
    const bool vec = (ldc & 3) == 0 && (reinterpret_cast<uintptr_t>(C) & 15) == 0;
    for (int id = tid; id < RP * C4; id += THREADS) {
        const int r = static_cast<int>(rank) * RP + id / C4, c = (id % C4) * 4;
        const uint32_t local = base + static_cast<uint32_t>(r * LDT + c) * 4u;
        float v[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int q = 0; q < S; ++q) {
            uint32_t remote;
            asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(local), "r"(q));
            float x, y, z, w;
            asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                         : "=f"(x), "=f"(y), "=f"(z), "=f"(w)
                         : "r"(remote)
                         : "memory");
            v[0] += x;
            v[1] += y;
            v[2] += z;
            v[3] += w;
        }
        const int m = m0 + r, n = n0 + c;
        if (m >= M) continue;
        gemm_store4<COPY>(C, bias, N, ldc, m, n, v, flags, vec, Cb);
    }
    gemm_cluster_sync();
}

// The epilogue of a whole wgmma tile through shared memory: the fragments into the free
// ring (gemm_stage_tile), then read back a float4 a
// lane, a warp storing 512 contiguous bytes of a row an instruction (the fragments' own
// stores write 8 rows x 32 bytes each). A thread's four columns are the same in every row
// it stores, so its bias is read once, before the stores.
template <int BN, bool COPY = false, int THREADS = 256>
__device__ __forceinline__ void gemm_staged_epilogue(const float (&acc)[1][BN / 8][4], float* __restrict__ C,
                                                     const float* __restrict__ bias, int M, int N, long long ldc,
                                                     int m0, int n0, int flags, uint32_t base, unsigned char* smem,
                                                     __nv_bfloat16* __restrict__ Cb) {
    constexpr int BM = 128, LDT = BN + 4, C4 = BN / 4, ROWS = THREADS / C4;
    static_assert(THREADS % C4 == 0, "a thread's columns are the same in every row it stores");
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
    const bool vec = (ldc & 3) == 0 && (reinterpret_cast<uintptr_t>(C) & 15) == 0;
    if (flags & 16) {
        // the residual (`bias` is R, of C's layout; no bias): RB rows' R loaded before
        // their stores (each row's load waited for before its store left the epilogue
        // latency-bound: 81 against 49 µs for DCNv2's 4096 x 3456 data gradient)
        constexpr int RB = THREADS == 256 ? 8 : 2;  // (the 384-thread tile has 84 registers a thread)
        const bool rvec = vec && n + 3 < N && (reinterpret_cast<uintptr_t>(bias) & 15) == 0;
        for (int r0 = tid / C4; r0 < BM; r0 += RB * ROWS) {
            float4 rv[RB];
#pragma unroll
            for (int j = 0; j < RB; ++j) {
                const int r = r0 + j * ROWS, m = m0 + r;
                rv[j] = make_float4(0.f, 0.f, 0.f, 0.f);
                if (r >= BM || m >= M) continue;
                const float* rr = bias + static_cast<long long>(m) * ldc + n;
                if (rvec) {
                    rv[j] = __ldcs(reinterpret_cast<const float4*>(rr));
                } else {
                    if (n < N) rv[j].x = __ldg(rr);
                    if (n + 1 < N) rv[j].y = __ldg(rr + 1);
                    if (n + 2 < N) rv[j].z = __ldg(rr + 2);
                    if (n + 3 < N) rv[j].w = __ldg(rr + 3);
                }
            }
#pragma unroll
            for (int j = 0; j < RB; ++j) {
                const int r = r0 + j * ROWS, m = m0 + r;
                if (r >= BM || m >= M) break;
                const float4 x = *reinterpret_cast<const float4*>(T + r * LDT + c);
                // (the product as the plain store gives it, + 0 where there is no bias,
                // then r: the bits of dx stored and summed with r)
                float v[4] = {(x.x + b[0]) + rv[j].x, (x.y + b[1]) + rv[j].y, (x.z + b[2]) + rv[j].z,
                              (x.w + b[3]) + rv[j].w};
                gemm_store4<COPY>(C, bias, N, ldc, m, n, v, flags & ~17, vec, Cb);
            }
        }
        return;
    }
    for (int r = tid / C4; r < BM; r += ROWS) {
        const int m = m0 + r;
        if (m >= M) break;
        const float4 x = *reinterpret_cast<const float4*>(T + r * LDT + c);
        float v[4] = {x.x + b[0], x.y + b[1], x.z + b[2], x.w + b[3]};
        // the bias is in; gemm_store4 applies the ReLU and the mask
        gemm_store4<COPY>(C, bias, N, ldc, m, n, v, flags & ~1, vec, Cb);
    }
}

// A wgmma tile's epilogue: its splits summed in the cluster (CLUSTER > 1), else the
// staged store; THREADS of the CTA store.
template <int BN, int CLUSTER, bool COPY, int THREADS = 256>
__device__ __forceinline__ void gemm_wgmma_epilogue(const float (&acc)[1][BN / 8][4], float* __restrict__ C,
                                                    const float* __restrict__ bias, int M, int N, long long ldc,
                                                    int m0, int n0, int flags, uint32_t base, unsigned char* smem,
                                                    __nv_bfloat16* __restrict__ Cb) {
    if constexpr (CLUSTER > 1) {
        gemm_cluster_epilogue<BN, CLUSTER, COPY, THREADS>(acc, C, bias, M, N, ldc, m0, n0, flags, base, smem, Cb);
    } else {
        gemm_staged_epilogue<BN, COPY, THREADS>(acc, C, bias, M, N, ldc, m0, n0, flags, base, smem, Cb);
    }
}

// One operand's tiles of the wgmma k steps (BK = 64) into the stages, 16-byte cp.async
// chunks in the 128-byte swizzle: K-major (TR false), ROWS rows of 128 bytes (row r at
// r·128, from src[row·ld + k], rows past `lim` reading row lim-1); MN-major (TR true),
// ROWS/64 blocks of [64 k][64 m or n] (block h at h·8192, row k at k·128, from
// src[k·ld + m], chunks past `lim` reading the last whole chunk, lim a multiple of 8).
// Each chunk's clamped offset from the tile's base is found once, 32 bits (under
// ROWS·ld elements K-major, 64·ld + ROWS MN-major; the plans refuse an ld that overflows
// them); a k step adds its k to the base.
template <int ROWS, bool TR, int THREADS = 256>
struct GemmWgmmaTile {
    static constexpr int CH = ROWS * 8 / THREADS;
    static_assert(ROWS * 8 % THREADS == 0, "a tile's chunks split evenly over the loading threads");
    const __nv_bfloat16* base;
    long long ld;
    uint32_t off[CH];

    __device__ __forceinline__ GemmWgmmaTile(const __nv_bfloat16* __restrict__ src, long long ld_, int r0, int lim,
                                             int tid)
        : base(src + (TR ? r0 : static_cast<long long>(r0) * ld_)), ld(ld_) {
#pragma unroll
        for (int i = 0; i < CH; ++i) {
            const int id = tid + i * THREADS, c = id & 7;
            if (TR) {
                const int h = id >> 9, k = (id >> 3) & 63, m = r0 + h * 64 + c * 8;
                off[i] = static_cast<uint32_t>(k * ld + ((m < lim ? m : lim - 8) - r0));
            } else {
                const int r = id >> 3, row = r0 + r < lim ? r0 + r : lim - 1;
                off[i] = static_cast<uint32_t>((row - r0) * ld + c * 8);
            }
        }
    }

    __device__ __forceinline__ void load(uint32_t dst, int k0, int tid) const {
        const __nv_bfloat16* p = base + (TR ? static_cast<long long>(k0) * ld : k0);
#pragma unroll
        for (int i = 0; i < CH; ++i) {
            const int id = tid + i * THREADS, c = id & 7;
            uint32_t at;
            if (TR) {
                const int h = id >> 9, k = (id >> 3) & 63;
                at = h * 8192 + k * 128 + ((c ^ (k & 7)) << 4);
            } else {
                const int r = id >> 3;
                at = r * 128 + ((c ^ (r & 7)) << 4);
            }
            gemm_cp_async16(dst + at, p + off[i]);
        }
    }
};

// flags & 16: the residual's part of this CTA's tile (rows m0 .., columns n0 .. n0+BN-1
// of R, which `bias` points at, C's layout) prefetched into L2 while the main loop runs,
// so that the epilogue's loads of it find it there; `t` of `threads` threads issue them.
template <int BN>
__device__ __forceinline__ void gemm_prefetch_residual(const float* __restrict__ R, int M, int N, long long ldc,
                                                       int m0, int n0, int flags, int t, int threads) {
    if (!(flags & 16)) return;
    constexpr int LINES = BN * 4 / 128;  // 128-byte lines of a tile row
    for (int i = t; i < 128 * LINES; i += threads) {
        const int m = m0 + i / LINES, n = n0 + (i % LINES) * 32;
        if (m < M && n < N) asm volatile("prefetch.global.L2 [%0];\n" ::"l"(R + static_cast<long long>(m) * ldc + n));
    }
}

template <int BN, int STAGES, int CLUSTER = 1, bool TA = false, bool TB = false, bool COPY = false>
__device__ __forceinline__ void gemm_wgmma_body(const __nv_bfloat16* __restrict__ A,
                                                const __nv_bfloat16* __restrict__ B, float* __restrict__ C,
                                                const float* __restrict__ bias, int M, int N, int Kp,
                                                long long lda, long long ldb, long long ldc, long long batch_a,
                                                long long batch_b, long long batch_c, int batch, int k_split,
                                                long long split_c, int flags, __nv_bfloat16* __restrict__ Cb) {
    constexpr int BM = 128, BK = 64;
    constexpr int A_BYTES = BM * BK * 2, STAGE = (BM + BN) * BK * 2, NACC = BN / 2;
    static_assert(BN == 128 || BN == 256, "wgmma tiles are 128 or 256 wide");
    extern __shared__ __align__(16) unsigned char gemm_smem[];
    const uint32_t base = (gemm_smem_addr(gemm_smem) + 1023u) & ~1023u;

    const int tid = threadIdx.x, wg = tid >> 7;
    const int split = blockIdx.z / batch, bi = blockIdx.z % batch;
    const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN;
    const long long kb = static_cast<long long>(split) * k_split;
    const int k_begin = static_cast<int>(kb < Kp ? kb : Kp);
    const int k_end = k_begin + k_split < Kp ? k_begin + k_split : Kp;
    A += bi * batch_a;
    B += bi * batch_b;
    C += split * split_c + bi * batch_c;

    const GemmWgmmaTile<BM, TA> tile_a(A, lda, m0, M, tid);
    const GemmWgmmaTile<BN, TB> tile_b(B, ldb, n0, N, tid);
    auto load_stage = [&](int slot, int kt) {
        const int k0 = k_begin + kt * BK;
        const uint32_t sa = base + slot * STAGE;
        tile_a.load(sa, k0, tid);
        tile_b.load(sa + A_BYTES, k0, tid);
    };

    float acc[1][BN / 8][4];
    float(&d)[NACC] = reinterpret_cast<float(&)[NACC]>(acc);
#pragma unroll
    for (int i = 0; i < NACC; ++i) d[i] = 0.f;

    // as gemm_pipe_body: tile kt in slot kt % STAGES, AHEAD tiles in flight; the
    // cp.async writes (generic proxy) are fenced before the barrier for wgmma's reads
    // (async proxy). The 128x128 tile (two CTAs an SM, whose k steps interleave) keeps
    // STAGES-1 tiles in flight and waits for each k step's wgmma before the next barrier,
    // so the slot refilled after that barrier, step kt-1's, is no longer read. The
    // 128x256 tile (one CTA an SM) keeps a k step's wgmma running while the next is
    // issued: it waits only for the one before (wait_group 1), so it refills step kt-2's
    // slot, STAGES-2 tiles ahead.
    constexpr bool OVERLAP = BN == 256;
    constexpr int AHEAD = OVERLAP ? STAGES - 2 : STAGES - 1;
    static_assert(AHEAD >= 1, "a pipeline needs a tile in flight");
    const int nk = (k_end - k_begin) / BK;
#pragma unroll
    for (int s = 0; s < AHEAD; ++s) {
        if (s < nk) load_stage(s, s);
        gemm_cp_commit();
    }
    gemm_prefetch_residual<BN>(bias, M, N, ldc, m0, n0, flags, tid, 256);
    for (int kt = 0; kt < nk; ++kt) {
        gemm_cp_wait<AHEAD - 1>();
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();
        const int next = kt + AHEAD;
        if (next < nk) load_stage(next % STAGES, next);
        gemm_cp_commit();
        // a warpgroup's 64 rows of A: rows wg·64.. (K-major) or m block wg (MN-major), both
        // 8192 bytes in; a k16 step is 32 bytes into K-major rows, 16 rows of 128 bytes
        // down MN-major ones
        const uint32_t sa = base + (kt % STAGES) * STAGE + wg * 8192, sb = base + (kt % STAGES) * STAGE + A_BYTES;
        gemm_wgmma_kstep<BN, TA, TB>(d, sa, sb);
        if constexpr (OVERLAP) asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
        else asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        gemm_wgmma_hold(d);
    }
    if constexpr (OVERLAP) {
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        gemm_wgmma_hold(d);
    }
    gemm_cp_wait<0>();
    gemm_wgmma_epilogue<BN, CLUSTER, COPY>(acc, C, bias, M, N, ldc, m0, n0, flags, base, gemm_smem, Cb);
}

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

#define ERASE_GEMM_ARGS_A(AT)                                                                           \
    const AT *__restrict__ A, const float *__restrict__ B, float *__restrict__ C,                      \
        const float *__restrict__ bias, int M, int N, int K, long long lda, long long ldb, long long ldc, \
        long long batch_a, long long batch_b, long long batch_c, int batch, int k_split, long long split_c, \
        int flags, float *__restrict__ asum
#define ERASE_GEMM_PASS A, B, C, bias, M, N, K, lda, ldb, ldc, batch_a, batch_b, batch_c, batch, k_split, split_c, flags, asum

// Arguments of every gemm_bf16_* kernel, in order:
//   A, B, C, bias (read when flags & 1 or 8; any valid pointer otherwise),
//   M, N, K (i32), lda, ldb, ldc (i64, elements),
//   batch_a, batch_b, batch_c (i64, elements between batch entries), batch (i32),
//   k_split (i32, multiple of 32: k range of one split), split_c (i64, elements between
//   the outputs of two splits), flags (i32: 1 bias, 2 relu, 4 column sums of a
//   transposed A, batch 1 only, 8 the ReLU gradient's mask read through `bias`, batch 1
//   only), asum (f32 [splits][M], written when flags & 4).
// Grid: (ceil(M/BM), ceil(N/BN), splits·batch); block: 256 (128x128) or 128 (64x64).
#define ERASE_GEMM_KERNELS(LAYOUT, TA, TB)                                                    \
    ERASE_KERNEL void __launch_bounds__(256) gemm_bf16_##LAYOUT##_128x128(ERASE_GEMM_ARGS_A(float)) { ERASE_PDL_ENTER(); \
        gemm_bf16_body<128, 128, 2, 4, 2, TA, TB>(ERASE_GEMM_PASS);                             \
    }                                                                                         \
    ERASE_KERNEL void __launch_bounds__(128) gemm_bf16_##LAYOUT##_64x64(ERASE_GEMM_ARGS_A(float)) { ERASE_PDL_ENTER(); \
        gemm_bf16_body<64, 64, 2, 2, 1, TA, TB>(ERASE_GEMM_PASS);                               \
    }

ERASE_GEMM_KERNELS(nn, false, false)
ERASE_GEMM_KERNELS(nt, false, true)
ERASE_GEMM_KERNELS(tn, true, false)
ERASE_GEMM_KERNELS(tt, true, true)

// `gemm_bf16_<layout>_<tile>_a16`: the same with A a bf16 tensor (read as it is, 8-byte
// chunks where lda is a multiple of 4 and A 8-byte aligned): the dy a data or weight
// gradient reads when the op that made it wrote it in bf16 (AutoInt's attention
// gradient), too small a GEMM for the pipelined path. The layouts of LinearGradInput
// (nn) and LinearGradWeight (tn, with dy's column sums from the bf16 values).
#define ERASE_GEMM_KERNELS_A16(LAYOUT, TA, TB)                                                               \
    ERASE_KERNEL void __launch_bounds__(256) gemm_bf16_##LAYOUT##_128x128_a16(ERASE_GEMM_ARGS_A(__nv_bfloat16)) { ERASE_PDL_ENTER(); \
        gemm_bf16_body<128, 128, 2, 4, 2, TA, TB>(ERASE_GEMM_PASS);                                        \
    }                                                                                                    \
    ERASE_KERNEL void __launch_bounds__(128) gemm_bf16_##LAYOUT##_64x64_a16(ERASE_GEMM_ARGS_A(__nv_bfloat16)) { ERASE_PDL_ENTER(); \
        gemm_bf16_body<64, 64, 2, 2, 1, TA, TB>(ERASE_GEMM_PASS);                                          \
    }
ERASE_GEMM_KERNELS_A16(nn, false, false)
ERASE_GEMM_KERNELS_A16(tn, true, false)

// The tall kernels (see gemm_tall_body), one a bound on N; PER_SM CTAs an SM by registers
// (ops/src/cuda/dense.rs, TALL_KERNELS, plans with the same count).
#define ERASE_GEMM_TALL_KERNEL(NMAX, PER_SM)                                                              \
    ERASE_KERNEL void __launch_bounds__(256, PER_SM)                                                      \
        gemm_tall_n##NMAX(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C,   \
                          const float* __restrict__ bias, int M, int N, int K, long long lda, long long ldb,   \
                          long long ldc, int tb, int flags, const float* __restrict__ R) { ERASE_PDL_ENTER(); \
        gemm_tall_body<NMAX, false>(A, B, C, bias, M, N, K, lda, ldb, ldc, tb, flags, R);                 \
    }                                                                                                     \
    ERASE_KERNEL void __launch_bounds__(256, PER_SM)                                                      \
        gemm_tall_n##NMAX##_c(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C, \
                              const float* __restrict__ bias, int M, int N, int K, long long lda,             \
                              long long ldb, long long ldc, int tb, int flags, const float* __restrict__ R) { ERASE_PDL_ENTER(); \
        gemm_tall_body<NMAX, true>(A, B, C, bias, M, N, K, lda, ldb, ldc, tb, flags, R);                  \
    }
ERASE_GEMM_TALL_KERNEL(64, 3)
ERASE_GEMM_TALL_KERNEL(128, 2)
ERASE_GEMM_TALL_KERNEL(192, 2)
ERASE_GEMM_TALL_KERNEL(256, 2)

// `gemm_tall_n<NMAX>_c_a16`: A bf16 (K a multiple of 8, A 16-byte aligned, lda a
// multiple of 8), staged as it is: half the bytes of an f32 A, so K = 192 (AutoInt's QKV
// data gradient from a bf16 dqkv) fits two CTAs an SM.
#define ERASE_GEMM_TALL_KERNEL_A16(NMAX, PER_SM)                                                              \
    ERASE_KERNEL void __launch_bounds__(256, PER_SM) gemm_tall_n##NMAX##_c_a16(                               \
        const __nv_bfloat16* __restrict__ A, const float* __restrict__ B, float* __restrict__ C,               \
        const float* __restrict__ bias, int M, int N, int K, long long lda, long long ldb, long long ldc,      \
        int tb, int flags, const float* __restrict__ R) { ERASE_PDL_ENTER();                                  \
        gemm_tall_body<NMAX, true>(A, B, C, bias, M, N, K, lda, ldb, ldc, tb, flags, R);                      \
    }
ERASE_GEMM_TALL_KERNEL_A16(64, 3)
ERASE_GEMM_TALL_KERNEL_A16(128, 2)
ERASE_GEMM_TALL_KERNEL_A16(192, 2)
ERASE_GEMM_TALL_KERNEL_A16(256, 2)

// `gemm_tall_n<NMAX>_c_bo`: the `_c` form storing C in bf16 only (C a bf16 pointer, ldc
// in elements; no mask): AutoInt's QKV projection, whose output the attention rounds to
// bf16 anyway, written in half the bytes (Graph::linear_for_attention).
#define ERASE_GEMM_TALL_KERNEL_BO(NMAX, PER_SM)                                                               \
    ERASE_KERNEL void __launch_bounds__(256, PER_SM) gemm_tall_n##NMAX##_c_bo(                                \
        const float* __restrict__ A, const float* __restrict__ B, __nv_bfloat16* __restrict__ C,              \
        const float* __restrict__ bias, int M, int N, int K, long long lda, long long ldb, long long ldc,      \
        int tb, int flags, const float* __restrict__ R) { ERASE_PDL_ENTER();                                  \
        gemm_tall_body<NMAX, true, float, __nv_bfloat16>(A, B, C, bias, M, N, K, lda, ldb, ldc, tb, flags, R); \
    }
ERASE_GEMM_TALL_KERNEL_BO(64, 3)
ERASE_GEMM_TALL_KERNEL_BO(128, 2)
ERASE_GEMM_TALL_KERNEL_BO(192, 2)
ERASE_GEMM_TALL_KERNEL_BO(256, 2)

// The pipelined kernels, arguments in order:
//   A, B (bf16: K-major rows A[m·lda + k], B[n·ldb + k], or, in the `_mm` kernels,
//   MN-major A[k·lda + m], B[k·ldb + n]; batch entries batch_a, batch_b elements apart),
//   C, bias, M, N, Kp (i32; Kp a multiple of 64: the k range read, rows of A and B past M
//   and N read as row M-1 or N-1, and in `_mm` M, N are multiples of 8),
//   lda, ldb, ldc (i64), batch_a, batch_b, batch_c (i64, elements), batch (i32),
//   k_split (i32, multiple of 64), split_c (i64), flags (i32: 1 bias, 2 relu, 8 the mask), Cb (bf16:
//   the `_c` kernels, K-major operands, also store C's bf16 copy there, C's layout, the
//   operand of a later GEMM; the others never touch it).
// The operands are either the plan's rounded scratch (K-major, [Mp][Kp] and [Np][Kp],
// lda = ldb = Kp) or bf16 tensors read in place: an activation rounded once by its
// RoundBf16 node for every GEMM that reads it (K-major as Linear's x or
// LinearGradInput's dy, MN-major as LinearGradWeight's dy and x).
// Grid: (ceil(M/BM), ceil(N/BN), splits·batch); block 256. On sm_90a they run
// gemm_wgmma_body, on other targets gemm_pipe_body (ldmatrix + mma.sync); dynamic shared
// memory is the larger of the two forms' needs (the MN-major forms need no more):
//   gemm_bf16p_128x128  wgmma BK 64, 3 stages, 99328 | mma.sync BK 64, 3 stages, 110592
//                       (2 CTAs per SM): 110592
//   gemm_bf16p_128x256  wgmma BK 64, 4 stages, 197632 | mma.sync BK 32, 4 stages, 122880
//                       (warp tile 64x64): 197632
#define ERASE_GEMM_PIPE_ARGS                                                                            \
    const __nv_bfloat16 *__restrict__ A, const __nv_bfloat16 *__restrict__ B, float *__restrict__ C,    \
        const float *__restrict__ bias, int M, int N, int Kp, long long lda, long long ldb, long long ldc, \
        long long batch_a, long long batch_b, long long batch_c, int batch, int k_split, long long split_c, \
        int flags, __nv_bfloat16 *__restrict__ Cb
#define ERASE_GEMM_PIPE_PASS \
    A, B, C, bias, M, N, Kp, lda, ldb, ldc, batch_a, batch_b, batch_c, batch, k_split, split_c, flags, Cb

// gemm_bf16p<LAYOUT>_128x128 and _128x256, LAYOUT empty (K-major operands), _mm (both
// MN-major), _km (A K-major, B MN-major: a data gradient dy·w on copies of both), _c
// (K-major, and C's bf16 copy written by the epilogue: a separate instantiation, so the
// other kernels' code is that of no copy) or _kmc (_km with the copy: a data gradient
// that is the next layer down's dy).
// gemm_bf16p<LAYOUT>_128x128_k<S> and _128x256_k<S>: the kernel with its S splits (grid
// z = S, batch 1) summed inside a cluster of S CTAs (gemm_cluster_epilogue, its f32 tile
// in the ring: 66 KB of 96 KB at 128x128, 130 KB of 192 KB at 128x256): C is the output,
// `flags` the whole epilogue. Clusters need sm_90; the sm_80 form computes the whole K in
// the CTA of split 0 (the others return), the same result without the split. The plan
// passes split_c = 0 (the kernel body offsets C by split·split_c).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define ERASE_GEMM_PIPE_KERNELS(LAYOUT, TA, TB, COPY)                                                                 \
    ERASE_KERNEL void __launch_bounds__(256, 2) gemm_bf16p##LAYOUT##_128x128(ERASE_GEMM_PIPE_ARGS) { ERASE_PDL_ENTER(); \
        gemm_wgmma_body<128, 3, 1, TA, TB, COPY>(ERASE_GEMM_PIPE_PASS);                                              \
    }                                                                                                        \
    ERASE_KERNEL void __launch_bounds__(256, 1) gemm_bf16p##LAYOUT##_128x256(ERASE_GEMM_PIPE_ARGS) { ERASE_PDL_ENTER(); \
        gemm_wgmma_body<256, 4, 1, TA, TB, COPY>(ERASE_GEMM_PIPE_PASS);                                              \
    }
#define ERASE_GEMM_CLUSTER_KERNEL(LAYOUT, TA, TB, COPY, S)                                                            \
    ERASE_KERNEL void __cluster_dims__(1, 1, S) __launch_bounds__(256, 2)                                    \
        gemm_bf16p##LAYOUT##_128x128_k##S(ERASE_GEMM_PIPE_ARGS) { ERASE_PDL_ENTER();                         \
        gemm_wgmma_body<128, 3, S, TA, TB, COPY>(ERASE_GEMM_PIPE_PASS);                                              \
    }                                                                                                        \
    ERASE_KERNEL void __cluster_dims__(1, 1, S) __launch_bounds__(256, 1)                                    \
        gemm_bf16p##LAYOUT##_128x256_k##S(ERASE_GEMM_PIPE_ARGS) { ERASE_PDL_ENTER();                         \
        gemm_wgmma_body<256, 4, S, TA, TB, COPY>(ERASE_GEMM_PIPE_PASS);                                              \
    }
#else
#define ERASE_GEMM_PIPE_KERNELS(LAYOUT, TA, TB, COPY)                                                                 \
    ERASE_KERNEL void __launch_bounds__(256, 2) gemm_bf16p##LAYOUT##_128x128(ERASE_GEMM_PIPE_ARGS) { ERASE_PDL_ENTER(); \
        gemm_pipe_body<128, 128, 64, 2, 4, 3, TA, TB, COPY>(ERASE_GEMM_PIPE_PASS);                                   \
    }                                                                                                        \
    ERASE_KERNEL void __launch_bounds__(256, 1) gemm_bf16p##LAYOUT##_128x256(ERASE_GEMM_PIPE_ARGS) { ERASE_PDL_ENTER(); \
        gemm_pipe_body<128, 256, 32, 2, 4, 4, TA, TB, COPY>(ERASE_GEMM_PIPE_PASS);                                   \
    }
#define ERASE_GEMM_CLUSTER_KERNEL(LAYOUT, TA, TB, COPY, S)                                                            \
    ERASE_KERNEL void __launch_bounds__(256, 2) gemm_bf16p##LAYOUT##_128x128_k##S(ERASE_GEMM_PIPE_ARGS) { ERASE_PDL_ENTER(); \
        if (blockIdx.z != 0) return;                                                                         \
        gemm_pipe_body<128, 128, 64, 2, 4, 3, TA, TB, COPY>(A, B, C, bias, M, N, Kp, lda, ldb, ldc, batch_a, batch_b, \
                                                    batch_c, 1, Kp, 0, flags, Cb);                               \
    }                                                                                                        \
    ERASE_KERNEL void __launch_bounds__(256, 1) gemm_bf16p##LAYOUT##_128x256_k##S(ERASE_GEMM_PIPE_ARGS) { ERASE_PDL_ENTER(); \
        if (blockIdx.z != 0) return;                                                                         \
        gemm_pipe_body<128, 256, 32, 2, 4, 4, TA, TB, COPY>(A, B, C, bias, M, N, Kp, lda, ldb, ldc, batch_a, batch_b, \
                                                    batch_c, 1, Kp, 0, flags, Cb);                               \
    }
#endif
ERASE_GEMM_PIPE_KERNELS(, false, false, false)
ERASE_GEMM_PIPE_KERNELS(_mm, true, true, false)
ERASE_GEMM_PIPE_KERNELS(_km, false, true, false)
ERASE_GEMM_PIPE_KERNELS(_c, false, false, true)
ERASE_GEMM_PIPE_KERNELS(_kmc, false, true, true)
ERASE_GEMM_CLUSTER_KERNEL(, false, false, false, 2)
ERASE_GEMM_CLUSTER_KERNEL(, false, false, false, 4)
ERASE_GEMM_CLUSTER_KERNEL(, false, false, false, 8)
ERASE_GEMM_CLUSTER_KERNEL(_mm, true, true, false, 2)
ERASE_GEMM_CLUSTER_KERNEL(_mm, true, true, false, 4)
ERASE_GEMM_CLUSTER_KERNEL(_mm, true, true, false, 8)
ERASE_GEMM_CLUSTER_KERNEL(_km, false, true, false, 2)
ERASE_GEMM_CLUSTER_KERNEL(_km, false, true, false, 4)
ERASE_GEMM_CLUSTER_KERNEL(_km, false, true, false, 8)
ERASE_GEMM_CLUSTER_KERNEL(_c, false, false, true, 2)
ERASE_GEMM_CLUSTER_KERNEL(_c, false, false, true, 4)
ERASE_GEMM_CLUSTER_KERNEL(_c, false, false, true, 8)
ERASE_GEMM_CLUSTER_KERNEL(_kmc, false, true, true, 2)
ERASE_GEMM_CLUSTER_KERNEL(_kmc, false, true, true, 4)
ERASE_GEMM_CLUSTER_KERNEL(_kmc, false, true, true, 8)

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

namespace {

// dst[b][r][c] = bf16(src[b·batch_src + r·ld + c]) (round to nearest even) for r < rows,
// c < cols, 0 elsewhere in the padded [rp][cp] (cp a multiple of 8). One thread per 8
// consecutive c: two float4 loads where ld and the base allow, one 16-byte store. `blk`
// is the CTA's index over ceil(rp·cp/8 / 256) CTAs of 256 threads.
__device__ __forceinline__ void gemm_to_bf16_body(const float* __restrict__ src, __nv_bfloat16* __restrict__ dst,
                                                  int rows, int cols, long long ld, long long batch_src, int rp,
                                                  int cp, long long blk) {
    const long long i = blk * 256 + threadIdx.x;
    const int chunks = cp / 8;
    if (i >= static_cast<long long>(rp) * chunks) return;
    const int r = static_cast<int>(i / chunks), c = static_cast<int>(i % chunks) * 8;
    src += blockIdx.z * batch_src;
    dst += static_cast<long long>(blockIdx.z) * rp * cp;
    float v[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = 0.f;
    if (r < rows) {
        const float* p = src + static_cast<long long>(r) * ld + c;
        if (c + 8 <= cols && gemm_vec_ok(p, ld)) {
            const float4 x = __ldg(reinterpret_cast<const float4*>(p));
            const float4 y = __ldg(reinterpret_cast<const float4*>(p + 4));
            v[0] = x.x, v[1] = x.y, v[2] = x.z, v[3] = x.w, v[4] = y.x, v[5] = y.y, v[6] = y.z, v[7] = y.w;
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e)
                if (c + e < cols) v[e] = __ldg(p + e);
        }
    }
    uint4 o;
    o.x = gemm_pack_bf16(v[0], v[1]);
    o.y = gemm_pack_bf16(v[2], v[3]);
    o.z = gemm_pack_bf16(v[4], v[5]);
    o.w = gemm_pack_bf16(v[6], v[7]);
    *reinterpret_cast<uint4*>(dst + static_cast<long long>(r) * cp + c) = o;
}

// The transposing form: dst[b][r][c] = bf16(src[b·batch_src + c·ld + r]) for r < rows,
// c < cols, 0 elsewhere in [rp][cp] (rp, cp multiples of 8). A CTA moves the 64 (r) x 64
// (c) block (bx, by) through shared memory: coalesced f32 loads along r, 16-byte stores
// along c. 256 threads. With `sums` (batch 1), it also writes the f32 sum of its 64 c of
// row r, c ascending, to sums[by·rows + r]: a weight gradient's bias gradient in
// ceil(cols/64) partials, without a pass over src of its own.
__device__ __forceinline__ void gemm_to_bf16_t_body(const float* __restrict__ src, __nv_bfloat16* __restrict__ dst,
                                                    int rows, int cols, long long ld, long long batch_src, int rp,
                                                    int cp, int bx, int by, float* __restrict__ sums) {
    __shared__ float tile[64][65];  // [c][r], padded against bank conflicts
    const int tid = threadIdx.x, tx = tid & 63, ty = tid >> 6;
    const int r0 = bx * 64, c0 = by * 64;
    src += blockIdx.z * batch_src;
    dst += static_cast<long long>(blockIdx.z) * rp * cp;
    const int r = r0 + tx;
#pragma unroll 4
    for (int i = 0; i < 16; ++i) {
        const int cl = ty + 4 * i, c = c0 + cl;
        tile[cl][tx] = (r < rows && c < cols) ? __ldg(src + static_cast<long long>(c) * ld + r) : 0.f;
    }
    __syncthreads();
    if (sums != nullptr && tid < 64 && r0 + tid < rows) {
        float s = 0.f;
        for (int cl = 0; cl < 64; ++cl) s += tile[cl][tid];
        sums[static_cast<long long>(by) * rows + r0 + tid] = s;
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const int id = tid + j * 256, rl = id >> 3, ch = (id & 7) * 8;
        const int rr = r0 + rl, c = c0 + ch;
        if (rr >= rp || c >= cp) continue;
        uint4 o;
        o.x = gemm_pack_bf16(tile[ch][rl], tile[ch + 1][rl]);
        o.y = gemm_pack_bf16(tile[ch + 2][rl], tile[ch + 3][rl]);
        o.z = gemm_pack_bf16(tile[ch + 4][rl], tile[ch + 5][rl]);
        o.w = gemm_pack_bf16(tile[ch + 6][rl], tile[ch + 7][rl]);
        *reinterpret_cast<uint4*>(dst + static_cast<long long>(rr) * cp + c) = o;
    }
}

}  // namespace

// gemm_to_bf16 / gemm_to_bf16_t as above, one matrix a launch. Grid (ceil(rp·cp/8 / 256),
// 1, batch) and (ceil(rp/64), ceil(cp/64), batch), block 256.
ERASE_KERNEL void __launch_bounds__(256)
    gemm_to_bf16(const float* __restrict__ src, __nv_bfloat16* __restrict__ dst, int rows, int cols, long long ld,
                 long long batch_src, int rp, int cp) { ERASE_PDL_ENTER();
    gemm_to_bf16_body(src, dst, rows, cols, ld, batch_src, rp, cp, blockIdx.x);
}

ERASE_KERNEL void __launch_bounds__(256)
    gemm_to_bf16_t(const float* __restrict__ src, __nv_bfloat16* __restrict__ dst, int rows, int cols, long long ld,
                   long long batch_src, int rp, int cp) { ERASE_PDL_ENTER();
    gemm_to_bf16_t_body(src, dst, rows, cols, ld, batch_src, rp, cp, blockIdx.x, blockIdx.y, nullptr);
}

// Both operands of a pipelined GEMM in one launch (one launch fewer, and the small
// operand's conversion runs beside the large one's instead of after it). Operand X (A or
// B) takes CTAs [first_x, first_x + n_x) of grid x: plain when trans_x == 0 (n_x =
// ceil(rp_x·cp/8 / 256)), else the transposing form (n_x = gx_x · ceil(cp/64), CTA i at
// (i % gx_x, i / gx_x)). Grid (n_a + n_b, 1, batch), block 256. sums_a != 0 (a
// transposed A, batch 1): A's rows also summed over their K into sums_a, in
// ceil(K/64) partials of rows_a (see gemm_to_bf16_t_body).
ERASE_KERNEL void __launch_bounds__(256)
    gemm_to_bf16_pair(const float* __restrict__ src_a, __nv_bfloat16* __restrict__ dst_a, int rows_a, int cols_a,
                      long long ld_a, long long batch_a, int rp_a, int trans_a, int gx_a, int n_a,
                      const float* __restrict__ src_b, __nv_bfloat16* __restrict__ dst_b, int rows_b, int cols_b,
                      long long ld_b, long long batch_b, int rp_b, int trans_b, int gx_b, int cp,
                      float* __restrict__ sums_a, int sum_a) { ERASE_PDL_ENTER();
    int blk = blockIdx.x;
    const bool a = blk < n_a;
    if (!a) blk -= n_a;
    const float* src = a ? src_a : src_b;
    __nv_bfloat16* dst = a ? dst_a : dst_b;
    const int rows = a ? rows_a : rows_b, cols = a ? cols_a : cols_b, rp = a ? rp_a : rp_b;
    const long long ld = a ? ld_a : ld_b, bs = a ? batch_a : batch_b;
    const int gx = a ? gx_a : gx_b;
    float* sums = a && sum_a ? sums_a : nullptr;
    if (a ? trans_a : trans_b) gemm_to_bf16_t_body(src, dst, rows, cols, ld, bs, rp, cp, blk % gx, blk / gx, sums);
    else gemm_to_bf16_body(src, dst, rows, cols, ld, bs, rp, cp, blk);
}

// RoundBf16 with column sums (a layer's dy, rounded once for its data and weight
// gradients, and its bias gradient from the same pass): dst[r][c] = bf16(src[r][c]) for
// an f32 [rows][cols] matrix (cols a multiple of 8, src and dst 16-byte aligned), and
// part[by][c] = the f32 sum of src[r][c] over the CTA's 32·iters rows (iters ≤ 8), in a
// fixed order (each of 32 row lanes over its rows in order, then the 32 lane sums in
// lane order); colsum_final adds the ceil(rows/(32·iters)) partials. Grid (ceil(cols/64),
// ceil(rows/(32·iters))), block 256: thread t takes the 8 columns 64·bx + 8·(t % 8) of
// rows 32·iters·by + t/8 + 32·i, i < iters, so a warp reads four whole 256-byte row
// segments at a time; all of a thread's loads are issued before the first is used.
ERASE_KERNEL void __launch_bounds__(256)
    gemm_round_colsum(const float* __restrict__ src, __nv_bfloat16* __restrict__ dst, float* __restrict__ part,
                      int rows, int cols, int iters) { ERASE_PDL_ENTER();
    __shared__ float lanes[32][65];
    const int tid = threadIdx.x, ch = tid & 7, y = tid >> 3;
    const int c = blockIdx.x * 64 + ch * 8, r0 = blockIdx.y * 32 * iters;
    float acc[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = 0.f;
    if (c < cols) {
        float4 v[8][2];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int r = r0 + y + 32 * i;
            if (i < iters && r < rows) {
                const float* p = src + static_cast<long long>(r) * cols + c;
                v[i][0] = __ldg(reinterpret_cast<const float4*>(p));
                v[i][1] = __ldg(reinterpret_cast<const float4*>(p + 4));
            }
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int r = r0 + y + 32 * i;
            if (i < iters && r < rows) {
                const float4 x = v[i][0], z = v[i][1];
                acc[0] += x.x, acc[1] += x.y, acc[2] += x.z, acc[3] += x.w;
                acc[4] += z.x, acc[5] += z.y, acc[6] += z.z, acc[7] += z.w;
                uint4 o;
                o.x = gemm_pack_bf16(x.x, x.y);
                o.y = gemm_pack_bf16(x.z, x.w);
                o.z = gemm_pack_bf16(z.x, z.y);
                o.w = gemm_pack_bf16(z.z, z.w);
                *reinterpret_cast<uint4*>(dst + static_cast<long long>(r) * cols + c) = o;
            }
        }
    }
    erase_colsum_partials(lanes, acc, part, cols);
}

// C[i] = Σ_s part[s·split_stride + i] (+ bias[i % N]) (ReLU) (zero where flags & 8 and
// bias[i], then the ReLU's output, is not > 0), for i < count; C is
// contiguous. Block (X, Y), Y = 1, 2, 4, .. 32 (at most the split count) lanes of splits
// and X = max(32, 256 / Y) threads of element groups: thread (x, y) owns 4 consecutive
// elements (float4 loads when count and split_stride are multiples of 4, as the plan
// arranges, else 4 scalar loads) and sums splits y, y+Y, y+2Y, .. of them in that order;
// then thread (x, 0) adds the Y lane sums in lane order: a fixed order for a given split
// count and Y (deterministic), Y float4 loads in flight per element group. Dynamic
// shared memory: X·Y float4. Grid ceil(count / 4X) + ceil(rs_n / X).
//
// The CTAs past ceil(count / 4X) add a weight gradient's bias-gradient partials in the
// same launch (rs_slices > 0; one launch fewer than colsum_final after the reduction):
// rs_out[j] = Σ_{s < rs_slices} rs_part[s·rs_n + j], thread (x, y) of CTA b taking column
// j = X·b + x and slices y, y+Y, .. in order, then thread (x, 0) adding the Y sums in
// lane order.
ERASE_KERNEL void __launch_bounds__(1024)
    gemm_splitk_reduce(const float* __restrict__ part, const float* __restrict__ bias, float* __restrict__ C,
                       long long count, int N, int splits, long long split_stride, int flags,
                       const float* __restrict__ rs_part, float* __restrict__ rs_out, int rs_slices,
                       long long rs_n) { ERASE_PDL_ENTER();
    extern __shared__ float4 lanes[];
    const int nx = blockDim.x, ny = blockDim.y, tx = threadIdx.x, ty = threadIdx.y;
    const long long c_blocks = (count + 4 * nx - 1) / (4 * nx);
    if (blockIdx.x >= c_blocks) {
        const long long j = (blockIdx.x - c_blocks) * nx + tx;
        float t = 0.f;
        if (j < rs_n)
            for (int sl = ty; sl < rs_slices; sl += ny) t += __ldg(rs_part + sl * rs_n + j);
        lanes[ty * nx + tx].x = t;
        __syncthreads();
        if (ty == 0 && j < rs_n) {
            float r = lanes[tx].x;
            for (int y = 1; y < ny; ++y) r += lanes[y * nx + tx].x;
            rs_out[j] = r;
        }
        return;
    }
    const long long i0 = (static_cast<long long>(blockIdx.x) * nx + tx) * 4;
    const bool vec = (count & 3) == 0 && (split_stride & 3) == 0;
    float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
    // the ReLU gradient's mask, loaded before the partials (its latency hidden by theirs)
    float keep[4] = {1.f, 1.f, 1.f, 1.f};
    if ((flags & 8) && ty == 0) {
#pragma unroll
        for (int e = 0; e < 4; ++e)
            if (i0 + e < count) keep[e] = __ldg(bias + i0 + e);
    }
    if (i0 < count) {
        if (vec) {
#pragma unroll 4
            for (int sp = ty; sp < splits; sp += ny) {
                const float4 v = __ldg(reinterpret_cast<const float4*>(part + sp * split_stride + i0));
                s.x += v.x;
                s.y += v.y;
                s.z += v.z;
                s.w += v.w;
            }
        } else {
            for (int sp = ty; sp < splits; sp += ny) {
                const float* p = part + sp * split_stride + i0;
                s.x += __ldg(p);
                if (i0 + 1 < count) s.y += __ldg(p + 1);
                if (i0 + 2 < count) s.z += __ldg(p + 2);
                if (i0 + 3 < count) s.w += __ldg(p + 3);
            }
        }
    }
    if (ny > 1) {
        lanes[ty * nx + tx] = s;
        __syncthreads();
        if (ty == 0) {
            s = lanes[tx];
            for (int y = 1; y < ny; ++y) {
                const float4 v = lanes[y * nx + tx];
                s.x += v.x;
                s.y += v.y;
                s.z += v.z;
                s.w += v.w;
            }
        }
    }
    if (ty == 0) {
        const float v[4] = {s.x, s.y, s.z, s.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const long long i = i0 + e;
            if (i >= count) break;
            float r = v[e];
            if (flags & 1) r += __ldg(bias + i % N);
            if (flags & 2) r = fmaxf(r, 0.f);
            if (!(keep[e] > 0.f)) r = 0.f;
            C[i] = r;
        }
    }
}

// ---- thin GEMMs: a loss head's linear layer (one output) and its gradients -------------
// A linear layer of one output (the loss head of a detached block, d -> 1) is three thin
// GEMMs: y = x·wᵀ has N = 1, dx = dy·w has K = 1 and dw = dyᵀ·x has M = 1. On the tiled
// kernels a 64x64 tile computes one useful row or column of 64 and a weight gradient
// splits the rows into partials; these kernels run them at the memory's rate with the
// same products: operands rounded to bf16 (round to nearest even) as they are loaded,
// f32 sums in a fixed order (deterministic). f32 operands, batch 1.
//
// Epilogue flags (as the tiled kernels'): bit 0 adds bias[n], bit 1 applies ReLU, bit 3
// zeroes an element whose mask (the ReLU's output, of C's layout) is not > 0, bit 4 adds
// R (of C's layout) after them, bit 5 also writes the result's bf16 copy to cp.
__device__ __forceinline__ void gemm_thin_store(float v, long long i, int n, const float* __restrict__ bias,
                                                const float* __restrict__ mask, const float* __restrict__ R,
                                                float* __restrict__ C, __nv_bfloat16* __restrict__ cp,
                                                int flags) {
    if (flags & 1) v += __ldg(bias + n);
    if (flags & 2) v = fmaxf(v, 0.f);
    if ((flags & 8) && !(__ldg(mask + i) > 0.f)) v = 0.f;
    if (flags & 16) v += __ldg(R + i);
    C[i] = v;
    if (flags & 32) cp[i] = __float2bfloat16_rn(v);
}

__device__ __forceinline__ bool gemm_thin_aligned(const void* p, int bytes) {
    return (reinterpret_cast<uintptr_t>(p) & (bytes - 1)) == 0;
}

// N = 1: C[m] = Σ_k bf16(A[m·lda + k])·bf16(B[k·sbk]). One warp a row, 8 rows a CTA
// (grid ceil(M/8), block 256); lane l sums k = 4l + 128j (float4 loads where `vec`: lda
// and K multiples of 4, A and B 16-byte aligned, sbk = 1), else k = l + 32j, in j order,
// then the warp's fixed tree (erase_warp_sum).
ERASE_KERNEL void __launch_bounds__(256)
    gemm_thin_n1(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C,
                 const float* __restrict__ bias, const float* __restrict__ mask, const float* __restrict__ R,
                 __nv_bfloat16* __restrict__ cp, int M, int K, long long lda, long long sbk, int flags,
                 int vec) { ERASE_PDL_ENTER();
    const int lane = threadIdx.x & 31;
    const long long m = static_cast<long long>(blockIdx.x) * 8 + (threadIdx.x >> 5);
    if (m >= M) return;
    const float* a = A + m * lda;
    float s = 0.f;
    if (vec && gemm_thin_aligned(a, 16) && gemm_thin_aligned(B, 16)) {
        const int k4 = K >> 2;
#pragma unroll 4
        for (int j = lane; j < k4; j += 32) {
            const float4 x = __ldg(reinterpret_cast<const float4*>(a) + j);
            const float4 w = __ldg(reinterpret_cast<const float4*>(B) + j);
            s = fmaf(erase_round_bf16(x.x), erase_round_bf16(w.x), s);
            s = fmaf(erase_round_bf16(x.y), erase_round_bf16(w.y), s);
            s = fmaf(erase_round_bf16(x.z), erase_round_bf16(w.z), s);
            s = fmaf(erase_round_bf16(x.w), erase_round_bf16(w.w), s);
        }
    } else {
#pragma unroll 4
        for (int k = lane; k < K; k += 32)
            s = fmaf(erase_round_bf16(__ldg(a + k)), erase_round_bf16(__ldg(B + k * sbk)), s);
    }
    s = erase_warp_sum(s);
    if (lane == 0) gemm_thin_store(s, m, 0, bias, mask, R, C, cp, flags);
}

// K = 1: C[m·N + n] = bf16(A[m·sa])·bf16(B[n·sb]) (exact in f32), an outer product. Thread
// t of CTA b takes elements 4(256b + t) .. +3 (one row's four columns, float4 stores of C
// and R and the mask's loads where `vec`: N a multiple of 4, sb = 1, the pointers
// 16-byte aligned). Grid ceil(M·N / 1024), block 256.
ERASE_KERNEL void __launch_bounds__(256)
    gemm_thin_k1(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C,
                 const float* __restrict__ bias, const float* __restrict__ mask, const float* __restrict__ R,
                 __nv_bfloat16* __restrict__ cp, int M, int N, long long sa, long long sb, int flags,
                 int vec) { ERASE_PDL_ENTER();
    const long long count = static_cast<long long>(M) * N;
    const long long i0 = (static_cast<long long>(blockIdx.x) * 256 + threadIdx.x) * 4;
    if (i0 >= count) return;
    if (vec && gemm_thin_aligned(C + i0, 16) && (!(flags & 1) || gemm_thin_aligned(bias, 16)) &&
        (!(flags & 8) || gemm_thin_aligned(mask + i0, 16)) && (!(flags & 16) || gemm_thin_aligned(R + i0, 16)) &&
        (!(flags & 32) || gemm_thin_aligned(cp + i0, 8)) && gemm_thin_aligned(B, 16)) {
        const long long m = i0 / N;
        const int n = static_cast<int>(i0 - m * N);
        const float a = erase_round_bf16(__ldg(A + m * sa));
        const float4 b = __ldg(reinterpret_cast<const float4*>(B + n));
        float v[4] = {a * erase_round_bf16(b.x), a * erase_round_bf16(b.y), a * erase_round_bf16(b.z),
                      a * erase_round_bf16(b.w)};
        if (flags & 1) {
            const float4 c = __ldg(reinterpret_cast<const float4*>(bias + n));
            v[0] += c.x, v[1] += c.y, v[2] += c.z, v[3] += c.w;
        }
        if (flags & 2)
#pragma unroll
            for (int e = 0; e < 4; ++e) v[e] = fmaxf(v[e], 0.f);
        if (flags & 8) {
            const float4 y = __ldg(reinterpret_cast<const float4*>(mask + i0));
            if (!(y.x > 0.f)) v[0] = 0.f;
            if (!(y.y > 0.f)) v[1] = 0.f;
            if (!(y.z > 0.f)) v[2] = 0.f;
            if (!(y.w > 0.f)) v[3] = 0.f;
        }
        if (flags & 16) {
            const float4 r = __ldg(reinterpret_cast<const float4*>(R + i0));
            v[0] += r.x, v[1] += r.y, v[2] += r.z, v[3] += r.w;
        }
        *reinterpret_cast<float4*>(C + i0) = make_float4(v[0], v[1], v[2], v[3]);
        if (flags & 32) {
            uint2 o;
            o.x = gemm_pack_bf16(v[0], v[1]);
            o.y = gemm_pack_bf16(v[2], v[3]);
            *reinterpret_cast<uint2*>(cp + i0) = o;
        }
        return;
    }
    for (long long i = i0; i < i0 + 4 && i < count; ++i) {
        const long long m = i / N;
        const int n = static_cast<int>(i - m * N);
        const float v = erase_round_bf16(__ldg(A + m * sa)) * erase_round_bf16(__ldg(B + n * sb));
        gemm_thin_store(v, i, n, bias, mask, R, C, cp, flags);
    }
}

// M = 1: part[s·N + n] = Σ_{r in split s} bf16(A[r·sa])·bf16(B[r·ldb + n]) over the split's
// `rows_per` rows (a multiple of 8) of K. Block (32, 8): thread (x, y) of CTA (b, s) takes
// column n = 32b + x and rows r0 + y + 8j in j order (a warp reads a row's 32 columns
// together), then thread (x, 0) adds the 8 row lanes in order. Grid (ceil(N/32), splits).
// With `rs` (sa's A transposed: a weight gradient's dy), the CTAs of b = 0 also write the
// f32 sum of A over the split's rows, unrounded (the bias gradient's partial), to rs[s]:
// thread t over rows r0 + t + 256j in order, the warps' trees, then the 8 warp sums in
// order. gemm_splitk_reduce sums both in split order (or, with one split, part is C and
// rs the bias gradient itself).
ERASE_KERNEL void __launch_bounds__(256)
    gemm_thin_m1(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ part,
                 float* __restrict__ rs, int K, int N, long long sa, long long ldb, int rows_per) {
    ERASE_PDL_ENTER();
    __shared__ float lanes[8][33];
    __shared__ float warps[8];
    const int tx = threadIdx.x, ty = threadIdx.y, s = blockIdx.y;
    const int n = blockIdx.x * 32 + tx;
    const long long r0 = static_cast<long long>(s) * rows_per;
    const long long r1 = r0 + rows_per < K ? r0 + rows_per : K;
    float acc = 0.f;
    if (n < N) {
        const float* b = B + n;
#pragma unroll 4
        for (long long r = r0 + ty; r < r1; r += 8)
            acc = fmaf(erase_round_bf16(__ldg(A + r * sa)), erase_round_bf16(__ldg(b + r * ldb)), acc);
    }
    lanes[ty][tx] = acc;
    if (rs != nullptr && blockIdx.x == 0) {
        const int t = ty * 32 + tx;
        float a = 0.f;
        for (long long r = r0 + t; r < r1; r += 256) a += __ldg(A + r * sa);
        a = erase_warp_sum(a);
        if (tx == 0) warps[ty] = a;
    }
    __syncthreads();
    if (ty == 0 && n < N) {
        float v = lanes[0][tx];
#pragma unroll
        for (int y = 1; y < 8; ++y) v += lanes[y][tx];
        part[static_cast<long long>(s) * N + n] = v;
    }
    if (rs != nullptr && blockIdx.x == 0 && ty == 0 && tx == 0) {
        float a = warps[0];
#pragma unroll
        for (int y = 1; y < 8; ++y) a += warps[y];
        rs[s] = a;
    }
}
