"""Check 11.1 passes the solution, fails the stub, and names each planted mistake under every seed."""
from pathlib import Path

import pytest

from mgpu_helpers.tools.authoring import mutant_fails_every_seed
import mgpu_helpers.checks.planner  # noqa: F401  (registers 11.1)
from testkit import solution_passes_stub_fails

NB = Path(__file__).resolve().parent.parent / "solutions" / "11_capstone_fit_the_budget.ipynb"
FIT = "fitting = [p for p in plans if p.peak_bytes <= budget]"
KEY = 'key=lambda p: (p.config["world_size"], p.step_cost)'
MUTANTS = [
    ([(FIT, FIT.replace("<=", "<"))], "a plan whose peak equals the budget fits"),
    ([(FIT, 'fitting = [p for p in plans if p.peak_bytes * p.config["world_size"] <= budget]')],
     "the budget is per device"),
    ([(KEY, "key=lambda p: p.step_cost")], "the lowest step cost first, ignoring the number of ranks"),
    ([(KEY, 'key=lambda p: p.config["world_size"]')], "fewest ranks, but not the lowest step cost"),
    ([(KEY, "key=lambda p: p.peak_bytes")], "the plan with the smallest peak"),
    ([("        return None", "        return min(plans, key=lambda p: p.peak_bytes)")],
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


LT = "a plan whose peak equals the budget fits"
TIMES_WORLD = "the budget is per device"


@pytest.mark.ex_11_1
@pytest.mark.parametrize("edits,named,other", [
    ([(FIT, FIT.replace("<=", "<"))], LT, TIMES_WORLD),
    ([(FIT, 'fitting = [p for p in plans if p.peak_bytes * p.config["world_size"] <= budget]')], TIMES_WORLD, LT)],
    ids=["lt-alone", "times-world-alone"])
def test_lt_and_times_world_size_are_told_apart(edits, named, other):
    """`<` and "peak x world size" give the same wrong answer on many budgets (the message then lists both);
    the check's first cases separate them, so each is named alone under every seed."""
    from mgpu_helpers.tools.authoring import mutant_verdict
    for seed in range(20):
        ok, msg = mutant_verdict(NB, "11.1", "choose_plan", [tuple(e) for e in edits], seed=seed)
        assert not ok and named in msg and other not in msg, f"seed {seed}: {msg}"


@pytest.mark.ex_11_1
def test_the_kernel_and_the_judge_agree_whatever_threads_each_has(monkeypatch):
    """Under mgpu-grade the cases are made twice: in the learner's kernel (whose check cell planned at the
    kernel's thread count) and in the judge, a fresh process. On AVX-512 and AMX a bf16 matmul's scratch grows
    with the threads (0 on AVX2, and small at CI's 2 threads): here each matmul is given scratch per thread
    by hand. The course's solution once lost 11.1 this way on a 16-core Xeon; it must pass."""
    import torch

    from mgpu_helpers.checks.base import REGISTRY
    from mgpu_helpers.planner import accounting, capstone, kernels
    from mgpu_helpers.tools.authoring import exec_cell, exercise_source

    real = accounting.cpu_kernel_scratch
    monkeypatch.setattr(accounting, "cpu_kernel_scratch", lambda func, args, kwargs: real(func, args, kwargs) + (
        16384 * kernels.step_thread_count() if "mm" in str(func) else 0))
    check, choose = REGISTRY["11.1"], exec_cell(exercise_source(NB, "11.1"))["choose_plan"]

    def new_process():
        capstone._trace.cache_clear()
        capstone._plans.cache_clear()
    before = torch.get_num_threads()
    try:
        new_process()
        torch.set_num_threads(16)
        check(choose, seed=5)                  # the check cell, in the kernel
        results = check.run_all(choose, 5)     # what the grader's hidden cell sends from that kernel
        new_process()
        torch.set_num_threads(1)
        ok, msg = check.judge_all(5, results)  # the judge
    finally:
        new_process()
        torch.set_num_threads(before)
    assert ok, msg
