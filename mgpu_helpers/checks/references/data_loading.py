"""What check 10.1 compares against: DistributedSampler itself, and its rule written out with one part left
wrong at a time to name a learner's mistake (never for a notebook)."""
from __future__ import annotations

import torch
from torch.utils.data import DistributedSampler


def sampler_shard(n, world_size, rank, shuffle, seed, epoch, drop_last) -> list[int]:
    """What torch's DistributedSampler yields for ``rank`` in ``epoch`` (the ground truth of check 10.1)."""
    s = DistributedSampler(range(n), num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed,
                           drop_last=drop_last)
    s.set_epoch(epoch)
    return list(s)


def sampler_variant(n, world, shuffle, seed, epoch, drop_last, *, pad=True, strided=True, use_epoch=True):
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch * use_epoch)).tolist() \
        if shuffle else list(range(n))
    per = -(-(n - world) // world) if drop_last and n % world else -(-n // world)
    total = per * world
    if drop_last:
        order = order[:total]
    elif pad:
        order = (order * -(-total // max(n, 1)))[:total]
    if strided:
        return [order[r:total:world] for r in range(world)]
    return [order[r * per:(r + 1) * per] for r in range(world)]
