"""Notebook 03's helpers: the problem, the references, the simulated devices, DDP ranks, the script."""
import io
import sys
from pathlib import Path

import pytest

from testkit import run_torchrun
import torch
import torch.nn.functional as F

from mgpu_helpers import data_parallel as dp
from mgpu_helpers.checks.data_parallel import check_3_1
from mgpu_helpers.tools.authoring import exec_cell, exercise_source
from mgpu_helpers.runtime.launch import run_ranks

ROOT = Path(__file__).resolve().parent.parent
NB = ROOT / "solutions" / "03_data_parallel.ipynb"
SMALL = {"tokens": 10, "d_model": 6, "hidden": 12, "vocab": 32}


def _close(a, b, atol=1e-6):
    return all(torch.allclose(x, y, atol=atol) for x, y in zip(a, b))


def test_problem_is_deterministic():
    (m1, x1, y1), (m2, x2, y2) = dp.make_problem(**SMALL, seed=3), dp.make_problem(**SMALL, seed=3)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert all(torch.equal(a, b) for a, b in zip(m1.parameters(), m2.parameters()))


def test_references():
    model, x, y = dp.make_problem(**SMALL)
    loss, grads = dp.single_device_grads(model, x, y)
    assert all(p.grad is None for p in model.parameters())          # works on a copy
    assert torch.allclose(loss, F.cross_entropy(model(x), y))
    # 10 rows in 4 chunks: 3+3+3+1, so the unweighted average of chunk losses differs...
    bad, bad_grads = dp.single_device_grads(model, x, y, per_chunk=4)
    assert not torch.allclose(bad, loss) and not _close(bad_grads, grads)
    # ...while equal chunks make it equal, and a .grad already on the model changes nothing
    model(x).sum().backward()
    assert _close(dp.single_device_grads(model, x, y, per_chunk=5)[1], grads)


def test_loss_inside_shares_add_up_to_the_mean():
    model, x, y = dp.make_problem(**SMALL)
    wrapped = dp.LossInside(model)
    shares = [wrapped(a, b, len(x)) for a, b in zip(x.chunk(4), y.chunk(4))]
    assert torch.allclose(torch.cat(shares).sum(), F.cross_entropy(model(x), y))


@pytest.mark.parametrize("n,inside", [(1, False), (3, False), (4, True), (3, True)])
def test_simulation_gives_single_device_gradients(n, inside):
    model, x, y = dp.make_problem(**SMALL)
    ref_loss, ref = dp.single_device_grads(model, x, y)
    r = dp.simulate_data_parallel(model, x, y, n, loss_inside=inside)
    assert torch.allclose(r["loss"], ref_loss) and _close(r["grads"], ref)
    assert len(r["devices"]) == len(x.chunk(n))


def test_simulation_measures_the_device0_hotspot_exactly():
    spec = {"tokens": 64, "d_model": 8, "hidden": 16, "vocab": 1024}
    runs = [dp.simulate_data_parallel(*dp.make_problem(**spec), 4, loss_inside=inside)
            for inside in (False, True, False)]
    on0, inside, again = (r["devices"] for r in runs)
    assert on0 == again                                              # exact and repeatable
    logits = 64 * 1024 * 4
    assert on0[0]["peak"] - on0[1]["peak"] > 3 * logits              # whole-batch logits on device 0
    assert on0[1]["peak"] == on0[2]["peak"] == on0[3]["peak"]
    assert inside[0]["phases"]["gather + loss"] < on0[0]["phases"]["gather + loss"] - 3 * logits
    assert inside[0]["peak"] < on0[0]["peak"] / 2
    params = sum(p.numel() for p in dp.make_problem(**spec)[0].parameters()) * 4
    assert all(d["breakdown"]["parameters"] == params for d in on0 + inside)  # a full replica each
    assert all(sum(d["breakdown"].values()) == d["peak"] for d in on0 + inside)


def test_device_table_and_bars():
    r = dp.simulate_data_parallel(*dp.make_problem(**SMALL), 2)
    out = io.StringIO()
    sys.stdout, old = out, sys.stdout
    try:
        dp.device_table(r["devices"])
    finally:
        sys.stdout = old
    lines = out.getvalue().splitlines()
    assert lines[0].split() == ["device", "peak", "MiB", "parameters", "gradients", "activations", "other"]
    assert len(lines) == 3
    import matplotlib
    matplotlib.use("Agg")
    ax = dp.device_bars(r["devices"], "t")
    assert [t.get_text() for t in ax.get_xticklabels()] == ["device 0", "device 1"]


def test_ddp_ranks_equal_single_device_and_are_balanced():
    spec = {"tokens": 16, "d_model": 8, "hidden": 16, "vocab": 64}
    ranks = run_ranks(dp.ddp_step, 2, spec, backend="gloo", threads=1)  # see the notebook: fork + OpenMP
    _, ref = dp.single_device_grads(*dp.make_problem(**spec))
    assert all(_close(r["grads"], ref) for r in ranks)
    assert ranks[0]["peak"] == ranks[1]["peak"] > 0


def test_demos_return_timings():
    rows = dp.time_replicate(hiddens=(8, 16), layers=2, batch=4)
    assert [r["params"] for r in rows] == [2 * (8 * 8 + 8), 2 * (16 * 16 + 16)]
    assert all(r["replicate_s"] > 0 and r["step_s"] > 0 for r in rows)
    threads = torch.get_num_threads()
    out = dp.gil_demo(2)
    assert torch.get_num_threads() == threads                      # restored
    assert all(t["sequential_s"] > 0 and t["threads_s"] > 0 for t in out.values()) and len(out) == 2


def test_grading_split_round_trips_through_torch_save():
    check = check_3_1
    fn = exec_cell(exercise_source(NB, "3.1"))["data_parallel_step"]
    buf = io.BytesIO()
    torch.save(check.run_all(fn, seed=11), buf)
    buf.seek(0)
    assert check.judge_all(11, torch.load(buf, weights_only=True)) == (True, "Exercise 3.1 ✓ data_parallel_step: 3/3 cases")


@pytest.mark.parametrize("seed", range(20))
def test_cases_cover_even_uneven_and_fewer_chunks(seed):
    even, uneven, fewer = check_3_1.make_cases(seed)
    chunks = lambda c: [len(t) for t in torch.arange(c["batch"]).chunk(c["n_replicas"])]  # noqa: E731
    assert len(set(chunks(even))) == 1 and len(chunks(even)) == even["n_replicas"] >= 2
    assert len(set(chunks(uneven))) > 1 and len(chunks(uneven)) == uneven["n_replicas"]
    assert len(chunks(fewer)) < fewer["n_replicas"]
    ts = lambda c: sorted(len(t) for t in torch.arange(c["batch"]).tensor_split(c["n_replicas"]))  # noqa: E731
    assert ts(fewer) != sorted(chunks(fewer))                     # tensor_split is told apart


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_real_data_parallel_matches_single_device():
    _, x, y = dp.make_problem(**dp.DEMO)
    _, ref = dp.single_device_grads(dp.make_problem(**dp.DEMO)[0], x, y)
    for inside in (False, True):
        r = dp.real_data_parallel_memory(2, loss_inside=inside)
        assert _close(r["grads"], ref, atol=1e-5) and len(r["peaks"]) == 2


@pytest.mark.slow
def test_torchrun_script():
    p = run_torchrun("mgpu_helpers.data_parallel")
    assert "DDP on 2 ranks (gloo)" in p.stdout and "equal one process on the full batch of 16: True" in p.stdout
