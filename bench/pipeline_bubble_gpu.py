"""Notebook 09's bubble in seconds on GPUs: does the measured bubble follow (p-1)/(m+p-1) with a GPU per rank?

    PYTHONPATH=. python3 bench/pipeline_bubble_gpu.py            # p = 2 and 4 ranks (as many GPUs as there are)
    PYTHONPATH=. python3 bench/pipeline_bubble_gpu.py --cpu      # the same on gloo/CPU with a small model (a dry run)

Notebook 09 rests its claim on the step clock and says that with a GPU per rank, where a stage's compute dwarfs
a message's latency, measured bubbles come closer to the formula. This measures it. Per (p, m): the step time
of ``gpipe_step`` over NCCL (synchronized, the fastest of 5 after 2 warm-ups, the slowest rank), and each rank's
busy time -- its stage's forward and backward of the same m micro-batches alone, no communication, synchronized.
Measured bubble = 1 - busy / step, averaged over ranks. Prints a table: p, m, formula, measured.
"""
import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing
from mgpu_helpers.runtime.launch import rank_device, run_ranks  # noqa: E402
from mgpu_helpers.memory import make_batch  # noqa: E402
from mgpu_helpers.model_sharding import make_model, stage_bounds  # noqa: E402
from mgpu_helpers.checks.references import gpipe_step  # noqa: E402


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _timed(dev, fn, repeats=5, warmup=2):
    best = None
    for i in range(warmup + repeats):
        dist.barrier()
        _sync(dev)
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        span = torch.tensor([time.perf_counter() - t0], device=dev)
        dist.all_reduce(span, op=dist.ReduceOp.MAX)  # the step ends when the slowest rank is done
        if i >= warmup:
            best = span.item() if best is None else min(best, span.item())
    return best


def bubble(rank, world, m, n_layers, width, batch):
    dev = rank_device()
    model = make_model(n_layers, width).to(dev)
    x, y = (t.to(dev) for t in make_batch(batch, width, width))
    a, b = stage_bounds(n_layers, world)[rank]
    stage = model[a:b]

    def pipeline():
        model.zero_grad(set_to_none=True)
        gpipe_step(model, x, y, m)

    def alone():  # this rank's share of the work, without waiting for anyone
        outs = []
        for xm in x.chunk(m):
            xm = xm.detach().requires_grad_()
            outs.append(stage(xm))
        for out in outs:
            out.backward(torch.ones_like(out))

    step = _timed(dev, pipeline)
    busy = torch.tensor([_timed_local(dev, alone)], device=dev)
    dist.all_reduce(busy)
    return 1 - busy.item() / world / step, step


def _timed_local(dev, fn, repeats=5, warmup=2):
    best = None
    for i in range(warmup + repeats):
        _sync(dev)
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        if i >= warmup:
            best = min(best or 1e9, time.perf_counter() - t0)
    return best


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="gloo on the CPU with a small model (a dry run)")
    a = ap.parse_args()
    gpus = 0 if a.cpu else torch.cuda.device_count()
    if not a.cpu and gpus < 2:
        sys.exit(f"needs 2 or more GPUs (found {gpus}); --cpu runs a small dry run on gloo")
    worlds = [p for p in (2, 4) if a.cpu or p <= gpus]
    n_layers, width, batch = (8, 64, 64) if a.cpu else (8, 8192, 2048)
    print("torch", torch.__version__, "|", f"{gpus} GPU(s)" if gpus else "CPU (gloo)",
          torch.cuda.get_device_name(0) if gpus else "", f"| {n_layers} layers Linear({width}, {width}), batch {batch}")
    print(f"{'p':>2} {'m':>3}  {'(p-1)/(m+p-1)':>14}  {'measured':>9}  {'step (ms)':>10}")
    for p in worlds:
        for m in (1, 2, 4, 8):
            measured, step = run_ranks(bubble, p, m, n_layers, width, batch, timeout=600)[0]
            print(f"{p:>2} {m:>3}  {(p - 1) / (m + p - 1):>14.3f}  {measured:>9.3f}  {1e3 * step:>10.2f}")
