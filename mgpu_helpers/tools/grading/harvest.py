"""Kernel side of grading: run the learner's function on the grader's inputs and save what it returns.

This runs *inside the learner's kernel*, so nothing here is trusted and nothing here decides: a learner
can patch any of it and only changes the data handed to the judge. The judge (judge.py) regenerates the
cases from the seed in a process that never runs learner code, computes the reference itself and loads
these results with ``torch.load(weights_only=True)``, so forged results still have to be right.
"""
from __future__ import annotations

import contextlib
import io
import os

import torch

from ...checks import REGISTRY, Check, load_checks
from .hidden import HiddenProxy

SPEC = "mgpu_grade_in.pt"           # written by the grader: {exercise: {function, module, seed, hidden}}
OUT = "mgpu_grade_out_{}.pt"        # one results file per exercise, in the work dir


def _collect(chk: Check, fn, seed: int):
    try:
        return chk.run_all(fn, seed)
    except BaseException as e:  # noqa: BLE001 - SystemExit/KeyboardInterrupt end this exercise, not the harvest
        return {"aborted": f"{type(e).__name__}: {e}"[:2000]}


_LOGS: dict[str, list] = {}  # exercise id -> what the check cell's own run returned, case by case


def _spec(exercise: str, work: str) -> dict:
    spec = torch.load(os.path.join(work, SPEC), weights_only=True)[exercise]
    if spec["module"]:
        load_checks(spec["module"])  # registers the checks, if the notebook did not import them
    return spec


def prime(exercise: str, work: str) -> None:
    """Before the check cell: make it use the grader's seed and record what the learner's function
    returns, so the harvest need not run the public cases a second time (the naive way: run_all again).
    The check's printed line is unchanged: its number of cases never depends on the seed (nbval)."""
    seed, chk, log = _spec(exercise, work)["seed"], REGISTRY[exercise], []
    _LOGS[exercise] = log
    make_cases, run = chk.make_cases, chk.run

    def recording_run(fn, case):
        log.append(None)  # stays None if the learner's code raises: the harvest then runs run_all
        log[-1] = {"ok": True, "result": run(fn, case)}
        return log[-1]["result"]

    chk.make_cases = lambda seed_=None: make_cases(seed)
    chk.run = recording_run
    # No verdict in the kernel (the judge's, outside, may need a reference the sandbox hides): the cell still
    # runs the function on the grader's cases, so a stub or a raise fails it. Kept after the harvest, so a
    # later cell's ``check.passed(fn)`` reads "it ran" instead of importing a hidden file.
    chk.judge_one = lambda i, n, case, result: None


def harvest(exercise: str, user_ns: dict, work: str) -> None:
    spec = _spec(exercise, work)
    chk, fn = REGISTRY[exercise], user_ns.get(spec["function"])
    for name in ("make_cases", "run"):  # prime's patches: the harvest runs the check as it is
        chk.__dict__.pop(name, None)
    log = _LOGS.pop(exercise, None)
    out: dict = {}
    sink = io.StringIO()  # the learner's prints during the harvest are not part of the notebook's output
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        if not callable(fn):
            out["missing"] = f"`{spec['function']}` is not defined (did its exercise cell run without errors?)"
        else:
            n = len(chk.make_cases(spec["seed"]))
            complete = log is not None and len(log) == n and all(entry is not None for entry in log)
            out["public"] = log if complete else _collect(chk, fn, spec["seed"])
            out["hidden"] = {name: _collect(HiddenProxy(chk, lambda rng, c=cases: list(c)), fn, 0)
                             for name, cases in spec["hidden"].items()}
    path = os.path.join(work, OUT.format(exercise))
    try:
        torch.save(out, path)
    except Exception as e:  # noqa: BLE001 - e.g. a result that cannot be pickled
        torch.save({"unsaveable": f"{type(e).__name__}: {e}"[:500]}, path)
