"""Notebook 08 -- the checks of exercises 8.1 (ZeRO-1 ``ShardedOptimizer``) and 8.2 (ZeRO-2
``reduce_scatter_gradients``): every rank against one process training the same model unsharded."""

import warnings
from unittest import mock

import torch
import torch.distributed as dist
from torch.nn import functional as F

from ..memory import make_batch, mlp
from ..runtime.comm_log import CommLog
from ..sharding.zero import Zero2, ceil_div, all_gather_flat, linears, unique
from .base import CheckFailure, RemembersVerdict, expect, expect_close, expect_equal, expect_type, flat

OPTIMIZERS = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW, "SGD": torch.optim.SGD}


def _groups(model, case):
    """The param groups a case passes, as a user would write them -- a tied tensor may appear twice."""
    lins, lr = linears(model), case["kwargs"]["lr"]
    body = lins[:-1] if case["add_group"] else lins
    if case["groups"] == "split":  # two groups with their own hyperparameters; the tie crosses them
        h = case["tie"][1] if case["tie"] else len(body) // 2  # the tie's second user opens group 2
        return [{"params": [p for m in body[:h] for p in m.parameters()]},
                {"params": [p for m in body[h:] for p in m.parameters()], "lr": lr * case["lr_factor"],
                 "weight_decay": 0.0}]
    return [{"params": [p for m in body for p in m.parameters()]}]  # a tie appears twice in this one group


def _train(case, make_opt, model, hparams=True, schedule=True, grad_scale=1.0):
    """``steps`` steps on the full batch (every rank computes the same gradient, as after DDP's all-reduce).
    ``grad_scale``: a baseline's gradients multiplied before each step (a mistake's value, never the learner's)."""
    groups = _groups(model, case) + [{"params": list(linears(model)[-1].parameters()),  # the added group
                                      "lr": case["kwargs"]["lr"] * 2}]
    if not hparams:
        groups = [{"params": g["params"]} for g in groups]
    opt = make_opt(groups[:-1])
    if case["add_group"]:
        opt.add_param_group(groups[-1])
    x, y = make_batch(case["batch"], case["widths"][0], case["widths"][-1], case["seed"] + 1)
    for step in range(case["steps"]):
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        if step == 1 and schedule:  # what an lr scheduler does: write the new lr into param_groups
            for g in opt.param_groups:
                g["lr"] *= 0.5
        for p in unique(model.parameters()):
            if p.grad is not None:
                p.grad.mul_(grad_scale)
        opt.step()
        if step == 0:  # a rank that never receives the others' updates is plainest after one step
            opt.after_first = [p.detach().clone() for p in unique(model.parameters())]
    return opt


def _baseline(case, dedupe=True, **variant):
    model = mlp(case["widths"], seed=case["seed"], tie=case["tie"], freeze=case["freeze"])
    cls = OPTIMIZERS[case["optimizer"]]

    class Plain(cls):  # the unsharded optimizer, given the same groups, deduplicated (its __init__ adds them here)
        def add_param_group(self, g):
            ids = {id(p) for grp in self.param_groups for p in grp["params"]}
            kept = unique(g["params"]) if dedupe else list(g["params"])
            super().add_param_group({**g, "params": [p for p in kept if id(p) not in ids]})

    with warnings.catch_warnings():  # dedupe=False: torch warns of the duplicate in a group
        warnings.simplefilter("ignore")
        opt = _train(case, lambda groups: Plain(groups, **case["kwargs"]), model, **variant)
    return opt.after_first, [p.detach().clone() for p in unique(model.parameters())]


# Bad input: (what ShardedOptimizer is given, the exception it must raise, a word its message must say, the call).
_BAD = [("an optimizer instance", "TypeError", "optimizer_cls",
         lambda cls, p: cls(p, torch.optim.SGD(p, lr=0.1), lr=0.1)),
        ("an lr scheduler class", "TypeError", "optimizer_cls",
         lambda cls, p: cls(p, torch.optim.lr_scheduler.StepLR, lr=0.1)),
        ("a parameter on another device", "ValueError", "device",
         lambda cls, p: cls(p + [torch.nn.Parameter(torch.empty(2, device="meta"))], torch.optim.SGD, lr=0.1))]


def _rank_81(rank, world, cls, case):
    if case["kind"] == "bad input":
        p, out = [torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2))], {}
        for name, _, _, make in _BAD:
            try:
                make(cls, p)
                out[name] = ("no error", "")
            except NotImplementedError:
                raise  # the stub: "not implemented yet", not a wrong exception
            except Exception as e:  # noqa: BLE001 - which exception is the point
                out[name] = (type(e).__name__, str(e))
        return out
    model = mlp(case["widths"], seed=case["seed"], tie=case["tie"], freeze=case["freeze"])
    params = unique(model.parameters())
    first = [p.detach().clone() for p in params]
    opt = _train(case, lambda groups: cls(groups, OPTIMIZERS[case["optimizer"]], **case["kwargs"]), model)
    index, owned = {id(p): i for i, p in enumerate(params)}, set()
    held = (o for v in vars(opt).values() for o in (v if isinstance(v, (list, tuple)) else [v]))  # what it wraps
    for state in [opt.state] + [o.state for o in held if isinstance(o, torch.optim.Optimizer) and o is not opt]:
        owned |= {index[id(p)] for p, s in state.items()
                  if id(p) in index and any(isinstance(v, torch.Tensor) and v.dim() > 0 for v in s.values())}
    return {"params": [p.detach().clone() for p in params], "first": first, "owned": sorted(owned),
            "after_first": getattr(opt, "after_first", None),
            "is_optimizer": isinstance(opt, torch.optim.Optimizer), "groups": len(opt.param_groups)}


def _train_case(rng, world, optimizer, **over):
    kw = {"Adam": {"lr": 0.01}, "AdamW": {"lr": 0.01, "weight_decay": 0.1},
          "SGD": {"lr": 0.1, "momentum": 0.9}}[optimizer]
    h = rng.randint(3, 8)
    return {"kind": "train", "world_size": world, "optimizer": optimizer, "kwargs": kw,
            "widths": [rng.randint(2, 9), h, h, h, rng.randint(2, 5)], "tie": (1, 2), "freeze": [0],
            "groups": "split", "lr_factor": 0.3, "add_group": True, "steps": 3, "batch": 6,
            "seed": rng.randrange(2**31), **over}


class ShardedOptimizerCheck(RemembersVerdict):
    id, function, points = "8.1", "ShardedOptimizer", 3
    rank_fn = staticmethod(_rank_81)

    def cases(self, rng):
        # SGD first: Adam divides by the gradient's own scale, so a rescaled gradient changes an Adam step by
        # ~1e-6 (eps) -- too little to name; under SGD with momentum it changes the update N-fold.
        return [{"kind": "bad input", "world_size": 1},
                _train_case(rng, 4, "SGD", widths=[3, 4, 2], tie=None,   # 4 ranks, 4 trainable tensors: one owning all is unbalanced
                            freeze=[], groups="one", add_group=False),
                _train_case(rng, 2, "AdamW"),                            # groups, tie across them, frozen, add_param_group
                _train_case(rng, 1, "Adam", groups="one"),               # world size 1; the tie twice in ONE group
                _train_case(rng, 3, rng.choice(["Adam", "AdamW", "SGD"]), tie=None,  # uneven sizes
                            widths=[rng.randint(2, 30) for _ in range(4)])]

    hints = {"more than one parameter group": "a tied tensor (one parameter reached from two modules) must be kept "
             "once: drop the parameters already seen before adding a group"}

    def judge(self, case, result):
        if case["kind"] == "bad input":
            for probe, want, word, _ in _BAD:
                kind, msg = result[0][probe]
                expect_equal(kind, want, f"ShardedOptimizer given {probe}: the exception", hint=f"Raise {want}.")
                expect(word in msg, f"ShardedOptimizer given {probe} raised {kind}({msg!r}), which does not "
                       f"mention {word!r}: say what is wrong with which argument")
            return
        world, (base1, base) = case["world_size"], _baseline(case)
        model = mlp(case["widths"], seed=case["seed"], tie=case["tie"], freeze=case["freeze"])
        params = unique(model.parameters())
        trainable = [i for i, p in enumerate(params) if p.requires_grad]
        tied = {i for i, p in enumerate(params) if case["tie"] and p is linears(model)[case["tie"][0]].weight}
        owners = {i: [r for r, res in enumerate(result) if i in res["owned"]] for i in trainable}
        for r, res in enumerate(result):
            expect(res["is_optimizer"], "ShardedOptimizer must subclass torch.optim.Optimizer")
            expect_equal(res["groups"], len(_groups(model, case)) + case["add_group"], f"rank {r}: len(param_groups)",
                         hint="param_groups holds every group, with ALL its parameters (lr schedulers use it).")
        expect(world == 1 or any(len(v) < world for v in owners.values()), "every rank keeps optimizer state for "
               "every parameter: nothing is sharded. ZeRO-1 gives each parameter to one rank, which alone keeps its "
               "state and steps it.")
        for i, rs in owners.items():
            expect(len(rs) <= 1, f"parameter {i} has optimizer state on ranks {rs}: each parameter belongs to "
                   "exactly one rank's share" + (" (it is the tied tensor: keep it once)" if i in tied else ""))
            expect(len(rs) == 1, f"parameter {i} (trainable) has optimizer state on no rank: nobody stepped it"
                   + (" (it was added with add_param_group)" if case["add_group"] and i >= len(base) - 2 else ""))
        self._judge_balance(params, trainable, owners, world)
        variants = {"the param groups' own hyperparameters (lr, weight_decay) ignored: every group used the "
                    "constructor's": dict(hparams=False),
                    "an lr change written into optimizer.param_groups (what a scheduler does) never reached "
                    "the wrapped optimizer": dict(schedule=False),
                    "the wrapped optimizer kept the constructor's hyperparameters: neither the groups' own nor "
                    "later changes to param_groups reached it": dict(hparams=False, schedule=False),
                    "the tied tensor was stepped twice (it appears twice in a group: keep it once)": dict(dedupe=False),
                    f"the gradients were divided by the world size ({world}) before the step: every rank already "
                    "holds the averaged gradient (as after DDP's all-reduce), so the update shrank": dict(
                        grad_scale=1 / world),
                    f"the gradients were summed over the {world} ranks before the step: every rank already holds "
                    "the averaged gradient (as after DDP's all-reduce), so the update grew": dict(grad_scale=world)}
        variants = {k: _baseline(case, **v) for k, v in variants.items()}  # (at one rank, scaling by 1 is right)
        hint = "Expected: exactly what the wrapped optimizer gives in one process."
        for r, res in enumerate(result):
            stale = [b if owners.get(i) == [r] else f for i, (b, f) in enumerate(zip(base1, res["first"]))]
            expect_close(flat(res["after_first"]), flat(base1), f"rank {r}'s parameters after one step", rtol=1e-5,
                         atol=1e-6, hint=hint, mistakes={
                             "other ranks' updated parameters never arrived: each rank has only its own share "
                             "updated (broadcast or all_gather after the step)": flat(stale),
                             **{k: flat(v[0]) for k, v in variants.items()}})
            expect_close(flat(res["params"]), flat(base), f"rank {r}'s parameters after {case['steps']} steps",
                         rtol=1e-5, atol=1e-6, hint=hint, mistakes={k: flat(v[1]) for k, v in variants.items()})

    @staticmethod
    def _judge_balance(params, trainable, owners, world):
        """Each rank's share within one parameter of an even split: the bound any greedy partition meets. An
        answer where one rank owns everything trains right and shards nothing."""
        size = {i: params[i].numel() * params[i].element_size() for i in trainable}
        load = [sum(b for i, b in size.items() if owners[i] == [r]) for r in range(world)]
        total, largest = sum(size.values()), max(size.values())
        # Frozen parameters hold no state, so who owns them is not seen; ZeroRedundancyOptimizer counts them in
        # its partition, which can put all their bytes' worth of trainable ones on the other ranks.
        frozen = sum(p.numel() * p.element_size() for i, p in enumerate(params) if i not in size)
        heavy = max(range(world), key=load.__getitem__)
        greedy = [0] * world
        for b in sorted(size.values(), reverse=True):  # ZeroRedundancyOptimizer's partition: largest first
            greedy[greedy.index(min(greedy))] += b
        expect(load[heavy] <= total / world + largest + frozen,
               f"unbalanced: rank {heavy} owns {load[heavy]} of {total} bytes of trainable parameters "
               f"(shares {load}); giving each parameter, largest first, to the least-loaded rank (as "
               f"ZeroRedundancyOptimizer does) gives at most {max(greedy)} per rank. The heaviest rank's "
               "optimizer state sets the memory ZeRO-1 saves")


# --- 8.2: ZeRO-2 ----------------------------------------------------------------------------------------

def _same_sizes():
    """Before each sized collective, the ranks exchange (output, input) element counts and all raise a CheckFailure
    naming them if they cannot pair up -- else gloo fails with "Connection reset by peer" (or waits) unexplained."""
    from torch.utils._python_dispatch import _disable_current_modes
    gather = dist.all_gather

    def guard(name, fn):
        def sized(output, input, *args, **kwargs):
            outs = output if isinstance(output, (list, tuple)) else [output]
            ins = input if isinstance(input, (list, tuple)) else [input]
            mine = torch.tensor([sum(t.numel() for t in outs), sum(t.numel() for t in ins)], device=outs[0].device)
            every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
            with _disable_current_modes():  # not one of the learner's collectives: keep it out of the counts
                gather(every, mine)
            sizes, n = [tuple(e.tolist()) for e in every], len(every)
            scatter = name.startswith("reduce_scatter")
            pairs = len(set(sizes)) == 1 and (sizes[0][1] == n * sizes[0][0] if scatter else sizes[0][0] == n * sizes[0][1])
            if not pairs:
                raise CheckFailure(f"dist.{name} was called with sizes that do not pair up: " + "; ".join(
                    f"rank {r}: output {o} element(s), input {i}" for r, (o, i) in enumerate(sizes)) + ". A "
                    + ("reduce-scatter needs the same sizes on every rank and an input of N × the output: "
                       if scatter else "an all-gather needs the same sizes on every rank and an output of N × the "
                       "input: ") + "pad the flat gradient with zeros to ceil(n / N) · N elements, so that every "
                    "shard has the same length")
            return fn(output, input, *args, **kwargs)
        return sized

    sized = ("reduce_scatter_single", "reduce_scatter_tensor", "reduce_scatter", "all_gather_single",
             "all_gather_into_tensor")
    return mock.patch.multiple(dist, **{n: guard(n, getattr(dist, n)) for n in sized if hasattr(dist, n)})


def _rank_82(rank, world, fn, case):
    model = mlp(case["widths"], seed=case["seed"], freeze=case["freeze"])
    x, y = (t.tensor_split(world)[rank] for t in _batch82(case, world))
    zero = Zero2(model, OPTIMIZERS[case["optimizer"]], fn, **case["kwargs"])
    out = {"shards": [], "grads_left": [], "counts": [], "local": []}
    for _ in range(case["steps"]):
        F.cross_entropy(model(x), y).backward()
        local = flat(p.grad for p in zero.params)
        try:
            with CommLog() as count, _same_sizes():
                shard = fn(zero.params)
        except CheckFailure as e:  # the sizes cannot pair up: raised on every rank
            return {"sizes": str(e)}
        out["local"].append(local)
        out["shards"].append(shard.detach().clone() if isinstance(shard, torch.Tensor) else repr(shard)[:80])
        out["grads_left"].append(sum(p.grad.numel() for p in zero.params if p.grad is not None))
        out["counts"].append(count.counts)
        if not isinstance(shard, torch.Tensor) or shard.shape != zero.shard.shape:
            break
        zero.shard.grad = shard.detach().to(zero.shard.dtype)
        zero.optimizer.step()
        all_gather_flat(zero.flat, zero.shard.detach().clone())
        for p in model.parameters():
            p.grad = None
    out["params"] = [p.detach().clone() for p in model.parameters()]
    return out


def _batch82(case, world):
    return make_batch(world * case["per_rank"], case["widths"][0], case["widths"][-1], case["seed"] + 1)


def _baseline_82(case):
    """One process, the whole global batch: each step's flat gradient, and the parameters at the end."""
    model = mlp(case["widths"], seed=case["seed"], freeze=case["freeze"])
    params = [p for p in model.parameters() if p.requires_grad]
    opt = OPTIMIZERS[case["optimizer"]](params, **case["kwargs"])
    x, y = _batch82(case, case["world_size"])
    grads = []
    for _ in range(case["steps"]):
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        grads.append(flat(p.grad for p in params))
        opt.step()
    return grads, [p.detach().clone() for p in model.parameters()]


class ReduceScatterCheck(RemembersVerdict):
    id, function, points = "8.2", "reduce_scatter_gradients", 3
    rank_fn = staticmethod(_rank_82)

    def cases(self, rng):
        def case(world, divides):
            while True:  # redraw until the flat size does (or does not) divide by the world size
                widths = [rng.randint(2, 12) for _ in range(rng.randint(3, 4))]
                freeze = [rng.randrange(len(widths) - 1)] if rng.random() < 0.5 else []
                n = sum((a + 1) * b for a, b in zip(widths[:-1], widths[1:])) - sum(widths[i] * widths[i + 1]
                                                                               for i in freeze)
                if (n % world == 0) == divides:
                    opt = rng.choice(["SGD", "Adam"])
                    return {"world_size": world, "widths": widths, "freeze": freeze, "optimizer": opt,
                            "kwargs": {"lr": 0.05, "momentum": 0.9} if opt == "SGD" else {"lr": 0.01},
                            "steps": 2, "per_rank": rng.randint(2, 4), "seed": rng.randrange(2**31), "n": n}
        return [case(3, False), case(2, True), case(4, False), case(1, True)]

    def judge(self, case, result):
        world, n = case["world_size"], case["n"]
        L = ceil_div(n, world)
        grads, final = _baseline_82(case)
        pad = lambda g: F.pad(g, (0, L * world - n))  # noqa: E731
        sizes = next((res["sizes"] for res in result if "sizes" in res), None)
        expect(sizes is None, f"{sizes} ({n} gradient elements, {world} ranks: L = {L}).")
        for r, res in enumerate(result):
            for step, shard in enumerate(res["shards"]):
                what = f"rank {r}, step {step + 1}: the returned shard"
                expect_type(shard, torch.Tensor, f"{self.function} ({what})", "a 1-D tensor")
                expect_equal(tuple(shard.shape), (L,), f"{what}'s shape", mistakes={
                    f"floor(n / world_size) elements: the flat gradient was not padded to a multiple of the "
                    f"world size ({n} elements, {world} ranks)": (n // world,),
                    "the whole flat gradient: every rank must keep only its 1/N shard": (n,)},
                    hint=f"Pad the flat gradient to ceil(n / N) * N = {L * world} elements; shard r is "
                    f"elements [r*{L}, (r+1)*{L}).")
                full = pad(grads[step])
                expect_close(shard, full[r * L:(r + 1) * L], what, rtol=1e-4, atol=1e-6, mistakes={
                    "summed over the ranks but not divided by the world size": world * full[r * L:(r + 1) * L],
                    "this rank's own gradient, never reduced across ranks": pad(res["local"][step])[r * L:(r + 1) * L],
                    "another rank's slice (shard r is elements [r*L, (r+1)*L) of the padded flat gradient)":
                        full[((r + 1) % world) * L:((r + 1) % world + 1) * L] if world > 1 else None},
                    hint="Average over ranks; this rank keeps elements [rank*L, (rank+1)*L).")
                expect_equal(res["grads_left"][step], 0, f"rank {r}: gradient elements still held in .grad after "
                             f"{self.function}", mistakes={"kept the full .grad: the rank still holds every "
                             "gradient, so nothing was saved (set each p.grad to None)": n},
                             hint="After the call a rank holds only its shard.")
                counts = res["counts"][step]
                rs, ar, ag = (counts.get(op, 0) for op in ("reduce_scatter", "all_reduce", "all_gather"))
                expect(world == 1 or not ar or rs, f"rank {r}: all_reduce of the whole gradient, then a slice: "
                       "right values, but every rank received all of it; reduce-scatter sends each rank "
                       f"only its 1/N (collectives seen: {counts})")
                expect(world == 1 or not ag, f"rank {r}: all_gather of every rank's whole gradient, then a sum: "
                       f"right values, but each rank received (and held) {world} full gradients; reduce-scatter "
                       f"sends each rank only the sum of its 1/N (collectives seen: {counts})")
                expect(world == 1 or rs, f"rank {r}: no reduce-scatter among the collectives ({counts}): each "
                       "rank must receive only the sum of its own slice (dist.reduce_scatter_single)")
            expect_close(flat(res["params"]), flat(final),
                         f"rank {r}'s parameters after {case['steps']} ZeRO-2 steps", rtol=1e-4, atol=1e-5)
