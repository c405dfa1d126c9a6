//! What every part of the plan uses: the protocol's constants, overflow-checked arithmetic
//! and the input checks (hidden size, top-k ids).

use crate::protocol::dtype::DispatchDtype;
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
pub const FP8_GROUP: u64 = crate::protocol::quant::FP8_GROUP as u64;

pub(super) fn mul(a: u64, b: u64, arg: &'static str) -> Result<u64> {
    a.checked_mul(b).ok_or_else(|| Error::arg(arg, format!("{a} * {b} overflows u64")))
}

pub(super) fn align_up(x: u64, a: u64) -> u64 {
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
