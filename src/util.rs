//! Small shared helpers: deterministic test data, deadlines, the host-side wait back-off.

use std::time::{Duration, Instant};

/// SplitMix64: a tiny deterministic generator for test and benchmark inputs (no `rand` dep).
#[derive(Clone, Debug)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }
    /// Uniform in `[0, 1)`.
    pub fn unit_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
}

/// A point in time after which a bounded wait gives up.
#[derive(Clone, Copy, Debug)]
pub struct Deadline {
    start: Instant,
    limit: Duration,
}

impl Deadline {
    pub fn after(limit: Duration) -> Self {
        Deadline { start: Instant::now(), limit }
    }
    pub fn expired(&self) -> bool {
        self.start.elapsed() >= self.limit
    }
    pub fn elapsed(&self) -> Duration {
        self.start.elapsed()
    }
    pub fn limit(&self) -> Duration {
        self.limit
    }
    pub fn remaining(&self) -> Duration {
        self.limit.saturating_sub(self.start.elapsed())
    }
}

/// The host-side idle policy of a polling wait: spin, then yield, then sleep 20 us per round
/// (many ranks may share few cores). `Backoff::new(spins, yields)`: the round counts at which it
/// moves to the next regime; `reset` after progress.
#[derive(Clone, Debug)]
pub struct Backoff {
    rounds: u32,
    spins: u32,
    yields: u32,
}

impl Backoff {
    pub fn new(spins: u32, yields: u32) -> Self {
        Backoff { rounds: 0, spins, yields: yields.max(spins) }
    }
    pub fn reset(&mut self) {
        self.rounds = 0;
    }
    pub fn snooze(&mut self) {
        self.rounds = self.rounds.saturating_add(1);
        if self.rounds < self.spins {
            std::hint::spin_loop();
        } else if self.rounds < self.yields {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(20));
        }
    }
}
