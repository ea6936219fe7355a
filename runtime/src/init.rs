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
    let base = splitmix64(splitmix64(seed).wrapping_add(param_index));
    let uniform =
        |e: usize, slot: u64| to_unit(splitmix64(base.wrapping_add((e as u64) * 2 + slot)));
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
                let bound = 1.0 / (rows as f64).sqrt();
                for _ in 0..rows * d {
                    let e = v.len();
                    v.push((2.0 * uniform(e, 0) - 1.0) * bound);
                }
            }
            v
        }
    }
}
