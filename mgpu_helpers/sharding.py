"""Notebook 08 -- sharding the training state: ZeRO stages 1-3 and FSDP2.

Data parallelism (notebook 04) keeps a full copy of parameters, gradients and optimizer state on every
rank. ZeRO (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models") removes that redundancy in stages: stage 1 shards the optimizer state over the N ranks,
stage 2 also the gradients, stage 3 also the parameters. :func:`model_state_bytes` is that accounting
in closed form.
"""
from __future__ import annotations

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


def _ceil_div(a: int, b: int) -> int:
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

    Notebook 01's table counts the same 16 bytes/param for mixed-precision Adam; the 18 or 20 met
    elsewhere keep fp32 gradients (autocast) or an extra fp32 accumulation buffer (see
    ``mgpu_helpers.memory``), which this model -- the paper's -- does not.

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
    shard = _ceil_div(n_params, world_size)  # elements per rank once a category is sharded
    out = {"parameters": p_bytes * (shard if zero_stage >= 3 else n_params),
           "gradients": g_bytes * (shard if zero_stage >= 2 else n_params),
           "optimizer": k * (shard if zero_stage >= 1 else n_params)}
    out["total"] = sum(out.values())
    return out
