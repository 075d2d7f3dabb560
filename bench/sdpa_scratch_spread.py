"""How much scratch CPU flash attention's backward takes, call after call, on identical inputs, three ways.

    PYTHONPATH=. python3 bench/sdpa_scratch_spread.py [--threads 16] [--calls 30] [--dtype bf16]
    ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 PYTHONPATH=. python3 bench/sdpa_scratch_spread.py   # a Zen 4's ISA

``_scaled_dot_product_flash_attention_for_cpu_backward`` allocates on its worker threads (a row-sum buffer
each, and oneDNN's bf16 gemm scratchpad per gemm call on AVX-512 bf16 / AMX), which the profiler does not
record: it sees them only in the running total its own thread's next event carries. Printed per call:
- ``profiler``: what the profiler's own events show (the most held inside the call less what it left) -- a draw
  (as AVX512_CORE_BF16 at 16 threads on a 2-core Xeon: 322,180 ... 540,548 B over 30 calls; AVX2: stable);
- ``every thread``: the same from c10's own log of every allocation on every thread
  (``runtime.every_thread``, which ``AllocationReference`` reads too): the real peak of that call, which
  depends on how the threads' gemms overlapped;
- ``planned``: what ``planner.kernels`` plans for the op (``every_thread_bound``: every thread holding at once
  the most one thread holds), which no call may exceed.
Threads may exceed the cores: the scratch depends on the thread count; how often it is reached, on the cores.
"""
import argparse

import torch
from torch.profiler import record_function

from mgpu_helpers.planner import kernels
from mgpu_helpers.runtime.alloc_reference import AllocationReference


def profiler_alone(ref, label):
    """The range's peak as the profiler's own events carry it (the reference before it read c10's log)."""
    start, end = ref._range(label, 0)
    own = [live for (t, live), (_, ptr) in zip(ref.timeline, ref._blocks) if start <= t <= end and ptr is not None]
    return max([ref._live_before(start)] + own)


def spread(a):
    torch.set_num_threads(a.threads)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    q, k, v = (torch.randn(*a.shape, dtype=dtype) for _ in range(3))
    out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
    grad = torch.randn_like(out)
    backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    args = (grad, q, k, v, out, lse, 0.0, True)
    planned = kernels.probe(backward, args)
    backward(*args)
    with AllocationReference() as ref:
        log = ref.every_thread
        for i in range(a.calls):
            log.mark(f"in{i}")
            with record_function(f"call{i}"):
                res = backward(*args)
            log.mark(f"out{i}")
            with record_function(f"after{i}"):
                pass
            del res
    seen = [profiler_alone(ref, f"call{i}") - ref.at(f"after{i}") for i in range(a.calls)]
    real = []
    for i in range(a.calls):
        ev = log.between(f"in{i}", f"out{i}")
        start = ev[0][1] - ev[0][0]
        left = sum(n for n, _ in ev)
        real.append(max(t for _, t in ev) - start - left)
    return planned, sorted(seen), sorted(real)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--shape", type=int, nargs=4, default=(4, 4, 32, 16), metavar=("B", "H", "S", "D"))
    a = ap.parse_args(argv)
    planned, seen, real = spread(a)
    print(f"{a.dtype} {tuple(a.shape)} threads={a.threads} cores={len(__import__('os').sched_getaffinity(0))} "
          f"cpu={torch.backends.cpu.get_cpu_capability()}: {a.calls} calls")
    for name, got in (("profiler", seen), ("every thread", real)):
        print(f"  {name:13s} {got[0]:>10,} ... {got[-1]:>10,} B  median {got[len(got) // 2]:>10,}  "
              f"max / planned {got[-1] / planned:.3f}")
    print(f"  {'planned':13s} {planned:>10,} B" + ("  EXCEEDED" if real[-1] > planned else ""))


if __name__ == "__main__":
    main()
