//! How the processes of a data-parallel job find each other: the torchrun convention
//! (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`) and a small TCP
//! rendezvous at rank 0.
//!
//! Rank 0 listens on `MASTER_ADDR:MASTER_PORT`; every other rank connects (retrying
//! until the timeout, since rank 0 may start later) and sends its rank, the world size,
//! a tag (the backend and the training configuration: ranks that disagree are refused
//! with a message naming both) and a blob (the NCCL unique id for rank 0's, nothing for
//! the others). Rank 0 answers each with every rank's blob, in rank order. The
//! connections stay open: they are the links of the TCP collective backend
//! ([`crate::collective::tcp`]) and, beside NCCL, the control channel.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// One process's place in the job, from the environment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankEnv {
    pub rank: usize,
    pub world: usize,
    /// The rank among the processes of its host: which GPU it takes.
    pub local_rank: usize,
    pub master_addr: String,
    pub master_port: u16,
}

/// A failed rendezvous, naming the rank that reports it and what is missing.
#[derive(Debug, Clone, thiserror::Error)]
#[error("rank {rank}: rendezvous: {msg}")]
pub struct RendezvousError {
    pub rank: usize,
    pub msg: String,
}

impl RankEnv {
    /// Reads the torchrun variables. `None` when `RANK` and `WORLD_SIZE` are both unset
    /// (not a rank of a job); an error names a variable that is missing or malformed.
    /// `LOCAL_RANK` defaults to `RANK`, `MASTER_ADDR` to 127.0.0.1, `MASTER_PORT` to 29500.
    pub fn from_env() -> Result<Option<RankEnv>, String> {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let (rank, world) = match (var("RANK"), var("WORLD_SIZE")) {
            (None, None) => return Ok(None),
            (Some(r), Some(w)) => (r, w),
            (Some(_), None) => return Err("RANK is set but WORLD_SIZE is not".into()),
            (None, Some(_)) => return Err("WORLD_SIZE is set but RANK is not".into()),
        };
        let num = |k: &str, v: &str| -> Result<usize, String> {
            v.parse()
                .map_err(|_| format!("{k}={v} is not a non-negative integer"))
        };
        let rank = num("RANK", &rank)?;
        let world = num("WORLD_SIZE", &world)?;
        if world == 0 || rank >= world {
            return Err(format!("RANK={rank} must be below WORLD_SIZE={world}"));
        }
        let local_rank = match var("LOCAL_RANK") {
            Some(v) => num("LOCAL_RANK", &v)?,
            None => rank,
        };
        let master_port = match var("MASTER_PORT") {
            Some(v) => v
                .parse()
                .map_err(|_| format!("MASTER_PORT={v} is not a port number"))?,
            None => 29500,
        };
        Ok(Some(RankEnv {
            rank,
            world,
            local_rank,
            master_addr: var("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into()),
            master_port,
        }))
    }

    /// The variables a spawned worker gets (see [`RankEnv::from_env`]).
    pub fn vars(&self) -> Vec<(&'static str, String)> {
        vec![
            ("RANK", self.rank.to_string()),
            ("WORLD_SIZE", self.world.to_string()),
            ("LOCAL_RANK", self.local_rank.to_string()),
            ("MASTER_ADDR", self.master_addr.clone()),
            ("MASTER_PORT", self.master_port.to_string()),
        ]
    }
}

/// The links a rendezvous leaves open.
pub enum Links {
    /// Rank 0: one connection per other rank (index = rank; index 0 is `None`).
    Root(Vec<Option<TcpStream>>),
    /// Any other rank: its connection to rank 0.
    Leaf(TcpStream),
    /// A job of one rank: nothing to connect.
    Alone,
}

/// What a rendezvous gives each rank.
pub struct Rendezvous {
    pub rank: usize,
    pub world: usize,
    /// Every rank's blob, in rank order.
    pub blobs: Vec<Vec<u8>>,
    pub links: Links,
}

const MAGIC: &[u8; 8] = b"ERASERDV";

/// Meets the other ranks of `env`'s job; every rank passes its `blob` and a `tag` that
/// must be the same on every rank. Fails with a message naming the ranks that never
/// connected within `timeout`, or the rank whose tag differs.
pub fn rendezvous(
    env: &RankEnv,
    blob: &[u8],
    tag: &str,
    timeout: Duration,
) -> Result<Rendezvous, RendezvousError> {
    let rank = env.rank;
    let err = |msg: String| RendezvousError { rank, msg };
    if env.world == 1 {
        return Ok(Rendezvous {
            rank,
            world: 1,
            blobs: vec![blob.to_vec()],
            links: Links::Alone,
        });
    }
    let addr = resolve(&env.master_addr, env.master_port).map_err(err)?;
    let deadline = Instant::now() + timeout;
    if rank == 0 {
        root(env, addr, blob, tag, timeout, deadline).map_err(err)
    } else {
        leaf(env, addr, blob, tag, timeout, deadline).map_err(err)
    }
}

fn resolve(host: &str, port: u16) -> Result<SocketAddr, String> {
    (host, port)
        .to_socket_addrs()
        .map_err(|e| format!("MASTER_ADDR={host}: {e}"))?
        .next()
        .ok_or_else(|| format!("MASTER_ADDR={host} resolves to no address"))
}

fn root(
    env: &RankEnv,
    addr: SocketAddr,
    blob: &[u8],
    tag: &str,
    timeout: Duration,
    deadline: Instant,
) -> Result<Rendezvous, String> {
    let listener =
        TcpListener::bind(addr).map_err(|e| format!("rank 0 cannot listen on {addr}: {e}"))?;
    listener
        .set_nonblocking(true)
        .map_err(|e| format!("listening on {addr}: {e}"))?;
    let world = env.world;
    let mut links: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
    let mut blobs: Vec<Vec<u8>> = vec![Vec::new(); world];
    blobs[0] = blob.to_vec();
    let mut joined = 1;
    while joined < world {
        let (mut s, peer) = match listener.accept() {
            Ok(x) => x,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let missing: Vec<usize> = (1..world).filter(|&r| links[r].is_none()).collect();
                    return Err(format!(
                        "rank 0 waited {timeout:?} on {addr}; rank(s) {missing:?} never connected"
                    ));
                }
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
            Err(e) => return Err(format!("accepting on {addr}: {e}")),
        };
        let hello = (|| -> io::Result<(usize, usize, String, Vec<u8>)> {
            s.set_nonblocking(false)?;
            s.set_nodelay(true)?;
            s.set_read_timeout(Some(timeout))?;
            let mut magic = [0u8; 8];
            s.read_exact(&mut magic)?;
            if &magic != MAGIC {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "not an erase rank",
                ));
            }
            let r = read_u64(&mut s)? as usize;
            let w = read_u64(&mut s)? as usize;
            let tag = String::from_utf8_lossy(&read_bytes(&mut s, 1 << 16)?).into_owned();
            let b = read_bytes(&mut s, 1 << 20)?;
            Ok((r, w, tag, b))
        })();
        let (r, w, their_tag, b) = match hello {
            Ok(x) => x,
            // a stray connection (a port scan, a health check): ignore it
            Err(e) => {
                eprintln!("rendezvous: ignoring a connection from {peer}: {e}");
                continue;
            }
        };
        let refuse = |s: &mut TcpStream, msg: String| -> String {
            let _ = write_reply(s, Err(&msg));
            msg
        };
        if w != world {
            return Err(refuse(
                &mut s,
                format!("rank {r} says WORLD_SIZE={w}, rank 0 has {world}"),
            ));
        }
        if r == 0 || r >= world || links[r].is_some() {
            return Err(refuse(
                &mut s,
                format!("a second process claims rank {r} (from {peer})"),
            ));
        }
        if their_tag != tag {
            return Err(refuse(
                &mut s,
                format!(
                    "rank {r} runs a different job than rank 0:\n  rank 0: {tag}\n  rank {r}: {their_tag}"
                ),
            ));
        }
        blobs[r] = b;
        links[r] = Some(s);
        joined += 1;
    }
    for (r, l) in links.iter_mut().enumerate() {
        if let Some(s) = l {
            write_reply(s, Ok(&blobs)).map_err(|e| format!("answering rank {r}: {e}"))?;
        }
    }
    Ok(Rendezvous {
        rank: 0,
        world,
        blobs,
        links: Links::Root(links),
    })
}

fn leaf(
    env: &RankEnv,
    addr: SocketAddr,
    blob: &[u8],
    tag: &str,
    timeout: Duration,
    deadline: Instant,
) -> Result<Rendezvous, String> {
    let mut s = loop {
        match TcpStream::connect_timeout(&addr, Duration::from_millis(500)) {
            Ok(s) => break s,
            Err(e) => {
                if Instant::now() >= deadline {
                    return Err(format!(
                        "could not reach rank 0 at {addr} within {timeout:?}: {e}"
                    ));
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    };
    let io = |e: io::Error| format!("talking to rank 0 at {addr}: {e}");
    s.set_nodelay(true).map_err(io)?;
    s.write_all(MAGIC).map_err(io)?;
    write_u64(&mut s, env.rank as u64).map_err(io)?;
    write_u64(&mut s, env.world as u64).map_err(io)?;
    write_bytes(&mut s, tag.as_bytes()).map_err(io)?;
    write_bytes(&mut s, blob).map_err(io)?;
    // rank 0 answers once every rank has joined
    let left = deadline.saturating_duration_since(Instant::now()) + Duration::from_secs(2);
    s.set_read_timeout(Some(left)).map_err(io)?;
    let status = read_u64(&mut s).map_err(|e| {
        format!(
            "rank 0 at {addr} did not answer within {timeout:?} (another rank may be missing): {e}"
        )
    })?;
    if status != 0 {
        let msg = read_bytes(&mut s, 1 << 16).map_err(io)?;
        return Err(format!("rank 0 refused: {}", String::from_utf8_lossy(&msg)));
    }
    let n = read_u64(&mut s).map_err(io)? as usize;
    if n != env.world {
        return Err(format!("rank 0 sent {n} blobs for {} ranks", env.world));
    }
    let blobs = (0..n)
        .map(|_| read_bytes(&mut s, 1 << 20))
        .collect::<io::Result<Vec<_>>>()
        .map_err(io)?;
    s.set_read_timeout(None).map_err(io)?;
    Ok(Rendezvous {
        rank: env.rank,
        world: env.world,
        blobs,
        links: Links::Leaf(s),
    })
}

fn write_reply(s: &mut TcpStream, r: Result<&[Vec<u8>], &str>) -> io::Result<()> {
    match r {
        Ok(blobs) => {
            write_u64(s, 0)?;
            write_u64(s, blobs.len() as u64)?;
            for b in blobs {
                write_bytes(s, b)?;
            }
        }
        Err(msg) => {
            write_u64(s, 1)?;
            write_bytes(s, msg.as_bytes())?;
        }
    }
    s.flush()
}

pub(crate) fn write_u64(s: &mut impl Write, v: u64) -> io::Result<()> {
    s.write_all(&v.to_le_bytes())
}

pub(crate) fn read_u64(s: &mut impl Read) -> io::Result<u64> {
    let mut b = [0u8; 8];
    s.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

fn write_bytes(s: &mut impl Write, b: &[u8]) -> io::Result<()> {
    write_u64(s, b.len() as u64)?;
    s.write_all(b)
}

fn read_bytes(s: &mut impl Read, max: usize) -> io::Result<Vec<u8>> {
    let n = read_u64(s)? as usize;
    if n > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("a message of {n} bytes (at most {max} expected)"),
        ));
    }
    let mut v = vec![0u8; n];
    s.read_exact(&mut v)?;
    Ok(v)
}

/// A port on `host` that is free now (the OS picks it). Another process may take it
/// before the job binds it; the rendezvous then fails with a clear error.
pub fn free_port(host: &str) -> Result<u16, String> {
    let l = TcpListener::bind((host, 0)).map_err(|e| format!("finding a free port: {e}"))?;
    l.local_addr()
        .map(|a| a.port())
        .map_err(|e| format!("finding a free port: {e}"))
}
