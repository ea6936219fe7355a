//! NCCL through cudarc, loaded at run time: nothing NCCL is needed to build or start;
//! where `libnccl.so` is missing the first call says so instead of crashing.
//!
//! [`NcclComm`] issues collectives on a stream the caller gives (the communication
//! stream of a data-parallel step), records each in a log of [`CollectiveRecord`]s as
//! the CPU backends do, and can be aborted from another thread (`ncclCommAbort` is
//! allowed to run while a collective hangs): [`Watchdog`] does that when the host
//! stays inside one operation longer than the timeout, and exits the process naming
//! the rank and the operation.
//!
//! NVLink multicast (NVLS) is off (`NCCL_NVLS_ENABLE=0`): it is forbidden on our GPU
//! machines and it reduces in an order that is not fixed.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cudarc::nccl::sys;

use crate::collective::{CallLog, CollectiveRecord};
use crate::error::RuntimeError;

fn nccl_err(what: &str, e: cudarc::nccl::result::NcclError) -> RuntimeError {
    RuntimeError::Device(format!("NCCL {what}: {:?}", e.0))
}

/// One transfer of [`NcclComm::exchange`]: `bytes` at device address `ptr` sent to, or
/// received from, rank `peer`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transfer {
    Send { peer: usize, ptr: u64, bytes: usize },
    Recv { peer: usize, ptr: u64, bytes: usize },
}

impl Transfer {
    pub fn peer(&self) -> usize {
        match *self {
            Transfer::Send { peer, .. } | Transfer::Recv { peer, .. } => peer,
        }
    }
}

/// `queue`'s NCCL calls as one group, ended even when queuing one of them fails.
fn grouped(
    queue: impl FnOnce() -> Result<(), cudarc::nccl::result::NcclError>,
) -> Result<(), cudarc::nccl::result::NcclError> {
    cudarc::nccl::result::group_start()?;
    let queued = queue();
    let ended = cudarc::nccl::result::group_end();
    queued?;
    ended?;
    Ok(())
}

/// Whether NCCL can be loaded; `Err` says why not. Looking for it panics inside cudarc
/// when the library lacks a symbol it expects: that becomes an error too.
pub fn nccl_check() -> Result<i32, RuntimeError> {
    let found = std::panic::catch_unwind(|| {
        // SAFETY: only tries to load the library by its usual names.
        unsafe { sys::is_culib_present() }
    });
    match found {
        Ok(true) => {}
        Ok(false) => {
            return Err(RuntimeError::Device(
                "NCCL (libnccl.so) was not found on the loader path; install NCCL or add its folder to LD_LIBRARY_PATH".into(),
            ))
        }
        Err(_) => {
            return Err(RuntimeError::Device(
                "this libnccl.so lacks functions cudarc expects (NCCL 2.28 or newer is needed)"
                    .into(),
            ))
        }
    }
    std::panic::catch_unwind(cudarc::nccl::result::get_nccl_version)
        .map_err(|_| RuntimeError::Device("loading NCCL failed".into()))?
        .map_err(|e| nccl_err("version", e))
}

/// A new NCCL unique id (rank 0 makes it and hands it out), as bytes.
pub fn unique_id() -> Result<Vec<u8>, RuntimeError> {
    nccl_check()?;
    let id = cudarc::nccl::result::get_uniqueid().map_err(|e| nccl_err("unique id", e))?;
    Ok(id.internal.iter().map(|&c| c as u8).collect())
}

/// A communicator handle that may be aborted from the watchdog thread.
#[derive(Clone, Copy)]
struct RawComm(sys::ncclComm_t);
// SAFETY: NCCL allows ncclCommAbort and ncclCommGetAsyncError from any thread.
unsafe impl Send for RawComm {}

/// One rank's NCCL communicator.
///
/// NCCL allows a communicator's calls from any thread as long as they are not
/// concurrent; `&mut self` on every call, and a lock where several dispatch threads
/// share it, keep them one at a time.
pub struct NcclComm {
    comm: sys::ncclComm_t,
    rank: usize,
    world: usize,
    log: CallLog,
    aborted: Arc<AtomicBool>,
}

// SAFETY: the handle may move between threads (NCCL requires only that calls on one
// communicator do not overlap, which `&mut self` guarantees); the device context is bound
// by every thread that issues work before it calls in.
unsafe impl Send for NcclComm {}

/// What the host is doing, for the watchdog: since when, and what.
#[derive(Default)]
struct Doing {
    since: Option<Instant>,
    what: String,
}

/// Exits the process with a message naming the rank and the operation when the host
/// stays inside one operation (a collective, a step's wait) longer than the timeout,
/// after aborting the communicator so that no GPU stays blocked in NCCL.
pub struct Watchdog {
    doing: Arc<Mutex<Doing>>,
    comm: Arc<Mutex<Option<RawComm>>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Watchdog {
    pub fn start(rank: usize, timeout: Duration) -> Self {
        let doing = Arc::new(Mutex::new(Doing::default()));
        let comm: Arc<Mutex<Option<RawComm>>> = Arc::new(Mutex::new(None));
        let stop = Arc::new(AtomicBool::new(false));
        let (d, c, s) = (Arc::clone(&doing), Arc::clone(&comm), Arc::clone(&stop));
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(100));
                let late = {
                    let d = d.lock().unwrap_or_else(|e| e.into_inner());
                    d.since
                        .filter(|t| t.elapsed() > timeout)
                        .map(|_| d.what.clone())
                };
                if let Some(what) = late {
                    eprintln!(
                        "erase-ctr: error: rank {rank}: {what}: timed out after {timeout:?} (another rank may have died or stopped); aborting the NCCL communicator"
                    );
                    if let Some(RawComm(comm)) = *c.lock().unwrap_or_else(|e| e.into_inner()) {
                        // SAFETY: `comm` is live (cleared before it is destroyed); NCCL
                        // allows aborting it while another thread is inside a call.
                        let _ = unsafe { cudarc::nccl::result::comm_abort(comm) };
                    }
                    std::process::exit(1);
                }
            }
        });
        Watchdog {
            doing,
            comm,
            stop,
            thread: Some(thread),
        }
    }

    /// The host enters `what`.
    pub fn enter(&self, what: impl Into<String>) {
        let mut d = self.doing.lock().unwrap_or_else(|e| e.into_inner());
        d.since = Some(Instant::now());
        d.what = what.into();
    }

    /// The host left the operation it entered.
    pub fn leave(&self) {
        self.doing.lock().unwrap_or_else(|e| e.into_inner()).since = None;
    }

    fn watch(&self, comm: Option<RawComm>) {
        *self.comm.lock().unwrap_or_else(|e| e.into_inner()) = comm;
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl NcclComm {
    /// Joins the communicator of `world` ranks named by `id` (from [`unique_id`] on rank
    /// 0) on the current CUDA context. `watchdog` ends the process if the other ranks
    /// never join.
    pub fn init(
        id: &[u8],
        rank: usize,
        world: usize,
        watchdog: &Watchdog,
    ) -> Result<Self, RuntimeError> {
        nccl_check()?;
        let mut uid = sys::ncclUniqueId { internal: [0; 128] };
        if id.len() != uid.internal.len() {
            return Err(RuntimeError::Device(format!(
                "the NCCL id from rank 0 has {} bytes, expected 128",
                id.len()
            )));
        }
        for (d, &s) in uid.internal.iter_mut().zip(id) {
            *d = s as _;
        }
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        watchdog.enter(format!("ncclCommInitRank ({world} ranks)"));
        // SAFETY: `comm` is an out-pointer to a live handle; the id came from rank 0's
        // ncclGetUniqueId; the current thread has the device's context bound.
        let r = unsafe {
            cudarc::nccl::result::comm_init_rank(&mut comm, world as i32, uid, rank as i32)
        };
        watchdog.leave();
        r.map_err(|e| nccl_err("ncclCommInitRank", e))?;
        watchdog.watch(Some(RawComm(comm)));
        Ok(NcclComm {
            comm,
            rank,
            world,
            log: CallLog::default(),
            aborted: Arc::new(AtomicBool::new(false)),
        })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world(&self) -> usize {
        self.world
    }

    pub fn log(&self) -> &[CollectiveRecord] {
        self.log.records()
    }

    fn record(&mut self, kind: &'static str, bucket: &str, bytes: usize) -> CollectiveRecord {
        self.log.record(kind, bucket, bytes)
    }

    /// Averages each `(pointer, f32 count)` over the ranks in place, as one grouped
    /// collective (one log record) on `stream`.
    ///
    /// # Safety
    /// Every pointer is a live device allocation of at least its count of f32s, left
    /// alone by other streams until the work on `stream` after this call completes.
    pub unsafe fn all_reduce_mean(
        &mut self,
        bucket: &str,
        parts: &[(u64, usize)],
        stream: cudarc::driver::sys::CUstream,
    ) -> Result<CollectiveRecord, RuntimeError> {
        let bytes = parts.iter().map(|p| p.1 * 4).sum();
        let rec = self.record("all_reduce", bucket, bytes);
        let reduce = || -> Result<(), cudarc::nccl::result::NcclError> {
            for &(ptr, n) in parts {
                // SAFETY: the caller's contract; in place is allowed by NCCL.
                unsafe {
                    cudarc::nccl::result::all_reduce(
                        ptr as *const _,
                        ptr as *mut _,
                        n,
                        sys::ncclDataType_t::ncclFloat32,
                        sys::ncclRedOp_t::ncclAvg,
                        self.comm,
                        stream as sys::cudaStream_t,
                    )
                }?;
            }
            Ok(())
        };
        grouped(reduce).map_err(|e| nccl_err(&format!("{rec}"), e))?;
        Ok(rec)
    }

    /// Gathers `bytes` from every rank's `send` into `recv` (rank order) on `stream`.
    ///
    /// # Safety
    /// `send` holds `bytes` bytes and `recv` `world * bytes`, both live device memory
    /// that other streams leave alone until the work on `stream` completes.
    pub unsafe fn all_gather(
        &mut self,
        bucket: &str,
        send: u64,
        recv: u64,
        bytes: usize,
        stream: cudarc::driver::sys::CUstream,
    ) -> Result<CollectiveRecord, RuntimeError> {
        let rec = self.record("all_gather", bucket, bytes);
        // SAFETY: the caller's contract.
        unsafe {
            cudarc::nccl::result::all_gather(
                send as *const _,
                recv as *mut _,
                bytes,
                sys::ncclDataType_t::ncclUint8,
                self.comm,
                stream as sys::cudaStream_t,
            )
        }
        .map_err(|e| nccl_err(&format!("{rec}"), e))?;
        Ok(rec)
    }

    /// Jagged all-to-all on `stream`, as one group of NCCL sends and receives (one log
    /// record, of 0 bytes as the CPU backends log theirs: the sizes differ by rank).
    /// Rank `k`'s part of `send` is bytes `send_at[k]..send_at[k + 1]`; what rank `k` sent
    /// this one lands at `recv_at[k]..recv_at[k + 1]` of `recv`. Both offset lists have
    /// `world + 1` entries, in order; the sizes must agree with the peers' (exchange the
    /// counts first, with a fixed-size call of this). What a sharded table's lookup and
    /// update exchange: ids to their owners, rows back, gradients to the owners.
    ///
    /// # Safety
    /// `send` holds `send_at[world]` bytes and `recv` `recv_at[world]`, both live device
    /// memory that other streams leave alone until the work on `stream` completes.
    pub unsafe fn all_to_all_v(
        &mut self,
        bucket: &str,
        send: u64,
        send_at: &[usize],
        recv: u64,
        recv_at: &[usize],
        stream: cudarc::driver::sys::CUstream,
    ) -> Result<CollectiveRecord, RuntimeError> {
        // checked before anything is logged or issued: a refused call is no collective
        for (what, at) in [("send", send_at), ("receive", recv_at)] {
            if at.len() != self.world + 1 || at.windows(2).any(|w| w[0] > w[1]) {
                return Err(RuntimeError::Device(format!(
                    "rank {}: all_to_all '{bucket}': the {what} offsets must be {} ascending byte offsets (one part per rank and the end), got {at:?}",
                    self.rank,
                    self.world + 1
                )));
            }
        }
        let parts: Vec<Transfer> = (0..self.world)
            .flat_map(|peer| {
                let (s0, s1) = (send_at[peer], send_at[peer + 1]);
                let (r0, r1) = (recv_at[peer], recv_at[peer + 1]);
                [
                    Transfer::Send {
                        peer,
                        ptr: send + s0 as u64,
                        bytes: s1 - s0,
                    },
                    Transfer::Recv {
                        peer,
                        ptr: recv + r0 as u64,
                        bytes: r1 - r0,
                    },
                ]
            })
            .collect();
        // SAFETY: the caller's contract: each part lies inside its buffer.
        unsafe { self.exchange(bucket, &parts, stream) }
    }

    /// Issues `parts` as one group of NCCL sends and receives on `stream` (one log record,
    /// of 0 bytes as a jagged all-to-all's: the sizes differ by rank). Each rank's sends
    /// to a peer must match the peer's receives from it, in count, size and order.
    /// Peers out of range are refused before anything is logged or issued.
    ///
    /// # Safety
    /// Every part's `bytes` lie inside live device memory that other streams leave alone
    /// until the work on `stream` completes.
    pub unsafe fn exchange(
        &mut self,
        bucket: &str,
        parts: &[Transfer],
        stream: cudarc::driver::sys::CUstream,
    ) -> Result<CollectiveRecord, RuntimeError> {
        if let Some(t) = parts.iter().find(|t| t.peer() >= self.world) {
            return Err(RuntimeError::Device(format!(
                "rank {}: exchange '{bucket}': peer {} of a communicator of {} ranks",
                self.rank,
                t.peer(),
                self.world
            )));
        }
        let rec = self.record("all_to_all", bucket, 0);
        let queue = || -> Result<(), cudarc::nccl::result::NcclError> {
            for t in parts {
                // SAFETY: the caller's contract: each part lies inside live memory.
                unsafe {
                    match *t {
                        Transfer::Send { peer, ptr, bytes } if bytes > 0 => {
                            cudarc::nccl::result::send(
                                ptr as *const _,
                                bytes,
                                sys::ncclDataType_t::ncclUint8,
                                peer as i32,
                                self.comm,
                                stream as sys::cudaStream_t,
                            )?;
                        }
                        Transfer::Recv { peer, ptr, bytes } if bytes > 0 => {
                            cudarc::nccl::result::recv(
                                ptr as *mut _,
                                bytes,
                                sys::ncclDataType_t::ncclUint8,
                                peer as i32,
                                self.comm,
                                stream as sys::cudaStream_t,
                            )?;
                        }
                        _ => {}
                    }
                }
            }
            Ok(())
        };
        grouped(queue).map_err(|e| nccl_err(&format!("{rec}"), e))?;
        Ok(rec)
    }

    /// An error NCCL found while running collectives (a peer that died, a broken link).
    pub fn async_error(&self) -> Option<String> {
        let mut r = sys::ncclResult_t::ncclSuccess;
        // SAFETY: `comm` is live; `r` is an out-pointer to a live value.
        let q = unsafe { sys::ncclCommGetAsyncError(self.comm, &mut r) };
        match (q, r) {
            (sys::ncclResult_t::ncclSuccess, sys::ncclResult_t::ncclSuccess) => None,
            (sys::ncclResult_t::ncclSuccess, e) => Some(format!("{e:?}")),
            (e, _) => Some(format!("{e:?} (asking for the async error)")),
        }
    }

    /// Aborts the communicator: collectives in flight return, later ones fail.
    pub fn abort(&mut self) {
        if !self.aborted.swap(true, Ordering::SeqCst) {
            // SAFETY: `comm` is live and aborted once.
            let _ = unsafe { cudarc::nccl::result::comm_abort(self.comm) };
        }
    }

    /// Forgets the watchdog's handle before the communicator goes.
    pub fn unwatch(&self, watchdog: &Watchdog) {
        watchdog.watch(None);
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        if !self.aborted.load(Ordering::SeqCst) {
            // SAFETY: `comm` is live, destroyed once; the caller synchronized the streams
            // that used it (the step program's drop does).
            let _ = unsafe { cudarc::nccl::result::comm_destroy(self.comm) };
        }
    }
}
