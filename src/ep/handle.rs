//! The normal-mode dispatch handle: everything a cached-handle dispatch and a combine need to
//! move the same tokens again without a notify step (DeepEP's `handle` tuple).

use crate::protocol::plan::SendPlan;

/// What one normal dispatch learned, kept for a cached-handle dispatch and for combine.
///
/// Send side (this rank's tokens): which tokens went to which rank, in token order. Receive side
/// (rows of `recv_x`): rows from source `s` are `rank_prefix[s]..rank_prefix[s + 1]`.
/// A handle belongs to the [`super::buffer::Buffer`] that made it; another buffer rejects it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DispatchHandle {
    pub(crate) buffer_id: u64,
    pub(crate) num_tokens: usize,
    pub(crate) send_plan: SendPlan,
    pub(crate) is_token_in_rank: Vec<bool>,
    pub(crate) rank_prefix: Vec<u64>,
    pub(crate) num_out_rows: usize,
    pub(crate) recv_src_idx: Vec<i32>,
    pub(crate) num_recv_tokens_per_expert: Vec<usize>,
}

impl DispatchHandle {
    /// Tokens this rank dispatched (rows of its combine output).
    pub fn num_tokens(&self) -> usize {
        self.num_tokens
    }

    /// `[num_tokens, num_ranks]` whether each token went to each rank.
    pub fn is_token_in_rank(&self) -> &[bool] {
        &self.is_token_in_rank
    }

    /// `[num_ranks + 1]` prefix of received rows per source rank.
    pub fn rank_prefix(&self) -> &[u64] {
        &self.rank_prefix
    }

    /// Rows actually received.
    pub fn num_recv_tokens(&self) -> usize {
        self.rank_prefix.last().copied().unwrap_or(0) as usize
    }

    /// Rows of the dispatch outputs (`num_worst_tokens` when it was given).
    pub fn num_out_rows(&self) -> usize {
        self.num_out_rows
    }

    /// `[num_recv_tokens]` token index of each received row on its source rank.
    pub fn recv_src_idx(&self) -> &[i32] {
        &self.recv_src_idx
    }

    /// `[num_local_experts]` received top-k entries per local expert, aligned.
    pub fn num_recv_tokens_per_expert(&self) -> &[usize] {
        &self.num_recv_tokens_per_expert
    }

    /// Tokens this rank sent to `dst`, in order (row `i` of what `dst` returns in combine).
    pub fn tokens_sent_to(&self, dst: usize) -> &[u32] {
        self.send_plan.tokens_for(dst as u64)
    }

    /// Rows this rank receives from `src`.
    pub(crate) fn recv_count(&self, src: usize) -> u64 {
        self.rank_prefix[src + 1] - self.rank_prefix[src]
    }
}

/// What one low-latency dispatch learned, kept for its combine (DeepEP's LL `handle`).
///
/// Send side (this rank's tokens): the row of each `(token, k)` within its expert's block.
/// Receive side: `[L, R]` `(begin, count)` of each source's rows within `recv_x[e]`.
/// A handle belongs to the [`super::buffer::Buffer`] that made it and to the buffer's state
/// since its last `clean_low_latency_buffer`; otherwise it is refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LlHandle {
    pub(crate) buffer_id: u64,
    pub(crate) generation: u64,
    pub(crate) num_tokens: usize,
    /// `[T, K]` the dispatch's global expert ids.
    pub(crate) topk_idx: Vec<i64>,
    /// `[T, K]` row within expert `topk_idx[t][k]`'s block, -1 where masked.
    pub(crate) pos: Vec<i32>,
    /// `[E]` rows this rank sent to each global expert.
    pub(crate) count_per_expert: Vec<u32>,
    /// Receive side.
    pub(crate) recv: crate::protocol::plan::LlRecvLayout,
}

impl LlHandle {
    /// Tokens this rank dispatched (rows of its combine output).
    pub fn num_tokens(&self) -> usize {
        self.num_tokens
    }

    /// `[L]` rows received per local expert.
    pub fn recv_count(&self) -> &[u32] {
        &self.recv.count_per_expert
    }

    /// `(begin, count)` of source `src`'s rows within `recv_x[local_expert]`.
    pub fn layout_range(
        &self,
        local_expert: usize,
        src: usize,
        num_ranks: usize,
    ) -> Option<(u32, u32)> {
        self.recv.range(local_expert, src, num_ranks)
    }
}
