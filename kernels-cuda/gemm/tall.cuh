// Part of gemm.cu, the GEMM family's one translation unit: gemm.cu includes it after the parts it
// uses; it is not compiled alone. The tall GEMMs (`gemm_tall_n*`): many rows, the whole of N and K
// in one CTA.

namespace {

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
    if (COPY && (flags & 64)) {
        // C stored in bf16 alone: the copy below is the output
    } else if (vec && n + 3 < N) {
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

}  // namespace

// The tall kernels (see gemm_tall_body), one a bound on N; PER_SM CTAs an SM by registers
// (ops/src/family/gemm.rs, TALL_KERNELS, plans with the same count).
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
