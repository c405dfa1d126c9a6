"""The torch helper's loader (fabric_ep/_native.py) without torch (runs in CI): FABRIC_EP_NATIVE
is parsed, 0 never builds, auto warns once and keeps the pure-Python path when the build fails,
1 raises naming why. The helper itself is tested on the GPU machine (test_native.py)."""

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


def test_a_cached_module_of_another_abi_is_refused(monkeypatch):
    """_build checks the module's ABI (a stale cache of an older package)."""
    fake_ext = types.SimpleNamespace(load=lambda **kw: types.SimpleNamespace(ABI=_native.ABI + 1))
    utils = types.ModuleType("torch.utils")
    utils.cpp_extension = fake_ext
    torch = types.ModuleType("torch")
    torch.utils = utils
    monkeypatch.setitem(__import__("sys").modules, "torch", torch)
    monkeypatch.setitem(__import__("sys").modules, "torch.utils", utils)
    monkeypatch.setitem(__import__("sys").modules, "torch.utils.cpp_extension", fake_ext)
    want = f"has ABI {_native.ABI + 1}, this package needs {_native.ABI}"
    with pytest.raises(RuntimeError, match=want):
        _native._build(torch)
