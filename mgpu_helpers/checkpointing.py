"""Notebook 07 -- activation checkpointing: keep a few tensors, recompute the rest in backward.

A stack of L residual blocks, split into **segments of k consecutive blocks** (blocks 0..k-1, k..2k-1, ...;
the last segment is shorter when k does not divide L), each segment run under
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: forward keeps only each segment's input
(one residual tensor, ``s`` bytes); backward recomputes one segment at a time, so at most k blocks'
activations (``a`` bytes each) are alive at once. Activation memory ~ (L/k)·s + k·a, smallest near
k = sqrt(L·s/a): the sqrt(L) rule (Chen et al. 2016, "Training deep nets with sublinear memory cost").

``predict_peak`` gives the exact peak of one forward + backward of :class:`Stack` for any plan of
checkpointed segments and plain blocks, byte for byte what :class:`MemoryTracker` measures on a CPU
(tests/test_checkpointing.py proves it over random shapes). ``checkpoint_every`` is the reference of
exercise 7.1; ``selective_context`` is torch's selective checkpointing with a "save the matmuls,
recompute the pointwise ops" policy. Nothing here is distributed: every figure is one process's.
"""
from __future__ import annotations

import functools
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointError, CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from torch.utils._python_dispatch import TorchDispatchMode

from .checks import Check, REGISTRY, describe_value, expect, expect_close, expect_equal, expect_type
from .tracker import MemoryTracker

F32 = 4


class Block(nn.Module):
    """Residual MLP block ``x + down(relu(up(x)))``; ``transformer=True``: pre-norm with GELU,
    ``x + down(gelu(up(norm(x))))``, the MLP half of a transformer layer."""

    def __init__(self, d: int, h: int, transformer: bool = False):
        super().__init__()
        self.norm = nn.LayerNorm(d) if transformer else nn.Identity()
        self.up, self.down = nn.Linear(d, h), nn.Linear(h, d)
        self.act = F.gelu if transformer else torch.relu

    def forward(self, x):
        return x + self.down(self.act(self.up(self.norm(x))))


class Stack(nn.Module):
    """``blocks`` (an nn.ModuleList of L :class:`Block`) followed by a classifier ``head``."""

    def __init__(self, layers: int, d: int, h: int, classes: int, seed: int = 0, transformer: bool = False):
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = nn.ModuleList(Block(d, h, transformer) for _ in range(layers))
        self.head = nn.Linear(d, classes)


def make_data(batch: int, d: int, classes: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)  # its own generator: the global RNG stays untouched
    return torch.randn(batch, d, generator=g), torch.randint(0, classes, (batch,), generator=g)


# --- the plan: which blocks are checkpointed together ---------------------------------------------------

def segments(layers: int, k: int) -> list[tuple[int, int]]:
    """[(start, stop), ...]: consecutive runs of k blocks, the last one shorter when k does not divide L."""
    if not isinstance(k, int) or isinstance(k, bool):
        raise TypeError(f"k must be an int, got {type(k).__name__}")
    if not 1 <= k <= layers:
        raise ValueError(f"k={k}: segments need 1 <= k <= the number of blocks ({layers})")
    return [(i, min(i + k, layers)) for i in range(0, layers, k)]


def _run(blocks, x):
    for block in blocks:
        x = block(x)
    return x


def checkpoint_every(blocks, x, k: int, context_fn=None):
    """Reference of exercise 7.1: each segment of k blocks under non-reentrant checkpointing.
    ``context_fn``: e.g. :func:`selective_context` for selective checkpointing."""
    for start, stop in segments(len(blocks), k):
        extra = {} if context_fn is None else {"context_fn": context_fn}
        # The segment's input is passed as an argument: it is what checkpoint keeps and recomputes from.
        x = checkpoint(_run, blocks[start:stop], x, use_reentrant=False, **extra)
    return x


def no_checkpointing(blocks, x, k=None):
    return _run(blocks, x)


def run_plan(blocks, x, plan):
    """Run a plan of :func:`plan_for`'s form: [(blocks in the segment, checkpointed?), ...]."""
    start = 0
    for n, ck in plan:
        seg = blocks[start:start + n]
        x = checkpoint(_run, seg, x, use_reentrant=False) if ck else _run(seg, x)
        start += n
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


# --- selective checkpointing: save what is expensive to recompute ----------------------------------------

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
    """Forward ops run again during backward (their counts, from the op log): what checkpointing pays in
    compute, deterministic where wall times are not. Gradient ops never include addmm, layer_norm, gelu
    or relu, so those counted in backward are recomputations."""
    model.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model.head(forward(model.blocks, x, k)), y)
    with OpLog() as log:
        loss.backward()
    counts: dict[str, int] = {}
    for op in log.ops:
        if op in ("addmm", "relu", "gelu", "native_layer_norm"):
            counts[op] = counts.get(op, 0) + 1
    return counts


# --- prediction: the exact peak of one forward + backward of Stack ----------------------------------------

def plan_for(layers: int, k: int | None) -> list[tuple[int, bool]]:
    """[(blocks in the segment, checkpointed?), ...]: k=None means no checkpointing."""
    if k is None:
        return [(1, False)] * layers
    return [(stop - start, True) for start, stop in segments(layers, k)]


def predict_peak(plan, d: int, h: int, classes: int, batch: int) -> int:
    """Peak bytes (``max_memory_allocated`` semantics, input and targets made before) of
    ``cross_entropy(head(stack(x)), y).backward()`` with ``Stack(L, d, h, classes)``, fp32, on a CPU.

    Backward visits the segments last to first. While segment j is being backpropagated, alive are:
    the parameters; the gradients of every later block (and of the head); what every *earlier* segment
    kept (a checkpointed segment: its input, s bytes; a plain block: its saved tensors, a bytes); segment
    j's own saved tensors, recomputed if it is checkpointed (n_j blocks · a); and backward's temporaries.
    The peak is the largest of these sums, reached in segment j's last block, just after its ``down``
    layer got its gradients. The input x existed before the step, so it is not counted (- s).
    """
    s = F32 * batch * d                       # one residual tensor: a segment boundary
    a = F32 * batch * (d + h)                 # what one block saves: up's input x and relu's output
    g = F32 * (2 * d * h + d + h)             # one block's parameters (= its gradients)
    head = F32 * (d * classes + classes)
    params = sum(n for n, _ in plan) * g + head  # the head's gradients are alive from its backward on
    temps = s + 2 * F32 * batch * h + 2 * F32  # dL/d(out), dL/d(relu), dL/du; the loss and its grad
    down_grads = F32 * (h * d + d)
    best = None
    for j, (n, _) in enumerate(plan):
        later = sum(m for m, _ in plan[j + 1:]) * g
        earlier = sum(s if ck else m * a for m, ck in plan[:j])
        here = params + head + later + down_grads + earlier + n * a - s + temps
        best = here if best is None else max(best, here)
    return best


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
    best = float("inf")
    for _ in range(repeat):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        F.cross_entropy(model.head(forward(model.blocks, x, k)), y).backward()
        best = min(best, time.perf_counter() - t0)
    return best


def sweep(layers=16, d=32, h=64, classes=8, batch=1024, ks=None, forward=None, repeat=3, progress=None):
    """Peak (measured and predicted), matmuls recomputed in backward (op log) and step time for no
    checkpointing and every k; ``forward`` (the learner's function, same signature as
    :func:`checkpoint_every`) replaces the reference."""
    model, (x, y) = Stack(layers, d, h, classes), make_data(batch, d, classes)
    rows = {}
    for k in [None] + list(ks or range(1, layers + 1)):
        fwd = no_checkpointing if k is None else (forward or checkpoint_every)
        rows[k] = {"peak": measure_step(model, x, y, fwd, k)[0],
                   "predicted": predict_peak(plan_for(layers, k), d, h, classes, batch),
                   "recomputed": recomputed_ops(model, x, y, fwd, k).get("addmm", 0),
                   "seconds": time_step(model, x, y, fwd, k, repeat), "repeat": repeat}
        if progress is not None:
            progress.update(1)
    return rows


def selective_vs_full(layers=8, d=128, h=512, classes=8, batch=512, repeat=3):
    """Transformer-like MLP blocks, one checkpointed segment per block: none vs selective vs full."""
    model, (x, y) = Stack(layers, d, h, classes, transformer=True), make_data(batch, d, classes)
    variants = {"no checkpointing": (no_checkpointing, None),
                "selective (save matmuls)": (functools.partial(checkpoint_every, context_fn=selective_context), 1),
                "full checkpointing": (checkpoint_every, 1)}
    out = {}
    for name, (fwd, k) in variants.items():
        peak, grads = measure_step(model, x, y, fwd, k)
        out[name] = {"peak": peak, "grads": grads, "recomputed": recomputed_ops(model, x, y, fwd, k),
                     "seconds": time_step(model, x, y, fwd, k, repeat)}
    return out


def plot_sweep(rows, layers, ax_mem=None, passed=None, optimum=None):
    """Peak memory (measured, predicted) and step time against k, no checkpointing as a line; on the
    memory panel the measured optimum, sqrt(L) and ``optimum`` (sqrt(L·s/a), the formula's) marked; on the
    time panel what the op counts predict if matmuls were all the time."""
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
    for ax in (am, at):
        ax.set_xlabel("k (blocks per checkpointed segment)")
        ax.set_xticks(ks)
        ax.grid(alpha=0.3)
    am.set(ylabel="peak memory (MiB)", ylim=(0, None),
           title="Peak of one forward + backward" + ("" if passed is None else f" (your 7.1: {passed})"))
    at.plot(ks, [1e3 * rows[k]["seconds"] for k in ks], "o-", color="C1", label="checkpointed")
    at.axhline(1e3 * rows[None]["seconds"], color="gray", ls="--", label="no checkpointing")
    at.plot(ks, [1e3 * rows[None]["seconds"] * op_count_ratio(rows[k]["recomputed"], layers) for k in ks], "x:",
            color="k", label="from the op counts (matmuls only)")
    at.set(ylabel=f"step time (ms, best of {rows[None].get('repeat', 3)})", ylim=(0, None),
           title="Time of one forward + backward")
    am.legend(fontsize=8)
    at.legend(fontsize=8)
    fig.tight_layout()
    return fig


def op_count_ratio(recomputed: int, layers: int) -> float:
    """Step time relative to no checkpointing if the blocks' matmuls were all the time: forward runs 2L
    of them, backward twice as many (input and weight gradients), and checkpointing adds ``recomputed``."""
    return (6 * layers + recomputed) / (6 * layers)


# --- exercise 7.1 --------------------------------------------------------------------------------------

def _case(rng, layers, k, seed=None):
    d = rng.choice([8, 16])
    # activations dominate (batch >= 16·d): the regime checkpointing is for, where predict_peak is exact
    return {"layers": layers, "k": k, "d": d, "h": rng.choice([2, 3, 4]) * d, "classes": rng.randint(2, 8),
            "batch": rng.choice([16, 32]) * d, "seed": rng.randrange(2**31) if seed is None else seed}


def _mistake_plans(L, k):
    plans = {"checkpointed every block on its own, whatever k (segments of 1 block)": plan_for(L, 1),
             "no checkpointing at all": plan_for(L, None),
             "checkpointed only the blocks i with i % k == 0, each on its own: that saves L/k blocks' "
             "activations and keeps the rest, not the sqrt(L) trade-off": [(1, i % k == 0) for i in range(L)]}
    if k < L:
        plans["one segment for the whole stack (as if k = L): backward recomputes every block at once"] = \
            plan_for(L, L)
        plans["segments of k + 1 blocks (off by one)"] = plan_for(L, k + 1)
    if k > 1:
        plans["segments of k - 1 blocks (off by one)"] = plan_for(L, k - 1)
    if k < L:
        plans["block 0 left out (segments started at block 1)"] = [(1, False)] + [
            (stop - start, True) for start, stop in segments(L - 1, min(k, L - 1))]
    return plans


def _ptr(args) -> int:
    return args[0].untyped_storage().data_ptr() if args and isinstance(args[0], torch.Tensor) else -1


def _stale(recomputed: list) -> str:
    """Name what the blocks re-run in backward show ([block, got its forward input?] in order), or ""."""
    blocks = [b for b, _ in recomputed]
    if len(set(blocks)) < len(blocks):  # a block re-run twice: every recomputation ran the same segment
        return ("it matches a common mistake: the recomputation ran the wrong blocks (block "
                f"{max(set(blocks), key=blocks.count)} again and again): the checkpointed function reads loop "
                "variables (start, the slice of blocks, perhaps x) instead of receiving them as arguments, and by "
                "backward time they hold the last segment's values. Hint: pass the segment and its input: "
                "checkpoint(run_segment, blocks[start:start + k], x, use_reentrant=False).")
    starts = [same for j, (b, same) in enumerate(recomputed) if j == 0 or recomputed[j - 1][0] != b - 1]
    if not all(starts):
        return ("it matches a common mistake: the segment's input was not passed to checkpoint as an argument, so "
                "the function reads the loop's x -- at backward time it holds its final value and the "
                "recomputation runs on the wrong input. Hint: checkpoint(function, *its inputs, use_reentrant=False).")
    return ""


class CheckpointEvery(Check):
    id, function = "7.1", "checkpoint_segments"

    def cases(self, rng):
        fixed = [_case(rng, 8, 3), _case(rng, 6, 1), _case(rng, 5, 5), _case(rng, 9, 2)]
        random_ = [_case(rng, L, rng.randint(2, L - 1)) for L in (rng.randint(4, 12), rng.randint(4, 12))]
        bad = [dict(_case(rng, 4, 0), bad=True), dict(_case(rng, 5, 6), bad=True)]
        cases = fixed + random_
        rng.shuffle(cases)
        return cases + bad

    def describe(self, case):
        return (f"{case['layers']} blocks, k={case['k']}, batch {case['batch']}, d={case['d']}, h={case['h']}")

    def run(self, fn, case):
        model = Stack(case["layers"], case["d"], case["h"], case["classes"], seed=case["seed"])
        x, y = make_data(case["batch"], case["d"], case["classes"], seed=case["seed"])
        if case.get("bad"):
            try:
                fn(model.blocks, x, case["k"])
            except ValueError as e:
                return {"raised": "ValueError", "message": str(e)}
            except Exception as e:  # noqa: BLE001 - the judge names what was raised instead
                return {"raised": type(e).__name__, "message": str(e)}
            return {"raised": None}
        # Which blocks backward re-runs, and whether each gets the input it had in forward (the same
        # storage: checkpoint keeps the segment's input): names reading loop variables inside the
        # checkpointed function. Storage addresses only -- nothing is allocated, the peak is untouched.
        phase, first_input, recomputed = ["forward"], {}, []
        def seen(i, args):  # returns None: a pre-hook's return value would replace the block's input
            if phase[0] == "forward":
                first_input.setdefault(i, _ptr(args))
            else:
                recomputed.append([i, _ptr(args) == first_input.get(i)])

        for i, b in enumerate(model.blocks):
            b.register_forward_pre_hook(lambda m, args, i=i: seen(i, args))
        with MemoryTracker(model) as mt:
            out = fn(model.blocks, x, case["k"])
            if not isinstance(out, torch.Tensor):
                return {"output": describe_value(out)}
            loss = F.cross_entropy(model.head(out), y)
            del out
            phase[0] = "backward"
            try:
                loss.backward()
            except CheckpointError as e:  # torch compared the recomputation with the forward: they differ
                return {"checkpoint_error": str(e).split("\n\n")[0][:400], "recomputed": recomputed}
        return {"peak": mt.peak_bytes, "grads": [p.grad for p in model.parameters()], "recomputed": recomputed}

    def judge(self, case, result):
        L, k = case["layers"], case["k"]
        expect_type(result, dict, self.function, "a dict (internal)")
        if case.get("bad"):
            expect(result.get("raised") == "ValueError",
                   f"k={k} with {L} blocks must raise ValueError (k goes from 1 to the number of blocks); "
                   + ("your function returned normally" if result.get("raised") is None
                      else f"it raised {result['raised']}: {result.get('message', '')}"))
            return
        expect("output" not in result, f"{self.function} returned {result.get('output')}; expected the output "
               "tensor of the last block (batch × d).")
        if "checkpoint_error" in result:
            expect(False, "backward raised torch's CheckpointError (the recomputation did not match the forward): "
                   f"{result['checkpoint_error']}\n  " + (_stale(result.get("recomputed") or []) or
                   "Hint: checkpoint(function, *its inputs, use_reentrant=False), with everything the function "
                   "uses passed as an argument."))
        model = Stack(L, case["d"], case["h"], case["classes"], seed=case["seed"])
        x, y = make_data(case["batch"], case["d"], case["classes"], seed=case["seed"])
        F.cross_entropy(model.head(no_checkpointing(model.blocks, x)), y).backward()
        names = [n for n, _ in model.named_parameters()]
        grads = result["grads"]
        expect(len(grads) == len(names), f"got {len(grads)} gradients for {len(names)} parameters")
        missing = sorted({int(n.split(".")[1]) for n, g in zip(names, grads) if g is None and n.startswith("blocks")})
        if missing == list(range(L)):
            expect(False, "no block got a gradient (only the head did): it matches a common mistake: "
                   "use_reentrant=True with an input that does not require grad -- the reentrant variant then "
                   "returns an output that needs no gradient, so backward never reaches the blocks. "
                   "Hint: use_reentrant=False.")
        if missing:
            tail = missing == list(range(missing[0], L))
            expect(False, f"blocks {missing} got no gradient" + (
                ": it matches a common mistake: the last, shorter segment was never run (k does not divide "
                "the number of blocks)" if tail else "") + ". Hint: every block runs, in order, exactly once.")
        flat = torch.cat([g.flatten() for g in grads])
        ref = torch.cat([p.grad.flatten() for p in model.parameters()])
        if not torch.allclose(flat, ref, rtol=1e-4, atol=1e-6):
            expect(not _stale(result.get("recomputed") or []), "the gradients differ from the same step without "
                   "checkpointing: " + _stale(result.get("recomputed") or []))
        expect_close(flat, ref, "the gradients (compared with the same step without checkpointing)", hint="Hint: pass each segment's blocks and input to checkpoint as arguments; "
                     "non-reentrant checkpointing gives gradients equal to the plain step.", rtol=1e-4, atol=1e-6)
        shape = (case["d"], case["h"], case["classes"], case["batch"])
        expected = predict_peak(plan_for(L, k), *shape)
        mistakes = {name: predict_peak(plan, *shape) for name, plan in _mistake_plans(L, k).items()}
        expect_equal(result["peak"], expected, "the peak bytes of the step, measured with MemoryTracker",
                     mistakes={n: v for n, v in mistakes.items() if v != expected},
                     hint=f"(The expected value is predict_peak for segments of {k}.) Hint: segments are blocks "
                          f"0..{k - 1}, {k}..{2 * k - 1}, ... (the last may be shorter), each one checkpointed.")


check_7_1 = REGISTRY["7.1"]
