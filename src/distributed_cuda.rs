//! Data parallelism on CUDA devices with NCCL (one process per GPU).

use anyhow::{bail, Result};

use crate::distributed::FailAt;
use crate::launch::WorkerOptions;
use crate::train::TrainConfig;
use erase_runtime::rendezvous::RankEnv;

/// Runs this process as rank `env.rank` on CUDA device `env.local_rank`.
pub fn run_worker_cuda(
    _cfg: &TrainConfig,
    _env: &RankEnv,
    _opts: &WorkerOptions,
    _fail: Option<FailAt>,
) -> Result<()> {
    bail!("not yet")
}
