"""Wall time of run_ranks launches by start method: fork, forkserver (torch preloaded) and spawn.

Each launch starts the ranks, initialises a gloo process group, does one all_reduce (and, in the "cuda"
rows, ``torch.zeros(1, device="cuda")`` in every rank: CUDA initialised there), destroys the group and
returns. Every method runs in a fresh interpreter, so "first" includes what a kernel pays once (the
forkserver's start and its torch import); "later" are the launches after it. Where CUDA is available the
caller initialises CUDA and runs a backward first, as a notebook would, except for fork (fork after CUDA
initialisation is fatal; run_ranks never forks with a GPU visible).

    PYTHONPATH=. python3 bench/launch.py [--repeats 5]

Goal on a GPU machine: every later forkserver launch of 2 ranks <= 0.5 s, "cuda" rows included.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from mgpu_helpers.runtime.launch import describe, run_ranks

GOAL_S = 0.5


def one_all_reduce(rank, world_size, cuda):
    if cuda:
        torch.zeros(1, device="cuda")  # initialises CUDA in this rank
    t = torch.ones(4) * (rank + 1)
    dist.all_reduce(t)
    return t[0].item()


def series(method, cuda, repeats):
    """In a fresh interpreter: time the first and later launches for 2 and 4 ranks; one JSON line each."""
    os.environ["MGPU_START_METHOD"] = method
    if method != "fork" and torch.cuda.is_available():  # is_available() first would poison fork
        x = torch.ones(8, device="cuda", requires_grad=True)  # the caller used CUDA and autograd
        (x * 2).sum().backward()
        torch.cuda.synchronize()
    for world in (2, 4):
        times = []
        for _ in range(1 + repeats):
            t0 = time.perf_counter()
            out = run_ranks(one_all_reduce, world, cuda, backend="gloo", timeout=300)
            times.append(time.perf_counter() - t0)
            assert out == [world * (world + 1) / 2] * world, out
        print(json.dumps({"world": world, "first": times[0], "later": times[1:]}), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5, help="later launches per row (default 5)")
    ap.add_argument("--series", nargs=2, metavar=("METHOD", "CUDA"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.series:
        return series(a.series[0], a.series[1] == "cuda", a.repeats)
    cuda = torch.cuda.is_available()
    print(f"torch {torch.__version__}, {len(os.sched_getaffinity(0))} cores, load average "
          f"{os.getloadavg()[0]:.1f}, GPUs: {torch.cuda.device_count()}"
          f"{' (' + torch.cuda.get_device_name(0) + ')' if cuda else ''}; run_ranks(fn, 2) here: {describe(2)}")
    print(f"{'method':<11}{'rank work':<11}{'world':>5}{'first':>9}{'later median':>14}{'later max':>11}  goal")
    failed = False
    for method in ("fork", "forkserver", "spawn"):
        for work in (("none", "cuda") if cuda else ("none",)):
            cmd = [sys.executable, __file__, "--series", method, work, "--repeats", str(a.repeats)]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
            rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
            for r in rows:
                goal = ""
                if r["world"] == 2 and method == "forkserver":
                    ok = max(r["later"]) <= GOAL_S
                    goal = f"later <= {GOAL_S} s: {'yes' if ok else 'NO'}"
                    failed |= not ok
                print(f"{method:<11}{work:<11}{r['world']:>5}{r['first']:>8.2f}s"
                      f"{statistics.median(r['later']):>13.3f}s{max(r['later']):>10.3f}s  {goal}")
            if proc.returncode:
                failed = True
                print(f"{method:<11}{work:<11} failed (exit {proc.returncode}): "
                      f"{(proc.stderr.strip().splitlines() or ['?'])[-1][:200]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
