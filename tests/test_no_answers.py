"""The proof behind the refusal: no function or class of the package, handed to an exercise's check
as the answer itself, passes it. Run with the delegation refusal switched off, so the check judges the
callable on its merits. Candidates: every callable a graded kernel can import (lesson modules, runtime,
checks; not tools, not the masked references) whose required positional parameters match the exercise's.

Opt-in (about 5 minutes on 2 cores): ``.venv/bin/python -m pytest -m answers tests/test_no_answers.py``.
"""
import importlib
import inspect
import pkgutil
from pathlib import Path

import nbformat
import pytest

import mgpu_helpers
from mgpu_helpers.checks import REGISTRY, load_checks
from mgpu_helpers.tools.authoring import exec_cell, exercise_cells

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.answers
SOLUTIONS = {}
for _p in sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb")):
    _nb = nbformat.read(_p, as_version=4)
    load_checks("mgpu_helpers." + _nb.metadata["mgpu"]["module"])
    for _ex, _c in exercise_cells(_nb).items():
        SOLUTIONS[_ex] = exec_cell(_c.source)[_c.metadata["mgpu"]["function"]]
REACHABLE = [i.name for i in pkgutil.walk_packages(mgpu_helpers.__path__, "mgpu_helpers.")
             if ".tools" not in i.name and ".references" not in i.name and not i.name.endswith(".__main__")]


def _required(fn):
    target = fn.__init__ if inspect.isclass(fn) and "__init__" in vars(fn) else fn
    try:
        params = [p for p in inspect.signature(target).parameters.values() if p.name != "self"]
    except (TypeError, ValueError):
        return None
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return None
    return sum(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


def candidates(ex):
    want, solution = _required(SOLUTIONS[ex]), SOLUTIONS[ex]
    for name in REACHABLE:
        for attr, obj in list(vars(importlib.import_module(name)).items()):
            if (inspect.isfunction(obj) or inspect.isclass(obj)) and obj.__module__ == name \
                    and _required(obj) == want and (inspect.isclass(obj) or not inspect.isclass(solution)):
                yield f"{name}.{attr}", obj


@pytest.mark.parametrize("ex", sorted(SOLUTIONS, key=lambda e: tuple(map(int, e.split(".")))))
def test_no_package_callable_passes_a_check(ex, monkeypatch):
    import mgpu_helpers.checks.base as base
    monkeypatch.setattr(base, "course_code_used", lambda fn, may_use=(): None)   # judge on the merits
    import resource
    resource.setrlimit(resource.RLIMIT_AS, (8 * 2**30, resource.getrlimit(resource.RLIMIT_AS)[1]))  # a 7B build
    check = REGISTRY[ex]
    assert check.passes(SOLUTIONS[ex]), f"{ex}: the solution must pass"
    passing = [name for name, obj in candidates(ex) if check.passes(obj, seed=0)]
    assert not passing, f"exercise {ex} is answered by the package itself: {passing}"
