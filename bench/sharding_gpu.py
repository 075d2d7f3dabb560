"""Notebook 08 on one GPU: per-rank model-state accounting at world size 1, three ways.

For each method (the unsharded replica, ZeRO-1 ZeroRedundancyOptimizer, ZeRO-2 ``Zero2``, FSDP2 per block
and root-only), one rank (NCCL when a GPU is visible, else gloo/CPU) takes a warm-up step and a measured
step; printed side by side: ``torch.cuda.max_memory_allocated()`` of the measured step, the tracker's peak
(on CUDA it reads the allocator) and its accounted peak (the CPU-style live-storage count), the model state
held after the step by category, and the formula (fp32 Adam, ZeRO stage of the method, N = 1)::

    python bench/sharding_gpu.py            # from the repository root (torch only; no Jupyter)
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gc  # noqa: E402

import torch  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from mgpu_helpers.runtime.launch import rank_device, run_ranks  # noqa: E402
from mgpu_helpers.memory import make_batch  # noqa: E402
from mgpu_helpers.sharding.fsdp import STAGE, build, formula  # noqa: E402
from mgpu_helpers.checks.references import reference_reduce_scatter  # noqa: E402
from mgpu_helpers.runtime.tracker import MemoryTracker  # noqa: E402

WIDTHS = [1024, 4096, 4096, 4096, 4096, 1000]  # 54.6M parameters: 874 MB of fp32 Adam model state
PER_RANK = 64


def one_rank(rank, world_size):
    dev, out = rank_device(), {"device": str(rank_device())}
    if dev.type == "cuda":
        out["device"] += f" ({torch.cuda.get_device_name(dev)})"
    for method in STAGE:
        model, opt, step = build(method, WIDTHS, reduce_scatter_fn=reference_reduce_scatter)
        x, y = make_batch(PER_RANK, WIDTHS[0], WIDTHS[-1], 1, device=dev)

        def train_step():
            model.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            step()

        train_step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        with MemoryTracker(model, opt) as mt:
            train_step()
        cuda_peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
        n = sum(p.numel() for p in model.parameters())
        out[method] = {"cuda_max_allocated": cuda_peak, "cuda_at_entry": base if dev.type == "cuda" else None,
                       "tracker_peak": mt.peak_bytes, "accounted_peak": mt.accounted_peak_bytes,
                       "state": {c: mt.breakdown()[c] for c in ("parameters", "gradients", "optimizer_state")},
                       "formula": formula(n, method, world_size), "n": n}
        # train_step's closure holds the model: without dropping it, each method's figures would include
        # the previous method's model and optimizer state ("at entry" grew by ~940 MB per method).
        del model, opt, step, train_step, mt, x, y
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return out


if __name__ == "__main__":
    res = run_ranks(one_rank, 1, timeout=600)[0]
    print(f"device: {res.pop('device')}; widths {WIDTHS}, batch {PER_RANK}, fp32 Adam (foreach), world size 1")
    MB = 1e6
    for method, r in res.items():
        s, f = r["state"], r["formula"]
        cuda = "n/a" if r["cuda_max_allocated"] is None else f"{r['cuda_max_allocated'] / MB:.1f}"
        print(f"{method:<34} n={r['n']}  max_memory_allocated {cuda} MB (at entry "
              f"{(r['cuda_at_entry'] or 0) / MB:.1f}); tracker peak {r['tracker_peak'] / MB:.1f} MB, accounted "
              f"{r['accounted_peak'] / MB:.1f} MB ({r['accounted_peak'] / r['tracker_peak']:.4f}x)")
        print(f"{'':<34} held after step (tracker) vs formula, MB: " + ", ".join(
            f"{c} {s[c] / MB:.2f}/{f[c] / MB:.2f}" for c in s))
