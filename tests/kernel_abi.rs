//! The typed kernel ABI, checked without a GPU: every launch that the plans of the CTR
//! model, the zoo's models, mlp30 and nanochat make (at several sizes and in every
//! variant) passes its kernel exactly the parameters the kernel's PTX declares, in count,
//! width and kind; and the kernel exists. A wrong argument list fails here, not on a GPU machine. (And
//! which programs' launches take the TMA kernels' 128x64 tile.)

use erase::graph::{DType, OptimizerConfig};
use erase::model::ctr::{CtrConfig, Variant};
use erase::ops::cuda::{KArg, KernelCall, PlanOptions};
use erase::runtime::kernels::check_call;
use erase::runtime::program::schedule::ScheduleKind;
use erase::train::{plan_step, ScheduleOptions};

/// The kernel library, or `None` (after saying so) in a build without nvcc.
fn library() -> Option<erase::runtime::kernels::KernelLibrary> {
    let lib = erase::kernels::library();
    if lib.modules.is_empty() {
        println!("skipped: this build has no kernels (nvcc was not found at build time)");
        assert!(
            std::env::var("CI").map_or(true, |v| v != "true"),
            "CI installs nvcc: a build without kernels there is a broken build"
        );
        return None;
    }
    Some(lib)
}

/// Checks every launch of a graph's program; returns how many calls it checked.
fn check_program(
    what: &str,
    lib: &erase::runtime::kernels::KernelLibrary,
    g: &erase::graph::Graph,
    prog: &erase::runtime::program::schedule::StepProgram,
) -> usize {
    let mut calls = 0;
    for l in &prog.launches {
        let node = l.node;
        let plan = match erase::profile::node_plan(g, node, prog.launch_at(g, l)) {
            Ok(p) => p,
            Err(e) => panic!("{what}: node '{}' has no plan: {e}", g.node(node).name),
        };
        for c in &plan.calls {
            let k = lib
                .find(c.kernel)
                .unwrap_or_else(|| panic!("{what}: kernel '{}' is not in the PTX", c.kernel));
            if let Err(e) = check_call(c, k.params) {
                panic!("{what}: node '{}': {e}", g.node(node).name);
            }
            calls += 1;
        }
    }
    calls
}

#[test]
fn every_plan_of_the_ctr_models_mlp30_and_nanochat_matches_its_kernels_parameters() {
    let Some(lib) = library() else { return };
    let mut total = 0;
    let opt = OptimizerConfig::default();
    let spec_multi = CtrConfig {
        table_rows: (0..26).map(|j| 3 + j * 4000).collect(),
        field_hot: (0..26).map(|j| 1 + j % 3).collect(),
        mean_fields: (0..26).map(|j| j % 4 == 0).collect(),
        ..Default::default()
    };
    let mut no_dense = CtrConfig::small();
    no_dense.num_dense = 0;
    let sizes = [
        ("small", CtrConfig::small()),
        ("spec", CtrConfig::default()),
        (
            "spec batch 16384",
            CtrConfig {
                batch: 16384,
                ..Default::default()
            },
        ),
        ("spec multi-hot, mixed tables", spec_multi),
        ("no dense features", no_dense),
    ];
    for (name, cfg) in sizes {
        for v in Variant::ALL {
            // the CUDA schedule: bf16 copies of the GEMM operands on
            let sched = ScheduleOptions::default();
            let plan = plan_step(&cfg.clone().with_variant(v), DType::F32, &opt, &sched)
                .unwrap_or_else(|e| panic!("{name} {v}: {e:#}"));
            let g = &plan.model.graph;
            total += check_program(&format!("ctr {name} {v}"), &lib, g, &plan.program);
        }
    }
    // the zoo at its spec-preset sizes (DCNv2's 128-wide embeddings, its thin heads)
    for name in erase::model::zoo::names() {
        let cfg = erase::model::api::configure(&name, CtrConfig::default(), true).unwrap();
        for v in Variant::ALL {
            let plan = plan_step(
                &cfg.clone().with_variant(v),
                DType::F32,
                &opt,
                &ScheduleOptions::default(),
            )
            .unwrap_or_else(|e| panic!("{name} {v}: {e:#}"));
            let g = &plan.model.graph;
            total += check_program(&format!("zoo {name} {v}"), &lib, g, &plan.program);
        }
    }
    for (width, layers, batch) in [(256usize, 30usize, 256usize), (1024, 30, 256), (64, 4, 7)] {
        for mode in [
            erase::model::mlp30::Mode::Conventional,
            erase::model::mlp30::Mode::Erase,
        ] {
            let cfg = erase::model::mlp30::Mlp30Config {
                width,
                layers,
                batch,
                mode,
                ..Default::default()
            };
            let p = erase::model::mlp30::plan(&cfg, &opt, 4).unwrap();
            total += check_program(
                &format!("mlp30 {width}x{layers} batch {batch}"),
                &lib,
                &p.plan.graph,
                &p.plan.program,
            );
        }
    }
    for cfg in [
        erase::model::nanochat::NanoConfig::default(),
        erase::model::nanochat::NanoConfig {
            seq: 1024,
            width: 512,
            heads: 8,
            layers: 6,
            batch: 16,
            aux_weight: 1.0,
        },
    ] {
        for kind in [ScheduleKind::Serial, ScheduleKind::Early] {
            let p = erase::model::nanochat::plan(&cfg, &opt, kind, 2).unwrap();
            total += check_program(
                &format!("nanochat seq {} width {}", cfg.seq, cfg.width),
                &lib,
                &p.plan.graph,
                &p.plan.program,
            );
        }
    }
    println!("{total} kernel calls match their kernels' parameters");
    assert!(total > 1000, "only {total} calls checked");
}

#[test]
fn a_wrong_argument_list_fails_the_check() {
    let Some(lib) = library() else { return };
    let k = lib.find("ew_scale").expect("ew_scale is a kernel");
    // ew_scale(x, y, n, factor)
    let good = KernelCall {
        kernel: "ew_scale",
        grid: [1, 1, 1],
        block: [256, 1, 1],
        smem: 0,
        args: vec![KArg::In(0), KArg::Out(0), KArg::I64(4), KArg::F32(2.0)],
    };
    assert_eq!(check_call(&good, k.params), Ok(()));
    let mut short = good.clone();
    short.args.pop();
    let e = check_call(&short, k.params).unwrap_err();
    assert!(
        e.contains("takes 4 parameters") && e.contains("passes 3"),
        "{e}"
    );
    let mut narrow = good.clone();
    narrow.args[2] = KArg::I32(4);
    let e = check_call(&narrow, k.params).unwrap_err();
    assert!(e.contains("parameter 2 is .u64"), "{e}");
    let mut kind = good;
    kind.args[3] = KArg::I32(2);
    let e = check_call(&kind, k.params).unwrap_err();
    assert!(e.contains("parameter 3 is .f32"), "{e}");
}

#[test]
fn the_sharded_lookups_kernel_matches_its_parameters() {
    let Some(lib) = library() else { return };
    let geo = erase::sharding::cuda_geometry(
        &[10, 3, 70],
        (16, 2, 8),
        (1, 3),
        1 << 40,
        erase::sharding::Sharding::Row,
    )
    .unwrap()
    .expect("row-wise tables are sharded");
    let c = geo.shard_ids_call();
    let k = lib
        .find(c.kernel)
        .unwrap_or_else(|| panic!("kernel '{}' is not in the PTX", c.kernel));
    check_call(&c, k.params).unwrap();
}

/// Programmatic dependent launch (on by default on sm_90) lets a kernel start while the
/// one before it on its stream still runs: each kernel of the sm_90a PTX must wait for it
/// before touching memory, and the sm_80 PTX (launched without it) has no such wait.
#[test]
fn every_sm90a_kernel_waits_for_its_predecessor_before_touching_memory() {
    use erase::runtime::kernels::check_pdl_waits;
    let Some(lib) = library() else { return };
    let mut checked = 0;
    for m in lib.modules {
        checked += check_pdl_waits(m.sm90a).unwrap_or_else(|e| panic!("{}.cu: {e}", m.file));
        assert!(
            !m.sm80.contains("griddepcontrol"),
            "{}.cu: the sm_80 PTX has griddepcontrol",
            m.file
        );
    }
    assert_eq!(
        checked,
        lib.kernels.len(),
        "every kernel of the library is an .entry of some module"
    );
}

#[test]
fn a_kernel_that_reads_before_its_wait_fails_the_pdl_check() {
    use erase::runtime::kernels::check_pdl_waits;
    let ok = ".visible .entry k(\n.param .u64 p\n)\n{\nld.param.u64 %rd1, [p];\ngriddepcontrol.wait;\ngriddepcontrol.launch_dependents;\nld.global.f32 %f1, [%rd1];\nret;\n}\n";
    assert_eq!(check_pdl_waits(ok), Ok(1));
    let early = ok.replace(
        "griddepcontrol.wait;\n",
        "@%p1 ld.global.nc.f32 %f2, [%rd1];\ngriddepcontrol.wait;\n",
    );
    let e = check_pdl_waits(&early).unwrap_err();
    assert!(e.contains("'k'") && e.contains("ld.global.nc"), "{e}");
    let generic = ok.replace(
        "griddepcontrol.wait;\n",
        "st.u32 [%rd1], 0;\ngriddepcontrol.wait;\n",
    );
    assert!(check_pdl_waits(&generic).unwrap_err().contains("before"));
    let none = ok.replace("griddepcontrol.wait;\n", "");
    assert!(check_pdl_waits(&none).unwrap_err().contains("never"));
    let no_trigger = ok.replace("griddepcontrol.launch_dependents;\n", "");
    assert!(check_pdl_waits(&no_trigger)
        .unwrap_err()
        .contains("launch_dependents"));
}

/// The spec model's step at its sizes (batch 4096), as the CUDA backend schedules it.
fn spec_plan(v: Variant) -> erase::train::StepPlan {
    plan_step(
        &CtrConfig::default().with_variant(v),
        DType::F32,
        &OptimizerConfig::default(),
        &ScheduleOptions::default(),
    )
    .unwrap_or_else(|e| panic!("{v}: {e:#}"))
}

#[test]
fn the_serial_schedules_take_the_tma_128x64_tile_and_erase_does_not() {
    // the spec model at batch 4096: the 4096 x 256 layers' GEMMs (64 CTAs of 128x128 on
    // the H200's 132 SMs) take the 128x64 tile in the baseline's and detached's programs,
    // and in no launch of the ERASE program (where the wider grids made the step slower)
    if std::env::var_os("ERASE_GEMM_TMA_N64").is_some() {
        println!("ERASE_GEMM_TMA_N64 is set: the default launch set is not what runs");
        return;
    }
    for v in Variant::ALL {
        let plan = spec_plan(v);
        let g = &plan.model.graph;
        let prog = &plan.program;
        let narrow = prog
            .launches
            .iter()
            .filter(|l| {
                erase::profile::kernels_of(g, l.node, prog.launch_at(g, l))
                    .contains("gemm_bf16t_128x64")
            })
            .count();
        if v == Variant::Erase {
            assert_eq!(narrow, 0, "{v}");
        } else {
            assert!(narrow >= 4, "{v}: {narrow} launches on the 128x64 tile");
        }
    }
}

#[test]
fn the_erase_program_plans_its_gemms_with_the_overlapped_split_bounds() {
    // the ERASE program's launches plan exactly as every launch did under the bounds
    // measured for it (ERASE_GEMM_MIN_K_SPLIT=1024, ERASE_GEMM_MIN_K_SPLIT_FEW=256,
    // ERASE_GEMM_PIPE_MIN_K_SPLIT=2048 on an H200: +2.8 % erase); the serial programs'
    // launches as under the default bounds; and the two differ (fewer splits)
    // the bounds of an A/B: every launch's, from the environment as it was set
    let measured_bounds = |min_k: &str, few: &str, pipe: &str| {
        PlanOptions::H200
            .with_env(|k| {
                match k {
                    "ERASE_GEMM_MIN_K_SPLIT" => Some(min_k),
                    "ERASE_GEMM_MIN_K_SPLIT_FEW" => Some(few),
                    "ERASE_GEMM_PIPE_MIN_K_SPLIT" => Some(pipe),
                    "ERASE_GEMM_OVERLAPPED_SPLITS" => Some("0"),
                    _ => None,
                }
                .map(str::to_string)
            })
            .unwrap()
    };
    let measured = measured_bounds("1024", "256", "2048");
    let serial_bounds = PlanOptions {
        gemm_overlapped_splits: None,
        ..PlanOptions::H200
    };
    for v in Variant::ALL {
        let plan = spec_plan(v);
        let g = &plan.model.graph;
        let prog = &plan.program;
        let mut differ = 0;
        for l in &prog.launches {
            let at = prog.launch_at(g, l);
            let got = erase::profile::node_plan_with(g, l.node, PlanOptions::H200.at_launch(at));
            let with = |o: PlanOptions| erase::profile::node_plan_with(g, l.node, o.at_launch(at));
            let name = &g.node(l.node).name;
            if v == Variant::Erase {
                assert_eq!(got, with(measured), "{v}: '{name}'");
            } else {
                assert_eq!(got, with(serial_bounds), "{v}: '{name}'");
            }
            differ += usize::from(got != with(serial_bounds));
        }
        if v == Variant::Erase {
            assert!(differ >= 5, "{v}: {differ} launches plan other splits");
            println!("{v}: {differ} launches plan fewer splits than the serial bounds give");
        }
    }
    // at batch 16384 the ERASE program's launches plan as under 4x the bounds (measured on
    // an H200: +2.2 % erase), and the program knows its step's size
    let measured_16k = measured_bounds("4096", "1024", "8192");
    let cfg = CtrConfig {
        batch: 16384,
        ..CtrConfig::default()
    };
    let plan = plan_step(
        &cfg.with_variant(Variant::Erase),
        DType::F32,
        &OptimizerConfig::default(),
        &ScheduleOptions::default(),
    )
    .unwrap();
    let (g, prog) = (&plan.model.graph, &plan.program);
    assert_eq!(erase::runtime::program::schedule::step_examples(g), 16384);
    for l in &prog.launches {
        let at = prog.launch_at(g, l);
        assert_eq!(at.examples, 16384);
        let got = erase::profile::node_plan_with(g, l.node, PlanOptions::H200.at_launch(at));
        let want = erase::profile::node_plan_with(g, l.node, measured_16k.at_launch(at));
        assert_eq!(got, want, "batch 16384: '{}'", g.node(l.node).name);
    }
}

#[test]
fn the_cost_model_plans_each_launch_with_the_kernel_paths_asked_for() {
    if library().is_none() {
        return;
    }
    let kernels = |plan_options: Option<PlanOptions>| -> Vec<&'static str> {
        let plan = plan_step(
            &CtrConfig::default().with_variant(Variant::Baseline),
            DType::F32,
            &OptimizerConfig::default(),
            &ScheduleOptions {
                plan_options,
                ..Default::default()
            },
        )
        .unwrap();
        let kernels = plan.program.launches.iter();
        kernels
            .filter_map(|l| l.spec.as_ref().map(|s| s.kernel))
            .collect()
    };
    let tall = |k: &&str| k.starts_with("gemm_tall");
    let default = kernels(None);
    assert!(default.iter().any(tall), "{default:?}");
    assert_eq!(default, kernels(Some(PlanOptions::H200)));
    // `--kernel-paths no-tall`: AutoInt's tall projections on the other GEMM kernels
    let other = kernels(Some(PlanOptions {
        gemm_tall: false,
        ..PlanOptions::H200
    }));
    assert!(!other.iter().any(tall), "{other:?}");
    assert_eq!(other.len(), default.len());
}
