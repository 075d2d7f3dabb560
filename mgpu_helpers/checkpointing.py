"""Notebook 07 -- activation checkpointing (Chen et al. 2016): L blocks in checkpointed segments of k keep
(L/k)·s + k·a bytes of activations, least near k = sqrt(L·s/a). ``predict_peak`` is byte-exact against
:class:`MemoryTracker` on a CPU for any plan; ``selective_context`` saves the matmuls and recomputes the rest.
The check of 7.1 is in ``checks.checkpointing``.
"""
import functools
import timeit
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint, checkpoint_sequential,
                                    create_selective_checkpoint_contexts, noop_context_fn)

from .memory import make_batch
from .runtime.tracker import MemoryTracker

F32 = 4


class Block(nn.Module):
    """``x + down(relu(up(x)))``; ``transformer=True``: ``x + down(gelu(up(norm(x))))``, a transformer's MLP
    half. ``dropout`` > 0: on the branch, whose mask a recomputation must draw again identically (check 7.1)."""

    def __init__(self, d: int, h: int, transformer: bool = False, dropout: float = 0.0):
        super().__init__()
        self.norm = nn.LayerNorm(d) if transformer else nn.Identity()
        self.up, self.down = nn.Linear(d, h), nn.Linear(h, d)
        self.act = F.gelu if transformer else torch.relu
        self.drop = nn.Dropout(dropout) if dropout else nn.Identity()  # Identity allocates nothing

    def forward(self, x):
        return x + self.drop(self.down(self.act(self.up(self.norm(x)))))


class Stack(nn.Module):
    """``blocks`` (an nn.ModuleList of L :class:`Block`) followed by a classifier ``head``."""

    def __init__(self, layers: int, d: int, h: int, classes: int, seed: int = 0, transformer: bool = False,
                 dropout: float = 0.0):
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = nn.ModuleList(Block(d, h, transformer, dropout) for _ in range(layers))
        self.head = nn.Linear(d, classes)


def segments(layers: int, k: int) -> list[tuple[int, int]]:
    """[(start, stop), ...]: consecutive runs of k blocks, the last one shorter when k does not divide L."""
    if not isinstance(k, int) or isinstance(k, bool):
        raise TypeError(f"k must be an int, got {type(k).__name__}")
    if not 1 <= k <= layers:
        raise ValueError(f"k={k}: segments need 1 <= k <= the number of blocks ({layers})")
    return [(i, min(i + k, layers)) for i in range(0, layers, k)]


def no_checkpointing(blocks, x, k=None):
    for block in blocks:
        x = block(x)
    return x


def torch_segments(blocks, x, k: int):
    """torch's ``checkpoint_sequential`` with ceil(L/k) segments (its plan: :func:`sequential_plan`)."""
    return checkpoint_sequential(blocks, -(-len(blocks) // k), x, use_reentrant=False)


def per_block(blocks, x, k=None, context_fn=noop_context_fn):
    """Every block checkpointed on its own (as torchtitan does); ``context_fn``: e.g. :func:`selective_context`."""
    for block in blocks:
        x = checkpoint(block, x, use_reentrant=False, context_fn=context_fn)
    return x


class OpLog(TorchDispatchMode):
    """The aten ops that run while active (views and detaches left out): which forward ops backward re-runs."""

    QUIET = {"detach", "t", "view", "expand", "ones_like", "_to_copy", "alias"}

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in self.QUIET:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


# aten ops as the policy sees them: nn.Linear reaches it as addmm (or mm without a bias), never as
# aten.linear, which decomposes before dispatch (``policy_ops`` shows what a block sends it).
MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


def save_matmuls(ctx, op, *args, **kwargs):
    """Policy: keep every matmul's output, recompute everything else (pointwise ops, norms)."""
    return CheckpointPolicy.MUST_SAVE if op in MATMULS else CheckpointPolicy.PREFER_RECOMPUTE


selective_context = functools.partial(create_selective_checkpoint_contexts, save_matmuls)


def policy_ops(block, x) -> list[str]:
    """The ops a selective-checkpointing policy is asked about in ``block``'s forward, in order."""
    seen: list[str] = []

    def recording(ctx, op, *args, **kwargs):
        if not ctx.is_recompute:
            seen.append(op.__name__)
        return save_matmuls(ctx, op, *args, **kwargs)

    checkpoint(block, x, use_reentrant=False,
               context_fn=functools.partial(create_selective_checkpoint_contexts, recording))
    return seen


def recomputed_ops(model: Stack, x, y, forward, k=None) -> dict[str, int]:
    """Counts of forward ops run again in backward (backward's own are never addmm, layer_norm, gelu or relu)."""
    model.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model.head(forward(model.blocks, x, k)), y)
    with OpLog() as log:
        loss.backward()
    return dict(Counter(op for op in log.ops if op in ("addmm", "relu", "gelu", "native_layer_norm")))


def sequential_plan(layers: int, k: int) -> list[tuple[int, bool]]:
    """The plan :func:`torch_segments` runs: n = ceil(L/k) segments of floor(L/n) blocks, the last unchecked."""
    n = -(-layers // k)
    return [(layers // n, True)] * (n - 1) + [(layers - layers // n * (n - 1), False)]


def plan_for(layers: int, k: int | None) -> list[tuple[int, bool]]:
    """[(blocks in the segment, checkpointed?), ...]: k=None means no checkpointing."""
    return [(1, False)] * layers if k is None else [(b - a, True) for a, b in segments(layers, k)]


def predict_peak(plan, d: int, h: int, classes: int, batch: int) -> int:
    """Peak bytes (``max_memory_allocated`` semantics; x and y made before) of one fp32 step
    ``cross_entropy(head(stack(x)), y).backward()`` of ``Stack(L, d, h, classes)`` on a CPU.

    While backward is in segment j (last to first), alive are: the parameters; the gradients of the head
    and of every later block; what every earlier segment kept (checkpointed: its input, s bytes; plain: its
    saved tensors, a bytes a block); segment j's saved tensors (recomputed if checkpointed), n_j · a; and
    backward's temporaries. The peak is the largest sum, just after segment j's last ``down`` got its gradients.
    """
    s = F32 * batch * d                       # one residual tensor: a segment boundary
    a = F32 * batch * (d + h)                 # what one block saves: up's input x and relu's output
    g = F32 * (2 * d * h + d + h)             # one block's parameters (= its gradients)
    head = F32 * (d * classes + classes)
    params = sum(n for n, _ in plan) * g + head  # the head's gradients are alive from its backward on
    temps = s + 2 * F32 * batch * h + 2 * F32  # dL/d(out), dL/d(relu), dL/du; the loss and its grad
    down_grads = F32 * (h * d + d)
    return max(params + head + sum(m for m, _ in plan[j + 1:]) * g + down_grads
               + sum(s if ck else m * a for m, ck in plan[:j]) + n * a - s + temps  # - s: x existed before
               for j, (n, _) in enumerate(plan))


def measure_step(model: Stack, x, y, forward, k=None):
    """One forward + backward under MemoryTracker: (peak bytes, gradients by parameter name)."""
    model.zero_grad(set_to_none=True)
    with MemoryTracker(model) as mt:
        out = model.head(forward(model.blocks, x, k))
        loss = F.cross_entropy(out, y)
        del out  # the logits are not needed once the loss exists (cross_entropy keeps what it needs)
        mt.mark("backward")
        loss.backward()
    return mt.peak_bytes, {n: p.grad for n, p in model.named_parameters()}


def time_step(model: Stack, x, y, forward, k=None, repeat=3) -> float:
    """Best of ``repeat`` wall times of the same step, without the tracker (it slows every op)."""
    def step():
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model.head(forward(model.blocks, x, k)), y).backward()

    return min(timeit.repeat(step, number=1, repeat=repeat))


def sweep(layers=16, d=32, h=64, classes=8, batch=1024, forward=None, repeat=3, progress=None):
    """Per k (None: none): peak measured and predicted, matmuls recomputed, time; ``forward`` (else torch's)."""
    model, (x, y) = Stack(layers, d, h, classes), make_batch(batch, d, classes)
    rows = {}
    for k in [None, *range(1, layers + 1)]:
        fwd = no_checkpointing if k is None else (forward or torch_segments)
        plan = plan_for(layers, k) if k is None or forward else sequential_plan(layers, k)
        rows[k] = {"peak": measure_step(model, x, y, fwd, k)[0],
                   "predicted": predict_peak(plan, d, h, classes, batch),
                   "recomputed": recomputed_ops(model, x, y, fwd, k).get("addmm", 0),
                   "seconds": time_step(model, x, y, fwd, k, repeat), "repeat": repeat}
        if progress is not None:
            progress.update(1)
    return rows


def selective_vs_full(layers=8, d=128, h=512, classes=8, batch=512, repeat=3):
    """Transformer-like MLP blocks, one checkpointed segment per block: none vs selective vs full."""
    model, (x, y) = Stack(layers, d, h, classes, transformer=True), make_batch(batch, d, classes)
    variants = {"no checkpointing": (no_checkpointing, None),
                "selective (save matmuls)": (functools.partial(per_block, context_fn=selective_context), 1),
                "full checkpointing": (per_block, 1)}
    out = {}
    for name, (fwd, k) in variants.items():
        peak, grads = measure_step(model, x, y, fwd, k)
        out[name] = {"peak": peak, "grads": grads, "recomputed": recomputed_ops(model, x, y, fwd, k),
                     "seconds": time_step(model, x, y, fwd, k, repeat)}
    return out


def plot_sweep(rows, layers, passed=None, optimum=None):
    """Peak memory (measured, predicted, optima marked) and step time (and the op counts' figure) against k."""
    import matplotlib.pyplot as plt

    ks = [k for k in rows if k is not None]
    MiB = 2**20
    fig, (am, at) = plt.subplots(1, 2, figsize=(11, 4))
    am.plot(ks, [rows[k]["peak"] / MiB for k in ks], "o-", label="measured (MemoryTracker)")
    am.plot(ks, [rows[k]["predicted"] / MiB for k in ks], "x", ms=9, label="predicted (predict_peak)")
    am.axhline(rows[None]["peak"] / MiB, color="gray", ls="--", label="no checkpointing")
    best = min(ks, key=lambda k: rows[k]["peak"])
    am.plot([best], [rows[best]["peak"] / MiB], "*", ms=16, color="C3", label=f"measured optimum k={best}")
    am.axvline(layers ** 0.5, color="C2", ls=":", label=f"√L = {layers ** 0.5:.2f}")
    if optimum is not None:
        am.axvline(optimum, color="C3", ls="--", lw=0.8, label=f"√(L·s/a) = {optimum:.2f}")
    am.set(ylabel="peak memory (MiB)", title="Peak of one forward + backward" + (
        "" if passed is None else f" (your 7.1: {passed})"))
    at.plot(ks, [1e3 * rows[k]["seconds"] for k in ks], "o-", color="C1", label="checkpointed")
    at.axhline(1e3 * rows[None]["seconds"], color="gray", ls="--", label="no checkpointing")
    at.plot(ks, [1e3 * rows[None]["seconds"] * op_count_ratio(rows[k]["recomputed"], layers) for k in ks], "x:",
            color="k", label="from the op counts (matmuls only)")
    at.set(ylabel=f"step time (ms, best of {rows[None].get('repeat', 3)})", title="Time of one forward + backward")
    for ax in (am, at):
        ax.set(xlabel="k (blocks per checkpointed segment)", xticks=ks, ylim=(0, None))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def op_count_ratio(recomputed: int, layers: int) -> float:
    """Step time relative to no checkpointing if matmuls were all the time: forward runs 2L, backward 4L
    (input and weight gradients), checkpointing ``recomputed`` more."""
    return (6 * layers + recomputed) / (6 * layers)
