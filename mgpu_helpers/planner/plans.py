"""The plan: per-rank memory of a training step before anything is allocated (``planner.plan``).

The step is ``train_step`` from the steady state (optimizer state made, gradients None), counted as
``MemoryTracker`` counts it from before the model is built, one rank's batch excepted. Stages 0-2 take each
rank's timeline by rule from one unsharded trace (``planner.layouts``); stage 3 runs FSDP2 (``planner.fsdp``).
"""

from dataclasses import dataclass, replace

import torch

from ..runtime.tracker import CATEGORIES, MemoryTracker
from .layouts import LAYOUTS, METHOD, check_args, model_state, rank_timeline
from .trace import Trace, apply_checkpointing, check_step_args, make_optimizer, trace_step, train_step, warm_up

@dataclass(frozen=True)
class Plan:
    """Per-rank memory of one training step (bytes): the worst rank's (``worst_rank``) figures, every rank's
    peak (``rank_peaks``), the memory layout (:data:`LAYOUTS`) and the ``method`` torch runs."""
    peak_bytes: int
    breakdown: dict        # by the tracker's CATEGORIES at the peak; sums to peak_bytes
    model_state: dict      # parameters, gradients, optimizer, total: what the rank keeps between steps
    peak_phase: str        # where the step peaks ("forward", "backward 2", "step", ...)
    config: dict           # precision, zero_stage, world_size, micro_batches, checkpointing, optimizer, options
    n_params: int
    layout: str = "fp32"
    method: str = "DDP"
    rank_peaks: tuple = ()
    worst_rank: int = 0

    @property
    def device_bytes(self) -> int:
        """What one rank's (Hopper) GPU must hold (``planner.budget``'s total), to compare with a capacity."""
        from .budget import budget
        return budget(self.peak_bytes, world_size=self.config["world_size"]).total

    @property
    def step_cost(self) -> float:
        return step_cost(**{k: self.config[k] for k in ("world_size", "zero_stage", "checkpointing", "micro_batches")})

    @property
    def layout_description(self) -> str:
        return LAYOUTS.get(self.layout, "FSDP2 MixedPrecisionPolicy over fp32 sharded parameters: " + self.layout)


def step_cost(*, world_size: int, zero_stage: int, checkpointing: bool, micro_batches: int) -> float:
    """The course's stated rule for the relative time of one step (1.0 = plain step on one device):
    checkpointing recomputes the forward: +1/3; each extra micro-batch: +0.1; on several ranks +0.02 per
    ZeRO stage, and +0.5 for ZeRO-3's second all-gather in backward. Relative, not a prediction of seconds."""
    cost = 1 + checkpointing / 3 + 0.1 * (micro_batches - 1)
    if world_size > 1:
        cost += 0.02 * zero_stage + 0.5 * (zero_stage == 3)
    return round(cost, 6)


def _from_timeline(t, state, phases, config, n_params, layout, method):
    t = t.round().to(torch.int64)
    totals = t.sum(1)
    i = int(torch.argmax(totals))  # the first sample at the peak
    return Plan(peak_bytes=int(totals[i]), breakdown={c: int(v) for c, v in zip(CATEGORIES, t[i])},
                model_state=state, peak_phase=phases[i], config=config, n_params=n_params, layout=layout,
                method=method)


def _worst(plans):
    peaks = tuple(p.peak_bytes for p in plans)
    r = max(range(len(peaks)), key=peaks.__getitem__)
    return replace(plans[r], rank_peaks=peaks, worst_rank=r)


def _fsdp_plan(trace_kw, world_size, options, config, layout):
    """ZeRO-3: FSDP2 run on fake tensors, one trace per group of ranks with equal shards (planner.fsdp)."""
    from .fsdp import rank_groups
    fsdp = {k: options[k] for k in ("fsdp_units", "reshard_after_forward", "prefetch", "offload", "mp_policy")}
    per_rank = [None] * world_size
    for ranks in rank_groups(trace_kw["model_fn"], world_size, fsdp["fsdp_units"], fsdp["reshard_after_forward"]):
        tr = trace_step(**trace_kw, fsdp=dict(fsdp, world_size=world_size, rank=ranks[0]))
        state = model_state(tr, tr.state_sizes)
        state["total"] = sum(state.values())
        p = _from_timeline(tr.timeline.to(torch.float64), state, tr.phases, config, tr.n_params, layout,
                           f"{METHOD[3]} ({'per block + root' if fsdp['fsdp_units'] == 'blocks' else 'root only'})")
        for r in ranks:
            per_rank[r] = p
    return _worst(per_rank)


def plan_from_trace(trace: Trace, zero_stage: int = 0, world_size: int = 1, **options) -> Plan:
    """The plan for ZeRO ``zero_stage`` on ``world_size`` ranks from an unsharded trace (stage 3: FSDP2 run,
    cached per trace); ``options``: :data:`OPTIONS` (plan()'s docs)."""
    layout = trace.config.get("layout", trace.config["precision"])
    o = check_args(zero_stage, world_size, layout, options)
    mp = o["mp_policy"]
    if mp is not None:  # a policy names the layout: FSDP2's mixed precision, or its own dtypes
        layout = ("fsdp-mixed" if (mp.param_dtype, mp.reduce_dtype) == (torch.bfloat16, torch.float32) else
                  f"fsdp-mp(param={mp.param_dtype}, reduce={mp.reduce_dtype})".replace("torch.", ""))
    config = dict(trace.config, zero_stage=zero_stage, world_size=world_size,
                  **{k: v for k, v in o.items() if k != "mp_policy"})
    if zero_stage == 3:
        key = (world_size, tuple((k, repr(v)) for k, v in sorted(o.items())))
        if key not in trace.fsdp_plans:  # FSDP2 runs once per trace, world size and options
            trace.fsdp_plans[key] = _fsdp_plan(trace.source, world_size, o, config, layout)
        return trace.fsdp_plans[key]
    method = METHOD[zero_stage] if world_size > 1 else "one device, unwrapped"
    plans = [_from_timeline(*rank_timeline(trace, zero_stage, world_size, r, o["gradient_as_bucket_view"]),
                            trace.phases, config, trace.n_params, layout, method)
             for r in (range(world_size) if zero_stage == 1 and world_size > 1 else [0])]  # stage 1: ranks differ
    return _worst(plans * world_size if len(plans) == 1 else plans)


def plan(model_fn, batch, *, loss_fn, optimizer="adam", precision="fp32", zero_stage=0, world_size=1,
         micro_batches=1, checkpointing=False, device=None, round_to=None, **options) -> Plan:
    """Per-rank memory of one steady-state training step of ``model_fn()`` on ``batch`` (module docs).
    ``model_fn()`` builds the model when called (under ``FakeTensorMode``: nothing real is allocated);
    ``batch = (inputs, targets)``: only shapes and dtypes are read. ``device`` (default "cuda" if available);
    ``round_to``: the allocator's block (default 512 on CUDA, 1 on the CPU); ``precision``: one of :data:`LAYOUTS`.

    Options (:data:`OPTIONS`, torch's defaults): ``gradient_as_bucket_view=False`` (DDP, stages 0-1: False
    keeps a second copy of the gradients in the buckets); ``fsdp_units="blocks"`` (stage 3: ``fully_shard``
    each block of the largest ``nn.ModuleList``, then the root; ``"root"``: the root alone);
    ``reshard_after_forward=None`` (FSDP2's default; True/False for every unit; an int k, a divisor of
    ``world_size`` other than 1 and itself, reshards each block to k ranks after forward, e.g. one node's);
    ``prefetch=1`` (units all-gathered ahead); ``mp_policy=None`` (a ``MixedPrecisionPolicy`` or its keyword
    dict); ``offload=False`` (``CPUOffloadPolicy``: on a CPU plan host and device memory are one, summed)."""
    o = check_args(zero_stage, world_size, precision, options)  # before tracing: fail fast, nothing half-done
    check_step_args(model_fn, loss_fn, optimizer, micro_batches)
    trace_kw = dict(model_fn=model_fn, batch=batch, loss_fn=loss_fn, optimizer=optimizer, precision=precision,
                    micro_batches=micro_batches, checkpointing=checkpointing, device=device, round_to=round_to)
    if zero_stage == 3:  # no unsharded trace: FSDP2 runs from trace_kw (plan_from_trace)
        trace = Trace(config=dict(optimizer=optimizer, precision=precision, micro_batches=micro_batches,
                                  checkpointing=checkpointing, device=device, layout=precision), source=trace_kw)
    else:
        trace = trace_step(**trace_kw)
    return plan_from_trace(trace, zero_stage, world_size, **o)


def measure_step(model_fn, batch, *, loss_fn, precision="fp32", checkpointing=False, micro_batches=1,
                 optimizer="adam", seed=0) -> tuple[int, dict]:
    """The same step for real, under ``MemoryTracker`` on this machine's CPU (or the model's device):
    ``(peak_bytes, peak_breakdown)`` -- what :func:`plan` predicts with ``device="cpu"``."""
    torch.manual_seed(seed)
    model = model_fn()
    if precision == "bf16":
        model = model.to(torch.bfloat16)
        batch = tuple(t.bfloat16() if t.is_floating_point() else t for t in batch)
    if checkpointing:
        apply_checkpointing(model)
    opt = make_optimizer(model, optimizer)
    warm_up(model, opt)
    with MemoryTracker(model, opt) as mt:
        train_step(model, opt, batch, loss_fn, precision=precision, micro_batches=micro_batches, mark=mt.mark)
    return mt.peak_bytes, mt.peak_breakdown()
