//! The metrics a recommendation engineer reads: normalized entropy and AUC of the main
//! logit, and throughput percentiles. NE is a bundle of summable states in f64 (as
//! TorchRec keeps it), so a multi-rank reduction is one sum.

/// Summable state of normalized entropy.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct NeState {
    /// Σ BCE(logit, label).
    pub ce_sum: f64,
    /// Σ label.
    pub positives: f64,
    pub count: f64,
}

impl NeState {
    pub fn update(&mut self, logits: &[f64], labels: &[f64]) {
        for (&x, &y) in logits.iter().zip(labels) {
            self.ce_sum += x.max(0.0) - x * y + (-x.abs()).exp().ln_1p();
            self.positives += y;
            self.count += 1.0;
        }
    }

    pub fn merge(&mut self, o: &NeState) {
        self.ce_sum += o.ce_sum;
        self.positives += o.positives;
        self.count += o.count;
    }

    /// Mean BCE over the entropy of the base rate; `None` when undefined (no examples, or
    /// labels all one class).
    pub fn ne(&self) -> Option<f64> {
        if self.count == 0.0 {
            return None;
        }
        let p = self.positives / self.count;
        if p <= 0.0 || p >= 1.0 {
            return None;
        }
        let h = -(p * p.ln() + (1.0 - p) * (1.0 - p).ln());
        Some(self.ce_sum / self.count / h)
    }

    pub fn mean_loss(&self) -> f64 {
        if self.count == 0.0 {
            f64::NAN
        } else {
            self.ce_sum / self.count
        }
    }
}

/// Area under the ROC curve (ties share their average rank). `None` when one class is
/// missing.
pub fn auc(scores: &[f64], labels: &[f64]) -> Option<f64> {
    let mut idx: Vec<usize> = (0..scores.len()).collect();
    idx.sort_by(|&a, &b| scores[a].total_cmp(&scores[b]));
    let (mut rank_sum_pos, mut pos, mut neg) = (0.0f64, 0.0f64, 0.0f64);
    let mut i = 0;
    while i < idx.len() {
        let mut j = i;
        while j + 1 < idx.len() && scores[idx[j + 1]] == scores[idx[i]] {
            j += 1;
        }
        let avg_rank = (i + j) as f64 / 2.0 + 1.0;
        for &k in &idx[i..=j] {
            if labels[k] > 0.5 {
                rank_sum_pos += avg_rank;
                pos += 1.0;
            } else {
                neg += 1.0;
            }
        }
        i = j + 1;
    }
    if pos == 0.0 || neg == 0.0 {
        return None;
    }
    Some((rank_sum_pos - pos * (pos + 1.0) / 2.0) / (pos * neg))
}

/// p50, p90 (the fast end: the 90th percentile of QPS) and mean of per-step QPS.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct QpsSummary {
    pub p50: f64,
    pub p90: f64,
    pub mean: f64,
    pub steps: usize,
}

/// Summarises per-step QPS values (nearest-rank percentiles).
pub fn qps_summary(qps: &[f64]) -> Option<QpsSummary> {
    if qps.is_empty() {
        return None;
    }
    let mut v = qps.to_vec();
    v.sort_by(f64::total_cmp);
    let pct = |p: f64| v[(((p / 100.0) * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1];
    Some(QpsSummary {
        p50: pct(50.0),
        p90: pct(90.0),
        mean: v.iter().sum::<f64>() / v.len() as f64,
        steps: v.len(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ne_of_the_base_rate_predictor_is_one() {
        let p: f64 = 0.25;
        let logit = (p / (1.0 - p)).ln();
        let labels: Vec<f64> = (0..400).map(|i| f64::from(i % 4 == 0)).collect();
        let mut s = NeState::default();
        s.update(&vec![logit; labels.len()], &labels);
        assert!((s.ne().unwrap() - 1.0).abs() < 1e-12);
        // better than the base rate: below one
        let good: Vec<f64> = labels
            .iter()
            .map(|&y| if y > 0.5 { 2.0 } else { -3.0 })
            .collect();
        let mut t = NeState::default();
        t.update(&good, &labels);
        assert!(t.ne().unwrap() < 0.3);
        assert_eq!(NeState::default().ne(), None);
    }

    #[test]
    fn auc_counts_pairs_and_ties() {
        assert_eq!(
            auc(&[0.1, 0.4, 0.35, 0.8], &[0.0, 0.0, 1.0, 1.0]),
            Some(0.75)
        );
        assert_eq!(auc(&[0.5, 0.5], &[0.0, 1.0]), Some(0.5));
        assert_eq!(auc(&[1.0, 2.0], &[1.0, 1.0]), None);
    }

    #[test]
    fn percentiles_take_the_fast_end() {
        let q: Vec<f64> = (1..=10).map(f64::from).collect();
        let s = qps_summary(&q).unwrap();
        assert_eq!((s.p50, s.p90, s.mean, s.steps), (5.0, 9.0, 5.5, 10));
    }
}
