//! Sharded embedding tables on CPU ranks: each table (a field of the stacked table) is
//! replicated, whole on one rank (table-wise) or split by rows over every rank
//! (row-wise), as [`crate::sharding::plan`] places it. A rank stores only the rows it
//! owns (and every row of a replicated field), followed, for each field it does not
//! hold whole, by a landing area of one row per id slot of its batch: its step graph is
//! built with those storage sizes (`CtrConfig::storage_rows`). In each step:
//!
//! 1. **Lookup.** The rank maps each id of its batch into its storage: an owned row to
//!    its place, any other row to a landing slot (one per distinct row). It sends each
//!    owner the rows it needs from it (one jagged all-to-all of ids), the owners answer
//!    with the rows (a second one), the rows land in their slots, and the step's lookup
//!    reads the remapped ids: each bag sums the same rows in its own order, as on one
//!    process.
//! 2. **Update.** After the backward, every rank sends each owner the occurrences of its
//!    rows (row, pooled gradient) in bag order (a third all-to-all; a replicated row's go
//!    to every rank); each owner concatenates them in rank order and applies the fused
//!    row-wise Adagrad to the rows it owns. Every row's gradient sums the same terms in
//!    the same order as the replicated update, which gathers every rank's occurrences:
//!    the same bits.
//! 3. **Whole tables** where a step needs them (a checkpoint, the end): every owner
//!    sends its rows and their Adagrad state to rank 0 (a fourth all-to-all, empty to
//!    the other ranks), which assembles a whole copy beside its storage until the next
//!    step and writes it, so a checkpoint holds each table whole, whatever the sharding,
//!    and resumes on any rank count, while one host holds one whole copy, not one a rank.
//!    An evaluation needs none: its forward looks rows up as a step does.

use std::collections::HashMap;

use anyhow::{anyhow, bail, Context, Result};

use crate::sharding::{Placement, Sharding, Table};
use erase_graph::{Graph, Leaf, NodeId, Op, Shape, Tensor};
use erase_ops::cpu::embedding::{Bags, PAD};
use erase_ops::{Buffer, NodeCall};
use erase_runtime::collective::Collective;
use erase_runtime::cpu::runner::ProgramRunner;

/// The rank that assembles the whole sharded tables for a checkpoint and the end (the
/// rank that writes checkpoints); the others hold only their rows.
pub(crate) const WHOLE_RANK: usize = 0;

/// Who holds a row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Owner {
    Every,
    One(usize),
}

/// Where one field's rows live in a rank's storage.
#[derive(Clone, Debug, PartialEq)]
struct FieldStore {
    placement: Placement,
    /// Rows of the whole field, and where it starts in the whole stacked table.
    rows: usize,
    base: usize,
    /// The rows of the field this rank holds (`own_start ..+ own_len`: all of them for a
    /// replicated field or one placed here, a range of them row-wise, none otherwise).
    own_start: usize,
    own_len: usize,
    /// Where the field starts in this rank's storage, and its landing slots after the
    /// rows it holds.
    local_base: usize,
    landing: usize,
    /// With [`Landing::PerOwner`]: where (within the field's storage) the block of the
    /// rows each rank owns lands; empty with [`Landing::Distinct`].
    landing_at: Vec<Option<usize>>,
}

/// How a rank lays out the landing slots of a field it does not hold whole.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Landing {
    /// One slot per id slot of its batch, filled with the distinct rows it fetches (CPU
    /// ranks: the lookup maps ids on the host).
    Distinct,
    /// One block of a slot per id slot of its batch for each other rank that owns rows of
    /// the field, each id landing at its own position in its owner's block (CUDA ranks:
    /// every position fixed by the batch's shape, so the exchange can be captured).
    PerOwner,
}

/// The rows of a field placed `placement` that rank `k` of `world` holds: (start, len).
fn held_range(placement: Placement, rows: usize, k: usize, world: usize) -> (usize, usize) {
    match placement {
        Placement::Replicated => (0, rows),
        Placement::Table(o) if o == k => (0, rows),
        Placement::Table(_) => (0, 0),
        Placement::Row => {
            let per = row_share(rows, world);
            let start = (k * per).min(rows);
            (start, ((k + 1) * per).min(rows) - start)
        }
    }
}

impl FieldStore {
    /// Rows of the field in this rank's storage (at least one: a table of no rows is
    /// not a table).
    fn stored(&self) -> usize {
        (self.own_len + self.landing).max(1)
    }
}

/// Where every field of the trainer's stacked table lives on one rank: the placement
/// of [`crate::sharding::plan`] and the storage it gives this rank.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Storage {
    fields: Vec<FieldStore>,
    rank: usize,
    world: usize,
}

impl Storage {
    /// The fields of `field_rows` rows (width `dim`, `slots[f]` ids of field `f` in each
    /// of the rank's `batch` examples) placed for rank `rank` of `world`, each rank
    /// holding at most `budget` bytes of tables (`mode`), with landing slots laid out
    /// `landing_kind`: `None` when every table stays replicated (the step then gathers
    /// the sparse gradients as it always has).
    pub(crate) fn plan(
        field_rows: &[usize],
        slots: &[usize],
        (dim, batch): (usize, usize),
        (rank, world): (usize, usize),
        budget: u64,
        (mode, landing_kind): (Sharding, Landing),
    ) -> Result<Option<Storage>> {
        let tables: Vec<Table> = field_rows
            .iter()
            .enumerate()
            .map(|(i, &rows)| Table {
                name: format!("C{}", i + 1),
                rows,
                dim,
            })
            .collect();
        let placements = crate::sharding::plan(&tables, world, budget, mode)?.placements;
        if placements.iter().all(|p| *p == Placement::Replicated) {
            return Ok(None);
        }
        let (mut base, mut local_base) = (0, 0);
        let mut fields = Vec::with_capacity(field_rows.len());
        for (f, (&rows, &placement)) in field_rows.iter().zip(&placements).enumerate() {
            let (own_start, own_len) = held_range(placement, rows, rank, world);
            let block = batch * slots.get(f).copied().unwrap_or(1);
            let (mut landing, mut landing_at) = (0, Vec::new());
            if own_len < rows {
                match landing_kind {
                    Landing::Distinct => landing = block,
                    Landing::PerOwner => {
                        landing_at = (0..world)
                            .map(|k| {
                                let owns = k != rank
                                    && placement != Placement::Replicated
                                    && held_range(placement, rows, k, world).1 > 0;
                                owns.then(|| {
                                    let at = own_len + landing;
                                    landing += block;
                                    at
                                })
                            })
                            .collect();
                    }
                }
            }
            let fs = FieldStore {
                placement,
                rows,
                base,
                own_start,
                own_len,
                local_base,
                landing,
                landing_at,
            };
            base += rows;
            local_base += fs.stored();
            fields.push(fs);
        }
        let store = Storage {
            fields,
            rank,
            world,
        };
        Ok(Some(store))
    }

    /// Every rank's storage of the placement, laid out for CUDA ranks
    /// ([`Landing::PerOwner`]), in rank order: `None` when every table stays replicated.
    pub(crate) fn all_ranks(
        field_rows: &[usize],
        slots: &[usize],
        (dim, batch): (usize, usize),
        world: usize,
        budget: u64,
        mode: Sharding,
    ) -> Result<Option<Vec<Storage>>> {
        (0..world)
            .map(|k| {
                Storage::plan(
                    field_rows,
                    slots,
                    (dim, batch),
                    (k, world),
                    budget,
                    (mode, Landing::PerOwner),
                )
            })
            .collect::<Result<Option<Vec<_>>>>()
    }

    /// Rows of each field in this rank's storage (`CtrConfig::storage_rows`).
    /// The landing slots of every field, in rows: the rows this rank fetches each step
    /// (outside `--rank-memory`, which budgets the rows it holds).
    pub(crate) fn landing_rows(&self) -> usize {
        self.fields.iter().map(|f| f.landing).sum()
    }

    pub(crate) fn stored_rows(&self) -> Vec<usize> {
        self.fields.iter().map(FieldStore::stored).collect()
    }

    /// The CUDA kernels' view of the placement (laid out [`Landing::PerOwner`]), as rank
    /// `self.rank` sees it: `all[k]` is rank `k`'s storage, `hot` the slots of every bag.
    pub(crate) fn geometry(
        &self,
        all: &[Storage],
        examples: usize,
        hot: usize,
    ) -> Result<erase_runtime::cuda::sharded::ShardGeometry> {
        use erase_runtime::cuda::sharded::{FieldKind, FieldOnRank, ShardGeometry};
        if all.len() != self.world || all.iter().any(|s| s.fields.len() != self.fields.len()) {
            bail!("the ranks' table placements disagree");
        }
        let kinds = self
            .fields
            .iter()
            .map(|f| match f.placement {
                Placement::Replicated => FieldKind::Replicated,
                Placement::Table(k) => FieldKind::Table(k),
                Placement::Row => FieldKind::Row {
                    per: row_share(f.rows, self.world),
                },
            })
            .collect();
        let on = all
            .iter()
            .map(|s| {
                s.fields
                    .iter()
                    .map(|f| FieldOnRank {
                        start: f.own_start,
                        len: f.own_len,
                        base: f.local_base,
                    })
                    .collect()
            })
            .collect();
        let landing = self
            .fields
            .iter()
            .map(|f| {
                (0..self.world)
                    .map(|k| f.landing_at.get(k).copied().flatten())
                    .collect()
            })
            .collect();
        let g = ShardGeometry {
            rank: self.rank,
            world: self.world,
            examples,
            hot,
            rows: self.field_rows(),
            kinds,
            on,
            landing,
            stored: self.stored_rows(),
        };
        if g.stored_total() >= i32::MAX as usize {
            bail!(
                "a rank's {} stored rows do not fit the kernels' i32 ids",
                g.stored_total()
            );
        }
        Ok(g)
    }

    fn field_rows(&self) -> Vec<usize> {
        self.fields.iter().map(|f| f.rows).collect()
    }

    /// This rank's initial storage of table `table` of `g` (width from `g`): the rows it
    /// holds at the whole table's initial values (parameters drawn from `seed`), the
    /// landing slots at zero.
    pub(crate) fn initial(&self, g: &Graph, table: Tensor, seed: u64) -> Result<Vec<f32>> {
        let d = g.shape(table).dims().get(1).copied().unwrap_or(1);
        let index = param_index(g, table)?;
        let held: Vec<(usize, usize)> = self.held().collect();
        let rows: Vec<usize> = held.iter().map(|h| h.0).collect();
        let init = erase_runtime::init::init_table_rows(&self.field_rows(), d, seed, index, &rows);
        let mut local = vec![0f32; self.stored_total() * d];
        for (i, &(_, at)) in held.iter().enumerate() {
            for (o, &v) in local[at * d..(at + 1) * d]
                .iter_mut()
                .zip(&init[i * d..(i + 1) * d])
            {
                *o = v as f32;
            }
        }
        Ok(local)
    }

    /// Step 3 of the module documentation: every rank's rows of the table `name` (this
    /// rank's storage `table` of width `d`, its row-wise Adagrad state `acc`) sent over
    /// `comm` to rank 0 ([`WHOLE_RANK`]), which returns the whole table and state; every
    /// other rank returns `None`. Every rank must call it, in the same order.
    pub(crate) fn assemble<C: Collective>(
        &self,
        name: &str,
        table: &[f32],
        acc: &[f32],
        d: usize,
        comm: &mut C,
    ) -> Result<Option<(Vec<f32>, Vec<f32>)>> {
        if table.len() != self.stored_total() * d || acc.len() != self.stored_total() {
            bail!(
                "'{name}': {} and {} stored values, the placement stores {} rows of {d}",
                table.len(),
                acc.len(),
                self.stored_total()
            );
        }
        let whole_here = self.rank == WHOLE_RANK;
        let mine: Vec<u8> = self
            .owned_by(self.rank)
            .filter(|_| !whole_here)
            .flat_map(|r| {
                let at = self.local(r).unwrap_or(0);
                table[at * d..(at + 1) * d]
                    .iter()
                    .chain(std::iter::once(&acc[at]))
                    .flat_map(|v| v.to_le_bytes())
                    .collect::<Vec<u8>>()
            })
            .collect();
        let mut parts = vec![Vec::new(); self.world];
        parts[WHOLE_RANK] = mine;
        let got = comm.all_to_all(&format!("{name}.whole"), &parts)?;
        if !whole_here {
            return Ok(None);
        }
        let n = self.whole_rows();
        let (mut wt, mut wa) = (vec![0f32; n * d], vec![0f32; n]);
        for (r, at) in self.held() {
            wt[r * d..(r + 1) * d].copy_from_slice(&table[at * d..(at + 1) * d]);
            wa[r] = acc[at];
        }
        for (k, b) in got.iter().enumerate() {
            if k == self.rank {
                continue;
            }
            let vals = f32s_of(b);
            let rows: Vec<usize> = self.owned_by(k).collect();
            if vals.len() != rows.len() * (d + 1) {
                bail!(
                    "'{name}': rank {k} sent {} values for its {} rows",
                    vals.len(),
                    rows.len()
                );
            }
            for (i, r) in rows.into_iter().enumerate() {
                let v = &vals[i * (d + 1)..(i + 1) * (d + 1)];
                wt[r * d..(r + 1) * d].copy_from_slice(&v[..d]);
                wa[r] = v[d];
            }
        }
        Ok(Some((wt, wa)))
    }

    /// A whole table `b` of rows of `width` values (a resumed checkpoint's table, or its
    /// state with `width` 1) written into this rank's storage `local`: the rows it holds.
    pub(crate) fn scatter(
        &self,
        name: &str,
        b: &Buffer,
        width: usize,
        local: &mut [f32],
    ) -> Result<()> {
        let Buffer::F32(v) = b else {
            bail!("'{name}' must be f32, not {}", b.dtype());
        };
        if v.len() != self.whole_rows() * width {
            bail!(
                "'{name}' has {} values; the whole table needs {}",
                v.len(),
                self.whole_rows() * width
            );
        }
        if local.len() != self.stored_total() * width {
            bail!(
                "'{name}': {} stored values, the placement stores {} rows of {width}",
                local.len(),
                self.stored_total()
            );
        }
        for (r, at) in self.held() {
            local[at * width..(at + 1) * width].copy_from_slice(&v[r * width..(r + 1) * width]);
        }
        Ok(())
    }

    /// The whole table's shape of `t` (a table or its state) in graph `g`: its storage
    /// shape with the whole table's rows.
    pub(crate) fn whole_dims(&self, g: &Graph, t: Tensor) -> Vec<usize> {
        let mut dims = g.shape(t).dims().to_vec();
        if let Some(first) = dims.first_mut() {
            *first = self.whole_rows();
        }
        dims
    }

    fn whole_rows(&self) -> usize {
        self.fields.iter().map(|f| f.rows).sum()
    }

    fn stored_total(&self) -> usize {
        self.fields.iter().map(FieldStore::stored).sum()
    }

    /// The field of a row of the whole stacked table.
    fn field_of(&self, row: usize) -> usize {
        self.fields
            .partition_point(|f| f.base <= row)
            .saturating_sub(1)
    }

    /// The owner of row `row` of the whole stacked table.
    fn owner(&self, row: usize) -> Owner {
        let f = &self.fields[self.field_of(row)];
        match f.placement {
            Placement::Replicated => Owner::Every,
            Placement::Table(k) => Owner::One(k),
            Placement::Row => Owner::One((row - f.base) / row_share(f.rows, self.world)),
        }
    }

    /// Where row `row` of the whole stacked table is in this rank's storage, if it holds
    /// it (owned or replicated).
    fn local(&self, row: usize) -> Option<usize> {
        let f = &self.fields[self.field_of(row)];
        let id = row.checked_sub(f.base)?;
        (id >= f.own_start && id < f.own_start + f.own_len).then(|| f.local_base + id - f.own_start)
    }

    /// The rows of the whole stacked table this rank holds, with their places in its
    /// storage, in row order.
    fn held(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.fields
            .iter()
            .flat_map(|f| (0..f.own_len).map(move |i| (f.base + f.own_start + i, f.local_base + i)))
    }

    /// The rows rank `k` owns alone (not replicated ones), in row order.
    fn owned_by(&self, k: usize) -> impl Iterator<Item = usize> + '_ {
        self.fields.iter().flat_map(move |f| {
            let range = match f.placement {
                Placement::Replicated => 0..0,
                Placement::Table(o) if o == k => 0..f.rows,
                Placement::Table(_) => 0..0,
                Placement::Row => {
                    let per = row_share(f.rows, self.world);
                    (k * per).min(f.rows)..((k + 1) * per).min(f.rows)
                }
            };
            range.map(move |r| f.base + r)
        })
    }
}

/// Rows of a row-wise field each rank owns (the last ones may own fewer, or none).
fn row_share(rows: usize, world: usize) -> usize {
    rows.div_ceil(world.max(1)).max(1)
}

/// The trainer's stacked table (its `RowwiseAdagrad` node's tensors) on a rank that
/// stores only its own rows, and what the current step needs of it.
pub(crate) struct ShardedTables {
    store: Storage,
    name: String,
    ids: Tensor,
    offsets: Tensor,
    dpooled: Tensor,
    table: Tensor,
    acc: Tensor,
    dim: usize,
    lr: f64,
    eps: f64,
    /// The whole-table ids of the batch last looked up (the runner holds them remapped).
    step_ids: Option<Vec<i32>>,
    /// Whether the runner's ids are a fed batch's, not yet remapped.
    fresh: bool,
    /// A whole copy of the table and its state, from [`ShardedTables::assemble`] until
    /// the next update, on rank [`WHOLE_RANK`] alone.
    whole: Option<(Vec<f32>, Vec<f32>)>,
}

impl ShardedTables {
    /// The sharded tables of a rank's step program `g` (built with `store`'s storage
    /// rows), whose row-wise Adagrad updates are `nodes`: the trainer's one stacked
    /// table. Initialises the rows the rank holds to the whole table's initial values
    /// (parameters drawn from `seed`).
    pub(crate) fn new(
        g: &Graph,
        nodes: &[NodeId],
        store: Storage,
        runner: &mut ProgramRunner,
        seed: u64,
    ) -> Result<ShardedTables> {
        let &[id] = nodes else {
            bail!(
                "sharding takes the trainer's one set of embedding tables; the step has {} row-wise Adagrad updates",
                nodes.len()
            );
        };
        let n = g.node(id);
        let Op::RowwiseAdagrad {
            lr,
            eps,
            field_rows,
        } = &n.op
        else {
            bail!("'{}' is not a row-wise Adagrad update", n.name);
        };
        let (&[ids, offsets, dpooled], &[table, acc]) = (&n.inputs[..], &n.updates[..]) else {
            bail!(
                "'{}': sharding takes a row-wise Adagrad of (ids, offsets, pooled gradient) on (table, state)",
                n.name
            );
        };
        if *field_rows != store.stored_rows() {
            bail!(
                "'{}': the step stores {field_rows:?} rows of each field, its placement {:?}",
                n.name,
                store.stored_rows()
            );
        }
        let dim = g.shape(table).dims()[1];
        let t = ShardedTables {
            name: n.name.clone(),
            ids,
            offsets,
            dpooled,
            table,
            acc,
            dim,
            lr: *lr,
            eps: *eps,
            step_ids: None,
            fresh: false,
            whole: None,
            store,
        };
        runner.feed(table, Buffer::F32(t.store.initial(g, table, seed)?))?;
        Ok(t)
    }

    /// The batch's ids tensor: a batch fed to it is looked up by the next
    /// [`ShardedTables::fetch`].
    pub(crate) fn ids(&self) -> Tensor {
        self.ids
    }

    /// Marks the runner's ids as a newly fed batch's.
    pub(crate) fn fed(&mut self) {
        self.fresh = true;
    }

    /// Step 1: the rows this rank's batch needs from other ranks fetched into its landing
    /// slots, and the batch's ids remapped into its storage.
    pub(crate) fn fetch<C: Collective>(
        &mut self,
        runner: &mut ProgramRunner,
        comm: &mut C,
    ) -> Result<()> {
        if !self.fresh {
            bail!(
                "'{}': the lookup needs a newly fed batch (its ids were looked up already)",
                self.name
            );
        }
        let st = &self.store;
        let (ids, offsets) = (i32s(runner, self.ids)?, i32s(runner, self.offsets)?);
        let field_rows = st.field_rows();
        let bags =
            Bags::new(&ids, &offsets, &field_rows).map_err(|e| anyhow!("'{}': {e}", self.name))?;
        let nf = field_rows.len();
        // per owner: the rows asked of it and the storage slots they land in
        let mut want: Vec<Vec<u32>> = vec![Vec::new(); st.world];
        let mut land: Vec<Vec<usize>> = vec![Vec::new(); st.world];
        let mut slot_of: HashMap<usize, usize> = HashMap::new();
        let mut used = vec![0usize; nf];
        let mut local_ids = ids.clone();
        for bag in 0..bags.num_bags() {
            let (lo, hi) = (offsets[bag] as usize, offsets[bag + 1] as usize);
            for j in lo..hi {
                let id = ids[j];
                if id == PAD {
                    continue;
                }
                let row = bags.row(bag, id);
                let f = &st.fields[bag % nf];
                let at = match st.local(row) {
                    Some(at) => at,
                    None => {
                        let Owner::One(k) = st.owner(row) else {
                            bail!("'{}': row {row} is replicated but not held", self.name);
                        };
                        *slot_of.entry(row).or_insert_with(|| {
                            let s = f.local_base + f.own_len + used[bag % nf];
                            used[bag % nf] += 1;
                            want[k].push(row as u32);
                            land[k].push(s);
                            s
                        })
                    }
                };
                local_ids[j] = (at - f.local_base) as i32;
            }
        }
        if let Some(f) = (0..nf).find(|&f| used[f] > st.fields[f].landing) {
            bail!(
                "'{}': field {f} needs {} landing rows, it has {}",
                self.name,
                used[f],
                st.fields[f].landing
            );
        }
        let asks: Vec<Vec<u8>> = want
            .iter()
            .map(|rows| rows.iter().flat_map(|r| r.to_le_bytes()).collect())
            .collect();
        let asked = comm.all_to_all(&format!("{}.lookup ids", self.name), &asks)?;
        let mut table = take_f32(runner, self.table)?;
        let d = self.dim;
        let mut answers = Vec::with_capacity(st.world);
        for (k, b) in asked.iter().enumerate() {
            let mut rows = Vec::with_capacity(b.len() / 4 * d * 4);
            for r in u32s(b) {
                let r = r as usize;
                let at = (r < st.whole_rows() && st.owner(r) == Owner::One(st.rank))
                    .then(|| st.local(r))
                    .flatten();
                let Some(at) = at else {
                    runner.feed(self.table, Buffer::F32(table))?;
                    bail!(
                        "'{}': rank {k} asked rank {} for row {r}, which it does not own",
                        self.name,
                        st.rank
                    );
                };
                rows.extend(
                    table[at * d..(at + 1) * d]
                        .iter()
                        .flat_map(|v| v.to_le_bytes()),
                );
            }
            answers.push(rows);
        }
        let got = match comm.all_to_all(&format!("{}.lookup rows", self.name), &answers) {
            Ok(g) => g,
            Err(e) => {
                runner.feed(self.table, Buffer::F32(table))?;
                return Err(e.into());
            }
        };
        let mut bad = None;
        for (k, slots) in land.iter().enumerate() {
            let vals = f32s_of(&got[k]);
            if vals.len() != slots.len() * d {
                bad = Some(anyhow!(
                    "'{}': rank {k} answered {} values for {} rows of {d}",
                    self.name,
                    vals.len(),
                    slots.len()
                ));
                break;
            }
            for (i, &s) in slots.iter().enumerate() {
                table[s * d..(s + 1) * d].copy_from_slice(&vals[i * d..(i + 1) * d]);
            }
        }
        runner.feed(self.table, Buffer::F32(table))?;
        if let Some(e) = bad {
            return Err(e);
        }
        runner.feed(self.ids, Buffer::I32(local_ids))?;
        self.step_ids = Some(ids);
        self.fresh = false;
        Ok(())
    }

    /// Step 2: the occurrences' gradients to their owners, who apply row-wise Adagrad
    /// (each gradient scaled by `scale`, the mean over ranks, as the replicated update).
    pub(crate) fn update<C: Collective>(
        &mut self,
        runner: &mut ProgramRunner,
        comm: &mut C,
        scale: f32,
    ) -> Result<()> {
        // the whole copy is stale once the rows change
        self.whole = None;
        let st = &self.store;
        let ids = self
            .step_ids
            .take()
            .ok_or_else(|| anyhow!("'{}': the update has no lookup of its step", self.name))?;
        let offsets = i32s(runner, self.offsets)?;
        let dp = f32s(runner, self.dpooled)?;
        let field_rows = st.field_rows();
        let bags =
            Bags::new(&ids, &offsets, &field_rows).map_err(|e| anyhow!("'{}': {e}", self.name))?;
        let d = self.dim;
        if dp.len() != bags.num_bags() * d {
            bail!(
                "'{}': {} pooled-gradient values for {} bags of {d}",
                self.name,
                dp.len(),
                bags.num_bags()
            );
        }
        // per destination: the rows, then their gradients, in bag order
        let mut rows: Vec<Vec<u32>> = vec![Vec::new(); st.world];
        let mut grads: Vec<Vec<f32>> = vec![Vec::new(); st.world];
        for bag in 0..bags.num_bags() {
            for &id in bags.bag_ids(bag).iter().filter(|&&id| id != PAD) {
                let row = bags.row(bag, id);
                let g = &dp[bag * d..(bag + 1) * d];
                let to = match st.owner(row) {
                    Owner::Every => 0..st.world,
                    Owner::One(k) => k..k + 1,
                };
                for k in to {
                    rows[k].push(row as u32);
                    grads[k].extend_from_slice(g);
                }
            }
        }
        let parts: Vec<Vec<u8>> = rows
            .iter()
            .zip(&grads)
            .map(|(r, g)| {
                let mut b = (r.len() as u32).to_le_bytes().to_vec();
                b.extend(r.iter().flat_map(|x| x.to_le_bytes()));
                b.extend(g.iter().flat_map(|x| x.to_le_bytes()));
                b
            })
            .collect();
        let got = comm.all_to_all(&format!("{}.grad", self.name), &parts)?;
        // every rank's occurrences of the rows this rank holds, in rank order, at their
        // places in its storage
        let (mut all_rows, mut all_grads) = (Vec::<i32>::new(), Vec::<f32>::new());
        for (k, b) in got.iter().enumerate() {
            let bad = || anyhow!("'{}': rank {k} sent a malformed gradient part", self.name);
            let n = u32::from_le_bytes(b.get(..4).ok_or_else(bad)?.try_into()?) as usize;
            let (r, g) = b[4..].split_at_checked(4 * n).ok_or_else(bad)?;
            let g = f32s_of(g);
            if g.len() != n * d {
                return Err(bad());
            }
            for r in u32s(r) {
                let r = r as usize;
                let at = (r < st.whole_rows()).then(|| st.local(r)).flatten();
                let Some(at) = at else {
                    bail!(
                        "'{}': rank {k} sent rank {} the gradient of row {r}, which it does not hold",
                        self.name,
                        st.rank
                    );
                };
                all_rows.push(at as i32);
            }
            all_grads.extend(g.into_iter().map(|v| v * scale));
        }
        // the fused row-wise Adagrad of the op, on one "field" of every stored row: each
        // occurrence its own bag, so its rows sort stably in the order received
        let total = st.stored_total();
        let op = Op::RowwiseAdagrad {
            lr: self.lr,
            eps: self.eps,
            field_rows: vec![total],
        };
        let n = all_rows.len();
        let offs: Vec<i32> = (0..=n as i32).collect();
        let (ids_s, off_s, dp_s) = (
            Shape::new(&[n]),
            Shape::new(&[n + 1]),
            Shape::new(&[n, 1, d]),
        );
        let call = NodeCall {
            op: &op,
            name: &self.name,
            in_shapes: vec![&ids_s, &off_s, &dp_s],
            out_shapes: Vec::new(),
            bf16_gemm: false,
        };
        let ins = [
            Buffer::I32(all_rows),
            Buffer::I32(offs),
            Buffer::F32(all_grads),
        ];
        let refs: Vec<&Buffer> = ins.iter().collect();
        let mut upd = vec![
            Buffer::F32(take_f32(runner, self.table)?),
            Buffer::F32(take_f32(runner, self.acc)?),
        ];
        let r = erase_ops::execute(&call, &refs, &mut [], &mut upd)
            .with_context(|| format!("rank {}: the sharded update", st.rank));
        let [table, acc] =
            <[Buffer; 2]>::try_from(upd).map_err(|_| anyhow!("the update lost a tensor"))?;
        runner.feed(self.table, table)?;
        runner.feed(self.acc, acc)?;
        r.map(|_| ())
    }

    /// Step 3: every owner's rows and their state to rank [`WHOLE_RANK`], which holds a
    /// whole copy of the table until its next update.
    pub(crate) fn assemble<C: Collective>(
        &mut self,
        runner: &mut ProgramRunner,
        comm: &mut C,
    ) -> Result<()> {
        // taken out of the runner (no copy) and fed back, whatever the exchange gave
        let table = take_f32(runner, self.table)?;
        let acc = match take_f32(runner, self.acc) {
            Ok(a) => a,
            Err(e) => {
                runner.feed(self.table, Buffer::F32(table))?;
                return Err(e);
            }
        };
        let whole = self
            .store
            .assemble(&self.name, &table, &acc, self.dim, comm);
        runner.feed(self.table, Buffer::F32(table))?;
        runner.feed(self.acc, Buffer::F32(acc))?;
        self.whole = whole?;
        Ok(())
    }

    /// The table and its state.
    pub(crate) fn tensors(&self) -> Vec<Tensor> {
        vec![self.table, self.acc]
    }

    /// Whether `t` is the table or its state (read and written whole).
    pub(crate) fn holds(&self, t: Tensor) -> bool {
        t == self.table || t == self.acc
    }

    /// The whole table's shape of `t` (the table or its state) in graph `g`.
    pub(crate) fn whole_dims(&self, g: &Graph, t: Tensor) -> Vec<usize> {
        self.store.whole_dims(g, t)
    }

    /// The whole table or its state, as [`ShardedTables::assemble`] left it.
    pub(crate) fn read_whole(&self, t: Tensor) -> Result<Buffer> {
        read_whole(&self.whole, &self.name, t == self.table)
    }

    /// Writes a whole table or its state (a resumed checkpoint's) into this rank's
    /// storage: the rows it holds.
    pub(crate) fn write_whole(
        &mut self,
        runner: &mut ProgramRunner,
        t: Tensor,
        b: Buffer,
    ) -> Result<()> {
        let width = if t == self.table { self.dim } else { 1 };
        let name = runner.graph().name(t).to_string();
        let mut local = take_f32(runner, t)?;
        let r = self.store.scatter(&name, &b, width, &mut local);
        runner.feed(t, Buffer::F32(local))?;
        self.whole = None;
        r
    }
}

/// The whole table (`table`) or its state from rank 0's whole copy of sharded table
/// `name`, which [`Storage::assemble`] made for a checkpoint or the end.
pub(crate) fn read_whole(
    whole: &Option<(Vec<f32>, Vec<f32>)>,
    name: &str,
    table: bool,
) -> Result<Buffer> {
    let (t, a) = whole.as_ref().ok_or_else(|| {
        anyhow!(
            "'{name}' is sharded: it is whole only on rank {WHOLE_RANK}, after a checkpoint's \
             or the last step"
        )
    })?;
    Ok(Buffer::F32(if table { t.clone() } else { a.clone() }))
}

/// The position of parameter `t` among the graph's parameters (what its initial
/// values are drawn with).
fn param_index(g: &Graph, t: Tensor) -> Result<u64> {
    let mut index = 0u64;
    for node in g.nodes() {
        if let Op::Leaf(Leaf::Param { .. }) = &node.op {
            if node.outputs.first() == Some(&t) {
                return Ok(index);
            }
            index += 1;
        }
    }
    bail!("'{}' is not a parameter", g.name(t))
}

fn i32s(runner: &ProgramRunner, t: Tensor) -> Result<Vec<i32>> {
    match runner.get(t) {
        Some(Buffer::I32(v)) => Ok(v),
        Some(b) => bail!(
            "'{}' is {}, expected i32",
            runner.graph().name(t),
            b.dtype()
        ),
        None => bail!("'{}' has no value", runner.graph().name(t)),
    }
}

fn f32s(runner: &ProgramRunner, t: Tensor) -> Result<Vec<f32>> {
    match runner.get(t) {
        Some(Buffer::F32(v)) => Ok(v),
        Some(b) => bail!(
            "'{}' is {}, expected f32",
            runner.graph().name(t),
            b.dtype()
        ),
        None => bail!("'{}' has no value", runner.graph().name(t)),
    }
}

/// A persistent f32 tensor taken out of the runner without a copy (fed back after).
fn take_f32(runner: &mut ProgramRunner, t: Tensor) -> Result<Vec<f32>> {
    let name = runner.graph().name(t).to_string();
    match runner.take_leaf(t) {
        Some(Buffer::F32(v)) => Ok(v),
        Some(b) => {
            let dt = b.dtype();
            runner.feed(t, b)?;
            bail!("'{name}' is {dt}, expected f32")
        }
        None => bail!("'{name}' has no value"),
    }
}

fn u32s(b: &[u8]) -> Vec<u32> {
    bytemuck::pod_collect_to_vec(b)
}

fn f32s_of(b: &[u8]) -> Vec<f32> {
    bytemuck::pod_collect_to_vec(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every rank's storage of the same placement, laid out for CUDA ranks.
    fn ranks(
        rows: &[usize],
        (examples, hot): (usize, usize),
        world: usize,
        (mode, budget): (Sharding, u64),
    ) -> Vec<Storage> {
        let slots = vec![hot; rows.len()];
        Storage::all_ranks(rows, &slots, (4, examples), world, budget, mode)
            .unwrap()
            .expect("sharded")
    }

    /// The CUDA ranks' exchange played on the CPU with the kernel's reference: every
    /// rank's lookup through its storage and landing blocks reads the rows of the whole
    /// table, and each owner's update occurrences are exactly the occurrences of the rows
    /// it holds, in rank and bag order.
    #[test]
    fn the_cuda_exchange_looks_up_the_whole_tables_rows_and_updates_each_row_once() {
        let rows = [7usize, 1, 12, 5];
        let (examples, hot, d) = (6usize, 2usize, 3usize);
        let big = 1 << 40;
        for (world, mode, budget) in [
            (3, Sharding::Row, big),
            (3, Sharding::Table, big),
            (2, Sharding::Row, big),
            (4, Sharding::Row, big),
            // the largest field sharded, the others replicated
            (3, Sharding::Auto, 300),
        ] {
            let all = ranks(&rows, (examples, hot), world, (mode, budget));
            if mode == Sharding::Auto {
                let kinds: Vec<Placement> = all[0].fields.iter().map(|f| f.placement).collect();
                assert!(
                    kinds.contains(&Placement::Replicated)
                        && kinds.iter().any(|p| *p != Placement::Replicated),
                    "{kinds:?}"
                );
            }
            let geo: Vec<_> = all
                .iter()
                .map(|s| s.geometry(&all, examples, hot).unwrap())
                .collect();
            let whole: Vec<f32> = (0..rows.iter().sum::<usize>() * d)
                .map(|i| i as f32 * 0.5 + 1.0)
                .collect();
            // each rank's storage: its rows at their whole-table values, landing poisoned
            let mut store: Vec<Vec<f32>> = all
                .iter()
                .map(|s| {
                    let mut v = vec![f32::NAN; s.stored_total() * d];
                    for (r, at) in s.held() {
                        v[at * d..(at + 1) * d].copy_from_slice(&whole[r * d..(r + 1) * d]);
                    }
                    v
                })
                .collect();
            let n = geo[0].n_ids();
            let nf = rows.len();
            // random ids (some padding) for every rank's batch
            let mut x = 12345u64 + world as u64;
            let batch: Vec<Vec<i32>> = (0..world)
                .map(|_| {
                    (0..n)
                        .map(|s| {
                            x = x
                                .wrapping_mul(6364136223846793005)
                                .wrapping_add(1442695040888963407);
                            let f = (s / hot) % nf;
                            if (x >> 60) == 0 {
                                PAD
                            } else {
                                ((x >> 33) % rows[f] as u64) as i32
                            }
                        })
                        .collect()
                })
                .collect();
            let refs: Vec<_> = (0..world).map(|j| geo[j].reference(&batch[j])).collect();
            // each owner answers every rank's asks from its storage
            let answers: Vec<Vec<f32>> = (0..world)
                .map(|k| {
                    let mut a = vec![0f32; world * n * d];
                    for (j, r) in refs.iter().enumerate() {
                        for (p, &at) in r.2[k * n..(k + 1) * n].iter().enumerate() {
                            if at != PAD {
                                let at = at as usize;
                                a[(j * n + p) * d..(j * n + p + 1) * d]
                                    .copy_from_slice(&store[k][at * d..(at + 1) * d]);
                            }
                        }
                    }
                    a
                })
                .collect();
            // the blocks pair up: owner k's sends to j are j's receives from k, in order
            for j in 0..world {
                for k in (0..world).filter(|&k| k != j) {
                    let sends: Vec<_> =
                        geo[k].sends().into_iter().filter(|b| b.peer == j).collect();
                    let recvs: Vec<_> = geo[j]
                        .receives()
                        .into_iter()
                        .filter(|b| b.peer == k)
                        .collect();
                    assert_eq!(sends.len(), recvs.len(), "{mode:?} {world}: {k} -> {j}");
                    for (s, r) in sends.iter().zip(&recvs) {
                        assert_eq!((s.field, s.rows), (r.field, r.rows));
                        store[j][r.at * d..(r.at + s.rows) * d]
                            .copy_from_slice(&answers[k][s.at * d..(s.at + s.rows) * d]);
                    }
                }
            }
            // the backward: each rank's pooled gradients of the fields an owner has rows
            // of go to that owner (the row blocks' pairs the other way), its own block
            // stays; the owner's occurrence j·n + f·(n/nf) + e·hot + p pairs with bag
            // (j, f, e) of its received gradients
            let bags = geo[0].bags();
            let dp: Vec<Vec<f32>> = (0..world)
                .map(|j| (0..bags * d).map(|i| (j * 1000 + i) as f32).collect())
                .collect();
            let mut grads: Vec<Vec<f32>> = vec![vec![f32::NAN; world * bags * d]; world];
            for k in 0..world {
                for (i, &b) in geo[k].grad_own_bags().iter().enumerate() {
                    if b != PAD {
                        let (b, to) = (b as usize, (k * bags + i) * d);
                        grads[k][to..to + d].copy_from_slice(&dp[k][b * d..(b + 1) * d]);
                    }
                }
            }
            for j in 0..world {
                let packed = geo[j].grad_send_bags();
                let mut at = 0;
                for blk in geo[j].receives() {
                    // the owner's matching receive: its send block to j of the same field
                    let k = blk.peer;
                    assert!(geo[k]
                        .sends()
                        .iter()
                        .any(|s| s.peer == j && s.field == blk.field));
                    for e in 0..examples {
                        let b = packed[at + e] as usize;
                        let to = (j * bags + blk.field * examples + e) * d;
                        grads[k][to..to + d].copy_from_slice(&dp[j][b * d..(b + 1) * d]);
                    }
                    at += examples;
                }
            }
            for (k, got) in grads.iter().enumerate() {
                for j in 0..world {
                    for (q, &u) in refs[j].2[k * n..(k + 1) * n].iter().enumerate() {
                        if u == PAD {
                            continue;
                        }
                        let (f, e) = (q / (examples * hot), (q % (examples * hot)) / hot);
                        let g = &got[(j * bags + f * examples + e) * d..][..d];
                        let b = e * nf + f;
                        assert_eq!(
                            g,
                            &dp[j][b * d..(b + 1) * d],
                            "{mode:?}: owner {k}, rank {j}, occurrence {q}"
                        );
                    }
                }
            }
            for j in 0..world {
                let (local, ubm, _) = &refs[j];
                let bases: Vec<usize> = all[j].fields.iter().map(|f| f.local_base).collect();
                let gbases: Vec<usize> = all[j].fields.iter().map(|f| f.base).collect();
                for s in 0..n {
                    let f = (s / hot) % nf;
                    if batch[j][s] == PAD {
                        assert_eq!(local[s], PAD);
                        continue;
                    }
                    assert!((local[s] as usize) < all[j].fields[f].stored());
                    let at = bases[f] + local[s] as usize;
                    let r = gbases[f] + batch[j][s] as usize;
                    assert_eq!(
                        store[j][at * d..(at + 1) * d],
                        whole[r * d..(r + 1) * d],
                        "{mode:?} on {world}: rank {j}, slot {s}"
                    );
                    // a replicated row's occurrence goes to every rank (`ubm`), an owned
                    // row's to its owner alone (`ufm`, field-major), at the row's place
                    let fm = f * (n / nf) + (s / hot / nf) * hot + s % hot;
                    for k in 0..world {
                        let (u, v) = (ubm[k * n + s], refs[j].2[k * n + fm]);
                        let place = all[k].local(r).map_or(PAD, |p| p as i32);
                        match all[k].owner(r) {
                            Owner::Every => assert_eq!((u, v), (place, PAD)),
                            Owner::One(o) if o == k => assert_eq!((u, v), (PAD, place)),
                            Owner::One(_) => assert_eq!((u, v), (PAD, PAD)),
                        }
                    }
                }
            }
        }
    }
}
