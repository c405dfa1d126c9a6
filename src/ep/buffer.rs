//! `Buffer`: the EP communication buffer of one rank (DeepEP V1's `deep_ep.Buffer`), normal mode.
//!
//! ```no_run
//! # use std::sync::Arc;
//! # use fabric_ep::ep::buffer::*;
//! # use fabric_ep::ep::config::{EpConfig, EpSettings};
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

use super::config::{DispatchDtype, EpConfig};
use super::gpu::{GpuBuffer, GpuOptions};
use super::handle::DispatchHandle;
use super::host::{Geometry, HostComm, StepCounts};
use super::layout::{dispatch_layout, Layout};
use super::plan::{self, NotifyRecord, Phase, RecordFields, RecvPlan, SendPlan, FP8_GROUP};
use super::quant::{bf16_to_f32, f32_to_bf16};
use crate::bootstrap::Bootstrap;
use crate::fabric::{FiAddr, InfoQuery, MemKind, MemoryRegion, RemoteRegion, Stack};
use crate::proxy::{
    CounterLayout, CounterMemory, FabricPeer, FabricTransport, LoopbackGroup, LoopbackOptions,
    Proxy, ProxyConfig, RingLayout, RingMemory, SharedRegion,
};
use crate::{Error, Result};

pub use super::reference::{Tokens as OwnedTokens, TokensRef as Tokens};

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
    /// The GPU backend's options (required with [`Backend::Gpu`]).
    pub gpu: Option<GpuOptions>,
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
            gpu: None,
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
}

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
    /// The GPU backend's engine (`Backend::Gpu`); the host fields above are then empty.
    gpu: Option<Box<GpuBuffer>>,
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

fn read_u64(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?))
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
        if opts.backend == Backend::Gpu {
            let g = opts.gpu.as_ref().ok_or_else(|| {
                Error::arg("backend", "Backend::Gpu needs GPU options: use BufferOptions::gpu")
            })?;
            let id = NEXT_BUFFER_ID.fetch_add(1, Ordering::Relaxed);
            let gpu = Box::new(GpuBuffer::connect(cfg.clone(), &boot, g, id)?);
            let (comm, fabric, _mem) = (None, None, None);
            return Ok(Buffer {
                cfg,
                id,
                boot,
                comm,
                fabric,
                _mem,
                poisoned: None,
                gpu: Some(gpu),
            });
        }
        if opts.ring_capacity == 0 {
            return Err(Error::arg("ring_capacity", "must be at least 1"));
        }
        let rank = cfg.rank;
        let r = cfg.num_ranks;
        let timeout = opts.timeout.unwrap_or(cfg.timeout);
        let layout = cfg.normal_layout();
        let rings = RingMemory::new_host(RingLayout::new(1, opts.ring_capacity)?)?;
        let counters = CounterMemory::new_host(CounterLayout {
            num_slots: layout.imm.num_ids() as u32,
            num_rings: 1,
        })?;
        let pcfg = ProxyConfig {
            rank: rank as u32,
            value_bits: plan::IMM_VALUE_BITS,
            ..ProxyConfig::default()
        };
        let hash = cfg.hash();
        let id = NEXT_BUFFER_ID.fetch_add(1, Ordering::Relaxed);
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
                let stack = Stack::open(&InfoQuery::provider(&opts.provider), r)?;
                let stride = stack.info.max_region_bytes().max(4096) as u64;
                let geo = geometry(&cfg, stride)?;
                let send = Arc::new(SharedRegion::alloc_host(geo.bytes as usize)?);
                let recv = Arc::new(SharedRegion::alloc_host(geo.bytes as usize)?);
                // SAFETY: both regions are kept alive by `Buffer::_mem`, which drops after the
                // proxy (whose transport posts writes naming them) and after the registrations.
                let send_mr =
                    Arc::new(unsafe { stack.register(send.as_ptr(), send.len(), MemKind::Host)? });
                let recv_mr =
                    Arc::new(unsafe { stack.register(recv.as_ptr(), recv.len(), MemKind::Host)? });
                let name = stack.ep.name()?;
                let desc = recv_mr.remote().to_bytes();
                let mut blob = hash.to_le_bytes().to_vec();
                blob.extend_from_slice(&(name.len() as u32).to_le_bytes());
                blob.extend_from_slice(&name);
                blob.extend_from_slice(&desc);
                let all = boot.all_gather(&blob)?;
                let mut names = Vec::with_capacity(r);
                let mut regions: Vec<RemoteRegion> = Vec::with_capacity(r);
                for (peer, b) in all.iter().enumerate() {
                    let bad = || blob_err(rank, peer, b.len());
                    let h = read_u64(b, 0).ok_or_else(bad)?;
                    cfg.check_peer_hash(peer, h)?;
                    let n = u32::from_le_bytes(
                        b.get(8..12).ok_or_else(bad)?.try_into().map_err(|_| bad())?,
                    ) as usize;
                    names.push(b.get(12..12 + n).ok_or_else(bad)?.to_vec());
                    let region = RemoteRegion::from_bytes(b.get(12 + n..).ok_or_else(bad)?)
                        .map_err(|_| bad())?;
                    if region.len < geo.bytes {
                        return Err(bad());
                    }
                    regions.push(region);
                }
                let addrs: Vec<FiAddr> = stack.connect(&names)?;
                let peers = addrs
                    .into_iter()
                    .zip(regions)
                    .map(|(addr, recv)| Some(FabricPeer { addr, recv }))
                    .collect();
                let transport =
                    FabricTransport::new(rank as u32, stack.ep.clone(), send_mr.clone(), peers)?;
                let proxy = Proxy::start(pcfg, rings.clone(), counters, vec![transport])?;
                let hold = FabricHold { _recv_mr: recv_mr, _send_mr: send_mr, _stack: stack };
                (geo, send, recv, proxy, Some(hold))
            }
        };
        // Every rank's proxy runs and every region is registered before anyone writes.
        boot.barrier()?;
        let producer = rings.producer(0)?;
        let comm = HostComm::new(rank, geo, timeout, producer, proxy, send.clone(), recv.clone());
        let _mem = Some((send, recv));
        Ok(Buffer { cfg, id, boot, comm: Some(comm), fabric, _mem, poisoned: None, gpu: None })
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
        let barrier = self.boot.barrier();
        self.teardown();
        barrier.map_err(Error::from)
    }

    fn teardown(&mut self) {
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
        let rows = recv_plan.num_out_rows as usize;
        let send_counts: Vec<u64> =
            (0..r).map(|d| send_plan.tokens_for(d as u64).len() as u64).collect();
        let recv_counts: Vec<u64> =
            (0..r).map(|s| recv_plan.rank_prefix[s + 1] - recv_plan.rank_prefix[s]).collect();
        let fp8 = cfg.dispatch_dtype == DispatchDtype::Fp8E4m3;
        let groups = h / FP8_GROUP as usize;
        let (mut out_bf16, mut out_fp8, mut out_scales) = if fp8 {
            (Vec::new(), vec![0u8; rows * h], vec![0f32; rows * groups])
        } else {
            (vec![0u16; rows * h], Vec::new(), Vec::new())
        };
        let with_topk = args.topk_idx.is_some();
        let (mut out_idx, mut out_w) = if with_topk {
            (vec![-1i64; rows * k], vec![0f32; rows * k])
        } else {
            (Vec::new(), Vec::new())
        };
        let n_recv = recv_plan.num_recv_tokens as usize;
        let mut src_idx = vec![0i32; n_recv];
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
    // Index loops over ranks read closest to the reference's summation order.
    #[allow(clippy::needless_range_loop)]
    pub fn combine(&mut self, args: &CombineArgs<'_>) -> Result<CombineOutput> {
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
