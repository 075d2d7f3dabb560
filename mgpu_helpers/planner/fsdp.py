"""ZeRO-3 as FSDP2 runs it, planned by running it: ``fully_shard`` on fake tensors over a fake process group.

FSDP2's memory is no rule of thumb over an unsharded step (padded flat all-gather buffers, unsharded storages
freed and re-grown with ``UntypedStorage.resize_``, prefetching, ``MixedPrecisionPolicy``'s copies), so the
planner runs it on a model built under ``FakeTensorMode``, in a fake process group (``init_process_group("fake")``)
of the planned world size and rank, and counts the second step (:func:`rank_groups`: one trace per equal shards).
"""

import contextlib

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

from .accounting import FakeTracker


NO_BLOCKS = ("fsdp_units='blocks': the model has no nn.ModuleList of blocks to wrap one by one with fully_shard; "
             "pass fsdp_units='root' to shard the whole model as one unit")


def largest_block_list(model: nn.Module, missing: str = ""):
    """The model's blocks: its largest non-empty ``nn.ModuleList``, what FSDP2 wraps "per block" and
    checkpointing wraps one by one; if none, [] (or ``ValueError(missing)``)."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)]
    if missing and not lists:
        raise ValueError(missing)
    return max(lists, key=len) if lists else []


def apply_fsdp(model, mesh, *, fsdp_units="blocks", precision="fp32", reshard_after_forward=None, prefetch=1,
               offload=False, mp_policy=None):
    """``fully_shard`` ``model`` with plan()'s FSDP2 options (for the planner and the real runs alike): an int
    ``reshard_after_forward`` applies to each block, the root keeping FSDP2's default unless it is the only
    unit; ``prefetch`` k > 1 is set both ways; ``mp_policy`` overrides ``precision``'s."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    mixed = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if precision == "fsdp-mixed" else MixedPrecisionPolicy()
    kw = dict(mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy or mixed,
              offload_policy=CPUOffloadPolicy(pin_memory=False) if offload else OffloadPolicy())
    blocks = list(largest_block_list(model, NO_BLOCKS)) if fsdp_units == "blocks" else []
    as_int = type(reshard_after_forward) is int  # an int k, not a bool (True == 1 in Python, not to FSDP2)
    # An int makes fully_shard reshape the mesh's (real) rank tensor: outside the planner's fake mode.
    with unset_fake_temporarily() if as_int else contextlib.nullcontext():
        for block in blocks:
            fully_shard(block, **kw)
        fully_shard(model, **{**kw, "reshard_after_forward": None} if as_int and blocks else kw)
    if prefetch > 1:
        for i, block in enumerate(blocks):
            block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + prefetch])
            block.set_modules_to_backward_prefetch(blocks[max(0, i - prefetch):i][::-1])
    return model


def step_on_shards(opt) -> None:
    """Make ``opt`` (over FSDP2's DTensor parameters, all Shard(0)) step on their local shards: the tensors
    DTensor's foreach ops make, without its sharding propagation (uncached for foreach ops over lists: most
    of a 70B plan's time). ``opt.global_params`` keeps the DTensors."""
    opt.global_params = [p for g in opt.param_groups for p in g["params"]]
    groups = [list(g["params"]) for g in opt.param_groups]
    step, zero_grad = opt.step, opt.zero_grad

    def step_(*args, **kwargs):
        for g, params in zip(opt.param_groups, groups):
            g["params"] = [p._local_tensor for p in params]  # each step: FSDP2's lazy init may re-pad a shard
            for p, t in zip(params, g["params"]):  # the gradient FSDP2 reduce-scattered, as the shard's own
                t.grad = p.grad._local_tensor if p.grad is not None else None
        return step(*args, **kwargs)

    def zero_grad_(set_to_none=True):
        zero_grad(set_to_none)
        for p in opt.global_params if set_to_none else ():
            p.grad = p._local_tensor.grad = None
    opt.step, opt.zero_grad = step_, zero_grad_


class FSDPFakeTracker(FakeTracker):
    """The fake-storage tracker, also counting FSDP2's unsharded storages from entry: FSDP2 re-grows them each
    step with ``UntypedStorage.resize_``, which the dispatcher never sees (the tracker's patch of it does)."""

    def __enter__(self):
        super().__enter__()
        with self._lock:
            for m in self.model.modules():  # FSDP2's all-gather outputs and unsharded parameters
                state = getattr(m, "_get_fsdp_state", None)
                group = state()._fsdp_param_group if state is not None else None
                for fp in group.fsdp_params if group is not None else ():
                    for t in [*getattr(fp, "all_gather_outputs", []), getattr(fp, "_unsharded_param", None)]:
                        if t is not None and t.untyped_storage()._cdata not in self._recs:
                            self._add(t.untyped_storage(), "parameters")
        return self


def shard_rows(sizes, world_size, rank):
    """Rows of dim 0 that ``rank`` holds of each parameter (``torch.chunk``'s split, as FSDP2 shards)."""
    chunks = [-(-rows // world_size) for rows in sizes]
    return tuple(max(0, min(c, rows - rank * c)) for rows, c in zip(sizes, chunks))


def rank_groups(model_fn, world_size, fsdp_units="blocks", reshard_after_forward=None):
    """Ranks grouped by identical shard sizes (and post-forward shards for an int ``reshard_after_forward``),
    one trace per group. Builds the model (fake) first: one that cannot be wrapped fails before any trace."""
    with FakeTensorMode():
        model = model_fn()
        if not isinstance(model, nn.Module):
            raise TypeError(f"model_fn must return an nn.Module, got {type(model).__name__}")
        if fsdp_units == "blocks":
            largest_block_list(model, NO_BLOCKS)
        rows = [p.shape[0] if p.dim() else 1 for p in model.parameters()]
    groups = {}
    k = reshard_after_forward if type(reshard_after_forward) is int else None  # not a bool
    for r in range(world_size):
        key = (shard_rows(rows, world_size, r), shard_rows(rows, k, r % k) if k else None)
        groups.setdefault(key, []).append(r)
    return list(groups.values())
