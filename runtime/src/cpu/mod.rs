//! The CPU backend: executes a graph's nodes in order on host buffers, with a rayon pool
//! of a chosen size. It is real (the whole trainer runs on it) and it is the reference
//! the CUDA backend is checked against.

pub mod runner;

use crate::error::RuntimeError;
use crate::init::{init_param, init_param_as};
use erase_graph::{DType, Graph, Leaf, NodeId, Op, Tensor};
use erase_ops::{Buffer, NodeCall};

/// Settings of a CPU session.
#[derive(Clone, Copy, Debug)]
pub struct CpuConfig {
    /// Worker threads (1 = everything on the calling thread's pool of one).
    pub threads: usize,
    /// Seed of parameter initialisation.
    pub seed: u64,
}

impl Default for CpuConfig {
    fn default() -> Self {
        CpuConfig {
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            seed: 0,
        }
    }
}

/// A graph bound to host storage: persistent tensors (parameters, optimizer state,
/// constants) live across runs, inputs are fed, everything else is recomputed.
pub struct CpuSession<'g> {
    graph: &'g Graph,
    store: Vec<Option<Buffer>>,
    pool: rayon::ThreadPool,
}

impl<'g> CpuSession<'g> {
    pub fn new(graph: &'g Graph, cfg: CpuConfig) -> Result<Self, RuntimeError> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(cfg.threads.max(1))
            .build()
            .map_err(|e| {
                RuntimeError::Device(format!("cannot start {} CPU threads: {e}", cfg.threads))
            })?;
        let store = initial_store(graph, cfg.seed);
        Ok(CpuSession { graph, store, pool })
    }

    pub fn graph(&self) -> &'g Graph {
        self.graph
    }

    /// Sets an input (or overwrites a parameter), checking type and size.
    pub fn feed(&mut self, t: Tensor, b: Buffer) -> Result<(), RuntimeError> {
        crate::error::check_feed(self.graph, t, &b)?;
        self.store[t.index()] = Some(b);
        refresh_copy(self.graph, &mut self.store, t);
        Ok(())
    }

    pub fn get(&self, t: Tensor) -> Option<&Buffer> {
        self.store.get(t.index()).and_then(|b| b.as_ref())
    }

    /// A scalar tensor's value (e.g. a loss) as f64.
    pub fn scalar(&self, t: Tensor) -> Result<f64, RuntimeError> {
        self.get(t)
            .and_then(|b| b.to_f64().first().copied())
            .ok_or_else(|| RuntimeError::NotComputed(self.graph.name(t).to_string()))
    }

    /// Runs every non-leaf node in order: forward, backward and optimizer updates.
    pub fn run(&mut self) -> Result<(), RuntimeError> {
        let ids: Vec<NodeId> = self
            .graph
            .nodes()
            .iter()
            .filter(|n| !n.op.is_leaf())
            .map(|n| n.id)
            .collect();
        self.run_nodes(&ids)
    }

    /// Runs the given nodes in the given order (they must respect data dependencies).
    pub fn run_nodes(&mut self, ids: &[NodeId]) -> Result<(), RuntimeError> {
        let graph = self.graph;
        let pool = &self.pool;
        let store = &mut self.store;
        pool.install(|| {
            for &id in ids {
                run_node(graph, store, id)?;
            }
            Ok(())
        })
    }
}

/// A rayon pool of `threads` workers.
pub fn thread_pool(threads: usize) -> Result<rayon::ThreadPool, RuntimeError> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads.max(1))
        .build()
        .map_err(|e| RuntimeError::Device(format!("cannot start {threads} CPU threads: {e}")))
}

/// Storage for the leaves of `graph`: parameters initialised from `seed`, optimizer state
/// at zero, constants; inputs empty until fed.
pub fn initial_store(graph: &Graph, seed: u64) -> Vec<Option<Buffer>> {
    let mut store = vec![None; graph.num_tensors()];
    let mut param_index = 0u64;
    for node in graph.nodes() {
        let Op::Leaf(leaf) = &node.op else { continue };
        let t = node.outputs[0];
        let info = graph.info(t);
        let n = info.shape.numel();
        store[t.index()] = match leaf {
            Leaf::Input => None,
            Leaf::Param { init, .. } => {
                let (shape, i) = (&info.shape, param_index);
                param_index += 1;
                // made in the parameter's type: no f64 copy of a large table
                Some(match info.dtype {
                    DType::F32 => Buffer::F32(init_param_as(init, shape, seed, i, |x| x as f32)),
                    DType::F64 => Buffer::F64(init_param(init, shape, seed, i)),
                    other => Buffer::from_f64(other, &init_param(init, shape, seed, i)),
                })
            }
            Leaf::State => Some(Buffer::zeros(info.dtype, n)),
            Leaf::Const(v) => Some(Buffer::from_f64(info.dtype, v)),
            // its parameter's leaf comes first: a copy is made of a parameter in use
            Leaf::ParamCopy { of } => store[of.index()].as_ref().map(Buffer::to_bf16),
        };
    }
    store
}

/// Remakes the bf16 copy of parameter `t` ([`Leaf::ParamCopy`]) from its value in
/// `store`, after the parameter was set: the copy is always the parameter, rounded.
pub(crate) fn refresh_copy(graph: &Graph, store: &mut [Option<Buffer>], t: Tensor) {
    if let Some(c) = graph.param_copy(t) {
        store[c.index()] = store[t.index()].as_ref().map(Buffer::to_bf16);
    }
}

/// Executes one node on `store`. Updates are taken out and put back even on error, so a
/// failed node leaves persistent tensors as they were.
pub(crate) fn run_node(
    graph: &Graph,
    store: &mut [Option<Buffer>],
    id: NodeId,
) -> Result<(), RuntimeError> {
    let node = graph.node(id);
    let missing = |t: Tensor| {
        RuntimeError::NotComputed(format!(
            "{} (needed by node '{}')",
            graph.name(t),
            node.name
        ))
    };
    let mut upd = Vec::with_capacity(node.updates.len());
    for &t in &node.updates {
        upd.push(store[t.index()].take().ok_or_else(|| missing(t))?);
    }
    let result = {
        let mut ins = Vec::with_capacity(node.inputs.len());
        for &t in &node.inputs {
            ins.push(store[t.index()].as_ref().ok_or_else(|| missing(t))?);
        }
        let mut outs: Vec<Buffer> = node
            .outputs
            .iter()
            .map(|&t| {
                let i = graph.info(t);
                Buffer::poison(i.dtype, i.shape.numel())
            })
            .collect();
        let call = NodeCall {
            op: &node.op,
            name: &node.name,
            in_shapes: node.inputs.iter().map(|&t| graph.shape(t)).collect(),
            out_shapes: node.outputs.iter().map(|&t| graph.shape(t)).collect(),
            bf16_gemm: false,
        };
        erase_ops::execute(&call, &ins, &mut outs, &mut upd).map(|()| outs)
    };
    for (&t, b) in node.updates.iter().zip(upd) {
        store[t.index()] = Some(b);
    }
    for (&t, b) in node.outputs.iter().zip(result?) {
        store[t.index()] = Some(b);
    }
    Ok(())
}

/// A host buffer of `dtype` from raw bytes.
pub fn buffer_from_bytes(dtype: DType, bytes: &[u8]) -> Buffer {
    match dtype {
        DType::F32 => Buffer::F32(bytemuck::pod_collect_to_vec(bytes)),
        DType::F64 => Buffer::F64(bytemuck::pod_collect_to_vec(bytes)),
        DType::I32 => Buffer::I32(bytemuck::pod_collect_to_vec(bytes)),
        DType::Bf16 => Buffer::Bf16(bytemuck::pod_collect_to_vec(bytes)),
    }
}
