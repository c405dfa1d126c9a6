//! The GPU backend of [`Buffer`](super::buffer::Buffer): normal and low-latency dispatch/combine
//! with CUDA kernels ([`super::normal_gpu`], [`super::ll_gpu`]) for the ranks of one machine:
//! threads of one process, processes sharing one GPU (under MPS), or processes on several GPUs
//! that can access each other.
//!
//! One file: what is left here is `GpuBuffer` and the argument types of its calls (its API);
//! connection (ipc.rs) and the proxy lanes (ll_proxy.rs, normal_proxy.rs) are submodules already.
//!
//! ```no_run
//! # use std::sync::Arc;
//! # use fabric_ep::cuda::{Device, DeviceBuffer, Stream};
//! # use fabric_ep::ep::buffer::{Buffer, BufferOptions};
//! # use fabric_ep::protocol::config::{EpConfig, EpSettings};
//! # use fabric_ep::ep::gpu::*;
//! # fn f(boot: Arc<dyn fabric_ep::bootstrap::Bootstrap>, dev: Device, x: &DeviceBuffer,
//! #      idx: &DeviceBuffer, w: &DeviceBuffer, t: usize) -> fabric_ep::Result<()> {
//! let cfg = EpConfig::new(EpSettings::new(boot.rank(), boot.world_size(), 64, 4096, 8))?;
//! let mut buf = Buffer::new(cfg, boot, BufferOptions::gpu(GpuOptions::new(dev.clone())))?;
//! let stream = Stream::new(&dev)?;
//! let gpu = buf.gpu()?;
//! let mut handle = gpu.new_handle(t)?;
//! // Step 1: notify; one host synchronisation tells the receive count.
//! let notify = GpuNotifyArgs::new(DevSlice::of(idx), t, &stream);
//! let info = unsafe { gpu.notify_gpu(&notify, &mut handle)? }.expect("no num_worst_tokens");
//! // Step 2: allocate outputs for exactly that many rows, then dispatch.
//! let out = GpuDispatchBuffers::new(gpu, info.num_recv_tokens)?;
//! let args = GpuDispatchArgs {
//!     x: DevSlice::of(x), x_scales: None, topk_idx: DevSlice::of(idx),
//!     topk_weights: DevSlice::of(w), stream: &stream,
//! };
//! unsafe { gpu.dispatch_gpu(&args, &handle, &out.out())? };
//! gpu.sync_gpu(&stream)?;
//! # Ok(()) }
//! ```
//!
//! Connection (`ipc.rs`): every rank sends its identity (process, machine, context, GPU UUID),
//! allocates its comm buffers and sends their device pointers through the bootstrap. A peer in
//! the same process and context is addressed through its pointers as they are; one in the same
//! process on another GPU through the same pointers with peer access enabled; one in another
//! process of this machine through CUDA IPC (`cuIpcGetMemHandle` of each allocation a peer
//! writes or reads: the normal comm buffer, the low-latency buffer and flags;
//! `cuIpcOpenMemHandle` with lazy peer access on the other side, which owns the mappings). On
//! another GPU the two must be able to access each other (`cuDeviceCanAccessPeer`); a peer that
//! cannot be reached (another machine, no peer access) is an error naming it at connect time.
//! [`GpuBuffer::peer_paths`] says which path each peer got.
//! Ranks on other nodes (`ranks_per_node < num_ranks`) are reached through proxy lanes
//! instead, wherever they run: libfabric RMA writes posted by a CPU proxy, one lane per mode
//! ([`normal_proxy`], `GpuOptions::proxy_provider`; [`ll_proxy`], `GpuOptions::ll_provider`).
//!
//! NOTES (co-residency): receive kernels spin on other ranks' sends, so every rank's running
//! kernel must be resident at once. Each rank launches at most `num_sms` blocks (default:
//! SMs / ranks on this GPU, even) and `num_sms * ranks on this GPU <= SMs` is checked at
//! connect time (ranks on the same GPU are counted from the exchanged UUIDs). Processes sharing
//! one GPU run their kernels at the same time only under MPS: start the control daemon
//! (`nvidia-cuda-mps-control -d`) before the ranks. Without it the GPU time-slices between the
//! processes' contexts: every wait on another process lasts until the GPU switches to it
//! (milliseconds per step; measured on an H200 with 2 processes: 18 ms per normal dispatch of
//! 512 tokens, 4.5 ms per low-latency dispatch), and a wait longer than the config's timeout
//! fails with [`Error::Timeout`] naming a peer (never a hang). Conversely, ranks as threads of
//! one process need `CUDA_DEVICE_MAX_CONNECTIONS` raised (32 works; 8 by default, fewer for an
//! MPS client): the ranks' streams otherwise share hardware queues and queue their spinning
//! kernels behind each other until the timeout. `connect` refuses too few (`check_work_queues`).
//!
//! NOTES (lifetime): a rank's comm buffers are written by its peers' kernels. Tear down with
//! [`Buffer::destroy`](super::buffer::Buffer::destroy) (collective: it waits for every rank)
//! after every stream that ran this buffer's kernels has synchronised; it then closes the IPC
//! mappings and waits again before any rank frees its buffers. Dropping a `Buffer` without
//! `destroy` (a failed rank) skips those waits.

pub mod normal_proxy;

pub mod ll_proxy;

use std::mem::ManuallyDrop;
use std::sync::Arc;
use std::time::Duration;

mod ipc;
pub use ipc::PeerPath;

use super::layout_gpu::{DispatchLayoutGpu, LayoutBuffers, LayoutTuning};
use super::ll_gpu::{self, LlDispatchOut, LlGpuConfig, LlGpuRank, LlTicket};
use super::normal_gpu::{
    CombineArgs, DispatchInputs, DispatchOutputs, NormalGpuRank, NormalGpuSettings, NormalHandle,
    RecvInfo,
};
use crate::abi;
use crate::bootstrap::Bootstrap;
use crate::cuda::{CudaError, Device, DeviceBuffer, Stream};
use crate::protocol::config::{DispatchDtype, EpConfig};
use crate::{Error, Result};

/// GPU options of a [`Buffer`](super::buffer::Buffer) (`BufferOptions::gpu`).
#[derive(Clone, Debug)]
pub struct GpuOptions {
    /// This rank's GPU.
    pub device: Device,
    /// Blocks per kernel of this rank (its SM budget); `None`: SMs / ranks on this GPU rounded
    /// down to even, at most [`DEFAULT_MAX_SMS`] when normal mode is enabled. The ranks on one
    /// GPU share it, so `num_sms *` ranks on this GPU must not exceed its SMs.
    pub num_sms: Option<usize>,
    /// Normal mode: records per queue chunk (same on every rank).
    pub chunk_tokens: usize,
    /// Normal mode: chunks in flight per (sender, receiver) pair (same on every rank); `None`:
    /// [`default_slots_per_peer`] for the job's number of ranks.
    pub slots_per_peer: Option<usize>,
    /// Allocate the normal-mode comm buffer.
    pub normal: bool,
    /// Allocate the low-latency buffers (two sets, sized from `max_tokens_per_rank`; dispatch
    /// dtype = the config's `dispatch_dtype`).
    pub low_latency: bool,
    /// Normal mode with `ranks_per_node < num_ranks`: the libfabric provider of the proxy lane
    /// to the other nodes ([`normal_proxy`]; `efa` on EFA, `shm` / `tcp;ofi_rxm` on one box).
    pub proxy_provider: String,
    /// Low-latency mode, peers on other nodes (`ranks_per_node < num_ranks`): the libfabric
    /// provider of the proxy path ([`ll_proxy`]); `None`: `FI_PROVIDER` or libfabric's first.
    pub ll_provider: Option<String>,
    /// Low-latency mode: DeepEP's `enable_shrink` ([`LlGpuRank::enable_shrink`]): masked ranks
    /// are skipped, a rank whose data does not come within the timeout is masked instead of
    /// failing the call. Every peer must be on this node (refused with a proxy lane).
    pub shrink: bool,
}

impl GpuOptions {
    /// Both modes, default SM budget, 16-token chunks, slots per peer by the number of ranks
    /// ([`default_slots_per_peer`]).
    pub fn new(device: Device) -> Self {
        GpuOptions {
            device,
            num_sms: None,
            chunk_tokens: 16,
            slots_per_peer: None,
            normal: true,
            low_latency: true,
            proxy_provider: "shm".to_string(),
            ll_provider: None,
            shrink: false,
        }
    }
}

/// A range of device memory: pointer and its size in bytes (a tensor's `data_ptr()` and
/// `numel() * element_size()`). Every call checks the size against what it will touch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DevSlice {
    pub ptr: u64,
    pub bytes: usize,
}

impl DevSlice {
    /// All of `b`.
    pub fn of(b: &DeviceBuffer) -> Self {
        DevSlice { ptr: b.device_ptr(), bytes: b.len() }
    }
}

/// Normal-mode dispatch handle on the device: the send plan and receive counts a notify made,
/// reused by a cached dispatch and by combine. Made by [`GpuBuffer::new_handle`].
pub struct GpuHandle {
    inner: NormalHandle,
    buffer_id: u64,
    capacity: usize,
    out_rows: Option<usize>,
    info: Option<RecvInfo>,
}

impl GpuHandle {
    /// Rows of the dispatch outputs (received tokens, or `num_worst_tokens`); `None` before a
    /// notify.
    pub fn num_out_rows(&self) -> Option<usize> {
        self.out_rows
    }
    /// The receive counts read back after the notify (`None` in `num_worst_tokens` mode).
    pub fn recv_info(&self) -> Option<&RecvInfo> {
        self.info.as_ref()
    }
    /// The device buffers (send plan, `rank_prefix [R + 1]`, `recv_expert_counts [L]`).
    pub fn device(&self) -> &NormalHandle {
        &self.inner
    }
    /// Input tokens of the dispatch this handle describes.
    pub fn num_tokens(&self) -> usize {
        self.inner.num_tokens()
    }
    /// The most input tokens a notify with this handle takes.
    pub fn capacity(&self) -> usize {
        self.capacity
    }
}

/// Notify (step 1 of a fresh dispatch).
#[derive(Clone, Copy, Debug)]
pub struct GpuNotifyArgs<'a> {
    /// int64 `[num_tokens, num_topk]` global expert ids, -1 = none.
    pub topk_idx: DevSlice,
    pub num_tokens: usize,
    /// Tokens per local expert are rounded up to this (>= 1).
    pub expert_alignment: usize,
    /// Fixed output rows, no host synchronisation; more arrivals are a device error.
    pub num_worst_tokens: Option<usize>,
    pub stream: &'a Stream,
}

impl<'a> GpuNotifyArgs<'a> {
    /// Alignment 1, no `num_worst_tokens`.
    pub fn new(topk_idx: DevSlice, num_tokens: usize, stream: &'a Stream) -> Self {
        GpuNotifyArgs { topk_idx, num_tokens, expert_alignment: 1, num_worst_tokens: None, stream }
    }
}

/// Dispatch inputs (device memory).
#[derive(Clone, Copy, Debug)]
pub struct GpuDispatchArgs<'a> {
    /// bf16 or e4m3 `[num_tokens, hidden]` (the config's `dispatch_dtype`).
    pub x: DevSlice,
    /// f32 `[num_tokens, hidden / 128]`, fp8 only.
    pub x_scales: Option<DevSlice>,
    /// int64 `[num_tokens, num_topk]`.
    pub topk_idx: DevSlice,
    /// f32 `[num_tokens, num_topk]`.
    pub topk_weights: DevSlice,
    pub stream: &'a Stream,
}

/// Dispatch outputs (device memory), `handle.num_out_rows()` rows each.
#[derive(Clone, Copy, Debug)]
pub struct GpuDispatchOut {
    /// `[rows, hidden]` bf16 or e4m3, grouped by source rank.
    pub recv_x: DevSlice,
    /// f32 `[rows, hidden / 128]`, fp8 only.
    pub recv_x_scales: Option<DevSlice>,
    /// int64 `[rows, num_topk]` local expert ids, -1 where not local.
    pub recv_topk_idx: DevSlice,
    /// f32 `[rows, num_topk]`.
    pub recv_topk_weights: DevSlice,
    /// int32 `[rows]` token index on the source rank (-1 on padding rows).
    pub recv_src_idx: DevSlice,
}

/// Dispatch outputs allocated by the buffer.
pub struct GpuDispatchBuffers {
    pub rows: usize,
    pub recv_x: DeviceBuffer,
    pub recv_x_scales: Option<DeviceBuffer>,
    pub recv_topk_idx: DeviceBuffer,
    pub recv_topk_weights: DeviceBuffer,
    pub recv_src_idx: DeviceBuffer,
}

impl GpuDispatchBuffers {
    /// Outputs of `rows` rows for `gpu`'s config (at least one row, so pointers are valid).
    pub fn new(gpu: &GpuBuffer, rows: usize) -> Result<Self> {
        Self::for_config(&gpu.dev, &gpu.cfg, rows)
    }

    /// Outputs of `rows` rows for config `c` on `dev` (a buffer built over `c`'s settings, e.g.
    /// `ep::hier_gpu::GpuHierBuffer`, whose stages have other shapes).
    pub fn for_config(dev: &Device, c: &EpConfig, rows: usize) -> Result<Self> {
        let n = rows.max(1);
        let fp8 = c.dispatch_dtype == DispatchDtype::Fp8E4m3;
        let payload = if fp8 { c.hidden } else { 2 * c.hidden };
        Ok(GpuDispatchBuffers {
            rows,
            recv_x: DeviceBuffer::new(dev, n * payload)?,
            recv_x_scales: if fp8 {
                Some(DeviceBuffer::new(dev, n * (c.hidden / 128) * 4)?)
            } else {
                None
            },
            recv_topk_idx: DeviceBuffer::new(dev, n * c.num_topk * 8)?,
            recv_topk_weights: DeviceBuffer::new(dev, n * c.num_topk * 4)?,
            recv_src_idx: DeviceBuffer::new(dev, n * 4)?,
        })
    }

    pub fn out(&self) -> GpuDispatchOut {
        GpuDispatchOut {
            recv_x: DevSlice::of(&self.recv_x),
            recv_x_scales: self.recv_x_scales.as_ref().map(DevSlice::of),
            recv_topk_idx: DevSlice::of(&self.recv_topk_idx),
            recv_topk_weights: DevSlice::of(&self.recv_topk_weights),
            recv_src_idx: DevSlice::of(&self.recv_src_idx),
        }
    }
}

/// Normal combine (device memory).
#[derive(Clone, Copy, Debug)]
pub struct GpuCombineArgs<'a> {
    /// bf16 `[rows, hidden]`, rows as the dispatch delivered them.
    pub x: DevSlice,
    /// f32 `[rows, num_topk]`, summed back like `x`.
    pub topk_weights: Option<DevSlice>,
    /// bf16 `[num_tokens, hidden]` out: per token the fp32 sum over the ranks it went to.
    pub combined_x: DevSlice,
    /// f32 `[num_tokens, num_topk]` out.
    pub combined_topk_weights: Option<DevSlice>,
    pub stream: &'a Stream,
}

/// Low-latency dispatch (device memory).
#[derive(Clone, Copy, Debug)]
pub struct GpuLlDispatchArgs<'a> {
    /// bf16 `[num_tokens, hidden]`, `num_tokens <= max_tokens_per_rank`.
    pub x: DevSlice,
    /// int64 `[num_tokens, num_topk]` global expert ids, -1 = none.
    pub topk_idx: DevSlice,
    pub num_tokens: usize,
    /// Must match the config's `dispatch_dtype` (the buffers are sized for it).
    pub use_fp8: bool,
    /// Return after the send; the receive runs when the hook is called.
    pub return_recv_hook: bool,
    pub stream: &'a Stream,
}

/// Low-latency combine (device memory).
#[derive(Clone, Copy)]
pub struct GpuLlCombineArgs<'a> {
    /// bf16 `[L, R * max_tokens_per_rank, hidden]` expert outputs, rows as dispatched.
    pub x: DevSlice,
    /// int64 / f32 `[num_tokens, num_topk]`, as given to the dispatch.
    pub topk_idx: DevSlice,
    pub topk_weights: DevSlice,
    pub num_tokens: usize,
    /// The dispatch's outputs (its `layout_range` and `pos` are the handle).
    pub handle: &'a LlDispatchOut,
    /// bf16 `[num_tokens, hidden]` out.
    pub out: DevSlice,
    pub return_recv_hook: bool,
    pub stream: &'a Stream,
}

/// A low-latency dispatch whose receive has not run: pass it to
/// [`GpuBuffer::low_latency_dispatch_recv_gpu`].
#[must_use = "the receive runs only when the hook is completed"]
#[derive(Debug)]
pub struct LlDispatchHook {
    ticket: LlTicket,
    buffer_id: u64,
}

/// A low-latency combine whose receive has not run: pass it to
/// [`GpuBuffer::low_latency_combine_recv_gpu`] with the same arguments.
#[must_use = "the receive runs only when the hook is completed"]
#[derive(Debug)]
pub struct LlCombineHook {
    ticket: LlTicket,
    buffer_id: u64,
}

struct NormalPart {
    rank: NormalGpuRank,
    /// The rank's comm buffer (the same allocation `rank` holds), for [`GpuBuffer::local_region`].
    comm: Arc<DeviceBuffer>,
    layout_gpu: DispatchLayoutGpu,
    layout: LayoutBuffers,
    layout_cap: usize,
}

struct LlPart {
    // NOTES: field order is drop order: the proxy lane (which registered the rank's buffer)
    // goes before the rank that owns the memory.
    lane: Option<ll_proxy::LlProxyLane>,
    rank: LlGpuRank,
}

/// One rank's GPU engine (owned by a `Buffer` with `Backend::Gpu`; reach it with
/// `Buffer::gpu`).
pub struct GpuBuffer {
    cfg: EpConfig,
    id: u64,
    dev: Device,
    num_sms: usize,
    // NOTES: field order is drop order; both parts only free memory.
    normal: Option<NormalPart>,
    ll: Option<LlPart>,
    poisoned: Option<String>,
    /// IPC mappings of peers' buffers (peers in other processes).
    maps: ipc::PeerMaps,
    /// Some rank pair of the job is in different processes (the same on every rank).
    ipc_world: bool,
    paths: Vec<PeerPath>,
    /// Ranks known dead (the bootstrap's), asked while [`Self::sync_gpu`] waits.
    peer_watch: crate::proxy::PeerWatch,
    /// [`Self::set_ll_wait_stats`]: the next low-latency call's wait-cost tensor (0: none).
    ll_wait_stats: u64,
}

impl std::fmt::Debug for GpuBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuBuffer")
            .field("rank", &self.cfg.rank)
            .field("num_sms", &self.num_sms)
            .finish()
    }
}

/// Default cap of the per-rank SM budget: the normal kernels were measured and tested at 32
/// blocks per rank (kernels/NOTES.md); `GpuOptions::num_sms` overrides it.
pub const DEFAULT_MAX_SMS: usize = 32;

/// Connection blob: hash, pid, context, chunk, slots, flags, normal buffer, LL peer entry; then
/// the IPC export section (ipc.rs) when a peer is in another process.
const BLOB_BYTES: usize = 8 * 7 + std::mem::size_of::<abi::fep_ll_peer>();

fn read_u64(b: &[u8], i: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(i * 8..i * 8 + 8)?.try_into().ok()?))
}

/// Name of a normal or low-latency device phase.
pub fn phase_name(phase: u32) -> &'static str {
    match phase {
        abi::FEP_NORMAL_PHASE_NOTIFY => "normal notify",
        abi::FEP_NORMAL_PHASE_DISPATCH_SEND => "normal dispatch send",
        abi::FEP_NORMAL_PHASE_DISPATCH_RECV => "normal dispatch receive",
        abi::FEP_NORMAL_PHASE_COMBINE_SEND => "normal combine send",
        abi::FEP_NORMAL_PHASE_COMBINE_RECV => "normal combine receive",
        p => ll_gpu::phase_name(p),
    }
}

/// Streams per rank that may carry its kernels or the events they wait on: the caller's, the
/// normal and low-latency rank streams, and the C ABI's comm stream.
const STREAMS_PER_RANK: usize = 4;
/// The most hardware work queues a CUDA context gets (`CUDA_DEVICE_MAX_CONNECTIONS`'s range).
const MAX_WORK_QUEUES: usize = 32;
/// What a context gets when `CUDA_DEVICE_MAX_CONNECTIONS` is unset.
const DEFAULT_WORK_QUEUES: usize = 8;
/// What an MPS client is assumed to get when it is unset: fewer (the server's clients share one
/// pool); on the H200, 2 ranks as threads of one MPS client timed out with the default.
const DEFAULT_WORK_QUEUES_MPS: usize = 2;

/// Refuses `in_ctx` ranks as threads of one CUDA context when the context's hardware work queues
/// (`max_connections`, the variable's value; `under_mps`: the process looks like an MPS client)
/// are too few for their streams.
///
/// NOTES: a context maps its streams onto `CUDA_DEVICE_MAX_CONNECTIONS` hardware queues (8 by
/// default, fewer per client under MPS). When two ranks' streams share a queue, one rank's
/// spinning receive kernel can sit in front of the very launch it waits for: a deadlock until the
/// timeout (seen on the H200: 4 ranks as threads through the C ABI, ranks 1 and 3 timing out on 0
/// and 2). Ranks in their own processes (the real deployment) are not affected. The variable is
/// read when the context is created, so it must be set before CUDA starts (before torch
/// initialises CUDA, for Python callers).
fn check_work_queues(in_ctx: usize, max_connections: Option<&str>, under_mps: bool) -> Result<()> {
    if in_ctx <= 1 {
        return Ok(());
    }
    let have = match max_connections {
        None if under_mps => DEFAULT_WORK_QUEUES_MPS,
        None => DEFAULT_WORK_QUEUES,
        Some(v) => v.trim().parse::<usize>().map_err(|_| {
            Error::arg("CUDA_DEVICE_MAX_CONNECTIONS", format!("{v:?} is not a number"))
        })?,
    };
    let need = (in_ctx * STREAMS_PER_RANK).min(MAX_WORK_QUEUES);
    if have < need {
        return Err(Error::arg(
            "CUDA_DEVICE_MAX_CONNECTIONS",
            format!(
                "{have} hardware work queues for {in_ctx} ranks as threads of one CUDA context: \
                 their spinning kernels can queue behind each other until the timeout; set \
                 CUDA_DEVICE_MAX_CONNECTIONS={need} (or 32) in the environment before CUDA starts, \
                 or run one process per rank"
            ),
        ));
    }
    Ok(())
}

/// Refuses processes sharing one GPU without an MPS server (`under_mps`: its pipe directory is
/// known): their kernels would time-slice, and every wait on another process would last until
/// the GPU switches contexts, so steps fail with timeouts instead of running. `allow`
/// (`FEP_ALLOW_NO_MPS`) lets a caller whose MPS server lives elsewhere proceed.
fn check_mps(rank: usize, peer: usize, under_mps: bool, allow: bool) -> Result<()> {
    if under_mps || allow {
        return Ok(());
    }
    Err(Error::arg(
        "MPS",
        format!(
            "rank {rank} shares its GPU with rank {peer}, a process of its own, and no MPS server \
             was found (neither CUDA_MPS_PIPE_DIRECTORY nor /tmp/nvidia-mps/control): without \
             MPS the processes' kernels time-slice and cannot wait for each other; start \
             `nvidia-cuda-mps-control -d` before the ranks (or set FEP_ALLOW_NO_MPS=1 if the \
             server's pipe directory is elsewhere)"
        ),
    ))
}

/// Normal mode's default chunks in flight per (sender, receiver) pair: 32 up to 8 ranks, 16
/// beyond.
///
/// NOTES: measured on the H200 (ep-bench normal, 4096 tokens, hidden 7168, top-8 of 256, fp8,
/// 16-token chunks; `ep-bench --gpu-chunk 16 --gpu-slots S`): two GPUs over NVLink, one process
/// each, combine 512.1 us with 16 slots and 349.4 us with 32 (NCCL all-to-all + permute: 310.7),
/// 357.1 with 64; 4 ranks as threads on one GPU 748.6 / 722.1 us. A combine chunk goes to its
/// peer and comes back as a credit: across NVLink 16 chunks in flight left the links idle. The
/// comm buffer holds `num_ranks x slots x chunk` records (8 ranks x 32 x 16 x 14.4 KB = 59 MB),
/// so beyond one node's 8 ranks the default stays 16 (256 ranks: 0.94 GB).
pub fn default_slots_per_peer(num_ranks: usize) -> usize {
    if num_ranks <= 8 {
        32
    } else {
        16
    }
}

impl GpuBuffer {
    /// Allocates this rank's buffers, exchanges their device pointers (and IPC handles for peers
    /// in other processes) through `boot`, checks that every rank has the same config and can be
    /// reached, and maps peers' buffers. Collective. `id` is the owning `Buffer`'s id (handles
    /// carry it).
    pub(crate) fn connect(
        cfg: EpConfig,
        boot: &Arc<dyn Bootstrap>,
        opts: &GpuOptions,
        id: u64,
    ) -> Result<Self> {
        let dev = opts.device.clone();
        dev.bind()?;
        // NOTES: load the kernels now, before any collective: a rank's first launch would load
        // them otherwise, and loading a module into a context whose other streams run a peer's
        // spinning kernels (ranks as threads, each with its own `Device`, as the C ABI makes
        // them) can wait for those kernels: the first step could stall until the timeout.
        dev.load_module()?;
        let (rank, r) = (cfg.rank, cfg.num_ranks);
        crate::log::set_rank(rank);
        let slots_per_peer = opts.slots_per_peer.unwrap_or_else(|| default_slots_per_peer(r));
        // How each peer is reached (pointers, peer access, CUDA IPC): see ipc.rs.
        let remote = |peer: usize| cfg.node_of(peer) != cfg.node_of(rank);
        let peers = ipc::Peers::exchange(&**boot, &dev, rank, &remote)?;
        let on_gpu = peers.ranks_on_this_gpu();
        let in_ctx = 1 + peers.paths().iter().filter(|p| **p == ipc::PeerPath::Direct).count();
        let under_mps = std::env::var_os("CUDA_MPS_PIPE_DIRECTORY").is_some()
            || std::path::Path::new("/tmp/nvidia-mps/control").exists();
        check_work_queues(
            in_ctx,
            std::env::var("CUDA_DEVICE_MAX_CONNECTIONS").ok().as_deref(),
            under_mps,
        )?;
        if let Some(peer) =
            peers.paths().iter().position(|p| *p == ipc::PeerPath::Ipc { same_gpu: true })
        {
            let allow = std::env::var_os("FEP_ALLOW_NO_MPS").is_some();
            check_mps(rank, peer, under_mps, allow)?;
            if under_mps {
                crate::fep_info!("MPS: rank {rank} shares its GPU with rank {peer}; MPS found");
            } else {
                crate::fep_warn!(
                    "MPS: rank {rank} shares its GPU with rank {peer}, another process, and no \
                     MPS server was found; going on because FEP_ALLOW_NO_MPS is set"
                );
            }
        }
        let sms = dev.sm_count() as usize;
        // The cap is normal mode's (its kernels were tuned at 32 blocks); low latency alone
        // takes its whole share of the GPU (more blocks, more rows in flight).
        let cap = if opts.normal { DEFAULT_MAX_SMS } else { sms };
        let num_sms = opts.num_sms.unwrap_or((sms / on_gpu.max(1)).min(cap) & !1);
        if num_sms == 0
            || num_sms * on_gpu > sms
            || (opts.normal && (num_sms < 2 * r || num_sms % 2 != 0))
        {
            return Err(Error::arg(
                "num_sms",
                format!(
                    "{num_sms} blocks x {on_gpu} ranks on one GPU of {sms} SMs ({r} ranks in \
                     all): every rank's kernels must be resident at once (normal mode also \
                     needs an even budget >= 2 x ranks)"
                ),
            ));
        }
        let timeout = cfg.timeout;
        crate::fep_info!(
            "GPU buffer: rank {rank} of {r} ({} per node), GPU {} ({}), {num_sms} SMs, {on_gpu} \
             rank(s) on it, normal {} low latency {}, {slots_per_peer} slots per peer, timeout \
             {timeout:?}",
            cfg.ranks_per_node,
            dev.name(),
            dev.pci_bus_id().unwrap_or_else(|_| "?".into()),
            opts.normal,
            opts.low_latency
        );
        let normal = if opts.normal {
            let settings = NormalGpuSettings {
                chunk_tokens: opts.chunk_tokens,
                slots_per_peer,
                num_sms,
                timeout,
                ..NormalGpuSettings::new(
                    r,
                    cfg.num_experts,
                    cfg.hidden,
                    cfg.num_topk,
                    cfg.dispatch_dtype,
                )
            };
            let map = super::normal_gpu::CommMap::new(&settings)?;
            let buf = Arc::new(DeviceBuffer::zeroed(&dev, map.total_bytes as usize)?);
            Some((settings, buf))
        } else {
            None
        };
        let ll = if opts.low_latency {
            let lcfg = LlGpuConfig {
                num_ranks: r,
                num_experts: cfg.num_experts,
                hidden: cfg.hidden,
                num_topk: cfg.num_topk,
                max_tokens_per_rank: cfg.max_tokens_per_rank,
                use_fp8: cfg.dispatch_dtype == DispatchDtype::Fp8E4m3,
                round_scale: false,
                sm_budget: Some(num_sms as u32),
                timeout,
            };
            // Peers on other nodes: the proxy lane decides where the LL buffer lives.
            let prep = if cfg.num_nodes() > 1 {
                let p = opts.ll_provider.as_deref();
                let who = (rank, rank % cfg.ranks_per_node);
                Some(ll_proxy::LlProxyPrep::open(&dev, p, who, r, lcfg.layout()?)?)
            } else {
                None
            };
            if opts.shrink && prep.is_some() {
                return Err(Error::arg(
                    "enable_shrink",
                    format!(
                        "the GPU backend's shrink mode needs every rank on one node ({} ranks \
                         per node of {r}): its peers on other nodes go through the proxy lane, \
                         which does not skip masked ranks (the host backend's shrink mode does)",
                        cfg.ranks_per_node
                    ),
                ));
            }
            let mem = prep.as_ref().map(|p| p.mem());
            let mut l = LlGpuRank::new_unconnected_in(&dev, lcfg, rank, num_sms as u32, mem)?;
            if opts.shrink {
                l.enable_shrink()?;
            }
            Some((l, prep))
        } else {
            None
        };
        // NOTES: the zeroing memsets landed before any peer can learn the pointers:
        // DeviceBuffer's fills wait for themselves (Device::blocking).
        let pid = std::process::id() as u64;
        let ctx = dev.as_raw() as u64;
        let mut blob = Vec::with_capacity(BLOB_BYTES);
        for v in [
            cfg.hash(),
            pid,
            ctx,
            opts.chunk_tokens as u64,
            slots_per_peer as u64,
            opts.normal as u64 | (opts.low_latency as u64) << 1,
            normal.as_ref().map_or(0, |(_, b)| b.device_ptr()),
        ] {
            blob.extend_from_slice(&v.to_le_bytes());
        }
        let entry = ll.as_ref().map(|(l, _)| l.peer_entry()).unwrap_or_default();
        blob.extend_from_slice(bytemuck::bytes_of(&entry));
        // NOTES: a low-latency buffer in host memory (a proxy lane whose provider cannot
        // register GPU memory) cannot be shared with this node's other processes through CUDA
        // IPC (cuIpcGetMemHandle refuses host memory): refused here, naming the cause, on every
        // rank that has such a peer (the same provider everywhere; IPC peers come in pairs).
        let ll_host = ll.as_ref().is_some_and(|(_, p)| {
            p.as_ref().is_some_and(|p| matches!(p.mem(), ll_gpu::LlMem::Host(_)))
        });
        if let Some(peer) =
            peers.paths().iter().position(|p| matches!(p, ipc::PeerPath::Ipc { .. }))
        {
            if ll_host {
                return Err(Error::arg(
                    "provider",
                    format!(
                        "low latency across nodes over {:?}, which cannot register GPU memory \
                         (no FI_HMEM): its buffer is host memory, which CUDA IPC cannot share \
                         with rank {peer}, another process of rank {rank}'s node; use a \
                         provider with FI_HMEM (efa), one process per node, or ranks as threads",
                        opts.ll_provider.as_deref().unwrap_or("FI_PROVIDER")
                    ),
                ));
            }
        }
        let exported = [normal.as_ref().map_or(0, |(_, b)| b.device_ptr()), entry.buf, entry.flags];
        blob.extend_from_slice(&peers.export(&dev, &exported)?);
        let all = boot.all_gather(&blob)?;
        let mut maps = ipc::PeerMaps::default();
        let mut normal_ptrs = Vec::with_capacity(r);
        let mut table = Vec::with_capacity(r);
        for (peer, b) in all.iter().enumerate() {
            let bad = || Error::Protocol {
                rank,
                peer,
                phase: "connect",
                msg: format!("malformed GPU connection blob of {} bytes", b.len()),
            };
            if b.len() < BLOB_BYTES {
                return Err(bad());
            }
            let v = |i| read_u64(b, i).ok_or_else(bad);
            cfg.check_peer_hash(peer, v(0)?)?;
            // Peers on other nodes need no check here: both modes reach them through their
            // proxy lanes (attached below), from any process.
            let theirs = (v(3)?, v(4)?, v(5)?);
            let ours = (
                opts.chunk_tokens as u64,
                slots_per_peer as u64,
                opts.normal as u64 | (opts.low_latency as u64) << 1,
            );
            if theirs != ours {
                return Err(Error::ConfigMismatch(format!(
                    "rank {peer} has GPU options (chunk_tokens, slots_per_peer, modes) {theirs:?}, \
                     rank {rank} has {ours:?}"
                )));
            }
            let mut e: abi::fep_ll_peer =
                bytemuck::pod_read_unaligned(b.get(56..BLOB_BYTES).ok_or_else(bad)?);
            let theirs = [v(6)?, e.buf, e.flags];
            let ptrs = peers.resolve(&dev, peer, &theirs, &b[BLOB_BYTES..], &mut maps)?;
            normal_ptrs.push(ptrs[0]);
            (e.buf, e.flags) = (ptrs[1], ptrs[2]);
            table.push(e);
        }
        let normal = match normal {
            Some((settings, buf)) => {
                // SAFETY: every pointer addresses, in this context (directly, through peer access
                // or an IPC mapping held in `maps`), a peer's zeroed comm buffer of this map that
                // lives until its Buffer is destroyed (collectively, after every rank's last
                // kernel; IPC mappings are closed before any rank frees its buffers); a peer on
                // another node has no pointer (0) and is reached through the proxy lane below.
                let comm = buf.clone();
                let mut rank_n = unsafe {
                    NormalGpuRank::from_peer_pointers(&dev, &settings, rank, buf, &normal_ptrs)?
                };
                if cfg.ranks_per_node < r {
                    let l = normal_proxy::ProxyLaneSettings::new(
                        &opts.proxy_provider,
                        cfg.ranks_per_node,
                    )?;
                    let lane = normal_proxy::NormalProxyLane::connect(
                        &dev,
                        &**boot,
                        &settings,
                        &l,
                        num_sms.max(r) as u32,
                    )?;
                    rank_n.attach_proxy(lane)?;
                }
                let layout_gpu = DispatchLayoutGpu::new(&dev, cfg.num_experts, r, r)?;
                let layout = LayoutBuffers::new(&layout_gpu, 1)?;
                Some(NormalPart { rank: rank_n, comm, layout_gpu, layout, layout_cap: 1 })
            }
            None => None,
        };
        let ll = match ll {
            Some((mut l, prep)) => {
                let lane = match prep {
                    Some(p) => {
                        Some(p.connect(boot, cfg.ranks_per_node, &mut l, &mut table, timeout)?)
                    }
                    None => None,
                };
                // SAFETY: as above, for the LL buffers and flags of same-node peers (proxy
                // peers' entries carry no pointers).
                unsafe { l.set_peers(&table)? };
                Some(LlPart { lane, rank: l })
            }
            None => None,
        };
        let ipc_world = peers.world_uses_ipc();
        let paths = peers.paths().to_vec();
        let peer_watch = super::connect::peer_watch(boot);
        let mut normal = normal;
        if let Some(n) = normal.as_mut() {
            n.rank.watch_peers(peer_watch.clone());
        }
        Ok(GpuBuffer {
            cfg,
            id,
            dev,
            num_sms,
            normal,
            ll,
            poisoned: None,
            maps,
            ipc_world,
            paths,
            peer_watch,
            ll_wait_stats: 0,
        })
    }

    /// Teardown step of [`Buffer::destroy`](super::buffer::Buffer::destroy), after its barrier
    /// (no kernel of any rank runs): unmaps this rank's IPC mappings of peers' buffers, then,
    /// when any ranks are in different processes, waits for every rank to have done so, so no
    /// rank frees memory that a peer still maps. Collective.
    pub(crate) fn close_peer_mappings(&mut self, boot: &dyn Bootstrap) -> Result<()> {
        self.maps.close();
        if self.ipc_world {
            boot.barrier()?;
        }
        Ok(())
    }

    /// How this rank reaches each rank's buffers (pointers, peer access or CUDA IPC).
    pub fn peer_paths(&self) -> &[PeerPath] {
        &self.paths
    }

    /// Low-latency proxy lane ([`ll_proxy`]): `None` when every peer is on this node, else
    /// `Some(hmem)` (`true`: the LL buffer is GPU memory registered with `FI_HMEM`).
    pub fn ll_proxy_hmem(&self) -> Option<bool> {
        self.ll.as_ref().and_then(|l| l.lane.as_ref()).map(|lane| lane.hmem())
    }

    /// Diagnostics of the low-latency proxy lane (`None` without one): see
    /// [`ll_proxy`]'s `LlProxyLane::snapshot`. Only while no kernel of this rank runs (after
    /// `sync_gpu` returned).
    pub fn ll_proxy_snapshot(&self) -> Option<String> {
        let l = self.ll.as_ref()?;
        Some(l.lane.as_ref()?.snapshot(&l.rank))
    }

    /// This rank's low-latency protocol state (`None` without low-latency mode): see
    /// [`LlGpuRank::state_snapshot`]. For error reports, after `sync_gpu` returned.
    pub fn ll_state_snapshot(&self) -> Option<String> {
        let l = self.ll.as_ref()?;
        Some(l.rank.state_snapshot().unwrap_or_else(|e| format!("no snapshot: {e}")))
    }

    /// Why the proxy lane did not use the provider's `FI_HMEM` (its CUDA registration failed).
    pub fn ll_proxy_hmem_refused(&self) -> Option<&str> {
        self.ll.as_ref().and_then(|l| l.lane.as_ref()).and_then(|lane| lane.hmem_refused())
    }

    /// This rank's SM budget (blocks per kernel).
    pub fn num_sms(&self) -> usize {
        self.num_sms
    }
    pub fn device(&self) -> &Device {
        &self.dev
    }
    pub fn config(&self) -> &EpConfig {
        &self.cfg
    }

    fn usable(&self) -> Result<()> {
        match &self.poisoned {
            Some(why) => Err(Error::Other(format!(
                "rank {}: GPU buffer unusable after an earlier failure ({why}); \
                 call clean_low_latency_gpu on every rank (low-latency) or rebuild the Buffer",
                self.cfg.rank
            ))),
            None => Ok(()),
        }
    }

    fn normal(&mut self) -> Result<&mut NormalPart> {
        self.usable()?;
        self.normal
            .as_mut()
            .ok_or_else(|| Error::arg("mode", "normal mode was not enabled (GpuOptions::normal)"))
    }

    fn ll(&mut self) -> Result<&mut LlPart> {
        self.usable()?;
        self.ll.as_mut().ok_or_else(|| {
            Error::arg("mode", "low-latency mode was not enabled (GpuOptions::low_latency)")
        })
    }

    /// A view of `s` named `arg` (null with a size is an argument error).
    ///
    /// # Safety
    /// `s` is device memory of this context, alive while the launches using it run.
    unsafe fn view(&self, arg: &'static str, s: DevSlice) -> Result<ManuallyDrop<DeviceBuffer>> {
        if s.ptr == 0 && s.bytes > 0 {
            return Err(Error::arg(arg, "null device pointer"));
        }
        Ok(DeviceBuffer::view(&self.dev, s.ptr, s.bytes))
    }

    /// Turns a device error into a typed one ([`Error::Timeout`] naming the peer for a wait that
    /// ran out) and marks the buffer unusable.
    fn device_error(&mut self, e: Error) -> Error {
        let e = match e {
            Error::Cuda(CudaError::Timeout { call, waited }) => Error::Timeout {
                rank: self.cfg.rank,
                phase: call,
                peers: Vec::new(),
                waited,
                detail: String::new(),
            },
            Error::Cuda(c) => Error::from_device(c, phase_name, self.cfg.timeout),
            e => e,
        };
        self.poisoned = Some(e.to_string());
        e
    }

    /// Waits (bounded: the config's timeout twice plus 5 s) for `stream`, then reports any error
    /// this rank's kernels recorded, as a typed error.
    pub fn sync_gpu(&mut self, stream: &Stream) -> Result<()> {
        let limit = self.cfg.timeout * 2 + Duration::from_secs(5);
        // The stream's end, or a rank the bootstrap saw die (its kernels' waits on that rank
        // would otherwise last their whole budget before this wait could tell).
        let mut dead = None;
        let watch = &self.peer_watch;
        let shrink = self.ll.as_mut().filter(|l| l.rank.shrink_enabled());
        let mut res = match shrink {
            // Shrink mode: a dead rank is masked (the kernels stop waiting for it), not an error.
            Some(l) => crate::cuda::poll_within(limit, "cuStreamQuery", || {
                for d in watch() {
                    // Fails only for a rank out of range, which the bootstrap never reports.
                    let _ = l.rank.set_mask(d.rank, true, "the bootstrap saw it leave");
                }
                stream.query()
            }),
            None => crate::cuda::poll_within(limit, "cuStreamQuery", || {
                dead = watch().first().copied();
                Ok(dead.is_some() || stream.query()?)
            }),
        }
        .map_err(Error::from);
        if let Some(d) = dead {
            res = Err(Error::Proxy(crate::proxy::ProxyError::PeerDead {
                rank: self.cfg.rank as u32,
                peer: d.rank as u32,
                waiting: Vec::new(),
                reported_by: d.reported_by.map(|b| b as u32),
            }));
        }
        if res.is_ok() {
            if let Some(n) = &self.normal {
                res = n.rank.check();
            }
        }
        if res.is_ok() {
            if let Some(l) = &mut self.ll {
                res = l.rank.finish();
                if res.is_ok() && l.rank.shrink_enabled() {
                    res = l.rank.mask().map(|_| ()); // warns of ranks the kernels masked
                }
                // A stopped proxy is the root cause of the kernel's timeout: report it instead.
                if let Some(Err(e)) = l.lane.as_ref().map(|lane| lane.check()) {
                    res = Err(e);
                }
            }
        }
        res.map_err(|e| self.device_error(e))
    }

    /// A normal-mode handle for up to `capacity_tokens` input tokens.
    pub fn new_handle(&mut self, capacity_tokens: usize) -> Result<GpuHandle> {
        let id = self.id;
        let n = self.normal()?;
        if capacity_tokens > n.layout_cap {
            // NOTES: allocations happen here, outside any step (see `notify_gpu`): every rank
            // makes its handles before the collective calls that use them.
            n.layout = LayoutBuffers::new(&n.layout_gpu, capacity_tokens)?;
            n.layout_cap = capacity_tokens;
        }
        Ok(GpuHandle {
            inner: NormalHandle::new(&n.rank, capacity_tokens.max(1))?,
            buffer_id: id,
            capacity: capacity_tokens.max(1),
            out_rows: None,
            info: None,
        })
    }

    /// Notify of a fresh normal dispatch: the GPU `get_dispatch_layout` of `topk_idx`, the send
    /// plan into `handle` and the count exchange with every rank, on `a.stream`. Without
    /// `num_worst_tokens` it then synchronises the stream once (bounded) and returns the
    /// receive counts, so the caller can allocate outputs of `num_recv_tokens` rows; with it,
    /// returns `None` at once. Collective.
    ///
    /// # Safety
    /// `a.topk_idx` addresses device memory of this context that stays alive until the stream
    /// has finished; every rank notifies concurrently.
    pub unsafe fn notify_gpu(
        &mut self,
        a: &GpuNotifyArgs<'_>,
        handle: &mut GpuHandle,
    ) -> Result<Option<RecvInfo>> {
        let (k, t) = (self.cfg.num_topk, a.num_tokens);
        if handle.buffer_id != self.id {
            return Err(Error::arg("handle", "made by another Buffer"));
        }
        if t > handle.capacity {
            return Err(Error::arg(
                "num_tokens",
                format!("{t}: the handle was made for at most {} tokens", handle.capacity),
            ));
        }
        if a.topk_idx.bytes < t * k * 8 {
            return Err(Error::arg(
                "topk_idx",
                format!("{} bytes, needs {t} x {k} int64", a.topk_idx.bytes),
            ));
        }
        let topk = self.view("topk_idx", a.topk_idx)?;
        let rank = self.cfg.rank as u32;
        let cap = a.num_worst_tokens.unwrap_or(i32::MAX as usize);
        let n = self.normal()?;
        if t > n.layout_cap {
            // NOTES: no allocation or free here. With ranks as threads of one context, a
            // cuMemAlloc/cuMemFree can wait for the whole device, including a peer's notify
            // kernel that spins until this rank's notify runs: a deadlock until the timeout.
            // Capacity is reserved with the handle (`new_handle`), when no step is in flight.
            return Err(Error::arg(
                "num_tokens",
                format!(
                    "{t} tokens, but {} were reserved: make the handle with new_handle({t}) \
                     before the step",
                    n.layout_cap
                ),
            ));
        }
        let n = self.normal()?;
        handle.out_rows = None;
        handle.info = None;
        n.layout_gpu.launch(
            a.stream,
            &topk,
            t,
            k,
            &n.layout,
            None,
            rank,
            LayoutTuning::default(),
        )?;
        n.rank.notify(a.stream, &n.layout, t, &mut handle.inner, a.expert_alignment, cap)?;
        match a.num_worst_tokens {
            Some(w) => {
                handle.out_rows = Some(w);
                Ok(None)
            }
            None => {
                let info = match n.rank.recv_info(a.stream, &handle.inner) {
                    Ok(i) => i,
                    Err(e) => return Err(self.device_error(e)),
                };
                handle.out_rows = Some(info.num_recv_tokens);
                handle.info = Some(info.clone());
                Ok(Some(info))
            }
        }
    }

    /// Normal dispatch with `handle` (fresh from [`Self::notify_gpu`], or cached from an earlier
    /// dispatch of the same routing) into `out` (`handle.num_out_rows()` rows), on `a.stream`.
    /// Asynchronous: [`Self::sync_gpu`] reports device errors. Collective.
    ///
    /// # Safety
    /// Every slice addresses device memory of this context that stays alive until the stream
    /// has finished; every rank dispatches concurrently.
    pub unsafe fn dispatch_gpu(
        &mut self,
        a: &GpuDispatchArgs<'_>,
        handle: &GpuHandle,
        out: &GpuDispatchOut,
    ) -> Result<()> {
        if handle.buffer_id != self.id {
            return Err(Error::arg("handle", "made by another Buffer"));
        }
        let rows =
            handle.out_rows.ok_or_else(|| Error::arg("handle", "no notify has filled it"))?;
        let fp8 = self.cfg.dispatch_dtype == DispatchDtype::Fp8E4m3;
        if fp8 != a.x_scales.is_some() || fp8 != out.recv_x_scales.is_some() {
            return Err(Error::arg(
                "x_scales",
                format!(
                    "the buffer dispatches {:?}: x_scales and recv_x_scales are required \
                     exactly for fp8",
                    self.cfg.dispatch_dtype
                ),
            ));
        }
        let x = self.view("x", a.x)?;
        let xs = match a.x_scales {
            Some(s) => Some(self.view("x_scales", s)?),
            None => None,
        };
        let ti = self.view("topk_idx", a.topk_idx)?;
        let tw = self.view("topk_weights", a.topk_weights)?;
        let rx = self.view("recv_x", out.recv_x)?;
        let rxs = match out.recv_x_scales {
            Some(s) => Some(self.view("recv_x_scales", s)?),
            None => None,
        };
        let rti = self.view("recv_topk_idx", out.recv_topk_idx)?;
        let rtw = self.view("recv_topk_weights", out.recv_topk_weights)?;
        let rsi = self.view("recv_src_idx", out.recv_src_idx)?;
        let n = self.normal()?;
        n.rank.dispatch(
            a.stream,
            &handle.inner,
            &DispatchInputs { x: &x, x_scales: xs.as_deref(), topk_idx: &ti, topk_weights: &tw },
            &DispatchOutputs {
                recv_x: &rx,
                recv_x_scales: rxs.as_deref(),
                recv_topk_idx: &rti,
                recv_topk_weights: &rtw,
                recv_src_idx: &rsi,
            },
            rows,
        )
    }

    /// Normal combine with the dispatch's `handle`, on `a.stream`. Asynchronous. Collective.
    ///
    /// # Safety
    /// As [`Self::dispatch_gpu`].
    pub unsafe fn combine_gpu(&mut self, a: &GpuCombineArgs<'_>, handle: &GpuHandle) -> Result<()> {
        if handle.buffer_id != self.id {
            return Err(Error::arg("handle", "made by another Buffer"));
        }
        let rows =
            handle.out_rows.ok_or_else(|| Error::arg("handle", "no notify has filled it"))?;
        let x = self.view("x", a.x)?;
        let w = match a.topk_weights {
            Some(s) => Some(self.view("topk_weights", s)?),
            None => None,
        };
        let cx = self.view("combined_x", a.combined_x)?;
        let cw = match a.combined_topk_weights {
            Some(s) => Some(self.view("combined_topk_weights", s)?),
            None => None,
        };
        let n = self.normal()?;
        n.rank.combine(
            a.stream,
            &handle.inner,
            &CombineArgs {
                x: &x,
                topk_weights: w.as_deref(),
                combined_x: &cx,
                combined_weights: cw.as_deref(),
            },
            rows,
        )
    }

    /// This rank's own communication memory as `(address, bytes)`, as the kernels address it
    /// (DeepEP's `get_local_buffer_tensor`): `low_latency` false: the normal-mode comm buffer
    /// (device memory: peers' chunks land there, then the flags, credits, notify records and
    /// local state of its layout); true: the low-latency buffer (both sets' send and receive
    /// areas; device memory, or pinned host memory mapped into the GPU when peers on other
    /// nodes reach it through a provider without `FI_HMEM`). Dispatch and combine overwrite it.
    pub fn local_region(&self, low_latency: bool) -> Result<(u64, usize)> {
        if low_latency {
            let l = self.ll.as_ref().ok_or_else(|| {
                Error::arg("mode", "low-latency mode was not enabled (GpuOptions::low_latency)")
            })?;
            let m = l.rank.mem();
            return Ok((m.device_ptr(), m.len()));
        }
        let n = self.normal.as_ref().ok_or_else(|| {
            Error::arg(
                "mode",
                "normal mode was not enabled here (GpuOptions::normal; with internode_hierarchy \
                 its buffers are the stages')",
            )
        })?;
        Ok((n.comm.device_ptr(), n.comm.len()))
    }

    /// Low-latency dispatch outputs (and combine handle) for this buffer's config.
    pub fn new_ll_dispatch_out(&mut self) -> Result<LlDispatchOut> {
        let dev = self.dev.clone();
        let l = self.ll()?;
        LlDispatchOut::new(&dev, l.rank.config())
    }

    /// Runs `f` with the rank's launches on `stream` (the caller's), in order with its other
    /// work (capturable in a CUDA graph).
    fn on_ll_stream<T>(
        &mut self,
        stream: &Stream,
        f: impl FnOnce(&mut LlGpuRank) -> Result<T>,
    ) -> Result<T> {
        self.ll()?.rank.with_stream(stream, f)
    }

    /// Low-latency dispatch (DeepEP V1): sends `x`'s rows to their experts' ranks (fp8 cast
    /// in-kernel when the config is fp8) into `out` (`[L, R * max_tokens, hidden]`, counts,
    /// source info, the combine handle). With `return_recv_hook` only the send is launched and
    /// the hook runs the receive; without, both. No host synchronisation. Collective.
    ///
    /// # Safety
    /// Every slice and `out` stay alive until `a.stream` has finished (the hook's receive
    /// included); every rank dispatches concurrently.
    pub unsafe fn low_latency_dispatch_gpu(
        &mut self,
        a: &GpuLlDispatchArgs<'_>,
        out: &LlDispatchOut,
    ) -> Result<Option<LlDispatchHook>> {
        let ws = std::mem::take(&mut self.ll_wait_stats);
        self.shrink_mask_dead();
        let fp8 = self.cfg.dispatch_dtype == DispatchDtype::Fp8E4m3;
        if a.use_fp8 != fp8 {
            return Err(Error::arg(
                "use_fp8",
                format!(
                    "{}: this buffer's low-latency buffers are sized for {:?} (config dispatch_dtype)",
                    a.use_fp8, self.cfg.dispatch_dtype
                ),
            ));
        }
        let x = self.view("x", a.x)?;
        let ti = self.view("topk_idx", a.topk_idx)?;
        let hook = a.return_recv_hook;
        let id = self.id;
        self.on_ll_stream(a.stream, |r| {
            let t = r.dispatch_send(&x, &ti, a.num_tokens, out)?.with_wait_stats(ws);
            if hook {
                Ok(Some(LlDispatchHook { ticket: t, buffer_id: id }))
            } else {
                r.dispatch_recv(t.chained(), out)?;
                Ok(None)
            }
        })
    }

    /// DeepEP's `dispatch_wait_recv_cost_stats` / `combine_wait_recv_cost_stats` for the next
    /// low-latency dispatch or combine only (then reset): `stats` is a device `int64
    /// [num_ranks]` (0: none) to which that call's receive adds, per source rank, the
    /// nanoseconds (%globaltimer) it waited for the rank's flags, summed over them. The caller
    /// keeps it alive until the receive has run on its stream.
    pub fn set_ll_wait_stats(&mut self, stats: u64) -> Result<()> {
        if stats != 0 && self.ll.is_none() {
            return Err(Error::arg("wait_recv_cost_stats", "this buffer has no low-latency part"));
        }
        if stats % 8 != 0 {
            return Err(Error::arg("wait_recv_cost_stats", "misaligned device pointer"));
        }
        self.ll_wait_stats = stats;
        Ok(())
    }

    /// Power-of-two fp8 scales (DeepEP's `round_scale`) for this rank's later low-latency
    /// dispatches; an error without the low-latency part or with bf16 dispatch.
    pub fn set_ll_round_scale(&mut self, on: bool) -> Result<()> {
        match self.ll.as_mut() {
            Some(l) => l.rank.set_round_scale(on),
            None if !on => Ok(()),
            None => Err(Error::arg("round_scale", "this buffer has no low-latency part")),
        }
    }

    /// Completes a hooked low-latency dispatch: launches its receive into the same `out`.
    ///
    /// # Safety
    /// As [`Self::low_latency_dispatch_gpu`].
    pub unsafe fn low_latency_dispatch_recv_gpu(
        &mut self,
        hook: LlDispatchHook,
        out: &LlDispatchOut,
        stream: &Stream,
    ) -> Result<()> {
        if hook.buffer_id != self.id {
            return Err(Error::arg("hook", "made by another Buffer"));
        }
        self.on_ll_stream(stream, |r| r.dispatch_recv(hook.ticket, out))
    }

    /// Low-latency combine (DeepEP V1): expert outputs go back to their tokens' ranks, where
    /// the receive computes the top-k weighted sum in fp32 into `a.out`. Hook as in dispatch.
    /// Collective.
    ///
    /// # Safety
    /// As [`Self::low_latency_dispatch_gpu`].
    pub unsafe fn low_latency_combine_gpu(
        &mut self,
        a: &GpuLlCombineArgs<'_>,
    ) -> Result<Option<LlCombineHook>> {
        let ws = std::mem::take(&mut self.ll_wait_stats);
        self.shrink_mask_dead();
        let x = self.view("x", a.x)?;
        let id = self.id;
        if a.return_recv_hook {
            let send =
                self.on_ll_stream(a.stream, |r| r.combine_send(&x, a.handle, a.num_tokens))?;
            let send = send.with_wait_stats(ws);
            return Ok(Some(LlCombineHook { ticket: send, buffer_id: id }));
        }
        // NOTES: send and receive in one call, so `x` is unchanged in between: the rows of this
        // rank's own experts stay in `x` (combine_send_pull).
        let ti = self.view("topk_idx", a.topk_idx)?;
        let tw = self.view("topk_weights", a.topk_weights)?;
        let out = self.view("out", a.out)?;
        self.on_ll_stream(a.stream, |r| {
            let t = r.combine_send_pull(&x, a.handle, a.num_tokens)?.with_wait_stats(ws);
            r.combine_recv(t.chained(), &ti, &tw, a.handle, &out)
        })?;
        Ok(None)
    }

    /// Completes a hooked low-latency combine (the same arguments as the send).
    ///
    /// # Safety
    /// As [`Self::low_latency_dispatch_gpu`].
    pub unsafe fn low_latency_combine_recv_gpu(
        &mut self,
        hook: LlCombineHook,
        a: &GpuLlCombineArgs<'_>,
    ) -> Result<()> {
        if hook.buffer_id != self.id {
            return Err(Error::arg("hook", "made by another Buffer"));
        }
        if hook.ticket.num_tokens != a.num_tokens {
            return Err(Error::arg(
                "num_tokens",
                format!("{}: the combine send had {}", a.num_tokens, hook.ticket.num_tokens),
            ));
        }
        let ti = self.view("topk_idx", a.topk_idx)?;
        let tw = self.view("topk_weights", a.topk_weights)?;
        let out = self.view("out", a.out)?;
        self.on_ll_stream(a.stream, |r| r.combine_recv(hook.ticket, &ti, &tw, a.handle, &out))
    }

    /// DeepEP's `clean_low_latency_buffer`, and the reset after any device error: every rank
    /// calls it (no kernel of the group running); the buffer is usable again (both modes).
    pub fn clean_low_latency_gpu(&mut self) -> Result<()> {
        let l = self.ll.as_mut().ok_or_else(|| {
            Error::arg("mode", "low-latency mode was not enabled (GpuOptions::low_latency)")
        })?;
        if l.rank.shrink_enabled() {
            let watch = self.peer_watch.clone();
            let dead = move |p: usize| watch().iter().any(|d| d.rank == p);
            l.rank.clean_shrink(&dead)?;
        } else {
            l.rank.clean()?;
        }
        if let Some(lane) = &l.lane {
            lane.fence(&mut l.rank)?;
        }
        if let Some(n) = self.normal.as_mut() {
            n.rank.reset()?;
        }
        // Every reset above is complete on return (fills and copies wait for themselves); no
        // device-wide synchronisation, which with ranks as threads would wait for peers.
        self.poisoned = None;
        Ok(())
    }

    fn shrink_part(&mut self) -> Result<&mut LlGpuRank> {
        match self.ll.as_mut() {
            Some(l) if l.rank.shrink_enabled() => Ok(&mut l.rank),
            _ => Err(Error::arg(
                "enable_shrink",
                "this buffer was built without shrink mode (GpuOptions::shrink, \
                 fep_config.enable_shrink)",
            )),
        }
    }

    /// Shrink mode (DeepEP's `low_latency_update_mask_buffer`; this rank only): masks or
    /// unmasks `rank` ([`LlGpuRank::set_mask`]).
    pub fn ll_update_mask(&mut self, rank: usize, masked: bool) -> Result<()> {
        self.shrink_part()?.set_mask(rank, masked, "")
    }

    /// Shrink mode (DeepEP's `low_latency_query_mask_buffer`): `[R]` the masked ranks.
    pub fn ll_mask(&mut self) -> Result<Vec<bool>> {
        self.shrink_part()?.mask()
    }

    /// Shrink mode, before a call's writes: masks the ranks the bootstrap saw leave (a write
    /// into a dead process's memory is never wanted; its data would not come either).
    fn shrink_mask_dead(&mut self) {
        let watch = self.peer_watch.clone();
        if let Some(l) = self.ll.as_mut().filter(|l| l.rank.shrink_enabled()) {
            for d in watch() {
                let _ = l.rank.set_mask(d.rank, true, "the bootstrap saw it leave");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn processes_sharing_a_gpu_need_mps() {
        assert!(check_mps(0, 1, true, false).is_ok());
        assert!(check_mps(0, 1, false, true).is_ok());
        let e = check_mps(2, 3, false, false).unwrap_err().to_string();
        assert!(e.contains("MPS") && e.contains("rank 3") && e.contains("nvidia-cuda-mps-control"));
    }

    #[test]
    fn work_queue_check_names_the_variable() {
        assert!(check_work_queues(1, None, true).is_ok());
        assert!(check_work_queues(2, None, false).is_ok());
        assert!(check_work_queues(4, Some("32"), true).is_ok());
        assert!(check_work_queues(16, Some("32"), false).is_ok());
        for (n, v, mps) in [
            (4, None, false),
            (4, Some("8"), false),
            (8, Some("16"), false),
            (2, Some("x"), false),
            (2, None, true),
        ] {
            match check_work_queues(n, v, mps) {
                Err(Error::InvalidArgument { arg, msg }) => {
                    assert_eq!(arg, "CUDA_DEVICE_MAX_CONNECTIONS", "{msg}")
                }
                other => panic!("{n} ranks, {v:?}, MPS {mps}: {other:?}"),
            }
        }
    }
}
