"""The torch helper's loader (fabric_ep/_native.py) without torch (runs in CI): FABRIC_EP_NATIVE
is parsed, 0 never builds, auto warns once and keeps the pure-Python path when the build fails,
1 raises naming why. The helper itself is tested on the GPU machine (test_native.py)."""

import pathlib
import sys
import threading
import types
import warnings

import pytest

import fabric_ep
from fabric_ep import _native


@pytest.fixture
def fresh(monkeypatch):
    """A loader that has not tried yet, whose build fails as torch's would without a compiler."""
    monkeypatch.setattr(_native, "_tried", False)
    monkeypatch.setattr(_native, "_module", None)
    monkeypatch.setattr(_native, "_status", "not loaded yet")
    calls = []

    def build(torch):
        calls.append(torch)
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(_native, "_build", build)
    return calls


@pytest.mark.parametrize("value, mode", [("", "auto"), ("AUTO", "auto"), ("1", "on"),
                                         ("require", "on"), ("0", "off"), ("off", "off")])
def test_mode_values(monkeypatch, value, mode):
    monkeypatch.setenv("FABRIC_EP_NATIVE", value)
    assert _native._mode() == mode


def test_bad_mode_is_refused_naming_the_variable(monkeypatch):
    monkeypatch.setenv("FABRIC_EP_NATIVE", "maybe")
    with pytest.raises(ValueError, match="FABRIC_EP_NATIVE='maybe'"):
        _native.get(types.SimpleNamespace())


def test_off_never_builds(monkeypatch, fresh):
    monkeypatch.setenv("FABRIC_EP_NATIVE", "0")
    assert _native.get(object()) is None and fresh == []
    assert _native.status().startswith("off") and fabric_ep.native_status() == _native.status()


def test_auto_warns_once_and_keeps_the_pure_path(monkeypatch, fresh):
    monkeypatch.delenv("FABRIC_EP_NATIVE", raising=False)
    with pytest.warns(RuntimeWarning, match="did not build.*Ninja is required"):
        assert _native.get(object()) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _native.get(object()) is None  # tried once per process: no second build or warning
    assert len(fresh) == 1 and _native.status().startswith("failed: RuntimeError: Ninja")


def test_required_raises_with_the_reason(monkeypatch, fresh):
    monkeypatch.setenv("FABRIC_EP_NATIVE", "1")
    for _ in range(2):
        with pytest.raises(RuntimeError, match="FABRIC_EP_NATIVE=1.*Ninja is required"):
            _native.get(object())
    assert len(fresh) == 1


@pytest.fixture
def fake_torch(monkeypatch, tmp_path):
    """A torch whose cpp_extension.load records its arguments and returns a module of ``abi``
    (``loads``: the calls), with TORCH_EXTENSIONS_DIR in a temporary folder."""
    loads = []
    fake_ext = types.SimpleNamespace(
        get_default_build_root=lambda: str(tmp_path / "default"),
        load=lambda **kw: loads.append(kw) or types.SimpleNamespace(ABI=fake_ext.abi),
        abi=_native.ABI)
    utils = types.ModuleType("torch.utils")
    utils.cpp_extension = fake_ext
    torch = types.ModuleType("torch")
    torch.utils, torch.__version__ = utils, "2.11.0+cu130"
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setitem(sys.modules, "torch.utils", utils)
    monkeypatch.setitem(sys.modules, "torch.utils.cpp_extension", fake_ext)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    return torch, fake_ext, loads


def test_builds_in_a_folder_per_python_and_torch(fake_torch, tmp_path, monkeypatch):
    torch, _, loads = fake_torch
    assert _native._build(torch).ABI == _native.ABI
    d = loads[0]["build_directory"]
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    assert d == str(tmp_path / "ext" / f"fabric_ep_native-{py}-torch2.11.0_cu130")
    assert loads[0]["sources"] == [_native._SRC] and pathlib.Path(d).is_dir()
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    _native._build(torch)
    assert loads[1]["build_directory"].startswith(str(tmp_path / "default"))


def test_a_stale_build_lock_is_waited_for_with_a_deadline(fake_torch, monkeypatch):
    """torch's own wait on the build folder's lock file has none: a build killed midway would
    hang every later Buffer."""
    torch, _, loads = fake_torch
    d = _native._build_dir(torch, torch.utils.cpp_extension)
    lock = pathlib.Path(d) / "lock"
    lock.write_text("")
    monkeypatch.setattr(_native, "LOCK_WAIT_S", 0.3)
    with pytest.raises(RuntimeError, match="lock still exists after 0 s.*delete the file"):
        _native._build(torch)
    assert loads == []  # torch's load, which would wait forever, was not called
    # A lock that goes away within the deadline (another process's build ending): built.
    monkeypatch.setattr(_native, "LOCK_WAIT_S", 30.0)
    threading.Timer(0.1, lock.unlink).start()
    assert _native._build(torch).ABI == _native.ABI and len(loads) == 1


def test_a_cached_module_of_another_abi_is_refused(fake_torch):
    """_build checks the module's ABI (a stale cache of an older package)."""
    torch, fake_ext, _ = fake_torch
    fake_ext.abi = _native.ABI + 1
    want = f"has ABI {_native.ABI + 1}, this package needs {_native.ABI}"
    with pytest.raises(RuntimeError, match=want):
        _native._build(torch)
