"""``Config``: DeepEP's performance-tuning config, mapped onto fabric-ep's normal-mode chunking.

fabric-ep moves normal-mode tokens in chunks of ``chunk_tokens`` tokens (one RMA write each)
through ``slots_per_peer`` slots per (source, destination) pair, the same for every peer: there
is no separate NVLink and RDMA path with their own chunk sizes. A ``Config`` therefore maps as

* ``num_sms``                            -> ``num_sms`` (the GPU backend's SM budget)
* ``rdma_send_chunk``                    -> ``chunk_tokens``
* ``rdma_recv_chunk // rdma_send_chunk`` -> ``slots_per_peer``

and the NVLink fields must equal the RDMA ones (a ``Config`` where they differ is refused where
it would be used, naming the fields). The config is fixed when the :class:`~fabric_ep.Buffer` is
built (``Buffer(..., config=)``, used by every normal-mode native buffer it creates); a
``config=`` passed to ``dispatch``/``combine`` is accepted as a tuning hint and not used.
"""

from __future__ import annotations

from . import _ext

DEFAULT_NUM_SMS = 20
DEFAULT_CHUNK_TOKENS = 64
DEFAULT_SLOTS_PER_PEER = 4


def _positive(name: str, v: object) -> int:
    # At most 2**31 - 1: the native config's fields are int32 (a larger value would wrap).
    if isinstance(v, bool) or not isinstance(v, int) or not 0 < v < 2**31:
        raise ValueError(f"{name}: {v!r} must be a positive int below 2**31")
    return v


# The size hints' defaults when the caller gives only DeepEP's (hidden_bytes, num_ranks): a
# buffer sized by them takes any shape of that hidden size up to top-16 of 1024 experts.
HINT_TOPK = 16
HINT_EXPERTS = 1024


def gpu_chunking(num_ranks: int) -> "tuple[int, int]":
    """The GPU backend's default normal-mode ``(chunk_tokens, slots_per_peer)`` (the library's
    ``GpuOptions``: 16-token chunks, 32 slots per peer up to 8 ranks, else 16)."""
    return 16, 32 if num_ranks <= 8 else 16


def normal_buffer_bytes(num_ranks: int, hidden: int, num_experts: int, num_topk: int, fp8: bool,
                        chunking: "tuple[int, int]") -> int:
    """Per-rank bytes of a normal-mode native buffer of this shape and ``(chunk_tokens,
    slots_per_peer)`` (the library's size hints)."""
    chunk, slots = chunking
    cfg = dict(rank=0, num_ranks=num_ranks, ranks_per_node=1, local_rank=0, hidden=hidden,
               num_topk=num_topk, num_experts=num_experts,
               dispatch_dtype=_ext.FEP_DTYPE_FP8_E4M3 if fp8 else _ext.FEP_DTYPE_BF16,
               chunk_tokens=chunk, slots_per_peer=slots, provider="shm")
    return int(_ext.size_hints(cfg)["normal_bytes"])


class Config:
    """DeepEP V1's ``Config(num_sms, nvl_send_chunk, nvl_recv_chunk, rdma_send_chunk,
    rdma_recv_chunk)`` (chunk sizes in tokens). Validated here, once."""

    __slots__ = (
        "num_sms",
        "num_max_nvl_chunked_send_tokens",
        "num_max_nvl_chunked_recv_tokens",
        "num_max_rdma_chunked_send_tokens",
        "num_max_rdma_chunked_recv_tokens",
    )

    def __init__(
        self,
        num_sms: int = DEFAULT_NUM_SMS,
        num_max_nvl_chunked_send_tokens: int = DEFAULT_CHUNK_TOKENS,
        num_max_nvl_chunked_recv_tokens: int = DEFAULT_CHUNK_TOKENS * DEFAULT_SLOTS_PER_PEER,
        num_max_rdma_chunked_send_tokens: int = DEFAULT_CHUNK_TOKENS,
        num_max_rdma_chunked_recv_tokens: int = DEFAULT_CHUNK_TOKENS * DEFAULT_SLOTS_PER_PEER,
    ):
        self.num_sms = _positive("num_sms", num_sms)
        self.num_max_nvl_chunked_send_tokens = _positive(
            "num_max_nvl_chunked_send_tokens", num_max_nvl_chunked_send_tokens
        )
        self.num_max_nvl_chunked_recv_tokens = _positive(
            "num_max_nvl_chunked_recv_tokens", num_max_nvl_chunked_recv_tokens
        )
        self.num_max_rdma_chunked_send_tokens = _positive(
            "num_max_rdma_chunked_send_tokens", num_max_rdma_chunked_send_tokens
        )
        self.num_max_rdma_chunked_recv_tokens = _positive(
            "num_max_rdma_chunked_recv_tokens", num_max_rdma_chunked_recv_tokens
        )

    def _key(self):
        return (
            self.num_sms,
            self.num_max_nvl_chunked_send_tokens,
            self.num_max_nvl_chunked_recv_tokens,
            self.num_max_rdma_chunked_send_tokens,
            self.num_max_rdma_chunked_recv_tokens,
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Config) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return "Config(%d, %d, %d, %d, %d)" % self._key()

    def fabric_chunking(self) -> "tuple[int, int, int]":
        """``(num_sms, chunk_tokens, slots_per_peer)`` for fabric-ep; ValueError naming the
        fields when this config has no fabric-ep equivalent."""
        (sms, nvl_s, nvl_r, rdma_s, rdma_r) = self._key()
        if (nvl_s, nvl_r) != (rdma_s, rdma_r):
            raise ValueError(
                f"config: {self!r}: fabric-ep uses one chunking for every peer, so "
                "num_max_nvl_chunked_send_tokens/recv_tokens must equal "
                "num_max_rdma_chunked_send_tokens/recv_tokens (use Buffer.get_dispatch_config)"
            )
        if rdma_r % rdma_s != 0:
            raise ValueError(
                f"config: {self!r}: num_max_rdma_chunked_recv_tokens ({rdma_r}) must be a multiple "
                f"of num_max_rdma_chunked_send_tokens ({rdma_s}): the receive side holds whole "
                "chunks"
            )
        return sms, rdma_s, rdma_r // rdma_s

    def _normal_bytes(self, hidden_bytes: int, num_ranks: int, num_experts, num_topk: int) -> int:
        _positive("hidden_bytes", hidden_bytes)
        _positive("num_ranks", num_ranks)
        if hidden_bytes % 2 != 0:
            raise ValueError(f"hidden_bytes: {hidden_bytes} is not a whole number of bf16 values")
        _positive("num_topk", num_topk)
        if num_experts is None:
            # Generous: the per-expert counts grow the buffer a little with the experts.
            num_experts = num_ranks * max(1, -(-max(num_topk, HINT_EXPERTS) // num_ranks))
        _positive("num_experts", num_experts)
        h = hidden_bytes // 2
        # The larger of this config's chunking (the host backend's) and the GPU backend's own.
        return max(normal_buffer_bytes(num_ranks, h, num_experts, num_topk, False, c)
                   for c in (self.fabric_chunking()[1:], gpu_chunking(num_ranks)))

    def get_nvl_buffer_size_hint(
        self, hidden_bytes: int, num_ranks: int, *, num_experts=None, num_topk: int = HINT_TOPK
    ) -> int:
        """Bytes of fabric-ep's normal-mode buffer per rank when all ``num_ranks`` ranks share a
        node (``num_ranks <= 8``), else 0 (then :meth:`get_rdma_buffer_size_hint` has it).

        :class:`~fabric_ep.Buffer` checks each shape's native buffer against the byte counts it
        was given (``num_nvl_bytes + num_rdma_bytes``). ``hidden_bytes`` is DeepEP's
        ``hidden * 2`` (bf16); ``num_topk`` (default 8) and ``num_experts`` (default: the
        smallest multiple of ``num_ranks`` not below ``num_topk``) change it a little."""
        if num_ranks > 8:
            return 0
        return self._normal_bytes(hidden_bytes, num_ranks, num_experts, num_topk)

    def get_rdma_buffer_size_hint(
        self, hidden_bytes: int, num_ranks: int, *, num_experts=None, num_topk: int = HINT_TOPK
    ) -> int:
        """Bytes of fabric-ep's normal-mode buffer per rank when ``num_ranks > 8`` (several
        nodes), else 0; see :meth:`get_nvl_buffer_size_hint`."""
        if num_ranks <= 8:
            return 0
        return self._normal_bytes(hidden_bytes, num_ranks, num_experts, num_topk)

