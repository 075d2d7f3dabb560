"""What check 1.1 compares against: the training state one real step leaves behind (never for a notebook)."""
from __future__ import annotations

import torch
from torch import nn

from ...memory import make_optimizer, nbytes


def measured_training_state(model: nn.Module, optimizer: str, precision: str, batch: int = 4) -> dict[str, int]:
    """Take one real training step and count the bytes of what it leaves behind, by category.

    "mixed" is built the way mixed-precision training works without autocast: a bf16 model for
    forward/backward, an fp32 master copy that the optimizer updates, copied back after the step.
    The optimizer's ``step`` counter is a 0-d tensor that torch keeps on the CPU even when training
    on a GPU, so like ``torch.cuda.memory_allocated`` we do not count it.
    """
    work = model.to(torch.bfloat16 if precision in ("bf16", "mixed") else torch.float32)
    master = [p.detach().float().clone() for p in work.parameters()] if precision == "mixed" else None
    opt = make_optimizer(optimizer, master if master is not None else work.parameters())
    x = torch.randn(batch, next(work.parameters()).shape[1], dtype=next(work.parameters()).dtype)
    work(x).float().square().mean().backward()
    if master is not None:  # the optimizer updates the fp32 master from the bf16 gradients
        for m, p in zip(master, work.parameters()):
            m.grad = p.grad.float()
    opt.step()
    if master is not None:
        for m, p in zip(master, work.parameters()):
            p.data.copy_(m)
            m.grad = None  # the fp32 gradient copy is a temporary
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0]
    return {"parameters": nbytes(work.parameters()),
            "gradients": nbytes(p.grad for p in work.parameters()),
            "optimizer_state": nbytes(state) + (nbytes(master) if master else 0)}
