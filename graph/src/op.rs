//! The operations of the graph. One enum holds forward ops, the backward ops that
//! autodiff appends, and the optimizer updates, so that a whole training step is one
//! graph that can be partitioned, planned and scheduled as a unit.

use crate::dtype::DType;

/// How a parameter is initialised. Initialisation is deterministic from the runtime's
/// seed and the parameter's index.
#[derive(Clone, Debug, PartialEq)]
pub enum Init {
    Zeros,
    Ones,
    /// Uniform in `[-bound, bound]`.
    Uniform {
        bound: f64,
    },
    /// Normal with mean 0.
    Normal {
        std: f64,
    },
    /// Explicit values, row-major (length must match the shape).
    Values(Vec<f64>),
    /// Several embedding tables stacked in one `[Σ rows, D]` parameter: the rows of the
    /// table with `rows` rows are uniform in `±1/sqrt(rows)`.
    Tables {
        field_rows: Vec<usize>,
    },
}

/// The role of a leaf tensor.
#[derive(Clone, Debug, PartialEq)]
pub enum Leaf {
    /// Fed by the user every step.
    Input,
    /// A model parameter, persistent across steps.
    Param { init: Init, trainable: bool },
    /// Optimizer state (moments, accumulators, step counts), persistent, zero at start.
    State,
    /// A constant, stored in the graph.
    Const(Vec<f64>),
    /// The bf16 copy (nearest even) of the parameter `of`, persistent: the parameter's
    /// optimizer update writes it beside the parameter, and the runtimes make it from
    /// the parameter at start and whenever the parameter is set (a checkpoint loaded,
    /// say). Not checkpointed: it is the parameter's value, rounded.
    ParamCopy { of: crate::graph::Tensor },
}

/// An operation. Inputs and outputs are listed on the node; the comments give their order.
#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    /// A leaf: no inputs, one output.
    Leaf(Leaf),

    // ---- forward ops --------------------------------------------------------------
    /// `[x, w, b?] -> [y]`: `y = x·wᵀ (+ b)`, x `[.., K]`, w `[N, K]`, b `[N]`; with `relu`,
    /// `y = max(x·wᵀ (+ b), 0)` (the activation in the GEMM's epilogue, no second pass).
    Linear {
        bias: bool,
        relu: bool,
    },
    /// `[x, w, b?, r] -> [y]`: `y = (x·wᵀ (+ b)) + r`, r of y's shape: a linear layer and
    /// the residual added to its output, rounded as `Linear` then `Add` (the sum in the
    /// GEMM's epilogue where the kernel can, no pass of its own over y).
    LinearAdd {
        bias: bool,
    },
    /// `[x, w, b?, a, c] -> [y, z (, bf16(z))]`: `y = x·wᵀ (+ b)` and `z = a ⊙ y + c`, a, c
    /// and z of y's shape: a `Linear` and the `MulAdd` that reads its output as `b` (the DCN
    /// cross update), in one node, rounded as the two (`y` stored as the `Linear` stored it,
    /// f32 or bf16, and `z` computed from the stored `y`). Made from the two nodes by
    /// [`crate::fuse_cross_updates`] after autodiff, so that the GEMM's epilogue computes the
    /// update; no model builds it, and autodiff never sees it.
    LinearMulAdd {
        bias: bool,
    },
    /// `[a, b] -> [c]`: matrix product of the last two dims (optional equal leading batch
    /// dim), `op(a)·op(b)` where `op` transposes when its flag is set.
    MatMul {
        ta: bool,
        tb: bool,
    },
    /// `[a, b] -> [c]`: elementwise sum; `b`'s shape is `a`'s or a suffix of it (broadcast
    /// over the leading dims, e.g. over the batch).
    Add,
    /// `[a, b] -> [c]`: elementwise product, broadcasting as `Add`.
    Mul,
    /// `[a, b, c] -> [y]`: `y = a ⊙ b + c` of three tensors of one shape, rounded as `Mul`
    /// then `Add` (the DCN cross update `x0 ⊙ up + x` in one pass).
    MulAdd,
    /// `[x] -> [y]`: `y = x · factor`.
    Scale {
        factor: f64,
    },
    Relu,
    /// tanh approximation of GELU (as GPT-2 and PyTorch's `approximate="tanh"`).
    Gelu,
    Sigmoid,
    /// `[x] -> [y]`: SiLU (swish), `y = x · sigmoid(x)`.
    Silu,
    /// `[x, gamma, beta] -> [y, mean, rstd]`: normalises the last dim.
    LayerNorm {
        eps: f64,
    },
    /// `[x] -> [y]`: same elements, new shape.
    Reshape,
    /// `[x1, x2, ..] -> [y]`: concatenation along `axis`.
    Concat {
        axis: usize,
    },
    /// `[x] -> [y]`: `len` entries of `axis` starting at `start`.
    Slice {
        axis: usize,
        start: usize,
        len: usize,
    },
    /// `[x] -> [y_0, y_1, ..]`: `x` cut along `axis` into consecutive parts of `sizes`
    /// entries (the gradient of `Concat`: every part in one pass).
    Split {
        axis: usize,
        sizes: Vec<usize>,
    },
    /// `[e] -> [y]`: DLRM interaction, `e [B, F, D]` to the `F(F-1)/2` dots `<e_i, e_j>`,
    /// `i < j`, row-major upper triangle.
    PairwiseDot,
    /// `[q, k, v] -> [o, lse]`: multi-head scaled dot-product attention over `[B, S, H·Dh]`
    /// tensors; `lse [B, H, S]` is the log-sum-exp of each softmax row, kept for backward.
    /// `packed`: one input `[qkv] -> [o, lse]`, `qkv [B, S, 3·H·Dh]` holding q, k and v side
    /// by side in its last dim (a QKV projection's output, read in place: no slices, and the
    /// backward writes one `dqkv` instead of three gradients padded and summed).
    Attention {
        heads: usize,
        causal: bool,
        packed: bool,
    },
    /// `[table, ids, offsets] -> [y]`: sum-pooled bags over several tables stored as one
    /// `[Σ rows, D]` parameter. `ids` (i32) are rows local to their field's table; bag `b`
    /// of field `f` is `offsets[b·F + f] .. offsets[b·F + f + 1]`; `y` is `[B, F, D]`.
    EmbeddingBag {
        field_rows: Vec<usize>,
    },
    /// `[y, ids, offsets] -> [z]`: the mean pooling of bags that `EmbeddingBag` summed.
    /// `y` is `[B, F, D]` (its bags in the layout of `ids` and `offsets`); bag `b` of a
    /// field `f` with `mean[f]` is divided by its count of ids (padding ids, -1, not
    /// counted; an empty bag stays 0), the other fields' bags pass through. Its gradient
    /// is the same op on `dz`: a diagonal scaling.
    BagMean {
        mean: Vec<bool>,
    },
    /// `[logit, label] -> [loss]`: mean binary cross-entropy with logits.
    BceWithLogits,
    /// `[logits, labels] -> [loss]`: mean softmax cross-entropy, labels are i32 classes.
    SoftmaxCrossEntropy,
    /// `[x] -> [s]`: sum of all elements.
    Sum,
    /// `[x] -> [s]`: mean of all elements.
    Mean,
    /// `[x] -> [y]`: identity forward; autodiff emits no gradient edge through it.
    Detach,
    /// `[x] -> [y]`: element type conversion.
    Cast {
        to: DType,
    },
    /// `[x] -> [xb]`: x (f32, at least 2-D) rounded to bf16 (nearest even), the same shape:
    /// the one rounding of a GEMM operand that several GEMMs read (a layer's input for its
    /// forward and weight gradient, a layer's dy for its data and weight gradients; see
    /// `Graph::set_bf16_copies`). With `col_sums`, `[x] -> [xb, s]`, `s` the f32 sums of x
    /// over its rows (as `SumToShape` to the last dim: the bias gradient when x is a dy).
    /// The gradient passes through unchanged.
    RoundBf16 {
        col_sums: bool,
    },

    // ---- backward ops (appended by autodiff) --------------------------------------
    /// `[dy, w] -> [dx]`: `dx = dy·w` over the rows of `dy` (the data gradient of `Linear`).
    /// With `relu_mask`, `[dy, w, y] -> [dx]` with `dx = (dy·w) ⊙ (y > 0)`: the gradient
    /// carried on through the ReLU that made `y` (a `Relu`'s or a `Linear { relu: true
    /// }`'s output), `ReluGrad` folded into the product's epilogue. A second output
    /// `[.., dx_bf16]` (bf16) is dx's bf16 copy from the same pass: dx is the whole dy of a
    /// linear layer below with bf16 operand copies (`Graph::set_bf16_copies`), whose GEMMs
    /// read the copy. With `residual`, a last input `r` of dx's shape: `dx = dy·w (⊙ mask) +
    /// r`, rounded as the product then `Add`: x's whole gradient when the product and `r`
    /// are its only two contributions (their `GradSum`, summed in the GEMM's epilogue where
    /// the kernel can, no pass of its own over the three tensors).
    LinearGradInput {
        relu_mask: bool,
        residual: bool,
    },
    /// `[dy, x] -> [dw]`: `dw = dyᵀ·x` summed over all rows (the weight gradient); with
    /// `bias`, `[dy, x] -> [dw, db]`, `db` the column sums of `dy` (as `SumToShape` gives
    /// them) from the same pass over `dy`.
    LinearGradWeight {
        bias: bool,
    },
    /// `[dy, y] -> [dx]`
    ReluGrad,
    /// `[dy, x] -> [dx]`
    GeluGrad,
    /// `[dy, x] -> [dx]`: `dx = dy · s · (1 + x · (1 - s))`, `s = sigmoid(x)`.
    SiluGrad,
    /// `[dy, a, b] -> [da, db]`: `da = dy ⊙ b`, `db = dy ⊙ a` (the gradient of a product of
    /// two tensors of one shape, in one pass). With a bf16 output 1, `[da, db_bf16]` or
    /// `[da, db_bf16, s]`: db is the dy of a linear layer with bf16 operand copies, written
    /// only as its bf16 copy, and `s` its column sums (the layer's bias gradient). With
    /// `plus_dy`, `da = dy ⊙ b + dy`: the gradient of `a ⊙ b + a` (a cross network's first
    /// update, its x0 read once for both), a's two contributions in one tensor.
    MulGrad {
        plus_dy: bool,
    },
    /// `[dy, y] -> [dx]`
    SigmoidGrad,
    /// `[dy, x, gamma, mean, rstd] -> [dx, dgamma, dbeta]`
    LayerNormGrad,
    /// `[dy] -> [dx]`: sums `dy` over its leading dims down to the output shape (the
    /// gradient of a broadcast operand, or of a bias).
    SumToShape,
    /// `[dy] -> [dx]`: writes `dy` into `len` entries of `axis` at `start` of a zero
    /// tensor whose `axis` has `full` entries (the gradient of `Slice`).
    Pad {
        axis: usize,
        start: usize,
        full: usize,
    },
    /// `[dy, e] -> [de]`
    PairwiseDotGrad,
    /// `[do, q, k, v, o, lse] -> [dq, dk, dv]`; `packed`: `[do, qkv, o, lse] -> [dqkv]`.
    AttentionGrad {
        heads: usize,
        causal: bool,
        packed: bool,
    },
    /// `[dy, ids, offsets] -> [dtable]`: the dense table gradient of `EmbeddingBag`
    /// (a scatter in a fixed order). Training uses the sparse form instead: the pooled
    /// gradient with the ids, consumed by the row-wise optimizer.
    EmbeddingBagGradDense {
        field_rows: Vec<usize>,
    },
    /// `[ids, offsets] -> [rows, bags]` (i32, one entry per id): every occurrence's global
    /// table row and its bag, sorted by row, stably (id order within a row). It needs only
    /// the batch's ids, so the row-wise update's sort can run at the start of the step
    /// instead of at its end.
    EmbeddingSort {
        field_rows: Vec<usize>,
    },
    /// `[dloss, logit, label] -> [dlogit]`
    BceWithLogitsGrad,
    /// `[dloss, logits, labels] -> [dlogits]`
    SoftmaxCrossEntropyGrad,
    /// `[ds] -> [dx]`: fills the shape with `ds · scale` (the gradient of `Sum`/`Mean`).
    Broadcast {
        scale: f64,
    },
    /// `[g1, g2, ..] -> [g]`: the sum of several gradient contributions, in input order
    /// (autodiff orders them by the id of the node that made them).
    GradSum,
    /// `[g1, g2, ..] -> [y]`: `len` entries of `axis` from `start` of the sum of several
    /// gradient contributions, summed in input order: `Slice(GradSum(g..))` in one pass
    /// that reads only the window (a concat input's gradient when its output has several
    /// consumers).
    SliceSum {
        axis: usize,
        start: usize,
        len: usize,
    },

    // ---- optimizer updates (update persistent tensors in place) -------------------
    /// `updates [step]`: `step += 1` (an i32 scalar). Kept separate from the update itself
    /// so the step count lives in device memory and changes inside a captured graph.
    StepIncrement,
    /// `inputs [g..]`, `updates [p..]`: `p -= lr · g`.
    Sgd {
        lr: f64,
    },
    /// `inputs [step, g1..gn]`, `updates [p1..pn, m1..mn, v1..vn, c1..ck]`: Adam with
    /// bias correction, over all dense parameters in one op; `ci` (k <= n) is the bf16
    /// copy of `pi` ([`Leaf::ParamCopy`]), written from the updated `pi`.
    Adam {
        lr: f64,
        beta1: f64,
        beta2: f64,
        eps: f64,
    },
    /// `inputs [ids, offsets, dpooled]`, `updates [table, acc]`: row-wise Adagrad on the rows
    /// the batch touches: for each row, `g` is the sum of its gradient over all occurrences
    /// (in a fixed order), `acc += mean(g²)`, `w -= lr · g / (sqrt(acc) + eps)`. With
    /// `inputs [ids, offsets, dpooled, rows, bags]` the occurrences come sorted by an
    /// `EmbeddingSort` of the same ids (same bits, no sort of its own).
    RowwiseAdagrad {
        lr: f64,
        eps: f64,
        field_rows: Vec<usize>,
    },
}

impl Op {
    /// A short lower-case name, used in labels and error messages.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Leaf(Leaf::Input) => "input",
            Op::Leaf(Leaf::Param { .. }) => "param",
            Op::Leaf(Leaf::State) => "state",
            Op::Leaf(Leaf::Const(_)) => "const",
            Op::Leaf(Leaf::ParamCopy { .. }) => "param_copy",
            Op::Linear { .. } => "linear",
            Op::LinearAdd { .. } => "linear_add",
            Op::LinearMulAdd { .. } => "linear_mul_add",
            Op::MatMul { .. } => "matmul",
            Op::Add => "add",
            Op::Mul => "mul",
            Op::MulAdd => "mul_add",
            Op::Scale { .. } => "scale",
            Op::Relu => "relu",
            Op::Gelu => "gelu",
            Op::Silu => "silu",
            Op::Sigmoid => "sigmoid",
            Op::LayerNorm { .. } => "layer_norm",
            Op::Reshape => "reshape",
            Op::Concat { .. } => "concat",
            Op::Slice { .. } => "slice",
            Op::Split { .. } => "split",
            Op::PairwiseDot => "pairwise_dot",
            Op::Attention { .. } => "attention",
            Op::EmbeddingBag { .. } => "embedding_bag",
            Op::BagMean { .. } => "bag_mean",
            Op::BceWithLogits => "bce_with_logits",
            Op::SoftmaxCrossEntropy => "softmax_cross_entropy",
            Op::Sum => "sum",
            Op::Mean => "mean",
            Op::Detach => "detach",
            Op::Cast { .. } => "cast",
            Op::RoundBf16 { .. } => "round_bf16",
            Op::LinearGradInput { .. } => "linear_grad_input",
            Op::LinearGradWeight { .. } => "linear_grad_weight",
            Op::ReluGrad => "relu_grad",
            Op::GeluGrad => "gelu_grad",
            Op::SiluGrad => "silu_grad",
            Op::MulGrad { .. } => "mul_grad",
            Op::SigmoidGrad => "sigmoid_grad",
            Op::LayerNormGrad => "layer_norm_grad",
            Op::SumToShape => "sum_to_shape",
            Op::Pad { .. } => "pad",
            Op::PairwiseDotGrad => "pairwise_dot_grad",
            Op::AttentionGrad { .. } => "attention_grad",
            Op::EmbeddingBagGradDense { .. } => "embedding_bag_grad_dense",
            Op::EmbeddingSort { .. } => "embedding_sort",
            Op::BceWithLogitsGrad => "bce_with_logits_grad",
            Op::SoftmaxCrossEntropyGrad => "softmax_cross_entropy_grad",
            Op::Broadcast { .. } => "broadcast",
            Op::GradSum => "grad_sum",
            Op::SliceSum { .. } => "slice_sum",
            Op::StepIncrement => "step_increment",
            Op::Sgd { .. } => "sgd",
            Op::Adam { .. } => "adam",
            Op::RowwiseAdagrad { .. } => "rowwise_adagrad",
        }
    }

    pub fn is_leaf(&self) -> bool {
        matches!(self, Op::Leaf(_))
    }

    pub fn is_optimizer(&self) -> bool {
        matches!(
            self,
            Op::StepIncrement | Op::Sgd { .. } | Op::Adam { .. } | Op::RowwiseAdagrad { .. }
        )
    }
}
