"""Grade one student's notebook: assemble, run, judge, score; re-run when the kernel was taken down.

A check scores its points only if BOTH its check cell PASSED under nbval with the kernel replying "ok"
AND the outside judge accepts the harvested results. A *catastrophe* (a timeout, the kernel dying, an output
or process cap, a harvest cell that did not run) ends what the run can say about every later cell: the
exercise whose code was running gets its status, and the exercises after it are graded in a fresh run with
that exercise stubbed, so the damage stays with its cause without a kernel per exercise (twice the time).
"""

import hashlib
import hmac
import io
import random
import re
from dataclasses import dataclass
from pathlib import Path

import nbformat

from .assemble import CourseNotebook, Submission, assemble, clean_source
from .execute import Limits, RunResult, run_job, work_dir


@dataclass
class Row:
    student: str
    notebook: str
    exercise: str        # "1.1", or "1.1 hidden: <name>"
    points: int
    max_points: int
    status: str          # passed | failed | not-implemented | missing-notebook | invalid-notebook | ...
    message: str
    hidden: bool = False


@dataclass
class Context:
    key: bytes
    limits: Limits
    hidden: dict         # exercise id -> [HiddenCheck]
    modules: dict        # notebook name -> importable module name
    keep: list           # the paths the kernel sees beyond the system's (execute.needed_paths)
    import_paths: list
    mpl_cache: str
    extra: dict          # relative path -> bytes: the course's assets/, next to each notebook


def seed_for(key: bytes, *parts: str) -> int:
    """Secret (keyed) but reproducible: the same key, student and check give the same cases."""
    return int.from_bytes(hmac.new(key, "\0".join(parts).encode(), hashlib.sha256).digest()[:8], "little")


_ADDR = re.compile(r"0x[0-9a-fA-F]{6,}")
_SCRATCH = re.compile(r"/\S*/mgpu-grade-[^/\s]+/\d+/\d+")  # a job directory (without the sandbox)


def tidy(msg: str, limit: int = 600) -> str:
    """Messages are deterministic (no addresses, no scratch paths) and short."""
    msg = _SCRATCH.sub("<work>", _ADDR.sub("0x…", str(msg))).strip()
    return msg if len(msg) <= limit else msg[: limit - 1] + "…"


def _harvest_spec(ctx: Context, student: str, course: CourseNotebook) -> tuple[bytes, dict]:
    import torch
    spec, seeds = {}, {}
    for e in course.exercises:
        s = seed_for(ctx.key, student, course.name, e.id, "")
        hs = {h.name: seed_for(ctx.key, student, course.name, e.id, h.name) for h in ctx.hidden.get(e.id, [])}
        seeds[e.id] = (s, hs)
        spec[e.id] = {"function": e.function, "module": ctx.modules[course.name], "seed": s,
                      "hidden": {h.name: h.cases(random.Random(hs[h.name])) for h in ctx.hidden.get(e.id, [])}}
    buf = io.BytesIO()
    torch.save(spec, buf)
    return buf.getvalue(), seeds


def _events(run: RunResult, layout, exercises) -> tuple[int, str] | None:
    """(cell, kind) of the first catastrophe in a run, or None."""
    found = []
    for c in range(layout.n_code):
        r = run.records.get(c)
        if r is None:
            found.append((c, "notebook-timeout" if run.timed_out else "error"))
            break
        if r["event"] or r["outcome"] == "error":
            found.append((c, r["event"] or "error"))
    for ex in exercises:
        h = layout.harvest[ex]
        if h in run.records and ex not in run.results:
            found.append((h, "sabotage"))
    return min(found) if found else None


def _catastrophe(kind: str, ex: str, ctx: Context, run: RunResult) -> tuple[str, str]:
    lim = ctx.limits
    return {
        "timeout": ("timeout", f"a cell of exercise {ex} ran longer than {lim.cell_timeout:g} s (an endless loop?)"),
        "notebook-timeout": ("timeout", f"the notebook ran longer than {lim.notebook_timeout:g} s"),
        "kernel-died": ("kernel-died", f"the kernel died while running exercise {ex}: os._exit, a crash, or running "
                        f"out of memory (the limit is {lim.memory / 2**30:g} GiB) ends it"),
        "process-limit": ("process-limit", f"exercise {ex} left too many processes or threads running (the sandbox "
                          f"allows {lim.processes} in all; a fork bomb?)"),
        "output-limit": ("output-limit", f"a cell of exercise {ex} printed more than {lim.output_cap} bytes "
                         f"(or the notebook more than {lim.output_cap_total})"),
        "sabotage": ("failed", f"the grader's cell after exercise {ex} did not run: code in the exercise changed "
                     "how the kernel runs cells (input transformers, patched IPython or checks)"),
        "error": ("error", "grader error: the notebook could not be run" + (f": {run.error}" if run.error else "")),
    }[kind]


def _first_line(text: str, limit: int = 240) -> str:
    line = next((ln.strip() for ln in str(text).splitlines() if ln.strip()), "")
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _cell_problem(r: dict | None) -> str:
    """Why a check cell did not pass, as one sentence (never a traceback: feedback is read by a student)."""
    if r is None:
        return "the cell did not run"
    if r["outcome"] in ("skipped", "xfailed", "xpassed"):
        return f"the cell was {r['outcome']}, and only a pass counts"
    if r["status"] not in (None, "ok") or r["ename"]:
        what = _first_line(r["evalue"] or "")
        return f"the cell raised {r['ename'] or 'an error'}" + (f" ({what})" if what else "")
    if r["failure"] and "outputs differ" in r["failure"]:
        return "the cell's output differs from the reference (does your function print?)"
    return _first_line(r["failure"] or "the cell failed")


def _oom(text: str) -> bool:
    return "MemoryError" in text or "can't allocate memory" in text


def _status(ok: bool, msg: str) -> str:
    if ok or "not implemented yet" in msg:
        return "passed" if ok else "not-implemented"
    return "memory-limit" if _oom(msg) else "failed"


def _normal(ex, spec, run, layout, verdict) -> tuple[str, str]:
    rec = run.records.get(layout.check[ex])
    cell_ok = rec is not None and rec["outcome"] == "passed" and rec["status"] == "ok"
    ok, msg = verdict["public"]
    if ok and cell_ok:
        return "passed", msg
    span = [run.records.get(c) or {} for c in range(layout.exercise[ex], layout.span_end(ex) + 1)]
    if any(_oom(f"{r.get('ename')} {r.get('evalue')}") for r in span):
        return "memory-limit", f"{msg} (the memory limit was hit)"
    if not ok:
        return ("error" if verdict.get("error") else _status(ok, msg)), msg
    # The two disagree: the outside judge accepts the harvested results, the kernel's check cell did not pass.
    return "failed", (f"Exercise {ex}: the judge accepts what `{spec.function}` returned, but the check cell in "
                      f"the notebook did not pass: {_cell_problem(rec)}.")


def grade_notebook(ctx: Context, judge, student: str, course: CourseNotebook, sub: Submission,
                   job: Path) -> list[Row]:
    hidden = {e.id: ctx.hidden.get(e.id, []) for e in course.exercises}
    final: dict[str, tuple] = {}  # exercise id -> (public (status, msg), {hidden name: (status, msg)})

    def settle(ex: str, st: tuple[str, str]) -> None:  # the public check and its hidden ones alike
        final[ex] = (st, {h.name: st for h in hidden[ex]})

    for e in course.exercises:
        if sub.status != "ok":
            settle(e.id, (sub.status, sub.message))
        elif e.id in sub.problems:
            settle(e.id, sub.problems[e.id])
        elif sub.sources[e.id].strip() == clean_source(e.stub).strip():  # the release's stub (sources are clean)
            # Its check fails on the stub (each check's tests prove it): nothing needs to run, and a notebook
            # with nothing else (a class mid-course submits every notebook) is not run at all.
            settle(e.id, ("not-implemented", f"Exercise {e.id} ✗ {e.function}: not implemented yet"))
    pending = [e.id for e in course.exercises if e.id not in final]
    specs = {e.id: e for e in course.exercises}
    stubbed: set[str] = set()
    grade_in, seeds = _harvest_spec(ctx, student, course) if pending else (b"", {})
    while pending:  # each run but the last stubs one more exercise
        work = job / str(len(stubbed))
        nb, layout = assemble(course, sub.sources, stubbed, work_dir(work))
        run = run_job(work, course.name, nbformat.writes(nb), grade_in, [e.id for e in course.exercises], ctx)
        event = _events(run, layout, pending)
        done = [ex for ex in pending if event is None or layout.span_end(ex) < event[0]]
        tasks = [{"exercise": ex, "module": ctx.modules[course.name], "seed": seeds[ex][0],
                  "hidden_seeds": seeds[ex][1], "results": str(run.results.get(ex, ""))} for ex in done]
        for ex, v in zip(done, judge(tasks) if tasks else []):
            hid = {n: (_status(ok, m), m) for n, (ok, m) in v["hidden"].items()}
            final[ex] = (_normal(ex, specs[ex], run, layout, v), hid)
        pending = [ex for ex in pending if ex not in final]
        if event is None:
            break
        # The culprit: the learner's exercise cell that ran last before the catastrophe.
        learner = [ex for ex in sub.sources if ex not in stubbed and layout.exercise[ex] <= event[0]]
        culprit = max(learner, key=lambda ex: layout.exercise[ex]) if learner else None
        if culprit is None:  # instructor code or the environment failed: nothing to stub, nothing to retry
            for ex in pending:
                settle(ex, _catastrophe(event[1], ex, ctx, run))
            break
        if culprit in pending:
            settle(culprit, _catastrophe(event[1], culprit, ctx, run))
            pending.remove(culprit)
        stubbed.add(culprit)
    rows = []
    for e in course.exercises:
        (status, msg), hid = final[e.id]
        rows.append(Row(student, course.name, e.id, e.points if status == "passed" else 0, e.points, status, tidy(msg)))
        for h in hidden[e.id]:
            hs, hm = hid[h.name]
            rows.append(Row(student, course.name, f"{e.id} hidden: {h.name}", h.points if hs == "passed" else 0,
                            h.points, hs, tidy(hm), hidden=True))
    return rows
