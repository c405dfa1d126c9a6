//! The proxy over libfabric between processes: this test binary re-executes itself as the ranks
//! (`LocalJob` + `TcpStore`, the path a torchrun job takes). Every rank's rings write into every
//! rank; all bytes and counters checked; a rank killed mid-run is named by the others' waits.
//! Providers from `FEP_TEST_PROVIDERS` (comma list), default shm, tcp;ofi_rxm, udp;ofi_rxd.

use std::time::{Duration, Instant};

use fabric_ep::bootstrap::{Bootstrap, RankOutcome, TcpStore};
use fabric_ep::proxy::ProxyError;

mod common;
use common::proxy::{run_rank, Mode, RINGS};

const ROLE: &str = "FEP_PROXY_TEST_ROLE";
const CHILD_OK: &str = "CHILD_OK";
const JOB_WALL: Duration = Duration::from_secs(40);

/// The body of a rank process (`FEP_PROXY_TEST_ROLE=provider|mode`, mode `all` or `dies:<rank>`).
/// Prints `CHILD_OK` only when its expectation held; a normal `cargo test` run returns at once.
#[test]
fn child_rank() {
    let Ok(role) = std::env::var(ROLE) else { return };
    let (provider, mode) = role.split_once('|').expect("role");
    let store = TcpStore::from_env(Duration::from_secs(20)).expect("join the store");
    let (rank, n) = (store.rank() as u32, store.world_size() as u32);
    let mode = match mode.split_once(':') {
        Some(("dies", r)) => Mode::Dies(r.parse().expect("rank")),
        _ => Mode::All,
    };
    let gather = |d: &[u8]| store.all_gather(d).expect("all_gather");
    // SIGKILL: no destructor, no flush, no goodbye, exactly like a crashed or OOM-killed rank.
    // SAFETY: kill(2) on our own pid.
    let die = || unsafe {
        libc::kill(libc::getpid(), libc::SIGKILL);
    };
    let t = Instant::now();
    let result = run_rank(provider, rank, n, mode, &gather, &die);
    match (mode, result) {
        (Mode::All, Ok(())) => {}
        (Mode::Dies(dead), Err(e)) => {
            // Either the wait ran out naming the dead rank, or the transport noticed it first.
            let named = match &e {
                ProxyError::ArrivalTimeout { lagging, .. } => {
                    lagging.len() == 1
                        && lagging[0].peer == dead
                        && lagging[0].observed < u64::from(RINGS * common::proxy::MSGS)
                }
                ProxyError::WorkerFailed { source, .. } => matches!(
                    **source,
                    ProxyError::Fabric { peer: Some(p), .. } | ProxyError::PeerUnreachable { peer: p, .. }
                        if p == dead
                ),
                _ => false,
            };
            assert!(named, "rank {rank}: error does not name rank {dead}: {e}");
            assert!(t.elapsed() < Duration::from_secs(15), "rank {rank}: took {:?}", t.elapsed());
            println!("rank {rank} saw: {e}");
        }
        (mode, r) => panic!("rank {rank} in {mode:?}: unexpected {r:?}"),
    }
    println!("{CHILD_OK}");
}

fn run_job(provider: &str, n: usize, mode: &str) -> Vec<RankOutcome> {
    common::run_child_ranks(n, &[(ROLE.to_string(), format!("{provider}|{mode}"))], JOB_WALL)
}

/// `FEP_TEST_SHOW=1` prints every rank's output even when the test passes.
fn assert_ok(provider: &str, out: &[RankOutcome], ranks: impl IntoIterator<Item = usize>) {
    if std::env::var_os("FEP_TEST_SHOW").is_some() {
        eprintln!("{provider}:\n{}", out.iter().map(|o| o.to_string()).collect::<String>());
    }
    for r in ranks {
        let o = &out[r];
        assert!(
            o.success() && o.stdout.contains(CHILD_OK),
            "{provider}: rank {r} failed:\n{}",
            out.iter().map(|o| o.to_string()).collect::<String>()
        );
    }
}

#[test]
fn all_to_all_between_processes_2_and_4_ranks() {
    for provider in common::providers(common::ALL_PROVIDERS) {
        for n in [2, 4] {
            let t = Instant::now();
            let out = run_job(&provider, n, "all");
            assert_ok(&provider, &out, 0..n);
            eprintln!("{provider} n={n}: {:?}", t.elapsed());
        }
    }
}

#[test]
fn killed_rank_is_named_by_every_other_rank() {
    for provider in common::providers(common::ALL_PROVIDERS) {
        let n = 3;
        let t = Instant::now();
        let out = run_job(&provider, n, &format!("dies:{}", n - 1));
        assert_ok(&provider, &out, 0..n - 1);
        assert!(!out[n - 1].success(), "{provider}: the killed rank exited cleanly");
        eprintln!("{provider} killed rank: {:?}", t.elapsed());
    }
}
