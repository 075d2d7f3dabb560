"""Notebook 12 -- FSDP2 in practice: the knobs of ``fully_shard`` and what each costs, measured per rank.

Notebook 08 showed what ZeRO-3 shards. Here one model (residual MLP blocks, each its own ``fully_shard``
unit, the root holding the embedding and head) is trained under each knob of FSDP2, and each rank's
memory and communication for one steady training step are measured:

* ``reshard_after_forward`` True / False / an int: peak bytes against bytes all-gathered;
* explicit prefetch (``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch``);
* ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` against ``torch.autocast`` over FSDP2;
* ``CPUOffloadPolicy`` and ``torch.autograd.graph.save_on_cpu``; foreach vs fused Adam; meta-device init.

Memory is counted two ways in the same step. :class:`~mgpu_helpers.runtime.tracker.MemoryTracker` gives the split
by category but learns a storage only when it is made, so it misses the unsharded parameters FSDP2 frees
with ``resize_(0)`` and re-grows every step. ``torch.profiler`` with ``profile_memory=True``
sees every allocation of the CPU allocator (measured: it matched the tracker and the planner to 8 bytes where both see everything), so
the **peak** is the profiler's; the gap between the two is reported as its own row, never hidden. On a GPU
the peak is ``torch.cuda.max_memory_allocated`` (the same semantics). Collectives are counted at the
dispatcher (:class:`~mgpu_helpers.runtime.comm_log.CommLog`): op, dtype, bytes in and out, on every rank.

Sweeps run one rank of a world of N inside this process (torch's fake process group, ``runtime.
fake_world``): allocations are real, collectives move no data -- right for bytes, useless for values.
The timeline and overlap figures are in ``timeline``; meta-device initialisation (``init_weights``: the
values one process draws, on any mesh -- DTensor's RNG repeats shards on a CPU mesh) and what activation
offload would move in ``init``; the planner's figures for the same knobs in ``plan``. ``measure`` also takes a
``shard_fn(model, mesh)`` (exercise 12.1: a learner's own ``fully_shard`` policy) and reports the forward's
issue order of all-gathers and matrix multiplies (``CommLog.order``), the same on every machine.

Run as a script (every knob on 2 ranks, one table per rank)::

    torchrun --nproc-per-node 2 -m mgpu_helpers.fsdp_practice
    python -m mgpu_helpers.fsdp_practice                       # no torchrun: 2 ranks via run_ranks
"""
from .init import SavedBytes, init_weights, meta_init, meta_init_values, saved_for_backward
from ..runtime.comm_log import CommLog
from .instruments import profiled_peak, state_bytes
from .knobs import (KNOBS, MODEL, PHASES, Block, Net, accumulation, blocks, budgets, build, forget_cached_meshes, knob_grid, knob_sweep,
                    make_model, measure, shard, sweep)
from .plan import plan_knobs
from .timeline import COMPUTE, overlap, summarize, trace
from .timeline import plot as plot_timeline

__all__ = ["MODEL", "Block", "Net", "make_model", "blocks", "shard", "forget_cached_meshes", "CommLog",
           "state_bytes", "profiled_peak", "build", "measure", "accumulation", "sweep", "knob_grid", "knob_sweep", "budgets", "KNOBS", "PHASES",
           "meta_init", "meta_init_values", "init_weights", "SavedBytes", "saved_for_backward", "plan_knobs", "trace", "summarize",
           "overlap", "plot_timeline", "COMPUTE"]
