"""What the planner plans: the memory layouts (precisions) and the methods torch runs at each ZeRO stage.

**Layouts** (:data:`LAYOUTS`): torch has no optimizer that runs ``zero-mixed``, so it is planned by rule
(:func:`zero_mixed`). Figures differ from DeepSpeed's, whose "ZeRO-1 on 8 ranks" is ``zero-mixed``: under
autocast the fp32 parameters *are* the master, so ZeRO-1 shards only Adam's 8 B/param.

**Methods** (:data:`METHOD`), as torch runs them, with torch's defaults: stage 0 ``DistributedDataParallel``;
stage 1 ``ZeroRedundancyOptimizer`` over DDP (whole parameters per rank, greedily: every rank is planned, the
worst reported); stage 2 the course's ZeRO-2 (notebook 08's ``Zero2``, by rule); stage 3 FSDP2 ``fully_shard``
per block + root (``planner.fsdp``: run, not ruled). ``world_size=1`` plans the unwrapped step at stages 0-2;
stage 3 runs FSDP2 even at one rank.
"""

import torch

LAYOUTS = {
    "fp32": "fp32 parameters, gradients and Adam state; fp32 compute",
    "bf16-autocast": "autocast(bf16) over fp32 parameters, gradients and Adam state (fp32 = master)",
    "fp16-autocast": "autocast(fp16) over fp32 parameters, gradients and Adam state (fp32 = master)",
    "bf16": "pure bf16: bf16 parameters, gradients and Adam state, no master copy",
    "fsdp-mixed": "FSDP2 MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) over fp32 sharded "
                  "parameters, gradients and Adam state; bf16 compute copies gathered per unit",
    "zero-mixed": "ZeRO paper: bf16 parameters and gradients, fp32 master + Adam moments (12 B/param, "
                  "sharded from stage 1); planned by rule from the bf16 trace",
}
METHOD = {0: "DDP", 1: "ZeroRedundancyOptimizer + DDP", 2: "course ZeRO-2 (rules)", 3: "FSDP2 fully_shard"}
_P, _G, _O, _A, _X = range(5)  # the tracker's CATEGORIES, in order
ZERO_STAGES = (0, 1, 2, 3)
OPTIONS = dict(gradient_as_bucket_view=False, fsdp_units="blocks", reshard_after_forward=None, prefetch=1,
               offload=False, mp_policy=None)  # torch's defaults (module docs)
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def check_args(zero_stage, world_size, precision, options):
    """plan()'s arguments, every one checked before anything is traced: one clear error naming the argument."""
    if zero_stage not in ZERO_STAGES or isinstance(zero_stage, bool):
        raise ValueError(f"zero_stage must be one of {ZERO_STAGES}, got {zero_stage!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if precision not in LAYOUTS:
        raise ValueError(f"precision must be one of {tuple(LAYOUTS)}, got {precision!r}")
    if unknown := set(options) - set(OPTIONS):
        raise TypeError(f"plan() got unknown option(s) {sorted(unknown)}; options: {sorted(OPTIONS)}")
    o = {**OPTIONS, **options}
    fsdp_only = [k for k in ("mp_policy", "offload") if o[k] not in (None, False)] \
        + (["precision='fsdp-mixed'"] if precision == "fsdp-mixed" else [])
    if zero_stage != 3 and fsdp_only:
        raise ValueError(f"{', '.join(fsdp_only)}: FSDP2's, so zero_stage must be 3, got {zero_stage}")
    if zero_stage == 3 and precision == "zero-mixed":
        raise ValueError("precision='zero-mixed' is planned by rule for stages 0-2; at zero_stage=3 plan FSDP2's "
                         "layouts ('fsdp-mixed', 'bf16', 'fp32', ...)")
    if o["fsdp_units"] not in ("blocks", "root"):
        raise ValueError(f"fsdp_units must be 'blocks' (each block of the largest nn.ModuleList, then the root) "
                         f"or 'root', got {o['fsdp_units']!r}")
    raf = o["reshard_after_forward"]
    if not (raf is None or isinstance(raf, bool) or (  # a bool first: 1 == True in Python, not to FSDP2
            isinstance(raf, int) and 1 < raf < world_size and world_size % raf == 0 and zero_stage == 3)):
        raise ValueError(f"reshard_after_forward must be None (FSDP2's default), True, False or an int that divides "
                         f"world_size={world_size}, other than 1 and world_size, got {raf!r}")
    if isinstance(o["prefetch"], bool) or not isinstance(o["prefetch"], int) or o["prefetch"] < 1:
        raise ValueError(f"prefetch must be an int >= 1 (1 = FSDP2's default), got {o['prefetch']!r}")
    mp = o["mp_policy"]
    if mp is not None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            dt = mp.get(name) if isinstance(mp, dict) else getattr(mp, name, None)
            if dt is not None and dt not in _FLOATS:
                raise ValueError(f"mp_policy.{name} must be None or one of {_FLOATS}, got {dt!r}")
        if isinstance(mp, dict):
            from torch.distributed.fsdp import MixedPrecisionPolicy
            o["mp_policy"] = MixedPrecisionPolicy(**mp)
    return o


def zero_partition(numels, world_size):
    """``ZeroRedundancyOptimizer._partition_parameters`` of one group: indices per rank, biggest first
    (stable), each to the first rank holding the fewest elements so far."""
    ranks, sizes = [[] for _ in range(world_size)], [0] * world_size
    for i in sorted(range(len(numels)), key=lambda i: -numels[i]):
        r = sizes.index(min(sizes))
        ranks[r].append(i)
        sizes[r] += numels[i]
    return ranks


def padded_bytes(sizes, n, block):
    return sum(-(-(-(-numel // n) * e) // block) * block for numel, e in sizes)


def model_state(trace, state_sizes, n=1):
    """Parameters, gradients and optimizer state of ``trace``'s step in ``n`` equal shards (1: whole), in
    allocator blocks."""
    grads = [(numel, trace.grad_bytes_per_elem) for numel, _ in trace.param_sizes]
    return {"parameters": padded_bytes(trace.param_sizes, n, trace.round_to),
            "gradients": padded_bytes(grads, n, trace.round_to),
            "optimizer": padded_bytes(state_sizes, n, trace.round_to)}


def zero_mixed(trace):
    """The ZeRO paper's layout from a pure-bf16 trace (a copy of the timeline): Adam's state becomes an
    fp32 master + two fp32 moments, 12 B/param instead of bf16's 2 + 2; foreach Adam's temporaries in the
    step run in fp32 (x2), beside an fp32 copy of each gradient (+4 B/param in the step)."""
    t = trace.timeline.to(torch.float64).clone()
    numel = sum(n for n, _ in trace.param_sizes)
    in_step = torch.tensor([ph == "step" for ph in trace.phases])
    t[:, _O] += 8 * numel
    t[in_step, _X] = 2 * t[in_step, _X] + 4 * numel
    return t, [(n, 12) for n, _ in trace.param_sizes]  # master + moments per parameter (step counters aside)


def rank_timeline(trace, zero_stage, world_size, rank, gradient_as_bucket_view=False):
    """One rank's timeline (float64 [samples, categories]) and model state at ZeRO ``zero_stage`` (0-2)
    over ``world_size`` ranks, by rule from the unsharded ``trace`` (module docs)."""
    layout = trace.config.get("layout", trace.config.get("precision"))
    t, state_sizes = zero_mixed(trace) if layout == "zero-mixed" else \
        (trace.timeline.to(torch.float64).clone(), trace.state_sizes)
    n, block, s = world_size, trace.round_to, zero_stage if world_size > 1 else -1
    full = model_state(trace, state_sizes)
    state = dict(full)
    in_step = torch.tensor([ph == "step" for ph in trace.phases])
    bwd = torch.tensor([ph.startswith("backward") for ph in trace.phases])
    if s in (0, 1):  # DDP's buckets: a flat copy of every gradient, from construction on
        buckets = padded_bytes([(sum(numel for numel, _ in trace.param_sizes), trace.grad_bytes_per_elem)], 1, block)
        if gradient_as_bucket_view:  # the gradients live in the buckets, all step; each new one autograd
            # makes is counted beside them until the next (an upper bound: the trace does not mark the add)
            made = torch.clamp(torch.diff(t[:, _G], prepend=t[:1, _G]), min=0) * bwd
            held = torch.zeros_like(made)
            for i in range(1, len(made)):
                held[i] = made[i] if made[i] > 0 else (held[i - 1] if bwd[i] else 0)
            t[:, _G] = buckets + held
            state["gradients"] = buckets
        else:
            t[:, _G] += buckets
            state["gradients"] += buckets
    if s == 1:  # ZeroRedundancyOptimizer: this rank's whole parameters' state, and its step
        mine = zero_partition([numel for numel, _ in trace.param_sizes], n)[rank]
        per_param = trace.param_state_sizes if layout != "zero-mixed" else [[sz] for sz in state_sizes]
        own = sum(padded_bytes(per_param[i], 1, block) for i in mine)
        own_p = padded_bytes([trace.param_sizes[i] for i in mine], 1, block)
        t[:, _O] -= full["optimizer"] - own
        t[in_step, _X] *= own_p / full["parameters"] if full["parameters"] else 1.0
        state["optimizer"] = own
    if s == 2:  # the course's ZeRO-2: state and gradients in equal flat shards
        part = model_state(trace, state_sizes, n)
        t[:, _O] *= part["optimizer"] / full["optimizer"] if full["optimizer"] else 1.0
        t[in_step, _X] *= part["parameters"] / full["parameters"] if full["parameters"] else 1.0
        g, r = t[:, _G].clone(), part["gradients"] / full["gradients"] if full["gradients"] else 1.0
        unit = -(-trace.unit_numel * trace.grad_bytes_per_elem // block) * block
        t[:, _G] = g * r  # in backward the unit being reduced is still whole (never more than made so far)
        t[bwd, _G] += torch.clamp(g[bwd] * (1 - r), max=unit)
        state["optimizer"], state["gradients"] = part["optimizer"], part["gradients"]
    state["total"] = sum(state.values())
    return t, state
