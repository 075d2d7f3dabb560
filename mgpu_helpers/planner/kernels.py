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
profiler already on in this process, ``MGPU_PLAN_PROBE=0``, an op too large to run here), is right on the ISA
it was fitted on only: ``kernel_rules``' lines, fitted on AVX2.

A kernel run twice: the first call plans oneDNN's primitive (and caches it), the second is what every
later step does; the figure is the second's.

**Threads.** oneDNN's bf16 matmul scratch is per thread: on the H200 host's Xeon (AMX) an addmm of
256x64 by 64x256 borrowed 13,312 B at 1 thread and 207,232 B at 16, linearly; with
``ONEDNN_MAX_CPU_ISA=AVX2``, nothing (bench/probe_threads.py). So the probe runs the kernel with the
thread count the planned step runs with: :func:`step_threads` sets it (``planner.plan`` does, for ranks
that ``run_ranks`` starts: its default share of the cores per rank); by default, this process's.

**Worker threads.** Most kernels allocate on the calling thread only (oneDNN's matmul sizes one scratchpad
for all its threads there). Flash attention's CPU kernels allocate inside their parallel loop: each
thread's row sums and, on AVX-512 bf16 and AMX, a oneDNN gemm scratchpad per gemm call -- itself sized
for every thread, so the op's scratch grows as the square of the threads (bf16 backward, 4x4 heads of 32x16:
38,148 B at 1 thread, 69,384 at 2, up to 1,960,000 at 16). How many of those blocks are live at once
depends on how the threads' gemms overlap: with as many threads as cores nearly all of them (2 threads on
2 cores: 69,384 B in 29 calls of 30); with 16 threads on 2 cores, 0.4-0.9 MB. The probe sees the workers'
blocks in c10's log of every thread (``runtime.every_thread``) and plans such an op with every thread holding
at once the most one thread holds (:func:`every_thread_bound`): the planner must not be under, and with a
core per thread that is what the step takes.
"""
from __future__ import annotations

import contextlib
import functools
import os
from collections import Counter

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

from .kernel_rules import (_CONVS, chunk_cat_scratch, conv_scratch, derived_scratch, is_chunk_cat,  # noqa: F401
                           is_reduce_scatter, reduce_scatter_scratch)


aten = torch.ops.aten
# Which ops borrow memory no returned tensor owns is not a list one can keep: oneDNN's convolutions and bf16
# matmuls do by ISA, and ATen's own kernels do too (batch norm's backward took a 1 MiB temporary beside its
# 1 MiB input gradient: the peak of a conv net's step once oneDNN's scratch shrank under SSE4.1). So every
# aten op is probed, once per signature, except those that cannot borrow or must not run here: views and
# aliases (no kernel), storage surgery (``resize_``/``set_``: the trace accounts for it), and anything
# outside aten (collectives above all) but FSDP2's ``_chunk_cat``.
_SKIPPED = {"resize_", "set_", "_local_scalar_dense", "record_stream", "copy_", "detach", "alias", "lift_fresh",
            "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "zeros", "zeros_like",
            "ones", "ones_like", "full", "full_like", "scalar_tensor", "_to_copy", "clone", "t", "view"}

_CACHE: dict = {}   # signature -> bytes; per process (the ISA and the build do not change under it)
_OWN: dict = {}  # signature -> what the calling thread alone held, for kernels that allocate on workers too
# how the step being planned runs, each set for a while by a context manager below
_THREADS: list = [None]  # its thread count; None: this process's
_CALLING_THREAD_ONLY = [False]  # plan worker-thread kernels with the calling thread's share only
_FAKE_COLLECTIVES = [False]  # its collectives are a fake process group's


@contextlib.contextmanager
def _setting(cell: list, value):
    old, cell[0] = cell[0], value
    try:
        yield
    finally:
        cell[0] = old


def step_threads(n: int | None):
    """Probe kernels as a step running on ``n`` threads takes them (None: this process's thread count)."""
    return _setting(_THREADS, n)


def step_thread_count() -> int:
    """The threads the step being planned runs its CPU kernels on (:func:`step_threads`, else this process's)."""
    return _THREADS[0] or torch.get_num_threads()


@functools.lru_cache(maxsize=None)
def probed(func) -> bool:
    if is_chunk_cat(func) or is_reduce_scatter(func):
        return True
    schema = getattr(func, "_schema", None)
    if schema is None or not schema.name.startswith("aten::") or getattr(func, "is_view", False):
        return False
    return schema.name[len("aten::"):] not in _SKIPPED


class _Spec:
    """What the probe keeps of a tensor argument: enough to make a real one like it later."""
    __slots__ = ("shape", "stride", "dtype", "requires_grad")

    def __init__(self, t: torch.Tensor):
        self.shape, self.stride, self.dtype, self.requires_grad = tuple(t.shape), tuple(t.stride()), t.dtype, \
            t.requires_grad

    def key(self):
        return ("T", self.shape, self.stride, self.dtype, self.requires_grad)


def _plain(t) -> bool:
    # a FakeTensor or a real one; a DTensor or another subclass is not probed (its shape is not its storage)
    return isinstance(t, torch.Tensor) and (type(t) is torch.Tensor or type(t).__name__ == "FakeTensor")


def _signature(func, specs):
    leaves, tree = tree_flatten(specs)
    key = tuple(x.key() if isinstance(x, _Spec) else
                (x if isinstance(x, (int, float, bool, str, type(None), torch.dtype)) else repr(x)) for x in leaves)
    return (str(func), str(tree), key, step_thread_count(), torch.is_grad_enabled())


def _real(t: _Spec) -> torch.Tensor:
    """A CPU tensor with the spec's shape, strides, dtype and ``requires_grad``, holding random values
    (kernels pick no path by value, but NaNs from uninitialised memory would slow some). ``requires_grad``
    matters: oneDNN's forward convolution of an input that requires grad borrowed 2 MiB where the same one
    without took 1 MiB (3 in-channels, 8x32x32, AVX2)."""
    # one storage as large as the strides reach (expanded tensors have stride 0: no per-element fill)
    extent = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride) if n > 0) if all(t.shape) else 0
    floating = t.dtype.is_floating_point or t.dtype.is_complex
    base = torch.randn(extent, dtype=t.dtype) if floating else torch.zeros(extent, dtype=t.dtype)
    out = base.as_strided(t.shape, t.stride)
    return out.detach().requires_grad_(True) if t.requires_grad and floating else out


_PENDING: dict = {}  # signature -> (func, specs, threads, grad mode): met by a trace, not yet measured
# Ops whose tensors hold more than this are not run here: a 7B model planned on a laptop would run its
# matmuls for real (notebook 11's 1B trace timed out). They get the fallback lines; what is per thread
# (oneDNN's bf16 matmul scratch, ~70 KiB a thread on AMX) is small beside such a step.
PROBE_BYTES = 16 * 2**20


def measured_scratch(func, args, kwargs):
    """Bytes the real CPU kernel of ``func`` holds inside the op beyond what it leaves allocated, for these
    arguments (only their metadata is used); None while it waits for :func:`measure_pending`, and for ops
    too large to run here (:data:`PROBE_BYTES`) or on tensor subclasses (DTensor): the fallback's."""
    leaves = tree_flatten((args, kwargs or {}))[0]
    if any(isinstance(x, torch.Tensor) and not _plain(x) for x in leaves):
        return None
    if sum(x.numel() * x.element_size() for x in leaves if isinstance(x, torch.Tensor)) > PROBE_BYTES:
        return None
    specs = tree_map(lambda x: _Spec(x) if isinstance(x, torch.Tensor) else x, (args, kwargs or {}))
    sig = _signature(func, specs)
    if sig not in _CACHE:
        _PENDING.setdefault(sig, (func, specs, step_thread_count(), torch.is_grad_enabled()))
        return None
    return _OWN.get(sig, _CACHE[sig]) if _CALLING_THREAD_ONLY[0] else _CACHE[sig]


def measure_pending() -> int:
    """Run every op signature a trace met and this process has not measured yet, each twice (the first call
    plans and caches oneDNN's primitive; the second is what every later step does), in one profiler session
    (starting one costs ~0.1 s: one per op would dominate a plan). Returns how many were measured."""
    from torch.profiler import record_function

    from ..runtime.alloc_reference import AllocationReference
    items, failed = list(_PENDING.items()), set()
    _PENDING.clear()
    if not items:
        return 0
    with _disable_current_modes(), AllocationReference() as ref:
        log = ref.every_thread  # c10's line for each block of each thread: the workers' too
        for i, (sig, (func, specs, threads, grad)) in enumerate(items):
            # as the trace called it: same grad mode, same threads, inputs that require grad where its did
            with torch.set_grad_enabled(grad), _set_threads(threads):
                try:
                    a, k = tree_map(lambda x: _real(x) if isinstance(x, _Spec) else x, specs)
                    func(*a, **k)
                    log.mark(f"in{i}")
                    with record_function(f"mgpu_probe{i}"):
                        out = func(*a, **k)
                    log.mark(f"out{i}")
                    with record_function(f"mgpu_probe_after{i}"):
                        pass
                    del out, a, k
                except Exception:  # noqa: BLE001 - a kernel that will not run on made-up inputs: the fallback
                    failed.add(sig)
    for i, (sig, (func, specs, threads, _)) in enumerate(items):
        if sig in failed:
            _CACHE[sig] = derived_scratch(func, *specs)
            continue
        # the most held inside the op, less what it left allocated (its outputs): by every thread, as it happened
        seen = max(0, ref.peak_in(f"mgpu_probe{i}") - ref.at(f"mgpu_probe_after{i}"))
        own = ref.own_events(f"mgpu_probe{i}")
        bound = every_thread_bound(own, log.between(f"in{i}", f"out{i}"), threads)
        _CACHE[sig] = max(seen, bound)
        if bound:
            _OWN[sig] = _own_scratch(own)
    return len(items)


def _own_scratch(own: list) -> int:
    live = peak = 0
    for n in own:
        live += n
        peak = max(peak, live)
    return peak - live


def fake_collectives():
    """Plan a step whose collectives are a fake process group's (a rank measured in one process, as notebook
    12's ``fake_world``): no gloo, so no copy of a reduce-scatter's input."""
    return _setting(_FAKE_COLLECTIVES, True)


def calling_thread_only():
    """Plan kernels that allocate on worker threads with the calling thread's share only (what the profiler's
    own events show), not every thread at its most: for tests and benches that set a plan beside a step
    whose threads outnumber the cores, where the workers seldom all hold their scratch at once."""
    return _setting(_CALLING_THREAD_ONLY, True)


def every_thread_bound(own: list, every: list, threads: int) -> int:
    """Scratch of a kernel that allocates on its worker threads too, with every thread holding the most it
    holds at once; 0 for a kernel whose every allocation is the calling thread's (the profiler saw it all).

    ``own``: the calling thread's allocations and frees (signed bytes, in order; the profiler's), ``every``:
    every thread's (``EveryThreadAllocations``). The workers' blocks are the sizes ``every`` has beyond
    ``own``. The calling thread runs its share of the same parallel loop, so what one worker holds at once
    is read off it: the most the calling thread held of blocks of the sizes workers also made (flash attention's
    backward: its row sums and one oneDNN gemm scratchpad; not the per-thread buffers it allocated for all
    threads before the loop), and never less than the largest worker block. The real peak of one call lies
    anywhere between the calling thread's own and this bound, by how the threads' gemms happen to overlap;
    a plan must not be under it."""
    workers = Counter(n for n, _ in every if n > 0) - Counter(n for n in own if n > 0)
    if not workers or threads < 2:
        return 0
    local = local_peak = 0
    for n in own:
        if abs(n) in workers:
            local += n
            local_peak = max(local_peak, local)
    return _own_scratch(own) + (threads - 1) * max(local_peak, max(workers))


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


def probe(func, args, kwargs=None) -> int:
    """:func:`measured_scratch` now, for one op (tests, benches); the fallback if it cannot be measured."""
    if measured_scratch(func, args, kwargs) is None:
        measure_pending()
    got = measured_scratch(func, args, kwargs)
    return derived_scratch(func, args, kwargs) if got is None else got


def can_probe() -> bool:
    from ..runtime.alloc_reference import profiler_running
    return os.environ.get("MGPU_PLAN_PROBE", "1") != "0" and not profiler_running()


def cpu_kernel_scratch(func, args, kwargs) -> int:
    """What the planner adds as a transient inside ``func`` on the CPU: measured when it can be. A trace that
    meets a signature not measured yet gets the fallback and leaves it pending: ``planner.trace.trace_step``
    then calls :func:`measure_pending` and traces again (the naive way, one profiler session per op inside
    the trace, cost 4.1 s of a 4.4 s plan of a small conv net: 31 sessions)."""
    if is_reduce_scatter(func):  # a collective: not run here; its rule is gloo's, whatever the ISA
        return reduce_scatter_scratch(func, args, kwargs) if not _FAKE_COLLECTIVES[0] else 0
    if can_probe():
        measured = measured_scratch(func, args, kwargs)
        if measured is not None:
            return measured
    return derived_scratch(func, args, kwargs)
