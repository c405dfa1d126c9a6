# Can NCCL put two ranks on one GPU? (two processes, same device, all_to_all_single)
import os, sys, torch, torch.distributed as dist, torch.multiprocessing as mp
def w(r, n):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29555")
    torch.cuda.set_device(0)
    try:
        dist.init_process_group("nccl", rank=r, world_size=n, device_id=torch.device("cuda:0"))
        x = torch.full((1 << 20,), float(r), device="cuda"); y = torch.empty_like(x)
        dist.all_to_all_single(y, x); torch.cuda.synchronize()
        print(f"NCCL_PROBE rank {r}/{n}: ok {y[0].item()} {y[-1].item()}", flush=True)
    except Exception as e:
        print(f"NCCL_PROBE rank {r}/{n}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
if __name__ == "__main__":
    mp.spawn(w, args=(2,), nprocs=2)
