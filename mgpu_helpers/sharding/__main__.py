"""``torchrun --nproc-per-node 2 -m mgpu_helpers.sharding`` (or ``python -m mgpu_helpers.sharding``: 2 ranks via
run_ranks): ZeroRedundancyOptimizer and FSDP2 against one process, bytes per rank against the formula."""
import os

from ..runtime.launch import run_ranks, script_args, torchrun_main
from .fsdp import _demo

script_args(__doc__)
torchrun_main(_demo) if "RANK" in os.environ else print(run_ranks(_demo, 2)[0])
