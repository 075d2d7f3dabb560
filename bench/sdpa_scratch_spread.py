"""How much scratch CPU flash attention's backward takes, call after call, on identical inputs.

    PYTHONPATH=. python3 bench/sdpa_scratch_spread.py [--threads 16] [--calls 30] [--dtype bf16]
    ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 PYTHONPATH=. python3 bench/sdpa_scratch_spread.py   # a Zen 4's ISA

The planner probes each op's scratch once (``planner.kernels``: one warm call, one measured). For
``_scaled_dot_product_flash_attention_for_cpu_backward`` in bf16 at many threads on AVX-512 bf16 / AMX that one
figure is a draw: on a Xeon as AVX512_CORE_BF16 at 16 threads, 30 identical calls took 322,180 ... 431,496 B in
one run and 322,308 ... 540,548 B in the next (AVX2: 213,120 ... 213,248). Prints the sorted figures from the profiler's allocation record
(``AllocationReference``), the most held inside each call less what it left. Threads may exceed the cores:
the scratch depends on the thread count, not on the cores.
"""
import argparse

import torch
from torch.profiler import record_function

from mgpu_helpers.runtime.alloc_reference import AllocationReference


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--shape", type=int, nargs=4, default=(4, 4, 32, 16), metavar=("B", "H", "S", "D"))
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    q, k, v = (torch.randn(*a.shape, dtype=dtype) for _ in range(3))
    out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
    grad = torch.randn_like(out)
    backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    with AllocationReference() as ref:
        for i in range(a.calls):
            with record_function(f"call{i}"):
                res = backward(grad, q, k, v, out, lse, 0.0, True)
            with record_function(f"after{i}"):
                pass
            del res
    got = sorted(ref.peak_in(f"call{i}") - ref.at(f"after{i}") for i in range(a.calls))
    print(f"{a.dtype} {tuple(a.shape)} threads={a.threads} cpu={torch.backends.cpu.get_cpu_capability()}: "
          f"{a.calls} calls, scratch {got[0]:,} ... {got[-1]:,} B (max / min {got[-1] / max(got[0], 1):.2f})")
    print(got)


if __name__ == "__main__":
    main()
