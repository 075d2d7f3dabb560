"""Notebook 07 on a GPU: the CPU tracker's peak vs ``torch.cuda.max_memory_allocated()`` for the same
forward + backward of a residual MLP stack, without checkpointing and with segments of k blocks.

    PYTHONPATH=. python3 bench/checkpointing_gpu.py            # 16 blocks, d=512, h=1024, batch 4096 (~2 min, CPU side dominates)
    PYTHONPATH=. python3 bench/checkpointing_gpu.py --small    # a quick run of the same code

For each plan: (a) CUDA: after a warm-up step (cuBLAS workspace), what is allocated beyond the model is
subtracted and the peak stats are reset, then one step; (b) CPU: ``MemoryTracker(round_to=512)`` over the
same step on a copy of the model (CUDA's 512-byte blocks); (c) ``predict_peak`` (exact bytes, no rounding).
Without CUDA only (b) and (c) run. Output also goes to ``$OUT/checkpointing_gpu.txt`` when ``OUT`` is set.
"""
import argparse
import copy

import torch
import torch.nn.functional as F

from bench.measure import cuda_step_peak
from bench.tracker_vs_cuda import Report, diff
from mgpu_helpers.checkpointing import Stack, no_checkpointing, plan_for, predict_peak
from mgpu_helpers.checks.references import checkpoint_every
from mgpu_helpers.runtime.tracker import MemoryTracker

MiB = 2**20


def step(model, x, y, k):
    fwd = no_checkpointing if k is None else checkpoint_every
    F.cross_entropy(model.head(fwd(model.blocks, x, k)), y).backward()
    model.zero_grad(set_to_none=True)


def cuda_peak(base, x, y, k):
    model = copy.deepcopy(base).cuda()
    x, y = x.cuda(), y.cuda()
    return cuda_step_peak(lambda: step(model, x, y, k), held=lambda: list(model.parameters()))[0]


def tracker_peak(base, x, y, k):
    model = copy.deepcopy(base)
    with MemoryTracker(model, round_to=512) as mt:
        step(model, x, y, k)
    return mt.peak_bytes


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true")
    args = ap.parse_args()
    L, d, h, c, B = (8, 64, 128, 8, 1024) if args.small else (16, 512, 1024, 16, 4096)
    torch.manual_seed(0)
    base = Stack(L, d, h, c)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(B, d, generator=g), torch.randint(0, c, (B,), generator=g)
    cuda = torch.cuda.is_available()
    say = Report()
    say.path = say.path and say.path.replace("tracker_vs_cuda", "checkpointing_gpu")
    say(f"torch {torch.__version__}; Stack({L} blocks, d={d}, h={h}, {c} classes), batch {B}, fp32; "
        f"{sum(p.numel() for p in base.parameters()) / 1e6:.1f}M params")
    say(f"CUDA: {torch.cuda.get_device_name() if cuda else 'unavailable -- CPU side only'}")
    head = f"{'plan':<10} {'CUDA peak':>10} {'tracker':>10} {'predicted':>10} {'d tracker vs CUDA':>20}"
    say(head)
    say("-" * len(head))
    for k in [None] + sorted({1, 2, 3, int(L ** 0.5), L // 2, L}):
        t = tracker_peak(base, x, y, k)
        p = predict_peak(plan_for(L, k), d, h, c, B)
        name = "none" if k is None else f"k={k}"
        if cuda:
            try:
                cp = cuda_peak(base, x, y, k)
                say(f"{name:<10} {cp / MiB:>10.2f} {t / MiB:>10.2f} {p / MiB:>10.2f} {diff(t, cp):>20}")
                torch.cuda.empty_cache()
                continue
            except Exception as e:  # keep the other rows
                say(f"{name:<10} CUDA side failed: {type(e).__name__}: {e}")
        say(f"{name:<10} {'-':>10} {t / MiB:>10.2f} {p / MiB:>10.2f}")


if __name__ == "__main__":
    main()
