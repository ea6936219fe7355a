//! Deterministic parameter initialisation: element `e` of the `p`-th parameter draws
//! from a counter-based generator, so the values depend on the seed and the parameter's
//! position only, never on thread count or allocation order.

use erase_graph::{Init, Shape};

/// The splitmix64 mixing function (wrapping 64-bit arithmetic).
pub fn splitmix64(z: u64) -> u64 {
    let z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    let z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A uniform in [0, 1) with 53 random bits.
pub fn to_unit(u: u64) -> f64 {
    (u >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// The initial values of a parameter, row-major.
pub fn init_param(init: &Init, shape: &Shape, seed: u64, param_index: u64) -> Vec<f64> {
    let n = shape.numel();
    let base = param_base(seed, param_index);
    let uniform = |e: usize, slot: u64| uniform_at(base, e, slot);
    match init {
        Init::Zeros => vec![0.0; n],
        Init::Ones => vec![1.0; n],
        Init::Values(v) => v.clone(),
        Init::Uniform { bound } => (0..n)
            .map(|e| (2.0 * uniform(e, 0) - 1.0) * bound)
            .collect(),
        Init::Normal { std } => (0..n)
            .map(|e| {
                let (u1, u2) = (uniform(e, 0), uniform(e, 1));
                std * (-2.0 * (1.0 - u1).ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
            })
            .collect(),
        Init::Tables { field_rows } => {
            let d = shape.last();
            let mut v = Vec::with_capacity(n);
            for &rows in field_rows {
                let bound = table_bound(rows);
                for _ in 0..rows * d {
                    let e = v.len();
                    v.push((2.0 * uniform(e, 0) - 1.0) * bound);
                }
            }
            v
        }
    }
}

/// The initial values of some rows of an `Init::Tables` parameter of `field_rows` (its
/// fields stacked) and width `d`: the values [`init_param`] gives rows `rows` (indices
/// into the stacked table), row after row in the order asked. A rank that stores only
/// the rows it owns initialises them to the whole table's values without building it.
pub fn init_table_rows(
    field_rows: &[usize],
    d: usize,
    seed: u64,
    param_index: u64,
    rows: &[usize],
) -> Vec<f64> {
    let base = param_base(seed, param_index);
    let starts: Vec<usize> = field_rows
        .iter()
        .scan(0, |at, &r| {
            let s = *at;
            *at += r;
            Some(s)
        })
        .collect();
    let mut v = Vec::with_capacity(rows.len() * d);
    for &r in rows {
        let f = starts.partition_point(|&s| s <= r).saturating_sub(1);
        let bound = field_rows.get(f).map_or(0.0, |&n| table_bound(n));
        v.extend((0..d).map(|j| (2.0 * uniform_at(base, r * d + j, 0) - 1.0) * bound));
    }
    v
}

/// The generator's state for the `param_index`-th parameter.
fn param_base(seed: u64, param_index: u64) -> u64 {
    splitmix64(splitmix64(seed).wrapping_add(param_index))
}

/// Uniform draw `slot` of element `e` of a parameter.
fn uniform_at(base: u64, e: usize, slot: u64) -> f64 {
    to_unit(splitmix64(base.wrapping_add((e as u64) * 2 + slot)))
}

/// The bound of a field's uniform initialisation: `1/sqrt(rows)`.
fn table_bound(rows: usize) -> f64 {
    1.0 / (rows as f64).sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_rows_get_the_values_of_the_whole_table() {
        let (fields, d) = (vec![5usize, 1, 9], 3);
        let whole = init_param(
            &Init::Tables {
                field_rows: fields.clone(),
            },
            &Shape::new(&[15, d]),
            11,
            4,
        );
        let rows = [14usize, 0, 5, 6, 5, 9];
        let some = init_table_rows(&fields, d, 11, 4, &rows);
        for (i, &r) in rows.iter().enumerate() {
            assert_eq!(
                some[i * d..(i + 1) * d],
                whole[r * d..(r + 1) * d],
                "row {r}"
            );
        }
        // another parameter index or seed draws other values
        assert_ne!(init_table_rows(&fields, d, 11, 5, &rows), some);
        assert_ne!(init_table_rows(&fields, d, 12, 4, &rows), some);
    }
}
