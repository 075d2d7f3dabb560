"""Where a launch's time goes inside the ranks: start, first autograd step, collectives, point-to-point.

    PYTHONPATH=. python3 bench/rank_phases.py [--world 2 4]

For each world size, run_ranks (as a notebook would, after the caller ran a backward, and on CUDA machines
after the caller used the GPU) of a function that times, in every rank: a small MLP's first forward +
backward, its second one, 200 all_reduce calls of one float, and 50 send/recv round trips between
neighbours. Prints the wall time of the launch and each phase's slowest rank, so a slow machine shows
which part is slow (process start, autograd's first backward, gloo's transport). Wall times: a bench.
"""
import argparse
import time

import torch
import torch.distributed as dist

from mgpu_helpers.runtime.launch import run_ranks


def phases(rank, world_size):
    out, t = {}, time.perf_counter()
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    x = torch.randn(32, 64)
    for name in ("first_backward", "second_backward"):
        t = time.perf_counter()
        model(x).square().mean().backward()
        out[name] = time.perf_counter() - t
    one = torch.ones(1)
    t = time.perf_counter()
    for _ in range(200):
        dist.all_reduce(one)
    out["200_all_reduce"] = time.perf_counter() - t
    t = time.perf_counter()
    buf = torch.zeros(16)
    for _ in range(50):
        if rank % 2 == 0 and rank + 1 < world_size:
            dist.send(buf, rank + 1)
            dist.recv(buf, rank + 1)
        elif rank % 2 == 1:
            dist.recv(buf, rank - 1)
            dist.send(buf, rank - 1)
    out["50_send_recv"] = time.perf_counter() - t
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, nargs="+", default=[2, 4])
    a = ap.parse_args()
    m = torch.nn.Linear(8, 8)
    m(torch.randn(4, 8)).sum().backward()  # as a notebook kernel would have done
    if torch.cuda.is_available():
        torch.zeros(1, device="cuda")
    for w in a.world:
        for i in range(3):
            t = time.perf_counter()
            res = run_ranks(phases, w, timeout=120)
            wall = time.perf_counter() - t
            worst = {k: max(r[k] for r in res) for k in res[0]}
            print(f"world {w} launch {i}: wall {wall:6.2f} s | " +
                  " | ".join(f"{k} {v * 1000:8.1f} ms" for k, v in worst.items()), flush=True)


if __name__ == "__main__":
    main()
