"""The optional torch helper (``_native.cpp``): the GPU path's allocations, ``record_stream``
calls and input reads batched into one C++ call each (see the notes there for why).

It is built on first use with torch's own extension builder (``torch.utils.cpp_extension.load``:
g++ or the compiler in ``CXX``, ninja and torch's headers; no nvcc, no CUDA header), cached
under ``TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``), and loaded from there
afterwards. ``Buffer`` calls :func:`get` before its ranks connect. ``FABRIC_EP_NATIVE`` picks:

* ``auto`` (default): use it when it builds; otherwise warn once and keep the pure-Python path
  (the same GPU path, each torch call made from Python: a few us more per call);
* ``1``: it must load (a GPU ``Buffer`` raises otherwise);
* ``0``: never (the pure-Python path).

``status()`` says which is in use and why.
"""

import os
import threading
import warnings
from typing import Any, Optional

ABI = 2  # _native.cpp's kAbi
_NAME = "fabric_ep_native"
_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_native.cpp")

_lock = threading.Lock()
_tried = False
_module: Any = None
_status = "not loaded yet (no GPU Buffer made)"


def _mode() -> str:
    v = os.environ.get("FABRIC_EP_NATIVE", "auto").strip().lower()
    if v in ("", "auto"):
        return "auto"
    if v in ("1", "on", "true", "yes", "require"):
        return "on"
    if v in ("0", "off", "false", "no"):
        return "off"
    raise ValueError(f"FABRIC_EP_NATIVE={v!r}: expected auto, 1 or 0")


def _build(torch: Any) -> Any:
    from torch.utils import cpp_extension

    # (Torch's device-generic stream API only: no CUDA headers or nvcc needed.)
    mod = cpp_extension.load(
        name=_NAME, sources=[_SRC], extra_cflags=["-O2"], with_cuda=False,
        verbose=os.environ.get("FABRIC_EP_NATIVE_VERBOSE", "") not in ("", "0"))
    if getattr(mod, "ABI", None) != ABI:
        raise RuntimeError(f"the cached {_NAME} has ABI {getattr(mod, 'ABI', None)}, this "
                           f"package needs {ABI} (clear TORCH_EXTENSIONS_DIR's {_NAME})")
    return mod


def get(torch: Any) -> Optional[Any]:
    """The helper module, or None for the pure-Python path (see the module doc). Built or loaded
    once per process; thread-safe (ranks as threads make their Buffers concurrently)."""
    global _tried, _module, _status
    mode = _mode()
    if mode == "off":
        _status = "off (FABRIC_EP_NATIVE=0): pure-Python torch calls"
        return None
    with _lock:
        if not _tried:
            _tried = True
            try:
                _module = _build(torch)
                _status = f"loaded ({_NAME}, ABI {ABI})"
            except Exception as e:  # noqa: BLE001 - any build failure: the pure-Python path
                _module = None
                _status = f"failed: {type(e).__name__}: {e}"
                if mode == "auto":
                    warnings.warn(
                        f"fabric_ep: the torch helper did not build ({_status}); using the "
                        "pure-Python torch calls (a few us more per call). FABRIC_EP_NATIVE=0 "
                        "silences this, FABRIC_EP_NATIVE_VERBOSE=1 shows the build",
                        RuntimeWarning, stacklevel=3)  # the caller's Buffer(...)
        if _module is None and mode == "on":
            raise RuntimeError(f"FABRIC_EP_NATIVE=1: the torch helper is required and {_status}")
        return _module


def status() -> str:
    """Whether the GPU path uses the helper: ``loaded ...``, ``off ...``, ``failed: <why>`` or
    ``not loaded yet ...``."""
    return _status
