"""``Buffer``: DeepEP V1's ``deep_ep.Buffer`` over fabric-ep's C ABI.

Shapes use DeepEP's names: ``T`` tokens on this rank, ``H`` hidden, ``K`` top-k, ``R`` ranks,
``E`` experts (global), ``L = E / R`` local experts, ``rows`` received tokens of a dispatch.

The one difference from DeepEP's constructor: fabric-ep sizes its buffers from the model shape,
not from byte counts, so ``num_experts``, ``hidden`` and ``num_topk`` are required keyword
arguments (``num_nvl_bytes``/``num_rdma_bytes`` are accepted and kept, but size nothing).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, List, Optional, Tuple, Union

import numpy as np

from . import _ext
from ._arrays import alloc, arr, data_ptr, empty_like_kind, in2
from ._ext import (
    FEP_BACKEND_GPU,
    FEP_BACKEND_HOST,
    FEP_DTYPE_BF16,
    FEP_DTYPE_BOOL,
    FEP_DTYPE_F32,
    FEP_DTYPE_FP8_E4M3,
    FEP_DTYPE_I32,
    FEP_DTYPE_I64,
    core,
)
from .config import DEFAULT_NUM_SMS, Config
from .utils import NO_EVENT, EventOverlap

FP8_GROUP = 128  # channels per fp8 scale

_DISPATCH_DTYPES = {"bf16": FEP_DTYPE_BF16, "fp8": FEP_DTYPE_FP8_E4M3}


def _default_ranks_per_node(num_ranks: int) -> int:
    # NOTES: the same rule as EpSettings::new (largest divisor of num_ranks not above 8);
    # resolved here and passed explicitly so Python and the library agree on the node count.
    for d in range(min(8, num_ranks), 0, -1):
        if num_ranks % d == 0:
            return d
    return 1


def _env_int(name: str) -> Optional[int]:
    v = os.environ.get(name, "").strip()
    if not v:
        return None
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"{name}={v!r} is not an integer") from None


def _no_event(previous_event: Any) -> None:
    if previous_event is None:
        return
    if isinstance(previous_event, EventOverlap) and previous_event.event is None:
        return  # nothing pending (what this backend's calls return)
    raise ValueError(
        "previous_event: the host backend runs each call to completion on the calling thread and "
        "cannot wait on a stream event; pass None (or an EventOverlap with nothing pending)"
    )


def _host_only(async_finish: bool, allocate_on_comm_stream: bool) -> None:
    if async_finish:
        raise ValueError(
            "async_finish=True: the host backend completes every call before it returns; pass "
            "async_finish=False"
        )
    if allocate_on_comm_stream:
        raise ValueError(
            "allocate_on_comm_stream=True: the host backend has no communication stream; pass "
            "allocate_on_comm_stream=False"
        )


def wait_stats_arg(name: str, t: Any, num_ranks: int) -> Any:
    """DeepEP's ``dispatch_wait_recv_cost_stats`` / ``combine_wait_recv_cost_stats`` on the
    host backend: None, or a writable ``[num_ranks]`` int64 numpy array / torch CPU tensor (the
    receive adds to it). Returns its :class:`Arr` (or None)."""
    if t is None:
        return None
    a = arr(name, t, FEP_DTYPE_I64, (num_ranks,))
    if type(t) is np.ndarray and not t.flags.writeable:
        raise ValueError(f"{name}: a read-only array (the receive adds the wait times to it)")
    return a


def _destroy_handle(ptr: int, _destroy=core.handle_destroy) -> None:
    _destroy(ptr)


class DispatchHandle:
    """What ``dispatch`` returns as ``handle``: pass it to ``combine`` and to a cached
    ``dispatch``. Owns the native ``fep_handle`` (freed when this object is collected). Opaque;
    ``num_tokens`` (this rank's ``T``) and ``num_recv_tokens`` (``rows``) are informational."""

    __slots__ = ("_ptr", "_buffer_id", "num_tokens", "num_recv_tokens", "_keep", "__weakref__")

    def __init__(self, ptr: int, buffer_id: int, num_tokens: int, num_recv_tokens: int):
        self._ptr = ptr
        self._buffer_id = buffer_id
        self.num_tokens = num_tokens
        self.num_recv_tokens = num_recv_tokens
        # GPU backend: (topk_idx, topk_weights), the tensors a cached dispatch reuses.
        self._keep: Any = None

    def __del__(self, _destroy=_destroy_handle) -> None:
        p, self._ptr = self._ptr, 0
        if p:
            _destroy(p)

    def __repr__(self) -> str:
        return f"DispatchHandle(num_tokens={self.num_tokens}, rows={self.num_recv_tokens})"


class _TorchAllGather:
    """The all-gather ``fep_buffer_create`` runs over a ``torch.distributed`` group: a callable
    taking this rank's bytes and returning every rank's, concatenated in rank order
    (``torch.distributed.all_gather`` of uint8 tensors; on the current CUDA device for NCCL
    groups). What it raises is chained to the create call's error."""

    def __init__(self, group: Any):
        import torch
        import torch.distributed as dist

        self.group = group
        self.size = dist.get_world_size(group)
        backend = str(dist.get_backend(group)).lower()
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")
        )

    def __call__(self, data: bytes) -> bytes:
        import torch
        import torch.distributed as dist

        length = len(data)
        if length == 0:
            return b""
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        parts = [torch.empty(length, dtype=torch.uint8, device=self.device) for _ in range(self.size)]
        dist.all_gather(parts, t, group=self.group)
        return torch.cat(parts).cpu().contiguous().numpy().tobytes()


class _Engine:
    """One native buffer of one model shape (what :class:`fabric_ep.Buffer` creates per shape) on fabric-ep: the host backend (CPU threads over host memory; numpy
    arrays or torch CPU tensors) or the GPU backend (CUDA kernels; torch CUDA tensors, the
    current CUDA stream; see :mod:`fabric_ep._gpu` for the stream rules).

    Arguments (DeepEP's, in DeepEP's order):
        group: a ``torch.distributed`` ProcessGroup (the connection info is all-gathered over it),
            any object with ``rank()``, ``size()`` and ``all_gather_bytes(bytes) -> list[bytes]``
            (e.g. :class:`fabric_ep.ThreadGroup`, ranks as threads of this process),
            or ``None``: bootstrap from the torchrun variables ``RANK``, ``WORLD_SIZE``,
            ``MASTER_ADDR``, ``MASTER_PORT`` (fabric-ep's store listens on ``MASTER_PORT + 1``
            unless ``FEP_MASTER_PORT`` is set), ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``.
        num_nvl_bytes, num_rdma_bytes: accepted and kept as attributes; fabric-ep sizes its own
            buffers from ``num_experts``/``hidden``/``num_topk`` (see :meth:`size_hints`).
        low_latency_mode: must be True for the ``low_latency_*`` calls (as in DeepEP).
        num_qps_per_rank, allow_nvlink_for_low_latency_mode: accepted (validated) and kept; they
            tune DeepEP's NVSHMEM/IBGDA transport, which fabric-ep does not have (it uses
            libfabric endpoints; intranode traffic goes through the provider).
        explicitly_destroy: when True, :meth:`destroy` must be called; otherwise the native
            buffer is also freed by ``__del__`` (a collective: every rank must drop its Buffer).

    fabric-ep keywords (the one difference from DeepEP's signature):
        num_experts, hidden, num_topk: required. ``hidden`` a multiple of 8 (of 128 for fp8);
            ``num_experts`` a multiple of the number of ranks.
        dispatch_dtype: ``"bf16"`` (default) or ``"fp8"``: the normal-mode token format the
            buffer carries (fabric-ep sizes the buffer for one format; DeepEP decides per call).
        num_max_dispatch_tokens_per_rank: low-latency capacity (0: the library's default, 128);
            ``low_latency_dispatch``/``clean_low_latency_buffer`` must pass the same value.
        config: a :class:`Config` for normal mode (default ``Buffer.get_dispatch_config(R)``).
        backend: ``"host"``, ``"gpu"`` or ``"auto"`` (default): ``"gpu"`` when torch sees a CUDA
            device and ``group`` is an NCCL process group or an ``all_gather_bytes`` group (a
            :class:`fabric_ep.ThreadGroup`), else ``"host"``. GPU ranks are processes (one per
            GPU, peers reached through CUDA IPC; several on one GPU need MPS) or threads of one
            process on one GPU. Thread mode is for tests and needs
            ``CUDA_DEVICE_MAX_CONNECTIONS=32`` and ``CUDA_MODULE_LOADING=EAGER`` set before CUDA
            initialises (see ThreadGroup).
        gpu_reserve_tokens: GPU backend: dispatch handles for up to this many input tokens are
            reserved at construction (4 of them; 0: none), so steps allocate no device memory; a
            larger dispatch allocates one when it runs (which, with ranks as threads, can stall
            until the timeout if a peer's kernel is spinning).
        provider: libfabric provider (``"shm"``, ``"tcp;ofi_rxm"``, ``"efa"``); None:
            ``FI_PROVIDER``, else ``"shm"``.
        timeout_s: bound on every wait inside the library (0: 60 s).
        ranks_per_node: None: ``LOCAL_WORLD_SIZE``, else the largest divisor of R up to 8.
        internode_hierarchy: GPU backend, ranks on 2 or more nodes (``ranks_per_node < R``):
            normal mode through DeepEP's hierarchy (one copy of a token per destination node,
            then the gateway's fan-out inside its node: fewer bytes on the network; the combine
            sums each node's bf16 partial) instead of direct per-rank sends. Low-latency mode
            always sends directly. Default False.
    """

    num_sms: int = DEFAULT_NUM_SMS

    def __init__(
        self,
        group: Any,
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
        num_qps_per_rank: int = 24,
        allow_nvlink_for_low_latency_mode: bool = True,
        explicitly_destroy: bool = False,
        *,
        num_experts: Optional[int] = None,
        hidden: Optional[int] = None,
        num_topk: Optional[int] = None,
        dispatch_dtype: str = "bf16",
        num_max_dispatch_tokens_per_rank: int = 0,
        config: Optional[Config] = None,
        backend: str = "auto",
        provider: Optional[str] = None,
        timeout_s: float = 0.0,
        ranks_per_node: Optional[int] = None,
        gpu_reserve_tokens: int = 4096,
        internode_hierarchy: bool = False,
        _boot: Any = None,
        _modes: int = 0,
        _comm_ptr: int = 0,
        _shrink: bool = False,
    ) -> None:
        self._ptr = 0  # set last: __del__ must see a consistent object if __init__ raises
        # The facade's shared bootstrap (fabric_ep.Buffer): its gather or native store, instead
        # of one made from ``group`` here.
        self._boot = _boot
        self._g: Optional[Any] = None
        missing = [
            n for n, v in (("num_experts", num_experts), ("hidden", hidden), ("num_topk", num_topk))
            if v is None
        ]
        if missing:
            raise TypeError(
                "Buffer: fabric-ep sizes its buffers from the model shape, so "
                + ", ".join(missing)
                + " must be given as keyword arguments (e.g. Buffer(group, num_experts=256, "
                "hidden=7168, num_topk=8)); num_nvl_bytes/num_rdma_bytes do not size anything"
            )
        for n, v in (("num_experts", num_experts), ("hidden", hidden), ("num_topk", num_topk)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{n}: {v!r} must be a positive int")
        for n, v in (("num_nvl_bytes", num_nvl_bytes), ("num_rdma_bytes", num_rdma_bytes)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{n}: {v!r} must be a non-negative int")
        if isinstance(num_qps_per_rank, bool) or not isinstance(num_qps_per_rank, int) or num_qps_per_rank <= 0:
            raise ValueError(f"num_qps_per_rank: {num_qps_per_rank!r} must be a positive int")
        if dispatch_dtype not in _DISPATCH_DTYPES:
            raise ValueError(f"dispatch_dtype: {dispatch_dtype!r}, expected 'bf16' or 'fp8'")
        if backend not in ("auto", "host", "gpu"):
            raise ValueError(f"backend: {backend!r}, expected 'auto', 'host' or 'gpu'")
        if backend == "auto":
            backend = _auto_backend(group)
        if isinstance(gpu_reserve_tokens, bool) or not isinstance(gpu_reserve_tokens, int) \
                or not 0 <= gpu_reserve_tokens < 2**31:
            raise ValueError(f"gpu_reserve_tokens: {gpu_reserve_tokens!r} must be an int in [0, 2**31)")
        if not isinstance(internode_hierarchy, bool):
            raise TypeError(f"internode_hierarchy: {internode_hierarchy!r} must be a bool")
        if internode_hierarchy and backend != "gpu":
            raise ValueError(
                f"internode_hierarchy: the GPU backend's (this Buffer uses {backend!r}; the host "
                "backend's hierarchy is ep::hier in Rust)"
            )
        self.internode_hierarchy = internode_hierarchy
        self.backend = backend
        if num_max_dispatch_tokens_per_rank < 0:
            raise ValueError(
                f"num_max_dispatch_tokens_per_rank: {num_max_dispatch_tokens_per_rank} is negative"
            )
        if config is not None and not isinstance(config, Config):
            raise TypeError(f"config: expected a fabric_ep.Config, got {type(config).__name__}")

        self.group = group
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = bool(low_latency_mode)
        self.num_qps_per_rank = num_qps_per_rank
        self.allow_nvlink_for_low_latency_mode = bool(allow_nvlink_for_low_latency_mode)
        self.explicitly_destroy = bool(explicitly_destroy)
        self.num_experts = num_experts
        self.hidden = hidden
        self.num_topk = num_topk
        self.dispatch_dtype = dispatch_dtype
        self._dispatch_code = _DISPATCH_DTYPES[dispatch_dtype]

        explicit_config = config is not None
        cfg = _ext.new_config()
        self._gather: Optional[Any] = None
        if _boot is not None:
            self._gather = _boot.gather
            cfg["rank"] = _boot.rank
            cfg["num_ranks"] = _boot.size
            world = _boot.size
            if ranks_per_node is None:
                ranks_per_node = _boot.local_size
        elif group is not None and hasattr(group, "all_gather_bytes"):
            from ._gpu import CallbackAllGather

            self._gather = CallbackAllGather(group)
            cfg["rank"] = group.rank()
            cfg["num_ranks"] = group.size()
            world = cfg["num_ranks"]
        elif group is not None:
            self._gather = _TorchAllGather(group)
            cfg["rank"] = group.rank()
            cfg["num_ranks"] = group.size()
            world = cfg["num_ranks"]
        else:
            world = _env_int("WORLD_SIZE")  # None: the library reports the missing variable
        if ranks_per_node is None:
            ranks_per_node = _env_int("LOCAL_WORLD_SIZE")
            if ranks_per_node is None and world is not None and world > 0:
                ranks_per_node = _default_ranks_per_node(world)
        if ranks_per_node is not None:
            if ranks_per_node <= 0:
                raise ValueError(f"ranks_per_node: {ranks_per_node} must be positive")
            cfg["ranks_per_node"] = ranks_per_node
        if internode_hierarchy:
            if ranks_per_node is None or world is None or ranks_per_node >= world:
                raise ValueError(
                    f"internode_hierarchy: needs ranks on 2 or more nodes (ranks_per_node "
                    f"{ranks_per_node} of {world} ranks)"
                )
            cfg["internode_hierarchy"] = 1
        if config is None:
            config = _public_buffer().get_dispatch_config(world if world else 1)
        sms, chunk, slots = config.fabric_chunking()
        self.config = config
        cfg["num_experts"] = num_experts
        cfg["hidden"] = hidden
        cfg["num_topk"] = num_topk
        cfg["max_tokens_per_rank"] = num_max_dispatch_tokens_per_rank
        cfg["dispatch_dtype"] = self._dispatch_code
        cfg["num_sms"] = sms
        cfg["chunk_tokens"] = chunk
        cfg["slots_per_peer"] = slots
        cfg["backend"] = FEP_BACKEND_HOST
        torch_mod: Any = None
        if backend == "gpu":
            try:
                import torch as torch_mod
            except ImportError as e:
                raise ValueError(f"backend: 'gpu' needs torch with CUDA ({e})") from None
            if not torch_mod.cuda.is_available():
                raise ValueError("backend: 'gpu' needs a CUDA device (torch.cuda.is_available() is False)")
            cfg["backend"] = FEP_BACKEND_GPU
            cfg["device"] = torch_mod.cuda.current_device()
            # Reserved inside fep_buffer_create, before its closing barrier (no allocation may
            # happen while a peer's kernel spins).
            cfg["gpu_reserve_tokens"] = gpu_reserve_tokens if gpu_reserve_tokens else -1
            # The GPU defaults (SMs / ranks, 16-token chunks, 32 slots up to 8 ranks, else 16)
            # unless the caller chose.
            if not explicit_config:
                cfg["chunk_tokens"] = cfg["slots_per_peer"] = 0
                if _public_buffer().num_sms == DEFAULT_NUM_SMS:
                    cfg["num_sms"] = 0
        cfg["modes"] = _modes if backend == "gpu" else 0
        self._shrink = bool(_shrink)
        cfg["enable_shrink"] = int(self._shrink)
        cfg["timeout_s"] = float(timeout_s)
        cfg["provider"] = provider
        self._cfg = cfg

        # (The gather's exception, if any, is chained to the create call's error.)
        if _boot is not None and _boot.ptr:
            self._ptr = core.buffer_create_boot(cfg, _boot.ptr)
        else:
            self._ptr = core.buffer_create(cfg, self._gather)
        r, n = core.buffer_rank(self._ptr)
        self.rank = r
        self.group_size = n
        self.num_ranks = n
        self.ranks_per_node = ranks_per_node if ranks_per_node else _default_ranks_per_node(n)
        self.num_local_experts = num_experts // n
        # NOTES: 0 asks the library for its default capacity, DEFAULT_MAX_TOKENS_PER_RANK = 128
        # (src/protocol/config.rs); the LL calls check callers' values against this.
        self.num_max_dispatch_tokens_per_rank = num_max_dispatch_tokens_per_rank or 128
        self._num_nodes = n // self.ranks_per_node
        comm = 0
        if backend == "gpu":
            _, sms, comm = core.gpu_info(self._ptr)
            self.num_sms = sms
            comm = _comm_ptr or comm
        # The native calls with this buffer's shape constants (fabric_ep._core.Calls): each
        # call passes only what changes.
        self._n = core.Calls(hidden, num_topk, self._dispatch_code, self.num_local_experts, n,
                             self.num_max_dispatch_tokens_per_rank, comm)
        if backend == "gpu":
            from ._gpu import GpuPath

            threads = hasattr(group, "all_gather_bytes") and self.num_ranks > 1
            self._g = GpuPath(self, torch_mod, int(cfg["device"]), threads, comm,
                              reserve_tokens=gpu_reserve_tokens)

    # ---------------------------------------------------------------- lifetime

    def _live(self) -> int:
        if not self._ptr:
            raise RuntimeError("Buffer: already destroyed")
        return self._ptr

    def destroy(self) -> None:
        """Frees the native buffer (a bounded barrier with the other ranks, then teardown).
        Collective: every rank calls it. Later calls on this Buffer raise."""
        if not self._ptr:
            raise RuntimeError("Buffer.destroy: already destroyed")
        if self._g is not None:
            self._g.quiesce()  # no kernel of this rank may run into the teardown
        p, self._ptr = self._ptr, 0
        core.buffer_destroy(p)

    def __del__(self) -> None:
        if getattr(self, "_ptr", 0) and not getattr(self, "explicitly_destroy", True):
            p, self._ptr = self._ptr, 0
            try:
                core.buffer_destroy(p)
            except Exception:  # noqa: BLE001 - interpreter shutdown; nothing to report to
                pass

    def __enter__(self) -> "_Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._ptr:
            self.destroy()

    # ---------------------------------------------------------------- static helpers

    def size_hints(self) -> "dict[str, int]":
        """What this buffer's configuration needs per rank: ``normal_bytes``, ``ll_bytes``,
        ``normal_regions``, ``ll_regions`` (memory regions at ``FEP_MR_MAX_BYTES`` each)."""
        return _ext.size_hints(self._cfg)

    def get_comm_stream(self) -> Any:
        """The communication stream (a ``torch.cuda.Stream``) on the GPU backend; None on the host
        backend, which has none (``torch.cuda.stream(None)`` is a no-op context). The stream
        stays valid after :meth:`destroy` (tensors recorded on it may be freed later); a Buffer
        built later on the GPU may get the same one."""
        self._live()
        return self._g.comm if self._g is not None else None

    def sync(self) -> None:
        """fabric-ep extension: waits (bounded by twice ``timeout_s`` plus 5 s) until the
        communication stream has run its work and raises :class:`FabricEPError` for any error
        this rank's kernels recorded (a timed-out wait names the phase and the peer). A no-op on
        the host backend, whose calls report their errors themselves."""
        self._live()
        if self._g is not None:
            self._g.sync()

    def get_local_buffer_tensor(self, dtype: Any, size: Any = None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> Any:
        """A view of this native buffer's own registered memory (see
        :meth:`fabric_ep.Buffer.get_local_buffer_tensor`)."""
        p = self._live()
        use_rdma_buffer = bool(use_rdma_buffer)
        if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)):
            raise TypeError(f"offset: {offset!r} must be an int (bytes)")
        try:
            addr, nbytes = core.local_region(p, use_rdma_buffer)
        except Exception as e:  # noqa: BLE001 - re-raised naming DeepEP's argument
            if use_rdma_buffer and "connected by the first low-latency call" in str(e):
                raise RuntimeError(
                    "get_local_buffer_tensor(use_rdma_buffer=True): the host backend connects "
                    "its low-latency buffer on the first low-latency call (or "
                    "clean_low_latency_buffer) of every rank; make one first"
                ) from e
            raise
        return local_view(self._g, addr, int(nbytes), dtype, size, int(offset))

    # ---------------------------------------------------------------- normal mode

    def get_dispatch_layout(
        self,
        topk_idx: Any,
        num_experts: int,
        previous_event: Optional[EventOverlap] = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> Tuple[Any, Optional[Any], Any, Any, EventOverlap]:
        """Counts for a dispatch.

        Arguments:
            topk_idx: ``[T, K]`` int64 global expert ids, -1 = no expert.
            num_experts: must equal the buffer's ``num_experts``.

        Returns:
            num_tokens_per_rank: ``[R]`` int32, tokens this rank sends to each rank.
            num_tokens_per_rdma_rank: ``[R / ranks_per_node]`` int32 per node, or None when all
                ranks share one node (as DeepEP returns for intranode settings).
            num_tokens_per_expert: ``[E]`` int32.
            is_token_in_rank: ``[T, R]`` bool.
            event: ``EventOverlap(None)`` (the work is done).
        """
        self._live()
        if num_experts != self.num_experts:
            raise ValueError(
                f"num_experts: {num_experts}, but this Buffer was built for {self.num_experts}"
            )
        if self._g is not None:
            return self._g.get_dispatch_layout(topk_idx, num_experts, previous_event,
                                               async_finish, allocate_on_comm_stream)
        return layout_host(self.num_ranks, self.ranks_per_node, topk_idx, num_experts,
                           previous_event, async_finish, allocate_on_comm_stream)

    def _check_config(self, config: Optional[Config]) -> None:
        if config is not None and config != self.config:
            raise ValueError(
                f"config: {config!r} differs from this Buffer's {self.config!r}; fabric-ep fixes "
                "its chunking when the Buffer is built: pass config= to Buffer(...) instead"
            )

    def dispatch(
        self,
        x: Union[Any, Tuple[Any, Any]],
        handle: Optional[DispatchHandle] = None,
        num_tokens_per_rank: Optional[Any] = None,
        num_tokens_per_rdma_rank: Optional[Any] = None,
        is_token_in_rank: Optional[Any] = None,
        num_tokens_per_expert: Optional[Any] = None,
        topk_idx: Optional[Any] = None,
        topk_weights: Optional[Any] = None,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        config: Optional[Config] = None,
        previous_event: Optional[EventOverlap] = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> Tuple[Any, Optional[Any], Optional[Any], Optional[List[int]], Optional[DispatchHandle], EventOverlap]:
        """Normal-mode dispatch: sends each token to every rank holding one of its experts.

        Arguments:
            x: ``[T, H]`` bf16, or ``(x, x_scales)`` with ``x`` ``[T, H]`` fp8 e4m3 and
                ``x_scales`` ``[T, H / 128]`` float32 (needs ``dispatch_dtype="fp8"``).
            handle: a previous dispatch's handle: reuse its routing (cached mode; then
                ``topk_idx``/``topk_weights`` must be None).
            num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                num_tokens_per_expert: :meth:`get_dispatch_layout`'s outputs. Optional here and
                checked for shape/dtype only: the library derives the same counts from
                ``topk_idx``.
            topk_idx: ``[T, K]`` int64, -1 = no expert. topk_weights: ``[T, K]`` float32.
            expert_alignment: each ``num_recv_tokens_per_expert_list`` entry is rounded up to it.
            num_worst_tokens: > 0: output rows fixed at this (rows past the received ones are
                zero, their ``recv_topk_idx`` -1) and, as in DeepEP, an empty
                ``num_recv_tokens_per_expert_list``; an error if more tokens arrive.
            config: None or this Buffer's config.
            previous_event, async_finish, allocate_on_comm_stream: host backend: None / False /
                False (anything else is refused).

        Returns:
            recv_x: ``[rows, H]`` (same type as ``x``; a tuple with ``[rows, H / 128]`` scales
                for fp8), grouped by source rank ascending, token order within a source.
            recv_topk_idx: ``[rows, K]`` int64 local expert ids (-1 where not on this rank).
            recv_topk_weights: ``[rows, K]`` float32 (0 where ``recv_topk_idx`` is -1).
            num_recv_tokens_per_expert_list: Python list of ``L`` ints.
            handle: a :class:`DispatchHandle` for ``combine``.
            event: ``EventOverlap(None)``.
            In cached mode (``handle`` given) only ``recv_x`` and ``event`` are returned, the
            others are None (as in DeepEP).
        """
        p = self._ptr
        if not p:
            raise RuntimeError("Buffer: already destroyed")
        if config is not None:
            self._check_config(config)
        g = self._g
        if g is not None:
            if num_tokens_per_rank is not None or num_tokens_per_rdma_rank is not None \
                    or is_token_in_rank is not None or num_tokens_per_expert is not None:
                # This Buffer's last get_dispatch_layout outputs, passed back as they came (the
                # documented call), are known good: not checked again.
                lo = g._layout_out
                if not lo or num_tokens_per_rank is not lo[0] \
                        or num_tokens_per_rdma_rank is not lo[1] \
                        or num_tokens_per_expert is not lo[2] or is_token_in_rank is not lo[3]:
                    self._layout_args(None, num_tokens_per_rank, num_tokens_per_rdma_rank,
                                      is_token_in_rank, num_tokens_per_expert)
            return g.dispatch(x, handle, topk_idx, topk_weights, expert_alignment,
                              num_worst_tokens, previous_event, async_finish,
                              allocate_on_comm_stream)
        if previous_event is not None:
            _no_event(previous_event)
        if async_finish or allocate_on_comm_stream:
            _host_only(async_finish, allocate_on_comm_stream)
        h = self.hidden
        k = self.num_topk

        # ---- x
        if type(x) is tuple:
            if len(x) != 2:
                raise ValueError(f"x: a tuple must be (x, x_scales), got {len(x)} elements")
            xo, so = x
            xp, xc, t, _ = in2("x", xo, FEP_DTYPE_FP8_E4M3, None, h)
            sp = in2("x_scales", so, FEP_DTYPE_F32, t, h // FP8_GROUP)[0]
        else:
            xo, so = x, None
            xp, xc, t, _ = in2("x", xo, None, None, h)
            if xc != FEP_DTYPE_BF16:
                raise TypeError(
                    f"x: dtype {xo.dtype}: pass bf16 tokens, or fp8 as a tuple (x, x_scales)"
                )
            sp = 0
        if xc != self._dispatch_code:
            raise TypeError(
                f"x: {'fp8' if so is not None else 'bf16'} tokens on a Buffer built with "
                f"dispatch_dtype={self.dispatch_dtype!r} (fabric-ep sizes its buffer for one "
                "token format: build it with the other dispatch_dtype)"
            )

        # ---- routing
        if handle is not None:
            _check_cached_handle(handle, self, topk_idx, topk_weights, t)
            ip = wp = 0
            cached = handle._ptr
        else:
            if topk_idx is None:
                raise ValueError("topk_idx: required unless a cached handle is given")
            if topk_weights is None:
                raise ValueError("topk_weights: required when topk_idx is given")
            ip = in2("topk_idx", topk_idx, FEP_DTYPE_I64, t, k)[0]
            wp = in2("topk_weights", topk_weights, FEP_DTYPE_F32, t, k)[0]
            cached = None
        if (num_tokens_per_rank is not None or num_tokens_per_rdma_rank is not None
                or is_token_in_rank is not None or num_tokens_per_expert is not None):
            self._layout_args(t, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                              num_tokens_per_expert)
        if type(expert_alignment) is not int or not 1 <= expert_alignment < 2**31:
            raise ValueError(f"expert_alignment: {expert_alignment!r} must be an int in [1, 2**31)")
        if type(num_worst_tokens) is not int or not 0 <= num_worst_tokens < 2**31:
            raise ValueError(f"num_worst_tokens: {num_worst_tokens!r} must be an int in [0, 2**31)")

        # ---- step 1: communicate; learn the row count.
        hp, rows = self._n.dispatch(p, xp, t, sp if so is not None else None,
                                    None if cached else ip, None if cached else wp, cached,
                                    expert_alignment, num_worst_tokens)
        new_handle = DispatchHandle(hp, id(self), t, rows)  # owns hp from here on

        # ---- step 2: outputs into arrays of the caller's library.
        recv_x, rxp = alloc(xo, (rows, h))
        if so is not None:
            recv_s, rsp = alloc(so, (rows, h // FP8_GROUP))
        else:
            recv_s = rsp = None
        if handle is None:
            recv_idx, rip = alloc(topk_idx, (rows, k))
            recv_w, rwp = alloc(topk_weights, (rows, k))
        else:
            recv_idx = recv_w = rip = rwp = None
        counts = self._n.copy_out(hp, rows, rxp, rsp, rip, rwp)
        out_x = recv_x if so is None else (recv_x, recv_s)
        if handle is not None:
            return out_x, None, None, None, None, NO_EVENT
        if num_worst_tokens > 0:
            counts = []
        return out_x, recv_idx, recv_w, counts, new_handle, NO_EVENT

    def _layout_args(self, t: Optional[int], per_rank: Any, per_rdma: Any, in_rank: Any,
                     per_expert: Any) -> None:
        """Checks ``get_dispatch_layout``'s outputs passed to ``dispatch`` (shape and dtype only:
        the library derives the counts from ``topk_idx``)."""
        if self._g is not None:
            g = self._g
            if per_rank is not None:
                g.tn("num_tokens_per_rank", per_rank, (g.i32,), (self.num_ranks,))
            if per_rdma is not None:
                g.tn("num_tokens_per_rdma_rank", per_rdma, (g.i32,), (self._num_nodes,))
            if in_rank is not None:
                rows = in_rank.shape[0] if isinstance(in_rank, g.Tensor) and in_rank.dim() == 2 else -1
                g.tn("is_token_in_rank", in_rank, (g.torch.bool,), (rows, self.num_ranks))
            if per_expert is not None:
                g.tn("num_tokens_per_expert", per_expert, (g.i32,), (self.num_experts,))
            return
        if per_rank is not None:
            arr("num_tokens_per_rank", per_rank, FEP_DTYPE_I32, (self.num_ranks,))
        if per_rdma is not None:
            arr("num_tokens_per_rdma_rank", per_rdma, FEP_DTYPE_I32, (self._num_nodes,))
        if in_rank is not None:
            arr("is_token_in_rank", in_rank, FEP_DTYPE_BOOL, (t, self.num_ranks))
        if per_expert is not None:
            arr("num_tokens_per_expert", per_expert, FEP_DTYPE_I32, (self.num_experts,))

    def combine(
        self,
        x: Any,
        handle: DispatchHandle,
        topk_weights: Optional[Any] = None,
        bias: Any = None,
        config: Optional[Config] = None,
        previous_event: Optional[EventOverlap] = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> Tuple[Any, Optional[Any], EventOverlap]:
        """Normal-mode combine: returns each token's rows to its source rank and sums them.

        Arguments:
            x: ``[rows, H]`` bf16, rows as the dispatch's ``recv_x`` (with ``num_worst_tokens``
                all of them; padding rows are ignored).
            handle: the dispatch's handle.
            topk_weights: optional ``[rows, K]`` float32, summed back like ``x``.
            bias: must be None (fabric-ep's combine has no bias add).
            config, previous_event, async_finish, allocate_on_comm_stream: as in ``dispatch``.

        Returns:
            combined_x: ``[T, H]`` bf16 (same type as ``x``): per token, the fp32 sum over the
                ranks it went to (0 for tokens that went nowhere).
            combined_topk_weights: ``[T, K]`` float32, or None without ``topk_weights``.
            event: ``EventOverlap(None)``.
        """
        p = self._ptr
        if not p:
            raise RuntimeError("Buffer: already destroyed")
        if bias is not None:
            raise ValueError("bias: fabric-ep's combine has no bias add; add it before or after")
        if config is not None:
            self._check_config(config)
        if type(handle) is not DispatchHandle:
            raise TypeError(
                f"handle: expected a fabric_ep DispatchHandle, got {type(handle).__name__}"
            )
        if handle._buffer_id != id(self) or not handle._ptr:
            raise ValueError("handle: made by another Buffer (or already freed)")
        if self._g is not None:
            return self._g.combine(x, handle, topk_weights, previous_event, async_finish,
                                   allocate_on_comm_stream)
        if previous_event is not None:
            _no_event(previous_event)
        if async_finish or allocate_on_comm_stream:
            _host_only(async_finish, allocate_on_comm_stream)
        h = self.hidden
        k = self.num_topk
        rows = handle.num_recv_tokens
        t = handle.num_tokens
        xp = in2("x", x, FEP_DTYPE_BF16, rows, h)[0]
        out, outp = alloc(x, (t, h))
        if topk_weights is not None:
            wp = in2("topk_weights", topk_weights, FEP_DTYPE_F32, rows, k)[0]
            cw, cwp = alloc(topk_weights, (t, k))
        else:
            wp = cwp = cw = None
        self._n.combine(p, handle._ptr, xp, rows, wp, outp, t, cwp)
        return out, cw, NO_EVENT

    # ---------------------------------------------------------------- low-latency mode

    def _ll_check(self, call: str) -> int:
        p = self._ptr
        if not p:
            raise RuntimeError("Buffer: already destroyed")
        if not self.low_latency_mode:
            raise ValueError(
                f"{call}: this Buffer was built with low_latency_mode=False (as DeepEP, the "
                "low-latency calls need Buffer(..., low_latency_mode=True))"
            )
        return p

    def _ll_shape_args(self, num_max_dispatch_tokens_per_rank: int, hidden: Optional[int],
                       num_experts: int) -> None:
        if num_max_dispatch_tokens_per_rank != self.num_max_dispatch_tokens_per_rank:
            raise ValueError(
                f"num_max_dispatch_tokens_per_rank: {num_max_dispatch_tokens_per_rank}, but this "
                f"Buffer was built for {self.num_max_dispatch_tokens_per_rank} (fabric-ep sizes the "
                "low-latency buffer at construction: Buffer(..., "
                "num_max_dispatch_tokens_per_rank=N))"
            )
        if hidden is not None and hidden != self.hidden:
            raise ValueError(f"hidden: {hidden}, but this Buffer was built for {self.hidden}")
        if num_experts != self.num_experts:
            raise ValueError(
                f"num_experts: {num_experts}, but this Buffer was built for {self.num_experts}"
            )

    def low_latency_dispatch(
        self,
        x: Any,
        topk_idx: Any,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        cumulative_local_expert_recv_stats: Optional[Any] = None,
        dispatch_wait_recv_cost_stats: Optional[Any] = None,
        use_fp8: bool = True,
        round_scale: bool = False,
        use_ue8m0: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
    ) -> Tuple[Any, Any, "LowLatencyHandle", EventOverlap, Optional[Callable[[], None]]]:
        """Low-latency dispatch (DeepEP V1 semantics). ``L`` local experts,
        ``S = num_ranks * num_max_dispatch_tokens_per_rank``.

        Arguments:
            x: ``[T, H]`` bf16, ``T <= num_max_dispatch_tokens_per_rank``.
            topk_idx: ``[T, K]`` int64, -1 = none (an expert at most once per token).
            num_max_dispatch_tokens_per_rank, num_experts: must equal the Buffer's.
            cumulative_local_expert_recv_stats: optional ``[L]`` int32; the received count of
                each local expert is added to it (DeepEP's EPLB statistics).
            dispatch_wait_recv_cost_stats: optional ``[R]`` int64; the receive adds to entry
                ``r`` the nanoseconds it waited for rank ``r``'s messages (summed over them, one
                per local expert; DeepEP's statistics for finding slow ranks).
            use_fp8: cast to fp8 e4m3 with one float32 scale per 128 channels.
            round_scale: power-of-two scales. use_ue8m0: must be False (no UE8M0 packing).
            async_finish: must be False on the host backend.
            return_recv_hook: return after the sends; calling ``hook()`` does the receive and
                fills ``recv_x``/``recv_count``/the handle (valid only after it).

        Returns:
            recv_x: ``[L, S, H]`` bf16 (same dtype as ``x``), or with ``use_fp8`` a tuple of
                ``[L, S, H]`` fp8 e4m3 (numpy uint8 / ml_dtypes float8_e4m3fn; torch
                float8_e4m3fn) and ``[L, S, H / 128]`` float32 scales. For local expert ``e``,
                rows from source rank 0 first, then rank 1, ...; rows past ``recv_count[e]``
                are zero.
            recv_count: ``[L]`` int32 rows received per local expert.
            handle: a :class:`LowLatencyHandle` for ``low_latency_combine``.
            event: ``EventOverlap(None)``.
            hook: None, or with ``return_recv_hook`` a callable completing the receive.
        """
        p = self._ptr
        # NOTES: one conjunction in the common case; the helpers name what is wrong.
        if not (p and self.low_latency_mode and num_experts == self.num_experts
                and num_max_dispatch_tokens_per_rank == self.num_max_dispatch_tokens_per_rank):
            p = self._ll_check("low_latency_dispatch")
            self._ll_shape_args(num_max_dispatch_tokens_per_rank, None, num_experts)
        if use_ue8m0:
            raise ValueError("use_ue8m0=True: fabric-ep's fp8 scales are float32; pass False")
        if self._g is not None:
            return self._g.ll_dispatch(x, topk_idx, cumulative_local_expert_recv_stats,
                                       dispatch_wait_recv_cost_stats, use_fp8, round_scale,
                                       async_finish, return_recv_hook)
        ws = wait_stats_arg("dispatch_wait_recv_cost_stats", dispatch_wait_recv_cost_stats,
                            self.num_ranks)
        if async_finish:
            _host_only(async_finish, False)
        h, k = self.hidden, self.num_topk
        xp, _, t, is_torch = in2("x", x, FEP_DTYPE_BF16, None, h)
        if t > self.num_max_dispatch_tokens_per_rank:
            raise ValueError(
                f"x: {t} tokens, more than num_max_dispatch_tokens_per_rank "
                f"{self.num_max_dispatch_tokens_per_rank}"
            )
        ip = in2("topk_idx", topk_idx, FEP_DTYPE_I64, t, k)[0]
        stats = None
        if cumulative_local_expert_recv_stats is not None:
            stats = arr("cumulative_local_expert_recv_stats", cumulative_local_expert_recv_stats,
                        FEP_DTYPE_I32, (self.num_local_experts,)).obj
        l, sz = self.num_local_experts, self.num_ranks * self.num_max_dispatch_tokens_per_rank
        n = self._n
        op = n.ll_dispatch(p, xp, t, ip, bool(use_fp8), bool(round_scale), bool(return_recv_hook),
                           ws.ptr if ws is not None else None)
        handle = LowLatencyHandle(op, id(self), t, self.num_max_dispatch_tokens_per_rank,
                                  h, self.num_experts)
        like = x
        if use_fp8:
            recv_x = fp8_empty(like, (l, sz, h))
            recv_s = empty_like_kind(like, (l, sz, h // FP8_GROUP), FEP_DTYPE_F32)
        else:
            recv_x = empty_like_kind(like, (l, sz, h))
            recv_s = None
        recv_count = empty_like_kind(like, (l,), FEP_DTYPE_I32)
        handle.src_rank = empty_like_kind(like, (l, sz), FEP_DTYPE_I32)
        handle.src_idx = empty_like_kind(like, (l, sz), FEP_DTYPE_I32)
        handle.layout_range = empty_like_kind(like, (l, self.num_ranks), FEP_DTYPE_I64)
        outs = (bool(use_fp8), data_ptr(recv_x),
                data_ptr(recv_s) if recv_s is not None else None, data_ptr(recv_count),
                data_ptr(handle.src_rank), data_ptr(handle.src_idx), data_ptr(handle.layout_range))
        buf_ref = self
        # The native op adds to the wait-cost array in its receive: kept alive until then.
        handle._keep = ws

        def receive() -> None:
            bp = buf_ref._ptr
            if not bp:
                raise RuntimeError("low_latency_dispatch hook: the Buffer was destroyed")
            if handle._received:
                raise RuntimeError("low_latency_dispatch hook: already called")
            n.ll_complete(bp, handle._ptr)
            n.ll_dispatch_copy_out(handle._ptr, *outs)
            handle._received = True
            handle._keep = None
            if stats is not None:
                _accumulate(stats, recv_count)

        out_x = (recv_x, recv_s) if use_fp8 else recv_x
        if return_recv_hook:
            return out_x, recv_count, handle, NO_EVENT, receive
        receive()
        return out_x, recv_count, handle, NO_EVENT, None

    def low_latency_combine(
        self,
        x: Any,
        topk_idx: Any,
        topk_weights: Any,
        handle: "LowLatencyHandle",
        use_logfmt: bool = False,
        zero_copy: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        out: Optional[Any] = None,
        combine_wait_recv_cost_stats: Optional[Any] = None,
    ) -> Tuple[Any, EventOverlap, Optional[Callable[[], None]]]:
        """Low-latency combine (DeepEP V1 semantics).

        Arguments:
            x: ``[L, S, H]`` bf16 expert outputs, rows as ``low_latency_dispatch`` delivered
                them (rows past the counts are ignored).
            topk_idx: ``[T, K]`` int64, the ids given to the dispatch (an entry may be -1 to
                leave that expert out of the sum). topk_weights: ``[T, K]`` float32.
            handle: the dispatch's :class:`LowLatencyHandle` (its hook, if any, called).
            use_logfmt: accepted; the combine sends bf16 (no LogFMT compression: at least as
                accurate). zero_copy: must be False here (the facade's zero-copy form passes
                its tensor as ``x``). async_finish: must be False on the host backend.
            combine_wait_recv_cost_stats: optional ``[R]`` int64; the receive adds to entry
                ``r`` the nanoseconds it waited for rank ``r``'s answers.
            return_recv_hook: return after the sends; ``hook()`` receives and fills the output.
            out: optional ``[T, H]`` bf16 array to write the result into.

        Returns:
            combined_x: ``[T, H]`` bf16 (``out`` when given): per token, the fp32 sum of
                ``weight * expert output`` over its experts, rounded once.
            event: ``EventOverlap(None)``.
            hook: None, or with ``return_recv_hook`` a callable completing the receive.
        """
        p = self._ll_check("low_latency_combine")
        # NOTES: use_logfmt is accepted and the payload stays bf16 (LogFMT is DeepEP's lossy
        # 10-bit compression; bf16 is at least as accurate), on both backends.
        if zero_copy:
            raise ValueError(
                "zero_copy=True: fabric-ep does not expose its low-latency buffer "
                "(get_next_low_latency_combine_buffer); pass False"
            )
        if type(handle) is not LowLatencyHandle:
            raise TypeError(
                f"handle: expected a fabric_ep LowLatencyHandle, got {type(handle).__name__}"
            )
        if handle._buffer_id != id(self) or not handle._ptr:
            raise ValueError("handle: made by another Buffer (or already freed)")
        if not handle._received:
            raise ValueError("handle: its dispatch's receive hook has not been called yet")
        if self._g is not None:
            return self._g.ll_combine(x, topk_idx, topk_weights, handle, out, async_finish,
                                      return_recv_hook, combine_wait_recv_cost_stats)
        if async_finish:
            _host_only(async_finish, False)
        ws = wait_stats_arg("combine_wait_recv_cost_stats", combine_wait_recv_cost_stats,
                            self.num_ranks)
        h, k, t = self.hidden, self.num_topk, handle.num_tokens
        l, sz = self.num_local_experts, self.num_ranks * self.num_max_dispatch_tokens_per_rank
        xa = arr("x", x, FEP_DTYPE_BF16, (l, sz, h))
        ip = in2("topk_idx", topk_idx, FEP_DTYPE_I64, t, k)[0]
        wp = in2("topk_weights", topk_weights, FEP_DTYPE_F32, t, k)[0]
        if out is not None:
            combined = arr("out", out, FEP_DTYPE_BF16, (t, h)).obj
        else:
            combined = empty_like_kind(x, (t, h))
        n = self._n
        cop = _LowLatencyOp(n.ll_combine(p, handle._ptr, xa.ptr, ip, wp, t, bool(return_recv_hook),
                                         ws.ptr if ws is not None else None))
        outp = data_ptr(combined)
        buf_ref = self

        def receive() -> None:
            bp = buf_ref._ptr
            if not bp:
                raise RuntimeError("low_latency_combine hook: the Buffer was destroyed")
            if cop.done:
                raise RuntimeError("low_latency_combine hook: already called")
            n.ll_complete(bp, cop.ptr)
            n.ll_combine_copy_out(cop.ptr, outp, t)
            cop.done = True
            _ = ws  # the native op added to it in its receive: alive until here

        if return_recv_hook:
            return combined, NO_EVENT, receive
        receive()
        return combined, NO_EVENT, None

    def get_next_low_latency_combine_buffer(self, handle: Any) -> Any:
        raise NotImplementedError(
            "get_next_low_latency_combine_buffer: fabric-ep does not expose its low-latency "
            "buffer (zero_copy combine is not supported)"
        )

    def clean_low_latency_buffer(
        self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int
    ) -> None:
        """Makes the low-latency buffer usable again (after a failed or abandoned step).
        Collective: every rank calls it. Earlier low-latency handles and hooks become invalid.
        The arguments must match the Buffer's (fabric-ep sized the buffer at construction)."""
        p = self._ll_check("clean_low_latency_buffer")
        self._ll_shape_args(num_max_dispatch_tokens_per_rank, hidden, num_experts)
        if self._g is not None:
            # GPU: no kernel of the group may run while any rank resets (collective fence).
            self._g.quiesce()
            if self._shrink:
                # Among the unmasked ranks only, in band (a masked rank does not take part in
                # the group's barrier): the native clean fences before and after its reset.
                core.clean_low_latency_buffer(p)
                return
            self._barrier()
        core.clean_low_latency_buffer(p)
        if self._g is not None:
            self._barrier()

    def _barrier(self) -> None:
        if self._boot is not None:
            self._boot.barrier()
        else:
            from ._gpu import group_barrier

            group_barrier(self.group)


class _CudaRegion:
    """``__cuda_array_interface__`` of ``nbytes`` bytes of device memory at ``addr`` (what
    ``torch.as_tensor`` views without copying)."""

    def __init__(self, addr: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (addr, False), "version": 3,
            "strides": None,
        }


def local_view(g: Any, addr: int, nbytes: int, dtype: Any, size: Any, offset: int) -> Any:
    """``get_local_buffer_tensor``'s view: ``nbytes`` at ``addr`` from byte ``offset``, as
    ``dtype`` (1-D, or ``size``'s shape); device memory when ``g`` (the GPU path) is given."""
    torch = sys.modules.get("torch")
    is_torch = torch is not None and isinstance(dtype, torch.dtype)
    if g is not None and not is_torch:
        raise TypeError(f"dtype: {dtype!r}: the GPU backend's view is a torch tensor; pass a "
                        "torch.dtype")
    if is_torch:
        item = torch.empty((), dtype=dtype).element_size()
    else:
        try:
            np_dt = np.dtype(dtype)
        except TypeError:
            raise TypeError(f"dtype: {dtype!r} is neither a torch.dtype nor a numpy dtype") \
                from None
        item = np_dt.itemsize
    if not 0 <= offset <= nbytes:
        raise ValueError(f"offset: {offset} bytes, outside the region's {nbytes} bytes")
    if offset % item:
        raise ValueError(f"offset: {offset} bytes is not a multiple of the {item}-byte element")
    avail = (nbytes - offset) // item
    if size is None:
        shape: Tuple[int, ...] = (avail,)
    else:
        dims = (size,) if isinstance(size, (int, np.integer)) and not isinstance(size, bool) \
            else tuple(size) if isinstance(size, (tuple, list)) or (
                torch is not None and isinstance(size, torch.Size)) else None
        if dims is None or any(isinstance(d, bool) or not isinstance(d, (int, np.integer))
                               or d < 0 for d in dims):
            raise TypeError(f"size: {size!r} must be a torch.Size, a tuple of non-negative ints "
                            "or an int")
        shape = tuple(int(d) for d in dims)
        n = 1
        for d in shape:
            n *= d
        if n > avail:
            raise ValueError(f"size: {list(shape)} is {n} elements of {item} bytes, the region "
                             f"has {avail} from offset {offset} ({nbytes} bytes)")
        avail = n
    count = avail * item
    if g is not None:
        raw = torch.as_tensor(_CudaRegion(addr + offset, count), device=f"cuda:{g.dev}")
        return raw.view(dtype).view(shape)
    import ctypes

    raw = np.ctypeslib.as_array((ctypes.c_uint8 * count).from_address(addr + offset)) \
        if count else np.empty(0, np.uint8)
    if is_torch:
        return torch.from_numpy(raw).view(dtype).view(shape)
    return raw.view(np_dt).reshape(shape)


def layout_host(r: int, rpn: int, topk_idx: Any, num_experts: int, previous_event: Any,
                async_finish: bool, allocate_on_comm_stream: bool) -> Tuple[Any, ...]:
    """``get_dispatch_layout`` on the host backend for ``r`` ranks, ``rpn`` per node."""
    _no_event(previous_event)
    _host_only(async_finish, allocate_on_comm_stream)
    idx = arr("topk_idx", topk_idx, FEP_DTYPE_I64, (None, None))
    t, k = idx.shape
    nodes = r // rpn
    per_rank = idx.empty((r,), FEP_DTYPE_I32)
    per_node = idx.empty((nodes,), FEP_DTYPE_I32)
    per_expert = idx.empty((num_experts,), FEP_DTYPE_I32)
    in_rank = idx.empty((t, r), FEP_DTYPE_BOOL)
    core.layout_host(idx.ptr, t, k, num_experts, r, rpn, data_ptr(per_rank), data_ptr(per_node),
                     data_ptr(per_expert), data_ptr(in_rank))
    return per_rank, per_node if nodes > 1 else None, per_expert, in_rank, NO_EVENT


def _check_cached_handle(handle: Any, buf: Any, topk_idx: Any, topk_weights: Any, t: int) -> None:
    """A cached-handle dispatch's arguments (host and GPU backends alike)."""
    if type(handle) is not DispatchHandle:
        raise TypeError(
            f"handle: expected a fabric_ep DispatchHandle, got {type(handle).__name__}"
        )
    if handle._buffer_id != id(buf) or not handle._ptr:
        raise ValueError("handle: made by another Buffer (or already freed)")
    if topk_idx is not None or topk_weights is not None:
        raise ValueError(
            "topk_idx/topk_weights: must be None with a cached handle (the handle holds "
            "the routing)"
        )
    if t != handle.num_tokens:
        raise ValueError(f"x: {t} tokens, the handle was made for {handle.num_tokens}")


def _auto_backend(group: Any) -> str:
    """``"gpu"`` for an NCCL process group or an ``all_gather_bytes`` group when torch sees a
    CUDA device; ``"host"`` otherwise."""
    if group is None:
        return "host"
    import sys

    torch = sys.modules.get("torch")
    if torch is None:
        return "host"
    try:
        if not torch.cuda.is_available():
            return "host"
    except Exception:  # noqa: BLE001 - a broken CUDA install: the host backend still works
        return "host"
    if hasattr(group, "all_gather_bytes"):
        return "gpu"
    try:
        import torch.distributed as dist

        return "gpu" if "nccl" in str(dist.get_backend(group)).lower() else "host"
    except Exception:  # noqa: BLE001 - not a torch group
        return "host"


def _accumulate(stats: Any, counts: Any) -> None:
    """``stats += counts`` in place across numpy/torch (the stats array is the caller's)."""
    if type(stats) is np.ndarray:
        stats += np.asarray(counts, dtype=stats.dtype)
    elif type(counts) is np.ndarray:
        import torch

        stats.add_(torch.from_numpy(counts))
    else:
        stats.add_(counts)


def fp8_empty(like: Any, shape: Tuple[int, ...]) -> Any:
    """fp8 e4m3 output in ``like``'s library: torch.float8_e4m3fn; numpy
    ml_dtypes.float8_e4m3fn when ``like`` is ml_dtypes.bfloat16, else uint8 bytes."""
    if type(like) is np.ndarray:
        if like.dtype.name == "bfloat16":
            import ml_dtypes  # the bf16 dtype came from it

            return np.empty(shape, ml_dtypes.float8_e4m3fn)
        return np.empty(shape, np.uint8)
    import torch

    return torch.empty(shape, dtype=getattr(torch, "float8_e4m3fn", torch.uint8))


def _destroy_ll_op(ptr: int, _destroy=core.ll_op_destroy) -> None:
    _destroy(ptr)


class _LowLatencyOp:
    """Owns a ``fep_ll_op`` (a combine's)."""

    __slots__ = ("ptr", "done")

    def __init__(self, ptr: int):
        self.ptr = ptr
        self.done = False

    def __del__(self, _destroy=_destroy_ll_op) -> None:
        p, self.ptr = self.ptr, 0
        if p:
            _destroy(p)


def _destroy_gpu_ll_op(ptr: int, _destroy=core.gpu_ll_op_destroy) -> None:
    _destroy(ptr)


class _GpuLowLatencyOp:
    """Owns a ``fep_gpu_ll_op`` (a combine's) and the tensors its receive uses."""

    __slots__ = ("ptr", "done", "keep")

    def __init__(self, ptr: int, keep: Tuple[Any, ...]):
        self.ptr = ptr
        self.done = False
        self.keep = keep

    def __del__(self, _destroy=_destroy_gpu_ll_op) -> None:
        p, self.ptr = self.ptr, 0
        if p:
            _destroy(p)


class LowLatencyHandle:
    """What ``low_latency_dispatch`` returns as ``handle``; pass it to ``low_latency_combine``.
    Owns the dispatch's native op. Attributes (valid once the receive is done): ``src_rank`` and
    ``src_idx`` ``[L, S]`` int32 (source rank / token index of each row, -1 past the counts on
    the host backend; unspecified past the counts on the GPU backend), ``layout_range`` ``[L, R]``
    int64 (DeepEP's packing: ``begin << 32 | count``; computed on first access on the GPU),
    ``num_max_dispatch_tokens_per_rank``, ``hidden``, ``num_experts``."""

    __slots__ = ("_ptr", "_buffer_id", "_received", "num_tokens", "num_max_dispatch_tokens_per_rank",
                 "hidden", "num_experts", "_src_rank", "_src_idx", "_layout_range", "_gpu",
                 "_pairs_v", "_routing", "_keep", "_zero_copy")

    def __init__(self, ptr: int, buffer_id: int, num_tokens: int, max_tokens: int, hidden: int,
                 num_experts: int, gpu: bool = False):
        self._ptr = ptr
        self._buffer_id = buffer_id
        self._received = False
        self._gpu = gpu
        self.num_tokens = num_tokens
        self.num_max_dispatch_tokens_per_rank = max_tokens
        self.hidden = hidden
        self.num_experts = num_experts
        self._src_rank = self._src_idx = self._layout_range = self._pairs_v = None
        # GPU: (the routing block, ((element offset, shape) of src_rank, src_idx, pairs)): the
        # three are views of it, made on first read (GpuPath.ll_dispatch).
        self._routing: Any = None
        self._keep: Any = None
        # The zero-copy combine's input (fabric_ep.Buffer.get_next_low_latency_combine_buffer).
        self._zero_copy: Any = None

    def _part(self, i: int) -> Any:
        block, views = self._routing
        off, shape = views[i]
        n = 1
        for d in shape:
            n *= d
        return block[off:off + n].view(shape)

    @property
    def src_rank(self) -> Any:
        if self._src_rank is None and self._routing is not None:
            self._src_rank = self._part(0)
        return self._src_rank

    @src_rank.setter
    def src_rank(self, v: Any) -> None:
        self._src_rank = v

    @property
    def src_idx(self) -> Any:
        if self._src_idx is None and self._routing is not None:
            self._src_idx = self._part(1)
        return self._src_idx

    @src_idx.setter
    def src_idx(self, v: Any) -> None:
        self._src_idx = v

    @property
    def _pairs(self) -> Any:
        """GPU: ``[L, R, 2]`` int32 (begin, count) of each (local expert, source rank)."""
        if self._pairs_v is None and self._routing is not None:
            self._pairs_v = self._part(2)
        return self._pairs_v

    @property
    def layout_range(self) -> Any:
        if self._layout_range is None and self._pairs is not None:
            import torch

            p = self._pairs.to(torch.int64)
            self._layout_range = (p[..., 0] << 32) | p[..., 1]
        return self._layout_range

    @layout_range.setter
    def layout_range(self, v: Any) -> None:
        self._layout_range = v

    def __del__(self, _destroy=_destroy_ll_op, _destroy_gpu=_destroy_gpu_ll_op) -> None:
        p, self._ptr = self._ptr, 0
        if p:
            (_destroy_gpu if self._gpu else _destroy)(p)


def _public_buffer() -> Any:
    """:class:`fabric_ep.Buffer` (its class settings, ``num_sms``, and default configs)."""
    from ._facade import Buffer

    return Buffer
