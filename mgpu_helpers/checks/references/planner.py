"""Check 11.1's reference: the cheapest plan that fits (never for a notebook)."""
from __future__ import annotations


def cheapest_plan(plans, budget):
    """Fewest ranks, then the lowest step cost, then the first listed; None if none fits."""
    fitting = [p for p in plans if p.peak_bytes <= budget]
    return min(fitting, key=lambda p: (p.config["world_size"], p.step_cost), default=None)
