"""Argument checking and refusals, on a 1-rank Buffer in this process: every error names the
argument; DeepEP options fabric-ep cannot honour raise instead of being ignored."""

import os

import numpy as np
import pytest

import fabric_ep
from fabric_ep import Buffer, Config, EventOverlap, FabricEPArgumentError
from conftest import free_port

E, H, K, T = 8, 256, 2, 16


@pytest.fixture(scope="module")
def env1():
    port = free_port()
    saved = dict(os.environ)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), FEP_MASTER_PORT=str(port),
                      FEP_JOB_ID=f"pytest-args-{os.getpid()}")
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="module")
def buf(env1):
    b = Buffer(None, num_experts=E, hidden=H, num_topk=K, explicitly_destroy=True, timeout_s=10.0)
    yield b
    b.destroy()


@pytest.fixture
def data():
    rng = np.random.default_rng(1)
    x = rng.integers(0, 1 << 14, size=(T, H)).astype(np.uint16)
    idx = np.stack([np.arange(T) % E, (np.arange(T) + 3) % E], 1).astype(np.int64)
    w = np.ones((T, K), dtype=np.float32)
    return x, idx, w


def _cuda_available():
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def raises(exc, match, fn, *a, **kw):
    with pytest.raises(exc, match=match) as e:
        fn(*a, **kw)
    return e.value


def test_constructor_argument_errors(env1):
    # DeepEP's form: no model shape (each call brings its own).
    os.environ["FEP_MASTER_PORT"] = str(free_port())
    b = Buffer(None, int(1e8), 0, explicitly_destroy=True)
    assert (b.rank, b.num_ranks, b.group_size) == (0, 1, 1) and b.num_nvl_bytes == int(1e8)
    b.destroy()
    raises(TypeError, "^num_experts, hidden and num_topk: give all three", Buffer, None,
           num_experts=E, hidden=H)
    raises(ValueError, "^num_nvl_bytes: ", Buffer, None, -1)
    raises(ValueError, "^num_qps_per_rank: ", Buffer, None, 0, 0, False, 0)
    raises(TypeError, "^low_latency_mode: ", Buffer, None, 0, 0, "yes")
    raises(TypeError, "^enable_shrink: ", Buffer, None, enable_shrink=1)
    raises(ValueError, "^timeout_s: ", Buffer, None, timeout_s=float("nan"))
    raises(ValueError, "^timeout_s: ", Buffer, None, timeout_s=-1.0)
    raises(ValueError, "^provider: ", Buffer, None, provider="shm\0tcp")
    raises(ValueError, "^hidden: ", Buffer, None, num_experts=E, hidden=0, num_topk=K)
    raises(ValueError, "^dispatch_dtype: ", Buffer, None, num_experts=E, hidden=H, num_topk=K,
           dispatch_dtype="fp16")
    raises(ValueError, "^backend: ", Buffer, None, num_experts=E, hidden=H, num_topk=K,
           backend="tpu")
    if not _cuda_available():
        raises(ValueError, "^backend: 'gpu' needs ", Buffer, None, num_experts=E, hidden=H,
               num_topk=K, backend="gpu")
    raises(ValueError, "^config: .*nvl", Buffer, None, num_experts=E, hidden=H, num_topk=K,
           config=Config(20, 6, 256, 6, 128))
    raises(ValueError, "^internode_hierarchy: the GPU backend's", Buffer, None, num_experts=E,
           hidden=H, num_topk=K, backend="host", internode_hierarchy=True)
    raises(TypeError, "^internode_hierarchy: ", Buffer, None, num_experts=E, hidden=H, num_topk=K,
           backend="host", internode_hierarchy=1)


def test_library_refuses_the_hierarchy_off_the_gpu():
    # The C ABI checks it too (before any bootstrap): the host backend, or a single node.
    from fabric_ep._ext import core

    cfg = dict(rank=0, num_ranks=2, ranks_per_node=1, local_rank=0, num_experts=E, hidden=H,
               num_topk=K, internode_hierarchy=1)
    e = raises(FabricEPArgumentError, "internode_hierarchy", core.buffer_create, cfg)
    assert e.call == "fep_buffer_create" and e.status == 7001


def test_library_errors_name_the_field(env1):
    # hidden not a multiple of 8: refused by the library; the message names hidden.
    e = raises(FabricEPArgumentError, "hidden", Buffer, None, num_experts=E, hidden=100,
               num_topk=K)
    assert e.call == "fep_buffer_create_boot" and e.status == 7001


def test_dispatch_argument_errors(buf, data):
    x, idx, w = data
    raises(TypeError, "^x: dtype float32", buf.dispatch, x.astype(np.float32), topk_idx=idx,
           topk_weights=w)
    # Another hidden size on the same Buffer: its own native buffer, made on first use.
    rx = buf.dispatch(x[:, :128].copy(), topk_idx=idx, topk_weights=w)[0]
    assert rx.shape == (T, 128) and (rx == x[:, :128]).all()
    raises(ValueError, "^x: must be C-contiguous", buf.dispatch,
           np.asfortranarray(x), topk_idx=idx, topk_weights=w)
    raises(TypeError, "^x: expected a numpy.ndarray or a torch.Tensor, got list", buf.dispatch,
           x.tolist(), topk_idx=idx, topk_weights=w)
    raises(TypeError, "^topk_idx: dtype int32", buf.dispatch, x, topk_idx=idx.astype(np.int32),
           topk_weights=w)
    raises(ValueError, r"^topk_weights: shape \[16, 3\]", buf.dispatch, x, topk_idx=idx,
           topk_weights=np.ones((T, 3), np.float32))
    raises(ValueError, "^topk_idx: required", buf.dispatch, x)
    raises(ValueError, "^topk_weights: required", buf.dispatch, x, topk_idx=idx)
    raises(ValueError, "^num_tokens_per_rank: shape", buf.dispatch, x, topk_idx=idx,
           topk_weights=w, num_tokens_per_rank=np.zeros(2, np.int32))
    raises(TypeError, "^is_token_in_rank: dtype", buf.dispatch, x, topk_idx=idx,
           topk_weights=w, is_token_in_rank=np.zeros((T, 1), np.int32))
    raises(ValueError, "^expert_alignment: ", buf.dispatch, x, topk_idx=idx, topk_weights=w,
           expert_alignment=0)
    raises(ValueError, "^num_worst_tokens: ", buf.dispatch, x, topk_idx=idx, topk_weights=w,
           num_worst_tokens=-1)
    # fp8 tokens on the same Buffer (DeepEP picks the format per call); a malformed tuple.
    x8, s8 = x.view(np.uint8)[:, :H].copy(), np.full((T, 2), 0.5, np.float32)
    (r8, rs8), *_ = buf.dispatch((x8, s8), topk_idx=idx, topk_weights=w)
    assert (r8 == x8).all() and (rs8 == s8).all()
    raises(ValueError, "^x_scales: shape", buf.dispatch, (x8, np.ones((T, 3), np.float32)),
           topk_idx=idx, topk_weights=w)
    raises(ValueError, "^x: a tuple must be", buf.dispatch, (x,), topk_idx=idx, topk_weights=w)


def test_library_side_errors_surface(buf, data):
    x, idx, w = data
    bad = idx.copy()
    bad[0, 0] = E + 5
    e = raises(FabricEPArgumentError, "topk_idx", buf.dispatch, x, topk_idx=bad, topk_weights=w)
    assert e.call == "fep_dispatch" and e.status_name
    # Refused before anything was sent: the buffer still works.
    rx, *_ = buf.dispatch(x, topk_idx=idx, topk_weights=w)
    assert rx.shape == (T, H)


def test_too_many_tokens_for_num_worst_tokens(env1, data):
    # Found out after the count exchange: an error naming num_worst_tokens, after which the
    # library refuses the buffer (its peers may be mid-protocol), saying why.
    os.environ["FEP_MASTER_PORT"] = str(free_port())
    b = Buffer(None, num_experts=E, hidden=H, num_topk=K, explicitly_destroy=True, timeout_s=10.0)
    x, idx, w = data
    raises(FabricEPArgumentError, "num_worst_tokens.*receives 16 tokens, more than 1", b.dispatch,
           x, topk_idx=idx, topk_weights=w, num_worst_tokens=1)
    raises(fabric_ep.FabricEPError, "unusable after an earlier failure", b.dispatch, x,
           topk_idx=idx, topk_weights=w)
    b.destroy()


def test_cached_and_combine_argument_errors(buf, data):
    x, idx, w = data
    rx, ri, rw, counts, handle, ev = buf.dispatch(x, topk_idx=idx, topk_weights=w)
    raises(ValueError, "^topk_idx/topk_weights: must be None with a cached handle", buf.dispatch,
           x, handle=handle, topk_idx=idx, topk_weights=w)
    raises(ValueError, "^x: 8 tokens, the handle was made for 16", buf.dispatch, x[:8].copy(),
           handle=handle)
    raises(TypeError, "^handle: expected a fabric_ep DispatchHandle", buf.dispatch, x,
           handle=(1, 2))
    raises(ValueError, r"^x: shape \[15, 256\], expected \[16, 256\]", buf.combine,
           rx[:15].copy(), handle)
    raises(TypeError, "^x: dtype float32", buf.combine, rx.astype(np.float32), handle)
    raises(TypeError, "^handle: ", buf.combine, rx, None)
    raises(ValueError, r"^topk_weights: shape", buf.combine, rx, handle,
           topk_weights=np.ones((T, 1), np.float32))
    raises(ValueError, r"^bias\[0\]: shape", buf.combine, rx, handle, bias=rx[:1].copy())
    raises(ValueError, "^bias: a tensor or a pair", buf.combine, rx, handle, bias=(rx, rx, rx))
    combined, cw, ev = buf.combine(rx, handle)
    assert combined.shape == (T, H) and cw is None
    # bias (one tensor or a pair) is added to the sum: at one rank the sum is x itself.
    from fabric_ep._arrays import _bf16_bits_to_f32, _f32_to_bf16_bits

    ones = _f32_to_bf16_bits(np.ones((T, H), np.float32))
    b1, _, _ = buf.combine(rx, handle, bias=ones)
    b2, _, _ = buf.combine(rx, handle, bias=(ones, ones))
    xf = _bf16_bits_to_f32(combined)
    assert (b1 == _f32_to_bf16_bits(xf + 1)).all() and (b2 == _f32_to_bf16_bits(xf + 2)).all()


def test_unsupported_options_are_refused(buf, data):
    x, idx, w = data
    kw = dict(topk_idx=idx, topk_weights=w)
    raises(ValueError, "^async_finish=True", buf.dispatch, x, async_finish=True, **kw)
    raises(ValueError, "^allocate_on_comm_stream=True", buf.dispatch, x,
           allocate_on_comm_stream=True, **kw)
    raises(ValueError, "^previous_event: ", buf.dispatch, x, previous_event=EventOverlap(object()),
           **kw)
    # DeepEP's own tuned configs are tuning hints here: accepted.
    assert buf.dispatch(x, config=Config(20, 6, 256, 6, 128), **kw)[0].shape == (T, H)
    raises(TypeError, "^config: expected a fabric_ep.Config", buf.dispatch, x, config=(1, 2),
           **kw)
    raises(ValueError, "^async_finish=True", buf.get_dispatch_layout, idx, E, async_finish=True)
    raises(ValueError, "^num_experts: 0 ", buf.get_dispatch_layout, idx, 0)
    per_rank, _, per_expert, _, _ = buf.get_dispatch_layout(idx, 2 * E)
    assert per_expert.shape == (2 * E,) and per_rank.tolist() == [T]
    # What DeepEP hands back when async_finish=False is accepted as previous_event.
    *_, ev = buf.get_dispatch_layout(idx, E)
    out = buf.dispatch(x, previous_event=ev, config=buf.config, **kw)
    assert out[0].shape == (T, H)


def test_low_latency_argument_checks(buf, env1, data):
    x, idx, w = data
    for name in ("low_latency_dispatch", "low_latency_combine", "clean_low_latency_buffer"):
        assert callable(getattr(buf, name))
    # As in DeepEP, a normal-mode buffer refuses the low-latency calls.
    raises(ValueError, "^low_latency_dispatch: this Buffer was built with low_latency_mode=False",
           buf.low_latency_dispatch, x, idx, 128, E)
    os.environ["FEP_MASTER_PORT"] = str(free_port())
    ll = Buffer(None, 0, 0, True, num_experts=E, hidden=H, num_topk=K, explicitly_destroy=True,
                timeout_s=10.0, num_max_dispatch_tokens_per_rank=T)
    try:
        raises(ValueError, "^num_max_dispatch_tokens_per_rank: 0 ", ll.low_latency_dispatch, x,
               idx, 0, E)
        raises(ValueError, "^num_experts: 0 ", ll.low_latency_dispatch, x, idx, T, 0)
        raises(ValueError, "^use_ue8m0=True", ll.low_latency_dispatch, x, idx, T, E,
               use_ue8m0=True)
        raises(ValueError, "^dispatch_wait_recv_cost_stats: shape", ll.low_latency_dispatch, x,
               idx, T, E, dispatch_wait_recv_cost_stats=np.zeros(2, np.int64))
        raises(TypeError, "^dispatch_wait_recv_cost_stats: dtype", ll.low_latency_dispatch, x,
               idx, T, E, dispatch_wait_recv_cost_stats=np.zeros(1, np.int32))
        raises(ValueError, "^async_finish=True", ll.low_latency_dispatch, x, idx, T, E,
               async_finish=True)
        raises(TypeError, "^x: dtype float32", ll.low_latency_dispatch, x.astype(np.float32), idx,
               T, E)
        big = np.zeros((T + 1, H), np.uint16)
        raises(ValueError, "^x: 17 tokens, more than num_max_dispatch_tokens_per_rank 16",
               ll.low_latency_dispatch, big, np.zeros((T + 1, K), np.int64), T, E)
        raises(ValueError, "^cumulative_local_expert_recv_stats: shape",
               ll.low_latency_dispatch, x, idx, T, E,
               cumulative_local_expert_recv_stats=np.zeros(3, np.int32))
        rx, cnt, handle, _, hook = ll.low_latency_dispatch(x, idx, T, E, use_fp8=False,
                                                           return_recv_hook=True)
        raises(ValueError, "^handle: its dispatch's receive hook has not been called",
               ll.low_latency_combine, rx, idx, w, handle)
        hook()
        raises(RuntimeError, "already called", hook)
        raises(ValueError, "^zero_copy=True: call get_next_low_latency_combine_buffer",
               ll.low_latency_combine, rx, idx, w, handle, zero_copy=True)
        raises(TypeError, "^use_logfmt: ", ll.low_latency_combine, rx, idx, w, handle,
               use_logfmt="yes")
        raises(ValueError, "^combine_wait_recv_cost_stats: shape", ll.low_latency_combine, rx,
               idx, w, handle, combine_wait_recv_cost_stats=np.zeros(2, np.int64))
        raises(ValueError, r"^x: shape \[16, 256\]", ll.low_latency_combine, x, idx, w, handle)
        raises(ValueError, r"^out: shape", ll.low_latency_combine, rx, idx, w, handle,
               out=np.empty((1, H), np.uint16))
        raises(TypeError, "^handle: expected a fabric_ep LowLatencyHandle",
               ll.low_latency_combine, rx, idx, w, object())
        y, _, none = ll.low_latency_combine(rx, idx, w, handle)
        assert y.shape == (T, H) and none is None
        # zero_copy: the expert outputs written into the handle's own combine buffer.
        zc = ll.get_next_low_latency_combine_buffer(handle)
        assert zc.shape == rx.shape and ll.get_next_low_latency_combine_buffer(handle) is zc
        zc[...] = rx
        y2, _, _ = ll.low_latency_combine(x, idx, w, handle, zero_copy=True)
        assert (y2 == y).all()
        # Another max-token count: its own buffer; a clean of a shape never used is a no-op.
        rx2, cnt2, h2, _, _ = ll.low_latency_dispatch(x, idx, 2 * T, E, use_fp8=False)
        assert rx2.shape[1] == 2 * T and (cnt2 == cnt).all()
        ll.clean_low_latency_buffer(T, 128, E)
        ll.clean_low_latency_buffer(T, H, E)
    finally:
        ll.destroy()


def test_event_overlap_and_helpers(buf):
    ev = EventOverlap(None)
    with ev as e:
        assert e is ev
    ev.current_stream_wait()

    class Ev:
        waited = 0

        def wait(self):
            Ev.waited += 1

    EventOverlap(Ev()).current_stream_wait()
    assert Ev.waited == 1
    assert buf.get_comm_stream() is None
    cfg = Buffer.get_dispatch_config(8)
    assert cfg == Buffer.get_combine_config(8) == Config()
    assert cfg.get_nvl_buffer_size_hint(7168 * 2, 8) > 0 and cfg.get_rdma_buffer_size_hint(
        7168 * 2, 8) == 0
    assert cfg.get_rdma_buffer_size_hint(7168 * 2, 16) > cfg.get_nvl_buffer_size_hint(7168 * 2, 8)
    assert Buffer.get_low_latency_rdma_size_hint(128, 7168, 16, 256) > 128 * 7168 * 2 * 16
    raises(ValueError, "^num_sms: ", Config, 0)
    # DeepEP's sizing (hidden bytes and ranks only) covers a real shape on either backend.
    from fabric_ep.config import gpu_chunking, normal_buffer_bytes

    for r in (2, 4, 8, 16):
        c = Buffer.get_dispatch_config(r)
        hint = c.get_nvl_buffer_size_hint(7168 * 2, r) + c.get_rdma_buffer_size_hint(7168 * 2, r)
        for chunking in ((64, 4), gpu_chunking(r)):
            assert hint >= normal_buffer_bytes(r, 7168, 256, 8, False, chunking), (r, chunking)
    hints = buf.size_hints()
    assert hints["normal_bytes"] > 0 and hints["ll_bytes"] > 0


def test_destroy_then_use(env1, data):
    os.environ["FEP_MASTER_PORT"] = str(free_port())
    b = Buffer(None, num_experts=E, hidden=H, num_topk=K, explicitly_destroy=True, timeout_s=10.0)
    b.destroy()
    raises(RuntimeError, "already destroyed", b.destroy)
    x, idx, w = data
    raises(RuntimeError, "already destroyed", b.dispatch, x, topk_idx=idx, topk_weights=w)


def test_torch_cpu_and_cuda(buf, data):
    torch = pytest.importorskip("torch", reason="torch is not installed on this machine")
    x, idx, w = data
    xt = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    rx, ri, rw, counts, h, _ = buf.dispatch(xt, topk_idx=torch.from_numpy(idx),
                                            topk_weights=torch.from_numpy(w))
    assert rx.dtype == torch.bfloat16 and ri.dtype == torch.int64 and rw.dtype == torch.float32
    cx, _, _ = buf.combine(rx, h)
    assert cx.dtype == torch.bfloat16 and cx.shape == (T, H)
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the CUDA refusal is not exercised")
    with pytest.raises(ValueError, match="^x: tensor is on cuda"):
        buf.dispatch(xt.cuda(), topk_idx=torch.from_numpy(idx), topk_weights=torch.from_numpy(w))


def test_out_of_range_ints_are_refused_naming_the_argument(env1, buf, data):
    # Never wrapped into the native call's 32- or 64-bit fields: refused before it, by name.
    x, idx, w = data
    raises(ValueError, "^hidden: ", Buffer, None, num_experts=E, hidden=2**32 + H, num_topk=K)
    raises(ValueError, "^num_max_dispatch_tokens_per_rank: ", Buffer, None, num_experts=E,
           hidden=H, num_topk=K, num_max_dispatch_tokens_per_rank=2**31)
    for name, v in (("num_worst_tokens", 2**63), ("num_worst_tokens", 2**31),
                    ("expert_alignment", 2**32 + 1)):
        raises(ValueError, f"^{name}: ", buf.dispatch, x, topk_idx=idx, topk_weights=w,
               **{name: v})
