"""Notebook 00 -- the environment report (``python -m mgpu_helpers.environment``) and how ranks run from a
notebook; under torchrun the script checks that every rank can reach the others::

    torchrun --nproc-per-node 2 -m mgpu_helpers.environment
"""
import os
import platform

import torch
import torch.distributed as dist


def environment() -> dict[str, object]:
    """What this machine offers the course: versions, devices, backends, cores."""
    cuda = torch.cuda.is_available()
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda available": cuda,
        "gpus": torch.cuda.device_count() if cuda else 0,
        "gpu names": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
        "gloo available": dist.is_available() and dist.is_gloo_available(),
        "nccl available": dist.is_available() and dist.is_nccl_available(),
        "cpu cores": os.cpu_count(),
        "torch threads": torch.get_num_threads(),
        "platform": f"{platform.system()} {platform.machine()}",
    }


def print_environment() -> None:
    env = environment()
    width = max(map(len, env))
    for k, v in env.items():
        print(f"{k:<{width}}  {v}")
    if env["gpus"] >= 2:
        print(f"→ distributed exercises use NCCL, one process per GPU (up to {env['gpus']} ranks)")
    elif env["gpus"] == 1:
        print("→ one GPU: memory is measured on it; distributed exercises run their ranks over gloo on CPU")
    else:
        print("→ no GPU: every exercise runs on the CPU; ranks are processes talking over gloo")


def hello(rank: int, world_size: int) -> str:
    """Each rank contributes rank+1; after all_reduce(SUM) every rank holds 1+2+…+world_size."""
    from .runtime.launch import rank_device

    t = torch.tensor([float(rank + 1)], device=rank_device())
    dist.all_reduce(t)
    return f"rank {rank}/{world_size}: sum = {t.item():.0f}"


if __name__ == "__main__":
    from .runtime.launch import script_args, torchrun_main

    script_args(__doc__)
    torchrun_main(hello) if "RANK" in os.environ else print_environment()
