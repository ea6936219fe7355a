//! Where each embedding table lives when several ranks train: replicated on every rank
//! (today's training, for small tables), table-wise (the whole table on one rank) or
//! row-wise (its rows split evenly over the ranks, for a table too large for one). The
//! planner is a pure function of the tables' sizes, the rank count and each rank's
//! memory budget, so every rank computes the same placement; `erase-ctr plan --gpus N
//! --sharding MODE` prints it, and CPU and CUDA ranks train with it (`crate::sharded`,
//! `erase_runtime::cuda::sharded`).

use anyhow::{bail, Result};

/// What `--sharding` asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sharding {
    /// Every table on every rank.
    Replicated,
    /// Every table whole on one rank, balanced by bytes.
    Table,
    /// Every table's rows split over all ranks.
    Row,
    /// Per table: see [`plan`].
    Auto,
}

impl Sharding {
    /// The `--sharding` value.
    pub fn as_str(self) -> &'static str {
        match self {
            Sharding::Replicated => "replicated",
            Sharding::Table => "table",
            Sharding::Row => "row",
            Sharding::Auto => "auto",
        }
    }
}

/// Where one table lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    Replicated,
    /// Whole, on this rank.
    Table(usize),
    /// Rows `k·⌈rows/n⌉ ..` on rank `k`.
    Row,
}

/// One embedding table: its name (the field), rows and width.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Table {
    pub name: String,
    pub rows: usize,
    pub dim: usize,
}

impl Table {
    /// Bytes of its f32 rows and its row-wise Adagrad state (one f32 a row).
    pub fn bytes(&self) -> u64 {
        self.rows as u64 * (self.dim as u64 + 1) * 4
    }
}

/// A placement of every table, and what it costs each rank.
#[derive(Clone, Debug, PartialEq)]
pub struct ShardPlan {
    pub placements: Vec<Placement>,
    /// Table bytes each rank holds.
    pub rank_bytes: Vec<u64>,
}

impl ShardPlan {
    /// Bytes one rank sends (and receives) in the forward all-to-all of a step of
    /// `local_batch` examples a rank, one pooled row of each sharded field an example:
    /// the rows its examples need from other ranks (for `n` ranks, `(n-1)/n` of them).
    pub fn all_to_all_bytes(&self, tables: &[Table], local_batch: usize) -> f64 {
        let n = self.rank_bytes.len().max(1) as f64;
        let rows: f64 = tables
            .iter()
            .zip(&self.placements)
            .filter(|(_, p)| !matches!(p, Placement::Replicated))
            .map(|(t, _)| (local_batch * t.dim * 4) as f64)
            .fold(0.0, |a, b| a + b);
        rows * (n - 1.0) / n
    }
}

/// A rank's budget for tables unless `--rank-memory` says otherwise: 120 GB (an H200's
/// 141 GB less room for the step).
pub const DEFAULT_RANK_MEMORY: u64 = 120_000_000_000;

/// Tables at most this large stay replicated under `auto`: exchanging their pooled rows
/// costs a latency that holding them everywhere does not.
pub const AUTO_REPLICATE_BYTES: u64 = 1 << 20;

/// The placement `mode` asks for on `ranks` ranks of `budget` bytes each for tables.
///
/// `auto`: on one or two ranks, tables stay replicated while they fit (with two, the
/// gradients' gather of a replicated table moves what the sharded exchange would), the
/// largest sharded first until a rank's replicated tables and its share of the others
/// fit; on more ranks every table above
/// [`AUTO_REPLICATE_BYTES`] is sharded, since the replicated tables' gather grows with
/// the rank count and the exchange does not. A sharded table goes whole to the rank
/// that holds the fewest bytes (largest first) where it fits, else row-wise.
pub fn plan(tables: &[Table], ranks: usize, budget: u64, mode: Sharding) -> Result<ShardPlan> {
    if ranks == 0 {
        bail!("sharding: no ranks");
    }
    let total: u64 = tables.iter().map(Table::bytes).sum();
    let gb = |b: u64| size(b);
    let mut placements = vec![Placement::Replicated; tables.len()];
    let shard: Vec<bool> = match mode {
        Sharding::Replicated => {
            if total > budget {
                bail!(
                    "--sharding replicated: the {} tables need {} on every rank, {} more than a rank's budget of {}; use --sharding row or auto",
                    tables.len(),
                    gb(total),
                    gb(total - budget),
                    gb(budget)
                );
            }
            vec![false; tables.len()]
        }
        Sharding::Table | Sharding::Row => vec![true; tables.len()],
        Sharding::Auto => {
            // on more than two ranks every large table is sharded; then, on any rank
            // count, the largest of the others until a rank's replicated tables and its
            // share of the sharded ones fit
            let mut out: Vec<bool> = tables
                .iter()
                .map(|t| ranks > 2 && t.bytes() > AUTO_REPLICATE_BYTES)
                .collect();
            let mut order: Vec<usize> = (0..tables.len()).filter(|&i| !out[i]).collect();
            order.sort_by_key(|&i| (std::cmp::Reverse(tables[i].bytes()), i));
            let mut kept: u64 = (0..tables.len())
                .filter(|&i| !out[i])
                .map(|i| tables[i].bytes())
                .sum();
            let fits = |kept: u64| kept + (total - kept).div_ceil(ranks as u64) <= budget;
            for i in order {
                if fits(kept) {
                    break;
                }
                out[i] = true;
                kept -= tables[i].bytes();
            }
            out
        }
    };
    let replicated: u64 = tables
        .iter()
        .zip(&shard)
        .filter(|(_, s)| !**s)
        .map(|(t, _)| t.bytes())
        .sum();
    let mut rank_bytes = vec![replicated; ranks];
    // row-wise first (they load every rank alike), then whole tables largest first
    let mut whole = Vec::new();
    for (i, t) in tables.iter().enumerate() {
        if !shard[i] {
            continue;
        }
        let row_wise =
            mode == Sharding::Row || (mode != Sharding::Table && replicated + t.bytes() > budget);
        if row_wise {
            placements[i] = Placement::Row;
            split_rows(&mut rank_bytes, t);
        } else {
            whole.push(i);
        }
    }
    whole.sort_by_key(|&i| (std::cmp::Reverse(tables[i].bytes()), i));
    for i in whole {
        let t = &tables[i];
        let (k, _) = rank_bytes
            .iter()
            .enumerate()
            .min_by_key(|(k, b)| (**b, *k))
            .expect("at least one rank");
        if rank_bytes[k] + t.bytes() > budget {
            if mode == Sharding::Table {
                bail!(
                    "--sharding table: table '{}' ({}) does not fit rank {k}, which holds {} of a {} budget; use --sharding row or auto",
                    t.name,
                    gb(t.bytes()),
                    gb(rank_bytes[k]),
                    gb(budget)
                );
            }
            placements[i] = Placement::Row;
            split_rows(&mut rank_bytes, t);
            continue;
        }
        placements[i] = Placement::Table(k);
        rank_bytes[k] += t.bytes();
    }
    if let Some((k, b)) = rank_bytes.iter().enumerate().find(|(_, b)| **b > budget) {
        bail!(
            "--sharding {}: rank {k} would hold {} of tables, over its budget of {} (--rank-memory), even with its tables split row-wise over {ranks} ranks",
            mode.as_str(),
            gb(*b),
            gb(budget)
        );
    }
    Ok(ShardPlan {
        placements,
        rank_bytes,
    })
}

/// Bytes for people: GB, or MB below 0.1 GB.
pub(crate) fn size(b: u64) -> String {
    if b >= 100_000_000 {
        format!("{:.2} GB", b as f64 / 1e9)
    } else {
        format!("{:.2} MB", b as f64 / 1e6)
    }
}

/// Adds each rank's share of `t`'s rows (⌈rows/n⌉ of them) to `rank_bytes`.
fn split_rows(rank_bytes: &mut [u64], t: &Table) {
    let per = Table {
        rows: t.rows.div_ceil(rank_bytes.len().max(1)),
        ..t.clone()
    }
    .bytes();
    for b in rank_bytes {
        *b += per;
    }
}

/// How rank `rank` of `world` sees the tables of `field_rows` rows (width `dim`, `hot`
/// ids a bag, `examples` examples a rank) placed by `mode` within `budget` bytes a rank,
/// laid out for CUDA ranks' sharded lookup (`erase_runtime::cuda::sharded`): `None` when
/// every table stays replicated.
pub fn cuda_geometry(
    field_rows: &[usize],
    (dim, hot, examples): (usize, usize, usize),
    (rank, world): (usize, usize),
    budget: u64,
    mode: Sharding,
) -> Result<Option<erase_runtime::cuda::sharded::ShardGeometry>> {
    Ok(
        cuda_geometries(field_rows, (dim, hot, examples), world, budget, mode)?
            .and_then(|mut all| (rank < all.len()).then(|| all.swap_remove(rank))),
    )
}

/// [`cuda_geometry`] of every rank, in rank order.
pub fn cuda_geometries(
    field_rows: &[usize],
    (dim, hot, examples): (usize, usize, usize),
    world: usize,
    budget: u64,
    mode: Sharding,
) -> Result<Option<Vec<erase_runtime::cuda::sharded::ShardGeometry>>> {
    let slots = vec![hot; field_rows.len()];
    let Some(all) = crate::sharded::Storage::all_ranks(
        field_rows,
        &slots,
        (dim, examples),
        world,
        budget,
        mode,
    )?
    else {
        return Ok(None);
    };
    all.iter()
        .map(|s| s.geometry(&all, examples, hot))
        .collect::<Result<Vec<_>>>()
        .map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tables(rows: &[usize]) -> Vec<Table> {
        rows.iter()
            .enumerate()
            .map(|(i, &rows)| Table {
                name: format!("C{}", i + 1),
                rows,
                dim: 64,
            })
            .collect()
    }

    #[test]
    fn replicated_fits_or_is_refused_naming_the_shortfall() {
        let t = tables(&[1000, 2000]);
        let p = plan(&t, 4, 1 << 30, Sharding::Replicated).unwrap();
        assert_eq!(p.placements, vec![Placement::Replicated; 2]);
        assert_eq!(p.rank_bytes, vec![3000 * 65 * 4; 4]);
        assert_eq!(p.all_to_all_bytes(&t, 1024), 0.0);
        let e = plan(&t, 4, 500_000, Sharding::Replicated)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--sharding replicated") && e.contains("use --sharding row"),
            "{e}"
        );
    }

    #[test]
    fn table_wise_balances_largest_first_and_refuses_a_table_too_large_for_a_rank() {
        let t = tables(&[100, 400, 300, 200]);
        let p = plan(&t, 2, 1 << 30, Sharding::Table).unwrap();
        // 400 to rank 0, 300 to rank 1, 200 to rank 1 (300 < 400), 100 to rank 0
        assert_eq!(
            p.placements,
            vec![
                Placement::Table(0),
                Placement::Table(0),
                Placement::Table(1),
                Placement::Table(1)
            ]
        );
        assert_eq!(p.rank_bytes, vec![500 * 65 * 4, 500 * 65 * 4]);
        let big = tables(&[10_000_000]);
        let e = plan(&big, 4, 1 << 30, Sharding::Table)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("table 'C1'") && e.contains("use --sharding row"),
            "{e}"
        );
    }

    #[test]
    fn row_wise_splits_every_table_evenly() {
        let t = tables(&[1001, 64]);
        let p = plan(&t, 4, 1 << 30, Sharding::Row).unwrap();
        assert_eq!(p.placements, vec![Placement::Row; 2]);
        assert_eq!(p.rank_bytes, vec![(251 + 16) * 65 * 4; 4]);
        // every example needs 3/4 of its two pooled rows from other ranks
        assert_eq!(p.all_to_all_bytes(&t, 100), 2.0 * 100.0 * 64.0 * 4.0 * 0.75);
    }

    #[test]
    fn auto_shards_what_does_not_fit_and_splits_what_no_rank_holds() {
        // 26 tables of 1M rows at dim 64: 6.8 GB; a budget of 4 GB a rank
        let t = tables(&[1_000_000; 26]);
        let budget = 4_000_000_000;
        assert!(plan(&t, 2, budget, Sharding::Replicated).is_err());
        let p = plan(&t, 2, budget, Sharding::Auto).unwrap();
        let sharded = p
            .placements
            .iter()
            .filter(|x| !matches!(x, Placement::Replicated))
            .count();
        assert!(sharded > 0 && sharded < 26, "{:?}", p.placements);
        assert!(p.rank_bytes.iter().all(|&b| b <= budget));
        // on 8 ranks every large table is sharded, small ones stay
        let mut t8 = t.clone();
        t8.push(Table {
            name: "tiny".into(),
            rows: 10,
            dim: 64,
        });
        let p8 = plan(&t8, 8, budget, Sharding::Auto).unwrap();
        assert_eq!(p8.placements[26], Placement::Replicated);
        assert!(p8.placements[..26]
            .iter()
            .all(|x| matches!(x, Placement::Table(_))));
        // a table larger than any rank's budget goes row-wise
        let huge = tables(&[20_000_000, 1000]); // 5.2 GB
        let ph = plan(&huge, 4, budget, Sharding::Auto).unwrap();
        assert_eq!(ph.placements[0], Placement::Row);
        // the same inputs give the same plan (every rank computes it)
        assert_eq!(ph, plan(&huge, 4, budget, Sharding::Auto).unwrap());
    }
}
