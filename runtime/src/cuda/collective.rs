//! Data-parallel steps on a CUDA device: the step program with its collectives.
//!
//! The collectives are part of the step as the program issues it, so every rank issues
//! the same ones in the same order by construction (blocking dispatch, or captured
//! inside the whole-step CUDA graph):
//! - `early`: right after the last launch of each backward program, its stream records
//!   an event, the communication stream waits for it and averages that program's dense
//!   gradients over the ranks (one grouped NCCL all-reduce: one bucket), then gathers
//!   the (ids, pooled gradients) of the embedding tables whose gradients that program
//!   completes, while the rest of the step runs on the other streams;
//! - `end`: the same collectives, all issued after the backward's final join (one
//!   bucket of every dense gradient).
//!
//! The optimizer's launches wait for the communication stream. The row-wise Adagrad of
//! each table runs on the gathered (ids, gradients) of every rank, at the global batch's
//! shape (the bags of every rank hold `hot` ids each, so the global offsets are fixed),
//! instead of the local one: every rank applies the same update to the same rows, and
//! the replicas stay identical.

use std::collections::{BTreeMap, BTreeSet};

use crate::cuda::nccl::NcclComm;
use crate::cuda::program::CudaProgram;
use crate::cuda::{DeviceBuffer, Event, PreparedLaunch, Stream};
use crate::error::RuntimeError;
use crate::program::memory::alias_root;
use cudarc::driver::{result, sys};
use erase_graph::{Grad, Gradients, Op, Partition, Phase, Tensor};
use erase_ops::cuda::{cuda_plan, KArg, Operands};

/// A table's gradient as the ranks exchange it.
struct SparseExchange {
    name: String,
    ids: Tensor,
    dpooled: Tensor,
    ids_bytes: usize,
    dp_bytes: usize,
    /// Every rank's ids and pooled gradients, in rank order.
    all_ids: DeviceBuffer,
    all_dp: DeviceBuffer,
    /// `0, hot, 2 hot, ...` for the global batch.
    _all_offsets: DeviceBuffer,
    /// The row-wise Adagrad at the global batch's shape, and its scratch.
    update: Vec<PreparedLaunch>,
    _scratch: Vec<DeviceBuffer>,
    /// A sharded table's update reads the owners' occurrences from the lookup (the ids
    /// are not gathered).
    sharded: bool,
}

/// A sharded table's exchanges (see [`crate::cuda::sharded`]). At the start of each step,
/// on the communication stream: the ids mapped into this rank's storage, the asks and
/// occurrences sent to their owners, the owners' rows sent into the askers' landing
/// blocks; the launches that read the ids or the table wait for it. Once the table's
/// gradient is complete: each rank's pooled gradients to the owners of the fields, and
/// at the update, each owner's row-wise Adagrad of the occurrences of its rows.
struct ShardedLookup {
    name: String,
    /// `shard_ids` on the batch's ids, and the owner's gather of the rows asked of it
    /// (one per other rank).
    remap: PreparedLaunch,
    gather: Vec<PreparedLaunch>,
    /// The ids' exchange (asks and occurrences) and the rows' (answers into landing
    /// blocks), in the order every rank issues them.
    ids_parts: Vec<crate::cuda::nccl::Transfer>,
    rows_parts: Vec<crate::cuda::nccl::Transfer>,
    /// The launches that read the ids or the table.
    readers: BTreeSet<usize>,
    done: Event,
    /// The replicated fields' occurrences received (every rank's `ubm` part for this
    /// rank, in rank order): the gathered update's ids.
    occurrences: u64,
    /// This rank's own parts of `ubm` and `ufm`: (source, destination) of their copies,
    /// and a part's bytes.
    own: [(u64, u64); 2],
    part: usize,
    /// The backward: the pooled gradients packed for the owners and this rank's own
    /// block, their exchange, and the owner's update of its rows.
    grad_pack: Vec<PreparedLaunch>,
    grad_parts: Vec<crate::cuda::nccl::Transfer>,
    update_owned: Vec<PreparedLaunch>,
    /// Whether some fields are replicated: their gradients are gathered as before.
    replicated: bool,
    _buffers: Vec<DeviceBuffer>,
}

/// One bucket: what the ranks exchange after launch `after` (early) or at the join (end).
struct Bucket {
    name: String,
    after: usize,
    dense: Vec<Tensor>,
    sparse: Vec<usize>,
}

/// The collectives of a data-parallel step and the buffers they need.
pub struct DataParallel {
    comm_stream: Stream,
    begin: Event,
    ready: Vec<Event>,
    done: Event,
    buckets: Vec<Bucket>,
    sparse: Vec<SparseExchange>,
    /// The local row-wise Adagrad launches, replaced by the global ones.
    skip: BTreeSet<usize>,
    first_optimizer: usize,
    end: bool,
    /// The sharded table's lookup, when the tables are sharded.
    lookup: Option<ShardedLookup>,
    /// The collectives one step issues, for the logs: (kind, bucket, bytes).
    pub per_step: Vec<(&'static str, String, usize)>,
}

impl DataParallel {
    /// Plans the collectives of `p`'s step over `world` ranks. `early`: one bucket per
    /// backward program, after it; else one bucket at the end of the backward.
    pub fn new(
        p: &CudaProgram<'_>,
        part: &Partition,
        grads: &Gradients,
        world: usize,
        early: bool,
    ) -> Result<Self, RuntimeError> {
        Self::with_shards(p, part, grads, world, early, None)
    }

    /// [`DataParallel::new`] for a rank whose table is sharded as `shards` places it
    /// (the program built with its storage's rows): the lookup exchange at the start of
    /// the step, and the update of the rows it holds from every rank's occurrences.
    pub fn with_shards(
        p: &CudaProgram<'_>,
        part: &Partition,
        grads: &Gradients,
        world: usize,
        early: bool,
        shards: Option<&crate::cuda::sharded::ShardGeometry>,
    ) -> Result<Self, RuntimeError> {
        let (g, prog, dev) = (p.g, p.prog, p.dev);
        let err = |m: String| RuntimeError::Device(format!("data parallel: {m}"));
        let launch_of: BTreeMap<_, _> = prog
            .launches
            .iter()
            .enumerate()
            .map(|(i, l)| (l.node, i))
            .collect();
        let first_optimizer = prog
            .launches
            .iter()
            .position(|l| g.node(l.node).phase == Phase::Optimizer)
            .ok_or_else(|| err("the step has no optimizer".into()))?;
        // the collectives meet at the join before the updates: every update on the main
        // stream behind it (a plan without `updates_by_data`)
        if let Some(l) = prog.launches[first_optimizer..]
            .iter()
            .find(|l| g.node(l.node).phase == Phase::Optimizer && l.stream.0 != 0)
        {
            return Err(err(format!(
                "the update '{}' runs on {}, not behind the join on the main stream:                  plan data-parallel steps with updates_by_data off",
                g.node(l.node).name,
                l.stream
            )));
        }
        let last_of = |k: usize| -> Option<usize> {
            part.programs[k]
                .nodes
                .iter()
                .filter_map(|n| launch_of.get(n).copied())
                .max()
        };
        // the optimizer launch that consumes each table's gradient
        let rowwise: BTreeMap<Tensor, usize> = prog
            .launches
            .iter()
            .enumerate()
            .filter(|(_, l)| matches!(g.node(l.node).op, Op::RowwiseAdagrad { .. }))
            .map(|(i, l)| (g.node(l.node).inputs[2], i))
            .collect();
        // the sharded table's lookup, built first: its update reads the owners'
        // occurrences that the lookup receives
        let lookup = match shards {
            Some(geo) => {
                let mut nodes = rowwise.values().map(|&i| prog.launches[i].node);
                let (Some(node), None) = (nodes.next(), nodes.next()) else {
                    return Err(err(format!(
                        "sharded tables need the trainer's one table; the step has {} row-wise Adagrad updates",
                        rowwise.len()
                    )));
                };
                let n = g.node(node);
                let (&[ids, _, dpooled], &[table, acc]) = (&n.inputs[..], &n.updates[..]) else {
                    return Err(err(format!(
                        "'{}' is not a row-wise Adagrad of (ids, offsets, pooled gradient) on (table, state)",
                        n.name
                    )));
                };
                let Op::RowwiseAdagrad { lr, eps, .. } = n.op else {
                    return Err(err(format!("'{}' is not row-wise Adagrad", n.name)));
                };
                Some(ShardedLookup::new(
                    p,
                    geo,
                    (ids, dpooled),
                    (table, acc),
                    (&n.name, lr, eps),
                )?)
            }
            None => None,
        };
        let mut by_program: BTreeMap<usize, (Vec<Tensor>, Vec<usize>)> = BTreeMap::new();
        let mut sparse = Vec::new();
        let mut skip = BTreeSet::new();
        for (param, grad) in &grads.by_param {
            let Some(&k) = part.grad_complete.get(param) else {
                continue;
            };
            match grad {
                Grad::Dense(t) => by_program.entry(k).or_default().0.push(*t),
                Grad::Sparse {
                    ids,
                    offsets,
                    dpooled,
                    ..
                } => {
                    let &li = rowwise.get(dpooled).ok_or_else(|| {
                        err(format!(
                            "no row-wise Adagrad reads '{}' (only row-wise Adagrad tables are supported)",
                            g.name(*dpooled)
                        ))
                    })?;
                    skip.insert(li);
                    let node = g.node(prog.launches[li].node);
                    let (n_ids, n_off) = (g.shape(*ids).numel(), g.shape(*offsets).numel());
                    let n_bags = n_off.saturating_sub(1);
                    if n_bags == 0 || n_ids % n_bags != 0 {
                        return Err(err(format!(
                            "'{}': {n_ids} ids in {n_bags} bags: bags of one size are needed",
                            node.name
                        )));
                    }
                    let hot = n_ids / n_bags;
                    let dims = g.shape(*dpooled).dims().to_vec();
                    let mut gdims = dims.clone();
                    gdims[0] *= world;
                    // a sharded table: the owner's occurrences at their places in its
                    // storage, every bag one "field" of the stacked storage
                    let (op, sharded) = match shards {
                        Some(geo) => {
                            let Op::RowwiseAdagrad { lr, eps, .. } = node.op else {
                                return Err(err(format!(
                                    "'{}' is not row-wise Adagrad",
                                    node.name
                                )));
                            };
                            gdims = vec![
                                gdims.iter().take(2).product(),
                                1,
                                *dims.last().unwrap_or(&1),
                            ];
                            (
                                Op::RowwiseAdagrad {
                                    lr,
                                    eps,
                                    field_rows: vec![geo.stored_total()],
                                },
                                true,
                            )
                        }
                        None => (node.op.clone(), false),
                    };
                    let ids_s = erase_graph::Shape::new(&[n_ids * world]);
                    let off_s = erase_graph::Shape::new(&[n_bags * world + 1]);
                    let dp_s = erase_graph::Shape::new(&gdims);
                    let upd: Vec<_> = node.updates.iter().map(|&t| g.shape(t)).collect();
                    let plan = cuda_plan(
                        &op,
                        &Operands {
                            opts: dev.plan_options(),
                            ins: &[&ids_s, &off_s, &dp_s],
                            in_dtypes: &[
                                erase_graph::DType::I32,
                                erase_graph::DType::I32,
                                erase_graph::DType::F32,
                            ],
                            outs: &[],
                            out_dtypes: &[],
                            upd: &upd,
                        },
                    )
                    .map_err(|e| err(format!("'{}' at the global batch: {e}", node.name)))?;
                    let ids_bytes = n_ids * 4;
                    let dp_bytes = dims.iter().product::<usize>() * 4;
                    let all_ids = dev.alloc(ids_bytes * world)?;
                    let all_dp = dev.alloc(dp_bytes * world)?;
                    let offs: Vec<i32> = (0..=n_bags * world).map(|i| (i * hot) as i32).collect();
                    let all_offsets = dev.alloc(offs.len() * 4)?;
                    dev.upload(&all_offsets, 0, bytemuck::cast_slice(&offs))?;
                    let ptr = |a: KArg| -> Option<u64> {
                        match a {
                            KArg::In(0) => Some(match (&lookup, sharded) {
                                (Some(lk), true) => lk.occurrences,
                                _ => all_ids.ptr(),
                            }),
                            KArg::In(1) => Some(all_offsets.ptr()),
                            KArg::In(2) => Some(all_dp.ptr()),
                            KArg::Upd(j) => node.updates.get(j).and_then(|&t| tensor_ptr(p, t)),
                            _ => None,
                        }
                    };
                    // a sharded table without replicated fields gathers nothing: its
                    // owners update their rows from the gradients' exchange
                    let gathered = !sharded || lookup.as_ref().is_some_and(|lk| lk.replicated);
                    let (update, scratch) = if gathered {
                        prepare_plan(dev, &plan, &ptr)?
                    } else {
                        (Vec::new(), Vec::new())
                    };
                    by_program.entry(k).or_default().1.push(sparse.len());
                    sparse.push(SparseExchange {
                        name: node.name.clone(),
                        ids: *ids,
                        dpooled: *dpooled,
                        ids_bytes,
                        dp_bytes,
                        all_ids,
                        all_dp,
                        _all_offsets: all_offsets,
                        update,
                        _scratch: scratch,
                        sharded,
                    });
                }
            }
        }
        let mut buckets: Vec<Bucket> = Vec::new();
        for (k, (dense, sp)) in by_program {
            let after = last_of(k).ok_or_else(|| {
                err(format!(
                    "backward program '{}' has no launch",
                    part.programs[k].name
                ))
            })?;
            buckets.push(Bucket {
                name: part.programs[k].name.clone(),
                after,
                dense,
                sparse: sp,
            });
        }
        buckets.sort_by_key(|b| b.after);
        if !early {
            let all = Bucket {
                name: "all".into(),
                after: first_optimizer,
                dense: buckets.iter().flat_map(|b| b.dense.clone()).collect(),
                sparse: buckets.iter().flat_map(|b| b.sparse.clone()).collect(),
            };
            buckets = vec![all];
        }
        let mut per_step = Vec::new();
        if let Some(lk) = &lookup {
            per_step.push(("all_to_all", format!("{}.lookup ids", lk.name), 0));
            per_step.push(("all_to_all", format!("{}.lookup rows", lk.name), 0));
        }
        for b in &buckets {
            if !b.dense.is_empty() {
                let bytes = b.dense.iter().map(|&t| g.shape(t).numel() * 4).sum();
                per_step.push(("all_reduce", b.name.clone(), bytes));
            }
            for &s in &b.sparse {
                let x = &sparse[s];
                if !x.sharded {
                    per_step.push(("all_gather", format!("{}.ids", x.name), x.ids_bytes));
                    per_step.push(("all_gather", format!("{}.grad", x.name), x.dp_bytes));
                    continue;
                }
                per_step.push(("all_to_all", format!("{}.grad", x.name), 0));
                if lookup.as_ref().is_some_and(|lk| lk.replicated) {
                    per_step.push((
                        "all_gather",
                        format!("{}.grad of the replicated fields", x.name),
                        x.dp_bytes,
                    ));
                }
            }
        }
        Ok(DataParallel {
            comm_stream: dev.stream(false)?,
            begin: dev.event(false)?,
            ready: (0..buckets.len())
                .map(|_| dev.event(false))
                .collect::<Result<_, _>>()?,
            done: dev.event(false)?,
            buckets,
            sparse,
            skip,
            first_optimizer,
            end: !early,
            lookup,
            per_step,
        })
    }
}

impl ShardedLookup {
    /// The exchanges of table `table` (its state `acc`; read through ids `ids`, its pooled
    /// gradient `dpooled`) of `p`'s program, sharded as `geo` places it.
    fn new(
        p: &CudaProgram<'_>,
        geo: &crate::cuda::sharded::ShardGeometry,
        (ids, dpooled): (Tensor, Tensor),
        (table, acc): (Tensor, Tensor),
        (name, lr, eps): (&str, f64, f64),
    ) -> Result<ShardedLookup, RuntimeError> {
        use crate::cuda::nccl::Transfer;
        use erase_graph::DType::{F32, I32};
        use erase_graph::Shape;
        let (g, dev) = (p.g, p.dev);
        let err = |m: String| RuntimeError::Device(format!("sharded table '{name}': {m}"));
        let (n, world, me) = (geo.n_ids(), geo.world, geo.rank);
        let (stored, nf, bags) = (geo.stored_total(), geo.rows.len(), geo.bags());
        let d = match g.shape(table).dims() {
            [rows, d] if *rows == stored => *d,
            dims => {
                return Err(err(format!(
                    "the table is {dims:?}, the placement stores {stored} rows"
                )))
            }
        };
        if g.shape(ids).numel() != n || g.shape(dpooled).numel() != bags * d {
            return Err(err(format!(
                "{} ids and {} pooled-gradient values, the placement's batch has {n} ids in {bags} bags of {d}",
                g.shape(ids).numel(),
                g.shape(dpooled).numel()
            )));
        }
        let missing = |t: Tensor| err(format!("'{}' has no address", g.name(t)));
        let ptr_of = |t: Tensor| tensor_ptr(p, t).ok_or_else(|| missing(t));
        let (ids_ptr, dp_ptr) = (ptr_of(ids)?, ptr_of(dpooled)?);
        let (table_ptr, acc_ptr) = (ptr_of(table)?, ptr_of(acc)?);
        let mut keep: Vec<DeviceBuffer> = Vec::new();
        let mut up = |v: &[i32]| -> Result<u64, RuntimeError> {
            let b = dev.alloc(v.len().max(1) * 4)?;
            dev.upload(&b, 0, bytemuck::cast_slice(v))?;
            let ptr = b.ptr();
            keep.push(b);
            Ok(ptr)
        };
        let (kind, geo_t) = geo.tables();
        let (kind_p, geo_p) = (up(&kind)?, up(&geo_t)?);
        let iota: Vec<i32> = (0..=(world * n) as i32).collect();
        let iota_p = up(&iota)?;
        let hot = geo.hot as i32;
        let bag_offsets: Vec<i32> = (0..=(world * bags) as i32).map(|i| i * hot).collect();
        let bag_offsets_p = up(&bag_offsets)?;
        let send_bags = geo.grad_send_bags();
        let own_bags = geo.grad_own_bags();
        let (send_bags_p, own_bags_p) = (up(&send_bags)?, up(&own_bags)?);
        let part = n * 4;
        let mut alloc = |bytes: usize, fill: Option<u8>| -> Result<u64, RuntimeError> {
            let b = dev.alloc(bytes.max(4))?;
            if let Some(v) = fill {
                dev.fill(&b, v)?;
            }
            let ptr = b.ptr();
            keep.push(b);
            Ok(ptr)
        };
        let (ubm_send, ufm_send) = (alloc(world * part, None)?, alloc(world * part, None)?);
        // the parts no peer sends stay PAD
        let (ubm_recv, ufm_recv) = (
            alloc(world * part, Some(0xFF))?,
            alloc(world * part, Some(0xFF))?,
        );
        let row = d * 4;
        let answers = alloc(world * n * row, None)?;
        let g_send = alloc(send_bags.len() * row, None)?;
        let g_recv = alloc(world * bags * row, Some(0))?;
        let remap = dev.prepare(&geo.shard_ids_call(), &|a| match a {
            KArg::In(0) => Some(ids_ptr),
            KArg::In(1) => Some(kind_p),
            KArg::In(2) => Some(geo_p),
            KArg::Out(0) => Some(ubm_send),
            KArg::Out(1) => Some(ufm_send),
            _ => None,
        })?;
        // a gather of rows by index (the lookup kernel, one index a bag) from `rows` rows
        // of `src`, `count` indices at `idx`, into `out`
        let mut scratch: Vec<DeviceBuffer> = Vec::new();
        let mut gather_rows = |src: u64,
                               rows: usize,
                               idx: u64,
                               count: usize,
                               out: u64|
         -> Result<Vec<PreparedLaunch>, RuntimeError> {
            if count == 0 {
                return Ok(Vec::new());
            }
            let op = Op::EmbeddingBag {
                field_rows: vec![rows],
            };
            let (t_s, i_s, o_s, y_s) = (
                Shape::new(&[rows, d]),
                Shape::new(&[count]),
                Shape::new(&[count + 1]),
                Shape::new(&[count, 1, d]),
            );
            let plan = cuda_plan(
                &op,
                &Operands {
                    opts: dev.plan_options(),
                    ins: &[&t_s, &i_s, &o_s],
                    in_dtypes: &[F32, I32, I32],
                    outs: &[&y_s],
                    out_dtypes: &[F32],
                    upd: &[],
                },
            )
            .map_err(|e| err(format!("a gather of {count} rows: {e}")))?;
            let (calls, mine) = prepare_plan(dev, &plan, &|a| match a {
                KArg::In(0) => Some(src),
                KArg::In(1) => Some(idx),
                KArg::In(2) => Some(iota_p),
                KArg::Out(0) => Some(out),
                _ => None,
            })?;
            scratch.extend(mine);
            Ok(calls)
        };
        // the owner's answers to every other rank's asks
        let mut gather = Vec::new();
        for k in (0..world).filter(|&k| k != me) {
            let at = (k * part) as u64;
            gather.extend(gather_rows(
                table_ptr,
                stored,
                ufm_recv + at,
                n,
                answers + (k * n * row) as u64,
            )?);
        }
        // the backward's packs: the gradients for the owners, and this rank's own block
        let mut grad_pack = gather_rows(dp_ptr, bags, send_bags_p, send_bags.len(), g_send)?;
        grad_pack.extend(gather_rows(
            dp_ptr,
            bags,
            own_bags_p,
            own_bags.len(),
            g_recv + (me * bags * row) as u64,
        )?);
        // the owner's update: every rank's occurrences of its rows (field-major), each
        // bag's gradient from its block
        let op = Op::RowwiseAdagrad {
            lr,
            eps,
            field_rows: vec![stored],
        };
        let (i_s, o_s, dp_s) = (
            Shape::new(&[world * n]),
            Shape::new(&[world * bags + 1]),
            Shape::new(&[world * bags, 1, d]),
        );
        let upd = [g.shape(table), g.shape(acc)];
        let plan = cuda_plan(
            &op,
            &Operands {
                opts: dev.plan_options(),
                ins: &[&i_s, &o_s, &dp_s],
                in_dtypes: &[I32, I32, F32],
                outs: &[],
                out_dtypes: &[],
                upd: &upd,
            },
        )
        .map_err(|e| err(format!("the owner's update: {e}")))?;
        let (update_owned, upd_scratch) = prepare_plan(dev, &plan, &|a| match a {
            KArg::In(0) => Some(ufm_recv),
            KArg::In(1) => Some(bag_offsets_p),
            KArg::In(2) => Some(g_recv),
            KArg::Upd(0) => Some(table_ptr),
            KArg::Upd(1) => Some(acc_ptr),
            _ => None,
        })?;
        // every peer: its asks and its occurrences, both ways (this rank's own parts are
        // copied, not sent)
        let mut ids_parts = Vec::new();
        for peer in (0..world).filter(|&k| k != me) {
            let at = (peer * part) as u64;
            ids_parts.extend([
                Transfer::Send {
                    peer,
                    ptr: ufm_send + at,
                    bytes: part,
                },
                Transfer::Recv {
                    peer,
                    ptr: ufm_recv + at,
                    bytes: part,
                },
                Transfer::Send {
                    peer,
                    ptr: ubm_send + at,
                    bytes: part,
                },
                Transfer::Recv {
                    peer,
                    ptr: ubm_recv + at,
                    bytes: part,
                },
            ]);
        }
        let (sends, receives) = (geo.sends(), geo.receives());
        let mut rows_parts: Vec<Transfer> = sends
            .iter()
            .map(|b| Transfer::Send {
                peer: b.peer,
                ptr: answers + (b.at * row) as u64,
                bytes: b.rows * row,
            })
            .collect();
        rows_parts.extend(receives.iter().map(|b| Transfer::Recv {
            peer: b.peer,
            ptr: table_ptr + (b.at * row) as u64,
            bytes: b.rows * row,
        }));
        // the backward runs the rows' pairs the other way, a block of bags each
        let ex = geo.examples;
        let mut grad_parts: Vec<Transfer> = receives
            .iter()
            .enumerate()
            .map(|(i, b)| Transfer::Send {
                peer: b.peer,
                ptr: g_send + (i * ex * row) as u64,
                bytes: ex * row,
            })
            .collect();
        grad_parts.extend(sends.iter().map(|b| Transfer::Recv {
            peer: b.peer,
            ptr: g_recv + ((b.peer * nf + b.field) * ex * row) as u64,
            bytes: ex * row,
        }));
        let readers = p
            .prog
            .launches
            .iter()
            .enumerate()
            .filter(|(_, l)| {
                let node = g.node(l.node);
                node.inputs.contains(&ids) || node.inputs.contains(&table)
            })
            .map(|(i, _)| i)
            .collect();
        let mine = (me * part) as u64;
        keep.extend(scratch);
        keep.extend(upd_scratch);
        Ok(ShardedLookup {
            name: name.to_string(),
            remap,
            gather,
            ids_parts,
            rows_parts,
            readers,
            done: dev.event(false)?,
            occurrences: ubm_recv,
            own: [
                (ubm_send + mine, ubm_recv + mine),
                (ufm_send + mine, ufm_recv + mine),
            ],
            part,
            grad_pack,
            grad_parts,
            update_owned,
            replicated: geo.any_replicated(),
            _buffers: keep,
        })
    }

    /// Issues the lookup on `cs` (the communication stream), after the work issued so
    /// far on it; `done` completes with it.
    fn issue(
        &self,
        dev: &crate::cuda::CudaDevice,
        comm: &mut NcclComm,
        cs: &Stream,
    ) -> Result<(), RuntimeError> {
        dev.launch_prepared(&self.remap, cs)?;
        for &(from, to) in &self.own {
            // SAFETY: both lie inside live buffers of this lookup, `part` bytes from their
            // ends; ordered on `cs` after the remap that wrote the source.
            unsafe { sys::cuMemcpyDtoDAsync_v2(to, from, self.part, cs.raw()) }
                .result()
                .map_err(|e| {
                    RuntimeError::Device(format!("copying the rank's own occurrences: {e:?}"))
                })?;
        }
        // SAFETY: every part lies inside this lookup's buffers or the table's storage
        // (its landing blocks), which only this stream touches until `done`.
        unsafe {
            comm.exchange(
                &format!("{}.lookup ids", self.name),
                &self.ids_parts,
                cs.raw(),
            )
        }?;
        for c in &self.gather {
            dev.launch_prepared(c, cs)?;
        }
        // SAFETY: as above.
        unsafe {
            comm.exchange(
                &format!("{}.lookup rows", self.name),
                &self.rows_parts,
                cs.raw(),
            )
        }?;
        self.done.record(cs)
    }

    /// Issues the gradients' exchange on `cs`, after the work that completed the pooled
    /// gradient (the caller's wait).
    fn issue_grads(
        &self,
        dev: &crate::cuda::CudaDevice,
        comm: &mut NcclComm,
        cs: &Stream,
    ) -> Result<(), RuntimeError> {
        for c in &self.grad_pack {
            dev.launch_prepared(c, cs)?;
        }
        // SAFETY: every part lies inside this lookup's gradient buffers, which only this
        // stream touches until the update (which waits for it).
        unsafe { comm.exchange(&format!("{}.grad", self.name), &self.grad_parts, cs.raw()) }
            .map(|_| ())
    }
}

/// `plan`'s launches prepared with `ptr` giving its operands' addresses, and the scratch
/// buffers allocated for it (kept alive by the caller as long as the launches).
fn prepare_plan(
    dev: &crate::cuda::CudaDevice,
    plan: &erase_ops::cuda::CudaPlan,
    ptr: &dyn Fn(KArg) -> Option<u64>,
) -> Result<(Vec<PreparedLaunch>, Vec<DeviceBuffer>), RuntimeError> {
    let scratch = plan
        .scratch
        .iter()
        .map(|&b| dev.alloc(b))
        .collect::<Result<Vec<_>, _>>()?;
    let calls = plan
        .calls
        .iter()
        .map(|c| {
            dev.prepare(c, &|a| match a {
                KArg::Scratch(j) => scratch.get(j).map(|b| b.ptr()),
                a => ptr(a),
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok((calls, scratch))
}

/// A tensor's device address in `p` (arena or leaf).
fn tensor_ptr(p: &CudaProgram<'_>, t: Tensor) -> Option<u64> {
    if let Some(pl) = p.plan.get(alias_root(p.g, &p.arena_set, t)) {
        return Some(p.arena.ptr() + pl.offset as u64);
    }
    p.leaves.get(&t).map(|b| b.ptr())
}

impl CudaProgram<'_> {
    /// Issues one data-parallel step (blocking dispatch): the program's launches with the
    /// collectives of `dp` on its communication stream (see the module documentation).
    pub fn run_data_parallel(
        &mut self,
        dp: &DataParallel,
        comm: &mut NcclComm,
    ) -> Result<(), RuntimeError> {
        if let Some((_, exec)) = self.graph {
            self.start.record(&self.streams[0])?;
            // SAFETY: `exec` is a live instantiated graph of this context whose buffers
            // (the arena, the leaves, `dp`'s) outlive the launch.
            unsafe { result::graph::launch(exec, self.streams[0].raw()) }
                .map_err(|e| RuntimeError::Device(format!("launching the step graph: {e:?}")))?;
            return self.end.record(&self.streams[0]);
        }
        self.start.record(&self.streams[0])?;
        if self.threaded {
            self.issue_data_parallel_threaded(dp, comm)?;
        } else {
            self.issue_data_parallel(dp, comm)?;
        }
        self.end.record(&self.streams[0])
    }

    /// [`CudaProgram::issue_data_parallel`] under threaded dispatch: the main stream's
    /// launches from this thread, the pool streams' from a dispatcher thread, each waiting
    /// on an event only after the other thread has issued the launch that records it. The
    /// collectives keep the program's order across the two threads: bucket `b` is issued
    /// (by the thread that issued the launch it follows) only after bucket `b - 1`, and
    /// the NCCL calls are serialised by a lock, so every rank issues the same sequence.
    /// No deadlock: a thread waiting for bucket `b - 1` has issued every launch before
    /// bucket `b`'s, and the other thread's waits before bucket `b - 1` only need those.
    fn issue_data_parallel_threaded(
        &self,
        dp: &DataParallel,
        comm: &mut NcclComm,
    ) -> Result<(), RuntimeError> {
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
        let n = self.prog.launches.len();
        let resolved = (0..dp.buckets.len())
            .map(|b| self.resolve_bucket(dp, b))
            .collect::<Result<Vec<_>, _>>()?;
        let mut recorder: Vec<Option<usize>> = vec![None; self.prog.events];
        for (i, l) in self.prog.launches.iter().enumerate() {
            if let Some(e) = l.record {
                recorder[e.0 as usize] = Some(i);
            }
        }
        let progress = [AtomicUsize::new(0), AtomicUsize::new(0)];
        let next_bucket = AtomicUsize::new(0);
        let failed = AtomicBool::new(false);
        let main = &self.streams[0];
        dp.begin.record(main)?;
        dp.begin.wait_on(&dp.comm_stream)?;
        if let Some(lk) = &dp.lookup {
            lk.issue(self.dev, comm, &dp.comm_stream)?;
        }
        let comm = std::sync::Mutex::new(comm);
        let (dev, prog, prepared, streams, events, g) = (
            self.dev,
            self.prog,
            &self.prepared,
            &self.streams,
            &self.events,
            self.g,
        );
        let spin = |until: &dyn Fn() -> bool| -> Result<(), RuntimeError> {
            while !until() {
                if failed.load(Ordering::Relaxed) {
                    return Err(RuntimeError::Device(
                        "the other dispatch thread failed".into(),
                    ));
                }
                std::thread::yield_now();
            }
            Ok(())
        };
        let exchange = |b: usize, from: &Stream| -> Result<(), RuntimeError> {
            spin(&|| next_bucket.load(Ordering::Acquire) == b)?;
            let mut c = comm
                .lock()
                .map_err(|_| RuntimeError::Device("the NCCL lock is poisoned".into()))?;
            exchange_resolved(dev, dp, b, &resolved[b], &mut c, from)?;
            next_bucket.store(b + 1, Ordering::Release);
            Ok(())
        };
        let work = |me: usize| -> Result<(), RuntimeError> {
            if me == 1 {
                dev.bind()?;
            }
            for (i, l) in prog.launches.iter().enumerate() {
                if usize::from(l.stream.0 != 0) != me {
                    continue;
                }
                let s = &streams[l.stream.0 as usize];
                for w in &l.waits {
                    if let Some(r) = recorder[w.event.0 as usize] {
                        let other = usize::from(prog.launches[r].stream.0 != 0);
                        if other != me {
                            spin(&|| progress[other].load(Ordering::Acquire) > r)?;
                        }
                    }
                    events[w.event.0 as usize].wait_on(s)?;
                }
                if let Some(lk) = dp.lookup.as_ref().filter(|lk| lk.readers.contains(&i)) {
                    lk.done.wait_on(s)?;
                }
                if i == dp.first_optimizer {
                    if dp.end {
                        exchange(0, s)?;
                    }
                    // the optimizer waits for every collective
                    spin(&|| next_bucket.load(Ordering::Acquire) == dp.buckets.len())?;
                    dp.done.record(&dp.comm_stream)?;
                    dp.done.wait_on(s)?;
                    for x in &dp.sparse {
                        for call in &x.update {
                            dev.launch_prepared(call, s)?;
                        }
                    }
                    for call in dp.lookup.iter().flat_map(|lk| &lk.update_owned) {
                        dev.launch_prepared(call, s)?;
                    }
                }
                if !dp.skip.contains(&i) {
                    for call in &prepared[i].calls {
                        dev.launch_prepared(call, s).map_err(|e| {
                            RuntimeError::Device(format!("'{}': {e}", g.node(l.node).name))
                        })?;
                    }
                }
                if let Some(e) = l.record {
                    events[e.0 as usize].record(s)?;
                }
                if !dp.end {
                    for (b, bucket) in dp.buckets.iter().enumerate() {
                        if bucket.after == i {
                            exchange(b, s)?;
                        }
                    }
                }
                progress[me].store(i + 1, Ordering::Release);
            }
            progress[me].store(n, Ordering::Release);
            Ok(())
        };
        crate::cuda::program::two_dispatch_threads(&failed, &work)?;
        self.join_pool_streams()
    }

    fn issue_data_parallel(
        &mut self,
        dp: &DataParallel,
        comm: &mut NcclComm,
    ) -> Result<(), RuntimeError> {
        let main = &self.streams[0];
        // the communication stream joins the step where it begins, and looks the
        // sharded table's rows up first
        dp.begin.record(main)?;
        dp.begin.wait_on(&dp.comm_stream)?;
        if let Some(lk) = &dp.lookup {
            lk.issue(self.dev, comm, &dp.comm_stream)?;
        }
        for i in 0..self.prog.launches.len() {
            let l = &self.prog.launches[i];
            let s = &self.streams[l.stream.0 as usize];
            for w in &l.waits {
                self.events[w.event.0 as usize].wait_on(s)?;
            }
            if let Some(lk) = dp.lookup.as_ref().filter(|lk| lk.readers.contains(&i)) {
                lk.done.wait_on(s)?;
            }
            if i == dp.first_optimizer {
                if dp.end {
                    self.exchange(dp, 0, comm, s)?;
                }
                // the optimizer waits for every collective, then applies the tables'
                // row-wise Adagrad to every rank's gathered gradients
                dp.done.record(&dp.comm_stream)?;
                dp.done.wait_on(s)?;
                for x in &dp.sparse {
                    for call in &x.update {
                        self.dev.launch_prepared(call, s)?;
                    }
                }
                for call in dp.lookup.iter().flat_map(|lk| &lk.update_owned) {
                    self.dev.launch_prepared(call, s)?;
                }
            }
            if !dp.skip.contains(&i) {
                for call in &self.prepared[i].calls {
                    self.dev.launch_prepared(call, s).map_err(|e| {
                        RuntimeError::Device(format!("'{}': {e}", self.g.node(l.node).name))
                    })?;
                }
            }
            if let Some(e) = l.record {
                self.events[e.0 as usize].record(s)?;
            }
            if !dp.end {
                for (b, bucket) in dp.buckets.iter().enumerate() {
                    if bucket.after == i {
                        self.exchange(dp, b, comm, s)?;
                    }
                }
            }
        }
        self.join_pool_streams()
    }

    /// Bucket `b`'s collectives on the communication stream, after the work issued so
    /// far on `from`.
    fn exchange(
        &self,
        dp: &DataParallel,
        b: usize,
        comm: &mut NcclComm,
        from: &Stream,
    ) -> Result<(), RuntimeError> {
        let r = self.resolve_bucket(dp, b)?;
        exchange_resolved(self.dev, dp, b, &r, comm, from)
    }

    /// The device addresses bucket `b` exchanges.
    fn resolve_bucket(&self, dp: &DataParallel, b: usize) -> Result<ResolvedBucket, RuntimeError> {
        let bucket = &dp.buckets[b];
        let missing = |t: Tensor| {
            RuntimeError::Device(format!(
                "data parallel: '{}' has no address",
                self.g.name(t)
            ))
        };
        let dense = bucket
            .dense
            .iter()
            .map(|&t| {
                tensor_ptr(self, t)
                    .map(|p| (p, self.g.shape(t).numel()))
                    .ok_or_else(|| missing(t))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let sparse = bucket
            .sparse
            .iter()
            .map(|&k| {
                let x = &dp.sparse[k];
                let ids = tensor_ptr(self, x.ids).ok_or_else(|| missing(x.ids))?;
                let dpd = tensor_ptr(self, x.dpooled).ok_or_else(|| missing(x.dpooled))?;
                Ok((k, ids, dpd))
            })
            .collect::<Result<Vec<_>, RuntimeError>>()?;
        Ok(ResolvedBucket { dense, sparse })
    }

    /// Issues every bucket's collectives once, outside any step, and waits: NCCL sets up
    /// what it needs on first use, which must not happen inside a graph capture. The
    /// values it averages are dead (the next step writes every gradient first).
    pub fn warm_up_collectives(
        &mut self,
        dp: &DataParallel,
        comm: &mut NcclComm,
    ) -> Result<(), RuntimeError> {
        let main = &self.streams[0];
        dp.begin.record(main)?;
        dp.begin.wait_on(&dp.comm_stream)?;
        if let Some(lk) = &dp.lookup {
            lk.issue(self.dev, comm, &dp.comm_stream)?;
        }
        for b in 0..dp.buckets.len() {
            self.exchange(dp, b, comm, main)?;
        }
        dp.comm_stream.synchronize()
    }

    /// The sharded table's lookup alone (a forward outside a step: an evaluation's),
    /// with every stream of the program waiting for it; nothing when no table is sharded.
    /// Every rank must issue it at the same point.
    pub fn look_up(&mut self, dp: &DataParallel, comm: &mut NcclComm) -> Result<(), RuntimeError> {
        let Some(lk) = &dp.lookup else {
            return Ok(());
        };
        dp.begin.record(&self.streams[0])?;
        dp.begin.wait_on(&dp.comm_stream)?;
        lk.issue(self.dev, comm, &dp.comm_stream)?;
        for s in &self.streams {
            lk.done.wait_on(s)?;
        }
        Ok(())
    }

    /// Captures the data-parallel step (every stream, the communication stream and its
    /// NCCL calls included) as one CUDA graph; later [`CudaProgram::run_data_parallel`]
    /// calls replay it. `comm`'s log gets one step's collectives, as issuing would.
    pub fn capture_data_parallel(
        &mut self,
        dp: &DataParallel,
        comm: &mut NcclComm,
    ) -> Result<(), RuntimeError> {
        let (graph, exec) = self.capture_with("the data-parallel step graph", |p| {
            p.issue_data_parallel(dp, comm)
        })?;
        self.graph = Some((graph, exec));
        Ok(())
    }

    /// Whether the last issued step has finished (without waiting).
    pub fn step_done(&self) -> Result<bool, RuntimeError> {
        // SAFETY: `end` is a live event of this context.
        match unsafe { result::event::query(self.end.raw()) } {
            Ok(()) => Ok(true),
            Err(result::DriverError(sys::CUresult::CUDA_ERROR_NOT_READY)) => Ok(false),
            Err(e) => Err(RuntimeError::Device(format!("waiting for the step: {e:?}"))),
        }
    }

    /// The main stream's time of the last finished step, in ms.
    pub fn step_ms(&self) -> Result<f32, RuntimeError> {
        self.end.elapsed_ms_since(&self.start)
    }
}

/// A bucket's device addresses: (pointer, elements) of each dense gradient, and
/// (table, ids pointer, pooled-gradient pointer) of each table it gathers.
struct ResolvedBucket {
    dense: Vec<(u64, usize)>,
    sparse: Vec<(usize, u64, u64)>,
}

/// Bucket `b`'s collectives on the communication stream, after the work issued so far on
/// `from` (the addresses resolved beforehand, so that any dispatch thread can issue it).
fn exchange_resolved(
    dev: &crate::cuda::CudaDevice,
    dp: &DataParallel,
    b: usize,
    r: &ResolvedBucket,
    comm: &mut NcclComm,
    from: &Stream,
) -> Result<(), RuntimeError> {
    let bucket = &dp.buckets[b];
    let cs = dp.comm_stream.raw();
    dp.ready[b].record(from)?;
    dp.ready[b].wait_on(&dp.comm_stream)?;
    if !r.dense.is_empty() {
        // SAFETY: the gradients live in the arena until the optimizer (which waits for
        // the communication stream) has read them; the stream waits for the launch that
        // completed them.
        unsafe { comm.all_reduce_mean(&bucket.name, &r.dense, cs) }?;
    }
    for &(k, ids, dpd) in &r.sparse {
        let x = &dp.sparse[k];
        if x.sharded {
            // the owners' blocks first, then (with replicated fields) the gather
            let lk = dp.lookup.as_ref().ok_or_else(|| {
                RuntimeError::Device(format!("'{}' is sharded but has no lookup", x.name))
            })?;
            lk.issue_grads(dev, comm, &dp.comm_stream)?;
            if lk.replicated {
                // SAFETY: as below.
                unsafe {
                    comm.all_gather(
                        &format!("{}.grad of the replicated fields", x.name),
                        dpd,
                        x.all_dp.ptr(),
                        x.dp_bytes,
                        cs,
                    )
                }?;
            }
            continue;
        }
        // SAFETY: the sources stay live until the optimizer reads them (it waits for this
        // stream); the destinations are `dp`'s, of `world` times the size.
        unsafe {
            comm.all_gather(
                &format!("{}.ids", x.name),
                ids,
                x.all_ids.ptr(),
                x.ids_bytes,
                cs,
            )?;
            comm.all_gather(
                &format!("{}.grad", x.name),
                dpd,
                x.all_dp.ptr(),
                x.dp_bytes,
                cs,
            )?;
        }
    }
    Ok(())
}
