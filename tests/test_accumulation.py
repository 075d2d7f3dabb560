"""Unit tests of mgpu_helpers.accumulation: the reference loop, collective counting, no_sync_context under
DDP and FSDP2, the memory measurement, the grading split, and the torchrun entry point."""
import contextlib
from pathlib import Path

import pytest

from testkit import run_torchrun
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from mgpu_helpers.checks.accumulation import check_5_1, check_5_2
from mgpu_helpers.checks.references import accumulate
from mgpu_helpers.accumulation import AllReduceCount, flat_grads, no_sync_context, peak_vs_effective_batch
from mgpu_helpers.memory import make_batch, mlp
from mgpu_helpers.runtime.comm_log import CommLog
from mgpu_helpers.runtime.launch import rank_device, run_ranks

ROOT = Path(__file__).resolve().parent.parent
WIDTHS, K, PER_RANK = [12, 24, 24, 5], 4, 8


def _big_batch_grads(world):
    x, y = make_batch(PER_RANK * world, WIDTHS[0], WIDTHS[-1], 3)
    model = mlp(WIDTHS, seed=1)
    F.cross_entropy(model(x), y).backward()
    return flat_grads(model)


def _shard(rank, world):
    return (t.tensor_split(world)[rank] for t in make_batch(PER_RANK * world, WIDTHS[0], WIDTHS[-1], 3))


def ddp_only_no_sync(model):  # the trap of the notebook: silently a no-op without no_sync
    return model.no_sync() if hasattr(model, "no_sync") else contextlib.nullcontext()


def test_accumulate_equals_one_big_batch():
    x, y = make_batch(24, WIDTHS[0], WIDTHS[-1], 0)
    big, acc = mlp(WIDTHS, seed=1), mlp(WIDTHS, seed=1)
    loss = F.cross_entropy(big(x), y)
    loss.backward()
    total = accumulate(acc, F.cross_entropy, x, y, 6, skip=None)
    torch.testing.assert_close(flat_grads(acc), flat_grads(big), rtol=1e-5, atol=1e-7)
    assert total == pytest.approx(loss.item(), rel=1e-5)
    with pytest.raises(ValueError, match="does not divide"):
        accumulate(acc, F.cross_entropy, x, y, 5, skip=None)


def test_no_sync_context_refuses_a_plain_module():
    with pytest.raises(TypeError, match="neither DistributedDataParallel nor an FSDP2"):
        with no_sync_context(nn.Linear(2, 2)):
            pass


def _ddp_counts(rank, world):
    ddp = DDP(mlp(WIDTHS, seed=1), bucket_cap_mb=2e-3)
    count = AllReduceCount(ddp)
    x, y = _shard(rank, world)
    out = {}
    for name, skip in [("warm-up", None), ("one sync", "single"), ("none", None),
                       ("no_sync_context", no_sync_context), ("ddp_only_no_sync", ddp_only_no_sync)]:
        ddp.zero_grad(set_to_none=True)
        count.calls = 0
        if skip == "single":
            F.cross_entropy(ddp(x), y).backward()
        else:
            accumulate(ddp, F.cross_entropy, x, y, K, skip=skip)
        out[name] = (count.calls, flat_grads(ddp.module))
    with CommLog() as c:  # collectives called from Python are seen by the dispatch mode
        dist.all_reduce(torch.ones(3, device=rank_device()))
    out["python all_reduce"] = c.counts
    return out


def test_ddp_no_sync_counts_one_sync_and_matches_the_big_batch():
    ranks = run_ranks(_ddp_counts, 2)
    ref = _big_batch_grads(2)
    for r in ranks:
        one = r["one sync"][0]
        assert one >= 2, "the bucket cap should split the gradients into several buckets"
        assert r["none"][0] == K * one
        assert r["no_sync_context"][0] == one and r["ddp_only_no_sync"][0] == one  # DDP: both work
        for name in ("none", "no_sync_context", "ddp_only_no_sync"):
            torch.testing.assert_close(r[name][1], ref, rtol=1e-4, atol=1e-6)
        assert r["python all_reduce"] == {"all_reduce": 1}


def _param_groups(state):
    """FSDP2's parameter groups of one module: a list since torch 2.13, one optional group in 2.11."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return groups
    return [state._fsdp_param_group] if state._fsdp_param_group is not None else []


def _fsdp_counts(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    model = mlp(WIDTHS, seed=1)
    for layer in list(model)[:-1]:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x, y = _shard(rank, world)
    out = {}
    for name, skip in [("none", None), ("ddp_only_no_sync", ddp_only_no_sync), ("no_sync_context", no_sync_context)]:
        model.zero_grad(set_to_none=True)
        with CommLog() as c:
            accumulate(model, F.cross_entropy, x, y, K, skip=skip)
        out[name] = (c.reduce_scatters, c.all_gathers, flat_grads(model))
    out["sync restored"] = all(g.reduce_grads for m in model.modules() if hasattr(m, "_get_fsdp_state")
                               for g in _param_groups(m._get_fsdp_state()))
    return out


def test_fsdp2_no_sync_context_skips_reduce_scatters_and_the_ddp_only_helper_does_not():
    ranks = run_ranks(_fsdp_counts, 2)
    ref = _big_batch_grads(2)
    groups = len(WIDTHS) - 1  # one FSDP group per Linear (the root holds the last one)
    for r in ranks:
        assert r["none"][0] == K * groups
        assert r["ddp_only_no_sync"][0] == K * groups  # the trap: silently no skipping
        assert r["no_sync_context"][0] == groups
        assert r["none"][1] > 0  # all-gathers counted too
        for name in ("none", "ddp_only_no_sync", "no_sync_context"):
            torch.testing.assert_close(r[name][2], ref, rtol=1e-4, atol=1e-6)
        assert r["sync restored"]


def test_peak_memory_flat_with_accumulation_linear_without():
    res = peak_vs_effective_batch(effective=(16, 32, 64, 128), micro=16)
    plain, acc = res["plain"], res["accumulated"]
    assert plain[0] == acc[0]  # k = 1 is the same computation
    assert acc[1] == acc[2] == acc[3]  # flat from k = 2 on
    steps = [b - a for a, b in zip(plain, plain[1:])]  # linear: doubling the batch doubles the growth
    assert steps[1] == pytest.approx(2 * steps[0], rel=0.05) and steps[2] == pytest.approx(2 * steps[1], rel=0.05)
    again = peak_vs_effective_batch(effective=(16, 32), micro=16)  # exact bytes: deterministic
    assert again["plain"] == plain[:2] and again["accumulated"] == acc[:2]


def _solution(ex, name):  # the learner's function as the solution notebook writes it
    from mgpu_helpers.tools.authoring import exec_cell, exercise_source
    return exec_cell(exercise_source(ROOT / "solutions" / "05_gradient_accumulation.ipynb", ex))[name]


@pytest.mark.parametrize("check,ex,name", [(check_5_1, "5.1", "accumulate_gradients"),
                                           (check_5_2, "5.2", "accumulate_ddp")], ids=["5.1", "5.2"])
def test_grading_split_round_trips_through_torch_save(check, ex, name, tmp_path):
    fn = _solution(ex, name)
    results = check.run_all(fn, seed=11)
    torch.save(results, tmp_path / "r.pt")
    ok, msg = check.judge_all(11, torch.load(tmp_path / "r.pt", weights_only=True))
    assert ok, msg
    bad = [{"ok": True, "result": {"oops": 1}}] * len(results)
    ok, msg = check.judge_all(11, bad)
    assert not ok and ("which the check cannot use" in msg or "unusable result" in msg), msg


@pytest.mark.slow
def test_script_runs_under_torchrun():
    proc = run_torchrun("mgpu_helpers.checks", args=["accumulation"])
    assert "gradients equal the single-process big batch" in proc.stdout
    assert "= one sync" in proc.stdout
