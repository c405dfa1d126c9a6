"""fabric_ep: DeepEP V1's Python API (``Buffer``, ``Config``, ``EventOverlap``) over fabric-ep's
C ABI (``libfabric_ep``), so a DeepEP user changes the import::

    from fabric_ep import Buffer, Config, EventOverlap

The one difference: ``Buffer(...)`` needs ``num_experts=``, ``hidden=`` and ``num_topk=`` (fabric-ep
sizes its buffers from the model shape, not from byte counts). Two backends: host (CPU threads
over host memory; numpy arrays or torch CPU tensors) and GPU (CUDA kernels; torch CUDA tensors
and the current CUDA stream; in this version ranks are threads of one process on one GPU, e.g.
over a :class:`ThreadGroup`).

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
