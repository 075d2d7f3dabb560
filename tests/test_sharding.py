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
