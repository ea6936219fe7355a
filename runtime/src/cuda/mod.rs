//! The CUDA device, through cudarc's driver bindings loaded at run time: nothing CUDA is
//! needed to build or start; a machine without a driver or a GPU gets a clear error.
//!
//! This layer is thin on purpose: raw streams (the main one at the highest priority),
//! events, device allocations and kernel launches from the ops' [`KernelCall`]s. cudarc's
//! safe layer tracks reads and writes per buffer and would make streams wait on each
//! other; here the only cross-stream order is the step program's own events.
//!
//! The executor's parts: [`program`] (a step program on the device), [`feed`] (the
//! input pipeline), [`graph`] (CUDA-graph capture), [`trace`] (measured steps),
//! [`collective`] and [`nccl`] (data parallelism), [`nvtx`] (names for Nsight Systems).

pub mod collective;
pub mod feed;
pub mod graph;
pub mod nccl;
pub mod nvtx;
pub mod program;
pub mod sharded;
pub mod trace;

use std::collections::BTreeMap;
use std::ffi::{c_void, CString};
use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext};
use erase_graph::{DType, Op, Shape};
use erase_ops::cuda::{cuda_plan, KArg, KernelCall, Operands, PlanOptions};
use erase_ops::Buffer;

use crate::cpu::buffer_from_bytes;
use crate::error::RuntimeError;
use crate::kernels::KernelLibrary;

/// How kernels follow the one before them on their stream (`ERASE_PDL`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PdlMode {
    /// A kernel is launched once its predecessor has finished (`ERASE_PDL=0`; always on
    /// the sm_80 PTX).
    Off,
    /// Programmatic dependent launch: a kernel is launched as soon as its predecessor's
    /// CTAs have all exited, before that grid's completion is processed; it waits for it
    /// in its first statement (the default on sm_90a; `ERASE_PDL=exit`).
    AtExit,
    /// As `AtExit`, and each kernel lets its successor launch as soon as it starts, so
    /// the successor's CTAs take SM slots (and wait) during this kernel's last wave
    /// (`ERASE_PDL=early`).
    Early,
}

/// Which PTX to load.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PtxTarget {
    Sm90a,
    Sm80,
}

fn driver_err(what: &str, e: result::DriverError) -> RuntimeError {
    RuntimeError::Device(format!("{what}: {e:?}"))
}

/// A device allocation, freed on drop.
pub struct DeviceBuffer {
    ptr: sys::CUdeviceptr,
    bytes: usize,
}

impl DeviceBuffer {
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.bytes > 0 {
            // SAFETY: `ptr` came from `malloc_sync` and is freed exactly once, here.
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}

/// A raw stream, destroyed on drop.
pub struct Stream {
    raw: sys::CUstream,
}

impl Stream {
    pub fn raw(&self) -> sys::CUstream {
        self.raw
    }

    pub fn synchronize(&self) -> Result<(), RuntimeError> {
        // SAFETY: `raw` is a live stream created by this module.
        unsafe { result::stream::synchronize(self.raw) }
            .map_err(|e| driver_err("stream synchronize", e))
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // SAFETY: created by `cuStreamCreateWithPriority`, destroyed once.
        let _ = unsafe { result::stream::destroy(self.raw) };
    }
}

/// A raw event (timing enabled only when asked), destroyed on drop.
pub struct Event {
    raw: sys::CUevent,
}

impl Event {
    pub fn raw(&self) -> sys::CUevent {
        self.raw
    }

    pub fn record(&self, s: &Stream) -> Result<(), RuntimeError> {
        // SAFETY: both handles are live and belong to the current context.
        unsafe { result::event::record(self.raw, s.raw) }.map_err(|e| driver_err("event record", e))
    }

    /// Records on `s`; `external` (during a capture) makes the record a node of the graph,
    /// so that replays record the event too (as trace marks need).
    pub fn record_flagged(&self, s: &Stream, external: bool) -> Result<(), RuntimeError> {
        if !external {
            return self.record(s);
        }
        // SAFETY: both handles are live; flag 1 is CU_EVENT_RECORD_EXTERNAL.
        unsafe { sys::cuEventRecordWithFlags(self.raw, s.raw(), 1) }
            .result()
            .map_err(|e| driver_err("recording an event into the graph", e))
    }

    /// Makes `s` wait for the work recorded before this event.
    pub fn wait_on(&self, s: &Stream) -> Result<(), RuntimeError> {
        // SAFETY: both handles are live and belong to the current context.
        unsafe {
            result::stream::wait_event(
                s.raw,
                self.raw,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .map_err(|e| driver_err("stream wait", e))
    }

    pub fn synchronize(&self) -> Result<(), RuntimeError> {
        // SAFETY: live event.
        unsafe { result::event::synchronize(self.raw) }
            .map_err(|e| driver_err("event synchronize", e))
    }

    /// Whether the work recorded before this event has completed (an event never
    /// recorded has), without waiting.
    pub fn query(&self) -> Result<bool, RuntimeError> {
        // SAFETY: live event.
        match unsafe { result::event::query(self.raw) } {
            Ok(()) => Ok(true),
            Err(result::DriverError(sys::CUresult::CUDA_ERROR_NOT_READY)) => Ok(false),
            Err(e) => Err(driver_err("event query", e)),
        }
    }

    /// Milliseconds from `start` to this event (both recorded with timing).
    pub fn elapsed_ms_since(&self, start: &Event) -> Result<f32, RuntimeError> {
        // SAFETY: both events are live and have completed (callers synchronize first).
        unsafe { result::event::elapsed(start.raw, self.raw) }
            .map_err(|e| driver_err("event elapsed", e))
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: created by `event::create`, destroyed once.
        let _ = unsafe { result::event::destroy(self.raw) };
    }
}

/// `o` for a device of `sms` SMs running `target`'s PTX: the warp-specialized and TMA GEMM
/// kernels are sm_90a code (their sm_80 forms trap), so the sm_80 PTX plans without them.
fn fit_plan(o: PlanOptions, sms: u32, target: PtxTarget) -> PlanOptions {
    let mut o = o.with_sms(sms as usize);
    if target == PtxTarget::Sm80 {
        o.gemm_ws = false;
        o.gemm_tma = false;
        o.gemm_tma_n64 = erase_ops::cuda::LaunchSet::NONE;
        // (the 128x64 tiles are the warp-specialized and the TMA kernels')
        o.gemm_tile = o.gemm_tile.filter(|t| t.n != 64);
    }
    o
}

impl PdlMode {
    /// When a kernel in this mode is launched, and the `ERASE_PDL` value that asks for it.
    pub fn describe(self) -> &'static str {
        match self {
            PdlMode::Off => "after their predecessor ends (ERASE_PDL=0)",
            PdlMode::AtExit => {
                "as their predecessor's CTAs exit (ERASE_PDL=exit, programmatic dependent launch)"
            }
            PdlMode::Early => {
                "as their predecessor starts (ERASE_PDL=early, programmatic dependent launch)"
            }
        }
    }
}

/// `ERASE_PDL`: `exit` (or unset: the fastest on an H200, BENCHMARKS.md) launches each
/// kernel once its predecessor's CTAs have exited, `early` once they have all started,
/// `0` after its predecessor has finished.
fn pdl_from_env() -> Result<PdlMode, RuntimeError> {
    match std::env::var("ERASE_PDL").ok().as_deref() {
        Some("0") => Ok(PdlMode::Off),
        None | Some("exit") => Ok(PdlMode::AtExit),
        Some("early") => Ok(PdlMode::Early),
        Some(other) => Err(RuntimeError::Device(format!(
            "ERASE_PDL={other}: expected 0 (a kernel starts after its predecessor ends), exit (once its CTAs have exited) or early (once they have started)"
        ))),
    }
}

/// Lets `f` take as much dynamic shared memory as the device allows a CTA (`optin` bytes,
/// less the kernel's static shared memory): past 48 KB the driver refuses a launch unless
/// the function says so first (the GEMM pipeline's stages live there).
fn allow_dynamic_smem(f: sys::CUfunction, optin: i32) -> Result<(), result::DriverError> {
    // SAFETY: `f` is a live function of a loaded module; both calls only read or set one
    // of its attributes, to a value the device supports.
    unsafe {
        let fixed = result::function::get_function_attribute(
            f,
            sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES,
        )?;
        result::function::set_function_attribute(
            f,
            sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            (optin - fixed).max(0),
        )
    }
}

/// The TMA descriptor of `t` at device address `ptr`: bf16, two dimensions (inner
/// contiguous), boxes of 64 x 64 elements (128-byte rows) in the 128-byte swizzle, zeros
/// past either extent, as the `gemm_bf16t*` kernels read it.
fn encode_tma(ptr: u64, t: &erase_ops::cuda::TmaMatrix) -> Result<[u8; 128], String> {
    if !ptr.is_multiple_of(16) || !t.ld.is_multiple_of(8) || t.ld < t.inner {
        return Err(format!(
            "a TMA operand needs a 16-byte aligned base (0x{ptr:x}) and rows of whole \
             16-byte chunks no shorter than the matrix (ld {} for {} elements)",
            t.ld, t.inner
        ));
    }
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
    let dims = [t.inner, t.outer];
    let strides = [t.ld * 2];
    let boxes = [64u32, 64];
    let steps = [1u32, 1];
    // SAFETY: every pointer names a live local array of the rank's length (strides one
    // shorter), `map` is writable storage of the descriptor's size, and the driver only
    // writes it; the device address is not dereferenced on the host.
    unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            2,
            ptr as *mut c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            steps.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
        .result()
    }
    .map_err(|e| format!("cuTensorMapEncodeTiled: {e:?}"))?;
    // SAFETY: the call succeeded, so the driver wrote the whole descriptor
    let map = unsafe { map.assume_init() };
    let mut out = [0u8; 128];
    for (o, w) in out.chunks_exact_mut(8).zip(map.opaque) {
        o.copy_from_slice(&w.to_ne_bytes());
    }
    Ok(out)
}

/// A kernel launch with its function and argument bytes resolved.
pub struct PreparedLaunch {
    f: sys::CUfunction,
    pub call: KernelCall,
    slots: Vec<ArgSlot>,
}

/// One kernel argument's bytes: 8 for a scalar or a pointer (the driver reads as many as
/// the parameter's size), 128 for a TMA descriptor, aligned as the descriptor must be.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct ArgSlot([u8; 128]);

// SAFETY: a function handle and plain bytes; usable from any thread with the context.
unsafe impl Send for PreparedLaunch {}
// SAFETY: as above; launching only reads it.
unsafe impl Sync for PreparedLaunch {}
// SAFETY: CUDA stream and event handles may be used from any thread of the process once
// the context is current there (the dispatcher thread binds it first).
unsafe impl Send for Stream {}
// SAFETY: as above; the driver serialises calls on one handle.
unsafe impl Sync for Stream {}
// SAFETY: as for `Stream`.
unsafe impl Send for Event {}
// SAFETY: as for `Stream`.
unsafe impl Sync for Event {}

/// A CUDA device with the kernel library loaded.
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    modules: Vec<sys::CUmodule>,
    functions: BTreeMap<&'static str, sys::CUfunction>,
    pub name: String,
    pub compute_capability: (i32, i32),
    pub sms: u32,
    pub target: PtxTarget,
    /// How kernels follow their stream predecessor: anything but `Off` only on the sm_90a
    /// PTX, whose kernels all begin with `griddepcontrol.wait` (see [`CudaDevice::set_pdl`]).
    pdl: PdlMode,
    library: KernelLibrary,
    /// The options every plan for this device follows: its SM count, and the paths the
    /// environment's documented overrides or [`CudaDevice::set_plan_options`] choose.
    plan: PlanOptions,
}

// SAFETY: the driver's handles (module, function) may be used from any thread once the
// context is current there; every entry point below binds the context first.
unsafe impl Send for CudaDevice {}
// SAFETY: as above; the handles are only read after construction.
unsafe impl Sync for CudaDevice {}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        for &m in &self.modules {
            // SAFETY: loaded by `module::load_data`, unloaded once; no launch outlives the
            // device (every method that launches synchronizes or hands back a stream the
            // caller synchronizes before dropping the device).
            let _ = unsafe { result::module::unload(m) };
        }
    }
}

impl CudaDevice {
    /// Opens device `ordinal` and loads `lib`. `ERASE_PTX=sm80` forces the sm_80 PTX on a
    /// Hopper GPU (to test the portable path).
    pub fn open(lib: KernelLibrary, ordinal: usize) -> Result<Self, RuntimeError> {
        if lib.modules.is_empty() {
            return Err(RuntimeError::Device(
                "this build has no CUDA kernels: nvcc was not found when it was built; run scripts/install-nvcc.sh and rebuild".into(),
            ));
        }
        // SAFETY: only asks whether the driver library can be loaded.
        if !unsafe { sys::is_culib_present() } {
            return Err(RuntimeError::Device(
                "no CUDA driver (libcuda.so) on this machine".into(),
            ));
        }
        result::init().map_err(|e| driver_err("cuInit", e))?;
        let count = result::device::get_count().map_err(|e| driver_err("device count", e))?;
        if count <= ordinal as i32 {
            return Err(RuntimeError::Device(format!(
                "no CUDA device {ordinal} ({count} found)"
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| driver_err("creating the context", e))?;
        // SAFETY: tracking is off before anything is allocated through the context; this
        // module never uses cudarc's tracked slices.
        unsafe { ctx.disable_event_tracking() };
        ctx.bind_to_thread()
            .map_err(|e| driver_err("binding the context", e))?;
        let name = ctx.name().map_err(|e| driver_err("device name", e))?;
        let cc = ctx
            .compute_capability()
            .map_err(|e| driver_err("compute capability", e))?;
        let sms = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| driver_err("SM count", e))? as u32;
        let smem_optin = ctx
            .attribute(
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            )
            .map_err(|e| driver_err("shared memory per block", e))?;
        let forced = std::env::var("ERASE_PTX").ok();
        let target = match forced.as_deref() {
            Some("sm80") => PtxTarget::Sm80,
            Some("sm90a") | None if cc == (9, 0) => PtxTarget::Sm90a,
            Some("sm90a") => {
                return Err(RuntimeError::Device(format!(
                    "ERASE_PTX=sm90a needs an sm_90 GPU; {name} is sm_{}{}",
                    cc.0, cc.1
                )))
            }
            Some(other) if other != "sm80" => {
                return Err(RuntimeError::Device(format!(
                    "ERASE_PTX={other}: expected sm90a or sm80"
                )))
            }
            _ if cc.0 >= 8 => PtxTarget::Sm80,
            _ => {
                return Err(RuntimeError::Device(format!(
                    "{name} is sm_{}{}; the kernels need sm_80 or newer",
                    cc.0, cc.1
                )))
            }
        };
        let plan = fit_plan(PlanOptions::from_env(), sms, target);
        let pdl = pdl_from_env()?;
        let mut dev = CudaDevice {
            pdl: PdlMode::Off,
            plan,
            ctx,
            modules: Vec::new(),
            functions: BTreeMap::new(),
            name,
            compute_capability: cc,
            sms,
            target,
            library: lib,
        };
        for m in lib.modules {
            let src = match target {
                PtxTarget::Sm90a => m.sm90a,
                PtxTarget::Sm80 => m.sm80,
            };
            let c = CString::new(src)
                .map_err(|_| RuntimeError::Device(format!("PTX of {} holds a NUL byte", m.file)))?;
            // SAFETY: `c` is a NUL-terminated PTX image that outlives the call.
            let module = unsafe { result::module::load_data(c.as_ptr() as *const c_void) }
                .map_err(|e| driver_err(&format!("loading the PTX of {}.cu", m.file), e))?;
            dev.modules.push(module);
            for k in lib.kernels.iter().filter(|k| k.file == m.file) {
                let cname = CString::new(k.name)
                    .map_err(|_| RuntimeError::Device(format!("bad kernel name {}", k.name)))?;
                // SAFETY: `module` was just loaded and is alive.
                let f = unsafe { result::module::get_function(module, cname) }
                    .map_err(|e| driver_err(&format!("kernel {} in {}.cu", k.name, m.file), e))?;
                allow_dynamic_smem(f, smem_optin)
                    .map_err(|e| driver_err(&format!("shared memory of kernel {}", k.name), e))?;
                dev.functions.insert(k.name, f);
            }
        }
        if target == PtxTarget::Sm90a {
            dev.set_pdl(pdl)?;
        }
        Ok(dev)
    }

    /// How this device's launches follow the kernel before them on their stream.
    pub fn pdl(&self) -> PdlMode {
        self.pdl
    }

    /// Sets how the launches that follow start (the environment's `ERASE_PDL` sets it at
    /// open): before any program is made or captured on this device. Every kernel's first
    /// statement waits for the grids before it on its stream (`griddepcontrol.wait`), so
    /// a kernel launched early reads and writes nothing before its predecessor is done.
    /// Only the sm_90a PTX has the wait: on the sm_80 PTX anything but `Off` is an error.
    pub fn set_pdl(&mut self, mode: PdlMode) -> Result<(), RuntimeError> {
        if mode != PdlMode::Off && self.target != PtxTarget::Sm90a {
            return Err(RuntimeError::Device(
                "programmatic dependent launch needs the sm_90a PTX (its kernels wait for their predecessors; the sm_80 ones do not)".into(),
            ));
        }
        self.bind()?;
        let early = [i32::from(mode == PdlMode::Early)];
        let name = CString::new("erase_pdl_early")
            .map_err(|_| RuntimeError::Device("the PDL switch's name holds a NUL byte".into()))?;
        for &m in &self.modules {
            // SAFETY: `m` is a loaded module of this (bound) context; the global, where the
            // module has it, is the 4-byte `__constant__ int` of kernels-cuda/common.cuh,
            // written synchronously while no kernel of this device runs.
            unsafe {
                if let Ok((ptr, 4)) = result::module::get_global(m, name.clone()) {
                    result::memcpy_htod_sync(ptr, &early)
                        .map_err(|e| driver_err("setting erase_pdl_early", e))?;
                }
            }
        }
        self.pdl = mode;
        Ok(())
    }

    /// The options this device's plans follow.
    pub fn plan_options(&self) -> PlanOptions {
        self.plan
    }

    /// Sets the paths its plans take (the SM count stays the device's): before any
    /// program is made on it, so that every plan of a step agrees.
    pub fn set_plan_options(&mut self, o: PlanOptions) {
        self.plan = fit_plan(o, self.sms, self.target);
    }

    pub fn library(&self) -> KernelLibrary {
        self.library
    }

    /// Makes the device's context current on the calling thread (needed once per thread
    /// before it issues work).
    pub fn bind(&self) -> Result<(), RuntimeError> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| driver_err("binding the context", e))
    }

    /// (free, total) bytes of device memory now.
    pub fn memory_info(&self) -> Result<(usize, usize), RuntimeError> {
        self.bind()?;
        cudarc::driver::result::mem_get_info().map_err(|e| driver_err("asking for free memory", e))
    }

    pub fn function(&self, name: &str) -> Result<sys::CUfunction, RuntimeError> {
        self.functions.get(name).copied().ok_or_else(|| {
            RuntimeError::Device(format!("kernel '{name}' is not in this build's PTX"))
        })
    }

    /// `bytes` of device memory (contents undefined).
    pub fn alloc(&self, bytes: usize) -> Result<DeviceBuffer, RuntimeError> {
        self.bind()?;
        if bytes == 0 {
            return Ok(DeviceBuffer { ptr: 0, bytes: 0 });
        }
        // SAFETY: a plain device allocation of a positive size.
        let ptr = unsafe { result::malloc_sync(bytes) }
            .map_err(|e| driver_err(&format!("allocating {bytes} bytes"), e))?;
        Ok(DeviceBuffer { ptr, bytes })
    }

    /// Sets every byte of `b` to `value` (0xFF makes f32 NaN: poison).
    pub fn fill(&self, b: &DeviceBuffer, value: u8) -> Result<(), RuntimeError> {
        if b.bytes == 0 {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: `b` is a live allocation of `b.bytes` bytes.
        unsafe { result::memset_d8_sync(b.ptr, value, b.bytes) }
            .map_err(|e| driver_err("memset", e))
    }

    pub fn upload(&self, b: &DeviceBuffer, offset: usize, data: &[u8]) -> Result<(), RuntimeError> {
        if data.is_empty() {
            return Ok(());
        }
        if offset + data.len() > b.bytes {
            return Err(RuntimeError::Device(format!(
                "upload of {} bytes at {offset} overflows a buffer of {}",
                data.len(),
                b.bytes
            )));
        }
        self.bind()?;
        // SAFETY: the destination range lies inside the live allocation (checked above).
        unsafe { result::memcpy_htod_sync(b.ptr + offset as u64, data) }
            .map_err(|e| driver_err("copy to device", e))
    }

    pub fn download(
        &self,
        b: &DeviceBuffer,
        offset: usize,
        out: &mut [u8],
    ) -> Result<(), RuntimeError> {
        if out.is_empty() {
            return Ok(());
        }
        if offset + out.len() > b.bytes {
            return Err(RuntimeError::Device(format!(
                "download of {} bytes at {offset} overflows a buffer of {}",
                out.len(),
                b.bytes
            )));
        }
        self.bind()?;
        // SAFETY: the source range lies inside the live allocation (checked above).
        unsafe { result::memcpy_dtoh_sync(out, b.ptr + offset as u64) }
            .map_err(|e| driver_err("copy to host", e))
    }

    /// A non-blocking stream; `highest` gives it the greatest priority the device has,
    /// else the least.
    pub fn stream(&self, highest: bool) -> Result<Stream, RuntimeError> {
        self.stream_ranked(if highest { 0 } else { u32::MAX })
    }

    /// A non-blocking stream `rank` priority levels below the greatest (0: the greatest;
    /// clamped to the least the device has).
    pub fn stream_ranked(&self, rank: u32) -> Result<Stream, RuntimeError> {
        self.bind()?;
        let (mut least, mut greatest) = (0i32, 0i32);
        // SAFETY: out-pointers to two live i32s; the context is current.
        unsafe { sys::cuCtxGetStreamPriorityRange(&mut least, &mut greatest) }
            .result()
            .map_err(|e| driver_err("stream priorities", e))?;
        let mut raw: sys::CUstream = std::ptr::null_mut();
        // numerically, greater priority is smaller: greatest <= least
        let prio = greatest
            .saturating_add(i32::try_from(rank).unwrap_or(i32::MAX))
            .min(least);
        // SAFETY: out-pointer to a live handle; flags and priority are valid values.
        unsafe {
            sys::cuStreamCreateWithPriority(
                &mut raw,
                sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
                prio,
            )
        }
        .result()
        .map_err(|e| driver_err("creating a stream", e))?;
        Ok(Stream { raw })
    }

    pub fn event(&self, timing: bool) -> Result<Event, RuntimeError> {
        self.bind()?;
        let flags = if timing {
            sys::CUevent_flags::CU_EVENT_DEFAULT
        } else {
            sys::CUevent_flags::CU_EVENT_DISABLE_TIMING
        };
        let raw = result::event::create(flags).map_err(|e| driver_err("creating an event", e))?;
        Ok(Event { raw })
    }

    /// The most threads a CTA of `kernel` may have (its launch bounds and registers).
    pub fn max_threads_per_block(&self, kernel: &str) -> Result<u32, RuntimeError> {
        let f = self.function(kernel)?;
        self.bind()?;
        // SAFETY: `f` is a live function of a loaded module.
        let n = unsafe {
            result::function::get_function_attribute(
                f,
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK,
            )
        }
        .map_err(|e| driver_err("function attribute", e))?;
        Ok(n as u32)
    }

    /// CTAs of `kernel` that fit on one SM with `block` threads and `smem` dynamic bytes.
    pub fn occupancy(&self, kernel: &str, block: u32, smem: u32) -> Result<u32, RuntimeError> {
        let f = self.function(kernel)?;
        self.bind()?;
        // SAFETY: `f` is a live function of a loaded module.
        let n = unsafe {
            result::occupancy::max_active_block_per_multiprocessor(f, block as i32, smem as usize)
        }
        .map_err(|e| driver_err("occupancy", e))?;
        Ok(n as u32)
    }

    /// Launches `call` on `s`, with operand pointers from `ptr`.
    pub fn launch(
        &self,
        call: &KernelCall,
        s: &Stream,
        ptr: &dyn Fn(KArg) -> Option<u64>,
    ) -> Result<(), RuntimeError> {
        let l = self.prepare(call, ptr)?;
        self.launch_prepared(&l, s)
    }

    /// Resolves `call`'s function and arguments once, for launches repeated every step.
    pub fn prepare(
        &self,
        call: &KernelCall,
        ptr: &dyn Fn(KArg) -> Option<u64>,
    ) -> Result<PreparedLaunch, RuntimeError> {
        let f = self.function(call.kernel)?;
        let mut slots: Vec<ArgSlot> = Vec::with_capacity(call.args.len());
        for &a in &call.args {
            let mut slot = ArgSlot([0u8; 128]);
            let b = &mut slot.0;
            match a {
                KArg::I32(v) => b[..4].copy_from_slice(&v.to_ne_bytes()),
                KArg::U32(v) => b[..4].copy_from_slice(&v.to_ne_bytes()),
                KArg::F32(v) => b[..4].copy_from_slice(&v.to_ne_bytes()),
                KArg::I64(v) => b[..8].copy_from_slice(&v.to_ne_bytes()),
                KArg::TensorMap(t) => {
                    let p = ptr(t.base.karg()).ok_or_else(|| {
                        RuntimeError::Device(format!(
                            "{}: no device pointer for argument {a:?}",
                            call.kernel
                        ))
                    })?;
                    b.copy_from_slice(&encode_tma(p, &t).map_err(|e| {
                        RuntimeError::Device(format!("{}: {a:?}: {e}", call.kernel))
                    })?);
                }
                other => {
                    // a pointer into a tensor: the tensor's pointer, then the offset
                    let (base, off) = match other {
                        KArg::InAt(i, off) => (KArg::In(i), off),
                        KArg::OutAt(i, off) => (KArg::Out(i), off),
                        KArg::ScratchAt(i, off) => (KArg::Scratch(i), off),
                        a => (a, 0),
                    };
                    let p = ptr(base).map(|p| p + off).ok_or_else(|| {
                        RuntimeError::Device(format!(
                            "{}: no device pointer for argument {other:?}",
                            call.kernel
                        ))
                    })?;
                    b[..8].copy_from_slice(&p.to_ne_bytes());
                }
            }
            slots.push(slot);
        }
        Ok(PreparedLaunch {
            f,
            call: call.clone(),
            slots,
        })
    }

    /// Issues a prepared launch on `s`.
    pub fn launch_prepared(&self, l: &PreparedLaunch, s: &Stream) -> Result<(), RuntimeError> {
        // the driver reads the arguments through mutable pointers: give it a copy
        let mut slots = l.slots.clone();
        let mut params: Vec<*mut c_void> = slots
            .iter_mut()
            .map(|s| s.0.as_mut_ptr() as *mut c_void)
            .collect();
        let c = &l.call;
        if self.pdl != PdlMode::Off {
            let mut attr = sys::CUlaunchAttribute {
                id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
                pad: [0; 4],
                value: sys::CUlaunchAttributeValue { pad: [0; 64] },
            };
            attr.value.programmaticStreamSerializationAllowed = 1;
            let config = sys::CUlaunchConfig {
                gridDimX: c.grid[0],
                gridDimY: c.grid[1],
                gridDimZ: c.grid[2],
                blockDimX: c.block[0],
                blockDimY: c.block[1],
                blockDimZ: c.block[2],
                sharedMemBytes: c.smem,
                hStream: s.raw,
                attrs: &mut attr,
                numAttrs: 1,
            };
            // SAFETY: as for `launch_kernel` below; `config` and the one attribute it
            // points at live until the call returns, and every kernel of the sm_90a PTX
            // (the only one `pdl` is set for) waits for its predecessors before it touches
            // memory (`ERASE_PDL_ENTER`, checked by tests/kernel_abi.rs).
            return unsafe {
                sys::cuLaunchKernelEx(&config, l.f, params.as_mut_ptr(), std::ptr::null_mut())
                    .result()
            }
            .map_err(|e| driver_err(&format!("launching {}", c.kernel), e));
        }
        // SAFETY: `l.f` is a live function; `params` points at one correctly sized value
        // per kernel parameter (the plan's argument list is the kernel's signature) that
        // lives until the call returns (the driver copies them at launch); operand
        // pointers are live device allocations of the sizes the plan was made for.
        unsafe {
            result::launch_kernel(
                l.f,
                (c.grid[0], c.grid[1], c.grid[2]),
                (c.block[0], c.block[1], c.block[2]),
                c.smem,
                s.raw,
                &mut params,
            )
        }
        .map_err(|e| driver_err(&format!("launching {}", c.kernel), e))
    }

    /// Runs one op on the device: inputs copied in, outputs and scratch poisoned (NaN),
    /// the plan's launches, outputs copied back; `upd` is updated in place. For tests and
    /// single-op benchmarks.
    pub fn run_node(
        &self,
        op: &Op,
        ins: &[(&Shape, &Buffer)],
        outs: &[(Shape, DType)],
        upd: &mut [(&Shape, &mut Buffer)],
    ) -> Result<Vec<Buffer>, RuntimeError> {
        let upd_in: Vec<(&Shape, &Buffer)> = upd.iter().map(|(s, b)| (*s, &**b)).collect();
        let node = NodeOnDevice::new(self, op, ins, outs, &upd_in)?;
        let s = self.stream(true)?;
        node.launch(self, &s)?;
        s.synchronize()?;
        for (i, (_, b)) in upd.iter_mut().enumerate() {
            let dt = b.dtype();
            **b = node.fetch(self, &node.upd[i], dt)?;
        }
        node.out
            .iter()
            .zip(outs)
            .map(|(b, (_, d))| node.fetch(self, b, *d))
            .collect()
    }

    /// Times one op on the device: inputs uploaded once, `warmup` untimed runs, then the
    /// median of `iters` runs, each between two events on one stream. Milliseconds.
    pub fn time_node(
        &self,
        op: &Op,
        ins: &[(&Shape, &Buffer)],
        outs: &[(Shape, DType)],
        upd: &[(&Shape, &Buffer)],
        warmup: usize,
        iters: usize,
    ) -> Result<f64, RuntimeError> {
        let node = NodeOnDevice::new(self, op, ins, outs, upd)?;
        let s = self.stream(true)?;
        let (a, b) = (self.event(true)?, self.event(true)?);
        let mut times = Vec::with_capacity(iters);
        for i in 0..warmup + iters {
            a.record(&s)?;
            node.launch(self, &s)?;
            b.record(&s)?;
            b.synchronize()?;
            if i >= warmup {
                times.push(f64::from(b.elapsed_ms_since(&a)?));
            }
        }
        times.sort_by(f64::total_cmp);
        Ok(times.get(times.len() / 2).copied().unwrap_or(f64::NAN))
    }
}

/// One op to time in [`CudaDevice::time_pair`]: the op, its inputs and its outputs.
pub type TimedOp<'a> = (&'a Op, &'a [(&'a Shape, &'a Buffer)], &'a [(Shape, DType)]);

/// What two ops cost alone, one after the other and side by side (ms, medians).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PairTiming {
    pub a_ms: f64,
    pub b_ms: f64,
    /// A then B on one stream.
    pub serial_ms: f64,
    /// A and B issued at once on two streams, until both are done.
    pub together_ms: f64,
}

impl CudaDevice {
    /// Times two ops alone, in sequence and concurrently (on two streams released by one
    /// event): `warmup` untimed rounds, then the median of `iters`. What the occupancy
    /// model's contention cost is measured with.
    pub fn time_pair(
        &self,
        a: TimedOp,
        b: TimedOp,
        warmup: usize,
        iters: usize,
    ) -> Result<PairTiming, RuntimeError> {
        let na = NodeOnDevice::new(self, a.0, a.1, a.2, &[])?;
        let nb = NodeOnDevice::new(self, b.0, b.1, b.2, &[])?;
        let (s1, s2) = (self.stream(true)?, self.stream(true)?);
        let (e0, e1, e2, e3) = (
            self.event(true)?,
            self.event(true)?,
            self.event(true)?,
            self.event(true)?,
        );
        let median = |mut v: Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
        };
        let (mut ta, mut tb, mut ts, mut tt) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for i in 0..warmup + iters {
            // alone, and in sequence
            e0.record(&s1)?;
            na.launch(self, &s1)?;
            e1.record(&s1)?;
            nb.launch(self, &s1)?;
            e2.record(&s1)?;
            e2.synchronize()?;
            let (a_ms, b_ms, ab) = (
                f64::from(e1.elapsed_ms_since(&e0)?),
                f64::from(e2.elapsed_ms_since(&e1)?),
                f64::from(e2.elapsed_ms_since(&e0)?),
            );
            // side by side: both streams wait for one mark, the first joins the second
            e0.record(&s1)?;
            e0.wait_on(&s2)?;
            na.launch(self, &s1)?;
            nb.launch(self, &s2)?;
            e3.record(&s2)?;
            e3.wait_on(&s1)?;
            e1.record(&s1)?;
            e1.synchronize()?;
            if i >= warmup {
                ta.push(a_ms);
                tb.push(b_ms);
                ts.push(ab);
                tt.push(f64::from(e1.elapsed_ms_since(&e0)?));
            }
        }
        Ok(PairTiming {
            a_ms: median(ta),
            b_ms: median(tb),
            serial_ms: median(ts),
            together_ms: median(tt),
        })
    }
}

impl CudaDevice {
    /// Times each launch of one op's plan separately (events between the launches):
    /// `warmup` untimed runs, then per launch the median of `iters` runs. (kernel,
    /// milliseconds) in plan order; for benchmarks that split an op into its passes (the
    /// pipelined GEMM's operand rounding, its wgmma kernel, the split-K sum).
    pub fn time_node_calls(
        &self,
        op: &Op,
        ins: &[(&Shape, &Buffer)],
        outs: &[(Shape, DType)],
        warmup: usize,
        iters: usize,
    ) -> Result<Vec<(&'static str, f64)>, RuntimeError> {
        let node = NodeOnDevice::new(self, op, ins, outs, &[])?;
        let s = self.stream(true)?;
        let calls = &node.plan.calls;
        let marks = (0..=calls.len())
            .map(|_| self.event(true))
            .collect::<Result<Vec<_>, _>>()?;
        let ptr = node.pointers();
        let mut times = vec![Vec::with_capacity(iters); calls.len()];
        for i in 0..warmup + iters {
            marks[0].record(&s)?;
            for (c, call) in calls.iter().enumerate() {
                self.launch(call, &s, &ptr)?;
                marks[c + 1].record(&s)?;
            }
            marks[calls.len()].synchronize()?;
            if i >= warmup {
                for (c, t) in times.iter_mut().enumerate() {
                    t.push(f64::from(marks[c + 1].elapsed_ms_since(&marks[c])?));
                }
            }
        }
        Ok(calls
            .iter()
            .zip(times)
            .map(|(call, mut t)| {
                t.sort_by(f64::total_cmp);
                (call.kernel, t.get(t.len() / 2).copied().unwrap_or(f64::NAN))
            })
            .collect())
    }
}

/// One op's plan with its operands in device memory (inputs uploaded; outputs and
/// scratch poisoned with NaN so an unwritten element shows).
struct NodeOnDevice {
    plan: erase_ops::cuda::CudaPlan,
    ins: Vec<DeviceBuffer>,
    out: Vec<DeviceBuffer>,
    upd: Vec<DeviceBuffer>,
    scratch: Vec<DeviceBuffer>,
}

impl NodeOnDevice {
    fn new(
        dev: &CudaDevice,
        op: &Op,
        ins: &[(&Shape, &Buffer)],
        outs: &[(Shape, DType)],
        upd: &[(&Shape, &Buffer)],
    ) -> Result<Self, RuntimeError> {
        let in_shapes: Vec<&Shape> = ins.iter().map(|x| x.0).collect();
        let in_dtypes: Vec<DType> = ins.iter().map(|x| x.1.dtype()).collect();
        let out_shapes: Vec<&Shape> = outs.iter().map(|x| &x.0).collect();
        let out_dtypes: Vec<DType> = outs.iter().map(|x| x.1).collect();
        let upd_shapes: Vec<&Shape> = upd.iter().map(|x| x.0).collect();
        let operands = Operands {
            opts: dev.plan_options(),
            ins: &in_shapes,
            in_dtypes: &in_dtypes,
            outs: &out_shapes,
            out_dtypes: &out_dtypes,
            upd: &upd_shapes,
        };
        let plan = cuda_plan(op, &operands).map_err(RuntimeError::Device)?;
        let upload = |b: &Buffer| -> Result<DeviceBuffer, RuntimeError> {
            let d = dev.alloc(b.bytes().len())?;
            dev.upload(&d, 0, b.bytes())?;
            Ok(d)
        };
        let poisoned = |n: usize| -> Result<DeviceBuffer, RuntimeError> {
            let d = dev.alloc(n)?;
            dev.fill(&d, 0xFF)?;
            Ok(d)
        };
        Ok(NodeOnDevice {
            ins: ins.iter().map(|x| upload(x.1)).collect::<Result<_, _>>()?,
            upd: upd.iter().map(|x| upload(x.1)).collect::<Result<_, _>>()?,
            out: outs
                .iter()
                .map(|(s, d)| poisoned(s.numel() * d.size_bytes()))
                .collect::<Result<_, _>>()?,
            scratch: plan
                .scratch
                .iter()
                .map(|&n| poisoned(n))
                .collect::<Result<_, _>>()?,
            plan,
        })
    }

    /// The device pointer of a pointer argument of this node's launches.
    fn pointers(&self) -> impl Fn(KArg) -> Option<u64> + '_ {
        move |a: KArg| -> Option<u64> {
            match a {
                KArg::In(i) => self.ins.get(i).map(|b| b.ptr),
                KArg::Out(i) => self.out.get(i).map(|b| b.ptr),
                KArg::Upd(i) => self.upd.get(i).map(|b| b.ptr),
                KArg::Scratch(i) => self.scratch.get(i).map(|b| b.ptr),
                _ => None,
            }
        }
    }

    fn launch(&self, dev: &CudaDevice, s: &Stream) -> Result<(), RuntimeError> {
        let ptr = self.pointers();
        for call in &self.plan.calls {
            dev.launch(call, s, &ptr)?;
        }
        Ok(())
    }

    fn fetch(
        &self,
        dev: &CudaDevice,
        b: &DeviceBuffer,
        dtype: DType,
    ) -> Result<Buffer, RuntimeError> {
        let mut bytes = vec![0u8; b.bytes];
        dev.download(b, 0, &mut bytes)?;
        Ok(buffer_from_bytes(dtype, &bytes))
    }
}
