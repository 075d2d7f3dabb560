"""The memory planner: per-rank memory of a training step before anything is allocated (``mgpu-plan``).

    plan(model_fn, batch, loss_fn=..., precision="bf16-autocast", zero_stage=3, world_size=8)

Its clients are ``mgpu-plan`` (``tools/plan_cli``), notebook 11 (``mgpu_helpers.capstone``), notebook 12
(``fsdp_practice.plan_knobs``) and the benches. **Data flows one way: trace -> plan -> budget -> report.**
Each module imports only those above it:

=================  ==========================================================================================
``accounting``     ``FakeTracker``: the course's ``MemoryTracker`` over fake storages, plus GPU kernels' scratch
``cuda``           CUDA-faithful kernels on any host (attention backends, fused RMSNorm, CUDA autocast lists)
``dynamic``        data-dependent ops (``.item()``, ``nonzero``) answered with stated representative values
``fsdp``           FSDP2 itself on the fake model in a fake process group (stage 3: run, not ruled)
``trace``          one steady training step under ``FakeTensorMode`` (:func:`trace_step`, :func:`train_step`)
``layouts``        the memory layouts and ZeRO/FSDP shard arithmetic: each rank's timeline from a trace
``plans``          :func:`plan` and :class:`Plan` (the worst rank's peak, every rank's), :func:`measure_step`
``allocator``      the caching allocator's rules, replayed over a trace's requests (rounding, reserve)
``budget``         what a GPU holds beyond the tensors: context, workspaces, allocator, NCCL (``mgpu-plan``)
``validation``     the plan held against the tracker on real ranks (and what the CPU allocator saw beside it)
``models``         the models it is held against (Llama-shaped decoders, conv nets, tied+frozen)
``parallel``       TP(+SP), pipeline stages, HSDP / FSDP2 x TP: each rank's step on fake ranks (``plan_layout``)
``search``         the layout search at scale (70B/405B) by arithmetic (``mgpu-plan --tp/--pp/--global-batch``)
=================  ==========================================================================================
"""
from .layouts import LAYOUTS, METHOD, OPTIONS, ZERO_STAGES, rank_timeline
from .models import SIZES, Decoder, decoder, lm_loss, token_batch
from .plans import Plan, measure_step, plan, plan_from_trace, step_cost
from .trace import (OPTIMIZERS, TRACED_LAYOUTS, Trace, apply_checkpointing, make_optimizer, trace_step, train_step,
                    warm_up)
from .validation import METHODS, table, validate

__all__ = ["plan", "Plan", "plan_from_trace", "step_cost", "measure_step", "trace_step", "train_step", "Trace",
           "warm_up", "make_optimizer", "apply_checkpointing", "TRACED_LAYOUTS", "OPTIMIZERS", "LAYOUTS", "METHOD",
           "OPTIONS", "ZERO_STAGES", "rank_timeline", "SIZES", "Decoder", "decoder", "lm_loss", "token_batch",
           "validate", "table", "METHODS"]
