"""Every CPU allocation of every thread, in sizes and running totals: what the profiler cannot record.

    with EveryThreadAllocations() as log:
        log.mark("a")                 # from the thread that opened it, between parallel regions
        op(*args)
        log.mark("b")
    log.between("a", "b")             # [(+bytes or -bytes, every thread's total after it), ...]

Why: the profiler records an allocation only on the thread that started it (pytorch/pytorch#192290). An
ATen CPU kernel that allocates *inside* ``at::parallel_for`` -- flash attention's CPU kernels give each
thread a row-sum buffer and call oneDNN's bf16 gemm, whose scratchpad comes from c10's allocator, on every
worker thread -- leaves the workers' blocks unrecorded: ``AllocationReference`` alone sees them only in the
running total its own thread's next event carries. So what one call of such a kernel seemed to take was a
draw (30 identical calls of the flash-attention backward, bf16, 16 threads, as AVX512_CORE_BF16: 322,180 ...
540,548 B; bench/sdpa_scratch_spread.py).

c10's CPU allocator can say every allocation itself: with its flag ``caffe2_report_cpu_memory_usage`` on
(:func:`count_every_thread`, at import) its ``ProfiledCPUMemoryReporter`` keeps one running total of every
thread and logs, at INFO level, "C10 alloc N bytes, total alloc M bytes." or "C10 deleted N bytes, total
alloc M bytes." for each block, on any thread, M read under its lock -- the very total the profiler's events
carry. Below WARNING that log is off; this lowers c10's log level to INFO while it is open and reads the
lines from file descriptor 2 (redirected to a temporary file: a notebook's output never sees them). Lines
that are not the allocator's are written back to fd 2 when it closes, but for c10's own below the level in
force before (INFO lines nobody asked for). The lines carry no thread id: ``AllocationReference`` and
``planner.kernels`` pair them with the profiler's events of the one thread it records.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import re
import tempfile

import torch

__all__ = ["EveryThreadAllocations", "count_every_thread", "c10_library", "fd2_to"]

_EVENT = re.compile(rb"C10 (alloc|deleted) (\d+) bytes, total alloc (-?\d+) bytes|mgpu_every_thread_mark (\S+)\n")
_MARK = b"mgpu_every_thread_mark "
# c10's own log format: severity letter, month and day; in a process group's ranks c10 puts "[rankN]:" first
_C10_LINE = re.compile(rb"^(?:\[rank\d+\]:)?\[([IWEF])\d{4} ")
_SEVERITY = {b"I": 0, b"W": 1, b"E": 2, b"F": 3}


@functools.lru_cache(maxsize=None)
def c10_library():
    """torch's c10 library (its flags are globals there), or None where it is not found: Linux names it
    libc10.so, macOS libc10.dylib, Windows c10.dll."""
    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    for name in ("libc10.so", "libc10.dylib", "c10.dll"):
        try:
            return ctypes.CDLL(os.path.join(lib, name))
        except OSError:
            continue
    return None


def _flag(ctype, name):
    lib = c10_library()
    try:
        return ctype.in_dll(lib, name) if lib is not None else None
    except ValueError:  # a build without that flag
        return None


@contextlib.contextmanager
def fd2_to(path):
    """File descriptor 2 -- where C++ code (c10, Kineto) writes, not ``sys.stderr`` -- into ``path`` for a while."""
    try:
        fd = os.dup(2)
    except OSError:  # no fd 2 (an embedded interpreter): nothing to silence
        yield
        return
    try:
        with open(path, "wb") as sink:
            os.dup2(sink.fileno(), 2)
            yield
    finally:
        os.dup2(fd, 2)
        os.close(fd)


def count_every_thread():
    """Turn on c10's running total of every thread's CPU allocations (once per process; it stays on).

    The profiler records an allocation or a free only on threads where it is on; gloo's worker threads drop
    the last reference to some tensors (FSDP2's all-gather outputs), so a sum of the recorded events drifts.
    With c10's flag ``caffe2_report_cpu_memory_usage``, ProfiledCPUMemoryReporter keeps one total of every
    thread's allocations and frees (from when the flag is set), which each recorded event carries as
    ``total_allocated``, and logs each block at INFO level (off unless :class:`EveryThreadAllocations` is
    open). Cost: a mutex and a hash-map update per CPU allocation."""
    flag = _flag(ctypes.c_bool, "FLAGS_caffe2_report_cpu_memory_usage")
    if flag is not None and not flag.value:
        # From now on each 1000th free of a block allocated before this line logs "Memory block of unknown
        # size was allocated before the profiling started" on fd 2 (in a rank or a notebook: a line in the
        # output, which nbval compares). Spend the first of those here, silenced.
        blocks = [torch.empty(1)]
        flag.value = True
        with fd2_to(os.devnull):
            blocks.clear()


class EveryThreadAllocations:
    """Collects c10's per-allocation log lines (all threads) while open; ``mark`` splits them. One opened
    while another is open reads the same stream (from where it stood at entry) and leaves it to the outer."""

    _open = None  # the outermost one open in this process: it owns fd 2's redirection

    def __init__(self):
        self.events, self._marks, self._file, self._fd2, self._outer = [], {}, None, None, None

    def __enter__(self):
        count_every_thread()
        outer = EveryThreadAllocations._open
        if outer is not None and outer._file is not None:
            self._outer, self._start = outer, os.lseek(outer._file.fileno(), 0, os.SEEK_CUR)
            return self
        self._level = _flag(ctypes.c_int, "FLAGS_caffe2_log_level")
        if self._level is None:  # no c10 flags to set (not found): nothing to read; events stay empty
            return self
        try:
            self._fd2 = os.dup(2)
        except OSError:  # no fd 2 (an embedded interpreter): nothing to read; events stay empty
            return self
        self._file = tempfile.TemporaryFile()
        os.dup2(self._file.fileno(), 2)
        self._old_level, self._level.value = self._level.value, 0
        EveryThreadAllocations._open = self
        return self

    def mark(self, label: str) -> None:
        """A line of our own in the same stream: what follows it was allocated after this call."""
        if self._fd2 is not None or self._outer is not None:
            os.write(2, _MARK + label.encode() + b"\n")

    def __exit__(self, *exc):
        if self._outer is not None:  # the outer's stream, from our entry to now; the outer keeps it all
            fd = self._outer._file.fileno()
            self._parse(os.pread(fd, os.lseek(fd, 0, os.SEEK_CUR) - self._start, self._start))
            self._outer = None
            return False
        if self._fd2 is None:
            return False
        EveryThreadAllocations._open = None
        self._level.value = self._old_level
        os.dup2(self._fd2, 2)
        os.close(self._fd2)
        self._fd2 = None
        self._file.seek(0)
        text = self._file.read()
        self._file.close()
        self._file = None
        self._parse(text)
        other = [line for line in text.splitlines(keepends=True) if not _EVENT.search(line)
                 and not (_C10_LINE.match(line) and _SEVERITY[_C10_LINE.match(line).group(1)] < self._old_level)]
        if other:  # whatever else went to fd 2 meanwhile (a warning of torch's): not ours to swallow
            os.write(2, b"".join(other))
        return False

    def _parse(self, text: bytes):
        # finditer over the whole text: two threads' lines may share one (c10 writes the message and its
        # newline apart), and every line is self-delimiting by its pattern
        for m in _EVENT.finditer(text):
            if m.group(4) is not None:
                self._marks[m.group(4).decode()] = len(self.events)
            else:
                n = int(m.group(2))
                self.events.append((n if m.group(1) == b"alloc" else -n, int(m.group(3))))

    def between(self, start: str, end: str) -> list:
        """[(signed bytes, every thread's total after it)] from mark ``start`` to mark ``end``, in the order
        the lines were written (totals are exact; two threads' lines may swap places)."""
        if start not in self._marks or end not in self._marks:
            return []
        return self.events[self._marks[start]:self._marks[end]]
