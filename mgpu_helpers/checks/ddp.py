"""Checks of notebook 04: 4.1 average gradients with all_reduce, 4.2 bucketed all_reduce; against the mean
of each rank's own gradients (what torch DDP computes), in one process."""

import itertools
from collections import OrderedDict

import torch
from torch import nn
from torch.nn import functional as F

from ..memory import make_batch, mlp
from ..runtime.launch import rank_device, run_ranks
from .base import (Check, CheckFailure, CollectiveLedger, collective_mismatch, expect, expect_close,
                   expect_equal, expect_type, plain)


class _SkipsUnused(nn.Sequential):
    def forward(self, x):  # the module named "unused" gets no input, so its parameters get no .grad
        for name, m in self.named_children():
            x = x if name == "unused" else m(x)
        return x


def _model(case) -> nn.Module:
    layers = list(mlp(case["widths"], seed=case["seed"], bias=case["bias"]).named_children())
    if case.get("unused"):  # between two layers, so a bucket has to skip it
        layers.insert(2, ("unused", nn.Linear(3, 2, bias=case["bias"])))
    return _SkipsUnused(OrderedDict(layers)).to(rank_device())


def _draw_model(rng, layers=(2, 3), world_size=2, uneven=False, unused=False):
    n, w = rng.randint(*layers), world_size
    rows = [rng.randint(2, 5) for _ in range(w)]
    while uneven and len(set(rows)) == 1:
        rows = [rng.randint(1, 6) for _ in range(w)]
    return {"widths": [rng.randint(2, 24) for _ in range(n + 1)], "bias": rng.random() < 0.7 or unused,
            "world_size": w, "rows": rows, "unused": unused, "seed": rng.randrange(10**6)}


def _grad_bytes(case) -> list[int]:  # of each used parameter's fp32 gradient, in model.parameters() order
    w = case["widths"]
    return [n for a, b in zip(w[:-1], w[1:]) for n in ([4 * a * b] + ([4 * b] if case["bias"] else []))]


def _shard(case, rank):
    w, rows = case["widths"], case["rows"]
    return tuple(t.split(rows)[rank] for t in make_batch(sum(rows), w[0], w[-1], case["seed"] + 1))


def _named_grads(model) -> dict:  # CPU copies: what a rank hands back to the kernel
    return {n: None if p.grad is None else p.grad.detach().cpu().clone() for n, p in model.named_parameters()}


def _backward(case, rank) -> nn.Module:
    """The model after backward of the mean loss over this rank's shard: the rank's own gradients."""
    model, (x, y) = _model(case), _shard(case, rank)
    F.cross_entropy(model(x), y).backward()
    return model


def _learner_rank(rank, world_size, fn, case):
    model = _backward(case, rank)
    ledger = CollectiveLedger()
    with ledger.watching():  # records every dist.all_reduce/broadcast/barrier; stops ranks that diverge
        out = fn(model, case["cap"]) if "cap" in case else fn(model)
    return {"grads": _named_grads(model), "returned": plain(out), "calls": ledger.calls,
            "mismatch": ledger.finish()}


def _references(case) -> list[dict]:
    """Each rank's own gradients. Computed in a rank of its own where there are GPUs: a backward pass in
    this process would start autograd's GPU threads on a CUDA build, and ranks forked after that fail."""
    local = lambda _, __, c: [_named_grads(_backward(c, r)) for r in range(c["world_size"])]  # noqa: E731
    return run_ranks(local, 1, case, backend="gloo", timeout=15)[0] if torch.cuda.device_count() else local(0, 1, case)


def _expected_buckets(sizes: list[int], cap: int, close_at_cap: bool = False, after: bool = False) -> list[int]:
    """Greedy packing in parameter order, no bucket over ``cap`` unless one gradient is. ``close_at_cap``: the
    off-by-one that closes a bucket exactly at the cap too; ``after``: DDP's rule, closing one once it reached it."""
    buckets: list[int] = []
    for n in sizes:
        if buckets and (buckets[-1] < cap if after else (buckets[-1] + n < cap if close_at_cap
                                                          else buckets[-1] + n <= cap)):
            buckets[-1] += n
        else:
            buckets.append(n)
    return buckets


class _AverageCheck(Check):
    rank_fn = staticmethod(_learner_rank)
    hints = {"NoneType": "it failed on the model's unused parameter, whose .grad is None (the forward pass never "
             "used it): skip parameters without a gradient"}

    def mistakes(self, case, local, target, world) -> dict:
        return {"summed with all_reduce but not divided by the world size": {n: world * t for n, t in target.items()},
                "divided by the world size twice": {n: t / world for n, t in target.items()},
                "divided by 2 instead of the world size (dist.get_world_size())": {n: t * world / 2 for n, t in target.items()},
                self.unchanged: local}

    def judge(self, case, result):
        world, locals_ = case["world_size"], _references(case)
        if any(r["mismatch"] for r in result):
            raise CheckFailure(collective_mismatch(next(r["mismatch"] for r in result if r["mismatch"])))
        used = [n for n, g in locals_[0].items() if g is not None]
        target = {n: sum(loc[n] for loc in locals_) / world for n in used}  # DDP: the mean of the ranks' own
        for r, got in enumerate(result):
            grads, what = got["grads"], f"rank {r}'s gradients after {self.function}"
            for n, g in grads.items():
                expect(n in used or g is None or not g.any(), f"{what}: the unused parameter {n} (its .grad was "
                       f"None) now has a non-zero gradient")
                expect(n not in used or g is not None, f"{what}: {n}.grad is None; it had a gradient before.")
            flat = lambda d: torch.cat([d[n].reshape(-1) for n in used])  # noqa: E731
            mistakes = {k: flat(v) for k, v in self.mistakes(case, locals_[r], target, world).items()}
            bad = [n for n in used if not torch.allclose(grads[n], target[n], rtol=1e-4, atol=1e-6)]
            good = [n for n in used if n not in bad]
            named = [k for k, v in mistakes.items() if torch.allclose(flat(grads), v, rtol=1e-4, atol=1e-6)]
            if bad and good and not named:  # some parameters right, others not: say which
                d = max((grads[n] - target[n]).abs().max().item() for n in bad)
                raise CheckFailure(f"{what}: {', '.join(bad)} differ (max |difference| {d:.3g}); "
                                   f"{', '.join(good)} match. {self.advice}")
            expect_close(flat(grads), flat(target), what, rtol=1e-4, atol=1e-6, hint=self.advice, mistakes=mistakes)


class Check41(_AverageCheck):
    id, function, points = "4.1", "average_gradients", 2
    unchanged = "gradients unchanged: averaged .data instead of .grad (or never reduced)"
    advice = "Each .grad must become (sum over ranks) / world_size."

    def cases(self, rng):
        return [_draw_model(rng, world_size=2, uneven=True, unused=True), _draw_model(rng, world_size=3),
                _draw_model(rng, world_size=1, unused=rng.random() < 0.5)]


class Check42(_AverageCheck):
    id, function, points = "4.2", "allreduce_bucketed", 3
    unchanged = "gradients unchanged: the reduced flat buffer was never copied back into .grad"
    forgot_last = "forgot the last bucket (the one still open after the loop): its gradients were never reduced"
    advice = "Each .grad must become (sum over ranks) / world_size, bucket by bucket."

    def cases(self, rng):
        out = []
        for kind, world, uneven, unused in (("at the cap", 2, True, True), ("in between", 3, False, False),
                                            ("larger than the cap", 2, False, True), ("one bucket", 1, False, False)):
            while True:  # redraw until the case tests what it is meant to (and bucketing saves calls)
                case = _draw_model(rng, (2, 4), world, uneven, unused)
                sizes = _grad_bytes(case)
                case["cap"] = {"at the cap": sum(sizes[:2]), "one bucket": sum(sizes) + 4 * rng.randint(0, 8),
                               "larger than the cap": rng.randint(min(sizes) - 1, max(sizes) - 1),
                               "in between": rng.randint(max(sizes), sum(sizes))}[kind]
                n = len(_expected_buckets(sizes, case["cap"]))
                if n < len(sizes) and (kind in ("one bucket", "larger than the cap") or n > 1) and (
                        kind != "at the cap" or len(sizes) > len(_expected_buckets(sizes, case["cap"], True)) > n):
                    out.append(case)
                    break
        return out

    def mistakes(self, case, local, target, world) -> dict:
        out = super().mistakes(case, local, target, world)
        last = sum(_expected_buckets(_grad_bytes(case), case["cap"])[:-1])  # where the last bucket starts
        ends = dict(zip(target, itertools.accumulate(_grad_bytes(case))))  # target: the used parameters, in order
        out[self.forgot_last] = {n: local[n] if ends[n] > last else t for n, t in target.items()}
        return out

    def judge(self, case, result):
        super().judge(case, result)  # the ranks' collectives and the gradients first, then the packing
        sizes, cap = _grad_bytes(case), case["cap"]
        buckets = _expected_buckets(sizes, cap)
        mistakes = {"one all_reduce per parameter (no bucketing)": sizes,
                    "closed a bucket that would have been exactly at the cap (>= instead of >): a bucket may reach "
                    "the cap, only exceeding it starts a new one": _expected_buckets(sizes, cap, close_at_cap=True),
                    "closed each bucket only once it reached the cap (DDP's rule), so buckets overshoot it; here a "
                    "bucket must never exceed the cap": _expected_buckets(sizes, cap, after=True),
                    self.forgot_last: buckets[:-1]}
        hint = f"Greedy packing of {sizes} bytes under a cap of {cap} bytes gives buckets of {buckets} bytes."
        for r, got in enumerate(result):
            expect_type(got["returned"], int, f"rank {r}: {self.function}", "an int: the number of all_reduce calls")
            expect_equal(got["returned"], len(buckets), f"rank {r}: the number of collectives returned",
                         mistakes={k: len(v) for k, v in mistakes.items()}, hint=hint)
            seen = [b for op, b, _ in got["calls"] if op == "all_reduce"]
            if seen:  # seen only when the learner calls dist.all_reduce (not an alias of it)
                expect_equal(seen, buckets, f"rank {r}: the bytes of each all_reduce'd bucket", mistakes=mistakes,
                             hint=hint)
