"""What the CPU allocator saw: the profiler's allocation events, summed in time order.

    with AllocationReference() as ref:           # start it before the model is built
        with record_function("step0"):           # any op or record_function range
            loss = model(x).sum(); loss.backward(); opt.step()
    ref.peak_bytes, ref.peak_in("step0"), ref.final_bytes

The course's figures count tensors (``MemoryTracker``, the planner), the same on every CPU; the allocator also
holds what C++ allocates behind no tensor (oneDNN's scratch, gloo's copies). This sees only this thread's
allocations, and frees of blocks made after entry: a lower bound, and a figure that depends on the machine.
"""

import bisect
import contextlib
import itertools
import os

import torch
from torch.profiler import ProfilerActivity, profile


@contextlib.contextmanager
def quiet_fd2():
    # Kineto prints "USDT: ... profiler_start/stop" on fd 2, not sys.stderr: into a notebook cell's output.
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as sink:
            os.dup2(sink.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class AllocationReference:
    """Live bytes of the CPU allocator from entry on. ``timeline``: (t_ns, live bytes) after each event;
    ``ranges``: {name: [(start_ns, end_ns), ...]} of every op and ``record_function`` range."""

    def __init__(self):
        self._prof, self._done, self._times, self.timeline, self.ranges = None, False, [], [], {}

    def __enter__(self):
        if torch._C._autograd._profiler_enabled():
            raise RuntimeError("AllocationReference: a torch profiler is already running in this process; "
                               "only one can record at a time -- exit it first")
        # acc_events: one recording cycle anyway; without it torch warns once per process on stderr
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True, acc_events=True)
        with quiet_fd2():
            self._prof.__enter__()
        return self

    def __exit__(self, *exc):
        with quiet_fd2():
            self._prof.__exit__(*exc)
        events = sorted(self._prof.profiler.kineto_results.events(), key=lambda e: (e.start_ns(), e.end_ns()))
        allocs = [(e.start_ns(), e.nbytes()) for e in events
                  if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
        for e in events:
            if e.name() != "[memory]":
                self.ranges.setdefault(e.name(), []).append((e.start_ns(), e.end_ns()))
        allocs.sort()
        self._times = [t for t, _ in allocs]
        self.timeline = list(zip(self._times, itertools.accumulate(n for _, n in allocs)))
        self._done = True

    def live_at(self, t_ns: int, inclusive: bool = False) -> int:
        """Live bytes after the events before ``t_ns`` (``inclusive``: at or before)."""
        i = (bisect.bisect_right if inclusive else bisect.bisect_left)(self._times, t_ns)
        return self.timeline[i - 1][1] if i else 0

    def events_in(self, start: int, end: int) -> list[int]:
        """Live bytes after each event in ``[start, end]`` (ns)."""
        lo, hi = bisect.bisect_left(self._times, start), bisect.bisect_right(self._times, end)
        return [b for _, b in self.timeline[lo:hi]]

    peak_bytes = property(lambda self: max([0] + [b for _, b in self.timeline]))
    final_bytes = property(lambda self: self.timeline[-1][1] if self.timeline else 0)

    def at(self, label: str, occurrence: int = 0) -> int:
        """Live bytes when the ``occurrence``-th range named ``label`` opened."""
        return self.live_at(self.ranges[label][occurrence][0])

    def peak_in(self, label: str, occurrence: int = 0) -> int:
        """Highest live bytes while the ``occurrence``-th range named ``label`` was open (its entry included)."""
        if not self._done:
            raise RuntimeError("AllocationReference: figures exist once the `with` has exited")
        if label not in self.ranges:
            raise KeyError(f"AllocationReference: no range named {label!r}")
        start, end = self.ranges[label][occurrence]
        return max([self.live_at(start)] + self.events_in(start, end))
