"""Notebook 01 -- where training memory goes.

Parameters, gradients, optimizer state and activations, counted two ways: by formula (what the
learner writes in exercises 1.1 and 1.2) and by measurement (:class:`MemoryTracker`, which has the
semantics of ``torch.cuda.memory_allocated`` on any device).

Precisions used throughout the course (the ZeRO paper's accounting, Rajbhandari et al. 2020):

=========  ===================  ==========  ===============================  ====================
precision  weights used in      gradients   optimizer state                  Adam bytes/param
           forward/backward
=========  ===================  ==========  ===============================  ====================
fp32       fp32 (4)             fp32 (4)    states in fp32 (4 each)          4+4+8    = 16
bf16       bf16 (2)             bf16 (2)    states in bf16 (2 each)          2+2+4    = 8
mixed      bf16 (2)             bf16 (2)    fp32 master (4) + states (4 each) 2+2+4+8 = 16
=========  ===================  ==========  ===============================  ====================

torch.autocast training is the fp32 row (fp32 weights and gradients, no master copy; its bf16 weight
copies are activations). "mixed" with fp32 gradients (Megatron-LM's bf16 setting) is 2+4+4+8 = 18
bytes/param, and 20 when 16-bit gradients are kept beside an fp32 copy (its fp16 setting): the numbers
learners meet in different sources differ by what they count, not by mistake.
"""
from __future__ import annotations

import random

import torch
from torch import nn

from .checks import Check, REGISTRY, expect, expect_equal, expect_type, plain
from .tracker import CATEGORIES, MemoryTracker  # noqa: F401  (re-exported for the notebooks)

BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def mlp(widths: list[int], dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Sequential:
    """Linear → ReLU → … → Linear with the given layer widths (no ReLU after the last Linear)."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers).to(dtype)


def make_optimizer(name: str, params, lr: float = 1e-3) -> torch.optim.Optimizer:
    # foreach=True is CUDA's default; keep it on every device so CPU and GPU figures match.
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, foreach=True)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, foreach=True)
    raise ValueError(f"unknown optimizer {name!r}: use 'sgd', 'momentum' or 'adam'")


def nbytes(tensors) -> int:
    """Bytes of distinct storages among ``tensors`` (views of one storage count once)."""
    seen, total = set(), 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total


def measured_training_state(model: nn.Module, optimizer: str, precision: str, batch: int = 4) -> dict[str, int]:
    """Take one real training step and count the bytes of what it leaves behind, by category.

    "mixed" is built the way mixed-precision training works without autocast: a bf16 model for
    forward/backward, an fp32 master copy that the optimizer updates, copied back after the step.
    The optimizer's ``step`` counter is a 0-d tensor that torch keeps on the CPU even when training
    on a GPU, so like ``torch.cuda.memory_allocated`` we do not count it.
    """
    work = model.to(torch.bfloat16 if precision in ("bf16", "mixed") else torch.float32)
    master = [p.detach().float().clone() for p in work.parameters()] if precision == "mixed" else None
    opt = make_optimizer(optimizer, master if master is not None else work.parameters())
    x = torch.randn(batch, next(work.parameters()).shape[1], dtype=next(work.parameters()).dtype)
    work(x).float().square().mean().backward()
    if master is not None:  # the optimizer updates the fp32 master from the bf16 gradients
        for m, p in zip(master, work.parameters()):
            m.grad = p.grad.float()
    opt.step()
    if master is not None:
        for m, p in zip(master, work.parameters()):
            p.data.copy_(m)
            m.grad = None  # the fp32 gradient copy is a temporary
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0]
    return {"parameters": nbytes(work.parameters()),
            "gradients": nbytes(p.grad for p in work.parameters()),
            "optimizer_state": nbytes(state) + (nbytes(master) if master else 0)}


class TrainingStateBytes(Check):
    id, function = "1.1", "training_state_bytes"

    def cases(self, rng: random.Random) -> list[dict]:
        combos = [("adam", "fp32"), ("momentum", "mixed"), ("momentum", "bf16"), ("sgd", "mixed"),
                  ("adam", "bf16"), ("sgd", "fp32")]
        rng.shuffle(combos)  # every combination each time, so no mistake can hide behind the draw
        # Adam + mixed last: there forgetting the master copy and a single Adam state give the same bytes,
        # and the cases before it tell the two apart (momentum + mixed, Adam + fp32).
        return [{"widths": [rng.randint(3, 40) for _ in range(rng.randint(2, 4))], "optimizer": o,
                 "precision": p, "seed": rng.randrange(2**31)} for o, p in combos + [("adam", "mixed")]]

    def run(self, fn, case):
        return plain(fn(mlp(case["widths"], seed=case["seed"]), case["optimizer"], case["precision"]))

    def judge(self, case, result):
        keys = ("parameters", "gradients", "optimizer_state")
        expect_type(result, dict, self.function, f"a dict with keys {list(keys)}", keys=keys)
        expect(all(isinstance(v, int) and not isinstance(v, bool) for v in result.values()),
               f"{self.function} returned {result}: each value must be an int (a number of bytes)")
        expected = measured_training_state(mlp(case["widths"], seed=case["seed"]), case["optimizer"], case["precision"])
        n = sum(p.numel() for p in mlp(case["widths"], seed=case["seed"]).parameters())
        w = 4 if case["precision"] == "fp32" else 2
        states = {"sgd": 0, "momentum": 1, "adam": 2}[case["optimizer"]]
        mistakes = {
            "counted elements, not bytes (multiply by bytes per element)":
                {"parameters": n, "gradients": n, "optimizer_state": n * (states + (case["precision"] == "mixed"))},
            "Adam keeps TWO states per parameter (exp_avg and exp_avg_sq)":
                dict(expected, optimizer_state=expected["optimizer_state"] - n * (4 if case["precision"] != "bf16" else 2)),
            "forgot the fp32 master copy of the weights that mixed precision keeps":
                dict(expected, optimizer_state=expected["optimizer_state"] - 4 * n),
            "used fp32 (4 bytes) for the 16-bit weights and gradients":
                dict(expected, parameters=4 * n, gradients=4 * n),
            "master copy counted under parameters (total right, split wrong): the exercise puts the fp32 "
            "master copy under optimizer_state":
                dict(expected, parameters=expected["parameters"] + 4 * n,
                     optimizer_state=expected["optimizer_state"] - 4 * n),
        }
        if states != 2:
            mistakes.pop("Adam keeps TWO states per parameter (exp_avg and exp_avg_sq)")
        if case["precision"] != "mixed":
            mistakes = {k: v for k, v in mistakes.items() if "master" not in k}
        if w == 4:
            mistakes.pop("used fp32 (4 bytes) for the 16-bit weights and gradients")
        split = " (the total is right: the split between categories is not)" if (
            result != expected and sum(result.values()) == sum(expected.values())) else ""
        expect_equal(result, expected, "bytes by category", mistakes=mistakes,
                     hint=f"Hint{split}: bytes = parameters × bytes per element; see the table above.")


class ActivationBytes(Check):
    id, function = "1.2", "activation_bytes"

    def cases(self, rng: random.Random) -> list[dict]:
        # at least one hidden layer, so that every mistake below changes the answer
        return [{"widths": [rng.randint(2, 64) for _ in range(rng.randint(3, 5))], "batch": rng.randint(1, 32),
                 "dtype": dt, "seed": rng.randrange(2**31)} for dt in ("fp32", "bf16", "fp32")]

    def run(self, fn, case):
        return plain(fn(list(case["widths"]), case["batch"], case["dtype"]))

    def judge(self, case, result):
        expect_type(result, int, self.function, "an int: a number of bytes")
        model = mlp(case["widths"], DTYPES[case["dtype"]], seed=case["seed"])
        x = torch.randn(case["batch"], case["widths"][0], dtype=DTYPES[case["dtype"]])
        with MemoryTracker(model) as mt:
            out = model(x)
            measured = mt.breakdown()["activations"]
        del out
        b, e, ws = case["batch"], BYTES[DTYPES[case["dtype"]]], case["widths"]
        hidden = sum(ws[1:-1])
        expect_equal(result, measured, "activation bytes after the forward pass", mistakes={
            "also counted the pre-activations (Linear outputs): ReLU saves only its output, and the "
            "Linear output it consumed is freed": b * e * (2 * hidden + ws[-1]),
            "counted the input batch, which existed before the forward pass": b * e * (hidden + ws[-1] + ws[0]),
            "forgot the output of the last Linear (the logits stay alive until the loss uses them)": b * e * hidden,
            "counted elements, not bytes": b * (hidden + ws[-1]),
            "used 4 bytes per element for bf16": b * 4 * (hidden + ws[-1]),
        }, hint="Hint: after forward, what is alive is every ReLU output (saved for backward) plus the logits.")


check_1_1 = REGISTRY["1.1"]
check_1_2 = REGISTRY["1.2"]
