"""`mgpu-grade`: grade submitted notebooks without trusting them.

Pipeline, one module each: ``assemble`` (the learner's exercise cells spliced into a pristine solution
notebook, with the grader's cells around each check), ``execute`` and ``sandbox`` (nbval run on it in new
namespaces on an allowlisted root, with limits; ``nbplugin`` records each cell; ``harvest`` brings back what
the learner's functions returned on the grader's inputs), ``judge`` (each check decided in a process that never
runs learner code, hidden checks included: ``hidden``), ``score`` (nbval's status, the kernel's and the judge's
per check; a re-run with the culprit stubbed when the kernel was taken down), ``report`` (grades.csv, feedback,
results.json, the summary plot), ``shards`` (SLURM array tasks and their merge), ``gradescope`` (the autograder
zip and its run_autograder) and ``cli``. Imported by the sandbox and the kernel: no torch at import time.
"""


def __getattr__(name):  # HiddenCheck lives in hidden.py, which imports torch via mgpu_helpers.checks
    if name == "HiddenCheck":
        from .hidden import HiddenCheck
        return HiddenCheck
    raise AttributeError(name)
