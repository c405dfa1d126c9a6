//! Proxy in CI: a CPU producer stands in for the GPU; rings -> workers -> LoopbackTransport.

use std::sync::Arc;
use std::time::{Duration, Instant};

use fabric_ep::protocol::plan::ImmCodec;
use fabric_ep::proxy::{
    ArrivalWait, Command, CounterLayout, CounterMemory, FepCmd, LoopbackGroup, LoopbackOptions,
    LoopbackTransport, Proxy, ProxyConfig, ProxyError, RingLayout, RingMemory, Transport,
    TransportEvent, WriteOp,
};
use fabric_ep::util::SplitMix64;

const WAIT: Duration = Duration::from_secs(20);
const MAX_LEN: usize = 192;
const STRIDE: usize = 256;

fn config(rank: u32) -> ProxyConfig {
    // Short spin so 2 shared cores are not eaten by idle workers.
    ProxyConfig {
        rank,
        idle_spin: Duration::from_micros(20),
        idle_yield: Duration::from_micros(200),
        ..ProxyConfig::default()
    }
}

struct Shape {
    ranks: u32,
    rings: u32,
    workers: u32,
    capacity: u32,
    msgs: u32,
    opts: LoopbackOptions,
    /// Every worker drains every ring (ProxyConfig::stripe_rings).
    stripe: bool,
}

fn payload(src: u32, ring: u32, dst: u32, j: u32) -> Vec<u8> {
    let mut rng = SplitMix64(
        u64::from(src) << 48 | u64::from(ring) << 32 | u64::from(dst) << 16 | u64::from(j),
    );
    let len = rng.below(MAX_LEN as u64 + 1) as usize;
    (0..len).map(|_| rng.next_u64() as u8).collect()
}

/// Every rank's every ring sends `msgs` writes to every rank (itself included); slot = source rank,
/// value = length. Checks every byte, arrivals, sums and sends_completed.
fn all_to_all(s: &Shape) {
    let per_src = (s.rings * s.ranks * s.msgs) as usize * STRIDE;
    let group = LoopbackGroup::host(s.ranks, per_src, per_src * s.ranks as usize, s.opts).unwrap();
    let codec = ImmCodec::default();
    let mut proxies = Vec::new();
    let mut ring_mems = Vec::new();
    for r in 0..s.ranks {
        let rings = RingMemory::new_host(RingLayout::new(s.rings, s.capacity).unwrap()).unwrap();
        let counters =
            CounterMemory::new_host(CounterLayout { num_slots: s.ranks, num_rings: s.rings })
                .unwrap();
        let transports = (0..s.workers).map(|_| group.transport(r).unwrap()).collect();
        let cfg = ProxyConfig { stripe_rings: s.stripe, ..config(r) };
        proxies.push(Proxy::start(cfg, rings.clone(), counters, transports).unwrap());
        ring_mems.push(rings);
    }
    // Index of message (ring, dst, j) within a source rank.
    let (ranks, msgs) = (s.ranks, s.msgs);
    let index = move |ring: u32, dst: u32, j: u32| ((ring * ranks + dst) * msgs + j) as usize;
    let mut producers = Vec::new();
    for src in 0..s.ranks {
        for ring in 0..s.rings {
            let mut p = ring_mems[src as usize].producer(ring).unwrap();
            let send = group.send_region(src).unwrap().clone();
            producers.push(std::thread::spawn(move || {
                for j in 0..msgs {
                    for dst in 0..ranks {
                        let data = payload(src, ring, dst, j);
                        let k = index(ring, dst, j);
                        // SAFETY: each message owns its STRIDE bytes, written before it is pushed.
                        unsafe { send.write(k * STRIDE, &data).unwrap() };
                        let cmd = Command {
                            dst_rank: dst,
                            local_offset: (k * STRIDE) as u64,
                            remote_offset: (src as usize * per_src + k * STRIDE) as u64,
                            length: data.len() as u32,
                            imm: codec.encode(src, data.len() as u32).unwrap(),
                        };
                        p.push(&cmd, WAIT).unwrap();
                    }
                }
            }));
        }
    }
    for p in producers {
        p.join().unwrap();
    }
    for dst in 0..s.ranks {
        let proxy = &proxies[dst as usize];
        let waits: Vec<_> = (0..s.ranks)
            .map(|src| ArrivalWait { slot: src, expected: u64::from(s.rings * s.msgs), peer: src })
            .collect();
        proxy.wait_all(&waits, WAIT).unwrap();
        for ring in 0..s.rings {
            proxy.wait_sends(ring, u64::from(s.ranks * s.msgs), WAIT).unwrap();
        }
    }
    // Let any stray (duplicate) arrival land before checking exact counts.
    std::thread::sleep(Duration::from_millis(20));
    for dst in 0..s.ranks {
        let proxy = &proxies[dst as usize];
        let recv = group.recv_region(dst).unwrap();
        for src in 0..s.ranks {
            let mut sum = 0u64;
            for ring in 0..s.rings {
                for j in 0..s.msgs {
                    let want = payload(src, ring, dst, j);
                    sum += want.len() as u64;
                    let mut got = vec![0u8; STRIDE];
                    let off = src as usize * per_src + index(ring, dst, j) * STRIDE;
                    // SAFETY: all arrivals were counted; nothing writes any more.
                    unsafe { recv.read(off, &mut got).unwrap() };
                    assert_eq!(
                        &got[..want.len()],
                        &want[..],
                        "bytes {src}->{dst} ring {ring} msg {j}"
                    );
                    assert!(
                        got[want.len()..].iter().all(|&b| b == 0),
                        "overrun {src}->{dst} ring {ring} msg {j}"
                    );
                }
            }
            assert_eq!(
                proxy.counters().arrivals(src).unwrap(),
                u64::from(s.rings * s.msgs),
                "arrivals {src}->{dst}"
            );
            assert_eq!(proxy.counters().sums(src).unwrap(), sum, "sums {src}->{dst}");
        }
        for ring in 0..s.rings {
            assert_eq!(
                proxy.counters().sends_completed(ring).unwrap(),
                u64::from(s.ranks * s.msgs)
            );
            assert_eq!(proxy.rings().tail(ring).unwrap(), u64::from(s.ranks * s.msgs));
        }
    }
    for p in proxies {
        p.shutdown().unwrap();
    }
}

#[test]
fn all_to_all_every_byte_and_counter() {
    all_to_all(&Shape {
        ranks: 4,
        rings: 2,
        workers: 2,
        capacity: 64,
        msgs: 48,
        opts: LoopbackOptions::default(),
        stripe: false,
    });
}

#[test]
fn tiny_ring_producer_waits_and_nothing_is_overwritten() {
    // Capacity 1 and 2: the producer is almost always waiting; an overwrite would show as a seq
    // error or a wrong byte/count.
    for capacity in [1, 2] {
        all_to_all(&Shape {
            ranks: 2,
            rings: 2,
            workers: 1,
            capacity,
            msgs: 64,
            opts: LoopbackOptions::default(),
            stripe: false,
        });
    }
}

#[test]
fn injected_eagain_loses_nothing() {
    let opts =
        LoopbackOptions { eagain_every: 3, max_outstanding: 5, ..LoopbackOptions::default() };
    all_to_all(&Shape {
        ranks: 3,
        rings: 2,
        workers: 1,
        capacity: 8,
        msgs: 48,
        opts,
        stripe: false,
    });
}

#[test]
fn reordered_delivery_keeps_counters_right() {
    let opts = LoopbackOptions { reorder_seed: Some(7), ..LoopbackOptions::default() };
    all_to_all(&Shape {
        ranks: 3,
        rings: 2,
        workers: 2,
        capacity: 16,
        msgs: 48,
        opts,
        stripe: false,
    });
    let opts = LoopbackOptions { eagain_every: 2, reorder_seed: Some(11), max_outstanding: 3 };
    all_to_all(&Shape {
        ranks: 2,
        rings: 3,
        workers: 2,
        capacity: 4,
        msgs: 32,
        opts,
        stripe: false,
    });
}

#[test]
fn striped_rings_every_worker_drains_every_ring() {
    // One ring and three workers (the low-latency lane's shape), then two rings; tiny rings make
    // the producer wait on the tail the stripes publish together (an early tail would let it
    // overwrite an entry a stripe has not posted: a seq error or a wrong byte/count).
    for (rings, capacity) in [(1, 64), (1, 1), (1, 2), (2, 5)] {
        all_to_all(&Shape {
            ranks: 3,
            rings,
            workers: 3,
            capacity,
            msgs: 40,
            opts: LoopbackOptions::default(),
            stripe: true,
        });
    }
    let opts = LoopbackOptions { eagain_every: 3, reorder_seed: Some(5), max_outstanding: 4 };
    all_to_all(&Shape {
        ranks: 2,
        rings: 1,
        workers: 4,
        capacity: 8,
        msgs: 48,
        opts,
        stripe: true,
    });
}

/// One rank, one ring, one worker, over a loopback group of `ranks`.
fn single(
    ranks: u32,
    capacity: u32,
    opts: LoopbackOptions,
) -> (LoopbackGroup, RingMemory, CounterMemory) {
    let group = LoopbackGroup::host(ranks, 4096, 4096, opts).unwrap();
    let rings = RingMemory::new_host(RingLayout::new(1, capacity).unwrap()).unwrap();
    let counters = CounterMemory::new_host(CounterLayout { num_slots: 4, num_rings: 1 }).unwrap();
    (group, rings, counters)
}

fn cmd(dst_rank: u32, slot: u32, value: u32) -> Command {
    Command {
        dst_rank,
        local_offset: 0,
        remote_offset: 0,
        length: 8,
        imm: ImmCodec::default().encode(slot, value).unwrap(),
    }
}

fn worker_error(proxy: &Proxy) -> Arc<ProxyError> {
    let start = Instant::now();
    loop {
        if let Some(e) = proxy.error() {
            return e;
        }
        assert!(start.elapsed() < WAIT, "worker did not fail");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn full_ring_with_no_consumer_times_out_then_drains() {
    let (group, rings, counters) = single(1, 4, LoopbackOptions::default());
    let mut p = rings.producer(0).unwrap();
    for i in 0..4 {
        assert!(p.try_push(&cmd(0, 1, i)));
    }
    assert!(!p.try_push(&cmd(0, 1, 99)));
    let t = Instant::now();
    let err = p.push(&cmd(0, 1, 99), Duration::from_millis(30)).unwrap_err();
    assert!(t.elapsed() < Duration::from_secs(2));
    assert!(
        matches!(err, ProxyError::RingFull { ring: 0, capacity: 4, head: 4, tail: 0, .. }),
        "{err}"
    );
    assert_eq!(rings.head(0).unwrap(), 4);
    let proxy = Proxy::start(config(0), rings.clone(), counters, vec![group.transport(0).unwrap()])
        .unwrap();
    // 4 queued + 6 more through the 4-entry ring.
    for i in 4..10 {
        p.push(&cmd(0, 1, i), WAIT).unwrap();
    }
    assert_eq!(proxy.wait_arrivals(1, 10, WAIT).unwrap(), (0..10).sum::<u64>());
    proxy.shutdown().unwrap();
}

#[test]
fn corrupted_seq_is_a_typed_error() {
    let (group, rings, counters) = single(1, 16, LoopbackOptions::default());
    let proxy = Proxy::start(config(0), rings.clone(), counters, vec![group.transport(0).unwrap()])
        .unwrap();
    let mut p = rings.producer(0).unwrap();
    for i in 0..5 {
        p.push(&cmd(0, 2, i), WAIT).unwrap();
    }
    let good = cmd(0, 2, 5);
    assert!(p.stage_raw(&FepCmd {
        local_offset: 0,
        remote_offset: 0,
        length: 8,
        dst_rank: 0,
        imm: good.imm,
        seq: 77
    }));
    p.publish();
    let err = proxy.wait_arrivals(2, 6, WAIT).unwrap_err();
    match &err {
        ProxyError::WorkerFailed { worker, source } => {
            assert_eq!(worker, "fep-proxy-0-0");
            assert!(
                matches!(
                    **source,
                    ProxyError::BadSeq { rank: 0, ring: 0, ticket: 5, expected: 5, found: 77 }
                ),
                "{source}"
            );
        }
        e => panic!("unexpected {e}"),
    }
    let counters = proxy.counters().clone();
    assert!(matches!(proxy.shutdown(), Err(ProxyError::WorkerFailed { .. })));
    // The 5 good writes were posted before the bad entry; the worker's drain lands their counters.
    assert_eq!(counters.arrivals(2).unwrap(), 5);
    assert_eq!(counters.sends_completed(0).unwrap(), 5);
    assert_eq!(rings.tail(0).unwrap(), 5, "tail stops before the bad entry");
}

#[test]
fn bad_slot_names_the_immediate() {
    let (group, rings, counters) = single(1, 16, LoopbackOptions::default());
    let proxy = Proxy::start(config(0), rings.clone(), counters, vec![group.transport(0).unwrap()])
        .unwrap();
    let mut p = rings.producer(0).unwrap();
    let imm = ImmCodec::default().encode(4, 3).unwrap(); // 4 slots: 0..4
    p.push(&Command { imm, ..cmd(0, 0, 0) }, WAIT).unwrap();
    let e = worker_error(&proxy);
    assert!(
        matches!(*e, ProxyError::BadSlot { rank: 0, imm: i, slot: 4, num_slots: 4 } if i == imm),
        "{e}"
    );
    assert!(e.to_string().contains(&format!("{imm:#010x}")), "{e}");
}

#[test]
fn bad_destination_and_offsets_are_typed_errors() {
    type Check = fn(&ProxyError) -> bool;
    let cases: [(Command, Check); 3] = [
        (cmd(5, 0, 0), |e| {
            matches!(e, ProxyError::BadRank { dst_rank: 5, num_ranks: 2, ring: 0, .. })
        }),
        (Command { local_offset: 4090, ..cmd(1, 0, 0) }, |e| {
            matches!(e, ProxyError::OutOfBounds { peer: 1, offset: 4090, length: 8, .. })
        }),
        (Command { remote_offset: u64::MAX - 2, ..cmd(1, 0, 0) }, |e| {
            matches!(e, ProxyError::OutOfBounds { peer: 1, .. })
        }),
    ];
    for (c, check) in cases {
        let (group, rings, counters) = single(2, 16, LoopbackOptions::default());
        let proxy =
            Proxy::start(config(0), rings.clone(), counters, vec![group.transport(0).unwrap()])
                .unwrap();
        rings.producer(0).unwrap().push(&c, WAIT).unwrap();
        let e = worker_error(&proxy);
        assert!(check(&e), "{e}");
    }
}

#[test]
fn dead_peer_fails_sends_and_waits_name_it() {
    let (group, rings, counters) = single(3, 16, LoopbackOptions::default());
    let proxy = Proxy::start(config(0), rings.clone(), counters, vec![group.transport(0).unwrap()])
        .unwrap();
    // Rank 2 never writes to us: the wait names it, within the timeout.
    let t = Instant::now();
    let waits = [
        ArrivalWait { slot: 1, expected: 0, peer: 1 },
        ArrivalWait { slot: 2, expected: 3, peer: 2 },
    ];
    let err = proxy.wait_all(&waits, Duration::from_millis(100)).unwrap_err();
    assert!(t.elapsed() < Duration::from_secs(2));
    match err {
        ProxyError::ArrivalTimeout { rank: 0, lagging, .. } => {
            assert_eq!(lagging.len(), 1);
            assert_eq!(
                (lagging[0].peer, lagging[0].slot, lagging[0].expected, lagging[0].observed),
                (2, 2, 3, 0)
            );
        }
        e => panic!("unexpected {e}"),
    }
    // Writing to a peer that is gone: a typed error naming it, and later waits report it.
    group.set_alive(1, false).unwrap();
    rings.producer(0).unwrap().push(&cmd(1, 0, 0), WAIT).unwrap();
    let e = worker_error(&proxy);
    assert!(matches!(*e, ProxyError::PeerUnreachable { rank: 0, peer: 1, .. }), "{e}");
    assert!(matches!(proxy.wait_arrivals(0, 1, WAIT), Err(ProxyError::WorkerFailed { .. })));
}

#[test]
fn restart_and_drop_release_everything() {
    let (group, rings, counters) = single(1, 8, LoopbackOptions::default());
    let send = group.send_region(0).unwrap().clone();
    let base = Arc::strong_count(&send);
    let mut p = rings.producer(0).unwrap();
    let mut total = 0u64;
    for round in 0..20u32 {
        let proxy = Proxy::start(
            config(0),
            rings.clone(),
            counters.clone(),
            vec![group.transport(0).unwrap()],
        )
        .unwrap();
        assert!(matches!(
            Proxy::start(
                config(0),
                rings.clone(),
                counters.clone(),
                vec![group.transport(0).unwrap()]
            ),
            Err(ProxyError::RingClaimed { ring: 0, role: "consumer" })
        ));
        for i in 0..10 {
            p.push(&cmd(0, 3, i), WAIT).unwrap();
        }
        total += 10;
        proxy.wait_arrivals(3, total, WAIT).unwrap();
        if round % 2 == 0 {
            proxy.shutdown().unwrap();
        } else {
            drop(proxy);
        }
        assert_eq!(Arc::strong_count(&send), base, "round {round}: transports released");
    }
    assert_eq!(counters.arrivals(3).unwrap(), total);
    assert_eq!(counters.sends_completed(0).unwrap(), total);
    drop(group);
    assert_eq!(Arc::strong_count(&send), 1);
}

/// A transport that fails to start, starts slowly, or is backpressured forever, and notes its
/// thread's name.
struct Stubborn {
    fail_start: bool,
    start_delay: Duration,
    name: Arc<parking_lot::Mutex<Option<String>>>,
}

impl Transport for Stubborn {
    fn on_start(&mut self) -> Result<(), ProxyError> {
        *self.name.lock() = std::thread::current().name().map(str::to_string);
        std::thread::sleep(self.start_delay);
        if self.fail_start {
            return Err(ProxyError::Transport { rank: 3, msg: "no NIC".into() });
        }
        Ok(())
    }
    fn post_write(&mut self, _op: &WriteOp) -> Result<bool, ProxyError> {
        Ok(false)
    }
    fn poll(&mut self, _events: &mut Vec<TransportEvent>) -> Result<(), ProxyError> {
        Ok(())
    }
}

#[test]
fn start_handshake_names_threads_and_reports_start_errors() {
    let rings = RingMemory::new_host(RingLayout::new(2, 4).unwrap()).unwrap();
    let counters = CounterMemory::new_host(CounterLayout { num_slots: 1, num_rings: 2 }).unwrap();
    let names: Vec<_> = (0..2).map(|_| Arc::new(parking_lot::Mutex::new(None))).collect();
    let ts = vec![
        Stubborn { fail_start: false, start_delay: Duration::ZERO, name: names[0].clone() },
        Stubborn { fail_start: true, start_delay: Duration::ZERO, name: names[1].clone() },
    ];
    let err = Proxy::start(config(3), rings.clone(), counters.clone(), ts).unwrap_err();
    assert!(matches!(err, ProxyError::Transport { rank: 3, .. }), "{err}");
    assert_eq!(names[0].lock().as_deref(), Some("fep-proxy-3-0"));
    assert_eq!(names[1].lock().as_deref(), Some("fep-proxy-3-1"));
    // The failed start released its rings; a forever-backpressured transport still stops promptly
    // with a full ring (nothing dropped: tail stays put).
    let ts =
        vec![Stubborn { fail_start: false, start_delay: Duration::ZERO, name: names[0].clone() }];
    let proxy = Proxy::start(config(3), rings.clone(), counters.clone(), ts).unwrap();
    let mut p = rings.producer(1).unwrap();
    for i in 0..4 {
        p.push(&cmd(0, 0, i), WAIT).unwrap();
    }
    std::thread::sleep(Duration::from_millis(10));
    assert_eq!(rings.tail(1).unwrap(), 0);
    let t = Instant::now();
    proxy.shutdown().unwrap();
    assert!(t.elapsed() < Duration::from_secs(2));
    // Config checks.
    let bad = CounterMemory::new_host(CounterLayout { num_slots: 1, num_rings: 1 }).unwrap();
    let ts: Vec<LoopbackTransport> = Vec::new();
    assert!(matches!(
        Proxy::start(config(0), rings.clone(), counters, ts),
        Err(ProxyError::InvalidConfig { what: "transports", .. })
    ));
    let group = LoopbackGroup::host(1, 64, 64, LoopbackOptions::default()).unwrap();
    assert!(matches!(
        Proxy::start(config(0), rings, bad, vec![group.transport(0).unwrap()]),
        Err(ProxyError::InvalidConfig { what: "counters.num_rings", .. })
    ));
}

#[test]
fn a_worker_stuck_starting_is_a_start_timeout_not_a_hang() {
    let rings = RingMemory::new_host(RingLayout::new(1, 4).unwrap()).unwrap();
    let counters = CounterMemory::new_host(CounterLayout { num_slots: 1, num_rings: 1 }).unwrap();
    let name = Arc::new(parking_lot::Mutex::new(None));
    let slow = Stubborn { fail_start: false, start_delay: Duration::from_millis(500), name };
    let cfg = ProxyConfig { start_timeout: Duration::from_millis(50), ..config(4) };
    let t = Instant::now();
    let err = Proxy::start(cfg, rings, counters, vec![slow]).unwrap_err();
    assert!(t.elapsed() < Duration::from_millis(400), "start waited {:?}", t.elapsed());
    assert!(
        matches!(err, ProxyError::StartTimeout { ref worker, .. } if worker == "fep-proxy-4-0"),
        "{err}"
    );
}
