"""Checks of notebook 01: 1.1 training-state bytes (against one real step, measured), 1.2 activation bytes."""

import torch

from ..memory import BYTES, DTYPES, mlp
from ..runtime.tracker import MemoryTracker
from .base import Check, expect, expect_equal, expect_type, plain


class TrainingStateBytes(Check):
    id, function = "1.1", "training_state_bytes"

    def cases(self, rng):
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
        from .references import measured_training_state
        expected = measured_training_state(mlp(case["widths"], seed=case["seed"]), case["optimizer"], case["precision"])
        n = sum(p.numel() for p in mlp(case["widths"], seed=case["seed"]).parameters())
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
        split = " (the total is right: the split between categories is not)" if (
            result != expected and sum(result.values()) == sum(expected.values())) else ""
        expect_equal(result, expected, "bytes by category", mistakes=mistakes,
                     hint=f"Hint{split}: bytes = parameters × bytes per element; see the table above.")


class ActivationBytes(Check):
    id, function = "1.2", "activation_bytes"

    def cases(self, rng):
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
