//! `erase-runtime`: devices and the execution of training steps.

pub mod cpu;
pub mod error;
pub mod init;

pub use cpu::{CpuConfig, CpuSession};
pub use error::RuntimeError;
