"""Wall time of one launch: run_ranks against raw torch.multiprocessing.start_processes (spawn).

Each launch starts the ranks, initialises a gloo process group, does one all_reduce, destroys the group
and returns. Medians of a few repeats; run with `python bench/launch.py [repeats]`.
"""
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from mgpu_helpers.launch import describe, run_ranks


def one_all_reduce(rank, world_size):
    t = torch.ones(4) * (rank + 1)
    dist.all_reduce(t)
    return t[0].item()


def _raw_rank(rank, world_size, path):  # what a script would hand to mp.spawn
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world_size)
    one_all_reduce(rank, world_size)
    dist.destroy_process_group()


def raw_spawn(world_size):
    fd, path = tempfile.mkstemp(prefix="bench-rdzv-")
    os.close(fd)
    try:
        tmp.start_processes(_raw_rank, args=(world_size, path), nprocs=world_size, start_method="spawn")
    finally:
        if os.path.exists(path):
            os.unlink(path)


def run_ranks_spawn(world_size):
    os.environ["MGPU_START_METHOD"] = "spawn"
    try:
        run_ranks(one_all_reduce, world_size, backend="gloo")
    finally:
        del os.environ["MGPU_START_METHOD"]


def median_time(launch, world_size, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        launch(world_size)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    print(f"torch {torch.__version__}, {len(os.sched_getaffinity(0))} cores, load average "
          f"{os.getloadavg()[0]:.1f}, median of {repeats} launches")
    print(f"{'world':>5}  {'run_ranks':>10}  {'run_ranks spawn':>15}  {'raw mp spawn':>12}  "
          f"{'raw/run_ranks':>13}  run_ranks starts")
    for world_size in (2, 4):
        expected = [world_size * (world_size + 1) / 2] * world_size
        assert run_ranks(one_all_reduce, world_size, backend="gloo") == expected
        ours = median_time(lambda w: run_ranks(one_all_reduce, w, backend="gloo"), world_size, repeats)
        ours_spawn = median_time(run_ranks_spawn, world_size, repeats)
        raw = median_time(raw_spawn, world_size, repeats)
        print(f"{world_size:>5}  {ours:>9.3f}s  {ours_spawn:>14.3f}s  {raw:>11.3f}s  {raw / ours:>12.1f}x"
              f"  {describe(world_size, backend='gloo')}")


if __name__ == "__main__":
    main()
