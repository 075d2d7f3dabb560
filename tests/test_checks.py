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
    ok, msg = check.judge_all(seed, check.run_all(lambda x: (_ for _ in ()).throw(NotImplementedError()), seed))
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
