"""fabric_ep: DeepEP V1's Python API (``Buffer``, ``Config``, ``EventOverlap``) over fabric-ep, so a
DeepEP user changes the import::

    from fabric_ep import Buffer, Config, EventOverlap

``Buffer(group, num_nvl_bytes, num_rdma_bytes, low_latency_mode, ...)`` takes DeepEP's V1
arguments as written; the model shape and token format come with each call, and each shape gets
its own native buffer. Two backends, chosen by the tensors: host (CPU threads over host memory;
numpy arrays or torch CPU tensors) and GPU (CUDA kernels; torch CUDA tensors and the current
CUDA stream; ranks as processes, one per GPU, or as threads of one process over a
:class:`ThreadGroup` for tests).

The library is reached through one extension module, ``fabric_ep._core`` (PyO3, built from
``ffi/python/native`` with fabric-ep linked in): found inside this package (a wheel carries it),
through ``FABRIC_EP_EXTENSION``, or in ``$CARGO_TARGET_DIR`` / the repository's
``target/{release,debug}`` (see :mod:`fabric_ep._ext`). The GPU backend makes its torch calls
(allocations, ``record_stream``, events) from Python.
"""

from ._errors import FabricEPArgumentError, FabricEPError, FabricEPTimeoutError
from ._ext import core as _core  # noqa: F401 - loads the native module first
from ._ext import native_status
from ._facade import Buffer
from .buffer import DispatchHandle, LowLatencyHandle
from .config import Config
from .utils import EventOverlap, ThreadGroup

__all__ = [
    "Buffer",
    "Config",
    "DispatchHandle",
    "LowLatencyHandle",
    "EventOverlap",
    "ThreadGroup",
    "FabricEPError",
    "FabricEPArgumentError",
    "FabricEPTimeoutError",
    "native_status",
]
__version__ = "0.1.0"
