//! The model API and the zoo: each of the field's standard models trains on the spec's
//! synthetic data and learns, its `detached` and `erase` variants give the same bits,
//! its blocks are cut as it marks them, and a model of one's own (the
//! `custom_model` example) gets the whole command line.

mod common;

use erase::model::ctr::{CtrConfig, Variant};
use erase::train::{train, Eval, Progress, TrainConfig};

struct Quiet;
impl Progress for Quiet {
    fn step(&mut self, _: usize, _: usize, _: f64, _: f64) {}
    fn eval(&mut self, _: &Eval) {}
}

fn cfg(model: &str, variant: Variant, steps: usize) -> TrainConfig {
    let model = CtrConfig {
        model: model.to_string(),
        batch: 128,
        rows: 500,
        ..CtrConfig::small()
    }
    .with_variant(variant);
    TrainConfig {
        eval_examples: 4096,
        threads: 2,
        ..TrainConfig::new(model, steps)
    }
}

#[test]
fn every_zoo_model_learns_and_its_detached_and_erase_variants_agree_bit_for_bit() {
    for name in ["dlrm", "dcnv2", "deepfm"] {
        // learns: NE on 4096 held-out examples of the spec's stream after 80 steps
        let r = train(&cfg(name, Variant::Erase, 80), &mut Quiet).unwrap();
        let ne = r.evals.last().unwrap().ne;
        assert!(ne < 0.98, "{name}: NE {ne} after 80 steps");
        assert!(r.losses.iter().all(|l| l.is_finite()));
        // the schedule alone differs between detached and erase
        let d = train(&cfg(name, Variant::Detached, 12), &mut Quiet).unwrap();
        let e = train(&cfg(name, Variant::Erase, 12), &mut Quiet).unwrap();
        let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&d.losses),
            bits(&e.losses),
            "{name}: detached and erase differ"
        );
        assert_eq!(
            d.evals.last().unwrap().ne.to_bits(),
            e.evals.last().unwrap().ne.to_bits()
        );
    }
}

#[test]
fn the_zoo_models_blocks_are_cut_where_they_mark_them() {
    let opt = erase::graph::OptimizerConfig::default();
    for (name, blocks) in [
        ("dlrm", vec!["bottom"]),
        ("dcnv2", vec!["bottom", "cross"]),
        ("deepfm", vec!["deep"]),
    ] {
        let c = cfg(name, Variant::Erase, 1).model;
        let p = erase::train::plan_step(&c, erase::graph::DType::F32, &opt, &Default::default())
            .unwrap();
        let early: Vec<&str> = p
            .partition
            .programs
            .iter()
            .filter(|x| x.early)
            .map(|x| x.name.as_str())
            .collect();
        for b in &blocks {
            assert!(
                early.contains(b),
                "{name}: no early program for block '{b}' ({early:?})"
            );
        }
        assert_eq!(p.model.aux_losses.len(), blocks.len(), "{name}");
        // baseline ignores the marks
        let base = erase::train::plan_step(
            &c.clone().with_variant(Variant::Baseline),
            erase::graph::DType::F32,
            &opt,
            &Default::default(),
        )
        .unwrap();
        assert!(base.model.aux_losses.is_empty());
    }
    // an unknown model is a clear error listing the models
    let bad = CtrConfig {
        model: "nope".into(),
        ..CtrConfig::small()
    };
    let e = erase::model::ctr::build(&bad, erase::graph::DType::F32).unwrap_err();
    assert!(
        format!("{e:#}").contains("unknown model 'nope' (models: spec, dlrm"),
        "{e:#}"
    );
}

/// The example's model, as its binary has it.
#[allow(dead_code)]
#[path = "../examples/custom_model.rs"]
mod custom_model;

#[test]
fn a_custom_model_gets_the_whole_command_line() {
    // what `erase::cli::main_with(Arc::new(TwoTower))` does, with the arguments given
    erase::model::api::register(std::sync::Arc::new(custom_model::TwoTower));
    let args = |a: &[&str]| -> Vec<std::ffi::OsString> {
        std::iter::once("custom_model")
            .chain(a.iter().copied())
            .map(Into::into)
            .collect()
    };
    let dir = common::TempDir::new("zoo");
    let ck = dir.join("tt.st");
    let ckp = ck.to_str().unwrap();
    erase::cli::run(args(&[
        "train",
        "--model",
        "two-tower",
        "--device",
        "cpu",
        "--steps",
        "40",
        "--eval-every",
        "0",
        "--eval-examples",
        "2048",
        "--threads",
        "2",
        "--checkpoint",
        ckp,
    ]))
    .unwrap();
    // the checkpoint records the model: eval builds it again without being told
    let st = erase::checkpoint::peek(&ck).unwrap();
    assert_eq!(st.get("model.model"), Some("\"two-tower\""));
    erase::cli::run(args(&["plan", "--model", "two-tower"])).unwrap();
    erase::cli::run(args(&[
        "bench",
        "--model",
        "two-tower",
        "--device",
        "cpu",
        "--warmup",
        "2",
        "--steps",
        "4",
        "--chunk",
        "2",
        "--eval-examples",
        "256",
    ]))
    .unwrap();
    // and the model learns with the trainer's loop
    // (the small preset's sizes, as `erase-ctr train` uses them)
    let model = CtrConfig {
        model: "two-tower".into(),
        ..CtrConfig::small()
    };
    let c = TrainConfig {
        eval_examples: 4096,
        threads: 2,
        ..TrainConfig::new(model, 60)
    };
    let r = train(&c, &mut Quiet).unwrap();
    let ne = r.evals.last().unwrap().ne;
    assert!(ne < 0.99, "two-tower: NE {ne}");
}
