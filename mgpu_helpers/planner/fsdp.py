"""ZeRO-3 as FSDP2 runs it, planned by running it: ``fully_shard`` on fake tensors over a fake process group.

FSDP2's memory is not a rule of thumb over one unsharded step: each unit all-gathers into a flat buffer of
padded shards and copies out into unsharded storages (freed and re-grown with ``UntypedStorage.resize_``),
the root stays unsharded after forward, one more unit is prefetched in backward, gradients are
reduce-scattered through a flat buffer, and ``MixedPrecisionPolicy`` gathers bf16 copies beside fp32 shards.
So the planner runs FSDP2 itself on a model built under ``FakeTensorMode``, in a fake process group
(``init_process_group("fake")``: collectives do nothing, shapes are right) of the planned world size and
rank, and counts the second step with the fake-storage tracker, seeded with FSDP2's unsharded storages.
Whatever FSDP2 does with the caller's model -- frozen or tied parameters, uneven shards -- is planned; ranks
whose shards are equal in every parameter share one trace (:func:`rank_groups`).
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from .accounting import FakeTracker


def largest_block_list(model: nn.Module):
    """The model's blocks: its largest non-empty ``nn.ModuleList`` ([] if none), what FSDP2 wraps "per block"
    and checkpointing wraps one by one."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)]
    return max(lists, key=len) if lists else []


def fsdp_blocks(model: nn.Module) -> list:
    blocks = list(largest_block_list(model))
    if not blocks:
        raise ValueError("fsdp_units='blocks': the model has no nn.ModuleList of blocks to wrap one by one "
                         "with fully_shard; pass fsdp_units='root' to shard the whole model as one unit")
    return blocks


def apply_fsdp(model, mesh, *, fsdp_units="blocks", precision="fp32", reshard_after_forward=None, prefetch=1,
               offload=False, mp_policy=None):
    """``fully_shard`` ``model`` with plan()'s FSDP2 options (shared by the planner and the real runs); an int
    ``reshard_after_forward`` k applies to each block, the root keeping FSDP2's default (with ``"root"``, the
    root is the unit and takes k); ``prefetch`` k > 1 sets k explicitly both ways; ``mp_policy`` overrides
    ``precision``'s; ``offload``: ``CPUOffloadPolicy(pin_memory=False)``."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    kw = dict(mesh=mesh, reshard_after_forward=reshard_after_forward)
    if mp_policy is not None:
        kw["mp_policy"] = mp_policy
    elif precision == "fsdp-mixed":
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if offload:
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    blocks = fsdp_blocks(model) if fsdp_units == "blocks" else []
    as_int = type(reshard_after_forward) is int  # an int k, not a bool (True == 1 in Python, not to FSDP2)
    # An int makes fully_shard reshape the mesh's rank tensor (a real tensor) into the post-forward mesh:
    # under the planner's FakeTensorMode that op must run outside the fake mode; the parameters stay fake.
    from torch._subclasses.fake_tensor import unset_fake_temporarily
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
    """Make ``opt`` (built over FSDP2's DTensor parameters) step on their local shards -- what DTensor's
    foreach ops do anyway (every parameter is Shard(0)), with the same tensors made and freed, but without
    DTensor's sharding propagation, which is not cached for foreach ops over lists (most of a 70B plan's
    time). ``opt.global_params`` keeps the DTensors (global counts)."""
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
        for p in opt.global_params:
            if set_to_none:
                p.grad = None
                p._local_tensor.grad = None
    opt.step, opt.zero_grad = step_, zero_grad_


class FSDPFakeTracker(FakeTracker):
    """The fake-storage tracker, also counting FSDP2's unsharded storages from entry: FSDP2 frees them with
    ``resize_(0)`` and re-grows them the same way each step, which no op creates (the dispatcher never
    sees ``UntypedStorage.resize_``; the tracker's patch of it does, for storages it knows)."""

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
    out = []
    for rows in sizes:
        chunk = -(-rows // world_size)
        out.append(max(0, min(chunk, rows - rank * chunk)))
    return tuple(out)


def rank_groups(model_fn, world_size, fsdp_units="blocks", reshard_after_forward=None):
    """Ranks grouped by identical shard sizes (``torch.chunk`` along dim 0): ``[[ranks...], ...]``, one trace
    per group; with an int ``reshard_after_forward`` k, by their post-forward shards over k ranks too. Builds
    the model (fake) first, so a model that cannot be wrapped as asked fails before anything is traced."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        model = model_fn()
        if not isinstance(model, nn.Module):
            raise TypeError(f"model_fn must return an nn.Module, got {type(model).__name__}")
        if fsdp_units == "blocks":
            fsdp_blocks(model)
        rows = [p.shape[0] if p.dim() else 1 for p in model.parameters()]
    groups = {}
    k = reshard_after_forward if type(reshard_after_forward) is int else None  # not a bool
    for r in range(world_size):
        key = (shard_rows(rows, world_size, r), shard_rows(rows, k, r % k) if k else None)
        groups.setdefault(key, []).append(r)
    return list(groups.values())
