"""The memory planner: per-rank memory of a training step before anything is allocated (``mgpu-plan``).

    plan(model_fn, batch, loss_fn=..., precision="bf16-autocast", zero_stage=3, world_size=8)

Its clients are ``mgpu-plan`` (``tools/plan_cli``), notebooks 11 (``capstone``) and 12 (``fsdp_practice``) and
the benches. Data flows one way, trace -> plan -> budget -> report; each module imports only those before it
(``trace``, ``layouts``, ``plans``, ``allocator``, ``budget``, ``validation``), and its docstring says its part.
"""
from .layouts import LAYOUTS, METHOD, OPTIONS, ZERO_STAGES, rank_timeline
from .models import SIZES, Decoder, decoder, lm_loss, token_batch
from .plans import Plan, measure_step, plan, plan_from_trace, step_cost
from .trace import (OPTIMIZERS, TRACED_LAYOUTS, Trace, apply_checkpointing, make_optimizer, trace_step, train_step,
                    warm_up)
from .validation import METHODS, table, validate
