"""Notebook 12 -- the checks of exercises 12.1 (choose ``reshard_after_forward`` and prefetch for a memory
and a communication budget, from measured rows) and 12.2 (a resumable sharded checkpoint: saved on N
ranks, loaded on M, training continues as one process would). The judges compute their references
themselves: 12.1 from the same measurement (``fsdp_practice.knob_sweep``: bytes are deterministic) and the
rule, which only the judge imports; 12.2 from one process training the same model on the whole batch."""
from __future__ import annotations

import copy
import shutil
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.nn import functional as F

from .base import REGISTRY, Check, expect, expect_close, expect_equal, plain, run_learner_ranks
from ..fsdp_practice import knob_sweep, make_model, shard
from ..runtime.launch import rank_device
from ..sharding import make_batch


def _options(world: int, blocks: int) -> list[dict]:
    return knob_sweep(world, blocks)


def _norm(choice):
    """Compare knob dicts by type too: ``True == 1`` in Python, but reshard_after_forward=1 is not True."""
    if not isinstance(choice, dict):
        return choice
    return {k: (type(v).__name__, v) for k, v in sorted(choice.items())}


class ChooseKnobsCheck(Check):
    id, function, points = "12.1", "choose_knobs", 2

    def cases(self, rng):
        # one measured table (the notebook's, 4 ranks); the budgets, drawn fresh, move the answer around it
        rows = _options(4, 4)
        P, C = sorted({r["peak"] for r in rows}), sorted({r["gathered"] for r in rows})
        out = []
        for kind in ("memory", "communication", "loose", "none"):
            budget = rng.randint(P[0], P[-1] - 1) if kind in ("memory", "communication") else \
                rng.randint(P[-1], 2 * P[-1]) if kind == "loose" else rng.randint(P[0] // 2, P[0] - 1)
            allowed = min(r["gathered"] for r in rows if r["peak"] <= budget) if kind != "none" else C[0]
            comm = rng.randint(C[0] // 2, allowed - 1) if kind == "communication" else rng.randint(C[-1], 2 * C[-1])
            out.append({"world_size": 4, "blocks": 4, "budget": budget, "comm_budget": comm, "bound": kind})
        return out

    def describe(self, case):
        return (f"{case['world_size']} ranks, {case['blocks']} blocks, budget {case['budget']} bytes per rank, "
                f"comm budget {case['comm_budget']} bytes all-gathered per step")

    def run(self, fn, case):
        rows = [dict(r) for r in _options(case["world_size"], case["blocks"])]
        return plain(fn(copy.deepcopy(rows), case["budget"], case["comm_budget"]))

    def judge(self, case, result):
        from .references.fsdp_practice import MISTAKES_12_1, choose  # the judge's side only

        rows = _options(case["world_size"], case["blocks"])
        want = choose(rows, case["budget"], case["comm_budget"])
        if result is not None:
            expect(isinstance(result, dict) and set(result) == {"reshard_after_forward", "prefetch"},
                   f"choose_knobs returned {result!r}; expected a dict with keys reshard_after_forward and "
                   "prefetch, or None when no row fits")
        mistakes = {name: _norm(choose(rows, case["budget"], case["comm_budget"], **v))
                    for name, v in MISTAKES_12_1.items()}
        expect_equal(_norm(result), _norm(want), "the chosen knobs (as (type, value))",
                     mistakes={k: v for k, v in mistakes.items() if v != _norm(want)},
                     hint="Keep the rows whose peak <= budget and gathered <= comm_budget; of those, the fewest "
                          "bytes all-gathered, then prefetch on, then the lower peak; None if none fits.")


# --- 12.2: a resumable sharded checkpoint ----------------------------------------------------------------

MODEL_12_2 = {"d": 16, "blocks": 2, "d_in": 6, "classes": 4}
ROWS, LR = 12, 1e-2  # 12 rows split evenly over 2, 3 or 4 ranks
# float64: N ranks sum gradients in another order than one process does, and Adam divides a gradient that
# cancels to near zero by its own square root; in float32 that turned a 1e-8 rounding difference into a
# 9e-6 parameter difference once in a CI run. In float64 the same amplification stays below 1e-12.
DTYPE = torch.float64


def _batch(case, step):
    return make_batch(case["seed"] + 100 + step, ROWS, MODEL_12_2["d_in"], MODEL_12_2["classes"])


def _sharded(seed):
    model = shard(make_model(**MODEL_12_2, seed=seed).to(DTYPE))
    return model, torch.optim.Adam(model.parameters(), lr=LR)


def _train(model, opt, case, steps, first):
    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    world, rank = (1, 0) if not isinstance(model, FSDPModule) else (world, rank)  # the judge's one process
    for s in range(first, first + steps):
        x, y = (t.tensor_split(world)[rank].to(rank_device()) for t in _batch(case, s))
        x = x.to(DTYPE)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone()


def _rank_save(rank, world, cls, case, path):
    model, opt = _sharded(case["seed"])
    _train(model, opt, case, case["before"], 0)
    cls().save(model, opt, path)
    dist.barrier()
    return None


def _rank_load(rank, world, cls, case, path):
    model, opt = _sharded(case["seed"] + 1)  # another init: a load that does nothing is visible
    cls().load(model, opt, path)
    params = list(model.parameters())
    loaded = [_full(p) for p in params]
    moments = [_full(opt.state[p]["exp_avg"]) if "exp_avg" in opt.state.get(p, {}) else None for p in params]
    _train(model, opt, case, case["after"], case["before"])
    final = [_full(p) for p in params]
    return {"loaded": loaded, "exp_avg": moments, "final": final} if rank == 0 else None


def _baseline(case, restart_optimizer=False, load_nothing=False):
    """One process, the whole batch: (parameters after ``before`` steps, after ``before + after``)."""
    model = make_model(**MODEL_12_2, seed=case["seed"] + (1 if load_nothing else 0), device="cpu").to(DTYPE)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    if not load_nothing:
        _train(model, opt, case, case["before"], 0)
    at_load = [p.detach().clone() for p in model.parameters()]
    if restart_optimizer or load_nothing:
        opt = torch.optim.Adam(model.parameters(), lr=LR)
        if restart_optimizer == "initialised":  # what get_state_dict does to a fresh optimizer: one step on
            from torch.distributed.checkpoint.state_dict import _init_optim_state  # zero gradients, lr 0
            _init_optim_state(opt)
    _train(model, opt, case, case["after"], case["before"])
    return at_load, [p.detach().clone() for p in model.parameters()]


class ShardedCheckpointCheck(Check):
    id, function, points = "12.2", "ShardedCheckpoint", 3

    def cases(self, rng):
        return [{"save_on": 2, "load_on": 4, "before": rng.randint(2, 3), "after": 2, "seed": rng.randrange(2**31)},
                {"save_on": 3, "load_on": 2, "before": rng.randint(1, 2), "after": 2, "seed": rng.randrange(2**31)}]

    def describe(self, case):
        return (f"{case['before']} steps on {case['save_on']} ranks, saved; loaded on {case['load_on']} ranks, "
                f"{case['after']} more steps")

    def run(self, cls, case):
        path = tempfile.mkdtemp(prefix="mgpu-ckpt-")
        try:
            run_learner_ranks(_rank_save, case["save_on"], cls, case, path, backend="gloo", timeout=60)
            return run_learner_ranks(_rank_load, case["load_on"], cls, case, path, backend="gloo", timeout=60)[0]
        finally:
            shutil.rmtree(path, ignore_errors=True)

    def judge(self, case, result):
        expect(isinstance(result, dict) and {"loaded", "final", "exp_avg"} <= set(result),
               "expected rank 0's parameters after the load and at the end")
        flat = lambda ts: torch.cat([t.flatten() for t in ts])  # noqa: E731
        at_load, final = _baseline(case)
        fresh, fresh_final = _baseline(case, load_nothing=True)
        _, restarted = _baseline(case, restart_optimizer=True)
        _, initialised = _baseline(case, restart_optimizer="initialised")
        expect_close(flat(result["loaded"]), flat(at_load), f"the parameters just after the load on "
                     f"{case['load_on']} ranks", rtol=1e-5, atol=1e-6, mistakes={
                         "nothing was loaded: these are the new model's own initial parameters": flat(fresh)},
                     hint="Load every parameter's saved values (dcp.load into the state dict, then set_state_dict).")
        expect(all(m is not None for m in result["exp_avg"]), "after the load, Adam has no state (exp_avg) for "
               "some parameters: the optimizer state was not saved or not loaded (get_state_dict gives both)")
        expect_close(flat(result["final"]), flat(final), f"the parameters after {case['after']} more steps",
                     rtol=1e-5, atol=1e-6, mistakes={
                         "Adam restarted from fresh moments: the optimizer state was not saved or not "
                         "loaded": flat(restarted),
                         "Adam restarted from the zero state get_state_dict gives a fresh optimizer: the "
                         "optimizer state was not saved or not loaded": flat(initialised),
                         "nothing was loaded": flat(fresh_final)},
                     hint="Training must continue exactly as one process trained without stopping would.")


check_12_1 = REGISTRY["12.1"]
check_12_2 = REGISTRY["12.2"]
__all__ = ["check_12_1", "check_12_2"]
