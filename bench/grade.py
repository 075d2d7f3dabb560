"""Bench: `mgpu-grade` on a generated class, against plain nbval on the same assembled notebooks.

    .venv/bin/python bench/grade.py [--students 30] [--jobs 2] [--repeat 1] [--class-size 300] [--node-cores 32]

    nice -n 10 .venv/bin/python bench/grade.py --students 1 --jobs 2     # the course's solutions as one student

The class is built from the notebooks with exercises in solutions/ (the fixture course in
tests/grading_fixtures when solutions/ has none): student i is perfect, half done or the untouched release (i mod 3).
* plain:  each student's assembled notebook (their exercise cells spliced into the solution notebook,
          without the grader's harvest cells) run by `python -m pytest --nbval` in its own directory,
          --jobs of them at a time -- what running the class through nbval costs anyway;
* grader: `python -m mgpu_helpers.tools.grading.cli SUBMISSIONS --out OUT --jobs N` on the same class
          (sandbox, harvest cells, outside judge, reports).
Prints both wall times (and CPU times of all child processes) and their ratios (goal: grader <= 1.3 x
plain). With --repeat R the two are alternated R times (the machine's load drifts) and the medians printed.
Then the throughput, students per hour per core, both from wall time x the cores the run could use
(min(--jobs, cores)) and from CPU time (steadier on a shared machine), and what the CPU figure means for a
class of --class-size: core-hours, hours on one node of --node-cores (`mgpu-grade --jobs`, or SLURM shards),
and per submission on Gradescope (each submission in its own container with 1/2 vCPU by default, more if
the assignment's settings ask).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from mgpu_helpers.tools.authoring import mgpu, release_notebook  # noqa: E402
from mgpu_helpers.tools.grading.assemble import assemble, load_course, read_submission  # noqa: E402


def course_dirs(tmp: Path) -> tuple[Path, list[str]]:
    """(solutions dir, extra import paths): the real course, or the fixture course."""
    if list((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb")):
        return ROOT / "solutions", []
    fix = ROOT / "tests" / "grading_fixtures"
    sol = tmp / "fixture_solutions"
    sol.mkdir()
    shutil.copy(fix / "90_fixture.ipynb.json", sol / "90_fixture.ipynb")
    return sol, [str(fix)]


def make_class(sol: Path, sub: Path, n: int) -> None:
    for p in sorted(sol.glob("[0-9][0-9]_*.ipynb")):
        full = nbformat.read(str(p), as_version=4)
        for i in range(n):
            kind = ("perfect", "half", "untouched")[i % 3]
            nb = full if kind == "perfect" else release_notebook(full)
            if kind == "half":
                ex = [c for c in full.cells if "exercise" in mgpu(c)]
                done = {mgpu(c)["exercise"]: c.source for c in ex[: max(1, len(ex) // 2)]}
                for c in nb.cells:
                    if mgpu(c).get("exercise") in done:
                        c.source = done[mgpu(c)["exercise"]]
            d = sub / f"student{i:02d}"
            d.mkdir(parents=True, exist_ok=True)
            (d / p.name).write_text(json.dumps(nb))


def plain(sol: Path, sub: Path, work: Path, jobs: int, imports: list[str]) -> float:
    """Run nbval on every assembled notebook (no grader machinery), `jobs` at a time."""
    course = [c for c in load_course(sol) if c.exercises]  # mgpu-grade skips notebooks without exercises
    tasks = []
    for s in sorted(d.name for d in sub.iterdir()):
        for c in course:
            nb, _ = assemble(c, read_submission(sub / s / c.name, c).sources, set(), "")
            nb.cells = [x for x in nb.cells if "mgpu_grade" not in x.metadata]  # no prime/harvest cells
            d = work / s
            d.mkdir(parents=True, exist_ok=True)
            (d / c.name).write_text(nbformat.writes(nb))
            tasks.append(d / c.name)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*imports, os.environ.get("PYTHONPATH", "")]))

    def run(p):
        subprocess.run([sys.executable, "-m", "pytest", "--nbval", str(p), "--nbval-current-env", "-p",
                        "no:cacheprovider", "-o", "addopts=", "--rootdir", str(p.parent), "-q"],
                       cwd=p.parent, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    t = time.perf_counter()
    with ThreadPoolExecutor(jobs) as pool:
        list(pool.map(run, tasks))
    return time.perf_counter() - t


def grader(sol: Path, sub: Path, out: Path, jobs: int, imports: list[str]) -> float:
    cmd = [sys.executable, "-m", "mgpu_helpers.tools.grading.cli", str(sub), "--out", str(out), "--solutions", str(sol),
           "--jobs", str(jobs), "--key", "bench"] + [a for p in imports for a in ("--import-path", p)]
    t = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--students", type=int, default=30)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--class-size", type=int, default=300, help="class for the arithmetic")
    ap.add_argument("--node-cores", type=int, default=32, help="cores of one cluster node for the arithmetic")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="mgpu-bench-") as tmp:
        tmp = Path(tmp)
        sol, imports = course_dirs(tmp)
        make_class(sol, tmp / "sub", a.students)
        n_nb = len([c for c in load_course(sol) if c.exercises])
        print(f"class: {a.students} students x {n_nb} notebooks from {sol} (jobs={a.jobs})")
        ratios, cpu_ratios, rates = [], [], []
        for r in range(a.repeat):
            c0 = cpu()
            tp = plain(sol, tmp / "sub", tmp / f"plain{r}", a.jobs, imports)
            c1 = cpu()
            tg = grader(sol, tmp / "sub", tmp / f"out{r}", a.jobs, imports)
            c2 = cpu()
            ratios.append(tg / tp)
            cores = min(a.jobs, os.cpu_count() or 1)
            rates.append((a.students * 3600 / (tg * cores), a.students * 3600 / (c2 - c1),
                          a.students * 3600 / (tp * cores), a.students * 3600 / (c1 - c0)))
            cpu_ratios.append((c2 - c1) / (c1 - c0))
            print(f"run {r + 1}: plain nbval {tp:7.1f} s ({c1 - c0:6.1f} s CPU)   mgpu-grade {tg:7.1f} s "
                  f"({c2 - c1:6.1f} s CPU)   ratio {tg / tp:.2f}x wall, {cpu_ratios[-1]:.2f}x CPU", flush=True)
        print(f"median ratio grader/plain: {statistics.median(ratios):.2f}x wall, {statistics.median(cpu_ratios):.2f}x "
              "CPU (goal <= 1.3x)")
        wall, cpu_rate, plain_wall, plain_cpu = (statistics.median(r[i] for r in rates) for i in range(4))
        print(f"throughput, students/hour/core: mgpu-grade {wall:.1f} (wall x {min(a.jobs, os.cpu_count() or 1)} "
              f"cores), {cpu_rate:.1f} (CPU); plain nbval {plain_wall:.1f} (wall), {plain_cpu:.1f} (CPU)")
        n, rate = a.class_size, cpu_rate  # CPU time: what a core of its own gives, whatever else the machine runs
        print(f"a class of {n} (from the CPU figure): {n / rate:.1f} core-hours; on one {a.node_cores}-core node "
              f"{60 * n / (rate * a.node_cores):.0f} min (if memory allows {a.node_cores} notebooks at once); "
              f"on Gradescope {60 / (rate * 0.5):.1f} min per submission at 1/2 vCPU (its default), "
              f"{60 / (rate * 2):.1f} min at 2 vCPUs (submissions run side by side)")

def cpu() -> float:
    """CPU seconds of every finished child process and its descendants: steadier than wall time when
    other work shares the machine."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


if __name__ == "__main__":
    main()
