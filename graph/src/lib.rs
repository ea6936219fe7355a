//! `erase-graph`: the static graph of a training step. Models are written against the
//! DSL of [`Graph`]; [`autodiff::backward`] appends the backward nodes and
//! [`optim::attach`] the optimizer updates, so one graph describes one whole step.

pub mod autodiff;
pub mod dtype;
pub mod error;
pub mod graph;
pub mod op;
pub mod optim;
pub mod partition;

pub use autodiff::{Grad, Gradients};
pub use dtype::{DType, Shape};
pub use error::{GraphError, Result};
pub use graph::{Graph, Loss, Node, NodeId, Phase, Tensor, TensorInfo, ATTENTION_BF16_MAX_SEQ};
pub use op::{Init, Leaf, Op};
pub use optim::{DenseOptimizer, OptimizerConfig, Updates};
pub use partition::{partition, BackwardProgram, Partition};

/// The backward and optimizer parts added to a forward graph by [`make_trainable`].
#[derive(Clone, Debug)]
pub struct Training {
    pub grads: Gradients,
    pub updates: Updates,
}

/// Appends autodiff and the optimizer updates to a forward graph with registered losses.
pub fn make_trainable(g: &mut Graph, cfg: &OptimizerConfig) -> Result<Training> {
    let grads = autodiff::backward(g)?;
    let updates = optim::attach(g, &grads, cfg)?;
    Ok(Training { grads, updates })
}

/// [`make_trainable`] with the dense parameters of each early backward program updated by
/// their own optimizer node, which the schedule can run right after that program (ERASE's
/// early per-block update) instead of in the single update after the whole backward.
/// Parameters whose gradient completes in the remainder keep one update at the end.
pub fn make_trainable_early_updates(g: &mut Graph, cfg: &OptimizerConfig) -> Result<Training> {
    let grads = autodiff::backward(g)?;
    let p = partition(g, &grads);
    let early: std::collections::BTreeMap<Tensor, usize> = p
        .grad_complete
        .iter()
        .filter(|(_, &k)| p.programs[k].early)
        .map(|(&t, &k)| (t, k))
        .collect();
    let updates = optim::attach_grouped(g, &grads, cfg, &|t| early.get(&t).copied())?;
    Ok(Training { grads, updates })
}

/// Fuses each forward linear layer (without a ReLU) whose output a `MulAdd` reads as its
/// `b` (the DCN cross update `x0 ⊙ (V·u + c) + x`) into one `Op::LinearMulAdd` node, after
/// autodiff and the optimizer: the backward and the updates are those of the two nodes,
/// and the values the same (the update computed from the layer's output as it is stored).
/// The CUDA plans compute the update in the GEMM's epilogue, one launch and one pass over
/// the layer's output fewer. Node ids change (`training`'s are updated); returns how many
/// pairs were fused.
pub fn fuse_cross_updates(g: &mut Graph, training: &mut Training) -> usize {
    let (remap, fused) = g.fuse_linear_mul_adds();
    if fused == 0 {
        return 0;
    }
    let map = |n: &mut NodeId| *n = remap[n.index()];
    let u = &mut training.updates;
    u.step_increment.as_mut().map(map);
    u.dense.iter_mut().for_each(map);
    u.sparse.iter_mut().for_each(map);
    for grad in training.grads.by_param.values_mut() {
        if let Grad::Sparse { node, .. } = grad {
            map(node);
        }
    }
    fused
}
