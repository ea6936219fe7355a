//! Data parallelism on CPU ranks: replicas stay bit-identical, every rank issues the same
//! collectives in the same order, one rank is the same as plain training, and a rank
//! that dies takes the others down with an error instead of a hang.

mod common;

use std::time::{Duration, Instant};

use erase::distributed::{evaluate_replica, train_data_parallel_cpu, FailAt};
use erase::model::ctr::CtrConfig;
use erase::train::{plan_step, Session, StepPlan, TrainConfig};

fn cfg(steps: usize) -> TrainConfig {
    let mut model = CtrConfig::small();
    model.batch = 64;
    model.rows = 100;
    TrainConfig {
        seed: 7,
        data_seed: 3,
        eval_examples: 64,
        ..TrainConfig::new(model, steps)
    }
}

/// The step plan of `c` in one process (the reference a data-parallel run is held to).
fn single_process(c: &TrainConfig) -> StepPlan {
    plan_step(
        &c.model,
        erase::graph::DType::F32,
        &c.optimizer,
        &c.schedule,
    )
    .unwrap()
}

#[test]
fn replicas_stay_bit_identical_on_2_and_4_ranks() {
    for world in [2, 4] {
        let results =
            train_data_parallel_cpu(&cfg(20), world, Duration::from_secs(60), None).unwrap();
        let ok: Vec<_> = results.into_iter().map(|r| r.unwrap()).collect();
        assert_eq!(ok.len(), world);
        for r in &ok[1..] {
            assert!(
                r.state == ok[0].state,
                "{world} ranks: rank {} differs from rank 0 after 20 steps",
                r.rank
            );
            assert_eq!(
                r.log, ok[0].log,
                "{world} ranks: rank {} issued other collectives",
                r.rank
            );
        }
        // one bucket per backward program and three gathers for the table, every step
        let per_step = ok[0].log.len().saturating_sub(1) / 20;
        assert!(per_step >= 7 + 3, "{per_step} collectives a step");
        // shards differ, so the ranks' losses differ while their parameters agree
        assert_ne!(ok[0].losses, ok[1].losses);
        assert!(ok.iter().all(|r| r.losses.iter().all(|l| l.is_finite())));
    }
}

#[test]
fn one_rank_is_plain_training() {
    let c = cfg(5);
    let ranks = train_data_parallel_cpu(&c, 1, Duration::from_secs(60), None).unwrap();
    let dp = ranks.into_iter().next().unwrap().unwrap();
    let plan = single_process(&c);
    let mut s = Session::new(&plan, None, c.seed, c.data_seed, 1).unwrap();
    let mut losses = Vec::new();
    for _ in 0..5 {
        losses.push(s.train_step_now().unwrap().loss);
    }
    assert_eq!(
        dp.losses, losses,
        "one data-parallel rank must train exactly as one process"
    );
    let single = s.evaluate(c.eval_examples).unwrap();
    let e = evaluate_replica(&c, &dp, None).unwrap();
    assert_eq!(
        (e.ne, e.auc, e.examples),
        (single.ne, single.auc, single.examples),
        "one data-parallel rank must evaluate exactly as one process"
    );
}

#[test]
fn rank_0_reports_the_held_out_ne_of_the_run() {
    let mut c = cfg(20);
    c.eval_examples = 128;
    let ranks = train_data_parallel_cpu(&c, 2, Duration::from_secs(60), None).unwrap();
    let ranks: Vec<_> = ranks.into_iter().map(|r| r.unwrap()).collect();
    let e = evaluate_replica(&c, &ranks[0], None).unwrap();
    assert_eq!(e.examples, 128, "two whole global batches of held-out data");
    assert_eq!(e.step, 0, "a fresh session at the global batch evaluates");
    // the same run in one process: the shards' mean gradient is the global batch's up
    // to rounding, so the held-out NE agrees closely (and differs from an untrained one)
    let plan = single_process(&c);
    let mut s = Session::new(&plan, None, c.seed, c.data_seed, 1).unwrap();
    let untrained = s.evaluate(c.eval_examples).unwrap();
    for _ in 0..20 {
        s.train_step_now().unwrap();
    }
    let single = s.evaluate(c.eval_examples).unwrap();
    assert!(
        (e.ne - single.ne).abs() <= 1e-5 * single.ne,
        "NE {} on 2 ranks against {} in one process",
        e.ne,
        single.ne
    );
    assert!(
        (e.ne - untrained.ne).abs() > 10.0 * (e.ne - single.ne).abs(),
        "NE {} on 2 ranks, {} untrained, {} in one process: the replica's parameters did not reach the evaluation",
        e.ne,
        untrained.ne,
        single.ne
    );
}

#[test]
fn a_dying_rank_stops_the_others_within_the_timeout() {
    let timeout = Duration::from_secs(3);
    let t0 = Instant::now();
    let results = train_data_parallel_cpu(
        &cfg(10),
        2,
        timeout,
        Some(FailAt {
            rank: 1,
            step: 3,
            how: Default::default(),
        }),
    )
    .unwrap();
    assert!(
        t0.elapsed() < Duration::from_secs(30),
        "took {:?}",
        t0.elapsed()
    );
    let e1 = format!("{:#}", results[1].as_ref().unwrap_err());
    assert!(e1.contains("rank 1 failed on purpose at step 3"), "{e1}");
    let e0 = format!("{:#}", results[0].as_ref().unwrap_err());
    assert!(
        e0.contains("rank 0") && (e0.contains("abort") || e0.contains("dropped")),
        "{e0}"
    );
}

#[test]
fn data_parallel_plans_sort_the_gathered_ids_in_the_update() {
    use erase::graph::Op;
    let c = cfg(1);
    let count = |p: &StepPlan| -> (usize, Vec<usize>) {
        let g = &p.model.graph;
        let sorts = g
            .nodes()
            .iter()
            .filter(|n| matches!(n.op, Op::EmbeddingSort { .. }))
            .count();
        let inputs = g
            .nodes()
            .iter()
            .filter(|n| matches!(n.op, Op::RowwiseAdagrad { .. }))
            .map(|n| n.inputs.len())
            .collect();
        (sorts, inputs)
    };
    // one process: the ids' sort is a node of its own, read by the update
    assert_eq!(count(&single_process(&c)), (1, vec![5]));
    // data parallel: each rank gathers every rank's ids at the update and sorts there
    let dp = erase::train::plan_step_data_parallel(
        &c.model,
        erase::graph::DType::F32,
        &c.optimizer,
        &c.schedule,
    )
    .unwrap();
    assert_eq!(count(&dp), (0, vec![3]));
    // and each early program on one stream: its gradients are all-reduced after its last
    // launch, on that launch's stream (no weight-gradient companions)
    // (and the blocks' forwards on main: one process puts them on streams of their own
    // after the pool and its companions)
    let sides = c.schedule.side_streams;
    let one = single_process(&c).program;
    assert_eq!(
        one.forward_from,
        Some(erase::runtime::program::schedule::StreamId(
            1 + 2 * sides as u16
        ))
    );
    assert_eq!(dp.program.streams, 1 + sides);
    assert_eq!(dp.program.forward_from, None);
}

/// Loaded examples of a test sample, as `erase-ctr` holds them (a tenth held out).
fn loaded(src: &erase::data::DataSource) -> erase::train::Data {
    let (train, _, _) = erase::data::load(src, &Default::default()).unwrap();
    let (tr, ev) = train.split_tail(0.1).unwrap();
    erase::train::Data::Table {
        train: std::sync::Arc::new(tr),
        eval: std::sync::Arc::new(ev),
        source: "sample".into(),
    }
}

fn sample(rel: &str) -> String {
    format!("{}/tests/data/{rel}", env!("CARGO_MANIFEST_DIR"))
}

/// A 2-rank run on real data killed after its checkpoint at step 3 and resumed ends
/// with the bits of the run that never stopped, every replica identical: for Criteo
/// lines and for a schema'd TSV with multi-hot lists.
#[test]
fn cpu_ranks_train_real_data_with_checkpoints_killed_and_resumed_bit_identically() {
    let schema = erase::data::TsvSchema::from_toml(
        "label = \"label\"\ndense = [\"price\"]\ncategorical = [\"user\", \"item\", \"genres\"]\nlist_separator = \"|\"\n",
    )
    .unwrap();
    let sources = [
        erase::data::DataSource::Criteo {
            path: sample("criteo_floats.tsv"),
        },
        erase::data::DataSource::Tsv {
            path: sample("multihot_sample.tsv"),
            schema,
        },
    ];
    let dir = common::TempDir::new("dp-ckpt");
    for (k, src) in sources.iter().enumerate() {
        let data = loaded(src);
        let erase::train::Data::Table { train, .. } = &data else {
            unreachable!()
        };
        let mut c = cfg(6);
        c.data = data.clone();
        c.model.num_dense = train.num_dense;
        c.model.num_sparse = train.num_sparse;
        if train.is_multi_hot() {
            c.model.field_hot = train.max_bag_lens();
        }
        let run = |c: &TrainConfig, fail: Option<FailAt>| {
            train_data_parallel_cpu(c, 2, Duration::from_secs(60), fail).unwrap()
        };
        let whole: Vec<_> = run(&c, None).into_iter().map(|r| r.unwrap()).collect();
        assert!(
            whole[0].state == whole[1].state,
            "source {k}: replicas differ"
        );
        // killed: rank 0 fails at step 4, after the checkpoint of step 3
        let ck = dir.join(format!("k{k}.st"));
        let killed = TrainConfig {
            checkpoint: Some(ck.clone()),
            checkpoint_every: 3,
            ..c.clone()
        };
        let r = run(
            &killed,
            Some(FailAt {
                rank: 0,
                step: 4,
                how: Default::default(),
            }),
        );
        assert!(
            r.iter().any(|x| x.is_err()),
            "source {k}: the kill did not happen"
        );
        assert_eq!(erase::checkpoint::peek(&ck).unwrap().step, 3);
        let resumed = TrainConfig {
            resume: Some(ck.clone()),
            ..c.clone()
        };
        let again: Vec<_> = run(&resumed, None)
            .into_iter()
            .map(|r| r.unwrap())
            .collect();
        assert!(
            again[0].state == again[1].state,
            "source {k}: resumed replicas differ"
        );
        assert!(
            again[0].state == whole[0].state,
            "source {k}: the resumed run ends with other bits than the run that never stopped"
        );
        // and the held-out evaluation reads the loaded data, not the synthetic stream
        let e = evaluate_replica(&c, &whole[0], None).unwrap();
        assert!(e.ne.is_finite() && e.examples > 0);
    }
}

/// Counts what rank 0 reports.
#[derive(Default)]
struct Count {
    steps: Vec<usize>,
    evals: Vec<usize>,
}

impl erase::train::Progress for Count {
    fn step(&mut self, step: usize, _: usize, loss: f64, qps: f64) {
        assert!(loss.is_finite() && qps > 0.0);
        self.steps.push(step);
    }
    fn eval(&mut self, e: &erase::train::Eval) {
        self.evals.push(e.step);
    }
}

/// Ranks train through the same loop as one process: rank 0 reports every step and
/// every periodic evaluation, every rank evaluates its replica at the same steps, and
/// the last of those agrees with the replica evaluated at the global batch.
#[test]
fn ranks_report_progress_and_evaluate_periodically_like_one_process() {
    let mut c = cfg(12);
    c.eval_every = 4;
    c.eval_examples = 128;
    let mut count = Count::default();
    let ranks = erase::distributed::train_data_parallel_cpu_with(
        &c,
        2,
        Duration::from_secs(60),
        None,
        &mut count,
    )
    .unwrap();
    let ranks: Vec<_> = ranks.into_iter().map(|r| r.unwrap()).collect();
    assert_eq!(count.steps, (1..=12).collect::<Vec<_>>());
    assert_eq!(count.evals, vec![4, 8, 12]);
    for r in &ranks {
        let at: Vec<usize> = r.evals.iter().map(|e| e.step).collect();
        assert_eq!(at, vec![4, 8, 12], "rank {}", r.rank);
        assert_eq!(
            r.evals, ranks[0].evals,
            "rank {} evaluates another replica",
            r.rank
        );
    }
    let last = ranks[0].evals[2];
    let whole = evaluate_replica(&c, &ranks[0], None).unwrap();
    assert_eq!(last.examples, whole.examples);
    assert!(
        (last.ne - whole.ne).abs() <= 1e-6 * whole.ne,
        "NE {} at the rank's batch, {} at the global batch",
        last.ne,
        whole.ne
    );
}
