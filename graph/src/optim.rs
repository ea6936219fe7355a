//! Optimizer updates as graph nodes, appended after the backward nodes. Dense parameters
//! are updated by one node (one launch on a GPU); each embedding table with a sparse
//! gradient by a row-wise Adagrad node that touches only the batch's rows.

use crate::autodiff::{Grad, Gradients};
use crate::dtype::{DType, Shape};
use crate::error::{GraphError, Result};
use crate::graph::{Graph, NodeId, Phase, Tensor};
use crate::op::Op;

/// The optimizer of dense parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum DenseOptimizer {
    Sgd {
        lr: f64,
    },
    Adam {
        lr: f64,
        beta1: f64,
        beta2: f64,
        eps: f64,
    },
}

impl DenseOptimizer {
    /// The spec's settings: lr 1e-3, betas (0.9, 0.999), eps 1e-8.
    pub fn adam() -> Self {
        DenseOptimizer::Adam {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
        }
    }
}

/// Optimizer settings of a training graph.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OptimizerConfig {
    pub dense: DenseOptimizer,
    /// Row-wise Adagrad for embedding tables with sparse gradients: (lr, eps).
    pub rowwise_adagrad: (f64, f64),
    /// Sort each table's occurrences by row in a node of its own (`EmbeddingSort`, ready
    /// as soon as the batch's ids are) instead of inside the row-wise update at the end
    /// of the step. The same bits either way. Data-parallel training gathers every rank's
    /// ids at the update and sorts there, so it turns this off.
    pub presort_ids: bool,
    /// Adam writes the bf16 copy of each parameter that the step's GEMMs read beside the
    /// updated parameter, in the same pass (`Graph::keep_param_copy`), instead of a
    /// RoundBf16 launch making it from the parameter in the next step's forward. The
    /// same bits either way.
    pub copies_in_update: bool,
}

impl Default for OptimizerConfig {
    fn default() -> Self {
        OptimizerConfig {
            dense: DenseOptimizer::adam(),
            rowwise_adagrad: (0.01, 1e-8),
            presort_ids: true,
            copies_in_update: true,
        }
    }
}

/// The update nodes, for the scheduler.
#[derive(Clone, Debug, Default)]
pub struct Updates {
    pub step_increment: Option<NodeId>,
    /// One dense update per group of parameters (one in all unless grouped).
    pub dense: Vec<NodeId>,
    pub sparse: Vec<NodeId>,
}

fn check_hyper(name: &str, v: f64, lo_open: f64, hi: Option<f64>) -> Result<()> {
    let ok = v.is_finite() && v > lo_open && hi.is_none_or(|h| v < h);
    if ok {
        Ok(())
    } else {
        Err(GraphError::Structure(format!(
            "optimizer: {name} = {v} is out of range"
        )))
    }
}

/// Appends the optimizer updates for `grads`.
pub fn attach(g: &mut Graph, grads: &Gradients, cfg: &OptimizerConfig) -> Result<Updates> {
    attach_grouped(g, grads, cfg, &|_| None)
}

/// [`attach`] with the dense parameters split into groups, one update node each:
/// `group_of(param)` is `Some(k)` for a parameter of group `k` (say, the backward program
/// that completes its gradient, so that its update can run right after it), `None` for
/// the parameters updated together after the whole backward. Every update reads the same
/// step count; the arithmetic of each parameter is the same in any grouping.
pub fn attach_grouped(
    g: &mut Graph,
    grads: &Gradients,
    cfg: &OptimizerConfig,
    group_of: &dyn Fn(Tensor) -> Option<usize>,
) -> Result<Updates> {
    let mut up = Updates::default();
    let mut dense: Vec<(Tensor, Tensor)> = Vec::new();
    for (&p, grad) in &grads.by_param {
        match grad {
            Grad::Dense(t) => dense.push((p, *t)),
            Grad::Sparse {
                node,
                ids,
                offsets,
                dpooled,
            } => {
                let Op::EmbeddingBag { field_rows } = g.node(*node).op.clone() else {
                    return Err(GraphError::Structure(format!(
                        "optimizer: sparse gradient of '{}' does not come from an embedding_bag",
                        g.name(p)
                    )));
                };
                let (lr, eps) = cfg.rowwise_adagrad;
                check_hyper("adagrad lr", lr, 0.0, None)?;
                check_hyper("adagrad eps", eps, 0.0, None)?;
                let rows = g.shape(p).dims()[0];
                let acc = g.state(
                    &format!("{}.adagrad_acc", g.name(p)),
                    &[rows],
                    g.float_dtype(),
                );
                let mut inputs = vec![*ids, *offsets, *dpooled];
                if cfg.presort_ids {
                    let n = Shape::new(&[g.shape(*ids).numel()]);
                    let sorted = g.add_derived(
                        Op::EmbeddingSort {
                            field_rows: field_rows.clone(),
                        },
                        vec![*ids, *offsets],
                        vec![(n.clone(), DType::I32), (n, DType::I32)],
                        format!("{}.sort", g.name(p)),
                        Phase::Backward,
                        Some(*node),
                    );
                    inputs.extend(sorted);
                }
                let name = format!("{}.rowwise_adagrad", g.name(p));
                let id = g.push_update(
                    Op::RowwiseAdagrad {
                        lr,
                        eps,
                        field_rows,
                    },
                    inputs,
                    vec![p, acc],
                    name,
                );
                up.sparse.push(id);
            }
        }
    }
    if dense.is_empty() {
        return Ok(up);
    }
    // groups in a fixed order: the named ones by number, then the rest
    let mut groups: std::collections::BTreeMap<(bool, usize), Vec<(Tensor, Tensor)>> =
        std::collections::BTreeMap::new();
    for &(p, gr) in &dense {
        let key = match group_of(p) {
            Some(k) => (false, k),
            None => (true, 0),
        };
        groups.entry(key).or_default().push((p, gr));
    }
    let suffix = |key: &(bool, usize)| {
        if groups.len() == 1 {
            String::new()
        } else if key.0 {
            ".rest".to_string()
        } else {
            format!(".g{}", key.1)
        }
    };
    match cfg.dense {
        DenseOptimizer::Sgd { lr } => {
            check_hyper("sgd lr", lr, 0.0, None)?;
            for (key, members) in &groups {
                let ps: Vec<Tensor> = members.iter().map(|d| d.0).collect();
                let gs: Vec<Tensor> = members.iter().map(|d| d.1).collect();
                let name = format!("optim/sgd{}", suffix(key));
                up.dense.push(g.push_update(Op::Sgd { lr }, gs, ps, name));
            }
        }
        DenseOptimizer::Adam {
            lr,
            beta1,
            beta2,
            eps,
        } => {
            check_hyper("adam lr", lr, 0.0, None)?;
            check_hyper("adam beta1", beta1, -f64::MIN_POSITIVE, Some(1.0))?;
            check_hyper("adam beta2", beta2, -f64::MIN_POSITIVE, Some(1.0))?;
            check_hyper("adam eps", eps, 0.0, None)?;
            let step = g.state("optim/adam.step", &[], DType::I32);
            up.step_increment = Some(g.push_update(
                Op::StepIncrement,
                Vec::new(),
                vec![step],
                "optim/step".into(),
            ));
            let float = g.float_dtype();
            for (key, members) in &groups {
                // the parameters whose bf16 copy the update writes first, the copies last
                let mut copies = Vec::new();
                let mut members = members.clone();
                if cfg.copies_in_update {
                    let mut with = Vec::new();
                    let mut without = Vec::new();
                    for &(p, gr) in &members {
                        match g.keep_param_copy(p) {
                            Some(c) => {
                                copies.push(c);
                                with.push((p, gr));
                            }
                            None => without.push((p, gr)),
                        }
                    }
                    with.extend(without);
                    members = with;
                }
                let ps: Vec<Tensor> = members.iter().map(|d| d.0).collect();
                let gs: Vec<Tensor> = members.iter().map(|d| d.1).collect();
                let mut updates = ps.clone();
                for kind in ["m", "v"] {
                    for &p in &ps {
                        let s = g.shape(p).dims().to_vec();
                        updates.push(g.state(&format!("{}.adam_{kind}", g.name(p)), &s, float));
                    }
                }
                updates.extend(copies);
                let mut inputs = vec![step];
                inputs.extend(gs);
                let name = format!("optim/adam{}", suffix(key));
                up.dense.push(g.push_update(
                    Op::Adam {
                        lr,
                        beta1,
                        beta2,
                        eps,
                    },
                    inputs,
                    updates,
                    name,
                ));
            }
        }
    }
    Ok(up)
}
