//! Normal-mode dispatch and combine on GPUs of one node: the kernels in `kernels/normal_*.cu`
//! driven from Rust, with ranks that reach each other's comm buffers through peer pointers (same
//! process: plain device pointers, several ranks may share one GPU; other processes: IPC
//! mappings, see [`PeerMemory`](crate::cuda::PeerMemory)).
//!
//! One file: `NormalGpuRank` owns the normal-mode buffers and launches notify, dispatch and combine
//! over them; its settings and byte map are already in normal_comm.rs, and `harness` sits beside
//! the rank it drives.
//!
//! Per step, each rank runs on its own stream:
//! 1. `get_dispatch_layout` ([`DispatchLayoutGpu`](super::layout_gpu::DispatchLayoutGpu)),
//! 2. [`NormalGpuRank::notify`]: send plan, count exchange; then either [`NormalGpuRank::recv_info`]
//!    (one host synchronisation, learns the receive counts) or, with `num_worst_tokens`, nothing,
//! 3. [`NormalGpuRank::dispatch`] through bounded per-peer queues,
//! 4. [`NormalGpuRank::combine`] with the same [`NormalHandle`].
//!
//! A cached-handle dispatch skips 1 and 2. All ranks must run the same sequence of notify /
//! dispatch / combine calls, and their kernels must be resident together: each rank's grid is its
//! SM budget (`num_sms`), so the sum over ranks sharing a GPU must not exceed its SM count.
//!
//! Buffers stay bounded: a rank's comm buffer holds `num_ranks x slots_per_peer` slots of
//! `chunk_tokens` records whatever the token count (see `fep_abi.h` for the map).
//!
//! NOTES: transports. Peers on this node are reached by stores through a peer pointer
//! ([`PeerTransport::PeerStore`]); peers on other nodes, once a
//! [`NormalProxyLane`](super::gpu::normal_proxy::NormalProxyLane) is attached
//! ([`NormalGpuRank::attach_proxy`]), through the CPU proxy ([`PeerTransport::Proxy`]): the same
//! queue protocol, with a chunk's peer stores replaced by staging plus one RMA write with
//! immediate data, its flag by the slot's arrival counter, and its credit by a zero-length write
//! (`fep_abi.h`, `fep_normal_proxy`).
//!
//! NOTES: after a device error (a bounded wait ran out, a count out of range) the protocol state
//! of every rank is undefined: call [`NormalGpuRank::reset`] on every rank (no kernel running)
//! before the next step.

use std::sync::Arc;
use std::time::Duration;

use super::gpu::normal_proxy::NormalProxyLane;
use crate::protocol::config::DispatchDtype;
// In a module of their own: the proxy lane (gpu::normal_proxy) needs them too, and this file
// needs the lane.
use super::layout_gpu::LayoutBuffers;
use super::normal_comm::MAX_RANKS;
pub use super::normal_comm::{CommMap, NormalGpuSettings};
use crate::abi;
use crate::cuda::launch;
use crate::cuda::{DevErrorRecord, Device, DeviceBuffer, HostMapped, Stream};
use crate::{Error, Result};

/// How a peer's queues are reached.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerTransport {
    /// Kernels store into the peer's buffer (same GPU, NVLink peer, IPC mapping). Built.
    PeerStore,
    /// Kernels push proxy commands; the proxy writes over libfabric (peers on other nodes).
    Proxy,
}

/// What a dispatch leaves for combine and for a cached dispatch (device memory).
pub struct NormalHandle {
    /// int32 `[R][capacity_tokens]`
    pub send_token_ids: DeviceBuffer,
    /// int32 `[capacity_tokens][R]`
    pub send_pos: DeviceBuffer,
    /// int32 `[R]`
    pub send_counts: DeviceBuffer,
    /// int32 `[R + 1]`
    pub rank_prefix: DeviceBuffer,
    /// int32 `[L]`
    pub recv_expert_counts: DeviceBuffer,
    capacity_tokens: usize,
    num_tokens: usize,
    num_ranks: usize,
    valid: bool,
}

impl NormalHandle {
    /// A handle for up to `capacity_tokens` input tokens of `rank`.
    pub fn new(rank: &NormalGpuRank, capacity_tokens: usize) -> Result<Self> {
        let dev = &rank.dev;
        let r = rank.settings.num_ranks;
        let l = rank.map.layout.num_local_experts as usize;
        Ok(NormalHandle {
            send_token_ids: DeviceBuffer::new(dev, 4 * r * capacity_tokens.max(1))?,
            send_pos: DeviceBuffer::new(dev, 4 * r * capacity_tokens.max(1))?,
            send_counts: DeviceBuffer::zeroed(dev, 4 * r)?,
            rank_prefix: DeviceBuffer::zeroed(dev, 4 * (r + 1))?,
            recv_expert_counts: DeviceBuffer::zeroed(dev, 4 * l)?,
            capacity_tokens,
            num_tokens: 0,
            num_ranks: r,
            valid: false,
        })
    }

    /// Input tokens of the dispatch this handle describes.
    pub fn num_tokens(&self) -> usize {
        self.num_tokens
    }

    fn as_abi(&self) -> abi::fep_normal_handle {
        abi::fep_normal_handle {
            send_token_ids: self.send_token_ids.device_ptr(),
            send_pos: self.send_pos.device_ptr(),
            send_counts: self.send_counts.device_ptr(),
            rank_prefix: self.rank_prefix.device_ptr(),
            recv_expert_counts: self.recv_expert_counts.device_ptr(),
            num_tokens: self.num_tokens as i32,
            _pad: 0,
        }
    }
}

/// Receive counts, read back after notify (the one host synchronisation).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecvInfo {
    /// `[R + 1]`
    pub rank_prefix: Vec<i32>,
    pub num_recv_tokens: usize,
    /// `[L]`, rounded up to the expert alignment.
    pub num_recv_tokens_per_expert: Vec<i32>,
}

/// Dispatch inputs (device memory).
pub struct DispatchInputs<'a> {
    /// bf16 or e4m3 `[num_tokens, hidden]`
    pub x: &'a DeviceBuffer,
    /// f32 `[num_tokens, hidden / 128]` (fp8 only)
    pub x_scales: Option<&'a DeviceBuffer>,
    /// int64 `[num_tokens, num_topk]`
    pub topk_idx: &'a DeviceBuffer,
    /// f32 `[num_tokens, num_topk]`
    pub topk_weights: &'a DeviceBuffer,
}

/// Dispatch outputs (device memory), `out_rows` rows each.
pub struct DispatchOutputs<'a> {
    pub recv_x: &'a DeviceBuffer,
    pub recv_x_scales: Option<&'a DeviceBuffer>,
    /// int64 `[rows, num_topk]`
    pub recv_topk_idx: &'a DeviceBuffer,
    /// f32 `[rows, num_topk]`
    pub recv_topk_weights: &'a DeviceBuffer,
    /// int32 `[rows]`
    pub recv_src_idx: &'a DeviceBuffer,
}

/// Combine inputs and outputs (device memory).
pub struct CombineArgs<'a> {
    /// bf16 `[rows, hidden]`: the processed received rows (rows as dispatch delivered them).
    pub x: &'a DeviceBuffer,
    /// f32 `[rows, num_topk]`, summed back like `x`.
    pub topk_weights: Option<&'a DeviceBuffer>,
    /// bf16 `[num_tokens, hidden]`
    pub combined_x: &'a DeviceBuffer,
    /// f32 `[num_tokens, num_topk]`
    pub combined_weights: Option<&'a DeviceBuffer>,
}

/// One rank of a normal-mode GPU group.
pub struct NormalGpuRank {
    rank: usize,
    settings: NormalGpuSettings,
    map: CommMap,
    dev: Device,
    buf: Arc<DeviceBuffer>,
    peers: [u64; MAX_RANKS],
    transports: Vec<PeerTransport>,
    err: DevErrorRecord,
    epoch: u64,
    proxy: Option<NormalProxyLane>,
    /// Page-locked landing area of the receive counts [`Self::recv_info`] reads back
    /// (`rank_prefix [R + 1]`, then `recv_expert_counts [L]`, i32).
    readback: HostMapped,
    /// Ranks known dead (the bootstrap's), asked while [`Self::recv_info`] waits.
    peer_watch: Option<crate::proxy::PeerWatch>,
}

/// Assumed SM clock for turning the timeout into a cycle budget (an H200 boosts to 1.98 GHz;
/// a slower clock only lengthens the wait).
const CYCLES_PER_SEC: f64 = 2.0e9;
/// Bytes before the totals in the mapped readback (the u64 epoch).
const READBACK_HEAD: usize = 8;

impl NormalGpuRank {
    /// Every rank of a group living in this process on `dev` (threads as ranks): comm buffers
    /// allocated and zeroed, peers addressed by plain device pointers.
    pub fn local_group(dev: &Device, settings: &NormalGpuSettings) -> Result<Vec<NormalGpuRank>> {
        let map = CommMap::new(settings)?;
        let r = settings.num_ranks;
        let sm = dev.sm_count() as usize;
        if settings.num_sms < 2 * r || settings.num_sms > sm {
            return Err(Error::arg(
                "num_sms",
                format!("{}: needs 2 x num_ranks ({r}) ..= {sm} SMs", settings.num_sms),
            ));
        }
        let mut bufs = Vec::with_capacity(r);
        for _ in 0..r {
            bufs.push(Arc::new(DeviceBuffer::zeroed(dev, map.total_bytes as usize)?));
        }
        let mut peers = [0u64; MAX_RANKS];
        for (p, b) in peers.iter_mut().zip(&bufs) {
            *p = b.device_ptr();
        }
        let mut out = Vec::with_capacity(r);
        for (rank, buf) in bufs.into_iter().enumerate() {
            out.push(NormalGpuRank {
                rank,
                settings: settings.clone(),
                map,
                dev: dev.clone(),
                buf,
                peers,
                transports: vec![PeerTransport::PeerStore; r],
                err: DevErrorRecord::new(dev)?,
                epoch: 0,
                proxy: None,
                readback: Self::new_readback(dev, settings, &map)?,
                peer_watch: None,
            });
        }
        Ok(out)
    }

    /// One rank whose peers' comm buffers were allocated elsewhere and whose device pointers
    /// this rank can use directly (ranks as threads of one process on `dev`, or IPC mappings):
    /// `buf` is this rank's own comm buffer (zeroed, [`CommMap::total_bytes`] at least),
    /// `peer_ptrs[p]` rank `p`'s buffer (`peer_ptrs[rank]` is `buf`'s pointer).
    ///
    /// # Safety
    /// Every pointer of `peer_ptrs` addresses a zeroed comm buffer of this map's size that stays
    /// allocated while this rank's kernels may run.
    pub unsafe fn from_peer_pointers(
        dev: &Device,
        settings: &NormalGpuSettings,
        rank: usize,
        buf: Arc<DeviceBuffer>,
        peer_ptrs: &[u64],
    ) -> Result<NormalGpuRank> {
        let map = CommMap::new(settings)?;
        let r = settings.num_ranks;
        let sm = dev.sm_count() as usize;
        if settings.num_sms < 2 * r || settings.num_sms > sm || settings.num_sms % 2 != 0 {
            return Err(Error::arg(
                "num_sms",
                format!("{}: needs an even 2 x num_ranks ({r}) ..= {sm} SMs", settings.num_sms),
            ));
        }
        if peer_ptrs.len() != r || rank >= r {
            return Err(Error::arg(
                "peer_ptrs",
                format!("{} pointers for rank {rank} of {r}", peer_ptrs.len()),
            ));
        }
        if (buf.len() as u64) < map.total_bytes || peer_ptrs[rank] != buf.device_ptr() {
            return Err(Error::arg(
                "buf",
                format!(
                    "{} bytes (needs {}), or not peer_ptrs[{rank}]",
                    buf.len(),
                    map.total_bytes
                ),
            ));
        }
        let mut peers = [0u64; MAX_RANKS];
        peers[..r].copy_from_slice(peer_ptrs);
        Ok(NormalGpuRank {
            rank,
            settings: settings.clone(),
            map,
            dev: dev.clone(),
            buf,
            peers,
            transports: vec![PeerTransport::PeerStore; r],
            err: DevErrorRecord::new(dev)?,
            epoch: 0,
            proxy: None,
            readback: Self::new_readback(dev, settings, &map)?,
            peer_watch: None,
        })
    }

    /// The notify's totals for the host (fep_abi.h `host_counts`): the u64 epoch of the last
    /// notify that wrote them, then rank_prefix `[R + 1]` and the per-local-expert counts `[L]`.
    fn new_readback(dev: &Device, s: &NormalGpuSettings, map: &CommMap) -> Result<HostMapped> {
        let l = map.layout.num_local_experts as usize;
        let m = HostMapped::new(dev, READBACK_HEAD + 4 * (s.num_ranks + 1 + l))?;
        m.write::<u64>(0, 0)?;
        Ok(m)
    }

    pub fn rank(&self) -> usize {
        self.rank
    }
    /// Lets [`Self::recv_info`] end at once, naming the rank, when `watch` reports one dead.
    pub fn watch_peers(&mut self, watch: crate::proxy::PeerWatch) {
        self.peer_watch = Some(watch);
    }
    pub fn settings(&self) -> &NormalGpuSettings {
        &self.settings
    }
    pub fn comm_map(&self) -> &CommMap {
        &self.map
    }
    pub fn device(&self) -> &Device {
        &self.dev
    }
    /// How each peer is reached.
    pub fn transports(&self) -> &[PeerTransport] {
        &self.transports
    }

    /// The proxy lane, if one is attached.
    pub fn proxy_lane(&self) -> Option<&NormalProxyLane> {
        self.proxy.as_ref()
    }

    /// Routes the lane's peers (its mask: the ranks on other nodes) through the proxy. Before
    /// the first step; the lane must have a ring per block of this rank's kernels.
    pub fn attach_proxy(&mut self, lane: NormalProxyLane) -> Result<()> {
        let r = self.settings.num_ranks;
        if (lane.num_rings() as usize) < self.settings.num_sms.max(r) {
            return Err(Error::arg(
                "lane",
                format!(
                    "{} rings for {} blocks per kernel",
                    lane.num_rings(),
                    self.settings.num_sms
                ),
            ));
        }
        let mask = lane.mask();
        if mask >> self.rank & 1 == 1 || (r < 32 && mask >> r != 0) {
            return Err(Error::arg(
                "lane",
                format!("mask {mask:#x} for rank {} of {r}", self.rank),
            ));
        }
        for (p, t) in self.transports.iter_mut().enumerate() {
            if mask >> p & 1 == 1 {
                *t = PeerTransport::Proxy;
                // Never dereferenced by the kernels (the mask routes this peer to the proxy).
                self.peers[p] = 0;
            }
        }
        self.proxy = Some(lane);
        Ok(())
    }

    /// Zeroes this rank's comm buffer, error record and proxy counters (after an error; every
    /// rank must do it, with no kernel of the group running and no proxy write in flight).
    pub fn reset(&mut self) -> Result<()> {
        self.buf.memset(0)?;
        self.err.reset()?;
        if let Some(l) = &self.proxy {
            l.reset_counters();
        }
        self.epoch = 0;
        Ok(())
    }

    /// The typed device error recorded by this rank's kernels, if any (after its stream has
    /// synchronised), else the proxy worker's error, if it stopped on one.
    pub fn check(&self) -> Result<()> {
        self.err.check().map_err(Error::from)?;
        match &self.proxy {
            Some(l) => l.check(),
            None => Ok(()),
        }
    }

    /// Synchronises `stream` within the timeout (plus slack), then [`Self::check`].
    pub fn finish(&self, stream: &Stream) -> Result<()> {
        stream.synchronize_within(self.settings.timeout * 2 + Duration::from_secs(5))?;
        self.check()
    }

    fn comm(&self) -> abi::fep_normal_comm {
        let budget = (self.settings.timeout.as_secs_f64() * CYCLES_PER_SEC) as u64;
        abi::fep_normal_comm {
            peer_base: self.peers,
            recv_offset: self.map.recv_offset,
            flag_offset: self.map.flag_offset,
            credit_offset: self.map.credit_offset,
            notify_offset: self.map.notify_offset,
            ack_offset: self.map.ack_offset,
            state_offset: self.map.state_offset,
            slot_bytes: self.map.layout.slot_bytes,
            notify_bytes: self.map.notify_bytes,
            dev_error: self.err.as_abi(),
            budget_cycles: budget.max(1),
            rank: self.rank as u32,
            num_ranks: self.settings.num_ranks as u32,
            slots_per_peer: self.settings.slots_per_peer as u32,
            chunk_tokens: self.settings.chunk_tokens as u32,
            num_local_experts: self.map.layout.num_local_experts as u32,
            _pad: 0,
            proxy: self.proxy.as_ref().map(|l| l.as_abi()).unwrap_or_default(),
        }
    }

    fn check_transports(&self) -> Result<()> {
        if self.proxy.is_none() {
            if let Some(p) = self.transports.iter().position(|t| *t == PeerTransport::Proxy) {
                return Err(Error::arg("transport", format!("peer {p}: proxy without a lane")));
            }
        }
        Ok(())
    }

    /// Notify: builds the send plan into `handle` and exchanges counts with every rank.
    /// `layout` holds this rank's `get_dispatch_layout` outputs for `num_tokens` tokens;
    /// `out_capacity` is the most rows the receive outputs may get (`num_worst_tokens` when
    /// given): more is a device error naming the phase.
    ///
    /// # Safety
    /// `layout` and `handle` stay alive and untouched until `stream` has finished; every rank of
    /// the group runs its notify concurrently (else the waits time out).
    pub unsafe fn notify(
        &mut self,
        stream: &Stream,
        layout: &LayoutBuffers,
        num_tokens: usize,
        handle: &mut NormalHandle,
        expert_alignment: usize,
        out_capacity: usize,
    ) -> Result<()> {
        self.check_transports()?;
        let r = self.settings.num_ranks;
        if num_tokens > handle.capacity_tokens || num_tokens > i32::MAX as usize {
            return Err(Error::arg(
                "num_tokens",
                format!("{num_tokens}: the handle holds {}", handle.capacity_tokens),
            ));
        }
        if handle.num_ranks != r {
            return Err(Error::arg("handle", "made for another group"));
        }
        if layout.is_token_in_rank.len() < num_tokens * r
            || layout.num_tokens_per_expert.len() < 4 * self.settings.num_experts
        {
            return Err(Error::arg("layout", "buffers smaller than num_tokens x num_ranks"));
        }
        if expert_alignment == 0 || expert_alignment > i32::MAX as usize {
            return Err(Error::arg(
                "expert_alignment",
                format!("{expert_alignment}: must be >= 1"),
            ));
        }
        handle.num_tokens = num_tokens;
        handle.valid = true;
        self.epoch += 1;
        let p = abi::fep_normal_notify_params {
            comm: self.comm(),
            handle: handle.as_abi(),
            is_token_in_rank: layout.is_token_in_rank.device_ptr(),
            num_tokens_per_expert: layout.num_tokens_per_expert.device_ptr(),
            epoch: self.epoch,
            expert_alignment: expert_alignment as i32,
            out_capacity: out_capacity.min(i32::MAX as usize) as i32,
            host_counts: self.readback.device_ptr(),
        };
        launch::normal_notify(stream, p).map_err(Error::from)
    }

    /// After [`Self::notify`]: waits (bounded) until the notify kernel has written its totals
    /// into mapped host memory and reads the receive counts, without synchronising `stream`.
    ///
    /// NOTES: the notify's last block writes the totals there itself and then release-stores
    /// this notify's epoch (fep_abi.h `host_counts`), so the host sees them the moment they
    /// exist, not after the kernel's end, a copy and a stream synchronisation. A notify that
    /// fails returns without the epoch: the stream then ends without it, and the device error
    /// (or, if none was recorded, a protocol error) is returned instead.
    pub fn recv_info(&self, stream: &Stream, handle: &NormalHandle) -> Result<RecvInfo> {
        let (pre, per) = (handle.rank_prefix.len() / 4, handle.recv_expert_counts.len() / 4);
        if READBACK_HEAD + 4 * (pre + per) > self.readback.len() {
            return Err(Error::arg("handle", "made for another group"));
        }
        let epoch = self.epoch;
        let limit = self.settings.timeout * 2 + Duration::from_secs(5);
        let arrived =
            || -> crate::cuda::CudaResult<bool> { Ok(self.readback.read::<u64>(0)? == epoch) };
        let (mut ended, mut dead) = (false, None);
        crate::cuda::poll_within(limit, "the notify's totals", || {
            if arrived()? {
                return Ok(true);
            }
            dead = self.peer_watch.as_ref().and_then(|w| w().first().copied());
            if dead.is_some() {
                return Ok(true);
            }
            ended = stream.query()?;
            Ok(ended)
        })?;
        if let Some(d) = dead {
            return Err(Error::Proxy(crate::proxy::ProxyError::PeerDead {
                rank: self.rank as u32,
                peer: d.rank as u32,
                waiting: Vec::new(),
                reported_by: d.reported_by.map(|b| b as u32),
            }));
        }
        if ended && !arrived()? {
            self.check()?;
            return Err(Error::Protocol {
                rank: self.rank,
                peer: self.rank,
                phase: "notify",
                msg: "the notify kernel ended without its totals".into(),
            });
        }
        self.check()?;
        let read = |off: usize, n: usize| -> Result<Vec<i32>> {
            (0..n).map(|i| Ok(self.readback.read::<i32>(off + 4 * i)?)).collect()
        };
        let rank_prefix = read(READBACK_HEAD, pre)?;
        let per_expert = read(READBACK_HEAD + 4 * pre, per)?;
        let n = *rank_prefix.last().unwrap_or(&0);
        Ok(RecvInfo {
            num_recv_tokens: n.max(0) as usize,
            rank_prefix,
            num_recv_tokens_per_expert: per_expert,
        })
    }

    fn need(what: &'static str, b: &DeviceBuffer, bytes: usize) -> Result<()> {
        if b.len() < bytes {
            return Err(Error::arg(what, format!("{} bytes, needs {bytes}", b.len())));
        }
        Ok(())
    }

    /// Dispatch with `handle` (fresh from notify, or cached). Outputs get `out_rows` rows: the
    /// received count, or `num_worst_tokens` (rows past the received ones are padding).
    ///
    /// # Safety
    /// All buffers stay alive until `stream` has finished; every rank of the group dispatches
    /// concurrently.
    pub unsafe fn dispatch(
        &self,
        stream: &Stream,
        handle: &NormalHandle,
        inp: &DispatchInputs<'_>,
        out: &DispatchOutputs<'_>,
        out_rows: usize,
    ) -> Result<()> {
        self.check_transports()?;
        if !handle.valid {
            return Err(Error::arg("handle", "no notify has filled it"));
        }
        let s = &self.settings;
        let rec = self.map.layout.dispatch_record;
        let (t, h, k) = (handle.num_tokens, s.hidden, s.num_topk);
        let payload = rec.payload_bytes as usize;
        Self::need("x", inp.x, t * payload)?;
        Self::need("topk_idx", inp.topk_idx, t * k * 8)?;
        Self::need("topk_weights", inp.topk_weights, t * k * 4)?;
        Self::need("recv_x", out.recv_x, out_rows * payload)?;
        Self::need("recv_topk_idx", out.recv_topk_idx, out_rows * k * 8)?;
        Self::need("recv_topk_weights", out.recv_topk_weights, out_rows * k * 4)?;
        Self::need("recv_src_idx", out.recv_src_idx, out_rows * 4)?;
        let fp8 = s.dtype == DispatchDtype::Fp8E4m3;
        let (xs, rxs) = match (fp8, inp.x_scales, out.recv_x_scales) {
            (false, _, _) => (0, 0),
            (true, Some(a), Some(b)) => {
                let g = h / 128;
                Self::need("x_scales", a, t * g * 4)?;
                Self::need("recv_x_scales", b, out_rows * g * 4)?;
                (a.device_ptr(), b.device_ptr())
            }
            _ => return Err(Error::arg("x_scales", "fp8 dispatch needs scales in and out")),
        };
        if out_rows > i32::MAX as usize {
            return Err(Error::arg("out_rows", format!("{out_rows} exceeds i32::MAX")));
        }
        let p = abi::fep_normal_dispatch_params {
            comm: self.comm(),
            handle: handle.as_abi(),
            x: inp.x.device_ptr(),
            x_scales: xs,
            topk_idx: inp.topk_idx.device_ptr(),
            topk_weights: inp.topk_weights.device_ptr(),
            recv_x: out.recv_x.device_ptr(),
            recv_x_scales: rxs,
            recv_topk_idx: out.recv_topk_idx.device_ptr(),
            recv_topk_weights: out.recv_topk_weights.device_ptr(),
            recv_src_idx: out.recv_src_idx.device_ptr(),
            out_rows: out_rows as i32,
            num_topk: k as i32,
            record_bytes: rec.bytes as u32,
            payload_bytes: rec.payload_bytes as u32,
            num_scales: rec.num_scales as u32,
            scales_offset: rec.scales_offset as u32,
            topk_idx_offset: rec.topk_idx_offset as u32,
            topk_weights_offset: rec.topk_weights_offset as u32,
            src_idx_offset: rec.src_idx_offset.unwrap_or(0) as u32,
            bulk_movers: launch::dispatch_movers(rec.payload_bytes as u32),
        };
        launch::normal_dispatch(stream, s.num_sms as u32, p).map_err(Error::from)
    }

    /// Combine with the dispatch's `handle`. `args.x` has at least the received rows.
    ///
    /// # Safety
    /// As [`Self::dispatch`].
    pub unsafe fn combine(
        &self,
        stream: &Stream,
        handle: &NormalHandle,
        args: &CombineArgs<'_>,
        recv_rows: usize,
    ) -> Result<()> {
        self.check_transports()?;
        if !handle.valid {
            return Err(Error::arg("handle", "no notify has filled it"));
        }
        let s = &self.settings;
        let rec = self.map.layout.combine_record;
        let (t, h, k) = (handle.num_tokens, s.hidden, s.num_topk);
        Self::need("x", args.x, recv_rows * h * 2)?;
        Self::need("combined_x", args.combined_x, t * h * 2)?;
        if let Some(w) = args.topk_weights {
            Self::need("topk_weights", w, recv_rows * k * 4)?;
        }
        if let Some(w) = args.combined_weights {
            Self::need("combined_weights", w, t * k * 4)?;
        }
        let p = abi::fep_normal_combine_params {
            comm: self.comm(),
            handle: handle.as_abi(),
            x: args.x.device_ptr(),
            topk_weights: args.topk_weights.map_or(0, |b| b.device_ptr()),
            combined_x: args.combined_x.device_ptr(),
            combined_weights: args.combined_weights.map_or(0, |b| b.device_ptr()),
            hidden: h as i32,
            num_topk: k as i32,
            record_bytes: rec.bytes as u32,
            topk_weights_offset: rec.topk_weights_offset as u32,
        };
        launch::normal_combine(stream, s.num_sms as u32, p).map_err(Error::from)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn comm_map_is_bounded_and_aligned() {
        let s = NormalGpuSettings::new(4, 256, 7168, 8, DispatchDtype::Fp8E4m3);
        let m = CommMap::new(&s).unwrap();
        for o in [m.flag_offset, m.credit_offset, m.notify_offset, m.ack_offset, m.state_offset] {
            assert_eq!(o % 256, 0);
        }
        assert!(m.total_bytes > m.state_offset);
        // Independent of the token count: 4 peers x spp slots x 16 records of at most 14.4 KB
        // (the record bytes plus the flag, credit, notify and state areas).
        let data = 4 * s.slots_per_peer as u64 * 16 * 14_400;
        assert!(m.total_bytes < data + (1 << 20), "{} for spp {}", m.total_bytes, s.slots_per_peer);
        assert!(CommMap::new(&NormalGpuSettings { num_ranks: 9, ..s.clone() }).is_err());
        assert!(CommMap::new(&NormalGpuSettings { num_topk: 33, ..s }).is_err());
    }
}

/// Threads-as-ranks harness on one GPU, shared by tests/gpu_normal.rs and
/// ep-bench/examples/gpu_normal_bench.rs: per-rank device buffers and one full step
/// (layout -> notify -> [recv_info] -> dispatch -> combine).
pub mod harness {
    use super::*;
    use crate::bootstrap::InProcGroup;
    use crate::ep::gpu::normal_proxy::ProxyLaneSettings;
    use crate::ep::layout_gpu::{DispatchLayoutGpu, LayoutTuning};

    /// One rank's inputs, on the host.
    #[derive(Clone, Debug)]
    pub struct RankInput {
        pub num_tokens: usize,
        /// bf16 bits as little-endian bytes, or e4m3 bytes: `[num_tokens, payload]`
        pub x: Vec<u8>,
        /// f32 `[num_tokens, hidden / 128]` (fp8), else empty
        pub x_scales: Vec<f32>,
        pub topk_idx: Vec<i64>,
        pub topk_weights: Vec<f32>,
        /// bf16 `[out_capacity, hidden]` the rank "computes" for combine (`None`: recv_x, bf16 only)
        pub combine_x: Option<Vec<u16>>,
        /// f32 `[out_capacity, topk]` combine weights
        pub combine_weights: Option<Vec<f32>>,
    }

    /// Device buffers of one rank.
    pub struct RankBuffers {
        pub stream: Stream,
        pub layout_gpu: DispatchLayoutGpu,
        pub layout: LayoutBuffers,
        pub handle: NormalHandle,
        pub num_tokens: usize,
        pub out_capacity: usize,
        pub x: DeviceBuffer,
        pub x_scales: Option<DeviceBuffer>,
        pub topk_idx: DeviceBuffer,
        pub topk_weights: DeviceBuffer,
        pub recv_x: DeviceBuffer,
        pub recv_x_scales: Option<DeviceBuffer>,
        pub recv_topk_idx: DeviceBuffer,
        pub recv_topk_weights: DeviceBuffer,
        pub recv_src_idx: DeviceBuffer,
        pub combine_x: Option<DeviceBuffer>,
        pub combine_weights: Option<DeviceBuffer>,
        pub combined_x: DeviceBuffer,
        pub combined_weights: DeviceBuffer,
    }

    impl RankBuffers {
        pub fn new(rank: &NormalGpuRank, inp: &RankInput, out_capacity: usize) -> Result<Self> {
            let dev = rank.device();
            let s = rank.settings();
            let (t, h, k) = (inp.num_tokens, s.hidden, s.num_topk);
            let payload = rank.comm_map().layout.dispatch_record.payload_bytes as usize;
            let fp8 = s.dtype == DispatchDtype::Fp8E4m3;
            let cap = out_capacity.max(1);
            let layout_gpu = DispatchLayoutGpu::new(dev, s.num_experts, s.num_ranks, s.num_ranks)?;
            let layout = LayoutBuffers::new(&layout_gpu, t.max(1))?;
            let upload = |b: &[u8]| -> Result<DeviceBuffer> {
                if b.is_empty() {
                    Ok(DeviceBuffer::new(dev, 16)?)
                } else {
                    Ok(DeviceBuffer::from_slice(dev, b)?)
                }
            };
            let f32s = |v: &[f32]| upload(bytemuck::cast_slice(v));
            Ok(RankBuffers {
                stream: Stream::new(dev)?,
                handle: NormalHandle::new(rank, t.max(1))?,
                layout_gpu,
                layout,
                num_tokens: t,
                out_capacity,
                x: upload(&inp.x)?,
                x_scales: if fp8 { Some(f32s(&inp.x_scales)?) } else { None },
                topk_idx: upload(bytemuck::cast_slice(&inp.topk_idx))?,
                topk_weights: f32s(&inp.topk_weights)?,
                recv_x: DeviceBuffer::new(dev, cap * payload)?,
                recv_x_scales: if fp8 {
                    Some(DeviceBuffer::new(dev, cap * (h / 128) * 4)?)
                } else {
                    None
                },
                recv_topk_idx: DeviceBuffer::new(dev, cap * k * 8)?,
                recv_topk_weights: DeviceBuffer::new(dev, cap * k * 4)?,
                recv_src_idx: DeviceBuffer::new(dev, cap * 4)?,
                combine_x: match &inp.combine_x {
                    Some(v) => Some(upload(bytemuck::cast_slice(v))?),
                    None => None,
                },
                combine_weights: match &inp.combine_weights {
                    Some(v) => Some(f32s(v)?),
                    None => None,
                },
                combined_x: DeviceBuffer::new(dev, t.max(1) * h * 2)?,
                combined_weights: DeviceBuffer::new(dev, t.max(1) * k * 4)?,
            })
        }

        /// Fills every output with `byte`, ordered on the rank's stream.
        pub fn poison(&self, byte: u8) -> Result<()> {
            let s = &self.stream;
            for b in [
                &self.recv_x,
                &self.recv_topk_idx,
                &self.recv_topk_weights,
                &self.recv_src_idx,
                &self.combined_x,
                &self.combined_weights,
            ] {
                b.memset_async(byte, s)?;
            }
            if let Some(b) = &self.recv_x_scales {
                b.memset_async(byte, s)?;
            }
            Ok(())
        }
    }

    /// Attaches a proxy lane to every rank of a threads-as-ranks group (collective over an
    /// in-process bootstrap, one thread per rank): ranks on different nodes
    /// (`rank / lane.ranks_per_node`) reach each other through `lane.provider`; ranks of one
    /// node keep their peer pointers.
    pub fn attach_proxy_lanes(
        ranks: &mut [NormalGpuRank],
        lane: &ProxyLaneSettings,
        timeout: Duration,
    ) -> Result<()> {
        let boots = InProcGroup::new(ranks.len(), lane.ranks_per_node, timeout)?;
        let results: Vec<Result<()>> = std::thread::scope(|sc| {
            let handles: Vec<_> = ranks
                .iter_mut()
                .zip(boots)
                .map(|(rank, boot)| {
                    sc.spawn(move || -> Result<()> {
                        let dev = rank.device().clone();
                        dev.bind()?;
                        let s = rank.settings().clone();
                        let rings = s.num_sms.max(s.num_ranks) as u32;
                        let l = NormalProxyLane::connect(&dev, &boot, &s, lane, rings)?;
                        rank.attach_proxy(l)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| Err(Error::Other("lane thread panicked".into())))
                })
                .collect()
        });
        results.into_iter().collect()
    }

    /// Options of one step.
    #[derive(Clone, Copy, Debug, Default)]
    pub struct StepOptions {
        pub expert_alignment: usize,
        pub num_worst_tokens: Option<usize>,
        /// Reuse the handle of the previous step (no layout, no notify).
        pub cached: bool,
        /// Stop after dispatch.
        pub skip_combine: bool,
    }

    /// What a step learned on the host.
    #[derive(Clone, Debug)]
    pub struct StepOut {
        /// `None` in num_worst_tokens mode (no host synchronisation before dispatch).
        pub info: Option<RecvInfo>,
        pub out_rows: usize,
    }

    /// Launches layout + notify (fresh handle) on the rank's stream.
    ///
    /// # Safety
    /// `b` stays alive until its stream has finished; all ranks run it concurrently.
    pub unsafe fn launch_notify(
        rank: &mut NormalGpuRank,
        b: &mut RankBuffers,
        expert_alignment: usize,
        out_capacity: usize,
    ) -> Result<()> {
        let s = rank.settings().clone();
        b.layout_gpu.launch(
            &b.stream,
            &b.topk_idx,
            b.num_tokens,
            s.num_topk,
            &b.layout,
            None,
            rank.rank() as u32,
            LayoutTuning::default(),
        )?;
        rank.notify(
            &b.stream,
            &b.layout,
            b.num_tokens,
            &mut b.handle,
            expert_alignment,
            out_capacity,
        )
    }

    /// Launches dispatch on the rank's stream.
    ///
    /// # Safety
    /// As [`launch_notify`].
    pub unsafe fn launch_dispatch(
        rank: &NormalGpuRank,
        b: &RankBuffers,
        out_rows: usize,
    ) -> Result<()> {
        rank.dispatch(
            &b.stream,
            &b.handle,
            &DispatchInputs {
                x: &b.x,
                x_scales: b.x_scales.as_ref(),
                topk_idx: &b.topk_idx,
                topk_weights: &b.topk_weights,
            },
            &DispatchOutputs {
                recv_x: &b.recv_x,
                recv_x_scales: b.recv_x_scales.as_ref(),
                recv_topk_idx: &b.recv_topk_idx,
                recv_topk_weights: &b.recv_topk_weights,
                recv_src_idx: &b.recv_src_idx,
            },
            out_rows,
        )
    }

    /// Launches combine on the rank's stream (input: `combine_x`, else `recv_x`).
    ///
    /// # Safety
    /// As [`launch_notify`].
    pub unsafe fn launch_combine(
        rank: &NormalGpuRank,
        b: &RankBuffers,
        recv_rows: usize,
    ) -> Result<()> {
        rank.combine(
            &b.stream,
            &b.handle,
            &CombineArgs {
                x: b.combine_x.as_ref().unwrap_or(&b.recv_x),
                topk_weights: b.combine_weights.as_ref(),
                combined_x: &b.combined_x,
                combined_weights: Some(&b.combined_weights),
            },
            recv_rows,
        )
    }

    /// One full step of one rank (call from the rank's thread; all ranks step together).
    pub fn step(rank: &mut NormalGpuRank, b: &mut RankBuffers, o: StepOptions) -> Result<StepOut> {
        let cap = o.num_worst_tokens.unwrap_or(b.out_capacity);
        // SAFETY: `b` outlives the synchronisations below (finish), which end every launch.
        unsafe {
            if !o.cached {
                launch_notify(rank, b, o.expert_alignment.max(1), cap)?;
            }
            let (info, out_rows) = match o.num_worst_tokens {
                Some(w) => (None, w),
                None => {
                    let i = rank.recv_info(&b.stream, &b.handle)?;
                    let n = i.num_recv_tokens;
                    (Some(i), n)
                }
            };
            launch_dispatch(rank, b, out_rows)?;
            rank.finish(&b.stream)?;
            if !o.skip_combine {
                launch_combine(rank, b, out_rows)?;
                rank.finish(&b.stream)?;
            }
            Ok(StepOut { info, out_rows })
        }
    }
}
