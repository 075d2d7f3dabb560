"""Check 10.1 passes the solution, fails the stub, and names planted mistakes under every one of 20 seeds."""
from pathlib import Path

import pytest

from mgpu_helpers.tools.authoring import exercise_source, mutant_fails_every_seed
import mgpu_helpers.checks.data_loading  # noqa: F401  (registers 10.1)
from testkit import solution_passes_stub_fails

NB = Path(__file__).resolve().parent.parent / "solutions" / "10_data_loading.ipynb"
FN = "shard_indices"
MUTANTS = [
    ([("return order[rank:total:world_size]", "return order[rank * per_rank:(rank + 1) * per_rank]")],
     "contiguous blocks per rank"),
    ([("manual_seed(seed + epoch)", "manual_seed(seed)")], "set_epoch forgotten"),
    ([("        order = (order * -(-total // n))[:total]", "        pass")], "no padding"),
    ([("(order * -(-total // n))[:total]", "(order + order[:total - n])")], "padding that repeats the index list only once"),
    ([("    if drop_last and n % world_size:", "    if False:"), ("    if drop_last:\n", "    if False:\n")],
     "drop_last ignored"),
]
# neither padded nor dropped (order[rank::world_size]): named "no padding" whichever case fails first (it
# was unnamed when a drop_last=True case came first, under 4 of 20 seeds)
_src = exercise_source(NB, "10.1")
MUTANTS.append(([(_src[_src.index("    if drop_last and n % world_size:"):_src.index("    ### END SOLUTION")],
                  "    return order[rank::world_size]\n")], "no padding"))


@pytest.mark.ex_10_1
def test_solution_passes_and_stub_fails():
    solution_passes_stub_fails(NB, "10.1", FN)


@pytest.mark.ex_10_1
@pytest.mark.parametrize("edits,named", MUTANTS, ids=[n[:30] for _, n in MUTANTS])
def test_mistake_fails_under_every_seed(edits, named):
    mutant_fails_every_seed(NB, "10.1", FN, edits, named)
