"""Notebook 04 -- DistributedDataParallel from the collectives up.

Data parallelism keeps a full replica of the model on every rank, gives each rank its own shard of the
global batch and averages the gradients with ``all_reduce`` after backward, so that every rank takes
the same optimizer step as one process on the whole batch would. The learner writes that average
(exercise 4.1), then the bucketed version DDP really uses (4.2): fewer, larger collectives. Their checks
are in ``checks.ddp``.

Run as a script (torch DDP on 2 ranks against a single process on the full batch)::

    torchrun --nproc-per-node 2 -m mgpu_helpers.ddp
    python -m mgpu_helpers.ddp                                 # no torchrun: 2 ranks via run_ranks
"""
from __future__ import annotations

import os

import torch
import torch._dynamo  # noqa: F401  DDP's first construction imports ~800 modules (1.4 s); doing it once
import torch.distributed as dist  # here, in the notebook kernel, spares every forked rank that cost.
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from .ddp_demos import draw_collectives, fork_after_cuda, settled_all_reduce, spawn_from_notebook  # noqa: F401
from .runtime.launch import rank_device, run_ranks, torchrun_main

# --- models and data: the same on every rank, from a seed ------------------------------------------

def make_model(widths: list[int], seed: int = 0, bias: bool = True) -> nn.Sequential:
    """Linear → ReLU → … → Linear, initialised from ``seed`` (so every rank builds the same replica)."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers += ([nn.ReLU()] if i else []) + [nn.Linear(a, b, bias=bias)]
    return nn.Sequential(*layers)


def make_batch(n: int, d_in: int, classes: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch: ``n`` inputs and class labels."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d_in, generator=g), torch.randint(0, classes, (n,), generator=g)


def shard(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous, equal share of the global batch (its first dimension)."""
    per = t.shape[0] // world_size
    return t[rank * per:(rank + 1) * per]


def flat_grads(model: nn.Module) -> torch.Tensor:
    """Every parameter's gradient in one vector (zeros where a gradient is missing)."""
    return torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).detach().reshape(-1)
                      for p in model.parameters()])


def _grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()  # mean over the batch, as every rank of DDP computes it
    return flat_grads(model)


# --- the script: torch DDP against one process on the full batch ------------------------------------

def _demo(rank: int, world_size: int) -> str:
    widths, per_rank = [32, 64, 64, 10], 8
    x, y = make_batch(per_rank * world_size, widths[0], widths[-1])
    dev = rank_device()
    model = DDP(make_model(widths).to(dev), device_ids=[dev.index] if dev.type == "cuda" else None)
    got = _grads(model, shard(x, rank, world_size).to(dev), shard(y, rank, world_size).to(dev)).cpu()
    full = _grads(make_model(widths), x, y)  # every rank can compute the single-process reference
    same = torch.tensor([float(torch.allclose(got, full, rtol=1e-4, atol=1e-6))], device=dev)
    dist.all_reduce(same, op=dist.ReduceOp.MIN)  # true only if it holds on every rank
    return (f"DDP on {world_size} ranks ({dist.get_backend()}): averaged gradients of "
            f"{sum(p.numel() for p in model.parameters())} parameters equal one process on the full batch "
            f"of {x.shape[0]}: {bool(same.item())} (rank {rank}: max |diff| {(got - full).abs().max():.1e})")


if __name__ == "__main__":
    if "RANK" in os.environ:
        torchrun_main(_demo)
    else:
        print(run_ranks(_demo, 2)[0])
