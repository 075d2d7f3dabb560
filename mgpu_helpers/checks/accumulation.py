"""Checks of notebook 05: 5.1 accumulation = one big batch, 5.2 DDP accumulation that all-reduces once; against
a single process on the big batch, collectives counted."""

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from ..accumulation import AllReduceCount, flat_grads
from ..memory import make_batch, mlp
from ..runtime.launch import rank_device
from .base import (Check, CheckFailure, CollectiveLedger, collective_mismatch, expect, expect_close,
                   expect_equal, expect_type, plain, run_learner_ranks)


def _model_case(rng, k: int, m: int) -> dict:
    widths = [rng.randint(4, 24)] + [rng.randint(8, 40) for _ in range(rng.randint(1, 2))] + [rng.randint(3, 6)]
    return {"widths": widths, "k": k, "micro": m, "seed": rng.randrange(2**31)}


def _data(case, world=1):
    x, y = make_batch(world * case["k"] * case["micro"], case["widths"][0], case["widths"][-1], case["seed"] + 1)
    if case.get("pad"):  # padding: targets -100, which F.cross_entropy ignores; a different count per micro-batch
        g, m = torch.Generator().manual_seed(case["seed"] + 2), case["micro"]
        for j, pads in enumerate(torch.randperm(m, generator=g)[:case["k"]].tolist()):  # 0..m-1, all different
            y[j * m:j * m + pads] = -100  # each micro-batch keeps at least one counted target
    return x, y


def _prefill(model, case):
    """Gradients already in .grad when the function is called (the caller's, from earlier micro-batches)."""
    g = torch.Generator().manual_seed(case["seed"] + 3)
    for p in model.parameters() if case.get("prefilled") else ():
        p.grad = torch.randn(p.shape, generator=g)
    return flat_grads(model)


def _summed(widths, seed, x, y):
    """Single-process reference: gradient and value of the SUMMED loss over (x, y)'s counted targets, their count."""
    model = mlp(widths, seed=seed)
    (loss := F.cross_entropy(model(x), y, reduction="sum")).backward()
    return flat_grads(model), loss.item(), int((y != -100).sum())


def _grads_of(widths, seed, x, y):
    """Gradients of the mean loss over (x, y), and that loss."""
    g, loss, n = _summed(widths, seed, x, y)
    return g / n, loss / n


def _run_counted(model, call):
    sizes, grads_seen = [], []  # each forward's batch size (did the learner split?) and .grad's sum before it

    def seen(mod, args):  # returns None: a pre-hook's return value would replace the input
        sizes.append(len(args[0]))
        grads_seen.append(sum(float(p.grad.detach().double().sum()) for p in model.parameters() if p.grad is not None))
    with model.register_forward_pre_hook(seen):
        loss = call()
    return {"loss": plain(loss), "grads": flat_grads(model), "forward_batches": sizes, "grads_seen": grads_seen}


def _expect_split(who, res, k, m):
    expect_equal(res["forward_batches"], [m] * k, f"{who}the batch sizes the model's forward saw", mistakes={
        "one forward over the whole batch: that is the big batch itself, not k micro-batches": [k * m]},
        hint="Hint: split inputs and targets into k micro-batches (tensor_split); run each through the model.")
    seen = res["grads_seen"]  # a backward between two forwards changes .grad
    expect(all(a != b for a, b in zip(seen, seen[1:])), f"{who}no backward ran between two micro-batches' "
           "forwards: it matches a common mistake: the losses were summed and backward called once at the end. "
           "The gradients are right, but every micro-batch's activations stay alive until that one backward "
           "-- the memory accumulation exists to save. Hint: call backward() on each micro-batch's loss before "
           "the next forward.")


def _expect_loss(who, res, loss, mistakes, hint):
    expect_type(res["loss"], (float, int), f"{who}the function", "a float: the accumulated loss",
                hint="Hint: a Python number, as loss.item() gives, not a tensor (which would keep its graph alive).")
    expect_close(res["loss"], loss, f"{who}the returned loss", rtol=1e-4, mistakes=mistakes, hint=hint)


class AccumulateGradients(Check):
    id, function = "5.1", "accumulate_gradients"

    def cases(self, rng):
        k = rng.choice([2, 3, 4])
        return [_model_case(rng, k, rng.choice([m for m in range(3, 7) if m != k])),  # every mistake shows
                dict(_model_case(rng, rng.randint(4, 8), 1), prefilled=True),        # one sample each; .grad set
                dict(_model_case(rng, 1, rng.randint(2, 8)), pad=True),              # k=1: the big batch itself
                dict(_model_case(rng, rng.randint(2, 4), rng.randint(4, 6)), pad=True, prefilled=True)]

    def run(self, fn, case):
        model, (x, y) = mlp(case["widths"], seed=case["seed"]), _data(case)
        _prefill(model, case)
        return _run_counted(model, lambda: fn(model, F.cross_entropy, x, y, case["k"]))

    def judge(self, case, result):
        k, m, (x, y) = case["k"], case["micro"], _data(case)
        g0 = _prefill(mlp(case["widths"], seed=case["seed"]), case)
        parts = [_summed(case["widths"], case["seed"], xm, ym) for xm, ym in zip(x.tensor_split(k), y.tensor_split(k))]
        n = sum(c for _, _, c in parts)
        base, loss = sum(g for g, _, _ in parts) / n, sum(v for _, v, _ in parts) / n
        means = sum(g / c for g, _, c in parts)  # the sum of the micro-batches' mean-loss gradients
        _expect_split("", result, k, m)
        expect_close(result["grads"], g0 + base, "the accumulated gradient (added to what .grad held)", rtol=1e-4,
                     mistakes={
            "weighted each micro-batch's mean loss by 1/k: with padding the micro-batches count different numbers "
            "of targets, so their means are not equal shares of the big batch's mean (the 2024 transformers "
            "Trainer bug). Divide each micro-batch's summed loss by the whole batch's count": g0 + means / k,
            "zeroed the gradients already in .grad (zero_grad at the start): they are the caller's; "
            "accumulate into them": base,
            "loss not divided by k: each micro-batch's mean added whole, k× too large": g0 + means,
            "zero_grad inside the loop: only the last micro-batch's gradients survive": parts[-1][0] / n,
            "gradients zeroed after the last backward": torch.zeros_like(base),
            "counted the padding: divided by the number of rows, not of counted targets (targets == -100 are "
            "ignored)": g0 + base * n / len(y),
            "divided the micro-batch's MEAN loss by the count: loss_fn already averaged it; take "
            "reduction='sum'": g0 + means / n,
            "divided by the micro-batch size instead of k: loss_fn already averages over it": g0 + means / m,
        }, hint="Hint: loss_fn(model(x), y, reduction='sum') / (the whole batch's count of targets != -100) "
                "for each micro-batch, backward, and zero nothing.")
        _expect_loss("", result, loss, {
            "summed the micro-batch losses without dividing": sum(v / c for _, v, c in parts),
            "returned only the last micro-batch's share (total = instead of total +=)": parts[-1][1] / n},
            "Hint: return the sum of the k shares: the big batch's mean loss over its counted targets.")


def _ddp_case(rank, world, fn, case):
    """One rank of check 5.2 (also the script): fn accumulates on this rank's shard; all-reduces counted."""
    dev = rank_device()
    model = mlp(case["widths"], seed=case["seed"]).to(dev)
    ddp = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None, bucket_cap_mb=case["bucket_cap_mb"])
    count = AllReduceCount(ddp)
    x, y = (t.tensor_split(world)[rank].to(dev) for t in _data(case, world))
    # DDP's first backward uses one bucket, then rebuilds them; a real loop is past that: one step first.
    F.cross_entropy(ddp(x), y).backward()
    ddp.zero_grad(set_to_none=True)
    count.calls, forwards = 0, []
    model.register_forward_pre_hook(lambda mod, args: forwards.append(1))
    count.ledger, count.tag = CollectiveLedger(), lambda: len(forwards)  # tag: the micro-step
    out = _run_counted(model, lambda: fn(ddp, F.cross_entropy, x, y, case["k"]))
    out["mismatch"], count.ledger = count.ledger.finish(), None
    out["allreduces"], count.calls = count.calls, 0
    ddp.zero_grad(set_to_none=True)
    F.cross_entropy(ddp(x), y).backward()  # the reference: how many bucket all-reduces ONE sync takes
    out["buckets_per_sync"] = count.calls
    return out


def _judge_rank(case, rank, world, res):
    k, m, (x, y) = case["k"], case["micro"], _data(case, world)
    base, _ = _grads_of(case["widths"], case["seed"], x, y)
    xs, ys = x.tensor_split(world)[rank], y.tensor_split(world)[rank]
    local, loss = _grads_of(case["widths"], case["seed"], xs, ys)
    firsts = [_grads_of(case["widths"], case["seed"], x.tensor_split(world)[r][:m], y.tensor_split(world)[r][:m])[0]
              for r in range(world)]  # each rank's first micro-batch
    _expect_split(f"rank {rank}: ", res, k, m)
    expect_close(res["grads"], base, f"rank {rank}: the accumulated gradient", rtol=1e-4, mistakes={
        "loss not divided by k: gradients are k× too large": k * base,
        "synchronised on the FIRST micro-step instead of the last: the later micro-batches' gradients were never "
        "all-reduced, so each rank kept its own of those (ranks disagree)":
            local + (sum(firsts) / world - firsts[rank]) / k,
        "no_sync on every micro-step, including the last: gradients were never all-reduced, so each rank "
        "kept only its own (ranks disagree)": local,
    }, hint="Hint: loss/k on every micro-step; the first k-1 inside ddp_model.no_sync(), the last outside it, "
            "so that DDP averages what was accumulated.")
    b, n_tensors = res["buckets_per_sync"], 2 * (len(case["widths"]) - 1)
    expect(1 <= b <= n_tensors, f"rank {rank}: one synchronised backward all-reduced {b} buckets, not 1 to {n_tensors}")
    expect_equal(res["allreduces"], b, f"rank {rank}: gradient all-reduces during the {k} micro-steps "
                 f"(one sync = {b} bucket{'s' * (b > 1)})", mistakes={
        f"no no_sync (or the forward ran outside it: DDP decides in forward): all {k} micro-steps all-reduced, "
        "k× the collectives": k * b,
        "no_sync on every micro-step, including the last: gradients never all-reduced": 0})
    _expect_loss(f"rank {rank}: ", res, loss, {
        "summed the micro-batch losses without dividing by k": k * loss,
        "returned only the last micro-batch's loss/k (total = instead of total +=)":
            _grads_of(case["widths"], case["seed"], xs[-m:], ys[-m:])[1] / k},
        "Hint: return the sum of the k values of loss/k: the big batch's mean loss.")


class AccumulateDDP(Check):
    id, function = "5.2", "accumulate_ddp"

    def cases(self, rng):
        cases = [dict(_model_case(rng, k, rng.randint(2, 4)), world=2) for k in rng.sample([2, 3, 4], 3)] + [
            dict(_model_case(rng, rng.randint(2, 4), rng.randint(2, 4)), world=1)]  # one rank: DDP still syncs
        for c in cases:  # a bucket cap that splits the gradients into a few buckets, so counts are telling
            n = sum((a + 1) * b for a, b in zip(c["widths"][:-1], c["widths"][1:]))
            c["bucket_cap_mb"] = 4 * n / rng.randint(2, 4) / 2**20
        return cases

    def run(self, fn, case):
        return {"ranks": run_learner_ranks(_ddp_case, case["world"], fn, case, timeout=15)}

    def judge(self, case, result):
        mismatch = next((r["mismatch"] for r in result["ranks"] if r["mismatch"]), None)
        if mismatch:
            raise CheckFailure(collective_mismatch(mismatch, tag="micro-step") + ". Hint: every rank runs the "
                               "same micro-steps, with the same no_sync choices.")
        for rank, res in enumerate(result["ranks"]):
            _judge_rank(case, rank, case["world"], res)


def script(rank, world, k=4):
    """``torchrun --nproc-per-node 2 -m mgpu_helpers.checks accumulation``: the reference loop on DDP, judged."""
    from .references import accumulate
    case = {"widths": [32, 64, 64, 10], "k": k, "micro": 4, "seed": 0, "bucket_cap_mb": 0.01}
    res = _ddp_case(rank, world, accumulate, case)
    _judge_rank(case, rank, world, res)  # raises if the gradients or the counts are wrong
    return (f"DDP accumulation over {world} ranks, k={k}: gradients equal the single-process big batch; "
            f"{res['allreduces']} bucket all-reduces in all = one sync ({res['buckets_per_sync']} buckets), not {k}×")
