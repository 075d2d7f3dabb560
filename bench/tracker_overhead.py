"""What MemoryTracker costs a training step, measured side by side in one run (tests never assert times).

    python bench/tracker_overhead.py        # a 1M-parameter MLP, 64 rows; ~10 s on 2 cores

Prints the median step time without and with the tracker (the dispatch mode sees every op) and their ratio.
"""
from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from mgpu_helpers.runtime.tracker import MemoryTracker


def step(model, opt, x, mt=None):
    loss = model(x).sum()
    if mt:
        mt.mark("backward")
    loss.backward()
    del loss
    if mt:
        mt.mark("step")
    opt.step()
    opt.zero_grad(set_to_none=True)


def timed(fn, n=15):
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times[2:])  # the first steps pay one-off costs (Adam's state, allocator)


def main():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True)
    x = torch.randn(64, 512)
    plain = timed(lambda: step(model, opt, x))
    with MemoryTracker(model, opt) as mt:
        tracked = timed(lambda: step(model, opt, x, mt))
    params = sum(p.numel() for p in model.parameters())
    print(f"{params:,} parameters, batch 64, {torch.get_num_threads()} threads")
    print(f"step without the tracker {plain * 1e3:8.2f} ms")
    print(f"step with the tracker    {tracked * 1e3:8.2f} ms   ratio {tracked / plain:.2f}x")


if __name__ == "__main__":
    main()
