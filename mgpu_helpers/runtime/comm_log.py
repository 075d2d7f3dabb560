"""``CommLog``: the collectives this rank makes, as the dispatcher sees them (``c10d`` / ``_c10d_functional``
ops: FSDP2's, ``dist.*``, DTensor's). DDP's built-in all-reduce runs in C++, unseen: count it with a comm hook
(``accumulation.AllReduceCount``)."""

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass_type
from torch.utils._pytree import tree_leaves

_MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")


class CommLog(TorchDispatchMode):
    """``with CommLog() as c:`` records each collective in ``c.calls``: ``(op, dtype, bytes in, bytes out)`` (an
    all-gather: in = this rank's shard, out = the whole unit; a reduce-scatter the reverse). ``c.order``: the
    all-gathers (``G``) and matmuls (``m``) in issue order, which prefetch changes (``GmmGmm`` -> ``GGmmGmm``)."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, str, int, int]] = []
        self.order = ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented  # let DTensor unwrap; its collectives come back here on plain tensors
        if func.namespace in ("c10d", "_c10d_functional") and not func._opname.startswith(("barrier", "monitored",
                                                                                             "wait")):
            ts = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            nb = [t.numel() * t.element_size() for t in ts]
            # (output, input) for _allgather_base_ and _reduce_scatter_base_; in place for all-reduce
            out, inp = (nb[0], nb[1]) if len(nb) > 1 else (sum(nb), sum(nb))
            n = func._opname.replace("_", "")  # c10d names vary: reduce_scatter_, _reduce_scatter_base_...
            kind = next((k for k in _KINDS if k.replace("_", "") in n), func._opname)
            self.calls.append((kind, str(ts[0].dtype).replace("torch.", "") if ts else "-", inp, out))
            self.order += "G" if self.calls[-1][0] == "all_gather" else ""
        elif func in _MATMULS:
            self.order += "m"
        return func(*args, **(kwargs or {}))

    counts = property(lambda self: dict(Counter(op for op, *_ in self.calls)))
    all_gathers = property(lambda self: self.counts.get("all_gather", 0))
    reduce_scatters = property(lambda self: self.counts.get("reduce_scatter", 0))

    def summary(self) -> dict[str, dict]:
        """``{"all_gather bfloat16": {"calls", "bytes_in", "bytes_out"}, ...}``."""
        out: dict[str, dict] = {}
        for op, dtype, i, o in self.calls:
            s = out.setdefault(f"{op} {dtype}", {"calls": 0, "bytes_in": 0, "bytes_out": 0})
            s["calls"], s["bytes_in"], s["bytes_out"] = s["calls"] + 1, s["bytes_in"] + i, s["bytes_out"] + o
        return out

    @property
    def gathered(self) -> int:
        """Bytes this rank received from other ranks in all-gathers (the unit minus its own shard)."""
        return sum(o - i for op, _, i, o in self.calls if op == "all_gather")
