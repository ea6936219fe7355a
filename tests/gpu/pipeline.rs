//! The trainer's pipeline on the GPU: batches from the loader thread through pinned memory
//! and the copy stream, losses read back one step late, and the captured step graph's
//! order checked edge by edge against the step program.

use erase::data::synthetic::{SyntheticConfig, SyntheticCtr};
use erase::graph::{DType, OptimizerConfig, Phase};
use erase::model::ctr::{CtrConfig, Variant};
use erase::runtime::cuda::graph::program_reachability;
use erase::runtime::cuda::program::CudaProgram;
use erase::train::{plan_step, Data, Dispatch, ScheduleOptions, Session, StepPlan};

fn small_plan(variant: Variant, occupancy: bool) -> StepPlan {
    let mut cfg = CtrConfig::small().with_variant(variant);
    cfg.batch = 512;
    plan_step(
        &cfg,
        DType::F32,
        &OptimizerConfig::default(),
        &ScheduleOptions {
            occupancy: if occupancy {
                erase::train::Occupancy::On
            } else {
                erase::train::Occupancy::Off
            },
            ..ScheduleOptions::default()
        },
    )
    .expect("plan")
}

#[test]
fn pipelined_training_matches_step_by_step_training_in_every_dispatch() {
    let Some(dev) =
        super::device("pipelined_training_matches_step_by_step_training_in_every_dispatch")
    else {
        return;
    };
    let steps = 20;
    let p = small_plan(Variant::Erase, false);
    let m = &p.model;
    let cfg = &m.cfg;
    // the reference: feed synchronously, run, wait, read the loss, step after step
    let gen = SyntheticCtr::new(SyntheticConfig {
        seed: 0,
        rows: cfg.rows,
        hot: cfg.hot,
    });
    let mut eager = CudaProgram::new(dev, &m.graph, &p.program, &p.memory, 1).unwrap();
    let (mut d, mut r, mut y) = (
        vec![0f32; cfg.batch * cfg.num_dense],
        vec![0u32; cfg.ids_per_batch()],
        vec![0f32; cfg.batch],
    );
    let mut want = Vec::new();
    for step in 0..steps {
        gen.fill_batch(
            1,
            (step * cfg.batch) as u64,
            cfg.batch,
            &mut d,
            &mut r,
            &mut y,
        );
        let (bd, bi, bo, bl) = m.batch_buffers(&d, &r, &y).unwrap();
        for (t, b) in [
            (m.inputs.dense, &bd),
            (m.inputs.ids, &bi),
            (m.inputs.offsets, &bo),
            (m.inputs.label, &bl),
        ] {
            eager.feed(t, b).unwrap();
        }
        eager.run().unwrap();
        eager.synchronize().unwrap();
        want.push(eager.get(m.main_loss).unwrap().to_f64()[0]);
    }
    for dispatch in [Dispatch::Blocking, Dispatch::Threaded, Dispatch::Graph] {
        let mut s =
            Session::with_dispatch(&p, Some(dev), dispatch, &Data::Synthetic, 1, 0, 1).unwrap();
        let mut got = Vec::new();
        let mut late = 0;
        for _ in 0..steps {
            if let Some(r) = s.train_step().unwrap() {
                // one step late: the result that comes back is the step before the one
                // just issued
                assert_eq!(
                    r.step + 1,
                    s.step,
                    "{dispatch:?}: results come one step late"
                );
                late += 1;
                got.push(r);
            }
        }
        got.extend(s.drain().unwrap());
        assert_eq!(
            late,
            steps - 1,
            "{dispatch:?}: every step but the last comes back late"
        );
        assert_eq!(got.len(), steps);
        for (k, r) in got.iter().enumerate() {
            assert_eq!(r.step, k + 1);
            assert!(
                r.loss.to_bits() == want[k].to_bits(),
                "{dispatch:?} step {k}: loss {} through the pipeline, {} step by step",
                r.loss,
                want[k]
            );
            assert!(
                r.secs > 0.0 && r.secs.is_finite(),
                "{dispatch:?} step {k}: {} s",
                r.secs
            );
        }
        let mut params: Vec<_> = m.params.iter().map(|x| x.1).collect();
        params.push(m.table);
        for t in params {
            assert!(
                s.read(t).unwrap() == eager.get(t).unwrap(),
                "{dispatch:?}: '{}' differs from step-by-step training",
                m.graph.name(t)
            );
        }
        println!(
            "{dispatch:?}: {steps} pipelined steps equal step-by-step training; the loader made the steps wait {:.1} ms",
            s.loader_stall().as_secs_f64() * 1e3
        );
    }
}

#[test]
fn captured_step_graph_orders_launches_exactly_as_the_program_does() {
    let Some(dev) =
        super::device("captured_step_graph_orders_launches_exactly_as_the_program_does")
    else {
        return;
    };
    for (variant, occupancy) in [
        (Variant::Erase, false),
        (Variant::Erase, true),
        (Variant::Detached, false),
        (Variant::Baseline, false),
    ] {
        let p = small_plan(variant, occupancy);
        let m = &p.model;
        let mut prog = CudaProgram::new(dev, &m.graph, &p.program, &p.memory, 1).unwrap();
        let kernels = prog.capture().unwrap();
        assert_eq!(kernels, prog.kernel_launches());
        // the main stream's nodes outrank the late stream's, which outrank the pool's,
        // which outrank the weight-gradient companions' (the graph runs by node
        // priority): one priority per rank that carries kernels (an H200 has six levels)
        let prio = prog.kernel_node_priorities().unwrap();
        let ranks: std::collections::BTreeSet<u32> = p
            .program
            .launches
            .iter()
            .filter(|l| l.spec.is_some())
            .map(|l| p.program.stream_rank(l.stream))
            .collect();
        let late = p.program.late_stream.is_some();
        assert_eq!(
            prio.len(),
            ranks.len(),
            "{variant:?}: kernel node priorities {prio:?}, stream ranks {ranks:?}"
        );
        if variant == Variant::Erase {
            assert!(ranks.len() >= 3, "{variant:?}: stream ranks {ranks:?}");
        }
        if late {
            let on_late = p
                .program
                .launches
                .iter()
                .filter(|l| Some(l.stream) == p.program.late_stream && l.spec.is_some())
                .count();
            assert!(on_late > 0, "{variant:?}: nothing on the late stream");
        }
        let mask = prog.kernel_mask();
        let got = prog.captured_order().unwrap();
        let want = program_reachability(&p.program, &mask);
        let n = p.program.launches.len();
        let (mut pairs, mut early_to_forward) = (0usize, 0usize);
        for a in 0..n {
            for b in 0..n {
                let (Some(g), Some(w)) = (got.ordered(a, b), want.ordered(a, b)) else {
                    continue;
                };
                pairs += 1;
                let name = |i: usize| m.graph.node(p.program.launches[i].node).name.clone();
                assert_eq!(
                    g,
                    w,
                    "{variant:?} occupancy {occupancy}: the graph {} '{}' -> '{}', the program {}",
                    if g { "orders" } else { "does not order" },
                    name(a),
                    name(b),
                    if w { "does" } else { "does not" }
                );
                let phase = |i: usize| m.graph.node(p.program.launches[i].node).phase;
                let early = p.program.launches[a].stream.0 != 0;
                if g && early && phase(a) == Phase::Backward && phase(b) == Phase::Forward {
                    early_to_forward += 1;
                }
            }
        }
        assert!(
            pairs > 1000,
            "{variant:?}: only {pairs} launch pairs compared"
        );
        if variant == Variant::Erase && !occupancy {
            assert_eq!(
                early_to_forward, 0,
                "without the occupancy rule no early backward may be ordered before a forward launch"
            );
        }
        println!(
            "{variant:?} occupancy {occupancy}: {pairs} launch pairs, graph order = program order; {early_to_forward} early-backward -> forward orderings"
        );
    }
}

#[test]
fn measured_trace_shows_erase_overlapping_and_detached_not() {
    let Some(dev) = super::device("measured_trace_shows_erase_overlapping_and_detached_not") else {
        return;
    };
    for dispatch in [Dispatch::Graph, Dispatch::Blocking] {
        let mut fractions = Vec::new();
        for variant in [Variant::Erase, Variant::Detached] {
            let cfg = CtrConfig::default().with_variant(variant);
            let p = plan_step(
                &cfg,
                DType::F32,
                &OptimizerConfig::default(),
                &ScheduleOptions::default(),
            )
            .unwrap();
            let mut s =
                Session::with_dispatch(&p, Some(dev), dispatch, &Data::Synthetic, 1, 0, 1).unwrap();
            for _ in 0..5 {
                s.train_step().unwrap();
            }
            let (trace, results) = s.trace_steps(3).unwrap();
            assert_eq!(results.last().map(|r| r.step), Some(8));
            assert_eq!(trace.steps(), vec![5, 6, 7]);
            let kernels = p
                .program
                .launches
                .iter()
                .filter(|l| l.spec.is_some())
                .count();
            for st in trace.steps() {
                let (lo, hi) = trace.step_bounds(st);
                let n = trace
                    .events
                    .iter()
                    .filter(|e| e.step == st && e.kind == erase::runtime::trace::TraceKind::Kernel)
                    .count();
                assert!(
                    n > kernels / 2,
                    "{variant:?} step {st}: {n} kernel events of {kernels}"
                );
                for e in trace.events.iter().filter(|e| e.step == st) {
                    assert!(
                        e.end_us >= e.start_us && e.start_us >= lo && e.end_us <= hi,
                        "{variant:?}: '{}' at {}..{} µs",
                        e.name,
                        e.start_us,
                        e.end_us
                    );
                }
                assert!(hi - lo > 100.0, "{variant:?}: a step of {} µs", hi - lo);
            }
            let json: serde_json::Value = serde_json::from_str(&trace.to_chrome_json()).unwrap();
            assert!(json.is_object() || json.is_array(), "the trace is JSON");
            let svg = trace.to_svg(7, "test");
            assert!(svg.starts_with("<svg") || svg.starts_with("<?xml"));
            let o = trace.overlap();
            println!(
                "{dispatch:?} {variant:?}: early backward {:.1} µs, overlapped {:.1} µs ({:.1} %), span {:.1} µs",
                o.early_backward_us,
                o.overlapped_us,
                100.0 * o.fraction,
                o.steps.last().map_or(0.0, |x| x.span_us)
            );
            fractions.push((variant, o.overlapped_us, o.fraction));
        }
        let erase = fractions[0];
        let detached = fractions[1];
        assert!(
            erase.1 > 0.0,
            "{dispatch:?}: no early backward kernel of erase ran beside a forward kernel"
        );
        assert_eq!(
            detached.1, 0.0,
            "{dispatch:?}: detached runs its backward after the forward, never beside it"
        );
    }
}
