"""A CPU training step's peak three ways: planned, the profiler's, and every thread's (c10's own log).

    PYTHONPATH=. python3 bench/every_thread_step.py [--model decoder|mlp] [--threads 16] [--reps 5]
    ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 PYTHONPATH=. python3 bench/every_thread_step.py --threads 16

The step of tests/test_planner.py (bf16 autocast, checkpointing). The profiler (``AllocationReference``)
records the allocations of the thread that runs the step; blocks that kernels allocate on their worker
threads (flash attention's CPU kernels do, per gemm, on AVX-512 bf16 and AMX) it sees only in the total
its next event carries. ``runtime.every_thread`` reads c10's log of every allocation on every thread: the
step's real peak. Printed per rep: both peaks, and the plan beside them (``planner.kernels`` plans such
kernels with every thread holding its most at once).
"""
import argparse
import gc
import os
import sys

import torch
from torch.profiler import record_function

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from mgpu_helpers.planner import plan  # noqa: E402
from mgpu_helpers.planner.trace import apply_checkpointing, make_optimizer, train_step, warm_up  # noqa: E402
from mgpu_helpers.runtime.alloc_reference import AllocationReference  # noqa: E402
from mgpu_helpers.runtime.every_thread import EveryThreadAllocations  # noqa: E402


def one_step(model_fn, batch, loss_fn, precision, ckpt):
    torch.manual_seed(0)
    gc.collect()
    with AllocationReference() as ref, EveryThreadAllocations() as log:
        net = model_fn()
        if ckpt:
            apply_checkpointing(net)
        opt = make_optimizer(net)
        warm_up(net, opt)
        log.mark("in")
        with record_function("step"):
            train_step(net, opt, batch, loss_fn, precision=precision)
        log.mark("out")
        del net, opt
    ev = log.between("in", "out")
    start = ev[0][1] - ev[0][0]
    every = ref.at("step") + max(t for _, t in ev) - start
    return ref.peak_in("step"), every


def main(argv=None):
    from test_planner import MODELS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="decoder", choices=list(MODELS))
    ap.add_argument("--precision", default="bf16-autocast")
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    model_fn, batch, loss_fn = MODELS[a.model]
    p = plan(model_fn, batch, loss_fn=loss_fn, precision=a.precision, checkpointing=True, device="cpu")
    print(f"{a.model} {a.precision} ckpt threads={a.threads} cores={len(os.sched_getaffinity(0))} "
          f"ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', 'native')}: planned {p.peak_bytes:,} B")
    for r in range(a.reps):
        seen, every = one_step(model_fn, batch, loss_fn, a.precision, True)
        print(f"  rep {r}: profiler {seen:>10,} ({seen / p.peak_bytes - 1:+.2%})   every thread {every:>10,} "
              f"({every / p.peak_bytes - 1:+.2%})" + ("  OVER THE PLAN" if every > p.peak_bytes else ""))


if __name__ == "__main__":
    main()
