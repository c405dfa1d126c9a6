//! The proxy over libfabric, ranks as threads of one process (one endpoint each): every rank's
//! rings write into every rank (itself included); every byte and counter checked. Providers from
//! `FEP_TEST_PROVIDERS` (comma list), default shm, tcp;ofi_rxm, udp;ofi_rxd.

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use fabric_ep::fabric::{InfoQuery, MemKind, RemoteRegion, Stack};
use fabric_ep::proxy::{
    ArrivalWait, Command, CounterLayout, CounterMemory, FabricPeer, FabricTransport, ImmCodec,
    Proxy, ProxyConfig, ProxyError, RingLayout, RingMemory, SharedRegion,
};
use fabric_ep::util::SplitMix64;
use parking_lot::Mutex;

const RINGS: u32 = 2;
const MSGS: u32 = 12;
const STRIDE: usize = 4096;
const WAIT: Duration = Duration::from_secs(30);

fn providers() -> Vec<String> {
    std::env::var("FEP_TEST_PROVIDERS")
        .map(|v| v.split(',').map(str::to_string).collect())
        .unwrap_or_else(|_| vec!["shm".into(), "tcp;ofi_rxm".into(), "udp;ofi_rxd".into()])
}

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

fn payload(src: u32, ring: u32, dst: u32, j: u32) -> Vec<u8> {
    let mut rng = SplitMix64(
        u64::from(src) << 48 | u64::from(ring) << 32 | u64::from(dst) << 16 | u64::from(j),
    );
    // Some count-only (empty) messages, some up to a page.
    let len = if j % 5 == 0 { 0 } else { rng.below(STRIDE as u64 + 1) as usize };
    (0..len).map(|_| rng.next_u64() as u8).collect()
}

/// Index of message (ring, dst, j) among one source rank's messages.
fn index(n: u32, ring: u32, dst: u32, j: u32) -> usize {
    ((ring * n + dst) * MSGS + j) as usize
}

/// One rank's whole life. `silent`: this rank connects but never writes and leaves early (the
/// others' waits must then fail naming it). Returns the rank's wait error, if any.
fn run_rank(
    provider: &str,
    rank: u32,
    n: u32,
    silent: Option<u32>,
    gather: &dyn Fn(&[u8]) -> Vec<Vec<u8>>,
) -> Result<(), ProxyError> {
    let ctx = |what: &str| format!("{provider} rank {rank}: {what}");
    let stack = Stack::open(&InfoQuery::provider(provider), n as usize)
        .unwrap_or_else(|e| panic!("{}: {e}", ctx("open")));
    let names = gather(&stack.ep.name().unwrap_or_else(|e| panic!("{}: {e}", ctx("name"))));
    let addrs = stack.connect(&names).unwrap_or_else(|e| panic!("{}: {e}", ctx("connect")));
    let per_src = (RINGS * n * MSGS) as usize * STRIDE;
    let send = SharedRegion::alloc_host(per_src).unwrap();
    let recv = SharedRegion::alloc_host(per_src * n as usize).unwrap();
    // SAFETY: both regions outlive their registrations (dropped at the end of this function,
    // after the proxy and the registrations).
    let smr =
        Arc::new(unsafe { stack.register(send.as_ptr(), send.len(), MemKind::Host) }.unwrap());
    let rmr = unsafe { stack.register(recv.as_ptr(), recv.len(), MemKind::Host) }.unwrap();
    let remotes = gather(&rmr.remote().to_bytes());
    let peers = remotes
        .iter()
        .zip(&addrs)
        .map(|(b, &addr)| Some(FabricPeer { addr, recv: RemoteRegion::from_bytes(b).unwrap() }))
        .collect();
    let transport = FabricTransport::new(rank, stack.ep.clone(), smr, peers).unwrap();
    let rings = RingMemory::new_host(RingLayout::new(RINGS, 16).unwrap()).unwrap();
    let counters =
        CounterMemory::new_host(CounterLayout { num_slots: n, num_rings: RINGS }).unwrap();
    let config = ProxyConfig {
        rank,
        idle_spin: Duration::from_micros(20),
        idle_yield: Duration::from_micros(500),
        ..ProxyConfig::default()
    };
    let proxy = Proxy::start(config, rings.clone(), counters, vec![transport]).unwrap();
    gather(b"started");
    if silent == Some(rank) {
        proxy.shutdown().unwrap_or_else(|e| panic!("{}: {e}", ctx("shutdown")));
        drop(rmr);
        gather(b"done");
        return Ok(());
    }
    let codec = ImmCodec::default();
    let mut producers: Vec<_> = (0..RINGS).map(|r| rings.producer(r).unwrap()).collect();
    for j in 0..MSGS {
        for dst in 0..n {
            if silent == Some(dst) {
                continue;
            }
            for (ring, p) in producers.iter_mut().enumerate() {
                let ring = ring as u32;
                let data = payload(rank, ring, dst, j);
                let k = index(n, ring, dst, j);
                // SAFETY: each message owns its STRIDE bytes, written once before its push.
                unsafe { send.write(k * STRIDE, &data).unwrap() };
                let cmd = Command {
                    dst_rank: dst,
                    local_offset: (k * STRIDE) as u64,
                    remote_offset: (rank as usize * per_src + k * STRIDE) as u64,
                    length: data.len() as u32,
                    imm: codec.encode(rank, data.len() as u32).unwrap(),
                };
                p.push(&cmd, WAIT).unwrap();
            }
        }
    }
    let waits: Vec<_> = (0..n)
        .map(|src| ArrivalWait { slot: src, expected: u64::from(RINGS * MSGS), peer: src })
        .collect();
    let timeout = if silent.is_some() { Duration::from_secs(2) } else { WAIT };
    let waited = proxy.wait_all(&waits, timeout);
    let sends = u64::from((n - u32::from(silent.is_some())) * MSGS);
    for ring in 0..RINGS {
        proxy.wait_sends(ring, sends, WAIT).unwrap_or_else(|e| panic!("{}: {e}", ctx("sends")));
    }
    if waited.is_ok() {
        for src in 0..n {
            let mut sum = 0;
            for ring in 0..RINGS {
                for j in 0..MSGS {
                    let want = payload(src, ring, rank, j);
                    sum += want.len() as u64;
                    let mut got = vec![0u8; want.len()];
                    let off = src as usize * per_src + index(n, ring, rank, j) * STRIDE;
                    // SAFETY: every arrival from src is counted; nothing writes there any more.
                    unsafe { recv.read(off, &mut got).unwrap() };
                    assert!(
                        got == want,
                        "{}",
                        ctx(&format!("bytes from {src} ring {ring} msg {j}"))
                    );
                }
            }
            assert_eq!(proxy.counters().sums(src).unwrap(), sum, "{}", ctx("sums"));
            assert_eq!(proxy.counters().arrivals(src).unwrap(), u64::from(RINGS * MSGS));
        }
    }
    // Nobody tears down its endpoint while a peer may still need it for progress.
    gather(b"done");
    proxy.shutdown().unwrap_or_else(|e| panic!("{}: {e}", ctx("shutdown")));
    drop(rmr);
    waited
}

fn run_group(provider: &str, n: u32, silent: Option<u32>) -> Vec<Result<(), ProxyError>> {
    let g = Gather::new(n as usize);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|rank| {
                let g = g.clone();
                s.spawn(move || {
                    run_rank(provider, rank, n, silent, &|d: &[u8]| g.all_gather(rank as usize, d))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn all_to_all_over_libfabric_2_and_4_ranks() {
    for provider in providers() {
        for n in [2, 4] {
            let t = Instant::now();
            for (rank, r) in run_group(&provider, n, None).into_iter().enumerate() {
                r.unwrap_or_else(|e| panic!("{provider} n={n} rank {rank}: {e}"));
            }
            eprintln!("{provider} n={n}: {:?}", t.elapsed());
        }
    }
}

#[test]
fn silent_peer_is_named_by_every_wait() {
    for provider in providers() {
        let t = Instant::now();
        let results = run_group(&provider, 3, Some(2));
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
