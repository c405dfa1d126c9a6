"""The installable package (ffi/python/setup.py): `pip wheel ffi/python` makes a cp38-abi3
platform wheel that carries the native module fabric_ep/_core.abi3.so and the libfabric it links
(fabric_ep/.libs/); installed into a fresh venv it imports from outside the repository with no
FABRIC_EP_EXTENSION, loads the packaged module and its bundled libfabric, and runs a one-rank
host Buffer.

The wheels are built from make test's debug module (FABRIC_EP_EXTENSION, or cargo's no-op debug
build: no second compile). pip builds in an isolated environment, as a user's plain `pip wheel`
does, so it fetches setuptools from the package index; the tests skip, saying so, when it is
unreachable, and when this Python cannot make a venv."""

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile

import numpy
import pytest

from conftest import PKG_ROOT, free_port

REPO = PKG_ROOT.parent.parent
# Variables that would point the build or the import at the checkout instead of the wheel.
OURS = ("FABRIC_EP_EXTENSION", "FABRIC_EP_ROOT", "FABRIC_EP_CARGO_PROFILE", "PYTHONPATH",
        "LD_LIBRARY_PATH", "LD_PRELOAD", "CARGO_TARGET_DIR")


# The C runtime every Linux has, never bundled.
C_RUNTIME = re.compile(
    r"(libc|libm|libdl|libpthread|librt|libgcc_s|libstdc\+\+|ld-linux[^.]*)[.]so")


MODULE = "fabric_ep/_core.abi3.so"


def debug_module() -> pathlib.Path:
    p = os.environ.get("FABRIC_EP_EXTENSION")
    if p:
        return pathlib.Path(p)
    target = pathlib.Path(os.environ.get("CARGO_TARGET_DIR") or REPO / "target")
    return target / "debug" / "libfabric_ep_python.so"


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in OURS}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1", PIP_ROOT_USER_ACTION="ignore")
    env.update(extra)
    return env


def pip_wheel(src: pathlib.Path, out: pathlib.Path, env: dict, expect_ok: bool = True):
    """`pip wheel --no-deps -w out src` as a user runs it (isolated build); (wheel, output)."""
    out.mkdir(parents=True, exist_ok=True)
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "-w", str(out),
                        str(src)], env=env, capture_output=True, text=True, timeout=600)
    log = p.stdout + p.stderr
    if p.returncode != 0 and re.search(r"No matching distribution found for setuptools|"
                                       r"Could not find a version that satisfies the requirement "
                                       r"setuptools", log):
        pytest.skip("pip's isolated build could not fetch setuptools from the package index")
    if not expect_ok:
        assert p.returncode != 0, log
        return None, log
    assert p.returncode == 0, log
    wheels = list(out.glob("fabric_ep-*.whl"))
    assert len(wheels) == 1, (wheels, log)
    return wheels[0], log


def expected_platform() -> str:
    return re.sub(r"[-.]", "_", sysconfig.get_platform())


def check_wheel(whl: pathlib.Path, tmp: pathlib.Path):
    """Tag and contents: cp38-abi3-<platform>, the module stripped with RUNPATH $ORIGIN/.libs,
    libfabric bundled with RUNPATH $ORIGIN, no ctypes layer or torch helper left."""
    tag = whl.name[:-len(".whl")].split("-")[-3:]
    assert tag == ["cp38", "abi3", expected_platform()], whl.name
    with zipfile.ZipFile(whl) as z:
        names = set(z.namelist())
        wheel_meta = z.read("fabric_ep-0.1.0.dist-info/WHEEL").decode()
        assert "Root-Is-Purelib: false" in wheel_meta, wheel_meta
        assert MODULE in names, sorted(names)
        assert "fabric_ep/.libs/libfabric.so.1" in names, sorted(names)
        assert "fabric_ep/_ext.py" in names and "fabric_ep/_errors.py" in names
        assert not {"fabric_ep/_lib.py", "fabric_ep/_native.cpp", "fabric_ep/_native.py",
                    "fabric_ep/libfabric_ep.so"} & names, sorted(names)
        bundled = sorted(n.rsplit("/", 1)[1] for n in names if n.startswith("fabric_ep/.libs/"))
        # The C runtime stays the system's (a second glibc in one process breaks it).
        assert not [n for n in bundled if C_RUNTIME.match(n)], bundled
        z.extract(MODULE, tmp)
        z.extract("fabric_ep/.libs/libfabric.so.1", tmp)
    lib = tmp / MODULE
    dyn = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True).stdout
    assert re.search(r"\(RUNPATH\)\s+Library runpath: \[\$ORIGIN/\.libs\]", dyn), dyn
    sections = subprocess.run(["readelf", "-S", "-W", str(lib)], capture_output=True,
                              text=True).stdout
    assert ".symtab" not in sections and ".debug_info" not in sections, "module not stripped"
    dyn = subprocess.run(["readelf", "-d", str(tmp / "fabric_ep/.libs/libfabric.so.1")],
                         capture_output=True, text=True).stdout
    assert re.search(r"\(RUNPATH\)\s+Library runpath: \[\$ORIGIN\]", dyn), dyn
    return bundled


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """`FABRIC_EP_EXTENSION=<debug module> pip wheel ffi/python`: the prebuilt path, in place."""
    lib = debug_module()
    if not lib.is_file():
        pytest.skip(f"no built module at {lib} (make test builds it: cargo build -p "
                    "fabric-ep-python --features extension-module)")
    out = tmp_path_factory.mktemp("wheel")
    whl, log = pip_wheel(PKG_ROOT, out, clean_env(FABRIC_EP_EXTENSION=str(lib)))
    assert f"packaging FABRIC_EP_EXTENSION={lib.resolve()}" in log, log
    return whl


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory):
    """A fresh venv with only the wheel installed (numpy from this Python's numpy, through a .pth
    file: after the venv's own site-packages, so it cannot shadow the installed fabric_ep)."""
    d = tmp_path_factory.mktemp("venv")
    p = subprocess.run([sys.executable, "-m", "venv", str(d)], capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"python -m venv does not work here: {p.stderr.strip()[-300:]}")
    py = d / "bin" / "python"
    p = subprocess.run([str(py), "-m", "pip", "install", "--no-index", "--no-deps", str(wheel)],
                       env=clean_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('platlib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    numpy_dir = pathlib.Path(numpy.__file__).resolve().parent.parent
    (pathlib.Path(site) / "zz_numpy_for_test.pth").write_text(f"{numpy_dir}\n")
    return py, pathlib.Path(site)


# Runs in the venv from a folder outside the repository: which files were loaded, and a one-rank
# host Buffer's layout and dispatch against what they must be.
PROBE = textwrap.dedent("""
    import json, re, numpy as np
    import fabric_ep
    from fabric_ep import Buffer, _core
    maps = open("/proc/self/maps").read().split()
    fabric = sorted({w for w in maps if re.search(r"/libfabric[.]so[.]1([.][0-9.]+)?$", w)})
    buf = Buffer(None, num_experts=8, hidden=128, num_topk=2)
    idx = np.array([[0, 5], [7, -1], [-1, -1], [3, 2]], np.int64)
    n_rank, n_rdma, n_exp, in_rank, _ = buf.get_dispatch_layout(idx, 8)
    x = np.arange(4 * 128, dtype=np.uint16).reshape(4, 128)
    w = np.ones((4, 2), np.float32)
    rx, *_ = buf.dispatch(x, num_tokens_per_rank=n_rank, is_token_in_rank=in_rank,
                          num_tokens_per_expert=n_exp, topk_idx=idx, topk_weights=w)
    ok = bool(np.array_equal(rx, x[[0, 1, 3]]))
    ranks = buf.num_ranks
    buf.destroy()
    print(json.dumps({"package": fabric_ep.__file__, "lib": _core.__file__, "fabric": fabric,
                      "ranks": ranks, "per_rank": n_rank.tolist(),
                      "per_expert": n_exp.tolist(), "dispatch_ok": ok}))
""")


def probe(argv, cwd: pathlib.Path, **extra) -> dict:
    """Runs ``argv`` (the venv's python and PROBE, or a command that ends by running them) as a
    one-rank job in ``cwd``; PROBE's report."""
    port = free_port()
    env = clean_env(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                    MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), FEP_MASTER_PORT=str(port),
                    FEP_JOB_ID=f"wheel-{os.getpid()}-{port}",
                    FI_PROVIDER=os.environ.get("FI_PROVIDER", "shm"), **extra)
    p = subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_wheel_is_an_abi3_platform_wheel_with_the_module_and_libfabric(wheel, tmp_path):
    bundled = check_wheel(wheel, tmp_path)
    assert "libfabric.so.1" in bundled
    # The device tool carries 64 MiB: the wheel must stay well below it.
    assert wheel.stat().st_size < 32 * 2**20, wheel.stat().st_size


def test_installed_wheel_imports_outside_the_repo_with_its_own_libraries(venv, tmp_path):
    py, site = venv
    got = probe([py, "-c", PROBE], tmp_path)
    pkg = (site / "fabric_ep").resolve()
    assert pathlib.Path(got["package"]).resolve().parent == pkg, got
    assert pathlib.Path(got["lib"]).resolve() == pkg / "_core.abi3.so", got
    assert [str(pathlib.Path(f).resolve()) for f in got["fabric"]] == \
        [str(pkg / ".libs" / "libfabric.so.1")], got
    assert got["ranks"] == 1 and got["per_rank"] == [3], got
    assert got["per_expert"] == [1, 0, 1, 1, 0, 1, 0, 1], got
    assert got["dispatch_ok"], got


def system_libfabric():
    p = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True)
    m = re.search(r"libfabric\.so\.1 \(.*?\) => (\S+)", p.stdout)
    return pathlib.Path(m.group(1)) if m else None


def test_ld_library_path_picks_another_libfabric(venv, tmp_path):
    """A RUNPATH leaves LD_LIBRARY_PATH first (e.g. AWS's EFA libfabric in /opt/amazon/efa)."""
    sys_fab = system_libfabric()
    if sys_fab is None:
        pytest.skip("no system libfabric.so.1 here to pick")
    py, _ = venv
    got = probe([py, "-c", PROBE], tmp_path, LD_LIBRARY_PATH=str(sys_fab.parent))
    assert [str(pathlib.Path(f).resolve()) for f in got["fabric"]] == [str(sys_fab.resolve())], got
    assert got["dispatch_ok"], got


def test_wheel_works_where_the_system_has_no_libfabric(wheel, venv, tmp_path):
    """The target may have no libfabric: in a private mount namespace, the system's copy of
    every library the module loads but the C runtime is hidden (/dev/null bound over it);
    the import and the Buffer must still work, from the bundle alone."""
    if shutil.which("unshare") is None or subprocess.run(
            ["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.skip("no mount namespace here (unshare -m needs root)")
    # Everything the library loads here but the C runtime, found independently of the build.
    lib = debug_module()
    if not lib.is_file():
        pytest.skip(f"no built module at {lib}")
    out = subprocess.run(["ldd", str(lib)], capture_output=True, text=True, env=clean_env()).stdout
    hide = {os.path.realpath(m.group(2)) for m in re.finditer(r"^\s*(\S+) => (/\S+)", out, re.M)
            if not C_RUNTIME.match(m.group(1))}
    if not hide:
        pytest.skip(f"ldd {lib} lists no library to hide: {out}")
    py, _ = venv
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    mounts = "".join(f"mount --bind /dev/null {h} && " for h in sorted(hide))
    # The bare system libfabric must now fail (the hiding works) while the wheel loads.
    check = f"! {py} -c 'import ctypes; ctypes.CDLL(\"libfabric.so.1\")' 2>/dev/null && "
    got = probe(["unshare", "-m", "sh", "-c", f"{mounts}{check}exec {py} {script}"], tmp_path)
    pkg = (venv[1] / "fabric_ep").resolve()
    assert [str(pathlib.Path(f).resolve()) for f in got["fabric"]] == \
        [str(pkg / ".libs" / "libfabric.so.1")], got
    assert got["dispatch_ok"], got


def copy_package(dst: pathlib.Path) -> pathlib.Path:
    """ffi/python alone, as a build from an sdist sees it."""
    shutil.copytree(PKG_ROOT, dst, ignore=shutil.ignore_patterns(
        "build", "*.egg-info", "__pycache__", "tests"))
    return dst


def test_copy_without_the_repository_says_how_to_build(tmp_path):
    src = copy_package(tmp_path / "pkg")
    _, log = pip_wheel(src, tmp_path / "out", clean_env(), expect_ok=False)
    assert "FABRIC_EP_ROOT" in log and "FABRIC_EP_EXTENSION" in log, log


def test_copy_builds_with_cargo_in_fabric_ep_root(tmp_path):
    """FABRIC_EP_ROOT + the cargo path (debug profile: make test's build, so cargo has nothing to
    compile); cargo's own report names the library that is packaged."""
    if shutil.which("cargo") is None:
        pytest.skip("no cargo on PATH")
    lib = debug_module()
    src = copy_package(tmp_path / "pkg")
    # CARGO_TARGET_DIR stays, and PATH is the one make test's cargo had (when it says so):
    # cargo must find its build where it put it, and build.rs reruns on another PATH.
    env = clean_env(FABRIC_EP_ROOT=str(REPO), FABRIC_EP_CARGO_PROFILE="debug")
    if os.environ.get("CARGO_TARGET_DIR"):
        env["CARGO_TARGET_DIR"] = os.environ["CARGO_TARGET_DIR"]
    if os.environ.get("FEP_TEST_CARGO_PATH"):
        env["PATH"] = os.environ["FEP_TEST_CARGO_PATH"]
    whl, log = pip_wheel(src, tmp_path / "out", env)
    assert ("build -p fabric-ep-python --features extension-module --lib "
            "--message-format=json-render-diagnostics in " + str(REPO)) in log, log
    assert "bundled libraries" in log, log
    check_wheel(whl, tmp_path / "x")
    # The packaged file is the stripped debug build: same exported symbols (the C ABI linked
    # in, and the module's init function).
    def exports(p):
        out = subprocess.run(["nm", "-D", "--defined-only", str(p)], capture_output=True,
                             text=True, check=True).stdout
        return sorted(line.split()[-1] for line in out.splitlines()
                      if " fep_" in line or "PyInit__core" in line)
    if lib.is_file():
        got = exports(tmp_path / "x" / MODULE)
        assert "PyInit__core" in got and got == exports(lib)
