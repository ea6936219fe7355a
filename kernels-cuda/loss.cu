// Losses and full reductions: mean BCE with logits, mean softmax cross-entropy, sum and
// mean of a tensor, and the gradients of the two losses.
//
// The reference (ops/src/cpu/kernels.rs) accumulates these scalars in f64, so the GPU
// does too, in a fixed order, in two passes:
//  loss_partial (mode 0: x, mode 1: the BCE term of (x, y)) and loss_partial_f64 (f64
//    row losses): G CTAs of 256 threads; thread t of CTA g sums elements
//    g·256 + t + k·G·256 in k order in f64, the CTA adds its threads with the fixed
//    shuffle tree and writes part[g]. G depends only on n (the plan picks it).
//  loss_final: one CTA adds the G partials (strided per thread, then the tree), divides
//    by n for a mean in f64 and rounds once to f32.
//  softmax_xent_rows: one warp per row: the row max, Σ exp(x - max) in f64 (lanes strided
//    over the classes, then the tree) and the row's loss max + ln z - x[label] in f64.
// The result equals the reference's to f64 rounding differences (~1e-16 relative), which
// almost always round to the same f32. Bound: memory (4-8 bytes per element) plus f64
// exp/log1p (full rate on an H200; batch-sized inputs are latency-bound anyway).
//
// Gradients (elementwise / one warp per row, in f32 like the reference):
//  bce_grad: dx = (sigmoid(x) - y) · (dloss / n).
//  softmax_xent_grad: dx = (softmax(x) - onehot(label)) · (dloss / rows), the row max
//    and Σ exp by a warp (fixed tree). An out-of-range label writes NaN for its row's
//    loss (and no one-hot in the gradient); the CPU path reports it as an error.
#include "common.cuh"

#define LOSS_THREADS 256

__device__ __forceinline__ double bce_term(float xf, float yf) {
    const double x = xf, y = yf;
    return fmax(x, 0.0) - x * y + log1p(exp(-fabs(x)));
}

ERASE_KERNEL void loss_partial(const float* __restrict__ x, const float* __restrict__ y, long long n, int mode,
                               double* __restrict__ part) { ERASE_PDL_ENTER();
    __shared__ double sh[32];
    double s = 0.0;
    for (long long i = erase_gtid(); i < n; i += erase_gstride())
        s += mode == 1 ? bce_term(x[i], y[i]) : (double)x[i];
    s = erase_block_sum_f64(s, sh);
    if (threadIdx.x == 0) part[blockIdx.x] = s;
}

ERASE_KERNEL void loss_partial_f64(const double* __restrict__ x, long long n, double* __restrict__ part) { ERASE_PDL_ENTER();
    __shared__ double sh[32];
    double s = 0.0;
    for (long long i = erase_gtid(); i < n; i += erase_gstride()) s += x[i];
    s = erase_block_sum_f64(s, sh);
    if (threadIdx.x == 0) part[blockIdx.x] = s;
}

// out[0] = f32(Σ part / n) when `mean` (0/0 = NaN for an empty input, as the reference),
// else f32(Σ part). One CTA.
ERASE_KERNEL void loss_final(const double* __restrict__ part, int g, float* __restrict__ out, int mean, long long n) { ERASE_PDL_ENTER();
    __shared__ double sh[32];
    double s = 0.0;
    for (int i = threadIdx.x; i < g; i += blockDim.x) s += part[i];
    s = erase_block_sum_f64(s, sh);
    if (threadIdx.x == 0) out[0] = (float)(mean ? s / (double)n : s);
}

// row_loss[r] = max + ln Σ exp(x - max) - x[label] in f64, one warp per row.
ERASE_KERNEL void softmax_xent_rows(const float* __restrict__ logits, const int* __restrict__ labels,
                                    double* __restrict__ row_loss, long long rows, int c) { ERASE_PDL_ENTER();
    const int lane = threadIdx.x & 31;
    const long long warps = (long long)gridDim.x * (blockDim.x >> 5);
    for (long long r = erase_gtid() >> 5; r < rows; r += warps) {
        const float* xr = logits + r * c;
        float mx = -INFINITY;
        for (int k = lane; k < c; k += 32) mx = fmaxf(mx, xr[k]);
        const double m = (double)erase_warp_max(mx);
        double z = 0.0;
        for (int k = lane; k < c; k += 32) z += exp((double)xr[k] - m);
        z = erase_warp_sum_f64(z);
        if (lane == 0) {
            const int l = labels[r];
            row_loss[r] = (l >= 0 && l < c) ? m + log(z) - (double)xr[l] : (double)NAN;
        }
    }
}

ERASE_KERNEL void bce_grad(const float* __restrict__ dloss, const float* __restrict__ x,
                           const float* __restrict__ y, float* __restrict__ dx, long long n) { ERASE_PDL_ENTER();
    const float scale = erase_div(__ldg(dloss), (float)n);
    for (long long i = erase_gtid(); i < n; i += erase_gstride())
        dx[i] = erase_mul(erase_sub(erase_sigmoid(x[i]), y[i]), scale);
}

ERASE_KERNEL void softmax_xent_grad(const float* __restrict__ dloss, const float* __restrict__ logits,
                                    const int* __restrict__ labels, float* __restrict__ dx, long long rows, int c) { ERASE_PDL_ENTER();
    const int lane = threadIdx.x & 31;
    const long long warps = (long long)gridDim.x * (blockDim.x >> 5);
    const float scale = erase_div(__ldg(dloss), (float)rows);
    for (long long r = erase_gtid() >> 5; r < rows; r += warps) {
        const float* xr = logits + r * c;
        float mx = -INFINITY;
        for (int k = lane; k < c; k += 32) mx = fmaxf(mx, xr[k]);
        mx = erase_warp_max(mx);
        float z = 0.0f;
        for (int k = lane; k < c; k += 32) z += expf(erase_sub(xr[k], mx));
        z = erase_warp_sum(z);
        const int l = labels[r];
        float* dr = dx + r * c;
        for (int k = lane; k < c; k += 32) {
            const float p = erase_div(expf(erase_sub(xr[k], mx)), z);
            dr[k] = erase_mul(erase_sub(p, k == l ? 1.0f : 0.0f), scale);
        }
    }
}
