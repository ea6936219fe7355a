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
    init_param_as(init, shape, seed, param_index, |x| x)
}

/// [`init_param`]'s values, each converted by `conv` as it is drawn (no f64 copy of the
/// whole parameter: a large table is made in its own type), on every core for a large
/// one. The same values whatever the thread count: each element's draw depends on its
/// index alone.
pub fn init_param_as<T: Copy + Send + Default>(
    init: &Init,
    shape: &Shape,
    seed: u64,
    param_index: u64,
    conv: impl Fn(f64) -> T + Sync,
) -> Vec<T> {
    let n = shape.numel();
    let base = param_base(seed, param_index);
    match init {
        Init::Zeros => return vec![conv(0.0); n],
        Init::Ones => return vec![conv(1.0); n],
        Init::Values(v) => return v.iter().map(|&x| conv(x)).collect(),
        _ => {}
    }
    // field starts (in elements) and bounds of a stacked table
    let (starts, bounds): (Vec<usize>, Vec<f64>) = match init {
        Init::Tables { field_rows } => {
            let d = shape.last();
            let mut at = 0;
            field_rows
                .iter()
                .map(|&rows| {
                    let s = at;
                    at += rows * d;
                    (s, table_bound(rows))
                })
                .unzip()
        }
        _ => (Vec::new(), Vec::new()),
    };
    let value = |e: usize| -> f64 {
        let u = |slot: u64| uniform_at(base, e, slot);
        match init {
            Init::Uniform { bound } => (2.0 * u(0) - 1.0) * bound,
            Init::Normal { std } => {
                let (u1, u2) = (u(0), u(1));
                std * (-2.0 * (1.0 - u1).ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
            }
            Init::Tables { .. } => {
                let f = starts.partition_point(|&s| s <= e).saturating_sub(1);
                (2.0 * u(0) - 1.0) * bounds.get(f).copied().unwrap_or(0.0)
            }
            Init::Zeros | Init::Ones | Init::Values(_) => 0.0,
        }
    };
    let mut out = vec![T::default(); n];
    let threads = if n < 1 << 20 {
        1
    } else {
        std::thread::available_parallelism().map_or(1, |t| t.get())
    };
    let chunk = n.div_ceil(threads).max(1);
    std::thread::scope(|sc| {
        for (k, part) in out.chunks_mut(chunk).enumerate() {
            let (value, conv) = (&value, &conv);
            sc.spawn(move || {
                for (i, o) in part.iter_mut().enumerate() {
                    *o = conv(value(k * chunk + i));
                }
            });
        }
    });
    out
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

    #[test]
    fn a_parameter_made_in_f32_has_the_f64_values_rounded_on_any_thread_count() {
        // 3 fields of 70000 rows (over 2^20 elements, so drawn on every core)
        let fields = vec![70_000usize, 3, 70_000];
        let d = 8;
        let rows: usize = fields.iter().sum();
        let cases = [
            (Init::Tables { field_rows: fields }, Shape::new(&[rows, d])),
            (Init::Uniform { bound: 0.3 }, Shape::new(&[1200, 1000])),
            (Init::Normal { std: 0.02 }, Shape::new(&[64, 33])),
            (Init::Values(vec![0.1, -2.5, 3.0]), Shape::new(&[3])),
            (Init::Ones, Shape::new(&[5])),
            (Init::Zeros, Shape::new(&[4, 2])),
        ];
        for (init, shape) in &cases {
            let wide = init_param(init, shape, 7, 3);
            assert_eq!(wide.len(), shape.numel(), "{init:?}");
            let narrow = init_param_as(init, shape, 7, 3, |x| x as f32);
            let want: Vec<f32> = wide.iter().map(|&x| x as f32).collect();
            assert!(narrow == want, "{init:?}: f32 values differ");
        }
        // element by element, as the generator is defined
        let base = param_base(7, 3);
        let u = |e: usize, k: u64| uniform_at(base, e, k);
        let uni = init_param(&cases[1].0, &cases[1].1, 7, 3);
        assert!(uni
            .iter()
            .enumerate()
            .all(|(e, &x)| x == (2.0 * u(e, 0) - 1.0) * 0.3));
        let nor = init_param(&cases[2].0, &cases[2].1, 7, 3);
        let box_muller = |e: usize| {
            0.02 * (-2.0 * (1.0 - u(e, 0)).ln()).sqrt()
                * (2.0 * std::f64::consts::PI * u(e, 1)).cos()
        };
        assert!(nor.iter().enumerate().all(|(e, &x)| x == box_muller(e)));
        // the stacked table's fields keep their own bounds (1/sqrt(rows))
        let t = init_param(&cases[0].0, &cases[0].1, 7, 3);
        let small_field = &t[70_000 * d..70_003 * d];
        assert!(small_field.iter().any(|x| x.abs() > 0.05));
        assert!(t[..70_000 * d]
            .iter()
            .all(|x| x.abs() <= 1.0 / 70_000f64.sqrt()));
    }
}
