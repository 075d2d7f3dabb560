"""Notebook 12 -- the model, ``fully_shard`` under each knob, and one steady step measured per rank
(``measure``; as rank 0 of N in a fake world: ``sweep``, ``knob_sweep``) with the instruments: the allocator's
live bytes (``profiled_peak``: it sees FSDP2's unsharded parameters, re-grown after ``resize_(0)``, which the
tracker misses) and the state by the tensors (``state_bytes``); and the planner on the same knobs (``plan_knobs``).
"""
import contextlib
import functools
import gc

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.nn import functional as F
from torch.profiler import record_function

from ..memory import make_batch, nbytes
from ..planner.parallel import forget_meshes
from ..runtime.alloc_reference import AllocationReference, quiet_fd2
from ..runtime.comm_log import CommLog
from ..runtime.fake_world import fake_world
from ..runtime.launch import rank_device
from ..runtime.precision import training_precision
from ..runtime.tracker import MemoryTracker

MODEL = {"d": 128, "blocks": 4, "d_in": 32, "classes": 10}  # the notebook's model: 4 units of 131,712 bytes
KNOBS = {"reshard_after_forward": True, "prefetch": 0, "precision": "fp32", "offload": False,  # the defaults
         "optimizer": "foreach", "save_on_cpu": False, "rows": 8, "async_unshard": False}


class Block(nn.Module):
    """A residual MLP block: one ``fully_shard`` unit."""

    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.up, self.down = nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


class Net(nn.Module):
    """``Linear(d_in, d)``, ``blocks`` × :class:`Block` (the units ``fully_shard`` wraps), ``Linear(d, classes)``."""

    def __init__(self, d=128, blocks=4, d_in=32, classes=10):
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.blocks = nn.ModuleList(Block(d, 2 * d) for _ in range(blocks))
        self.out = nn.Linear(d, classes)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def make_model(d=128, blocks=4, d_in=32, classes=10, seed=0, device=None) -> Net:
    """:class:`Net`, seeded, on ``device`` (default: this rank's)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Net(d, blocks, d_in, classes).to(device or rank_device())


def blocks(model) -> list[nn.Module]:
    return list(model.blocks)


def shard(model, mesh=None, *, reshard_after_forward=True, prefetch=0, mp_policy=None, offload_policy=None):
    """``fully_shard`` each block with the knobs, then the root (never resharded after forward: backward needs
    it at once). ``prefetch=k``: each block all-gathers the next k (in backward the previous k); 0: FSDP2's order."""
    if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0:
        raise ValueError(f"prefetch={prefetch!r}: the number of units to all-gather ahead, an int >= 0")
    # DTensor's caches hold the mesh of whoever filled them, equal to a new mesh of the same shape: a rank
    # forked from a kernel that ran a fake world would get that world's rank-0 mesh back from its ops
    forget_meshes()
    mesh = mesh or init_device_mesh(rank_device().type, (dist.get_world_size(),))
    kw = {"mesh": mesh, "mp_policy": mp_policy or MixedPrecisionPolicy(),
          "offload_policy": offload_policy or OffloadPolicy()}
    units = list(model.blocks)
    for b in units:
        fully_shard(b, reshard_after_forward=reshard_after_forward, **kw)
    fully_shard(model, **kw)
    for i, b in enumerate(units):  # prefetch 0 sets empty lists: FSDP2's default, its implicit order
        b.set_modules_to_forward_prefetch(units[i + 1:i + 1 + prefetch])
        b.set_modules_to_backward_prefetch(units[max(0, i - prefetch):i][::-1])
    return model


def build(knobs: dict, model_kw=None, seed=0, shard_fn=None):
    """(model, optimizer, step) on this rank for ``knobs`` (see ``KNOBS``); ``shard_fn(model, mesh)`` (12.1's
    policy) replaces :func:`shard` and its knobs. ``step(mark)`` calls ``mark("backward")`` after forward."""
    k = {**KNOBS, **knobs}
    if set(k) != set(KNOBS) or k["precision"] not in ("fp32", "mp_policy", "autocast") \
            or k["optimizer"] not in ("foreach", "fused"):
        raise ValueError(f"knobs {knobs}: known are {KNOBS}, precision fp32, mp_policy or autocast, optimizer "
                         "foreach or fused")
    mkw = {**MODEL, **(model_kw or {})}
    model = make_model(**mkw, seed=seed)
    half = training_precision(rank_device())  # bf16, or fp16 + GradScaler on a GPU without bf16 (a T4)
    mp = MixedPrecisionPolicy(param_dtype=half.dtype, reduce_dtype=torch.float32) \
        if k["precision"] == "mp_policy" else None
    if shard_fn is None:
        shard(model, reshard_after_forward=k["reshard_after_forward"], prefetch=k["prefetch"], mp_policy=mp,
              offload_policy=CPUOffloadPolicy(pin_memory=False) if k["offload"] else None)
    else:
        forget_meshes()
        model = shard_fn(model, init_device_mesh(rank_device().type, (dist.get_world_size(),))) or model
    if k["async_unshard"]:
        # FSDP2 waits for each all-gather where it is issued unless unshard is async (a private switch): on a
        # GPU that wait only orders streams, on a CPU (gloo) it blocks the one thread that computes
        model._set_unshard_async_op(True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, **{k["optimizer"]: True})
    world, rank = dist.get_world_size(), dist.get_rank()
    x, y = make_batch(k["rows"] * world, mkw["d_in"], mkw["classes"], seed + 1)
    x, y = x.tensor_split(world)[rank].to(rank_device()), y.tensor_split(world)[rank].to(rank_device())
    cast = torch.autocast(rank_device().type, half.dtype, enabled=k["precision"] == "autocast")
    hooks = torch.autograd.graph.save_on_cpu(pin_memory=False) if k["save_on_cpu"] else contextlib.nullcontext()
    # fp16 needs loss scaling: DTensor all-reduces the scaler's found_inf over the mesh (torch/distributed/
    # tensor/_dispatch.py, found_inf_reduce_handler), so every rank skips the same steps. Disabled, it passes through
    scaler = torch.amp.GradScaler(rank_device().type, enabled=half.needs_scaler and k["precision"] != "fp32")

    def step(mark=lambda phase: None):
        with record_function("## forward ##"), cast, hooks:
            loss = F.cross_entropy(model(x), y)
        mark("backward")
        with record_function("## backward ##"):
            scaler.scale(loss).backward()
        with record_function("## optimizer ##"):
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
        return loss.detach()
    return model, opt, step


def state_bytes(model, opt) -> dict[str, int]:
    """This rank's parameters, gradients and optimizer state, by the tensors themselves."""
    ps = list(model.parameters())
    return {"parameters": nbytes(ps), "gradients": nbytes(p.grad for p in ps),
            "optimizer_state": nbytes(v for s in opt.state.values() for v in s.values())}


@contextlib.contextmanager
def profiled_peak(baseline: int = 0):
    """``with profiled_peak(baseline) as r:``, then live bytes (``memory_allocated`` semantics, from the allocator
    or on a CPU ``AllocationReference``): ``r["peak"]``, ``r["end"]``, ``r["phases"]`` (the peak in each
    ``record_function("## name ##")``) and, on a CPU, ``r["compute"]`` (the most held as a matmul starts)."""
    r = {"peak": baseline, "end": baseline, "phases": {}, "compute": {}}
    # Collect now (FSDP2 modules sit in reference cycles) and not inside: an earlier tensor freed in the window
    # would count as a free at gc's whim, and the same code must give the same bytes on every run.
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        if rank_device().type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            at = torch.cuda.memory_allocated()
            yield r
            torch.cuda.synchronize()
            r["peak"] = baseline + torch.cuda.max_memory_allocated() - at
            r["end"] = baseline + torch.cuda.memory_allocated() - at
            return
        with quiet_fd2(), AllocationReference() as ref:  # C++ warns on fd 2 inside the window too
            yield r
    finally:
        if enabled:
            gc.enable()
    r["peak"], r["end"] = baseline + ref.peak_bytes, baseline + ref.final_bytes
    # the live total as each matmul starts: held *while computing*, not the transient all-gather copy-out peak
    mms = [a for op in ("aten::addmm", "aten::mm") for a, _ in ref.ranges.get(op, [])]
    for name, spans in ref.ranges.items():
        if name.startswith("## "):
            for a, b in spans:
                if inside := ref.events_in(a, b):
                    r["phases"][name[3:-3]] = max(r["phases"].get(name[3:-3], 0), baseline + max(inside))
                if at_mm := [ref.live_at(t, inclusive=True) for t in mms if a <= t <= b]:
                    r["compute"][name[3:-3]] = max(r["compute"].get(name[3:-3], 0), baseline + max(at_mm))


def measure(rank, world_size, knobs=None, model_kw=None, categories=True, seed=0, shard_fn=None, keep=False):
    """This rank's figures for one steady step under ``knobs``: ``state`` (held after it), :func:`profiled_peak`'s,
    ``comm``, ``gathered``, ``forward_order``; ``categories``: the tracker's too (slower); ``keep``: ``model``."""
    model, opt, step = build(knobs or {}, model_kw, seed, shard_fn)
    step()  # warm-up: Adam makes its state, FSDP2 its buffers
    base = sum(state_bytes(model, opt).values())
    marks, tracker = {}, MemoryTracker(model, opt) if categories else contextlib.nullcontext()
    with CommLog() as comm, profiled_peak(base) as prof, tracker as mt:
        step(lambda phase: marks.setdefault(phase, len(comm.order)))
    out = {"tracker_peak": mt.peak_bytes, "tracker_peak_breakdown": mt.peak_breakdown()} if categories else {}
    if keep:
        out["model"] = model
    return {"state": state_bytes(model, opt), "peak": prof["peak"], "phases": prof["phases"],
            "compute": prof["compute"], **out,
            "comm": comm.summary(), "gathered": comm.gathered, "forward_order": comm.order[:marks["backward"]]}


def accumulation(rank, world_size, micro_batches=4, sync_each=True, rows=8, seed=0) -> dict:
    """One optimizer step over ``micro_batches`` per rank. ``sync_each`` (torchtitan's way): every backward
    reduce-scatters and reshards; ``False``: only the last, so unsharded parameters and gradients stay."""
    model, opt, _ = build({}, seed=seed)
    x, y = make_batch(rows * micro_batches * world_size, MODEL["d_in"], MODEL["classes"], seed + 1)
    x, y = x.tensor_split(world_size)[rank].to(rank_device()), y.tensor_split(world_size)[rank].to(rank_device())
    per_micro = []

    def step():
        per_micro.clear()
        for i, (xm, ym) in enumerate(zip(x.chunk(micro_batches), y.chunk(micro_batches))):
            last = i == micro_batches - 1
            if not sync_each:
                model.set_requires_gradient_sync(last)
                model.set_reshard_after_backward(last)
            with CommLog() as comm:
                (F.cross_entropy(model(xm), ym) / micro_batches).backward()
            per_micro.append(comm.counts)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up
    with CommLog() as comm, profiled_peak(sum(state_bytes(model, opt).values())) as prof:
        step()
    reduced = sum(i for op, _, i, _ in comm.calls if op == "reduce_scatter")
    return {"peak": prof["peak"], "gathered": comm.gathered, "reduced": reduced, "per_micro": list(per_micro)}


def sweep(world_size: int, options: list[dict], model_kw=None) -> list[dict]:
    """:func:`measure` per knob dict in ``options`` as rank 0 of a fake world: rows ``{**knobs, peak,
    forward_compute`` (held while the forward computes), ``gathered, forward_order}``."""
    rows = []
    with fake_world(world_size):
        for o in options:
            m = measure(0, world_size, o, model_kw, categories=False)
            rows.append({**o, "peak": m["peak"], "forward_compute": m["compute"].get("forward", 0),
                         "gathered": m["gathered"], "forward_order": m["forward_order"]})
    return rows


def knob_grid(world_size: int) -> list[dict]:
    """reshard_after_forward True / 2 (an even world above 2) / False, with prefetch 0, 1 and 2 (not with False)."""
    ints = [2] if world_size > 2 and world_size % 2 == 0 else []
    return [{"reshard_after_forward": r, "prefetch": p} for r in [True, *ints, False]
            for p in ((0, 1) if r is False else (0, 1, 2))]


def budgets(rows) -> dict:
    """Exercise 12.1's budgets from a :func:`knob_sweep` table: midway between the second- and third-lowest
    distinct figures of a column, so that some rows fit, some miss, none sits on it."""
    def mid(xs):
        xs = sorted(set(xs))
        return (xs[1] + xs[2]) // 2
    return {"memory": mid(r["peak"] for r in rows), "communication": mid(r["gathered"] for r in rows)}


@functools.lru_cache(maxsize=None)
def _knob_sweep(world_size: int, blocks: int) -> tuple:
    return tuple(sweep(world_size, knob_grid(world_size), {"blocks": blocks}))


def knob_sweep(world_size: int = 4, blocks: int = 4) -> list[dict]:
    """:func:`sweep` over :func:`knob_grid`, measured once per process and handed out as fresh copies."""
    return [dict(r) for r in _knob_sweep(world_size, blocks)]


def plan_knobs(world_size: int, knobs: dict, model_kw=None):
    """``planner.plan``'s :class:`~mgpu_helpers.planner.Plan` of :func:`measure`'s step under ``knobs``. The knobs
    map one to one but prefetch: the planner's 1 is FSDP2's default order (0 here); k > 1 is explicit."""
    from ..planner import plan

    k = {**KNOBS, **knobs}
    if set(knobs) - {"reshard_after_forward", "prefetch", "precision", "offload", "rows"}:
        raise ValueError(f"knobs {knobs}: the planner plans reshard_after_forward (True, False, an int), "
                         "prefetch, precision, offload")
    mkw = {**MODEL, **(model_kw or {})}
    batch = make_batch(k["rows"], mkw["d_in"], mkw["classes"], 1)  # only shapes and dtypes are used
    return plan(functools.partial(Net, **mkw), batch, loss_fn=F.cross_entropy, optimizer="adam",
                precision={"fp32": "fp32", "mp_policy": "fsdp-mixed", "autocast": "bf16-autocast"}[k["precision"]],
                zero_stage=3, world_size=world_size, device="cpu",
                reshard_after_forward=k["reshard_after_forward"], prefetch=k["prefetch"] or 1,
                offload=k["offload"])


def _demo(rank, world_size):
    lines = [f"rank {rank} of {world_size}: knobs -> peak bytes, bytes all-gathered"]
    for knobs in knob_grid(world_size) + [{"precision": "mp_policy"}, {"precision": "autocast"}, {"offload": True},
                              {"optimizer": "fused"}]:
        m = measure(rank, world_size, knobs)
        lines.append(f"  {knobs}: peak {m['peak']}, gathered {m['gathered']}")
    return "\n".join(lines)

