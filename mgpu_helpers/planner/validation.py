"""Holding the planner against real steps: each rank's measured peak beside ``plan()``.

    rows = validate(tied_frozen("tiny"), token_batch(4, 32, 512), loss_fn=lm_loss, model="tied+frozen",
                    methods=("ddp", "zero1", "fsdp2"), world_sizes=(2, 4))
    print(table(rows))

A *method* (:data:`METHODS`) is what torch runs, mapped to plan() options. Each rank's ``MemoryTracker`` is
entered before the model is built and measures the third step, the steady one ``plan()`` plans; on gloo each
collective returns once gloo's worker has let go of its tensors (``parallel.settled_collectives``). On the CPU
the two agree to the byte; ``allocator`` is what the CPU allocator saw beside them (gloo's copies, oneDNN's
scratch): it depends on the machine, and no plan promises it.
"""

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.profiler import record_function

from ..runtime.alloc_reference import AllocationReference
from ..runtime.launch import rank_device, run_ranks
from ..runtime.tracker import MemoryTracker
from .parallel import settled_collectives
from .trace import train_step

METHODS = {  # method: plan() options
    "ddp": dict(zero_stage=0),
    "zero1": dict(zero_stage=1),
    "fsdp2": dict(zero_stage=3, fsdp_units="blocks"),
    "fsdp2-root": dict(zero_stage=3, fsdp_units="root"),
}
STEPS = 3  # the measured step is the last


def mesh_of(device):
    return DeviceMesh(torch.device(device).type, list(range(dist.get_world_size())))


def wrap(model, method, precision="fp32", device="cpu", mesh=None, **options):
    """``(model, optimizer)`` as ``method`` wraps them on this rank (the model on ``device``); ``options``:
    plan()'s; ``mesh``: FSDP2's (default :func:`mesh_of` the device)."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    trainable = [p for p in model.parameters() if p.requires_grad]
    device = torch.device(device)
    if method in ("ddp", "zero1"):
        model = DDP(model, device_ids=[device.index or 0] if device.type == "cuda" else None,
                    gradient_as_bucket_view=options.get("gradient_as_bucket_view", False))
        if method == "ddp":
            return model, torch.optim.Adam(trainable, lr=1e-3, foreach=True)
        from torch.distributed.optim import ZeroRedundancyOptimizer
        return model, ZeroRedundancyOptimizer(trainable, optimizer_class=torch.optim.Adam, lr=1e-3, foreach=True)
    if method in ("fsdp2", "fsdp2-root"):
        from .fsdp import apply_fsdp  # the very code plan() runs on fake tensors
        fsdp = {k: v for k, v in options.items() if k in ("reshard_after_forward", "prefetch", "offload", "mp_policy")}
        apply_fsdp(model, mesh or mesh_of(device), precision=precision, fsdp_units=METHODS[method]["fsdp_units"],
                   **fsdp)
        return model, torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3, foreach=True)
    raise ValueError(f"method must be one of {list(METHODS)}, got {method!r}")


def _measure_rank(rank, world, model_fn, batch, loss_fn, method, precision, options):
    """This rank's steady step of ``method``: ``peak`` (the tracker's), ``start``/``start_prev`` (at the start
    of the last two steps), on the CPU ``allocator``."""
    torch.manual_seed(0)
    device = rank_device()
    x, y = (t.to(device) for t in batch)  # made before the tracker starts: not counted, as in plan()
    x = x.bfloat16() if precision == "bf16" and x.is_floating_point() else x
    step_precision = "fp32" if precision in ("fsdp-mixed", "bf16") else precision
    mesh = mesh_of(device) if method.startswith("fsdp2") else None  # its rank tensor: before the count, as plan()
    cpu = device.type == "cpu"
    ref = AllocationReference() if cpu else contextlib.nullcontext()
    with ref, settled_collectives() if cpu else contextlib.nullcontext(), MemoryTracker(device=device) as mt:
        with device:
            model = model_fn()
        if precision == "bf16":
            model = model.to(torch.bfloat16)
        model, opt = wrap(model, method, precision, device=device, mesh=mesh, **options)
        starts = []
        for i in range(STEPS):
            starts.append(mt.current_bytes)
            if i == STEPS - 1:
                mt.reset_peak()
            with record_function(f"step {i}"):
                train_step(model, opt, (x, y), loss_fn, precision=step_precision)
    out = {"peak": mt.peak_bytes, "start_prev": starts[-2], "start": starts[-1]}
    if cpu:
        out["allocator"] = ref.peak_in(f"step {STEPS - 1}")
    return out


def validate(model_fn, batch, *, loss_fn, model, methods=tuple(METHODS), world_sizes=(2, 4),
             precisions=("fp32",), **options):
    """Rows ``{model, method, world, precision, rank, measured, planned, error, steady, allocator, held}``
    (``error`` = planned / measured - 1, negative the dangerous direction; ``steady``: the same figure at the
    start of steps 2 and 3; ``held``: to the byte on the CPU, within 2% on a GPU, whose allocator rounds)."""
    from .budget import cublas_workspaces
    from .plans import plan
    rows = []
    for precision in precisions:
        for method in methods:
            if precision == "fsdp-mixed" and not method.startswith("fsdp2"):
                continue  # MixedPrecisionPolicy is FSDP2's
            for n in world_sizes:
                got = run_ranks(_measure_rank, n, model_fn, batch, loss_fn, method, precision, options, timeout=600)
                device = "cuda" if "allocator" not in got[0] else "cpu"
                p = plan(model_fn, batch, loss_fn=loss_fn, precision=precision, world_size=n, device=device,
                         **METHODS[method], **options)
                # On a GPU max_memory_allocated also holds cuBLAS's two workspaces (mgpu-plan's "alloc")
                hopper = device == "cuda" and torch.cuda.get_device_capability()[0] == 9
                extra = sum(cublas_workspaces("hopper" if hopper else "other")) if device == "cuda" else 0
                for r, m in enumerate(got):
                    planned = p.rank_peaks[r] + extra
                    error = planned / m["peak"] - 1
                    rows.append(dict(model=model, method=method, world=n, precision=precision, rank=r,
                                     measured=m["peak"], planned=planned, error=error,
                                     steady=m["start"] == m["start_prev"], allocator=m.get("allocator"),
                                     held=abs(error) <= (0.02 if device == "cuda" else 0.0)))
    return rows


def table(rows) -> str:
    """The rows as a fixed-width table, one line per rank (on the CPU, what the allocator saw beside them)."""
    alloc = any(r.get("allocator") is not None for r in rows)
    head = (f"{'model':<12} {'method':<10} {'layout':<14} {'N':>2} {'rank':>4} | {'measured B':>12} "
            f"{'planned B':>12} {'error':>7}" + (f" | {'CPU allocator B':>15}" if alloc else ""))
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['model']:<12} {r['method']:<10} {r['precision']:<14} {r['world']:>2} {r['rank']:>4} | "
                     f"{r['measured']:>12,} {r['planned']:>12,} {100 * r['error']:>+6.2f}%"
                     + (f" | {r['allocator']:>15,}" if alloc and r.get("allocator") is not None else "")
                     + ("" if r.get("steady", True) else "  (not steady)"))
    return "\n".join(lines)
