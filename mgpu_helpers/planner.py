"""Notebook 11 -- the memory planner: per-rank memory of a training step before anything is allocated.

    plan(model_fn, batch, loss_fn=..., precision="bf16-autocast", zero_stage=3, world_size=8)

traces one steady-state step of ``model_fn()`` under fake tensors (``planner_trace``: the course's
tracker over fake storages, so at world size 1 it *is* the tracker's figure for that step) and derives
the ZeRO-sharded figures from that one unsharded trace (:meth:`Trace.shard`). ``model_state_bytes`` is
notebook 08's closed form, re-exported; ``decoder`` builds Llama-shaped models; check 11.1.

**The step** (``planner_trace.train_step``): optimizer state already made, gradients None; per
micro-batch ``loss_fn(model(x), y) / micro_batches`` and backward; ``opt.step()``; ``zero_grad``.
Counted from before the model was built: parameters, gradients, optimizer state, activations,
temporaries; not the batch (it exists before the model), not kernels' scratch (cuBLAS workspace).
``batch`` is one rank's batch. Optimizers: foreach ``Adam(lr=1e-3)``, ``SGD`` with or without momentum.

**Sharding** (ZeRO stage s over N ranks), applied to every sample of the traced timeline, then the peak
taken again (it moves: unsharded, a 7B step peaks in Adam's step; sharded, in backward):
  * s >= 1: optimizer state, and the step's temporaries (foreach Adam makes them per parameter), 1/N;
  * s >= 2: gradients 1/N, plus during backward one unit's full gradients (before its reduce-scatter;
    at most the gradients made so far);
  * s == 3: parameters 1/N, plus one unit's full parameters during forward and backward (all-gathered).
Each tensor is split into N equal flat shards (``ceil(numel / N)`` elements, padded as ZeRO does), each
rounded to the allocator's block. A *unit* is what FSDP2 gathers at once, assumed to be one block of the
model's largest ``nn.ModuleList`` or, when larger, everything outside the blocks (embeddings, head):
one unit at a time (no prefetch: FSDP2's default prefetches one more unit, add one unit for it).
Not modelled: communication buffers beyond one unit, DDP's gradient buckets at stage 0 (as with
``gradient_as_bucket_view=True``), fragmentation. At world size 1 every stage equals the trace.
"""
from __future__ import annotations

import functools
import random
from dataclasses import dataclass

import torch

from .sharding import model_state_bytes  # noqa: F401  notebook 08's closed form, the planner's reference
from .planner_models import SIZES, Decoder, decoder, lm_loss, token_batch  # noqa: F401
from .planner_trace import (PRECISIONS, OPTIMIZERS, Trace, apply_checkpointing, make_optimizer, trace_step,  # noqa: F401
                            train_step, warm_up)
from .checks import REGISTRY, describe_value, expect, expect_equal
from .checks.remember import RemembersVerdict
from .runtime.tracker import CATEGORIES, MemoryTracker

__all__ = ["plan", "Plan", "model_state_bytes", "trace_step", "train_step", "decoder", "step_cost",
           "PRECISIONS", "ZERO_STAGES"]
ZERO_STAGES = (0, 1, 2, 3)
_P, _G, _O, _A, _X = range(len(CATEGORIES))
CLOSED_FORM_PRECISION = {"fp32": "fp32", "bf16-autocast": "fp32", "fp16-autocast": "fp32", "bf16": "bf16"}


# --- plans -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Plan:
    """Per-rank memory of one training step under a strategy (all figures in bytes)."""
    peak_bytes: int
    breakdown: dict        # by the tracker's CATEGORIES at the peak; sums to peak_bytes
    model_state: dict      # parameters, gradients, optimizer, total: what the rank keeps between steps
    peak_phase: str        # where the step peaks ("forward", "backward 2", "step", ...)
    config: dict           # precision, zero_stage, world_size, micro_batches, checkpointing, optimizer
    n_params: int

    def fits(self, budget_bytes: int) -> bool:
        return self.peak_bytes <= budget_bytes

    @property
    def step_cost(self) -> float:
        return step_cost(**{k: self.config[k] for k in ("world_size", "zero_stage", "checkpointing",
                                                        "micro_batches")})


def step_cost(*, world_size: int, zero_stage: int, checkpointing: bool, micro_batches: int) -> float:
    """The course's stated rule for the relative time of one step (1.0 = plain step on one device):
    checkpointing recomputes the forward (a third of a step): +1/3; each extra micro-batch runs smaller,
    less efficient kernels and its own launches: +0.1; on several ranks ZeRO-1/2 move as many bytes as
    DDP (2x the parameters per step) but each stage's bookkeeping costs +0.02, and ZeRO-3 all-gathers the
    parameters again in backward (3x: +0.5). Relative, not a prediction of seconds."""
    cost = 1 + checkpointing / 3 + 0.1 * (micro_batches - 1)
    if world_size > 1:
        cost += 0.02 * zero_stage + 0.5 * (zero_stage == 3)
    return round(cost, 6)


def _bytes(sizes, n, block):
    return sum(-(-(-(-numel // n) * e) // block) * block for numel, e in sizes)


def shard(trace: Trace, zero_stage: int = 0, world_size: int = 1) -> Plan:
    """The per-rank plan for ZeRO ``zero_stage`` on ``world_size`` ranks, from an unsharded trace."""
    if zero_stage not in ZERO_STAGES or isinstance(zero_stage, bool):
        raise ValueError(f"zero_stage must be one of {ZERO_STAGES}, got {zero_stage!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    s, n, block = zero_stage if world_size > 1 else 0, world_size, trace.round_to
    grads = [(numel, trace.grad_bytes_per_elem) for numel, _ in trace.param_sizes]
    full = {"p": _bytes(trace.param_sizes, 1, block), "g": _bytes(grads, 1, block),
            "o": _bytes(trace.state_sizes, 1, block)}
    part = {"p": _bytes(trace.param_sizes, n, block), "g": _bytes(grads, n, block),
            "o": _bytes(trace.state_sizes, n, block)}
    t = trace.timeline.to(torch.float64).clone()
    in_step = torch.tensor([ph == "step" for ph in trace.phases])
    fwd = torch.tensor([ph.startswith("forward") for ph in trace.phases])
    bwd = torch.tensor([ph.startswith("backward") for ph in trace.phases])
    unit = lambda e: -(-trace.unit_numel * e // block) * block  # noqa: E731
    if s >= 1:
        ratio = part["o"] / full["o"] if full["o"] else 1.0
        t[:, _O] *= ratio
        t[in_step, _X] *= part["p"] / full["p"] if full["p"] else 1.0
    if s >= 2:
        g, r = t[:, _G].clone(), part["g"] / full["g"] if full["g"] else 1.0
        t[:, _G] = g * r  # in backward, the unit being reduced is still whole (never more than made so far)
        t[bwd, _G] += torch.clamp(g[bwd] * (1 - r), max=unit(trace.grad_bytes_per_elem))
    if s >= 3:
        t[:, _P] -= full["p"] - part["p"]
        t[fwd | bwd, _P] += unit(trace.param_sizes[0][1] if trace.param_sizes else 4)
    t = t.round().to(torch.int64)
    totals = t.sum(1)
    i = int(torch.argmax(totals))  # the first sample at the peak
    state = {"parameters": part["p"] if s >= 3 else full["p"], "gradients": part["g"] if s >= 2 else full["g"],
             "optimizer": part["o"] if s >= 1 else full["o"]}
    state["total"] = sum(state.values())
    return Plan(peak_bytes=int(totals[i]), breakdown={c: int(v) for c, v in zip(CATEGORIES, t[i])},
                model_state=state, peak_phase=trace.phases[i],
                config=dict(trace.config, zero_stage=zero_stage, world_size=world_size), n_params=trace.n_params)


Trace.shard = shard


def plan(model_fn, batch, *, loss_fn, optimizer="adam", precision="fp32", zero_stage=0, world_size=1,
         micro_batches=1, checkpointing=False, device=None, round_to=None) -> Plan:
    """Per-rank memory of one steady-state training step of ``model_fn()`` on ``batch`` (module docs).

    ``model_fn()`` builds the model; the planner calls it under ``FakeTensorMode`` (or it may build on the
    meta device), so nothing real is allocated. ``batch = (inputs, targets)``: only shapes and dtypes are
    used (real or meta tensors). ``device``: where to plan (default: "cuda" if available, else "cpu");
    ``round_to``: allocator block (default 512 on CUDA, 1 -- exact bytes -- on the CPU, as the tracker)."""
    if zero_stage not in ZERO_STAGES or isinstance(zero_stage, bool):  # before tracing: fail fast
        raise ValueError(f"zero_stage must be one of {ZERO_STAGES}, got {zero_stage!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    trace = trace_step(model_fn, batch, loss_fn=loss_fn, optimizer=optimizer, precision=precision,
                       micro_batches=micro_batches, checkpointing=checkpointing, device=device, round_to=round_to)
    return trace.shard(zero_stage, world_size)


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

# --- exercise 11.1: the cheapest plan that fits ----------------------------------------------------

CHECK_MODEL, CHECK_BATCH = "tiny", (8, 64)  # (batch size, sequence length) of the check's plans
CHECK_GRID = dict(world_size=(1, 2, 4, 8), zero_stage=ZERO_STAGES, checkpointing=(False, True),
                  micro_batches=(1, 2))


@functools.lru_cache(maxsize=None)
def cached_trace(size, batch_size, seq_len, precision="bf16-autocast", checkpointing=False, micro_batches=1):
    """One trace per (model, batch, precision, checkpointing, micro-batches); sharding reuses it."""
    vocab = SIZES[size][0]
    return trace_step(decoder(size), token_batch(batch_size, seq_len, vocab), loss_fn=lm_loss,
                      precision=precision, checkpointing=checkpointing, micro_batches=micro_batches,
                      device="cpu", round_to=512)


def candidate_plans(size=CHECK_MODEL, batch=CHECK_BATCH, precision="bf16-autocast", **grid) -> list[Plan]:
    """Every plan of the grid (:data:`CHECK_GRID`, entries replaced by keyword) for a decoder of
    ``size``; at world size 1 only stage 0 (at one rank there is nothing to shard)."""
    g = {**CHECK_GRID, **grid}
    return list(_plans(size, tuple(batch), precision, *(tuple(g[k]) for k in CHECK_GRID)))


@functools.lru_cache(maxsize=None)
def _plans(size, batch, precision, world_sizes, stages, ckpts, micro):
    return tuple(cached_trace(size, *batch, precision, ck, k).shard(s, n)
                 for n in world_sizes for s in stages if n > 1 or s == 0 for ck in ckpts for k in micro)


def cheapest_plan(plans, budget):
    """Reference for 11.1: fewest ranks, then the lowest step cost, then the first listed; None if none fits."""
    fitting = [p for p in plans if p.peak_bytes <= budget]
    return min(fitting, key=lambda p: (p.config["world_size"], p.step_cost), default=None)


def _summary(p):
    return None if p is None else {k: p.config[k] for k in ("world_size", "zero_stage", "checkpointing",
                                                            "micro_batches")}


class Check11_1(RemembersVerdict):
    id, function, points = "11.1", "choose_plan", 3

    def cases(self, rng):
        peaks = sorted({p.peak_bytes for p in candidate_plans()})
        lo, hi = peaks[0], peaks[-1]
        cases = [{"budget": lo - 1, "what": "below every plan's peak"},            # nothing fits
                 *self._separating(rng),
                 {"budget": lo, "what": "exactly the smallest peak"},              # fits exactly
                 {"budget": hi, "what": "exactly the largest peak, costliest listed first", "worst_first": 1},
                 {"budget": rng.choice(peaks[1:-1]), "what": "exactly one plan's peak"}]
        cases += [{"budget": rng.randint(lo, hi), "what": "random"} for _ in range(3)]
        for c in cases:
            c["order"] = rng.randrange(2**31)
        return cases

    @staticmethod
    def _separating(rng):
        """Two budgets on which "peak < budget" and "peak x world size <= budget" give different wrong answers,
        each before any case where they coincide, so that each mistake is named alone: a one-rank plan's exact
        peak (only `<` goes wrong there), and a budget between two peaks whose answer needs several ranks (only
        the x world size mistake goes wrong)."""
        plans = candidate_plans()
        peaks = sorted({p.peak_bytes for p in plans})
        at_peak = [p.peak_bytes for p in plans if p.config["world_size"] == 1 and
                   _summary(cheapest_plan(plans, p.peak_bytes)) == _summary(p)]
        between = [a + 1 for a, b in zip(peaks, peaks[1:]) if b > a + 1 and
                   cheapest_plan(plans, a + 1).config["world_size"] > 1 and
                   _summary(cheapest_plan([p for p in plans if p.peak_bytes * p.config["world_size"] <= a + 1], a + 1))
                   != _summary(cheapest_plan(plans, a + 1))]
        return [{"budget": rng.choice(sorted(at_peak)), "what": "exactly a one-rank plan's peak"},
                {"budget": rng.choice(between), "what": "between two peaks, more than one rank needed"}]

    def describe(self, case):
        return f"budget {case['budget']:,} B ({case['what']})"

    def _plans(self, case):
        plans = candidate_plans()
        random.Random(case["order"]).shuffle(plans)
        if case.get("worst_first"):  # the first listed of the fewest ranks is then never the cheapest
            plans.sort(key=lambda p: -p.step_cost)
        return plans

    def run(self, fn, case):
        chosen = fn(self._plans(case), case["budget"])
        if chosen is None or isinstance(chosen, Plan):
            return {"type": "Plan" if chosen is not None else "None", "plan": _summary(chosen)}
        return {"type": describe_value(chosen), "plan": None}

    def judge(self, case, result):
        expect(result["type"] in ("Plan", "None"),
               f"choose_plan returned {result['type']}; expected one of the Plan objects it was given, or None")
        plans, budget = self._plans(case), case["budget"]
        fit = [p for p in plans if p.peak_bytes <= budget]
        wrong = {
            "a plan whose peak equals the budget fits (peak <= budget, not <)":
                cheapest_plan([p for p in plans if p.peak_bytes < budget], budget),
            "the budget is per device: compare each rank's peak, not peak x world size":
                cheapest_plan([p for p in plans if p.peak_bytes * p.config["world_size"] <= budget], budget),
            "the lowest step cost first, ignoring the number of ranks":
                min(fit, key=lambda p: p.step_cost, default=None),
            "fewest ranks, but not the lowest step cost among them":
                min(fit, key=lambda p: p.config["world_size"], default=None),
            "the plan with the smallest peak, not the cheapest":
                min(fit, key=lambda p: p.peak_bytes, default=None),
            "when nothing fits, return None (not the plan closest to fitting)":
                min(plans, key=lambda p: p.peak_bytes) if not fit else cheapest_plan(plans, budget),
        }
        expect_equal(result["plan"], _summary(cheapest_plan(plans, budget)), "the chosen plan",
                     mistakes={k: _summary(v) for k, v in wrong.items()},
                     hint="Fits: peak_bytes <= budget. Cheapest: fewest ranks, then the lowest step_cost.")


check_11_1 = REGISTRY["11.1"]
