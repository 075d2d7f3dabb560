"""planner.parallel against real layouts on 2 and 4 gloo ranks: each rank's plan beside its tracker's peak.

The real run is torch's own layout (``parallelize_module`` colwise/rowwise + sequence parallel, the course's
pipeline stages over ``isend``/``irecv``, FSDP2 on a 2-D mesh or HSDP) under the course's ``MemoryTracker``;
the plan runs the same code on fake tensors in a fake process group (planner/parallel.py).
"""
import pytest

from mgpu_helpers.planner.parallel import Layout, LlamaConfig, check_layout, measure_layout, plan_layout, schedule_order

CFG = LlamaConfig(vocab=512, d=64, layers=4, heads=4, kv_heads=4, ffn=172)
BATCH, SEQ = 8, 32
EXACT = [  # layouts whose plan equals the tracker to the byte on every rank
    Layout(pp=2, microbatches=4, schedule="gpipe"),
    Layout(pp=2, microbatches=4, schedule="1f1b"),
    Layout(pp=4, microbatches=4, schedule="gpipe"),           # unequal stages: embedding first, head last
    Layout(pp=4, microbatches=4, schedule="1f1b"),
    Layout(dp_shard=2),                                       # FSDP2, 1-D
    Layout(dp_replicate=2, dp_shard=2),                       # HSDP on a 2-D mesh
    Layout(tp=2, dp_shard=2),                                 # FSDP2 x TP on a 2-D mesh
    Layout(pp=2, tp=2, microbatches=2),                       # PP x TP
]
TP = [Layout(tp=2), Layout(tp=4)]


def _show(layout, measured, planned):
    return f"{layout.describe()}: measured {measured}, planned {planned}"


@pytest.mark.slow
@pytest.mark.parametrize("layout", EXACT + TP, ids=lambda l: l.describe().replace(" ", "-"))
def test_every_rank_equals_its_tracker(layout):
    measured = measure_layout(CFG, layout, BATCH, SEQ)
    planned = plan_layout(CFG, layout, BATCH, SEQ)
    print(_show(layout, measured, planned))
    assert planned == measured, _show(layout, measured, planned)
