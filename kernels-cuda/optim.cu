// Dense optimizers over all parameters in one launch: Adam (PyTorch's form, as
// ops/src/cpu/kernels.rs::adam) and SGD.
//
// Launch arguments are scalars and pointers only, so the parameter list travels through a
// table in scratch memory: optim_table_build (one tiny launch per 32 tensors, before the
// update) writes one OptRec per tensor from its arguments; the update kernel then reads
// the table. Every tensor is cut into chunks of OPT_CHUNK elements; chunk_start is the
// index of a tensor's first chunk in the concatenation of all tensors' chunks.
//
// adam_multi_tensor / sgd_multi_tensor: one 256-thread CTA per chunk (grid = total
// chunks); warp 0 finds the chunk's tensor in the table (opt_find_warp). Adam: thread t
// updates elements 4t .. 4t+3 of the chunk, all its loads issued before its stores; SGD:
// elements t, t+256, t+512, t+768. Adam's bias
// corrections come from the step counter in device memory (never a launch argument, so a
// captured graph replays correctly): bc1 = 1 - β1^step, bc2 = 1 - β2^step in f64 with the
// same square-and-multiply powi as Rust, step size lr/bc1 and sqrt(bc2) rounded to f32,
// then the f32 update written without FMA contraction: the result is bit-identical to the
// CPU reference. A record with a bf16 copy (c, Leaf::ParamCopy: the copy the step's GEMMs
// read) also gets the updated parameter rounded to bf16 (nearest even) there, in the same
// pass. Bound: memory (Adam 28 bytes per element, 30 with a copy; SGD 12).
#include "common.cuh"

#define OPT_CHUNK 1024
#define OPT_THREADS 256

struct OptRec {
    float* p;
    const float* g;
    float* m;
    float* v;
    __nv_bfloat16* c;  // the parameter's bf16 copy, or null (Adam only)
    long long numel;
    long long chunk_start;
};

#define OPT_REC_PARAMS(k) \
    float *p##k, const float *g##k, float *m##k, float *v##k, __nv_bfloat16 *b##k, long long n##k, long long c##k
#define OPT_REC_SET(k)                                                  \
    if (threadIdx.x == k && k < count) {                                \
        OptRec r;                                                       \
        r.p = p##k;                                                     \
        r.g = g##k;                                                     \
        r.m = m##k;                                                     \
        r.v = v##k;                                                     \
        r.c = b##k;                                                     \
        r.numel = n##k;                                                 \
        r.chunk_start = c##k;                                           \
        table[first + k] = r;                                           \
    }

// table[first + k] = record k, for k < count (<= 32). One CTA of 32 threads.
ERASE_KERNEL void optim_table_build(OptRec* table, int first, int count, OPT_REC_PARAMS(0), OPT_REC_PARAMS(1), OPT_REC_PARAMS(2), OPT_REC_PARAMS(3), OPT_REC_PARAMS(4), OPT_REC_PARAMS(5), OPT_REC_PARAMS(6), OPT_REC_PARAMS(7), OPT_REC_PARAMS(8), OPT_REC_PARAMS(9), OPT_REC_PARAMS(10), OPT_REC_PARAMS(11), OPT_REC_PARAMS(12), OPT_REC_PARAMS(13), OPT_REC_PARAMS(14), OPT_REC_PARAMS(15), OPT_REC_PARAMS(16), OPT_REC_PARAMS(17), OPT_REC_PARAMS(18), OPT_REC_PARAMS(19), OPT_REC_PARAMS(20), OPT_REC_PARAMS(21), OPT_REC_PARAMS(22), OPT_REC_PARAMS(23), OPT_REC_PARAMS(24), OPT_REC_PARAMS(25), OPT_REC_PARAMS(26), OPT_REC_PARAMS(27), OPT_REC_PARAMS(28), OPT_REC_PARAMS(29), OPT_REC_PARAMS(30), OPT_REC_PARAMS(31)) { ERASE_PDL_ENTER();
    OPT_REC_SET(0) OPT_REC_SET(1) OPT_REC_SET(2) OPT_REC_SET(3) OPT_REC_SET(4) OPT_REC_SET(5) OPT_REC_SET(6) OPT_REC_SET(7) OPT_REC_SET(8) OPT_REC_SET(9) OPT_REC_SET(10) OPT_REC_SET(11) OPT_REC_SET(12) OPT_REC_SET(13) OPT_REC_SET(14) OPT_REC_SET(15) OPT_REC_SET(16) OPT_REC_SET(17) OPT_REC_SET(18) OPT_REC_SET(19) OPT_REC_SET(20) OPT_REC_SET(21) OPT_REC_SET(22) OPT_REC_SET(23) OPT_REC_SET(24) OPT_REC_SET(25) OPT_REC_SET(26) OPT_REC_SET(27) OPT_REC_SET(28) OPT_REC_SET(29) OPT_REC_SET(30) OPT_REC_SET(31)
}

// The tensor that owns chunk `b`: the last record with chunk_start <= b, found by warp 0
// in rounds of 32 records (one load a lane, then a ballot) instead of a chain of
// dependent loads by one thread; records are in chunk_start order.
__device__ __forceinline__ int opt_find_warp(const OptRec* __restrict__ t, int nt, long long b) {
    const int lane = threadIdx.x & 31;
    int count = 0;
    for (int base = 0; base < nt; base += 32) {
        const bool le = base + lane < nt && t[base + lane].chunk_start <= b;
        const unsigned m = __ballot_sync(0xffffffffu, le);
        count += __popc(m);
        if (m != 0xffffffffu) break;  // a record past b, or the end of the table
    }
    return count - 1;
}

// Thread t of chunk b's CTA owns elements e0 + 4t .. e0 + 4t + 3 (float4 loads when the
// tensor's four arrays are 16-byte aligned), loading all of them before any store: a
// thread's 16 loads are in flight at once.
template <typename F>
__device__ __forceinline__ void opt_chunk4(const OptRec& r, long long b, F&& update) {
    const long long e = (b - r.chunk_start) * OPT_CHUNK + 4 * threadIdx.x;
    if (e >= r.numel) return;
    const bool vec = e + 4 <= r.numel &&
                     ((reinterpret_cast<uintptr_t>(r.p) | reinterpret_cast<uintptr_t>(r.g) |
                       reinterpret_cast<uintptr_t>(r.m) | reinterpret_cast<uintptr_t>(r.v)) & 15) == 0;
    float g[4], m[4], v[4], p[4];
    if (vec) {
        const float4 g4 = *reinterpret_cast<const float4*>(r.g + e);
        const float4 m4 = *reinterpret_cast<const float4*>(r.m + e);
        const float4 v4 = *reinterpret_cast<const float4*>(r.v + e);
        const float4 p4 = *reinterpret_cast<const float4*>(r.p + e);
        g[0] = g4.x, g[1] = g4.y, g[2] = g4.z, g[3] = g4.w;
        m[0] = m4.x, m[1] = m4.y, m[2] = m4.z, m[3] = m4.w;
        v[0] = v4.x, v[1] = v4.y, v[2] = v4.z, v[3] = v4.w;
        p[0] = p4.x, p[1] = p4.y, p[2] = p4.z, p[3] = p4.w;
    } else {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const bool in = e + k < r.numel;
            g[k] = in ? r.g[e + k] : 0.f;
            m[k] = in ? r.m[e + k] : 0.f;
            v[k] = in ? r.v[e + k] : 0.f;
            p[k] = in ? r.p[e + k] : 0.f;
        }
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) update(g[k], m[k], v[k], p[k]);
    if (vec) {
        *reinterpret_cast<float4*>(r.m + e) = make_float4(m[0], m[1], m[2], m[3]);
        *reinterpret_cast<float4*>(r.v + e) = make_float4(v[0], v[1], v[2], v[3]);
        *reinterpret_cast<float4*>(r.p + e) = make_float4(p[0], p[1], p[2], p[3]);
    } else {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            if (e + k < r.numel) {
                r.m[e + k] = m[k];
                r.v[e + k] = v[k];
                r.p[e + k] = p[k];
            }
        }
    }
    if (r.c != nullptr) {
        if (vec && (reinterpret_cast<uintptr_t>(r.c) & 7) == 0) {
            const __nv_bfloat162 lo = __floats2bfloat162_rn(p[0], p[1]), hi = __floats2bfloat162_rn(p[2], p[3]);
            *reinterpret_cast<uint2*>(r.c + e) =
                make_uint2(*reinterpret_cast<const unsigned*>(&lo), *reinterpret_cast<const unsigned*>(&hi));
        } else {
#pragma unroll
            for (int k = 0; k < 4; ++k)
                if (e + k < r.numel) r.c[e + k] = __float2bfloat16_rn(p[k]);
        }
    }
}

static_assert(OPT_CHUNK == 4 * OPT_THREADS, "a thread owns four elements of a chunk");

ERASE_KERNEL void adam_multi_tensor(const OptRec* __restrict__ table, int nt, long long total_chunks,
                                    const int* __restrict__ step, long long lr_bits, long long beta1_bits,
                                    long long beta2_bits, float eps) { ERASE_PDL_ENTER();
    __shared__ int s_tensor;
    __shared__ float s_coef[4];  // step_size, bc2_sqrt, beta1, beta2 (f32)
    const long long b = blockIdx.x;
    if (b >= total_chunks) return;
    if (threadIdx.x < 32) {
        const int ti = opt_find_warp(table, nt, b);
        if (threadIdx.x == 0) s_tensor = ti;
    } else if (threadIdx.x == 32) {
        const double lr = erase_f64_from_bits(lr_bits);
        const double b1 = erase_f64_from_bits(beta1_bits), b2 = erase_f64_from_bits(beta2_bits);
        const int st = *step;
        const double bc1 = 1.0 - erase_powi(b1, st);
        const double bc2 = 1.0 - erase_powi(b2, st);
        s_coef[0] = (float)(lr / bc1);
        s_coef[1] = (float)sqrt(bc2);
        s_coef[2] = (float)b1;
        s_coef[3] = (float)b2;
    }
    __syncthreads();
    const int ti = s_tensor;
    if (ti < 0) return;
    const OptRec r = table[ti];
    const float step_size = s_coef[0], bc2_sqrt = s_coef[1], b1 = s_coef[2], b2 = s_coef[3];
    const float omb1 = erase_sub(1.0f, b1), omb2 = erase_sub(1.0f, b2);
    opt_chunk4(r, b, [&](float g, float& m, float& v, float& p) {
        m = erase_add(erase_mul(b1, m), erase_mul(omb1, g));
        v = erase_add(erase_mul(b2, v), erase_mul(erase_mul(omb2, g), g));
        const float denom = erase_add(erase_div(erase_sqrt(v), bc2_sqrt), eps);
        p = erase_sub(p, erase_div(erase_mul(step_size, m), denom));
    });
}

ERASE_KERNEL void sgd_multi_tensor(const OptRec* __restrict__ table, int nt, long long total_chunks, float lr) { ERASE_PDL_ENTER();
    __shared__ int s_tensor;
    const long long b = blockIdx.x;
    if (b >= total_chunks) return;
    if (threadIdx.x < 32) {
        const int ti = opt_find_warp(table, nt, b);
        if (threadIdx.x == 0) s_tensor = ti;
    }
    __syncthreads();
    const int ti = s_tensor;
    if (ti < 0) return;
    const OptRec r = table[ti];
    const long long e0 = (b - r.chunk_start) * OPT_CHUNK;
#pragma unroll
    for (int k = 0; k < OPT_CHUNK / OPT_THREADS; ++k) {
        const long long e = e0 + k * OPT_THREADS + threadIdx.x;
        if (e < r.numel) r.p[e] = erase_sub(r.p[e], erase_mul(lr, r.g[e]));
    }
}
