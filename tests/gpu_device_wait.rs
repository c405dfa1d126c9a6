//! GPU: bounded device waits (on a counter, and on a packed counter word's wrapping high half)
//! and the proxy ring push (kernels/include/fep_device.cuh), with the CPU standing in for the
//! proxy. Ignored without `--include-ignored`; scripts/gpu-check.sh runs
//! them.

mod common;
use common::gpu::gpu;
use fabric_ep::abi::{self, fep_cmd, fep_ring_push_test_params, fep_wait_test_params};
use fabric_ep::cuda::{launch, CudaError, DevErrorRecord, HostMapped, Stream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// About 1 ms at H200 clocks (1.98 GHz boost; less when idle-clocked, so longer in time).
const SMALL_BUDGET: u64 = 2_000_000;

#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh runs it"]
fn gpu_wait_timeout_is_a_typed_error_naming_rank_phase_peer() {
    let Some(dev) = gpu() else { return };
    let stream = Stream::new(&dev).unwrap();
    let counter = HostMapped::new(&dev, 8).unwrap(); // nobody ever writes it
    let err = DevErrorRecord::new(&dev).unwrap();
    let p = fep_wait_test_params {
        counter: counter.device_ptr(),
        dev_error: err.as_abi(),
        expected: 1,
        budget_cycles: SMALL_BUDGET,
        rank: 3,
        phase: 7,
        peer: 5,
        _pad: 0,
    };
    let t = Instant::now();
    // SAFETY: counter and err outlive the synchronisation.
    unsafe { launch::wait_test(&stream, p) }.unwrap();
    stream.synchronize_within(Duration::from_secs(10)).expect("the kernel must give up, not hang");
    let took = t.elapsed();
    match err.check() {
        Err(e @ CudaError::Device { .. }) => {
            let CudaError::Device { what, rank, phase, peer, expected, observed, .. } = &e else {
                unreachable!()
            };
            assert_eq!(
                (*what, *rank, *phase, *peer, *expected, *observed),
                ("WAIT_TIMEOUT", 3, 7, Some(5), 1, 0)
            );
            eprintln!("timeout path: {e} (after {took:?})");
        }
        other => panic!("expected a device timeout, got {other:?}"),
    }
    assert!(took < Duration::from_secs(5), "gave up after {took:?}");
}

#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh runs it"]
fn gpu_wait_sees_a_host_write() {
    let Some(dev) = gpu() else { return };
    let stream = Stream::new(&dev).unwrap();
    let counter = HostMapped::new(&dev, 8).unwrap();
    let err = DevErrorRecord::new(&dev).unwrap();
    let p = fep_wait_test_params {
        counter: counter.device_ptr(),
        dev_error: err.as_abi(),
        expected: 3,
        budget_cycles: 20_000_000_000, // ~10 s: only a broken path runs into it
        rank: 0,
        phase: 1,
        peer: 1,
        _pad: 0,
    };
    // SAFETY: counter and err outlive the synchronisation.
    unsafe { launch::wait_test(&stream, p) }.unwrap();
    std::thread::sleep(Duration::from_millis(5));
    assert!(!stream.query().unwrap(), "the kernel must still be waiting");
    let c = counter.atomic_u64(0).unwrap();
    c.store(2, Ordering::Release);
    std::thread::sleep(Duration::from_millis(5));
    assert!(!stream.query().unwrap(), "2 < 3: still waiting");
    c.store(3, Ordering::Release);
    stream.synchronize_within(Duration::from_secs(15)).unwrap();
    err.check().unwrap();
}

/// `packed` counter word (`(arrivals << 32) | sums`, both modulo 2^32; fep_abi.h
/// FEP_COUNTER_PACKED_OFFSET) as the proxy writes it: the wait ends on the high half equal to
/// what it expects modulo 2^32 (here across the wrap: 2^32 - 2, 2^32 - 1, then 0 = expected), and
/// the word it hands back carries the low half of the same load.
#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh runs it"]
fn gpu_packed_wait_sees_a_host_write_across_the_wrap() {
    let Some(dev) = gpu() else { return };
    let stream = Stream::new(&dev).unwrap();
    let counter = HostMapped::new(&dev, 16).unwrap();
    let word = counter.atomic_u64(0).unwrap();
    let out = counter.atomic_u64(8).unwrap();
    word.store(0xffff_fffe_0000_0005, Ordering::Release);
    let err = DevErrorRecord::new(&dev).unwrap();
    let p = fep_wait_test_params {
        counter: counter.device_ptr(),
        dev_error: err.as_abi(),
        expected: 0x7_0000_0000,       // only the low 32 bits count: 0
        budget_cycles: 20_000_000_000, // ~10 s: only a broken path runs into it
        rank: 0,
        phase: 1,
        peer: 1,
        _pad: 0,
    };
    // SAFETY: counter and err outlive the synchronisation.
    unsafe { launch::wait_packed_test(&stream, p) }.unwrap();
    std::thread::sleep(Duration::from_millis(5));
    assert!(!stream.query().unwrap(), "2^32 - 2 is behind 0: still waiting");
    word.store(0xffff_ffff_ffff_fff0, Ordering::Release);
    std::thread::sleep(Duration::from_millis(5));
    assert!(!stream.query().unwrap(), "2^32 - 1 is behind 0: still waiting");
    word.store(0x0000_0000_0000_3ff2, Ordering::Release); // both halves wrapped
    stream.synchronize_within(Duration::from_secs(15)).unwrap();
    err.check().unwrap();
    assert_eq!(out.load(Ordering::Acquire), 0x3ff2, "the word that ended the wait");
}

/// A high half ahead of the one awaited (modulo 2^32: 1 when 2^32 - 1 is awaited) is an
/// overrun, reported at once as BAD_COUNT with the two high halves, not a wait to the budget.
#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh runs it"]
fn gpu_packed_wait_ahead_is_bad_count() {
    let Some(dev) = gpu() else { return };
    let stream = Stream::new(&dev).unwrap();
    let counter = HostMapped::new(&dev, 16).unwrap();
    counter.atomic_u64(0).unwrap().store(0x0000_0001_0000_0009, Ordering::Release);
    let err = DevErrorRecord::new(&dev).unwrap();
    let p = fep_wait_test_params {
        counter: counter.device_ptr(),
        dev_error: err.as_abi(),
        expected: 0xffff_ffff,
        budget_cycles: 20_000_000_000, // ~10 s: an ahead word must not wait for it
        rank: 2,
        phase: 17,
        peer: 3,
        _pad: 0,
    };
    let t = Instant::now();
    // SAFETY: counter and err outlive the synchronisation.
    unsafe { launch::wait_packed_test(&stream, p) }.unwrap();
    stream.synchronize_within(Duration::from_secs(15)).unwrap();
    assert!(t.elapsed() < Duration::from_secs(5), "gave up after {:?}", t.elapsed());
    match err.check() {
        Err(CudaError::Device {
            what: "BAD_COUNT",
            rank: 2,
            phase: 17,
            peer: Some(3),
            expected: 0xffff_ffff,
            observed: 1,
            ..
        }) => {}
        other => panic!("expected BAD_COUNT, got {other:?}"),
    }
    assert_eq!(counter.atomic_u64(8).unwrap().load(Ordering::Acquire), 0, "no word handed back");
}

/// Far behind (the proxy never wrote): a typed timeout with the expected and last high halves.
#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh runs it"]
fn gpu_packed_wait_timeout_names_rank_phase_peer() {
    let Some(dev) = gpu() else { return };
    let stream = Stream::new(&dev).unwrap();
    let counter = HostMapped::new(&dev, 16).unwrap();
    counter.atomic_u64(0).unwrap().store(0x0000_0004_0000_0040, Ordering::Release);
    let err = DevErrorRecord::new(&dev).unwrap();
    let p = fep_wait_test_params {
        counter: counter.device_ptr(),
        dev_error: err.as_abi(),
        expected: 5,
        budget_cycles: SMALL_BUDGET,
        rank: 1,
        phase: 19,
        peer: 0,
        _pad: 0,
    };
    // SAFETY: counter and err outlive the synchronisation.
    unsafe { launch::wait_packed_test(&stream, p) }.unwrap();
    stream.synchronize_within(Duration::from_secs(10)).expect("the kernel must give up, not hang");
    match err.check() {
        Err(CudaError::Device {
            what: "WAIT_TIMEOUT",
            rank: 1,
            phase: 19,
            peer: Some(0),
            expected: 5,
            observed: 4,
            ..
        }) => {}
        other => panic!("expected a device timeout, got {other:?}"),
    }
}

/// The kernel pushes 10 000 commands through an 8-entry ring (so it waits on "ring full" all the
/// time) while a CPU thread consumes them, checks every field, and bumps the arrival counter the
/// kernel waits for at the end.
#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh runs it"]
fn gpu_ring_push_to_cpu_consumer() {
    let Some(dev) = gpu() else { return };
    let stream = Stream::new(&dev).unwrap();
    const CAP: usize = 8;
    const N: u32 = 10_000;
    let ring = HostMapped::new(&dev, abi::ring_bytes(CAP)).unwrap();
    let arrival = HostMapped::new(&dev, 8).unwrap();
    let err = DevErrorRecord::new(&dev).unwrap();
    let p = fep_ring_push_test_params {
        ring: ring.device_ptr(),
        arrival: arrival.device_ptr(),
        dev_error: err.as_abi(),
        budget_cycles: 4_000_000_000, // ~2 s per wait
        arrival_expected: N as u64,
        capacity: CAP as u32,
        num_cmds: N,
        dst_rank: 9,
        length: 4096,
        rank: 2,
        phase: 11,
    };
    // SAFETY: ring, arrival and err outlive the synchronisation.
    unsafe { launch::ring_push_test(&stream, p) }.unwrap();
    let stop = AtomicBool::new(false);
    let consumed = std::thread::scope(|s| {
        let h = s.spawn(|| {
            let head = ring.atomic_u64(0).unwrap();
            let tail = ring.atomic_u64(64).unwrap();
            let arr = arrival.atomic_u64(0).unwrap();
            let deadline = Instant::now() + Duration::from_secs(30);
            let mut t = 0u64;
            while t < N as u64 {
                assert!(
                    Instant::now() < deadline && !stop.load(Ordering::Relaxed),
                    "consumer stuck at {t}"
                );
                let h = head.load(Ordering::Acquire);
                assert!(h - t <= CAP as u64, "producer overwrote: head {h} tail {t}");
                while t < h {
                    let off = 128 + (t as usize % CAP) * 32;
                    let c: fep_cmd = ring.read(off).unwrap();
                    let i = t as u32;
                    assert_eq!(c.seq, i, "seq at {t}");
                    assert_eq!((c.imm, c.dst_rank, c.length), (i, 9, 4096));
                    assert_eq!(
                        (c.local_offset, c.remote_offset),
                        (i as u64 * 4096, i as u64 * 4096)
                    );
                    t += 1;
                    tail.store(t, Ordering::Release);
                    arr.fetch_add(1, Ordering::AcqRel);
                }
                std::hint::spin_loop();
            }
            t
        });
        let r = stream.synchronize_within(Duration::from_secs(60));
        stop.store(true, Ordering::Relaxed);
        r.unwrap();
        h.join().unwrap()
    });
    err.check().unwrap();
    assert_eq!(consumed, N as u64);
    assert_eq!(ring.atomic_u64(0).unwrap().load(Ordering::Acquire), N as u64);
}

/// Nobody consumes: the producer fills the ring, then its bounded wait runs out with a typed
/// error instead of overwriting or hanging.
#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh runs it"]
fn gpu_ring_full_times_out() {
    let Some(dev) = gpu() else { return };
    let stream = Stream::new(&dev).unwrap();
    let ring = HostMapped::new(&dev, abi::ring_bytes(4)).unwrap();
    let arrival = HostMapped::new(&dev, 8).unwrap();
    let err = DevErrorRecord::new(&dev).unwrap();
    let p = fep_ring_push_test_params {
        ring: ring.device_ptr(),
        arrival: arrival.device_ptr(),
        dev_error: err.as_abi(),
        budget_cycles: SMALL_BUDGET,
        arrival_expected: 10,
        capacity: 4,
        num_cmds: 10,
        dst_rank: 6,
        length: 64,
        rank: 1,
        phase: 4,
    };
    // SAFETY: ring, arrival and err outlive the synchronisation.
    unsafe { launch::ring_push_test(&stream, p) }.unwrap();
    stream.synchronize_within(Duration::from_secs(10)).expect("must give up, not hang");
    match err.check() {
        Err(CudaError::Device {
            what: "WAIT_TIMEOUT",
            rank: 1,
            phase: 4,
            peer: Some(6),
            expected: 1,
            observed: 0,
            ..
        }) => {}
        other => panic!("expected ring-full timeout, got {other:?}"),
    }
    assert_eq!(ring.atomic_u64(0).unwrap().load(Ordering::Acquire), 4, "exactly capacity pushed");
    for i in 0..4u32 {
        let c: fep_cmd = ring.read(128 + i as usize * 32).unwrap();
        assert_eq!((c.seq, c.imm), (i, i));
    }
}
