//! Kernel benchmarks on the GPU: bf16 GEMM at 4096³ and at every GEMM shape of the CTR
//! model (forward, data gradient, weight gradient), fused attention forward+backward,
//! embedding bag forward and backward+update, and a copy for the bandwidth ceiling.
//! Prints a table; with `--json FILE` also writes one JSON object per line, which
//! `scripts/torch_kernels.py` reads to put PyTorch's times beside ours.
//!
//! With `--contention`, instead: what two device-filling launches cost side by side
//! against one after the other (compute-bound GEMMs, memory-bound adds, one of each), the
//! occupancy model's contention cost.
//!
//! `cargo bench --bench kernels -- [--json FILE] [--quick] [--only WORD] [--model NAME]`
//! (`--only gemm` runs only the benchmarks whose kind or name holds WORD; `--only "gemm dx
//! M=4096 N=64 K=1728"` one GEMM shape, for a profiler; `--model dcnv2` takes the GEMM
//! shapes of that model at the spec preset's sizes instead of the spec model's).

use std::collections::BTreeSet;
use std::io::Write as _;

use erase::graph::{DType, Op, OptimizerConfig, Shape};
use erase::model::ctr::CtrConfig;
use erase::ops::Buffer;
use erase::runtime::cuda::CudaDevice;
use erase::runtime::init::{splitmix64, to_unit};
use erase::train::{plan_step, ScheduleOptions};

fn rand(seed: u64, n: usize, scale: f32) -> Buffer {
    Buffer::F32(
        (0..n)
            .map(|i| scale * (2.0 * to_unit(splitmix64(seed * 7919 + i as u64)) as f32 - 1.0))
            .collect(),
    )
}

struct Row {
    name: String,
    kind: &'static str,
    ms: f64,
    flops: f64,
    bytes: f64,
    /// Shape description PyTorch's side needs (JSON fragment).
    torch: String,
}

struct Bench<'a> {
    dev: &'a CudaDevice,
    iters: usize,
    rows: Vec<Row>,
    only: Option<String>,
}

impl Bench<'_> {
    /// Whether `--only` leaves out the benchmark of this kind.
    fn skip(&self, kind: &str) -> bool {
        self.only
            .as_ref()
            .is_some_and(|w| !kind.contains(w.as_str()))
    }

    fn time(
        &mut self,
        op: &Op,
        ins: &[(Shape, Buffer)],
        outs: &[(Shape, DType)],
        upd: &[(Shape, Buffer)],
    ) -> f64 {
        let i: Vec<(&Shape, &Buffer)> = ins.iter().map(|(s, b)| (s, b)).collect();
        let u: Vec<(&Shape, &Buffer)> = upd.iter().map(|(s, b)| (s, b)).collect();
        match self.dev.time_node(op, &i, outs, &u, 3, self.iters) {
            Ok(ms) => ms,
            Err(e) => {
                eprintln!("{}: {e}", op.name());
                f64::NAN
            }
        }
    }

    /// `[m,k]·[k,n]` style GEMMs: kind is linear (x·wᵀ+b), linear_add (x·wᵀ+b+r), dx
    /// (dy·w), dw (dyᵀ·x) or mm;
    /// `dy16`: dy is bf16, as the model's op that makes it writes it (the GEMM reads it
    /// as it is; its other operand is f32).
    fn gemm(&mut self, kind: &'static str, m: usize, n: usize, k: usize, dy16: bool) {
        // the row's name, so that `--only "gemm dx M=4096 N=64 K=1728"` picks one shape
        // (under a profiler, say)
        if self.skip(&format!("gemm {kind} M={m} N={n} K={k}")) {
            return;
        }
        type Case = (Op, Vec<(Shape, Buffer)>, Vec<(Shape, DType)>);
        let (op, ins, outs): Case = match kind {
            "linear" => (
                Op::Linear {
                    bias: true,
                    relu: false,
                },
                vec![
                    (Shape::new(&[m, k]), rand(1, m * k, 1.0)),
                    (Shape::new(&[n, k]), rand(2, n * k, 0.1)),
                    (Shape::new(&[n]), rand(3, n, 0.1)),
                ],
                vec![(Shape::new(&[m, n]), DType::F32)],
            ),
            "linear_add" => (
                Op::LinearAdd { bias: true },
                vec![
                    (Shape::new(&[m, k]), rand(1, m * k, 1.0)),
                    (Shape::new(&[n, k]), rand(2, n * k, 0.1)),
                    (Shape::new(&[n]), rand(3, n, 0.1)),
                    (Shape::new(&[m, n]), rand(4, m * n, 1.0)),
                ],
                vec![(Shape::new(&[m, n]), DType::F32)],
            ),
            "dx" => (
                Op::LinearGradInput {
                    relu_mask: false,
                    residual: false,
                },
                vec![
                    (Shape::new(&[m, n]), rand(1, m * n, 1.0)),
                    (Shape::new(&[n, k]), rand(2, n * k, 0.1)),
                ],
                vec![(Shape::new(&[m, k]), DType::F32)],
            ),
            "dw" => (
                Op::LinearGradWeight { bias: false },
                vec![
                    (Shape::new(&[m, n]), rand(1, m * n, 1.0)),
                    (Shape::new(&[m, k]), rand(2, m * k, 1.0)),
                ],
                vec![(Shape::new(&[n, k]), DType::F32)],
            ),
            _ => (
                Op::MatMul {
                    ta: false,
                    tb: false,
                },
                vec![
                    (Shape::new(&[m, k]), rand(1, m * k, 1.0)),
                    (Shape::new(&[k, n]), rand(2, k * n, 1.0)),
                ],
                vec![(Shape::new(&[m, n]), DType::F32)],
            ),
        };
        let mut ins = ins;
        if dy16 {
            ins[0].1 = Buffer::from_f64(DType::Bf16, &ins[0].1.to_f64());
        }
        let ms = self.time(&op, &ins, &outs, &[]);
        let dy_bytes = if dy16 { 2.0 } else { 4.0 } * (m * n) as f64;
        self.rows.push(Row {
            name: format!(
                "gemm {kind} M={m} N={n} K={k}{}",
                if dy16 { " (bf16 dy)" } else { "" }
            ),
            kind: "gemm",
            ms,
            flops: 2.0 * (m * n * k) as f64,
            bytes: match kind {
                "dx" | "dw" => dy_bytes + 4.0 * (n * k + m * k) as f64,
                "linear_add" => 4.0 * (m * k + n * k + 2 * m * n) as f64,
                _ => 4.0 * (m * k + n * k + m * n) as f64,
            },
            torch: format!("{{\"op\":\"gemm\",\"kind\":\"{kind}\",\"m\":{m},\"n\":{n},\"k\":{k}}}"),
        });
        // a plan of several launches: each one's time beside the whole (where it goes)
        let i: Vec<(&Shape, &Buffer)> = ins.iter().map(|(s, b)| (s, b)).collect();
        match self.dev.time_node_calls(&op, &i, &outs, 3, self.iters) {
            Ok(calls) if calls.len() > 1 => {
                for (kernel, ms) in calls {
                    // the pipelined pass with its epilogue is the GEMM as the model runs
                    // it on bf16 copies (the rounding passes shared with other GEMMs):
                    // PyTorch's bf16 op plus epilogue is its twin
                    let main =
                        kernel.starts_with("gemm_bf16p_") || kernel.starts_with("gemm_bf16t_");
                    self.rows.push(Row {
                        name: format!("  {kind} {m}x{n}x{k}: pass {kernel}"),
                        kind: "gemm",
                        ms,
                        flops: if main { 2.0 * (m * n * k) as f64 } else { 0.0 },
                        bytes: 0.0,
                        torch: if main {
                            format!("{{\"op\":\"gemm\",\"kind\":\"{kind}\",\"m\":{m},\"n\":{n},\"k\":{k}}}")
                        } else {
                            "{\"op\":\"none\"}".into()
                        },
                    });
                }
            }
            Ok(_) => {}
            Err(e) => eprintln!("gemm {kind} passes: {e}"),
        }
    }

    /// The pipelined GEMM's passes at n³ timed one by one: the wgmma kernel alone is a
    /// bf16 GEMM (operands already bf16 in device memory), what `torch.matmul` on bf16
    /// tensors measures; the rounding of the f32 operands is the pass before it.
    fn gemm_bf16_kernel(&mut self, n: usize) {
        if self.skip("gemm mm") {
            return;
        }
        let op = Op::MatMul {
            ta: false,
            tb: false,
        };
        let ins = [
            (Shape::new(&[n, n]), rand(1, n * n, 1.0)),
            (Shape::new(&[n, n]), rand(2, n * n, 1.0)),
        ];
        let i: Vec<(&Shape, &Buffer)> = ins.iter().map(|(s, b)| (s, b)).collect();
        let outs = [(Shape::new(&[n, n]), DType::F32)];
        let calls = match self.dev.time_node_calls(&op, &i, &outs, 3, self.iters) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("gemm passes: {e}");
                return;
            }
        };
        for (kernel, ms) in calls {
            let main = kernel.starts_with("gemm_bf16p_") || kernel.starts_with("gemm_bf16t_");
            self.rows.push(Row {
                name: format!("gemm mm M={n} N={n} K={n}: pass {kernel}"),
                kind: "gemm",
                ms,
                flops: if main { 2.0 * (n * n * n) as f64 } else { 0.0 },
                bytes: if main {
                    (4 * n * n + 4 * n * n) as f64
                } else {
                    12.0 * (n * n) as f64
                },
                // the wgmma pass is the bf16 GEMM PyTorch times; the others have no twin
                torch: if main {
                    format!("{{\"op\":\"gemm\",\"kind\":\"mm\",\"m\":{n},\"n\":{n},\"k\":{n}}}")
                } else {
                    "{\"op\":\"none\"}".into()
                },
            });
        }
    }

    fn attention(&mut self, b: usize, h: usize, s: usize, dh: usize) {
        if self.skip("attention") {
            return;
        }
        let w = h * dh;
        let x = |seed| (Shape::new(&[b, s, w]), rand(seed, b * s * w, 1.0));
        let (q, k, v) = (x(1), x(2), x(3));
        let fwd = Op::Attention {
            heads: h,
            causal: false,
            packed: false,
        };
        let outs = vec![
            (Shape::new(&[b, s, w]), DType::F32),
            (Shape::new(&[b, h, s]), DType::F32),
        ];
        let ins = vec![q.clone(), k.clone(), v.clone()];
        let f_ms = self.time(&fwd, &ins, &outs, &[]);
        // backward inputs: do, q, k, v, o, lse (o and lse from a forward run)
        let i: Vec<(&Shape, &Buffer)> = ins.iter().map(|(s, b)| (s, b)).collect();
        let fo = self
            .dev
            .run_node(&fwd, &i, &outs, &mut [])
            .unwrap_or_default();
        let b_ms = if fo.len() == 2 {
            let bins = vec![
                x(4),
                q,
                k,
                v,
                (Shape::new(&[b, s, w]), fo[0].clone()),
                (Shape::new(&[b, h, s]), fo[1].clone()),
            ];
            let bouts = vec![(Shape::new(&[b, s, w]), DType::F32); 3];
            self.time(
                &Op::AttentionGrad {
                    heads: h,
                    causal: false,
                    packed: false,
                },
                &bins,
                &bouts,
                &[],
            )
        } else {
            f64::NAN
        };
        let flops = 4.0 * (b * h * s * s * dh) as f64;
        println!(
            "attention B={b} H={h} S={s} D={dh}: forward {:.1} µs ({:.1} TFLOP/s), backward {:.1} µs ({:.1} TFLOP/s useful)",
            f_ms * 1e3,
            flops / (f_ms * 1e-3) / 1e12,
            b_ms * 1e3,
            2.5 * flops / (b_ms * 1e-3) / 1e12
        );
        self.rows.push(Row {
            name: format!("attention fwd+bwd B={b} H={h} S={s} D={dh}"),
            kind: "attention",
            ms: f_ms + b_ms,
            flops: 3.5 * flops,
            bytes: 4.0 * (b * s * w * 11) as f64,
            torch: format!("{{\"op\":\"sdpa\",\"b\":{b},\"h\":{h},\"s\":{s},\"d\":{dh}}}"),
        });
    }

    fn embedding(&mut self, batch: usize, fields: usize, rows: usize, d: usize) {
        if self.skip("embedding") {
            return;
        }
        let field_rows = vec![rows; fields];
        let nnz = batch * fields;
        let ids: Vec<i32> = (0..nnz)
            .map(|i| (splitmix64(i as u64) % rows as u64) as i32)
            .collect();
        let offsets: Vec<i32> = (0..=nnz as i32).collect();
        let table = (
            Shape::new(&[rows * fields, d]),
            rand(5, rows * fields * d, 0.01),
        );
        let ids = (Shape::new(&[nnz]), Buffer::I32(ids));
        let offs = (Shape::new(&[nnz + 1]), Buffer::I32(offsets));
        let fwd = Op::EmbeddingBag {
            field_rows: field_rows.clone(),
        };
        let ms = self.time(
            &fwd,
            &[table.clone(), ids.clone(), offs.clone()],
            &[(Shape::new(&[batch, fields, d]), DType::F32)],
            &[],
        );
        // the bytes a lookup must move: each looked-up row read once, each bag written once
        let bytes = (2 * nnz * d * 4) as f64;
        self.rows.push(Row {
            name: format!("embedding_bag fwd B={batch} F={fields} rows={rows} D={d}"),
            kind: "bytes",
            ms,
            flops: 0.0,
            bytes,
            torch: format!("{{\"op\":\"embedding_bag\",\"b\":{batch},\"f\":{fields},\"rows\":{rows},\"d\":{d}}}"),
        });
        let upd = Op::RowwiseAdagrad {
            lr: 0.01,
            eps: 1e-8,
            field_rows,
        };
        let dp = (Shape::new(&[batch, fields, d]), rand(6, nnz * d, 1.0));
        let acc = (
            Shape::new(&[rows * fields]),
            Buffer::F32(vec![0.0; rows * fields]),
        );
        let ms = self.time(&upd, &[ids, offs, dp], &[], &[table, acc]);
        self.rows.push(Row {
            name: format!("embedding bwd+rowwise adagrad B={batch} F={fields}"),
            kind: "bytes",
            ms,
            flops: 0.0,
            // gradient read, rows read and written, accumulators read and written
            bytes: (3 * nnz * d * 4 + 2 * nnz * 4) as f64,
            torch: "{\"op\":\"none\"}".into(),
        });
    }

    fn copy(&mut self, n: usize) {
        let ms = self.time(
            &Op::Reshape,
            &[(Shape::new(&[n]), rand(9, n, 1.0))],
            &[(Shape::new(&[n]), DType::F32)],
            &[],
        );
        self.rows.push(Row {
            name: format!("copy {} MiB", (n * 4) >> 20),
            kind: "bytes",
            ms,
            flops: 0.0,
            bytes: (2 * n * 4) as f64,
            torch: format!("{{\"op\":\"copy\",\"n\":{n}}}"),
        });
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let json = args
        .iter()
        .position(|a| a == "--json")
        .and_then(|i| args.get(i + 1))
        .cloned();
    let quick = args.iter().any(|a| a == "--quick");
    let only = args
        .iter()
        .position(|a| a == "--only")
        .and_then(|i| args.get(i + 1))
        .cloned();
    let dev = match erase::gpu::open_device() {
        Ok(d) => d,
        Err(e) => {
            println!("skipped: no CUDA device ({e:#})");
            return;
        }
    };
    println!(
        "device: {} ({} SMs), PTX {:?}",
        dev.name, dev.sms, dev.target
    );
    if args.iter().any(|a| a == "--contention") {
        contention(&dev, json.as_deref());
        return;
    }
    let mut b = Bench {
        dev: &dev,
        iters: if quick { 5 } else { 20 },
        rows: Vec::new(),
        only,
    };
    b.copy(1 << 28);
    b.gemm("mm", 4096, 4096, 4096, false);
    b.gemm_bf16_kernel(4096);
    // every GEMM shape of the spec's CTR model (or --model's, at the spec preset's sizes)
    // at batch 4096
    let model = args
        .iter()
        .position(|a| a == "--model")
        .and_then(|i| args.get(i + 1))
        .cloned()
        .unwrap_or_else(|| "spec".into());
    let cfg = match erase::model::api::configure(&model, CtrConfig::default(), true) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("--model {model}: {e:#}");
            std::process::exit(2);
        }
    };
    let mut shapes = BTreeSet::new();
    if let Ok(p) = plan_step(
        &cfg,
        DType::F32,
        &OptimizerConfig::default(),
        &ScheduleOptions::default(),
    ) {
        let g = &p.model.graph;
        for l in &p.program.launches {
            let n = g.node(l.node);
            let s = |i: usize| g.shape(n.inputs[i]).clone();
            // a bf16 dy beside an f32 operand: written so by the op that makes it, read
            // as it is (a bf16 dy beside a bf16 copy is a copied layer's: the benchmark
            // feeds f32 and times its pipelined pass apart)
            let dy16 = || g.dtype(n.inputs[0]) == DType::Bf16 && g.dtype(n.inputs[1]) == DType::F32;
            match n.op {
                Op::Linear { .. } => {
                    let (x, w) = (s(0), s(1));
                    shapes.insert(("linear", x.rows(), w.dims()[0], w.dims()[1], false));
                }
                Op::LinearAdd { .. } => {
                    let (x, w) = (s(0), s(1));
                    shapes.insert(("linear_add", x.rows(), w.dims()[0], w.dims()[1], false));
                }
                Op::LinearGradInput { .. } => {
                    let (dy, w) = (s(0), s(1));
                    shapes.insert(("dx", dy.rows(), w.dims()[0], w.dims()[1], dy16()));
                }
                Op::LinearGradWeight { .. } => {
                    let (dy, x) = (s(0), s(1));
                    shapes.insert(("dw", dy.rows(), dy.last(), x.last(), dy16()));
                }
                _ => {}
            }
        }
    }
    for (kind, m, n, k, dy16) in shapes {
        b.gemm(kind, m, n, k, dy16);
    }
    b.attention(4096, 2, 27, 32);
    b.attention(8, 8, 2048, 64);
    b.embedding(4096, 26, 100_000, 64);

    let copy_bw = b.rows.first().map_or(f64::NAN, |r| r.bytes / (r.ms * 1e-3));
    println!(
        "{:<58} {:>10} {:>10} {:>10} {:>8}",
        "benchmark", "µs", "TFLOP/s", "GB/s", "of copy"
    );
    let mut f = json.as_ref().and_then(|p| std::fs::File::create(p).ok());
    for r in &b.rows {
        let s = r.ms * 1e-3;
        let (tf, gb) = (r.flops / s / 1e12, r.bytes / s / 1e9);
        let frac = if r.kind == "bytes" {
            format!("{:.0} %", 100.0 * r.bytes / s / copy_bw)
        } else {
            String::new()
        };
        println!(
            "{:<58} {:>10.1} {:>10.1} {:>10.0} {:>8}",
            r.name,
            r.ms * 1e3,
            tf,
            gb,
            frac
        );
        if let Some(f) = &mut f {
            let _ = writeln!(
                f,
                "{{\"name\":\"{}\",\"ms\":{},\"flops\":{},\"bytes\":{},\"torch\":{}}}",
                r.name, r.ms, r.flops, r.bytes, r.torch
            );
        }
    }
}

/// The contention of pairs of device-filling launches: each alone, in sequence and side
/// by side on two streams; `together / serial - 1` is the cost the occupancy model
/// charges two such launches sharing the device (0: the device's work is conserved,
/// negative: they overlap usefully).
fn contention(dev: &CudaDevice, json: Option<&str>) {
    let linear = Op::Linear {
        bias: false,
        relu: false,
    };
    let mut f = json.and_then(|p| std::fs::File::create(p).ok());
    println!(
        "{:<44} {:>9} {:>9} {:>9} {:>9} {:>8}",
        "pair (side by side on two streams)", "A µs", "B µs", "A;B µs", "A|B µs", "cost"
    );
    for rows in [4096usize, 16384] {
        let (x, w, y) = (
            Shape::new(&[rows, 1728]),
            Shape::new(&[1024, 1728]),
            Shape::new(&[rows, 1024]),
        );
        let (x1, w1, x2, w2) = (
            rand(1, x.numel(), 1.0),
            rand(2, w.numel(), 0.05),
            rand(3, x.numel(), 1.0),
            rand(4, w.numel(), 0.05),
        );
        // an add moving about as many bytes as the GEMM takes time
        let e = Shape::new(&[rows, 4096]);
        let (p, q, r, t) = (
            rand(5, e.numel(), 1.0),
            rand(6, e.numel(), 1.0),
            rand(7, e.numel(), 1.0),
            rand(8, e.numel(), 1.0),
        );
        let g1 = [(&x, &x1), (&w, &w1)];
        let g2 = [(&x, &x2), (&w, &w2)];
        let a1 = [(&e, &p), (&e, &q)];
        let a2 = [(&e, &r), (&e, &t)];
        let gout = [(y.clone(), DType::F32)];
        let aout = [(e.clone(), DType::F32)];
        let pairs: [(
            &str,
            erase::runtime::cuda::TimedOp,
            erase::runtime::cuda::TimedOp,
        ); 3] = [
            (
                "compute+compute",
                (&linear, &g1, &gout),
                (&linear, &g2, &gout),
            ),
            (
                "compute+memory",
                (&linear, &g1, &gout),
                (&Op::Add, &a1, &aout),
            ),
            (
                "memory+memory",
                (&Op::Add, &a1, &aout),
                (&Op::Add, &a2, &aout),
            ),
        ];
        for (name, a, b) in pairs {
            let label = format!("{name}, {rows} rows");
            match dev.time_pair(a, b, 5, 30) {
                Ok(t) => {
                    let cost = t.together_ms / t.serial_ms - 1.0;
                    println!(
                        "{:<44} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>7.1} %",
                        label,
                        t.a_ms * 1e3,
                        t.b_ms * 1e3,
                        t.serial_ms * 1e3,
                        t.together_ms * 1e3,
                        100.0 * cost
                    );
                    if let Some(f) = &mut f {
                        let _ = writeln!(
                            f,
                            "{{\"pair\":\"{name}\",\"rows\":{rows},\"a_ms\":{},\"b_ms\":{},\"serial_ms\":{},\"together_ms\":{},\"cost\":{cost}}}",
                            t.a_ms, t.b_ms, t.serial_ms, t.together_ms
                        );
                    }
                }
                Err(e) => println!("{label}: {e}"),
            }
        }
    }
}
