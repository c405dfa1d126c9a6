//! GPU: kernels drive the real CPU proxy between two processes that share one GPU. Each rank's
//! kernel writes payloads into its send region (mapped host memory), pushes commands into the
//! proxy ring; the proxy posts RMA writes with immediate data over libfabric (`shm`,
//! `tcp;ofi_rxm`); the peer's proxy bumps its arrival counter (mapped host memory); the peer's
//! kernel waits (bounded) for it and checks every byte; the hosts check bytes, poison, arrivals,
//! sums and send completions again. And the timeout path: a peer that never writes turns into a
//! typed error naming rank, phase and peer, with no hang.
//!
//! Ignored without `--include-ignored` (scripts/gpu-check.sh runs them); without a GPU they say
//! SKIP. The test binary re-executes itself as the ranks (`LocalJob` + `TcpStore`). Providers from
//! `FEP_TEST_PROVIDERS` (comma list), default `shm,tcp;ofi_rxm`.

use std::time::{Duration, Instant};

use fabric_ep::abi::fep_proxy_exchange_params;
use fabric_ep::bootstrap::{Bootstrap, RankOutcome, TcpStore};
use fabric_ep::cuda::{gpu_available, launch, CudaError, DeviceBuffer};
use fabric_ep::protocol::plan::ImmCodec;
use fabric_ep::proxy::ArrivalWait;

mod common;
use common::gpu_proxy::{cycles, gpu_proxy_config, msg_byte, msg_len, GpuRank, RankSetup};

const ROLE: &str = "FEP_GPU_PROXY_ROLE";
const CHILD_OK: &str = "CHILD_OK";
const JOB_WALL: Duration = Duration::from_secs(90);
/// Messages each way: 4x the ring, so the kernel also waits on a full ring.
const NUM_MSGS: u32 = 64;
const CAPACITY: u32 = 16;
const STRIDE: u32 = 4096;
const POISON: u8 = 0xa5;
const PHASE: u32 = 21;
/// clock64 budget per wait in the exchange (~20 s at 2 GHz): only a broken path runs into it.
const LONG_BUDGET: Duration = Duration::from_secs(20);
/// Budget of the wait that must time out (~0.25 s at 2 GHz, longer at idle clocks).
const SHORT_BUDGET: Duration = Duration::from_millis(250);
const ASSUMED_GHZ: f64 = 2.0;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// Both ranks' kernels push and wait.
    All,
    /// This rank never pushes: the other's kernel must time out naming it.
    Silent(u32),
}

/// Host check of everything `peer` sent `rank`: every byte of every message, the poison after
/// each message (nothing wrote past its length), arrivals and sums exactly.
fn check_received(r: &GpuRank, peer: u32) {
    let base = (peer * NUM_MSGS * STRIDE) as usize;
    let mut sum = 0u64;
    for i in 0..NUM_MSGS {
        let len = msg_len(peer, i, STRIDE);
        sum += u64::from(len);
        let off = base + (i * STRIDE) as usize;
        for j in 0..STRIDE {
            let got = r.recv_byte(off + j as usize);
            let want = if j < len { msg_byte(peer, r.rank, i, j) } else { POISON };
            assert_eq!(
                got, want,
                "rank {}: byte {j} of message {i} from {peer} (length {len})",
                r.rank
            );
        }
    }
    assert_eq!(r.counters.arrivals(peer).unwrap(), u64::from(NUM_MSGS), "arrivals from {peer}");
    assert_eq!(r.counters.sums(peer).unwrap(), sum, "sum of lengths from {peer}");
    assert_eq!(r.counters.arrivals(r.rank).unwrap(), 0, "nothing was sent to self");
}

fn child(provider: &str, mode: Mode) {
    let store = TcpStore::from_env(Duration::from_secs(30)).expect("join the store");
    let (rank, n) = (store.rank() as u32, store.world_size() as u32);
    assert_eq!(n, 2, "two ranks");
    let peer = 1 - rank;
    let gather = |d: &[u8]| store.all_gather(d).expect("all_gather");
    let per_src = (NUM_MSGS * STRIDE) as usize;
    let setup = RankSetup {
        provider: provider.to_string(),
        rank,
        num_ranks: n,
        send_bytes: per_src,
        recv_bytes: per_src * n as usize,
        capacity: CAPACITY,
        config: gpu_proxy_config(Duration::from_millis(50)),
    };
    let r = GpuRank::open(&setup, POISON, &gather);
    let codec = ImmCodec::default();
    let silent = matches!(mode, Mode::Silent(s) if s == rank);
    let expect_timeout = matches!(mode, Mode::Silent(s) if s == peer);
    let mismatches = DeviceBuffer::zeroed(&r.dev, 4).unwrap();
    let budget = if expect_timeout { SHORT_BUDGET } else { LONG_BUDGET };
    let p = fep_proxy_exchange_params {
        ring: r.ring_dptr,
        send: r.send.device_ptr(),
        recv: r.recv.device_ptr(),
        arrivals: r.arrivals_dptr(peer),
        mismatches: mismatches.device_ptr(),
        dev_error: r.dev_error(),
        budget_cycles: cycles(budget, ASSUMED_GHZ),
        arrival_base: 0,
        remote_base: u64::from(rank * NUM_MSGS * STRIDE),
        recv_base: u64::from(peer * NUM_MSGS * STRIDE),
        capacity: CAPACITY,
        num_msgs: NUM_MSGS,
        stride: STRIDE,
        rank,
        peer,
        phase: PHASE,
        imm_slot: rank,
        value_bits: codec.value_bits(),
        push: 1,
        _pad: 0,
    };
    let t = Instant::now();
    if !silent {
        // SAFETY: every buffer in `p` belongs to `r` or `mismatches`, which outlive the
        // synchronisation below.
        unsafe { launch::proxy_exchange_test(&r.stream, p) }.unwrap();
        r.stream
            .synchronize_within(Duration::from_secs(60))
            .unwrap_or_else(|e| panic!("rank {rank}: the kernel must finish or give up: {e}"));
    }
    let took = t.elapsed();
    if expect_timeout {
        match r.err.check() {
            Err(e @ CudaError::Device { .. }) => {
                let CudaError::Device {
                    what, rank: er, phase, peer: ep, expected, observed, ..
                } = &e
                else {
                    unreachable!()
                };
                assert_eq!(
                    (*what, *er, *phase, *ep, *expected, *observed),
                    ("WAIT_TIMEOUT", rank, PHASE, Some(peer), u64::from(NUM_MSGS), 0),
                    "{e}"
                );
                println!("timeout path ({provider}): {e} (kernel gave up after {took:?})");
            }
            other => panic!("rank {rank}: expected a device timeout naming peer {peer}: {other:?}"),
        }
        assert!(took < Duration::from_secs(20), "rank {rank}: gave up only after {took:?}");
        // Its own writes still went out and completed.
        r.proxy.wait_sends(0, u64::from(NUM_MSGS), Duration::from_secs(20)).unwrap();
    } else if silent {
        // The silent rank still receives: its proxy counts the peer's writes (host-side wait).
        let w = ArrivalWait { slot: peer, expected: u64::from(NUM_MSGS), peer };
        r.proxy.wait_all(&[w], Duration::from_secs(30)).unwrap();
        check_received(&r, peer);
    } else {
        r.err.check().unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        let bad: Vec<u32> = mismatches.to_vec().unwrap();
        assert_eq!(bad[0], 0, "rank {rank}: the kernel found mismatched bytes from {peer}");
        r.proxy.wait_sends(0, u64::from(NUM_MSGS), Duration::from_secs(20)).unwrap();
        assert_eq!(r.rings.tail(0).unwrap(), u64::from(NUM_MSGS));
        check_received(&r, peer);
        println!("rank {rank} ({provider}): {NUM_MSGS} messages each way checked in {took:?}");
    }
    r.proxy.check().unwrap();
    // Nobody tears down its endpoint while the peer may still need it.
    gather(b"done");
    println!("{CHILD_OK}");
}

/// The body of a rank process (`FEP_GPU_PROXY_ROLE=provider|all` or `provider|silent:<rank>`);
/// a normal test run returns at once.
#[test]
fn child_rank() {
    let Ok(role) = std::env::var(ROLE) else { return };
    let (provider, mode) = role.split_once('|').expect("role");
    let mode = match mode.split_once(':') {
        Some(("silent", r)) => Mode::Silent(r.parse().expect("rank")),
        _ => Mode::All,
    };
    child(provider, mode);
}

fn run_job(provider: &str, mode: &str) -> Vec<RankOutcome> {
    common::run_child_ranks(2, &[(ROLE.to_string(), format!("{provider}|{mode}"))], JOB_WALL)
}

fn assert_ok(provider: &str, out: &[RankOutcome]) {
    let all = out.iter().map(|o| o.to_string()).collect::<String>();
    // With --nocapture (scripts/gpu-check.sh) the log shows what each rank saw, and under
    // compute-sanitizer --target-processes all, each rank's own error summary.
    let shown = ["timeout path", "checked in", "ERROR SUMMARY"];
    for line in all.lines().filter(|l| shown.iter().any(|s| l.contains(s))) {
        eprintln!("{line}");
    }
    for (r, o) in out.iter().enumerate() {
        assert!(o.success() && o.stdout.contains(CHILD_OK), "{provider}: rank {r} failed:\n{all}");
    }
}

fn gpu() -> bool {
    if !gpu_available() {
        eprintln!("SKIP: no GPU visible (gpu_available() is false)");
        return false;
    }
    true
}

#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh runs it"]
fn gpu_kernels_exchange_through_proxies_between_processes() {
    if !gpu() {
        return;
    }
    for provider in common::providers(common::GPU_PROVIDERS) {
        let t = Instant::now();
        let out = run_job(&provider, "all");
        assert_ok(&provider, &out);
        eprintln!("{provider}: exchange job {:?}", t.elapsed());
    }
}

#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh runs it"]
fn gpu_peer_never_writes_is_a_typed_error_naming_the_peer() {
    if !gpu() {
        return;
    }
    for provider in common::providers(common::GPU_PROVIDERS) {
        let t = Instant::now();
        let out = run_job(&provider, "silent:1");
        assert_ok(&provider, &out);
        eprintln!("{provider}: silent-peer job {:?}", t.elapsed());
    }
}

/// Runs everywhere: the Rust mirror of the kernels' message pattern stays what the kernel file
/// says (a change to one side only would make the GPU tests fail for the wrong reason).
#[test]
fn message_pattern_is_stable() {
    assert_eq!(msg_len(0, 4, STRIDE), 0);
    assert_eq!(msg_len(1, 9, STRIDE), 0);
    let lens: Vec<u32> = (0..NUM_MSGS).map(|i| msg_len(1, i, STRIDE)).collect();
    assert!(lens.iter().all(|&l| l <= STRIDE));
    assert!(lens.iter().filter(|&&l| l > 1).count() > NUM_MSGS as usize / 2);
    assert_ne!(msg_byte(0, 1, 0, 0), msg_byte(1, 0, 0, 0));
    assert!(u64::from(STRIDE) <= u64::from(ImmCodec::default().max_value()));
}
