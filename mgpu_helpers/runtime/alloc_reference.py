"""What the CPU allocator saw: the profiler's allocation events, summed in time order.

    with AllocationReference() as ref:           # start it before the model is built
        model = build(); opt = make_opt(model)
        ref.mark("step0")                        # or any torch.profiler.record_function range
        loss = model(x).sum(); loss.backward(); opt.step()
    ref.at("step0"), ref.peak_bytes, ref.peak_in("step0"), ref.final_bytes

The course's CPU figures are the accounting of tensors (``MemoryTracker``, the planner): the same on every
CPU. The allocator holds more than the tensors: what C++ allocates behind no tensor of Python's (oneDNN's
scratch inside a convolution or a bf16 matmul, by instruction set and thread count; gloo's copy of a
reduce-scatter's input). This reference shows that difference where a lesson needs it (notebook 11's ranks).
``torch.profiler.profile(activities=[CPU], profile_memory=True)`` records each allocation and free of
c10's CPU allocator made on the thread that runs it, with its size; their running sum from the entry on is
``memory_allocated``'s figure without its 512-byte rounding. It misses what other threads allocate (a
kernel's worker threads, gloo's) and frees of blocks made before the entry: a lower bound of what the
allocator held, and a figure that depends on the machine. On a GPU, ``torch.cuda``'s counters are the
allocator's own (notebook 02).

Figures exist once the ``with`` has exited (the profiler hands its events over when it stops). Marks are
``record_function`` ranges: ``at(label)`` is the live bytes when the range first opened, ``peak_in(label)``
the highest while it was open. Nothing is changed in torch's state but for the profiler's lifetime.
"""
from __future__ import annotations

import bisect
import contextlib
import os

import torch
from torch.profiler import ProfilerActivity, profile, record_function

__all__ = ["AllocationReference"]


@contextlib.contextmanager
def _quiet_fd2():
    # Kineto prints "USDT: ... profiler_start/stop" on file descriptor 2 (not sys.stderr): in a notebook that
    # lands in the cell's output. Silence fd 2 for the start and the stop only.
    try:
        saved = os.dup(2)
    except OSError:  # no fd 2 (an embedded interpreter)
        yield
        return
    try:
        with open(os.devnull, "wb") as sink:
            os.dup2(sink.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _walk(events):
    for e in events:
        yield e
        yield from _walk(e.children)


class AllocationReference:
    """Live bytes of the CPU allocator from entry on, as the profiler's ``[memory]`` events record them.

    After the ``with``: ``peak_bytes``, ``final_bytes``, ``at(label)``, ``peak_in(label)``, ``marks`` and
    ``timeline`` ((t_ns, live bytes) after each event)."""

    def __init__(self):
        self._prof, self._done, self._times, self.timeline, self._ranges = None, False, [], [], {}

    def __enter__(self):
        if torch._C._autograd._profiler_enabled():
            raise RuntimeError("AllocationReference: a torch profiler is already running in this process; "
                               "only one can record at a time -- exit it first")
        # acc_events: one recording cycle anyway; without it torch warns once per process on stderr
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True, acc_events=True)
        with _quiet_fd2():
            self._prof.__enter__()
        return self

    def __exit__(self, *exc):
        with _quiet_fd2():
            self._prof.__exit__(*exc)
        allocs = []
        for e in _walk(self._prof.profiler.kineto_results.experimental_event_tree()):
            f = e.extra_fields
            if type(f).__name__ == "_ExtraFields_Allocation":
                if f.device.type == "cpu":
                    allocs.append((e.start_time_ns, f.alloc_size))
            else:
                self._ranges.setdefault(e.name, []).append((e.start_time_ns, e.end_time_ns))
        for spans in self._ranges.values():
            spans.sort()
        live = 0
        for t, n in sorted(allocs):
            live += n
            self.timeline.append((t, live))
        self._times = [t for t, _ in self.timeline]
        self._done = True
        return False

    def mark(self, label: str) -> None:
        """A zero-length range named ``label``: ``at(label)`` is the live bytes at this instant."""
        with record_function(label):
            pass

    def _range(self, label, occurrence):
        if not self._done:
            raise RuntimeError("AllocationReference: figures exist once the `with` has exited")
        if label not in self._ranges:
            raise KeyError(f"AllocationReference: no mark or range named {label!r}")
        return self._ranges[label][occurrence]

    def _live_before(self, t_ns):
        i = bisect.bisect_left(self._times, t_ns)
        return self.timeline[i - 1][1] if i else 0

    @property
    def peak_bytes(self) -> int:
        return max([0] + [b for _, b in self.timeline])

    @property
    def final_bytes(self) -> int:
        return self.timeline[-1][1] if self.timeline else 0

    @property
    def marks(self) -> list:
        return sorted(self._ranges, key=lambda k: self._ranges[k][0][0])

    def at(self, label: str, occurrence: int = 0) -> int:
        """Live bytes when the ``occurrence``-th range named ``label`` opened."""
        return self._live_before(self._range(label, occurrence)[0])

    def peak_in(self, label: str, occurrence: int = 0) -> int:
        """Highest live bytes while the ``occurrence``-th range named ``label`` was open (its entry included)."""
        start, end = self._range(label, occurrence)
        i, j = bisect.bisect_left(self._times, start), bisect.bisect_right(self._times, end)
        return max([self._live_before(start)] + [b for _, b in self.timeline[i:j]])
