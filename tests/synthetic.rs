//! The synthetic CTR generator against the anchor's golden examples
//! (`tests/data/synthetic_golden.json`, a copy of `shared/anchors/synthetic_golden.json`).

use std::sync::OnceLock;

use erase::data::synthetic::*;
use serde_json::Value;

fn golden() -> Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/synthetic_golden.json"
    );
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {path}: {e}"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("parse {path}: {e}"))
}

fn u64_of(v: &Value, what: &str) -> u64 {
    v.as_u64()
        .unwrap_or_else(|| panic!("{what}: not an unsigned integer: {v}"))
}

fn f64_of(v: &Value, what: &str) -> f64 {
    v.as_f64()
        .unwrap_or_else(|| panic!("{what}: not a number: {v}"))
}

fn array<'a>(v: &'a Value, what: &str) -> &'a Vec<Value> {
    v.as_array()
        .unwrap_or_else(|| panic!("{what}: not an array"))
}

/// The default generator (seed 0, 100_000 rows), built once for the whole file.
fn spec_generator() -> &'static SyntheticCtr {
    static GEN: OnceLock<SyntheticCtr> = OnceLock::new();
    GEN.get_or_init(|| SyntheticCtr::new(SyntheticConfig::default()))
}

#[test]
fn matches_anchor_golden_examples() {
    let g = golden();
    let cfg = SyntheticConfig {
        seed: u64_of(&g["data_seed"], "data_seed"),
        rows: u64_of(&g["rows"], "rows") as usize,
        hot: 1,
    };
    assert_eq!(
        cfg,
        SyntheticConfig::default(),
        "the golden file is the spec's default"
    );
    let gen = spec_generator();

    let want_shift = f64_of(&g["shift"], "shift");
    assert!(
        (gen.shift() - want_shift).abs() < 1e-9,
        "shift {} vs anchor {}",
        gen.shift(),
        want_shift
    );

    let examples = array(&g["examples"], "examples");
    assert!(!examples.is_empty());
    for e in examples {
        let stream = u64_of(&e["stream"], "stream");
        let index = u64_of(&e["index"], "index");
        let at = format!("stream {stream} index {index}");
        let ex = gen.example(stream, index);

        let rows = array(&e["rows_per_field"], "rows_per_field");
        let global = array(&e["ids_global_rows"], "ids_global_rows");
        assert_eq!(rows.len(), NUM_SPARSE, "{at}");
        assert_eq!(global.len(), NUM_SPARSE, "{at}");
        for j in 0..NUM_SPARSE {
            assert_eq!(
                ex.rows[j] as u64,
                u64_of(&rows[j], "row"),
                "{at} field {j} row"
            );
            assert_eq!(
                gen.global_row(j, ex.rows[j]),
                u64_of(&global[j], "global row"),
                "{at} field {j} global row"
            );
        }

        let dense = array(&e["dense"], "dense");
        assert_eq!(dense.len(), NUM_DENSE, "{at}");
        for (t, (&got, want)) in ex.dense.iter().zip(dense).enumerate() {
            // The anchor stores the f32 feature widened to f64: equal after rounding.
            let want = f64_of(want, "dense") as f32;
            assert_eq!(
                got.to_bits(),
                want.to_bits(),
                "{at} dense {t}: {got} vs {want}"
            );
        }

        assert_eq!(ex.label, f64_of(&e["label"], "label") as f32, "{at} label");

        // fill_batch gives the same example at the same index.
        let (mut d, mut r, mut l) = ([0f32; NUM_DENSE], [0u32; NUM_SPARSE], [0f32; 1]);
        gen.fill_batch(stream, index, 1, &mut d, &mut r, &mut l);
        assert_eq!(
            (d, r, l[0]),
            (ex.dense, ex.rows, ex.label),
            "{at} fill_batch"
        );
    }
}

#[test]
fn same_seed_same_examples_any_thread_count() {
    let cfg = SyntheticConfig {
        seed: 7,
        rows: 5000,
        hot: 1,
    };
    let a = SyntheticCtr::with_threads(cfg, 1).unwrap_or_else(|e| panic!("{e}"));
    let b = SyntheticCtr::with_threads(cfg, 3).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(a.shift().to_bits(), b.shift().to_bits());
    for stream in [1u64, 2] {
        for i in (0..2000u64).chain([1 << 40, u64::MAX]) {
            let (x, y) = (a.example(stream, i), b.example(stream, i));
            assert_eq!(x, y, "stream {stream} index {i}");
            assert_eq!(x.teacher.to_bits(), y.teacher.to_bits());
        }
    }
    // A different seed gives different data.
    let c = SyntheticCtr::new(SyntheticConfig { seed: 8, ..cfg });
    assert_ne!(a.example(1, 0).rows, c.example(1, 0).rows);
}

#[test]
fn batches_match_examples_and_multi_hot_layout() {
    let cfg = SyntheticConfig {
        seed: 0,
        rows: 1000,
        hot: 3,
    };
    let gen = SyntheticCtr::new(cfg);
    let (first, batch) = (4090u64, 3000usize); // large enough to split over threads
    let mut dense = vec![0f32; batch * NUM_DENSE];
    let mut rows = vec![0u32; batch * NUM_SPARSE * cfg.hot];
    let mut labels = vec![0f32; batch];
    gen.fill_batch(1, first, batch, &mut dense, &mut rows, &mut labels);
    for k in 0..batch {
        let ex = gen.example(1, first + k as u64);
        assert_eq!(&dense[k * NUM_DENSE..(k + 1) * NUM_DENSE], &ex.dense);
        assert_eq!(labels[k], ex.label);
        for j in 0..NUM_SPARSE {
            for h in 0..cfg.hot {
                let got = rows[(k * NUM_SPARSE + j) * cfg.hot + h];
                let want = (ex.rows[j] as u64 + h as u64 * 7919) % cfg.rows as u64;
                assert_eq!(got as u64, want, "example {k} field {j} hot {h}");
            }
        }
    }
}

#[test]
fn positive_rate_is_calibrated() {
    let gen = spec_generator();
    let n = 20_000usize;
    let mut dense = vec![0f32; n * NUM_DENSE];
    let mut rows = vec![0u32; n * NUM_SPARSE];
    let mut labels = vec![0f32; n];
    gen.fill_batch(1, 0, n, &mut dense, &mut rows, &mut labels);
    let rate = labels.iter().map(|&y| y as f64).sum::<f64>() / n as f64;
    assert!((rate - 0.25).abs() < 0.02, "positive rate {rate}");

    // The teacher's own NE on these labels: the spec's best achievable, about 0.767.
    let mut logits = vec![0f64; n];
    gen.fill_teacher_logits(1, 0, &mut logits);
    let bce = logits
        .iter()
        .zip(&labels)
        .map(|(&z, &y)| z.max(0.0) - z * y as f64 + (-z.abs()).exp().ln_1p())
        .sum::<f64>()
        / n as f64;
    let base = -(rate * rate.ln() + (1.0 - rate) * (1.0 - rate).ln());
    let ne = bce / base;
    assert!((ne - 0.767).abs() < 0.02, "teacher NE {ne}");
}
