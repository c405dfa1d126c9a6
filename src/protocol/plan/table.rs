//! The plan table ([`plan_table`]): per-rank buffer bytes, memory regions, messages and bytes
//! per peer for a setting at any number of ranks, from [`cluster_sizing`], so users size
//! clusters before renting them. The C ABI's `fep_plan_table` and `ep-bench plan` print it.

use super::cluster::{cluster_sizing, ClusterParams};
use crate::protocol::dtype::DispatchDtype;
use crate::Result;

/// Formats bytes with a binary unit.
fn bytes(b: f64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{v:.0} {}", UNITS[u])
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// The plan table for each rank count, one row per count.
#[allow(clippy::too_many_arguments)]
pub fn plan_table(
    ranks: &[u64],
    num_experts: u64,
    hidden: u64,
    num_topk: u64,
    fp8: bool,
    num_tokens: u64,
    max_tokens_per_rank: u64,
    chunk_tokens: u64,
    slots_per_peer: u64,
    max_region_bytes: u64,
) -> Result<String> {
    use std::fmt::Write;
    let mut out = String::new();
    let dtype = if fp8 { DispatchDtype::Fp8E4m3 } else { DispatchDtype::Bf16 };
    let _ = writeln!(
        out,
        "plan: {num_experts} experts, hidden {hidden}, top-{num_topk}, {} dispatch; normal {num_tokens} \
         tokens/rank (chunks of {chunk_tokens}, {slots_per_peer} slots/peer); low-latency {max_tokens_per_rank} \
         tokens/rank; regions of at most {}",
        if fp8 { "fp8" } else { "bf16" },
        bytes(max_region_bytes as f64)
    );
    let _ = writeln!(
        out,
        "{:>6} | {:>10} {:>7} {:>9} {:>12} | {:>10} {:>7} {:>7} {:>12}",
        "ranks",
        "normal buf",
        "regions",
        "msgs/step",
        "bytes/peer",
        "LL buf",
        "regions",
        "msgs",
        "bytes/peer"
    );
    for &r in ranks {
        let sizing = cluster_sizing(&ClusterParams {
            num_ranks: r,
            num_experts,
            hidden,
            num_topk,
            dtype,
            num_tokens,
            max_tokens_per_rank,
            chunk_tokens,
            slots_per_peer,
            max_region_bytes,
        });
        let s = match sizing {
            Ok(s) => s,
            Err(e) => {
                let _ = writeln!(out, "{r:>6} | not a valid setting: {e}");
                continue;
            }
        };
        let _ = writeln!(
            out,
            "{:>6} | {:>10} {:>7} {:>9} {:>12} | {:>10} {:>7} {:>7} {:>12}",
            r,
            bytes(s.normal_total_bytes as f64),
            s.normal_regions,
            s.normal_dispatch_msgs_expected,
            bytes(s.normal_dispatch_bytes_per_peer_expected),
            bytes(s.ll_total_bytes as f64),
            s.ll_regions,
            s.ll_msgs,
            bytes(s.ll_dispatch_bytes_per_peer_expected),
        );
    }
    let _ = writeln!(
        out,
        "normal buf = receive + send staging + notify per rank (bounded: independent of tokens); \
         msgs/step and bytes/peer = dispatch writes and record bytes to one peer, expected under \
         uniform routing; LL buf = both alternating buffer sets."
    );
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_scales_to_thousands_of_ranks_without_overflow() {
        let t = plan_table(&[8, 64, 1024, 4096], 4096, 7168, 8, true, 4096, 128, 16, 2, 1 << 30)
            .unwrap();
        assert_eq!(t.lines().count(), 2 + 4 + 1, "{t}");
        assert!(t.contains("  4096 |") && !t.contains("not a valid"), "{t}");
        // 256 experts cannot spread over 1024 ranks: that row says so, the others still print.
        let t = plan_table(&[8, 1024], 256, 7168, 8, true, 4096, 128, 64, 4, 1 << 30).unwrap();
        assert!(t.contains("  1024 | not a valid setting") && t.contains("     8 | "), "{t}");
        assert_eq!(bytes(1536.0), "1.5 KiB");
    }
}
