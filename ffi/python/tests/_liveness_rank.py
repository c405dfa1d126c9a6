"""One rank of test_liveness.py: a host-backend Buffer over a process-group stand-in (an object
with ``all_gather_bytes``, here a TCP hub on rank 0 that watches nobody), dispatch + combine in
a loop. Prints ``iter N`` after each step and ``ERROR <message>`` when a call fails."""

import os
import socket
import struct
import sys
import time

import numpy as np

import fabric_ep

WORLD = int(os.environ["WORLD_SIZE"])
H, K, E = 256, 2, 6


def _recv_exact(s, n):
    out = bytearray()
    while len(out) < n:
        b = s.recv(n - len(out))
        if not b:
            raise ConnectionError("hub connection closed")
        out += b
    return bytes(out)


class HubGroup:
    """``all_gather_bytes`` over one TCP connection per rank to rank 0 (equal lengths)."""

    def __init__(self, rank, size, port):
        self._rank, self._size = rank, size
        if rank == 0:
            ls = socket.socket()
            ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            ls.bind(("127.0.0.1", port))
            ls.listen(size)
            conns = {}
            while len(conns) < size - 1:
                c, _ = ls.accept()
                conns[struct.unpack("<Q", _recv_exact(c, 8))[0]] = c
            self._conns = [conns[r] for r in range(1, size)]
        else:
            t = time.monotonic()
            while True:
                try:
                    c = socket.create_connection(("127.0.0.1", port))
                    break
                except OSError:
                    if time.monotonic() - t > 20:
                        raise
                    time.sleep(0.02)
            c.sendall(struct.pack("<Q", rank))
            self._conns = [c]

    def rank(self):
        return self._rank

    def size(self):
        return self._size

    def all_gather_bytes(self, data):
        n = len(data)
        if self._rank == 0:
            parts = [bytes(data)] + [_recv_exact(c, n) for c in self._conns]
            for c in self._conns:
                c.sendall(b"".join(parts))
            return parts
        self._conns[0].sendall(data)
        whole = _recv_exact(self._conns[0], n * self._size)
        return [whole[i * n:(i + 1) * n] for i in range(self._size)]


def main():
    r = int(os.environ["RANK"])
    group = HubGroup(r, WORLD, int(os.environ["FEP_TEST_HUB_PORT"]))
    buf = fabric_ep.Buffer(group, num_experts=E, hidden=H, num_topk=K, provider="tcp;ofi_rxm",
                           timeout_s=4.0, ranks_per_node=1, explicitly_destroy=True)
    t = 32
    x = np.full((t, H), 0x3F80, dtype=np.uint16)
    idx = np.array([[i % E, (i + 1) % E] for i in range(t)], dtype=np.int64)
    w = np.full((t, K), 0.5, dtype=np.float32)
    it = 0
    while True:
        try:
            n_rank, n_rdma, n_exp, in_rank, _ = buf.get_dispatch_layout(idx, E)
            rx, _, rw, _, handle, _ = buf.dispatch(
                x, num_tokens_per_rank=n_rank, num_tokens_per_rdma_rank=n_rdma,
                is_token_in_rank=in_rank, num_tokens_per_expert=n_exp, topk_idx=idx,
                topk_weights=w)
            buf.combine(rx, handle, topk_weights=rw)
        except Exception as e:  # the survivor's error: what the test checks
            print(f"ERROR {e}", flush=True)
            os._exit(2)  # no collective teardown: a peer is gone
        print(f"iter {it}", flush=True)
        it += 1


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stdout.flush()
        sys.exit(1)
