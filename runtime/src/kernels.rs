//! What the build knows of the kernels it embeds, with no device needed: each kernel
//! family's PTX (`kernels-cuda/NAME.cu`, or `NAME/NAME.cu` for a folder) for both
//! targets, and each kernel's registers, shared memory and parameter list as ptxas and
//! the PTX declare them. The schedule's cost model and the ABI check read it; the CUDA
//! device loads it.

/// The PTX of one kernel family (`kernels-cuda/NAME.cu` or `NAME/NAME.cu`) for both
/// targets.
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
/// (or `.s64`/`.b64`), `I32`/`U32` a 32-bit integer, `F32` an `.f32`, a `TensorMap` a
/// byte array (the 128-byte descriptor).
pub fn arg_fits(arg: &erase_ops::cuda::KArg, param: &str) -> bool {
    use erase_ops::cuda::KArg::*;
    match arg {
        In(_) | InAt(..) | Out(_) | OutAt(..) | Upd(_) | Scratch(_) | ScratchAt(..) | I64(_) => {
            matches!(param, "u64" | "s64" | "b64")
        }
        I32(_) | U32(_) => matches!(param, "u32" | "s32" | "b32"),
        F32(_) => param == "f32",
        // `.param .align 64 .b8 name[128]`
        TensorMap(_) => param == "b8[]",
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

/// Checks that every kernel of a PTX text waits for the grids before it on its stream
/// before it touches memory, and then lets the next one launch: `griddepcontrol.wait`
/// ahead of its first global, generic or asynchronous load, store, atomic or prefetch, and
/// `griddepcontrol.launch_dependents` after the wait. What programmatic dependent launch
/// (`CudaDevice::set_pdl`) relies on; a kernel without it would race its predecessor.
/// Returns how many kernels it checked, or the first that fails, named.
pub fn check_pdl_waits(ptx: &str) -> Result<usize, String> {
    // a memory access: ld/st/atom/red/prefetch/cp.async* not of the param, shared, local
    // or const state spaces
    fn first_access(body: &str) -> Option<usize> {
        let mut at = 0;
        for line in body.lines() {
            let t = line.trim_start();
            let op = t.strip_prefix('@').map_or(t, |p| {
                // a predicated instruction: "@%p1 ld.global..." or "@!%p1 ..."
                p.split_once(char::is_whitespace)
                    .map_or("", |(_, r)| r.trim_start())
            });
            let accesses = ["ld.", "st.", "atom.", "red.", "prefetch.", "cp."]
                .iter()
                .any(|m| {
                    op.strip_prefix(m).is_some_and(|rest| {
                        !["param", "shared", "local", "const"]
                            .iter()
                            .any(|s| rest.starts_with(s))
                    })
                });
            if accesses {
                return Some(at);
            }
            at += line.len() + 1;
        }
        None
    }
    let mut checked = 0;
    for part in ptx.split(".entry ").skip(1) {
        let name = part
            .split(|c: char| c == '(' || c.is_whitespace())
            .next()
            .unwrap_or("?");
        // the body only: from the first brace after the parameter list
        let body = part.find('{').map_or("", |b| &part[b..]);
        let wait = body.find("griddepcontrol.wait").ok_or_else(|| {
            format!("kernel '{name}' never executes griddepcontrol.wait (ERASE_PDL_ENTER)")
        })?;
        if let Some(a) = first_access(body).filter(|&a| a < wait) {
            let line = body[a..].lines().next().unwrap_or("").trim();
            return Err(format!(
                "kernel '{name}' accesses memory before griddepcontrol.wait: `{line}`"
            ));
        }
        match body.find("griddepcontrol.launch_dependents") {
            Some(l) if l > wait => {}
            _ => {
                return Err(format!(
                    "kernel '{name}' has no griddepcontrol.launch_dependents after its wait"
                ))
            }
        }
        checked += 1;
    }
    Ok(checked)
}
