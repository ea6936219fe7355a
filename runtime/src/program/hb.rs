//! The happens-before checker. From the step program alone (stream order plus events,
//! as vector clocks) and the memory plan, every pair of launches that touch overlapping
//! bytes, one of them writing, must be ordered. Each unordered pair is reported with both
//! launches' labels. Persistent tensors (parameters, optimizer state) and fed inputs are
//! checked too, each as its own buffer.

use std::collections::BTreeMap;
use std::fmt;

use crate::program::memory::{alias_root, is_alias, MemoryPlan};
use crate::program::schedule::{
    happens_before, vector_clocks, EdgeKind, EventId, StepProgram, Wait,
};
use erase_graph::{Graph, Tensor};

/// Two launches that may run in either order, or at once, on overlapping bytes.
#[derive(Clone, Debug, PartialEq)]
pub struct Hazard {
    pub first: usize,
    pub second: usize,
    pub detail: String,
}

impl fmt::Display for Hazard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "launches {} and {}: {}",
            self.first, self.second, self.detail
        )
    }
}

#[derive(Clone, Copy, Debug)]
struct Access {
    launch: usize,
    region: usize,
    start: usize,
    end: usize,
    write: bool,
    tensor: Tensor,
}

/// Two consecutive steps of `p`: the second step's launches follow the first's on every
/// stream, with their own events, and the second step's first launch on the main stream
/// waits for every stream's last launch of the first: every executor joins the pool
/// streams into the main stream at the end of a step (as a CUDA graph must before its
/// capture ends). Work a step leaves unordered with that join's far side meets the next
/// step here.
fn two_steps(p: &StepProgram) -> StepProgram {
    let mut q = p.clone();
    let mut events = 2 * p.events as u32;
    let mut join = Vec::new();
    for s in 1..p.streams {
        let Some(last) = p.launches.iter().rposition(|l| l.stream.0 as usize == s) else {
            continue;
        };
        let e = *q.launches[last].record.get_or_insert_with(|| {
            events += 1;
            EventId(events - 1)
        });
        join.push(Wait {
            event: e,
            kind: EdgeKind::Join,
            why: format!("the end of the step joins side{s}"),
        });
    }
    let shift = p.events as u32;
    let mut first_main = true;
    for l in &p.launches {
        let mut l = l.clone();
        l.record = l.record.map(|e| EventId(e.0 + shift));
        for w in &mut l.waits {
            w.event = EventId(w.event.0 + shift);
        }
        if first_main && l.stream.0 == 0 {
            first_main = false;
            l.waits.append(&mut join);
        }
        q.launches.push(l);
    }
    q.events = events as usize;
    q
}

/// Checks `p` with `plan` over two consecutive steps; returns every hazard found (empty =
/// the plan is safe). Launch indices at or above `p.launches.len()` are the next step's.
pub fn check(g: &Graph, p: &StepProgram, plan: &MemoryPlan) -> Vec<Hazard> {
    let p = &two_steps(p);
    let mut hazards = Vec::new();
    // an event must be recorded (in issue order) before anyone waits for it: waiting on
    // an event not yet recorded waits for nothing
    let mut recorded: BTreeMap<EventId, usize> = BTreeMap::new();
    for (i, l) in p.launches.iter().enumerate() {
        for w in &l.waits {
            if !recorded.contains_key(&w.event) {
                hazards.push(Hazard {
                    first: i,
                    second: i,
                    detail: format!(
                        "{} waits for event e{} before it is recorded",
                        l.label, w.event.0
                    ),
                });
            }
        }
        if let Some(e) = l.record {
            recorded.insert(e, i);
        }
    }

    let arena: BTreeMap<Tensor, ()> = plan.place.keys().map(|&t| (t, ())).collect();
    let mut acc: Vec<Access> = Vec::new();
    for (i, l) in p.launches.iter().enumerate() {
        if is_alias(g, l.node) && plan.get(g.node(l.node).outputs[0]).is_some() {
            continue;
        }
        let n = g.node(l.node);
        let mut add = |t: Tensor, write: bool| {
            let bytes = g.shape(t).numel() * g.dtype(t).size_bytes();
            let (region, start) = match plan.get(alias_root(g, &arena, t)) {
                Some(pl) => (0, pl.offset),
                None => (1 + t.index(), 0),
            };
            acc.push(Access {
                launch: i,
                region,
                start,
                end: start + bytes,
                write,
                tensor: t,
            });
        };
        for &t in &n.inputs {
            add(t, false);
        }
        for &t in n.outputs.iter().chain(&n.updates) {
            add(t, true);
        }
    }
    let clocks = vector_clocks(p);
    acc.sort_by_key(|a| (a.region, a.start, a.launch));
    // sweep: accesses sorted by start; compare with those still open
    let mut open: Vec<Access> = Vec::new();
    for a in acc {
        open.retain(|o| o.region == a.region && o.end > a.start);
        for o in &open {
            if o.launch == a.launch || !(o.write || a.write) {
                continue;
            }
            let (x, y) = (o.launch.min(a.launch), o.launch.max(a.launch));
            if !(happens_before(p, &clocks, x, y) || happens_before(p, &clocks, y, x)) {
                let name = |acc: &Access| {
                    format!(
                        "{} '{}'",
                        if acc.write { "writes" } else { "reads" },
                        g.name(acc.tensor)
                    )
                };
                hazards.push(Hazard {
                    first: x,
                    second: y,
                    detail: format!(
                        "{} ({}) {} and {} ({}) {} overlap with no order between them",
                        p.launches[o.launch].label,
                        p.launches[o.launch].stream,
                        name(o),
                        p.launches[a.launch].label,
                        p.launches[a.launch].stream,
                        name(&a)
                    ),
                });
            }
        }
        open.push(a);
    }
    hazards.sort_by_key(|h| (h.first, h.second));
    hazards.dedup_by_key(|h| (h.first, h.second));
    hazards
}
