//! Protocol math shared by the CUDA kernels, the proxy and the host backend: record layouts,
//! buffer offsets, immediate data, chunk/credit bookkeeping, receive plans and cluster sizing.
//! Pure: no GPU, no NIC, no threads. Plain structs, `u64` byte offsets, slices in, `Vec`s out.
//!
//! Vocabulary: `R` = num_ranks, `E` = num_experts, `L` = E / R local experts per rank,
//! `spp` = slots_per_peer, `C` = chunk_tokens, `M` = max_tokens_per_rank. Global expert `g`
//! lives on rank `g / L` as local expert `g % L`.
//!
//! # Wire records
//! Every token crosses the wire as one record of little-endian fields, padded to 16 bytes:
//!
//! | record            | payload                 | scales (f32)  | topk idx (i32) | topk w (f32) | src idx (i32) |
//! |-------------------|-------------------------|---------------|----------------|--------------|---------------|
//! | normal dispatch   | bf16 `2H` / e4m3 `H`    | fp8: `H/128`  | `K`, local ids | `K`          | 1             |
//! | normal combine    | bf16 `2H`               | -             | -              | `K`          | -             |
//! | LL dispatch       | bf16 `2H` / e4m3 `H`    | fp8: `H/128`  | -              | -            | 1             |
//! | LL combine        | bf16 `2H`               | -             | -              | -            | -             |
//!
//! Fields follow each other in the table's order with no gaps (all 4-byte aligned, the payload
//! 16-byte aligned because `H % 8 == 0`). The normal-dispatch topk ids are already local to the
//! destination rank (`-1` where the expert is not there or the entry was `-1`), and the weights
//! are 0 there, as DeepEP's sender does; the receiver copies both verbatim.
//!
//! # Immediate data
//! Every RMA write carries a `u32`: `slot_id = imm >> 14` (18 bits), `value = imm & 0x3fff`.
//! See [`NormalImm`] and [`LlImm`] for the id spaces.

use super::dtype::DispatchDtype;
use crate::{Error, Result};

/// Records are padded to this many bytes.
///
/// NOTES: padding normal-mode records to 128 bytes (whole lines for the payload's warp stores)
/// was tried and reverted (measured on an H200, A/B runs alternated): the host-staged proxy lane
/// gained 0-10% (7 of 8 alternated pairs), the intranode path lost 1.6-1.8% in dispatch and
/// 0.7-1.0% in combine (the 1.1% / 0.7% more bytes), and intranode (and EFA with FI_HMEM, where
/// records stay in device memory) is the path that matters.
pub const RECORD_ALIGN: u64 = 16;
/// Low-latency dispatch records are padded to this many bytes (one GPU cache line).
///
/// NOTES: so every record starts on a line and the kernel writes each line whole: the payload
/// by whole warps, the tail (scales, source index, padding) by one warp from shared memory
/// (kernels/ll_dispatch.cu). Tried because over the proxy lane without `FI_HMEM` those writes
/// cross PCIe into host memory, and the send staged 3.6 MB in ~200 us while the combine's
/// whole-line rows went at ~50 GB/s (H200, traced). Measured after, on the same machine:
/// `gpu_ll_bench` dispatch 18.30 us at 1 rank (19.2 before), 48.22 at 4 (50.1); the traced
/// proxy send span did not shrink, so partial lines were not what slows that staging. Cost: 16
/// bytes per fp8 record at hidden 7168 (0.2%), 112 per bf16 record.
pub const LL_DISPATCH_RECORD_ALIGN: u64 = 128;
/// Bits of the immediate data's value field.
pub const IMM_VALUE_BITS: u32 = 14;
/// Largest value an immediate can carry.
pub const IMM_VALUE_MAX: u32 = (1 << IMM_VALUE_BITS) - 1;
/// Bits of the immediate data's slot id.
pub const IMM_SLOT_BITS: u32 = 32 - IMM_VALUE_BITS;
/// Number of distinct slot ids.
pub const IMM_NUM_SLOT_IDS: u64 = 1 << IMM_SLOT_BITS;
/// Low-latency buffer sets that alternate.
pub const LL_NUM_SETS: u64 = 2;
/// Notify record slots per source (alternating by notify sequence number).
pub const NOTIFY_SLOTS: u64 = 2;
/// Largest hidden size accepted (keeps every product far inside `u64`).
pub const MAX_HIDDEN: usize = 1 << 20;
/// Largest top-k accepted.
pub const MAX_TOPK: usize = 256;
/// Channels per fp8 scale.
pub const FP8_GROUP: u64 = super::quant::FP8_GROUP as u64;

fn mul(a: u64, b: u64, arg: &'static str) -> Result<u64> {
    a.checked_mul(b).ok_or_else(|| Error::arg(arg, format!("{a} * {b} overflows u64")))
}

fn align_up(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}

/// Check `hidden` for `dtype`: positive, a multiple of 8 (16-byte bf16 rows), of 128 for fp8,
/// at most [`MAX_HIDDEN`].
pub fn check_hidden(hidden: usize, dtype: DispatchDtype) -> Result<()> {
    if hidden == 0 || hidden % 8 != 0 || hidden > MAX_HIDDEN {
        return Err(Error::arg(
            "hidden",
            format!("{hidden} is not a positive multiple of 8 up to {MAX_HIDDEN}"),
        ));
    }
    if dtype == DispatchDtype::Fp8E4m3 && hidden % FP8_GROUP as usize != 0 {
        return Err(Error::arg(
            "hidden",
            format!("{hidden} is not a multiple of 128, as fp8 needs"),
        ));
    }
    Ok(())
}

/// Check `topk_idx [num_tokens, num_topk]`: every entry is `-1` or in `0..num_experts`; with
/// `distinct`, no token names one expert twice. The error names `topk_idx`, the token and `k`.
pub fn check_topk_idx(
    topk_idx: &[i64],
    num_tokens: usize,
    num_topk: usize,
    num_experts: usize,
    distinct: bool,
) -> Result<()> {
    if Some(topk_idx.len()) != num_tokens.checked_mul(num_topk) {
        return Err(Error::arg(
            "topk_idx",
            format!("length {}, expected {num_tokens} * {num_topk}", topk_idx.len()),
        ));
    }
    if num_topk == 0 {
        return Ok(());
    }
    for (t, row) in topk_idx.chunks_exact(num_topk).enumerate() {
        for (k, &g) in row.iter().enumerate() {
            if g < -1 || g >= num_experts as i64 {
                return Err(Error::arg(
                    "topk_idx",
                    format!("token {t}, k {k}: expert {g} not in -1..{num_experts}"),
                ));
            }
            if distinct && g >= 0 && row[..k].contains(&g) {
                return Err(Error::arg(
                    "topk_idx",
                    format!("token {t}, k {k}: expert {g} selected twice"),
                ));
            }
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Records
// ---------------------------------------------------------------------------------------------

/// Byte layout of one wire record (see the module table). Offsets are from the record start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecordLayout {
    /// Payload format (combine records are always bf16).
    pub dtype: DispatchDtype,
    /// Channels.
    pub hidden: u64,
    /// Payload bytes at offset 0: `2 * hidden` (bf16) or `hidden` (e4m3).
    pub payload_bytes: u64,
    /// Offset of `num_scales` f32 (fp8 only).
    pub scales_offset: u64,
    pub num_scales: u64,
    /// Offset of `num_topk_idx` i32 local expert ids.
    pub topk_idx_offset: u64,
    pub num_topk_idx: u64,
    /// Offset of `num_topk_weights` f32.
    pub topk_weights_offset: u64,
    pub num_topk_weights: u64,
    /// Offset of the i32 source token index, if the record has one.
    pub src_idx_offset: Option<u64>,
    /// Record size, a multiple of [`RECORD_ALIGN`].
    pub bytes: u64,
}

/// The fields of one record, borrowed; used to write a record.
#[derive(Clone, Copy, Debug)]
pub struct RecordFields<'a> {
    /// `payload_bytes` bytes (bf16 bits little-endian, or e4m3 bytes).
    pub payload: &'a [u8],
    /// `num_scales` values.
    pub scales: &'a [f32],
    /// `num_topk_idx` local expert ids.
    pub topk_idx: &'a [i32],
    /// `num_topk_weights` values.
    pub topk_weights: &'a [f32],
    /// Source token index (ignored when the record has none).
    pub src_idx: i32,
}

impl RecordLayout {
    fn build(
        hidden: u64,
        dtype: DispatchDtype,
        num_topk_idx: u64,
        num_topk_weights: u64,
        with_src: bool,
        align: u64,
    ) -> Result<Self> {
        check_hidden(usize::try_from(hidden).unwrap_or(usize::MAX), dtype)?;
        if num_topk_idx > MAX_TOPK as u64 || num_topk_weights > MAX_TOPK as u64 {
            return Err(Error::arg("num_topk", format!("more than {MAX_TOPK}")));
        }
        let (payload_bytes, num_scales) = match dtype {
            DispatchDtype::Bf16 => (2 * hidden, 0),
            DispatchDtype::Fp8E4m3 => (hidden, hidden / FP8_GROUP),
        };
        let scales_offset = payload_bytes;
        let topk_idx_offset = scales_offset + 4 * num_scales;
        let topk_weights_offset = topk_idx_offset + 4 * num_topk_idx;
        let end = topk_weights_offset + 4 * num_topk_weights;
        let (src_idx_offset, end) = if with_src { (Some(end), end + 4) } else { (None, end) };
        Ok(RecordLayout {
            dtype,
            hidden,
            payload_bytes,
            scales_offset,
            num_scales,
            topk_idx_offset,
            num_topk_idx,
            topk_weights_offset,
            num_topk_weights,
            src_idx_offset,
            bytes: align_up(end, align),
        })
    }

    /// Normal-mode dispatch record: payload, scales (fp8), `num_topk` local ids, `num_topk`
    /// weights, source token index.
    pub fn normal_dispatch(hidden: u64, dtype: DispatchDtype, num_topk: u64) -> Result<Self> {
        Self::build(hidden, dtype, num_topk, num_topk, true, RECORD_ALIGN)
    }

    /// Normal-mode combine record: bf16 payload and `num_topk` weights.
    pub fn normal_combine(hidden: u64, num_topk: u64) -> Result<Self> {
        Self::build(hidden, DispatchDtype::Bf16, 0, num_topk, false, RECORD_ALIGN)
    }

    /// Low-latency dispatch record: payload, scales (fp8), source token index; padded to
    /// [`LL_DISPATCH_RECORD_ALIGN`].
    pub fn ll_dispatch(hidden: u64, dtype: DispatchDtype) -> Result<Self> {
        Self::build(hidden, dtype, 0, 0, true, LL_DISPATCH_RECORD_ALIGN)
    }

    /// Low-latency combine record: the bf16 row alone.
    pub fn ll_combine(hidden: u64) -> Result<Self> {
        Self::build(hidden, DispatchDtype::Bf16, 0, 0, false, RECORD_ALIGN)
    }

    /// Write one record into `out[..self.bytes]` (padding zeroed). Field lengths must match.
    pub fn write(&self, out: &mut [u8], f: &RecordFields<'_>) -> Result<()> {
        let have = out.len();
        let rec = out.get_mut(..self.bytes as usize).ok_or_else(|| {
            Error::arg("out", format!("{have} bytes, record needs {}", self.bytes))
        })?;
        let want = [
            ("payload", f.payload.len() as u64, self.payload_bytes),
            ("scales", f.scales.len() as u64, self.num_scales),
            ("topk_idx", f.topk_idx.len() as u64, self.num_topk_idx),
            ("topk_weights", f.topk_weights.len() as u64, self.num_topk_weights),
        ];
        for (arg, got, expected) in want {
            if got != expected {
                return Err(Error::arg(arg, format!("length {got}, record has {expected}")));
            }
        }
        let p = self.payload_bytes as usize;
        rec[..p].copy_from_slice(f.payload);
        let mut at = self.scales_offset as usize;
        for v in f
            .scales
            .iter()
            .map(|v| v.to_le_bytes())
            .chain(f.topk_idx.iter().map(|v| v.to_le_bytes()))
            .chain(f.topk_weights.iter().map(|v| v.to_le_bytes()))
        {
            rec[at..at + 4].copy_from_slice(&v);
            at += 4;
        }
        if let Some(o) = self.src_idx_offset {
            rec[o as usize..o as usize + 4].copy_from_slice(&f.src_idx.to_le_bytes());
            at = o as usize + 4;
        }
        rec[at..].fill(0);
        Ok(())
    }

    /// A read view of one record in `rec[..self.bytes]`.
    pub fn read<'a>(&self, rec: &'a [u8]) -> Result<RecordView<'a>> {
        if (rec.len() as u64) < self.bytes {
            return Err(Error::arg(
                "rec",
                format!("{} bytes, record needs {}", rec.len(), self.bytes),
            ));
        }
        Ok(RecordView { layout: *self, rec: &rec[..self.bytes as usize] })
    }
}

/// Read access to one record's fields (little-endian, unaligned-safe).
#[derive(Clone, Copy, Debug)]
pub struct RecordView<'a> {
    layout: RecordLayout,
    rec: &'a [u8],
}

impl<'a> RecordView<'a> {
    fn u32_at(&self, off: u64) -> [u8; 4] {
        let o = off as usize;
        [self.rec[o], self.rec[o + 1], self.rec[o + 2], self.rec[o + 3]]
    }
    /// The payload bytes.
    pub fn payload(&self) -> &'a [u8] {
        &self.rec[..self.layout.payload_bytes as usize]
    }
    /// Scale `i` (`i < num_scales`, else `None`).
    pub fn scale(&self, i: u64) -> Option<f32> {
        (i < self.layout.num_scales)
            .then(|| f32::from_le_bytes(self.u32_at(self.layout.scales_offset + 4 * i)))
    }
    /// Local expert id `k`.
    pub fn topk_idx(&self, k: u64) -> Option<i32> {
        (k < self.layout.num_topk_idx)
            .then(|| i32::from_le_bytes(self.u32_at(self.layout.topk_idx_offset + 4 * k)))
    }
    /// Weight `k`.
    pub fn topk_weight(&self, k: u64) -> Option<f32> {
        (k < self.layout.num_topk_weights)
            .then(|| f32::from_le_bytes(self.u32_at(self.layout.topk_weights_offset + 4 * k)))
    }
    /// Source token index.
    pub fn src_idx(&self) -> Option<i32> {
        self.layout.src_idx_offset.map(|o| i32::from_le_bytes(self.u32_at(o)))
    }
}

/// Sender side of normal dispatch: turn one token's global `topk_idx [K]` (i64, -1 = none)
/// and `topk_weights [K]` into the record's local ids for `dst_rank` (`-1` where the expert is
/// not on `dst_rank`) and weights (0 there). No allocation.
pub fn to_local_topk(
    topk_idx: &[i64],
    topk_weights: &[f32],
    dst_rank: u64,
    num_local_experts: u64,
    out_idx: &mut [i32],
    out_weights: &mut [f32],
) -> Result<()> {
    let k = topk_idx.len();
    if topk_weights.len() != k {
        return Err(Error::arg(
            "topk_weights",
            format!("length {}, expected {k}", topk_weights.len()),
        ));
    }
    if out_idx.len() != k || out_weights.len() != k {
        return Err(Error::arg("out_idx", format!("outputs must have length {k}")));
    }
    let begin = dst_rank.saturating_mul(num_local_experts) as i64;
    let end = begin.saturating_add(num_local_experts as i64);
    for i in 0..k {
        let g = topk_idx[i];
        if g >= begin && g < end && g >= 0 {
            out_idx[i] = (g - begin) as i32;
            out_weights[i] = topk_weights[i];
        } else {
            out_idx[i] = -1;
            out_weights[i] = 0.0;
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Immediate data
// ---------------------------------------------------------------------------------------------

/// Pack `(slot_id, value)`; errors if either does not fit.
pub fn imm_encode(slot_id: u64, value: u64) -> Result<u32> {
    if slot_id >= IMM_NUM_SLOT_IDS {
        return Err(Error::arg("slot_id", format!("{slot_id} does not fit {IMM_SLOT_BITS} bits")));
    }
    if value > IMM_VALUE_MAX as u64 {
        return Err(Error::arg("value", format!("{value} does not fit {IMM_VALUE_BITS} bits")));
    }
    Ok(((slot_id as u32) << IMM_VALUE_BITS) | value as u32)
}

/// Unpack into `(slot_id, value)`.
pub fn imm_decode(imm: u32) -> (u64, u64) {
    ((imm >> IMM_VALUE_BITS) as u64, (imm & IMM_VALUE_MAX) as u64)
}

/// Which direction of a normal-mode step a data write belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Phase {
    Dispatch = 0,
    Combine = 1,
}

/// A decoded normal-mode immediate. `src` is always the rank that posted the write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormalMsg {
    /// A chunk landed in the receiver's slot `(src, slot)`; `rows` tokens (1..=chunk_tokens).
    Data { phase: Phase, src: u64, slot: u64, rows: u64 },
    /// `src`'s notify record landed; `seq14` is its notify sequence number mod 2^14.
    Notify { src: u64, seq14: u64 },
    /// `src` consumed `chunks` chunks this rank sent it; their slots may be reused.
    Credit { src: u64, chunks: u64 },
}

/// The normal-mode slot id space, seen from the receiving rank:
///
/// ```text
/// data:   [0, 2*R*spp)          id = (phase * R + src) * spp + slot
/// notify: [2*R*spp, +R)         id = 2*R*spp + src
/// credit: [2*R*spp + R, +R)     id = 2*R*spp + R + src
/// ```
///
/// `R * (2 * spp + 2)` ids must fit in 18 bits (1024 ranks: spp <= 127).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NormalImm {
    pub num_ranks: u64,
    pub slots_per_peer: u64,
}

impl NormalImm {
    /// Errors (naming `slots_per_peer`, or `num_ranks` when even one slot does not fit) if the
    /// id space exceeds 18 bits.
    pub fn new(num_ranks: u64, slots_per_peer: u64) -> Result<Self> {
        if num_ranks == 0 {
            return Err(Error::arg("num_ranks", "must be at least 1"));
        }
        if slots_per_peer == 0 {
            return Err(Error::arg("slots_per_peer", "must be at least 1"));
        }
        let ids = num_ranks.checked_mul(2 * slots_per_peer.min(IMM_NUM_SLOT_IDS) + 2);
        if ids.is_none_or(|n| n > IMM_NUM_SLOT_IDS) {
            let max_spp = (IMM_NUM_SLOT_IDS / num_ranks).saturating_sub(2) / 2;
            if max_spp == 0 {
                return Err(Error::arg(
                    "num_ranks",
                    format!("{num_ranks} ranks do not fit the 18-bit immediate slot ids"),
                ));
            }
            return Err(Error::arg(
                "slots_per_peer",
                format!(
                    "{slots_per_peer} with {num_ranks} ranks needs more than 2^{IMM_SLOT_BITS} \
                     immediate slot ids; at most {max_spp}"
                ),
            ));
        }
        Ok(NormalImm { num_ranks, slots_per_peer })
    }

    /// Ids in use, `R * (2 * spp + 2)`.
    pub fn num_ids(&self) -> u64 {
        self.num_ranks * (2 * self.slots_per_peer + 2)
    }

    fn data_ids(&self) -> u64 {
        2 * self.num_ranks * self.slots_per_peer
    }

    fn check_src(&self, src: u64) -> Result<()> {
        if src >= self.num_ranks {
            return Err(Error::arg("src", format!("{src} not in 0..{}", self.num_ranks)));
        }
        Ok(())
    }

    /// Immediate of a data chunk from `src` into slot `slot` carrying `rows` tokens.
    pub fn data(&self, phase: Phase, src: u64, slot: u64, rows: u64) -> Result<u32> {
        self.check_src(src)?;
        if slot >= self.slots_per_peer {
            return Err(Error::arg("slot", format!("{slot} not in 0..{}", self.slots_per_peer)));
        }
        imm_encode(((phase as u64) * self.num_ranks + src) * self.slots_per_peer + slot, rows)
    }

    /// Immediate of `src`'s notify record with sequence number `seq`.
    pub fn notify(&self, src: u64, seq: u64) -> Result<u32> {
        self.check_src(src)?;
        imm_encode(self.data_ids() + src, seq & IMM_VALUE_MAX as u64)
    }

    /// Immediate of a credit from `src` returning `chunks` chunks.
    pub fn credit(&self, src: u64, chunks: u64) -> Result<u32> {
        self.check_src(src)?;
        imm_encode(self.data_ids() + self.num_ranks + src, chunks)
    }

    /// Decode an immediate that arrived; errors (naming `imm`) on ids outside the space.
    pub fn decode(&self, imm: u32) -> Result<NormalMsg> {
        let (id, value) = imm_decode(imm);
        let d = self.data_ids();
        if id < d {
            let slot = id % self.slots_per_peer;
            let ps = id / self.slots_per_peer;
            let phase = if ps >= self.num_ranks { Phase::Combine } else { Phase::Dispatch };
            Ok(NormalMsg::Data { phase, src: ps % self.num_ranks, slot, rows: value })
        } else if id < d + self.num_ranks {
            Ok(NormalMsg::Notify { src: id - d, seq14: value })
        } else if id < d + 2 * self.num_ranks {
            Ok(NormalMsg::Credit { src: id - d - self.num_ranks, chunks: value })
        } else {
            Err(Error::arg(
                "imm",
                format!("{imm:#010x}: slot id {id} outside 0..{}", self.num_ids()),
            ))
        }
    }
}

/// A decoded low-latency immediate; `value` fields are row counts (0 allowed: every pair
/// always gets one message, so the receiver knows when it is complete).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LlMsg {
    /// Rank `src` sent `count` tokens for the receiver's local expert `local_expert`.
    Dispatch { set: u64, local_expert: u64, src: u64, count: u64 },
    /// Rank `src` returned `count` rows of its local expert `local_expert` (global expert
    /// `src * L + local_expert`) for the receiver's tokens.
    Combine { set: u64, src: u64, local_expert: u64, count: u64 },
}

/// The low-latency slot id space, seen from the receiving rank:
///
/// ```text
/// id = ((phase * 2 + set) * E) + unit
/// dispatch: unit = local_expert * R + src     (the receive block [local_expert][src])
/// combine:  unit = src * L + local_expert     (the global expert that answered)
/// ```
///
/// `4 * E` ids must fit in 18 bits: `num_experts <= 65536`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LlImm {
    pub num_ranks: u64,
    pub num_experts: u64,
}

impl LlImm {
    pub fn new(num_ranks: u64, num_experts: u64) -> Result<Self> {
        if num_ranks == 0 {
            return Err(Error::arg("num_ranks", "must be at least 1"));
        }
        if num_experts == 0 || num_experts % num_ranks != 0 {
            return Err(Error::arg(
                "num_experts",
                format!("{num_experts} is not a positive multiple of num_ranks {num_ranks}"),
            ));
        }
        if num_experts > IMM_NUM_SLOT_IDS / (2 * LL_NUM_SETS) {
            return Err(Error::arg(
                "num_experts",
                format!(
                    "{num_experts} needs more than 2^{IMM_SLOT_BITS} immediate slot ids; at most {}",
                    IMM_NUM_SLOT_IDS / (2 * LL_NUM_SETS)
                ),
            ));
        }
        Ok(LlImm { num_ranks, num_experts })
    }

    fn local(&self) -> u64 {
        self.num_experts / self.num_ranks
    }

    /// Ids in use, `4 * E`.
    pub fn num_ids(&self) -> u64 {
        2 * LL_NUM_SETS * self.num_experts
    }

    fn check(&self, set: u64, rank: u64, local_expert: u64) -> Result<()> {
        if set >= LL_NUM_SETS {
            return Err(Error::arg("set", format!("{set} not in 0..{LL_NUM_SETS}")));
        }
        if rank >= self.num_ranks {
            return Err(Error::arg("src", format!("{rank} not in 0..{}", self.num_ranks)));
        }
        if local_expert >= self.local() {
            return Err(Error::arg(
                "local_expert",
                format!("{local_expert} not in 0..{}", self.local()),
            ));
        }
        Ok(())
    }

    /// Immediate of a dispatch message from `src` for the destination's `local_expert`.
    pub fn dispatch(&self, set: u64, local_expert: u64, src: u64, count: u64) -> Result<u32> {
        self.check(set, src, local_expert)?;
        imm_encode(set * self.num_experts + local_expert * self.num_ranks + src, count)
    }

    /// Immediate of a combine message from expert rank `src` (its `local_expert`).
    pub fn combine(&self, set: u64, src: u64, local_expert: u64, count: u64) -> Result<u32> {
        self.check(set, src, local_expert)?;
        imm_encode(
            (LL_NUM_SETS + set) * self.num_experts + src * self.local() + local_expert,
            count,
        )
    }

    /// Decode an immediate that arrived; errors (naming `imm`) on ids outside the space.
    pub fn decode(&self, imm: u32) -> Result<LlMsg> {
        let (id, count) = imm_decode(imm);
        if id >= self.num_ids() {
            return Err(Error::arg(
                "imm",
                format!("{imm:#010x}: slot id {id} outside 0..{}", self.num_ids()),
            ));
        }
        let (ps, unit) = (id / self.num_experts, id % self.num_experts);
        let set = ps % LL_NUM_SETS;
        Ok(if ps < LL_NUM_SETS {
            LlMsg::Dispatch {
                set,
                local_expert: unit / self.num_ranks,
                src: unit % self.num_ranks,
                count,
            }
        } else {
            LlMsg::Combine {
                set,
                src: unit / self.local(),
                local_expert: unit % self.local(),
                count,
            }
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Memory regions
// ---------------------------------------------------------------------------------------------

/// How a buffer of `total_units` equal units is split into memory regions no larger than a
/// provider's limit, never splitting a unit (one RMA write always targets one region).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RegionPlan {
    pub unit_bytes: u64,
    pub total_units: u64,
    pub units_per_region: u64,
    pub num_regions: u64,
}

impl RegionPlan {
    /// Errors (naming `max_region_bytes`) when one unit is larger than a region may be.
    pub fn new(unit_bytes: u64, total_units: u64, max_region_bytes: u64) -> Result<Self> {
        if unit_bytes == 0 {
            return Err(Error::arg("unit_bytes", "must be positive"));
        }
        let units_per_region = max_region_bytes / unit_bytes;
        if units_per_region == 0 {
            return Err(Error::arg(
                "max_region_bytes",
                format!("{max_region_bytes} is smaller than one unit of {unit_bytes} bytes"),
            ));
        }
        let units_per_region = units_per_region.min(total_units.max(1));
        Ok(RegionPlan {
            unit_bytes,
            total_units,
            units_per_region,
            num_regions: total_units.div_ceil(units_per_region),
        })
    }

    /// Bytes of the whole buffer.
    pub fn total_bytes(&self) -> u64 {
        self.total_units * self.unit_bytes
    }

    /// Byte range `(offset, len)` of region `i` within the buffer.
    pub fn region_range(&self, i: u64) -> Result<(u64, u64)> {
        if i >= self.num_regions {
            return Err(Error::arg("region", format!("{i} not in 0..{}", self.num_regions)));
        }
        let first = i * self.units_per_region;
        let units = self.units_per_region.min(self.total_units - first);
        Ok((first * self.unit_bytes, units * self.unit_bytes))
    }

    /// `(region, offset within region)` of a buffer byte offset.
    pub fn locate(&self, offset: u64) -> Result<(u64, u64)> {
        if offset >= self.total_bytes() {
            return Err(Error::arg("offset", format!("{offset} not in 0..{}", self.total_bytes())));
        }
        let region_bytes = self.units_per_region * self.unit_bytes;
        Ok((offset / region_bytes, offset % region_bytes))
    }
}

// ---------------------------------------------------------------------------------------------
// Normal mode
// ---------------------------------------------------------------------------------------------

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

// ---------------------------------------------------------------------------------------------
// Low-latency mode
// ---------------------------------------------------------------------------------------------

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

// ---------------------------------------------------------------------------------------------
// Cluster sizing (ep-bench plan)
// ---------------------------------------------------------------------------------------------

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

// Index loops over ranks/tokens/channels read closest to the math they check.
#[allow(clippy::needless_range_loop, clippy::type_complexity)]
#[cfg(test)]
mod tests {
    use super::*;
    use crate::ep::quant::{bf16_to_f32, f32_to_bf16, quantize_row_bf16};
    use crate::ep::reference::tests::{random_bf16, random_topk};
    use crate::ep::reference::{self as refm, Tokens, TokensRef};
    use crate::util::SplitMix64;

    const BF16: DispatchDtype = DispatchDtype::Bf16;
    const FP8: DispatchDtype = DispatchDtype::Fp8E4m3;

    #[test]
    fn record_layouts_at_deepseek_sizes() {
        let r = RecordLayout::normal_dispatch(7168, BF16, 8).unwrap();
        assert_eq!(
            (r.payload_bytes, r.topk_idx_offset, r.topk_weights_offset, r.src_idx_offset, r.bytes),
            (14336, 14336, 14368, Some(14400), 14416)
        );
        let r = RecordLayout::normal_dispatch(7168, FP8, 8).unwrap();
        assert_eq!(
            (r.payload_bytes, r.scales_offset, r.num_scales, r.topk_idx_offset, r.bytes),
            (7168, 7168, 56, 7392, 7472)
        );
        assert_eq!(RecordLayout::normal_combine(7168, 8).unwrap().bytes, 14368);
        assert_eq!(RecordLayout::ll_dispatch(7168, BF16).unwrap().bytes, 14464);
        assert_eq!(RecordLayout::ll_dispatch(7168, FP8).unwrap().bytes, 7424);
        for h in (128..8192).step_by(128) {
            for dt in [BF16, FP8] {
                let r = RecordLayout::ll_dispatch(h, dt).unwrap();
                assert_eq!(r.bytes % LL_DISPATCH_RECORD_ALIGN, 0, "{h} {dt:?}");
                assert_eq!(r.scales_offset % 16, 0, "{h} {dt:?}: the tail is written in 16 B");
            }
        }
        assert_eq!(RecordLayout::ll_combine(7168).unwrap().bytes, 14336);
        for h in (8..2048).step_by(8) {
            for k in [0, 1, 3, 8, 9] {
                let r = RecordLayout::normal_dispatch(h, BF16, k).unwrap();
                assert_eq!(r.bytes % RECORD_ALIGN, 0);
                assert!(r.bytes >= 2 * h + 8 * k + 4 && r.bytes < 2 * h + 8 * k + 4 + 16);
            }
        }
        assert!(matches!(
            RecordLayout::normal_dispatch(7176, FP8, 8),
            Err(Error::InvalidArgument { arg: "hidden", .. })
        ));
        assert!(matches!(
            RecordLayout::ll_combine(12),
            Err(Error::InvalidArgument { arg: "hidden", .. })
        ));
    }

    #[test]
    fn record_write_read_round_trip() {
        let r = RecordLayout::normal_dispatch(256, FP8, 3).unwrap();
        let payload: Vec<u8> = (0..256).map(|i| i as u8).collect();
        let mut out = vec![0xAAu8; r.bytes as usize + 5];
        let f = RecordFields {
            payload: &payload,
            scales: &[0.5, 2.0],
            topk_idx: &[3, -1, 0],
            topk_weights: &[0.25, 0.0, 1.5],
            src_idx: 12345,
        };
        r.write(&mut out, &f).unwrap();
        let v = r.read(&out).unwrap();
        assert_eq!(v.payload(), &payload[..]);
        assert_eq!((v.scale(0), v.scale(1), v.scale(2)), (Some(0.5), Some(2.0), None));
        assert_eq!(
            (0..4).map(|k| v.topk_idx(k)).collect::<Vec<_>>(),
            vec![Some(3), Some(-1), Some(0), None]
        );
        assert_eq!(v.topk_weight(2), Some(1.5));
        assert_eq!(v.src_idx(), Some(12345));
        let end = r.src_idx_offset.unwrap() as usize + 4;
        assert!(out[end..r.bytes as usize].iter().all(|&b| b == 0), "padding zeroed");
        assert!(out[r.bytes as usize..].iter().all(|&b| b == 0xAA), "nothing past the record");
        let short = RecordFields { scales: &[1.0], ..f };
        assert!(matches!(
            r.write(&mut out, &short),
            Err(Error::InvalidArgument { arg: "scales", .. })
        ));
        assert!(matches!(
            r.write(&mut out[..10], &f),
            Err(Error::InvalidArgument { arg: "out", .. })
        ));
        assert!(matches!(r.read(&out[..10]), Err(Error::InvalidArgument { arg: "rec", .. })));
    }

    #[test]
    fn local_topk_matches_deepep_sender() {
        let idx = [5i64, -1, 2, 3, 7];
        let w = [0.1f32, 0.2, 0.3, 0.4, 0.5];
        let (mut oi, mut ow) = ([0i32; 5], [0f32; 5]);
        to_local_topk(&idx, &w, 1, 2, &mut oi, &mut ow).unwrap(); // rank 1 holds experts 2, 3
        assert_eq!(oi, [-1, -1, 0, 1, -1]);
        assert_eq!(ow, [0.0, 0.0, 0.3, 0.4, 0.0]);
        assert!(to_local_topk(&idx, &w[..4], 1, 2, &mut oi, &mut ow).is_err());
    }

    #[test]
    fn imm_ids_are_unique_and_decode_back() {
        for (r, spp) in [(1u64, 1u64), (3, 2), (8, 5)] {
            let imm = NormalImm::new(r, spp).unwrap();
            let mut seen = std::collections::HashSet::new();
            for phase in [Phase::Dispatch, Phase::Combine] {
                for src in 0..r {
                    for slot in 0..spp {
                        let v = imm.data(phase, src, slot, 77).unwrap();
                        assert!(seen.insert(v >> IMM_VALUE_BITS));
                        assert_eq!(
                            imm.decode(v).unwrap(),
                            NormalMsg::Data { phase, src, slot, rows: 77 }
                        );
                    }
                }
            }
            for src in 0..r {
                let v = imm.notify(src, 0x4005).unwrap();
                assert!(seen.insert(v >> IMM_VALUE_BITS));
                assert_eq!(imm.decode(v).unwrap(), NormalMsg::Notify { src, seq14: 5 });
                let v = imm.credit(src, 3).unwrap();
                assert!(seen.insert(v >> IMM_VALUE_BITS));
                assert_eq!(imm.decode(v).unwrap(), NormalMsg::Credit { src, chunks: 3 });
            }
            assert_eq!(seen.len() as u64, imm.num_ids());
            assert!(seen.iter().all(|&id| (id as u64) < imm.num_ids()));
            assert!(imm.decode((imm.num_ids() as u32) << IMM_VALUE_BITS).is_err());
            assert!(imm.data(Phase::Dispatch, r, 0, 1).is_err());
            assert!(imm.data(Phase::Dispatch, 0, spp, 1).is_err());
            assert!(matches!(
                imm.data(Phase::Dispatch, 0, 0, 1 << 14),
                Err(Error::InvalidArgument { arg: "value", .. })
            ));
        }
        for (r, e) in [(1u64, 1u64), (2, 6), (4, 4)] {
            let imm = LlImm::new(r, e).unwrap();
            let l = e / r;
            let mut seen = std::collections::HashSet::new();
            for set in 0..2 {
                for src in 0..r {
                    for le in 0..l {
                        let v = imm.dispatch(set, le, src, 9).unwrap();
                        assert!(seen.insert(v >> IMM_VALUE_BITS));
                        let m = LlMsg::Dispatch { set, local_expert: le, src, count: 9 };
                        assert_eq!(imm.decode(v).unwrap(), m);
                        let v = imm.combine(set, src, le, 0).unwrap();
                        assert!(seen.insert(v >> IMM_VALUE_BITS));
                        let m = LlMsg::Combine { set, src, local_expert: le, count: 0 };
                        assert_eq!(imm.decode(v).unwrap(), m);
                    }
                }
            }
            assert_eq!(seen.len() as u64, imm.num_ids());
            assert!(imm.decode((imm.num_ids() as u32) << IMM_VALUE_BITS).is_err());
            assert!(imm.dispatch(2, 0, 0, 0).is_err());
        }
        // The limits: 18 bits of ids.
        assert!(NormalImm::new(1 << 16, 1).is_ok());
        assert!(matches!(
            NormalImm::new(1 << 16, 2),
            Err(Error::InvalidArgument { arg: "slots_per_peer", .. })
        ));
        assert!(matches!(
            NormalImm::new(1 << 17, 1),
            Err(Error::InvalidArgument { arg: "num_ranks", .. })
        ));
        assert!(LlImm::new(1, 1 << 16).is_ok());
        assert!(matches!(
            LlImm::new(1, (1 << 16) + 1),
            Err(Error::InvalidArgument { arg: "num_experts", .. })
        ));
        assert_eq!(imm_decode(imm_encode((1 << 18) - 1, 0x3fff).unwrap()), ((1 << 18) - 1, 0x3fff));
        assert!(imm_encode(1 << 18, 0).is_err());
    }

    #[test]
    fn region_plans_never_split_a_unit() {
        for (unit, units, max) in [(100u64, 10u64, 250u64), (7, 1, 7), (16, 1000, 4096), (5, 0, 5)]
        {
            let p = RegionPlan::new(unit, units, max).unwrap();
            assert_eq!(p.num_regions, if units == 0 { 0 } else { units.div_ceil(max / unit) });
            let mut covered = 0;
            for i in 0..p.num_regions {
                let (off, len) = p.region_range(i).unwrap();
                assert_eq!(off, covered);
                assert!(len <= max && len % unit == 0 && len > 0);
                covered += len;
            }
            assert_eq!(covered, p.total_bytes());
            for u in 0..units {
                let (r0, o0) = p.locate(u * unit).unwrap();
                let (r1, o1) = p.locate(u * unit + unit - 1).unwrap();
                assert_eq!(r0, r1, "unit {u} split");
                assert_eq!(o1, o0 + unit - 1);
                assert_eq!(p.region_range(r0).unwrap().0 + o0, u * unit);
            }
            assert!(p.locate(p.total_bytes()).is_err());
        }
        assert!(matches!(
            RegionPlan::new(100, 3, 99),
            Err(Error::InvalidArgument { arg: "max_region_bytes", .. })
        ));
    }

    #[test]
    fn chunk_math() {
        let l = NormalLayout::from_parts(2, 2, 8, 1, BF16, 5, 3).unwrap();
        assert_eq!(
            (l.num_chunks(0), l.num_chunks(1), l.num_chunks(5), l.num_chunks(6)),
            (0, 1, 1, 2)
        );
        for n in 0..40 {
            let rows: Vec<u64> = (0..l.num_chunks(n)).map(|k| l.chunk_rows(n, k)).collect();
            assert_eq!(rows.iter().sum::<u64>(), n);
            assert!(rows.iter().all(|&r| (1..=5).contains(&r)));
            assert_eq!(l.chunk_rows(n, l.num_chunks(n)), 0);
            let mut at = 0;
            for k in 0..l.num_chunks(n) {
                let (b, e) = l.chunk_range(n, k);
                assert_eq!((b, e - b), (at, rows[k as usize]));
                at = e;
            }
        }
        assert_eq!(l.chunk_slot(7), 1);
        assert_eq!(l.recv_slot_offset(1, 2).unwrap(), 5 * l.slot_bytes);
        assert!(l.recv_slot_offset(2, 0).is_err() && l.recv_slot_offset(0, 3).is_err());
        assert_eq!(l.notify_offset(1, 3).unwrap(), 3 * l.notify_record_bytes);
        assert!(l.row_offset(Phase::Dispatch, 5).is_err());
    }

    #[test]
    fn notify_records_round_trip_and_are_bounds_checked() {
        let rec = NotifyRecord { seq: 7, num_tokens: 10, tokens_per_local_expert: vec![3, 10, 0] };
        let mut buf = vec![0xffu8; NotifyRecord::bytes(3) as usize];
        assert_eq!(buf.len(), 32);
        rec.encode(&mut buf).unwrap();
        assert_eq!(NotifyRecord::decode(&buf, 3).unwrap(), rec);
        let from = NotifyRecord::for_destination(1, 7, &[4, 10], &[1, 1, 1, 3, 10, 0]).unwrap();
        assert_eq!(from, rec);

        let layout = NormalLayout::from_parts(2, 6, 8, 2, BF16, 4, 2).unwrap();
        let ok = NotifyRecord { seq: 0, num_tokens: 5, tokens_per_local_expert: vec![5, 1, 0] };
        let p = RecvPlan::new(0, &[ok.clone(), rec.clone()], &layout, 4, None).unwrap();
        assert_eq!(p.rank_prefix, vec![0, 5, 15]);
        assert_eq!(p.tokens_per_local_expert, vec![8, 12, 0]);
        assert_eq!(p.chunks_from, vec![2, 3]);
        assert_eq!(p.out_row(&layout, 1, 2, 1).unwrap(), 5 + 9);
        assert!(p.out_row(&layout, 1, 2, 2).is_err());
        let w = RecvPlan::new(0, &[ok.clone(), rec.clone()], &layout, 1, Some(15)).unwrap();
        assert_eq!((w.num_recv_tokens, w.num_out_rows), (15, 15));
        assert!(matches!(
            RecvPlan::new(0, &[ok.clone(), rec.clone()], &layout, 1, Some(14)),
            Err(Error::InvalidArgument { arg: "num_worst_tokens", .. })
        ));
        // From the network: counts that cannot be are protocol errors naming the peer.
        let bad = NotifyRecord { seq: 0, num_tokens: 2, tokens_per_local_expert: vec![5, 0, 0] };
        assert!(matches!(
            RecvPlan::new(0, &[ok.clone(), bad], &layout, 1, None),
            Err(Error::Protocol { peer: 1, .. })
        ));
        let bad = NotifyRecord { seq: 0, num_tokens: 2, tokens_per_local_expert: vec![1, 0, 0] };
        assert!(matches!(
            RecvPlan::new(3, &[bad, ok.clone()], &layout, 1, None),
            Err(Error::Protocol { rank: 3, peer: 0, .. })
        ));
        let bad = NotifyRecord { seq: 0, num_tokens: 2, tokens_per_local_expert: vec![1, 1] };
        assert!(matches!(
            RecvPlan::new(0, &[ok.clone(), bad], &layout, 1, None),
            Err(Error::Protocol { peer: 1, .. })
        ));
        assert!(matches!(
            RecvPlan::new(0, &[ok.clone(), rec.clone()], &layout, 0, None),
            Err(Error::InvalidArgument { arg: "expert_alignment", .. })
        ));
    }

    // -----------------------------------------------------------------------------------------
    // An in-memory cluster running the normal-mode protocol through plan.rs, with every RMA
    // write delivered in random order, checked against the reference.
    // -----------------------------------------------------------------------------------------

    struct Write {
        src: usize,
        dst: usize,
        /// Staging offset on `src` (read at delivery, as a NIC would) or inline bytes.
        from_staging: Option<u64>,
        inline: Vec<u8>,
        len: u64,
        to_notify: bool,
        dst_off: u64,
        imm: u32,
    }

    struct Rank {
        recv: Vec<u8>,
        staging: Vec<u8>,
        notify: Vec<u8>,
        filled: Vec<Option<u64>>,
        notified: Vec<bool>,
        /// Per destination: encoded records still to send, next chunk, chunks not yet credited.
        out: Vec<Vec<Vec<u8>>>,
        next_k: Vec<u64>,
        uncredited: Vec<u64>,
        /// Per source: expected tokens (once known), next chunk to consume, records received.
        expect: Vec<Option<u64>>,
        consume_k: Vec<u64>,
        got: Vec<Vec<Vec<u8>>>,
    }

    /// Moves `streams[src][dst]` (encoded records) from every src to every dst through the
    /// bounded queues. With `notify`, `notify[src][dst]` goes first through the notify region
    /// and tells the receiver how many records to expect; otherwise the receiver knows.
    /// Returns `[dst][src]` records in arrival-consumption order and the decoded notifies.
    fn run_queues(
        layout: &NormalLayout,
        phase: Phase,
        streams: Vec<Vec<Vec<Vec<u8>>>>,
        notify: Option<Vec<Vec<NotifyRecord>>>,
        rng: &mut SplitMix64,
    ) -> (Vec<Vec<Vec<Vec<u8>>>>, Vec<Vec<NotifyRecord>>) {
        let n = layout.num_ranks as usize;
        let spp = layout.slots_per_peer;
        let rec_bytes = layout.record(phase).bytes;
        let mut ranks: Vec<Rank> = (0..n)
            .map(|me| Rank {
                recv: vec![0; layout.recv_bytes() as usize],
                staging: vec![0; layout.send_bytes() as usize],
                notify: vec![0; layout.notify_bytes() as usize],
                filled: vec![None; n * spp as usize],
                notified: vec![false; n],
                out: streams[me].clone(),
                next_k: vec![0; n],
                uncredited: vec![0; n],
                expect: (0..n)
                    .map(|s| notify.is_none().then(|| streams[s][me].len() as u64))
                    .collect(),
                consume_k: vec![0; n],
                got: vec![Vec::new(); n],
            })
            .collect();
        let mut pool: Vec<Write> = Vec::new();
        if let Some(nt) = &notify {
            for (src, row) in nt.iter().enumerate() {
                for (dst, rec) in row.iter().enumerate() {
                    let mut b = vec![0; layout.notify_record_bytes as usize];
                    rec.encode(&mut b).unwrap();
                    pool.push(Write {
                        src,
                        dst,
                        from_staging: None,
                        len: b.len() as u64,
                        inline: b,
                        to_notify: true,
                        dst_off: layout.notify_offset(src as u64, rec.seq as u64).unwrap(),
                        imm: layout.imm.notify(src as u64, rec.seq as u64).unwrap(),
                    });
                }
            }
        }
        let mut rounds = 0;
        loop {
            rounds += 1;
            assert!(rounds < 1_000_000, "no progress: deadlock");
            for me in 0..n {
                // Send: at most spp chunks in flight per destination.
                for dst in 0..n {
                    let total = ranks[me].out[dst].len() as u64;
                    while ranks[me].next_k[dst] < layout.num_chunks(total)
                        && ranks[me].uncredited[dst] < spp
                    {
                        let k = ranks[me].next_k[dst];
                        let slot = layout.chunk_slot(k);
                        let (b, e) = layout.chunk_range(total, k);
                        let off = layout.send_slot_offset(dst as u64, slot).unwrap();
                        for (i, t) in (b..e).enumerate() {
                            let at = (off + layout.row_offset(phase, i as u64).unwrap()) as usize;
                            let rec = ranks[me].out[dst][t as usize].clone();
                            ranks[me].staging[at..at + rec.len()].copy_from_slice(&rec);
                        }
                        pool.push(Write {
                            src: me,
                            dst,
                            from_staging: Some(off),
                            inline: Vec::new(),
                            len: (e - b) * rec_bytes,
                            to_notify: false,
                            dst_off: layout.recv_slot_offset(me as u64, slot).unwrap(),
                            imm: layout.imm.data(phase, me as u64, slot, e - b).unwrap(),
                        });
                        ranks[me].next_k[dst] += 1;
                        ranks[me].uncredited[dst] += 1;
                    }
                }
                // Receive: strictly in chunk order per source, credit each chunk.
                for src in 0..n {
                    let Some(total) = ranks[me].expect[src] else { continue };
                    loop {
                        let k = ranks[me].consume_k[src];
                        if k >= layout.num_chunks(total) {
                            break;
                        }
                        let slot = layout.chunk_slot(k);
                        let Some(rows) = ranks[me].filled[src * spp as usize + slot as usize]
                        else {
                            break;
                        };
                        assert_eq!(rows, layout.chunk_rows(total, k), "rows in imm");
                        let off = layout.recv_slot_offset(src as u64, slot).unwrap();
                        for i in 0..rows {
                            let at = (off + layout.row_offset(phase, i).unwrap()) as usize;
                            let rec = ranks[me].recv[at..at + rec_bytes as usize].to_vec();
                            ranks[me].got[src].push(rec);
                        }
                        ranks[me].filled[src * spp as usize + slot as usize] = None;
                        ranks[me].consume_k[src] += 1;
                        pool.push(Write {
                            src: me,
                            dst: src,
                            from_staging: None,
                            inline: Vec::new(),
                            len: 0,
                            to_notify: false,
                            dst_off: 0,
                            imm: layout.imm.credit(me as u64, 1).unwrap(),
                        });
                    }
                }
            }
            if pool.is_empty() {
                break;
            }
            let w = pool.swap_remove(rng.below(pool.len() as u64) as usize);
            let bytes = match w.from_staging {
                Some(off) => ranks[w.src].staging[off as usize..(off + w.len) as usize].to_vec(),
                None => w.inline.clone(),
            };
            let d = &mut ranks[w.dst];
            let region = if w.to_notify { &mut d.notify } else { &mut d.recv };
            region[w.dst_off as usize..w.dst_off as usize + bytes.len()].copy_from_slice(&bytes);
            match layout.imm.decode(w.imm).unwrap() {
                NormalMsg::Data { phase: p, src, slot, rows } => {
                    assert_eq!(p, phase);
                    assert_eq!(src as usize, w.src);
                    let cell = &mut d.filled[(src * spp + slot) as usize];
                    assert!(cell.is_none(), "slot overwritten before it was consumed");
                    *cell = Some(rows);
                }
                NormalMsg::Notify { src, .. } => {
                    assert!(!d.notified[src as usize]);
                    d.notified[src as usize] = true;
                    let off = layout.notify_offset(src, 0).unwrap() as usize;
                    let rec =
                        NotifyRecord::decode(&d.notify[off..], layout.num_local_experts).unwrap();
                    d.expect[src as usize] = Some(rec.num_tokens as u64);
                }
                NormalMsg::Credit { src, chunks } => {
                    assert!(d.uncredited[src as usize] >= chunks);
                    d.uncredited[src as usize] -= chunks;
                }
            }
        }
        let mut notifies = vec![Vec::new(); n];
        for (me, r) in ranks.iter().enumerate() {
            for src in 0..n {
                assert_eq!(r.consume_k[src], layout.num_chunks(r.got[src].len() as u64));
                assert_eq!(r.uncredited[src], 0, "rank {me}: credits outstanding to {src}");
                if notify.is_some() {
                    let off = layout.notify_offset(src as u64, 0).unwrap() as usize;
                    notifies[me].push(
                        NotifyRecord::decode(&r.notify[off..], layout.num_local_experts).unwrap(),
                    );
                }
            }
        }
        (ranks.into_iter().map(|r| r.got).collect(), notifies)
    }

    /// `[t, R]` as the layout step would produce it (private; layout.rs is elsewhere).
    fn is_token_in_rank(topk: &[i64], t: usize, k: usize, r: usize, l: usize) -> Vec<bool> {
        let mut v = vec![false; t * r];
        for i in 0..t {
            for &g in &topk[i * k..(i + 1) * k] {
                if g >= 0 {
                    v[i * r + g as usize / l] = true;
                }
            }
        }
        v
    }

    #[allow(clippy::too_many_arguments)]
    fn normal_protocol_matches_reference(
        seed: u64,
        r: usize,
        e: usize,
        k: usize,
        h: usize,
        tokens: &[usize],
        fp8: bool,
        chunk: u64,
        spp: u64,
    ) {
        let mut rng = SplitMix64(seed);
        let l = e / r;
        let groups = h / 128;
        let dtype = if fp8 { FP8 } else { BF16 };
        let layout =
            NormalLayout::from_parts(r as u64, e as u64, h as u64, k as u64, dtype, chunk, spp)
                .unwrap();
        let xs: Vec<Vec<u16>> = tokens.iter().map(|&t| random_bf16(&mut rng, t * h)).collect();
        let q: Vec<(Vec<u8>, Vec<f32>)> = xs
            .iter()
            .map(|x| {
                if fp8 {
                    crate::ep::quant::quantize_bf16(x, h, false).unwrap()
                } else {
                    (vec![], vec![])
                }
            })
            .collect();
        let idxs: Vec<Vec<i64>> =
            tokens.iter().map(|&t| random_topk(&mut rng, t, k, e, 0.15)).collect();
        let ws: Vec<Vec<f32>> =
            tokens.iter().map(|&t| (0..t * k).map(|_| rng.unit_f32()).collect()).collect();

        // Sender side: send plans, notify records and the encoded record streams.
        let plans: Vec<SendPlan> = (0..r)
            .map(|s| {
                let itr = is_token_in_rank(&idxs[s], tokens[s], k, r, l);
                SendPlan::from_is_token_in_rank(&itr, tokens[s] as u64, r as u64).unwrap()
            })
            .collect();
        let mut notify = Vec::new();
        let mut streams = Vec::new();
        for s in 0..r {
            let per_rank: Vec<u32> =
                (0..r).map(|d| plans[s].tokens_for(d as u64).len() as u32).collect();
            let mut per_expert = vec![0u32; e];
            for &g in idxs[s].iter().filter(|&&g| g >= 0) {
                per_expert[g as usize] += 1;
            }
            notify.push(
                (0..r as u64)
                    .map(|d| NotifyRecord::for_destination(d, 0, &per_rank, &per_expert).unwrap())
                    .collect(),
            );
            let rec = layout.dispatch_record;
            let (mut li, mut lw) = (vec![0i32; k], vec![0f32; k]);
            let mut payload = vec![0u8; rec.payload_bytes as usize];
            let row: Vec<Vec<Vec<u8>>> = (0..r as u64)
                .map(|d| {
                    plans[s]
                        .tokens_for(d)
                        .iter()
                        .map(|&t| {
                            let t = t as usize;
                            to_local_topk(
                                &idxs[s][t * k..(t + 1) * k],
                                &ws[s][t * k..(t + 1) * k],
                                d,
                                l as u64,
                                &mut li,
                                &mut lw,
                            )
                            .unwrap();
                            let scales: &[f32] = if fp8 {
                                payload.copy_from_slice(&q[s].0[t * h..(t + 1) * h]);
                                &q[s].1[t * groups..(t + 1) * groups]
                            } else {
                                for (c, &b) in xs[s][t * h..(t + 1) * h].iter().enumerate() {
                                    payload[2 * c..2 * c + 2].copy_from_slice(&b.to_le_bytes());
                                }
                                &[]
                            };
                            let mut out = vec![0u8; rec.bytes as usize];
                            let f = RecordFields {
                                payload: &payload,
                                scales,
                                topk_idx: &li,
                                topk_weights: &lw,
                                src_idx: t as i32,
                            };
                            rec.write(&mut out, &f).unwrap();
                            out
                        })
                        .collect()
                })
                .collect();
            streams.push(row);
        }
        let (got, notifies) = run_queues(&layout, Phase::Dispatch, streams, Some(notify), &mut rng);

        // Reference.
        let inputs: Vec<refm::NormalRankInput> = (0..r)
            .map(|s| refm::NormalRankInput {
                x: if fp8 {
                    TokensRef::Fp8 { x: &q[s].0, scales: &q[s].1 }
                } else {
                    TokensRef::Bf16(&xs[s])
                },
                topk_idx: &idxs[s],
                topk_weights: &ws[s],
            })
            .collect();
        let p = refm::NormalParams {
            num_experts: e,
            hidden: h,
            num_topk: k,
            expert_alignment: 4,
            num_worst_tokens: None,
        };
        let want = refm::normal_dispatch(&p, &inputs).unwrap();

        // Receiver side: the plan from the notifies, then records -> outputs.
        let mut recv_x_all = Vec::new();
        for d in 0..r {
            let plan = RecvPlan::new(d, &notifies[d], &layout, 4, None).unwrap();
            let w = &want[d];
            assert_eq!(
                plan.rank_prefix.iter().map(|&v| v as usize).collect::<Vec<_>>(),
                w.rank_prefix
            );
            assert_eq!(
                plan.tokens_per_local_expert.iter().map(|&v| v as usize).collect::<Vec<_>>(),
                w.num_recv_tokens_per_expert
            );
            let rows = plan.num_out_rows as usize;
            let (mut xb, mut x8, mut sc) =
                (vec![0u16; rows * h], vec![0u8; rows * h], vec![0f32; rows * groups]);
            let (mut ti, mut tw) = (vec![-1i64; rows * k], vec![0f32; rows * k]);
            let (mut sr, mut si) = (vec![0i32; rows], vec![0i32; rows]);
            for s in 0..r {
                for (i, recb) in got[d][s].iter().enumerate() {
                    let (kk, row) = (i as u64 / chunk, i as u64 % chunk);
                    let o = plan.out_row(&layout, s as u64, kk, row).unwrap() as usize;
                    let v = layout.dispatch_record.read(recb).unwrap();
                    if fp8 {
                        x8[o * h..(o + 1) * h].copy_from_slice(v.payload());
                        for g in 0..groups {
                            sc[o * groups + g] = v.scale(g as u64).unwrap();
                        }
                    } else {
                        for c in 0..h {
                            xb[o * h + c] =
                                u16::from_le_bytes([v.payload()[2 * c], v.payload()[2 * c + 1]]);
                        }
                    }
                    for j in 0..k {
                        ti[o * k + j] = v.topk_idx(j as u64).unwrap() as i64;
                        tw[o * k + j] = v.topk_weight(j as u64).unwrap();
                    }
                    sr[o] = s as i32;
                    si[o] = v.src_idx().unwrap();
                }
            }
            let recv_x =
                if fp8 { Tokens::Fp8 { x: x8, scales: sc } } else { Tokens::Bf16(xb.clone()) };
            assert_eq!(recv_x, w.recv_x, "rank {d} recv_x");
            assert_eq!(ti, w.recv_topk_idx, "rank {d} recv_topk_idx");
            assert_eq!(tw, w.recv_topk_weights, "rank {d} recv_topk_weights");
            assert_eq!((sr, si), (w.recv_src_rank.clone(), w.recv_src_idx.clone()));
            recv_x_all.push(xb);
        }
        if fp8 {
            return;
        }

        // Combine through the same queues, reversed: rank d returns row o scaled by (d + 1).
        let ys: Vec<Vec<u16>> = recv_x_all
            .iter()
            .enumerate()
            .map(|(d, x)| {
                x.iter().map(|&b| f32_to_bf16(bf16_to_f32(b) * (d as f32 + 1.0))).collect()
            })
            .collect();
        let crec = layout.combine_record;
        let mut streams = vec![vec![Vec::new(); r]; r];
        for d in 0..r {
            let w = &want[d];
            for s in 0..r {
                for o in w.rank_prefix[s]..w.rank_prefix[s + 1] {
                    let payload: Vec<u8> =
                        ys[d][o * h..(o + 1) * h].iter().flat_map(|b| b.to_le_bytes()).collect();
                    let mut out = vec![0u8; crec.bytes as usize];
                    let f = RecordFields {
                        payload: &payload,
                        scales: &[],
                        topk_idx: &[],
                        topk_weights: &w.recv_topk_weights[o * k..(o + 1) * k],
                        src_idx: 0,
                    };
                    crec.write(&mut out, &f).unwrap();
                    streams[d][s].push(out);
                }
            }
        }
        let (got, _) = run_queues(&layout, Phase::Combine, streams, None, &mut rng);
        let cin: Vec<refm::NormalCombineInput> = (0..r)
            .map(|d| refm::NormalCombineInput {
                x: &ys[d],
                topk_weights: Some(&want[d].recv_topk_weights),
            })
            .collect();
        let cwant = refm::normal_combine(&p, &want, &cin).unwrap();
        for s in 0..r {
            // Contributions kept per source rank and summed in ascending rank order.
            let mut acc = vec![0f32; tokens[s] * h];
            let mut accw = vec![0f32; tokens[s] * k];
            for d in 0..r {
                let toks = plans[s].tokens_for(d as u64);
                assert_eq!(got[s][d].len(), toks.len());
                for (i, recb) in got[s][d].iter().enumerate() {
                    let v = crec.read(recb).unwrap();
                    let t = toks[i] as usize;
                    for c in 0..h {
                        acc[t * h + c] += bf16_to_f32(u16::from_le_bytes([
                            v.payload()[2 * c],
                            v.payload()[2 * c + 1],
                        ]));
                    }
                    for j in 0..k {
                        accw[t * k + j] += v.topk_weight(j as u64).unwrap();
                    }
                }
            }
            let cx: Vec<u16> = acc.into_iter().map(f32_to_bf16).collect();
            assert_eq!(cx, cwant[s].combined_x, "rank {s} combined_x");
            assert_eq!(Some(accw), cwant[s].combined_topk_weights, "rank {s} combined weights");
        }
    }

    #[test]
    fn normal_protocol_over_unordered_delivery_matches_reference() {
        normal_protocol_matches_reference(1, 4, 16, 4, 32, &[37, 50, 0, 13], false, 5, 2);
        normal_protocol_matches_reference(2, 4, 8, 2, 256, &[20, 3, 9, 0], true, 4, 1);
        normal_protocol_matches_reference(3, 1, 4, 2, 16, &[25], false, 7, 3);
        normal_protocol_matches_reference(4, 3, 6, 6, 8, &[11, 0, 5], false, 1, 1); // all experts
        normal_protocol_matches_reference(5, 8, 32, 3, 8, &[9, 1, 0, 0, 30, 2, 7, 4], false, 3, 4);
        normal_protocol_matches_reference(6, 2, 2, 1, 16, &[0, 0], false, 2, 2);
        // nothing at all
    }

    // -----------------------------------------------------------------------------------------
    // The low-latency protocol through plan.rs, unordered, against the reference.
    // -----------------------------------------------------------------------------------------

    fn ll_protocol_matches_reference(
        seed: u64,
        e: usize,
        k: usize,
        h: usize,
        m: usize,
        tokens: &[usize],
        fp8: bool,
    ) {
        let r = tokens.len();
        let l = e / r;
        let mut rng = SplitMix64(seed);
        let layout = LlLayout::from_parts(
            r as u64,
            e as u64,
            h as u64,
            if fp8 { FP8 } else { BF16 },
            m as u64,
        )
        .unwrap();
        let xs: Vec<Vec<u16>> = tokens.iter().map(|&t| random_bf16(&mut rng, t * h)).collect();
        let idxs: Vec<Vec<i64>> =
            tokens.iter().map(|&t| random_topk(&mut rng, t, k, e, 0.2)).collect();
        let ws: Vec<Vec<f32>> =
            tokens.iter().map(|&t| (0..t * k).map(|_| rng.unit_f32() - 0.3).collect()).collect();
        let mut bufs: Vec<Vec<u8>> =
            (0..r).map(|_| vec![0u8; layout.total_bytes() as usize]).collect();
        let plans: Vec<LlSendPlan> = (0..r)
            .map(|s| LlSendPlan::new(&idxs[s], tokens[s] as u64, k as u64, &layout).unwrap())
            .collect();
        let (dset, cset) = (0u64, 1u64);
        let rec = layout.dispatch_record;
        let groups = h / 128;

        // Dispatch: pack rows at (g, pos), then one write per (dst, local expert).
        let mut pool = Vec::new();
        for s in 0..r {
            let mut payload = vec![0u8; rec.payload_bytes as usize];
            let mut scales = vec![0f32; if fp8 { groups } else { 0 }];
            for t in 0..tokens[s] {
                let row = &xs[s][t * h..(t + 1) * h];
                if fp8 {
                    quantize_row_bf16(row, false, &mut payload, &mut scales).unwrap();
                } else {
                    payload = row.iter().flat_map(|b| b.to_le_bytes()).collect();
                }
                for j in 0..k {
                    let g = idxs[s][t * k + j];
                    if g < 0 {
                        assert_eq!(plans[s].pos[t * k + j], -1);
                        continue;
                    }
                    let at = layout.dispatch_send_offset(dset, g as u64).unwrap()
                        + plans[s].pos[t * k + j] as u64 * rec.bytes;
                    let f = RecordFields {
                        payload: &payload,
                        scales: &scales,
                        topk_idx: &[],
                        topk_weights: &[],
                        src_idx: t as i32,
                    };
                    rec.write(&mut bufs[s][at as usize..], &f).unwrap();
                }
            }
            for g in 0..e as u64 {
                let (dst, le) = (g / l as u64, g % l as u64);
                let count = plans[s].count_per_expert[g as usize] as u64;
                assert_eq!(plans[s].counts_for(dst, &layout)[le as usize] as u64, count);
                pool.push((
                    s,
                    dst as usize,
                    layout.dispatch_send_offset(dset, g).unwrap(),
                    layout.dispatch_msg_bytes(count),
                    layout.dispatch_recv_offset(dset, le, s as u64).unwrap(),
                    layout.imm.dispatch(dset, le, s as u64, count).unwrap(),
                ));
            }
        }
        let mut counts = vec![vec![u32::MAX; l * r]; r];
        let mut arrivals = vec![0usize; r];
        while !pool.is_empty() {
            let (src, dst, from, len, to, imm) =
                pool.swap_remove(rng.below(pool.len() as u64) as usize);
            let bytes = bufs[src][from as usize..(from + len) as usize].to_vec();
            bufs[dst][to as usize..(to + len) as usize].copy_from_slice(&bytes);
            let LlMsg::Dispatch { set, local_expert, src: s, count } =
                layout.imm.decode(imm).unwrap()
            else {
                panic!()
            };
            assert_eq!((set, s as usize), (dset, src));
            assert_eq!(counts[dst][local_expert as usize * r + src], u32::MAX, "duplicate message");
            counts[dst][local_expert as usize * r + src] = count as u32;
            arrivals[dst] += 1;
        }
        assert!(arrivals.iter().all(|&a| a == e), "every rank gets exactly E messages");

        let p = refm::LlParams {
            num_experts: e,
            hidden: h,
            num_topk: k,
            max_tokens_per_rank: m,
            use_fp8: fp8,
            round_scale: false,
        };
        let inputs: Vec<refm::LlRankInput> =
            (0..r).map(|s| refm::LlRankInput { x: &xs[s], topk_idx: &idxs[s] }).collect();
        let want = refm::ll_dispatch(&p, &inputs).unwrap();
        let srows = r * m;
        let mut ys = Vec::new();
        let mut layouts = Vec::new();
        for d in 0..r {
            let lay = LlRecvLayout::new(d, &counts[d], &layout).unwrap();
            assert_eq!(lay.count_per_expert, want[d].recv_count);
            for le in 0..l {
                for s in 0..r {
                    assert_eq!(lay.range(le, s, r), Some(want[d].layout_range[le * r + s]));
                }
            }
            let (mut xb, mut x8, mut sc) = (
                vec![0u16; l * srows * h],
                vec![0u8; l * srows * h],
                vec![0f32; l * srows * groups],
            );
            let (mut sr, mut si) = (vec![-1i32; l * srows], vec![-1i32; l * srows]);
            for le in 0..l {
                for s in 0..r {
                    let (begin, count) = lay.range(le, s, r).unwrap();
                    let base = layout.dispatch_recv_offset(dset, le as u64, s as u64).unwrap();
                    for i in 0..count as u64 {
                        let o = le * srows + (begin as u64 + i) as usize;
                        let at = (base + i * rec.bytes) as usize;
                        let v = rec.read(&bufs[d][at..]).unwrap();
                        if fp8 {
                            x8[o * h..(o + 1) * h].copy_from_slice(v.payload());
                            for g in 0..groups {
                                sc[o * groups + g] = v.scale(g as u64).unwrap();
                            }
                        } else {
                            for c in 0..h {
                                xb[o * h + c] = u16::from_le_bytes([
                                    v.payload()[2 * c],
                                    v.payload()[2 * c + 1],
                                ]);
                            }
                        }
                        sr[o] = s as i32;
                        si[o] = v.src_idx().unwrap();
                    }
                }
            }
            let got =
                if fp8 { Tokens::Fp8 { x: x8, scales: sc } } else { Tokens::Bf16(xb.clone()) };
            assert_eq!(got, want[d].recv_x, "rank {d} recv_x");
            assert_eq!(sr, want[d].recv_src_rank);
            assert_eq!(si, want[d].recv_src_idx);
            // Expert "computation": scale each local expert's rows differently.
            ys.push(
                want[d]
                    .recv_x
                    .clone()
                    .bf16_or(&xb)
                    .iter()
                    .enumerate()
                    .map(|(i, &b)| {
                        f32_to_bf16(bf16_to_f32(b) * (1.0 + (i / (srows * h)) as f32 * 0.5))
                    })
                    .collect::<Vec<u16>>(),
            );
            layouts.push(lay);
        }
        if fp8 {
            return;
        }

        // Combine: one write per (source rank, local expert), back to combine_recv[g].
        let crec = layout.combine_record;
        let mut pool = Vec::new();
        for d in 0..r {
            for le in 0..l {
                for s in 0..r {
                    let (begin, count) = layouts[d].range(le, s, r).unwrap();
                    let at = layout.combine_send_offset(cset, le as u64, s as u64).unwrap();
                    for i in 0..count as usize {
                        let o = le * srows + begin as usize + i;
                        let payload: Vec<u8> = ys[d][o * h..(o + 1) * h]
                            .iter()
                            .flat_map(|b| b.to_le_bytes())
                            .collect();
                        let f = RecordFields {
                            payload: &payload,
                            scales: &[],
                            topk_idx: &[],
                            topk_weights: &[],
                            src_idx: 0,
                        };
                        crec.write(&mut bufs[d][(at + i as u64 * crec.bytes) as usize..], &f)
                            .unwrap();
                    }
                    let g = (d * l + le) as u64;
                    pool.push((
                        d,
                        s,
                        at,
                        layout.combine_msg_bytes(count as u64),
                        layout.combine_recv_offset(cset, g).unwrap(),
                        layout.imm.combine(cset, d as u64, le as u64, count as u64).unwrap(),
                    ));
                }
            }
        }
        let mut arrivals = vec![0usize; r];
        while !pool.is_empty() {
            let (src, dst, from, len, to, imm) =
                pool.swap_remove(rng.below(pool.len() as u64) as usize);
            let bytes = bufs[src][from as usize..(from + len) as usize].to_vec();
            bufs[dst][to as usize..(to + len) as usize].copy_from_slice(&bytes);
            let LlMsg::Combine { set, src: s, local_expert, count } =
                layout.imm.decode(imm).unwrap()
            else {
                panic!()
            };
            assert_eq!((set, s as usize), (cset, src));
            assert_eq!(
                count,
                plans[dst].count_per_expert[s as usize * l + local_expert as usize] as u64
            );
            arrivals[dst] += 1;
        }
        assert!(arrivals.iter().all(|&a| a == e));
        let cin: Vec<refm::LlCombineInput> = (0..r)
            .map(|d| refm::LlCombineInput { x: &ys[d], topk_idx: &idxs[d], topk_weights: &ws[d] })
            .collect();
        let cwant = refm::ll_combine(&p, &want, &cin).unwrap();
        for s in 0..r {
            let mut out = vec![0u16; tokens[s] * h];
            for t in 0..tokens[s] {
                let mut acc = vec![0f32; h];
                for j in 0..k {
                    let g = idxs[s][t * k + j];
                    if g < 0 {
                        continue;
                    }
                    let at = layout.combine_recv_offset(cset, g as u64).unwrap()
                        + plans[s].pos[t * k + j] as u64 * crec.bytes;
                    let v = crec.read(&bufs[s][at as usize..]).unwrap();
                    for c in 0..h {
                        let y = bf16_to_f32(u16::from_le_bytes([
                            v.payload()[2 * c],
                            v.payload()[2 * c + 1],
                        ]));
                        acc[c] = y.mul_add(ws[s][t * k + j], acc[c]);
                    }
                }
                for c in 0..h {
                    out[t * h + c] = f32_to_bf16(acc[c]);
                }
            }
            assert_eq!(out, cwant[s], "rank {s} combined");
        }
    }

    trait Bf16Or {
        fn bf16_or<'a>(&'a self, fallback: &'a [u16]) -> &'a [u16];
    }
    impl Bf16Or for Tokens {
        fn bf16_or<'a>(&'a self, fallback: &'a [u16]) -> &'a [u16] {
            match self {
                Tokens::Bf16(x) => x,
                Tokens::Fp8 { .. } => fallback,
            }
        }
    }

    #[test]
    fn ll_protocol_over_unordered_delivery_matches_reference() {
        ll_protocol_matches_reference(1, 16, 4, 32, 8, &[7, 0, 8, 3], false);
        ll_protocol_matches_reference(2, 8, 3, 256, 6, &[6, 2], true);
        ll_protocol_matches_reference(3, 4, 4, 16, 5, &[5, 5, 5, 5], false); // every expert
        ll_protocol_matches_reference(4, 3, 1, 8, 4, &[0, 0, 0], false);
        ll_protocol_matches_reference(5, 6, 2, 8, 9, &[9], false);
    }

    #[test]
    fn ll_plans_bound_their_inputs() {
        let layout = LlLayout::from_parts(2, 4, 8, BF16, 3).unwrap();
        let e = LlSendPlan::new(&[0; 4], 4, 1, &layout);
        assert!(matches!(e, Err(Error::InvalidArgument { arg: "x", .. })));
        let e = LlSendPlan::new(&[1, 1], 1, 2, &layout);
        assert!(matches!(e, Err(Error::InvalidArgument { arg: "topk_idx", .. })));
        let e = LlSendPlan::new(&[4], 1, 1, &layout);
        assert!(matches!(e, Err(Error::InvalidArgument { arg: "topk_idx", .. })));
        // All tokens to one expert: pos counts up, the block holds them.
        let p = LlSendPlan::new(&[2, -1, 2, 0, 2, -1], 3, 2, &layout).unwrap();
        assert_eq!(p.count_per_expert, vec![1, 0, 3, 0]);
        assert_eq!(p.pos, vec![0, -1, 1, 0, 2, -1]);
        let e = LlRecvLayout::new(1, &[0, 4, 0, 0], &layout);
        assert!(matches!(e, Err(Error::Protocol { rank: 1, peer: 1, .. })));
        assert!(LlRecvLayout::new(1, &[0, 3], &layout).is_err());
        let ll = LlRecvLayout::new(0, &[3, 3, 0, 1], &layout).unwrap();
        assert_eq!((ll.begin, ll.count_per_expert), (vec![0, 3, 0, 0], vec![6, 1]));
        // Offsets: sets and areas do not overlap, units tile the buffer.
        let mut seen = std::collections::HashSet::new();
        for set in 0..2 {
            for g in 0..4 {
                assert!(seen.insert(layout.dispatch_send_offset(set, g).unwrap()));
                assert!(seen.insert(layout.combine_recv_offset(set, g).unwrap()));
            }
        }
        assert_eq!(seen.len() as u64 * layout.unit_bytes, layout.total_bytes());
        assert_eq!(
            layout.combine_send_offset(1, 1, 0).unwrap(),
            layout.dispatch_send_offset(1, 2).unwrap()
        );
        assert!(layout.dispatch_recv_offset(0, 2, 0).is_err());
    }

    #[test]
    fn cluster_sizing_scales_to_thousands_of_ranks() {
        // Exact miss probability by enumeration: E = 4, L = 2, K = 2 -> P(hit) = 5/6.
        let small = ClusterParams {
            num_ranks: 2,
            num_experts: 4,
            hidden: 128,
            num_topk: 2,
            dtype: FP8,
            num_tokens: 600,
            max_tokens_per_rank: 10,
            chunk_tokens: 64,
            slots_per_peer: 2,
            max_region_bytes: 1 << 30,
        };
        let s = cluster_sizing(&small).unwrap();
        assert!((s.p_token_to_rank - 5.0 / 6.0).abs() < 1e-12);
        assert!((s.normal_tokens_per_peer_expected - 500.0).abs() < 1e-9);
        assert_eq!(s.normal_dispatch_msgs_max, 2 + 2 * 10);
        assert_eq!(s.normal_dispatch_msgs_expected, 2 + 2 * 8);
        assert_eq!(s.ll_msgs, 4);
        for ranks in [8u64, 256, 1024, 4096] {
            let p = ClusterParams {
                num_ranks: ranks,
                num_experts: ranks.max(256),
                hidden: 7168,
                num_topk: 8,
                dtype: FP8,
                num_tokens: 4096,
                max_tokens_per_rank: 128,
                chunk_tokens: 32,
                slots_per_peer: 2,
                max_region_bytes: 1 << 32,
            };
            let s = cluster_sizing(&p).unwrap();
            let normal =
                NormalLayout::from_parts(ranks, p.num_experts, 7168, 8, FP8, 32, 2).unwrap();
            assert_eq!(s.normal_recv_bytes, ranks * 2 * normal.slot_bytes);
            assert_eq!(
                s.normal_total_bytes,
                s.normal_recv_bytes + s.normal_send_bytes + s.normal_notify_bytes
            );
            assert!(s.normal_regions >= s.normal_total_bytes.div_ceil(1 << 32));
            assert!(s.ll_regions >= s.ll_total_bytes.div_ceil(1 << 32));
            assert!(s.p_token_to_rank > 0.0 && s.p_token_to_rank <= 1.0);
            assert!(
                s.ll_dispatch_bytes_per_peer_max >= s.ll_dispatch_bytes_per_peer_expected as u64
            );
            if ranks >= 4096 {
                assert!(s.normal_total_bytes > i32::MAX as u64);
            }
        }
        let bad =
            ClusterParams { slots_per_peer: 200, num_ranks: 1024, num_experts: 1024, ..small };
        assert!(matches!(
            cluster_sizing(&bad),
            Err(Error::InvalidArgument { arg: "slots_per_peer", .. })
        ));
    }
}
