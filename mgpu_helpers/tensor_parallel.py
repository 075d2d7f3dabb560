"""Notebook 09, part 2 -- tensor parallelism: one layer's weights split across ranks (exercise 9.2).

The Megatron-LM MLP: fc1 is *column-parallel* (rank r keeps rows r·h/N … of W1 and b1, i.e. a slice of the
hidden features), fc2 is *row-parallel* (rank r keeps the matching columns of W2), so that each rank's
``relu(x W1_rᵀ + b1_r) W2_rᵀ`` is a partial sum of the output and ONE ``all_reduce`` completes it; fc2's bias
is added once, after the sum. In backward the same happens mirrored: the gradient reaching x is a partial
sum on each rank, so the operator that copied x into the parallel region all-reduces in backward. Megatron
calls the two operators f (identity forward, all_reduce backward) and g (all_reduce forward, identity
backward). ``TensorParallelMLP`` is the reference; ``torch_tensor_parallel`` is the same with
``torch.distributed.tensor.parallel``.
"""
from __future__ import annotations

import torch
import torch._dynamo  # noqa: F401  parallelize_module imports it: 1 s in every forked rank, once here instead
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn import functional as F

from .checks import REGISTRY, CheckFailure, expect, expect_close, expect_equal, run_learner_ranks
from .checks.remember import RemembersVerdict
from .runtime.tracker import MemoryTracker


class DenseMLP(nn.Module):
    """fc1: Linear(d, h) → ReLU → fc2: Linear(h, d) (weights as nn.Linear keeps them: out × in)."""

    def __init__(self, d: int, h: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def make_mlp(d: int, h: int, seed: int = 0) -> DenseMLP:
    torch.manual_seed(seed)
    return DenseMLP(d, h)


class CopyToParallel(torch.autograd.Function):
    """Megatron's f: forward passes x through; backward sums the partial gradients of x over the ranks."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()  # never reduce a buffer autograd may hand to someone else too
        dist.all_reduce(grad)
        return grad


class ReduceFromParallel(torch.autograd.Function):
    """Megatron's g: forward sums the partial outputs over the ranks; backward passes the gradient through
    (each rank's partial output contributed with weight 1 to the sum)."""

    @staticmethod
    def forward(ctx, partial):
        total = partial.clone()
        dist.all_reduce(total)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad


def _check_split(h: int, world_size: int) -> int:
    if world_size < 1 or h % world_size:
        raise ValueError(f"hidden size {h} is not divisible by world_size={world_size}: tensor parallelism "
                         "gives every rank an equal slice of the hidden features")
    return h // world_size


class TensorParallelMLP(nn.Module):
    """Rank ``rank``'s share of ``dense`` (a DenseMLP): fc1 column-parallel, fc2 row-parallel; fc2's bias
    whole on every rank. Shards are copies: a slice of ``dense``'s weights would keep all of it alive."""

    def __init__(self, dense: DenseMLP, rank: int, world_size: int):
        super().__init__()
        d, h = dense.fc1.in_features, dense.fc1.out_features
        part = _check_split(h, world_size)
        rows = slice(rank * part, (rank + 1) * part)
        dev = dense.fc1.weight.device
        self.fc1, self.fc2 = nn.Linear(d, part, device=dev), nn.Linear(part, d, device=dev)
        with torch.no_grad():
            self.fc1.weight.copy_(dense.fc1.weight[rows])
            self.fc1.bias.copy_(dense.fc1.bias[rows])
            self.fc2.weight.copy_(dense.fc2.weight[:, rows])
            self.fc2.bias.copy_(dense.fc2.bias)

    def forward(self, x):
        x = CopyToParallel.apply(x)
        partial = F.linear(torch.relu(self.fc1(x)), self.fc2.weight)  # this rank's share of the output
        return ReduceFromParallel.apply(partial) + self.fc2.bias   # bias once, after the sum


def param_bytes(module) -> int:
    """Parameter bytes of ``module`` as the tracker counts them (whole storages: a view costs its base)."""
    with MemoryTracker(module) as mt:
        pass
    return mt.breakdown()["parameters"]


def parameter_bytes_formula(d: int, h: int, world_size: int, element_size: int = 4) -> int:
    """Per-rank parameter bytes of the tensor-parallel MLP: W1, b1, W2 split N ways, b2 whole."""
    return element_size * (2 * d * h // world_size + h // world_size + d)


def torch_tensor_parallel(dense: DenseMLP, device_type: str = "cpu"):
    """The same split with torch's DTensor tensor parallelism, on a 1-D mesh over every rank: fc1
    ColwiseParallel, fc2 RowwiseParallel. Parallelizes ``dense`` in place and returns it."""
    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    return parallelize_module(dense, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})


class AllReduceCounter:
    """``with AllReduceCounter() as c:`` counts ``dist.all_reduce`` calls made from Python (c.calls)."""

    def __enter__(self):
        self.calls, self._real = 0, dist.all_reduce

        def counting(*args, **kwargs):
            self.calls += 1
            return self._real(*args, **kwargs)

        dist.all_reduce = counting
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self._real


# --- check 9.2: the tensor-parallel MLP --------------------------------------------------------------

# torch's words for the two places learners stick, and what to do (added to the error the rank raised)
_HINTS = {"a leaf Variable that requires grad is being used in an in-place operation":
          "copying the shards into the new module's parameters (param.copy_(...)) is an in-place op on a leaf "
          "that requires grad: do it under `with torch.no_grad():`",
          "modified by an inplace operation":
          "dist.all_reduce works in place: inside the autograd.Function, all-reduce a clone (total = "
          "partial.clone(); dist.all_reduce(total)), never a tensor autograd saved"}


def _hinted(e: Exception) -> str:
    text = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return text + "".join(f" -- Hint: {h}" for k, h in _HINTS.items() if k in str(e))


def _tp_rank(rank, world, fn, case):
    dense = make_mlp(case["d"], case["h"], case["seed"])
    try:
        mod = fn(dense, rank, world)
    except ValueError as e:
        return {"raised": f"ValueError: {e}"}
    except RuntimeError as e:
        if any(k in str(e) for k in _HINTS):
            raise RuntimeError(_hinted(e).split(": ", 1)[1]) from e
        raise
    del dense  # what the rank's module keeps alive is what it costs
    shapes = {name: tuple(q.shape) for name, q in mod.named_parameters()}
    out = {"shapes": shapes, "param_bytes": param_bytes(mod)}
    g = torch.Generator().manual_seed(case["seed"] + 1)
    x = torch.randn(case["batch"], case["d"], generator=g).requires_grad_()
    gy = torch.randn(case["batch"], case["d"], generator=g)
    try:  # a wrong split fails here: the judge names it from the shapes first
        with AllReduceCounter() as forward:
            y = mod(x)
        with AllReduceCounter() as backward:
            (y * gy).sum().backward()
    except RuntimeError as e:
        return {**out, "error": _hinted(e)}
    return {**out, "y": y.detach(), "x_grad": x.grad, "forward_calls": forward.calls, "backward_calls": backward.calls,
            "grads": {name: q.grad for name, q in mod.named_parameters()}}


def _dense_reference(case):
    dense = make_mlp(case["d"], case["h"], case["seed"])
    g = torch.Generator().manual_seed(case["seed"] + 1)
    x = torch.randn(case["batch"], case["d"], generator=g).requires_grad_()
    gy = torch.randn(case["batch"], case["d"], generator=g)
    y = dense(x)
    (y * gy).sum().backward()
    return dense, x, gy, y.detach()


def _partial(dense, x, gy, rank, world):
    """Rank ``rank``'s partial output (bias excluded) and partial input gradient."""
    part = dense.fc1.out_features // world
    rows = slice(rank * part, (rank + 1) * part)
    xr, w1, b1, w2 = (t.detach() for t in (x, dense.fc1.weight, dense.fc1.bias, dense.fc2.weight))
    xr.requires_grad_()  # the dense MLP's own .grad stays the reference
    out = torch.relu(xr @ w1[rows].T + b1[rows]) @ w2[:, rows].T
    (out * gy).sum().backward()
    return out.detach(), xr.grad


class ParallelMLPCheck(RemembersVerdict):
    id, function, points = "9.2", "parallel_mlp", 3

    def cases(self, rng):
        def case(n, bad=False):
            d = n * rng.randint(max(1, 3 // n), max(1, 12 // n))  # a multiple of n: a wrong split shows
            h = n * rng.randint(2, 6) + (rng.randint(1, n - 1) if bad else 0)
            return {"world_size": n, "d": d, "h": h, "batch": rng.randint(2, 6), "seed": rng.randrange(2**31)}
        return [case(3, bad=True), case(2), case(4), case(1), case(3)]  # the first: h not divisible by 3

    def describe(self, case):
        return f"{case['world_size']} rank(s), d={case['d']}, h={case['h']}, batch {case['batch']}"

    def run(self, fn, case):
        return run_learner_ranks(_tp_rank, case["world_size"], fn, case, backend="gloo", timeout=15)

    def judge(self, case, result):
        n, d, h = case["world_size"], case["d"], case["h"]
        expect(isinstance(result, list) and len(result) == n, f"expected one result per rank ({n})")
        raised = [r.get("raised") for r in result]
        if h % n:
            expect(all(raised), f"h={h} is not divisible by world_size={n}: every rank must raise ValueError "
                   f"(naming the hidden size), but {sum(not r for r in raised)} rank(s) returned a module")
            return
        expect(not any(raised), f"a rank raised {next(filter(None, raised), '')} although {n} divides h={h}")
        part = h // n
        want = {"fc1.weight": (part, d), "fc1.bias": (part,), "fc2.weight": (d, part), "fc2.bias": (d,)}
        wrong = {"fc1.weight": {"split W1 along dim 1 (its inputs): column-parallel fc1 splits its output "
                                "features, dim 0 of nn.Linear's weight": (h, d // n), "W1 not split": (h, d)},
                 "fc1.bias": {"b1 not split with W1's rows": (h,)},
                 "fc2.weight": {"split W2 along dim 0 (its outputs): row-parallel fc2 splits its input features, "
                                "dim 1 of nn.Linear's weight": (d // n, h), "W2 not split": (d, h)},
                 "fc2.bias": {"b2 split: it is added once, after the all_reduce, so every rank keeps all of it":
                              (d // n,)}}
        for r, res in enumerate(result):
            expect_equal(sorted(res["shapes"]), sorted(want), f"rank {r}: the module's parameter names",
                         hint="Keep exactly fc1 and fc2 (nn.Linear) with this rank's shards; no copy of the dense MLP.")
            for name, shape in want.items():
                expect_equal(res["shapes"][name], shape, f"rank {r}: {name}'s shape", mistakes=wrong[name])
        for r, res in enumerate(result):
            expect("error" not in res, f"rank {r}'s forward or backward raised {res.get('error')}")
        dense, x, gy, y = _dense_reference(case)
        full, formula = parameter_bytes_formula(d, h, 1), parameter_bytes_formula(d, h, n)
        shard = {"W1": 4 * d * part, "b1": 4 * part, "W2": 4 * d * part}  # a view costs its whole tensor: N×
        views = {formula + sum((n - 1) * shard[k] for k in ks) for ks in
                 (("W1",), ("b1",), ("W2",), ("W1", "b1"), ("W1", "W2"), ("b1", "W2"), ("W1", "b1", "W2"))} - {formula}
        fwd, bwd = [res["forward_calls"] for res in result], [res["backward_calls"] for res in result]
        for calls, when in ((fwd, "forward"), (bwd, "backward")):
            if sum(fwd + bwd) and len(set(calls)) > 1:  # seen only when the learner calls dist.all_reduce
                raise CheckFailure(f"ranks disagree in {when}: " + ", ".join(
                    f"rank {r} made {c} all_reduce calls" for r, c in enumerate(calls)))
        for r, res in enumerate(result):
            partial_y, partial_xg = _partial(dense, x, gy, r, n)
            expect_close(res["y"], y, f"rank {r}'s output", rtol=1e-4, atol=1e-5, mistakes={
                f"fc2's bias added on every rank before the all_reduce: counted {n} times": y + (n - 1) * dense.fc2.bias,
                "no all_reduce in forward: this rank's output is only its partial sum": partial_y + dense.fc2.bias,
                "no all_reduce in forward, and the bias left out": partial_y})
            expect_close(res["x_grad"], x.grad, f"rank {r}'s gradient of the input x", rtol=1e-4, atol=1e-5, mistakes={
                "no all_reduce in backward (f): x's gradient is only this rank's partial sum": partial_xg,
                "g's backward all-reduces too (a differentiable all_reduce as g): gradients N× too large": n * x.grad},
                hint="Hint: f = identity forward, all_reduce backward; g = all_reduce forward, identity backward.")
            rows = slice(r * part, (r + 1) * part)
            for name, ref in (("fc1.weight", dense.fc1.weight.grad[rows]), ("fc1.bias", dense.fc1.bias.grad[rows]),
                              ("fc2.weight", dense.fc2.weight.grad[:, rows]), ("fc2.bias", dense.fc2.bias.grad)):
                expect_close(res["grads"][name], ref, f"rank {r}'s {name}.grad", rtol=1e-4, atol=1e-5, mistakes={
                    "g's backward all-reduces too (a differentiable all_reduce as g): gradients N× too large": n * ref})
            got = res["param_bytes"]
            expect(got not in views, f"rank {r}: parameter bytes (tracker) are {got}, expected {formula}: it matches "
                   "a common mistake: shards that are views of the dense weights (sliced without .clone()): a view "
                   "keeps its whole tensor alive, so the rank still holds all of it")
            expect_equal(got, formula, f"rank {r}: parameter bytes (tracker)",
                         hint=f"1/{n} of W1, b1, W2 plus the whole b2: {formula} bytes of {full}.")
        if sum(fwd + bwd):
            expect_equal(fwd[0], 1, "all_reduce calls per rank in forward (g)")
            expect_equal(bwd[0], 1, "all_reduce calls per rank in backward (f)")


check_9_2 = REGISTRY["9.2"]
