"""Notebook 04 -- DistributedDataParallel from the collectives up.

Data parallelism keeps a full replica of the model on every rank, gives each rank its own shard of the
global batch and averages the gradients with ``all_reduce`` after backward, so that every rank takes
the same optimizer step as one process on the whole batch would. The learner writes that average
(exercise 4.1), then the bucketed version DDP really uses (4.2): fewer, larger collectives.

Run as a script (torch DDP on 2 ranks against a single process on the full batch)::

    torchrun --nproc-per-node 2 -m mgpu_helpers.ddp
    python -m mgpu_helpers.ddp                                 # no torchrun: 2 ranks via run_ranks
"""
from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import textwrap
import time

import matplotlib.pyplot as plt
import torch
import torch._dynamo  # noqa: F401  DDP's first construction imports ~800 modules (1.4 s); doing it once
import torch.distributed as dist  # here, in the notebook kernel, spares every forked rank that cost.
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from .checks import REGISTRY, Check, expect, expect_close, expect_equal, run_learner_ranks
from .launch import rank_device, run_ranks, torchrun_main

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


@contextlib.contextmanager
def settled_all_reduce():
    """Within the ``with``, ``dist.all_reduce`` returns only once the backend has let go of the tensor:
    gloo's worker thread drops its reference a moment *after* all_reduce returns, so a measurement would
    see -- or not, by chance -- a buffer the program no longer holds."""
    real = dist.all_reduce

    def all_reduce(tensor, *args, **kwargs):
        held = tensor._use_count()
        out = real(tensor, *args, **kwargs)
        while tensor._use_count() > held:  # the worker thread still holds it: let it run
            time.sleep(0)
        return out

    dist.all_reduce = all_reduce
    try:
        yield
    finally:
        dist.all_reduce = real


# --- pictures of collectives ------------------------------------------------------------------------

def draw_collectives(results: dict[str, tuple[list, list]]):
    """One row per collective: each rank's tensor before (left) and after (right), one box per element.
    ``results`` maps a name to (before, after), each a list over ranks of lists of numbers."""
    fig, axes = plt.subplots(len(results), 2, figsize=(9, 1.5 * len(results) + 0.4), squeeze=False)
    values = sorted({v for b, a in results.values() for t in b + a for v in t})
    cmap = plt.get_cmap("tab20", max(len(values), 1))
    for row, (name, pair) in zip(axes, results.items()):
        for ax, tensors, when in zip(row, pair, ("before", "after")):
            for r, t in enumerate(tensors):
                for j, v in enumerate(t):  # equal values get equal colours: "the same on every rank"
                    ax.add_patch(plt.Rectangle((j, -r - 1), 0.92, 0.85, color=cmap(values.index(v)), alpha=.55))
                    ax.text(j + 0.46, -r - 0.57, f"{v:g}", ha="center", va="center", fontsize=9)
            ax.set_xlim(0, max(len(t) for t in pair[0] + pair[1]))
            ax.set_ylim(-len(tensors), 0)
            ax.set_yticks([-r - 0.57 for r in range(len(tensors))], [f"rank {r}" for r in range(len(tensors))])
            ax.set_xticks([])
            ax.set_title(f"{name}: {when}", fontsize=10)
            ax.spines[:].set_visible(False)
    fig.tight_layout()
    return fig


# --- what goes wrong when launching ranks -----------------------------------------------------------

def _errors_of(code: str) -> list[str]:
    """Run ``code`` in a fresh interpreter whose ``__main__`` cannot be imported (like a notebook's);
    return the last line of each traceback it printed, then its exit code."""
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


# --- the checks -------------------------------------------------------------------------------------

def _draw_model(rng, layers=(2, 3)):
    n = rng.randint(*layers)
    return {"widths": [rng.randint(2, 24) for _ in range(n + 1)], "bias": rng.random() < 0.7,
            "world_size": rng.choice([2, 3]), "per_rank": rng.randint(2, 5), "seed": rng.randrange(10**6)}


def _grad_bytes(case) -> list[int]:  # of each parameter's fp32 gradient, in model.parameters() order
    w = case["widths"]
    return [n for a, b in zip(w[:-1], w[1:]) for n in ([4 * a * b] + ([4 * b] if case["bias"] else []))]


def _batch(case):
    w = case["widths"]
    return make_batch(case["world_size"] * case["per_rank"], w[0], w[-1], case["seed"] + 1)


def _learner_rank(rank, world_size, fn, case):
    model = make_model(case["widths"], case["seed"], case["bias"])
    x, y = (shard(t, rank, world_size) for t in _batch(case))
    F.cross_entropy(model(x), y).backward()
    sizes, real_all_reduce = [], dist.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):  # observe every collective the learner issues
        sizes.append(tensor.numel() * tensor.element_size())
        return real_all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counting_all_reduce
    try:
        out = fn(model, case["cap"]) if "cap" in case else fn(model)
    finally:
        dist.all_reduce = real_all_reduce
    out = out if isinstance(out, int) and not isinstance(out, bool) else repr(out)[:80]  # plain data only
    return {"grads": flat_grads(model), "returned": out, "sizes": sizes}


def _reference_rank(rank, world_size, case):
    # torch DDP's gradients on this rank's shard, and one process's on the whole batch and on the shard.
    # Computed in a rank: backward in the caller would start autograd's GPU threads on a CUDA build, and
    # ranks forked after that fail ("Unable to handle autograd's threading in combination with fork").
    (x, y), args = _batch(case), (case["widths"], case["seed"], case["bias"])
    xs, ys = shard(x, rank, world_size), shard(y, rank, world_size)
    return {"ddp": _grads(DDP(make_model(*args)), xs, ys), "full": _grads(make_model(*args), x, y),
            "local": _grads(make_model(*args), xs, ys)}


def _expected_buckets(sizes: list[int], cap: int) -> list[int]:
    """Greedy packing in parameter order: start a new bucket when adding the next gradient would make
    the current one exceed ``cap``; a gradient larger than ``cap`` therefore gets a bucket of its own."""
    buckets: list[int] = []
    for n in sizes:
        if buckets and buckets[-1] + n <= cap:
            buckets[-1] += n
        else:
            buckets.append(n)
    return buckets


class _AverageCheck(Check):
    def run(self, fn, case):
        return run_learner_ranks(_learner_rank, case["world_size"], fn, case, backend="gloo", timeout=60)

    def judge(self, case, result):
        world = case["world_size"]
        refs = run_ranks(_reference_rank, world, case, backend="gloo", timeout=60)
        full = refs[0]["full"]  # one process, the whole batch: what averaging must reproduce
        expect(isinstance(result, list) and len(result) == world, f"expected one result per rank ({world})")
        for r, got in enumerate(result):
            what = f"rank {r}'s gradients after {self.function}"
            expect_close(got["grads"], full, what, rtol=1e-4, atol=1e-6, hint=self.hint, mistakes={
                "summed with all_reduce but not divided by the world size": full * world,
                "divided by the world size twice": full / world,
                self.unchanged: refs[r]["local"]})
            expect_close(got["grads"], refs[r]["ddp"], f"{what} vs torch DDP's", rtol=1e-4, atol=1e-6)


class Check41(_AverageCheck):
    id, function, points = "4.1", "average_gradients", 2
    unchanged = "gradients unchanged: averaged .data instead of .grad (or never reduced)"
    hint = "Each .grad must become (sum over ranks) / world_size: dist.all_reduce(p.grad), then divide."

    def cases(self, rng):
        return [{**_draw_model(rng), "world_size": w} for w in (2, 3, rng.choice([2, 3]))]


class Check42(_AverageCheck):
    id, function, points = "4.2", "allreduce_bucketed", 3
    unchanged = "gradients unchanged: the reduced flat buffer was never copied back into .grad"
    hint = "all_reduce each flat bucket, divide by world_size, and copy its slices back into the .grads."

    def cases(self, rng):
        out = []
        for kind in ("one bucket", "a gradient larger than the cap", "in between"):
            while True:  # redraw until the case tests what it is meant to (and bucketing saves calls)
                case = _draw_model(rng, (2, 4))
                sizes, total = _grad_bytes(case), sum(_grad_bytes(case))
                case["cap"] = {"one bucket": total + 4 * rng.randint(0, 8),
                               "a gradient larger than the cap": rng.randint(min(sizes) - 1, max(sizes) - 1),
                               "in between": rng.randint(max(sizes), total)}[kind]
                n = len(_expected_buckets(sizes, case["cap"]))
                if n < len(sizes) and (kind != "in between" or n > 1):
                    out.append(case)
                    break
        return out

    def judge(self, case, result):
        super().judge(case, result)  # the gradients first, then the collectives
        sizes = _grad_bytes(case)
        buckets = _expected_buckets(sizes, case["cap"])
        mistakes = {"one all_reduce per parameter (no bucketing)": len(sizes)}
        for r, got in enumerate(result):
            expect_equal(got["returned"], len(buckets), f"rank {r}: the number of collectives returned",
                         mistakes=mistakes, hint=f"Greedy packing of {sizes} bytes under a cap of "
                         f"{case['cap']} bytes gives buckets of {buckets} bytes.")
            if got["sizes"]:  # seen only when the learner calls dist.all_reduce (not an alias of it)
                expect_equal(len(got["sizes"]), len(buckets), f"rank {r}: the number of all_reduce calls "
                             "issued", mistakes=mistakes)
                expect_equal(got["sizes"], buckets, f"rank {r}: the bytes of each all_reduce'd bucket")


check_4_1 = REGISTRY["4.1"]
check_4_2 = REGISTRY["4.2"]


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
