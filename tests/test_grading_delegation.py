"""End to end: a class whose exercise cells hand the work to the course's own package scores 0 on
those checks, with a row saying why, while an honest submission of the same notebook scores full marks."""
import csv
import shutil
from pathlib import Path

import nbformat
import pytest

from mgpu_helpers.tools.authoring import exercise_cells, release_notebook
from mgpu_helpers.tools.grading.cli import main as grade_main
from mgpu_helpers.tools.grading.execute import sandbox

ROOT = Path(__file__).resolve().parents[1]
NB = "05_gradient_accumulation.ipynb"
pytestmark = pytest.mark.slow

DELEGATE_5_1 = '''from mgpu_helpers.accumulation import flat_grads


def accumulate_gradients(model, loss_fn, inputs, targets, k):
    flat_grads(model)
    return 0.0
'''
# The judges' reference loop: masked in the sandbox (an ImportError there), refused by name without one.
DELEGATE_5_2 = '''from mgpu_helpers.checks.references import accumulate


def accumulate_ddp(ddp_model, loss_fn, inputs, targets, k):
    return accumulate(ddp_model, loss_fn, inputs, targets, k)
'''


def _submission(sources: dict) -> str:
    solution = nbformat.read(ROOT / "solutions" / NB, as_version=4)
    nb = release_notebook(solution)
    for ex, cell in exercise_cells(nb).items():
        cell.source = sources.get(ex, exercise_cells(solution)[ex].source)
    return nbformat.writes(nb)


def test_delegating_class_scores_zero_with_a_reason(tmp_path):
    sub, out = tmp_path / "sub", tmp_path / "out"
    for student, sources in {"honest": {}, "delegates": {"5.1": DELEGATE_5_1, "5.2": DELEGATE_5_2}}.items():
        (sub / student).mkdir(parents=True)
        (sub / student / NB).write_text(_submission(sources))
    sol = tmp_path / "solutions"
    sol.mkdir()
    shutil.copy(ROOT / "solutions" / NB, sol / NB)
    grade_main([str(sub), "--out", str(out), "--solutions", str(sol), "--timeout", "120", "--key", "k"])
    with open(out / "grades.csv", newline="", encoding="utf-8") as f:
        rows = {(r["student"], r["exercise"]): r for r in csv.DictReader(f)}
    assert [rows[("honest", ex)]["points"] for ex in ("5.1", "5.2")] == ["2", "3"] or all(
        rows[("honest", ex)]["points"] == rows[("honest", ex)]["max_points"] for ex in ("5.1", "5.2")), rows
    r51, r52 = rows[("delegates", "5.1")], rows[("delegates", "5.2")]
    assert r51["points"] == "0" and "the course's own implementation" in r51["message"], r51
    assert "mgpu_helpers.accumulation.flat_grads" in r51["message"], r51
    assert r52["points"] == "0", r52
    if sandbox()[0] is not None:   # masked: the reference does not exist inside
        assert "is not defined (did its exercise cell run without errors?)" in r52["message"] or \
            "No module named" in r52["message"], r52
    else:
        assert "the course's own implementation" in r52["message"], r52
