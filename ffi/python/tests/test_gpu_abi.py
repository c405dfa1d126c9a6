"""The C ABI's GPU entry points and the versioned config, checked without a GPU (runs in CI): the
80-byte first-release ``fep_config`` is still accepted, short or wrong-version configs are
refused naming ``cfg``, ``fep_gpu_*`` calls on a host buffer or with NULLs are refused naming the
argument, and a GPU buffer on a device that does not exist names ``device``."""

import ctypes
import os

# This module may share a process with thread-mode GPU tests: whichever initialises CUDA first,
# the context needs a hardware queue per stream (see conftest.py).
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")

import pytest  # noqa: E402

from conftest import free_port  # noqa: E402
from fabric_ep import _lib  # noqa: E402
from fabric_ep._lib import FEP_ERR_INVALID_ARGUMENT, lib  # noqa: E402

E, H, K = 8, 256, 2


@pytest.fixture
def env1():
    port = free_port()
    saved = dict(os.environ)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), FEP_MASTER_PORT=str(port),
                      FEP_JOB_ID=f"pytest-gpu-abi-{os.getpid()}-{port}")
    yield
    os.environ.clear()
    os.environ.update(saved)


def small_cfg():
    cfg = _lib.new_config()
    cfg.rank, cfg.num_ranks, cfg.ranks_per_node, cfg.local_rank = 0, 1, 1, 0
    cfg.num_experts, cfg.hidden, cfg.num_topk = E, H, K
    cfg.provider = b"shm"
    return cfg


def last_error():
    return (lib.fep_last_error() or b"").decode()


def test_config_init_fills_size_version_and_device():
    cfg = _lib.new_config()
    assert cfg.struct_size == ctypes.sizeof(_lib.fep_config) == 96
    assert cfg.internode_hierarchy == 0
    assert cfg.version == _lib.FEP_ABI_VERSION and cfg.device == -1 and cfg.gpu_reserve_tokens == 0
    assert ctypes.sizeof(_lib.fep_config) > _lib.FEP_CONFIG_V1_SIZE


def test_first_release_config_size_is_still_accepted():
    full = small_cfg()
    want = _lib.size_hints(full)
    # A caller compiled against the first header: 80 bytes, no device field after it.
    v1 = ctypes.create_string_buffer(_lib.FEP_CONFIG_V1_SIZE)
    ctypes.memmove(v1, ctypes.addressof(full), _lib.FEP_CONFIG_V1_SIZE)
    ctypes.c_uint32.from_buffer(v1, 0).value = _lib.FEP_CONFIG_V1_SIZE
    got = _lib.fep_size_hints()
    st = lib.fep_get_size_hints(ctypes.cast(v1, ctypes.POINTER(_lib.fep_config)),
                                ctypes.byref(got))
    assert st == 0, last_error()
    assert (got.normal_bytes, got.ll_bytes) == (want.normal_bytes, want.ll_bytes)


@pytest.mark.parametrize("size, version", [(_lib.FEP_CONFIG_V1_SIZE - 4, 1), (96, 2), (96, 0)])
def test_short_or_wrong_version_config_is_refused(size, version):
    cfg = small_cfg()
    cfg.struct_size, cfg.version = size, version
    out = _lib.fep_size_hints()
    st = lib.fep_get_size_hints(ctypes.byref(cfg), ctypes.byref(out))
    assert st == FEP_ERR_INVALID_ARGUMENT and "`cfg`" in last_error(), last_error()


def test_gpu_calls_refuse_null_and_host_buffers(env1):
    out_h, rows = ctypes.c_void_p(), ctypes.c_int64()
    order = _lib.fep_gpu_order()
    st = lib.fep_gpu_notify(None, None, 1, 0, ctypes.byref(order), ctypes.byref(out_h),
                            ctypes.byref(rows), None)
    assert st == FEP_ERR_INVALID_ARGUMENT and "`buf`" in last_error(), last_error()
    assert lib.fep_gpu_sync(None, None) == FEP_ERR_INVALID_ARGUMENT
    cfg = small_cfg()
    buf = ctypes.c_void_p()
    _lib.check("fep_buffer_create",
               lib.fep_buffer_create(ctypes.byref(cfg), _lib.ALLGATHER_FN(), None,
                                     ctypes.byref(buf)))
    try:
        st = lib.fep_gpu_notify(buf, None, 1, 0, ctypes.byref(order), ctypes.byref(out_h),
                                ctypes.byref(rows), None)
        assert st == FEP_ERR_INVALID_ARGUMENT, st
        assert "`buf`: a host backend buffer" in last_error(), last_error()
        assert lib.fep_gpu_reserve(buf, 16, 1) == FEP_ERR_INVALID_ARGUMENT
        op = ctypes.c_void_p()
        st = lib.fep_gpu_ll_dispatch(buf, None, None, False, False, False, None,
                                     ctypes.byref(order), ctypes.byref(op))
        assert st == FEP_ERR_INVALID_ARGUMENT and "`buf`" in last_error()
        assert op.value is None
    finally:
        _lib.check("fep_buffer_destroy", lib.fep_buffer_destroy(buf))


def test_gpu_buffer_on_a_missing_device_names_it(env1):
    cfg = small_cfg()
    cfg.backend = _lib.FEP_BACKEND_GPU
    cfg.device = 999
    buf = ctypes.c_void_p()
    st = lib.fep_buffer_create(ctypes.byref(cfg), _lib.ALLGATHER_FN(), None, ctypes.byref(buf))
    assert st != 0 and buf.value is None
    assert "`device`: CUDA device 999" in last_error(), last_error()
