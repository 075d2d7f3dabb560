"""`mgpu-course`: the authoring command line: ``mgpu-course release [--check]``, ``execute [NB ...]``,
``validate``, ``autograder --out autograder.zip [--hidden DIR] [--key KEY]`` (``mgpu-course COMMAND --help``).
"""

import argparse
import sys
from pathlib import Path

import nbformat

from .authoring import NOTEBOOK_GLOB, course_notebooks, dumps, release_notebook, validate

ROOT = Path(__file__).resolve().parents[2]


def _problems(sol: Path) -> list[str]:
    return [pr for p in course_notebooks(sol) for pr in validate(nbformat.read(str(p), as_version=4), p.name)]


def input_problem(a) -> str | None:
    """What is wrong with the command line, in one line (None: nothing)."""
    if a.cmd != "execute" or not a.notebooks:
        if not a.solutions.is_dir():
            return f"--solutions {a.solutions} is not a directory"
        if not course_notebooks(a.solutions):
            return f"no solution notebooks (NN_name.ipynb) in {a.solutions}"
    if a.cmd == "release" and a.out.exists() and not a.out.is_dir():
        return f"--out {a.out} exists and is not a directory"
    if a.cmd == "autograder":
        for flag, d in [("--hidden", a.hidden)] * (a.hidden is not None) + [("--import-path", d) for d in a.import_path]:
            if not d.is_dir():
                return f"{flag} {d} is not a directory"
        if a.out.suffix != ".zip" or a.out.is_dir():
            return f"--out {a.out}: the name of the zip to write, e.g. autograder.zip"
        if not all(v > 0 for v in (a.jobs, a.timeout, a.notebook_timeout, a.memory)):
            return "--jobs, --timeout, --notebook-timeout and --memory must be > 0"
    missing = [str(p) for p in a.notebooks if not p.is_file()] if a.cmd == "execute" else []
    return f"no such notebook: {', '.join(missing)}" if missing else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mgpu-course", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--solutions", type=Path, default=ROOT / "solutions")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("release", help="write notebooks/ (student copies) from solutions/")
    r.add_argument("--out", type=Path, default=ROOT / "notebooks")
    r.add_argument("--check", action="store_true", help="exit 1 if notebooks/ differs from what release would write")
    e = sub.add_parser("execute", help="re-run solution notebooks in place, storing the outputs nbval compares")
    e.add_argument("notebooks", nargs="*", type=Path)
    e.add_argument("--timeout", type=int, default=600)
    sub.add_parser("validate", help="check the metadata schema of every solution notebook")
    g = sub.add_parser("autograder", help="write the Gradescope autograder zip (GRADING.md says how to upload it)")
    g.add_argument("--out", type=Path, default=Path("autograder.zip"))
    g.add_argument("--hidden", type=Path, default=None, help="directory of hidden checks (*.py)")
    g.add_argument("--import-path", type=Path, action="append", default=[], help="extra course module folder")
    g.add_argument("--key", default=None, help="grading key for the seeds (default: a new random one)")
    g.add_argument("--jobs", type=int, default=2, help="notebooks run at once in one container (its CPUs)")
    g.add_argument("--timeout", type=float, default=120, help="seconds per cell")
    g.add_argument("--notebook-timeout", type=float, default=900, help="seconds per notebook")
    g.add_argument("--memory", type=float, default=8, help="GiB of address space for nbval and the kernel")
    a = ap.parse_args(argv)
    problem = input_problem(a)
    if problem:  # before anything is written: a wrong --solutions once released 0 notebooks, deleting the rest
        print(f"mgpu-course: error: {problem}", file=sys.stderr)
        return 2
    if a.cmd == "release":
        sol, out = a.solutions, a.out
        problems = _problems(sol)
        if problems:  # never release a notebook whose schema is broken
            print("\n".join(problems))
            return 1
        expected = {p.name: dumps(release_notebook(nbformat.read(str(p), as_version=4))) for p in course_notebooks(sol)}
        if a.check:
            drift = sorted(n for n, text in expected.items()
                           if not (out / n).exists() or (out / n).read_text(encoding="utf-8") != text)
            extra = sorted({p.name for p in out.glob("*.ipynb")} - set(expected))
            for n in drift:
                print(f"drift: {out.name}/{n} differs from the release of {sol.name}/{n}")
            for n in extra:
                foreign = "" if Path(n).match(NOTEBOOK_GLOB) else \
                    " (not a course notebook's name: release leaves it; remove it)"
                print(f"drift: {out.name}/{n} has no source in {sol.name}/{foreign}")
            if drift or extra:
                print("notebooks/ is out of date: run `mgpu-course release`")
                return 1
            print(f"notebooks/ is up to date ({len(expected)} notebooks)")
            return 0
        out.mkdir(parents=True, exist_ok=True)
        for n, text in expected.items():
            (out / n).write_text(text, encoding="utf-8")
        for p in course_notebooks(out):  # a course notebook whose source is gone; any other file stays
            if p.name not in expected:
                p.unlink()
        print(f"released {len(expected)} notebooks to {out}")
        return 0
    if a.cmd == "execute":
        from nbclient import NotebookClient
        for p in a.notebooks or course_notebooks(a.solutions):
            nb = nbformat.read(str(p), as_version=4)
            NotebookClient(nb, timeout=a.timeout, kernel_name="python3",
                           resources={"metadata": {"path": str(p.parent)}}).execute()
            p.write_text(dumps(nb), encoding="utf-8")
            print(f"executed {p}")
        return 0
    if a.cmd == "validate":
        problems = _problems(a.solutions)
        print("\n".join(problems + [f"{len(course_notebooks(a.solutions))} notebooks, {len(problems)} problems"]))
        return 1 if problems else 0
    from .grading.gradescope import build
    build(a.out, a.solutions, a.hidden, a.import_path, a.key,
          {k: getattr(a, k) for k in ("jobs", "timeout", "notebook_timeout", "memory")})
    print(f"wrote {a.out}: {len(course_notebooks(a.solutions))} notebooks" + (f", hidden checks from {a.hidden}"
          if a.hidden else "") + "; the solutions and the grading key are inside: keep the zip private")
    return 0


if __name__ == "__main__":
    sys.exit(main())
