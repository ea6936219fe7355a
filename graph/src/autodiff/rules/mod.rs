//! The gradient rules, one file and function per op family (as `ops/src/family/`). Each
//! gets the node, the sum of its output's gradient contributions (`dy`) and what the walk
//! knows (which tensors need a gradient, how often each is read), and contributes its
//! inputs' gradients to the builder. [`super::backward_with`] dispatches to them in one
//! exhaustive match.

mod attention;
mod elementwise;
mod embedding;
mod gemm;
mod interaction;
mod loss;
mod norm;
mod reduce;
mod shape;
pub(super) use {
    attention::attention, elementwise::elementwise, embedding::embedding, gemm::gemm,
    interaction::interaction, loss::loss, norm::norm, reduce::reduce, shape::shape,
};

use super::Builder;
use crate::dtype::Shape;
use crate::graph::Node;
use crate::{GraphError, Tensor};

/// What a rule knows of the node it differentiates.
pub(super) struct Rule<'a> {
    pub node: &'a Node,
    /// The gradient of the node's output 0 (the sum of its contributions).
    pub dy: Tensor,
    /// How many contributions `dy` sums.
    pub contributions: usize,
    /// Which tensors need a gradient.
    pub req: &'a [bool],
    /// How many forward nodes (and losses) read each tensor.
    pub uses: &'a [usize],
}

impl Rule<'_> {
    /// Whether input `i` needs a gradient.
    fn needs(&self, i: usize) -> bool {
        self.req[self.node.inputs[i].index()]
    }

    /// Input `i`'s shape.
    fn shape_of(&self, b: &Builder, i: usize) -> Shape {
        b.g.shape(self.node.inputs[i]).clone()
    }

    /// The error of a family's rules handed an op of another family (a dispatch bug).
    fn misrouted(&self, family: &str) -> GraphError {
        GraphError::Structure(format!(
            "autodiff: the {family} rules were asked for {} node '{}'",
            self.node.op.name(),
            self.node.name
        ))
    }
}
