"""Notebook 12 -- FSDP2 in practice: each knob of ``fully_shard`` (reshard_after_forward, prefetch, mixed
precision, CPU offload, foreach vs fused Adam, meta-device init) and what it costs per rank, in ``knobs``.
``MemoryTracker`` splits memory by category but misses the unsharded parameters FSDP2 frees with
``resize_(0)`` and re-grows, so the **peak** is the profiler's (``instruments``) and the gap is its own row.
Collectives: ``CommLog``. Sweeps run one rank of N in this process (``runtime.fake_world``). Also ``timeline``
(overlap of communication and compute), ``init`` (meta-device init, activation offload) and ``plan`` (the
planner on the same knobs). The script (every knob on 2 ranks, one table per rank)::

    torchrun --nproc-per-node 2 -m mgpu_helpers.fsdp_practice
    python -m mgpu_helpers.fsdp_practice                       # no torchrun: 2 ranks via run_ranks
"""
from ..runtime.comm_log import CommLog  # noqa: F401
from .init import init_weights, meta_init, meta_init_values, saved_for_backward  # noqa: F401
from .instruments import profiled_peak, state_bytes  # noqa: F401
from .knobs import (KNOBS, MODEL, Block, Net, accumulation, budgets, build, forget_cached_meshes,  # noqa: F401
                    knob_grid, knob_sweep, make_model, measure, shard, sweep)
from .plan import plan_knobs  # noqa: F401
from .timeline import COMPUTE, overlap, summarize, trace  # noqa: F401
from .timeline import plot as plot_timeline  # noqa: F401
