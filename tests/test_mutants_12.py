"""Each check of notebook 12 passes the solution, fails the stub, and names each planted mistake. The mistakes:
for 12.1 a policy that misses either budget, no or too much forward prefetch, the root left
unsharded; for 12.2 the optimizer not saved, its state keyed by position (``optimizer.state_dict()``), nothing loaded, ``dcp.load`` without ``set_state_dict`` (the lr a
scheduler set is lost), each rank's shards written with ``torch.save``, the whole model gathered to rank 0 and
written with ``torch.save``, a full state dict written with DCP, and only rank 0 saving.

12.2's mistakes are named under every seed of ``sweep_seeds()`` (``mutant_fails_every_seed``): its draw (steps before the save, the
lr, the values) feeds the judge's comparisons. 12.1's are named under two: its judge reads bytes, the
forward's issue order and which modules are units, and its draw is only the model's and the batch's values,
which none of those depend on -- ``test_12_1_reads_nothing_the_draw_changes`` proves that on the solution
and on a wrong policy (as notebook 08 splits its mistakes; 20 seeds of 4 profiled ranks took 219 s of the
suite's test time on 2 cores for nothing more)."""
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
# (edits applied to the solution cell, words the failure must contain, under 20 seeds?)
CASES = {
    "12.1": ("shard_for_budget", [
        ([(RAF, "reshard_after_forward=True)")], "the communication budget was missed", False),
        ([(RAF, "reshard_after_forward=False)")], "the memory budget was missed", False),
        ([(PREFETCH, "        pass")], "no explicit forward prefetch", False),
        ([(PREFETCH, "        block.set_modules_to_forward_prefetch(units[units.index(block) + 1:][:2])")],
         "prefetched two blocks ahead", False),
        ([(ROOT, "    pass")], "the root is not a fully_shard unit", False),
    ]),
    "12.2": ("ShardedCheckpoint", [
        ([(STATE, '        state = {"model": model_sd}'), (SET, SET.replace('state["optim"]', "optim_sd"))],
         "optimizer state was not saved or not loaded", True),
        ([(LOAD, "            pass  #")], "nothing was loaded", True),
        ([(SET, "            pass")], "the learning rate was not restored", True),
        ([(SAVE, f"            __import__('torch').save(state, f'{{path}}/rank{{{RANK}}}.pt')")],
         "each rank's shards were written with torch.save", True),
        ([(GET, f"        model_sd, optim_sd = get_state_dict(model, optimizer, {FULL})"),
          (SAVE, f"            {RANK} == 0 and __import__('torch').save(state, f'{{path}}/model.pt')")],
         "the whole model was gathered to one rank", True),
        ([(GET, f"        model_sd, optim_sd = get_state_dict(model, optimizer, {FULL.replace(', cpu_offload=True', '')})")],
         "a rank held whole parameters while saving", True),
        ([(SAVE, f"            {RANK} == 0 and dcp.save(state, checkpoint_id=path, no_dist=True)")],
         "only some ranks' shards are in the checkpoint", True),
        # the optimizer's own state_dict(): keyed by position, right only while the parameter order is the same
        # (every draw has the case whose optimizer lists them in reverse: two seeds say as much as twenty)
        ([(GET, "        model_sd, _ = get_state_dict(model, optimizer); optim_sd = optimizer.state_dict()")],
         "keyed by position", False),
    ]),
}

PARAMS = mistake_params(CASES, width=30)


@pytest.mark.parametrize("ex", [marked(e) for e in CASES])
def test_solution_passes_and_stub_fails(ex):
    solution_passes_stub_fails(NB, ex, CASES[ex][0])


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("ex,edits,named,every", PARAMS)
def test_planted_mistake_is_named(ex, edits, named, every):
    mutant_fails_every_seed(NB, ex, CASES[ex][0], edits, named, seeds=None if every else (7, 8))


@pytest.mark.ex_12_1
def test_12_1_reads_nothing_the_draw_changes():
    """What 12.1's judge reads of each rank -- peak and all-gathered bytes, the forward's issue order, which
    modules are units -- is the same under two draws, for the solution and for a policy that misses a
    budget: so a mistake named under two seeds is named under every one."""
    from mgpu_helpers.checks import REGISTRY
    from mgpu_helpers.tools.authoring import exec_cell, exercise_source, mutate
    chk, src = REGISTRY["12.1"], exercise_source(NB, "12.1")
    for source in (src, mutate(src, RAF, "reshard_after_forward=True)")):
        fn = exec_cell(source)["shard_for_budget"]
        (a,), (b,) = chk.make_cases(1), chk.make_cases(2)
        assert a["seed"] != b["seed"] and {**a, "seed": 0} == {**b, "seed": 0}  # only the draw differs
        ra, rb = chk.run_all(fn, 1), chk.run_all(fn, 2)  # as the check runs it (one thread)
        assert all(r["ok"] for r in ra + rb) and ra == rb, (ra, rb)


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
