//! Collective communication between the ranks of a data-parallel group.
//!
//! [`Collective`] is the interface the trainer talks to; [`cpu_group`] makes an
//! in-process implementation in which every rank is a thread (the NCCL backend
//! implements the same trait). Every rank must call the same collectives in the
//! same order: the n-th call of every rank is matched by its sequence number, and a
//! rank that calls a different collective (kind, bucket or size) at the same
//! sequence number is a deterministic-order violation that every rank reports as
//! [`CollectiveError::Mismatch`]. A rank that does not arrive within the timeout
//! makes the others fail with [`CollectiveError::Timeout`]; a rank that drops its
//! handle (it died or returned early) or calls [`CpuCollective::abort`] makes the
//! others fail promptly with [`CollectiveError::Aborted`] instead of hanging.
//!
//! `all_reduce_sum` adds the ranks' buffers in rank order (0, 1, ..., n-1) in f32,
//! so every rank gets bit-identical results whatever the order of arrival.

pub mod rendezvous;
pub mod tcp;

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// One call of a collective, as every rank records it in its log.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct CollectiveRecord {
    /// The call's sequence number on this rank: 0, 1, 2, ...
    pub seq: u64,
    /// `"all_reduce"`, `"all_gather"` or `"barrier"`.
    pub kind: &'static str,
    /// The bucket (all_reduce, all_gather) or what the barrier is for.
    pub bucket: String,
    /// This rank's payload in bytes (0 for a barrier).
    pub bytes: usize,
}

/// The calls one rank has made, in order: every backend keeps one, and a call's sequence
/// number is its place in it.
#[derive(Clone, Debug, Default)]
pub struct CallLog(Vec<CollectiveRecord>);

impl CallLog {
    /// Records the next call and returns its record.
    pub fn record(&mut self, kind: &'static str, bucket: &str, bytes: usize) -> CollectiveRecord {
        let r = CollectiveRecord {
            seq: self.0.len() as u64,
            kind,
            bucket: bucket.to_string(),
            bytes,
        };
        self.0.push(r.clone());
        r
    }

    pub fn records(&self) -> &[CollectiveRecord] {
        &self.0
    }

    /// The last call's record (a default one before any call).
    pub fn last(&self) -> CollectiveRecord {
        self.0.last().cloned().unwrap_or_default()
    }
}

impl fmt::Display for CollectiveRecord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} '{}' (seq {}, {} bytes)",
            self.kind, self.bucket, self.seq, self.bytes
        )
    }
}

/// A collective that failed. Each names the rank that reports it and the
/// collective (kind, bucket, sequence number, bytes).
#[derive(Debug, Clone, thiserror::Error)]
pub enum CollectiveError {
    /// Some ranks did not arrive within the timeout.
    #[error("rank {rank}: {op}: timed out after {timeout:?} waiting for rank(s) {missing:?}")]
    Timeout {
        rank: usize,
        op: CollectiveRecord,
        timeout: Duration,
        missing: Vec<usize>,
    },
    /// Ranks called different collectives, buckets or sizes at the same sequence
    /// number: a deterministic-order violation.
    #[error("rank {rank}: {op}: mismatch (deterministic-order violation): {detail}")]
    Mismatch {
        rank: usize,
        op: CollectiveRecord,
        detail: String,
    },
    /// The group was aborted: a rank failed, dropped its handle or called `abort`.
    #[error("rank {rank}: {op}: group aborted: {reason}")]
    Aborted {
        rank: usize,
        op: CollectiveRecord,
        reason: String,
    },
}

impl CollectiveError {
    /// The rank that reports the error.
    pub fn rank(&self) -> usize {
        match self {
            Self::Timeout { rank, .. }
            | Self::Mismatch { rank, .. }
            | Self::Aborted { rank, .. } => *rank,
        }
    }

    /// The collective that failed.
    pub fn op(&self) -> &CollectiveRecord {
        match self {
            Self::Timeout { op, .. } | Self::Mismatch { op, .. } | Self::Aborted { op, .. } => op,
        }
    }
}

/// Collective communication of one rank of a group.
pub trait Collective: Send {
    /// This rank, in `0..world()`.
    fn rank(&self) -> usize;
    /// The number of ranks in the group.
    fn world(&self) -> usize;
    /// Replaces `buf` with the element-wise sum of every rank's `buf`, added in rank
    /// order so that every rank gets bit-identical results.
    fn all_reduce_sum(&mut self, bucket: &str, buf: &mut [f32]) -> Result<(), CollectiveError>;
    /// Every rank's bytes, in rank order; every rank must pass the same length.
    fn all_gather(&mut self, bucket: &str, mine: &[u8]) -> Result<Vec<Vec<u8>>, CollectiveError>;
    /// Jagged all-to-all: `send[k]` goes to rank `k` (one part for every rank, this one's
    /// own included, of any length); returns what every rank sent this one, in rank
    /// order. The sizes differ between ranks, so the call's log entry has none (0 bytes)
    /// and every rank's log stays the same. What a sharded table's lookup exchanges: the
    /// ids each owner must look up, then the pooled rows back.
    fn all_to_all(
        &mut self,
        bucket: &str,
        send: &[Vec<u8>],
    ) -> Result<Vec<Vec<u8>>, CollectiveError>;
    /// Returns once every rank has called it.
    fn barrier(&mut self, what: &str) -> Result<(), CollectiveError>;
    /// Every call this rank made, in order (failed calls included).
    fn log(&self) -> &[CollectiveRecord];
}

/// Makes a CPU group of `world` ranks: one handle per rank, to move into its
/// thread. A rank that waits longer than `timeout` for the others fails.
pub fn cpu_group(world: usize, timeout: Duration) -> Vec<CpuCollective> {
    let shared = Arc::new(Shared {
        state: Mutex::new(State::default()),
        cv: Condvar::new(),
    });
    (0..world)
        .map(|rank| CpuCollective {
            rank,
            world,
            timeout,
            log: CallLog::default(),
            shared: Arc::clone(&shared),
        })
        .collect()
}

/// One rank's handle of a group made by [`cpu_group`]. Dropping it aborts the group.
pub struct CpuCollective {
    rank: usize,
    world: usize,
    timeout: Duration,
    log: CallLog,
    shared: Arc<Shared>,
}

struct Shared {
    state: Mutex<State>,
    cv: Condvar,
}

#[derive(Default)]
struct State {
    slots: HashMap<u64, Slot>,
    /// Set once the group is unusable; the first failure wins.
    failure: Option<Failure>,
}

enum Failure {
    /// `reason` names the rank that aborted.
    Aborted {
        reason: String,
    },
    Mismatch {
        seq: u64,
        detail: String,
    },
    Timeout {
        seq: u64,
        missing: Vec<usize>,
    },
}

/// What one rank deposits.
enum Payload {
    None,
    F32(Vec<f32>),
    Bytes(Vec<u8>),
    /// Every rank's bytes, in rank order: the result of an all_gather.
    Gathered(Vec<Vec<u8>>),
    /// One rank's parts of an all_to_all, one for every rank.
    Parts(Vec<Vec<u8>>),
    /// Every rank's parts, `[from][to]`: the result of an all_to_all.
    Exchanged(Vec<Vec<Vec<u8>>>),
}

/// The meeting point of the ranks' calls with one sequence number.
struct Slot {
    /// The first arrival's call, which the others must match.
    kind: &'static str,
    bucket: String,
    bytes: usize,
    first: usize,
    deposits: Vec<Option<Payload>>,
    arrived: usize,
    /// Set by the last arrival.
    result: Option<Arc<Payload>>,
    /// Ranks that have taken the result; the slot goes when all have.
    taken: usize,
}

impl CpuCollective {
    /// Aborts the group: every rank's pending and later collectives fail promptly.
    pub fn abort(&self) {
        self.fail_group(format!("rank {} aborted the group", self.rank));
    }

    /// How long a rank waits for the others.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    fn fail_group(&self, reason: String) {
        let mut st = self.shared.lock();
        if st.failure.is_none() {
            st.failure = Some(Failure::Aborted { reason });
        }
        drop(st);
        self.shared.cv.notify_all();
    }

    /// Deposits `payload` for the next sequence number, waits for every rank and
    /// returns the combined result.
    fn exchange(
        &mut self,
        kind: &'static str,
        bucket: &str,
        bytes: usize,
        payload: Payload,
    ) -> Result<Arc<Payload>, CollectiveError> {
        let op = self.log.record(kind, bucket, bytes);
        let seq = op.seq;
        let rank = self.rank;
        let world = self.world;
        let deadline = Instant::now() + self.timeout;

        let mut st = self.shared.lock();
        if let Some(f) = &st.failure {
            return Err(failure_error(f, rank, &op, self.timeout));
        }
        let slot = st.slots.entry(seq).or_insert_with(|| Slot {
            kind,
            bucket: bucket.to_string(),
            bytes,
            first: rank,
            deposits: (0..world).map(|_| None).collect(),
            arrived: 0,
            result: None,
            taken: 0,
        });
        if slot.kind != kind || slot.bucket != bucket || slot.bytes != bytes {
            let detail = format!(
                "rank {rank} called {kind} '{bucket}' ({bytes} bytes) but rank {} called {} '{}' ({} bytes)",
                slot.first, slot.kind, slot.bucket, slot.bytes
            );
            st.failure = Some(Failure::Mismatch {
                seq,
                detail: detail.clone(),
            });
            drop(st);
            self.shared.cv.notify_all();
            return Err(CollectiveError::Mismatch { rank, op, detail });
        }
        slot.deposits[rank] = Some(payload);
        slot.arrived += 1;
        if slot.arrived == world {
            slot.result = Some(Arc::new(combine(&mut slot.deposits)));
            self.shared.cv.notify_all();
        }

        loop {
            // A complete collective is delivered even if the group failed since.
            let slot = st
                .slots
                .get_mut(&seq)
                .expect("slot lives until every rank took it");
            if let Some(result) = slot.result.clone() {
                slot.taken += 1;
                if slot.taken == world {
                    st.slots.remove(&seq);
                }
                return Ok(result);
            }
            let missing: Vec<usize> = (0..world).filter(|&r| slot.deposits[r].is_none()).collect();
            if let Some(f) = &st.failure {
                return Err(failure_error(f, rank, &op, self.timeout));
            }
            let now = Instant::now();
            if now >= deadline {
                st.failure = Some(Failure::Timeout {
                    seq,
                    missing: missing.clone(),
                });
                drop(st);
                self.shared.cv.notify_all();
                return Err(CollectiveError::Timeout {
                    rank,
                    op,
                    timeout: self.timeout,
                    missing,
                });
            }
            st = self
                .shared
                .cv
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The error a rank reports for `op` once the group has failed.
fn failure_error(
    f: &Failure,
    rank: usize,
    op: &CollectiveRecord,
    timeout: Duration,
) -> CollectiveError {
    let op = op.clone();
    match f {
        Failure::Mismatch { seq, detail } if *seq == op.seq => CollectiveError::Mismatch {
            rank,
            op,
            detail: detail.clone(),
        },
        Failure::Timeout { seq, missing } if *seq == op.seq && !missing.contains(&rank) => {
            CollectiveError::Timeout {
                rank,
                op,
                timeout,
                missing: missing.clone(),
            }
        }
        Failure::Mismatch { seq, detail } => CollectiveError::Aborted {
            rank,
            op,
            reason: format!("mismatch at seq {seq}: {detail}"),
        },
        Failure::Timeout { seq, missing } => CollectiveError::Aborted {
            rank,
            op,
            reason: format!(
                "seq {seq} timed out after {timeout:?} waiting for rank(s) {missing:?}"
            ),
        },
        Failure::Aborted { reason } => CollectiveError::Aborted {
            rank,
            op,
            reason: reason.clone(),
        },
    }
}

/// Combines every rank's deposit, in rank order.
fn combine(deposits: &mut [Option<Payload>]) -> Payload {
    let n = deposits.len();
    let mut it = deposits
        .iter_mut()
        .map(|d| d.take().expect("every rank deposited"));
    match it.next() {
        None | Some(Payload::None | Payload::Gathered(_) | Payload::Exchanged(_)) => Payload::None,
        Some(Payload::Parts(first)) => {
            let mut all = Vec::with_capacity(n);
            all.push(first);
            for d in it {
                let Payload::Parts(v) = d else {
                    unreachable!("kinds were checked to match")
                };
                all.push(v);
            }
            Payload::Exchanged(all)
        }
        Some(Payload::F32(mut acc)) => {
            for d in it {
                let Payload::F32(v) = d else {
                    unreachable!("kinds were checked to match")
                };
                for (a, x) in acc.iter_mut().zip(&v) {
                    *a += *x;
                }
            }
            Payload::F32(acc)
        }
        Some(Payload::Bytes(first)) => {
            let mut all = Vec::with_capacity(n);
            all.push(first);
            for d in it {
                let Payload::Bytes(v) = d else {
                    unreachable!("kinds were checked to match")
                };
                all.push(v);
            }
            Payload::Gathered(all)
        }
    }
}

impl Collective for CpuCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_reduce_sum(&mut self, bucket: &str, buf: &mut [f32]) -> Result<(), CollectiveError> {
        let bytes = std::mem::size_of_val(buf);
        let result = self.exchange("all_reduce", bucket, bytes, Payload::F32(buf.to_vec()))?;
        let Payload::F32(sum) = &*result else {
            unreachable!("an all_reduce slot holds f32")
        };
        buf.copy_from_slice(sum);
        Ok(())
    }

    fn all_gather(&mut self, bucket: &str, mine: &[u8]) -> Result<Vec<Vec<u8>>, CollectiveError> {
        let n = mine.len();
        let result = self.exchange("all_gather", bucket, n, Payload::Bytes(mine.to_vec()))?;
        let Payload::Gathered(all) = &*result else {
            unreachable!("an all_gather slot gathers bytes")
        };
        Ok(all.clone())
    }

    fn all_to_all(
        &mut self,
        bucket: &str,
        send: &[Vec<u8>],
    ) -> Result<Vec<Vec<u8>>, CollectiveError> {
        if send.len() != self.world {
            let op = self.log.record("all_to_all", bucket, 0);
            let e = CollectiveError::Mismatch {
                rank: self.rank,
                op,
                detail: format!(
                    "rank {} passed {} parts to all_to_all '{bucket}' for {} ranks",
                    self.rank,
                    send.len(),
                    self.world
                ),
            };
            self.fail_group(format!("{e}"));
            return Err(e);
        }
        let result = self.exchange("all_to_all", bucket, 0, Payload::Parts(send.to_vec()))?;
        let Payload::Exchanged(all) = &*result else {
            unreachable!("an all_to_all slot exchanges parts")
        };
        Ok(all.iter().map(|from| from[self.rank].clone()).collect())
    }

    fn barrier(&mut self, what: &str) -> Result<(), CollectiveError> {
        self.exchange("barrier", what, 0, Payload::None).map(|_| ())
    }

    fn log(&self) -> &[CollectiveRecord] {
        self.log.records()
    }
}

impl Drop for CpuCollective {
    fn drop(&mut self) {
        self.fail_group(format!(
            "rank {} dropped its handle after {} collective(s) (it failed or returned early)",
            self.rank,
            self.log.records().len()
        ));
    }
}
