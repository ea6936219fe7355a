//! Models built on the graph DSL: the spec's CTR model (`ctr`), the model API any CTR
//! model implements to be trained by `erase-ctr` (`api`), the field's standard models on it
//! (`zoo`), the paper's other experiments (`mlp30`, `nanochat`), and the planner and
//! phase-by-phase runner those two share (`stepper`).

pub mod api;
pub mod ctr;
pub mod mlp30;
pub mod nanochat;
pub mod stepper;
pub mod zoo;
