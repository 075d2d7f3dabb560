"""Notebook 08 -- torch's versions on one model: ``ZeroRedundancyOptimizer`` (ZeRO-1) and FSDP2 ``fully_shard``
(ZeRO-3), per-rank memory of a steady step against :func:`model_state_bytes`, and the ways "FSDP did not save
memory" happens. The script: ``sharding/__main__.py``.
"""
import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from ..runtime.fake_world import fake_world
from ..memory import make_batch, mlp
from ..runtime.launch import rank_device
from ..runtime.plots import stacked_bars, unit_for
from ..runtime.tracker import MemoryTracker
from .zero import Zero2, linears, model_state_bytes

STAGE = {"DDP (DistributedDataParallel)": 0, "ZeRO-1 (ZeroRedundancyOptimizer)": 1, "ZeRO-2 (Zero2)": 2,
         "FSDP2 per block + root": 3, "FSDP2 root only": 3}
# "buckets": with DDP's default gradient_as_bucket_view=False (torch/nn/parallel/distributed.py) the reducer
# allocates flat buckets at construction and copies the gradients in: a second copy, alive with the model.
MODEL_STATE = ("parameters", "gradients", "optimizer_state", "buckets")


def build(method: str, widths, seed=0, lr=1e-3, reduce_scatter_fn=None):
    """(model, optimizer to track, step function) for ``method`` on this rank (a key of ``STAGE``)."""
    dev = rank_device()
    model = mlp(widths, seed=seed).to(dev)
    if method.startswith("FSDP2"):
        mesh = init_device_mesh(dev.type, (dist.get_world_size(),))
        if "per block" in method:
            for lin in linears(model)[:-1]:  # each Linear its own group; the root keeps the last one
                fully_shard(lin, mesh=mesh)
        fully_shard(model, mesh=mesh)
    if method.startswith("ZeRO-2"):
        zero = Zero2(model, torch.optim.Adam, reduce_scatter_fn, lr=lr, foreach=True)
        return model, zero.optimizer, zero.step
    if method.startswith(("DDP", "ZeRO-1")):  # ZeroRedundancyOptimizer is used over DDP: DDP all-reduces
        # init_sync=False: the ranks built the same weights, and gloo's worker would free the initial broadcast's
        # copy whenever it likes, inside this count
        with MemoryTracker() as mt:  # what the constructor allocates and keeps: the buckets (``bucket_bytes``)
            model = DDP(model, init_sync=False)
        model.bucket_bytes = mt.current_bytes
        if dist.get_backend() == "fake":  # its all-reduce's future holds no tensor, which DDP's reducer asserts:
            model.register_comm_hook(None, noop_hook)  # the bucket back untouched, as an in-place all-reduce would
    if method.startswith("ZeRO-1"):
        zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=lr, foreach=True)
        return model, zero.optim, zero.step
    opt = torch.optim.Adam(model.parameters(), lr=lr, foreach=True)  # foreach: CUDA's default, everywhere
    return model, opt, opt.step


def measure(rank, world_size, methods, widths, per_rank=8, seed=0, reduce_scatter_fn=None):
    """This rank's memory in a steady step of ``methods`` (a key of ``STAGE``, or a list); ``naive_param_bytes``
    counts a DTensor's *global* size: the miscount that makes FSDP2 seem to "save nothing"."""
    if not isinstance(methods, str):
        return {m: measure(rank, world_size, m, widths, per_rank, seed, reduce_scatter_fn) for m in methods}
    model, opt, step = build(methods, widths, seed, reduce_scatter_fn=reduce_scatter_fn)
    x, y = make_batch(per_rank * world_size, widths[0], widths[-1], seed + 1)
    x, y = (t.tensor_split(world_size)[rank].to(rank_device()) for t in (x, y))

    def train_step():
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        step()

    buckets = getattr(model, "bucket_bytes", 0)
    for _ in range(2 if buckets else 1):  # warm-up: Adam makes its state in the first step; DDP rebuilds
        train_step()                      # its buckets (same bytes, in backward's order) in the second forward
    with MemoryTracker(model, opt) as mt:  # it sees what it can claim (parameters, optimizer state) and what
        train_step()                       # is allocated inside: DDP's buckets, made earlier, are added
        mt.mark("end")
    state, at_peak = mt.breakdown(), mt.peak_breakdown()
    at_peak["other"] += buckets
    return {"n_params": sum(p.numel() for p in mlp(widths, seed=seed).parameters()),
            "state": {**{c: state[c] for c in MODEL_STATE[:3]}, "buckets": buckets},
            "peak": mt.peak_bytes + buckets, "peak_breakdown": at_peak,
            "naive_param_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}


def trains_like_one_process(rank, world_size, method, widths, steps=3, per_rank=4, seed=0,
                            reduce_scatter_fn=None) -> float:
    """Max |difference| of this rank's parameters after ``steps`` of ``method`` from one process's Adam."""
    model, _, step = build(method, widths, seed, lr=1e-2, reduce_scatter_fn=reduce_scatter_fn)
    ref = mlp(widths, seed=seed)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2, foreach=True)
    x, y = make_batch(per_rank * world_size, widths[0], widths[-1], seed + 1)
    xs, ys = (t.tensor_split(world_size)[rank].to(rank_device()) for t in (x, y))
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(xs), ys).backward()
        step()
        ref_opt.zero_grad(set_to_none=True)
        F.cross_entropy(ref(x), y).backward()
        ref_opt.step()
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]  # FSDP2: DTensors
    return max((a.detach().cpu() - b.detach().cpu()).abs().max().item() for a, b in zip(full, ref.parameters()))


def sweep(world_sizes, methods, widths, per_rank=8, reduce_scatter_fn=None) -> dict:
    """``{method: {world_size: rank 0's measure()}}``, each world size simulated with :func:`fake_world`."""
    out: dict = {}
    for w in world_sizes:
        with fake_world(w):
            for m, r in measure(0, w, methods, widths, per_rank, 0, reduce_scatter_fn).items():
                out.setdefault(m, {})[w] = r
    return out


def formula(n_params: int, method: str, world_size: int) -> dict[str, int]:
    """ZeRO's accounting (fp32 Adam) for ``method`` in the tracker's categories, plus DDP's "buckets" (stages
    0 and 1 run under DDP: one more copy of the gradients, not in the paper's)."""
    f = model_state_bytes(n_params, zero_stage=STAGE[method], world_size=world_size, precision="fp32")
    return {"parameters": f["parameters"], "gradients": f["gradients"], "optimizer_state": f["optimizer"],
            "buckets": f["gradients"] if STAGE[method] <= 1 else 0}


def plot_per_rank(results: dict, world_sizes, title="Per-rank model state after a training step"):
    """Stacked bars of ``results[method][world_size]`` (rank 0's :func:`measure`), the formula as a black tick."""
    methods, cells = list(results), [(m, w) for w in world_sizes for m in results]
    bars = {f"{methods.index(m) + 1}\n{w} rank{'s' * (w > 1)}":  # DDP's buckets drawn as "other"
            {"other" if c == "buckets" else c: v for c, v in results[m][w]["state"].items()} for m, w in cells}
    ax = stacked_bars(bars, title + "\n" + ", ".join(f"{j + 1}: {m}" for j, m in enumerate(methods)),
                      plt.subplots(figsize=(10, 4.2))[1], xlabel="other: DDP's gradient buckets")
    ax.title.set_fontsize(10)
    div = unit_for(max(sum(b.values()) for b in bars.values()))[0]
    for i, (m, w) in enumerate(cells):
        f = sum(formula(results[m][w]["n_params"], m, w).values()) / div
        ax.plot([i - 0.4, i + 0.4], [f, f], "k-", lw=2, label="formula" if i == 0 else None)
    ax.legend(fontsize=8, frameon=False, loc="upper right")
    return ax.figure


def plot_peaks(rows: dict, world_sizes, title: str, ax=None):
    """Peak bytes per rank vs world size, one line per method (``rows[method][world_size]`` = bytes)."""
    ax = ax or plt.subplots(figsize=(6, 4))[1]
    div, unit = unit_for(max(v for r in rows.values() for v in r.values()))
    for m, r in rows.items():
        ax.plot(world_sizes, [r[w] / div for w in world_sizes], "o-", label=m)
    ax.set(xticks=list(world_sizes), xlabel="ranks", ylabel=f"peak per rank ({unit})", ylim=(0, None), title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, frameon=False)
    return ax


def _demo(rank, world_size):
    """The script: FSDP2 and ZeroRedundancyOptimizer train like one process; rank 0's bytes vs the formula."""
    widths, lines = [32, 128, 128, 128, 10], []
    for m in ("ZeRO-1 (ZeroRedundancyOptimizer)", "FSDP2 per block + root"):
        diff = torch.tensor([trains_like_one_process(rank, world_size, m, widths)], device=rank_device())
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)
        r = measure(rank, world_size, m, widths)
        got, want = sum(r["state"].values()), sum(formula(r["n_params"], m, world_size).values())
        lines.append(f"{m} on {world_size} ranks ({dist.get_backend()}): 3 Adam steps "
                     f"{'equal' if diff.item() < 1e-4 else 'DIFFER from'} one process (max |diff| {diff.item():.1e} "
                     f"over ranks); rank {rank} holds {got} bytes of model state, the formula {want} "
                     f"({got / want:.3f}x)")
    return "\n".join(lines)
