"""Notebook 12 -- FSDP2 in practice: each knob of ``fully_shard``, what it costs per rank and what the planner
says of it (``knobs``), the overlap of communication and compute (``timeline``), meta-device init and
activation offload (``init``). The script, every knob on 2 ranks::

    torchrun --nproc-per-node 2 -m mgpu_helpers.fsdp_practice
    python -m mgpu_helpers.fsdp_practice                       # no torchrun: 2 ranks via run_ranks
"""
from ..runtime.comm_log import CommLog  # noqa: F401
from .init import init_weights, meta_init, meta_init_values, saved_for_backward  # noqa: F401
from .knobs import (KNOBS, MODEL, Block, Net, accumulation, blocks, budgets, build, knob_grid,  # noqa: F401
                    knob_sweep, make_model, measure, plan_knobs, profiled_peak, shard, sweep)
from .timeline import overlap, summarize, trace  # noqa: F401
from .timeline import plot as plot_timeline  # noqa: F401
