"""Data-dependent ops in a fake trace: representative values where a tensor's values decide a size."""
from __future__ import annotations

import contextlib


@contextlib.contextmanager
def dynamic_sizes(moe_imbalance: float = 1.0):
    yield
