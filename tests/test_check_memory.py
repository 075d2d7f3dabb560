"""``check.passed(fn)`` answers from the check cell's verdict on the same function, without running it again."""
import pytest

from mgpu_helpers.checks import RemembersVerdict
from mgpu_helpers.checks import REGISTRY, CheckFailure, expect_equal


class Doubles(RemembersVerdict):
    function = "double"      # no id: not registered

    def __init__(self):
        self.runs = 0

    def cases(self, rng):
        return [{"x": rng.randint(1, 9)}]

    def run(self, fn, case):
        self.runs += 1
        return fn(case["x"])

    def judge(self, case, result):
        expect_equal(result, 2 * case["x"], "double(x)")


def test_passed_reuses_the_verdict_on_the_same_function(capsys):
    check = Doubles()
    assert "" not in REGISTRY

    def good(x):
        return 2 * x

    def bad(x):
        return x

    check(good)
    assert check.runs == 1 and check.passed(good) and check.runs == 1      # remembered: not run again
    with pytest.raises(CheckFailure):
        check(bad)
    assert check.runs == 2 and not check.passed(bad) and check.runs == 2   # a failure is remembered too
    assert check.passed(good) and check.runs == 3                          # another function: judged afresh
    assert "✓" in capsys.readouterr().out


def test_the_course_checks_that_cells_ask_remember():
    import mgpu_helpers.checks.capstone  # noqa: F401  registers 11.1 (alone, the test found none of these)
    import mgpu_helpers.checks.model_sharding  # noqa: F401
    import mgpu_helpers.checks.sharding  # noqa: F401
    for ex in ("8.1", "8.2", "9.1", "9.2", "11.1"):
        assert isinstance(REGISTRY[ex], RemembersVerdict), ex
