//! Embedding bags over several tables stacked in one parameter, their dense gradient and
//! the row-wise Adagrad update. Ids come from data, so they are validated here and a bad
//! one is an error naming the bag, not a panic. An id of [`PAD`] fills a slot of a bag
//! shorter than its field's capacity (multi-hot fields of variable length in a static
//! shape): it has no row, adds nothing and gets no gradient, as the CUDA kernels skip
//! ids outside their table.

/// The id of an empty slot of a bag.
pub const PAD: i32 = -1;

use super::kernels::for_rows;
use super::real::Real;
use super::{get, get_i32, out, Elem, NodeCall};
use crate::buffer::Buffer;
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

/// Embedding bags, mean pooling, the dense table gradient and row-wise Adagrad.
pub(super) fn exec_embedding<T: Elem>(
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
