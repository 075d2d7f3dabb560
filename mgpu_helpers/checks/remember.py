"""A check that remembers its last verdict in the kernel, for the cells after it.

Cells after an exercise ask whether the learner's function passed, to use it or to fall back to torch's own
machinery. Running the check again there repeats its work -- and, for a function that hangs, its timeout
(71 s in notebook 08 for one that hangs). The check cell has just judged that very function object, so the answer is
remembered: ``check.passed(fn)`` returns the verdict of the last ``check(fn)`` when ``fn`` is the same
object (re-running the exercise cell makes a new one), else runs the check quietly.

Only the kernel's display uses this; grading decides outside the kernel, where the learner's code cannot
reach the verdict (``tools.grading.judge``).
"""
from __future__ import annotations

from typing import Callable

from .base import Check


class RemembersVerdict(Check):
    """Mix into a check class: ``check(fn)`` as before, plus ``check.passed(fn)``."""

    def __call__(self, fn: Callable, seed: int | None = None) -> None:
        self._last = (fn, False)        # a failure, a timeout or an interrupt leaves "not passed"
        super().__call__(fn, seed)
        self._last = (fn, True)

    def passed(self, fn: Callable) -> bool:
        last = getattr(self, "_last", None)
        if last is not None and last[0] is fn:
            return last[1]
        return self.passes(fn)
