"""Check of notebook 07: 7.1 segments of k blocks under checkpointing; gradients against the plain step, the peak
against ``predict_peak`` (exact, proven against the tracker), the recomputed blocks recorded."""

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointError

from ..checkpointing import (Stack, no_checkpointing, plan_for, predict_peak, segments)
from ..memory import make_batch
from ..runtime.tracker import MemoryTracker
from .base import Check, describe_value, expect, expect_close, expect_equal, flat


def _case(rng, layers, k, seed=None):
    d = rng.choice([8, 16])
    # activations dominate (batch >= 16·d): the regime checkpointing is for, where predict_peak is exact
    return {"layers": layers, "k": k, "d": d, "h": rng.choice([2, 3, 4]) * d, "classes": rng.randint(2, 8),
            "batch": rng.choice([16, 32]) * d, "seed": rng.randrange(2**31) if seed is None else seed}


def _problem(case, dropout=True):
    """The case's stack (with its dropout, unless ``dropout=False``), its batch and targets."""
    model = Stack(case["layers"], case["d"], case["h"], case["classes"], seed=case["seed"],
                  dropout=case.get("dropout", 0.0) if dropout else 0.0)
    return (model, *make_batch(case["batch"], case["d"], case["classes"], seed=case["seed"]))


def _mistake_plans(L, k):
    plans = {"checkpointed every block on its own, whatever k (segments of 1 block)": plan_for(L, 1),
             "no checkpointing at all": plan_for(L, None),
             "checkpointed only the blocks i with i % k == 0, each on its own: that saves L/k blocks' "
             "activations and keeps the rest, not the sqrt(L) trade-off": [(1, i % k == 0) for i in range(L)]}
    if k > 1:
        plans["segments of k - 1 blocks (off by one)"] = plan_for(L, k - 1)
    if k < L:
        plans["one segment for the whole stack (as if k = L): backward recomputes every block at once"] = \
            plan_for(L, L)
        plans["segments of k + 1 blocks (off by one)"] = plan_for(L, k + 1)
        plans["block 0 left out (segments started at block 1)"] = [(1, False)] + [
            (stop - start, True) for start, stop in segments(L - 1, min(k, L - 1))]
    return plans


def _stale(recomputed: list) -> str:
    """Name what the blocks re-run in backward show ([block, got its forward input?] in order), or ""."""
    blocks = [b for b, _ in recomputed]
    if len(set(blocks)) < len(blocks):  # a block re-run twice: every recomputation ran the same segment
        return ("it matches a common mistake: the recomputation ran the wrong blocks (block "
                f"{max(set(blocks), key=blocks.count)} again and again): the checkpointed function reads loop "
                "variables (start, the slice of blocks, perhaps x) instead of receiving them as arguments, and by "
                "backward time they hold the last segment's values. Hint: pass the segment and its input: "
                "checkpoint(run_segment, blocks[start:start + k], x, use_reentrant=False).")
    starts = [same for j, (b, same) in enumerate(recomputed) if j == 0 or recomputed[j - 1][0] != b - 1]
    if not all(starts):
        return ("it matches a common mistake: the segment's input was not passed to checkpoint as an argument, so "
                "the function reads the loop's x -- at backward time it holds its final value and the "
                "recomputation runs on the wrong input. Hint: checkpoint(function, *its inputs, use_reentrant=False).")
    return ""


class CheckpointEvery(Check):
    id, function = "7.1", "checkpoint_segments"

    def cases(self, rng):
        fixed = [_case(rng, 8, 3), _case(rng, 6, 1), _case(rng, 5, 5), _case(rng, 9, 2)]
        random_ = [_case(rng, L, rng.randint(2, L - 1)) for L in (rng.randint(4, 12), rng.randint(4, 12))]
        bad = [dict(_case(rng, 4, 0), bad=True), dict(_case(rng, 5, 6), bad=True)]
        cases = fixed + random_
        rng.shuffle(cases)
        # Dropout: the recomputation must draw the same masks as the forward (checkpoint's default
        # preserve_rng_state=True); judged after the others, so a mistake they catch is named there first.
        dropout = [dict(_case(rng, rng.randint(4, 8), 2), dropout=0.5), dict(_case(rng, 5, 5), dropout=0.3)]
        return cases + dropout + bad

    def run(self, fn, case):
        model, x, y = _problem(case)
        if case.get("bad"):
            try:
                fn(model.blocks, x, case["k"])
            except Exception as e:  # noqa: BLE001 - the judge names what was raised instead
                return {"raised": "ValueError" if isinstance(e, ValueError) else type(e).__name__, "message": str(e)}
            return {"raised": None}
        # Which blocks backward re-runs, and whether each gets its forward input (the same storage): names loop
        # variables read inside the checkpointed function. Storage addresses only: the peak is untouched.
        phase, first_input, recomputed = ["forward"], {}, []
        def seen(i, args):  # returns None: a pre-hook's return value would replace the block's input
            ptr = args[0].untyped_storage().data_ptr() if args and isinstance(args[0], torch.Tensor) else -1
            if phase[0] == "forward":
                first_input.setdefault(i, ptr)
            else:
                recomputed.append([i, ptr == first_input.get(i)])

        for i, b in enumerate(model.blocks):
            b.register_forward_pre_hook(lambda m, args, i=i: seen(i, args))
        torch.manual_seed(case["seed"])  # dropout's masks: the judge's plain step draws the same
        with MemoryTracker(model) as mt:
            out = fn(model.blocks, x, case["k"])
            if not isinstance(out, torch.Tensor):
                return {"output": describe_value(out)}
            loss = F.cross_entropy(model.head(out), y)
            del out
            phase[0] = "backward"
            try:
                loss.backward()
            except CheckpointError as e:  # torch compared the recomputation with the forward: they differ
                return {"checkpoint_error": str(e).split("\n\n")[0][:400], "recomputed": recomputed}
        return {"peak": mt.peak_bytes, "grads": [p.grad for p in model.parameters()], "recomputed": recomputed}

    def judge(self, case, result):
        L, k = case["layers"], case["k"]
        if case.get("bad"):
            expect(result.get("raised") == "ValueError",
                   f"k={k} with {L} blocks must raise ValueError (k goes from 1 to the number of blocks); "
                   + ("your function returned normally" if result.get("raised") is None
                      else f"it raised {result['raised']}: {result.get('message', '')}"))
            return
        expect("output" not in result, f"{self.function} returned {result.get('output')}; expected the output "
               "tensor of the last block (batch × d).")
        stale = _stale(result.get("recomputed") or [])
        expect("checkpoint_error" not in result, "backward raised torch's CheckpointError (the recomputation did "
               f"not match the forward): {result.get('checkpoint_error')}\n  " + (stale or "Hint: checkpoint(function, "
               "*its inputs, use_reentrant=False), with everything the function uses passed as an argument."))
        model, x, y = _problem(case)
        torch.manual_seed(case["seed"])
        F.cross_entropy(model.head(no_checkpointing(model.blocks, x)), y).backward()
        names = [n for n, _ in model.named_parameters()]
        grads = result["grads"]
        missing = sorted({int(n.split(".")[1]) for n, g in zip(names, grads) if g is None and n.startswith("blocks")})
        expect(missing != list(range(L)), "no block got a gradient (only the head did): the graph is cut between "
               "the head and the blocks. It matches a common mistake: use_reentrant=True with an input that does not "
               "require grad -- the reentrant variant then returns an output that needs no gradient, so backward "
               "never reaches the blocks; or a detach() of the segments' outputs. Hint: use_reentrant=False, and "
               "pass each segment's output on as it is.")
        if missing:
            tail = missing == list(range(missing[0], L))
            expect(False, f"blocks {missing} got no gradient" + (
                ": it matches a common mistake: the last, shorter segment was never run (k does not divide "
                "the number of blocks)" if tail else "") + ". Hint: every block runs, in order, exactly once.")
        got, ref = flat(grads), flat(p.grad for p in model.parameters())
        if not torch.allclose(got, ref, rtol=1e-4, atol=1e-6):
            expect(not stale, "the gradients differ from the same step without checkpointing: " + stale)
            if case.get("dropout"):
                off = _problem(case, dropout=False)[0]  # same weights
                F.cross_entropy(off.head(no_checkpointing(off.blocks, x)), y).backward()
                expect(not torch.allclose(got, flat(p.grad for p in off.parameters()), rtol=1e-4, atol=1e-6),
                       "the gradients are those of the stack without dropout: it matches a common mistake: dropout "
                       "switched off (the blocks put in eval mode). Hint: leave the blocks' mode alone; "
                       "checkpoint's default preserve_rng_state=True replays the forward's dropout masks.")
            expect(not case.get("dropout"), "the gradients differ from the same step without checkpointing, in a "
                   "stack with dropout (the cases without dropout passed): it matches a common mistake: "
                   "preserve_rng_state=False -- the recomputation draws new dropout masks, so backward "
                   "differentiates another function than the forward computed. Hint: leave checkpoint's "
                   "preserve_rng_state at its default, True.")
        expect_close(got, ref, "the gradients (compared with the same step without checkpointing)", rtol=1e-4,
                     atol=1e-6, hint="Hint: pass each segment's blocks and input to checkpoint as arguments; "
                     "non-reentrant checkpointing gives gradients equal to the plain step.")
        if case.get("dropout"):
            return  # predict_peak models the stack without dropout (whose masks add to the peak)
        shape = (case["d"], case["h"], case["classes"], case["batch"])
        expect_equal(result["peak"], predict_peak(plan_for(L, k), *shape), "the peak bytes of the step, measured "
                     "with MemoryTracker", mistakes={name: predict_peak(plan, *shape)
                                                     for name, plan in _mistake_plans(L, k).items()},
                     hint=f"(The expected value is predict_peak for segments of {k}.) Hint: segments are blocks "
                          f"0..{k - 1}, {k}..{2 * k - 1}, ... (the last may be shorter), each one checkpointed.")
