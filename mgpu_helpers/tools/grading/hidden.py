"""Hidden checks: extra cases an instructor keeps out of the release (``mgpu-grade --hidden DIR``).

Every ``*.py`` file in DIR may define subclasses of :class:`HiddenCheck`::

    # hidden/01.py -- never released, never readable from a learner's kernel
    from mgpu_helpers.tools.grading import HiddenCheck

    class HugeModels(HiddenCheck):
        exercise = "1.1"          # the public check whose run() feeds the learner's function
        points = 1
        def cases(self, rng):     # plain data, like Check.cases
            return [{"n_params": rng.randrange(10**9, 10**10), "dtype": "bfloat16"}]
        # def judge(self, case, result): ...   optional; the public check's judge by default

Only the *cases* (data) go into the kernel, where the public check's ``run`` calls the learner's function;
the verdict is made outside (judge.py). Feedback shows the check's name and message, never this source.
"""

import importlib.util
import inspect
from pathlib import Path

from ...checks import Check


class HiddenCheck:
    exercise: str = ""   # the exercise id whose public check runs the learner's function
    points: int = 1
    name: str = ""       # shown in grades and feedback; defaults to the class name

    def cases(self, rng) -> list[dict]:
        raise NotImplementedError

    judge = None          # optional judge(case, result); None -> the public check's judge


def load_hidden(directory: Path | None) -> dict[str, list[HiddenCheck]]:
    """{exercise id: [hidden checks, sorted by name]} from every ``*.py`` in ``directory``."""
    found: dict[str, dict[str, HiddenCheck]] = {}
    for path in sorted(Path(directory).glob("*.py")) if directory else []:
        spec = importlib.util.spec_from_file_location(f"mgpu_grade_hidden_{path.stem}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        for obj in vars(mod).values():
            if (inspect.isclass(obj) and issubclass(obj, HiddenCheck) and obj is not HiddenCheck
                    and obj.__module__ == mod.__name__ and obj.exercise):
                inst = obj()
                inst.name = inst.name or obj.__name__
                if inst.name in found.setdefault(obj.exercise, {}):
                    raise ValueError(f"{path}: two hidden checks for {obj.exercise} are named {inst.name!r}")
                found[obj.exercise][inst.name] = inst
    return {ex: [checks[n] for n in sorted(checks)] for ex, checks in sorted(found.items())}


class HiddenProxy(Check):
    """A public check's run, describe and judge (unless ``judge`` is given) on cases from ``cases(rng)``: in the
    kernel the hidden cases arrive as data, never as code. ``id`` is set per instance, so it never registers."""

    def __init__(self, base: Check, cases, judge=None):
        self.id, self.function, self.cases = base.id, base.function, cases
        self.run, self.describe, self.judge = base.run, base.describe, judge or base.judge
