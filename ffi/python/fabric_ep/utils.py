"""``EventOverlap``: DeepEP's event wrapper.

On the host backend every call has finished when it returns, so the calls return
``EventOverlap(None)`` (what DeepEP returns when ``async_finish=False``): waiting on it, or using
it as a context manager, does nothing. A ``torch.cuda.Event`` (or anything with ``.wait()``)
can be wrapped too; ``current_stream_wait`` then makes the current stream wait for it.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple


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
