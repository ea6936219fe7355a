//! What the build knows of the kernels it embeds, with no device needed: each
//! `kernels-cuda/*.cu` file's PTX for both targets, and each kernel's registers, shared
//! memory and parameter list as ptxas and the PTX declare them. The schedule's cost
//! model and the ABI check read it; the CUDA device loads it.

/// The PTX of one `kernels-cuda/*.cu` file for both targets.
#[derive(Debug)]
pub struct PtxModule {
    pub file: &'static str,
    pub sm90a: &'static str,
    pub sm80: &'static str,
}

/// One kernel's resources as ptxas reports them for sm_90a.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelInfo {
    pub name: &'static str,
    pub file: &'static str,
    pub regs: u32,
    /// Static shared memory, bytes.
    pub smem: u32,
    /// Spilled bytes (stores).
    pub spill: u32,
    /// The kernel's parameters as its sm_90a PTX declares them, in order, comma
    /// separated (`u64,u64,u32,f32`): what a launch plan's arguments must match.
    pub params: &'static str,
}

/// Whether a launch argument fits a PTX parameter type: pointers and `I64` are `.u64`
/// (or `.s64`/`.b64`), `I32`/`U32` a 32-bit integer, `F32` an `.f32`.
pub fn arg_fits(arg: &erase_ops::cuda::KArg, param: &str) -> bool {
    use erase_ops::cuda::KArg::*;
    match arg {
        In(_) | InAt(..) | Out(_) | OutAt(..) | Upd(_) | Scratch(_) | ScratchAt(..) | I64(_) => {
            matches!(param, "u64" | "s64" | "b64")
        }
        I32(_) | U32(_) => matches!(param, "u32" | "s32" | "b32"),
        F32(_) => param == "f32",
    }
}

/// Checks one launch's arguments against its kernel's declared parameters: the count,
/// and the width and kind of each. The message names the kernel and the argument.
pub fn check_call(call: &erase_ops::cuda::KernelCall, params: &str) -> Result<(), String> {
    let want: Vec<&str> = if params.is_empty() {
        Vec::new()
    } else {
        params.split(',').collect()
    };
    if want.len() != call.args.len() {
        return Err(format!(
            "kernel '{}' takes {} parameters ({params}), the plan passes {}",
            call.kernel,
            want.len(),
            call.args.len()
        ));
    }
    for (i, (a, p)) in call.args.iter().zip(&want).enumerate() {
        if !arg_fits(a, p) {
            return Err(format!(
                "kernel '{}' parameter {i} is .{p}, the plan passes {a:?}",
                call.kernel
            ));
        }
    }
    Ok(())
}

/// The kernels a build embeds (empty when it was built without nvcc).
#[derive(Debug, Clone, Copy)]
pub struct KernelLibrary {
    pub modules: &'static [PtxModule],
    pub kernels: &'static [KernelInfo],
}

impl KernelLibrary {
    pub fn find(&self, name: &str) -> Option<&KernelInfo> {
        self.kernels.iter().find(|k| k.name == name)
    }
}
