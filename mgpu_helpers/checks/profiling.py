"""Checks of notebook 02: 2.1 a peak-memory measurement, 2.2 the phase where a step peaks (against the tracker)."""
from __future__ import annotations

from ..memory import make_optimizer
from ..profiling import _inputs, scenario
from .base import REGISTRY, Check, expect, expect_equal, expect_type, plain


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
        from .references.profiling import peak_figures
        m = peak_figures(case)
        expect(m["old_peak"] > m["peak"], f"check error: the earlier peak is not above the step's ({case})")
        expect_equal(result, m["peak"] - m["before"], "the bytes the step added at its peak", mistakes={
            "returned the CURRENT bytes after the step (what it left behind), not its peak":
                m["after"] - m["before"],
            "returned the current bytes after the step, baseline included": m["after"],
            "forgot to reset the peak first, so an earlier, larger peak leaked in": m["old_peak"] - m["before"],
            "forgot to reset the peak, and included the baseline": m["old_peak"],
            "included the baseline allocated before the step (subtract what was allocated before it)": m["peak"],
        }, hint="Hint: note what is allocated, reset the peak, run the step, subtract.")


class PeakPhase(Check):
    id, function = "2.2", "peak_phase"
    may_use = ("mgpu_helpers.runtime.tracker",)  # the task: measure the phases with MemoryTracker

    def cases(self, rng):
        # Fixed kinds, random sizes. Weight-heavy (tiny batch): the optimizer's first step peaks with Adam's two
        # states or momentum's buffer, but backward with plain SGD (it makes no state). Activation-heavy (big
        # batch, narrow layers): backward peaks. Wide layers with a mid-size batch: Adam's step peaks. So the
        # peak phase is a function of no one of batch size, width or optimizer: it has to be measured.
        out = []
        for kind, opt in (("weights", "adam"), ("weights", "momentum"), ("weights", "sgd"),
                          ("activations", "adam"), ("activations", "sgd"), ("wide", "adam")):
            if kind == "weights":
                hidden, batch, first = rng.randint(256, 384), rng.randint(2, 8), rng.randint(128, 256)
            elif kind == "activations":
                hidden, batch, first = rng.randint(32, 64), rng.randint(1024, 2048), rng.randint(16, 32)
            else:
                hidden, batch, first = rng.randint(768, 1024), rng.randint(96, 192), rng.randint(128, 256)
            widths = [first] + [hidden] * rng.randint(1, 3) + [10]
            out.append({"widths": widths, "batch": batch, "optimizer": opt, "seed": rng.randrange(2**31)})
        return out

    def run(self, fn, case):
        model, batch = _inputs(case)
        return plain(fn(model, make_optimizer(case["optimizer"], model.parameters()), batch))

    def judge(self, case, result):
        expect_type(result, str, self.function, "a str: 'forward', 'backward' or 'optimizer'")
        from .references.profiling import phase_peaks
        peaks, ends = phase_peaks(case)
        expected = max(peaks, key=peaks.get)
        wrong: dict[str, list[str]] = {}  # mistaken answer -> the mistakes that give it here
        for name, value in (("returned the phase with the largest memory at its END, not the largest peak "
                             "within it", max(ends, key=ends.get)), ("returned simply the first phase", "forward"),
                            ("guessed the phase from the batch size instead of measuring it (a weight-heavy "
                             "step with plain SGD peaks in backward; a wide one with Adam, in the optimizer)",
                             "backward" if case["batch"] > 64 else "optimizer")):
            if value != expected:
                wrong.setdefault(value, []).append(name)
        expect_equal(result, expected, "the phase where memory peaks",
                     mistakes={"; or ".join(names): value for value, names in wrong.items()},
                     hint="Hint: mark the three phases, then take the one with the largest phase_peaks().")


check_2_1 = REGISTRY["2.1"]
check_2_2 = REGISTRY["2.2"]
