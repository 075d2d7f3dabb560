"""Checks of notebook 02: 2.1 a peak-memory measurement, 2.2 the phase where a step peaks (against the tracker)."""

from ..memory import make_optimizer
from ..profiling import scenario_inputs, scenario
from .base import Check, expect_equal, expect_type, plain


class PeakMemory(Check):
    id, function = "2.1", "peak_memory"

    def cases(self, rng):
        out = [{"widths": [rng.randint(8, 64) for _ in range(rng.randint(3, 5))], "batch": rng.randint(64, 512),
                "seed": rng.randrange(2**31), "baseline": rng.randint(1, 64) * 4096} for _ in range(3)]
        for c in out:  # the earlier spike: well above anything the step allocates (activations, grads, temps)
            w, b = c["widths"], c["batch"]
            c["spike"] = 8 * (3 * b * sum(w) + 3 * sum(i * o + o for i, o in zip(w, w[1:]))) + rng.randint(1, 64) * 4096
        return out

    def run(self, fn, case):
        with scenario(case) as (step, tracker):
            return plain(fn(step, tracker))

    def judge(self, case, result):
        expect_type(result, int, self.function, "an int: a number of bytes")
        from .references import peak_figures
        m = peak_figures(case)
        expect_equal(result, m["peak"] - m["before"], "the bytes the step added at its peak", mistakes={
            "returned the CURRENT bytes after the step (what it left behind), not its peak":
                m["after"] - m["before"],
            "returned the current bytes after the step, baseline included": m["after"],
            "forgot to reset the peak first, so an earlier, larger peak leaked in": m["old_peak"] - m["before"],
            "forgot to reset the peak, and included the baseline": m["old_peak"],
            "included the baseline allocated before the step (subtract what was allocated before it)": m["peak"],
        }, hint="Hint: note what is allocated, reset the peak, run the step, subtract.")


# 2.2's kinds of step: (hidden width, batch, input width) ranges
_SIZES = {"weights": ((256, 384), (2, 8), (128, 256)), "activations": ((32, 64), (1024, 2048), (16, 32)),
          "narrow": ((24, 32), (48, 64), (4, 8)), "wide": ((768, 1024), (96, 192), (128, 256))}


class PeakPhase(Check):
    id, function = "2.2", "peak_phase"
    may_use = ("mgpu_helpers.runtime.tracker",)  # the task: measure the phases with MemoryTracker

    def cases(self, rng):
        # Fixed kinds, random sizes: weight-heavy steps and wide ones with Adam peak in the optimizer, activation-heavy
        # and narrow ones with SGD in backward; so no rule on the batch size gives every answer: it must be measured.
        out = []
        for kind, opt in (("weights", "adam"), ("weights", "momentum"), ("activations", "adam"),
                          ("activations", "sgd"), ("narrow", "sgd"), ("wide", "adam")):
            hidden, batch, first = (rng.randint(*r) for r in _SIZES[kind])
            widths = [first] + [hidden] * rng.randint(1, 3) + [10]
            out.append({"kind": kind, "widths": widths, "batch": batch, "optimizer": opt,
                        "seed": rng.randrange(2**31)})
        return out

    def run(self, fn, case):
        model, batch = scenario_inputs(case)
        return plain(fn(model, make_optimizer(case["optimizer"], model.parameters()), batch))

    def judge(self, case, result):
        expect_type(result, str, self.function, "a str: 'forward', 'backward' or 'optimizer'")
        from .references import phase_peaks
        peaks, ends = phase_peaks(case)
        expect_equal(result, max(peaks, key=peaks.get), "the phase where memory peaks", mistakes={
            "returned the phase with the largest memory at its END, not the largest peak within it":
                max(ends, key=ends.get),
            "returned simply the first phase": "forward",
            "guessed the phase from the batch size instead of measuring it (narrow layers with plain SGD peak in "
            "backward at a small batch; wide ones with Adam in the optimizer at a larger one)":
                "backward" if case["batch"] > 64 else "optimizer"},
            hint="Hint: mark the three phases, then take the one with the largest phase_peaks().")
