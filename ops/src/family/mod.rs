//! The op families, one file each: for its ops, the CPU reference, the CUDA launch plan
//! and the cost estimate side by side. The top-level dispatch (`cpu::execute`,
//! `cuda::cuda_plan`, `launch::launch_spec`) is one exhaustive `match` each that names
//! every op and calls its family here.

pub mod attention;
pub mod elementwise;
pub mod embedding;
pub mod gemm;
pub mod interaction;
pub mod loss;
pub mod norm;
pub mod optim;
pub mod reduce;
pub mod shape;
