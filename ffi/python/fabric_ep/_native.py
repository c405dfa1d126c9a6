"""The optional torch helper (``_native.cpp``): the GPU path's allocations, ``record_stream``
calls and input reads batched into one C++ call each (see the notes there for why).

It is built on first use with torch's own extension builder (``torch.utils.cpp_extension.load``:
g++ or the compiler in ``CXX``, ninja and torch's headers; no nvcc, no CUDA header), cached
under ``TORCH_EXTENSIONS_DIR`` (default torch's, ``~/.cache/torch_extensions``) in a folder per
Python and torch version, and loaded from there afterwards; a build of it in progress elsewhere
is waited for at most ``LOCK_WAIT_S``. ``Buffer`` calls :func:`get` before its ranks connect.
``FABRIC_EP_NATIVE`` picks:

* ``auto`` (default): use it when it builds; otherwise warn once and keep the pure-Python path
  (the same GPU path, each torch call made from Python: a few us more per call);
* ``1``: it must load (a GPU ``Buffer`` raises otherwise);
* ``0``: never (the pure-Python path).

``status()`` says which is in use and why.
"""

import os
import sys
import threading
import time
import warnings
from typing import Any, Optional

ABI = 2  # _native.cpp's kAbi
_NAME = "fabric_ep_native"
_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_native.cpp")

# How long a build waits for another process's build of the same directory (torch's own wait,
# on the directory's ``lock`` file, has no deadline: a process killed mid-build leaves the file
# and every later build would wait forever). A build takes ~13 s on the H200 host.
LOCK_WAIT_S = 300.0

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


def _build_dir(torch: Any, cpp_extension: Any) -> str:
    """``TORCH_EXTENSIONS_DIR`` (else torch's default root) / ``fabric_ep_native-<python>-
    torch<version>``: one build per interpreter and torch."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    tag = f"py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__}"
    d = os.path.join(root, f"{_NAME}-{tag.replace('+', '_')}")
    os.makedirs(d, exist_ok=True)
    return d


def _wait_lock(d: str) -> None:
    """Waits, at most LOCK_WAIT_S, for another build of ``d`` to end (torch's wait has no
    deadline); raises naming the lock file after that."""
    lock = os.path.join(d, "lock")
    deadline = time.monotonic() + LOCK_WAIT_S
    while os.path.exists(lock):
        if time.monotonic() >= deadline:
            raise RuntimeError(
                f"{lock} still exists after {LOCK_WAIT_S:.0f} s: another process's build of the "
                "helper, or one that died mid-build (then delete the file)")
        time.sleep(0.1)


def _build(torch: Any) -> Any:
    from torch.utils import cpp_extension

    d = _build_dir(torch, cpp_extension)
    _wait_lock(d)
    # (Torch's device-generic stream API only: no CUDA headers or nvcc needed.)
    mod = cpp_extension.load(
        name=_NAME, sources=[_SRC], extra_cflags=["-O2"], with_cuda=False, build_directory=d,
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
