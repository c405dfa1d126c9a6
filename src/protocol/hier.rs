//! The pure part of DeepEP's internode hierarchy (normal mode): the two stages' settings, the
//! node stage's metadata lane and the final row order. The stages themselves (`ep::hier`'s
//! `HierBuffer` on the host backend, `ep::hier_gpu`'s `GpuHierBuffer` on the GPU) are two
//! `ep::buffer::Buffer`s over sub-communicators and stay in `ep`; what they compute from the
//! config and from the stages' outputs is here.
//!
//! * The **rail stage** runs over the ranks with this rank's local index (one per node, the
//!   world's experts); the **node stage** over this node's ranks, with the node's experts and
//!   hidden + [`META_CHANNELS`] ([`stage_settings`]).
//! * The **metadata lane**: the node stage's extra channels carry, in their first 8 bytes, the
//!   row's source node and its token index on the source (little-endian `u32`s), copied
//!   verbatim by both dtypes' dispatch (`widen`, `read_meta`, `narrow`: the host backend's
//!   passes; the GPU backend writes the same bytes with device copies).
//! * The **final order** restores the direct path's row order (source rank ascending, token
//!   order within a source) from the lane and the gateway each row came from ([`final_order`],
//!   with `rows_by_source` and `permute_rows`).

use super::config::{EpConfig, EpSettings};
use super::quant::FP8_GROUP;
use super::reference::Tokens as OwnedTokens;
use crate::{Error, Result};

/// Channels of the node stage's metadata lane (one fp8 scale group).
pub const META_CHANNELS: usize = FP8_GROUP;

/// The settings of the two stages' buffers for world config `cfg`: (rail, node).
pub fn stage_settings(cfg: &EpConfig) -> Result<(EpSettings, EpSettings)> {
    let s = cfg.settings();
    let rpn = s.ranks_per_node;
    let nodes = s.num_ranks / rpn;
    let rail = EpSettings { rank: s.rank / rpn, num_ranks: nodes, ranks_per_node: 1, ..s.clone() };
    let node = EpSettings {
        rank: s.rank % rpn,
        num_ranks: rpn,
        ranks_per_node: rpn,
        num_experts: s.num_experts / nodes,
        hidden: s.hidden + META_CHANNELS,
        ..s.clone()
    };
    if s.hidden % FP8_GROUP != 0 {
        return Err(Error::arg(
            "hidden",
            format!(
                "{} is not a multiple of 128, as the hierarchy's metadata lane needs",
                s.hidden
            ),
        ));
    }
    if s.num_topk > node.num_experts {
        // The node stage is a Buffer over one node's experts, whose config takes top-k
        // within its experts.
        return Err(Error::arg(
            "num_topk",
            format!(
                "{}: the hierarchy's node stage holds num_experts / nodes = {} / {nodes} = {} \
                 experts, and top-k may not exceed them",
                s.num_topk, s.num_experts, node.num_experts
            ),
        ));
    }
    Ok((rail, node))
}

/// The direct path's row order for the node stage's `n2` rows, from each row's metadata lane
/// (`meta`: source node, token index) and the gateway it came from (`gateway`, its local
/// index): a stable counting sort by source rank = node * rpn + gateway. Returns (`perm`:
/// output row -> node-stage row, `rank_prefix [R + 1]`, `recv_src_idx` in output order). A
/// source node out of range is a protocol error naming the gateway's job rank.
#[doc(hidden)]
pub fn final_order(
    cfg: &EpConfig,
    meta: &[(u32, u32)],
    gateway: &[usize],
) -> Result<(Vec<u32>, Vec<u64>, Vec<i32>)> {
    let (rpn, r) = (cfg.ranks_per_node, cfg.num_ranks);
    let n2 = meta.len();
    let mut count = vec![0u64; r + 1];
    let mut keys = Vec::with_capacity(n2);
    if gateway.len() != n2 {
        return Err(Error::arg("gateway", format!("{} rows, expected {n2}", gateway.len())));
    }
    for (i, &(m, t)) in meta.iter().enumerate() {
        let bad = |msg: String| Error::Protocol {
            rank: cfg.rank,
            peer: cfg.rank / rpn * rpn + gateway[i],
            phase: "hierarchical dispatch",
            msg,
        };
        if gateway[i] >= rpn {
            return Err(Error::arg("gateway", format!("row {i}: {} of {rpn}", gateway[i])));
        }
        let key = m as usize * rpn + gateway[i];
        if key >= r {
            return Err(bad(format!("row {i} names source node {m} of {}", r / rpn)));
        }
        if t > i32::MAX as u32 {
            return Err(bad(format!("row {i} names source token {t}, past 2^31 - 1")));
        }
        count[key + 1] += 1;
        keys.push(key);
    }
    for s in 0..r {
        count[s + 1] += count[s];
    }
    let rank_prefix = count.clone();
    let mut perm = vec![0u32; n2];
    let mut src_idx = vec![0i32; n2];
    for (i, &key) in keys.iter().enumerate() {
        let p = count[key] as usize;
        count[key] += 1;
        perm[p] = i as u32;
        src_idx[p] = meta[i].1 as i32;
    }
    Ok((perm, rank_prefix, src_idx))
}

/// Rows of `k` values of `v` in output order (`perm`), padded to `rows` with `fill`; empty
/// stays empty (a cached dispatch returns no top-k).
/// `[rows, k]` of `v`'s rows in `perm` order, padding rows `fill`; empty when the dispatch had
/// no top-k (`present` false). Not "when `v` is empty": a rank receiving no row still returns
/// `num_worst_tokens` padding rows.
pub(crate) fn permute_rows<T: Copy>(
    v: &[T],
    perm: &[u32],
    rows: usize,
    k: usize,
    fill: T,
    present: bool,
) -> Vec<T> {
    if !present {
        return Vec::new();
    }
    let mut o = vec![fill; rows * k];
    for (p, &i) in perm.iter().enumerate() {
        let i = i as usize;
        o[p * k..(p + 1) * k].copy_from_slice(&v[i * k..(i + 1) * k]);
    }
    o
}

/// The source of each of `n` rows grouped by a `[sources + 1]` prefix.
pub(crate) fn rows_by_source(prefix: &[u64], n: usize) -> Vec<usize> {
    let mut v = Vec::with_capacity(n);
    for s in 0..prefix.len().saturating_sub(1) {
        let c = (prefix[s + 1] - prefix[s]) as usize;
        v.extend(std::iter::repeat_n(s, c));
    }
    v.truncate(n);
    v
}

/// The node stage's rows: each of `n` rows of `x` (hidden `h`) followed by the metadata lane,
/// whose first 8 bytes are `meta(row)` = (source node, token index on the source), LE.
pub(crate) fn widen(
    x: &OwnedTokens,
    h: usize,
    n: usize,
    meta: impl Fn(usize) -> (u32, u32),
) -> OwnedTokens {
    let hw = h + META_CHANNELS;
    let bytes = |i: usize| {
        let (m, t) = meta(i);
        let mut b = [0u8; 8];
        b[..4].copy_from_slice(&m.to_le_bytes());
        b[4..].copy_from_slice(&t.to_le_bytes());
        b
    };
    match x {
        OwnedTokens::Bf16(v) => {
            let mut o = vec![0u16; n * hw];
            for i in 0..n {
                o[i * hw..i * hw + h].copy_from_slice(&v[i * h..(i + 1) * h]);
                let b = bytes(i);
                for j in 0..4 {
                    o[i * hw + h + j] = u16::from_le_bytes([b[2 * j], b[2 * j + 1]]);
                }
            }
            OwnedTokens::Bf16(o)
        }
        OwnedTokens::Fp8 { x: v, scales } => {
            let (g, gw) = (h / FP8_GROUP, hw / FP8_GROUP);
            let mut o = vec![0u8; n * hw];
            let mut s = vec![1f32; n * gw];
            for i in 0..n {
                o[i * hw..i * hw + h].copy_from_slice(&v[i * h..(i + 1) * h]);
                o[i * hw + h..i * hw + h + 8].copy_from_slice(&bytes(i));
                s[i * gw..i * gw + g].copy_from_slice(&scales[i * g..(i + 1) * g]);
            }
            OwnedTokens::Fp8 { x: o, scales: s }
        }
    }
}

/// The (source node, token index) lane of each of the first `n` node-stage rows.
pub(crate) fn read_meta(x: &OwnedTokens, h: usize, n: usize) -> Vec<(u32, u32)> {
    let hw = h + META_CHANNELS;
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let mut b = [0u8; 8];
        match x {
            OwnedTokens::Bf16(v) => {
                for j in 0..4 {
                    b[2 * j..2 * j + 2].copy_from_slice(&v[i * hw + h + j].to_le_bytes());
                }
            }
            OwnedTokens::Fp8 { x: v, .. } => b.copy_from_slice(&v[i * hw + h..i * hw + h + 8]),
        }
        let m = u32::from_le_bytes(b[..4].try_into().expect("4 bytes"));
        let t = u32::from_le_bytes(b[4..].try_into().expect("4 bytes"));
        out.push((m, t));
    }
    out
}

/// The node stage's rows without the lane, in output order (`perm`), padded to `rows`.
pub(crate) fn narrow(x: &OwnedTokens, h: usize, perm: &[u32], rows: usize) -> OwnedTokens {
    let hw = h + META_CHANNELS;
    match x {
        OwnedTokens::Bf16(v) => {
            let mut o = vec![0u16; rows * h];
            for (p, &i) in perm.iter().enumerate() {
                let i = i as usize;
                o[p * h..(p + 1) * h].copy_from_slice(&v[i * hw..i * hw + h]);
            }
            OwnedTokens::Bf16(o)
        }
        OwnedTokens::Fp8 { x: v, scales } => {
            let (g, gw) = (h / FP8_GROUP, hw / FP8_GROUP);
            let mut o = vec![0u8; rows * h];
            let mut s = vec![0f32; rows * g];
            for (p, &i) in perm.iter().enumerate() {
                let i = i as usize;
                o[p * h..(p + 1) * h].copy_from_slice(&v[i * hw..i * hw + h]);
                s[p * g..(p + 1) * g].copy_from_slice(&scales[i * gw..i * gw + g]);
            }
            OwnedTokens::Fp8 { x: o, scales: s }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lane_round_trips_both_dtypes() {
        let h = 128;
        let bf = OwnedTokens::Bf16((0..2 * h as u16).collect());
        let w = widen(&bf, h, 2, |i| (7 + i as u32, 0xdead_0000 + i as u32));
        assert_eq!(read_meta(&w, h, 2), vec![(7, 0xdead_0000), (8, 0xdead_0001)]);
        match narrow(&w, h, &[1, 0], 3) {
            OwnedTokens::Bf16(v) => {
                assert_eq!(v.len(), 3 * h);
                assert_eq!(&v[..h], &(h as u16..2 * h as u16).collect::<Vec<_>>()[..]);
                assert_eq!(&v[h..2 * h], &(0..h as u16).collect::<Vec<_>>()[..]);
                assert!(v[2 * h..].iter().all(|&c| c == 0), "padding rows are zero");
            }
            _ => panic!("bf16 in, bf16 out"),
        }
        let f8 =
            OwnedTokens::Fp8 { x: (0..2 * h).map(|v| v as u8).collect(), scales: vec![0.5, 2.0] };
        let w = widen(&f8, h, 2, |i| (i as u32, 40 + i as u32));
        assert_eq!(read_meta(&w, h, 2), vec![(0, 40), (1, 41)]);
        match narrow(&w, h, &[1, 0], 2) {
            OwnedTokens::Fp8 { x, scales } => {
                assert_eq!(scales, vec![2.0, 0.5]);
                assert_eq!(x[0], 128u8);
                assert_eq!(x[h], 0u8);
            }
            _ => panic!("fp8 in, fp8 out"),
        }
    }

    #[test]
    fn rows_by_source_follows_the_prefix() {
        assert_eq!(rows_by_source(&[0, 2, 2, 3], 3), vec![0, 0, 2]);
        assert_eq!(rows_by_source(&[0], 0), Vec::<usize>::new());
    }
}
