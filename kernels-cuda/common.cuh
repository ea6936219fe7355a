// Shared helpers of Erase's kernels. Every kernel is `extern "C"` so the runtime finds it
// by name in the PTX; every kernel takes its sizes as arguments and guards its bounds.
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

#define ERASE_KERNEL extern "C" __global__

// The first statement of every kernel. On sm_90 the runtime may launch kernels with
// programmatic stream serialization (`ERASE_PDL`): a kernel may then be launched before
// the one before it on its stream has finished. `griddepcontrol.wait` holds every thread
// until the grids it depends on have completed and their writes are visible, so nothing
// a kernel reads or writes races with its predecessor. Where `erase_pdl_early` (set by
// the runtime when it loads the module) is 1, `launch_dependents` then lets the next
// kernel of the stream launch while this one runs; else the next launches when this
// one's CTAs have all exited. Without the launch attribute (sm_80, `ERASE_PDL=0`) the
// wait returns at once.
__constant__ int erase_pdl_early;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define ERASE_PDL_ENTER()                                                                  \
    do {                                                                                   \
        asm volatile("griddepcontrol.wait;\n" ::: "memory");                              \
        if (erase_pdl_early) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory"); \
    } while (0)
#else
#define ERASE_PDL_ENTER() \
    do {                  \
    } while (0)
#endif

// Round an f32 to bf16 (round to nearest even) and back: what a bf16 GEMM operand holds.
__device__ __forceinline__ float erase_round_bf16(float x) {
    return __bfloat162float(__float2bfloat16_rn(x));
}

// Sum over a warp, the same tree on every call (deterministic).
__device__ __forceinline__ float erase_warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float erase_warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over a block of blockDim.x threads (a multiple of 32, at most 1024) in a fixed
// order; `scratch` holds 32 floats of shared memory. Every thread gets the result.
__device__ __forceinline__ float erase_block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    v = erase_warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = (threadIdx.x < warps) ? scratch[threadIdx.x] : 0.0f;
    if (warp == 0) v = erase_warp_sum(v);
    if (threadIdx.x == 0) scratch[0] = v;
    __syncthreads();
    v = scratch[0];
    __syncthreads();
    return v;
}

// ---- indexing ------------------------------------------------------------------------

// This thread's index in the whole grid (x only) and the grid's width, in 64 bits: loops
// over tensors of any size stride by the grid ("grid-stride loops").
__device__ __forceinline__ long long erase_gtid() {
    return (long long)blockIdx.x * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ long long erase_gstride() {
    return (long long)gridDim.x * blockDim.x;
}

// `a / b` for non-negative `a`, positive `b`: 32-bit division when both fit (several
// times cheaper than 64-bit division, which shapes of fewer than 2^32 elements never need).
__device__ __forceinline__ long long erase_udiv(long long a, long long b) {
    if (((unsigned long long)a | (unsigned long long)b) >> 32 == 0)
        return (long long)((unsigned)a / (unsigned)b);
    return a / b;
}

// ---- IEEE arithmetic without contraction ----------------------------------------------
// nvcc fuses `a * b + c` into one FMA; the CPU reference rounds the product first. Where
// a kernel should reproduce the reference to the bit (elementwise maps, optimizers), it
// writes the operations with these round-to-nearest intrinsics, which are never fused.
__device__ __forceinline__ float erase_mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float erase_add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float erase_sub(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ float erase_div(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ float erase_sqrt(float a) { return __fsqrt_rn(a); }

// The logistic function exactly as the CPU reference writes it (no overflow either side).
__device__ __forceinline__ float erase_sigmoid(float x) {
    if (x >= 0.0f) return erase_div(1.0f, erase_add(1.0f, expf(-x)));
    const float e = expf(x);
    return erase_div(e, erase_add(1.0f, e));
}

// ---- double-precision reductions (losses accumulate in f64, as the reference does) ----

__device__ __forceinline__ double erase_warp_sum_f64(double v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum over a block of blockDim.x threads (a multiple of 32, at most 1024) in a fixed
// order; `scratch` holds 32 doubles of shared memory. Every thread gets the result.
__device__ __forceinline__ double erase_block_sum_f64(double v, double* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    v = erase_warp_sum_f64(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = (threadIdx.x < warps) ? scratch[threadIdx.x] : 0.0;
    if (warp == 0) v = erase_warp_sum_f64(v);
    if (threadIdx.x == 0) scratch[0] = v;
    __syncthreads();
    v = scratch[0];
    __syncthreads();
    return v;
}

// An f64 hyper-parameter passed bit for bit as an i64 launch argument (launch arguments
// are 32-bit floats at most; bias corrections need the f64 the reference uses).
__device__ __forceinline__ double erase_f64_from_bits(long long bits) {
    return __longlong_as_double(bits);
}

// `a^n` for an integer `n` by the square-and-multiply loop of compiler-rt's `__powidf2`,
// which Rust's `f64::powi` calls at run time: the same products in the same order, so the
// same bits.
__device__ __forceinline__ double erase_powi(double a, int n) {
    const bool recip = n < 0;
    double r = 1.0;
    for (;;) {
        if (n & 1) r *= a;
        n /= 2;
        if (n == 0) break;
        a *= a;
    }
    return recip ? 1.0 / r : r;
}

// The column-sum partials of a CTA of 256 threads laid out as gemm_round_colsum's: thread
// t holds in acc[e] its running sums of column 64·blockIdx.x + 8·(t % 8) + e over its
// rows (row lane t / 8). The 32 row lanes' sums are added in lane order into
// part[blockIdx.y·cols + c] (colsum_final then adds the slices in order). `lanes` is
// the CTA's shared [32][65] floats.
__device__ __forceinline__ void erase_colsum_partials(float (&lanes)[32][65], const float (&acc)[8],
                                                      float* __restrict__ part, int cols) {
    const int tid = threadIdx.x, ch = tid & 7, y = tid >> 3;
#pragma unroll
    for (int e = 0; e < 8; ++e) lanes[y][ch * 8 + e] = acc[e];
    __syncthreads();
    if (tid < 64 && blockIdx.x * 64 + tid < cols) {
        float t = 0.f;
        for (int q = 0; q < 32; ++q) t += lanes[q][tid];
        part[static_cast<long long>(blockIdx.y) * cols + blockIdx.x * 64 + tid] = t;
    }
}
