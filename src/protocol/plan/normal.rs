//! Normal mode: the buffer layout ([`NormalLayout`]), notify records, and the send and
//! receive plans of the chunked queues.

use super::base::*;
use super::imm::{NormalImm, Phase};
use super::record::RecordLayout;
use super::region::RegionPlan;
use crate::protocol::dtype::DispatchDtype;
use crate::{Error, Result};

/// Normal-mode buffers of one rank.
///
/// ```text
/// recv region:    [src in 0..R][slot in 0..spp] slot_bytes     (written by peers)
/// send staging:   [dst in 0..R][slot in 0..spp] slot_bytes     (read by the NIC)
/// notify region:  [seq % 2][src in 0..R] notify_record_bytes   (written by peers)
/// slot_bytes = chunk_tokens * max(dispatch record, combine record)
/// ```
///
// NOTES: bounded per-peer queues. The sender of pair (s -> r) numbers its chunks k = 0, 1, ...
// within a step and writes chunk k into slot k % spp of r's recv region (from its own staging
// slot k % spp), with `NormalImm::data`. It may write chunk k only after the credits for chunks
// < k - spp + 1 came back, so it never has more than spp chunks in flight and a slot is never
// overwritten before it is consumed. Because writes land in any order, a slot id alone is
// unambiguous only thanks to that bound. The receiver consumes chunks of each source strictly in
// order k = 0, 1, ... (waiting for slot k % spp to be filled) and returns credits (possibly
// batched). A sender's step is complete only after every chunk it sent has been credited, so
// every queue is empty at a step boundary and chunk numbering restarts at 0 in the next step and
// in the other phase; the phase bit in the immediate is there to detect protocol errors.
// Combine runs the same queues in the other direction (expert rank -> token's rank) with combine
// records, the rows in exactly the order dispatch delivered them.
//
// NOTES: notify. Before a fresh-layout dispatch every rank writes one `NotifyRecord` to every
// rank (itself included), into slot `seq % 2` where `seq` counts the notifies of that pair. Two
// slots suffice: a sender can start notify seq + 2 only after finishing the step of seq + 1,
// which needs the receiver's own notify seq + 1, which the receiver sends only after reading
// notify seq. A cached-handle dispatch sends no notify and does not advance seq. Zero tokens to
// a peer means a notify with `num_tokens = 0` and no data chunks: nobody waits for anything else.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NormalLayout {
    pub num_ranks: u64,
    pub num_local_experts: u64,
    pub chunk_tokens: u64,
    pub slots_per_peer: u64,
    pub dispatch_record: RecordLayout,
    pub combine_record: RecordLayout,
    /// One slot: `chunk_tokens` of the larger record.
    pub slot_bytes: u64,
    /// One notify record (see [`NotifyRecord`]).
    pub notify_record_bytes: u64,
    pub imm: NormalImm,
}

impl NormalLayout {
    /// Build from plain settings (the same checks as the config, errors name the argument).
    pub fn from_parts(
        num_ranks: u64,
        num_experts: u64,
        hidden: u64,
        num_topk: u64,
        dtype: DispatchDtype,
        chunk_tokens: u64,
        slots_per_peer: u64,
    ) -> Result<Self> {
        let imm = NormalImm::new(num_ranks, slots_per_peer)?;
        if num_experts == 0 || num_experts % num_ranks != 0 {
            return Err(Error::arg(
                "num_experts",
                format!("{num_experts} is not a positive multiple of num_ranks {num_ranks}"),
            ));
        }
        if chunk_tokens == 0 || chunk_tokens > IMM_VALUE_MAX as u64 {
            return Err(Error::arg(
                "chunk_tokens",
                format!("{chunk_tokens} not in 1..={IMM_VALUE_MAX}"),
            ));
        }
        let dispatch_record = RecordLayout::normal_dispatch(hidden, dtype, num_topk)?;
        let combine_record = RecordLayout::normal_combine(hidden, num_topk)?;
        let slot_bytes =
            mul(chunk_tokens, dispatch_record.bytes.max(combine_record.bytes), "chunk_tokens")?;
        let num_local_experts = num_experts / num_ranks;
        let layout = NormalLayout {
            num_ranks,
            num_local_experts,
            chunk_tokens,
            slots_per_peer,
            dispatch_record,
            combine_record,
            slot_bytes,
            notify_record_bytes: NotifyRecord::bytes(num_local_experts),
            imm,
        };
        // Make every size below representable, so the accessors can be infallible.
        mul(mul(num_ranks, slots_per_peer, "slots_per_peer")?, slot_bytes, "slots_per_peer")?
            .checked_mul(2)
            .ok_or_else(|| Error::arg("slots_per_peer", "buffer size overflows u64"))?;
        Ok(layout)
    }

    /// Record of `phase`.
    pub fn record(&self, phase: Phase) -> &RecordLayout {
        match phase {
            Phase::Dispatch => &self.dispatch_record,
            Phase::Combine => &self.combine_record,
        }
    }

    /// Bytes of the receive region.
    pub fn recv_bytes(&self) -> u64 {
        self.num_ranks * self.slots_per_peer * self.slot_bytes
    }

    /// Bytes of the send staging.
    pub fn send_bytes(&self) -> u64 {
        self.recv_bytes()
    }

    /// Bytes of the notify region.
    pub fn notify_bytes(&self) -> u64 {
        NOTIFY_SLOTS * self.num_ranks * self.notify_record_bytes
    }

    fn check_slot(&self, peer: u64, peer_arg: &'static str, slot: u64) -> Result<u64> {
        if peer >= self.num_ranks {
            return Err(Error::arg(peer_arg, format!("{peer} not in 0..{}", self.num_ranks)));
        }
        if slot >= self.slots_per_peer {
            return Err(Error::arg("slot", format!("{slot} not in 0..{}", self.slots_per_peer)));
        }
        Ok((peer * self.slots_per_peer + slot) * self.slot_bytes)
    }

    /// Offset of slot `(src, slot)` in the receive region.
    pub fn recv_slot_offset(&self, src: u64, slot: u64) -> Result<u64> {
        self.check_slot(src, "src", slot)
    }

    /// Offset of slot `(dst, slot)` in the send staging.
    pub fn send_slot_offset(&self, dst: u64, slot: u64) -> Result<u64> {
        self.check_slot(dst, "dst", slot)
    }

    /// Offset of row `row` (`< chunk_tokens`) of a chunk, from the slot start.
    pub fn row_offset(&self, phase: Phase, row: u64) -> Result<u64> {
        if row >= self.chunk_tokens {
            return Err(Error::arg("row", format!("{row} not in 0..{}", self.chunk_tokens)));
        }
        Ok(row * self.record(phase).bytes)
    }

    /// Offset of `src`'s notify record with sequence number `seq` in the notify region.
    pub fn notify_offset(&self, src: u64, seq: u64) -> Result<u64> {
        if src >= self.num_ranks {
            return Err(Error::arg("src", format!("{src} not in 0..{}", self.num_ranks)));
        }
        Ok(((seq % NOTIFY_SLOTS) * self.num_ranks + src) * self.notify_record_bytes)
    }

    /// Chunks for `num_tokens` tokens: `ceil(n / chunk_tokens)`, 0 for 0.
    pub fn num_chunks(&self, num_tokens: u64) -> u64 {
        num_tokens.div_ceil(self.chunk_tokens)
    }

    /// Slot of chunk `k`: `k % spp`.
    pub fn chunk_slot(&self, k: u64) -> u64 {
        k % self.slots_per_peer
    }

    /// Rows in chunk `k` of a `num_tokens` stream (0 past the end); what its immediate carries.
    pub fn chunk_rows(&self, num_tokens: u64, k: u64) -> u64 {
        num_tokens.saturating_sub(k.saturating_mul(self.chunk_tokens)).min(self.chunk_tokens)
    }

    /// Token range `[begin, end)` of chunk `k` within the pair's stream.
    pub fn chunk_range(&self, num_tokens: u64, k: u64) -> (u64, u64) {
        let begin = k.saturating_mul(self.chunk_tokens).min(num_tokens);
        (begin, begin + self.chunk_rows(num_tokens, k))
    }

    /// Region split of the receive region (and, identically, the send staging).
    pub fn data_region_plan(&self, max_region_bytes: u64) -> Result<RegionPlan> {
        RegionPlan::new(self.slot_bytes, self.num_ranks * self.slots_per_peer, max_region_bytes)
    }

    /// Region split of the notify region.
    pub fn notify_region_plan(&self, max_region_bytes: u64) -> Result<RegionPlan> {
        RegionPlan::new(self.notify_record_bytes, NOTIFY_SLOTS * self.num_ranks, max_region_bytes)
    }
}

/// What source rank `s` tells destination rank `r` before a normal dispatch.
///
/// Wire form (little-endian u32s, padded to 16 bytes):
/// `[seq, num_tokens, tokens_per_local_expert[0..L]]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NotifyRecord {
    /// Notify sequence number of the pair (low 32 bits).
    pub seq: u32,
    /// Tokens `s` sends to `r` (each token once, however many of its experts are on `r`).
    pub num_tokens: u32,
    /// `[L]`: `topk_idx` entries of `s` naming each of `r`'s local experts (DeepEP's
    /// `num_tokens_per_expert`; a token counts once per entry).
    pub tokens_per_local_expert: Vec<u32>,
}

impl NotifyRecord {
    /// Wire bytes for `num_local_experts`.
    pub fn bytes(num_local_experts: u64) -> u64 {
        align_up((2 + num_local_experts) * 4, RECORD_ALIGN)
    }

    /// The record source rank sends to `dst`, from the source's layout: `num_tokens_per_rank
    /// [R]` and `num_tokens_per_expert [E]` (what `get_dispatch_layout` returns).
    pub fn for_destination(
        dst: u64,
        seq: u32,
        num_tokens_per_rank: &[u32],
        num_tokens_per_expert: &[u32],
    ) -> Result<Self> {
        let r = num_tokens_per_rank.len() as u64;
        if dst >= r {
            return Err(Error::arg("dst", format!("{dst} not in 0..{r}")));
        }
        let e = num_tokens_per_expert.len() as u64;
        if e == 0 || e % r != 0 {
            return Err(Error::arg(
                "num_tokens_per_expert",
                format!("length {e} is not a positive multiple of num_ranks {r}"),
            ));
        }
        let l = e / r;
        Ok(NotifyRecord {
            seq,
            num_tokens: num_tokens_per_rank[dst as usize],
            tokens_per_local_expert: num_tokens_per_expert
                [(dst * l) as usize..((dst + 1) * l) as usize]
                .to_vec(),
        })
    }

    /// Write into `out[..bytes(L)]` (padding zeroed).
    pub fn encode(&self, out: &mut [u8]) -> Result<()> {
        let n = Self::bytes(self.tokens_per_local_expert.len() as u64) as usize;
        let out = out.get_mut(..n).ok_or_else(|| Error::arg("out", format!("needs {n} bytes")))?;
        out.fill(0);
        let words = [self.seq, self.num_tokens]
            .into_iter()
            .chain(self.tokens_per_local_expert.iter().copied());
        for (i, w) in words.enumerate() {
            out[4 * i..4 * i + 4].copy_from_slice(&w.to_le_bytes());
        }
        Ok(())
    }

    /// Read from `bytes` (at least `bytes(L)` long).
    pub fn decode(bytes: &[u8], num_local_experts: u64) -> Result<Self> {
        let n = Self::bytes(num_local_experts) as usize;
        if bytes.len() < n {
            return Err(Error::arg("bytes", format!("{} bytes, record needs {n}", bytes.len())));
        }
        let w = |i: usize| {
            u32::from_le_bytes([bytes[4 * i], bytes[4 * i + 1], bytes[4 * i + 2], bytes[4 * i + 3]])
        };
        Ok(NotifyRecord {
            seq: w(0),
            num_tokens: w(1),
            tokens_per_local_expert: (0..num_local_experts as usize).map(|e| w(2 + e)).collect(),
        })
    }
}

/// Sender side of normal mode: which tokens go to each destination, in token order.
/// `token_ids[dst_offsets[r]..dst_offsets[r + 1]]` is the stream to rank `r`; chunk `k` of it
/// is `chunk_range(n, k)`. Also the combine map: row `i` of what `r` returns is token
/// `token_ids[dst_offsets[r] + i]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SendPlan {
    /// `[R + 1]` prefix offsets into `token_ids`.
    pub dst_offsets: Vec<u64>,
    /// Source token indices grouped by destination.
    pub token_ids: Vec<u32>,
}

impl SendPlan {
    /// From `is_token_in_rank [num_tokens, num_ranks]` (a layout output).
    pub fn from_is_token_in_rank(
        is_token_in_rank: &[bool],
        num_tokens: u64,
        num_ranks: u64,
    ) -> Result<Self> {
        if Some(is_token_in_rank.len() as u64) != num_tokens.checked_mul(num_ranks) {
            return Err(Error::arg(
                "is_token_in_rank",
                format!("length {}, expected {num_tokens} * {num_ranks}", is_token_in_rank.len()),
            ));
        }
        if num_tokens > i32::MAX as u64 {
            return Err(Error::arg("num_tokens", format!("{num_tokens} exceeds i32::MAX")));
        }
        let (t, r) = (num_tokens as usize, num_ranks as usize);
        let mut dst_offsets = vec![0u64; r + 1];
        for row in is_token_in_rank.chunks_exact(r.max(1)).take(t) {
            for (d, &hit) in row.iter().enumerate() {
                dst_offsets[d + 1] += hit as u64;
            }
        }
        for d in 0..r {
            dst_offsets[d + 1] += dst_offsets[d];
        }
        let mut fill: Vec<u64> = dst_offsets[..r].to_vec();
        let mut token_ids = vec![0u32; dst_offsets[r] as usize];
        for (tok, row) in is_token_in_rank.chunks_exact(r.max(1)).take(t).enumerate() {
            for (d, &hit) in row.iter().enumerate() {
                if hit {
                    token_ids[fill[d] as usize] = tok as u32;
                    fill[d] += 1;
                }
            }
        }
        Ok(SendPlan { dst_offsets, token_ids })
    }

    /// Tokens sent to `dst`, in order (empty for an out-of-range `dst`).
    pub fn tokens_for(&self, dst: u64) -> &[u32] {
        match (self.dst_offsets.get(dst as usize), self.dst_offsets.get(dst as usize + 1)) {
            (Some(&a), Some(&b)) => &self.token_ids[a as usize..b as usize],
            _ => &[],
        }
    }
}

/// Receiver side of a normal dispatch, from the notify records of every source.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecvPlan {
    /// `[R + 1]`: rows from source `s` are `rank_prefix[s]..rank_prefix[s + 1]` of `recv_x`.
    pub rank_prefix: Vec<u64>,
    /// Tokens actually received.
    pub num_recv_tokens: u64,
    /// Rows of the outputs: `num_recv_tokens`, or `num_worst_tokens` when given.
    pub num_out_rows: u64,
    /// `[L]` tokens per local expert, each rounded up to `expert_alignment`.
    pub tokens_per_local_expert: Vec<u64>,
    /// `[R]` data chunks expected from each source (its completions to count).
    pub chunks_from: Vec<u64>,
}

impl RecvPlan {
    /// `records[s]` is what source `s` sent to `rank`. Counts came from the network, so they
    /// are bounds-checked ([`Error::Protocol`] naming the peer). `num_worst_tokens`, when
    /// given, fixes the output rows; a larger real count is an error naming it.
    pub fn new(
        rank: usize,
        records: &[NotifyRecord],
        layout: &NormalLayout,
        expert_alignment: u64,
        num_worst_tokens: Option<u64>,
    ) -> Result<Self> {
        let r = layout.num_ranks as usize;
        let l = layout.num_local_experts as usize;
        if records.len() != r {
            return Err(Error::arg("records", format!("{} records, expected {r}", records.len())));
        }
        if expert_alignment == 0 {
            return Err(Error::arg("expert_alignment", "must be at least 1"));
        }
        let mut rank_prefix = vec![0u64; r + 1];
        let mut per_expert = vec![0u64; l];
        let mut chunks_from = vec![0u64; r];
        for (s, rec) in records.iter().enumerate() {
            let bad = |msg: String| Error::Protocol { rank, peer: s, phase: "notify", msg };
            if rec.tokens_per_local_expert.len() != l {
                return Err(bad(format!(
                    "{} expert counts, expected {l}",
                    rec.tokens_per_local_expert.len()
                )));
            }
            if rec.num_tokens > i32::MAX as u32 {
                return Err(bad(format!("token count {} exceeds i32::MAX", rec.num_tokens)));
            }
            let k = layout.dispatch_record.num_topk_idx;
            let mut sum = 0u64;
            for (e, &c) in rec.tokens_per_local_expert.iter().enumerate() {
                if c as u64 > rec.num_tokens as u64 * k {
                    return Err(bad(format!(
                        "expert {e} count {c} exceeds {} tokens * top-{k}",
                        rec.num_tokens
                    )));
                }
                sum += c as u64;
                per_expert[e] += c as u64;
            }
            if sum < rec.num_tokens as u64 || sum > rec.num_tokens as u64 * k {
                return Err(bad(format!(
                    "{} tokens but {sum} expert selections on this rank (top-{k})",
                    rec.num_tokens
                )));
            }
            rank_prefix[s + 1] = rank_prefix[s] + rec.num_tokens as u64;
            chunks_from[s] = layout.num_chunks(rec.num_tokens as u64);
        }
        let num_recv_tokens = rank_prefix[r];
        let num_out_rows = match num_worst_tokens {
            None => num_recv_tokens,
            Some(w) if w >= num_recv_tokens => w,
            Some(w) => {
                return Err(Error::arg(
                    "num_worst_tokens",
                    format!("rank {rank} receives {num_recv_tokens} tokens, more than {w}"),
                ))
            }
        };
        Ok(RecvPlan {
            rank_prefix,
            num_recv_tokens,
            num_out_rows,
            tokens_per_local_expert: per_expert
                .iter()
                .map(|&c| align_up(c, expert_alignment))
                .collect(),
            chunks_from,
        })
    }

    /// Output row of row `row` of chunk `k` from source `src`.
    pub fn out_row(&self, layout: &NormalLayout, src: u64, k: u64, row: u64) -> Result<u64> {
        let s = src as usize;
        if s + 1 >= self.rank_prefix.len() {
            return Err(Error::arg(
                "src",
                format!("{src} not in 0..{}", self.rank_prefix.len() - 1),
            ));
        }
        let n = self.rank_prefix[s + 1] - self.rank_prefix[s];
        if row >= layout.chunk_rows(n, k) {
            return Err(Error::arg(
                "row",
                format!("row {row} of chunk {k} is past source {src}'s {n} tokens"),
            ));
        }
        Ok(self.rank_prefix[s] + k * layout.chunk_tokens + row)
    }
}
