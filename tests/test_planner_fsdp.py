"""ZeRO-3 planned by running FSDP2 on fake tensors (planner.fsdp): steady step, ranks, options."""
import pytest
import torch
import torch.distributed as dist

import mgpu_helpers.planner.trace as planner_trace
from mgpu_helpers.planner import plan
from mgpu_helpers.planner.fsdp import rank_groups, shard_rows
from mgpu_helpers.planner.models import decoder, lm_loss, tied_frozen, token_batch

TINY = dict(model_fn=decoder("tiny"), batch=token_batch(4, 32, 512), loss_fn=lm_loss)


def fsdp_plan(**kw):
    return plan(TINY["model_fn"], TINY["batch"], loss_fn=lm_loss, zero_stage=3, device="cpu", **kw)


def test_one_warm_up_step_is_steady(monkeypatch):
    # The planner counts FSDP2's second step; the third (what the real-step reference measures) is equal.
    for kw in (dict(world_size=2, checkpointing=True, micro_batches=2), dict(world_size=4, precision="fsdp-mixed",
                                                                         fsdp_units="root")):
        one = fsdp_plan(**kw)
        monkeypatch.setattr(planner_trace, "FSDP_WARM_UP_STEPS", 2)
        assert fsdp_plan(**kw).rank_peaks == one.rank_peaks
        monkeypatch.setattr(planner_trace, "FSDP_WARM_UP_STEPS", 1)


def test_ranks_with_equal_shards_share_a_trace_and_uneven_ones_differ():
    assert shard_rows([172, 64, 8], 8, 0) == (22, 8, 1) and shard_rows([172, 64, 8], 8, 7) == (18, 8, 1)
    assert shard_rows([3], 4, 3) == (0,)  # torch.chunk leaves the last rank empty
    assert rank_groups(TINY["model_fn"], 2) == [[0, 1]]
    assert rank_groups(TINY["model_fn"], 8) == [[0, 1, 2, 3, 4, 5, 6], [7]]  # SwiGLU 172 rows over 8
    p = fsdp_plan(world_size=8)
    assert len(p.rank_peaks) == 8 and p.rank_peaks[7] < p.rank_peaks[0] == p.peak_bytes and p.worst_rank == 0


def test_options_move_the_plan_the_way_fsdp2_does():
    default = fsdp_plan(world_size=2)
    kept = fsdp_plan(world_size=2, reshard_after_forward=False)  # every unit stays gathered until backward
    root = fsdp_plan(world_size=2, fsdp_units="root")
    mixed = fsdp_plan(world_size=2, precision="fsdp-mixed")
    assert kept.peak_bytes > default.peak_bytes and root.peak_bytes > default.peak_bytes
    assert mixed.peak_bytes < default.peak_bytes and mixed.layout == "fsdp-mixed"
    assert mixed.model_state == default.model_state  # fp32 shards either way; only the gathered copies are bf16
    assert fsdp_plan(world_size=4).peak_bytes < default.peak_bytes
    assert fsdp_plan(world_size=2, prefetch=2).peak_bytes >= default.peak_bytes


def test_an_int_reshard_after_forward_is_planned_between_true_and_false():
    """An int k reshards each block to k ranks after forward (torch's docstring: a non-trivial divisor of the
    mesh; the intra-node size on a multi-node mesh): more held than True, less than False."""
    peaks = {rf: fsdp_plan(world_size=4, reshard_after_forward=rf).peak_bytes for rf in (True, 2, False)}
    assert peaks[True] < peaks[2] < peaks[False], peaks
    # ranks are grouped by their post-forward shard too (r % k of their group of k): here 172 rows split
    # evenly in 2, so only the last rank's smaller shard over 8 stands apart
    assert rank_groups(TINY["model_fn"], 8, reshard_after_forward=2) == [[0, 1, 2, 3, 4, 5, 6], [7]]
    for bad in (1, 4, 3):
        with pytest.raises(ValueError, match="an int that divides world_size=4"):
            fsdp_plan(world_size=4, reshard_after_forward=bad)
    with pytest.raises(ValueError, match="reshard_after_forward"):
        plan(TINY["model_fn"], TINY["batch"], loss_fn=lm_loss, zero_stage=2, world_size=4, device="cpu",
             reshard_after_forward=2)


def test_tied_and_frozen_parameters_are_planned_as_fsdp2_holds_them():
    p = plan(tied_frozen("tiny"), TINY["batch"], loss_fn=lm_loss, zero_stage=3, world_size=2, device="cpu")
    q = fsdp_plan(world_size=2)
    assert p.n_params < q.n_params  # the head is the embedding; the frozen block is not trained
    assert p.model_state["optimizer"] < q.model_state["optimizer"] / 2 + 4096


def test_inside_a_process_group_it_says_so():
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with pytest.raises(RuntimeError, match="call plan\\(\\) outside an initialised process group"):
            fsdp_plan(world_size=2)
    finally:
        dist.destroy_process_group()


def test_a_policy_names_the_layout():
    import torch
    same = fsdp_plan(world_size=2, mp_policy=dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    assert same.layout == "fsdp-mixed" and same.peak_bytes == fsdp_plan(world_size=2, precision="fsdp-mixed").peak_bytes
    own = fsdp_plan(world_size=2, mp_policy=dict(param_dtype=torch.bfloat16))
    assert own.layout == "fsdp-mp(param=bfloat16, reduce=None)" and "MixedPrecisionPolicy" in own.layout_description


def test_stepping_the_local_shards_makes_the_bytes_dtensors_make(monkeypatch):
    """step_on_shards (the planner's shortcut past DTensor's sharding propagation in the optimizer step) must
    not change one byte: the same timeline as Adam stepping FSDP2's DTensor parameters, on an uneven rank too
    (its shards are re-padded by FSDP2's lazy init, after the optimizer was built).

    Not on torch < 2.13: there DTensor's step under FakeTensorMode over the fake process group makes
    whole-parameter temporaries that real ranks' steps do not (planning with it was +21% against two real
    FSDP2 ranks on 2.11, +122% in notebook 12); test_planner_ranks holds the shortcut against real ranks."""
    if tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13):
        pytest.skip("torch < 2.13: the fake DTensor step is not a reference (test_planner_ranks is)")
    import mgpu_helpers.planner.trace as pt
    from mgpu_helpers.planner.trace import trace_step

    def timeline(rank):
        fsdp = dict(world_size=8, rank=rank, fsdp_units="blocks", reshard_after_forward=None, prefetch=1,
                    offload=False, mp_policy=None)
        tr = trace_step(TINY["model_fn"], TINY["batch"], loss_fn=lm_loss, device="cpu", fsdp=fsdp)
        return tr.timeline.tolist(), tr.state_sizes, tr.n_params

    fast = [timeline(r) for r in (0, 7)]
    calls = []
    monkeypatch.setattr(pt, "step_on_shards", calls.append)  # the name trace_step calls: Adam steps the DTensors
    assert [timeline(r) for r in (0, 7)] == fast
    assert calls, "trace_step no longer calls step_on_shards: this test compares nothing"
