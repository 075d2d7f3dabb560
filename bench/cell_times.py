"""Wall time of each notebook's code cells, run in order in one namespace (as bench/run_notebooks.py runs them).

    PYTHONPATH=. python3 bench/cell_times.py solutions/04_ddp.ipynb [...]

Prints each notebook's total, every cell over 1 s with its first line, and every cell that raised:
where a machine is slow (on an H200: the forkserver's first start, CUDA's initialisation, 04's spawn demo).
"""
import contextlib
import io
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("MPLBACKEND", "Agg")


def cell_times(path: Path) -> tuple[float, list[str]]:
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    ns, total, notes = {"__name__": "__main__"}, 0.0, []
    cwd = os.getcwd()
    os.chdir(path.parent)  # notebooks run with their own folder as the working directory
    try:
        for i, cell in enumerate(cells):
            src, err, t = "".join(cell["source"]), None, time.perf_counter()
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                try:
                    exec(compile(src, f"<{path.name} cell {i}>", "exec"), ns)
                except BaseException as e:  # noqa: BLE001 - say so and go on, as a notebook run with errors
                    err = e
            dt = time.perf_counter() - t
            total += dt
            if err is not None:
                notes.append(f"cell {i} RAISED {type(err).__name__}: {err}")
            if dt > 1:
                notes.append(f"cell {i} {dt:.1f} s: {src.splitlines()[0][:70] if src else ''}")
    finally:
        os.chdir(cwd)
    return total, notes


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    for p in sys.argv[1:]:
        total, notes = cell_times(Path(p).resolve())
        print(f"{Path(p).name} {total:.1f} s", *notes, sep="\n   ", flush=True)


if __name__ == "__main__":
    main()
