//! Reports of unresponsive ranks held by a relay (the TCP store, the liveness channel's rank 0)
//! for their grace, and the order they go out in.
//!
//! A rank whose bounded wait on others ran out reports them before it fails. A named rank that
//! reports too within the grace is alive: it is itself waiting on a rank further up. Reports go
//! out upstream first: a report that names a rank whose own report is still held waits for that
//! one (up to [`CHAIN_CAP`] after it arrived), so its reporter hears of the rank at the top of
//! the chain (the stopped one) before the answer to its report, and can name that rank in its
//! error instead of the live rank it happened to wait on.
//!
//! NOTES: pure bookkeeping, no I/O. A cycle (two ranks each reporting the other, both waiting
//! on a third that never reports) is broken oldest first; every call removes a report or moves
//! one past `now`, so it ends.

use std::time::{Duration, Instant};

use super::later;

/// The longest a report is held waiting for the reports of the ranks it names, from its arrival.
/// Below the reporter's own bound on the answer, so a chain resolves before the reporter gives up.
pub(crate) const CHAIN_CAP: Duration = Duration::from_millis(900);

/// One report: rank `by` timed out on `peers`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Held {
    pub by: usize,
    pub peers: Vec<usize>,
    /// When its grace ends (later, while it waits for an upstream report).
    pub at: Instant,
    /// When it goes out whatever it waits for.
    pub cap: Instant,
}

/// The reports a relay holds.
#[derive(Default, Debug)]
pub(crate) struct HeldReports {
    items: Vec<Held>,
}

impl HeldReports {
    /// Holds `by`'s report of `peers`, arrived at `now`, for `grace`.
    pub fn push(&mut self, by: usize, peers: Vec<usize>, now: Instant, grace: Duration) {
        self.items.push(Held { by, peers, at: later(now, grace), cap: later(now, CHAIN_CAP) });
    }

    /// Whether a report of `by`'s is still held.
    pub fn holds_from(&self, by: usize) -> bool {
        self.items.iter().any(|h| h.by == by)
    }

    /// When the next report comes due.
    pub fn next_due(&self) -> Option<Instant> {
        self.items.iter().map(|h| h.at).min()
    }

    /// Takes the reports to relay at `now` (every one with `None`), in the order they go out:
    /// a report comes after the held reports of the ranks it names.
    pub fn take_due(&mut self, now: Option<Instant>) -> Vec<Held> {
        let mut out = Vec::new();
        loop {
            let due: Vec<usize> = (0..self.items.len())
                .filter(|&i| now.is_none_or(|n| self.items[i].at <= n))
                .collect();
            if due.is_empty() {
                return out;
            }
            if let Some(&i) = due.iter().find(|&&i| self.upstream(i, now).is_none()) {
                out.push(self.items.remove(i));
                continue;
            }
            // Every due report waits on another: those waiting on one not yet due move to its time.
            let mut moved = false;
            for &i in &due {
                if let Some(j) = self.upstream(i, now) {
                    if !due.contains(&j) {
                        self.items[i].at = self.items[j].at.min(self.items[i].cap);
                        moved = true;
                    }
                }
            }
            if !moved {
                // A cycle among due reports: the oldest goes first.
                let i = due.into_iter().min_by_key(|&i| self.items[i].cap).unwrap_or(0);
                out.push(self.items.remove(i));
            }
        }
    }

    /// A held report of a rank that report `i` names, unless `i`'s cap passed.
    fn upstream(&self, i: usize, now: Option<Instant>) -> Option<usize> {
        let h = &self.items[i];
        if now.is_some_and(|n| n >= h.cap) {
            return None;
        }
        self.items.iter().position(|o| o.by != h.by && h.peers.contains(&o.by))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: Duration = Duration::from_millis(300);

    fn ms(t0: Instant, m: u64) -> Instant {
        t0 + Duration::from_millis(m)
    }

    #[test]
    fn a_lone_report_goes_out_after_its_grace() {
        let t0 = Instant::now();
        let mut h = HeldReports::default();
        h.push(2, vec![1], t0, G);
        assert!(h.take_due(Some(ms(t0, 299))).is_empty());
        assert_eq!(h.next_due(), Some(ms(t0, 300)));
        let out = h.take_due(Some(ms(t0, 300)));
        assert_eq!(out.len(), 1);
        assert_eq!((out[0].by, out[0].peers.clone()), (2, vec![1]));
        assert!(!h.holds_from(2));
    }

    /// Rank 0 waited on rank 2, which waited on stopped rank 1 and reported a little later:
    /// rank 0's report goes out after rank 2's, at rank 2's time, not at its own.
    #[test]
    fn a_report_naming_a_reporter_waits_for_its_report() {
        let t0 = Instant::now();
        let mut h = HeldReports::default();
        h.push(0, vec![2], t0, G);
        h.push(2, vec![1], ms(t0, 200), G);
        assert!(h.take_due(Some(ms(t0, 300))).is_empty(), "rank 0's waits for rank 2's");
        assert_eq!(h.next_due(), Some(ms(t0, 500)));
        let out: Vec<usize> = h.take_due(Some(ms(t0, 500))).iter().map(|r| r.by).collect();
        assert_eq!(out, vec![2, 0], "upstream first");
    }

    #[test]
    fn a_chain_goes_out_upstream_first_and_all_at_once_on_close() {
        let t0 = Instant::now();
        let mut h = HeldReports::default();
        h.push(0, vec![3], t0, G);
        h.push(3, vec![2], t0, G);
        h.push(2, vec![1], t0, G);
        let out: Vec<usize> = h.take_due(None).iter().map(|r| r.by).collect();
        assert_eq!(out, vec![2, 3, 0]);
    }

    #[test]
    fn the_cap_ends_the_wait_for_an_upstream_report() {
        let t0 = Instant::now();
        let mut h = HeldReports::default();
        h.push(0, vec![2], t0, G);
        // Rank 2 reports long after: rank 0's report waits at most until its cap.
        h.push(2, vec![1], ms(t0, 800), G);
        assert!(h.take_due(Some(ms(t0, 300))).is_empty());
        assert_eq!(h.next_due(), Some(t0 + CHAIN_CAP));
        let out: Vec<usize> = h.take_due(Some(t0 + CHAIN_CAP)).iter().map(|r| r.by).collect();
        assert_eq!(out, vec![0]);
        assert!(h.holds_from(2));
    }

    #[test]
    fn a_cycle_is_broken_oldest_first() {
        let t0 = Instant::now();
        let mut h = HeldReports::default();
        h.push(4, vec![5], ms(t0, 10), G);
        h.push(5, vec![4], t0, G);
        let out: Vec<usize> = h.take_due(Some(ms(t0, 400))).iter().map(|r| r.by).collect();
        assert_eq!(out, vec![5, 4]);
        assert!(h.next_due().is_none());
    }

    #[test]
    fn reports_of_one_rank_never_wait_on_each_other() {
        let t0 = Instant::now();
        let mut h = HeldReports::default();
        h.push(1, vec![2], t0, G);
        h.push(1, vec![3], t0, G);
        assert_eq!(h.take_due(Some(ms(t0, 300))).len(), 2);
    }
}
