"""A class split over SLURM array tasks (``mgpu-grade --shard K/N``, ``mgpu-grade merge``) and the isolation
line every run prints and puts in every results.json.

The class is graded without running a notebook (the untouched release, a missing notebook, an invalid
file: the grader decides those without a kernel), so each run costs only the grader's start.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import nbformat
import pytest

from mgpu_helpers.tools.authoring import release_notebook
from mgpu_helpers.tools.grading.cli import main as grade_main
from mgpu_helpers.tools.grading.execute import isolation_line, reset_sandbox
from mgpu_helpers.tools.grading.report import partition

FIX = Path(__file__).parent / "grading_fixtures"
NB = "90_fixture.ipynb"
STUDENTS = ["ana", "ben", "cleo", "dev", "eli", "fay", "gus"]


def test_shards_are_a_deterministic_partition():
    names = [f"s{i:03d}" for i in range(53)]
    for n in (1, 2, 3, 8, 60):
        slices = partition(names, b"key", n)
        assert len(slices) == n
        assert sorted(s for sl in slices for s in sl) == names          # every student exactly once
        assert max(map(len, slices)) - min(map(len, slices)) <= 1      # balanced
        assert partition(list(reversed(names)), b"key", n) == slices   # stable: the order given changes nothing
    assert partition(names, b"other key", 4) != partition(names, b"key", 4)


@pytest.fixture(scope="module")
def course(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("shards")
    (tmp / "solutions").mkdir()
    shutil.copy(FIX / f"{NB}.json", tmp / "solutions" / NB)
    sub = tmp / "sub"
    stub = nbformat.writes(release_notebook(nbformat.reads((FIX / f"{NB}.json").read_text(), as_version=4)))
    for i, s in enumerate(STUDENTS):
        (sub / s).mkdir(parents=True)
        if i % 3 == 0:
            (sub / s / NB).write_text(stub)
        elif i % 3 == 1:
            (sub / s / NB).write_text("{ not json")
    return tmp


def grade(course, out, *extra):
    reset_sandbox()
    return grade_main([str(course / "sub"), "--out", str(out), "--solutions", str(course / "solutions"),
                       "--import-path", str(FIX), "--key", "shard-key", "--jobs", "1", *extra])


def test_merged_shards_are_one_run_and_a_dead_shard_is_missing(course, tmp_path, capsys):
    assert grade(course, tmp_path / "one") == 0
    for k in (1, 2, 3):
        assert grade(course, tmp_path / f"s{k}", "--shard", f"{k}/3") == 0
    assert grade(course, tmp_path / "s1", "--shard", "1/3") == 0  # a re-run of a shard changes nothing
    marker = json.loads((tmp_path / "s1" / "shard.json").read_text())
    assert marker["students"] == partition(STUDENTS, b"shard-key", 3)[0]

    assert grade_main(["merge", *(str(tmp_path / f"s{k}") for k in (1, 2, 3)), "--out", str(tmp_path / "m")]) == 0
    one, merged = tmp_path / "one", tmp_path / "m"
    assert (merged / "grades.csv").read_bytes() == (one / "grades.csv").read_bytes()
    assert (merged / "summary.png").read_bytes() == (one / "summary.png").read_bytes()
    for s in STUDENTS:
        for f in ("feedback.md", "results.json"):
            assert (merged / s / f).read_bytes() == (one / s / f).read_bytes()
    assert not (merged / "MISSING.txt").exists()

    # Shard 2 died (its marker is written last): its students are reported missing, never given zeros.
    (tmp_path / "s2" / "shard.json").unlink()
    capsys.readouterr()
    assert grade_main(["merge", *(str(tmp_path / f"s{k}") for k in (1, 2, 3)), "--out", str(tmp_path / "m2")]) == 1
    lost = partition(STUDENTS, b"shard-key", 3)[1]
    report = (tmp_path / "m2" / "MISSING.txt").read_text()
    assert "shard 2/3 missing" in report and all(s in report for s in lost)
    assert "NOT graded" in capsys.readouterr().err
    rows = (tmp_path / "m2" / "grades.csv").read_text().splitlines()[1:]
    assert {r.split(",")[0] for r in rows} == set(STUDENTS) - set(lost)


def test_a_shard_needs_the_class_key(course, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("MGPU_GRADE_KEY", raising=False)
    args = [str(course / "sub"), "--out", str(tmp_path / "o"), "--solutions", str(course / "solutions")]
    assert grade_main([*args, "--shard", "1/2"]) == 2
    assert "--shard needs the class's key" in capsys.readouterr().err
    assert grade_main([*args, "--shard", "3/2", "--key", "k"]) == 2
    assert "K/N with 1 <= K <= N" in capsys.readouterr().err


def test_every_run_says_what_isolates_it(course, tmp_path, capsys):
    """One line, in the instructor's log and in every student's results.json; never silently none."""
    assert grade(course, tmp_path / "auto") == 0
    reset_sandbox()
    line = isolation_line()
    assert line.startswith("isolation: ")
    assert f"mgpu-grade: {line}" in capsys.readouterr().out
    assert json.loads((tmp_path / "auto" / "ana" / "results.json").read_text())["output"].startswith(line)
    assert grade(course, tmp_path / "none", "--no-sandbox") == 0
    out = capsys.readouterr()
    assert "mgpu-grade: isolation: NONE" in out.out and "WARNING" in out.err
    assert json.loads((tmp_path / "none" / "ana" / "results.json").read_text())["output"].startswith(
        "isolation: NONE")
    reset_sandbox()
