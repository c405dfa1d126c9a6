"""Runs test modules without pytest (the GPU machine may not have it): a small stand-in for the
parts of pytest the GPU tests use (importorskip, skip, mark.parametrize, raises), then every
``test_*`` function of the given files, each parameter set on its own. Prints one line per test
and a closing ``N passed, N failed, N skipped`` line; exit status 1 if any failed.

Usage: ``python3 plain_runner.py test_gpu.py [test_gpu_abi.py ...]`` (paths; their directory is
put on ``sys.path`` so ``conftest`` helpers import). Fixtures are not supported: a test that
takes arguments other than its parameters is reported as skipped."""

import contextlib
import importlib.util
import inspect
import itertools
import os
import re
import sys
import time
import traceback
import types


class Skipped(Exception):
    pass


@contextlib.contextmanager
def raises(exc, match=None):
    """pytest.raises without pytest: the block must raise ``exc`` (matching ``match``)."""
    try:
        yield
    except exc as e:
        if match is not None and not re.search(match, str(e)):
            raise AssertionError(f"{type(e).__name__}({e!s}) does not match {match!r}") from e
        return
    name = getattr(exc, "__name__", repr(exc))  # an exception class, or a tuple of them
    raise AssertionError(f"did not raise {name}" + (f" matching {match!r}" if match else ""))


def _shim() -> types.ModuleType:
    m = types.ModuleType("pytest")

    def skip(reason="", allow_module_level=False):
        raise Skipped(reason)

    def importorskip(name, reason=None):
        try:
            return importlib.import_module(name)
        except ImportError:
            raise Skipped(reason or f"could not import {name!r}") from None

    class _Mark:
        def parametrize(self, names, values):
            names = [n.strip() for n in names.split(",")] if isinstance(names, str) else names

            def deco(fn):
                fn.__dict__.setdefault("_params", []).insert(0, (names, list(values)))
                return fn
            return deco

        def __getattr__(self, name):
            return lambda *a, **k: (lambda fn: fn)

    def fixture(*a, **k):
        if a and callable(a[0]):
            return a[0]
        return lambda fn: fn

    m.skip, m.importorskip, m.raises, m.mark, m.fixture = skip, importorskip, raises, _Mark(), fixture
    m.Skipped = Skipped
    return m


def _cases(fn):
    params = getattr(fn, "_params", [])
    if not params:
        yield "", {}
        return
    for combo in itertools.product(*[vals for _, vals in params]):
        kw = {}
        for (names, _), v in zip(params, combo):
            if len(names) == 1:
                kw[names[0]] = v
            else:
                kw.update(zip(names, v))
        yield "[" + "-".join(str(v) for v in kw.values()) + "]", kw


def main(paths):
    # NOTES: the stand-in even where pytest is installed, so parametrize works the same way.
    pytest = sys.modules["pytest"] = _shim()
    skip_exc = pytest.Skipped
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    for path in paths:
        sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
        name = os.path.splitext(os.path.basename(path))[0]
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(mod)
        except skip_exc as e:
            print(f"SKIPPED {name}: {e}", flush=True)
            counts["skipped"] += 1
            continue
        for tname, fn in inspect.getmembers(mod, inspect.isfunction):
            if not tname.startswith("test_") or fn.__module__ != mod.__name__:
                continue
            for suffix, kw in _cases(fn):
                extra = [p for p in inspect.signature(fn).parameters if p not in kw]
                label = f"{name}::{tname}{suffix}"
                if extra:
                    print(f"SKIPPED {label}: needs fixtures {extra}", flush=True)
                    counts["skipped"] += 1
                    continue
                t0 = time.monotonic()
                try:
                    fn(**kw)
                    print(f"PASSED {label} ({time.monotonic() - t0:.1f} s)", flush=True)
                    counts["passed"] += 1
                except skip_exc as e:
                    print(f"SKIPPED {label}: {e}", flush=True)
                    counts["skipped"] += 1
                except BaseException:  # noqa: BLE001 - reported, the run goes on
                    print(f"FAILED {label} ({time.monotonic() - t0:.1f} s)\n"
                          f"{traceback.format_exc()}", flush=True)
                    counts["failed"] += 1
    print(f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped")
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
