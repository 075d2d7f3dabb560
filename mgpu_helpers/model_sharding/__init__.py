"""Notebook 09 -- model sharding: pipeline parallelism (``pipeline.py``, exercise 9.1) and tensor parallelism
(``tensor_parallel.py``, 9.2); checks in ``checks.model_sharding``. The script (a GPipe step and a
tensor-parallel MLP against one process) judges with the checks' references, so it lives with them::

    torchrun --nproc-per-node 2 -m mgpu_helpers.checks model_sharding
    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint $HEAD_NODE:29500 \\
        -m mgpu_helpers.checks model_sharding   # on each of 2 nodes (tests/test_multinode.py: localhost)
    python -m mgpu_helpers.checks model_sharding   # no torchrun: 2 ranks via run_ranks
"""
from .pipeline import (StepRecorder, Stuck, as_intervals, bubble_fraction, make_model,  # noqa: F401
                       plot_timeline, single_process_step, stage_bounds, step_timeline, wall_timeline)
from .tensor_parallel import (DenseMLP, make_mlp, param_bytes, parameter_bytes_formula,  # noqa: F401
                              torch_tensor_parallel)
