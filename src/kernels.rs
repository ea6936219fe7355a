//! The CUDA kernels this build embeds (see `build.rs`): PTX for sm_90a and sm_80, and
//! each kernel's registers, shared memory and spills as ptxas reported them.

use erase_runtime::kernels::{KernelInfo, KernelLibrary, PtxModule};

mod generated {
    use super::{KernelInfo, PtxModule};
    include!(concat!(env!("OUT_DIR"), "/kernels.rs"));
}

/// The embedded kernel library (empty when nvcc was not found at build time).
pub fn library() -> KernelLibrary {
    KernelLibrary {
        modules: generated::MODULES,
        kernels: generated::KERNELS,
    }
}

/// The nvcc this build used ("" when none).
pub fn nvcc() -> &'static str {
    generated::NVCC
}
