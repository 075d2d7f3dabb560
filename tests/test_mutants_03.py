"""The check of notebook 03 passes the solution, fails the stub, and names planted mistakes."""
from pathlib import Path

import pytest

import mgpu_helpers.checks.data_parallel  # noqa: F401  (registers 3.1)
from mgpu_helpers.tools.authoring import mutant_fails_every_seed, mutant_verdict, solution_verdict, stub_verdict

NB = Path(__file__).resolve().parent.parent / "solutions" / "03_data_parallel.ipynb"
FN = "data_parallel_step"
pytestmark = pytest.mark.ex_3_1

SUM = "total = torch.stack([c.grad for c in copies]).sum(0)"
REDUCE = "p.grad = total if p.grad is None else p.grad + total"
LOSS = "loss = F.cross_entropy(torch.cat(outputs), targets)"
MUTANTS = [  # (old, new, what the failure message must say)
    (SUM, SUM.replace(".sum(0)", ".mean(0)"), "averaged the replica gradients instead of summing them"),
    (SUM, SUM + " / n_replicas", "averaged the replica gradients"),
    (LOSS, "loss = torch.stack([F.cross_entropy(o, t) for o, t in zip(outputs, targets.chunk(n_replicas))]).mean()",
     "averaged per-replica losses without weighting the unequal chunks"),
    (REDUCE, "pass", "never copied back"),
    (REDUCE, "p.grad = torch.zeros_like(p)", "forgot to copy the replica gradients back"),
    ("chunks = inputs.chunk(n_replicas)", "chunks = inputs.tensor_split(n_replicas)", "torch.chunk"),
    ("outputs = list(pool.map(lambda replica, x: replica(x), replicas, chunks))",
     "outputs = [replica(x) for replica, x in zip(replicas, chunks)]", "in the calling thread"),
    ("replicas = [copy.deepcopy(model) for _ in chunks]", "replicas = [model for _ in chunks]",
     "the original model ran forward itself"),
    ("return loss.detach()", "return None", "returned None; expected the loss"),
]
# One shared copy runs every chunk: autograd sums the chunks' gradients into it, so copying its .grad back
# gives the right numbers without the reduce the lesson is about. The check counts the modules that ran.
SHARED = [("replicas = [copy.deepcopy(model) for _ in chunks]",
           "shared = copy.deepcopy(model)\n    replicas = [shared for _ in chunks]"),
          (SUM, "total = copies[0].grad")]


@pytest.mark.parametrize("seed", [None, 0, 1, 2])
def test_solution_passes(seed):
    ok, msg = solution_verdict(NB, "3.1", FN, seed=seed)
    assert ok and msg == "Exercise 3.1 ✓ data_parallel_step: 3/3 cases", msg


def test_stub_fails():
    ok, msg = stub_verdict(NB, "3.1", FN)
    assert not ok and "not implemented yet" in msg and "Exercise 3.1" in msg, msg


@pytest.mark.parametrize("old,new,named", MUTANTS, ids=[m[2][:32] for m in MUTANTS])
def test_planted_mistake_is_named_under_20_seeds(old, new, named):
    mutant_fails_every_seed(NB, "3.1", FN, [(old, new)], named)


def test_one_shared_copy_is_named_under_20_seeds():
    mutant_fails_every_seed(NB, "3.1", FN, SHARED, "one shared copy ran every chunk")


def test_no_warning_for_a_loss_that_requires_grad():
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # check_3_1 once printed a UserWarning from its own float(loss)
        ok, msg = mutant_verdict(NB, "3.1", FN, [("return loss.detach()", "return loss")], seed=0)
    assert ok, msg
