"""planner.parallel against real layouts on 2 and 4 gloo ranks: each rank's plan beside its tracker's peak.

The real run is torch's own layout (``parallelize_module`` colwise/rowwise + sequence parallel, the course's
pipeline stages over ``isend``/``irecv``, FSDP2 on a 2-D mesh or HSDP, context parallel's K/V all-gather,
a MoE's experts over ep with ``all_to_all_single``) under the course's ``MemoryTracker``;
the plan runs the same code on fake tensors in a fake process group (planner/parallel.py).
"""
import pytest

from mgpu_helpers.planner.parallel import (Layout, LlamaConfig, check_layout, measure_layout, plan_layout, schedule_order,
                                           settled_collectives)
from mgpu_helpers.runtime.launch import rank_device, run_ranks

CFG = LlamaConfig(vocab=512, d=64, layers=4, heads=4, kv_heads=4, ffn=172)
CFG8 = CFG._replace(layers=8)  # interleaved layouts: pp x v chunks of at least one block each
BATCH, SEQ = 8, 32
EXACT = [  # layouts whose plan equals the tracker to the byte on every rank
    Layout(pp=2, microbatches=4, schedule="gpipe"),
    Layout(pp=2, microbatches=4, schedule="1f1b"),
    Layout(pp=4, microbatches=4, schedule="gpipe"),           # unequal stages: embedding first, head last
    Layout(pp=4, microbatches=4, schedule="1f1b"),
    Layout(dp_shard=2),                                       # FSDP2, 1-D
    Layout(dp_replicate=2, dp_shard=2),                       # HSDP on a 2-D mesh
    Layout(dp_replicate=2),                                   # HSDP, one shard group: replicated
]
TP = [  # tensor parallel (+ sequence parallel, loss_parallel head), alone and on 2-D meshes
    Layout(tp=2), Layout(tp=4),
    Layout(tp=2, dp_shard=2),                                 # FSDP2 x TP on a 2-D mesh
    Layout(pp=2, tp=2, microbatches=2),                       # PP x TP
]
CP = [  # context parallel: K and V all-gathered over cp, FSDP2 over dp_shard x cp
    Layout(cp=2), Layout(cp=4), Layout(cp=2, dp_shard=2), Layout(cp=2, tp=2),
]
MOE = CFG._replace(experts=4, top_k=2, expert_ffn=64)
EP = [  # routed experts sharded over ep (borrowed from dp_shard x cp), tokens dispatched by all_to_all
    Layout(dp_shard=2, ep=2), Layout(dp_shard=4, ep=4),
    Layout(dp_shard=4, ep=2),                                 # ep2 x fsdp: each expert's FSDP2 over 2 ranks
    Layout(dp_shard=2, cp=2, ep=2),                           # ep over cp's ranks
]
INTERLEAVED = [  # v = 2 chunks per rank, Megatron's order (on CFG8)
    Layout(pp=2, microbatches=4, schedule="interleaved", virtual_stages=2),
    Layout(pp=4, microbatches=4, schedule="interleaved", virtual_stages=2),
    Layout(pp=2, microbatches=4, schedule="interleaved", virtual_stages=2, checkpointing=True),
    Layout(pp=4, microbatches=8, schedule="interleaved", virtual_stages=2, checkpointing=True),
]


def _plan_equals_tracker(cfg, layout):
    planned = plan_layout(cfg, layout, BATCH, SEQ)
    measured = measure_layout(cfg, layout, BATCH, SEQ)
    assert planned == measured, f"{layout.describe()}: measured {measured}, planned {planned}"


@pytest.mark.slow
@pytest.mark.parametrize("layout", EXACT + TP + INTERLEAVED, ids=lambda l: l.describe().replace(" ", "-"))
def test_every_rank_equals_its_tracker(layout):
    cfg = CFG8 if layout.virtual_stages > 1 else CFG
    _plan_equals_tracker(cfg, layout)


@pytest.mark.slow
@pytest.mark.parametrize("layout", CP, ids=lambda l: l.describe().replace(" ", "-"))
def test_context_parallel_ranks_equal_their_tracker(layout):
    _plan_equals_tracker(CFG, layout)


@pytest.mark.slow
@pytest.mark.parametrize("layout", EP, ids=lambda l: l.describe().replace(" ", "-"))
def test_expert_parallel_ranks_equal_their_tracker(layout):
    _plan_equals_tracker(MOE, layout)


def test_the_stages_differ_as_the_schedule_says():
    # GPipe holds all 4 micro-batches on every stage; 1F1B holds min(m, pp - stage): the first stage most
    gpipe = plan_layout(CFG, Layout(pp=2, microbatches=4, schedule="gpipe"), BATCH, SEQ)
    f1b = plan_layout(CFG, Layout(pp=2, microbatches=4, schedule="1f1b"), BATCH, SEQ)
    assert f1b[0] < gpipe[0] and f1b[1] < gpipe[1], (gpipe, f1b)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_schedule_order_runs_every_micro_batch_once(schedule):
    for pp in (1, 2, 4):
        for m in (1, 2, 4, 8):
            for s in range(pp):
                ops = schedule_order(schedule, m, pp, s)
                assert sorted(ops) == sorted([("F", 0, i) for i in range(m)] + [("B", 0, i) for i in range(m)])
                assert all(ops.index(("F", 0, i)) < ops.index(("B", 0, i)) for i in range(m))


def test_interleaved_order_is_torchs():
    # the ops (chunk c = torch's stage index // pp) in the order torch's ScheduleInterleaved1F1B gives each rank
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B
    for pp in (2, 4):
        for v in (2, 3):
            for m in (pp, 2 * pp, 4 * pp):
                sched = SimpleNamespace(n_local_stages=v, pp_group_size=pp, microbatches_per_round=pp,
                                        _n_microbatches=m)
                for s in range(pp):
                    torchs = [(a.computation_type.value, a.stage_index // pp, a.microbatch_index)
                              for a in ScheduleInterleaved1F1B._calculate_single_rank_operations(sched, s) if a]
                    assert schedule_order("interleaved", m, pp, s, v) == torchs, (pp, v, m, s)


@pytest.mark.parametrize("kw,msg", [
    (dict(tp=3), "tp=3 must divide the attention heads"),
    (dict(pp=5), "exceeds the model's 4 layers"),
    (dict(dp_shard=3), "global batch 8 is not divisible by dp (3)"),
    (dict(schedule="zb"), "schedule must be one of"),
    (dict(ep=2, dp_shard=2), "ep=2 needs routed experts"),
    (dict(pp=2, schedule="interleaved", microbatches=3), "interleaved 1F1B needs microbatches (3) divisible by pp (2)"),
    (dict(pp=2, virtual_stages=2), "virtual_stages=2 needs schedule='interleaved' and pp > 1"),
])
def test_impossible_layouts_say_what_to_change(kw, msg):
    with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        check_layout(CFG, Layout(**kw), BATCH, SEQ)


@pytest.mark.parametrize("kw,msg", [
    (dict(ep=3, dp_shard=3), "ep=3 must divide the experts (4)"),
    (dict(ep=4, dp_shard=2), "ep=4 must divide the experts (4) and dp_shard x cp (2)"),
    (dict(tp=2), "tp=2 with routed experts is not planned"),
])
def test_impossible_expert_layouts_say_what_to_change(kw, msg):
    with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        check_layout(MOE, Layout(**kw), 12, SEQ)


def test_experts_capacity_is_static_and_drops_the_overflow():
    import torch

    from mgpu_helpers.planner.parallel import MoE, capacity
    moe = MoE(MOE)
    assert capacity(MOE, 256) == 128 and capacity(MOE._replace(capacity_factor=1.25), 10) == 7  # ceil(f T k / E)
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[0], moe.router.weight[1] = 2, 1  # every token: expert 0 first, expert 1 second
    x = torch.ones(1, 16, MOE.d)
    seen = torch.zeros(MOE.experts, capacity(MOE, 16), MOE.d)
    moe.experts.forward = lambda buf: seen.copy_(buf) + 1  # a filled slot's output: 2; an empty one's: 1
    out = moe(x).detach()
    # experts 0 and 1 take the first 8 of 16 tokens each (capacity 8), the other two only padding; the
    # last 8 tokens are dropped by both their experts: their output is 0
    assert (seen[:2] == 1).all() and (seen[2:] == 0).all()
    assert (out[0, 8:] == 0).all() and torch.allclose(out[0, :8], torch.full((8, MOE.d), 2.0))


def _late_frees(rank, world_size, n):
    """How often a tensor dropped right after a collective outlived its drop (gloo's worker still held it)."""
    import torch
    import torch.distributed as dist
    from torch.multiprocessing.reductions import StorageWeakRef
    late = 0
    with settled_collectives():
        for i in range(n):
            t = torch.randn(4096, device=rank_device())
            ref = StorageWeakRef(t.untyped_storage())
            if i % 2:
                dist.all_reduce(t)
            else:
                dist.broadcast(t, src=0)
            del t
            late += not ref.expired()
    return late


def test_settled_collectives_free_a_dropped_tensor_at_once():
    """What notebook 04's bucket table and every measured layout rest on: under ``settled_collectives`` a
    collective returns only once gloo's worker has let go of its tensors (before the aliases, 73 and 52 of
    these 300 outlived their drop on 2 cores)."""
    assert run_ranks(_late_frees, 2, 300, backend="gloo") == [0, 0]
