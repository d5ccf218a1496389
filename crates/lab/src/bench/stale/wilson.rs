//! The Wilson score interval for a share, and the sample size it needs.
//!
//! Written out rather than taken from a statistics crate: the interval is
//! one closed form, and the only quantile it needs is the normal 97.5%
//! point, a constant. A crate such as `statrs` would bring a dependency tree
//! for that one number.

/// Φ⁻¹(0.975): the normal quantile of a two-sided 95% interval.
pub const Z95: f64 = 1.959_963_984_540_054;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Interval {
    pub low: f64,
    pub high: f64,
}

/// The Wilson score interval for `hits` out of `n`; `None` when `n` is 0
/// or `hits` exceeds it.
pub fn wilson(hits: u64, n: u64, z: f64) -> Option<Interval> {
    if n == 0 || hits > n {
        return None;
    }
    Some(wilson_at(hits as f64 / n as f64, n as f64, z))
}

/// The interval at share `p` over `n` trials (`n` > 0).
fn wilson_at(p: f64, n: f64, z: f64) -> Interval {
    let z2 = z * z;
    let denominator = 1.0 + z2 / n;
    let centre = (p + z2 / (2.0 * n)) / denominator;
    let half = z / denominator * (p * (1.0 - p) / n + z2 / (4.0 * n * n)).sqrt();
    Interval {
        low: (centre - half).max(0.0),
        high: (centre + half).min(1.0),
    }
}

/// The fewest trials for which the interval's upper bound at share `p` is
/// at most `goal`; `None` when `p` is not below `goal` (no number of trials
/// would do) or either is outside 0 to 1.
pub fn trials_needed(p: f64, goal: f64, z: f64) -> Option<u64> {
    if !(0.0..=1.0).contains(&p) || !(0.0..=1.0).contains(&goal) || p >= goal {
        return None;
    }
    // The upper bound falls as n grows (at a fixed share), so the answer is
    // found by doubling, then halving the gap.
    let fits = |n: u64| wilson_at(p, n as f64, z).high <= goal;
    let mut high = 1u64;
    while !fits(high) {
        high = high.checked_mul(2)?;
    }
    let mut low = high / 2;
    while high - low > 1 {
        let mid = low + (high - low) / 2;
        if fits(mid) {
            high = mid;
        } else {
            low = mid;
        }
    }
    Some(high)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn known_intervals() {
        // 5 of 10: the textbook (0.2366, 0.7634).
        let i = wilson(5, 10, Z95).unwrap();
        assert!(close(i.low, 0.236_593_090_512_564), "{i:?}");
        assert!(close(i.high, 0.763_406_909_487_436), "{i:?}");
        // None of 10: the upper bound is z²/(n + z²).
        let i = wilson(0, 10, Z95).unwrap();
        assert_eq!(i.low, 0.0);
        assert!(close(i.high, Z95 * Z95 / (10.0 + Z95 * Z95)), "{i:?}");
        let i = wilson(3, 10_000, Z95).unwrap();
        assert!(close(i.low, 0.000_102_032_199_417_810), "{i:?}");
        assert!(close(i.high, 0.000_881_735_772_236_379), "{i:?}");
        assert_eq!(wilson(0, 0, Z95), None);
        assert_eq!(wilson(2, 1, Z95), None);
    }

    #[test]
    fn trials_needed_is_the_first_n_that_meets_the_goal() {
        // None seen: n >= z²(1/goal - 1), 3837.6 for 0.1 pp.
        assert_eq!(trials_needed(0.0, 0.001, Z95), Some(3838));
        let n = trials_needed(0.0003, 0.001, Z95).unwrap();
        assert!(wilson_at(0.0003, n as f64, Z95).high <= 0.001);
        assert!(wilson_at(0.0003, (n - 1) as f64, Z95).high > 0.001);
        assert_eq!(trials_needed(0.001, 0.001, Z95), None);
        assert_eq!(trials_needed(0.02, 0.001, Z95), None);
        assert_eq!(trials_needed(-0.1, 0.001, Z95), None);
    }
}
