//! Expands `--config FILE` into the flags of the subcommand it follows.
//!
//! One config file serves every subcommand. Its tables:
//! - `[model]`, and `[data]`'s description of the data (`data`, `cache_dir`, `strict`,
//!   `data_seed`): settings shared by the subcommands; each subcommand takes the keys
//!   that are flags of it and leaves the others (`eval` has no `--steps`); `[data]`'s
//!   other keys are the `data` subcommand's own;
//! - `[train]`, `[eval]`, `[bench]`, `[plan]`: settings of that subcommand alone;
//! - `[data.schema]`: the columns of `--data tsv:PATH`, read by the data loader.
//!
//! Every key must be a flag of some subcommand (of its own, for the subcommands'
//! tables) and every value must parse as that flag's value: a typo or a wrong type is an
//! error naming the file, the table and the key, whichever subcommand runs.

use std::ffi::OsString;

use anyhow::{bail, Context, Result};
use clap::{Arg, Command};

use super::Cli;

/// Tables whose keys every subcommand may take.
const SHARED: [&str; 2] = ["model", "data"];

/// The keys of `[data]` that describe the data, for every subcommand that reads data; its
/// other keys are the `data` subcommand's own (its `threads`, `seed` and `json` mean other
/// things than train's and bench's flags of those names).
const DATA_SOURCE_KEYS: [&str; 4] = ["data", "cache-dir", "strict", "data-seed"];

fn flag_of<'a>(cmd: &'a Command, flag: &str) -> Option<&'a Arg> {
    cmd.get_arguments().find(|a| a.get_long() == Some(flag))
}

/// The text of a clap error without its "error: " prefix and usage lines.
fn clap_reason(e: &clap::Error) -> String {
    let text = e.to_string();
    let first = text.lines().next().unwrap_or_default();
    first.strip_prefix("error: ").unwrap_or(first).to_string()
}

/// The `--flag=value` arguments of one config value, checked against the flag's parser.
fn flag_args(arg: &Arg, flag: &str, value: &toml::Value, at: &str) -> Result<Vec<OsString>> {
    let takes_value = arg.get_action().takes_values();
    let text = match value {
        toml::Value::Boolean(b) if !takes_value => {
            return Ok(if *b {
                vec![format!("--{flag}").into()]
            } else {
                vec![]
            })
        }
        _ if !takes_value => {
            bail!("{at} = {value}: `--{flag}` is a switch; write true or false")
        }
        toml::Value::String(v) => v.clone(),
        toml::Value::Integer(v) => v.to_string(),
        toml::Value::Float(v) => v.to_string(),
        toml::Value::Boolean(v) => if *v { "on" } else { "off" }.to_string(),
        toml::Value::Array(items) => items
            .iter()
            .map(|i| i.as_str().map_or_else(|| i.to_string(), str::to_string))
            .collect::<Vec<_>>()
            .join(","),
        // `[model.table_rows]`: NAME = ROWS pairs
        toml::Value::Table(t) => t
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(","),
        other => bail!("{at} = {other} is not a flag value"),
    };
    // the value must parse as the flag's: parse it with that flag alone
    let alone = Command::new("erase-ctr").no_binary_name(true).arg(
        arg.clone()
            .required(false)
            .required_unless_present(clap::builder::Resettable::<clap::Id>::Reset),
    );
    alone
        .try_get_matches_from([format!("--{flag}={text}")])
        .map_err(|e| anyhow::anyhow!("{at} = {value}: {}", clap_reason(&e)))?;
    // `--flag=value`: a value starting with '-' is not taken for a flag
    Ok(vec![format!("--{flag}={text}").into()])
}

/// The command line with a config file's settings in it, and where each came from.
pub(super) struct Expanded {
    pub args: Vec<OsString>,
    /// `(flag, "FILE: [table] key")` for each setting the config gave and the command
    /// line did not.
    pub from_config: Vec<(String, String)>,
    /// Notes for the user: the data the config names that this subcommand does not read
    /// (`bench` times synthetic data, `plan` reads none).
    pub notes: Vec<String>,
}

impl Expanded {
    /// `message` with a line naming the config key of each flag it names that came from
    /// the config file, so an error about `--batch` points at `[model] batch`.
    pub fn annotate(&self, message: String) -> String {
        let mut out = message;
        let mut notes = Vec::new();
        for (flag, at) in &self.from_config {
            let named = out.match_indices(&format!("--{flag}")).any(|(i, m)| {
                !out[i + m.len()..]
                    .chars()
                    .next()
                    .is_some_and(|c| c.is_ascii_alphanumeric() || c == '-')
            });
            if named {
                notes.push(format!("  (--{flag} is {at})"));
            }
        }
        for n in notes {
            out.push('\n');
            out.push_str(&n);
        }
        out
    }
}

/// `args` (the program name first) with the settings of the `--config FILE` they name
/// inserted after the subcommand, so that flags given on the command line win.
pub(super) fn expand_config(args: Vec<OsString>) -> Result<Expanded> {
    let strs: Vec<String> = args
        .iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    let pos = strs
        .iter()
        .position(|a| a == "--config" || a.starts_with("--config="));
    let Some(pos) = pos else {
        return Ok(Expanded {
            args,
            from_config: Vec::new(),
            notes: Vec::new(),
        });
    };
    // a bare `--config` takes the next argument as its file
    let (mut given, mut i) = (0, pos);
    while i < strs.len() {
        if strs[i] == "--config" {
            given += 1;
            i += 1;
        } else if strs[i].starts_with("--config=") {
            given += 1;
        }
        i += 1;
    }
    if given > 1 {
        bail!("--config is given {given} times; a command reads one config file (merge them)");
    }
    let path = match strs[pos].strip_prefix("--config=") {
        Some(p) => p.to_string(),
        None => strs
            .get(pos + 1)
            .cloned()
            .ok_or_else(|| anyhow::anyhow!("--config needs a FILE"))?,
    };
    let text = std::fs::read_to_string(&path).with_context(|| format!("--config {path}"))?;
    let table: toml::Table = text
        .parse()
        .with_context(|| format!("{path} is not valid TOML"))?;
    let sub = strs.get(1).cloned().unwrap_or_default();
    let cli = <Cli as clap::CommandFactory>::command();
    let this = cli
        .find_subcommand(&sub)
        .ok_or_else(|| anyhow::anyhow!("--config must follow a subcommand"))?;
    // the subcommands' own tables (`data` is a subcommand too, but its table is shared)
    let names: Vec<String> = cli
        .get_subcommands()
        .map(|c| c.get_name().to_string())
        .filter(|n| !SHARED.contains(&n.as_str()))
        .collect();
    let mut extra: Vec<OsString> = Vec::new();
    let mut from_config: Vec<(String, String)> = Vec::new();
    let mut notes: Vec<String> = Vec::new();
    // a flag the command line gives wins over the config's
    let on_command_line = |flag: &str| {
        let long = format!("--{flag}");
        strs.iter()
            .any(|a| *a == long || a.starts_with(&format!("{long}=")))
    };
    for (section, body) in &table {
        let Some(body) = body.as_table() else {
            bail!("{path}: `{section}` must be a table such as [train]");
        };
        let shared = SHARED.contains(&section.as_str());
        // a shared table is shared even where a subcommand has its name (`data`)
        let owner = match cli.find_subcommand(section) {
            _ if shared => None,
            Some(c) => Some(c),
            None => bail!(
                "{path}: [{section}] is not a table of erase-ctr's config (tables: [model], [data], {})",
                names
                    .iter()
                    .map(|n| format!("[{n}]"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        };
        for (key, value) in body {
            if section == "data" && key == "schema" {
                continue; // read by the data loader
            }
            let at = format!("{path}: [{section}] {key}");
            let flag = key.replace('_', "-");
            // `[data]`'s keys other than the data's description are the `data`
            // subcommand's own
            let owner = match (section.as_str(), owner) {
                ("data", None) if !DATA_SOURCE_KEYS.contains(&flag.as_str()) => {
                    cli.find_subcommand("data")
                }
                (_, o) => o,
            };
            // `data --write-criteo` writes data and reads none: the config's source is
            // not for it
            if sub == "data" && flag == "data" && on_command_line("write-criteo") {
                continue;
            }
            match owner {
                // a subcommand's own table: checked against it, used only by it
                Some(cmd) => {
                    let Some(arg) = flag_of(cmd, &flag) else {
                        bail!("{at} is not a setting of `erase-ctr {section}` (see erase-ctr {section} --help)");
                    };
                    let args = flag_args(arg, &flag, value, &at)?;
                    if cmd.get_name() == this.get_name() {
                        extra.extend(args);
                        if !on_command_line(&flag) {
                            from_config.push((flag.clone(), at.clone()));
                        }
                    }
                }
                // a shared table: a flag of this subcommand is used, one of another
                // subcommand is left to it, anything else is a mistake
                None => match flag_of(this, &flag) {
                    Some(arg) => {
                        extra.extend(flag_args(arg, &flag, value, &at)?);
                        if !on_command_line(&flag) {
                            from_config.push((flag.clone(), at.clone()));
                        }
                    }
                    None => {
                        let other = cli
                            .get_subcommands()
                            .find_map(|c| flag_of(c, &flag).map(|a| (c, a)));
                        match other {
                            Some((_, a)) => {
                                flag_args(a, &flag, value, &at)?;
                                // the data a user may think this command reads
                                if section == "data" && flag == "data" {
                                    notes.push(format!(
                                        "{at} is not read by `erase-ctr {sub}`, {}",
                                        if sub == "bench" {
                                            "which times the spec's synthetic data"
                                        } else {
                                            "which reads no data"
                                        }
                                    ));
                                }
                            }
                            None => bail!(
                                "{at} is not a setting of any erase-ctr subcommand (see erase-ctr {sub} --help)"
                            ),
                        }
                    }
                },
            }
        }
    }
    let mut out: Vec<OsString> = args[..2.min(args.len())].to_vec();
    out.extend(extra);
    out.extend(args.into_iter().skip(2));
    Ok(Expanded {
        args: out,
        from_config,
        notes,
    })
}
