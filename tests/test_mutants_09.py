"""Each check of notebook 09 passes the solution, fails the stub, and names planted mistakes under 20 seeds."""
from pathlib import Path

import pytest

import mgpu_helpers.checks.model_sharding  # noqa: F401  (registers 9.1 and 9.2)
from mgpu_helpers.model_sharding import pipeline
from mgpu_helpers.tools.authoring import mutant_fails_every_seed
from testkit import marked, mistake_params, solution_passes_stub_fails

NB = Path(__file__).resolve().parent.parent / "solutions" / "09_model_sharding.ipynb"

LOSS = "out = F.cross_entropy(out, y) / n_micro "
START = "start = rank * per + min(rank, extra)"
BACKWARD = """        else:
            grad = torch.empty_like(out)
            dist.recv(grad, src=rank + 1)                # d(loss)/d(our output), from the next stage
            out.backward(grad)
        if not first:
            dist.send(x.grad, dst=rank - 1)              # d(loss)/d(our input), to the previous stage
"""
SEND_FWD = "dist.send(out.detach(), dst=rank + 1)"
CHECK_M = """    if len(inputs) % n_micro:
        raise ValueError(f"n_micro={n_micro} does not divide the batch of {len(inputs)} samples")
"""
W1 = "self.fc1.weight.copy_(dense.fc1.weight[rows])"
W2 = "self.fc2.weight.copy_(dense.fc2.weight[:, rows])"
CHECK_H = """            if h % world_size:
                raise ValueError(f"hidden size h={h} is not divisible by world_size={world_size}")
"""
CASES = {
    "9.1": ("pipeline_step", [
        ([(BACKWARD, "")], "the gradient was never sent back"),
        ([("dist.send(x.grad, dst=rank - 1)", "pass")], "waited for a message that never came"),
        ([(SEND_FWD, SEND_FWD + "\n            dist.recv(torch.empty_like(out), src=rank + 1)")], "deadlocked"),
        ([(LOSS, "out = F.cross_entropy(out, y) ")], "loss not divided by n_micro"),
        ([("per, extra = divmod(len(model), world)", "per, extra = len(model) // world, 0")], "belong to no stage"),
        ([(START, "start = rank * per")], "neighbouring stages overlap"),
        ([(START, "start = rank * per + max(0, rank - (world - extra))"),
          ("per + (rank < extra)", "per + (rank >= world - extra)")], "the extra layers went to the last ranks"),
        ([("zip(inputs.chunk(n_micro), targets.chunk(n_micro))", "[(inputs, targets)]"), (LOSS, "out = F.cross_entropy(out, y) ")],
         "one forward over the whole batch"),
        ([(CHECK_M, "")], "every rank must raise ValueError"),
        # the two places learners stick: the received activation untracked; neighbours' backward orders differ
        ([("            x.requires_grad_() ", "            pass ")], "call x.requires_grad_() on it"),
        ([("    for x, out in saved: ", "    for x, out in (saved[::-1] if last else saved): ")],
         "must run the micro-batches' backwards in the same order"),
    ]),
    "9.2": ("parallel_mlp", [
        ([("dist.all_reduce(grad)", "pass")], "no all_reduce in backward (f)"),
        ([("dist.all_reduce(total)", "pass")], "no all_reduce in forward"),
        ([("return Reduce.apply(partial) + self.fc2.bias", "return Reduce.apply(partial + self.fc2.bias)")],
         "fc2's bias added on every rank before the all_reduce"),
        ([("return Reduce.apply(partial) + self.fc2.bias",
           "return torch.distributed.nn.functional.all_reduce(partial) + self.fc2.bias")], "g's backward all-reduces too"),
        ([(W1, "self.fc1.weight = nn.Parameter(dense.fc1.weight.chunk(world_size, dim=1)[rank].clone())")],
         "split W1 along dim 1"),
        ([(W2, "self.fc2.weight = nn.Parameter(dense.fc2.weight.chunk(world_size, dim=0)[rank].clone())")],
         "split W2 along dim 0"),
        ([(W1, "self.fc1.weight = nn.Parameter(dense.fc1.weight[rows])"),
          (W2, "self.fc2.weight = nn.Parameter(dense.fc2.weight[:, rows])")], "views of the dense weights"),
        ([(CHECK_H, "")], "every rank must raise ValueError"),
        ([("            with torch.no_grad():                    # copies", "            if True:  # copies")],
         "under `with torch.no_grad():`"),
    ]),
}


PARAMS = mistake_params(CASES)


@pytest.mark.parametrize("ex", [marked(e) for e in CASES])
def test_solution_passes_and_stub_fails(ex):
    solution_passes_stub_fails(NB, ex, CASES[ex][0])


@pytest.mark.parametrize("ex,edits,named", PARAMS)
def test_planted_mistake_is_named_under_every_seed(ex, edits, named, monkeypatch):
    # A deadlock costs the recorder's timeout per seed: 0.5 s (forked ranks inherit it) keeps 20 seeds short.
    monkeypatch.setattr(pipeline, "P2P_TIMEOUT", 0.5)
    mutant_fails_every_seed(NB, ex, CASES[ex][0], edits, named)
