//! Readers of real data: Criteo layout, user TSV schemas, paths, malformed lines and
//! the binary cache. Fixtures are in `tests/data/` (made up, no real data); MovieLens
//! is read from `../shared/data` only where it exists.

use std::collections::HashSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use erase::data::table::{dense_transform, glob_match, hash_category, resolve_path};
use erase::data::{load, parse_data_arg, DataSource, Examples, LoadOptions, LoadReport, TsvSchema};

const CRITEO: &str = "tests/data/criteo_small.tsv";
const CRITEO_GZ: &str = "tests/data/criteo_small.tsv.gz";
const RECBOLE: &str = "tests/data/recbole_small.inter";

fn fixture(rel: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(rel)
        .to_string_lossy()
        .into_owned()
}

/// A fresh, empty scratch folder for one test.
fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("data_readers")
        .join(name);
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    dir
}

fn criteo(path: &str) -> DataSource {
    DataSource::Criteo {
        path: path.to_string(),
    }
}

fn load_plain(src: &DataSource) -> (Examples, Option<Examples>, LoadReport) {
    load(src, &LoadOptions::default()).unwrap()
}

fn err_text(r: anyhow::Result<(Examples, Option<Examples>, LoadReport)>) -> String {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => format!("{e:#}"),
    }
}

/// All contents of examples, for equality checks.
fn contents(e: &Examples) -> (Vec<u32>, Vec<u32>, Vec<bool>, Vec<u32>) {
    let missing = (0..e.len())
        .flat_map(|i| (0..e.num_sparse).map(move |j| (i, j)))
        .map(|(i, j)| e.is_missing(i, j))
        .collect();
    (
        e.dense().iter().map(|x| x.to_bits()).collect(),
        e.ids().to_vec(),
        missing,
        e.labels().iter().map(|x| x.to_bits()).collect(),
    )
}

fn ln1p(x: f64) -> f32 {
    x.max(0.0).ln_1p() as f32
}

#[test]
fn criteo_parses_values_and_transforms() {
    let (ex, eval, rep) = load_plain(&criteo(&fixture(CRITEO)));
    assert!(eval.is_none());
    assert_eq!((ex.num_dense, ex.num_sparse), (13, 26));
    assert_eq!(ex.len(), 20);
    assert_eq!(rep.files, 1);
    assert_eq!(rep.lines, 26, "27 lines, one blank");
    assert_eq!(rep.examples, 20);
    assert_eq!(rep.malformed, 6);
    assert!(!rep.from_cache);

    // Line 1: dense 5, 0, -3, (empty), 100, 1..8; C22 empty.
    let d = &ex.dense()[..13];
    let want: Vec<f32> = [
        5.0, 0.0, -3.0, 0.0, 100.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0,
    ]
    .iter()
    .map(|&x| ln1p(x))
    .collect();
    assert_eq!(d, &want[..]);
    assert_eq!(d[0], 6f64.ln() as f32);
    assert!((d[0] - 1.791_759_5).abs() < 1e-6);
    assert_eq!(d[2], 0.0, "negative integers clamp to 0");
    assert_eq!(d[3], 0.0, "missing is 0");
    assert_eq!(ex.labels()[0], 1.0);
    assert_eq!(ex.id(0, 0), Some(0x68fd1e64));
    assert_eq!(ex.id(0, 25), Some(0x9727dd16));
    assert_eq!(ex.id(0, 21), None);
    assert!(ex.is_missing(0, 21));

    // Line 2: label 0 and every feature empty.
    assert_eq!(ex.labels()[1], 0.0);
    assert!(ex.dense()[13..26].iter().all(|&x| x == 0.0));
    assert!((0..26).all(|j| ex.is_missing(1, j)));

    // Line 3: i64 extremes, ffffffff, 00000000 (present, not missing), upper-case hex.
    let d3 = &ex.dense()[26..39];
    assert_eq!(d3[0], ln1p(9_223_372_036_854_775_807.0));
    assert_eq!(d3[1], 0.0);
    assert_eq!(ex.id(2, 0), Some(u32::MAX));
    assert_eq!(ex.id(2, 1), Some(0));
    assert_eq!(ex.id(2, 2), Some(0xabcdef12));
    assert_eq!(dense_transform(-7.0), 0.0);

    let pos = ex.labels().iter().filter(|&&l| l == 1.0).count();
    assert_eq!(ex.positive_rate(), pos as f64 / 20.0);
    assert!(ex.labels().iter().all(|&l| l == 0.0 || l == 1.0));
}

#[test]
fn criteo_malformed_lines_are_counted_reported_and_skipped() {
    let path = fixture(CRITEO);
    let (_, _, rep) = load_plain(&criteo(&path));
    assert_eq!(rep.malformed, 6);
    assert_eq!(rep.first_errors.len(), 5, "at most 5 kept");
    let e = &rep.first_errors;
    assert!(e[0].starts_with(&format!("{path}:6: expected 40 tab-separated fields")));
    assert!(
        e[0].ends_with(
            "found 39 (no label column: Erase trains and evaluates on labeled examples only)"
        ),
        "{}",
        e[0]
    );
    assert!(e[1].starts_with(&format!("{path}:9: ")) && e[1].ends_with("found 41"));
    assert!(e[2].starts_with(&format!("{path}:14: C3 'xyz12345' is not a 32-bit hex id")));
    assert!(e[3].starts_with(&format!("{path}:17: I1 '123456789012345678901234'")));
    assert!(
        e[3].contains("does not fit in a 64-bit integer"),
        "{}",
        e[3]
    );
    assert!(e[4].starts_with(&format!("{path}:21: label '2': expected 0 or 1")));
    let shown = rep.to_string();
    assert!(shown.contains("6 malformed skipped") && shown.contains("... and 1 more"));
}

#[test]
fn strict_stops_at_the_first_malformed_line() {
    let path = fixture(CRITEO);
    let opts = LoadOptions {
        strict: true,
        cache_dir: None,
        ..Default::default()
    };
    let msg = err_text(load(&criteo(&path), &opts));
    assert_eq!(
        msg,
        format!("{path}:6: expected 40 tab-separated fields (label, I1..I13, C1..C26), found 39 (no label column: Erase trains and evaluates on labeled examples only)")
    );
}

#[test]
fn gzip_equals_plain_by_magic_not_name() {
    let (plain, _, _) = load_plain(&criteo(&fixture(CRITEO)));
    let (gz, _, rep) = load_plain(&criteo(&fixture(CRITEO_GZ)));
    assert_eq!(contents(&plain), contents(&gz));
    assert_eq!(rep.malformed, 6);
    assert!(rep.first_errors[0].contains("criteo_small.tsv.gz:6:"));
    // A gzip file without the .gz name, and a plain one named .gz.
    let dir = scratch("gzip_magic");
    let a = dir.join("data.txt");
    let b = dir.join("plain.gz");
    fs::copy(fixture(CRITEO_GZ), &a).unwrap();
    fs::copy(fixture(CRITEO), &b).unwrap();
    for p in [&a, &b] {
        let (e, _, _) = load_plain(&criteo(p.to_str().unwrap()));
        assert_eq!(contents(&plain), contents(&e));
    }
}

#[test]
fn empty_and_missing_files_are_clear_errors() {
    let dir = scratch("empty_missing");
    let empty = dir.join("empty.tsv");
    fs::write(&empty, b"").unwrap();
    let p = empty.to_str().unwrap();
    assert_eq!(
        err_text(load(&criteo(p), &LoadOptions::default())),
        format!("no examples in {p}")
    );
    // Only malformed lines: still no examples, and it says why.
    let bad = dir.join("bad.tsv");
    fs::write(&bad, b"1\t2\n\n").unwrap();
    let msg = err_text(load(
        &criteo(bad.to_str().unwrap()),
        &LoadOptions::default(),
    ));
    assert!(msg.starts_with(&format!("no examples in {}", bad.display())));
    assert!(msg.contains("1 malformed"), "{msg}");
    // Mostly malformed lines (another format): an error, not a run on the few that parse.
    let good = fs::read_to_string(fixture("tests/data/criteo_floats.tsv")).unwrap();
    let mut mixed: String = good.lines().take(3).map(|l| format!("{l}\n")).collect();
    mixed += &"a,b,c\n".repeat(4);
    let mixed_path = dir.join("mixed.tsv");
    fs::write(&mixed_path, mixed).unwrap();
    let msg = err_text(load(
        &criteo(mixed_path.to_str().unwrap()),
        &LoadOptions::default(),
    ));
    assert!(
        msg.contains("4 of the 7 lines") && msg.contains("mixed.tsv:4"),
        "{msg}"
    );

    let missing = dir.join("nope.tsv");
    let msg = err_text(load(
        &criteo(missing.to_str().unwrap()),
        &LoadOptions::default(),
    ));
    assert!(msg.contains(missing.to_str().unwrap()), "{msg}");
    assert!(msg.contains("No such file"), "{msg}");
}

#[test]
fn glob_and_folder_paths() {
    assert!(glob_match("part-*.tsv", "part-001.tsv"));
    assert!(glob_match("*", "x"));
    assert!(glob_match("a*b*c", "aXXbYYc"));
    assert!(glob_match("a*b*c", "abc"));
    assert!(!glob_match("a*b*c", "abcd"));
    assert!(glob_match("day_?", "day_7"));
    assert!(!glob_match("day_?", "day_10"));
    assert!(glob_match("*.gz", "a.tsv.gz"));
    assert!(!glob_match("*.gz", "a.tsv"));

    // The fixture and its gzipped copy: 2 files, twice the examples.
    let pattern = fixture("tests/data/criteo_small.tsv*");
    let (ex, _, rep) = load_plain(&criteo(&pattern));
    assert_eq!((rep.files, ex.len(), rep.malformed), (2, 40, 12));
    let one = fixture("tests/data/criteo_smal?.tsv");
    assert_eq!(resolve_path(&one).unwrap().len(), 1);
    let none = fixture("tests/data/nothing-*.tsv");
    let msg = format!("{:#}", resolve_path(&none).unwrap_err());
    assert_eq!(msg, format!("no files match {none}"));

    // A folder: regular files sorted by name; dotfiles and sub-folders skipped.
    let dir = scratch("folder");
    fs::copy(fixture(CRITEO_GZ), dir.join("b-part.gz")).unwrap();
    fs::copy(fixture(CRITEO), dir.join("a-part.tsv")).unwrap();
    fs::write(dir.join(".hidden"), b"junk\n").unwrap();
    fs::create_dir(dir.join("sub")).unwrap();
    let files = resolve_path(dir.to_str().unwrap()).unwrap();
    let names: Vec<_> = files
        .iter()
        .map(|f| f.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ["a-part.tsv", "b-part.gz"]);
    let (ex, _, rep) = load_plain(&criteo(dir.to_str().unwrap()));
    assert_eq!((rep.files, ex.len()), (2, 40));
    assert!(rep.first_errors[0].contains("a-part.tsv:6:"));
    // A cache kept in the data folder itself is never read as data.
    let here = LoadOptions {
        strict: false,
        cache_dir: Some(dir.clone()),
        ..Default::default()
    };
    let src = criteo(dir.to_str().unwrap());
    assert!(!load(&src, &here).unwrap().2.from_cache);
    let (ex, _, rep) = load(&src, &here).unwrap();
    assert!(rep.from_cache);
    assert_eq!((rep.files, ex.len()), (2, 40));
    assert_eq!(resolve_path(dir.to_str().unwrap()).unwrap(), files);
    // A glob over the folder.
    let g = format!("{}/*-part*", dir.display());
    assert_eq!(resolve_path(&g).unwrap(), files);
    // An empty folder.
    let empty = scratch("folder_empty");
    let msg = format!("{:#}", resolve_path(empty.to_str().unwrap()).unwrap_err());
    assert!(msg.contains("holds no files"), "{msg}");
}

#[test]
fn fill_batch_wraps_around() {
    let (ex, _, _) = load_plain(&criteo(&fixture(CRITEO)));
    let (n, nd, ns) = (ex.len(), ex.num_dense, ex.num_sparse);
    let rows_per_table = 1000;
    let batch = 5;
    let mut dense = vec![0f32; batch * nd];
    let mut rows = vec![0u32; batch * ns];
    let mut labels = vec![0f32; batch];
    // 3 full passes plus 18: examples 18, 19, 0, 1, 2.
    ex.fill_batch(
        (3 * n + 18) as u64,
        batch,
        rows_per_table,
        &mut dense,
        &mut rows,
        &mut labels,
    );
    for (k, i) in [18usize, 19, 0, 1, 2].into_iter().enumerate() {
        assert_eq!(
            &dense[k * nd..(k + 1) * nd],
            &ex.dense()[i * nd..(i + 1) * nd]
        );
        assert_eq!(labels[k], ex.labels()[i]);
        for j in 0..ns {
            let want = ex.id(i, j).map_or(0, |id| id % rows_per_table as u32);
            assert_eq!(rows[k * ns + j], want);
        }
    }
    // Example 0's C1 and example 2's ffffffff / 00000000 / missing.
    assert_eq!(rows[2 * ns], 0x68fd1e64 % 1000);
    assert_eq!(rows[2 * ns + 21], 0, "missing -> row 0");
    assert_eq!(rows[4 * ns], u32::MAX % 1000);
    assert_eq!(rows[4 * ns + 1], 0);

    let mut d1 = vec![0f32; 2 * nd];
    let mut r1 = vec![0u32; 2 * ns];
    let mut l1 = vec![0f32; 2];
    ex.fill_batch_indices(&[2, 18], rows_per_table, &mut d1, &mut r1, &mut l1);
    assert_eq!(&d1[..nd], &dense[4 * nd..5 * nd]);
    assert_eq!(&r1[ns..], &rows[..ns]);
}

fn recbole_schema() -> TsvSchema {
    TsvSchema::from_toml(
        r#"
        [data]
        path = "ignored by the schema"
        [data.schema]
        separator = "\t"
        header = true
        label = "rating"
        label_threshold = 4.0
        dense = ["timestamp"]
        categorical = ["user_id", "item_id"]
        time = "timestamp"
        eval_fraction = 0.25
        "#,
    )
    .unwrap()
}

#[test]
fn tsv_schema_from_toml_and_data_arg() {
    let s = recbole_schema();
    assert_eq!(s.separator, '\t');
    assert_eq!(s.label, "rating");
    assert_eq!(s.label_threshold, Some(4.0));
    assert_eq!(s.dense, ["timestamp"]);
    assert_eq!(s.categorical, ["user_id", "item_id"]);
    assert_eq!(s.time.as_deref(), Some("timestamp"));
    // Defaults, a bare table, indices as integers.
    let bare = TsvSchema::from_toml("label = 0\ncategorical = [1, \"2\"]\n").unwrap();
    assert_eq!(bare.separator, '\t');
    assert!(bare.header);
    assert_eq!(bare.label, "0");
    assert_eq!(bare.categorical, ["1", "2"]);
    assert_eq!(bare.time, None);
    let typo = TsvSchema::from_toml("label = \"y\"\ncategorical = [\"a\"]\nlabels = 1\n");
    assert!(format!("{:#}", typo.unwrap_err()).contains("labels"));
    let sep = TsvSchema::from_toml("separator = \"ab\"\nlabel = \"y\"\ndense = [\"a\"]\n");
    assert!(sep.is_err());

    let leak = TsvSchema::from_toml("label = \"y\"\ndense = [\"y\"]\n");
    assert!(format!("{:#}", leak.unwrap_err()).contains("also a feature"));
    let no_schema = TsvSchema::from_toml("[data]\npath = \"x\"\n");
    assert!(format!("{:#}", no_schema.unwrap_err()).contains("no [data.schema]"));

    assert_eq!(parse_data_arg("synthetic", None).unwrap(), None);
    assert_eq!(
        parse_data_arg("criteo:/d/day_*", None).unwrap(),
        Some(criteo("/d/day_*"))
    );
    assert_eq!(
        parse_data_arg("tsv:x.inter", Some(&s)).unwrap(),
        Some(DataSource::Tsv {
            path: "x.inter".into(),
            schema: s.clone()
        })
    );
    assert!(format!("{:#}", parse_data_arg("tsv:x", None).unwrap_err()).contains("[data.schema]"));
    assert!(parse_data_arg("avazu:x", None).is_err());
}

#[test]
fn tsv_recbole_header_crlf_and_time_split() {
    let path = fixture(RECBOLE);
    let raw = fs::read(&path).unwrap();
    assert!(
        raw.windows(2).filter(|w| w == b"\r\n").count() == 12,
        "the fixture must keep its CRLF line endings"
    );
    let src = DataSource::Tsv {
        path: path.clone(),
        schema: recbole_schema(),
    };
    let (train, eval, rep) = load_plain(&src);
    let eval = eval.expect("a time split");
    assert_eq!((train.num_dense, train.num_sparse), (1, 2));
    assert_eq!(rep.lines, 11);
    assert_eq!(rep.malformed, 3);
    assert_eq!((rep.examples, rep.eval_examples), (8, 2));
    assert_eq!(
        rep.first_errors,
        [
            format!("{path}:7: label 'rating' 'four' is not a number"),
            format!("{path}:8: time 'timestamp' is empty"),
            format!("{path}:9: expected 4 fields, found 5"),
        ]
    );
    // Eval: the latest 2 by time (978824291, 978302109), in file order.
    assert_eq!(eval.len(), 2);
    assert_eq!(eval.labels(), [0.0, 1.0]);
    assert_eq!(eval.dense()[0], ln1p(978302109.0));
    assert_eq!(eval.dense()[1], ln1p(978824291.0));
    assert_eq!(
        eval.id(0, 1),
        Some(hash_category(b"\"Great Escape, The (1963)\""))
    );
    assert_eq!(eval.id(1, 1), None, "empty item -> missing");
    // Train: the rest, in file order; ratings 5, 4, 2, 4.5, 3.9, 4 (>= 4: 1, 1, 0, 1, 0, 1).
    assert_eq!(train.len(), 6);
    assert_eq!(train.labels(), [1.0, 1.0, 0.0, 1.0, 0.0, 1.0]);
    assert_eq!(train.dense()[0], ln1p(978300760.0));
    assert_eq!(train.id(0, 0), Some(hash_category(b"u1")));
    assert_eq!(train.id(0, 1), Some(hash_category(b"Toy Story (1995)")));
    assert_eq!(
        train.id(0, 1),
        train.id(1, 1),
        "the same title, the same id"
    );
    assert_eq!(train.id(5, 0), Some(hash_category(b"u6")), "no trailing CR");
    assert!((train.positive_rate() - 4.0 / 6.0).abs() < 1e-15);

    // The hash is fixed: these values must never change.
    assert_eq!(hash_category(b""), hash_category(b""));
    assert_eq!(hash_category(b"u1"), 0xb85a_5b3a);
    assert_eq!(hash_category(b"Toy Story (1995)"), 0x4c69_d1da);

    // The same by column index, no header, a comma separator and LF endings.
    let dir = scratch("tsv_indices");
    let csv = dir.join("log.csv");
    fs::write(&csv, "u1,Toy Story (1995),5,978300760\nu2,,1,978300761\n").unwrap();
    let schema = TsvSchema {
        separator: ',',
        header: false,
        label: "2".into(),
        label_threshold: Some(4.0),
        dense: vec![],
        categorical: vec!["0".into(), "1".into()],
        time: None,
        eval_fraction: 0.1,
        max_list: 1024,
        list_separator: None,
        mean: vec![],
    };
    let (ex, eval, rep) = load_plain(&DataSource::Tsv {
        path: csv.to_string_lossy().into(),
        schema: schema.clone(),
    });
    assert!(eval.is_none());
    assert_eq!((ex.len(), rep.malformed, ex.num_dense), (2, 0, 0));
    assert_eq!(ex.labels(), [1.0, 0.0]);
    assert_eq!(ex.id(0, 1), Some(hash_category(b"Toy Story (1995)")));
    assert_eq!(ex.id(1, 1), None);
    // Names without a header are an error, and so is an unknown header name.
    let named = TsvSchema {
        label: "rating".into(),
        ..schema
    };
    let msg = err_text(load(
        &DataSource::Tsv {
            path: csv.to_string_lossy().into(),
            schema: named,
        },
        &LoadOptions::default(),
    ));
    assert!(msg.contains("0-based indices"), "{msg}");
    let mut unknown = recbole_schema();
    unknown.categorical.push("genre".into());
    let msg = err_text(load(
        &DataSource::Tsv {
            path: path.clone(),
            schema: unknown,
        },
        &LoadOptions::default(),
    ));
    assert!(msg.starts_with(&format!(
        "{path}:1: header: column 'genre' is not in the header"
    )));

    // Every file of a source must have the first file's header.
    let two = scratch("tsv_headers");
    fs::copy(&path, two.join("a.inter")).unwrap();
    fs::write(
        two.join("b.inter"),
        "user_id\titem_id\trating\ttimestamp\r\nu9\tX\t5\t1\r\n",
    )
    .unwrap();
    let msg = err_text(load(
        &DataSource::Tsv {
            path: two.to_string_lossy().into(),
            schema: recbole_schema(),
        },
        &LoadOptions::default(),
    ));
    assert!(msg.contains("b.inter:1: header: 'user_id"), "{msg}");
    assert!(
        msg.contains("differs from the first file's header"),
        "{msg}"
    );

    // A label that is not 0/1 without a threshold.
    let mut no_threshold = recbole_schema();
    no_threshold.label_threshold = None;
    let msg = err_text(load(
        &DataSource::Tsv {
            path: path.clone(),
            schema: no_threshold,
        },
        &LoadOptions::default(),
    ));
    assert!(msg.starts_with(&format!("no examples in {path} (11 malformed lines skipped; first: {path}:2: label 'rating' '5': expected 0 or 1")), "{msg}");
}

/// Copies the Criteo fixture into a scratch folder and loads it with a cache there.
struct CacheCase {
    data: PathBuf,
    opts: LoadOptions,
}

impl CacheCase {
    fn new(name: &str) -> CacheCase {
        let dir = scratch(name);
        let data = dir.join("train.tsv");
        fs::copy(fixture(CRITEO), &data).unwrap();
        CacheCase {
            data,
            opts: LoadOptions {
                strict: false,
                cache_dir: Some(dir.join("cache")),
                ..Default::default()
            },
        }
    }

    fn load(&self) -> (Examples, LoadReport) {
        let (e, eval, r) = load(&criteo(self.data.to_str().unwrap()), &self.opts).unwrap();
        assert!(eval.is_none());
        (e, r)
    }
}

#[test]
fn cache_is_written_then_mapped() {
    let case = CacheCase::new("cache_basic");
    let (first, r1) = case.load();
    assert!(!r1.from_cache && !first.is_mapped());
    assert!(r1.warnings.is_empty(), "{:?}", r1.warnings);
    let cache = r1.cache_path.clone().unwrap();
    assert!(cache.exists());
    let (second, r2) = case.load();
    assert!(r2.from_cache && second.is_mapped());
    assert_eq!(contents(&first), contents(&second));
    assert_eq!(r2.cache_path.as_ref(), Some(&cache));
    // The report survives the cache, so strict still fails on a cached malformed line.
    assert_eq!(
        (r2.lines, r2.examples, r2.malformed, &r2.first_errors),
        (r1.lines, r1.examples, r1.malformed, &r1.first_errors)
    );
    let strict = LoadOptions {
        strict: true,
        ..case.opts.clone()
    };
    let msg = err_text(load(&criteo(case.data.to_str().unwrap()), &strict));
    assert!(msg.contains("train.tsv:6: expected 40"), "{msg}");
    // Mapped batches equal in-memory ones.
    let mut bufs = [
        (vec![0f32; 7 * 13], vec![0u32; 7 * 26], vec![0f32; 7]),
        (vec![0f32; 7 * 13], vec![0u32; 7 * 26], vec![0f32; 7]),
    ];
    for (e, (d, r, l)) in [&first, &second].into_iter().zip(bufs.iter_mut()) {
        e.fill_batch(17, 7, 100_000, d, r, l);
    }
    assert_eq!(bufs[0], bufs[1]);
    // No temporary files are left beside it.
    let left: Vec<_> = fs::read_dir(cache.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left, [cache.file_name().unwrap()]);
}

#[test]
fn cache_truncated_or_corrupt_is_rebuilt() {
    let case = CacheCase::new("cache_corrupt");
    let (first, r1) = case.load();
    let cache = r1.cache_path.clone().unwrap();
    let len = fs::metadata(&cache).unwrap().len();

    // Truncated by 8 bytes.
    fs::OpenOptions::new()
        .write(true)
        .open(&cache)
        .unwrap()
        .set_len(len - 8)
        .unwrap();
    let (e, r) = case.load();
    assert!(!r.from_cache);
    assert!(r.warnings[0].contains("truncated"), "{:?}", r.warnings);
    assert_eq!(contents(&e), contents(&first));
    assert_eq!(fs::metadata(&cache).unwrap().len(), len, "rebuilt");
    assert!(case.load().1.from_cache);

    // One payload byte flipped.
    let mut bytes = fs::read(&cache).unwrap();
    let at = bytes.len() - 100;
    bytes[at] ^= 0x10;
    fs::write(&cache, &bytes).unwrap();
    let (e, r) = case.load();
    assert!(!r.from_cache);
    assert!(r.warnings[0].contains("payload"), "{:?}", r.warnings);
    assert_eq!(contents(&e), contents(&first));

    // A header byte flipped (a count).
    let mut bytes = fs::read(&cache).unwrap();
    bytes[48] ^= 1;
    fs::write(&cache, &bytes).unwrap();
    let r = case.load().1;
    assert!(
        !r.from_cache && r.warnings[0].contains("header"),
        "{:?}",
        r.warnings
    );

    // Garbage and an empty file.
    fs::write(&cache, b"not a cache").unwrap();
    assert!(!case.load().1.from_cache);
    fs::write(&cache, b"").unwrap();
    assert!(!case.load().1.from_cache);
    assert!(case.load().1.from_cache);
}

#[test]
fn cache_is_invalidated_by_changed_sources() {
    let case = CacheCase::new("cache_stale");
    let (_, r1) = case.load();
    assert!(case.load().1.from_cache);

    // Same size, new mtime.
    let f = fs::OpenOptions::new().write(true).open(&case.data).unwrap();
    f.set_modified(SystemTime::now() + Duration::from_secs(5))
        .unwrap();
    drop(f);
    let (_, r) = case.load();
    assert!(!r.from_cache);
    assert!(r.warnings[0].contains("stale"), "{:?}", r.warnings);
    assert_eq!(r.cache_path, r1.cache_path, "the same file, rewritten");
    assert!(case.load().1.from_cache);

    // New content: one more line.
    let mut text = fs::read(&case.data).unwrap();
    text.extend_from_slice(b"1\t1\t\t\t\t\t\t\t\t\t\t\t\t\t");
    text.extend_from_slice("\t".repeat(25).as_bytes());
    text.push(b'\n');
    fs::write(&case.data, &text).unwrap();
    let (e, r) = case.load();
    assert!(!r.from_cache);
    assert_eq!(e.len(), 21);
    let (e, r) = case.load();
    assert!(r.from_cache);
    assert_eq!(e.len(), 21);
    assert_eq!(e.dense()[20 * 13], 2f64.ln() as f32);

    // A different schema (here: another reader) gets its own cache file.
    let schema = TsvSchema {
        separator: '\t',
        header: false,
        label: "0".into(),
        label_threshold: None,
        dense: vec!["1".into()],
        categorical: vec!["14".into()],
        time: None,
        eval_fraction: 0.1,
        max_list: 1024,
        list_separator: None,
        mean: vec![],
    };
    let tsv = DataSource::Tsv {
        path: case.data.to_string_lossy().into(),
        schema,
    };
    let (e, _, r) = load(&tsv, &case.opts).unwrap();
    assert!(!r.from_cache);
    assert_ne!(r.cache_path, r1.cache_path);
    assert_eq!((e.num_dense, e.num_sparse), (1, 1));
    assert!(case.load().1.from_cache, "the Criteo cache is untouched");
}

#[test]
fn cache_keeps_the_time_split() {
    let dir = scratch("cache_split");
    let src = DataSource::Tsv {
        path: fixture(RECBOLE),
        schema: recbole_schema(),
    };
    let opts = LoadOptions {
        strict: false,
        cache_dir: Some(dir),
        ..Default::default()
    };
    let (t1, e1, r1) = load(&src, &opts).unwrap();
    let (t2, e2, r2) = load(&src, &opts).unwrap();
    assert!(!r1.from_cache && r2.from_cache);
    assert_eq!(contents(&t1), contents(&t2));
    assert_eq!(contents(&e1.unwrap()), contents(&e2.unwrap()));
    assert_eq!(r2.eval_examples, 2);
}

/// MovieLens-1M from `shared/data`, where it exists (it may not be redistributed, so it
/// is never in this repository).
#[test]
fn movielens_1m_when_present() {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/data/movielens-1m/ml-1m.inter.gz");
    if !path.exists() {
        println!(
            "note: {} not found; MovieLens check skipped",
            path.display()
        );
        return;
    }
    let schema = TsvSchema {
        separator: '\t',
        header: true,
        label: "rating".into(),
        label_threshold: Some(4.0),
        dense: vec![],
        categorical: vec!["user_id".into(), "item_id".into()],
        time: None,
        eval_fraction: 0.1,
        max_list: 1024,
        list_separator: None,
        mean: vec![],
    };
    let src = DataSource::Tsv {
        path: path.to_string_lossy().into(),
        schema: schema.clone(),
    };
    let t0 = Instant::now();
    let (ex, eval, rep) = load_plain(&src);
    let parse_s = t0.elapsed().as_secs_f64();
    assert!(eval.is_none());
    assert_eq!(ex.len(), 1_000_209);
    assert_eq!(rep.malformed, 0, "{:?}", rep.first_errors);
    let pos = ex.labels().iter().filter(|&&l| l == 1.0).count();
    assert_eq!(pos, 575_281);
    assert!((ex.positive_rate() * 100.0 - 57.52).abs() < 0.005);
    let users: HashSet<u32> = (0..ex.len()).filter_map(|i| ex.id(i, 0)).collect();
    let items: HashSet<u32> = (0..ex.len()).filter_map(|i| ex.id(i, 1)).collect();
    assert_eq!((users.len(), items.len()), (6040, 3706));

    // With a time split and the cache.
    let cache = scratch("movielens");
    let opts = LoadOptions {
        strict: false,
        cache_dir: Some(cache),
        ..Default::default()
    };
    let split = DataSource::Tsv {
        path: path.to_string_lossy().into(),
        schema: TsvSchema {
            time: Some("timestamp".into()),
            ..schema
        },
    };
    let t0 = Instant::now();
    let (train, eval, r1) = load(&split, &opts).unwrap();
    let build_s = t0.elapsed().as_secs_f64();
    let t0 = Instant::now();
    let (train2, eval2, r2) = load(&split, &opts).unwrap();
    let cached_s = t0.elapsed().as_secs_f64();
    assert!(!r1.from_cache && r2.from_cache, "{:?}", r1.warnings);
    let eval = eval.unwrap();
    assert_eq!((train.len(), eval.len()), (900_188, 100_021));
    assert_eq!(contents(&train), contents(&train2));
    assert_eq!(contents(&eval), contents(&eval2.unwrap()));
    println!(
        "movielens-1m: {} rows, positive rate {:.4} %, {} users, {} items; parse {parse_s:.2} s, \
         parse+split+cache write {build_s:.2} s, cached load {cached_s:.3} s; \
         time split: train {} (positive {:.4} %), eval {} (positive {:.4} %)",
        ex.len(),
        ex.positive_rate() * 100.0,
        users.len(),
        items.len(),
        train.len(),
        train.positive_rate() * 100.0,
        eval.len(),
        eval.positive_rate() * 100.0,
    );
}

/// Every bag and row a model would be fed, for equality checks across storages.
fn fed(e: &Examples) -> (Vec<Vec<u32>>, Vec<u32>, Vec<u32>) {
    let bags = (0..e.len())
        .flat_map(|i| (0..e.num_sparse).map(move |j| (i, j)))
        .map(|(i, j)| e.bag(i, j).to_vec())
        .collect();
    (
        bags,
        e.dense().iter().map(|x| x.to_bits()).collect(),
        e.labels().iter().map(|x| x.to_bits()).collect(),
    )
}

#[test]
fn data_streamed_into_the_cache_equals_data_parsed_in_memory_and_splits_as_views() {
    let dir = scratch("stream");
    let multi = TsvSchema::from_toml(
        "label = \"label\"\ndense = [\"price\"]\ncategorical = [\"user\", \"item\", \"genres\"]\nlist_separator = \"|\"\n",
    )
    .unwrap();
    let sources = [
        criteo(&fixture("tests/data/criteo_floats.tsv")),
        DataSource::Tsv {
            path: fixture("tests/data/multihot_sample.tsv"),
            schema: multi,
        },
    ];
    for (k, src) in sources.iter().enumerate() {
        let (mem, _, rm) = load_plain(src);
        let opts = LoadOptions {
            cache_dir: Some(dir.join(format!("cache{k}"))),
            stream: Some(true),
            threads: Some(2),
            ..Default::default()
        };
        let (streamed, eval, rs) = load(src, &opts).unwrap();
        // parsed once, straight into the file that training maps
        assert!(
            streamed.is_mapped() && eval.is_none() && !rs.from_cache,
            "{rs}"
        );
        assert_eq!(
            (rs.lines, rs.examples, rs.malformed),
            (rm.lines, rm.examples, rm.malformed)
        );
        assert_eq!(streamed.digest(), mem.digest());
        assert_eq!(fed(&streamed), fed(&mem));
        assert_eq!(streamed.max_bag_lens(), mem.max_bag_lens());
        // the held-out tail of a mapped file is a view with the same content as the
        // in-memory split's
        let (t1, e1) = streamed.split_tail(0.1).unwrap();
        let (t2, e2) = mem.split_tail(0.1).unwrap();
        assert!(t1.is_mapped() && e1.is_mapped());
        assert_eq!((t1.len(), e1.len()), (t2.len(), e2.len()));
        assert_eq!(fed(&t1), fed(&t2));
        assert_eq!(fed(&e1), fed(&e2));
        assert_eq!((t1.digest(), e1.digest()), (t2.digest(), e2.digest()));
        let n = 7;
        let (ns, nd) = (mem.num_sparse, mem.num_dense);
        let rows = vec![97usize; ns];
        let slots = e1.max_bag_lens();
        let per: usize = slots.iter().sum();
        let fill = |e: &Examples| {
            let (mut d, mut r, mut l) = (vec![0f32; n * nd], vec![0u32; n * per], vec![0f32; n]);
            let slots = e.is_multi_hot().then_some(&slots[..]);
            e.fill_batch_rows(3, n, &rows, slots, &mut d, &mut r, &mut l);
            (d.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), r, l)
        };
        assert_eq!(fill(&e1), fill(&e2));
        // and a second load maps the same file again
        let (again, _, r3) = load(src, &opts).unwrap();
        assert!(r3.from_cache && again.digest() == mem.digest());
    }
}

/// A list longer than the schema's `max_list` makes its line malformed (it would size every
/// example's bag): skipped and counted, or with `strict` an error naming file and line.
#[test]
fn a_list_longer_than_max_list_is_a_malformed_line() {
    let schema = |max: usize| {
        TsvSchema::from_toml(&format!(
            "label = \"label\"\ndense = [\"price\"]\ncategorical = [\"user\", \"item\", \"genres\"]\nlist_separator = \"|\"\nmax_list = {max}\n"
        ))
        .unwrap()
    };
    let src = |max: usize| DataSource::Tsv {
        path: fixture("tests/data/multihot_sample.tsv"),
        schema: schema(max),
    };
    let (all, _, r) = load_plain(&src(1024));
    assert_eq!(r.malformed, 0, "{r}");
    let longest = all.max_bag_lens()[2];
    assert!(longest > 2, "the sample's longest genres list: {longest}");
    let (some, _, r) = load_plain(&src(longest - 1));
    assert!(r.malformed > 0 && some.len() < all.len(), "{r}");
    assert!(some.max_bag_lens()[2] < longest);
    assert!(
        r.first_errors[0].contains("more than max_list"),
        "{:?}",
        r.first_errors
    );
    let strict = LoadOptions {
        strict: true,
        ..Default::default()
    };
    let e = err_text(load(&src(longest - 1), &strict));
    assert!(
        e.contains("multihot_sample.tsv:") && e.contains("'genres' holds"),
        "{e}"
    );
    match TsvSchema::from_toml("label = \"l\"\nmax_list = 0\n") {
        Ok(_) => panic!("max_list = 0 accepted"),
        Err(e) => assert!(e.to_string().contains("max_list"), "{e}"),
    }
}
