//! The schedule simulator: replays a step program on the occupancy model's cost
//! estimates with stream semantics (in order within a stream, events across streams).
//! Kernels that run at once share the device: while the footprints of the running
//! kernels add up to more than the whole device, each progresses at its share. This is
//! how we plan past the machines we have: more streams, other devices.

use crate::occupancy::DeviceModel;
use crate::schedule::{EventId, StepProgram};
use std::collections::BTreeMap;

#[derive(Clone, Debug, PartialEq)]
pub struct SimConfig {
    pub device: DeviceModel,
    /// Host time to issue one launch (0 for a replayed CUDA graph).
    pub host_per_launch_s: f64,
}

/// A predicted launch: when it starts and ends, in seconds from the step's start.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SimLaunch {
    pub start: f64,
    pub end: f64,
}

#[derive(Clone, Debug, PartialEq)]
pub struct SimResult {
    pub step_s: f64,
    pub launches: Vec<SimLaunch>,
    /// Per stream: seconds with at least one of its launches running.
    pub busy_s: Vec<f64>,
}

/// Simulates one step of `p`.
pub fn simulate(p: &StepProgram, cfg: &SimConfig) -> SimResult {
    let n = p.launches.len();
    let work: Vec<f64> = p
        .launches
        .iter()
        .map(|l| l.spec.as_ref().map_or(0.0, |s| cfg.device.duration_s(s)))
        .collect();
    let foot: Vec<f64> = p
        .launches
        .iter()
        .map(|l| l.spec.as_ref().map_or(0.0, |s| cfg.device.footprint(s)))
        .collect();
    let recorder: BTreeMap<EventId, usize> = p
        .launches
        .iter()
        .enumerate()
        .filter_map(|(i, l)| l.record.map(|e| (e, i)))
        .collect();
    let queues: Vec<Vec<usize>> = (0..p.streams)
        .map(|s| p.on_stream(crate::schedule::StreamId(s as u16)).collect())
        .collect();
    let mut head = vec![0usize; p.streams];
    let mut done = vec![false; n];
    let mut out = vec![
        SimLaunch {
            start: 0.0,
            end: 0.0
        };
        n
    ];
    let mut remaining = work.clone();
    let mut running: Vec<usize> = Vec::new();
    let mut t = 0.0f64;
    let mut finished = 0;
    while finished < n {
        // start everything that can start now, in issue order
        let mut started = true;
        while started {
            started = false;
            for s in 0..p.streams {
                let Some(&i) = queues[s].get(head[s]) else {
                    continue;
                };
                if running
                    .iter()
                    .any(|&r| p.launches[r].stream.0 as usize == s)
                {
                    continue;
                }
                let issued = i as f64 * cfg.host_per_launch_s;
                let deps_done = p.launches[i]
                    .waits
                    .iter()
                    .all(|w| recorder.get(&w.event).is_none_or(|&r| done[r]));
                if deps_done && issued <= t + 1e-15 {
                    out[i].start = t;
                    head[s] += 1;
                    if remaining[i] <= 0.0 {
                        done[i] = true;
                        finished += 1;
                        out[i].end = t;
                    } else {
                        running.push(i);
                    }
                    started = true;
                }
            }
        }
        if finished == n {
            break;
        }
        // advance to the next completion (or the next issue time)
        let total: f64 = running.iter().map(|&r| foot[r]).sum();
        let rate = if total > 1.0 { 1.0 / total } else { 1.0 };
        let next_done = running
            .iter()
            .map(|&r| remaining[r] / rate)
            .fold(f64::INFINITY, f64::min);
        let next_issue = (0..p.streams)
            .filter_map(|s| queues[s].get(head[s]))
            .map(|&i| i as f64 * cfg.host_per_launch_s)
            .filter(|&x| x > t + 1e-15)
            .fold(f64::INFINITY, f64::min);
        let dt = next_done.min(next_issue);
        if !dt.is_finite() {
            // nothing runs and nothing can start: a wait that is never satisfied
            break;
        }
        t += dt;
        running.retain(|&r| {
            remaining[r] -= dt * rate;
            if remaining[r] <= 1e-15 {
                done[r] = true;
                out[r].end = t;
                finished += 1;
                false
            } else {
                true
            }
        });
    }
    let mut busy_s = vec![0.0; p.streams];
    for s in 0..p.streams {
        busy_s[s] = queues[s].iter().map(|&i| out[i].end - out[i].start).sum();
    }
    let step_s = out.iter().map(|l| l.end).fold(0.0, f64::max);
    SimResult {
        step_s,
        launches: out,
        busy_s,
    }
}
