"""`mgpu-grade`: grade submitted notebooks without trusting them.

Pipeline, one module each::

    assemble  learner's exercise cells (by id, cleaned) spliced into a pristine copy of the solution
              notebook, plus the grader's "prime" and "harvest" cells around each check cell
    execute   writes a job and runs it in the sandbox: sandbox.py (pid 1 of new namespaces, an empty root
              holding an allowlist; limits on memory, time, output and processes; no capabilities),
              nbplugin.py (per-cell records, output and process caps); brings back the learner's results
              on the grader's inputs (harvest.py)
    judge     decides each check in a process that never runs learner code (Check.judge_all on
              torch.load(weights_only=True) data), including hidden checks (hidden.py)
    score     combines nbval status, the kernel's reply status and the judge's verdict per check;
              re-runs a notebook with the offending exercise stubbed when it took the kernel down
    report    grades.csv, per-student feedback.md and Gradescope results.json, class summary plot
    shards    a class split over SLURM array tasks, and the merge of their grades
    gradescope  the course as a Gradescope autograder (its zip, and run_autograder inside it)
    cli       the command line

This package is imported by the sandbox and the kernel, so it must stay light: no torch at import time.
"""


def __getattr__(name):  # HiddenCheck lives in hidden.py, which imports torch via mgpu_helpers.checks
    if name == "HiddenCheck":
        from .hidden import HiddenCheck
        return HiddenCheck
    raise AttributeError(name)
