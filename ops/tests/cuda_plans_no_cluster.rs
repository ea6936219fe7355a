//! The pipelined weight gradient with `ERASE_GEMM_CLUSTER=0` (the switch that keeps the
//! split-K partials and the reduction launch, for comparing the two forms), checked
//! without a GPU. A file of its own: the switch is read from the environment, which this
//! process alone sets.

use erase_graph::{DType, Op, Shape};
use erase_ops::cuda::{cuda_plan, KArg, Operands};

#[test]
fn without_clusters_the_reduction_launch_also_adds_the_bias_gradient() {
    std::env::set_var("ERASE_GEMM_CLUSTER", "0");
    // dw [1024, 1728] over 4096 rows, with db: two splits, so partials and a reduction
    let (rows, n, k) = (4096, 1024, 1728);
    let ins = [Shape::new(&[rows, n]), Shape::new(&[rows, k])];
    let outs = [Shape::new(&[n, k]), Shape::new(&[n])];
    let (ir, or): (Vec<&Shape>, Vec<&Shape>) = (ins.iter().collect(), outs.iter().collect());
    let p = cuda_plan(
        &Op::LinearGradWeight { bias: true },
        &Operands {
            ins: &ir,
            in_dtypes: &[DType::F32; 2],
            outs: &or,
            out_dtypes: &[DType::F32; 2],
            upd: &[],
        },
    )
    .unwrap();
    let names: Vec<&str> = p.calls.iter().map(|c| c.kernel).collect();
    assert_eq!(
        names,
        [
            "gemm_to_bf16_pair",
            "gemm_bf16p_128x128",
            "gemm_splitk_reduce"
        ],
        "no colsum_final launch of its own"
    );
    // dy's column sums: one partial per 64 rows (scratch 3, after the two bf16 operands
    // and the GEMM's partials), added into db by the reduction's extra CTAs
    let r = &p.calls[2];
    assert_eq!(r.args[8], KArg::Scratch(3));
    assert_eq!(r.args[9], KArg::Out(1));
    assert_eq!(r.args[10], KArg::I32((rows / 64) as i32));
    assert_eq!(r.args[11], KArg::I64(n as i64));
    assert_eq!(p.scratch[3], rows / 64 * n * 4);
    assert_eq!(r.grid[0] as usize, (n * k).div_ceil(128) + n.div_ceil(32));
}
