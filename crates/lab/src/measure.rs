//! Latency figures the benches print: one way of reading percentiles, so
//! the p99 of one table means what the p99 of the next one does.

use std::time::Duration;

/// One run's latencies in milliseconds, sorted once.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Latencies {
    sorted_ms: Vec<f64>,
}

impl Latencies {
    pub fn from_millis(mut millis: Vec<f64>) -> Latencies {
        millis.sort_by(f64::total_cmp);
        Latencies { sorted_ms: millis }
    }

    pub fn from_durations(durations: &[Duration]) -> Latencies {
        Latencies::from_millis(durations.iter().map(|d| d.as_secs_f64() * 1e3).collect())
    }

    pub fn len(&self) -> usize {
        self.sorted_ms.len()
    }

    pub fn is_empty(&self) -> bool {
        self.sorted_ms.is_empty()
    }

    /// The nearest-rank percentile (`quantile` from 0 to 1): the smallest
    /// sample with at least that share of all samples at or below it. A
    /// sample that was measured, never an interpolation between two; `None`
    /// without samples.
    pub fn percentile(&self, quantile: f64) -> Option<f64> {
        let count = self.sorted_ms.len();
        if count == 0 {
            return None;
        }
        let rank = ((quantile * count as f64).ceil() as usize).clamp(1, count);
        Some(self.sorted_ms[rank - 1])
    }

    pub fn max(&self) -> Option<f64> {
        self.sorted_ms.last().copied()
    }

    pub fn mean(&self) -> Option<f64> {
        (!self.sorted_ms.is_empty())
            .then(|| self.sorted_ms.iter().sum::<f64>() / self.sorted_ms.len() as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank_samples() {
        let latencies = Latencies::from_millis((1..=100).rev().map(f64::from).collect());
        assert_eq!(latencies.len(), 100);
        assert_eq!(latencies.percentile(0.50), Some(50.0));
        assert_eq!(latencies.percentile(0.99), Some(99.0));
        assert_eq!(latencies.percentile(1.0), Some(100.0));
        assert_eq!(
            latencies.percentile(0.0),
            Some(1.0),
            "rank 0 is the first sample"
        );
        assert_eq!(latencies.max(), Some(100.0));
        assert_eq!(latencies.mean(), Some(50.5));
    }

    #[test]
    fn few_samples_still_give_a_measured_value() {
        let latencies =
            Latencies::from_durations(&[Duration::from_millis(3), Duration::from_millis(1)]);
        assert_eq!(latencies.percentile(0.50), Some(1.0));
        assert_eq!(latencies.percentile(0.99), Some(3.0));
    }

    #[test]
    fn no_samples_no_figures() {
        let latencies = Latencies::default();
        assert!(latencies.is_empty());
        assert_eq!(latencies.percentile(0.5), None);
        assert_eq!((latencies.max(), latencies.mean()), (None, None));
    }
}
