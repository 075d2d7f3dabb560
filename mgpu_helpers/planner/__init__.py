"""Notebook 11 -- the memory planner: per-rank memory of a training step before anything is allocated.

    plan(model_fn, batch, loss_fn=..., precision="bf16-autocast", zero_stage=3, world_size=8)

plans what torch runs, in a named memory layout (:data:`LAYOUTS`; ``plan.layout``): stage 0 DDP with its
gradient buckets, stage 1 ``ZeroRedundancyOptimizer`` over DDP, stage 2 the course's ZeRO-2, stage 3 FSDP2
``fully_shard`` per block + root, each with torch's defaults (:data:`OPTIONS`). Its clients are notebook 11
(this face), notebook 12 (``fsdp_practice.plan_knobs``), ``mgpu-plan`` (``tools/plan_cli``,
``tools/plan_sources``) and the benches.

**Data flows one way: trace -> plan -> budget -> report.** Each module imports only those above it:

=================  ==========================================================================================
``kernel_rules``   what no probe measures: oneDNN convolutions' fitted lines, the copies FSDP2's
                   ``_chunk_cat`` and gloo's reduce-scatter make (read off their arguments)
``kernels``        what a CPU kernel borrows inside one op beside what it returns (oneDNN's scratch, by ISA
                   and thread count; its worker threads' too): measured on this machine, once per op signature
``accounting``     ``FakeTracker``: the course's ``MemoryTracker`` over fake storages, plus ``kernels``' figures
                   on the CPU and cuDNN's calibrated workspace on a GPU (what no tensor owns)
``cuda``           CUDA-faithful kernels on any host (attention backends, fused RMSNorm, CUDA autocast lists)
``dynamic``        data-dependent ops (``.item()``, ``nonzero``) answered with stated representative values
                   (mixture-of-experts routing: balanced, or ``--moe-imbalance``), where fake tensors refuse
``fsdp``           FSDP2 itself on the fake model in a fake process group (stage 3: run, not ruled)
``trace``          one steady training step under ``FakeTensorMode`` (:func:`trace_step`, :func:`train_step`)
``layouts``        the memory layouts and ZeRO/FSDP shard arithmetic: each rank's timeline from a trace
``plans``          :func:`plan` and :class:`Plan` (the worst rank's peak, every rank's), :func:`measure_step`
``allocator``      the caching allocator's rules, replayed over a trace's requests (rounding, reserve)
``budget``         what a GPU holds beyond the tensors: context, workspaces, allocator, NCCL (``mgpu-plan``)
``validation``     the plan held against real gloo ranks with a reference that sees every allocation
``models``         the models it is held against (Llama-shaped decoders, conv nets, tied+frozen)
``capstone``       notebook 11's own: exercise 11.1's grid of plans and the ipywidgets calculator
=================  ==========================================================================================

``model_state_bytes`` is notebook 08's closed form (``sharding``), re-exported as the planner's reference.
"""
from ..sharding import model_state_bytes
from .capstone import (CHECK_BATCH, CHECK_GRID, CHECK_MODEL, calculator, cached_trace, candidate_plans, render,
                       settings_plan)
from .layouts import LAYOUTS, METHOD, OPTIONS, ZERO_STAGES, rank_timeline
from .models import SIZES, Decoder, decoder, lm_loss, token_batch
from .plans import Plan, measure_step, plan, shard, step_cost
from .trace import OPTIMIZERS, PRECISIONS, Trace, apply_checkpointing, make_optimizer, trace_step, train_step, warm_up
from .validation import METHODS, table, validate

__all__ = ["plan", "Plan", "shard", "step_cost", "measure_step", "trace_step", "train_step", "Trace", "warm_up",
           "make_optimizer", "apply_checkpointing", "PRECISIONS", "OPTIMIZERS", "LAYOUTS", "METHOD", "OPTIONS",
           "ZERO_STAGES", "rank_timeline", "SIZES", "Decoder", "decoder", "lm_loss", "token_batch",
           "model_state_bytes", "cached_trace", "candidate_plans", "CHECK_MODEL", "CHECK_BATCH", "CHECK_GRID",
           "render", "calculator", "settings_plan", "validate", "table", "METHODS"]
