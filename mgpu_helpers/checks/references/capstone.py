"""Check 11.1's reference: the cheapest plan that fits a card (never for a notebook)."""
from __future__ import annotations


def cheapest_plan(plans, capacity):
    """Fewest ranks, then the lowest step cost, then the first listed, of the plans whose device total fits
    ``capacity``; None if none fits."""
    fitting = [p for p in plans if p.device_bytes <= capacity]
    return min(fitting, key=lambda p: (p.config["world_size"], p.step_cost), default=None)
