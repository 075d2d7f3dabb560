"""``torchrun --nproc-per-node 2 -m mgpu_helpers.fsdp_practice`` (or ``python -m mgpu_helpers.fsdp_practice``: 2 ranks
via run_ranks): every knob of ``fully_shard`` on 2 ranks, peak bytes and bytes all-gathered, one table per rank."""
import os

from ..runtime.launch import run_ranks, script_args, torchrun_main
from .knobs import _demo

script_args(__doc__)
torchrun_main(_demo) if "RANK" in os.environ else print("\n".join(run_ranks(_demo, 2)))
