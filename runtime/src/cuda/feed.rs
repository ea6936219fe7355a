//! Feeding a step program without stopping it.
//!
//! A batch travels in three hops, none of which makes the host wait for the GPU:
//! 1. a loader thread writes it into a page-locked (pinned) host slot;
//! 2. the copy stream copies the slot into a device staging buffer of the same slot,
//!    once the step that last read that staging buffer has taken its inputs out;
//! 3. the main stream, at the start of the step, waits for that copy and copies the
//!    staging buffer into the program's fixed input buffers (device to device, a few
//!    microseconds), then runs the step (eager launches or the captured graph).
//!
//! The losses come back the same way in reverse: the main stream copies them into a
//! pinned slot after the step and records an event; the host reads them one step later,
//! when the next step is already queued, so the GPU never idles while the host checks.

use std::ops::{Deref, DerefMut};

use crate::cuda::program::CudaProgram;
use crate::cuda::{CudaDevice, DeviceBuffer, Event, Stream};
use crate::error::RuntimeError;
use cudarc::driver::sys;
use erase_graph::Tensor;

/// Page-locked host memory (the copy engines read and write it without a bounce buffer,
/// asynchronously to the host).
pub struct PinnedBuffer {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the allocation belongs to this value alone; moving it to another thread moves
// the only handle to it.
unsafe impl Send for PinnedBuffer {}

impl Deref for PinnedBuffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: `ptr` points to `len` bytes allocated by cuMemHostAlloc and alive
        // until drop; shared access through `&self`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl DerefMut for PinnedBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: as above, with exclusive access through `&mut self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: allocated by cuMemHostAlloc, freed once. A copy that reads it has
            // completed: the owners wait for their copy events before dropping.
            let _ = unsafe { sys::cuMemFreeHost(self.ptr.cast()) };
        }
    }
}

impl CudaDevice {
    /// `bytes` of pinned host memory, zeroed.
    pub fn pinned(&self, bytes: usize) -> Result<PinnedBuffer, RuntimeError> {
        if bytes == 0 {
            return Ok(PinnedBuffer {
                ptr: std::ptr::null_mut(),
                len: 0,
            });
        }
        self.bind()?;
        let mut p: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: an out-pointer to a live pointer; a positive size; flags 0 (plain
        // page-locked memory of this context).
        unsafe { sys::cuMemHostAlloc(&mut p, bytes, 0) }
            .result()
            .map_err(|e| {
                RuntimeError::Device(format!("pinning {bytes} bytes of host memory: {e:?}"))
            })?;
        let mut b = PinnedBuffer {
            ptr: p.cast(),
            len: bytes,
        };
        b.fill(0);
        Ok(b)
    }
}

/// Where each input lies in a packed batch: the inputs one after another, in the order
/// given, each at a 256-byte aligned offset.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InputLayout {
    pub inputs: Vec<(Tensor, usize, usize)>,
    pub bytes: usize,
}

impl InputLayout {
    /// The layout of `inputs` of `g` (each its shape's elements at its dtype's size).
    pub fn new(g: &erase_graph::Graph, inputs: &[Tensor]) -> InputLayout {
        let mut off = 0usize;
        let mut v = Vec::new();
        for &t in inputs {
            let len = g.shape(t).numel() * g.dtype(t).size_bytes();
            v.push((t, off, len));
            off = (off + len).div_ceil(256) * 256;
        }
        InputLayout {
            inputs: v,
            bytes: off,
        }
    }

    /// The bytes of input `k` inside a packed batch.
    pub fn range(&self, k: usize) -> std::ops::Range<usize> {
        let (_, off, len) = self.inputs[k];
        off..off + len
    }
}

/// The device side of the input pipeline (see the module's text).
pub(crate) struct InputPipeline {
    layout: InputLayout,
    copy: Stream,
    staging: Vec<DeviceBuffer>,
    /// Recorded on the copy stream after slot k's copy to the device.
    copied: Vec<Event>,
    /// Recorded on the main stream once the step took slot k's inputs.
    consumed: Vec<Event>,
}

/// The results of one step, read back through pinned memory.
pub(crate) struct Readback {
    tensors: Vec<Tensor>,
    host: Vec<PinnedBuffer>,
    done: Vec<Event>,
    /// The timing event before the first step since the timing (re)started, and that
    /// step's number.
    first: Event,
    first_step: Option<u64>,
}

/// What a finished step gave back.
#[derive(Clone, Debug)]
pub struct StepValues {
    /// The read-back tensors' first element each, in the order asked for.
    pub values: Vec<f32>,
    /// Milliseconds from the end of the previous pipelined step (or the start of the first)
    /// to the end of this one, on the main stream.
    pub ms: f32,
}

/// Slots of the loss read-back ring: the step being read, the one before it (its end is
/// the reference time) and the one just issued.
const READBACK_SLOTS: usize = 3;

impl CudaProgram<'_> {
    /// The packed layout of `inputs` (leaves of the graph) for [`CudaProgram::step_from`].
    pub fn input_layout(&self, inputs: &[Tensor]) -> Result<InputLayout, RuntimeError> {
        for &t in inputs {
            if !self.leaves.contains_key(&t) {
                return Err(RuntimeError::Feed {
                    tensor: self.g.name(t).to_string(),
                    msg: "only leaves (inputs, parameters) can be fed".into(),
                });
            }
        }
        Ok(InputLayout::new(self.g, inputs))
    }

    /// Sets up the pipeline: `slots` device staging buffers (one per pinned host slot the
    /// caller will cycle through), a copy stream, and the read-back ring for `readback`
    /// (scalar tensors such as the losses).
    pub fn enable_pipeline(
        &mut self,
        inputs: &[Tensor],
        slots: usize,
        readback: &[Tensor],
    ) -> Result<InputLayout, RuntimeError> {
        let layout = self.input_layout(inputs)?;
        let slots = slots.max(1);
        let staging = (0..slots)
            .map(|_| self.dev.alloc(layout.bytes))
            .collect::<Result<Vec<_>, _>>()?;
        let events = |n: usize| {
            (0..n)
                .map(|_| self.dev.event(false))
                .collect::<Result<Vec<_>, _>>()
        };
        let (copied, consumed) = (events(slots)?, events(slots)?);
        let bytes = readback.len() * 4;
        for &t in readback {
            if self.tensor_ptr(t).is_none() {
                return Err(RuntimeError::NotComputed(self.g.name(t).to_string()));
            }
        }
        self.readback = Some(Readback {
            tensors: readback.to_vec(),
            host: (0..READBACK_SLOTS)
                .map(|_| self.dev.pinned(bytes))
                .collect::<Result<Vec<_>, _>>()?,
            done: (0..READBACK_SLOTS)
                .map(|_| self.dev.event(true))
                .collect::<Result<Vec<_>, _>>()?,
            first: self.dev.event(true)?,
            first_step: None,
        });
        let copy = self.dev.stream(false)?;
        crate::cuda::nvtx::name_stream(copy.raw(), "copy");
        self.pipeline = Some(InputPipeline {
            layout: layout.clone(),
            copy,
            staging,
            copied,
            consumed,
        });
        Ok(layout)
    }

    /// Issues step number `step` (counted by the caller from 0) on the packed batch in
    /// pinned `host`, which belongs to staging slot `slot`: the copy, the step, and the
    /// read-back. Returns at once. `host` must not be written again before
    /// [`CudaProgram::copied`]`(slot)` has completed.
    pub fn step_from(
        &mut self,
        step: u64,
        slot: usize,
        host: &PinnedBuffer,
    ) -> Result<(), RuntimeError> {
        self.step_from_with(step, slot, host, |p| p.run())
    }

    /// [`CudaProgram::step_from`] with the step itself issued by `run` (a data-parallel
    /// step with its collectives, say) between the batch's copy and the read-back.
    pub fn step_from_with(
        &mut self,
        step: u64,
        slot: usize,
        host: &PinnedBuffer,
        run: impl FnOnce(&mut Self) -> Result<(), RuntimeError>,
    ) -> Result<(), RuntimeError> {
        let err = |what: &str, e: cudarc::driver::result::DriverError| {
            RuntimeError::Device(format!("{what}: {e:?}"))
        };
        self.trace_start()?;
        let marks = self.trace.as_mut().filter(|t| t.armed).map(|t| {
            t.copies_recorded = true;
            &t.copies
        });
        let p = self.pipeline.as_ref().ok_or_else(|| {
            RuntimeError::Device("the input pipeline is not set up: call enable_pipeline".into())
        })?;
        if slot >= p.staging.len() || host.len() < p.layout.bytes {
            return Err(RuntimeError::Device(format!(
                "slot {slot} of {} with {} bytes; the batch needs {}",
                p.staging.len(),
                host.len(),
                p.layout.bytes
            )));
        }
        self.dev.bind()?;
        let copies = crate::cuda::nvtx::range("copy batch");
        let main = &self.streams[0];
        let dst = &p.staging[slot];
        // the copy may overwrite the staging buffer once the step that read it took its
        // inputs out (an event never recorded is complete)
        p.consumed[slot].wait_on(&p.copy)?;
        if let Some(m) = marks {
            m[0].0.record(&p.copy)?;
        }
        // SAFETY: `host` is pinned and holds at least `layout.bytes` bytes (checked); the
        // destination is a live device allocation of that size; the caller keeps `host`
        // unchanged until `copied[slot]` completes.
        unsafe {
            sys::cuMemcpyHtoDAsync_v2(
                dst.ptr(),
                host.as_ptr().cast(),
                p.layout.bytes,
                p.copy.raw(),
            )
        }
        .result()
        .map_err(|e| err("copying a batch to the device", e))?;
        if let Some(m) = marks {
            m[0].1.record(&p.copy)?;
        }
        p.copied[slot].record(&p.copy)?;
        p.copied[slot].wait_on(main)?;
        if let Some(m) = marks {
            m[1].0.record(main)?;
        }
        for &(t, off, len) in &p.layout.inputs {
            let leaf = self.leaves[&t].ptr();
            // SAFETY: both ranges lie inside live allocations (the layout was built from
            // the leaves' sizes); ordered on the main stream after the copy above and
            // before the step that reads the leaf.
            unsafe { sys::cuMemcpyDtoDAsync_v2(leaf, dst.ptr() + off as u64, len, main.raw()) }
                .result()
                .map_err(|e| err("copying a batch into the step's inputs", e))?;
        }
        if let Some(m) = marks {
            m[1].1.record(main)?;
        }
        p.consumed[slot].record(main)?;
        drop(copies);
        let rb = self
            .readback
            .as_mut()
            .ok_or_else(|| RuntimeError::Device("no read-back ring".into()))?;
        if rb.first_step.is_none() {
            rb.first.record(main)?;
            rb.first_step = Some(step);
        }
        run(self)?;
        let rb = self
            .readback
            .as_ref()
            .ok_or_else(|| RuntimeError::Device("no read-back ring".into()))?;
        let main = &self.streams[0];
        let r = (step as usize) % READBACK_SLOTS;
        for (k, &t) in rb.tensors.iter().enumerate() {
            let src = self
                .tensor_ptr(t)
                .ok_or_else(|| RuntimeError::NotComputed(self.g.name(t).to_string()))?;
            // SAFETY: 4 bytes of a live f32 tensor into 4 bytes of a pinned slot that the
            // host reads only after `done[r]` completes.
            unsafe {
                sys::cuMemcpyDtoHAsync_v2(
                    rb.host[r].as_ptr().add(4 * k) as *mut std::ffi::c_void,
                    src,
                    4,
                    main.raw(),
                )
            }
            .result()
            .map_err(|e| err("reading a loss back", e))?;
        }
        rb.done[r].record(main)?;
        Ok(())
    }

    /// Starts the step timing afresh with the next step (after an evaluation or a
    /// checkpoint, whose time is not a step's).
    pub fn restart_timing(&mut self) {
        if let Some(rb) = self.readback.as_mut() {
            rb.first_step = None;
        }
    }

    /// The event that completes when slot `slot`'s host buffer has been copied out.
    pub fn copied(&self, slot: usize) -> Option<&Event> {
        self.pipeline.as_ref().and_then(|p| p.copied.get(slot))
    }

    /// Whether step `step` (issued by [`CudaProgram::step_from`]) has finished, without
    /// waiting.
    pub fn step_finished(&self, step: u64) -> Result<bool, RuntimeError> {
        let rb = self
            .readback
            .as_ref()
            .ok_or_else(|| RuntimeError::Device("no read-back ring".into()))?;
        rb.done[(step as usize) % READBACK_SLOTS].query()
    }

    /// Waits for step `step` (issued by [`CudaProgram::step_from`]; at most the two
    /// latest steps may be outstanding) and returns its read-back values and time.
    pub fn step_values(&self, step: u64) -> Result<StepValues, RuntimeError> {
        let rb = self
            .readback
            .as_ref()
            .ok_or_else(|| RuntimeError::Device("no read-back ring".into()))?;
        let r = (step as usize) % READBACK_SLOTS;
        rb.done[r].synchronize()?;
        let ms = if rb.first_step.is_none_or(|f| f >= step) {
            rb.done[r].elapsed_ms_since(&rb.first)?
        } else {
            let prev = (step as usize + READBACK_SLOTS - 1) % READBACK_SLOTS;
            rb.done[r].elapsed_ms_since(&rb.done[prev])?
        };
        let values = rb.host[r]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        Ok(StepValues { values, ms })
    }
}
