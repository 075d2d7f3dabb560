"""Each check of notebook 04 passes the solution, fails the stub, and names planted mistakes."""
from pathlib import Path

import pytest

from mgpu_helpers.authoring import mutant_verdict, solution_verdict, stub_verdict
import mgpu_helpers.ddp  # noqa: F401  (registers 4.1 and 4.2)

NB = Path(__file__).resolve().parent.parent / "solutions" / "04_ddp.ipynb"
DIVIDE = "            p.grad /= world_size"

CASES = {
    "4.1": ("average_gradients", [
        ([(DIVIDE, "            pass")], "summed with all_reduce but not divided by the world size"),
        ([(DIVIDE, DIVIDE + "\n" + DIVIDE)], "divided by the world size twice"),
        ([("dist.all_reduce(p.grad,", "dist.all_reduce(p.data,"), (DIVIDE, "            p.data /= world_size")],
         "averaged .data instead of .grad"),
    ]),
    "4.2": ("allreduce_bucketed", [
        ([("if current and current_bytes + nbytes > bucket_cap_bytes:", "if current:")],
         "one all_reduce per parameter (no bucketing)"),
        ([("            g.copy_(flat[offset:offset + g.numel()].view_as(g))", "            pass")],
         "the reduced flat buffer was never copied back into .grad"),
        ([("        flat /= world_size\n", "")], "not divided by the world size"),
    ]),
}


def _marks(ex):
    return getattr(pytest.mark, f"ex_{ex.replace('.', '_')}")


PARAMS = [pytest.param(ex, edits, named, marks=_marks(ex), id=f"{ex}-{named[:30]}")
          for ex, (_, ms) in CASES.items() for edits, named in ms]


@pytest.mark.parametrize("ex", [pytest.param(e, marks=_marks(e)) for e in CASES])
def test_solution_passes_and_stub_fails(ex):
    fn_name, _ = CASES[ex]
    ok, msg = solution_verdict(NB, ex, fn_name)
    assert ok, msg
    assert msg == f"Exercise {ex} ✓ {fn_name}: 3/3 cases"
    ok, msg = stub_verdict(NB, ex, fn_name)
    assert not ok and "not implemented yet" in msg and f"Exercise {ex}" in msg


@pytest.mark.parametrize("ex,edits,named", PARAMS)
def test_planted_mistake_is_named(ex, edits, named):
    ok, msg = mutant_verdict(NB, ex, CASES[ex][0], edits, seed=7)
    assert not ok, f"mutant {edits!r} passed the check"
    assert named in msg, msg
