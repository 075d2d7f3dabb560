"""Notebook 12 -- the measuring instruments: each rank's live bytes from ``torch.profiler`` (every allocation
of the CPU allocator; on CUDA the allocator's own counters) and each collective from the dispatcher.

``profiled_peak`` has ``memory_allocated`` semantics: bytes alive at entry (given) plus every allocation and
free inside, in time order, with the peak per ``record_function("## phase ##")`` range. It sees what a
tracker that learns storages when they are made misses: FSDP2's unsharded parameters, freed with
``resize_(0)`` after use and re-grown at the next all-gather (issue 18; FACTS.md: the profiler matched the
tracker and the planner to 8 bytes where both see everything).
"""
from __future__ import annotations

import contextlib
import gc

import torch

from ..runtime.launch import rank_device


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors: this rank's local shard)."""
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            t = t.to_local() if hasattr(t, "to_local") else t
            seen[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
    return sum(seen.values())


def state_bytes(model, opt=None) -> dict[str, int]:
    """This rank's parameters, gradients and optimizer state, by the tensors themselves."""
    ps = list(model.parameters())
    return {"parameters": storage_bytes(ps), "gradients": storage_bytes(p.grad for p in ps),
            "optimizer_state": storage_bytes(v for s in (opt.state.values() if opt else []) for v in s.values())}


@contextlib.contextmanager
def _quiet_stderr():
    """Some builds' profiler writes ``USDT: ... profiler_start`` / ``profiler_stop`` and a once-per-process
    "Memory block of unknown size was allocated before the profiling started" from C++ straight to file
    descriptor 2 (no Python warning to filter), which nbval would compare. Silence fd 2 while profiling."""
    import os
    import sys
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


@contextlib.contextmanager
def profiled_peak(baseline: int = 0):
    """``with profiled_peak(b) as r: ...`` then ``r["peak"]``, ``r["end"]``: live bytes as
    ``memory_allocated`` would say, counting ``baseline`` bytes alive at entry plus every allocation and
    free inside (the profiler's ``[memory]`` events in time order; on CUDA the allocator itself), and
    ``r["phases"]``: the peak inside each ``record_function("## name ##")`` range, ``r["compute"]``: per
    phase, the most held when a matrix multiply starts (CPU only)."""
    r = {"peak": baseline, "end": baseline, "phases": {}, "compute": {}}
    # Collect earlier garbage now (FSDP2 modules sit in reference cycles): freed inside the window, a
    # tensor the profiler saw allocated in an earlier window would count as a free, at gc's whim. And no
    # collection inside the window, so that the same code gives the same bytes on every run.
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        with _measured(r, baseline):
            yield r
    finally:
        if enabled:
            gc.enable()


@contextlib.contextmanager
def _measured(r, baseline):
    dev = rank_device()
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        at = torch.cuda.memory_allocated()
        yield r
        torch.cuda.synchronize()
        r["peak"] = baseline + torch.cuda.max_memory_allocated() - at
        r["end"] = baseline + torch.cuda.memory_allocated() - at
        return
    from torch.profiler import ProfilerActivity, profile
    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield r
    events = list(prof.profiler.kineto_results.events())
    ev = sorted((e.start_ns(), e.nbytes()) for e in events
                if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    spans = [(e.name()[3:-3], e.start_ns(), e.end_ns()) for e in events if e.name().startswith("## ")]
    # the live total when each matrix multiply starts: what is held *while computing*, as opposed to the
    # transient peak of an all-gather's copy-out (which needs the gather buffer and the unit at once)
    mms = sorted(e.start_ns() for e in events if e.name() in ("aten::addmm", "aten::mm"))
    cur, peak, i = baseline, baseline, 0
    for t, n in ev:
        while i < len(mms) and mms[i] < t:
            for name, a, b in spans:
                if a <= mms[i] <= b:
                    r["compute"][name] = max(r["compute"].get(name, 0), cur)
            i += 1
        cur += n
        peak = max(peak, cur)
        for name, a, b in spans:  # a phase's peak: the highest live total inside its record_function
            if a <= t <= b:
                r["phases"][name] = max(r["phases"].get(name, 0), cur)
    r["peak"], r["end"] = peak, cur


__all__ = ["storage_bytes", "state_bytes", "profiled_peak"]
