//! The CPU collective backend: every rank is a thread. Results are bit-identical
//! across ranks, ordered by rank, and failures (mismatch, early exit, timeout) reach
//! every rank promptly with errors that name the rank and the collective.

use std::thread;
use std::time::{Duration, Instant};

use erase_runtime::collective::{cpu_group, Collective, CollectiveError, CpuCollective};

const TIMEOUT: Duration = Duration::from_millis(2000);
const SLACK: Duration = Duration::from_millis(1500);

/// Runs `f(handle)` on one thread per rank and returns the results in rank order.
fn on_ranks<T: Send + 'static>(
    world: usize,
    timeout: Duration,
    f: impl Fn(CpuCollective) -> T + Send + Sync + Clone + 'static,
) -> Vec<T> {
    let threads: Vec<_> = cpu_group(world, timeout)
        .into_iter()
        .map(|c| {
            let f = f.clone();
            thread::spawn(move || f(c))
        })
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}

/// Rank `r`'s gradient: mixes of 1e8 and 1.0, so the order of addition matters in f32
/// (with three ranks or more: for two, a + b == b + a).
fn grads(r: usize, world: usize) -> Vec<f32> {
    const BASE: [f32; 4] = [1e8, 1.0, -1e8, 1.0];
    (0..64)
        .map(|i| BASE[(i + r) % 4] * (1 + i % 5) as f32 + (world - r) as f32 * 0.25)
        .collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn all_reduce_is_rank_ordered_and_bit_identical(world: usize) {
    let reference: Vec<f32> = (0..64)
        .map(|i| {
            let mut acc = grads(0, world)[i];
            for r in 1..world {
                acc += grads(r, world)[i];
            }
            acc
        })
        .collect();
    // The data makes the order matter: summing in reverse rank order differs somewhere.
    let reversed: Vec<f32> = (0..64)
        .map(|i| {
            let mut acc = grads(world - 1, world)[i];
            for r in (0..world - 1).rev() {
                acc += grads(r, world)[i];
            }
            acc
        })
        .collect();
    if world > 2 {
        assert_ne!(
            bits(&reference),
            bits(&reversed),
            "test data is order-insensitive"
        );
    }

    let results = on_ranks(world, TIMEOUT, move |mut c| {
        let r = c.rank();
        let mut out = Vec::new();
        for step in 0..20 {
            // Later ranks arrive first, in varying order.
            if (step + r) % 3 != 0 {
                thread::sleep(Duration::from_micros(((world - r) * 300) as u64));
            }
            let mut buf = grads(r, world);
            c.all_reduce_sum("grads", &mut buf).unwrap();
            out.push(bits(&buf));
        }
        out
    });
    for (r, per_step) in results.iter().enumerate() {
        for (step, got) in per_step.iter().enumerate() {
            assert_eq!(got, &bits(&reference), "rank {r} step {step} of {world}");
        }
    }
}

#[test]
fn all_reduce_two_ranks() {
    all_reduce_is_rank_ordered_and_bit_identical(2);
}

#[test]
fn all_reduce_four_ranks() {
    all_reduce_is_rank_ordered_and_bit_identical(4);
}

#[test]
fn all_gather_returns_rank_ordered_data() {
    for world in [2, 4] {
        let results = on_ranks(world, TIMEOUT, move |mut c| {
            let r = c.rank();
            thread::sleep(Duration::from_millis(((world - r) * 2) as u64));
            let mine: Vec<u8> = (0..5).map(|i| (r * 10 + i) as u8).collect();
            c.all_gather("meta", &mine).unwrap()
        });
        let expect: Vec<Vec<u8>> = (0..world)
            .map(|r| (0..5).map(|i| (r * 10 + i) as u8).collect())
            .collect();
        for (r, got) in results.iter().enumerate() {
            assert_eq!(got, &expect, "rank {r} of {world}");
        }
    }
}

#[test]
fn logs_are_identical_after_mixed_collectives() {
    for world in [2, 4] {
        let logs = on_ranks(world, TIMEOUT, |mut c| {
            let r = c.rank();
            let mut buf = vec![r as f32; 10];
            c.barrier("start").unwrap();
            c.all_reduce_sum("layer0", &mut buf).unwrap();
            let g = c.all_gather("loss", &(r as u32).to_le_bytes()).unwrap();
            assert_eq!(g.len(), c.world());
            let mut buf2 = vec![1.0f32; 3];
            c.all_reduce_sum("layer1", &mut buf2).unwrap();
            assert_eq!(buf2, vec![c.world() as f32; 3]);
            c.all_gather("empty", &[]).unwrap();
            c.barrier("end").unwrap();
            c.log().to_vec()
        });
        let kinds: Vec<_> = logs[0].iter().map(|l| (l.seq, l.kind, l.bytes)).collect();
        assert_eq!(
            kinds,
            vec![
                (0, "barrier", 0),
                (1, "all_reduce", 40),
                (2, "all_gather", 4),
                (3, "all_reduce", 12),
                (4, "all_gather", 0),
                (5, "barrier", 0),
            ]
        );
        for (r, log) in logs.iter().enumerate() {
            assert_eq!(log, &logs[0], "rank {r} of {world}");
        }
    }
}

fn assert_mentions(e: &CollectiveError, parts: &[&str]) {
    let msg = e.to_string();
    for part in parts {
        assert!(msg.contains(part), "'{msg}' does not mention {part}");
    }
}

#[test]
fn different_bucket_or_size_is_a_mismatch_on_every_rank() {
    for (world, bad) in [(2, 1), (4, 2)] {
        for wrong_size in [false, true] {
            let start = Instant::now();
            let results = on_ranks(world, TIMEOUT, move |mut c| {
                let r = c.rank();
                c.barrier("start").unwrap();
                let (bucket, n) = match (r == bad, wrong_size) {
                    (true, false) => ("other", 8),
                    (true, true) => ("grads", 9),
                    _ => ("grads", 8),
                };
                let mut buf = vec![1.0f32; n];
                let e = c.all_reduce_sum(bucket, &mut buf).unwrap_err();
                // The group is unusable afterwards; later calls fail at once.
                let later = c.barrier("after").unwrap_err();
                (e, later)
            });
            assert!(
                start.elapsed() < TIMEOUT,
                "a mismatch waited for the timeout"
            );
            for (r, (e, later)) in results.iter().enumerate() {
                assert!(matches!(e, CollectiveError::Mismatch { .. }), "{e:?}");
                assert_eq!(e.rank(), r);
                assert_eq!(e.op().seq, 1);
                let offender = format!("rank {bad} called");
                let bad_call = if wrong_size {
                    "all_reduce 'grads' (36 bytes)"
                } else {
                    "all_reduce 'other' (32 bytes)"
                };
                assert_mentions(
                    e,
                    &[
                        &format!("rank {r}:"),
                        "all_reduce",
                        "seq 1",
                        "mismatch",
                        bad_call,
                        "all_reduce 'grads' (32 bytes)",
                    ],
                );
                // Either the offender arrived after someone (named as the caller) or
                // first (named as the one the others disagree with).
                let msg = e.to_string();
                assert!(
                    msg.contains(&offender) || msg.contains(&format!("but rank {bad} called")),
                    "'{msg}' does not name rank {bad}"
                );
                assert!(
                    matches!(later, CollectiveError::Aborted { .. }),
                    "{later:?}"
                );
                assert_mentions(later, &["barrier 'after'", "seq 2", "mismatch at seq 1"]);
            }
        }
    }
}

#[test]
fn rank_that_exits_early_aborts_the_others_promptly() {
    for world in [2, 4] {
        // Rank 1 returns after the first collective: the others are either already
        // waiting in the second one or arrive after the drop.
        let start = Instant::now();
        let results = on_ranks(world, TIMEOUT, |mut c| {
            let r = c.rank();
            let mut buf = vec![1.0f32; 4];
            c.all_reduce_sum("layer0", &mut buf).unwrap();
            if r == 1 {
                thread::sleep(Duration::from_millis(30));
                return None;
            }
            let t = Instant::now();
            let e = c.all_reduce_sum("layer1", &mut buf).unwrap_err();
            Some((e, t.elapsed()))
        });
        assert!(start.elapsed() < TIMEOUT + SLACK);
        for (r, res) in results.into_iter().enumerate() {
            let Some((e, elapsed)) = res else {
                assert_eq!(r, 1);
                continue;
            };
            assert!(elapsed < TIMEOUT + SLACK, "rank {r} took {elapsed:?}");
            assert!(elapsed < TIMEOUT, "rank {r} waited for the timeout: {e}");
            assert!(matches!(e, CollectiveError::Aborted { .. }), "{e:?}");
            assert_mentions(
                &e,
                &[
                    &format!("rank {r}:"),
                    "all_reduce 'layer1' (seq 1, 16 bytes)",
                    "aborted",
                    "rank 1 dropped its handle",
                ],
            );
        }
    }
}

#[test]
fn explicit_abort_fails_the_others() {
    let results = on_ranks(2, TIMEOUT, |mut c| {
        if c.rank() == 0 {
            thread::sleep(Duration::from_millis(20));
            c.abort();
        }
        let t = Instant::now();
        let e = c.barrier("sync").unwrap_err();
        (e, t.elapsed())
    });
    for (r, (e, elapsed)) in results.iter().enumerate() {
        assert!(*elapsed < TIMEOUT, "rank {r} took {elapsed:?}");
        assert_mentions(
            e,
            &[
                &format!("rank {r}:"),
                "barrier 'sync' (seq 0",
                "rank 0 aborted",
            ],
        );
    }
}

#[test]
fn rank_that_never_calls_makes_the_others_time_out() {
    let world = 4;
    let sleeper = 3;
    let results = on_ranks(world, TIMEOUT, move |mut c| {
        let r = c.rank();
        c.barrier("start").unwrap();
        if r == sleeper {
            // Holds its handle but never calls the next collective in time.
            thread::sleep(TIMEOUT + Duration::from_millis(150));
            let e = c.all_gather("stats", &[0; 8]).unwrap_err();
            return (e, Duration::ZERO);
        }
        let t = Instant::now();
        let e = c.all_gather("stats", &[r as u8; 8]).unwrap_err();
        (e, t.elapsed())
    });
    for (r, (e, elapsed)) in results.iter().enumerate() {
        if r == sleeper {
            // The late rank learns that the others gave up on this collective.
            assert!(matches!(e, CollectiveError::Aborted { .. }), "{e:?}");
            assert_mentions(e, &["seq 1 timed out", "[3]"]);
            continue;
        }
        assert!(
            matches!(e, CollectiveError::Timeout { ref missing, .. } if missing == &vec![sleeper]),
            "{e:?}"
        );
        assert!(*elapsed < TIMEOUT + SLACK, "rank {r} took {elapsed:?}");
        assert!(
            *elapsed >= TIMEOUT - Duration::from_millis(50),
            "rank {r}: {elapsed:?}"
        );
        assert_mentions(
            e,
            &[
                &format!("rank {r}:"),
                "all_gather 'stats' (seq 1, 8 bytes)",
                "timed out after 2s",
                "rank(s) [3]",
            ],
        );
    }
}

/// The TCP backend (ranks as threads here, over real loopback sockets) on `world` ranks.
fn tcp_ranks<T: Send + 'static>(
    world: usize,
    f: impl Fn(erase_runtime::collective::tcp::TcpCollective) -> T + Send + Sync + Clone + 'static,
) -> Vec<T> {
    use erase_runtime::collective::rendezvous::{free_port, rendezvous, RankEnv};
    let port = free_port("127.0.0.1").unwrap();
    let threads: Vec<_> = (0..world)
        .map(|rank| {
            let f = f.clone();
            thread::spawn(move || {
                let env = RankEnv {
                    rank,
                    world,
                    local_rank: rank,
                    master_addr: "127.0.0.1".into(),
                    master_port: port,
                };
                let rdv = rendezvous(&env, &[rank as u8], "test", TIMEOUT).unwrap();
                assert_eq!(
                    rdv.blobs,
                    (0..world).map(|r| vec![r as u8]).collect::<Vec<_>>()
                );
                f(erase_runtime::collective::tcp::TcpCollective::new(
                    rdv, TIMEOUT,
                ))
            })
        })
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}

#[test]
fn tcp_backend_sums_in_rank_order_like_the_in_process_one_on_4_ranks() {
    let world = 4;
    let tcp = tcp_ranks(world, move |mut c| {
        let mut buf = grads(c.rank(), world);
        c.all_reduce_sum("grads", &mut buf).unwrap();
        let all = c.all_gather("ids", &[c.rank() as u8; 3]).unwrap();
        c.barrier("end").unwrap();
        (bits(&buf), all, c.log().to_vec())
    });
    let threads = on_ranks(world, TIMEOUT, move |mut c| {
        let mut buf = grads(c.rank(), world);
        c.all_reduce_sum("grads", &mut buf).unwrap();
        bits(&buf)
    });
    for (r, (sum, all, log)) in tcp.iter().enumerate() {
        assert_eq!(sum, &threads[r], "rank {r}");
        assert_eq!(
            all,
            &(0..world).map(|k| vec![k as u8; 3]).collect::<Vec<_>>()
        );
        assert_eq!(log, &tcp[0].2);
    }
}

#[test]
fn tcp_backend_reports_a_mismatch_on_every_rank() {
    let errs = tcp_ranks(3, |mut c| {
        let bucket = if c.rank() == 2 { "b" } else { "a" };
        let mut buf = vec![1.0f32; 4];
        c.all_reduce_sum(bucket, &mut buf).unwrap_err()
    });
    for (r, e) in errs.iter().enumerate() {
        assert!(matches!(e, CollectiveError::Mismatch { .. }), "{e:?}");
        assert_mentions(e, &[&format!("rank {r}"), "rank 2 called all_reduce 'b'"]);
    }
}

/// Rank `from`'s part for rank `to`: a different length for every pair (some empty).
fn part(from: usize, to: usize) -> Vec<u8> {
    (0..(from * 3 + to * 5) % 7)
        .map(|i| (from * 16 + to + i) as u8)
        .collect()
}

#[test]
fn all_to_all_delivers_every_jagged_part_to_its_rank() {
    for world in [1, 2, 4] {
        let got = on_ranks(world, TIMEOUT, move |mut c| {
            let r = c.rank();
            let send: Vec<Vec<u8>> = (0..world).map(|to| part(r, to)).collect();
            let a = c.all_to_all("ids", &send).unwrap();
            let b = c.all_to_all("rows", &send).unwrap();
            assert_eq!(a, b);
            (a, c.log().to_vec())
        });
        for (r, (recv, log)) in got.iter().enumerate() {
            let want: Vec<Vec<u8>> = (0..world).map(|from| part(from, r)).collect();
            assert_eq!(recv, &want, "rank {r} of {world}");
            assert_eq!(log, &got[0].1, "rank {r}'s log");
            assert_eq!(log[0].bytes, 0);
        }
    }
}

#[test]
fn tcp_all_to_all_matches_the_in_process_one() {
    let world = 3;
    let tcp = tcp_ranks(world, move |mut c| {
        let r = c.rank();
        let send: Vec<Vec<u8>> = (0..world).map(|to| part(r, to)).collect();
        let a = c.all_to_all("ids", &send).unwrap();
        c.barrier("end").unwrap();
        (a, c.log().to_vec())
    });
    for (r, (recv, log)) in tcp.iter().enumerate() {
        let want: Vec<Vec<u8>> = (0..world).map(|from| part(from, r)).collect();
        assert_eq!(recv, &want, "rank {r}");
        assert_eq!(log, &tcp[0].1);
    }
}

#[test]
fn all_to_all_with_a_wrong_part_count_fails_on_every_rank() {
    let errs = on_ranks(3, TIMEOUT, |mut c| {
        let n = if c.rank() == 1 { 2 } else { 3 };
        c.all_to_all("ids", &vec![vec![1u8]; n]).unwrap_err()
    });
    for (r, e) in errs.iter().enumerate() {
        assert_mentions(e, &[&format!("rank {r}"), "rank 1 passed 2 parts"]);
    }
    let errs = tcp_ranks(3, |mut c| {
        let n = if c.rank() == 2 { 4 } else { 3 };
        c.all_to_all("ids", &vec![vec![1u8]; n]).unwrap_err()
    });
    for (r, e) in errs.iter().enumerate() {
        assert_mentions(e, &[&format!("rank {r}"), "rank 2 passed 4 parts"]);
    }
}

#[test]
fn a_rank_that_dies_in_an_all_to_all_fails_the_others_naming_it() {
    let start = Instant::now();
    let results = on_ranks(4, TIMEOUT, |mut c| {
        let r = c.rank();
        let send = vec![vec![r as u8; 8]; 4];
        c.all_to_all("ids", &send).unwrap();
        if r == 2 {
            thread::sleep(Duration::from_millis(30));
            return None;
        }
        Some(c.all_to_all("rows", &send).unwrap_err())
    });
    assert!(start.elapsed() < TIMEOUT + SLACK);
    for (r, e) in results.into_iter().enumerate() {
        let Some(e) = e else {
            assert_eq!(r, 2);
            continue;
        };
        assert!(matches!(e, CollectiveError::Aborted { .. }), "{e:?}");
        assert_mentions(&e, &["all_to_all 'rows'", "rank 2 dropped its handle"]);
    }
    // over TCP: the rank's connection closes
    let results = tcp_ranks(3, |mut c| {
        let r = c.rank();
        let send = vec![vec![r as u8; 8]; 3];
        c.all_to_all("ids", &send).unwrap();
        if r == 1 {
            return None;
        }
        Some(c.all_to_all("rows", &send).unwrap_err())
    });
    for (r, e) in results.into_iter().enumerate() {
        let Some(e) = e else { continue };
        assert_mentions(&e, &[&format!("rank {r}"), "all_to_all 'rows'"]);
        if r == 0 {
            assert_mentions(&e, &["rank 1"]);
        }
    }
}
