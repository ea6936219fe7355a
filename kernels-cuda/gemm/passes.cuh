// Part of gemm.cu, the GEMM family's one translation unit: gemm.cu includes it after the parts it
// uses; it is not compiled alone. A GEMM's helper passes: operands rounded to bf16 (`gemm_to_bf16`,
// `_t`, `_pair`), a dy rounded with its column sums (`gemm_round_colsum`), split-K partials summed
// (`gemm_splitk_reduce`).

namespace {

// dst[b][r][c] = bf16(src[b·batch_src + r·ld + c]) (round to nearest even) for r < rows,
// c < cols, 0 elsewhere in the padded [rp][cp] (cp a multiple of 8). One thread per 8
// consecutive c: two float4 loads where ld and the base allow, one 16-byte store. `blk`
// is the CTA's index over ceil(rp·cp/8 / 256) CTAs of 256 threads.
__device__ __forceinline__ void gemm_to_bf16_body(const float* __restrict__ src, __nv_bfloat16* __restrict__ dst,
                                                  int rows, int cols, long long ld, long long batch_src, int rp,
                                                  int cp, long long blk) {
    const long long i = blk * 256 + threadIdx.x;
    const int chunks = cp / 8;
    if (i >= static_cast<long long>(rp) * chunks) return;
    const int r = static_cast<int>(i / chunks), c = static_cast<int>(i % chunks) * 8;
    src += blockIdx.z * batch_src;
    dst += static_cast<long long>(blockIdx.z) * rp * cp;
    float v[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = 0.f;
    if (r < rows) {
        const float* p = src + static_cast<long long>(r) * ld + c;
        if (c + 8 <= cols && gemm_vec_ok(p, ld)) {
            const float4 x = __ldg(reinterpret_cast<const float4*>(p));
            const float4 y = __ldg(reinterpret_cast<const float4*>(p + 4));
            v[0] = x.x, v[1] = x.y, v[2] = x.z, v[3] = x.w, v[4] = y.x, v[5] = y.y, v[6] = y.z, v[7] = y.w;
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e)
                if (c + e < cols) v[e] = __ldg(p + e);
        }
    }
    uint4 o;
    o.x = gemm_pack_bf16(v[0], v[1]);
    o.y = gemm_pack_bf16(v[2], v[3]);
    o.z = gemm_pack_bf16(v[4], v[5]);
    o.w = gemm_pack_bf16(v[6], v[7]);
    *reinterpret_cast<uint4*>(dst + static_cast<long long>(r) * cp + c) = o;
}

// The transposing form: dst[b][r][c] = bf16(src[b·batch_src + c·ld + r]) for r < rows,
// c < cols, 0 elsewhere in [rp][cp] (rp, cp multiples of 8). A CTA moves the 64 (r) x 64
// (c) block (bx, by) through shared memory: coalesced f32 loads along r, 16-byte stores
// along c. 256 threads. With `sums` (batch 1), it also writes the f32 sum of its 64 c of
// row r, c ascending, to sums[by·rows + r]: a weight gradient's bias gradient in
// ceil(cols/64) partials, without a pass over src of its own.
__device__ __forceinline__ void gemm_to_bf16_t_body(const float* __restrict__ src, __nv_bfloat16* __restrict__ dst,
                                                    int rows, int cols, long long ld, long long batch_src, int rp,
                                                    int cp, int bx, int by, float* __restrict__ sums) {
    __shared__ float tile[64][65];  // [c][r], padded against bank conflicts
    const int tid = threadIdx.x, tx = tid & 63, ty = tid >> 6;
    const int r0 = bx * 64, c0 = by * 64;
    src += blockIdx.z * batch_src;
    dst += static_cast<long long>(blockIdx.z) * rp * cp;
    const int r = r0 + tx;
#pragma unroll 4
    for (int i = 0; i < 16; ++i) {
        const int cl = ty + 4 * i, c = c0 + cl;
        tile[cl][tx] = (r < rows && c < cols) ? __ldg(src + static_cast<long long>(c) * ld + r) : 0.f;
    }
    __syncthreads();
    if (sums != nullptr && tid < 64 && r0 + tid < rows) {
        float s = 0.f;
        for (int cl = 0; cl < 64; ++cl) s += tile[cl][tid];
        sums[static_cast<long long>(by) * rows + r0 + tid] = s;
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const int id = tid + j * 256, rl = id >> 3, ch = (id & 7) * 8;
        const int rr = r0 + rl, c = c0 + ch;
        if (rr >= rp || c >= cp) continue;
        uint4 o;
        o.x = gemm_pack_bf16(tile[ch][rl], tile[ch + 1][rl]);
        o.y = gemm_pack_bf16(tile[ch + 2][rl], tile[ch + 3][rl]);
        o.z = gemm_pack_bf16(tile[ch + 4][rl], tile[ch + 5][rl]);
        o.w = gemm_pack_bf16(tile[ch + 6][rl], tile[ch + 7][rl]);
        *reinterpret_cast<uint4*>(dst + static_cast<long long>(rr) * cp + c) = o;
    }
}

}  // namespace

// gemm_to_bf16 / gemm_to_bf16_t as above, one matrix a launch. Grid (ceil(rp·cp/8 / 256),
// 1, batch) and (ceil(rp/64), ceil(cp/64), batch), block 256.
ERASE_KERNEL void __launch_bounds__(256)
    gemm_to_bf16(const float* __restrict__ src, __nv_bfloat16* __restrict__ dst, int rows, int cols, long long ld,
                 long long batch_src, int rp, int cp) { ERASE_PDL_ENTER();
    gemm_to_bf16_body(src, dst, rows, cols, ld, batch_src, rp, cp, blockIdx.x);
}

ERASE_KERNEL void __launch_bounds__(256)
    gemm_to_bf16_t(const float* __restrict__ src, __nv_bfloat16* __restrict__ dst, int rows, int cols, long long ld,
                   long long batch_src, int rp, int cp) { ERASE_PDL_ENTER();
    gemm_to_bf16_t_body(src, dst, rows, cols, ld, batch_src, rp, cp, blockIdx.x, blockIdx.y, nullptr);
}

// Both operands of a pipelined GEMM in one launch (one launch fewer, and the small
// operand's conversion runs beside the large one's instead of after it). Operand X (A or
// B) takes CTAs [first_x, first_x + n_x) of grid x: plain when trans_x == 0 (n_x =
// ceil(rp_x·cp/8 / 256)), else the transposing form (n_x = gx_x · ceil(cp/64), CTA i at
// (i % gx_x, i / gx_x)). Grid (n_a + n_b, 1, batch), block 256. sums_a != 0 (a
// transposed A, batch 1): A's rows also summed over their K into sums_a, in
// ceil(K/64) partials of rows_a (see gemm_to_bf16_t_body).
ERASE_KERNEL void __launch_bounds__(256)
    gemm_to_bf16_pair(const float* __restrict__ src_a, __nv_bfloat16* __restrict__ dst_a, int rows_a, int cols_a,
                      long long ld_a, long long batch_a, int rp_a, int trans_a, int gx_a, int n_a,
                      const float* __restrict__ src_b, __nv_bfloat16* __restrict__ dst_b, int rows_b, int cols_b,
                      long long ld_b, long long batch_b, int rp_b, int trans_b, int gx_b, int cp,
                      float* __restrict__ sums_a, int sum_a) { ERASE_PDL_ENTER();
    int blk = blockIdx.x;
    const bool a = blk < n_a;
    if (!a) blk -= n_a;
    const float* src = a ? src_a : src_b;
    __nv_bfloat16* dst = a ? dst_a : dst_b;
    const int rows = a ? rows_a : rows_b, cols = a ? cols_a : cols_b, rp = a ? rp_a : rp_b;
    const long long ld = a ? ld_a : ld_b, bs = a ? batch_a : batch_b;
    const int gx = a ? gx_a : gx_b;
    float* sums = a && sum_a ? sums_a : nullptr;
    if (a ? trans_a : trans_b) gemm_to_bf16_t_body(src, dst, rows, cols, ld, bs, rp, cp, blk % gx, blk / gx, sums);
    else gemm_to_bf16_body(src, dst, rows, cols, ld, bs, rp, cp, blk);
}

// RoundBf16 with column sums (a layer's dy, rounded once for its data and weight
// gradients, and its bias gradient from the same pass): dst[r][c] = bf16(src[r][c]) for
// an f32 [rows][cols] matrix (cols a multiple of 8, src and dst 16-byte aligned), and
// part[by][c] = the f32 sum of src[r][c] over the CTA's 32·iters rows (iters ≤ 8), in a
// fixed order (each of 32 row lanes over its rows in order, then the 32 lane sums in
// lane order); colsum_final adds the ceil(rows/(32·iters)) partials. Grid (ceil(cols/64),
// ceil(rows/(32·iters))), block 256: thread t takes the 8 columns 64·bx + 8·(t % 8) of
// rows 32·iters·by + t/8 + 32·i, i < iters, so a warp reads four whole 256-byte row
// segments at a time; all of a thread's loads are issued before the first is used.
ERASE_KERNEL void __launch_bounds__(256)
    gemm_round_colsum(const float* __restrict__ src, __nv_bfloat16* __restrict__ dst, float* __restrict__ part,
                      int rows, int cols, int iters) { ERASE_PDL_ENTER();
    __shared__ float lanes[32][65];
    const int tid = threadIdx.x, ch = tid & 7, y = tid >> 3;
    const int c = blockIdx.x * 64 + ch * 8, r0 = blockIdx.y * 32 * iters;
    float acc[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = 0.f;
    if (c < cols) {
        float4 v[8][2];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int r = r0 + y + 32 * i;
            if (i < iters && r < rows) {
                const float* p = src + static_cast<long long>(r) * cols + c;
                v[i][0] = __ldg(reinterpret_cast<const float4*>(p));
                v[i][1] = __ldg(reinterpret_cast<const float4*>(p + 4));
            }
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int r = r0 + y + 32 * i;
            if (i < iters && r < rows) {
                const float4 x = v[i][0], z = v[i][1];
                acc[0] += x.x, acc[1] += x.y, acc[2] += x.z, acc[3] += x.w;
                acc[4] += z.x, acc[5] += z.y, acc[6] += z.z, acc[7] += z.w;
                uint4 o;
                o.x = gemm_pack_bf16(x.x, x.y);
                o.y = gemm_pack_bf16(x.z, x.w);
                o.z = gemm_pack_bf16(z.x, z.y);
                o.w = gemm_pack_bf16(z.z, z.w);
                *reinterpret_cast<uint4*>(dst + static_cast<long long>(r) * cols + c) = o;
            }
        }
    }
    erase_colsum_partials(lanes, acc, part, cols);
}

// C[i] = Σ_s part[s·split_stride + i] (+ bias[i % N]) (ReLU) (zero where flags & 8 and
// bias[i], then the ReLU's output, is not > 0), for i < count; C is
// contiguous. Block (X, Y), Y = 1, 2, 4, .. 32 (at most the split count) lanes of splits
// and X = max(32, 256 / Y) threads of element groups: thread (x, y) owns 4 consecutive
// elements (float4 loads when count and split_stride are multiples of 4, as the plan
// arranges, else 4 scalar loads) and sums splits y, y+Y, y+2Y, .. of them in that order;
// then thread (x, 0) adds the Y lane sums in lane order: a fixed order for a given split
// count and Y (deterministic), Y float4 loads in flight per element group. Dynamic
// shared memory: X·Y float4. Grid ceil(count / 4X) + ceil(rs_n / X).
//
// The CTAs past ceil(count / 4X) add a weight gradient's bias-gradient partials in the
// same launch (rs_slices > 0; one launch fewer than colsum_final after the reduction):
// rs_out[j] = Σ_{s < rs_slices} rs_part[s·rs_n + j], thread (x, y) of CTA b taking column
// j = X·b + x and slices y, y+Y, .. in order, then thread (x, 0) adding the Y sums in
// lane order.
ERASE_KERNEL void __launch_bounds__(1024)
    gemm_splitk_reduce(const float* __restrict__ part, const float* __restrict__ bias, float* __restrict__ C,
                       long long count, int N, int splits, long long split_stride, int flags,
                       const float* __restrict__ rs_part, float* __restrict__ rs_out, int rs_slices,
                       long long rs_n) { ERASE_PDL_ENTER();
    extern __shared__ float4 lanes[];
    const int nx = blockDim.x, ny = blockDim.y, tx = threadIdx.x, ty = threadIdx.y;
    const long long c_blocks = (count + 4 * nx - 1) / (4 * nx);
    if (blockIdx.x >= c_blocks) {
        const long long j = (blockIdx.x - c_blocks) * nx + tx;
        float t = 0.f;
        if (j < rs_n)
            for (int sl = ty; sl < rs_slices; sl += ny) t += __ldg(rs_part + sl * rs_n + j);
        lanes[ty * nx + tx].x = t;
        __syncthreads();
        if (ty == 0 && j < rs_n) {
            float r = lanes[tx].x;
            for (int y = 1; y < ny; ++y) r += lanes[y * nx + tx].x;
            rs_out[j] = r;
        }
        return;
    }
    const long long i0 = (static_cast<long long>(blockIdx.x) * nx + tx) * 4;
    const bool vec = (count & 3) == 0 && (split_stride & 3) == 0;
    float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
    // the ReLU gradient's mask, loaded before the partials (its latency hidden by theirs)
    float keep[4] = {1.f, 1.f, 1.f, 1.f};
    if ((flags & 8) && ty == 0) {
#pragma unroll
        for (int e = 0; e < 4; ++e)
            if (i0 + e < count) keep[e] = __ldg(bias + i0 + e);
    }
    if (i0 < count) {
        if (vec) {
#pragma unroll 4
            for (int sp = ty; sp < splits; sp += ny) {
                const float4 v = __ldg(reinterpret_cast<const float4*>(part + sp * split_stride + i0));
                s.x += v.x;
                s.y += v.y;
                s.z += v.z;
                s.w += v.w;
            }
        } else {
            for (int sp = ty; sp < splits; sp += ny) {
                const float* p = part + sp * split_stride + i0;
                s.x += __ldg(p);
                if (i0 + 1 < count) s.y += __ldg(p + 1);
                if (i0 + 2 < count) s.z += __ldg(p + 2);
                if (i0 + 3 < count) s.w += __ldg(p + 3);
            }
        }
    }
    if (ny > 1) {
        lanes[ty * nx + tx] = s;
        __syncthreads();
        if (ty == 0) {
            s = lanes[tx];
            for (int y = 1; y < ny; ++y) {
                const float4 v = lanes[y * nx + tx];
                s.x += v.x;
                s.y += v.y;
                s.z += v.z;
                s.w += v.w;
            }
        }
    }
    if (ty == 0) {
        const float v[4] = {s.x, s.y, s.z, s.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const long long i = i0 + e;
            if (i >= count) break;
            float r = v[e];
            if (flags & 1) r += __ldg(bias + i % N);
            if (flags & 2) r = fmaxf(r, 0.f);
            if (!(keep[e] > 0.f)) r = 0.f;
            C[i] = r;
        }
    }
}
