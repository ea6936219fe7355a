//! Readiness analysis and the partition of a training step into backward programs.
//!
//! Every node gets the earliest point of the forward order after which it can run: the
//! last forward node it depends on, directly or through other nodes. Backward nodes that
//! become ready at the same point form one backward program; the program that waits for
//! the last forward node (the main loss) is the remainder. With `detach` cuts, each
//! detached block's backward depends only on that block's forward and local loss, so it
//! becomes ready long before the main loss: that is what ERASE starts early. Nothing
//! here knows about blocks by name; they are found from the dependencies the cuts leave.

use std::collections::BTreeMap;

use crate::graph::{Graph, NodeId, Phase, Tensor};

/// An index into [`Partition::forward`]: the forward order.
pub type ForwardPos = usize;

/// A group of backward nodes that become ready together.
#[derive(Clone, Debug, PartialEq)]
pub struct BackwardProgram {
    /// Derived from the scopes of the forward nodes it differentiates (e.g. `cross`).
    pub name: String,
    /// The program can start right after this forward node has run.
    pub ready_after: ForwardPos,
    /// In execution order (node-id order, a valid topological order).
    pub nodes: Vec<NodeId>,
    /// True for programs that can start before the last forward node; false for the
    /// remainder.
    pub early: bool,
}

/// The partition of a training graph.
#[derive(Clone, Debug, PartialEq)]
pub struct Partition {
    /// Forward compute nodes (no leaves), in order.
    pub forward: Vec<NodeId>,
    /// Early programs ordered by readiness, then the remainder (if any) last.
    pub programs: Vec<BackwardProgram>,
    /// Optimizer nodes, in order.
    pub optimizer: Vec<NodeId>,
    /// For each trainable parameter with a gradient: the program after which its gradient
    /// is complete (an early per-block update could run there).
    pub grad_complete: BTreeMap<Tensor, usize>,
    /// For every node: its readiness (the forward position after which it can run).
    pub ready: BTreeMap<NodeId, ForwardPos>,
    /// Dense updates that may run right after early program `k` (all the gradients they
    /// read come from it): present when the optimizer was attached per program.
    pub early_updates: BTreeMap<usize, Vec<NodeId>>,
}

impl Partition {
    /// The early programs that become ready right after forward position `pos`.
    pub fn ready_at(&self, pos: ForwardPos) -> impl Iterator<Item = (usize, &BackwardProgram)> {
        self.programs
            .iter()
            .enumerate()
            .filter(move |(_, p)| p.early && p.ready_after == pos)
    }

    /// The index of the program that holds `node`, if it is a backward node.
    pub fn program_of(&self, node: NodeId) -> Option<usize> {
        self.programs.iter().position(|p| p.nodes.contains(&node))
    }
}

/// The top-level scope of a node name (`cross/linear0` -> `cross`).
fn scope_of(name: &str) -> &str {
    name.split('/').next().unwrap_or(name)
}

/// Computes the readiness of every node and groups the backward nodes.
pub fn partition(g: &Graph, grads: &crate::autodiff::Gradients) -> Partition {
    let forward: Vec<NodeId> = g
        .nodes()
        .iter()
        .filter(|n| n.phase == Phase::Forward && !n.op.is_leaf())
        .map(|n| n.id)
        .collect();
    let pos_of: BTreeMap<NodeId, ForwardPos> =
        forward.iter().enumerate().map(|(i, &n)| (n, i)).collect();

    // readiness: max over dependencies; leaves are ready at "before everything" (None).
    let mut ready: Vec<Option<ForwardPos>> = vec![None; g.nodes().len()];
    for node in g.nodes() {
        let mut r = pos_of.get(&node.id).copied();
        if node.phase == Phase::Backward && node.op.is_leaf() {
            // a loss's gradient seed exists once the loss does
            r = node.origin.and_then(|o| ready[o.index()]);
        }
        for &t in node.inputs.iter().chain(&node.updates) {
            let p = g.info(t).producer;
            r = r.max(ready[p.index()]);
        }
        ready[node.id.index()] = r;
    }
    let last = forward.len().saturating_sub(1);

    // group backward compute nodes by readiness, in node-id order; nodes that read only
    // the step's inputs (the embedding ids' sort) form a program of their own, first
    let mut groups: BTreeMap<Option<ForwardPos>, Vec<NodeId>> = BTreeMap::new();
    for node in g.nodes() {
        if node.phase == Phase::Backward && !node.op.is_leaf() {
            groups
                .entry(ready[node.id.index()])
                .or_default()
                .push(node.id);
        }
    }
    let mut programs = Vec::new();
    for (at, nodes) in groups {
        let pos = at.unwrap_or(0);
        // name: the scope most of the differentiated forward nodes share
        let mut votes: BTreeMap<&str, usize> = BTreeMap::new();
        for &n in &nodes {
            if let Some(o) = g.node(n).origin {
                *votes.entry(scope_of(&g.node(o).name)).or_default() += 1;
            }
        }
        let early = pos < last;
        let name = if early {
            let scope = votes
                .iter()
                .max_by_key(|(s, c)| (**c, std::cmp::Reverse(**s)))
                .map_or_else(|| format!("block@{pos}"), |(s, _)| (*s).to_string());
            if at.is_none() {
                format!("{scope}/inputs")
            } else {
                scope
            }
        } else if at.is_none() {
            // a one-node forward: the inputs' program is not early either
            "remainder/inputs".to_string()
        } else {
            "remainder".to_string()
        };
        programs.push(BackwardProgram {
            name,
            ready_after: pos,
            nodes,
            early,
        });
    }

    let mut prog_of_node: BTreeMap<NodeId, usize> = BTreeMap::new();
    for (i, p) in programs.iter().enumerate() {
        for &n in &p.nodes {
            prog_of_node.insert(n, i);
        }
    }
    let mut grad_complete = BTreeMap::new();
    for (&p, grad) in &grads.by_param {
        let producer = g.info(grad.final_tensor()).producer;
        if let Some(&i) = prog_of_node.get(&producer) {
            grad_complete.insert(p, i);
        }
    }
    let optimizer = g
        .nodes()
        .iter()
        .filter(|n| n.phase == Phase::Optimizer && !n.op.is_leaf())
        .map(|n| n.id)
        .collect();
    let ready = g
        .nodes()
        .iter()
        .filter_map(|n| ready[n.id.index()].map(|r| (n.id, r)))
        .collect();
    let mut early_updates: BTreeMap<usize, Vec<NodeId>> = BTreeMap::new();
    for &n in &optimizer {
        let node = g.node(n);
        if !matches!(
            node.op,
            crate::op::Op::Adam { .. } | crate::op::Op::Sgd { .. }
        ) {
            continue;
        }
        let progs: std::collections::BTreeSet<Option<usize>> = node
            .inputs
            .iter()
            .map(|&t| g.info(t).producer)
            .filter(|&p| !g.node(p).op.is_leaf())
            .map(|p| prog_of_node.get(&p).copied())
            .collect();
        if let [Some(k)] = progs.into_iter().collect::<Vec<_>>()[..] {
            if programs[k].early {
                early_updates.entry(k).or_default().push(n);
            }
        }
    }
    Partition {
        forward,
        programs,
        optimizer,
        grad_complete,
        ready,
        early_updates,
    }
}
