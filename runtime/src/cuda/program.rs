//! Runs a step program on a CUDA device (blocking dispatch: one host thread issues every
//! launch in schedule order): every step tensor at its planned offset in one arena,
//! persistent tensors and inputs in their own allocations, one stream per program stream
//! (the main one at the highest priority), and the program's events between them.

use std::collections::BTreeMap;

use crate::cpu::buffer_from_bytes;
use crate::cpu::initial_store;
use crate::cuda::nvtx;
use crate::cuda::{CudaDevice, DeviceBuffer, Event, PreparedLaunch, Stream};
use crate::error::RuntimeError;
use crate::program::memory::{alias_root, MemoryPlan};
use crate::program::schedule::{Label, StepProgram, StreamId};
use cudarc::driver::{result, sys};
use erase_graph::{DType, Graph, Tensor};
use erase_ops::cuda::{cuda_plan, KArg, Operands};
use erase_ops::Buffer;

/// One launch, ready to issue.
pub(crate) struct Prepared {
    /// Empty for an alias that moves no bytes.
    pub(crate) calls: Vec<PreparedLaunch>,
    /// Kept alive for the calls that point into it.
    _scratch: Vec<DeviceBuffer>,
}

pub struct CudaProgram<'a> {
    pub(crate) dev: &'a CudaDevice,
    pub(crate) g: &'a Graph,
    pub(crate) prog: &'a StepProgram,
    pub(crate) plan: &'a MemoryPlan,
    pub(crate) arena: DeviceBuffer,
    pub(crate) leaves: BTreeMap<Tensor, DeviceBuffer>,
    pub(crate) prepared: Vec<Prepared>,
    pub(crate) streams: Vec<Stream>,
    pub(crate) events: Vec<Event>,
    pub(crate) start: Event,
    pub(crate) end: Event,
    pub(crate) join: Event,
    /// Batches staged in device memory (see [`CudaProgram::stage`]).
    pub(crate) ring: Vec<Vec<DeviceBuffer>>,
    pub(crate) ring_inputs: Vec<Tensor>,
    pub(crate) threaded: bool,
    /// The captured step (graph dispatch), once [`CudaProgram::capture`] ran.
    pub(crate) graph: Option<(sys::CUgraph, sys::CUgraphExec)>,
    pub(crate) arena_set: BTreeMap<Tensor, ()>,
    /// The input pipeline and the loss read-back ring, once enabled.
    pub(crate) pipeline: Option<crate::cuda::feed::InputPipeline>,
    pub(crate) readback: Option<crate::cuda::feed::Readback>,
    /// While capturing: each kernel node of the graph with the launch that made it;
    /// kept after the capture (see [`CudaProgram::captured_order`]).
    pub(crate) capture_nodes: Option<Vec<(sys::CUgraphNode, usize)>>,
    pub(crate) graph_nodes: Vec<(sys::CUgraphNode, usize)>,
    /// Event marks around every launch, once tracing is enabled (see `cuda::trace`).
    pub(crate) trace: Option<crate::cuda::trace::TraceState>,
    /// The last subset [`CudaProgram::run_subset`] issued, with its own waits and events.
    pub(crate) subset: Option<Subset>,
}

/// Launches of a program issued alone (an evaluation's forward): the indices, the program
/// restricted to them (`StepProgram::restricted`, whose waits order them as the whole step
/// does without the launches left out) and its events.
pub(crate) struct Subset {
    which: Vec<usize>,
    order: StepProgram,
    events: Vec<Event>,
}

impl<'a> CudaProgram<'a> {
    /// Allocates the arena and the leaves (parameters initialised from `seed` as on the
    /// CPU), prepares every launch's kernels, and creates the streams and events.
    pub fn new(
        dev: &'a CudaDevice,
        g: &'a Graph,
        prog: &'a StepProgram,
        plan: &'a MemoryPlan,
        seed: u64,
    ) -> Result<Self, RuntimeError> {
        let arena = dev.alloc(plan.arena_bytes.max(1))?;
        dev.fill(&arena, 0xFF)?;
        let mut leaves = BTreeMap::new();
        let store = initial_store(g, seed);
        for t in g.tensors() {
            if g.leaf(t).is_none() {
                continue;
            }
            let bytes = g.shape(t).numel() * g.dtype(t).size_bytes();
            let b = dev.alloc(bytes)?;
            match &store[t.index()] {
                Some(v) => dev.upload(&b, 0, v.bytes())?,
                None => dev.fill(&b, 0xFF)?,
            }
            leaves.insert(t, b);
        }
        let arena_set: BTreeMap<Tensor, ()> = plan.place.keys().map(|&t| (t, ())).collect();
        let mut prepared = Vec::with_capacity(prog.launches.len());
        for l in &prog.launches {
            let n = g.node(l.node);
            let alias = crate::program::memory::is_alias(g, l.node)
                && plan
                    .get(n.outputs[0])
                    .zip(plan.get(n.inputs[0]))
                    .is_some_and(|(a, b)| a.offset == b.offset);
            if alias {
                prepared.push(Prepared {
                    calls: Vec::new(),
                    _scratch: Vec::new(),
                });
                continue;
            }
            let ins: Vec<_> = n.inputs.iter().map(|&t| g.shape(t)).collect();
            let ind: Vec<DType> = n.inputs.iter().map(|&t| g.dtype(t)).collect();
            let outs: Vec<_> = n.outputs.iter().map(|&t| g.shape(t)).collect();
            let outd: Vec<DType> = n.outputs.iter().map(|&t| g.dtype(t)).collect();
            let upd: Vec<_> = n.updates.iter().map(|&t| g.shape(t)).collect();
            let p = cuda_plan(
                &n.op,
                &Operands {
                    opts: dev.plan_options().at_launch(prog.launch_at(g, l)),
                    ins: &ins,
                    in_dtypes: &ind,
                    outs: &outs,
                    out_dtypes: &outd,
                    upd: &upd,
                },
            )
            .map_err(|e| RuntimeError::Device(format!("node '{}': {e}", n.name)))?;
            let scratch = p
                .scratch
                .iter()
                .map(|&b| dev.alloc(b))
                .collect::<Result<Vec<_>, _>>()?;
            let ptr_of = |t: Tensor| -> Option<u64> {
                if let Some(pl) = plan.get(alias_root(g, &arena_set, t)) {
                    return Some(arena.ptr() + pl.offset as u64);
                }
                leaves.get(&t).map(|b: &DeviceBuffer| b.ptr())
            };
            let ptr = |a: KArg| -> Option<u64> {
                match a {
                    KArg::In(k) => n.inputs.get(k).and_then(|&t| ptr_of(t)),
                    KArg::Out(k) => n.outputs.get(k).and_then(|&t| ptr_of(t)),
                    KArg::Upd(k) => n.updates.get(k).and_then(|&t| ptr_of(t)),
                    KArg::Scratch(k) => scratch.get(k).map(|b| b.ptr()),
                    _ => None,
                }
            };
            let calls = p
                .calls
                .iter()
                .map(|c| dev.prepare(c, &ptr))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| RuntimeError::Device(format!("node '{}': {e}", n.name)))?;
            prepared.push(Prepared {
                calls,
                _scratch: scratch,
            });
        }
        // main at the greatest priority, then the late stream, the pool, the companions
        let streams = (0..prog.streams)
            .map(|s| dev.stream_ranked(prog.stream_rank(StreamId(s as u16))))
            .collect::<Result<Vec<_>, _>>()?;
        for (s, st) in streams.iter().enumerate() {
            nvtx::name_stream(st.raw(), &crate::trace::stream_name(s as u16));
        }
        let events = (0..prog.events)
            .map(|_| dev.event(false))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(CudaProgram {
            dev,
            g,
            prog,
            plan,
            arena,
            leaves,
            prepared,
            streams,
            events,
            start: dev.event(true)?,
            end: dev.event(true)?,
            join: dev.event(false)?,
            graph: None,
            ring: Vec::new(),
            ring_inputs: Vec::new(),
            threaded: false,
            arena_set,
            pipeline: None,
            readback: None,
            capture_nodes: None,
            graph_nodes: Vec::new(),
            trace: None,
            subset: None,
        })
    }

    /// The step program this runs.
    pub fn program(&self) -> &'a StepProgram {
        self.prog
    }

    /// The graph this runs.
    pub fn graph(&self) -> &'a Graph {
        self.g
    }

    /// The device this program runs on.
    pub fn device(&self) -> &'a CudaDevice {
        self.dev
    }

    pub(crate) fn tensor_ptr(&self, t: Tensor) -> Option<u64> {
        if let Some(pl) = self.plan.get(alias_root(self.g, &self.arena_set, t)) {
            return Some(self.arena.ptr() + pl.offset as u64);
        }
        self.leaves.get(&t).map(|b| b.ptr())
    }

    /// Copies an input (or a parameter) to the device.
    pub fn feed(&mut self, t: Tensor, b: &Buffer) -> Result<(), RuntimeError> {
        crate::error::check_feed(self.g, t, b)?;
        let info = self.g.info(t);
        let dst = self.leaves.get(&t).ok_or_else(|| RuntimeError::Feed {
            tensor: info.name.clone(),
            msg: "only leaves (inputs, parameters) can be fed".into(),
        })?;
        // the previous step may still read the input: wait for it
        self.streams[0].synchronize()?;
        self.dev.upload(dst, 0, b.bytes())?;
        // a parameter's persistent bf16 copy is the parameter, rounded: set it too
        if let Some(c) = self.g.param_copy(t) {
            if let Some(dst) = self.leaves.get(&c) {
                self.dev.upload(dst, 0, b.to_bf16().bytes())?;
            }
        }
        Ok(())
    }

    /// Issues one step: every launch on its stream, with the program's waits and records.
    /// Returns once issued; [`CudaProgram::synchronize`] waits for it.
    pub fn run(&mut self) -> Result<(), RuntimeError> {
        self.trace_start()?;
        let traced_exec = self
            .trace
            .as_ref()
            .filter(|t| t.armed)
            .and_then(|t| t.graph.map(|g| g.1));
        if let (Some(exec), Some(_)) = (traced_exec, self.graph) {
            let _range = nvtx::range("graph replay");
            self.start.record(&self.streams[0])?;
            // SAFETY: as below, for the traced copy of the step graph.
            unsafe { result::graph::launch(exec, self.streams[0].raw()) }.map_err(|e| {
                RuntimeError::Device(format!("launching the traced step graph: {e:?}"))
            })?;
            return self.end.record(&self.streams[0]);
        }
        if let Some((_, exec)) = self.graph {
            let _range = nvtx::range("graph replay");
            self.start.record(&self.streams[0])?;
            // SAFETY: `exec` is a live instantiated graph of this context; every buffer
            // it uses is owned by `self` and outlives the launch (drop synchronizes).
            unsafe { result::graph::launch(exec, self.streams[0].raw()) }
                .map_err(|e| RuntimeError::Device(format!("launching the step graph: {e:?}")))?;
            return self.end.record(&self.streams[0]);
        }
        if self.threaded {
            self.start.record(&self.streams[0])?;
            self.issue_threaded()?;
            return self.end.record(&self.streams[0]);
        }
        let all: Vec<usize> = (0..self.prog.launches.len()).collect();
        self.run_subset(&all)
    }

    /// Captures the whole step (every stream: pool streams fork from the main stream at
    /// the start and join it at the end) as one CUDA graph; later [`CudaProgram::run`]
    /// calls replay it with one launch. Returns the graph's kernel nodes, which must
    /// equal the launches the eager step issues.
    pub fn capture(&mut self) -> Result<usize, RuntimeError> {
        let (graph, exec, kernels) = self.capture_graph(false)?;
        self.graph = Some((graph, exec));
        Ok(kernels)
    }

    /// Captures the whole step into a new graph and instantiates it; `traced` records the
    /// trace marks as event-record nodes (see `cuda::trace`). Returns the graph, its
    /// executable and its kernel nodes.
    pub(crate) fn capture_graph(
        &mut self,
        traced: bool,
    ) -> Result<(sys::CUgraph, sys::CUgraphExec, usize), RuntimeError> {
        if let Some(t) = self.trace.as_mut() {
            t.capturing = traced;
        }
        if !traced {
            self.capture_nodes = Some(Vec::new());
        }
        let all: Vec<usize> = (0..self.prog.launches.len()).collect();
        let captured = self.capture_with("the step graph", |p| p.issue(&all));
        if let Some(t) = self.trace.as_mut() {
            t.capturing = false;
        }
        if !traced {
            self.graph_nodes = self.capture_nodes.take().unwrap_or_default();
        }
        let (graph, exec) = captured?;
        Ok((graph, exec, count_kernel_nodes(graph)?))
    }

    /// Captures what `issue` issues as one CUDA graph and instantiates it: the pool
    /// streams enter the capture through the main stream (`issue` joins them back, as
    /// every step does), and after the capture the program gets fresh events (those
    /// recorded during it became graph edges; eager launches, such as an evaluation's
    /// forward, need events of their own). `what` names the graph in errors.
    pub(crate) fn capture_with(
        &mut self,
        what: &str,
        issue: impl FnOnce(&mut Self) -> Result<(), RuntimeError>,
    ) -> Result<(sys::CUgraph, sys::CUgraphExec), RuntimeError> {
        let err =
            |doing: &str, e: result::DriverError| RuntimeError::Device(format!("{doing}: {e:?}"));
        self.streams[0].synchronize()?;
        let main = self.streams[0].raw();
        // SAFETY: `main` is a live stream; thread-local mode keeps other threads' calls
        // out of the capture.
        unsafe {
            result::stream::begin_capture(
                main,
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
        }
        .map_err(|e| err(&format!("beginning the capture of {what}"), e))?;
        // every pool stream enters the capture through the main stream
        let forked = (|| -> Result<(), RuntimeError> {
            self.join.record(&self.streams[0])?;
            for s in &self.streams[1..] {
                self.join.wait_on(s)?;
            }
            Ok(())
        })();
        let issued = forked.and_then(|()| issue(self));
        // SAFETY: ends the capture begun above on the same stream, even after an error.
        let graph = unsafe { result::stream::end_capture(main) };
        issued?;
        let graph = graph.map_err(|e| err(&format!("ending the capture of {what}"), e))?;
        // the kernel nodes keep the priority of the stream they were captured from (the
        // main stream's is the highest, the pool's the lowest): without USE_NODE_PRIORITY a
        // graph runs every node at the priority of the stream it is launched into, and the
        // forward waits behind early backward work (erase measured 1.4 % faster with it;
        // `graph_node_priority: false`, ERASE_GRAPH_NODE_PRIORITY=0, turns it off)
        let mut flags =
            sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH as u64;
        if self.dev.plan_options().graph_node_priority {
            flags |=
                sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY as u64;
        }
        let mut exec: sys::CUgraphExec = std::ptr::null_mut();
        // SAFETY: `graph` is the live graph just captured; `exec` is a live out-pointer.
        unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, flags) }
            .result()
            .map_err(|e| err(&format!("instantiating {what}"), e))?;
        self.events = (0..self.prog.events)
            .map(|_| self.dev.event(false))
            .collect::<Result<Vec<_>, _>>()?;
        self.join = self.dev.event(false)?;
        Ok((graph, exec))
    }

    /// Copies `batches` (each one buffer per tensor of `inputs`) to device memory, so that
    /// steps can take their inputs from there (as a benchmark that keeps data off the
    /// host's path does).
    pub fn stage(
        &mut self,
        inputs: &[Tensor],
        batches: &[Vec<Buffer>],
    ) -> Result<(), RuntimeError> {
        self.ring.clear();
        for b in batches {
            let mut bufs = Vec::new();
            for (&t, v) in inputs.iter().zip(b) {
                let d = self.dev.alloc(v.bytes().len())?;
                self.dev.upload(&d, 0, v.bytes())?;
                if v.bytes().len() != self.leaves.get(&t).map_or(0, |l| l.bytes()) {
                    return Err(RuntimeError::Feed {
                        tensor: self.g.name(t).to_string(),
                        msg: "staged batch has the wrong size".into(),
                    });
                }
                bufs.push(d);
            }
            self.ring.push(bufs);
        }
        self.ring_inputs = inputs.to_vec();
        Ok(())
    }

    /// Issues one step on staged batch `k` (modulo the ring): device-to-device copies into
    /// the input buffers on the main stream, then the step; records `mark` after it.
    /// Nothing waits on the host.
    pub fn run_staged(&mut self, k: usize, mark: &Event) -> Result<(), RuntimeError> {
        if self.ring.is_empty() {
            return Err(RuntimeError::Device(
                "no staged batches: call stage first".into(),
            ));
        }
        let slot = k % self.ring.len();
        for (j, t) in self.ring_inputs.iter().enumerate() {
            let (src, dst) = (&self.ring[slot][j], &self.leaves[t]);
            // SAFETY: both are live allocations of the same size (checked in `stage`); the
            // copy is ordered on the main stream before the step that reads it.
            unsafe {
                result::memcpy_dtod_async(dst.ptr(), src.ptr(), src.bytes(), self.streams[0].raw())
            }
            .map_err(|e| RuntimeError::Device(format!("staging copy: {e:?}")))?;
        }
        self.run()?;
        mark.record(&self.streams[0])
    }

    /// The kernel launches one eager step issues.
    pub fn kernel_launches(&self) -> usize {
        self.prepared.iter().map(|p| p.calls.len()).sum()
    }

    /// Issues the launches `which` (indices in issue order, a prefix-closed subset such
    /// as the forward launches) as [`CudaProgram::run`] does.
    pub fn run_subset(&mut self, which: &[usize]) -> Result<(), RuntimeError> {
        // the subset's own waits: the whole step's may order two of its launches only
        // through a launch left out
        let sub = match self.subset.take() {
            Some(sub) if sub.which == which => sub,
            _ => {
                let order = self.prog.restricted(which);
                let events = (0..order.events)
                    .map(|_| self.dev.event(false))
                    .collect::<Result<Vec<_>, _>>()?;
                Subset {
                    which: which.to_vec(),
                    order,
                    events,
                }
            }
        };
        self.start.record(&self.streams[0])?;
        let issued = self.issue_ordered(which, Some(&sub));
        self.subset = Some(sub);
        issued?;
        self.end.record(&self.streams[0])?;
        Ok(())
    }

    /// Threaded dispatch: the host thread issues the main stream's launches and a
    /// dispatcher thread those of the pool streams, both in schedule order. A wait is
    /// issued only after the other thread has issued the launch that records its event
    /// (waiting on an event not yet recorded would wait for nothing).
    pub fn set_threaded(&mut self, on: bool) {
        self.threaded = on;
    }

    fn issue_threaded(&self) -> Result<(), RuntimeError> {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let n = self.prog.launches.len();
        let recorder: Vec<Option<usize>> = {
            let mut r = vec![None; self.prog.events];
            for (i, l) in self.prog.launches.iter().enumerate() {
                if let Some(e) = l.record {
                    r[e.0 as usize] = Some(i);
                }
            }
            r
        };
        // progress[0]: launches of the main thread issued below this index; [1]: dispatcher's
        let progress = [AtomicUsize::new(0), AtomicUsize::new(0)];
        let failed = std::sync::atomic::AtomicBool::new(false);
        // only the parts the threads share (the graph handles stay on this thread)
        let (dev, prog, prepared, streams, events) = (
            self.dev,
            self.prog,
            &self.prepared,
            &self.streams,
            &self.events,
        );
        let trace = self.trace.as_ref().and_then(|t| t.active());
        let work = |me: usize| -> Result<(), RuntimeError> {
            if me == 1 {
                dev.bind()?;
                nvtx::name_os_thread("erase-dispatch");
            }
            let mut ranges = BlockRanges::new();
            for (i, l) in prog.launches.iter().enumerate() {
                let owner = usize::from(l.stream.0 != 0);
                if owner != me {
                    continue;
                }
                ranges.enter(&l.label);
                for w in &l.waits {
                    if let Some(r) = recorder[w.event.0 as usize] {
                        let other = usize::from(prog.launches[r].stream.0 != 0);
                        if other != me {
                            while progress[other].load(Ordering::Acquire) <= r {
                                if failed.load(Ordering::Relaxed) {
                                    return Err(RuntimeError::Device(
                                        "the other dispatch thread failed".into(),
                                    ));
                                }
                                std::thread::yield_now();
                            }
                        }
                    }
                    events[w.event.0 as usize].wait_on(&streams[l.stream.0 as usize])?;
                }
                let s = &streams[l.stream.0 as usize];
                let mark = crate::cuda::trace::mark_of(trace, i);
                if let Some((m, external)) = mark {
                    m.0.record_flagged(s, external)?;
                }
                for call in &prepared[i].calls {
                    dev.launch_prepared(call, s)?;
                }
                if let Some((m, external)) = mark {
                    m.1.record_flagged(s, external)?;
                }
                if let Some(e) = l.record {
                    events[e.0 as usize].record(s)?;
                }
                progress[me].store(i + 1, Ordering::Release);
            }
            drop(ranges);
            progress[me].store(n, Ordering::Release);
            Ok(())
        };
        two_dispatch_threads(&failed, &work)?;
        self.join_pool_streams()
    }

    /// Makes the main stream wait for everything issued on the pool streams, so that the
    /// step's end covers all of its work.
    pub(crate) fn join_pool_streams(&self) -> Result<(), RuntimeError> {
        for s in &self.streams[1..] {
            self.join.record(s)?;
            self.join.wait_on(&self.streams[0])?;
        }
        Ok(())
    }

    /// Issues launches and joins every pool stream into the main stream.
    fn issue(&mut self, which: &[usize]) -> Result<(), RuntimeError> {
        self.issue_ordered(which, None)
    }

    /// [`CudaProgram::issue`] with the waits and records of `sub` (`which` restricted),
    /// where given, instead of the whole program's.
    fn issue_ordered(&mut self, which: &[usize], sub: Option<&Subset>) -> Result<(), RuntimeError> {
        let mut ranges = BlockRanges::new();
        for (p, &i) in which.iter().enumerate() {
            let l = &self.prog.launches[i];
            let (order, events) = match sub {
                Some(sub) => (&sub.order.launches[p], &sub.events),
                None => (l, &self.events),
            };
            ranges.enter(&l.label);
            let s = &self.streams[l.stream.0 as usize];
            for w in &order.waits {
                events[w.event.0 as usize].wait_on(s)?;
            }
            let mark = self.trace.as_ref().and_then(|t| t.mark(i));
            if let Some((m, external)) = mark {
                m.0.record_flagged(s, external)?;
            }
            for call in &self.prepared[i].calls {
                self.dev.launch_prepared(call, s).map_err(|e| {
                    RuntimeError::Device(format!("'{}': {e}", self.g.node(l.node).name))
                })?;
                if let Some(nodes) = self.capture_nodes.as_mut() {
                    nodes.push((crate::cuda::graph::last_captured_node(s)?, i));
                }
            }
            if let Some((m, external)) = mark {
                m.1.record_flagged(s, external)?;
            }
            if let Some(e) = order.record {
                events[e.0 as usize].record(s)?;
            }
        }
        drop(ranges);
        // join every stream into main so the step's end covers all of its work
        self.join_pool_streams()
    }

    /// Waits for the last issued step; returns its time on the main stream in ms.
    pub fn synchronize(&self) -> Result<f32, RuntimeError> {
        self.end.synchronize()?;
        self.end.elapsed_ms_since(&self.start)
    }

    /// The value of a tensor now (after [`CudaProgram::synchronize`]).
    pub fn get(&self, t: Tensor) -> Result<Buffer, RuntimeError> {
        let ptr = self
            .tensor_ptr(t)
            .ok_or_else(|| RuntimeError::NotComputed(self.g.name(t).to_string()))?;
        let dt = self.g.dtype(t);
        let mut bytes = vec![0u8; self.g.shape(t).numel() * dt.size_bytes()];
        let (buf, off) = if self.leaves.contains_key(&t) {
            (&self.leaves[&t], 0)
        } else {
            (&self.arena, (ptr - self.arena.ptr()) as usize)
        };
        self.dev.download(buf, off, &mut bytes)?;
        Ok(buffer_from_bytes(dt, &bytes))
    }
}

/// The NVTX range of each run of consecutive launches of one block and phase, as one
/// thread issues them: `fwd:cross`, `bwd:cross`, `bwd:remainder`, `optim`.
struct BlockRanges<'p> {
    on: bool,
    open: Option<(&'p Label, nvtx::Range)>,
}

impl<'p> BlockRanges<'p> {
    fn new() -> Self {
        BlockRanges {
            on: nvtx::enabled(),
            open: None,
        }
    }

    /// Closes the open range unless `label` continues it, and opens `label`'s.
    fn enter(&mut self, label: &'p Label) {
        if !self.on {
            return;
        }
        if let Some((open, _)) = &self.open {
            if open.phase == label.phase && (open.phase == "optim" || open.block == label.block) {
                return;
            }
        }
        // close before opening: the ranges are a stack
        self.open = None;
        let name = if label.phase == "optim" {
            "optim".to_string()
        } else {
            format!("{}:{}", label.phase, label.block)
        };
        self.open = Some((label, nvtx::range(&name)));
    }
}

/// The kernel nodes of a captured graph.
fn kernel_nodes(graph: sys::CUgraph) -> Result<Vec<sys::CUgraphNode>, RuntimeError> {
    let err = |what: &str, e: result::DriverError| RuntimeError::Device(format!("{what}: {e:?}"));
    let mut n: usize = 0;
    // SAFETY: a null node array asks only for the count.
    unsafe { sys::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut n) }
        .result()
        .map_err(|e| err("counting graph nodes", e))?;
    let mut nodes = vec![std::ptr::null_mut(); n];
    // SAFETY: `nodes` has room for the `n` nodes the graph holds.
    unsafe { sys::cuGraphGetNodes(graph, nodes.as_mut_ptr(), &mut n) }
        .result()
        .map_err(|e| err("listing graph nodes", e))?;
    let mut kernels = Vec::with_capacity(n);
    for node in nodes {
        let mut t = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
        // SAFETY: `node` belongs to the live graph.
        unsafe { sys::cuGraphNodeGetType(node, &mut t) }
            .result()
            .map_err(|e| err("graph node type", e))?;
        if t == sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL {
            kernels.push(node);
        }
    }
    Ok(kernels)
}

fn count_kernel_nodes(graph: sys::CUgraph) -> Result<usize, RuntimeError> {
    Ok(kernel_nodes(graph)?.len())
}

/// (priority, kernel nodes) of a graph's kernel nodes, by priority.
pub(crate) fn node_priorities(graph: sys::CUgraph) -> Result<Vec<(i32, usize)>, RuntimeError> {
    let mut by = std::collections::BTreeMap::new();
    for node in kernel_nodes(graph)? {
        // SAFETY: all-zero bytes are a valid value of this plain-data union.
        let mut v: sys::CUlaunchAttributeValue = unsafe { std::mem::zeroed() };
        // SAFETY: `node` is a kernel node of the live graph; `v` is a live out-value.
        unsafe {
            sys::cuGraphKernelNodeGetAttribute(
                node,
                sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PRIORITY,
                &mut v,
            )
        }
        .result()
        .map_err(|e| RuntimeError::Device(format!("kernel node priority: {e:?}")))?;
        // SAFETY: the driver wrote the priority member.
        *by.entry(unsafe { v.priority }).or_insert(0) += 1;
    }
    Ok(by.into_iter().collect())
}

/// Runs `work(0)` on this thread and `work(1)` on a dispatcher thread (threaded
/// dispatch): a failure on either side sets `failed`, which the other side's waits watch,
/// and the first error is returned.
pub(crate) fn two_dispatch_threads(
    failed: &std::sync::atomic::AtomicBool,
    work: &(dyn Fn(usize) -> Result<(), RuntimeError> + Sync),
) -> Result<(), RuntimeError> {
    use std::sync::atomic::Ordering;
    let (a, b) = std::thread::scope(|sc| {
        let h = sc.spawn(|| {
            let r = work(1);
            if r.is_err() {
                failed.store(true, Ordering::Relaxed);
            }
            r
        });
        let a = work(0);
        if a.is_err() {
            failed.store(true, Ordering::Relaxed);
        }
        (
            a,
            h.join().unwrap_or_else(|_| {
                Err(RuntimeError::Device(
                    "the dispatcher thread panicked".into(),
                ))
            }),
        )
    });
    a?;
    b
}

impl Drop for CudaProgram<'_> {
    fn drop(&mut self) {
        let _ = self.streams[0].synchronize();
        if let Some((graph, exec)) = self.trace.as_mut().and_then(|t| t.graph.take()) {
            // SAFETY: created by `capture_graph`, destroyed once, after the last replay.
            unsafe {
                let _ = result::graph::exec_destroy(exec);
                let _ = result::graph::destroy(graph);
            }
        }
        if let Some((graph, exec)) = self.graph.take() {
            // SAFETY: created by `capture`, destroyed once, after the last replay finished.
            unsafe {
                let _ = result::graph::exec_destroy(exec);
                let _ = result::graph::destroy(graph);
            }
        }
    }
}
