"""The exercises' checks: ``base`` is the machinery; ``checks/<lesson>.py`` holds the checks of the notebook of
``mgpu_helpers/<lesson>.py`` (``from mgpu_helpers.checks.ddp import check_4_1``). ``references/`` is imported only
inside ``judge`` and not mounted in the grading sandbox, so no learner's code can reach it while it is graded."""
from .base import *  # noqa: F401,F403  the machinery, for `from mgpu_helpers.checks import Check`


def load_checks(module: str) -> None:
    """Register the checks of a notebook whose helper module is ``module`` (``mgpu_helpers.ddp`` ->
    ``mgpu_helpers.checks.ddp``); a module of the course's own without checks is imported as it is."""
    import importlib.util
    importlib.import_module(module)
    package, _, lesson = module.rpartition(".")
    if package == "mgpu_helpers" and importlib.util.find_spec(f"{__name__}.{lesson}"):
        importlib.import_module(f"{__name__}.{lesson}")
