"""TorchX component for a multi-node ep-bench run on P5 (EFA).

Usage: torchx run -s kubernetes docs/deploy/torchx_ep_bench.py:ep_bench --nnodes 2 --image <img>
"""

from torchx import specs


def ep_bench(
    image: str,
    nnodes: int = 2,
    nproc_per_node: int = 8,
    mode: str = "both",
    tokens: int = 4096,
    hidden: int = 7168,
    fp8: bool = True,
) -> specs.AppDef:
    args = [
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc_per_node}",
        "--no-python",
        "ep-bench",
        f"--mode={mode}",
        "--backend=gpu",
        "--provider=efa",
        f"--ranks-per-node={nproc_per_node}",
        f"--tokens={tokens}",
        f"--hidden={hidden}",
    ] + (["--fp8"] if fp8 else [])
    return specs.AppDef(
        name="fabric-ep-bench",
        roles=[
            specs.Role(
                name="ep-bench",
                image=image,
                entrypoint="torchrun",
                args=args,
                num_replicas=nnodes,
                resource=specs.Resource(
                    cpu=192,
                    gpu=nproc_per_node,
                    memMB=512 * 1024,
                    devices={"vpc.amazonaws.com/efa": 32},
                ),
                env={
                    "FI_PROVIDER": "efa",
                    "FI_EFA_USE_DEVICE_RDMA": "1",
                    "FI_EFA_FORK_SAFE": "1",
                },
            )
        ],
    )
