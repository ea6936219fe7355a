//! The Criteo Kaggle/terabyte line: `label \t I1..I13 \t C1..C26`, where the label is
//! `0` or `1`, `I*` are integers and `C*` 32-bit ids in hex; any feature may be empty.

use super::table::{dense_transform, show, LineParser, Row};

/// Dense (integer) features of a Criteo line.
pub const CRITEO_DENSE: usize = 13;
/// Categorical (hex) features of a Criteo line.
pub const CRITEO_SPARSE: usize = 26;
const FIELDS: usize = 1 + CRITEO_DENSE + CRITEO_SPARSE;

#[derive(Clone)]
pub(crate) struct CriteoParser;

impl CriteoParser {
    pub fn new() -> Self {
        CriteoParser
    }
}

/// A Criteo integer feature: decimal digits with an optional sign (`-1`, `260`), or the
/// same value written as a float (`260.0`, `2.6e2`), as the samples exported through
/// pandas write them. Surrounding spaces are allowed. A fraction, NaN or an infinity is
/// not an integer.
fn parse_int(f: &[u8]) -> Result<i64, &'static str> {
    let s = std::str::from_utf8(f)
        .map_err(|_| "is not an integer")?
        .trim_matches(' ');
    match s.parse::<i64>() {
        Ok(x) => Ok(x),
        Err(e)
            if matches!(
                e.kind(),
                std::num::IntErrorKind::PosOverflow | std::num::IntErrorKind::NegOverflow
            ) =>
        {
            Err("does not fit in a 64-bit integer")
        }
        Err(_) => match s.parse::<f64>() {
            // `s.parse::<f64>` also takes "inf" and "NaN": neither is a count
            Ok(x) if !x.is_finite() => Err("is not a finite number"),
            Ok(x) if x.fract() != 0.0 => Err("is not an integer (it has a fraction)"),
            Ok(x) if x.abs() >= 9.2e18 => Err("does not fit in a 64-bit integer"),
            Ok(x) => Ok(x as i64),
            Err(_) => Err("is not an integer"),
        },
    }
}

/// A Criteo id: 1 to 8 hex digits.
fn parse_hex(f: &[u8]) -> Option<u32> {
    if f.is_empty() || f.len() > 8 || !f.iter().all(u8::is_ascii_hexdigit) {
        return None;
    }
    let s = std::str::from_utf8(f).ok()?;
    u32::from_str_radix(s, 16).ok()
}

impl LineParser for CriteoParser {
    fn num_dense(&self) -> usize {
        CRITEO_DENSE
    }
    fn num_sparse(&self) -> usize {
        CRITEO_SPARSE
    }

    fn parse(&mut self, line: &[u8], row: &mut Row) -> Result<(), String> {
        let n = line.iter().filter(|&&b| b == b'\t').count() + 1;
        if n != FIELDS {
            // Kaggle's test.txt: the same layout without the label
            let unlabeled = if n == FIELDS - 1 {
                " (no label column: Erase trains and evaluates on labeled examples only)"
            } else {
                ""
            };
            return Err(format!(
                "expected {FIELDS} tab-separated fields (label, I1..I13, C1..C26), found {n}{unlabeled}"
            ));
        }
        for (k, f) in line.split(|&b| b == b'\t').enumerate() {
            match k {
                0 => {
                    row.label = match f {
                        b"0" => 0.0,
                        b"1" => 1.0,
                        _ => return Err(format!("label {}: expected 0 or 1", show(f))),
                    }
                }
                1..=CRITEO_DENSE => {
                    row.dense[k - 1] = if f.is_empty() {
                        0.0
                    } else {
                        let x = parse_int(f).map_err(|why| format!("I{k} {} {why}", show(f)))?;
                        dense_transform(x as f64)
                    }
                }
                _ => {
                    let j = k - 1 - CRITEO_DENSE;
                    row.missing[j] = f.is_empty();
                    row.ids[j] = if f.is_empty() {
                        0
                    } else {
                        parse_hex(f).ok_or_else(|| {
                            format!("C{} {} is not a 32-bit hex id", j + 1, show(f))
                        })?
                    };
                }
            }
        }
        Ok(())
    }
}
