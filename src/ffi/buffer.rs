//! The Buffer part of the C ABI: config, size hints, create/destroy, normal dispatch (two-step
//! and `num_worst_tokens` forms) and combine.
//!
//! One file: it defines the C structs the whole ABI passes (`fep_config`, `fep_tensor`,
//! `fep_buffer`, `fep_handle`) and their checks, which ffi/gpu.rs reuses, next to the entry points
//! that create and destroy them.
//!
//! Ownership: `fep_buffer_create` returns a buffer the caller frees with `fep_buffer_destroy`;
//! `fep_dispatch` returns a handle the caller frees with `fep_handle_destroy` (after its last
//! use as a cached handle or by `fep_combine`). Tensors are borrowed for the call only.

use std::ffi::CStr;
use std::os::raw::{c_char, c_int, c_void};
use std::sync::Arc;
use std::time::Duration;

use super::{guard, usize_arg, FEP_ABI_VERSION};
use crate::bootstrap::{Bootstrap, CallbackBootstrap, TcpStore};
use crate::ep::buffer::DispatchOutput;
use crate::ep::buffer::{
    Backend, Buffer, BufferOptions, CombineArgs, DispatchArgs, OwnedTokens, Tokens,
};
use crate::ep::gpu::GpuOptions;
use crate::ep::handle::DispatchHandle;
use crate::ep::hier_gpu::GpuHierBuffer;
use crate::error::Error;
use crate::protocol::config::{DispatchDtype, EpConfig, EpSettings};

/// `fep_tensor.dtype`: bf16 (as 16-bit words).
pub const FEP_DTYPE_BF16: i32 = 0;
/// `fep_tensor.dtype`: fp8 e4m3fn bytes.
pub const FEP_DTYPE_FP8_E4M3: i32 = 1;
/// `fep_tensor.dtype`: float32.
pub const FEP_DTYPE_F32: i32 = 2;
/// `fep_tensor.dtype`: int64.
pub const FEP_DTYPE_I64: i32 = 3;
/// `fep_tensor.dtype`: int32.
pub const FEP_DTYPE_I32: i32 = 4;
/// `fep_tensor.dtype`: bool (one byte).
pub const FEP_DTYPE_BOOL: i32 = 5;

/// `fep_config.backend`: CPU threads over host memory (no GPU needed).
pub const FEP_BACKEND_HOST: i32 = 0;
/// `fep_config.backend`: CUDA kernels.
pub const FEP_BACKEND_GPU: i32 = 1;

/// A dense, row-major tensor: data pointer, dtype (`FEP_DTYPE_*`) and shape (`ndim` of 0..=4
/// extents, none negative). A tensor is refused, naming its argument, for a wrong dtype, ndim
/// or extent, a NULL or misaligned `data` with elements, or a shape whose bytes would exceed
/// `PTRDIFF_MAX` (no slice that large can exist, whatever the pointer).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct fep_tensor {
    pub data: *mut c_void,
    pub dtype: i32,
    pub ndim: i32,
    pub shape: [i64; 4],
}

/// Buffer configuration. Begins with its size and version (fill them with `fep_config_init`);
/// zero fields take their defaults, -1 rank fields come from the
/// environment (torchrun variables) or the all-gather callback's caller.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct fep_config {
    /// `sizeof(fep_config)`.
    pub struct_size: u32,
    /// `FEP_ABI_VERSION`.
    pub version: u32,
    /// This rank; -1: `RANK`.
    pub rank: i32,
    /// World size; -1: `WORLD_SIZE`.
    pub num_ranks: i32,
    /// Ranks per node; 0: `LOCAL_WORLD_SIZE` (or up to 8 dividing the world).
    pub ranks_per_node: i32,
    /// Rank within the node; -1: `LOCAL_RANK` (or rank % ranks_per_node).
    pub local_rank: i32,
    pub num_experts: i32,
    pub hidden: i32,
    pub num_topk: i32,
    /// Low-latency capacity; 0: 128.
    pub max_tokens_per_rank: i32,
    /// `FEP_DTYPE_BF16` or `FEP_DTYPE_FP8_E4M3`.
    pub dispatch_dtype: i32,
    /// SM budget; 0: 20.
    pub num_sms: i32,
    /// Normal-mode chunk tokens; 0: the backend's default (host 64, GPU 16).
    pub chunk_tokens: i32,
    /// Normal-mode slots per peer; 0: the backend's default (host 4; GPU 32 up to 8 ranks,
    /// else 16).
    pub slots_per_peer: i32,
    /// `FEP_BACKEND_HOST` or `FEP_BACKEND_GPU`.
    pub backend: i32,
    pub reserved: i32,
    /// Bound on every wait, seconds; 0: 60.
    pub timeout_s: f64,
    /// libfabric provider ("shm", "tcp;ofi_rxm", "efa", ...); NULL: `FI_PROVIDER`, else "shm".
    /// On the GPU backend, the provider of both modes' proxy lanes to other nodes. UTF-8, at
    /// most 256 bytes, no control characters, not blank.
    pub provider: *const c_char,
    // ---- Appended after the first release (a caller whose `struct_size` ends before a field
    // gets that field's default; see `FEP_CONFIG_V1_SIZE`).
    /// `FEP_BACKEND_GPU`: CUDA device ordinal; -1: `LOCAL_RANK` (or 0 without it).
    pub device: i32,
    /// `FEP_BACKEND_GPU`: dispatch handles (4) reserved at creation for up to this many input
    /// tokens, so steps allocate no device memory; 0: 4096; -1: none.
    pub gpu_reserve_tokens: i32,
    /// `FEP_BACKEND_GPU`, normal mode across nodes (`ranks_per_node < num_ranks`): 1 = DeepEP's
    /// hierarchy (`ep::hier_gpu`: one copy of a token per destination node, then the gateway's
    /// fan-out inside its node), 0 = direct per-rank sends (the default). Low-latency mode
    /// always sends directly.
    pub internode_hierarchy: i32,
    /// `FEP_BACKEND_GPU`: which modes' buffers to allocate, `FEP_MODE_NORMAL` |
    /// `FEP_MODE_LOW_LATENCY`; 0: both. A call of a mode not allocated is `FEP_ERR_INVALID_ARGUMENT`.
    /// The host backend always has both.
    pub modes: i32,
    /// Low-latency mode: 1 = DeepEP's `enable_shrink` (a rank that stalls for the timeout is
    /// masked instead of failing the call; `fep_ll_update_mask` / `fep_ll_query_mask` /
    /// `fep_ll_clean_mask`), 0 = off (the default). `FEP_BACKEND_GPU` takes it with every rank
    /// on one node (`ranks_per_node == num_ranks`); a rank cannot mask itself there.
    pub enable_shrink: i32,
    pub reserved2: i32,
}

/// `fep_config.modes`: normal mode (dispatch / combine).
pub const FEP_MODE_NORMAL: i32 = 1;
/// `fep_config.modes`: low-latency mode.
pub const FEP_MODE_LOW_LATENCY: i32 = 2;

/// `struct_size` of the first `fep_config` (up to and including `provider`): still accepted;
/// the fields after it take their defaults.
pub const FEP_CONFIG_V1_SIZE: u32 = 80;

const _: () = assert!(std::mem::offset_of!(fep_config, device) == FEP_CONFIG_V1_SIZE as usize);

/// What a configuration needs, per rank.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct fep_size_hints {
    /// Normal mode: receive + send staging + notify bytes (independent of the token count).
    pub normal_bytes: u64,
    /// Low latency: both alternating buffer sets.
    pub ll_bytes: u64,
    /// Memory regions the normal buffers need at `FEP_MR_MAX_BYTES` (default 1 GiB) each.
    pub normal_regions: u64,
    pub ll_regions: u64,
}

/// Equal-length all-gather supplied by the caller (e.g. over a torch process group): `send` has
/// `len` bytes; `recv` has `len * num_ranks`, rank r's contribution at `r * len`. Return 0 on
/// success. It must carry its own timeout.
pub type fep_allgather_fn = Option<
    unsafe extern "C" fn(
        send: *const c_void,
        len: usize,
        recv: *mut c_void,
        user: *mut c_void,
    ) -> c_int,
>;

/// An EP buffer (opaque).
pub struct fep_buffer {
    pub(crate) inner: Option<Buffer>,
    /// GPU backend state (handle pool, join events); `None` on the host backend.
    pub(crate) gpu: Option<super::gpu::GpuState>,
}

/// A normal dispatch's handle (opaque): on the host backend with, until copied out, its
/// outputs; on the GPU backend the device-side plan, returned to its buffer's pool when freed.
pub struct fep_handle {
    pub(crate) kind: HandleKind,
}

// NOTES: every fep_handle is boxed already; the variants' size difference costs nothing.
#[allow(clippy::large_enum_variant)]
pub(crate) enum HandleKind {
    Host { handle: DispatchHandle, out: Option<DispatchOutput> },
    Gpu(super::gpu::PooledHandle),
    GpuHier(super::gpu::PooledHierHandle),
}

impl fep_handle {
    fn host(&self) -> Result<&DispatchHandle, Error> {
        match &self.kind {
            HandleKind::Host { handle, .. } => Ok(handle),
            HandleKind::Gpu(_) | HandleKind::GpuHier(_) => {
                Err(Error::arg("handle", "a GPU backend handle: use the fep_gpu_* calls"))
            }
        }
    }
}

/// Fills `cfg` with its size, version and defaults (zero / -1 fields).
///
/// # Safety
/// `cfg` must point at a writable `fep_config`.
#[no_mangle]
pub unsafe extern "C" fn fep_config_init(cfg: *mut fep_config) -> super::fep_status {
    guard(|| {
        let c = cfg.as_mut().ok_or_else(|| Error::arg("cfg", "NULL pointer"))?;
        *c = fep_config {
            struct_size: std::mem::size_of::<fep_config>() as u32,
            version: FEP_ABI_VERSION,
            rank: -1,
            num_ranks: -1,
            ranks_per_node: 0,
            local_rank: -1,
            num_experts: 0,
            hidden: 0,
            num_topk: 0,
            max_tokens_per_rank: 0,
            dispatch_dtype: FEP_DTYPE_BF16,
            num_sms: 0,
            chunk_tokens: 0,
            slots_per_peer: 0,
            backend: FEP_BACKEND_HOST,
            reserved: 0,
            timeout_s: 0.0,
            provider: std::ptr::null(),
            device: -1,
            gpu_reserve_tokens: 0,
            internode_hierarchy: 0,
            modes: 0,
            enable_shrink: 0,
            reserved2: 0,
        };
        Ok(())
    })
}

fn env_usize(var: &'static str) -> Result<usize, Error> {
    let v = std::env::var(var).map_err(|_| {
        Error::arg("cfg", format!("{var} is not set and the config leaves it to the environment"))
    })?;
    v.parse().map_err(|_| Error::arg("cfg", format!("{var}={v:?} is not a non-negative integer")))
}

pub(crate) struct Resolved {
    pub(crate) settings: EpSettings,
    pub(crate) local_rank: usize,
    backend: Backend,
    provider: String,
    /// The raw config (fields past the caller's `struct_size` at their defaults).
    raw: fep_config,
}

/// Longest `fep_config.provider` accepted (libfabric's names, lists included, are far shorter).
const MAX_PROVIDER_LEN: usize = 256;

/// Reads a caller's config: the first `struct_size` bytes (at least `FEP_CONFIG_V1_SIZE`, at
/// most this library's `sizeof(fep_config)`); later fields keep `fep_config_init`'s defaults.
unsafe fn read_config(cfg: *const fep_config) -> Result<fep_config, Error> {
    if cfg.is_null() {
        return Err(Error::arg("cfg", "NULL pointer"));
    }
    // SAFETY: every caller's struct has at least the 8-byte size/version header.
    let (size, version) = (
        std::ptr::read_unaligned(cfg.cast::<u32>()),
        std::ptr::read_unaligned(cfg.cast::<u32>().add(1)),
    );
    let ours = std::mem::size_of::<fep_config>() as u32;
    if version != FEP_ABI_VERSION || size < FEP_CONFIG_V1_SIZE || size > ours || size % 4 != 0 {
        return Err(Error::arg(
            "cfg",
            format!(
                "version {version} / struct_size {size}: this library is ABI {FEP_ABI_VERSION} \
                 with a {}-byte fep_config ({FEP_CONFIG_V1_SIZE} bytes and up accepted; use \
                 fep_config_init)",
                std::mem::size_of::<fep_config>()
            ),
        ));
    }
    let mut c = std::mem::MaybeUninit::<fep_config>::uninit();
    fep_config_init(c.as_mut_ptr());
    let mut c = c.assume_init();
    let n = (size as usize).min(std::mem::size_of::<fep_config>());
    // SAFETY: the caller's struct has `size` bytes; we copy at most our own size.
    std::ptr::copy_nonoverlapping(cfg.cast::<u8>(), (&mut c as *mut fep_config).cast::<u8>(), n);
    c.struct_size = std::mem::size_of::<fep_config>() as u32;
    Ok(c)
}

pub(crate) unsafe fn resolve(cfg: *const fep_config) -> Result<Resolved, Error> {
    let raw = read_config(cfg)?;
    let c = &raw;
    // Fields whose 0 (or -1) means "the default": any other negative is a mistake, not a
    // request for the default.
    for (name, v, least) in [
        ("rank", c.rank, -1),
        ("num_ranks", c.num_ranks, -1),
        ("ranks_per_node", c.ranks_per_node, 0),
        ("local_rank", c.local_rank, -1),
        ("max_tokens_per_rank", c.max_tokens_per_rank, 0),
        ("num_sms", c.num_sms, 0),
        ("chunk_tokens", c.chunk_tokens, 0),
        ("slots_per_peer", c.slots_per_peer, 0),
        ("device", c.device, -1),
        ("gpu_reserve_tokens", c.gpu_reserve_tokens, -1),
    ] {
        if v < least {
            return Err(Error::arg(name, format!("{v}: must be >= {least}")));
        }
    }
    if !(0..=1).contains(&c.internode_hierarchy) {
        return Err(Error::arg(
            "internode_hierarchy",
            format!("{}: 1 (on) or 0 (off)", c.internode_hierarchy),
        ));
    }
    if !(0..=1).contains(&c.enable_shrink) {
        return Err(Error::arg("enable_shrink", format!("{}: 1 (on) or 0 (off)", c.enable_shrink)));
    }
    if !(0..=FEP_MODE_NORMAL | FEP_MODE_LOW_LATENCY).contains(&c.modes) {
        return Err(Error::arg(
            "modes",
            format!("{}: FEP_MODE_NORMAL (1) | FEP_MODE_LOW_LATENCY (2), or 0 for both", c.modes),
        ));
    }
    if !c.timeout_s.is_finite() || c.timeout_s < 0.0 {
        return Err(Error::arg(
            "timeout_s",
            format!("{}: must be finite and >= 0 (0: the default)", c.timeout_s),
        ));
    }
    let pos = |name: &'static str, v: i32| -> Result<usize, Error> {
        if v <= 0 {
            Err(Error::arg(name, format!("{v}: must be positive")))
        } else {
            Ok(v as usize)
        }
    };
    let rank = if c.rank < 0 { env_usize("RANK")? } else { c.rank as usize };
    let num_ranks =
        if c.num_ranks < 0 { env_usize("WORLD_SIZE")? } else { pos("num_ranks", c.num_ranks)? };
    let mut s = EpSettings::new(
        rank,
        num_ranks,
        pos("num_experts", c.num_experts)?,
        pos("hidden", c.hidden)?,
        pos("num_topk", c.num_topk)?,
    );
    if c.ranks_per_node > 0 {
        s.ranks_per_node = c.ranks_per_node as usize;
    } else if let Ok(v) = env_usize("LOCAL_WORLD_SIZE") {
        s.ranks_per_node = v;
    }
    if c.max_tokens_per_rank > 0 {
        s.max_tokens_per_rank = c.max_tokens_per_rank as usize;
    }
    s.dispatch_dtype = match c.dispatch_dtype {
        FEP_DTYPE_BF16 => DispatchDtype::Bf16,
        FEP_DTYPE_FP8_E4M3 => DispatchDtype::Fp8E4m3,
        d => {
            return Err(Error::arg(
                "dispatch_dtype",
                format!("{d}: use FEP_DTYPE_BF16 or FEP_DTYPE_FP8_E4M3"),
            ))
        }
    };
    if c.num_sms > 0 {
        s.num_sms = c.num_sms as usize;
    }
    if c.chunk_tokens > 0 {
        s.chunk_tokens = c.chunk_tokens as usize;
    }
    if c.slots_per_peer > 0 {
        s.slots_per_peer = c.slots_per_peer as usize;
    }
    if c.timeout_s > 0.0 {
        s.timeout = Duration::try_from_secs_f64(c.timeout_s)
            .map_err(|e| Error::arg("timeout_s", e.to_string()))?;
    }
    let backend = match c.backend {
        FEP_BACKEND_HOST => Backend::Host,
        FEP_BACKEND_GPU => Backend::Gpu,
        b => {
            return Err(Error::arg(
                "backend",
                format!("{b}: use FEP_BACKEND_HOST or FEP_BACKEND_GPU"),
            ))
        }
    };
    let provider = if c.provider.is_null() {
        std::env::var("FI_PROVIDER").unwrap_or_else(|_| "shm".into())
    } else {
        let p = CStr::from_ptr(c.provider)
            .to_str()
            .map_err(|_| Error::arg("provider", "not UTF-8"))?
            .to_string();
        if p.trim().is_empty() {
            return Err(Error::arg("provider", "empty (NULL picks FI_PROVIDER, else shm)"));
        }
        if p.len() > MAX_PROVIDER_LEN || p.chars().any(char::is_control) {
            return Err(Error::arg(
                "provider",
                format!(
                    "{} bytes{}: a libfabric provider name is at most {MAX_PROVIDER_LEN} \
                     printable bytes",
                    p.len(),
                    if p.chars().any(char::is_control) { " with control characters" } else { "" }
                ),
            ));
        }
        p
    };
    let local_rank = if c.local_rank >= 0 {
        c.local_rank as usize
    } else {
        env_usize("LOCAL_RANK").unwrap_or(rank % s.ranks_per_node.max(1))
    };
    // Every field's range now, before any bootstrap or allocation (the errors name the field).
    s.validate()?;
    if local_rank >= s.ranks_per_node {
        return Err(Error::arg(
            "local_rank",
            format!("{local_rank} not in 0..{} (ranks_per_node)", s.ranks_per_node),
        ));
    }
    let hier = c.internode_hierarchy;
    if hier == 1 && (backend != Backend::Gpu || s.ranks_per_node >= s.num_ranks) {
        return Err(Error::arg(
            "internode_hierarchy",
            format!(
                "{hier}: 1 (on) is for the GPU backend across nodes (ranks_per_node {} < \
                 num_ranks {}), 0 off",
                s.ranks_per_node, s.num_ranks
            ),
        ));
    }
    if c.enable_shrink == 1 && backend == Backend::Gpu && s.ranks_per_node < s.num_ranks {
        return Err(Error::arg(
            "enable_shrink",
            format!(
                "1 with FEP_BACKEND_GPU needs every rank on one node (ranks_per_node {} < \
                 num_ranks {}): peers on other nodes go through the proxy lane, which does not \
                 skip masked ranks (the host backend's shrink mode does)",
                s.ranks_per_node, s.num_ranks
            ),
        ));
    }
    Ok(Resolved { settings: s, local_rank, backend, provider, raw })
}

/// Bytes and memory regions a configuration needs per rank (no communication). `cfg` is
/// validated as by [`fep_buffer_create`].
///
/// # Safety
/// `cfg` and `out` must be valid pointers.
#[no_mangle]
pub unsafe extern "C" fn fep_get_size_hints(
    cfg: *const fep_config,
    out: *mut fep_size_hints,
) -> super::fep_status {
    guard(|| {
        let r = resolve(cfg)?;
        let out = out.as_mut().ok_or_else(|| Error::arg("out", "NULL pointer"))?;
        let c = EpConfig::new(r.settings)?;
        let max_region = std::env::var("FEP_MR_MAX_BYTES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1u64 << 30);
        *out = fep_size_hints {
            normal_bytes: c.normal_recv_bytes() + c.normal_send_bytes() + c.normal_notify_bytes(),
            ll_bytes: c.ll_buffer_bytes(),
            normal_regions: c.normal_num_regions(max_region)?,
            ll_regions: c.ll_num_regions(max_region)?,
        };
        Ok(())
    })
}

/// Creates a buffer: validates `cfg` (every field's range, `rank < num_ranks`, `local_rank <
/// ranks_per_node`, `ranks_per_node` dividing `num_ranks`, before any communication; the
/// message names the field), bootstraps (through `allgather` when given, else the
/// torchrun/PyTorchJob environment variables), exchanges a config hash (a mismatch is
/// `FEP_ERR_CONFIG_MISMATCH` naming the rank), allocates, registers and connects.
///
/// # Safety
/// `cfg` and `out` must be valid; `allgather` (if given) must be callable with `user` from this
/// thread for the duration of the call.
#[no_mangle]
pub unsafe extern "C" fn fep_buffer_create(
    cfg: *const fep_config,
    allgather: fep_allgather_fn,
    user: *mut c_void,
    out: *mut *mut fep_buffer,
) -> super::fep_status {
    guard(|| {
        let out = out.as_mut().ok_or_else(|| Error::arg("out", "NULL pointer"))?;
        *out = std::ptr::null_mut();
        let r = resolve(cfg)?;
        let s = &r.settings;
        let boot: Arc<dyn Bootstrap> = match allgather {
            // NOTES: the pointer is only used during fep_buffer_create (the Buffer's connect
            // phase); later collectives of the Buffer (destroy's barrier) use it too, so the
            // caller's callback must stay valid until fep_buffer_destroy returns.
            Some(f) => Arc::new(CallbackBootstrap::new(
                s.rank,
                s.num_ranks,
                r.local_rank,
                s.ranks_per_node,
                caller_gather(f, user),
            )?),
            None => Arc::new(TcpStore::from_env(s.timeout)?),
        };
        *out = create_on(r, boot)?;
        Ok(())
    })
}

/// A caller's `fep_allgather_fn` and its `user` pointer as the bootstrap's all-gather.
pub(crate) fn caller_gather(
    f: unsafe extern "C" fn(*const c_void, usize, *mut c_void, *mut c_void) -> c_int,
    user: *mut c_void,
) -> crate::bootstrap::AllGatherFn {
    let user = user as usize;
    Box::new(move |send: &[u8], recv: &mut [u8]| {
        // SAFETY: the caller promised a callable `f` for `user` while the object lives.
        let rc = unsafe {
            f(send.as_ptr().cast(), send.len(), recv.as_mut_ptr().cast(), user as *mut c_void)
        };
        if rc == 0 {
            Ok(())
        } else {
            Err(format!("the caller's all-gather returned {rc}"))
        }
    })
}

/// [`fep_buffer_create`] over a bootstrap the caller keeps ([`super::fep_boot_create`]): several
/// buffers of one job (a normal and a low-latency one, one per model shape) share one store
/// connection. `cfg`'s rank fields of -1 take the bootstrap's.
///
/// # Safety
/// `cfg`, `boot` and `out` must be valid; `boot` must outlive the buffer.
#[no_mangle]
pub unsafe extern "C" fn fep_buffer_create_boot(
    cfg: *const fep_config,
    boot: *const super::fep_boot,
    out: *mut *mut fep_buffer,
) -> super::fep_status {
    guard(|| {
        let out = out.as_mut().ok_or_else(|| Error::arg("out", "NULL pointer"))?;
        *out = std::ptr::null_mut();
        let boot = super::live::get(boot, "boot")?.get()?;
        *out = create_over(cfg, boot)?;
        Ok(())
    })
}

/// [`fep_buffer_create_boot`]'s work over a bootstrap (also `fep_ep`'s, over its own).
pub(crate) unsafe fn create_over(
    cfg: *const fep_config,
    boot: Arc<dyn Bootstrap>,
) -> Result<*mut fep_buffer, Error> {
    let mut raw = read_config(cfg)?;
    if raw.rank < 0 {
        raw.rank = boot.rank() as i32;
    }
    if raw.num_ranks < 0 {
        raw.num_ranks = boot.world_size() as i32;
    }
    if raw.local_rank < 0 {
        raw.local_rank = boot.local_rank() as i32;
    }
    if raw.ranks_per_node <= 0 {
        raw.ranks_per_node = boot.local_world_size() as i32;
    }
    let r = resolve(&raw)?;
    create_on(r, boot)
}

/// The collective part of buffer creation, over a bootstrap.
fn create_on(r: Resolved, boot: Arc<dyn Bootstrap>) -> Result<*mut fep_buffer, Error> {
    let s = &r.settings;
    let hier = r.raw.internode_hierarchy;
    if boot.rank() != s.rank || boot.world_size() != s.num_ranks {
        return Err(Error::arg(
            "cfg",
            format!(
                "rank {}/{} disagrees with the bootstrap's {}/{}",
                s.rank,
                s.num_ranks,
                boot.rank(),
                boot.world_size()
            ),
        ));
    }
    let (opts, dev, hier_opts) = match r.backend {
        Backend::Host => (
            BufferOptions {
                ll_shrink: r.raw.enable_shrink == 1,
                ..BufferOptions::host(&r.provider)
            },
            None,
            None,
        ),
        Backend::Gpu => {
            let (mut o, dev) = super::gpu::options(&r.raw, r.local_rank)?;
            // The provider to other nodes, for both modes' proxy lanes.
            o.proxy_provider = r.provider.clone();
            o.ll_provider = Some(r.provider.clone());
            // With the hierarchy, normal mode is its stages' and this buffer keeps low
            // latency only.
            let h = (hier == 1 && o.normal).then(|| GpuOptions { low_latency: false, ..o.clone() });
            if h.is_some() {
                o.normal = false;
            }
            o.shrink = r.raw.enable_shrink == 1;
            (BufferOptions { ll_shrink: o.shrink, ..BufferOptions::gpu(o) }, Some(dev), h)
        }
    };
    let cfg = EpConfig::new(r.settings)?;
    let mut buf = Buffer::new(cfg.clone(), boot.clone(), opts)?;
    let gpu = match dev {
        Some(d) => {
            let mut st = super::gpu::GpuState::new(d)?;
            let tokens = match r.raw.gpu_reserve_tokens {
                0 => super::gpu::DEFAULT_RESERVE_TOKENS,
                t if t < 0 => 0,
                t => t as usize,
            };
            if let Some(o) = hier_opts {
                let hb = GpuHierBuffer::new(cfg, boot.clone(), BufferOptions::gpu(o))?;
                st.set_hier(hb);
            }
            if tokens > 0 {
                st.reserve(&mut buf, tokens, super::gpu::RESERVED_HANDLES)?;
            }
            // NOTES: no rank may start a step (whose kernels spin on its peers) while a
            // peer still allocates (its allocation would wait for those kernels): every
            // rank allocates above, then this barrier.
            boot.barrier()?;
            Some(st)
        }
        None => None,
    };
    Ok(super::live::boxed(fep_buffer { inner: Some(buf), gpu }))
}

/// Tears the buffer down (a bounded barrier with the other ranks, then teardown) and frees it.
/// NULL is a no-op. The pointer is invalid afterwards, whatever the status. A buffer from
/// `fep_ep_buffer` is refused (`FEP_ERR_INVALID_ARGUMENT`, nothing freed): its `fep_ep` frees it.
///
/// # Safety
/// `buf` must come from `fep_buffer_create` and not be used afterwards.
#[no_mangle]
pub unsafe extern "C" fn fep_buffer_destroy(buf: *mut fep_buffer) -> super::fep_status {
    guard(|| {
        if buf.is_null() {
            return Ok(());
        }
        destroy_boxed(super::live::take(buf, "buf")?)
    })
}

/// The collective teardown of a buffer taken out of the registry.
pub(crate) fn destroy_boxed(mut b: Box<fep_buffer>) -> Result<(), Error> {
    // The hierarchy's stages first (collective, in the same order on every rank).
    let hier = b.gpu.as_mut().and_then(|g| g.take_hier()).map(|h| h.destroy());
    let res = match b.inner.take() {
        Some(inner) => inner.destroy(),
        None => Ok(()),
    };
    let res = match hier {
        Some(Err(e)) => Err(e),
        _ => res,
    };
    // NOTES: pooled GPU handles are freed here, after the collective teardown (no peer
    // kernel can be spinning any more); handles the caller still holds free their own.
    b.gpu.take();
    res
}

/// Frees a dispatch handle. NULL is a no-op.
///
/// # Safety
/// `handle` must come from `fep_dispatch` and not be used afterwards.
#[no_mangle]
pub unsafe extern "C" fn fep_handle_destroy(handle: *mut fep_handle) {
    super::live::free(handle, "handle");
}

/// `num_worst_tokens` as output rows: at most 2^31 - 1, and the host backend's outputs of that
/// many rows must be allocatable (a probe, so a huge value is an error, not an abort).
fn worst_rows(n: i64, c: &EpConfig) -> Result<usize, Error> {
    if !(0..=i64::from(i32::MAX)).contains(&n) {
        return Err(Error::arg("num_worst_tokens", format!("{n}: must be in [0, 2^31 - 1]")));
    }
    let rows = n as usize;
    let row_bytes = c.hidden * 2 + c.hidden / 128 * 4 + c.num_topk * 12;
    let bytes = rows.checked_mul(row_bytes).ok_or_else(|| {
        Error::arg("num_worst_tokens", format!("{n} rows of {row_bytes} bytes overflow"))
    })?;
    let mut probe: Vec<u8> = Vec::new();
    probe.try_reserve_exact(bytes).map_err(|_| {
        Error::arg(
            "num_worst_tokens",
            format!("{n} rows need {bytes} bytes of output, which cannot be allocated"),
        )
    })?;
    Ok(rows)
}

pub(crate) fn dtype_name(d: i32) -> &'static str {
    match d {
        FEP_DTYPE_BF16 => "bf16",
        FEP_DTYPE_FP8_E4M3 => "fp8_e4m3",
        FEP_DTYPE_F32 => "f32",
        FEP_DTYPE_I64 => "i64",
        FEP_DTYPE_I32 => "i32",
        FEP_DTYPE_BOOL => "bool",
        _ => "unknown",
    }
}

/// Checks a tensor's dtype and shape (`None` = any extent) and returns its element count.
pub(crate) unsafe fn check_tensor(
    name: &'static str,
    t: &fep_tensor,
    dtype: i32,
    shape: &[Option<i64>],
) -> Result<usize, Error> {
    if t.dtype != dtype {
        return Err(Error::arg(
            name,
            format!("dtype {} ({}), expected {}", t.dtype, dtype_name(t.dtype), dtype_name(dtype)),
        ));
    }
    let dims = &t.shape[..(t.ndim.clamp(0, 4) as usize)];
    if t.ndim as usize != shape.len()
        || dims.iter().zip(shape).any(|(d, s)| *d < 0 || s.is_some_and(|s| s != *d))
    {
        return Err(Error::arg(name, format!("shape {dims:?}, expected {shape:?}")));
    }
    let n = dims
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d as usize))
        .ok_or_else(|| Error::arg(name, "size overflows"))?;
    let elem = match dtype {
        FEP_DTYPE_FP8_E4M3 | FEP_DTYPE_BOOL => 1,
        FEP_DTYPE_BF16 => 2,
        FEP_DTYPE_F32 | FEP_DTYPE_I32 => 4,
        _ => 8,
    };
    if n.checked_mul(elem).is_none_or(|b| b > isize::MAX as usize) {
        return Err(Error::arg(name, format!("shape {dims:?} exceeds the address space")));
    }
    Ok(n)
}

pub(crate) unsafe fn view<'a, T>(
    name: &'static str,
    t: *const fep_tensor,
    dtype: i32,
    shape: &[Option<i64>],
) -> Result<(&'a [T], [i64; 4]), Error> {
    let t = t.as_ref().ok_or_else(|| Error::arg(name, "NULL tensor"))?;
    let n = check_tensor(name, t, dtype, shape)?;
    Ok((super::slice_in(name, t.data as *const T, n)?, t.shape))
}

pub(crate) unsafe fn view_mut<'a, T>(
    name: &'static str,
    t: *mut fep_tensor,
    dtype: i32,
    shape: &[Option<i64>],
) -> Result<&'a mut [T], Error> {
    let t = t.as_mut().ok_or_else(|| Error::arg(name, "NULL tensor"))?;
    let n = check_tensor(name, t, dtype, shape)?;
    if n == 0 {
        return Ok(&mut []);
    }
    if t.data.is_null() || (t.data as usize) % std::mem::align_of::<T>() != 0 {
        return Err(Error::arg(name, "NULL or misaligned data"));
    }
    Ok(std::slice::from_raw_parts_mut(t.data as *mut T, n))
}

pub(crate) fn buffer<'a>(buf: *mut fep_buffer) -> Result<&'a mut Buffer, Error> {
    // SAFETY: the caller passes a pointer from fep_buffer_create (checked for NULL).
    unsafe { super::live::get(buf, "buf") }?
        .inner
        .as_mut()
        .ok_or_else(|| Error::arg("buf", "destroyed buffer"))
}

pub(crate) fn no_stream(stream: *mut c_void, buf: &mut Buffer) -> Result<(), Error> {
    if buf.gpu().is_ok() {
        return Err(Error::arg(
            "buf",
            "a GPU backend buffer: use the fep_gpu_* calls (device pointers and a CUstream)",
        ));
    }
    if !stream.is_null() {
        return Err(Error::arg("stream", "the host backend runs on the calling thread: pass NULL"));
    }
    Ok(())
}

/// Normal dispatch, step 1 (DeepEP V1 semantics): sends this rank's tokens and receives its
/// share; `*num_recv_tokens` tells the caller how many rows to allocate for step 2
/// (`fep_handle_copy_out`). `x`: `[T, H]` bf16, or fp8 e4m3 with `x_scales` `[T, H/128]` f32;
/// `topk_idx` `[T, K]` i64 (-1 = none) and `topk_weights` `[T, K]` f32, both NULL when
/// `cached` (a previous dispatch's handle) is given; `num_worst_tokens` 0 = as many rows as
/// arrive. `stream`: a `CUstream` on the GPU backend, NULL on the host backend.
///
/// Refused (`FEP_ERR_INVALID_ARGUMENT`, the message naming the argument): `T` above 2^31 - 1;
/// `x_scales` given with bf16 `x`; a NaN or infinite `topk_weights` or `x_scales` value; a
/// `topk_idx` value outside -1..num_experts (an expert named twice in one token is valid, as in
/// DeepEP: the token goes to its rank once); `expert_alignment` < 1; `num_worst_tokens` outside
/// 0..=2^31 - 1, below the rows received, or more rows than the host can allocate; a
/// `cached` handle together with `topk_idx`/`topk_weights`, of another buffer, or destroyed.
///
/// # Safety
/// Every non-NULL pointer must be valid for the call.
#[no_mangle]
pub unsafe extern "C" fn fep_dispatch(
    buf: *mut fep_buffer,
    x: *const fep_tensor,
    x_scales: *const fep_tensor,
    topk_idx: *const fep_tensor,
    topk_weights: *const fep_tensor,
    cached: *const fep_handle,
    expert_alignment: i32,
    num_worst_tokens: i64,
    stream: *mut c_void,
    out_handle: *mut *mut fep_handle,
    num_recv_tokens: *mut i64,
) -> super::fep_status {
    guard(|| {
        let out_handle =
            out_handle.as_mut().ok_or_else(|| Error::arg("out_handle", "NULL pointer"))?;
        *out_handle = std::ptr::null_mut();
        let b = buffer(buf)?;
        no_stream(stream, b)?;
        let (hidden, k) = (b.config().hidden as i64, b.config().num_topk as i64);
        if !cached.is_null() && (!topk_idx.is_null() || !topk_weights.is_null()) {
            return Err(Error::arg(
                "topk_idx/topk_weights",
                "must be NULL with a cached handle (the handle holds the routing)",
            ));
        }
        let xt = x.as_ref().ok_or_else(|| Error::arg("x", "NULL tensor"))?;
        let tokens = xt.shape[0];
        // Before any tensor is read: DeepEP's token counts are ints.
        if tokens > i64::from(i32::MAX) {
            return Err(Error::arg("x", format!("{tokens} tokens, more than 2^31 - 1")));
        }
        let xs = match xt.dtype {
            FEP_DTYPE_BF16 => {
                if !x_scales.is_null() {
                    return Err(Error::arg("x_scales", "given with bf16 x: must be NULL"));
                }
                Tokens::Bf16(view::<u16>("x", x, FEP_DTYPE_BF16, &[None, Some(hidden)])?.0)
            }
            FEP_DTYPE_FP8_E4M3 => {
                let x = view::<u8>("x", x, FEP_DTYPE_FP8_E4M3, &[None, Some(hidden)])?.0;
                let scales = view::<f32>(
                    "x_scales",
                    x_scales,
                    FEP_DTYPE_F32,
                    &[Some(tokens), Some(hidden / 128)],
                )?
                .0;
                super::check_finite("x_scales", scales)?;
                Tokens::Fp8 { x, scales }
            }
            d => {
                return Err(Error::arg(
                    "x",
                    format!("dtype {d} ({}): use bf16 or fp8_e4m3", dtype_name(d)),
                ))
            }
        };
        let idx = if topk_idx.is_null() {
            None
        } else {
            Some(view::<i64>("topk_idx", topk_idx, FEP_DTYPE_I64, &[Some(tokens), Some(k)])?.0)
        };
        let w = if topk_weights.is_null() {
            None
        } else {
            let w =
                view::<f32>("topk_weights", topk_weights, FEP_DTYPE_F32, &[Some(tokens), Some(k)])?
                    .0;
            super::check_finite("topk_weights", w)?;
            Some(w)
        };
        let cached = match super::live::get_opt(cached, "cached")? {
            Some(h) => Some(h.host().map_err(|e| super::rename_arg(e, "handle", "cached"))?),
            None => None,
        };
        let args = DispatchArgs {
            x: xs,
            topk_idx: idx,
            topk_weights: w,
            layout: None,
            handle: cached,
            expert_alignment: usize_arg("expert_alignment", expert_alignment as i64)?,
            num_worst_tokens: if num_worst_tokens != 0 {
                Some(worst_rows(num_worst_tokens, b.config())?)
            } else {
                None
            },
        };
        let out = b.dispatch(&args).map_err(|e| {
            if cached.is_some() {
                super::rename_arg(e, "handle", "cached")
            } else {
                e
            }
        })?;
        if !num_recv_tokens.is_null() {
            *num_recv_tokens = out.handle.num_out_rows() as i64;
        }
        *out_handle = super::live::boxed(fep_handle {
            kind: HandleKind::Host { handle: out.handle.clone(), out: Some(out) },
        });
        Ok(())
    })
}

/// Normal dispatch, step 2: copies the outputs into caller tensors of `rows` =
/// `*num_recv_tokens` from step 1 (or `num_worst_tokens`): `recv_x` `[rows, H]` (bf16, or fp8
/// with `recv_x_scales` `[rows, H/128]` f32), `recv_topk_idx` `[rows, K]` i64 (local expert ids,
/// -1 where not local), `recv_topk_weights` `[rows, K]` f32, `num_recv_tokens_per_expert`
/// `[local_experts]` i32. Optional outputs may be NULL. Can be called once per handle.
///
/// # Safety
/// Every non-NULL pointer must be valid for the call.
#[no_mangle]
pub unsafe extern "C" fn fep_handle_copy_out(
    handle: *mut fep_handle,
    recv_x: *mut fep_tensor,
    recv_x_scales: *mut fep_tensor,
    recv_topk_idx: *mut fep_tensor,
    recv_topk_weights: *mut fep_tensor,
    num_recv_tokens_per_expert: *mut fep_tensor,
) -> super::fep_status {
    guard(|| {
        let h = super::live::get(handle, "handle")?;
        let HandleKind::Host { out: slot, .. } = &mut h.kind else {
            return Err(Error::arg(
                "handle",
                "a GPU backend handle: fep_gpu_dispatch fills outputs",
            ));
        };
        let out = slot.take().ok_or_else(|| Error::arg("handle", "outputs already copied out"))?;
        let rows = out.handle.num_out_rows() as i64;
        // NOTES: a row width is derived from the output's length, which says nothing when no
        // row arrived: then any width is accepted (a rank that receives nothing passes the
        // same `[0, hidden]` tensors as its peers).
        let width = |len: usize| (rows > 0).then(|| len as i64 / rows);
        let restore = |slot: &mut Option<DispatchOutput>, out| *slot = Some(out);
        let res = (|| -> Result<(), Error> {
            match &out.recv_x {
                OwnedTokens::Bf16(v) => {
                    let hidden = width(v.len());
                    view_mut::<u16>("recv_x", recv_x, FEP_DTYPE_BF16, &[Some(rows), hidden])?
                        .copy_from_slice(v)
                }
                OwnedTokens::Fp8 { x, scales } => {
                    let hidden = width(x.len());
                    view_mut::<u8>("recv_x", recv_x, FEP_DTYPE_FP8_E4M3, &[Some(rows), hidden])?
                        .copy_from_slice(x);
                    if !recv_x_scales.is_null() {
                        view_mut::<f32>(
                            "recv_x_scales",
                            recv_x_scales,
                            FEP_DTYPE_F32,
                            &[Some(rows), width(scales.len())],
                        )?
                        .copy_from_slice(scales);
                    }
                }
            }
            if !recv_topk_idx.is_null() && !out.recv_topk_idx.is_empty() {
                let k = width(out.recv_topk_idx.len());
                view_mut::<i64>("recv_topk_idx", recv_topk_idx, FEP_DTYPE_I64, &[Some(rows), k])?
                    .copy_from_slice(&out.recv_topk_idx);
            }
            if !recv_topk_weights.is_null() && !out.recv_topk_weights.is_empty() {
                let k = width(out.recv_topk_weights.len());
                view_mut::<f32>(
                    "recv_topk_weights",
                    recv_topk_weights,
                    FEP_DTYPE_F32,
                    &[Some(rows), k],
                )?
                .copy_from_slice(&out.recv_topk_weights);
            }
            if !num_recv_tokens_per_expert.is_null() {
                let n = out.num_recv_tokens_per_expert.len() as i64;
                let dst = view_mut::<i32>(
                    "num_recv_tokens_per_expert",
                    num_recv_tokens_per_expert,
                    FEP_DTYPE_I32,
                    &[Some(n)],
                )?;
                for (d, s) in dst.iter_mut().zip(&out.num_recv_tokens_per_expert) {
                    *d = i32::try_from(*s).map_err(|_| {
                        Error::arg("num_recv_tokens_per_expert", "count exceeds int32")
                    })?;
                }
            }
            Ok(())
        })();
        if res.is_err() {
            // Let the caller fix its tensors and try again.
            restore(slot, out);
        }
        res
    })
}

/// Number of rows of the dispatch outputs this handle holds.
///
/// # Safety
/// `handle` must be valid or NULL (returns -1).
#[no_mangle]
pub unsafe extern "C" fn fep_handle_num_recv_tokens(handle: *const fep_handle) -> i64 {
    super::live::get_opt(handle, "handle").ok().flatten().map_or(-1, |h| match &h.kind {
        HandleKind::Host { handle, .. } => handle.num_out_rows() as i64,
        HandleKind::Gpu(p) => p.num_out_rows().map_or(-1, |r| r as i64),
        HandleKind::GpuHier(p) => p.get().map_or(-1, |h| h.num_out_rows() as i64),
    })
}

/// Normal combine with a dispatch handle: `x` `[rows, H]` bf16 (rows as the dispatch's outputs),
/// optional `topk_weights` `[rows, K]` f32; writes `combined_x` `[T, H]` bf16 (per original
/// token, the fp32 sum over the ranks it went to) and, when given, `combined_topk_weights`
/// `[T, K]` f32. `combined_topk_weights` without `topk_weights` is refused (nothing would be
/// written to it), as is a NaN or infinite weight.
///
/// # Safety
/// Every non-NULL pointer must be valid for the call.
#[no_mangle]
pub unsafe extern "C" fn fep_combine(
    buf: *mut fep_buffer,
    handle: *const fep_handle,
    x: *const fep_tensor,
    topk_weights: *const fep_tensor,
    combined_x: *mut fep_tensor,
    combined_topk_weights: *mut fep_tensor,
    stream: *mut c_void,
) -> super::fep_status {
    guard(|| {
        let b = buffer(buf)?;
        no_stream(stream, b)?;
        let h = super::live::get(handle, "handle")?.host()?;
        let (hidden, k) = (b.config().hidden as i64, b.config().num_topk as i64);
        let rows = h.num_out_rows() as i64;
        let xs = view::<u16>("x", x, FEP_DTYPE_BF16, &[Some(rows), Some(hidden)])?.0;
        let w = if topk_weights.is_null() {
            if !combined_topk_weights.is_null() {
                return Err(Error::arg(
                    "combined_topk_weights",
                    "given without topk_weights: nothing would be written (pass NULL)",
                ));
            }
            None
        } else {
            let w =
                view::<f32>("topk_weights", topk_weights, FEP_DTYPE_F32, &[Some(rows), Some(k)])?.0;
            super::check_finite("topk_weights", w)?;
            Some(w)
        };
        let out = b.combine(&CombineArgs { x: xs, handle: h, topk_weights: w })?;
        let t = h.num_tokens() as i64;
        view_mut::<u16>("combined_x", combined_x, FEP_DTYPE_BF16, &[Some(t), Some(hidden)])?
            .copy_from_slice(&out.combined_x);
        if let (false, Some(cw)) =
            (combined_topk_weights.is_null(), out.combined_topk_weights.as_ref())
        {
            view_mut::<f32>(
                "combined_topk_weights",
                combined_topk_weights,
                FEP_DTYPE_F32,
                &[Some(t), Some(k)],
            )?
            .copy_from_slice(cw);
        }
        Ok(())
    })
}

/// This buffer's rank and world size.
///
/// # Safety
/// `buf` must be valid; `rank`/`num_ranks` may be NULL.
#[no_mangle]
pub unsafe extern "C" fn fep_buffer_rank(
    buf: *mut fep_buffer,
    rank: *mut i32,
    num_ranks: *mut i32,
) -> super::fep_status {
    guard(|| {
        let b = buffer(buf)?;
        if let Some(r) = rank.as_mut() {
            *r = b.rank() as i32;
        }
        if let Some(n) = num_ranks.as_mut() {
            *n = b.config().num_ranks as i32;
        }
        Ok(())
    })
}
