"""Notebook 12 -- communication hidden behind compute: each rank's ``torch.profiler`` trace of a step, in one
figure; ``overlap`` = (time both run) / (time communication runs). Communication: gloo's worker-thread ranges
(FSDP2's reduce-scatter shows as an all_reduce), or NCCL kernels; compute: ``COMPUTE`` ops, or other kernels."""
from collections import Counter

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile

from ..runtime.launch import rank_device
from ..runtime.alloc_reference import quiet_fd2
from .knobs import build

COMPUTE = ("aten::mm", "aten::addmm", "aten::gelu", "aten::gelu_backward")


def _length(spans) -> float:
    """The length of the union of (start, end) spans."""
    total, reach = 0.0, float("-inf")
    for a, b in sorted(spans):
        total += max(0.0, b - max(a, reach))
        reach = max(reach, b)
    return total


def overlap(compute, comm) -> float:
    """The fraction of communication time during which compute runs too (0 when nothing communicates)."""
    total = _length(comm)  # |X and Y| = |X| + |Y| - |X or Y|
    return (_length(compute) + total - _length([*compute, *comm])) / total if total else 0.0


def trace(rank, world_size, kind="fsdp", knobs=None, model_kw=None, warmup=2):
    """This rank's profiled step (``kind`` "fsdp": ``build(knobs)``; "ddp": under DDP): spans of ``compute`` and
    ``comm`` in ms from ``t0`` (the machine's clock), ``phases``, and the orders of issue (deterministic)."""
    ddp = (lambda model, mesh: DDP(model, bucket_cap_mb=0.25)) if kind == "ddp" else None
    step = build(knobs or {}, model_kw, shard_fn=ddp)[2]
    for _ in range(warmup):  # DDP rebuilds its buckets after the first step; FSDP2 makes its buffers
        step()
    cuda = rank_device().type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    dist.barrier()
    with quiet_fd2(), profile(activities=acts) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    events = list(prof.profiler.kineto_results.events())
    phases = {e.name()[3:-3]: (e.start_ns(), e.end_ns(), e.start_thread_id())
              for e in events if e.name().startswith("## ")}
    t0, main = phases["forward"][0], phases["forward"][2]
    ms = lambda t: (t - t0) / 1e6  # noqa: E731
    if cuda:
        kernels = [e for e in events if e.device_type() == torch.autograd.DeviceType.CUDA and e.end_ns() > 0]
        comm = [(ms(e.start_ns()), ms(e.end_ns()), e.name()[:40]) for e in kernels if "nccl" in e.name().lower()]
        compute = [(ms(e.start_ns()), ms(e.end_ns())) for e in kernels if "nccl" not in e.name().lower()]
    else:
        comm = [(ms(e.start_ns()), ms(e.end_ns()), e.name()) for e in events if e.name().startswith("gloo:")]
        compute = [(ms(e.start_ns()), ms(e.end_ns())) for e in events
                   if e.name() in COMPUTE and e.start_thread_id() == main]
    fwd = phases["forward"]
    order = "".join("G" if e.name().startswith("FSDP::all_gather (") else "m" for e in sorted(
        (e for e in events if e.start_thread_id() == main and fwd[0] <= e.start_ns() <= fwd[1]
         and (e.name() == "aten::addmm" or e.name().startswith("FSDP::all_gather ("))), key=lambda e: e.start_ns()))
    # Gradient reductions issued from the main thread while backward still had matmuls to run (the order of
    # issue, not a time: deterministic): DDP's bucket all-reduces, FSDP2's reduce-scatters.
    bwd = phases["backward"]
    on_main = [e for e in events if e.start_thread_id() == main and bwd[0] <= e.start_ns() <= bwd[1]]
    last_mm = max((e.start_ns() for e in on_main if e.name() in COMPUTE), default=bwd[0])
    reduces = [e.start_ns() for e in on_main if e.name().startswith("c10d::") and "reduce" in e.name()]
    early = sum(t < last_mm for t in reduces)
    return {"compute": compute, "comm": comm, "t0": t0, "forward_order": order,
            "reductions_before_last_backward_matmul": (early, len(reduces)),
            "phases": {k: (ms(a), ms(b)) for k, (a, b, _) in phases.items()}}


def summarize(traces) -> dict:
    """Per rank: communication time (on gloo with waits for the slower peer), overlap, step time, collectives."""
    out = []
    for tr in traces:
        comm = [(a, b) for a, b, _ in tr["comm"]]
        out.append({"comm_ms": _length(comm), "overlap": overlap(tr["compute"], comm),
                    "collectives": dict(Counter(n for *_, n in tr["comm"])),
                    "step_ms": tr["phases"]["optimizer"][1]})  # the whole step: what a speed-up is judged by
    return out


def plot(traces_by_label: dict, title="One training step on every rank: compute and communication"):
    """Per label (e.g. "DDP") and rank, compute (blue) above communication (orange), backward shaded."""
    import matplotlib.pyplot as plt

    rows = [(lab, r, tr) for lab, trs in traces_by_label.items() for r, tr in enumerate(trs)]
    fig, ax = plt.subplots(figsize=(11, 0.55 * len(rows) + 1.2))
    for i, (lab, r, tr) in enumerate(rows):
        shift = (tr["t0"] - min(t["t0"] for t in traces_by_label[lab])) / 1e6
        y = len(rows) - 1 - i
        ax.broken_barh([(a + shift, b - a) for a, b in tr["compute"]], (y + 0.05, 0.4), color="#4C72B0")
        ax.broken_barh([(a + shift, b - a) for a, b, _ in tr["comm"]], (y - 0.45, 0.4), color="#DD8452")
        a, b = tr["phases"]["backward"]
        ax.axvspan(a + shift, b + shift, ymin=(y - 0.5 + 0.5) / len(rows), ymax=(y + 0.5 + 0.5) / len(rows),
                   color="grey", alpha=0.12, lw=0)
    ax.set_yticks(range(len(rows)), [f"{lab}, rank {r}" for lab, r, _ in rows][::-1], fontsize=8)
    ax.set_xlabel("ms from the step's start (shaded: backward)")
    ax.set_title(title + "\nblue: compute (matmuls, GELU) · orange: collectives", fontsize=10)
    ax.set_ylim(-0.6, len(rows) - 0.4)
    ax.grid(axis="x", alpha=0.3)
    return fig
