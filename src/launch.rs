//! Data parallelism with one process per rank: the supervisor that `erase-ctr train
//! --gpus N` runs on one host, and the worker each rank runs.
//!
//! The supervisor starts N copies of the same command with the torchrun variables
//! (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`) and
//! `NCCL_NVLS_ENABLE=0`, prefixes their output with `[rank k]`, and watches them: when
//! one exits with an error or is killed, it kills the others and fails with a message
//! naming that rank and its error. Ctrl-C (or SIGTERM) stops them all; a worker whose
//! supervisor dies is killed by the kernel (`PR_SET_PDEATHSIG`).
//!
//! A process started with those variables set (by the supervisor, by torchrun, or by
//! hand on several hosts) is a worker: it meets the others at rank 0 (see
//! [`erase_runtime::collective::rendezvous`]) and trains its shard with the CPU collective backend
//! over TCP or, on a GPU, with NCCL.

use std::ffi::OsString;
use std::io::{BufRead, BufReader, Write as _};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};

use crate::distributed::{run_rank, AllReduce, FailAt, RankResult};
use crate::train::TrainConfig;
use erase_runtime::collective::rendezvous::{free_port, rendezvous, RankEnv};
use erase_runtime::collective::tcp::TcpCollective;
use erase_runtime::collective::{Collective, CollectiveRecord};

/// Where a worker trains.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WorkerDevice {
    /// CUDA device `LOCAL_RANK` when this build and host have one, else the CPU.
    Auto,
    /// The CPU, with the TCP collective backend.
    Cpu,
    /// CUDA device `LOCAL_RANK`, with NCCL.
    Cuda,
}

/// A worker's settings beyond the training configuration.
#[derive(Clone, Debug)]
pub struct WorkerOptions {
    pub device: WorkerDevice,
    pub allreduce: AllReduce,
    /// How long a collective (and the rendezvous) may wait for the other ranks.
    pub timeout: Duration,
    /// Write each rank's collective log to `DIR/rank-K.log`.
    pub collective_log: Option<PathBuf>,
    /// The kernel paths a CUDA rank's plans take (`--kernel-paths`).
    pub plan: erase_ops::cuda::PlanOptions,
    /// Rank 0 writes its progress (steps and evaluations) here as JSON lines.
    pub metrics: Option<PathBuf>,
}

/// FNV-1a, 64 bits: a cheap fingerprint to compare replicas and logs across ranks.
pub fn fnv64(bytes: &[u8]) -> u64 {
    fnv64_parts([bytes])
}

/// [`fnv64`] of the concatenation of `parts`, without concatenating them.
pub fn fnv64_parts<'a>(parts: impl IntoIterator<Item = &'a [u8]>) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in parts.into_iter().flatten() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The fingerprint of a collective log (kind, bucket, size, order).
pub fn log_hash(log: &[CollectiveRecord]) -> u64 {
    let text: String = log.iter().map(|r| format!("{r}\n")).collect();
    fnv64(text.as_bytes())
}

/// What every rank must agree on: ranks whose tags differ are refused at the rendezvous.
fn job_tag(cfg: &TrainConfig, backend: &str, opts: &WorkerOptions, world: usize) -> String {
    format!(
        "backend {backend}; world {world}; allreduce {}; dispatch {}; steps {}; {}",
        opts.allreduce.as_str(),
        cfg.dispatch.as_str(),
        cfg.steps,
        cfg.identity_text()
    )
}

/// Runs this process as rank `env.rank` of a data-parallel job. `cfg.model.batch` is
/// the global batch.
pub fn run_worker(cfg: &TrainConfig, env: &RankEnv, opts: &WorkerOptions) -> Result<()> {
    let world = env.world;
    if cfg.schedule.early_updates {
        bail!("--optimizer-update early updates a block before its gradients are all-reduced; with several ranks use end");
    }
    if !cfg.model.batch.is_multiple_of(world) {
        bail!(
            "--batch {} (the global batch) must split evenly over the {world} ranks (--gpus, WORLD_SIZE)",
            cfg.model.batch
        );
    }

    // NVLink multicast is forbidden on our GPU machines and reduces in no fixed order;
    // set before any thread starts, so that NCCL (loaded later) reads it
    std::env::set_var("NCCL_NVLS_ENABLE", "0");
    if cfg.dispatch == crate::train::Dispatch::Graph {
        // connect every channel at init: none may be set up inside the graph capture
        std::env::set_var("NCCL_RUNTIME_CONNECT", "0");
    }
    let fail = FailAt::from_env()?;
    // rank 0 reports progress (and writes --metrics); the others train quietly
    let mut console = None;
    if env.rank == 0 {
        let jsonl =
            match &opts.metrics {
                Some(p) => Some(std::fs::File::create(p).with_context(|| {
                    format!("--metrics {}: cannot create the file", p.display())
                })?),
                None => None,
            };
        console = Some(crate::train::ConsoleProgress::new(jsonl));
    }
    let mut quiet = crate::train::Quiet;
    let progress: &mut dyn crate::train::Progress = match console.as_mut() {
        Some(c) => c,
        None => &mut quiet,
    };
    let use_cuda = match opts.device {
        WorkerDevice::Cpu => false,
        WorkerDevice::Cuda => true,
        WorkerDevice::Auto => crate::gpu::open_device_ordinal(env.local_rank).is_ok(),
    };
    if use_cuda {
        return crate::distributed_cuda::run_worker_cuda(cfg, env, opts, fail, progress);
    }
    if cfg.dispatch != crate::train::Dispatch::Blocking {
        bail!(
            "--dispatch {} needs a CUDA device; CPU ranks run blocking",
            cfg.dispatch.as_str()
        );
    }
    let mut local = cfg.model.clone();
    local.batch = cfg.model.batch / world;
    let tag = job_tag(cfg, "cpu", opts, world);
    let rdv = rendezvous(env, &[], &tag, opts.timeout)?;
    let mut comm = TcpCollective::new(rdv, opts.timeout);
    let r = match run_rank(
        cfg,
        &local,
        world,
        &mut comm,
        fail,
        opts.allreduce,
        progress,
    ) {
        Ok(r) => r,
        Err(e) => {
            comm.abort();
            return Err(e.context(format!("rank {}", env.rank)));
        }
    };
    report(&mut comm, &r, cfg, opts, "CPU", || {
        r.evaluation(|| crate::distributed::evaluate_replica(cfg, &r, None))
    })
}

/// Compares every rank's replica and collective log through `comm` (an all-gather of
/// their fingerprints), prints this rank's line and, on rank 0, the job's summary with
/// the held-out evaluation `eval` gives (run after the check, when no rank waits on rank
/// 0 any more). Fails naming the first rank that differs from rank 0.
pub fn report<C: Collective>(
    comm: &mut C,
    r: &RankResult,
    cfg: &TrainConfig,
    opts: &WorkerOptions,
    device: &str,
    eval: impl FnOnce() -> Result<(crate::train::Eval, &'static str)>,
) -> Result<()> {
    let (rank, world) = (comm.rank(), comm.world());
    if let Some(dir) = &opts.collective_log {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("--collective-log {}", dir.display()))?;
        let path = dir.join(format!("rank-{rank}.log"));
        let text: String = r.log.iter().map(|x| format!("{x}\n")).collect();
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
    }
    // what every rank holds: the whole state, less any sharded table (rank 0's alone)
    let (hs, hl) = (r.replicated_fingerprint(), log_hash(&r.log));
    let mine: Vec<u8> = [hs.to_le_bytes(), hl.to_le_bytes()].concat();
    let all = comm.all_gather("replica check", &mine)?;
    let warm = cfg.warmup.min(r.step_secs.len().saturating_sub(1));
    let qps: Vec<f64> = r.step_secs[warm..]
        .iter()
        .map(|s| cfg.model.batch as f64 / s.max(1e-12))
        .collect();
    let q = crate::metrics::qps_summary(&qps);
    // a rank's own state; with sharded tables, rank 0's holds them whole and the others'
    // none, so the replicas are compared on the rest
    let held = if r.sharded.is_empty() {
        String::new()
    } else if rank == crate::sharded::WHOLE_RANK {
        format!(" (with the whole sharded tables; replicated tensors fnv64 {hs:016x})")
    } else {
        format!(" (without the sharded tables; replicated tensors fnv64 {hs:016x})")
    };
    println!(
        "rank {rank}: {} steps, last loss of its shard {:.6}, {} collectives, state fnv64 {:016x}, log fnv64 {hl:016x}{held}",
        r.losses.len(),
        r.losses.last().copied().unwrap_or(f64::NAN),
        r.log.len(),
        fnv64(&r.state)
    );
    let word = |b: &[u8], k: usize| -> u64 {
        let mut w = [0u8; 8];
        w.copy_from_slice(&b[8 * k..8 * k + 8]);
        u64::from_le_bytes(w)
    };
    for (k, b) in all.iter().enumerate() {
        if b.len() != 16 {
            bail!("rank {k} sent a malformed replica check");
        }
        if word(b, 0) != hs {
            bail!("rank {rank}: the replicas differ after training: rank {k}'s parameters are not rank {rank}'s");
        }
        if word(b, 1) != hl {
            bail!("rank {rank}: rank {k} issued other collectives than rank {rank} (collective logs differ)");
        }
    }
    if rank == 0 {
        println!(
            "data parallel on {world} {device} ranks ({} all-reduce): {} steps of a global batch of {}",
            opts.allreduce.as_str(),
            r.losses.len(),
            cfg.model.batch
        );
        let what = if r.sharded.is_empty() {
            "state"
        } else {
            "replicated tensors; the sharded tables whole on rank 0"
        };
        println!(
            "  replicas bit-identical on all {world} ranks ({what}: fnv64 {hs:016x}); collective logs identical ({} calls, fnv64 {hl:016x})",
            r.log.len()
        );
        if let Some(q) = q {
            println!(
                "  global examples/s p50 {:.0}  p90 {:.0}  mean {:.0} ({} steps after warm-up, rank 0's step times)",
                q.p50, q.p90, q.mean, q.steps
            );
        }
        let _ = std::io::stdout().flush();
        let (e, what) = eval().context("rank 0: evaluating its replica")?;
        println!(
            "  held-out NE {:.4}  AUC {:.4} ({} examples, {what})",
            e.ne, e.auc, e.examples
        );
    }
    let _ = std::io::stdout().flush();
    Ok(())
}

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// One worker as the supervisor sees it.
struct Worker {
    rank: usize,
    child: Child,
    status: Option<ExitStatus>,
}

/// Why a worker stopped, in words.
fn describe(status: &ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exited with status {c}"),
        (None, Some(9)) => "was killed (SIGKILL)".into(),
        (None, Some(6)) => "crashed (SIGABRT)".into(),
        (None, Some(11)) => "crashed (SIGSEGV)".into(),
        (None, Some(s)) => format!("was killed by signal {s}"),
        (None, None) => "stopped".into(),
    }
}

/// A failure that only reports another rank's failure (the connection to it closed,
/// the group was aborted): the supervisor names the rank that failed first instead.
fn is_secondary(msg: &str) -> bool {
    [
        "group aborted",
        "closed its connection",
        "lost the connection",
    ]
    .iter()
    .any(|p| msg.contains(p))
}

/// Starts `world` workers running this program with `args` (the command line after the
/// program name) on this host and supervises them (see the module documentation).
pub fn supervise(world: usize, args: &[OsString]) -> Result<()> {
    if world == 0 {
        bail!("--gpus must be at least 1");
    }
    let exe = std::env::current_exe().context("finding this program to start the workers")?;
    let addr = std::env::var("MASTER_ADDR").unwrap_or_else(|_| "127.0.0.1".into());
    let port = match std::env::var("MASTER_PORT") {
        Ok(p) => p
            .parse()
            .map_err(|_| anyhow!("MASTER_PORT={p} is not a port number"))?,
        Err(_) => free_port(&addr).map_err(|e| anyhow!(e))?,
    };
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }
    eprintln!("erase-ctr: starting {world} ranks (MASTER_ADDR={addr} MASTER_PORT={port})");
    let errors: Arc<Mutex<Vec<Option<String>>>> = Arc::new(Mutex::new(vec![None; world]));
    let mut workers: Vec<Worker> = Vec::with_capacity(world);
    let mut pipes = Vec::new();
    for rank in 0..world {
        let env = RankEnv {
            rank,
            world,
            local_rank: rank,
            master_addr: addr.clone(),
            master_port: port,
        };
        let mut cmd = Command::new(&exe);
        cmd.args(args)
            .envs(env.vars())
            .env("LOCAL_WORLD_SIZE", world.to_string())
            .env("NCCL_NVLS_ENABLE", "0")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        {
            use std::os::unix::process::CommandExt;
            // SAFETY: runs in the forked child before exec and only calls prctl, which is
            // async-signal-safe: the child is killed when the supervisor dies.
            unsafe {
                cmd.pre_exec(|| {
                    libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                    Ok(())
                });
            }
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                stop(&mut workers);
                bail!("starting rank {rank}: {e}");
            }
        };
        if let Some(out) = child.stdout.take() {
            pipes.push(forward(rank, out, false, Arc::clone(&errors)));
        }
        if let Some(err) = child.stderr.take() {
            pipes.push(forward(rank, err, true, Arc::clone(&errors)));
        }
        workers.push(Worker {
            rank,
            child,
            status: None,
        });
    }
    let t0 = Instant::now();
    let failed: Vec<(usize, ExitStatus)> = loop {
        if INTERRUPTED.load(Ordering::SeqCst) {
            stop(&mut workers);
            for p in pipes {
                let _ = p.join();
            }
            bail!("interrupted: stopped all {world} ranks");
        }
        let mut failed = Vec::new();
        for w in workers.iter_mut().filter(|w| w.status.is_none()) {
            match w.child.try_wait() {
                Ok(Some(s)) => {
                    w.status = Some(s);
                    if !s.success() {
                        failed.push((w.rank, s));
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    stop(&mut workers);
                    bail!("watching the ranks: {e}");
                }
            }
        }
        if !failed.is_empty() || workers.iter().all(|w| w.status.is_some()) {
            break failed;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let stopped = workers.iter().filter(|w| w.status.is_none()).count();
    stop(&mut workers);
    for p in pipes {
        let _ = p.join();
    }
    if failed.is_empty() {
        eprintln!(
            "erase-ctr: all {world} ranks finished in {:.1} s",
            t0.elapsed().as_secs_f64()
        );
        return Ok(());
    }
    let errors = errors.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let msg_of = |rank: usize| errors[rank].clone().unwrap_or_default();
    // the rank that failed on its own, rather than one that saw another rank go
    let &(rank, status) = failed
        .iter()
        .find(|(r, _)| !is_secondary(&msg_of(*r)))
        .unwrap_or(&failed[0]);
    let msg = msg_of(rank);
    bail!(
        "rank {rank} {}{}; stopped the other {} rank(s)",
        describe(&status),
        if msg.is_empty() {
            String::new()
        } else {
            format!(": {msg}")
        },
        stopped
    )
}

/// Kills every worker still running and reaps them all.
fn stop(workers: &mut [Worker]) {
    for w in workers.iter_mut().filter(|w| w.status.is_none()) {
        let _ = w.child.kill();
    }
    for w in workers.iter_mut().filter(|w| w.status.is_none()) {
        w.status = w.child.wait().ok();
    }
}

/// Copies a worker's output to ours, line by line with a `[rank k]` prefix, and keeps
/// its last error message.
fn forward(
    rank: usize,
    pipe: impl std::io::Read + Send + 'static,
    is_err: bool,
    errors: Arc<Mutex<Vec<Option<String>>>>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        for line in BufReader::new(pipe).lines() {
            let Ok(line) = line else { break };
            if is_err {
                eprintln!("[rank {rank}] {line}");
                let msg = line.strip_prefix("erase-ctr: error: ");
                if let Some(m) = msg {
                    let mut e = errors.lock().unwrap_or_else(|e| e.into_inner());
                    e[rank] = Some(m.to_string());
                }
            } else {
                println!("[rank {rank}] {line}");
            }
        }
    })
}
