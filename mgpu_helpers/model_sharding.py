"""Notebook 09 -- model sharding: pipeline parallelism (layers across ranks, exercise 9.1) and tensor
parallelism (one layer's weights across ranks, exercise 9.2). The machinery is in ``pipeline.py`` and
``tensor_parallel.py``; here are the checks and the script.

Run as a script (a GPipe step and a tensor-parallel MLP over every rank, compared with one process)::

    torchrun --nproc-per-node 2 -m mgpu_helpers.model_sharding
    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint $HEAD_NODE:29500 \\
        -m mgpu_helpers.model_sharding          # on each of 2 nodes (tests/test_multinode.py: localhost)
    python -m mgpu_helpers.model_sharding       # no torchrun: 2 ranks via run_ranks
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .checks import REGISTRY, CheckFailure, expect, expect_close, expect_equal, expect_type, run_learner_ranks
from .checks.remember import RemembersVerdict
from .runtime.launch import rank_device, run_ranks, torchrun_main
from .pipeline import (StepRecorder, Stuck, as_intervals, bubble_fraction, gpipe_step, make_batch, make_model,
                       plot_timeline, single_process_step, stage_bounds, step_timeline, wall_timeline)
from .tensor_parallel import (AllReduceCounter, DenseMLP, TensorParallelMLP, check_9_2, make_mlp, param_bytes,
                              parameter_bytes_formula, torch_tensor_parallel)

__all__ = ["check_9_1", "check_9_2", "StepRecorder", "Stuck", "as_intervals", "bubble_fraction", "gpipe_step",
           "make_batch", "make_model", "plot_timeline", "single_process_step", "stage_bounds", "step_timeline",
           "wall_timeline", "AllReduceCounter", "DenseMLP", "TensorParallelMLP", "make_mlp",
           "parameter_bytes_formula", "torch_tensor_parallel", "param_bytes", "passes"]


def passes(check, fn) -> bool:
    """Whether ``fn`` passes ``check`` (quietly): the check cell's verdict on this very function when it has one
    (no second run, no second timeout), else a quiet run."""
    if isinstance(check, RemembersVerdict):
        return check.passed(fn)
    import contextlib
    import io
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            check(fn)
    except AssertionError:
        return False
    return True


def _plain(value):  # a returned loss, as plain data the grader can ship
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value)
    return value if value is None or isinstance(value, (int, float)) else repr(value)[:80]


# --- check 9.1: the pipeline step --------------------------------------------------------------------

def _pipe_rank(rank, world, fn, case):
    model = make_model(case["n_layers"], case["width"], case["seed"])
    x, y = make_batch(case["batch"], case["width"], case["seed"] + 1)
    try:
        with StepRecorder(model, stage_bounds(case["n_layers"], world)[rank][0]) as rec:
            loss, stuck = fn(model, x, y, case["n_micro"]), None
    except Stuck as e:
        loss, stuck = None, str(e)
    except ValueError as e:
        return {"raised": f"ValueError: {e}"}
    return {"grads": [p.grad for p in model.parameters()], "loss": _plain(loss), "stuck": stuck,
            "batches": rec.batches, "steps": rec.steps, "clock": rec.clock}


def _other_splits(n_layers, p):
    per, extra = divmod(n_layers, p)
    at_end = [0] + [min(n_layers, r * per + max(0, r - (p - extra))) for r in range(1, p + 1)]
    return {
        f"n_layers // world_size layers per stage: the last {extra} layer(s) belong to no stage":
            [list(range(r * per, (r + 1) * per)) for r in range(p)],
        "the extra layers went to the last ranks; the first n_layers % world_size ranks take them":
            [list(range(a, b)) for a, b in zip(at_end, at_end[1:])],
        "stage starts at rank * (n_layers // world_size): neighbouring stages overlap":
            [list(range(r * per, r * per + per + (r < extra))) for r in range(p)]}


def _expect_stages(owned, case):
    p, n = case["world_size"], case["n_layers"]
    want = [list(range(a, b)) for a, b in stage_bounds(n, p)]
    if owned == want:
        return
    if p > 1 and owned[-1] == want[-1] and not any(owned[:-1]):
        raise CheckFailure(f"only the last stage's parameters have a .grad; ranks 0..{p - 2} have .grad None: "
                           "the gradient was never sent back (each stage must backward its saved outputs with "
                           "the gradient it receives from the next rank, then send its input's gradient on)")
    named = [name for name, split in _other_splits(n, p).items() if split == owned]
    seen = "; ".join(f"rank {r}: {o}" for r, o in enumerate(owned))
    raise CheckFailure(f"the layers with a gradient on each rank are {seen}; expected {want} (contiguous, the "
                       f"first {n % p} rank(s) one layer more)" + (f": it matches a common mistake: {named[0]}"
                                                                   if named else ""))


def _deadlock(result):
    lines = [f"rank {r} {res['stuck']}" if res.get("stuck") else f"rank {r} returned" for r, res in enumerate(result)]
    head = ("the ranks deadlocked: every rank waited for another" if all(r.get("stuck") for r in result) else
            "some ranks waited for a message that never came (a rank that returned sent less than its peer "
            "expected)")
    raise CheckFailure(head + ":\n    " + ";\n    ".join(lines) + "\n  Hint: every dist.send needs the matching "
                       "dist.recv on the peer, in the same order. GPipe: all forwards (recv from rank-1, compute, "
                       "send to rank+1), then all backwards (recv from rank+1, backward, send to rank-1).")


class PipelineStep(RemembersVerdict):
    id, function, points = "9.1", "pipeline_step", 3

    def cases(self, rng):
        def case(p, n_layers, m, per_micro=None):
            return {"world_size": p, "n_layers": n_layers, "n_micro": m, "batch": m * (per_micro or rng.randint(1, 3)),
                    "width": rng.randint(4, 12), "seed": rng.randrange(2**31)}
        p = rng.choice([2, 3])
        return [{**case(2, 3, 4, 2), "batch": 8 + rng.randint(1, 3)},      # n_micro does not divide the batch
                case(p, rng.choice([n for n in range(p + 1, 3 * p + 1) if n % p]), rng.randint(2, 4)),  # uneven
                case(4, rng.choice([4, 6, 8]), rng.randint(2, 5)),         # 4 stages
                case(1, rng.randint(1, 4), rng.randint(2, 4)),             # world size 1: no send/recv at all
                case(rng.choice([2, 3]), 3, 1)]                            # one micro-batch: the naive pipeline

    def describe(self, case):
        return (f"{case['world_size']} rank(s), {case['n_layers']} layers, batch {case['batch']}, "
                f"n_micro={case['n_micro']}")

    def run(self, fn, case):
        return run_learner_ranks(_pipe_rank, case["world_size"], fn, case, backend="gloo", timeout=15)

    def judge(self, case, result):
        p, n, m, b = case["world_size"], case["n_layers"], case["n_micro"], case["batch"]
        expect(isinstance(result, list) and len(result) == p, f"expected one result per rank ({p})")
        raised = [r.get("raised") for r in result]
        if b % m:
            expect(all(raised), f"n_micro={m} does not divide the batch of {b}: every rank must raise ValueError "
                   f"(naming n_micro), but {sum(not r for r in raised)} rank(s) returned")
            return
        expect(not any(raised), f"a rank raised {next(filter(None, raised), '')} although n_micro={m} divides {b}")
        if any(r["stuck"] for r in result):
            _deadlock(result)
        model = make_model(n, case["width"], case["seed"])
        x, y = make_batch(b, case["width"], case["seed"] + 1)
        loss = single_process_step(model, x, y)
        ref = [q.grad for q in model.parameters()]
        owned = [[i for i in range(n) if res["grads"][2 * i] is not None] for res in result]
        _expect_stages(owned, case)
        for r in reversed(range(p)):  # from the loss backwards: the first rank that differs is where it went wrong
            res = result[r]
            got = torch.cat([res["grads"][k].flatten() for i in owned[r] for k in (2 * i, 2 * i + 1)])
            want = torch.cat([ref[k].flatten() for i in owned[r] for k in (2 * i, 2 * i + 1)])
            if r == p - 1:
                expect_close(got, want, f"rank {r}'s gradients (layers {owned[r]}, the last stage)", rtol=1e-4,
                             atol=1e-6, mistakes={"loss not divided by n_micro: the micro-batch losses add up to "
                                                  "n_micro × the batch's mean": m * want},
                             hint="Hint: the last stage backwards cross_entropy(out, y) / n_micro for each micro-batch.")
            else:
                expect_close(got, want, f"rank {r}'s gradients (layers {owned[r]})", rtol=1e-4, atol=1e-6,
                             hint=f"The later stages' gradients are right, so what reached rank {r}'s backward is "
                             "off: each saved output must be backwarded with the gradient of *that* micro-batch's "
                             f"output, received from rank {r + 1} -- both ranks must run the micro-batches' backwards "
                             "in the same order -- and the gradient sent back must be x.grad of the same "
                             "micro-batch's input.")
        last = result[-1]["loss"]
        expect_type(last, (float, int), "the last rank", "the batch's mean loss (a float)")
        expect_close(last, loss, "the loss returned by the last rank", rtol=1e-4, mistakes={
            "loss not divided by n_micro": m * loss}, hint="Return the sum of the micro-batch losses / n_micro.")
        for r, res in enumerate(result):
            expect_equal(res["batches"], [b // m] * m, f"rank {r}: the batch sizes its stage's forward saw", mistakes={
                "one forward over the whole batch: no micro-batches": [b]},
                hint="Hint: cut the batch into n_micro micro-batches (chunk) and pipeline them one by one.")
        steps, busy = max(res["clock"] for res in result), [len(res["steps"]) for res in result]
        expect_equal(busy, [2 * m] * p, "forward + backward steps of each rank's stage", mistakes={
            "backward of all micro-batches at once: one backward per micro-batch": [m + 1] * p})
        expect_equal(steps, 2 * (m + p - 1), f"the schedule's length in steps (GPipe: 2·(m + p − 1) = "
                     f"{2 * (m + p - 1)})", mistakes={
            "no pipelining: each micro-batch went forward and back through every stage before the next started":
                2 * m * p})


check_9_1 = REGISTRY["9.1"]


# --- the script ---------------------------------------------------------------------------------------

def _script(rank, world):
    dev = rank_device()
    n_layers, n_micro, width, batch, d, h = world + 1, 4, 32, 16, 32, 240
    model = make_model(n_layers, width).to(dev)
    x, y = (t.to(dev) for t in make_batch(batch, width))
    loss = gpipe_step(model, x, y, n_micro)
    base = make_model(n_layers, width).to(dev)
    base_loss = single_process_step(base, x, y)
    a, b = stage_bounds(n_layers, world)[rank]
    pipe_ok = all(torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6)
                  for p, q in zip(model[a:b].parameters(), base[a:b].parameters()))
    pipe_ok &= loss is None or abs(loss - base_loss) < 1e-5 * max(1.0, abs(base_loss))
    dense = make_mlp(d, h).to(dev)
    tp = TensorParallelMLP(dense, rank, world)
    xin = torch.randn(8, d, generator=torch.Generator().manual_seed(2)).to(dev)
    xt, xd = xin.clone().requires_grad_(), xin.clone().requires_grad_()
    yt, yd = tp(xt), dense(xd)
    yt.sum().backward()
    yd.sum().backward()
    rows = slice(rank * h // world, (rank + 1) * h // world)
    tp_ok = (torch.allclose(yt, yd, rtol=1e-4, atol=1e-5) and torch.allclose(xt.grad, xd.grad, rtol=1e-4, atol=1e-5)
             and torch.allclose(tp.fc1.weight.grad, dense.fc1.weight.grad[rows], rtol=1e-4, atol=1e-5))
    flags = torch.tensor([float(pipe_ok), float(tp_ok)], device=dev)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)  # true only where it holds on every rank
    return (f"world size {world} ({dist.get_backend()}): GPipe, {n_layers} layers in {world} stages "
            f"{[e - s for s, e in stage_bounds(n_layers, world)]}, {n_micro} micro-batches: gradients and loss equal "
            f"one process: {bool(flags[0])}; tensor-parallel MLP d={d} h={h}: output and gradients equal the dense "
            f"MLP: {bool(flags[1])}; parameter bytes per rank {param_bytes(tp)} "
            f"(formula {parameter_bytes_formula(d, h, world)}, dense {parameter_bytes_formula(d, h, 1)})")


if __name__ == "__main__":
    if "RANK" in os.environ:
        torchrun_main(_script)
    else:
        print(run_ranks(_script, 2)[0])
