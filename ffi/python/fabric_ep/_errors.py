"""The exceptions a failed ``fep_*`` call raises (``fabric_ep._core`` raises them: the call's
name, the ``fep_status`` code and name, and the library's own message)."""

from __future__ import annotations


class FabricEPError(RuntimeError):
    """A ``fep_*`` call failed. ``call`` names it, ``status`` is the ``fep_status`` code,
    ``status_name`` its name, and the message is the library's own (``fep_last_error``)."""

    def __init__(self, call: str, status: int, status_name: str, message: str):
        self.call = call
        self.status = status
        self.status_name = status_name
        self.message = message
        super().__init__(f"{call}: {status_name} ({status}): {message}")


class FabricEPArgumentError(FabricEPError, ValueError):
    """``FEP_ERR_INVALID_ARGUMENT``: the library refused an argument (the message names it)."""


class FabricEPTimeoutError(FabricEPError, TimeoutError):
    """``FEP_ERR_TIMEOUT``: a bounded wait expired (the message names the rank/phase)."""
