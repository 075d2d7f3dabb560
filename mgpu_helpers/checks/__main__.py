"""A lesson's script that judges with its checks' references, run on every rank:

    torchrun --nproc-per-node 2 -m mgpu_helpers.checks accumulation     # notebook 05: DDP no_sync accumulation
    torchrun --nproc-per-node 2 -m mgpu_helpers.checks model_sharding   # notebook 09: GPipe step, tensor-parallel MLP
    python -m mgpu_helpers.checks model_sharding                        # no torchrun: 2 ranks via run_ranks

Each is ``checks.<lesson>.script(rank, world_size)``, judged as its check judges: a lesson never imports its checks.
"""
import importlib
import os

from ..runtime.launch import run_ranks, script_args, torchrun_main

SCRIPTS = ("accumulation", "model_sharding")  # the checks modules with a script(rank, world_size)

lesson = script_args(__doc__, add=lambda p: p.add_argument("lesson", choices=SCRIPTS)).lesson
script = importlib.import_module(f"{__package__}.{lesson}").script
if "RANK" in os.environ:
    torchrun_main(script)
else:
    print(run_ranks(script, 2)[0])
