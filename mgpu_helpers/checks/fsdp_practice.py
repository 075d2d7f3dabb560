"""Notebook 12 -- the checks of 12.1 (a ``fully_shard`` policy meeting a memory and a communication budget,
measured as each of 4 ranks; the forward's issue order against FSDP2's own) and 12.2 (a sharded checkpoint saved
on N ranks, loaded on M, against one process training on the whole batch; its DCP metadata read)."""

import shutil
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.nn import functional as F

from .base import Check, expect, expect_close, flat, run_learner_ranks
from ..fsdp_practice import MODEL, blocks, budgets, knob_sweep, make_model, measure, shard
from ..runtime.launch import rank_device
from ..runtime.fake_world import fake_world
from ..memory import make_batch
from ..runtime.comm_log import CommLog


def _rank_12_1(rank, world, fn, case):
    """One steady step of the model sharded by ``fn(model, mesh)`` as this rank: its peak, bytes all-gathered,
    the forward's issue order, and whether the blocks and the root are ``fully_shard`` units."""
    m = measure(rank, world, {}, categories=False, seed=case["seed"], shard_fn=fn, keep=True)
    model = m["model"]
    return {"root": isinstance(model, FSDPModule), "blocks": [isinstance(b, FSDPModule) for b in blocks(model)],
            "peak": m["peak"], "gathered": m["gathered"], "forward_order": m["forward_order"]}


class ShardForBudgetCheck(Check):
    id, function, points = "12.1", "shard_for_budget", 3
    rank_fn = staticmethod(_rank_12_1)  # run as each rank in turn (run below)

    def cases(self, rng):
        # The budgets are the notebook's (``fsdp_practice.budgets``, deterministic); the draw is the seed only.
        b = budgets(knob_sweep(4, MODEL["blocks"]))
        return [{"world_size": 4, "seed": rng.randrange(2**31), "budget": b["memory"],
                 "comm_budget": b["communication"]}]

    def run(self, fn, case):
        # Each rank in turn in this process under torch's fake process group: real allocations, collectives that
        # move no data, so the same bytes on every run (gloo's worker threads moved a rank's profiled peak).
        out = []
        for rank in range(case["world_size"]):
            with fake_world(case["world_size"], rank):
                out.append(self.rank_fn(rank, case["world_size"], fn, case))
        return out

    hints = {"all_gather_copy_in_stream":  # FSDP2's lazy init found no root state
             "the root is not a fully_shard unit: after the blocks, call fully_shard(model, mesh=mesh); the root's "
             "forward is what sets every unit up",
             "has no attribute 'set_modules_to_":
             "set_modules_to_forward_prefetch is a method of FSDPModule: fully_shard each block first, then give "
             "each block the list of blocks to prefetch",
             "reshard_after_forward as an int":  # torch: "... it should be a factor of N"
             "an int reshard_after_forward is a world size to reshard to after forward: a divisor of the mesh's "
             "size other than 1 and the size itself"}

    def judge(self, case, result):
        r0 = result[0]
        expect(r0["root"], "the root is not a fully_shard unit: after the blocks, fully_shard(model, mesh=mesh) "
               "shards what is left (the first and last Linear) and drives each step's all-gathers")
        loose = [i for i, b in enumerate(r0["blocks"]) if not b]
        expect(not loose, f"the blocks were not sharded one by one: block(s) {loose} are not fully_shard units of "
               "their own (call fully_shard on each of model.blocks, then on the root), so their parameters are "
               "all-gathered together with the root's and held for the whole step")
        p_rank = max(range(len(result)), key=lambda i: result[i]["peak"])  # the first rank at the highest
        g_rank = max(range(len(result)), key=lambda i: result[i]["gathered"])
        peak, gathered = result[p_rank]["peak"], result[g_rank]["gathered"]
        missed = [why for over, why in (
            (peak > case["budget"], f"the memory budget was missed: rank {p_rank} peaks at {peak:,} bytes, "
             f"{peak - case['budget']:,} above the budget of {case['budget']:,} (reshard_after_forward=False keeps "
             "every block unsharded from its forward to its backward; prefetching two blocks ahead holds two more "
             "units while computing)"),
            (gathered > case["comm_budget"], f"the communication budget was missed: rank {g_rank} all-gathers "
             f"{gathered:,} bytes per step, {gathered - case['comm_budget']:,} above the budget of "
             f"{case['comm_budget']:,} (reshard_after_forward=True all-gathers every block again, over all ranks, "
             "in backward)")) if over]
        expect(not missed, "; and ".join(missed))
        rows = knob_sweep(4, MODEL["blocks"])
        ahead = {r["forward_order"] for r in rows if r["prefetch"] == 1 and r["reshard_after_forward"] is not False}
        implicit = {r["forward_order"] for r in rows if r["prefetch"] == 0}
        order = r0["forward_order"]
        if order not in ahead:
            expect(order not in implicit, f"no explicit forward prefetch: the forward issued its all-gathers (G) "
                   f"and matrix multiplies (m) in FSDP2's implicit order, {order}: each block's all-gather right "
                   "before its own compute. Ask each block to prefetch the next one "
                   "(set_modules_to_forward_prefetch), so that the CPU issues it one block early")
            expect(order not in {r["forward_order"] for r in rows if r["prefetch"] == 2},
                   f"prefetched two blocks ahead: the forward issued its all-gathers (G) and matrix multiplies (m) "
                   f"in the order {order}; one block ahead gives {sorted(ahead)[0]}. Each block prefetches the "
                   "next one only: a longer list holds more units at once")
            expect(False, f"the forward issued its all-gathers (G) and matrix multiplies (m) in the order {order}; "
                   f"one block ahead gives {sorted(ahead)[0]} (each block prefetches the next one, in forward)")


# --- 12.2: a resumable sharded checkpoint ----------------------------------------------------------------

MODEL_12_2 = {"d": 16, "blocks": 2, "d_in": 6, "classes": 4}
ROWS, LR = 12, 1e-2  # 12 rows split evenly over 2, 3 or 4 ranks
# float64: N ranks sum gradients in another order than one process does, and Adam divides a gradient that
# cancels to near zero by its own square root, which in float32 can lift a rounding difference above rtol.
DTYPE = torch.float64


def _sharded(seed, reorder=False):
    """The FSDP2 model and its Adam; ``reorder``: the optimizer lists the parameters in reverse (a run resumed
    from code that builds its param groups in another order: state keyed by name survives it, by position not)."""
    model = shard(make_model(**MODEL_12_2, seed=seed).to(DTYPE))
    params = list(model.parameters())
    return model, torch.optim.Adam(params[::-1] if reorder else params, lr=LR)


def _train(model, opt, case, steps, first):
    world, rank = (dist.get_world_size(), dist.get_rank()) if isinstance(model, FSDPModule) else (1, 0)  # 1: the judge
    for s in range(first, first + steps):
        batch = make_batch(ROWS, MODEL_12_2["d_in"], MODEL_12_2["classes"], case["seed"] + 100 + s)
        x, y = (t.tensor_split(world)[rank].to(rank_device()) for t in batch)
        F.cross_entropy(model(x.to(DTYPE)), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone()


def _gathered_values(comm) -> int:
    """Bytes of float64 (the model's dtype) this rank received: DCP's own planning moves only bytes and ints."""
    return sum(o for op, dtype, _, o in comm.calls if dtype == "float64")


def _rank_save(rank, world, cls, case, path):
    model, opt = _sharded(case["seed"])
    _train(model, opt, case, case["before"], 0)
    for g in opt.param_groups:  # what an lr scheduler does between steps: non-tensor state to keep
        g["lr"] = case["lr"]
    with CommLog() as comm:
        cls().save(model, opt, path)
    dist.barrier()
    return _gathered_values(comm)


def _rank_load(rank, world, cls, case, path):
    model, opt = _sharded(case["seed"] + 1, case.get("reorder", False))  # another init: a no-op load shows
    with CommLog() as comm:
        cls().load(model, opt, path)
    params = list(model.parameters())
    loaded = [_full(p) for p in params]
    moments = [_full(opt.state[p]["exp_avg"]) if "exp_avg" in opt.state.get(p, {}) else None for p in params]
    _train(model, opt, case, case["after"], case["before"])
    final = [_full(p) for p in params]
    gathered = _gathered_values(comm)
    return {"loaded": loaded, "exp_avg": moments, "final": final, "gathered": gathered} if rank == 0 else gathered


def _saved(path, world) -> dict:
    """What is in the checkpoint directory: its files, whether DCP's metadata reads, and the tensors (of at
    least ``world`` rows) stored whole (one chunk) or only in part (some ranks' shards missing)."""
    import math
    import os
    from torch.distributed.checkpoint import FileSystemReader

    out = {"files": sorted(os.listdir(path)), "metadata": False, "whole": [], "partial": []}
    try:
        md = FileSystemReader(path).read_metadata()
    except Exception:  # noqa: BLE001 - no DCP checkpoint there: the judge says which kind of mistake
        return out
    out["metadata"] = True
    for fqn, m in md.state_dict_metadata.items():
        # every tensor of at least ``world`` rows, whatever the learner named the state dict's keys: a sharded
        # save writes one chunk per rank (parameters and Adam's moments alike); scalars (Adam's step) are whole
        if getattr(m, "chunks", None) and len(m.size) and m.size[0] >= world:
            held = sum(math.prod(c.sizes) for c in m.chunks)
            (out["partial"] if held < math.prod(m.size) else out["whole"] if len(m.chunks) == 1 else []).append(fqn)
    return out


def _baseline(case, optimizer="loaded", load_nothing=False):
    """One process, the whole batch: parameters at the load and at the end. From the load Adam goes on with its state
    and lr (``"loaded"``), its state only (``"lr lost"``), or restarts (``"fresh"``, ``"initialised"``)."""
    model = make_model(**MODEL_12_2, seed=case["seed"] + (1 if load_nothing else 0), device="cpu").to(DTYPE)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    if not load_nothing:
        _train(model, opt, case, case["before"], 0)
    at_load = [p.detach().clone() for p in model.parameters()]
    if optimizer in ("fresh", "initialised") or load_nothing:
        opt = torch.optim.Adam(model.parameters(), lr=LR)
        if optimizer == "initialised":  # what get_state_dict does to a fresh optimizer: one step on
            from torch.distributed.checkpoint.state_dict import _init_optim_state  # zero gradients, lr 0
            _init_optim_state(opt)
    elif optimizer == "loaded":
        for g in opt.param_groups:
            g["lr"] = case["lr"]
    _train(model, opt, case, case["after"], case["before"])
    return at_load, [p.detach().clone() for p in model.parameters()]


class ShardedCheckpointCheck(Check):
    id, function, points = "12.2", "ShardedCheckpoint", 3

    def cases(self, rng):  # lr: a decayed one, set before saving
        return [{"save_on": n, "load_on": m, "before": rng.randint(*before), "after": 2, "seed": rng.randrange(2**31),
                 "lr": round(rng.uniform(2e-3, 5e-3), 5), **extra}
                for n, m, before, extra in ((2, 4, (2, 3), {}), (3, 2, (1, 2), {"reorder": True}))]

    def run(self, cls, case):
        path = tempfile.mkdtemp(prefix="mgpu-ckpt-")
        try:
            saving = run_learner_ranks(_rank_save, case["save_on"], cls, case, path, backend="gloo", timeout=60)
            saved = _saved(path, case["save_on"])
            if not saved["metadata"] or saved["whole"] or saved["partial"] or any(saving):
                return {"saved": saved, "save_gathered": max(saving)}  # the judge says what went wrong
            loading = run_learner_ranks(_rank_load, case["load_on"], cls, case, path, backend="gloo", timeout=60)
            return {**loading[0], "saved": saved, "save_gathered": 0,
                    "load_gathered": max([loading[0]["gathered"], *loading[1:]])}
        finally:
            shutil.rmtree(path, ignore_errors=True)

    hints = {r"Size mismatch between saved .* for \w+\.state\.\d+\.":
             "the optimizer's state was keyed by position (optimizer.state_dict(): parameter 0, 1, ...): an "
             "optimizer that lists its parameters in another order loaded one parameter's moments into another. "
             "get_state_dict(model, optimizer) keys the optimizer's state by parameter name",
             r"^(?=.*Timeout)(?=.*dcp)(?=.*(barrier|all_gather))":
             "dcp.save and dcp.load are collective: every rank calls them (each writes or reads its own shards), "
             "never only rank 0 -- the ranks that did not call it waited for it"}

    def judge(self, case, result):
        saved, n = result["saved"], case["save_on"]
        expect(saved["metadata"] or saved["files"], "nothing was written to path: save must write the "
               "checkpoint into the directory it is given (dcp.save(state, checkpoint_id=path))")
        expect(saved["metadata"], f"the directory holds {', '.join(saved['files'])} but no DCP metadata "
               "(.metadata): " + ("each rank's shards were written with torch.save, which another number of "
                                  "ranks cannot read (their DTensors carry the saving mesh: loading them on "
                                  f"{case['load_on']} ranks fails with a mesh mismatch). dcp.save writes the "
                                  "shards with the metadata that reshards them on load"
                                  if len(saved["files"]) >= n else
                                  "the whole model was gathered to one rank and written with torch.save: no rank "
                                  "may hold the whole model. dcp.save writes each rank's shard, in parallel"))
        held = ([f"{result['save_gathered']:,} bytes of parameters gathered"] if result["save_gathered"] else []) + \
            ([f"stored in one piece: {', '.join(saved['whole'][:3])}{', ...' if len(saved['whole']) > 3 else ''}"]
             if saved["whole"] else [])
        expect(not held, f"a rank held whole parameters while saving ({'; '.join(held)}): the state dict was gathered to full tensors "
               "(full_state_dict=True or full_tensor()). get_state_dict's default keeps each rank's shards, and "
               "dcp.save writes them where they are: no rank may hold the whole model")
        expect(not saved["partial"], f"only some ranks' shards are in the checkpoint ({len(saved['partial'])} of the "
               f"model's tensors incomplete, e.g. {saved['partial'][0] if saved['partial'] else ''}): every rank must call save, and dcp.save -- each of the {n} ranks writes its own "
               "shards (only rank 0 saved?)")
        expect(not result["load_gathered"], f"a rank gathered whole parameters while loading "
               f"({result['load_gathered']:,} bytes): load into get_state_dict's sharded template with dcp.load "
               "-- each rank reads its own shards -- and put it back with set_state_dict")
        at_load, final = _baseline(case)
        fresh, fresh_final = _baseline(case, load_nothing=True)
        restarted, initialised, lr_lost = (_baseline(case, optimizer=o)[1] for o in ("fresh", "initialised", "lr lost"))
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
                         "the learning rate was not restored (Adam went on at the fresh optimizer's lr, not the "
                         f"saved {case['lr']}): dcp.load fills the template's tensors in place, so parameters and "
                         "moments arrive, but param_groups reach the optimizer only through "
                         "set_state_dict": flat(lr_lost),
                         "nothing was loaded": flat(fresh_final)},
                     hint="Training must continue exactly as one process trained without stopping would.")
