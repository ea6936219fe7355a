//! What a captured step graph orders: its dependency edges (`cuGraphGetEdges`), mapped back
//! to the step program's launches, so that a test can compare the graph's happens-before
//! with the program's own (same-stream order plus the event edges of the schedule).

use cudarc::driver::sys;

use crate::cuda::program::CudaProgram;
use crate::cuda::Stream;
use crate::error::RuntimeError;
use crate::program::schedule::StepProgram;

fn err(what: &str, e: cudarc::driver::result::DriverError) -> RuntimeError {
    RuntimeError::Device(format!("{what}: {e:?}"))
}

/// The node a capturing stream added last (its one capture dependency right after a
/// launch).
pub(crate) fn last_captured_node(s: &Stream) -> Result<sys::CUgraphNode, RuntimeError> {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    let mut deps: *const sys::CUgraphNode = std::ptr::null();
    let mut edge_data: *const sys::CUgraphEdgeData = std::ptr::null();
    let mut n: usize = 0;
    // SAFETY: out-pointers to live locals; the optional id and graph outputs are null (not
    // wanted); `deps` and `edge_data` point into the driver's storage, valid until the next
    // call on this stream, and only `deps` is read, at once below. The edge data is asked
    // for (and ignored) because a programmatic launch's edges carry some, and the driver
    // refuses a query that would drop it.
    unsafe {
        sys::cuStreamGetCaptureInfo_v3(
            s.raw(),
            &mut status,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            &mut deps,
            &mut edge_data,
            &mut n,
        )
    }
    .result()
    .map_err(|e| err("asking the capture for its last node", e))?;
    if status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE || n != 1 {
        return Err(RuntimeError::Device(format!(
            "a launch during capture left {n} dependencies (status {status:?}); expected its one node"
        )));
    }
    // SAFETY: the driver returned `n == 1` valid entries at `deps`.
    Ok(unsafe { *deps })
}

/// For every pair of launches `(a, b)` (indices into the program): whether `b` is ordered
/// after `a`. Launches that issue no kernel (aliases) are `None`.
pub struct Reachability {
    pub after: Vec<Option<Vec<bool>>>,
}

impl Reachability {
    /// Whether launch `b` must wait for launch `a` (both issue kernels).
    pub fn ordered(&self, a: usize, b: usize) -> Option<bool> {
        self.after.get(a)?.as_ref().map(|v| v[b])
    }
}

/// The program's own order: each stream's launches in issue order, plus an edge from
/// the launch that records an event to every launch that waits on it. `kernels[i]` says
/// whether launch `i` issues any kernel (others are left out of the result, but order
/// still flows through them).
pub fn program_reachability(prog: &StepProgram, kernels: &[bool]) -> Reachability {
    let n = prog.launches.len();
    let mut preds: Vec<Vec<usize>> = vec![Vec::new(); n];
    let mut last_on: Vec<Option<usize>> = vec![None; prog.streams];
    let mut recorder = vec![None; prog.events];
    for (i, l) in prog.launches.iter().enumerate() {
        let s = l.stream.0 as usize;
        if let Some(p) = last_on[s] {
            preds[i].push(p);
        }
        for w in &l.waits {
            if let Some(r) = recorder[w.event.0 as usize] {
                preds[i].push(r);
            }
        }
        if let Some(e) = l.record {
            recorder[e.0 as usize] = Some(i);
        }
        last_on[s] = Some(i);
    }
    // issue order is a topological order: ancestors[i] = union of preds' ancestors
    let mut anc: Vec<Vec<bool>> = Vec::with_capacity(n);
    for p in &preds {
        let mut a = vec![false; n];
        for &q in p {
            a[q] = true;
            for (x, &y) in a.iter_mut().zip(&anc[q]) {
                *x |= y;
            }
        }
        anc.push(a);
    }
    to_reachability(&anc, kernels)
}

fn to_reachability(anc: &[Vec<bool>], kernels: &[bool]) -> Reachability {
    let n = anc.len();
    let mut after: Vec<Option<Vec<bool>>> =
        (0..n).map(|i| kernels[i].then(|| vec![false; n])).collect();
    for b in 0..n {
        if !kernels[b] {
            continue;
        }
        for a in 0..n {
            if anc[b][a] {
                if let Some(v) = after[a].as_mut() {
                    v[b] = true;
                }
            }
        }
    }
    Reachability { after }
}

impl CudaProgram<'_> {
    /// (priority, kernel nodes) of the captured graph's kernel nodes, most urgent (lowest
    /// number) first: a node keeps the priority of the stream it was captured from.
    pub fn kernel_node_priorities(&self) -> Result<Vec<(i32, usize)>, RuntimeError> {
        let Some((graph, _)) = self.graph else {
            return Err(RuntimeError::Device(
                "no captured graph: call capture first".into(),
            ));
        };
        crate::cuda::program::node_priorities(graph)
    }

    /// The captured graph's order between launches, from its dependency edges: launch `b`
    /// is after `a` when a path of edges leads from a node of `a` to a node of `b`.
    pub fn captured_order(&self) -> Result<Reachability, RuntimeError> {
        let Some((graph, _)) = self.graph else {
            return Err(RuntimeError::Device(
                "no captured graph: call capture first".into(),
            ));
        };
        let mut n: usize = 0;
        // SAFETY: null arrays ask for the number of edges only.
        unsafe {
            sys::cuGraphGetEdges_v2(
                graph,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                &mut n,
            )
        }
        .result()
        .map_err(|e| err("counting the graph's edges", e))?;
        let mut from = vec![std::ptr::null_mut(); n];
        let mut to = vec![std::ptr::null_mut(); n];
        // the edges' data (a programmatic launch's edges have some: the driver refuses to
        // list them without it); an edge of either type orders its nodes
        // SAFETY: all-zero bytes are a valid `CUgraphEdgeData` (plain integers).
        let mut data: Vec<sys::CUgraphEdgeData> = vec![unsafe { std::mem::zeroed() }; n];
        // SAFETY: all three arrays hold `n` entries.
        unsafe {
            sys::cuGraphGetEdges_v2(
                graph,
                from.as_mut_ptr(),
                to.as_mut_ptr(),
                data.as_mut_ptr(),
                &mut n,
            )
        }
        .result()
        .map_err(|e| err("listing the graph's edges", e))?;
        // every graph node gets an index; kernel nodes know their launch
        let mut index: std::collections::HashMap<usize, usize> = Default::default();
        let mut id = |p: sys::CUgraphNode| {
            let k = index.len();
            *index.entry(p as usize).or_insert(k)
        };
        let edges: Vec<(usize, usize)> = from
            .iter()
            .zip(&to)
            .map(|(&a, &b)| (id(a), id(b)))
            .collect();
        for &(node, _) in &self.graph_nodes {
            id(node);
        }
        let nodes = index.len();
        let launch_of: Vec<Option<usize>> = {
            let mut v = vec![None; nodes];
            for &(node, l) in &self.graph_nodes {
                v[index[&(node as usize)]] = Some(l);
            }
            v
        };
        // node reachability by a topological sweep (Kahn's algorithm)
        let mut succ = vec![Vec::new(); nodes];
        let mut indeg = vec![0usize; nodes];
        for &(a, b) in &edges {
            succ[a].push(b);
            indeg[b] += 1;
        }
        let mut order = Vec::with_capacity(nodes);
        let mut ready: Vec<usize> = (0..nodes).filter(|&x| indeg[x] == 0).collect();
        while let Some(x) = ready.pop() {
            order.push(x);
            for &y in &succ[x] {
                indeg[y] -= 1;
                if indeg[y] == 0 {
                    ready.push(y);
                }
            }
        }
        if order.len() != nodes {
            return Err(RuntimeError::Device(
                "the captured graph has a cycle".into(),
            ));
        }
        let launches = self.prog.launches.len();
        // per node: the launches ordered before it (through any path)
        let mut before: Vec<Vec<bool>> = vec![vec![false; launches]; nodes];
        let mut preds = vec![Vec::new(); nodes];
        for &(a, b) in &edges {
            preds[b].push(a);
        }
        for &x in &order {
            let mut acc = vec![false; launches];
            for &p in &preds[x] {
                if let Some(l) = launch_of[p] {
                    acc[l] = true;
                }
                for (u, &v) in acc.iter_mut().zip(&before[p]) {
                    *u |= v;
                }
            }
            before[x] = acc;
        }
        let kernels: Vec<bool> = (0..launches)
            .map(|i| self.graph_nodes.iter().any(|&(_, l)| l == i))
            .collect();
        let mut anc = vec![vec![false; launches]; launches];
        for (x, &l) in launch_of.iter().enumerate() {
            if let Some(l) = l {
                for (u, &v) in anc[l].iter_mut().zip(&before[x]) {
                    *u |= v;
                }
            }
        }
        // a launch's own nodes (split-K and its reduction) are not an order between launches
        for (l, a) in anc.iter_mut().enumerate() {
            a[l] = false;
        }
        Ok(to_reachability(&anc, &kernels))
    }

    /// Which launches issue at least one kernel.
    pub fn kernel_mask(&self) -> Vec<bool> {
        self.prepared.iter().map(|p| !p.calls.is_empty()).collect()
    }
}
