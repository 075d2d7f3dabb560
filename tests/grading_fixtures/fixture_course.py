"""Checks of the two-exercise fixture course that tests/test_grading.py and bench/grade.py grade.

The notebook ``90_fixture.ipynb.json`` imports this module (``from fixture_course import ...``); the grader
puts this directory on the kernel's and the judge's import path (``--import-path``). Ids 90.x cannot clash
with the course's own exercises.
"""
import torch

from mgpu_helpers.checks import REGISTRY, Check, expect_close, expect_equal


def _x(case):
    return torch.randn(case["n"], generator=torch.Generator().manual_seed(case["seed"]))


class ScaleCheck(Check):
    id, function, points = "90.1", "scale", 2

    def cases(self, rng):
        return [{"n": rng.randint(2, 6), "k": rng.choice([0.5, 2.0, 3.0]), "seed": rng.randrange(10**6)}
                for _ in range(3)]

    def run(self, fn, case):
        return fn(_x(case), case["k"])

    def judge(self, case, result):
        x = _x(case)
        expect_close(result, x * case["k"], "scale(x, k)", mistakes={"added k instead of multiplying": x + case["k"]})


class ParamBytesCheck(Check):
    id, function, points = "90.2", "param_bytes", 1

    def cases(self, rng):
        return [{"fan_in": rng.randint(1, 40), "fan_out": rng.randint(1, 40),
                 "dtype": rng.choice(["float32", "bfloat16", "float64"])} for _ in range(3)]

    def run(self, fn, case):
        return fn(torch.nn.Linear(case["fan_in"], case["fan_out"], dtype=getattr(torch, case["dtype"])))

    def judge(self, case, result):
        size = torch.tensor([], dtype=getattr(torch, case["dtype"])).element_size()
        n = case["fan_in"] * case["fan_out"] + case["fan_out"]
        expect_equal(result, n * size, "param_bytes(model)",
                     mistakes={"forgot the bias": (n - case["fan_out"]) * size, "counted elements, not bytes": n})


check_90_1 = REGISTRY["90.1"]
check_90_2 = REGISTRY["90.2"]
