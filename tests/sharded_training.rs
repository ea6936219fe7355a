//! Sharded embedding tables on CPU ranks: table-wise, row-wise and auto placements train
//! to the bits of replicated tables (the lookups and updates are the same arithmetic in
//! the same order), replicas and collective logs stay identical across ranks, a table
//! set too large for a rank's budget trains row-wise where replicated refuses it, and a
//! checkpoint holds each table whole so it resumes on another rank count.

mod common;

use std::time::Duration;

use erase::distributed::{train_data_parallel_cpu, FailAt, RankResult};
use erase::model::ctr::CtrConfig;
use erase::sharding::Sharding;
use erase::train::TrainConfig;

fn cfg(steps: usize, sharding: Sharding) -> TrainConfig {
    let mut model = CtrConfig::small();
    model.batch = 64;
    model.rows = 300;
    TrainConfig {
        seed: 7,
        data_seed: 3,
        eval_examples: 64,
        eval_every: 10,
        sharding,
        ..TrainConfig::new(model, steps)
    }
}

fn run(c: &TrainConfig, world: usize) -> Vec<RankResult> {
    train_data_parallel_cpu(c, world, Duration::from_secs(60), None)
        .unwrap()
        .into_iter()
        .map(|r| r.unwrap())
        .collect()
}

/// Rank `r` ends with `reference`'s bits: every tensor of it (rank 0 holds the sharded
/// tables whole), or every tensor but the sharded tables, which the other ranks do not
/// hold whole.
fn assert_same_bits(r: &RankResult, reference: &RankResult, what: &str) {
    if r.rank == 0 {
        assert!(r.state == reference.state, "{what}: rank 0's bits differ");
        return;
    }
    assert!(!r.sharded.is_empty(), "{what}: no table is sharded");
    for (name, _, _) in &reference.layout {
        let held = r.tensor(name);
        if r.sharded.contains(name) {
            assert!(
                held.is_none(),
                "{what}: rank {} holds '{name}' whole",
                r.rank
            );
        } else {
            assert!(
                held.is_some() && held == reference.tensor(name),
                "{what}: rank {}'s '{name}' differs",
                r.rank
            );
        }
    }
    assert_eq!(
        r.replicated_fingerprint(),
        reference.replicated_fingerprint(),
        "{what}: rank {}",
        r.rank
    );
}

fn sharded_calls(r: &RankResult) -> usize {
    r.log
        .iter()
        .filter(|x| x.bucket.contains(".lookup") || x.bucket.contains(".grad"))
        .count()
}

#[test]
fn table_row_and_auto_sharding_train_to_the_bits_of_replicated_tables() {
    for world in [2, 4] {
        let replicated = run(&cfg(20, Sharding::Replicated), world);
        // auto shards every table once a rank's budget is too small for them all
        let tight = {
            let mut c = cfg(20, Sharding::Auto);
            c.rank_memory = 300_000;
            c
        };
        for (name, c) in [
            ("table", cfg(20, Sharding::Table)),
            ("row", cfg(20, Sharding::Row)),
            ("auto", tight),
        ] {
            let ranks = run(&c, world);
            assert!(
                sharded_calls(&ranks[0]) >= 20 * 3,
                "{name} on {world}: the step exchanged no rows ({} sharded calls)",
                sharded_calls(&ranks[0])
            );
            // rank 0 alone assembles the whole tables: the others' state leaves them out
            assert_eq!(ranks[0].sharded.len(), 2, "{name}: the table and its state");
            for r in &ranks {
                let what = format!("{name} on {world} ranks");
                let reference = RankResult {
                    sharded: r.sharded.clone(),
                    ..replicated[0].clone()
                };
                assert_same_bits(r, &reference, &what);
                if r.rank > 0 {
                    assert!(r.state.len() < ranks[0].state.len(), "{what}");
                }
                assert_eq!(
                    r.log, ranks[0].log,
                    "{name} on {world}: rank {} issued other collectives",
                    r.rank
                );
                assert_eq!(r.losses, replicated[r.rank].losses, "{name} on {world}");
                // the periodic evaluations look their rows up as the steps do; the last
                // is the run's (no rank builds the whole model to evaluate it)
                assert_eq!(r.evals.len(), 2, "{name} on {world}");
                assert_eq!(r.evals, replicated[r.rank].evals, "{name} on {world}");
                assert_eq!(r.final_eval, r.evals.last().copied(), "{name} on {world}");
                assert!(replicated[r.rank].final_eval.is_none());
            }
        }
    }
}

#[test]
fn a_table_set_over_the_budget_trains_row_wise_where_replicated_refuses_it() {
    // the small model's 26 tables of 300 rows of 16 (and their state) take 530 kB
    let budget = 200_000;
    let mut c = cfg(3, Sharding::Replicated);
    c.rank_memory = budget;
    let err = train_data_parallel_cpu(&c, 4, Duration::from_secs(60), None)
        .unwrap()
        .into_iter()
        .find_map(|r| r.err())
        .expect("replicated tables over the budget must be refused");
    let msg = format!("{err:#}");
    assert!(
        msg.contains("--sharding replicated") && msg.contains("budget"),
        "{msg}"
    );
    c.sharding = Sharding::Row;
    let ranks = run(&c, 4);
    for r in &ranks {
        assert_eq!(
            r.replicated_fingerprint(),
            ranks[0].replicated_fingerprint(),
            "rank {}",
            r.rank
        );
    }
    assert!(sharded_calls(&ranks[0]) > 0);
    // each rank stores a quarter of the rows and a landing slot per id of its batch of
    // 16 (26 fields): (75 + 16) rows of 16 values and their state, under the budget
    let whole = 26 * 300 * 17 * 4;
    for r in &ranks {
        assert_eq!(r.table_bytes, 26 * (75 + 16) * 17 * 4, "rank {}", r.rank);
        assert!(r.table_bytes < budget, "rank {}", r.rank);
    }
    // and the whole tables come back at the end, on rank 0: its state has every row
    let replicated = {
        let mut c = cfg(3, Sharding::Replicated);
        c.rank_memory = 1 << 30;
        run(&c, 4)
    };
    assert_eq!(replicated[0].table_bytes, whole);
    assert!(ranks[0].state == replicated[0].state);
}

#[test]
fn a_sharded_checkpoint_resumes_on_1_2_and_4_ranks() {
    let dir = common::TempDir::new("sharded");
    let ck = dir.join("k.st");
    let base = cfg(6, Sharding::Row);
    let whole = run(&base, 2);
    // killed after the checkpoint of step 3
    let killed = TrainConfig {
        checkpoint: Some(ck.clone()),
        checkpoint_every: 3,
        ..base.clone()
    };
    let r = train_data_parallel_cpu(
        &killed,
        2,
        Duration::from_secs(60),
        Some(FailAt {
            rank: 1,
            step: 4,
            how: Default::default(),
        }),
    )
    .unwrap();
    assert!(r.iter().any(|x| x.is_err()), "the kill did not happen");
    assert_eq!(erase::checkpoint::peek(&ck).unwrap().step, 3);
    let resumed = |world: usize, sharding: Sharding| {
        run(
            &TrainConfig {
                resume: Some(ck.clone()),
                sharding,
                ..base.clone()
            },
            world,
        )
    };
    assert!(
        resumed(2, Sharding::Row)[0].state == whole[0].state,
        "resumed on 2 ranks: other bits than the run that never stopped"
    );
    // the checkpoint holds each table whole: on 1 and 4 ranks, sharded or not, it
    // resumes to that rank count's bits
    for world in [1, 4] {
        let rep = resumed(world, Sharding::Replicated);
        let tab = resumed(world, Sharding::Table);
        assert!(
            tab[0].state == rep[0].state,
            "{world} ranks: a sharded resume differs from a replicated one"
        );
    }
}

#[test]
fn a_rank_that_dies_before_the_lookup_all_to_all_stops_the_others_naming_it() {
    let t0 = std::time::Instant::now();
    let results = train_data_parallel_cpu(
        &cfg(10, Sharding::Row),
        4,
        Duration::from_secs(3),
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
    for k in [0, 2, 3] {
        let e = format!("{:#}", results[k].as_ref().unwrap_err());
        assert!(
            e.contains(&format!("rank {k}"))
                && e.contains("sharded lookup")
                && e.contains("rank 1"),
            "rank {k}: {e}"
        );
    }
}
