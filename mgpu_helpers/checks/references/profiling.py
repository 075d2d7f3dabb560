"""What checks 2.1 and 2.2 compare against (never for a notebook)."""
from __future__ import annotations

from ...memory import make_optimizer
from ...profiling import scenario_inputs, scenario, train_step
from ...runtime.tracker import MemoryTracker


def peak_figures(case: dict) -> dict:
    """Before the step, the earlier peak, the step's own peak and what it left: 2.1's scenario, measured."""
    with scenario(case) as (step, t):
        before, old_peak = t.current_bytes, t.peak_bytes
        t.reset_peak()
        step()
        return {"before": before, "old_peak": old_peak, "peak": t.peak_bytes, "after": t.current_bytes}


def phase_peaks(case: dict) -> tuple[dict, dict]:
    """(peak bytes within each phase, bytes at the end of each phase) of the reference step, for 2.2."""
    model, (x, y) = scenario_inputs(case)
    opt = make_optimizer(case["optimizer"], model.parameters())
    with MemoryTracker(model, opt) as t:
        train_step(model, opt, x, y, mark=t.mark)
    return t.phase_peaks(), {phase: total for phase, total, _ in t.timeline}
