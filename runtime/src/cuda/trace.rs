//! A measured kernel trace from CUDA events: a timing event recorded on the launch's own
//! stream just before and just after each launch of the step program, and around the
//! batch copies, all read against one reference event recorded on the main stream at the
//! start of the traced window.
//!
//! Eager dispatch records the marks as it issues. Graph dispatch replays a second copy of
//! the step graph, captured with the marks as event-record nodes (external records), so
//! each record belongs to its launch by construction: no attribution of the graph's
//! internal streams is needed. The marks cost a little (a traced step runs a few percent
//! slower than an untraced one); traced steps are left out of the throughput figures.

use crate::cuda::program::CudaProgram;
use crate::cuda::Event;
use crate::error::RuntimeError;
use crate::trace::MeasuredStep;
use cudarc::driver::sys;

/// A launch's (before, after) marks.
pub(crate) type Marks = (Event, Event);
/// The marks of the launches being traced, and whether they become graph nodes.
pub(crate) type ActiveMarks<'a> = Option<(&'a [Option<Marks>], bool)>;

pub(crate) struct TraceState {
    /// Per launch that issues kernels: (before, after).
    marks: Vec<Option<(Event, Event)>>,
    /// Whether steps issued now are traced.
    pub(crate) armed: bool,
    /// Whether the traced graph is being captured (marks become graph nodes).
    pub(crate) capturing: bool,
    /// Whether `t0` was recorded in this window.
    started: bool,
    t0: Event,
    /// The traced copy of the step graph (graph dispatch).
    pub(crate) graph: Option<(sys::CUgraph, sys::CUgraphExec)>,
    /// (before, after) of the batch's copy to the device (copy stream) and into the
    /// step's inputs (main stream), when the step came through the input pipeline.
    pub(crate) copies: [(Event, Event); 2],
    pub(crate) copies_recorded: bool,
}

impl TraceState {
    /// The marks of launch `i` when it is to be traced, and whether they are recorded as
    /// graph nodes.
    pub(crate) fn mark(&self, i: usize) -> Option<(&(Event, Event), bool)> {
        mark_of(self.active(), i)
    }

    /// The marks when steps issued now are traced, and whether they become graph nodes.
    pub(crate) fn active(&self) -> ActiveMarks<'_> {
        (self.armed || self.capturing).then_some((&self.marks[..], self.capturing))
    }
}

/// Launch `i`'s marks out of [`TraceState::active`]'s answer.
pub(crate) fn mark_of(active: ActiveMarks<'_>, i: usize) -> Option<(&Marks, bool)> {
    let (marks, external) = active?;
    marks.get(i).and_then(|m| m.as_ref()).map(|m| (m, external))
}

impl CudaProgram<'_> {
    /// Turns tracing on or off for the steps issued from now on. The first time on, this
    /// makes the events and, under graph dispatch, captures the traced graph. Turning it
    /// on starts a new window (times count from its first traced step).
    pub fn set_tracing(&mut self, on: bool) -> Result<(), RuntimeError> {
        let all: Vec<usize> = (0..self.prepared.len()).collect();
        self.set_tracing_of(on, &all)
    }

    /// Like [`CudaProgram::set_tracing`], with marks around the launches `which` only (a
    /// few marks cost next to nothing, e.g. the end of the forward and the start of the
    /// optimizer for phase times). Launches marked before stay marked.
    pub fn set_tracing_of(&mut self, on: bool, which: &[usize]) -> Result<(), RuntimeError> {
        let wanted = |i: usize, has: bool| has || which.contains(&i);
        let widen = match &self.trace {
            None => on,
            Some(t) => {
                on && which.iter().any(|&i| {
                    t.marks.get(i).is_some_and(|m| m.is_none())
                        && !self.prepared[i].calls.is_empty()
                })
            }
        };
        if widen {
            let ev = || self.dev.event(true);
            let mut old = self.trace.take();
            let mut marks = Vec::with_capacity(self.prepared.len());
            for (i, p) in self.prepared.iter().enumerate() {
                let had = old
                    .as_mut()
                    .and_then(|t| t.marks.get_mut(i).and_then(|m| m.take()));
                marks.push(match had {
                    Some(m) => Some(m),
                    None if !p.calls.is_empty() && wanted(i, false) => Some((ev()?, ev()?)),
                    None => None,
                });
            }
            if let Some((graph, exec)) = old.as_mut().and_then(|t| t.graph.take()) {
                self.streams[0].synchronize()?;
                // SAFETY: the traced graph of the narrower set, destroyed once, after the
                // stream that replays it has finished.
                unsafe {
                    let _ = cudarc::driver::result::graph::exec_destroy(exec);
                    let _ = cudarc::driver::result::graph::destroy(graph);
                }
            }
            self.trace = Some(TraceState {
                marks,
                armed: false,
                capturing: false,
                started: false,
                t0: ev()?,
                graph: None,
                copies: [(ev()?, ev()?), (ev()?, ev()?)],
                copies_recorded: false,
            });
            if self.graph.is_some() {
                let (graph, exec, _) = self.capture_graph(true)?;
                if let Some(t) = self.trace.as_mut() {
                    t.graph = Some((graph, exec));
                }
            }
        }
        if let Some(t) = self.trace.as_mut() {
            if on && !t.armed {
                t.started = false;
            }
            t.armed = on;
        }
        Ok(())
    }

    /// Records the window's reference event on the main stream before the first traced
    /// work (no-op when not tracing or already started).
    pub(crate) fn trace_start(&mut self) -> Result<(), RuntimeError> {
        if let Some(t) = self.trace.as_mut() {
            if t.armed && !t.started {
                t.t0.record(&self.streams[0])?;
                t.started = true;
                t.copies_recorded = false;
            }
        }
        Ok(())
    }

    /// The times of the last traced step, once it has finished (after
    /// [`CudaProgram::synchronize`] or the pipeline's read-back).
    pub fn traced_step(&self) -> Result<MeasuredStep, RuntimeError> {
        let t = self.trace.as_ref().filter(|t| t.started).ok_or_else(|| {
            RuntimeError::Device("no traced step: call set_tracing(true) and run a step".into())
        })?;
        let at = |e: &Event| -> Result<f64, RuntimeError> {
            Ok(f64::from(e.elapsed_ms_since(&t.t0)?) * 1e-3)
        };
        let mut launches = Vec::with_capacity(t.marks.len());
        for m in &t.marks {
            launches.push(match m {
                Some((a, b)) => (at(a)?, at(b)?),
                None => (f64::NAN, f64::NAN),
            });
        }
        let mut copies = Vec::new();
        if t.copies_recorded {
            for (what, (a, b)) in ["h2d batch", "d2d inputs"].into_iter().zip(&t.copies) {
                copies.push((what, at(a)?, at(b)?));
            }
        }
        Ok(MeasuredStep { launches, copies })
    }
}
