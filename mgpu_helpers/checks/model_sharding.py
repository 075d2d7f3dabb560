"""Checks of notebook 09: 9.1 a GPipe step over send/recv (against one process on the whole batch, the step
clock recorded), 9.2 the tensor-parallel MLP (against the dense MLP, all_reduces counted); and the script."""

from itertools import combinations

import torch
import torch.distributed as dist
from torch.nn import functional as F

from ..memory import make_batch
from ..model_sharding import (StepRecorder, Stuck, make_mlp, make_model, param_bytes, parameter_bytes_formula,
                              single_process_step, stage_bounds)
from ..runtime.comm_log import CommLog
from ..runtime.launch import rank_device
from .base import (REGISTRY, CheckFailure, RemembersVerdict, expect, expect_close, expect_equal, expect_type, plain,
                   scalar)  # plain: a rank hands back CPU tensors


# --- check 9.1: the pipeline step --------------------------------------------------------------------

def _pipe_rank(rank, world, fn, case):
    model = make_model(case["n_layers"], case["width"], case["seed"])
    x, y = make_batch(case["batch"], case["width"], case["width"], case["seed"] + 1)
    try:
        with StepRecorder(model, stage_bounds(case["n_layers"], world)[rank][0]) as rec:
            loss, stuck = fn(model, x, y, case["n_micro"]), None
    except Stuck as e:
        loss, stuck = None, str(e)
    except ValueError as e:
        return {"raised": f"ValueError: {e}"}
    return {"grads": [plain(p.grad) for p in model.parameters()], "loss": scalar(loss), "stuck": stuck,
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
    rank_fn = staticmethod(_pipe_rank)

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

    def judge(self, case, result):
        p, n, m, b = case["world_size"], case["n_layers"], case["n_micro"], case["batch"]
        raised = [r.get("raised") for r in result]
        if b % m:
            expect(all(raised), f"n_micro={m} does not divide the batch of {b}: every rank must raise ValueError "
                   f"(naming n_micro), but {sum(not r for r in raised)} rank(s) returned")
            return
        expect(not any(raised), f"a rank raised {next(filter(None, raised), '')} although n_micro={m} divides {b}")
        if any(r["stuck"] for r in result):
            _deadlock(result)
        model = make_model(n, case["width"], case["seed"])
        x, y = make_batch(b, case["width"], case["width"], case["seed"] + 1)
        loss = single_process_step(model, x, y)
        ref = [q.grad for q in model.parameters()]
        owned = [[i for i in range(n) if res["grads"][2 * i] is not None] for res in result]
        want = [list(range(a, b)) for a, b in stage_bounds(n, p)]
        expect(p == 1 or owned[-1] != want[-1] or any(owned[:-1]), f"only the last stage's parameters have a .grad; "
               f"ranks 0..{p - 2} have .grad None: the gradient was never sent back (each stage must backward its "
               "saved outputs with the gradient it receives from the next rank, then send its input's gradient on)")
        expect_equal(owned, want, "the layers with a gradient on each rank", mistakes=_other_splits(n, p),
                     hint=f"Stages are contiguous, the first {n % p} rank(s) one layer more.")
        for r in reversed(range(p)):  # from the loss backwards: the first rank that differs is where it went wrong
            res = result[r]
            got = torch.cat([res["grads"][k].flatten() for i in owned[r] for k in (2 * i, 2 * i + 1)])
            want = torch.cat([ref[k].flatten() for i in owned[r] for k in (2 * i, 2 * i + 1)])
            last = r == p - 1
            expect_close(got, want, f"rank {r}'s gradients (layers {owned[r]}{', the last stage' * last})", rtol=1e-4,
                         atol=1e-6, mistakes={"loss not divided by n_micro: the micro-batch losses add up to "
                                              "n_micro × the batch's mean": m * want} if last else None,
                         hint="Hint: the last stage backwards cross_entropy(out, y) / n_micro for each micro-batch."
                         if last else f"The later stages' gradients are right, so what reached rank {r}'s backward "
                         "is off: each saved output must be backwarded with the gradient of *that* micro-batch's "
                         f"output, received from rank {r + 1} -- both ranks must run the micro-batches' backwards "
                         "in the same order -- and the gradient sent back must be x.grad of the same micro-batch's "
                         "input.")
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


# --- check 9.2: the tensor-parallel MLP --------------------------------------------------------------

def _tp_rank(rank, world, fn, case):
    dense = make_mlp(case["d"], case["h"], case["seed"])
    try:
        mod = fn(dense, rank, world)
    except ValueError as e:
        return {"raised": f"ValueError: {e}"}
    del dense  # what the rank's module keeps alive is what it costs
    out = {"shapes": {name: tuple(q.shape) for name, q in mod.named_parameters()}, "param_bytes": param_bytes(mod)}
    g = torch.Generator().manual_seed(case["seed"] + 1)
    x = torch.randn(case["batch"], case["d"], generator=g).to(rank_device()).requires_grad_()
    gy = torch.randn(case["batch"], case["d"], generator=g).to(rank_device())
    try:  # a wrong split fails here: the judge names it from the shapes first
        with CommLog() as forward:
            y = mod(x)
        with CommLog() as backward:
            (y * gy).sum().backward()
    except RuntimeError as e:
        return {**out, "error": f"RuntimeError: {str(e).splitlines()[0] if str(e) else ''}"}
    return {**out, "y": plain(y), "x_grad": plain(x.grad), "forward_calls": forward.counts.get("all_reduce", 0),
            "backward_calls": backward.counts.get("all_reduce", 0),
            "grads": {name: plain(q.grad) for name, q in mod.named_parameters()}}


def _partial(dense, x, gy, rank, world):
    """Rank ``rank``'s partial output (bias excluded) and partial input gradient: the reference with no all_reduce."""
    from .references import TensorParallelMLP
    tp, xr = TensorParallelMLP(dense, rank, world), x.detach().requires_grad_()  # x's own .grad stays the reference
    out = F.linear(torch.relu(tp.fc1(xr)), tp.fc2.weight)
    (out * gy).sum().backward()
    return out.detach(), xr.grad


class ParallelMLPCheck(RemembersVerdict):
    id, function, points = "9.2", "parallel_mlp", 3
    rank_fn = staticmethod(_tp_rank)
    hints = {"a leaf Variable that requires grad is being used in an in-place operation":  # torch's words
             "copying the shards into the new module's parameters (param.copy_(...)) is an in-place op on a leaf "
             "that requires grad: do it under `with torch.no_grad():`",
             "modified by an inplace operation": "dist.all_reduce works in place: inside the autograd.Function, "
             "all-reduce a clone (total = partial.clone(); dist.all_reduce(total)), never a tensor autograd saved"}

    def cases(self, rng):
        def case(n, bad=False):
            d = n * rng.randint(max(1, 3 // n), max(1, 12 // n))  # a multiple of n: a wrong split shows
            h = n * rng.randint(2, 6) + (rng.randint(1, n - 1) if bad else 0)
            return {"world_size": n, "d": d, "h": h, "batch": rng.randint(2, 6), "seed": rng.randrange(2**31)}
        return [case(3, bad=True), case(2), case(4), case(1), case(3)]  # the first: h not divisible by 3

    def judge(self, case, result):
        n, d, h = case["world_size"], case["d"], case["h"]
        raised = [r.get("raised") for r in result]
        if h % n:
            expect(all(raised), f"h={h} is not divisible by world_size={n}: every rank must raise ValueError "
                   f"(naming the hidden size), but {sum(not r for r in raised)} rank(s) returned a module")
            return
        expect(not any(raised), f"a rank raised {next(filter(None, raised), '')} although {n} divides h={h}")
        part = h // n
        want = {"fc1.weight": (part, d), "fc1.bias": (part,), "fc2.weight": (d, part), "fc2.bias": (d,)}
        wrong = {"fc1.weight": {"split W1 along dim 1 (its inputs): column-parallel fc1 splits its output "
                                "features, dim 0 of nn.Linear's weight": (h, d // n), "W1 not split": (h, d)},
                 "fc1.bias": {"b1 not split with W1's rows": (h,)},
                 "fc2.weight": {"split W2 along dim 0 (its outputs): row-parallel fc2 splits its input features, "
                                "dim 1 of nn.Linear's weight": (d // n, h), "W2 not split": (d, h)},
                 "fc2.bias": {"b2 split: it is added once, after the all_reduce, so every rank keeps all of it":
                              (d // n,)}}
        for r, res in enumerate(result):
            expect_equal(sorted(res["shapes"]), sorted(want), f"rank {r}: the module's parameter names",
                         hint="Keep exactly fc1 and fc2 (nn.Linear) with this rank's shards; no copy of the dense MLP.")
            for name, shape in want.items():
                expect_equal(res["shapes"][name], shape, f"rank {r}: {name}'s shape", mistakes=wrong[name])
        for r, res in enumerate(result):
            expect("error" not in res, f"rank {r}'s forward or backward raised {res.get('error')}"
                   + (f" -- Hint: {self.hint(res['error'])}" if "error" in res and self.hint(res["error"]) else ""))
        dense, g = make_mlp(case["d"], case["h"], case["seed"]), torch.Generator().manual_seed(case["seed"] + 1)
        x = torch.randn(case["batch"], case["d"], generator=g).to(rank_device()).requires_grad_()  # as _tp_rank's
        gy = torch.randn(case["batch"], case["d"], generator=g).to(rank_device())
        y = dense(x)
        (y * gy).sum().backward()
        y = y.detach()
        full, formula = parameter_bytes_formula(d, h, 1), parameter_bytes_formula(d, h, n)
        shard = {"W1": 4 * d * part, "b1": 4 * part, "W2": 4 * d * part}  # a view costs its whole tensor: N×
        views = {formula + sum((n - 1) * shard[k] for k in ks) for i in (1, 2, 3) for ks in combinations(shard, i)}
        views -= {formula}
        fwd, bwd = [res["forward_calls"] for res in result], [res["backward_calls"] for res in result]
        for calls, when in ((fwd, "forward"), (bwd, "backward")):
            if sum(fwd + bwd) and len(set(calls)) > 1:  # seen only when the learner calls dist.all_reduce
                raise CheckFailure(f"ranks disagree in {when}: " + ", ".join(
                    f"rank {r} made {c} all_reduce calls" for r, c in enumerate(calls)))
        for r, res in enumerate(result):
            partial_y, partial_xg = _partial(dense, x, gy, r, n)
            expect_close(res["y"], y, f"rank {r}'s output", rtol=1e-4, atol=1e-5, mistakes={
                f"fc2's bias added on every rank before the all_reduce: counted {n} times": y + (n - 1) * dense.fc2.bias,
                "no all_reduce in forward: this rank's output is only its partial sum": partial_y + dense.fc2.bias,
                "no all_reduce in forward, and the bias left out": partial_y})
            expect_close(res["x_grad"], x.grad, f"rank {r}'s gradient of the input x", rtol=1e-4, atol=1e-5, mistakes={
                "no all_reduce in backward (f): x's gradient is only this rank's partial sum": partial_xg,
                "g's backward all-reduces too (a differentiable all_reduce as g): gradients N× too large": n * x.grad},
                hint="Hint: f = identity forward, all_reduce backward; g = all_reduce forward, identity backward.")
            rows = slice(r * part, (r + 1) * part)
            for name, ref in (("fc1.weight", dense.fc1.weight.grad[rows]), ("fc1.bias", dense.fc1.bias.grad[rows]),
                              ("fc2.weight", dense.fc2.weight.grad[:, rows]), ("fc2.bias", dense.fc2.bias.grad)):
                expect_close(res["grads"][name], ref, f"rank {r}'s {name}.grad", rtol=1e-4, atol=1e-5, mistakes={
                    "g's backward all-reduces too (a differentiable all_reduce as g): gradients N× too large": n * ref})
            got = res["param_bytes"]
            expect(got not in views, f"rank {r}: parameter bytes (tracker) are {got}, expected {formula}: it matches "
                   "a common mistake: shards that are views of the dense weights (sliced without .clone()): a view "
                   "keeps its whole tensor alive, so the rank still holds all of it")
            expect_equal(got, formula, f"rank {r}: parameter bytes (tracker)",
                         hint=f"1/{n} of W1, b1, W2 plus the whole b2: {formula} bytes of {full}.")
        if sum(fwd + bwd):
            expect_equal(fwd[0], 1, "all_reduce calls per rank in forward (g)")
            expect_equal(bwd[0], 1, "all_reduce calls per rank in backward (f)")


def script(rank, world):
    """``torchrun --nproc-per-node 2 -m mgpu_helpers.checks model_sharding``: the references, judged by 9.1 and 9.2
    on every rank (a wrong result raises)."""
    from .references import TensorParallelMLP, gpipe_step
    pipe = {"world_size": world, "n_layers": world + 1, "n_micro": 4, "batch": 16, "width": 32, "seed": 0}
    tp = {"world_size": world, "d": 32, "h": 240, "batch": 8, "seed": 0}
    for check, rank_fn, fn, case in ((REGISTRY["9.1"], _pipe_rank, gpipe_step, pipe),
                                     (REGISTRY["9.2"], _tp_rank, TensorParallelMLP, tp)):
        results = [None] * world
        dist.all_gather_object(results, rank_fn(rank, world, fn, case))
        check.judge(case, results)
    return (f"world size {world} ({dist.get_backend()}): GPipe, {pipe['n_layers']} layers in {world} stages "
            f"{[e - s for s, e in stage_bounds(pipe['n_layers'], world)]}, 4 micro-batches: gradients and loss equal "
            f"one process: True; tensor-parallel MLP d=32 h=240: output and gradients equal the dense MLP: True; "
            f"parameter bytes per rank {results[rank]['param_bytes']} (formula "
            f"{parameter_bytes_formula(32, 240, world)}, dense {parameter_bytes_formula(32, 240, 1)})")
