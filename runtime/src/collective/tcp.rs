//! The CPU collective backend for ranks that are processes: every rank talks to rank 0
//! over the TCP connection the rendezvous left open (a star). Each rank sends its call
//! (sequence number, kind, bucket, size) and payload; rank 0 checks that every call
//! matches its own, adds the f32 buffers in rank order (0, 1, ..., n-1, as the
//! in-process backend does, so results are bit-identical on every rank and equal to
//! that backend's), and sends the result back.
//!
//! Failures reach every rank as the in-process backend's errors do: a call that differs
//! is a [`CollectiveError::Mismatch`]; a rank that does not arrive within the timeout
//! makes rank 0 report [`CollectiveError::Timeout`] naming it to every rank; a rank
//! whose connection closes (it exited or was killed) or that calls
//! [`TcpCollective::abort`] makes the others fail with [`CollectiveError::Aborted`]. A
//! rank whose answer from rank 0 does not come within the timeout (plus a little slack,
//! so that rank 0's own report arrives first when it is rank 0 that waits) names rank 0.
//!
//! A star costs rank 0 n - 1 transfers per collective: fine for CI and loopback tests,
//! not a fast path (NCCL is the fast path).

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::time::{Duration, Instant};

use crate::collective::rendezvous::{write_u64, Links, Rendezvous};
use crate::collective::{CallLog, Collective, CollectiveError, CollectiveRecord};

const CALL: u64 = 0;
const ABORT: u64 = 1;

const OK: u64 = 0;
const MISMATCH: u64 = 1;
const TIMEOUT: u64 = 2;
const ABORTED: u64 = 3;

/// One rank's handle of a TCP group (see the module documentation).
pub struct TcpCollective {
    rank: usize,
    world: usize,
    timeout: Duration,
    log: CallLog,
    links: Links,
    /// Set once the group failed: later calls fail at once with this reason.
    failed: Option<String>,
}

fn kind_code(kind: &str) -> u64 {
    match kind {
        "all_reduce" => 0,
        "all_gather" => 1,
        "all_to_all" => 3,
        _ => 2,
    }
}

fn kind_name(code: u64) -> &'static str {
    match code {
        0 => "all_reduce",
        1 => "all_gather",
        3 => "all_to_all",
        _ => "barrier",
    }
}

/// Parts as one payload: their count, each one's length, then their bytes.
fn pack_parts(parts: &[Vec<u8>]) -> Vec<u8> {
    let mut b =
        Vec::with_capacity(8 * (parts.len() + 1) + parts.iter().map(Vec::len).sum::<usize>());
    b.extend_from_slice(&(parts.len() as u64).to_le_bytes());
    for p in parts {
        b.extend_from_slice(&(p.len() as u64).to_le_bytes());
    }
    for p in parts {
        b.extend_from_slice(p);
    }
    b
}

/// The parts of [`pack_parts`], or what is wrong with the bytes.
fn unpack_parts(b: &[u8]) -> Result<Vec<Vec<u8>>, String> {
    let word = |i: usize| -> Result<usize, String> {
        let w = b
            .get(8 * i..8 * i + 8)
            .ok_or_else(|| format!("a parts message of {} bytes ends in its header", b.len()))?;
        let mut a = [0u8; 8];
        a.copy_from_slice(w);
        Ok(u64::from_le_bytes(a) as usize)
    };
    let n = word(0)?;
    if n > b.len() / 8 {
        return Err(format!(
            "a parts message of {} bytes claims {n} parts",
            b.len()
        ));
    }
    let mut at = 8 * (n + 1);
    let mut parts = Vec::with_capacity(n);
    for i in 0..n {
        let len = word(1 + i)?;
        let end = at
            .checked_add(len)
            .filter(|&e| e <= b.len())
            .ok_or_else(|| {
                format!(
                    "part {i} of {len} bytes runs past the message's {}",
                    b.len()
                )
            })?;
        parts.push(b[at..end].to_vec());
        at = end;
    }
    if at != b.len() {
        return Err(format!("{} bytes after the last part", b.len() - at));
    }
    Ok(parts)
}

/// A call as it travels.
struct Call {
    seq: u64,
    kind: &'static str,
    bucket: String,
    bytes: usize,
    payload: Vec<u8>,
}

/// What a rank 0 read from one rank gives.
enum Arrival {
    Call(Call),
    Abort,
}

impl TcpCollective {
    /// The group of a finished rendezvous; a rank that waits longer than `timeout` for
    /// the others fails.
    pub fn new(rdv: Rendezvous, timeout: Duration) -> Self {
        TcpCollective {
            rank: rdv.rank,
            world: rdv.world,
            timeout,
            log: CallLog::default(),
            links: rdv.links,
            failed: None,
        }
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Aborts the group: every rank's pending and later collectives fail promptly.
    pub fn abort(&mut self) {
        let reason = format!("rank {} aborted the group", self.rank);
        match &mut self.links {
            Links::Leaf(s) => {
                let _ = write_u64(s, ABORT);
                let _ = s.flush();
                let _ = s.shutdown(Shutdown::Both);
            }
            Links::Root(peers) => {
                for s in peers.iter_mut().flatten() {
                    let _ = send_error(s, ABORTED, &[], &reason);
                    let _ = s.shutdown(Shutdown::Both);
                }
            }
            Links::Alone => {}
        }
        self.failed.get_or_insert(reason);
    }

    fn exchange(
        &mut self,
        kind: &'static str,
        bucket: &str,
        bytes: usize,
        payload: Vec<u8>,
    ) -> Result<Vec<u8>, CollectiveError> {
        let op = self.log.record(kind, bucket, bytes);
        let seq = op.seq;
        let rank = self.rank;
        if let Some(reason) = &self.failed {
            return Err(CollectiveError::Aborted {
                rank,
                op,
                reason: reason.clone(),
            });
        }
        let call = Call {
            seq,
            kind,
            bucket: bucket.to_string(),
            bytes,
            payload,
        };
        let r = match &mut self.links {
            Links::Alone => Ok(call.payload),
            Links::Leaf(s) => leaf_exchange(s, rank, &op, call, self.timeout),
            Links::Root(peers) => root_exchange(peers, self.world, &op, call, self.timeout),
        };
        if let Err(e) = &r {
            self.failed = Some(match e {
                CollectiveError::Aborted { reason, .. } => reason.clone(),
                other => format!("{other}"),
            });
        }
        r
    }
}

fn deadline_read(s: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> io::Result<()> {
    let mut at = 0;
    while at < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        s.set_read_timeout(Some(left))?;
        match s.read(&mut buf[at..]) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => at += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                return Err(io::ErrorKind::TimedOut.into())
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn deadline_u64(s: &mut TcpStream, deadline: Instant) -> io::Result<u64> {
    let mut b = [0u8; 8];
    deadline_read(s, &mut b, deadline)?;
    Ok(u64::from_le_bytes(b))
}

fn deadline_bytes(s: &mut TcpStream, deadline: Instant, max: usize) -> io::Result<Vec<u8>> {
    let n = deadline_u64(s, deadline)? as usize;
    if n > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("a message of {n} bytes (at most {max} expected)"),
        ));
    }
    let mut v = vec![0u8; n];
    deadline_read(s, &mut v, deadline)?;
    Ok(v)
}

fn write_bytes(s: &mut TcpStream, b: &[u8]) -> io::Result<()> {
    write_u64(s, b.len() as u64)?;
    s.write_all(b)
}

fn send_call(s: &mut TcpStream, c: &Call, timeout: Duration) -> io::Result<()> {
    s.set_write_timeout(Some(timeout))?;
    let mut head = Vec::with_capacity(48 + c.bucket.len());
    write_u64(&mut head, CALL)?;
    write_u64(&mut head, c.seq)?;
    write_u64(&mut head, kind_code(c.kind))?;
    write_u64(&mut head, c.bucket.len() as u64)?;
    head.extend_from_slice(c.bucket.as_bytes());
    write_u64(&mut head, c.bytes as u64)?;
    write_u64(&mut head, c.payload.len() as u64)?;
    s.write_all(&head)?;
    s.write_all(&c.payload)?;
    s.flush()
}

fn read_arrival(s: &mut TcpStream, deadline: Instant) -> io::Result<Arrival> {
    if deadline_u64(s, deadline)? == ABORT {
        return Ok(Arrival::Abort);
    }
    let seq = deadline_u64(s, deadline)?;
    let kind = kind_name(deadline_u64(s, deadline)?);
    let bucket = String::from_utf8_lossy(&deadline_bytes(s, deadline, 1 << 16)?).into_owned();
    let bytes = deadline_u64(s, deadline)? as usize;
    let payload = deadline_bytes(s, deadline, usize::MAX)?;
    Ok(Arrival::Call(Call {
        seq,
        kind,
        bucket,
        bytes,
        payload,
    }))
}

fn send_error(s: &mut TcpStream, status: u64, missing: &[usize], msg: &str) -> io::Result<()> {
    s.set_write_timeout(Some(Duration::from_secs(2)))?;
    let mut b = Vec::new();
    write_u64(&mut b, status)?;
    write_u64(&mut b, missing.len() as u64)?;
    for &m in missing {
        write_u64(&mut b, m as u64)?;
    }
    write_u64(&mut b, msg.len() as u64)?;
    b.extend_from_slice(msg.as_bytes());
    s.write_all(&b)?;
    s.flush()
}

/// Whether `s` has bytes waiting (the rank's call arrived, or its connection closed).
fn has_data(s: &TcpStream) -> bool {
    if s.set_nonblocking(true).is_err() {
        return false;
    }
    let mut b = [0u8; 1];
    let r = s.peek(&mut b);
    let _ = s.set_nonblocking(false);
    matches!(r, Ok(n) if n > 0)
}

fn root_exchange(
    peers: &mut [Option<TcpStream>],
    world: usize,
    op: &CollectiveRecord,
    mine: Call,
    timeout: Duration,
) -> Result<Vec<u8>, CollectiveError> {
    let deadline = Instant::now() + timeout;
    let mut calls: Vec<Call> = Vec::with_capacity(world);
    calls.push(mine);
    // every failure is reported to every other rank, then returned
    let fail = |peers: &mut [Option<TcpStream>], e: CollectiveError| {
        let (status, missing, msg) = match &e {
            CollectiveError::Mismatch { detail, .. } => (MISMATCH, Vec::new(), detail.clone()),
            CollectiveError::Timeout { missing, .. } => (TIMEOUT, missing.clone(), String::new()),
            CollectiveError::Aborted { reason, .. } => (ABORTED, Vec::new(), reason.clone()),
        };
        for s in peers.iter_mut().flatten() {
            let _ = send_error(s, status, &missing, &msg);
        }
        Err(e)
    };
    let aborted = |reason: String| CollectiveError::Aborted {
        rank: 0,
        op: op.clone(),
        reason,
    };
    for r in 1..world {
        let Some(s) = peers[r].as_mut() else {
            return fail(peers, aborted(format!("rank {r} has no connection")));
        };
        let arrival = read_arrival(s, deadline);
        let c = match arrival {
            Ok(Arrival::Call(c)) => c,
            Ok(Arrival::Abort) => {
                peers[r] = None;
                return fail(peers, aborted(format!("rank {r} aborted the group")));
            }
            Err(e) if e.kind() == io::ErrorKind::TimedOut => {
                let mut missing = vec![r];
                missing
                    .extend((r + 1..world).filter(|&k| !peers[k].as_ref().is_some_and(has_data)));
                return fail(
                    peers,
                    CollectiveError::Timeout {
                        rank: 0,
                        op: op.clone(),
                        timeout,
                        missing,
                    },
                );
            }
            Err(e) => {
                peers[r] = None;
                return fail(
                    peers,
                    aborted(format!(
                        "rank {r} closed its connection (it exited or died): {e}"
                    )),
                );
            }
        };
        let first = &calls[0];
        if c.seq != first.seq
            || c.kind != first.kind
            || c.bucket != first.bucket
            || c.bytes != first.bytes
        {
            let detail = format!(
                "rank {r} called {} '{}' ({} bytes, seq {}) but rank 0 called {} '{}' ({} bytes, seq {})",
                c.kind, c.bucket, c.bytes, c.seq, first.kind, first.bucket, first.bytes, first.seq
            );
            return fail(
                peers,
                CollectiveError::Mismatch {
                    rank: 0,
                    op: op.clone(),
                    detail,
                },
            );
        }
        calls.push(c);
    }
    // an all_to_all gives each rank its own column; the rest one result for all
    let columns = if op.kind == "all_to_all" {
        let mut parts = Vec::with_capacity(world);
        for (r, c) in calls.iter().enumerate() {
            match unpack_parts(&c.payload) {
                Ok(p) if p.len() == world => parts.push(p),
                Ok(p) => {
                    let detail = format!(
                        "rank {r} passed {} parts to all_to_all '{}' for {world} ranks",
                        p.len(),
                        op.bucket
                    );
                    return fail(
                        peers,
                        CollectiveError::Mismatch {
                            rank: 0,
                            op: op.clone(),
                            detail,
                        },
                    );
                }
                Err(e) => return fail(peers, aborted(format!("rank {r}'s all_to_all: {e}"))),
            }
        }
        Some(
            (0..world)
                .map(|to| {
                    pack_parts(
                        &parts
                            .iter()
                            .map(|from| from[to].clone())
                            .collect::<Vec<_>>(),
                    )
                })
                .collect::<Vec<_>>(),
        )
    } else {
        None
    };
    let result = match &columns {
        Some(c) => c[0].clone(),
        None => combine(op.kind, &calls),
    };
    for (r, p) in peers.iter_mut().enumerate() {
        let Some(s) = p else { continue };
        let bytes = columns.as_ref().map_or(&result, |c| &c[r]);
        let sent = (|| -> io::Result<()> {
            s.set_write_timeout(Some(timeout))?;
            write_u64(s, OK)?;
            write_bytes(s, bytes)?;
            s.flush()
        })();
        if let Err(e) = sent {
            *p = None;
            return fail(
                peers,
                aborted(format!(
                    "rank {r} closed its connection (it exited or died): {e}"
                )),
            );
        }
    }
    Ok(result)
}

/// Every rank's payload combined in rank order: f32 sums for an all_reduce, the
/// concatenation for an all_gather, nothing for a barrier.
fn combine(kind: &str, calls: &[Call]) -> Vec<u8> {
    match kind {
        "all_reduce" => {
            let mut acc: Vec<f32> = bytemuck::pod_collect_to_vec(&calls[0].payload);
            for c in &calls[1..] {
                let v: Vec<f32> = bytemuck::pod_collect_to_vec(&c.payload);
                for (a, x) in acc.iter_mut().zip(&v) {
                    *a += *x;
                }
            }
            bytemuck::cast_slice(&acc).to_vec()
        }
        "all_gather" => calls.iter().flat_map(|c| c.payload.clone()).collect(),
        _ => Vec::new(),
    }
}

fn leaf_exchange(
    s: &mut TcpStream,
    rank: usize,
    op: &CollectiveRecord,
    call: Call,
    timeout: Duration,
) -> Result<Vec<u8>, CollectiveError> {
    let lost = |e: io::Error| CollectiveError::Aborted {
        rank,
        op: op.clone(),
        reason: format!("lost the connection to rank 0 (it exited or died): {e}"),
    };
    send_call(s, &call, timeout).map_err(lost)?;
    // rank 0 reports a missing third rank at its own deadline: leave it time to do so
    let slack = Duration::from_secs(2).max(timeout / 4);
    let deadline = Instant::now() + timeout + slack;
    let status = match deadline_u64(s, deadline) {
        Ok(v) => v,
        Err(e) if e.kind() == io::ErrorKind::TimedOut => {
            return Err(CollectiveError::Timeout {
                rank,
                op: op.clone(),
                timeout: timeout + slack,
                missing: vec![0],
            })
        }
        Err(e) => return Err(lost(e)),
    };
    let read = |s: &mut TcpStream| -> io::Result<(Vec<usize>, String)> {
        let n = deadline_u64(s, deadline)? as usize;
        let missing = (0..n.min(1 << 16))
            .map(|_| deadline_u64(s, deadline).map(|m| m as usize))
            .collect::<io::Result<Vec<_>>>()?;
        let msg = String::from_utf8_lossy(&deadline_bytes(s, deadline, 1 << 20)?).into_owned();
        Ok((missing, msg))
    };
    let op = op.clone();
    match status {
        OK => deadline_bytes(s, deadline, usize::MAX).map_err(lost),
        MISMATCH => {
            let (_, detail) = read(s).map_err(lost)?;
            Err(CollectiveError::Mismatch { rank, op, detail })
        }
        TIMEOUT => {
            let (missing, _) = read(s).map_err(lost)?;
            Err(CollectiveError::Timeout {
                rank,
                op,
                timeout,
                missing,
            })
        }
        _ => {
            let (_, reason) = read(s).map_err(lost)?;
            Err(CollectiveError::Aborted { rank, op, reason })
        }
    }
}

impl Collective for TcpCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_reduce_sum(&mut self, bucket: &str, buf: &mut [f32]) -> Result<(), CollectiveError> {
        let bytes = std::mem::size_of_val(buf);
        let payload = bytemuck::cast_slice(buf).to_vec();
        let sum = self.exchange("all_reduce", bucket, bytes, payload)?;
        if sum.len() != bytes {
            return Err(CollectiveError::Aborted {
                rank: self.rank,
                op: self.log.last(),
                reason: format!("rank 0 sent {} bytes for {bytes}", sum.len()),
            });
        }
        bytemuck::cast_slice_mut::<f32, u8>(buf).copy_from_slice(&sum);
        Ok(())
    }

    fn all_gather(&mut self, bucket: &str, mine: &[u8]) -> Result<Vec<Vec<u8>>, CollectiveError> {
        let n = mine.len();
        let all = self.exchange("all_gather", bucket, n, mine.to_vec())?;
        if all.len() != n * self.world {
            return Err(CollectiveError::Aborted {
                rank: self.rank,
                op: self.log.last(),
                reason: format!("rank 0 sent {} bytes for {} x {n}", all.len(), self.world),
            });
        }
        Ok(if n == 0 {
            vec![Vec::new(); self.world]
        } else {
            all.chunks(n).map(<[u8]>::to_vec).collect()
        })
    }

    fn all_to_all(
        &mut self,
        bucket: &str,
        send: &[Vec<u8>],
    ) -> Result<Vec<Vec<u8>>, CollectiveError> {
        let got = self.exchange("all_to_all", bucket, 0, pack_parts(send))?;
        let parts = unpack_parts(&got).map_err(|reason| CollectiveError::Aborted {
            rank: self.rank,
            op: self.log.last(),
            reason: format!("rank 0's all_to_all answer: {reason}"),
        })?;
        if parts.len() != self.world {
            let reason = if matches!(self.links, Links::Alone) {
                format!("{} parts for 1 rank", parts.len())
            } else {
                format!("rank 0 sent {} parts for {} ranks", parts.len(), self.world)
            };
            return Err(CollectiveError::Mismatch {
                rank: self.rank,
                op: self.log.last(),
                detail: reason,
            });
        }
        Ok(parts)
    }

    fn barrier(&mut self, what: &str) -> Result<(), CollectiveError> {
        self.exchange("barrier", what, 0, Vec::new()).map(|_| ())
    }

    fn log(&self) -> &[CollectiveRecord] {
        self.log.records()
    }
}

impl Drop for TcpCollective {
    fn drop(&mut self) {
        match &mut self.links {
            Links::Leaf(s) => {
                let _ = s.shutdown(Shutdown::Both);
            }
            Links::Root(peers) => {
                for s in peers.iter_mut().flatten() {
                    let _ = s.shutdown(Shutdown::Both);
                }
            }
            Links::Alone => {}
        }
    }
}
