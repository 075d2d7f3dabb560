"""Each check of notebook 12 passes the solution, fails the stub, and names each planted mistake under 20
seeds (``mutant_fails_every_seed``)."""
from pathlib import Path

import pytest

from mgpu_helpers.tools.authoring import mutant_fails_every_seed
import mgpu_helpers.checks.fsdp_practice  # noqa: F401  (registers 12.1 and 12.2)
from testkit import marked, mistake_params, solution_passes_stub_fails

NB = Path(__file__).resolve().parent.parent / "solutions" / "12_fsdp2_in_practice.ipynb"

FITS = '    fits = [r for r in options if r["peak"] <= budget and r["gathered"] <= comm_budget]'
KEY = '    best = min(fits, key=lambda r: (r["gathered"], -r["prefetch"], r["peak"]))'
SET = ('        set_state_dict(model, optimizer, model_state_dict=state["model"], '
       'optim_state_dict=state["optim"])')
# (edits applied to the solution cell, words the failure must contain)
CASES = {
    "12.1": ("choose_knobs", [
        ([(FITS, FITS.replace('r["peak"] <= budget and ', ""))], "the memory budget was ignored"),
        ([(FITS, FITS.replace(' and r["gathered"] <= comm_budget', ""))], "the communication budget was ignored"),
        ([(KEY, KEY.replace('(r["gathered"], -r["prefetch"], r["peak"])', '(r["peak"], r["gathered"], -r["prefetch"])'))],
         "the least memory was chosen"),
        ([(KEY, KEY.replace('-r["prefetch"]', 'r["prefetch"]'))], "prefetch was left off"),
    ]),
    "12.2": ("ShardedCheckpoint", [
        ([('dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)',
           'dcp.save({"model": model_sd}, checkpoint_id=path)'),
          ('        state = {"model": model_sd, "optim": optim_sd}', '        state = {"model": model_sd}'),
          (SET, SET.replace('state["optim"]', "optim_sd"))],
         "optimizer state was not saved or not loaded"),
        ([("        dcp.load(state, checkpoint_id=path)", "        pass  #")], "nothing was loaded"),
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
