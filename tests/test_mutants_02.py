"""Each check of notebook 02 passes the solution, fails the stub, and names planted mistakes."""
from pathlib import Path

import pytest

from mgpu_helpers.tools.authoring import mutant_fails_every_seed, solution_verdict, stub_verdict
import mgpu_helpers.checks.profiling  # noqa: F401  (registers 2.1 and 2.2)

NB = Path(__file__).resolve().parent.parent / "solutions" / "02_measuring_memory.ipynb"

CASES = {
    "2.1": ("peak_memory", [
        ("return tracker.peak_bytes - before", "return tracker.current_bytes - before",
         "returned the CURRENT bytes after the step"),
        ("    tracker.reset_peak()", "    pass", "forgot to reset the peak first"),
        ("return tracker.peak_bytes - before", "return tracker.peak_bytes", "included the baseline"),
    ]),
    "2.2": ("peak_phase", [
        ("peaks = t.phase_peaks()", "peaks = {phase: total for phase, total, _ in t.timeline}",
         "largest memory at its END"),
        ("return max(peaks, key=peaks.get)", "return next(iter(peaks))", "returned simply the first phase"),
        ("return max(peaks, key=peaks.get)", "return [max(peaks, key=peaks.get)]", "returned a list; expected a str"),
        ("    with MemoryTracker(model, optimizer) as t:",
         "    return 'backward' if len(x) > 64 else 'optimizer'\n    with MemoryTracker(model, optimizer) as t:",
         "guessed the phase from the batch size"),
    ]),
}


def _marked(ex):
    return getattr(pytest.mark, f"ex_{ex.replace('.', '_')}")


PARAMS = [pytest.param(ex, m, marks=_marked(ex), id=f"{ex}-{m[2][:24]}") for ex, (_, ms) in CASES.items() for m in ms]


@pytest.mark.parametrize("ex", [pytest.param(e, marks=_marked(e)) for e in CASES])
def test_solution_passes_and_stub_fails(ex):
    fn_name, _ = CASES[ex]
    for seed in (None, 7):
        ok, msg = solution_verdict(NB, ex, fn_name, seed=seed)
        assert ok, msg
    ok, msg = stub_verdict(NB, ex, fn_name)
    assert not ok and "not implemented yet" in msg and f"Exercise {ex}" in msg


@pytest.mark.parametrize("ex,mutant", PARAMS)
def test_planted_mistake_is_named_under_20_seeds(ex, mutant):
    old, new, named = mutant
    mutant_fails_every_seed(NB, ex, CASES[ex][0], [(old, new)], named)
