"""Raw ctypes bindings to ``libfabric_ep`` (the C ABI in ``ffi/include/fabric_ep.h``).

This module only declares structs and prototypes, loads the library, and turns a non-zero
``fep_status`` into a :class:`FabricEPError` carrying the call, the status and the library's own
message (``fep_last_error``). Everything else lives in :mod:`fabric_ep.buffer`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import pathlib
from typing import List, Optional

# ---- Constants mirrored from the header (checked against the library at load time where the
# library exposes them: fep_abi_version).
FEP_ABI_VERSION = 1

FEP_DTYPE_BF16 = 0
FEP_DTYPE_FP8_E4M3 = 1
FEP_DTYPE_F32 = 2
FEP_DTYPE_I64 = 3
FEP_DTYPE_I32 = 4
FEP_DTYPE_BOOL = 5

FEP_BACKEND_HOST = 0
FEP_BACKEND_GPU = 1

FEP_MODE_NORMAL = 1
FEP_MODE_LOW_LATENCY = 2

FEP_OK = 0
FEP_ERR_INVALID_ARGUMENT = 7001
FEP_ERR_TIMEOUT = 7002
FEP_ERR_CONFIG_MISMATCH = 7006


class fep_config(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("version", ctypes.c_uint32),
        ("rank", ctypes.c_int32),
        ("num_ranks", ctypes.c_int32),
        ("ranks_per_node", ctypes.c_int32),
        ("local_rank", ctypes.c_int32),
        ("num_experts", ctypes.c_int32),
        ("hidden", ctypes.c_int32),
        ("num_topk", ctypes.c_int32),
        ("max_tokens_per_rank", ctypes.c_int32),
        ("dispatch_dtype", ctypes.c_int32),
        ("num_sms", ctypes.c_int32),
        ("chunk_tokens", ctypes.c_int32),
        ("slots_per_peer", ctypes.c_int32),
        ("backend", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
        ("timeout_s", ctypes.c_double),
        ("provider", ctypes.c_char_p),
        # Appended after the first release (FEP_CONFIG_V1_SIZE = 80 bytes is still accepted).
        ("device", ctypes.c_int32),
        ("gpu_reserve_tokens", ctypes.c_int32),
        ("internode_hierarchy", ctypes.c_int32),
        ("modes", ctypes.c_int32),
    ]


class fep_size_hints(ctypes.Structure):
    _fields_ = [
        ("normal_bytes", ctypes.c_uint64),
        ("ll_bytes", ctypes.c_uint64),
        ("normal_regions", ctypes.c_uint64),
        ("ll_regions", ctypes.c_uint64),
    ]


class fep_tensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("dtype", ctypes.c_int32),
        ("ndim", ctypes.c_int32),
        ("shape", ctypes.c_int64 * 4),
    ]


class fep_gpu_order(ctypes.Structure):
    """Stream order of a GPU call: run on ``stream`` after ``wait_stream``'s queued work and
    ``wait_event``; then ``then_stream`` waits for it (NULL members skipped)."""

    _fields_ = [
        ("stream", ctypes.c_void_p),
        ("wait_stream", ctypes.c_void_p),
        ("wait_event", ctypes.c_void_p),
        ("then_stream", ctypes.c_void_p),
    ]


FEP_CONFIG_V1_SIZE = 80


# int (*)(const void *send, size_t len, void *recv, void *user)
ALLGATHER_FN = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p
)

_P = ctypes.POINTER
_vp = ctypes.c_void_p
_st = ctypes.c_int32  # fep_status (a C enum: int)


class FabricEPError(RuntimeError):
    """A ``fep_*`` call failed. ``call`` names it, ``status`` is the ``fep_status`` code,
    ``status_name`` its name, and the message is the library's own (``fep_last_error``)."""

    def __init__(self, call: str, status: int, status_name: str, message: str):
        self.call = call
        self.status = status
        self.status_name = status_name
        self.message = message
        super().__init__(f"{call}: {status_name} ({status}): {message}")


class FabricEPArgumentError(FabricEPError, ValueError):
    """``FEP_ERR_INVALID_ARGUMENT``: the library refused an argument (the message names it)."""


class FabricEPTimeoutError(FabricEPError, TimeoutError):
    """``FEP_ERR_TIMEOUT``: a bounded wait expired (the message names the rank/phase)."""


def _candidates() -> List[pathlib.Path]:
    """Where to look after ``FABRIC_EP_LIBRARY``, in order: the package directory (an installed
    wheel carries the library there, with the libfabric it links in ``.libs/``), then the cargo
    target directories of a developer checkout (``$CARGO_TARGET_DIR``, and the repository's
    ``target/`` when the package runs from its source tree ``<repo>/ffi/python/fabric_ep``),
    newest build first."""
    names = ["libfabric_ep.so", "libfabric_ep.dylib"]
    here = pathlib.Path(__file__).resolve().parent
    bundled = [here / n for n in names]
    roots: List[pathlib.Path] = []
    target = os.environ.get("CARGO_TARGET_DIR")
    if target:
        roots.append(pathlib.Path(target))
    if here.parent.name == "python" and here.parent.parent.name == "ffi":
        roots.append(here.parent.parent.parent / "target")
    built = [r / prof / n for r in roots for prof in ("release", "debug") for n in names]
    # NOTES: a stale release build must not shadow a fresh debug one (make test builds debug):
    # among the cargo outputs the most recently built wins.
    built.sort(key=lambda p: p.stat().st_mtime if p.exists() else -1.0, reverse=True)
    return bundled + built


def _load() -> ctypes.CDLL:
    def _open(path: str, origin: str) -> ctypes.CDLL:
        try:
            return ctypes.CDLL(path)
        except OSError as e:
            # Typically a library it links is missing (libfabric.so.1 for a cargo build on a
            # machine without libfabric): the loader's message names it.
            raise ImportError(
                f"fabric_ep: {origin} {path} does not load: {e}. An installed wheel's library "
                "loads the libfabric it carries (fabric_ep/.libs/; rebuild the wheel if that is "
                "missing); a cargo build needs libfabric installed (apt-get install libfabric1), "
                "or use a wheel (`make wheel`, then `pip install dist/fabric_ep-*.whl`)."
            ) from e

    explicit = os.environ.get("FABRIC_EP_LIBRARY")
    if explicit:
        if not os.path.exists(explicit):
            raise ImportError(f"FABRIC_EP_LIBRARY={explicit!r}: no such file")
        return _open(explicit, "FABRIC_EP_LIBRARY:")
    tried = []
    for p in _candidates():
        tried.append(str(p))
        if p.exists():
            return _open(str(p), "library")
    found = ctypes.util.find_library("fabric_ep")
    if found:
        return _open(found, "system library")
    raise ImportError(
        "fabric_ep: cannot find libfabric_ep.so. Install the wheel, which carries it (in the "
        "fabric-ep repository: `pip install ffi/python`, or `make wheel` and `pip install "
        "dist/fabric_ep-*.whl` on another machine); in a checkout, build it with `cargo build "
        "--release --lib` (and set CARGO_TARGET_DIR if cargo builds elsewhere); or point "
        "FABRIC_EP_LIBRARY at a libfabric_ep.so. Tried: " + ", ".join(tried) + " and the "
        "system library path."
    )


def _declare(lib: ctypes.CDLL) -> None:
    def f(name, restype, *argtypes):
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = list(argtypes)

    f("fep_abi_version", ctypes.c_uint32)
    f("fep_status_string", ctypes.c_char_p, ctypes.c_int32)
    f("fep_last_error", ctypes.c_char_p)
    f("fep_config_init", _st, _P(fep_config))
    f("fep_get_size_hints", _st, _P(fep_config), _P(fep_size_hints))
    f("fep_buffer_create", _st, _P(fep_config), ALLGATHER_FN, _vp, _P(_vp))
    f("fep_buffer_destroy", _st, _vp)
    f("fep_buffer_rank", _st, _vp, _P(ctypes.c_int32), _P(ctypes.c_int32))
    f("fep_handle_destroy", None, _vp)
    f("fep_handle_num_recv_tokens", ctypes.c_int64, _vp)
    f(
        "fep_get_dispatch_layout_host",
        _st,
        _vp,  # const int64_t *topk_idx
        ctypes.c_int64,
        ctypes.c_int32,
        ctypes.c_int32,
        ctypes.c_int32,
        ctypes.c_int32,
        _vp,
        _vp,
        _vp,
        _vp,
    )
    # Tensor arguments are passed as plain addresses (ctypes.addressof of a fep_tensor, or None):
    # c_void_p argtypes accept ints without building pointer objects, the cheapest form.
    f(
        "fep_dispatch",
        _st,
        _vp,  # buf
        _vp,  # x
        _vp,  # x_scales
        _vp,  # topk_idx
        _vp,  # topk_weights
        _vp,  # cached
        ctypes.c_int32,
        ctypes.c_int64,
        _vp,  # stream
        _vp,  # fep_handle **out_handle
        _vp,  # int64_t *num_recv_tokens
    )
    f("fep_handle_copy_out", _st, _vp, _vp, _vp, _vp, _vp, _vp)
    f("fep_combine", _st, _vp, _vp, _vp, _vp, _vp, _vp, _vp)
    # Low-latency mode (present in libraries built after it reached the C ABI).
    _b = ctypes.c_bool
    optional = [
        ("fep_low_latency_dispatch", _st, _vp, _vp, _vp, _b, _b, _b, _vp, _vp),
        ("fep_ll_op_complete", _st, _vp, _vp),
        ("fep_ll_dispatch_copy_out", _st, _vp, _vp, _vp, _vp, _vp, _vp, _vp),
        ("fep_low_latency_combine", _st, _vp, _vp, _vp, _vp, _vp, _b, _vp, _vp),
        ("fep_ll_combine_copy_out", _st, _vp, _vp),
        ("fep_ll_op_destroy", None, _vp),
        ("fep_clean_low_latency_buffer", _st, _vp),
        # GPU backend (device pointers, CUDA streams).
        ("fep_gpu_reserve", _st, _vp, ctypes.c_int64, ctypes.c_int32),
        ("fep_gpu_notify", _st, _vp, _vp, ctypes.c_int32, ctypes.c_int64, _vp, _vp, _vp, _vp),
        ("fep_gpu_notify_inputs", _st, _vp, _vp, _vp, _vp, _vp, ctypes.c_int32, ctypes.c_int64,
         _vp, _vp, _vp, _vp),
        ("fep_gpu_dispatch", _st, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp),
        ("fep_gpu_combine", _st, _vp, _vp, _vp, _vp, _vp, _vp, _vp),
        ("fep_gpu_ll_dispatch", _st, _vp, _vp, _vp, _b, _b, _b, _vp, _vp, _vp),
        ("fep_gpu_ll_complete", _st, _vp, _vp, _vp),
        ("fep_gpu_ll_combine", _st, _vp, _vp, _vp, _vp, _vp, _vp, _b, _vp, _vp),
        ("fep_gpu_ll_op_destroy", None, _vp),
        ("fep_gpu_sync", _st, _vp, _vp),
        ("fep_gpu_info", _st, _vp, _vp, _vp, _vp),
        # A bootstrap shared by several buffers.
        ("fep_boot_create", _st, ctypes.c_double, _P(_vp)),
        ("fep_boot_rank", _st, _vp, _P(ctypes.c_int32), _P(ctypes.c_int32), _P(ctypes.c_int32),
         _P(ctypes.c_int32)),
        ("fep_boot_destroy", _st, _vp),
        ("fep_boot_allgather", ctypes.c_int32, _vp, ctypes.c_size_t, _vp, _vp),
        ("fep_buffer_create_boot", _st, _P(fep_config), _vp, _P(_vp)),
    ]
    for name, restype, *argtypes in optional:
        if hasattr(lib, name):
            f(name, restype, *argtypes)


lib = _load()
_declare(lib)

if lib.fep_abi_version() != FEP_ABI_VERSION:
    raise ImportError(
        f"fabric_ep: libfabric_ep ABI version {lib.fep_abi_version()}, this package speaks "
        f"{FEP_ABI_VERSION}: rebuild the library and the package from the same commit"
    )


def _has(name: str) -> bool:
    try:
        getattr(lib, name)
        return True
    except AttributeError:
        return False


def error(call: str, status: int) -> FabricEPError:
    """The exception for a failed ``call`` (reads ``fep_last_error`` on this thread)."""
    name = (lib.fep_status_string(status) or b"?").decode(errors="replace")
    msg = (lib.fep_last_error() or b"").decode(errors="replace")
    if status == FEP_ERR_INVALID_ARGUMENT:
        return FabricEPArgumentError(call, status, name, msg)
    if status == FEP_ERR_TIMEOUT:
        return FabricEPTimeoutError(call, status, name, msg)
    return FabricEPError(call, status, name, msg)


def check(call: str, status: int) -> None:
    if status != FEP_OK:
        raise error(call, status)


def new_config() -> fep_config:
    cfg = fep_config()
    check("fep_config_init", lib.fep_config_init(ctypes.byref(cfg)))
    return cfg


def size_hints(cfg: fep_config) -> fep_size_hints:
    out = fep_size_hints()
    check("fep_get_size_hints", lib.fep_get_size_hints(ctypes.byref(cfg), ctypes.byref(out)))
    return out


def optional_symbol(name: str) -> Optional[ctypes._CFuncPtr]:  # type: ignore[name-defined]
    return getattr(lib, name) if _has(name) else None
