"""Each check of notebook 05 passes the solution, fails the stub, and names each planted mistake under 20 seeds."""
from pathlib import Path

import pytest

from mgpu_helpers.tools.authoring import mutant_fails_every_seed
import mgpu_helpers.checks.accumulation  # noqa: F401  (registers 5.1 and 5.2)
from testkit import marked, mistake_params, solution_passes_stub_fails

NB = Path(__file__).resolve().parent.parent / "solutions" / "05_gradient_accumulation.ipynb"

# (old text, new text) pairs applied in turn to the solution cell, and the words the failure must contain
LOSS_51 = 'loss = loss_fn(model(x), y, reduction="sum") / n'
LOSS_52 = "loss = loss_fn(ddp_model(x), y) / k"
CTX = "contextlib.nullcontext() if last else ddp_model.no_sync()"
CASES = {
    "5.1": ("accumulate_gradients", [
        ([(LOSS_51, "loss = loss_fn(model(x), y) / k")], "weighted each micro-batch's mean loss by 1/k"),
        ([(LOSS_51, "loss = loss_fn(model(x), y)")], "loss not divided by k"),
        ([("        loss.backward()", "        model.zero_grad()\n        loss.backward()")],
         "zero_grad inside the loop"),
        ([("    total = 0.0", "    model.zero_grad()\n    total = 0.0")], "zeroed the gradients already in .grad"),
        ([("n = int((targets != -100).sum())", "n = len(targets)")], "counted the padding"),
        ([(LOSS_51, "loss = loss_fn(model(x), y) / n")], "divided the micro-batch's MEAN loss by the count"),
        ([(LOSS_51, "loss = loss_fn(model(x), y) / len(x)")], "divided by the micro-batch size instead of k"),
        ([("zip(inputs.tensor_split(k), targets.tensor_split(k))", "[(inputs, targets)]")],
         "one forward over the whole batch"),
        ([("total += loss.item()", "total = loss.item()")], "returned only the last micro-batch's share"),
        ([("total += loss.item()", "total = total + loss")], "returned a tensor"),
        ([("        loss.backward()                      # adds into .grad: never zero it, here or before the loop\n"
           "        total += loss.item()\n    return total",
           "        total = total + loss\n    total.backward()\n    return total.item()")],
         "the losses were summed and backward called once"),
    ]),
    "5.2": ("accumulate_ddp", [
        ([(CTX, "contextlib.nullcontext()")], "no no_sync"),
        ([(CTX, "ddp_model.no_sync()")], "no_sync on every micro-step, including the last"),
        ([(LOSS_52, "loss = loss_fn(ddp_model(x), y)")], "loss not divided by k"),
        ([("total += loss.item()", "total = loss.item()")], "returned only the last micro-batch's loss"),
        ([(f"        with {CTX}:   # forward AND backward inside\n            {LOSS_52}\n",
           f"        {LOSS_52}\n        with {CTX}:\n")], "the forward ran outside it"),
        ([("zip(inputs.tensor_split(k), targets.tensor_split(k))", "[(inputs, targets)]"),
          ("last = i == k - 1", "last = True"), (LOSS_52, "loss = loss_fn(ddp_model(x), y)")],
         "one forward over the whole batch"),
        ([("last = i == k - 1", "last = i == 0")], "synchronised on the FIRST micro-step instead of the last"),
        ([("import contextlib", "import contextlib\nimport torch.distributed as dist"),
          (CTX, "contextlib.nullcontext() if last or dist.get_rank() else ddp_model.no_sync()")],
         "the ranks' collectives do not match"),
        ([("            loss.backward()\n        total += loss.item()\n    return total",
           "            total = total + loss\n    total.backward()\n    return total.item()")],
         "the losses were summed and backward called once"),
    ]),
}


PARAMS = mistake_params(CASES)


@pytest.mark.parametrize("ex", [marked(e) for e in CASES])
def test_solution_passes_and_stub_fails(ex):
    solution_passes_stub_fails(NB, ex, CASES[ex][0])


@pytest.mark.parametrize("ex,edits,named", PARAMS)
def test_planted_mistake_is_named_under_20_seeds(ex, edits, named):
    mutant_fails_every_seed(NB, ex, CASES[ex][0], edits, named)
