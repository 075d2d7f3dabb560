"""MemoryTracker against the allocator itself (AllocationReference: the profiler's running total of the c10
CPU allocator) inside gloo ranks: DDP, ZeroRedundancyOptimizer + DDP, FSDP2 root-only and per block + root,
at 2 and 4 ranks, on a small Llama-shaped decoder; a conv net with BatchNorm at one rank (oneDNN's scratch).

The reference starts before the model is built; the tracker is entered for one steady step after two
warm-up steps (Adam's state made, DDP's buckets rebuilt in gradient order). The tracker has
``memory_allocated`` semantics from its entry: what was live at entry beyond the model and optimizer is not
its to count. That difference (``gap``) is asserted too: DDP's buckets -- C++ tensors holding a copy of
every gradient (``gradient_as_bucket_view=False``, the default) -- and, for FSDP2, the DeviceMesh's
tensor of ranks (4 bytes per rank).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from mgpu_helpers.runtime.alloc_reference import AllocationReference
from mgpu_helpers.runtime.launch import run_ranks
from mgpu_helpers.planner.models import Decoder, lm_loss, token_batch
from mgpu_helpers.planner.validation import wrap
from mgpu_helpers.runtime.tracker import MemoryTracker

METHODS = ("ddp", "zero1+ddp", "fsdp2-root", "fsdp2-blocks")
WRAP = {"ddp": "ddp", "zero1+ddp": "zero1", "fsdp2-root": "fsdp2-root", "fsdp2-blocks": "fsdp2"}  # its names
PHASES = ("forward", "backward", "step", "end")


def build(method):
    """(model, the optimizer the tracker watches, what steps): ``planner.validation.wrap``, the wrapping the
    planner's own validation runs; ZeroRedundancyOptimizer's step calls its local optimizer, so that is watched."""
    torch.manual_seed(0)
    model, opt = wrap(Decoder(512, 64, 2, 4, 172), WRAP[method])
    return model, getattr(opt, "optim", opt), opt


def step(model, opt, stepper, x, y, marks=lambda label: None):
    marks("forward")
    loss = lm_loss(model(x), y)
    marks("backward")
    loss.backward()
    marks("step")
    (stepper or opt).step()
    opt.zero_grad(set_to_none=True)
    marks("end")


def measure(rank, world, method):
    x, y = token_batch(2, 16, 512, seed=rank)  # made before the reference: counted by neither
    with AllocationReference() as ref:
        model, opt, stepper = build(method)
        for _ in range(2):
            step(model, opt, stepper, x, y)
        ref.mark("entry")
        with MemoryTracker(model, opt) as mt:
            def marks(label):
                ref.mark(label)
                if label != "forward":  # the tracker's first phase is "forward" from its entry
                    mt.mark(label)
            step(model, opt, stepper, x, y, marks)
        ref.mark("exit")
    return compare(ref, mt) | {"grad_bytes": sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                                                 for p in model.parameters()) * 4,
                               "full_grad_bytes": sum(p.numel() for p in model.parameters()) * 4}


def compare(ref, mt):
    """The tracker's figures and the reference's at the same points (the reference less the gap)."""
    gap = ref.at("entry") - mt.timeline[0][1]
    first = {}
    for phase, total, _ in mt.timeline:
        first.setdefault(phase, total)
    bounds = list(PHASES[1:]) + ["exit"]
    return {"gap": gap, "peak": (mt.peak_bytes, ref.peak_between("entry", "exit") - gap),
            "marks": {ph: (first[ph], ref.at(ph) - gap) for ph in PHASES[1:]},
            "phase_peaks": {ph: (mt.phase_peaks()[ph], ref.peak_between(ph, nxt) - gap)
                            for ph, nxt in zip(PHASES, bounds)},
            "current": (mt.current_bytes, ref.at("exit") - gap),
            "other_at_peak": mt.peak_breakdown()["other"], "accounted_peak": mt.accounted_peak_bytes}


def assert_matches(r, label):
    pairs = {"peak": r["peak"], "current": r["current"], **{f"at {k}": v for k, v in r["marks"].items()},
             **{f"peak of {k}": v for k, v in r["phase_peaks"].items()}}
    wrong = {k: v for k, v in pairs.items() if v[0] != v[1]}
    assert not wrong, f"{label}: tracker != reference (tracker, reference): {wrong}"


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("method", METHODS)
def test_tracker_equals_allocator_on_ranks(method, world):
    results = run_ranks(measure, world, method, backend="gloo", timeout=300)
    for rank, r in enumerate(results):
        assert_matches(r, f"{method} rank {rank}/{world}")
        # Live at entry beyond the model and optimizer: DDP's buckets (one copy of every gradient) or FSDP2's
        # DeviceMesh (its ranks as an int32 tensor); plus, in some runs, a buffer of the warm-up's last
        # collective that gloo's worker thread has not let go of yet (1.6 KB seen; notebook 04 explains; in the
        # fresh-clone CI runs, on one FSDP2 root-only rank of 4, the whole unsharded gradient, 658,688 B, that the
        # warm-up's last reduce-scatter read): live before entry, so not the step's.
        expected = r["grad_bytes"] if "ddp" in method else 4 * world
        assert expected <= r["gap"] <= expected + r["full_grad_bytes"] + 4096, (method, rank, r["gap"], expected)


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                  nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))

    def forward(self, x):
        return self.body(x)


def test_tracker_equals_allocator_conv_net_with_batchnorm():
    torch.manual_seed(0)
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    with AllocationReference() as ref:
        model = ConvNet()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True)
        F.cross_entropy(model(x), y).backward()  # warm-up: Adam's state
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref.mark("entry")
        with MemoryTracker(model, opt, exact=True) as mt:  # one process: exact only when asked
            def marks(label):
                ref.mark(label)
                if label != "forward":
                    mt.mark(label)
            marks("forward")
            loss = F.cross_entropy(model(x), y)
            marks("backward")
            loss.backward()
            marks("step")
            opt.step()
            opt.zero_grad(set_to_none=True)
            marks("end")
        ref.mark("exit")
    r = compare(ref, mt)
    assert r["gap"] == 0
    assert_matches(r, "conv net")
    # oneDNN's convolutions take scratch that no tensor owns: the accounting of tensors alone is low
    assert r["peak"][0] > r["accounted_peak"] and r["other_at_peak"] > 0
