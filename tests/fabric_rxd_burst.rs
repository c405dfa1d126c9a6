//! Bursts of RMA writes with immediate data over `udp;ofi_rxd` between processes (this binary
//! re-executes itself as the ranks), every byte and count checked.
//!
//! The regression: with rxd's window raised (`FI_OFI_RXD_MAX_UNACKED`), one endpoint's burst of
//! packets filled the completion queue of its udp endpoint, which libfabric's udp provider before
//! 2.4 then overran on the next receive: target-side FI_ETRUNC completions ("len 20432"), rxd's
//! "Cannot process packet", lost completions. The proxy's libfabric transport bounds the packets
//! it keeps in flight on rxd (`Info::burst_limit`); `FEP_RXD_MAX_PACKETS=0` turns that off and
//! brings the failure back within seconds (what this test was checked against).

use std::sync::Arc;
use std::time::{Duration, Instant};

use fabric_ep::bootstrap::{Bootstrap, RankOutcome, TcpStore};
use fabric_ep::fabric::{InfoQuery, MemKind, RemoteRegion, Stack};
use fabric_ep::protocol::plan::ImmCodec;
use fabric_ep::proxy::{
    ArrivalWait, Command, CounterLayout, CounterMemory, FabricPeer, FabricTransport, Proxy,
    ProxyConfig, RingLayout, RingMemory, SharedRegion,
};
use fabric_ep::util::SplitMix64;

mod common;

const ROLE: &str = "FEP_RXD_BURST_ROLE";
const CHILD_OK: &str = "CHILD_OK";
const PROVIDER: &str = "udp;ofi_rxd";
const RANKS: usize = 4;
/// Rounds of messages; in each, messages from each rank to each rank (itself included), and the
/// largest one.
const ROUNDS: u32 = 3;
const MSGS: u32 = 128;
const MAX_LEN: usize = 32 << 10;
/// Immediate bits for the value (the message's length), the rest name the slot (its source).
const VALUE_BITS: u32 = 20;
const WAIT: Duration = Duration::from_secs(10);
const JOB_WALL: Duration = Duration::from_secs(40);

fn len_of(round: u32, src: u32, dst: u32, j: u32) -> usize {
    let mut rng = SplitMix64(
        u64::from(round) << 60 | u64::from(src) << 40 | u64::from(dst) << 20 | u64::from(j),
    );
    // Every fourth message empty (a count alone), the others up to MAX_LEN.
    if j % 4 == 0 {
        0
    } else {
        rng.below(MAX_LEN as u64 + 1) as usize
    }
}

fn byte(round: u32, src: u32, dst: u32, j: u32, i: usize) -> u8 {
    (round as usize * 17 + src as usize * 131 + dst as usize * 31 + j as usize * 7 + i) as u8
}

/// The body of a rank process; prints `CHILD_OK` when every check held. A plain `cargo test`
/// run returns at once.
#[test]
fn child_rank() {
    if std::env::var_os(ROLE).is_none() {
        return;
    }
    let store = TcpStore::from_env(WAIT).expect("join the store");
    let (rank, n) = (store.rank() as u32, store.world_size() as u32);
    let gather = |d: &[u8]| store.all_gather(d).expect("all_gather");
    let stack = Stack::open(&InfoQuery::provider(PROVIDER), n as usize).expect("open");
    let addrs = stack.connect(&gather(&stack.ep.name().expect("name"))).expect("connect");
    let slot = MAX_LEN;
    let per_src = n as usize * MSGS as usize * slot;
    let send = SharedRegion::alloc_host(per_src).expect("send region");
    let recv = SharedRegion::alloc_host(per_src * n as usize).expect("recv region");
    // SAFETY: both regions outlive their registrations (dropped after the proxy and them).
    let smr =
        Arc::new(unsafe { stack.register(send.as_ptr(), send.len(), MemKind::Host) }.unwrap());
    let rmr = unsafe { stack.register(recv.as_ptr(), recv.len(), MemKind::Host) }.unwrap();
    let peers = gather(&rmr.remote().to_bytes())
        .iter()
        .zip(&addrs)
        .map(|(b, &addr)| Some(FabricPeer { addr, recv: RemoteRegion::from_bytes(b).unwrap() }))
        .collect();
    let transport = FabricTransport::new(rank, stack.ep.clone(), smr, peers).expect("transport");
    let rings = RingMemory::new_host(RingLayout::new(1, 1024).unwrap()).unwrap();
    let counters = CounterMemory::new_host(CounterLayout { num_slots: n, num_rings: 1 }).unwrap();
    let proxy = Proxy::start(
        ProxyConfig { rank, value_bits: VALUE_BITS, ..ProxyConfig::default() },
        rings.clone(),
        counters,
        vec![transport],
    )
    .expect("proxy");
    let codec = ImmCodec::new(VALUE_BITS).expect("codec");
    // The ring holds every message of a round: each round goes out as one burst.
    let mut producer = rings.producer(0).expect("producer");
    let mut sums = vec![0u64; n as usize];
    for round in 0..ROUNDS {
        for j in 0..MSGS {
            for dst in 0..n {
                let k = (dst * MSGS + j) as usize;
                let len = len_of(round, rank, dst, j);
                let data: Vec<u8> = (0..len).map(|i| byte(round, rank, dst, j, i)).collect();
                // SAFETY: each message owns its slot; the previous round's write from it
                // completed (wait_sends below) before this one is staged.
                unsafe { send.write(k * slot, &data).unwrap() };
                let at = rank as usize * per_src + (rank * MSGS + j) as usize * slot;
                let cmd = Command {
                    dst_rank: dst,
                    local_offset: (k * slot) as u64,
                    remote_offset: at as u64,
                    length: len as u32,
                    imm: codec.encode(rank, len as u32).unwrap(),
                };
                producer.push(&cmd, WAIT).unwrap_or_else(|e| panic!("rank {rank}: push: {e}"));
            }
        }
        let arrived = u64::from(MSGS * (round + 1));
        let waits: Vec<_> =
            (0..n).map(|src| ArrivalWait { slot: src, expected: arrived, peer: src }).collect();
        let t = Instant::now();
        proxy.wait_all(&waits, WAIT).unwrap_or_else(|e| panic!("rank {rank} round {round}: {e}"));
        let sent = u64::from(n * MSGS * (round + 1));
        proxy.wait_sends(0, sent, WAIT).unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        for src in 0..n {
            for j in 0..MSGS {
                let len = len_of(round, src, rank, j);
                sums[src as usize] += len as u64;
                let mut got = vec![0u8; len];
                let off = src as usize * per_src + (src * MSGS + j) as usize * slot;
                // SAFETY: every arrival from src is counted; src writes there again only after
                // the barrier below.
                unsafe { recv.read(off, &mut got).unwrap() };
                let bad =
                    got.iter().enumerate().position(|(i, &b)| b != byte(round, src, rank, j, i));
                assert!(
                    bad.is_none(),
                    "rank {rank} round {round}: message {j} from {src}: byte {bad:?} differs"
                );
            }
            assert_eq!(
                proxy.counters().sums(src).unwrap(),
                sums[src as usize],
                "rank {rank}: sums"
            );
            assert_eq!(proxy.counters().arrivals(src).unwrap(), arrived, "rank {rank}: arrivals");
        }
        eprintln!("rank {rank} round {round}: all arrived in {:?}", t.elapsed());
        // Every rank checked this round before anyone overwrites it.
        gather(b"checked");
    }
    // Nobody tears down its endpoint while a peer may still need it for progress.
    gather(b"done");
    proxy.shutdown().unwrap_or_else(|e| panic!("rank {rank}: shutdown: {e}"));
    drop(rmr);
    println!("{CHILD_OK}");
}

fn run_job(extra: &[(&str, &str)]) -> Vec<RankOutcome> {
    let mut env = vec![(ROLE.to_string(), "1".to_string())];
    env.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    common::run_child_ranks(RANKS, &env, JOB_WALL)
}

/// rxd's window at 1024 packets per peer: without the transport's bound one endpoint's burst is
/// far more than its udp completion queue (2048 entries) holds.
#[test]
fn rxd_bursts_with_a_wide_window_arrive_whole() {
    let t = Instant::now();
    let out = run_job(&[("FI_OFI_RXD_MAX_UNACKED", "1024")]);
    let all = || out.iter().map(|o| o.to_string()).collect::<String>();
    for (r, o) in out.iter().enumerate() {
        assert!(o.success() && o.stdout.contains(CHILD_OK), "rank {r} failed:\n{}", all());
        assert!(!o.stderr.contains("Cannot process packet"), "rank {r}: rxd garbled:\n{}", all());
    }
    eprintln!("{PROVIDER}: {RANKS} ranks x {MSGS} messages to each: {:?}", t.elapsed());
}
