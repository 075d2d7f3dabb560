"""Each check of notebook 04 passes the solution, fails the stub, and names each planted mistake under 20 seeds."""
from pathlib import Path

import pytest

from mgpu_helpers.tools.authoring import mutant_fails_every_seed
import mgpu_helpers.checks.ddp  # noqa: F401  (registers 4.1 and 4.2)
from testkit import solution_passes_stub_fails

NB = Path(__file__).resolve().parent.parent / "solutions" / "04_ddp.ipynb"
DIVIDE = "            p.grad /= world_size"
REDUCE = "            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)   # every rank now holds the sum..."
RULE = "if current and current_bytes + nbytes > bucket_cap_bytes:"
LAST = "    if current:\n        buckets.append(current)\n"

CASES = {
    "4.1": ("average_gradients", [
        ([(DIVIDE, "            pass")], "summed with all_reduce but not divided by the world size"),
        ([(DIVIDE, DIVIDE + "\n" + DIVIDE)], "divided by the world size twice"),
        ([(DIVIDE, "            p.grad /= 2")], "divided by 2 instead of the world size"),
        ([("dist.all_reduce(p.grad,", "dist.all_reduce(p.data,"), (DIVIDE, "            p.data /= world_size")],
         "averaged .data instead of .grad"),
        ([("        if p.grad is not None:\n", "        if True:\n")], "unused parameter, whose .grad is None"),
        ([("        if p.grad is not None:\n", "        if p.grad is not None and p.dim() > 1:\n")],
         ".bias differ"),
        ([(REDUCE, "            if dist.get_rank() == 0 or p.dim() > 1:\n    " + REDUCE)],
         "the ranks' collectives do not match"),
    ]),
    "4.2": ("allreduce_bucketed", [
        ([(RULE, "if current:")], "one all_reduce per parameter (no bucketing)"),
        ([(RULE, RULE.replace(">", ">="))], "exactly at the cap (>= instead of >)"),
        ([("            g.copy_(flat[offset:offset + g.numel()].view_as(g))", "            pass")],
         "the reduced flat buffer was never copied back into .grad"),
        ([(LAST, "")], "forgot the last bucket"),
        ([("        flat /= world_size\n", "")], "not divided by the world size"),
        ([("p.grad for p in model.parameters() if p.grad is not None", "p.grad for p in model.parameters()")],
         "unused parameter, whose .grad is None"),
        ([("    for bucket in buckets:\n", "    for bucket in (buckets if dist.get_rank() else buckets[:1]):\n")],
         "the ranks' collectives do not match"),
    ]),
}


def _marks(ex):
    return getattr(pytest.mark, f"ex_{ex.replace('.', '_')}")


PARAMS = [pytest.param(ex, edits, named, marks=_marks(ex), id=f"{ex}-{named[:30]}")
          for ex, (_, ms) in CASES.items() for edits, named in ms]


@pytest.mark.parametrize("ex", [pytest.param(e, marks=_marks(e)) for e in CASES])
def test_solution_passes_and_stub_fails(ex):
    solution_passes_stub_fails(NB, ex, CASES[ex][0], seeds=(None, 0, 1))


@pytest.mark.parametrize("ex,edits,named", PARAMS)
def test_planted_mistake_is_named_under_20_seeds(ex, edits, named):
    mutant_fails_every_seed(NB, ex, CASES[ex][0], edits, named)
