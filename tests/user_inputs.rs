//! The data and state users have, through the `erase-ctr` binary as they run it: real
//! layouts (Criteo with float-written integers, Avazu with no dense features, multi-hot
//! lists, per-field table sizes, zstd) train, and bad input or state is refused with a
//! message that names the problem and where, before any work is lost.

mod common;

use std::path::Path;
use std::process::{Command, Output};

const EXE: &str = env!("CARGO_BIN_EXE_erase-ctr");

fn fixture(p: &str) -> String {
    format!("{}/tests/data/{p}", env!("CARGO_MANIFEST_DIR"))
}

fn tmpdir(tag: &str) -> common::TempDir {
    common::TempDir::new(&format!("user-{tag}"))
}

/// `erase-ctr ARGS` on the CPU with a small model.
fn run(args: &[&str]) -> Output {
    Command::new(EXE).args(args).output().unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// A run that must fail with each of `parts` in its message.
fn fails_with(o: &Output, parts: &[&str]) {
    let t = text(o);
    assert!(!o.status.success(), "expected a failure, got success:\n{t}");
    for p in parts {
        assert!(t.contains(p), "the message lacks '{p}':\n{t}");
    }
}

fn ok(o: &Output) -> String {
    let t = text(o);
    assert!(o.status.success(), "failed:\n{t}");
    t
}

/// What `eval` prints of checkpoint `ckp` on 128 held-out examples (it must succeed).
fn eval_checkpoint(ckp: &str) -> String {
    ok(&run(&[
        "eval",
        "--device",
        "cpu",
        "--checkpoint",
        ckp,
        "--eval-examples",
        "128",
    ]))
}

/// The final NE a `train` run printed.
fn final_ne(out: &str) -> f64 {
    let line = out
        .lines()
        .find(|l| l.trim_start().starts_with("NE  final"))
        .unwrap_or_else(|| panic!("no final NE in:\n{out}"));
    line.split_whitespace().nth(2).unwrap().parse().unwrap()
}

const SMALL: [&str; 12] = [
    "--device",
    "cpu",
    "--batch",
    "64",
    "--rows",
    "2000",
    "--eval-every",
    "0",
    "--eval-examples",
    "1000",
    "--threads",
    "2",
];

fn train(extra: &[&str]) -> Output {
    let mut a = vec!["train"];
    a.extend(SMALL);
    a.extend(extra);
    run(&a)
}

fn write(dir: &Path, name: &str, text: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p.to_str().unwrap().to_string()
}

const MULTIHOT_SCHEMA: &str = r#"[data.schema]
label = "label"
dense = ["price"]
categorical = ["user", "item", "genres"]
list_separator = "|"
"#;

#[test]
fn real_layouts_train_and_learn() {
    let dir = tmpdir("layouts");
    // Criteo with integers written as floats: every line is an example
    let out = ok(&train(&[
        "--steps",
        "40",
        "--data",
        &format!("criteo:{}", fixture("criteo_floats.tsv")),
    ]));
    assert!(out.contains("1500 examples, 0 malformed"), "{out}");
    let ne = final_ne(&out);
    assert!(ne < 0.99, "Criteo floats: NE {ne} after 40 steps\n{out}");

    // Avazu: no dense features, so no bottom MLP
    let cfg = format!("{}/configs/avazu.toml", env!("CARGO_MANIFEST_DIR"));
    let out = ok(&train(&[
        "--steps",
        "40",
        "--config",
        &cfg,
        "--data",
        &format!("tsv:{}", fixture("avazu_sample.csv")),
    ]));
    assert!(out.contains("0 dense and 22 categorical fields"), "{out}");
    let ne = final_ne(&out);
    assert!(ne < 0.99, "Avazu: NE {ne} after 40 steps\n{out}");

    // multi-hot lists of any length, sum-pooled
    let cfg = write(&dir, "multi.toml", MULTIHOT_SCHEMA);
    let data = format!("tsv:{}", fixture("multihot_sample.tsv"));
    let cache = dir.join("cache");
    let args = [
        "--steps",
        "40",
        "--config",
        &cfg,
        "--data",
        &data,
        "--cache-dir",
        cache.to_str().unwrap(),
    ];
    let out = ok(&train(&args));
    assert!(out.contains("bag slots per field [1, 1, 5]"), "{out}");
    let ne = final_ne(&out);
    assert!(ne < 0.99, "multi-hot: NE {ne} after 40 steps\n{out}");
    // the multi-hot cache gives the same examples, so the same bits
    let again = ok(&train(&args));
    assert!(again.contains("from cache"), "{again}");
    assert_eq!(final_ne(&again), ne);
    // the same lists mean-pooled (configs/multihot.toml)
    let mean = format!("{}/configs/multihot.toml", env!("CARGO_MANIFEST_DIR"));
    let out = ok(&train(&["--config", &mean, "--data", &data]));
    let ne_mean = final_ne(&out);
    assert!(
        ne_mean < 1.0 && ne_mean != ne,
        "mean pooling: NE {ne_mean}\n{out}"
    );
}

/// `eval` takes the model a checkpoint records and refuses one that computes otherwise
/// (the same parameters pooled another way), naming the setting.
#[test]
fn eval_takes_the_recorded_model_and_refuses_another() {
    let dir = tmpdir("eval-model");
    let ck = dir.join("dlrm.st");
    let ckp = ck.to_str().unwrap();
    ok(&run(&[
        "train",
        "--device",
        "cpu",
        "--model",
        "dlrm",
        "--batch",
        "64",
        "--rows",
        "500",
        "--steps",
        "2",
        "--eval-every",
        "0",
        "--checkpoint",
        ckp,
    ]));
    let out = eval_checkpoint(ckp);
    assert!(out.contains("step 2, NE"), "{out}");

    // sum-pooled genres in training, mean-pooled in eval
    let sum = write(
        &dir,
        "sum.toml",
        &format!("[model]\nbatch = 64\nrows = 2000\n{MULTIHOT_SCHEMA}"),
    );
    let mean = format!("{}/configs/multihot.toml", env!("CARGO_MANIFEST_DIR"));
    let data = format!("tsv:{}", fixture("multihot_sample.tsv"));
    let ck = dir.join("multi.st");
    let ckp = ck.to_str().unwrap();
    ok(&train(&[
        "--config",
        &sum,
        "--data",
        &data,
        "--steps",
        "2",
        "--checkpoint",
        ckp,
    ]));
    let eval = |cfg: &str| {
        run(&[
            "eval",
            "--device",
            "cpu",
            "--config",
            cfg,
            "--data",
            &data,
            "--checkpoint",
            ckp,
        ])
    };
    ok(&eval(&sum));
    fails_with(
        &eval(&mean),
        &[
            "multi.st was trained with another model",
            "model.mean_fields",
        ],
    );
}

/// `plan` predicts with --contention and refuses a predicted trace as --measured; `bench`
/// refuses a mode named twice and, on the CPU, the flags that read CUDA traces, and gives
/// no MFU there (it is a GPU's rate).
#[test]
fn plan_and_bench_honour_their_flags_or_refuse_them() {
    let dir = tmpdir("plan-bench-flags");
    let erase_us = |extra: &[&str]| -> f64 {
        let mut a = vec!["plan", "--preset", "spec"];
        a.extend(extra);
        let out = ok(&run(&a));
        out.lines()
            .find_map(|l| l.trim_start().strip_prefix("erase "))
            .and_then(|l| l.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no erase row:\n{out}"))
    };
    let free = erase_us(&[]);
    let costly = erase_us(&["--contention", "0.5,0.5,0.5"]);
    assert!(
        costly > free,
        "--contention 0.5: {costly} µs against {free}"
    );

    let trace = dir.join("predicted.json");
    ok(&run(&["plan", "--trace", trace.to_str().unwrap()]));
    fails_with(
        &run(&["plan", "--measured", trace.to_str().unwrap()]),
        &["--measured", "predicted (simulator), not measured"],
    );

    // the placement flags without the ranks they place tables over
    fails_with(
        &run(&["plan", "--sharding", "row"]),
        &["--sharding row", "give --gpus"],
    );
    fails_with(
        &run(&["plan", "--rank-memory", "3"]),
        &["--rank-memory", "give --gpus"],
    );
    fails_with(
        &run(&[
            "bench",
            "--device",
            "cpu",
            "--dispatch",
            "blocking,blocking",
        ]),
        &["--dispatch blocking is given twice"],
    );
    fails_with(
        &run(&["bench", "--device", "cpu", "--kernels", "5"]),
        &["--kernels", "CUDA"],
    );
    // the fused cross update reads f32 operands: not with the cross network in bf16
    fails_with(
        &run(&["plan", "--model", "dcnv2", "--fuse-cross-updates", "on"]),
        &["--fuse-cross-updates on", "--bf16-cross off"],
    );
    ok(&run(&[
        "plan",
        "--model",
        "dcnv2",
        "--fuse-cross-updates",
        "on",
        "--bf16-cross",
        "off",
    ]));
    let out = ok(&run(&[
        "bench",
        "--device",
        "cpu",
        "--warmup",
        "0",
        "--steps",
        "2",
        "--eval-examples",
        "256",
    ]));
    let erase = out
        .lines()
        .find(|l| l.starts_with("erase "))
        .unwrap_or_else(|| panic!("no erase row:\n{out}"));
    assert!(
        erase.trim_end().ends_with('-') && !out.contains("MFU:"),
        "{out}"
    );
}

/// `data` holds out what `train` holds out (its counts are `--table-rows auto`'s), says
/// how many threads a parse used, and writes valid JSON whatever the path.
#[test]
fn data_reports_the_split_and_threads_train_uses() {
    let dir = tmpdir("data-report");
    let odd = dir.join("odd\u{7f}name.tsv");
    std::fs::copy(fixture("criteo_small.tsv"), &odd).unwrap();
    let json = dir.join("d.json");
    let out = ok(&run(&[
        "data",
        "--data",
        &format!("criteo:{}", odd.display()),
        "--counts",
        "--threads",
        "1,2",
        "--json",
        json.to_str().unwrap(),
    ]));
    assert!(out.contains("2 threads asked, 1 used"), "{out}");
    let split = out
        .lines()
        .find(|l| l.contains("training examples,"))
        .unwrap_or_else(|| panic!("{out}"));
    assert!(!split.contains(" 0 held out"), "{split}");
    assert!(out.contains("what --table-rows auto gives"), "{out}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(v["runs"][1]["threads"], 2, "{v}");
    assert_eq!(v["runs"][1]["threads_used"], 1, "{v}");
    assert!(v["data"].as_str().unwrap().contains('\u{7f}'), "{v}");
}

/// A folder as a checkpoint or a file as the cache folder is named as what it is, and
/// `data` refuses a TSV schema for Criteo data as train and eval do.
#[test]
fn a_folder_checkpoint_a_file_cache_and_a_schema_for_criteo_are_named() {
    let dir = tmpdir("misplaced-paths");
    fails_with(
        &run(&[
            "eval",
            "--device",
            "cpu",
            "--checkpoint",
            dir.to_str().unwrap(),
        ]),
        &["is a folder, not a checkpoint file"],
    );
    let file = write(&dir, "not-a-folder", "x");
    let criteo = format!("criteo:{}", fixture("criteo_small.tsv"));
    fails_with(
        &train(&["--data", &criteo, "--cache-dir", &file, "--steps", "1"]),
        &["--cache-dir", "is a file"],
    );
    let movielens = format!("{}/configs/movielens.toml", env!("CARGO_MANIFEST_DIR"));
    fails_with(
        &run(&["data", "--config", &movielens, "--data", &criteo]),
        &["[data.schema]", "Criteo's fixed layout"],
    );
}

/// `data --write-criteo` writes data a model learns from (its label depends on the ids
/// and the first integer), refuses what it cannot write before it starts, and leaves no
/// temporary file behind.
#[test]
fn write_criteo_writes_learnable_data_and_refuses_what_it_cannot_write() {
    let dir = tmpdir("write-criteo");
    let file = dir.join("day.tsv");
    let path = file.to_str().unwrap();
    ok(&run(&["data", "--write-criteo", path, "--lines", "20000"]));
    let out = ok(&train(&[
        "--data",
        &format!("criteo:{path}"),
        "--table-rows",
        "auto",
        "--steps",
        "80",
        "--eval-every",
        "0",
    ]));
    let auc: f64 = out
        .lines()
        .find_map(|l| l.trim_start().strip_prefix("AUC final"))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no final AUC in:\n{out}"));
    assert!(
        auc > 0.6,
        "AUC {auc}: the written labels carry no signal\n{out}"
    );
    assert!(final_ne(&out) < 1.0, "{out}");

    let folder = dir.join("sub");
    std::fs::create_dir(&folder).unwrap();
    fails_with(
        &run(&[
            "data",
            "--write-criteo",
            folder.to_str().unwrap(),
            "--lines",
            "10",
        ]),
        &["--write-criteo", "is a folder"],
    );
    fails_with(
        &run(&["data", "--write-criteo", path, "--lines", "0"]),
        &["--lines 0"],
    );
    fails_with(
        &run(&["data", "--write-criteo", path, "--counts"]),
        &["--counts", "--write-criteo"],
    );
    let left: Vec<_> = std::fs::read_dir(&*dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".tmp-"))
        .collect();
    assert!(left.is_empty(), "temporary files left: {left:?}");
}

/// `eval` takes the preset whose sizes a checkpoint records (trained with `--preset spec`,
/// evaluated without it) and the synthetic data's seed it was trained on, and says when a
/// seed given differs.
#[test]
fn eval_takes_the_recorded_preset_and_data_seed() {
    let dir = tmpdir("eval-preset-seed");
    let ck = dir.join("spec.st");
    let ckp = ck.to_str().unwrap();
    ok(&run(&[
        "train",
        "--device",
        "cpu",
        "--preset",
        "spec",
        "--rows",
        "50",
        "--batch",
        "32",
        "--steps",
        "2",
        "--eval-every",
        "0",
        "--eval-examples",
        "64",
        "--checkpoint",
        ckp,
    ]));
    let out = eval_checkpoint(ckp);
    assert!(
        out.contains("records the sizes of --preset spec") && out.contains("step 2, NE"),
        "{out}"
    );

    let ck = dir.join("seed7.st");
    let ckp = ck.to_str().unwrap();
    let trained = ok(&run(&[
        "train",
        "--device",
        "cpu",
        "--data-seed",
        "7",
        "--steps",
        "20",
        "--eval-every",
        "0",
        "--eval-examples",
        "128",
        "--checkpoint",
        ckp,
    ]));
    // the same 128 held-out examples of seed 7: the NE train printed
    let ne = format!("NE {:.4},", final_ne(&trained));
    let out = eval_checkpoint(ckp);
    assert!(out.contains(&ne), "expected {ne}:\n{out}");
    let other = ok(&run(&[
        "eval",
        "--device",
        "cpu",
        "--checkpoint",
        ckp,
        "--eval-examples",
        "128",
        "--data-seed",
        "3",
    ]));
    assert!(
        other.contains("trained on the synthetic data of seed 7")
            && other.contains("another distribution")
            && !other.contains(&ne),
        "{other}"
    );
}

/// Without a time column, the schema's eval_fraction holds out the last lines read; an
/// eval_fraction outside (0, 1) is an error whether or not there is a time column.
#[test]
fn eval_fraction_splits_data_without_time_and_is_checked() {
    let dir = tmpdir("eval-fraction");
    let data = format!("tsv:{}", fixture("multihot_sample.tsv"));
    let half = write(
        &dir,
        "half.toml",
        &format!("[model]\nbatch = 64\n{MULTIHOT_SCHEMA}eval_fraction = 0.5\n"),
    );
    let out = ok(&train(&[
        "--config", &half, "--data", &data, "--steps", "1",
    ]));
    let split = out
        .lines()
        .find_map(|l| l.strip_prefix("data: "))
        .unwrap_or_else(|| panic!("no split line:\n{out}"));
    let n: Vec<f64> = split
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    assert!(
        n.len() >= 2 && (n[0] - n[1]).abs() <= 1.0,
        "not half and half: {split}"
    );
    for bad in ["1.5", "0"] {
        let cfg = write(
            &dir,
            "bad.toml",
            &format!("[model]\nbatch = 64\n{MULTIHOT_SCHEMA}eval_fraction = {bad}\n"),
        );
        fails_with(
            &train(&["--config", &cfg, "--data", &data, "--steps", "1"]),
            &["eval_fraction", "strictly between 0 and 1"],
        );
    }
}

/// Output paths and counts are checked before a command does its work, and settings
/// that contradict each other are errors, not silently resolved.
#[test]
fn outputs_and_contradictions_are_refused_before_the_work() {
    let dir = tmpdir("outputs");
    let nowhere = dir.join("no/such/folder/x.json");
    let nowhere = nowhere.to_str().unwrap();
    let o = run(&[
        "bench", "--device", "cpu", "--steps", "1", "--json", nowhere,
    ]);
    fails_with(&o, &["--json", "does not exist"]);
    assert!(
        !text(&o).contains("p90"),
        "it benchmarked first:\n{}",
        text(&o)
    );
    fails_with(
        &run(&["plan", "--trace", nowhere]),
        &["--trace", "does not exist"],
    );
    let jpg = dir.join("t.jpg");
    fails_with(
        &run(&["plan", "--timeline", jpg.to_str().unwrap()]),
        &["--timeline", ".svg or .png"],
    );
    fails_with(&run(&["plan", "--gpus", "0"]), &["--gpus", "at least 1"]);
    fails_with(
        &run(&["plan", "--sweep-side-streams", "1000"]),
        &["--sweep-side-streams", "at most"],
    );
    fails_with(
        &run(&["train", "--device", "cpu", "--cpu-ranks", "0"]),
        &["--cpu-ranks", "at least 1"],
    );
    let o = run(&[
        "train",
        "--device",
        "cpu",
        "--batch",
        "1",
        "--eval-examples",
        "1",
        "--steps",
        "50",
    ]);
    fails_with(&o, &["--eval-examples 1", "at least 2 held-out examples"]);
    assert!(
        !text(&o).contains("step 1/"),
        "it trained first:\n{}",
        text(&o)
    );
    let criteo = format!("criteo:{}", fixture("criteo_floats.tsv"));
    fails_with(
        &run(&["data", "--write-criteo", nowhere, "--data", &criteo]),
        &["--write-criteo", "drop --data"],
    );
    fails_with(
        &run(&["data", "--data", &criteo, "--json", nowhere]),
        &["--json", "does not exist"],
    );
    fails_with(
        &train(&[
            "--data",
            &criteo,
            "--table-rows",
            "C1=5,C1=7",
            "--steps",
            "1",
        ]),
        &["'C1' is given twice"],
    );
    // a measured trace with a negative kernel time
    let bad = write(
        &dir,
        "trace.json",
        r#"{"traceEvents": [{"ph": "X", "name": "k", "ts": 0, "dur": -5, "args": {"node": "top/linear0", "kind": "kernel"}}]}"#,
    );
    fails_with(
        &run(&["plan", "--measured", &bad]),
        &["top/linear0", "at least 0"],
    );
}

/// Runs `erase-ctr ARGS` until its first progress line, sends it SIGINT, and returns its
/// exit status and what it printed on stderr after that (killed after 120 s: a run that
/// ignores the signal fails the test instead of hanging it).
fn interrupted(args: &[&str]) -> (std::process::ExitStatus, String) {
    use std::io::BufRead;
    let mut child = Command::new(EXE)
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id().to_string();
    // killed if it has not ended within 120 s (the channel says it has)
    let (done, ended) = std::sync::mpsc::channel::<()>();
    let watchdog = {
        let pid = pid.clone();
        std::thread::spawn(move || {
            if ended
                .recv_timeout(std::time::Duration::from_secs(120))
                .is_err()
            {
                let _ = Command::new("kill").args(["-KILL", &pid]).status();
            }
        })
    };
    let mut err = std::io::BufReader::new(child.stderr.take().unwrap());
    let mut seen = String::new();
    // the first progress line: the training loop runs, so the first signal is a stop
    while !seen.contains("step 1/") {
        let mut line = String::new();
        assert!(
            err.read_line(&mut line).unwrap() > 0,
            "no progress:\n{seen}"
        );
        seen += &line;
    }
    assert!(Command::new("kill")
        .args(["-INT", &pid])
        .status()
        .unwrap()
        .success());
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut err, &mut rest).unwrap();
    let status = child.wait().unwrap();
    let _ = done.send(());
    let _ = watchdog.join();
    (status, rest)
}

/// Ctrl-C ends a run after the step under way, with its checkpoint, and exit status 130;
/// the run continues from there with --resume. A checkpoint file that was there before
/// the run, and that it had not written yet, is kept as it was.
#[test]
fn an_interrupted_run_keeps_its_checkpoint_and_resumes() {
    let dir = tmpdir("interrupt");
    let ck = dir.join("k.st");
    let ckp = ck.to_str().unwrap();
    let run_args = |steps: &str| -> Vec<String> {
        [
            "train",
            "--device",
            "cpu",
            "--batch",
            "64",
            "--rows",
            "500",
            "--steps",
            steps,
            "--eval-every",
            "0",
            "--eval-examples",
            "128",
            "--checkpoint",
            ckp,
        ]
        .map(String::from)
        .to_vec()
    };
    let args = run_args("1000000");
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (status, rest) = interrupted(&args);
    assert_eq!(status.code(), Some(130), "{rest}");
    let at: usize = rest
        .split("interrupted after step ")
        .nth(1)
        .and_then(|t| t.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no interruption message:\n{rest}"));
    assert!((1..1_000_000).contains(&at), "{rest}");
    assert!(rest.contains(&format!("--resume {ckp}")), "{rest}");
    // the checkpoint holds that step: resuming starts right after it
    let more = (at + 2).to_string();
    let mut resume = run_args(&more);
    resume.extend(["--resume".to_string(), ckp.to_string()]);
    let resume: Vec<&str> = resume.iter().map(String::as_str).collect();
    let out = ok(&run(&resume));
    assert!(
        out.contains(&format!("resumed from {ckp} at step {at}")),
        "{out}"
    );
    // a new run pointed at that file, stopped before it wrote it: the file is kept
    let (status, rest) = interrupted(&args);
    assert_eq!(status.code(), Some(130), "{rest}");
    assert!(rest.contains("is kept as it was"), "{rest}");
    let out = eval_checkpoint(ckp);
    assert!(out.contains(&format!("step {}, NE", at + 2)), "{out}");
}

#[test]
fn float_integers_with_a_fraction_nan_or_inf_are_errors_naming_file_and_line() {
    let dir = tmpdir("floats");
    let good: String = std::fs::read_to_string(fixture("criteo_floats.tsv"))
        .unwrap()
        .lines()
        .take(3)
        .collect::<Vec<_>>()
        .join("\n");
    for (bad, why) in [
        ("2.5", "has a fraction"),
        ("nan", "not a finite number"),
        ("inf", "not a finite number"),
    ] {
        let mut lines: Vec<String> = good.lines().map(str::to_string).collect();
        let mut f: Vec<&str> = lines[1].split('\t').collect();
        f[3] = bad;
        lines[1] = f.join("\t");
        let p = write(&dir, "bad.tsv", &(lines.join("\n") + "\n"));
        let o = train(&["--steps", "1", "--strict", "--data", &format!("criteo:{p}")]);
        fails_with(&o, &["bad.tsv:2:", "I3", why]);
    }
}

#[test]
fn zstd_is_read_and_other_compressions_are_refused_by_name() {
    let dir = tmpdir("zstd");
    let plain = std::fs::read(fixture("criteo_floats.tsv")).unwrap();
    let zst = dir.join("day.tsv.zst");
    std::fs::write(&zst, zstd::encode_all(&plain[..], 3).unwrap()).unwrap();
    let a = ok(&train(&[
        "--steps",
        "3",
        "--data",
        &format!("criteo:{}", fixture("criteo_floats.tsv")),
    ]));
    let b = ok(&train(&[
        "--steps",
        "3",
        "--data",
        &format!("criteo:{}", zst.display()),
    ]));
    assert!(b.contains("1500 examples, 0 malformed"), "{b}");
    assert_eq!(final_ne(&a), final_ne(&b));
    for (magic, name) in [
        (&b"BZh91AY&SY"[..], "bzip2"),
        (&[0xfd, b'7', b'z', b'X', b'Z', 0, 0][..], "xz"),
    ] {
        let p = dir.join(format!("day.{name}"));
        std::fs::write(&p, magic).unwrap();
        let o = train(&["--steps", "1", "--data", &format!("criteo:{}", p.display())]);
        fails_with(&o, &[&format!("is {name}, which is not supported")]);
    }
}

#[test]
fn per_field_table_sizes_given_or_counted_train_and_resume() {
    let dir = tmpdir("sizes");
    let data = format!("criteo:{}", fixture("criteo_floats.tsv"));
    // mixed sizes by name: 3, 1000 and the rest 100000
    let ck = dir.join("mixed.st");
    let base = [
        "--rows",
        "100000",
        "--table-rows",
        "C1=3,C2=1000",
        "--data",
        &data,
    ];
    let whole = ok(&train(&[&base[..], &["--steps", "6"]].concat()));
    assert!(
        whole.contains("rows in all (given: C1 3, C2 1000, C3 100000"),
        "{whole}"
    );
    let ckp = ck.to_str().unwrap();
    ok(&train(
        &[&base[..], &["--steps", "3", "--checkpoint", ckp]].concat(),
    ));
    let resumed = ok(&train(
        &[&base[..], &["--steps", "6", "--resume", ckp]].concat(),
    ));
    assert_eq!(final_ne(&resumed), final_ne(&whole));
    // eval takes the per-field sizes the checkpoint records
    let e = ok(&run(&[
        "eval",
        "--device",
        "cpu",
        "--eval-examples",
        "128",
        "--data",
        &data,
        "--checkpoint",
        ckp,
    ]));
    assert!(e.contains("step 3, NE"), "{e}");
    // a list of the wrong length names both counts
    let o = train(&["--steps", "1", "--table-rows", "3,4", "--data", &data]);
    fails_with(&o, &["--table-rows gives 2 sizes", "26 categorical fields"]);
    // counted from the data, capped, kept beside the cache
    let cache = dir.join("cache");
    let auto = [
        "--steps",
        "2",
        "--table-rows",
        "auto",
        "--rows-cap",
        "64",
        "--data",
        &data,
        "--cache-dir",
        cache.to_str().unwrap(),
    ];
    let out = ok(&train(&auto));
    assert!(out.contains("at most 64: C1 "), "{out}");
    assert!(std::fs::read_dir(&cache).unwrap().any(|e| e
        .unwrap()
        .file_name()
        .to_string_lossy()
        .ends_with(".counts")));
}

#[test]
fn one_config_file_serves_every_subcommand_and_type_errors_name_file_table_and_key() {
    let dir = tmpdir("config");
    let cfg = write(
        &dir,
        "run.toml",
        "[model]\nbatch = 64\nrows = 500\n[train]\nsteps = 2\neval_every = 0\n[data]\n",
    );
    let ck = dir.join("run.st");
    let ckp = ck.to_str().unwrap();
    ok(&run(&[
        "train",
        "--device",
        "cpu",
        "--config",
        &cfg,
        "--checkpoint",
        ckp,
    ]));
    // eval takes [model] and leaves [train]'s eval_every to train
    let out = ok(&run(&[
        "eval",
        "--device",
        "cpu",
        "--config",
        &cfg,
        "--checkpoint",
        ckp,
        "--eval-examples",
        "128",
    ]));
    assert!(out.contains("step 2, NE"), "{out}");

    // [data] is shared though `data` is also a subcommand: train takes its keys
    let cache = dir.join("cache");
    let with_data = write(
        &dir,
        "data.toml",
        &format!(
            "[model]\nbatch = 64\n[train]\nsteps = 2\neval_every = 0\n[data]\ndata = \"criteo:{}\"\ncache_dir = \"{}\"\n",
            fixture("criteo_floats.tsv"),
            cache.display()
        ),
    );
    let out = ok(&run(&["train", "--device", "cpu", "--config", &with_data]));
    assert!(
        out.contains("criteo_floats.tsv"),
        "[data] data not used:\n{out}"
    );
    assert!(cache.is_dir(), "[data] cache_dir not used:\n{out}");
    assert!(!out.contains("is not read by"), "{out}");
    // plan (and bench) read no data file: the config's is named as not read, not dropped
    // silently
    let out = ok(&run(&["plan", "--config", &with_data]));
    assert!(
        out.contains("data.toml: [data] data is not read by `erase-ctr plan`"),
        "{out}"
    );
    // [data]'s keys other than the data's description are the data subcommand's own:
    // its threads list and seed do not become train's flags of those names
    let both = write(
        &dir,
        "both.toml",
        &format!(
            "[model]\nbatch = 64\n[train]\nsteps = 2\neval_every = 0\n[data]\ndata = \"criteo:{}\"\nthreads = \"1,all\"\nseed = 7\n",
            fixture("criteo_floats.tsv"),
        ),
    );
    let out = ok(&run(&["train", "--device", "cpu", "--config", &both]));
    assert!(out.contains("criteo_floats.tsv"), "{out}");
    let out = ok(&run(&["data", "--config", &both]));
    assert!(out.contains("1 thread"), "{out}");
    let written = dir.join("w.tsv");
    ok(&run(&[
        "data",
        "--config",
        &both,
        "--write-criteo",
        written.to_str().unwrap(),
        "--lines",
        "10",
    ]));
    assert_eq!(
        std::fs::read_to_string(&written).unwrap().lines().count(),
        10
    );
    // one config file a command
    fails_with(
        &run(&[
            "train", "--device", "cpu", "--config", &cfg, "--config", &with_data,
        ]),
        &["--config is given 2 times"],
    );

    for (body, parts) in [
        (
            "[train]\nsteps = -20\n",
            &["[train] steps = -20", "invalid value"][..],
        ),
        (
            "[train]\nstrict = \"yes\"\n",
            &["[train] strict", "switch"][..],
        ),
        (
            "[model]\nbogus = 1\n",
            &["[model] bogus is not a setting"][..],
        ),
        ("[trian]\nsteps = 1\n", &["[trian] is not a table"][..]),
        // values that pass the flag's parser but not the command: the key is named too
        (
            "[model]\nmodel = \"nosuch\"\n",
            &["unknown model 'nosuch'", "(--model is ", "[model] model)"][..],
        ),
        (
            "[model]\nbatch = 0\n",
            &["batch must be at least 1", "(--batch is ", "[model] batch)"][..],
        ),
    ] {
        let p = write(&dir, "bad.toml", body);
        let o = run(&["train", "--device", "cpu", "--config", &p]);
        let mut want = vec!["bad.toml"];
        want.extend(parts);
        fails_with(&o, &want);
    }
}

#[test]
fn checkpoints_are_verified_and_resume_identifies_data_by_content() {
    let dir = tmpdir("ckpt");
    let ck = dir.join("k.st");
    let ckp = ck.to_str().unwrap();
    let d = dir.join("d");
    std::fs::create_dir_all(&d).unwrap();
    let src = std::fs::read(fixture("criteo_floats.tsv")).unwrap();
    std::fs::write(d.join("big.tsv"), &src).unwrap();
    let rel = format!("criteo:{}", d.join("big.tsv").display());
    ok(&train(&[
        "--variant",
        "baseline",
        "--steps",
        "3",
        "--data",
        &rel,
        "--checkpoint",
        ckp,
    ]));

    // eval takes the variant and sizes the checkpoint records
    let mut e = vec!["eval", "--device", "cpu", "--checkpoint", ckp];
    e.extend(["--data", &rel, "--eval-examples", "128"]);
    assert!(ok(&run(&e)).contains("step 3, NE"));
    // the wrong variant says which flags the checkpoint was trained with
    let mut w = e.clone();
    w.extend(["--variant", "erase"]);
    fails_with(
        &run(&w),
        &["is missing", "--variant baseline", "--rows 2000"],
    );

    // the same data spelled another way (the gzip copy, with ./) resumes
    let gz = d.join("big.tsv.gz");
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    std::io::Write::write_all(&mut enc, &src).unwrap();
    std::fs::write(&gz, enc.finish().unwrap()).unwrap();
    let spelled = format!("criteo:{}/./big.tsv.gz", d.display());
    let resume = |data: &str| {
        train(&[
            "--variant",
            "baseline",
            "--steps",
            "5",
            "--data",
            data,
            "--resume",
            ckp,
        ])
    };
    ok(&resume(&spelled));
    // other data of the same size at the same path is refused, naming the key
    let mut lines: Vec<&str> = std::str::from_utf8(&src).unwrap().lines().collect();
    lines.swap(0, 1);
    std::fs::write(d.join("big.tsv"), lines.join("\n") + "\n").unwrap();
    fails_with(
        &resume(&rel),
        &["another configuration", "data: the checkpoint has 1350"],
    );

    // one flipped bit is refused naming the tensor
    let mut bytes = std::fs::read(&ck).unwrap();
    let n = bytes.len();
    bytes[n - 40] ^= 0x10;
    let flipped = dir.join("flipped.st");
    std::fs::write(&flipped, &bytes).unwrap();
    let mut f = vec!["eval", "--device", "cpu", "--variant", "baseline"];
    f.extend(["--rows", "2000", "--batch", "64", "--eval-examples", "64"]);
    f.extend(["--checkpoint", flipped.to_str().unwrap(), "--data", &rel]);
    fails_with(&run(&f), &["does not match its checksum", "corrupted"]);
    // ... and one trained on files is not scored on synthetic data
    let mut s = vec!["eval", "--device", "cpu", "--checkpoint", ckp];
    s.extend(["--eval-examples", "64"]);
    fails_with(&run(&s), &["trained on data files", "--data"]);
}

#[test]
fn bad_targets_fail_before_training_and_stale_temp_files_are_removed() {
    let dir = tmpdir("targets");
    let missing = dir.join("no/such/folder/k.st");
    let o = train(&["--steps", "50", "--checkpoint", missing.to_str().unwrap()]);
    fails_with(&o, &["does not exist"]);
    assert!(
        !text(&o).contains("step 1/"),
        "it trained first:\n{}",
        text(&o)
    );
    let o = train(&["--steps", "50", "--checkpoint", dir.to_str().unwrap()]);
    fails_with(&o, &["is a folder"]);

    // a writer killed mid-write left its temporary file (pid 4194305: never a live pid)
    let stale = dir.join(".k.st.tmp-4194305");
    std::fs::write(&stale, b"half a checkpoint").unwrap();
    let live = dir.join(format!(".k.st.tmp-{}", std::process::id()));
    std::fs::write(&live, b"a live writer's").unwrap();
    ok(&train(&[
        "--steps",
        "1",
        "--checkpoint",
        dir.join("k.st").to_str().unwrap(),
    ]));
    assert!(!stale.exists(), "the stale temporary file is still there");
    assert!(live.exists(), "a live process's temporary file was removed");

    // what is not a regular file is refused (a socket here; a device alike), not replaced
    let socket = dir.join("s.st");
    let _listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    let o = train(&["--steps", "1", "--checkpoint", socket.to_str().unwrap()]);
    fails_with(&o, &["is not a regular file"]);
    let kind = std::fs::symlink_metadata(&socket).unwrap().file_type();
    assert!(std::os::unix::fs::FileTypeExt::is_socket(&kind));
    // a link to a file not written yet: the file is written, the link kept
    let ahead = dir.join("ahead.st");
    std::os::unix::fs::symlink("run7.st", &ahead).unwrap();
    ok(&train(&[
        "--steps",
        "1",
        "--checkpoint",
        ahead.to_str().unwrap(),
    ]));
    assert!(dir.join("run7.st").is_file());
    assert!(std::fs::symlink_metadata(&ahead)
        .unwrap()
        .file_type()
        .is_symlink());
    // a link is kept: the file it names is replaced
    let link = dir.join("latest.st");
    std::os::unix::fs::symlink(dir.join("k.st"), &link).unwrap();
    ok(&train(&[
        "--steps",
        "1",
        "--checkpoint",
        link.to_str().unwrap(),
    ]));
    assert!(std::fs::symlink_metadata(&link)
        .unwrap()
        .file_type()
        .is_symlink());

    // a metrics file that cannot be written is an error, not silence
    if Path::new("/dev/full").exists() {
        let o = train(&["--steps", "2", "--metrics", "/dev/full"]);
        fails_with(&o, &["--metrics /dev/full", "a write failed"]);
    }
}

#[test]
fn tables_larger_than_memory_are_refused_before_allocation() {
    let o = run(&[
        "train",
        "--device",
        "cpu",
        "--batch",
        "16",
        "--rows",
        "200000000",
        "--steps",
        "1",
    ]);
    fails_with(&o, &["the model needs", "embedding tables", "GB free"]);
}

#[test]
fn one_class_data_and_bad_counts_are_errors() {
    let dir = tmpdir("oneclass");
    // ratings of 1 to 5 read as 0/1 labels: mostly malformed, and it says why
    let ratings = |rating: &dyn Fn(usize) -> usize| {
        let mut lines = vec!["user\titem\trating".to_string()];
        for i in 0..300 {
            lines.push(format!("u{}\ti{}\t{}", i % 17, i % 31, rating(i)));
        }
        lines.join("\n") + "\n"
    };
    let five = write(&dir, "five.tsv", &ratings(&|i| 1 + i % 5));
    let cfg = write(
        &dir,
        "r.toml",
        "[data.schema]\nlabel = \"rating\"\ncategorical = [\"user\", \"item\"]\n",
    );
    let o = train(&[
        "--steps",
        "2",
        "--config",
        &cfg,
        "--data",
        &format!("tsv:{five}"),
    ]);
    fails_with(
        &o,
        &["240 of the 300 lines", "malformed", "label_threshold"],
    );
    // ones, and a tenth of twos (malformed, skipped): one class
    let data = write(
        &dir,
        "ratings.tsv",
        &ratings(&|i| 1 + usize::from(i % 10 == 0)),
    );
    let o = train(&[
        "--steps",
        "2",
        "--config",
        &cfg,
        "--data",
        &format!("tsv:{data}"),
    ]);
    fails_with(&o, &["all", "positive", "label_threshold"]);

    fails_with(&train(&["--threads", "0"]), &["--threads", "at least 1"]);
    fails_with(&run(&["bench", "--chunk", "0"]), &["--chunk", "at least 1"]);
    fails_with(
        &run(&["plan", "--side-streams", "1000"]),
        &["--side-streams", "at most 32"],
    );
    // a schema with criteo: data is a mistake, not ignored
    let s = write(
        &dir,
        "s.toml",
        "[data.schema]\nlabel = 0\ncategorical = [1]\n",
    );
    let o = train(&[
        "--config",
        &s,
        "--data",
        &format!("criteo:{}", fixture("criteo_small.tsv")),
    ]);
    fails_with(&o, &["[data.schema] describes the columns of tsv: data"]);
}

#[test]
fn schema_columns_named_twice_and_folders_with_other_entries() {
    let dir = tmpdir("columns");
    let data = write(&dir, "d.tsv", "a\tb\ta\tlabel\n1\tx\t2\t1\n3\ty\t4\t0\n");
    let twice = write(
        &dir,
        "twice.toml",
        "[data.schema]\nlabel = \"label\"\ncategorical = [\"a\", \"b\"]\n",
    );
    fails_with(
        &train(&["--config", &twice, "--data", &format!("tsv:{data}")]),
        &["names column 'a' 2 times"],
    );
    let same = write(
        &dir,
        "same.toml",
        "[data.schema]\nlabel = \"label\"\ncategorical = [\"b\", 1]\n",
    );
    fails_with(
        &train(&["--config", &same, "--data", &format!("tsv:{data}")]),
        &["'b' and '1' are the same column"],
    );
    // a data folder with a subfolder: the subfolder is noted, the file read
    let folder = dir.join("folder");
    std::fs::create_dir_all(folder.join("sub")).unwrap();
    std::fs::copy(fixture("criteo_floats.tsv"), folder.join("day0.tsv")).unwrap();
    let out = ok(&train(&[
        "--steps",
        "1",
        "--data",
        &format!("criteo:{}", folder.display()),
    ]));
    assert!(out.contains("skipped") && out.contains("a folder"), "{out}");
}

#[test]
fn a_checkpoint_with_a_non_finite_parameter_is_refused_naming_it() {
    let dir = tmpdir("nan");
    let ck = dir.join("k.st");
    ok(&train(&[
        "--steps",
        "2",
        "--checkpoint",
        ck.to_str().unwrap(),
    ]));
    // a parameter set to NaN with a matching checksum: only the value check can see it
    let bytes = std::fs::read(&ck).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let mut json: serde_json::Value =
        serde_json::from_str(&meta.metadata().as_ref().unwrap()["erase"]).unwrap();
    let target = "top/layers.0.weight";
    let mut tensors: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
        .collect();
    let t = tensors.iter_mut().find(|t| t.0 == target).unwrap();
    t.3[..4].copy_from_slice(&f32::NAN.to_le_bytes());
    json["checksums"][target] = erase::checkpoint::tensor_checksum(&t.3).into();
    let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    let mut info = std::collections::HashMap::new();
    info.insert("erase".to_string(), json.to_string());
    let nan = dir.join("nan.st");
    std::fs::write(&nan, safetensors::serialize(views, Some(info)).unwrap()).unwrap();
    let o = run(&[
        "eval",
        "--device",
        "cpu",
        "--eval-examples",
        "64",
        "--checkpoint",
        nan.to_str().unwrap(),
    ]);
    fails_with(&o, &[target, "not finite"]);
}

#[test]
fn spaces_around_criteo_integers_and_stale_cache_temporaries() {
    let dir = tmpdir("spaces");
    let src = std::fs::read_to_string(fixture("criteo_floats.tsv")).unwrap();
    let mut lines: Vec<String> = src.lines().take(800).map(str::to_string).collect();
    let mut f: Vec<String> = lines[0].split('\t').map(str::to_string).collect();
    f[1] = " 12".into();
    lines[0] = f.join("\t");
    let data = write(&dir, "spaced.tsv", &(lines.join("\n") + "\n"));
    let cache = dir.join("cache");
    let args = [
        "--steps",
        "1",
        "--strict",
        "--data",
        &format!("criteo:{data}"),
        "--cache-dir",
        cache.to_str().unwrap(),
    ];
    let out = ok(&train(&args));
    assert!(out.contains("800 examples, 0 malformed"), "{out}");
    // a cache writer killed mid-write left its temporary file; the next write removes it
    let name = std::fs::read_dir(&cache)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .find(|n| n.ends_with(".erase-cache"))
        .unwrap();
    std::fs::remove_file(cache.join(&name)).unwrap();
    let stale = cache.join(format!("{name}.tmp.4194305.1"));
    std::fs::write(&stale, b"half a cache").unwrap();
    ok(&train(&args));
    assert!(!stale.exists(), "the stale cache temporary is still there");
    assert!(cache.join(&name).exists());
}

/// `plan --gpus N` prints where the tables would live; a forced placement that cannot
/// fit names the flag and the way out.
#[test]
fn plan_prints_the_table_placement_and_refuses_one_that_does_not_fit() {
    let t = ok(&run(&["plan", "--preset", "spec", "--gpus", "4"]));
    assert!(
        t.contains("sharding auto") && t.contains("26 table-wise"),
        "{t}"
    );
    let t = ok(&run(&[
        "plan",
        "--preset",
        "spec",
        "--gpus",
        "4",
        "--sharding",
        "row",
    ]));
    assert!(t.contains("26 row-wise"), "{t}");
    // the sharded step is predicted, and at 8 ranks beats gathering replicated tables'
    // gradients (which grows with the ranks)
    let erase_step = |sharding: &str| -> f64 {
        let t = ok(&run(&[
            "plan",
            "--preset",
            "spec",
            "--gpus",
            "8",
            "--sharding",
            sharding,
        ]));
        let line = t
            .lines()
            .find(|l| {
                l.trim_start().starts_with("erase")
                    && l.contains("early all-reduce")
                    && l.contains(if sharding == "replicated" {
                        "replicated"
                    } else {
                        "sharded"
                    })
            })
            .unwrap_or_else(|| panic!("no erase prediction in {t}"));
        line.split("GPUs:")
            .nth(1)
            .and_then(|r| r.split("µs").next())
            .and_then(|x| x.trim().parse().ok())
            .unwrap_or_else(|| panic!("no step time in {line}"))
    };
    let (replicated, sharded) = (erase_step("replicated"), erase_step("table"));
    assert!(
        sharded < replicated && sharded > 0.0,
        "8 ranks: sharded {sharded} µs against replicated {replicated} µs"
    );
    fails_with(
        &run(&[
            "plan",
            "--preset",
            "spec",
            "--gpus",
            "4",
            "--sharding",
            "replicated",
            "--rank-memory",
            "0.5",
        ]),
        &["--sharding replicated", "use --sharding row or auto"],
    );
}

/// `--contention` takes three costs and names the flag when it does not get them; a
/// replicated table set over `--rank-memory` is refused naming the way out; `--sharding
/// row` on CPU ranks trains.
#[test]
fn contention_and_sharding_flags_are_checked_and_sharded_cpu_ranks_train() {
    for bad in ["1,2", "a,b,c", "0,-1,0"] {
        let o = run(&["plan", "--preset", "small", &format!("--contention={bad}")]);
        fails_with(&o, &["--contention", "CC,CM,MM"]);
    }
    let o = run(&["plan", "--preset", "small", "--contention=0.3,0.3,0.3"]);
    let out = ok(&o);
    assert!(out.contains("occupancy model:"), "{out}");
    // the priorities auto tried, and a forced set, are printed
    let out = ok(&run(&["plan", "--preset", "spec"]));
    assert!(
        out.contains("stream priorities: main > ")
            && out.contains("tried main > late > pool > companions:")
            && out.contains("main = late = pool = companions:"),
        "{out}"
    );
    let out = ok(&run(&[
        "plan",
        "--preset",
        "spec",
        "--occupancy",
        "off",
        "--stream-priorities",
        "flat",
    ]));
    assert!(
        out.contains("stream priorities: main = late = pool = companions"),
        "{out}"
    );
    fails_with(
        &run(&["plan", "--stream-priorities", "fast"]),
        &["--stream-priorities", "fast", "main-first"],
    );
    let small = [
        "train",
        "--preset",
        "small",
        "--batch",
        "64",
        "--rows",
        "300",
        "--steps",
        "3",
        "--cpu-ranks",
        "2",
        "--eval-examples",
        "64",
    ];
    let mut a = small.to_vec();
    a.extend(["--sharding", "replicated", "--rank-memory", "0.0001"]);
    fails_with(
        &run(&a),
        &["--sharding replicated", "budget", "--sharding row or auto"],
    );
    let mut a = small.to_vec();
    a.extend(["--sharding", "row", "--rank-memory", "0.0004"]);
    let out = ok(&run(&a));
    assert!(out.contains("replicas bit-identical"), "{out}");
}

/// The settings of several ranks are checked together before anything trains: one way
/// to run ranks, settings that need several, a budget that holds the landing slots, the
/// machine's memory for all the CPU ranks; `plan` and `bench` take the table sizes.
#[test]
fn rank_settings_and_table_sizes_are_checked_before_training() {
    let small = [
        "train",
        "--preset",
        "small",
        "--batch",
        "64",
        "--rows",
        "300",
        "--steps",
        "2",
        "--eval-examples",
        "64",
    ];
    let with = |extra: &[&str]| {
        let mut a = small.to_vec();
        a.extend(extra);
        run(&a)
    };
    fails_with(
        &with(&["--cpu-ranks", "2", "--gpus", "2"]),
        &["--cpu-ranks 2", "--gpus 2", "give one"],
    );
    fails_with(
        &with(&["--sharding", "row"]),
        &["--sharding", "this run has one"],
    );
    fails_with(
        &with(&["--rank-memory", "3"]),
        &["--rank-memory", "this run has one"],
    );
    fails_with(
        &with(&["--cpu-ranks", "2", "--dispatch", "threaded"]),
        &["--cpu-ranks", "blocking", "--dispatch"],
    );
    fails_with(
        &with(&["--cpu-ranks", "3"]),
        &["--batch 64", "3 ranks of --cpu-ranks"],
    );
    // 300 KB holds a rank's rows (265 KB); the slots of the rows it fetches come on top
    let o = with(&[
        "--cpu-ranks",
        "2",
        "--sharding",
        "row",
        "--rank-memory",
        "0.00030",
    ]);
    let out = ok(&o);
    assert!(
        out.contains(
            "0.27 MB of the rows it holds (what --rank-memory budgets), 0.06 MB of landing slots"
        ),
        "{out}"
    );
    // 1.4 TB of tables: refused before a rank allocates them
    let huge: Vec<String> = (1..=10).map(|j| format!("C{j}=2000000000")).collect();
    let huge = huge.join(",");
    let o = with(&[
        "--cpu-ranks",
        "2",
        "--sharding",
        "row",
        "--rank-memory",
        "1000000",
        "--table-rows",
        &huge,
    ]);
    fails_with(
        &o,
        &["2 ranks on this machine need", "GB free", "fewer rows"],
    );

    // plan and bench size the tables as train does, and refuse what they cannot use
    let out = text(&run(&[
        "plan",
        "--preset",
        "small",
        "--table-rows",
        "C1=5000000",
    ]));
    assert!(out.contains("given: C1 5000000"), "{out}");
    fails_with(
        &run(&["plan", "--preset", "small", "--table-rows", "garbage"]),
        &["--table-rows", "garbage"],
    );
    fails_with(
        &run(&[
            "bench",
            "--device",
            "cpu",
            "--rows-cap",
            "5",
            "--steps",
            "1",
        ]),
        &["--rows-cap 5", "--table-rows auto"],
    );
}

/// `--lr` and `--embedding-lr` set the two optimizers' learning rates (the run says which
/// it trains with), change what is learned, are part of what a resume must repeat, and
/// refuse what is not a learning rate, naming the flag.
#[test]
fn learning_rates_are_flags_checked_and_part_of_a_checkpoint() {
    let dir = tmpdir("lr");
    let ck = |name: &str| dir.join(name).to_str().unwrap().to_string();
    let (spec, tuned) = (ck("spec.st"), ck("tuned.st"));
    let out = ok(&train(&["--steps", "20", "--checkpoint", &spec]));
    assert!(
        out.contains("Adam lr 0.001, row-wise Adagrad lr 0.01"),
        "{out}"
    );
    let spec_ne = final_ne(&out);
    let out = ok(&train(&[
        "--steps",
        "20",
        "--lr",
        "0.02",
        "--embedding-lr",
        "0.2",
        "--checkpoint",
        &tuned,
    ]));
    assert!(
        out.contains("Adam lr 0.02, row-wise Adagrad lr 0.2"),
        "{out}"
    );
    // the same seeds and data: another learning rate, another model
    assert_ne!(final_ne(&out), spec_ne, "{out}");
    assert_ne!(
        std::fs::read(&spec).unwrap(),
        std::fs::read(&tuned).unwrap()
    );
    // a resume must repeat them: the differing keys are named
    fails_with(
        &train(&["--steps", "25", "--resume", &tuned]),
        &["another configuration", "optimizer", "0.02"],
    );
    ok(&train(&[
        "--steps",
        "25",
        "--lr",
        "0.02",
        "--embedding-lr",
        "0.2",
        "--resume",
        &tuned,
    ]));
    for bad in ["0", "-1e-3", "nan", "inf", "fast"] {
        fails_with(&train(&["--lr", bad]), &["--lr", bad]);
        fails_with(&train(&["--embedding-lr", bad]), &["--embedding-lr", bad]);
    }
}

/// `eval --predictions FILE` writes each held-out example's label, logit and probability;
/// the NE they give is the one eval prints, and a folder is refused before the work.
#[test]
fn eval_writes_predictions_that_give_its_ne() {
    let dir = tmpdir("predictions");
    let ck = dir.join("m.st");
    let ckp = ck.to_str().unwrap();
    ok(&train(&["--steps", "10", "--checkpoint", ckp]));
    let pred = dir.join("pred.tsv");
    let out = ok(&run(&[
        "eval",
        "--device",
        "cpu",
        "--checkpoint",
        ckp,
        // not a whole number of batches of 64: exactly these, the last batch's tail left out
        "--eval-examples",
        "650",
        "--predictions",
        pred.to_str().unwrap(),
    ]));
    assert!(out.contains("on 650 held-out examples"), "{out}");
    let text = std::fs::read_to_string(&pred).unwrap();
    let mut lines = text.lines();
    assert_eq!(lines.next(), Some("example\tlabel\tlogit\tprobability"));
    let rows: Vec<[f64; 3]> = lines
        .enumerate()
        .map(|(i, l)| {
            let v: Vec<f64> = l.split('\t').map(|x| x.parse().unwrap()).collect();
            assert_eq!(v[0], i as f64, "{l}");
            [v[1], v[2], v[3]]
        })
        .collect();
    assert_eq!(rows.len(), 650, "{out}");
    let (mut bce, mut pos) = (0.0, 0.0);
    for &[y, z, p] in &rows {
        assert!(y == 0.0 || y == 1.0, "label {y}");
        assert!((p - 1.0 / (1.0 + (-z).exp())).abs() < 1e-8, "{z} {p}");
        bce += z.max(0.0) - z * y + (-z.abs()).exp().ln_1p();
        pos += y;
    }
    let n = rows.len() as f64;
    let base = pos / n;
    let ne = (bce / n) / -(base * base.ln() + (1.0 - base) * (1.0 - base).ln());
    let printed: f64 = out
        .split("NE ")
        .nth(1)
        .and_then(|t| t.split(',').next())
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        (ne - printed).abs() < 6e-5,
        "NE {ne} from the file, {printed} printed"
    );
    // a folder is refused before anything is evaluated, and nothing is left behind
    fails_with(
        &run(&[
            "eval",
            "--device",
            "cpu",
            "--checkpoint",
            ckp,
            "--predictions",
            dir.to_str().unwrap(),
        ]),
        &["--predictions", "is a folder"],
    );
    let names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(names.iter().all(|n| !n.contains(".tmp-")), "{names:?}");
    // a link stays a link to the file it names
    #[cfg(unix)]
    {
        let target = dir.join("target.tsv");
        let link = dir.join("link.tsv");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        ok(&run(&[
            "eval",
            "--device",
            "cpu",
            "--checkpoint",
            ckp,
            "--eval-examples",
            "64",
            "--predictions",
            link.to_str().unwrap(),
        ]));
        assert!(std::fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink());
        assert_eq!(
            std::fs::read_to_string(&target).unwrap().lines().count(),
            65
        );
    }
}

/// `eval --examples all` scores a data file from its start, every example (a test file of
/// its own), in file order: the predictions' labels are the file's, line by line; the
/// default stays the held-out tenth, and synthetic data has no "all".
#[test]
fn eval_examples_all_reads_a_test_file_in_full_and_in_order() {
    let dir = tmpdir("examples-all");
    let ck = dir.join("m.st");
    let ckp = ck.to_str().unwrap();
    let data = format!("criteo:{}", fixture("criteo_floats.tsv"));
    ok(&train(&[
        "--steps",
        "10",
        "--data",
        &data,
        "--checkpoint",
        ckp,
    ]));
    let pred = dir.join("all.tsv");
    let eval = |extra: &[&str]| {
        let mut a = vec![
            "eval",
            "--device",
            "cpu",
            "--checkpoint",
            ckp,
            "--data",
            &data,
            "--batch",
            "50",
        ];
        a.extend(extra);
        run(&a)
    };
    let out = ok(&eval(&[
        "--examples",
        "all",
        "--predictions",
        pred.to_str().unwrap(),
    ]));
    assert!(out.contains("on 1500 examples (--examples all"), "{out}");
    let file_labels: Vec<f64> = std::fs::read_to_string(fixture("criteo_floats.tsv"))
        .unwrap()
        .lines()
        .map(|l| l.split('\t').next().unwrap().parse().unwrap())
        .collect();
    let labels_of = |p: &Path| -> Vec<f64> {
        std::fs::read_to_string(p)
            .unwrap()
            .lines()
            .skip(1)
            .map(|l| l.split('\t').nth(1).unwrap().parse().unwrap())
            .collect()
    };
    assert_eq!(labels_of(&pred), file_labels);
    // a batch that does not divide the file (1500 = 23 x 64 + 28), and a file shorter
    // than one batch: every example once, none twice
    let out = ok(&run(&[
        "eval",
        "--device",
        "cpu",
        "--checkpoint",
        ckp,
        "--data",
        &data,
        "--batch",
        "64",
        "--examples",
        "all",
        "--predictions",
        pred.to_str().unwrap(),
    ]));
    assert!(out.contains("on 1500 examples"), "{out}");
    assert_eq!(labels_of(&pred), file_labels);
    let short = dir.join("short.tsv");
    let full = std::fs::read_to_string(fixture("criteo_floats.tsv")).unwrap();
    let head: Vec<&str> = full.lines().take(40).collect();
    std::fs::write(&short, head.join("\n") + "\n").unwrap();
    let out = ok(&run(&[
        "eval",
        "--device",
        "cpu",
        "--checkpoint",
        ckp,
        "--data",
        &format!("criteo:{}", short.display()),
        "--batch",
        "64",
        "--examples",
        "all",
        "--predictions",
        pred.to_str().unwrap(),
    ]));
    assert!(out.contains("on 40 examples"), "{out}");
    assert_eq!(labels_of(&pred), file_labels[..40]);
    // the default: the held-out last tenth
    let out = ok(&eval(&[]));
    assert!(out.contains("on 150 held-out examples"), "{out}");
    fails_with(
        &run(&[
            "eval",
            "--device",
            "cpu",
            "--checkpoint",
            ckp,
            "--data",
            "synthetic",
            "--examples",
            "all",
        ]),
        &["--examples all", "synthetic"],
    );
}
