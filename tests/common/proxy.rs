//! Shared by the proxy-over-libfabric tests (threads as ranks, and processes as ranks): one
//! rank's whole life, producing into its rings writes for every rank and checking what arrives.

use std::sync::Arc;
use std::time::Duration;

use fabric_ep::fabric::{InfoQuery, MemKind, RemoteRegion, Stack};
use fabric_ep::protocol::plan::ImmCodec;
use fabric_ep::proxy::{
    ArrivalWait, Command, CounterLayout, CounterMemory, FabricPeer, FabricTransport, Proxy,
    ProxyConfig, ProxyError, RingLayout, RingMemory, SharedRegion,
};
use fabric_ep::util::SplitMix64;

/// Which rank, if any, fails to take part.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Everyone writes to everyone.
    All,
    /// This rank connects, never writes, and shuts down cleanly.
    Silent(u32),
    /// This rank writes half its messages, then `die` ends it (a process abort).
    Dies(u32),
}

impl Mode {
    fn absent(self) -> Option<u32> {
        match self {
            Mode::All => None,
            Mode::Silent(r) | Mode::Dies(r) => Some(r),
        }
    }
}

/// How long survivors wait for a rank that is absent.
pub const ABSENT_WAIT: Duration = Duration::from_secs(2);
pub const RINGS: u32 = 2;
pub const MSGS: u32 = 12;
pub const STRIDE: usize = 4096;
pub const WAIT: Duration = Duration::from_secs(30);

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

/// One rank's whole life: connect, start a proxy, write every message to every rank present
/// (itself included), wait for what it should receive and check every byte, arrival and sum.
/// With an absent rank (`mode`), the others skip it and their wait must fail naming it. Returns
/// that wait's result. `die` ends this process (only called for `Mode::Dies(rank)`).
pub fn run_rank(
    provider: &str,
    rank: u32,
    n: u32,
    mode: Mode,
    gather: &dyn Fn(&[u8]) -> Vec<Vec<u8>>,
    die: &dyn Fn(),
) -> Result<(), ProxyError> {
    let silent = mode.absent();
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
    if mode == Mode::Silent(rank) {
        proxy.shutdown().unwrap_or_else(|e| panic!("{}: {e}", ctx("shutdown")));
        drop(rmr);
        gather(b"done");
        return Ok(());
    }
    let codec = ImmCodec::default();
    let mut producers: Vec<_> = (0..RINGS).map(|r| rings.producer(r).unwrap()).collect();
    for j in 0..MSGS {
        if mode == Mode::Dies(rank) && j == MSGS / 2 {
            // Let what was posted leave, then die mid-protocol, as a crashed rank does.
            for ring in 0..RINGS {
                proxy.wait_sends(ring, u64::from((n - 1) * j), WAIT).unwrap();
            }
            die();
        }
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
    let timeout = if silent.is_some() { ABSENT_WAIT } else { WAIT };
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
    // Nobody tears down its endpoint while a peer may still need it for progress (a dead rank
    // cannot take part: survivors just leave).
    if !matches!(mode, Mode::Dies(_)) {
        gather(b"done");
    }
    proxy.shutdown().unwrap_or_else(|e| panic!("{}: {e}", ctx("shutdown")));
    drop(rmr);
    waited
}
