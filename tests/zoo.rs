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
    let names = erase::model::zoo::names();
    assert!(names.len() >= 3, "{names:?}");
    for name in &names {
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
    let expected = [
        ("dlrm", vec!["bottom"]),
        ("dcnv2", vec!["bottom", "cross"]),
        ("deepfm", vec!["deep"]),
    ];
    // a model added to the zoo names its blocks here
    let listed: Vec<String> = expected.iter().map(|(n, _)| n.to_string()).collect();
    assert_eq!(
        listed,
        erase::model::zoo::names(),
        "every zoo model's blocks"
    );
    for (name, blocks) in expected {
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
    erase::model::api::register(std::sync::Arc::new(custom_model::TwoTower)).unwrap();
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

/// A model of the API for one misuse (`case`), to see that building it is refused with a
/// message naming what is wrong.
struct Misuse(&'static str);

impl erase::model::api::Model for Misuse {
    fn name(&self) -> &str {
        self.0
    }
    fn build(
        &self,
        g: &mut erase::graph::Graph,
        x: &erase::model::api::ModelInputs,
        _: &erase::model::ctr::CtrConfig,
        b: &mut erase::model::api::Blocks,
    ) -> anyhow::Result<erase::graph::Tensor> {
        let flat = g.flatten(x.fields)?;
        let u = g.scoped("u", |g| g.linear(flat, 8))?;
        let logit = |g: &mut erase::graph::Graph, t| -> anyhow::Result<_> {
            let y = g.scoped("top", |g| g.linear(t, 1))?;
            Ok(g.reshape(y, &[x.batch])?)
        };
        match self.0 {
            "label" => Ok(x.label),
            "relu" | "relu-original" => {
                let r = g.scoped("u", |g| g.relu(u))?;
                let cut = b.mark(g, "u", r)?;
                logit(g, if self.0 == "relu" { cut } else { r })
            }
            "input" => {
                let extra = g.input("extra", &[x.batch, 3], erase::graph::DType::F32)?;
                let h = g.concat(&[flat, extra], 1)?;
                logit(g, h)
            }
            "constant" => Ok(g.constant("c", &[x.batch], vec![0.5; x.batch])?),
            "read-original" => {
                let _ = b.mark(g, "u", u)?;
                logit(g, u)
            }
            "unread" => {
                let _ = b.mark(g, "u", u)?;
                logit(g, flat)
            }
            "input-block" => {
                let cut = b.mark(g, "inputs", flat)?;
                let h = g.scoped("h", |g| g.linear(cut, 8))?;
                logit(g, h)
            }
            "logit-block" => {
                let y = logit(g, u)?;
                b.mark(g, "u", y)
            }
            "twice" => {
                let a = b.mark(g, "u", u)?;
                let v = g.scoped("v", |g| g.linear(a, 8))?;
                let c = b.mark(g, "u", v)?;
                logit(g, c)
            }
            "column" => {
                let y = logit(g, u)?;
                Ok(g.reshape(y, &[x.batch, 1])?)
            }
            _ => {
                let cut = b.mark(g, "u", u)?;
                logit(g, cut)
            }
        }
    }
}

#[test]
fn a_models_misuse_of_the_api_is_refused_naming_it() {
    use erase::model::api::register;
    use std::sync::Arc;
    let e = register(Arc::new(Misuse("spec"))).unwrap_err();
    assert!(format!("{e:#}").contains("cannot be named 'spec'"), "{e:#}");
    let build = |case: &'static str, variant: Variant| {
        register(Arc::new(Misuse(case))).unwrap();
        let mut c = cfg(case, variant, 1).model;
        c.batch = 16;
        erase::model::ctr::build(&c, erase::graph::DType::F32).map(|_| ())
    };
    // the well-formed one builds in every variant
    for v in [Variant::Baseline, Variant::Erase] {
        build("fine", v).unwrap();
    }
    // with bf16 copies of every layer's operands (as on a GPU), a block whose last op
    // cannot write the copy itself (a ReLU) gets a RoundBf16 of its output: the rest
    // reads it through the cut, or, reading the output itself, is refused
    let with_copies = |case: &'static str| {
        register(Arc::new(Misuse(case))).unwrap();
        let mut c = cfg(case, Variant::Erase, 1).model;
        c.batch = 16;
        erase::model::ctr::build_with(&c, erase::graph::DType::F32, Some(0), Default::default())
            .map(|_| ())
    };
    with_copies("relu").unwrap();
    with_copies("fine").unwrap();
    for case in ["relu-original", "read-original"] {
        let e = with_copies(case).expect_err(case);
        assert!(
            format!("{e:#}").contains("reads block 'u''s output"),
            "{case}: {e:#}"
        );
    }
    for (case, variants, want) in [
        ("label", &[Variant::Erase][..], "computed from the label"),
        ("input", &[Variant::Baseline], "adds an input 'extra'"),
        ("constant", &[Variant::Erase], "computed from no parameter"),
        (
            "read-original",
            &[Variant::Erase],
            "node 'top/linear0' reads block 'u''s output",
        ),
        (
            "unread",
            &[Variant::Baseline, Variant::Erase],
            "the logit does not read block 'u'",
        ),
        (
            "input-block",
            &[Variant::Baseline, Variant::Erase],
            "block 'inputs' has no parameter of its own",
        ),
        (
            "logit-block",
            &[Variant::Baseline, Variant::Erase],
            "a block's output is [batch = 16, features..]",
        ),
        ("twice", &[Variant::Baseline], "block 'u' is marked twice"),
        ("column", &[Variant::Baseline], "g.reshape(logit, &[batch])"),
    ] {
        for &v in variants {
            let e = build(case, v).expect_err(case);
            assert!(format!("{e:#}").contains(want), "{case} ({v:?}): {e:#}");
        }
    }
}
