"""Notebook 04 -- DistributedDataParallel from the collectives up: the learner averages gradients with
``all_reduce`` (exercise 4.1), then in buckets as DDP does (4.2; checks in ``checks.ddp``). Here: the batch's
shards, collectives drawn, and the launch traps (``mp.spawn`` from a notebook, fork after CUDA). The script,
torch DDP on 2 ranks against one process on the full batch::

    torchrun --nproc-per-node 2 -m mgpu_helpers.ddp
    python -m mgpu_helpers.ddp                                 # no torchrun: 2 ranks via run_ranks
"""
import os
import re
import subprocess
import sys
import textwrap

import matplotlib.pyplot as plt
import torch
import torch._dynamo  # noqa: F401  DDP's first construction imports ~800 modules (1.4 s); doing it once
import torch.distributed as dist  # here, in the notebook kernel, spares every forked rank that cost.
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from .accumulation import flat_grads
from .memory import make_batch, mlp
from .runtime.launch import rank_device, run_ranks, script_args, torchrun_main


def shard(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous, equal share of the global batch (its first dimension)."""
    per = t.shape[0] // world_size
    return t[rank * per:(rank + 1) * per]


def _grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()  # mean over the batch, as every rank of DDP computes it
    return flat_grads(model)


def draw_collectives(results: dict[str, tuple[list, list]]):
    """Per collective (``results``: name -> (before, after), lists over ranks of numbers), each rank's values
    coloured by the rank they come from, or grey when computed from every rank (the name says "reduce")."""
    n_ranks = max(len(b) for b, _ in results.values())
    colours = [plt.get_cmap("tab10")(r) for r in range(n_ranks)]
    combined = "#B0B0B0"
    fig, axes = plt.subplots(len(results), 2, figsize=(9, 1.5 * len(results) + 0.9), squeeze=False)
    for row, (name, (before, after)) in zip(axes, results.items()):
        for ax, tensors, when in zip(row, (before, after), ("before", "after")):
            for r, t in enumerate(tensors):
                for j, v in enumerate(t):  # after a copy: the colour of the rank whose tensor held v
                    colour = colours[r] if when == "before" else combined if "reduce" in name else next(
                        (colours[s] for s, src in enumerate(before) if v in src), combined)
                    ax.add_patch(plt.Rectangle((j, -r - 1), 0.92, 0.85, color=colour, alpha=.55))
                    ax.text(j + 0.46, -r - 0.57, f"{v:g}", ha="center", va="center", fontsize=9)
            ax.set_xlim(0, max(len(t) for t in before + after))
            ax.set_ylim(-len(tensors), 0)
            ax.set_yticks([-r - 0.57 for r in range(len(tensors))], [f"rank {r}" for r in range(len(tensors))])
            ax.set_xticks([])
            ax.set_title(f"{name}: {when}", fontsize=10)
            ax.spines[:].set_visible(False)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c, alpha=.55) for c in colours + [combined]]
    fig.legend(handles, [f"rank {r}'s data" for r in range(n_ranks)] + ["computed from every rank (a reduction)"],
               loc="lower center", ncol=n_ranks + 1, frameon=False, fontsize=9)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


def _errors_of(code: str) -> list[str]:
    """Each traceback's last line from ``code`` run in a fresh interpreter (``__main__`` unimportable), exit code."""
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    lines = [line for line in p.stderr.splitlines() if re.match(r"[\w.]+(Error|Exception): ", line)]
    return [re.sub(r"<module '__main__' \(.*\)>", "<module '__main__'>", x) for x in lines] + [  # as 3.11 .. 3.13
        f"exit code {p.returncode}"]


def spawn_from_notebook() -> list[str]:
    """``torch.multiprocessing.spawn`` of a function defined in ``__main__``: the child's error, the parent's."""
    return _errors_of("""
        import torch.multiprocessing as mp
        def work(rank):                         # defined in __main__, which the child cannot import
            print("rank", rank, "ran")
        mp.spawn(work, nprocs=1)
    """)


def fork_after_cuda() -> list[str]:
    """(GPU only) Fork a child after CUDA is initialised in the parent: the child's error."""
    return _errors_of("""
        import multiprocessing as mp, torch
        torch.zeros(1, device="cuda")           # the parent initialises CUDA...
        def child():
            torch.zeros(1, device="cuda")       # ...and a forked child cannot
        p = mp.get_context("fork").Process(target=child); p.start(); p.join()
        raise SystemExit(p.exitcode)
    """)


def _demo(rank: int, world_size: int) -> str:
    widths, per_rank = [32, 64, 64, 10], 8
    x, y = make_batch(per_rank * world_size, widths[0], widths[-1])
    dev = rank_device()
    model = DDP(mlp(widths), device_ids=[dev.index] if dev.type == "cuda" else None)
    got = _grads(model, shard(x, rank, world_size), shard(y, rank, world_size))
    full = _grads(mlp(widths), x, y)  # every rank can compute the single-process reference
    same = torch.tensor([float(torch.allclose(got, full, rtol=1e-4, atol=1e-6))], device=dev)
    dist.all_reduce(same, op=dist.ReduceOp.MIN)  # true only if it holds on every rank
    return (f"DDP on {world_size} ranks ({dist.get_backend()}): averaged gradients of "
            f"{sum(p.numel() for p in model.parameters())} parameters equal one process on the full batch "
            f"of {x.shape[0]}: {bool(same.item())} (rank {rank}: max |diff| {(got - full).abs().max():.1e})")


if __name__ == "__main__":
    script_args(__doc__)
    torchrun_main(_demo) if "RANK" in os.environ else print(run_ranks(_demo, 2)[0])
