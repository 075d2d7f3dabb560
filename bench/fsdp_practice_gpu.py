"""Notebook 12 on GPUs: each knob's per-rank peak from the CUDA allocator beside the CPU profiler's figure for
the same step (rank 0 of N, fake process group), bytes all-gathered, and the overlap of communication with
compute from CUDA kernel traces (NCCL kernels vs the rest) for FSDP2 implicit / explicit prefetch and DDP.

    PYTHONPATH=. python3 bench/fsdp_practice_gpu.py [--world 2] [--rows 1024] [--d 1024]

Needs CUDA; with fewer GPUs than --world it uses what there is (NCCL needs one GPU per rank; with one GPU
only the memory columns are meaningful). Prints one table; nothing is asserted.
"""
from __future__ import annotations

import argparse
import sys

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--rows", type=int, default=1024, help="samples per rank for the overlap runs")
    ap.add_argument("--d", type=int, default=1024, help="model width (the notebook uses 128)")
    args = ap.parse_args()
    if torch.cuda.device_count() == 0:
        print("no CUDA device: this bench measures notebook 12's knobs on GPUs (run the notebook on a CPU)")
        return 0
    world = max(1, min(args.world, torch.cuda.device_count()))
    model_kw = {"d": args.d}

    from mgpu_helpers.fsdp_practice import knob_grid, measure
    from mgpu_helpers.fsdp_practice.timeline import summarize, trace
    from mgpu_helpers.runtime.launch import run_ranks
    from mgpu_helpers.runtime.fake_world import fake_world

    knobs = knob_grid(world) + [{"precision": "mp_policy"}, {"precision": "autocast"}, {"offload": True},
                                {"optimizer": "fused"}, {"save_on_cpu": True}]
    with fake_world(world):  # the CPU profiler's figure for rank 0 of `world`, before any CUDA use here
        cpu = [measure(0, world, k, model_kw, categories=False) for k in knobs]

    def on_gpus(rank, world_size):
        mem = [measure(rank, world_size, k, model_kw, categories=False) for k in knobs]
        runs = {"FSDP2 implicit": ("fsdp", {"rows": args.rows}),
                "FSDP2 prefetch 1": ("fsdp", {"rows": args.rows, "prefetch": 1}),
                "DDP buckets": ("ddp", {"rows": args.rows})}
        tl = {label: trace(rank, world_size, kind, k, model_kw) for label, (kind, k) in runs.items()}
        return mem, tl

    res = run_ranks(on_gpus, world, backend="nccl" if world > 1 else "auto", timeout=600)
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, {world} rank(s), d={args.d}")
    print(f"{'knobs':<58} {'CPU profiler':>13} {'CUDA rank 0':>13} {'ratio':>7} {'gathered':>11} {'GPU gathered':>13}")
    for k, c, g in zip(knobs, cpu, res[0][0]):
        print(f"{str(k):<58} {c['peak']:>13,} {g['peak']:>13,} {g['peak'] / c['peak']:>7.3f} {c['gathered']:>11,} "
              f"{g['gathered']:>13,}")
    print("overlap of communication with compute (CUDA kernels), per rank:")
    for label in res[0][1]:
        s = summarize([r[1][label] for r in res])
        print(f"  {label:<18}" + "  ".join(f"rank {i}: {x['comm_ms']:7.2f} ms comm, {x['overlap']:5.1%} overlapped"
                                         for i, x in enumerate(s)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
