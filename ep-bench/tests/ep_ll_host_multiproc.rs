//! Low-latency mode on the host backend with ranks as OS processes (ep-bench launches itself;
//! every rank checks every dispatch and combine, with and without the recv hook, against the
//! reference built from all ranks' inputs), node splits forcing the libfabric path.

use std::time::Instant;

mod common;
use common::ep_bench;

fn low_latency(provider: &str, ranks: usize, per_node: usize, fp8: bool) {
    let t = Instant::now();
    let mut c = ep_bench();
    c.args(["--mode", "low-latency", "--backend", "host", "--provider", provider])
        .args(["--ranks", &ranks.to_string(), "--ranks-per-node", &per_node.to_string()])
        .args(["--tokens", "32", "--hidden", "256", "--topk", "4", "--experts", "16"])
        .args(["--iters", "2", "--timeout", "30"]);
    if fp8 {
        c.arg("--fp8");
    }
    let out = c.output().expect("run ep-bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{provider} x{ranks}: {stdout}\n{stderr}");
    assert!(stdout.contains("every result checked against the reference"), "{stdout}");
    // One table row per operation: "low-latency  <op>  host  <ranks> ...".
    for op in ["dispatch", "dispatch+hook", "combine", "combine+hook"] {
        let found = stdout.lines().any(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.len() > 4
                && f[0] == "low-latency"
                && f[1] == op
                && f[2] == "host"
                && f[3] == ranks.to_string()
        });
        assert!(found, "no `{op}` row: {stdout}");
    }
    eprintln!("{provider} {ranks} ranks ({per_node} per node), fp8 {fp8}: ok in {:?}", t.elapsed());
}

#[test]
fn processes_shm_2() {
    low_latency("shm", 2, 2, true);
}

#[test]
fn processes_tcp_rxm_4_as_2_nodes() {
    low_latency("tcp;ofi_rxm", 4, 2, false);
}

#[test]
fn processes_udp_rxd_2_as_2_nodes_unordered() {
    low_latency("udp;ofi_rxd", 2, 1, true);
}
