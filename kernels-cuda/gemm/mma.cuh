// Part of gemm.cu, the GEMM family's one translation unit: gemm.cu includes it after the parts it
// uses; it is not compiled alone. The register-staged tiles (`gemm_bf16_<layout>_<tile>`, `_a16`):
// the mma.sync helpers, the direct epilogue and gemm_bf16_body.

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
        if (!(COPY && (flags & 64))) {
            if (vec_c && n + 1 < N) {
                *reinterpret_cast<float2*>(crow + n) = make_float2(v[0], v[1]);
            } else {
                if (n < N) crow[n] = v[0];
                if (n + 1 < N) crow[n + 1] = v[1];
            }
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
