"""The Gradescope autograder: ``mgpu-course autograder`` writes the zip Gradescope's specification asks
for, and its run_autograder, run on a fake /autograder tree in a temporary folder, grades a fixture
submission into a results.json of Gradescope's schema."""
from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import nbformat
import pytest

from mgpu_helpers.tools.authoring import mgpu, release_notebook
from mgpu_helpers.tools.course import main as course_main
from mgpu_helpers.tools.grading.gradescope import collect

FIX = Path(__file__).parent / "grading_fixtures"
NB = "90_fixture.ipynb"
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def autograder(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gradescope")
    (tmp / "solutions").mkdir()
    (tmp / "hidden").mkdir()
    shutil.copy(FIX / f"{NB}.json", tmp / "solutions" / NB)
    shutil.copy(FIX / "hidden_checks.py", tmp / "hidden" / "hidden_checks.py")
    z = tmp / "autograder.zip"
    assert course_main(["--solutions", str(tmp / "solutions"), "autograder", "--out", str(z), "--hidden",
                        str(tmp / "hidden"), "--import-path", str(FIX), "--key", "gs-key", "--jobs", "1",
                        "--timeout", "60"]) == 0
    return tmp, z


def test_the_zip_is_what_gradescope_asks_for(autograder):
    _, z = autograder
    with zipfile.ZipFile(z) as f:
        names = set(f.namelist())
        mode = {n: f.getinfo(n).external_attr >> 16 for n in names}
        setup, run = f.read("setup.sh").decode(), f.read("run_autograder").decode()
        config = json.loads(f.read("course/grading.json"))
        pins = f.read("constraints.txt").decode()
    assert {"setup.sh", "run_autograder"} <= names                   # at the zip's root, not in a folder
    assert mode["setup.sh"] & stat.S_IXUSR and mode["run_autograder"] & stat.S_IXUSR
    assert setup.startswith("#!/usr/bin/env bash") and run.startswith("#!/usr/bin/env bash")
    import nbval
    import torch
    assert f"torch=={torch.__version__.split('+')[0]}" in setup and "download.pytorch.org/whl/cpu" in setup
    assert f"nbval=={nbval.__version__}" in pins
    assert "/autograder/source/package" in setup and "package/pyproject.toml" in names
    assert "package/mgpu_helpers/tools/grading/gradescope.py" in names
    assert not any("__pycache__" in n for n in names)
    # the key, the solutions and the hidden checks travel in course/, which setup.sh makes root's alone
    assert config["key"] == "gs-key" and config["hidden"] and config["jobs"] == 1
    assert {f"course/solutions/{NB}", "course/hidden/hidden_checks.py"} <= names
    assert "chmod -R go-rwx /autograder/source/course" in setup
    assert "imports/0/fixture_course.py" in names                   # course modules: the kernel imports them
    assert "/autograder/results" not in setup and "mgpu_helpers.tools.grading.gradescope" in run
    # the same course gives the same zip
    again = z.with_name("again.zip")
    assert course_main(["--solutions", str(autograder[0] / "solutions"), "autograder", "--out", str(again), "--hidden",
                        str(autograder[0] / "hidden"), "--import-path", str(FIX), "--key", "gs-key", "--jobs", "1",
                        "--timeout", "60"]) == 0
    assert again.read_bytes() == z.read_bytes()


def test_submitted_files_are_found_wherever_they_lie(tmp_path):
    (tmp_path / "a" / ".ipynb_checkpoints").mkdir(parents=True)
    for p in ("a/01_x.ipynb", "01_x.ipynb", "a/.ipynb_checkpoints/02_y.ipynb", "a/02_y.ipynb", "notes.ipynb"):
        (tmp_path / p).write_text("{}")
    files, notes = collect(tmp_path, {"01_x.ipynb", "02_y.ipynb"})
    assert files == {"01_x.ipynb": tmp_path / "01_x.ipynb", "02_y.ipynb": tmp_path / "a" / "02_y.ipynb"}
    assert any("uploaded 2 times" in n for n in notes) and any("notes.ipynb is not a notebook" in n for n in notes)


@pytest.mark.slow
def test_run_autograder_on_a_fake_autograder_tree(autograder):
    tmp, z = autograder
    root = tmp / "autograder"
    with zipfile.ZipFile(z) as f:
        f.extractall(root / "source")
    shutil.copy(root / "source" / "run_autograder", root / "run_autograder")
    (root / "run_autograder").chmod(0o755)
    # the student's upload: the release, 90.2 done, 90.1 still the stub; in a folder, as a zip upload leaves it
    sol = nbformat.reads((FIX / f"{NB}.json").read_text(), as_version=4)
    nb = release_notebook(sol)
    done = next(c.source for c in sol.cells if mgpu(c).get("exercise") == "90.2")
    next(c for c in nb.cells if mgpu(c).get("exercise") == "90.2").source = done
    (root / "submission" / "work").mkdir(parents=True)
    nbformat.write(nb, root / "submission" / "work" / NB)
    (root / "submission_metadata.json").write_text(json.dumps({"users": [{"id": 7, "email": "s@example.org"}]}))
    env = dict(os.environ, MGPU_AUTOGRADER_ROOT=str(root), MGPU_AUTOGRADER_PYTHON=sys.executable,
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run(["bash", str(root / "run_autograder")], cwd=root, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "isolation: " in r.stdout                                 # the instructor's log (results/stdout)
    res = json.loads((root / "results" / "results.json").read_text())
    # Gradescope's schema: total score, output, per test name/score/max_score/status/output/visibility
    assert set(res) == {"score", "output", "tests"}
    assert res["output"].startswith("isolation: ")
    for t in res["tests"]:
        assert set(t) == {"name", "score", "max_score", "status", "output", "visibility"}
        assert isinstance(t["name"], str) and isinstance(t["output"], str)
        assert 0 <= t["score"] <= t["max_score"] and t["status"] in ("passed", "failed")
        assert t["visibility"] in ("hidden", "after_due_date", "after_published", "visible")
    assert res["score"] == sum(t["score"] for t in res["tests"])
    by = {t["name"]: t for t in res["tests"]}
    assert by[f"{NB}: exercise 90.1"]["output"].startswith("[not-implemented]")
    assert by[f"{NB}: exercise 90.2"]["status"] == "passed"
    hidden = [t for t in res["tests"] if "extra check" in t["name"]]
    assert hidden and all(t["visibility"] == "after_published" for t in hidden)
    text = json.dumps(res) + r.stdout + r.stderr
    assert "HIDDEN-SOURCE-MARKER" not in text and "gs-key" not in text


@pytest.mark.slow
def test_where_namespaces_are_refused_root_runs_the_kernel_as_its_own_user(tmp_path, capsys):
    """Gradescope's container (root, seccomp refuses unshare): the kernel cannot read what only root may, its
    results still come out, and the isolation line says which mode graded it."""
    from mgpu_helpers.tools.grading.cli import main as grade_main
    from mgpu_helpers.tools.grading.execute import _own_user_works, reset_sandbox
    if os.geteuid() != 0:
        pytest.skip("the kernel's own user needs a grader running as root")
    why = _own_user_works()
    if why:
        pytest.skip(f"another user cannot run this python here ({why})")
    (tmp_path / "solutions").mkdir(mode=0o700)
    shutil.copy(FIX / f"{NB}.json", tmp_path / "solutions" / NB)
    secret = tmp_path / "solutions" / NB
    sol = nbformat.reads((FIX / f"{NB}.json").read_text(), as_version=4)
    nb = release_notebook(sol)
    cells = {mgpu(c).get("exercise"): c for c in nb.cells}
    cells["90.2"].source = next(c.source for c in sol.cells if mgpu(c).get("exercise") == "90.2")
    cells["90.1"].source = f"def scale(x, k):\n    return open({str(secret)!r}).read()\n"
    (tmp_path / "sub" / "eve").mkdir(parents=True)
    nbformat.write(nb, tmp_path / "sub" / "eve" / NB)
    reset_sandbox()
    try:
        rc = grade_main([str(tmp_path / "sub"), "--out", str(tmp_path / "out"), "--solutions",
                         str(tmp_path / "solutions"), "--import-path", str(FIX), "--key", "k", "--isolation", "user"])
    finally:
        reset_sandbox()
    assert rc == 0
    assert "isolation: container + the kernel's own unprivileged user" in capsys.readouterr().out
    res = json.loads((tmp_path / "out" / "eve" / "results.json").read_text())
    assert res["output"].startswith("isolation: container + the kernel's own unprivileged user")
    by = {t["name"]: t for t in res["tests"]}
    assert by[f"{NB}: exercise 90.2"]["status"] == "passed"
    assert "PermissionError" in by[f"{NB}: exercise 90.1"]["output"], by[f"{NB}: exercise 90.1"]["output"]
