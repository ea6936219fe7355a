//! Models built on the graph DSL.

pub mod ctr;
