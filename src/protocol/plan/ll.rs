//! Low-latency mode: the buffer layout ([`LlLayout`]) and the send and receive plans.

use super::base::*;
use super::imm::LlImm;
use super::record::RecordLayout;
use super::region::RegionPlan;
use crate::protocol::dtype::DispatchDtype;
use crate::{Error, Result};

/// Low-latency buffer of one rank: two sets, each a send area and a receive area of `E` units.
///
/// ```text
/// offset(set, area, unit) = ((set * 2 + area) * E + unit) * unit_bytes
/// unit_bytes = M * max(LL dispatch record, LL combine record)
/// area 0 (send):  dispatch: unit g = global expert, rows in the sender's token order
///                 combine:  unit e * R + dst = rows of local expert e for rank dst
/// area 1 (recv):  dispatch: unit e * R + src = block [local expert e][source src]
///                 combine:  unit g = src * L + e = rows answered by global expert g
/// ```
///
// NOTES: each dispatch or combine call flips to the other set (as DeepEP's buffer index does),
// so one set's dispatch and combine areas are never live at once and share memory, and the
// result of the previous call stays readable while the next one runs. Every (destination,
// local expert) pair gets exactly one write per call, with the row count in its immediate
// (zero-length when the count is 0), so the receiver waits for exactly E arrivals per call and
// never depends on the order in which they land. A message never crosses a unit, and a unit
// never crosses a memory region, so one RMA write always targets one region.
//
// NOTES: deterministic output. After all E arrivals, receiver block (e, s) holds count[e][s]
// rows in s's token order; the compacted `recv_x[e]` places source 0's rows first, then
// source 1's, ...: `begin[e][s] = sum_{s' < s} count[e][s']` (see `LlRecvLayout`). The source
// side places its rows for global expert g at `pos[t][k]` = the number of its earlier tokens
// that selected g (see `LlSendPlan`), which is also where the answer comes back in combine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LlLayout {
    pub num_ranks: u64,
    pub num_experts: u64,
    pub num_local_experts: u64,
    pub max_tokens_per_rank: u64,
    pub dispatch_record: RecordLayout,
    pub combine_record: RecordLayout,
    /// One block of `max_tokens_per_rank` of the larger record.
    pub unit_bytes: u64,
    pub imm: LlImm,
}

/// Which half of a low-latency set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LlArea {
    Send = 0,
    Recv = 1,
}

impl LlLayout {
    pub fn from_parts(
        num_ranks: u64,
        num_experts: u64,
        hidden: u64,
        dtype: DispatchDtype,
        max_tokens_per_rank: u64,
    ) -> Result<Self> {
        let imm = LlImm::new(num_ranks, num_experts)?;
        if max_tokens_per_rank == 0 || max_tokens_per_rank > IMM_VALUE_MAX as u64 {
            return Err(Error::arg(
                "max_tokens_per_rank",
                format!("{max_tokens_per_rank} not in 1..={IMM_VALUE_MAX}"),
            ));
        }
        let dispatch_record = RecordLayout::ll_dispatch(hidden, dtype)?;
        let combine_record = RecordLayout::ll_combine(hidden)?;
        let unit_bytes = max_tokens_per_rank * dispatch_record.bytes.max(combine_record.bytes);
        Ok(LlLayout {
            num_ranks,
            num_experts,
            num_local_experts: num_experts / num_ranks,
            max_tokens_per_rank,
            dispatch_record,
            combine_record,
            unit_bytes,
            imm,
        })
    }

    /// Bytes of one set (send + receive areas).
    pub fn set_bytes(&self) -> u64 {
        2 * self.num_experts * self.unit_bytes
    }

    /// Bytes of the whole buffer (both sets).
    pub fn total_bytes(&self) -> u64 {
        LL_NUM_SETS * self.set_bytes()
    }

    /// Offset of a unit.
    pub fn unit_offset(&self, set: u64, area: LlArea, unit: u64) -> Result<u64> {
        if set >= LL_NUM_SETS {
            return Err(Error::arg("set", format!("{set} not in 0..{LL_NUM_SETS}")));
        }
        if unit >= self.num_experts {
            return Err(Error::arg("unit", format!("{unit} not in 0..{}", self.num_experts)));
        }
        Ok(((set * 2 + area as u64) * self.num_experts + unit) * self.unit_bytes)
    }

    fn local_unit(&self, e: u64, rank: u64, rank_arg: &'static str) -> Result<u64> {
        if e >= self.num_local_experts {
            return Err(Error::arg(
                "local_expert",
                format!("{e} not in 0..{}", self.num_local_experts),
            ));
        }
        if rank >= self.num_ranks {
            return Err(Error::arg(rank_arg, format!("{rank} not in 0..{}", self.num_ranks)));
        }
        Ok(e * self.num_ranks + rank)
    }

    /// Dispatch staging for global expert `g` (send area).
    pub fn dispatch_send_offset(&self, set: u64, global_expert: u64) -> Result<u64> {
        self.unit_offset(set, LlArea::Send, global_expert)
    }

    /// Dispatch receive block `[local_expert][src]` (receive area).
    pub fn dispatch_recv_offset(&self, set: u64, local_expert: u64, src: u64) -> Result<u64> {
        self.unit_offset(set, LlArea::Recv, self.local_unit(local_expert, src, "src")?)
    }

    /// Combine staging: rows of `local_expert` going back to `dst` (send area).
    pub fn combine_send_offset(&self, set: u64, local_expert: u64, dst: u64) -> Result<u64> {
        self.unit_offset(set, LlArea::Send, self.local_unit(local_expert, dst, "dst")?)
    }

    /// Combine receive block of global expert `g` (receive area).
    pub fn combine_recv_offset(&self, set: u64, global_expert: u64) -> Result<u64> {
        self.unit_offset(set, LlArea::Recv, global_expert)
    }

    /// Bytes of a dispatch message with `count` rows.
    pub fn dispatch_msg_bytes(&self, count: u64) -> u64 {
        count * self.dispatch_record.bytes
    }

    /// Bytes of a combine message with `count` rows.
    pub fn combine_msg_bytes(&self, count: u64) -> u64 {
        count * self.combine_record.bytes
    }

    /// Region split of the whole buffer (units never split).
    pub fn region_plan(&self, max_region_bytes: u64) -> Result<RegionPlan> {
        RegionPlan::new(self.unit_bytes, 2 * LL_NUM_SETS * self.num_experts, max_region_bytes)
    }
}

/// Source side of a low-latency dispatch (and the map its combine reads back through).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LlSendPlan {
    pub num_tokens: u64,
    pub num_topk: u64,
    /// `[E]` rows sent to each global expert (the count in its immediate).
    pub count_per_expert: Vec<u32>,
    /// `[num_tokens, K]` row of `(t, k)` within expert `topk_idx[t][k]`'s block; -1 where masked.
    pub pos: Vec<i32>,
}

impl LlSendPlan {
    /// `topk_idx [num_tokens, K]` global ids (-1 = none; an expert at most once per token).
    /// Errors name `x` when `num_tokens > max_tokens_per_rank`, and `topk_idx` on bad ids.
    pub fn new(
        topk_idx: &[i64],
        num_tokens: u64,
        num_topk: u64,
        layout: &LlLayout,
    ) -> Result<Self> {
        if num_tokens > layout.max_tokens_per_rank {
            return Err(Error::arg(
                "x",
                format!(
                    "{num_tokens} tokens, more than max_tokens_per_rank {}",
                    layout.max_tokens_per_rank
                ),
            ));
        }
        check_topk_idx(
            topk_idx,
            num_tokens as usize,
            num_topk as usize,
            layout.num_experts as usize,
            true,
        )?;
        let mut count_per_expert = vec![0u32; layout.num_experts as usize];
        let pos = topk_idx
            .iter()
            .map(|&g| {
                if g < 0 {
                    -1
                } else {
                    let c = &mut count_per_expert[g as usize];
                    *c += 1;
                    (*c - 1) as i32
                }
            })
            .collect();
        Ok(LlSendPlan { num_tokens, num_topk, count_per_expert, pos })
    }

    /// Counts of the messages to rank `dst`, `[L]` (local expert order).
    pub fn counts_for(&self, dst: u64, layout: &LlLayout) -> &[u32] {
        let l = layout.num_local_experts as usize;
        let d = (dst as usize).min(layout.num_ranks as usize);
        self.count_per_expert.get(d * l..(d + 1) * l).unwrap_or(&[])
    }
}

/// Receiver side of a low-latency dispatch: the compacted output layout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LlRecvLayout {
    /// `[L, R]` rows from source `s` for local expert `e` (the immediates' counts).
    pub count: Vec<u32>,
    /// `[L, R]` first row of that block within `recv_x[e]` (prefix over sources).
    pub begin: Vec<u32>,
    /// `[L]` rows per local expert (`recv_count`).
    pub count_per_expert: Vec<u32>,
}

impl LlRecvLayout {
    /// From the counts that arrived, `counts [L, R]` (index `e * R + s`). Each is bounds-checked
    /// against `max_tokens_per_rank` ([`Error::Protocol`] naming the source).
    pub fn new(rank: usize, counts: &[u32], layout: &LlLayout) -> Result<Self> {
        let (l, r) = (layout.num_local_experts as usize, layout.num_ranks as usize);
        if counts.len() != l * r {
            return Err(Error::arg(
                "counts",
                format!("length {}, expected {l} * {r}", counts.len()),
            ));
        }
        let mut begin = vec![0u32; l * r];
        let mut count_per_expert = vec![0u32; l];
        for e in 0..l {
            let mut acc = 0u32;
            for s in 0..r {
                let c = counts[e * r + s];
                if c as u64 > layout.max_tokens_per_rank {
                    return Err(Error::Protocol {
                        rank,
                        peer: s,
                        phase: "low-latency dispatch",
                        msg: format!(
                            "{c} rows for local expert {e}, more than max_tokens_per_rank {}",
                            layout.max_tokens_per_rank
                        ),
                    });
                }
                begin[e * r + s] = acc;
                acc += c;
            }
            count_per_expert[e] = acc;
        }
        Ok(LlRecvLayout { count: counts.to_vec(), begin, count_per_expert })
    }

    /// DeepEP's `layout_range[e][s]` as `(begin, count)`.
    pub fn range(&self, local_expert: usize, src: usize, num_ranks: usize) -> Option<(u32, u32)> {
        let i = local_expert.checked_mul(num_ranks)?.checked_add(src)?;
        if src >= num_ranks {
            return None;
        }
        Some((*self.begin.get(i)?, *self.count.get(i)?))
    }
}
