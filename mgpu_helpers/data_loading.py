"""Notebook 10 -- data loading: DataLoader workers, pinned memory, prefetching, and per-rank shards (check 10.1
in ``checks.data_loading``). The script prints each rank's DistributedSampler shard::

    torchrun --nproc-per-node 2 -m mgpu_helpers.data_loading
"""
import os
import time
import warnings

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from .runtime.launch import script_args, torchrun_main


class SlowDataset(Dataset):
    """``n`` items of ``dim`` floats; each takes ``delay`` seconds to "decode". Item: (tensor, index, pid)."""

    def __init__(self, n: int = 64, delay: float = 0.005, dim: int = 16):
        if n < 0 or delay < 0:
            raise ValueError(f"n and delay must be >= 0, got n={n}, delay={delay}")
        self.n, self.delay, self.dim = n, delay, dim

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        time.sleep(self.delay)
        return torch.full((self.dim,), float(i)), i, os.getpid()


def epoch_seconds(loader) -> tuple[float, set[int]]:
    """Wall time of one pass over ``loader`` (worker start-up included) and the pids that made items."""
    t0, pids = time.perf_counter(), set()
    for _, _, pid in loader:
        pids.update(pid.tolist())
    return time.perf_counter() - t0, pids


def throughput(workers=(0, 1, 2, 4), n=256, delay=0.005, batch_size=8) -> dict[int, dict]:
    """One epoch per ``num_workers``: ``startup`` (seconds to the first batch, workers started), ``rate`` (items
    per second after it, which start-up would hide in a short epoch) and the loader's ``warnings``."""
    ds, out = SlowDataset(n, delay), {}
    for w in workers:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t0 = time.perf_counter()
            it = iter(DataLoader(ds, batch_size=batch_size, num_workers=w))
            first = len(next(it)[1])
            t1 = time.perf_counter()
            rest = sum(len(batch[1]) for batch in it)
            t2 = time.perf_counter()
        out[w] = {"startup": t1 - t0, "rate": rest / (t2 - t1), "items": first + rest,
                  "warnings": sorted({" ".join(str(m.message).split()) for m in caught})}
    return out


def _worker_id(batch) -> int:  # a collate_fn: runs where the batch is made. Module level: workers unpickle it
    info = torch.utils.data.get_worker_info()
    return -1 if info is None else info.id  # -1: the main process


def batch_makers(num_workers: int, batches: int = 8, batch_size: int = 4) -> list[int]:
    """Which worker made each of the first ``batches`` batches (batch i: worker i mod num_workers)."""
    with warnings.catch_warnings():  # more workers than cores: torch's warning is shown with throughput()
        warnings.simplefilter("ignore", UserWarning)
        loader = DataLoader(range(64), batch_size=batch_size, num_workers=num_workers, collate_fn=_worker_id)
        return [b for b, _ in zip(loader, range(batches))]


def worker_memory(num_workers: int):
    """Each worker's RSS and USS once a batch is taken (USS: what it adds; RSS counts pages shared with its parent)."""
    import psutil

    # only this loader's workers: others may be alive (an earlier loader's, run_ranks' forkserver, a tracker)
    before = {p.pid for p in psutil.Process().children()}
    it = iter(DataLoader(SlowDataset(64, 0.0), batch_size=8, num_workers=num_workers))
    next(it)
    mems = [p.memory_full_info() for p in psutil.Process().children() if p.pid not in before]
    return {"processes": len(mems), "rss": [m.rss for m in mems], "uss": [m.uss for m in mems]}  # `it` ends its workers


def pin_memory_on_this_machine():
    """What ``pin_memory=True`` does here: on CUDA, page-locked batches; without an accelerator, a warning."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batch = next(iter(DataLoader(SlowDataset(8, 0.0), batch_size=4, pin_memory=True)))
    return batch[0].is_pinned(), [str(w.message) for w in caught]


def in_flight(num_workers: int, prefetch_factor: int, batch_size: int = 4, wait: float = 0.5) -> int:
    """Batches made ahead while the loop stalls after its first: num_workers × prefetch_factor."""
    import multiprocessing as mp

    counter = mp.Value("i", 0)

    class Counting(SlowDataset):
        def __getitem__(self, i):
            with counter.get_lock():
                counter.value += 1
            return super().__getitem__(i)

    it = iter(DataLoader(Counting(256, 0.0), batch_size=batch_size, num_workers=num_workers,
                         prefetch_factor=prefetch_factor))
    next(it)
    last, stable_since = -1, time.perf_counter()
    while time.perf_counter() - stable_since < wait:  # until the workers stop: the queue is full
        time.sleep(0.02)
        if counter.value != last:
            last, stable_since = counter.value, time.perf_counter()
    return last // batch_size - 1  # minus the batch already taken; `it`, freed on return, ends the workers


def _script(rank, world, n=10):
    import torch.distributed as dist

    s = DistributedSampler(range(n), shuffle=True, seed=0)  # rank and world size from the process group
    shards = []
    for epoch in (0, 1):
        s.set_epoch(epoch)
        mine = [None] * world
        dist.all_gather_object(mine, list(s))
        shards.append(mine)
    assert all(sorted(set(sum(e, []))) == list(range(n)) for e in shards), "shards do not cover the dataset"
    return f"{world} ranks, {n} samples: epoch 0 {shards[0]}, epoch 1 {shards[1]} (set_epoch reshuffles)"


if __name__ == "__main__":  # torchrun --nproc-per-node 2 -m mgpu_helpers.data_loading
    script_args(__doc__)
    torchrun_main(_script)
