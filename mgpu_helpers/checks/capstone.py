"""Check of notebook 11: 11.1 the cheapest plan that fits a card, over the planner's own plans."""

import random

from ..capstone import candidate_plans
from ..planner import Plan
from .base import RemembersVerdict, describe_value, expect, expect_equal


def _summary(p):
    return None if p is None else {k: p.config[k] for k in ("world_size", "zero_stage", "checkpointing",
                                                            "micro_batches")}


def _cheapest(plans, fits):
    """The course's rule over the plans ``fits`` keeps: fewest ranks, then the lowest step cost, then the first
    listed; None if it keeps none. With a wrong idea of "fits" it gives that mistake's plan."""
    return min((p for p in plans if fits(p)), key=lambda p: (p.config["world_size"], p.step_cost), default=None)


# The wrong ideas of "fits", each as a rule over (plan, capacity): the check's first cases separate them.
WRONG_FITS = {
    "a plan whose device total equals the capacity fits (device_bytes <= capacity, not <)":
        lambda p, c: p.device_bytes < c,
    "the capacity is per device: compare each rank's device total, not x world size":
        lambda p, c: p.device_bytes * p.config["world_size"] <= c,
    "a card must hold more than the allocated peak: compare plan.device_bytes (peak + allocator reserve + "
    "CUDA context + NCCL), not plan.peak_bytes, with the capacity":
        lambda p, c: p.peak_bytes <= c,
}


class Check11_1(RemembersVerdict):
    id, function, points = "11.1", "choose_plan", 3

    def cases(self, rng):
        totals = sorted({p.device_bytes for p in candidate_plans()})
        lo, hi = totals[0], totals[-1]
        cases = [{"capacity": lo - 1, "what": "below every plan's device total"},     # nothing fits
                 *self._separating(rng),
                 {"capacity": lo, "what": "exactly the smallest device total"},       # fits exactly
                 {"capacity": hi, "what": "exactly the largest device total, costliest listed first",
                  "worst_first": 1},
                 {"capacity": rng.choice(totals[1:-1]), "what": "exactly one plan's device total"}]
        cases += [{"capacity": rng.randint(lo, hi), "what": "random"} for _ in range(3)]
        for c in cases:
            c["order"] = rng.randrange(2**31)
        return cases

    @staticmethod
    def _separating(rng):
        """For each wrong idea of "fits", a capacity (a device total, one byte above it, or a peak) on which it
        alone picks a wrong plan, before any case where they coincide: each mistake is named alone."""
        plans = candidate_plans()
        points = sorted({b for p in plans for b in (p.device_bytes, p.device_bytes + 1, p.peak_bytes)})
        right = {c: _summary(_cheapest(plans, lambda p: p.device_bytes <= c)) for c in points}
        wrong = {name: {c: _summary(_cheapest(plans, lambda p: rule(p, c))) != right[c] for c in points}
                 for name, rule in WRONG_FITS.items()}
        return [{"capacity": rng.choice([c for c in points if wrong[name][c] and not any(
                     wrong[o][c] for o in WRONG_FITS if o != name)] or [c for c in points if wrong[name][c]]),
                 "what": "telling: " + name.split(":")[0].split(" (")[0]} for name in WRONG_FITS]

    def describe(self, case):
        return f"capacity {case['capacity']:,} B ({case['what']})"

    def _plans(self, case):
        plans = candidate_plans()
        random.Random(case["order"]).shuffle(plans)
        if case.get("worst_first"):  # the first listed of the fewest ranks is then never the cheapest
            plans.sort(key=lambda p: -p.step_cost)
        return plans

    def run(self, fn, case):
        chosen = fn(self._plans(case), case["capacity"])
        if chosen is None or isinstance(chosen, Plan):
            return {"type": "Plan" if chosen is not None else "None", "plan": _summary(chosen)}
        return {"type": describe_value(chosen), "plan": None}

    def judge(self, case, result):
        expect(result["type"] in ("Plan", "None"),
               f"choose_plan returned {result['type']}; expected one of the Plan objects it was given, or None")
        plans, capacity = self._plans(case), case["capacity"]
        fit = [p for p in plans if p.device_bytes <= capacity]
        right = _cheapest(fit, lambda p: True)
        wrong = {name: _cheapest(plans, lambda p, rule=rule: rule(p, capacity)) for name, rule in WRONG_FITS.items()}
        wrong.update({
            "the lowest step cost first, ignoring the number of ranks":
                min(fit, key=lambda p: p.step_cost, default=None),
            "fewest ranks, but not the lowest step cost among them":
                min(fit, key=lambda p: p.config["world_size"], default=None),
            "the plan with the smallest device total, not the cheapest":
                min(fit, key=lambda p: p.device_bytes, default=None),
            "when nothing fits, return None (not the plan closest to fitting)":
                min(plans, key=lambda p: p.device_bytes) if not fit else right,
        })
        expect_equal(result["plan"], _summary(right), "the chosen plan",
                     mistakes={k: _summary(v) for k, v in wrong.items()},
                     hint="Fits: device_bytes <= capacity. Cheapest: fewest ranks, then the lowest step_cost.")
