"""The course itself, graded end to end as an instructor grades it: `mgpu-grade` over the thirteen notebooks.

One class run (module fixture, ``--jobs 2``) shared by every assertion, three students:
- ``perfect``: the solution notebooks, copied unchanged -> every exercise full marks;
- ``released``: the student notebooks as released, untouched -> every exercise 0, "not implemented" (without
  running them: the grader knows the release's stubs; tests/test_grading.py runs a stub with a line added);
- ``mistakes``: the solutions with one common mistake planted per notebook (taken from tests/mutants.py,
  so the mistake and the words that name it are the ones the check is proven on) -> 0 on that
  exercise only, the mistake named in the student's feedback.md, and every other exercise full marks.

The fixture course (tests/test_grading.py) proves the grader's mechanics and its tamper vectors; this proves
the course's own check cells and judges under the sandbox that hides ``checks/references/`` (the
course's solutions once scored 36/52 here while every study-mode test passed).
"""
from __future__ import annotations

import csv
import os
import shutil
from collections import defaultdict
from pathlib import Path

import nbformat
import pytest

from mgpu_helpers.tools.authoring import mgpu
from mgpu_helpers.tools.grading.cli import main as grade_main

from mutants import EXERCISES

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


# One exercise per notebook, and the words of the mistake planted in it (tests/mutants.py, where the check is
# proven to name it): notebook -> (exercise, edits to its solution cell, words feedback.md must contain)
GRADED = {
    "1.1": "Adam keeps TWO states",
    "2.1": "returned the CURRENT bytes after the step",
    "3.1": "never copied back",
    "4.1": "summed with all_reduce but not divided by the world size",
    "5.1": "weighted each micro-batch's mean loss by 1/k",
    "6.1": "grew one step late",
    "7.1": "use_reentrant=True with an input that does not require grad",
    "8.1": "other ranks' updated parameters never arrived",
    "9.1": "the gradient was never sent back",
    "10.1": "set_epoch forgotten",
    "11.1": "a plan whose device total equals the capacity fits",
    "12.2": "optimizer state was not saved or not loaded",
}
PLANTED = {EXERCISES[ex].notebook: (ex, next(m.edits for m in EXERCISES[ex].mistakes if m.named == named), named)
           for ex, named in GRADED.items()}


def _exercise_cell(nb, ex):
    return next(c for c in nb.cells if mgpu(c).get("exercise") == ex)


def _with_mistake(path: Path, ex: str, edits) -> nbformat.NotebookNode:
    nb = nbformat.read(path, as_version=4)
    cell = _exercise_cell(nb, ex)
    for old, new in edits:
        assert old in cell.source, f"{path.name} {ex}: the planted edit no longer applies: {old[:60]!r}"
        cell.source = cell.source.replace(old, new, 1)
    return nb


def _rows(out: Path) -> dict:
    """student -> notebook -> exercise -> row (public checks; hidden rows, if any, are kept under their ids)."""
    table: dict = defaultdict(lambda: defaultdict(dict))
    with open(out / "grades.csv", newline="", encoding="utf-8") as f:
        for r in csv.DictReader(f):
            table[r["student"]][r["notebook"].removesuffix(".ipynb")][r["exercise"]] = r
    return table


@pytest.fixture(scope="module")
def course_graded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("course-grading")
    sub, out = tmp / "submissions", tmp / "out"
    for student in ("perfect", "released", "mistakes"):
        (sub / student).mkdir(parents=True)
    for path in sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb")):
        shutil.copy(path, sub / "perfect" / path.name)
        shutil.copy(ROOT / "notebooks" / path.name, sub / "released" / path.name)
        planted = PLANTED.get(path.stem)
        if planted is None:
            shutil.copy(path, sub / "mistakes" / path.name)
        else:
            nbformat.write(_with_mistake(path, planted[0], planted[1]), sub / "mistakes" / path.name)
    # --timeout: the class shares 2 cores with the rest of the suite (a 120 s default cell bar timed out 11.1).
    # MGPU_CLASS_JOBS: more notebooks at once on a host with more cores (bench/device_suite.sh on 16)
    jobs = os.environ.get("MGPU_CLASS_JOBS", "2")
    rc = grade_main([str(sub), "--out", str(out), "--jobs", jobs, "--timeout", "300", "--key", "course-test-key"])
    return {"rc": rc, "out": out, "rows": _rows(out),
            "notebooks": sorted(p.stem for p in (ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))}


def _all(g, student):
    return [r for nb in g["rows"][student].values() for r in nb.values()]


def test_the_class_was_graded(course_graded):
    assert course_graded["rc"] == 0
    assert set(course_graded["rows"]) == {"perfect", "released", "mistakes"}
    for student in course_graded["rows"]:
        with_exercises = [nb for nb in course_graded["notebooks"] if course_graded["rows"][student].get(nb)]
        # every notebook that has an exercise is graded for every student
        assert set(with_exercises) == set(PLANTED), (student, with_exercises)


def test_the_solutions_score_full_marks(course_graded):
    rows = _all(course_graded, "perfect")
    wrong = [f"{r['exercise']}: {r['status']}: {r['message']}" for r in rows if r["points"] != r["max_points"]]
    assert not wrong, "the course's own solutions lose points:\n" + "\n".join(wrong)
    assert sum(int(r["max_points"]) for r in rows) > 0


def test_the_untouched_release_scores_zero_not_implemented(course_graded):
    rows = _all(course_graded, "released")
    assert rows
    wrong = [f"{r['exercise']}: {r['points']} {r['status']}: {r['message']}" for r in rows
             if r["points"] != "0" or r["status"] != "not-implemented"]
    assert not wrong, "the release scores where nothing is implemented:\n" + "\n".join(wrong)


@pytest.mark.parametrize("notebook", sorted(PLANTED))
def test_a_planted_mistake_loses_its_exercise_only_and_is_named(course_graded, notebook):
    ex, _, named = PLANTED[notebook]
    rows = course_graded["rows"]["mistakes"][notebook]
    for exercise, r in rows.items():
        if exercise == ex or exercise.startswith(f"{ex} hidden:"):
            continue
        assert r["points"] == r["max_points"], f"{notebook} {exercise} lost points for {ex}'s mistake: {r['message']}"
    r = rows[ex]
    assert r["points"] == "0" and r["status"] == "failed", (r["status"], r["message"])
    assert named in r["message"], f"{ex}: the feedback does not name the mistake ({named!r}): {r['message']}"
    feedback = (course_graded["out"] / "mistakes" / "feedback.md").read_text()
    assert named in feedback


def test_feedback_never_shows_a_traceback(course_graded):
    for student in ("perfect", "released", "mistakes"):
        text = (course_graded["out"] / student / "feedback.md").read_text()
        assert "Traceback (most recent call last)" not in text and "ModuleNotFoundError" not in text, student
