//! The memory planner: every tensor a step makes lives in one arena, at an offset chosen
//! ahead of time. Static shapes make every lifetime known; two tensors may share bytes
//! only if the schedule orders every use of one before every use of the other (in one
//! stream's order, or through an event path across streams), so reuse is safe whatever
//! the streams' timing. Reshape and detach outputs alias their input: they move no bytes.

use std::collections::BTreeMap;

use crate::program::schedule::{vector_clocks, StepProgram};
use erase_graph::{Graph, Op, Tensor};

/// Arena offsets are aligned to this (what vectorised GPU loads like).
pub const ALIGN: usize = 256;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placement {
    pub offset: usize,
    pub bytes: usize,
}

#[derive(Clone, Debug, PartialEq)]
pub struct MemoryPlan {
    /// Every arena tensor (aliases included) and its bytes.
    pub place: BTreeMap<Tensor, Placement>,
    pub arena_bytes: usize,
    /// What the same tensors would take without reuse.
    pub total_bytes: usize,
    /// (later, earlier): the later tensor reuses bytes of the earlier one.
    pub reuse: Vec<(Tensor, Tensor)>,
}

impl MemoryPlan {
    pub fn get(&self, t: Tensor) -> Option<Placement> {
        self.place.get(&t).copied()
    }
}

/// True for launches that only rename their input (no bytes move).
pub fn is_alias(g: &Graph, node: erase_graph::NodeId) -> bool {
    matches!(g.node(node).op, Op::Reshape | Op::Detach)
}

/// Tensors that live in the arena: outputs of launches.
fn arena_tensors(g: &Graph, p: &StepProgram) -> Vec<Tensor> {
    p.launches
        .iter()
        .flat_map(|l| g.node(l.node).outputs.iter().copied())
        .collect()
}

/// The tensor whose bytes `t` uses (itself unless it is an alias of another arena tensor).
pub fn alias_root(g: &Graph, arena: &BTreeMap<Tensor, ()>, mut t: Tensor) -> Tensor {
    loop {
        let n = g.producer(t);
        if matches!(n.op, Op::Reshape | Op::Detach) && arena.contains_key(&n.inputs[0]) {
            t = n.inputs[0];
        } else {
            return t;
        }
    }
}

struct Group {
    root: Tensor,
    bytes: usize,
    uses: Vec<usize>,
    first: usize,
    /// Per stream, the latest / earliest clock over the uses.
    max_clock: Vec<u32>,
    min_clock: Vec<u32>,
}

fn ordered_before(a: &Group, b: &Group) -> bool {
    a.uses.iter().all(|u| !b.uses.contains(u))
        && a.max_clock.iter().zip(&b.min_clock).all(|(x, y)| y >= x)
}

/// Plans the arena of `p`. Tensors in `keep` (read by the host after the step, such as
/// losses) never share bytes.
pub fn plan_memory(g: &Graph, p: &StepProgram, keep: &[Tensor]) -> MemoryPlan {
    let clocks = vector_clocks(p);
    let tensors = arena_tensors(g, p);
    let arena: BTreeMap<Tensor, ()> = tensors.iter().map(|&t| (t, ())).collect();
    let mut launch_of: BTreeMap<erase_graph::NodeId, usize> = BTreeMap::new();
    for (i, l) in p.launches.iter().enumerate() {
        launch_of.insert(l.node, i);
    }
    // uses of each root: its producer and every non-alias consumer of any alias
    let mut groups: BTreeMap<Tensor, Group> = BTreeMap::new();
    for &t in &tensors {
        let root = alias_root(g, &arena, t);
        let bytes = g.shape(root).numel() * g.dtype(root).size_bytes();
        groups.entry(root).or_insert_with(|| Group {
            root,
            bytes,
            uses: Vec::new(),
            first: usize::MAX,
            max_clock: vec![0; p.streams],
            min_clock: vec![u32::MAX; p.streams],
        });
    }
    for (i, l) in p.launches.iter().enumerate() {
        if is_alias(g, l.node) {
            continue;
        }
        let n = g.node(l.node);
        for &t in n.inputs.iter().chain(&n.outputs) {
            if arena.contains_key(&t) {
                let root = alias_root(g, &arena, t);
                if let Some(gr) = groups.get_mut(&root) {
                    if !gr.uses.contains(&i) {
                        gr.uses.push(i);
                    }
                }
            }
        }
    }
    let kept: Vec<Tensor> = keep
        .iter()
        .filter(|t| arena.contains_key(t))
        .map(|&t| alias_root(g, &arena, t))
        .collect();
    let mut order: Vec<Group> = groups.into_values().collect();
    for gr in &mut order {
        if gr.uses.is_empty() {
            // produced by an alias of nothing in the arena: keep it alive for the step
            gr.uses.push(0);
        }
        gr.first = *gr.uses.iter().min().unwrap_or(&0);
        for &u in &gr.uses {
            let s = p.launches[u].stream.0 as usize;
            gr.max_clock[s] = gr.max_clock[s].max(clocks[u][s]);
            for (m, &c) in gr.min_clock.iter_mut().zip(&clocks[u]) {
                *m = (*m).min(c);
            }
        }
    }
    order.sort_by_key(|gr| (gr.first, gr.root));

    let mut placed: Vec<(usize, Placement)> = Vec::new(); // (index into order, placement)
    let mut plan = MemoryPlan {
        place: BTreeMap::new(),
        arena_bytes: 0,
        total_bytes: 0,
        reuse: Vec::new(),
    };
    for i in 0..order.len() {
        let gr = &order[i];
        let size = gr.bytes.div_ceil(ALIGN) * ALIGN;
        plan.total_bytes += size;
        let is_kept = kept.contains(&gr.root);
        let mut busy: Vec<Placement> = placed
            .iter()
            .filter(|(j, _)| {
                let other = &order[*j];
                is_kept
                    || kept.contains(&other.root)
                    || !(ordered_before(other, gr) || ordered_before(gr, other))
            })
            .map(|(_, pl)| *pl)
            .collect();
        busy.sort_by_key(|pl| pl.offset);
        let mut offset = 0;
        for pl in &busy {
            if offset + size <= pl.offset {
                break;
            }
            offset = offset.max((pl.offset + pl.bytes).div_ceil(ALIGN) * ALIGN);
        }
        let me = Placement {
            offset,
            bytes: size,
        };
        for (j, pl) in &placed {
            if pl.offset < offset + size && offset < pl.offset + pl.bytes {
                plan.reuse.push((gr.root, order[*j].root));
            }
        }
        plan.arena_bytes = plan.arena_bytes.max(offset + size);
        placed.push((i, me));
    }
    for (i, pl) in placed {
        plan.place.insert(
            order[i].root,
            Placement {
                offset: pl.offset,
                bytes: order[i].bytes,
            },
        );
    }
    for &t in &tensors {
        let root = alias_root(g, &arena, t);
        if let Some(&pl) = plan.place.get(&root) {
            plan.place.insert(t, pl);
        }
    }
    plan
}
