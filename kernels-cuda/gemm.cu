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
// the bias and ReLU. Epilogue flags: bit 0 adds bias[n], bit 1 applies ReLU. The epilogue
// writes each thread's two adjacent columns as one float2 where C's alignment allows.
//
// Bound: 2·M·N·K FLOPs on tensor cores against 4·(M·K·ceil(N/BN) + N·K·ceil(M/BM) + M·N)
// bytes; the model's shapes (K = 13..351, N small) are memory-bound, the 128x128 tile
// (arithmetic intensity 32 FLOP/byte of f32 operand) serves the large square ones.
#include "common.cuh"

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
};

__device__ __forceinline__ bool gemm_vec_ok(const float* p, long long ld) {
    return (ld & 3) == 0 && (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

template <int BM, int BN, int WARPS_M, int WARPS_N, int AHEAD, bool TA, bool TB>
__device__ __forceinline__ void gemm_bf16_body(const float* __restrict__ A, const float* __restrict__ B,
                                               float* __restrict__ C, const float* __restrict__ bias, int M,
                                               int N, int K, long long lda, long long ldb, long long ldc,
                                               long long batch_a, long long batch_b, long long batch_c,
                                               int batch, int k_split, long long split_c, int flags) {
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
        GemmTileLoader<A_ROWS, A_COLS, THREADS> a;
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
    auto store = [&](const Staged& s, int buf) {
        s.a.store(sA[buf], tid);
        s.b.store(sB[buf], tid);
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

    // epilogue: thread holds rows g, g+8 and columns 2t, 2t+1 of every mma tile
    const int g = lane >> 2, t = lane & 3;
    const bool vec_c = (ldc & 1) == 0 && (reinterpret_cast<uintptr_t>(C) & 7) == 0;
#pragma unroll
    for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int m = m0 + wm0 + mi * 16 + g + half * 8;
            if (m >= M) continue;
            float* crow = C + static_cast<long long>(m) * ldc;
#pragma unroll
            for (int ni = 0; ni < NI; ++ni) {
                const int n = n0 + wn0 + ni * 8 + 2 * t;  // even
                float v[2];
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    v[e] = acc[mi][ni][half * 2 + e];
                    if ((flags & 1) && n + e < N) v[e] += __ldg(bias + n + e);
                    if (flags & 2) v[e] = fmaxf(v[e], 0.f);
                }
                if (vec_c && n + 1 < N) {
                    *reinterpret_cast<float2*>(crow + n) = make_float2(v[0], v[1]);
                } else {
                    if (n < N) crow[n] = v[0];
                    if (n + 1 < N) crow[n + 1] = v[1];
                }
            }
        }
    }
}

}  // namespace

#define ERASE_GEMM_ARGS                                                                                 \
    const float *__restrict__ A, const float *__restrict__ B, float *__restrict__ C,                   \
        const float *__restrict__ bias, int M, int N, int K, long long lda, long long ldb, long long ldc, \
        long long batch_a, long long batch_b, long long batch_c, int batch, int k_split, long long split_c, \
        int flags
#define ERASE_GEMM_PASS A, B, C, bias, M, N, K, lda, ldb, ldc, batch_a, batch_b, batch_c, batch, k_split, split_c, flags

// Arguments of every gemm_bf16_* kernel, in order:
//   A, B, C, bias (read when flags & 1; any valid pointer otherwise),
//   M, N, K (i32), lda, ldb, ldc (i64, elements),
//   batch_a, batch_b, batch_c (i64, elements between batch entries), batch (i32),
//   k_split (i32, multiple of 32: k range of one split), split_c (i64, elements between
//   the outputs of two splits), flags (i32: 1 bias, 2 relu).
// Grid: (ceil(M/BM), ceil(N/BN), splits·batch); block: 256 (128x128) or 128 (64x64).
#define ERASE_GEMM_KERNELS(LAYOUT, TA, TB)                                                    \
    ERASE_KERNEL void __launch_bounds__(256) gemm_bf16_##LAYOUT##_128x128(ERASE_GEMM_ARGS) { \
        gemm_bf16_body<128, 128, 2, 4, 2, TA, TB>(ERASE_GEMM_PASS);                             \
    }                                                                                         \
    ERASE_KERNEL void __launch_bounds__(128) gemm_bf16_##LAYOUT##_64x64(ERASE_GEMM_ARGS) {   \
        gemm_bf16_body<64, 64, 2, 2, 1, TA, TB>(ERASE_GEMM_PASS);                               \
    }

ERASE_GEMM_KERNELS(nn, false, false)
ERASE_GEMM_KERNELS(nt, false, true)
ERASE_GEMM_KERNELS(tn, true, false)
ERASE_GEMM_KERNELS(tt, true, true)

// C[i] = Σ_s part[s·split_stride + i] (+ bias[i % N]) (ReLU), for i < count; C is
// contiguous. Block (256/Y, Y), Y = 1, 2, 4 or 8 (at most the split count): thread (x, y)
// sums splits y, y+Y, y+2Y, .. of element blockDim.x·blockIdx.x + x in that order, then
// thread (x, 0) adds the Y lane sums in lane order: a fixed order for a given split count
// and Y (deterministic), Y loads in flight per element. Grid ceil(count / (256/Y)).
ERASE_KERNEL void __launch_bounds__(256)
    gemm_splitk_reduce(const float* __restrict__ part, const float* __restrict__ bias, float* __restrict__ C,
                       long long count, int N, int splits, long long split_stride, int flags) {
    __shared__ float lanes[256];
    const int nx = blockDim.x, ny = blockDim.y, tx = threadIdx.x, ty = threadIdx.y;
    const long long i = static_cast<long long>(blockIdx.x) * nx + tx;
    float s = 0.f;
    if (i < count) {
#pragma unroll 4
        for (int sp = ty; sp < splits; sp += ny) s += __ldg(part + sp * split_stride + i);
    }
    if (ny > 1) {
        lanes[ty * nx + tx] = s;
        __syncthreads();
        if (ty == 0) {
            s = lanes[tx];
            for (int y = 1; y < ny; ++y) s += lanes[y * nx + tx];
        }
    }
    if (ty == 0 && i < count) {
        if (flags & 1) s += __ldg(bias + i % N);
        if (flags & 2) s = fmaxf(s, 0.f);
        C[i] = s;
    }
}
