"""Decide every check outside the learner's kernel: a verdict computed inside it can always be subverted there.

In the kernel, the grader's cells around each check cell call ``prime`` and ``harvest``: they run the learner's
function on the grader's cases and save what it returns. Nothing there is trusted and nothing there decides: a
learner can patch any of it and only changes the data handed to the judge.
A judge (``python -m mgpu_helpers.tools.grading.judge CONFIG``) is a long-lived process that never runs learner
code and imports the checks, hidden ones included, as the grading starts. It loads the harvested results with
``torch.load(weights_only=True)`` (plain data and tensors, never an object the learner made) and calls
``Check.judge_all(seed, results)``, which regenerates the cases and computes the reference itself, so forged
results still have to be right. Tasks and verdicts travel as JSON lines over stdin/stdout.
"""

import contextlib
import io
import json
import os
import select
import subprocess
import sys
from pathlib import Path

import torch

from ...checks import REGISTRY, Check, load_checks
from .execute import RESULT_CAP, die_with_parent
from .hidden import HiddenProxy

SPEC = "mgpu_grade_in.pt"           # written by the grader: {exercise: {function, module, seed, hidden}}
OUT = "mgpu_grade_out_{}.pt"        # one results file per exercise, in the work dir


# --- in the learner's kernel ---------------------------------------------------------------------------

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
    """Before the check cell: make it use the grader's seed and record what the learner's function returns, so
    the harvest need not run the public cases again. Its printed line (nbval's) never depends on the seed."""
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


# --- the judge, outside --------------------------------------------------------------------------------

def _load(path):
    if not path:
        return None, "no results came back from the kernel"
    p = Path(path)
    if p.is_symlink() or not p.is_file() or p.stat().st_size > RESULT_CAP:
        return None, "the results file is missing, not a plain file, or too large"
    try:
        data = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - anything the learner's kernel wrote
        return None, f"its results could not be loaded safely ({type(e).__name__}); return plain data or tensors"
    if not isinstance(data, dict):
        return None, "its results are malformed"
    if "missing" in data:
        return None, str(data["missing"])[:300]
    if "unsaveable" in data:
        return None, f"its results could not be saved ({str(data['unsaveable'])[:200]}); return plain data or tensors"
    return data, ""


def _verdict(check, seed, results, head):
    if isinstance(results, dict) and "aborted" in results:
        return False, f"{head} the run was aborted: {str(results['aborted'])[:300]}"
    try:
        ok, msg = check.judge_all(seed, results)
    except Exception as e:  # noqa: BLE001 - a judge must answer, whatever the results look like
        return False, f"{head} unusable results ({type(e).__name__}: {str(e)[:200]})"
    return bool(ok), str(msg)


def _alike(verdict: list, task: dict, error: bool) -> dict:  # for the public check and its hidden ones
    return {"public": verdict, "hidden": {n: verdict for n in task["hidden_seeds"]}, "error": error}


def judge_exercise(task: dict, hidden: dict) -> dict:
    ex = task["exercise"]
    check = REGISTRY.get(ex)
    if check is None:
        return _alike([False, f"grader error: no check is registered for exercise {ex} (module {task['module']!r})"],
                      task, True)
    head = f"Exercise {ex} ✗ {check.function}:"
    data, why = _load(task["results"])
    if data is None:
        return _alike([False, f"{head} {why}"], task, False)
    by_name = {h.name: h for h in hidden.get(ex, [])}
    out = {"public": list(_verdict(check, task["seed"], data.get("public"), head)), "hidden": {}, "error": False}
    got_hidden = data.get("hidden") if isinstance(data.get("hidden"), dict) else {}
    for name, seed in sorted(task["hidden_seeds"].items()):
        h = by_name[name]
        out["hidden"][name] = list(_verdict(HiddenProxy(check, h.cases, h.judge), seed, got_hidden.get(name), head))
    return out


def serve(config: dict) -> None:
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything a check module prints goes to stderr, not into the protocol
    sys.path[:0] = config["import_paths"]
    for m in config["modules"]:
        load_checks(m)  # the lesson module and its checks (mgpu_helpers.checks.<lesson>), references lazily
    from .hidden import load_hidden
    hidden = load_hidden(config["hidden"])
    for line in sys.stdin:
        protocol.write(json.dumps([judge_exercise(t, hidden) for t in json.loads(line)]) + "\n")


class Judge:
    """Client of one judge process, started at once (it imports the checks meanwhile); restarted when it fails."""

    def __init__(self, import_paths: list[str], modules: list[str], hidden: str | None, log: Path):
        self.config = {"import_paths": import_paths, "modules": modules, "hidden": hidden}
        self.log, self.proc = log, None
        self.start()

    def start(self):
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen([sys.executable, "-m", "mgpu_helpers.tools.grading.judge",
                                          json.dumps(self.config)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         text=True, stderr=open(self.log, "a"), preexec_fn=die_with_parent())

    def __call__(self, tasks: list[dict]) -> list[dict]:
        self.start()
        try:
            self.proc.stdin.write(json.dumps(tasks) + "\n")
            self.proc.stdin.flush()
            ready, _, _ = select.select([self.proc.stdout], [], [], 900)  # a restarted judge loads first
            return json.loads(self.proc.stdout.readline() if ready else "")
        except (OSError, ValueError) as e:
            self.close()
            return [_alike([False, f"grader error: the judge failed ({type(e).__name__}); see {self.log}"], t, True)
                    for t in tasks]

    def close(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


if __name__ == "__main__":
    serve(json.loads(sys.argv[1]))
