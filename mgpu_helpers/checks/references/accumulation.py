"""The accumulation loop checks 5.1/5.2 and the module's script use (never for a notebook)."""
from __future__ import annotations

import contextlib

from ...accumulation import no_sync_context


def accumulate(model, loss_fn, inputs, targets, k, skip=no_sync_context) -> float:
    """Forward/backward ``k`` equal micro-batches with loss/k; the first k-1 inside ``skip(model)``
    (``skip=None`` for a model with nothing to sync). Returns the accumulated loss (the big batch's)."""
    if len(inputs) % k:
        raise ValueError(f"k={k} does not divide the batch of {len(inputs)}")
    total = 0.0
    for i, (x, y) in enumerate(zip(inputs.tensor_split(k), targets.tensor_split(k))):
        last = i == k - 1
        with contextlib.nullcontext() if last or skip is None else skip(model):
            loss = loss_fn(model(x), y) / k  # mean over the micro-batch / k = its share of the big batch's mean
            loss.backward()
        total += loss.item()
    return total
