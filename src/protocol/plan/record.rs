//! Wire records: the byte layout of one token's record ([`RecordLayout`]), writing and
//! reading it, and the sender's local top-k ids.

use super::base::*;
use crate::protocol::dtype::DispatchDtype;
use crate::{Error, Result};

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
