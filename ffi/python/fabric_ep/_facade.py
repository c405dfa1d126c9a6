"""``fabric_ep.Buffer``: DeepEP V1's ``deep_ep.Buffer`` as frameworks construct and call it.

DeepEP sizes one buffer from byte counts and takes the model shape (hidden size, top-k, number
of experts) and the token format (bf16, or fp8 with scales) with each call. fabric-ep's native
buffers are built for one shape and format (their records and queues are laid out for it), so
this class keeps one native buffer per shape a job uses (an :class:`_Engine`), created on the
shape's first call and reused by every later call of that shape:

* normal mode: one per ``(backend, num_experts, hidden, num_topk, bf16 | fp8)``;
* low latency: one per ``(backend, num_experts, hidden, num_topk,
  num_max_dispatch_tokens_per_rank, use_fp8)`` (the host backend casts per call, so there
  ``use_fp8`` is not part of the key).

NOTES (collective creation): creating a native buffer is collective, so it happens inside the
first call of a shape on every rank at once. DeepEP's contract gives that for free: every rank
makes the same calls in the same order with the same hidden size, top-k, number of experts and
format (ranks with no tokens pass ``[0, hidden]`` tensors). All native buffers of one ``Buffer``
share one bootstrap (the group's all-gather, or one join of the torchrun store), one
communication stream and one lifetime: :meth:`destroy` frees them in creation order.

The backend follows the tensors: torch CUDA tensors take the GPU backend (CUDA kernels, ranks
as processes reaching each other's buffers through CUDA IPC), numpy arrays and CPU tensors the
host backend, whatever the group's own backend (NCCL, gloo, or none).
"""

from __future__ import annotations

import math
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import numpy as np

from . import _ext
from ._ext import FEP_MODE_LOW_LATENCY, FEP_MODE_NORMAL, core
from .buffer import (
    DispatchHandle,
    LowLatencyHandle,
    _default_ranks_per_node,
    _env_int,
    _Engine,
    _TorchAllGather,
)
from .config import DEFAULT_NUM_SMS, Config, gpu_chunking, normal_buffer_bytes
from .utils import EventOverlap

_DTYPES = ("bf16", "fp8")
_BACKENDS = {True: "gpu", False: "host"}


def _bool_arg(name: str, v: Any) -> bool:
    """``v`` as a bool (Python or numpy bools only, as DeepEP's bindings take them), else
    TypeError naming ``name``: a string or a number is a mistake, not a truth value."""
    if not isinstance(v, (bool, np.bool_)):
        raise TypeError(f"{name}: {v!r} must be a bool")
    return bool(v)


# The library's limit on fep_config.provider (a libfabric provider name or list).
_MAX_PROVIDER_BYTES = 256


def _check_provider(provider: Any) -> None:
    if provider is None:
        return
    if not isinstance(provider, str):
        raise ValueError(f"provider: {provider!r} must be a str (or None)")
    try:
        raw = provider.encode()
    except UnicodeEncodeError:
        raise ValueError(f"provider: {provider!r} is not encodable as UTF-8") from None
    if not provider.strip() or len(raw) > _MAX_PROVIDER_BYTES \
            or any(not ch.isprintable() for ch in provider):
        raise ValueError(f"provider: {provider[:64]!r} must be a non-blank, printable name of at "
                         f"most {_MAX_PROVIDER_BYTES} bytes (no NUL)")


def _int_arg(name: str, v: Any, lo: int, hi: int = 2**31 - 1) -> int:
    """``v`` as an int in ``[lo, hi]`` (bools refused), else ValueError naming ``name``."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise ValueError(f"{name}: {v!r} must be an int")
    v = int(v)
    if not lo <= v <= hi:
        raise ValueError(f"{name}: {v} must be in [{lo}, {hi}]")
    return v


class _Boot:
    """The bootstrap every native buffer of one :class:`Buffer` is created over: ``gather`` (an
    all-gather callback over the caller's group) or ``ptr`` (a native ``fep_boot``: the torchrun
    store, joined once)."""

    def __init__(self, group: Any, timeout_s: float):
        self.group = group
        self.gather: Any = None
        self.ptr = 0
        if group is not None and hasattr(group, "all_gather_bytes"):
            from ._gpu import CallbackAllGather

            self.gather = CallbackAllGather(group)
            self.rank, self.size = int(group.rank()), int(group.size())
            self.local_size: Optional[int] = None
        elif group is not None:
            self.gather = _TorchAllGather(group)
            self.rank, self.size = int(group.rank()), int(group.size())
            self.local_size = None
        else:
            self.ptr = core.boot_create(float(timeout_s))
            self.rank, self.size, _, self.local_size = core.boot_rank(self.ptr)

    def barrier(self) -> None:
        if self.ptr:
            core.boot_allgather(self.ptr, b"\0")
        else:
            from ._gpu import group_barrier

            group_barrier(self.group)

    def close(self) -> None:
        p, self.ptr = self.ptr, 0
        if p:
            core.boot_destroy(p)


def _backend_of(a: Any) -> str:
    """``"gpu"`` for a torch CUDA tensor, ``"host"`` for numpy arrays and CPU tensors."""
    if type(a) is np.ndarray:
        return "host"
    return "gpu" if getattr(a, "is_cuda", False) else "host"


def _width(name: str, a: Any) -> int:
    shape = getattr(a, "shape", None)
    if shape is None:
        raise TypeError(f"{name}: expected a numpy.ndarray or a torch.Tensor, got "
                        f"{type(a).__name__}")
    if len(shape) != 2:
        raise ValueError(f"{name}: expected a [T, *] array or tensor, got shape "
                         f"{None if shape is None else list(shape)}")
    return int(shape[1])


class Buffer:
    """DeepEP V1's ``Buffer`` on fabric-ep (see the module notes for how shapes map onto native
    buffers).

    Arguments (DeepEP's, in DeepEP's order):
        group: a ``torch.distributed`` ProcessGroup of any backend (NCCL, gloo), any object
            with ``rank()``, ``size()`` and ``all_gather_bytes(bytes) -> list[bytes]`` (e.g.
            :class:`fabric_ep.ThreadGroup`), or ``None``: the torchrun variables ``RANK``,
            ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` (fabric-ep's store listens on
            ``MASTER_PORT + 1`` unless ``FEP_MASTER_PORT`` is set), ``LOCAL_RANK``,
            ``LOCAL_WORLD_SIZE``; the store is joined here, once.
        num_nvl_bytes, num_rdma_bytes: the capacity, as DeepEP sizes it (``Config``'s
            ``get_nvl_buffer_size_hint``/``get_rdma_buffer_size_hint``,
            :meth:`get_low_latency_rdma_size_hint`). A normal-mode shape whose native buffer
            needs more than ``num_nvl_bytes + num_rdma_bytes``, or a low-latency shape needing
            more than ``num_rdma_bytes``, is refused naming the argument and both sizes; 0 (both)
            sets no limit. Each shape in use has its own native buffer.
        low_latency_mode: must be True for the ``low_latency_*`` calls (as in DeepEP).
        num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl, use_fabric, comm:
            accepted and validated; they tune DeepEP's NVSHMEM/IBGDA transport, which fabric-ep
            does not have (libfabric endpoints; CUDA IPC inside a node).
        enable_shrink: DeepEP's elastic low-latency mode: a rank that stalls for
            ``timeout_s`` (or that the bootstrap saw leave) is masked instead of failing the
            call; masked ranks get no low-latency writes and are not waited for
            (:meth:`low_latency_update_mask_buffer`, :meth:`low_latency_query_mask_buffer`,
            :meth:`low_latency_clean_mask_buffer`); ``clean_low_latency_buffer`` runs among the
            unmasked ranks. With CUDA tensors (the GPU backend) every rank must be on one node,
            and a rank cannot mask itself.
        explicitly_destroy: when True, :meth:`destroy` must be called; otherwise the native
            buffers are also freed by ``__del__`` (a collective: every rank must drop its Buffer).

    fabric-ep keywords (optional):
        num_experts, hidden, num_topk, dispatch_dtype, num_max_dispatch_tokens_per_rank: a
            model shape to build now (its first call then has nothing to create); calls of
            other shapes still work.
        backend: ``"auto"`` (by the tensors), ``"host"`` or ``"gpu"``.
        provider, timeout_s, ranks_per_node, gpu_reserve_tokens, internode_hierarchy: as the
            native config (``fep_config``) documents.
    """

    num_sms: int = DEFAULT_NUM_SMS

    def __init__(
        self,
        group: Any = None,
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
        num_qps_per_rank: int = 24,
        allow_nvlink_for_low_latency_mode: bool = True,
        allow_mnnvl: bool = False,
        use_fabric: bool = False,
        explicitly_destroy: bool = False,
        enable_shrink: bool = False,
        comm: Any = None,
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
    ) -> None:
        self._live_flag = False  # set last: __del__ must see a consistent object
        self._engines: Dict[Tuple[Any, ...], _Engine] = {}
        self._order: List[_Engine] = []
        self._boot: Optional[_Boot] = None
        for n, v in (("num_nvl_bytes", num_nvl_bytes), ("num_rdma_bytes", num_rdma_bytes)):
            _int_arg(n, v, 0, 2**63 - 1)
        _int_arg("num_qps_per_rank", num_qps_per_rank, 1)
        for n, v in (("low_latency_mode", low_latency_mode),
                     ("allow_nvlink_for_low_latency_mode", allow_nvlink_for_low_latency_mode),
                     ("allow_mnnvl", allow_mnnvl), ("use_fabric", use_fabric),
                     ("explicitly_destroy", explicitly_destroy), ("enable_shrink", enable_shrink),
                     ("internode_hierarchy", internode_hierarchy)):
            if not isinstance(v, (bool, np.bool_)):
                raise TypeError(f"{n}: {v!r} must be a bool")
        if comm is not None and group is not None:
            raise ValueError("comm: pass either group or comm (an mpi4py communicator), not both")
        if comm is not None:
            group = _MpiGroup(comm)
        if backend not in ("auto", "host", "gpu"):
            raise ValueError(f"backend: {backend!r}, expected 'auto', 'host' or 'gpu'")
        if dispatch_dtype not in _DTYPES:
            raise ValueError(f"dispatch_dtype: {dispatch_dtype!r}, expected 'bf16' or 'fp8'")
        if config is not None and not isinstance(config, Config):
            raise TypeError(f"config: expected a fabric_ep.Config, got {type(config).__name__}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) \
                or not math.isfinite(timeout_s) or timeout_s < 0:
            raise ValueError(f"timeout_s: {timeout_s!r} must be a finite number >= 0")
        _int_arg("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank, 0)
        _int_arg("gpu_reserve_tokens", gpu_reserve_tokens, 0)
        _check_provider(provider)
        if group is not None and not (callable(getattr(group, "rank", None))
                                      and callable(getattr(group, "size", None))):
            raise TypeError(f"group: {type(group).__name__} is not a process group (it needs "
                            "rank() and size(); torch.distributed groups, ThreadGroup, or None)")
        self.group = group
        self.num_nvl_bytes = int(num_nvl_bytes)
        self.num_rdma_bytes = int(num_rdma_bytes)
        self.low_latency_mode = bool(low_latency_mode)
        self.num_qps_per_rank = int(num_qps_per_rank)
        self.allow_nvlink_for_low_latency_mode = bool(allow_nvlink_for_low_latency_mode)
        self.allow_mnnvl = bool(allow_mnnvl)
        self.use_fabric = bool(use_fabric)
        self.explicitly_destroy = bool(explicitly_destroy)
        self.enable_shrink = bool(enable_shrink)
        self.internode_hierarchy = bool(internode_hierarchy)
        self._backend = backend
        self._auto = backend == "auto"
        self._by_id: Dict[int, _Engine] = {}
        # Shrink mode: the ranks masked (by the caller, or as every low-latency native buffer
        # found them), given to each one made later.
        self._mask: List[int] = []
        self._opts = dict(provider=provider, timeout_s=float(timeout_s),
                          gpu_reserve_tokens=gpu_reserve_tokens,
                          internode_hierarchy=bool(internode_hierarchy), config=config)
        for n, v in (("num_experts", num_experts), ("hidden", hidden), ("num_topk", num_topk)):
            if v is not None:
                _int_arg(n, v, 1)
        self._boot = _Boot(group, float(timeout_s))
        try:
            self._setup(ranks_per_node, backend, num_experts, hidden, num_topk, dispatch_dtype,
                        num_max_dispatch_tokens_per_rank)
        except BaseException:
            self._live_flag = False
            for e in self._order:
                e._ptr and e.destroy()
            self._boot.close()
            raise

    def _setup(self, ranks_per_node: Optional[int], backend: str, num_experts: Optional[int],
               hidden: Optional[int], num_topk: Optional[int], dispatch_dtype: str,
               num_max_dispatch_tokens_per_rank: int) -> None:
        self.rank = self._boot.rank
        self.group_size = self.num_ranks = self._boot.size
        if ranks_per_node is None:
            ranks_per_node = self._boot.local_size or _env_int("LOCAL_WORLD_SIZE") \
                or _default_ranks_per_node(self.num_ranks)
        _int_arg("ranks_per_node", ranks_per_node, 1)
        if self.num_ranks % ranks_per_node:
            raise ValueError(f"ranks_per_node: {ranks_per_node} does not divide the "
                             f"{self.num_ranks} ranks")
        self.ranks_per_node = int(ranks_per_node)
        self._num_nodes = self.num_ranks // self.ranks_per_node
        self._mask = [0] * self.num_ranks
        self._comm: Any = None  # the shared communication stream (GPU), made on first need
        self._comm_ptr = 0
        self._last_experts: Optional[int] = None
        self._live_flag = True
        shape = (num_experts, hidden, num_topk)
        if any(v is not None for v in shape):
            if any(v is None for v in shape):
                raise TypeError("num_experts, hidden and num_topk: give all three or none")
            b = backend
            if b == "auto":
                b = "gpu" if _torch_cuda() else "host"
            m = num_max_dispatch_tokens_per_rank or 128
            self._last_experts = num_experts
            self._make(("n", b, num_experts, hidden, num_topk, dispatch_dtype == "fp8"),
                       m if self.low_latency_mode else 0)
            if self.low_latency_mode and b == "gpu":
                self._make(("l", b, num_experts, hidden, num_topk, m,
                            dispatch_dtype == "fp8"), m)
            elif self.low_latency_mode:
                # The host backend's normal engine carries low latency too (cast per call).
                self._engines[("l", b, num_experts, hidden, num_topk, m, None)] = self._order[0]

    # ---------------------------------------------------------------- engines

    def _make(self, key: Tuple[Any, ...], max_tokens: int) -> _Engine:
        """The native buffer of ``key`` (created collectively on first use)."""
        e = self._engines.get(key)
        if e is not None:
            return e
        if not self._live_flag:
            raise RuntimeError("Buffer: already destroyed")
        kind, backend, experts, hidden, topk = key[:5]
        fp8 = key[-1]
        _int_arg("num_experts", experts, 1)
        if experts % self.num_ranks:
            raise ValueError(f"num_experts: {experts} is not a multiple of the {self.num_ranks} "
                             "ranks")
        _int_arg("hidden", hidden, 1)
        _int_arg("num_topk", topk, 1)
        if kind == "l":
            _int_arg("num_max_dispatch_tokens_per_rank", max_tokens, 1)
        self._check_capacity(kind, backend, experts, hidden, topk, max_tokens, bool(fp8))
        modes = FEP_MODE_NORMAL if kind == "n" else FEP_MODE_LOW_LATENCY
        comm = self._comm_ptr
        if backend == "gpu" and not comm and self._comm is not None:
            comm = self._comm.cuda_stream
        o = self._opts
        e = _Engine(
            self.group, self.num_nvl_bytes, self.num_rdma_bytes, kind == "l" or self.low_latency_mode,
            self.num_qps_per_rank, self.allow_nvlink_for_low_latency_mode, True,
            num_experts=experts, hidden=hidden, num_topk=topk,
            dispatch_dtype="fp8" if fp8 else "bf16",
            num_max_dispatch_tokens_per_rank=max_tokens,
            config=o["config"] if kind == "n" else None, backend=backend,
            provider=o["provider"], timeout_s=o["timeout_s"], ranks_per_node=self.ranks_per_node,
            gpu_reserve_tokens=o["gpu_reserve_tokens"] if kind == "n" else 0,
            internode_hierarchy=o["internode_hierarchy"] if kind == "n" else False,
            _boot=self._boot, _modes=modes, _comm_ptr=comm,
            _shrink=self.enable_shrink,
        )
        if e._shrink:
            for rank, m in enumerate(self._mask):
                if m:
                    core.ll_update_mask(e._ptr, rank, True)
        if e._g is not None and not self._comm_ptr:
            self._comm_ptr = e._g.comm_ptr
            if self._comm is None:
                self._comm = e._g.comm
        self._engines[key] = e
        self._order.append(e)
        self._by_id[id(e)] = e
        return e

    def _check_capacity(self, kind: str, backend: str, experts: int, hidden: int, topk: int,
                        max_tokens: int, fp8: bool) -> None:
        if kind == "n":
            cap = self.num_nvl_bytes + self.num_rdma_bytes
            if not cap:
                return
            # The chunking the native buffer will get: the caller's Config, else the backend's
            # default (the GPU's own; the host's from the default Config).
            cfg = self._opts["config"]
            if cfg is not None:
                chunking = cfg.fabric_chunking()[1:]
            elif backend == "gpu":
                chunking = gpu_chunking(self.num_ranks)
            else:
                chunking = Buffer.get_dispatch_config(self.num_ranks).fabric_chunking()[1:]
            need = normal_buffer_bytes(self.num_ranks, hidden, experts, topk, fp8, chunking)
            names = "num_nvl_bytes + num_rdma_bytes"
        else:
            cap = self.num_rdma_bytes
            if not cap:
                return
            need = _need_bytes(self.num_ranks, experts, hidden, topk, max_tokens, fp8)["ll_bytes"]
            names = "num_rdma_bytes"
        if need > cap:
            what = (f"normal mode, hidden {hidden}, top-{topk} of {experts} experts" if kind == "n"
                    else f"low latency, {max_tokens} tokens per rank, hidden {hidden}, "
                         f"top-{topk} of {experts} experts")
            raise ValueError(
                f"{names}: {cap} bytes, but this call's shape ({what}, {self.num_ranks} ranks) "
                f"needs {need}; size the Buffer with "
                + ("Config.get_nvl_buffer_size_hint / get_rdma_buffer_size_hint" if kind == "n"
                   else "Buffer.get_low_latency_rdma_size_hint")
            )

    def _backend_for(self, a: Any) -> str:
        b = self._backend
        return _backend_of(a) if b == "auto" else b

    def _by_handle(self, handle: Any, cls: type) -> _Engine:
        if type(handle) is not cls:
            raise TypeError(f"handle: expected a fabric_ep {cls.__name__}, got "
                            f"{type(handle).__name__}")
        e = self._by_id.get(handle._buffer_id)
        if e is None:
            raise ValueError("handle: made by another Buffer (or after destroy)")
        return e

    def _live(self) -> None:
        if not self._live_flag:
            raise RuntimeError("Buffer: already destroyed")

    def __getattr__(self, name: str) -> Any:
        # The first native buffer's attributes (num_experts, hidden, ...) for callers of the
        # keyword form, which builds exactly one normal-mode shape.
        if name.startswith("__"):
            raise AttributeError(name)
        order = self.__dict__.get("_order")
        if order:
            return getattr(order[0], name)
        raise AttributeError(f"Buffer has no attribute {name!r} (no native buffer yet)")

    # ---------------------------------------------------------------- lifetime

    def destroy(self) -> None:
        """Frees every native buffer (creation order; each a bounded barrier with the other
        ranks) and leaves the bootstrap. Collective: every rank calls it. Later calls raise."""
        if not self._live_flag:
            raise RuntimeError("Buffer.destroy: already destroyed")
        self._live_flag = False
        err: Optional[BaseException] = None
        for e in self._order:
            try:
                if e._ptr:
                    e.destroy()
            except BaseException as x:  # noqa: BLE001 - the others are still freed
                err = err or x
        self._order, self._engines, self._by_id = [], {}, {}
        if self._boot is not None:
            self._boot.close()
        if err is not None:
            raise err

    def __del__(self) -> None:
        if getattr(self, "_live_flag", False) and not getattr(self, "explicitly_destroy", True):
            try:
                self.destroy()
            except Exception:  # noqa: BLE001 - interpreter shutdown; nothing to report to
                pass
        elif not getattr(self, "_live_flag", False) and getattr(self, "_boot", None) is not None:
            self._boot.close()

    def __enter__(self) -> "Buffer":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._live_flag:
            self.destroy()

    # ---------------------------------------------------------------- static helpers

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Sets the SM budget the default configs carry (DeepEP's ``Buffer.set_num_sms``:
        even)."""
        _int_arg("new_num_sms", new_num_sms, 1)
        if new_num_sms % 2:
            raise ValueError(f"new_num_sms: {new_num_sms} must be even (as in DeepEP)")
        Buffer.num_sms = int(new_num_sms)

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """fabric-ep's normal-mode config for ``num_ranks`` ranks: 64-token chunks, 4 slots per
        peer, ``Buffer.num_sms`` SMs (the same for every ``num_ranks`` and for combine)."""
        _int_arg("num_ranks", num_ranks, 1)
        return Config(Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """Same as :meth:`get_dispatch_config`: dispatch and combine share chunking."""
        return Buffer.get_dispatch_config(num_ranks)

    @staticmethod
    def get_low_latency_rdma_size_hint(
        num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int
    ) -> int:
        """Bytes of fabric-ep's low-latency buffer per rank for this shape (both alternating
        sets; bf16 and fp8 both fit)."""
        _int_arg("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank, 1)
        _int_arg("hidden", hidden, 1)
        _int_arg("num_ranks", num_ranks, 1)
        _int_arg("num_experts", num_experts, 1)
        return max(
            _need_bytes(num_ranks, num_experts, hidden, min(num_experts, 9),
                        num_max_dispatch_tokens_per_rank, fp8)["ll_bytes"] for fp8 in (False, True))

    @staticmethod
    def capture() -> EventOverlap:
        """An event recorded on the current CUDA stream (DeepEP's ``Buffer.capture``)."""
        import torch

        e = torch.cuda.Event()
        e.record()
        return EventOverlap(e)

    @staticmethod
    def is_sm90_compiled() -> bool:
        """True: the kernels are built for sm_90 (Hopper)."""
        return True

    def get_comm_stream(self) -> Any:
        """The communication stream (a ``torch.cuda.Stream``) every GPU call of this Buffer runs
        on; None on a machine without CUDA. It stays valid after :meth:`destroy`."""
        self._live()
        return self._comm_stream()

    def _comm_stream(self) -> Any:
        if self._comm is None and _torch_cuda():
            import torch

            # High priority, as the library's own communication streams (src/cuda/stream.rs).
            self._comm = torch.cuda.Stream(priority=-1)
        return self._comm

    def sync(self) -> None:
        """fabric-ep extension: waits (bounded) until every native buffer's communication work has
        run and raises :class:`FabricEPError` for any error its kernels recorded."""
        self._live()
        for e in self._order:
            e.sync()

    def get_local_buffer_tensor(self, dtype: Any, size: Any = None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> Any:
        """DeepEP's ``get_local_buffer_tensor``: a view of this rank's own registered
        communication memory as a 1-D tensor of ``dtype`` (or ``size``'s shape): with
        ``use_rdma_buffer`` the low-latency buffer of the first low-latency shape used (both
        sets' send staging and receive areas), else the normal-mode receive region of the first
        normal-mode shape (peers' chunks land there; on the GPU followed by the protocol's
        flags and counters). It spans the region fabric-ep registered for that shape (sized by
        the shape, at most ``num_nvl_bytes + num_rdma_bytes`` / ``num_rdma_bytes``), from byte
        ``offset`` (as DeepEP applies it: bytes, here a multiple of the element size) to its
        end. Dispatch and combine of that mode overwrite it (as in DeepEP); it is valid until
        :meth:`destroy`. Host backend: a numpy array for a numpy dtype, a torch CPU tensor for a
        torch dtype; GPU backend: a torch CUDA tensor over device memory."""
        self._live()
        use_rdma_buffer = _bool_arg("use_rdma_buffer", use_rdma_buffer)
        kind = "l" if use_rdma_buffer else "n"
        e = next((e for k, e in self._engines.items() if k[0] == kind), None)
        if e is None:
            what = "low-latency" if use_rdma_buffer else "normal-mode"
            raise RuntimeError(
                f"get_local_buffer_tensor: no {what} native buffer yet (fabric-ep creates one "
                "on a shape's first call, or at construction with num_experts, hidden and "
                "num_topk)"
            )
        return e.get_local_buffer_tensor(dtype, size, offset, use_rdma_buffer)

    # ---------------------------------------------------------------- normal mode

    def get_dispatch_layout(
        self,
        topk_idx: Any,
        num_experts: int,
        previous_event: Optional[EventOverlap] = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> Tuple[Any, Optional[Any], Any, Any, EventOverlap]:
        """Counts for a dispatch (DeepEP V1): ``num_tokens_per_rank [R]`` int32,
        ``num_tokens_per_rdma_rank [R / ranks_per_node]`` int32 (None on one node),
        ``num_tokens_per_expert [E]`` int32, ``is_token_in_rank [T, R]`` bool, event."""
        self._live()
        _int_arg("num_experts", num_experts, 1)
        if num_experts % self.num_ranks:
            raise ValueError(f"num_experts: {num_experts} is not a multiple of the "
                             f"{self.num_ranks} ranks")
        self._last_experts = num_experts
        backend = self._backend_for(topk_idx)
        for e in self._order:
            if e.num_experts == num_experts and e.backend == backend \
                    and (e._g is not None) == (backend == "gpu"):
                return e.get_dispatch_layout(topk_idx, num_experts, previous_event, async_finish,
                                             allocate_on_comm_stream)
        if backend == "gpu":
            from ._gpu import layout_gpu

            return layout_gpu(self, topk_idx, num_experts, previous_event, async_finish,
                              allocate_on_comm_stream)
        from .buffer import layout_host

        return layout_host(self.num_ranks, self.ranks_per_node, topk_idx, num_experts,
                           previous_event, async_finish, allocate_on_comm_stream)

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
    ) -> Tuple[Any, Optional[Any], Optional[Any], Optional[List[int]], Optional[DispatchHandle],
               EventOverlap]:
        """Normal-mode dispatch (DeepEP V1): each token to every rank holding one of its experts.

        ``x``: ``[T, H]`` bf16, or ``(x, x_scales)`` with fp8 e4m3 ``[T, H]`` and float32
        ``[T, H / 128]``. ``handle``: a previous dispatch's (cached mode: ``topk_idx`` /
        ``topk_weights`` None). The layout tensors are :meth:`get_dispatch_layout`'s.
        ``num_worst_tokens > 0``: outputs of exactly that many rows, no host synchronisation.
        ``config``: any :class:`Config` (a tuning hint; fabric-ep's chunking is its own).
        Returns ``recv_x``, ``recv_topk_idx`` (local ids, -1 elsewhere), ``recv_topk_weights``,
        ``num_recv_tokens_per_expert_list``, the handle and an :class:`EventOverlap` (cached
        mode: ``recv_x`` and the event, the rest None)."""
        if config is not None and not isinstance(config, Config):
            raise TypeError(f"config: expected a fabric_ep.Config, got {type(config).__name__}")
        if handle is not None:
            e = self._by_handle(handle, DispatchHandle)
        else:
            # NOTES: the common case in one lookup (a torch tensor's shape and device read once
            # each); anything unusual (numpy, a missing argument, a new shape, a destroyed
            # Buffer) takes the checked path below.
            fp8 = type(x) is tuple
            try:
                x0 = x[0] if fp8 else x
                key = ("n", _BACKENDS[x0.is_cuda] if self._auto else self._backend,
                       self._last_experts if num_tokens_per_expert is None
                       else num_tokens_per_expert.shape[0], x0.shape[1], topk_idx.shape[1], fp8)
                e = self._engines[key]
            except (AttributeError, IndexError, KeyError, TypeError):
                e = self._normal_engine(x, topk_idx, num_tokens_per_expert)
        return e.dispatch(x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank,
                          is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights,
                          expert_alignment, num_worst_tokens, None, previous_event, async_finish,
                          allocate_on_comm_stream)

    def _normal_engine(self, x: Any, topk_idx: Any, num_tokens_per_expert: Any) -> _Engine:
        """The checked path of :meth:`dispatch`'s engine choice (creates it on first use)."""
        if not self._live_flag:
            raise RuntimeError("Buffer: already destroyed")
        fp8 = type(x) is tuple
        if fp8 and len(x) != 2:
            raise ValueError(f"x: a tuple must be (x, x_scales), got {len(x)} elements")
        x0 = x[0] if fp8 else x
        if topk_idx is None:
            raise ValueError("topk_idx: required unless a cached handle is given")
        if num_tokens_per_expert is not None:
            experts = _width_1d("num_tokens_per_expert", num_tokens_per_expert)
        elif self._last_experts is not None:
            experts = self._last_experts
        else:
            raise ValueError("num_tokens_per_expert: required (get_dispatch_layout's) to "
                             "know the number of experts")
        key = ("n", self._backend_for(x0), experts, _width("x", x0),
               _width("topk_idx", topk_idx), fp8)
        return self._engines.get(key) or self._make(key, 0)

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
        """Normal-mode combine (DeepEP V1): each token's rows back to its source rank, summed
        (fp32 accumulation, one rounding). ``bias``: None, a ``[T, H]`` bf16 tensor or a pair
        of them, added to the sum (in fp32, after the sum has been rounded to bf16).
        Returns ``combined_x [T, H]``, ``combined_topk_weights`` (or None) and the event."""
        if config is not None and not isinstance(config, Config):
            raise TypeError(f"config: expected a fabric_ep.Config, got {type(config).__name__}")
        e = self._by_handle(handle, DispatchHandle)
        biases = _biases(bias, handle.num_tokens, e.hidden)
        out, w, ev = e.combine(x, handle, topk_weights, None, None, previous_event, async_finish,
                               allocate_on_comm_stream)
        if biases:
            out, ev = _add_bias(e, out, biases, ev, async_finish)
        return out, w, ev

    # ---------------------------------------------------------------- low-latency mode

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
    ) -> Tuple[Any, Any, LowLatencyHandle, EventOverlap, Optional[Callable[[], None]]]:
        """Low-latency dispatch (DeepEP V1). ``x [T <= num_max_dispatch_tokens_per_rank, H]``
        bf16, ``topk_idx [T, K]`` int64. Returns ``recv_x [L, R * M, H]`` (with ``use_fp8`` a
        tuple with float32 scales ``[L, R * M, H / 128]``), ``recv_count [L]`` int32, the handle,
        the event and the hook (with ``return_recv_hook``)."""
        m = num_max_dispatch_tokens_per_rank
        # NOTES (per-call cost): Python bools pass one chained test; anything else takes the
        # loop that names the argument (or accepts a numpy bool).
        if not (use_fp8.__class__ is round_scale.__class__ is use_ue8m0.__class__
                is async_finish.__class__ is return_recv_hook.__class__ is bool):
            for n, v in (("use_fp8", use_fp8), ("round_scale", round_scale),
                         ("use_ue8m0", use_ue8m0), ("async_finish", async_finish),
                         ("return_recv_hook", return_recv_hook)):
                _bool_arg(n, v)
        if round_scale and not use_fp8:
            raise ValueError("round_scale=True: needs use_fp8=True (bf16 rows have no scales)")
        try:  # the common case in one lookup, as dispatch's
            gpu = x.is_cuda if self._auto else self._backend == "gpu"
            key = ("l", _BACKENDS[gpu], num_experts, x.shape[1], topk_idx.shape[1], m,
                   bool(use_fp8) if gpu else None)
            e = self._engines[key]
        except (AttributeError, IndexError, KeyError, TypeError):
            key = self._ll_key(x, topk_idx, m, num_experts, use_fp8)
            e = None
        if use_ue8m0 and not (use_fp8 and round_scale):
            raise ValueError("use_ue8m0=True: needs use_fp8=True and round_scale=True (as in "
                             "DeepEP: UE8M0 scales are the rounded scales' exponents)")
        if use_ue8m0 and key[3] % 512:
            raise ValueError(f"use_ue8m0=True: hidden {key[3]} must be a multiple of 512 (four "
                             "UE8M0 scales per int32)")
        e = e or self._engines.get(key) or self._make(key, m)
        if self.enable_shrink and len(self._engines) > 1:
            self._sync_mask()
        out = e.low_latency_dispatch(x, topk_idx, m, num_experts,
                                     cumulative_local_expert_recv_stats,
                                     dispatch_wait_recv_cost_stats, use_fp8, round_scale,
                                     False, async_finish, return_recv_hook)
        return _ue8m0(e, out, async_finish) if use_ue8m0 else out

    def _ll_key(self, x: Any, topk_idx: Any, m: Any, num_experts: Any,
                use_fp8: bool) -> Tuple[Any, ...]:
        """The checked path of :meth:`low_latency_dispatch`'s engine choice."""
        if not self.low_latency_mode:
            raise ValueError(
                "low_latency_dispatch: this Buffer was built with low_latency_mode=False (as in "
                "DeepEP, the low-latency calls need Buffer(..., low_latency_mode=True))"
            )
        self._live()
        m = _int_arg("num_max_dispatch_tokens_per_rank", m, 1)
        backend = self._backend_for(x)
        return ("l", backend, num_experts, _width("x", x), _width("topk_idx", topk_idx), m,
                bool(use_fp8) if backend == "gpu" else None)

    def low_latency_combine(
        self,
        x: Any,
        topk_idx: Any,
        topk_weights: Any,
        handle: LowLatencyHandle,
        use_logfmt: bool = False,
        zero_copy: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        out: Optional[Any] = None,
        combine_wait_recv_cost_stats: Optional[Any] = None,
    ) -> Tuple[Any, EventOverlap, Optional[Callable[[], None]]]:
        """Low-latency combine (DeepEP V1): ``x [L, R * M, H]`` bf16 expert outputs (with
        ``zero_copy``: the tensor :meth:`get_next_low_latency_combine_buffer` returned, already
        written), ``topk_idx``/``topk_weights [T, K]``. Returns ``combined_x [T, H]``, the event
        and the hook."""
        if not (use_logfmt.__class__ is zero_copy.__class__ is async_finish.__class__
                is return_recv_hook.__class__ is bool):  # as in low_latency_dispatch
            for n, v in (("use_logfmt", use_logfmt), ("zero_copy", zero_copy),
                         ("async_finish", async_finish), ("return_recv_hook", return_recv_hook)):
                _bool_arg(n, v)
        e = self._by_handle(handle, LowLatencyHandle)
        if zero_copy:
            zc = handle._zero_copy
            if zc is None:
                raise ValueError(
                    "zero_copy=True: call get_next_low_latency_combine_buffer(handle) first and "
                    "write the expert outputs into the tensor it returns"
                )
            x = zc
        return e.low_latency_combine(x, topk_idx, topk_weights, handle, use_logfmt, False,
                                     async_finish, return_recv_hook, out,
                                     combine_wait_recv_cost_stats)

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> Any:
        """The ``[L, R * M, H]`` bf16 tensor a ``low_latency_combine(..., zero_copy=True)`` with
        this handle reads its expert outputs from (DeepEP's zero-copy form: write into it, then
        combine). fabric-ep's combine sends from it directly; it is this handle's own tensor."""
        e = self._by_handle(handle, LowLatencyHandle)
        zc = handle._zero_copy
        if zc is None:
            shape = (e.num_local_experts, e.num_ranks * e.num_max_dispatch_tokens_per_rank,
                     e.hidden)
            if e._g is not None:
                zc = e._g.torch.empty(shape, dtype=e._g.torch.bfloat16,
                                      device=e._g.torch.device("cuda", e._g.dev))
            else:
                from ._arrays import empty_like_kind

                zc = empty_like_kind(handle.src_rank, shape, _ext.FEP_DTYPE_BF16)
            handle._zero_copy = zc
        return zc

    # ---------------------------------------------------------------- shrink mode

    def _ll_engines(self) -> List[_Engine]:
        seen: Dict[int, _Engine] = {}
        for k, e in self._engines.items():
            if k[0] == "l" and e._ptr:
                seen.setdefault(id(e), e)
        return list(seen.values())

    def _shrink_only(self, call: str) -> None:
        self._live()
        if not self.enable_shrink:
            raise ValueError(f"{call}: needs Buffer(..., enable_shrink=True) (as in DeepEP)")

    def _sync_mask(self) -> List[int]:
        """The union of every low-latency native buffer's mask (each masks the ranks it found
        stalled), given back to each."""
        engines = self._ll_engines()
        for e in engines:
            for rank, m in enumerate(core.ll_query_mask(e._ptr, self.num_ranks)):
                self._mask[rank] |= m
        if len(engines) > 1:
            for e in engines:
                have = core.ll_query_mask(e._ptr, self.num_ranks)
                for rank, m in enumerate(self._mask):
                    if m and not have[rank]:
                        core.ll_update_mask(e._ptr, rank, True)
        return self._mask

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """DeepEP's ``low_latency_update_mask_buffer`` (``enable_shrink``; this rank only):
        ``mask=True`` masks ``rank_to_mask`` (this rank's low-latency calls stop writing to it
        and waiting for it; its experts count as ``-1`` in combine), False unmasks it; an
        unmasked rank needs ``clean_low_latency_buffer`` (on every unmasked rank, it included)
        before the next low-latency call, which is refused until then."""
        self._shrink_only("low_latency_update_mask_buffer")
        rank = _int_arg("rank_to_mask", rank_to_mask, 0, self.num_ranks - 1)
        mask = _bool_arg("mask", mask)
        self._sync_mask()
        self._mask[rank] = int(mask)
        for e in self._ll_engines():
            core.ll_update_mask(e._ptr, rank, mask)

    def low_latency_query_mask_buffer(self, mask_status: Any) -> None:
        """DeepEP's ``low_latency_query_mask_buffer``: writes ``mask_status`` (``[R]`` int32:
        numpy, or a torch tensor on any device) with 1 for each rank this rank has masked
        (by :meth:`low_latency_update_mask_buffer` or because it stalled), else 0."""
        self._shrink_only("low_latency_query_mask_buffer")
        shape = tuple(getattr(mask_status, "shape", ()) or ())
        if not hasattr(mask_status, "shape"):
            raise TypeError(f"mask_status: expected a numpy.ndarray or a torch.Tensor, got "
                            f"{type(mask_status).__name__}")
        if shape != (self.num_ranks,):
            raise ValueError(f"mask_status: shape {list(shape)}, expected [{self.num_ranks}]")
        m = self._sync_mask()
        if type(mask_status) is np.ndarray:
            if mask_status.dtype != np.int32:
                raise TypeError(f"mask_status: dtype {mask_status.dtype}, expected int32")
            mask_status[...] = np.asarray(m, np.int32)
            return
        torch = sys.modules["torch"]
        if mask_status.dtype != torch.int32:
            raise TypeError(f"mask_status: dtype {mask_status.dtype}, expected torch.int32")
        mask_status.copy_(torch.tensor(m, dtype=torch.int32))

    def low_latency_clean_mask_buffer(self) -> None:
        """DeepEP's ``low_latency_clean_mask_buffer``: unmasks every rank (then
        ``clean_low_latency_buffer`` before the next low-latency call, as for one)."""
        self._shrink_only("low_latency_clean_mask_buffer")
        self._mask = [0] * self.num_ranks
        for e in self._ll_engines():
            core.ll_clean_mask(e._ptr)

    def clean_low_latency_buffer(
        self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int
    ) -> None:
        """Makes the low-latency buffers of this shape usable again (after a failed or
        abandoned step). Collective (with ``enable_shrink``: among the ranks not masked; one
        that does not take part in time is masked). Their earlier handles and hooks become
        invalid."""
        self._live()
        _int_arg("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank, 1)
        _int_arg("hidden", hidden, 1)
        _int_arg("num_experts", num_experts, 1)
        for key, e in list(self._engines.items()):
            if key[0] == "l" and key[2] == num_experts and key[3] == hidden \
                    and key[5] == num_max_dispatch_tokens_per_rank:
                e.clean_low_latency_buffer(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    def size_hints(self) -> "dict[str, int]":
        """fabric-ep extension: the per-rank bytes of the first native buffer's configuration."""
        if not self._order:
            raise RuntimeError("size_hints: no native buffer yet (no call made)")
        return self._order[0].size_hints()


def _width_1d(name: str, a: Any) -> int:
    shape = getattr(a, "shape", None)
    if shape is None or len(shape) != 1:
        raise ValueError(f"{name}: expected a 1-D array or tensor, got shape "
                         f"{None if shape is None else list(shape)}")
    return int(shape[0])


def _need_bytes(num_ranks: int, experts: int, hidden: int, topk: int, max_tokens: int,
                fp8: bool) -> Any:
    cfg = dict(rank=0, num_ranks=num_ranks, ranks_per_node=1, local_rank=0, num_experts=experts,
               hidden=hidden, num_topk=topk, max_tokens_per_rank=max_tokens,
               dispatch_dtype=_ext.FEP_DTYPE_FP8_E4M3 if fp8 else _ext.FEP_DTYPE_BF16,
               provider="shm")
    return _ext.size_hints(cfg)


def _torch_cuda() -> bool:
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001 - a broken CUDA install: no GPU path
        return False


def _biases(bias: Any, t: int, hidden: int) -> Tuple[Any, ...]:
    if bias is None:
        return ()
    parts = bias if isinstance(bias, tuple) else (bias,)
    if len(parts) > 2:
        raise ValueError(f"bias: a tensor or a pair of tensors, got {len(parts)}")
    for i, b in enumerate(parts):
        if b is None:
            continue
        shape = tuple(getattr(b, "shape", ()))
        if shape != (t, hidden):
            raise ValueError(f"bias[{i}]: shape {list(shape)}, expected [{t}, {hidden}]")
    return tuple(b for b in parts if b is not None)


def _add_bias(e: _Engine, out: Any, biases: Tuple[Any, ...], ev: EventOverlap,
              async_finish: bool) -> Tuple[Any, EventOverlap]:
    """``out + sum(biases)`` in fp32, rounded once to bf16, in place; on the communication stream
    after the combine when it is asynchronous (then a new event), else on the current stream."""
    g = e._g
    if g is None:
        from ._arrays import add_bf16_inplace

        add_bf16_inplace(out, biases)
        return out, ev
    torch = g.torch
    stream = g.comm if async_finish else torch.cuda.current_stream()
    with torch.cuda.stream(stream):
        acc = out.float()
        for b in biases:
            if b.dtype != torch.bfloat16 or b.device != out.device:
                raise ValueError(f"bias: dtype {b.dtype} on {b.device}, expected bfloat16 on "
                                 f"{out.device}")
            acc += b.float()
        out.copy_(acc)
    if not async_finish:
        return out, ev
    for b in biases:
        b.record_stream(stream)
    ne = torch.cuda.Event()
    ne.record(stream)
    return out, EventOverlap(ne)


def _ue8m0(e: _Engine, out: Tuple[Any, ...], async_finish: bool) -> Tuple[Any, ...]:
    """DeepEP's ``use_ue8m0`` form of a low-latency dispatch's result: the power-of-two float32
    scales ``[L, S, H / 128]`` as their exponent bytes (UE8M0), four per int32:
    ``[L, S, H / 512]``. Filled once the receive has run: at once, after the hook, or on the
    communication stream before a new event (``async_finish``)."""
    (q, scales), count, handle, ev, hook = out
    shape = tuple(scales.shape[:-1]) + (scales.shape[-1] // 4,)
    if type(scales) is np.ndarray:
        packed = np.empty(shape, np.int32)

        def fill() -> None:
            packed.view(np.uint8).reshape(scales.shape)[...] = \
                (scales.view(np.uint32) >> 23) & 0xFF
    else:
        torch = sys.modules["torch"]
        packed = torch.empty(shape, dtype=torch.int32, device=scales.device)

        def fill() -> None:
            b = ((scales.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
            packed.view(torch.uint8).view(b.shape).copy_(b)

    g = e._g
    if hook is not None:
        def ue8m0_hook() -> None:
            hook()  # the receive, on the current stream (GPU)
            fill()

        return (q, packed), count, handle, ev, ue8m0_hook
    if g is not None and async_finish:
        torch = g.torch
        with torch.cuda.stream(g.comm):
            fill()
        ne = torch.cuda.Event()
        ne.record(g.comm)
        return (q, packed), count, handle, EventOverlap(ne), None
    fill()
    return (q, packed), count, handle, ev, None


class _MpiGroup:
    """DeepEP's ``comm=`` (an mpi4py communicator) as an ``all_gather_bytes`` group."""

    def __init__(self, comm: Any):
        self.comm = comm

    def rank(self) -> int:
        return int(self.comm.Get_rank())

    def size(self) -> int:
        return int(self.comm.Get_size())

    def all_gather_bytes(self, data: bytes) -> List[bytes]:
        return list(self.comm.allgather(bytes(data)))

    def barrier(self) -> None:
        self.comm.Barrier()
