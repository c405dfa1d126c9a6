//! `ep-bench plan`: per-rank buffer bytes, memory regions, messages and bytes per peer for a
//! setting at any number of ranks, so users size clusters before renting them.
//!
//! `ep-bench plan --hierarchy` adds [`hierarchy_table`]: the inter-node token copies and bytes of
//! direct per-rank sends (what the kernels do) against DeepEP's hierarchy (one copy per
//! destination node, then an NVLink fan-out), counted exactly on routings from the project's own
//! generator.

use crate::ep::config::DispatchDtype;
use crate::ep::layout::{random_topk_idx, LayoutShape};
use crate::ep::plan::{cluster_sizing, ClusterParams};
use crate::error::{Error, Result};
use crate::util::SplitMix64;

/// Formats bytes with a binary unit.
pub fn bytes(b: f64) -> String {
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

/// Token copies of a set of routings under the two internode strategies, summed over source
/// ranks. Exact counts, no model: each token is counted from its own top-k row.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RouteCounts {
    /// Tokens counted (all source ranks).
    pub tokens: u64,
    /// Direct per-rank sends: per token, the distinct destination ranks on other nodes (one
    /// inter-node copy each).
    pub direct_internode: u64,
    /// Hierarchy: per token, the distinct other nodes among its destinations (one inter-node copy
    /// each, to the gateway rank with the source's local index).
    pub hier_internode: u64,
    /// Hierarchy: per token and remote node, the destination ranks there other than the gateway
    /// (the copies the gateway forwards over NVLink).
    pub hier_forward: u64,
}

/// Counts one source rank's routing into `acc`. `topk_idx` is `[tokens, num_topk]` row-major,
/// int64, -1 = no expert; expert `e` lives on rank `e / (num_experts / num_ranks)`, rank `r` on
/// node `r / ranks_per_node` (the layout's convention). `dests` is scratch.
fn count_rank_routes(
    src: usize,
    topk_idx: &[i64],
    shape: &LayoutShape,
    acc: &mut RouteCounts,
    dests: &mut Vec<usize>,
) -> Result<()> {
    let (num_topk, num_experts) = (shape.num_topk, shape.num_experts);
    if topk_idx.len() % num_topk != 0 {
        return Err(Error::arg(
            "topk_idx",
            format!(
                "rank {src}: {} entries, not a multiple of num_topk ({num_topk})",
                topk_idx.len()
            ),
        ));
    }
    let epr = shape.experts_per_rank();
    let rpn = shape.ranks_per_node;
    let src_node = src / rpn;
    let local = src % rpn;
    for (t, row) in topk_idx.chunks_exact(num_topk).enumerate() {
        dests.clear();
        for (k, &e) in row.iter().enumerate() {
            if e == -1 {
                continue;
            }
            if e < 0 || e as u64 >= num_experts as u64 {
                return Err(Error::arg(
                    "topk_idx",
                    format!("rank {src}: entry [{t}, {k}] = {e} is outside [-1, {num_experts})"),
                ));
            }
            dests.push(e as usize / epr);
        }
        // NOTES: sorted ranks give sorted nodes (node = rank / rpn), so distinct nodes are the
        // node changes along the list.
        dests.sort_unstable();
        dests.dedup();
        let mut last_node = usize::MAX;
        for &d in dests.iter() {
            let node = d / rpn;
            if node == src_node {
                continue;
            }
            acc.direct_internode += 1;
            if node != last_node {
                acc.hier_internode += 1;
                last_node = node;
            }
            if d != node * rpn + local {
                acc.hier_forward += 1;
            }
        }
        acc.tokens += 1;
    }
    Ok(())
}

/// The counting core of [`hierarchy_table`] on explicit routings: `topk[r]` is rank `r`'s
/// `[tokens, num_topk]` top-k indices (row-major, -1 = no expert). Counts are summed over all
/// source ranks.
pub fn count_routes(
    topk: &[Vec<i64>],
    num_experts: usize,
    num_ranks: usize,
    ranks_per_node: usize,
    num_topk: usize,
) -> Result<RouteCounts> {
    if topk.len() != num_ranks {
        return Err(Error::arg(
            "topk",
            format!("{} routings for {num_ranks} ranks: one per rank", topk.len()),
        ));
    }
    let shape = LayoutShape::new(0, num_topk, num_experts, num_ranks, ranks_per_node)?;
    let mut acc = RouteCounts::default();
    let mut dests = Vec::with_capacity(num_topk);
    for (src, idx) in topk.iter().enumerate() {
        count_rank_routes(src, idx, &shape, &mut acc, &mut dests)?;
    }
    Ok(acc)
}

/// Internode routing of direct per-rank sends against DeepEP's hierarchy, one row per rank count:
/// every rank's top-k routing is drawn by [`random_topk_idx`] (seed `seed + rank`, no drops,
/// distinct experts) and counted exactly with [`count_routes`]'s rules. Bytes only: no link speed
/// is assumed. A rank count that is not a multiple of `ranks_per_node`, does not divide
/// `num_experts`, or fits on one node gets a "not a valid setting" row.
#[allow(clippy::too_many_arguments)]
pub fn hierarchy_table(
    ranks: &[u64],
    ranks_per_node: u64,
    num_experts: u64,
    hidden: u64,
    num_topk: u64,
    fp8: bool,
    num_tokens: u64,
    seed: u64,
) -> Result<String> {
    use std::fmt::Write;
    let dtype = if fp8 { DispatchDtype::Fp8E4m3 } else { DispatchDtype::Bf16 };
    let dispatch_bytes = dtype.token_bytes(hidden) as f64;
    let combine_bytes = DispatchDtype::Bf16.token_bytes(hidden) as f64;
    let mib = (1u64 << 20) as f64;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "hierarchy: {num_experts} experts, hidden {hidden}, top-{num_topk}, {} dispatch ({dispatch_bytes} \
         B/token) / bf16 combine ({combine_bytes} B/token), {num_tokens} tokens/rank, \
         {ranks_per_node} ranks/node; routings from random_topk_idx (seed {seed} + rank)",
        if fp8 { "fp8" } else { "bf16" },
    );
    let _ = writeln!(
        out,
        "{:>6} {:>5} | {:>8} {:>8} {:>6} | {:>11} {:>11} | {:>11} {:>11} | {:>9}",
        "ranks",
        "nodes",
        "direct",
        "hier",
        "dedup",
        "disp direct",
        "disp hier",
        "comb direct",
        "comb hier",
        "NVLink"
    );
    let _ = writeln!(
        out,
        "{:>6} {:>5} | {:>8} {:>8} {:>6} | {:>11} {:>11} | {:>11} {:>11} | {:>9}",
        "", "", "copies/t", "copies/t", "x", "MiB/rank", "MiB/rank", "MiB/rank", "MiB/rank", "copies/t"
    );
    for &r in ranks {
        let shape = (|| {
            LayoutShape::new(
                to_usize("num_tokens", num_tokens)?,
                to_usize("num_topk", num_topk)?,
                to_usize("num_experts", num_experts)?,
                to_usize("num_ranks", r)?,
                to_usize("ranks_per_node", ranks_per_node)?,
            )
        })();
        let shape = match shape {
            Ok(s) if s.num_nodes() < 2 => {
                let _ = writeln!(
                    out,
                    "{r:>6} | not a valid setting: one node ({r} ranks, {ranks_per_node} per node): \
                     nothing crosses nodes"
                );
                continue;
            }
            Ok(s) if s.num_tokens == 0 => {
                let _ = writeln!(out, "{r:>6} | not a valid setting: no tokens");
                continue;
            }
            Ok(s) => s,
            Err(e) => {
                let _ = writeln!(out, "{r:>6} | not a valid setting: {e}");
                continue;
            }
        };
        let mut acc = RouteCounts::default();
        let mut dests = Vec::with_capacity(shape.num_topk);
        for src in 0..shape.num_ranks {
            let mut rng = SplitMix64(seed.wrapping_add(src as u64));
            let idx = random_topk_idx(&mut rng, shape, 0, false);
            count_rank_routes(src, &idx, &shape, &mut acc, &mut dests)?;
        }
        let per_token = |c: u64| c as f64 / acc.tokens as f64;
        let per_rank_mib = |c: u64, b: f64| c as f64 * b / shape.num_ranks as f64 / mib;
        let dedup = if acc.hier_internode == 0 {
            "-".to_string()
        } else {
            format!("{:.2}", acc.direct_internode as f64 / acc.hier_internode as f64)
        };
        let _ = writeln!(
            out,
            "{:>6} {:>5} | {:>8.3} {:>8.3} {:>6} | {:>11.1} {:>11.1} | {:>11.1} {:>11.1} | {:>9.3}",
            r,
            shape.num_nodes(),
            per_token(acc.direct_internode),
            per_token(acc.hier_internode),
            dedup,
            per_rank_mib(acc.direct_internode, dispatch_bytes),
            per_rank_mib(acc.hier_internode, dispatch_bytes),
            per_rank_mib(acc.direct_internode, combine_bytes),
            per_rank_mib(acc.hier_internode, combine_bytes),
            per_token(acc.hier_forward),
        );
    }
    let _ = writeln!(
        out,
        "Counted exactly on every rank's routing, mean over source ranks; copies/t = per token a \
         rank holds. direct = copies to distinct destination ranks on other nodes (what the \
         kernels do); hier = copies to distinct other nodes, each to the gateway GPU with the \
         source's local index (DeepEP's hierarchy); dedup = direct / hier inter-node bytes; \
         NVLink = copies the gateways forward to the other destination ranks of their node (hier \
         only). disp = one step's dispatch, comb = its combine (the same rows back as bf16; the \
         hierarchy's gateway reduces its node's rows into one). Bytes only: no link speed is \
         assumed."
    );
    Ok(out)
}

fn to_usize(arg: &'static str, v: u64) -> Result<usize> {
    usize::try_from(v).map_err(|_| Error::arg(arg, format!("{v}: too large")))
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
