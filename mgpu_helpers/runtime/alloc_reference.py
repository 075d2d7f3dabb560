"""A CPU reference that sees every allocation: ``memory_allocated`` semantics in exact bytes.

    with AllocationReference() as ref:           # start it before the model is built
        model = build(); opt = make_opt(model)
        ref.mark("step0")                        # or any torch.profiler.record_function range
        loss = model(x).sum(); loss.backward(); opt.step()
    ref.at("step0"), ref.peak_bytes, ref.peak_in("step0"), ref.final_bytes

Why a second way of counting: a TorchDispatchMode (``MemoryTracker``) sees the storages that tensor ops
make. It cannot see what C++ allocates behind no tensor of Python's -- DDP's gradient buckets, oneDNN's
convolution scratch -- and it learns of a storage only when an op makes it (FSDP2 frees and re-grows its
unsharded parameters with ``UntypedStorage.resize_``, which no op announces). ``torch.profiler.profile(
activities=[CPU], profile_memory=True)`` records each allocation and free of the c10 allocator as an event
with a nanosecond timestamp and the allocator's running total (``total_allocated``; on the CPU kept over
every thread once c10's ``caffe2_report_cpu_memory_usage`` flag is on, which entry sets -- gloo's threads
free tensors where the profiler records nothing). That total, less its value at entry, is the bytes live
at any recorded instant: what ``torch.cuda.memory_allocated()`` would read on a GPU (without its 512-byte
rounding) counted from the ``with``'s entry, so start it before anything you want counted exists
(FACTS.md, "Memory on CPU": a decoder's step at one rank matched the planner to 8 bytes). A change made
on another thread shows at the next recorded event of a profiled thread.

Figures are known only after the ``with`` exits (the profiler hands its events over when it stops).
Marks are ``record_function`` ranges: ``mark(label)`` makes a zero-length one; ``at(label)`` is the live
bytes when the range with that name first opened (``occurrence=k``: the k-th, ``-1`` the last);
``peak_in(label)`` is the highest live figure while it was open. Costs: the profiler slows small ops down
~2x. ``device="cuda"`` reads CUDA's events (the caching allocator's total) instead.
"""
from __future__ import annotations

import bisect
import contextlib
import ctypes
import os

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from .every_thread import EveryThreadAllocations, fd2_to
from .every_thread import _flag, count_every_thread as _count_every_thread

__all__ = ["AllocationReference", "profiler_running"]


def profiler_running() -> bool:
    """True while a torch profiler is on in this process (a second one cannot start then)."""
    return torch._C._autograd._profiler_enabled()


@contextlib.contextmanager
def _no_c10_warnings():
    # While profiling, each 1000th free of a block allocated before the flag was set logs "Memory block of
    # unknown size was allocated before the profiling started" (c10 LOG(WARNING), to fd 2: in a notebook,
    # a line nbval would compare). Those frees are what memory_allocated-since-entry semantics ignore, so
    # c10's warnings are raised to errors for the reference's lifetime only.
    level = _flag(ctypes.c_int, "FLAGS_caffe2_log_level")
    if level is None:  # c10's library not found (see every_thread.c10_library): nothing to quieten
        yield
        return
    old, level.value = level.value, max(level.value, 2)
    try:
        yield
    finally:
        level.value = old


def _with_other_threads(allocs, every):
    """The profiled thread's allocation events [(t_ns, bytes, total, ptr)] with every other thread's put in
    between: ``every`` is c10's log of all threads' [(bytes, total)] (``EveryThreadAllocations``). Each
    event of ours is one of the log's lines (same bytes, same total: both are the reporter's counter, taken
    under its lock); the lines between two of ours are other threads' -- a kernel's OpenMP workers, gloo's
    threads -- and get the time of ours before them (they carry none), ``ptr`` None. Without them a worker's
    block shows only in the total our next event carries, and a peak between two of our events is missed
    (pytorch/pytorch#192290: the profiler records the memory events of its own thread only). The naive
    alternative, reading only the totals our events carry, is what this reference did before: a draw for
    flash attention's CPU backward. What the earlier time cannot place: a range opened between two of our
    events, before another thread's block, without an event of ours inside before it, misses that block (a
    kernel allocates its buffers on the calling thread before its workers start, so an op's range does not)."""
    if not every or not allocs:
        return allocs
    where: dict = {}
    for i, line in enumerate(every):
        where.setdefault(line, []).append(i)
    at = []  # the log's line of each of our events, None where it is not in the log (made before it opened)
    j = 0
    for _, n, total, _ in allocs:
        lines = where.get((n, total), ())
        k = bisect.bisect_left(lines, j)
        at.append(lines[k] if k < len(lines) else None)
        if at[-1] is not None:
            j = at[-1] + 1
    # lines before our first matched event: other threads' blocks made since the log opened, just before it
    first = next((i for i in range(len(allocs)) if at[i] is not None), None)
    out, nxt = [], len(every)
    for i in range(len(allocs) - 1, -1, -1):  # backwards: the next matched line bounds each gap
        if at[i] is not None:
            out.extend(reversed([(allocs[i][0], n, total, None) for n, total in every[at[i] + 1:nxt]]))
            nxt = at[i]
        out.append(allocs[i])
        if i == first:
            out.extend(reversed([(allocs[i][0], n, total, None) for n, total in every[:at[i]]]))
    out.reverse()
    return out


def _walk(events):
    for e in events:
        yield e
        yield from _walk(e.children)


def _quiet_stderr():
    # Kineto prints "USDT: ... profiler_start/stop" on file descriptor 2 (not sys.stderr): in a notebook that
    # lands in the cell's output and nbval would compare a timestamp. Silence fd 2 for the start/stop only.
    return fd2_to(os.devnull)


class _Series:
    """Live bytes after each allocator event: ``timeline`` [(t_ns, live)], read at any instant."""

    def __init__(self, times, timeline):
        self._times, self.timeline = times, timeline

    def live_at(self, t_ns) -> int:
        """Live bytes just after time ``t_ns`` (events at ``t_ns`` included: a sample follows its event)."""
        i = bisect.bisect_right(self._times, t_ns)
        return self.timeline[i - 1][1] if i else 0

    def segment_peaks(self, starts, end=None):
        """For sorted times ``starts``: [(peak, t_of_peak)] over [starts[k], starts[k+1]) (the last: to
        ``end`` or the end of the profile), the live figure at each start included -- what happens between two samples (a kernel's
        scratch, allocated and freed inside one op) belongs to the first."""
        out = []
        for k, t0 in enumerate(starts):  # events in (t0, next start): live_at(t0) already holds those at t0
            best = (self.live_at(t0), t0)
            j = bisect.bisect_right(self._times, t0)
            nxt = starts[k + 1] if k + 1 < len(starts) else end
            end_i = bisect.bisect_left(self._times, nxt) if nxt is not None else len(self._times)
            for i in range(j, end_i):
                if self.timeline[i][1] > best[0]:
                    best = (self.timeline[i][1], self._times[i])
            out.append(best)
        return out


class AllocationReference(_Series):
    """Live bytes of the device's allocator from entry on, from the profiler's ``[memory]`` events.

    After the ``with``: ``peak_bytes`` (highest live figure), ``final_bytes`` (live at exit), ``at(label)``
    (live when the mark/range ``label`` opened), ``peak_in(label)`` (highest while it was open),
    ``marks`` (labels in the order they opened), ``timeline`` ((t_ns, live bytes) after each event)."""

    def __init__(self, device="cpu"):
        self.device = torch.device(device)
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"AllocationReference(device={device!r}): the profiler's memory events "
                             "cover 'cpu' and 'cuda' only")
        self._prof, self._done = None, False
        super().__init__([], [])

    def __enter__(self):
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        if profiler_running():
            raise RuntimeError("AllocationReference: a torch profiler is already running in this process; "
                               "only one can record at a time -- exit it first")
        if self.device.type == "cpu":
            _count_every_thread()
        # acc_events: one recording cycle anyway; without it torch 2.11 warns on stderr ("Profiler clears
        # events at the end of each cycle") once per process, a line nbval would see in a cell's output
        self._prof = profile(activities=acts, profile_memory=True, record_shapes=False, acc_events=True)
        self._quiet = _no_c10_warnings()
        self._quiet.__enter__()
        with _quiet_stderr():
            self._prof.__enter__()
        # the blocks worker threads allocate, which the profiler does not record (see every_thread)
        self._log = EveryThreadAllocations().__enter__() if self.device.type == "cpu" else None
        self.every_thread = self._log
        AllocationReference.running = self
        return self

    def __exit__(self, *exc):
        AllocationReference.running = None
        if self._log is not None:
            self._log.__exit__(None, None, None)
        with _quiet_stderr():
            self._prof.__exit__(*exc)
        self._quiet.__exit__(None, None, None)
        allocs, self._ranges = [], {}  # name -> [(start_ns, end_ns)] in order of opening
        for e in _walk(self._prof.profiler.kineto_results.experimental_event_tree()):
            f = e.extra_fields
            if type(f).__name__ == "_ExtraFields_Allocation":
                if f.device.type == self.device.type:
                    allocs.append((e.start_time_ns, f.alloc_size, f.total_allocated, f.ptr))
            else:
                self._ranges.setdefault(e.name, []).append((e.start_time_ns, e.end_time_ns))
        for spans in self._ranges.values():
            spans.sort()
        allocs.sort(key=lambda a: a[0])
        allocs = _with_other_threads(allocs, self._log.events if self._log is not None else [])
        # The allocator's running total of every thread, less its value just before the first event
        zero = allocs[0][2] - allocs[0][1] if allocs else 0
        self.timeline = [(t, total - zero) for t, _, total, _ in allocs]
        self._times = [t for t, _ in self.timeline]
        self._blocks = [(n, ptr) for _, n, _, ptr in allocs]
        self._done = True
        return False

    running = None  # the instance whose `with` is open: MemoryTracker joins it rather than start a profiler

    @staticmethod
    def sample(name: str) -> None:
        """A cheap zero-length range (~2 us): after exit ``times(name)`` holds the starts, in order, and
        ``live_at`` / ``segment_peaks`` read the allocator there. MemoryTracker takes one per change."""
        with torch._C._profiler._RecordFunctionFast(name):
            pass

    def times(self, name: str) -> list:
        """Start times (ns) of the ranges named ``name``, in order (none: [])."""
        self._need()
        return [t for t, _ in self._ranges.get(name, [])]

    def mark(self, label: str) -> None:
        """A zero-length range named ``label``: ``at(label)`` is the live bytes at this instant."""
        with record_function(label):
            pass

    # ---- the figures (after exit) -----------------------------------------------------------------
    def _need(self):
        if not self._done:
            raise RuntimeError("AllocationReference: figures exist once the `with` has exited "
                               "(the profiler hands its events over when it stops)")

    def since(self, t0, keep=()) -> "_Series":
        """The live figure from ``t0`` on as the tracker counts it: a free of a block allocated before ``t0``
        (by address) does not lower it, unless the address is in ``keep`` (blocks it counted at ``t0``: the
        model's and optimizer's). Without this, memory that merely became garbage earlier -- a previous
        model collected by ``gc`` during the step -- would make the figure drop below what the step holds."""
        made, keep, back, lives = set(), set(keep), 0, []
        for (t, live), (n, ptr) in zip(self.timeline, self._blocks):
            if t > t0 and ptr is not None:  # events at t0 are in live_at(t0) already; None: another thread's
                if n > 0:
                    made.add(ptr)
                elif ptr in made:
                    made.discard(ptr)
                elif ptr in keep:
                    keep.discard(ptr)
                else:
                    back -= n
            lives.append(live + back)
        return _Series(self._times, list(zip(self._times, lives)))

    def _live_before(self, t_ns):
        i = bisect.bisect_left(self._times, t_ns)  # events strictly before t_ns
        return self.timeline[i - 1][1] if i else 0

    def _range(self, label, occurrence):
        self._need()
        if label not in self._ranges:
            known = [m for m in self.marks if not m.startswith(("aten::", "autograd::", "torch::"))][:20]
            raise KeyError(f"AllocationReference: no mark or range named {label!r}; user marks seen: {known}")
        return self._ranges[label][occurrence]

    @property
    def peak_bytes(self) -> int:
        self._need()
        return max([0] + [b for _, b in self.timeline])

    @property
    def final_bytes(self) -> int:
        self._need()
        return self.timeline[-1][1] if self.timeline else 0

    @property
    def marks(self) -> list:
        self._need()
        return sorted(self._ranges, key=lambda k: self._ranges[k][0][0])

    def at(self, label: str, occurrence: int = 0) -> int:
        """Live bytes when the ``occurrence``-th range named ``label`` opened."""
        return self._live_before(self._range(label, occurrence)[0])

    def peak_in(self, label: str, occurrence: int = 0) -> int:
        """Highest live bytes while the ``occurrence``-th range named ``label`` was open (its entry included)."""
        start, end = self._range(label, occurrence)
        i, j = bisect.bisect_left(self._times, start), bisect.bisect_right(self._times, end)
        return max([self._live_before(start)] + [b for _, b in self.timeline[i:j]])

    def own_events(self, label: str, occurrence: int = 0) -> list:
        """[signed bytes] of the allocations and frees recorded while the range was open, in order: those of
        the profiled thread only (a worker thread's show in the totals, never as events of their own)."""
        start, end = self._range(label, occurrence)
        i, j = bisect.bisect_left(self._times, start), bisect.bisect_right(self._times, end)
        return [n for n, ptr in self._blocks[i:j] if ptr is not None]

    def peak_between(self, start_label: str, end_label: str | None = None) -> int:
        """Highest live bytes from the opening of ``start_label`` to that of ``end_label`` (or the end)."""
        start = self._range(start_label, 0)[0]
        end = self._range(end_label, 0)[0] if end_label is not None else float("inf")
        i, j = bisect.bisect_left(self._times, start), bisect.bisect_left(self._times, end)
        return max([self._live_before(start)] + [b for _, b in self.timeline[i:j]])


# As early as the package is imported: blocks allocated before the flag is set have no size on record, and
# their frees (a model built before the first reference, freed inside it) would go uncounted.
_count_every_thread()
