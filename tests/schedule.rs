//! The partition, the step program, the memory planner and the happens-before checker on
//! random graphs with detach cuts, and the schedule fuzzer: random interleavings of the
//! step program on the planner's arena give the same bits as the plain CPU session.

use erase::graph::{
    make_trainable, partition, DType, DenseOptimizer, Graph, OptimizerConfig, Tensor,
};
use erase::ops::Buffer;
use erase::runtime::cpu::runner::{random_order, ProgramRunner};
use erase::runtime::init::{splitmix64, to_unit};
use erase::runtime::program::hb::check;
use erase::runtime::program::memory::plan_memory;
use erase::runtime::program::occupancy::DeviceModel;
use erase::runtime::program::schedule::{schedule, ScheduleConfig, ScheduleKind, StepProgram};
use erase::runtime::{CpuConfig, CpuSession};

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = splitmix64(self.0);
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

struct RandomModel {
    g: Graph,
    x: Tensor,
    y: Tensor,
    losses: Vec<Tensor>,
    cuts: usize,
}

/// A chain of blocks; each block reads one or two earlier block outputs (through a detach
/// when the coin says so), runs a few random ops and may have a local loss.
fn random_model(seed: u64, batch: usize) -> RandomModel {
    let mut r = Rng(seed.wrapping_mul(0x9E37_79B9) + 1);
    let mut g = Graph::new(DType::F32);
    let x = g.input("x", &[batch, 6], DType::F32).unwrap();
    let y = g.input("y", &[batch], DType::F32).unwrap();
    let mut outs = vec![x];
    let mut losses = Vec::new();
    let mut cuts = 0;
    let blocks = 3 + r.below(4);
    for b in 0..blocks {
        let name = format!("b{b}");
        let (h, loss, cut) = g.scoped(&name, |g| {
            let take = |g: &mut Graph, r: &mut Rng| {
                let src = outs[r.below(outs.len())];
                if src != x && r.below(3) > 0 {
                    (g.detach(src).unwrap(), true)
                } else {
                    (src, false)
                }
            };
            let (mut h, mut cut) = take(g, &mut r);
            h = g.linear(h, 8).unwrap();
            for _ in 0..1 + r.below(3) {
                h = match r.below(5) {
                    0 => g.relu(h).unwrap(),
                    1 => g.gelu(h).unwrap(),
                    2 => g.layer_norm(h).unwrap(),
                    3 => {
                        let (o, c) = take(g, &mut r);
                        cut |= c;
                        let o = g.linear(o, 8).unwrap();
                        g.add(h, o).unwrap()
                    }
                    _ => {
                        let a = g.linear(h, 8).unwrap();
                        let s = g.sigmoid(a).unwrap();
                        g.mul(h, s).unwrap()
                    }
                };
            }
            let loss = if r.below(3) > 0 {
                let head = g.linear(h, 1).unwrap();
                let l = g.bce_with_logits(head, y).unwrap();
                g.loss(l, 1.0).unwrap();
                Some(l)
            } else {
                None
            };
            (h, loss, cut)
        });
        cuts += usize::from(cut);
        outs.push(h);
        losses.extend(loss);
    }
    let last = *outs.last().unwrap_or(&x);
    let top = g.scoped("top", |g| {
        let parts: Vec<Tensor> = outs[1..].iter().map(|&o| g.detach(o).unwrap()).collect();
        let c = g.concat(&parts, 1).unwrap();
        let c = g.add(c, c).unwrap();
        let h = g.linear(c, 1).unwrap();
        let _ = last;
        g.bce_with_logits(h, y).unwrap()
    });
    g.loss(top, 1.0).unwrap();
    losses.push(top);
    RandomModel {
        g,
        x,
        y,
        losses,
        cuts,
    }
}

fn cfg(kind: ScheduleKind, side: usize) -> ScheduleConfig {
    ScheduleConfig {
        kind,
        side_streams: side,
        occupancy: false,
        exclusive_only: None,
        device: DeviceModel::h200(),
        kernels: None,
        plan_options: None,
        late_stream: false,
        weight_grad_streams: false,
        forward_streams: false,
        updates_by_data: false,
        priorities: Default::default(),
    }
}

fn batch(seed: u64, b: usize) -> (Buffer, Buffer) {
    let x = (0..b * 6)
        .map(|i| (2.0 * to_unit(splitmix64(seed * 7777 + i as u64)) - 1.0) as f32)
        .collect();
    let y = (0..b)
        .map(|i| f32::from(splitmix64(seed * 31 + i as u64).is_multiple_of(2)))
        .collect();
    (Buffer::F32(x), Buffer::F32(y))
}

fn params_bytes(g: &Graph, get: impl Fn(Tensor) -> Buffer) -> Vec<u8> {
    g.params()
        .into_iter()
        .flat_map(|p| get(p).bytes().to_vec())
        .collect()
}

#[test]
fn random_graphs_plan_safely_and_fuzz_bit_identically() {
    let mut interleavings = 0;
    for seed in 0..24u64 {
        let b = 5;
        let mut m = random_model(seed, b);
        let opt = OptimizerConfig {
            dense: DenseOptimizer::Adam {
                lr: 0.01,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
            },
            ..Default::default()
        };
        let tr = make_trainable(&mut m.g, &opt).unwrap();
        let part = partition(&m.g, &tr.grads);
        let sides = 1 + (seed as usize % 3);
        let mut c = cfg(ScheduleKind::Early, sides);
        c.late_stream = seed % 2 == 0;
        c.weight_grad_streams = seed % 3 == 1;
        c.updates_by_data = seed % 4 >= 2;
        c.forward_streams = seed % 5 < 3;
        // priorities order nothing: every set the occupancy model can choose gives the
        // ranked program's launches and edges, so it is as safe
        c.priorities =
            erase::runtime::program::simulate::PRIORITY_CANDIDATES[(seed as usize / 3) % 3];
        if seed % 3 == 2 {
            // every constraint the occupancy model can add: a one-SM, one-CTA device on
            // which every launch fills a wave and none is short, under the rule
            c.occupancy = true;
            c.device = DeviceModel {
                sms: 1,
                max_ctas_per_sm: 1,
                exclusive_threshold_s: 0.0,
                ..DeviceModel::h200()
            };
        }
        let prog: StepProgram = schedule(&m.g, &part, &c);
        let ranked = schedule(
            &m.g,
            &part,
            &ScheduleConfig {
                priorities: Default::default(),
                ..c.clone()
            },
        );
        assert_eq!(prog.priorities, c.priorities);
        assert_eq!(
            StepProgram {
                priorities: ranked.priorities,
                ..prog.clone()
            },
            ranked,
            "seed {seed}: the priorities changed more than the streams' ranks"
        );
        if c.occupancy {
            assert!(
                prog.launches.iter().any(|l| l.exclusive),
                "seed {seed}: the rule ordered nothing"
            );
        }
        let plan = plan_memory(&m.g, &prog, &m.losses);
        let hazards = check(&m.g, &prog, &plan);
        assert!(
            hazards.is_empty(),
            "seed {seed}: {}\n{}",
            hazards[0],
            prog.render(&m.g)
        );
        assert!(plan.arena_bytes <= plan.total_bytes);
        if m.cuts > 0 {
            assert!(
                plan.arena_bytes < plan.total_bytes,
                "seed {seed}: no reuse at all"
            );
        }
        // reference: the plain session, all nodes in order
        let steps = 6;
        let mut reference = CpuSession::new(&m.g, CpuConfig { threads: 1, seed }).unwrap();
        for s in 0..steps {
            let (xb, yb) = batch(s, b);
            reference.feed(m.x, xb).unwrap();
            reference.feed(m.y, yb).unwrap();
            reference.run().unwrap();
        }
        let want = params_bytes(&m.g, |p| reference.get(p).unwrap().clone());
        for trial in 0..8u64 {
            let mut runner =
                ProgramRunner::new(&m.g, &prog, &plan, seed, 1 + (trial as usize % 2)).unwrap();
            for s in 0..steps {
                let (xb, yb) = batch(s, b);
                runner.feed(m.x, xb).unwrap();
                runner.feed(m.y, yb).unwrap();
                let order = random_order(&prog, seed * 1000 + trial * 10 + s);
                assert_eq!(order.len(), prog.launches.len());
                runner.run_order(&order).unwrap();
                interleavings += 1;
            }
            let got = params_bytes(&m.g, |p| runner.get(p).unwrap());
            assert!(
                got == want,
                "seed {seed} trial {trial}: parameters differ from the reference"
            );
        }
    }
    assert!(interleavings >= 1000, "only {interleavings} interleavings");
}

#[test]
fn a_broken_plan_is_caught() {
    // removing any cross-stream edge of a plan must make the checker fail: the schedule
    // keeps no redundant edge
    let mut removed = 0;
    for seed in 0..12u64 {
        let mut m = random_model(seed, 3);
        let tr = make_trainable(&mut m.g, &OptimizerConfig::default()).unwrap();
        let part = partition(&m.g, &tr.grads);
        let prog = schedule(&m.g, &part, &cfg(ScheduleKind::Early, 2));
        let plan = plan_memory(&m.g, &prog, &m.losses);
        assert!(check(&m.g, &prog, &plan).is_empty());
        for (i, l) in prog.launches.iter().enumerate() {
            for w in 0..l.waits.len() {
                let mut broken = prog.clone();
                broken.launches[i].waits.remove(w);
                let plan2 = plan_memory(&m.g, &prog, &m.losses);
                assert!(
                    !check(&m.g, &broken, &plan2).is_empty(),
                    "seed {seed}: removing '{}' went unnoticed",
                    l.waits[w].why
                );
                removed += 1;
            }
        }
        // and placing a tensor over one that is live at the same time must fail too
        let mut bad = plan.clone();
        let live_pair = plan.place.iter().find_map(|(&a, pa)| {
            plan.place
                .iter()
                .find(|(&b, pb)| a != b && pa.offset != pb.offset && g_conflict(&m.g, &prog, a, b))
                .map(|(&b, _)| (a, b))
        });
        if let Some((a, b)) = live_pair {
            let target = bad.place[&b];
            bad.place.insert(a, target);
            for (t, p) in bad.place.clone() {
                if erase::runtime::program::memory::alias_root(
                    &m.g,
                    &plan.place.keys().map(|&k| (k, ())).collect(),
                    t,
                ) == a
                {
                    bad.place.insert(
                        t,
                        erase::runtime::program::memory::Placement {
                            offset: target.offset,
                            ..p
                        },
                    );
                }
            }
            assert!(
                !check(&m.g, &prog, &bad).is_empty(),
                "seed {seed}: overlapping live tensors went unnoticed"
            );
        }
    }
    assert!(
        removed >= 20,
        "only {removed} cross-stream edges in the sample"
    );
}

/// Two arena tensors whose producers are unordered (so they are live at the same time).
fn g_conflict(g: &Graph, p: &StepProgram, a: Tensor, b: Tensor) -> bool {
    let clocks = erase::runtime::program::schedule::vector_clocks(p);
    let at = |t: Tensor| p.launches.iter().position(|l| l.node == g.info(t).producer);
    match (at(a), at(b)) {
        (Some(x), Some(y)) if x != y => {
            use erase::runtime::program::schedule::happens_before as hb;
            !hb(p, &clocks, x, y) && !hb(p, &clocks, y, x)
        }
        _ => false,
    }
}

#[test]
fn serial_schedule_is_one_stream_and_deterministic() {
    let mut m = random_model(3, 4);
    let tr = make_trainable(&mut m.g, &OptimizerConfig::default()).unwrap();
    let part = partition(&m.g, &tr.grads);
    let a = schedule(&m.g, &part, &cfg(ScheduleKind::Serial, 4));
    let b = schedule(&m.g, &part, &cfg(ScheduleKind::Serial, 4));
    assert_eq!(a, b);
    assert_eq!(a.streams, 1);
    assert_eq!(a.events, 0);
    assert_eq!(a.render(&m.g), b.render(&m.g));
}
