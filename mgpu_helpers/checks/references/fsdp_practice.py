"""The judge's side of notebook 12's checks: the rule exercise 12.1 asks for, and the variants that name
its usual mistakes. Imported only inside ``judge`` (``checks.fsdp_practice``), never by the notebook or
the lesson module, so that no working answer is importable from a learner's kernel by the lesson's names.
"""
from __future__ import annotations


def _knobs(row):
    return {"reshard_after_forward": row["reshard_after_forward"], "prefetch": row["prefetch"]}


def choose(options, budget, comm_budget, *, memory=True, comm=True, order="fastest"):
    """The fastest row that fits: peak <= budget and gathered <= comm_budget; fastest = fewest bytes
    all-gathered, then prefetch on (hides the all-gathers behind compute), then the lower peak. None when
    nothing fits. ``memory``/``comm`` False ignore that budget; ``order`` "least memory" sorts by peak,
    "no prefetch" prefers prefetch off -- the mistakes."""
    fits = [r for r in options if (not memory or r["peak"] <= budget) and (not comm or r["gathered"] <= comm_budget)]
    if not fits:
        return None
    key = {"fastest": lambda r: (r["gathered"], -r["prefetch"], r["peak"]),
           "least memory": lambda r: (r["peak"], r["gathered"], -r["prefetch"]),
           "no prefetch": lambda r: (r["gathered"], r["prefetch"], r["peak"])}[order]
    return _knobs(min(fits, key=key))


MISTAKES_12_1 = {
    "the memory budget was ignored (a row whose peak exceeds the budget was chosen)": dict(memory=False),
    "the communication budget was ignored (a row that all-gathers more than the budget was chosen)":
        dict(comm=False),
    "both budgets were ignored": dict(memory=False, comm=False),
    "the least memory was chosen, not the least communication (within the budgets, fewer bytes "
    "all-gathered is faster)": dict(order="least memory"),
    "prefetch was left off although the budgets allow it (prefetch costs no extra all-gather bytes and "
    "hides them behind compute)": dict(order="no prefetch"),
}
