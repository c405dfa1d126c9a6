//! Low-latency (LL) dispatch/combine on the GPU: fixed buffers, the kernels of
//! `kernels/ll_dispatch.cu` and `kernels/ll_combine.cu`, and a threads-as-ranks harness
//! ([`LlGpuGroup`]) that runs N ranks in one process on one GPU, each with its own buffers and
//! stream, peers' buffers addressed through plain device pointers.
//!
//! One file: `LlGpuRank` (one rank's low-latency buffers and launches), its config and tickets, and
//! the `LlGpuGroup` harness all work on the same private buffer fields.
//!
//! Per rank and call (DeepEP V1 LL semantics, oracle: [`crate::protocol::reference`]):
//! - `dispatch_send`: `x [T, hidden]` bf16 + `topk_idx [T, K]` int64 -> for each global expert
//!   `g`, the rows of the tokens that chose it, written straight into the receive block
//!   `[g % L][this rank]` of rank `g / L` (fp8 e4m3 + per-128 f32 scales cast in-kernel, or bf16),
//!   then one flag per (destination, local expert) with the count, zero counts included.
//! - `dispatch_recv` (the hook): waits (bounded) for every source's flags, writes
//!   `recv_x [L, R * M, hidden]` (+ scales) in the deterministic order (for local expert `e`, rows
//!   of source 0, then 1, ...; within a source in its token order), `recv_count [L]`, source rank
//!   and token index per row, and `layout_range [L, R]` as `(begin, count)`.
//! - `combine_send`: `x [L, R * M, hidden]` bf16 rows go back to their source rank's combine
//!   receive block `g`, row `pos` (the row the token had in the dispatch message).
//! - `combine_recv` (the hook): per token, the top-k weighted sum in fp32 (k ascending, fma),
//!   bf16 out `[T, hidden]`.
//!
//! Buffers follow [`LlLayout`] exactly (two sets that alternate per call, each a send and a
//! receive area of `E` units); flags are `u64 [2 sets][2 phases][E]` in the receiver's memory.
//!
// NOTES (ordering): payload stores -> `__threadfence_system` in every sending thread -> barrier ->
// ticket atomic (the last block to finish is chosen) -> fence -> release store of each flag
// `(tag << 32) | count`. The receiver acquires the flag (system scope), then a barrier, then reads
// the rows through L2. The tag is the set's epoch (1, 2, ... per use of the set; the same on every
// rank because every rank makes the same sequence of LL calls), kept in device memory (the send's
// last block advances it, the receive on the same stream reads it), so flags never need resetting
// (a value of an earlier call is always smaller than `tag << 32`) and a captured CUDA graph
// replays correctly. The host picks the set by call parity, as DeepEP does.
//
// NOTES (buffer reuse): a call uses set `call parity` (host side). Rank A's dispatch of call n+2 overwrites rank
// B's set only after A's combine receive of call n+1 saw B's combine send, which B issues after its
// dispatch receive of call n has finished reading: the usual dispatch -> combine alternation
// keeps the two sets safe, as in DeepEP.
//
// NOTES (co-residency): receive kernels spin on flags written by other ranks' kernels. Each rank's
// kernels run on one stream (so at most one of them runs at a time) with a grid of at most
// `sm_budget` blocks, and `num_ranks * sm_budget <= SMs`, so every rank's running kernel fits on
// the GPU at once and no spin can starve a sender.

use crate::abi;
use crate::cuda::launch::{self, LaunchConfig};
use crate::cuda::{DevErrorRecord, Device, DeviceBuffer, Event, HostMapped, Stream};
use crate::protocol::config::DispatchDtype;
use crate::protocol::plan::{LlLayout, RecordLayout};
use crate::{Error, Result};
use std::sync::Arc;
use std::time::Duration;

/// Clock assumed to turn a timeout into a device cycle budget (H200 boost clock, about 2 GHz).
/// NOTES: at lower clocks the device-side wait lasts longer than `timeout`, never shorter.
pub const ASSUMED_CLOCK_HZ: u64 = 2_000_000_000;
/// Largest number of experts the kernels' shared-memory scans take.
pub const MAX_EXPERTS: usize = 8 * abi::FEP_LL_THREADS as usize;
const SMEM_LIMIT: usize = 48 * 1024;

/// Settings of the low-latency GPU path, validated by [`LlGpuConfig::layout`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LlGpuConfig {
    pub num_ranks: usize,
    pub num_experts: usize,
    /// Channels; a multiple of 128.
    pub hidden: usize,
    pub num_topk: usize,
    pub max_tokens_per_rank: usize,
    /// Dispatch in fp8 (e4m3 + per-128 f32 scales) instead of bf16.
    pub use_fp8: bool,
    /// Power-of-two fp8 scales (DeepEP's `round_scale`).
    pub round_scale: bool,
    /// Blocks per kernel launch of one rank; `None`: SMs / num_ranks.
    pub sm_budget: Option<u32>,
    /// Bound on every device-side wait.
    pub timeout: Duration,
}

impl LlGpuConfig {
    /// The DeepSeek-style benchmark setting: 128 tokens, hidden 7168, top-8 of 256, fp8.
    pub fn bench(num_ranks: usize) -> Self {
        LlGpuConfig {
            num_ranks,
            num_experts: 256,
            hidden: 7168,
            num_topk: 8,
            max_tokens_per_rank: 128,
            use_fp8: true,
            round_scale: false,
            sm_budget: None,
            timeout: Duration::from_secs(10),
        }
    }

    pub fn num_local_experts(&self) -> usize {
        self.num_experts / self.num_ranks.max(1)
    }

    /// Rows per local expert in the outputs, `num_ranks * max_tokens_per_rank`.
    pub fn rows_per_expert(&self) -> usize {
        self.num_ranks * self.max_tokens_per_rank
    }

    /// Checks every setting the kernels rely on and returns the buffer layout.
    pub fn layout(&self) -> Result<LlLayout> {
        if self.num_ranks == 0 {
            return Err(Error::arg("num_ranks", "must be at least 1"));
        }
        if self.num_experts == 0
            || self.num_experts % self.num_ranks != 0
            || self.num_experts > MAX_EXPERTS
        {
            return Err(Error::arg(
                "num_experts",
                format!(
                    "{}: must be a positive multiple of num_ranks {} and at most {MAX_EXPERTS}",
                    self.num_experts, self.num_ranks
                ),
            ));
        }
        if self.hidden == 0 || self.hidden % 128 != 0 {
            return Err(Error::arg(
                "hidden",
                format!("{}: the GPU path needs a positive multiple of 128", self.hidden),
            ));
        }
        if self.num_topk == 0 || self.num_topk > self.num_experts {
            return Err(Error::arg(
                "num_topk",
                format!("{} not in 1..={}", self.num_topk, self.num_experts),
            ));
        }
        if self.round_scale && !self.use_fp8 {
            return Err(Error::arg("round_scale", "only meaningful with use_fp8"));
        }
        let dtype = if self.use_fp8 { DispatchDtype::Fp8E4m3 } else { DispatchDtype::Bf16 };
        let layout = LlLayout::from_parts(
            self.num_ranks as u64,
            self.num_experts as u64,
            self.hidden as u64,
            dtype,
            self.max_tokens_per_rank as u64,
        )?;
        if self.send_smem(self.max_tokens_per_rank) > SMEM_LIMIT {
            return Err(Error::arg(
                "max_tokens_per_rank",
                format!(
                    "{} x top-{} with {} experts needs {} bytes of shared memory (limit {SMEM_LIMIT})",
                    self.max_tokens_per_rank,
                    self.num_topk,
                    self.num_experts,
                    self.send_smem(self.max_tokens_per_rank)
                ),
            ));
        }
        let rows = self.num_local_experts() as u64 * self.rows_per_expert() as u64;
        if rows * self.hidden as u64 / 16 > i32::MAX as u64 || layout.unit_bytes > u32::MAX as u64 {
            return Err(Error::arg("max_tokens_per_rank", "outputs too large for 32-bit indices"));
        }
        Ok(layout)
    }

    /// Dispatch send: the record tail one token's writes share (kernels/ll_dispatch.cu: scales,
    /// source index, padding; a multiple of 16 bytes), destination rows, top-k and counts.
    fn send_smem(&self, num_tokens: usize) -> usize {
        self.dispatch_tail_bytes()
            + self.num_topk * 8
            + (num_tokens * self.num_topk + self.num_experts + self.num_ranks) * 4
    }
    /// Bytes of a dispatch record after its payload (`record_bytes - scales_offset`).
    fn dispatch_tail_bytes(&self) -> usize {
        let dtype = if self.use_fp8 { DispatchDtype::Fp8E4m3 } else { DispatchDtype::Bf16 };
        RecordLayout::ll_dispatch(self.hidden as u64, dtype)
            .map_or(0, |r| (r.bytes - r.scales_offset) as usize)
    }
    fn scan_smem(&self) -> usize {
        (2 * self.num_experts + 1 + self.num_ranks) * 4
    }
    /// Bytes of the flags (`u64 [2 sets][2 phases][E]`); the shrink clean's barrier words
    /// (`u64 [R]`, one per writing rank) follow them in the same allocation, untouched by a
    /// clean.
    fn flag_bytes(&self) -> usize {
        2 * 2 * self.num_experts * 8
    }
    fn combine_recv_smem(&self) -> usize {
        self.num_topk * 12 + self.num_experts * 4
    }

    /// Blocks that can have work in a kernel copying the rows one rank can receive in a
    /// dispatch (= send back in a combine) of `row_bytes` each: at most every source rank's
    /// tokens, each to min(top-k, local experts) of this rank's experts; each row is
    /// `FEP_LL_SEG_BYTES` segments, one per warp. (Capped by the rank's budget at launch.)
    fn row_blocks(&self, row_bytes: usize) -> usize {
        let rows =
            self.num_ranks * self.max_tokens_per_rank * self.num_topk.min(self.num_local_experts());
        let segs = row_bytes.div_ceil(abi::FEP_LL_SEG_BYTES as usize);
        let warps = (abi::FEP_LL_THREADS / 32) as usize;
        rows.saturating_mul(segs).div_ceil(warps)
    }
    fn budget_cycles(&self) -> u64 {
        let ns = self.timeout.as_nanos().min(u64::MAX as u128 / 4) as u64;
        ns.saturating_mul(ASSUMED_CLOCK_HZ / 1_000_000_000).max(1)
    }
}

/// One rank's dispatch outputs on the device; also the handle its combine reads
/// (`layout_range`, `pos`). `S = num_ranks * max_tokens_per_rank`.
pub struct LlDispatchOut {
    /// `[L, S, hidden]` e4m3 bytes (fp8) or bf16.
    pub recv_x: DeviceBuffer,
    /// f32 `[L, S, hidden / 128]` (fp8 only; empty otherwise).
    pub recv_scales: DeviceBuffer,
    /// i32 `[L, S]`.
    pub recv_src_rank: DeviceBuffer,
    /// i32 `[L, S]`.
    pub recv_src_idx: DeviceBuffer,
    /// i32 `[L]`.
    pub recv_count: DeviceBuffer,
    /// i32 `[L, R, 2]` `(begin, count)`.
    pub layout_range: DeviceBuffer,
    /// i32 `[max_tokens_per_rank, K]`: row of `(t, k)` within its expert's message (-1 masked).
    pub pos: DeviceBuffer,
}

/// [`LlDispatchOut`] copied to the host.
#[derive(Clone, Debug, PartialEq)]
pub struct LlDispatchHost {
    pub recv_x: Vec<u8>,
    pub recv_scales: Vec<f32>,
    pub recv_src_rank: Vec<i32>,
    pub recv_src_idx: Vec<i32>,
    pub recv_count: Vec<i32>,
    pub layout_range: Vec<i32>,
    pub pos: Vec<i32>,
}

impl LlDispatchOut {
    pub fn new(dev: &Device, cfg: &LlGpuConfig) -> Result<Self> {
        let (l, s, h) = (cfg.num_local_experts(), cfg.rows_per_expert(), cfg.hidden);
        let elem = if cfg.use_fp8 { 1 } else { 2 };
        Ok(LlDispatchOut {
            recv_x: DeviceBuffer::new(dev, l * s * h * elem)?,
            recv_scales: DeviceBuffer::new(
                dev,
                if cfg.use_fp8 { l * s * (h / 128) * 4 } else { 0 },
            )?,
            recv_src_rank: DeviceBuffer::new(dev, l * s * 4)?,
            recv_src_idx: DeviceBuffer::new(dev, l * s * 4)?,
            recv_count: DeviceBuffer::new(dev, l * 4)?,
            layout_range: DeviceBuffer::new(dev, cfg.num_experts * 8)?,
            pos: DeviceBuffer::new(dev, cfg.max_tokens_per_rank * cfg.num_topk * 4)?,
        })
    }

    /// Fills every output with `byte` (tests poison before each run); done when it returns
    /// (`DeviceBuffer::memset` waits for its fill: a plain cuMemset could land after the next
    /// kernels wrote, as seen on the H200 at 7168 x 4 ranks).
    pub fn poison(&self, byte: u8) -> Result<()> {
        for b in [
            &self.recv_x,
            &self.recv_scales,
            &self.recv_src_rank,
            &self.recv_src_idx,
            &self.recv_count,
            &self.layout_range,
            &self.pos,
        ] {
            b.memset(byte)?;
        }
        Ok(())
    }

    pub fn to_host(&self) -> Result<LlDispatchHost> {
        Ok(LlDispatchHost {
            recv_x: self.recv_x.to_vec()?,
            recv_scales: self.recv_scales.to_vec()?,
            recv_src_rank: self.recv_src_rank.to_vec()?,
            recv_src_idx: self.recv_src_idx.to_vec()?,
            recv_count: self.recv_count.to_vec()?,
            layout_range: self.layout_range.to_vec()?,
            pos: self.pos.to_vec()?,
        })
    }
}

/// A send in flight: what the matching receive (the hook) needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LlTicket {
    pub set: u32,
    pub num_tokens: usize,
    /// [`LlGpuRank::combine_send_pull`]: the expert outputs `x` the receive reads this rank's
    /// own rows from (0: every row was copied).
    pub pull_x: u64,
    /// [`Self::chained`]: the receive may use programmatic dependent launch.
    pub chain: bool,
    /// [`Self::with_wait_stats`]: the receive's per-source wait costs go here (0: none).
    pub wait_stats: u64,
}

impl LlTicket {
    /// This ticket for a receive launched right after its send on the rank's stream, with
    /// nothing queued there in between: the receive may then start by programmatic dependent
    /// launch (`launch::ll_dispatch_recv`'s `chained` says why only then).
    pub fn chained(self) -> LlTicket {
        LlTicket { chain: true, ..self }
    }

    /// This ticket with its receive adding, per source rank, the nanoseconds it waited for that
    /// rank's flags to `stats` (device `int64 [num_ranks]`, DeepEP's `*_wait_recv_cost_stats`;
    /// 0: none). The caller keeps it alive until the receive has run.
    pub fn with_wait_stats(self, stats: u64) -> LlTicket {
        LlTicket { wait_stats: stats, ..self }
    }
}

/// Where a rank's LL buffer lives: device memory (peers on this node only, or a provider with
/// `FI_HMEM` that registers GPU memory), or pinned host memory mapped into the GPU (peers on
/// other nodes over a provider without `FI_HMEM`: libfabric registers it as host memory).
#[derive(Clone)]
pub enum LlMem {
    Device(Arc<DeviceBuffer>),
    Host(Arc<HostMapped>),
}

impl LlMem {
    /// The address the kernels use.
    pub fn device_ptr(&self) -> u64 {
        match self {
            LlMem::Device(b) => b.device_ptr(),
            LlMem::Host(m) => m.device_ptr(),
        }
    }
    pub fn len(&self) -> usize {
        match self {
            LlMem::Device(b) => b.len(),
            LlMem::Host(m) => m.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One rank: its LL buffer, flags, peer table, stream and error record.
pub struct LlGpuRank {
    rank: usize,
    cfg: LlGpuConfig,
    layout: LlLayout,
    /// The rank's own stream: launches go here unless [`Self::with_stream`] names the caller's.
    stream: Stream,
    /// The caller's stream (borrowed) while inside [`Self::with_stream`].
    launch_on: Option<Stream>,
    /// Recorded on the caller's stream after each [`Self::with_stream`] call: what
    /// [`Self::finish`] and [`Self::clean`] wait for (bounded).
    last: Event,
    buf: LlMem,
    flags: Arc<DeviceBuffer>,
    peers: DeviceBuffer,
    /// The proxy lane's kernel view (all zero: no proxy peers) and its device state
    /// (`fep_ll_proxy.state`, see fep_abi.h); set by `ep::gpu::ll_proxy`.
    proxy: abi::fep_ll_proxy,
    proxy_state: Option<DeviceBuffer>,
    /// u32 [2] dispatch-send and combine-send tickets (kernels leave them zero), then u64 [2]
    /// per-set epochs (device memory, advanced by the send kernels).
    workspace: DeviceBuffer,
    err: DevErrorRecord,
    calls: u64,
    grid: u32,
    /// Host copy of the peer table ([`Self::set_peers`]): the shrink clean writes its barrier
    /// words through it.
    peer_table: Vec<abi::fep_ll_peer>,
    shrink: Option<Shrink>,
}

/// Shrink mode's state (DeepEP's `enable_shrink`; kernels/include/fep_ll.cuh NOTES).
struct Shrink {
    /// u32 `[R]` in mapped host memory, 1 = masked: the kernels read it, a receive whose wait
    /// runs out stores 1, the host sets and clears it (fep_abi.h `shrink_mask`).
    mask: HostMapped,
    /// u64 `[2 phases][2 sets][E]`: the receives' per-unit decisions (`shrink_decide`).
    decide: DeviceBuffer,
    /// The mask as last seen by the host: a rank set since was masked by a kernel (warned).
    seen: Vec<bool>,
    /// Cleans run: the round of the clean's barrier words.
    cleans: u64,
    /// Set by an unmask: calls are refused until a clean.
    needs_clean: Option<String>,
}

fn need(arg: &'static str, buf: &DeviceBuffer, bytes: usize) -> Result<()> {
    if buf.len() < bytes {
        return Err(Error::arg(arg, format!("{} bytes, needs {bytes}", buf.len())));
    }
    Ok(())
}

/// Name of a `FEP_PHASE_LL_*` phase.
pub fn phase_name(phase: u32) -> &'static str {
    match phase {
        abi::FEP_PHASE_LL_DISPATCH_SEND => "low-latency dispatch send",
        abi::FEP_PHASE_LL_DISPATCH_RECV => "low-latency dispatch receive",
        abi::FEP_PHASE_LL_COMBINE_SEND => "low-latency combine send",
        abi::FEP_PHASE_LL_COMBINE_RECV => "low-latency combine receive",
        _ => "unknown phase",
    }
}

impl LlGpuRank {
    /// One rank's buffers on `dev` (flags and tickets zeroed, device synchronised), for ranks
    /// built one by one (a `Buffer` per thread): exchange [`Self::peer_entry`] of every rank,
    /// then [`Self::set_peers`]. `grid` is the rank's SM budget (blocks per launch).
    pub fn new_unconnected(dev: &Device, cfg: LlGpuConfig, rank: usize, grid: u32) -> Result<Self> {
        Self::new_unconnected_in(dev, cfg, rank, grid, None)
    }

    /// As [`Self::new_unconnected`], with the LL buffer `mem` (at least
    /// `LlLayout::total_bytes`) instead of a fresh device buffer.
    pub fn new_unconnected_in(
        dev: &Device,
        cfg: LlGpuConfig,
        rank: usize,
        grid: u32,
        mem: Option<LlMem>,
    ) -> Result<Self> {
        let layout = cfg.layout()?;
        if rank >= cfg.num_ranks || grid == 0 || grid > dev.sm_count() {
            return Err(Error::arg(
                "sm_budget",
                format!(
                    "rank {rank} of {}, {grid} blocks on {} SMs",
                    cfg.num_ranks,
                    dev.sm_count()
                ),
            ));
        }
        let total = usize::try_from(layout.total_bytes())
            .map_err(|_| Error::arg("max_tokens_per_rank", "LL buffer larger than memory"))?;
        let flag_bytes = cfg.flag_bytes() + cfg.num_ranks * 8;
        let buf = match mem {
            Some(m) if m.len() < total => {
                return Err(Error::arg(
                    "mem",
                    format!("{} bytes, the LL buffer needs {total}", m.len()),
                ))
            }
            Some(m) => m,
            None => LlMem::Device(Arc::new(DeviceBuffer::new(dev, total)?)),
        };
        let r = LlGpuRank {
            rank,
            layout,
            stream: Stream::new(dev)?,
            launch_on: None,
            last: Event::new_untimed(dev)?,
            buf,
            proxy: abi::fep_ll_proxy::default(),
            proxy_state: None,
            flags: Arc::new(DeviceBuffer::zeroed(dev, flag_bytes)?),
            peers: DeviceBuffer::zeroed(
                dev,
                cfg.num_ranks * std::mem::size_of::<abi::fep_ll_peer>(),
            )?,
            workspace: DeviceBuffer::zeroed(dev, 24)?,
            err: DevErrorRecord::new(dev)?,
            calls: 0,
            grid,
            peer_table: Vec::new(),
            shrink: None,
            cfg,
        };
        // The zeroing above is complete: DeviceBuffer's fills wait for themselves.
        Ok(r)
    }

    /// This rank's entry of every peer's table (buffer and flags reached by peer stores).
    pub fn peer_entry(&self) -> abi::fep_ll_peer {
        abi::fep_ll_peer {
            buf: self.buf.device_ptr(),
            flags: self.flags.device_ptr(),
            transport: abi::FEP_LL_TRANSPORT_PEER,
            _pad: 0,
            proxy: 0,
        }
    }

    /// Installs the peer table (`table[p]` = rank `p`'s [`Self::peer_entry`]).
    ///
    /// # Safety
    /// Every entry addresses buffers of a rank with the same config that stay allocated while
    /// this rank's kernels may run.
    pub unsafe fn set_peers(&mut self, table: &[abi::fep_ll_peer]) -> Result<()> {
        if table.len() != self.cfg.num_ranks {
            return Err(Error::arg(
                "table",
                format!("{} entries for {} ranks", table.len(), self.cfg.num_ranks),
            ));
        }
        self.peers.copy_from_host(table)?;
        self.peer_table = table.to_vec();
        Ok(())
    }

    /// Installs the proxy lane's kernel view and its device state (zeroed, `12 + 8 E` u64).
    pub(crate) fn set_proxy(&mut self, px: abi::fep_ll_proxy, state: DeviceBuffer) {
        self.proxy = abi::fep_ll_proxy { state: state.device_ptr(), ..px };
        self.proxy_state = Some(state);
    }

    /// The proxy lane's device state, if any.
    pub(crate) fn proxy_state(&self) -> Option<&DeviceBuffer> {
        self.proxy_state.as_ref()
    }

    /// Overwrites the proxy lane's device state (the clean fence re-bases it); no kernel of this
    /// rank may run.
    pub(crate) fn upload_proxy_state(&mut self, words: &[u64]) -> Result<()> {
        let st = self
            .proxy_state
            .as_mut()
            .ok_or_else(|| Error::Other(format!("rank {}: no proxy lane", self.rank)))?;
        st.copy_from_host(words)?; // complete on return (Device::blocking)
        Ok(())
    }

    /// The LL buffer.
    pub fn mem(&self) -> &LlMem {
        &self.buf
    }

    /// After a failed call (a timeout) on every rank: waits for this rank's stream (bounded),
    /// zeroes its flags and tickets, clears its error record and restarts its epochs. Every
    /// rank must do it before the next call, with no kernel of the group running.
    pub fn clean(&mut self) -> Result<()> {
        self.wait_idle()?;
        self.reset()
    }

    /// Zeroes flags (not the shrink barrier words after them), tickets, epochs, the error
    /// record and the shrink decisions; no kernel of this rank may run.
    fn reset(&mut self) -> Result<()> {
        self.flags.memset_prefix(0, self.cfg.flag_bytes())?;
        self.workspace.memset(0)?;
        self.err.reset()?;
        if let Some(sh) = &mut self.shrink {
            sh.decide.memset(0)?;
            sh.needs_clean = None;
        }
        self.calls = 0;
        Ok(())
    }

    /// Turns on shrink mode (DeepEP's `enable_shrink`): masked ranks get no writes and are not
    /// waited for, and a receive wait that runs out masks its rank instead of failing
    /// (kernels/include/fep_ll.cuh NOTES). Peers must all be on this node (flags and rows by
    /// peer stores, no proxy lane). Before the first call.
    pub fn enable_shrink(&mut self) -> Result<()> {
        let (r, e) = (self.cfg.num_ranks, self.cfg.num_experts);
        let dev = self.flags.device().clone();
        self.shrink = Some(Shrink {
            mask: HostMapped::new(&dev, r * 4)?,
            decide: DeviceBuffer::zeroed(&dev, 2 * 2 * e * 8)?,
            seen: vec![false; r],
            cleans: 0,
            needs_clean: None,
        });
        Ok(())
    }

    pub fn shrink_enabled(&self) -> bool {
        self.shrink.is_some()
    }

    fn shrink_usable(&self) -> Result<()> {
        match self.shrink.as_ref().and_then(|sh| sh.needs_clean.as_ref()) {
            Some(why) => Err(Error::Other(format!(
                "rank {}: low-latency calls are refused until clean_low_latency_buffer ({why};                  what was written while it was masked is out of step)",
                self.rank
            ))),
            None => Ok(()),
        }
    }

    fn shrink_state(&self) -> Result<&Shrink> {
        self.shrink.as_ref().ok_or_else(|| {
            Error::arg("enable_shrink", "this low-latency buffer was built without shrink mode")
        })
    }

    /// Shrink mode: `[R]` which ranks are masked (by [`Self::set_mask`], or by a receive whose
    /// wait ran out). Ranks the kernels masked since the last look are warned about here.
    pub fn mask(&mut self) -> Result<Vec<bool>> {
        let rank = self.rank;
        let sh = self.shrink.as_mut().ok_or_else(|| {
            Error::arg("enable_shrink", "this low-latency buffer was built without shrink mode")
        })?;
        let mut out = Vec::with_capacity(sh.seen.len());
        for p in 0..sh.seen.len() {
            let m = sh.mask.read::<u32>(p * 4)? != 0;
            if m && !sh.seen[p] {
                crate::fep_warn!(
                    "rank {rank}: low-latency receive: masking rank {p} (no data within the \
                     timeout); later low-latency calls skip it"
                );
            }
            sh.seen[p] = m;
            out.push(m);
        }
        Ok(out)
    }

    /// Shrink mode: masks (`masked`) or unmasks `peer` on this rank only, also while a kernel
    /// runs (a rank the bootstrap saw die: the receives stop waiting for it within ~20 us).
    /// Unmasking a masked rank refuses calls until [`Self::clean_shrink`]. This rank itself
    /// cannot be masked.
    pub fn set_mask(&mut self, peer: usize, masked: bool, why: &str) -> Result<()> {
        let rank = self.rank;
        let r = self.cfg.num_ranks;
        let sh = self.shrink.as_mut().ok_or_else(|| {
            Error::arg("enable_shrink", "this low-latency buffer was built without shrink mode")
        })?;
        if peer >= r {
            return Err(Error::arg("rank", format!("{peer} not in 0..{r}")));
        }
        if peer == rank {
            if masked {
                return Err(Error::arg(
                    "rank",
                    format!("{peer} is this rank (the GPU backend masks peers only)"),
                ));
            }
            return Ok(());
        }
        let was = sh.mask.read::<u32>(peer * 4)? != 0;
        sh.mask.write::<u32>(peer * 4, u32::from(masked))?;
        if masked && !was && !why.is_empty() {
            crate::fep_warn!(
                "rank {rank}: low-latency: masking rank {peer} ({why}); later low-latency calls \
                 skip it"
            );
        }
        sh.seen[peer] = masked;
        if was && !masked {
            sh.needs_clean = Some(format!("rank {peer} was unmasked"));
        }
        Ok(())
    }

    /// Shrink mode's `clean_low_latency_buffer`, collective among the ranks this rank has not
    /// masked (a masked rank does not take part, so the bootstrap cannot fence it): waits for
    /// this rank's kernels, then an in-band barrier (every unmasked peer's kernels are done),
    /// the reset of [`Self::clean`], and a second barrier (every unmasked peer is reset before
    /// anyone's next call writes here). The barrier words sit after each rank's flags: this
    /// rank writes its round into word `[me]` of every unmasked peer (a host copy through the
    /// peer's mapping) and polls its own words, bounded by the timeout; a peer that does not
    /// arrive in time is masked. `dead(p)`: the bootstrap saw rank `p` leave (masked first).
    pub fn clean_shrink(&mut self, dead: &dyn Fn(usize) -> bool) -> Result<()> {
        self.shrink_state()?;
        self.wait_idle()?;
        let me = self.rank;
        for p in (0..self.cfg.num_ranks).filter(|&p| p != me && dead(p)) {
            self.set_mask(p, true, "the bootstrap saw it leave")?;
        }
        let round = {
            let sh = self.shrink.as_mut().expect("checked above");
            sh.cleans += 1;
            2 * sh.cleans
        };
        self.shrink_barrier(round - 1, dead)?;
        self.reset()?;
        self.shrink_barrier(round, dead)
    }

    fn shrink_barrier(&mut self, round: u64, dead: &dyn Fn(usize) -> bool) -> Result<()> {
        let (r, me) = (self.cfg.num_ranks, self.rank);
        let dev = self.flags.device().clone();
        let board = self.cfg.flag_bytes() as u64;
        let masked = self.mask()?;
        for p in (0..r).filter(|&p| p != me && !masked[p]) {
            let at = self.peer_table[p].flags + board + 8 * me as u64;
            // SAFETY: word `me` of peer p's barrier words, inside its flags allocation (mapped
            // in this context for the Buffer's life); no kernel reads it.
            let mut w = unsafe { DeviceBuffer::view(&dev, at, 8) };
            w.copy_from_host(&[round])?;
        }
        let deadline = std::time::Instant::now() + self.cfg.timeout;
        let mut words = vec![0u64; r];
        // SAFETY: this rank's own barrier words, inside its flags allocation.
        let own = unsafe { DeviceBuffer::view(&dev, self.flags.device_ptr() + board, 8 * r) };
        loop {
            own.copy_to_host(&mut words)?;
            let masked = self.mask()?;
            let waiting: Vec<usize> =
                (0..r).filter(|&p| p != me && !masked[p] && words[p] < round).collect();
            if waiting.is_empty() {
                return Ok(());
            }
            let now = std::time::Instant::now();
            for &p in &waiting {
                if dead(p) {
                    self.set_mask(p, true, "the bootstrap saw it leave")?;
                } else if now >= deadline {
                    self.set_mask(
                        p,
                        true,
                        "it did not take part in clean_low_latency_buffer \
                                            within the timeout",
                    )?;
                }
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    pub fn rank(&self) -> usize {
        self.rank
    }
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// Runs `f` with this rank's launches going to `stream` (the caller's) instead of the
    /// rank's own: the kernels are ordered on it like any other work, with no event joins to a
    /// side stream. NOTES: every call used to join the rank's own stream with two event waits;
    /// since they went (with the device-wide synchronisations after fills), the 4-rank-threads
    /// flake has not recurred (ll_notes.md; the cause is not proven: a probe found no stream
    /// held behind another's spinning kernel).
    /// Afterwards an event on `stream` marks the rank's last launch for [`Self::finish`] and
    /// [`Self::clean`] (not while `stream` is being captured: a captured record is no event to
    /// wait for).
    pub(crate) fn with_stream<T>(
        &mut self,
        stream: &Stream,
        f: impl FnOnce(&mut Self) -> Result<T>,
    ) -> Result<T> {
        // SAFETY: the borrowed handle is dropped before this returns, while `stream` lives.
        self.launch_on = Some(unsafe { Stream::borrowed(stream.device(), stream.as_raw()) });
        let res = f(self);
        self.launch_on = None;
        let marked = match stream.is_capturing() {
            Ok(false) => self.last.record(stream),
            Ok(true) => Ok(()),
            Err(e) => Err(e),
        };
        let v = res?;
        marked?;
        Ok(v)
    }

    fn launch_stream(&self) -> &Stream {
        self.launch_on.as_ref().unwrap_or(&self.stream)
    }

    /// Waits (bounded: the config's timeout plus 5 s) for the rank's own stream and for its
    /// last launch on a caller's stream.
    fn wait_idle(&self) -> Result<()> {
        let limit = self.cfg.timeout + Duration::from_secs(5);
        self.stream.synchronize_within(limit)?;
        self.last.synchronize_within(limit)?;
        Ok(())
    }
    pub fn config(&self) -> &LlGpuConfig {
        &self.cfg
    }
    pub fn layout(&self) -> &LlLayout {
        &self.layout
    }
    /// Blocks per launch.
    pub fn grid(&self) -> u32 {
        self.grid
    }

    /// This rank's protocol state as its device memory holds it: the send ticket, the epoch of
    /// each set, and per set and phase the flag each source rank last published into this
    /// rank's first unit from it. What a timed-out wait needs beside its own error: a source's
    /// flag still 0 after its send ran (epoch advanced) means its stores went elsewhere; a flag
    /// that arrived after the wait gave up means a late send. Read with plain copies: call once
    /// this rank's kernels have stopped (peers may still write: a snapshot, not a fence).
    pub fn state_snapshot(&self) -> Result<String> {
        let ws: Vec<u64> = self.workspace.to_vec()?;
        let flags: Vec<u64> = self.flags.to_vec()?;
        let (e, r) = (self.cfg.num_experts, self.cfg.num_ranks);
        let l = e / r;
        let mut out = format!(
            "rank {}: calls {}, ticket {}, epochs [{}, {}]",
            self.rank,
            self.calls,
            ws[0] & 0xffff_ffff,
            ws[1],
            ws[2]
        );
        for set in 0..2 {
            for (phase, what) in [(0, "dispatch"), (1, "combine")] {
                // Dispatch unit of source src: e * R + src (e = 0); combine unit: src * L + e.
                let first = |src: usize| if phase == 0 { src } else { src * l };
                let vals: Vec<String> = (0..r)
                    .map(|src| format!("{:#x}", flags[(set * 2 + phase) * e + first(src)]))
                    .collect();
                out.push_str(&format!("; set {set} {what} flags from ranks [{}]", vals.join(", ")));
            }
        }
        Ok(out)
    }

    fn next_ticket(&mut self, num_tokens: usize) -> LlTicket {
        self.calls += 1;
        LlTicket {
            set: (self.calls % 2) as u32,
            num_tokens,
            pull_x: 0,
            chain: false,
            wait_stats: 0,
        }
    }

    /// A launch of at most `work` blocks (and at most the rank's budget): every LL kernel
    /// strides its work over the grid, so blocks past the work would only join the grid-wide
    /// ticket, the proxy handoff and their fences; a one-block grid skips both. (Measured at one
    /// token through the proxy: the send took as long at 1 block as at 66; its cost was the
    /// per-thread fences, since removed; ll_notes.md.)
    fn cfg(&self, smem: usize, work: usize) -> LaunchConfig {
        let grid = self.grid.min(u32::try_from(work.max(1)).unwrap_or(u32::MAX));
        LaunchConfig { grid, block: abi::FEP_LL_THREADS, shared_bytes: smem as u32 }
    }

    fn dispatch_params(
        &self,
        t: LlTicket,
        out: &LlDispatchOut,
    ) -> Result<abi::fep_ll_dispatch_params> {
        let c = &self.cfg;
        let (l, s, h) = (c.num_local_experts(), c.rows_per_expert(), c.hidden);
        let elem = if c.use_fp8 { 1 } else { 2 };
        need("out.recv_x", &out.recv_x, l * s * h * elem)?;
        if c.use_fp8 {
            need("out.recv_scales", &out.recv_scales, l * s * (h / 128) * 4)?;
        }
        need("out.recv_src_rank", &out.recv_src_rank, l * s * 4)?;
        need("out.recv_src_idx", &out.recv_src_idx, l * s * 4)?;
        need("out.recv_count", &out.recv_count, l * 4)?;
        need("out.layout_range", &out.layout_range, c.num_experts * 8)?;
        need("out.pos", &out.pos, t.num_tokens * c.num_topk * 4)?;
        let rec = &self.layout.dispatch_record;
        Ok(abi::fep_ll_dispatch_params {
            x: 0,
            topk_idx: 0,
            peers: self.peers.device_ptr(),
            workspace: self.workspace.device_ptr(),
            pos: out.pos.device_ptr(),
            local_buf: self.buf.device_ptr(),
            local_flags: self.flags.device_ptr(),
            recv_x: out.recv_x.device_ptr(),
            recv_scales: out.recv_scales.device_ptr(),
            recv_src_rank: out.recv_src_rank.device_ptr(),
            recv_src_idx: out.recv_src_idx.device_ptr(),
            recv_count: out.recv_count.device_ptr(),
            layout_range: out.layout_range.device_ptr(),
            dev_error: self.err.as_abi(),
            epoch: self.workspace.device_ptr() + 8,
            budget_cycles: c.budget_cycles(),
            unit_bytes: self.layout.unit_bytes,
            record_bytes: rec.bytes as u32,
            scales_offset: rec.scales_offset as u32,
            src_idx_offset: rec.src_idx_offset.unwrap_or(0) as u32,
            num_tokens: t.num_tokens as i32,
            hidden: h as i32,
            num_topk: c.num_topk as i32,
            num_experts: c.num_experts as i32,
            num_ranks: c.num_ranks as i32,
            max_tokens: c.max_tokens_per_rank as i32,
            rank: self.rank as i32,
            set: t.set as i32,
            use_fp8: c.use_fp8 as i32,
            round_scale: c.round_scale as i32,
            _pad: 0,
            proxy: self.proxy,
            wait_stats: t.wait_stats,
            shrink_mask: self.shrink.as_ref().map_or(0, |sh| sh.mask.device_ptr()),
            shrink_decide: self.shrink.as_ref().map_or(0, |sh| sh.decide.device_ptr()),
        })
    }

    /// Power-of-two fp8 scales (DeepEP's `round_scale`) for the dispatches launched from now on
    /// (a per-call choice: the receive only copies what the send cast).
    pub fn set_round_scale(&mut self, on: bool) -> Result<()> {
        if on && !self.cfg.use_fp8 {
            return Err(Error::arg("round_scale", "only meaningful with use_fp8"));
        }
        self.cfg.round_scale = on;
        Ok(())
    }

    /// Launches the dispatch send of `x [num_tokens, hidden]` bf16 and `topk_idx
    /// [num_tokens, K]` int64 (global ids, -1 = none, distinct per token) on this rank's stream.
    /// `out.pos` is written here; the rest of `out` by [`Self::dispatch_recv`] with the ticket.
    ///
    /// # Safety
    /// `x`, `topk_idx`, `out` and every rank of the group stay alive until this rank's stream has
    /// finished the launch.
    pub unsafe fn dispatch_send(
        &mut self,
        x: &DeviceBuffer,
        topk_idx: &DeviceBuffer,
        num_tokens: usize,
        out: &LlDispatchOut,
    ) -> Result<LlTicket> {
        let c = &self.cfg;
        if num_tokens > c.max_tokens_per_rank {
            return Err(Error::arg(
                "x",
                format!(
                    "{num_tokens} tokens, more than max_tokens_per_rank {}",
                    c.max_tokens_per_rank
                ),
            ));
        }
        need("x", x, num_tokens * c.hidden * 2)?;
        need("topk_idx", topk_idx, num_tokens * c.num_topk * 8)?;
        self.shrink_usable()?;
        let smem = self.cfg.send_smem(num_tokens);
        let mut t = self.next_ticket(num_tokens);
        let mut p = match self.dispatch_params(t, out) {
            Ok(p) => p,
            Err(e) => {
                self.calls -= 1;
                return Err(e);
            }
        };
        p.x = x.device_ptr();
        p.topk_idx = topk_idx.device_ptr();
        t.num_tokens = num_tokens;
        launch::ll_dispatch_send(self.launch_stream(), self.cfg(smem, num_tokens), p)?;
        Ok(t)
    }

    /// Launches the dispatch receive (the hook) of `t` into `out`.
    ///
    /// # Safety
    /// As [`Self::dispatch_send`].
    pub unsafe fn dispatch_recv(&self, t: LlTicket, out: &LlDispatchOut) -> Result<()> {
        let p = self.dispatch_params(t, out)?;
        let payload = if self.cfg.use_fp8 { self.cfg.hidden } else { 2 * self.cfg.hidden };
        let cfg = self.cfg(self.cfg.scan_smem(), self.cfg.row_blocks(payload));
        launch::ll_dispatch_recv(self.launch_stream(), cfg, p, t.chain)?;
        Ok(())
    }

    fn combine_params(
        &self,
        t: LlTicket,
        handle: &LlDispatchOut,
    ) -> Result<abi::fep_ll_combine_params> {
        let c = &self.cfg;
        need("handle.layout_range", &handle.layout_range, c.num_experts * 8)?;
        need("handle.pos", &handle.pos, t.num_tokens * c.num_topk * 4)?;
        Ok(abi::fep_ll_combine_params {
            x: 0,
            topk_idx: 0,
            topk_weights: 0,
            pos: handle.pos.device_ptr(),
            layout_range: handle.layout_range.device_ptr(),
            peers: self.peers.device_ptr(),
            workspace: self.workspace.device_ptr() + 4,
            local_buf: self.buf.device_ptr(),
            local_flags: self.flags.device_ptr(),
            out: 0,
            dev_error: self.err.as_abi(),
            epoch: self.workspace.device_ptr() + 8,
            budget_cycles: c.budget_cycles(),
            unit_bytes: self.layout.unit_bytes,
            record_bytes: self.layout.combine_record.bytes as u32,
            num_tokens: t.num_tokens as i32,
            hidden: c.hidden as i32,
            num_topk: c.num_topk as i32,
            num_experts: c.num_experts as i32,
            num_ranks: c.num_ranks as i32,
            max_tokens: c.max_tokens_per_rank as i32,
            rank: self.rank as i32,
            set: t.set as i32,
            self_pull: (t.pull_x != 0) as i32,
            proxy: self.proxy,
            wait_stats: t.wait_stats,
            shrink_mask: self.shrink.as_ref().map_or(0, |sh| sh.mask.device_ptr()),
            shrink_decide: self.shrink.as_ref().map_or(0, |sh| sh.decide.device_ptr()),
        })
    }

    /// Launches the combine send of `x [L, S, hidden]` bf16 (expert outputs, rows as this rank's
    /// dispatch `handle` received them). `num_tokens` is this rank's own token count (as passed
    /// to its dispatch; the combine receive needs it).
    ///
    /// # Safety
    /// As [`Self::dispatch_send`].
    pub unsafe fn combine_send(
        &mut self,
        x: &DeviceBuffer,
        handle: &LlDispatchOut,
        num_tokens: usize,
    ) -> Result<LlTicket> {
        self.combine_send_with(x, handle, num_tokens, false)
    }

    /// [`Self::combine_send`] that leaves the rows of this rank's own experts in `x`: the
    /// receive ([`Self::combine_recv`] with the returned ticket) reads them there instead of a
    /// copy, so they cross memory once less (at one rank, every row). Only for a send and
    /// receive made together (no hook): `x` must not change in between.
    ///
    /// # Safety
    /// As [`Self::dispatch_send`], and `x` stays unchanged until the receive has run.
    pub unsafe fn combine_send_pull(
        &mut self,
        x: &DeviceBuffer,
        handle: &LlDispatchOut,
        num_tokens: usize,
    ) -> Result<LlTicket> {
        self.combine_send_with(x, handle, num_tokens, true)
    }

    unsafe fn combine_send_with(
        &mut self,
        x: &DeviceBuffer,
        handle: &LlDispatchOut,
        num_tokens: usize,
        pull: bool,
    ) -> Result<LlTicket> {
        let c = &self.cfg;
        if num_tokens > c.max_tokens_per_rank {
            return Err(Error::arg("num_tokens", format!("{num_tokens} > max_tokens_per_rank")));
        }
        need("x", x, c.num_local_experts() * c.rows_per_expert() * c.hidden * 2)?;
        self.shrink_usable()?;
        let mut t = self.next_ticket(num_tokens);
        if pull {
            t.pull_x = x.device_ptr();
        }
        let mut p = match self.combine_params(t, handle) {
            Ok(p) => p,
            Err(e) => {
                self.calls -= 1;
                return Err(e);
            }
        };
        p.x = x.device_ptr();
        let cfg = self.cfg(self.cfg.scan_smem(), self.cfg.row_blocks(2 * self.cfg.hidden));
        launch::ll_combine_send(self.launch_stream(), cfg, p)?;
        Ok(t)
    }

    /// Launches the combine receive (the hook) of `t`: `out [T, hidden]` bf16 from this rank's
    /// `topk_idx`/`topk_weights [T, K]` (int64 / f32, as passed to the dispatch) and its `handle`.
    ///
    /// # Safety
    /// As [`Self::dispatch_send`].
    pub unsafe fn combine_recv(
        &self,
        t: LlTicket,
        topk_idx: &DeviceBuffer,
        topk_weights: &DeviceBuffer,
        handle: &LlDispatchOut,
        out: &DeviceBuffer,
    ) -> Result<()> {
        let c = &self.cfg;
        need("topk_idx", topk_idx, t.num_tokens * c.num_topk * 8)?;
        need("topk_weights", topk_weights, t.num_tokens * c.num_topk * 4)?;
        need("out", out, t.num_tokens * c.hidden * 2)?;
        let mut p = self.combine_params(t, handle)?;
        p.x = t.pull_x;
        p.topk_idx = topk_idx.device_ptr();
        p.topk_weights = topk_weights.device_ptr();
        p.out = out.device_ptr();
        launch::ll_combine_recv(
            self.launch_stream(),
            self.cfg(self.cfg.combine_recv_smem(), t.num_tokens),
            p,
            t.chain,
        )?;
        Ok(())
    }

    /// Waits (bounded: the config's timeout plus 5 s) for this rank's kernels, then turns a
    /// recorded device error into a typed error: a device wait that ran out becomes
    /// [`Error::Timeout`] naming this rank, the phase and the peer.
    pub fn finish(&self) -> Result<()> {
        self.wait_idle()?;
        self.err.check().map_err(|e| Error::from_device(e, phase_name, self.cfg.timeout))
    }
}

/// N ranks as threads of one process on one GPU (the harness the GPU tests and benchmark use).
pub struct LlGpuGroup {
    pub ranks: Vec<LlGpuRank>,
}

impl LlGpuGroup {
    /// Allocates every rank's buffers on `dev` and wires each rank's peer table to the others'
    /// buffers (direct device pointers).
    pub fn new(dev: &Device, cfg: LlGpuConfig) -> Result<Self> {
        let sms = dev.sm_count().max(1);
        let grid = cfg.sm_budget.unwrap_or((sms / cfg.num_ranks as u32).max(1));
        if grid == 0 || grid as u64 * cfg.num_ranks as u64 > sms as u64 {
            return Err(Error::arg(
                "sm_budget",
                format!(
                    "{grid} blocks x {} ranks: must be >= 1 and fit the GPU's {sms} SMs at once \
                     (the receive kernels spin on the other ranks' sends)",
                    cfg.num_ranks
                ),
            ));
        }
        let mut ranks = (0..cfg.num_ranks)
            .map(|rank| LlGpuRank::new_unconnected_in(dev, cfg.clone(), rank, grid, None))
            .collect::<Result<Vec<_>>>()?;
        let table: Vec<abi::fep_ll_peer> = ranks.iter().map(LlGpuRank::peer_entry).collect();
        for r in ranks.iter_mut() {
            // SAFETY: every entry addresses a rank of this group, whose buffers live as long
            // as the group (and so as every launch made through it).
            unsafe { r.set_peers(&table)? };
        }
        Ok(LlGpuGroup { ranks })
    }

    pub fn num_ranks(&self) -> usize {
        self.ranks.len()
    }

    /// Makes the buffers usable again after a failed call (a timeout): waits for every stream
    /// (bounded), zeroes flags and tickets, clears the error records and restarts the epochs.
    pub fn clean(&mut self) -> Result<()> {
        for r in &self.ranks {
            r.stream.synchronize_within(r.cfg.timeout + Duration::from_secs(5))?;
        }
        for r in self.ranks.iter_mut() {
            r.reset()?;
        }
        Ok(())
    }

    /// Every rank's [`LlGpuRank::finish`]; the first error wins (after all streams are drained).
    pub fn finish(&self) -> Result<()> {
        let mut first = None;
        for r in &self.ranks {
            if let Err(e) = r.finish() {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_checks() {
        let c = LlGpuConfig::bench(4);
        let l = c.layout().unwrap();
        assert_eq!(l.num_local_experts, 64);
        assert_eq!(l.dispatch_record.bytes, 7424);
        assert!(c.send_smem(128) <= SMEM_LIMIT);
        let mut bad = c.clone();
        bad.hidden = 7160;
        assert!(matches!(bad.layout(), Err(Error::InvalidArgument { arg: "hidden", .. })));
        let mut bad = c.clone();
        bad.num_experts = 255;
        assert!(matches!(bad.layout(), Err(Error::InvalidArgument { arg: "num_experts", .. })));
        let mut bad = c;
        bad.max_tokens_per_rank = 4096;
        assert!(bad.layout().is_err());
        assert_eq!(phase_name(abi::FEP_PHASE_LL_DISPATCH_RECV), "low-latency dispatch receive");
    }

    #[test]
    fn receive_grids_follow_the_most_rows_a_rank_can_get() {
        // DeepEP's standard at 4 ranks: 4 x 128 tokens x top-8 rows of 2 fp8 segments (7168 B)
        // over 16 warps a block: far above any SM budget, so the budget decides.
        let c = LlGpuConfig::bench(4);
        assert_eq!(c.row_blocks(c.hidden), 4 * 128 * 8 * 2 / 16);
        assert_eq!(c.row_blocks(2 * c.hidden), 4 * 128 * 8 * 4 / 16);
        // The proxy bench's 1-token case: 2 ranks, top-1 of 2 experts, rows of 128 channels.
        let tiny = LlGpuConfig {
            num_ranks: 2,
            num_experts: 2,
            hidden: 128,
            num_topk: 1,
            max_tokens_per_rank: 1,
            ..c
        };
        assert_eq!(tiny.row_blocks(tiny.hidden), 1);
        assert_eq!(tiny.row_blocks(2 * tiny.hidden), 1);
        // Top-k above the local experts: a token lands on each local expert at most once.
        let few = LlGpuConfig { num_ranks: 4, num_experts: 8, num_topk: 6, ..tiny };
        assert_eq!(few.row_blocks(128), (4 * 2_usize).div_ceil(16));
    }
}
