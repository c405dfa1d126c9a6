//! DeepEP's internode hierarchy on the GPU backend: the same two stages as [`super::hier`]
//! (a rail stage with one copy of a token per destination node, then the gateway's fan-out
//! inside its node), each stage a GPU [`Buffer`] running the direct path's kernels, proxy and
//! transport unchanged. Between the stages only stream-ordered copies run (no new kernels):
//!
//! One file: `GpuHierBuffer` composes the two stages over scratch buffers (`RailScratch`,
//! `NodeScratch`) private to it; the host hierarchy it mirrors is hier.rs.
//!
//! * **widen**: the rail stage's rows are copied into rows of hidden + 128 (a strided copy) and
//!   the metadata lane's first 8 bytes are set: the source node (one 2-D memset per source
//!   node, whose rows are contiguous) and the token's index on its source (a strided copy of
//!   the rail stage's `recv_src_idx`);
//! * **final order**: after the node stage the lanes are read back (one strided copy to pinned
//!   host memory and the dispatch's one host synchronisation), the direct path's order is
//!   computed on the host (`protocol::hier::final_order`); it is a permutation of at most
//!   `nodes x ranks_per_node` contiguous runs, so the rows are moved by one strided copy per run
//!   and tensor. A cached dispatch reuses the runs without reading anything back.
//! * **combine**: the expert outputs are copied into the node stage's order and width (per run),
//!   the node stage combines them at the gateways (the node's partial in bf16), a strided copy
//!   drops the lane, and the rail stage combines them at the sources.
//!
//! NOTES (what this costs against DeepEP's design): DeepEP's gateway forwards from its receive
//! buffer inside the kernel; here each stage is a whole dispatch, so a token crosses device
//! memory three times more (widen, node stage, final copy), and a fresh dispatch synchronises
//! the host three times (two notifies, the lanes). docs/ARCHITECTURE.md ("Internode: direct
//! per-rank sends vs DeepEP's hierarchy") has what was measured and what the library keeps.
//!
//! All calls of one [`GpuHierBuffer`] go on one stream, in the same order on every rank (they
//! are collective, like the direct path's).

use std::sync::Arc;
use std::time::Duration;

use super::buffer::{check_boot, Backend, Buffer, BufferOptions};
use super::gpu::{
    DevSlice, GpuCombineArgs, GpuDispatchArgs, GpuDispatchBuffers, GpuDispatchOut, GpuHandle,
    GpuNotifyArgs, GpuOptions, DEFAULT_MAX_SMS,
};
use super::hier::{check_world, stage_boots, world_err};
use crate::bootstrap::Bootstrap;
use crate::cuda::{
    copy_2d_async, memset_2d_u32_async, memset_range_async, CudaError, DeviceBuffer, Event,
    HostMapped, Stream,
};
use crate::protocol::config::{DispatchDtype, EpConfig};
use crate::protocol::hier::{final_order, rows_by_source, stage_settings, META_CHANNELS};
use crate::protocol::quant::FP8_GROUP;
use crate::{Error, Result};

/// This rank's own CUDA calls between the stages (copies, memsets, the pinned stage's waits) as
/// errors naming the job rank: a driver error keeps its type (`FEP_ERR_CUDA`) with the rank in
/// its text; a host wait that ran out becomes [`Error::Timeout`] of this rank. (The stages'
/// errors are mapped by `rail_err` / `node_err`.)
fn local(rank: usize) -> impl Fn(CudaError) -> Error {
    move |e| match e {
        CudaError::Driver { call, code, name, text } => Error::Cuda(CudaError::Driver {
            call,
            code,
            name,
            text: format!("{text} (rank {rank}, the hierarchy's copies between its stages)"),
        }),
        CudaError::Timeout { call, waited } => Error::Timeout {
            rank,
            phase: call,
            peers: Vec::new(),
            waited,
            detail: " (the hierarchy's copies between its stages)".into(),
        },
        e => e.into(),
    }
}

/// Arguments of a hierarchical GPU dispatch (device memory, as [`GpuDispatchArgs`]).
#[derive(Clone, Copy, Debug)]
pub struct GpuHierDispatchArgs<'a> {
    /// bf16 or e4m3 `[num_tokens, hidden]`.
    pub x: DevSlice,
    /// f32 `[num_tokens, hidden / 128]`, fp8 only.
    pub x_scales: Option<DevSlice>,
    /// int64 `[num_tokens, num_topk]`, -1 = none.
    pub topk_idx: DevSlice,
    /// f32 `[num_tokens, num_topk]`.
    pub topk_weights: DevSlice,
    pub num_tokens: usize,
    /// Tokens per local expert are rounded up to this (>= 1).
    pub expert_alignment: usize,
    /// Fixed output rows (padding rows: zero, top-k -1, source -1); an error if more arrive.
    pub num_worst_tokens: Option<usize>,
    /// Reuse the handle's routing (both stages skip their notify; same inputs' routing).
    pub cached: bool,
    pub stream: &'a Stream,
}

/// The routing of one hierarchical GPU dispatch (both stages' device handles and the final
/// order). Made by [`GpuHierBuffer::new_handle`], filled by a fresh dispatch.
pub struct GpuHierHandle {
    buffer_id: u64,
    capacity: usize,
    rail: GpuHandle,
    node: GpuHandle,
    /// The rail stage's received rows per source node, `[nodes + 1]` prefix.
    rail_prefix: Vec<usize>,
    /// The final order as runs: (output row, node-stage row, rows).
    runs: Vec<(usize, usize, usize)>,
    rank_prefix: Vec<u64>,
    per_expert: Vec<i32>,
    /// `recv_src_idx` in output order (`n2` int32), copied to each dispatch's output.
    src: DeviceBuffer,
    n1: usize,
    n2: usize,
    rows: usize,
    filled: bool,
    /// Prepared and not yet finished.
    prepared: bool,
    /// Input tokens of the last dispatch, and its `num_worst_tokens` (a cached dispatch keeps
    /// the fresh one's output shape).
    tokens: usize,
    worst: Option<usize>,
    /// Unique among the buffer's handles (which one the scratch holds).
    serial: u64,
}

impl GpuHierHandle {
    /// Rows received (before `num_worst_tokens` padding).
    pub fn num_recv_tokens(&self) -> usize {
        self.n2
    }
    /// Rows of the dispatch outputs.
    pub fn num_out_rows(&self) -> usize {
        self.rows
    }
    /// `[R + 1]`: output rows are grouped by source rank, as the direct path's.
    pub fn rank_prefix(&self) -> &[u64] {
        &self.rank_prefix
    }
    /// Tokens per local expert (rounded up to the alignment).
    pub fn num_recv_tokens_per_expert(&self) -> &[i32] {
        &self.per_expert
    }
    /// Input tokens of the dispatch this handle describes.
    pub fn num_tokens(&self) -> usize {
        self.tokens
    }
    /// Prepared ([`GpuHierBuffer::prepare`]) and not yet finished.
    pub fn is_prepared(&self) -> bool {
        self.prepared
    }
    /// A dispatch has filled it (a cached dispatch may reuse it).
    pub fn is_filled(&self) -> bool {
        self.filled
    }
    /// Rows the rail stage received (this rank as a gateway) and forwarded inside its node.
    pub fn gateway_rows(&self) -> usize {
        self.n1
    }
}

/// The rail stage's side of the scratch: `n1` rows (what this rank receives as a gateway).
struct RailScratch {
    n1: usize,
    rail_out: GpuDispatchBuffers,
    wide_x: DeviceBuffer,
    wide_s: Option<DeviceBuffer>,
    gw_x: DeviceBuffer,
    gw_w: DeviceBuffer,
    rail_x: DeviceBuffer,
}

/// The node stage's side of the scratch: `n2` rows (what this rank receives).
struct NodeScratch {
    n2: usize,
    node_out: GpuDispatchBuffers,
    comb_x: DeviceBuffer,
    comb_w: DeviceBuffer,
    /// Pinned: the lanes read back (`n2 x 8` bytes), then `recv_src_idx` staged (`n2 x 4`).
    host: HostMapped,
}

/// Device scratch for the stages, reserved for `tokens` input tokens per rank.
struct Scratch {
    tokens: usize,
    rail: RailScratch,
    node: NodeScratch,
    /// Recorded after the last upload from `node.host`: the next write waits for it.
    uploaded: Event,
}

/// DeepEP's hierarchy over two GPU [`Buffer`]s (see the module docs).
pub struct GpuHierBuffer {
    cfg: EpConfig,
    rail: Buffer,
    node: Buffer,
    id: u64,
    sc: Option<Scratch>,
    /// The handle whose dispatch the scratch holds, prepared and not finished.
    prepared: Option<u64>,
    next_serial: u64,
    /// This rank is the only one of the job in its CUDA context (its own process): the scratch
    /// starts at the rows one destination node would send and grows to what arrives (an
    /// allocation inside a step cannot wait for a peer's kernel). Otherwise (ranks as threads)
    /// it is reserved for the worst case up front.
    lazy: bool,
}

impl std::fmt::Debug for GpuHierBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuHierBuffer").field("rank", &self.cfg.rank).finish_non_exhaustive()
    }
}

impl GpuHierBuffer {
    /// Connects both stages (collective). `opts` is a GPU buffer's (`BufferOptions::gpu`, normal
    /// mode): the rail stage reaches the other nodes through the proxy lane over
    /// `opts.gpu.proxy_provider`, the node stage its node's ranks through device pointers or
    /// CUDA IPC. Each stage takes half of the rank's `num_sms` (default: the GPU's SMs over twice
    /// the job's ranks on this GPU, at most 32, even, per stage), so both stages' kernels of every
    /// rank sharing the GPU fit at once.
    pub fn new(cfg: EpConfig, boot: Arc<dyn Bootstrap>, opts: BufferOptions) -> Result<Self> {
        if opts.backend != Backend::Gpu {
            return Err(Error::arg(
                "backend",
                "GpuHierBuffer is the GPU backend's (ep::hier::HierBuffer is the host's)",
            ));
        }
        let g = opts.gpu.clone().ok_or_else(|| {
            Error::arg("backend", "Backend::Gpu needs GPU options: use BufferOptions::gpu")
        })?;
        if !g.normal {
            return Err(Error::arg("gpu.normal", "the hierarchy is normal mode: enable it"));
        }
        if opts.intranode_provider.is_some() || opts.emulate_network_gbps.is_some() {
            return Err(Error::arg(
                "intranode_provider",
                "host backend options (intranode_provider, emulate_network_gbps) do not apply",
            ));
        }
        check_boot(&cfg, &*boot)?;
        let (rs, ns) = stage_settings(&cfg)?;
        let mut me = g.device.uuid()?.to_vec();
        me.extend_from_slice(&std::process::id().to_le_bytes());
        let all = check_world(&cfg, &*boot, "the backend", b"gpu", &me)?;
        let on_gpu = all.iter().filter(|u| u.get(..16) == me.get(..16)).count().max(1);
        let in_ctx = all.iter().filter(|u| u[..] == me[..]).count().max(1);
        let sms = g.device.sm_count() as usize;
        // `num_sms` is the rank's budget: each stage takes half of it. Every rank's two stages'
        // kernels must be resident at once (a rank may be in the node stage while its peer is
        // still in the rail stage).
        let num_sms = match g.num_sms {
            Some(n) => (n / 2) & !1,
            None => (sms / (2 * on_gpu)).min(DEFAULT_MAX_SMS) & !1,
        };
        if num_sms == 0 || 2 * num_sms * on_gpu > sms {
            return Err(Error::arg(
                "num_sms",
                format!(
                    "{} per rank: the hierarchy's two stages take {num_sms} blocks each, and {on_gpu} \
                     ranks' stages on this GPU of {sms} SMs must fit at once",
                    g.num_sms.map_or("default".to_string(), |n| n.to_string())
                ),
            ));
        }
        let stage = GpuOptions { num_sms: Some(num_sms), low_latency: false, ..g };
        let (rail_boot, node_boot) = stage_boots(&cfg, boot);
        let (rpn, local) = (cfg.ranks_per_node, cfg.rank % cfg.ranks_per_node);
        let first = cfg.rank - local;
        let rail =
            Buffer::new(EpConfig::new(rs)?, Arc::new(rail_boot), BufferOptions::gpu(stage.clone()))
                .map_err(|e| world_err(e, "rail", |n| n * rpn + local))?;
        let node = Buffer::new(EpConfig::new(ns)?, Arc::new(node_boot), BufferOptions::gpu(stage))
            .map_err(|e| world_err(e, "node", |j| first + j))?;
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let id = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(GpuHierBuffer {
            cfg,
            rail,
            node,
            id,
            sc: None,
            prepared: None,
            next_serial: 1,
            lazy: in_ctx == 1,
        })
    }

    pub fn config(&self) -> &EpConfig {
        &self.cfg
    }

    /// Each stage's SM budget (blocks per kernel).
    pub fn num_sms(&mut self) -> Result<usize> {
        Ok(self.rail.gpu()?.num_sms())
    }

    fn rail_err(&self, e: Error) -> Error {
        let (rpn, local) = (self.cfg.ranks_per_node, self.cfg.rank % self.cfg.ranks_per_node);
        world_err(e, "rail", |n| n * rpn + local)
    }

    fn node_err(&self, e: Error) -> Error {
        let first = self.cfg.rank / self.cfg.ranks_per_node * self.cfg.ranks_per_node;
        world_err(e, "node", |j| first + j)
    }

    fn elt(&self) -> usize {
        if self.cfg.dispatch_dtype == DispatchDtype::Fp8E4m3 {
            1
        } else {
            2
        }
    }

    /// A handle for dispatches of up to `capacity_tokens` tokens; reserves the stages' device
    /// scratch for that many tokens on *every* rank (a gateway receives up to `nodes x
    /// capacity_tokens` rows, a rank up to `num_ranks x capacity_tokens`: pass the job's largest
    /// tokens per rank).
    ///
    /// With ranks as threads of one CUDA context the whole worst case is reserved here and more
    /// rows fail in the stage that receives them: an allocation inside a step could wait for a
    /// peer's spinning kernel. A rank alone in its context (its own process) reserves one node's
    /// rows for the received side and grows both sides to what arrives, after each stage's
    /// notify has synchronised the stream, so its memory follows the routing, not `num_ranks`.
    /// Every rank makes its handles before the steps that use them; growing the scratch here
    /// drops a prepared, unfinished dispatch.
    pub fn new_handle(&mut self, capacity_tokens: usize) -> Result<GpuHierHandle> {
        let t = capacity_tokens.max(1);
        if self.sc.as_ref().is_none_or(|s| s.tokens < t) {
            // Never below what the scratch has grown to (a cached dispatch of an older handle
            // relies on it).
            let had = self.sc.as_ref().map_or((0, 0), |s| (s.rail.n1, s.node.n2));
            self.prepared = None;
            self.sc = None;
            self.sc = Some(self.reserve(t, had)?);
        }
        let sc = self.sc.as_ref().expect("reserved above");
        let (n1, n2) = (sc.rail.n1, sc.node.n2);
        let dev = self.rail.gpu()?.device().clone();
        let rail = self.rail.gpu()?.new_handle(t)?;
        let node = self.node.gpu()?.new_handle(n1)?;
        Ok(GpuHierHandle {
            buffer_id: self.id,
            capacity: t,
            rail,
            node,
            rail_prefix: Vec::new(),
            runs: Vec::new(),
            rank_prefix: Vec::new(),
            per_expert: Vec::new(),
            src: DeviceBuffer::new(&dev, n2 * 4)?,
            n1: 0,
            n2: 0,
            rows: 0,
            filled: false,
            prepared: false,
            tokens: 0,
            worst: None,
            serial: {
                self.next_serial += 1;
                self.next_serial
            },
        })
    }

    /// Scratch for `t` tokens per rank, at least `had` = (gateway rows, received rows).
    fn reserve(&mut self, t: usize, had: (usize, usize)) -> Result<Scratch> {
        let nodes = self.cfg.num_ranks / self.cfg.ranks_per_node;
        // At most `t` tokens from each source: the rail stage has `nodes` sources, the node stage
        // `ranks_per_node` gateways of at most `n1` rows each (the worst case, reserved unless
        // the scratch may grow later).
        let n1 = (nodes * t).max(had.0);
        let n2 = if self.lazy { n1 } else { self.cfg.ranks_per_node * nodes * t }.max(had.1);
        let dev = self.rail.gpu()?.device().clone();
        Ok(Scratch {
            tokens: t,
            rail: self.rail_scratch(n1)?,
            node: self.node_scratch(n2)?,
            uploaded: Event::new_untimed(&dev)?,
        })
    }

    fn rail_scratch(&mut self, n1: usize) -> Result<RailScratch> {
        let (h, k, e) = (self.cfg.hidden, self.cfg.num_topk, self.elt());
        let (hw, g) = (h + META_CHANNELS, h / FP8_GROUP);
        let dev = self.rail.gpu()?.device().clone();
        Ok(RailScratch {
            n1,
            rail_out: GpuDispatchBuffers::new(self.rail.gpu()?, n1)?,
            // Zeroed: the lane's unused bytes (and fp8's lane scale) stay defined.
            wide_x: DeviceBuffer::zeroed(&dev, n1 * hw * e)?,
            wide_s: if e == 1 { Some(DeviceBuffer::zeroed(&dev, n1 * (g + 1) * 4)?) } else { None },
            gw_x: DeviceBuffer::new(&dev, n1 * hw * 2)?,
            gw_w: DeviceBuffer::new(&dev, (n1 * k * 4).max(4))?,
            rail_x: DeviceBuffer::new(&dev, n1 * h * 2)?,
        })
    }

    fn node_scratch(&mut self, n2: usize) -> Result<NodeScratch> {
        let (h, k) = (self.cfg.hidden, self.cfg.num_topk);
        let hw = h + META_CHANNELS;
        let dev = self.rail.gpu()?.device().clone();
        Ok(NodeScratch {
            n2,
            node_out: GpuDispatchBuffers::new(self.node.gpu()?, n2)?,
            comb_x: DeviceBuffer::zeroed(&dev, n2 * hw * 2)?,
            comb_w: DeviceBuffer::new(&dev, (n2 * k * 4).max(4))?,
            host: HostMapped::new(&dev, (n2 * 12).max(12))?,
        })
    }

    /// Makes room for `n1` gateway rows (the rail notify's count; the stream has synchronised):
    /// grows the rail side of the scratch and the handle's node-stage capacity when the scratch
    /// may grow, else refuses what was not reserved.
    fn fit_rail(&mut self, n1: usize, handle: &mut GpuHierHandle) -> Result<()> {
        let have = self.sc.as_ref().map_or(0, |s| s.rail.n1);
        if n1 <= have && n1 <= handle.node.capacity() {
            return Ok(());
        }
        if !self.lazy {
            return Err(Error::arg(
                "handle",
                format!(
                    "this rank receives {n1} rows as a gateway, {} were reserved (new_handle's \
                     capacity x nodes): make handles for the job's largest tokens per rank",
                    have.min(handle.node.capacity())
                ),
            ));
        }
        let grow = n1 + n1 / 4;
        if n1 > have {
            let r = self.rail_scratch(grow)?;
            if let Some(sc) = self.sc.as_mut() {
                sc.rail = r;
            }
        }
        if n1 > handle.node.capacity() {
            handle.node = self.node.gpu()?.new_handle(grow)?;
        }
        Ok(())
    }

    /// Makes room for `n2` received rows (the node notify's count; the stream has synchronised),
    /// as [`Self::fit_rail`].
    fn fit_node(&mut self, n2: usize, handle: &mut GpuHierHandle) -> Result<()> {
        let own = local(self.cfg.rank);
        let have = self.sc.as_ref().map_or(0, |s| s.node.n2);
        if n2 <= have && n2 * 4 <= handle.src.len() {
            return Ok(());
        }
        if !self.lazy {
            return Err(Error::arg(
                "handle",
                format!(
                    "this rank receives {n2} rows, {} were reserved (new_handle's capacity x \
                     ranks): make handles for the job's largest tokens per rank",
                    have.min(handle.src.len() / 4)
                ),
            ));
        }
        let grow = n2 + n2 / 4;
        if n2 > have {
            if let Some(sc) = self.sc.as_ref() {
                // The pinned stage may still feed an upload (bounded like sync_gpu).
                sc.uploaded
                    .synchronize_within(self.cfg.timeout * 2 + Duration::from_secs(5))
                    .map_err(&own)?;
            }
            let ns = self.node_scratch(grow)?;
            if let Some(sc) = self.sc.as_mut() {
                sc.node = ns;
            }
        }
        if n2 * 4 > handle.src.len() {
            let dev = self.rail.gpu()?.device().clone();
            handle.src = DeviceBuffer::new(&dev, grow * 4).map_err(&own)?;
        }
        Ok(())
    }

    /// Dispatch through the rail stage, then the node stage, into `out` (the direct path's
    /// outputs and order; `out` holds at least the returned number of rows): [`Self::prepare`]
    /// then [`Self::finish`]. Returns the output rows (received, or `num_worst_tokens`).
    /// Collective.
    ///
    /// # Safety
    /// Every slice addresses device memory of this context that stays alive until the stream has
    /// finished; every rank dispatches concurrently.
    pub unsafe fn dispatch_gpu(
        &mut self,
        a: &GpuHierDispatchArgs<'_>,
        handle: &mut GpuHierHandle,
        out: &GpuDispatchOut,
    ) -> Result<usize> {
        let rows = self.prepare(a, handle)?;
        self.finish(handle, out, a.stream)?;
        Ok(rows)
    }

    /// Step 1 of a dispatch: both stages' notifies (fresh) and dispatches into the buffer's
    /// scratch, and the final order; returns the output rows, so a caller can allocate outputs
    /// of that size before [`Self::finish`] (the C ABI's two-step form). A fresh dispatch
    /// synchronises the host with the stream three times (the two notifies and the lanes), a
    /// cached one never. The scratch holds one prepared dispatch: finish it before preparing
    /// another. Collective.
    ///
    /// # Safety
    /// As [`Self::dispatch_gpu`].
    pub unsafe fn prepare(
        &mut self,
        a: &GpuHierDispatchArgs<'_>,
        handle: &mut GpuHierHandle,
    ) -> Result<usize> {
        let own = local(self.cfg.rank);
        let (h, k, e) = (self.cfg.hidden, self.cfg.num_topk, self.elt());
        let (hw, g) = (h + META_CHANNELS, h / FP8_GROUP);
        let gw = g + 1;
        let (t, s) = (a.num_tokens, a.stream);
        if handle.buffer_id != self.id {
            return Err(Error::arg("handle", "made by another GpuHierBuffer"));
        }
        if t > handle.capacity {
            return Err(Error::arg(
                "num_tokens",
                format!("{t}: the handle was made for at most {} tokens", handle.capacity),
            ));
        }
        if a.cached && !handle.filled {
            return Err(Error::arg("handle", "cached dispatch with a handle no dispatch filled"));
        }
        if a.cached && t != handle.tokens {
            return Err(Error::arg(
                "num_tokens",
                format!("{t}: a cached dispatch reuses a routing of {} tokens", handle.tokens),
            ));
        }
        if a.expert_alignment == 0 {
            return Err(Error::arg("expert_alignment", "must be at least 1"));
        }
        if !a.cached {
            handle.filled = false;
        }
        // Whatever was prepared and not finished is overwritten from here on.
        self.prepared = None;
        handle.prepared = false;
        if self.sc.is_none() {
            return Err(Error::arg("handle", "no handle was made (new_handle)"));
        }
        // Rail stage: one copy per destination node, to the gateway with this local index.
        if !a.cached {
            let n = GpuNotifyArgs {
                topk_idx: a.topk_idx,
                num_tokens: t,
                expert_alignment: 1,
                num_worst_tokens: None,
                stream: s,
            };
            let r = self.rail.gpu().and_then(|g| g.notify_gpu(&n, &mut handle.rail));
            match r.map_err(|err| self.rail_err(err))? {
                Some(info) => {
                    handle.rail_prefix =
                        info.rank_prefix.iter().map(|&v| v.max(0) as usize).collect();
                    // The notify synchronised the stream: the scratch may be replaced here.
                    self.fit_rail(info.num_recv_tokens, handle)?;
                }
                None => {
                    return Err(Error::Other("rail stage: its notify returned no counts".into()))
                }
            }
        }
        let n1 = handle.rail.num_out_rows().unwrap_or(0);
        let sc = self.sc.as_ref().expect("checked above");
        if n1 > sc.rail.n1 {
            return Err(Error::Other(format!(
                "rail stage: {n1} rows past the scratch's {}",
                sc.rail.n1
            )));
        }
        let ro = sc.rail.rail_out.out();
        let wide_x = DevSlice::of(&sc.rail.wide_x);
        let wide_s = sc.rail.wide_s.as_ref().map(DevSlice::of);
        let d = GpuDispatchArgs {
            x: a.x,
            x_scales: a.x_scales,
            topk_idx: a.topk_idx,
            topk_weights: a.topk_weights,
            stream: s,
        };
        let r = self.rail.gpu().and_then(|g| g.dispatch_gpu(&d, &handle.rail, &ro));
        r.map_err(|err| self.rail_err(err))?;
        // Widen into hidden + 128 with the lane: (source node, token index on the source).
        copy_2d_async(s, wide_x.ptr, hw * e, ro.recv_x.ptr, h * e, h * e, n1).map_err(&own)?;
        if let (Some(ws), Some(rs)) = (wide_s, ro.recv_x_scales) {
            copy_2d_async(s, ws.ptr, gw * 4, rs.ptr, g * 4, g * 4, n1).map_err(&own)?;
        }
        let lane = wide_x.ptr + (h * e) as u64;
        for (m, w) in handle.rail_prefix.windows(2).enumerate() {
            let row = (w[0] * hw * e) as u64;
            memset_2d_u32_async(s, lane + row, hw * e, m as u32, 1, w[1] - w[0]).map_err(&own)?;
        }
        copy_2d_async(s, lane + 4, hw * e, ro.recv_src_idx.ptr, 4, 4, n1).map_err(&own)?;
        // Node stage: the gateway forwards to the ranks of its node.
        let topk = DevSlice { ptr: ro.recv_topk_idx.ptr, bytes: n1 * k * 8 };
        let mut info2 = None;
        if !a.cached {
            let n = GpuNotifyArgs {
                topk_idx: topk,
                num_tokens: n1,
                expert_alignment: a.expert_alignment,
                num_worst_tokens: None,
                stream: s,
            };
            let r = self.node.gpu().and_then(|g| g.notify_gpu(&n, &mut handle.node));
            let info = r.map_err(|err| self.node_err(err))?;
            let info = info.ok_or_else(|| Error::Other("node stage: no counts".into()))?;
            // The notify synchronised the stream: the scratch may be replaced here.
            self.fit_node(info.num_recv_tokens, handle)?;
            info2 = Some(info);
        }
        let sc = self.sc.as_ref().expect("checked above");
        let no = sc.node.node_out.out();
        let n2 = handle.node.num_out_rows().unwrap_or(0);
        if n2 > sc.node.n2 || n2 * 4 > handle.src.len() {
            return Err(Error::Other(format!(
                "node stage: {n2} rows past the scratch's {}",
                sc.node.n2.min(handle.src.len() / 4)
            )));
        }
        let host = sc.node.host.as_ptr();
        let host_src = host as u64 + sc.node.n2 as u64 * 8;
        let uploaded = &sc.uploaded;
        let d = GpuDispatchArgs {
            x: wide_x,
            x_scales: wide_s,
            topk_idx: topk,
            topk_weights: ro.recv_topk_weights,
            stream: s,
        };
        let mut res = self.node.gpu().and_then(|g| g.dispatch_gpu(&d, &handle.node, &no));
        if res.is_ok() && !a.cached {
            // The lanes back to the host (pinned), once per fresh dispatch.
            let lanes = no.recv_x.ptr + (h * e) as u64;
            res = copy_2d_async(s, host as u64, 8, lanes, hw * e, 8, n2)
                .map_err(&own)
                .and_then(|_| self.node.gpu().and_then(|g| g.sync_gpu(s)));
        }
        res.map_err(|err| self.node_err(err))?;
        if let Some(info2) = info2 {
            // SAFETY: the stream has finished the copy of `n2 x 8` bytes into `host`.
            let lanes = std::slice::from_raw_parts(host as *const u8, n2 * 8);
            let meta: Vec<(u32, u32)> = lanes
                .chunks_exact(8)
                .map(|b| {
                    let w = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
                    (w(0), w(4))
                })
                .collect();
            let prefix: Vec<u64> = info2.rank_prefix.iter().map(|&v| v.max(0) as u64).collect();
            let gateway = rows_by_source(&prefix, n2);
            let (perm, rank_prefix, src_idx) = final_order(&self.cfg, &meta, &gateway)?;
            handle.runs = runs_of(&perm);
            handle.rank_prefix = rank_prefix;
            handle.per_expert = info2.num_recv_tokens_per_expert;
            handle.n1 = n1;
            handle.n2 = n2;
            // The source indices to the handle's device copy, through the pinned stage (the
            // previous upload from it has finished; bounded like sync_gpu).
            uploaded
                .synchronize_within(self.cfg.timeout * 2 + Duration::from_secs(5))
                .map_err(&own)?;
            let staged = std::slice::from_raw_parts_mut(host_src as *mut i32, n2);
            staged.copy_from_slice(&src_idx);
            copy_2d_async(s, handle.src.device_ptr(), n2 * 4, host_src, n2 * 4, n2 * 4, 1)
                .map_err(&own)?;
            uploaded.record(s).map_err(&own)?;
            handle.filled = true;
        }
        if !a.cached {
            handle.worst = a.num_worst_tokens;
            handle.tokens = t;
        }
        let rows = match a.num_worst_tokens.or(handle.worst) {
            None => n2,
            Some(w) if w >= n2 => w,
            Some(w) => {
                return Err(Error::arg(
                    "num_worst_tokens",
                    format!("rank {} receives {n2} tokens, more than {w}", self.cfg.rank),
                ))
            }
        };
        handle.rows = rows;
        handle.prepared = true;
        self.prepared = Some(handle.serial);
        Ok(rows)
    }

    /// Step 2 of a dispatch: the prepared rows into `out` in the direct path's order (one strided
    /// copy per run and tensor), padding rows for `num_worst_tokens`, on `stream`.
    ///
    /// # Safety
    /// `out` addresses device memory of this context that stays alive until the stream has
    /// finished.
    pub unsafe fn finish(
        &mut self,
        handle: &mut GpuHierHandle,
        out: &GpuDispatchOut,
        s: &Stream,
    ) -> Result<()> {
        let own = local(self.cfg.rank);
        if handle.buffer_id != self.id {
            return Err(Error::arg("handle", "made by another GpuHierBuffer"));
        }
        if !handle.prepared || self.prepared != Some(handle.serial) {
            return Err(Error::arg(
                "handle",
                "not the dispatch prepared last (prepare, then finish, one dispatch at a time)",
            ));
        }
        let Some(sc) = self.sc.as_ref() else {
            return Err(Error::arg("handle", "no handle was made (new_handle)"));
        };
        let no = sc.node.node_out.out();
        let (h, k, e) = (self.cfg.hidden, self.cfg.num_topk, self.elt());
        let (hw, g) = (h + META_CHANNELS, h / FP8_GROUP);
        let (gw, fp8) = (g + 1, e == 1);
        let (rows, n2) = (handle.rows, handle.n2);
        let need = |name: &'static str, sl: DevSlice, row: usize| -> Result<()> {
            if sl.ptr == 0 || sl.bytes < rows * row {
                return Err(Error::arg(
                    name,
                    format!("{} bytes, {rows} rows need {}", sl.bytes, rows * row),
                ));
            }
            Ok(())
        };
        need("recv_x", out.recv_x, h * e)?;
        let out_s = match (fp8, out.recv_x_scales) {
            (true, Some(sl)) => {
                need("recv_x_scales", sl, g * 4)?;
                Some(sl)
            }
            (false, None) => None,
            _ => return Err(Error::arg("recv_x_scales", "required exactly for fp8")),
        };
        need("recv_topk_idx", out.recv_topk_idx, k * 8)?;
        need("recv_topk_weights", out.recv_topk_weights, k * 4)?;
        need("recv_src_idx", out.recv_src_idx, 4)?;
        // Final order: one strided copy per run and tensor.
        for &(p, i, len) in &handle.runs {
            let (p, i) = (p as u64, i as u64);
            let (he, hwe) = ((h * e) as u64, (hw * e) as u64);
            copy_2d_async(
                s,
                out.recv_x.ptr + p * he,
                h * e,
                no.recv_x.ptr + i * hwe,
                hw * e,
                h * e,
                len,
            )
            .map_err(&own)?;
            if let (Some(os), Some(ns)) = (out_s, no.recv_x_scales) {
                let (a4, b4) = ((g * 4) as u64, (gw * 4) as u64);
                copy_2d_async(s, os.ptr + p * a4, g * 4, ns.ptr + i * b4, gw * 4, g * 4, len)
                    .map_err(&own)?;
            }
            let (k8, k4) = ((k * 8) as u64, (k * 4) as u64);
            let (ti, tw) = (no.recv_topk_idx.ptr, no.recv_topk_weights.ptr);
            copy_2d_async(
                s,
                out.recv_topk_idx.ptr + p * k8,
                len * k * 8,
                ti + i * k8,
                len * k * 8,
                len * k * 8,
                1,
            )
            .map_err(&own)?;
            copy_2d_async(
                s,
                out.recv_topk_weights.ptr + p * k4,
                len * k * 4,
                tw + i * k4,
                len * k * 4,
                len * k * 4,
                1,
            )
            .map_err(&own)?;
        }
        copy_2d_async(s, out.recv_src_idx.ptr, n2 * 4, handle.src.device_ptr(), n2 * 4, n2 * 4, 1)
            .map_err(&own)?;
        // Padding rows (num_worst_tokens): zero rows, top-k -1, weights 0, source -1.
        let pad = rows - n2;
        memset_range_async(s, out.recv_x.ptr + (n2 * h * e) as u64, 0, pad * h * e)
            .map_err(&own)?;
        if let Some(os) = out_s {
            memset_range_async(s, os.ptr + (n2 * g * 4) as u64, 0, pad * g * 4).map_err(&own)?;
        }
        memset_range_async(s, out.recv_topk_idx.ptr + (n2 * k * 8) as u64, 0xFF, pad * k * 8)
            .map_err(&own)?;
        memset_range_async(s, out.recv_topk_weights.ptr + (n2 * k * 4) as u64, 0, pad * k * 4)
            .map_err(&own)?;
        memset_range_async(s, out.recv_src_idx.ptr + (n2 * 4) as u64, 0xFF, pad * 4)
            .map_err(&own)?;
        handle.prepared = false;
        self.prepared = None;
        Ok(())
    }

    /// Combine through the node stage (to the gateways, whose partial is bf16), then the rail
    /// stage (to the sources). `a.x [rows, H]` and `a.topk_weights [rows, K]` in the dispatch's
    /// output order. Asynchronous ([`Self::sync_gpu`] reports device errors). Collective.
    ///
    /// # Safety
    /// As [`Self::dispatch_gpu`].
    pub unsafe fn combine_gpu(
        &mut self,
        a: &GpuCombineArgs<'_>,
        handle: &GpuHierHandle,
    ) -> Result<()> {
        let own = local(self.cfg.rank);
        let (h, k) = (self.cfg.hidden, self.cfg.num_topk);
        let hw = h + META_CHANNELS;
        if handle.buffer_id != self.id {
            return Err(Error::arg("handle", "made by another GpuHierBuffer"));
        }
        if !handle.filled {
            return Err(Error::arg("handle", "no dispatch filled it"));
        }
        let Some(sc) = self.sc.as_ref() else {
            return Err(Error::arg("handle", "no handle was made (new_handle)"));
        };
        let rows = handle.rows;
        if a.x.ptr == 0 || a.x.bytes < rows * h * 2 {
            return Err(Error::arg(
                "x",
                format!("{} bytes, {rows} rows of bf16 need {}", a.x.bytes, rows * h * 2),
            ));
        }
        if let Some(w) = a.topk_weights {
            if w.ptr == 0 || w.bytes < rows * k * 4 {
                return Err(Error::arg(
                    "topk_weights",
                    format!("{} bytes, {rows} rows need {}", w.bytes, rows * k * 4),
                ));
            }
        }
        let s = a.stream;
        let (cx, cw) = (sc.node.comb_x.device_ptr(), sc.node.comb_w.device_ptr());
        for &(p, i, len) in &handle.runs {
            let (p, i) = (p as u64, i as u64);
            copy_2d_async(
                s,
                cx + i * (hw * 2) as u64,
                hw * 2,
                a.x.ptr + p * (h * 2) as u64,
                h * 2,
                h * 2,
                len,
            )
            .map_err(&own)?;
            if let Some(w) = a.topk_weights {
                let k4 = (k * 4) as u64;
                copy_2d_async(
                    s,
                    cw + i * k4,
                    len * k * 4,
                    w.ptr + p * k4,
                    len * k * 4,
                    len * k * 4,
                    1,
                )
                .map_err(&own)?;
            }
        }
        let n1 = handle.n1;
        let with_w = a.topk_weights.is_some() || a.combined_topk_weights.is_some();
        let gw_w = DevSlice::of(&sc.rail.gw_w);
        let node_args = GpuCombineArgs {
            x: DevSlice::of(&sc.node.comb_x),
            topk_weights: with_w.then(|| DevSlice::of(&sc.node.comb_w)),
            combined_x: DevSlice::of(&sc.rail.gw_x),
            combined_topk_weights: with_w.then_some(gw_w),
            stream: s,
        };
        let r = self.node.gpu().and_then(|n| n.combine_gpu(&node_args, &handle.node));
        r.map_err(|err| self.node_err(err))?;
        let sc = self.sc.as_ref().expect("checked above");
        copy_2d_async(
            s,
            sc.rail.rail_x.device_ptr(),
            h * 2,
            sc.rail.gw_x.device_ptr(),
            hw * 2,
            h * 2,
            n1,
        )
        .map_err(&own)?;
        let rail_args = GpuCombineArgs {
            x: DevSlice::of(&sc.rail.rail_x),
            topk_weights: with_w.then_some(gw_w),
            combined_x: a.combined_x,
            combined_topk_weights: a.combined_topk_weights,
            stream: s,
        };
        let r = self.rail.gpu().and_then(|rl| rl.combine_gpu(&rail_args, &handle.rail));
        r.map_err(|err| self.rail_err(err))
    }

    /// Waits (bounded) for `stream` and reports either stage's device errors, in job ranks.
    pub fn sync_gpu(&mut self, stream: &Stream) -> Result<()> {
        let r = self.rail.gpu().and_then(|g| g.sync_gpu(stream));
        r.map_err(|e| self.rail_err(e))?;
        let n = self.node.gpu().and_then(|g| g.sync_gpu(stream));
        n.map_err(|e| self.node_err(e))
    }

    /// Tears both stages down (collective).
    pub fn destroy(mut self) -> Result<()> {
        self.sc = None;
        let r = self.rail.destroy();
        let n = self.node.destroy();
        r.and(n)
    }
}

/// The runs of a permutation: maximal (output row, source row, length) with consecutive rows on
/// both sides.
fn runs_of(perm: &[u32]) -> Vec<(usize, usize, usize)> {
    let mut runs: Vec<(usize, usize, usize)> = Vec::new();
    for (p, &i) in perm.iter().enumerate() {
        let i = i as usize;
        match runs.last_mut() {
            Some((p0, i0, len)) if *p0 + *len == p && *i0 + *len == i => *len += 1,
            _ => runs.push((p, i, 1)),
        }
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::{local, runs_of};
    use crate::cuda::CudaError;
    use crate::Error;
    use std::time::Duration;

    #[test]
    fn own_cuda_errors_name_the_job_rank() {
        let driver = CudaError::Driver {
            call: "cuMemcpy2DAsync",
            code: 1,
            name: "CUDA_ERROR_INVALID_VALUE".into(),
            text: "invalid argument".into(),
        };
        let e = local(5)(driver);
        assert!(matches!(e, Error::Cuda(CudaError::Driver { code: 1, .. })), "{e:?}");
        assert!(e.to_string().contains("(rank 5, the hierarchy's copies"), "{e}");
        let waited = Duration::from_secs(3);
        let e = local(6)(CudaError::Timeout { call: "cuEventQuery", waited });
        assert!(
            matches!(&e, Error::Timeout { rank: 6, phase: "cuEventQuery", peers, waited: w, .. }
                if peers.is_empty() && *w == waited),
            "{e:?}"
        );
        let e = local(7)(CudaError::NoGpu("none".into()));
        assert!(matches!(e, Error::Cuda(CudaError::NoGpu(_))), "{e:?}");
    }

    #[test]
    fn runs_cover_the_permutation() {
        assert_eq!(runs_of(&[]), vec![]);
        assert_eq!(runs_of(&[0, 1, 2]), vec![(0, 0, 3)]);
        // Two gateways' blocks of two source nodes each, swapped into source-rank order.
        assert_eq!(runs_of(&[0, 1, 4, 2, 3, 5]), vec![(0, 0, 2), (2, 4, 1), (3, 2, 2), (5, 5, 1)]);
    }
}
