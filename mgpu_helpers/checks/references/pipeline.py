"""A GPipe step with exercise 9.1's contract, for the tests, the GPU benches and the module's script (never
for a notebook)."""
from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from ...model_sharding.pipeline import stage_bounds


@contextlib.contextmanager
def _busy(timeline, kind, j):
    t0 = time.perf_counter()  # CLOCK_MONOTONIC on Linux: one clock for every process of the machine
    yield
    if timeline is not None:
        timeline.append((kind, j, t0, time.perf_counter()))


def gpipe_step(model: nn.Sequential, inputs, targets, n_micro: int, timeline: list | None = None):
    """GPipe forward + backward of ``model`` split over the ranks (every rank passes the same model
    and batch; each uses its own stage). Leaves each stage's gradients in its parameters; returns the batch's
    mean loss on the last rank, None elsewhere. ``timeline`` collects (kind, micro-batch, t0, t1)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if len(inputs) % n_micro:
        raise ValueError(f"n_micro={n_micro} does not divide the batch of {len(inputs)} samples")
    start, end = stage_bounds(len(model), world)[rank]
    stage, first, last = model[start:end], rank == 0, rank == world - 1
    saved, loss = [], 0.0
    for j, (x, y) in enumerate(zip(inputs.chunk(n_micro), targets.chunk(n_micro))):  # all forwards...
        if not first:
            x = torch.empty_like(x)
            dist.recv(x, src=rank - 1)
            x.requires_grad_()  # its gradient is what we send back
        with _busy(timeline, "F", j):
            out = stage(x)
            out = F.cross_entropy(out, y) / n_micro if last else out  # the micro-batch's share of the mean
        if not last:
            dist.send(out.detach(), dst=rank + 1)
        saved.append((x, out))
    for j, (x, out) in enumerate(saved):  # ...then all backwards
        grad = None
        if not last:
            grad = torch.empty_like(out)
            dist.recv(grad, src=rank + 1)
        with _busy(timeline, "B", j):
            out.backward(grad)
        loss += out.item() if last else 0.0
        if not first:
            dist.send(x.grad, dst=rank - 1)
    return loss if last else None
