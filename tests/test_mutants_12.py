"""Each check of notebook 12 passes the solution, fails the stub, and names each planted mistake under 20
seeds (``mutant_fails_every_seed``). The mistakes are issue 28's: for 12.1 a policy that misses either
budget, no or too much forward prefetch, the root left unsharded; for 12.2 the optimizer not saved, nothing
loaded, ``dcp.load`` without ``set_state_dict`` (the lr a scheduler set is lost), each rank's shards written
with ``torch.save``, the whole model gathered to rank 0 and written with ``torch.save``, a full state dict
written with DCP, and only rank 0 saving."""
from pathlib import Path

import pytest

from mgpu_helpers.tools.authoring import mutant_fails_every_seed
import mgpu_helpers.checks.fsdp_practice  # noqa: F401  (registers 12.1 and 12.2)
from testkit import marked, mistake_params, solution_passes_stub_fails

NB = Path(__file__).resolve().parent.parent / "solutions" / "12_fsdp2_in_practice.ipynb"

RAF = "reshard_after_forward=2)"
PREFETCH = "        block.set_modules_to_forward_prefetch([following])  # one block ahead"
ROOT = "    fully_shard(model, mesh=mesh)  # then the root: the first and last Linear"
GET = "        model_sd, optim_sd = get_state_dict(model, optimizer)  # save: what to write; load: the template to fill"
SAVE = "            dcp.save(state, checkpoint_id=path)  # each rank writes its own shards, rank 0 the metadata"
LOAD = "            dcp.load(state, checkpoint_id=path)  # in place, into the template's tensors, resharded"
SET = ('            set_state_dict(model, optimizer, model_state_dict=state["model"], '
       'optim_state_dict=state["optim"])')
STATE = '        state = {"model": model_sd, "optim": optim_sd}'
FULL = ("options=__import__('torch').distributed.checkpoint.state_dict.StateDictOptions("
        "full_state_dict=True, cpu_offload=True)")
RANK = '__import__("torch").distributed.get_rank()'
# (edits applied to the solution cell, words the failure must contain)
CASES = {
    "12.1": ("shard_for_budget", [
        ([(RAF, "reshard_after_forward=True)")], "the communication budget was missed"),
        ([(RAF, "reshard_after_forward=False)")], "the memory budget was missed"),
        ([(PREFETCH, "        pass")], "no explicit forward prefetch"),
        ([(PREFETCH, "        block.set_modules_to_forward_prefetch(units[units.index(block) + 1:][:2])")],
         "prefetched two blocks ahead"),
        ([(ROOT, "    pass")], "the root is not a fully_shard unit"),
    ]),
    "12.2": ("ShardedCheckpoint", [
        ([(STATE, '        state = {"model": model_sd}'), (SET, SET.replace('state["optim"]', "optim_sd"))],
         "optimizer state was not saved or not loaded"),
        ([(LOAD, "            pass  #")], "nothing was loaded"),
        ([(SET, "            pass")], "the learning rate was not restored"),
        ([(SAVE, f"            __import__('torch').save(state, f'{{path}}/rank{{{RANK}}}.pt')")],
         "each rank's shards were written with torch.save"),
        ([(GET, f"        model_sd, optim_sd = get_state_dict(model, optimizer, {FULL})"),
          (SAVE, f"            {RANK} == 0 and __import__('torch').save(state, f'{{path}}/model.pt')")],
         "the whole model was gathered to one rank"),
        ([(GET, f"        model_sd, optim_sd = get_state_dict(model, optimizer, {FULL.replace(', cpu_offload=True', '')})")],
         "a rank held whole parameters while saving"),
        ([(SAVE, f"            {RANK} == 0 and dcp.save(state, checkpoint_id=path, no_dist=True)")],
         "only some ranks' shards are in the checkpoint"),
    ]),
}

PARAMS = mistake_params(CASES, width=30)


@pytest.mark.parametrize("ex", [marked(e) for e in CASES])
def test_solution_passes_and_stub_fails(ex):
    solution_passes_stub_fails(NB, ex, CASES[ex][0])


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("ex,edits,named", PARAMS)
def test_planted_mistake_is_named(ex, edits, named):
    mutant_fails_every_seed(NB, ex, CASES[ex][0], edits, named)


@pytest.mark.ex_12_2
def test_only_rank_0_calling_dcp_save_is_named_in_the_hint():
    """``if rank == 0: dcp.save(...)`` (collective, so the other ranks wait at the barrier until the launch
    times out, 60 s: not run here) reads as the hint says."""
    from mgpu_helpers.checks import REGISTRY
    hint = REGISTRY["12.2"].hint(
        "RankTimeout: run_ranks: timed out after 60 s; rank(s) 0, 1 still running (killed)\n  rank 0 was waiting "
        "in all_gather (torch/distributed/distributed_c10d.py), called from transfer, line 19: if rank == 0: "
        "dcp.save(state, checkpoint_id=path)\n  rank 1 was waiting in barrier (torch/distributed/distributed_c10d.py)")
    assert "every rank calls them" in hint and "never only rank 0" in hint
