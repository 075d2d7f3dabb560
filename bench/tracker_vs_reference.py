"""MemoryTracker (exact, CPU) against the allocator's own record (AllocationReference) inside gloo ranks.

    python bench/tracker_vs_reference.py            # decoder and conv net; 1, 2 and 4 ranks; ~3 min on 2 cores

One steady training step (after two warm-up steps) per (model x method x world size); every rank's peak by the
tracker, by the reference (less what was live at the tracker's entry beyond the model and optimizer: the
"gap", e.g. DDP's buckets), and by the accounting of tensors alone; plus the largest difference at the
marks (forward, backward, step, end) over all ranks. CPU only: on a GPU the tracker reads the CUDA
allocator (bench/tracker_vs_cuda.py).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from mgpu_helpers.runtime.alloc_reference import AllocationReference
from mgpu_helpers.runtime.launch import run_ranks
from mgpu_helpers.planner.models import Decoder, lm_loss, token_batch
from mgpu_helpers.planner.validation import wrap as validate_wrap
from mgpu_helpers.runtime.tracker import MemoryTracker

PHASES = ("forward", "backward", "step", "end")


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU()),
                                     nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU())])
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x.mean((2, 3)))


def make(kind, rank):
    """(model factory, batch, loss): the batch is made before the reference starts, the model inside it."""
    g = torch.Generator().manual_seed(rank)
    if kind == "decoder":
        return lambda: Decoder(512, 64, 2, 4, 172), token_batch(2, 16, 512, seed=rank), lm_loss
    x, y = torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
    return ConvNet, (x, y), F.cross_entropy


WRAP = {"ddp": "ddp", "zero1+ddp": "zero1", "fsdp2-root": "fsdp2-root", "fsdp2-blocks": "fsdp2"}


def wrap(model, method):
    """(model, the optimizer the tracker watches, what steps), wrapped by ``planner.validation.wrap``."""
    if method == "none":
        return model, torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True), None
    model, opt = validate_wrap(model, WRAP[method])
    return model, getattr(opt, "optim", opt), opt  # ZeroRedundancyOptimizer's step calls its local optimizer


def measure(rank, world, kind, method):
    factory, (x, y), loss_fn = make(kind, rank)
    with AllocationReference() as ref:
        torch.manual_seed(0)
        model, opt, stepper = wrap(factory(), method)

        def step(marks=lambda label: None):
            marks("forward")
            loss = loss_fn(model(x), y)
            marks("backward")
            loss.backward()
            marks("step")
            (stepper or opt).step()
            opt.zero_grad(set_to_none=True)
            marks("end")

        step()
        step()
        ref.mark("entry")
        with MemoryTracker(model, opt, exact=True) as mt:
            def marks(label):
                ref.mark(label)
                if label != "forward":
                    mt.mark(label)
            step(marks)
        ref.mark("exit")
    gap = ref.at("entry") - mt.timeline[0][1]
    first = {}
    for phase, total, _ in mt.timeline:
        first.setdefault(phase, total)
    worst = max(abs(first[ph] - (ref.at(ph) - gap)) for ph in PHASES[1:])
    return {"tracker": mt.peak_bytes, "reference": ref.peak_between("entry", "exit") - gap,
            "accounted": mt.accounted_peak_bytes, "gap": gap, "worst_mark": worst}


def main():
    cases = [(k, "none", 1) for k in ("decoder", "conv")] + [
        (k, m, w) for k in ("decoder", "conv") for m in ("ddp", "zero1+ddp", "fsdp2-root", "fsdp2-blocks")
        for w in (2, 4)]
    print(f"{'model':<8}{'method':<14}{'world':>6}{'tracker peak':>14}{'reference':>12}{'diff':>6}"
          f"{'tensors only':>14}{'gap at entry':>14}{'|diff| marks':>14}")
    for kind, method, world in cases:
        rows = run_ranks(measure, world, kind, method, backend="gloo", timeout=600)
        r0 = rows[0]
        worst = max(max(abs(r["tracker"] - r["reference"]), r["worst_mark"]) for r in rows)
        print(f"{kind:<8}{method:<14}{world:>6}{r0['tracker']:>14}{r0['reference']:>12}"
              f"{r0['tracker'] - r0['reference']:>6}{r0['accounted']:>14}{r0['gap']:>14}{worst:>14}")


if __name__ == "__main__":
    main()
