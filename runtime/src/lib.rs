//! `erase-runtime`: devices and the execution of training steps.

pub mod collective;
pub mod cpu;
pub mod cuda;
pub mod cuda_collective;
pub mod cuda_feed;
pub mod cuda_graph;
pub mod cuda_program;
pub mod cuda_trace;
pub mod error;
pub mod hb;
pub mod init;
pub mod memory;
pub mod nccl;
pub mod nvtx;
pub mod occupancy;
pub mod program;
pub mod rendezvous;
pub mod schedule;
pub mod simulate;
pub mod tcp_collective;
pub mod trace;

pub use cpu::{CpuConfig, CpuSession};
pub use error::RuntimeError;
