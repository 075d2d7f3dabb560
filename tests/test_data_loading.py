"""Unit tests of mgpu_helpers.data_loading: workers, prefetching, pinning on CPU, the sampler variants, the
grading split, bad input and the torchrun entry point."""
import pytest
import torch
from torch.utils.data import DataLoader

from testkit import run_torchrun
from mgpu_helpers.data_loading import SlowDataset, epoch_seconds, in_flight, pin_memory_on_this_machine, worker_memory
from mgpu_helpers.checks.data_loading import check_10_1
from mgpu_helpers.checks.references import sampler_variant, sampler_shard


def test_workers_are_other_processes_and_persistent_ones_stay():
    import os
    _, pids = epoch_seconds(DataLoader(SlowDataset(8, 0.0), batch_size=4, num_workers=2, persistent_workers=True))
    assert len(pids) == 2 and os.getpid() not in pids
    mem = worker_memory(1)
    assert mem["processes"] == 1 and 0 < mem["uss"][0] < mem["rss"][0]


def test_prefetch_keeps_workers_times_factor_batches_ahead():
    assert in_flight(2, 3) == 6


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only behaviour")
def test_pin_memory_without_accelerator_warns():
    pinned, warned = pin_memory_on_this_machine()
    assert not pinned and any("no accelerator" in w for w in warned)


@pytest.mark.parametrize("n,world,drop", [(10, 4, False), (10, 4, True), (2, 5, False), (7, 1, True), (12, 3, True)])
def test_reference_variant_equals_the_sampler(n, world, drop):
    for shuffle in (False, True):
        assert sampler_variant(n, world, shuffle, 3, 2, drop) == [sampler_shard(n, world, r, shuffle, 3, 2, drop)
                                                           for r in range(world)]


def test_bad_input():
    with pytest.raises(ValueError, match="delay"):
        SlowDataset(4, -1.0)


def test_grading_split_round_trips_through_torch_save(tmp_path):
    from torch.utils.data import DistributedSampler

    def fn(n, w, r, *, shuffle, seed, epoch, drop_last):   # torch's own, as a learner may write it
        s = DistributedSampler(range(n), num_replicas=w, rank=r, shuffle=shuffle, seed=seed, drop_last=drop_last)
        s.set_epoch(epoch)
        return list(s)
    results = check_10_1.run_all(fn, seed=11)
    torch.save(results, tmp_path / "r.pt")
    ok, msg = check_10_1.judge_all(11, torch.load(tmp_path / "r.pt", weights_only=True))
    assert ok, msg
    ok, msg = check_10_1.judge_all(11, [{"ok": True, "result": 5}] * len(results))
    assert not ok and "returned an int" in msg


@pytest.mark.slow
def test_script_runs_under_torchrun():
    assert "set_epoch reshuffles" in run_torchrun("mgpu_helpers.data_loading").stdout


def test_batches_go_to_workers_in_turn():
    from mgpu_helpers.data_loading import batch_makers
    assert batch_makers(0, batches=3) == [-1, -1, -1]
    assert batch_makers(2, batches=6) == [0, 1, 0, 1, 0, 1]


def test_throughput_separates_startup_and_reports_warnings():
    import os
    from mgpu_helpers.data_loading import throughput
    w = (os.cpu_count() or 1) + 1                      # more workers than cores: torch's warning is returned
    out = throughput(workers=(0, w), n=32, delay=0.0, batch_size=8)
    assert [r["items"] for r in out.values()] == [32, 32]
    assert out[0]["warnings"] == [] and any("worker processes" in m for m in out[w]["warnings"])
