"""The GPU entry points and the config as the native module (fabric_ep._core) passes them,
checked without a GPU (runs in CI): the config's defaults, fields out of range or unknown refused
naming them, ``fep_gpu_*`` calls on a host buffer or with NULLs refused naming the argument, and
a GPU buffer on a device that does not exist names ``device``. (The C ABI's own versioned-config
checks, the 80-byte first-release ``fep_config`` among them, are the crate's tests:
ffi/python/native/tests/c_abi.rs.)"""

import os

# This module may share a process with thread-mode GPU tests: whichever initialises CUDA first,
# the context needs a hardware queue per stream (see conftest.py).
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")

import pytest  # noqa: E402

from conftest import free_port  # noqa: E402
from fabric_ep import FabricEPArgumentError, FabricEPError  # noqa: E402
from fabric_ep._ext import FEP_ABI_VERSION, FEP_BACKEND_GPU, core  # noqa: E402

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
    return dict(rank=0, num_ranks=1, ranks_per_node=1, local_rank=0, num_experts=E, hidden=H,
                num_topk=K, provider="shm")


def test_config_defaults_carry_size_version_and_device():
    d = core.config_defaults()
    assert d["struct_size"] == 104 > core.FEP_CONFIG_V1_SIZE == 80
    assert d["enable_shrink"] == 0
    assert d["version"] == FEP_ABI_VERSION == core.abi_version()
    assert d["device"] == -1 and d["gpu_reserve_tokens"] == 0 and d["internode_hierarchy"] == 0
    assert d["rank"] == -1 and d["provider"] is None


@pytest.mark.parametrize("field, value, match", [
    ("hidden", 2**32 + 256, "^hidden: 4294967552 does not fit a 32-bit int"),
    ("num_topk", -2**31 - 1, "^num_topk: -2147483649 does not fit"),
    ("max_tokens_per_rank", 2**63, "^max_tokens_per_rank: .* must be an int"),
    ("num_experts", "8", "^num_experts: 8 must be an int"),
    ("timeout_s", "x", "^timeout_s: x must be a number"),
    ("provider", "s\0hm", "^provider: must not contain NUL"),
    ("struct_size", 80, "^struct_size: set by the library"),
    ("hiden", 256, 'no field "hiden" in fep_config'),
])
def test_config_fields_out_of_range_or_unknown_are_refused_by_name(field, value, match):
    cfg = small_cfg()
    cfg[field] = value
    with pytest.raises(ValueError, match=match):
        core.size_hints(cfg)


def test_library_refusals_raise_fabric_ep_errors():
    cfg = small_cfg()
    cfg["hidden"] = 100  # not a multiple of 8: the library's check
    with pytest.raises(FabricEPArgumentError, match="^fep_get_size_hints: invalid argument "
                                                    r"\(7001\): .*hidden") as e:
        core.size_hints(cfg)
    assert (e.value.call, e.value.status, e.value.status_name) == \
        ("fep_get_size_hints", 7001, "invalid argument")


def test_gpu_calls_refuse_null_and_host_buffers(env1):
    n = core.Calls(H, K, core.FEP_DTYPE_BF16, E, 1, 128, 0x9000)
    with pytest.raises(FabricEPArgumentError, match="`buf`"):
        n.gpu_notify(0, 0, 0, 1, 0, 0x5000, 0, False)
    with pytest.raises(FabricEPArgumentError, match="^fep_gpu_sync"):
        core.gpu_sync(0, 0)
    buf = core.buffer_create(small_cfg())
    try:
        with pytest.raises(FabricEPArgumentError, match="`buf`: a host backend buffer"):
            n.gpu_notify(buf, 0, 0, 1, 0, 0x5000, 0, False)
        with pytest.raises(FabricEPArgumentError, match="`buf`"):
            n.gpu_ll_dispatch(buf, 0, 0, 0, 0, 0, 0, False, False, False, 0x5000, False)
        with pytest.raises(FabricEPArgumentError, match="`buf`"):
            core.gpu_info(buf)
    finally:
        core.buffer_destroy(buf)
    # The live-object registry: a destroyed buffer is refused, not used.
    with pytest.raises(FabricEPError, match="^fep_buffer_destroy"):
        core.buffer_destroy(buf)


def test_gpu_buffer_on_a_missing_device_names_it(env1):
    cfg = small_cfg()
    cfg.update(backend=FEP_BACKEND_GPU, device=999)
    with pytest.raises(FabricEPError, match="`device`: CUDA device 999"):
        core.buffer_create(cfg)


def test_buffer_create_chains_the_gather_callbacks_exception():
    cfg = dict(rank=0, num_ranks=2, ranks_per_node=2, local_rank=0, num_experts=E, hidden=H,
               num_topk=K, provider="shm", timeout_s=5.0)

    def gather(data):
        raise KeyError("the group is gone")

    with pytest.raises(FabricEPError, match="^fep_buffer_create") as e:
        core.buffer_create(cfg, gather)
    assert isinstance(e.value.__cause__, KeyError), e.value.__cause__
    # A callable returning the wrong length is refused naming the callback.
    with pytest.raises(FabricEPError) as e:
        core.buffer_create(cfg, lambda data: data)
    assert "all-gather callback: returned" in str(e.value.__cause__), e.value.__cause__


def test_address_reads_a_contiguous_array_and_refuses_a_strided_one():
    np = pytest.importorskip("numpy")
    a = np.arange(12, dtype=np.int32).reshape(3, 4)
    assert core.address(a) == a.ctypes.data
    with pytest.raises((BufferError, ValueError)):
        core.address(a[:, ::2])
