"""Run solution notebooks without Jupyter and compare their printed output with the stored one.

For machines that have PyTorch but no Jupyter stack (the GPU machines this course is verified on):
each notebook's code cells run in order in one namespace, as a kernel would run them; a cell's stdout
is compared with its stored stream output unless the cell starts with ``# NBVAL_IGNORE_OUTPUT``
(exactly what nbval compares, minus rich outputs, which nbval does not compare for images either).

    PYTHONPATH=. python3 bench/run_notebooks.py solutions/01_where_memory_goes.ipynb [...]

Prints one row per notebook: code cells, cells whose compared output differs, errors, seconds.
``--show-diff`` prints the differing outputs; ``--outputs DIR`` writes every cell's output there.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import linecache
import os
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("MPLBACKEND", "Agg")


def _stored(cell) -> str:
    return "".join("".join(o.get("text", "")) for o in cell.get("outputs", [])
                   if o.get("output_type") == "stream" and o.get("name") == "stdout")


def run(path: Path, show_diff: bool, outdir: Path | None) -> tuple[int, int, int, float]:
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    ns = {"__name__": "__main__"}
    differ = errors = 0
    log = []
    cwd = os.getcwd()
    os.chdir(path.parent)  # notebooks run with their own folder as the working directory
    t0 = time.perf_counter()
    try:
        for i, cell in enumerate(cells):
            src = "".join(cell["source"])
            buf, name = io.StringIO(), f"<{path.name} cell {i}>"
            # as IPython does: tracebacks (a rank's too) then show the cell's source lines
            linecache.cache[name] = (len(src), None, src.splitlines(True), name)
            try:
                with contextlib.redirect_stdout(buf):
                    exec(compile(src, name, "exec"), ns)
            except BaseException:  # noqa: BLE001 - report and go on, like a notebook run with errors
                errors += 1
                buf.write("ERROR\n" + traceback.format_exc())
            got = buf.getvalue()
            log.append(f"=== cell {i}\n{got}")
            ignored = src.lstrip().startswith("# NBVAL_IGNORE_OUTPUT")
            if not ignored and got != _stored(cell):
                differ += 1
                if show_diff:
                    print(f"--- {path.name} cell {i}: stored\n{_stored(cell)}--- got\n{got}")
    finally:
        os.chdir(cwd)
    if outdir:
        outdir.mkdir(parents=True, exist_ok=True)
        (outdir / f"{path.stem}.txt").write_text("\n".join(log))
    return len(cells), differ, errors, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("notebooks", nargs="+", type=Path)
    ap.add_argument("--show-diff", action="store_true")
    ap.add_argument("--outputs", type=Path)
    a = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    rows = [(p.name, *run(p.resolve(), a.show_diff, a.outputs)) for p in a.notebooks]
    print(f"{'notebook':<34}{'cells':>6}{'differ':>8}{'errors':>8}{'seconds':>9}")
    for name, n, d, e, s in rows:
        print(f"{name:<34}{n:>6}{d:>8}{e:>8}{s:>9.1f}")
    return 1 if any(e for *_, e, _ in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
