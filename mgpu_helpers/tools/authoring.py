"""The notebook metadata schema (AUTHORING.md, "Cells": ``validate``), the solution → student transformation,
and the mutant harness. Release replaces each solution block by ``raise NotImplementedError("Exercise 4.1:
<task>")`` at the block's indentation, clears outputs and execution counts, and keeps ids, tags and metadata.
"""

import contextlib
import copy
import io
import os
import re
from pathlib import Path
from typing import Any, Callable

# nbformat is imported where a notebook is read or written: notebooks import ``verdict`` from here on machines
# without Jupyter's packages (bench/run_notebooks.py on a GPU box).

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
NOTEBOOK_GLOB = "[0-9][0-9]_*.ipynb"  # a course notebook's name: 04_ddp.ipynb


def course_notebooks(folder: str | Path) -> list[Path]:
    """The course notebooks in ``folder`` (solutions/ or notebooks/), in order."""
    return sorted(Path(folder).glob(NOTEBOOK_GLOB))


def mgpu(cell) -> dict:
    return cell.get("metadata", {}).get("mgpu", {}) or {}


def exercise_cells(nb) -> dict[str, Any]:
    return {mgpu(c)["exercise"]: c for c in nb.cells if c.cell_type == "code" and "exercise" in mgpu(c)}


def strip_solution(source: str, message: str) -> str:
    """Replace every BEGIN/END SOLUTION block by a ``raise NotImplementedError(message)``."""
    out, inside = [], False
    for line in source.splitlines():
        stripped = line.strip()
        if stripped.startswith(BEGIN):
            if inside:
                raise ValueError("nested ### BEGIN SOLUTION")
            inside = True
            indent = line[: len(line) - len(line.lstrip())]
            out.append(f"{indent}raise NotImplementedError({message!r})")
        elif stripped.startswith(END):
            if not inside:
                raise ValueError("### END SOLUTION without BEGIN")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError("### BEGIN SOLUTION without END")
    return "\n".join(out)


def validate(nb, name: str = "notebook") -> list[str]:
    """Problems with a solution notebook's schema (empty list when it is fine)."""
    problems, seen_ex, seen_check = [], set(), set()
    for i, c in enumerate(nb.cells):
        m = mgpu(c)
        tags = c.get("metadata", {}).get("tags", [])
        src = c.source if isinstance(c.source, str) else "".join(c.source)
        for kind, seen in (("exercise", seen_ex), ("check", seen_check)):
            if kind in m:
                if m[kind] in seen:
                    problems.append(f"{name} cell {i}: duplicate {kind} {m[kind]}")
                seen.add(m[kind])
                if kind not in tags:
                    problems.append(f"{name} cell {i}: {kind} {m[kind]} lacks the '{kind}' tag")
        if "exercise" in m:
            ex = m["exercise"]
            if not re.fullmatch(r"\d{1,2}\.\d{1,2}", str(ex)):
                problems.append(f"{name} cell {i}: bad exercise id {ex!r}")
            if src.count(BEGIN) != 1 or src.count(END) != 1:
                problems.append(f"{name} cell {i}: exercise {ex} needs exactly one solution block")
            if not m.get("function") or not m.get("task"):
                problems.append(f"{name} cell {i}: exercise {ex} needs 'function' and 'task'")
        elif BEGIN in src:
            problems.append(f"{name} cell {i}: solution block outside an exercise cell")
        for line in src.splitlines():  # nbval takes a marker only as the whole comment: "# NBVAL_X  (why)" is ignored
            if re.match(r"\s*#+\s*NBVAL_[A-Z_]+\s*\S", line) and not re.fullmatch(r"\s*#+\s*NBVAL_[A-Z_]+\s*", line):
                problems.append(f"{name} cell {i}: {line.strip()!r}: nbval ignores a marker with text after it "
                                "(put the reason on the next line)")
        if "check" in m:
            ck = m["check"]
            if not isinstance(m.get("points"), int) or m["points"] <= 0:
                problems.append(f"{name} cell {i}: check {ck} needs positive integer 'points'")
            if "NBVAL_SKIP" in src or "NBVAL_IGNORE_OUTPUT" in src or "NBVAL_RAISES_EXCEPTION" in src:
                problems.append(f"{name} cell {i}: check {ck} must be compared by nbval (no NBVAL_ markers)")
    return (problems + [f"{name}: exercise {ex} has no check cell" for ex in seen_ex - seen_check]
            + [f"{name}: check {ck} has no exercise cell" for ck in seen_check - seen_ex])


def release_notebook(nb):
    """The student copy of a solution notebook."""
    nb = copy.deepcopy(nb)
    for c in [c for c in nb.cells if c.cell_type == "code"]:
        if "exercise" in mgpu(c):
            c.source = strip_solution(c.source, f"Exercise {mgpu(c)['exercise']}: {mgpu(c)['task']}")
        c.outputs, c.execution_count = [], None
    return nb


def dumps(nb) -> str:
    import nbformat

    return nbformat.writes(nb) + "\n"  # json.dumps ends without one; nbformat.write adds it


# --- mutant harness: run a check on the solution, the stub, and planted mistakes ---------------------

def exercise_source(nb_path: str | Path, exercise: str) -> str:
    import nbformat

    return exercise_cells(nbformat.read(str(nb_path), as_version=4))[exercise].source


def exec_cell(source: str) -> dict:
    """Execute an exercise cell as a notebook would (module ``__main__``) and return its namespace."""
    ns: dict = {"__name__": "__main__"}
    exec(compile(source, "<exercise cell>", "exec"), ns)
    return ns


def mutate(source: str, old: str, new: str) -> str:
    if old not in source:
        raise AssertionError(f"mutant does not apply: {old!r} is not in the solution")
    return source.replace(old, new)


def verdict(check: Callable, fn: Callable, seed: int | None = None) -> tuple[bool, str]:
    """(passed, message) of ``check(fn)``; the message is the printed line or the failure text."""
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            check(fn, seed=seed)
    except AssertionError as e:
        return False, str(e)
    return True, buf.getvalue().strip()


def stub_verdict(nb_path, exercise: str, function: str) -> tuple[bool, str]:
    """The check's verdict on the released stub of that cell."""
    from ..checks import REGISTRY
    stub = strip_solution(exercise_source(nb_path, exercise), f"Exercise {exercise}: stub")
    return verdict(REGISTRY[exercise], exec_cell(stub)[function])


def mutant_verdict(nb_path, exercise: str, function: str, edits, seed: int | None = 7) -> tuple[bool, str]:
    """The check's verdict on the solution with textual ``edits`` [(old, new), ...] planted in it (none: as written)."""
    from ..checks import REGISTRY
    src = exercise_source(nb_path, exercise)
    for old, new in edits:
        src = mutate(src, old, new)
    return verdict(REGISTRY[exercise], exec_cell(src)[function], seed)


def sweep_seeds() -> range:
    """The seeds a mutant sweep runs: ``MGPU_SEEDS`` of them (``make test`` 20, ``make test-fast`` 2)."""
    return range(int(os.environ.get("MGPU_SEEDS", "20")))


def mutant_fails_every_seed(nb_path, exercise: str, function: str, edits, named: str, seeds=None) -> None:
    """The planted mistake fails the check, naming ``named``, under every seed (default: :func:`sweep_seeds`):
    a check whose verdict depends on the draw lets a learner pass in the notebook and fail at grading."""
    for seed in sweep_seeds() if seeds is None else seeds:
        ok, msg = mutant_verdict(nb_path, exercise, function, edits, seed=seed)
        assert not ok, f"mutant {edits!r} passed the check with seed {seed}"
        assert named in msg, f"seed {seed}: {named!r} not named in: {msg}"
