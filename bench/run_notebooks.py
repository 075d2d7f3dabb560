"""Run solution notebooks without Jupyter and compare their printed output with the stored one.

For machines that have PyTorch but no Jupyter stack (the GPU machines this course is verified on):
each notebook's code cells run in order in one namespace, as a kernel would run them; a cell's stdout
is compared with its stored stream output unless the cell starts with ``# NBVAL_IGNORE_OUTPUT``
(exactly what nbval compares, minus rich outputs, which nbval does not compare for images either).

    PYTHONPATH=. python3 bench/run_notebooks.py solutions/01_where_memory_goes.ipynb [...]

Prints one row per notebook and a total: code cells, compared cells (not ``# NBVAL_IGNORE_OUTPUT``),
compared cells whose stdout differs from the stored output, cells that raised, compared cells that
wrote to stderr (warnings: not compared here, but nbval would see them), wall seconds.
``--show-diff`` prints the differing outputs; ``--outputs DIR`` writes every cell's output there;
``--cell-times`` lists each notebook's cells that took over 1 s (where a machine is slow: on an H200 the
forkserver's first start, CUDA's initialisation, 04's spawn demo).
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


def run(path: Path, show_diff: bool, outdir: Path | None,
        cell_times: bool = False) -> tuple[int, int, int, int, int, float]:
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    ns = {"__name__": "__main__"}
    compared = differ = errors = stderr = 0
    log = []
    cwd = os.getcwd()
    os.chdir(path.parent)  # notebooks run with their own folder as the working directory
    t0 = time.perf_counter()
    try:
        for i, cell in enumerate(cells):
            src = "".join(cell["source"])
            buf, err, name = io.StringIO(), io.StringIO(), f"<{path.name} cell {i}>"
            t_cell = time.perf_counter()
            # as IPython does: tracebacks (a rank's too) then show the cell's source lines
            linecache.cache[name] = (len(src), None, src.splitlines(True), name)
            try:
                with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err):
                    exec(compile(src, name, "exec"), ns)
            except BaseException:  # noqa: BLE001 - report and go on, like a notebook run with errors
                errors += 1
                buf.write("ERROR\n" + traceback.format_exc())
            got, dt = buf.getvalue(), time.perf_counter() - t_cell
            if cell_times and dt > 1:
                print(f"  {path.name} cell {i}: {dt:.1f} s  {src.splitlines()[0][:70] if src else ''}", flush=True)
            log.append(f"=== cell {i}\n{got}" + (f"--- stderr\n{err.getvalue()}" if err.getvalue() else ""))
            if err.getvalue():
                sys.stderr.write(err.getvalue())
            if src.lstrip().startswith("# NBVAL_IGNORE_OUTPUT"):
                continue
            compared += 1
            stderr += bool(err.getvalue())
            if got != _stored(cell):
                differ += 1
                if show_diff:
                    print(f"--- {path.name} cell {i}: stored\n{_stored(cell)}--- got\n{got}")
    finally:
        os.chdir(cwd)
    if outdir:
        outdir.mkdir(parents=True, exist_ok=True)
        (outdir / f"{path.stem}.txt").write_text("\n".join(log))
    return len(cells), compared, differ, errors, stderr, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("notebooks", nargs="+", type=Path)
    ap.add_argument("--show-diff", action="store_true")
    ap.add_argument("--outputs", type=Path)
    ap.add_argument("--cell-times", action="store_true", help="list the cells that took over 1 s")
    a = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    rows = []
    for p in a.notebooks:
        rows.append((p.name, *run(p.resolve(), a.show_diff, a.outputs, a.cell_times)))
        print(f"done {p.name}: {rows[-1][3]} differing, {rows[-1][4]} errors, {rows[-1][6]:.1f} s", flush=True)
    rows.append(("total", *(sum(r[i] for r in rows) for i in range(1, 7))))
    print(f"{'notebook':<34}{'cells':>6}{'compared':>9}{'differ':>7}{'errors':>7}{'stderr':>7}{'seconds':>9}")
    for name, n, c, d, e, err, s in rows:
        print(f"{name:<34}{n:>6}{c:>9}{d:>7}{e:>7}{err:>7}{s:>9.1f}")
    return 1 if rows[-1][3] or rows[-1][4] else 0


if __name__ == "__main__":
    sys.exit(main())
