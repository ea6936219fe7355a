//! Checkpoints: resuming gives the same bits as not stopping; a truncated or foreign
//! checkpoint is refused with a clear error; a non-finite loss stops training naming the
//! step and the block.

mod common;

use erase::graph::DenseOptimizer;
use erase::model::ctr::CtrConfig;
use erase::train::{train, Eval, Progress, TrainConfig};

struct Quiet;
impl Progress for Quiet {
    fn step(&mut self, _: usize, _: usize, _: f64, _: f64) {}
    fn eval(&mut self, _: &Eval) {}
}

fn cfg(steps: usize, dir: &std::path::Path, name: &str) -> TrainConfig {
    let mut model = CtrConfig::small();
    model.batch = 32;
    model.rows = 100;
    TrainConfig {
        seed: 3,
        data_seed: 1,
        eval_examples: 32,
        threads: 2,
        checkpoint: Some(dir.join(name)),
        ..TrainConfig::new(model, steps)
    }
}

fn tensors(path: &std::path::Path) -> Vec<(String, Vec<u8>)> {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut v: Vec<(String, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, t)| (n, t.data().to_vec()))
        .collect();
    v.sort();
    v
}

fn tmpdir(tag: &str) -> common::TempDir {
    common::TempDir::new(&format!("ckpt-{tag}"))
}

#[test]
fn resume_equals_an_uninterrupted_run_bit_for_bit() {
    let d = tmpdir("resume");
    let straight = train(&cfg(6, &d, "straight.safetensors"), &mut Quiet).unwrap();
    train(&cfg(3, &d, "half.safetensors"), &mut Quiet).unwrap();
    let mut second = cfg(6, &d, "resumed.safetensors");
    second.resume = Some(d.join("half.safetensors"));
    let resumed = train(&second, &mut Quiet).unwrap();
    let (a, b) = (
        tensors(&d.join("straight.safetensors")),
        tensors(&d.join("resumed.safetensors")),
    );
    assert!(a.len() > 50, "{} tensors", a.len());
    for ((na, ta), (nb, tb)) in a.iter().zip(&b) {
        assert_eq!(na, nb);
        assert!(ta == tb, "'{na}' differs after resuming");
    }
    assert_eq!(
        straight.losses[3..],
        resumed.losses[..],
        "losses after the resume differ"
    );
    // the optimizer state is in the checkpoint too
    assert!(
        a.iter().any(|(n, _)| n.ends_with("adam_m"))
            && a.iter().any(|(n, _)| n.contains("adagrad_acc"))
    );
}

#[test]
fn truncated_foreign_or_mismatched_checkpoints_are_refused() {
    let d = tmpdir("bad");
    train(&cfg(1, &d, "ok.safetensors"), &mut Quiet).unwrap();
    let bytes = std::fs::read(d.join("ok.safetensors")).unwrap();
    std::fs::write(d.join("cut.safetensors"), &bytes[..bytes.len() / 2]).unwrap();
    let mut c = cfg(2, &d, "out.safetensors");
    c.resume = Some(d.join("cut.safetensors"));
    let e = format!("{:#}", train(&c, &mut Quiet).unwrap_err());
    assert!(
        e.contains("cut.safetensors") && e.contains("not a complete checkpoint"),
        "{e}"
    );
    // peek reads the header alone, and checks the length it lists
    let state = erase::checkpoint::peek(&d.join("ok.safetensors")).unwrap();
    assert_eq!(state.step, 1);
    let e = format!(
        "{:#}",
        erase::checkpoint::peek(&d.join("cut.safetensors")).unwrap_err()
    );
    assert!(e.contains("not a complete checkpoint"), "{e}");
    let mut longer = bytes.clone();
    longer.extend_from_slice(b"tail");
    std::fs::write(d.join("long.safetensors"), &longer).unwrap();
    let e = format!(
        "{:#}",
        erase::checkpoint::peek(&d.join("long.safetensors")).unwrap_err()
    );
    assert!(e.contains("its header lists"), "{e}");
    std::fs::write(d.join("tiny.safetensors"), b"abc").unwrap();
    let e = format!(
        "{:#}",
        erase::checkpoint::peek(&d.join("tiny.safetensors")).unwrap_err()
    );
    assert!(e.contains("not a complete checkpoint"), "{e}");
    // another configuration
    let mut other = cfg(2, &d, "out.safetensors");
    other.seed = 4;
    other.resume = Some(d.join("ok.safetensors"));
    let e = format!("{:#}", train(&other, &mut Quiet).unwrap_err());
    assert!(e.contains("another configuration"), "{e}");
    // missing file
    let mut miss = cfg(2, &d, "out.safetensors");
    miss.resume = Some(d.join("nope.safetensors"));
    let e = format!("{:#}", train(&miss, &mut Quiet).unwrap_err());
    assert!(e.contains("nope.safetensors"), "{e}");
    // no temporary files left behind
    let leftovers: Vec<_> = std::fs::read_dir(&d)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains(".tmp-"))
        .collect();
    assert!(leftovers.is_empty());
}

#[test]
fn a_non_finite_loss_stops_training_naming_step_and_block() {
    let d = tmpdir("nan");
    let mut c = cfg(20, &d, "x.safetensors");
    c.optimizer.dense = DenseOptimizer::Adam {
        lr: 1e30,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
    };
    let e = format!("{:#}", train(&c, &mut Quiet).unwrap_err());
    assert!(
        e.starts_with("step ") && e.contains("loss") && e.contains("block '"),
        "{e}"
    );
    assert!(
        !d.join("x.safetensors").exists(),
        "no checkpoint of a diverged run"
    );
}

#[test]
fn evaluating_a_checkpoint_gives_the_training_runs_final_metrics() {
    use erase::graph::DType;
    use erase::train::{plan_step, Data, Session};
    let d = tmpdir("eval");
    let c = cfg(3, &d, "e.safetensors");
    let report = train(&c, &mut Quiet).unwrap();
    let last = *report.evals.last().unwrap();
    let plan = plan_step(&c.model, DType::F32, &c.optimizer, &c.schedule).unwrap();
    // another seed: the weights must come from the checkpoint, not the initialisation
    let mut s = Session::new(&plan, None, 99, c.data_seed, 2).unwrap();
    let before = s.evaluate(c.eval_examples).unwrap();
    assert_eq!(s.load_weights(&d.join("e.safetensors")).unwrap(), 3);
    let after = s.evaluate(c.eval_examples).unwrap();
    assert_eq!((after.ne, after.auc), (last.ne, last.auc));
    assert_ne!(before.ne, after.ne);
    // a checkpoint of another model size is refused, naming the tensor
    let mut other = c.model.clone();
    other.dim = 8;
    let plan2 = plan_step(&other, DType::F32, &c.optimizer, &c.schedule).unwrap();
    let mut s2 =
        Session::with_dispatch(&plan2, None, Default::default(), &Data::Synthetic, 0, 1, 2)
            .unwrap();
    let e = format!(
        "{:#}",
        s2.load_weights(&d.join("e.safetensors")).unwrap_err()
    );
    assert!(
        e.contains("tensor '") && e.contains("the model needs"),
        "{e}"
    );
}

/// Where the weights' bf16 copies are made (by Adam, or in each forward) changes no value,
/// so it is no part of a checkpoint's identity: a run resumes a checkpoint written under
/// the other (or before the switch existed). The rest of the optimizer is.
#[test]
fn where_the_weights_copies_are_made_is_no_part_of_a_checkpoints_identity() {
    let d = tmpdir("copies");
    let mut c = cfg(1, &d, "x.safetensors");
    let keys =
        |c: &TrainConfig| -> Vec<String> { c.identity().into_iter().map(|kv| kv.0).collect() };
    assert!(keys(&c).iter().any(|k| k == "optimizer.presort_ids"));
    assert!(
        !keys(&c).iter().any(|k| k.contains("copies")),
        "{:?}",
        keys(&c)
    );
    let before = c.identity();
    c.optimizer.copies_in_update = !c.optimizer.copies_in_update;
    assert_eq!(c.identity(), before);
}
