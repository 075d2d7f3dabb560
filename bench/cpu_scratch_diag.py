"""Where a CPU plan and the profiler part: every op's kernel scratch, planned vs taken, in one step.

    PYTHONPATH=. python3 bench/cpu_scratch_diag.py [--model mlp|decoder] [--precision bf16-autocast]
                                                   [--ckpt] [--json OUT]

The planner adds, after each op's outputs, the scratch its kernel took when probed alone
(``planner.kernels``). This runs the planned step for real under the profiler's allocation record
(``AllocationReference``, which sees every byte) with a dispatch mode that brackets every op, so each op's
scratch in the real step (the most held inside it, less what it left) stands beside the planner's figure
for the same op. It prints the plan's peak against the profiler's, then each op whose two figures differ
(``--json``: both lists whole). Used for tests/test_planner.py's bf16 + checkpointing rows under
``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16`` (issue: CPU figures on every CPU).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from torch.profiler import record_function
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from mgpu_helpers.planner import accounting, plan  # noqa: E402
from mgpu_helpers.planner import kernels  # noqa: E402


class Bracket(TorchDispatchMode):
    """Each probed op inside a profiler range of its own, then a zero-length one: its scratch afterwards."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        i = len(self.ops)
        self.ops.append(func)
        with record_function(f"diag_op{i}"):
            out = func(*args, **(kwargs or {}))
        with record_function(f"diag_after{i}"):
            pass
        return out


def planned_ops(model_fn, batch, loss_fn, precision, ckpt):
    seen = []
    real = accounting.cpu_kernel_scratch

    def spy(func, args, kwargs):
        got = real(func, args, kwargs)
        seen.append((str(func), got))
        return got
    plan(model_fn, batch, loss_fn=loss_fn, precision=precision, checkpointing=ckpt, device="cpu")  # probes
    accounting.cpu_kernel_scratch = spy
    try:
        p = plan(model_fn, batch, loss_fn=loss_fn, precision=precision, checkpointing=ckpt, device="cpu")
    finally:
        accounting.cpu_kernel_scratch = real
    return p, seen


def measured_ops(model_fn, batch, loss_fn, precision, ckpt):
    from test_planner import profiled  # the reference tests/test_planner.py holds the plan against
    mode = Bracket()
    ref = profiled(model_fn, batch, loss_fn, precision, ckpt, mode=mode)
    every = [(str(func), max(0, ref.peak_in(f"diag_op{i}") - ref.at(f"diag_after{i}")), kernels.probed(func))
             for i, func in enumerate(mode.ops)]
    rows = [(name, got) for name, got, probed in every if probed]
    # where the real step peaks: the op whose range holds it, the live bytes as it began and its own scratch
    peak = ref.peak_in("step")
    at_peak = next((i for i in range(len(mode.ops)) if ref.peak_in(f"diag_op{i}") == peak), None)
    if at_peak is None:
        print(f"the step's peak {peak:,} lies between ops")
    else:
        print(f"the step's peak {peak:,} is inside op {at_peak} of {len(mode.ops)} ({mode.ops[at_peak]}): live as "
              f"it began {ref.at(f'diag_op{at_peak}'):,}, its scratch {every[at_peak][1]:,}")
    unprobed = [(i, name, got) for i, (name, got, probed) in enumerate(every) if not probed and got]
    print(f"ops the planner does not probe that took scratch in the real step: {len(unprobed)}")
    for i, name, got in unprobed[:40]:
        print(f"  op {i:4d} {name:50s} scratch {got:>9,}")
    return peak, rows


def main(argv=None):
    from test_planner import MODELS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mlp", choices=list(MODELS))
    ap.add_argument("--precision", default="bf16-autocast")
    ap.add_argument("--ckpt", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    model_fn, batch, loss_fn = MODELS[a.model]
    if a.precision == "bf16" and batch[0].is_floating_point():  # as the test: a pure-bf16 step takes bf16 inputs
        batch = (batch[0].bfloat16(), batch[1])
    p, planned = planned_ops(model_fn, batch, loss_fn, a.precision, a.ckpt)
    measured, real = measured_ops(model_fn, batch, loss_fn, a.precision, a.ckpt)
    print(f"{a.model} {a.precision}{' ckpt' if a.ckpt else ''} ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', 'native')} "
          f"threads={torch.get_num_threads()}: planned {p.peak_bytes:,} measured {measured:,} "
          f"({(p.peak_bytes / measured - 1) * 100:+.3f}%)")
    # walk both in order, matching op names from the end of the plan's list: the step is its last ops
    tail, diffs, j = planned[-len(real):], [], 0
    for name, got in real:
        while j < len(tail) and tail[j][0] != name:
            j += 1
        if j == len(tail):
            break
        if tail[j][1] != got:
            diffs.append((name, tail[j][1], got))
        j += 1
    print(f"ops in the real step: {len(real)}; planned ops with scratch: {sum(1 for _, s in planned if s)}; "
          f"real ops with scratch: {sum(1 for _, s in real if s)}; differing: {len(diffs)}")
    for name, want, got in diffs[:60]:
        print(f"  {name:50s} planned {want:>9,} taken {got:>9,}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(planned_peak=p.peak_bytes, measured=measured, planned=planned, real=real), f)


if __name__ == "__main__":
    main()
