//! `erase-runtime`: devices and the execution of training steps.
//!
//! - [`program`]: the step program and its analyses: the schedule (streams, events, the
//!   ERASE order), the memory plan, the happens-before checker, the occupancy model and
//!   the simulator.
//! - [`cpu`]: the CPU executor (the session of the reference ops, and the runner of a step
//!   program at its planned arena offsets, which is also the schedule fuzzer).
//! - [`cuda`]: the CUDA executor: the device, the step program on it, the input feed,
//!   graph capture, the measured trace, NCCL and NVTX.
//! - [`collective`]: collectives between ranks: in-process, TCP, and the rendezvous.
//! - [`trace`]: the trace format and its pictures (Chrome JSON, SVG timelines).
//! - [`kernels`]: what the build knows of the embedded kernels (names, parameters,
//!   registers, shared memory), with no device needed.
//!
//! Who uses whom: `program` uses `kernels`; `cpu` uses `program`; `trace` uses
//! `program`; `cuda` uses all of them; `collective` uses none. No module imports another
//! in a circle.

pub mod collective;
pub mod cpu;
pub mod cuda;
pub mod error;
pub mod init;
pub mod kernels;
pub mod program;
pub mod trace;

pub use cpu::{CpuConfig, CpuSession};
pub use error::RuntimeError;
