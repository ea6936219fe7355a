//! GPU tests: every CUDA kernel against the CPU reference of its op, on fresh random
//! inputs, with outputs poisoned (NaN) before each launch so unwritten elements fail.
//! Without a CUDA device each test prints `skipped: no CUDA device` and passes; with
//! `ERASE_REQUIRE_GPU=1` a missing device (or a build without kernels) fails instead.
//! Each test that ran on the GPU prints `gpu test ran: NAME`.

mod dense;
mod families;
mod pipeline;
mod runtime;
mod sanitize;

use std::sync::OnceLock;

use erase::graph::{DType, Op, Shape};
use erase::ops::Buffer;
use erase::runtime::cuda::CudaDevice;
use erase::runtime::init::{splitmix64, to_unit};

/// The shared device, opened once; `None` (after printing why) when there is none.
pub fn device(test: &str) -> Option<&'static CudaDevice> {
    static DEV: OnceLock<Result<CudaDevice, String>> = OnceLock::new();
    let d = DEV.get_or_init(|| erase::gpu::open_device().map_err(|e| format!("{e:#}")));
    match d {
        Ok(dev) => {
            println!("gpu test ran: {test}");
            Some(dev)
        }
        Err(e) => {
            if std::env::var("ERASE_REQUIRE_GPU").is_ok_and(|v| v == "1") {
                panic!("{test}: ERASE_REQUIRE_GPU=1 but no usable CUDA device: {e}");
            }
            println!("{test}: skipped: no CUDA device ({e})");
            None
        }
    }
}

/// Another handle on the test device whose plans take `opts` (its SM count stays the
/// device's): a test's way to run an op on a path the defaults do not take.
pub fn handle_with(opts: erase::ops::cuda::PlanOptions) -> CudaDevice {
    let mut d = erase::gpu::open_device().expect("a second handle on the test device");
    d.set_plan_options(opts);
    d
}

/// `n` uniform values in `[lo, hi)`, fresh for each `seed` (never zeros by construction
/// unless the range contains 0).
pub fn rand_f32(seed: u64, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            lo + (hi - lo)
                * to_unit(splitmix64(
                    seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (i as u64 + 1),
                )) as f32
        })
        .collect()
}

/// An operand: its shape and value.
#[derive(Clone)]
pub struct Arg {
    pub shape: Shape,
    pub value: Buffer,
}

pub fn arg(shape: &[usize], value: Buffer) -> Arg {
    Arg {
        shape: Shape::new(shape),
        value,
    }
}

/// Runs `op` on the GPU: inputs copied in, outputs poisoned, launches, results copied back.
/// `upd` holds persistent tensors the op updates in place (they are updated here too).
pub fn run_gpu(
    dev: &CudaDevice,
    op: &Op,
    ins: &[Arg],
    outs: &[(&[usize], DType)],
    upd: &mut [Arg],
) -> Vec<Buffer> {
    let in_refs: Vec<(&Shape, &Buffer)> = ins.iter().map(|a| (&a.shape, &a.value)).collect();
    let out_shapes: Vec<(Shape, DType)> = outs.iter().map(|(s, d)| (Shape::new(s), *d)).collect();
    let mut upd_refs: Vec<(&Shape, &mut Buffer)> =
        upd.iter_mut().map(|a| (&a.shape, &mut a.value)).collect();
    dev.run_node(op, &in_refs, &out_shapes, &mut upd_refs)
        .unwrap_or_else(|e| panic!("{}: {e}", op.name()))
}

/// Runs `op` with the CPU reference (f32, or f64 when the buffers are f64).
pub fn run_cpu(op: &Op, ins: &[Arg], outs: &[(&[usize], DType)], upd: &mut [Arg]) -> Vec<Buffer> {
    let shapes: Vec<Shape> = outs.iter().map(|(s, _)| Shape::new(s)).collect();
    let call = erase::ops::NodeCall {
        op,
        name: "reference",
        in_shapes: ins.iter().map(|a| &a.shape).collect(),
        out_shapes: shapes.iter().collect(),
        bf16_gemm: false,
    };
    let in_refs: Vec<&Buffer> = ins.iter().map(|a| &a.value).collect();
    let mut o: Vec<Buffer> = outs
        .iter()
        .map(|(s, d)| Buffer::poison(*d, s.iter().product()))
        .collect();
    let mut u: Vec<Buffer> = upd.iter().map(|a| a.value.clone()).collect();
    erase::ops::execute(&call, &in_refs, &mut o, &mut u)
        .unwrap_or_else(|e| panic!("cpu reference: {e}"));
    for (a, b) in upd.iter_mut().zip(u) {
        a.value = b;
    }
    o
}

/// Asserts `|got - want| <= atol + rtol·|want|` elementwise (NaN fails), naming the worst.
pub fn assert_close(what: &str, got: &[f64], want: &[f64], rtol: f64, atol: f64) {
    assert_eq!(
        got.len(),
        want.len(),
        "{what}: {} values, expected {}",
        got.len(),
        want.len()
    );
    let mut worst = (0usize, 0.0f64);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (g - w).abs();
        let ok = err <= atol + rtol * w.abs();
        assert!(
            ok && g.is_finite() == w.is_finite(),
            "{what}[{i}]: got {g}, want {w} (|err| {err:.3e}, tolerance {:.3e})",
            atol + rtol * w.abs()
        );
        let scaled = err / (atol + rtol * w.abs());
        if scaled > worst.1 {
            worst = (i, scaled);
        }
    }
    println!(
        "{what}: ok ({} values, worst at [{}] = {:.2} of tolerance)",
        got.len(),
        worst.0,
        worst.1
    );
}

#[test]
fn every_kernel_a_plan_names_is_in_the_embedded_ptx() {
    // runs everywhere: a build with kernels must contain every kernel the ops launch
    let lib = erase::kernels::library();
    if lib.modules.is_empty() {
        println!("skipped: this build has no kernels (nvcc was not found at build time)");
        assert!(
            std::env::var("ERASE_REQUIRE_GPU").map_or(true, |v| v != "1"),
            "ERASE_REQUIRE_GPU=1 needs a build with kernels"
        );
        return;
    }
    for name in erase::ops::cuda::kernel_names() {
        assert!(
            lib.find(name).is_some(),
            "kernel '{name}' is used by a plan but missing from the PTX"
        );
    }
}
