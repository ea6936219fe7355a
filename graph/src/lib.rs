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
pub use graph::{Graph, Loss, Node, NodeId, Phase, Tensor, TensorInfo};
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
