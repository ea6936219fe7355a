//! Reverse-mode autodiff over the static graph. It appends backward nodes to the same
//! graph, so the training step is one graph. Two rules matter for ERASE:
//! - `detach` emits no gradient edge at all (not a zero tensor), so nothing upstream of a
//!   cut ever waits for anything downstream of it;
//! - a tensor that several consumers use gets its gradient from one n-ary `GradSum` node
//!   whose inputs are ordered by the id of the node that made them: the sum is
//!   deterministic, and nothing accumulates in place (which would race once the
//!   consumers' backwards run on different streams). A concat's output sums them per
//!   input instead, one `SliceSum` over that input's window, in the same order.

mod rules;

use std::collections::BTreeMap;

use crate::dtype::{DType, Shape};
use crate::error::{GraphError, Result};
use crate::graph::{Graph, NodeId, Phase, Tensor};
use crate::op::{Leaf, Op};

/// The gradient of one trainable parameter.
#[derive(Clone, Debug, PartialEq)]
pub enum Grad {
    /// A dense tensor of the parameter's shape.
    Dense(Tensor),
    /// The gradient of an embedding table used by exactly one `embedding_bag`: the
    /// gradient of the pooled output with the bag's ids and offsets. Only the rows the
    /// batch touches have a gradient; the row-wise optimizer consumes it as it is.
    Sparse {
        /// The embedding_bag node.
        node: NodeId,
        ids: Tensor,
        offsets: Tensor,
        /// `[B, F, D]`, the gradient of the pooled bags.
        dpooled: Tensor,
    },
}

impl Grad {
    /// The tensor whose completion makes the gradient complete.
    pub fn final_tensor(&self) -> Tensor {
        match self {
            Grad::Dense(t) => *t,
            Grad::Sparse { dpooled, .. } => *dpooled,
        }
    }
}

/// Gradients of all trainable parameters that some loss depends on, by parameter id.
#[derive(Clone, Debug, Default)]
pub struct Gradients {
    pub by_param: BTreeMap<Tensor, Grad>,
}

impl Gradients {
    pub fn get(&self, p: Tensor) -> Option<&Grad> {
        self.by_param.get(&p)
    }
}

/// What requires a gradient: a tensor that depends on a trainable parameter through ops
/// other than `detach` (and other than the integer inputs of lookups and losses).
fn requires_grad(g: &Graph) -> Vec<bool> {
    let mut req = vec![false; g.num_tensors()];
    for node in g.nodes() {
        if node.phase != Phase::Forward {
            continue;
        }
        let r = match &node.op {
            Op::Leaf(Leaf::Param { trainable, .. }) => *trainable,
            Op::Leaf(_) | Op::Detach => false,
            // labels are data, not differentiable operands
            Op::BceWithLogits | Op::SoftmaxCrossEntropy => req[node.inputs[0].index()],
            Op::EmbeddingBag { .. } | Op::BagMean { .. } => req[node.inputs[0].index()],
            _ => node.inputs.iter().any(|t| req[t.index()]),
        };
        for &o in &node.outputs {
            req[o.index()] = r;
        }
    }
    req
}

/// One gradient contribution to a tensor: which node made it and the tensor.
#[derive(Clone, Copy, Debug)]
struct Contribution {
    by: NodeId,
    grad: Tensor,
}

struct Builder<'g> {
    g: &'g mut Graph,
    contribs: Vec<Vec<Contribution>>,
    /// Sparse table gradients: table -> (embedding_bag node, dpooled).
    sparse: BTreeMap<Tensor, Vec<(NodeId, Tensor)>>,
    /// Outputs of `Linear { relu: true }` or `Relu` whose one gradient contribution
    /// already has the ReLU's mask applied (a `LinearGradInput { relu_mask }` of their
    /// one consumer).
    masked: std::collections::BTreeSet<Tensor>,
    /// A linear layer's dy written as its bf16 copy by the node that makes it (a
    /// `MulGrad`), with that node's column sums of it (the layer's bias gradient).
    dy_sums: BTreeMap<Tensor, Tensor>,
}

impl Builder<'_> {
    fn add(
        &mut self,
        op: Op,
        inputs: Vec<Tensor>,
        outs: Vec<Shape>,
        name: String,
        origin: NodeId,
    ) -> Vec<Tensor> {
        let dt = self.g.float_dtype();
        let outs = outs.into_iter().map(|s| (s, dt)).collect();
        self.g
            .add_derived(op, inputs, outs, name, Phase::Backward, Some(origin))
    }

    fn add1(
        &mut self,
        op: Op,
        inputs: Vec<Tensor>,
        shape: Shape,
        name: String,
        origin: NodeId,
    ) -> Tensor {
        self.add(op, inputs, vec![shape], name, origin)[0]
    }

    fn contribute(&mut self, to: Tensor, grad: Tensor) {
        let by = self.g.info(grad).producer;
        self.contribs[to.index()].push(Contribution { by, grad });
    }

    /// The complete gradient of `t`, summing contributions in node-id order.
    fn total(&mut self, t: Tensor, origin: NodeId) -> Option<Tensor> {
        let mut cs = std::mem::take(&mut self.contribs[t.index()]);
        match cs.len() {
            0 => None,
            1 => Some(cs[0].grad),
            _ => {
                cs.sort_by_key(|c| (c.by, c.grad));
                let shape = self.g.shape(t).clone();
                let name = format!("{}.grad_sum", self.g.name(t));
                Some(self.add1(
                    Op::GradSum,
                    cs.iter().map(|c| c.grad).collect(),
                    shape,
                    name,
                    origin,
                ))
            }
        }
    }

    /// The one gradient contribution `x` has besides the one node `id` (a linear layer
    /// reading x, or `read`, a bf16 copy of it) is about to make, when it is final: every
    /// other forward reader of x or of `read` comes after `id` in the graph, so the walk
    /// (which goes backward) has taken its contribution already, and exactly one is
    /// waiting, of `shape` and the graph's float type. It is taken from x: node `id`'s data
    /// gradient adds it (`LinearGradInput { residual }`), the GEMM's epilogue summing what a
    /// `GradSum` of the two would (a sum of two is the same in either order).
    fn sole_other_contribution(
        &mut self,
        id: NodeId,
        x: Tensor,
        read: Tensor,
        shape: &Shape,
    ) -> Option<Tensor> {
        let copy_maker = (read != x).then(|| self.g.info(read).producer);
        let all_later = self.g.nodes().iter().all(|n| {
            n.phase != Phase::Forward
                || n.id >= id
                || Some(n.id) == copy_maker
                || !n.inputs.iter().any(|&t| t == x || t == read)
        });
        if !all_later {
            return None;
        }
        let mut waiting = self.contribs[x.index()].clone();
        if read != x {
            waiting.extend(self.contribs[read.index()].iter().copied());
        }
        let [c] = waiting[..] else {
            return None;
        };
        if self.g.shape(c.grad) != shape || self.g.dtype(c.grad) != self.g.float_dtype() {
            return None;
        }
        self.contribs[x.index()].clear();
        self.contribs[read.index()].clear();
        Some(c.grad)
    }

    /// The gradients of a concat's inputs when its output has several contributions:
    /// `SliceSum` of each needed input's window of them, in the order [`Self::total`]
    /// sums them, so the bits are those of the sum sliced.
    fn concat_slice_sums(&mut self, node: &crate::graph::Node, axis: usize, req: &[bool]) {
        let mut cs = std::mem::take(&mut self.contribs[node.outputs[0].index()]);
        cs.sort_by_key(|c| (c.by, c.grad));
        let grads: Vec<Tensor> = cs.iter().map(|c| c.grad).collect();
        let mut start = 0;
        for (i, &input) in node.inputs.iter().enumerate() {
            let s = self.g.shape(input).clone();
            let len = s.dims()[axis];
            if req[input.index()] {
                let dx = self.add1(
                    Op::SliceSum { axis, start, len },
                    grads.clone(),
                    s,
                    format!("{}.dx{i}", node.name),
                    node.id,
                );
                self.contribute(input, dx);
            }
            start += len;
        }
    }

    /// The gradient of a reshaped concat (each block's flatten of the field embeddings)
    /// with several contributions: each is passed on to the concat's output as a reshape
    /// (a view), so that the concat's slice sums read them all in one pass
    /// ([`Self::concat_slice_sums`]) instead of a `GradSum` here and a pass over its
    /// result there (two passes over the whole gradient fewer). Returns whether it did:
    /// not where a contribution is not of the graph's float type.
    fn reshape_into_concat(&mut self, node: &crate::graph::Node) -> bool {
        let src = node.inputs[0];
        if !matches!(self.g.producer(src).op, Op::Concat { .. }) {
            return false;
        }
        let float = self.g.float_dtype();
        let out = node.outputs[0];
        if self.contribs[out.index()]
            .iter()
            .any(|c| self.g.dtype(c.grad) != float)
        {
            return false;
        }
        let mut cs = std::mem::take(&mut self.contribs[out.index()]);
        cs.sort_by_key(|c| (c.by, c.grad));
        let shape = self.g.shape(src).clone();
        for (i, c) in cs.iter().enumerate() {
            let name = format!("{}.dx{i}", node.name);
            let dx = self.add1(Op::Reshape, vec![c.grad], shape.clone(), name, node.id);
            self.contribute(src, dx);
        }
        true
    }

    /// A linear layer's weight gradient, with the bias gradient (of `bias`, the bias the
    /// layer still owes one) from the same pass over dy when both are wanted, else the
    /// bias gradient by a reduction of its own. `dy` is [what the GEMM reads (dy or its
    /// bf16 copy), what the reduction reads].
    #[allow(clippy::too_many_arguments)]
    fn weight_grads(
        &mut self,
        nm: &str,
        id: NodeId,
        dy: [Tensor; 2],
        x: Tensor,
        w: Tensor,
        bias: Option<Tensor>,
        req: &[bool],
    ) {
        let bias = bias.filter(|t| req[t.index()]);
        let fused_db = bias.is_some() && req[w.index()];
        if req[w.index()] {
            let mut outs = vec![self.g.shape(w).clone()];
            outs.extend(bias.filter(|_| fused_db).map(|t| self.g.shape(t).clone()));
            let g = self.add(
                Op::LinearGradWeight { bias: fused_db },
                vec![dy[0], x],
                outs,
                format!("{nm}.dw"),
                id,
            );
            self.contribute(w, g[0]);
            if let (true, Some(t)) = (fused_db, bias) {
                self.contribute(t, g[1]);
            }
        }
        if let (false, Some(t)) = (fused_db, bias) {
            let s = self.g.shape(t).clone();
            let db = self.add1(Op::SumToShape, vec![dy[1]], s, format!("{nm}.db"), id);
            self.contribute(t, db);
        }
    }

    /// Reduces `dy` to `target`'s shape when `target` was broadcast.
    fn unbroadcast(&mut self, dy: Tensor, target: Tensor, name: String, origin: NodeId) -> Tensor {
        let ts = self.g.shape(target).clone();
        if self.g.shape(dy) == &ts {
            dy
        } else {
            self.add1(Op::SumToShape, vec![dy], ts, name, origin)
        }
    }
}

/// Options of [`backward_with`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BackwardOptions {
    /// Keep embedding-table gradients sparse (pooled gradient + ids) where a table feeds
    /// one lookup; otherwise every table gradient is made dense.
    pub sparse_tables: bool,
}

impl Default for BackwardOptions {
    fn default() -> Self {
        BackwardOptions {
            sparse_tables: true,
        }
    }
}

/// Appends the backward nodes of all registered losses. Returns the gradient of every
/// trainable parameter that a loss depends on.
pub fn backward(g: &mut Graph) -> Result<Gradients> {
    backward_with(g, BackwardOptions::default())
}

/// Whether `t` is the output of a linear layer with bf16 operand copies
/// (`Graph::set_bf16_copies`), without a ReLU or a copy output of its own, that one node
/// alone reads (`uses`): then that node's gradient for `t` is the layer's whole dy, and it
/// may write it as the bf16 copy the layer's GEMMs read. `Some(sums)`: `sums` the shape of
/// the column sums the layer takes as its bias gradient, if it needs one.
fn copied_layer_output(
    g: &Graph,
    uses: &[usize],
    req: &[bool],
    t: Tensor,
) -> Option<Option<Shape>> {
    let p = g.producer(t);
    match p.op {
        Op::Linear { bias, relu: false }
            if p.outputs == [t]
                && uses[t.index()] == 1
                && g.dtype(p.inputs[0]) == DType::Bf16
                && (req[p.inputs[0].index()] || req[p.inputs[1].index()]) =>
        {
            Some((bias && req[p.inputs[2].index()]).then(|| g.shape(p.inputs[2]).clone()))
        }
        _ => None,
    }
}

/// Whether `t`'s gradient may be written in bf16: `t` is the output of a linear layer
/// without a ReLU or a copy output, that one node alone reads (`uses`), of the size
/// `Graph::bf16_dy_layer` asks, the layer reading an f32 x (a layer with copies rounds dy
/// itself, with its column sums) and its weight trained (the weight gradient's pass sums
/// the bias gradient from the bf16 values, as autocast does in PyTorch). The layer's data
/// and weight gradients round dy to bf16 anyway, so they compute the same products; the
/// gradient is written and read in half the bytes.
fn bf16_layer_gradient(g: &Graph, uses: &[usize], req: &[bool], t: Tensor) -> bool {
    let p = g.producer(t);
    if !matches!(p.op, Op::Linear { relu: false, .. }) {
        return false;
    }
    let (w, x) = (g.shape(p.inputs[1]).dims(), g.shape(p.inputs[0]));
    w.len() == 2
        && g.bf16_dy_layer(x.numel() / w[1].max(1), w[1], w[0])
        && p.outputs == [t]
        && uses[t.index()] == 1
        && g.dtype(p.inputs[0]) == DType::F32
        && req[p.inputs[1].index()]
}

/// [`backward`] with options.
pub fn backward_with(g: &mut Graph, opts: BackwardOptions) -> Result<Gradients> {
    if g.losses().is_empty() {
        return Err(GraphError::Structure(
            "autodiff: the graph has no loss; register one with Graph::loss".into(),
        ));
    }
    if g.nodes().iter().any(|n| n.phase != Phase::Forward) {
        return Err(GraphError::Structure(
            "autodiff: the graph already has backward or optimizer nodes".into(),
        ));
    }
    let req = requires_grad(g);
    let forward_len = g.nodes().len();
    let losses = g.losses().to_vec();
    let n = g.num_tensors();
    // how many times forward nodes read each tensor, and losses count as readers: a
    // ReLU output read once, by a linear, can take its mask from that linear's dx
    let mut uses = vec![0usize; n];
    for node in g.nodes() {
        for t in &node.inputs {
            uses[t.index()] += 1;
        }
    }
    for l in &losses {
        uses[l.tensor.index()] += 1;
    }
    let mut b = Builder {
        g,
        contribs: vec![Vec::new(); n],
        sparse: BTreeMap::new(),
        masked: Default::default(),
        dy_sums: Default::default(),
    };

    // Seeds: d(Σ w·l)/dl = w, one constant per loss.
    for l in &losses {
        if !req[l.tensor.index()] {
            continue;
        }
        let dt = b.g.dtype(l.tensor);
        let name = format!("{}.seed", b.g.name(l.tensor));
        let loss_node = b.g.info(l.tensor).producer;
        let mut seed = b.g.add_seed(name.clone(), l.weight, dt, loss_node);
        let ls = b.g.shape(l.tensor).clone();
        if ls.rank() > 0 {
            let origin = b.g.info(l.tensor).producer;
            seed = b.add1(Op::Reshape, vec![seed], ls, name, origin);
        }
        b.contribute(l.tensor, seed);
    }

    for idx in (0..forward_len).rev() {
        let node = b.g.nodes()[idx].clone();
        if node.op.is_leaf() || node.outputs.is_empty() || !req[node.outputs[0].index()] {
            continue;
        }
        if let Some(c) = b.g.copy_output(&node) {
            // the bf16 copy beside output 0: its gradient is output 0's
            let cs = std::mem::take(&mut b.contribs[c.index()]);
            b.contribs[node.outputs[0].index()].extend(cs);
        }
        if matches!(node.op, Op::RoundBf16 { .. }) {
            // the rounding is not differentiated: each of the copy's contributions goes
            // to x as it is, not summed first (x's own sum, E's slice sums, takes them
            // with its other contributions in one pass)
            let cs = std::mem::take(&mut b.contribs[node.outputs[0].index()]);
            b.contribs[node.inputs[0].index()].extend(cs);
            continue;
        }
        let contributions = b.contribs[node.outputs[0].index()].len();
        if let (Op::Reshape, true) = (&node.op, contributions > 1) {
            if b.reshape_into_concat(&node) {
                continue;
            }
        }
        if let (Op::Concat { axis }, true) = (&node.op, contributions > 1) {
            // each input's gradient as one pass over its window of the contributions,
            // instead of their sum over the whole output and then a copy out of it
            b.concat_slice_sums(&node, *axis, &req);
            continue;
        }
        let Some(dy) = b.total(node.outputs[0], node.id) else {
            continue;
        };
        for &o in &node.outputs[1..] {
            // secondary outputs (statistics kept for backward) carry no gradient
            b.contribs[o.index()].clear();
        }
        let r = rules::Rule {
            node: &node,
            dy,
            contributions,
            req: &req,
            uses: &uses,
        };
        // one arm a family, every op named: a new op does not compile without its rule
        match &node.op {
            Op::Linear { .. } | Op::LinearAdd { .. } | Op::MatMul { .. } => {
                rules::gemm(&mut b, &r)?
            }
            Op::Add
            | Op::Mul
            | Op::MulAdd
            | Op::Scale { .. }
            | Op::Relu
            | Op::Sigmoid
            | Op::Gelu
            | Op::Silu => rules::elementwise(&mut b, &r)?,
            Op::LayerNorm { .. } => rules::norm(&mut b, &r)?,
            Op::Reshape
            | Op::Detach
            | Op::RoundBf16 { .. }
            | Op::Cast { .. }
            | Op::Concat { .. }
            | Op::Slice { .. } => rules::shape(&mut b, &r)?,
            Op::PairwiseDot => rules::interaction(&mut b, &r)?,
            Op::Attention { .. } => rules::attention(&mut b, &r)?,
            Op::EmbeddingBag { .. } | Op::BagMean { .. } => rules::embedding(&mut b, &r)?,
            Op::BceWithLogits | Op::SoftmaxCrossEntropy => rules::loss(&mut b, &r)?,
            Op::Sum | Op::Mean => rules::reduce(&mut b, &r)?,
            // leaves are skipped above; the rest are backward and optimizer ops, which a
            // forward graph does not have, and the fused cross update, made after autodiff
            // (crate::fuse_cross_updates)
            Op::Leaf(_)
            | Op::LinearMulAdd { .. }
            | Op::LinearGradInput { .. }
            | Op::LinearGradWeight { .. }
            | Op::MulGrad { .. }
            | Op::ReluGrad
            | Op::GeluGrad
            | Op::SiluGrad
            | Op::SigmoidGrad
            | Op::Split { .. }
            | Op::Pad { .. }
            | Op::LayerNormGrad
            | Op::SumToShape
            | Op::PairwiseDotGrad
            | Op::AttentionGrad { .. }
            | Op::EmbeddingBagGradDense { .. }
            | Op::EmbeddingSort { .. }
            | Op::RowwiseAdagrad { .. }
            | Op::BceWithLogitsGrad
            | Op::SoftmaxCrossEntropyGrad
            | Op::Broadcast { .. }
            | Op::GradSum
            | Op::SliceSum { .. }
            | Op::StepIncrement
            | Op::Sgd { .. }
            | Op::Adam { .. } => {
                return Err(GraphError::Structure(format!(
                    "autodiff: no gradient rule for {} node '{}'",
                    node.op.name(),
                    node.name
                )))
            }
        }
    }

    // Parameters: complete their gradients.
    let mut grads = Gradients::default();
    for p in b.g.params() {
        if !req[p.index()] {
            continue;
        }
        let origin = b.g.info(p).producer;
        let sparse = b.sparse.remove(&p).unwrap_or_default();
        let dense_count = b.contribs[p.index()].len();
        if opts.sparse_tables && dense_count == 0 && sparse.len() == 1 {
            let (node, dpooled) = sparse[0];
            let n = b.g.node(node).clone();
            grads.by_param.insert(
                p,
                Grad::Sparse {
                    node,
                    ids: n.inputs[1],
                    offsets: n.inputs[2],
                    dpooled,
                },
            );
            continue;
        }
        // Shared between several lookups or also used densely: densify each lookup's
        // gradient and sum everything in a fixed order.
        for (node, dpooled) in sparse {
            let n = b.g.node(node).clone();
            let Op::EmbeddingBag { field_rows } = n.op else {
                continue;
            };
            let s = b.g.shape(p).clone();
            let d = b.add1(
                Op::EmbeddingBagGradDense { field_rows },
                vec![dpooled, n.inputs[1], n.inputs[2]],
                s,
                format!("{}.dtable", n.name),
                node,
            );
            b.contribute(p, d);
        }
        if let Some(t) = b.total(p, origin) {
            grads.by_param.insert(p, Grad::Dense(t));
        }
    }
    debug_assert!(
        b.dy_sums.is_empty(),
        "autodiff: column sums of a bf16 dy no linear layer took"
    );
    Ok(grads)
}
