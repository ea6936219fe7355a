// Fused multi-head attention, forward and backward, in the FlashAttention-2 manner, on
// bf16 tensor cores (mma.sync.m16n8k16.row.col.f32.bf16.bf16.f32, sm_80+).
//
// Tensors are f32 [B, S, H·Dh] (head h = columns h·Dh .. (h+1)·Dh), lse and D are f32
// [B, H, S]; q, k, v, do, o, dq, dk, dv must start 16-byte aligned (float4 loads, float2
// stores; the runtime's arena aligns every tensor to 256 bytes); scale = 1/sqrt(Dh)
// comes from the plan. The matmul operands (q, k, v, do, and the probabilities P and
// dS = P∘(dP − D)) are rounded to bf16 (nearest even);
// scores, the softmax statistics and every accumulator stay f32. Dh is a template
// parameter (32, 64: kernels attn_*_d32, attn_*_d64); S is any length (tiles are guarded
// and zero-filled; keys past S and, when causal, keys after the query are masked).
//
// Tiling: a CTA is 4 warps (128 threads; 8 warps for S > 64) and owns 64 rows (128)
// of queries, or keys for dk/dv; each warp owns 16 of them and keeps its operand fragments and accumulators in
// registers; the other side streams through shared memory in tiles of 64 rows, stored
// as bf16 [64][Dh + 8] (padding makes ldmatrix conflict-free). The score tile of a warp
// (16 x 64, f32 accumulators) is turned into the A fragments of the next mma in registers.
//
//   attn_fwd_d{32,64}      S ≤ 64, grid (ceil(S/64), H, B): per key tile: S = Q·Kᵀ,
//                          online softmax (running max m and sum l per row, f32, exp2
//                          domain), O = O·α + P·V; at the end o = O / l,
//                          lse = m·ln2 + ln l. Never materialises [S, S]. Causal CTAs stop
//                          at the diagonal.
//   S > 64 (the staged kernels, 8 warps and 128 rows a CTA, see "S > 64" below):
//   attn_stage_bf16        q, k, v (and do, with D_i = Σ_c bf16(do_ic)·o_ic and lse·log2 e
//                          for the backward) to bf16 head-major scratch, once.
//   attn_fwd_st_d{32,64}   the forward above, K and V tiles streamed by cp.async.
//   attn_bwd_dkdv_st_d{32,64} grid (ceil(S/128), H, B): one CTA per 128 keys loops over all
//                          query tiles (causal: from the diagonal): Pᵀ = exp(K·Qᵀ·scale −
//                          lse), dV += Pᵀ·dO, dPᵀ = V·dOᵀ, dSᵀ = Pᵀ∘(dPᵀ − D),
//                          dK += dSᵀ·Q; dk = scale·dK.
//   attn_bwd_dq_st_d{32,64} grid (ceil(S/128), H, B): one CTA per 128 queries loops over
//                          the key tiles, recomputing P and dP: dQ += dS·K; dq = scale·dQ.
//   attn_bwd_small_d{32,64} S ≤ 64 (the CTR model's 27 fields): grid (1, H, B), one CTA
//                          does all three: D, then dK, dV as above, dSᵀ to shared memory
//                          (bf16), then dQ = dS·K by query rows; no scratch, one launch.
// A warp's tile whose keys are all < S and, when causal, all at or before its first row
// (and for dk, dv: whose queries are all < S) takes an unmasked copy of the loop body: no
// index arithmetic, compares or selects per score, so no spills in the staged backward.
// Every output element is written by exactly one thread after a fixed-order reduction:
// no atomics, bit-identical results run to run.
//
// Bound: forward 4·B·H·S²·Dh FLOPs (halved when causal) on tensor cores; backward 10·B·H·S²·Dh
// useful (5 products), 14 executed (the dq pass recomputes S and dP), against
// 4·B·S·H·Dh·(4 fwd | 8 bwd) bytes plus one K/V (or Q/dO) re-read (bf16) per 128 rows. For
// S ≥ 128 the tensor-core work dominates; for short sequences (S = 27: B·H CTAs of one
// tile) the kernels are memory-bound.
#include "common.cuh"

namespace {

constexpr int ATTN_ROWS = 64;  // rows of a CTA, and of a streamed tile
constexpr int ATTN_THREADS = 128;
constexpr float ATTN_LOG2E = 1.4426950408889634f;
constexpr float ATTN_LN2 = 0.6931471805599453f;

__device__ __forceinline__ uint32_t attn_pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
}

__device__ __forceinline__ void attn_ldsm_x4(uint32_t (&r)[4], const __nv_bfloat16* p) {
    const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

__device__ __forceinline__ void attn_ldsm_x4_trans(uint32_t (&r)[4], const __nv_bfloat16* p) {
    const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

__device__ __forceinline__ void attn_mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Rows r0 .. r0+R-1 of one head (`src` points at the head's column 0 of row 0; rows are
// `ld` floats apart) to bf16 shared memory, zero past row S; T threads (tid < T) share it.
template <int D, int R = ATTN_ROWS, int T = ATTN_THREADS>
__device__ __forceinline__ void attn_load_tile(__nv_bfloat16 (*dst)[D + 8], const float* __restrict__ src,
                                               long long ld, int r0, int S, int tid) {
    constexpr int CPR = D / 4;
    constexpr int PER = R * CPR / T;
    // rows are H·Dh floats apart (a multiple of 4) and tensors start 16-byte aligned (the
    // runtime's arena aligns to 256): float4 loads
    float4 v[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const int id = tid + i * T;
        const int r = r0 + id / CPR, c = (id % CPR) * 4;
        v[i] = r < S ? __ldg(reinterpret_cast<const float4*>(src + static_cast<long long>(r) * ld + c))
                     : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const int id = tid + i * T;
        uint2 p;
        p.x = attn_pack_bf16(v[i].x, v[i].y);
        p.y = attn_pack_bf16(v[i].z, v[i].w);
        *reinterpret_cast<uint2*>(&dst[id / CPR][(id % CPR) * 4]) = p;
    }
}

// The same tile from a bf16 source (a packed q, k, v its projection stored in bf16, see
// Graph::linear_for_attention): the values attn_load_tile would round to, copied as they
// are, 8 a chunk (rows are 3·H·Dh elements apart and heads Dh, a multiple of 32: 16-byte
// loads).
template <int D, int R = ATTN_ROWS, int T = ATTN_THREADS>
__device__ __forceinline__ void attn_load_tile(__nv_bfloat16 (*dst)[D + 8], const __nv_bfloat16* __restrict__ src,
                                               long long ld, int r0, int S, int tid) {
    constexpr int CPR = D / 8;
    constexpr int PER = R * CPR / T;
    static_assert(R * CPR % T == 0, "a tile's chunks split evenly over the threads");
    // every chunk's load in flight before the first store (one at a time, the tile's
    // loads wait in turn: the forward ran 23 % slower than from f32)
    uint4 v[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const int id = tid + i * T;
        const int r = r0 + id / CPR, c = (id % CPR) * 8;
        // (32-bit offsets: r·ld + c < 3·S·H·Dh, which the plans keep within i32)
        v[i] = r < S ? __ldg(reinterpret_cast<const uint4*>(src + (r * static_cast<int>(ld) + c)))
                     : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const int id = tid + i * T;
        *reinterpret_cast<uint4*>(&dst[id / CPR][(id % CPR) * 8]) = v[i];
    }
}

// A fragments (16 rows from `row0`, k = Dh) of a row-major [rows][Dh] shared tile.
template <int D>
__device__ __forceinline__ void attn_load_a(uint32_t (&f)[D / 16][4], __nv_bfloat16 (*s)[D + 8], int row0,
                                            int lane) {
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc)
        attn_ldsm_x4(f[kc], &s[row0 + (lane & 7) + ((lane >> 3) & 1) * 8][kc * 16 + (lane >> 4) * 8]);
}

// acc[16 x R] += A[16 x Dh] · Tᵀ, T an [R][Dh] shared tile (B operand k = Dh, n = T's rows).
template <int D, int R = ATTN_ROWS>
__device__ __forceinline__ void attn_mma_abt(float (&acc)[R / 8][4], const uint32_t (&a)[D / 16][4],
                                             __nv_bfloat16 (*s)[D + 8], int lane) {
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) {
#pragma unroll
        for (int np = 0; np < R / 16; ++np) {
            uint32_t r[4];
            attn_ldsm_x4(r, &s[np * 16 + (lane & 7) + (lane >> 4) * 8][kc * 16 + ((lane >> 3) & 1) * 8]);
            attn_mma(acc[2 * np], a[kc], r[0], r[1]);
            attn_mma(acc[2 * np + 1], a[kc], r[2], r[3]);
        }
    }
}

// acc[16 x Dh] += P[16 x R] · T, P in accumulator layout (rounded to bf16 here), T an
// [R][Dh] shared tile (B operand k = T's rows, n = Dh).
template <int D, int R = ATTN_ROWS>
__device__ __forceinline__ void attn_mma_pt(float (&acc)[D / 8][4], const float (&p)[R / 8][4],
                                            __nv_bfloat16 (*s)[D + 8], int lane) {
#pragma unroll
    for (int kc = 0; kc < R / 16; ++kc) {
        uint32_t a[4];
        a[0] = attn_pack_bf16(p[2 * kc][0], p[2 * kc][1]);
        a[1] = attn_pack_bf16(p[2 * kc][2], p[2 * kc][3]);
        a[2] = attn_pack_bf16(p[2 * kc + 1][0], p[2 * kc + 1][1]);
        a[3] = attn_pack_bf16(p[2 * kc + 1][2], p[2 * kc + 1][3]);
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
            uint32_t r[4];
            attn_ldsm_x4_trans(r, &s[kc * 16 + (lane & 7) + ((lane >> 3) & 1) * 8][dp * 16 + (lane >> 4) * 8]);
            attn_mma(acc[2 * dp], a, r[0], r[1]);
            attn_mma(acc[2 * dp + 1], a, r[2], r[3]);
        }
    }
}

// Two adjacent output elements: f32, or bf16 where the gradient's reader rounds it anyway.
__device__ __forceinline__ void attn_store2(float* p, float a, float b) {
    *reinterpret_cast<float2*>(p) = make_float2(a, b);
}
__device__ __forceinline__ void attn_store2(__nv_bfloat16* p, float a, float b) {
    *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(a, b);
}

template <int N, int M>
__device__ __forceinline__ void attn_zero(float (&a)[N][M]) {
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
        for (int j = 0; j < M; ++j) a[i][j] = 0.f;
}

// Rows (i_r = row0 + g + 8r) of a [16 x Dh] accumulator, times `mul`, to dst rows < S.
template <int D, typename OT>
__device__ __forceinline__ void attn_store_rows(OT* __restrict__ dst, long long ld, const float (&acc)[D / 8][4],
                                                int row0, int S, float mul0, float mul1, int lane) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int i = row0 + g + 8 * r;
        if (i >= S) continue;
        const float mul = r ? mul1 : mul0;
        OT* row = dst + static_cast<long long>(i) * ld;
#pragma unroll
        for (int dn = 0; dn < D / 8; ++dn)
            attn_store2(row + dn * 8 + 2 * t, acc[dn][2 * r] * mul, acc[dn][2 * r + 1] * mul);
    }
}

// One key tile's step of the online softmax for a warp's two rows per thread (row[r]):
// raw scores s (with M, keys past S and, when causal, after the row masked; without M the
// caller knows every key of the tile is seen by every row) become probabilities
// exp2(s·sl2 − m_new), one fused multiply-add each, against the running max m (kept in the
// exp2 domain: the raw max times sl2 > 0 is the max of the scaled scores); l and the
// output accumulator are rescaled by exp2(m_old − m_new) first.
template <int D, int R, bool M = true>
__device__ __forceinline__ void attn_softmax_step(float (&s)[R / 8][4], float (&m)[2], float (&l)[2],
                                                  float (&oacc)[D / 8][4], int k0, const int (&row)[2], int S,
                                                  int causal, float sl2, int t) {
    float mt[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int ni = 0; ni < R / 8; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int r = e >> 1;
            if (M) {
                const int j = k0 + ni * 8 + 2 * t + (e & 1);
                const bool ok = j < S && (!causal || j <= row[r]);
                s[ni][e] = ok ? s[ni][e] : -INFINITY;
            }
            mt[r] = fmaxf(mt[r], s[ni][e]);
        }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        mt[r] = fmaxf(mt[r], __shfl_xor_sync(0xffffffffu, mt[r], 1));
        mt[r] = fmaxf(mt[r], __shfl_xor_sync(0xffffffffu, mt[r], 2));
        const float mn = fmaxf(m[r], mt[r] * sl2);
        const float mu = mn == -INFINITY ? 0.f : mn;
        const float alpha = exp2f(m[r] - mu);
        m[r] = mn;
        l[r] *= alpha;
#pragma unroll
        for (int dn = 0; dn < D / 8; ++dn) {
            oacc[dn][2 * r] *= alpha;
            oacc[dn][2 * r + 1] *= alpha;
        }
#pragma unroll
        for (int ni = 0; ni < R / 8; ++ni)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const float p = exp2f(fmaf(s[ni][2 * r + e], sl2, -mu));
                s[ni][2 * r + e] = p;
                l[r] += p;
            }
    }
}

// R = 64: the CTA's 4 warps own one tile of 64 queries of one (b, h). R = 32 (S <= 32
// only): two groups of 2 warps, each a head of its own (h = blockIdx.y·2 + group), so
// the padding to the tile is half as wide and twice the heads fit an SM.
template <int R>
struct AttnGroups {
    static constexpr int WARPS = R / 16;                        // warps per (b, h)
    static constexpr int N = ATTN_THREADS / 32 / WARPS;         // (b, h) per CTA
    static constexpr int T = WARPS * 32;                        // threads per (b, h)
    // a thread's group, its warp within the group and its index within the group
    // (R = 64: one group, the whole CTA; written so that nothing is computed for it)
    static __device__ __forceinline__ int group(int tid) { return N == 1 ? 0 : (tid >> 5) / WARPS; }
    static __device__ __forceinline__ int warp(int tid) { return N == 1 ? tid >> 5 : (tid >> 5) % WARPS; }
    static __device__ __forceinline__ int index(int tid) { return N == 1 ? tid : tid % T; }
};

template <int D, bool P, int R = ATTN_ROWS, typename IT = float>
__device__ __forceinline__ void attn_fwd_body(const IT* __restrict__ q, const IT* __restrict__ k,
                                              const IT* __restrict__ v, float* __restrict__ o,
                                              float* __restrict__ lse, int S, int H, int causal, float scale) {
    constexpr int LD = D + 8;
    using G = AttnGroups<R>;
    __shared__ __align__(16) __nv_bfloat16 sQs[G::N][R][LD];
    __shared__ __align__(16) __nv_bfloat16 sKs[G::N][R][LD];
    __shared__ __align__(16) __nv_bfloat16 sVs[G::N][R][LD];
    const int tid0 = threadIdx.x, lane = tid0 & 31, g = lane >> 2, t = lane & 3;
    const int grp = G::group(tid0), warp = G::warp(tid0), tid = G::index(tid0);
    auto sQ = sQs[grp];
    auto sK = sKs[grp];
    auto sV = sVs[grp];
    const int h = blockIdx.y * G::N + grp, b = blockIdx.z, q0 = blockIdx.x * R;
    // a group past the last head loads nothing and stores nothing, but keeps the CTA's
    // barriers: its rows count as past the sequence's end
    const int Sg = G::N == 1 || h < H ? S : 0;
    const long long W = static_cast<long long>(H) * D;
    // q, k, v and their gradients: rows W floats apart, or 3·W when packed (P)
    const long long ldi = P ? 3 * W : W;
    const long long pbase = static_cast<long long>(b) * S * ldi + static_cast<long long>(h) * D;
    q += pbase;
    k += pbase;
    v += pbase;
    const float sl2 = scale * ATTN_LOG2E;

    attn_load_tile<D, R, G::T>(sQ, q, ldi, q0, Sg, tid);
    __syncthreads();
    uint32_t qf[D / 16][4];
    attn_load_a<D>(qf, sQ, warp * 16, lane);

    const int row[2] = {q0 + warp * 16 + g, q0 + warp * 16 + g + 8};
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    float oacc[D / 8][4];
    attn_zero(oacc);

    const int tiles = (S + R - 1) / R;
    const int kt_end = causal ? min(tiles, static_cast<int>(blockIdx.x) + 1) : tiles;
    for (int kt = 0; kt < kt_end; ++kt) {
        const int k0 = kt * R;
        __syncthreads();  // the previous tile's readers are done
        attn_load_tile<D, R, G::T>(sK, k, ldi, k0, Sg, tid);
        attn_load_tile<D, R, G::T>(sV, v, ldi, k0, Sg, tid);
        __syncthreads();

        float s[R / 8][4];
        attn_zero(s);
        attn_mma_abt<D, R>(s, qf, sK, lane);

        attn_softmax_step<D, R>(s, m, l, oacc, k0, row, Sg, causal, sl2, t);
        attn_mma_pt<D, R>(oacc, s, sV, lane);
    }

#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
        if (t == 0 && row[r] < Sg)
            lse[(static_cast<long long>(b) * H + h) * S + row[r]] = m[r] * ATTN_LN2 + logf(l[r]);
    }
    // o's offset recomputed here rather than kept live through the loop
    o += static_cast<long long>(b) * S * W + static_cast<long long>(h) * D;
    attn_store_rows<D>(o, W, oacc, q0 + warp * 16, Sg, 1.f / l[0], 1.f / l[1], lane);
}

// ---- S > 64: bf16 operands staged once, streamed tiles through a cp.async ring ----------
//
// attn_stage_bf16 rounds q, k, v (and do, for the backward) to bf16 once, into scratch
// laid out head-major, [B, H, S, Dh]: a 64-row tile of one head is then 64·Dh·2
// contiguous bytes that cp.async copies straight into shared memory, the next tile in
// flight while the warps multiply the current one (two stages). Against the f32 kernels
// that each CTA rounded on the way (attn_load_tile), the streamed bytes halve, no
// registers hold a tile in flight, and the rounding is done once per element instead of
// once per CTA that reads it. The products are the same (the same bf16 values in the same
// mma order); CTAs are NW = 8 warps, 128 rows of queries (forward, dq) or keys (dk, dv),
// so each streamed tile feeds twice the rows.

constexpr int ATTN_ST_WARPS = 8;
constexpr int ATTN_ST_THREADS = ATTN_ST_WARPS * 32;
constexpr int ATTN_ST_ROWS = ATTN_ST_WARPS * 16;  // a CTA's own rows

__device__ __forceinline__ void attn_cp16(void* smem, const void* gmem, int bytes) {
    const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(bytes) : "memory");
}
__device__ __forceinline__ void attn_cp4(void* smem, const void* gmem, int bytes) {
    const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(gmem), "r"(bytes) : "memory");
}
__device__ __forceinline__ void attn_cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void attn_cp_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Issues the copies of rows r0 .. r0+R-1 of one head's bf16 [S][Dh] (`src` at row 0) into
// dst[R][Dh + 8]; rows past S are zero-filled.
template <int D, int R>
__device__ __forceinline__ void attn_cp_tile(__nv_bfloat16 (*dst)[D + 8], const __nv_bfloat16* __restrict__ src,
                                             int r0, int S, int tid) {
    constexpr int CPR = D / 8;  // 16-byte chunks per row
    static_assert(R * CPR % ATTN_ST_THREADS == 0, "tile must split evenly over the threads");
#pragma unroll
    for (int i = 0; i < R * CPR / ATTN_ST_THREADS; ++i) {
        const int id = tid + i * ATTN_ST_THREADS;
        const int r = id / CPR, c = (id % CPR) * 8;
        const bool ok = r0 + r < S;
        attn_cp16(&dst[r][c], src + static_cast<long long>(ok ? r0 + r : 0) * D + c, ok ? 16 : 0);
    }
}

// Issues the copies of v[r0 .. r0+63] (zero past S) into dst[64] (threads `first` ..
// first+63 of the CTA).
__device__ __forceinline__ void attn_cp_row64(float* dst, const float* __restrict__ v, int r0, int S, int tid,
                                              int first) {
    const int i = tid - first;
    if (i >= 0 && i < ATTN_ROWS) {
        const bool ok = r0 + i < S;
        attn_cp4(dst + i, v + (ok ? r0 + i : 0), ok ? 4 : 0);
    }
}

// The shared memory of the staged kernels: two stages of two streamed [64][Dh + 8] bf16
// tiles (K and V, or Q and dO), which also hold the CTA's own 128 rows of two tensors
// before the loop; and two stages of two 64-float rows (lse and D for dk, dv).
template <int D>
struct AttnStaged {
    static constexpr int LD = D + 8;
    __nv_bfloat16 t[2][2][ATTN_ROWS][LD];
    float row[2][2][ATTN_ROWS];
    // the two tensors' own rows: [ATTN_ST_ROWS][LD] each, over stage 0 (and 1)
    __device__ __forceinline__ __nv_bfloat16 (*own(int i))[LD] {
        return reinterpret_cast<__nv_bfloat16(*)[LD]>(&t[0][0][0][0] + i * ATTN_ST_ROWS * LD);
    }
};
static_assert(2 * ATTN_ST_ROWS == 4 * ATTN_ROWS, "own rows of two tensors fill both stages");

// Forward, S > 64: grid (ceil(S/128), H, B), block 256. q, k, v: bf16 [B, H, S, Dh];
// o f32 [B, S, H·Dh]; lse [B, H, S]. Each warp does what attn_fwd_body's does for its 16
// queries, in the same order.
template <int D>
__device__ __forceinline__ void attn_fwd_st_body(const __nv_bfloat16* __restrict__ q,
                                                 const __nv_bfloat16* __restrict__ k,
                                                 const __nv_bfloat16* __restrict__ v, float* __restrict__ o,
                                                 float* __restrict__ lse, int S, int H, int causal, float scale) {
    __shared__ __align__(16) AttnStaged<D> sm;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int h = blockIdx.y, b = blockIdx.z, q0 = blockIdx.x * ATTN_ST_ROWS;
    const long long hb = (static_cast<long long>(b) * H + h) * S * D;
    q += hb;
    k += hb;
    v += hb;
    const float sl2 = scale * ATTN_LOG2E;

    const int tiles = (S + ATTN_ROWS - 1) / ATTN_ROWS;
    const int kt_end = causal ? min(tiles, (q0 + ATTN_ST_ROWS - 1) / ATTN_ROWS + 1) : tiles;
    // the CTA's queries over stage 1 (a whole stage: 128 rows), the first K, V tile in stage 0
    attn_cp_tile<D, ATTN_ST_ROWS>(sm.own(1), q, q0, S, tid);
    attn_cp_tile<D, ATTN_ROWS>(sm.t[0][0], k, 0, S, tid);
    attn_cp_tile<D, ATTN_ROWS>(sm.t[0][1], v, 0, S, tid);
    attn_cp_commit();
    attn_cp_wait<0>();
    __syncthreads();
    uint32_t qf[D / 16][4];
    attn_load_a<D>(qf, sm.own(1), warp * 16, lane);

    const int row[2] = {q0 + warp * 16 + g, q0 + warp * 16 + g + 8};
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    float oacc[D / 8][4];
    attn_zero(oacc);

    for (int kt = 0; kt < kt_end; ++kt) {
        const int k0 = kt * ATTN_ROWS, st = kt & 1;
        __syncthreads();  // stage st ^ 1 (and the queries over it) is read by no one
        if (kt + 1 < kt_end) {
            attn_cp_tile<D, ATTN_ROWS>(sm.t[st ^ 1][0], k, k0 + ATTN_ROWS, S, tid);
            attn_cp_tile<D, ATTN_ROWS>(sm.t[st ^ 1][1], v, k0 + ATTN_ROWS, S, tid);
        }
        attn_cp_commit();
        attn_cp_wait<1>();  // this tile's group is done (the next one may be in flight)
        __syncthreads();

        float s[ATTN_ROWS / 8][4];
        attn_zero(s);
        attn_mma_abt<D>(s, qf, sm.t[st][0], lane);

        // a tile every key of which every row of the warp sees needs no mask
        if (k0 + ATTN_ROWS <= S && (!causal || k0 + ATTN_ROWS - 1 <= q0 + warp * 16))
            attn_softmax_step<D, ATTN_ROWS, false>(s, m, l, oacc, k0, row, S, causal, sl2, t);
        else
            attn_softmax_step<D, ATTN_ROWS, true>(s, m, l, oacc, k0, row, S, causal, sl2, t);
        attn_mma_pt<D>(oacc, s, sm.t[st][1], lane);
    }

#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
        if (t == 0 && row[r] < S) lse[(static_cast<long long>(b) * H + h) * S + row[r]] = m[r] * ATTN_LN2 + logf(l[r]);
    }
    const long long W = static_cast<long long>(H) * D;
    o += static_cast<long long>(b) * S * W + static_cast<long long>(h) * D;
    attn_store_rows<D>(o, W, oacc, q0 + warp * 16, S, 1.f / l[0], 1.f / l[1], lane);
}

// One query tile (sQ, sdO, with lse·log2 e and D in sL, sD) of attn_bwd_dkdv_st_body's
// loop for a warp's 16 keys, in parts of C query columns (fewer registers live; each
// accumulator still adds the query k-steps in order). Without M the caller knows every
// query of the tile is < S and sees every key.
template <int D, int C, bool M>
__device__ __forceinline__ void attn_dkdv_tile(float (&dkacc)[D / 8][4], float (&dvacc)[D / 8][4],
                                               const uint32_t (&kf)[D / 16][4], const uint32_t (&vf)[D / 16][4],
                                               __nv_bfloat16 (*sQ)[D + 8], __nv_bfloat16 (*sdO)[D + 8],
                                               const float* sL, const float* sD, int i0, const int (&key)[2],
                                               int S, int causal, float sl2, int lane) {
    const int t = lane & 3;
#pragma unroll
    for (int c0 = 0; c0 < ATTN_ROWS; c0 += C) {
        // Pᵀ (16 keys x C queries) = exp(K·Qᵀ·scale − lse)
        float p[C / 8][4];
        attn_zero(p);
        attn_mma_abt<D, C>(p, kf, sQ + c0, lane);
#pragma unroll
        for (int ni = 0; ni < C / 8; ++ni)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int ci = c0 + ni * 8 + 2 * t + (e & 1);
                const float pe = exp2f(p[ni][e] * sl2 - sL[ci]);
                if (M) {
                    const int i = i0 + ci, j = key[e >> 1];
                    const bool ok = i < S && j < S && (!causal || j <= i);
                    p[ni][e] = ok ? pe : 0.f;
                } else {
                    p[ni][e] = pe;
                }
            }
        // dV += Pᵀ·dO
        attn_mma_pt<D, C>(dvacc, p, sdO + c0, lane);
        // dPᵀ = V·dOᵀ, dSᵀ = Pᵀ∘(dPᵀ − D)
        float dp[C / 8][4];
        attn_zero(dp);
        attn_mma_abt<D, C>(dp, vf, sdO + c0, lane);
#pragma unroll
        for (int ni = 0; ni < C / 8; ++ni)
#pragma unroll
            for (int e = 0; e < 4; ++e) p[ni][e] *= dp[ni][e] - sD[c0 + ni * 8 + 2 * t + (e & 1)];
        // dK += dSᵀ·Q
        attn_mma_pt<D, C>(dkacc, p, sQ + c0, lane);
    }
}

// One key tile (sK, sV) of attn_bwd_dq_st_body's loop for a warp's 16 queries (row[r],
// with L = lse·log2 e and D), in parts of C key columns, recomputing P and dP: dQ += dS·K.
// Without M the caller knows every key of the tile is < S and seen by every row.
template <int D, int C, bool M>
__device__ __forceinline__ void attn_dq_tile(float (&dqacc)[D / 8][4], const uint32_t (&qf)[D / 16][4],
                                             const uint32_t (&dof)[D / 16][4], __nv_bfloat16 (*sK)[D + 8],
                                             __nv_bfloat16 (*sV)[D + 8], int j0, const int (&row)[2],
                                             const float (&L)[2], const float (&Di)[2], int S, int causal,
                                             float sl2, int lane) {
    const int t = lane & 3;
#pragma unroll
    for (int c0 = 0; c0 < ATTN_ROWS; c0 += C) {
        float p[C / 8][4];
        attn_zero(p);
        attn_mma_abt<D, C>(p, qf, sK + c0, lane);
        float dp[C / 8][4];
        attn_zero(dp);
        attn_mma_abt<D, C>(dp, dof, sV + c0, lane);
#pragma unroll
        for (int ni = 0; ni < C / 8; ++ni)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = e >> 1;
                float pe = exp2f(p[ni][e] * sl2 - L[r]);
                if (M) {
                    const int j = j0 + c0 + ni * 8 + 2 * t + (e & 1), i = row[r];
                    const bool ok = i < S && j < S && (!causal || j <= i);
                    pe = ok ? pe : 0.f;
                }
                p[ni][e] = pe * (dp[ni][e] - Di[r]);
            }
        // dQ += dS·K
        attn_mma_pt<D, C>(dqacc, p, sK + c0, lane);
    }
}

// dK, dV, S > 64: grid (ceil(S/128), H, B), block 256; a warp owns 16 keys and loops over
// the query tiles (causal: from the first that reaches its CTA's keys) as the f32 kernel
// do: Pᵀ = exp(K·Qᵀ·scale − lse), dV += Pᵀ·dO, dPᵀ = V·dOᵀ, dSᵀ = Pᵀ∘(dPᵀ − D),
// dK += dSᵀ·Q; dk = scale·dK. dk, dv: rows `ldo` floats apart. lb = lse·log2(e) and D
// come from attn_stage_bf16.
template <int D, int C = 16>
__device__ __forceinline__ void attn_bwd_dkdv_st_body(const __nv_bfloat16* __restrict__ dO,
                                                      const __nv_bfloat16* __restrict__ q,
                                                      const __nv_bfloat16* __restrict__ k,
                                                      const __nv_bfloat16* __restrict__ v,
                                                      const float* __restrict__ lb, const float* __restrict__ Dv,
                                                      float* __restrict__ dk, float* __restrict__ dv, int ldo,
                                                      int S, int H, int causal, float scale) {
    __shared__ __align__(16) AttnStaged<D> sm;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2;
    const int h = blockIdx.y, b = blockIdx.z, j0 = blockIdx.x * ATTN_ST_ROWS;
    const long long bh = static_cast<long long>(b) * H + h, hb = bh * S * D;
    dO += hb;
    q += hb;
    k += hb;
    v += hb;
    lb += bh * S;
    Dv += bh * S;
    const float sl2 = scale * ATTN_LOG2E;

    attn_cp_tile<D, ATTN_ST_ROWS>(sm.own(0), k, j0, S, tid);
    attn_cp_tile<D, ATTN_ST_ROWS>(sm.own(1), v, j0, S, tid);
    attn_cp_commit();
    attn_cp_wait<0>();
    __syncthreads();
    uint32_t kf[D / 16][4], vf[D / 16][4];
    attn_load_a<D>(kf, sm.own(0), warp * 16, lane);
    attn_load_a<D>(vf, sm.own(1), warp * 16, lane);

    const int key0 = j0 + warp * 16, key[2] = {key0 + g, key0 + g + 8};
    float dkacc[D / 8][4], dvacc[D / 8][4];
    attn_zero(dkacc);
    attn_zero(dvacc);

    const int tiles = (S + ATTN_ROWS - 1) / ATTN_ROWS;
    const int qt0 = causal ? j0 / ATTN_ROWS : 0;
    auto issue = [&](int qt, int st) {
        const int i0 = qt * ATTN_ROWS;
        attn_cp_tile<D, ATTN_ROWS>(sm.t[st][0], q, i0, S, tid);
        attn_cp_tile<D, ATTN_ROWS>(sm.t[st][1], dO, i0, S, tid);
        attn_cp_row64(sm.row[st][0], lb, i0, S, tid, 0);
        attn_cp_row64(sm.row[st][1], Dv, i0, S, tid, ATTN_ROWS);
    };
    __syncthreads();  // the own rows' readers are done before stage 0 is overwritten
    issue(qt0, 0);
    attn_cp_commit();
    for (int qt = qt0; qt < tiles; ++qt) {
        const int i0 = qt * ATTN_ROWS, st = (qt - qt0) & 1;
        if (qt + 1 < tiles) issue(qt + 1, st ^ 1);
        attn_cp_commit();
        attn_cp_wait<1>();
        __syncthreads();
        __nv_bfloat16(*sQ)[D + 8] = sm.t[st][0];
        __nv_bfloat16(*sdO)[D + 8] = sm.t[st][1];
        const float* sL = sm.row[st][0];
        const float* sD = sm.row[st][1];

        // a tile whose queries are all < S and see all the warp's keys needs no mask
        if (i0 + ATTN_ROWS <= S && key0 + 16 <= S && (!causal || key0 + 15 <= i0))
            attn_dkdv_tile<D, C, false>(dkacc, dvacc, kf, vf, sQ, sdO, sL, sD, i0, key, S, causal, sl2, lane);
        else
            attn_dkdv_tile<D, C, true>(dkacc, dvacc, kf, vf, sQ, sdO, sL, sD, i0, key, S, causal, sl2, lane);
        __syncthreads();  // stage st is read by no one before the next issue overwrites it
    }
    const long long obase = static_cast<long long>(b) * S * ldo + static_cast<long long>(h) * D;
    attn_store_rows<D>(dk + obase, ldo, dkacc, j0 + warp * 16, S, scale, scale, lane);
    attn_store_rows<D>(dv + obase, ldo, dvacc, j0 + warp * 16, S, 1.f, 1.f, lane);
}

// dQ, S > 64: grid (ceil(S/128), H, B), block 256; a warp owns 16 queries and loops over
// the key tiles recomputing P and dP: dQ += dS·K; dq = scale·dQ (rows `ldo` floats apart).
// lb and D as for dk, dv.
template <int D, int C = 16>
__device__ __forceinline__ void attn_bwd_dq_st_body(const __nv_bfloat16* __restrict__ dO,
                                                    const __nv_bfloat16* __restrict__ q,
                                                    const __nv_bfloat16* __restrict__ k,
                                                    const __nv_bfloat16* __restrict__ v,
                                                    const float* __restrict__ lb, const float* __restrict__ Dv,
                                                    float* __restrict__ dq, int ldo, int S, int H, int causal,
                                                    float scale) {
    __shared__ __align__(16) AttnStaged<D> sm;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2;
    const int h = blockIdx.y, b = blockIdx.z, i0 = blockIdx.x * ATTN_ST_ROWS;
    const long long bh = static_cast<long long>(b) * H + h, hb = bh * S * D;
    dO += hb;
    q += hb;
    k += hb;
    v += hb;
    const float sl2 = scale * ATTN_LOG2E;

    attn_cp_tile<D, ATTN_ST_ROWS>(sm.own(0), q, i0, S, tid);
    attn_cp_tile<D, ATTN_ST_ROWS>(sm.own(1), dO, i0, S, tid);
    attn_cp_commit();
    attn_cp_wait<0>();
    __syncthreads();
    uint32_t qf[D / 16][4], dof[D / 16][4];
    attn_load_a<D>(qf, sm.own(0), warp * 16, lane);
    attn_load_a<D>(dof, sm.own(1), warp * 16, lane);

    const int row0 = i0 + warp * 16, row[2] = {row0 + g, row0 + g + 8};
    float L[2], Di[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const bool ok = row[r] < S;
        L[r] = ok ? __ldg(lb + bh * S + row[r]) : 0.f;
        Di[r] = ok ? __ldg(Dv + bh * S + row[r]) : 0.f;
    }
    float dqacc[D / 8][4];
    attn_zero(dqacc);

    const int tiles = (S + ATTN_ROWS - 1) / ATTN_ROWS;
    const int kt_end = causal ? min(tiles, (i0 + ATTN_ST_ROWS - 1) / ATTN_ROWS + 1) : tiles;
    __syncthreads();  // the own rows' readers are done before stage 0 is overwritten
    attn_cp_tile<D, ATTN_ROWS>(sm.t[0][0], k, 0, S, tid);
    attn_cp_tile<D, ATTN_ROWS>(sm.t[0][1], v, 0, S, tid);
    attn_cp_commit();
    for (int kt = 0; kt < kt_end; ++kt) {
        const int j0 = kt * ATTN_ROWS, st = kt & 1;
        if (kt + 1 < kt_end) {
            attn_cp_tile<D, ATTN_ROWS>(sm.t[st ^ 1][0], k, j0 + ATTN_ROWS, S, tid);
            attn_cp_tile<D, ATTN_ROWS>(sm.t[st ^ 1][1], v, j0 + ATTN_ROWS, S, tid);
        }
        attn_cp_commit();
        attn_cp_wait<1>();
        __syncthreads();

        // a tile whose keys are all < S and seen by all the warp's (valid) rows needs no mask
        if (j0 + ATTN_ROWS <= S && row0 + 16 <= S && (!causal || j0 + ATTN_ROWS - 1 <= row0))
            attn_dq_tile<D, C, false>(dqacc, qf, dof, sm.t[st][0], sm.t[st][1], j0, row, L, Di, S, causal, sl2,
                                      lane);
        else
            attn_dq_tile<D, C, true>(dqacc, qf, dof, sm.t[st][0], sm.t[st][1], j0, row, L, Di, S, causal, sl2,
                                     lane);
        __syncthreads();  // stage st is read by no one before the next issue overwrites it
    }
    const long long obase = static_cast<long long>(b) * S * ldo + static_cast<long long>(h) * D;
    attn_store_rows<D>(dq + obase, ldo, dqacc, i0 + warp * 16, S, scale, scale, lane);
}

// S ≤ 64: one CTA per (b, h) holds every query and key, so the three gradients come out
// of one pass: D from do and o, dK and dV as in attn_bwd_dkdv (warps own 16 keys), dSᵀ to
// shared memory as bf16, then dQ = dS·K with warps owning 16 queries. No scratch.
template <int D, bool P, int R = ATTN_ROWS, typename OT = float, typename IT = float>
__device__ __forceinline__ void attn_bwd_small_body(const float* __restrict__ dO, const IT* __restrict__ q,
                                                    const IT* __restrict__ k, const IT* __restrict__ v,
                                                    const float* __restrict__ o, const float* __restrict__ lse,
                                                    OT* __restrict__ dq, OT* __restrict__ dk,
                                                    OT* __restrict__ dv, int S, int H, int causal, float scale) {
    constexpr int LD = D + 8;
    using G = AttnGroups<R>;
    __shared__ __align__(16) __nv_bfloat16 sKs[G::N][R][LD];
    __shared__ __align__(16) __nv_bfloat16 sVs[G::N][R][LD];
    __shared__ __align__(16) __nv_bfloat16 sQs[G::N][R][LD];
    __shared__ __align__(16) __nv_bfloat16 sdOs[G::N][R][LD];
    __shared__ __align__(16) __nv_bfloat16 sdSs[G::N][R][R + 8];  // [key][query]
    __shared__ float sLs[G::N][R], sDs[G::N][R];
    const int tid0 = threadIdx.x, lane = tid0 & 31, g = lane >> 2, t = lane & 3;
    const int grp = G::group(tid0), warp = G::warp(tid0), tid = G::index(tid0);
    auto sK = sKs[grp];
    auto sV = sVs[grp];
    auto sQ = sQs[grp];
    auto sdO = sdOs[grp];
    auto sdS = sdSs[grp];
    float* sL = sLs[grp];
    float* sD = sDs[grp];
    const int h = blockIdx.y * G::N + grp, b = blockIdx.z;
    // a group past the last head: nothing loaded or stored, the barriers kept
    S = G::N == 1 || h < H ? S : 0;
    const long long W = static_cast<long long>(H) * D;
    const long long base = static_cast<long long>(b) * S * W + static_cast<long long>(h) * D;
    // q, k, v and their gradients: rows W floats apart, or 3·W when packed (P)
    const long long ldi = P ? 3 * W : W;
    const long long pbase = static_cast<long long>(b) * S * ldi + static_cast<long long>(h) * D;
    o += base;
    dO += base;
    q += pbase;
    k += pbase;
    v += pbase;
    dq += pbase;
    dk += pbase;
    dv += pbase;
    const long long lbase = (static_cast<long long>(b) * H + h) * S;
    const float sl2 = scale * ATTN_LOG2E;

    attn_load_tile<D, R, G::T>(sK, k, ldi, 0, S, tid);
    attn_load_tile<D, R, G::T>(sV, v, ldi, 0, S, tid);
    attn_load_tile<D, R, G::T>(sQ, q, ldi, 0, S, tid);
    attn_load_tile<D, R, G::T>(sdO, dO, W, 0, S, tid);
    if (tid < R) sL[tid] = tid < S ? __ldg(lse + lbase + tid) * ATTN_LOG2E : 0.f;
    // D_i = Σ_c bf16(do_ic)·o_ic, lanes over c then the warp's fixed tree: warp w takes rows w, w+4,
    // ..; the loads of 8 rows are issued before their reductions (one row at a time left
    // this loop bound by load latency)
    constexpr int WARPS = G::WARPS, BATCH = 8;
#pragma unroll
    for (int j0 = 0; j0 < R / WARPS; j0 += BATCH) {
        float dd[BATCH];
#pragma unroll
        for (int j = 0; j < BATCH; ++j) {
            const int i = warp + (j0 + j) * WARPS;
            float d = 0.f;
            if (i < S) {
                const float* dor = dO + static_cast<long long>(i) * W;
                const float* orow = o + static_cast<long long>(i) * W;
#pragma unroll
                for (int c = lane; c < D; c += 32) d += erase_round_bf16(__ldg(dor + c)) * __ldg(orow + c);
            }
            dd[j] = d;
        }
#pragma unroll
        for (int j = 0; j < BATCH; ++j) {
            const float d = erase_warp_sum(dd[j]);
            if (lane == 0) sD[warp + (j0 + j) * WARPS] = d;
        }
    }
    __syncthreads();

    {
        uint32_t kf[D / 16][4], vf[D / 16][4];
        attn_load_a<D>(kf, sK, warp * 16, lane);
        attn_load_a<D>(vf, sV, warp * 16, lane);
        const int key[2] = {warp * 16 + g, warp * 16 + g + 8};
        float dkacc[D / 8][4], dvacc[D / 8][4];
        attn_zero(dkacc);
        attn_zero(dvacc);
        float p[R / 8][4];
        attn_zero(p);
        attn_mma_abt<D, R>(p, kf, sQ, lane);
#pragma unroll
        for (int ni = 0; ni < R / 8; ++ni)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int i = ni * 8 + 2 * t + (e & 1), j = key[e >> 1];
                const bool ok = i < S && j < S && (!causal || j <= i);
                p[ni][e] = ok ? exp2f(p[ni][e] * sl2 - sL[i]) : 0.f;
            }
        attn_mma_pt<D, R>(dvacc, p, sdO, lane);
        float dp[R / 8][4];
        attn_zero(dp);
        attn_mma_abt<D, R>(dp, vf, sdO, lane);
#pragma unroll
        for (int ni = 0; ni < R / 8; ++ni)
#pragma unroll
            for (int e = 0; e < 4; ++e) p[ni][e] *= dp[ni][e] - sD[ni * 8 + 2 * t + (e & 1)];
        attn_mma_pt<D, R>(dkacc, p, sQ, lane);
        // dSᵀ rounded as attn_mma_pt rounds it, for dQ
#pragma unroll
        for (int ni = 0; ni < R / 8; ++ni)
#pragma unroll
            for (int r = 0; r < 2; ++r)
                *reinterpret_cast<uint32_t*>(&sdS[key[r]][ni * 8 + 2 * t]) =
                    attn_pack_bf16(p[ni][2 * r], p[ni][2 * r + 1]);
        attn_store_rows<D>(dk, ldi, dkacc, warp * 16, S, scale, scale, lane);
        attn_store_rows<D>(dv, ldi, dvacc, warp * 16, S, 1.f, 1.f, lane);
    }
    __syncthreads();

    // dQ (16 queries of this warp x Dh) = dS·K: A = dS from sdS[key][query] (.trans),
    // B = K from sK[key][d] (.trans)
    float dqacc[D / 8][4];
    attn_zero(dqacc);
#pragma unroll
    for (int kc = 0; kc < R / 16; ++kc) {
        uint32_t a[4];
        attn_ldsm_x4_trans(a, &sdS[kc * 16 + (lane & 7) + (lane >> 4) * 8][warp * 16 + ((lane >> 3) & 1) * 8]);
#pragma unroll
        for (int dp2 = 0; dp2 < D / 16; ++dp2) {
            uint32_t r[4];
            attn_ldsm_x4_trans(r, &sK[kc * 16 + (lane & 7) + ((lane >> 3) & 1) * 8][dp2 * 16 + (lane >> 4) * 8]);
            attn_mma(dqacc[2 * dp2], a, r[0], r[1]);
            attn_mma(dqacc[2 * dp2 + 1], a, r[2], r[3]);
        }
    }
    attn_store_rows<D>(dq, ldi, dqacc, warp * 16, S, scale, scale, lane);
}

}  // namespace

// attn_fwd_d*(q, k, v, o, lse, S, H, causal, scale): grid (ceil(S/64), H, B), block 128.
// attn_*_packed_d*: the same with q, k and v (and dq, dk, dv in the backward) one packed
// [B, S, 3·H·Dh] tensor: rows 3·H·Dh floats apart, k and v passed as pointers H·Dh and
// 2·H·Dh into it; o, do and lse are always their own tensors.
#define ERASE_ATTN_KERNELS(DH, P, SUFFIX, FWD_MIN_CTAS, TFWD_MIN_CTAS, TBWD_MIN_CTAS)                                                                    \
    ERASE_KERNEL void __launch_bounds__(ATTN_THREADS, FWD_MIN_CTAS) attn_fwd##SUFFIX##_d##DH(                              \
        const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,               \
        float* __restrict__ o, float* __restrict__ lse, int S, int H, int causal, float scale) { ERASE_PDL_ENTER(); \
        attn_fwd_body<DH, P>(q, k, v, o, lse, S, H, causal, scale);                                          \
    }                                                                                                        \
    ERASE_KERNEL void __launch_bounds__(ATTN_THREADS) attn_bwd_small##SUFFIX##_d##DH(                        \
        const float* __restrict__ dO, const float* __restrict__ q, const float* __restrict__ k,              \
        const float* __restrict__ v, const float* __restrict__ o, const float* __restrict__ lse,             \
        float* __restrict__ dq, float* __restrict__ dk, float* __restrict__ dv, int S, int H, int causal,    \
        float scale) { ERASE_PDL_ENTER();                                                                    \
        attn_bwd_small_body<DH, P>(dO, q, k, v, o, lse, dq, dk, dv, S, H, causal, scale);                    \
    }                                                                                                        \
    ERASE_KERNEL void __launch_bounds__(ATTN_THREADS, TFWD_MIN_CTAS) attn_fwd_tiny##SUFFIX##_d##DH(           \
        const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,               \
        float* __restrict__ o, float* __restrict__ lse, int S, int H, int causal, float scale) { ERASE_PDL_ENTER(); \
        attn_fwd_body<DH, P, 32>(q, k, v, o, lse, S, H, causal, scale);                                      \
    }                                                                                                        \
    ERASE_KERNEL void __launch_bounds__(ATTN_THREADS, TBWD_MIN_CTAS) attn_bwd_tiny##SUFFIX##_d##DH(           \
        const float* __restrict__ dO, const float* __restrict__ q, const float* __restrict__ k,              \
        const float* __restrict__ v, const float* __restrict__ o, const float* __restrict__ lse,             \
        float* __restrict__ dq, float* __restrict__ dk, float* __restrict__ dv, int S, int H, int causal,    \
        float scale) { ERASE_PDL_ENTER();                                                                    \
        attn_bwd_small_body<DH, P, 32>(dO, q, k, v, o, lse, dq, dk, dv, S, H, causal, scale);                \
    }

// FWD_MIN_CTAS: 5 resident CTAs per SM (at most 102 registers) keeps the Dh = 32 forward
// at 96 registers without spills (left to itself ptxas spilled the packed form; at 4 CTAs
// it took 127 registers and ran 12 % slower at the AutoInt shape); Dh = 64 needs more.
// TFWD_MIN_CTAS, TBWD_MIN_CTAS: the S <= 32 kernels (two heads a CTA): the most CTAs an
// SM whose register cap leaves them without spills.
ERASE_ATTN_KERNELS(32, false, , 5, 5, 8)
ERASE_ATTN_KERNELS(64, false, , 1, 2, 4)
ERASE_ATTN_KERNELS(32, true, _packed, 5, 5, 8)
ERASE_ATTN_KERNELS(64, true, _packed, 1, 2, 4)

// attn_bwd_{small,tiny}_packed_bo_d*: the packed backward writing dqkv in bf16 (the
// projection's GEMMs that read it round it to bf16 anyway): half the bytes out, and
// half for each GEMM that reads it. Arguments as the f32 forms.
#define ERASE_ATTN_BWD_BF16_OUT(DH, TBWD_MIN_CTAS)                                                               \
    ERASE_KERNEL void __launch_bounds__(ATTN_THREADS) attn_bwd_small_packed_bo_d##DH(                           \
        const float* __restrict__ dO, const float* __restrict__ q, const float* __restrict__ k,                 \
        const float* __restrict__ v, const float* __restrict__ o, const float* __restrict__ lse,                \
        __nv_bfloat16* __restrict__ dq, __nv_bfloat16* __restrict__ dk, __nv_bfloat16* __restrict__ dv, int S,  \
        int H, int causal, float scale) { ERASE_PDL_ENTER();                                                    \
        attn_bwd_small_body<DH, true>(dO, q, k, v, o, lse, dq, dk, dv, S, H, causal, scale);                    \
    }                                                                                                           \
    ERASE_KERNEL void __launch_bounds__(ATTN_THREADS, TBWD_MIN_CTAS) attn_bwd_tiny_packed_bo_d##DH(              \
        const float* __restrict__ dO, const float* __restrict__ q, const float* __restrict__ k,                 \
        const float* __restrict__ v, const float* __restrict__ o, const float* __restrict__ lse,                \
        __nv_bfloat16* __restrict__ dq, __nv_bfloat16* __restrict__ dk, __nv_bfloat16* __restrict__ dv, int S,  \
        int H, int causal, float scale) { ERASE_PDL_ENTER();                                                    \
        attn_bwd_small_body<DH, true, 32>(dO, q, k, v, o, lse, dq, dk, dv, S, H, causal, scale);                \
    }
ERASE_ATTN_BWD_BF16_OUT(32, 8)
ERASE_ATTN_BWD_BF16_OUT(64, 4)

// attn_*_packed_bi_d* (S <= 64): the packed kernels reading a bf16 qkv (its projection
// stored it in bf16, the values they round to anyway: the same bits from half the bytes);
// the backward writes dqkv in f32, or in bf16 (`_bi_bo`). Arguments as the f32 forms,
// with q, k and v bf16 pointers (k and v H·Dh and 2·H·Dh elements into qkv).
#define ERASE_ATTN_BF16_IN(DH, FWD_MIN_CTAS, TFWD_MIN_CTAS, TBWD_MIN_CTAS)                                        \
    ERASE_KERNEL void __launch_bounds__(ATTN_THREADS, FWD_MIN_CTAS) attn_fwd_packed_bi_d##DH(                   \
        const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,                               \
        const __nv_bfloat16* __restrict__ v, float* __restrict__ o, float* __restrict__ lse, int S, int H,      \
        int causal, float scale) { ERASE_PDL_ENTER();                                                           \
        attn_fwd_body<DH, true, ATTN_ROWS, __nv_bfloat16>(q, k, v, o, lse, S, H, causal, scale);                \
    }                                                                                                           \
    ERASE_KERNEL void __launch_bounds__(ATTN_THREADS, TFWD_MIN_CTAS) attn_fwd_tiny_packed_bi_d##DH(             \
        const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,                               \
        const __nv_bfloat16* __restrict__ v, float* __restrict__ o, float* __restrict__ lse, int S, int H,      \
        int causal, float scale) { ERASE_PDL_ENTER();                                                           \
        attn_fwd_body<DH, true, 32, __nv_bfloat16>(q, k, v, o, lse, S, H, causal, scale);                       \
    }                                                                                                           \
    ERASE_KERNEL void __launch_bounds__(ATTN_THREADS) attn_bwd_small_packed_bi_d##DH(                           \
        const float* __restrict__ dO, const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k, \
        const __nv_bfloat16* __restrict__ v, const float* __restrict__ o, const float* __restrict__ lse,        \
        float* __restrict__ dq, float* __restrict__ dk, float* __restrict__ dv, int S, int H, int causal,       \
        float scale) { ERASE_PDL_ENTER();                                                                       \
        attn_bwd_small_body<DH, true, ATTN_ROWS, float, __nv_bfloat16>(dO, q, k, v, o, lse, dq, dk, dv, S, H,   \
                                                                       causal, scale);                          \
    }                                                                                                           \
    ERASE_KERNEL void __launch_bounds__(ATTN_THREADS, TBWD_MIN_CTAS) attn_bwd_tiny_packed_bi_d##DH(             \
        const float* __restrict__ dO, const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k, \
        const __nv_bfloat16* __restrict__ v, const float* __restrict__ o, const float* __restrict__ lse,        \
        float* __restrict__ dq, float* __restrict__ dk, float* __restrict__ dv, int S, int H, int causal,       \
        float scale) { ERASE_PDL_ENTER();                                                                       \
        attn_bwd_small_body<DH, true, 32, float, __nv_bfloat16>(dO, q, k, v, o, lse, dq, dk, dv, S, H, causal,  \
                                                                scale);                                         \
    }                                                                                                           \
    ERASE_KERNEL void __launch_bounds__(ATTN_THREADS) attn_bwd_small_packed_bi_bo_d##DH(                        \
        const float* __restrict__ dO, const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k, \
        const __nv_bfloat16* __restrict__ v, const float* __restrict__ o, const float* __restrict__ lse,        \
        __nv_bfloat16* __restrict__ dq, __nv_bfloat16* __restrict__ dk, __nv_bfloat16* __restrict__ dv, int S,  \
        int H, int causal, float scale) { ERASE_PDL_ENTER();                                                    \
        attn_bwd_small_body<DH, true, ATTN_ROWS, __nv_bfloat16, __nv_bfloat16>(dO, q, k, v, o, lse, dq, dk, dv, \
                                                                               S, H, causal, scale);            \
    }                                                                                                           \
    ERASE_KERNEL void __launch_bounds__(ATTN_THREADS, TBWD_MIN_CTAS) attn_bwd_tiny_packed_bi_bo_d##DH(          \
        const float* __restrict__ dO, const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k, \
        const __nv_bfloat16* __restrict__ v, const float* __restrict__ o, const float* __restrict__ lse,        \
        __nv_bfloat16* __restrict__ dq, __nv_bfloat16* __restrict__ dk, __nv_bfloat16* __restrict__ dv, int S,  \
        int H, int causal, float scale) { ERASE_PDL_ENTER();                                                    \
        attn_bwd_small_body<DH, true, 32, __nv_bfloat16, __nv_bfloat16>(dO, q, k, v, o, lse, dq, dk, dv, S, H,  \
                                                                        causal, scale);                         \
    }
ERASE_ATTN_BF16_IN(32, 5, 5, 8)
ERASE_ATTN_BF16_IN(64, 1, 2, 4)

// S > 64 (grid (ceil(S/128), H, B), block 256): q, k, v and do are the bf16 head-major
// copies attn_stage_bf16 writes; o, lse, D and the gradients are as in the f32 kernels,
// the gradients' rows `ldo` floats apart (H·Dh, or 3·H·Dh into a packed dqkv).
#define ERASE_ATTN_STAGED_KERNELS(DH)                                                                          \
    ERASE_KERNEL void __launch_bounds__(ATTN_ST_THREADS, 2) attn_fwd_st_d##DH(                                 \
        const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,                              \
        const __nv_bfloat16* __restrict__ v, float* __restrict__ o, float* __restrict__ lse, int S, int H,     \
        int causal, float scale) { ERASE_PDL_ENTER();                                                          \
        attn_fwd_st_body<DH>(q, k, v, o, lse, S, H, causal, scale);                                            \
    }                                                                                                          \
    ERASE_KERNEL void __launch_bounds__(ATTN_ST_THREADS, 2) attn_bwd_dkdv_st_d##DH(                            \
        const __nv_bfloat16* __restrict__ dO, const __nv_bfloat16* __restrict__ q,                             \
        const __nv_bfloat16* __restrict__ k, const __nv_bfloat16* __restrict__ v,                              \
        const float* __restrict__ lb, const float* __restrict__ Dv, float* __restrict__ dk,                    \
        float* __restrict__ dv, int ldo, int S, int H, int causal, float scale) { ERASE_PDL_ENTER();           \
        attn_bwd_dkdv_st_body<DH>(dO, q, k, v, lb, Dv, dk, dv, ldo, S, H, causal, scale);                     \
    }                                                                                                          \
    ERASE_KERNEL void __launch_bounds__(ATTN_ST_THREADS, 2) attn_bwd_dq_st_d##DH(                              \
        const __nv_bfloat16* __restrict__ dO, const __nv_bfloat16* __restrict__ q,                             \
        const __nv_bfloat16* __restrict__ k, const __nv_bfloat16* __restrict__ v,                              \
        const float* __restrict__ lb, const float* __restrict__ Dv, float* __restrict__ dq, int ldo, int S,    \
        int H, int causal, float scale) { ERASE_PDL_ENTER();                                                   \
        attn_bwd_dq_st_body<DH>(dO, q, k, v, lb, Dv, dq, ldo, S, H, causal, scale);                           \
    }

ERASE_ATTN_STAGED_KERNELS(32)
ERASE_ATTN_STAGED_KERNELS(64)

// dst_t[((b·H + h)·S + i)·Dh + c] = bf16(src_t[(b·S + i)·ld_t + h·Dh + c]) for tensor
// t = blockIdx.y (0, 1, 2: q, k, v, rows ld_qkv floats apart; 3: do, rows H·Dh apart),
// rounded to nearest even as attn_load_tile rounds. With do (t = 3) the backward's row
// statistics come too, for row r = (b·H + h)·S + i: Dv[r] = Σ_c bf16(do)·o (each thread's
// four products in column order, then a fixed xor tree over the row's Dh/4 threads) and
// lb[r] = lse[r]·log2(e). A thread per 4 consecutive elements (four columns of one head:
// a row is Dh/4 consecutive lanes of one warp); block 256, grid (ceil(B·S·H·Dh / 1024),
// tensors). o, lse, Dv and lb are read or written only for t = 3.
ERASE_KERNEL void __launch_bounds__(256)
    attn_stage_bf16(const float* __restrict__ s0, const float* __restrict__ s1, const float* __restrict__ s2,
                    const float* __restrict__ s3, __nv_bfloat16* __restrict__ d0, __nv_bfloat16* __restrict__ d1,
                    __nv_bfloat16* __restrict__ d2, __nv_bfloat16* __restrict__ d3, const float* __restrict__ o,
                    const float* __restrict__ lse, float* __restrict__ Dv, float* __restrict__ lb, int ld_qkv,
                    int B, int S, int H, int Dh) { ERASE_PDL_ENTER();
    const int tsr = blockIdx.y;
    const float* src = tsr == 0 ? s0 : tsr == 1 ? s1 : tsr == 2 ? s2 : s3;
    __nv_bfloat16* dst = tsr == 0 ? d0 : tsr == 1 ? d1 : tsr == 2 ? d2 : d3;
    const long long W = static_cast<long long>(H) * Dh;
    const long long ld = tsr == 3 ? W : ld_qkv;
    const long long e = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) * 4;
    const long long n = static_cast<long long>(B) * S * W;
    // threads past the end stay for the row sums' shuffles (whole rows are in or out)
    const bool in = e < n;
    const int c = static_cast<int>(e % Dh);
    long long r = e / Dh;
    const int h = static_cast<int>(r % H);
    r /= H;  // b·S + i
    const long long b = r / S, i = r % S;
    const long long at = r * ld + static_cast<long long>(h) * Dh + c;
    const float4 x = in ? __ldg(reinterpret_cast<const float4*>(src + at)) : make_float4(0.f, 0.f, 0.f, 0.f);
    uint2 p;
    p.x = attn_pack_bf16(x.x, x.y);
    p.y = attn_pack_bf16(x.z, x.w);
    const long long row = (b * H + h) * S + i;
    if (in) *reinterpret_cast<uint2*>(dst + row * Dh + c) = p;
    if (tsr != 3) return;  // uniform across the CTA
    const float4 y = in ? __ldg(reinterpret_cast<const float4*>(o + r * W + static_cast<long long>(h) * Dh + c))
                        : make_float4(0.f, 0.f, 0.f, 0.f);
    float sum = erase_round_bf16(x.x) * y.x;
    sum += erase_round_bf16(x.y) * y.y;
    sum += erase_round_bf16(x.z) * y.z;
    sum += erase_round_bf16(x.w) * y.w;
    for (int m = Dh / 8; m >= 1; m >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, m);
    if (in && c == 0) {
        Dv[row] = sum;
        lb[row] = __ldg(lse + row) * ATTN_LOG2E;
    }
}
