// Part of gemm.cu, the GEMM family's one translation unit: gemm.cu includes it after the parts it
// uses; it is not compiled alone. The thin GEMMs of a linear layer of one output (`gemm_thin_n1`,
// `_k1`, `_m1`).

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
