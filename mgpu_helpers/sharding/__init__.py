"""Notebook 08 -- sharding the training state: ZeRO by hand (``zero``) and torch's ZeRO-1 and FSDP2 (``fsdp``,
which builds on ``zero``). ``fsdp``'s names load on first use: FSDP2 and matplotlib are slow to import, and the
closed forms (notebook 11 imports ``model_state_bytes``) need neither. Checks: ``checks.sharding``. The script::

    torchrun --nproc-per-node 2 -m mgpu_helpers.sharding
    python -m mgpu_helpers.sharding                            # no torchrun: 2 ranks via run_ranks
"""
from ..runtime.fake_world import fake_world  # noqa: F401  (the lesson runs its ranks in it)
from .zero import (PRECISIONS, STATES_PER_PARAM, Zero2, all_gather_flat, comm_bytes_per_step, linears,  # noqa: F401
                   model_state_bytes, unique)

_FSDP = ("STAGE", "MODEL_STATE", "build", "measure", "sweep", "trains_like_one_process", "formula",
         "plot_per_rank", "plot_peaks")


def __getattr__(name):  # `from mgpu_helpers.sharding import measure`: the fsdp half, imported on first use
    if name in _FSDP:
        from . import fsdp
        return getattr(fsdp, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
