//! Embedding tables: `EmbeddingBag`, `BagMean`, `EmbeddingBagGradDense`, `EmbeddingSort`, `RowwiseAdagrad`.
//!
//! Everything of the family in one place: the CPU reference (`cpu`, what every CUDA
//! kernel is tested against), the CUDA launch plans (`cuda`) and the cost estimate the
//! scheduler reads (`cost`).

// ---- the CPU reference ----
pub mod cpu {
    //! Embedding bags over several tables stacked in one parameter, their dense gradient and
    //! the row-wise Adagrad update. Ids come from data, so they are validated here and a bad
    //! one is an error naming the bag, not a panic. An id of [`PAD`] fills a slot of a bag
    //! shorter than its field's capacity (multi-hot fields of variable length in a static
    //! shape): it has no row, adds nothing and gets no gradient, as the CUDA kernels skip
    //! ids outside their table.

    /// The id of an empty slot of a bag.
    pub const PAD: i32 = -1;

    use crate::buffer::Buffer;
    use crate::cpu::kernels::for_rows;
    use crate::cpu::real::Real;
    use crate::cpu::{get, get_i32, out, Elem, NodeCall};
    use erase_graph::Op;

    /// The layout of a lookup: bags of `fields` fields each, table bases per field.
    pub struct Bags<'a> {
        pub ids: &'a [i32],
        pub offsets: &'a [i32],
        pub field_rows: &'a [usize],
        pub bases: Vec<usize>,
    }

    impl<'a> Bags<'a> {
        /// Validates offsets (non-decreasing, from 0 to the number of ids) and ids (inside
        /// their field's table).
        pub fn new(
            ids: &'a [i32],
            offsets: &'a [i32],
            field_rows: &'a [usize],
        ) -> Result<Self, String> {
            let f = field_rows.len();
            if offsets.first() != Some(&0) {
                return Err(format!(
                    "offsets must start at 0, got {:?}",
                    offsets.first()
                ));
            }
            let last = offsets.last().copied().unwrap_or(0);
            if last < 0 || last as usize != ids.len() {
                return Err(format!(
                    "the last offset is {last} but there are {} ids",
                    ids.len()
                ));
            }
            for (i, w) in offsets.windows(2).enumerate() {
                if w[1] < w[0] {
                    return Err(format!(
                        "offsets decrease at bag {i} (example {}, field {}): {} then {}",
                        i / f,
                        i % f,
                        w[0],
                        w[1]
                    ));
                }
            }
            let mut bases = Vec::with_capacity(f);
            let mut acc = 0;
            for &r in field_rows {
                bases.push(acc);
                acc += r;
            }
            let bags = Bags {
                ids,
                offsets,
                field_rows,
                bases,
            };
            for bag in 0..offsets.len() - 1 {
                let fi = bag % f;
                for &id in bags.bag_ids(bag) {
                    if id != PAD && (id < 0 || id as usize >= field_rows[fi]) {
                        return Err(format!(
                            "id {id} in bag {bag} (example {}, field {fi}) is out of range for that field's table of {} rows",
                            bag / f,
                            field_rows[fi]
                        ));
                    }
                }
            }
            Ok(bags)
        }

        pub fn num_bags(&self) -> usize {
            self.offsets.len() - 1
        }

        pub fn bag_ids(&self, bag: usize) -> &'a [i32] {
            &self.ids[self.offsets[bag] as usize..self.offsets[bag + 1] as usize]
        }

        /// The global table row of an id in `bag`.
        pub fn row(&self, bag: usize, id: i32) -> usize {
            self.bases[bag % self.field_rows.len()] + id as usize
        }
    }

    /// `y[bag] = Σ table[row(id)]` over the bag's ids.
    pub fn embedding_bag<T: Real>(table: &[T], bags: &Bags, y: &mut [T], d: usize) {
        for_rows(y, d, |bag, out| {
            out.iter_mut().for_each(|v| *v = T::ZERO);
            for &id in bags.bag_ids(bag).iter().filter(|&&id| id != PAD) {
                let r = bags.row(bag, id);
                for (o, &t) in out.iter_mut().zip(&table[r * d..(r + 1) * d]) {
                    *o += t;
                }
            }
        });
    }

    /// `z[bag] = y[bag] / n` for the bags of fields with `mean[f]`, `n` the bag's ids other
    /// than padding (an empty bag stays as it is), `z[bag] = y[bag]` for the others.
    pub fn bag_mean<T: Real>(y: &[T], bags: &Bags, mean: &[bool], z: &mut [T], d: usize) {
        let f = mean.len();
        for_rows(z, d, |bag, out| {
            let src = &y[bag * d..(bag + 1) * d];
            let n = bags.bag_ids(bag).iter().filter(|&&id| id != PAD).count();
            if mean[bag % f] && n > 0 {
                let inv = T::from_f64(1.0 / n as f64);
                for (o, &v) in out.iter_mut().zip(src) {
                    *o = v * inv;
                }
            } else {
                out.copy_from_slice(src);
            }
        });
    }

    /// The dense table gradient: each occurrence adds its bag's gradient to its row, bags and
    /// ids in order.
    pub fn embedding_bag_grad_dense<T: Real>(dy: &[T], bags: &Bags, dtable: &mut [T], d: usize) {
        dtable.iter_mut().for_each(|v| *v = T::ZERO);
        for bag in 0..bags.num_bags() {
            for &id in bags.bag_ids(bag).iter().filter(|&&id| id != PAD) {
                let r = bags.row(bag, id);
                for c in 0..d {
                    dtable[r * d + c] += dy[bag * d + c];
                }
            }
        }
    }

    /// (global row, bag) for every occurrence, in id order, then stably sorted by row;
    /// padding slots are not occurrences.
    pub fn sorted_occurrences(bags: &Bags) -> Vec<(usize, usize)> {
        let mut occ: Vec<(usize, usize)> = Vec::with_capacity(bags.ids.len());
        for bag in 0..bags.num_bags() {
            for &id in bags.bag_ids(bag).iter().filter(|&&id| id != PAD) {
                occ.push((bags.row(bag, id), bag));
            }
        }
        occ.sort_by_key(|o| o.0);
        occ
    }

    /// The bag of every slot of `ids`, in slot order (for the sentinel entries of a sort).
    pub fn slot_bags(bags: &Bags) -> Vec<usize> {
        let mut out = vec![0; bags.ids.len()];
        for bag in 0..bags.num_bags() {
            let (a, b) = (bags.offsets[bag] as usize, bags.offsets[bag + 1] as usize);
            out[a..b].iter_mut().for_each(|x| *x = bag);
        }
        out
    }

    /// The row the sort gives a padding slot: one past the last row, so it sorts last.
    pub fn sentinel_row(bags: &Bags) -> usize {
        bags.field_rows.iter().sum()
    }

    /// The occurrences as an `EmbeddingSort` of the same ids gave them, without sorting
    /// again: one per id, in (row, bag) order, each bag a bag of the batch and each row
    /// inside that bag's field table; anything else is an error, not an update of the wrong
    /// rows.
    pub fn presorted_occurrences(
        bags: &Bags,
        rows: &[i32],
        bag: &[i32],
    ) -> Result<Vec<(usize, usize)>, String> {
        let n = bags.ids.len();
        if rows.len() != n || bag.len() != n {
            return Err(format!(
                "{} sorted rows and {} bags for {n} ids",
                rows.len(),
                bag.len()
            ));
        }
        let f = bags.field_rows.len();
        let sentinel = sentinel_row(bags);
        let mut occ: Vec<(usize, usize)> = Vec::with_capacity(n);
        for (k, (&r, &b)) in rows.iter().zip(bag).enumerate() {
            let (r, b) = (r as usize, b as usize);
            if r == sentinel {
                continue; // a padding slot, sorted after every row
            }
            let inside = b < bags.num_bags() && {
                let base = bags.bases[b % f];
                r >= base && r < base + bags.field_rows[b % f]
            };
            if !inside || occ.last().is_some_and(|&last| last > (r, b)) {
                return Err(format!(
                    "sorted occurrence {k} (row {r}, bag {b}) is not one of this batch's, in row order"
                ));
            }
            occ.push((r, b));
        }
        Ok(occ)
    }

    /// Row-wise Adagrad on the rows the batch touches, over the occurrences of
    /// [`sorted_occurrences`]. Each touched row's gradient is the sum over its occurrences in
    /// id order (the stable sort by row keeps that order), so the result is deterministic.
    pub fn rowwise_adagrad<T: Real>(
        table: &mut [T],
        acc: &mut [T],
        occ: &[(usize, usize)],
        dpooled: &[T],
        d: usize,
        lr: f64,
        eps: f64,
    ) {
        let (lr, eps) = (T::from_f64(lr), T::from_f64(eps));
        let inv_d = T::from_f64(1.0 / d as f64);
        let mut g = vec![T::ZERO; d];
        let mut i = 0;
        while i < occ.len() {
            let row = occ[i].0;
            g.iter_mut().for_each(|v| *v = T::ZERO);
            while i < occ.len() && occ[i].0 == row {
                let bag = occ[i].1;
                for c in 0..d {
                    g[c] += dpooled[bag * d + c];
                }
                i += 1;
            }
            let mut sq = T::ZERO;
            for &v in &g {
                sq += v * v;
            }
            acc[row] += sq * inv_d;
            let denom = acc[row].sqrt() + eps;
            for c in 0..d {
                table[row * d + c] -= lr * g[c] / denom;
            }
        }
    }

    /// `EmbeddingSort`: the occurrences' (row, bag) pairs, sorted by row (stably), into the
    /// two i32 outputs.
    pub(crate) fn exec_embedding_sort(
        ins: &[&Buffer],
        outs: &mut [Buffer],
        field_rows: &[usize],
    ) -> Result<(), String> {
        let bags = Bags::new(
            get_i32(ins[0], "ids")?,
            get_i32(ins[1], "offsets")?,
            field_rows,
        )?;
        let mut occ = sorted_occurrences(&bags);
        let [Buffer::I32(rows), Buffer::I32(bag)] = outs else {
            return Err("expected two i32 outputs: rows and bags".into());
        };
        let n = bags.ids.len();
        if rows.len() != n || bag.len() != n {
            return Err(format!(
                "{n} occurrences into outputs of {} and {}",
                rows.len(),
                bag.len()
            ));
        }
        // padding slots last, in slot order, under the sentinel row (as the CUDA sort has them)
        if occ.len() < n {
            let (sentinel, slot_bag) = (sentinel_row(&bags), slot_bags(&bags));
            for (k, &id) in bags.ids.iter().enumerate() {
                if id == PAD {
                    occ.push((sentinel, slot_bag[k]));
                }
            }
        }
        for (k, &(r, b)) in occ.iter().enumerate() {
            rows[k] = i32::try_from(r).map_err(|_| format!("row {r} does not fit an i32"))?;
            bag[k] = i32::try_from(b).map_err(|_| format!("bag {b} does not fit an i32"))?;
        }
        Ok(())
    }

    /// Embedding bags, mean pooling, the dense table gradient and row-wise Adagrad.
    pub(crate) fn exec_embedding<T: Elem>(
        call: &NodeCall,
        ins: &[&Buffer],
        outs: &mut [Buffer],
        upd: &mut [Buffer],
    ) -> Result<(), String> {
        let ish = |i: usize| call.in_shapes[i];
        let osh = |i: usize| call.out_shapes[i];
        match call.op {
            Op::EmbeddingBag { field_rows } => {
                let bags = Bags::new(
                    get_i32(ins[1], "ids")?,
                    get_i32(ins[2], "offsets")?,
                    field_rows,
                )?;
                let d = ish(0).dims()[1];
                embedding_bag(get::<T>(ins[0], "table")?, &bags, out(&mut outs[0])?, d);
            }
            Op::BagMean { mean } => {
                // the ids' tables are not needed: any row count admits every id
                let any_rows = vec![usize::MAX / (mean.len() + 1); mean.len()];
                let bags = Bags::new(
                    get_i32(ins[1], "ids")?,
                    get_i32(ins[2], "offsets")?,
                    &any_rows,
                )?;
                let d = ish(0).dims()[2];
                bag_mean(get::<T>(ins[0], "y")?, &bags, mean, out(&mut outs[0])?, d);
            }
            Op::EmbeddingBagGradDense { field_rows } => {
                let bags = Bags::new(
                    get_i32(ins[1], "ids")?,
                    get_i32(ins[2], "offsets")?,
                    field_rows,
                )?;
                let d = osh(0).dims()[1];
                embedding_bag_grad_dense(get::<T>(ins[0], "dy")?, &bags, out(&mut outs[0])?, d);
            }
            Op::RowwiseAdagrad {
                lr,
                eps,
                field_rows,
            } => {
                let bags = Bags::new(
                    get_i32(ins[0], "ids")?,
                    get_i32(ins[1], "offsets")?,
                    field_rows,
                )?;
                let dp = get::<T>(ins[2], "dpooled")?;
                let d = ish(2).dims()[2];
                let [table, acc] = upd else {
                    return Err("expected table and accumulator".into());
                };
                let occ = match ins {
                    [_, _, _] => sorted_occurrences(&bags),
                    [_, _, _, rows, bag] => {
                        presorted_occurrences(&bags, get_i32(rows, "rows")?, get_i32(bag, "bags")?)?
                    }
                    _ => return Err(format!("expected 3 or 5 inputs, got {}", ins.len())),
                };
                rowwise_adagrad(out(table)?, out(acc)?, &occ, dp, d, *lr, *eps);
            }
            other => {
                return Err(format!(
                    "embedding: no CPU implementation of {}",
                    other.name()
                ))
            }
        }
        Ok(())
    }
}

// ---- the CUDA launch plans ----
pub(crate) mod cuda {
    //! Embedding bags (`kernels-cuda/embedding_bag.cu`): the lookup, mean pooling, the ids'
    //! sort, the dense gradient and the fused row-wise Adagrad.

    use crate::cuda::common::*;
    use crate::cuda::{blocks, CudaPlan, KArg, KernelCall, Operands};
    use erase_graph::{Op, Shape};
    use KArg::{Out, Scratch, Upd, F32, I32, I64};

    /// Kernels these plans launch.
    pub(crate) const KERNELS: &[&str] = &[
        "ew_fill_u32",
        "emb_meta_build",
        "embedding_bag_fwd",
        "embedding_bag_fwd_v4",
        "embedding_bag_fwd_fields",
        "emb_sort_keys",
        "emb_radix_hist",
        "emb_radix_scan",
        "emb_radix_scatter",
        "emb_seg_chunks",
        "emb_seg_tails",
        "emb_adagrad_apply",
        "emb_bag_mean",
    ];

    /// Pairs per radix-sort tile (`EMB_TILE`) and sorted positions per segment chunk
    /// (`EMB_CHUNK`) in embedding_bag.cu.
    const EMB_TILE: usize = 2048;

    const EMB_CHUNK: usize = 32;

    /// Bags a lane group looks up at once in `embedding_bag_fwd_fields` (`EMB_FWD_BAGS`).
    const EMB_FWD_BAGS: usize = 4;

    /// CTAs an SM of `embedding_bag_fwd_fields` (its launch bounds, `EMB_FWD_CTAS`): the grid
    /// is one wave of them, each walking several chunks of bags, the next chunk's indices
    /// loaded while this chunk's rows are in flight.
    const EMB_FWD_CTAS: usize = 3;

    /// Field geometry: the `emb_meta_build` calls writing (base, rows) per field into
    /// `Scratch(0)` (16 bytes a field), and the total rows.
    fn emb_meta(op: &Op, field_rows: &[usize]) -> Result<(Vec<KernelCall>, usize), String> {
        if field_rows.is_empty() {
            return Err(format!("{}: no fields", op.name()));
        }
        let total: usize = field_rows.iter().sum();
        if total >= i32::MAX as usize {
            return Err(format!(
                "{}: {total} table rows do not fit the kernels' i32 row keys",
                op.name()
            ));
        }
        let mut calls = Vec::new();
        for first in (0..field_rows.len()).step_by(BUILD_SLOTS) {
            let count = BUILD_SLOTS.min(field_rows.len() - first);
            let mut args = vec![Scratch(0), I32(first as i32), I32(count as i32)];
            args.extend(emb_field_args(field_rows, first));
            calls.push(kc("emb_meta_build", [1, 1, 1], [32, 1, 1], 0, args));
        }
        Ok((calls, total))
    }

    /// The (base row, rows) pairs of fields `first ..` (at most BUILD_SLOTS; the slots past
    /// the last field repeat field `first`), as the kernels with field arguments take them.
    fn emb_field_args(field_rows: &[usize], first: usize) -> Vec<KArg> {
        let base = |i: usize| field_rows[..i].iter().sum::<usize>();
        let count = BUILD_SLOTS.min(field_rows.len() - first);
        (0..BUILD_SLOTS)
            .flat_map(|k| {
                let i = if k < count { first + k } else { first };
                [n64(base(i)), n64(field_rows[i])]
            })
            .collect()
    }

    /// Ids and offsets must be i32 vectors; returns (ids, offsets) counts.
    fn emb_ids(op: &Op, ids: &Shape, offsets: &Shape) -> Result<(usize, usize), String> {
        let n_ids = ids.numel();
        if n_ids >= i32::MAX as usize {
            return Err(format!("{}: {n_ids} ids do not fit i32 offsets", op.name()));
        }
        Ok((n_ids, offsets.numel()))
    }

    /// The width D of a stacked table `[Σ rows, D]`, checking its rows against the fields'.
    fn emb_table_width(op: &Op, what: &str, table: &Shape, total: usize) -> Result<usize, String> {
        match table.dims() {
            [rows, d] if *rows == total => Ok(*d),
            [_, _] => Err(format!(
                "{}: {what} {table} must have Σ rows = {total}",
                op.name()
            )),
            _ => Err(format!("{}: {what} {table} must be [rows, D]", op.name())),
        }
    }

    /// `emb_bag_mean`: a warp per bag counts its ids and scales its row (see the kernel).
    pub(crate) fn bag_mean(op: &Op, o: &Operands, mean: &[bool]) -> Result<CudaPlan, String> {
        expect(op, o, &[F, I, I], &[F])?;
        let dims = o.ins[0].dims();
        let (n_ids, n_off) = emb_ids(op, o.ins[1], o.ins[2])?;
        let d = dims.last().copied().unwrap_or(0);
        let n_bags = o.outs[0].numel() / d.max(1);
        if d == 0 || n_bags == 0 {
            return Ok(plan_of(vec![], vec![]));
        }
        if mean.len() > 64 {
            return Err(format!(
                "{}: at most 64 fields (the mask of mean fields is one 64-bit argument), got {}",
                op.name(),
                mean.len()
            ));
        }
        let mask = mean
            .iter()
            .enumerate()
            .fold(0u64, |m, (f, &on)| if on { m | 1 << f } else { m });
        let args = vec![
            KArg::In(0),
            KArg::In(1),
            KArg::In(2),
            Out(0),
            n64(n_ids),
            n64(n_off),
            n64(n_bags),
            I32(i32_of(mean.len(), "fields")?),
            I32(i32_of(d, "embedding dim")?),
            I64(mask as i64),
        ];
        Ok(plan_of(
            vec![warp_rows("emb_bag_mean", n_bags, args)],
            vec![],
        ))
    }

    pub(crate) fn embedding_bag(
        op: &Op,
        o: &Operands,
        field_rows: &[usize],
    ) -> Result<CudaPlan, String> {
        expect(op, o, &[F, I, I], &[F])?;
        let (mut calls, total) = emb_meta(op, field_rows)?;
        let d = emb_table_width(op, "table", o.ins[0], total)?;
        let (n_ids, n_off) = emb_ids(op, o.ins[1], o.ins[2])?;
        let out_n = o.outs[0].numel();
        if d == 0 || out_n == 0 {
            return Ok(plan_of(vec![], vec![]));
        }
        let n_bags = out_n / d;
        // the sizes every lookup kernel takes after its pointers
        let sizes = [
            n64(n_ids),
            n64(n_off),
            n64(n_bags),
            I32(field_rows.len() as i32),
            I32(i32_of(d, "embedding dim")?),
            n64(total),
        ];
        // D % 4 == 0: a group of `lanes` lanes (a power of two <= 32) per bag, float4 columns
        let lanes = (d / 4).next_power_of_two().min(32);
        if d % 4 == 0 && field_rows.len() <= BUILD_SLOTS {
            // one launch: the fields' (base, rows) as arguments, EMB_FWD_BAGS bags a group
            let mut args = vec![KArg::In(0), KArg::In(1), KArg::In(2), Out(0)];
            args.extend(sizes);
            args.push(I32(lanes.trailing_zeros() as i32));
            args.extend(emb_field_args(field_rows, 0));
            let per_cta = EMB_FWD_BAGS * 256 / lanes;
            return Ok(plan_of(
                vec![kc(
                    "embedding_bag_fwd_fields",
                    [
                        blocks(n_bags, per_cta).min((o.opts.sms * EMB_FWD_CTAS) as u32),
                        1,
                        1,
                    ],
                    [256, 1, 1],
                    0,
                    args,
                )],
                vec![],
            ));
        }
        let mut args = vec![KArg::In(0), KArg::In(1), KArg::In(2), Scratch(0), Out(0)];
        args.extend(sizes);
        if d % 4 == 0 {
            args.push(I32(lanes.trailing_zeros() as i32));
            let per_cta = 256 / lanes;
            calls.push(kc(
                "embedding_bag_fwd_v4",
                [blocks(n_bags, per_cta).min(MAX_BLOCKS), 1, 1],
                [256, 1, 1],
                0,
                args,
            ));
        } else {
            calls.push(warp_rows("embedding_bag_fwd", n_bags, args));
        }
        Ok(plan_of(calls, vec![16 * field_rows.len()]))
    }

    /// Where the segment sums of the backward go.
    enum SegDst {
        /// `dtable[row]`: the dense gradient (output 0).
        Dense,
        /// `G[run start]` in the given scratch buffer, for Adagrad.
        ByPosition(usize),
    }

    /// The occurrences sorted by row: their keys (`emb_sort_keys`: global row, or `total` for
    /// an id outside its table, and the bag), then LSD radix passes of 8 bits over the bits
    /// the keys use (the sentinel is the largest key), stable, ping-ponging between scratch
    /// pairs. `calls` must hold emb_meta's launches, which write the meta into scratch 0:
    /// this adds that buffer as the first of the plan's scratch. The last pass writes into
    /// `dst` (rows, bags) when given, else into scratch. Returns where the sorted rows and
    /// bags are.
    #[allow(clippy::too_many_arguments)]
    fn emb_sort(
        calls: &mut Vec<KernelCall>,
        scratch: &mut Vec<usize>,
        field_rows: &[usize],
        total: usize,
        (ids, offsets): (KArg, KArg),
        n: usize,
        n_bags: usize,
        dst: Option<(KArg, KArg)>,
    ) -> Result<(KArg, KArg), String> {
        let sentinel = total as i32;
        let tiles = n.div_ceil(EMB_TILE).max(1);
        let nb = i32_of(n_bags, "bags")?;
        debug_assert!(scratch.is_empty(), "the meta is scratch 0");
        scratch.push(16 * field_rows.len());
        let first = scratch.len();
        scratch.extend([
            4 * n,           // keys a
            4 * n,           // values a
            4 * n,           // keys b
            4 * n,           // values b
            4 * 256 * tiles, // histogram
        ]);
        let hist = Scratch(first + 4);
        calls.push(ew(
            "emb_sort_keys",
            n,
            vec![
                ids,
                offsets,
                Scratch(0),
                Scratch(first),
                Scratch(first + 1),
                I32(n as i32),
                I32(nb),
                I32(field_rows.len() as i32),
                I32(sentinel),
            ],
        ));
        // LSD passes of 8 bits over the bits the keys use (the sentinel is the largest key);
        // at least one, so that `dst` is always written
        let bits = 32 - (sentinel as u32).leading_zeros();
        let passes = bits.div_ceil(8).max(1);
        let (mut k_in, mut v_in) = (Scratch(first), Scratch(first + 1));
        let (mut k_out, mut v_out) = (Scratch(first + 2), Scratch(first + 3));
        for p in 0..passes {
            if p + 1 == passes {
                if let Some((rows, bags)) = dst {
                    (k_out, v_out) = (rows, bags);
                }
            }
            let shift = I32(8 * p as i32);
            calls.push(kc(
                "emb_radix_hist",
                [tiles as u32, 1, 1],
                [256, 1, 1],
                0,
                vec![k_in, I32(n as i32), shift, hist],
            ));
            calls.push(kc(
                "emb_radix_scan",
                [1, 1, 1],
                [1024, 1, 1],
                0,
                vec![hist, n64(256 * tiles)],
            ));
            calls.push(kc(
                "emb_radix_scatter",
                [tiles as u32, 1, 1],
                [256, 1, 1],
                0,
                vec![k_in, v_in, k_out, v_out, I32(n as i32), shift, hist],
            ));
            std::mem::swap(&mut k_in, &mut k_out);
            std::mem::swap(&mut v_in, &mut v_out);
        }
        Ok((k_in, v_in))
    }

    /// The chunked segment sums of `dy` over the sorted occurrences (`rows`, `bags`), into
    /// `dst`; their partials in two scratch buffers appended to `scratch`.
    #[allow(clippy::too_many_arguments)]
    fn emb_segments(
        calls: &mut Vec<KernelCall>,
        scratch: &mut Vec<usize>,
        total: usize,
        (rows, bags, dy): (KArg, KArg, KArg),
        n: usize,
        n_bags: usize,
        d: usize,
        dst: SegDst,
    ) -> Result<(), String> {
        let sentinel = total as i32;
        let chunks = n.div_ceil(EMB_CHUNK).max(1);
        let col_tiles = d.div_ceil(32);
        let di = i32_of(d, "embedding dim")?;
        let nb = i32_of(n_bags, "bags")?;
        let first = scratch.len();
        scratch.extend([
            4 * chunks * d, // part_first
            4 * chunks * d, // part_last
        ]);
        let (dst_arg, by_row) = match dst {
            SegDst::Dense => (Out(0), 1),
            SegDst::ByPosition(s) => (Scratch(s), 0),
        };
        let warps = chunks * col_tiles;
        calls.push(warp_rows(
            "emb_seg_chunks",
            warps,
            vec![
                rows,
                bags,
                dy,
                I32(n as i32),
                I32(di),
                I32(nb),
                I32(sentinel),
                Scratch(first),
                Scratch(first + 1),
                dst_arg,
                I32(by_row),
            ],
        ));
        calls.push(warp_rows(
            "emb_seg_tails",
            warps,
            vec![
                rows,
                I32(n as i32),
                I32(di),
                I32(sentinel),
                Scratch(first),
                Scratch(first + 1),
                dst_arg,
                I32(by_row),
            ],
        ));
        Ok(())
    }

    /// `EmbeddingSort`: meta, keys and the radix passes, the last into the two outputs.
    pub(crate) fn embedding_sort(
        op: &Op,
        o: &Operands,
        field_rows: &[usize],
    ) -> Result<CudaPlan, String> {
        expect(op, o, &[I, I], &[I, I])?;
        let (mut calls, total) = emb_meta(op, field_rows)?;
        let (n_ids, n_off) = emb_ids(op, o.ins[0], o.ins[1])?;
        if o.outs.iter().any(|s| s.numel() != n_ids) {
            return Err(format!(
                "embedding_sort: outputs {} and {} for {n_ids} ids",
                o.outs[0], o.outs[1]
            ));
        }
        if n_ids == 0 {
            return Ok(plan_of(vec![], vec![]));
        }
        let mut scratch = Vec::new();
        emb_sort(
            &mut calls,
            &mut scratch,
            field_rows,
            total,
            (KArg::In(0), KArg::In(1)),
            n_ids,
            n_off.saturating_sub(1),
            Some((Out(0), Out(1))),
        )?;
        Ok(plan_of(calls, scratch))
    }

    pub(crate) fn embedding_bag_grad_dense(
        op: &Op,
        o: &Operands,
        field_rows: &[usize],
    ) -> Result<CudaPlan, String> {
        expect(op, o, &[F, I, I], &[F])?;
        let (mut calls, total) = emb_meta(op, field_rows)?;
        let d = emb_table_width(op, "dtable", o.outs[0], total)?;
        let (n_ids, n_off) = emb_ids(op, o.ins[1], o.ins[2])?;
        let zero = ew(
            "ew_fill_u32",
            total * d,
            vec![Out(0), n64(total * d), KArg::U32(0)],
        );
        if n_ids == 0 || d == 0 {
            return Ok(plan_of(vec![zero], vec![]));
        }
        let n_bags = (o.ins[0].numel() / d).min(n_off.saturating_sub(1));
        let mut scratch = Vec::new();
        calls.push(zero);
        let (rows, bags) = emb_sort(
            &mut calls,
            &mut scratch,
            field_rows,
            total,
            (KArg::In(1), KArg::In(2)),
            n_ids,
            n_bags,
            None,
        )?;
        emb_segments(
            &mut calls,
            &mut scratch,
            total,
            (rows, bags, KArg::In(0)),
            n_ids,
            n_bags,
            d,
            SegDst::Dense,
        )?;
        Ok(plan_of(calls, scratch))
    }

    /// Row-wise Adagrad: the occurrences sorted by row (here, or by an `EmbeddingSort` whose
    /// outputs are inputs 3 and 4), each row's gradient summed over them in that order into
    /// G at the run's first position, then `emb_adagrad_apply` a warp per run.
    pub(crate) fn rowwise_adagrad(
        op: &Op,
        o: &Operands,
        lr: f64,
        eps: f64,
        field_rows: &[usize],
    ) -> Result<CudaPlan, String> {
        let presorted = o.ins.len() == 5;
        if presorted {
            expect(op, o, &[I, I, F, I, I], &[])?;
        } else {
            expect(op, o, &[I, I, F], &[])?;
        }
        let (meta_calls, total) = emb_meta(op, field_rows)?;
        let d = o.ins[2].last();
        if o.upd.len() != 2 || o.upd[0].dims() != [total, d] || o.upd[1].numel() != total {
            return Err(format!(
                "rowwise_adagrad: table and accumulator must be [{total}, {d}] and [{total}] for dpooled {}",
                o.ins[2]
            ));
        }
        let (n_ids, n_off) = emb_ids(op, o.ins[0], o.ins[1])?;
        if presorted && (o.ins[3].numel() != n_ids || o.ins[4].numel() != n_ids) {
            return Err(format!(
                "rowwise_adagrad: sorted rows {} and bags {} for {n_ids} ids",
                o.ins[3], o.ins[4]
            ));
        }
        if n_ids == 0 || d == 0 {
            return Ok(plan_of(vec![], vec![]));
        }
        let n_bags = (o.ins[2].numel() / d).min(n_off.saturating_sub(1));
        let mut calls = Vec::new();
        let mut scratch = Vec::new();
        let (rows, bags) = if presorted {
            (KArg::In(3), KArg::In(4))
        } else {
            calls = meta_calls;
            emb_sort(
                &mut calls,
                &mut scratch,
                field_rows,
                total,
                (KArg::In(0), KArg::In(1)),
                n_ids,
                n_bags,
                None,
            )?
        };
        let g = scratch.len();
        scratch.push(4 * n_ids * d);
        emb_segments(
            &mut calls,
            &mut scratch,
            total,
            (rows, bags, KArg::In(2)),
            n_ids,
            n_bags,
            d,
            SegDst::ByPosition(g),
        )?;
        calls.push(warp_rows(
            "emb_adagrad_apply",
            n_ids,
            vec![
                rows,
                Scratch(g),
                I32(n_ids as i32),
                I32(i32_of(d, "embedding dim")?),
                I32(total as i32),
                Upd(0),
                Upd(1),
                F32(lr as f32),
                F32(eps as f32),
                F32((1.0 / d as f64) as f32),
            ],
        ));
        Ok(plan_of(calls, scratch))
    }
}

// ---- the cost estimate ----
pub(crate) mod cost {
    use crate::launch::{ceil, elementwise, Cost, LaunchSpec};

    /// The lookup and its dense gradient: each looked-up row is read once, each pooled
    /// row written once.
    pub(crate) fn embedding_bag(c: &Cost) -> LaunchSpec {
        let out0 = c.out0();
        LaunchSpec {
            kernel: "embedding_bag_fwd",
            grid: ceil(out0 / c.outs[0].last().max(1), 8),
            block: 256,
            regs_per_thread: 40,
            smem_bytes: 0,
            flops: out0 as f64,
            bytes: (c.ins[1].numel() * c.outs[0].last()) as f64 * c.e + c.out_bytes(),
            tensor_core: false,
            copies: false,
            attention: false,
            extra_launches: 0,
        }
    }

    /// Reads y and the offsets and ids once, writes z.
    pub(crate) fn bag_mean(c: &Cost) -> LaunchSpec {
        let ids = (c.ins[1].numel() + c.ins[2].numel()) as f64 * 4.0;
        elementwise("emb_bag_mean", c.out0(), 2.0 * c.out_bytes() + ids)
    }

    /// The keys, then one 8-bit LSD pass per byte the row keys use, each reading and
    /// writing keys and bags.
    pub(crate) fn embedding_sort(c: &Cost, field_rows: &[usize]) -> LaunchSpec {
        let n = c.ins[0].numel();
        let total: usize = field_rows.iter().sum();
        let passes = ((usize::BITS - total.leading_zeros()) as usize)
            .div_ceil(8)
            .max(1);
        LaunchSpec {
            kernel: "emb_radix_scatter",
            grid: ceil(n, 2048).max(1),
            block: 256,
            regs_per_thread: 32,
            smem_bytes: 4 * 1024,
            flops: (8 * n) as f64,
            bytes: (12 * n + passes * 16 * n) as f64,
            tensor_core: false,
            copies: false,
            attention: false,
            extra_launches: 0,
        }
    }

    pub(crate) fn rowwise_adagrad(c: &Cost) -> LaunchSpec {
        let d = c.ins[2].last();
        let n = c.ins[0].numel();
        LaunchSpec {
            kernel: "embedding_bag_bwd_rowwise_adagrad",
            grid: ceil(n, 8),
            block: 256,
            regs_per_thread: 48,
            smem_bytes: 8 * 1024,
            flops: (4 * n * d) as f64,
            bytes: (3 * n * d) as f64 * 4.0,
            tensor_core: false,
            copies: false,
            attention: false,
            extra_launches: 0,
        }
    }
}
