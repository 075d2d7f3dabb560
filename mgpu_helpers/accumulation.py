"""Notebook 05 -- gradient accumulation: k micro-batches give one big batch's gradients, and the gradient
all-reduce (DDP) or reduce-scatter (FSDP2) can wait for the last micro-step (checks in ``checks.accumulation``).
The script (DDP ``no_sync`` on 2 ranks against one process) judges with the checks, so it lives with them::

    torchrun --nproc-per-node 2 -m mgpu_helpers.checks accumulation
"""
import contextlib

import torch
import torch._dynamo  # noqa: F401  DDP's constructor imports it (~2 s): import it once here, not in every forked rank
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel as DDP

from .memory import mlp, torch_threads
from .runtime.tracker import MemoryTracker


def flat_grads(model: nn.Module) -> torch.Tensor:
    """Every parameter's gradient in one CPU vector (full tensors for FSDP2's DTensors; zeros where None)."""
    grads = (torch.zeros_like(p) if p.grad is None else p.grad.detach() for p in model.parameters())
    return torch.cat([(g.full_tensor() if hasattr(g, "full_tensor") else g).flatten().cpu() for g in grads])


class AllReduceCount:
    """A comm hook counting DDP's bucket all-reduces in ``calls`` (DDP's own run in C++, unseen by Python)."""

    def __init__(self, ddp_model: DDP):
        self.calls, self.group = 0, ddp_model.process_group
        self.ledger, self.tag = None, lambda: 0  # a check's CollectiveLedger, and the tag of the moment
        ddp_model.register_comm_hook(self, AllReduceCount._hook)

    @staticmethod
    def _hook(state, bucket):  # unannotated: DDP rejects string annotations such as `from __future__` makes
        state.calls += 1
        buf = bucket.buffer()
        if state.ledger is not None and not state.ledger.admit("all_reduce", buf.numel() * buf.element_size(),
                                                               state.tag()):
            fut = torch.futures.Future()  # the ranks' collectives diverged: skip it, so that no rank hangs
            fut.set_result(buf)
            return fut
        return default_hooks.allreduce_hook(state.group, bucket)  # what DDP does without a hook


@contextlib.contextmanager
def no_sync_context(model: nn.Module):
    """Backward inside accumulates locally; the first backward outside syncs it all. Put forward AND backward
    inside: DDP decides in forward whether the coming backward syncs. DDP: ``model.no_sync()``. FSDP2
    (``fully_shard``, which has no ``no_sync``): ``set_requires_gradient_sync(False)``, True again on exit.
    Anything else raises TypeError: a fallback that does nothing lets every micro-step communicate silently."""
    if isinstance(model, DDP):
        with model.no_sync():
            yield
    elif isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        raise TypeError(f"no_sync_context: {type(model).__name__} is neither DistributedDataParallel nor an "
                        "FSDP2 module (fully_shard); there is no gradient sync to skip. Pass the wrapped model.")


def peak_vs_effective_batch(effective=(16, 32, 64, 128, 256), micro=16, tokens=16, widths=(32, 128, 128, 16),
                            seed=0) -> dict[str, list[int]]:
    """Peak bytes per effective batch: one plain batch vs micro-batches of ``micro``, each made in the loop."""
    model, g = mlp(list(widths), seed=seed), torch.Generator().manual_seed(seed)

    def step(n, k):
        model.zero_grad(set_to_none=True)
        with MemoryTracker(model) as mt:
            for _ in range(k):
                x = torch.randn(n, tokens, widths[0], generator=g)
                y = torch.randint(widths[-1], (n * tokens,), generator=g)
                (F.cross_entropy(model(x).flatten(0, 1), y) / k).backward()
                del x, y  # before the next one is made
        return mt.peak_bytes

    with torch_threads(1):  # tiny ops: a second OpenMP thread only spin-waits on a busy machine
        return {"effective": list(effective), "plain": [step(b, 1) for b in effective],
                "accumulated": [step(micro, b // micro) for b in effective], "micro": micro}

