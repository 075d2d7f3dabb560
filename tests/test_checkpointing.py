"""Unit tests of mgpu_helpers.checkpointing: segments, the exact peak prediction (also for the mixed plans
the check uses to name mistakes), gradients of full and selective checkpointing, bad input, the grading split."""
import random

import pytest
import torch
import torch.nn.functional as F

from mgpu_helpers.tools.authoring import verdict
from mgpu_helpers.memory import make_batch
from mgpu_helpers.checkpointing import (OpLog, Stack, measure_step, no_checkpointing, plan_for,
                                        predict_peak, segments, selective_context, selective_vs_full,
                                        sequential_plan, torch_segments)
from mgpu_helpers.checks.checkpointing import _case, _mistake_plans, check_7_1
from mgpu_helpers.checks.references import checkpoint_every, run_plan


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_segments_cover_every_block_once_the_last_shorter():
    assert segments(9, 2) == [(0, 2), (2, 4), (4, 6), (6, 8), (8, 9)]
    assert segments(5, 5) == [(0, 5)] and segments(3, 1) == [(0, 1), (1, 2), (2, 3)]
    for bad in (0, -1, 6):
        with pytest.raises(ValueError, match=f"k={bad}"):
            segments(5, bad)
    with pytest.raises(TypeError, match="k must be an int"):
        segments(5, 2.0)
    with pytest.raises(ValueError, match="k=0"):
        checkpoint_every(Stack(3, 4, 8, 2).blocks, torch.randn(2, 4), 0)


def _grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("k", [1, 2, 3, 7])
def test_checkpoint_every_gradients_equal_the_plain_step(k):
    x, y = make_batch(64, 8, 3)
    plain, ckpt = Stack(7, 8, 16, 3, seed=4), Stack(7, 8, 16, 3, seed=4)
    F.cross_entropy(plain.head(no_checkpointing(plain.blocks, x)), y).backward()
    F.cross_entropy(ckpt.head(checkpoint_every(ckpt.blocks, x, k)), y).backward()
    assert torch.equal(_grads(plain), _grads(ckpt))  # non-reentrant: bitwise equal


def test_predict_peak_is_exact_on_the_checks_cases_and_mistake_plans():
    rng = random.Random(0)
    for _ in range(12):
        L = rng.randint(2, 12)
        c = _case(rng, L, rng.randint(1, L))
        model = Stack(L, c["d"], c["h"], c["classes"], seed=c["seed"])
        x, y = make_batch(c["batch"], c["d"], c["classes"], seed=c["seed"])
        shape = (c["d"], c["h"], c["classes"], c["batch"])
        plans = {"right": plan_for(L, c["k"]), **_mistake_plans(L, c["k"])}
        for name, plan in plans.items():
            measured, _ = measure_step(model, x, y, lambda b, x_, k_: run_plan(b, x_, plan))
            assert measured == predict_peak(plan, *shape), (name, c)


def test_checkpointing_lowers_the_peak_and_k_equal_L_saves_nothing():
    L, d, h, c, B = 9, 16, 32, 4, 256
    peak = {k: predict_peak(plan_for(L, k), d, h, c, B) for k in [None, *range(1, L + 1)]}
    assert peak[L] == peak[None]
    assert min(peak[k] for k in range(1, L)) < 0.5 * peak[None]


def test_recompute_is_visible_and_selective_skips_the_matmuls():
    stack = Stack(1, 4, 8, 2)
    x = torch.randn(3, 4)
    logs = {}
    for name, kw in [("full", {}), ("selective", {"context_fn": selective_context})]:
        out = torch.utils.checkpoint.checkpoint(stack.blocks[0], x, use_reentrant=False, **kw)
        with OpLog() as log:
            out.sum().backward()
        logs[name] = log.ops
    assert logs["full"].count("addmm") == 1 and "relu" in logs["full"]
    assert "addmm" not in logs["selective"] and "relu" in logs["selective"]


def test_selective_between_full_and_none_with_equal_gradients():
    res = selective_vs_full(layers=2, d=32, h=128, batch=256, repeat=1)
    none, sac, full = (res[n] for n in ("no checkpointing", "selective (save matmuls)", "full checkpointing"))
    assert full["peak"] < sac["peak"] < none["peak"]
    for r in (sac, full):
        for n, g in none["grads"].items():
            torch.testing.assert_close(r["grads"][n], g, rtol=1e-4, atol=1e-6)


def test_wrong_type_is_reported_not_crashed():
    ok, msg = verdict(check_7_1, lambda blocks, x, k: 3 if 1 <= k <= len(blocks) else (_ for _ in ()).throw(
        ValueError("k")), seed=1)
    assert not ok and "returned an int" in msg


def test_grading_split_round_trips_through_torch_save(tmp_path):
    from pathlib import Path
    from mgpu_helpers.tools.authoring import exec_cell, exercise_source
    nb = Path(__file__).resolve().parents[1] / "solutions" / "07_activation_checkpointing.ipynb"
    solution = exec_cell(exercise_source(nb, "7.1"))["checkpoint_segments"]   # the course's own is refused
    results = check_7_1.run_all(solution, seed=11)
    torch.save(results, tmp_path / "r.pt")
    ok, msg = check_7_1.judge_all(11, torch.load(tmp_path / "r.pt", weights_only=True))
    assert ok, msg
    ok, msg = check_7_1.judge_all(11, [{"ok": True, "result": {"oops": 1}}] * len(results))
    assert not ok


def test_recomputed_matmuls_counted_from_the_op_log():
    from mgpu_helpers.checkpointing import MATMULS, Stack, no_checkpointing, recomputed_ops, segments
    L = 5
    model, (x, y) = Stack(L, 4, 8, 3), make_batch(16, 4, 3)
    assert recomputed_ops(model, x, y, no_checkpointing) == {}
    for k in range(1, L + 1):  # each segment again but its last layer: 2L - (number of segments)
        assert recomputed_ops(model, x, y, checkpoint_every, k)["addmm"] == 2 * L - len(segments(L, k))
    assert torch.ops.aten.linear.default not in MATMULS


def test_the_policy_sees_addmm_not_linear():
    from mgpu_helpers.checkpointing import Block, policy_ops
    ops = policy_ops(Block(4, 8), torch.randn(3, 4))
    assert ops.count("addmm.default") == 2 and not any(op.startswith("linear") for op in ops)


def test_torch_segments_is_predicted_exactly():
    """The cells' stand-in until 7.1 is done: torch's checkpoint_sequential, its own plan, exact bytes."""
    L, d, h, classes, batch = 9, 16, 32, 4, 256
    model, (x, y) = Stack(L, d, h, classes), make_batch(batch, d, classes)
    for k in range(1, L + 1):
        measured, _ = measure_step(model, x, y, torch_segments, k)
        assert measured == predict_peak(sequential_plan(L, k), d, h, classes, batch), k
