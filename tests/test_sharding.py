"""Unit tests of mgpu_helpers.sharding: the closed-form ZeRO accounting (the paper's figures, uneven
splits, bad input), ..."""
import pytest

from mgpu_helpers.sharding import model_state_bytes


def _gb(stage):
    return round(model_state_bytes(7_500_000_000, zero_stage=stage, world_size=64)["total"] / 1e9, 2)


def test_zero_paper_figures():  # Rajbhandari et al. 2020, figure 1: 7.5B parameters, 64 GPUs, K = 12
    assert model_state_bytes(7_500_000_000)["total"] == 120 * 10**9
    assert [_gb(s) for s in (0, 1, 2, 3)] == [120.0, 31.41, 16.64, 1.88]
    assert [round(_gb(s), 1) for s in (1, 2)] == [31.4, 16.6]


@pytest.mark.parametrize("precision,optimizer,per_param", [
    ("mixed", "adam", (2, 2, 12)), ("mixed", "sgd", (2, 2, 4)), ("mixed", "momentum", (2, 2, 8)),
    ("fp32", "adam", (4, 4, 8)), ("fp32", "sgd", (4, 4, 0)), ("fp32", "momentum", (4, 4, 4)),
    ("bf16", "adam", (2, 2, 4)), ("bf16", "sgd", (2, 2, 0)), ("bf16", "momentum", (2, 2, 2))])
def test_bytes_per_parameter_unsharded(precision, optimizer, per_param):
    got = model_state_bytes(1000, precision=precision, optimizer=optimizer)
    assert (got["parameters"], got["gradients"], got["optimizer"]) == tuple(1000 * b for b in per_param)
    assert got["total"] == 1000 * sum(per_param)


def test_stages_shard_one_more_category_each():
    n, w = 1200, 4
    full = model_state_bytes(n)
    s = [model_state_bytes(n, zero_stage=k, world_size=w) for k in (0, 1, 2, 3)]
    assert s[0] == full
    assert s[1] == dict(full, optimizer=full["optimizer"] // w, total=4 * n + 12 * n // w)
    assert s[2]["gradients"] == full["gradients"] // w and s[2]["parameters"] == full["parameters"]
    assert s[3]["total"] == full["total"] // w
    assert all(model_state_bytes(n, zero_stage=k, world_size=1) == full for k in (1, 2, 3))


def test_uneven_split_is_padded_up():
    got = model_state_bytes(10, zero_stage=3, world_size=4, precision="fp32")  # 3 elements per rank
    assert got == {"parameters": 12, "gradients": 12, "optimizer": 24, "total": 48}
    assert model_state_bytes(3, zero_stage=3, world_size=8, precision="fp32")["parameters"] == 4
    assert model_state_bytes(0, zero_stage=3, world_size=8)["total"] == 0


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(precision="fp16"), ValueError, "precision"), (dict(optimizer="adagrad"), ValueError, "optimizer"),
    (dict(zero_stage=4), ValueError, "zero_stage"), (dict(zero_stage=-1), ValueError, "zero_stage"),
    (dict(world_size=0), ValueError, "world_size"), (dict(world_size=2.0), ValueError, "world_size"),
])
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        model_state_bytes(100, **kwargs)


def test_bad_n_params():
    with pytest.raises(ValueError, match="n_params"):
        model_state_bytes(-1)
    with pytest.raises(TypeError, match="n_params"):
        model_state_bytes(1.5)


# --- the harness, torch's versions, the sweep, the script ---------------------------------------------

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from testkit import run_torchrun  # noqa: E402
from mgpu_helpers.runtime.launch import run_ranks  # noqa: E402
from mgpu_helpers.memory import mlp  # noqa: E402
from mgpu_helpers.sharding import linears, unique  # noqa: E402
from mgpu_helpers.checks.sharding import check_8_2  # noqa: E402
from mgpu_helpers.runtime.fake_world import fake_world  # noqa: E402
from mgpu_helpers.sharding.fsdp import formula, measure, sweep, trains_like_one_process  # noqa: E402
from mgpu_helpers.checks.references import reference_reduce_scatter  # noqa: E402

WIDTHS = [16, 64, 64, 64, 10]


def test_make_model_ties_and_freezes():
    m = mlp([4, 5, 5, 5, 3], tie=(1, 2), freeze=(0,))
    lins = linears(m)
    assert lins[1].weight is lins[2].weight and not lins[0].weight.requires_grad
    assert len(unique([p for lin in lins for p in lin.parameters()])) == len(list(m.parameters())) == 7


def test_reference_reduce_scatter_passes_check_8_2(capsys, monkeypatch):
    import mgpu_helpers.checks.base as base
    with pytest.raises(AssertionError, match="the course's own implementation"):   # as a learner's answer: refused
        check_8_2(reference_reduce_scatter, seed=3)
    monkeypatch.setattr(base, "course_code_used", lambda fn, may_use=(): None)   # on its merits: right
    check_8_2(reference_reduce_scatter, seed=3)
    assert "Exercise 8.2 ✓" in capsys.readouterr().out


def _fsdp_and_zero2(rank, world):
    return {m: trains_like_one_process(rank, world, m, WIDTHS, reduce_scatter_fn=reference_reduce_scatter)
            for m in ("FSDP2 per block + root", "ZeRO-2 (Zero2)", "ZeRO-1 (ZeroRedundancyOptimizer)")}


def test_sharded_training_equals_one_process():  # 3 ranks: the flat size does not divide (Zero2 pads)
    for res in run_ranks(_fsdp_and_zero2, 3, timeout=60):
        assert all(d < 1e-4 for d in res.values()), res  # Adam lr 1e-2: summation order only


def _fsdp_state(rank, world):
    return measure(rank, world, "FSDP2 per block + root", WIDTHS)["state"]


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_model_state_within_1_over_n_plus_5_percent(world):
    replica = run_ranks(lambda r, w: measure(r, w, "DDP (DistributedDataParallel)", WIDTHS)["state"], 1)[0]
    full = sum(replica.values()) - replica["buckets"]  # the model state alone, without DDP's bucket copy
    per_rank = run_ranks(_fsdp_state, world, timeout=60)
    for r, state in enumerate(per_rank):
        assert sum(state.values()) <= full * (1 / world + 0.05), (r, state, full)
    with fake_world(world):  # the simulated rank 0 gives the same bytes as the real one
        assert measure(0, world, "FSDP2 per block + root", WIDTHS)["state"] == per_rank[0]
    assert not dist.is_initialized()


def test_sweep_matches_formula_for_zero2_and_fsdp2():
    res = sweep((1, 2, 8), ["ZeRO-2 (Zero2)", "FSDP2 per block + root"], WIDTHS, reduce_scatter_fn=reference_reduce_scatter)
    for m, by_world in res.items():
        for w, r in by_world.items():
            want, full = sum(formula(r["n_params"], m, w).values()), 16 * r["n_params"]
            assert want <= sum(r["state"].values()) <= want * 1.05, (m, w, r["state"])
            assert "FSDP2" not in m or sum(r["state"].values()) <= full * (1 / w + 0.05)
    assert res["FSDP2 per block + root"][8]["naive_param_bytes"] == 4 * res["FSDP2 per block + root"][8]["n_params"]


def test_torchrun_entry():
    out = run_torchrun("mgpu_helpers.sharding").stdout
    assert out.count("equal one process") == 2 and "FSDP2 per block + root on 2 ranks" in out, out


def test_ddp_holds_a_bucketed_copy_of_the_gradients():
    """DDP's default gradient_as_bucket_view=False: its buckets are one more copy of the fp32 gradients,
    on every world size (the row notebook 08 adds to the ZeRO paper's accounting)."""
    res = sweep((1, 2), ["DDP (DistributedDataParallel)", "ZeRO-1 (ZeroRedundancyOptimizer)"], WIDTHS)
    for m, by_world in res.items():
        for w, r in by_world.items():
            assert r["state"]["buckets"] == 4 * r["n_params"] == formula(r["n_params"], m, w)["buckets"], (m, w)
            assert r["state"]["gradients"] == 4 * r["n_params"]


def _comm_received(rank, world, method):
    from mgpu_helpers.runtime.comm_log import CommLog
    from mgpu_helpers.memory import make_batch
    from mgpu_helpers.sharding.fsdp import build
    import torch.nn.functional as F
    model, _, step = build(method, WIDTHS, reduce_scatter_fn=reference_reduce_scatter)
    x, y = make_batch(8, WIDTHS[0], WIDTHS[-1], 1)
    with CommLog() as comm:
        F.cross_entropy(model(x), y).backward()
        step()
    return {op: sum(o - i if op == "all_gather" else i - o for o2, _, i, o in comm.calls if o2 == op)
            for op in ("all_gather", "reduce_scatter")}


@pytest.mark.parametrize("world", [2, 4])
def test_comm_bytes_per_step_against_fsdp2_and_zero2(world):
    """What a rank receives per step in FSDP2's and Zero2's all-gathers and reduce-scatters (a reduce-scatter
    receives its input less its own shard), counted at the dispatcher, against comm_bytes_per_step: equal for
    Zero2's flat buffer; for FSDP2 within its per-parameter padding, less the root's second all-gather (the
    root is not resharded after forward)."""
    from mgpu_helpers.sharding import comm_bytes_per_step
    n = sum(p.numel() for p in mlp(WIDTHS).parameters())
    with fake_world(world):
        zero2 = _comm_received(0, world, "ZeRO-2 (Zero2)")
        fsdp = _comm_received(0, world, "FSDP2 per block + root")
    want2, want3 = (comm_bytes_per_step(n, zero_stage=s, world_size=world) for s in (2, 3))
    assert zero2 == {"all_gather": want2["all-gather"], "reduce_scatter": want2["reduce-scatter"]}, zero2
    root = sum(p.numel() * 4 for p in linears(mlp(WIDTHS))[-1].parameters()) * (world - 1) // world
    assert abs(fsdp["all_gather"] - (want3["all-gather"] - root)) <= 64 * world * 8, fsdp  # padding: < a row each
    assert abs(fsdp["reduce_scatter"] - want3["reduce-scatter"]) <= 64 * world * 8, fsdp
    big = [comm_bytes_per_step(10**9, zero_stage=s, world_size=8)["total"] for s in range(4)]
    assert [round(b / big[0], 6) for b in big] == [1, 1.5, 1, 1.5]
