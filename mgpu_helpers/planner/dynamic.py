"""Data-dependent ops in a fake trace: a representative value where a tensor's values decide a size.

A fake tensor has shapes but no values, so ``FakeTensorMode`` refuses ``.item()`` / ``.tolist()``
(``aten._local_scalar_dense``) and ops whose output size is data-dependent (``nonzero``, ``masked_select``):
mixture-of-experts layers that loop over the experts, initialisers that read a bound back, positions from a
mask. :func:`dynamic_sizes` answers each with a stated representative value, on the side that over-estimates
memory where a choice matters:

* an integer read back: with one count per expert (``moe`` given), the tokens an expert gets under the stated
  routing (:meth:`DynamicSizes.expert_share`); any other integer, the step's sequence length;
* ``nonzero`` / ``masked_select``: every element selected, except a per-expert mask of ``tokens x top_k``
  elements, which selects the expert's share;
* a float read back: 1.0; ``all()`` True and ``any()`` False, as the planned batch (no padding) makes them
  (``padding_mask.all()``; a rejection-sampling initialiser's loop ends), any other boolean False; a value
  the fake mode kept (a tensor made from a Python number): that value.

It is a user dispatch mode entered outside ``trace_step``, so it sees each op before the fake mode and answers
only what the fake mode would refuse. Every op pays a Python call through it, so ``mgpu-plan`` traces within
it only when a trace without it met such an op (:data:`DATA_DEPENDENT`).
"""
from __future__ import annotations

import math

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes, _get_current_dispatch_mode_stack

aten = torch.ops.aten
_SELECT = {aten.nonzero.default, aten.masked_select.default}
_ALL = {aten.all.default, aten.all.dim, aten.all.dims}
_ANY = {aten.any.default, aten.any.dim, aten.any.dims}


class DynamicSizes(TorchDispatchMode):
    """Representative values for data-dependent ops on fake tensors (see the module's docstring)."""

    def __init__(self, moe_imbalance: float = 1.0):
        super().__init__()
        self.imbalance = moe_imbalance
        self.moe = None  # (experts, top_k), set by the source before tracing when the model has experts
        self.tokens = 0  # tokens of the step (batch x sequence), set likewise
        self.seq = 0     # tokens per sample

    def expert_share(self, expert: int = 0) -> int:
        """Tokens expert ``expert`` gets: the even share ``tokens x top_k / experts``; under an imbalance the
        first expert gets ``imbalance`` times it (at most every token) and the others share the rest, so
        that the counts still add up to ``tokens x top_k`` (the families split by them)."""
        experts, top_k = self.moe
        total = self.tokens * top_k
        hot = min(self.tokens, math.ceil(self.imbalance * total / experts))
        if expert == 0:
            return hot
        rest, others = total - hot, experts - 1
        return rest // others + (1 if expert - 1 < rest % others else 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        x = args[0] if args else None
        if not isinstance(x, FakeTensor):
            return func(*args, **kwargs)
        if func is aten._local_scalar_dense.default:
            if getattr(x, "constant", None) is not None:  # a value the fake mode kept (a tensor made from a number)
                with _disable_current_modes():
                    return x.constant.item()
            if x.dtype == torch.bool:
                return getattr(x, "_planned_value", False)
            if x.is_floating_point() or x.is_complex():
                return 1.0
            base = x._base if x._base is not None else x
            if self.moe is not None and base.numel() == self.moe[0]:  # one count per expert: the stated routing
                return self.expert_share(x.storage_offset() - base.storage_offset())
            return max(self.seq, 1)
        if func in _SELECT:
            n = x.numel() if func is aten.nonzero.default else torch.broadcast_shapes(x.shape, args[1].shape).numel()
            if self.moe is not None and self.tokens and n == self.tokens * self.moe[1]:
                n = self.expert_share()  # one expert's (top-k slot, token) mask: the largest share
            if func is aten.nonzero.default:
                return x.new_empty((n, x.dim()), dtype=torch.long)
            return x.new_empty((n,))
        out = func(*args, **kwargs)
        if (func in _ALL or func in _ANY) and isinstance(out, FakeTensor):  # what .item() will read back
            out._planned_value = func in _ALL
        return out


DATA_DEPENDENT = (torch._subclasses.fake_tensor.DataDependentOutputException,
                  torch._subclasses.fake_tensor.DynamicOutputShapeException)


def dynamic_sizes(moe_imbalance: float = 1.0) -> DynamicSizes:
    """The mode to enter: within it, fake traces answer data-dependent ops with representative values."""
    return DynamicSizes(moe_imbalance)


def active():
    """The :class:`DynamicSizes` in force, if any: the source tells it how many experts and tokens the step has."""
    return next((m for m in _get_current_dispatch_mode_stack() if isinstance(m, DynamicSizes)), None)
