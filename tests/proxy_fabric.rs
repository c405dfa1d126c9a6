//! The proxy over libfabric, ranks as threads of one process (one endpoint each): every rank's
//! rings write into every rank (itself included); every byte and counter checked. Providers from
//! `FEP_TEST_PROVIDERS` (comma list), default shm, tcp;ofi_rxm, udp;ofi_rxd.

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use fabric_ep::proxy::ProxyError;
use parking_lot::Mutex;

mod common;
use common::proxy::{run_rank, Mode};

/// Threads as ranks: a barrier-based all-gather.
struct Gather {
    n: usize,
    slots: Mutex<Vec<Vec<u8>>>,
    barrier: Barrier,
}

impl Gather {
    fn new(n: usize) -> Arc<Self> {
        Arc::new(Gather { n, slots: Mutex::new(vec![Vec::new(); n]), barrier: Barrier::new(n) })
    }
    fn all_gather(&self, rank: usize, data: &[u8]) -> Vec<Vec<u8>> {
        self.slots.lock()[rank] = data.to_vec();
        self.barrier.wait();
        let out = self.slots.lock().clone();
        self.barrier.wait();
        assert_eq!(out.len(), self.n);
        out
    }
}

fn run_group(provider: &str, n: u32, mode: Mode) -> Vec<Result<(), ProxyError>> {
    let g = Gather::new(n as usize);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|rank| {
                let g = g.clone();
                s.spawn(move || {
                    run_rank(
                        provider,
                        rank,
                        n,
                        mode,
                        &|d: &[u8]| g.all_gather(rank as usize, d),
                        &|| {},
                    )
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn all_to_all_over_libfabric_2_and_4_ranks() {
    for provider in common::providers(common::ALL_PROVIDERS) {
        for n in [2, 4] {
            let t = Instant::now();
            for (rank, r) in run_group(&provider, n, Mode::All).into_iter().enumerate() {
                r.unwrap_or_else(|e| panic!("{provider} n={n} rank {rank}: {e}"));
            }
            eprintln!("{provider} n={n}: {:?}", t.elapsed());
        }
    }
}

#[test]
fn silent_peer_is_named_by_every_wait() {
    for provider in common::providers(common::ALL_PROVIDERS) {
        let t = Instant::now();
        let results = run_group(&provider, 3, Mode::Silent(2));
        assert!(t.elapsed() < Duration::from_secs(20), "{provider}: {:?}", t.elapsed());
        for (rank, r) in results.into_iter().enumerate().take(2) {
            match r {
                Err(ProxyError::ArrivalTimeout { rank: r, lagging, .. }) => {
                    assert_eq!(r as usize, rank);
                    assert_eq!(lagging.len(), 1, "{provider}: {lagging:?}");
                    assert_eq!((lagging[0].peer, lagging[0].observed), (2, 0), "{provider}");
                }
                other => panic!(
                    "{provider} rank {rank}: expected a timeout naming rank 2, got {other:?}"
                ),
            }
        }
    }
}
