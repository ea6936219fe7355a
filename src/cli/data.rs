//! `erase-ctr data`: what a data source holds and how fast it parses; and a writer of
//! Criteo-layout files of any size, for benchmarks and tests.

use std::io::Write as _;

use anyhow::{bail, Context, Result};
use clap::Args;

use crate::data::{load, parse_data_arg, LoadOptions, TsvSchema};

#[derive(Args)]
pub(crate) struct DataArgs {
    /// The data: `criteo:PATH` or `tsv:PATH` (with `[data.schema]` in --config), as for
    /// train.
    #[arg(long, required_unless_present = "write_criteo")]
    data: Option<String>,
    /// A TOML file whose `[data.schema]` describes `tsv:` data.
    #[arg(long, value_name = "FILE")]
    config: Option<std::path::PathBuf>,
    /// Parse the data once per thread count in this list (`all`: every core), without the
    /// cache, and print lines/s and MB/s of each.
    #[arg(long, value_delimiter = ',', default_value = "1,2,all")]
    threads: Vec<String>,
    /// Also count the distinct ids of each field (what `--table-rows auto` gives).
    #[arg(long)]
    counts: bool,
    /// Write the parse rates as JSON to this file.
    #[arg(long, value_name = "FILE")]
    json: Option<std::path::PathBuf>,
    /// Instead: write a Criteo-layout file of --lines random lines here (plain text;
    /// integers, some written as floats and some missing; 8-hex-digit ids of skewed
    /// frequency; a label of about 25 % positives that depends on the ids of the first 8
    /// fields and the first integer, so a model trained on it learns), then stop. The other flags of `data`
    /// do not apply.
    #[arg(long, value_name = "PATH")]
    write_criteo: Option<std::path::PathBuf>,
    /// Lines of --write-criteo.
    #[arg(long, default_value_t = 1_000_000)]
    lines: u64,
    /// Seed of --write-criteo.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

fn schema_of(config: Option<&std::path::Path>) -> Result<Option<TsvSchema>> {
    let Some(p) = config else { return Ok(None) };
    let text = std::fs::read_to_string(p).with_context(|| format!("--config {}", p.display()))?;
    let table: toml::Table = text
        .parse()
        .with_context(|| format!("{} is not valid TOML", p.display()))?;
    if table.get("data").and_then(|d| d.get("schema")).is_none() {
        return Ok(None);
    }
    Ok(Some(TsvSchema::from_toml(&text).with_context(|| {
        format!("{}: [data.schema]", p.display())
    })?))
}

pub(super) fn run(a: &DataArgs) -> Result<()> {
    if let Some(p) = &a.json {
        super::check_output("--json", p)?;
    }
    if let Some(path) = &a.write_criteo {
        if a.data.is_some() {
            bail!("--write-criteo writes synthetic data and reads none; drop --data (or run `data --data` on its own)");
        }
        if a.json.is_some() || a.counts {
            bail!("--json and --counts describe data that `data --data` reads; --write-criteo writes data and reports neither (run `data --data criteo:PATH` on the file it writes)");
        }
        if a.lines == 0 {
            bail!("--lines 0: --write-criteo needs at least one line");
        }
        super::check_output("--write-criteo", path)?;
        return write_criteo(path, a.lines, a.seed);
    }
    let data = a.data.as_deref().unwrap_or_default();
    let schema = schema_of(a.config.as_deref())?;
    let Some(src) = parse_data_arg(data, schema.as_ref()).context("--data")? else {
        bail!("--data synthetic has nothing to parse; give criteo:PATH or tsv:PATH");
    };
    if let (crate::data::DataSource::Criteo { .. }, Some(_), Some(p)) = (&src, &schema, &a.config) {
        bail!(
            "{}: [data.schema] describes the columns of tsv: data, but --data {data} has \
             Criteo's fixed layout; use --data tsv:PATH, or drop [data.schema]",
            p.display()
        );
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut counts = Vec::new();
    for t in &a.threads {
        let n = match t.trim() {
            "all" => cores,
            s => super::at_least_one(s).map_err(|e| anyhow::anyhow!("--threads {s}: {e}"))?,
        };
        if !counts.contains(&n) {
            counts.push(n);
        }
    }
    let mut rows = Vec::new();
    let mut last = None;
    for &n in &counts {
        let opts = LoadOptions {
            threads: Some(n),
            ..Default::default()
        };
        let t0 = std::time::Instant::now();
        let (train, eval, report) = load(&src, &opts)?;
        let secs = t0.elapsed().as_secs_f64();
        let lines_s = report.lines as f64 / secs;
        // the threads the parse used: fewer than asked where the data has fewer pieces
        let used = report.parse_threads.clamp(1, n);
        println!(
            "{n:>3} thread{} asked, {used} used: {} lines in {secs:.2} s: {:.0}k lines/s, {:.0} MB/s ({} malformed)",
            if n == 1 { "" } else { "s" },
            report.lines,
            lines_s / 1e3,
            report.parse_bytes as f64 / secs / 1e6,
            report.malformed
        );
        rows.push(serde_json::json!({
                "threads": n,
                "threads_used": used,
                "lines": report.lines,
                "bytes": report.parse_bytes,
                "secs": (secs * 1e4).round() / 1e4,
                "lines_per_s": lines_s.round(),
        }));
        last = Some((train, eval, report));
    }
    if let Some((train, eval, report)) = &mut last {
        // the split train makes: a source without one holds out its last lines
        if eval.is_none() {
            let fraction = super::held_out_fraction(&src);
            let (tr, ev) = train.split_tail(fraction).with_context(|| {
                format!("holding out {fraction} of the examples for evaluation")
            })?;
            (*train, *eval) = (tr, Some(ev));
        }
        println!("{report}");
        println!(
            "{} training examples, {} held out; {} dense and {} categorical fields{}, {:.2} % positive",
            train.len(),
            eval.as_ref().map_or(0, |e| e.len()),
            train.num_dense,
            train.num_sparse,
            if train.is_multi_hot() {
                format!(" (multi-hot, longest bags {:?})", train.max_bag_lens())
            } else {
                String::new()
            },
            100.0 * train.positive_rate()
        );
        if a.counts {
            println!(
                "distinct ids per field in the training examples (what --table-rows auto gives): {:?}",
                train.distinct_ids()
            );
        }
    }
    if let Some(p) = &a.json {
        let text = format!(
            "{}\n",
            serde_json::json!({"data": data, "cores": cores, "runs": rows})
        );
        std::fs::write(p, text).with_context(|| format!("--json {}", p.display()))?;
    }
    Ok(())
}

/// Writes `lines` random Criteo-layout lines to `path` (atomically: a temporary file
/// beside it, then a rename; the temporary file removed on an error or Ctrl-C), printing
/// progress every tenth. Each line's label is drawn with a probability that rises with a
/// score of the ids of its first 8 fields (at most 64 values each) and its first integer.
fn write_criteo(path: &std::path::Path, lines: u64, seed: u64) -> Result<()> {
    use crate::data::synthetic::splitmix64;
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(std::path::Path::new("."));
    let tmp = dir.join(format!(
        ".{}.tmp-{}",
        path.file_name().unwrap_or_default().to_string_lossy(),
        std::process::id()
    ));
    // Ctrl-C stops at the next line, so that the temporary file goes too
    let signals = crate::interrupt::install();
    let stop = signals.flag();
    stop.arm(true);
    let file = std::fs::File::create(&tmp)
        .with_context(|| format!("--write-criteo: cannot create {}", tmp.display()))?;
    let mut w = std::io::BufWriter::with_capacity(1 << 22, file);
    let mut line = String::with_capacity(512);
    let t0 = std::time::Instant::now();
    let mut state = seed ^ 0x5EED_C817_E000_0000;
    let mut next = || {
        state = splitmix64(state);
        state
    };
    let result = (|| -> Result<()> {
        for i in 0..lines {
            use std::fmt::Write as _;
            if i % 4096 == 0 && stop.requested() {
                bail!("interrupted after {i} of {lines} lines; nothing written");
            }
            line.clear();
            // the label's place, set once the features are drawn
            line.push('0');
            // the label's score: a weight in [-1, 1) of each id (a hash of the field and
            // the value), and the first integer's size
            let mut score = 0.0f64;
            let weight = |h: u64| (h >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0;
            for k in 0..13u64 {
                let r = next();
                line.push('\t');
                let x = (r >> 8) % (10 << k.min(10));
                match r % 16 {
                    0 | 1 => {}               // missing
                    2 => line.push_str("-1"), // Criteo's -1
                    3 => {
                        let _ = write!(line, "{x}.0");
                    }
                    _ => {
                        let _ = write!(line, "{x}");
                    }
                }
                if k == 0 && r % 16 > 2 {
                    score += 0.3 * (x as f64 / 10.0 - 0.5);
                }
            }
            for j in 0..26u64 {
                let r = next();
                line.push('\t');
                if r % 20 == 0 {
                    continue; // missing
                }
                // skewed: most ids from a small set of the field's values; the first 8
                // fields have at most 64 values each, and they carry the label's signal
                let v = if j < 8 {
                    ((r >> 8) % 64).pow(2) / 64
                } else {
                    (r >> 8) % (1 + ((r >> 40) % 64).pow(3) * (j + 1))
                };
                let id = splitmix64(v ^ (j << 56)) as u32;
                let _ = write!(line, "{id:08x}");
                if j < 8 {
                    score += 0.6 * weight(splitmix64(u64::from(id) ^ (j << 40) ^ 0xC11C));
                }
            }
            // about a quarter positives
            let p = 1.0 / (1.0 + (-(score - 1.5)).exp());
            if weight(next()) * 0.5 + 0.5 < p {
                line.replace_range(0..1, "1");
            }
            line.push('\n');
            w.write_all(line.as_bytes())?;
            if lines >= 10 && (i + 1) % (lines / 10) == 0 {
                eprintln!(
                    "  {} of {lines} lines ({:.1} s)",
                    i + 1,
                    t0.elapsed().as_secs_f64()
                );
            }
        }
        w.flush()?;
        w.get_ref().sync_all()?;
        Ok(())
    })();
    if let Err(e) = result {
        let _ = std::fs::remove_file(&tmp);
        return Err(e).with_context(|| format!("--write-criteo {}", path.display()));
    }
    if let Err(e) = std::fs::rename(&tmp, path) {
        let _ = std::fs::remove_file(&tmp);
        return Err(e).with_context(|| format!("--write-criteo: renaming into {}", path.display()));
    }
    eprintln!(
        "wrote {lines} Criteo-layout lines to {} in {:.1} s",
        path.display(),
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}
