"""The schema, the release transform and its drift check."""
import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from mgpu_helpers.tools import course
from mgpu_helpers.tools.authoring import release_notebook, strip_solution, validate


def _nb(extra_check=True):
    ex = new_code_cell("def f(x):\n    '''doc'''\n    ### BEGIN SOLUTION\n    return x + 1\n    ### END SOLUTION\n")
    ex.metadata = {"tags": ["exercise"], "mgpu": {"exercise": "9.1", "function": "f", "task": "add one"}}
    ck = new_code_cell("check_9_1(f)")
    ck.metadata = {"tags": ["check"], "mgpu": {"check": "9.1", "points": 2}}
    ck.outputs = [nbformat.v4.new_output("stream", text="Exercise 9.1 ✓ f: 3/3 cases\n")]
    cells = [new_markdown_cell("# t"), ex] + ([ck] if extra_check else [])
    return new_notebook(cells=cells)


def test_strip_solution_keeps_indentation_and_code_outside():
    out = strip_solution("def f():\n    x = 1\n    ### BEGIN SOLUTION\n    return x\n    ### END SOLUTION\n", "Exercise 9.1: do it")
    assert out == "def f():\n    x = 1\n    raise NotImplementedError('Exercise 9.1: do it')"


@pytest.mark.parametrize("src", ["### BEGIN SOLUTION\nx", "x\n### END SOLUTION", "### BEGIN SOLUTION\n### BEGIN SOLUTION\n"])
def test_strip_solution_rejects_unbalanced_blocks(src):
    with pytest.raises(ValueError):
        strip_solution(src, "m")


def test_release_strips_solutions_and_outputs_keeps_metadata():
    nb = _nb()
    rel = release_notebook(nb)
    ex, ck = rel.cells[1], rel.cells[2]
    assert "return x + 1" not in ex.source and "NotImplementedError('Exercise 9.1: add one')" in ex.source
    assert ex.metadata["mgpu"]["exercise"] == "9.1" and ex.metadata["tags"] == ["exercise"]
    assert ck.outputs == [] and ck.source == "check_9_1(f)" and ck.id == nb.cells[2].id
    assert nb.cells[2].outputs, "release must not modify its input"


def test_validate_finds_schema_problems():
    assert validate(_nb()) == []
    assert any("no check cell" in p for p in validate(_nb(extra_check=False)))
    nb = _nb()
    nb.cells[2].source = "# NBVAL_IGNORE_OUTPUT\ncheck_9_1(f)"
    assert any("NBVAL" in p for p in validate(nb))
    nb = _nb()
    nb.cells.append(nbformat.from_dict(nb.cells[1]))
    assert any("duplicate exercise" in p for p in validate(nb))
    nb = _nb()  # nbval reads a marker only as the whole comment: one with a reason after it does nothing
    nb.cells.append(new_code_cell("# NBVAL_IGNORE_OUTPUT  (wall times)\nprint(1)"))
    assert any("nbval ignores a marker" in p for p in validate(nb))
    nb.cells[-1].source = "# NBVAL_IGNORE_OUTPUT\n# (wall times)\nprint(1)"
    assert validate(nb) == []


def test_release_check_detects_drift(tmp_path, capsys):
    sol, out = tmp_path / "solutions", tmp_path / "notebooks"
    sol.mkdir()
    nbformat.write(_nb(), sol / "09_x.ipynb")
    assert course.main(["--solutions", str(sol), "release", "--out", str(out), "--check"]) == 1
    assert course.main(["--solutions", str(sol), "release", "--out", str(out)]) == 0
    assert course.main(["--solutions", str(sol), "release", "--out", str(out), "--check"]) == 0
    (out / "09_x.ipynb").write_text((out / "09_x.ipynb").read_text().replace("add one", "add two"))
    assert course.main(["--solutions", str(sol), "release", "--out", str(out), "--check"]) == 1
    (out / "09_x.ipynb").unlink()
    course.main(["--solutions", str(sol), "release", "--out", str(out)])
    (out / "99_stale.ipynb").write_text("{}")
    assert course.main(["--solutions", str(sol), "release", "--out", str(out), "--check"]) == 1
    assert "no source" in capsys.readouterr().out


def test_release_loses_nothing_on_a_wrong_command_line(tmp_path, capsys):
    """A wrong --solutions once released 0 notebooks and deleted every one in notebooks/; now each slip is one
    line and exit 2 with nothing written, and release removes only course notebooks whose source is gone."""
    sol, out = tmp_path / "solutions", tmp_path / "notebooks"
    sol.mkdir()
    nbformat.write(_nb(), sol / "09_x.ipynb")
    assert course.main(["--solutions", str(sol), "release", "--out", str(out)]) == 0
    (out / "my_notes.ipynb").write_text("{}")  # a file of the user's own
    before = {p.name: p.read_text() for p in out.iterdir()}
    capsys.readouterr()
    for argv, message in [
            (["--solutions", str(tmp_path / "nowhere"), "release", "--out", str(out)], "is not a directory"),
            (["--solutions", str(out.parent), "release", "--out", str(out)], "no solution notebooks (NN_name.ipynb)"),
            (["--solutions", str(sol), "release", "--out", str(out / "my_notes.ipynb")], "is not a directory"),
            (["--solutions", str(tmp_path / "nowhere"), "validate"], "is not a directory"),
            (["execute", str(tmp_path / "nope.ipynb")], "no such notebook"),
    ]:
        assert course.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("mgpu-course: error: ") and message in err, err
        assert {p.name: p.read_text() for p in out.iterdir()} == before
    nbformat.write(_nb(), sol / "10_y.ipynb")
    assert course.main(["--solutions", str(sol), "release", "--out", str(out)]) == 0
    (sol / "09_x.ipynb").unlink()
    assert course.main(["--solutions", str(sol), "release", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["10_y.ipynb", "my_notes.ipynb"]
    assert course.main(["--solutions", str(sol), "release", "--out", str(out), "--check"]) == 1
    assert "not a course notebook's name" in capsys.readouterr().out


def test_committed_solutions_follow_the_schema():
    from pathlib import Path
    root = Path(course.__file__).resolve().parents[2] / "solutions"
    nbs = sorted(root.glob("[0-9][0-9]_*.ipynb"))
    assert nbs, "no solution notebooks"
    for p in nbs:
        nb = nbformat.read(p, as_version=4)
        assert validate(nb, p.name) == []
        assert nb.metadata["mgpu"]["notebook"] == p.name[:2]
        module = nb.metadata["mgpu"]["module"]
        face = root.parent / "mgpu_helpers" / module  # a module, or a package whose __init__ is the face
        assert face.with_suffix(".py").exists() or (face / "__init__.py").exists(), \
            f"{p.name}: no helper module {module}.py or package {module}/"
        first = nb.cells[0].source
        for heading in ("What you will learn", "Prerequisites", "Runs on"):
            assert heading in first, f"{p.name}: first cell lacks '{heading}'"
        assert "Summary" in nb.cells[-1].source, f"{p.name}: last cell is not a summary"
