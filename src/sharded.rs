//! Sharded embedding tables on CPU ranks: each table (a field of the stacked table) is
//! replicated, whole on one rank (table-wise) or split by rows over every rank
//! (row-wise), as [`crate::sharding::plan`] places it. In each step:
//!
//! 1. **Lookup.** Every rank sends each owner the rows its batch needs from it (one
//!    jagged all-to-all of ids), the owners answer with the rows (a second one), and the
//!    rank writes them into its copy of the table, which the step's lookup then reads:
//!    each bag sums its rows in its own order, as on one process.
//! 2. **Update.** After the backward, every rank sends each owner the occurrences of its
//!    rows (row, pooled gradient) in bag order (a third all-to-all; a replicated row's go
//!    to every rank); each owner concatenates them in rank order and applies the fused
//!    row-wise Adagrad to the rows it owns. Every row's gradient sums the same terms in
//!    the same order as the replicated update, which gathers every rank's occurrences:
//!    the same bits.
//! 3. **Whole tables** where a step needs them (an evaluation, a checkpoint, the end):
//!    every owner sends its rows and their Adagrad state to every rank (a fourth
//!    all-to-all), so a checkpoint holds each table whole, whatever the sharding, and
//!    resumes on any rank count.
//!
//! The rows a rank does not own are a landing buffer for step 1: the CPU ranks still
//! allocate the whole table (the owner's rows are the only ones updated and trusted);
//! holding only the owned rows is what the CUDA ranks' sharding needs next.

use std::collections::BTreeSet;

use anyhow::{anyhow, bail, Context, Result};

use crate::sharding::{Placement, Sharding, Table};
use erase_graph::{Graph, NodeId, Op, Shape, Tensor};
use erase_ops::cpu::embedding::{Bags, PAD};
use erase_ops::{Buffer, NodeCall};
use erase_runtime::collective::Collective;
use erase_runtime::cpu::runner::ProgramRunner;

/// Who holds a row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Owner {
    Every,
    One(usize),
}

/// One stacked table (a `RowwiseAdagrad` node's) and where its fields live.
struct ShardedTable {
    name: String,
    ids: Tensor,
    offsets: Tensor,
    dpooled: Tensor,
    table: Tensor,
    acc: Tensor,
    field_rows: Vec<usize>,
    bases: Vec<usize>,
    placements: Vec<Placement>,
    dim: usize,
    lr: f64,
    eps: f64,
}

/// The sharded tables of a rank's step program.
pub(crate) struct ShardedTables {
    tables: Vec<ShardedTable>,
    rank: usize,
    world: usize,
}

impl ShardedTables {
    /// The row-wise Adagrad tables of `nodes` placed field by field for rank `rank` of
    /// `world`, each rank holding at most `budget` bytes of tables (`mode`, as
    /// [`crate::sharding::plan`] places them): `None` when every table stays replicated
    /// (the step then gathers the sparse gradients as it always has).
    pub(crate) fn plan(
        g: &Graph,
        nodes: &[NodeId],
        (rank, world): (usize, usize),
        budget: u64,
        mode: Sharding,
    ) -> Result<Option<ShardedTables>> {
        let mut tables = Vec::new();
        for &id in nodes {
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
            let dim = g.shape(table).dims()[1];
            let fields: Vec<Table> = field_rows
                .iter()
                .enumerate()
                .map(|(i, &rows)| Table {
                    name: format!("C{}", i + 1),
                    rows,
                    dim,
                })
                .collect();
            let placements = crate::sharding::plan(&fields, world, budget, mode)?.placements;
            let bases = field_rows
                .iter()
                .scan(0, |at, &r| {
                    let base = *at;
                    *at += r;
                    Some(base)
                })
                .collect();
            tables.push(ShardedTable {
                name: n.name.clone(),
                ids,
                offsets,
                dpooled,
                table,
                acc,
                field_rows: field_rows.clone(),
                bases,
                placements,
                dim,
                lr: *lr,
                eps: *eps,
            });
        }
        let any = tables
            .iter()
            .any(|t| t.placements.iter().any(|p| *p != Placement::Replicated));
        Ok(any.then_some(ShardedTables {
            tables,
            rank,
            world,
        }))
    }

    /// Step 1: the rows this rank's batch needs from other ranks, fetched into its table.
    pub(crate) fn fetch<C: Collective>(
        &self,
        runner: &mut ProgramRunner,
        comm: &mut C,
    ) -> Result<()> {
        for t in &self.tables {
            let (ids, offsets) = (i32s(runner, t.ids)?, i32s(runner, t.offsets)?);
            let bags = Bags::new(&ids, &offsets, &t.field_rows)
                .map_err(|e| anyhow!("'{}': {e}", t.name))?;
            let mut want: Vec<BTreeSet<u32>> = vec![BTreeSet::new(); self.world];
            for bag in 0..bags.num_bags() {
                for &id in bags.bag_ids(bag).iter().filter(|&&id| id != PAD) {
                    let row = bags.row(bag, id);
                    if let Owner::One(k) = t.owner(row, self.world) {
                        if k != self.rank {
                            want[k].insert(row as u32);
                        }
                    }
                }
            }
            let asks: Vec<Vec<u8>> = want
                .iter()
                .map(|rows| rows.iter().flat_map(|r| r.to_le_bytes()).collect())
                .collect();
            let asked = comm.all_to_all(&format!("{}.lookup ids", t.name), &asks)?;
            let mut table = take_f32(runner, t.table)?;
            let d = t.dim;
            let mut answers = Vec::with_capacity(self.world);
            for (k, b) in asked.iter().enumerate() {
                let mut rows = Vec::with_capacity(b.len() / 4 * d * 4);
                for r in u32s(b) {
                    let r = r as usize;
                    if t.owner(r, self.world) != Owner::One(self.rank) {
                        bail!(
                            "'{}': rank {k} asked rank {} for row {r}, which it does not own",
                            t.name,
                            self.rank
                        );
                    }
                    rows.extend(
                        table[r * d..(r + 1) * d]
                            .iter()
                            .flat_map(|v| v.to_le_bytes()),
                    );
                }
                answers.push(rows);
            }
            let got = comm.all_to_all(&format!("{}.lookup rows", t.name), &answers)?;
            for (k, rows) in want.iter().enumerate() {
                let vals = f32s_of(&got[k]);
                if vals.len() != rows.len() * d {
                    bail!(
                        "'{}': rank {k} answered {} values for {} rows of {d}",
                        t.name,
                        vals.len(),
                        rows.len()
                    );
                }
                for (i, &r) in rows.iter().enumerate() {
                    let r = r as usize;
                    table[r * d..(r + 1) * d].copy_from_slice(&vals[i * d..(i + 1) * d]);
                }
            }
            runner.feed(t.table, Buffer::F32(table))?;
        }
        Ok(())
    }

    /// Step 2: the occurrences' gradients to their owners, who apply row-wise Adagrad
    /// (each gradient scaled by `scale`, the mean over ranks, as the replicated update).
    pub(crate) fn update<C: Collective>(
        &self,
        runner: &mut ProgramRunner,
        comm: &mut C,
        scale: f32,
    ) -> Result<()> {
        for t in &self.tables {
            let (ids, offsets) = (i32s(runner, t.ids)?, i32s(runner, t.offsets)?);
            let dp = f32s(runner, t.dpooled)?;
            let bags = Bags::new(&ids, &offsets, &t.field_rows)
                .map_err(|e| anyhow!("'{}': {e}", t.name))?;
            let d = t.dim;
            if dp.len() != bags.num_bags() * d {
                bail!(
                    "'{}': {} pooled-gradient values for {} bags of {d}",
                    t.name,
                    dp.len(),
                    bags.num_bags()
                );
            }
            // per destination: the rows, then their gradients, in bag order
            let mut rows: Vec<Vec<u32>> = vec![Vec::new(); self.world];
            let mut grads: Vec<Vec<f32>> = vec![Vec::new(); self.world];
            for bag in 0..bags.num_bags() {
                for &id in bags.bag_ids(bag).iter().filter(|&&id| id != PAD) {
                    let row = bags.row(bag, id);
                    let g = &dp[bag * d..(bag + 1) * d];
                    let to = match t.owner(row, self.world) {
                        Owner::Every => 0..self.world,
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
            let got = comm.all_to_all(&format!("{}.grad", t.name), &parts)?;
            // every rank's occurrences of this rank's rows, in rank order
            let (mut all_rows, mut all_grads) = (Vec::<i32>::new(), Vec::<f32>::new());
            for (k, b) in got.iter().enumerate() {
                let bad = || anyhow!("'{}': rank {k} sent a malformed gradient part", t.name);
                let n = u32::from_le_bytes(b.get(..4).ok_or_else(bad)?.try_into()?) as usize;
                let (r, g) = b[4..].split_at_checked(4 * n).ok_or_else(bad)?;
                let g = f32s_of(g);
                if g.len() != n * d {
                    return Err(bad());
                }
                for r in u32s(r) {
                    let r = r as usize;
                    let owner = t.owner(r, self.world);
                    if owner != Owner::Every && owner != Owner::One(self.rank) {
                        bail!(
                            "'{}': rank {k} sent rank {} the gradient of row {r}, which it does not own",
                            t.name,
                            self.rank
                        );
                    }
                    all_rows.push(r as i32);
                }
                all_grads.extend(g.into_iter().map(|v| v * scale));
            }
            // the fused row-wise Adagrad of the op, on one "field" of every row: each
            // occurrence its own bag, so its rows sort stably in the order received
            let total: usize = t.field_rows.iter().sum();
            let op = Op::RowwiseAdagrad {
                lr: t.lr,
                eps: t.eps,
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
                name: &t.name,
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
                Buffer::F32(take_f32(runner, t.table)?),
                Buffer::F32(take_f32(runner, t.acc)?),
            ];
            erase_ops::execute(&call, &refs, &mut [], &mut upd)
                .with_context(|| format!("rank {}: the sharded update", self.rank))?;
            let [table, acc] =
                <[Buffer; 2]>::try_from(upd).map_err(|_| anyhow!("the update lost a tensor"))?;
            runner.feed(t.table, table)?;
            runner.feed(t.acc, acc)?;
        }
        Ok(())
    }

    /// Step 3: every owner's rows and their state to every rank, so that every rank holds
    /// every table whole (and the replicas are identical).
    pub(crate) fn assemble<C: Collective>(
        &self,
        runner: &mut ProgramRunner,
        comm: &mut C,
    ) -> Result<()> {
        for t in &self.tables {
            let d = t.dim;
            let (mut table, mut acc) = (take_f32(runner, t.table)?, take_f32(runner, t.acc)?);
            let mine: Vec<u8> = t
                .owned_rows(self.rank, self.world)
                .flat_map(|r| {
                    table[r * d..(r + 1) * d]
                        .iter()
                        .chain(std::iter::once(&acc[r]))
                        .flat_map(|v| v.to_le_bytes())
                        .collect::<Vec<u8>>()
                })
                .collect();
            let parts = vec![mine; self.world];
            let got = comm.all_to_all(&format!("{}.whole", t.name), &parts)?;
            for (k, b) in got.iter().enumerate() {
                if k == self.rank {
                    continue;
                }
                let vals = f32s_of(b);
                let rows: Vec<usize> = t.owned_rows(k, self.world).collect();
                if vals.len() != rows.len() * (d + 1) {
                    bail!(
                        "'{}': rank {k} sent {} values for its {} rows",
                        t.name,
                        vals.len(),
                        rows.len()
                    );
                }
                for (i, r) in rows.into_iter().enumerate() {
                    let v = &vals[i * (d + 1)..(i + 1) * (d + 1)];
                    table[r * d..(r + 1) * d].copy_from_slice(&v[..d]);
                    acc[r] = v[d];
                }
            }
            runner.feed(t.table, Buffer::F32(table))?;
            runner.feed(t.acc, Buffer::F32(acc))?;
        }
        Ok(())
    }
}

impl ShardedTable {
    /// The owner of global row `row` of the stacked table.
    fn owner(&self, row: usize, world: usize) -> Owner {
        let f = self.bases.partition_point(|&b| b <= row).saturating_sub(1);
        match self.placements[f] {
            Placement::Replicated => Owner::Every,
            Placement::Table(k) => Owner::One(k),
            Placement::Row => {
                let per = self.field_rows[f].div_ceil(world.max(1)).max(1);
                Owner::One((row - self.bases[f]) / per)
            }
        }
    }

    /// The rows rank `k` owns alone, in row order.
    fn owned_rows(&self, k: usize, world: usize) -> impl Iterator<Item = usize> + '_ {
        self.field_rows
            .iter()
            .enumerate()
            .flat_map(move |(f, &rows)| {
                let base = self.bases[f];
                let range = match self.placements[f] {
                    Placement::Replicated => 0..0,
                    Placement::Table(o) if o == k => 0..rows,
                    Placement::Table(_) => 0..0,
                    Placement::Row => {
                        let per = rows.div_ceil(world.max(1)).max(1);
                        (k * per).min(rows)..((k + 1) * per).min(rows)
                    }
                };
                range.map(move |r| base + r)
            })
    }
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
