//! Finite-difference gradient checks in f64 for every differentiable op, through the CPU
//! backend, on random shapes (odd sizes included) and random values.
//!
//! Each check builds `loss = Σ R ⊙ op(params...)` with a random constant `R`, takes the
//! analytic gradient from autodiff, and compares it with central differences.

use erase::graph::autodiff::{backward_with, BackwardOptions};
use erase::graph::{DType, Grad, Graph, Init, Op, Phase, Tensor};
use erase::ops::Buffer;
use erase::runtime::init::{splitmix64, to_unit};
use erase::runtime::{CpuConfig, CpuSession};

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(1);
        to_unit(splitmix64(self.0))
    }
    fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next() * (hi - lo + 1) as f64) as usize % (hi - lo + 1)
    }
    fn values(&mut self, n: usize, scale: f64) -> Vec<f64> {
        (0..n).map(|_| (2.0 * self.next() - 1.0) * scale).collect()
    }
}

/// Checks d(Σ R ⊙ y)/dp for every parameter `p` made by `build` (which returns y).
fn check(name: &str, seed: u64, build: impl FnOnce(&mut Graph, &mut Rng) -> Tensor) {
    let mut rng = Rng(seed.wrapping_mul(0x1234_5678_9ABC_DEF1));
    let mut g = Graph::new(DType::F64);
    let y = build(&mut g, &mut rng);
    let dims = g.shape(y).dims().to_vec();
    let n = dims.iter().product();
    let r = g.constant("R", &dims, rng.values(n, 1.0)).unwrap();
    let weighted = if g.shape(y).rank() == 0 {
        g.scale(y, 1.7).unwrap()
    } else {
        g.mul(y, r).unwrap()
    };
    let loss = g.sum(weighted).unwrap();
    g.loss(loss, 1.0).unwrap();
    let grads = backward_with(
        &mut g,
        BackwardOptions {
            sparse_tables: false,
        },
    )
    .unwrap();
    assert!(!grads.by_param.is_empty(), "{name}: no gradient at all");

    let forward: Vec<_> = g
        .nodes()
        .iter()
        .filter(|n| n.phase == Phase::Forward && !n.op.is_leaf())
        .map(|n| n.id)
        .collect();
    let mut s = CpuSession::new(&g, CpuConfig { threads: 2, seed }).unwrap();
    assert!(
        g.inputs().is_empty(),
        "{name}: checks build constants, not inputs"
    );
    s.run().unwrap();
    for (&p, grad) in &grads.by_param {
        let Grad::Dense(gt) = grad else {
            panic!("{name}: sparse gradient in a dense check")
        };
        let analytic = s.get(*gt).unwrap().to_f64();
        let base = s.get(p).unwrap().to_f64();
        let numel = base.len();
        let picks: Vec<usize> = if numel <= 24 {
            (0..numel).collect()
        } else {
            (0..24).map(|_| rng.range(0, numel - 1)).collect()
        };
        let mut worst: f64 = 0.0;
        for &i in &picks {
            let h = 1e-6 * base[i].abs().max(1.0);
            let mut eval = |v: f64| {
                let mut pv = base.clone();
                pv[i] = v;
                s.feed(p, Buffer::F64(pv)).unwrap();
                s.run_nodes(&forward).unwrap();
                s.scalar(loss).unwrap()
            };
            let num = (eval(base[i] + h) - eval(base[i] - h)) / (2.0 * h);
            // relative error, with an absolute floor for entries near zero
            let err = (num - analytic[i]).abs() / (1e-3 + num.abs().max(analytic[i].abs()));
            worst = worst.max(err);
            assert!(
                err < 1e-6,
                "{name}: d loss / d {}[{i}]: numeric {num:.10e}, autodiff {:.10e} (rel err {err:.2e})",
                g.name(p),
                analytic[i]
            );
        }
        s.feed(p, Buffer::F64(base)).unwrap();
        eprintln!(
            "{name}: {} ok ({} entries, worst rel err {worst:.1e})",
            g.name(p),
            picks.len()
        );
    }
}

fn param(g: &mut Graph, rng: &mut Rng, name: &str, shape: &[usize], scale: f64) -> Tensor {
    let n = shape.iter().product();
    g.param(name, shape, Init::Values(rng.values(n, scale)))
        .unwrap()
}

const TRIALS: u64 = 3;

#[test]
fn linear_and_matmul() {
    for t in 0..TRIALS {
        check("linear", t, |g, r| {
            let (b, s, k, n) = (r.range(1, 5), r.range(1, 3), r.range(1, 9), r.range(1, 7));
            let x = param(g, r, "x", &[b, s, k], 1.0);
            let w = param(g, r, "w", &[n, k], 1.0);
            let bias = param(g, r, "b", &[n], 1.0);
            g.linear_with(x, w, Some(bias)).unwrap()
        });
        check("linear_relu", 30 + t, |g, r| {
            let (m, k, n) = (r.range(1, 7), r.range(1, 9), r.range(1, 7));
            let x = param(g, r, "x", &[m, k], 1.0);
            let w = param(g, r, "w", &[n, k], 1.0);
            let bias = param(g, r, "b", &[n], 1.0);
            g.linear_relu_with(x, w, Some(bias)).unwrap()
        });
        // the residual's gradient is dy itself; with and without a bias
        check("linear_add", 40 + t, |g, r| {
            let (b, s, k, n) = (r.range(1, 5), r.range(1, 3), r.range(1, 9), r.range(1, 7));
            let x = param(g, r, "x", &[b, s, k], 1.0);
            let w = param(g, r, "w", &[n, k], 1.0);
            let bias = param(g, r, "b", &[n], 1.0);
            let res = param(g, r, "r", &[b, s, n], 1.0);
            let y = g.linear_add_with(x, w, Some(bias), res).unwrap();
            // the residual read again downstream: its gradient sums both uses
            g.mul(y, res).unwrap()
        });
        check("linear_add_nobias", 50 + t, |g, r| {
            let (m, k, n) = (r.range(1, 7), r.range(1, 9), r.range(1, 7));
            let x = param(g, r, "x", &[m, k], 1.0);
            let w = param(g, r, "w", &[n, k], 1.0);
            let res = param(g, r, "r", &[m, n], 1.0);
            g.linear_add_with(x, w, None, res).unwrap()
        });
        check("linear_nobias", 10 + t, |g, r| {
            let (m, k, n) = (r.range(1, 7), r.range(1, 9), r.range(1, 7));
            let x = param(g, r, "x", &[m, k], 1.0);
            let w = param(g, r, "w", &[n, k], 1.0);
            g.linear_with(x, w, None).unwrap()
        });
        for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
            check(&format!("matmul ta={ta} tb={tb}"), 20 + t, |g, r| {
                let (m, k, n) = (r.range(1, 6), r.range(1, 7), r.range(1, 5));
                let batch = r.range(1, 3);
                let sa = if ta { [k, m] } else { [m, k] };
                let sb = if tb { [n, k] } else { [k, n] };
                let (a, b) = if batch > 1 {
                    (
                        param(g, r, "a", &[batch, sa[0], sa[1]], 1.0),
                        param(g, r, "b", &[batch, sb[0], sb[1]], 1.0),
                    )
                } else {
                    (param(g, r, "a", &sa, 1.0), param(g, r, "b", &sb, 1.0))
                };
                g.matmul_t(a, b, ta, tb).unwrap()
            });
        }
    }
}

#[test]
fn elementwise() {
    for t in 0..TRIALS {
        for (label, mul, bcast) in [
            ("add", false, false),
            ("add_bcast", false, true),
            ("mul", true, false),
            ("mul_bcast", true, true),
        ] {
            check(label, 30 + t, |g, r| {
                let (b, f, d) = (r.range(1, 4), r.range(1, 5), r.range(1, 6));
                let a = param(g, r, "a", &[b, f, d], 1.0);
                let bshape: Vec<usize> = if bcast { vec![f, d] } else { vec![b, f, d] };
                let c = param(g, r, "b", &bshape, 1.0);
                if mul {
                    g.mul(a, c).unwrap()
                } else {
                    g.add(a, c).unwrap()
                }
            });
        }
        check("scale", 40 + t, |g, r| {
            let sh = [r.range(1, 9)];
            let x = param(g, r, "x", &sh, 1.0);
            g.scale(x, -0.37).unwrap()
        });
        check("relu", 41 + t, |g, r| {
            let sh = [r.range(2, 5), r.range(1, 9)];
            let x = param(g, r, "x", &sh, 1.0);
            g.relu(x).unwrap()
        });
        check("gelu", 42 + t, |g, r| {
            let sh = [r.range(2, 5), r.range(1, 9)];
            let x = param(g, r, "x", &sh, 3.0);
            g.gelu(x).unwrap()
        });
        check("silu", 44 + t, |g, r| {
            let sh = [r.range(2, 5), r.range(1, 9)];
            let x = param(g, r, "x", &sh, 4.0);
            g.silu(x).unwrap()
        });
        check("sigmoid", 43 + t, |g, r| {
            let sh = [r.range(2, 5), r.range(1, 9)];
            let x = param(g, r, "x", &sh, 5.0);
            g.sigmoid(x).unwrap()
        });
        check("layer_norm", 44 + t, |g, r| {
            let (rows, d) = (r.range(1, 6), r.range(2, 11));
            let x = param(g, r, "x", &[rows, d], 2.0);
            let gamma = param(g, r, "gamma", &[d], 1.0);
            let beta = param(g, r, "beta", &[d], 1.0);
            g.layer_norm_with(x, gamma, beta, 1e-5).unwrap()
        });
    }
}

#[test]
fn shape_ops() {
    for t in 0..TRIALS {
        check("reshape_flatten", 50 + t, |g, r| {
            let (b, f, d) = (r.range(1, 4), r.range(1, 5), r.range(1, 6));
            let x = param(g, r, "x", &[b, f, d], 1.0);
            let y = g.flatten(x).unwrap();
            let y2 = g.relu(y).unwrap();
            g.reshape(y2, &[b * f, d]).unwrap()
        });
        for axis in 0..3 {
            check(&format!("concat axis {axis}"), 51 + t, |g, r| {
                let dims = [r.range(1, 4), r.range(1, 4), r.range(1, 4)];
                let mut parts = Vec::new();
                for i in 0..3 {
                    let mut d = dims;
                    d[axis] = r.range(1, 3);
                    parts.push(param(g, r, &format!("x{i}"), &d, 1.0));
                }
                g.concat(&parts, axis).unwrap()
            });
            check(&format!("slice axis {axis}"), 52 + t, |g, r| {
                let dims = [r.range(2, 5), r.range(2, 5), r.range(2, 5)];
                let x = param(g, r, "x", &dims, 1.0);
                let start = r.range(0, dims[axis] - 1);
                let len = r.range(1, dims[axis] - start);
                g.slice(x, axis, start, len).unwrap()
            });
        }
        check("mul_add", 56 + t, |g, r| {
            let dims = [r.range(1, 4), r.range(1, 6)];
            let a = param(g, r, "a", &dims, 1.0);
            let b = param(g, r, "b", &dims, 1.0);
            let c = param(g, r, "c", &dims, 1.0);
            g.mul_add(a, b, c).unwrap()
        });
        check("mul of one shape (fused gradient)", 57 + t, |g, r| {
            let dims = [r.range(1, 4), r.range(1, 6)];
            let a = param(g, r, "a", &dims, 1.0);
            let b = param(g, r, "b", &dims, 1.0);
            g.mul(a, b).unwrap()
        });
        check("pairwise_dot", 53 + t, |g, r| {
            let (b, f, d) = (r.range(1, 4), r.range(2, 7), r.range(1, 5));
            let e = param(g, r, "e", &[b, f, d], 1.0);
            g.pairwise_dot(e).unwrap()
        });
    }
}

#[test]
fn attention() {
    for t in 0..TRIALS {
        for causal in [false, true] {
            check(&format!("attention causal={causal}"), 60 + t, |g, r| {
                let (b, s, heads, dh) =
                    (r.range(1, 3), r.range(1, 7), r.range(1, 3), r.range(1, 5));
                let w = heads * dh;
                let q = param(g, r, "q", &[b, s, w], 1.0);
                let k = param(g, r, "k", &[b, s, w], 1.0);
                let v = param(g, r, "v", &[b, s, w], 1.0);
                g.attention(q, k, v, heads, causal).unwrap()
            });
            check(
                &format!("attention packed causal={causal}"),
                65 + t,
                |g, r| {
                    let (b, s, heads, dh) =
                        (r.range(1, 3), r.range(1, 7), r.range(1, 3), r.range(1, 5));
                    let qkv = param(g, r, "qkv", &[b, s, 3 * heads * dh], 1.0);
                    g.attention_packed(qkv, heads, causal).unwrap()
                },
            );
        }
    }
}

/// Random multi-hot bags (duplicates included) over tables of different sizes.
fn bags(r: &mut Rng, b: usize, field_rows: &[usize]) -> (Vec<f64>, Vec<f64>) {
    let mut ids = Vec::new();
    let mut offsets = vec![0.0];
    for _ in 0..b {
        for &rows in field_rows {
            let hot = r.range(0, 3);
            for _ in 0..hot {
                ids.push(r.range(0, rows - 1) as f64);
            }
            offsets.push(ids.len() as f64);
        }
    }
    (ids, offsets)
}

#[test]
fn embedding_bag() {
    for t in 0..TRIALS {
        check("embedding_bag", 70 + t, |g, r| {
            let field_rows: Vec<usize> = (0..r.range(1, 4)).map(|_| r.range(1, 5)).collect();
            let (b, d) = (r.range(1, 5), r.range(1, 4));
            let total: usize = field_rows.iter().sum();
            let table = param(g, r, "table", &[total, d], 1.0);
            let (ids, offsets) = bags(r, b, &field_rows);
            let ids_t = int_const(g, "ids", ids);
            let off_t = int_const(g, "offsets", offsets);
            g.embedding_bag(table, ids_t, off_t, &field_rows).unwrap()
        });
    }
}

#[test]
fn padded_bags_and_bag_mean() {
    // bags with padding slots (-1) and a mean over some fields: the gradient reaches
    // only the ids, each scaled by 1/n of its bag
    for t in 0..TRIALS {
        check("bag_mean", 170 + t, |g, r| {
            let f = r.range(1, 4);
            let field_rows: Vec<usize> = (0..f).map(|_| r.range(1, 5)).collect();
            let mean: Vec<bool> = (0..f).map(|_| r.range(0, 2) == 1).collect();
            let (b, d) = (r.range(1, 4), r.range(1, 4));
            let total: usize = field_rows.iter().sum();
            let table = param(g, r, "table", &[total, d], 1.0);
            let (mut ids, mut offsets) = (Vec::new(), vec![0.0]);
            for _ in 0..b {
                for &rows in &field_rows {
                    let used = r.range(0, 4);
                    for k in 0..3 {
                        ids.push(if k < used {
                            r.range(0, rows - 1) as f64
                        } else {
                            -1.0
                        });
                    }
                    offsets.push(ids.len() as f64);
                }
            }
            let ids_t = int_const(g, "ids", ids);
            let off_t = int_const(g, "offsets", offsets);
            let y = g.embedding_bag(table, ids_t, off_t, &field_rows).unwrap();
            g.bag_mean(y, ids_t, off_t, &mean).unwrap()
        });
    }
}

#[test]
fn zoo_models() {
    // each zoo model's dense part on tiny sizes, its fields and dense features parameters
    for (k, name) in erase::model::zoo::names().iter().enumerate() {
        check(&format!("zoo {name}"), 300 + k as u64, |g, r| {
            let cfg = erase::model::ctr::CtrConfig {
                model: name.to_string(),
                batch: 3,
                num_dense: 2,
                num_sparse: 3,
                dim: 4,
                bottom: vec![5],
                top: vec![6],
                deep: vec![5],
                cross_rank: 3,
                cross_layers: 2,
                ..erase::model::ctr::CtrConfig::small()
            };
            let dense = param(g, r, "dense", &[3, 2], 1.0);
            let fields = param(g, r, "fields", &[3, 3, 4], 1.0);
            let label = g.constant("label", &[3], vec![1.0, 0.0, 1.0]).unwrap();
            let x = erase::model::api::ModelInputs {
                dense: Some(dense),
                fields,
                label,
                batch: 3,
                dim: 4,
            };
            let mut blocks = erase::model::api::Blocks::new(false, label, 3);
            let m = erase::model::api::find(name).unwrap();
            m.build(g, &x, &cfg, &mut blocks).unwrap()
        });
    }
}

fn int_const(g: &mut Graph, name: &str, v: Vec<f64>) -> Tensor {
    let v: Vec<i32> = v.iter().map(|&x| x as i32).collect();
    g.constant_i32(name, &[v.len()], &v).unwrap()
}

#[test]
fn losses_and_reductions() {
    for t in 0..TRIALS {
        check("bce_with_logits", 80 + t, |g, r| {
            let n = r.range(1, 9);
            let x = param(g, r, "logit", &[n, 1], 4.0);
            let labels: Vec<f64> = (0..n).map(|_| (r.next() < 0.5) as u8 as f64).collect();
            let y = g.constant("label", &[n], labels).unwrap();
            g.bce_with_logits(x, y).unwrap()
        });
        check("softmax_cross_entropy", 81 + t, |g, r| {
            let (n, c) = (r.range(1, 6), r.range(2, 7));
            let x = param(g, r, "logits", &[n, c], 3.0);
            let labels: Vec<f64> = (0..n).map(|_| r.range(0, c - 1) as f64).collect();
            let l = int_const(g, "labels", labels);
            g.softmax_cross_entropy(x, l).unwrap()
        });
        check("sum", 82 + t, |g, r| {
            let sh = [r.range(1, 4), r.range(1, 5)];
            let x = param(g, r, "x", &sh, 1.0);
            let y = g.mul(x, x).unwrap();
            g.sum(y).unwrap()
        });
        check("mean", 83 + t, |g, r| {
            let sh = [r.range(1, 4), r.range(1, 5)];
            let x = param(g, r, "x", &sh, 1.0);
            let y = g.mul(x, x).unwrap();
            g.mean(y).unwrap()
        });
    }
}

#[test]
fn concat_with_several_consumers_differentiates_through_slice_sums() {
    for axis in 0..3 {
        let name = format!("concat of a shared output, axis {axis}");
        check(&name, 95 + axis as u64, |g, r| {
            let dims = [r.range(2, 4), r.range(2, 4), r.range(2, 4)];
            let mut parts = Vec::new();
            for i in 0..3 {
                let mut d = dims;
                d[axis] = r.range(1, 3);
                let n = d.iter().product();
                // the middle part is a constant: it needs no gradient, and gets no node
                parts.push(if i == 1 {
                    g.constant("c", &d, r.values(n, 1.0)).unwrap()
                } else {
                    param(g, r, &format!("x{i}"), &d, 1.0)
                });
            }
            let e = g.concat(&parts, axis).unwrap();
            // three consumers of the concat's output
            let a = g.relu(e).unwrap();
            let b = g.sigmoid(e).unwrap();
            let ab = g.add(a, b).unwrap();
            g.mul(ab, e).unwrap()
        });
    }
    // the nodes autodiff makes for such a concat
    let mut g = Graph::new(DType::F64);
    let x0 = g.param("x0", &[2, 3], Init::Values(vec![0.5; 6])).unwrap();
    let c = g.constant("c", &[2, 1], vec![0.25; 2]).unwrap();
    let x2 = g.param("x2", &[2, 2], Init::Values(vec![-0.5; 4])).unwrap();
    let e = g.concat(&[x0, c, x2], 1).unwrap();
    let a = g.relu(e).unwrap();
    let y = g.mul(a, e).unwrap();
    let l = g.sum(y).unwrap();
    g.loss(l, 1.0).unwrap();
    backward_with(&mut g, BackwardOptions::default()).unwrap();
    let windows: Vec<(usize, usize)> = g
        .nodes()
        .iter()
        .filter_map(|n| match n.op {
            Op::SliceSum { start, len, .. } => Some((start, len)),
            _ => None,
        })
        .collect();
    assert_eq!(windows, [(0, 3), (4, 2)]);
    assert!(
        !g.nodes()
            .iter()
            .any(|n| matches!(n.op, Op::GradSum | Op::Slice { .. })),
        "the sum over the whole output and its slices are gone"
    );
}

/// A concat read through a reshape (each block's flatten of the field embeddings) with
/// several contributions: each goes to the concat as a view, and the concat's slice sums
/// take them all; no `GradSum` over the reshaped whole. Against finite differences.
#[test]
fn a_reshaped_concats_contributions_go_to_its_slice_sums() {
    let build = |g: &mut Graph, r: &mut Rng| {
        let x0 = param(g, r, "x0", &[2, 2, 3], 1.0);
        let x1 = param(g, r, "x1", &[2, 1, 3], 1.0);
        let e = g.concat(&[x0, x1], 1).unwrap();
        let flat = g.reshape(e, &[2, 9]).unwrap();
        // three contributions to the flat view
        let a = g.relu(flat).unwrap();
        let b = g.sigmoid(flat).unwrap();
        let ab = g.add(a, b).unwrap();
        g.mul(ab, flat).unwrap()
    };
    check("reshaped concat", 97, build);
    let mut g = Graph::new(DType::F64);
    let mut r = Rng(97);
    let y = build(&mut g, &mut r);
    let l = g.sum(y).unwrap();
    g.loss(l, 1.0).unwrap();
    backward_with(&mut g, BackwardOptions::default()).unwrap();
    let sums: Vec<(usize, usize, usize)> = g
        .nodes()
        .iter()
        .filter_map(|n| match n.op {
            Op::SliceSum { start, len, .. } => Some((start, len, n.inputs.len())),
            _ => None,
        })
        .collect();
    assert_eq!(sums, [(0, 2, 3), (2, 1, 3)]);
    assert!(!g.nodes().iter().any(|n| matches!(n.op, Op::GradSum)));
}

/// A linear layer's input with one more reader after the layer: x's two contributions
/// summed by the layer's data gradient (`LinearGradInput { residual }`), no `GradSum`;
/// with its other reader before the layer (not yet differentiated when the layer is),
/// the `GradSum` stays. Both against finite differences.
#[test]
fn a_linear_inputs_other_contribution_is_summed_in_its_data_gradient() {
    let count = |g: &Graph, f: &dyn Fn(&Op) -> bool| g.nodes().iter().filter(|n| f(&n.op)).count();
    for reader_first in [false, true] {
        let build = |g: &mut Graph, r: &mut Rng| {
            let x = param(g, r, "x", &[5, 4], 1.0);
            let early = if reader_first {
                Some(g.sigmoid(x).unwrap())
            } else {
                None
            };
            let y = g.linear(x, 3).unwrap();
            let z = g.linear(y, 4).unwrap();
            match early {
                Some(e) => g.mul(z, e).unwrap(),
                None => g.mul(z, x).unwrap(),
            }
        };
        let mut g = Graph::new(DType::F64);
        let y = build(&mut g, &mut Rng(7));
        let loss = g.sum(y).unwrap();
        g.loss(loss, 1.0).unwrap();
        backward_with(&mut g, BackwardOptions::default()).unwrap();
        let summed = count(&g, &|o| {
            matches!(o, Op::LinearGradInput { residual: true, .. })
        });
        let sums = count(&g, &|o| matches!(o, Op::GradSum));
        if reader_first {
            assert_eq!((summed, sums), (0, 1), "a reader before the layer");
        } else {
            assert_eq!((summed, sums), (1, 0), "a reader after the layer");
        }
        check("linear_dx_residual", 91 + u64::from(reader_first), build);
    }
    // a layer with its own input as the residual (y = x·wᵀ + b + x): r's gradient is dy,
    // summed into dx the same way
    let build = |g: &mut Graph, r: &mut Rng| {
        let x = param(g, r, "x", &[5, 4], 1.0);
        let w = param(g, r, "w", &[4, 4], 1.0);
        let bias = param(g, r, "b", &[4], 1.0);
        let y = g.linear_add_with(x, w, Some(bias), x).unwrap();
        g.sigmoid(y).unwrap()
    };
    let mut g = Graph::new(DType::F64);
    let y = build(&mut g, &mut Rng(8));
    let loss = g.sum(y).unwrap();
    g.loss(loss, 1.0).unwrap();
    backward_with(&mut g, BackwardOptions::default()).unwrap();
    let summed = count(&g, &|o| {
        matches!(o, Op::LinearGradInput { residual: true, .. })
    });
    assert_eq!(
        (summed, count(&g, &|o| matches!(o, Op::GradSum))),
        (1, 0),
        "x as its layer's residual"
    );
    check("linear_add_dx_residual", 93, build);
}

#[test]
fn shared_tensor_gradients_sum_over_consumers() {
    // x feeds three consumers: its gradient is one sum of three contributions.
    check("grad_sum", 90, |g, r| {
        let x = param(g, r, "x", &[3, 4], 1.0);
        let a = g.relu(x).unwrap();
        let b = g.sigmoid(x).unwrap();
        let ab = g.add(a, b).unwrap();
        g.mul(ab, x).unwrap()
    });
}
