//! Executes a step program on the CPU the way a GPU would: every tensor at its planned
//! arena offset, launches in any order that stream order and events permit. Each
//! tensor's bytes are poisoned (all ones: NaN for floats) when its lifetime begins, so a
//! read of bytes that another tensor has since reused shows up in the results. With a
//! random order per step this is the schedule fuzzer; in issue order it is the CPU
//! backend of the step program.

use std::collections::BTreeMap;

use crate::cpu::{initial_store, thread_pool};
use crate::error::RuntimeError;
use crate::program::memory::{alias_root, MemoryPlan};
use crate::program::schedule::StepProgram;
use erase_graph::{Graph, Tensor};
use erase_ops::{Buffer, NodeCall};

pub struct ProgramRunner<'a> {
    g: &'a Graph,
    prog: &'a StepProgram,
    plan: &'a MemoryPlan,
    /// 8-byte aligned backing store of the arena.
    arena: Vec<u64>,
    /// Leaves (parameters, state, constants, inputs), by tensor index.
    store: Vec<Option<Buffer>>,
    arena_set: BTreeMap<Tensor, ()>,
    pool: std::sync::Arc<rayon::ThreadPool>,
    /// Round GEMM operands to bf16 as the CUDA kernels do (see `NodeCall::bf16_gemm`).
    pub bf16_gemm: bool,
}

impl<'a> ProgramRunner<'a> {
    pub fn new(
        g: &'a Graph,
        prog: &'a StepProgram,
        plan: &'a MemoryPlan,
        seed: u64,
        threads: usize,
    ) -> Result<Self, RuntimeError> {
        Ok(ProgramRunner {
            g,
            prog,
            plan,
            arena: vec![0; plan.arena_bytes.div_ceil(8)],
            store: initial_store(g, seed),
            arena_set: plan.place.keys().map(|&t| (t, ())).collect(),
            pool: std::sync::Arc::new(thread_pool(threads)?),
            bf16_gemm: false,
        })
    }

    /// Sets an input (or overwrites a parameter).
    /// The graph this runner executes.
    pub fn graph(&self) -> &'a Graph {
        self.g
    }

    pub fn feed(&mut self, t: Tensor, b: Buffer) -> Result<(), RuntimeError> {
        crate::error::check_feed(self.g, t, &b)?;
        self.store[t.index()] = Some(b);
        super::refresh_copy(self.g, &mut self.store, t);
        Ok(())
    }

    /// Overwrites a tensor's current value: a leaf, or an arena tensor's bytes (e.g. a
    /// gradient replaced by its all-reduced value before the optimizer runs).
    pub fn write(&mut self, t: Tensor, b: &Buffer) -> Result<(), RuntimeError> {
        crate::error::check_feed(self.g, t, b)?;
        match self.plan.get(alias_root(self.g, &self.arena_set, t)) {
            Some(pl) => {
                let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut self.arena);
                bytes[pl.offset..pl.offset + b.bytes().len()].copy_from_slice(b.bytes());
            }
            None => {
                self.store[t.index()] = Some(b.clone());
                super::refresh_copy(self.g, &mut self.store, t);
            }
        }
        Ok(())
    }

    /// Takes a leaf's value out of the runner, without copying it (an optimizer update
    /// done beside the program, say); [`ProgramRunner::feed`] puts it back. `None` for a
    /// tensor in the arena or without a value.
    pub fn take_leaf(&mut self, t: Tensor) -> Option<Buffer> {
        if self.plan.get(t).is_some() {
            return None;
        }
        self.store.get_mut(t.index()).and_then(Option::take)
    }

    /// A leaf's value (a parameter or optimizer state), borrowed: `None` for an arena
    /// tensor or one without a value.
    pub fn leaf(&self, t: Tensor) -> Option<&Buffer> {
        if self.plan.get(t).is_some() {
            return None;
        }
        self.store.get(t.index()).and_then(Option::as_ref)
    }

    /// The value of a tensor now: a leaf, or an arena tensor's current bytes.
    pub fn get(&self, t: Tensor) -> Option<Buffer> {
        if let Some(pl) = self.plan.get(t) {
            let bytes: &[u8] = bytemuck::cast_slice(&self.arena);
            let n = self.g.shape(t).numel() * self.g.dtype(t).size_bytes();
            return Some(crate::cpu::buffer_from_bytes(
                self.g.dtype(t),
                &bytes[pl.offset..pl.offset + n],
            ));
        }
        self.store.get(t.index()).and_then(|b| b.clone())
    }

    /// Runs the launches in issue order.
    pub fn run(&mut self) -> Result<(), RuntimeError> {
        let order: Vec<usize> = (0..self.prog.launches.len()).collect();
        self.run_order(&order)
    }

    /// Runs the launches in `order` (a permutation that respects streams and events; see
    /// [`random_order`]).
    pub fn run_order(&mut self, order: &[usize]) -> Result<(), RuntimeError> {
        let pool = std::sync::Arc::clone(&self.pool);
        pool.install(|| order.iter().try_for_each(|&i| self.run_launch(i)))
    }

    fn run_launch(&mut self, i: usize) -> Result<(), RuntimeError> {
        let g = self.g;
        let node = g.node(self.prog.launches[i].node);
        // aliases whose bytes are their input's move nothing
        if crate::program::memory::is_alias(g, self.prog.launches[i].node) {
            let (o, x) = (node.outputs[0], node.inputs[0]);
            if let (Some(po), Some(px)) = (self.plan.get(o), self.plan.get(x)) {
                if po.offset == px.offset {
                    return Ok(());
                }
            }
        }
        let missing = |t: Tensor| {
            RuntimeError::NotComputed(format!("{} (needed by '{}')", g.name(t), node.name))
        };
        let mut upd = Vec::with_capacity(node.updates.len());
        for &t in &node.updates {
            upd.push(self.store[t.index()].take().ok_or_else(|| missing(t))?);
        }
        // the outputs' lifetime begins: poison their bytes (inputs never share them)
        for &t in &node.outputs {
            if let Some(pl) = self.plan.get(t) {
                let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut self.arena);
                bytes[pl.offset..pl.offset + pl.bytes].fill(0xFF);
            }
        }
        let mut arena_inputs: Vec<Buffer> = Vec::new();
        let mut slots: Vec<Option<usize>> = Vec::new();
        for &t in &node.inputs {
            if self.plan.get(t).is_some() {
                slots.push(Some(arena_inputs.len()));
                arena_inputs.push(self.get(t).ok_or_else(|| missing(t))?);
            } else {
                slots.push(None);
            }
        }
        let mut ins: Vec<&Buffer> = Vec::with_capacity(node.inputs.len());
        for (k, &t) in node.inputs.iter().enumerate() {
            match slots[k] {
                Some(j) => ins.push(&arena_inputs[j]),
                None => ins.push(self.store[t.index()].as_ref().ok_or_else(|| missing(t))?),
            }
        }
        let mut outs: Vec<Buffer> = node
            .outputs
            .iter()
            .map(|&t| Buffer::poison(g.dtype(t), g.shape(t).numel()))
            .collect();
        let call = NodeCall {
            op: &node.op,
            name: &node.name,
            in_shapes: node.inputs.iter().map(|&t| g.shape(t)).collect(),
            out_shapes: node.outputs.iter().map(|&t| g.shape(t)).collect(),
            bf16_gemm: self.bf16_gemm,
        };
        let r = erase_ops::execute(&call, &ins, &mut outs, &mut upd);
        drop(ins);
        for (&t, b) in node.updates.iter().zip(upd) {
            self.store[t.index()] = Some(b);
        }
        r?;
        for (&t, b) in node.outputs.iter().zip(outs) {
            match self.plan.get(alias_root(g, &self.arena_set, t)) {
                Some(pl) => {
                    let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut self.arena);
                    let src = b.bytes();
                    bytes[pl.offset..pl.offset + src.len()].copy_from_slice(src);
                }
                None => self.store[t.index()] = Some(b),
            }
        }
        Ok(())
    }
}

/// A random order of the launches that a GPU could run them in: each launch after the
/// previous one on its stream and after the launches that record the events it waits for.
pub fn random_order(p: &StepProgram, seed: u64) -> Vec<usize> {
    let recorder = p.recorders();
    let queues = p.stream_queues();
    let mut head = vec![0usize; p.streams];
    let mut done = vec![false; p.launches.len()];
    let mut order = Vec::with_capacity(p.launches.len());
    let mut state = seed;
    while order.len() < p.launches.len() {
        let ready: Vec<usize> = (0..p.streams)
            .filter(|&s| {
                queues[s].get(head[s]).is_some_and(|&i| {
                    p.launches[i]
                        .waits
                        .iter()
                        .all(|w| recorder.get(&w.event).is_none_or(|&r| done[r]))
                })
            })
            .collect();
        if ready.is_empty() {
            break; // a wait that can never be satisfied; the checker reports it
        }
        state = crate::init::splitmix64(state);
        let s = ready[(state % ready.len() as u64) as usize];
        let i = queues[s][head[s]];
        head[s] += 1;
        done[i] = true;
        order.push(i);
    }
    order
}
