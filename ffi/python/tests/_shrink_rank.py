"""One rank of test_ll_deepep_args.py's shrink-mode process test: ranks as processes over the
torchrun variables; rank 2 dies (os._exit) after one good low-latency step, and the others must
mask it (the store reports it gone) and go on: dispatch, combine and clean without it.
Prints ``rank R: ok`` when every check passed.

NOTES: rank 2 dies between steps, once every other rank has finished the first one (files in
``FEP_TEST_SYNC_DIR``): a write still in flight to a rank that dies may never complete over a
provider that needs the receiver's acknowledgement (tcp;ofi_rxm), which the call reports as a
send timeout (ffi/python/README.md, shrink mode), not what this test is about."""

import os
import sys
import time

import numpy as np

from fabric_ep import Buffer

from _rank import H, L, MAX_LL, bf2f, f2bf, inputs, ll_combine_want, ll_reference

GONE = 2


def main():
    r, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    all_in = [inputs(s, n, salt=18, tokens=[6, 9, 7, 5][:n]) for s in range(n)]
    x, idx, w = all_in[r]
    e_all = L * n
    buf = Buffer(None, 0, 0, True, enable_shrink=True, timeout_s=10.0, explicitly_destroy=True,
                 num_max_dispatch_tokens_per_rank=MAX_LL)

    def step(ins, masked):
        rx, cnt, h, _, _ = buf.low_latency_dispatch(x, idx, MAX_LL, e_all, use_fp8=False)
        assert np.array_equal(rx, ll_reference(r, n, ins)[0]), "dispatch rows differ"
        y = np.zeros(rx.shape, np.uint16)
        for e in range(L):
            y[e] = f2bf(bf2f(rx[e]) * (e + 1))
        cx, _, _ = buf.low_latency_combine(y, idx, w, h)
        want_idx = idx.copy()
        for s in masked:
            want_idx[(idx >= 0) & (idx // L == s)] = -1
        assert np.array_equal(cx, ll_combine_want(x, want_idx, w)), "combine differs"

    step(all_in, ())
    sync = os.environ["FEP_TEST_SYNC_DIR"]
    if r == GONE:
        deadline = time.monotonic() + 60
        while len(os.listdir(sync)) < n - 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)
        sys.stdout.flush()
        os._exit(0)  # dies between steps
    open(os.path.join(sync, f"done-{r}"), "w").close()
    time.sleep(1.0)
    t0 = time.monotonic()
    survivors = [a if s != GONE else (a[0][:0], a[1][:0], a[2][:0]) for s, a in enumerate(all_in)]
    step(survivors, (GONE,))
    took = time.monotonic() - t0
    assert took < 5.0, f"the dead rank was waited for ({took:.1f} s)"
    mask = np.zeros(n, np.int32)
    buf.low_latency_query_mask_buffer(mask)
    assert mask.tolist() == [int(s == GONE) for s in range(n)], mask
    buf.clean_low_latency_buffer(MAX_LL, H, e_all)
    step(survivors, (GONE,))
    try:
        # Collective over the store, which rank GONE left: a bootstrap error (naming it, or the
        # store itself once rank 0, which serves it, has gone on and exited).
        buf.destroy()
    except Exception as e:  # noqa: BLE001 - expected
        assert "bootstrap error" in str(e), e
    print(f"rank {r}: ok", flush=True)


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stdout.flush()
        sys.exit(1)
