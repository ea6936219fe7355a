//! The ERASE plan of the CTR model: early programs on side streams, a minimal and
//! checked set of cross-stream edges, and the same bits as the detached schedule.

use erase::data::synthetic::{SyntheticConfig, SyntheticCtr};
use erase::graph::{DType, Op, OptimizerConfig, Phase};
use erase::model::ctr::{CtrConfig, Variant};
use erase::runtime::cpu::runner::{random_order, ProgramRunner};
use erase::runtime::program::hb::check;
use erase::runtime::program::memory::{alias_root, Placement};
use erase::runtime::program::schedule::{happens_before, vector_clocks, EdgeKind, StreamId};
use erase::train::{plan_step, ScheduleOptions, StepPlan};

fn tiny(variant: Variant) -> CtrConfig {
    let mut c = CtrConfig::small().with_variant(variant);
    c.batch = 8;
    c.rows = 50;
    c
}

fn plan(cfg: &CtrConfig, side: usize) -> StepPlan {
    plan_with(
        cfg,
        &ScheduleOptions {
            side_streams: side,
            ..Default::default()
        },
    )
}

fn plan_with(cfg: &CtrConfig, s: &ScheduleOptions) -> StepPlan {
    plan_step(cfg, DType::F32, &OptimizerConfig::default(), s).unwrap()
}

#[test]
fn erase_plan_starts_every_block_backward_early_on_side_streams() {
    let p = plan(&CtrConfig::small(), 4);
    let prog = &p.program;
    let g = &p.model.graph;
    let last_forward = prog
        .launches
        .iter()
        .rposition(|l| g.node(l.node).phase == Phase::Forward)
        .unwrap();
    let early: Vec<_> = p.partition.programs.iter().filter(|x| x.early).collect();
    assert!(early.len() >= 5, "{} early programs", early.len());
    let mut sides = std::collections::BTreeSet::new();
    for bp in &early {
        let first = prog
            .launches
            .iter()
            .position(|l| l.node == bp.nodes[0])
            .unwrap();
        let s = prog.launches[first].stream;
        assert_ne!(s, StreamId::MAIN, "program {} on the main stream", bp.name);
        assert!(
            first < last_forward,
            "program {} starts after the last forward launch",
            bp.name
        );
        sides.insert(s);
    }
    assert!(
        sides.len() >= 2,
        "early programs use {} side stream(s)",
        sides.len()
    );
    let names: Vec<&str> = early.iter().map(|b| b.name.as_str()).collect();
    // the embedding ids' sort first (it needs only the batch), then readied in the order
    // the blocks run forward: bottom, then the long backwards first
    assert_eq!(
        names,
        [
            "embedding/inputs",
            "bottom",
            "autoint",
            "cross",
            "masknet",
            "deep",
            "interaction"
        ]
    );
    // the embedding table is shared by five blocks: its update waits for the last of them
    let table_prog = p.partition.grad_complete[&p.model.table];
    assert_eq!(p.partition.programs[table_prog].name, "interaction");
    // baseline: one remainder; nothing early but the ids' sort, which needs no backward
    let b = plan(&CtrConfig::small().with_variant(Variant::Baseline), 4);
    let early: Vec<&str> = b
        .partition
        .programs
        .iter()
        .filter(|x| x.early)
        .map(|x| x.name.as_str())
        .collect();
    assert_eq!(early, ["embedding/inputs"]);
    assert_eq!(b.program.streams, 1);
}

#[test]
fn schedule_is_deterministic_byte_for_byte() {
    let a = plan(&CtrConfig::small(), 3);
    let b = plan(&CtrConfig::small(), 3);
    assert_eq!(a.program, b.program);
    assert_eq!(
        a.program.render(&a.model.graph),
        b.program.render(&b.model.graph)
    );
    assert_eq!(a.memory, b.memory);
}

#[test]
fn every_edge_and_every_placement_of_the_erase_plan_is_needed() {
    let p = plan(&CtrConfig::small(), 4);
    let (g, prog, mem) = (&p.model.graph, &p.program, &p.memory);
    assert!(check(g, prog, mem).is_empty());
    let mut tested = 0;
    for (i, l) in prog.launches.iter().enumerate() {
        for w in 0..l.waits.len() {
            let mut broken = prog.clone();
            broken.launches[i].waits.remove(w);
            let hazards = check(g, &broken, mem);
            if l.waits[w].kind == EdgeKind::Occupancy {
                continue; // ordering for speed only, marked as such
            }
            assert!(
                !hazards.is_empty(),
                "removing '{}' went unnoticed",
                l.waits[w].why
            );
            tested += 1;
        }
    }
    assert!(tested >= 8, "only {tested} edges");
    // every memory-reuse decision is safe only because of the order it relies on: moving
    // the later tensor onto bytes of a tensor live at the same time must be caught
    let clocks = vector_clocks(prog);
    let at = |t| {
        prog.launches
            .iter()
            .position(|l| l.node == g.info(t).producer)
    };
    let arena = mem.place.keys().map(|&k| (k, ())).collect();
    let mut moved = 0;
    for &(later, _) in mem.reuse.iter().take(40) {
        let Some(a) = at(later) else { continue };
        let rival = mem.place.iter().find(|(&t, pl)| {
            alias_root(g, &arena, t) == t
                && pl.offset != mem.place[&later].offset
                && at(t).is_some_and(|b| {
                    b != a
                        && !happens_before(prog, &clocks, a, b)
                        && !happens_before(prog, &clocks, b, a)
                })
        });
        let Some((&rival, rpl)) = rival else { continue };
        let mut bad = mem.clone();
        for (t, pl) in mem.place.iter() {
            if alias_root(g, &arena, *t) == later {
                bad.place.insert(
                    *t,
                    Placement {
                        offset: rpl.offset,
                        ..*pl
                    },
                );
            }
        }
        assert!(
            !check(g, prog, &bad).is_empty(),
            "placing '{}' over concurrent '{}' went unnoticed",
            g.name(later),
            g.name(rival)
        );
        moved += 1;
    }
    assert!(moved >= 10, "only {moved} placements tested");
}

/// Runs `steps` steps of a plan with the step-program runner; returns parameter bytes.
fn run(p: &StepPlan, steps: usize, shuffle: Option<u64>) -> Vec<u8> {
    let m = &p.model;
    let c = &m.cfg;
    let gen = SyntheticCtr::new(SyntheticConfig {
        seed: 0,
        rows: c.rows,
        hot: c.hot,
    });
    let mut r = ProgramRunner::new(&m.graph, &p.program, &p.memory, 11, 2).unwrap();
    let (mut d, mut rows, mut y) = (
        vec![0f32; c.batch * 13],
        vec![0u32; c.ids_per_batch()],
        vec![0f32; c.batch],
    );
    for s in 0..steps {
        gen.fill_batch(1, (s * c.batch) as u64, c.batch, &mut d, &mut rows, &mut y);
        let (a, b, o, l) = m.batch_buffers(&d, &rows, &y).unwrap();
        r.feed(m.inputs.dense, a).unwrap();
        r.feed(m.inputs.ids, b).unwrap();
        r.feed(m.inputs.offsets, o).unwrap();
        r.feed(m.inputs.label, l).unwrap();
        match shuffle {
            Some(seed) => r
                .run_order(&random_order(&p.program, seed * 100 + s as u64))
                .unwrap(),
            None => r.run().unwrap(),
        }
    }
    let mut out: Vec<u8> = r.get(m.table).unwrap().bytes().to_vec();
    for (_, t) in &m.params {
        out.extend_from_slice(r.get(*t).unwrap().bytes());
    }
    out
}

#[test]
fn erase_equals_detached_bit_for_bit_and_baseline_differs() {
    let e = plan(&tiny(Variant::Erase), 4);
    let d = plan(&tiny(Variant::Detached), 4);
    let b = plan(&tiny(Variant::Baseline), 4);
    let steps = 4;
    let want = run(&d, steps, None);
    assert!(
        run(&e, steps, None) == want,
        "erase (issue order) differs from detached"
    );
    for seed in 0..6 {
        assert!(
            run(&e, steps, Some(seed)) == want,
            "erase (interleaving {seed}) differs from detached"
        );
    }
    assert!(
        run(&b, steps, None) != want,
        "baseline should train differently"
    );
}

/// ERASE's early per-block update: each early block's parameters updated right after its
/// backward, on its side stream, the step count incremented first; the same bits as the
/// single update after the join, in issue order and in random interleavings.
#[test]
fn early_per_block_updates_run_after_their_block_and_train_the_same_bits() {
    let cfg = tiny(Variant::Erase);
    let early = plan_step(
        &cfg,
        DType::F32,
        &OptimizerConfig::default(),
        &ScheduleOptions {
            early_updates: true,
            ..Default::default()
        },
    )
    .unwrap();
    let end = plan(&cfg, 4);
    let prog = &early.program;
    let g = &early.model.graph;
    let name = |i: usize| g.node(prog.launches[i].node).name.clone();
    // the step count first, on main
    assert!(name(0).contains("optim/step"), "first launch: {}", name(0));
    // one update per early block, each on its block's stream right after its backward
    let mut early_updates = 0;
    for (k, ups) in &early.partition.early_updates {
        let bwd = &early.partition.programs[*k];
        assert!(bwd.early);
        for &u in ups {
            let i = prog.launches.iter().position(|l| l.node == u).unwrap();
            let last_bwd = prog
                .launches
                .iter()
                .rposition(|l| bwd.nodes.contains(&l.node))
                .unwrap();
            // on the block's side stream (its weight gradients ran on the companion)
            let side = prog
                .launches
                .iter()
                .find(|l| l.node == bwd.nodes[0])
                .unwrap()
                .stream;
            assert_eq!(prog.launches[i].stream, side);
            assert_ne!(prog.launches[i].stream, StreamId::MAIN, "{}", name(i));
            assert!(i > last_bwd, "{} before its block's backward", name(i));
            early_updates += 1;
        }
    }
    let blocks = early.partition.programs.iter().filter(|p| p.early).count();
    assert!(
        early_updates >= blocks - 1,
        "{early_updates} early updates for {blocks} blocks"
    );
    assert_eq!(check(g, prog, &early.memory).len(), 0);
    // the same bits as one update after the join
    let want = run(&end, 4, None);
    assert!(
        run(&early, 4, None) == want,
        "early updates (issue order) differ"
    );
    for seed in 0..4 {
        assert!(
            run(&early, 4, Some(seed)) == want,
            "early updates (interleaving {seed}) differ"
        );
    }
}

#[test]
fn the_ctr_step_uses_the_fused_forms() {
    use erase::graph::Op;
    for variant in [Variant::Baseline, Variant::Erase] {
        let p = plan(&tiny(variant), 4);
        let g = &p.model.graph;
        let count = |f: &dyn Fn(&Op) -> bool| g.nodes().iter().filter(|n| f(&n.op)).count();
        // AutoInt reads q, k, v in place: no slices of the projection, no pads back
        assert_eq!(
            count(&|o| matches!(o, Op::Pad { .. })),
            0,
            "{variant:?}: pads"
        );
        assert!(
            count(&|o| matches!(o, Op::Attention { packed: true, .. })) > 0,
            "{variant:?}: no packed attention"
        );
        assert_eq!(
            count(&|o| matches!(o, Op::Attention { packed: false, .. })),
            0,
            "{variant:?}: attention on sliced q, k, v"
        );
        // a ReLU straight after a linear is the linear's epilogue
        for n in g.nodes() {
            if matches!(n.op, Op::Relu) {
                let producer = g.info(n.inputs[0]).producer;
                assert!(
                    !matches!(g.node(producer).op, Op::Linear { .. }),
                    "{variant:?}: '{}' is a separate ReLU after a linear",
                    n.name
                );
            }
        }
        assert!(count(&|o| matches!(o, Op::Linear { relu: true, .. })) >= 10);
        // the cross update is one mul_add a layer (fused with the layer that makes its
        // factor only where asked: --fuse-cross-updates); the bias gradients come with dw
        assert_eq!(
            count(&|o| matches!(o, Op::MulAdd)),
            3,
            "{variant:?}: mul_add"
        );
        assert_eq!(count(&|o| matches!(o, Op::LinearMulAdd { .. })), 0);
        assert_eq!(
            count(&|o| matches!(o, Op::SumToShape)),
            0,
            "{variant:?}: a bias gradient of its own"
        );
        assert!(count(&|o| matches!(o, Op::LinearGradWeight { bias: true })) >= 10);
        assert!(count(&|o| matches!(o, Op::MulGrad { .. })) >= 4);
        // a ReLU output that only the next linear reads gets its gradient's mask in that
        // linear's dx: a relu_grad is left only where the ReLU's output has other readers
        let masked = count(&|o| {
            matches!(
                o,
                Op::LinearGradInput {
                    relu_mask: true,
                    residual: false
                }
            )
        });
        assert!(masked >= 5, "{variant:?}: {masked} masked dx");
        // a layer input with one other reader (the cross layers' x_l, read by the next
        // layer's mul_add too): its two gradient contributions summed in the dx GEMM's
        // epilogue, no grad_sum of its own
        for l in 0..2 {
            let sum = format!("cross/mul_add{l}.grad_sum");
            assert!(
                !g.nodes().iter().any(|n| n.name == sum),
                "{variant:?}: '{sum}' is a pass of its own"
            );
        }
        let summed = count(&|o| matches!(o, Op::LinearGradInput { residual: true, .. }));
        assert!(summed >= 2, "{variant:?}: {summed} dx with a residual");
        for n in g.nodes() {
            if matches!(n.op, Op::ReluGrad) {
                let y = n.inputs[1];
                let readers: Vec<_> = g
                    .nodes()
                    .iter()
                    .filter(|m| m.phase == erase::graph::Phase::Forward && m.inputs.contains(&y))
                    .collect();
                assert!(
                    !(readers.len() == 1 && matches!(readers[0].op, Op::Linear { .. })),
                    "{variant:?}: '{}' could be the next linear's epilogue",
                    n.name
                );
            }
        }
    }
}

#[test]
fn the_last_early_program_has_the_late_stream_to_itself() {
    let p = plan(&tiny(Variant::Erase), 4);
    let prog = &p.program;
    let g = &p.model.graph;
    let late = erase::runtime::program::schedule::StreamId(4);
    assert_eq!(prog.late_stream, Some(late));
    // the programs readied during the forward, in order: the last one alone on side4
    let early: Vec<_> = p.partition.programs.iter().filter(|q| q.early).collect();
    assert!(early.len() >= 2, "{} early programs", early.len());
    let stream_of = |name: &str| -> Vec<u16> {
        let mut s: Vec<u16> = prog
            .launches
            .iter()
            .filter(|l| l.label.block == name && l.label.phase == "bwd")
            .filter(|l| !matches!(g.node(l.node).op, Op::LinearGradWeight { .. }))
            .map(|l| l.stream.0)
            .collect();
        s.dedup();
        s
    };
    // the weight gradients on the companion of their program's stream
    for (i, l) in prog.launches.iter().enumerate() {
        if l.label.phase == "bwd" && matches!(g.node(l.node).op, Op::LinearGradWeight { .. }) {
            let first = prog
                .launches
                .iter()
                .position(|m| m.label.block == l.label.block && m.label.phase == "bwd")
                .unwrap();
            if prog.launches[first].stream != StreamId::MAIN {
                assert_eq!(l.stream.0, prog.launches[first].stream.0 + 4, "launch {i}");
            }
        }
    }
    let ready_last = early
        .iter()
        .max_by_key(|q| {
            prog.launches
                .iter()
                .position(|l| l.label.block == q.name && l.label.phase == "bwd")
                .unwrap_or(0)
        })
        .unwrap();
    assert_eq!(stream_of(&ready_last.name), vec![4], "{}", ready_last.name);
    for q in early.iter().filter(|q| q.name != ready_last.name) {
        let s = stream_of(&q.name);
        assert!(
            s.len() == 1 && (1..4).contains(&s[0]),
            "{} on {s:?}",
            q.name
        );
    }
    // off: the pool is shared round-robin and no stream is promoted
    let sched = ScheduleOptions {
        side_streams: 4,
        late_stream: false,
        ..Default::default()
    };
    let off = plan_with(&tiny(Variant::Erase), &sched);
    assert_eq!(off.program.late_stream, None);
}

#[test]
fn weight_gradients_leave_the_data_gradient_chain_for_companion_streams() {
    let sched = ScheduleOptions {
        side_streams: 4,
        weight_grad_streams: true,
        ..Default::default()
    };
    let p = plan_with(&CtrConfig::small(), &sched);
    let (g, prog, mem) = (&p.model.graph, &p.program, &p.memory);
    // main, the pool, its companions, then the blocks' forward streams
    assert_eq!(prog.forward_from, Some(StreamId(1 + 2 * 4)));
    assert!(check(g, prog, mem).is_empty());
    let mut companions = std::collections::BTreeSet::new();
    for bp in p.partition.programs.iter().filter(|x| x.early) {
        let side = prog
            .launches
            .iter()
            .find(|l| l.node == bp.nodes[0])
            .unwrap()
            .stream;
        for &n in &bp.nodes {
            let l = prog.launches.iter().find(|l| l.node == n).unwrap();
            if matches!(g.node(n).op, erase::graph::Op::LinearGradWeight { .. }) {
                // the companion of the program's side stream
                assert_eq!(l.stream.0, side.0 + 4, "{} of {}", g.node(n).name, bp.name);
                companions.insert(l.stream);
            } else {
                assert_eq!(l.stream, side, "{} of {}", g.node(n).name, bp.name);
            }
        }
    }
    assert!(companions.len() >= 3, "{companions:?}");
    // the remainder keeps its weight gradients on the main stream
    let remainder = p.partition.programs.iter().find(|x| !x.early).unwrap();
    for &n in &remainder.nodes {
        let l = prog.launches.iter().find(|l| l.node == n).unwrap();
        assert_eq!(l.stream, StreamId::MAIN);
    }
    // every edge the split adds is one the plan needs
    for (i, l) in prog.launches.iter().enumerate() {
        for w in 0..l.waits.len() {
            if l.waits[w].kind == EdgeKind::Occupancy {
                continue;
            }
            let mut broken = prog.clone();
            broken.launches[i].waits.remove(w);
            assert!(
                !check(g, &broken, mem).is_empty(),
                "removing '{}' went unnoticed",
                l.waits[w].why
            );
        }
    }
    // the same parameters as the unsplit plan after training, in issue order and in
    // random interleavings that respect the edges
    let tiny_split = plan_with(&tiny(Variant::Erase), &sched);
    let want = run(&plan(&tiny(Variant::Erase), 4), 3, None);
    assert!(run(&tiny_split, 3, None) == want, "split differs");
    for seed in 0..4 {
        assert!(
            run(&tiny_split, 3, Some(seed)) == want,
            "split (interleaving {seed}) differs"
        );
    }
}

/// Forward streams: each block's own forward (its layers and its head) on a stream of its
/// own after the pool and the companions, at main's rank; what several blocks or the top
/// read (the embeddings, the bottom MLP, the top) on main; the same bits as the detached
/// schedule, in issue order and in random interleavings; and off, the forward on main.
#[test]
fn each_blocks_forward_runs_on_a_forward_stream_of_its_own_with_the_same_bits() {
    let p = plan(&tiny(Variant::Erase), 4);
    let (prog, g) = (&p.program, &p.model.graph);
    let from = prog.forward_from.expect("forward streams");
    assert_eq!(
        from,
        StreamId(1 + 2 * 4),
        "after the pool and its companions"
    );
    let mut by_block: std::collections::BTreeMap<String, Vec<u16>> = Default::default();
    for l in prog.launches.iter().filter(|l| l.label.phase == "fwd") {
        // the bf16 weight copies read only parameters: hoisted to the first pool stream
        if l.stream == StreamId(1) {
            continue;
        }
        let scope = g.node(l.node).name.split('/').next().unwrap().to_string();
        by_block.entry(scope).or_default().push(l.stream.0);
    }
    for (scope, streams) in &by_block {
        let mut s = streams.clone();
        s.dedup();
        match scope.as_str() {
            "embedding" | "top" => assert_eq!(s, vec![0], "{scope}"),
            // the bottom MLP is a field of the embeddings every block reads; its head is
            // the bottom block's own
            "bottom" => assert_eq!(s, vec![0], "{scope}"),
            _ => assert!(s.iter().all(|&x| x >= from.0), "{scope} forward on {s:?}"),
        }
    }
    // two blocks never share a forward stream, and every forward stream runs at main's rank
    let heads: Vec<u16> = [
        "autoint_head",
        "cross_head",
        "masknet_head",
        "deep_head",
        "interaction_head",
    ]
    .iter()
    .filter_map(|h| by_block.get(*h).map(|s| s[0]))
    .collect();
    let mut uniq = heads.clone();
    uniq.sort_unstable();
    uniq.dedup();
    assert_eq!(uniq.len(), heads.len(), "{heads:?}");
    assert!(heads.len() >= 4, "{by_block:?}");
    for s in from.0..prog.streams as u16 {
        assert_eq!(prog.stream_rank(StreamId(s)), 0, "side{s}");
    }
    // the same bits as detached, however the streams interleave
    let d = plan(&tiny(Variant::Detached), 4);
    let want = run(&d, 3, None);
    assert!(run(&p, 3, None) == want, "forward streams (issue order)");
    for seed in 0..4 {
        assert!(
            run(&p, 3, Some(seed)) == want,
            "forward streams (interleaving {seed})"
        );
    }
    // off: every forward launch but the hoisted copies on main
    let sched = ScheduleOptions {
        side_streams: 4,
        forward_streams: false,
        ..Default::default()
    };
    let off = plan_with(&tiny(Variant::Erase), &sched);
    assert_eq!(off.program.forward_from, None);
    assert!(off
        .program
        .launches
        .iter()
        .filter(|l| l.label.phase == "fwd")
        .all(|l| l.stream == StreamId::MAIN || l.stream == StreamId(1)));
}

/// An evaluation runs the forward launches alone: the program restricted to them orders
/// every two of them exactly as the whole step does, though the whole step's own waits may
/// order a pair only through a launch left out (at the spec's sizes and batch 16384, the
/// occupancy model's constraint on a backward launch does; the evaluation then read
/// activations still being written, on an H200).
#[test]
fn a_subset_of_the_step_is_ordered_as_in_the_whole_step() {
    let mut big = CtrConfig::default().with_variant(Variant::Erase);
    big.batch = 16384;
    for cfg in [tiny(Variant::Erase), CtrConfig::small(), big] {
        let p = plan_with(&cfg, &ScheduleOptions::default());
        let prog = &p.program;
        let fwd: Vec<usize> = (0..prog.launches.len())
            .filter(|&i| prog.launches[i].label.phase == "fwd")
            .collect();
        let r = prog.restricted(&fwd);
        assert_eq!(r.launches.len(), fwd.len());
        let (cf, cr) = (vector_clocks(prog), vector_clocks(&r));
        for a in 0..fwd.len() {
            assert_eq!(r.launches[a].node, prog.launches[fwd[a]].node);
            for b in a + 1..fwd.len() {
                assert_eq!(
                    happens_before(&r, &cr, a, b),
                    happens_before(prog, &cf, fwd[a], fwd[b]),
                    "batch {}: {} and {}",
                    cfg.batch,
                    prog.launches[fwd[a]].label,
                    prog.launches[fwd[b]].label
                );
            }
        }
        // every wait of the restricted program names an event one of its launches records
        let recorded: std::collections::BTreeSet<_> =
            r.launches.iter().filter_map(|l| l.record).collect();
        assert_eq!(recorded.len(), r.events);
        assert!(r
            .launches
            .iter()
            .flat_map(|l| &l.waits)
            .all(|w| recorded.contains(&w.event)));
    }
}

#[test]
fn streams_rank_main_then_late_then_pool_then_companions() {
    let p = plan(&tiny(Variant::Erase), 4);
    let prog = &p.program;
    // side1..3 the shared pool, side4 the late stream, side5..8 the companions, then the
    // blocks' forward streams at main's rank
    assert_eq!(prog.late_stream, Some(StreamId(4)));
    assert_eq!(prog.weight_grad_from, Some(StreamId(5)));
    assert_eq!(prog.forward_from, Some(StreamId(9)));
    let ranks: Vec<u32> = (0..prog.streams as u16)
        .map(|s| prog.stream_rank(StreamId(s)))
        .collect();
    let m = u32::MAX;
    assert_eq!(ranks[..9], [0, 2, 2, 2, 1, m, m, m, m]);
    assert!(
        ranks.len() > 9 && ranks[9..].iter().all(|&r| r == 0),
        "{ranks:?}"
    );
    // without companions the pool keeps the least priority
    let sched = ScheduleOptions {
        side_streams: 4,
        weight_grad_streams: false,
        ..Default::default()
    };
    let c = &tiny(Variant::Erase);
    let off = plan_with(c, &sched);
    assert_eq!(off.program.weight_grad_from, None);
    assert_eq!(off.program.stream_rank(StreamId(1)), m);
    assert_eq!(off.program.stream_rank(StreamId(4)), 1);
}

#[test]
fn updates_wait_for_their_gradients_alone_and_the_tables_update_beside_the_dense_one() {
    for by_data in [true, false] {
        let sched = ScheduleOptions {
            side_streams: 4,
            updates_by_data: by_data,
            ..Default::default()
        };
        let c = &tiny(Variant::Erase);
        // plan_step proves the plan hazard-free over two steps
        let p = plan_with(c, &sched);
        let (prog, g) = (&p.program, &p.model.graph);
        let find = |pred: &dyn Fn(&Op) -> bool| -> usize {
            prog.launches
                .iter()
                .position(|l| pred(&g.node(l.node).op))
                .unwrap()
        };
        let rowwise = find(&|op| matches!(op, Op::RowwiseAdagrad { .. }));
        let adam = find(&|op| matches!(op, Op::Adam { .. }));
        // the launch that writes the tables' gradient (the concat's backward sum)
        let grad_of = g.node(prog.launches[rowwise].node).inputs.clone();
        let writer = prog.launches[..rowwise]
            .iter()
            .rposition(|l| g.node(l.node).outputs.iter().any(|t| grad_of.contains(t)))
            .unwrap();
        let joins = prog
            .launches
            .iter()
            .flat_map(|l| &l.waits)
            .filter(|w| w.kind == EdgeKind::Join)
            .count();
        assert_eq!(prog.launches[adam].stream, StreamId::MAIN);
        if by_data {
            assert_ne!(prog.launches[writer].stream, StreamId::MAIN);
            assert_eq!(prog.launches[rowwise].stream, prog.launches[writer].stream);
            assert_eq!(joins, 0, "no join edge when updates wait by data");
            // the dense update is not ordered after the tables' update, nor after the
            // gradient sum it does not read
            let hb = vector_clocks(prog);
            assert!(!happens_before(prog, &hb, rowwise, adam));
            assert!(!happens_before(prog, &hb, writer, adam));
        } else {
            assert_eq!(prog.launches[rowwise].stream, StreamId::MAIN);
            assert!(joins >= 4, "{joins} join edges");
        }
    }
}
