"""MemoryTracker on the CPU: the allocator's own figure, from the profiler, with the tracker's categories.

On CUDA the tracker reads ``memory_allocated`` and its categories are the accounting of tensors, ``other``
absorbing the difference. The CPU has no such counter, and the accounting of tensors alone misses what
no tensor op announces: buffers C++ keeps (DDP's gradient buckets), kernels' scratch that no tensor owns
(oneDNN convolutions), storages re-grown with ``UntypedStorage.resize_`` before the tracker knew them.
So on the CPU the tracker plays the same game with the profiler's ``[memory]`` events
(:class:`~mgpu_helpers.alloc_reference.AllocationReference`) standing in for the allocator:

* every timeline sample also makes a zero-length profiler range (``AllocationReference.sample``): after
  the profile, the allocator's live bytes at that instant are known exactly;
* total at a sample = the accounted bytes at entry (model, optimizer state: what the tracker was told
  of) + what the allocator gained since entry -- the ``memory_allocated`` semantics of the CUDA path
  (allocated now, minus what was allocated at entry beyond the model and optimizer);
* the peak and each phase's peak take the highest allocator figure *between* samples too (a scratch
  buffer allocated and freed inside one op), with the categories of the sample before it.

``other`` = allocator - accounted, at every sample and at the peak. It can be negative only when
something allocated before entry beyond the model and optimizer (an input batch) is freed inside the
``with`` -- as on CUDA, where the same free lowers ``memory_allocated``.
"""
from __future__ import annotations

from .alloc_reference import AllocationReference, profiler_running


class ExactCPU:
    """The profiler side of one MemoryTracker: start (or join) a reference, sample, and reconcile."""

    def __init__(self, tracker, required: bool):
        self.tracker, self.n_samples, self.done = tracker, 0, False
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
        self.n_samples, self.done, self.s0 = 0, False, len(tracker._timeline)

    @property
    def on(self) -> bool:
        return self.ref is not None

    def sample(self) -> None:
        self.n_samples += 1
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
        if len(times) != self.n_samples or len(end) != 1:
            raise RuntimeError(f"MemoryTracker: {len(times)} profiler samples for {self.n_samples} timeline "
                               "samples -- the profile lost events; figures are the accounting alone")
        s0 = self.s0
        base = mt._timeline[s0][1] - ref.live_at(times[0])
        segs = ref.segment_peaks(times, end=end[0])
        phase_peaks, peak = {}, None
        for k, (t, (pk, _)) in enumerate(zip(times, segs)):
            i = s0 + k
            phase, acc, cats = mt._timeline[i]
            total = base + ref.live_at(t)
            cats = dict(cats)
            cats["other"] += total - acc
            mt._timeline[i] = (phase, total, cats)
            phase_peaks[phase] = max(phase_peaks.get(phase, pk + base), pk + base)
            if i >= mt._reset_idx and (peak is None or pk + base > peak[0]):
                peak = (pk + base, i)
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
