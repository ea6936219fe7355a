//! Erase: a training runtime that starts each detached block's backward early, on its own
//! stream, where it overlaps later forward work (ERASE, arXiv 2608.18469).
//!
//! This crate is the facade users import: the graph DSL ([`graph`]), the ops ([`ops`]),
//! the runtime ([`runtime`]), and the data and models of the CTR trainer.

pub use erase_graph as graph;
pub use erase_ops as ops;
pub use erase_runtime as runtime;

pub mod bench;
pub mod checkpoint;
pub mod cli;
pub mod data;
pub mod distributed;
pub mod distributed_cuda;
pub mod gpu;
pub mod interrupt;
pub mod kernels;
pub mod launch;
pub mod metrics;
pub mod model;
pub mod profile;
mod sharded;
pub mod sharding;
pub mod train;
