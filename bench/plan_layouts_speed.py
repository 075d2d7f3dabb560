"""How long the layout search takes, and its peak memory: Llama-3 70B and 405B over 50+ layouts each.

    python bench/plan_layouts_speed.py     # prints seconds and peak RSS (the budget: 60 s, 2 GiB, 2 cores)
"""
import resource
import time

from mgpu_helpers.planner.parallel import LLAMA3
from mgpu_helpers.planner.search import search

GRID = dict(gpus=(8, 16, 64, 128, 512), tp=(1, 2, 4, 8), pp=(1, 2, 4, 8), cp=(1, 2), dp_replicate=(1, 2),
            schedules=("gpipe", "1f1b", "interleaved"), checkpointing=(False, True), global_batch=(512,))


def main():
    t0 = time.perf_counter()
    for name in ("llama3-70b", "llama3-405b"):
        t = time.perf_counter()
        rows = search(LLAMA3[name], capacity=80 * 10**9, seq=8192, **GRID)
        print(f"{name}: {len(rows)} layouts, {sum(r['fits'] for r in rows)} fit 80 GB, "
              f"{time.perf_counter() - t:.3f} s")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux -> GiB
    print(f"total {time.perf_counter() - t0:.3f} s, peak RSS {rss:.3f} GiB (whole process, imports included)")


if __name__ == "__main__":
    main()
