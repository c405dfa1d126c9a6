//! A bootstrap over a caller-supplied all-gather (the C ABI, a torch process group, MPI).
//!
//! Such collectives are equal-length (`MPI_Allgather`, `dist.all_gather_into_tensor`), so variable
//! blobs take two calls: first every rank's length (u64 LE), then every blob padded to the longest.
//!
//! The first length exchange also carries rank 0's liveness beacon (`liveness.rs`): every rank
//! then keeps a connection to rank 0, which relays a rank's departure to all, so a dead peer is
//! in [`Bootstrap::dead_ranks`] within milliseconds, as with the TCP store, instead of being seen
//! only when a data-path wait on it times out.

use std::sync::Arc;

use parking_lot::Mutex;

use super::liveness::{Beacon, Liveness, Reports, BEACON_BYTES};
use super::{check_ranks, Bootstrap, BootstrapError, DeadSet, MAX_BLOB};

/// The liveness channel's state: started by the first all-gather.
enum Live {
    NotStarted,
    Running(#[allow(dead_code)] Liveness),
    /// One rank, or rank 0 could not listen, or this rank could not start its thread.
    Off,
}

/// An equal-length all-gather: `send` holds `L` bytes, `recv` has room for `L * world_size`; on
/// return `recv[r * L..(r + 1) * L]` holds rank `r`'s `send`. Every rank calls it with the same `L`.
/// `Err` carries the caller's own description of what failed.
pub type AllGatherFn = Box<dyn Fn(&[u8], &mut [u8]) -> Result<(), String> + Send + Sync>;

/// [`Bootstrap`] over an [`AllGatherFn`].
///
/// NOTES: the deadline belongs to the callback: this wrapper cannot interrupt a foreign collective,
/// so a callback that can block must carry its own timeout (torch's process groups and NCCL do).
pub struct CallbackBootstrap {
    rank: usize,
    world_size: usize,
    local_rank: usize,
    local_world_size: usize,
    all_gather: AllGatherFn,
    /// Two threads must not interleave the two calls one all-gather makes; holds the liveness
    /// channel, which the first all-gather starts.
    call: Mutex<Live>,
    dead: Arc<DeadSet>,
    /// The running channel's reports (outside `call`, which a collective holds).
    reports: std::sync::OnceLock<Arc<Reports>>,
}

impl CallbackBootstrap {
    /// Wraps `all_gather` with the given identity (as the caller's launcher knows it).
    pub fn new(
        rank: usize,
        world_size: usize,
        local_rank: usize,
        local_world_size: usize,
        all_gather: AllGatherFn,
    ) -> Result<Self, BootstrapError> {
        check_ranks(rank, world_size, local_rank, local_world_size)?;
        Ok(CallbackBootstrap {
            rank,
            world_size,
            local_rank,
            local_world_size,
            all_gather,
            call: Mutex::new(if world_size > 1 { Live::NotStarted } else { Live::Off }),
            dead: Arc::new(DeadSet::new(world_size)),
            reports: std::sync::OnceLock::new(),
        })
    }

    /// The beacon slot this rank contributes to the first length exchange: rank 0 starts
    /// listening and sends where; the others send zeros.
    fn beacon_slot(&self, live: &mut Live) -> [u8; BEACON_BYTES] {
        if self.rank != 0 {
            return [0; BEACON_BYTES];
        }
        match Liveness::serve(self.world_size, self.dead.clone()) {
            Ok((l, beacon)) => {
                crate::fep_debug!(
                    target: "fabric_ep::bootstrap",
                    "liveness: rank 0 listens on port {} of {:?}",
                    beacon.port,
                    beacon.addrs
                );
                let _ = self.reports.set(l.reports());
                *live = Live::Running(l);
                beacon.encode()
            }
            Err(e) => {
                crate::fep_warn!(
                    target: "fabric_ep::bootstrap",
                    "liveness: rank 0 cannot listen ({e}); a rank that dies is seen only when a \
                     wait on it times out"
                );
                *live = Live::Off;
                [0; BEACON_BYTES]
            }
        }
    }

    /// After the first length exchange: every rank but 0 joins rank 0's beacon, if it sent one.
    fn start_liveness(&self, live: &mut Live, rank0_slot: &[u8]) {
        if self.rank == 0 {
            return;
        }
        *live = match Beacon::decode(rank0_slot) {
            None => Live::Off,
            Some(b) => match Liveness::join(self.rank, self.world_size, b, self.dead.clone()) {
                Ok(l) => {
                    let _ = self.reports.set(l.reports());
                    Live::Running(l)
                }
                Err(e) => {
                    crate::fep_warn!(
                        target: "fabric_ep::bootstrap",
                        "liveness: rank {} cannot start its thread ({e}); a rank that dies is \
                         seen only when a wait on it times out",
                        self.rank
                    );
                    Live::Off
                }
            },
        };
    }

    fn call(&self, send: &[u8], what: &str) -> Result<Vec<u8>, BootstrapError> {
        let total = send.len().checked_mul(self.world_size).ok_or_else(|| {
            BootstrapError::Callback(format!(
                "{what}: {} bytes x {} ranks overflows",
                send.len(),
                self.world_size
            ))
        })?;
        let mut recv = vec![0u8; total];
        (self.all_gather)(send, &mut recv)
            .map_err(|e| BootstrapError::Callback(format!("rank {}: {what}: {e}", self.rank)))?;
        // A callback that does not place blobs by rank would silently scramble every address; our
        // own slot is the one thing we can check.
        let ours = &recv[self.rank * send.len()..(self.rank + 1) * send.len()];
        if ours != send {
            return Err(BootstrapError::Callback(format!(
                "rank {}: {what}: the callback did not put this rank's data at index {}; it must \
                 return blobs in rank order",
                self.rank, self.rank
            )));
        }
        Ok(recv)
    }
}

impl Bootstrap for CallbackBootstrap {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world_size
    }
    fn local_rank(&self) -> usize {
        self.local_rank
    }
    fn local_world_size(&self) -> usize {
        self.local_world_size
    }

    fn all_gather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>, BootstrapError> {
        if data.len() > MAX_BLOB {
            return Err(BootstrapError::Protocol(format!(
                "rank {}: all_gather blob of {} bytes exceeds the {MAX_BLOB}-byte limit",
                self.rank,
                data.len()
            )));
        }
        let mut live = self.call.lock();
        // A rank that left cannot contribute: fail naming it rather than enter a collective
        // that waits for it until the caller's own timeout.
        if let Some(&rank) = self.dead.list().first() {
            return Err(BootstrapError::PeerGone { rank, op: "all_gather" });
        }
        let first = matches!(*live, Live::NotStarted);
        let mut head = (data.len() as u64).to_le_bytes().to_vec();
        if first {
            head.extend_from_slice(&self.beacon_slot(&mut live));
        }
        let lens_raw = match self.call(&head, "length exchange") {
            Ok(r) => r,
            Err(e) => {
                if first {
                    // Try again from the start next time, as every rank will.
                    *live = Live::NotStarted;
                }
                return Err(e);
            }
        };
        if first {
            self.start_liveness(&mut live, &lens_raw[8..head.len()]);
        }
        let mut lens = Vec::with_capacity(self.world_size);
        for (r, chunk) in lens_raw.chunks_exact(head.len()).enumerate() {
            let mut b = [0u8; 8];
            b.copy_from_slice(&chunk[..8]);
            let len = u64::from_le_bytes(b);
            match usize::try_from(len) {
                Ok(len) if len <= MAX_BLOB => lens.push(len),
                _ => {
                    return Err(BootstrapError::Protocol(format!(
                        "rank {r} announced a {len}-byte blob, above the {MAX_BLOB}-byte limit"
                    )))
                }
            }
        }
        let max = lens.iter().copied().max().unwrap_or(0);
        // Every rank sees the same lengths, so all of them skip the second call together.
        if max == 0 {
            return Ok(vec![Vec::new(); self.world_size]);
        }
        let mut padded = vec![0u8; max];
        padded[..data.len()].copy_from_slice(data);
        let all = self.call(&padded, "data exchange")?;
        Ok(lens.iter().enumerate().map(|(r, &len)| all[r * max..r * max + len].to_vec()).collect())
    }

    fn dead_ranks(&self) -> Vec<usize> {
        self.dead.list()
    }

    fn is_dead(&self, rank: usize) -> bool {
        self.dead.is_dead(rank)
    }

    fn dead_peers(&self) -> Vec<super::DeadPeer> {
        self.dead.peers()
    }

    fn report_unresponsive(&self, peers: &[usize]) {
        let Some(r) = self.reports.get() else { return };
        let mut named: Vec<usize> = peers
            .iter()
            .copied()
            .filter(|&p| p != self.rank && p < self.world_size && !self.dead.is_dead(p))
            .collect();
        named.sort_unstable();
        named.dedup();
        r.report(&named, std::time::Duration::from_millis(1500));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A one-rank "collective": copies send to recv.
    fn solo() -> AllGatherFn {
        Box::new(|send, recv| {
            recv.copy_from_slice(send);
            Ok(())
        })
    }

    #[test]
    fn single_rank_round_trips() {
        let b = CallbackBootstrap::new(0, 1, 0, 1, solo()).expect("new");
        assert_eq!(b.all_gather(b"abc").expect("gather"), vec![b"abc".to_vec()]);
        b.barrier().expect("barrier");
    }

    #[test]
    fn callback_error_is_reported() {
        let b = CallbackBootstrap::new(0, 1, 0, 1, Box::new(|_, _| Err("pg broken".into())))
            .expect("new");
        let err = b.all_gather(b"x").expect_err("callback fails");
        assert!(matches!(&err, BootstrapError::Callback(m) if m.contains("pg broken")), "{err}");
    }

    /// An equal-length all-gather among `n` threads: one slot per rank, two barriers.
    fn group(n: usize) -> Vec<AllGatherFn> {
        let slots = Arc::new(Mutex::new(vec![Vec::new(); n]));
        let barrier = Arc::new(std::sync::Barrier::new(n));
        (0..n)
            .map(|rank| {
                let (slots, barrier) = (slots.clone(), barrier.clone());
                let f: AllGatherFn = Box::new(move |send: &[u8], recv: &mut [u8]| {
                    slots.lock()[rank] = send.to_vec();
                    barrier.wait();
                    for (r, s) in slots.lock().iter().enumerate() {
                        recv[r * send.len()..(r + 1) * send.len()].copy_from_slice(s);
                    }
                    barrier.wait();
                    Ok(())
                });
                f
            })
            .collect()
    }

    /// `n` callback bootstraps over [`group`], one node.
    fn bootstraps(n: usize) -> Vec<Arc<CallbackBootstrap>> {
        group(n)
            .into_iter()
            .enumerate()
            .map(|(r, f)| Arc::new(CallbackBootstrap::new(r, n, r, n, f).expect("new")))
            .collect()
    }

    fn wait_for(what: &str, f: impl Fn() -> bool) {
        let t = std::time::Instant::now();
        while !f() {
            assert!(t.elapsed() < std::time::Duration::from_secs(2), "{what}: not within 2 s");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }

    #[test]
    fn a_rank_that_leaves_is_named_by_the_others_and_fails_later_collectives() {
        let n = 3;
        let boots = bootstraps(n);
        let threads: Vec<_> = boots
            .iter()
            .map(|b| {
                let b = b.clone();
                std::thread::spawn(move || b.all_gather(&[b.rank() as u8; 3]).expect("gather"))
            })
            .collect();
        for t in threads {
            assert_eq!(t.join().unwrap(), vec![vec![0; 3], vec![1; 3], vec![2; 3]]);
        }
        let mut boots: Vec<Option<Arc<CallbackBootstrap>>> = boots.into_iter().map(Some).collect();
        // Let the joiners connect, then rank 1 leaves (its bootstrap closes).
        std::thread::sleep(std::time::Duration::from_millis(300));
        boots[1] = None;
        for r in [0, 2] {
            let b = boots[r].as_ref().unwrap();
            wait_for(&format!("rank {r} names rank 1"), || b.dead_ranks() == vec![1]);
            assert!(b.is_dead(1) && !b.is_dead(0) && !b.is_dead(2));
            let err = b.all_gather(b"x").expect_err("a collective without rank 1");
            assert!(matches!(err, BootstrapError::PeerGone { rank: 1, .. }), "{err}");
        }
        // Rank 0 leaves: rank 2 names it too.
        boots[0] = None;
        let b = boots[2].as_ref().unwrap();
        wait_for("rank 2 names rank 0", || b.dead_ranks() == vec![1, 0]);
    }

    /// A joiner's report and rank 0's own reach every other rank as "unresponsive, reported by"
    /// (each returns once rank 0 relayed it, after its grace); a peer is relayed once.
    #[test]
    fn unresponsive_peers_reported_by_any_rank_reach_the_others() {
        use crate::bootstrap::DeadPeer;
        let n = 4;
        let boots = bootstraps(n);
        let threads: Vec<_> = boots
            .iter()
            .map(|b| {
                let b = b.clone();
                std::thread::spawn(move || b.barrier().expect("barrier"))
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        std::thread::sleep(std::time::Duration::from_millis(300));
        // Rank 2 timed out on rank 1 (and names itself and a rank out of range: ignored).
        boots[2].report_unresponsive(&[1, 2, 9]);
        let stalled = DeadPeer { rank: 1, reported_by: Some(2) };
        for r in [0, 3] {
            wait_for(&format!("rank {r} hears of rank 1"), || {
                boots[r].dead_peers() == vec![stalled]
            });
        }
        // Rank 0 reports rank 3 (and rank 1 again: relayed once); rank 3 is told too, and keeps
        // waiting on its own peers, as rank 1 does.
        boots[0].report_unresponsive(&[3, 1]);
        let three = DeadPeer { rank: 3, reported_by: Some(0) };
        wait_for("rank 2 hears of rank 3", || boots[2].dead_peers() == vec![stalled, three]);
        assert_eq!(boots[0].dead_peers(), vec![stalled, three]);
        assert_eq!(boots[3].dead_peers(), vec![stalled]);
        assert_eq!(boots[1].dead_peers(), vec![three]);
    }

    #[test]
    fn misplaced_blob_is_caught() {
        let b = CallbackBootstrap::new(
            1,
            2,
            1,
            2,
            Box::new(|send, recv| {
                recv[..send.len()].copy_from_slice(send);
                Ok(())
            }),
        )
        .expect("new");
        assert!(matches!(b.all_gather(b"x"), Err(BootstrapError::Callback(_))));
    }
}
