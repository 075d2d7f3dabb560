"""mgpu_helpers.profiling: snapshot parsing, stored GPU assets, the profiler summary, checks 2.1/2.2."""
import json
import os
import pickle
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mgpu_helpers import profiling as P
from mgpu_helpers.checks import REGISTRY
import mgpu_helpers.checks.profiling  # noqa: F401  (registers 2.1 and 2.2)
from mgpu_helpers.checks import references as R
from mgpu_helpers.runtime.tracker import MemoryTracker

ROOT = Path(__file__).resolve().parent.parent
M = P.MiB


def _synthetic():
    trace = [{"action": "segment_alloc", "size": 20 * M}, {"action": "alloc", "size": 10 * M},
             {"action": "alloc", "size": 5 * M}, {"action": "free_requested", "size": 5 * M},
             {"action": "free_completed", "size": 5 * M}, {"action": "snapshot", "size": 0},
             {"action": "segment_alloc", "size": 20 * M}]
    # at the dump: two segments (40 MiB reserved), 10 MiB allocated, plus 2 MiB made before recording
    segments = [{"total_size": 20 * M + 2 * M, "allocated_size": 12 * M, "blocks": []},
                {"total_size": 20 * M, "allocated_size": 0, "blocks": []}]
    return {"segments": segments, "device_traces": [[], trace]}


def test_snapshot_series_undoes_events_from_the_dump():
    allocated, reserved = P.snapshot_series(_synthetic())
    assert allocated == [2 * M, 12 * M, 17 * M, 17 * M, 12 * M, 12 * M, 12 * M]
    assert reserved == [22 * M] * 6 + [42 * M]


def test_snapshot_summary_splits_by_phase():
    s = P.snapshot_summary(_synthetic(), {"forward": 0, "backward": 2, "optimizer": 5, "end": 7})
    assert s["peak in forward"] == 12 * M and s["peak in backward"] == 17 * M and s["peak in optimizer"] == 12 * M
    assert s["peak allocated"] == 17 * M and s["reserved at the end"] == 42 * M
    assert s["allocations"] == 2 and s["segments at the end"] == 2


def test_plot_snapshot_draws():
    import matplotlib
    matplotlib.use("Agg")
    ax = P.plot_snapshot(_synthetic(), {"forward": 0, "backward": 2, "optimizer": 5}, title="t")
    assert ax.get_ylabel() == "MiB" and len(ax.lines) >= 1


def test_stored_assets_are_small_consistent_and_labelled():
    fig = P.stored_figures()
    assert fig["made_by"] == "bench/profiling_gpu.py" and fig["device"].startswith("NVIDIA")
    for name in (P.FIGURES, P.SNAPSHOT, P.PNG):
        assert P.asset(name).stat().st_size < 2_000_000
    rows = fig["allocator"]
    assert all(r["allocated"] <= r["reserved"] <= r["device_used"] for r in rows.values())
    s = fig["snapshot"]
    summary = P.snapshot_summary(P.stored_snapshot(), s["marks"])
    assert summary == s["summary"]  # the notebook's parse of the pickle = what the GPU run computed
    # the trace's peak is the allocator's own counter (the trace misses only sub-KiB blocks made before it)
    assert abs(summary["peak allocated"] - s["max_memory_allocated"]) < 4096
    assert s["tracker_cpu"]["accounted_peak_bytes"] == pytest.approx(s["tracker_cuda"]["peak_bytes"], rel=0.01)


@pytest.mark.parametrize("where", ["solutions", "notebooks"])
def test_assets_found_from_either_notebook_folder(where, monkeypatch, tmp_path):
    (tmp_path / where).mkdir()
    monkeypatch.chdir(tmp_path / where)  # nothing next to it: falls back to the repository's copy
    assert P.asset(P.FIGURES) == ROOT / "solutions" / "assets" / P.FIGURES
    monkeypatch.chdir(ROOT / where)
    assert P.asset(P.FIGURES).resolve() == (ROOT / "solutions" / "assets" / P.FIGURES).resolve()


def test_top_memory_ops_is_deterministic():
    from torch.profiler import ProfilerActivity, profile

    def once():
        torch.manual_seed(0)
        model = P.mlp([32, 64, 10])
        opt = P.make_optimizer("adam", model.parameters())
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True, acc_events=True) as prof:
            P.train_step(model, opt, torch.randn(64, 32), torch.randint(0, 10, (64,)))
        return P.top_memory_ops(prof, k=5)

    a, b = once(), once()
    assert a == b and len(a) == 5
    assert [n for _, n in a] == sorted((n for _, n in a), reverse=True)


def test_peak_memory_reference_on_a_hand_made_step():
    def peak_memory(step_fn, tracker):
        before = tracker.current_bytes
        tracker.reset_peak()
        step_fn()
        return tracker.peak_bytes - before

    def step():
        t = torch.empty(1000, dtype=torch.uint8)
        u = torch.empty(3000, dtype=torch.uint8)  # noqa: F841 - 4000 bytes alive at the peak
        del t

    with MemoryTracker() as mt:
        keep = torch.empty(500, dtype=torch.uint8)  # noqa: F841
        big = torch.empty(10_000, dtype=torch.uint8)
        del big
        assert peak_memory(step, mt) == 4000


@pytest.mark.parametrize("ex", ["2.1", "2.2"])
def test_grading_split_round_trips(ex):
    def peak_memory(step_fn, tracker):
        before = tracker.current_bytes
        tracker.reset_peak()
        step_fn()
        return tracker.peak_bytes - before

    def peak_phase(model, optimizer, batch):
        x, y = batch
        with MemoryTracker(model, optimizer) as t:
            t.mark("forward")
            loss = torch.nn.functional.cross_entropy(model(x), y)
            t.mark("backward")
            loss.backward()
            t.mark("optimizer")
            optimizer.step()
            optimizer.zero_grad()
        peaks = t.phase_peaks()
        return max(peaks, key=peaks.get)

    check = REGISTRY[ex]
    results = check.run_all(peak_memory if ex == "2.1" else peak_phase, seed=3)
    assert check.judge_all(3, json.loads(json.dumps(results))) == (True, f"Exercise {ex} ✓ {check.function}: "
                                                                        f"{len(results)}/{len(results)} cases")
    assert not check.judge_all(3, [{"ok": True, "result": "forward" if ex == "2.2" else 1}] * len(results))[0]


def test_2_2_cases_have_clear_answers():
    # Every case's peak phase is the one its kind predicts, by a margin a learner's variant of the step
    # (another loss call, zero_grad placement) cannot close.
    for seed in range(5):  # 300 seeds checked once by hand: smallest margin 1.24
        for c in REGISTRY["2.2"].make_cases(seed):
            peaks, _ = R.phase_peaks(c)
            top, second = sorted(peaks.values(), reverse=True)[:2]
            assert max(peaks, key=peaks.get) == ("backward" if c["kind"] in ("activations", "narrow") else "optimizer")
            assert top > 1.15 * second, (c, peaks)


def test_2_1_spike_exceeds_every_step_peak():
    for seed in range(4):
        for c in REGISTRY["2.1"].make_cases(seed):
            m = R.peak_figures(c)
            assert m["old_peak"] > m["peak"] > m["after"] > m["before"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_allocator_demo_on_a_gpu(tmp_path):  # runs where a GPU is
    rows = P.allocator_demo()
    assert rows["b = a.float(); del b"]["reserved"] - rows["a = 256 MiB tensor"]["reserved"] >= 1024 * M
    frag = rows["40 x 2 MiB, every other one freed"]
    assert frag["reserved"] - frag["allocated"] >= 40 * M  # the holes
    assert rows["then empty_cache()"]["reserved"] == frag["reserved"]  # no segment is wholly free
    assert rows["then one 4 MiB tensor"]["reserved"] > frag["reserved"]  # so 4 MiB needs a new segment
    marks = P.record_step_snapshot(tmp_path / "s.pickle", widths=(256, 256, 10), batch=64)
    s = P.snapshot_summary(pickle.loads((tmp_path / "s.pickle").read_bytes()), marks)
    assert s["peak in backward"] > 0 and s["peak allocated"] >= s["peak in forward"]


def test_bench_script_is_a_no_op_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the script would measure")
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "profiling_gpu.py"), "--out", "/nonexistent"],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0 and "no CUDA device" in out.stdout, out.stderr


def test_checks_draw_fresh_inputs_unless_seeded():
    for ex in ("2.1", "2.2"):
        check = REGISTRY[ex]
        assert check.make_cases() != check.make_cases()
        assert check.make_cases(5) == check.cases(random.Random(5))
