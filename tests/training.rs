//! Training on the CPU backend: detach semantics, weighted losses, optimizers, and a small
//! MLP that learns, with bit-identical results for 1 and 2 threads.

use erase::graph::autodiff::backward;
use erase::graph::{
    make_trainable, DType, DenseOptimizer, Grad, Graph, Init, OptimizerConfig, Tensor,
};
use erase::ops::Buffer;
use erase::runtime::init::{splitmix64, to_unit};
use erase::runtime::{CpuConfig, CpuSession};

fn uniform(seed: u64, n: usize) -> Vec<f64> {
    (0..n)
        .map(|i| 2.0 * to_unit(splitmix64(seed * 1_000_003 + i as u64)) - 1.0)
        .collect()
}

/// upstream -> detach -> downstream, with a local loss before the cut and one after it.
fn cut_graph(w_local: f64, w_down: f64) -> (Graph, Tensor, Tensor, erase::graph::Gradients) {
    let mut g = Graph::new(DType::F64);
    let x = g.constant("x", &[4, 3], uniform(1, 12)).unwrap();
    let h = g.scoped("up", |g| {
        let h = g.linear(x, 5).unwrap();
        g.relu(h).unwrap()
    });
    let local = g.mean(h).unwrap();
    let cut = g.detach(h).unwrap();
    let down = g.scoped("down", |g| g.linear(cut, 2).unwrap());
    let down_sq = g.mul(down, down).unwrap();
    let down_loss = g.sum(down_sq).unwrap();
    g.loss(local, w_local).unwrap();
    g.loss(down_loss, w_down).unwrap();
    let up_w = g.find("up/linear0.weight").unwrap();
    let down_w = g.find("down/linear0.weight").unwrap();
    let grads = backward(&mut g).unwrap();
    (g, up_w, down_w, grads)
}

fn grad_value(g: &Graph, grads: &erase::graph::Gradients, p: Tensor) -> Option<Vec<f64>> {
    let Grad::Dense(t) = grads.get(p)?.clone() else {
        panic!("dense expected")
    };
    let mut s = CpuSession::new(
        g,
        CpuConfig {
            threads: 1,
            seed: 3,
        },
    )
    .unwrap();
    s.run().unwrap();
    Some(s.get(t).unwrap().to_f64())
}

#[test]
fn detach_cuts_every_gradient_edge() {
    let (g0, up0, down0, gr0) = cut_graph(1.0, 0.0);
    let (g1, up1, down1, gr1) = cut_graph(1.0, 1.0);
    // upstream: the same gradient whether the downstream loss counts or not
    let a = grad_value(&g0, &gr0, up0).unwrap();
    let b = grad_value(&g1, &gr1, up1).unwrap();
    assert_eq!(
        a, b,
        "a loss downstream of the cut changed an upstream gradient"
    );
    assert!(
        a.iter().any(|&v| v != 0.0),
        "the local loss must reach the upstream weight"
    );
    // downstream: weight 0 gives zero, weight 1 gives a gradient
    let d0 = grad_value(&g0, &gr0, down0).unwrap();
    let d1 = grad_value(&g1, &gr1, down1).unwrap();
    assert!(d0.iter().all(|&v| v == 0.0));
    assert!(d1.iter().any(|&v| v != 0.0));
    // no backward node of the downstream block reads anything upstream of the cut's gradient:
    // the upstream weight's gradient depends on no node made from the downstream loss
    let Grad::Dense(t) = gr1.get(up1).unwrap().clone() else {
        panic!()
    };
    let mut stack = vec![t];
    let mut seen = std::collections::BTreeSet::new();
    while let Some(t) = stack.pop() {
        let node = g1.producer(t);
        if !seen.insert(node.id) {
            continue;
        }
        assert!(
            !node.name.starts_with("down/"),
            "upstream gradient depends on '{}'",
            node.name
        );
        stack.extend(node.inputs.iter().copied());
    }
}

#[test]
fn weighted_losses_sum() {
    let (ga, upa, _, gra) = cut_graph(1.0, 0.0);
    let (gb, upb, _, grb) = cut_graph(2.5, 0.0);
    let a = grad_value(&ga, &gra, upa).unwrap();
    let b = grad_value(&gb, &grb, upb).unwrap();
    for (x, y) in a.iter().zip(&b) {
        assert!(
            (2.5 * x - y).abs() <= 1e-12 * (1.0 + y.abs()),
            "{x} * 2.5 != {y}"
        );
    }
    // two terms on one tensor: gradients add
    let mut g = Graph::new(DType::F64);
    let p = g
        .param("p", &[3], Init::Values(vec![1.0, -2.0, 0.5]))
        .unwrap();
    let s1 = g.sum(p).unwrap();
    let sq = g.mul(p, p).unwrap();
    let s2 = g.sum(sq).unwrap();
    g.loss(s1, 0.5).unwrap();
    g.loss(s2, 3.0).unwrap();
    let grads = backward(&mut g).unwrap();
    let v = grad_value(&g, &grads, p).unwrap();
    assert_eq!(v, vec![0.5 + 6.0, 0.5 - 12.0, 0.5 + 3.0]);
}

#[test]
fn adam_matches_the_formula() {
    let mut g = Graph::new(DType::F64);
    let p = g.param("p", &[2], Init::Values(vec![1.0, -1.0])).unwrap();
    let c = g.constant("c", &[2], vec![3.0, -0.5]).unwrap();
    let y = g.mul(p, c).unwrap();
    let l = g.sum(y).unwrap();
    g.loss(l, 1.0).unwrap();
    let cfg = OptimizerConfig {
        dense: DenseOptimizer::Adam {
            lr: 0.1,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
        },
        ..Default::default()
    };
    make_trainable(&mut g, &cfg).unwrap();
    let mut s = CpuSession::new(
        &g,
        CpuConfig {
            threads: 1,
            seed: 0,
        },
    )
    .unwrap();
    let (mut m, mut v, mut w) = ([0.0f64; 2], [0.0f64; 2], [1.0f64, -1.0]);
    let grad = [3.0, -0.5];
    for t in 1..=3 {
        s.run().unwrap();
        for i in 0..2 {
            m[i] = 0.9 * m[i] + 0.1 * grad[i];
            v[i] = 0.999 * v[i] + 0.001 * grad[i] * grad[i];
            let mh = m[i] / (1.0 - 0.9f64.powi(t));
            let vh = v[i] / (1.0 - 0.999f64.powi(t));
            w[i] -= 0.1 * mh / (vh.sqrt() + 1e-8);
        }
        let got = s.get(p).unwrap().to_f64();
        for i in 0..2 {
            assert!(
                (got[i] - w[i]).abs() < 1e-12,
                "step {t}: {} vs {}",
                got[i],
                w[i]
            );
        }
    }
}

#[test]
fn rowwise_adagrad_sums_duplicates_and_touches_only_batch_rows() {
    let mut g = Graph::new(DType::F64);
    let rows = [4usize, 3];
    let table = g
        .param(
            "table",
            &[7, 2],
            Init::Values((0..14).map(|i| i as f64 * 0.1).collect()),
        )
        .unwrap();
    // two examples, two fields; row 1 of field 0 appears three times, twice in one bag
    let ids = g.constant_i32("ids", &[6], &[1, 1, 2, 1, 0, 2]).unwrap();
    let offsets = g.constant_i32("offsets", &[5], &[0, 2, 3, 4, 6]).unwrap();
    let e = g.embedding_bag(table, ids, offsets, &rows).unwrap();
    let c = g
        .constant(
            "c",
            &[2, 2, 2],
            vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0],
        )
        .unwrap();
    let y = g.mul(e, c).unwrap();
    let l = g.sum(y).unwrap();
    g.loss(l, 1.0).unwrap();
    let tr = make_trainable(
        &mut g,
        &OptimizerConfig {
            rowwise_adagrad: (0.5, 1e-8),
            ..Default::default()
        },
    )
    .unwrap();
    assert!(matches!(tr.grads.get(table), Some(Grad::Sparse { .. })));
    let mut s = CpuSession::new(
        &g,
        CpuConfig {
            threads: 2,
            seed: 0,
        },
    )
    .unwrap();
    s.run().unwrap();
    let w = s.get(table).unwrap().to_f64();
    // gradients per global row: field 0 row 1 gets bag0 twice + bag2 once: 2*(1,2) + (5,6)
    let expect_row = |r: usize, g: [f64; 2]| {
        let acc = (g[0] * g[0] + g[1] * g[1]) / 2.0;
        let w0 = [r as f64 * 0.2, r as f64 * 0.2 + 0.1];
        [
            w0[0] - 0.5 * g[0] / (acc.sqrt() + 1e-8),
            w0[1] - 0.5 * g[1] / (acc.sqrt() + 1e-8),
        ]
    };
    let checks = [
        (1, [7.0, 10.0]),                // field 0 row 1
        (4 + 2, [3.0 + 7.0, 4.0 + 8.0]), // field 1 row 2 (bag 1 and bag 3)
        (4, [7.0, 8.0]),                 // field 1 row 0 (bag 3)
    ];
    for (r, gr) in checks {
        let want = expect_row(r, gr);
        assert!(
            (w[2 * r] - want[0]).abs() < 1e-12 && (w[2 * r + 1] - want[1]).abs() < 1e-12,
            "row {r}: {:?} vs {want:?}",
            &w[2 * r..2 * r + 2]
        );
    }
    // untouched rows do not move
    for r in [0usize, 2, 3, 5] {
        assert_eq!(w[2 * r], r as f64 * 0.2);
        assert_eq!(w[2 * r + 1], r as f64 * 0.2 + 0.1);
    }
}

/// A 2-class task, separable by a hidden random hyperplane with a margin.
fn separable_batch(seed: u64, n: usize, dim: usize) -> (Vec<f32>, Vec<f32>) {
    let w = uniform(999, dim);
    let mut x = Vec::with_capacity(n * dim);
    let mut y = Vec::with_capacity(n);
    let mut i = 0;
    while y.len() < n {
        let v = uniform(seed * 7919 + i, dim);
        i += 1;
        let s: f64 = v.iter().zip(&w).map(|(a, b)| a * b).sum();
        if s.abs() < 0.1 {
            continue;
        }
        x.extend(v.iter().map(|&a| a as f32));
        y.push(f32::from(s > 0.0));
    }
    (x, y)
}

/// Trains an MLP for `steps` steps; returns the final parameters' bytes and the test accuracy.
fn train_mlp(threads: usize, steps: usize, batch: usize, width: usize) -> (Vec<u8>, f64) {
    let dim = 10;
    let mut g = Graph::new(DType::F32);
    let x = g.input("x", &[batch, dim], DType::F32).unwrap();
    let y = g.input("y", &[batch], DType::F32).unwrap();
    let h = g.linear(x, width).unwrap();
    let h = g.relu(h).unwrap();
    let h = g.linear(h, width).unwrap();
    let h = g.gelu(h).unwrap();
    let logit = g.linear(h, 1).unwrap();
    let loss = g.bce_with_logits(logit, y).unwrap();
    g.loss(loss, 1.0).unwrap();
    let cfg = OptimizerConfig {
        dense: DenseOptimizer::Adam {
            lr: 1e-2,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
        },
        ..Default::default()
    };
    make_trainable(&mut g, &cfg).unwrap();
    let mut s = CpuSession::new(&g, CpuConfig { threads, seed: 42 }).unwrap();
    for step in 0..steps {
        let (xb, yb) = separable_batch(step as u64, batch, dim);
        s.feed(x, Buffer::F32(xb)).unwrap();
        s.feed(y, Buffer::F32(yb)).unwrap();
        s.run().unwrap();
    }
    // evaluate on unseen batches with the forward nodes only
    let fwd: Vec<_> = g
        .nodes()
        .iter()
        .filter(|n| n.phase == erase::graph::Phase::Forward && !n.op.is_leaf())
        .map(|n| n.id)
        .collect();
    let (mut right, mut total) = (0usize, 0usize);
    for eb in 0..8 {
        let (xb, yb) = separable_batch(1_000_000 + eb, batch, dim);
        s.feed(x, Buffer::F32(xb)).unwrap();
        s.feed(y, Buffer::F32(yb.clone())).unwrap();
        s.run_nodes(&fwd).unwrap();
        let out = s.get(logit).unwrap().to_f64();
        for (o, t) in out.iter().zip(&yb) {
            right += usize::from((*o > 0.0) == (*t > 0.5));
            total += 1;
        }
    }
    let mut bytes = Vec::new();
    for p in g.params() {
        bytes.extend_from_slice(s.get(p).unwrap().bytes());
    }
    (bytes, right as f64 / total as f64)
}

#[test]
fn mlp_learns_and_is_bit_identical_across_thread_counts() {
    // small batches: the accuracy the task allows
    let (_, acc) = train_mlp(2, 300, 64, 32);
    assert!(acc >= 0.95, "test accuracy {acc} below 0.95");
    // large enough that GEMMs and elementwise loops split across threads
    let (p1, acc1) = train_mlp(1, 25, 2048, 64);
    let (p2, acc2) = train_mlp(2, 25, 2048, 64);
    assert_eq!(acc1, acc2);
    assert!(p1 == p2, "parameters differ between 1 and 2 threads");
    let (p3, _) = train_mlp(2, 25, 2048, 64);
    assert!(p2 == p3, "two runs with the same seed differ");
}
