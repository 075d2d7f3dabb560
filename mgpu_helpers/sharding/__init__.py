"""Notebook 08 -- sharding the training state: ZeRO stages 1-3 and FSDP2.

``zero``   ZeRO by hand: :func:`model_state_bytes` (the accounting in closed form, per stage, per rank) and
           :class:`Zero2` (ZeRO-2 around any model with the reduce-scatter written in exercise 8.2);
``fsdp``   torch's versions, ``ZeroRedundancyOptimizer`` (ZeRO-1) and FSDP2 ``fully_shard`` (ZeRO-3), their
           per-rank memory measured against the formula, and the ways "FSDP did not save memory" happens.

``fsdp`` builds on ``zero``, never the other way round. Its names are loaded when first used: it imports
FSDP2 and matplotlib (3 s), which the closed forms (notebook 11 imports ``model_state_bytes``) do not need.
The checks of 8.1 and 8.2 are in ``checks.sharding``. Run as a script::

    torchrun --nproc-per-node 2 -m mgpu_helpers.sharding
    python -m mgpu_helpers.sharding                            # no torchrun: 2 ranks via run_ranks
"""
from ..runtime.fake_world import fake_world  # noqa: F401  (the lesson runs its ranks in it)
from .zero import (PRECISIONS, STATES_PER_PARAM, Zero2, all_gather_flat, comm_bytes_per_step, linears,
                   model_state_bytes, unique)

_FSDP = ("STAGE", "MODEL_STATE", "build", "measure", "sweep", "trains_like_one_process", "formula",
         "plot_per_rank", "plot_peaks")

__all__ = ["PRECISIONS", "STATES_PER_PARAM", "Zero2", "all_gather_flat", "comm_bytes_per_step", "linears",
           "model_state_bytes", "unique", "fake_world", *_FSDP]


def __getattr__(name):  # `from mgpu_helpers.sharding import measure`: the fsdp half, imported on first use
    if name in _FSDP:
        from . import fsdp
        return getattr(fsdp, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
