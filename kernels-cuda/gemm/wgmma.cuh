// Part of gemm.cu, the GEMM family's one translation unit: gemm.cu includes it after the parts it
// uses; it is not compiled alone. The wgmma form of the pipelined path (sm_90a) with the epilogues
// the other wgmma forms share, and the pipelined kernels `gemm_bf16p_*`, which run it on sm_90a and
// gemm_pipe_body (pipe.cuh) elsewhere.

namespace {

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

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace

// The pipelined kernels, arguments in order:
//   A, B (bf16: K-major rows A[m·lda + k], B[n·ldb + k], or, in the `_mm` kernels,
//   MN-major A[k·lda + m], B[k·ldb + n]; batch entries batch_a, batch_b elements apart),
//   C, bias, M, N, Kp (i32; Kp a multiple of 64: the k range read, rows of A and B past M
//   and N read as row M-1 or N-1, and in `_mm` M, N are multiples of 8),
//   lda, ldb, ldc (i64), batch_a, batch_b, batch_c (i64, elements), batch (i32),
//   k_split (i32, multiple of 64), split_c (i64), flags (i32: 1 bias, 2 relu, 8 the mask,
//   16 a residual through `bias`, 64 in the `_c` kernels C stored in bf16 alone: C and Cb
//   the same bf16 tensor), Cb (bf16: the `_c` kernels, K-major operands, also store C's
//   bf16 copy there, C's layout, the operand of a later GEMM; the others never touch it).
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
