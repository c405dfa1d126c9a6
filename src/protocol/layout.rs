//! `get_dispatch_layout` (DeepEP V1 semantics): from `topk_idx [num_tokens, num_topk]` (int64,
//! -1 = no expert) compute tokens per rank, per node and per expert, and `is_token_in_rank`.
//!
//! [`dispatch_layout`] is the pure-Rust version: the reference the GPU kernel is tested against,
//! and the host backend's implementation (one pass, no division in the loop). The GPU launch
//! (`kernels/layout.cu`, one launch) is `ep::layout_gpu::DispatchLayoutGpu`, which checks its
//! arguments with this module's [`LayoutShape`].
//!
//! Semantics (NOTES: the GPU kernel implements exactly these):
//! - experts are split evenly: expert `e` lives on rank `e / (num_experts / num_ranks)`; rank `r`
//!   on node `r / ranks_per_node`;
//! - a token counts once per rank and once per node it goes to, however many of its top-k experts
//!   live there; `is_token_in_rank[t, r]` is true when any of them does;
//! - per expert, every top-k entry counts (as DeepEP; top-k indices are distinct in practice);
//! - `-1` entries are skipped; anything else outside `[0, num_experts)` is an error.

use crate::util::SplitMix64;
use crate::{Error, Result};

/// The four outputs of `get_dispatch_layout`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Layout {
    /// `[num_ranks]`
    pub num_tokens_per_rank: Vec<i32>,
    /// `[num_nodes]`, `num_nodes = num_ranks / ranks_per_node`
    pub num_tokens_per_node: Vec<i32>,
    /// `[num_experts]`
    pub num_tokens_per_expert: Vec<i32>,
    /// `[num_tokens, num_ranks]`, row-major
    pub is_token_in_rank: Vec<bool>,
}

/// The shape arguments, validated once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayoutShape {
    pub num_tokens: usize,
    pub num_topk: usize,
    pub num_experts: usize,
    pub num_ranks: usize,
    pub ranks_per_node: usize,
}

impl LayoutShape {
    /// Checks the arguments (not the indices): experts split evenly over ranks, ranks over nodes,
    /// everything within `i32` (the output dtype).
    pub fn new(
        num_tokens: usize,
        num_topk: usize,
        num_experts: usize,
        num_ranks: usize,
        ranks_per_node: usize,
    ) -> Result<LayoutShape> {
        let max = i32::MAX as usize;
        if num_ranks == 0 || num_ranks > max {
            return Err(Error::arg("num_ranks", format!("{num_ranks}: must be in 1..={max}")));
        }
        if num_experts == 0 || num_experts % num_ranks != 0 || num_experts > max {
            return Err(Error::arg(
                "num_experts",
                format!("{num_experts}: must be a positive multiple of num_ranks ({num_ranks})"),
            ));
        }
        if ranks_per_node == 0 || num_ranks % ranks_per_node != 0 {
            return Err(Error::arg(
                "ranks_per_node",
                format!("{ranks_per_node}: must divide num_ranks ({num_ranks})"),
            ));
        }
        if num_topk == 0 || num_topk > max {
            return Err(Error::arg("num_topk", format!("{num_topk}: must be in 1..={max}")));
        }
        if num_tokens > max || num_tokens.checked_mul(num_topk).is_none() {
            return Err(Error::arg("num_tokens", format!("{num_tokens}: too many")));
        }
        if num_tokens.checked_mul(num_ranks).is_none() {
            return Err(Error::arg(
                "num_tokens",
                format!("{num_tokens} x {num_ranks} ranks overflows"),
            ));
        }
        Ok(LayoutShape { num_tokens, num_topk, num_experts, num_ranks, ranks_per_node })
    }

    pub fn num_nodes(&self) -> usize {
        self.num_ranks / self.ranks_per_node
    }
    pub fn experts_per_rank(&self) -> usize {
        self.num_experts / self.num_ranks
    }
}

/// Pure-Rust `get_dispatch_layout`. `topk_idx` is `[num_tokens, num_topk]` row-major.
pub fn dispatch_layout(
    topk_idx: &[i64],
    num_tokens: usize,
    num_topk: usize,
    num_experts: usize,
    num_ranks: usize,
    ranks_per_node: usize,
) -> Result<Layout> {
    let shape = LayoutShape::new(num_tokens, num_topk, num_experts, num_ranks, ranks_per_node)?;
    let mut out = Layout::default();
    dispatch_layout_into(topk_idx, shape, &mut out)?;
    Ok(out)
}

/// [`dispatch_layout`] into existing vectors (no allocation once they have the capacity): the
/// host backend calls this every step.
pub fn dispatch_layout_into(topk_idx: &[i64], shape: LayoutShape, out: &mut Layout) -> Result<()> {
    let LayoutShape { num_tokens, num_topk, num_experts, num_ranks, .. } = shape;
    if topk_idx.len() != num_tokens * num_topk {
        return Err(Error::arg(
            "topk_idx",
            format!(
                "{} entries, expected num_tokens x num_topk = {num_tokens} x {num_topk}",
                topk_idx.len()
            ),
        ));
    }
    let num_nodes = shape.num_nodes();
    let epr = shape.experts_per_rank();
    let rpn = shape.ranks_per_node;
    reset(&mut out.num_tokens_per_rank, num_ranks, 0);
    reset(&mut out.num_tokens_per_node, num_nodes, 0);
    reset(&mut out.num_tokens_per_expert, num_experts, 0);
    reset(&mut out.is_token_in_rank, num_tokens * num_ranks, false);

    // NOTES: a node is "seen" for token t when node_stamp[node] == t + 1: no clearing per token.
    let mut node_stamp = vec![0u32; num_nodes];
    let per_expert = &mut out.num_tokens_per_expert;
    let per_rank = &mut out.num_tokens_per_rank;
    let per_node = &mut out.num_tokens_per_node;
    for (t, (row_idx, row_in)) in topk_idx
        .chunks_exact(num_topk)
        .zip(out.is_token_in_rank.chunks_exact_mut(num_ranks))
        .enumerate()
    {
        let stamp = t as u32 + 1;
        for (k, &e) in row_idx.iter().enumerate() {
            if e < 0 || e as u64 >= num_experts as u64 {
                if e == -1 {
                    continue;
                }
                return Err(Error::arg(
                    "topk_idx",
                    format!("entry [{t}, {k}] = {e} is outside [-1, {num_experts})"),
                ));
            }
            let e = e as usize;
            per_expert[e] += 1;
            let r = e / epr;
            if !row_in[r] {
                row_in[r] = true;
                per_rank[r] += 1;
                let n = r / rpn;
                if node_stamp[n] != stamp {
                    node_stamp[n] = stamp;
                    per_node[n] += 1;
                }
            }
        }
    }
    Ok(())
}

fn reset<T: Copy>(v: &mut Vec<T>, n: usize, x: T) {
    v.clear();
    v.resize(n, x);
}

/// Test and benchmark data: `[shape.num_tokens, shape.num_topk]` random expert ids, distinct per
/// token (as `torch.topk` gives) unless `dups`, each replaced by -1 with probability `drop_pct`%.
pub fn random_topk_idx(
    rng: &mut SplitMix64,
    shape: LayoutShape,
    drop_pct: u64,
    dups: bool,
) -> Vec<i64> {
    let s = shape;
    let mut v = Vec::with_capacity(s.num_tokens * s.num_topk);
    let mut row: Vec<i64> = Vec::with_capacity(s.num_topk);
    for _ in 0..s.num_tokens {
        row.clear();
        while row.len() < s.num_topk {
            let e = rng.below(s.num_experts as u64) as i64;
            // Distinct unless duplicates are asked for (or there are fewer experts than top-k).
            if (dups && rng.below(4) == 0) || !row.contains(&e) || row.len() >= s.num_experts {
                row.push(e);
            }
        }
        for x in row.iter_mut() {
            if rng.below(100) < drop_pct {
                *x = -1;
            }
        }
        v.extend_from_slice(&row);
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Straightforward version: sets, no tricks.
    fn brute(topk: &[i64], s: LayoutShape) -> Layout {
        let epr = s.experts_per_rank();
        let mut l = Layout {
            num_tokens_per_rank: vec![0; s.num_ranks],
            num_tokens_per_node: vec![0; s.num_nodes()],
            num_tokens_per_expert: vec![0; s.num_experts],
            is_token_in_rank: vec![false; s.num_tokens * s.num_ranks],
        };
        for t in 0..s.num_tokens {
            let row = &topk[t * s.num_topk..(t + 1) * s.num_topk];
            let mut ranks = std::collections::BTreeSet::new();
            for &e in row.iter().filter(|&&e| e >= 0) {
                l.num_tokens_per_expert[e as usize] += 1;
                ranks.insert(e as usize / epr);
            }
            let nodes: std::collections::BTreeSet<usize> =
                ranks.iter().map(|r| r / s.ranks_per_node).collect();
            for &r in &ranks {
                l.num_tokens_per_rank[r] += 1;
                l.is_token_in_rank[t * s.num_ranks + r] = true;
            }
            for &n in &nodes {
                l.num_tokens_per_node[n] += 1;
            }
        }
        l
    }

    #[test]
    fn matches_brute_force_on_random_inputs() {
        let mut rng = SplitMix64(7);
        for &(ranks, rpn) in
            &[(1, 1), (2, 2), (3, 1), (4, 2), (8, 8), (16, 8), (24, 8), (64, 8), (48, 4)]
        {
            for &mult in &[1usize, 2, 4] {
                let experts = ranks * mult * if ranks < 8 { 8 } else { 1 };
                for &topk in &[1usize, 2, 6, 8, 9] {
                    for &tokens in &[0usize, 1, 5, 130] {
                        for &(drop, dups) in &[(0, false), (20, false), (10, true), (100, false)] {
                            let s = LayoutShape::new(tokens, topk, experts, ranks, rpn).unwrap();
                            let idx = random_topk_idx(&mut rng, s, drop, dups);
                            let got =
                                dispatch_layout(&idx, tokens, topk, experts, ranks, rpn).unwrap();
                            assert_eq!(got, brute(&idx, s), "{s:?} drop {drop} dups {dups}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn all_tokens_to_one_expert() {
        let (tokens, topk, experts, ranks) = (100, 4, 32, 8);
        let mut idx = vec![-1i64; tokens * topk];
        for t in 0..tokens {
            idx[t * topk] = 13;
        }
        let l = dispatch_layout(&idx, tokens, topk, experts, ranks, 4).unwrap();
        assert_eq!(l.num_tokens_per_expert[13], 100);
        assert_eq!(l.num_tokens_per_expert.iter().sum::<i32>(), 100);
        assert_eq!(l.num_tokens_per_rank, vec![0, 0, 0, 100, 0, 0, 0, 0]);
        assert_eq!(l.num_tokens_per_node, vec![100, 0]);
        assert!((0..tokens).all(|t| l.is_token_in_rank[t * ranks + 3]));
    }

    #[test]
    fn counts_once_per_rank_and_node() {
        // experts 0,1 on rank 0; 2,3 on rank 1 (node 0); 4.. on node 1.
        let idx = [0i64, 1, 2, 5];
        let l = dispatch_layout(&idx, 1, 4, 8, 4, 2).unwrap();
        assert_eq!(l.num_tokens_per_rank, vec![1, 1, 1, 0]);
        assert_eq!(l.num_tokens_per_node, vec![1, 1]);
        assert_eq!(l.is_token_in_rank, vec![true, true, true, false]);
    }

    #[test]
    fn rejects_bad_arguments() {
        let bad = |r: Result<Layout>, arg: &str| match r {
            Err(Error::InvalidArgument { arg: a, .. }) => assert_eq!(a, arg),
            other => panic!("expected InvalidArgument({arg}), got {other:?}"),
        };
        bad(dispatch_layout(&[0], 1, 1, 10, 4, 1), "num_experts");
        bad(dispatch_layout(&[0], 1, 1, 8, 0, 1), "num_ranks");
        bad(dispatch_layout(&[0], 1, 1, 8, 4, 3), "ranks_per_node");
        bad(dispatch_layout(&[0], 1, 0, 8, 4, 1), "num_topk");
        bad(dispatch_layout(&[0, 1], 1, 1, 8, 4, 1), "topk_idx");
        bad(dispatch_layout(&[8], 1, 1, 8, 4, 1), "topk_idx");
        bad(dispatch_layout(&[-2], 1, 1, 8, 4, 1), "topk_idx");
        assert!(dispatch_layout(&[-1], 1, 1, 8, 4, 1).is_ok());
    }

    #[test]
    fn reuse_into_clears_previous_results() {
        let mut out = Layout::default();
        let s = LayoutShape::new(2, 2, 8, 4, 2).unwrap();
        dispatch_layout_into(&[0, 7, 3, -1], s, &mut out).unwrap();
        dispatch_layout_into(&[-1, -1, -1, -1], s, &mut out).unwrap();
        assert_eq!(out, brute(&[-1, -1, -1, -1], s));
    }

    /// The host backend runs this on 4096 x top-8 every step: keep it well under a millisecond
    /// (debug builds are slower; the bound is loose on purpose, it catches quadratic mistakes).
    #[test]
    fn fast_enough_for_4096_by_8() {
        let s = LayoutShape::new(4096, 8, 256, 64, 8).unwrap();
        let idx = random_topk_idx(&mut SplitMix64(1), s, 0, false);
        let mut out = Layout::default();
        dispatch_layout_into(&idx, s, &mut out).unwrap();
        let t = std::time::Instant::now();
        for _ in 0..10 {
            dispatch_layout_into(&idx, s, &mut out).unwrap();
        }
        let per = t.elapsed() / 10;
        assert!(per < std::time::Duration::from_millis(50), "{per:?} per call");
    }
}
