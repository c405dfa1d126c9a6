"""fabric_ep: DeepEP V1's Python API (``Buffer``, ``Config``, ``EventOverlap``) over fabric-ep's
C ABI (``libfabric_ep``), so a DeepEP user changes the import::

    from fabric_ep import Buffer, Config, EventOverlap

``Buffer(group, num_nvl_bytes, num_rdma_bytes, low_latency_mode, ...)`` takes DeepEP's V1
arguments as written; the model shape and token format come with each call, and each shape gets
its own native buffer. Two backends, chosen by the tensors: host (CPU threads over host memory;
numpy arrays or torch CPU tensors) and GPU (CUDA kernels; torch CUDA tensors and the current
CUDA stream; ranks as processes, one per GPU, or as threads of one process over a
:class:`ThreadGroup` for tests).

The GPU backend makes its torch calls through a small C++ helper built on first use
(``FABRIC_EP_NATIVE``: auto, 1, 0; :func:`native_status` says whether it is in use), else from
Python. The library is found through ``FABRIC_EP_LIBRARY``, next to this package,
``$CARGO_TARGET_DIR`` or the repository's ``target/{release,debug}``, then the system library
path.
"""

from ._lib import FabricEPArgumentError, FabricEPError, FabricEPTimeoutError
from ._native import status as native_status
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
