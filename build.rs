//! Compiles each family of `kernels-cuda/` (a file `NAME.cu`, or a folder `NAME/` whose
//! `NAME.cu` includes the folder's other files) to PTX with nvcc, for sm_90a (Hopper:
//! wgmma allowed) and sm_80 (A100-class, and a fallback the H200 can run), and embeds it
//! with each kernel's registers, shared memory and spills as ptxas reports them for
//! sm_90a, and its parameter list as the PTX declares it (which a CPU test checks every
//! launch plan against: a wrong argument list fails without a GPU).
//!
//! nvcc is found through `$NVCC`, `$CUDA_HOME/bin/nvcc`, `PATH`, or the project's own
//! pinned install (`scripts/install-nvcc.sh` puts it in `.tools/cuda`). Without nvcc the
//! build still succeeds, with one warning, and the CUDA backend says at run time that
//! this build has no kernels and how to get them. A kernel that does not compile fails
//! the build.

use std::env;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

fn find_nvcc(root: &Path) -> Option<PathBuf> {
    let works = |p: &Path| {
        Command::new(p)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if let Some(p) = env::var_os("NVCC").map(PathBuf::from) {
        return works(&p).then_some(p);
    }
    if let Some(h) = env::var_os("CUDA_HOME") {
        let p = PathBuf::from(h).join("bin/nvcc");
        if works(&p) {
            return Some(p);
        }
    }
    if let Some(paths) = env::var_os("PATH") {
        for dir in env::split_paths(&paths) {
            let p = dir.join("nvcc");
            if p.is_file() && works(&p) {
                // a symlink to nvcc loses its headers: call it by its real path
                return Some(fs::canonicalize(&p).unwrap_or(p));
            }
        }
    }
    let p = root.join(".tools/cuda/nvidia/cu13/bin/nvcc");
    works(&p).then_some(p)
}

/// One kernel's resources from `ptxas -v`.
struct Resources {
    name: String,
    regs: u32,
    smem: u32,
    spill: u32,
}

/// Parses ptxas's verbose report (lines "Compiling entry function 'NAME'", "Used N
/// registers, ... M bytes smem", "S bytes spill stores").
fn parse_ptxas(report: &str) -> Vec<Resources> {
    let mut out: Vec<Resources> = Vec::new();
    let num_before = |line: &str, unit: &str| -> u32 {
        line.split(',')
            .find(|part| part.contains(unit))
            .and_then(|part| part.split_whitespace().find_map(|w| w.parse().ok()))
            .unwrap_or(0)
    };
    for line in report.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap_or("").to_string();
            out.push(Resources {
                name,
                regs: 0,
                smem: 0,
                spill: 0,
            });
        } else if let Some(r) = out.last_mut() {
            if line.contains("Used") && line.contains("registers") {
                r.regs = num_before(line.split("Used").nth(1).unwrap_or(""), "registers");
                r.smem = num_before(line, "bytes smem");
            } else if line.contains("spill stores") {
                r.spill = num_before(line, "spill stores");
            }
        }
    }
    out
}

/// Kernels whose register cap makes ptxas spill a little, kept because they measured
/// faster that way than without the cap (on an H200, BENCHMARKS.md "Attention at S = 2048"):
/// two CTAs an SM hide the cp.async ring's latency better than one CTA without spills.
/// The spills sit in the masked form of the loop body (tiles at S's end or on the causal
/// diagonal); the unmasked form that whole tiles take spills nothing. A spill larger than
/// the bytes listed here still warns.
/// The S <= 32 backward reading a bf16 q, k, v (Dh = 32) spills one value, stored once and
/// reloaded once a thread (SASS: one STL, one LDL), at the 64 registers that let eight
/// CTAs share an SM as the f32 form's do. It measured 73.7 µs a layer on an H200 (the f32
/// form 82.3); the first form, at seven CTAs (72 registers, no spill) and with its tile
/// loads one at a time, 88.6 (BENCHMARKS.md, "This build's changes"). The f32-input forms
/// spill the same one value since every kernel begins by waiting for its predecessor
/// (`ERASE_PDL_ENTER`), which ptxas schedules around.
const MEASURED_SPILLS: &[(&str, u32)] = &[
    ("attn_bwd_dkdv_st_d64", 72),
    ("attn_bwd_dkdv_st_d32", 20),
    ("attn_bwd_dq_st_d64", 4),
    ("attn_bwd_tiny_packed_bi_d32", 8),
    ("attn_bwd_tiny_packed_bi_bo_d32", 8),
    ("attn_bwd_tiny_packed_d32", 8),
    ("attn_bwd_tiny_packed_bo_d32", 8),
];

/// Each `.entry`'s parameter types in a PTX text, in order (`NAME -> "u64,u32,f32"`).
fn parse_params(ptx: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut cur: Option<(String, Vec<String>)> = None;
    for line in ptx.lines() {
        let t = line.trim();
        if let Some(rest) = t.split(".entry ").nth(1) {
            let name = rest.split('(').next().unwrap_or("").trim().to_string();
            cur = Some((name, Vec::new()));
            if t.ends_with("()") {
                if let Some((n, p)) = cur.take() {
                    out.push((n, p.join(",")));
                }
            }
            continue;
        }
        if let Some((_, params)) = cur.as_mut() {
            if t.starts_with(".param") {
                // `.param .u64 name,` or `.param .align 8 .b8 name[16]`
                let words: Vec<&str> = t.split_whitespace().collect();
                let ty = if words.get(1) == Some(&".align") {
                    format!("{}[]", words.get(3).unwrap_or(&"").trim_start_matches('.'))
                } else {
                    words
                        .get(1)
                        .unwrap_or(&"")
                        .trim_start_matches('.')
                        .to_string()
                };
                params.push(ty);
            } else if t.starts_with(')') {
                if let Some((n, p)) = cur.take() {
                    out.push((n, p.join(",")));
                }
            }
        }
    }
    out
}

fn run(cmd: &mut Command, what: &str) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("erase build: cannot run nvcc for {what}: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if !out.status.success() {
        panic!("erase build: nvcc failed on {what}:\n{text}");
    }
    text
}

fn main() {
    let root =
        PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let out_dir = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let src = root.join("kernels-cuda");
    println!("cargo:rerun-if-changed=kernels-cuda");
    for v in ["NVCC", "CUDA_HOME", "PATH"] {
        println!("cargo:rerun-if-env-changed={v}");
    }
    // a family is `NAME.cu`, or a folder `NAME/` compiled through its `NAME/NAME.cu`
    let mut files: Vec<PathBuf> = fs::read_dir(&src)
        .map(|d| {
            d.filter_map(|e| e.ok().map(|e| e.path()))
                .filter_map(|p| {
                    if p.is_dir() {
                        let name = p.file_name()?.to_str()?.to_string();
                        let unit = p.join(format!("{name}.cu"));
                        unit.is_file().then_some(unit)
                    } else {
                        p.extension().is_some_and(|x| x == "cu").then_some(p)
                    }
                })
                .collect()
        })
        .unwrap_or_default();
    files.sort();
    for f in &files {
        println!("cargo:rerun-if-changed={}", f.display());
    }

    let mut gen = String::from("// generated by build.rs\n");
    let nvcc = find_nvcc(&root);
    let Some(nvcc) = nvcc.filter(|_| !files.is_empty()) else {
        println!(
            "cargo:warning=erase: nvcc not found ($NVCC, $CUDA_HOME/bin, PATH, .tools/cuda): building without CUDA kernels; run scripts/install-nvcc.sh and rebuild to get them"
        );
        gen.push_str(
            "pub static MODULES: &[PtxModule] = &[];\npub static KERNELS: &[KernelInfo] = &[];\n",
        );
        gen.push_str("pub const NVCC: &str = \"\";\n");
        fs::write(out_dir.join("kernels.rs"), gen).expect("write kernels.rs");
        return;
    };

    // compile every file for both targets, two files at a time (nvcc is single-threaded)
    let jobs: Vec<_> = files
        .iter()
        .map(|f| {
            let (nvcc, src, out_dir, f) = (nvcc.clone(), src.clone(), out_dir.clone(), f.clone());
            std::thread::spawn(move || {
                let stem = f
                    .file_stem()
                    .and_then(|s| s.to_str())
                    .unwrap_or("kernels")
                    .to_string();
                let base = |c: &mut Command| {
                    c.arg("-I")
                        .arg(&src)
                        .args(["-std=c++17", "-O3", "-Xptxas=-warn-spills"]);
                };
                let mut report = String::new();
                for (arch, tag) in [("sm_90a", "sm90a"), ("sm_80", "sm80")] {
                    let ptx = out_dir.join(format!("{stem}.{tag}.ptx"));
                    let mut c = Command::new(&nvcc);
                    base(&mut c);
                    // a front-end warning (an unused variable, a narrowing) fails the build:
                    // in a kernel it is more often a bug than noise
                    c.args(["-ptx", &format!("-arch={arch}"), "-Werror", "all-warnings"])
                        .arg(&f)
                        .arg("-o")
                        .arg(&ptx);
                    run(&mut c, &format!("{} ({arch})", f.display()));
                }
                // resources as ptxas reports them for the H200
                let mut c = Command::new(&nvcc);
                base(&mut c);
                c.args([
                    "-cubin",
                    "-gencode=arch=compute_90a,code=sm_90a",
                    "-Xptxas=-v",
                ])
                .arg(&f)
                .arg("-o")
                .arg(out_dir.join(format!("{stem}.sm90a.cubin")));
                report.push_str(&run(&mut c, &format!("{} (ptxas report)", f.display())));
                let ptx = fs::read_to_string(out_dir.join(format!("{stem}.sm90a.ptx")))
                    .unwrap_or_default();
                (stem, report, parse_params(&ptx))
            })
        })
        .collect();
    let mut modules = Vec::new();
    let mut kernels = Vec::new();
    let mut summary = String::new();
    for j in jobs {
        let (stem, report, params) = j.join().expect("nvcc job panicked");
        for r in parse_ptxas(&report) {
            let p = params
                .iter()
                .find(|(n, _)| *n == r.name)
                .map(|(_, p)| p.clone())
                .unwrap_or_else(|| {
                    panic!(
                        "erase build: no .entry for kernel {} in {stem}'s PTX",
                        r.name
                    )
                });
            let _ = writeln!(
                summary,
                "{stem}: {} regs {} smem {} spill {}",
                r.name, r.regs, r.smem, r.spill
            );
            let allowed = MEASURED_SPILLS
                .iter()
                .find(|(name, _)| *name == r.name)
                .map_or(0, |&(_, bytes)| bytes);
            if r.spill > allowed {
                println!(
                    "cargo:warning=erase: kernel {} ({stem}.cu) spills {} bytes of registers",
                    r.name, r.spill
                );
            }
            kernels.push((stem.clone(), r, p));
        }
        modules.push(stem);
    }
    fs::write(out_dir.join("ptxas-report.txt"), &summary).expect("write ptxas report");
    gen.push_str("pub static MODULES: &[PtxModule] = &[\n");
    for m in &modules {
        let _ = writeln!(
            gen,
            "    PtxModule {{ file: {m:?}, sm90a: include_str!(concat!(env!(\"OUT_DIR\"), \"/{m}.sm90a.ptx\")), sm80: include_str!(concat!(env!(\"OUT_DIR\"), \"/{m}.sm80.ptx\")) }},"
        );
    }
    gen.push_str("];\npub static KERNELS: &[KernelInfo] = &[\n");
    for (m, r, p) in &kernels {
        let _ = writeln!(
            gen,
            "    KernelInfo {{ name: {:?}, file: {m:?}, regs: {}, smem: {}, spill: {}, params: {p:?} }},",
            r.name, r.regs, r.smem, r.spill
        );
    }
    gen.push_str("];\n");
    let _ = writeln!(
        gen,
        "pub const NVCC: &str = {:?};",
        nvcc.display().to_string()
    );
    fs::write(out_dir.join("kernels.rs"), gen).expect("write kernels.rs");
}
