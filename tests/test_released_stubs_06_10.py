"""The released 06, 07 and 10 run top to bottom with every exercise unsolved: only the check cells fail
(saying "not implemented yet"); every other cell uses torch's own machinery or the course's reference, or
prints one line saying which exercise to finish first -- no stub's NotImplementedError leaks from a later
cell. (Issue 21b tests 08, 09 and 11 the same way.)"""
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ["06_mixed_precision", "07_activation_checkpointing", "10_data_loading"]


def _text(cell) -> str:
    parts = []
    for o in cell.get("outputs", []):
        parts += [o.get("text", ""), o.get("ename", ""), o.get("evalue", ""), "\n".join(o.get("traceback", []))]
        parts += [str(v) for k, v in o.get("data", {}).items() if k == "text/plain"]
    return "\n".join(parts)


@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_released_notebook_runs_with_stubs(name):
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(str(ROOT / "notebooks" / f"{name}.ipynb"), as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": str(ROOT / "notebooks")}}).execute()
    checks = 0
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        errors = [o for o in cell.outputs if o.get("output_type") == "error"]
        if "check" in cell.get("metadata", {}).get("tags", []):
            assert errors and "not implemented yet" in _text(cell), f"cell {i}:\n{_text(cell)[-2000:]}"
            checks += 1
            continue
        assert not errors, f"cell {i} ({cell.source[:60]!r}) failed with the exercises unsolved:\n{_text(cell)[-2000:]}"
        assert "NotImplementedError" not in _text(cell), f"cell {i} shows a stub's error:\n{_text(cell)[-2000:]}"
    assert checks == sum("check" in c.get("metadata", {}).get("tags", []) for c in nb.cells) > 0
