"""Notebook 04's helpers: bucket rule, cases, references, grading split, launch traps, the script."""
import io
from pathlib import Path

import pytest

from testkit import run_torchrun
import torch
import torch.distributed as dist

from mgpu_helpers import ddp as lesson
from mgpu_helpers.checks import REGISTRY, ddp
from mgpu_helpers.memory import make_batch
from mgpu_helpers.tools.authoring import exec_cell, exercise_source
from mgpu_helpers.runtime.launch import run_ranks

ROOT = Path(__file__).resolve().parent.parent
NB = ROOT / "solutions" / "04_ddp.ipynb"


def _solution(ex, name):
    return exec_cell(exercise_source(NB, ex))[name]


@pytest.mark.parametrize("sizes,cap,buckets", [
    ([8, 8, 8], 16, [16, 8]),                 # the next gradient would exceed the cap: new bucket
    ([8, 8, 8], 24, [24]),                    # exactly the cap fits
    ([8, 8, 8], 7, [8, 8, 8]),                # every gradient larger than the cap: one bucket each
    ([4, 100, 4, 4], 10, [4, 100, 8]),        # a large gradient alone, small ones packed around it
    ([4, 4], 10**9, [8]),
])
def test_bucket_rule(sizes, cap, buckets):
    assert ddp._expected_buckets(sizes, cap) == buckets


@pytest.mark.parametrize("seed", range(25))
def test_cases_test_what_they_claim(seed):
    at_cap, middle, big, one = ddp.check_4_2.make_cases(seed)
    for case in (at_cap, middle, big, one):
        sizes = ddp._grad_bytes(case)
        model = ddp._model(case)
        model(ddp._shard(case, 0)[0]).sum().backward()
        assert sizes == [p.numel() * p.element_size() for p in model.parameters() if p.grad is not None]
        assert len(ddp._expected_buckets(sizes, case["cap"])) < len(sizes)   # bucketing saves collectives
        assert len(case["rows"]) == case["world_size"]
    assert ddp._expected_buckets(ddp._grad_bytes(at_cap), at_cap["cap"])[0] == at_cap["cap"]   # exactly at it
    assert at_cap["unused"] and len(set(at_cap["rows"])) > 1                  # an unused parameter; uneven shards
    assert any(p.grad is None for p in ddp._model(at_cap).parameters())
    assert len(ddp._expected_buckets(ddp._grad_bytes(one), one["cap"])) == 1 and one["world_size"] == 1
    assert max(ddp._grad_bytes(big)) > big["cap"]
    assert len(ddp._expected_buckets(ddp._grad_bytes(middle), middle["cap"])) > 1
    assert [c["world_size"] for c in ddp.check_4_1.make_cases(seed)] == [2, 3, 1]


def test_shards_partition_the_batch():
    x, y = make_batch(12, 5, 3)
    assert torch.equal(torch.cat([lesson.shard(x, r, 3) for r in range(3)]), x)
    assert torch.equal(make_batch(12, 5, 3)[1], y)          # deterministic from the seed


def _ddp_rank(rank, world_size, case):
    from torch.nn.parallel import DistributedDataParallel as DDP
    net = DDP(ddp._model(case), find_unused_parameters=case["unused"])
    x, y = ddp._shard(case, rank)
    torch.nn.functional.cross_entropy(net(x), y).backward()
    return {n: p.grad for n, p in net.module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("which", [0, 1])
def test_reference_is_what_torch_ddp_computes(which):
    # the checks' reference (the mean over ranks of each rank's own gradients), against torch DDP itself,
    # with uneven shards and an unused parameter
    case = ddp.check_4_1.make_cases(3)[which]
    locals_ = ddp._references(case)
    for got in run_ranks(_ddp_rank, case["world_size"], case, backend="gloo"):
        for n, g in got.items():
            assert torch.allclose(g, sum(loc[n] for loc in locals_) / case["world_size"], rtol=1e-4, atol=1e-6)


def test_collective_mismatch_messages():
    from mgpu_helpers.checks import collective_mismatch
    msg = collective_mismatch([[["all_reduce", 8, 0]] * 2, [["all_reduce", 8, 0]] * 4])
    assert msg.startswith("rank 0 made 2 all_reduce calls, rank 1 made 4: the ranks' collectives do not match")
    msg = collective_mismatch([[["all_reduce", 8, 1]], [["all_reduce", 8, 3]]], tag="micro-step")
    assert "rank 0's is all_reduce of 8 bytes in micro-step 1, rank 1's is all_reduce of 8 bytes in micro-step 3" in msg


@pytest.mark.parametrize("ex,name", [("4.1", "average_gradients"), ("4.2", "allreduce_bucketed")])
def test_grading_split_ships_plain_data(ex, name):
    check, seed = REGISTRY[ex], 11
    results = check.run_all(_solution(ex, name), seed)
    buf = io.BytesIO()
    torch.save(results, buf)
    buf.seek(0)
    shipped = torch.load(buf, weights_only=True)                # what the grader's judge receives
    n = len(check.make_cases(seed))
    assert check.judge_all(seed, shipped) == (True, f"Exercise {ex} ✓ {name}: {n}/{n} cases")


def test_aliased_all_reduce_is_not_penalised():
    # The check cannot count calls made through an alias bound before the ranks start; it must not fail them.
    alias = "import torch.distributed as dist\nfrom torch.distributed import all_reduce"
    src = exercise_source(NB, "4.2").replace("import torch.distributed as dist", alias)
    src = src.replace("dist.all_reduce(flat,", "all_reduce(flat,")
    check = REGISTRY["4.2"]
    ok, msg = check.judge_all(5, check.run_all(exec_cell(src)["allreduce_bucketed"], 5))
    assert ok, msg


def test_wrong_type_is_named():
    def returns_a_list(model, cap):
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
        return [1]
    ok, msg = REGISTRY["4.2"].judge_all(2, REGISTRY["4.2"].run_all(returns_a_list, 2))
    assert not ok and "returned a list; expected an int" in msg, msg


def test_right_grads_wrong_packing_fails():
    def packs_everything(model, cap):     # right gradients, one bucket whatever the cap
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
        off = 0
        for g in grads:
            g.copy_(flat[off:off + g.numel()].view_as(g))
            off += g.numel()
        return 1
    ok, msg = REGISTRY["4.2"].judge_all(2, REGISTRY["4.2"].run_all(packs_everything, 2))
    assert not ok and "number of collectives returned: got 1" in msg


def test_draw_collectives():
    fig = lesson.draw_collectives({"all_reduce": ([[1, 2], [3, 4]], [[4, 6], [4, 6]]),
                                "all_gather": ([[1], [2]], [[1, 2], [1, 2]])})
    assert len(fig.axes) == 4
    import matplotlib.pyplot as plt
    plt.close(fig)


@pytest.mark.slow
def test_spawn_from_notebook_fails_as_described():
    lines = lesson.spawn_from_notebook()
    assert lines[0] == "AttributeError: Can't get attribute 'work' on <module '__main__'>"
    assert "ProcessExitedException" in lines[1] and lines[-1] == "exit code 1"


@pytest.mark.slow
def test_check_runs_under_spawn(monkeypatch):
    # GPU machines spawn (fork after CUDA init is fatal): the learner's __main__ function must travel by value.
    check = REGISTRY["4.2"]
    case = check.make_cases(4)[0]
    monkeypatch.setenv("MGPU_START_METHOD", "spawn")
    result = check.run(_solution("4.2", "allreduce_bucketed"), case)
    monkeypatch.delenv("MGPU_START_METHOD")
    check.judge(case, result)


@pytest.mark.slow
def test_torchrun_script():
    p = run_torchrun("mgpu_helpers.ddp")
    assert "DDP on 2 ranks (gloo)" in p.stdout and "equal one process on the full batch of 16: True" in p.stdout
