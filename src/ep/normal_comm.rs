//! Normal mode on the GPU: the group's settings ([`NormalGpuSettings`]) and the byte map of a
//! rank's comm buffer ([`CommMap`]), plain data shared by the kernels' host side
//! (normal_gpu.rs, which re-exports both) and the CPU proxy lane (gpu/normal_proxy.rs).

use std::time::Duration;

use crate::abi;
use crate::protocol::config::DispatchDtype;
use crate::protocol::plan::NormalLayout;
use crate::{Error, Result};

/// Settings of one normal-mode GPU group (the same on every rank).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NormalGpuSettings {
    pub num_ranks: usize,
    pub num_experts: usize,
    pub hidden: usize,
    pub num_topk: usize,
    pub dtype: DispatchDtype,
    /// Records per queue chunk.
    pub chunk_tokens: usize,
    /// Chunks in flight per (sender, receiver) pair.
    pub slots_per_peer: usize,
    /// Blocks per kernel (one block per SM at most): the rank's SM budget; even, `>= 2 x ranks`.
    pub num_sms: usize,
    /// Bound of every device-side wait.
    pub timeout: Duration,
}

impl NormalGpuSettings {
    /// Defaults: 16-token chunks, 8 slots per peer, 32 SMs, 10 s timeout.
    pub fn new(
        num_ranks: usize,
        num_experts: usize,
        hidden: usize,
        num_topk: usize,
        dtype: DispatchDtype,
    ) -> Self {
        NormalGpuSettings {
            num_ranks,
            num_experts,
            hidden,
            num_topk,
            dtype,
            chunk_tokens: 16,
            slots_per_peer: 16,
            num_sms: 32,
            timeout: Duration::from_secs(10),
        }
    }
}

/// Byte map of a comm buffer (identical on every rank; mirrors `fep_abi.h` and the state area of
/// `kernels/include/fep_normal.cuh`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CommMap {
    pub layout: NormalLayout,
    pub recv_offset: u64,
    pub flag_offset: u64,
    pub credit_offset: u64,
    pub notify_offset: u64,
    pub notify_bytes: u64,
    pub ack_offset: u64,
    pub state_offset: u64,
    pub total_bytes: u64,
}

pub(crate) const MAX_RANKS: usize = abi::FEP_NORMAL_MAX_RANKS as usize;

pub(crate) fn align(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}

impl CommMap {
    pub fn new(s: &NormalGpuSettings) -> Result<Self> {
        if s.num_ranks == 0 || s.num_ranks > MAX_RANKS {
            return Err(Error::arg(
                "num_ranks",
                format!("{}: the intranode kernels take 1..={MAX_RANKS}", s.num_ranks),
            ));
        }
        if s.num_topk == 0 || s.num_topk > 32 {
            return Err(Error::arg("num_topk", format!("{}: must be in 1..=32", s.num_topk)));
        }
        if s.slots_per_peer == 0 || s.slots_per_peer > 1024 {
            return Err(Error::arg(
                "slots_per_peer",
                format!("{} not in 1..=1024", s.slots_per_peer),
            ));
        }
        let layout = NormalLayout::from_parts(
            s.num_ranks as u64,
            s.num_experts as u64,
            s.hidden as u64,
            s.num_topk as u64,
            s.dtype,
            s.chunk_tokens as u64,
            s.slots_per_peer as u64,
        )?;
        let r = s.num_ranks as u64;
        let spp = s.slots_per_peer as u64;
        let l = layout.num_local_experts;
        let recv_offset = 0;
        let flag_offset = align(recv_offset + layout.recv_bytes(), 256);
        let credit_offset = align(flag_offset + r * spp * 8, 256);
        let notify_offset = align(credit_offset + r * spp * 8, 256);
        let notify_bytes = align(16 + 4 * l, 16);
        let ack_offset = align(notify_offset + r * notify_bytes, 256);
        let state_offset = align(ack_offset + r * 8, 256);
        // fep_normal.cuh: 176 bytes of counters, then u32 consumed [8][spp], u32 experts [8][L].
        let state_bytes = 176 + 4 * MAX_RANKS as u64 * (spp + l);
        let total_bytes = align(state_offset + state_bytes, 256);
        Ok(CommMap {
            layout,
            recv_offset,
            flag_offset,
            credit_offset,
            notify_offset,
            notify_bytes,
            ack_offset,
            state_offset,
            total_bytes,
        })
    }
}
