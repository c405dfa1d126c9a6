//! DeepEP's per-call shape in the C ABI (`fep_ep_*`): one object sized by DeepEP's byte counts
//! (`num_nvl_bytes`, `num_rdma_bytes`, `low_latency_mode`) that hands out a native
//! [`fep_buffer`] per model shape and token format, created collectively on the shape's first
//! request over the object's one bootstrap and reused by every later request.
//!
//! DeepEP sizes one buffer from byte counts and takes the shape (hidden size, top-k, number of
//! experts, bf16 or fp8) with each call; a fabric-ep buffer is laid out for one shape. A `fep_ep`
//! keeps one buffer per
//! - normal mode: `(num_experts, hidden, num_topk, dispatch_dtype)`;
//! - low latency: `(num_experts, hidden, num_topk, max_tokens_per_rank, dispatch_dtype)`; on the
//!   host backend without the format (the host casts per call, `fep_low_latency_dispatch`'s
//!   `use_fp8`: one bf16 buffer serves both).
//!
//! The buffers are the object's: `fep_ep_destroy` frees them in creation order, and a caller's
//! `fep_buffer_destroy` of one is refused. The calls that run on a buffer (`fep_dispatch`,
//! `fep_combine`, `fep_low_latency_*`, `fep_gpu_*`) take them unchanged. On the GPU backend every
//! buffer of one object reports the same communication stream (`fep_gpu_info`, `fep_ep_info`).
//!
//! NOTES (collective creation): building a shape's buffer is collective, so it happens in the
//! first request of that shape on every rank at once. DeepEP's contract gives that: every rank
//! makes the same calls in the same order with the same shapes (a rank without tokens still
//! calls, with `[0, hidden]` tensors). The capacity check needs no communication and every rank
//! has the same byte counts (`fep_ep_create` checks), so a refused shape is refused on every
//! rank alike.

use std::ffi::{CStr, CString};
use std::os::raw::{c_char, c_void};
use std::sync::Arc;

use super::buffer::{
    caller_gather, create_over, destroy_boxed, fep_allgather_fn, fep_buffer, fep_config,
    fep_config_init, resolve, FEP_BACKEND_GPU, FEP_BACKEND_HOST, FEP_DTYPE_BF16,
    FEP_MODE_LOW_LATENCY, FEP_MODE_NORMAL,
};
use super::{fep_status, guard, FEP_ABI_VERSION};
use crate::bootstrap::{Bootstrap, CallbackBootstrap, TcpStore, MAX_WORLD};
use crate::cuda::Stream;
use crate::error::Error;
use crate::protocol::config::{DispatchDtype, EpConfig, EpSettings};

/// What a `fep_ep` is created from: DeepEP's `Buffer` arguments and the `fep_config` fields that
/// every buffer of the object shares. Fill it with `fep_ep_config_init` (defaults), then set the
/// fields to change. Zero fields take their defaults; -1 rank fields come from the environment
/// (torchrun variables) or, over the environment's store, from the store.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct fep_ep_config {
    /// `sizeof(fep_ep_config)`.
    pub struct_size: u32,
    /// `FEP_ABI_VERSION`.
    pub version: u32,
    /// DeepEP's `num_nvl_bytes`, per rank, >= 0. A normal-mode shape may use up to
    /// `num_nvl_bytes + num_rdma_bytes` (`fep_ep_need_bytes`); 0 and 0: no limit.
    pub num_nvl_bytes: i64,
    /// DeepEP's `num_rdma_bytes`, per rank, >= 0: also the limit of each low-latency shape
    /// (0: no limit for low latency).
    pub num_rdma_bytes: i64,
    /// DeepEP's `low_latency_mode`: 1 = low-latency shapes may be requested, 0 = normal mode
    /// only (as DeepEP, whose low-latency calls need it).
    pub low_latency_mode: i32,
    /// `FEP_BACKEND_HOST` or `FEP_BACKEND_GPU`.
    pub backend: i32,
    /// This rank; -1: `RANK` (over the environment's store: the store's).
    pub rank: i32,
    /// World size; -1: `WORLD_SIZE` (over the environment's store: the store's).
    pub num_ranks: i32,
    /// Ranks per node; 0: `LOCAL_WORLD_SIZE` (or up to 8 dividing the world).
    pub ranks_per_node: i32,
    /// Rank within the node; -1: `LOCAL_RANK` (or rank % ranks_per_node).
    pub local_rank: i32,
    /// `FEP_BACKEND_GPU`: CUDA device ordinal; -1: `LOCAL_RANK` (or 0 without it).
    pub device: i32,
    /// SM budget of every buffer; 0: the backend's default.
    pub num_sms: i32,
    /// Normal-mode chunk tokens; 0: the backend's default (host 64, GPU 16).
    pub chunk_tokens: i32,
    /// Normal-mode slots per peer; 0: the backend's default (host 4; GPU 32 up to 8 ranks,
    /// else 16).
    pub slots_per_peer: i32,
    /// `FEP_BACKEND_GPU`, normal-mode buffers: dispatch handles reserved at creation for up to
    /// this many input tokens; 0: 4096; -1: none (`fep_config.gpu_reserve_tokens`).
    pub gpu_reserve_tokens: i32,
    /// `FEP_BACKEND_GPU` across nodes, normal-mode buffers: 1 = DeepEP's hierarchy, 0 = direct
    /// (`fep_config.internode_hierarchy`).
    pub internode_hierarchy: i32,
    /// Bound on every wait, seconds (the bootstrap's too); 0: 60. Finite and >= 0.
    pub timeout_s: f64,
    /// libfabric provider; NULL: `FI_PROVIDER`, else "shm" (`fep_config.provider`; copied).
    pub provider: *const c_char,
}

/// DeepEP's per-call shape over native buffers (opaque): see [`fep_ep_buffer`].
pub struct fep_ep {
    boot: Arc<dyn Bootstrap>,
    /// Every shape's buffer config starts from this (rank fields resolved; `provider` points at
    /// `_provider`).
    base: fep_config,
    /// The caller's provider string, copied: its pointer only had to live for the create call.
    _provider: Option<CString>,
    nvl_bytes: u64,
    rdma_bytes: u64,
    low_latency: bool,
    /// The buffers, in creation order.
    bufs: Vec<(Key, *mut fep_buffer)>,
    /// `FEP_BACKEND_GPU`: the communication stream every buffer of this object reports.
    comm: Option<Stream>,
}

/// What tells two shapes' buffers apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Key {
    mode: i32,
    num_experts: i32,
    hidden: i32,
    num_topk: i32,
    max_tokens_per_rank: i32,
    /// `None`: any format (the host backend's low latency).
    dtype: Option<i32>,
}

/// A requested shape: its buffer's config (validated), its key and the bytes it needs.
struct Shape {
    cfg: fep_config,
    key: Key,
    need: u64,
    what: String,
}

/// The GPU backend's normal-mode chunk when the config leaves it at 0 (`GpuOptions::new`'s).
const GPU_CHUNK_TOKENS: usize = 16;

/// Fills `cfg` with its size, version and defaults: no byte limit, normal mode only, host
/// backend, rank fields from the environment (-1 / 0), every other field 0 (its default),
/// provider NULL.
///
/// # Safety
/// `cfg` must point at a writable `fep_ep_config`.
#[no_mangle]
pub unsafe extern "C" fn fep_ep_config_init(cfg: *mut fep_ep_config) -> fep_status {
    guard(|| {
        let c = cfg.as_mut().ok_or_else(|| Error::arg("cfg", "NULL pointer"))?;
        *c = fep_ep_config {
            struct_size: std::mem::size_of::<fep_ep_config>() as u32,
            version: FEP_ABI_VERSION,
            num_nvl_bytes: 0,
            num_rdma_bytes: 0,
            low_latency_mode: 0,
            backend: FEP_BACKEND_HOST,
            rank: -1,
            num_ranks: -1,
            ranks_per_node: 0,
            local_rank: -1,
            device: -1,
            num_sms: 0,
            chunk_tokens: 0,
            slots_per_peer: 0,
            gpu_reserve_tokens: 0,
            internode_hierarchy: 0,
            timeout_s: 0.0,
            provider: std::ptr::null(),
        };
        Ok(())
    })
}

/// Reads a caller's `fep_ep_config` and checks the fields no `fep_config` has (the shared ones
/// are checked by [`resolve`]).
unsafe fn read_ep_config(cfg: *const fep_ep_config) -> Result<fep_ep_config, Error> {
    if cfg.is_null() {
        return Err(Error::arg("cfg", "NULL pointer"));
    }
    // SAFETY: every caller's struct has at least the 8-byte size/version header.
    let (size, version) = (
        std::ptr::read_unaligned(cfg.cast::<u32>()),
        std::ptr::read_unaligned(cfg.cast::<u32>().add(1)),
    );
    let ours = std::mem::size_of::<fep_ep_config>();
    if version != FEP_ABI_VERSION || size as usize != ours {
        return Err(Error::arg(
            "cfg",
            format!(
                "version {version} / struct_size {size}: this library is ABI {FEP_ABI_VERSION} \
                 with a {ours}-byte fep_ep_config (use fep_ep_config_init)"
            ),
        ));
    }
    let e = std::ptr::read_unaligned(cfg);
    for (name, v) in [("num_nvl_bytes", e.num_nvl_bytes), ("num_rdma_bytes", e.num_rdma_bytes)] {
        if v < 0 {
            return Err(Error::arg(name, format!("{v}: must be >= 0 (0 and 0: no limit)")));
        }
    }
    if !(0..=1).contains(&e.low_latency_mode) {
        return Err(Error::arg(
            "low_latency_mode",
            format!(
                "{}: 1 (low-latency shapes allowed) or 0 (normal mode only)",
                e.low_latency_mode
            ),
        ));
    }
    Ok(e)
}

/// The `fep_config` every buffer of `e` shares (no shape yet).
fn base_config(e: &fep_ep_config) -> fep_config {
    let mut c = std::mem::MaybeUninit::<fep_config>::uninit();
    // SAFETY: fep_config_init writes the whole struct.
    let mut c = unsafe {
        fep_config_init(c.as_mut_ptr());
        c.assume_init()
    };
    c.rank = e.rank;
    c.num_ranks = e.num_ranks;
    c.ranks_per_node = e.ranks_per_node;
    c.local_rank = e.local_rank;
    c.backend = e.backend;
    c.device = e.device;
    c.num_sms = e.num_sms;
    c.chunk_tokens = e.chunk_tokens;
    c.slots_per_peer = e.slots_per_peer;
    c.gpu_reserve_tokens = e.gpu_reserve_tokens;
    c.internode_hierarchy = e.internode_hierarchy;
    c.timeout_s = e.timeout_s;
    c.provider = e.provider;
    c
}

/// `base` with the smallest valid shape of its world, so [`resolve`] checks every shared field
/// (the errors name it) before a shape is known.
fn probe(base: &fep_config) -> fep_config {
    let world = if base.num_ranks > 0 {
        base.num_ranks
    } else {
        // -1: the environment's (a missing or bad variable is resolve's error to report).
        std::env::var("WORLD_SIZE")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|&n| n > 0)
            .unwrap_or(1)
    };
    fep_config { num_experts: world, hidden: 128, num_topk: 1, ..*base }
}

fn mode_name(mode: i32) -> &'static str {
    if mode == FEP_MODE_LOW_LATENCY {
        "low latency"
    } else {
        "normal mode"
    }
}

/// The shape's buffer config over `base` (rank fields set), checked (every error names its
/// argument), and the bytes its buffer needs: the size hints' arithmetic (`fep_get_size_hints`)
/// with the chunking the buffer will get (the config's, else the backend's default).
unsafe fn shape(
    base: &fep_config,
    mode: i32,
    num_experts: i32,
    hidden: i32,
    num_topk: i32,
    dispatch_dtype: i32,
    max_tokens_per_rank: i32,
) -> Result<Shape, Error> {
    if mode != FEP_MODE_NORMAL && mode != FEP_MODE_LOW_LATENCY {
        return Err(Error::arg(
            "mode",
            format!("{mode}: FEP_MODE_NORMAL (1) or FEP_MODE_LOW_LATENCY (2), one of them"),
        ));
    }
    let ll = mode == FEP_MODE_LOW_LATENCY;
    if ll && max_tokens_per_rank < 1 {
        return Err(Error::arg(
            "max_tokens_per_rank",
            format!(
                "{max_tokens_per_rank}: must be >= 1 with FEP_MODE_LOW_LATENCY (DeepEP's \
                 num_max_dispatch_tokens_per_rank)"
            ),
        ));
    }
    if !ll && max_tokens_per_rank != 0 {
        return Err(Error::arg(
            "max_tokens_per_rank",
            format!("{max_tokens_per_rank}: must be 0 with FEP_MODE_NORMAL (no per-rank capacity)"),
        ));
    }
    let mut c = fep_config {
        num_experts,
        hidden,
        num_topk,
        dispatch_dtype,
        max_tokens_per_rank: if ll { max_tokens_per_rank } else { 0 },
        ..*base
    };
    // The shape as asked (its format checked against its hidden size, whatever the backend).
    let mut s: EpSettings = resolve(&c)?.settings;
    let host = c.backend == FEP_BACKEND_HOST;
    let any_format = ll && host;
    if any_format {
        c.dispatch_dtype = FEP_DTYPE_BF16;
        s.dispatch_dtype = DispatchDtype::Bf16;
    }
    if ll {
        // Handles and the hierarchy are normal mode's.
        c.gpu_reserve_tokens = -1;
        c.internode_hierarchy = 0;
    }
    // The GPU allocates only this mode's buffers (the host backend always has both).
    c.modes = if host { 0 } else { mode };
    if c.backend == FEP_BACKEND_GPU {
        if base.chunk_tokens == 0 {
            s.chunk_tokens = GPU_CHUNK_TOKENS;
        }
        if base.slots_per_peer == 0 {
            s.slots_per_peer = crate::ep::gpu::default_slots_per_peer(s.num_ranks);
        }
    }
    let ec = EpConfig::new(s)?;
    let need = if ll {
        ec.ll_buffer_bytes()
    } else {
        [ec.normal_recv_bytes(), ec.normal_send_bytes(), ec.normal_notify_bytes()]
            .into_iter()
            .try_fold(0u64, u64::checked_add)
            .ok_or_else(|| Error::arg("hidden", "the shape's buffer bytes overflow 64 bits"))?
    };
    let format = if any_format {
        "either format"
    } else if dispatch_dtype == FEP_DTYPE_BF16 {
        "bf16"
    } else {
        "fp8"
    };
    let tokens =
        if ll { format!(", {max_tokens_per_rank} tokens per rank") } else { String::new() };
    let ranks =
        if ec.num_ranks == 1 { "1 rank".to_string() } else { format!("{} ranks", ec.num_ranks) };
    let what = format!(
        "{}{tokens}, hidden {hidden}, top-{num_topk} of {num_experts} experts, {format}, {ranks}",
        mode_name(mode)
    );
    let key = Key {
        mode,
        num_experts,
        hidden,
        num_topk,
        max_tokens_per_rank: c.max_tokens_per_rank,
        dtype: (!any_format).then_some(dispatch_dtype),
    };
    Ok(Shape { cfg: c, key, need, what })
}

/// Fills `base`'s rank fields left to the environment from the bootstrap (as
/// `fep_buffer_create_boot` does) and checks the given ones against it.
fn rank_fields(base: &mut fep_config, boot: &dyn Bootstrap) -> Result<(), Error> {
    for (name, v, theirs) in [
        ("rank", &mut base.rank, boot.rank()),
        ("num_ranks", &mut base.num_ranks, boot.world_size()),
    ] {
        if *v < 0 {
            *v = theirs as i32;
        } else if *v as usize != theirs {
            return Err(Error::arg(name, format!("{v} disagrees with the bootstrap's {theirs}")));
        }
    }
    if base.local_rank < 0 {
        base.local_rank = boot.local_rank() as i32;
    }
    if base.ranks_per_node <= 0 {
        base.ranks_per_node = boot.local_world_size() as i32;
    }
    Ok(())
}

/// The fields every rank must give alike (the capacity check and the buffers' chunking depend on
/// them).
const AGREED: [&str; 7] = [
    "num_nvl_bytes",
    "num_rdma_bytes",
    "low_latency_mode",
    "backend",
    "chunk_tokens",
    "slots_per_peer",
    "internode_hierarchy",
];

/// One all-gather of [`AGREED`]: a rank that gave another value is `FEP_ERR_CONFIG_MISMATCH`
/// naming it, the field and both values, here instead of a refusal on some ranks only later
/// (the others would wait for it in the shape's creation until the timeout).
fn agree(boot: &dyn Bootstrap, vals: [i64; AGREED.len()]) -> Result<(), Error> {
    let blob: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
    let all = boot.all_gather(&blob)?;
    for (peer, b) in all.iter().enumerate() {
        if b.len() != blob.len() {
            return Err(Error::Protocol {
                rank: boot.rank(),
                peer,
                phase: "fep_ep_create",
                msg: format!("{} bytes of settings, expected {}", b.len(), blob.len()),
            });
        }
        for ((name, ours), theirs) in AGREED.iter().zip(vals).zip(b.chunks_exact(8)) {
            let mut w = [0u8; 8];
            w.copy_from_slice(theirs);
            let theirs = i64::from_le_bytes(w);
            if theirs != ours {
                return Err(Error::ConfigMismatch(format!(
                    "fep_ep_create: rank {peer} has {name} {theirs}, rank {} has {ours}",
                    boot.rank()
                )));
            }
        }
    }
    Ok(())
}

/// Creates the object: checks `cfg` (every field's range before any communication; the message
/// names the field), joins the bootstrap (through `allgather` when given, else the
/// torchrun/PyTorchJob environment's store, once, for every buffer of the object), and checks
/// that every rank gave the same byte counts, `low_latency_mode`, backend, chunking and
/// `internode_hierarchy` (a difference is `FEP_ERR_CONFIG_MISMATCH` naming the rank and the
/// field). No buffer is created yet: [`fep_ep_buffer`] makes one per shape. On the GPU backend it
/// opens the device and takes the object's communication stream. Collective.
///
/// # Safety
/// `cfg` and `out` must be valid; `allgather` (if given) must be callable with `user` from the
/// threads that call `fep_ep_*` on this object until `fep_ep_destroy` returns.
#[no_mangle]
pub unsafe extern "C" fn fep_ep_create(
    cfg: *const fep_ep_config,
    allgather: fep_allgather_fn,
    user: *mut c_void,
    out: *mut *mut fep_ep,
) -> fep_status {
    guard(|| {
        let out = out.as_mut().ok_or_else(|| Error::arg("out", "NULL pointer"))?;
        *out = std::ptr::null_mut();
        let e = read_ep_config(cfg)?;
        let provider =
            if e.provider.is_null() { None } else { Some(CStr::from_ptr(e.provider).to_owned()) };
        let mut base = base_config(&e);
        base.provider = provider.as_ref().map_or(std::ptr::null(), |p| p.as_ptr());
        let r = resolve(&probe(&base))?;
        let s = &r.settings;
        let boot: Arc<dyn Bootstrap> = match allgather {
            Some(f) => Arc::new(CallbackBootstrap::new(
                s.rank,
                s.num_ranks,
                r.local_rank,
                s.ranks_per_node,
                caller_gather(f, user),
            )?),
            None => Arc::new(TcpStore::from_env(s.timeout)?),
        };
        rank_fields(&mut base, &*boot)?;
        let r = resolve(&probe(&base))?;
        agree(
            &*boot,
            [
                e.num_nvl_bytes,
                e.num_rdma_bytes,
                e.low_latency_mode.into(),
                e.backend.into(),
                e.chunk_tokens.into(),
                e.slots_per_peer.into(),
                e.internode_hierarchy.into(),
            ],
        )?;
        let comm = if e.backend == FEP_BACKEND_GPU {
            let (_, dev) = super::gpu::options(&probe(&base), r.local_rank)?;
            Some(Stream::kept(&dev)?)
        } else {
            None
        };
        *out = super::live::boxed(fep_ep {
            boot,
            base,
            _provider: provider,
            nvl_bytes: e.num_nvl_bytes as u64,
            rdma_bytes: e.num_rdma_bytes as u64,
            low_latency: e.low_latency_mode == 1,
            bufs: Vec::new(),
            comm,
        });
        Ok(())
    })
}

/// The native buffer of one per-call shape: `mode` `FEP_MODE_NORMAL` or `FEP_MODE_LOW_LATENCY`
/// (the latter only with `low_latency_mode` 1), `num_experts` (a multiple of the ranks),
/// `hidden`, `num_topk`, `dispatch_dtype` (`FEP_DTYPE_BF16` or `FEP_DTYPE_FP8_E4M3`) and
/// `max_tokens_per_rank` (low latency: DeepEP's `num_max_dispatch_tokens_per_rank`, >= 1;
/// normal mode: 0). The first request of a shape creates its buffer (collective: every rank
/// makes the same `fep_ep_buffer` calls in the same order, as DeepEP requires of its calls);
/// later requests return the same buffer and communicate nothing. The fp8 format of normal mode
/// is the tokens' (`fep_dispatch`'s `x`); of low latency on the GPU the received rows' (on the
/// host backend one buffer serves both: `use_fp8` per call).
///
/// Refused (`FEP_ERR_INVALID_ARGUMENT`, before any communication, the message naming the
/// argument): a field out of range, as `fep_config` would refuse it; a low-latency shape
/// without `low_latency_mode`; a shape needing more than the object's capacity
/// (`fep_ep_need_bytes`: normal mode up to `num_nvl_bytes + num_rdma_bytes`, low latency up to
/// `num_rdma_bytes`, 0 = no limit), the message naming the capacity argument, both sizes and the
/// shape.
///
/// `*out` stays owned by the object: use it with every `fep_*` call that takes a buffer until
/// `fep_ep_destroy`, which frees it (`fep_buffer_destroy` on it is refused). On the GPU backend,
/// a shape's first request allocates device memory: with ranks as threads of one process, make
/// it while no kernel of the group runs (as `fep_gpu_reserve`).
///
/// # Safety
/// `ep` must come from `fep_ep_create`; `out` must be valid. Calls on one object are sequential.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn fep_ep_buffer(
    ep: *mut fep_ep,
    mode: i32,
    num_experts: i32,
    hidden: i32,
    num_topk: i32,
    dispatch_dtype: i32,
    max_tokens_per_rank: i32,
    out: *mut *mut fep_buffer,
) -> fep_status {
    guard(|| {
        let out = out.as_mut().ok_or_else(|| Error::arg("out", "NULL pointer"))?;
        *out = std::ptr::null_mut();
        let ep = super::live::get(ep, "ep")?;
        if mode == FEP_MODE_LOW_LATENCY && !ep.low_latency {
            return Err(Error::arg(
                "mode",
                "FEP_MODE_LOW_LATENCY: this fep_ep was created with low_latency_mode 0 (as in \
                 DeepEP, low-latency calls need low_latency_mode 1)",
            ));
        }
        let sh = shape(
            &ep.base,
            mode,
            num_experts,
            hidden,
            num_topk,
            dispatch_dtype,
            max_tokens_per_rank,
        )?;
        if let Some(&(_, b)) = ep.bufs.iter().find(|(k, _)| *k == sh.key) {
            *out = b;
            return Ok(());
        }
        let (cap, name, hint) = if mode == FEP_MODE_NORMAL {
            (ep.nvl_bytes + ep.rdma_bytes, "num_nvl_bytes + num_rdma_bytes", "")
        } else {
            (ep.rdma_bytes, "num_rdma_bytes", " (DeepEP's get_low_latency_rdma_size_hint)")
        };
        if cap != 0 && sh.need > cap {
            return Err(Error::arg(
                name,
                format!(
                    "{cap} bytes, but this shape ({}) needs {}; size the fep_ep with \
                     fep_ep_need_bytes{hint}",
                    sh.what, sh.need
                ),
            ));
        }
        let b = create_over(&sh.cfg, ep.boot.clone())?;
        // Owned from here on, whatever fails next: fep_ep_destroy frees it.
        if !super::live::set_owner(b, "fep_ep") {
            return Err(Error::Other("a new buffer is not in the live registry".into()));
        }
        ep.bufs.push((sh.key, b));
        if let (Some(comm), Some(g)) = (ep.comm.as_ref(), (*b).gpu.as_mut()) {
            g.share_comm(comm)?;
        }
        *out = b;
        Ok(())
    })
}

/// Bytes per rank the buffer of a shape needs, as [`fep_ep_buffer`] checks them against the
/// capacity: DeepEP's size hints for C callers (`get_nvl_buffer_size_hint` /
/// `get_rdma_buffer_size_hint` for normal mode, whose shapes may use `num_nvl_bytes +
/// num_rdma_bytes` in any split; `get_low_latency_rdma_size_hint` for low latency, against
/// `num_rdma_bytes`). `cfg`: the configuration the object will be created with (its backend and
/// chunking change the answer; every field is checked; its rank fields are not used), `num_ranks`
/// the world size (1..=2^20), the shape as `fep_ep_buffer` takes it (and checks it). No
/// communication. Size a `fep_ep` for several shapes with the largest need of each mode.
///
/// # Safety
/// `cfg` and `bytes` must be valid pointers.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn fep_ep_need_bytes(
    cfg: *const fep_ep_config,
    num_ranks: i32,
    mode: i32,
    num_experts: i32,
    hidden: i32,
    num_topk: i32,
    dispatch_dtype: i32,
    max_tokens_per_rank: i32,
    bytes: *mut u64,
) -> fep_status {
    guard(|| {
        let bytes = bytes.as_mut().ok_or_else(|| Error::arg("bytes", "NULL pointer"))?;
        let e = read_ep_config(cfg)?;
        if num_ranks < 1 || num_ranks as usize > MAX_WORLD {
            return Err(Error::arg("num_ranks", format!("{num_ranks} not in 1..={MAX_WORLD}")));
        }
        // The rank fields are not used here, but must be in range (as fep_ep_create has them).
        for (name, v, least) in [
            ("rank", e.rank, -1),
            ("num_ranks", e.num_ranks, -1),
            ("ranks_per_node", e.ranks_per_node, 0),
            ("local_rank", e.local_rank, -1),
        ] {
            if v < least {
                return Err(Error::arg(name, format!("{v}: must be >= {least}")));
            }
        }
        if e.num_ranks == 0 {
            return Err(Error::arg("num_ranks", "0: must be positive (or -1)"));
        }
        if !(0..=1).contains(&e.internode_hierarchy) {
            return Err(Error::arg(
                "internode_hierarchy",
                format!("{}: 1 (on) or 0 (off)", e.internode_hierarchy),
            ));
        }
        let mut base = base_config(&e);
        // The world of the question, one rank per node; the hierarchy changes no size.
        (base.rank, base.num_ranks, base.ranks_per_node, base.local_rank) = (0, num_ranks, 1, 0);
        base.internode_hierarchy = 0;
        *bytes =
            shape(&base, mode, num_experts, hidden, num_topk, dispatch_dtype, max_tokens_per_rank)?
                .need;
        Ok(())
    })
}

/// This object's rank, world size, ranks per node, number of buffers created so far, and (GPU
/// backend) the communication stream every one of its buffers reports (`fep_gpu_info`): a
/// non-blocking `CUstream` valid for the rest of the process; NULL on the host backend. Outputs
/// may be NULL.
///
/// # Safety
/// `ep` must come from `fep_ep_create`; the outputs must be valid or NULL.
#[no_mangle]
pub unsafe extern "C" fn fep_ep_info(
    ep: *const fep_ep,
    rank: *mut i32,
    num_ranks: *mut i32,
    ranks_per_node: *mut i32,
    num_buffers: *mut i32,
    comm_stream: *mut *mut c_void,
) -> fep_status {
    guard(|| {
        let ep = super::live::get(ep, "ep")?;
        let n =
            i32::try_from(ep.bufs.len()).map_err(|_| Error::arg("ep", "buffers exceed int32"))?;
        for (p, v) in [
            (rank, ep.base.rank),
            (num_ranks, ep.base.num_ranks),
            (ranks_per_node, ep.base.ranks_per_node),
            (num_buffers, n),
        ] {
            if let Some(p) = p.as_mut() {
                *p = v;
            }
        }
        if let Some(c) = comm_stream.as_mut() {
            *c = ep.comm.as_ref().map_or(std::ptr::null_mut(), |s| s.as_raw() as *mut c_void);
        }
        Ok(())
    })
}

/// Destroys every buffer of the object in creation order (each a bounded barrier with the other
/// ranks, then its teardown; a failure does not stop the others, the first is returned) and
/// leaves the bootstrap. Collective. NULL is a no-op; the object and its buffers are invalid
/// afterwards, whatever the status (a second destroy is refused). Handles and ops the caller
/// still holds are freed by their own `_destroy` calls, before or after.
///
/// # Safety
/// `ep` must come from `fep_ep_create` and not be used afterwards.
#[no_mangle]
pub unsafe extern "C" fn fep_ep_destroy(ep: *mut fep_ep) -> fep_status {
    guard(|| {
        if ep.is_null() {
            return Ok(());
        }
        let mut e = super::live::take(ep, "ep")?;
        let mut first = None;
        for (_, b) in e.bufs.drain(..) {
            let res = super::live::take_owned(b, "buf").and_then(destroy_boxed);
            if let (Err(err), None) = (res, &first) {
                first = Some(err);
            }
        }
        // The stream goes back to the process's kept ones only once no buffer reports it.
        e.comm.take();
        drop(e);
        first.map_or(Ok(()), Err)
    })
}
