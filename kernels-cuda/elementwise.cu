// Elementwise maps and copies: add/mul with suffix broadcasting, the fused products of
// same-shape tensors (mul_add, mul_grad: float4 lanes), scale, the activations and their
// gradients, casts, the n-ary gradient sum, fills, the step counter, and the shape ops
// (concat/slice/pad as strided row copies, reshape/detach as a plain copy).
//
// Tiling: 1-D grid-stride loops; 256 threads per CTA, a grid of at most a few thousand
// CTAs (the plan caps it), each thread one element per iteration, consecutive threads on
// consecutive elements so every warp access is one or a few 128-byte transactions.
// Bound: memory bandwidth (4-12 bytes per element, a handful of FLOPs; GELU ~20 FLOPs and
// a tanhf, still memory-bound on an H200). No reductions: every output element is a pure
// function of its inputs, so results are deterministic. The arithmetic is written with
// erase_mul/erase_add (no FMA contraction) so the maps reproduce the CPU reference's
// rounding; only expf/tanhf may differ from the host libm by an ulp or two.
#include "common.cuh"

#define EW_LOOP(i, n) for (long long i = erase_gtid(); i < (n); i += erase_gstride())

// ---- binary with suffix broadcasting ---------------------------------------------------

// c[i] = a[i] (+|*) b[i % nb]; `b`'s shape is a suffix of `a`'s, so `nb` divides `n`.
// The modulo is taken once per thread, then advanced by the grid stride.
template <bool MUL>
__device__ __forceinline__ void binary_bcast(const float* __restrict__ a, const float* __restrict__ b,
                                             float* __restrict__ c, long long n, long long nb) {
    if (nb <= 0) return;
    long long i = erase_gtid();
    const long long stride = erase_gstride();
    if (i >= n) return;
    long long j = i % nb;
    const long long step = stride % nb;
    for (; i < n; i += stride) {
        const float x = a[i], y = __ldg(b + j);
        c[i] = MUL ? erase_mul(x, y) : erase_add(x, y);
        j += step;
        if (j >= nb) j -= nb;
    }
}

ERASE_KERNEL void ew_add(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ c,
                         long long n, long long nb) { ERASE_PDL_ENTER();
    binary_bcast<false>(a, b, c, n, nb);
}

ERASE_KERNEL void ew_mul(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ c,
                         long long n, long long nb) { ERASE_PDL_ENTER();
    binary_bcast<true>(a, b, c, n, nb);
}

// ---- fused products of same-shape tensors ------------------------------------------------

// float4 lanes over the first n & ~3 elements (the runtime's arena aligns tensors to 256
// bytes), then a scalar tail; the arithmetic as ew_mul then ew_add (no FMA contraction).
__device__ __forceinline__ float4 ew4(const float* __restrict__ p, long long i) {
    return __ldg(reinterpret_cast<const float4*>(p) + i);
}

// Four consecutive elements of b (i counts float4 lanes) as floats: f32 as they are, bf16
// (a factor stored in bf16, Graph::linear_stored_bf16) widened exactly.
__device__ __forceinline__ float4 ew4b(const float* __restrict__ p, long long i) { return ew4(p, i); }
__device__ __forceinline__ float4 ew4b(const __nv_bfloat16* __restrict__ p, long long i) {
    const uint2 u = __ldg(reinterpret_cast<const uint2*>(p) + i);
    const __nv_bfloat162 lo = *reinterpret_cast<const __nv_bfloat162*>(&u.x),
                         hi = *reinterpret_cast<const __nv_bfloat162*>(&u.y);
    const float2 l = __bfloat1622float2(lo), h = __bfloat1622float2(hi);
    return make_float4(l.x, l.y, h.x, h.y);
}
__device__ __forceinline__ float ew1b(const float* __restrict__ p, long long j) { return p[j]; }
__device__ __forceinline__ float ew1b(const __nv_bfloat16* __restrict__ p, long long j) {
    return __bfloat162float(p[j]);
}

// bf16 (round to nearest even) of four floats, as 8 bytes.
__device__ __forceinline__ uint2 ew_bf16x4(float4 v) {
    const __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y), hi = __floats2bfloat162_rn(v.z, v.w);
    return make_uint2(*reinterpret_cast<const unsigned*>(&lo), *reinterpret_cast<const unsigned*>(&hi));
}

// One element of a tensor of type T as f32 (ew4b/ew1b for f32 too: the loads of one body
// for either storage).
__device__ __forceinline__ float4 ew4t(const float* __restrict__ p, long long i) { return ew4(p, i); }
__device__ __forceinline__ float4 ew4t(const __nv_bfloat16* __restrict__ p, long long i) { return ew4b(p, i); }

// Four f32 values stored as T (bf16: rounded to nearest even).
__device__ __forceinline__ void ew_store4(float* __restrict__ p, long long i, float4 v) {
    reinterpret_cast<float4*>(p)[i] = v;
}
__device__ __forceinline__ void ew_store4(__nv_bfloat16* __restrict__ p, long long i, float4 v) {
    reinterpret_cast<uint2*>(p)[i] = ew_bf16x4(v);
}
__device__ __forceinline__ void ew_store1(float* __restrict__ p, long long j, float v) { p[j] = v; }
__device__ __forceinline__ void ew_store1(__nv_bfloat16* __restrict__ p, long long j, float v) {
    p[j] = __float2bfloat16_rn(v);
}

// y = a ⊙ b + c (the DCN cross update); n elements of each; with COPY also yb = bf16(y),
// the bf16 copy a GEMM reads of the cross update (Graph::set_bf16_copies), without a pass
// of its own over y. B is f32, or bf16 (the cross layer's up-projection stored in bf16);
// A and C are f32, or bf16 (x0's copy and the previous update stored in bf16,
// Graph::set_bf16_cross), and Y f32 or bf16 (an update stored in bf16).
template <typename A, typename B, typename C, typename Y, bool COPY>
__device__ __forceinline__ void ew_mul_add_body(const A* __restrict__ a, const B* __restrict__ b,
                                                const C* __restrict__ c, Y* __restrict__ y,
                                                __nv_bfloat16* __restrict__ yb, long long n) {
    const long long n4 = n >> 2;
    EW_LOOP(i, n4) {
        const float4 x = ew4t(a, i), z = ew4t(b, i), w = ew4t(c, i);
        const float4 v = make_float4(erase_add(erase_mul(x.x, z.x), w.x), erase_add(erase_mul(x.y, z.y), w.y),
                                     erase_add(erase_mul(x.z, z.z), w.z), erase_add(erase_mul(x.w, z.w), w.w));
        ew_store4(y, i, v);
        if constexpr (COPY) reinterpret_cast<uint2*>(yb)[i] = ew_bf16x4(v);
    }
    EW_LOOP(i, n - 4 * n4) {
        const long long j = 4 * n4 + i;
        const float v = erase_add(erase_mul(ew1b(a, j), ew1b(b, j)), ew1b(c, j));
        ew_store1(y, j, v);
        if constexpr (COPY) yb[j] = __float2bfloat16_rn(v);
    }
}

ERASE_KERNEL void ew_mul_add(const float* __restrict__ a, const float* __restrict__ b,
                             const float* __restrict__ c, float* __restrict__ y, long long n) { ERASE_PDL_ENTER();
    ew_mul_add_body<float, float, float, float, false>(a, b, c, y, nullptr, n);
}

ERASE_KERNEL void ew_mul_add_bf16(const float* __restrict__ a, const float* __restrict__ b,
                                  const float* __restrict__ c, float* __restrict__ y, __nv_bfloat16* __restrict__ yb,
                                  long long n) { ERASE_PDL_ENTER();
    ew_mul_add_body<float, float, float, float, true>(a, b, c, y, yb, n);
}

// The same with b in bf16 (`_b16`).
ERASE_KERNEL void ew_mul_add_b16(const float* __restrict__ a, const __nv_bfloat16* __restrict__ b,
                                 const float* __restrict__ c, float* __restrict__ y, long long n) { ERASE_PDL_ENTER();
    ew_mul_add_body<float, __nv_bfloat16, float, float, false>(a, b, c, y, nullptr, n);
}

ERASE_KERNEL void ew_mul_add_bf16_b16(const float* __restrict__ a, const __nv_bfloat16* __restrict__ b,
                                      const float* __restrict__ c, float* __restrict__ y,
                                      __nv_bfloat16* __restrict__ yb, long long n) { ERASE_PDL_ENTER();
    ew_mul_add_body<float, __nv_bfloat16, float, float, true>(a, b, c, y, yb, n);
}

// The cross update with every operand stored in bf16 (`_s16`: x0's copy, the
// up-projection and the previous update; Graph::set_bf16_cross): y stored in bf16 (read
// only by the next layer's GEMM and update), or in f32 with (`_f32c`) or without
// (`_f32`) its bf16 copy (the network's last update, read by a layer of its own type).
ERASE_KERNEL void ew_mul_add_s16(const __nv_bfloat16* __restrict__ a, const __nv_bfloat16* __restrict__ b,
                                 const __nv_bfloat16* __restrict__ c, __nv_bfloat16* __restrict__ y, long long n) {
    ERASE_PDL_ENTER();
    ew_mul_add_body<__nv_bfloat16, __nv_bfloat16, __nv_bfloat16, __nv_bfloat16, false>(a, b, c, y, nullptr, n);
}

ERASE_KERNEL void ew_mul_add_s16_f32(const __nv_bfloat16* __restrict__ a, const __nv_bfloat16* __restrict__ b,
                                     const __nv_bfloat16* __restrict__ c, float* __restrict__ y, long long n) {
    ERASE_PDL_ENTER();
    ew_mul_add_body<__nv_bfloat16, __nv_bfloat16, __nv_bfloat16, float, false>(a, b, c, y, nullptr, n);
}

ERASE_KERNEL void ew_mul_add_s16_f32c(const __nv_bfloat16* __restrict__ a, const __nv_bfloat16* __restrict__ b,
                                      const __nv_bfloat16* __restrict__ c, float* __restrict__ y,
                                      __nv_bfloat16* __restrict__ yb, long long n) {
    ERASE_PDL_ENTER();
    ew_mul_add_body<__nv_bfloat16, __nv_bfloat16, __nv_bfloat16, float, true>(a, b, c, y, yb, n);
}

// c = a ⊙ b of same-shape tensors, and cb = bf16(c) (a product a GEMM reads: MaskNet's
// masked input).
ERASE_KERNEL void ew_mul_bf16(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ c,
                              __nv_bfloat16* __restrict__ cb, long long n) { ERASE_PDL_ENTER();
    const long long n4 = n >> 2;
    EW_LOOP(i, n4) {
        const float4 x = ew4(a, i), z = ew4(b, i);
        const float4 v = make_float4(erase_mul(x.x, z.x), erase_mul(x.y, z.y), erase_mul(x.z, z.z),
                                     erase_mul(x.w, z.w));
        reinterpret_cast<float4*>(c)[i] = v;
        reinterpret_cast<uint2*>(cb)[i] = ew_bf16x4(v);
    }
    EW_LOOP(i, n - 4 * n4) {
        const long long j = 4 * n4 + i;
        c[j] = erase_mul(a[j], b[j]);
        cb[j] = __float2bfloat16_rn(c[j]);
    }
}

// da = dy ⊙ b, db = dy ⊙ a (the gradient of a product of same-shape tensors).
ERASE_KERNEL void ew_mul_grad(const float* __restrict__ dy, const float* __restrict__ a,
                              const float* __restrict__ b, float* __restrict__ da, float* __restrict__ db,
                              long long n) { ERASE_PDL_ENTER();
    const long long n4 = n >> 2;
    EW_LOOP(i, n4) {
        const float4 g = ew4(dy, i), x = ew4(a, i), z = ew4(b, i);
        reinterpret_cast<float4*>(da)[i] =
            make_float4(erase_mul(g.x, z.x), erase_mul(g.y, z.y), erase_mul(g.z, z.z), erase_mul(g.w, z.w));
        reinterpret_cast<float4*>(db)[i] =
            make_float4(erase_mul(g.x, x.x), erase_mul(g.y, x.y), erase_mul(g.z, x.z), erase_mul(g.w, x.w));
    }
    EW_LOOP(i, n - 4 * n4) {
        const long long j = 4 * n4 + i;
        da[j] = erase_mul(dy[j], b[j]);
        db[j] = erase_mul(dy[j], a[j]);
    }
}

// ew_mul_grad whose db is a copied linear layer's dy (Graph::set_bf16_copies), written
// as the bf16 copy its GEMMs read instead of in f32, with its column sums (the layer's
// bias gradient) from the same pass: for [rows][cols] tensors (cols a multiple of 8, the
// arena's 256-byte alignment), da = dy ⊙ b in f32, dbb = bf16(dy ⊙ a), and, where part
// is not null, part[by][c] = the f32 sum of dy ⊙ a over the CTA's 32·iters rows, in the
// order of gemm_round_colsum (each of 32 row lanes over its rows in order, then the lane
// sums in lane order; colsum_final adds the slices in order). Grid (ceil(cols/64),
// ceil(rows/(32·iters))), block 256: thread t takes the 8 columns 64·bx + 8·(t % 8) of
// rows 32·iters·by + t/8 + 32·i, i < iters.
// With PLUS_DY, da = dy ⊙ b + dy (the gradient of a ⊙ b + a: a cross network's first
// update, a's two contributions summed in the same pass).
template <typename A, typename B, bool PLUS_DY = false>
__device__ __forceinline__ void ew_mul_grad_bf16_body(const float* __restrict__ dy, const A* __restrict__ a,
                                                      const B* __restrict__ b, float* __restrict__ da,
                                                      __nv_bfloat16* __restrict__ dbb, float* __restrict__ part,
                                                      int rows, int cols, int iters) {
    __shared__ float lanes[32][65];
    const int tid = threadIdx.x, ch = tid & 7, y = tid >> 3;
    const int c = blockIdx.x * 64 + ch * 8, r0 = blockIdx.y * 32 * iters;
    float acc[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = 0.f;
    if (c < cols) {
        const int last = min(iters, (rows - r0 - y + 31) / 32);  // rows r0 + y + 32·i < rows
#pragma unroll 2
        for (int i = 0; i < last; ++i) {
            const int r = r0 + y + 32 * i;
            const long long q = (static_cast<long long>(r) * cols + c) >> 2;
            const float4 g0 = ew4(dy, q), g1 = ew4(dy, q + 1), x0 = ew4t(a, q), x1 = ew4t(a, q + 1);
            const float4 z0 = ew4b(b, q), z1 = ew4b(b, q + 1);
            float4 d0 = make_float4(erase_mul(g0.x, z0.x), erase_mul(g0.y, z0.y), erase_mul(g0.z, z0.z),
                                    erase_mul(g0.w, z0.w));
            float4 d1 = make_float4(erase_mul(g1.x, z1.x), erase_mul(g1.y, z1.y), erase_mul(g1.z, z1.z),
                                    erase_mul(g1.w, z1.w));
            if constexpr (PLUS_DY) {
                d0 = make_float4(erase_add(d0.x, g0.x), erase_add(d0.y, g0.y), erase_add(d0.z, g0.z),
                                 erase_add(d0.w, g0.w));
                d1 = make_float4(erase_add(d1.x, g1.x), erase_add(d1.y, g1.y), erase_add(d1.z, g1.z),
                                 erase_add(d1.w, g1.w));
            }
            reinterpret_cast<float4*>(da)[q] = d0;
            reinterpret_cast<float4*>(da)[q + 1] = d1;
            const float4 v0 = make_float4(erase_mul(g0.x, x0.x), erase_mul(g0.y, x0.y), erase_mul(g0.z, x0.z),
                                          erase_mul(g0.w, x0.w));
            const float4 v1 = make_float4(erase_mul(g1.x, x1.x), erase_mul(g1.y, x1.y), erase_mul(g1.z, x1.z),
                                          erase_mul(g1.w, x1.w));
            acc[0] = erase_add(acc[0], v0.x), acc[1] = erase_add(acc[1], v0.y);
            acc[2] = erase_add(acc[2], v0.z), acc[3] = erase_add(acc[3], v0.w);
            acc[4] = erase_add(acc[4], v1.x), acc[5] = erase_add(acc[5], v1.y);
            acc[6] = erase_add(acc[6], v1.z), acc[7] = erase_add(acc[7], v1.w);
            reinterpret_cast<uint2*>(dbb)[q] = ew_bf16x4(v0);
            reinterpret_cast<uint2*>(dbb)[q + 1] = ew_bf16x4(v1);
        }
    }
    if (part == nullptr) return;  // uniform across the CTA: no barrier is skipped by some
    erase_colsum_partials(lanes, acc, part, cols);
}

ERASE_KERNEL void __launch_bounds__(256)
    ew_mul_grad_bf16(const float* __restrict__ dy, const float* __restrict__ a, const float* __restrict__ b,
                     float* __restrict__ da, __nv_bfloat16* __restrict__ dbb, float* __restrict__ part, int rows,
                     int cols, int iters) { ERASE_PDL_ENTER();
    ew_mul_grad_bf16_body<float, float>(dy, a, b, da, dbb, part, rows, cols, iters);
}

// The same with b in bf16 (`_b16`: the cross layer's up-projection stored in bf16, read to
// make the other factor's gradient da = dy ⊙ b).
ERASE_KERNEL void __launch_bounds__(256)
    ew_mul_grad_bf16_b16(const float* __restrict__ dy, const float* __restrict__ a,
                         const __nv_bfloat16* __restrict__ b, float* __restrict__ da,
                         __nv_bfloat16* __restrict__ dbb, float* __restrict__ part, int rows, int cols, int iters) {
    ERASE_PDL_ENTER();
    ew_mul_grad_bf16_body<float, __nv_bfloat16>(dy, a, b, da, dbb, part, rows, cols, iters);
}

// The same with a in bf16 too (`_a16_b16`: the cross layer's x0 read from its copy,
// Graph::set_bf16_cross): db = dy ⊙ a of the rounded a, the product the forward used.
ERASE_KERNEL void __launch_bounds__(256)
    ew_mul_grad_bf16_a16_b16(const float* __restrict__ dy, const __nv_bfloat16* __restrict__ a,
                             const __nv_bfloat16* __restrict__ b, float* __restrict__ da,
                             __nv_bfloat16* __restrict__ dbb, float* __restrict__ part, int rows, int cols,
                             int iters) {
    ERASE_PDL_ENTER();
    ew_mul_grad_bf16_body<__nv_bfloat16, __nv_bfloat16>(dy, a, b, da, dbb, part, rows, cols, iters);
}

// The same with dy added to da (`_dy`: the first cross layer's update x0 ⊙ v + x0, its two
// contributions to x0 in one tensor; Op::MulGrad { plus_dy }).
ERASE_KERNEL void __launch_bounds__(256)
    ew_mul_grad_bf16_a16_b16_dy(const float* __restrict__ dy, const __nv_bfloat16* __restrict__ a,
                                const __nv_bfloat16* __restrict__ b, float* __restrict__ da,
                                __nv_bfloat16* __restrict__ dbb, float* __restrict__ part, int rows, int cols,
                                int iters) {
    ERASE_PDL_ENTER();
    ew_mul_grad_bf16_body<__nv_bfloat16, __nv_bfloat16, true>(dy, a, b, da, dbb, part, rows, cols, iters);
}

// ---- unary maps ------------------------------------------------------------------------

ERASE_KERNEL void ew_scale(const float* __restrict__ x, float* __restrict__ y, long long n, float f) { ERASE_PDL_ENTER();
    EW_LOOP(i, n) y[i] = erase_mul(x[i], f);
}

ERASE_KERNEL void ew_relu(const float* __restrict__ x, float* __restrict__ y, long long n) { ERASE_PDL_ENTER();
    EW_LOOP(i, n) {
        const float v = x[i];
        y[i] = v > 0.0f ? v : 0.0f;  // NaN and -0 give +0, as the reference
    }
}

// The tanh approximation, term for term as ops/src/cpu/kernels.rs::gelu (f32 constants
// rounded from the same f64 values).
#define GELU_C ((float)0.7978845608028654)  // f64 -> f32, as T::from_f64
#define GELU_A ((float)0.044715)

__device__ __forceinline__ float gelu_f(float x) {
    const float x3 = erase_mul(erase_mul(erase_mul(GELU_A, x), x), x);
    const float u = erase_mul(GELU_C, erase_add(x, x3));
    return erase_mul(erase_mul(0.5f, x), erase_add(1.0f, tanhf(u)));
}

__device__ __forceinline__ float gelu_grad_f(float x) {
    const float x3 = erase_mul(erase_mul(erase_mul(GELU_A, x), x), x);
    const float u = erase_mul(GELU_C, erase_add(x, x3));
    const float t = tanhf(u);
    const float a3 = erase_mul(3.0f, GELU_A);
    const float left = erase_mul(0.5f, erase_add(1.0f, t));
    const float sech2 = erase_sub(1.0f, erase_mul(t, t));
    const float inner = erase_add(1.0f, erase_mul(erase_mul(a3, x), x));
    const float right = erase_mul(erase_mul(erase_mul(erase_mul(0.5f, x), sech2), GELU_C), inner);
    return erase_add(left, right);
}

ERASE_KERNEL void ew_gelu(const float* __restrict__ x, float* __restrict__ y, long long n) { ERASE_PDL_ENTER();
    EW_LOOP(i, n) y[i] = gelu_f(x[i]);
}

ERASE_KERNEL void ew_sigmoid(const float* __restrict__ x, float* __restrict__ y, long long n) { ERASE_PDL_ENTER();
    EW_LOOP(i, n) y[i] = erase_sigmoid(x[i]);
}

// SiLU (swish): y = x · sigmoid(x)
ERASE_KERNEL void ew_silu(const float* __restrict__ x, float* __restrict__ y, long long n) { ERASE_PDL_ENTER();
    EW_LOOP(i, n) {
        const float v = x[i];
        y[i] = erase_mul(v, erase_sigmoid(v));
    }
}

// dx = dy · s · (1 + x · (1 - s)), s = sigmoid(x), term for term as the reference
ERASE_KERNEL void ew_silu_grad(const float* __restrict__ dy, const float* __restrict__ x, float* __restrict__ dx,
                               long long n) { ERASE_PDL_ENTER();
    EW_LOOP(i, n) {
        const float v = x[i];
        const float s = erase_sigmoid(v);
        const float d = erase_mul(s, erase_add(1.0f, erase_mul(v, erase_sub(1.0f, s))));
        dx[i] = erase_mul(dy[i], d);
    }
}

// dx = y > 0 ? dy : 0 (`y` is relu's output)
ERASE_KERNEL void ew_relu_grad(const float* __restrict__ dy, const float* __restrict__ y, float* __restrict__ dx,
                               long long n) { ERASE_PDL_ENTER();
    EW_LOOP(i, n) dx[i] = y[i] > 0.0f ? dy[i] : 0.0f;
}

// dx = dy · gelu'(x)
ERASE_KERNEL void ew_gelu_grad(const float* __restrict__ dy, const float* __restrict__ x, float* __restrict__ dx,
                               long long n) { ERASE_PDL_ENTER();
    EW_LOOP(i, n) dx[i] = erase_mul(dy[i], gelu_grad_f(x[i]));
}

// dx = dy · y · (1 - y) (`y` is the sigmoid's output)
ERASE_KERNEL void ew_sigmoid_grad(const float* __restrict__ dy, const float* __restrict__ y,
                                  float* __restrict__ dx, long long n) { ERASE_PDL_ENTER();
    EW_LOOP(i, n) {
        const float s = y[i];
        dx[i] = erase_mul(erase_mul(dy[i], s), erase_sub(1.0f, s));
    }
}

// ---- casts -----------------------------------------------------------------------------
// Element type codes: 0 f32, 1 bf16 (stored as its 16 bits), 2 i32. f32 -> bf16 rounds to
// nearest even (NaN stays NaN), float -> i32 truncates and saturates with NaN -> 0 (PTX
// cvt.rzi.sat, which is Rust's `as`), i32 -> bf16 rounds the exact integer once.

__device__ __forceinline__ float cast_load_f32(const void* x, long long i, int from) {
    if (from == 0) return ((const float*)x)[i];
    if (from == 1) return __uint_as_float((unsigned)((const unsigned short*)x)[i] << 16);
    return (float)((const int*)x)[i];
}

ERASE_KERNEL void ew_cast(const void* __restrict__ x, void* __restrict__ y, long long n, int from, int to) { ERASE_PDL_ENTER();
    EW_LOOP(i, n) {
        if (to == 1) {
            __nv_bfloat16 b;
            if (from == 2)
                b = __int2bfloat16_rn(((const int*)x)[i]);
            else
                b = __float2bfloat16_rn(cast_load_f32(x, i, from));
            ((__nv_bfloat16*)y)[i] = b;
        } else if (to == 2) {
            ((int*)y)[i] = from == 2 ? ((const int*)x)[i] : __float2int_rz(cast_load_f32(x, i, from));
        } else {
            ((float*)y)[i] = cast_load_f32(x, i, from);
        }
    }
}

// ---- n-ary gradient sum ----------------------------------------------------------------

// The sum of gradient contributions (GradSum: one row, w = ld = n) or the window of one
// (SliceSum): for i < n (n a multiple of w), row r = i / w, column c = i % w:
// y[i] = p0[r·ld0 + off0 + c] + p1[r·ld + off + c] + .. + p_{k-1}[..], left to right
// (k <= 8). A chained call (more than 8 contributions) passes the
// running sum y as p0 with ld0 = w, off0 = 0: each element is read and written by one
// thread. With V = 4 every index is in float4 units (n, w, the strides and offsets
// multiples of 4, as the plan checks; the arena aligns tensors to 256 bytes).
template <int V>
struct SliceSumLane {
    using T = float;
};
template <>
struct SliceSumLane<4> {
    using T = float4;
};
template <int V>
__device__ __forceinline__ void slice_sum_body(float* y, long long n, long long w, long long ld0, long long off0,
                                               long long ld, long long off, int k, const float* p0,
                                               const float* p1, const float* p2, const float* p3,
                                               const float* p4, const float* p5, const float* p6,
                                               const float* p7) {
    using T = typename SliceSumLane<V>::T;
    const T* q[8] = {reinterpret_cast<const T*>(p0), reinterpret_cast<const T*>(p1), reinterpret_cast<const T*>(p2),
                     reinterpret_cast<const T*>(p3), reinterpret_cast<const T*>(p4), reinterpret_cast<const T*>(p5),
                     reinterpret_cast<const T*>(p6), reinterpret_cast<const T*>(p7)};
    // the whole tensor (grad_sum: one row, no offsets): every index is i, no division
    const bool flat = w == ld && ld0 == ld && off == 0 && off0 == 0;
    EW_LOOP(i, n / V) {
        const long long r = flat ? 0 : i / (w / V), c = i - r * (w / V);
        const long long j = flat ? i : r * (ld / V) + off / V + c;
        T v[8];
        v[0] = q[0][flat ? i : r * (ld0 / V) + off0 / V + c];
#pragma unroll
        for (int e = 1; e < 8; ++e)
            if (e < k) v[e] = q[e][j];
        T s = v[0];
#pragma unroll
        for (int e = 1; e < 8; ++e) {
            if (e >= k) break;
            if constexpr (V == 4) {
                s.x = erase_add(s.x, v[e].x);
                s.y = erase_add(s.y, v[e].y);
                s.z = erase_add(s.z, v[e].z);
                s.w = erase_add(s.w, v[e].w);
            } else {
                s = erase_add(s, v[e]);
            }
        }
        reinterpret_cast<T*>(y)[i] = s;
    }
}

#define EW_SLICE_SUM_ARGS                                                                                  \
    float *y, long long n, long long w, long long ld0, long long off0, long long ld, long long off, int k, \
        const float *p0, const float *p1, const float *p2, const float *p3, const float *p4, const float *p5, \
        const float *p6, const float *p7
ERASE_KERNEL void ew_slice_sum(EW_SLICE_SUM_ARGS) { ERASE_PDL_ENTER();
    slice_sum_body<1>(y, n, w, ld0, off0, ld, off, k, p0, p1, p2, p3, p4, p5, p6, p7);
}
ERASE_KERNEL void ew_slice_sum4(EW_SLICE_SUM_ARGS) { ERASE_PDL_ENTER();
    slice_sum_body<4>(y, n, w, ld0, off0, ld, off, k, p0, p1, p2, p3, p4, p5, p6, p7);
}

// ---- fills and the step counter --------------------------------------------------------

// y[i] = s[0] · scale (the gradient of sum/mean)
ERASE_KERNEL void ew_fill_scaled(const float* __restrict__ s, float* __restrict__ y, long long n, float scale) { ERASE_PDL_ENTER();
    const float v = erase_mul(__ldg(s), scale);
    EW_LOOP(i, n) y[i] = v;
}

// y[i] = v (32-bit words: zero fill of f32 or i32)
ERASE_KERNEL void ew_fill_u32(unsigned* __restrict__ y, long long n, unsigned v) { ERASE_PDL_ENTER();
    EW_LOOP(i, n) y[i] = v;
}

// step += 1, saturating (one i32)
ERASE_KERNEL void step_increment(int* step) { ERASE_PDL_ENTER();
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        const int s = *step;
        *step = s == 0x7fffffff ? s : s + 1;
    }
}

// ---- copies: reshape/detach, concat, slice, pad ----------------------------------------
// Instantiated for 32-bit (f32, i32) and 16-bit (bf16) elements.

template <typename T>
__device__ __forceinline__ void copy_flat(const T* __restrict__ x, T* __restrict__ y, long long n) {
    EW_LOOP(i, n) y[i] = x[i];
}

// For o < outer and c < chunk: y[o·dst_row + dst_off + c] = x[o·src_row + src_off + c].
// Concat places each input (chunk = its axis length · inner) into the output row; slice
// takes a chunk out of each input row.
template <typename T>
__device__ __forceinline__ void copy_rows(const T* __restrict__ x, T* __restrict__ y, long long outer, long long chunk,
                                          long long src_row, long long src_off, long long dst_row, long long dst_off) {
    if (chunk <= 0) return;
    const long long n = outer * chunk;
    EW_LOOP(i, n) {
        const long long o = erase_udiv(i, chunk), c = i - o * chunk;
        y[o * dst_row + dst_off + c] = x[o * src_row + src_off + c];
    }
}

// Every element of y [outer, dst_row]: x's row chunk at `off`, zero elsewhere.
template <typename T>
__device__ __forceinline__ void pad_rows(const T* __restrict__ x, T* __restrict__ y, long long outer, long long dst_row,
                                         long long chunk, long long off) {
    if (dst_row <= 0) return;
    const long long n = outer * dst_row;
    EW_LOOP(i, n) {
        const long long o = erase_udiv(i, dst_row), c = i - o * dst_row - off;
        y[i] = (c >= 0 && c < chunk) ? x[o * chunk + c] : (T)0;
    }
}

// Concat and Split in one launch for up to EW_PARTS parts: the big tensor's rows hold the
// parts' rows side by side in columns [big_off, big_off + Σ c_j) of each of its `outer`
// rows (row length big_row); part j is [outer, c_j]. split = 0 copies the parts into the
// big rows (concat), 1 the big rows into the parts (split). A thread per element of the
// covered columns, found by a scan over the parts' widths (unrolled: the pointers stay
// in registers); the big tensor's side is coalesced. Widths, offsets and rows count
// elements of T (ew_parts_rows_u128 moves 16-byte units).
#define EW_PARTS 8
#define EW_PART_PARAMS(T, j) T* __restrict__ p##j, long long c##j

// What a concat does with each unit it writes besides writing it: nothing, or write
// its bf16 copy at the same index (the copy a GEMM reads, see ew_parts_rows_f32_bf16).
struct EwNoCopy {
    template <typename T>
    __device__ __forceinline__ void operator()(long long, const T&) const {}
};
struct EwBf16Copy {
    uint2* copy;
    __device__ __forceinline__ void operator()(long long at, const float4& v) const { copy[at] = ew_bf16x4(v); }
};

// BIG false: the big tensor is not written (a concat stored in its bf16 copy alone; big is
// only an index base then).
template <typename T, typename Copy = EwNoCopy, bool BIG = true>
__device__ __forceinline__ void parts_rows(T* big, long long outer, long long big_row, long long big_off, int split,
                                           int count, T* const (&p)[EW_PARTS], const long long (&c)[EW_PARTS],
                                           Copy copy = Copy()) {
    long long width = 0;
#pragma unroll
    for (int j = 0; j < EW_PARTS; ++j)
        if (j < count) width += c[j];
    if (width <= 0) return;
    const long long n = outer * width;
    EW_LOOP(i, n) {
        const long long o = erase_udiv(i, width), col = i - o * width;
        T* q = p[0];
        long long ch = c[0], start = 0, acc = 0;
#pragma unroll
        for (int j = 0; j < EW_PARTS; ++j) {
            if (j < count && col >= acc) {
                q = p[j];
                ch = c[j];
                start = acc;
            }
            if (j < count) acc += c[j];
        }
        const long long at = o * big_row + big_off + col;
        T* s = q + o * ch + (col - start);
        if constexpr (BIG) {
            T* b = big + at;
            if (split) {
                *s = *b;
            } else {
                const T v = *s;
                *b = v;
                copy(at, v);
            }
        } else {
            copy(at, *s);
        }
    }
}

// Concat of f32 parts in float4 units (every width and offset a multiple of 4 floats)
// that also writes the big tensor's bf16 copy (uint2 units at the same index): the field
// embeddings E and the copy the GEMMs read, in one pass. Arguments as
// ew_parts_rows_u128's (concat only, no `split`), with the copy second.
ERASE_KERNEL void ew_parts_rows_f32_bf16(float4* big, uint2* copy, long long outer, long long big_row,
                                         long long big_off, int count, EW_PART_PARAMS(float4, 0),
                                         EW_PART_PARAMS(float4, 1), EW_PART_PARAMS(float4, 2),
                                         EW_PART_PARAMS(float4, 3), EW_PART_PARAMS(float4, 4),
                                         EW_PART_PARAMS(float4, 5), EW_PART_PARAMS(float4, 6),
                                         EW_PART_PARAMS(float4, 7)) { ERASE_PDL_ENTER();
    float4* const p[EW_PARTS] = {p0, p1, p2, p3, p4, p5, p6, p7};
    const long long c[EW_PARTS] = {c0, c1, c2, c3, c4, c5, c6, c7};
    parts_rows(big, outer, big_row, big_off, 0, count, p, c, EwBf16Copy{copy});
}

// The same concat stored in bf16 alone (`Graph::concat_stored`: DCNv2's x0, which only
// GEMMs and the cross updates read, from their bf16 copies): the copy written, the f32
// tensor not. Arguments as ew_parts_rows_f32_bf16's without `big`.
ERASE_KERNEL void ew_parts_rows_f32_to_bf16(uint2* copy, long long outer, long long big_row, long long big_off,
                                            int count, EW_PART_PARAMS(float4, 0), EW_PART_PARAMS(float4, 1),
                                            EW_PART_PARAMS(float4, 2), EW_PART_PARAMS(float4, 3),
                                            EW_PART_PARAMS(float4, 4), EW_PART_PARAMS(float4, 5),
                                            EW_PART_PARAMS(float4, 6), EW_PART_PARAMS(float4, 7)) { ERASE_PDL_ENTER();
    float4* const p[EW_PARTS] = {p0, p1, p2, p3, p4, p5, p6, p7};
    const long long c[EW_PARTS] = {c0, c1, c2, c3, c4, c5, c6, c7};
    parts_rows<float4, EwBf16Copy, false>(nullptr, outer, big_row, big_off, 0, count, p, c, EwBf16Copy{copy});
}

#define EW_PARTS_KERNEL(NAME, T)                                                                                   \
    ERASE_KERNEL void NAME(T* big, long long outer, long long big_row, long long big_off, int split, int count,     \
                           EW_PART_PARAMS(T, 0), EW_PART_PARAMS(T, 1), EW_PART_PARAMS(T, 2), EW_PART_PARAMS(T, 3), \
                           EW_PART_PARAMS(T, 4), EW_PART_PARAMS(T, 5), EW_PART_PARAMS(T, 6),                      \
                           EW_PART_PARAMS(T, 7)) { ERASE_PDL_ENTER();                                              \
        T* const p[EW_PARTS] = {p0, p1, p2, p3, p4, p5, p6, p7};                                                  \
        const long long c[EW_PARTS] = {c0, c1, c2, c3, c4, c5, c6, c7};                                           \
        parts_rows(big, outer, big_row, big_off, split, count, p, c);                                              \
    }
EW_PARTS_KERNEL(ew_parts_rows_u32, unsigned)
EW_PARTS_KERNEL(ew_parts_rows_u16, unsigned short)
// 16-byte units, when every width and offset is a multiple of 16 bytes (the plan decides)
EW_PARTS_KERNEL(ew_parts_rows_u128, uint4)

ERASE_KERNEL void ew_copy_u32(const unsigned* __restrict__ x, unsigned* __restrict__ y, long long n) { ERASE_PDL_ENTER();
    copy_flat(x, y, n);
}
ERASE_KERNEL void ew_copy_u16(const unsigned short* __restrict__ x, unsigned short* __restrict__ y, long long n) { ERASE_PDL_ENTER();
    copy_flat(x, y, n);
}
ERASE_KERNEL void ew_copy_rows_u32(const unsigned* __restrict__ x, unsigned* __restrict__ y, long long outer,
                                   long long chunk, long long src_row, long long src_off, long long dst_row,
                                   long long dst_off) { ERASE_PDL_ENTER();
    copy_rows(x, y, outer, chunk, src_row, src_off, dst_row, dst_off);
}
ERASE_KERNEL void ew_copy_rows_u16(const unsigned short* __restrict__ x, unsigned short* __restrict__ y,
                                   long long outer, long long chunk, long long src_row, long long src_off,
                                   long long dst_row, long long dst_off) { ERASE_PDL_ENTER();
    copy_rows(x, y, outer, chunk, src_row, src_off, dst_row, dst_off);
}
ERASE_KERNEL void ew_pad_rows_u32(const unsigned* __restrict__ x, unsigned* __restrict__ y, long long outer,
                                  long long dst_row, long long chunk, long long off) { ERASE_PDL_ENTER();
    pad_rows(x, y, outer, dst_row, chunk, off);
}
ERASE_KERNEL void ew_pad_rows_u16(const unsigned short* __restrict__ x, unsigned short* __restrict__ y,
                                  long long outer, long long dst_row, long long chunk, long long off) { ERASE_PDL_ENTER();
    pad_rows(x, y, outer, dst_row, chunk, off);
}
