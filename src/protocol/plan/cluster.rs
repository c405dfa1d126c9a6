//! Cluster sizing for ep-bench's plan ([`cluster_sizing`]): what one rank needs and moves per
//! step at a given scale, expected (uniform routing) and worst case.

use super::base::*;
use super::ll::LlLayout;
use super::normal::NormalLayout;
use crate::protocol::dtype::DispatchDtype;
use crate::{Error, Result};

/// Inputs of [`cluster_sizing`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClusterParams {
    pub num_ranks: u64,
    pub num_experts: u64,
    pub hidden: u64,
    pub num_topk: u64,
    pub dtype: DispatchDtype,
    /// Normal mode: tokens per rank per step.
    pub num_tokens: u64,
    /// Low-latency mode: tokens per rank per step (also the buffer capacity).
    pub max_tokens_per_rank: u64,
    pub chunk_tokens: u64,
    pub slots_per_peer: u64,
    /// The provider's largest memory region.
    pub max_region_bytes: u64,
}

/// What one rank needs and moves, per step. "Expected" figures assume uniform routing (each
/// token picks `K` distinct experts uniformly); "max" figures are the worst case.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ClusterSizing {
    pub normal_recv_bytes: u64,
    pub normal_send_bytes: u64,
    pub normal_notify_bytes: u64,
    /// Receive + send + notify.
    pub normal_total_bytes: u64,
    pub normal_regions: u64,
    pub ll_total_bytes: u64,
    pub ll_regions: u64,
    /// Probability that a token goes to a given rank.
    pub p_token_to_rank: f64,
    /// Normal dispatch, tokens to one peer: expected and max.
    pub normal_tokens_per_peer_expected: f64,
    pub normal_tokens_per_peer_max: u64,
    /// Normal dispatch, record bytes to one peer: expected and max.
    pub normal_dispatch_bytes_per_peer_expected: f64,
    pub normal_dispatch_bytes_per_peer_max: u64,
    /// Normal combine, record bytes back from one peer: expected and max.
    pub normal_combine_bytes_per_peer_expected: f64,
    pub normal_combine_bytes_per_peer_max: u64,
    /// Normal dispatch writes posted per rank: R notifies + data chunks (expected, max).
    pub normal_dispatch_msgs_expected: u64,
    pub normal_dispatch_msgs_max: u64,
    /// Low latency: writes posted per rank per dispatch (= per combine): E.
    pub ll_msgs: u64,
    /// Low latency, dispatch record bytes to one peer: expected and max.
    pub ll_dispatch_bytes_per_peer_expected: f64,
    pub ll_dispatch_bytes_per_peer_max: u64,
    /// Low latency, combine bytes from one peer: expected and max.
    pub ll_combine_bytes_per_peer_expected: f64,
    pub ll_combine_bytes_per_peer_max: u64,
}

/// Per-rank sizing of a cluster, all in `u64` (any rank count the id spaces allow).
pub fn cluster_sizing(p: &ClusterParams) -> Result<ClusterSizing> {
    let normal = NormalLayout::from_parts(
        p.num_ranks,
        p.num_experts,
        p.hidden,
        p.num_topk,
        p.dtype,
        p.chunk_tokens,
        p.slots_per_peer,
    )?;
    let ll =
        LlLayout::from_parts(p.num_ranks, p.num_experts, p.hidden, p.dtype, p.max_tokens_per_rank)?;
    if p.num_topk == 0 || p.num_topk > p.num_experts {
        return Err(Error::arg("num_topk", format!("{} not in 1..={}", p.num_topk, p.num_experts)));
    }
    let data = normal.data_region_plan(p.max_region_bytes)?;
    let notify = normal.notify_region_plan(p.max_region_bytes)?;
    let l = normal.num_local_experts;
    // P(token misses a rank) = C(E - L, K) / C(E, K) = prod_{i < K} (E - L - i) / (E - i).
    let mut miss = 1.0f64;
    for i in 0..p.num_topk {
        let num = p.num_experts as f64 - l as f64 - i as f64;
        miss *= (num.max(0.0)) / (p.num_experts - i) as f64;
    }
    let p_hit = 1.0 - miss;
    let n = p.num_tokens;
    let exp_tokens = n as f64 * p_hit;
    let dispatch_rec = normal.dispatch_record.bytes;
    let combine_rec = normal.combine_record.bytes;
    let exp_chunks = (exp_tokens / p.chunk_tokens as f64).ceil() as u64;
    let max_chunks = mul(p.num_ranks, normal.num_chunks(n), "num_tokens")?;
    // LL: each (token, selected expert) pair is one row; a peer hosts L of the E experts.
    let ll_rows_exp =
        p.max_tokens_per_rank as f64 * p.num_topk as f64 * l as f64 / p.num_experts as f64;
    let ll_rows_max = p.max_tokens_per_rank * p.num_topk.min(l);
    let ll_region = ll.region_plan(p.max_region_bytes)?;
    Ok(ClusterSizing {
        normal_recv_bytes: normal.recv_bytes(),
        normal_send_bytes: normal.send_bytes(),
        normal_notify_bytes: normal.notify_bytes(),
        normal_total_bytes: normal.recv_bytes() + normal.send_bytes() + normal.notify_bytes(),
        normal_regions: 2 * data.num_regions + notify.num_regions,
        ll_total_bytes: ll.total_bytes(),
        ll_regions: ll_region.num_regions,
        p_token_to_rank: p_hit,
        normal_tokens_per_peer_expected: exp_tokens,
        normal_tokens_per_peer_max: n,
        normal_dispatch_bytes_per_peer_expected: exp_tokens * dispatch_rec as f64,
        normal_dispatch_bytes_per_peer_max: mul(n, dispatch_rec, "num_tokens")?,
        normal_combine_bytes_per_peer_expected: exp_tokens * combine_rec as f64,
        normal_combine_bytes_per_peer_max: mul(n, combine_rec, "num_tokens")?,
        normal_dispatch_msgs_expected: p.num_ranks + p.num_ranks * exp_chunks,
        normal_dispatch_msgs_max: p.num_ranks + max_chunks,
        ll_msgs: p.num_experts,
        ll_dispatch_bytes_per_peer_expected: ll_rows_exp * ll.dispatch_record.bytes as f64,
        ll_dispatch_bytes_per_peer_max: ll_rows_max * ll.dispatch_record.bytes,
        ll_combine_bytes_per_peer_expected: ll_rows_exp * ll.combine_record.bytes as f64,
        ll_combine_bytes_per_peer_max: ll_rows_max * ll.combine_record.bytes,
    })
}
