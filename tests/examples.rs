//! The examples' library parts: the MNIST reader, the `mlp30` model (accuracy, and the
//! same bits under the detached and ERASE schedules) and `nanochat` (its loss falls; its
//! plan starts two backward programs early on side streams).
//!
//! Tests that need MNIST use `../shared/data/mnist` when it exists; otherwise (or with
//! `ERASE_TEST_SYNTHETIC_MNIST=1`) they say so and write a small synthetic MNIST-shaped
//! set of IDX files instead, so the reader and the training path always run.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Instant;

use erase::data::mnist::{self, encode_images, encode_labels, Mnist, Split, PIXELS};
use erase::graph::OptimizerConfig;
use erase::model::mlp30::{self, Mlp30Config, Mlp30Trainer, Mode};
use erase::model::nanochat::{self, NanoConfig, NanoTrainer};
use erase::runtime::program::schedule::{ScheduleKind, StreamId};

const THREADS: usize = 2;

/// A fresh, empty folder under the target dir (per process: runs may overlap).
fn scratch(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("examples-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    e.write_all(bytes).unwrap();
    e.finish().unwrap()
}

/// `n` learnable MNIST-shaped examples: digit `c` lights rows `2c+4..2c+6` over noise.
fn synthetic(n: usize, seed: u64) -> (Vec<u8>, Vec<u8>) {
    let mut pixels = vec![0u8; n * PIXELS];
    let mut labels = vec![0u8; n];
    for i in 0..n {
        let r = |k: u64| erase::runtime::init::splitmix64(seed * 1_000_003 + (i as u64) * 4096 + k);
        let c = (r(0) % 10) as usize;
        labels[i] = c as u8;
        for p in 0..PIXELS {
            let row = p / 28;
            let noise = (r(1 + p as u64) % 96) as u8;
            pixels[i * PIXELS + p] = if row / 2 == c + 2 { 160 + noise } else { noise };
        }
    }
    (pixels, labels)
}

/// Writes one split's two files, gzipped or not.
fn write_split(dir: &Path, split: Split, pixels: &[u8], labels: &[u8], gz: bool) {
    let (img, lab) = (encode_images(pixels), encode_labels(labels));
    let (img, lab, ext) = if gz {
        (gzip(&img), gzip(&lab), ".gz")
    } else {
        (img, lab, "")
    };
    std::fs::write(dir.join(format!("{}{ext}", split.images_file())), img).unwrap();
    std::fs::write(dir.join(format!("{}{ext}", split.labels_file())), lab).unwrap();
}

/// MNIST for the training tests: the real files when `../shared` has them, else a
/// synthetic stand-in written as IDX files and read back through the same reader.
fn mnist_data() -> &'static (Mnist, Mnist, bool) {
    static DATA: OnceLock<(Mnist, Mnist, bool)> = OnceLock::new();
    DATA.get_or_init(|| {
        let real = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/data/mnist");
        let forced = std::env::var_os("ERASE_TEST_SYNTHETIC_MNIST").is_some();
        let (dir, is_real) = if real.is_dir() && !forced {
            (real, true)
        } else {
            eprintln!(
                "NOTE: {} {}: the MNIST tests train on a synthetic MNIST-shaped set instead",
                real.display(),
                if forced {
                    "is skipped (ERASE_TEST_SYNTHETIC_MNIST)"
                } else {
                    "is missing"
                }
            );
            let d = scratch("synthetic-mnist");
            let (p, l) = synthetic(6000, 1);
            write_split(&d, Split::Train, &p, &l, true);
            let (p, l) = synthetic(1000, 2);
            write_split(&d, Split::Test, &p, &l, false);
            (d, false)
        };
        let t0 = Instant::now();
        let train = mnist::load(&dir, Split::Train).unwrap();
        let test = mnist::load(&dir, Split::Test).unwrap();
        if !is_real {
            let _ = std::fs::remove_dir_all(&dir);
        }
        eprintln!(
            "MNIST from {}: {} + {} images in {:.2} s",
            dir.display(),
            train.len(),
            test.len(),
            t0.elapsed().as_secs_f64()
        );
        if is_real {
            assert_eq!((train.len(), test.len()), (60_000, 10_000));
            // the published label counts
            let count = |m: &Mnist, c: i32| m.labels.iter().filter(|&&l| l == c).count();
            assert_eq!(count(&train, 0), 5923);
            assert_eq!(count(&test, 9), 1009);
            let mean =
                train.images.iter().map(|&x| f64::from(x)).sum::<f64>() / train.images.len() as f64;
            assert!((mean - 0.1307).abs() < 1e-3, "pixel mean {mean}");
        }
        (train, test, is_real)
    })
}

// ---- the reader --------------------------------------------------------------------

#[test]
fn mnist_reader_reads_plain_and_gzip_idx_files() {
    let (p, l) = synthetic(7, 3);
    for gz in [false, true] {
        let d = scratch(&format!("reader-{gz}"));
        write_split(&d, Split::Train, &p, &l, gz);
        write_split(&d, Split::Test, &p[..2 * PIXELS], &l[..2], !gz);
        let m = mnist::load(&d, Split::Train).unwrap();
        assert_eq!(m.n, 7);
        assert_eq!(
            m.labels,
            l.iter().map(|&x| i32::from(x)).collect::<Vec<_>>()
        );
        assert_eq!(m.images.len(), 7 * PIXELS);
        for (k, (&a, &b)) in m.images.iter().zip(&p).enumerate() {
            assert_eq!(a, f32::from(b) / 255.0, "pixel {k}");
        }
        assert!(m.images.iter().all(|&x| (0.0..=1.0).contains(&x)));
        let t = mnist::load(&d, Split::Test).unwrap();
        assert_eq!(t.n, 2);
        assert_eq!(t.image(1), m.image(1));
        // batches: chosen rows, and a wrapped last batch
        let (mut img, mut lab) = (vec![0.0; 3 * PIXELS], vec![0; 3]);
        m.fill_batch(&[6, 0, 3], &mut img, &mut lab);
        assert_eq!(lab, [m.labels[6], m.labels[0], m.labels[3]]);
        assert_eq!(&img[PIXELS..2 * PIXELS], m.image(0));
        assert_eq!(m.fill_range(6, &mut img, &mut lab), 1);
        assert_eq!(lab, [m.labels[6], m.labels[0], m.labels[1]]);
        std::fs::remove_dir_all(&d).unwrap();
    }
    // a permutation, different per epoch, the same on every call
    let a = mnist::shuffled(100, 7, 0);
    let mut s = a.clone();
    s.sort();
    assert_eq!(s, (0..100).collect::<Vec<_>>());
    assert_ne!(a, mnist::shuffled(100, 7, 1));
    assert_eq!(a, mnist::shuffled(100, 7, 0));
}

fn load_err(d: &Path, split: Split) -> String {
    format!("{:#}", mnist::load(d, split).unwrap_err())
}

#[test]
fn mnist_reader_rejects_bad_files_with_clear_errors() {
    let (p, l) = synthetic(4, 5);
    let d = scratch("reader-bad");
    let imgs = d.join(Split::Train.images_file());
    let labs = d.join(Split::Train.labels_file());

    // a missing folder, a missing file
    let e = load_err(&d.join("nope"), Split::Train);
    assert!(e.contains("does not exist"), "{e}");
    let e = load_err(&d, Split::Train);
    assert!(
        e.contains("train-images-idx3-ubyte not found") && e.contains(".gz"),
        "{e}"
    );

    // the labels file where the images belong: a bad magic, named
    write_split(&d, Split::Train, &p, &l, false);
    std::fs::write(&imgs, encode_labels(&l)).unwrap();
    let e = load_err(&d, Split::Train);
    assert!(
        e.contains("bad magic 0x00000801") && e.contains("train-images-idx3-ubyte"),
        "{e}"
    );
    // garbage magic, gzipped: the magic is checked after gunzip
    std::fs::write(&imgs, gzip(b"\x12\x34\x56\x78 not an idx file")).unwrap();
    let e = load_err(&d, Split::Train);
    assert!(e.contains("bad magic 0x12345678"), "{e}");

    // truncated pixels, plain and gzip
    let full = encode_images(&p);
    std::fs::write(&imgs, &full[..full.len() - 100]).unwrap();
    let e = load_err(&d, Split::Train);
    assert!(
        e.contains("truncated") && e.contains("4 images") && e.contains("train-images"),
        "{e}"
    );
    std::fs::write(&imgs, gzip(&full[..10])).unwrap();
    let e = load_err(&d, Split::Train);
    assert!(e.contains("truncated"), "{e}");
    // a cut gzip stream
    let gz = gzip(&full);
    std::fs::write(&imgs, &gz[..gz.len() / 2]).unwrap();
    let e = load_err(&d, Split::Train);
    assert!(e.contains("corrupt or truncated gzip"), "{e}");
    // trailing bytes
    let mut long = full.clone();
    long.push(0);
    std::fs::write(&imgs, &long).unwrap();
    assert!(load_err(&d, Split::Train).contains("1 bytes after"));
    // wrong image size
    let mut odd = full.clone();
    odd[11] = 27;
    std::fs::write(&imgs, &odd).unwrap();
    assert!(load_err(&d, Split::Train).contains("27x28"));

    // labels: truncated, out of range, a count that differs from the images'
    std::fs::write(&imgs, &full).unwrap();
    let lf = encode_labels(&l);
    std::fs::write(&labs, &lf[..lf.len() - 1]).unwrap();
    let e = load_err(&d, Split::Train);
    assert!(
        e.contains("truncated") && e.contains("4 labels") && e.contains("train-labels"),
        "{e}"
    );
    std::fs::write(&labs, encode_labels(&[1, 2, 10, 3])).unwrap();
    assert!(load_err(&d, Split::Train).contains("label 2 is 10"));
    std::fs::write(&labs, encode_labels(&l[..3])).unwrap();
    let e = load_err(&d, Split::Train);
    assert!(e.contains("4 images") && e.contains("3 labels"), "{e}");
    // and the good files load
    std::fs::write(&labs, &lf).unwrap();
    assert_eq!(mnist::load(&d, Split::Train).unwrap().n, 4);
    std::fs::remove_dir_all(&d).unwrap();
}

// ---- mlp30 -------------------------------------------------------------------------

/// The test's MLP: 6 hidden layers of 128 instead of the example's 30 of 256, so that a
/// mode trains in seconds on two cores.
fn small_mlp(mode: Mode) -> Mlp30Config {
    Mlp30Config {
        mode,
        width: 128,
        layers: 6,
        batch: 128,
        ..Default::default()
    }
}

/// Trains `steps` steps (`None`: one epoch); returns (last loss, test accuracy, parameters).
fn train_mlp(cfg: &Mlp30Config, steps: Option<usize>) -> (f64, f64, Vec<u8>) {
    let (train, test, _) = mnist_data();
    let p = mlp30::plan(cfg, &OptimizerConfig::default(), 4).unwrap();
    let mut t = Mlp30Trainer::new(&p, None, 0, 1, THREADS).unwrap();
    let steps = steps.unwrap_or_else(|| t.steps_per_epoch(train));
    let t0 = Instant::now();
    let mut loss = f64::NAN;
    for _ in 0..steps {
        loss = t.train_step(train).unwrap().loss;
    }
    let secs = t0.elapsed().as_secs_f64();
    let acc = t.accuracy(test).unwrap();
    eprintln!(
        "mlp30 {} ({} layers of {}): {steps} steps in {secs:.1} s ({:.1} ms a step), loss {loss:.4}, test accuracy {:.2} %",
        cfg.mode,
        cfg.layers,
        cfg.width,
        1e3 * secs / steps as f64,
        100.0 * acc
    );
    (loss, acc, t.param_bytes().unwrap())
}

#[test]
fn mlp30_conventional_and_erase_learn_mnist() {
    let (_, _, real) = mnist_data();
    for mode in [Mode::Conventional, Mode::Erase] {
        // one epoch: 468 steps of 128 on MNIST (46 on the synthetic set)
        let (loss, acc, _) = train_mlp(&small_mlp(mode), None);
        assert!(loss.is_finite());
        assert!(
            acc > 0.90,
            "{mode}: test accuracy {:.2} % (real MNIST: {real})",
            100.0 * acc
        );
    }
}

#[test]
fn mlp30_detached_and_erase_give_the_same_bits() {
    let e = mlp30::plan(&small_mlp(Mode::Erase), &OptimizerConfig::default(), 4).unwrap();
    // every layer's backward starts early, on a side stream, round robin over the pool
    let early = e.plan.early_programs();
    assert_eq!(early.len(), 6, "{early:?}");
    assert!(early.iter().all(|(_, s)| *s != StreamId::MAIN));
    let streams: std::collections::BTreeSet<_> = early.iter().map(|x| x.1).collect();
    assert_eq!(streams.len(), 4);
    let d = mlp30::plan(&small_mlp(Mode::Detached), &OptimizerConfig::default(), 4).unwrap();
    assert_eq!(d.plan.program.streams, 1);
    assert_eq!(e.plan.program.launches.len(), d.plan.program.launches.len());

    let (le, _, pe) = train_mlp(&small_mlp(Mode::Erase), Some(5));
    let (ld, _, pd) = train_mlp(&small_mlp(Mode::Detached), Some(5));
    assert_eq!(le.to_bits(), ld.to_bits());
    assert!(
        pe == pd,
        "erase and detached parameters differ after 5 steps"
    );
    let (_, _, pc) = train_mlp(&small_mlp(Mode::Conventional), Some(5));
    // conventional has no heads; its hidden and final parameters come first and differ
    assert!(pc.len() < pe.len());
    assert!(
        pc[..] != pe[..pc.len()],
        "conventional trained like detached"
    );
}

// ---- nanochat ----------------------------------------------------------------------

/// A small repetitive text: a few sentences in a pseudo-random order.
fn chat_text() -> Vec<u8> {
    let lines = [
        "the cat sat on the mat. ",
        "a dog ran in the park. ",
        "we like to read books at night. ",
        "the sun is hot and the sea is blue. ",
        "my friend has a red bike. ",
    ];
    let mut s = Vec::new();
    for i in 0..400u64 {
        let r = erase::runtime::init::splitmix64(i) as usize % lines.len();
        s.extend_from_slice(lines[r].as_bytes());
    }
    s
}

fn small_chat() -> NanoConfig {
    NanoConfig {
        seq: 32,
        width: 64,
        heads: 2,
        layers: 3,
        batch: 8,
        aux_weight: 1.0,
    }
}

fn chat_opt() -> OptimizerConfig {
    OptimizerConfig {
        dense: erase::graph::DenseOptimizer::Adam {
            lr: 3e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
        },
        rowwise_adagrad: (0.05, 1e-8),
        presort_ids: true,
        copies_in_update: true,
    }
}

#[test]
fn nanochat_plan_starts_two_segments_early_on_side_streams() {
    let p = nanochat::plan(&small_chat(), &chat_opt(), ScheduleKind::Early, 2).unwrap();
    assert_eq!(p.plan.program.streams, 3);
    let early = p.plan.early_programs();
    let names: Vec<&str> = early.iter().map(|x| x.0.as_str()).collect();
    // the token ids' sort for the embedding's row-wise update (on the first side stream,
    // out of the round robin), then the two segments
    assert_eq!(names, ["seg0/inputs", "seg0", "seg1"]);
    assert_eq!(
        early.iter().map(|x| x.1).collect::<Vec<_>>(),
        [StreamId(1), StreamId(1), StreamId(2)]
    );
    // each starts before the main loss's forward is done
    let g = &p.plan.graph;
    let last_forward = p
        .plan
        .program
        .launches
        .iter()
        .rposition(|l| g.node(l.node).phase == erase::graph::Phase::Forward)
        .unwrap();
    for bp in p.plan.partition.programs.iter().filter(|b| b.early) {
        let first = p
            .plan
            .program
            .launches
            .iter()
            .position(|l| l.node == bp.nodes[0])
            .unwrap();
        assert!(first < last_forward, "{} starts after the forward", bp.name);
    }
    let text = p.plan.render();
    assert!(text.contains("side2") && text.contains("[join]"), "{text}");
    // the segments
    let c = NanoConfig {
        layers: 7,
        ..small_chat()
    };
    assert_eq!(
        [c.segment(0), c.segment(1), c.segment(2)],
        [0..2, 2..5, 5..7]
    );
    // head dims the CUDA kernels do not take are refused
    let bad = NanoConfig {
        width: 96,
        ..small_chat()
    };
    let e = format!("{:#}", nanochat::build(&bad).err().unwrap());
    assert!(e.contains("32 or 64"), "{e}");
}

#[test]
fn nanochat_loss_falls_and_erase_matches_serial() {
    let text = chat_text();
    let p = nanochat::plan(&small_chat(), &chat_opt(), ScheduleKind::Early, 2).unwrap();
    let mut t = NanoTrainer::new(&p, &text, None, 0, 1, THREADS).unwrap();
    let t0 = Instant::now();
    let losses: Vec<f64> = (0..100).map(|_| t.train_step().unwrap().loss).collect();
    let (first, last) = (losses[0], losses[99]);
    eprintln!(
        "nanochat: loss {first:.4} -> {last:.4} in 100 steps, {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    assert!(last < 0.8 * first, "loss {first} -> {last}");
    let out = t.generate(b"the cat ", 16).unwrap();
    assert_eq!(out.len(), 16);
    eprintln!("greedy: the cat {}", String::from_utf8_lossy(&out));

    // the serial schedule of the same graph gives the same bits
    let s = nanochat::plan(&small_chat(), &chat_opt(), ScheduleKind::Serial, 2).unwrap();
    let mut ts = NanoTrainer::new(&s, &text, None, 0, 1, THREADS).unwrap();
    let mut te = NanoTrainer::new(&p, &text, None, 0, 1, THREADS).unwrap();
    for step in 0..3 {
        let (a, b) = (te.train_step().unwrap(), ts.train_step().unwrap());
        assert_eq!(a.loss.to_bits(), b.loss.to_bits(), "step {step}");
        assert_eq!(a.aux, b.aux, "step {step}");
    }
}

#[test]
fn nanochat_refuses_missing_empty_and_short_texts() {
    let d = scratch("chat-text");
    let e = format!(
        "{:#}",
        nanochat::load_text(&d.join("none.txt")).unwrap_err()
    );
    assert!(e.contains("none.txt"), "{e}");
    std::fs::write(d.join("empty.txt"), b"").unwrap();
    let e = format!(
        "{:#}",
        nanochat::load_text(&d.join("empty.txt")).unwrap_err()
    );
    assert!(e.contains("empty"), "{e}");
    let p = nanochat::plan(&small_chat(), &chat_opt(), ScheduleKind::Early, 2).unwrap();
    let short = vec![b'a'; 32];
    let e = format!(
        "{:#}",
        NanoTrainer::new(&p, &short, None, 0, 1, 1).err().unwrap()
    );
    assert!(e.contains("32 bytes") && e.contains("33"), "{e}");
    std::fs::remove_dir_all(&d).unwrap();
}

/// The paper's limit on nanochat: at GPU sizes the fused attention backward fills every SM
/// for long, so the occupancy rule keeps it from overlapping anything; without the rule
/// the early backward of a cut-off segment runs beside later forward work.
#[test]
fn nanochat_attention_backward_runs_alone_under_the_occupancy_rule() {
    use erase::model::stepper::StepSchedule;
    use erase::runtime::cuda::graph::program_reachability;
    let gpu_sized = NanoConfig {
        seq: 1024,
        width: 512,
        heads: 8,
        layers: 6,
        batch: 16,
        aux_weight: 1.0,
    };
    let mut alone = Vec::new();
    for occupancy in [erase::train::Occupancy::On, erase::train::Occupancy::Off] {
        let p = nanochat::plan_with(
            &gpu_sized,
            &chat_opt(),
            &StepSchedule {
                kind: ScheduleKind::Early,
                side_streams: 2,
                occupancy,
            },
        )
        .unwrap();
        let prog = &p.plan.program;
        let kernels: Vec<bool> = prog.launches.iter().map(|l| l.spec.is_some()).collect();
        let r = program_reachability(prog, &kernels);
        let g = &p.plan.graph;
        let attn_bwd: Vec<usize> = (0..prog.launches.len())
            .filter(|&i| {
                kernels[i]
                    && prog.launches[i].stream.0 != 0
                    && g.node(prog.launches[i].node).phase == erase::graph::Phase::Backward
                    && prog.launches[i].label.op.contains("attention")
            })
            .collect();
        assert!(!attn_bwd.is_empty(), "no early attention backward launch");
        // launches on other streams that may run at the same time as it
        let concurrent = attn_bwd
            .iter()
            .map(|&a| {
                (0..prog.launches.len())
                    .filter(|&b| {
                        kernels[b]
                            && b != a
                            && r.ordered(a, b) == Some(false)
                            && r.ordered(b, a) == Some(false)
                    })
                    .count()
            })
            .sum::<usize>();
        alone.push(concurrent);
    }
    assert_eq!(
        alone[0], 0,
        "with the occupancy rule the attention backward overlaps {} launches",
        alone[0]
    );
    assert!(
        alone[1] > 0,
        "without the rule the early attention backward should overlap later forward work"
    );
}
