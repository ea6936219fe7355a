//! `erase-ctr plan`: the step program, its memory and happens-before check, and the
//! simulator's predicted step per variant.

use anyhow::{bail, Context, Result};
use clap::Args;

use super::{ModelArgs, Rates, VariantArg};
use crate::graph::{DType, OptimizerConfig, Phase};
use crate::model::ctr::Variant;
use crate::runtime::program::occupancy::DeviceModel;
use crate::runtime::program::simulate::{simulate, BucketKind, SimConfig};
use crate::runtime::trace::Trace;
use crate::train::{plan_step, ScheduleOptions};

#[derive(Args)]
pub(crate) struct PlanArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The rates the simulator predicts with: `measured`, what Erase's kernels reach on
    /// an H200 (the pipelined GEMM tiles by their CTAs' k steps and epilogue bytes, the
    /// other GEMMs at 250 TFLOP/s, 350 reading bf16 copies in place, the fused attention
    /// 150, memory 3.6 TB/s, 6 µs a launch), or `peak`, what cuBLAS and a copy reach
    /// (736 TFLOP/s, 4.22 TB/s).
    #[arg(long, value_enum, default_value = "measured")]
    rates: Rates,
    /// The dispatch the prediction is of: `graph` (a replayed CUDA graph: no host time)
    /// or `blocking` (one host thread issuing each launch, 6 µs apiece on an H200's
    /// host).
    #[arg(long, value_enum, default_value = "graph")]
    dispatch: PlanDispatch,
    /// The variant whose program is printed (the predicted times cover all three).
    #[arg(long, value_enum, default_value = "erase")]
    variant: VariantArg,
    /// Print every launch, not only the cross-stream edges.
    #[arg(long)]
    full: bool,
    /// Write the simulator's predicted timeline of the printed variant as a picture: SVG,
    /// or PNG when FILE ends in `.png`; `-` prints it as text instead.
    #[arg(long, value_name = "FILE")]
    timeline: Option<std::path::PathBuf>,
    /// Write the predicted timeline of the printed variant as Chrome / Perfetto
    /// trace-event JSON (open it in ui.perfetto.dev or chrome://tracing).
    #[arg(long, value_name = "FILE")]
    trace: Option<std::path::PathBuf>,
    /// Print the N launches the cost model predicts to take longest.
    #[arg(long, value_name = "N")]
    kernels: Option<usize>,
    /// Also predict data-parallel steps on this many GPUs (NVLink, ring collectives),
    /// with each block's gradients all-reduced early and with one all-reduce at the end.
    /// Here --batch is each GPU's batch (`train --gpus N --batch B` splits a global B:
    /// plan it with --batch B/N).
    #[arg(long, value_name = "N", value_parser = super::at_least_one)]
    gpus: Option<usize>,
    /// With --gpus: where the embedding tables would live (`auto`: by size, the ranks'
    /// memory and the communication; `replicated`, `table` or `row` to force one), as
    /// `train --sharding` places them; the prediction shows both exchanges, the jagged
    /// one of CPU ranks and the fixed blocks of CUDA ranks.
    #[arg(long, value_enum, default_value = "auto")]
    sharding: ShardingArg,
    /// With --gpus: each rank's memory for embedding tables and their optimizer state, GB.
    #[arg(long, value_name = "GB", default_value = "120", value_parser = super::gigabytes)]
    rank_memory: u64,
    /// Predict with kernel times measured on a GPU instead of the cost model's: a trace
    /// written by `train --trace` or `bench --trace-dir` (best of a serial variant, whose
    /// kernels ran alone). Launches it lacks, and those this variant plans with another
    /// kernel or grid than the trace's (ERASE's GEMMs split less than a serial
    /// program's), keep the model's time.
    #[arg(long, value_name = "TRACE.json")]
    measured: Option<std::path::PathBuf>,
    /// Also predict the `erase` step for every side-stream count from 1 to N (with the
    /// occupancy rule as set) and name the fastest: how the simulator chooses the pool.
    #[arg(long, value_name = "N", value_parser = super::side_stream_count)]
    sweep_side_streams: Option<usize>,
}

/// What a data-parallel prediction takes from one simulated step.
struct DpInputs {
    /// When the backward work is joined.
    join_s: f64,
    /// The updates after it, of which the row-wise update of the tables takes `update_s`.
    optimizer_s: f64,
    update_s: f64,
    buckets: Vec<crate::runtime::program::simulate::Bucket>,
}

/// What a data-parallel prediction needs from a one-GPU simulation: when the backward
/// work is joined, how long the optimizer and the row-wise update take, and the
/// communication buckets (one per backward program's dense gradients; the tables' sparse
/// gradients gathered).
fn data_parallel_inputs(
    p: &crate::train::StepPlan,
    r: &crate::runtime::program::simulate::SimResult,
) -> DpInputs {
    use crate::graph::{Grad, Phase};
    use crate::runtime::program::simulate::{Bucket, BucketKind};
    let g = &p.model.graph;
    let launch_of: std::collections::BTreeMap<_, _> = p
        .program
        .launches
        .iter()
        .enumerate()
        .map(|(i, l)| (l.node, i))
        .collect();
    // where a data-parallel step joins: after the last launch before the updates (the
    // single-GPU ERASE plan has no join of its own: its updates wait by data)
    let join = p
        .program
        .launches
        .iter()
        .enumerate()
        .filter(|(_, l)| g.node(l.node).phase != Phase::Optimizer)
        .map(|(i, _)| r.launches[i].end)
        .fold(0.0, f64::max);
    let end_of = |prog: usize| -> f64 {
        p.partition.programs[prog]
            .nodes
            .iter()
            .filter_map(|n| launch_of.get(n).map(|&i| r.launches[i].end))
            .fold(0.0, f64::max)
    };
    let mut by_prog: std::collections::BTreeMap<usize, f64> = Default::default();
    let mut buckets = Vec::new();
    for (param, grad) in &p.training.grads.by_param {
        let Some(&prog) = p.partition.grad_complete.get(param) else {
            continue;
        };
        match grad {
            Grad::Dense(t) => *by_prog.entry(prog).or_default() += (g.shape(*t).numel() * 4) as f64,
            Grad::Sparse {
                ids,
                offsets,
                dpooled,
                ..
            } => buckets.push(Bucket {
                bytes: ((g.shape(*ids).numel()
                    + g.shape(*offsets).numel()
                    + g.shape(*dpooled).numel())
                    * 4) as f64,
                ready_s: end_of(prog),
                kind: BucketKind::AllGather,
            }),
        }
    }
    for (prog, bytes) in by_prog {
        buckets.push(Bucket {
            bytes,
            ready_s: end_of(prog),
            kind: BucketKind::AllReduce,
        });
    }
    let update_s = p
        .program
        .launches
        .iter()
        .enumerate()
        .filter(|(_, l)| matches!(g.node(l.node).op, crate::graph::Op::RowwiseAdagrad { .. }))
        .map(|(i, _)| r.launches[i].end - r.launches[i].start)
        .fold(0.0, |a, b| a + b);
    DpInputs {
        join_s: join,
        optimizer_s: r.step_s - join,
        update_s,
        buckets,
    }
}

pub(super) fn run(a: &PlanArgs) -> Result<()> {
    // the placement flags describe the ranks of --gpus: alone they would change nothing
    if a.gpus.is_none() {
        if a.sharding != ShardingArg::Auto {
            bail!(
                "--sharding {} places the tables over the ranks of --gpus N; give --gpus",
                a.sharding.as_str()
            );
        }
        if a.rank_memory != 120_000_000_000 {
            bail!("--rank-memory budgets each rank of --gpus N; give --gpus");
        }
    }
    if let Some(p) = a.timeline.as_deref().filter(|p| p.as_os_str() != "-") {
        super::check_output("--timeline", p)?;
        let ext = p.extension().and_then(|e| e.to_str()).unwrap_or_default();
        if !matches!(ext.to_ascii_lowercase().as_str(), "svg" | "png") {
            bail!(
                "--timeline {}: a picture is written as .svg or .png (or `-` prints it as text)",
                p.display()
            );
        }
    }
    if let Some(p) = &a.trace {
        super::check_output("--trace", p)?;
    }
    let mut dp: Vec<(Variant, DpInputs)> = Vec::new();
    let sched = a.model.schedule()?;
    let sim = SimConfig {
        device: match a.rates {
            // the measured rates, with --contention where it is given
            Rates::Measured => DeviceModel {
                contention: sched.device.contention,
                ..DeviceModel::h200_measured()
            },
            Rates::Peak => sched.device.clone(),
        },
        host_per_launch_s: match a.dispatch {
            PlanDispatch::Graph => 0.0,
            PlanDispatch::Blocking => crate::runtime::program::simulate::BLOCKING_HOST_PER_LAUNCH_S,
        },
    };
    let shown = Variant::from(a.variant);
    let mut rows = Vec::new();
    let mut erase_overlap = None;
    let mut critical = None;
    let measured = match &a.measured {
        Some(path) => Some(
            crate::profile::load_measured(path)
                .with_context(|| format!("--measured {}", path.display()))?,
        ),
        None => None,
    };
    for v in Variant::ALL {
        let cfg = a.model.synthetic_config(v)?;
        let p = plan_step(&cfg, DType::F32, &OptimizerConfig::default(), &sched)?;
        // each launch's time alone: measured where the trace has it, else the cost model's
        let work = match &measured {
            None => None,
            Some(m) => {
                let (work, found) =
                    crate::profile::measured_work(&p.program, &p.model.graph, m, &sim.device);
                let kernels = p
                    .program
                    .launches
                    .iter()
                    .filter(|l| l.spec.is_some())
                    .count();
                println!("{v}: {found} of {kernels} launches take their measured time");
                Some(work)
            }
        };
        let r = match &work {
            None => simulate(&p.program, &sim),
            Some(w) => crate::runtime::program::simulate::simulate_with(&p.program, &sim, w),
        };
        let g = &p.model.graph;
        if v == shown {
            critical = Some((v, critical_path_text(&p.program, &r)));
        }
        if v == shown {
            let streams = match p.program.streams {
                1 => "1 stream (main)".to_string(),
                n => format!(
                    "{n} streams (main and side1..side{}: {} pool stream(s) for the early backwards{})",
                    n - 1,
                    sched.side_streams.min(n - 1),
                    if n > sched.side_streams + 1 {
                        ", the rest their forwards' and weight gradients' streams"
                    } else {
                        ""
                    }
                ),
            };
            println!(
                "== {v}: batch {}, {streams}, occupancy {} ==",
                cfg.batch,
                sched.occupancy.as_str()
            );
            if let Some(c) = &p.occupancy {
                println!(
                    "occupancy model: {} of {} device-filling launches ordered against the other streams (predicted step {:.1} µs with --occupancy off, {:.1} µs as chosen)",
                    c.kept.len(),
                    c.candidates,
                    c.off_s * 1e6,
                    c.chosen_s * 1e6
                );
                for k in &c.kept {
                    println!(
                        "  runs alone: {} (predicted {:.1} µs shorter)",
                        k.label,
                        k.gain_s * 1e6
                    );
                }
                let tried: Vec<String> = c
                    .tried
                    .iter()
                    .map(|(p, t)| format!("{p}: {:.1} µs", t * 1e6))
                    .collect();
                println!(
                    "stream priorities: {} ({:+.1} µs against ranked without constraints); tried {}",
                    c.priorities,
                    0.0 - c.priority_gain_s * 1e6,
                    tried.join(", ")
                );
            } else {
                println!("stream priorities: {}", p.program.priorities);
            }
            let early: Vec<_> = p.partition.programs.iter().filter(|x| x.early).collect();
            println!(
                "backward programs: {} early, {} remainder",
                early.len(),
                p.partition.programs.len() - early.len()
            );
            for bp in &p.partition.programs {
                let after = g.node(p.partition.forward[bp.ready_after]).name.clone();
                println!(
                    "  {:<12} {:4} nodes, ready after forward #{} '{}'",
                    bp.name,
                    bp.nodes.len(),
                    bp.ready_after,
                    after
                );
            }
            println!("streams (runs of launches in issue order):");
            print!("{}", p.program.render_streams());
            if a.full {
                print!("{}", p.program.render(g));
            } else {
                println!("cross-stream edges ({} events):", p.program.events);
                for (i, r, w) in p.program.edges() {
                    let (li, lr) = (&p.program.launches[i], &p.program.launches[r]);
                    println!(
                        "  {} #{i} waits for {} #{r}: {}",
                        li.stream, lr.stream, w.why
                    );
                }
            }
            let trace = Trace::from_simulation(&p.program, &r, g);
            let title = format!(
                "erase-ctr {v}: predicted step on {} (batch {}, {} stream(s))",
                sched.device.name, cfg.batch, p.program.streams
            );
            let text = a.timeline.as_deref().is_some_and(|p| p.as_os_str() == "-");
            if let Some(path) = a.timeline.as_deref().filter(|_| !text) {
                let png = path
                    .extension()
                    .is_some_and(|e| e.eq_ignore_ascii_case("png"));
                let bytes = if png {
                    let h = 40 + 44 * trace.stream_count().max(1) as u32;
                    trace.to_png(0, 1600, h)
                } else {
                    trace.to_svg(0, &title).into_bytes()
                };
                std::fs::write(path, bytes)
                    .with_context(|| format!("--timeline {}", path.display()))?;
                println!("predicted timeline written to {}", path.display());
            }
            if let Some(path) = &a.trace {
                std::fs::write(path, trace.to_chrome_json())
                    .with_context(|| format!("--trace {}", path.display()))?;
                println!("predicted trace written to {}", path.display());
            }
            if text {
                println!("predicted timeline on {} (µs):", sched.device.name);
                for (i, l) in p.program.launches.iter().enumerate() {
                    let s = r.launches[i];
                    if l.spec.is_some() {
                        println!(
                            "  {:>9.1} {:>9.1}  {:<6} {}",
                            s.start * 1e6,
                            s.end * 1e6,
                            l.stream.to_string(),
                            l.label
                        );
                    }
                }
            }
            if let Some(n) = a.kernels {
                let mut by_time: Vec<(f64, usize)> = p
                    .program
                    .launches
                    .iter()
                    .enumerate()
                    .filter_map(|(i, l)| {
                        let t = match &work {
                            Some(w) => w[i],
                            None => sim.device.duration_s(l.spec.as_ref()?),
                        };
                        l.spec.as_ref().map(|_| (t, i))
                    })
                    .collect();
                by_time.sort_by(|a, b| b.0.total_cmp(&a.0));
                let total: f64 = by_time.iter().map(|x| x.0).sum();
                println!(
                    "longest launches predicted (alone) on {}{}; all launches add up to {:.1} µs:",
                    sim.device.name,
                    if work.is_some() {
                        ", measured where the trace has them"
                    } else {
                        ""
                    },
                    total * 1e6
                );
                println!(
                    "  {:>8}  {:>6}  {:>8}  {:>9}  {:>9}  kernel / launch",
                    "µs", "share", "grid", "GFLOP", "MB"
                );
                for (t, i) in by_time.into_iter().take(n) {
                    let l = &p.program.launches[i];
                    let s = l.spec.as_ref().map_or((0, 0.0, 0.0, String::new()), |s| {
                        let k = crate::profile::kernels_of(g, l.node, p.program.launch_at(g, l));
                        let k = if k.is_empty() {
                            s.kernel.to_string()
                        } else {
                            k
                        };
                        (s.grid, s.flops, s.bytes, k)
                    });
                    println!(
                        "  {:8.1}  {:5.1}%  {:8}  {:9.3}  {:9.2}  {} ({}) '{}'",
                        t * 1e6,
                        100.0 * t / total,
                        s.0,
                        s.1 / 1e9,
                        s.2 / 1e6,
                        s.3,
                        l.label,
                        g.node(l.node).name
                    );
                }
            }
            let fwd = p
                .program
                .launches
                .iter()
                .filter(|l| g.node(l.node).phase == Phase::Forward)
                .count();
            println!(
                "{} launches ({fwd} forward); arena {:.1} MiB (without reuse {:.1} MiB); happens-before check: no hazards",
                p.program.launches.len(),
                p.memory.arena_bytes as f64 / (1 << 20) as f64,
                p.memory.total_bytes as f64 / (1 << 20) as f64
            );
            println!();
        }
        if v == Variant::Erase {
            erase_overlap = Some(Trace::from_simulation(&p.program, &r, g).overlap_step(0));
        }
        if a.gpus.is_some() {
            dp.push((v, data_parallel_inputs(&p, &r)));
        }
        rows.push((
            v,
            r.step_s,
            p.memory.arena_bytes,
            r.busy_s,
            crate::train::step_flops(&p),
        ));
    }
    if let Some(max) = a.sweep_side_streams {
        let cfg = a.model.synthetic_config(Variant::Erase)?;
        println!(
            "erase step by side streams (occupancy rule {}), {}:",
            sched.occupancy.as_str(),
            if measured.is_some() {
                "measured kernel times"
            } else {
                "cost model"
            }
        );
        let mut best: Option<(usize, f64)> = None;
        for k in 1..=max.max(1) {
            let sk = ScheduleOptions {
                side_streams: k,
                ..sched.clone()
            };
            let p = plan_step(&cfg, DType::F32, &OptimizerConfig::default(), &sk)?;
            let r = match &measured {
                None => simulate(&p.program, &sim),
                Some(m) => {
                    let (work, _) =
                        crate::profile::measured_work(&p.program, &p.model.graph, m, &sim.device);
                    crate::runtime::program::simulate::simulate_with(&p.program, &sim, &work)
                }
            };
            println!(
                "  {k} side stream(s): {:8.1} µs, {} streams used",
                r.step_s * 1e6,
                p.program.streams
            );
            if best.is_none_or(|b| r.step_s < b.1 * (1.0 - 1e-3)) {
                best = Some((k, r.step_s));
            }
        }
        if let Some((k, t)) = best {
            println!(
                "  fastest: {k} side stream(s), {:.1} µs (fewer streams win ties)",
                t * 1e6
            );
        }
    }
    if let Some(n) = a.gpus {
        use crate::runtime::program::simulate::{predict_sharded_step, LinkModel, ShardedExchange};
        if n == 0 {
            bail!("--gpus must be at least 1");
        }
        let link = LinkModel::nvlink_h200();
        let mc = a.model.synthetic_config(Variant::Erase)?;
        let batch = mc.batch;
        let tables: Vec<crate::sharding::Table> = mc
            .field_rows()
            .iter()
            .enumerate()
            .map(|(i, &rows)| crate::sharding::Table {
                name: format!("C{}", i + 1),
                rows,
                dim: mc.dim,
            })
            .collect();
        let shard = crate::sharding::plan(&tables, n, a.rank_memory, a.sharding.into())?;
        let bytes = shard.all_to_all_bytes(&tables, batch);
        // the sparse gradients' share that stays replicated: by the fields' id slots
        let slots = mc.bag_slots();
        let all_slots: usize = slots.iter().sum();
        let replicated_slots: usize = shard
            .placements
            .iter()
            .zip(&slots)
            .filter(|(p, _)| matches!(p, crate::sharding::Placement::Replicated))
            .map(|(_, &s)| s)
            .sum();
        let exchange = ShardedExchange {
            lookup_bytes: bytes,
            grad_bytes: bytes,
            replicated_share: replicated_slots as f64 / all_slots.max(1) as f64,
        };
        let sharded = (bytes > 0.0).then_some(&exchange);
        // what CUDA ranks exchange for the same placement: fixed blocks (every position
        // set by the batch's shape, so the step can be captured), the most any rank sends
        let hot = slots.first().copied().unwrap_or(1);
        let cuda_bytes = if sharded.is_some() && slots.iter().all(|&h| h == hot) {
            let (mut rows_most, mut grads_most) = (0f64, 0f64);
            let all = crate::sharding::cuda_geometries(
                &mc.field_rows(),
                (mc.dim, hot, batch),
                n,
                a.rank_memory,
                a.sharding.into(),
            )?;
            for geo in all.iter().flatten() {
                let rows: usize = geo.sends().iter().map(|b| b.rows).sum();
                let ids = 2 * geo.n_ids() * 4 * (n - 1);
                rows_most = rows_most.max((rows * mc.dim * 4 + ids) as f64);
                let grads = geo.receives().len() * geo.examples * mc.dim * 4;
                grads_most = grads_most.max(grads as f64);
            }
            Some((rows_most, grads_most))
        } else {
            None
        };
        let cuda_exchange = cuda_bytes.map(|(rows, grads)| ShardedExchange {
            lookup_bytes: rows,
            grad_bytes: grads,
            ..exchange
        });
        println!(
            "predicted data-parallel steps ({} examples per GPU; ring collectives at {:.0} GB/s bus bandwidth, {:.0} µs per hop), tables replicated{}:",
            batch,
            link.bus_bw / 1e9,
            link.latency_s * 1e6,
            if sharded.is_some() {
                format!(
                    " and sharded as `--sharding {}` places them below (`sharded`: a jagged exchange, as CPU ranks run it; `sharded-cuda`: the fixed blocks CUDA ranks exchange)",
                    a.sharding.as_str()
                )
            } else {
                String::new()
            }
        );
        for (v, d) in &dp {
            for (early, label) in [
                (true, "early all-reduce"),
                (false, "one all-reduce at the end"),
            ] {
                let kinds = [
                    (None, "replicated"),
                    (sharded, "sharded"),
                    (cuda_exchange.as_ref(), "sharded-cuda"),
                ];
                for (x, kind) in kinds
                    .into_iter()
                    .filter(|(x, k)| x.is_some() || *k == "replicated")
                {
                    let predict = |ranks: usize| {
                        predict_sharded_step(
                            d.join_s,
                            d.optimizer_s,
                            d.update_s,
                            &d.buckets,
                            &link,
                            ranks,
                            early,
                            x,
                        )
                    };
                    let (one, pn) = (predict(1), predict(n));
                    println!(
                        "  {:<9} {:<26} {:<10} {n} GPUs: {:8.1} µs, {:>9.0} ex/s, scaling {:5.1} %, exposed communication {:7.1} µs of {:7.1}",
                        v.as_str(),
                        label,
                        kind,
                        pn.step_s * 1e6,
                        (n * batch) as f64 / pn.step_s,
                        100.0 * one.step_s / pn.step_s,
                        pn.exposed_comm_s * 1e6,
                        pn.comm_s * 1e6
                    );
                }
            }
        }
        {
            let p = &shard;
            let count = |f: fn(&crate::sharding::Placement) -> bool| {
                p.placements.iter().filter(|x| f(x)).count()
            };
            let lo = p.rank_bytes.iter().min().copied().unwrap_or(0) as f64 / 1e6;
            let hi = p.rank_bytes.iter().max().copied().unwrap_or(0) as f64 / 1e6;
            println!(
                "  sharding {} (as `train --sharding` places them): {} replicated, {} table-wise, {} row-wise; tables on a rank {:.1} to {:.1} MB of {:.1} GB; the lookup's jagged all-to-all moves {:.1} MB per rank each way, {:.1} µs, and the gradients' as much",
                a.sharding.as_str(),
                count(|x| matches!(x, crate::sharding::Placement::Replicated)),
                count(|x| matches!(x, crate::sharding::Placement::Table(_))),
                count(|x| matches!(x, crate::sharding::Placement::Row)),
                lo,
                hi,
                a.rank_memory as f64 / 1e9,
                bytes / 1e6,
                if bytes > 0.0 { link.all_to_all_s(bytes, n) * 1e6 } else { 0.0 }
            );
        }
        if let Some((rows, grads)) = cuda_bytes {
            let t = |b: f64| {
                if b > 0.0 {
                    link.all_to_all_s(b, n) * 1e6
                } else {
                    0.0
                }
            };
            println!(
                "  CUDA ranks exchange fixed blocks (every position set by the batch's shape, so the step is captured whole): the lookup sends at most {:.1} MB per rank (one row per id slot of a field to each rank that asks it, and the ids both ways), {:.1} µs; the gradients {:.1} MB (each field's bags to each owner of its rows), {:.1} µs",
                rows / 1e6,
                t(rows),
                grads / 1e6,
                t(grads)
            );
        }
        if let Some((_, d)) = dp.first() {
            let gathered: f64 = d
                .buckets
                .iter()
                .filter(|b| b.kind == BucketKind::AllGather)
                .map(|b| b.bytes)
                .sum();
            println!(
                "  replicated tables: each rank gathers {:.1} MB of (ids, gradients) from every other rank, {:.1} µs at {n} GPUs, and updates every rank's rows ({:.1} µs at one rank's), both growing with N",
                gathered / 1e6,
                link.all_gather_s(gathered, n) * 1e6,
                d.update_s * 1e6
            );
        }
    }
    println!(
        "predicted step time on {} (simulator, {} dispatch):",
        sim.device.name,
        match a.dispatch {
            PlanDispatch::Graph => "graph",
            PlanDispatch::Blocking => "blocking",
        }
    );
    let base = rows[0].1;
    for (v, t, mem, busy, flops) in &rows {
        let batch = a.model.synthetic_config(*v)?.batch as f64;
        let qps = batch / t;
        let busy: Vec<String> = busy.iter().map(|b| format!("{:.0}", b * 1e6)).collect();
        println!(
            "  {:<9} {:8.1} µs  {:>9.0} ex/s  {:+6.1} % vs baseline   {:.1} MFLOP/example, MFU {:.1} %   arena {:7.1} MiB   busy µs per stream [{}]",
            v.as_str(),
            t * 1e6,
            qps,
            (base / t - 1.0) * 100.0,
            flops / batch / 1e6,
            100.0 * flops / t / crate::bench::MFU_PEAK_FLOPS,
            *mem as f64 / (1 << 20) as f64,
            busy.join(", ")
        );
    }
    if let Some((v, text)) = critical {
        print!("critical path ({v}): {text}");
    }
    if let Some(o) = erase_overlap {
        println!(
            "predicted overlap (erase): early backward {:.1} µs, of which {:.1} µs ({:.1} %) ran while forward work ran on another stream",
            o.early_backward_us,
            o.overlapped_us,
            100.0 * o.fraction
        );
        let busy: Vec<String> = o
            .streams
            .iter()
            .map(|b| format!("{} {:.0} %", b.name, 100.0 * b.busy_fraction))
            .collect();
        println!(
            "  busy share of the {:.1} µs step per stream: {}",
            o.span_us,
            busy.join(", ")
        );
    }
    Ok(())
}

/// The predicted step's critical path (`simulate::critical_path`): its launches' time by
/// stream and by block and phase, and its longest launches.
fn critical_path_text(
    prog: &crate::runtime::program::schedule::StepProgram,
    r: &crate::runtime::program::simulate::SimResult,
) -> String {
    use std::collections::BTreeMap;
    let path = crate::runtime::program::simulate::critical_path(prog, r);
    let us = |i: usize| (r.launches[i].end - r.launches[i].start) * 1e6;
    let total: f64 = path.iter().map(|&i| us(i)).sum();
    let mut runs: Vec<(String, f64, usize)> = Vec::new();
    for &i in &path {
        let l = &prog.launches[i];
        let key = if l.label.phase == "optim" {
            format!("{} optim", l.stream)
        } else {
            format!("{} {}:{}", l.stream, l.label.phase, l.label.block)
        };
        match runs.last_mut() {
            Some((k, t, c)) if *k == key => {
                *t += us(i);
                *c += 1;
            }
            _ => runs.push((key, us(i), 1)),
        }
    }
    let mut by_op: BTreeMap<String, f64> = BTreeMap::new();
    for &i in &path {
        *by_op.entry(prog.launches[i].label.to_string()).or_default() += us(i);
    }
    let mut ops: Vec<(String, f64)> = by_op.into_iter().collect();
    ops.sort_by(|a, b| b.1.total_cmp(&a.1));
    let runs: Vec<String> = runs
        .iter()
        .map(|(k, t, c)| format!("{k} {t:.1} µs ({c})"))
        .collect();
    let ops: Vec<String> = ops
        .iter()
        .take(5)
        .map(|(k, t)| format!("{k} {t:.1} µs"))
        .collect();
    format!(
        "{} launches, {total:.1} µs\n  in order: {}\n  most of it: {}\n",
        path.len(),
        runs.join(" -> "),
        ops.join(", ")
    )
}

/// `plan --dispatch`.
#[derive(Clone, Copy, clap::ValueEnum, PartialEq, Eq)]
pub(super) enum PlanDispatch {
    Graph,
    Blocking,
}

/// `--sharding`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(super) enum ShardingArg {
    Auto,
    Replicated,
    Table,
    Row,
}

impl ShardingArg {
    fn as_str(self) -> &'static str {
        match self {
            ShardingArg::Auto => "auto",
            ShardingArg::Replicated => "replicated",
            ShardingArg::Table => "table",
            ShardingArg::Row => "row",
        }
    }
}

impl From<ShardingArg> for crate::sharding::Sharding {
    fn from(a: ShardingArg) -> Self {
        match a {
            ShardingArg::Auto => crate::sharding::Sharding::Auto,
            ShardingArg::Replicated => crate::sharding::Sharding::Replicated,
            ShardingArg::Table => crate::sharding::Sharding::Table,
            ShardingArg::Row => crate::sharding::Sharding::Row,
        }
    }
}
