"""Notebook 07's compute claims on a GPU: what checkpointing re-runs (counted from the op log, the same on
every device) next to what it costs in time there (CUDA events, median of many steps).

    PYTHONPATH=. python3 bench/checkpointing_time_gpu.py           # d=1024, h=4096, batch 8192, 8 blocks
    PYTHONPATH=. python3 bench/checkpointing_time_gpu.py --small   # a quick run of the same code (CPU too)

Two tables: (1) the residual stack of §3 for k = 1..L: matmuls re-run (2L - segments), the ratio the op counts
predict if matmuls were all the time, and the measured ratio to no checkpointing; (2) §4's transformer MLP
blocks: no checkpointing, selective (save matmuls) and full, with the ops re-run and the measured time.
The notebook says SAC pays off in time where matmuls dominate (a GPU) and comes out close to full
checkpointing on a CPU; this bench is what that claim rests on for the GPU. Without CUDA it runs on the CPU
(wall clock). Output also goes to ``$OUT/checkpointing_time_gpu.txt`` when ``OUT`` is set.
"""
import argparse
import functools
import os
import statistics
import time

import torch
import torch.nn.functional as F

from mgpu_helpers.memory import make_batch  # noqa: E402
from mgpu_helpers.checkpointing import (Stack, no_checkpointing, op_count_ratio, recomputed_ops,
                                        selective_context)
from mgpu_helpers.checks.references import checkpoint_every


def step_ms(model, x, y, fwd, k, repeat):
    """Median milliseconds of one forward + backward (after 3 warm-up steps)."""
    cuda = x.is_cuda
    times = []
    for i in range(repeat + 3):
        model.zero_grad(set_to_none=True)
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        F.cross_entropy(model.head(fwd(model.blocks, x, k)), y).backward()
        if cuda:
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end)
        else:
            ms = 1e3 * (time.perf_counter() - t0)
        if i >= 3:
            times.append(ms)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    L, d, h, batch, repeat = (4, 64, 256, 512, 5) if args.small else (8, 1024, 4096, 8192, 20)
    lines = [f"device: {torch.cuda.get_device_name() if dev == 'cuda' else f'cpu ({os.cpu_count()} cores)'}; "
             f"torch {torch.__version__}; {L} blocks, d={d}, h={h}, batch {batch}; median of {repeat} steps"]

    model, (x, y) = Stack(L, d, h, 8), make_batch(batch, d, 8)
    counts = {k: recomputed_ops(model, x, y, checkpoint_every, k).get("addmm", 0) for k in range(1, L + 1)}
    model, x, y = model.to(dev), x.to(dev), y.to(dev)
    base = step_ms(model, x, y, no_checkpointing, None, repeat)
    lines.append(f"\n(1) residual stack: no checkpointing {base:.2f} ms")
    lines.append(f"{'k':>4}{'matmuls re-run':>16}{'op-count ratio':>16}{'measured ratio':>16}")
    for k in range(1, L + 1):
        ms = step_ms(model, x, y, checkpoint_every, k, repeat)
        lines.append(f"{k:>4}{counts[k]:>16}{op_count_ratio(counts[k], L):>15.2f}x{ms / base:>15.2f}x")

    variants = {"no checkpointing": (no_checkpointing, None),
                "selective (save matmuls)": (functools.partial(checkpoint_every, context_fn=selective_context), 1),
                "full checkpointing": (checkpoint_every, 1)}
    model, (x, y) = Stack(L, d, h, 8, transformer=True), make_batch(batch, d, 8)
    redo = {n: recomputed_ops(model, x, y, f, k) for n, (f, k) in variants.items()}
    model, x, y = model.to(dev), x.to(dev), y.to(dev)
    lines.append("\n(2) transformer MLP blocks, one segment per block")
    ref = None
    for name, (fwd, k) in variants.items():
        ms = step_ms(model, x, y, fwd, k, repeat)
        ref = ref or ms
        ops = ", ".join(f"{op} x{n}" for op, n in sorted(redo[name].items())) or "nothing"
        lines.append(f"  {name:<26}{ms:>9.2f} ms ({ms / ref:.2f}x)   re-run in backward: {ops}")
    text = "\n".join(lines)
    print(text)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "checkpointing_time_gpu.txt"), "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
