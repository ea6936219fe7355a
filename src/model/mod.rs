//! Models built on the graph DSL.

pub mod ctr;
pub mod mlp30;
pub mod nanochat;
