"""PyTorch's CUDA caching allocator, replayed over a planned step: what ``max_memory_allocated`` and
``max_memory_reserved`` will show, not only what the tensors hold.

A fake-tensor trace knows every storage the step makes and frees, in order: what the allocator is asked for.
It answers by rules that do not depend on the GPU (c10/cuda/CUDACachingAllocator.cpp, the constants below):
requests rounded to 512 B, blocks split only when the rest is worth keeping (an unsplit block counts whole),
small and large pools of segments never given back, best fit; ``expandable_segments:True`` grows one segment
per pool by pages and splits any block. Not replayed: other streams, ``max_split_size_mb`` and
``roundup_power2_divisions`` (off by default), kernels' workspaces but cuBLAS's (``planner.budget``'s lines).
"""

from bisect import bisect_left, insort

KMIN, SMALL, SMALL_BUFFER = 512, 1 << 20, 2 << 20             # kMinBlockSize, kSmallSize, kSmallBuffer
MIN_LARGE_ALLOC, ROUND_LARGE, LARGE_BUFFER = 10 << 20, 2 << 20, 20 << 20  # kMinLargeAlloc, kRoundLarge, kLargeBuffer


def round_size(n: int) -> int:
    return KMIN if n < KMIN else -(-n // KMIN) * KMIN


def segment_size(size: int) -> int:
    """cudaMalloc's size for a request that no cached block can hold (``get_allocation_size``)."""
    if size <= SMALL:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


class _Block:
    __slots__ = ("seg", "off", "size", "free", "prev", "next")

    def __init__(self, seg, off, size, prev=None, nxt=None):
        self.seg, self.off, self.size, self.free, self.prev, self.next = seg, off, size, True, prev, nxt


class CachingAllocator:
    """The allocator's block and segment rules, for one stream: ``malloc(key, nbytes)`` / ``free(key)``;
    ``allocated`` / ``reserved`` now, ``peak_allocated`` / ``peak_reserved`` since ``reset_peak()``."""

    def __init__(self, expandable: bool = False):
        self.expandable = expandable
        self._pools = {True: [], False: []}   # small? -> sorted [(size, seg, off, block)] of free blocks
        self._live = {}                         # key -> (small?, allocated block)
        self._tail = {}                         # expandable: small? -> the segment's last block
        self._segs = 0
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0

    def reset_peak(self):
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved

    # Best fit: the smallest free block that holds the request, then the lowest address (cudaMalloc gives each
    # new segment a lower address than the one before: replayed so, a real step's reserve came to the byte).
    def _insert(self, small, b):
        b.free = True
        insort(self._pools[small], (b.size, b.seg, b.off, b))  # (size, seg, off) is unique: blocks never compared

    def _remove(self, small, b):
        pool = self._pools[small]
        del pool[bisect_left(pool, (b.size, b.seg, b.off))]

    def _new_block(self, small, size):
        if not self.expandable:
            seg_bytes = segment_size(size)
            self._segs += 1
            self.reserved += seg_bytes
            return _Block(-self._segs, 0, seg_bytes)  # each new segment below the last: see _insert
        # expandable: map pages at the end of the pool's one segment, growing its last block if it is free
        page = SMALL_BUFFER if small else LARGE_BUFFER
        tail = self._tail.get(small)
        have = tail.size if tail is not None and tail.free else 0
        grow = -(-(size - have) // page) * page
        self.reserved += grow
        if have:
            self._remove(small, tail)
            tail.size += grow
            return tail
        off = tail.off + tail.size if tail is not None else 0
        b = _Block(0 if small else -1, off, grow, prev=tail)
        if tail is not None:
            tail.next = b
        self._tail[small] = b
        return b

    def malloc(self, key, nbytes: int) -> None:
        """Allocate ``nbytes`` for ``key`` (a block of at least that size, what memory_allocated adds)."""
        size = round_size(nbytes)
        small = size <= SMALL
        pool = self._pools[small]
        i = bisect_left(pool, (size, -(1 << 60), -1))
        if i < len(pool):
            b = pool[i][3]
            self._remove(small, b)
        else:
            b = self._new_block(small, size)
        rest = b.size - size
        if rest >= KMIN if (small or self.expandable) else rest > SMALL:  # should_split
            r = _Block(b.seg, b.off + size, rest, prev=b, nxt=b.next)
            if b.next is not None:
                b.next.prev = r
            b.next, b.size = r, size
            if self.expandable and self._tail.get(small) is b:
                self._tail[small] = r
            self._insert(small, r)
        b.free = False
        self._live[key] = (small, b)
        self.allocated += b.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def free(self, key) -> None:
        small, b = self._live.pop(key)
        self.allocated -= b.size
        if b.prev is not None and b.prev.free:  # merge with free neighbours in the same segment
            self._remove(small, b.prev)
            b = self._join(small, b.prev, b)
        if b.next is not None and b.next.free:
            self._remove(small, b.next)
            b = self._join(small, b, b.next)
        self._insert(small, b)

    def _join(self, small, left, right):
        left.size += right.size
        left.next = right.next
        if right.next is not None:
            right.next.prev = left
        if self._tail.get(small) is right:
            self._tail[small] = left
        return left


# Steps a run may need before its segments stop growing (a step can leave a free block too small for the next).
MAX_WARM_UP = 4


def replay(events, *, batch=(), workspaces=(), expandable=False) -> dict:
    """Replay a traced step (``Trace.events``) as a run makes it: the batch, what was live at the step's entry
    (the optimizer's state is made in the first step), cuBLAS's ``workspaces`` where the trace marked them
    (unmarked: at the first forward and backward), warm-up steps while they add a segment, peaks reset, the
    step again. Returns ``peak_allocated``, ``peak_reserved`` and ``exact_peak`` (the requests unrounded)."""
    alloc = CachingAllocator(expandable)
    for i, n in enumerate(batch):
        alloc.malloc(("batch", i), n)
    seeds = [e for e in events if e[2]]
    states = [(key, delta) for key, delta, _, _, cat in seeds if cat == "optimizer_state" and delta > 0]
    size = {}  # key -> bytes now
    for key, delta, _, _, cat in seeds:
        if cat != "optimizer_state" and delta > 0:
            alloc.malloc(key, delta)
            size[key] = delta
    entry = set(size)
    steady = [e for e in events if not e[2]]
    marked = any(e[4] == "cuBLAS" for e in steady)
    made_by = {"forward": 1, "backward": 2}  # unmarked: cuBLAS workspaces made by the first forward / backward
    ws, made = [], set()

    def make_workspace():
        ws.append(workspaces[len(ws)])
        alloc.malloc(("cuBLAS", len(ws)), ws[-1])
        return ws[-1]

    def make_states():
        for key, n in states:
            alloc.malloc(key, n)
            size[key] = n

    def run(measured):
        """One step; its peak of the unrounded requests."""
        now = sum(batch) + sum(size.values()) + sum(ws)
        peak, states_made = now, measured
        for key, delta, _, phase, cat in steady:
            if cat == "cuBLAS":
                if key not in made and len(ws) < len(workspaces):
                    made.add(key)
                    now += make_workspace()
                continue
            while not marked and len(ws) < min(made_by.get(phase.split()[0], 0), len(workspaces)):
                now += make_workspace()
            if not states_made and phase == "step":  # Adam makes its state inside its first step
                make_states()
                states_made = True
            old = size.get(key, 0)
            if old:
                alloc.free(key)
            size[key] = old + delta
            if size[key] > 0:
                alloc.malloc(key, size[key])
            else:
                del size[key]
            now += delta
            peak = max(peak, now)
        if not states_made:
            make_states()
        kept = entry | {k for k, _ in states}
        for key in [k for k in size if k not in kept]:  # held past the step's end
            alloc.free(key)
            del size[key]
        return peak

    run(False)
    for _ in range(MAX_WARM_UP - 1):  # further warm-up steps while the segments still grow (fragmentation)
        before = alloc.reserved
        run(True)
        if alloc.reserved == before:
            break
    alloc.reset_peak()
    exact_peak = run(True)
    return {"peak_allocated": alloc.peak_allocated, "peak_reserved": alloc.peak_reserved, "exact_peak": exact_peak}


def replay_recorded(events, reset_at: int = 0, expandable: bool = False) -> dict:
    """The rules over a real run's requests (``(action, address, size)`` of ``torch.cuda.memory._snapshot()``'s
    ``device_traces[0]``), peaks reset at event ``reset_at``: to hold against what that run measured."""
    alloc, live = CachingAllocator(expandable), {}
    for i, (action, addr, size) in enumerate(events):
        if i == reset_at:
            alloc.reset_peak()
        if action == "alloc":
            live[addr] = (addr, i)
            alloc.malloc(live[addr], size)
        elif action == "free_completed" and addr in live:
            alloc.free(live.pop(addr))
    return {"peak_allocated": alloc.peak_allocated, "peak_reserved": alloc.peak_reserved}
