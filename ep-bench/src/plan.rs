//! `ep-bench plan` prints the library's plan table (`fabric_ep::protocol::plan::plan_table`, also
//! the C ABI's `fep_plan_table`): per-rank buffer bytes, memory regions, messages and bytes per
//! peer for a setting at any number of ranks, so users size clusters before renting them.
//!
//! `ep-bench plan --hierarchy` adds [`hierarchy_table`]: the inter-node token copies and bytes of
//! direct per-rank sends (what the kernels do) against DeepEP's hierarchy (one copy per
//! destination node, then an NVLink fan-out), counted exactly on routings from the project's own
//! generator.

use fabric_ep::error::{Error, Result};
use fabric_ep::protocol::config::DispatchDtype;
use fabric_ep::protocol::layout::{random_topk_idx, LayoutShape};
use fabric_ep::util::SplitMix64;

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
        "",
        "",
        "copies/t",
        "copies/t",
        "x",
        "MiB/rank",
        "MiB/rank",
        "MiB/rank",
        "MiB/rank",
        "copies/t"
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

    /// 4 ranks, 2 per node, 8 experts (rank r holds experts 2r, 2r + 1), top-2. Node 0 = ranks
    /// 0, 1; node 1 = ranks 2, 3. Every count below is worked out by hand in the comments.
    #[test]
    fn route_counts_match_a_hand_count() {
        let topk = vec![
            // Rank 0 (node 0, local 0): its gateway on node 1 is rank 2.
            vec![
                4, 6, // ranks 2, 3: direct 2, hier 1, forward 1 (rank 3)
                4, 5, // rank 2 twice: direct 1, hier 1, forward 0 (the gateway itself)
                0, 2, // ranks 0, 1, both local: nothing crosses
                6, -1, // rank 3: direct 1, hier 1, forward 1
                -1, -1, // no expert: nothing
                1, 7, // rank 0 (itself) and rank 3: direct 1, hier 1, forward 1
            ],
            // Rank 1 (node 0, local 1): gateway rank 3.
            vec![5, 7], // ranks 2, 3: direct 2, hier 1, forward 1 (rank 2)
            // Rank 2: no tokens.
            vec![],
            // Rank 3 (node 1, local 1): gateway rank 1.
            vec![
                0, 3, // ranks 0, 1: direct 2, hier 1, forward 1 (rank 0)
                2, 6, // rank 1 (the gateway) and rank 3 (itself): direct 1, hier 1, forward 0
            ],
        ];
        let c = count_routes(&topk, 8, 4, 2, 2).unwrap();
        assert_eq!(
            c,
            RouteCounts { tokens: 9, direct_internode: 10, hier_internode: 7, hier_forward: 5 }
        );
        // Per source rank.
        let one = |r: usize| {
            let mut t = vec![vec![]; 4];
            t[r] = topk[r].clone();
            count_routes(&t, 8, 4, 2, 2).unwrap()
        };
        assert_eq!(
            one(0),
            RouteCounts { tokens: 6, direct_internode: 5, hier_internode: 4, hier_forward: 3 }
        );
        assert_eq!(
            one(3),
            RouteCounts { tokens: 2, direct_internode: 3, hier_internode: 2, hier_forward: 1 }
        );
    }

    #[test]
    fn route_counts_reject_bad_routings() {
        // An expert outside [-1, num_experts), a row cut short, a routing missing, a bad shape.
        assert!(count_routes(&[vec![8, 0], vec![], vec![], vec![]], 8, 4, 2, 2).is_err());
        assert!(count_routes(&[vec![-2, 0], vec![], vec![], vec![]], 8, 4, 2, 2).is_err());
        assert!(count_routes(&[vec![1, 2, 3], vec![], vec![], vec![]], 8, 4, 2, 2).is_err());
        assert!(count_routes(&[vec![1, 2], vec![], vec![]], 8, 4, 2, 2).is_err());
        assert!(count_routes(&[vec![], vec![], vec![], vec![]], 6, 4, 2, 2).is_err());
        assert!(count_routes(&[vec![], vec![], vec![], vec![]], 8, 4, 3, 2).is_err());
        assert!(count_routes(&[vec![], vec![], vec![], vec![]], 8, 4, 0, 2).is_err());
    }

    #[test]
    fn hierarchy_never_sends_more_across_nodes_than_direct() {
        // Generated routings: hier <= direct (one copy per node instead of per rank), and the
        // forwarded copies are the direct ones minus those the gateway itself takes (at most
        // one per inter-node copy).
        for (ranks, rpn, experts, topk) in [(16, 8, 256, 8), (32, 4, 64, 6), (12, 3, 24, 4)] {
            let shape = LayoutShape::new(200, topk, experts, ranks, rpn).unwrap();
            let routings: Vec<Vec<i64>> = (0..ranks)
                .map(|r| random_topk_idx(&mut SplitMix64(40 + r as u64), shape, 10, true))
                .collect();
            let c = count_routes(&routings, experts, ranks, rpn, topk).unwrap();
            assert_eq!(c.tokens, 200 * ranks as u64);
            assert!(c.hier_internode <= c.direct_internode, "{c:?}");
            assert!(c.direct_internode <= c.hier_internode * rpn as u64, "{c:?}");
            assert!(c.hier_forward <= c.direct_internode, "{c:?}");
            assert!(c.direct_internode - c.hier_internode <= c.hier_forward, "{c:?}");
            assert!(c.hier_internode > 0, "{c:?}");
        }
        // Every token's experts on distinct remote nodes (4 nodes of 2 ranks, 16 experts, rank r
        // holds 2r, 2r + 1; each source sends to one rank of every other node): the two
        // strategies send the same copies; forwarding happens only where the destination is
        // not the gateway.
        let routings: Vec<Vec<i64>> = (0..8)
            .map(|src: i64| {
                let node = src / 2;
                // One expert on local index 0 of every other node: ranks 0, 2, 4, 6 minus own.
                (0..4).filter(|&n| n != node).map(|n| 4 * n).collect()
            })
            .collect();
        let c = count_routes(&routings, 16, 8, 2, 3).unwrap();
        assert_eq!(c.direct_internode, c.hier_internode);
        assert_eq!(c.direct_internode, 8 * 3);
        // Sources with local index 0 hit their gateways; those with local index 1 forward each.
        assert_eq!(c.hier_forward, 4 * 3);
    }

    #[test]
    fn hierarchy_table_prints_invalid_settings_as_rows() {
        // 8 ranks = one node; 12 not a multiple of 8; 512 does not divide 256 experts.
        let t = hierarchy_table(&[8, 12, 16, 512, 32], 8, 256, 7168, 8, true, 64, 1).unwrap();
        assert_eq!(t.lines().count(), 3 + 5 + 1, "{t}");
        for r in ["     8 | not a valid", "    12 | not a valid", "   512 | not a valid"] {
            assert!(t.contains(r), "{r}\n{t}");
        }
        for r in ["    16     2 | ", "    32     4 | "] {
            assert!(t.contains(r), "{r}\n{t}");
        }
        // The dedup factor is at least 1 on every valid row.
        for line in t.lines().filter(|l| l.starts_with("    16") || l.starts_with("    32")) {
            let dedup: f64 = line.split_whitespace().nth(5).unwrap().parse().unwrap();
            assert!(dedup >= 1.0, "{line}");
        }
        // No tokens and zero ranks per node are rows too, not errors or panics.
        let t = hierarchy_table(&[16], 8, 256, 7168, 8, false, 0, 1).unwrap();
        assert!(t.contains("    16 | not a valid setting"), "{t}");
        let t = hierarchy_table(&[16, 0], 0, 256, 7168, 8, false, 64, 1).unwrap();
        assert_eq!(t.matches("not a valid setting").count(), 2, "{t}");
        // Same seed, same table.
        assert_eq!(
            hierarchy_table(&[16], 8, 256, 7168, 8, true, 64, 3).unwrap(),
            hierarchy_table(&[16], 8, 256, 7168, 8, true, 64, 3).unwrap()
        );
    }
}
