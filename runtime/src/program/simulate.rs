//! The schedule simulator: replays a step program on the occupancy model's cost
//! estimates with stream semantics (in order within a stream, events across streams).
//! Kernels that run at once share the device: while the footprints of the running
//! kernels add up to more than the whole device, the device goes to them by their
//! streams' priorities (the most urgent level gets what it fills first, the next level
//! what is left; within a level the launch that started first, as the CTA dispatcher hands
//! out SMs), each slowed by what sharing costs it beside the others that hold part of the
//! device (the device model's contention cost of each pair, by whether each is compute-
//! or memory-bound, in proportion to how far they oversubscribe it). A launch that
//! arrives takes its share at once (the model does not wait for resident CTAs to end). This is how we plan past the machines we have: more
//! streams, other devices.

use crate::program::occupancy::DeviceModel;
use crate::program::schedule::{schedule, Priorities, ScheduleConfig, StepProgram, StreamId};
use erase_graph::{Graph, NodeId, Partition};

/// Host time to issue one launch under blocking dispatch on the H200's host: fitted to
/// the CTR step's blocking dispatch at batch 4096 and 16384 (predicted within 1 % and 2 %
/// with it) and checked on mlp30's 306 small launches (2.09 ms predicted, 2.16 measured).
pub const BLOCKING_HOST_PER_LAUNCH_S: f64 = 6e-6;

#[derive(Clone, Debug, PartialEq)]
pub struct SimConfig {
    pub device: DeviceModel,
    /// Host time to issue one launch (0 for a replayed CUDA graph).
    pub host_per_launch_s: f64,
}

/// A predicted launch: when it starts and ends, in seconds from the step's start.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SimLaunch {
    pub start: f64,
    pub end: f64,
}

#[derive(Clone, Debug, PartialEq)]
pub struct SimResult {
    pub step_s: f64,
    pub launches: Vec<SimLaunch>,
    /// Per stream: seconds with at least one of its launches running.
    pub busy_s: Vec<f64>,
}

/// The launches that bound the predicted step, in step order: from the launch that ends
/// last, back through what each started after (the launch before it on its stream, or
/// one whose event it waited for: the one of them that ended last), to a launch that
/// started with the step or when the host issued it. With no host time a launch starts
/// as the last of those ends, so the path's launches cover the step end to end.
pub fn critical_path(p: &StepProgram, r: &SimResult) -> Vec<usize> {
    let n = p.launches.len().min(r.launches.len());
    let Some(mut i) = (0..n).max_by(|&a, &b| r.launches[a].end.total_cmp(&r.launches[b].end))
    else {
        return Vec::new();
    };
    let recorder = p.recorders();
    let mut before = vec![None; n];
    for q in p.stream_queues() {
        for w in q.windows(2) {
            if w[1] < n {
                before[w[1]] = Some(w[0]);
            }
        }
    }
    let mut path = vec![i];
    loop {
        let after = before[i]
            .into_iter()
            .chain(
                p.launches[i]
                    .waits
                    .iter()
                    .filter_map(|w| recorder.get(&w.event).copied()),
            )
            .filter(|&j| j < n)
            .max_by(|&a, &b| r.launches[a].end.total_cmp(&r.launches[b].end));
        match after {
            // (it started as that one ended, not later at the host's issue)
            Some(j) if r.launches[j].end >= r.launches[i].start - 1e-12 => {
                path.push(j);
                i = j;
            }
            _ => break,
        }
    }
    path.reverse();
    path
}

/// Simulates one step of `p`, each launch taking the device model's time alone.
pub fn simulate(p: &StepProgram, cfg: &SimConfig) -> SimResult {
    let work: Vec<f64> = p
        .launches
        .iter()
        .map(|l| l.spec.as_ref().map_or(0.0, |s| cfg.device.duration_s(s)))
        .collect();
    simulate_with(p, cfg, &work)
}

/// Simulates one step of `p` with the given time alone of every launch (seconds; for
/// instance measured on a serial schedule), the device model still deciding how
/// concurrent launches share the GPU.
pub fn simulate_with(p: &StepProgram, cfg: &SimConfig, work: &[f64]) -> SimResult {
    let n = p.launches.len();
    let work: Vec<f64> = (0..n)
        .map(|i| work.get(i).copied().unwrap_or(0.0))
        .collect();
    let foot: Vec<f64> = p
        .launches
        .iter()
        .map(|l| l.spec.as_ref().map_or(0.0, |s| cfg.device.footprint(s)))
        .collect();
    let memory: Vec<bool> = p
        .launches
        .iter()
        .map(|l| l.spec.as_ref().is_some_and(|s| cfg.device.memory_bound(s)))
        .collect();
    let level: Vec<u32> = p.launches.iter().map(|l| p.stream_rank(l.stream)).collect();
    // each running launch's rate of progress (1: as fast as alone), into `rate`
    let rates = |running: &[usize], out: &[SimLaunch], rate: &mut Vec<f64>| {
        rate.clear();
        let demand: f64 = running.iter().map(|&r| foot[r]).sum();
        if demand <= 1.0 {
            rate.resize(running.len(), 1.0);
            return;
        }
        // the share of its footprint each gets: the device left once the launches ahead
        // of it have what they fill (those of more urgent streams, then, within its
        // level, those started before it)
        rate.extend(running.iter().map(|&i| {
            let ahead = |j: usize| (level[j], out[j].start, j) < (level[i], out[i].start, i);
            let above: f64 = running
                .iter()
                .filter(|&&j| ahead(j))
                .map(|&j| foot[j])
                .sum();
            let left = (1.0 - above).max(0.0);
            if foot[i] <= left || foot[i] <= 0.0 {
                1.0
            } else {
                left / foot[i]
            }
        }));
        // only launches that hold part of the device contend: one that gets none has no
        // CTA resident
        let total: f64 = (0..running.len())
            .filter(|&k| rate[k] > 0.0)
            .map(|k| foot[running[k]])
            .fold(0.0, |a, b| a + b);
        let over = (total - 1.0).clamp(0.0, 1.0);
        for k in 0..running.len() {
            let i = running[k];
            let (mut w, mut c) = (0.0, 0.0);
            for (q, &j) in running.iter().enumerate() {
                if q != k && rate[q] > 0.0 {
                    w += foot[j];
                    c += foot[j] * cfg.device.pair_cost(memory[i], memory[j]);
                }
            }
            let kappa = if w > 0.0 { c / w } else { 0.0 };
            rate[k] = (rate[k] / (1.0 + over * kappa)).min(1.0);
        }
    };
    let mut rate = Vec::new();
    let recorder = p.recorders();
    let queues = p.stream_queues();
    let mut head = vec![0usize; p.streams];
    let mut done = vec![false; n];
    let mut out = vec![
        SimLaunch {
            start: 0.0,
            end: 0.0
        };
        n
    ];
    let mut remaining = work.clone();
    let mut running: Vec<usize> = Vec::new();
    let mut t = 0.0f64;
    let mut finished = 0;
    while finished < n {
        // start everything that can start now, in issue order
        let mut started = true;
        while started {
            started = false;
            for s in 0..p.streams {
                let Some(&i) = queues[s].get(head[s]) else {
                    continue;
                };
                if running
                    .iter()
                    .any(|&r| p.launches[r].stream.0 as usize == s)
                {
                    continue;
                }
                let issued = i as f64 * cfg.host_per_launch_s;
                let deps_done = p.launches[i]
                    .waits
                    .iter()
                    .all(|w| recorder.get(&w.event).is_none_or(|&r| done[r]));
                if deps_done && issued <= t + 1e-15 {
                    out[i].start = t;
                    head[s] += 1;
                    if remaining[i] <= 0.0 {
                        done[i] = true;
                        finished += 1;
                        out[i].end = t;
                    } else {
                        running.push(i);
                    }
                    started = true;
                }
            }
        }
        if finished == n {
            break;
        }
        // advance to the next completion (or the next issue time)
        rates(&running, &out, &mut rate);
        let next_done = running
            .iter()
            .zip(&rate)
            .map(|(&r, &x)| remaining[r] / x)
            .fold(f64::INFINITY, f64::min);
        let next_issue = (0..p.streams)
            .filter_map(|s| queues[s].get(head[s]))
            .map(|&i| i as f64 * cfg.host_per_launch_s)
            .filter(|&x| x > t + 1e-15)
            .fold(f64::INFINITY, f64::min);
        let dt = next_done.min(next_issue);
        if !dt.is_finite() {
            // nothing runs and nothing can start: a wait that is never satisfied
            break;
        }
        t += dt;
        let mut k = 0;
        running.retain(|&r| {
            remaining[r] -= dt * rate[k];
            k += 1;
            if remaining[r] <= 1e-15 {
                done[r] = true;
                out[r].end = t;
                finished += 1;
                false
            } else {
                true
            }
        });
    }
    let mut busy_s = vec![0.0; p.streams];
    for s in 0..p.streams {
        // folded from +0.0: an empty stream is busy 0 s, not the -0.0 an f64 sum starts at
        busy_s[s] = queues[s]
            .iter()
            .map(|&i| out[i].end - out[i].start)
            .fold(0.0, |a, b| a + b);
    }
    let step_s = out.iter().map(|l| l.end).fold(0.0, f64::max);
    SimResult {
        step_s,
        launches: out,
        busy_s,
    }
}

/// How ranks talk: NCCL's ring collectives over a link of `bus_bw` bytes/s with `latency_s`
/// per ring hop. For the H200's NVLink a ring all-reduce reaches a bus bandwidth of about
/// 400 GB/s (an assumption until measured on the machine).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinkModel {
    pub bus_bw: f64,
    pub latency_s: f64,
}

impl LinkModel {
    pub fn nvlink_h200() -> Self {
        LinkModel {
            bus_bw: 400e9,
            latency_s: 8e-6,
        }
    }

    /// Ring all-reduce of `bytes` over `n` ranks: 2(n-1)/n of the data crosses each link.
    pub fn all_reduce_s(&self, bytes: f64, n: usize) -> f64 {
        if n <= 1 {
            return 0.0;
        }
        let n = n as f64;
        2.0 * (n - 1.0) / n * bytes / self.bus_bw + 2.0 * (n - 1.0) * self.latency_s
    }

    /// Ring all-gather where every rank contributes `bytes_per_rank`.
    pub fn all_gather_s(&self, bytes_per_rank: f64, n: usize) -> f64 {
        if n <= 1 {
            return 0.0;
        }
        let nf = n as f64;
        (nf - 1.0) * bytes_per_rank / self.bus_bw + (nf - 1.0) * self.latency_s
    }

    /// All-to-all where every rank sends `bytes_per_rank` in total, spread over the others.
    pub fn all_to_all_s(&self, bytes_per_rank: f64, n: usize) -> f64 {
        if n <= 1 {
            return 0.0;
        }
        let nf = n as f64;
        (nf - 1.0) / nf * bytes_per_rank / self.bus_bw + self.latency_s
    }
}

/// How a bucket crosses the ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BucketKind {
    /// Ring all-reduce of `bytes` (dense gradients).
    AllReduce,
    /// Ring all-gather, every rank contributing `bytes` (replicated tables' sparse
    /// gradients).
    AllGather,
    /// All-to-all, every rank sending `bytes` in all (sharded tables' gradients to their
    /// owners).
    AllToAll,
}

/// One communication bucket: its bytes and when its data is complete on a rank.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Bucket {
    pub bytes: f64,
    pub ready_s: f64,
    pub kind: BucketKind,
}

impl Bucket {
    /// Seconds on `n` ranks over `link`.
    pub fn seconds(&self, link: &LinkModel, n: usize) -> f64 {
        match self.kind {
            BucketKind::AllReduce => link.all_reduce_s(self.bytes, n),
            BucketKind::AllGather => link.all_gather_s(self.bytes, n),
            BucketKind::AllToAll => link.all_to_all_s(self.bytes, n),
        }
    }
}

/// A data-parallel step's prediction.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DataParallelPrediction {
    pub ranks: usize,
    pub step_s: f64,
    /// Communication time not hidden behind computation.
    pub exposed_comm_s: f64,
    pub comm_s: f64,
}

/// Predicts a data-parallel step on `n` ranks from a one-rank simulation: buckets go out
/// on a communication stream, each as soon as it is ready (`early`) or all after
/// `join_s` (one all-reduce at the end); the optimizer (`optimizer_s` long) waits for the
/// last one. Compute and communication are assumed not to slow each other.
pub fn predict_data_parallel(
    join_s: f64,
    optimizer_s: f64,
    buckets: &[Bucket],
    link: &LinkModel,
    n: usize,
    early: bool,
) -> DataParallelPrediction {
    let mut order: Vec<Bucket> = buckets.to_vec();
    order.sort_by(|a, b| a.ready_s.total_cmp(&b.ready_s));
    let mut free = 0.0f64;
    let mut comm = 0.0;
    for b in &order {
        let start = if early {
            b.ready_s.max(free)
        } else {
            join_s.max(free)
        };
        let d = b.seconds(link, n);
        comm += d;
        free = start + d;
    }
    let done = join_s.max(free);
    DataParallelPrediction {
        ranks: n,
        step_s: done + optimizer_s,
        exposed_comm_s: done - join_s,
        comm_s: comm,
    }
}

/// What sharding the embedding tables changes in a data-parallel step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ShardedExchange {
    /// Bytes a rank sends (and receives) in the lookup's all-to-all of rows, which the
    /// lookup waits for at the step's start. (The ids go to their owners with the batch,
    /// as early as it is loaded: behind the step before.)
    pub lookup_bytes: f64,
    /// Bytes a rank sends in the gradients' all-to-all to the owners.
    pub grad_bytes: f64,
    /// The share of the sparse gradients (their bytes and occurrences) that belongs to
    /// tables that stay replicated: those are still gathered, and their update still
    /// grows with the ranks.
    pub replicated_share: f64,
}

/// [`predict_data_parallel`] with the embedding tables replicated (`sharded: None`) or
/// sharded, from a one-rank simulation whose row-wise update takes `update_s` of its
/// `optimizer_s`. Replicated: every rank gathers every rank's sparse gradients (the
/// [`BucketKind::AllGather`] buckets) and applies the update to all `n` ranks'
/// occurrences, `n` times one rank's. Sharded: the rows' all-to-all delays the lookup,
/// and so the whole step, by its time; the gradients' all-to-all replaces the gather
/// (ready when the tables' gradient is); each owner updates about one rank's occurrences
/// (the rows it owns, from every rank). Tables that stay replicated
/// (`ShardedExchange::replicated_share` of the sparse gradients) keep their share of the
/// gather and of the growing update.
#[allow(clippy::too_many_arguments)]
pub fn predict_sharded_step(
    join_s: f64,
    optimizer_s: f64,
    update_s: f64,
    buckets: &[Bucket],
    link: &LinkModel,
    n: usize,
    early: bool,
    sharded: Option<&ShardedExchange>,
) -> DataParallelPrediction {
    let Some(x) = sharded else {
        let more = update_s * n.saturating_sub(1) as f64;
        return predict_data_parallel(join_s, optimizer_s + more, buckets, link, n, early);
    };
    let lookup = if x.lookup_bytes > 0.0 {
        link.all_to_all_s(x.lookup_bytes, n)
    } else {
        0.0
    };
    let share = x.replicated_share.clamp(0.0, 1.0);
    let mut moved: Vec<Bucket> = buckets
        .iter()
        .filter(|b| b.kind != BucketKind::AllGather || share > 0.0)
        .map(|b| Bucket {
            ready_s: b.ready_s + lookup,
            bytes: if b.kind == BucketKind::AllGather {
                b.bytes * share
            } else {
                b.bytes
            },
            ..*b
        })
        .collect();
    // the gradients' exchange when the tables' gradient is complete (at the join if no
    // bucket says when)
    let ready = buckets
        .iter()
        .filter(|b| b.kind == BucketKind::AllGather)
        .map(|b| b.ready_s)
        .reduce(f64::max)
        .unwrap_or(join_s);
    if x.grad_bytes > 0.0 {
        moved.push(Bucket {
            bytes: x.grad_bytes,
            ready_s: ready + lookup,
            kind: BucketKind::AllToAll,
        });
    }
    let optimizer_s = optimizer_s + update_s * share * n.saturating_sub(1) as f64;
    let p = predict_data_parallel(join_s + lookup, optimizer_s, &moved, link, n, early);
    DataParallelPrediction {
        exposed_comm_s: p.exposed_comm_s + lookup,
        comm_s: p.comm_s + lookup,
        ..p
    }
}

#[cfg(test)]
mod dp_tests {
    use super::*;

    fn one_sharded_free(buckets: &[Bucket], link: &LinkModel) -> DataParallelPrediction {
        predict_data_parallel(5e-3, 2e-4, buckets, link, 1, true)
    }

    #[test]
    fn early_buckets_hide_communication_and_one_rank_costs_nothing() {
        let link = LinkModel::nvlink_h200();
        let buckets = [
            Bucket {
                bytes: 40e6,
                ready_s: 1e-3,
                kind: BucketKind::AllReduce,
            },
            Bucket {
                bytes: 40e6,
                ready_s: 2e-3,
                kind: BucketKind::AllReduce,
            },
            Bucket {
                bytes: 20e6,
                ready_s: 4e-3,
                kind: BucketKind::AllGather,
            },
        ];
        let one = predict_data_parallel(5e-3, 1e-4, &buckets, &link, 1, true);
        assert_eq!(one.step_s, 5e-3 + 1e-4);
        assert_eq!(one.exposed_comm_s, 0.0);
        for n in [2, 8] {
            let early = predict_data_parallel(5e-3, 1e-4, &buckets, &link, n, true);
            let end = predict_data_parallel(5e-3, 1e-4, &buckets, &link, n, false);
            assert!(
                early.step_s <= end.step_s,
                "{n}: early {early:?} end {end:?}"
            );
            assert!(
                (end.exposed_comm_s - end.comm_s).abs() < 1e-12,
                "at the end nothing hides"
            );
            assert!(early.exposed_comm_s < end.exposed_comm_s);
        }
        // sharded tables: the gather becomes an all-to-all and the update stays one rank's;
        // replicated, the gathered update grows with the ranks
        let x = ShardedExchange {
            lookup_bytes: 20e6,
            grad_bytes: 20e6,
            replicated_share: 0.0,
        };
        let one_rep = predict_sharded_step(5e-3, 2e-4, 1e-4, &buckets, &link, 1, true, None);
        assert_eq!(one_rep, one_sharded_free(&buckets, &link));
        for n in [2, 8, 64] {
            let rep = predict_sharded_step(5e-3, 2e-4, 1e-4, &buckets, &link, n, true, None);
            let plain = predict_data_parallel(5e-3, 2e-4, &buckets, &link, n, true);
            assert!((rep.step_s - plain.step_s - (n - 1) as f64 * 1e-4).abs() < 1e-12);
            let sh = predict_sharded_step(5e-3, 2e-4, 1e-4, &buckets, &link, n, true, Some(&x));
            let lookup = link.all_to_all_s(20e6, n);
            // the lookup's exchange is exposed whole, and counted as communication
            assert!(sh.step_s >= 5e-3 + 2e-4 + lookup - 1e-12, "{n}: {sh:?}");
            assert!(
                sh.exposed_comm_s >= lookup && sh.comm_s >= lookup + link.all_to_all_s(20e6, n)
            );
            if n == 64 {
                // at 64 ranks the gather of 20 MB from every rank costs far more
                assert!(sh.step_s < rep.step_s, "{sh:?} against {rep:?}");
            }
            // tables that stay replicated keep their gather and their growing update:
            // a placement that shards nothing costs the replicated step plus its lookup
            let none = ShardedExchange {
                replicated_share: 1.0,
                ..x
            };
            let mixed =
                predict_sharded_step(5e-3, 2e-4, 1e-4, &buckets, &link, n, true, Some(&none));
            assert!(mixed.step_s >= rep.step_s, "{n}: {mixed:?} against {rep:?}");
            let half = ShardedExchange {
                replicated_share: 0.5,
                ..x
            };
            let h = predict_sharded_step(5e-3, 2e-4, 1e-4, &buckets, &link, n, true, Some(&half));
            assert!(
                h.step_s >= sh.step_s && h.step_s <= mixed.step_s,
                "{n}: {h:?}"
            );
        }
        // a ring all-reduce moves 2(n-1)/n of the data: more ranks, more time, bounded
        let a2 = link.all_reduce_s(1e9, 2);
        let a8 = link.all_reduce_s(1e9, 8);
        assert!(a2 < a8 && a8 < 2.0 * 1e9 / link.bus_bw + 14.0 * link.latency_s + 1e-12);
    }
}

/// One ordering constraint the occupancy model kept: the device-filling launch of
/// `node` runs alone, and the step is predicted `gain_s` shorter for it.
#[derive(Clone, Debug, PartialEq)]
pub struct KeptConstraint {
    pub node: NodeId,
    pub label: String,
    pub gain_s: f64,
}

/// What the occupancy model decided for a schedule.
#[derive(Clone, Debug, PartialEq)]
pub struct OccupancyChoice {
    /// Launches the rule would order against the other streams.
    pub candidates: usize,
    /// The streams' priority levels chosen.
    pub priorities: Priorities,
    /// Each set of priority levels tried, with the step predicted with it (and the
    /// constraints kept for it), in the order tried: the default first (ranked, unless a set
    /// was forced).
    pub tried: Vec<(Priorities, f64)>,
    /// What the chosen priorities gain over [`Priorities::RANKED`] without constraints.
    pub priority_gain_s: f64,
    /// The ordering constraints kept, each with its gain over the ones before it.
    pub kept: Vec<KeptConstraint>,
    /// Predicted step of `--occupancy off` (ranked priorities, no constraint), and of
    /// the choice.
    pub off_s: f64,
    pub chosen_s: f64,
}

/// Least predicted gain, as a share of the step, for which a constraint is kept: below
/// it the model's error is larger than what it would buy.
pub const MIN_GAIN: f64 = 1e-3;

/// Least predicted gain, as a share of the step, for which other stream priorities
/// replace the ranked ones: the noise of alternated runs on an H200 (0.5 %). The model's
/// predictions of what a change of priorities does are smaller than its error on the step
/// (main-first measured -0.8 % to +0.9 % on the CTR step where it predicted about
/// +0.1 %; BENCHMARKS.md), so a smaller predicted gain could not be confirmed.
pub const PRIORITY_MIN_GAIN: f64 = 5e-3;

/// The stream priorities the occupancy model chooses among, the default first.
pub const PRIORITY_CANDIDATES: [Priorities; 3] =
    [Priorities::RANKED, Priorities::MAIN_FIRST, Priorities::FLAT];

/// The occupancy model deciding, not forbidding. For each set of stream priorities in
/// `priorities` (say [`PRIORITY_CANDIDATES`]; those that rank this program's streams
/// alike are tried once), starting from the schedule without the rule, each launch the rule names (in
/// issue order) is tried as device-filling, i.e. ordered against the other streams, and
/// kept only where the simulator (`sim`, with the kernels' footprints, the streams'
/// priorities and shared-device progress) predicts the step at least [`MIN_GAIN`]
/// shorter with it than with the constraints kept before. A later set of priorities
/// replaces the first only where it is predicted at least [`PRIORITY_MIN_GAIN`] shorter. Deterministic: the same graph and configuration give the same choice, so every
/// rank the same program. Returns the configuration to schedule with and the choice.
pub fn choose_occupancy(
    g: &Graph,
    part: &Partition,
    cfg: &ScheduleConfig,
    sim: &SimConfig,
    priorities: &[Priorities],
) -> (ScheduleConfig, OccupancyChoice) {
    let off = ScheduleConfig {
        occupancy: false,
        exclusive_only: None,
        priorities: Priorities::RANKED,
        ..cfg.clone()
    };
    let on = ScheduleConfig {
        occupancy: true,
        ..off.clone()
    };
    let mut probe = schedule(g, part, &off);
    let off_s = simulate(&probe, sim).step_s;
    let candidates: Vec<(NodeId, String)> = schedule(g, part, &on)
        .launches
        .iter()
        .filter(|l| l.exclusive)
        .map(|l| (l.node, format!("{} '{}'", l.label, g.node(l.node).name)))
        .collect();
    // the priority sets that rank this program's streams differently
    // (the off program, its priorities set in turn)
    let mut ranks = |p: Priorities| -> Vec<u32> {
        probe.priorities = p;
        (0..probe.streams)
            .map(|s| probe.stream_rank(StreamId(s as u16)))
            .collect()
    };
    let mut sets: Vec<(Priorities, Vec<u32>)> = Vec::new();
    for &p in priorities {
        let r = ranks(p);
        if sets.iter().all(|(_, q)| *q != r) {
            sets.push((p, r));
        }
    }
    let mut tried = Vec::new();
    // per set: its base without constraints, the kept nodes, the kept constraints
    let mut found: Vec<(f64, Vec<NodeId>, Vec<KeptConstraint>)> = Vec::new();
    for (p, _) in sets {
        let base = if p == Priorities::RANKED {
            off_s
        } else {
            let c = ScheduleConfig {
                priorities: p,
                ..off.clone()
            };
            simulate(&schedule(g, part, &c), sim).step_s
        };
        let (nodes, kept, t) = greedy_constraints(&candidates, base, |trial| {
            let c = ScheduleConfig {
                exclusive_only: Some(trial.to_vec()),
                priorities: p,
                ..on.clone()
            };
            simulate(&schedule(g, part, &c), sim).step_s
        });
        tried.push((p, t));
        found.push((base, nodes, kept));
    }
    let (priorities, chosen_s, (base, nodes, kept)) = match pick_priorities(&tried) {
        Some(i) => (tried[i].0, tried[i].1, found.swap_remove(i)),
        None => (Priorities::RANKED, off_s, (off_s, Vec::new(), Vec::new())),
    };
    let chosen = if nodes.is_empty() {
        ScheduleConfig { priorities, ..off }
    } else {
        ScheduleConfig {
            exclusive_only: Some(nodes),
            priorities,
            ..on
        }
    };
    (
        chosen,
        OccupancyChoice {
            candidates: candidates.len(),
            priorities,
            tried,
            priority_gain_s: off_s - base,
            kept,
            off_s,
            chosen_s,
        },
    )
}

/// Which of the priority sets tried (each with its predicted step) to run: the first
/// (the default), unless a later one is predicted at least [`PRIORITY_MIN_GAIN`] shorter
/// than it; each later set in turn replaces the one chosen so far only for that gain over
/// it too (two sets within the noise of each other keep the earlier: the model cannot
/// tell them apart). `None` when nothing was tried.
pub fn pick_priorities(tried: &[(Priorities, f64)]) -> Option<usize> {
    tried.first()?;
    let mut best = 0;
    for (i, &(_, t)) in tried.iter().enumerate().skip(1) {
        if t < tried[best].1 * (1.0 - PRIORITY_MIN_GAIN) {
            best = i;
        }
    }
    Some(best)
}

/// The greedy choice of [`choose_occupancy`] over any predictor: `candidates` in order,
/// each kept when `predict(kept so far + it)` is at least [`MIN_GAIN`] shorter than the
/// best so far (`base` without any). Returns the kept nodes, their gains and the best.
pub fn greedy_constraints(
    candidates: &[(NodeId, String)],
    base: f64,
    mut predict: impl FnMut(&[NodeId]) -> f64,
) -> (Vec<NodeId>, Vec<KeptConstraint>, f64) {
    let (mut nodes, mut kept, mut best) = (Vec::new(), Vec::new(), base);
    for (node, label) in candidates {
        let mut trial = nodes.clone();
        trial.push(*node);
        let t = predict(&trial);
        if t < best * (1.0 - MIN_GAIN) {
            kept.push(KeptConstraint {
                node: *node,
                label: label.clone(),
                gain_s: best - t,
            });
            nodes = trial;
            best = t;
        }
    }
    (nodes, kept, best)
}
