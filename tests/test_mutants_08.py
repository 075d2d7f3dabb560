"""Each check of notebook 08 passes the solution, fails the stub, and names planted mistakes -- the main ones
under 20 seeds (``mutant_fails_every_seed``), the rest under one."""
from pathlib import Path

import pytest

from mgpu_helpers.tools.authoring import mutant_fails_every_seed, mutant_verdict
import mgpu_helpers.checks.sharding  # noqa: F401  (registers 8.1 and 8.2)
from testkit import marked, mistake_params, solution_passes_stub_fails

NB = Path(__file__).resolve().parent.parent / "solutions" / "08_sharding_zero.ipynb"

SYNC = '            inner.update({k: v for k, v in outer.items() if k != "params"})'
MINE = 'mine = {k: v for k, v in param_group.items() if k != "params"}'
RS = "    reduce_scatter(shard, flat) "
# (edits applied to the solution cell, words the failure must contain, under 20 seeds?)
CASES = {
    "8.1": ("ShardedOptimizer", [
        ([("                    dist.broadcast(p.data, src=r)", "                    pass")],
         "other ranks' updated parameters never arrived", True),
        ([('mine["params"] = [p for p in fresh if self.owner[p] == self.rank]', 'mine["params"] = fresh')],
         "nothing is sharded", True),
        ([(SYNC, "            pass")], "never reached the wrapped optimizer", True),
        ([(SYNC, "            pass"), (MINE, "mine = {}")], "hyperparameters", False),
        ([("            if p not in self.owner and all(p is not q for q in fresh):", "            if True:")],
         "a tied tensor", False),
        ([("            self.local.add_param_group(mine)", "            pass")], "has optimizer state on no rank", False),
        ([("            raise TypeError(", "            print(")], "does not mention 'optimizer_cls'", False),
        ([("                raise ValueError(", "                print(")], "expected 'ValueError'", False),
        # Adam is nearly blind to a gradient's scale (2.9e-06 apart): the SGD case names it
        ([("        loss = self.local.step(closure)",
           "        [p.grad.div_(self.world) for p in self.owner if p.grad is not None]\n"
           "        loss = self.local.step(closure)")], "divided by the world size", True),
        ([("        loss = self.local.step(closure)",
           "        [dist.all_reduce(p.grad) for p in self.owner if p.grad is not None]\n"
           "        loss = self.local.step(closure)")], "summed over the", False),
        # right values, nothing sharded on ranks 1..N-1: rank 0 owns (and keeps the state of) every parameter
        ([("            r = self.load.index(min(self.load))", "            r = 0")], "unbalanced: rank 0 owns", True),
    ]),
    "8.2": ("reduce_scatter_gradients", [
        ([("    return shard / world", "    return shard")], "summed over the ranks but not divided", True),
        ([("        p.grad = None ", "        pass ")], "kept the full .grad", True),
        ([("    flat = torch.nn.functional.pad(flat, (0, shard_len * world - flat.numel()))",
           "    flat = flat[:shard_len * world]"),
          ("shard_len = -(-flat.numel() // world)", "shard_len = flat.numel() // world")],
         "was not padded", True),
        ([(RS, "    dist.all_reduce(flat); shard = flat[rank * shard_len:(rank + 1) * shard_len] #")],
         "all_reduce of the whole gradient, then a slice", False),
        # unequal shards (tensor_split, no padding): gloo alone ends in "Connection reset by peer"
        ([("    flat = torch.nn.functional.pad(flat, (0, shard_len * world - flat.numel()))",
           "    chunks = list(flat.tensor_split(world))"),
          (RS, "    shard = torch.empty_like(chunks[rank]); dist.reduce_scatter(shard, chunks) #")],
         "sizes that do not pair up: rank 0: output", True),
        ([(RS, "    shard.copy_(flat[rank * shard_len:(rank + 1) * shard_len]) #"),
          ("    return shard / world", "    return shard")], "never reduced across ranks", False),
        # right values from every rank's whole gradient: N times the traffic and the memory
        ([(RS, "    bufs = [torch.empty_like(flat) for _ in range(world)]; dist.all_gather(bufs, flat); "
               "shard = sum(bufs)[rank * shard_len:(rank + 1) * shard_len] #")],
         "all_gather of every rank's whole gradient", False),
    ]),
}


PARAMS = mistake_params(CASES, width=30)


@pytest.mark.parametrize("ex", [marked(e) for e in CASES])
def test_solution_passes_and_stub_fails(ex):
    solution_passes_stub_fails(NB, ex, CASES[ex][0])


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("ex,edits,named,every", PARAMS)
def test_planted_mistake_is_named(ex, edits, named, every):
    if every:
        mutant_fails_every_seed(NB, ex, CASES[ex][0], edits, named)
    else:
        ok, msg = mutant_verdict(NB, ex, CASES[ex][0], edits, seed=7)
        assert not ok, f"mutant {edits!r} passed the check"
        assert named in msg, msg
