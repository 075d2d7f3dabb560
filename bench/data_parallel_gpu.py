"""nn.DataParallel on real GPUs: per-GPU memory (loss on GPU 0 vs loss inside the replicas) and step times
against DDP, on the same model and global batch. Notebook 03's companion; never run by the tests.

    python bench/data_parallel_gpu.py                     # all GPUs (at most --gpus), default sizes
    python bench/data_parallel_gpu.py --gpus 2 --tokens 8192 --vocab 50304 --steps 20

Prints, per GPU, ``torch.cuda.max_memory_allocated(i)`` above what GPU i held before the step, for
DataParallel with the loss on GPU 0 and with the loss computed inside the replicas, next to what the
notebook's simulation (one thread + one MemoryTracker per simulated device, on the CPU) predicts; then
milliseconds per training step (forward, backward, SGD step) for both DataParallel variants and DDP
(one process per GPU, NCCL). On fewer than 2 GPUs it says why and exits 0 (``--force`` runs the code paths
on one GPU anyway, as a smoke test: the figures then mean nothing).
"""
import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing
from mgpu_helpers import data_parallel as dp  # noqa: E402
from mgpu_helpers.runtime.launch import run_ranks  # noqa: E402


def dp_step_time(spec, n_gpus, loss_inside, steps):
    """Milliseconds per DataParallel training step (the batch starts on the CPU, as from a DataLoader)."""
    model, x, y = dp.make_problem(**spec)
    model = model.cuda(0)
    net = nn.DataParallel(dp.LossInside(model) if loss_inside else model, device_ids=list(range(n_gpus)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step():
        loss = net(x, y, len(x)).sum() if loss_inside else F.cross_entropy(net(x), y.cuda(0, non_blocking=True))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return _time(step, steps)


def _time(step, steps):
    for _ in range(3):  # warm-up: cuBLAS handles, allocator pools, NCCL communicators
        step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / steps * 1e3


def ddp_step_time(rank, world_size, spec, steps):
    """One rank of DDP: its share of the same global batch, its own loss; ms per step (max over ranks)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    model, x, y = dp.make_problem(**spec)
    dev = torch.device("cuda", rank)
    model = model.to(dev)
    net = DDP(model, device_ids=[rank])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    xr, yr = x.chunk(world_size)[rank], y.chunk(world_size)[rank]

    def step():
        F.cross_entropy(net(xr.to(dev, non_blocking=True)), yr.to(dev, non_blocking=True)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    ms = torch.tensor([_time(step, steps)], device=dev)
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)  # a step takes as long as its slowest rank
    return {"ms": ms.item(), "peak": torch.cuda.max_memory_allocated(dev)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=4, help="use at most this many GPUs (default 4)")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--no-simulate", action="store_true", help="skip the CPU simulation (slow for big sizes)")
    ap.add_argument("--force", action="store_true", help="run on 1 GPU too (smoke test; figures meaningless)")
    a = ap.parse_args(argv)
    found = torch.cuda.device_count()
    n = min(a.gpus, found)
    if n < 2 and not (a.force and n >= 1):
        print(f"data_parallel_gpu: skipped: needs at least 2 GPUs, found {found}. nn.DataParallel has nothing "
              "to split on fewer; notebook 03's simulated devices show the same on a CPU.")
        return 0
    spec = {"tokens": a.tokens, "d_model": a.d_model, "hidden": a.hidden, "vocab": a.vocab}
    mib = 2**20
    print(f"{torch.cuda.get_device_name(0)} x {n}; torch {torch.__version__}; problem {spec}")
    print(f"logits of the whole batch {a.tokens * a.vocab * 4 / mib:.1f} MiB, "
          f"parameters {(a.d_model * a.hidden + a.hidden + a.hidden * a.vocab + a.vocab) * 4 / mib:.1f} MiB\n")

    _, x, y = dp.make_problem(**spec)
    _, ref = dp.single_device_grads(dp.make_problem(**spec)[0], x, y)
    real, sim = {}, {}
    for inside in (False, True):
        real[inside] = dp.real_data_parallel_memory(n, loss_inside=inside, spec=spec)
        same = all(torch.allclose(g, r, rtol=1e-3, atol=1e-5) for g, r in zip(real[inside]["grads"], ref))
        print(f"DataParallel, loss {'inside the replicas' if inside else 'on GPU 0'}: gradients equal one device's: {same}")
        if not a.no_simulate:
            sim[inside] = [d["peak"] for d in dp.simulate_data_parallel(*dp.make_problem(**spec), n, inside)["devices"]]
    print("\nPeak MiB above what each GPU held before the step (real: max_memory_allocated; sim: CPU tracker)")
    print(f"{'GPU':>4} {'loss on GPU 0':>14} {'(sim)':>9} {'loss inside':>12} {'(sim)':>9} {'ratio':>7}")
    for i in range(n):
        on0, ins = real[False]["peaks"][i], real[True]["peaks"][i]
        s0 = f"{sim[False][i] / mib:9.1f}" if sim and i < len(sim[False]) else f"{'-':>9}"
        s1 = f"{sim[True][i] / mib:9.1f}" if sim and i < len(sim[True]) else f"{'-':>9}"
        print(f"{i:>4} {on0 / mib:14.1f} {s0} {ins / mib:12.1f} {s1} {on0 / max(ins, 1):7.2f}")

    print(f"\nms per training step, global batch {a.tokens} tokens, {n} GPU(s), {a.steps} steps after 3 warm-up")
    t_on0 = dp_step_time(spec, n, False, a.steps)
    t_in = dp_step_time(spec, n, True, a.steps)
    ddp = run_ranks(ddp_step_time, n, spec, a.steps, backend="nccl", timeout=600)
    t_ddp = ddp[0]["ms"]
    for name, t in (("DataParallel, loss on GPU 0", t_on0), ("DataParallel, loss inside", t_in), ("DDP", t_ddp)):
        print(f"{name:>28}: {t:8.2f} ms   ({t / t_ddp:.2f}x DDP)")
    print("DDP peak per GPU (MiB, absolute): " + ", ".join(f"{r['peak'] / mib:.1f}" for r in ddp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
