//! Proxy throughput and wake-up latency through one worker thread to the loopback transport.
//!
//! `cargo bench --bench proxy` (release). Throughput counts commands: ring read + seq check +
//! loopback post (bounds checks, copy of `length` bytes, arrival queued) + poll + arrival and
//! send-completion counters published. Target: >= 10 M commands/s.

use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput};
use ep_bench::stats::percentile;
use fabric_ep::protocol::plan::ImmCodec;
use fabric_ep::proxy::{
    Command, CounterLayout, CounterMemory, LoopbackGroup, LoopbackOptions, Proxy, ProxyConfig,
    RingLayout, RingMemory, RingProducer,
};

const CAPACITY: u32 = 1 << 16;
const SLOTS: u32 = 64;

struct Setup {
    proxy: Proxy,
    producer: RingProducer,
    counters: CounterMemory,
    cmds: Vec<Command>,
    sent: u64,
}

fn setup(length: u32, config: ProxyConfig) -> Setup {
    let group = LoopbackGroup::host(1, 1 << 20, 1 << 20, LoopbackOptions::default()).unwrap();
    let rings = RingMemory::new_host(RingLayout::new(1, CAPACITY).unwrap()).unwrap();
    let counters =
        CounterMemory::new_host(CounterLayout { num_slots: SLOTS, num_rings: 1 }).unwrap();
    let proxy =
        Proxy::start(config, rings.clone(), counters.clone(), vec![group.transport(0).unwrap()])
            .unwrap();
    let codec = ImmCodec::default();
    let cmds = (0..1024u32)
        .map(|i| Command {
            dst_rank: 0,
            local_offset: u64::from(i % 256) * 4096,
            remote_offset: u64::from(i % 256) * 4096,
            length,
            imm: codec.encode(i % SLOTS, 1).unwrap(),
        })
        .collect();
    Setup { proxy, producer: rings.producer(0).unwrap(), counters, cmds, sent: 0 }
}

/// Spins (yielding) until the ring's sends and every slot's arrivals reach `sent`.
fn wait_done(s: &Setup) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while s.counters.sends_completed(0).unwrap() < s.sent {
        assert!(Instant::now() < deadline, "proxy stalled: {:?}", s.proxy.check());
        std::thread::yield_now();
    }
    let per_slot = s.sent / u64::from(SLOTS);
    for slot in 0..SLOTS {
        while s.counters.arrivals(slot).unwrap() < per_slot {
            assert!(Instant::now() < deadline, "arrivals stalled");
            std::thread::yield_now();
        }
    }
}

/// Worker alone: the ring is filled (unpublished) outside the timer, then one head store hands
/// the batch to the worker and the timer runs until every counter has landed.
fn worker_only(s: &mut Setup, iters: u64) -> Duration {
    let mut total = Duration::ZERO;
    let mut left = iters;
    while left > 0 {
        // Whole multiples of SLOTS so every slot's expected count is exact.
        let n = left.min(u64::from(CAPACITY)).div_ceil(u64::from(SLOTS)) * u64::from(SLOTS);
        for i in 0..n {
            assert!(s.producer.stage(&s.cmds[(i % 1024) as usize]));
        }
        s.sent += n;
        let t = Instant::now();
        s.producer.publish();
        wait_done(s);
        total += t.elapsed();
        left = left.saturating_sub(n);
    }
    total
}

/// Producer and worker concurrently: the producer stages and publishes 256 at a time.
fn with_producer(s: &mut Setup, iters: u64) -> Duration {
    let n = iters.div_ceil(u64::from(SLOTS)) * u64::from(SLOTS);
    let t = Instant::now();
    let mut i = 0u64;
    while i < n {
        let mut staged = 0;
        while staged < 256 && i < n && s.producer.stage(&s.cmds[(i % 1024) as usize]) {
            staged += 1;
            i += 1;
        }
        s.producer.publish();
        if staged == 0 {
            std::hint::spin_loop();
        }
    }
    s.sent += n;
    wait_done(s);
    t.elapsed()
}

fn throughput(c: &mut Criterion) {
    let mut g = c.benchmark_group("proxy_loopback");
    g.throughput(Throughput::Elements(1));
    g.measurement_time(Duration::from_secs(3));
    for length in [0u32, 64] {
        let mut s = setup(length, ProxyConfig::default());
        g.bench_function(BenchmarkId::new("worker_only", format!("{length}B")), |b| {
            b.iter_custom(|iters| worker_only(&mut s, iters))
        });
        g.bench_function(BenchmarkId::new("with_producer", format!("{length}B")), |b| {
            b.iter_custom(|iters| with_producer(&mut s, iters))
        });
        s.proxy.shutdown().unwrap();
    }
    g.finish();
}

/// Push one command after an idle gap, time until its arrival counter moves; the gap puts the
/// worker in a given idle regime (spin < `idle_spin` <= yield < `idle_yield` <= sleep). Printed as
/// p50/p90 over the samples (criterion's mean hides the tail that scheduling adds).
fn wake_latency() {
    let always_spin = ProxyConfig { idle_spin: Duration::MAX, ..ProxyConfig::default() };
    let cases = [
        ("always_spin, gap 5ms", always_spin, Duration::from_millis(5), 100),
        ("default, gap 20us (spinning)", ProxyConfig::default(), Duration::from_micros(20), 400),
        ("default, gap 1ms (yielding)", ProxyConfig::default(), Duration::from_millis(1), 200),
        ("default, gap 5ms (sleeping)", ProxyConfig::default(), Duration::from_millis(5), 100),
    ];
    println!("proxy_wake_latency: push -> arrival counter, one worker, loopback");
    for (name, config, gap, samples) in cases {
        let mut s = setup(0, config);
        let lat: Vec<Duration> = (0..samples)
            .map(|_| {
                let t = Instant::now();
                while t.elapsed() < gap {
                    std::hint::spin_loop();
                }
                let before = s.counters.arrivals(0).unwrap();
                let t = Instant::now();
                assert!(s.producer.try_push(&s.cmds[0]));
                while s.counters.arrivals(0).unwrap() == before {
                    std::hint::spin_loop();
                }
                t.elapsed()
            })
            .collect();
        let secs: Vec<f64> = lat.iter().map(Duration::as_secs_f64).collect();
        let p = |q: f64| Duration::from_secs_f64(percentile(&secs, q));
        println!("  {name:32} p50 {:>10.2?}  p90 {:>10.2?}", p(50.0), p(90.0));
        s.proxy.shutdown().unwrap();
    }
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    throughput(&mut c);
    c.final_summary();
    wake_latency();
}
