"""MemoryTracker on the CPU: the allocator's own figure, from the profiler, with the tracker's categories.

On CUDA the tracker reads ``memory_allocated`` and its categories are the accounting of tensors, ``other``
absorbing the difference. The CPU has no such counter, and the accounting of tensors alone misses what
no tensor op announces: buffers C++ keeps (DDP's gradient buckets), kernels' scratch that no tensor owns
(oneDNN convolutions), storages re-grown with ``UntypedStorage.resize_`` before the tracker knew them.
So on the CPU the tracker plays the same game with the profiler's ``[memory]`` events
(:class:`~mgpu_helpers.runtime.alloc_reference.AllocationReference`) standing in for the allocator:

* every timeline sample also makes a zero-length profiler range (``AllocationReference.sample``): after
  the profile, the allocator's live bytes at that instant are known exactly;
* total at a sample = the accounted bytes at entry (model, optimizer state: what the tracker was told
  of) + what the allocator gained since entry -- the ``memory_allocated`` semantics of the CUDA path
  (allocated now, minus what was allocated at entry beyond the model and optimizer);
* the peak and each phase's peak take the highest allocator figure *between* samples too (a scratch
  buffer allocated and freed inside one op), with the categories of the sample before it.

What no tensor op announces lands in ``other``: DDP's gradient buckets, oneDNN's convolution scratch,
foreach's wrapped scalars, checkpoint's saved RNG states. The figures exist once the tracker's ``with`` has
exited (inside it ``current_bytes`` is the accounting) -- or, when the tracker joined an enclosing
``AllocationReference`` rather than start a second profiler, once that one exits. Off (the accounting
alone): ``exact=False``; by default in one process, whose notebooks and checks use the accounting (turning
it on there changes their figures by those bytes: a follow-up); another profiler running; ``round_to`` >
1; a fake mode. tests/test_tracker_ranks.py: equal to the allocator at every mark, phase peak and peak
under DDP, ZeRO-1 + DDP and FSDP2 on 2 and 4 gloo ranks, and for a conv net in one process.

``other`` = allocator - accounted, at every sample and at the peak. One blind spot: a block from before the
entry that gloo's worker thread frees (the profiler records nothing on that thread, only the running
total shows it) lowers the figure, as it would lower ``memory_allocated``: a few KB at most, seen once. It can be negative only when
something allocated before entry beyond the model and optimizer (an input batch) is freed inside the
``with`` -- as on CUDA, where the same free lowers ``memory_allocated``.
"""
from __future__ import annotations

import threading

from .alloc_reference import AllocationReference, profiler_running


class ExactCPU:
    """The profiler side of one MemoryTracker: start (or join) a reference, sample, and reconcile."""

    def __init__(self, tracker, required: bool):
        self.tracker, self.idx, self.done = tracker, [], False
        self.name = f"mgpu.tracker.{id(tracker)}"
        self.ref, self.own = AllocationReference.running, False
        if self.ref is None:
            if profiler_running():  # someone else's profiler: one at a time, so count tensors only
                if required:
                    raise RuntimeError("MemoryTracker(exact=True): a torch profiler is already running; "
                                       "exit it, or run the tracker inside an AllocationReference")
                self.ref = None
                return
            self.ref, self.own = AllocationReference(tracker.device), True
            self.ref.__enter__()
        self.idx, self.thread = [], threading.get_ident()

    @property
    def on(self) -> bool:
        return self.ref is not None

    def seeded(self) -> None:
        """After the tracker counted its seeds: their addresses, whose frees the allocator must count."""
        self.seed_ptrs = {st.data_ptr() for st in (r.ref() for r in self.tracker._recs.values())
                          if st is not None and st.nbytes()}

    def sample(self) -> None:
        # Only the thread that entered is profiled: a sample taken on another (a free run by gloo's worker
        # thread) gets no time of its own and carries the offset of the sample before it.
        if threading.get_ident() == self.thread:
            self.idx.append(len(self.tracker._timeline) - 1)
            self.ref.sample(self.name)

    def exit(self) -> None:
        self.ref.sample(self.name + ".exit")
        if self.own:
            self.ref.__exit__(None, None, None)

    def ready(self) -> bool:
        # A joined reference hands its events over when *its* `with` exits: until then the tracker's
        # figures are the accounting alone.
        return self.on and not self.done and self.ref._done

    def reconcile(self) -> None:
        """Rewrite the tracker's timeline, peaks and frozen figures with the allocator's bytes."""
        self.done = True
        mt, ref = self.tracker, self.ref
        times, end = ref.times(self.name), ref.times(self.name + ".exit")
        if len(times) != len(self.idx) or len(end) != 1:
            raise RuntimeError(f"MemoryTracker: {len(times)} profiler samples for {len(self.idx)} timeline "
                               "samples -- the profile lost events")
        # From the entry on, blocks that were live then count only if the tracker counted them (its seeds)
        ref = ref.since(times[0], self.seed_ptrs)
        base = mt._timeline[self.idx[0]][1] - ref.live_at(times[0])  # accounted at entry = allocator there
        segs = ref.segment_peaks(times, end=end[0])
        bounds = self.idx[1:] + [len(mt._timeline) if mt._s_end is None else mt._s_end]
        phase_peaks, peak = {}, None
        for i, j, t, (pk, _) in zip(self.idx, bounds, times, segs):
            offset = base + ref.live_at(t) - mt._timeline[i][1]  # allocator - accounted at sample i
            for k in range(i, j):  # sample i and the unprofiled ones up to the next profiled one
                phase, acc, cats = mt._timeline[k]
                mt._timeline[k] = (phase, acc + offset, {**cats, "other": cats["other"] + offset})
            phase = mt._timeline[i][0]
            top = max([pk + base] + [mt._timeline[k][1] for k in range(i, j)])
            phase_peaks[phase] = max(phase_peaks.get(phase, top), top)
            if i >= mt._reset_idx and (peak is None or top > peak[0]):
                at = i if top == pk + base else max(range(i, j), key=lambda k: mt._timeline[k][1])
                peak = (top, at)
        for ph, v in mt._phase_peaks.items():  # phases marked after the exit keep their accounted figure
            phase_peaks.setdefault(ph, v)
        mt._phase_peaks = {ph: phase_peaks[ph] for ph in mt._phase_peaks}
        mt._ex_current = base + ref.live_at(end[0])  # current_bytes after the exit
        mt._acc_peak = mt._peak
        if peak is not None:
            value, i = peak  # the categories of the sample before the peak; other takes the rest
            cats = dict(mt._timeline[i][2])
            cats["other"] += value - mt._timeline[i][1]
            mt._peak, mt._peak_cats, mt._peak_idx = value, cats, i
