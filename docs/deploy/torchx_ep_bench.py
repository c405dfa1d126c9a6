"""TorchX component: ep-bench across P5 nodes (EFA), one torchrun per node with a c10d rendezvous.

Check what it would submit (no cluster needed; the kubernetes scheduler targets Volcano, whose
queue ``-cfg queue=`` names; ``--workspace ""`` turns off TorchX's image patching, which needs a
container engine)::

    torchx run --dryrun -s kubernetes -cfg queue=default --workspace "" \\
        docs/deploy/torchx_ep_bench.py:ep_bench --image <registry>/fabric-ep:0.1.0 --nnodes 2

Drop ``--dryrun`` to submit. Every node's torchrun meets at rank 0's host (the address Volcano's
env plugin publishes, ``specs.macros.rank0_env``), port ``rdzv_port``, under the app's id; torchrun
then gives each of its ``nproc_per_node`` ep-bench processes RANK/WORLD_SIZE/MASTER_ADDR, and
fabric-ep's store listens on MASTER_PORT + 1 beside torch's.
"""

import shlex

from torchx import specs

# A p5.48xlarge has 192 vCPUs and 2 TiB; TorchX's kubernetes scheduler requests 100 millicores
# and 1 GiB less than it limits. 180 vCPUs leave the kubelet's reserve and the node's daemon
# sets (EFA and NVIDIA device plugins, CNI, kube-proxy) room to run.
P5_CPUS = 180
P5_MEM_MB = 1024 * 1024
P5_EFA_INTERFACES = 32
P5_GPUS = 8

# libfabric on EFA and NCCL's aws-ofi-nccl plugin, as in docs/deploy/pytorchjob.yaml. TorchX
# cannot request huge pages (its Resource has no field for them), so libfabric's EFA bounce
# buffers stay in normal pages here.
P5_ENV = {
    "FI_PROVIDER": "efa",
    "FI_EFA_USE_DEVICE_RDMA": "1",
    "FI_EFA_FORK_SAFE": "1",
    "FI_EFA_USE_HUGE_PAGE": "0",
    "NCCL_NET_PLUGIN": "ofi",
    "NCCL_TUNER_PLUGIN": "ofi",
    "NCCL_SOCKET_IFNAME": "^lo,docker,veth",
    "NCCL_DEBUG": "INFO",
    "FEP_TIMEOUT_S": "300",
}


def ep_bench(
    image: str,
    nnodes: int = 2,
    nproc_per_node: int = P5_GPUS,
    mode: str = "both",
    tokens: int = 4096,
    hidden: int = 7168,
    topk: int = 8,
    experts: int = 256,
    bf16: bool = False,
    rdzv_port: int = 29500,
    cpu: int = P5_CPUS,
) -> specs.AppDef:
    """ep-bench on ``nnodes`` nodes of ``nproc_per_node`` GPUs each (GPU backend, EFA).

    Args:
        image: container image with ep-bench, libfabric for EFA and NCCL (the repo's Dockerfile)
        nnodes: nodes (one torchrun each)
        nproc_per_node: ranks per node (one per GPU)
        mode: normal, low-latency or both
        tokens: tokens per rank of the normal mode
        hidden: channels per token
        topk: experts per token
        experts: experts in all
        bf16: bf16 dispatch instead of fp8
        rdzv_port: port of the c10d rendezvous on rank 0's host
        cpu: vCPUs per node (at most what a node can allocate)
    """
    if nnodes < 1 or nproc_per_node < 1:
        raise ValueError(f"nnodes ({nnodes}) and nproc_per_node ({nproc_per_node}) must be >= 1")
    if not 1 <= cpu <= P5_CPUS:
        raise ValueError(f"cpu={cpu}: a p5.48xlarge allocates at most {P5_CPUS} vCPUs to a pod")
    bench = [
        "ep-bench",
        "--backend=gpu",
        f"--mode={mode}",
        "--provider=efa",
        f"--ranks-per-node={nproc_per_node}",
        f"--tokens={tokens}",
        f"--hidden={hidden}",
        f"--topk={topk}",
        f"--experts={experts}",
        "--json=-",
    ] + (["--bf16"] if bf16 else [])
    torchrun = [
        "torchrun",
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-id={specs.macros.app_id}",
        "--max-restarts=0",
    ]
    # The endpoint is expanded by the pod's shell: rank 0's host comes from an environment
    # variable the scheduler sets (rank 0 itself gets "localhost").
    endpoint = f"--rdzv-endpoint=$${{{specs.macros.rank0_env}:=localhost}}:{rdzv_port}"
    script = " ".join(
        [shlex.quote(a) for a in torchrun] + [endpoint, "--no-python"] + [shlex.quote(a) for a in bench]
    )
    return specs.AppDef(
        name="fabric-ep-bench",
        roles=[
            specs.Role(
                # No hyphen: the role name becomes part of the rank-0 host variable's name.
                name="worker",
                image=image,
                entrypoint="bash",
                args=["-c", script],
                num_replicas=nnodes,
                resource=specs.Resource(
                    cpu=cpu,
                    gpu=nproc_per_node,
                    memMB=P5_MEM_MB,
                    devices={"vpc.amazonaws.com/efa": P5_EFA_INTERFACES},
                    capabilities={"node.kubernetes.io/instance-type": "p5.48xlarge"},
                ),
                port_map={"c10d": rdzv_port},
                env=dict(P5_ENV),
                max_retries=0,
            )
        ],
    )
