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
// Bit 6 of the flags, in a kernel that writes C's bf16 copy (COPY), stores the copy alone
// and no f32 C (a linear layer stored in bf16 whose operands are bf16 copies:
// Graph::linear_stored_bf16); the plan passes the bf16 output as both C and the copy.
//
// Split-K (a fixed range of k per split, the grid's z) writes f32 partials to scratch;
// `gemm_splitk_reduce` sums them in split order (deterministic, no atomics) and applies
// the bias and ReLU. The pipelined kernels (either tile) instead sum their splits inside
// a thread-block cluster on sm_90 (gemm_bf16p_128x128_k<S>, _128x256_k<S>,
// gemm_cluster_epilogue). Epilogue flags: bit 0 adds bias[n], bit 1 applies ReLU, bit 3
// the ReLU gradient's mask (the `bias` pointer then being the ReLU's output), bit 4 in the
// pipelined kernels a residual added after the product (`bias` then being R, of C's
// layout; a GEMM with neither a bias nor a mask, C written whole by one launch), bit 6 in
// the copy forms C stored in bf16 alone (the copy is the output), bit 7 in the `_ma`
// kernels the cross update's bf16 copy (tma.cuh). The direct
// epilogue writes each thread's two adjacent columns as one float2 where C's alignment
// allows; the wgmma tile's (gemm_staged_epilogue) a float4 a lane through shared memory.
//
// Bound: 2·M·N·K FLOPs on tensor cores against 4·(M·K·ceil(N/BN) + N·K·ceil(M/BM) + M·N)
// bytes; the model's small shapes (K = 13..351, N small) are memory-bound and run these
// single-launch kernels.
//
// A bf16 A beside an f32 B (a dy the op that made it wrote in bf16: AutoInt's dqkv) has
// `_a16` forms of the nn and tn kernels, which stage its tiles as they are (and sum a
// transposed A's columns from the bf16 values).
//
// Tall GEMMs (many rows, N ≤ 256, small K) take `gemm_tall_n*` (see gemm_tall_body).
// Large GEMMs (ops/src/family/gemm.rs decides) take the pipelined path instead: the
// operands are rounded to bf16 once, by `gemm_to_bf16` / `gemm_to_bf16_t`, into K-major
// zero-padded scratch (the same round-to-nearest-even, so the same products), and
// `gemm_bf16p_*` multiplies them through a cp.async ring in dynamic shared memory:
// wgmma on sm_90a, ldmatrix + mma.sync on sm_80 (see gemm_wgmma_body, gemm_pipe_body).
// Rounding in a separate pass costs 6 bytes per operand element once, against re-reading
// f32 tiles from L2 for every output tile and keeping the f32 -> bf16 work and register
// staging out of the main loop.
#include "common.cuh"

// The driver's TMA descriptor (CUtensorMap), opaque here: the TMA kernels take two by
// value (gemm_tma_body).
struct alignas(64) GemmTmap {
    unsigned long long v[16];
};

// The family's parts, each after the parts whose helpers it uses. build.rs compiles this
// file alone (the folder's other files are its includes), so the kernels are those of one
// translation unit, as they were when the family was one file:
#include "mma.cuh"       // the register-staged tiles gemm_bf16_* (mma.sync)
#include "pipe.cuh"      // the pipelined path's cp.async ring, its mma.sync body
#include "tall.cuh"      // gemm_tall_n*: many rows, all of N and K in one CTA
#include "wgmma.cuh"     // the wgmma body and epilogues; the pipelined kernels gemm_bf16p_*
#include "wgmma_ws.cuh"  // gemm_bf16w_*: warp-specialized wgmma
#include "tma.cuh"       // gemm_bf16t_*: TMA loads, wgmma
#include "passes.cuh"    // rounding to bf16, column sums, the split-K reduction
#include "thin.cuh"      // gemm_thin_*: a linear layer of one output
