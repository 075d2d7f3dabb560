"""Notebook 12 -- the planner (``planner.plan``, notebook 11) on this notebook's knobs, against the measurement.
Knobs map one to one but prefetch: the planner's ``prefetch=1`` is FSDP2's default order (this notebook's
``prefetch=0``); ``k > 1`` sets k units explicitly both ways.
"""
from __future__ import annotations

import functools

from torch.nn import functional as F

from ..memory import make_batch
from .knobs import KNOBS, MODEL, Net

PRECISION = {"fp32": "fp32", "mp_policy": "fsdp-mixed", "autocast": "bf16-autocast"}


def plan_knobs(world_size: int, knobs: dict, model_kw=None):
    """``planner.plan`` for :func:`fsdp_practice.measure`'s step under ``knobs`` on ``world_size`` ranks
    (one rank's batch of ``knobs.get("rows", 8)``): the planner's :class:`~mgpu_helpers.planner.Plan`."""
    from ..planner import plan

    k = {**KNOBS, **knobs}
    if set(knobs) - {"reshard_after_forward", "prefetch", "precision", "offload", "rows"}:
        raise ValueError(f"knobs {knobs}: the planner plans reshard_after_forward (True, False, an int), "
                         "prefetch, precision, offload")
    mkw = {**MODEL, **(model_kw or {})}
    batch = make_batch(k["rows"], mkw["d_in"], mkw["classes"], 1)  # only shapes and dtypes are used
    return plan(functools.partial(Net, **mkw), batch, loss_fn=F.cross_entropy, optimizer="adam",
                precision=PRECISION[k["precision"]], zero_stage=3, world_size=world_size, device="cpu",
                reshard_after_forward=k["reshard_after_forward"], prefetch=k["prefetch"] or 1,
                offload=k["offload"])
