"""Loaded first by every pytest run from the repo root (unit tests and nbval alike)."""
import os

import pytest

# run_ranks notes on stderr, once per kernel, when a machine has fewer GPUs than ranks ("using gloo on
# CPU"). nbval compares stderr as well as stdout, so on a one-GPU machine the first launching cell of each
# notebook would differ from its stored output; the kernels nbval starts inherit this and stay quiet.
os.environ.setdefault("MGPU_FALLBACK_NOTE", "0")


# `make test` runs `-n 2 --dist loadfile --no-loadscope-reorder`: xdist hands out whole files, in collection
# order, to whichever worker is free. A long file handed out last runs alone at the end, so the longest files
# (measured with --durations; README, Verified on) go first and the short ones fill in behind them. xdist's
# own reordering (by number of tests) put notebook 12's planted mistakes, 15 tests of ~40 s, behind files of
# a hundred 1-second tests. Only the order changes: each file's tests keep theirs.
LONGEST_FIRST = ("tests/test_mutants.py", "tests/test_grading_course.py", "tests/test_released_notebooks.py",
                 "tests/test_grading.py", "tests/test_plan_catalogue.py", "tests/test_planner_parallel.py",
                 "tests/test_launch.py", "tests/test_fsdp_practice.py", "solutions/12_fsdp2_in_practice.ipynb",
                 "solutions/11_capstone_fit_the_budget.ipynb")
MUTANTS = "tests/test_mutants.py"


def pytest_configure(config):
    """Under xdist each worker shares the cores with the others (and with what they start): torch's default of
    one intra-op thread per core would make every worker's parallel op wait for a core another holds, its
    threads spin-waiting meanwhile. A worker gets its share: on 2 cores with `-n 2`, one thread each. It shows
    when more runs than the cores hold (kernels, ranks, the other worker's processes): tests/test_planner.py,
    test_tracker.py and test_profiling.py took 16 CPU-s instead of 32 beside other jobs; with the two workers
    alone on the cores, 25 in-process files cost the same either way. Kernels and spawned processes choose
    their own threads, as without xdist."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers:
        import torch

        from mgpu_helpers.runtime.launch import cores
        torch.set_num_threads(max(1, cores() // workers))


def pytest_collection_modifyitems(session, config, items):
    first = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.nodeid.split("::")[0], len(first)))  # stable


@pytest.hookimpl(optionalhook=True)  # only under xdist
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile``, but tests/test_mutants.py -- every exercise's planted mistakes (20 seeds each in the
    full tier), no fixture shared between its tests -- is handed out test by test: as one file it would run on
    one worker alone."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class MutantsTestByTest(LoadFileScheduling):
        def _split_scope(self, nodeid):
            file = super()._split_scope(nodeid)
            return nodeid if file == MUTANTS else file

    return MutantsTestByTest(config, log)
