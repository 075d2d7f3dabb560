"""Data-dependent ops in a fake trace: a stated representative value where a tensor's values decide a size.

``FakeTensorMode`` refuses ``.item()`` and ops whose output size depends on values (``nonzero``,
``masked_select``): mixture-of-experts layers looping over experts, initialisers reading a bound back, positions
from a mask. :class:`DynamicSizes` answers them, over-estimating memory where a choice matters (each answer is
commented). Entered outside ``trace_step``, it sees each op before the fake mode; every op pays a Python call
through it, so ``mgpu-plan`` traces within it only when a trace without it met such an op (:data:`DATA_DEPENDENT`).
"""

import math

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensor
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
        """Tokens expert ``expert`` gets: the even share ``tokens x top_k / experts``, the first ``imbalance``
        times it (at most every token) and the others the rest, so the counts add up (families split by them)."""
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
                return getattr(x, "_planned_value", False)  # all() True, any() False (no padding), else False
            if x.is_floating_point() or x.is_complex():
                return 1.0  # a float read back
            base = x._base if x._base is not None else x
            if self.moe is not None and base.numel() == self.moe[0]:  # one count per expert: the stated routing
                return self.expert_share(x.storage_offset() - base.storage_offset())
            return max(self.seq, 1)  # any other integer: the sequence length
        if func in _SELECT:  # every element selected
            n = x.numel() if func is aten.nonzero.default else torch.broadcast_shapes(x.shape, args[1].shape).numel()
            if self.moe is not None and self.tokens and n == self.tokens * self.moe[1]:
                n = self.expert_share()  # one expert's (top-k slot, token) mask: the largest share
            return x.new_empty((n, x.dim()), dtype=torch.long) if func is aten.nonzero.default else x.new_empty((n,))
        out = func(*args, **kwargs)
        if (func in _ALL or func in _ANY) and isinstance(out, FakeTensor):  # what .item() will read back
            out._planned_value = func in _ALL
        return out


DATA_DEPENDENT = (DataDependentOutputException, DynamicOutputShapeException)


def active():
    """The :class:`DynamicSizes` in force, if any: the source tells it how many experts and tokens the step has."""
    return next((m for m in _get_current_dispatch_mode_stack() if isinstance(m, DynamicSizes)), None)
