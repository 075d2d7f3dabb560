"""What a CPU kernel takes and gives back inside one op, beside its inputs and outputs: measured here.

A fake-tensor trace sees the tensors an op returns, never the memory its kernel borrows while it runs:
oneDNN's convolution scratch, the weight reorders of its bf16 matmuls on AVX-512-bf16 and AMX (none on
AVX2), the copy ``_chunk_cat`` makes converting FSDP2's bf16 gradients, the CPU flash attention's buffers.
How much depends on the CPU's instruction set, oneDNN's choice of kernel and the torch build, so the
planner does not carry a table from one CPU (an earlier version did: fitted on AVX2, it was 7-11% under on
AVX-512). It measures: the first time the trace meets an op of :data:`PROBED` with a given signature (shapes,
strides, dtypes, the non-tensor arguments), it runs the real op once on random CPU tensors of those shapes
under the profiler's allocation record (``AllocationReference``) and keeps the most the allocator held
inside the op beyond what the op left allocated. The same signature later costs a dict lookup, so a model
of N identical blocks pays for one block; the whole probe costs about one real step's kernels, once.

The naive alternative, a line fitted per op (kept as :func:`derived_scratch` for when no probe can run: a
profiler already on in this process, or ``MGPU_PLAN_PROBE=0``), is right on the ISA it was fitted on only.

A kernel run twice: the first call plans oneDNN's primitive (and caches it), the second is what every
later step does; the figure is the second's.

**Threads.** oneDNN's bf16 matmul scratch is per thread: on the H200 host's Xeon (AMX) an addmm of
256x64 by 64x256 borrowed 13,312 B at 1 thread and 207,232 B at 16, linearly; with
``ONEDNN_MAX_CPU_ISA=AVX2``, nothing (bench/probe_threads.py). So the probe runs the kernel with the
thread count the planned step runs with: :func:`step_threads` sets it (``planner.plan`` does, for ranks
that ``run_ranks`` starts: its default share of the cores per rank); by default, this process's.
"""
from __future__ import annotations

import contextlib
import os

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

from .planner_layouts import chunk_cat_scratch, conv_scratch, is_chunk_cat

aten = torch.ops.aten
# The ops whose CPU kernels borrow memory no returned tensor owns (or may, on some ISA). Elementwise ops,
# reductions and views allocate only what they return on every ISA.
PROBED = {aten.convolution.default, aten.convolution_backward.default,
          aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
          aten._scaled_dot_product_flash_attention_for_cpu.default,
          aten._scaled_dot_product_flash_attention_for_cpu_backward.default}

_CACHE: dict = {}   # signature -> bytes; per process (the ISA and the build do not change under it)
_THREADS: list = [None]  # the planned step's thread count; None: this process's


@contextlib.contextmanager
def step_threads(n: int | None):
    """Probe kernels as a step running on ``n`` threads takes them (None: this process's thread count)."""
    old, _THREADS[0] = _THREADS[0], n
    try:
        yield
    finally:
        _THREADS[0] = old


def _threads() -> int:
    return _THREADS[0] or torch.get_num_threads()


def probed(func) -> bool:
    return func in PROBED or is_chunk_cat(func)


def _signature(func, args, kwargs):
    def key(x):
        if isinstance(x, torch.Tensor):
            return ("T", tuple(x.shape), tuple(x.stride()), x.dtype, x.requires_grad)
        return x if isinstance(x, (int, float, bool, str, type(None), torch.dtype)) else repr(x)
    leaves, spec = tree_flatten((args, kwargs))
    return (str(func), str(spec), tuple(key(x) for x in leaves), _threads())


def _real(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor with ``t``'s shape, strides and dtype, holding random values (kernels pick no path
    by value, but NaNs from uninitialised memory would slow some)."""
    out = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="cpu")
    if out.is_floating_point():
        out.normal_()
    else:
        out.zero_()
    return out


def measured_scratch(func, args, kwargs) -> int:
    """Bytes the real CPU kernel of ``func`` holds inside the op beyond what it leaves allocated, for these
    arguments (fake or real tensors: only their metadata is used)."""
    from .runtime.alloc_reference import AllocationReference
    sig = _signature(func, args, kwargs or {})
    if sig not in _CACHE:
        with _disable_current_modes(), torch.no_grad(), _set_threads(_threads()):
            real_args, real_kwargs = tree_map(lambda x: _real(x) if isinstance(x, torch.Tensor) else x,
                                              (args, kwargs or {}))
            func(*real_args, **real_kwargs)  # the first call plans (and caches) oneDNN's primitive
            with AllocationReference() as ref:
                out = func(*real_args, **real_kwargs)
            del out
        _CACHE[sig] = max(0, ref.peak_bytes - ref.final_bytes)
    return _CACHE[sig]


@contextlib.contextmanager
def _set_threads(n: int):
    before = torch.get_num_threads()
    if n != before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if n != before:
            torch.set_num_threads(before)


def derived_scratch(func, args, kwargs) -> int:
    """The fallback: lines fitted on AVX2 (torch 2.13) for the ops that borrow memory there."""
    if is_chunk_cat(func):
        return chunk_cat_scratch(func, args, kwargs)
    if func in (aten.convolution.default, aten.convolution_backward.default):
        return conv_scratch(func, args)
    return 0


def can_probe() -> bool:
    from .runtime.alloc_reference import profiler_running
    return os.environ.get("MGPU_PLAN_PROBE", "1") != "0" and not profiler_running()


def cpu_kernel_scratch(func, args, kwargs) -> int:
    """What the planner adds as a transient inside ``func`` on the CPU: measured when it can be."""
    return measured_scratch(func, args, kwargs) if can_probe() else derived_scratch(func, args, kwargs)
