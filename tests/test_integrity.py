"""No exercise's answer within a learner's reach.

* Every function and class the package defines (enumerated, public and private), used by an exercise's
  answer -- called from a wrapper, aliased, subclassed or imported inside the function -- scores 0 on that
  check with a line saying that the course's own implementation was used, in study mode and when graded.
* No lesson module (what a notebook imports) holds, imports or advertises a judge's reference; no notebook
  imports one; the references are masked in the grading sandbox (tests/test_grading_sandbox.py walks it).
"""
import importlib
import inspect
import pkgutil
import pydoc
from pathlib import Path

import nbformat
import pytest

import mgpu_helpers
from mgpu_helpers.checks import REGISTRY, CheckFailure, load_checks
from mgpu_helpers.checks.delegation import course_code_used

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))
LESSONS = sorted({nbformat.read(p, as_version=4).metadata["mgpu"]["module"] for p in NOTEBOOKS})
for _lesson in LESSONS:
    load_checks(f"mgpu_helpers.{_lesson}")
MODULES = [info.name for info in pkgutil.walk_packages(mgpu_helpers.__path__, "mgpu_helpers.")
           if not info.name.endswith(".__main__")]  # a package's script entry runs when imported
EXERCISES = sorted(REGISTRY, key=lambda ex: tuple(int(x) for x in ex.split(".")))


def package_callables():
    """(module, name, object) for every function and class defined in the package."""
    out = []
    for name in MODULES:
        module = importlib.import_module(name)
        for attr, obj in vars(module).items():
            if (inspect.isfunction(obj) or inspect.isclass(obj)) and obj.__module__ == name:
                out.append((name, attr, obj))
    return out


CALLABLES = package_callables()


def submissions(module, name, obj):
    """The ways a learner's exercise cell (module ``__main__``) can hand the work to ``obj``."""
    forms = {
        "wrapper": f"from {module} import {name}\ndef answer(*args, **kwargs):\n    return {name}(*args, **kwargs)\n",
        "alias": f"from {module} import {name} as answer\n",
        "import inside": f"def answer(*args, **kwargs):\n    from {module} import {name}\n"
                         f"    return {name}(*args, **kwargs)\n",
        "helper of the learner's": f"import {module} as lib\ndef _mine(*a, **k):\n    return lib.{name}(*a, **k)\n"
                                   f"def answer(*args, **kwargs):\n    return _mine(*args, **kwargs)\n",
    }
    if inspect.isclass(obj):
        forms["subclass"] = (f"from {module} import {name}\nclass answer({name}):\n    def step(self, *a, **k):\n"
                             "        return super().step(*a, **k)\n")
    for form, source in forms.items():
        ns = {"__name__": "__main__"}
        try:
            exec(compile(source, "<exercise cell>", "exec"), ns)
        except TypeError:  # a class that cannot be subclassed
            continue
        yield form, ns["answer"]


def test_the_package_defines_callables_and_checks_are_registered():
    assert len(CALLABLES) > 300, len(CALLABLES)
    assert len(EXERCISES) >= 18, EXERCISES


@pytest.mark.parametrize("ex", EXERCISES)
def test_delegating_to_any_package_callable_scores_zero(ex):
    check, seed = REGISTRY[ex], 5
    tried = 0
    for module, name, obj in CALLABLES:
        if any(module == m or module.startswith(m + ".") for m in check.may_use):
            continue  # what the task itself asks to use (2.2: MemoryTracker): judged below, on its merits
        for form, answer in submissions(module, name, obj):
            ok, msg = check.judge_all(seed, check.run_all(answer, seed))    # graded: the kernel runs, a judge decides
            assert not ok and "the course's own implementation" in msg and f"Exercise {ex}" in msg, (form, name, msg)
            assert f"{module}" in msg or "mgpu_helpers" in msg, msg
            tried += 1
    assert tried > 1000


@pytest.mark.parametrize("ex", EXERCISES)
def test_study_mode_says_the_same(ex):
    check = REGISTRY[ex]
    module, name, obj = next((m, n, o) for m, n, o in CALLABLES if m == "mgpu_helpers.sharding.fsdp")
    _, answer = next(submissions(module, name, obj))
    with pytest.raises(CheckFailure, match="the course's own implementation"):
        check(answer)


def test_what_a_task_allows_is_still_judged_on_its_merits():
    """2.2 may measure with MemoryTracker; handing the whole answer to any tracker callable still fails."""
    check = REGISTRY["2.2"]
    for module, name, obj in CALLABLES:
        if module == "mgpu_helpers.runtime.tracker":
            for form, answer in submissions(module, name, obj):
                ok, msg = check.judge_all(3, check.run_all(answer, 3))
                assert not ok and "own implementation" not in msg, (form, name, msg)


def test_the_solutions_use_nothing_they_may_not():
    from mgpu_helpers.tools.authoring import exec_cell, exercise_cells
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        for ex, cell in exercise_cells(nb).items():
            fn = exec_cell(cell.source)[cell.metadata["mgpu"]["function"]]
            assert course_code_used(fn, REGISTRY[ex].may_use) is None, (path.name, ex)


def test_no_lesson_module_holds_imports_or_advertises_a_reference():
    from mgpu_helpers.checks import references
    ref_objects = {id(o) for o in vars(references).values()
                   if (inspect.isfunction(o) or inspect.isclass(o)) and o.__module__ == references.__name__}
    assert ref_objects, "the judges' references live in mgpu_helpers.checks.references"
    for lesson in LESSONS:
        module = importlib.import_module(f"mgpu_helpers.{lesson}")
        leaked = [k for k, v in vars(module).items() if id(v) in ref_objects]
        assert not leaked, f"mgpu_helpers.{lesson} holds the references {leaked}"
        text = pydoc.render_doc(module, renderer=pydoc.plaintext)
        assert "checks.references" not in text and "reference implementation" not in text.lower(), lesson


def test_no_notebook_imports_a_reference():
    for folder in ("solutions", "notebooks"):
        for path in sorted((ROOT / folder).glob("[0-9][0-9]_*.ipynb")):
            for cell in nbformat.read(path, as_version=4).cells:
                assert "checks.references" not in cell.source, (path.name, cell.source[:200])
