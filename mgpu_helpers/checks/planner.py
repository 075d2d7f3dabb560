"""Check of notebook 11: 11.1 the cheapest plan that fits a per-device budget, over the planner's own plans."""
from __future__ import annotations

import random

from ..planner import Plan, candidate_plans
from ..planner.capstone import CHECK_THREADS, _summary
from .base import REGISTRY, describe_value, expect, expect_equal
from .remember import RemembersVerdict


class Check11_1(RemembersVerdict):
    id, function, points = "11.1", "choose_plan", 3

    def cases(self, rng):
        peaks = sorted({p.peak_bytes for p in candidate_plans(threads=CHECK_THREADS)})
        lo, hi = peaks[0], peaks[-1]
        cases = [{"budget": lo - 1, "what": "below every plan's peak"},            # nothing fits
                 *self._separating(rng),
                 {"budget": lo, "what": "exactly the smallest peak"},              # fits exactly
                 {"budget": hi, "what": "exactly the largest peak, costliest listed first", "worst_first": 1},
                 {"budget": rng.choice(peaks[1:-1]), "what": "exactly one plan's peak"}]
        cases += [{"budget": rng.randint(lo, hi), "what": "random"} for _ in range(3)]
        for c in cases:
            c["order"] = rng.randrange(2**31)
        return cases

    @staticmethod
    def _separating(rng):
        """Two budgets on which "peak < budget" and "peak x world size <= budget" give different wrong answers,
        each before any case where they coincide, so that each mistake is named alone: a one-rank plan's exact
        peak (only `<` goes wrong there), and a budget between two peaks whose answer needs several ranks (only
        the x world size mistake goes wrong)."""
        def cheapest_plan(ps, budget):  # the rule, only to pick telling budgets (the judge's is in references)
            return min((p for p in ps if p.peak_bytes <= budget), key=lambda p: (p.config["world_size"], p.step_cost),
                       default=None)

        plans = candidate_plans(threads=CHECK_THREADS)
        peaks = sorted({p.peak_bytes for p in plans})
        at_peak = [p.peak_bytes for p in plans if p.config["world_size"] == 1 and
                   _summary(cheapest_plan(plans, p.peak_bytes)) == _summary(p)]
        between = [a + 1 for a, b in zip(peaks, peaks[1:]) if b > a + 1 and
                   cheapest_plan(plans, a + 1).config["world_size"] > 1 and
                   _summary(cheapest_plan([p for p in plans if p.peak_bytes * p.config["world_size"] <= a + 1], a + 1))
                   != _summary(cheapest_plan(plans, a + 1))]
        return [{"budget": rng.choice(sorted(at_peak)), "what": "exactly a one-rank plan's peak"},
                {"budget": rng.choice(between), "what": "between two peaks, more than one rank needed"}]

    def describe(self, case):
        return f"budget {case['budget']:,} B ({case['what']})"

    def _plans(self, case):
        plans = candidate_plans(threads=CHECK_THREADS)
        random.Random(case["order"]).shuffle(plans)
        if case.get("worst_first"):  # the first listed of the fewest ranks is then never the cheapest
            plans.sort(key=lambda p: -p.step_cost)
        return plans

    def run(self, fn, case):
        chosen = fn(self._plans(case), case["budget"])
        if chosen is None or isinstance(chosen, Plan):
            return {"type": "Plan" if chosen is not None else "None", "plan": _summary(chosen)}
        return {"type": describe_value(chosen), "plan": None}

    def judge(self, case, result):
        from .references.planner import cheapest_plan
        expect(result["type"] in ("Plan", "None"),
               f"choose_plan returned {result['type']}; expected one of the Plan objects it was given, or None")
        plans, budget = self._plans(case), case["budget"]
        fit = [p for p in plans if p.peak_bytes <= budget]
        wrong = {
            "a plan whose peak equals the budget fits (peak <= budget, not <)":
                cheapest_plan([p for p in plans if p.peak_bytes < budget], budget),
            "the budget is per device: compare each rank's peak, not peak x world size":
                cheapest_plan([p for p in plans if p.peak_bytes * p.config["world_size"] <= budget], budget),
            "the lowest step cost first, ignoring the number of ranks":
                min(fit, key=lambda p: p.step_cost, default=None),
            "fewest ranks, but not the lowest step cost among them":
                min(fit, key=lambda p: p.config["world_size"], default=None),
            "the plan with the smallest peak, not the cheapest":
                min(fit, key=lambda p: p.peak_bytes, default=None),
            "when nothing fits, return None (not the plan closest to fitting)":
                min(plans, key=lambda p: p.peak_bytes) if not fit else cheapest_plan(plans, budget),
        }
        expect_equal(result["plan"], _summary(cheapest_plan(plans, budget)), "the chosen plan",
                     mistakes={k: _summary(v) for k, v in wrong.items()},
                     hint="Fits: peak_bytes <= budget. Cheapest: fewest ranks, then the lowest step_cost.")


check_11_1 = REGISTRY["11.1"]
