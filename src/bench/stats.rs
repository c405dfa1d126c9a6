//! Summary statistics for timings.

use std::time::Duration;

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
    pub fn of_us(us: &mut [f64]) -> Summary {
        if us.is_empty() {
            return Summary::default();
        }
        us.sort_by(f64::total_cmp);
        let at = |q: f64| us[((us.len() - 1) as f64 * q).round() as usize];
        Summary { median_us: at(0.5), p99_us: at(0.99), min_us: us[0], n: us.len() }
    }
}
