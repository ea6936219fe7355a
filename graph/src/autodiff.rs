//! Reverse-mode autodiff over the static graph. It appends backward nodes to the same
//! graph, so the training step is one graph. Two rules matter for ERASE:
//! - `detach` emits no gradient edge at all (not a zero tensor), so nothing upstream of a
//!   cut ever waits for anything downstream of it;
//! - a tensor that several consumers use gets its gradient from one n-ary `GradSum` node
//!   whose inputs are ordered by the id of the node that made them: the sum is
//!   deterministic, and nothing accumulates in place (which would race once the
//!   consumers' backwards run on different streams). A concat's output sums them per
//!   input instead, one `SliceSum` over that input's window, in the same order.

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

/// [`backward`] with options.
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
        let nm = node.name.clone();
        let id = node.id;
        let ins = node.inputs.clone();
        let needs = |i: usize| req[ins[i].index()];
        let shape_of = |b: &Builder, i: usize| b.g.shape(ins[i]).clone();
        match &node.op {
            Op::Linear { bias, relu } => {
                // the fused ReLU's gradient first: dy ⊙ (y > 0), y the node's own output,
                // unless the one consumer's dx applied it already
                let y = node.outputs[0];
                let dy = if *relu && b.masked.contains(&y) {
                    if contributions != 1 {
                        return Err(GraphError::Structure(format!(
                            "autodiff: '{nm}' has {contributions} gradient contributions, one of them masked"
                        )));
                    }
                    dy
                } else if *relu {
                    let s = b.g.shape(y).clone();
                    b.add1(Op::ReluGrad, vec![dy, y], s, format!("{nm}.relu_dx"), id)
                } else {
                    dy
                };
                // the forward read a bf16 copy of x (Graph::set_bf16_copies): dy is
                // rounded once too, for both GEMMs, its column sums (the bias gradient)
                // taken in the same pass
                // (x is the copy, or a reshaped view of one). The f32 tensor behind it, and
                // how many other nodes read that f32 tensor or the copy
                let copied = b.g.dtype(ins[0]) == DType::Bf16;
                let copy = b.g.producer(ins[0]);
                let (x_f32, other_readers) = if matches!(copy.op, Op::RoundBf16 { .. }) {
                    // a RoundBf16 reads x_f32
                    let x = copy.inputs[0];
                    (x, uses[x.index()] - 1 + uses[ins[0].index()] - 1)
                } else if b.g.copy_output(copy) == Some(ins[0]) {
                    // written beside x_f32 by its producer
                    let x = copy.outputs[0];
                    (x, uses[x.index()] + uses[ins[0].index()] - 1)
                } else {
                    (ins[0], uses[ins[0].index()] - 1)
                };
                let mut db_done = false;
                let dy_gemm = if b.g.dtype(dy) == DType::Bf16 {
                    // the copy its producer wrote (a MulGrad), with the bias gradient
                    if let Some(sums) = b.dy_sums.remove(&dy) {
                        b.contribute(ins[2], sums);
                        db_done = true;
                    } else if *bias && needs(2) && (copied || !needs(1)) {
                        // (a bf16 dy with an f32 x: the weight gradient sums it)
                        return Err(GraphError::Structure(format!(
                            "autodiff: '{nm}' has a bf16 dy without its column sums"
                        )));
                    }
                    dy
                } else if copied && (needs(0) || needs(1)) {
                    let col_sums = *bias && needs(2);
                    let mut outs = vec![(b.g.shape(dy).clone(), DType::Bf16)];
                    if col_sums {
                        outs.push((shape_of(&b, 2), b.g.float_dtype()));
                    }
                    let r = b.g.add_derived(
                        Op::RoundBf16 { col_sums },
                        vec![dy],
                        outs,
                        format!("{nm}.dy_bf16"),
                        Phase::Backward,
                        Some(id),
                    );
                    if col_sums {
                        b.contribute(ins[2], r[1]);
                        db_done = true;
                    }
                    r[0]
                } else {
                    dy
                };
                if needs(0) {
                    // x the output of a ReLU (fused into a Linear or its own node) that
                    // only this node reads (through its bf16 copy, if it has one): its
                    // gradient's mask goes into this dx's epilogue
                    let x = x_f32;
                    let producer = b.g.node(b.g.info(x).producer);
                    let mask = other_readers == 0
                        && matches!(producer.op, Op::Linear { relu: true, .. } | Op::Relu)
                        && producer.outputs[0] == x;
                    // x the output of a linear layer with copies and without a ReLU (or
                    // a bias gradient to sum), read by this node alone: dx is that
                    // layer's whole dy, and the GEMM's epilogue writes its bf16 copy too
                    let below = matches!(
                        producer.op,
                        Op::Linear { bias, relu: false }
                            if !bias || !req[producer.inputs[2].index()]
                    ) && copied
                        && other_readers == 0
                        && producer.outputs[0] == x
                        && b.g.dtype(producer.inputs[0]) == DType::Bf16
                        && (req[producer.inputs[0].index()] || req[producer.inputs[1].index()]);
                    let mut inputs = vec![dy_gemm, ins[1]];
                    if mask {
                        inputs.push(x);
                        b.masked.insert(x);
                    }
                    let s = shape_of(&b, 0);
                    let f = b.g.float_dtype();
                    let mut outs = vec![(s.clone(), f)];
                    if below {
                        outs.push((s, DType::Bf16));
                    }
                    let dx = b.g.add_derived(
                        Op::LinearGradInput { relu_mask: mask },
                        inputs,
                        outs,
                        format!("{nm}.dx"),
                        Phase::Backward,
                        Some(id),
                    );
                    b.contribute(ins[0], dx[usize::from(below)]);
                }
                let owed = (*bias && !db_done).then(|| ins[2]);
                b.weight_grads(&nm, id, [dy_gemm, dy], ins[0], ins[1], owed, &req);
            }
            Op::LinearAdd { bias } => {
                // [x, w, b?, r]: dy is r's gradient as it is, and the layer's dy
                let nb = usize::from(*bias);
                if needs(2 + nb) {
                    b.contribute(ins[2 + nb], dy);
                }
                if needs(0) {
                    let dx = b.add1(
                        Op::LinearGradInput { relu_mask: false },
                        vec![dy, ins[1]],
                        shape_of(&b, 0),
                        format!("{nm}.dx"),
                        id,
                    );
                    b.contribute(ins[0], dx);
                }
                b.weight_grads(
                    &nm,
                    id,
                    [dy, dy],
                    ins[0],
                    ins[1],
                    bias.then(|| ins[2]),
                    &req,
                );
            }
            Op::MatMul { ta, tb } => {
                let (ta, tb) = (*ta, *tb);
                if needs(0) {
                    let (op, i) = if ta {
                        (Op::MatMul { ta: tb, tb: true }, vec![ins[1], dy])
                    } else {
                        (Op::MatMul { ta: false, tb: !tb }, vec![dy, ins[1]])
                    };
                    let da = b.add1(op, i, shape_of(&b, 0), format!("{nm}.da"), id);
                    b.contribute(ins[0], da);
                }
                if needs(1) {
                    let (op, i) = if tb {
                        (Op::MatMul { ta: true, tb: ta }, vec![dy, ins[0]])
                    } else {
                        (Op::MatMul { ta: !ta, tb: false }, vec![ins[0], dy])
                    };
                    let db = b.add1(op, i, shape_of(&b, 1), format!("{nm}.db"), id);
                    b.contribute(ins[1], db);
                }
            }
            Op::Add => {
                if needs(0) {
                    b.contribute(ins[0], dy);
                }
                if needs(1) {
                    let db = b.unbroadcast(dy, ins[1], format!("{nm}.db"), id);
                    b.contribute(ins[1], db);
                }
            }
            Op::Mul | Op::MulAdd
                if needs(0) && needs(1) && b.g.shape(ins[0]) == b.g.shape(ins[1]) =>
            {
                // both factors' gradients in one pass. A factor that is the output of a
                // linear layer with bf16 copies (Graph::set_bf16_copies), read by this
                // node alone: its gradient is that layer's whole dy, which the pass writes
                // as the bf16 copy the layer's GEMMs read (with its column sums, the bias
                // gradient) instead of in f32 for a RoundBf16 of its own
                let copied_dy = |k: usize| copied_layer_output(b.g, &uses, &req, ins[k]);
                let s = shape_of(&b, 0);
                let fused = [1, 0]
                    .into_iter()
                    .find_map(|k| copied_dy(k).map(|sums| (k, sums)));
                if let Some((k, sums)) = fused {
                    // [dy, other, linear output] -> [other's gradient, the layer's dy in
                    // bf16 (, its column sums)]
                    let (other, lin) = (ins[1 - k], ins[k]);
                    let f = b.g.float_dtype();
                    let mut outs = vec![(s.clone(), f), (s, DType::Bf16)];
                    if let Some(bs) = &sums {
                        outs.push((bs.clone(), f));
                    }
                    let g = b.g.add_derived(
                        Op::MulGrad,
                        vec![dy, other, lin],
                        outs,
                        format!("{nm}.grad"),
                        Phase::Backward,
                        Some(id),
                    );
                    b.contribute(other, g[0]);
                    b.contribute(lin, g[1]);
                    if sums.is_some() {
                        b.dy_sums.insert(g[1], g[2]);
                    }
                } else {
                    let g = b.add(
                        Op::MulGrad,
                        vec![dy, ins[0], ins[1]],
                        vec![s.clone(), s],
                        format!("{nm}.grad"),
                        id,
                    );
                    b.contribute(ins[0], g[0]);
                    b.contribute(ins[1], g[1]);
                }
                if matches!(node.op, Op::MulAdd) && needs(2) {
                    b.contribute(ins[2], dy);
                }
            }
            Op::MulAdd => {
                let s = shape_of(&b, 0);
                for (i, other, what) in [(0, 1, "da"), (1, 0, "db")] {
                    if needs(i) {
                        let d = b.add1(
                            Op::Mul,
                            vec![dy, ins[other]],
                            s.clone(),
                            format!("{nm}.{what}"),
                            id,
                        );
                        b.contribute(ins[i], d);
                    }
                }
                if needs(2) {
                    b.contribute(ins[2], dy);
                }
            }
            Op::Mul => {
                let out_shape = b.g.shape(dy).clone();
                if needs(0) {
                    let da = b.add1(
                        Op::Mul,
                        vec![dy, ins[1]],
                        out_shape.clone(),
                        format!("{nm}.da"),
                        id,
                    );
                    b.contribute(ins[0], da);
                }
                if needs(1) {
                    let full = b.add1(
                        Op::Mul,
                        vec![dy, ins[0]],
                        out_shape,
                        format!("{nm}.db_full"),
                        id,
                    );
                    let db = b.unbroadcast(full, ins[1], format!("{nm}.db"), id);
                    b.contribute(ins[1], db);
                }
            }
            Op::Scale { factor } => {
                let dx = b.add1(
                    Op::Scale { factor: *factor },
                    vec![dy],
                    shape_of(&b, 0),
                    format!("{nm}.dx"),
                    id,
                );
                b.contribute(ins[0], dx);
            }
            Op::Relu if b.masked.contains(&node.outputs[0]) => {
                // the one consumer's dx applied the mask: the gradient passes through
                if contributions != 1 {
                    return Err(GraphError::Structure(format!(
                        "autodiff: '{nm}' has {contributions} gradient contributions, one of them masked"
                    )));
                }
                b.contribute(ins[0], dy);
            }
            Op::Relu | Op::Sigmoid | Op::Gelu => {
                let (op, saved) = match node.op {
                    Op::Relu => (Op::ReluGrad, node.outputs[0]),
                    Op::Sigmoid => (Op::SigmoidGrad, node.outputs[0]),
                    _ => (Op::GeluGrad, ins[0]),
                };
                let dx = b.add1(op, vec![dy, saved], shape_of(&b, 0), format!("{nm}.dx"), id);
                b.contribute(ins[0], dx);
            }
            Op::LayerNorm { .. } => {
                // x the output of a linear layer with bf16 copies, read by this node
                // alone: dx is that layer's whole dy, which the pass also writes as the
                // bf16 copy the layer's GEMMs read, with its column sums (the layer's
                // bias gradient), as outputs 3 and 4
                let copy = if needs(0) {
                    copied_layer_output(b.g, &uses, &req, ins[0])
                } else {
                    None
                };
                let f = b.g.float_dtype();
                let mut out_specs = vec![
                    (shape_of(&b, 0), f),
                    (shape_of(&b, 1), f),
                    (shape_of(&b, 2), f),
                ];
                if let Some(sums) = &copy {
                    out_specs.push((shape_of(&b, 0), DType::Bf16));
                    // the sums even without a bias to take them: the kernel's one form
                    let cols = b.g.shape(ins[0]).last();
                    out_specs.push((sums.clone().unwrap_or_else(|| Shape::new(&[cols])), f));
                }
                let outs = b.g.add_derived(
                    Op::LayerNormGrad,
                    vec![dy, ins[0], ins[1], node.outputs[1], node.outputs[2]],
                    out_specs,
                    format!("{nm}.grad"),
                    Phase::Backward,
                    Some(id),
                );
                for i in 0..3 {
                    if needs(i) {
                        let t = if i == 0 && copy.is_some() {
                            outs[3]
                        } else {
                            outs[i]
                        };
                        b.contribute(ins[i], t);
                    }
                }
                if let Some(Some(_)) = &copy {
                    b.dy_sums.insert(outs[3], outs[4]);
                }
            }
            Op::Reshape => {
                let dx = b.add1(
                    Op::Reshape,
                    vec![dy],
                    shape_of(&b, 0),
                    format!("{nm}.dx"),
                    id,
                );
                b.contribute(ins[0], dx);
            }
            Op::Detach => {}
            // (its contributions were passed on above)
            Op::RoundBf16 { .. } => {}
            Op::Cast { .. } => {
                let to = b.g.dtype(ins[0]);
                let s = shape_of(&b, 0);
                let dx = b.g.add_derived(
                    Op::Cast { to },
                    vec![dy],
                    vec![(s, to)],
                    format!("{nm}.dx"),
                    Phase::Backward,
                    Some(id),
                )[0];
                b.contribute(ins[0], dx);
            }
            Op::Concat { axis } if (0..ins.len()).filter(|&i| needs(i)).count() > 1 => {
                // every part's gradient from one pass over dy
                let shapes: Vec<Shape> = (0..ins.len()).map(|i| shape_of(&b, i)).collect();
                let sizes = shapes.iter().map(|s| s.dims()[*axis]).collect();
                let parts = b.add(
                    Op::Split { axis: *axis, sizes },
                    vec![dy],
                    shapes,
                    format!("{nm}.dx"),
                    id,
                );
                for (i, (&input, &part)) in ins.iter().zip(&parts).enumerate() {
                    if needs(i) {
                        b.contribute(input, part);
                    }
                }
            }
            Op::Concat { axis } => {
                let mut start = 0;
                for (i, &input) in ins.iter().enumerate() {
                    let s = shape_of(&b, i);
                    let len = s.dims()[*axis];
                    if needs(i) {
                        let dx = b.add1(
                            Op::Slice {
                                axis: *axis,
                                start,
                                len,
                            },
                            vec![dy],
                            s,
                            format!("{nm}.dx{i}"),
                            id,
                        );
                        b.contribute(input, dx);
                    }
                    start += len;
                }
            }
            Op::Slice { axis, start, .. } => {
                let s = shape_of(&b, 0);
                let full = s.dims()[*axis];
                let dx = b.add1(
                    Op::Pad {
                        axis: *axis,
                        start: *start,
                        full,
                    },
                    vec![dy],
                    s,
                    format!("{nm}.dx"),
                    id,
                );
                b.contribute(ins[0], dx);
            }
            Op::PairwiseDot => {
                let de = b.add1(
                    Op::PairwiseDotGrad,
                    vec![dy, ins[0]],
                    shape_of(&b, 0),
                    format!("{nm}.de"),
                    id,
                );
                b.contribute(ins[0], de);
            }
            Op::Attention {
                heads,
                causal,
                packed: true,
            } => {
                // qkv a projection's output: dqkv is that layer's whole dy, written in
                // bf16 where only its GEMMs read it
                let dt = if bf16_layer_gradient(b.g, &uses, &req, ins[0]) {
                    DType::Bf16
                } else {
                    b.g.float_dtype()
                };
                let dqkv = b.g.add_derived(
                    Op::AttentionGrad {
                        heads: *heads,
                        causal: *causal,
                        packed: true,
                    },
                    vec![dy, ins[0], node.outputs[0], node.outputs[1]],
                    vec![(shape_of(&b, 0), dt)],
                    format!("{nm}.grad"),
                    Phase::Backward,
                    Some(id),
                )[0];
                b.contribute(ins[0], dqkv);
            }
            Op::Attention {
                heads,
                causal,
                packed: false,
            } => {
                let s = shape_of(&b, 0);
                let outs = b.add(
                    Op::AttentionGrad {
                        heads: *heads,
                        causal: *causal,
                        packed: false,
                    },
                    vec![dy, ins[0], ins[1], ins[2], node.outputs[0], node.outputs[1]],
                    vec![s.clone(), s.clone(), s],
                    format!("{nm}.grad"),
                    id,
                );
                for (i, &t) in outs.iter().enumerate() {
                    if needs(i) {
                        b.contribute(ins[i], t);
                    }
                }
            }
            Op::EmbeddingBag { .. } => {
                b.sparse.entry(ins[0]).or_default().push((id, dy));
            }
            Op::BagMean { mean } => {
                // z = y ⊙ s with s fixed by the ids: dy = dz ⊙ s, the same op
                let dx = b.add1(
                    Op::BagMean { mean: mean.clone() },
                    vec![dy, ins[1], ins[2]],
                    shape_of(&b, 0),
                    format!("{nm}.dy"),
                    id,
                );
                b.contribute(ins[0], dx);
            }
            Op::BceWithLogits => {
                let dx = b.add1(
                    Op::BceWithLogitsGrad,
                    vec![dy, ins[0], ins[1]],
                    shape_of(&b, 0),
                    format!("{nm}.dlogit"),
                    id,
                );
                b.contribute(ins[0], dx);
            }
            Op::SoftmaxCrossEntropy => {
                let dx = b.add1(
                    Op::SoftmaxCrossEntropyGrad,
                    vec![dy, ins[0], ins[1]],
                    shape_of(&b, 0),
                    format!("{nm}.dlogits"),
                    id,
                );
                b.contribute(ins[0], dx);
            }
            Op::Sum | Op::Mean => {
                let s = shape_of(&b, 0);
                let scale = if matches!(node.op, Op::Mean) {
                    1.0 / s.numel() as f64
                } else {
                    1.0
                };
                let dx = b.add1(Op::Broadcast { scale }, vec![dy], s, format!("{nm}.dx"), id);
                b.contribute(ins[0], dx);
            }
            other => {
                return Err(GraphError::Structure(format!(
                    "autodiff: no gradient rule for {} node '{nm}'",
                    other.name()
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
