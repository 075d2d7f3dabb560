"""Notebook 08 -- ZeRO by hand (Rajbhandari et al. 2020): :func:`model_state_bytes`, the accounting of stages
1-3 in closed form, and :class:`Zero2`, ZeRO-2 around any model with exercise 8.2's reduce-scatter.
"""
import torch
import torch.distributed as dist
from torch import nn

# The ZeRO paper's model (its section 3.1): "mixed" holds 16-bit weights and gradients and, in the
# optimizer, an fp32 master copy plus Adam's two fp32 moments: 2 + 2 + 12 = 16 bytes/param.
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
    """Bytes **per rank** of ``parameters``, ``gradients``, ``optimizer`` state and ``total`` for ``n_params``
    trained with ZeRO stage ``zero_stage`` (0: plain data parallelism) on ``world_size`` ranks, bytes per
    parameter from :data:`PRECISIONS` (``torch.autocast`` is "fp32"; the 18-20 met elsewhere are Megatron-LM's).
    A sharded category is padded to ``world_size`` shards of ``ceil(n_params / world_size)``, as ZeRO-2/3 do.
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
    """Bytes **one rank receives** per step, by collective, for ZeRO stage ``zero_stage`` as torch builds it: ring
    collectives over padded shards of ``L = ceil(n / N)``, (N - 1) L elements for a reduce-scatter or all-gather,
    twice that for an all-reduce. Stage 1 keeps DDP's all-reduce and adds the owners' broadcast (as
    ZeroRedundancyOptimizer and 8.1 do; the paper reduce-scatters); stage 3 all-gathers in forward and backward.
    """
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    peers, shard = world_size - 1, ceil_div(n_params, world_size)
    rs, ag = peers * shard * grad_bytes, peers * shard * param_bytes   # one reduce-scatter, one all-gather
    out = {"all-reduce": 2 * rs if zero_stage <= 1 else 0, "reduce-scatter": rs if zero_stage >= 2 else 0,
           "all-gather": (0, 0, ag, 2 * ag)[zero_stage], "broadcast": ag if zero_stage == 1 else 0}
    out["total"] = sum(out.values())
    return out


def linears(model: nn.Module) -> list[nn.Linear]:
    return [m for m in model.modules() if isinstance(m, nn.Linear)]


def unique(params) -> list[torch.Tensor]:
    """Each tensor once, in first-seen order (a tensor hashes by identity: no values compared)."""
    return list(dict.fromkeys(params))


class Zero2:
    """ZeRO-2: the trainable parameters become views into one padded flat buffer; this rank's optimizer holds its
    slice, whose ``.grad`` is ``reduce_scatter_fn(params)``'s; after the step the slices are all-gathered."""

    def __init__(self, model: nn.Module, optimizer_cls, reduce_scatter_fn, **kwargs):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.params = [p for p in model.parameters() if p.requires_grad]  # each tensor once, tied or not
        sizes = [p.numel() for p in self.params]
        self.shard_len = ceil_div(sum(sizes), self.world)
        self.flat = torch.zeros(self.shard_len * self.world, device=self.params[0].device)
        for p, view in zip(self.params, self.flat[:sum(sizes)].split(sizes)):
            view.copy_(p.detach().flatten())
            p.data = view.view_as(p)  # the parameters now live in the flat buffer (no second copy)
        self.shard = nn.Parameter(self.flat[self.rank * self.shard_len:(self.rank + 1) * self.shard_len])
        self.optimizer = optimizer_cls([self.shard], **kwargs)
        self.reduce_scatter_fn = reduce_scatter_fn

    def step(self):
        self.shard.grad = self.reduce_scatter_fn(self.params)  # 1/N of the averaged gradient
        self.optimizer.step()
        all_gather_flat(self.flat, self.shard.detach().clone())  # the input must not alias the output


def all_gather_flat(out: torch.Tensor, shard: torch.Tensor) -> None:  # all_gather_into_tensor warns from 2.13 on
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, shard)
