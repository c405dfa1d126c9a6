//! `Buffer`: the EP communication buffer of one rank (DeepEP V1's `deep_ep.Buffer`), normal mode.
//!
//! One file: it is `Buffer`'s whole host-side API (DeepEP's `deep_ep.Buffer`) for both modes, whose
//! `impl Buffer` blocks share the private state and helpers defined here; moving each mode into a
//! submodule would be a later pure move.
//!
//! ```no_run
//! # use std::sync::Arc;
//! # use fabric_ep::ep::buffer::*;
//! # use fabric_ep::protocol::config::{EpConfig, EpSettings};
//! # fn f(boot: Arc<dyn fabric_ep::bootstrap::Bootstrap>, x: &[u16], topk_idx: &[i64], w: &[f32])
//! #   -> fabric_ep::Result<()> {
//! let cfg = EpConfig::new(EpSettings::new(boot.rank(), boot.world_size(), 64, 4096, 8))?;
//! let mut buf = Buffer::new(cfg, boot, BufferOptions::host("tcp;ofi_rxm"))?;
//! let layout = buf.get_dispatch_layout(topk_idx)?;
//! let out = buf.dispatch(&DispatchArgs {
//!     x: Tokens::Bf16(x),
//!     topk_idx: Some(topk_idx),
//!     topk_weights: Some(w),
//!     layout: Some(&layout),
//!     ..DispatchArgs::default()
//! })?;
//! let expert_out = out.recv_x_bf16().unwrap();   // [rows, hidden] bf16 bits
//! let back = buf.combine(&CombineArgs { x: expert_out, handle: &out.handle, topk_weights: None })?;
//! # let _ = back; Ok(()) }
//! ```
//!
//! The host backend runs the protocol on CPU threads over host memory; the GPU backend (same
//! protocol, kernels, pinned or device memory) will add `dispatch_gpu`/`combine_gpu` beside these
//! host calls, with device pointers and a stream, without changing these argument structs.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// The host backend's proxy workers (one lane idles while the other works) sleep up to this
/// long between polls once idle for a while (`ProxyConfig::idle_sleep_max`).
const HOST_IDLE_SLEEP_MAX: Duration = Duration::from_millis(1);

use super::connect::peer_watch;
use super::gpu::{GpuBuffer, GpuOptions};
use super::handle::{DispatchHandle, LlHandle};
use super::host::ll::{LlComm, LlFabricHold, LlGeometry, LlLane, LlPhase};
use super::host::{Geometry, HostComm, StepCounts};
use crate::bootstrap::Bootstrap;
use crate::fabric::{InfoQuery, MemKind, MemoryRegion, Placement, Stack};
use crate::protocol::config::{DispatchDtype, EpConfig};
use crate::protocol::layout::{dispatch_layout, Layout};
use crate::protocol::plan::{
    self, LlArea, LlLayout, LlRecvLayout, LlSendPlan, NotifyRecord, Phase, RecordFields,
    RecordLayout, RecvPlan, SendPlan, FP8_GROUP,
};
use crate::protocol::quant::{bf16_to_f32, f32_to_bf16, quantize_row_bf16};
use crate::proxy::{
    CounterLayout, CounterMemory, FabricPeer, FabricTransport, LoopbackGroup, LoopbackOptions,
    Proxy, ProxyConfig, RingLayout, RingMemory, SharedRegion, SplitTransport, Throttled,
};
use crate::{Error, Result};

pub use crate::protocol::reference::{Tokens as OwnedTokens, TokensRef as Tokens};

const _: () = assert!(cfg!(target_endian = "little"), "wire records are little-endian");

/// Which engine moves the data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// CPU threads over host memory (CI, the GPU tests' oracle, ep-bench without a GPU).
    Host,
    /// CUDA kernels, ranks as threads of one process on one GPU ([`BufferOptions::gpu`];
    /// the calls are [`Buffer::gpu`]'s).
    Gpu,
}

/// How the ranks' buffers reach each other.
#[derive(Clone, Debug)]
pub enum TransportKind {
    /// libfabric RMA writes through the proxy, over [`BufferOptions::provider`].
    Fabric,
    /// In-process ranks (threads) sharing one address space; build the group with
    /// [`Buffer::loopback_group`] so its regions have this config's geometry.
    Loopback(LoopbackGroup),
}

/// How to build a [`Buffer`].
#[derive(Clone, Debug)]
pub struct BufferOptions {
    pub backend: Backend,
    /// libfabric provider for [`TransportKind::Fabric`]: "shm", "tcp;ofi_rxm", "udp;ofi_rxd",
    /// "efa", ...
    pub provider: String,
    pub transport: TransportKind,
    /// Bound on every wait; `None`: the config's `timeout`.
    pub timeout: Option<Duration>,
    /// Command ring entries (the writes one rank may have queued to its proxy).
    pub ring_capacity: u32,
    /// Low-latency mode over [`TransportKind::Loopback`]: the in-process group of the LL lane
    /// (build it with [`Buffer::ll_loopback_group`]); unused over libfabric.
    pub ll_loopback: Option<LoopbackGroup>,
    /// The GPU backend's options (required with [`Backend::Gpu`]).
    pub gpu: Option<GpuOptions>,
    /// Host backend over libfabric: peers on this rank's node are written through a second
    /// endpoint of this provider (e.g. "shm"), the others through [`Self::provider`], as a GPU
    /// job's intranode traffic takes NVLink and not the NIC. Every rank must pass the same
    /// (a mismatch is [`Error::ConfigMismatch`] at connect). `None`: one provider for all.
    pub intranode_provider: Option<String>,
    /// Host backend over libfabric, a bench aid: cap this rank's writes to ranks on other nodes
    /// at this many GB/s (`proxy::Throttled`), to stand in for a NIC slower than the node's
    /// own link where both are memory copies (one machine). `None`: no cap.
    pub emulate_network_gbps: Option<f64>,
    /// Low-latency mode: DeepEP's `enable_shrink`. A peer that stalls for the timeout (or that
    /// the bootstrap saw leave) is masked instead of failing the call; masked ranks get no
    /// writes and are not waited for ([`Buffer::ll_update_mask`]), and
    /// [`Buffer::clean_low_latency_buffer`] runs among the unmasked ranks only. The GPU
    /// backend takes it with every rank on one node ([`GpuOptions::shrink`]).
    pub ll_shrink: bool,
}

impl BufferOptions {
    /// Host backend over libfabric `provider`.
    pub fn host(provider: &str) -> Self {
        BufferOptions {
            backend: Backend::Host,
            provider: provider.to_string(),
            transport: TransportKind::Fabric,
            timeout: None,
            ring_capacity: 1024,
            ll_loopback: None,
            gpu: None,
            intranode_provider: None,
            emulate_network_gbps: None,
            ll_shrink: false,
        }
    }

    /// GPU backend (see [`crate::ep::gpu`]).
    pub fn gpu(opts: GpuOptions) -> Self {
        BufferOptions { backend: Backend::Gpu, gpu: Some(opts), ..Self::host("none") }
    }

    /// Host backend over an in-process loopback group.
    pub fn loopback(group: LoopbackGroup) -> Self {
        BufferOptions { transport: TransportKind::Loopback(group), ..Self::host("loopback") }
    }

    /// Adds the low-latency lane's loopback group (see [`Buffer::ll_loopback_group`]).
    pub fn with_ll_loopback(mut self, group: LoopbackGroup) -> Self {
        self.ll_loopback = Some(group);
        self
    }
}

/// Mixed into the connect header's config hash when an intranode provider is used.
const SPLIT_HASH_TAG: u64 = 0x7370_6c69_7470_7276; // "splitprv"

/// Region chunk used for the loopback transport (no provider limit; same as fabric's default).
const LOOPBACK_STRIDE: u64 = 1 << 30;

static NEXT_BUFFER_ID: AtomicU64 = AtomicU64::new(1);

/// Arguments of a normal dispatch. Shapes: `T` = tokens on this rank, `H` = hidden, `K` = top-k.
#[derive(Clone, Copy, Debug)]
pub struct DispatchArgs<'a> {
    /// `x [T, H]` bf16 bits, or e4m3 bytes `[T, H]` plus `scales [T, H / 128]` f32; must match
    /// the config's `dispatch_dtype`.
    pub x: Tokens<'a>,
    /// `[T, K]` global expert ids, -1 = none. Required unless `handle` is given.
    pub topk_idx: Option<&'a [i64]>,
    /// `[T, K]` weights; given exactly when `topk_idx` is.
    pub topk_weights: Option<&'a [f32]>,
    /// The output of [`Buffer::get_dispatch_layout`] for `topk_idx`; computed when `None`.
    pub layout: Option<&'a Layout>,
    /// Cached-handle dispatch: reuse a previous dispatch's routing and counts, no notify step.
    pub handle: Option<&'a DispatchHandle>,
    /// Tokens per local expert are rounded up to this (>= 1).
    pub expert_alignment: usize,
    /// Fixed output rows (no count sync needed by the caller); an error if more arrive.
    pub num_worst_tokens: Option<usize>,
}

impl Default for DispatchArgs<'_> {
    fn default() -> Self {
        DispatchArgs {
            x: Tokens::Bf16(&[]),
            topk_idx: None,
            topk_weights: None,
            layout: None,
            handle: None,
            expert_alignment: 1,
            num_worst_tokens: None,
        }
    }
}

/// Result of a normal dispatch. `rows` = received tokens, or `num_worst_tokens` when given
/// (rows past the received ones are zero, their ids -1).
#[derive(Clone, Debug, PartialEq)]
pub struct DispatchOutput {
    /// `[rows, H]` grouped by source rank ascending, token order within a source.
    pub recv_x: OwnedTokens,
    /// `[rows, K]` local expert ids, -1 where the expert is not on this rank (empty when the
    /// call had no `topk_idx`).
    pub recv_topk_idx: Vec<i64>,
    /// `[rows, K]`, 0 where `recv_topk_idx` is -1 (empty when the call had no weights).
    pub recv_topk_weights: Vec<f32>,
    /// `[num_local_experts]` received top-k entries per local expert, each rounded up to
    /// `expert_alignment`.
    pub num_recv_tokens_per_expert: Vec<usize>,
    /// Real rows received.
    pub num_recv_tokens: usize,
    pub handle: DispatchHandle,
}

impl DispatchOutput {
    /// `recv_x` as bf16 bits, when it is bf16.
    pub fn recv_x_bf16(&self) -> Option<&[u16]> {
        match &self.recv_x {
            OwnedTokens::Bf16(x) => Some(x),
            OwnedTokens::Fp8 { .. } => None,
        }
    }
}

/// Arguments of a normal combine.
#[derive(Clone, Copy, Debug)]
pub struct CombineArgs<'a> {
    /// `[rows, H]` bf16 bits, rows as the dispatch's `recv_x` (its real rows, or all
    /// `num_worst_tokens` rows; padding rows are ignored).
    pub x: &'a [u16],
    pub handle: &'a DispatchHandle,
    /// Optional `[rows, K]` weights, summed back like `x`.
    pub topk_weights: Option<&'a [f32]>,
}

/// Result of a normal combine.
#[derive(Clone, Debug, PartialEq)]
pub struct CombineOutput {
    /// `[T, H]` bf16: per token, the fp32 sum (destination ranks ascending) of what each rank
    /// it went to returned; 0 for tokens that went nowhere.
    pub combined_x: Vec<u16>,
    /// `[T, K]` the same sum over the weights, when weights were given.
    pub combined_topk_weights: Option<Vec<f32>>,
}

/// Keeps the libfabric objects alive behind the proxy.
struct FabricHold {
    // NOTES: field order is drop order: regions before the stack that registered them.
    /// The intranode provider's registrations and stack (`BufferOptions::intranode_provider`).
    _near: Option<(Arc<MemoryRegion>, Arc<MemoryRegion>, Stack)>,
    _recv_mr: Arc<MemoryRegion>,
    _send_mr: Arc<MemoryRegion>,
    _stack: Stack,
}

/// One rank's EP buffer, normal mode.
pub struct Buffer {
    cfg: EpConfig,
    id: u64,
    boot: Arc<dyn Bootstrap>,
    // NOTES: field order is drop order: the proxy (inside comm) stops before the registrations
    // go, and they go before the memory they cover (the regions in `_mem`).
    comm: Option<HostComm>,
    fabric: Option<FabricHold>,
    _mem: Option<(Arc<SharedRegion>, Arc<SharedRegion>)>,
    poisoned: Option<String>,
    /// The low-latency lane, connected by the first LL call (its own ring, proxy, transport
    /// and registered buffer; normal-mode users never pay for it).
    ll: Option<LlLane>,
    opts: BufferOptions,
    /// The GPU backend's engine (`Backend::Gpu`); the host fields above are then empty.
    gpu: Option<Box<GpuBuffer>>,
    /// `[R]` shrink mode's mask until the LL lane connects (then the lane's).
    ll_mask: Vec<bool>,
}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Buffer")
            .field("rank", &self.cfg.rank)
            .field("num_ranks", &self.cfg.num_ranks)
            .field("id", &self.id)
            .finish()
    }
}

fn geometry(cfg: &EpConfig, stride: u64) -> Result<Geometry> {
    Geometry::new(cfg.normal_layout(), stride)
}

fn blob_err(rank: usize, peer: usize, len: usize) -> Error {
    Error::Protocol {
        rank,
        peer,
        phase: "connect",
        msg: format!("malformed connection blob of {len} bytes"),
    }
}

/// `rows * per_row` copies of `v` for an output whose row count peers announced (`prefix`: the
/// per-source row prefix): a size that overflows or cannot be allocated is [`Error::Protocol`]
/// naming the source that announced the most rows, never an allocation abort.
pub(crate) fn announced_vec<T: Clone>(
    rank: usize,
    prefix: &[u64],
    rows: u64,
    per_row: usize,
    v: T,
) -> Result<Vec<T>> {
    let n = usize::try_from(rows).ok().and_then(|r| r.checked_mul(per_row));
    let mut out = Vec::new();
    match n {
        Some(n) if out.try_reserve_exact(n).is_ok() => {
            out.resize(n, v);
            Ok(out)
        }
        _ => {
            let (peer, most) = prefix
                .windows(2)
                .map(|w| w[1] - w[0])
                .enumerate()
                .max_by_key(|&(_, c)| c)
                .unwrap_or((0, 0));
            Err(Error::Protocol {
                rank,
                peer,
                phase: "notify",
                msg: format!(
                    "announced {most} tokens ({rows} rows from every peer): {rows} x {per_row} \
                     output elements of {} bytes cannot be allocated",
                    std::mem::size_of::<T>()
                ),
            })
        }
    }
}

fn read_u64(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

/// The bootstrap's rank and size must be the config's (an argument error naming `boot`).
pub(crate) fn check_boot(cfg: &EpConfig, boot: &dyn Bootstrap) -> Result<()> {
    if boot.rank() != cfg.rank || boot.world_size() != cfg.num_ranks {
        return Err(Error::arg(
            "boot",
            format!(
                "bootstrap is rank {} of {}, config says rank {} of {}",
                boot.rank(),
                boot.world_size(),
                cfg.rank,
                cfg.num_ranks
            ),
        ));
    }
    Ok(())
}

impl Buffer {
    /// A loopback group for `num_ranks` in-process ranks with `cfg`'s buffer geometry (any
    /// rank's config: the geometry is the same on all).
    pub fn loopback_group(cfg: &EpConfig, opts: LoopbackOptions) -> Result<LoopbackGroup> {
        let bytes = geometry(cfg, LOOPBACK_STRIDE)?.bytes as usize;
        Ok(LoopbackGroup::host(cfg.num_ranks as u32, bytes, bytes, opts)?)
    }

    /// Allocates and registers the normal-mode buffers (sizes from the config: they do not
    /// depend on the token count), connects every rank through `boot`, checks that every rank
    /// has the same config hash ([`Error::ConfigMismatch`] naming the rank otherwise) and
    /// starts the proxy. Collective: every rank calls it.
    pub fn new(cfg: EpConfig, boot: Arc<dyn Bootstrap>, opts: BufferOptions) -> Result<Self> {
        check_boot(&cfg, &*boot)?;
        crate::log::set_rank(cfg.rank);
        let fabric_host =
            opts.backend == Backend::Host && matches!(opts.transport, TransportKind::Fabric);
        if !fabric_host && opts.intranode_provider.is_some() {
            return Err(Error::arg(
                "intranode_provider",
                "only the host backend over libfabric takes it (not the GPU backend or loopback)",
            ));
        }
        if let Some(g) = opts.emulate_network_gbps {
            if !fabric_host {
                return Err(Error::arg(
                    "emulate_network_gbps",
                    "only the host backend over libfabric takes it (not the GPU backend or loopback)",
                ));
            }
            if !(g > 0.0 && g.is_finite()) {
                return Err(Error::arg("emulate_network_gbps", format!("{g} must be > 0 GB/s")));
            }
        }
        if opts.backend == Backend::Gpu {
            let g = opts.gpu.as_ref().ok_or_else(|| {
                Error::arg("backend", "Backend::Gpu needs GPU options: use BufferOptions::gpu")
            })?;
            let id = NEXT_BUFFER_ID.fetch_add(1, Ordering::Relaxed);
            let g = GpuOptions { shrink: g.shrink || opts.ll_shrink, ..g.clone() };
            let gpu = Box::new(GpuBuffer::connect(cfg.clone(), &boot, &g, id)?);
            let (comm, fabric, _mem) = (None, None, None);
            return Ok(Buffer {
                cfg,
                id,
                boot,
                comm,
                fabric,
                _mem,
                poisoned: None,
                ll: None,
                opts: opts.clone(),
                gpu: Some(gpu),
                ll_mask: Vec::new(),
            });
        }
        if opts.ring_capacity == 0 {
            return Err(Error::arg("ring_capacity", "must be at least 1"));
        }
        let rank = cfg.rank;
        let r = cfg.num_ranks;
        let timeout = opts.timeout.unwrap_or(cfg.timeout);
        let layout = cfg.normal_layout();
        // The host backend has no GPU: the node's ranks spread over equally near NICs.
        let place = Placement {
            rank: Some(rank),
            local_rank: rank % cfg.ranks_per_node.max(1),
            ..Placement::default()
        };
        let rings = RingMemory::new_host(RingLayout::new(1, opts.ring_capacity)?)?;
        let counters = CounterMemory::new_host(CounterLayout {
            num_slots: layout.imm.num_ids() as u32,
            num_rings: 1,
        })?;
        let pcfg = ProxyConfig {
            rank: rank as u32,
            value_bits: plan::IMM_VALUE_BITS,
            idle_sleep_max: HOST_IDLE_SLEEP_MAX,
            ..ProxyConfig::default()
        };
        let hash = cfg.hash();
        let id = NEXT_BUFFER_ID.fetch_add(1, Ordering::Relaxed);
        let opts_kept = opts.clone();
        let (geo, send, recv, proxy, fabric) = match &opts.transport {
            TransportKind::Loopback(group) => {
                let geo = geometry(&cfg, LOOPBACK_STRIDE)?;
                if group.num_ranks() as usize != r {
                    return Err(Error::arg(
                        "transport",
                        format!("loopback group of {} ranks, config has {r}", group.num_ranks()),
                    ));
                }
                let send = group.send_region(rank as u32)?.clone();
                let recv = group.recv_region(rank as u32)?.clone();
                if (send.len() as u64) < geo.bytes || (recv.len() as u64) < geo.bytes {
                    return Err(Error::arg(
                        "transport",
                        format!(
                            "loopback regions of {} bytes, this config needs {} \
                             (build the group with Buffer::loopback_group)",
                            send.len().min(recv.len()),
                            geo.bytes
                        ),
                    ));
                }
                let all = boot.all_gather(&hash.to_le_bytes())?;
                for (peer, b) in all.iter().enumerate() {
                    let h = read_u64(b, 0).ok_or_else(|| blob_err(rank, peer, b.len()))?;
                    cfg.check_peer_hash(peer, h)?;
                }
                let transport = group.transport(rank as u32)?;
                let proxy = Proxy::start(pcfg, rings.clone(), counters, vec![transport])?;
                (geo, send, recv, proxy, None)
            }
            TransportKind::Fabric => {
                let stack = Stack::open_placed(&InfoQuery::provider(&opts.provider), r, &place)?;
                let near_stack = match &opts.intranode_provider {
                    Some(p) => Some(Stack::open_placed(&InfoQuery::provider(p), r, &place)?),
                    None => None,
                };
                // NOTES: with two providers the slots must sit inside both one's and the other's
                // registration chunks: both are powers of two, so the smaller stride serves both.
                let stride = std::iter::once(&stack)
                    .chain(near_stack.as_ref())
                    .map(|s| s.info.max_region_bytes().max(4096) as u64)
                    .min()
                    .unwrap_or(4096);
                let geo = geometry(&cfg, stride)?;
                crate::fep_info!(
                    "host buffer: rank {rank} of {r} ({} per node), send and receive regions of \
                     {} bytes each in host memory, timeout {timeout:?}{}",
                    cfg.ranks_per_node,
                    geo.bytes,
                    opts.intranode_provider
                        .as_deref()
                        .map(|p| format!(", same-node peers over {p}"))
                        .unwrap_or_default()
                );
                let send = Arc::new(SharedRegion::alloc_host(geo.bytes as usize)?);
                let recv = Arc::new(SharedRegion::alloc_host(geo.bytes as usize)?);
                // The header: the config hash, tagged when an intranode provider is used (so
                // ranks that disagree on it fail here, before the second exchange).
                let tag = if near_stack.is_some() { SPLIT_HASH_TAG } else { 0 };
                let header = (hash ^ tag).to_le_bytes();
                let connect = |stack: &Stack| -> Result<_> {
                    // SAFETY: both regions are kept alive by `Buffer::_mem`, which drops after
                    // the proxy (whose transport posts writes naming them) and after the
                    // registrations.
                    let send_mr = Arc::new(unsafe {
                        stack.register(send.as_ptr(), send.len(), MemKind::Host)?
                    });
                    let recv_mr = Arc::new(unsafe {
                        stack.register(recv.as_ptr(), recv.len(), MemKind::Host)?
                    });
                    let fp = super::connect::exchange_fabric(
                        &*boot,
                        stack,
                        &recv_mr.remote(),
                        &header,
                        geo.bytes,
                    )?;
                    for (peer, h) in fp.headers.iter().enumerate() {
                        let h = read_u64(h, 0).ok_or_else(|| blob_err(rank, peer, h.len()))?;
                        if h ^ tag ^ SPLIT_HASH_TAG == hash {
                            return Err(Error::ConfigMismatch(format!(
                                "rank {rank} and rank {peer} disagree on \
                                 BufferOptions::intranode_provider (set on one, not the other)"
                            )));
                        }
                        cfg.check_peer_hash(peer, h ^ tag)?;
                    }
                    Ok((send_mr, recv_mr, fp.into_proxy_peers()))
                };
                let (send_mr, recv_mr, mut peers) = connect(&stack)?;
                // Peers on this rank's node: written over the intranode provider when one is
                // given (dropped from the network transport), never rate-capped.
                let same_node: Vec<bool> = (0..cfg.num_ranks)
                    .map(|d| d / cfg.ranks_per_node == rank / cfg.ranks_per_node)
                    .collect();
                let far_peers: Vec<bool> = same_node.iter().map(|&n| !n).collect();
                let keep = |p: &mut Vec<Option<FabricPeer>>, near: bool| {
                    for (slot, &n) in p.iter_mut().zip(&same_node) {
                        if n != near {
                            *slot = None;
                        }
                    }
                };
                if near_stack.is_some() {
                    keep(&mut peers, false);
                }
                let far =
                    FabricTransport::new(rank as u32, stack.ep.clone(), send_mr.clone(), peers)?;
                let rate = opts.emulate_network_gbps.map(|g| g * 1e9);
                let (proxy, near_hold) = match near_stack {
                    None => {
                        let t = Throttled::new(far, far_peers, rate);
                        (Proxy::start(pcfg, rings.clone(), counters, vec![t])?, None)
                    }
                    Some(ns) => {
                        let (nsend, nrecv, mut np) = connect(&ns)?;
                        keep(&mut np, true);
                        let near_t =
                            FabricTransport::new(rank as u32, ns.ep.clone(), nsend.clone(), np)?;
                        let t = SplitTransport { near: same_node.clone(), near_t, far_t: far };
                        let t = Throttled::new(t, far_peers, rate);
                        let proxy = Proxy::start(pcfg, rings.clone(), counters, vec![t])?;
                        (proxy, Some((nrecv, nsend, ns)))
                    }
                };
                let hold = FabricHold {
                    _near: near_hold,
                    _recv_mr: recv_mr,
                    _send_mr: send_mr,
                    _stack: stack,
                };
                (geo, send, recv, proxy, Some(hold))
            }
        };
        // Every rank's proxy runs and every region is registered before anyone writes.
        boot.barrier()?;
        let producer = rings.producer(0)?;
        proxy.watch_peers(peer_watch(&boot));
        let comm = HostComm::new(rank, geo, timeout, producer, proxy, send.clone(), recv.clone());
        Ok(Buffer {
            cfg,
            id,
            boot,
            comm: Some(comm),
            fabric,
            _mem: Some((send, recv)),
            poisoned: None,
            ll: None,
            opts: opts_kept,
            gpu: None,
            ll_mask: vec![false; r],
        })
    }

    /// The config this buffer was built from.
    pub fn config(&self) -> &EpConfig {
        &self.cfg
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.cfg.rank
    }

    /// Bytes of host memory this rank registered for normal mode (send staging + receive area,
    /// notify included). Fixed by the config: it never grows with the token count.
    pub fn registered_bytes(&self) -> u64 {
        self.comm.as_ref().map_or(0, |c| 2 * c.geo.bytes)
    }

    /// Bounded collective teardown: waits (up to the bootstrap's timeout) until every rank is
    /// done with its last call, so nobody unregisters memory a peer may still write, then stops
    /// the proxy. The buffer is torn down even when the barrier fails (its error is returned).
    pub fn destroy(mut self) -> Result<()> {
        let mut barrier = self.boot.barrier().map_err(Error::from);
        if let (Ok(()), Some(g)) = (&barrier, self.gpu.as_mut()) {
            // GPU backend: peers' IPC mappings are closed (collectively) before any rank frees
            // the memory behind them.
            barrier = g.close_peer_mappings(&*self.boot);
        }
        self.teardown();
        barrier
    }

    fn teardown(&mut self) {
        self.ll.take();
        self.comm.take();
        self.fabric.take();
        self.gpu.take();
    }

    /// The GPU engine of a [`Backend::Gpu`] buffer: device-pointer dispatch/combine on CUDA
    /// streams (an argument error on a host buffer).
    pub fn gpu(&mut self) -> Result<&mut GpuBuffer> {
        match self.gpu.as_deref_mut() {
            Some(g) => Ok(g),
            None => Err(Error::arg("backend", "this Buffer uses the host backend")),
        }
    }

    fn comm(&mut self) -> Result<&mut HostComm> {
        if let Some(why) = &self.poisoned {
            return Err(Error::Other(format!(
                "rank {}: buffer unusable after an earlier failure: {why}",
                self.cfg.rank
            )));
        }
        if self.gpu.is_some() {
            return Err(Error::arg("backend", "a GPU buffer: use the calls of Buffer::gpu"));
        }
        self.comm.as_mut().ok_or_else(|| Error::Other("buffer destroyed".into()))
    }

    /// DeepEP's `get_dispatch_layout`: from `topk_idx [T, K]` (-1 = none) the tokens per rank,
    /// node and expert, and `is_token_in_rank [T, R]`.
    pub fn get_dispatch_layout(&self, topk_idx: &[i64]) -> Result<Layout> {
        let k = self.cfg.num_topk;
        if topk_idx.len() % k != 0 {
            return Err(Error::arg(
                "topk_idx",
                format!("length {} is not a multiple of num_topk {k}", topk_idx.len()),
            ));
        }
        dispatch_layout(
            topk_idx,
            topk_idx.len() / k,
            k,
            self.cfg.num_experts,
            self.cfg.num_ranks,
            self.cfg.ranks_per_node,
        )
    }

    /// Checks `x` against the config; returns the token count.
    fn check_x(&self, x: &Tokens<'_>) -> Result<usize> {
        let h = self.cfg.hidden;
        let (len, dtype) = match x {
            Tokens::Bf16(v) => (v.len(), DispatchDtype::Bf16),
            Tokens::Fp8 { x, .. } => (x.len(), DispatchDtype::Fp8E4m3),
        };
        if dtype != self.cfg.dispatch_dtype {
            return Err(Error::arg(
                "x",
                format!(
                    "{dtype:?} tokens on a buffer configured for {:?}",
                    self.cfg.dispatch_dtype
                ),
            ));
        }
        if len % h != 0 {
            return Err(Error::arg(
                "x",
                format!(
                    "length {len} is not a multiple of hidden {h} (x must be [tokens, hidden])"
                ),
            ));
        }
        let t = len / h;
        if t > i32::MAX as usize {
            return Err(Error::arg("x", format!("{t} tokens, more than i32::MAX")));
        }
        if let Tokens::Fp8 { scales, .. } = x {
            let g = h / FP8_GROUP as usize;
            if scales.len() != t * g {
                return Err(Error::arg(
                    "scales",
                    format!("length {}, expected {t} * {g} ([tokens, hidden / 128])", scales.len()),
                ));
            }
        }
        Ok(t)
    }

    /// Normal dispatch (DeepEP V1): every token to every rank holding one of its experts.
    /// A fresh dispatch (no `handle`) runs the notify step first; a cached one reuses the
    /// handle's counts. Collective: every rank calls it, all fresh or all cached.
    pub fn dispatch(&mut self, args: &DispatchArgs<'_>) -> Result<DispatchOutput> {
        let r = self.dispatch_unreported(args);
        self.reported(r)
    }

    fn dispatch_unreported(&mut self, args: &DispatchArgs<'_>) -> Result<DispatchOutput> {
        let cfg = self.cfg.clone();
        let (r, k, h) = (cfg.num_ranks, cfg.num_topk, cfg.hidden);
        let l = cfg.num_local_experts();
        // ---- Validation: nothing is sent before every argument checked out.
        let t = self.check_x(&args.x)?;
        if args.expert_alignment == 0 {
            return Err(Error::arg("expert_alignment", "must be at least 1"));
        }
        match (args.topk_idx, args.topk_weights) {
            (Some(idx), Some(w)) => {
                plan::check_topk_idx(idx, t, k, cfg.num_experts, false)?;
                if w.len() != t * k {
                    return Err(Error::arg(
                        "topk_weights",
                        format!("length {}, expected {t} * {k}", w.len()),
                    ));
                }
            }
            (None, None) if args.handle.is_some() => {}
            (None, None) => {
                return Err(Error::arg("topk_idx", "required unless a handle is given"))
            }
            (Some(_), None) => {
                return Err(Error::arg("topk_weights", "required when topk_idx is given"))
            }
            (None, Some(_)) => {
                return Err(Error::arg("topk_idx", "required when topk_weights is given"))
            }
        }
        let (send_plan, is_token_in_rank, recv_plan, fresh_records) = match args.handle {
            Some(hd) => {
                if args.layout.is_some() {
                    return Err(Error::arg("layout", "give a layout or a handle, not both"));
                }
                if hd.buffer_id != self.id {
                    return Err(Error::arg("handle", "made by another Buffer"));
                }
                if hd.num_tokens != t {
                    return Err(Error::arg(
                        "x",
                        format!("{t} tokens, the handle was made for {}", hd.num_tokens),
                    ));
                }
                if let Some(idx) = args.topk_idx {
                    let itr = self.get_dispatch_layout(idx)?.is_token_in_rank;
                    if itr != hd.is_token_in_rank {
                        return Err(Error::arg(
                            "topk_idx",
                            "routes tokens to other ranks than the handle does",
                        ));
                    }
                }
                let recv_counts: Vec<u64> = (0..r).map(|s| hd.recv_count(s)).collect();
                let n = hd.num_recv_tokens();
                let rows = match args.num_worst_tokens {
                    None => hd.num_out_rows,
                    Some(w) if w >= n => w,
                    Some(w) => {
                        return Err(Error::arg(
                            "num_worst_tokens",
                            format!("rank {} receives {n} tokens, more than {w}", cfg.rank),
                        ))
                    }
                };
                let plan = RecvPlan {
                    rank_prefix: hd.rank_prefix.clone(),
                    num_recv_tokens: n as u64,
                    num_out_rows: rows as u64,
                    tokens_per_local_expert: hd
                        .num_recv_tokens_per_expert
                        .iter()
                        .map(|&c| c as u64)
                        .collect(),
                    chunks_from: recv_counts
                        .iter()
                        .map(|&c| cfg.normal_layout().num_chunks(c))
                        .collect(),
                };
                (hd.send_plan.clone(), hd.is_token_in_rank.clone(), Some(plan), None)
            }
            None => {
                let idx = args.topk_idx.unwrap_or(&[]);
                let computed;
                let layout = match args.layout {
                    Some(lay) => {
                        check_layout(lay, t, r, cfg.num_experts)?;
                        lay
                    }
                    None => {
                        computed = self.get_dispatch_layout(idx)?;
                        &computed
                    }
                };
                let sp =
                    SendPlan::from_is_token_in_rank(&layout.is_token_in_rank, t as u64, r as u64)?;
                let per_rank: Vec<u32> =
                    (0..r).map(|d| sp.tokens_for(d as u64).len() as u32).collect();
                for (d, (&a, &b)) in per_rank.iter().zip(&layout.num_tokens_per_rank).enumerate() {
                    if a as i64 != b as i64 {
                        return Err(Error::arg(
                            "layout",
                            format!(
                                "num_tokens_per_rank[{d}] = {b} but is_token_in_rank sends {a}"
                            ),
                        ));
                    }
                }
                let per_expert: Vec<u32> =
                    layout.num_tokens_per_expert.iter().map(|&c| c.max(0) as u32).collect();
                (sp, layout.is_token_in_rank.clone(), None, Some((per_rank, per_expert)))
            }
        };
        // ---- Notify (fresh only).
        let align = args.expert_alignment as u64;
        let worst = args.num_worst_tokens.map(|w| w as u64);
        let comm = self.comm()?;
        let recv_plan = match (recv_plan, fresh_records) {
            (Some(p), _) => p,
            (None, Some((per_rank, per_expert))) => {
                let seq = 0; // the engine stamps its own sequence number
                let records = (0..r as u64)
                    .map(|d| NotifyRecord::for_destination(d, seq, &per_rank, &per_expert))
                    .collect::<Result<Vec<_>>>()?;
                let res = comm.notify(records).and_then(|got| {
                    RecvPlan::new(cfg.rank, &got, cfg.normal_layout(), align, worst)
                });
                match res {
                    Ok(p) => p,
                    Err(e) => return Err(self.poison(e)),
                }
            }
            (None, None) => return Err(Error::Other("dispatch: no plan (bug)".into())),
        };
        // ---- Data.
        let me_rank = cfg.rank;
        let rows = recv_plan.num_out_rows as usize;
        let send_counts: Vec<u64> =
            (0..r).map(|d| send_plan.tokens_for(d as u64).len() as u64).collect();
        let recv_counts: Vec<u64> =
            (0..r).map(|s| recv_plan.rank_prefix[s + 1] - recv_plan.rank_prefix[s]).collect();
        let fp8 = cfg.dispatch_dtype == DispatchDtype::Fp8E4m3;
        let groups = h / FP8_GROUP as usize;
        // The row counts came from the peers' notify records: every output is allocated
        // fallibly, so a peer announcing 2^31 - 1 tokens is an error naming it, not an abort.
        let pre = &recv_plan.rank_prefix;
        let n_rows = recv_plan.num_out_rows;
        let alloc = (|| -> Result<_> {
            let (b, q, s) = if fp8 {
                (
                    Vec::new(),
                    announced_vec(me_rank, pre, n_rows, h, 0u8)?,
                    announced_vec(me_rank, pre, n_rows, groups, 0f32)?,
                )
            } else {
                (announced_vec(me_rank, pre, n_rows, h, 0u16)?, Vec::new(), Vec::new())
            };
            let (i, w) = if args.topk_idx.is_some() {
                (
                    announced_vec(me_rank, pre, n_rows, k, -1i64)?,
                    announced_vec(me_rank, pre, n_rows, k, 0f32)?,
                )
            } else {
                (Vec::new(), Vec::new())
            };
            let src = announced_vec(me_rank, pre, recv_plan.num_recv_tokens, 1, 0i32)?;
            Ok((b, q, s, i, w, src))
        })();
        let (mut out_bf16, mut out_fp8, mut out_scales, mut out_idx, mut out_w, mut src_idx) =
            match alloc {
                Ok(v) => v,
                Err(e) => return Err(self.poison(e)),
            };
        let with_topk = args.topk_idx.is_some();
        let n_recv = recv_plan.num_recv_tokens as usize;
        let rec = cfg.normal_layout().dispatch_record;
        let mut li = vec![-1i32; k];
        let mut lw = vec![0f32; k];
        let no_idx = vec![-1i32; k];
        let no_w = vec![0f32; k];
        let x = args.x;
        let (topk_idx, topk_w) = (args.topk_idx, args.topk_weights);
        let prefix = recv_plan.rank_prefix.clone();
        let me = cfg.rank;
        let write_row = |dst: usize, i: u64, out: &mut [u8]| -> Result<()> {
            let tok = send_plan.tokens_for(dst as u64)[i as usize] as usize;
            let (payload, scales): (&[u8], &[f32]) = match x {
                Tokens::Bf16(v) => (bytemuck::cast_slice(&v[tok * h..(tok + 1) * h]), &[]),
                Tokens::Fp8 { x, scales } => {
                    (&x[tok * h..(tok + 1) * h], &scales[tok * groups..(tok + 1) * groups])
                }
            };
            let (ti, tw): (&[i32], &[f32]) = match (topk_idx, topk_w) {
                (Some(idx), Some(w)) => {
                    plan::to_local_topk(
                        &idx[tok * k..(tok + 1) * k],
                        &w[tok * k..(tok + 1) * k],
                        dst as u64,
                        l as u64,
                        &mut li,
                        &mut lw,
                    )?;
                    (&li, &lw)
                }
                _ => (&no_idx, &no_w),
            };
            rec.write(
                out,
                &RecordFields {
                    payload,
                    scales,
                    topk_idx: ti,
                    topk_weights: tw,
                    src_idx: tok as i32,
                },
            )
        };
        let read_row = |src: usize, i: u64, bytes: &[u8]| -> Result<()> {
            let o = (prefix[src] + i) as usize;
            let v = rec.read(bytes)?;
            if fp8 {
                out_fp8[o * h..(o + 1) * h].copy_from_slice(v.payload());
                for g in 0..groups {
                    out_scales[o * groups + g] = v.scale(g as u64).unwrap_or(0.0);
                }
            } else {
                let dst: &mut [u8] = bytemuck::cast_slice_mut(&mut out_bf16[o * h..(o + 1) * h]);
                dst.copy_from_slice(v.payload());
            }
            if with_topk {
                for j in 0..k {
                    let e = v.topk_idx(j as u64).unwrap_or(-1);
                    if e < -1 || e >= l as i32 {
                        return Err(Error::Protocol {
                            rank: me,
                            peer: src,
                            phase: "dispatch",
                            msg: format!("row {i}: local expert {e} not in -1..{l}"),
                        });
                    }
                    out_idx[o * k + j] = e as i64;
                    out_w[o * k + j] = v.topk_weight(j as u64).unwrap_or(0.0);
                }
            }
            let s = v.src_idx().unwrap_or(-1);
            if s < 0 {
                return Err(Error::Protocol {
                    rank: me,
                    peer: src,
                    phase: "dispatch",
                    msg: format!("row {i}: negative source index {s}"),
                });
            }
            src_idx[o] = s;
            Ok(())
        };
        let counts = StepCounts { send: &send_counts, recv: &recv_counts };
        if let Err(e) = comm.step(Phase::Dispatch, &counts, write_row, read_row) {
            return Err(self.poison(e));
        }
        let per_expert: Vec<usize> =
            recv_plan.tokens_per_local_expert.iter().map(|&c| c as usize).collect();
        let handle = DispatchHandle {
            buffer_id: self.id,
            num_tokens: t,
            send_plan,
            is_token_in_rank,
            rank_prefix: recv_plan.rank_prefix,
            num_out_rows: rows,
            recv_src_idx: src_idx,
            num_recv_tokens_per_expert: per_expert.clone(),
        };
        Ok(DispatchOutput {
            recv_x: if fp8 {
                OwnedTokens::Fp8 { x: out_fp8, scales: out_scales }
            } else {
                OwnedTokens::Bf16(out_bf16)
            },
            recv_topk_idx: out_idx,
            recv_topk_weights: out_w,
            num_recv_tokens_per_expert: per_expert,
            num_recv_tokens: n_recv,
            handle,
        })
    }

    /// Normal combine (DeepEP V1): every rank returns its rows of `x` to the ranks they came
    /// from; per original token the fp32 sum over the ranks it went to, in bf16. Collective.
    pub fn combine(&mut self, args: &CombineArgs<'_>) -> Result<CombineOutput> {
        let r = self.combine_unreported(args);
        self.reported(r)
    }

    // Index loops over ranks read closest to the reference's summation order.
    #[allow(clippy::needless_range_loop)]
    fn combine_unreported(&mut self, args: &CombineArgs<'_>) -> Result<CombineOutput> {
        let cfg = self.cfg.clone();
        let (r, k, h) = (cfg.num_ranks, cfg.num_topk, cfg.hidden);
        let hd = args.handle;
        if hd.buffer_id != self.id {
            return Err(Error::arg("handle", "made by another Buffer"));
        }
        let n_recv = hd.num_recv_tokens();
        if args.x.len() % h != 0
            || (args.x.len() / h != n_recv && args.x.len() / h != hd.num_out_rows)
        {
            return Err(Error::arg(
                "x",
                format!(
                    "length {}, expected [{n_recv} or {}, hidden {h}] bf16",
                    args.x.len(),
                    hd.num_out_rows
                ),
            ));
        }
        let rows_in = args.x.len() / h;
        if let Some(w) = args.topk_weights {
            if w.len() != rows_in * k {
                return Err(Error::arg(
                    "topk_weights",
                    format!("length {}, expected {rows_in} * {k}", w.len()),
                ));
            }
        }
        let send_counts: Vec<u64> = (0..r).map(|s| hd.recv_count(s)).collect();
        let recv_counts: Vec<u64> =
            (0..r).map(|d| hd.send_plan.tokens_for(d as u64).len() as u64).collect();
        let total: usize = recv_counts.iter().map(|&c| c as usize).sum();
        // Rows as they come back, `[sum over d of tokens sent to d, H]`, reduced afterwards in
        // destination order so the fp32 sum has one fixed order (the reference's).
        let mut back = vec![0u16; total * h];
        let with_w = args.topk_weights.is_some();
        let mut back_w = vec![0f32; if with_w { total * k } else { 0 }];
        let rec = cfg.normal_layout().combine_record;
        let zeros = vec![0f32; k];
        let (x, wts) = (args.x, args.topk_weights);
        let prefix = &hd.rank_prefix;
        let dst_offsets = &hd.send_plan.dst_offsets;
        let write_row = |dst: usize, i: u64, out: &mut [u8]| -> Result<()> {
            let o = (prefix[dst] + i) as usize;
            let w: &[f32] = match wts {
                Some(w) => &w[o * k..(o + 1) * k],
                None => &zeros,
            };
            rec.write(
                out,
                &RecordFields {
                    payload: bytemuck::cast_slice(&x[o * h..(o + 1) * h]),
                    scales: &[],
                    topk_idx: &[],
                    topk_weights: w,
                    src_idx: 0,
                },
            )
        };
        let read_row = |src: usize, i: u64, bytes: &[u8]| -> Result<()> {
            let o = (dst_offsets[src] + i) as usize;
            let v = rec.read(bytes)?;
            let dst: &mut [u8] = bytemuck::cast_slice_mut(&mut back[o * h..(o + 1) * h]);
            dst.copy_from_slice(v.payload());
            if with_w {
                for j in 0..k {
                    back_w[o * k + j] = v.topk_weight(j as u64).unwrap_or(0.0);
                }
            }
            Ok(())
        };
        let counts = StepCounts { send: &send_counts, recv: &recv_counts };
        let comm = self.comm()?;
        if let Err(e) = comm.step(Phase::Combine, &counts, write_row, read_row) {
            return Err(self.poison(e));
        }
        let t = hd.num_tokens;
        let mut acc = vec![0f32; t * h];
        let mut acc_w = vec![0f32; if with_w { t * k } else { 0 }];
        for d in 0..r {
            let toks = hd.send_plan.tokens_for(d as u64);
            let base = dst_offsets[d] as usize;
            for (i, &tok) in toks.iter().enumerate() {
                let tok = tok as usize;
                let row = &back[(base + i) * h..(base + i + 1) * h];
                for (a, &b) in acc[tok * h..(tok + 1) * h].iter_mut().zip(row) {
                    *a += bf16_to_f32(b);
                }
                if with_w {
                    let wr = &back_w[(base + i) * k..(base + i + 1) * k];
                    for (a, &b) in acc_w[tok * k..(tok + 1) * k].iter_mut().zip(wr) {
                        *a += b;
                    }
                }
            }
        }
        Ok(CombineOutput {
            combined_x: acc.into_iter().map(f32_to_bf16).collect(),
            combined_topk_weights: with_w.then_some(acc_w),
        })
    }

    /// A call's result as returned: a timeout on peers is first reported to the bootstrap
    /// ([`Bootstrap::report_unresponsive`]), so the other ranks' waits end naming the stalled
    /// rank rather than this one when it leaves. The report returns once the relay answered,
    /// after the reports of the ranks it names: if one of them was itself waiting on a stopped
    /// rank, the error names that rank ([`Error::with_upstream`]).
    pub(crate) fn reported<T>(&self, r: Result<T>) -> Result<T> {
        r.map_err(|e| {
            let peers = e.unresponsive_peers();
            if peers.is_empty() {
                return e;
            }
            self.boot.report_unresponsive(&peers);
            e.with_upstream(self.boot.rank(), &self.boot.dead_peers())
        })
    }

    /// Marks the buffer unusable after a failure mid-protocol (peers' writes may still be in
    /// flight, counters are out of step) and returns the error.
    fn poison(&mut self, e: Error) -> Error {
        self.poisoned = Some(e.to_string());
        e
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // NOTES: no barrier here (a dropped buffer may be unwinding from a dead peer); every
        // call already waited for its own writes to complete, so stopping is bounded.
        self.teardown();
    }
}

fn check_layout(l: &Layout, t: usize, r: usize, e: usize) -> Result<()> {
    let want = [
        ("num_tokens_per_rank", l.num_tokens_per_rank.len(), r),
        ("num_tokens_per_expert", l.num_tokens_per_expert.len(), e),
        ("is_token_in_rank", l.is_token_in_rank.len(), t * r),
    ];
    for (what, got, exp) in want {
        if got != exp {
            return Err(Error::arg(
                "layout",
                format!("{what} has length {got}, expected {exp} for {t} tokens"),
            ));
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Low-latency mode
// ---------------------------------------------------------------------------------------------

/// Arguments of a low-latency dispatch (DeepEP V1 `low_latency_dispatch`). Shapes: `T` = tokens
/// on this rank (`<= max_tokens_per_rank`, may differ per rank), `H` = hidden, `K` = top-k.
#[derive(Clone, Copy, Debug)]
pub struct LlDispatchArgs<'a> {
    /// `x [T, H]` bf16 bits.
    pub x: &'a [u16],
    /// `[T, K]` global expert ids, -1 = none, an expert at most once per token.
    pub topk_idx: &'a [i64],
    /// Cast to e4m3 with one f32 scale per 128 channels (needs `H % 128 == 0`).
    pub use_fp8: bool,
    /// Power-of-two fp8 scales (DeepEP's `round_scale`).
    pub round_scale: bool,
    /// Return once the sends are issued; [`LlDispatchHook::complete`] does the receive.
    pub return_recv_hook: bool,
}

/// Result of a low-latency dispatch. `S = num_ranks * max_tokens_per_rank`, `L` local experts.
/// For local expert `e`, rows from source rank 0 come first, then rank 1, ..., each source's
/// rows in its token order; rows past `recv_count[e]` are zero (-1 in the source info).
#[derive(Clone, Debug, PartialEq)]
pub struct LlDispatchOutput {
    /// `[L, S, H]` bf16, or e4m3 `[L, S, H]` plus `scales [L, S, H / 128]`.
    pub recv_x: OwnedTokens,
    /// `[L]` rows received per local expert.
    pub recv_count: Vec<u32>,
    /// `[L, S]` source rank of each row.
    pub recv_src_rank: Vec<i32>,
    /// `[L, S]` token index on the source of each row.
    pub recv_src_idx: Vec<i32>,
    /// `[L, R]` `(begin, count)` of each source's rows within `recv_x[e]`.
    pub layout_range: Vec<(u32, u32)>,
    /// `[R]` nanoseconds the receive waited for each source rank's messages, summed over its
    /// `L` messages (from the start of the wait until each was seen; DeepEP's
    /// `dispatch_wait_recv_cost_stats`). A masked rank's: the time until it was masked, else 0.
    pub recv_wait_ns: Vec<u64>,
    pub handle: LlHandle,
}

/// A low-latency dispatch whose receive is still to be done (`return_recv_hook`).
#[must_use = "complete the hook: the buffer set stays reserved until then"]
#[derive(Debug)]
pub struct LlDispatchHook {
    buffer_id: u64,
    generation: u64,
    call: u64,
    set: u64,
    use_fp8: bool,
    handle: LlHandle,
}

impl LlDispatchHook {
    /// Completes the receive (bounded wait for every rank's messages) and returns the result,
    /// equal to what the same dispatch without a hook returns.
    pub fn complete(self, buf: &mut Buffer) -> Result<LlDispatchOutput> {
        buf.ll_take_pending(self.buffer_id, self.generation, self.set, self.call)?;
        let r = buf.ll_dispatch_recv(self.set, self.use_fp8, self.handle);
        buf.reported(r)
    }
}

/// What [`Buffer::low_latency_dispatch`] returns: the result, or a hook that completes it.
#[derive(Debug)]
pub enum LlDispatchOutcome {
    Received(LlDispatchOutput),
    Hook(LlDispatchHook),
}

impl LlDispatchOutcome {
    /// The result, completing the hook first if there is one.
    pub fn complete(self, buf: &mut Buffer) -> Result<LlDispatchOutput> {
        match self {
            LlDispatchOutcome::Received(o) => Ok(o),
            LlDispatchOutcome::Hook(h) => h.complete(buf),
        }
    }
}

/// Arguments of a low-latency combine (DeepEP V1 `low_latency_combine`).
#[derive(Clone, Copy, Debug)]
pub struct LlCombineArgs<'a> {
    /// `[L, S, H]` bf16 expert outputs, rows as the dispatch delivered them (rows past the
    /// counts are ignored).
    pub x: &'a [u16],
    /// `[T, K]` the ids passed to the dispatch; an entry may be -1 where the dispatch had an
    /// expert (that expert's answer is then left out of the sum).
    pub topk_idx: &'a [i64],
    /// `[T, K]` weights.
    pub topk_weights: &'a [f32],
    pub handle: &'a LlHandle,
    /// Return once the sends are issued; [`LlCombineHook::complete`] does the receive.
    pub return_recv_hook: bool,
}

/// Result of a low-latency combine.
#[derive(Clone, Debug, PartialEq)]
pub struct LlCombineOutput {
    /// `[T, H]` bf16: per token, `acc = fma(y_k, w_k, acc)` over its non-masked experts in `k`
    /// order, fp32, rounded once (bit-identical to `reference::ll_combine`). In shrink mode an
    /// expert of a masked rank counts as masked (`-1`).
    pub combined_x: Vec<u16>,
    /// `[R]` nanoseconds the receive waited for each rank's messages, as
    /// [`LlDispatchOutput::recv_wait_ns`] (DeepEP's `combine_wait_recv_cost_stats`).
    pub recv_wait_ns: Vec<u64>,
}

/// A low-latency combine whose receive is still to be done (`return_recv_hook`).
#[must_use = "complete the hook: the buffer set stays reserved until then"]
#[derive(Debug)]
pub struct LlCombineHook {
    buffer_id: u64,
    generation: u64,
    call: u64,
    set: u64,
    num_tokens: usize,
    topk_idx: Vec<i64>,
    topk_weights: Vec<f32>,
    pos: Vec<i32>,
    count_per_expert: Vec<u32>,
}

impl LlCombineHook {
    /// Completes the receive and the weighted sum.
    pub fn complete(self, buf: &mut Buffer) -> Result<LlCombineOutput> {
        buf.ll_take_pending(self.buffer_id, self.generation, self.set, self.call)?;
        let r = buf.ll_combine_recv(&self);
        buf.reported(r)
    }
}

/// What [`Buffer::low_latency_combine`] returns: the result, or a hook that completes it.
#[derive(Debug)]
pub enum LlCombineOutcome {
    Received(LlCombineOutput),
    Hook(LlCombineHook),
}

impl LlCombineOutcome {
    /// The result, completing the hook first if there is one.
    pub fn complete(self, buf: &mut Buffer) -> Result<LlCombineOutput> {
        match self {
            LlCombineOutcome::Received(o) => Ok(o),
            LlCombineOutcome::Hook(h) => h.complete(buf),
        }
    }
}

fn ll_layout_bf16(cfg: &EpConfig) -> Result<LlLayout> {
    // NOTES: the LL buffer is sized for bf16 dispatch records whatever the config's dtype: they
    // are the largest record, so an fp8 dispatch (chosen per call, `use_fp8`) fits the same units.
    LlLayout::from_parts(
        cfg.num_ranks as u64,
        cfg.num_experts as u64,
        cfg.hidden as u64,
        DispatchDtype::Bf16,
        cfg.max_tokens_per_rank as u64,
    )
}

impl Buffer {
    /// A loopback group for the low-latency lane of `num_ranks` in-process ranks (pass it with
    /// [`BufferOptions::with_ll_loopback`]).
    pub fn ll_loopback_group(cfg: &EpConfig, opts: LoopbackOptions) -> Result<LoopbackGroup> {
        let bytes = LlGeometry::new(ll_layout_bf16(cfg)?, LOOPBACK_STRIDE)?.bytes as usize;
        Ok(LoopbackGroup::host(cfg.num_ranks as u32, bytes, bytes, opts)?)
    }

    /// DeepEP's `get_low_latency_rdma_size_hint`: bytes of the LL buffer one rank registers
    /// (both sets; fixed by max_tokens_per_rank, hidden, ranks and experts).
    pub fn low_latency_buffer_bytes(cfg: &EpConfig) -> Result<u64> {
        Ok(ll_layout_bf16(cfg)?.total_bytes())
    }

    /// Connects the LL lane (collective; the first LL call of every rank does it).
    fn ll_connect(&mut self) -> Result<LlLane> {
        if self.gpu.is_some() {
            return Err(Error::arg("backend", "a GPU buffer: use the calls of Buffer::gpu"));
        }
        let cfg = &self.cfg;
        let (rank, r) = (cfg.rank, cfg.num_ranks);
        let layout = ll_layout_bf16(cfg)?;
        let timeout = self.opts.timeout.unwrap_or(cfg.timeout);
        let rings = RingMemory::new_host(RingLayout::new(1, self.opts.ring_capacity)?)?;
        let counters = CounterMemory::new_host(CounterLayout {
            num_slots: LlComm::num_slots(&layout)?,
            num_rings: 1,
        })?;
        let pcfg = ProxyConfig {
            rank: rank as u32,
            value_bits: plan::IMM_VALUE_BITS,
            idle_sleep_max: HOST_IDLE_SLEEP_MAX,
            ..ProxyConfig::default()
        };
        let (geo, send, recv, proxy, fabric) = match &self.opts.transport {
            TransportKind::Loopback(_) => {
                let group = self.opts.ll_loopback.clone().ok_or_else(|| {
                    Error::arg(
                        "transport",
                        "low-latency mode over loopback needs BufferOptions::with_ll_loopback(\
                         Buffer::ll_loopback_group(..))",
                    )
                })?;
                let geo = LlGeometry::new(layout, LOOPBACK_STRIDE)?;
                if group.num_ranks() as usize != r {
                    return Err(Error::arg(
                        "ll_loopback",
                        format!("group of {} ranks, config has {r}", group.num_ranks()),
                    ));
                }
                let send = group.send_region(rank as u32)?.clone();
                let recv = group.recv_region(rank as u32)?.clone();
                if (send.len() as u64) < geo.bytes || (recv.len() as u64) < geo.bytes {
                    return Err(Error::arg(
                        "ll_loopback",
                        format!(
                            "regions of {} bytes, the LL buffer needs {} \
                             (build it with Buffer::ll_loopback_group)",
                            send.len().min(recv.len()),
                            geo.bytes
                        ),
                    ));
                }
                self.boot.barrier()?;
                let transport = group.transport(rank as u32)?;
                let proxy = Proxy::start(pcfg, rings.clone(), counters, vec![transport])?;
                (geo, send, recv, proxy, None)
            }
            TransportKind::Fabric => {
                let place = Placement {
                    rank: Some(rank),
                    local_rank: rank % cfg.ranks_per_node.max(1),
                    ..Placement::default()
                };
                let stack =
                    Stack::open_placed(&InfoQuery::provider(&self.opts.provider), r, &place)?;
                let stride = stack.info.max_region_bytes().max(4096) as u64;
                let geo = LlGeometry::new(layout, stride)?;
                // One region holds send and receive areas; the NIC reads and writes disjoint
                // units of it (LlLayout's areas).
                let mem = Arc::new(SharedRegion::alloc_host(geo.bytes as usize)?);
                // SAFETY: the region is kept alive by `LlLane::_mem`, which drops after the
                // proxy (whose transport posts writes naming it) and after the registration.
                let mr =
                    Arc::new(unsafe { stack.register(mem.as_ptr(), mem.len(), MemKind::Host)? });
                let peers = super::connect::exchange_fabric(
                    &*self.boot,
                    &stack,
                    &mr.remote(),
                    &[],
                    geo.bytes,
                )?
                .into_proxy_peers();
                let transport =
                    FabricTransport::new(rank as u32, stack.ep.clone(), mr.clone(), peers)?;
                let proxy = Proxy::start(pcfg, rings.clone(), counters, vec![transport])?;
                (geo, mem.clone(), mem, proxy, Some(LlFabricHold { _mr: mr, _stack: stack }))
            }
        };
        // Every rank's LL proxy runs and every LL region is registered before anyone writes.
        self.boot.barrier()?;
        let producer = rings.producer(0)?;
        let shrink = self.opts.ll_shrink;
        if !shrink {
            // NOTES: in shrink mode the lane's own waits ask the bootstrap about the peers they
            // wait for (a dead rank is masked); a proxy watch would fail every later wait.
            proxy.watch_peers(peer_watch(&self.boot));
        }
        let mut mask = self.ll_mask.clone();
        mask.resize(r, false);
        let comm = LlComm::new(
            rank,
            geo,
            timeout,
            producer,
            proxy,
            send.clone(),
            recv.clone(),
            shrink,
            mask,
        );
        Ok(LlLane { comm, _fabric: fabric, _mem: (send, recv) })
    }

    /// The LL engine, connecting it on first use; refused after a failed LL call until
    /// [`Buffer::clean_low_latency_buffer`].
    fn ll_comm(&mut self) -> Result<&mut LlComm> {
        if self.comm.is_none() {
            return Err(Error::Other("buffer destroyed".into()));
        }
        if self.ll.is_none() {
            let lane = self.ll_connect()?;
            self.ll = Some(lane);
        }
        let rank = self.cfg.rank;
        let comm = &mut self.ll.as_mut().ok_or_else(|| Error::Other("no LL lane".into()))?.comm;
        if let Some(why) = &comm.broken {
            return Err(Error::Other(format!(
                "rank {rank}: low-latency buffer unusable after an earlier failure ({why}); \
                 call clean_low_latency_buffer on every rank"
            )));
        }
        Ok(comm)
    }

    fn ll_fail(&mut self, e: Error) -> Error {
        if let Some(lane) = self.ll.as_mut() {
            lane.comm.broken = Some(e.to_string());
        }
        e
    }

    /// Checks a hook belongs here and is the outstanding receive of its set; clears it.
    fn ll_take_pending(&mut self, id: u64, generation: u64, set: u64, call: u64) -> Result<()> {
        if id != self.id {
            return Err(Error::arg("hook", "made by another Buffer"));
        }
        let comm = self.ll_comm()?;
        if generation != comm.generation {
            return Err(Error::arg("hook", "made before clean_low_latency_buffer; it is void"));
        }
        if comm.pending[set as usize] != Some(call) {
            return Err(Error::arg("hook", "already completed"));
        }
        comm.pending[set as usize] = None;
        Ok(())
    }

    /// Reserves the buffer set of the next LL call; returns `(call, set)`.
    fn ll_begin(&mut self) -> Result<(u64, u64)> {
        let comm = self.ll_comm()?;
        let call = comm.calls;
        let set = call % plan::LL_NUM_SETS;
        if let Some(prev) = comm.pending[set as usize] {
            return Err(Error::arg(
                "hook",
                format!(
                    "the hook of low-latency call {prev} (buffer set {set}) is not completed; \
                     complete it before the call after next"
                ),
            ));
        }
        Ok((call, set))
    }

    /// Low-latency dispatch (DeepEP V1): one RMA write per (destination rank, destination
    /// local expert) carrying all its rows, the row count in the immediate (an empty write
    /// when it is 0). Collective: every rank calls it (with its own token count, the same
    /// `use_fp8`). Arguments are checked before anything is sent ([`Error::InvalidArgument`]
    /// naming the argument). Without `return_recv_hook` the receive completes before it
    /// returns (bounded; a peer that never sends is named in [`Error::Timeout`]).
    ///
    /// Calls alternate between two buffer sets (dispatch and combine alike), so the outputs of
    /// two calls may be alive at once. Contract (DeepEP's): a hook must be completed before
    /// this rank's call after next, and every rank must complete call N's receive before any
    /// rank starts call N + 2; violations are reported (`hook` argument, or
    /// [`Error::Protocol`] naming the peer that overran the set) where they can be seen.
    pub fn low_latency_dispatch(&mut self, args: &LlDispatchArgs<'_>) -> Result<LlDispatchOutcome> {
        let r = self.low_latency_dispatch_unreported(args);
        self.reported(r)
    }

    fn low_latency_dispatch_unreported(
        &mut self,
        args: &LlDispatchArgs<'_>,
    ) -> Result<LlDispatchOutcome> {
        let cfg = self.cfg.clone();
        let (h, k, m) = (cfg.hidden, cfg.num_topk, cfg.max_tokens_per_rank);
        if args.x.len() % h != 0 {
            return Err(Error::arg(
                "x",
                format!(
                    "length {} is not a multiple of hidden {h} ([tokens, hidden])",
                    args.x.len()
                ),
            ));
        }
        let t = args.x.len() / h;
        if t > m {
            return Err(Error::arg("x", format!("{t} tokens, more than max_tokens_per_rank {m}")));
        }
        if args.use_fp8 && h % FP8_GROUP as usize != 0 {
            return Err(Error::arg(
                "hidden",
                format!("{h} is not a multiple of 128, as fp8 needs"),
            ));
        }
        let layout = ll_layout_bf16(&cfg)?;
        let plan = LlSendPlan::new(args.topk_idx, t as u64, k as u64, &layout)?;
        let (call, set) = self.ll_begin()?;
        let me = cfg.rank;
        let boot = self.boot.clone();
        let dead = |p: usize| boot.is_dead(p);
        let res = (|| -> Result<()> {
            let comm = self.ll_comm()?;
            comm.wait_set_free(LlPhase::Dispatch, set, &dead)?;
            let rec = RecordLayout::ll_dispatch(h as u64, dtype_of(args.use_fp8))?;
            let rb = rec.bytes as usize;
            let groups = h / FP8_GROUP as usize;
            let (mut q, mut sc) = (vec![0u8; h], vec![0f32; groups]);
            let geo = comm.geo;
            for tok in 0..t {
                let row = &args.x[tok * h..(tok + 1) * h];
                let (payload, scales): (&[u8], &[f32]) = if args.use_fp8 {
                    quantize_row_bf16(row, args.round_scale, &mut q, &mut sc)?;
                    (&q, &sc)
                } else {
                    (bytemuck::cast_slice(row), &[])
                };
                for j in 0..k {
                    let g = args.topk_idx[tok * k + j];
                    if g < 0 {
                        continue;
                    }
                    let p = plan.pos[tok * k + j] as usize;
                    let off = geo.offset(set, LlArea::Send, g as u64)? + (p * rb) as u64;
                    // SAFETY: staging of set `set` is this thread's; its previous writes (call
                    // - 2) completed in that call's receive, which ll_begin saw finished.
                    let out = unsafe { comm.staging(off, rb)? };
                    let f = RecordFields {
                        payload,
                        scales,
                        topk_idx: &[],
                        topk_weights: &[],
                        src_idx: tok as i32,
                    };
                    rec.write(out, &f)?;
                }
            }
            let (e_count, l, r) = (cfg.num_experts, cfg.num_local_experts(), cfg.num_ranks);
            // Destinations rotated from this rank, so ranks do not all start on rank 0.
            for i in 0..e_count {
                let g = (me * l + i) % e_count;
                let (dst, e) = (g / l, g % l);
                let count = plan.count_per_expert[g] as u64;
                let imm = layout.imm.dispatch(set, e as u64, me as u64, count)?;
                comm.push(
                    LlPhase::Dispatch,
                    set,
                    g as u64,
                    dst,
                    geo.offset(set, LlArea::Send, g as u64)?,
                    geo.offset(set, LlArea::Recv, (e * r + me) as u64)?,
                    count * rec.bytes,
                    imm,
                )?;
            }
            comm.publish();
            comm.calls += 1;
            comm.pending[set as usize] = Some(call);
            Ok(())
        })();
        if let Err(e) = res {
            return Err(self.ll_fail(e));
        }
        let generation = self.ll.as_ref().map_or(0, |lane| lane.comm.generation);
        let handle = LlHandle {
            buffer_id: self.id,
            generation,
            num_tokens: t,
            topk_idx: args.topk_idx.to_vec(),
            pos: plan.pos,
            count_per_expert: plan.count_per_expert,
            recv: LlRecvLayout {
                count: Vec::new(),
                begin: Vec::new(),
                count_per_expert: Vec::new(),
            },
        };
        let hook = LlDispatchHook {
            buffer_id: self.id,
            generation,
            call,
            set,
            use_fp8: args.use_fp8,
            handle,
        };
        if args.return_recv_hook {
            Ok(LlDispatchOutcome::Hook(hook))
        } else {
            Ok(LlDispatchOutcome::Received(hook.complete(self)?))
        }
    }

    fn ll_dispatch_recv(
        &mut self,
        set: u64,
        use_fp8: bool,
        mut handle: LlHandle,
    ) -> Result<LlDispatchOutput> {
        let res = self.ll_dispatch_recv_inner(set, use_fp8, &mut handle);
        match res {
            Ok((recv_x, src_rank, src_idx, recv_wait_ns)) => {
                let r = self.cfg.num_ranks;
                let l = self.cfg.num_local_experts();
                let mut layout_range = Vec::with_capacity(l * r);
                for e in 0..l {
                    for s in 0..r {
                        layout_range.push(handle.recv.range(e, s, r).unwrap_or((0, 0)));
                    }
                }
                Ok(LlDispatchOutput {
                    recv_x,
                    recv_count: handle.recv.count_per_expert.clone(),
                    recv_src_rank: src_rank,
                    recv_src_idx: src_idx,
                    layout_range,
                    recv_wait_ns,
                    handle,
                })
            }
            Err(e) => Err(self.ll_fail(e)),
        }
    }

    #[allow(clippy::type_complexity)]
    fn ll_dispatch_recv_inner(
        &mut self,
        set: u64,
        use_fp8: bool,
        handle: &mut LlHandle,
    ) -> Result<(OwnedTokens, Vec<i32>, Vec<i32>, Vec<u64>)> {
        let cfg = self.cfg.clone();
        let (h, m, r, l) =
            (cfg.hidden, cfg.max_tokens_per_rank, cfg.num_ranks, cfg.num_local_experts());
        let s_rows = r * m;
        let groups = h / FP8_GROUP as usize;
        let layout = ll_layout_bf16(&cfg)?;
        let rec = RecordLayout::ll_dispatch(h as u64, dtype_of(use_fp8))?;
        let rb = rec.bytes as usize;
        let boot = self.boot.clone();
        let comm = self.ll_comm()?;
        let mut wait_ns = vec![0u64; r];
        let counts =
            comm.wait_counts(LlPhase::Dispatch, set, &mut wait_ns, &|p| boot.is_dead(p))?;
        let recv = LlRecvLayout::new(cfg.rank, &counts, &layout)?;
        let (mut xb, mut xq, mut xs) = if use_fp8 {
            (Vec::new(), vec![0u8; l * s_rows * h], vec![0f32; l * s_rows * groups])
        } else {
            (vec![0u16; l * s_rows * h], Vec::new(), Vec::new())
        };
        let mut src_rank = vec![-1i32; l * s_rows];
        let mut src_idx = vec![-1i32; l * s_rows];
        for e in 0..l {
            for src in 0..r {
                let (begin, count) = recv.range(e, src, r).unwrap_or((0, 0));
                if count == 0 {
                    continue;
                }
                let off = comm.geo.offset(set, LlArea::Recv, (e * r + src) as u64)?;
                // SAFETY: the block arrived (its counter was read with Acquire in wait_counts)
                // and src writes it again only in its call two later (the set contract).
                let block = unsafe { comm.received(off, count as usize * rb)? };
                for (i, bytes) in block.chunks_exact(rb).enumerate() {
                    let v = rec.read(bytes)?;
                    let s_i = v.src_idx().unwrap_or(-1);
                    if s_i < 0 || s_i as usize >= m {
                        return Err(Error::Protocol {
                            rank: cfg.rank,
                            peer: src,
                            phase: LlPhase::Dispatch.name(),
                            msg: format!("row {i} of local expert {e}: source index {s_i}"),
                        });
                    }
                    let o = e * s_rows + begin as usize + i;
                    if use_fp8 {
                        xq[o * h..(o + 1) * h].copy_from_slice(v.payload());
                        for gi in 0..groups {
                            xs[o * groups + gi] = v.scale(gi as u64).unwrap_or(0.0);
                        }
                    } else {
                        let dst: &mut [u8] = bytemuck::cast_slice_mut(&mut xb[o * h..(o + 1) * h]);
                        dst.copy_from_slice(v.payload());
                    }
                    src_rank[o] = src as i32;
                    src_idx[o] = s_i;
                }
            }
        }
        comm.finish_recv(LlPhase::Dispatch, set)?;
        handle.recv = recv;
        let recv_x =
            if use_fp8 { OwnedTokens::Fp8 { x: xq, scales: xs } } else { OwnedTokens::Bf16(xb) };
        Ok((recv_x, src_rank, src_idx, wait_ns))
    }

    /// Low-latency combine (DeepEP V1): every expert rank returns its rows to the ranks they
    /// came from, one write per (source rank, local expert); each rank sums per token
    /// `w_k * y_k` over its top-k in `k` order (fp32, fma), rounded to bf16 once. Collective.
    /// Same hook and buffer-set contract as [`Buffer::low_latency_dispatch`].
    pub fn low_latency_combine(&mut self, args: &LlCombineArgs<'_>) -> Result<LlCombineOutcome> {
        let r = self.low_latency_combine_unreported(args);
        self.reported(r)
    }

    fn low_latency_combine_unreported(
        &mut self,
        args: &LlCombineArgs<'_>,
    ) -> Result<LlCombineOutcome> {
        let cfg = self.cfg.clone();
        let (h, k, m, r, l) = (
            cfg.hidden,
            cfg.num_topk,
            cfg.max_tokens_per_rank,
            cfg.num_ranks,
            cfg.num_local_experts(),
        );
        let hd = args.handle;
        if hd.buffer_id != self.id {
            return Err(Error::arg("handle", "made by another Buffer"));
        }
        let generation = self.ll.as_ref().map_or(0, |lane| lane.comm.generation);
        if hd.generation != generation {
            return Err(Error::arg("handle", "made before clean_low_latency_buffer; it is void"));
        }
        if hd.recv.count.len() != l * r {
            return Err(Error::arg("handle", "its dispatch was not completed (complete the hook)"));
        }
        let s_rows = r * m;
        if args.x.len() != l * s_rows * h {
            return Err(Error::arg(
                "x",
                format!("length {}, expected [{l}, {s_rows}, {h}] bf16", args.x.len()),
            ));
        }
        let t = hd.num_tokens;
        if args.topk_idx.len() != t * k {
            return Err(Error::arg(
                "topk_idx",
                format!("length {}, expected {t} * {k}", args.topk_idx.len()),
            ));
        }
        for (i, (&a, &b)) in args.topk_idx.iter().zip(&hd.topk_idx).enumerate() {
            if a != b && a != -1 {
                return Err(Error::arg(
                    "topk_idx",
                    format!("token {}, k {}: expert {a}, the dispatch had {b}", i / k, i % k),
                ));
            }
        }
        if args.topk_weights.len() != t * k {
            return Err(Error::arg(
                "topk_weights",
                format!("length {}, expected {t} * {k}", args.topk_weights.len()),
            ));
        }
        let layout = ll_layout_bf16(&cfg)?;
        let (call, set) = self.ll_begin()?;
        let me = cfg.rank;
        let boot = self.boot.clone();
        let dead = |p: usize| boot.is_dead(p);
        let res = (|| -> Result<()> {
            let comm = self.ll_comm()?;
            comm.wait_set_free(LlPhase::Combine, set, &dead)?;
            let rec = layout.combine_record;
            let rb = rec.bytes as usize;
            let geo = comm.geo;
            for e in 0..l {
                for j in 0..r {
                    let dst = (me + j) % r;
                    let (begin, count) = hd.recv.range(e, dst, r).unwrap_or((0, 0));
                    let unit = (e * r + dst) as u64;
                    let local = geo.offset(set, LlArea::Send, unit)?;
                    if count > 0 {
                        // SAFETY: as in dispatch: this thread's staging, free since call - 2.
                        let out = unsafe { comm.staging(local, count as usize * rb)? };
                        for (i, o) in out.chunks_exact_mut(rb).enumerate() {
                            let row = e * s_rows + begin as usize + i;
                            let f = RecordFields {
                                payload: bytemuck::cast_slice(&args.x[row * h..(row + 1) * h]),
                                scales: &[],
                                topk_idx: &[],
                                topk_weights: &[],
                                src_idx: 0,
                            };
                            rec.write(o, &f)?;
                        }
                    }
                    let imm = layout.imm.combine(set, me as u64, e as u64, count as u64)?;
                    comm.push(
                        LlPhase::Combine,
                        set,
                        unit,
                        dst,
                        local,
                        geo.offset(set, LlArea::Recv, (me * l + e) as u64)?,
                        count as u64 * rec.bytes,
                        imm,
                    )?;
                }
            }
            comm.publish();
            comm.calls += 1;
            comm.pending[set as usize] = Some(call);
            Ok(())
        })();
        if let Err(e) = res {
            return Err(self.ll_fail(e));
        }
        let hook = LlCombineHook {
            buffer_id: self.id,
            generation,
            call,
            set,
            num_tokens: t,
            topk_idx: args.topk_idx.to_vec(),
            topk_weights: args.topk_weights.to_vec(),
            pos: hd.pos.clone(),
            count_per_expert: hd.count_per_expert.clone(),
        };
        if args.return_recv_hook {
            Ok(LlCombineOutcome::Hook(hook))
        } else {
            Ok(LlCombineOutcome::Received(hook.complete(self)?))
        }
    }

    fn ll_combine_recv(&mut self, hook: &LlCombineHook) -> Result<LlCombineOutput> {
        let res = self.ll_combine_recv_inner(hook);
        res.map_err(|e| self.ll_fail(e))
    }

    fn ll_combine_recv_inner(&mut self, hk: &LlCombineHook) -> Result<LlCombineOutput> {
        let cfg = self.cfg.clone();
        let (h, k, r, l) = (cfg.hidden, cfg.num_topk, cfg.num_ranks, cfg.num_local_experts());
        let layout = ll_layout_bf16(&cfg)?;
        let rb = layout.combine_record.bytes as usize;
        let boot = self.boot.clone();
        let comm = self.ll_comm()?;
        let set = hk.set;
        let mut wait_ns = vec![0u64; r];
        let counts = comm.wait_counts(LlPhase::Combine, set, &mut wait_ns, &|p| boot.is_dead(p))?;
        // counts[e * R + src] = rows answered by global expert src * L + e.
        for e in 0..l {
            for src in 0..r {
                if comm.mask[src] {
                    continue;
                }
                let got = counts[e * r + src];
                let want = hk.count_per_expert[src * l + e];
                if got != want {
                    return Err(Error::Protocol {
                        rank: cfg.rank,
                        peer: src,
                        phase: LlPhase::Combine.name(),
                        msg: format!("{got} rows back from local expert {e}, {want} were sent"),
                    });
                }
            }
        }
        let t = hk.num_tokens;
        let mut out = vec![0u16; t * h];
        let mut acc = vec![0f32; h];
        for tok in 0..t {
            acc.fill(0.0);
            for j in 0..k {
                let g = hk.topk_idx[tok * k + j];
                if g < 0 || comm.mask[g as usize / l] {
                    continue;
                }
                let p = hk.pos[tok * k + j];
                if p < 0 {
                    continue;
                }
                let w = hk.topk_weights[tok * k + j];
                let off = comm.geo.offset(set, LlArea::Recv, g as u64)? + (p as usize * rb) as u64;
                // SAFETY: arrived (wait_counts) and not rewritten before call + 2.
                let bytes = unsafe { comm.received(off, 2 * h)? };
                for (a, y) in acc.iter_mut().zip(bytes.chunks_exact(2)) {
                    *a = bf16_to_f32(u16::from_le_bytes([y[0], y[1]])).mul_add(w, *a);
                }
            }
            for (o, &a) in out[tok * h..(tok + 1) * h].iter_mut().zip(&acc) {
                *o = f32_to_bf16(a);
            }
        }
        comm.finish_recv(LlPhase::Combine, set)?;
        Ok(LlCombineOutput { combined_x: out, recv_wait_ns: wait_ns })
    }

    /// DeepEP's `clean_low_latency_buffer`: makes the LL buffer usable again after a failed
    /// step (a stalled peer, a timeout). Collective: every rank calls it. Bounded (the
    /// buffer's timeout and the bootstrap's).
    ///
    /// What it resets: the buffer-set parity (the next call uses set 0 on every rank), the
    /// outstanding hooks and handles (void afterwards: completing or combining them is an
    /// [`Error::InvalidArgument`]), and the failure flag. The cumulative arrival counters are
    /// not zeroed but re-based: every rank all-gathers how many LL writes it ever pushed to
    /// each slot and every receiver waits until exactly that many arrived, so a slow peer's
    /// late writes are counted before clean returns and can never pass for a later call's
    /// (host/ll.rs NOTES). Buffer contents are not zeroed (every call overwrites what it
    /// reads). Limit: a peer whose transport died cannot be fenced; rebuild the Buffer then.
    ///
    /// In shrink mode ([`BufferOptions::ll_shrink`]) it is collective among the ranks this rank
    /// has not masked and runs over the low-latency lane instead of the bootstrap (a masked
    /// rank does not take part): the same exact re-base, per unmasked rank, from the write
    /// counts each reports in band; a rank that does not take part within the timeout is
    /// masked (host/ll.rs NOTES).
    pub fn clean_low_latency_buffer(&mut self) -> Result<()> {
        if self.ll.is_none() {
            // Nothing sent yet on this rank; connecting is itself collective, so peers that
            // already connected are matched here.
            let lane = self.ll_connect()?;
            self.ll = Some(lane);
        }
        let boot = self.boot.clone();
        match self.ll.as_mut() {
            Some(lane) => lane.comm.fence(boot.as_ref()),
            None => Err(Error::Other("no LL lane".into())),
        }
    }
}

impl Buffer {
    fn shrink_only(&self, call: &str) -> Result<()> {
        if self.opts.ll_shrink {
            return Ok(());
        }
        Err(Error::arg(
            "enable_shrink",
            format!(
                "{call}: this buffer was built without shrink mode (BufferOptions::ll_shrink, \
                 fep_config.enable_shrink)"
            ),
        ))
    }

    /// This rank's own registered memory as `(address, bytes)` (DeepEP's
    /// `get_local_buffer_tensor`), host memory here (the GPU backend's: [`GpuBuffer::local_region`]).
    /// `low_latency` false: normal mode's receive region (peers' chunks and notify records land
    /// there: every dispatch and combine overwrites it); true: the low-latency lane's buffer
    /// (both sets' send staging and receive areas: every low-latency call overwrites it), which
    /// exists once the lane connected (the first low-latency call or clean).
    pub fn local_region(&self, low_latency: bool) -> Result<(u64, usize)> {
        if let Some(g) = self.gpu.as_deref() {
            return g.local_region(low_latency);
        }
        let r = if low_latency {
            let lane = self.ll.as_ref().ok_or_else(|| {
                Error::arg(
                    "low_latency",
                    "the low-latency buffer is connected by the first low-latency call (or \
                     clean_low_latency_buffer) on every rank; none was made yet",
                )
            })?;
            &lane.comm.recv
        } else {
            &self.comm.as_ref().ok_or_else(|| Error::Other("buffer destroyed".into()))?.recv
        };
        Ok((r.as_ptr() as u64, r.len()))
    }

    /// DeepEP's `low_latency_update_mask_buffer` (shrink mode; this rank only): masks `rank`
    /// (this rank's low-latency calls write nothing to it and wait for nothing from it; an
    /// expert of it counts as `-1` in combine) or unmasks it. Unmasking a masked rank leaves
    /// the low-latency buffer refusing calls until [`Buffer::clean_low_latency_buffer`] (on
    /// every unmasked rank, it included): what was written while it was masked is out of step.
    pub fn ll_update_mask(&mut self, rank: usize, masked: bool) -> Result<()> {
        self.shrink_only("low_latency_update_mask_buffer")?;
        if let Some(g) = self.gpu.as_deref_mut() {
            return g.ll_update_mask(rank, masked);
        }
        let r = self.cfg.num_ranks;
        if rank >= r {
            return Err(Error::arg("rank", format!("{rank} not in 0..{r}")));
        }
        match self.ll.as_mut() {
            Some(lane) => {
                let was = lane.comm.mask[rank];
                lane.comm.set_mask(rank, masked)?;
                if was && !masked {
                    lane.comm.broken = Some(format!("rank {rank} was unmasked"));
                }
            }
            None => self.ll_mask[rank] = masked,
        }
        Ok(())
    }

    /// DeepEP's `low_latency_query_mask_buffer`: `[R]` which ranks this rank has masked (by
    /// [`Buffer::ll_update_mask`] or because they timed out).
    pub fn ll_mask(&mut self) -> Result<Vec<bool>> {
        self.shrink_only("low_latency_query_mask_buffer")?;
        if let Some(g) = self.gpu.as_deref_mut() {
            return g.ll_mask();
        }
        Ok(match self.ll.as_ref() {
            Some(lane) => lane.comm.mask.clone(),
            None => self.ll_mask.clone(),
        })
    }

    /// DeepEP's `low_latency_clean_mask_buffer`: unmasks every rank (as
    /// [`Buffer::ll_update_mask`] does each).
    pub fn ll_clean_mask(&mut self) -> Result<()> {
        self.shrink_only("low_latency_clean_mask_buffer")?;
        for rank in 0..self.cfg.num_ranks {
            self.ll_update_mask(rank, false)?;
        }
        Ok(())
    }
}

fn dtype_of(use_fp8: bool) -> DispatchDtype {
    if use_fp8 {
        DispatchDtype::Fp8E4m3
    } else {
        DispatchDtype::Bf16
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_output_sized_past_memory_names_the_peer_that_announced_it() {
        // Rank 0 hears 5 tokens from rank 0, 2^31 - 1 from rank 1 and 3 from rank 2.
        let big = i32::MAX as u64;
        let prefix = [0, 5, 5 + big, 8 + big];
        for (rows, per_row) in [(8 + big, usize::MAX / 2), (u64::MAX, 1)] {
            match announced_vec(0, &prefix, rows, per_row, 0u16) {
                Err(Error::Protocol { rank: 0, peer: 1, phase: "notify", msg }) => {
                    assert!(msg.contains(&format!("announced {big} tokens")), "{msg}");
                }
                other => panic!("expected a protocol error naming rank 1, got {other:?}"),
            }
        }
        assert_eq!(announced_vec(0, &prefix, 3, 2, 7u8).unwrap(), vec![7; 6]);
    }
}
