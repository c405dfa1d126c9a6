"""Lints the deployment files: the EKS manifest parses and asks for what an EFA run needs; the
TorchX component compiles."""

import pathlib
import py_compile

import yaml

DEPLOY = pathlib.Path(__file__).resolve().parents[2] / "docs" / "deploy"


def test_pytorchjob_manifest_has_efa_resources():
    docs = list(yaml.safe_load_all((DEPLOY / "eks-ep-bench-pytorchjob.yaml").read_text()))
    assert len(docs) == 1
    job = docs[0]
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "PyTorchJob"
    pod = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    c = pod["containers"][0]
    limits = c["resources"]["limits"]
    assert limits["vpc.amazonaws.com/efa"] == 32
    assert limits["nvidia.com/gpu"] == 8
    assert "hugepages-2Mi" in limits
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["FI_PROVIDER"] == "efa" and env["FI_EFA_FORK_SAFE"] == "1"
    assert any(m["mountPath"] == "/dev/shm" for m in c["volumeMounts"])
    shm = [v for v in pod["volumes"] if v["name"] == "dshm"][0]
    assert shm["emptyDir"]["medium"] == "Memory"
    assert c["command"] == ["torchrun"] and "ep-bench" in c["args"]


def test_torchx_component_compiles():
    py_compile.compile(str(DEPLOY / "torchx_ep_bench.py"), doraise=True)
