//! Data parallelism with one process per rank, through the `erase-ctr` binary: the
//! supervisor (`train --gpus N --device cpu`) starts the workers, they meet at rank 0 and
//! all-reduce over TCP on loopback. Replicas stay bit-identical (and equal to the
//! in-process backend's), every rank logs the same collectives, and a rank that fails,
//! crashes or hangs takes the job down with an error naming it, within the timeout.

mod common;

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use erase::distributed::train_data_parallel_cpu;
use erase::launch::fnv64;
use erase::model::ctr::CtrConfig;
use erase::train::TrainConfig;

const EXE: &str = env!("CARGO_BIN_EXE_erase-ctr");

/// The small model the tests train: a global batch of 64, 100 rows per table.
fn args(steps: usize) -> Vec<String> {
    [
        "train",
        "--device",
        "cpu",
        "--batch",
        "64",
        "--rows",
        "100",
        "--steps",
        &steps.to_string(),
        "--seed",
        "7",
        "--data-seed",
        "3",
        "--eval-every",
        "0",
        "--warmup",
        "0",
        "--threads",
        "1",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

fn run(args: &[String], env: &[(&str, &str)]) -> (Output, Duration) {
    let t0 = Instant::now();
    let out = Command::new(EXE)
        .args(args)
        .envs(env.iter().copied())
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .env_remove("MASTER_PORT")
        .output()
        .expect("run erase-ctr");
    (out, t0.elapsed())
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

fn tmp(name: &str) -> common::TempDir {
    common::TempDir::new(&format!("mp-{name}"))
}

/// The state fingerprint each rank prints: `rank K: ... state fnv64 H, ...`.
fn state_hashes(stdout: &str) -> Vec<(usize, String)> {
    let mut v: Vec<(usize, String)> = stdout
        .lines()
        .filter_map(|l| {
            let l = l.split("] ").nth(1)?;
            let rank: usize = l.strip_prefix("rank ")?.split(':').next()?.parse().ok()?;
            let h = l
                .split("state fnv64 ")
                .nth(1)?
                .split(',')
                .next()?
                .to_string();
            Some((rank, h))
        })
        .collect();
    v.sort();
    v
}

/// The state fnv64 of rank 0 after `steps` steps of [`args`]' model on 2 in-process
/// ranks (threads), the reference the processes are held to.
fn threads_state_hash(steps: usize, sharding: erase::sharding::Sharding) -> String {
    let mut model = CtrConfig::small();
    model.batch = 64;
    model.rows = 100;
    let cfg = TrainConfig {
        seed: 7,
        data_seed: 3,
        eval_examples: 64,
        sharding,
        ..TrainConfig::new(model, steps)
    };
    let threads = train_data_parallel_cpu(&cfg, 2, Duration::from_secs(60), None).unwrap();
    format!("{:016x}", fnv64(&threads[0].as_ref().unwrap().state))
}

/// `steps` steps on two processes with `extra` flags, each rank's collectives logged into
/// `logs`; the run must succeed. Returns its stdout, stderr and how long it took.
fn two_ranks_logged(steps: usize, extra: &[&str], logs: &Path) -> (String, String, Duration) {
    let mut a = args(steps);
    a.extend(["--gpus", "2"].map(String::from));
    a.extend(extra.iter().map(|x| x.to_string()));
    a.extend(["--collective-timeout", "30", "--collective-log"].map(String::from));
    a.push(logs.display().to_string());
    let (out, took) = run(&a, &[]);
    let (so, se) = text(&out);
    assert!(out.status.success(), "{so}\n{se}");
    (so, se, took)
}

#[test]
fn two_processes_keep_replicas_bit_identical_and_log_the_same_collectives() {
    let logs = tmp("logs");
    let (so, se, took) = two_ranks_logged(20, &[], &logs);
    assert!(
        so.contains("replicas bit-identical on all 2 ranks"),
        "{so}\n{se}"
    );
    assert!(so.contains("held-out NE "), "rank 0 evaluates:\n{so}");
    let hashes = state_hashes(&so);
    assert_eq!(hashes.len(), 2, "{so}");
    assert_eq!(hashes[0].1, hashes[1].1, "{so}");
    let l0 = std::fs::read_to_string(logs.join("rank-0.log")).unwrap();
    let l1 = std::fs::read_to_string(logs.join("rank-1.log")).unwrap();
    assert_eq!(l0, l1, "the ranks' collective logs differ");
    // one all-reduce per backward program and three gathers for the tables, each step
    let per_step = l0.lines().filter(|l| l.starts_with("all_reduce")).count() / 20;
    assert!(per_step >= 7, "{per_step} all-reduces a step:\n{l0}");
    assert!(l0.contains("all_gather"), "{l0}");

    // sums in rank order: the processes end where the in-process backend (threads) does
    assert_eq!(
        threads_state_hash(20, erase::sharding::Sharding::Auto),
        hashes[0].1,
        "processes and threads trained different replicas"
    );
    eprintln!("2 processes x 20 steps: {took:?}");
}

#[test]
fn end_all_reduce_is_one_bucket_a_step() {
    let logs = tmp("end");
    let mut a = args(3);
    a.extend(
        [
            "--gpus",
            "2",
            "--allreduce",
            "end",
            "--collective-timeout",
            "30",
            "--collective-log",
        ]
        .map(String::from),
    );
    a.push(logs.display().to_string());
    let (out, _) = run(&a, &[]);
    let (so, se) = text(&out);
    assert!(out.status.success(), "{so}\n{se}");
    let l0 = std::fs::read_to_string(logs.join("rank-0.log")).unwrap();
    let reduces: Vec<&str> = l0.lines().filter(|l| l.starts_with("all_reduce")).collect();
    assert_eq!(reduces.len(), 3, "{l0}");
    assert!(
        reduces.iter().all(|l| l.starts_with("all_reduce 'all'")),
        "{l0}"
    );
}

/// Runs 2 ranks for 10 steps with rank 1 failing at step 3 as `how` says.
fn failing(how: &str, timeout: &str) -> (String, String, Duration, bool) {
    let mut a = args(10);
    a.extend(["--gpus", "2", "--collective-timeout", timeout].map(String::from));
    let fail = format!("1:3:{how}");
    let (out, took) = run(&a, &[("ERASE_FAIL_AT_STEP", fail.as_str())]);
    let (so, se) = text(&out);
    (so, se, took, out.status.success())
}

#[test]
fn a_rank_that_fails_stops_the_job_with_its_error() {
    let (so, se, took, ok) = failing("error", "10");
    assert!(!ok, "{so}\n{se}");
    let last = se.lines().last().unwrap_or_default();
    assert!(
        last.contains("rank 1 exited with status 1")
            && last.contains("rank 1 failed on purpose at step 3"),
        "{se}"
    );
    assert!(took < Duration::from_secs(15), "took {took:?}");
}

#[test]
fn a_rank_that_crashes_stops_the_job_naming_it() {
    let (so, se, took, ok) = failing("abort", "10");
    assert!(!ok, "{so}\n{se}");
    let last = se.lines().last().unwrap_or_default();
    assert!(last.contains("rank 1 crashed (SIGABRT)"), "{se}");
    assert!(took < Duration::from_secs(15), "took {took:?}");
}

#[test]
fn a_rank_that_hangs_makes_rank_0_time_out_naming_it() {
    let (so, se, took, ok) = failing("hang", "2");
    assert!(!ok, "{so}\n{se}");
    let last = se.lines().last().unwrap_or_default();
    assert!(
        last.contains("rank 0 exited")
            && last.contains("timed out after 2s waiting for rank(s) [1]"),
        "{se}"
    );
    assert!(took < Duration::from_secs(15), "took {took:?}");
}

/// Starts rank `rank` of 2 by hand, as torchrun or a second host would.
fn start_rank(rank: usize, port: u16, extra: &[&str], env: &[(&str, &str)]) -> std::process::Child {
    let mut a = args(4);
    a.extend(["--collective-timeout", "3"].map(String::from));
    a.extend(extra.iter().map(|s| s.to_string()));
    Command::new(EXE)
        .args(&a)
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", "2")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start a rank")
}

fn port() -> u16 {
    erase::runtime::collective::rendezvous::free_port("127.0.0.1").unwrap()
}

#[test]
fn ranks_started_by_hand_find_each_other_and_a_dead_one_is_named() {
    let p = port();
    let r1 = start_rank(1, p, &[], &[]); // before rank 0 listens: it retries
    std::thread::sleep(Duration::from_millis(300));
    let r0 = start_rank(0, p, &[], &[]);
    let (o0, o1) = (
        r0.wait_with_output().unwrap(),
        r1.wait_with_output().unwrap(),
    );
    let (so, se) = text(&o0);
    assert!(
        o0.status.success() && o1.status.success(),
        "{so}\n{se}\n{}",
        text(&o1).1
    );
    assert!(so.contains("replicas bit-identical on all 2 ranks"), "{so}");

    // without a supervisor, rank 0 sees rank 1's connection close and names it
    let p = port();
    let r0 = start_rank(0, p, &[], &[]);
    let r1 = start_rank(1, p, &[], &[("ERASE_FAIL_AT_STEP", "1:2:abort")]);
    let t0 = Instant::now();
    let (o0, o1) = (
        r0.wait_with_output().unwrap(),
        r1.wait_with_output().unwrap(),
    );
    assert!(!o0.status.success() && !o1.status.success());
    let (_, se) = text(&o0);
    assert!(
        se.contains("rank 0") && se.contains("rank 1 closed its connection"),
        "{se}"
    );
    assert!(t0.elapsed() < Duration::from_secs(15));
}

#[test]
fn rendezvous_names_a_rank_that_never_comes_and_refuses_a_different_job() {
    let p = port();
    let t0 = Instant::now();
    let o = start_rank(0, p, &[], &[]).wait_with_output().unwrap();
    let (_, se) = text(&o);
    assert!(!o.status.success());
    assert!(se.contains("rank(s) [1] never connected"), "{se}");
    assert!(t0.elapsed() < Duration::from_secs(10));

    let p = port();
    let r0 = start_rank(0, p, &[], &[]);
    let r1 = start_rank(1, p, &["--allreduce", "end"], &[]);
    let (o0, o1) = (
        r0.wait_with_output().unwrap(),
        r1.wait_with_output().unwrap(),
    );
    assert!(!o0.status.success() && !o1.status.success());
    let (_, se1) = text(&o1);
    assert!(
        se1.contains("rank 1 runs a different job than rank 0"),
        "{se1}"
    );
}

/// What every worker would refuse is refused once, by the supervisor, before any starts.
#[test]
fn options_no_cpu_rank_takes_are_refused_before_the_workers_start() {
    for extra in [
        ["--dispatch", "threaded"],
        ["--trace", "t.json"],
        ["--optimizer-update", "early"],
    ] {
        let mut a = args(2);
        a.extend(["--gpus".to_string(), "2".to_string()]);
        a.extend(extra.iter().map(|s| s.to_string()));
        let (out, took) = run(&a, &[]);
        let (stdout, stderr) = text(&out);
        assert!(!out.status.success(), "{extra:?}: {stdout}{stderr}");
        assert!(stderr.contains(extra[0]), "{extra:?}: {stderr}");
        assert!(
            !stderr.contains("[rank"),
            "{extra:?}: no worker may start: {stderr}"
        );
        assert!(took < Duration::from_secs(10), "{extra:?}: took {took:?}");
    }
}

/// Row-sharded tables over TCP: the processes exchange ids, rows and gradients by
/// all-to-all and end with the replicated in-process run's bits.
#[test]
fn row_sharded_tables_over_tcp_end_with_the_replicated_bits() {
    let logs = tmp("sharded-logs");
    let (so, _, _) = two_ranks_logged(8, &["--sharding", "row"], &logs);
    let hashes = state_hashes(&so);
    assert_eq!(hashes.len(), 2, "{so}");
    let l0 = std::fs::read_to_string(logs.join("rank-0.log")).unwrap();
    assert!(
        l0.contains("all_to_all") && l0.contains(".lookup rows"),
        "{l0}"
    );
    assert!(
        !l0.lines().any(|l| l.starts_with("all_gather")),
        "a sharded step gathers no gradients:\n{l0}"
    );
    // the ranks evaluate through their own lookups, not a whole model on rank 0
    assert!(
        so.contains("held-out NE ") && so.contains("each rank's sharded lookup"),
        "{so}"
    );
    assert_eq!(
        threads_state_hash(8, erase::sharding::Sharding::Replicated),
        hashes[0].1,
        "row-sharded processes and replicated threads trained different replicas"
    );
}
