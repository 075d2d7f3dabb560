"""`mgpu-grade`: grade submitted notebooks without trusting them.

Pipeline, one module each: ``assemble`` (the learner's exercise cells spliced into a pristine solution notebook,
the grader's cells around each check), ``execute`` (nbval on it in new namespaces on an allowlisted root, with
limits; ``nbplugin`` records each cell), ``judge`` (the grader's cells save what the learner's functions return
on its inputs; a process that never runs learner code decides each check, ``hidden`` checks included),
``score`` (nbval's, the kernel's and the judge's verdicts per check; a re-run with the culprit stubbed when the
kernel was taken down), ``report`` (grades.csv, feedback, results.json, the plot; the merge of ``--shard``
runs), ``gradescope`` (the autograder zip) and ``cli``. No torch at import time: the sandbox imports this package.
"""


def __getattr__(name):  # HiddenCheck lives in hidden.py, which imports torch via mgpu_helpers.checks
    if name == "HiddenCheck":
        from .hidden import HiddenCheck
        return HiddenCheck
    raise AttributeError(name)
