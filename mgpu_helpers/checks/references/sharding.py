"""A ZeRO-2 gradient reduce-scatter (exercise 8.2's contract) for the tests, the GPU bench and the script
(never for a notebook)."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn import functional as F


def reference_reduce_scatter(params):
    """Padded flat gradient, reduce-scattered and averaged; every p.grad freed."""
    world, rank = dist.get_world_size(), dist.get_rank()
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    n = -(-flat.numel() // world)
    flat = F.pad(flat, (0, n * world - flat.numel()))
    for p in params:
        p.grad = None
    shard = flat.new_empty(n)
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(shard, flat)
    return shard / world
