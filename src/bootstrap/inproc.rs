//! Threads as ranks: a Mutex/Condvar rendezvous with the same failure semantics as the TCP store
//! (a dropped rank is "gone", a late round names its missing ranks), so code tested in-process
//! behaves the same way across processes.

use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::{check_ranks, later, node_local_world, Bootstrap, BootstrapError, DeadSet, MAX_BLOB};

/// Why the group can no longer complete a round. Kept (cloneable) in the shared state so that every
/// rank, including ones that arrive later, reports the same cause.
#[derive(Clone, Debug)]
enum Failure {
    Timeout { round: u64, missing: Vec<usize> },
    Gone { rank: usize },
}

impl Failure {
    fn to_error(&self, op: &'static str, waited: Duration) -> BootstrapError {
        match self {
            Failure::Timeout { round, missing } => {
                let (round, missing) = (*round, missing.clone());
                BootstrapError::Timeout { op, round, missing, waited, note: String::new() }
            }
            Failure::Gone { rank } => BootstrapError::PeerGone { rank: *rank, op },
        }
    }
}

struct State {
    /// Number of the round being collected; bumped when the last rank arrives.
    round: u64,
    slots: Vec<Option<Vec<u8>>>,
    arrived: usize,
    /// Result of round `round - 1`, for the ranks still waking up from it.
    last: Option<Arc<Vec<Vec<u8>>>>,
    failed: Option<Failure>,
}

struct Shared {
    world_size: usize,
    timeout: Duration,
    state: Mutex<State>,
    cv: Condvar,
    /// Ranks dropped so far, readable without the state lock.
    dead: DeadSet,
}

/// Builds a group of in-process ranks.
pub struct InProcGroup;

impl InProcGroup {
    /// One [`InProcBootstrap`] per rank (index = rank); move each into its own thread. Ranks are
    /// packed `local_world_size` per simulated node, in rank order. Every all-gather waits at most
    /// `timeout` and then fails naming the ranks that did not arrive.
    ///
    /// Returns a `Result` (not a bare `Vec`) so that a zero or inconsistent size is a typed error,
    /// not a panic.
    // The group is only a factory: its product is the ranks, one per thread.
    #[allow(clippy::new_ret_no_self)]
    pub fn new(
        world_size: usize,
        local_world_size: usize,
        timeout: Duration,
    ) -> Result<Vec<InProcBootstrap>, BootstrapError> {
        check_ranks(0, world_size, 0, local_world_size)?;
        let shared = Arc::new(Shared {
            world_size,
            timeout,
            state: Mutex::new(State {
                round: 0,
                slots: vec![None; world_size],
                arrived: 0,
                last: None,
                failed: None,
            }),
            cv: Condvar::new(),
            dead: DeadSet::new(world_size),
        });
        Ok((0..world_size)
            .map(|rank| InProcBootstrap {
                shared: Arc::clone(&shared),
                rank,
                local_rank: rank % local_world_size,
                local_world_size: node_local_world(rank, world_size, local_world_size),
                call: Mutex::new(()),
            })
            .collect())
    }
}

/// One rank of an [`InProcGroup`]. Dropping it marks the rank gone: ranks waiting for it (now or
/// later) fail with [`BootstrapError::PeerGone`] instead of waiting out the timeout.
pub struct InProcBootstrap {
    shared: Arc<Shared>,
    rank: usize,
    local_rank: usize,
    local_world_size: usize,
    /// Serialises calls from several threads holding the same rank: one rank contributes once per
    /// round.
    call: Mutex<()>,
}

impl InProcBootstrap {
    fn gather(&self, data: &[u8], op: &'static str) -> Result<Vec<Vec<u8>>, BootstrapError> {
        if data.len() > MAX_BLOB {
            return Err(BootstrapError::Protocol(format!(
                "rank {}: {op} blob of {} bytes exceeds the {MAX_BLOB}-byte limit",
                self.rank,
                data.len()
            )));
        }
        let _one_call = self.call.lock();
        let start = Instant::now();
        let deadline = later(start, self.shared.timeout);
        let world = self.shared.world_size;
        let mut st = self.shared.state.lock();
        if let Some(f) = &st.failed {
            return Err(f.to_error(op, start.elapsed()));
        }
        let round = st.round;
        st.slots[self.rank] = Some(data.to_vec());
        st.arrived += 1;
        if st.arrived == world {
            let blobs: Vec<Vec<u8>> =
                st.slots.iter_mut().map(|s| s.take().unwrap_or_default()).collect();
            let blobs = Arc::new(blobs);
            st.last = Some(Arc::clone(&blobs));
            st.arrived = 0;
            st.round += 1;
            self.shared.cv.notify_all();
            return Ok(blobs.as_ref().clone());
        }
        loop {
            // NOTES: completion is checked before failure: a rank that finished the last round and
            // dropped must not turn that completed round into an error for slower wakers.
            if st.round > round {
                return Ok(st.last.as_deref().cloned().unwrap_or_default());
            }
            if let Some(f) = &st.failed {
                return Err(f.to_error(op, start.elapsed()));
            }
            if self.shared.cv.wait_until(&mut st, deadline).timed_out() {
                if st.round > round {
                    continue;
                }
                if st.failed.is_none() {
                    let missing =
                        st.slots.iter().enumerate().filter(|(_, s)| s.is_none()).map(|(r, _)| r);
                    st.failed = Some(Failure::Timeout { round, missing: missing.collect() });
                    self.shared.cv.notify_all();
                }
            }
        }
    }
}

impl Bootstrap for InProcBootstrap {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.shared.world_size
    }
    fn local_rank(&self) -> usize {
        self.local_rank
    }
    fn local_world_size(&self) -> usize {
        self.local_world_size
    }
    fn all_gather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>, BootstrapError> {
        self.gather(data, "all_gather")
    }
    fn barrier(&self) -> Result<(), BootstrapError> {
        self.gather(&[], "barrier").map(|_| ())
    }
    fn dead_ranks(&self) -> Vec<usize> {
        self.shared.dead.list()
    }
    fn is_dead(&self, rank: usize) -> bool {
        self.shared.dead.is_dead(rank)
    }
}

impl Drop for InProcBootstrap {
    fn drop(&mut self) {
        self.shared.dead.mark(self.rank);
        let mut st = self.shared.state.lock();
        if st.failed.is_none() {
            st.failed = Some(Failure::Gone { rank: self.rank });
        }
        self.shared.cv.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::thread;

    #[test]
    fn gathers_in_rank_order() {
        let group = InProcGroup::new(3, 2, Duration::from_secs(5)).expect("group");
        let handles: Vec<_> = group
            .into_iter()
            .map(|b| {
                thread::spawn(move || {
                    let blob = vec![b.rank() as u8; b.rank()];
                    let got = b.all_gather(&blob)?;
                    b.barrier()?;
                    Ok::<_, BootstrapError>((b.rank(), b.local_rank(), b.local_world_size(), got))
                })
            })
            .collect();
        for h in handles {
            let (rank, local_rank, local_world, got) = h.join().expect("thread").expect("gather");
            assert_eq!(local_rank, rank % 2);
            assert_eq!(local_world, if rank < 2 { 2 } else { 1 });
            assert_eq!(got, vec![vec![], vec![1], vec![2, 2]]);
        }
    }

    #[test]
    fn timeout_names_missing_ranks() {
        let mut group = InProcGroup::new(3, 3, Duration::from_millis(100)).expect("group");
        let _late = group.pop();
        let start = Instant::now();
        let err = group[0].all_gather(b"x").expect_err("rank 2 never arrives");
        assert!(start.elapsed() >= Duration::from_millis(100));
        match err {
            BootstrapError::Timeout { round: 0, missing, .. } => assert_eq!(missing, vec![1, 2]),
            other => panic!("expected Timeout, got {other}"),
        }
    }

    #[test]
    fn dropped_rank_is_dead_for_the_others() {
        let mut group = InProcGroup::new(3, 3, Duration::from_secs(5)).expect("group");
        assert!(group[0].dead_ranks().is_empty() && !group[0].is_dead(1));
        drop(group.remove(1));
        assert_eq!((group[0].dead_ranks(), group[1].is_dead(1)), (vec![1], true));
        assert!(!group[0].is_dead(0) && !group[0].is_dead(7));
    }

    #[test]
    fn rejects_bad_sizes() {
        assert!(InProcGroup::new(0, 1, Duration::from_secs(1)).is_err());
        assert!(InProcGroup::new(2, 0, Duration::from_secs(1)).is_err());
        assert!(InProcGroup::new(2, 3, Duration::from_secs(1)).is_err());
    }
}
