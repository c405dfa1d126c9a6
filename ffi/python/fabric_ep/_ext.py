"""Loads ``fabric_ep._core``, the package's binding to fabric-ep (a PyO3 extension module with
the library linked in; ``ffi/python/native``), and names its constants.

Where it comes from, in order: ``FABRIC_EP_EXTENSION`` (the path of a built module, e.g. cargo's
``libfabric_ep_python.so``: the development path ``make test`` uses), the package itself (an
installed wheel carries ``_core.abi3.so``, with the libfabric it links in ``.libs/``), then the
cargo target directories of a developer checkout (``$CARGO_TARGET_DIR``, and the repository's
``target/`` when the package runs from ``<repo>/ffi/python/fabric_ep``), newest build first.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import pathlib
import sys
from typing import Any, Dict, List

from ._errors import FabricEPArgumentError, FabricEPError, FabricEPTimeoutError  # noqa: F401

_NAME = "fabric_ep._core"
_BUILT = "libfabric_ep_python.so"  # cargo's name for the crate's cdylib

_HINT = (
    "An installed wheel's module loads the libfabric it carries (fabric_ep/.libs/; rebuild the "
    "wheel if that is missing); a cargo build needs libfabric installed (apt-get install "
    "libfabric1), or use a wheel (`make wheel`, then `pip install dist/fabric_ep-*.whl`)."
)


def _from_path(path: str, origin: str) -> Any:
    loader = importlib.machinery.ExtensionFileLoader(_NAME, path)
    spec = importlib.util.spec_from_file_location(_NAME, path, loader=loader)
    assert spec is not None
    mod = importlib.util.module_from_spec(spec)
    try:
        loader.exec_module(mod)
    except ImportError as e:
        # Typically a library it links is missing (libfabric.so.1 for a cargo build on a
        # machine without libfabric): the loader's message names it.
        raise ImportError(f"fabric_ep: {origin} {path} does not load: {e}. {_HINT}") from e
    sys.modules[_NAME] = mod
    return mod


def _checkout_builds() -> List[pathlib.Path]:
    here = pathlib.Path(__file__).resolve().parent
    roots: List[pathlib.Path] = []
    target = os.environ.get("CARGO_TARGET_DIR")
    if target:
        roots.append(pathlib.Path(target))
    if here.parent.name == "python" and here.parent.parent.name == "ffi":
        roots.append(here.parent.parent.parent / "target")
    built = [r / prof / _BUILT for r in roots for prof in ("release", "debug")]
    # NOTES: a stale release build must not shadow a fresh debug one: the newest wins.
    built.sort(key=lambda p: p.stat().st_mtime if p.exists() else -1.0, reverse=True)
    return built


def _load() -> Any:
    explicit = os.environ.get("FABRIC_EP_EXTENSION")
    if explicit:
        if not os.path.isfile(explicit):
            raise ImportError(f"FABRIC_EP_EXTENSION={explicit!r}: no such file")
        return _from_path(explicit, "FABRIC_EP_EXTENSION:")
    here = pathlib.Path(__file__).resolve().parent
    suffixes = importlib.machinery.EXTENSION_SUFFIXES
    if any((here / f"_core{s}").exists() for s in suffixes):
        try:
            from . import _core  # type: ignore[attr-defined]
        except ImportError as e:
            raise ImportError(f"fabric_ep: {here}/_core does not load: {e}. {_HINT}") from e
        return _core
    tried = []
    for p in _checkout_builds():
        tried.append(str(p))
        if p.exists():
            return _from_path(str(p), "module")
    raise ImportError(
        "fabric_ep: no native module (fabric_ep._core). Install the wheel, which carries it (in "
        "the fabric-ep repository: `pip install ffi/python`, or `make wheel` and `pip install "
        "dist/fabric_ep-*.whl` on another machine); in a checkout, build it with `cargo build "
        "-p fabric-ep-python --features extension-module` (and set CARGO_TARGET_DIR if cargo "
        "builds elsewhere); or point FABRIC_EP_EXTENSION at a built module. Tried: "
        + ", ".join([str(here / "_core.abi3.so")] + tried)
    )


core = _load()

FEP_ABI_VERSION = 1
if core.abi_version() != FEP_ABI_VERSION:
    raise ImportError(
        f"fabric_ep: native module ABI version {core.abi_version()}, this package speaks "
        f"{FEP_ABI_VERSION}: rebuild the module and the package from the same commit"
    )

FEP_DTYPE_BF16 = core.FEP_DTYPE_BF16
FEP_DTYPE_FP8_E4M3 = core.FEP_DTYPE_FP8_E4M3
FEP_DTYPE_F32 = core.FEP_DTYPE_F32
FEP_DTYPE_I64 = core.FEP_DTYPE_I64
FEP_DTYPE_I32 = core.FEP_DTYPE_I32
FEP_DTYPE_BOOL = core.FEP_DTYPE_BOOL
FEP_BACKEND_HOST = core.FEP_BACKEND_HOST
FEP_BACKEND_GPU = core.FEP_BACKEND_GPU
FEP_MODE_NORMAL = core.FEP_MODE_NORMAL
FEP_MODE_LOW_LATENCY = core.FEP_MODE_LOW_LATENCY
FEP_OK = core.FEP_OK
FEP_ERR_INVALID_ARGUMENT = core.FEP_ERR_INVALID_ARGUMENT
FEP_ERR_TIMEOUT = core.FEP_ERR_TIMEOUT
FEP_ERR_CONFIG_MISMATCH = core.FEP_ERR_CONFIG_MISMATCH


def new_config() -> Dict[str, Any]:
    """A configuration: the ``fep_config`` fields to set (a dict; the others keep
    ``fep_config_init``'s defaults, applied by the native call)."""
    return {}


def size_hints(cfg: Dict[str, Any]) -> Dict[str, int]:
    """``fep_get_size_hints``: ``normal_bytes``, ``ll_bytes``, ``normal_regions``,
    ``ll_regions``."""
    return core.size_hints(cfg)


def native_status() -> str:
    """Which binding is in use: the extension module's file (the GPU backend's torch calls are
    made from Python). Kept from the releases that had an optional torch helper, whose state it
    reported."""
    return f"fabric_ep._core ({getattr(core, '__file__', '?')}); torch calls from Python"
