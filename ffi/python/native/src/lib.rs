//! `fabric_ep._core`: the Python package's one binding to fabric-ep (a PyO3 extension module,
//! abi3, with the fabric_ep crate linked in).
//!
//! Every function calls the crate's C ABI (`fabric_ep::ffi::fep_*`), which owns the argument
//! checks, the live-object registry (stale and double destroy calls), the handle pools and the
//! bootstrap, so Python sees exactly what a C caller sees. Python passes plain ints (data
//! pointers from `tensor.data_ptr()` / numpy, row counts, stream and event handles); this
//! module builds the `fep_tensor` descriptors and `fep_gpu_order`s from them and the shape
//! constants of one native buffer ([`Calls`]), so the per-call Python side passes only what
//! changes. A failed call raises `fabric_ep.FabricEPError` (or its argument / timeout
//! subclasses), with the call's name, the status and the library's message.
//!
//! Every call that can block (connect, a barrier, a host-backend dispatch waiting for peers, a
//! GPU notify, a sync, a destroy) runs with the GIL released: ranks as threads of one process
//! must be able to run a peer's Python meanwhile. The all-gather callback of
//! `fep_buffer_create` takes the GIL back to call the Python group.

#![allow(clippy::too_many_arguments)]

mod desc;

use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::os::raw::{c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};

use fabric_ep::ffi as c;
use fabric_ep::ffi::{fep_config, fep_status, fep_tensor};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyDict, PyList, PyType};

use desc::{dtype_name, t1, t2, t3, Order, BF16, F32, FP8, I32, I64, NULL_TENSOR_PTR as NT};

// ---------------------------------------------------------------- errors

/// `fabric_ep._errors`' three classes (FabricEPError, FabricEPArgumentError,
/// FabricEPTimeoutError), looked up once.
static ERRORS: PyOnceLock<[Py<PyType>; 3]> = PyOnceLock::new();

fn error_classes(py: Python<'_>) -> PyResult<&[Py<PyType>; 3]> {
    ERRORS.get_or_try_init(py, || {
        let m = py.import("fabric_ep._errors")?;
        let get =
            |n: &str| -> PyResult<Py<PyType>> { Ok(m.getattr(n)?.cast_into::<PyType>()?.unbind()) };
        Ok([get("FabricEPError")?, get("FabricEPArgumentError")?, get("FabricEPTimeoutError")?])
    })
}

fn c_text(p: *const std::os::raw::c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: the library returns NUL-terminated strings that live until the next call on
    // this thread.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// The exception for a failed `call` (reads the thread's `fep_last_error`: call it on the
/// thread that made the call, before any other `fep_*` call).
fn fep_error(py: Python<'_>, call: &str, status: i32) -> PyErr {
    let name = c_text(c::fep_status_string(status));
    let msg = c_text(c::fep_last_error());
    let classes = match error_classes(py) {
        Ok(c) => c,
        Err(e) => return e,
    };
    let cls = match status {
        s if s == c::FEP_ERR_INVALID_ARGUMENT as i32 => &classes[1],
        s if s == c::FEP_ERR_TIMEOUT as i32 => &classes[2],
        _ => &classes[0],
    };
    match cls.bind(py).call1((call, status, name, msg)) {
        Ok(v) => PyErr::from_value(v),
        Err(e) => e,
    }
}

#[inline]
fn check(py: Python<'_>, call: &str, st: fep_status) -> PyResult<()> {
    if st == c::FEP_OK {
        Ok(())
    } else {
        Err(fep_error(py, call, st as i32))
    }
}

// ---------------------------------------------------------------- GIL release

/// Moves a closure holding raw pointers into `Python::detach`: the pointers are the caller's
/// (a buffer, tensors, out-parameters on this stack frame), valid for the call, and the
/// closure runs on this same thread before `detach` returns.
struct AssertSend<F>(F);
// SAFETY: see above: the closure never leaves the calling thread.
unsafe impl<F> Send for AssertSend<F> {}
impl<F> AssertSend<F> {
    fn into_inner(self) -> F {
        self.0
    }
}

#[inline]
fn nogil<R: Send, F: FnOnce() -> R>(py: Python<'_>, f: F) -> R {
    let f = AssertSend(f);
    py.detach(move || (f.into_inner())())
}

#[inline]
fn vp<T>(p: usize) -> *mut T {
    p as *mut T
}

/// An optional descriptor's address (NULL for None).
#[inline]
fn opt(t: &Option<fep_tensor>) -> *mut fep_tensor {
    t.as_ref().map_or(NT, |t| t as *const fep_tensor as *mut fep_tensor)
}

#[inline]
fn at(t: &fep_tensor) -> *mut fep_tensor {
    t as *const fep_tensor as *mut fep_tensor
}

fn i32_arg(name: &str, v: i64) -> PyResult<i32> {
    i32::try_from(v).map_err(|_| {
        PyValueError::new_err(format!("{name}: {v} does not fit a 32-bit int ([-2**31, 2**31))"))
    })
}

// ---------------------------------------------------------------- config

/// `fep_config`'s integer fields as Python sees them (`struct_size` and `version` are the
/// library's, read-only).
const INT_FIELDS: [&str; 20] = [
    "rank",
    "num_ranks",
    "ranks_per_node",
    "local_rank",
    "num_experts",
    "hidden",
    "num_topk",
    "max_tokens_per_rank",
    "dispatch_dtype",
    "num_sms",
    "chunk_tokens",
    "slots_per_peer",
    "backend",
    "device",
    "gpu_reserve_tokens",
    "internode_hierarchy",
    "modes",
    "reserved",
    "enable_shrink",
    "reserved2",
];

fn int_field<'a>(cfg: &'a mut fep_config, name: &str) -> Option<&'a mut i32> {
    Some(match name {
        "rank" => &mut cfg.rank,
        "num_ranks" => &mut cfg.num_ranks,
        "ranks_per_node" => &mut cfg.ranks_per_node,
        "local_rank" => &mut cfg.local_rank,
        "num_experts" => &mut cfg.num_experts,
        "hidden" => &mut cfg.hidden,
        "num_topk" => &mut cfg.num_topk,
        "max_tokens_per_rank" => &mut cfg.max_tokens_per_rank,
        "dispatch_dtype" => &mut cfg.dispatch_dtype,
        "num_sms" => &mut cfg.num_sms,
        "chunk_tokens" => &mut cfg.chunk_tokens,
        "slots_per_peer" => &mut cfg.slots_per_peer,
        "backend" => &mut cfg.backend,
        "device" => &mut cfg.device,
        "gpu_reserve_tokens" => &mut cfg.gpu_reserve_tokens,
        "internode_hierarchy" => &mut cfg.internode_hierarchy,
        "modes" => &mut cfg.modes,
        "reserved" => &mut cfg.reserved,
        "enable_shrink" => &mut cfg.enable_shrink,
        "reserved2" => &mut cfg.reserved2,
        _ => return None,
    })
}

fn default_config(py: Python<'_>) -> PyResult<fep_config> {
    let mut cfg = std::mem::MaybeUninit::<fep_config>::zeroed();
    // SAFETY: a writable fep_config; fep_config_init fills every field.
    let st = unsafe { c::fep_config_init(cfg.as_mut_ptr()) };
    check(py, "fep_config_init", st)?;
    // SAFETY: initialised above (and zeroed before).
    Ok(unsafe { cfg.assume_init() })
}

/// A `fep_config` from `fep_config_init`'s defaults and the dict's fields; the provider string
/// is returned beside it (the config points into it).
fn config_from(
    py: Python<'_>,
    fields: &Bound<'_, PyDict>,
) -> PyResult<(fep_config, Option<CString>)> {
    let mut cfg = default_config(py)?;
    let mut provider = None;
    for (k, v) in fields.iter() {
        let key: String = k.extract().map_err(|_| {
            PyValueError::new_err(format!("config: field names are strings, got {k:?}"))
        })?;
        match key.as_str() {
            "struct_size" | "version" => {
                return Err(PyValueError::new_err(format!(
                    "{key}: set by the library (fep_config_init), not by the caller"
                )))
            }
            "timeout_s" => {
                cfg.timeout_s = v.extract::<f64>().map_err(|_| {
                    PyValueError::new_err(format!("timeout_s: {v} must be a number"))
                })?
            }
            "provider" => {
                if v.is_none() {
                    provider = None;
                } else {
                    let s: String = v.extract().map_err(|_| {
                        PyValueError::new_err(format!("provider: {v} must be a str or None"))
                    })?;
                    provider =
                        Some(CString::new(s).map_err(|_| {
                            PyValueError::new_err("provider: must not contain NUL")
                        })?);
                }
            }
            name => {
                let slot = int_field(&mut cfg, name).ok_or_else(|| {
                    PyValueError::new_err(format!("config: no field {name:?} in fep_config"))
                })?;
                if v.is_instance_of::<pyo3::types::PyBool>() {
                    *slot = i32::from(v.extract::<bool>()?);
                    continue;
                }
                let n: i64 = v.extract().map_err(|_| {
                    PyValueError::new_err(format!("{name}: {v} must be an int in [-2**31, 2**31)"))
                })?;
                *slot = i32_arg(name, n)?;
            }
        }
    }
    cfg.provider = provider.as_ref().map_or(std::ptr::null(), |p| p.as_ptr());
    Ok((cfg, provider))
}

/// `fep_config_init`'s defaults as a dict (every field but `provider`, which is None).
#[pyfunction]
fn config_defaults(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let mut cfg = default_config(py)?;
    let d = PyDict::new(py);
    d.set_item("struct_size", cfg.struct_size)?;
    d.set_item("version", cfg.version)?;
    for name in INT_FIELDS {
        d.set_item(name, *int_field(&mut cfg, name).expect("a listed field"))?;
    }
    d.set_item("timeout_s", cfg.timeout_s)?;
    d.set_item("provider", py.None())?;
    Ok(d)
}

/// `fep_get_size_hints` of a configuration (a dict of `fep_config` fields).
#[pyfunction]
fn size_hints<'py>(py: Python<'py>, cfg: &Bound<'py, PyDict>) -> PyResult<Bound<'py, PyDict>> {
    let (cfg, _provider) = config_from(py, cfg)?;
    let mut out = c::fep_size_hints::default();
    // SAFETY: both point at live structs.
    let st = unsafe { c::fep_get_size_hints(&cfg, &mut out) };
    check(py, "fep_get_size_hints", st)?;
    let d = PyDict::new(py);
    d.set_item("normal_bytes", out.normal_bytes)?;
    d.set_item("ll_bytes", out.ll_bytes)?;
    d.set_item("normal_regions", out.normal_regions)?;
    d.set_item("ll_regions", out.ll_regions)?;
    Ok(d)
}

#[pyfunction]
fn abi_version() -> u32 {
    c::fep_abi_version()
}

// ---------------------------------------------------------------- bootstrap, create, destroy

/// The all-gather callback's state: the Python callable (`gather(bytes) -> bytes`, the ranks'
/// equal-length contributions concatenated in rank order), the group size, and the first
/// exception it raised (chained to the failed call's error).
struct Gather {
    f: Py<PyAny>,
    size: usize,
    err: Option<PyErr>,
}

/// The callback state of each live buffer created over one, by the buffer's address. NOTES: the
/// library calls the callback again after `fep_buffer_create` (the barrier of
/// `fep_buffer_destroy`), so its state lives until that call returns (the buffer is gone then,
/// whatever the status).
static GATHERS: Mutex<Option<HashMap<usize, Box<Gather>>>> = Mutex::new(None);

fn gathers<R>(f: impl FnOnce(&mut HashMap<usize, Box<Gather>>) -> R) -> R {
    let mut g = GATHERS.lock().unwrap_or_else(PoisonError::into_inner);
    f(g.get_or_insert_with(HashMap::new))
}

unsafe extern "C" fn gather_trampoline(
    send: *const c_void,
    len: usize,
    recv: *mut c_void,
    user: *mut c_void,
) -> c_int {
    // NOTES: called from fep_buffer_create on the creating thread, whose GIL is released:
    // take it back for the Python call. A panic must not unwind into the library.
    let r = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: `user` is the Gather that buffer_create passed, alive for that call.
        let g = unsafe { &mut *(user as *mut Gather) };
        Python::attach(|py| -> c_int {
            let res = (|| -> PyResult<()> {
                let data = if len == 0 {
                    PyBytes::new(py, &[])
                } else {
                    // SAFETY: the library hands `len` readable bytes at `send`.
                    PyBytes::new(py, unsafe { std::slice::from_raw_parts(send.cast::<u8>(), len) })
                };
                let out = g.f.bind(py).call1((data,))?;
                let bytes = out.cast::<PyBytes>().map_err(|_| {
                    PyValueError::new_err(format!(
                        "all-gather callback: returned {}, expected bytes",
                        out.get_type().name().map_or_else(|_| "?".into(), |n| n.to_string())
                    ))
                })?;
                let b = bytes.as_bytes();
                let want = len * g.size;
                if b.len() != want {
                    return Err(PyValueError::new_err(format!(
                        "all-gather callback: returned {} bytes, expected {want} ({} ranks of {len})",
                        b.len(),
                        g.size
                    )));
                }
                if want > 0 {
                    // SAFETY: the library hands `len * num_ranks` writable bytes at `recv`.
                    unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), recv.cast::<u8>(), want) };
                }
                Ok(())
            })();
            match res {
                Ok(()) => 0,
                Err(e) => {
                    if g.err.is_none() {
                        g.err = Some(e);
                    }
                    1
                }
            }
        })
    }));
    r.unwrap_or(1)
}

/// `fep_buffer_create`: over `gather` (a callable, see [`Gather`]) when given, else the
/// torchrun variables (the library's own store). Returns the buffer's address.
#[pyfunction]
#[pyo3(signature = (cfg, gather=None))]
fn buffer_create(
    py: Python<'_>,
    cfg: &Bound<'_, PyDict>,
    gather: Option<Py<PyAny>>,
) -> PyResult<usize> {
    let (cfg, _provider) = config_from(py, cfg)?;
    let mut out: *mut c::fep_buffer = std::ptr::null_mut();
    let out_p = &mut out as *mut *mut c::fep_buffer as usize;
    let cfg_p = &cfg as *const fep_config as usize;
    let st = match gather {
        Some(f) => {
            let size = usize::try_from(cfg.num_ranks).unwrap_or(0).max(1);
            // Boxed: its address is the callback's `user` pointer for the buffer's lifetime.
            let mut g = Box::new(Gather { f, size, err: None });
            let gp = &mut *g as *mut Gather as usize;
            // SAFETY: cfg and the out-parameter live on this frame, the callback state on the
            // heap (kept with the buffer below).
            let st = nogil(py, || unsafe {
                c::fep_buffer_create(
                    cfg_p as *const fep_config,
                    Some(gather_trampoline),
                    vp(gp),
                    out_p as *mut *mut c::fep_buffer,
                )
            });
            if st != c::FEP_OK {
                let e = fep_error(py, "fep_buffer_create", st as i32);
                if let Some(cause) = g.err.take() {
                    e.set_cause(py, Some(cause));
                }
                return Err(e);
            }
            gathers(|m| m.insert(out as usize, g));
            st
        }
        None => nogil(py, || unsafe {
            // SAFETY: as above; no callback: the library's store.
            c::fep_buffer_create(
                cfg_p as *const fep_config,
                None,
                std::ptr::null_mut(),
                out_p as *mut *mut c::fep_buffer,
            )
        }),
    };
    check(py, "fep_buffer_create", st)?;
    Ok(out as usize)
}

/// `fep_buffer_create_boot`: a buffer over a bootstrap from [`boot_create`].
#[pyfunction]
fn buffer_create_boot(py: Python<'_>, cfg: &Bound<'_, PyDict>, boot: usize) -> PyResult<usize> {
    let (cfg, _provider) = config_from(py, cfg)?;
    let mut out: *mut c::fep_buffer = std::ptr::null_mut();
    let out_p = &mut out as *mut *mut c::fep_buffer as usize;
    let cfg_p = &cfg as *const fep_config as usize;
    // SAFETY: cfg and the out-parameter live on this frame; the library checks `boot`.
    let st = nogil(py, || unsafe {
        c::fep_buffer_create_boot(
            cfg_p as *const fep_config,
            boot as *const c::fep_boot,
            out_p as *mut *mut c::fep_buffer,
        )
    });
    check(py, "fep_buffer_create_boot", st)?;
    Ok(out as usize)
}

#[pyfunction]
fn buffer_destroy(py: Python<'_>, buf: usize) -> PyResult<()> {
    // SAFETY: the library's registry refuses a stale or foreign pointer.
    let st = nogil(py, || unsafe { c::fep_buffer_destroy(vp(buf)) });
    // The buffer is gone whatever the status (a stale pointer has no state here).
    let gather = if st == c::FEP_ERR_INVALID_ARGUMENT { None } else { gathers(|m| m.remove(&buf)) };
    if st != c::FEP_OK {
        let e = fep_error(py, "fep_buffer_destroy", st as i32);
        if let Some(cause) = gather.and_then(|mut g| g.err.take()) {
            e.set_cause(py, Some(cause));
        }
        return Err(e);
    }
    Ok(())
}

/// `(rank, num_ranks)` of a buffer.
#[pyfunction]
fn buffer_rank(py: Python<'_>, buf: usize) -> PyResult<(i32, i32)> {
    let (mut r, mut n) = (0i32, 0i32);
    // SAFETY: out-parameters on this frame; the library checks `buf`.
    let st = unsafe { c::fep_buffer_rank(vp(buf), &mut r, &mut n) };
    check(py, "fep_buffer_rank", st)?;
    Ok((r, n))
}

#[pyfunction]
fn handle_destroy(py: Python<'_>, handle: usize) {
    // SAFETY: the library's registry ignores NULL and refuses a stale pointer.
    nogil(py, || unsafe { c::fep_handle_destroy(vp(handle)) })
}

#[pyfunction]
fn boot_create(py: Python<'_>, timeout_s: f64) -> PyResult<usize> {
    let mut out: *mut c::fep_boot = std::ptr::null_mut();
    let out_p = &mut out as *mut *mut c::fep_boot as usize;
    // SAFETY: the out-parameter lives on this frame.
    let st = nogil(py, || unsafe { c::fep_boot_create(timeout_s, out_p as *mut *mut c::fep_boot) });
    check(py, "fep_boot_create", st)?;
    Ok(out as usize)
}

/// `(rank, size, local_rank, local_size)` of a bootstrap.
#[pyfunction]
fn boot_rank(py: Python<'_>, boot: usize) -> PyResult<(i32, i32, i32, i32)> {
    let (mut r, mut n, mut lr, mut ln) = (0i32, 0i32, 0i32, 0i32);
    // SAFETY: out-parameters on this frame; the library checks `boot`.
    let st = unsafe { c::fep_boot_rank(vp(boot), &mut r, &mut n, &mut lr, &mut ln) };
    check(py, "fep_boot_rank", st)?;
    Ok((r, n, lr, ln))
}

/// `fep_boot_allgather`: every rank's `data` (equal lengths), concatenated in rank order.
#[pyfunction]
fn boot_allgather<'py>(py: Python<'py>, boot: usize, data: &[u8]) -> PyResult<Bound<'py, PyBytes>> {
    let (_, n, _, _) = boot_rank(py, boot)?;
    let len = data.len();
    let mut recv = vec![0u8; len * usize::try_from(n).unwrap_or(0)];
    let (sp, rp) = (data.as_ptr() as usize, recv.as_mut_ptr() as usize);
    // SAFETY: `data` and `recv` hold len and len * n bytes for the call.
    let st = nogil(py, || unsafe { c::fep_boot_allgather(vp(sp), len, vp(rp), vp(boot)) });
    if st != c::FEP_OK as i32 {
        return Err(fep_error(py, "fep_boot_allgather", st));
    }
    Ok(PyBytes::new(py, &recv))
}

#[pyfunction]
fn boot_destroy(py: Python<'_>, boot: usize) -> PyResult<()> {
    // SAFETY: the library's registry refuses a stale or foreign pointer.
    let st = nogil(py, || unsafe { c::fep_boot_destroy(vp(boot)) });
    check(py, "fep_boot_destroy", st)
}

// ---------------------------------------------------------------- host layout, LL ops

/// `fep_get_dispatch_layout_host`: `topk_idx` `[t, k]` int64 at `idx`; the four outputs
/// (int32 `[r]`, `[r / rpn]`, `[e]`, bool `[t, r]`) at the given addresses.
#[pyfunction]
fn layout_host(
    py: Python<'_>,
    idx: usize,
    t: i64,
    k: i64,
    e: i64,
    r: i64,
    rpn: i64,
    per_rank: usize,
    per_node: usize,
    per_expert: usize,
    in_rank: usize,
) -> PyResult<()> {
    let (k, e, r, rpn) = (
        i32_arg("num_topk", k)?,
        i32_arg("num_experts", e)?,
        i32_arg("num_ranks", r)?,
        i32_arg("ranks_per_node", rpn)?,
    );
    // SAFETY: the caller's arrays hold the sizes above; the library checks NULL/alignment.
    let st = nogil(py, || unsafe {
        c::fep_get_dispatch_layout_host(
            idx as *const i64,
            t,
            k,
            e,
            r,
            rpn,
            vp(per_rank),
            vp(per_node),
            vp(per_expert),
            vp(in_rank),
        )
    });
    check(py, "fep_get_dispatch_layout_host", st)
}

// ---------------------------------------------------------------- GPU layout

/// `fep_gpu_layout_create`: a layout object for `e` experts over `r` ranks of `rpn` per node
/// on CUDA device `device`.
#[pyfunction]
fn gpu_layout_create(py: Python<'_>, device: i64, e: i64, r: i64, rpn: i64) -> PyResult<usize> {
    let (device, e, r, rpn) = (
        i32_arg("device", device)?,
        i32_arg("num_experts", e)?,
        i32_arg("num_ranks", r)?,
        i32_arg("ranks_per_node", rpn)?,
    );
    let mut out: *mut c::fep_gpu_layout = std::ptr::null_mut();
    let op = AssertSend(&mut out as *mut *mut c::fep_gpu_layout);
    // SAFETY: `out` lives on this frame for the call.
    let st =
        nogil(py, move || unsafe { c::fep_gpu_layout_create(device, e, r, rpn, op.into_inner()) });
    check(py, "fep_gpu_layout_create", st)?;
    Ok(out as usize)
}

/// `fep_gpu_layout_run` on `stream`: `topk_idx` `[t, k]` int64 at `idx`; the outputs int32
/// `[r]` at `per_rank`, int32 `[nodes]` at `per_node` (0 on one node), int32 `[e]` at
/// `per_expert`, bool `[t, r]` at `in_rank`. No host synchronisation.
#[pyfunction]
fn gpu_layout_run(
    py: Python<'_>,
    layout: usize,
    idx: usize,
    t: i64,
    k: i64,
    r: i64,
    nodes: i64,
    e: i64,
    per_rank: usize,
    per_node: usize,
    per_expert: usize,
    in_rank: usize,
    stream: usize,
) -> PyResult<()> {
    let ti = t2(idx, I64, t, k);
    let pr = t1(per_rank, I32, r);
    let pn = t1(per_node, I32, nodes);
    let pe = t1(per_expert, I32, e);
    let inr = t2(in_rank, c::FEP_DTYPE_BOOL, t, r);
    let o = Order { stream, wait_stream: 0, wait_event: 0, then_stream: 0 }.raw();
    let pn_ptr = if per_node == 0 { std::ptr::null() } else { &pn as *const fep_tensor };
    // SAFETY: descriptors on this frame; the addresses are the caller's live CUDA tensors on
    // `stream`; the library checks the layout pointer, shapes, dtypes and NULLs. No wait here:
    // the GIL stays held (a launch).
    let st = unsafe { c::fep_gpu_layout_run(vp(layout), &ti, &pr, pn_ptr, &pe, &inr, &o) };
    check(py, "fep_gpu_layout_run", st)
}

/// `fep_gpu_layout_destroy` (waits, bounded, for the object's last launch).
#[pyfunction]
fn gpu_layout_destroy(py: Python<'_>, layout: usize) -> PyResult<()> {
    // SAFETY: the library refuses a stale or foreign pointer.
    let st = nogil(py, || unsafe { c::fep_gpu_layout_destroy(vp(layout)) });
    check(py, "fep_gpu_layout_destroy", st)
}

#[pyfunction]
fn ll_op_destroy(py: Python<'_>, op: usize) {
    // SAFETY: the library ignores NULL and refuses a stale pointer.
    nogil(py, || unsafe { c::fep_ll_op_destroy(vp(op)) })
}

#[pyfunction]
fn gpu_ll_op_destroy(py: Python<'_>, op: usize) {
    // SAFETY: as ll_op_destroy.
    nogil(py, || unsafe { c::fep_gpu_ll_op_destroy(vp(op)) })
}

#[pyfunction]
fn clean_low_latency_buffer(py: Python<'_>, buf: usize) -> PyResult<()> {
    // SAFETY: the library checks `buf`.
    let st = nogil(py, || unsafe { c::fep_clean_low_latency_buffer(vp(buf)) });
    check(py, "fep_clean_low_latency_buffer", st)
}

/// `fep_ll_update_mask` (shrink mode): masks or unmasks `rank` on this rank.
#[pyfunction]
fn ll_update_mask(py: Python<'_>, buf: usize, rank: i64, mask: bool) -> PyResult<()> {
    let r = i32_arg("rank", rank)?;
    // SAFETY: the library checks `buf`.
    let st = nogil(py, || unsafe { c::fep_ll_update_mask(vp(buf), r, mask) });
    check(py, "fep_ll_update_mask", st)
}

/// `fep_ll_query_mask` (shrink mode): which ranks are masked, as a list of 0 / 1.
#[pyfunction]
fn ll_query_mask<'py>(py: Python<'py>, buf: usize, num_ranks: i64) -> PyResult<Bound<'py, PyList>> {
    let n = usize::try_from(num_ranks)
        .map_err(|_| PyValueError::new_err(format!("num_ranks: {num_ranks} is negative")))?;
    let mut v = vec![0i32; n];
    let t = t1(v.as_mut_ptr() as usize, I32, num_ranks);
    // SAFETY: `v` holds num_ranks int32 on this frame; the library checks `buf` and the shape.
    let st = unsafe { c::fep_ll_query_mask(vp(buf), at(&t)) };
    check(py, "fep_ll_query_mask", st)?;
    PyList::new(py, v)
}

/// `fep_ll_clean_mask` (shrink mode): unmasks every rank.
#[pyfunction]
fn ll_clean_mask(py: Python<'_>, buf: usize) -> PyResult<()> {
    // SAFETY: the library checks `buf`.
    let st = nogil(py, || unsafe { c::fep_ll_clean_mask(vp(buf)) });
    check(py, "fep_ll_clean_mask", st)
}

/// `fep_buffer_local_region`: `(address, bytes)` of this rank's own communication memory
/// (`low_latency`: the low-latency buffer, else normal mode's).
#[pyfunction]
fn local_region(py: Python<'_>, buf: usize, low_latency: bool) -> PyResult<(usize, u64)> {
    let region = if low_latency { c::FEP_REGION_LOW_LATENCY } else { c::FEP_REGION_NORMAL };
    let mut data: *mut c_void = std::ptr::null_mut();
    let mut bytes = 0u64;
    // SAFETY: out-parameters on this frame; the library checks `buf`.
    let st = unsafe { c::fep_buffer_local_region(vp(buf), region, &mut data, &mut bytes) };
    check(py, "fep_buffer_local_region", st)?;
    Ok((data as usize, bytes))
}

/// `fep_gpu_sync`: waits (bounded) for `stream` and reports the kernels' recorded errors.
#[pyfunction]
fn gpu_sync(py: Python<'_>, buf: usize, stream: usize) -> PyResult<()> {
    // SAFETY: the library checks `buf`; `stream` is the caller's CUDA stream handle.
    let st = nogil(py, || unsafe { c::fep_gpu_sync(vp(buf), vp(stream)) });
    check(py, "fep_gpu_sync", st)
}

/// `(device, num_sms, comm_stream)` of a GPU buffer.
#[pyfunction]
fn gpu_info(py: Python<'_>, buf: usize) -> PyResult<(i32, i32, usize)> {
    let (mut d, mut sms) = (0i32, 0i32);
    let mut comm: *mut c_void = std::ptr::null_mut();
    // SAFETY: out-parameters on this frame; the library checks `buf`.
    let st = unsafe { c::fep_gpu_info(vp(buf), &mut d, &mut sms, &mut comm) };
    check(py, "fep_gpu_info", st)?;
    Ok((d, sms, comm as usize))
}

// ---------------------------------------------------------------- array addresses

/// CPython's `Py_buffer` (its layout is the stable ABI's since Python 3.11 and unchanged since
/// 3.3; the limited API of older versions does not declare it, so it is declared here).
#[repr(C)]
struct PyBufferView {
    buf: *mut c_void,
    obj: *mut pyo3::ffi::PyObject,
    len: pyo3::ffi::Py_ssize_t,
    itemsize: pyo3::ffi::Py_ssize_t,
    readonly: c_int,
    ndim: c_int,
    format: *mut std::os::raw::c_char,
    shape: *mut pyo3::ffi::Py_ssize_t,
    strides: *mut pyo3::ffi::Py_ssize_t,
    suboffsets: *mut pyo3::ffi::Py_ssize_t,
    internal: *mut c_void,
}

extern "C" {
    fn PyObject_GetBuffer(
        obj: *mut pyo3::ffi::PyObject,
        view: *mut PyBufferView,
        flags: c_int,
    ) -> c_int;
    fn PyBuffer_Release(view: *mut PyBufferView);
}

/// The data address of a C-contiguous buffer (a numpy array): the buffer protocol's, which
/// refuses a non-contiguous array (BufferError / ValueError; the caller then says why).
#[pyfunction]
fn address(obj: &Bound<'_, PyAny>) -> PyResult<usize> {
    // PyBUF_SIMPLE: the data only; numpy still refuses a non-C-contiguous array.
    const PYBUF_SIMPLE: c_int = 0;
    let mut view = std::mem::MaybeUninit::<PyBufferView>::zeroed();
    // SAFETY: a zeroed view filled by CPython on success and released right after.
    unsafe {
        if PyObject_GetBuffer(obj.as_ptr(), view.as_mut_ptr(), PYBUF_SIMPLE) != 0 {
            return Err(PyErr::fetch(obj.py()));
        }
        let p = (*view.as_ptr()).buf as usize;
        PyBuffer_Release(view.as_mut_ptr());
        Ok(p)
    }
}

// ---------------------------------------------------------------- per-buffer calls

/// The calls of one native buffer, with its shape constants: `hidden`, `num_topk`, the token
/// dtype (`FEP_DTYPE_BF16` or `FEP_DTYPE_FP8_E4M3`), local experts `L`, ranks `R`, low-latency
/// capacity `M` (`S = R * M` rows per local expert) and, on the GPU backend, the buffer's
/// communication stream (0 on the host). Each method is one C call (two for none); the
/// buffer's address is passed with every call (the Python side drops it on destroy).
#[pyclass(frozen, module = "fabric_ep._core")]
struct Calls {
    h: i64,
    k: i64,
    g: i64,
    xc: i32,
    l: i64,
    r: i64,
    m: i64,
    comm: usize,
    /// GPU dispatch scratch: recv_src_idx, a cached dispatch's recv_topk_idx and weights.
    scratch: [AtomicUsize; 3],
    /// GPU low latency: byte offsets of src_rank, src_idx, pairs, positions in the routing
    /// allocation.
    ll_offsets: [AtomicUsize; 4],
}

impl Calls {
    fn order(&self, compute: usize, event: usize, async_finish: bool) -> Order {
        Order::before_after(self.comm, compute, event, async_finish)
    }

    fn counts<'py>(&self, py: Python<'py>, v: &[i32]) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, v)
    }
}

#[pymethods]
impl Calls {
    #[new]
    #[pyo3(signature = (hidden, num_topk, dispatch_dtype, local_experts, num_ranks, max_tokens, comm_stream=0))]
    fn new(
        hidden: i64,
        num_topk: i64,
        dispatch_dtype: i32,
        local_experts: i64,
        num_ranks: i64,
        max_tokens: i64,
        comm_stream: usize,
    ) -> PyResult<Self> {
        for (n, v) in [
            ("hidden", hidden),
            ("num_topk", num_topk),
            ("local_experts", local_experts),
            ("num_ranks", num_ranks),
            ("max_tokens", max_tokens),
        ] {
            if !(1..1 << 31).contains(&v) {
                return Err(PyValueError::new_err(format!("{n}: {v} must be in [1, 2**31)")));
            }
        }
        if dispatch_dtype != BF16 && dispatch_dtype != FP8 {
            return Err(PyValueError::new_err(format!(
                "dispatch_dtype: {dispatch_dtype} ({}), expected bf16 or fp8",
                dtype_name(dispatch_dtype)
            )));
        }
        Ok(Calls {
            h: hidden,
            k: num_topk,
            g: hidden / 128,
            xc: dispatch_dtype,
            l: local_experts,
            r: num_ranks,
            m: max_tokens,
            comm: comm_stream,
            scratch: Default::default(),
            ll_offsets: Default::default(),
        })
    }

    // ------------------------------------------------------------ host normal mode

    /// `fep_dispatch` (host): x `[t, H]` at `x`, scales `[t, H / 128]` (fp8 only), routing
    /// `[t, K]` (None with a cached handle). Returns `(handle, rows)`.
    #[pyo3(signature = (buf, x, t, x_scales, topk_idx, topk_weights, cached, expert_alignment, num_worst_tokens))]
    fn dispatch(
        &self,
        py: Python<'_>,
        buf: usize,
        x: usize,
        t: i64,
        x_scales: Option<usize>,
        topk_idx: Option<usize>,
        topk_weights: Option<usize>,
        cached: Option<usize>,
        expert_alignment: i64,
        num_worst_tokens: i64,
    ) -> PyResult<(usize, i64)> {
        let ea = i32_arg("expert_alignment", expert_alignment)?;
        let tx = t2(x, self.xc, t, self.h);
        let ts = x_scales.map(|p| t2(p, F32, t, self.g));
        let ti = topk_idx.map(|p| t2(p, I64, t, self.k));
        let tw = topk_weights.map(|p| t2(p, F32, t, self.k));
        let mut hp: *mut c::fep_handle = std::ptr::null_mut();
        let mut rows = 0i64;
        let (hpp, rp) = (&mut hp as *mut _ as usize, &mut rows as *mut i64 as usize);
        // SAFETY: descriptors and out-parameters on this frame; the data is the caller's.
        let st = nogil(py, || unsafe {
            c::fep_dispatch(
                vp(buf),
                at(&tx),
                opt(&ts),
                opt(&ti),
                opt(&tw),
                cached.map_or(std::ptr::null(), |p| p as *const c::fep_handle),
                ea,
                num_worst_tokens,
                std::ptr::null_mut(),
                hpp as *mut *mut c::fep_handle,
                rp as *mut i64,
            )
        });
        check(py, "fep_dispatch", st)?;
        Ok((hp as usize, rows))
    }

    /// `fep_handle_copy_out` (host): the outputs `[rows, ...]`; the routing outputs and the
    /// per-expert counts unless cached (None). Returns the counts as a list (None if cached).
    #[pyo3(signature = (handle, rows, recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights))]
    fn copy_out<'py>(
        &self,
        py: Python<'py>,
        handle: usize,
        rows: i64,
        recv_x: usize,
        recv_x_scales: Option<usize>,
        recv_topk_idx: Option<usize>,
        recv_topk_weights: Option<usize>,
    ) -> PyResult<Option<Bound<'py, PyList>>> {
        let tx = t2(recv_x, self.xc, rows, self.h);
        let ts = recv_x_scales.map(|p| t2(p, F32, rows, self.g));
        let ti = recv_topk_idx.map(|p| t2(p, I64, rows, self.k));
        let tw = recv_topk_weights.map(|p| t2(p, F32, rows, self.k));
        let mut counts = vec![0i32; if ti.is_some() { self.l as usize } else { 0 }];
        let tc = ti.map(|_| t1(counts.as_mut_ptr() as usize, I32, self.l));
        // SAFETY: as dispatch; `counts` holds L int32.
        let st = nogil(py, || unsafe {
            c::fep_handle_copy_out(vp(handle), at(&tx), opt(&ts), opt(&ti), opt(&tw), opt(&tc))
        });
        check(py, "fep_handle_copy_out", st)?;
        if tc.is_some() {
            Ok(Some(self.counts(py, &counts)?))
        } else {
            Ok(None)
        }
    }

    /// `fep_combine` (host): x `[rows, H]`, weights `[rows, K]` (optional, then also the
    /// combined weights `[t, K]`), combined_x `[t, H]`.
    #[pyo3(signature = (buf, handle, x, rows, topk_weights, out, t, out_weights))]
    fn combine(
        &self,
        py: Python<'_>,
        buf: usize,
        handle: usize,
        x: usize,
        rows: i64,
        topk_weights: Option<usize>,
        out: usize,
        t: i64,
        out_weights: Option<usize>,
    ) -> PyResult<()> {
        let tx = t2(x, BF16, rows, self.h);
        let tw = topk_weights.map(|p| t2(p, F32, rows, self.k));
        let to = t2(out, BF16, t, self.h);
        let tcw = out_weights.map(|p| t2(p, F32, t, self.k));
        // SAFETY: as dispatch.
        let st = nogil(py, || unsafe {
            c::fep_combine(
                vp(buf),
                vp(handle),
                at(&tx),
                opt(&tw),
                at(&to),
                opt(&tcw),
                std::ptr::null_mut(),
            )
        });
        check(py, "fep_combine", st)
    }

    // ------------------------------------------------------------ host low latency

    /// `fep_low_latency_dispatch_ex` (host): x `[t, H]` bf16, topk_idx `[t, K]`, the wait
    /// costs `[R]` int64 (None: not kept). Returns the op.
    #[pyo3(signature = (buf, x, t, topk_idx, use_fp8, round_scale, return_recv_hook, wait_stats=None))]
    fn ll_dispatch(
        &self,
        py: Python<'_>,
        buf: usize,
        x: usize,
        t: i64,
        topk_idx: usize,
        use_fp8: bool,
        round_scale: bool,
        return_recv_hook: bool,
        wait_stats: Option<usize>,
    ) -> PyResult<usize> {
        let tx = t2(x, BF16, t, self.h);
        let ti = t2(topk_idx, I64, t, self.k);
        let ts = wait_stats.map(|p| t1(p, I64, self.r));
        let mut op: *mut c::fep_ll_op = std::ptr::null_mut();
        let opp = &mut op as *mut _ as usize;
        // SAFETY: as dispatch.
        let st = nogil(py, || unsafe {
            c::fep_low_latency_dispatch_ex(
                vp(buf),
                at(&tx),
                at(&ti),
                use_fp8,
                round_scale,
                return_recv_hook,
                opt(&ts),
                std::ptr::null_mut(),
                opp as *mut *mut c::fep_ll_op,
            )
        });
        check(py, "fep_low_latency_dispatch", st)?;
        Ok(op as usize)
    }

    /// `fep_ll_op_complete` (host): the receive of a low-latency op.
    fn ll_complete(&self, py: Python<'_>, buf: usize, op: usize) -> PyResult<()> {
        // SAFETY: the library checks both pointers.
        let st = nogil(py, || unsafe { c::fep_ll_op_complete(vp(buf), vp(op)) });
        check(py, "fep_ll_op_complete", st)
    }

    /// `fep_ll_dispatch_copy_out` (host): recv_x `[L, S, H]` (fp8 or bf16), scales
    /// `[L, S, H / 128]` (fp8 only), count `[L]`, src_rank / src_idx `[L, S]` int32,
    /// layout_range `[L, R]` int64.
    #[pyo3(signature = (op, use_fp8, recv_x, recv_x_scales, recv_count, src_rank, src_idx, layout_range))]
    fn ll_dispatch_copy_out(
        &self,
        py: Python<'_>,
        op: usize,
        use_fp8: bool,
        recv_x: usize,
        recv_x_scales: Option<usize>,
        recv_count: usize,
        src_rank: usize,
        src_idx: usize,
        layout_range: usize,
    ) -> PyResult<()> {
        let s = self.r * self.m;
        let tx = t3(recv_x, if use_fp8 { FP8 } else { BF16 }, self.l, s, self.h);
        let ts = recv_x_scales.map(|p| t3(p, F32, self.l, s, self.g));
        let tc = t1(recv_count, I32, self.l);
        let tr = t2(src_rank, I32, self.l, s);
        let ti = t2(src_idx, I32, self.l, s);
        let tl = t2(layout_range, I64, self.l, self.r);
        // SAFETY: as dispatch.
        let st = nogil(py, || unsafe {
            c::fep_ll_dispatch_copy_out(
                vp(op),
                at(&tx),
                opt(&ts),
                at(&tc),
                at(&tr),
                at(&ti),
                at(&tl),
            )
        });
        check(py, "fep_ll_dispatch_copy_out", st)
    }

    /// `fep_low_latency_combine_ex` (host): x `[L, S, H]` bf16, topk_idx / topk_weights
    /// `[t, K]`, the wait costs `[R]` int64 (None: not kept). Returns the op.
    #[pyo3(signature = (buf, dispatch_op, x, topk_idx, topk_weights, t, return_recv_hook, wait_stats=None))]
    fn ll_combine(
        &self,
        py: Python<'_>,
        buf: usize,
        dispatch_op: usize,
        x: usize,
        topk_idx: usize,
        topk_weights: usize,
        t: i64,
        return_recv_hook: bool,
        wait_stats: Option<usize>,
    ) -> PyResult<usize> {
        let tx = t3(x, BF16, self.l, self.r * self.m, self.h);
        let ti = t2(topk_idx, I64, t, self.k);
        let tw = t2(topk_weights, F32, t, self.k);
        let ts = wait_stats.map(|p| t1(p, I64, self.r));
        let mut op: *mut c::fep_ll_op = std::ptr::null_mut();
        let opp = &mut op as *mut _ as usize;
        // SAFETY: as dispatch.
        let st = nogil(py, || unsafe {
            c::fep_low_latency_combine_ex(
                vp(buf),
                dispatch_op as *const c::fep_ll_op,
                at(&tx),
                at(&ti),
                at(&tw),
                return_recv_hook,
                opt(&ts),
                std::ptr::null_mut(),
                opp as *mut *mut c::fep_ll_op,
            )
        });
        check(py, "fep_low_latency_combine", st)?;
        Ok(op as usize)
    }

    /// `fep_ll_combine_copy_out` (host): combined_x `[t, H]` bf16.
    fn ll_combine_copy_out(&self, py: Python<'_>, op: usize, out: usize, t: i64) -> PyResult<()> {
        let to = t2(out, BF16, t, self.h);
        // SAFETY: as dispatch.
        let st = nogil(py, || unsafe { c::fep_ll_combine_copy_out(vp(op), at(&to)) });
        check(py, "fep_ll_combine_copy_out", st)
    }

    // ------------------------------------------------------------ GPU normal mode

    /// The dispatch scratch (GPU): recv_src_idx, and a cached dispatch's recv_topk_idx /
    /// recv_topk_weights (the kernel writes them, nothing reads them).
    fn set_scratch(&self, src_idx: usize, topk_idx: usize, topk_weights: usize) {
        for (slot, v) in self.scratch.iter().zip([src_idx, topk_idx, topk_weights]) {
            slot.store(v, Ordering::Relaxed);
        }
    }

    /// `fep_gpu_notify` (or `fep_gpu_notify_inputs` with `x`, for the hierarchy): the layout
    /// of topk_idx `[t, K]`, on the comm stream after `compute` (or `event`), which waits
    /// afterwards unless `async_finish`. Returns `(handle, rows, per-expert counts)`.
    #[pyo3(signature = (buf, topk_idx, t, expert_alignment, num_worst_tokens, compute, event, async_finish, x=None, x_scales=None, topk_weights=None))]
    fn gpu_notify<'py>(
        &self,
        py: Python<'py>,
        buf: usize,
        topk_idx: usize,
        t: i64,
        expert_alignment: i64,
        num_worst_tokens: i64,
        compute: usize,
        event: usize,
        async_finish: bool,
        x: Option<usize>,
        x_scales: Option<usize>,
        topk_weights: Option<usize>,
    ) -> PyResult<(usize, i64, Bound<'py, PyList>)> {
        let ea = i32_arg("expert_alignment", expert_alignment)?;
        let ti = t2(topk_idx, I64, t, self.k);
        let order = self.order(compute, event, async_finish).raw();
        let mut counts = vec![0i32; self.l as usize];
        let cp = counts.as_mut_ptr() as usize;
        let mut hp: *mut c::fep_handle = std::ptr::null_mut();
        let mut rows = 0i64;
        let (hpp, rp) = (&mut hp as *mut _ as usize, &mut rows as *mut i64 as usize);
        let (call, st) = match x {
            None => (
                "fep_gpu_notify",
                // SAFETY: descriptors, order and out-parameters on this frame.
                nogil(py, || unsafe {
                    c::fep_gpu_notify(
                        vp(buf),
                        at(&ti),
                        ea,
                        num_worst_tokens,
                        &order,
                        hpp as *mut *mut c::fep_handle,
                        rp as *mut i64,
                        vp(cp),
                    )
                }),
            ),
            Some(xp) => {
                let tx = t2(xp, self.xc, t, self.h);
                let ts = x_scales.map(|p| t2(p, F32, t, self.g));
                let tw = t2(topk_weights.unwrap_or(0), F32, t, self.k);
                (
                    "fep_gpu_notify_inputs",
                    // SAFETY: as above.
                    nogil(py, || unsafe {
                        c::fep_gpu_notify_inputs(
                            vp(buf),
                            at(&tx),
                            opt(&ts),
                            at(&ti),
                            at(&tw),
                            ea,
                            num_worst_tokens,
                            &order,
                            hpp as *mut *mut c::fep_handle,
                            rp as *mut i64,
                            vp(cp),
                        )
                    }),
                )
            }
        };
        check(py, call, st)?;
        Ok((hp as usize, rows, self.counts(py, &counts)?))
    }

    /// `fep_gpu_dispatch`: inputs `[t, ...]`, outputs `[rows, ...]` (recv_topk_idx / weights
    /// None: the scratch, for a cached dispatch); recv_src_idx is the scratch. A dispatch after
    /// its notify (`after_notify`) adds no wait; a cached one waits for `compute` (or
    /// `event`). The compute stream waits afterwards unless `async_finish`.
    #[pyo3(signature = (buf, handle, x, x_scales, t, topk_idx, topk_weights, recv_x, recv_x_scales, rows, recv_topk_idx, recv_topk_weights, after_notify, compute, event, async_finish))]
    fn gpu_dispatch(
        &self,
        py: Python<'_>,
        buf: usize,
        handle: usize,
        x: usize,
        x_scales: Option<usize>,
        t: i64,
        topk_idx: usize,
        topk_weights: usize,
        recv_x: usize,
        recv_x_scales: Option<usize>,
        rows: i64,
        recv_topk_idx: Option<usize>,
        recv_topk_weights: Option<usize>,
        after_notify: bool,
        compute: usize,
        event: usize,
        async_finish: bool,
    ) -> PyResult<()> {
        let d = desc::gpu_dispatch(
            self.xc,
            self.h,
            self.k,
            [x, x_scales.unwrap_or(0), topk_idx, topk_weights],
            t,
            [
                recv_x,
                recv_x_scales.unwrap_or(0),
                recv_topk_idx.unwrap_or_else(|| self.scratch[1].load(Ordering::Relaxed)),
                recv_topk_weights.unwrap_or_else(|| self.scratch[2].load(Ordering::Relaxed)),
                self.scratch[0].load(Ordering::Relaxed),
            ],
            rows,
        );
        let order = if after_notify {
            Order::after_only(self.comm, compute, async_finish)
        } else {
            self.order(compute, event, async_finish)
        }
        .raw();
        let fp8 = x_scales.is_some();
        let [tx, ts, ti, tw, rx, rs, ri, rw, src] = &d;
        // SAFETY: descriptors and order on this frame; the data is the caller's.
        let st = nogil(py, || unsafe {
            c::fep_gpu_dispatch(
                vp(buf),
                handle as *const c::fep_handle,
                at(tx),
                if fp8 { at(ts) } else { NT },
                at(ti),
                at(tw),
                at(rx),
                if recv_x_scales.is_some() { at(rs) } else { NT },
                at(ri),
                at(rw),
                at(src),
                &order,
            )
        });
        check(py, "fep_gpu_dispatch", st)
    }

    /// `fep_gpu_combine`: x `[rows, H]`, weights `[rows, K]` (optional, then the combined
    /// weights `[t, K]` too), combined_x `[t, H]`; stream order as the notify's.
    #[pyo3(signature = (buf, handle, x, rows, topk_weights, out, t, out_weights, compute, event, async_finish))]
    fn gpu_combine(
        &self,
        py: Python<'_>,
        buf: usize,
        handle: usize,
        x: usize,
        rows: i64,
        topk_weights: Option<usize>,
        out: usize,
        t: i64,
        out_weights: Option<usize>,
        compute: usize,
        event: usize,
        async_finish: bool,
    ) -> PyResult<()> {
        let tx = t2(x, BF16, rows, self.h);
        let tw = topk_weights.map(|p| t2(p, F32, rows, self.k));
        let to = t2(out, BF16, t, self.h);
        let tcw = out_weights.map(|p| t2(p, F32, t, self.k));
        let order = self.order(compute, event, async_finish).raw();
        // SAFETY: as gpu_dispatch.
        let st = nogil(py, || unsafe {
            c::fep_gpu_combine(
                vp(buf),
                handle as *const c::fep_handle,
                at(&tx),
                opt(&tw),
                at(&to),
                opt(&tcw),
                &order,
            )
        });
        check(py, "fep_gpu_combine", st)
    }

    // ------------------------------------------------------------ GPU low latency

    /// The routing allocation's layout (GPU low latency): byte offsets of src_rank, src_idx,
    /// the (begin, count) pairs and the positions from its start (the count).
    fn set_ll_layout(&self, src_rank: usize, src_idx: usize, pairs: usize, positions: usize) {
        for (slot, v) in self.ll_offsets.iter().zip([src_rank, src_idx, pairs, positions]) {
            slot.store(v, Ordering::Relaxed);
        }
    }

    /// `fep_gpu_ll_dispatch`: x `[t, H]` bf16, topk_idx `[t, K]`; outputs recv_x (and its
    /// scales: 0 for bf16) and the routing allocation at `routing` (count first, the other
    /// parts at the offsets of [`Calls::set_ll_layout`]). Returns the op.
    #[pyo3(signature = (buf, x, t, topk_idx, recv_x, recv_x_scales, routing, use_fp8, round_scale, return_recv_hook, compute, async_finish, wait_stats=None))]
    fn gpu_ll_dispatch(
        &self,
        py: Python<'_>,
        buf: usize,
        x: usize,
        t: i64,
        topk_idx: usize,
        recv_x: usize,
        recv_x_scales: usize,
        routing: usize,
        use_fp8: bool,
        round_scale: bool,
        return_recv_hook: bool,
        compute: usize,
        async_finish: bool,
        wait_stats: Option<usize>,
    ) -> PyResult<usize> {
        let tx = t2(x, BF16, t, self.h);
        let ti = t2(topk_idx, I64, t, self.k);
        let ts = wait_stats.map(|p| t1(p, I64, self.r));
        let o = self.ll_offsets.each_ref().map(|a| a.load(Ordering::Relaxed));
        let outs = desc::gpu_ll_buffers(
            self.xc,
            self.h,
            self.k,
            self.l,
            self.r,
            self.m,
            recv_x,
            recv_x_scales,
            routing,
            o,
        );
        let order = self.order(compute, 0, async_finish).raw();
        let mut op: *mut c::fep_gpu_ll_op = std::ptr::null_mut();
        let opp = &mut op as *mut _ as usize;
        // SAFETY: descriptors, order and out-parameter on this frame.
        let st = nogil(py, || unsafe {
            c::fep_gpu_ll_dispatch_ex(
                vp(buf),
                at(&tx),
                at(&ti),
                use_fp8,
                round_scale,
                return_recv_hook,
                &outs,
                opt(&ts),
                &order,
                opp as *mut *mut c::fep_gpu_ll_op,
            )
        });
        check(py, "fep_gpu_ll_dispatch", st)?;
        Ok(op as usize)
    }

    /// `fep_gpu_ll_complete`: a hook's receive, on the comm stream after `compute`, which
    /// waits for it afterwards.
    fn gpu_ll_complete(
        &self,
        py: Python<'_>,
        buf: usize,
        op: usize,
        compute: usize,
    ) -> PyResult<()> {
        let order = self.order(compute, 0, false).raw();
        // SAFETY: the order on this frame; the library checks both pointers.
        let st = nogil(py, || unsafe { c::fep_gpu_ll_complete(vp(buf), vp(op), &order) });
        check(py, "fep_gpu_ll_complete", st)
    }

    /// `fep_gpu_ll_combine`: x `[L, S, H]` bf16, topk_idx / topk_weights `[t, K]`, out
    /// `[t, H]` bf16. Returns the op.
    #[pyo3(signature = (buf, dispatch_op, x, topk_idx, topk_weights, t, out, return_recv_hook, compute, async_finish, wait_stats=None))]
    fn gpu_ll_combine(
        &self,
        py: Python<'_>,
        buf: usize,
        dispatch_op: usize,
        x: usize,
        topk_idx: usize,
        topk_weights: usize,
        t: i64,
        out: usize,
        return_recv_hook: bool,
        compute: usize,
        async_finish: bool,
        wait_stats: Option<usize>,
    ) -> PyResult<usize> {
        let tx = t3(x, BF16, self.l, self.r * self.m, self.h);
        let ti = t2(topk_idx, I64, t, self.k);
        let tw = t2(topk_weights, F32, t, self.k);
        let to = t2(out, BF16, t, self.h);
        let ts = wait_stats.map(|p| t1(p, I64, self.r));
        let order = self.order(compute, 0, async_finish).raw();
        let mut op: *mut c::fep_gpu_ll_op = std::ptr::null_mut();
        let opp = &mut op as *mut _ as usize;
        // SAFETY: as gpu_ll_dispatch.
        let st = nogil(py, || unsafe {
            c::fep_gpu_ll_combine_ex(
                vp(buf),
                dispatch_op as *const c::fep_gpu_ll_op,
                at(&tx),
                at(&ti),
                at(&tw),
                at(&to),
                return_recv_hook,
                opt(&ts),
                &order,
                opp as *mut *mut c::fep_gpu_ll_op,
            )
        });
        check(py, "fep_gpu_ll_combine", st)?;
        Ok(op as usize)
    }
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("ABI_VERSION", c::FEP_ABI_VERSION)?;
    m.add("FEP_OK", c::FEP_OK as i32)?;
    m.add("FEP_ERR_INVALID_ARGUMENT", c::FEP_ERR_INVALID_ARGUMENT as i32)?;
    m.add("FEP_ERR_TIMEOUT", c::FEP_ERR_TIMEOUT as i32)?;
    m.add("FEP_ERR_CONFIG_MISMATCH", c::FEP_ERR_CONFIG_MISMATCH as i32)?;
    m.add("FEP_CONFIG_V1_SIZE", c::FEP_CONFIG_V1_SIZE)?;
    for (n, v) in [
        ("FEP_DTYPE_BF16", BF16),
        ("FEP_DTYPE_FP8_E4M3", FP8),
        ("FEP_DTYPE_F32", F32),
        ("FEP_DTYPE_I64", I64),
        ("FEP_DTYPE_I32", I32),
        ("FEP_DTYPE_BOOL", c::FEP_DTYPE_BOOL),
        ("FEP_BACKEND_HOST", c::FEP_BACKEND_HOST),
        ("FEP_BACKEND_GPU", c::FEP_BACKEND_GPU),
        ("FEP_MODE_NORMAL", c::FEP_MODE_NORMAL),
        ("FEP_MODE_LOW_LATENCY", c::FEP_MODE_LOW_LATENCY),
    ] {
        m.add(n, v)?;
    }
    m.add_class::<Calls>()?;
    m.add_function(wrap_pyfunction!(abi_version, m)?)?;
    m.add_function(wrap_pyfunction!(address, m)?)?;
    m.add_function(wrap_pyfunction!(config_defaults, m)?)?;
    m.add_function(wrap_pyfunction!(size_hints, m)?)?;
    m.add_function(wrap_pyfunction!(buffer_create, m)?)?;
    m.add_function(wrap_pyfunction!(buffer_create_boot, m)?)?;
    m.add_function(wrap_pyfunction!(buffer_destroy, m)?)?;
    m.add_function(wrap_pyfunction!(buffer_rank, m)?)?;
    m.add_function(wrap_pyfunction!(handle_destroy, m)?)?;
    m.add_function(wrap_pyfunction!(boot_create, m)?)?;
    m.add_function(wrap_pyfunction!(boot_rank, m)?)?;
    m.add_function(wrap_pyfunction!(boot_allgather, m)?)?;
    m.add_function(wrap_pyfunction!(boot_destroy, m)?)?;
    m.add_function(wrap_pyfunction!(layout_host, m)?)?;
    m.add_function(wrap_pyfunction!(gpu_layout_create, m)?)?;
    m.add_function(wrap_pyfunction!(gpu_layout_run, m)?)?;
    m.add_function(wrap_pyfunction!(gpu_layout_destroy, m)?)?;
    m.add_function(wrap_pyfunction!(ll_op_destroy, m)?)?;
    m.add_function(wrap_pyfunction!(gpu_ll_op_destroy, m)?)?;
    m.add_function(wrap_pyfunction!(clean_low_latency_buffer, m)?)?;
    m.add_function(wrap_pyfunction!(gpu_sync, m)?)?;
    m.add_function(wrap_pyfunction!(ll_update_mask, m)?)?;
    m.add_function(wrap_pyfunction!(ll_query_mask, m)?)?;
    m.add_function(wrap_pyfunction!(ll_clean_mask, m)?)?;
    m.add_function(wrap_pyfunction!(local_region, m)?)?;
    m.add_function(wrap_pyfunction!(gpu_info, m)?)?;
    Ok(())
}
