//! Sharded embedding tables on CUDA ranks: where each rank stores the rows of each field,
//! the `shard_ids` kernel that maps a batch's ids into that storage (and tells every owner
//! which rows it is asked for), its CPU reference, and the blocks of the rows' all-to-all.
//!
//! A rank stores, field by field, the rows it holds (every row of a replicated field,
//! the whole of a table-wise field placed on it, its range of a row-wise field), then one
//! landing block of `examples · hot` rows for each other rank that owns rows of the field.
//! The step (see [`crate::cuda::collective`]):
//! 1. `shard_ids` rewrites the batch's ids in place into storage ids and writes, for every
//!    rank `k`, the ids it is asked for (field-major, `ufm`) and the occurrences it holds
//!    (bag order, `ubm`);
//! 2. one all-to-all sends both to their owners;
//! 3. each owner gathers the rows asked of it (the lookup kernel with one id a bag) and a
//!    second all-to-all sends each field's block straight into the asker's landing block,
//!    which the step's lookup then reads;
//! 4. once the table's gradient is complete, each rank sends every owner the pooled
//!    gradients of its bags of the fields the owner has rows of (the rows' pairs in the
//!    other direction), and each owner applies row-wise Adagrad to the occurrences of the
//!    rows it owns (`ufm` of every rank, in rank order) at their places in its storage.
//!    Replicated fields' occurrences (`ubm`) and gradients are gathered from every rank,
//!    as with replicated tables, and applied by every rank.
//!
//! Every position is fixed by the batch's shape, so the step is the same sequence of
//! launches and NCCL calls every time, and can be captured in a CUDA graph.

use erase_ops::cuda::{KArg, KernelCall};

/// A padding id (no row).
pub const PAD: i32 = -1;

/// How a field's rows are placed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FieldKind {
    /// Every rank holds every row.
    Replicated,
    /// One rank holds every row.
    Table(usize),
    /// Rank `k` holds rows `k·per .. (k+1)·per`.
    Row { per: usize },
}

/// Where one field lives on one rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FieldOnRank {
    /// The field's rows the rank holds: `start .. start + len`.
    pub start: usize,
    pub len: usize,
    /// Where the field begins in the rank's stacked storage.
    pub base: usize,
}

/// The placement of every field on every rank, as one rank (`rank`) sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct ShardGeometry {
    pub rank: usize,
    pub world: usize,
    /// Examples of a rank's batch, and the slots of each bag (every bag the same).
    pub examples: usize,
    pub hot: usize,
    /// Rows of each whole field.
    pub rows: Vec<usize>,
    pub kinds: Vec<FieldKind>,
    /// `on[k][f]`: field `f` on rank `k`.
    pub on: Vec<Vec<FieldOnRank>>,
    /// `landing[f][k]`: where, within field `f` of this rank's storage, the block of the
    /// rows rank `k` owns lands (`None`: k sends none of `f` here).
    pub landing: Vec<Vec<Option<usize>>>,
    /// Rows of each field in this rank's storage.
    pub stored: Vec<usize>,
}

/// One block of the rows' all-to-all: `rows` rows to or from `peer`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowBlock {
    pub peer: usize,
    pub field: usize,
    /// Send: the first row in this rank's answer buffer (`peer · n + field · examples ·
    /// hot`). Receive: the first row in this rank's stacked storage.
    pub at: usize,
    pub rows: usize,
}

impl ShardGeometry {
    /// Id slots of a rank's batch.
    pub fn n_ids(&self) -> usize {
        self.examples * self.rows.len() * self.hot
    }

    /// Id slots of one field in a rank's batch: a landing block's rows.
    pub fn per_field(&self) -> usize {
        self.examples * self.hot
    }

    /// Rows of this rank's stacked storage.
    pub fn stored_total(&self) -> usize {
        self.stored.iter().sum()
    }

    /// The owner of id `id` of field `f` (`None`: replicated, or out of range).
    fn owner(&self, f: usize, id: i32) -> Option<usize> {
        if id < 0 || id as usize >= self.rows[f] {
            return None;
        }
        let k = match self.kinds[f] {
            FieldKind::Replicated => return None,
            FieldKind::Table(k) => k,
            FieldKind::Row { per } => id as usize / per.max(1),
        };
        (k < self.world).then_some(k)
    }

    /// The kernel's arguments `kind` (three per field) and `geo` (four per rank and
    /// field).
    pub fn tables(&self) -> (Vec<i32>, Vec<i32>) {
        let kind = self
            .kinds
            .iter()
            .zip(&self.rows)
            .flat_map(|(k, &rows)| match *k {
                FieldKind::Replicated => [0, 0, rows as i32],
                FieldKind::Table(o) => [1, o as i32, rows as i32],
                FieldKind::Row { per } => [2, per as i32, rows as i32],
            })
            .collect();
        let geo = self
            .on
            .iter()
            .enumerate()
            .flat_map(|(k, fields)| {
                fields.iter().enumerate().flat_map(move |(f, x)| {
                    let land = self.landing[f][k].map_or(-1, |l| l as i32);
                    [x.start as i32, x.len as i32, x.base as i32, land]
                })
            })
            .collect();
        (kind, geo)
    }

    /// What `shard_ids` computes, on the CPU: the storage ids of `ids` (a rank's batch)
    /// and every rank's `ubm` (occurrences of replicated rows, bag order) and `ufm` (of
    /// the rows the rank owns alone, field-major; see the kernel).
    pub fn reference(&self, ids: &[i32]) -> (Vec<i32>, Vec<i32>, Vec<i32>) {
        let (n, nf, hot) = (ids.len(), self.rows.len(), self.hot);
        let per_field = n / nf.max(1);
        let mut local = vec![PAD; n];
        let mut ubm = vec![PAD; self.world * n];
        let mut ufm = vec![PAD; self.world * n];
        for (s, &id) in ids.iter().enumerate() {
            let bag = s / hot;
            let f = bag % nf;
            let pos = (bag / nf) * hot + s % hot;
            let fm = f * per_field + pos;
            if id < 0 || id as usize >= self.rows[f] {
                continue;
            }
            let owner = self.owner(f, id);
            if matches!(self.kinds[f], FieldKind::Row { .. } | FieldKind::Table(_))
                && owner.is_none()
            {
                continue;
            }
            for k in 0..self.world {
                let x = self.on[k][f];
                let at = || (x.base + id as usize - x.start) as i32;
                match owner {
                    None => ubm[k * n + s] = at(),
                    Some(o) if o == k => ufm[k * n + fm] = at(),
                    Some(_) => {}
                }
            }
            local[s] = match owner {
                None => id - self.on[self.rank][f].start as i32,
                Some(k) if k == self.rank => id - self.on[self.rank][f].start as i32,
                Some(k) => self.landing[f][k].map_or(PAD, |l| (l + pos) as i32),
            };
        }
        (local, ubm, ufm)
    }

    /// The `shard_ids` launch on `ids` (rewritten in place, `KArg::In(0)`), the tables
    /// (`In(1)` kind, `In(2)` geo) and the outputs (`Out(0)` ubm, `Out(1)` ufm, each
    /// `world · n` i32).
    pub fn shard_ids_call(&self) -> KernelCall {
        let n = self.n_ids();
        KernelCall {
            kernel: "shard_ids",
            grid: [n.div_ceil(256).clamp(1, 65535) as u32, 1, 1],
            block: [256, 1, 1],
            smem: 0,
            args: vec![
                KArg::In(0),
                KArg::In(1),
                KArg::In(2),
                KArg::Out(0),
                KArg::Out(1),
                KArg::I32(n as i32),
                KArg::I32(self.rows.len() as i32),
                KArg::I32(self.hot as i32),
                KArg::I32(self.world as i32),
                KArg::I32(self.rank as i32),
            ],
        }
    }

    /// The blocks this rank sends: to each other rank, each field it owns rows of that
    /// the other does not hold whole (its answers to that rank's asks of the field). In
    /// the backward the same pairs run the other way: this rank receives those ranks'
    /// bags' gradients of the field.
    pub fn sends(&self) -> Vec<RowBlock> {
        let (n, pf) = (self.n_ids(), self.per_field());
        let mut v = Vec::new();
        for j in (0..self.world).filter(|&j| j != self.rank) {
            for f in 0..self.rows.len() {
                let owns = !matches!(self.kinds[f], FieldKind::Replicated)
                    && self.on[self.rank][f].len > 0;
                if owns && self.on[j][f].len < self.rows[f] {
                    v.push(RowBlock {
                        peer: j,
                        field: f,
                        at: j * n + f * pf,
                        rows: pf,
                    });
                }
            }
        }
        v
    }

    /// Bags of one rank's batch.
    pub fn bags(&self) -> usize {
        self.examples * self.rows.len()
    }

    /// The bags (rows of the pooled gradient `[examples · fields, D]`) this rank sends
    /// its owners in the backward, block after block in the order of
    /// [`ShardGeometry::receives`]: each block the field's bags, example by example.
    pub fn grad_send_bags(&self) -> Vec<i32> {
        let nf = self.rows.len();
        self.receives()
            .iter()
            .flat_map(|b| (0..self.examples).map(move |e| (e * nf + b.field) as i32))
            .collect()
    }

    /// The bags of this rank's own gradient block, field-major (`[fields][examples]`):
    /// a field's bags where this rank owns rows of it alone, PAD elsewhere.
    pub fn grad_own_bags(&self) -> Vec<i32> {
        let nf = self.rows.len();
        (0..nf)
            .flat_map(|f| {
                let owns = self.kinds[f] != FieldKind::Replicated && self.on[self.rank][f].len > 0;
                (0..self.examples).map(move |e| if owns { (e * nf + f) as i32 } else { PAD })
            })
            .collect()
    }

    /// Whether any field is replicated (its occurrences are then gathered from every
    /// rank, as with replicated tables).
    pub fn any_replicated(&self) -> bool {
        self.kinds.contains(&FieldKind::Replicated)
    }

    /// The blocks this rank receives: from each owner, each field it has a landing block
    /// for, into that block of its storage. In the backward the same pairs run the other
    /// way: this rank sends each of those owners its bags' gradients of the field.
    pub fn receives(&self) -> Vec<RowBlock> {
        let pf = self.per_field();
        let mut v = Vec::new();
        for k in (0..self.world).filter(|&k| k != self.rank) {
            for f in 0..self.rows.len() {
                if let Some(l) = self.landing[f][k] {
                    v.push(RowBlock {
                        peer: k,
                        field: f,
                        at: self.on[self.rank][f].base + l,
                        rows: pf,
                    });
                }
            }
        }
        v
    }
}
