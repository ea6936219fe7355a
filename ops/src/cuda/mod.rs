//! How each op runs on a CUDA device: the kernel launches it takes, with their grids,
//! blocks, shared memory and arguments. The runtime resolves the operand arguments to
//! device pointers and issues the launches in order on one stream.
//!
//! GPU tensors are f32 (and i32 for ids); GEMM and attention kernels round their operands
//! to bf16 as they load them and accumulate in f32, as the spec's mixed precision asks.

pub(crate) use crate::family::attention::cuda as attention;
pub(crate) mod common;
pub(crate) use crate::family::elementwise::cuda as elementwise;
pub(crate) use crate::family::embedding::cuda as embedding;
pub(crate) use crate::family::gemm::cuda as gemm;
pub(crate) use crate::family::interaction::cuda as interaction;
pub(crate) use crate::family::loss::cuda as loss;
pub(crate) use crate::family::norm::cuda as norm;
pub(crate) use crate::family::optim::cuda as optim;
#[cfg(test)]
mod plan_tests;
pub(crate) use crate::family::reduce::cuda as reduce;
pub(crate) use crate::family::shape::cuda as shape;

pub use crate::dispatch::cuda_plan;
use erase_graph::{DType, Shape};

/// One argument of a kernel launch.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KArg {
    /// Device pointer to the node's input `i`.
    In(usize),
    /// Device pointer `bytes` into the node's input `i` (a part of a packed tensor).
    InAt(usize, u64),
    /// Device pointer to the node's output `i`.
    Out(usize),
    /// Device pointer `bytes` into the node's output `i`.
    OutAt(usize, u64),
    /// Device pointer to the node's updated (persistent) tensor `i`.
    Upd(usize),
    /// Device pointer to the node's scratch buffer `i` (see [`CudaPlan::scratch`]).
    Scratch(usize),
    /// Device pointer `bytes` into the node's scratch buffer `i`.
    ScratchAt(usize, u64),
    I32(i32),
    U32(u32),
    I64(i64),
    F32(f32),
    /// A TMA descriptor (the driver's `CUtensorMap`, 128 bytes, passed by value) of a
    /// bf16 matrix, encoded by the runtime from the operand's pointer (see [`TmaMatrix`]).
    TensorMap(TmaMatrix),
}

/// A row-major bf16 matrix as the TMA kernels read it: `outer` rows of `inner` elements,
/// `ld` elements apart, at `base`; in boxes of 64 x 64 elements stored with the 128-byte
/// swizzle, elements past either extent read as zeros. The base must be 16-byte aligned
/// and `ld` a multiple of 8 (the plans check).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TmaMatrix {
    pub base: TmaBase,
    pub inner: u64,
    pub outer: u64,
    pub ld: u64,
}

/// The tensor a [`TmaMatrix`] starts at (a pointer argument's kinds).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum TmaBase {
    In(usize),
    Out(usize),
    Scratch(usize),
}

impl TmaBase {
    /// The base as the pointer argument it resolves like.
    pub fn karg(self) -> KArg {
        match self {
            TmaBase::In(i) => KArg::In(i),
            TmaBase::Out(i) => KArg::Out(i),
            TmaBase::Scratch(i) => KArg::Scratch(i),
        }
    }

    /// The base of a pointer argument at the start of its tensor, else `None`.
    pub fn of(a: KArg) -> Option<TmaBase> {
        match a {
            KArg::In(i) | KArg::InAt(i, 0) => Some(TmaBase::In(i)),
            KArg::Out(i) | KArg::OutAt(i, 0) => Some(TmaBase::Out(i)),
            KArg::Scratch(i) | KArg::ScratchAt(i, 0) => Some(TmaBase::Scratch(i)),
            _ => None,
        }
    }
}

/// One kernel launch.
#[derive(Clone, Debug, PartialEq)]
pub struct KernelCall {
    /// The `extern "C"` name of the kernel in `kernels-cuda/`.
    pub kernel: &'static str,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    /// Dynamic shared memory, bytes.
    pub smem: u32,
    pub args: Vec<KArg>,
}

/// The launches of one node, issued in order on one stream.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct CudaPlan {
    pub calls: Vec<KernelCall>,
    /// Bytes of each scratch buffer the calls use (contents undefined at the start; a
    /// call that needs zeros clears it itself).
    pub scratch: Vec<usize>,
}

impl CudaPlan {
    /// The launch that stands for the op in the cost model: the widest call that is not
    /// a helper pass around the op's own kernel (the pipelined GEMM's operand rounding, a
    /// split-K reduction; each family lists its helpers), else the widest of all.
    pub fn main_call(&self) -> Option<&KernelCall> {
        let size = |c: &&KernelCall| {
            u64::from(c.grid[0])
                * u64::from(c.grid[1])
                * u64::from(c.grid[2])
                * u64::from(c.block[0] * c.block[1] * c.block[2])
        };
        self.calls
            .iter()
            .filter(|c| !gemm::HELPERS.contains(&c.kernel))
            .max_by_key(size)
            .or_else(|| self.calls.iter().max_by_key(size))
    }
}

/// Shapes and element types of a node's operands, and the options the plan follows.
#[derive(Clone, Copy, Debug)]
pub struct Operands<'a> {
    pub ins: &'a [&'a Shape],
    pub in_dtypes: &'a [DType],
    pub outs: &'a [&'a Shape],
    pub out_dtypes: &'a [DType],
    pub upd: &'a [&'a Shape],
    pub opts: PlanOptions,
}

/// How the plans choose among kernels: a value, so that a plan is a function of its
/// operands and these. The defaults are the fastest measured on an H200; the switches
/// exist to compare paths on a model (`--kernel-paths` of `erase-ctr train`/`bench`, or the
/// environment variables of [`PlanOptions::with_env`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlanOptions {
    /// Streaming multiprocessors of the device: grids and tiles are sized by it (and
    /// the column sums' row slices, so it is part of their summation order).
    pub sms: usize,
    /// Large GEMMs round their operands to bf16 first and run the pipelined kernels
    /// (`false`: every GEMM on the single-launch kernels).
    pub gemm_pipeline: bool,
    /// A split pipelined 128x128 GEMM sums its splits inside a thread-block cluster
    /// (`false`: partials and a reduction launch).
    pub gemm_cluster: bool,
    /// Tall GEMMs run the persistent `gemm_tall_n*` kernels (`false`: the others).
    pub gemm_tall: bool,
    /// The tall kernels store from the fragments instead of through shared memory.
    pub gemm_tall_store_direct: bool,
    /// Nodes of a captured graph get the priority of their stream's rank.
    pub graph_node_priority: bool,
    /// The pipelined GEMMs' tile: `None`, the wave model's choice for each GEMM; `Some`,
    /// that tile for every one (to compare them on a model).
    pub gemm_tile: Option<GemmTile>,
    /// The warp-specialized pipelined tiles (`gemm_bf16w_*`: one warpgroup loads, two
    /// multiply, no CTA barrier in the main loop; sm_90a only) are among the wave model's
    /// candidates. A device running the sm_80 PTX turns it off.
    pub gemm_ws: bool,
    /// The pipelined GEMMs of batch 1 (unsplit, or split in a cluster) load their operands
    /// through the tensor memory accelerator (`gemm_bf16t_*`: one thread issues a stage,
    /// mbarriers instead of a CTA barrier a k step; sm_90a only). A device running the
    /// sm_80 PTX turns it off.
    pub gemm_tma: bool,
    /// The launches whose GEMMs may take the TMA kernels' 128x64 tile (with `gemm_tma`;
    /// `gemm_bf16t*_128x64`: 256 threads, 4 stages, two CTAs an SM), which the wave model
    /// chooses where the 128x128 grid leaves SMs idle (the CTR model's 4096 x 256
    /// outputs: 64 CTAs of 128x128 on 132 SMs, 128 of 128x64). A plan without a launch
    /// (one op alone) takes it where the set is [`LaunchSet::ALL`]; a step's launches ask
    /// [`PlanOptions::at_launch`]. On the H200 the serial programs' launches
    /// ([`LaunchSet::SERIAL`]): the CTR model's baseline step 3 % faster; under ERASE,
    /// where the early backward's GEMMs share the device with the forward, the wider grids
    /// made the step 0.3-1.9 % slower whichever launches took them (BENCHMARKS.md).
    pub gemm_tma_n64: LaunchSet,
    /// Fewest k one split of a single-launch GEMM gets (the split-K of small outputs with
    /// a long K: weight gradients over the batch's rows).
    pub gemm_min_k_per_split: usize,
    /// The same for an output of at most [`FEW_TILES`] 64x64 tiles (a weight gradient of
    /// a narrow layer), which splits its K far more to fill the device.
    pub gemm_min_k_per_split_few: usize,
    /// Fewest k one split of a pipelined GEMM gets (1024 on the H200: a weight gradient
    /// over 4096 rows in 4 splits, not 8; under ERASE the early backward's weight gradients
    /// share the device with the forward, and fewer CTAs each made the CTR step 4.8 %
    /// faster, 2048 or 4096 less so; see BENCHMARKS.md).
    pub gemm_pipe_min_k_per_split: usize,
    /// The split-K bounds of the launches of overlapped programs (ERASE's: not serial,
    /// [`LaunchAt::serial`]), which replace the three above there; `None`: the same
    /// bounds everywhere. On the H200 a single-launch split gets at least 1024 k (64 ->
    /// 256 for narrow outputs) and a pipelined one 2048: under ERASE the early backward's
    /// weight gradients share a full device with the forward, and fewer splits made the
    /// CTR step 2.8 % faster, while the serial step, which has the device to itself, is
    /// 7.1 % slower with them (BENCHMARKS.md). Those are the bounds of a step of 4096
    /// examples; a larger step scales them ([`SplitBounds::for_examples`]: at 16384, 4x,
    /// 2.0-2.2 % faster there than the 4096 bounds).
    pub gemm_overlapped_splits: Option<SplitBounds>,
    /// Fewest FLOPs (2·M·N·K·batch) for which a GEMM takes the pipelined path (its
    /// operands rounded to bf16 by separate launches); smaller ones run the single-launch
    /// kernels. 2^29 on the H200: the CTR model's mid-size layers (4096 x 256, K = 351 or
    /// 512) are 10-25 % faster pipelined; at 2^28 its 2^28-FLOP ones were slower.
    pub gemm_pipe_min_flops: usize,
    /// Least M and N of a GEMM on the pipelined path (128, one tile; 64 made the CTR
    /// step 6 % slower on the H200).
    pub gemm_pipe_min_mn: usize,
    /// GEMMs of one output row or column, or of K = 1 (a one-output linear layer, a
    /// detached block's loss head, and its gradients), of f32 operands, run the thin
    /// kernels (`gemm_thin_*`: the memory's rate, where a 64x64 tile computes one useful
    /// row or column of 64; `false`: the tiled kernels).
    pub gemm_thin: bool,
    /// A fused cross update (`LinearMulAdd`) computes the update in the epilogue of its
    /// GEMM where one TMA launch of the 128x128 tile writes the layer's output whole
    /// (`gemm_bf16t[_c]_128x128_ma`; `false`: the update's own launch after the GEMM).
    pub gemm_mul_add_epilogue: bool,
}

/// A pipelined GEMM tile: 128 rows by `n` columns, of the warp-specialized kernels
/// (`ws`: 128x64) or of the 256-thread ones (128x128, 128x256, and the TMA kernels' own
/// 128x64).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmTile {
    pub n: usize,
    pub ws: bool,
}

impl GemmTile {
    /// The tiles `ERASE_GEMM_TILE` names.
    pub const ALL: [(&'static str, GemmTile); 4] = [
        ("128x128", GemmTile { n: 128, ws: false }),
        ("128x256", GemmTile { n: 256, ws: false }),
        ("ws128x64", GemmTile { n: 64, ws: true }),
        ("t128x64", GemmTile { n: 64, ws: false }),
    ];
}

/// Where a step's launch runs: on the main stream or not, in the forward pass or not, in
/// a serial program (one stream: the baseline and detached schedules) or not, and in a
/// step of how many examples (`examples`; 0 where unknown).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LaunchAt {
    pub main: bool,
    pub forward: bool,
    pub serial: bool,
    pub examples: usize,
}

/// The split-K bounds of a GEMM plan: the fewest k a split gets, of the single-launch
/// kernels (`min_k`; `min_k_few` where the output has at most [`FEW_TILES`] 64x64 tiles)
/// and of the pipelined ones (`pipe_min_k`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SplitBounds {
    pub min_k: usize,
    pub min_k_few: usize,
    pub pipe_min_k: usize,
}

impl SplitBounds {
    /// The overlapped programs' bounds on the H200 (see
    /// [`PlanOptions::gemm_overlapped_splits`]), for a step of up to
    /// [`SplitBounds::EXAMPLES`] examples.
    pub const H200_OVERLAPPED: SplitBounds = SplitBounds {
        min_k: 1024,
        min_k_few: 256,
        pipe_min_k: 2048,
    };
    /// The step size the overlapped bounds are given for: a larger step scales them
    /// ([`SplitBounds::for_examples`]).
    pub const EXAMPLES: usize = 4096;

    /// These bounds for a step of `examples` examples: as they are up to
    /// [`SplitBounds::EXAMPLES`] (or where the step's size is unknown, 0), else times
    /// `examples / EXAMPLES` (whole multiples of 64), so that a weight gradient over the
    /// step's rows splits as often at every batch. (On the H200 at batch 16384 the CTR
    /// model's ERASE step was 2.0-2.2 % faster with 4x the bounds.)
    pub fn for_examples(self, examples: usize) -> SplitBounds {
        if examples <= Self::EXAMPLES {
            return self;
        }
        let scale = |k: usize| (k * examples / Self::EXAMPLES / 64 * 64).max(k);
        SplitBounds {
            min_k: scale(self.min_k),
            min_k_few: scale(self.min_k_few),
            pipe_min_k: scale(self.pipe_min_k),
        }
    }
}

/// A set of a step's launches, by where they run: every launch (`all`), or those of serial
/// programs (`serial`), on the main stream (`main`) or of the forward pass (`forward`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchSet {
    pub all: bool,
    pub serial: bool,
    pub main: bool,
    pub forward: bool,
}

impl LaunchSet {
    pub const NONE: LaunchSet = LaunchSet {
        all: false,
        serial: false,
        main: false,
        forward: false,
    };
    pub const ALL: LaunchSet = LaunchSet {
        all: true,
        ..LaunchSet::NONE
    };
    /// The launches of serial programs.
    pub const SERIAL: LaunchSet = LaunchSet {
        serial: true,
        ..LaunchSet::NONE
    };
    /// What [`LaunchSet::parse`] takes.
    pub const EXPECTED: &'static str =
        "expected 0, 1, or serial, main, fwd or several (comma separated: main,fwd)";

    /// Whether a launch at `at` is in the set.
    pub fn contains(self, at: LaunchAt) -> bool {
        self.all
            || (self.serial && at.serial)
            || (self.main && at.main)
            || (self.forward && at.forward)
    }

    /// `0` (none), `1` (all), or a comma-separated list of `serial`, `main` and `fwd`.
    pub fn parse(v: &str) -> Option<LaunchSet> {
        match v {
            "0" => return Some(LaunchSet::NONE),
            "1" => return Some(LaunchSet::ALL),
            _ => {}
        }
        let mut set = LaunchSet::NONE;
        for part in v.split(',') {
            match part.trim() {
                "serial" => set.serial = true,
                "main" => set.main = true,
                "fwd" => set.forward = true,
                _ => return None,
            }
        }
        Some(set)
    }
}

/// Output tiles (64x64) up to which a single-launch GEMM's K splits by
/// [`PlanOptions::gemm_min_k_per_split_few`].
pub const FEW_TILES: usize = 8;

impl PlanOptions {
    /// The H200's 132 SMs and every fast path on.
    pub const H200: PlanOptions = PlanOptions {
        sms: 132,
        gemm_pipeline: true,
        gemm_cluster: true,
        gemm_tall: true,
        gemm_tall_store_direct: false,
        graph_node_priority: true,
        gemm_tile: None,
        gemm_ws: false,
        gemm_tma: true,
        gemm_tma_n64: LaunchSet::SERIAL,
        gemm_min_k_per_split: 256,
        gemm_min_k_per_split_few: 64,
        gemm_pipe_min_k_per_split: 1024,
        gemm_overlapped_splits: Some(SplitBounds::H200_OVERLAPPED),
        gemm_pipe_min_flops: 1 << 29,
        gemm_pipe_min_mn: 128,
        gemm_thin: true,
        gemm_mul_add_epilogue: true,
    };

    /// These options for one launch of a step, at `at`: the launch sets resolve to every
    /// or no GEMM of the launch, and a launch of an overlapped program takes the
    /// overlapped split bounds (for the step's examples).
    pub fn at_launch(self, at: LaunchAt) -> PlanOptions {
        let n64 = if self.gemm_tma_n64.contains(at) {
            LaunchSet::ALL
        } else {
            LaunchSet::NONE
        };
        let mut o = PlanOptions {
            gemm_tma_n64: n64,
            ..self
        };
        if let Some(b) = self.gemm_overlapped_splits.filter(|_| !at.serial) {
            let b = b.for_examples(at.examples);
            o.gemm_min_k_per_split = b.min_k;
            o.gemm_min_k_per_split_few = b.min_k_few;
            o.gemm_pipe_min_k_per_split = b.pipe_min_k;
        }
        o
    }

    /// These options for a device of `sms` SMs.
    pub fn with_sms(self, sms: usize) -> PlanOptions {
        PlanOptions {
            sms: sms.max(1),
            ..self
        }
    }

    /// These options with the documented overrides `var` returns (the process's
    /// environment, read once at start, in the trainer): `ERASE_GEMM_PIPELINE=0`,
    /// `ERASE_GEMM_CLUSTER=0`, `ERASE_GEMM_TALL=0`, `ERASE_GEMM_TALL_STORE=direct`,
    /// `ERASE_GRAPH_NODE_PRIORITY=0`, `ERASE_GEMM_WS=0` or `1`, `ERASE_GEMM_TMA=0` or `1`,
    /// `ERASE_GEMM_THIN=0` or `1`, `ERASE_GEMM_MUL_ADD_EPILOGUE=0` or `1`,
    /// `ERASE_GEMM_TMA_N64` (a [`LaunchSet`]: `0`, `1`, or `serial`, `main` and `fwd`,
    /// comma separated), `ERASE_GEMM_TILE=128x128`, `128x256`, `ws128x64` (the `ws` tile also
    /// turns `gemm_ws` on) or `t128x64` (the TMA kernels' 128x64 tile, where the TMA
    /// kernels run; it also sets `gemm_tma_n64` to every launch), and the
    /// GEMM planner's thresholds as whole numbers: `ERASE_GEMM_MIN_K_SPLIT`,
    /// `ERASE_GEMM_MIN_K_SPLIT_FEW`, `ERASE_GEMM_PIPE_MIN_K_SPLIT` (each at least 1; the
    /// serial programs' and a lone op's: `ERASE_GEMM_OVERLAPPED_SPLITS=0` gives the
    /// overlapped programs these too, `1` their own H200 bounds),
    /// `ERASE_GEMM_PIPE_MIN_FLOPS` and `ERASE_GEMM_PIPE_MIN_MN` (at least 16). Any other
    /// value of a variable is an error naming it.
    pub fn with_env(self, var: impl Fn(&str) -> Option<String>) -> Result<PlanOptions, String> {
        let mut o = self;
        let flag = |name: &str, off: &str, on: &str| -> Result<Option<bool>, String> {
            match var(name).as_deref() {
                None | Some("") => Ok(None),
                Some(v) if v == off => Ok(Some(false)),
                Some(v) if v == on => Ok(Some(true)),
                Some(v) => Err(format!("{name}={v}: expected {off} or {on}")),
            }
        };
        if let Some(v) = flag("ERASE_GEMM_PIPELINE", "0", "1")? {
            o.gemm_pipeline = v;
        }
        if let Some(v) = flag("ERASE_GEMM_CLUSTER", "0", "1")? {
            o.gemm_cluster = v;
        }
        if let Some(v) = flag("ERASE_GEMM_TALL", "0", "1")? {
            o.gemm_tall = v;
        }
        if let Some(v) = flag("ERASE_GEMM_TALL_STORE", "shared", "direct")? {
            o.gemm_tall_store_direct = v;
        }
        if let Some(v) = flag("ERASE_GRAPH_NODE_PRIORITY", "0", "1")? {
            o.graph_node_priority = v;
        }
        if let Some(v) = flag("ERASE_GEMM_WS", "0", "1")? {
            o.gemm_ws = v;
        }
        if let Some(v) = flag("ERASE_GEMM_TMA", "0", "1")? {
            o.gemm_tma = v;
        }
        if let Some(v) = flag("ERASE_GEMM_THIN", "0", "1")? {
            o.gemm_thin = v;
        }
        if let Some(v) = flag("ERASE_GEMM_MUL_ADD_EPILOGUE", "0", "1")? {
            o.gemm_mul_add_epilogue = v;
        }
        if let Some(v) = flag("ERASE_GEMM_OVERLAPPED_SPLITS", "0", "1")? {
            o.gemm_overlapped_splits = v.then_some(SplitBounds::H200_OVERLAPPED);
        }
        match var("ERASE_GEMM_TMA_N64").as_deref() {
            None | Some("") => {}
            Some(v) => {
                o.gemm_tma_n64 = LaunchSet::parse(v)
                    .ok_or_else(|| format!("ERASE_GEMM_TMA_N64={v}: {}", LaunchSet::EXPECTED))?
            }
        }
        match var("ERASE_GEMM_TILE").as_deref() {
            None | Some("") => {}
            Some(v) => {
                let (_, t) = GemmTile::ALL
                    .iter()
                    .find(|(name, _)| *name == v)
                    .ok_or_else(|| {
                        format!(
                            "ERASE_GEMM_TILE={v}: expected one of {}",
                            GemmTile::ALL.map(|(n, _)| n).join(", ")
                        )
                    })?;
                o.gemm_tile = Some(*t);
                o.gemm_ws |= t.ws;
                if !t.ws && t.n == 64 {
                    o.gemm_tma_n64 = LaunchSet::ALL;
                }
            }
        }
        let number = |name: &str, least: usize| -> Result<Option<usize>, String> {
            match var(name).as_deref() {
                None | Some("") => Ok(None),
                Some(v) => match v.parse::<usize>() {
                    Ok(n) if n >= least => Ok(Some(n)),
                    _ => Err(format!(
                        "{name}={v}: expected a whole number of at least {least}"
                    )),
                },
            }
        };
        if let Some(n) = number("ERASE_GEMM_MIN_K_SPLIT", 1)? {
            o.gemm_min_k_per_split = n;
        }
        if let Some(n) = number("ERASE_GEMM_MIN_K_SPLIT_FEW", 1)? {
            o.gemm_min_k_per_split_few = n;
        }
        if let Some(n) = number("ERASE_GEMM_PIPE_MIN_MN", 16)? {
            o.gemm_pipe_min_mn = n;
        }
        if let Some(n) = number("ERASE_GEMM_PIPE_MIN_K_SPLIT", 1)? {
            o.gemm_pipe_min_k_per_split = n;
        }
        if let Some(n) = number("ERASE_GEMM_PIPE_MIN_FLOPS", 0)? {
            o.gemm_pipe_min_flops = n;
        }
        Ok(o)
    }

    /// [`PlanOptions::H200`] with the process environment's overrides, read once; an
    /// override it cannot read is reported on stderr once and ignored.
    pub fn from_env() -> PlanOptions {
        static O: std::sync::OnceLock<PlanOptions> = std::sync::OnceLock::new();
        *O.get_or_init(|| {
            PlanOptions::H200
                .with_env(|k| std::env::var(k).ok())
                .unwrap_or_else(|e| {
                    eprintln!("erase: ignoring {e}");
                    PlanOptions::H200
                })
        })
    }
}

impl Default for PlanOptions {
    fn default() -> PlanOptions {
        PlanOptions::H200
    }
}

/// Every kernel name any plan uses; a test checks each against the embedded PTX.
pub fn kernel_names() -> Vec<&'static str> {
    let families: [&[&'static str]; 10] = [
        gemm::KERNELS,
        attention::KERNELS,
        elementwise::KERNELS,
        shape::KERNELS,
        reduce::KERNELS,
        norm::KERNELS,
        interaction::KERNELS,
        loss::KERNELS,
        optim::KERNELS,
        embedding::KERNELS,
    ];
    let mut v: Vec<&'static str> = families
        .iter()
        .flat_map(|f| f.iter().copied())
        .chain(gemm::ws_kernels())
        .chain(gemm::tma_kernels())
        .collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// `ceil(a / b)` as a grid dimension.
pub(crate) fn blocks(a: usize, b: usize) -> u32 {
    a.div_ceil(b.max(1)).max(1) as u32
}
