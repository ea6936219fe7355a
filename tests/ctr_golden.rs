//! The CTR model (`erase::model::ctr`) against the PyTorch anchor's golden forward and
//! backward values (`tests/data/ctr_grad_golden.json`, a byte copy of
//! `shared/anchors/ctr_grad_golden.json`), and a small-size smoke test of all variants.
//!
//! The golden file: batch 16 (examples 0..15 of stream 1 of the spec's synthetic data,
//! seed 0, rows 1000), float64, every parameter set by a counter-based rule; for
//! `baseline` and `detached`: the logits, the losses, and a digest (sum, sum of squares,
//! sampled entries) of every parameter's gradient and of its value after one optimizer
//! step (Adam on dense parameters, row-wise Adagrad on the table).

use std::sync::OnceLock;

use erase::data::synthetic::{
    rng_u64, splitmix64, u64_to_uniform, SyntheticConfig, SyntheticCtr, STREAM_TRAIN,
};
use erase::graph::autodiff::{backward_with, BackwardOptions};
use erase::graph::{make_trainable, DType, Grad, OptimizerConfig, Tensor};
use erase::model::ctr::{self, CtrConfig, CtrModel, Variant, BLOCKS};
use erase::ops::Buffer;
use erase::runtime::{CpuConfig, CpuSession};
use serde_json::Value;

/// Worst relative error allowed against the golden values (the test runs in f64).
const TOL: f64 = 1e-6;
/// Index of the embedding tables in the golden file's init and digest rules.
const TABLE_INDEX: u64 = 1000;

fn golden() -> &'static Value {
    static G: OnceLock<Value> = OnceLock::new();
    G.get_or_init(|| {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/data/ctr_grad_golden.json"
        );
        let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {path}: {e}"));
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("parse {path}: {e}"))
    })
}

fn f64_of(v: &Value, what: &str) -> f64 {
    v.as_f64()
        .unwrap_or_else(|| panic!("{what}: not a number: {v}"))
}

fn u64_of(v: &Value, what: &str) -> u64 {
    v.as_u64()
        .unwrap_or_else(|| panic!("{what}: not an unsigned integer: {v}"))
}

fn array<'a>(v: &'a Value, what: &str) -> &'a Vec<Value> {
    v.as_array()
        .unwrap_or_else(|| panic!("{what}: not an array"))
}

fn str_of<'a>(v: &'a Value, what: &str) -> &'a str {
    v.as_str()
        .unwrap_or_else(|| panic!("{what}: not a string: {v}"))
}

/// The golden's sizes: the spec's model at batch 16 with 1000 rows per table.
fn golden_config(variant: Variant) -> CtrConfig {
    let d = &golden()["data"];
    CtrConfig {
        batch: u64_of(&d["batch"], "data.batch") as usize,
        rows: u64_of(&d["rows"], "data.rows") as usize,
        variant,
        ..CtrConfig::default()
    }
}

/// Examples 0..15 of stream 1 (seed 0, rows 1000): dense, per-field rows, labels.
fn golden_batch() -> &'static (Vec<f32>, Vec<u32>, Vec<f32>) {
    static B: OnceLock<(Vec<f32>, Vec<u32>, Vec<f32>)> = OnceLock::new();
    B.get_or_init(|| {
        let d = &golden()["data"];
        assert_eq!(u64_of(&d["stream"], "data.stream"), STREAM_TRAIN);
        assert_eq!(str_of(&d["examples"], "data.examples"), "0..15");
        let cfg = golden_config(Variant::Baseline);
        let gen = SyntheticCtr::new(SyntheticConfig {
            seed: u64_of(&d["data_seed"], "data.data_seed"),
            rows: cfg.rows,
            hot: 1,
        });
        let mut dense = vec![0.0f32; cfg.batch * cfg.num_dense];
        let mut rows = vec![0u32; cfg.ids_per_batch()];
        let mut labels = vec![0.0f32; cfg.batch];
        gen.fill_batch(
            STREAM_TRAIN,
            0,
            cfg.batch,
            &mut dense,
            &mut rows,
            &mut labels,
        );
        (dense, rows, labels)
    })
}

/// The golden's init rule: `u = (splitmix64(splitmix64(7*16 + 1000 + p) + e*64) >> 11) * 2^-53`,
/// i.e. the synthetic generator's counter with seed 7, stream 1000 + p, slot 0.
fn init_values(rule: &str, p: u64, shape: &[usize]) -> Vec<f64> {
    let n: usize = shape.iter().product();
    let u = |e: usize| u64_to_uniform(rng_u64(7, 1000 + p, e as u64, 0));
    let map: Box<dyn Fn(f64) -> f64> = if rule.starts_with("weight [out,in]") {
        let fan_in = shape[1];
        assert!(
            rule.contains(&format!("in={fan_in})")),
            "param {p}: rule '{rule}' does not match shape {shape:?}"
        );
        let s = (fan_in as f64).sqrt();
        Box::new(move |u| (2.0 * u - 1.0) / s)
    } else if rule.starts_with("bias:") {
        Box::new(|u| 0.01 * (2.0 * u - 1.0))
    } else if rule.starts_with("layernorm weight") {
        Box::new(|u| 1.0 + 0.1 * (2.0 * u - 1.0))
    } else if rule.starts_with("layernorm bias") {
        Box::new(|u| 0.05 * (2.0 * u - 1.0))
    } else if rule.starts_with("0.5*(2u-1)") {
        Box::new(|u| 0.5 * (2.0 * u - 1.0))
    } else {
        panic!("param {p}: unknown init rule '{rule}'")
    };
    (0..n).map(|e| map(u(e))).collect()
}

/// The digest's sample positions: `splitmix64(p*1000 + j) mod numel`, j = 0..7,
/// deduplicated and sorted.
fn sample_positions(p: u64, numel: usize) -> Vec<usize> {
    let mut v: Vec<usize> = (0..8)
        .map(|j| (splitmix64(p * 1000 + j) % numel as u64) as usize)
        .collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// The worst relative error seen so far, and where.
#[derive(Debug, Default)]
struct Worst {
    rel: f64,
    what: String,
    got: f64,
    want: f64,
    checked: usize,
}

impl Worst {
    /// `|got - want| / max(|want|, floor)`.
    fn check(&mut self, what: impl FnOnce() -> String, got: f64, want: f64, floor: f64) {
        self.checked += 1;
        let rel = if got.is_nan() || want.is_nan() {
            f64::INFINITY
        } else {
            (got - want).abs() / want.abs().max(floor)
        };
        if rel > self.rel || (rel.is_infinite() && !self.rel.is_infinite()) {
            self.rel = rel;
            self.what = what();
            self.got = got;
            self.want = want;
        }
    }

    fn report(&self, title: &str) {
        println!(
            "{title}: {} values checked, worst relative error {:.3e} at {} (got {:.17e}, want {:.17e})",
            self.checked, self.rel, self.what, self.got, self.want
        );
    }
}

/// Checks a tensor against a golden digest `{index, name, sum, sumsq, samples}`.
fn check_digest(w: &mut Worst, kind: &str, name: &str, p: u64, t: &[f64], d: &Value) {
    let what = format!("{kind} of {name}");
    assert_eq!(u64_of(&d["index"], &what), p, "{what}: index");
    assert_eq!(str_of(&d["name"], &what), name, "{what}: name");
    let want_sum = f64_of(&d["sum"], &what);
    let want_sumsq = f64_of(&d["sumsq"], &what);
    let sum: f64 = t.iter().sum();
    let sumsq: f64 = t.iter().map(|v| v * v).sum();
    let l2 = want_sumsq.sqrt();
    let rms = (want_sumsq / t.len() as f64).sqrt();
    // a sum can cancel: measure it against the tensor's L2 norm when it is smaller
    w.check(|| format!("{what}: sum"), sum, want_sum, l2.max(1e-300));
    w.check(|| format!("{what}: sumsq"), sumsq, want_sumsq, 1e-300);
    let samples = array(&d["samples"], &what);
    let want_pos: Vec<usize> = samples
        .iter()
        .map(|s| u64_of(&s[0], &what) as usize)
        .collect();
    assert_eq!(
        want_pos,
        sample_positions(p, t.len()),
        "{what}: sample positions differ from the digest rule"
    );
    for s in samples {
        let i = u64_of(&s[0], &what) as usize;
        let want = f64_of(&s[1], &what);
        w.check(
            || format!("{what}: [{i}]"),
            t[i],
            want,
            (1e-3 * rms).max(1e-300),
        );
    }
}

struct Outcome {
    logits: Vec<f64>,
    main_loss: f64,
    worst: Worst,
}

fn dense_grad(grads: &erase::graph::Gradients, p: Tensor, name: &str) -> Tensor {
    match grads.get(p) {
        Some(Grad::Dense(t)) => *t,
        other => panic!("{name}: expected a dense gradient, got {other:?}"),
    }
}

fn values(s: &CpuSession, t: Tensor, what: &str) -> Vec<f64> {
    s.get(t)
        .unwrap_or_else(|| panic!("{what}: no value"))
        .to_f64()
}

/// Builds the variant in f64 at the golden's sizes, sets the golden's parameters, runs one
/// training step, and checks everything against the golden file.
fn run_golden(variant: Variant) -> Outcome {
    let gv = &golden()["variants"][variant.as_str()];
    assert!(gv.is_object(), "no golden values for {variant}");
    let cfg = golden_config(variant);
    let mut m: CtrModel = ctr::build(&cfg, DType::F64).expect("build");

    // parameters: PyTorch's order, names and shapes
    let gparams = array(&gv["parameters"], "parameters");
    assert_eq!(
        gparams.len(),
        m.params.len() + 1,
        "{variant}: the golden lists {} parameters (+ the table), the model has {}",
        gparams.len() - 1,
        m.params.len()
    );
    let mut rules = Vec::new();
    for (i, (name, t)) in m.params.iter().enumerate() {
        let gp = &gparams[i];
        assert_eq!(u64_of(&gp["index"], "index"), i as u64);
        assert_eq!(
            str_of(&gp["name"], "name"),
            name,
            "{variant}: parameter {i}"
        );
        let shape: Vec<usize> = array(&gp["shape"], "shape")
            .iter()
            .map(|v| u64_of(v, "shape") as usize)
            .collect();
        assert_eq!(
            m.graph.shape(*t).dims(),
            &shape[..],
            "{variant}: shape of {name}"
        );
        rules.push(str_of(&gp["init"], "init").to_string());
    }
    let gt = gparams.last().unwrap();
    assert_eq!(u64_of(&gt["index"], "index"), TABLE_INDEX);
    let table_shape: Vec<usize> = array(&gt["shape"], "shape")
        .iter()
        .map(|v| u64_of(v, "shape") as usize)
        .collect();
    assert_eq!(m.graph.shape(m.table).dims(), &table_shape[..]);
    let table_rule = str_of(&gt["init"], "init").to_string();

    // a second graph with the dense table gradient, then the training graph
    let mut dense_graph = m.graph.clone();
    let dense_grads = backward_with(
        &mut dense_graph,
        BackwardOptions {
            sparse_tables: false,
        },
    )
    .expect("backward_with dense tables");
    let training = make_trainable(&mut m.graph, &OptimizerConfig::default()).expect("trainable");
    assert!(
        matches!(training.grads.get(m.table), Some(Grad::Sparse { .. })),
        "the training graph must update the table through the sparse row-wise Adagrad path"
    );

    let (dense, rows, labels) = golden_batch();
    let cpu = CpuConfig {
        threads: 2,
        seed: 0,
    };
    let mut sessions = Vec::new();
    for g in [&m.graph, &dense_graph] {
        let mut s = CpuSession::new(g, cpu).expect("session");
        for (i, (_, t)) in m.params.iter().enumerate() {
            let v = init_values(&rules[i], i as u64, m.graph.shape(*t).dims());
            s.feed(*t, Buffer::F64(v)).expect("feed param");
        }
        let v = init_values(&table_rule, TABLE_INDEX, &table_shape);
        s.feed(m.table, Buffer::F64(v)).expect("feed table");
        ctr::feed_batch(&mut s, &m, dense, rows, labels).expect("feed batch");
        s.run().expect("run");
        sessions.push(s);
    }
    let (train, dense_s) = (&sessions[0], &sessions[1]);

    let mut w = Worst::default();
    // forward
    let logits = values(train, m.logit, "logit");
    let want_logits = array(&gv["logits"], "logits");
    assert_eq!(logits.len(), want_logits.len());
    for (i, (g, wv)) in logits.iter().zip(want_logits).enumerate() {
        w.check(|| format!("logit[{i}]"), *g, f64_of(wv, "logit"), 1e-12);
    }
    assert_eq!(
        logits,
        values(dense_s, m.logit, "logit"),
        "the two graphs' forwards differ"
    );
    let main_loss = train.scalar(m.main_loss).unwrap();
    w.check(
        || "main loss".into(),
        main_loss,
        f64_of(&gv["main_loss"], "main_loss"),
        1e-12,
    );
    let want_aux = array(&gv["aux_losses"], "aux_losses");
    assert_eq!(m.aux_losses.len(), want_aux.len(), "{variant}: aux losses");
    for (k, ((block, l), wv)) in m.aux_losses.iter().zip(want_aux).enumerate() {
        assert_eq!(block, BLOCKS[k]);
        let got = train.scalar(*l).unwrap();
        w.check(
            || format!("aux loss {block}"),
            got,
            f64_of(wv, "aux"),
            1e-12,
        );
    }

    // gradients (dense parameters from the training graph, the table from the dense one)
    let ggrads = array(&gv["grads"], "grads");
    let gafter = array(&gv["params_after_one_step"], "params_after_one_step");
    assert_eq!(ggrads.len(), m.params.len() + 1);
    assert_eq!(gafter.len(), m.params.len() + 1);
    for (i, (name, p)) in m.params.iter().enumerate() {
        let gt = dense_grad(&training.grads, *p, name);
        let gv_ = values(train, gt, name);
        let gd = values(dense_s, dense_grad(&dense_grads, *p, name), name);
        assert_eq!(gv_, gd, "{name}: gradient differs between the two graphs");
        check_digest(&mut w, "grad", name, i as u64, &gv_, &ggrads[i]);
    }
    let tg = values(
        dense_s,
        dense_grad(&dense_grads, m.table, "table"),
        "table grad",
    );
    check_digest(
        &mut w,
        "grad",
        "embedding_tables",
        TABLE_INDEX,
        &tg,
        ggrads.last().unwrap(),
    );

    // values after one step: Adam on dense parameters, row-wise Adagrad on the table
    for (i, (name, p)) in m.params.iter().enumerate() {
        let v = values(train, *p, name);
        check_digest(&mut w, "after-step value", name, i as u64, &v, &gafter[i]);
    }
    let tv = values(train, m.table, "table");
    check_digest(
        &mut w,
        "after-step value",
        "embedding_tables",
        TABLE_INDEX,
        &tv,
        gafter.last().unwrap(),
    );

    w.report(&format!("ctr golden {variant}"));
    Outcome {
        logits,
        main_loss,
        worst: w,
    }
}

fn outcome(variant: Variant) -> &'static Outcome {
    static BASE: OnceLock<Outcome> = OnceLock::new();
    static DET: OnceLock<Outcome> = OnceLock::new();
    let cell = match variant {
        Variant::Baseline => &BASE,
        Variant::Detached => &DET,
        Variant::Erase => panic!("the golden file has no erase values (it equals detached)"),
    };
    cell.get_or_init(|| run_golden(variant))
}

fn assert_within(variant: Variant) {
    let o = outcome(variant);
    assert!(
        o.worst.rel <= TOL,
        "{variant}: worst relative error {:.3e} > {TOL:e} at {} (got {:.17e}, want {:.17e})",
        o.worst.rel,
        o.worst.what,
        o.worst.got,
        o.worst.want
    );
}

#[test]
fn golden_baseline() {
    assert_within(Variant::Baseline);
}

#[test]
fn golden_detached() {
    assert_within(Variant::Detached);
}

#[test]
fn baseline_and_detached_share_the_forward() {
    let (b, d) = (outcome(Variant::Baseline), outcome(Variant::Detached));
    let mut worst = 0.0f64;
    for (x, y) in b.logits.iter().zip(&d.logits) {
        worst = worst.max((x - y).abs() / y.abs().max(1e-12));
    }
    worst = worst.max((b.main_loss - d.main_loss).abs() / d.main_loss.abs());
    println!("baseline vs detached: worst relative difference of logits and main loss {worst:.3e}");
    assert!(
        worst <= 1e-12,
        "the cuts must not change the forward function"
    );
}

// ---- small sizes -----------------------------------------------------------------------------

fn small_generator() -> &'static SyntheticCtr {
    static G: OnceLock<SyntheticCtr> = OnceLock::new();
    G.get_or_init(|| {
        SyntheticCtr::new(SyntheticConfig {
            seed: 0,
            rows: CtrConfig::small().rows,
            hot: 1,
        })
    })
}

struct SmallRun {
    /// Main loss of each step.
    main: Vec<f64>,
    /// `(PyTorch name, bytes)` of every dense parameter after the steps, then the table's.
    params: Vec<(String, Vec<u8>)>,
}

fn train_small(variant: Variant, steps: usize) -> SmallRun {
    let cfg = CtrConfig::small().with_variant(variant);
    let mut m = ctr::build(&cfg, DType::F32).expect("build small");
    assert_eq!(
        m.aux_losses.len(),
        if variant.is_detached() { 6 } else { 0 }
    );
    for block in BLOCKS.iter().chain(&["top", "embedding"]) {
        let prefix = format!("{block}/");
        assert!(
            m.graph.nodes().iter().any(|n| n.name.starts_with(&prefix)),
            "no node is scoped under '{block}'"
        );
    }
    make_trainable(&mut m.graph, &OptimizerConfig::default()).expect("make_trainable small");
    let mut s = CpuSession::new(
        &m.graph,
        CpuConfig {
            threads: 2,
            seed: 0,
        },
    )
    .expect("session");
    let gen = small_generator();
    let mut dense = vec![0.0f32; cfg.batch * cfg.num_dense];
    let mut rows = vec![0u32; cfg.ids_per_batch()];
    let mut labels = vec![0.0f32; cfg.batch];
    let mut main = Vec::new();
    for step in 0..steps {
        gen.fill_batch(
            STREAM_TRAIN,
            (step * cfg.batch) as u64,
            cfg.batch,
            &mut dense,
            &mut rows,
            &mut labels,
        );
        ctr::feed_batch(&mut s, &m, &dense, &rows, &labels).expect("feed");
        s.run().expect("step");
        let l = s.scalar(m.main_loss).unwrap();
        assert!(l.is_finite(), "{variant} step {step}: main loss {l}");
        main.push(l);
        for (block, a) in &m.aux_losses {
            let v = s.scalar(*a).unwrap();
            assert!(v.is_finite(), "{variant} step {step}: aux loss {block} {v}");
        }
    }
    let mut params: Vec<(String, Vec<u8>)> = m
        .params
        .iter()
        .map(|(n, t)| (n.clone(), s.get(*t).unwrap().bytes().to_vec()))
        .collect();
    params.push((
        "embedding_tables".into(),
        s.get(m.table).unwrap().bytes().to_vec(),
    ));
    SmallRun { main, params }
}

#[test]
fn small_config_trains_every_variant() {
    let steps = 3;
    let base = train_small(Variant::Baseline, steps);
    let det = train_small(Variant::Detached, steps);
    let erase = train_small(Variant::Erase, steps);
    println!(
        "small: main loss per step: baseline {:?}, detached {:?}, erase {:?}",
        base.main, det.main, erase.main
    );
    // the first step's forward is the same function, with the same default init of every
    // shared parameter, in every variant
    assert_eq!(base.main[0].to_bits(), det.main[0].to_bits());
    // detached and erase are one graph: bit-identical after 3 steps
    assert_eq!(det.params.len(), erase.params.len());
    for ((n, a), (_, b)) in det.params.iter().zip(&erase.params) {
        assert!(a == b, "{n}: detached and erase differ after {steps} steps");
    }
    // baseline trains differently (no cuts, no heads)
    let differs = base.params.iter().any(|(n, a)| {
        det.params
            .iter()
            .find(|(m, _)| m == n)
            .is_some_and(|(_, b)| a != b)
    });
    assert!(differs, "baseline and detached gave identical parameters");
}

#[test]
fn config_validation_and_variant_names() {
    assert!(CtrConfig::default().validate().is_ok());
    assert!(CtrConfig::small().validate().is_ok());
    let bad = CtrConfig {
        dim: 0,
        ..CtrConfig::small()
    };
    let e = bad.validate().unwrap_err().to_string();
    assert!(e.contains("dim"), "{e}");
    let bad = CtrConfig {
        deep: vec![8, 0],
        ..CtrConfig::small()
    };
    let e = ctr::build(&bad, DType::F32).unwrap_err().to_string();
    assert!(e.contains("deep[1]"), "{e}");
    let bad = CtrConfig {
        aux_weight: f64::NAN,
        ..CtrConfig::small()
    };
    assert!(bad.validate().is_err());
    assert!(ctr::build(&CtrConfig::small(), DType::I32).is_err());
    for v in Variant::ALL {
        assert_eq!(v.to_string().parse::<Variant>().unwrap(), v);
    }
    assert!("fast".parse::<Variant>().is_err());
    // batch buffers refuse wrong sizes and out-of-range rows
    let cfg = CtrConfig {
        batch: 2,
        ..CtrConfig::small()
    };
    let dense = vec![0.0f32; 2 * 13];
    let labels = vec![0.0f32; 2];
    let mut rows = vec![0u32; 2 * 26];
    assert!(ctr::batch_buffers(&cfg, DType::F64, &dense, &rows, &labels).is_ok());
    rows[30] = cfg.rows as u32;
    let e = ctr::batch_buffers(&cfg, DType::F32, &dense, &rows, &labels)
        .unwrap_err()
        .to_string();
    assert!(e.contains("example 1, field 4"), "{e}");
    assert!(ctr::batch_buffers(&cfg, DType::F32, &dense[1..], &rows, &labels).is_err());
}
