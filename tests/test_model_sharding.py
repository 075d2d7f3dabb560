"""Unit tests of notebook 09's helpers: stage split, the reference GPipe step and its step clock, deadlock
reports, the tensor-parallel MLP (and torch's), bad input, the grading split, and the torchrun entry."""
import pytest
import torch
import torch.distributed as dist

from testkit import run_torchrun
from mgpu_helpers.runtime.launch import run_ranks
from mgpu_helpers.memory import make_batch
from mgpu_helpers.model_sharding import (StepRecorder, Stuck, as_intervals, bubble_fraction, make_mlp,
                                         make_model, param_bytes, parameter_bytes_formula, single_process_step,
                                         stage_bounds, step_timeline, torch_tensor_parallel)
from mgpu_helpers.checks.model_sharding import check_9_1, check_9_2
from mgpu_helpers.checks.references import gpipe_step
from mgpu_helpers.checks.references import TensorParallelMLP


def test_stage_bounds_uneven_and_bad_input():
    assert stage_bounds(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert stage_bounds(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert stage_bounds(3, 1) == [(0, 3)]
    with pytest.raises(ValueError, match="world_size=4"):
        stage_bounds(3, 4)


def _gpipe(rank, world, n_layers, n_micro):
    model, (x, y) = make_model(n_layers, 8), make_batch(12, 8, 8)
    with StepRecorder(model, stage_bounds(n_layers, world)[rank][0]) as rec:
        loss = gpipe_step(model, x, y, n_micro)
    base = make_model(n_layers, 8)
    base_loss = single_process_step(base, x, y)
    a, b = stage_bounds(n_layers, world)[rank]
    same = all(torch.allclose(p.grad, q.grad, atol=1e-6) for p, q in zip(model[a:b].parameters(), base[a:b].parameters()))
    others = all(p.grad is None for i, layer in enumerate(model) if not a <= i < b for p in layer.parameters())
    return same, others, loss if loss is None else abs(loss - base_loss) < 1e-6, rec.clock, rec.steps


@pytest.mark.parametrize("world,n_layers,n_micro", [(1, 3, 2), (2, 5, 3), (3, 7, 4), (4, 4, 1)])
def test_gpipe_equals_one_process_and_counts_the_bubble(world, n_layers, n_micro):
    ranks = run_ranks(_gpipe, world, n_layers, n_micro, timeout=60)
    assert all(same and others for same, others, *_ in ranks)
    assert ranks[-1][2] is True and all(r[2] is None for r in ranks[:-1])
    assert max(r[3] for r in ranks) == 2 * (n_micro + world - 1)
    per_rank = [as_intervals(r[4]) for r in ranks]
    assert bubble_fraction(per_rank) == pytest.approx((world - 1) / (n_micro + world - 1))


def test_gpipe_refuses_an_indivisible_batch():
    def work(rank, world):
        model, (x, y) = make_model(2, 4), make_batch(5, 4, 4)
        with pytest.raises(ValueError, match="n_micro=2"):
            gpipe_step(model, x, y, 2)
    run_ranks(work, 1)


def _deadlock(model, x, y, n_micro):
    dist.recv(torch.empty_like(x), src=1 - dist.get_rank())  # both ranks receive first


def _watched(rank, world):
    model, (x, y) = make_model(2, 4), make_batch(4, 4, 4)
    try:
        with StepRecorder(model, rank, timeout=0.5):
            _deadlock(model, x, y, 2)
    except Stuck as e:
        return str(e)


def test_recorder_reports_where_each_rank_waited():
    msgs = run_ranks(_watched, 2, timeout=30)
    for rank, msg in enumerate(msgs):
        assert f"dist.recv(src={1 - rank})" in msg and "after 0 send(s), 0 recv(s)" in msg, msg


def test_step_timeline_of_the_reference():
    ranks = run_ranks(step_timeline, 2, gpipe_step, 3, 2, timeout=60)
    assert [k for k, _ in ranks[0]["steps"]] == ["F", "F", "B", "B"]
    assert max(r["clock"] for r in ranks) == 6


def _tp(rank, world, d, h):
    dense = make_mlp(d, h, seed=3)
    tp = TensorParallelMLP(dense, rank, world)
    x = torch.randn(4, d, generator=torch.Generator().manual_seed(0))
    xt, xd = x.clone().requires_grad_(), x.clone().requires_grad_()
    yt, yd = tp(xt), dense(xd)
    yt.sum().backward()
    yd.sum().backward()
    ok = torch.allclose(yt, yd, atol=1e-5) and torch.allclose(xt.grad, xd.grad, atol=1e-5)
    ttp = torch_tensor_parallel(make_mlp(d, h, seed=3))
    ok &= torch.allclose(ttp(x), yd, atol=1e-5)
    return ok, param_bytes(tp), param_bytes(ttp)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_tensor_parallel_mlp_equals_dense_with_one_nth_of_the_bytes(world):
    for ok, mine, torchs in run_ranks(_tp, world, 8, 16, timeout=60):
        assert ok and mine == torchs == parameter_bytes_formula(8, 16, world)
    assert parameter_bytes_formula(8, 16, 1) == 4 * (2 * 8 * 16 + 16 + 8)


def test_tensor_parallel_refuses_an_indivisible_hidden_size():
    with pytest.raises(ValueError, match="hidden size 10 is not divisible by world_size=3"):
        TensorParallelMLP(make_mlp(4, 10), 0, 3)


@pytest.mark.parametrize("check", [check_9_1, check_9_2])
def test_grading_split_judges_outside(check):
    from mgpu_helpers.tools.authoring import exec_cell, exercise_source
    from testkit import ROOT
    fn = exec_cell(exercise_source(ROOT / "solutions" / "09_model_sharding.ipynb", check.id))[check.function]
    ok, msg = check.judge_all(5, check.run_all(fn, 5))
    assert ok, msg
    ok, msg = check.judge_all(5, [{"ok": True, "result": 3}] * 5)
    assert not ok and "cannot use" in msg or "expected one result" in msg, msg


def test_script_under_torchrun():
    out = run_torchrun("mgpu_helpers.checks", nproc=2, args=["model_sharding"]).stdout
    assert "world size 2" in out and out.count(": True") == 2, out
