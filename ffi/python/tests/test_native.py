"""The torch helper (fabric_ep/_native.cpp) on a GPU: it builds, its ``empty`` makes what
``Tensor.new_empty_strided`` makes, from the pool of the stream it is given, its ``record`` has
``Tensor.record_stream``'s effect (a block recorded on a busy stream is not reused until that
stream passes), and its ``ptrs`` reads the inputs' pointers only when every check holds.
Skipped without torch or a CUDA device (CI); the loader's choices are tested without torch in
test_native_loader.py, and the GPU path's use of it with a stand-in in
test_gpu_path_fake_torch.py."""

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed on this machine")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device visible to torch", allow_module_level=True)

from fabric_ep import _native  # noqa: E402

N = 3000  # float32 elements: a small-pool block (12000 bytes)


@pytest.fixture(scope="module")
def nat():
    mp = pytest.MonkeyPatch()
    mp.setenv("FABRIC_EP_NATIVE", "1")  # must build here
    try:
        m = _native.get(torch)
    finally:
        mp.undo()
    assert m is not None and m.ABI == _native.ABI, _native.status()
    return m


def test_empty_matches_new_empty_strided(nat):
    like_b = torch.empty(0, dtype=torch.bfloat16, device=0)
    like_i = torch.empty(0, dtype=torch.int64, device=0)
    a, b, c = nat.empty(0, like_b, (5, 7), (7, 1), like_i, (5, 2), (2, 1), like_b,
                        (2, 3, 4), (12, 4, 1))
    for t, want in ((a, like_b.new_empty_strided((5, 7), (7, 1))),
                    (b, like_i.new_empty_strided((5, 2), (2, 1))),
                    (c, like_b.new_empty_strided((2, 3, 4), (12, 4, 1)))):
        assert (t.dtype, t.shape, t.stride(), t.device) == \
            (want.dtype, want.shape, want.stride(), want.device)
        assert not t.requires_grad and t.is_contiguous()
    a.fill_(1.5)
    b.copy_(torch.arange(10, device=0).view(5, 2))
    assert a.float().sum().item() == 52.5 and b.sum().item() == 45
    (z,) = nat.empty(0, like_b, (0, 7), (7, 1))
    assert z.shape == (0, 7)


def test_bad_arguments_are_refused(nat):
    like = torch.empty(0, device=0)
    for args, exc, match in [
        ((0,), TypeError, "expected a stream"),
        ((0, like, (1,)), TypeError, "expected a stream"),
        (("s", like, (1,), (1,)), TypeError, "stream: expected an int"),
        ((0, "x", (1,), (1,)), TypeError, "like of output 0"),
        ((0, torch.empty(0), (1,), (1,)), ValueError, "expected a CUDA tensor"),
        ((0, like, [1], (1,)), TypeError, "shape of output 0"),
        ((0, like, (1, 2), (1,)), ValueError, "differ in length"),
    ]:
        with pytest.raises(exc, match=match):
            nat.empty(*args)
    for args, exc, match in [
        ((0,), TypeError, "pairs"),
        ((0, [like]), TypeError, "tuple of tensors"),
        ((0, (like, 3)), TypeError, "item 1"),
        ((0, (torch.empty(1),)), RuntimeError, "expected a CUDA tensor"),
    ]:
        with pytest.raises(exc, match=match):
            nat.record(*args)
    nat.record(0, (None, like), 0, ())  # None entries and empty tuples are fine


def test_empty_allocates_from_the_given_streams_pool(nat):
    """A block allocated on a stream returns to that stream's pool: freed, it is not handed to
    the current stream, and is handed out again on its own."""
    side = torch.cuda.Stream(device=0)
    ext = torch.cuda.ExternalStream(side.cuda_stream, device=0)  # as the Buffer's comm stream
    like = torch.empty(0, device=0)
    torch.cuda.synchronize()
    (t,) = nat.empty(ext.stream_id, like, (N,), (1,))
    p = t.data_ptr()
    del t
    v = torch.empty(N, device=0)  # the current stream's pool
    assert v.data_ptr() != p
    with torch.cuda.stream(ext):
        u = torch.empty(N, device=0)
    assert u.data_ptr() == p
    # And 0: the current stream's pool (the control: the current stream reuses its own block).
    (w,) = nat.empty(0, like, (N,), (1,))
    q = w.data_ptr()
    del w
    assert torch.empty(N, device=0).data_ptr() == q


def test_record_defers_reuse_until_the_recorded_stream_passes(nat):
    side = torch.cuda.Stream(device=0)
    ext = torch.cuda.ExternalStream(side.cuda_stream, device=0)
    torch.cuda.synchronize()

    def freed_block_reused(record_on):
        x = torch.empty(N, device=0)
        p = x.data_ptr()
        with torch.cuda.stream(ext):
            torch.cuda._sleep(200_000_000)  # keeps ext busy (~0.1 s) past the checks below
        if record_on is not None:
            nat.record(record_on, (x,))
        del x
        y = torch.empty(N, device=0)
        reused = y.data_ptr() == p
        ext.synchronize()
        return reused

    assert freed_block_reused(None)  # the control: no record, the block comes straight back
    assert freed_block_reused(0)  # recorded on its own (current) stream: a no-op, as torch's
    assert not freed_block_reused(ext.stream_id)  # held until ext's queued work passes


class Sub(torch.Tensor):
    pass


def test_ptrs_reads_the_common_case_and_declines_anything_else(nat):
    bf = torch.empty(0, dtype=torch.bfloat16, device=0)
    i64 = torch.empty(0, dtype=torch.int64, device=0)
    x = torch.zeros((5, 8), dtype=torch.bfloat16, device=0)
    idx = torch.zeros((5, 2), dtype=torch.int64, device=0)
    assert nat.ptrs(0, x, bf, -1, 8, idx, i64, -2, 2) == (x.data_ptr(), idx.data_ptr(), 5)
    assert nat.ptrs(0, x, bf, 5, 8) == (x.data_ptr(), 5)
    declined = [
        (x, bf, 4, 8),  # rows
        (x, bf, -1, 7),  # cols
        (x.float(), bf, -1, 8),  # dtype
        (x.cpu(), bf, -1, 8),  # device
        (x.t(), bf, -1, 5),  # layout
        (x.view(40), bf, -1, 8),  # ndim
        (x.as_subclass(Sub), bf, -1, 8),  # a subclass
        (None, bf, -1, 8),  # not a tensor
    ]
    for q in declined:
        assert nat.ptrs(0, *q) is None, q
    assert nat.ptrs(0, x, bf, -1, 8, idx[:4], i64, -2, 2) is None  # rows differ from the first's
    # torch counts a Parameter as an exact Tensor (THPVariable_CheckExact); the Python checks
    # accept it too (isinstance).
    p = torch.nn.Parameter(x)
    assert nat.ptrs(0, p, bf, -1, 8) == (x.data_ptr(), 5)
    assert nat.ptrs(1, x, bf, -1, 8) is None  # another device index than the tensor's
    for args, exc, match in [
        ((0, x, bf, -1), TypeError, "quadruples"),
        ((0, x, "bf", -1, 8), TypeError, "like of tensor 0"),
        ((0, x, bf, -2, 8), ValueError, "rows of tensor 0"),
        ((0, x, bf, -1, 8, idx, i64, -1, 2), ValueError, "rows of tensor 1"),
        ((0, None, bf, -1, 8, idx, i64, -1, 2), ValueError, "rows of tensor 1"),  # spec first
    ]:
        with pytest.raises(exc, match=match):
            nat.ptrs(*args)
