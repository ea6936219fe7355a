//! `erase-ops`: the semantics of every op, once. The CPU implementation in [`cpu`] is
//! the reference that every CUDA kernel is tested against.

pub mod buffer;
pub mod cpu;
pub mod cuda;
mod dispatch;
pub mod family;
pub mod launch;

pub use buffer::Buffer;
pub use cpu::{execute, NodeCall, OpError};
pub use launch::{launch_spec, launch_spec_typed, LaunchSpec};
