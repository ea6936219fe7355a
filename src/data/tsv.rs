//! A user-described separated-values log (see [`TsvSchema`]).

use anyhow::{bail, Context, Result};

use super::table::{dense_transform, hash_category, show, LineParser, Row, TsvSchema};

#[derive(Clone)]
pub(crate) struct TsvParser {
    schema: TsvSchema,
    sep: u8,
    /// Column indices, resolved from the schema (and the header).
    label: usize,
    dense: Vec<usize>,
    categorical: Vec<usize>,
    time: Option<usize>,
    /// Fields per line: the header's count, or the first data line's without a header.
    fields: Option<usize>,
    /// The first file's header, which every later file's header must equal.
    header: Option<Vec<u8>>,
    /// Field boundaries of the current line, reused.
    bounds: Vec<(usize, usize)>,
}

impl TsvParser {
    /// Without a header the schema's columns must be indices, resolved here.
    pub fn new(schema: TsvSchema) -> Result<Self> {
        let mut p = TsvParser {
            sep: schema.separator as u8,
            label: 0,
            dense: Vec::new(),
            categorical: Vec::new(),
            time: None,
            fields: None,
            header: None,
            bounds: Vec::new(),
            schema,
        };
        if !p.schema.header {
            p.resolve(&[])
                .context("[data.schema] with header = false")?;
        }
        Ok(p)
    }

    /// Resolves the schema's columns against `names` (empty: no header, so indices).
    fn resolve(&mut self, names: &[String]) -> Result<()> {
        let find = |col: &str| -> Result<usize> {
            let named =
                |n: &String| n == col || n.rsplit_once(':').is_some_and(|(base, _)| base == col);
            let hits: Vec<usize> = (0..names.len()).filter(|&i| named(&names[i])).collect();
            if hits.len() > 1 {
                bail!(
                    "the header names column '{col}' {} times (columns {}); name it by its 0-based index instead",
                    hits.len(),
                    hits.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(", ")
                );
            }
            if let Some(&i) = hits.first() {
                return Ok(i);
            }
            match col.parse::<usize>() {
                Ok(i) if names.is_empty() || i < names.len() => Ok(i),
                Ok(i) => bail!("column {i} is past the header's {} columns", names.len()),
                Err(_) if names.is_empty() => {
                    bail!("column '{col}': without a header, columns are 0-based indices")
                }
                Err(_) => bail!(
                    "column '{col}' is not in the header (columns: {})",
                    names.join(", ")
                ),
            }
        };
        self.label = find(&self.schema.label)?;
        self.dense = self
            .schema
            .dense
            .iter()
            .map(|c| find(c))
            .collect::<Result<_>>()?;
        self.categorical = self
            .schema
            .categorical
            .iter()
            .map(|c| find(c))
            .collect::<Result<_>>()?;
        self.time = self.schema.time.as_deref().map(find).transpose()?;
        // one column under two names (a name and its index, or two spellings)
        let mut used: Vec<(usize, &str)> = vec![(self.label, self.schema.label.as_str())];
        for (&i, c) in self
            .dense
            .iter()
            .zip(&self.schema.dense)
            .chain(self.categorical.iter().zip(&self.schema.categorical))
        {
            if let Some((_, first)) = used.iter().find(|(j, _)| *j == i) {
                bail!("'{first}' and '{c}' are the same column ({i}): each column is one feature");
            }
            used.push((i, c));
        }
        Ok(())
    }

    fn max_index(&self) -> usize {
        let mut m = self.label;
        for &i in self.dense.iter().chain(&self.categorical).chain(&self.time) {
            m = m.max(i);
        }
        m
    }
}

fn parse_number(f: &[u8]) -> Result<f64, &'static str> {
    let s = std::str::from_utf8(f)
        .map_err(|_| "is not a number")?
        .trim();
    match s.parse::<f64>() {
        Ok(x) if x.is_finite() => Ok(x),
        Ok(_) => Err("is not a finite number"),
        Err(_) => Err("is not a number"),
    }
}

impl LineParser for TsvParser {
    fn num_dense(&self) -> usize {
        self.schema.dense.len()
    }
    fn num_sparse(&self) -> usize {
        self.schema.categorical.len()
    }
    fn has_header(&self) -> bool {
        self.schema.header
    }
    fn has_time(&self) -> bool {
        self.schema.time.is_some()
    }
    fn is_multi(&self) -> bool {
        self.schema.list_separator.is_some()
    }

    fn header(&mut self, line: &[u8]) -> Result<()> {
        if line.is_empty() {
            bail!("empty header line (the schema says header = true)");
        }
        if let Some(first) = &self.header {
            if first.as_slice() != line {
                bail!(
                    "{} differs from the first file's header {}",
                    show(line),
                    show(first)
                );
            }
            return Ok(());
        }
        let names: Vec<String> = line
            .split(|&b| b == self.sep)
            .map(|f| String::from_utf8_lossy(f).trim().to_string())
            .collect();
        self.resolve(&names)?;
        self.fields = Some(names.len());
        self.header = Some(line.to_vec());
        Ok(())
    }

    fn parse(&mut self, line: &[u8], row: &mut Row) -> Result<(), String> {
        self.bounds.clear();
        let mut start = 0;
        for (k, &b) in line.iter().enumerate() {
            if b == self.sep {
                self.bounds.push((start, k));
                start = k + 1;
            }
        }
        self.bounds.push((start, line.len()));
        let n = self.bounds.len();
        let expected = match self.fields {
            Some(e) => e,
            None => {
                if n <= self.max_index() {
                    return Err(format!(
                        "{n} fields, but the schema uses column {}",
                        self.max_index()
                    ));
                }
                self.fields = Some(n);
                n
            }
        };
        if n != expected {
            return Err(format!("expected {expected} fields, found {n}"));
        }
        let field = |i: usize| {
            let (a, b) = self.bounds[i];
            &line[a..b]
        };
        let s = &self.schema;
        let f = field(self.label);
        if f.is_empty() {
            return Err(format!("label '{}' is empty", s.label));
        }
        let v = parse_number(f).map_err(|why| format!("label '{}' {} {why}", s.label, show(f)))?;
        row.label = match s.label_threshold {
            Some(t) => f32::from(u8::from(v >= t)),
            None if v == 0.0 || v == 1.0 => v as f32,
            None => {
                return Err(format!(
                    "label '{}' {}: expected 0 or 1 (or set label_threshold)",
                    s.label,
                    show(f)
                ))
            }
        };
        for (k, &i) in self.dense.iter().enumerate() {
            let f = field(i);
            row.dense[k] = if f.is_empty() {
                0.0
            } else {
                let x =
                    parse_number(f).map_err(|why| format!("'{}' {} {why}", s.dense[k], show(f)))?;
                dense_transform(x)
            };
        }
        if let Some(sep) = s.list_separator {
            // multi-hot: each non-empty value of the list one id; no value: missing
            row.multi.clear();
            row.lens.clear();
            for (k, &i) in self.categorical.iter().enumerate() {
                let before = row.multi.len();
                for v in field(i).split(|&b| b == sep as u8) {
                    let v = v.trim_ascii();
                    if !v.is_empty() {
                        row.multi.push(hash_category(v));
                    }
                }
                let n = row.multi.len() - before;
                if n > s.max_list {
                    return Err(format!(
                        "'{}' holds {n} ids, more than max_list = {} ([data.schema] max_list)",
                        s.categorical[k], s.max_list
                    ));
                }
                row.lens.push(n as u32);
                row.missing[k] = n == 0;
            }
        } else {
            for (k, &i) in self.categorical.iter().enumerate() {
                let f = field(i);
                row.missing[k] = f.is_empty();
                row.ids[k] = if f.is_empty() { 0 } else { hash_category(f) };
            }
        }
        if let Some(i) = self.time {
            let name = s.time.as_deref().unwrap_or_default();
            let f = field(i);
            if f.is_empty() {
                return Err(format!("time '{name}' is empty"));
            }
            row.time = parse_number(f).map_err(|why| format!("time '{name}' {} {why}", show(f)))?;
        }
        Ok(())
    }
}
