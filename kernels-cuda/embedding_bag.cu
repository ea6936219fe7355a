// Embedding bags over several tables stacked in one [Σ rows, D] table: the sum-pooled
// lookup, its dense table gradient, and row-wise Adagrad fused with the backward.
//
// Layout: bag k (= example · F + field) holds ids[offsets[k] .. offsets[k+1]]; an id is a
// row of its field's table, global row = base[field] + id. The per-field (base, rows)
// pairs are written into a small scratch table `meta` by emb_meta_build (launch
// arguments cannot carry arrays). Nothing is validated here (the CPU path reports bad
// data), but nothing is read out of bounds either: offsets are clamped to [0, n_ids],
// ids outside their field's table are skipped.
//
// embedding_bag_fwd_v4 (D % 4 == 0): a group of L = min(32, pow2 ≥ D/4) lanes per bag
//   (two bags a warp for D = 64), each lane 16-byte loads of float4 columns, ids walked in
//   order with two rows in flight. embedding_bag_fwd (any D): one warp per bag, lane l
//   accumulating columns l, l+32, l+64, l+96 of a 128-column tile, four rows in flight.
//   Either way each pooled value is the reference's sum in the reference's order:
//   bit-identical. Bags are grid-strided, 8 warps a CTA. Bound: memory, (ids + bags)·D·4
//   bytes (batch 4096 × 26 fields × 64: 27 MB gathered, 27 MB written) with a chain of
//   dependent loads (offsets, ids, table) per bag, hidden by many bags in flight.
//
// Backward (dense gradient and Adagrad): every occurrence i of an id becomes a pair
// (key = global row, value = its bag), keys of invalid occurrences = `sentinel` (one past
// the last row). A stable LSD radix sort (8 bits a pass, ceil(bits(sentinel)/8) passes)
// orders the pairs by row, occurrences of one row staying in occurrence order, which is
// the order the reference sums them in:
//   emb_sort_keys: thread per occurrence; its bag by binary search over the offsets.
//   emb_radix_hist: CTA per 2048-pair tile: digit counts (shared-memory integer atomics:
//     exact) -> hist[digit · tiles + tile].
//   emb_radix_scan: one CTA of 1024, 4 entries a thread: exclusive scan of hist
//     (digit-major: the global destination base of each digit in each tile).
//   emb_radix_scatter: CTA per tile, 8 warps × 8 rounds of 32 pairs in index order; a
//     pair's rank among equal digits comes from __match_any_sync and running per-warp
//     counts, so the scatter is stable.
// Then the segments (runs of one row) are summed in chunks of EMB_CHUNK = 32 sorted
// positions, a warp per (chunk, 32-column tile), lanes on columns:
//   emb_seg_chunks: the warp walks its chunk's positions in order (8 gradient loads in
//     flight) and flushes each run's sum at the run's end: a run wholly inside the chunk
//     is written out directly; the part of a run that continues from the previous chunk
//     goes to part_first[chunk], the part of a run that continues into the next chunk
//     (and starts in this one) to part_last[chunk].
//   emb_seg_tails: the warp of the chunk where a crossing run starts adds its part_last
//     and the following chunks' part_first in chunk order. A row occurring 4096 times is
//     128 chunk sums in parallel, then 128 sequential adds: no long serial walk, and a
//     fixed order (the grouping depends only on the sorted positions).
// Finished row sums go to dtable[row] (dense gradient; the table was zero-filled first)
// or to G[start position of the run] (Adagrad), and
//   emb_adagrad_apply: a warp per run (g, w and acc of the row loaded in one round trip):
//     acc[row] += mean(g²) (lane-strided squares, then the fixed tree),
//     w[row] -= lr · g / (sqrt(acc[row]) + eps). Only touched rows move.
// Sums of one row are in occurrence order within a chunk and chunk order across chunks:
// deterministic, and equal to the reference's sequential sum for rows whose occurrences
// share one chunk. Bound: memory, a few passes over N pairs (8 bytes) plus N·D·4 bytes
// of gradient read and the touched rows' table traffic.
#include "common.cuh"

#define EMB_TILE 2048  // pairs per radix tile: 8 warps × 8 rounds × 32
#define EMB_ROUNDS 8
#define EMB_RADIX 256
#define EMB_CHUNK 32  // sorted positions per segment chunk (one per lane)

// ---- per-field table -------------------------------------------------------------------

#define EMB_META_PARAMS(k) long long b##k, long long r##k
#define EMB_META_SET(k)                      \
    if (threadIdx.x == k && k < count) {     \
        meta[2 * (first + k)] = b##k;        \
        meta[2 * (first + k) + 1] = r##k;    \
    }

// meta[2f] = base row of field f, meta[2f+1] = its rows, for f = first + k, k < count
// (<= 32). One CTA of 32 threads.
ERASE_KERNEL void emb_meta_build(long long* meta, int first, int count, EMB_META_PARAMS(0), EMB_META_PARAMS(1), EMB_META_PARAMS(2), EMB_META_PARAMS(3), EMB_META_PARAMS(4), EMB_META_PARAMS(5), EMB_META_PARAMS(6), EMB_META_PARAMS(7), EMB_META_PARAMS(8), EMB_META_PARAMS(9), EMB_META_PARAMS(10), EMB_META_PARAMS(11), EMB_META_PARAMS(12), EMB_META_PARAMS(13), EMB_META_PARAMS(14), EMB_META_PARAMS(15), EMB_META_PARAMS(16), EMB_META_PARAMS(17), EMB_META_PARAMS(18), EMB_META_PARAMS(19), EMB_META_PARAMS(20), EMB_META_PARAMS(21), EMB_META_PARAMS(22), EMB_META_PARAMS(23), EMB_META_PARAMS(24), EMB_META_PARAMS(25), EMB_META_PARAMS(26), EMB_META_PARAMS(27), EMB_META_PARAMS(28), EMB_META_PARAMS(29), EMB_META_PARAMS(30), EMB_META_PARAMS(31)) { ERASE_PDL_ENTER();
    EMB_META_SET(0) EMB_META_SET(1) EMB_META_SET(2) EMB_META_SET(3) EMB_META_SET(4) EMB_META_SET(5) EMB_META_SET(6) EMB_META_SET(7) EMB_META_SET(8) EMB_META_SET(9) EMB_META_SET(10) EMB_META_SET(11) EMB_META_SET(12) EMB_META_SET(13) EMB_META_SET(14) EMB_META_SET(15) EMB_META_SET(16) EMB_META_SET(17) EMB_META_SET(18) EMB_META_SET(19) EMB_META_SET(20) EMB_META_SET(21) EMB_META_SET(22) EMB_META_SET(23) EMB_META_SET(24) EMB_META_SET(25) EMB_META_SET(26) EMB_META_SET(27) EMB_META_SET(28) EMB_META_SET(29) EMB_META_SET(30) EMB_META_SET(31)
}

// The global row of `id` in a bag of field f, or -1 when it is outside the field's table.
__device__ __forceinline__ long long emb_row(const long long* __restrict__ meta, int f, int id,
                                             long long total_rows) {
    const long long base = __ldg(meta + 2 * f), rows = __ldg(meta + 2 * f + 1);
    const long long r = base + id;
    return (id >= 0 && id < rows && r < total_rows) ? r : -1;
}

// ---- forward ---------------------------------------------------------------------------

// y[bag, :] = Σ table[row(id)] over the bag's ids, in order. Bags 0 .. n_bags-1 (the rows
// of y); offsets has n_offsets entries.
ERASE_KERNEL void embedding_bag_fwd(const float* __restrict__ table, const int* __restrict__ ids,
                                    const int* __restrict__ offsets, const long long* __restrict__ meta,
                                    float* __restrict__ y, long long n_ids, long long n_offsets, long long n_bags,
                                    int nf, int d, long long total_rows) { ERASE_PDL_ENTER();
    const int lane = threadIdx.x & 31;
    const long long warps = (long long)gridDim.x * (blockDim.x >> 5);
    for (long long bag = erase_gtid() >> 5; bag < n_bags; bag += warps) {
        long long start = bag < n_offsets ? __ldg(offsets + bag) : 0;
        long long end = bag + 1 < n_offsets ? __ldg(offsets + bag + 1) : start;
        start = min(max(start, 0LL), n_ids);
        end = min(max(end, start), n_ids);
        const int f = (int)(bag % nf);
        float* yr = y + bag * d;
        for (int c0 = 0; c0 < d; c0 += 128) {
            const int c = c0 + lane;
            float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
            for (long long k = start; k < end; k += 4) {
                // up to 4 rows in flight; added in id order
                float v[4][4];
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    const long long row = (k + u < end) ? emb_row(meta, f, __ldg(ids + k + u), total_rows) : -1;
                    const float* tr = table + (row < 0 ? 0 : row) * d + c;
#pragma unroll
                    for (int q = 0; q < 4; ++q) v[u][q] = (row >= 0 && c + 32 * q < d) ? __ldg(tr + 32 * q) : 0.0f;
                }
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    if (k + u < end) {
                        a0 += v[u][0];
                        a1 += v[u][1];
                        a2 += v[u][2];
                        a3 += v[u][3];
                    }
                }
            }
            if (c < d) yr[c] = a0;
            if (c + 32 < d) yr[c + 32] = a1;
            if (c + 64 < d) yr[c + 64] = a2;
            if (c + 96 < d) yr[c + 96] = a3;
        }
    }
}

// The same lookup for D % 4 == 0 with 16-byte loads: a group of 2^lanes_log2 lanes per
// bag (16 for D = 64: two bags a warp), lane l of a group owning float4 columns l, l+L,
// ...; ids walked in order, two rows in flight. Falls back to 4-byte loads (same mapping,
// same sums) if the table or output is not 16-byte aligned.
template <bool ALIGNED>
__device__ __forceinline__ float4 emb_load4(const float* p) {
    if (ALIGNED) return __ldg(reinterpret_cast<const float4*>(p));
    return make_float4(__ldg(p), __ldg(p + 1), __ldg(p + 2), __ldg(p + 3));
}

__device__ __forceinline__ void emb_acc4(float4& a, const float4 v) {
    a.x += v.x;
    a.y += v.y;
    a.z += v.z;
    a.w += v.w;
}

template <bool ALIGNED>
__device__ __forceinline__ void emb_fwd_v4(const float* __restrict__ table, const int* __restrict__ ids,
                                           const int* __restrict__ offsets, const long long* __restrict__ meta,
                                           float* __restrict__ y, long long n_ids, long long n_offsets,
                                           long long n_bags, int nf, int d, long long total_rows, int lanes_log2) {
    const int L = 1 << lanes_log2;
    const int sub = threadIdx.x & (L - 1);
    const long long groups = erase_gstride() >> lanes_log2;
    for (long long bag = erase_gtid() >> lanes_log2; bag < n_bags; bag += groups) {
        long long start = bag < n_offsets ? __ldg(offsets + bag) : 0;
        long long end = bag + 1 < n_offsets ? __ldg(offsets + bag + 1) : start;
        start = min(max(start, 0LL), n_ids);
        end = min(max(end, start), n_ids);
        const int f = (int)(bag % nf);
        for (int c = 4 * sub; c < d; c += 4 * L) {
            float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            long long k = start;
            for (; k + 1 < end; k += 2) {
                const long long r0 = emb_row(meta, f, __ldg(ids + k), total_rows);
                const long long r1 = emb_row(meta, f, __ldg(ids + k + 1), total_rows);
                const float4 z = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                const float4 v0 = r0 >= 0 ? emb_load4<ALIGNED>(table + r0 * d + c) : z;
                const float4 v1 = r1 >= 0 ? emb_load4<ALIGNED>(table + r1 * d + c) : z;
                emb_acc4(acc, v0);
                emb_acc4(acc, v1);
            }
            if (k < end) {
                const long long r0 = emb_row(meta, f, __ldg(ids + k), total_rows);
                if (r0 >= 0) emb_acc4(acc, emb_load4<ALIGNED>(table + r0 * d + c));
            }
            float* o = y + bag * d + c;
            if (ALIGNED) {
                *reinterpret_cast<float4*>(o) = acc;
            } else {
                o[0] = acc.x;
                o[1] = acc.y;
                o[2] = acc.z;
                o[3] = acc.w;
            }
        }
    }
}

ERASE_KERNEL void embedding_bag_fwd_v4(const float* __restrict__ table, const int* __restrict__ ids,
                                       const int* __restrict__ offsets, const long long* __restrict__ meta,
                                       float* __restrict__ y, long long n_ids, long long n_offsets, long long n_bags,
                                       int nf, int d, long long total_rows, int lanes_log2) { ERASE_PDL_ENTER();
    if ((((unsigned long long)table | (unsigned long long)y) & 15) == 0)
        emb_fwd_v4<true>(table, ids, offsets, meta, y, n_ids, n_offsets, n_bags, nf, d, total_rows, lanes_log2);
    else
        emb_fwd_v4<false>(table, ids, offsets, meta, y, n_ids, n_offsets, n_bags, nf, d, total_rows, lanes_log2);
}

// The lookup for D % 4 == 0 and at most 32 fields, whose (base, rows) pairs come as
// launch arguments (no emb_meta_build launch before it). A group of L = 2^lanes_log2
// lanes (16 for D = 64) takes EMB_FWD_BAGS consecutive bags at once: their offsets, then
// their ids, then one table row of each are loaded together, so four rows are in flight
// per lane where the one-bag kernel has a chain of dependent loads per bag. Each bag's
// sum adds its rows in id order from 0 (an invalid id adding 0), as embedding_bag_fwd_v4
// does: bit-identical to it.
//
// The table rows are read once (ld.global.cs: evict first, no reuse to keep) and the bags
// written with st.global.cs: 26.5 -> 23.5 µs at the spec's sizes on an H200, the CTR step
// unchanged (BENCHMARKS.md). A bag's first id is loaded beside its offsets, from
// position `bag`, and used when offsets[bag] is bag (one id a bag, the CTR model's
// case): one dependent load fewer before the rows; other bags load it after.
// The grid is one wave, EMB_FWD_CTAS CTAs an SM (80 registers: the next chunk's ids and
// offsets stay live beside this chunk's rows), each group walking its chunks of bags
// with the next chunk's indices loaded while this chunk's rows are in flight: 22.1-23.2
// -> 20.6-21.2 µs at the spec's sizes on an H200 (61-65 % -> 67-69 % of the copy
// bandwidth); the same kernel on a full grid, one chunk a group: 23.6-24.0 µs.
#define EMB_FWD_BAGS 4
#define EMB_FWD_CTAS 3  // ops/src/cuda/misc.rs plans the grid with the same count

template <bool ALIGNED>
__device__ __forceinline__ float4 emb_load4_stream(const float* p) {
    if (ALIGNED) return __ldcs(reinterpret_cast<const float4*>(p));
    return emb_load4<false>(p);
}

template <bool ALIGNED>
__device__ __forceinline__ void emb_fwd_fields(const float* __restrict__ table, const int* __restrict__ ids,
                                               const int* __restrict__ offsets, float* __restrict__ y,
                                               const long long* meta /* shared */, long long n_ids,
                                               long long n_offsets, long long n_bags, int nf, int d,
                                               long long total_rows, int lanes_log2) {
    // ids and table rows fit i32 (the host checks both), so positions and rows are ints
    const int L = 1 << lanes_log2;
    const int sub = threadIdx.x & (L - 1);
    const long long groups = erase_gstride() >> lanes_log2;
    const int nids = (int)n_ids, trows = (int)total_rows;
    const float4 z = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    const long long step = groups * EMB_FWD_BAGS;
    // one id a bag (offsets[bag] = bag) is the common case: bag's first id, loaded beside
    // its offsets instead of after them, is the id at offsets[bag] if that is bag
    // (checked below; otherwise loaded from there as usual). The next chunk's ids and
    // offsets are loaded while this chunk's rows are in flight (a persistent grid walks
    // several chunks), so only the first chunk waits for its indices on their own.
    int spec[EMB_FWD_BAGS], oa[EMB_FWD_BAGS], oe[EMB_FWD_BAGS];
    auto load_indices = [&](long long b) {
#pragma unroll
        for (int j = 0; j < EMB_FWD_BAGS; ++j) {
            const long long bag = b + j;
            spec[j] = bag < nids ? __ldg(ids + bag) : -1;
            oa[j] = bag < n_offsets ? __ldg(offsets + bag) : 0;
            oe[j] = bag + 1 < n_offsets ? __ldg(offsets + bag + 1) : oa[j];
        }
    };
    long long b0 = (erase_gtid() >> lanes_log2) * EMB_FWD_BAGS;
    if (b0 < n_bags) load_indices(b0);
    for (; b0 < n_bags; b0 += step) {
        int st[EMB_FWD_BAGS], len[EMB_FWD_BAGS], base[EMB_FWD_BAGS], rows[EMB_FWD_BAGS], first[EMB_FWD_BAGS];
        int most = 0;
#pragma unroll
        for (int j = 0; j < EMB_FWD_BAGS; ++j) {
            const long long bag = b0 + j;
            int a = oa[j];
            int e = oe[j];
            first[j] = spec[j];
            a = min(max(a, 0), nids);
            e = bag < n_bags ? min(max(e, a), nids) : a;
            st[j] = a;
            len[j] = e - a;
            most = max(most, e - a);
            const int f = (int)(bag % nf);
            base[j] = (int)meta[2 * f];
            rows[j] = (int)meta[2 * f + 1];
        }
        if (b0 + step < n_bags) load_indices(b0 + step);
        for (int c = 4 * sub; c < d; c += 4 * L) {
            float4 acc[EMB_FWD_BAGS];
#pragma unroll
            for (int j = 0; j < EMB_FWD_BAGS; ++j) acc[j] = z;
            for (int k = 0; k < most; ++k) {
                int row[EMB_FWD_BAGS];
#pragma unroll
                for (int j = 0; j < EMB_FWD_BAGS; ++j) {
                    const int id = k >= len[j]                         ? -1
                                   : k == 0 && st[j] == b0 + j ? first[j]
                                                               : __ldg(ids + st[j] + k);
                    row[j] = (id >= 0 && id < rows[j] && base[j] + id < trows) ? base[j] + id : -1;
                }
                float4 v[EMB_FWD_BAGS];
#pragma unroll
                for (int j = 0; j < EMB_FWD_BAGS; ++j)
                    v[j] = row[j] >= 0 ? emb_load4_stream<ALIGNED>(table + static_cast<long long>(row[j]) * d + c) : z;
#pragma unroll
                for (int j = 0; j < EMB_FWD_BAGS; ++j)
                    if (k < len[j]) emb_acc4(acc[j], v[j]);
            }
#pragma unroll
            for (int j = 0; j < EMB_FWD_BAGS; ++j) {
                if (b0 + j >= n_bags) break;
                float* o = y + (b0 + j) * d + c;
                if (ALIGNED) {
                    __stcs(reinterpret_cast<float4*>(o), acc[j]);
                } else {
                    o[0] = acc[j].x;
                    o[1] = acc[j].y;
                    o[2] = acc[j].z;
                    o[3] = acc[j].w;
                }
            }
        }
    }
}

#define EMB_META_SMEM(k)                 \
    if (threadIdx.x == k && k < nf) {    \
        meta[2 * k] = b##k;              \
        meta[2 * k + 1] = r##k;          \
    }

ERASE_KERNEL void __launch_bounds__(256, EMB_FWD_CTAS) embedding_bag_fwd_fields(const float* __restrict__ table, const int* __restrict__ ids,
                                           const int* __restrict__ offsets, float* __restrict__ y, long long n_ids,
                                           long long n_offsets, long long n_bags, int nf, int d, long long total_rows,
                                           int lanes_log2, EMB_META_PARAMS(0), EMB_META_PARAMS(1), EMB_META_PARAMS(2), EMB_META_PARAMS(3), EMB_META_PARAMS(4), EMB_META_PARAMS(5), EMB_META_PARAMS(6), EMB_META_PARAMS(7), EMB_META_PARAMS(8), EMB_META_PARAMS(9), EMB_META_PARAMS(10), EMB_META_PARAMS(11), EMB_META_PARAMS(12), EMB_META_PARAMS(13), EMB_META_PARAMS(14), EMB_META_PARAMS(15), EMB_META_PARAMS(16), EMB_META_PARAMS(17), EMB_META_PARAMS(18), EMB_META_PARAMS(19), EMB_META_PARAMS(20), EMB_META_PARAMS(21), EMB_META_PARAMS(22), EMB_META_PARAMS(23), EMB_META_PARAMS(24), EMB_META_PARAMS(25), EMB_META_PARAMS(26), EMB_META_PARAMS(27), EMB_META_PARAMS(28), EMB_META_PARAMS(29), EMB_META_PARAMS(30), EMB_META_PARAMS(31)) { ERASE_PDL_ENTER();
    __shared__ long long meta[64];
    EMB_META_SMEM(0) EMB_META_SMEM(1) EMB_META_SMEM(2) EMB_META_SMEM(3) EMB_META_SMEM(4) EMB_META_SMEM(5) EMB_META_SMEM(6) EMB_META_SMEM(7) EMB_META_SMEM(8) EMB_META_SMEM(9) EMB_META_SMEM(10) EMB_META_SMEM(11) EMB_META_SMEM(12) EMB_META_SMEM(13) EMB_META_SMEM(14) EMB_META_SMEM(15) EMB_META_SMEM(16) EMB_META_SMEM(17) EMB_META_SMEM(18) EMB_META_SMEM(19) EMB_META_SMEM(20) EMB_META_SMEM(21) EMB_META_SMEM(22) EMB_META_SMEM(23) EMB_META_SMEM(24) EMB_META_SMEM(25) EMB_META_SMEM(26) EMB_META_SMEM(27) EMB_META_SMEM(28) EMB_META_SMEM(29) EMB_META_SMEM(30) EMB_META_SMEM(31)
    __syncthreads();
    if ((((unsigned long long)table | (unsigned long long)y) & 15) == 0)
        emb_fwd_fields<true>(table, ids, offsets, y, meta, n_ids, n_offsets, n_bags, nf, d, total_rows, lanes_log2);
    else
        emb_fwd_fields<false>(table, ids, offsets, y, meta, n_ids, n_offsets, n_bags, nf, d, total_rows, lanes_log2);
}

// ---- backward: sort the occurrences by row ---------------------------------------------

// keys[i] = global row of occurrence i (sentinel when invalid), vals[i] = its bag.
ERASE_KERNEL void emb_sort_keys(const int* __restrict__ ids, const int* __restrict__ offsets,
                                const long long* __restrict__ meta, int* __restrict__ keys, int* __restrict__ vals,
                                int n_ids, int n_bags, int nf, int sentinel) { ERASE_PDL_ENTER();
    for (long long ii = erase_gtid(); ii < n_ids; ii += erase_gstride()) {
        const int i = (int)ii;
        // the last bag b < n_bags with offsets[b] <= i
        int lo = 0, hi = n_bags;
        while (lo < hi) {
            const int mid = (lo + hi) >> 1;
            if (__ldg(offsets + mid) <= i)
                lo = mid + 1;
            else
                hi = mid;
        }
        const int b = lo - 1;
        int key = sentinel;
        if (b >= 0 && i < __ldg(offsets + b + 1)) {
            const long long r = emb_row(meta, b % nf, ids[i], sentinel);
            if (r >= 0) key = (int)r;
        }
        keys[i] = key;
        vals[i] = b < 0 ? 0 : b;
    }
}

// hist[digit · tiles + tile] = count of the tile's keys with that digit.
ERASE_KERNEL void emb_radix_hist(const int* __restrict__ keys, int n, int shift, int* __restrict__ hist) { ERASE_PDL_ENTER();
    __shared__ int cnt[EMB_RADIX];
    for (int k = threadIdx.x; k < EMB_RADIX; k += blockDim.x) cnt[k] = 0;
    __syncthreads();
    const long long base = (long long)blockIdx.x * EMB_TILE;
    for (int k = threadIdx.x; k < EMB_TILE; k += blockDim.x) {
        const long long i = base + k;
        if (i < n) atomicAdd(&cnt[((unsigned)keys[i] >> shift) & (EMB_RADIX - 1)], 1);
    }
    __syncthreads();
    for (int k = threadIdx.x; k < EMB_RADIX; k += blockDim.x) hist[(long long)k * gridDim.x + blockIdx.x] = cnt[k];
}

// In-place exclusive scan of h[0 .. len), one CTA of 1024 threads, 4096 entries a step
// (each thread 4 consecutive entries; len is a multiple of 4: 256 digits × tiles).
ERASE_KERNEL void emb_radix_scan(int* __restrict__ h, long long len) { ERASE_PDL_ENTER();
    __shared__ int wsum[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int carry = 0;
    for (long long base = 0; base < len; base += 4 * 1024) {
        const long long i = base + 4 * threadIdx.x;
        int4 v = make_int4(0, 0, 0, 0);
        if (i < len) v = *reinterpret_cast<const int4*>(h + i);
        const int own = v.x + v.y + v.z + v.w;
        int x = own;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int t = __shfl_up_sync(0xffffffffu, x, o);
            if (lane >= o) x += t;
        }
        if (lane == 31) wsum[warp] = x;
        __syncthreads();
        if (warp == 0) {
            int w = wsum[lane];
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const int t = __shfl_up_sync(0xffffffffu, w, o);
                if (lane >= o) w += t;
            }
            wsum[lane] = w;  // inclusive prefix of the warp totals
        }
        __syncthreads();
        if (i < len) {
            int4 r;
            r.x = carry + (warp > 0 ? wsum[warp - 1] : 0) + x - own;
            r.y = r.x + v.x;
            r.z = r.y + v.y;
            r.w = r.z + v.z;
            *reinterpret_cast<int4*>(h + i) = r;
        }
        carry += wsum[31];
        __syncthreads();
    }
}

// Stable scatter of one radix pass; `hist` is the scanned histogram.
ERASE_KERNEL void emb_radix_scatter(const int* __restrict__ kin, const int* __restrict__ vin, int* __restrict__ kout,
                                    int* __restrict__ vout, int n, int shift, const int* __restrict__ hist) { ERASE_PDL_ENTER();
    __shared__ int wcnt[8][EMB_RADIX];  // per warp: digit counts, then the warp's offsets
    __shared__ int gbase[EMB_RADIX];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int k = threadIdx.x; k < 8 * EMB_RADIX; k += blockDim.x) (&wcnt[0][0])[k] = 0;
    for (int k = threadIdx.x; k < EMB_RADIX; k += blockDim.x)
        gbase[k] = hist[(long long)k * gridDim.x + blockIdx.x];
    __syncthreads();
    const long long base = (long long)blockIdx.x * EMB_TILE + warp * (EMB_ROUNDS * 32);
    const unsigned lt = (1u << lane) - 1u;
    int key[EMB_ROUNDS], val[EMB_ROUNDS], rank[EMB_ROUNDS];
#pragma unroll
    for (int r = 0; r < EMB_ROUNDS; ++r) {
        const long long i = base + r * 32 + lane;
        const bool ok = i < n;
        key[r] = ok ? kin[i] : 0;
        val[r] = ok ? vin[i] : 0;
        const int dig = ok ? (int)(((unsigned)key[r] >> shift) & (EMB_RADIX - 1)) : EMB_RADIX;
        const unsigned peers = __match_any_sync(0xffffffffu, dig);
        const int before = ok ? wcnt[warp][dig] : 0;
        rank[r] = before + __popc(peers & lt);
        __syncwarp();
        if (ok && (peers & lt) == 0) wcnt[warp][dig] = before + __popc(peers);  // the lowest peer
        __syncwarp();
    }
    __syncthreads();
    for (int dg = threadIdx.x; dg < EMB_RADIX; dg += blockDim.x) {
        int run = 0;
#pragma unroll
        for (int w = 0; w < 8; ++w) {
            const int c = wcnt[w][dg];
            wcnt[w][dg] = run;
            run += c;
        }
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < EMB_ROUNDS; ++r) {
        const long long i = base + r * 32 + lane;
        if (i < n) {
            const int dig = (int)(((unsigned)key[r] >> shift) & (EMB_RADIX - 1));
            const int dst = gbase[dig] + wcnt[warp][dig] + rank[r];
            kout[dst] = key[r];
            vout[dst] = val[r];
        }
    }
}

// ---- backward: sum each row's occurrences ----------------------------------------------

// Where a finished row sum goes: dtable[row] (by_row) or G[run start position].
__device__ __forceinline__ float* emb_dst(float* dst, int by_row, int row, int pos, int d) {
    return dst + (long long)(by_row ? row : pos) * d;
}

// One warp per (chunk, 32-column tile): grid-strided over chunks × tiles.
ERASE_KERNEL void emb_seg_chunks(const int* __restrict__ srow, const int* __restrict__ sbag,
                                 const float* __restrict__ dy, int n, int d, int n_bags, int sentinel,
                                 float* __restrict__ part_first, float* __restrict__ part_last,
                                 float* __restrict__ dst, int by_row) { ERASE_PDL_ENTER();
    const int lane = threadIdx.x & 31;
    const int tiles = (d + 31) >> 5;
    const long long chunks = (n + EMB_CHUNK - 1) / EMB_CHUNK;
    const long long warps = (long long)gridDim.x * (blockDim.x >> 5);
    for (long long w = erase_gtid() >> 5; w < chunks * tiles; w += warps) {
        const int q = (int)(w / tiles);
        const int c = (int)(w - (long long)q * tiles) * 32 + lane;
        const int k0 = q * EMB_CHUNK;
        const int cnt = min(EMB_CHUNK, n - k0);
        const int myrow = lane < cnt ? srow[k0 + lane] : -1;
        const int mybag = lane < cnt ? sbag[k0 + lane] : 0;
        const int prev = k0 > 0 ? srow[k0 - 1] : -1;           // row before the chunk
        const int next = k0 + cnt < n ? srow[k0 + cnt] : -1;   // row after the chunk
        // lanes where a run starts (within the chunk); invalid occurrences sort last, so
        // the valid ones are a prefix of the chunk
        const int left = __shfl_up_sync(0xffffffffu, myrow, 1);
        const unsigned starts = __ballot_sync(0xffffffffu, lane < cnt && (lane == 0 || left != myrow));
        const int valid = __popc(__ballot_sync(0xffffffffu, lane < cnt && myrow != sentinel));
        // walk the positions in order, 8 loads in flight; a run's sum is flushed at its end
        float acc = 0.0f;
        int s = 0;  // start of the current run
        for (int kb = 0; kb < valid; kb += 8) {
            float v[8];
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                const int k = kb + u;
                const int b = __shfl_sync(0xffffffffu, mybag, k & 31);
                v[u] = (k < valid && c < d && b < n_bags) ? dy[(long long)b * d + c] : 0.0f;
            }
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                const int k = kb + u;
                if (k < valid) {
                    acc += v[u];
                    if (k + 1 == valid || ((starts >> (k + 1)) & 1u)) {  // the run [s, k] ends
                        const int row = __shfl_sync(0xffffffffu, myrow, s);
                        const bool from_prev = s == 0 && prev == row;
                        const bool into_next = k + 1 == cnt && next == row;
                        if (c < d) {
                            if (!from_prev && !into_next)
                                emb_dst(dst, by_row, row, k0 + s, d)[c] = acc;
                            else if (from_prev)
                                part_first[(long long)q * d + c] = acc;
                            else
                                part_last[(long long)q * d + c] = acc;
                        }
                        acc = 0.0f;
                        s = k + 1;
                    }
                }
            }
        }
    }
}

// One warp per (chunk, 32-column tile): the chunk where a run that crosses into the next
// chunk starts adds up that run's pieces in chunk order.
ERASE_KERNEL void emb_seg_tails(const int* __restrict__ srow, int n, int d, int sentinel,
                                const float* __restrict__ part_first, const float* __restrict__ part_last,
                                float* __restrict__ dst, int by_row) { ERASE_PDL_ENTER();
    const int lane = threadIdx.x & 31;
    const int tiles = (d + 31) >> 5;
    const long long chunks = (n + EMB_CHUNK - 1) / EMB_CHUNK;
    const long long warps = (long long)gridDim.x * (blockDim.x >> 5);
    for (long long w = erase_gtid() >> 5; w < chunks * tiles; w += warps) {
        const int q = (int)(w / tiles);
        const int c = (int)(w - (long long)q * tiles) * 32 + lane;
        const int k0 = q * EMB_CHUNK;
        const int k1 = min(k0 + EMB_CHUNK, n);
        if (k1 >= n) continue;
        const int row = srow[k1 - 1];
        if (row == sentinel || srow[k1] != row) continue;  // the last run ends here
        if (k0 > 0 && srow[k0 - 1] == row) continue;       // it started in an earlier chunk
        // the run's start position: the first lane of the chunk holding `row`
        const unsigned hit = __ballot_sync(0xffffffffu, k0 + lane < k1 && srow[k0 + lane] == row);
        const int start = k0 + __ffs(hit) - 1;
        if (c >= d) continue;
        float acc = part_last[(long long)q * d + c];
        for (long long q2 = q + 1;; ++q2) {
            acc += part_first[q2 * d + c];
            const long long e2 = min((q2 + 1) * EMB_CHUNK, (long long)n);
            if (e2 >= n || srow[e2] != row) break;
        }
        emb_dst(dst, by_row, row, start, d)[c] = acc;
    }
}

// One warp per sorted position that starts a run of a valid row: row-wise Adagrad with
// the run's summed gradient G[position]. The row's gradient, weights and accumulator are
// loaded together (one round trip) when D <= 128.
ERASE_KERNEL void emb_adagrad_apply(const int* __restrict__ srow, const float* __restrict__ G, int n, int d,
                                    int sentinel, float* __restrict__ table, float* __restrict__ acc, float lr,
                                    float eps, float inv_d) { ERASE_PDL_ENTER();
    const int lane = threadIdx.x & 31;
    const long long warps = (long long)gridDim.x * (blockDim.x >> 5);
    for (long long k = erase_gtid() >> 5; k < n; k += warps) {
        const int row = srow[k];
        const int before = k > 0 ? srow[k - 1] : -1;
        if (row == sentinel || before == row) continue;
        const float* g = G + k * d;
        float* w = table + (long long)row * d;
        const float a0 = acc[row];
        if (d <= 128) {
            float gv[4], wv[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int c = lane + 32 * j;
                gv[j] = c < d ? g[c] : 0.0f;
                wv[j] = c < d ? w[c] : 0.0f;
            }
            float sq = 0.0f;
#pragma unroll
            for (int j = 0; j < 4; ++j) sq = fmaf(gv[j], gv[j], sq);
            sq = erase_warp_sum(sq);
            const float a = erase_add(a0, erase_mul(sq, inv_d));
            if (lane == 0) acc[row] = a;
            const float denom = erase_add(erase_sqrt(a), eps);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int c = lane + 32 * j;
                if (c < d) w[c] = erase_sub(wv[j], erase_div(erase_mul(lr, gv[j]), denom));
            }
        } else {
            float sq = 0.0f;
            for (int c = lane; c < d; c += 32) sq = fmaf(g[c], g[c], sq);
            sq = erase_warp_sum(sq);
            const float a = erase_add(a0, erase_mul(sq, inv_d));
            if (lane == 0) acc[row] = a;
            const float denom = erase_add(erase_sqrt(a), eps);
            for (int c = lane; c < d; c += 32) w[c] = erase_sub(w[c], erase_div(erase_mul(lr, g[c]), denom));
        }
    }
}

// ---- mean pooling ----------------------------------------------------------------------

// z[bag, :] = y[bag, :] · (1/n) for the bags of fields whose bit is set in `mean_mask`, n
// the bag's ids in [offsets[bag], offsets[bag+1]) other than padding (-1); an empty bag
// and the other fields' bags are copied. The same op is its own gradient (dz -> dy). A
// warp per bag (grid-strided): the lanes count the bag's ids, then stride its columns.
// 1/n is rounded once (IEEE division) and multiplied, as the CPU reference does: the same
// bits. Bound: memory, y read and z written once (plus the ids of mean fields).
ERASE_KERNEL void emb_bag_mean(const float* __restrict__ y, const int* __restrict__ ids,
                               const int* __restrict__ offsets, float* __restrict__ z, long long n_ids,
                               long long n_offsets, long long n_bags, int nf, int d, long long mean_mask) { ERASE_PDL_ENTER();
    const int lane = threadIdx.x & 31;
    const long long warps = (long long)gridDim.x * (blockDim.x >> 5);
    for (long long bag = erase_gtid() >> 5; bag < n_bags; bag += warps) {
        const int f = (int)(bag % nf);
        float scale = 1.0f;
        bool scaled = false;
        if ((mean_mask >> f) & 1LL) {
            long long start = bag < n_offsets ? __ldg(offsets + bag) : 0;
            long long end = bag + 1 < n_offsets ? __ldg(offsets + bag + 1) : start;
            start = min(max(start, 0LL), n_ids);
            end = min(max(end, start), n_ids);
            int n = 0;
            for (long long k = start + lane; k < end; k += 32) n += __ldg(ids + k) != -1 ? 1 : 0;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) n += __shfl_xor_sync(0xffffffffu, n, o);
            if (n > 0) {
                scale = erase_div(1.0f, (float)n);
                scaled = true;
            }
        }
        const float* yr = y + bag * d;
        float* zr = z + bag * d;
        for (int c = lane; c < d; c += 32) zr[c] = scaled ? erase_mul(__ldg(yr + c), scale) : __ldg(yr + c);
    }
}

// ---- sharded tables: the lookup's ids on a rank that holds some rows -------------------

// A rank `me` of `world` holds, of each field f, the rows placed on it (all of them when
// the field is replicated) and landing slots for the rows other ranks own. For id slot s
// of its batch (bags of `hot` slots, bag = example · nf + f, so n = examples · nf · hot),
// with id = ids[s] and pos its slot within the field (example · hot + s % hot):
//   ids[s]           <- the id in this rank's storage of field f: a row it holds, or the
//                       landing slot (landing offset for the owner) + pos; PAD stays PAD;
//   ubm[k·n + s]     <- where rank k stores the row (k's stacked storage index) if the
//                       row is replicated, else PAD: the occurrences every rank updates,
//                       in bag order;
//   ufm[k·n + f·(n/nf) + pos] <- the same where k owns the row alone, else PAD: for another
//                       rank k the rows asked of it, field-major so that each field's
//                       answers are one contiguous block; for every k (this rank too) the
//                       occurrences k updates, in the order of the gradient blocks.
// kind[3f ..]: 0 replicated, 1 table-wise (then the owner) or 2 row-wise (then rows a
// rank), and the field's rows. geo[4(k·nf + f) ..]: held start, held length and storage
// base of field f on rank k, and this rank's landing offset within field f for the rows
// k owns (-1: none). An id outside its field (bad data, never from the loader) becomes
// PAD.
ERASE_KERNEL void shard_ids(int* __restrict__ ids, const int* __restrict__ kind, const int* __restrict__ geo,
                            int* __restrict__ ubm, int* __restrict__ ufm, int n, int nf, int hot, int world,
                            int me) { ERASE_PDL_ENTER();
    const int per_field = n / nf;
    for (long long ii = erase_gtid(); ii < n; ii += erase_gstride()) {
        const int s = (int)ii;
        const int bag = s / hot, f = bag % nf;
        const int pos = (bag / nf) * hot + s % hot;
        const int fm = f * per_field + pos;
        const int id = ids[s];
        int owner = -2;  // -2: no row; -1: replicated
        if (id >= 0 && id < __ldg(kind + 3 * f + 2)) {
            const int k = __ldg(kind + 3 * f), p = __ldg(kind + 3 * f + 1);
            owner = k == 0 ? -1 : (k == 1 ? p : id / max(p, 1));
            if (owner >= world) owner = -2;
        }
        for (int k = 0; k < world; ++k) {
            const int* g = geo + 4 * (k * nf + f);
            const bool held = owner == -1 || owner == k;
            const int at = held ? __ldg(g + 2) + id - __ldg(g) : -1;
            ubm[(long long)k * n + s] = owner == -1 ? at : -1;
            ufm[(long long)k * n + fm] = owner == k ? at : -1;
        }
        int local = -1;
        if (owner == -1 || owner == me) {
            local = id - __ldg(geo + 4 * (me * nf + f));
        } else if (owner >= 0) {
            const int land = __ldg(geo + 4 * (owner * nf + f) + 3);
            local = land >= 0 ? land + pos : -1;
        }
        ids[s] = local;
    }
}
