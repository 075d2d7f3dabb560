"""Check 11.1 passes the solution, fails the stub, and names each planted mistake under every seed."""
from pathlib import Path

import pytest

from mgpu_helpers.tools.authoring import mutant_fails_every_seed, sweep_seeds
import mgpu_helpers.checks.capstone  # noqa: F401  (registers 11.1)
from testkit import solution_passes_stub_fails

NB = Path(__file__).resolve().parent.parent / "solutions" / "11_capstone_fit_the_budget.ipynb"
FIT = "fitting = [p for p in plans if p.device_bytes <= capacity]"
KEY = 'key=lambda p: (p.config["world_size"], p.step_cost)'
MUTANTS = [
    ([(FIT, FIT.replace("<=", "<"))], "a plan whose device total equals the capacity fits"),
    ([(FIT, 'fitting = [p for p in plans if p.device_bytes * p.config["world_size"] <= capacity]')],
     "the capacity is per device"),
    ([(FIT, FIT.replace("p.device_bytes", "p.peak_bytes"))], "a card must hold more than the allocated peak"),
    ([(KEY, "key=lambda p: p.step_cost")], "the lowest step cost first, ignoring the number of ranks"),
    ([(KEY, 'key=lambda p: p.config["world_size"]')], "fewest ranks, but not the lowest step cost"),
    ([(KEY, "key=lambda p: p.device_bytes")], "the plan with the smallest device total"),
    ([("        return None", "        return min(plans, key=lambda p: p.device_bytes)")],
     "when nothing fits, return None"),
    ([(f"return min(fitting, {KEY})", f"return min(fitting, {KEY}).config")],
     "expected one of the Plan objects"),
]


@pytest.mark.ex_11_1
def test_solution_passes_and_stub_fails():
    solution_passes_stub_fails(NB, "11.1", "choose_plan", seeds=(None, 3))


@pytest.mark.ex_11_1
@pytest.mark.parametrize("edits,named", MUTANTS, ids=[m[1][:30] for m in MUTANTS])
def test_planted_mistake_is_named_under_every_seed(edits, named):
    mutant_fails_every_seed(NB, "11.1", "choose_plan", edits, named)


FITS = [m for m in MUTANTS[:3]]


@pytest.mark.ex_11_1
@pytest.mark.parametrize("edits,named", FITS, ids=["lt-alone", "times-world-alone", "peak-alone"])
def test_each_wrong_fit_is_named_alone(edits, named):
    """`<`, "x world size" and "the allocated peak" give the same wrong answer on many capacities (the message
    then lists several); the check's first cases separate them, so each is named alone under every seed."""
    from mgpu_helpers.tools.authoring import mutant_verdict
    others = [m for _, m in FITS if m != named]
    for seed in sweep_seeds():
        ok, msg = mutant_verdict(NB, "11.1", "choose_plan", [tuple(e) for e in edits], seed=seed)
        assert not ok and named in msg and not any(o in msg for o in others), f"seed {seed}: {msg}"
