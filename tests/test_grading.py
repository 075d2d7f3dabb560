"""The instructor grader `mgpu-grade` on a generated class of the fixture course (tests/grading_fixtures).

One grading run (module fixture) covers: a perfect student, the untouched release, partial work, a named
mistake, a hidden-check failure, a missing notebook, and one student per tamper vector (edited check cells, skip tags,
stored outputs, monkeypatched checks, exits, loops, floods, malformed JSON, ...).
Every tamper student solves 90.2 and tampers around 90.1: 90.1 (and its hidden check) must score 0 and
90.2 full marks. The fixture notebook is stored as *.ipynb.json so that `pytest --nbval` does not collect it.
"""
from __future__ import annotations

import copy
import csv
import hashlib
import json
import math
import os
import shutil
from pathlib import Path

import nbformat
import pytest

from mgpu_helpers.tools.authoring import mgpu, release_notebook
from mgpu_helpers.tools.grading import assemble as asm
from mgpu_helpers.tools.grading.cli import main as grade_main
from mgpu_helpers.tools.grading.execute import sandbox
from mgpu_helpers.tools.grading.score import seed_for

FIX = Path(__file__).parent / "grading_fixtures"
NB = "90_fixture.ipynb"
OK1 = "Exercise 90.1 ✓ scale: 3/3 cases"
WRONG_SCALE = "import torch\n\n\ndef scale(x, k):\n    return x + k\n"
SANDBOXED = sandbox()[0] is not None
MAX_PROCESSES = 96 + 4 * (os.cpu_count() or 1)  # --max-processes of the graded class
pytestmark = pytest.mark.slow


def solution() -> nbformat.NotebookNode:
    return nbformat.reads((FIX / f"{NB}.json").read_text(), as_version=4)


def cell(nb, key, ex):
    return next(c for c in nb.cells if mgpu(c).get(key) == ex)


def release_with(**sources) -> nbformat.NotebookNode:
    """The student copy with some exercise cells replaced (keyword: 'e90_1' -> source)."""
    nb = release_notebook(solution())
    for k, src in sources.items():
        cell(nb, "exercise", k[1:].replace("_", ".")).source = src
    return nb


def solved(ex):
    return cell(solution(), "exercise", ex).source


def with_good_90_2(nb):
    cell(nb, "exercise", "90.2").source = solved("90.2")
    return nb


TAMPER_CELLS = {
    "t_monkeypatch": WRONG_SCALE + (
        "import mgpu_helpers.checks as _c\n"
        "def _fake(self, fn, seed=None):\n    print(f'Exercise {self.id} ✓ {self.function}: 3/3 cases')\n"
        "type(_c.REGISTRY['90.1']).__call__ = _fake\n"
        "_c.REGISTRY['90.1'].run_all = lambda fn, seed: [{'ok': True, 'result': 0.0}] * 3\n"
        "_c.REGISTRY['90.1'].judge_all = lambda seed, results: (True, 'accepted')\n"),
    "t_showtraceback": WRONG_SCALE + (
        f"get_ipython().showtraceback = lambda *a, **k: print({OK1!r})\n"),
    "t_input_transformer": solved("90.1") + (
        "\ndef _blank(lines):\n"
        f"    return [\"print({OK1!r})\\n\"] if any('check_90_1' in l for l in lines) else []\n"
        "get_ipython().input_transformers_post.append(_blank)\n"),
    "t_sys_exit": "import sys\n\n\ndef scale(x, k):\n    sys.exit(0)\n",
    "t_os_exit": "import os\n\n\ndef scale(x, k):\n    os._exit(0)\n",
    "t_infinite_loop": "def scale(x, k):\n    while True:\n        pass\n",
    "t_memory_bomb": "import torch\n\n\ndef scale(x, k):\n    hog = []\n    while True:\n"
                     "        hog.append(torch.empty(2**28))  # 1 GiB each, never touched\n",
    "t_output_flood": "def scale(x, k):\n    while True:\n        print('spam ' * 2000)\n",
    # Doubling, but bounded (2 x the limit at most, should the limit not hold): the bomb's processes sleep.
    "t_fork_bomb": "import os\nimport time\n\n\ndef scale(x, k):\n    me = os.getpid()\n"
                   f"    for _ in range({math.ceil(math.log2(MAX_PROCESSES)) + 1}):\n"
                   "        try:\n            os.fork()\n        except OSError:\n            break\n"
                   "    if os.getpid() != me:\n        time.sleep(60)\n        os._exit(0)\n    return x * k\n",
}

READ_SOLUTIONS = '''import ctypes, glob, json, pathlib
import mgpu_helpers
libc = ctypes.CDLL(None)
for d in [{sol!r}, {hid!r}, {sub!r}]:
    libc.umount2(d.encode(), 2)                    # try to undo the grader's mounts
try:                                               # try to make every judge accept
    open({mod!r}, "a").write("\\nimport mgpu_helpers.checks as c; c.Check.judge_all = lambda *a: (True, 'ok')\\n")
except OSError:
    pass
repo = pathlib.Path(mgpu_helpers.__file__).parents[1]  # the solutions next to the installed package
paths = glob.glob(str(repo / "solutions" / "*.ipynb")) + glob.glob(str(repo / "tests" / "grading_fixtures" / "*.json"))
paths += glob.glob({sol!r} + "/*.ipynb") + glob.glob({sub!r} + "/perfect/*.ipynb") + glob.glob({hid!r} + "/*.py")
for p in paths:
    try:
        cells = json.load(open(p))["cells"]
    except (OSError, ValueError):
        continue
    for c in cells:
        if c.get("metadata", {{}}).get("mgpu", {{}}).get("exercise") == "90.1":
            exec("".join(c["source"]))             # defines scale from someone else's notebook
'''

# student -> expected (points of 90.1, status of 90.1); all tamper students must get 90.2 in full
TAMPER = {
    "t_edit_check": "failed", "t_delete_check": "failed", "t_tags": "failed", "t_nbval_comments": "failed",
    "t_edit_outputs": "failed", "t_monkeypatch": "failed", "t_showtraceback": "failed",
    "t_input_transformer": "failed", "t_read_solutions": "failed", "t_sys_exit": "failed",
    "t_os_exit": "kernel-died", "t_infinite_loop": "timeout", "t_memory_bomb": "memory-limit",
    "t_output_flood": "output-limit", "t_dup_ids": "duplicate-exercise", "t_changed_ids": "missing-exercise",
    "t_fork_bomb": "process-limit",
}
NEEDS_SANDBOX = ("t_read_solutions", "t_fork_bomb")  # without namespaces: warned about, and not run


def build_class(root: Path, paths: dict) -> None:
    def put(student, nb=None, text=None):
        (root / student).mkdir(parents=True)
        if nb is not None or text is not None:
            (root / student / NB).write_text(text if text is not None else json.dumps(nb, indent=1))

    put("perfect", solution())
    put("untouched", release_notebook(solution()))
    nb = release_notebook(solution())  # the stub with a line added: not the release's, so it runs
    cell(nb, "exercise", "90.1").source += "\n# to do: multiply\n"
    put("stub_with_a_note", nb)
    put("partial", release_with(e90_1=solved("90.1")))
    put("mistake", with_good_90_2(release_with(e90_1=WRONG_SCALE)))
    put("special_case", with_good_90_2(release_with(
        e90_1="def scale(x, k):\n    return x * k if x.numel() < 100 else x\n")))
    put("no_notebook")
    for name, src in TAMPER_CELLS.items():
        if name not in NEEDS_SANDBOX or SANDBOXED:
            put(name, with_good_90_2(release_with(e90_1=src)))
    put("t_read_solutions", with_good_90_2(release_with(e90_1=READ_SOLUTIONS.format(**paths))))
    nb = with_good_90_2(release_with(e90_1=WRONG_SCALE))
    cell(nb, "check", "90.1").source = f"print({OK1!r})"
    put("t_edit_check", nb)
    nb = with_good_90_2(release_with(e90_1=WRONG_SCALE))
    nb.cells.remove(cell(nb, "check", "90.1"))
    put("t_delete_check", nb)
    nb = with_good_90_2(release_with(e90_1=WRONG_SCALE))
    for c in (cell(nb, "check", "90.1"), cell(nb, "exercise", "90.1")):
        c.metadata["tags"] = c.metadata.get("tags", []) + ["raises-exception", "nbval-skip"]
    put("t_tags", nb)
    nb = with_good_90_2(release_with(e90_1="# NBVAL_SKIP\n# NBVAL_RAISES_EXCEPTION\n" + WRONG_SCALE))
    cell(nb, "check", "90.1").source = "# NBVAL_SKIP\ncheck_90_1(scale)"
    put("t_nbval_comments", nb)
    nb = with_good_90_2(release_with(e90_1=WRONG_SCALE))
    c = cell(nb, "check", "90.1")
    c.metadata["tags"] = ["check", "raises-exception"]
    c.outputs = [nbformat.v4.new_output("error", ename="CheckFailure", evalue="whatever", traceback=[])]
    put("t_edit_outputs", nb)
    nb = with_good_90_2(release_with(e90_1=solved("90.1")))
    dup = copy.deepcopy(cell(nb, "exercise", "90.1"))
    nb.cells.insert(nb.cells.index(cell(nb, "exercise", "90.1")), dup)
    cell(nb, "exercise", "90.2")["id"] = nb.cells[0]["id"]  # a duplicated cell id changes nothing
    put("t_dup_ids", nb)
    nb = with_good_90_2(release_with(e90_1=solved("90.1")))
    cell(nb, "exercise", "90.1").metadata["mgpu"]["exercise"] = "90.9"
    put("t_changed_ids", nb)
    text = json.dumps(solution())
    put("t_malformed_json", text=text[: len(text) // 2])
    put("t_not_a_notebook", text=json.dumps({"cells": "nope"}))


def snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}


def read_rows(out: Path) -> dict:
    with open(out / "grades.csv", newline="", encoding="utf-8") as f:
        return {(r["student"], r["exercise"]): r for r in csv.DictReader(f)}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grading")
    sol, pkg, hid, sub, out = (tmp / n for n in ("solutions", "pkg", "hidden", "submissions", "out"))
    for d in (sol, pkg, hid):
        d.mkdir()
    shutil.copy(FIX / f"{NB}.json", sol / NB)
    shutil.copy(FIX / "fixture_course.py", pkg / "fixture_course.py")
    shutil.copy(FIX / "hidden_checks.py", hid / "hidden_checks.py")
    build_class(sub, {"sol": str(sol), "hid": str(hid), "sub": str(sub), "mod": str(pkg / "fixture_course.py")})
    before = snapshot(sub)
    args = ["--out", str(out), "--solutions", str(sol), "--hidden", str(hid), "--import-path", str(pkg),
            "--jobs", "2", "--timeout", "20", "--notebook-timeout", "150", "--key", "test-key",
            "--max-processes", str(MAX_PROCESSES)]
    rc = grade_main([str(sub), *args])
    return {"tmp": tmp, "sub": sub, "out": out, "args": args, "rc": rc, "before": before, "rows": read_rows(out),
            "pkg": pkg}


def points(rows, student):
    return sum(int(r["points"]) for (s, _), r in rows.items() if s == student)


def test_perfect_student_gets_full_marks(graded):
    rows = graded["rows"]
    assert graded["rc"] == 0
    assert {k[1]: r["status"] for k, r in rows.items() if k[0] == "perfect"} == {
        "90.1": "passed", "90.1 hidden: LongVectors": "passed", "90.2": "passed", "90.2 hidden: WideHalfLayers": "passed"}
    assert points(rows, "perfect") == 5
    assert rows[("perfect", "90.1")]["message"] == OK1


def test_untouched_release_scores_zero_without_crashing(graded):
    rows = {k: r for k, r in graded["rows"].items() if k[0] == "untouched"}
    assert len(rows) == 4 and all(r["status"] == "not-implemented" and r["points"] == "0" for r in rows.values())
    assert "not implemented yet" in rows[("untouched", "90.1")]["message"]


def test_a_stub_with_a_line_added_runs_and_reads_not_implemented(graded):
    rows = {k[1]: r for k, r in graded["rows"].items() if k[0] == "stub_with_a_note"}
    assert len(rows) == 4 and all(r["status"] == "not-implemented" and r["points"] == "0" for r in rows.values())
    assert "not implemented yet" in rows["90.1"]["message"]


def test_partial_work_mistakes_and_hidden_checks(graded):
    rows = graded["rows"]
    assert points(rows, "partial") == 3 and rows[("partial", "90.2")]["status"] == "not-implemented"
    assert rows[("mistake", "90.1")]["status"] == "failed"
    assert "added k instead of multiplying" in rows[("mistake", "90.1")]["message"]
    assert points(rows, "mistake") == 2
    # passes the public cases, fails the instructor's hidden ones
    assert rows[("special_case", "90.1")]["status"] == "passed"
    assert rows[("special_case", "90.1 hidden: LongVectors")]["status"] == "failed"
    assert points(rows, "special_case") == 4
    assert {r["status"] for k, r in rows.items() if k[0] == "no_notebook"} == {"missing-notebook"}


@pytest.mark.parametrize("student", sorted(TAMPER))
def test_tamper_vector_scores_zero_on_the_affected_check_only(graded, student):
    if student in NEEDS_SANDBOX and not SANDBOXED:
        pytest.skip("no mount/pid namespace here: the grader warns that it runs best effort")
    rows = graded["rows"]
    got = {k[1]: (r["points"], r["status"]) for k, r in rows.items() if k[0] == student}
    assert got["90.1"] == ("0", TAMPER[student]), rows[(student, "90.1")]["message"]
    assert got["90.1 hidden: LongVectors"][0] == "0"
    assert got["90.2"] == ("1", "passed"), rows[(student, "90.2")]["message"]
    assert got["90.2 hidden: WideHalfLayers"] == ("1", "passed")


def test_unreadable_or_invalid_files_get_clear_rows(graded):
    rows = graded["rows"]
    for student, words in (("t_malformed_json", "not valid JSON"), ("t_not_a_notebook", "not a valid Jupyter notebook")):
        mine = [r for k, r in rows.items() if k[0] == student]
        assert len(mine) == 4 and {r["status"] for r in mine} == {"invalid-notebook"}
        assert all(words in r["message"] and r["points"] == "0" for r in mine)


def test_outputs_are_complete_and_never_show_hidden_source(graded):
    out, rows = graded["out"], graded["rows"]
    assert (out / "grades.csv").read_text().splitlines()[0] == "student,notebook,exercise,points,max_points,status,message"
    assert (out / "summary.png").read_bytes()[:4] == b"\x89PNG"
    students = {s for s, _ in rows}
    for s in students:
        res = json.loads((out / s / "results.json").read_text())
        assert res["score"] == points(rows, s) and len(res["tests"]) == 4
        assert all({"name", "score", "max_score", "output"} <= set(t) for t in res["tests"])
        assert "# Feedback for" in (out / s / "feedback.md").read_text()
    assert "added k instead of multiplying" in (out / "mistake" / "feedback.md").read_text()
    for p in out.rglob("*"):
        if p.is_file() and p.suffix in (".md", ".json", ".csv"):
            text = p.read_text()
            assert "HIDDEN-SOURCE-MARKER" not in text and "def cases" not in text, p


def test_submissions_and_course_files_are_never_modified(graded):
    assert snapshot(graded["sub"]) == graded["before"]
    assert (graded["pkg"] / "fixture_course.py").read_text() == (FIX / "fixture_course.py").read_text()


def test_regrading_gives_identical_results_even_without_the_sandbox(graded, tmp_path, capsys):
    """Same key, same submissions -> byte-identical rows and files. Re-graded here with --no-sandbox,
    which also shows that the fallback (warned about) still contains a kernel that exits."""
    sub2, out2, again = tmp_path / "sub", tmp_path / "out", ("partial", "t_os_exit")
    for s in again:
        shutil.copytree(graded["sub"] / s, sub2 / s)
    args = list(graded["args"])
    args[args.index("--out") + 1] = str(out2)
    assert grade_main([str(sub2), *args, "--no-sandbox"]) == 0
    assert "WARNING" in capsys.readouterr().err
    assert read_rows(out2) == {k: r for k, r in graded["rows"].items() if k[0] in again}
    for s in again:
        assert (out2 / s / "feedback.md").read_bytes() == (graded["out"] / s / "feedback.md").read_bytes()
        ours, theirs = (json.loads((o / s / "results.json").read_text()) for o in (out2, graded["out"]))
        assert ours.pop("output").startswith("isolation: NONE")  # says so to the student and the instructor
        theirs.pop("output")
        assert ours == theirs


# --- assembly, without running anything ------------------------------------------------------------

def test_assembly_takes_only_cleaned_exercise_cells(tmp_path):
    sol = tmp_path / NB
    sol.write_text((FIX / f"{NB}.json").read_text())
    course = asm.load_course(tmp_path)[0]
    nb = release_with(e90_1="# NBVAL_SKIP\n  #NBVAL_RAISES_EXCEPTION\nx = 1  # keep me\n")
    cell(nb, "exercise", "90.1").metadata["tags"] = ["raises-exception"]
    cell(nb, "check", "90.1").source = "print('forged')"
    (tmp_path / "s.ipynb").write_text(json.dumps(nb))
    sub = asm.read_submission(tmp_path / "s.ipynb", course)
    assert sub.status == "ok" and sub.sources["90.1"] == "x = 1  # keep me"
    built, layout = asm.assemble(course, sub.sources, set(), "/work")
    ex, ck = cell(built, "exercise", "90.1"), cell(built, "check", "90.1")
    assert ex.source == "x = 1  # keep me" and ex.metadata["tags"] == ["exercise"]
    assert ck.source == "check_90_1(scale)" and ck.outputs[0]["text"] == OK1 + "\n"
    code = [c for c in built.cells if c.cell_type == "code"]
    assert "harvest('90.1'" in code[layout.harvest["90.1"]].source and layout.harvest["90.1"] == layout.check["90.1"] + 1
    # the run ends at the last harvest: the summary after it decides no grade and is not run
    assert "harvest" in built.cells[-1].metadata["mgpu_grade"] and not any("## Summary" in c.source for c in built.cells)
    stubbed, _ = asm.assemble(course, sub.sources, {"90.1"}, "/work")
    assert "raise NotImplementedError" in cell(stubbed, "exercise", "90.1").source


def test_missing_duplicate_and_invalid_submissions(tmp_path):
    (tmp_path / NB).write_text((FIX / f"{NB}.json").read_text())
    course = asm.load_course(tmp_path)[0]
    assert asm.read_submission(tmp_path / "nope.ipynb", course).status == "missing-notebook"
    (tmp_path / "bad.ipynb").write_text('{"cells": [')
    assert asm.read_submission(tmp_path / "bad.ipynb", course).status == "invalid-notebook"
    nb = release_notebook(solution())
    nb.cells.append(copy.deepcopy(cell(nb, "exercise", "90.1")))
    cell(nb, "exercise", "90.2").metadata["mgpu"]["exercise"] = "9.2"
    (tmp_path / "dup.ipynb").write_text(json.dumps(nb))
    sub = asm.read_submission(tmp_path / "dup.ipynb", course)
    assert sub.problems["90.1"][0] == "duplicate-exercise" and sub.problems["90.2"][0] == "missing-exercise"


def test_the_course_released_untouched_is_graded_without_running(tmp_path, monkeypatch):
    """Every released notebook of the course, submitted as released: each exercise "not-implemented", in the
    check's own words, and neither the sandbox nor the judge is called (a class mid-course submits them all)."""
    from mgpu_helpers.tools.grading import score

    def boom(*args, **kwargs):
        raise AssertionError("an untouched notebook was run or judged")
    monkeypatch.setattr(score, "run_job", boom)
    ctx = score.Context(key=b"k", limits=None, hidden={}, modules={}, keep=[], import_paths=[], mpl_cache="",
                        extra={})
    root = Path(__file__).resolve().parent.parent
    graded = 0
    for course in asm.load_course(root / "solutions"):
        rows = score.grade_notebook(ctx, boom, "s", course, asm.read_submission(root / "notebooks" / course.name,
                                                                                course), tmp_path)
        assert [r.exercise for r in rows] == [e.id for e in course.exercises]
        for r, e in zip(rows, course.exercises):
            assert (r.status, r.points) == ("not-implemented", 0), (course.name, r)
            assert r.message == f"Exercise {e.id} ✗ {e.function}: not implemented yet"
        graded += len(rows)
    assert graded >= 20


def test_seeds_are_secret_but_reproducible():
    assert seed_for(b"k", "ann", NB, "90.1", "") == seed_for(b"k", "ann", NB, "90.1", "")
    assert len({seed_for(b"k", "ann", NB, "90.1", ""), seed_for(b"k", "bob", NB, "90.1", ""),
                seed_for(b"other", "ann", NB, "90.1", "")}) == 3


def test_packages_installed_beside_the_environment_are_visible_to_the_kernel(tmp_path, monkeypatch):
    """`pip install --target DIR` on PYTHONPATH (or `pip install --user`): the kernel's own packages (nbval,
    ipykernel) live there, so the sandbox keeps that folder; a source checkout on sys.path is not kept."""
    from mgpu_helpers.tools.grading.execute import needed_paths
    site_dir, checkout = tmp_path / "site", tmp_path / "checkout"
    (site_dir / "nbval-0.11.0.dist-info").mkdir(parents=True)
    (checkout / "mgpu_helpers.egg-info").mkdir(parents=True)
    (checkout / "solutions").mkdir()
    monkeypatch.setattr("sys.path", [*__import__("sys").path, str(site_dir), str(checkout)])
    keep = needed_paths([])
    assert str(site_dir) in keep and str(checkout) not in keep


@pytest.mark.parametrize("make, args, message", [
    (lambda t: None, ["{t}/nowhere", "--out", "{t}/out"], "nowhere is not a directory"),
    (lambda t: (t / "sub").mkdir(), ["{t}/sub", "--out", "{t}/out"], "no student folders in"),
    (lambda t: (t / "sub").mkdir() or (t / "sub" / NB).write_text("{}"), ["{t}/sub", "--out", "{t}/out"],
     "1 notebook(s) lie directly in it: move them into a folder named for the student"),
    (None, ["{t}/sub", "--out", "{t}/sub/grades"], "is inside the submissions"),
    (None, ["{t}/sub", "--out", "{t}/sub/ann/x"], "is inside the submissions"),
    (lambda t: (t / "sub" / "ann").mkdir(parents=True) or (t / "out").write_text("x"),
     ["{t}/sub", "--out", "{t}/out"], "exists and is not a directory"),
    (None, ["{t}/sub", "--out", "{t}/out", "--jobs", "0"], "--jobs 0: must be > 0"),
    (None, ["{t}/sub", "--out", "{t}/out", "--timeout", "-1"], "--timeout -1: must be > 0"),
    (None, ["{t}/sub", "--out", "{t}/out", "--notebook-timeout", "0"], "--notebook-timeout 0: must be > 0"),
    (None, ["{t}/sub", "--out", "{t}/out", "--max-processes", "-1"], "--max-processes -1: must be >= 0"),
    (None, ["{t}/sub", "--out", "/proc/no/such/dir"], "cannot create it"),
    (None, ["{t}/sub", "--out", "{t}/out", "--solutions", "{t}/sub"], "no solution notebooks (NN_name.ipynb) in"),
    (None, ["{t}/sub", "--out", "{t}/out", "--hidden", "{t}/hiden"], "--hidden {t}/hiden is not a directory"),
    (None, ["{t}/sub", "--out", "{t}/out", "--import-path", "{t}/pkg"], "--import-path {t}/pkg is not a directory"),
])
def test_bad_command_lines_are_one_line_and_change_nothing(tmp_path, capsys, make, args, message):
    """An instructor's slip (a wrong folder, grades written among the submissions, a negative limit) is one
    line on stderr and exit 2, before any notebook runs or any file is written."""
    (make or (lambda t: (t / "sub" / "ann").mkdir(parents=True)))(tmp_path)
    before = snapshot(tmp_path)
    assert grade_main([a.format(t=tmp_path) for a in args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mgpu-grade: ") and message.format(t=tmp_path) in err, err
    assert snapshot(tmp_path) == before and not (tmp_path / "out").is_dir()
