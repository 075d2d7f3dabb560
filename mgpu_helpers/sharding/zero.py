"""Notebook 08 -- ZeRO by hand: the closed form and the course's ZeRO-2.

Data parallelism (notebook 04) keeps a full copy of parameters, gradients and optimizer state on every
rank. ZeRO (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models") removes that redundancy in stages: stage 1 shards the optimizer state over the N ranks,
stage 2 also the gradients, stage 3 also the parameters. :func:`model_state_bytes` is that accounting
in closed form; :class:`Zero2` runs ZeRO-2 around any model with a reduce-scatter written in exercise 8.2.
The checks of 8.1 and 8.2 are in ``checks.sharding``; torch's versions (``ZeroRedundancyOptimizer``, FSDP2
``fully_shard``) and their measured memory in ``sharding.fsdp``, which builds on this module (never the
other way round).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

# Bytes per parameter of (parameters, gradients, one optimizer state) for each precision, and the bytes
# of the fp32 master copy that only "mixed" keeps. The ZeRO paper's model (its section 3.1): mixed
# precision holds 16-bit weights and gradients (2 + 2 bytes) and, in the optimizer, an fp32 master copy
# of the weights plus Adam's two fp32 moments: K = 4 + 4 + 4 = 12 bytes, 16 bytes/param in all.
PRECISIONS = {  # precision: (parameter bytes, gradient bytes, bytes per optimizer state, master copy bytes)
    "mixed": (2, 2, 4, 4),
    "fp32": (4, 4, 4, 0),
    "bf16": (2, 2, 2, 0),
}
STATES_PER_PARAM = {"sgd": 0, "momentum": 1, "adam": 2}  # plain SGD keeps no state; momentum one buffer


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def model_state_bytes(n_params: int, *, zero_stage: int = 0, world_size: int = 1, precision: str = "mixed",
                      optimizer: str = "adam") -> dict[str, int]:
    """Bytes **per rank** of parameters, gradients and optimizer state for ``n_params`` parameters
    trained with ZeRO stage ``zero_stage`` (0 = plain data parallelism) on ``world_size`` ranks.

    Returns ``{"parameters", "gradients", "optimizer", "total"}``, exact integers. Per parameter:

    =========  =====  =====  =============================================  ===================
    precision  param  grad   optimizer state K (adam / momentum / sgd)       adam total
    =========  =====  =====  =============================================  ===================
    mixed      2      2      fp32 master 4 + 4 per state: 12 / 8 / 4         16
    fp32       4      4      4 per state: 8 / 4 / 0                          16
    bf16       2      2      2 per state: 4 / 2 / 0                          8
    =========  =====  =====  =============================================  ===================

    A sharded category is split into ``world_size`` equal shards of ``ceil(n_params / world_size)``
    elements each: when the split is uneven the flat buffer is padded to a multiple of the world size
    (as ZeRO-2/3 implementations do), so every rank holds -- and is charged for -- the same number of
    elements. That is why the sum over ranks may exceed the unsharded figure by under ``world_size``
    elements' worth of bytes per category.

    Notebook 01's table counts the same 16 bytes/param for mixed-precision Adam. ``torch.autocast`` is the
    fp32 row (fp32 weights and gradients, no master copy: 4 + 4 + 8 = 16; its bf16 weight copies are
    activations). The 18 and 20 met elsewhere are Megatron-LM's mixed precision: 16-bit weights + fp32
    master + Adam with fp32 gradients (2 + 4 + 12 = 18), or with 16-bit gradients and an fp32 copy of them
    (2 + 2 + 4 + 12 = 20); this model -- the paper's -- has neither.

    The ZeRO paper's example, 7.5B parameters on 64 GPUs, in decimal GB: 120 / 31.4 / 16.6 / 1.88.
    """
    if isinstance(n_params, bool) or not isinstance(n_params, int):
        raise TypeError(f"n_params must be an int, got {type(n_params).__name__}")
    if n_params < 0:
        raise ValueError(f"n_params must be >= 0, got {n_params}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if zero_stage not in (0, 1, 2, 3) or isinstance(zero_stage, bool):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}: use one of {sorted(PRECISIONS)}")
    if optimizer not in STATES_PER_PARAM:
        raise ValueError(f"unknown optimizer {optimizer!r}: use one of {sorted(STATES_PER_PARAM)}")
    p_bytes, g_bytes, s_bytes, master = PRECISIONS[precision]
    k = master + STATES_PER_PARAM[optimizer] * s_bytes
    shard = ceil_div(n_params, world_size)  # elements per rank once a category is sharded
    out = {"parameters": p_bytes * (shard if zero_stage >= 3 else n_params),
           "gradients": g_bytes * (shard if zero_stage >= 2 else n_params),
           "optimizer": k * (shard if zero_stage >= 1 else n_params)}
    out["total"] = sum(out.values())
    return out


def comm_bytes_per_step(n_params: int, *, zero_stage: int, world_size: int, param_bytes: int = 4,
                        grad_bytes: int = 4) -> dict[str, int]:
    """Bytes **one rank receives** per training step, by collective, for ZeRO stage ``zero_stage`` as the
    course and torch build it, with ring collectives over padded shards of ``L = ceil(n / N)`` elements:
    a reduce-scatter or an all-gather receives ``(N - 1) L`` elements, an all-reduce (a reduce-scatter, then
    an all-gather) twice that, and a broadcast from each parameter's owner the ``(N - 1) / N`` of the
    parameters a rank does not own (an even split).

    ======  =============================================================  ======================
    stage   per step                                                        x DDP (equal dtypes)
    ======  =============================================================  ======================
    0       DDP: all-reduce the gradients                                   1
    1       ZeroRedundancyOptimizer / 8.1 over DDP: DDP's all-reduce, then  1.5
            each owner broadcasts its updated parameters
    2       reduce-scatter the gradients, all-gather the updated shards     1
            (8.2's ``Zero2``)
    3       FSDP2 (``reshard_after_forward=True``): all-gather parameters   1.5
            in forward and again in backward, reduce-scatter gradients
    ======  =============================================================  ======================

    The ZeRO paper counts stage 1 at DDP's volume too (its section 7): a rank steps only its shard, so a
    reduce-scatter of the gradients is enough, then an all-gather of the updated parameters. The course's
    ZeRO-1 and torch's keep DDP's all-reduce and add the broadcast: 1.5x.
    """
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    n, peers = world_size, world_size - 1
    shard = ceil_div(n_params, n)
    rs, ag = peers * shard * grad_bytes, peers * shard * param_bytes   # one reduce-scatter, one all-gather
    out = {"all-reduce": 0, "reduce-scatter": 0, "all-gather": 0, "broadcast": 0}
    if zero_stage <= 1:
        out["all-reduce"] = 2 * rs
    if zero_stage == 1:
        out["broadcast"] = ag
    if zero_stage == 2:
        out.update({"reduce-scatter": rs, "all-gather": ag})
    if zero_stage == 3:
        out.update({"reduce-scatter": rs, "all-gather": 2 * ag})
    out["total"] = sum(out.values())
    return out


# --- models and parameters ----------------------------------------------------------------------------

def linears(model: nn.Module) -> list[nn.Linear]:
    return [m for m in model.modules() if isinstance(m, nn.Linear)]


def unique(params) -> list[torch.Tensor]:
    """Each tensor once, in first-seen order (``module.parameters()`` does this; lists built by hand don't)."""
    seen, out = set(), []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


# --- ZeRO-2 around a model: the shard this rank owns of one flat buffer --------------------------------

class Zero2:
    """ZeRO-2 for ``model`` on this rank: every trainable parameter becomes a view into one flat fp32 buffer,
    zero-padded to a multiple of the world size; this rank's optimizer holds only its slice ``[r*L, (r+1)*L)``
    (``L = ceil(n / N)``) as one parameter, whose ``.grad`` is the slice of the averaged gradient that
    ``reduce_scatter_fn(params)`` returns (and which frees the full ``.grad``s). After the step the updated
    slices are all-gathered into the buffer, so every rank has the whole model again."""

    def __init__(self, model: nn.Module, optimizer_cls, reduce_scatter_fn, **kwargs):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.params = [p for p in unique(model.parameters()) if p.requires_grad]
        n = sum(p.numel() for p in self.params)
        self.shard_len = ceil_div(n, self.world)
        self.flat = torch.zeros(self.shard_len * self.world, device=self.params[0].device)
        off = 0
        for p in self.params:  # the parameters now live in the flat buffer (no second copy)
            self.flat[off:off + p.numel()].copy_(p.detach().flatten())
            p.data = self.flat[off:off + p.numel()].view_as(p)
            off += p.numel()
        self.shard = nn.Parameter(self.flat[self.rank * self.shard_len:(self.rank + 1) * self.shard_len])
        self.optimizer = optimizer_cls([self.shard], **kwargs)
        self.reduce_scatter_fn = reduce_scatter_fn

    def step(self):
        self.shard.grad = self.reduce_scatter_fn(self.params)  # 1/N of the averaged gradient
        self.optimizer.step()
        all_gather_flat(self.flat, self.shard.detach().clone())  # the input must not alias the output


def all_gather_flat(out: torch.Tensor, shard: torch.Tensor) -> None:
    """``all_gather_single`` (torch >= 2.13; its older name ``all_gather_into_tensor`` now warns)."""
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, shard)
