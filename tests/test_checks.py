"""The Check base class: one deterministic line, helpful failures, and the grading split."""
import random

import pytest

from mgpu_helpers.checks import REGISTRY, Check, CheckFailure, expect_close, expect_equal


class Double(Check):
    id, function = "99.1", "double"

    def cases(self, rng):
        return [{"x": rng.randint(-50, 50)} for _ in range(3)]

    def run(self, fn, case):
        return fn(case["x"])

    def judge(self, case, result):
        expect_equal(result, 2 * case["x"], "double(x)", mistakes={"squared instead of doubled": case["x"] ** 2})


@pytest.fixture
def check():
    yield REGISTRY["99.1"]


def test_pass_prints_one_line(check, capsys):
    check(lambda x: 2 * x)
    assert capsys.readouterr().out == "Exercise 99.1 ✓ double: 3/3 cases\n"


def test_stub_says_not_implemented(check):
    def stub(x):
        raise NotImplementedError("Exercise 99.1: double x")
    with pytest.raises(CheckFailure, match="not implemented yet"):
        check(stub)


def test_named_mistake(check):
    with pytest.raises(CheckFailure, match="squared instead of doubled"):
        check(lambda x: x * x if x not in (0, 2) else 2 * x + 1, seed=1)


def test_learner_exception_is_reported_with_case(check):
    with pytest.raises(CheckFailure, match=r"raised ZeroDivisionError.*\n.*on case: x="):
        check(lambda x: 1 / 0)


def test_not_callable(check):
    with pytest.raises(CheckFailure, match="expected a function"):
        check(42)


def test_grading_split_judges_outside(check):
    seed = 1234
    good = check.run_all(lambda x: 2 * x, seed)
    assert check.judge_all(seed, good) == (True, "Exercise 99.1 ✓ double: 3/3 cases")
    ok, msg = check.judge_all(seed, check.run_all(lambda x: 3 * x, seed))
    assert not ok and "double(x)" in msg
    ok, msg = check.judge_all(seed, check.run_all(
        lambda x: (_ for _ in ()).throw(NotImplementedError("Exercise 99.1: double x")), seed))
    assert not ok and "not implemented" in msg
    assert check.judge_all(seed, [])[0] is False
    assert check.judge_all(seed, ["junk", 1, None])[0] is False
    assert check.judge_all(seed, [{"ok": True, "result": "x"}] * 3)[0] is False


def test_expect_close_messages():
    import torch
    expect_close(torch.ones(3), torch.ones(3) + 1e-9, "t")
    with pytest.raises(CheckFailure, match="shape"):
        expect_close(torch.ones(2), torch.ones(3), "t")
    with pytest.raises(CheckFailure, match="max \\|difference\\|"):
        expect_close(torch.ones(3), torch.zeros(3), "t")
    with pytest.raises(CheckFailure, match="summed"):
        expect_close(torch.full((3,), 2.0), torch.ones(3), "grad", mistakes={"summed, not averaged": torch.full((3,), 2.0)})
    with pytest.raises(CheckFailure, match="got 2, expected 1"):
        expect_close(2.0, 1.0, "x")


def test_fresh_cases_each_call(check):
    assert check.make_cases(1) == check.make_cases(1)
    assert len({str(check.make_cases()) for _ in range(5)}) > 1
    assert check.cases(random.Random(3)) == check.make_cases(3)


# --- what "not implemented yet" means, what a failure shows, timeouts paid once, hints -------------------

def test_only_the_stubs_not_implemented_error_means_not_started(check):
    import torch

    def uses_modulelist_as_a_module(x):   # torch's own NotImplementedError: a bug, not a stub
        return torch.nn.ModuleList([torch.nn.Identity()])(x)
    with pytest.raises(CheckFailure) as info:
        check(uses_modulelist_as_a_module)
    msg = str(info.value)
    assert "raised NotImplementedError" in msg and "not implemented yet" not in msg, msg
    assert isinstance(info.value.__cause__, NotImplementedError)  # the learner's traceback stays attached
    rendered = "\n".join(info.value._render_traceback_())
    assert "uses_modulelist_as_a_module" in rendered and "torch" in rendered, rendered
    assert "mgpu_helpers" not in rendered, rendered             # no frames of the course's machinery

    seed = 5
    ok, msg = check.judge_all(seed, check.run_all(uses_modulelist_as_a_module, seed))
    assert not ok and "raised NotImplementedError" in msg and "not implemented yet" not in msg, msg
    ok, msg = check.judge_all(seed, check.run_all(
        lambda x: (_ for _ in ()).throw(NotImplementedError("Exercise 99.1: double x")), seed))
    assert not ok and "not implemented yet" in msg, msg


def test_a_failing_check_renders_its_message_only(check):
    with pytest.raises(CheckFailure) as info:
        check(lambda x: 3 * x)
    lines = info.value._render_traceback_()
    assert len(lines) == 1 and "double(x): got" in lines[0] and "checks.py" not in lines[0], lines


def test_messages_have_no_verb_to_disagree_with():
    import torch
    with pytest.raises(CheckFailure, match=r"^the indices of every rank: got \[1\], expected \[2\]\.$"):
        expect_equal([1], [2], "the indices of every rank")
    with pytest.raises(CheckFailure, match=r"^the parameters after the script: wrong, and it matches a common "
                                           r"mistake: never unscaled\.$"):
        expect_close(torch.ones(2), torch.zeros(2), "the parameters after the script",
                     mistakes={"never unscaled": torch.ones(2)})


class Hangs(Check):
    id, function = "99.2", "hangs"
    calls = 0

    def cases(self, rng):
        return [{"x": i} for i in range(3)]

    def run(self, fn, case):
        Hangs.calls += 1
        return fn(case["x"])

    def judge(self, case, result):
        expect_equal(result, case["x"], "hangs(x)")


def test_a_timeout_is_paid_once_per_function():
    check = REGISTRY["99.2"]

    def hung(x):
        raise TimeoutError("rank 1 did not finish within 20 s")
    Hangs.calls = 0
    with pytest.raises(CheckFailure, match="raised TimeoutError"):
        check(hung)
    assert Hangs.calls == 1
    for again in (lambda: check(hung), lambda: check.passes(hung)):   # e.g. a plot asking whether it passed
        try:
            again()
        except CheckFailure as e:
            assert "not run again" in str(e)
    assert Hangs.calls == 1
    results = check.run_all(hung, 0)                                   # the grader's harvest
    assert Hangs.calls == 1 and all("TimeoutError" in r["error"] for r in results)

    class Hidden(Hangs):                     # the grader's hidden cases: another Check with the same id
        id = ""                              # (not registered)

    hidden = Hidden()
    hidden.id = "99.2"
    assert all("TimeoutError" in r["error"] for r in hidden.run_all(hung, 0)) and Hangs.calls == 1

    def hung_again(x):                                                 # the cell re-run: a new function
        raise TimeoutError("still hung")
    assert not check.passes(hung_again) and Hangs.calls == 2
    check(lambda x: x)                                                 # other functions are unaffected


class Hinted(Check):
    id, function = "99.3", "hinted"

    def cases(self, rng):
        return [{"x": 1}]

    def run(self, fn, case):
        return fn(case["x"])

    def judge(self, case, result):
        expect_equal(result, 1, "hinted(x)")

    def hint(self, error):
        return "cast x to the model's dtype" if "dtype" in error else ""


def test_hints_for_what_the_learner_raised():
    check = REGISTRY["99.3"]

    def wrong_dtype(x):
        raise RuntimeError("mat1 and mat2 must have the same dtype")
    with pytest.raises(CheckFailure, match="(?s)raised RuntimeError: mat1.*Hint: cast x to the model's dtype"):
        check(wrong_dtype)
    ok, msg = check.judge_all(0, check.run_all(wrong_dtype, 0))
    assert not ok and "Hint: cast x" in msg, msg
    with pytest.raises(CheckFailure) as info:
        check(lambda x: 1 / 0)
    assert "Hint" not in str(info.value)


def test_a_ranks_own_not_implemented_error_is_not_a_stub():
    from mgpu_helpers.checks import run_learner_ranks
    from mgpu_helpers.runtime.launch import RankError

    with pytest.raises(NotImplementedError, match="^Exercise 4.1: average"):
        run_learner_ranks(_raise_stub, 2, timeout=60)
    with pytest.raises(RankError, match="forward"):
        run_learner_ranks(_raise_torch, 2, timeout=60)


def _raise_stub(rank, world):
    raise NotImplementedError("Exercise 4.1: average the gradients")


def _raise_torch(rank, world):
    import torch
    torch.nn.ModuleList()(1)


class HangsInRanks(Check):
    id, function = "99.4", "hangs_in_ranks"

    def cases(self, rng):
        return [{"x": 1}, {"x": 2}]

    launches = 0

    def run(self, fn, case):
        from mgpu_helpers.checks import run_learner_ranks
        HangsInRanks.launches += 1
        return run_learner_ranks(fn, 2, timeout=3)

    def judge(self, case, result):
        expect_equal(result, [None, None], "hangs_in_ranks")


def _sleeps(rank, world):
    import time
    time.sleep(60)


def test_a_hung_rank_is_waited_for_once():
    """The real path: run_ranks' RankTimeout is a TimeoutError; the second call (a plot's `passes`) and the
    grader's run_all launch nothing, instead of waiting for the timeout again."""
    check = REGISTRY["99.4"]
    HangsInRanks.launches = 0  # the every-check error-path test may have launched it already
    with pytest.raises(CheckFailure, match="RankTimeout"):
        check(_sleeps)
    assert HangsInRanks.launches == 1
    assert not check.passes(_sleeps)
    assert all(not r["ok"] for r in check.run_all(_sleeps, 0)) and HangsInRanks.launches == 1
