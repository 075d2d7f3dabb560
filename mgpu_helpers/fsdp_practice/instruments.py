"""Notebook 12 -- the measuring instruments: each rank's live bytes from the allocator (``profiled_peak``: it
sees FSDP2's unsharded parameters, re-grown after ``resize_(0)``, which the tracker misses) and its state
by the tensors themselves (``state_bytes``)."""
from __future__ import annotations

import contextlib
import gc

import torch

from ..memory import nbytes
from ..runtime.alloc_reference import AllocationReference, quiet_fd2
from ..runtime.launch import rank_device


def state_bytes(model, opt) -> dict[str, int]:
    """This rank's parameters, gradients and optimizer state, by the tensors themselves."""
    ps = list(model.parameters())
    return {"parameters": nbytes(ps), "gradients": nbytes(p.grad for p in ps),
            "optimizer_state": nbytes(v for s in opt.state.values() for v in s.values())}


@contextlib.contextmanager
def profiled_peak(baseline: int = 0):
    """``with profiled_peak(b) as r: ...`` then ``r["peak"]``, ``r["end"]``: live bytes with ``memory_allocated``
    semantics, ``baseline`` alive at entry plus every allocation and free inside (on the CPU
    ``AllocationReference``; on CUDA the allocator); ``r["phases"]``: the peak in each ``record_function("## name
    ##")`` range; ``r["compute"]``: per phase, the most held when a matrix multiply starts (CPU only)."""
    r = {"peak": baseline, "end": baseline, "phases": {}, "compute": {}}
    # Collect earlier garbage now (FSDP2 modules sit in reference cycles): freed inside the window, a
    # tensor the profiler saw allocated in an earlier window would count as a free, at gc's whim. And no
    # collection inside the window, so that the same code gives the same bytes on every run.
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        if rank_device().type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            at = torch.cuda.memory_allocated()
            yield r
            torch.cuda.synchronize()
            r["peak"] = baseline + torch.cuda.max_memory_allocated() - at
            r["end"] = baseline + torch.cuda.memory_allocated() - at
            return
        with quiet_fd2(), AllocationReference() as ref:  # C++ warns on fd 2 inside the window too
            yield r
    finally:
        if enabled:
            gc.enable()
    r["peak"], r["end"] = baseline + ref.peak_bytes, baseline + ref.final_bytes
    # the live total when each matrix multiply starts: what is held *while computing*, as opposed to the
    # transient peak of an all-gather's copy-out (which needs the gather buffer and the unit at once)
    mms = [a for op in ("aten::addmm", "aten::mm") for a, _ in ref.ranges.get(op, [])]
    for name, spans in ref.ranges.items():
        if name.startswith("## "):
            for a, b in spans:
                if inside := ref.events_in(a, b):
                    r["phases"][name[3:-3]] = max(r["phases"].get(name[3:-3], 0), baseline + max(inside))
                if at_mm := [ref.live_at(t, inclusive=True) for t in mms if a <= t <= b]:
                    r["compute"][name[3:-3]] = max(r["compute"].get(name[3:-3], 0), baseline + max(at_mm))
