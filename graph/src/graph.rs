//! The static graph and the model DSL. Every builder method checks shapes and element
//! types when the node is added, so a mistake is reported at the line of model code that
//! made it, naming the op, the node and the operands.

use crate::dtype::{DType, Shape};
use crate::error::{GraphError, Result};
use crate::op::{Init, Leaf, Op};

/// The longest sequence whose packed q, k, v [`Graph::linear_for_attention`] stores in bf16:
/// the fused attention kernels (one 64-row tile of queries and keys) read it as it is.
pub const ATTENTION_BF16_MAX_SEQ: usize = 64;

/// A handle to a tensor (a value) of a graph. Only the graph's methods make one (the
/// field is private), so a handle always names a tensor of some graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Tensor(pub(crate) u32);

/// A handle to a node (an operation) of a graph. Ids grow in insertion order, which is
/// also a valid execution order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(pub u32);

impl Tensor {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl NodeId {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// What part of a training step a node belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Phase {
    Forward,
    Backward,
    Optimizer,
}

#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub shape: Shape,
    pub dtype: DType,
    pub producer: NodeId,
    pub name: String,
}

#[derive(Clone, Debug)]
pub struct Node {
    pub id: NodeId,
    pub op: Op,
    pub inputs: Vec<Tensor>,
    pub outputs: Vec<Tensor>,
    /// Persistent tensors this node reads and rewrites in place (optimizer updates).
    pub updates: Vec<Tensor>,
    pub name: String,
    pub phase: Phase,
    /// For backward nodes: the forward node whose gradient rule made this node.
    pub origin: Option<NodeId>,
}

/// A weighted loss term: the step minimises `Σ weight · loss`.
#[derive(Clone, Debug)]
pub struct Loss {
    pub tensor: Tensor,
    pub weight: f64,
}

/// A static computation graph, built through the DSL methods below.
#[derive(Clone, Debug)]
pub struct Graph {
    tensors: Vec<TensorInfo>,
    nodes: Vec<Node>,
    losses: Vec<Loss>,
    scope: Vec<String>,
    float: DType,
    /// Per scope and op kind: how many nodes were named automatically.
    counters: std::collections::BTreeMap<String, usize>,
    /// Least FLOPs of a layer whose GEMM operands are rounded once by RoundBf16 nodes
    /// (`None`: off; see [`Graph::set_bf16_copies`]).
    bf16_copies: Option<usize>,
    /// Whether [`Graph::linear_stored_bf16`] stores its output in bf16 (see
    /// [`Graph::set_bf16_storage`]).
    bf16_storage: bool,
    /// Whether [`Graph::mul_add_stored`] reads and stores a cross network in bf16 (see
    /// [`Graph::set_bf16_cross`]).
    bf16_cross: bool,
    /// Whether autodiff sums the two gradient contributions of a cross update `a ⊙ b + a`
    /// in its gradient's pass (see [`Graph::set_fold_plus_dy`]).
    fold_plus_dy: bool,
    /// Whether [`Graph::concat_stored`] stores its output in bf16 alone (see
    /// [`Graph::set_bf16_x0`]).
    bf16_x0: bool,
    /// The RoundBf16 copy made of each activation so far.
    bf16_of: std::collections::BTreeMap<Tensor, Tensor>,
}

impl Default for Graph {
    fn default() -> Self {
        Self::new(DType::F32)
    }
}

/// The output description a node is added with.
pub(crate) struct OutSpec {
    pub shape: Shape,
    pub dtype: DType,
}

impl Graph {
    /// A new graph whose parameters and activations use `float` (F32, or F64 for
    /// reference computations).
    pub fn new(float: DType) -> Self {
        Graph {
            tensors: Vec::new(),
            nodes: Vec::new(),
            losses: Vec::new(),
            scope: Vec::new(),
            float,
            counters: Default::default(),
            bf16_copies: None,
            bf16_storage: false,
            bf16_cross: false,
            fold_plus_dy: false,
            bf16_x0: false,
            bf16_of: Default::default(),
        }
    }

    /// Rounds the GEMM operands of large linear layers to bf16 once, in RoundBf16 nodes,
    /// instead of in each GEMM that reads them. For a layer added after this call by
    /// `linear_with` / `linear_relu_with` over `rows` rows, `in` inputs and `out` outputs,
    /// with rows, in and out multiples of 64, each at least 128, and 2·rows·in·out at least
    /// `min_flops` (an f32 graph only), the forward reads bf16 copies of x (one copy per
    /// activation, shared by every such layer that reads it; the weight gradient reads it
    /// too) and of the weight (which the data gradient reads too), and autodiff rounds the
    /// layer's dy once for its data and weight gradients (summing the bias gradient in the
    /// same pass). The values are those of a backend
    /// that rounds GEMM operands to bf16 (the CUDA kernels, the CPU with `bf16_gemm`), in
    /// fewer passes; `None` turns it off for the layers added after.
    pub fn set_bf16_copies(&mut self, min_flops: Option<usize>) {
        self.bf16_copies = min_flops;
    }

    /// Whether the layers added after this call by [`Graph::linear_stored_bf16`] (the
    /// cross layers' up-projections) store their output in bf16 where they take bf16
    /// copies of their operands, as autocast stores a linear layer's output; off, they
    /// are [`Graph::linear_with`]'s f32 layers.
    pub fn set_bf16_storage(&mut self, on: bool) {
        self.bf16_storage = on;
    }

    /// Whether the cross updates added after this call by [`Graph::mul_add_stored`] read
    /// x0 and the previous layer's update from their bf16 copies (the ones the cross
    /// layers' GEMMs read) and store their own update in bf16, where their up-projection
    /// is stored in bf16 ([`Graph::set_bf16_storage`]): half the bytes for the network's
    /// elementwise passes, forward and backward, each update rounded to bf16 once. Off,
    /// they are [`Graph::mul_add`]'s f32 updates.
    pub fn set_bf16_cross(&mut self, on: bool) {
        self.bf16_cross = on;
    }

    /// Whether autodiff gives a cross update that reads one tensor as both `a` and `c`
    /// (`a ⊙ b + a`: a network's first update stored in bf16, x0 read from one copy, see
    /// [`Graph::mul_add_stored`]) one gradient for a: `MulGrad { plus_dy }` writes
    /// `dy ⊙ b + dy`, one tensor fewer for a's sum to read, instead of `dy ⊙ b` beside
    /// dy. The same sum in another order.
    pub fn set_fold_plus_dy(&mut self, on: bool) {
        self.fold_plus_dy = on;
    }

    /// See [`Graph::set_fold_plus_dy`].
    pub fn fold_plus_dy(&self) -> bool {
        self.fold_plus_dy
    }

    /// Whether [`Graph::concat_stored`] (a cross network's x0 that only its bf16 layers
    /// read) stores its output in bf16 alone: the concat's pass writes the copy the
    /// network reads and not the f32 tensor nobody does.
    pub fn set_bf16_x0(&mut self, on: bool) {
        self.bf16_x0 = on;
    }

    /// Whether a linear layer of these sizes may read its dy in bf16, written so by the op
    /// that makes it (see `autodiff`): bf16 copies are on, in an f32 graph, and the layer
    /// has at least their FLOPs (2·rows·in·out), whatever its shape. Its GEMMs round dy
    /// to bf16 anyway.
    pub fn bf16_dy_layer(&self, rows: usize, inputs: usize, outputs: usize) -> bool {
        let Some(min_flops) = self.bf16_copies else {
            return false;
        };
        self.float == DType::F32
            && (2 * rows).saturating_mul(inputs).saturating_mul(outputs) >= min_flops
    }

    /// The bf16 copy a node writes beside its output 0 (its second output), for the ops
    /// that make one in the same pass (`MulAdd`, `Mul`, `Concat`, `Linear`: its GEMM's
    /// epilogue; see
    /// [`Graph::set_bf16_copies`]). Gradients of the copy are those of output 0.
    pub fn copy_output(&self, node: &Node) -> Option<Tensor> {
        match (&node.op, &node.outputs[..]) {
            (Op::MulAdd | Op::Mul | Op::Concat { .. } | Op::Linear { .. }, [_, c])
                if self.dtype(*c) == DType::Bf16 =>
            {
                Some(*c)
            }
            // (the update's copy, beside the update: the node's output 1)
            (Op::LinearMulAdd { .. }, [_, _, c]) if self.dtype(*c) == DType::Bf16 => Some(*c),
            _ => None,
        }
    }

    /// Whether a linear layer of these sizes takes bf16 copies of its operands (see
    /// [`Graph::set_bf16_copies`]).
    pub fn bf16_layer(&self, rows: usize, inputs: usize, outputs: usize) -> bool {
        let ok = |d: usize| d >= 128 && d.is_multiple_of(64);
        ok(rows) && ok(inputs) && ok(outputs) && self.bf16_dy_layer(rows, inputs, outputs)
    }

    /// The bf16 copy of the f32 activation `x` (a RoundBf16 node the first time). A
    /// reshaped view (each block's flatten of the field embeddings) gets the same reshape
    /// of its source's one copy, and a detached one the detach of it.
    fn bf16_copy(&mut self, x: Tensor) -> Tensor {
        if let Some(&c) = self.bf16_of.get(&x) {
            return c;
        }
        if self.dtype(x) == DType::Bf16 {
            // stored in bf16 already (Graph::mul_add_stored): its own copy
            return x;
        }
        // a view of another activation: the same view of its copy (a detached block's
        // output, DCNv2's cross network read by the top's first layer, so gets the copy
        // its last op writes in its pass instead of a RoundBf16 launch after the block)
        let producer = self.producer(x);
        let (src, view) = (producer.inputs.first().copied(), producer.op.clone());
        let is_view = match view {
            Op::Reshape => src.is_some_and(|t| self.shape(t).rank() >= 2),
            Op::Detach => true,
            _ => false,
        };
        if let (true, Some(src)) = (is_view, src) {
            let src_copy = self.bf16_copy(src);
            return self.add_copy_node(x, view, src_copy);
        }
        // an elementwise product, a concat or a linear layer writes the copy beside its
        // output in the same pass: a second output of its node (see Graph::copy_output)
        let pid = self.info(x).producer;
        let node = &self.nodes[pid.index()];
        let same_shapes = node.inputs.iter().all(|&t| self.shape(t) == self.shape(x));
        let fusable = node.outputs == [x]
            && node.phase == Phase::Forward
            && match node.op {
                Op::MulAdd | Op::Concat { .. } | Op::Linear { .. } => true,
                Op::Mul => same_shapes,
                _ => false,
            };
        if fusable {
            let c = Tensor(self.tensors.len() as u32);
            self.tensors.push(TensorInfo {
                shape: self.shape(x).clone(),
                dtype: DType::Bf16,
                producer: pid,
                name: format!("{}.bf16", self.name(x)),
            });
            self.nodes[pid.index()].outputs.push(c);
            self.bf16_of.insert(x, c);
            return c;
        }
        self.add_copy_node(x, Op::RoundBf16 { col_sums: false }, x)
    }

    /// A node `op(input)` that makes `x`'s bf16 copy (x's shape, named after it),
    /// remembered as that copy.
    fn add_copy_node(&mut self, x: Tensor, op: Op, input: Tensor) -> Tensor {
        let shape = self.shape(x).clone();
        let name = format!("{}.bf16", self.name(x));
        let out = OutSpec {
            shape,
            dtype: DType::Bf16,
        };
        let c = self.add_forward(op, vec![input], vec![out], name)[0];
        self.bf16_of.insert(x, c);
        c
    }

    pub fn float_dtype(&self) -> DType {
        self.float
    }

    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    pub fn node(&self, id: NodeId) -> &Node {
        &self.nodes[id.index()]
    }

    pub fn num_tensors(&self) -> usize {
        self.tensors.len()
    }

    pub fn info(&self, t: Tensor) -> &TensorInfo {
        &self.tensors[t.index()]
    }

    pub fn shape(&self, t: Tensor) -> &Shape {
        &self.tensors[t.index()].shape
    }

    pub fn dtype(&self, t: Tensor) -> DType {
        self.tensors[t.index()].dtype
    }

    pub fn name(&self, t: Tensor) -> &str {
        &self.tensors[t.index()].name
    }

    pub fn producer(&self, t: Tensor) -> &Node {
        &self.nodes[self.tensors[t.index()].producer.index()]
    }

    pub fn losses(&self) -> &[Loss] {
        &self.losses
    }

    /// Every tensor, in creation order.
    pub fn tensors(&self) -> impl Iterator<Item = Tensor> {
        (0..self.tensors.len() as u32).map(Tensor)
    }

    /// The leaf kind of `t`, if a leaf produces it.
    pub fn leaf(&self, t: Tensor) -> Option<&Leaf> {
        match &self.producer(t).op {
            Op::Leaf(l) => Some(l),
            _ => None,
        }
    }

    /// Parameters (trainable or not), in creation order.
    pub fn params(&self) -> Vec<Tensor> {
        self.tensors()
            .filter(|&t| matches!(self.leaf(t), Some(Leaf::Param { .. })))
            .collect()
    }

    pub fn inputs(&self) -> Vec<Tensor> {
        self.tensors()
            .filter(|&t| matches!(self.leaf(t), Some(Leaf::Input)))
            .collect()
    }

    /// True for tensors that live across steps (parameters and optimizer state).
    pub fn is_persistent(&self, t: Tensor) -> bool {
        matches!(self.leaf(t), Some(Leaf::Param { .. } | Leaf::State))
    }

    /// The persistent bf16 copy of parameter `p` that its optimizer update keeps
    /// ([`Leaf::ParamCopy`]), if it has one.
    pub fn param_copy(&self, p: Tensor) -> Option<Tensor> {
        if !matches!(self.leaf(p), Some(Leaf::Param { .. })) {
            return None;
        }
        self.tensors()
            .find(|&t| matches!(self.leaf(t), Some(Leaf::ParamCopy { of }) if *of == p))
    }

    /// Makes the bf16 copy of parameter `p` that a forward RoundBf16 node writes every
    /// step a persistent [`Leaf::ParamCopy`] instead, for `p`'s optimizer update to
    /// write: the node becomes the copy's leaf, and no launch of the step makes it. Its
    /// readers keep reading the same tensor. Returns the copy, or None where no such node
    /// makes one (a small layer reads the f32 weight).
    pub(crate) fn keep_param_copy(&mut self, p: Tensor) -> Option<Tensor> {
        let &c = self.bf16_of.get(&p)?;
        let id = self.info(c).producer;
        let node = &mut self.nodes[id.index()];
        let made_each_step = node.phase == Phase::Forward
            && matches!(node.op, Op::RoundBf16 { col_sums: false })
            && node.inputs == [p]
            && node.outputs == [c];
        if !made_each_step {
            return None;
        }
        node.op = Op::Leaf(Leaf::ParamCopy { of: p });
        node.inputs.clear();
        node.phase = Phase::Optimizer;
        Some(c)
    }

    /// Finds a tensor by its full name.
    pub fn find(&self, name: &str) -> Option<Tensor> {
        self.tensors().find(|&t| self.name(t) == name)
    }

    // ---- naming -----------------------------------------------------------------

    /// Runs `f` with `name` pushed on the scope stack: nodes made inside are named
    /// `name/...`.
    pub fn scoped<T>(&mut self, name: &str, f: impl FnOnce(&mut Graph) -> T) -> T {
        self.scope.push(name.to_string());
        let r = f(self);
        self.scope.pop();
        r
    }

    fn full_name(&self, base: &str) -> String {
        if self.scope.is_empty() {
            base.to_string()
        } else {
            format!("{}/{}", self.scope.join("/"), base)
        }
    }

    fn auto_name(&mut self, op: &str) -> String {
        let name = self.peek_name(op);
        *self.counters.entry(self.full_name(op)).or_insert(0) += 1;
        name
    }

    /// The name the next automatically named `op` node of the current scope will get:
    /// `scope/op0`, `scope/op1`, ...
    fn peek_name(&self, op: &str) -> String {
        let k = self.counters.get(&self.full_name(op)).copied().unwrap_or(0);
        self.full_name(&format!("{op}{k}"))
    }

    /// Gives the node that produces `t` (and `t` itself) a user-chosen name, scoped.
    pub fn set_name(&mut self, t: Tensor, name: &str) -> Tensor {
        let full = self.full_name(name);
        let producer = self.tensors[t.index()].producer;
        let node = &mut self.nodes[producer.index()];
        if node.outputs.len() == 1 {
            node.name = full.clone();
            self.tensors[t.index()].name = full;
        } else {
            let pos = node.outputs.iter().position(|&o| o == t).unwrap_or(0);
            self.tensors[t.index()].name = format!("{full}.{pos}");
            node.name = full;
        }
        t
    }

    // ---- node insertion -------------------------------------------------------------

    pub(crate) fn push_node(
        &mut self,
        op: Op,
        inputs: Vec<Tensor>,
        outs: Vec<OutSpec>,
        name: String,
        phase: Phase,
        origin: Option<NodeId>,
    ) -> (NodeId, Vec<Tensor>) {
        let id = NodeId(self.nodes.len() as u32);
        let multi = outs.len() > 1;
        let mut outputs = Vec::with_capacity(outs.len());
        for (i, o) in outs.into_iter().enumerate() {
            let t = Tensor(self.tensors.len() as u32);
            self.tensors.push(TensorInfo {
                shape: o.shape,
                dtype: o.dtype,
                producer: id,
                name: if multi {
                    format!("{name}.{i}")
                } else {
                    name.clone()
                },
            });
            outputs.push(t);
        }
        self.nodes.push(Node {
            id,
            op,
            inputs,
            outputs: outputs.clone(),
            updates: Vec::new(),
            name,
            phase,
            origin,
        });
        (id, outputs)
    }

    /// Appends an update node (an optimizer op that rewrites persistent tensors).
    pub(crate) fn push_update(
        &mut self,
        op: Op,
        inputs: Vec<Tensor>,
        updates: Vec<Tensor>,
        name: String,
    ) -> NodeId {
        let id = NodeId(self.nodes.len() as u32);
        self.nodes.push(Node {
            id,
            op,
            inputs,
            outputs: Vec::new(),
            updates,
            name,
            phase: Phase::Optimizer,
            origin: None,
        });
        id
    }

    fn add_forward(
        &mut self,
        op: Op,
        inputs: Vec<Tensor>,
        outs: Vec<OutSpec>,
        name: String,
    ) -> Vec<Tensor> {
        self.push_node(op, inputs, outs, name, Phase::Forward, None)
            .1
    }

    fn add1(&mut self, op: Op, inputs: Vec<Tensor>, shape: Shape, dtype: DType) -> Tensor {
        let name = self.auto_name(op.name());
        self.add_forward(op, inputs, vec![OutSpec { shape, dtype }], name)[0]
    }

    fn leaf_node(&mut self, name: &str, leaf: Leaf, shape: Shape, dtype: DType) -> Tensor {
        let full = self.full_name(name);
        self.add_forward(
            Op::Leaf(leaf),
            Vec::new(),
            vec![OutSpec { shape, dtype }],
            full,
        )[0]
    }

    // ---- checks -----------------------------------------------------------------------

    fn desc(&self, t: Tensor) -> String {
        let i = &self.tensors[t.index()];
        format!("'{}' {} {}", i.name, i.shape, i.dtype)
    }

    fn shape_err(&self, op: &'static str, detail: String) -> GraphError {
        GraphError::Shape {
            op,
            node: self.peek_name(op),
            detail,
        }
    }

    fn invalid(&self, op: &'static str, detail: String) -> GraphError {
        GraphError::Invalid {
            op,
            node: self.peek_name(op),
            detail,
        }
    }

    fn expect_float(&self, op: &'static str, ts: &[Tensor]) -> Result<DType> {
        let first = self.dtype(ts[0]);
        for &t in ts {
            let d = self.dtype(t);
            if d != self.float {
                return Err(GraphError::DType {
                    op,
                    node: self.peek_name(op),
                    detail: format!(
                        "operands must be of the graph's float type {}, got {}",
                        self.float,
                        ts.iter()
                            .map(|&t| self.desc(t))
                            .collect::<Vec<_>>()
                            .join(" and ")
                    ),
                });
            }
        }
        Ok(first)
    }

    /// A bf16 packed q, k, v: only in an f32 graph, of a sequence the fused kernels hold
    /// ([`Graph::linear_for_attention`] makes one). Returns the outputs' type, f32.
    fn expect_bf16_attention_input(&self, op: &'static str, qkv: Tensor) -> Result<DType> {
        let d = self.shape(qkv).dims();
        if self.float != DType::F32 || d.len() != 3 || d[1] > ATTENTION_BF16_MAX_SEQ {
            return Err(GraphError::DType {
                op,
                node: self.peek_name(op),
                detail: format!(
                    "a bf16 q, k, v ({}) needs an f32 graph and a sequence of at most {ATTENTION_BF16_MAX_SEQ}",
                    self.desc(qkv)
                ),
            });
        }
        Ok(DType::F32)
    }

    fn expect_dtype(&self, op: &'static str, t: Tensor, want: DType, role: &str) -> Result<()> {
        if self.dtype(t) != want {
            return Err(GraphError::DType {
                op,
                node: self.peek_name(op),
                detail: format!("{role} {} must be {want}", self.desc(t)),
            });
        }
        Ok(())
    }

    fn expect_rank(&self, op: &'static str, t: Tensor, rank: usize, role: &str) -> Result<()> {
        if self.shape(t).rank() != rank {
            return Err(
                self.shape_err(op, format!("{role} {} must have rank {rank}", self.desc(t)))
            );
        }
        Ok(())
    }

    // ---- leaves -------------------------------------------------------------------------

    /// An input fed each step.
    pub fn input(&mut self, name: &str, shape: &[usize], dtype: DType) -> Result<Tensor> {
        if shape.contains(&0) || Shape::new(shape).checked_numel().is_none() {
            return Err(GraphError::Invalid {
                op: "input",
                node: self.full_name(name),
                detail: format!(
                    "shape {} has a zero dimension or more elements than a machine holds",
                    Shape::new(shape)
                ),
            });
        }
        Ok(self.leaf_node(name, Leaf::Input, Shape::new(shape), dtype))
    }

    /// A trainable parameter of the graph's float type.
    pub fn param(&mut self, name: &str, shape: &[usize], init: Init) -> Result<Tensor> {
        self.param_with(name, shape, init, true)
    }

    pub fn param_with(
        &mut self,
        name: &str,
        shape: &[usize],
        init: Init,
        trainable: bool,
    ) -> Result<Tensor> {
        let Some(n) = Shape::new(shape).checked_numel() else {
            return Err(GraphError::Invalid {
                op: "param",
                node: self.full_name(name),
                detail: format!(
                    "shape {} has more elements than a machine holds",
                    Shape::new(shape)
                ),
            });
        };
        let full = self.full_name(name);
        if self.tensors.iter().zip(0u32..).any(|(i, k)| {
            i.name == full && matches!(self.leaf(Tensor(k)), Some(Leaf::Param { .. } | Leaf::State))
        }) {
            return Err(GraphError::Invalid {
                op: "param",
                node: full,
                detail: "a parameter of this name exists; parameters are saved by name, so each needs its own (use g.scoped)".to_string(),
            });
        }
        let bad = shape.contains(&0)
            || matches!(&init, Init::Values(v) if v.len() != n)
            || matches!(&init, Init::Tables { field_rows } if shape.first() != Some(&field_rows.iter().sum::<usize>()))
            || matches!(init, Init::Uniform { bound } if !(bound.is_finite() && bound >= 0.0))
            || matches!(init, Init::Normal { std } if !(std.is_finite() && std >= 0.0));
        if bad {
            return Err(GraphError::Invalid {
                op: "param",
                node: self.full_name(name),
                detail: format!("shape {} and init {init:?} do not fit", Shape::new(shape)),
            });
        }
        let float = self.float;
        Ok(self.leaf_node(
            name,
            Leaf::Param { init, trainable },
            Shape::new(shape),
            float,
        ))
    }

    /// Optimizer state: persistent, zero at start.
    pub fn state(&mut self, name: &str, shape: &[usize], dtype: DType) -> Tensor {
        let t = Tensor(self.tensors.len() as u32);
        let id = NodeId(self.nodes.len() as u32);
        self.tensors.push(TensorInfo {
            shape: Shape::new(shape),
            dtype,
            producer: id,
            name: name.to_string(),
        });
        self.nodes.push(Node {
            id,
            op: Op::Leaf(Leaf::State),
            inputs: Vec::new(),
            outputs: vec![t],
            updates: Vec::new(),
            name: name.to_string(),
            phase: Phase::Optimizer,
            origin: None,
        });
        t
    }

    /// A constant of the graph's float type.
    pub fn constant(&mut self, name: &str, shape: &[usize], values: Vec<f64>) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        if values.len() != n {
            return Err(GraphError::Invalid {
                op: "const",
                node: self.full_name(name),
                detail: format!(
                    "{} values for shape {} ({} elements)",
                    values.len(),
                    Shape::new(shape),
                    n
                ),
            });
        }
        let float = self.float;
        Ok(self.leaf_node(name, Leaf::Const(values), Shape::new(shape), float))
    }

    /// An integer constant (ids, offsets, class labels baked into the graph).
    pub fn constant_i32(&mut self, name: &str, shape: &[usize], values: &[i32]) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        if values.len() != n {
            return Err(GraphError::Invalid {
                op: "const",
                node: self.full_name(name),
                detail: format!(
                    "{} values for shape {} ({n} elements)",
                    values.len(),
                    Shape::new(shape)
                ),
            });
        }
        let v = values.iter().map(|&x| x as f64).collect();
        Ok(self.leaf_node(name, Leaf::Const(v), Shape::new(shape), DType::I32))
    }

    // ---- dense ops ------------------------------------------------------------------------

    /// A fully connected layer `x·wᵀ + b` with fresh parameters `{name}.weight` `[out, in]`
    /// (uniform ±1/sqrt(in)) and `{name}.bias` (zeros).
    pub fn linear(&mut self, x: Tensor, out: usize) -> Result<Tensor> {
        let (w, b) = self.linear_params(x, out)?;
        self.linear_with(x, w, Some(b))
    }

    /// [`Graph::linear`] whose output is stored as [`Graph::linear_stored_bf16`] stores it.
    pub fn linear_stored(&mut self, x: Tensor, out: usize) -> Result<Tensor> {
        let (w, b) = self.linear_params(x, out)?;
        self.linear_stored_bf16(x, w, Some(b))
    }

    /// A new linear layer's weight (uniform ±1/sqrt(K)) and bias (zeros), named after the
    /// node it will make.
    fn linear_params(&mut self, x: Tensor, out: usize) -> Result<(Tensor, Tensor)> {
        let k = self.shape(x).last();
        if out == 0 {
            return Err(self.invalid("linear", "zero output features".into()));
        }
        // linear_with/layer_norm_with below name the node with this same name
        let full = self.peek_name("linear");
        let base = full.rsplit('/').next().unwrap_or("linear").to_string();
        let bound = 1.0 / (k as f64).sqrt();
        let w = self.param(
            &format!("{base}.weight"),
            &[out, k],
            Init::Uniform { bound },
        )?;
        let b = self.param(&format!("{base}.bias"), &[out], Init::Zeros)?;
        Ok((w, b))
    }

    /// `relu(x·wᵀ + b)` with new parameters initialised as [`Graph::linear`]'s, the ReLU in
    /// the GEMM's epilogue (see [`Graph::linear_relu_with`]).
    pub fn linear_relu(&mut self, x: Tensor, out: usize) -> Result<Tensor> {
        let (w, b) = self.linear_params(x, out)?;
        self.linear_relu_with(x, w, Some(b))
    }

    /// `x·wᵀ (+ b)` with given parameters: x `[.., K]`, w `[N, K]`, b `[N]`.
    pub fn linear_with(&mut self, x: Tensor, w: Tensor, b: Option<Tensor>) -> Result<Tensor> {
        self.linear_op(x, w, b, false)
    }

    /// The packed q, k, v projection `x·wᵀ (+ b)` of [`Graph::attention_packed`] over `x`
    /// `[B, S, D]`. With bf16 copies on (an f32 graph, [`Graph::set_bf16_copies`]) for a
    /// layer of its FLOPs, a sequence of at most 64 and a layer too narrow for copies of
    /// its own operands (the attention gradient then writes dqkv in bf16 too), its
    /// output is stored in bf16: the attention reads it as it is and rounds q, k and v to
    /// bf16 anyway, so it computes the same values from half the bytes (the projection's
    /// store, and the attention's reads forward and backward). Otherwise this is
    /// [`Graph::linear_with`]. A bf16 output is for attention: other ops refuse it.
    pub fn linear_for_attention(
        &mut self,
        x: Tensor,
        w: Tensor,
        b: Option<Tensor>,
    ) -> Result<Tensor> {
        let (n, k, dt) = self.linear_checks(x, w, b)?;
        let xs = self.shape(x).clone();
        let short = xs.rank() == 3 && xs.dims()[1] <= ATTENTION_BF16_MAX_SEQ;
        if dt != DType::F32
            || !short
            || !self.bf16_dy_layer(xs.rows(), k, n)
            || self.bf16_layer(xs.rows(), k, n)
        {
            return self.linear_with(x, w, b);
        }
        let mut all = vec![x, w];
        all.extend(b);
        let out = vec![xs.dims()[0], xs.dims()[1], n];
        let op = Op::Linear {
            bias: b.is_some(),
            relu: false,
        };
        Ok(self.add1(op, all, Shape(out), DType::Bf16))
    }

    /// `x·wᵀ (+ b)` stored in bf16, as autocast stores a linear layer's output, where
    /// [`Graph::set_bf16_storage`] is on and the layer takes bf16 copies of its operands
    /// ([`Graph::set_bf16_copies`]); otherwise [`Graph::linear_with`]. For a factor of a cross update ([`Graph::mul_add`]'s `b`,
    /// which reads it in bf16): its GEMM stores half the bytes and the update reads half,
    /// forward and backward. The values are the f32 product rounded to nearest even.
    pub fn linear_stored_bf16(
        &mut self,
        x: Tensor,
        w: Tensor,
        b: Option<Tensor>,
    ) -> Result<Tensor> {
        let (n, k, _) = self.linear_checks(x, w, b)?;
        let xs = self.shape(x).clone();
        if !self.bf16_storage || !self.bf16_layer(xs.rows(), k, n) {
            return self.linear_with(x, w, b);
        }
        let mut all = vec![self.bf16_copy(x), self.bf16_copy(w)];
        all.extend(b);
        let mut out = xs.dims().to_vec();
        *out.last_mut().unwrap_or(&mut 0) = n;
        let op = Op::Linear {
            bias: b.is_some(),
            relu: false,
        };
        Ok(self.add1(op, all, Shape(out), DType::Bf16))
    }

    /// `relu(x·wᵀ (+ b))` as one op: the ReLU runs in the GEMM's epilogue (the same values
    /// as [`Graph::linear_with`] followed by [`Graph::relu`], one launch and one tensor fewer).
    pub fn linear_relu_with(&mut self, x: Tensor, w: Tensor, b: Option<Tensor>) -> Result<Tensor> {
        self.linear_op(x, w, b, true)
    }

    /// `x·wᵀ (+ b) + r` as one op (`Op::LinearAdd`): a residual connection around a linear
    /// layer, the sum in the GEMM's epilogue instead of a pass of its own. r has the
    /// output's shape. A layer large enough for bf16 operand copies
    /// ([`Graph::set_bf16_copies`]) is built as [`Graph::linear_with`] and [`Graph::add`]
    /// instead: the same values.
    pub fn linear_add_with(
        &mut self,
        x: Tensor,
        w: Tensor,
        b: Option<Tensor>,
        r: Tensor,
    ) -> Result<Tensor> {
        // the layer's own checks, on a Linear node not yet added
        let (n, k, dt) = self.linear_checks(x, w, b)?;
        if self.bf16_layer(self.shape(x).rows(), k, n) {
            let y = self.linear_with(x, w, b)?;
            return self.add(r, y);
        }
        let op = "linear_add";
        let mut d = self.shape(x).dims().to_vec();
        *d.last_mut().unwrap_or(&mut 0) = n;
        let y_shape = Shape(d);
        if self.dtype(r) != dt {
            return Err(self.invalid(
                op,
                format!(
                    "residual {} is not of input {}'s type",
                    self.desc(r),
                    self.desc(x)
                ),
            ));
        }
        if self.shape(r) != &y_shape {
            return Err(self.shape_err(
                op,
                format!(
                    "residual {} must have the layer's output shape {y_shape}",
                    self.desc(r)
                ),
            ));
        }
        let mut all = vec![x, w];
        all.extend(b);
        all.push(r);
        Ok(self.add1(Op::LinearAdd { bias: b.is_some() }, all, y_shape, dt))
    }

    /// The input checks of a linear layer: float operands, a matrix weight whose K is x's
    /// last dim, a bias of the weight's N. Returns (N, K) and the type.
    fn linear_checks(
        &self,
        x: Tensor,
        w: Tensor,
        b: Option<Tensor>,
    ) -> Result<(usize, usize, DType)> {
        let op = "linear";
        // an x stored in bf16 (Graph::mul_add_stored) in an f32 graph: read as the layer's
        // bf16 copy of x, by a layer large enough for copies (checked below)
        let x_bf16 = self.float == DType::F32 && self.dtype(x) == DType::Bf16;
        let mut all = if x_bf16 { vec![w] } else { vec![x, w] };
        all.extend(b);
        let dt = self.expect_float(op, &all)?;
        self.expect_rank(op, w, 2, "weight")?;
        let xs = self.shape(x).clone();
        if xs.rank() == 0 {
            return Err(self.shape_err(op, format!("input {} is a scalar", self.desc(x))));
        }
        let (n, k) = (self.shape(w).dims()[0], self.shape(w).dims()[1]);
        if xs.last() != k {
            return Err(self.shape_err(
                op,
                format!(
                    "input {} has {} features but weight {} expects {k}",
                    self.desc(x),
                    xs.last(),
                    self.desc(w)
                ),
            ));
        }
        if let Some(b) = b {
            if self.shape(b).dims() != [n] {
                return Err(self.shape_err(
                    op,
                    format!(
                        "bias {} must be [{n}] for weight {}",
                        self.desc(b),
                        self.desc(w)
                    ),
                ));
            }
        }
        if x_bf16 && !self.bf16_layer(xs.rows(), k, n) {
            return Err(self.invalid(
                op,
                format!(
                    "input {} is stored in bf16 (Graph::mul_add_stored), but a layer of {} rows, {k} inputs and {n} outputs reads f32 inputs (bf16 ones only with bf16 operand copies: rows, inputs and outputs multiples of 64 and at least 128); store the update that feeds it in f32",
                    self.desc(x),
                    xs.rows()
                ),
            ));
        }
        Ok((n, k, dt))
    }

    fn linear_op(&mut self, x: Tensor, w: Tensor, b: Option<Tensor>, relu: bool) -> Result<Tensor> {
        let (n, k, dt) = self.linear_checks(x, w, b)?;
        let xs = self.shape(x).clone();
        let mut all = vec![x, w];
        all.extend(b);
        let mut out = xs.dims().to_vec();
        *out.last_mut().unwrap_or(&mut 0) = n;
        let op = Op::Linear {
            bias: b.is_some(),
            relu,
        };
        if self.bf16_layer(xs.rows(), k, n) {
            all[0] = self.bf16_copy(x);
            all[1] = self.bf16_copy(w);
        }
        Ok(self.add1(op, all, Shape(out), dt))
    }

    /// Matrix product `a·b` of `[M, K]` and `[K, N]` (or with an equal leading batch dim).
    pub fn matmul(&mut self, a: Tensor, b: Tensor) -> Result<Tensor> {
        self.matmul_t(a, b, false, false)
    }

    /// `op(a)·op(b)`, where `op` transposes the last two dims when its flag is set.
    pub fn matmul_t(&mut self, a: Tensor, b: Tensor, ta: bool, tb: bool) -> Result<Tensor> {
        let op = "matmul";
        let dt = self.expect_float(op, &[a, b])?;
        let (sa, sb) = (self.shape(a).clone(), self.shape(b).clone());
        let ok_rank = (sa.rank() == 2 && sb.rank() == 2)
            || (sa.rank() == 3 && sb.rank() == 3 && sa.dims()[0] == sb.dims()[0]);
        if !ok_rank {
            return Err(self.shape_err(
                op,
                format!(
                    "operands {} and {} must both be matrices, or batches of matrices with the same batch size",
                    self.desc(a),
                    self.desc(b)
                ),
            ));
        }
        let r = sa.rank();
        let (m, ka) = if ta {
            (sa.dims()[r - 1], sa.dims()[r - 2])
        } else {
            (sa.dims()[r - 2], sa.dims()[r - 1])
        };
        let (kb, n) = if tb {
            (sb.dims()[r - 1], sb.dims()[r - 2])
        } else {
            (sb.dims()[r - 2], sb.dims()[r - 1])
        };
        if ka != kb {
            return Err(self.shape_err(
                op,
                format!(
                    "inner dimensions differ: {} (transposed: {ta}) gives K = {ka}, {} (transposed: {tb}) gives K = {kb}",
                    self.desc(a),
                    self.desc(b)
                ),
            ));
        }
        let out = if r == 3 {
            vec![sa.dims()[0], m, n]
        } else {
            vec![m, n]
        };
        Ok(self.add1(Op::MatMul { ta, tb }, vec![a, b], Shape(out), dt))
    }

    fn broadcast_binary(&mut self, op: Op, a: Tensor, b: Tensor) -> Result<Tensor> {
        let name = op.name();
        let dt = self.expect_float(name, &[a, b])?;
        let (sa, sb) = (self.shape(a).clone(), self.shape(b).clone());
        if !sa.ends_with(&sb) {
            return Err(self.shape_err(
                name,
                format!(
                    "{} cannot be broadcast to {}: the second operand's shape must equal the first's or its trailing dimensions",
                    self.desc(b),
                    self.desc(a)
                ),
            ));
        }
        Ok(self.add1(op, vec![a, b], sa, dt))
    }

    /// `a + b`, `b` broadcast over `a`'s leading dims.
    pub fn add(&mut self, a: Tensor, b: Tensor) -> Result<Tensor> {
        self.broadcast_binary(Op::Add, a, b)
    }

    /// `a ⊙ b`, `b` broadcast over `a`'s leading dims.
    pub fn mul(&mut self, a: Tensor, b: Tensor) -> Result<Tensor> {
        self.broadcast_binary(Op::Mul, a, b)
    }

    /// `a ⊙ b + c` in one op, for three tensors of one shape: the same values as
    /// `add(mul(a, b), c)` of one shape (the DCN cross update), one pass over memory
    /// instead of two and no intermediate. In an f32 graph `b` may be bf16 (a layer of
    /// [`Graph::linear_stored_bf16`]), read as its f32 values.
    pub fn mul_add(&mut self, a: Tensor, b: Tensor, c: Tensor) -> Result<Tensor> {
        let op = "mul_add";
        let dt = if self.float == DType::F32 && self.dtype(b) == DType::Bf16 {
            self.expect_float(op, &[a, c])?
        } else {
            self.expect_float(op, &[a, b, c])?
        };
        let s = self.one_shape(op, [a, b, c])?;
        Ok(self.add1(Op::MulAdd, vec![a, b, c], s, dt))
    }

    /// The shape of `a`, `b` and `c`, which must have one (the cross updates' operands).
    fn one_shape(&self, op: &'static str, [a, b, c]: [Tensor; 3]) -> Result<Shape> {
        let s = self.shape(a).clone();
        if self.shape(b) != &s || self.shape(c) != &s {
            return Err(self.shape_err(
                op,
                format!(
                    "{}, {} and {} must have one shape",
                    self.desc(a),
                    self.desc(b),
                    self.desc(c)
                ),
            ));
        }
        Ok(s)
    }

    /// The cross update `a ⊙ b + c` ([`Graph::mul_add`]) of a cross network stored in
    /// bf16, where [`Graph::set_bf16_cross`] is on and `b` is an up-projection stored in
    /// bf16 ([`Graph::linear_stored_bf16`]): `a` (x0) and `c` (the previous update, or x0)
    /// read from their bf16 copies, the ones the network's GEMMs read, and the update
    /// stored in bf16 (`store_bf16`: for an update that only the next layer reads, its
    /// GEMM and update) or in f32 (the network's output, for layers of any size).
    /// Otherwise [`Graph::mul_add`]. The values: the f32 update of the rounded operands,
    /// rounded to nearest even where stored in bf16.
    pub fn mul_add_stored(
        &mut self,
        a: Tensor,
        b: Tensor,
        c: Tensor,
        store_bf16: bool,
    ) -> Result<Tensor> {
        if !self.bf16_cross || self.float != DType::F32 || self.dtype(b) != DType::Bf16 {
            return self.mul_add(a, b, c);
        }
        let op = "mul_add";
        for t in [a, c] {
            if self.dtype(t) != DType::Bf16 {
                self.expect_float(op, &[t])?;
            }
        }
        let s = self.one_shape(op, [a, b, c])?;
        let (a, c) = (self.bf16_copy(a), self.bf16_copy(c));
        let dt = if store_bf16 { DType::Bf16 } else { DType::F32 };
        Ok(self.add1(Op::MulAdd, vec![a, b, c], s, dt))
    }

    pub fn scale(&mut self, x: Tensor, factor: f64) -> Result<Tensor> {
        let dt = self.expect_float("scale", &[x])?;
        let s = self.shape(x).clone();
        Ok(self.add1(Op::Scale { factor }, vec![x], s, dt))
    }

    fn unary(&mut self, op: Op, x: Tensor) -> Result<Tensor> {
        let dt = self.expect_float(op.name(), &[x])?;
        let s = self.shape(x).clone();
        Ok(self.add1(op, vec![x], s, dt))
    }

    pub fn relu(&mut self, x: Tensor) -> Result<Tensor> {
        self.unary(Op::Relu, x)
    }

    pub fn gelu(&mut self, x: Tensor) -> Result<Tensor> {
        self.unary(Op::Gelu, x)
    }

    /// SiLU (swish): `x · sigmoid(x)`.
    pub fn silu(&mut self, x: Tensor) -> Result<Tensor> {
        self.unary(Op::Silu, x)
    }

    pub fn sigmoid(&mut self, x: Tensor) -> Result<Tensor> {
        self.unary(Op::Sigmoid, x)
    }

    /// Identity forward; no gradient flows back through it.
    pub fn detach(&mut self, x: Tensor) -> Result<Tensor> {
        let s = self.shape(x).clone();
        let d = self.dtype(x);
        Ok(self.add1(Op::Detach, vec![x], s, d))
    }

    /// Element type conversion (e.g. to bf16 for GEMM operands and back).
    pub fn cast(&mut self, x: Tensor, to: DType) -> Result<Tensor> {
        let from = self.dtype(x);
        // bf16 copies; and f32 in an f64 reference graph (rounding to f32 and back)
        let ok = |d: DType| {
            d == self.float || d == DType::Bf16 || (self.float == DType::F64 && d == DType::F32)
        };
        if !ok(from) || !ok(to) {
            return Err(GraphError::DType {
                op: "cast",
                node: self.peek_name("cast"),
                detail: format!(
                    "casts go between the graph's float type {} and bf16, got {} to {to}",
                    self.float,
                    self.desc(x)
                ),
            });
        }
        let s = self.shape(x).clone();
        Ok(self.add1(Op::Cast { to }, vec![x], s, to))
    }

    /// Layer norm over the last dim with fresh `gamma` (ones) and `beta` (zeros).
    pub fn layer_norm(&mut self, x: Tensor) -> Result<Tensor> {
        let d = self.shape(x).last();
        // linear_with/layer_norm_with below name the node with this same name
        let full = self.peek_name("layer_norm");
        let base = full.rsplit('/').next().unwrap_or("layer_norm").to_string();
        let g = self.param(&format!("{base}.weight"), &[d], Init::Ones)?;
        let b = self.param(&format!("{base}.bias"), &[d], Init::Zeros)?;
        self.layer_norm_with(x, g, b, 1e-5)
    }

    pub fn layer_norm_with(
        &mut self,
        x: Tensor,
        gamma: Tensor,
        beta: Tensor,
        eps: f64,
    ) -> Result<Tensor> {
        let op = "layer_norm";
        let dt = self.expect_float(op, &[x, gamma, beta])?;
        let xs = self.shape(x).clone();
        let d = xs.last();
        if xs.rank() == 0 {
            return Err(self.shape_err(
                op,
                format!(
                    "{} is a scalar: layer norm normalises a last dimension",
                    self.desc(x)
                ),
            ));
        }
        if self.shape(gamma).dims() != [d] || self.shape(beta).dims() != [d] {
            return Err(self.shape_err(
                op,
                format!(
                    "gamma {} and beta {} must be [{d}] to normalise {}",
                    self.desc(gamma),
                    self.desc(beta),
                    self.desc(x)
                ),
            ));
        }
        if eps.is_nan() || eps <= 0.0 {
            return Err(self.invalid(op, format!("eps must be positive, got {eps}")));
        }
        let rows = Shape(xs.dims()[..xs.rank() - 1].to_vec());
        let name = self.auto_name(op);
        let outs = vec![
            OutSpec {
                shape: xs,
                dtype: dt,
            },
            OutSpec {
                shape: rows.clone(),
                dtype: dt,
            },
            OutSpec {
                shape: rows,
                dtype: dt,
            },
        ];
        Ok(self.add_forward(Op::LayerNorm { eps }, vec![x, gamma, beta], outs, name)[0])
    }

    // ---- shape ops ------------------------------------------------------------------

    pub fn reshape(&mut self, x: Tensor, shape: &[usize]) -> Result<Tensor> {
        let s = Shape::new(shape);
        if s.checked_numel() != Some(self.shape(x).numel()) {
            return Err(self.shape_err(
                "reshape",
                format!(
                    "{} has {} elements, the new shape {s} has {}",
                    self.desc(x),
                    self.shape(x).numel(),
                    s.checked_numel()
                        .map_or("more than a machine holds".to_string(), |n| n.to_string())
                ),
            ));
        }
        let d = self.dtype(x);
        Ok(self.add1(Op::Reshape, vec![x], s, d))
    }

    /// `[B, ...] -> [B, prod(...)]`.
    pub fn flatten(&mut self, x: Tensor) -> Result<Tensor> {
        let s = self.shape(x).clone();
        if s.rank() == 0 {
            return Err(
                self.shape_err("reshape", format!("cannot flatten scalar {}", self.desc(x)))
            );
        }
        let rest: usize = s.dims()[1..].iter().product();
        self.reshape(x, &[s.dims()[0], rest])
    }

    pub fn concat(&mut self, xs: &[Tensor], axis: usize) -> Result<Tensor> {
        let op = "concat";
        if xs.is_empty() {
            return Err(self.invalid(op, "nothing to concatenate".into()));
        }
        let dt = self.expect_float(op, xs)?;
        let first = self.shape(xs[0]).clone();
        if axis >= first.rank() {
            return Err(self.invalid(
                op,
                format!("axis {axis} out of range for {}", self.desc(xs[0])),
            ));
        }
        let mut out = first.dims().to_vec();
        out[axis] = 0;
        for &x in xs {
            let s = self.shape(x);
            let same_rest = s.rank() == first.rank()
                && (0..s.rank()).all(|i| i == axis || s.dims()[i] == first.dims()[i]);
            if !same_rest {
                return Err(self.shape_err(
                    op,
                    format!(
                        "{} and {} differ outside axis {axis}",
                        self.desc(xs[0]),
                        self.desc(x)
                    ),
                ));
            }
            out[axis] += s.dims()[axis];
        }
        Ok(self.add1(Op::Concat { axis }, xs.to_vec(), Shape(out), dt))
    }

    /// [`Graph::concat`] stored in bf16 alone, for a concat that only the layers of a cross
    /// network stored in bf16 read (DCNv2's x0: its GEMMs and updates read x0's bf16
    /// copy, nothing its f32 values): where [`Graph::set_bf16_x0`] is on, with bf16
    /// copies and the cross network in bf16 ([`Graph::set_bf16_cross`],
    /// [`Graph::set_bf16_storage`]), of f32 parts whose rows after `axis` are whole
    /// float4 units; otherwise [`Graph::concat`]. The values are the f32 concat's rounded
    /// to nearest even; a linear layer reading it must take bf16 copies (it refuses
    /// otherwise). The caller asks only where no op reads the f32 values.
    pub fn concat_stored(&mut self, xs: &[Tensor], axis: usize) -> Result<Tensor> {
        let y = self.concat(xs, axis)?;
        let on = self.bf16_x0
            && self.bf16_cross
            && self.bf16_storage
            && self.bf16_copies.is_some()
            && self.float == DType::F32;
        let whole_units = xs.iter().all(|&x| {
            let d = self.shape(x).dims();
            d[axis..].iter().product::<usize>() % 4 == 0
        });
        if on && whole_units {
            // the node just added: its one output stored in bf16
            self.tensors[y.index()].dtype = DType::Bf16;
        }
        Ok(y)
    }

    pub fn slice(&mut self, x: Tensor, axis: usize, start: usize, len: usize) -> Result<Tensor> {
        let s = self.shape(x).clone();
        if axis >= s.rank()
            || len == 0
            || start
                .checked_add(len)
                .is_none_or(|end| end > s.dims()[axis])
        {
            return Err(self.shape_err(
                "slice",
                format!(
                    "entries {start}..{} of axis {axis} do not fit in {}",
                    start.saturating_add(len),
                    self.desc(x)
                ),
            ));
        }
        let mut out = s.dims().to_vec();
        out[axis] = len;
        let d = self.dtype(x);
        Ok(self.add1(Op::Slice { axis, start, len }, vec![x], Shape(out), d))
    }

    /// DLRM dot interaction: `[B, F, D] -> [B, F(F-1)/2]`.
    pub fn pairwise_dot(&mut self, e: Tensor) -> Result<Tensor> {
        let dt = self.expect_float("pairwise_dot", &[e])?;
        self.expect_rank("pairwise_dot", e, 3, "input")?;
        let s = self.shape(e).dims().to_vec();
        if s[1] < 2 {
            return Err(self.shape_err(
                "pairwise_dot",
                format!("{} needs at least two fields", self.desc(e)),
            ));
        }
        let pairs = s[1] * (s[1] - 1) / 2;
        Ok(self.add1(Op::PairwiseDot, vec![e], Shape(vec![s[0], pairs]), dt))
    }

    /// Multi-head scaled dot-product attention over `[B, S, H·Dh]` tensors (one fused op).
    pub fn attention(
        &mut self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        heads: usize,
        causal: bool,
    ) -> Result<Tensor> {
        let op = "attention";
        let dt = self.expect_float(op, &[q, k, v])?;
        for (t, role) in [(q, "query"), (k, "key"), (v, "value")] {
            self.expect_rank(op, t, 3, role)?;
        }
        let qs = self.shape(q).clone();
        if self.shape(k) != &qs || self.shape(v) != &qs {
            return Err(self.shape_err(
                op,
                format!(
                    "query {}, key {} and value {} must have one shape",
                    self.desc(q),
                    self.desc(k),
                    self.desc(v)
                ),
            ));
        }
        if heads == 0 || !qs.dims()[2].is_multiple_of(heads) {
            return Err(self.invalid(
                op,
                format!("{heads} heads do not divide width {}", qs.dims()[2]),
            ));
        }
        let (b, s) = (qs.dims()[0], qs.dims()[1]);
        let name = self.auto_name(op);
        let outs = vec![
            OutSpec {
                shape: qs,
                dtype: dt,
            },
            OutSpec {
                shape: Shape(vec![b, heads, s]),
                dtype: dt,
            },
        ];
        let op = Op::Attention {
            heads,
            causal,
            packed: false,
        };
        Ok(self.add_forward(op, vec![q, k, v], outs, name)[0])
    }

    /// [`Graph::attention`] over one `[B, S, 3·H·Dh]` tensor holding q, k and v side by side
    /// in its last dim, as a fused QKV projection makes it: the same result as slicing it
    /// into three, without the slices, and its gradient is one tensor of `qkv`'s shape.
    pub fn attention_packed(&mut self, qkv: Tensor, heads: usize, causal: bool) -> Result<Tensor> {
        let op = "attention";
        // a bf16 qkv (Graph::linear_for_attention): the outputs in the graph's f32
        let dt = match self.dtype(qkv) {
            DType::Bf16 => self.expect_bf16_attention_input(op, qkv)?,
            _ => self.expect_float(op, &[qkv])?,
        };
        self.expect_rank(op, qkv, 3, "packed q, k, v")?;
        let d = self.shape(qkv).dims().to_vec();
        if !d[2].is_multiple_of(3) {
            return Err(self.shape_err(
                op,
                format!(
                    "packed q, k, v {} has a last dim that is not 3 widths",
                    self.desc(qkv)
                ),
            ));
        }
        let w = d[2] / 3;
        if heads == 0 || !w.is_multiple_of(heads) {
            return Err(self.invalid(op, format!("{heads} heads do not divide width {w}")));
        }
        let name = self.auto_name(op);
        let outs = vec![
            OutSpec {
                shape: Shape(vec![d[0], d[1], w]),
                dtype: dt,
            },
            OutSpec {
                shape: Shape(vec![d[0], heads, d[1]]),
                dtype: dt,
            },
        ];
        let op = Op::Attention {
            heads,
            causal,
            packed: true,
        };
        Ok(self.add_forward(op, vec![qkv], outs, name)[0])
    }

    /// One parameter holding several embedding tables, `[Σ rows, dim]`, uniform
    /// ±1/sqrt(rows) per table as the spec asks (so tables of one size share a bound).
    pub fn embedding_tables(
        &mut self,
        name: &str,
        field_rows: &[usize],
        dim: usize,
    ) -> Result<Tensor> {
        if field_rows.is_empty() || field_rows.contains(&0) || dim == 0 {
            return Err(GraphError::Invalid {
                op: "param",
                node: self.full_name(name),
                detail: format!("tables of rows {field_rows:?} and dim {dim}"),
            });
        }
        let total: usize = field_rows.iter().sum();
        let init = Init::Tables {
            field_rows: field_rows.to_vec(),
        };
        self.param(name, &[total, dim], init)
    }

    /// Sum-pooled embedding bags: `table [Σ rows, D]`, `ids` i32 `[nnz]` (local rows of
    /// each field's table), `offsets` i32 `[B·F + 1]`, giving `[B, F, D]`.
    /// Mean pooling of the bags of the fields with `mean[f]` (see [`Op::BagMean`]): `y` is
    /// the `[B, F, D]` output of [`Graph::embedding_bag`] over the same `ids` and `offsets`.
    pub fn bag_mean(
        &mut self,
        y: Tensor,
        ids: Tensor,
        offsets: Tensor,
        mean: &[bool],
    ) -> Result<Tensor> {
        let op = "bag_mean";
        let dt = self.expect_float(op, &[y])?;
        self.expect_dtype(op, ids, DType::I32, "ids")?;
        self.expect_dtype(op, offsets, DType::I32, "offsets")?;
        self.expect_rank(op, y, 3, "y")?;
        let dims = self.shape(y).dims().to_vec();
        let (b, f) = (dims[0], dims[1]);
        if f != mean.len() || self.shape(offsets).numel() != b * f + 1 {
            return Err(self.shape_err(
                op,
                format!(
                    "y {} must be [B, F, D] with F = {} fields and offsets {} B·F + 1 entries",
                    self.desc(y),
                    mean.len(),
                    self.desc(offsets)
                ),
            ));
        }
        let s = self.shape(y).clone();
        Ok(self.add1(
            Op::BagMean {
                mean: mean.to_vec(),
            },
            vec![y, ids, offsets],
            s,
            dt,
        ))
    }

    pub fn embedding_bag(
        &mut self,
        table: Tensor,
        ids: Tensor,
        offsets: Tensor,
        field_rows: &[usize],
    ) -> Result<Tensor> {
        let op = "embedding_bag";
        let dt = self.expect_float(op, &[table])?;
        self.expect_dtype(op, ids, DType::I32, "ids")?;
        self.expect_dtype(op, offsets, DType::I32, "offsets")?;
        self.expect_rank(op, table, 2, "table")?;
        self.expect_rank(op, ids, 1, "ids")?;
        self.expect_rank(op, offsets, 1, "offsets")?;
        let f = field_rows.len();
        let total: usize = field_rows.iter().sum();
        if f == 0 || self.shape(table).dims()[0] != total {
            return Err(self.shape_err(
                op,
                format!(
                    "table {} must have Σ rows = {total} rows for {f} tables of rows {field_rows:?}",
                    self.desc(table)
                ),
            ));
        }
        let n_off = self.shape(offsets).dims()[0];
        if n_off < 2 || !(n_off - 1).is_multiple_of(f) {
            return Err(self.shape_err(
                op,
                format!(
                    "offsets {} must hold B·{f} + 1 entries (one bag per example and field, plus the end)",
                    self.desc(offsets)
                ),
            ));
        }
        let b = (n_off - 1) / f;
        let d = self.shape(table).dims()[1];
        Ok(self.add1(
            Op::EmbeddingBag {
                field_rows: field_rows.to_vec(),
            },
            vec![table, ids, offsets],
            Shape(vec![b, f, d]),
            dt,
        ))
    }

    // ---- losses and reductions ------------------------------------------------------

    /// Mean binary cross-entropy of `logit` against `label` (same number of elements).
    pub fn bce_with_logits(&mut self, logit: Tensor, label: Tensor) -> Result<Tensor> {
        let op = "bce_with_logits";
        let dt = self.expect_float(op, &[logit, label])?;
        let (a, b) = (self.shape(logit).clone(), self.shape(label).clone());
        if a.numel() != b.numel() || a.rows() * a.last() != b.numel() || a.numel() == 0 {
            return Err(self.shape_err(
                op,
                format!(
                    "logit {} and label {} differ in size",
                    self.desc(logit),
                    self.desc(label)
                ),
            ));
        }
        Ok(self.add1(Op::BceWithLogits, vec![logit, label], Shape::scalar(), dt))
    }

    /// Mean softmax cross-entropy of `logits [N, C]` against i32 class `labels [N]`.
    pub fn softmax_cross_entropy(&mut self, logits: Tensor, labels: Tensor) -> Result<Tensor> {
        let op = "softmax_cross_entropy";
        let dt = self.expect_float(op, &[logits])?;
        self.expect_dtype(op, labels, DType::I32, "labels")?;
        self.expect_rank(op, logits, 2, "logits")?;
        let n = self.shape(logits).dims()[0];
        if self.shape(labels).dims() != [n] {
            return Err(self.shape_err(
                op,
                format!(
                    "labels {} must be [{n}] for logits {}",
                    self.desc(labels),
                    self.desc(logits)
                ),
            ));
        }
        Ok(self.add1(
            Op::SoftmaxCrossEntropy,
            vec![logits, labels],
            Shape::scalar(),
            dt,
        ))
    }

    pub fn sum(&mut self, x: Tensor) -> Result<Tensor> {
        let dt = self.expect_float("sum", &[x])?;
        Ok(self.add1(Op::Sum, vec![x], Shape::scalar(), dt))
    }

    pub fn mean(&mut self, x: Tensor) -> Result<Tensor> {
        let dt = self.expect_float("mean", &[x])?;
        Ok(self.add1(Op::Mean, vec![x], Shape::scalar(), dt))
    }

    /// Registers `l` as a loss term with weight `weight`: the step minimises
    /// `Σ weight · l` over all registered terms.
    pub fn loss(&mut self, l: Tensor, weight: f64) -> Result<()> {
        if !self.shape(l).is_scalar_like() {
            return Err(GraphError::LossNotScalar {
                node: self.name(l).to_string(),
                shape: self.shape(l).to_string(),
            });
        }
        if !self.dtype(l).is_float() || !weight.is_finite() {
            return Err(GraphError::Invalid {
                op: "loss",
                node: self.name(l).to_string(),
                detail: format!(
                    "a loss must be a float scalar with a finite weight (weight {weight})"
                ),
            });
        }
        self.losses.push(Loss { tensor: l, weight });
        Ok(())
    }

    /// Adds a node made by a transformation (autodiff): checked by construction.
    pub(crate) fn add_derived(
        &mut self,
        op: Op,
        inputs: Vec<Tensor>,
        outs: Vec<(Shape, DType)>,
        name: String,
        phase: Phase,
        origin: Option<NodeId>,
    ) -> Vec<Tensor> {
        let outs = outs
            .into_iter()
            .map(|(shape, dtype)| OutSpec { shape, dtype })
            .collect();
        self.push_node(op, inputs, outs, name, phase, origin).1
    }

    /// The seed of a loss's gradient: a backward leaf whose origin is the loss's node, so
    /// the partition treats it as existing once the loss does.
    pub(crate) fn add_seed(
        &mut self,
        name: String,
        value: f64,
        dtype: DType,
        loss: NodeId,
    ) -> Tensor {
        self.push_node(
            Op::Leaf(Leaf::Const(vec![value])),
            Vec::new(),
            vec![OutSpec {
                shape: Shape::scalar(),
                dtype,
            }],
            name,
            Phase::Backward,
            Some(loss),
        )
        .1[0]
    }

    /// Fuses each forward `Linear` (no ReLU, one output) with the `MulAdd` that reads its
    /// output as its `b` into one `LinearMulAdd` node at the linear's place (see
    /// [`crate::fuse_cross_updates`]). Returns, for every node before the fusion, its id
    /// after (a removed `MulAdd`'s: the fused node's), and how many pairs were fused.
    pub(crate) fn fuse_linear_mul_adds(&mut self) -> (Vec<NodeId>, usize) {
        let mut pairs: Vec<(usize, usize)> = Vec::new();
        for (mi, m) in self.nodes.iter().enumerate() {
            if m.op != Op::MulAdd || m.phase != Phase::Forward || m.inputs.len() != 3 {
                continue;
            }
            let (a, y, c) = (m.inputs[0], m.inputs[1], m.inputs[2]);
            let li = self.tensors[y.index()].producer.index();
            let l = &self.nodes[li];
            let fusable = matches!(l.op, Op::Linear { relu: false, .. })
                && l.phase == Phase::Forward
                && l.outputs == [y]
                && a != y
                && c != y
                && self.shape(a) == self.shape(y)
                && self.shape(c) == self.shape(y)
                && self.dtype(a) == DType::F32
                && self.dtype(c) == DType::F32
                // the fused node, at the linear's place, reads a and c: made before it
                && self.tensors[a.index()].producer.index() < li
                && self.tensors[c.index()].producer.index() < li
                && !pairs.iter().any(|&(l2, _)| l2 == li);
            if fusable {
                pairs.push((li, mi));
            }
        }
        let n = self.nodes.len();
        if pairs.is_empty() {
            return ((0..n as u32).map(NodeId).collect(), 0);
        }
        let dropped: std::collections::BTreeMap<usize, usize> =
            pairs.iter().map(|&(l, m)| (m, l)).collect();
        for &(li, mi) in &pairs {
            let m = self.nodes[mi].clone();
            let l = &mut self.nodes[li];
            let Op::Linear { bias, .. } = l.op else {
                continue;
            };
            let short = m.name.rsplit('/').next().unwrap_or(&m.name).to_string();
            l.op = Op::LinearMulAdd { bias };
            l.inputs.extend([m.inputs[0], m.inputs[2]]);
            l.outputs.extend(m.outputs.iter().copied());
            l.name = format!("{}+{short}", l.name);
        }
        // new ids: nodes after a removed one move down; a removed one maps to its linear
        let mut remap = Vec::with_capacity(n);
        let mut removed_before = 0u32;
        for i in 0..n {
            if dropped.contains_key(&i) {
                remap.push(NodeId(u32::MAX));
                removed_before += 1;
            } else {
                remap.push(NodeId(i as u32 - removed_before));
            }
        }
        for (&m, &l) in &dropped {
            remap[m] = remap[l];
        }
        let old = std::mem::take(&mut self.nodes);
        for (i, mut node) in old.into_iter().enumerate() {
            if dropped.contains_key(&i) {
                continue;
            }
            node.id = remap[i];
            node.origin = node.origin.map(|o| remap[o.index()]);
            self.nodes.push(node);
        }
        for t in &mut self.tensors {
            t.producer = remap[t.producer.index()];
        }
        (remap, pairs.len())
    }
}
