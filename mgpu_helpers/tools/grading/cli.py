"""`mgpu-grade`: grade submitted notebooks without trusting them.

    mgpu-grade SUBMISSIONS --out OUT [--jobs N] [--timeout S] [--hidden DIR] [--solutions DIR]
    mgpu-grade SUBMISSIONS --out OUT_K --shard K/N --key KEY     one of N slices of the class (a SLURM array task)
    mgpu-grade merge OUT_1 ... OUT_N --out OUT                   the class's grades from its N slices

SUBMISSIONS holds ``<student>/<NN_name>.ipynb``; the notebook names are those of the solution notebooks.
Writes OUT/grades.csv, OUT/<student>/feedback.md, OUT/<student>/results.json (Gradescope) and
OUT/summary.png. Submissions are only read. Seeds come from a key (``--key``, $MGPU_GRADE_KEY, or
OUT/.mgpu-grade-key, created on the first run): keep it to reproduce a grading run exactly. Every run says
in one line what isolates learner code here (namespaces; else, as root, the kernel's own user; else none),
on stdout and in every results.json.
"""

import argparse
import os
import queue
import secrets
import shutil
import signal
import sys
import tempfile
import traceback
from concurrent.futures import ThreadPoolExecutor
from importlib.util import find_spec
from pathlib import Path

from ..authoring import course_notebooks
from .assemble import load_course, read_submission
from .execute import (RUNNING, STOP, Limits, check_allowlist, course_files, default_processes, hidden_from_kernel,
                      isolation_line, kill, needed_paths, protected_paths, readable_by_kernel, reset_sandbox, sandbox)
from .report import MARKER, merge, parse_shard, partition, write_all, write_marker
from .score import Context, Row, grade_notebook

ROOT = Path(__file__).resolve().parents[3]


def resolve_module(name: str) -> str:
    """A notebook's helper module: ``memory`` -> ``mgpu_helpers.memory``, else the name as given."""
    return f"mgpu_helpers.{name}" if name and "." not in name and find_spec(f"mgpu_helpers.{name}") else name


def parse(argv):
    ap = argparse.ArgumentParser(prog="mgpu-grade", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("submissions", type=Path, help="directory of <student>/<NN_name>.ipynb")
    ap.add_argument("--out", type=Path, required=True, help="where grades, feedback and the plot go")
    ap.add_argument("--solutions", type=Path, default=ROOT / "solutions", help="the instructor's notebooks")
    ap.add_argument("--hidden", type=Path, default=None, help="directory of hidden checks (*.py)")
    ap.add_argument("--jobs", type=int, default=1, help="notebooks run in parallel")
    ap.add_argument("--timeout", type=float, default=120, help="seconds per cell (default 120)")
    ap.add_argument("--notebook-timeout", type=float, default=900, help="seconds per notebook (default 900)")
    ap.add_argument("--memory", type=float, default=8, help="GiB of address space for nbval and the kernel")
    ap.add_argument("--output-cap", type=int, default=2**20, help="bytes of output per cell (x8 per notebook)")
    ap.add_argument("--max-processes", type=int, default=0,
                    help=f"processes and threads of one notebook's sandbox (default {default_processes()} here)")
    ap.add_argument("--key", help="grading key for the seeds (default: $MGPU_GRADE_KEY or OUT/.mgpu-grade-key)")
    ap.add_argument("--import-path", type=Path, action="append", default=[],
                    help="extra directory on the kernel's and the judge's import path (course modules)")
    ap.add_argument("--keep-scratch", action="store_true", help="keep the assembled notebooks and run logs")
    ap.add_argument("--no-sandbox", action="store_true",
                    help="UNSAFE: run nbval without namespaces (learner code can read everything); for debugging")
    ap.add_argument("--isolation", choices=("auto", "user"), default="auto",
                    help="user: skip the namespaces and run the kernel as its own user, as where the host "
                         "refuses namespaces (needs root)")
    ap.add_argument("--shard", default=None, metavar="K/N",
                    help="grade only the K-th of N slices of the class (needs --key or $MGPU_GRADE_KEY)")
    return ap.parse_args(argv)


def input_problem(a) -> str | None:
    """What is wrong with the command line, in one line, before anything is created or run (None: nothing)."""
    if not a.submissions.is_dir():
        return f"{a.submissions} is not a directory"
    for flag, value in (("--timeout", a.timeout), ("--notebook-timeout", a.notebook_timeout),
                        ("--memory", a.memory), ("--output-cap", a.output_cap), ("--jobs", a.jobs)):
        if not value > 0:
            return f"{flag} {value:g}: must be > 0"
    folders = ([("--hidden", a.hidden)] if a.hidden is not None else []) + [("--import-path", d) for d in a.import_path]
    for flag, d in folders:
        if not d.is_dir():  # a hidden-check folder mistyped must not grade the class without them
            return f"{flag} {d} is not a directory"
    if a.shard is not None:
        try:
            parse_shard(a.shard)
        except ValueError as e:
            return str(e)
        if not (a.key or os.environ.get("MGPU_GRADE_KEY")):  # each shard would make a key of its own
            return "--shard needs the class's key (--key or $MGPU_GRADE_KEY), the same for every shard"
    if a.isolation == "user" and os.geteuid() != 0:
        return "--isolation user needs root (it runs the kernel as a user of its own)"
    if a.max_processes < 0:
        return f"--max-processes {a.max_processes}: must be >= 0 (0: the default)"
    if not course_notebooks(a.solutions):
        return f"no solution notebooks (NN_name.ipynb) in {a.solutions}"
    out, sub = a.out.resolve(), a.submissions.resolve()
    if out.exists() and not out.is_dir():
        return f"--out {a.out} exists and is not a directory"
    if out == sub or sub in out.parents:  # its folder would be graded as a student's, now or on the next run
        return f"--out {a.out} is inside the submissions ({a.submissions}): write the grades elsewhere"
    if not any(d.is_dir() and not d.name.startswith(".") for d in sub.iterdir()):
        loose = len(list(sub.glob("*.ipynb")))
        return (f"no student folders in {a.submissions}: it holds one folder per student, <student>/NN_name.ipynb"
                + (f" ({loose} notebook(s) lie directly in it: move them into a folder named for the student)"
                   if loose else ""))
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"--out {a.out}: cannot create it ({e.strerror})"
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["merge"]:
        ap = argparse.ArgumentParser(prog="mgpu-grade merge", description="the class's grades.csv, feedback and "
                                     "summary plot from the output folders of its --shard K/N runs")
        ap.add_argument("shards", type=Path, nargs="+", help="the shards' --out folders")
        ap.add_argument("--out", type=Path, required=True)
        m = ap.parse_args(argv[1:])
        return merge(m.shards, m.out)
    a = parse(argv)
    problem = input_problem(a)
    if problem:
        print(f"mgpu-grade: {problem}", file=sys.stderr)
        return 2
    whole = load_course(a.solutions)
    course = [nb for nb in whole if nb.exercises]  # nothing to grade in the others
    if not course:
        print(f"mgpu-grade: no solution notebooks (NN_name.ipynb) with exercises in {a.solutions}", file=sys.stderr)
        return 2
    from .hidden import load_hidden
    from .judge import Judge

    out = a.out.resolve()
    key_file = out / ".mgpu-grade-key"  # made on the first run, where neither --key nor $MGPU_GRADE_KEY is given
    if not (a.key or os.environ.get("MGPU_GRADE_KEY") or key_file.exists()):
        key_file.write_text(secrets.token_hex(32) + "\n")
        key_file.chmod(0o600)
    key = (a.key or os.environ.get("MGPU_GRADE_KEY") or key_file.read_text().strip()).encode()
    hidden = load_hidden(a.hidden)
    known = {e.id for nb in course for e in nb.exercises}
    for ex in sorted(set(hidden) - known):
        print(f"mgpu-grade: warning: hidden checks for exercise {ex}, which no notebook has", file=sys.stderr)
    reset_sandbox()
    iso = sandbox(disable=a.no_sandbox, user_only=a.isolation == "user")
    if iso.prefix is None and not iso.own_user:
        print("mgpu-grade: WARNING: no mount/pid namespace here (" + iso.why + "): learner code runs with the grader's "
              "view of the file system and CAN READ the solutions, the hidden checks and other submissions. "
              "Grade on Linux with unshare(1) (as root, or with unprivileged user namespaces).", file=sys.stderr)
    elif not iso.bounded:
        print("mgpu-grade: WARNING: RLIMIT_NPROC does not hold in the sandbox here: a fork bomb is bounded only by "
              "the timeouts.", file=sys.stderr)
    imports = [str(p.resolve()) for p in a.import_path]
    keep = needed_paths(imports)
    protect = protected_paths([a.solutions.resolve(), a.hidden and a.hidden.resolve(), a.submissions.resolve(), out])
    try:
        check_allowlist(keep, [*protect, os.path.realpath(tempfile.gettempdir())])  # the jobs' scratch goes there
    except ValueError as e:
        print(f"mgpu-grade: {e}", file=sys.stderr)
        return 2
    scratch = Path(tempfile.mkdtemp(prefix="mgpu-grade-"))
    isolation = isolation_line()
    if iso.own_user:
        scratch.chmod(0o755)  # pytest lists the work folder's parents; every job file but the assets is 0600
        out.chmod(0o700)      # earlier runs' grades
        exposed = readable_by_kernel(protect + hidden_from_kernel())
        if exposed:
            print("mgpu-grade: WARNING: without namespaces the kernel's user can read " + ", ".join(exposed)
                  + ": make them unreadable to other users (chmod go-rwx) or grade where namespaces work",
                  file=sys.stderr)
            isolation += "; but it CAN READ " + ", ".join(exposed)
    print(f"mgpu-grade: {isolation}", flush=True)
    import matplotlib
    ctx = Context(key, Limits(a.timeout, a.notebook_timeout, int(a.memory * 2**30), a.output_cap, 8 * a.output_cap,
                              a.max_processes or default_processes()),
                  {ex: hs for ex, hs in hidden.items() if ex in known},
                  {nb.name: resolve_module(nb.module) for nb in course},
                  keep, imports, matplotlib.get_cachedir(), course_files(a.solutions))
    everyone = students = sorted(d.name for d in a.submissions.iterdir() if d.is_dir() and not d.name.startswith("."))
    if a.shard:
        k, n = parse_shard(a.shard)
        students = partition(everyone, key, n)[k - 1]
        (out / MARKER).unlink(missing_ok=True)  # an earlier run's: this one has not finished yet
        print(f"mgpu-grade: shard {k}/{n}: {len(students)} of {len(everyone)} students", flush=True)
    for s in students:
        foreign = sorted({p.name for p in (a.submissions / s).glob("*.ipynb")} - {nb.name for nb in whole})
        if foreign:
            print(f"mgpu-grade: {s}: ignored {', '.join(foreign)} (not a notebook of this course)")
    judges: queue.Queue = queue.Queue()
    modules = sorted({m for m in ctx.modules.values() if m})
    for i in range(a.jobs):  # started now: they import the checks while the first notebooks run
        judges.put(Judge(imports, modules, a.hidden and str(a.hidden.resolve()), scratch / f"judge{i}.log"))
    tasks = [(i, s, nb) for i, (s, nb) in enumerate((s, nb) for s in students for nb in course)]

    def grade(task):
        i, s, nb = task
        judge, job = judges.get(), scratch / f"{i:05d}"
        try:
            return grade_notebook(ctx, judge, s, nb, read_submission(a.submissions / s / nb.name, nb), job)
        except Exception:  # noqa: BLE001 - a grader bug costs this notebook, not the class
            msg = "grader error: " + traceback.format_exc().strip().splitlines()[-1]
            traceback.print_exc()
            return [Row(s, nb.name, e.id, 0, e.points, "error", msg) for e in nb.exercises]
        finally:
            judges.put(judge)
            if not a.keep_scratch:
                shutil.rmtree(job, ignore_errors=True)

    rows: list[Row] = []
    # SLURM's time limit and scancel send SIGTERM: stop as on Ctrl-C (the handler raises KeyboardInterrupt)
    before = {sig: signal.signal(sig, signal.default_int_handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
    pool = ThreadPoolExecutor(a.jobs)
    try:
        for k, got in enumerate(pool.map(grade, tasks), 1):
            rows += got
            print(f"[{k}/{len(tasks)}] {got[0].student} {got[0].notebook}: "
                  f"{sum(r.points for r in got)}/{sum(r.max_points for r in got)}", flush=True)
    except KeyboardInterrupt:
        STOP.set()
        pool.shutdown(wait=False, cancel_futures=True)
        for proc in list(RUNNING):  # the sandboxes run in their own sessions: Ctrl-C does not reach them
            kill(proc)
        print("mgpu-grade: interrupted; nothing written", file=sys.stderr)
        return 130
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
        pool.shutdown(wait=True, cancel_futures=True)
        while not judges.empty():
            judges.get().close()
        if not a.keep_scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    write_all(rows, out, isolation)
    if a.shard:  # written last: a shard without it did not finish (merge reports it missing)
        write_marker(out, *parse_shard(a.shard), everyone, key)
    if a.keep_scratch:
        print(f"mgpu-grade: scratch kept in {scratch}")
    errors = [r for r in rows if r.status == "error"]
    print(f"mgpu-grade: {len(students)} students, {len(course)} notebooks, {len(rows)} checks graded -> {out}"
          + (f"; {len(errors)} grader errors (see grades.csv)" if errors else ""))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
