//! Multi-process tests of the fabric layer through the main job's binary: N OS processes
//! bootstrap over the TCP store, connect, and do an all-to-all of RMA writes with immediate data
//! (every byte and every completion count checked) over shm, tcp;ofi_rxm and udp;ofi_rxd (the
//! last delivers out of order, as EFA's SRD does). Plus the failure paths.

use std::time::{Duration, Instant};

mod common;
use common::ep_bench;

fn selftest(provider: &str, ranks: usize, bytes: usize, msgs: usize) {
    let t = Instant::now();
    let out = ep_bench()
        .args(["selftest", "--ranks", &ranks.to_string(), "--provider", provider])
        .args(["--bytes-per-peer", &bytes.to_string(), "--msgs-per-peer", &msgs.to_string()])
        .args(["--timeout", "30"])
        .output()
        .expect("run ep-bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{provider} x{ranks}: {stdout}\n{stderr}");
    assert!(stdout.contains(&format!("selftest ok: {ranks} ranks over {provider}")), "{stdout}");
    eprintln!("{provider} x{ranks}: ok in {:?}", t.elapsed());
}

#[test]
fn alltoall_shm_2_4_8() {
    for n in [2, 4, 8] {
        selftest("shm", n, 256 << 10, 8);
    }
}

#[test]
fn alltoall_tcp_rxm_2_4_8() {
    for n in [2, 4, 8] {
        selftest("tcp;ofi_rxm", n, 256 << 10, 8);
    }
}

#[test]
fn alltoall_udp_rxd_unordered_2_4_8() {
    for n in [2, 4, 8] {
        selftest("udp;ofi_rxd", n, 64 << 10, 4);
    }
}

#[test]
fn killed_peer_is_named_within_the_timeout() {
    let t = Instant::now();
    let out = ep_bench()
        .args(["selftest", "--ranks", "3", "--provider", "tcp;ofi_rxm", "--timeout", "4"])
        .env("FEP_TEST_DIE_RANK", "1")
        .output()
        .expect("run ep-bench");
    let elapsed = t.elapsed();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a dead peer must fail the run");
    // Ranks 0 and 2 both name rank 1 as the one that never delivered.
    for r in [0, 2] {
        assert!(stderr.contains(&format!("rank {r} failed")), "rank {r} should fail:\n{stderr}");
    }
    assert!(
        stderr.contains("waiting for ranks [1]") || stderr.contains("write to rank 1"),
        "the error must name rank 1:\n{stderr}"
    );
    assert!(elapsed < Duration::from_secs(60), "took {elapsed:?}");
}

#[test]
fn unknown_provider_is_a_clear_error() {
    let out = ep_bench()
        .args(["selftest", "--ranks", "2", "--provider", "no-such-provider", "--timeout", "10"])
        .output()
        .expect("run ep-bench");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("no libfabric provider matches provider=\"no-such-provider\""),
        "{stderr}"
    );
}

/// `ep-bench fabric --span`: the streaming writes rotate over a 1 MiB span of both registered
/// buffers (a write past the registration would fail the run) and the table says so.
#[test]
fn fabric_bench_with_a_span_runs_over_shm() {
    let out = ep_bench()
        .args(["fabric", "--provider", "shm", "--sizes", "65536", "--window", "4"])
        .args(["--span", "1048576", "--no-pingpong", "--iters", "20", "--timeout", "60"])
        .output()
        .expect("run ep-bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("64KiB |"), "{stdout}");
    assert!(stdout.contains("rotate over 1048576 bytes"), "{stdout}");
}
