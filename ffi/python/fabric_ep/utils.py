"""``EventOverlap``: DeepEP's event wrapper; ``ThreadGroup``: ranks as threads of one process.

On the host backend every call has finished when it returns, so the calls return
``EventOverlap(None)`` (what DeepEP returns when ``async_finish=False``): waiting on it, or using
it as a context manager, does nothing. On the GPU backend, ``async_finish=True`` returns an
``EventOverlap`` wrapping a ``torch.cuda.Event`` recorded on the buffer's communication stream;
``current_stream_wait`` makes the current stream wait for it.
"""

from __future__ import annotations

import threading
from typing import Any, List, Optional, Tuple


class EventOverlap:
    """An event and the tensors it keeps alive until the event has completed.

    Arguments:
        event: ``None`` (nothing pending: the host backend's calls complete before returning) or
            an event object with a ``wait()`` method (e.g. ``torch.cuda.Event``).
        extra_tensors: tensors to keep referenced while the event is pending.
    """

    __slots__ = ("event", "extra_tensors")

    def __init__(self, event: Optional[Any] = None, extra_tensors: Optional[Tuple[Any, ...]] = None):
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        """Makes the current stream wait for the event (a no-op when ``event`` is None)."""
        if self.event is not None:
            self.event.wait()

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        if self.event is not None:
            self.current_stream_wait()

    def __repr__(self) -> str:
        return "EventOverlap(None)" if self.event is None else f"EventOverlap({self.event!r})"


class _NoEvent(EventOverlap):
    """``EventOverlap(None)`` as the calls return it when nothing is pending: one shared
    instance (a new object per call cost ~0.4 us on the H200 host), read-only so that no
    caller's change can reach another's."""

    __slots__ = ()

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(
            f"{name}: the EventOverlap(None) that fabric_ep returns is shared and read-only"
        )


NO_EVENT: EventOverlap = object.__new__(_NoEvent)
object.__setattr__(NO_EVENT, "event", None)
object.__setattr__(NO_EVENT, "extra_tensors", None)


class ThreadGroup:
    """A group whose ranks are threads of this process (the GPU backend's mode in this version:
    every rank on one GPU). ``ThreadGroup.create(n)`` returns one object per rank; each rank's
    thread passes its own as ``Buffer(group, ...)``. Any object with ``rank()``, ``size()`` and
    ``all_gather_bytes(bytes) -> list[bytes]`` can stand in for a ``torch.distributed`` group the
    same way. Waits are bounded by ``timeout_s`` (a ``TimeoutError`` names the rank).

    Thread mode is for tests; real jobs run one process per GPU. On the GPU backend the ranks'
    streams then share one CUDA context, which maps its streams onto
    ``CUDA_DEVICE_MAX_CONNECTIONS`` hardware work queues (8 by default): when two ranks' streams
    share a queue, one rank's spinning kernel can wait behind another's until the timeout. Set
    ``CUDA_DEVICE_MAX_CONNECTIONS=32`` (and ``CUDA_MODULE_LOADING=EAGER``) in the environment
    before CUDA initialises, i.e. before torch first touches the GPU: the library refuses to
    connect several ranks of one context, with an error naming the variable, when it is too
    low (more than 2 ranks need it). See :mod:`fabric_ep._gpu` for the other rules of thread
    mode (one stream per rank, a warm caching allocator)."""

    class _Shared:
        def __init__(self, n: int, timeout_s: float):
            self.n = n
            self.timeout_s = timeout_s
            self.slots: List[bytes] = [b""] * n
            self.barrier = threading.Barrier(n)

    def __init__(self, shared: "ThreadGroup._Shared", rank: int):
        self._s = shared
        self._rank = rank

    @staticmethod
    def create(num_ranks: int, timeout_s: float = 120.0) -> "List[ThreadGroup]":
        if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks <= 0:
            raise ValueError(f"num_ranks: {num_ranks!r} must be a positive int")
        shared = ThreadGroup._Shared(num_ranks, float(timeout_s))
        return [ThreadGroup(shared, r) for r in range(num_ranks)]

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._s.n

    def _wait(self) -> None:
        try:
            self._s.barrier.wait(self._s.timeout_s)
        except threading.BrokenBarrierError:
            raise TimeoutError(
                f"ThreadGroup: rank {self._rank} waited {self._s.timeout_s} s for the other "
                f"{self._s.n - 1} ranks (a rank failed or never came)"
            ) from None

    def barrier(self) -> None:
        self._wait()

    def all_gather_bytes(self, data: bytes) -> List[bytes]:
        """Every rank's ``data`` in rank order (collective)."""
        self._s.slots[self._rank] = bytes(data)
        self._wait()
        out = list(self._s.slots)
        self._wait()  # nobody overwrites its slot before every rank has read
        return out
