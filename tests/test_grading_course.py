"""The course itself, graded end to end as an instructor grades it: `mgpu-grade` over the thirteen notebooks.

One class run (module fixture, ``--jobs 2``) shared by every assertion, three students:
- ``perfect``: the solution notebooks, copied unchanged -> every exercise full marks;
- ``released``: the student notebooks as released, untouched -> every exercise 0, "not implemented" (without
  running them: the grader knows the release's stubs; tests/test_grading.py runs a stub with a line added);
- ``mistakes``: the solutions with one common mistake planted per notebook (taken from that notebook's
  mutant tests, so the mistake and the words that name it are the ones the check is proven on) -> 0 on that
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

import test_mutants_01 as m01
import test_mutants_02 as m02
import test_mutants_03 as m03
import test_mutants_04 as m04
import test_mutants_05 as m05
import test_mutants_06 as m06
import test_mutants_07 as m07
import test_mutants_08 as m08
import test_mutants_09 as m09
import test_mutants_10 as m10
import test_mutants_11 as m11
import test_mutants_12 as m12

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def _first(cases: dict, ex: str):
    """The first planted mistake of ``ex`` in a mutant module's CASES, as (edits, named)."""
    mistake = cases[ex][1][0]
    if isinstance(mistake[0], str):           # (old, new, named)
        return [(mistake[0], mistake[1])], mistake[2]
    return mistake[0], mistake[1]             # (edits, named[, every seed])


# notebook -> (exercise, edits to its solution cell, words feedback.md must contain)
PLANTED = {
    "01_where_memory_goes": ("1.1", *_first(m01.CASES, "1.1")),
    "02_measuring_memory": ("2.1", *_first(m02.CASES, "2.1")),
    "03_data_parallel": ("3.1", [m03.MUTANTS[3][:2]], m03.MUTANTS[3][2]),
    "04_ddp": ("4.1", *_first(m04.CASES, "4.1")),
    "05_gradient_accumulation": ("5.1", *_first(m05.CASES, "5.1")),
    "06_mixed_precision": ("6.1", *_first(m06.CASES, "6.1")),
    "07_activation_checkpointing": ("7.1", *m07.EVERY_SEED[1]),
    "08_sharding_zero": ("8.1", *_first(m08.CASES, "8.1")),
    "09_model_sharding": ("9.1", *_first(m09.CASES, "9.1")),
    "10_data_loading": ("10.1", *m10.MUTANTS[1]),
    "11_capstone_fit_the_budget": ("11.1", *m11.MUTANTS[0]),
    "12_fsdp2_in_practice": ("12.2", *_first(m12.CASES, "12.2")),
}


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
