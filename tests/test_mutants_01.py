"""Each check of notebook 01 passes the solution, fails the stub, and names planted mistakes."""
from pathlib import Path

import pytest

from mgpu_helpers.authoring import mutant_verdict, solution_verdict, stub_verdict
import mgpu_helpers.memory  # noqa: F401  (registers 1.1 and 1.2)

NB = Path(__file__).resolve().parent.parent / "solutions" / "01_where_memory_goes.ipynb"

CASES = {
    "1.1": ("training_state_bytes", [
        ('"adam": 2', '"adam": 1', "Adam keeps TWO states"),
        ("master = 4 if precision == \"mixed\" else 0", "master = 0", "master copy"),
        ('return {"parameters": n * weight,\n            "gradients": n * weight,\n            "optimizer_state": n * (buffers * state + master)}',
         'return {"parameters": n, "gradients": n, "optimizer_state": n * (buffers + (master > 0))}',
         "counted elements, not bytes"),
        ('weight = {"fp32": 4, "bf16": 2, "mixed": 2}', 'weight = {"fp32": 4, "bf16": 4, "mixed": 4}', "used fp32 (4 bytes)"),
    ]),
    "1.2": ("activation_bytes", [
        ("(relu_outputs + logits)", "relu_outputs", "forgot the output of the last Linear"),
        ("(relu_outputs + logits)", "(2 * relu_outputs + logits)", "pre-activations"),
        ("(relu_outputs + logits)", "(relu_outputs + logits + widths[0])", "counted the input batch"),
        ('bytes_per_element = {"fp32": 4, "bf16": 2}[dtype]', "bytes_per_element = 4", "4 bytes per element for bf16"),
    ]),
}
PARAMS = [pytest.param(ex, m, marks=getattr(pytest.mark, f"ex_{ex.replace('.', '_')}"), id=f"{ex}-{m[2][:20]}")
          for ex, (_, ms) in CASES.items() for m in ms]


@pytest.mark.parametrize("ex", [pytest.param(e, marks=getattr(pytest.mark, f"ex_{e.replace('.', '_')}")) for e in CASES])
def test_solution_passes_and_stub_fails(ex):
    fn_name, _ = CASES[ex]
    ok, msg = solution_verdict(NB, ex, fn_name)
    assert ok, msg
    ok, msg = stub_verdict(NB, ex, fn_name)
    assert not ok and "not implemented yet" in msg and f"Exercise {ex}" in msg


@pytest.mark.parametrize("ex,mutant", PARAMS)
def test_planted_mistake_is_named(ex, mutant):
    old, new, named = mutant
    ok, msg = mutant_verdict(NB, ex, CASES[ex][0], [(old, new)], seed=7)
    assert not ok, f"mutant {new!r} passed the check"
    assert named in msg, msg
