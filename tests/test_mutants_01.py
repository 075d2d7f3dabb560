"""Each check of notebook 01 passes the solution, fails the stub, and names each planted mistake under 20 seeds."""
from pathlib import Path

import pytest

from mgpu_helpers.tools.authoring import mutant_fails_every_seed, solution_verdict, stub_verdict
import mgpu_helpers.checks.memory  # noqa: F401  (registers 1.1 and 1.2)

NB = Path(__file__).resolve().parent.parent / "solutions" / "01_where_memory_goes.ipynb"
RETURN = ('return {"parameters": n * weight,\n            "gradients": n * weight,\n'
          '            "optimizer_state": n * (buffers * state + master)}')
RETURN_12 = "return batch * bytes_per_element * (relu_outputs + logits)"

CASES = {
    "1.1": ("training_state_bytes", [
        ('"adam": 2', '"adam": 1', "Adam keeps TWO states"),
        ("master = 4 if precision == \"mixed\" else 0", "master = 0", "forgot the fp32 master copy"),
        (RETURN, 'return {"parameters": n, "gradients": n, "optimizer_state": n * (buffers + (master > 0))}',
         "counted elements, not bytes"),
        ('weight = {"fp32": 4, "bf16": 2, "mixed": 2}', 'weight = {"fp32": 4, "bf16": 4, "mixed": 4}', "used fp32 (4 bytes)"),
        (RETURN, RETURN.replace('"parameters": n * weight', '"parameters": n * (weight + master)')
                       .replace("n * (buffers * state + master)", "n * buffers * state"),
         "master copy counted under parameters (total right, split wrong)"),
        (RETURN, "return (n * weight, n * weight, n * (buffers * state + master))",
         "returned a list; expected a dict with keys"),
    ]),
    "1.2": ("activation_bytes", [
        ("(relu_outputs + logits)", "relu_outputs", "forgot the output of the last Linear"),
        ("(relu_outputs + logits)", "(2 * relu_outputs + logits)", "pre-activations"),
        ("(relu_outputs + logits)", "(relu_outputs + logits + widths[0])", "counted the input batch"),
        ('bytes_per_element = {"fp32": 4, "bf16": 2}[dtype]', "bytes_per_element = 4", "4 bytes per element for bf16"),
        (RETURN_12, f"return float({RETURN_12[7:]})", "returned a float; expected an int"),
    ]),
}
PARAMS = [pytest.param(ex, m, marks=getattr(pytest.mark, f"ex_{ex.replace('.', '_')}"), id=f"{ex}-{m[2][:20]}")
          for ex, (_, ms) in CASES.items() for m in ms]


@pytest.mark.parametrize("ex", [pytest.param(e, marks=getattr(pytest.mark, f"ex_{e.replace('.', '_')}")) for e in CASES])
def test_solution_passes_and_stub_fails(ex):
    fn_name, _ = CASES[ex]
    for seed in (None, 0, 1):
        ok, msg = solution_verdict(NB, ex, fn_name, seed=seed)
        assert ok, msg
    ok, msg = stub_verdict(NB, ex, fn_name)
    assert not ok and "not implemented yet" in msg and f"Exercise {ex}" in msg


@pytest.mark.parametrize("ex,mutant", PARAMS)
def test_planted_mistake_is_named_under_20_seeds(ex, mutant):
    old, new, named = mutant
    mutant_fails_every_seed(NB, ex, CASES[ex][0], [(old, new)], named)


def test_master_copy_forgotten_is_told_apart_from_one_adam_state():
    # the two mistakes give the same bytes for Adam + mixed; an earlier case (momentum + mixed) separates them
    from mgpu_helpers.tools.authoring import mutant_verdict
    for seed in range(5):
        ok, msg = mutant_verdict(NB, "1.1", "training_state_bytes",
                                 [("master = 4 if precision == \"mixed\" else 0", "master = 0")], seed=seed)
        assert not ok and "Adam keeps TWO states" not in msg, msg
