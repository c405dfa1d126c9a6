//! Summary statistics for timings: [`percentile`], the one percentile definition every figure
//! of the bench, its examples and its Criterion benches uses, and [`Summary`] built on it.

use std::time::Duration;

/// The nearest-rank `p`-th percentile (`p` in 0..=100) of `v`, sorted or not: the smallest
/// value with at least `p`% of the sample at or below it, i.e. the value of rank
/// `ceil(p / 100 * n)` (clamped to 1..=n) in ascending order. `p` = 0 gives the minimum, 100 the
/// maximum, 50 the lower median of an even-sized sample. NaN for an empty sample or a NaN `p`.
/// A sample not already ascending is sorted in a copy (`f64::total_cmp`: NaNs sort last).
pub fn percentile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() || p.is_nan() {
        return f64::NAN;
    }
    let n = v.len();
    let rank = ((p.clamp(0.0, 100.0) / 100.0 * n as f64).ceil() as usize).clamp(1, n);
    if v.windows(2).all(|w| w[0].total_cmp(&w[1]).is_le()) {
        return v[rank - 1];
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[rank - 1]
}

/// Median and p99 of a sample of durations, in microseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Summary {
    pub median_us: f64,
    pub p99_us: f64,
    pub min_us: f64,
    pub n: usize,
}

impl Summary {
    pub fn of(samples: &[Duration]) -> Summary {
        let mut us: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1e6).collect();
        Self::of_us(&mut us)
    }
    /// Sorts `us` in place (then [`percentile`] reads it without a copy).
    pub fn of_us(us: &mut [f64]) -> Summary {
        if us.is_empty() {
            return Summary::default();
        }
        us.sort_by(f64::total_cmp);
        Summary {
            median_us: percentile(us, 50.0),
            p99_us: percentile(us, 99.0),
            min_us: percentile(us, 0.0),
            n: us.len(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_is_nan_and_does_not_panic() {
        for p in [0.0, 50.0, 99.0, 100.0] {
            assert!(percentile(&[], p).is_nan());
        }
        assert_eq!(Summary::of_us(&mut []), Summary::default());
    }

    #[test]
    fn one_element_is_every_percentile() {
        for p in [0.0, 1.0, 50.0, 99.0, 100.0] {
            assert_eq!(percentile(&[7.5], p), 7.5);
        }
    }

    #[test]
    fn nearest_rank() {
        // 1..=100 shuffled: the p-th percentile is p itself (rank p), 0 the minimum.
        let mut v: Vec<f64> = (1..=100).map(f64::from).collect();
        v.reverse();
        v.swap(3, 70);
        assert_eq!(percentile(&v, 0.0), 1.0);
        assert_eq!(percentile(&v, 50.0), 50.0);
        assert_eq!(percentile(&v, 99.0), 99.0);
        assert_eq!(percentile(&v, 100.0), 100.0);
        // Odd size: the middle; even size: the lower of the two middle values.
        assert_eq!(percentile(&[3.0, 1.0, 2.0], 50.0), 2.0);
        assert_eq!(percentile(&[4.0, 1.0, 3.0, 2.0], 50.0), 2.0);
        // p99 of 10 is the maximum (rank ceil(9.9) = 10); p out of range is clamped.
        let ten: Vec<f64> = (0..10).map(f64::from).collect();
        assert_eq!(percentile(&ten, 99.0), 9.0);
        assert_eq!(percentile(&ten, 150.0), 9.0);
        assert_eq!(percentile(&ten, -1.0), 0.0);
        assert!(percentile(&ten, f64::NAN).is_nan());
    }

    #[test]
    fn summary_uses_percentile() {
        let mut v = vec![5.0, 1.0, 4.0, 2.0, 3.0];
        let s = Summary::of_us(&mut v);
        assert_eq!((s.median_us, s.p99_us, s.min_us, s.n), (3.0, 5.0, 1.0, 5));
        assert_eq!(v, vec![1.0, 2.0, 3.0, 4.0, 5.0]);
    }
}
