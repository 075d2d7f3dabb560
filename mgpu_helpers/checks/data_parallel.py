"""Check of notebook 03: 3.1 a DataParallel step over CPU replicas, against one device's step on the
whole batch (PyTorch itself)."""

import threading

import torch

from ..data_parallel import make_problem, single_device_grads
from .base import Check, expect, expect_close, expect_equal, expect_type, plain


class DataParallelStep(Check):
    id, function, points = "3.1", "data_parallel_step", 3

    def cases(self, rng):
        dims = lambda: {"features": rng.randint(3, 8), "hidden": rng.randint(4, 16),  # noqa: E731
                        "classes": rng.randint(2, 6), "seed": rng.randrange(2**31)}
        n, c = rng.randint(2, 4), rng.randint(2, 4)
        last = rng.randint(1, c - 1)
        fewer = rng.choice([(5, 4), (6, 4), (9, 4), (8, 5), (7, 5)])  # torch.chunk gives fewer than n chunks
        return [dict(dims(), batch=n * rng.randint(2, 5), n_replicas=n),              # divides evenly
                dict(dims(), batch=c * 3 + last, n_replicas=4),                       # unequal chunks
                dict(dims(), batch=fewer[0], n_replicas=fewer[1])]

    def _problem(self, case):
        return make_problem(case["batch"], case["features"], case["hidden"], case["classes"], case["seed"],
                            torch.float64)

    def run(self, fn, case):
        model, x, y = self._problem(case)
        calls, caller, modules = [], threading.get_ident(), []

        def spy(module, args):  # copied along with the module by deepcopy: sees every replica's forward
            if not any(m is module for m in modules):
                modules.append(module)  # kept alive for the run, so each replica has its own index
            which = next(i for i, m in enumerate(modules) if m is module)
            calls.append([module is model, threading.get_ident() == caller, int(args[0].shape[0]), which])
        model.register_forward_pre_hook(spy)
        loss = fn(model, x.clone(), y.clone(), case["n_replicas"])
        return {"loss": plain(loss), "calls": calls,  # plain: detached, so no requires_grad warning
                "grads": [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]}

    def judge(self, case, r):
        model, x, y = self._problem(case)
        n, calls = case["n_replicas"], r["calls"]
        sizes = [len(c) for c in x.chunk(n)]
        expect(len(calls) > 0, "no replica ran forward: call each replica as `replica(x)`.")
        expect(not any(c[0] for c in calls), "the original model ran forward itself: replicate it "
               "(copy.deepcopy(model) per chunk) and run the copies, as DataParallel does.")
        expect_equal(sorted(c[2] for c in calls), sorted(sizes), "the list of the replicas' batch sizes", mistakes={
            "split with tensor_split-style sizes; DataParallel's scatter uses torch.chunk "
            "(ceil(B/n) rows per chunk, so possibly fewer chunks than n)": sorted(len(c) for c in x.tensor_split(n))})
        expect(len({c[3] for c in calls}) == len(calls), f"{len(calls)} forwards ran on "
               f"{len({c[3] for c in calls})} module(s): it matches a common mistake: one shared copy ran every "
               "chunk, so autograd summed the chunks' gradients into that one copy and the reduce step never "
               "happened. DataParallel replicates the module onto every device: make one copy per chunk, then "
               "sum the replicas' gradients into the model.")
        expect(len(sizes) == 1 or not all(c[1] for c in calls), "every replica ran forward in the calling "
               "thread: parallel_apply runs each replica in its own thread (e.g. ThreadPoolExecutor.map).")
        expect_type(r["loss"], (float, torch.Tensor), self.function, "the loss: a float or a 0-d tensor")
        expect(not isinstance(r["loss"], torch.Tensor) or r["loss"].numel() == 1,
               f"{self.function} returned a tensor of shape {tuple(getattr(r['loss'], 'shape', ()))} as the loss: "
               "return the one mean loss over the whole batch")
        loss, grads = single_device_grads(model, x, y)
        bad_loss, bad_grads = single_device_grads(model, x, y, per_chunk=n)
        expect_close(r["loss"], loss, "the returned loss", mistakes={
            "averaged per-replica losses without weighting the unequal chunks": bad_loss},
            hint="Hint: gather the outputs (torch.cat) and compute one loss over the whole batch.")
        for i, (g, ref) in enumerate(zip(r["grads"], grads)):
            expect(g is not None, f"the model's parameter {i} has .grad None: the replica gradients were "
                   "never copied back (reduced) into the original model.")
            expect_close(g, ref, f"the gradient of parameter {i}", mistakes={
                "forgot to copy the replica gradients back into the model (they are zero)": torch.zeros_like(ref),
                "averaged the replica gradients instead of summing them": ref / len(sizes),
                "averaged the replica gradients (over n_replicas) instead of summing them": ref / n,
                "averaged per-replica losses without weighting the unequal chunks": bad_grads[i]},
                hint="Hint: the loss is a mean over the gathered batch, so each replica's gradient is its "
                     "share of the total: sum them, as DataParallel's backward does.", rtol=1e-7, atol=1e-9)
