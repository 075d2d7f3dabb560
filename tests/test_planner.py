"""The planner: equal to the tracker on the same real step; ZeRO derivation; closed forms; bad input."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mgpu_helpers import sharding
from mgpu_helpers.planner import (SIZES, Plan, cached_trace, decoder, lm_loss, model_state_bytes, plan,
                                  step_cost, token_batch)
from mgpu_helpers.planner_trace import apply_checkpointing, make_optimizer, train_step, warm_up
from mgpu_helpers.runtime.tracker import CATEGORIES, MemoryTracker


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class MLPNet(nn.Module):
    def __init__(self, d=32, layers=3, classes=10):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def tracked(model_fn, batch, loss_fn, precision, checkpointing, k):
    """The tracker's figures for the same step, taken for real on the CPU."""
    torch.manual_seed(0)
    model = model_fn()
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    if checkpointing:
        apply_checkpointing(model)
    opt = make_optimizer(model)
    warm_up(model, opt)
    with MemoryTracker(model, opt) as mt:
        train_step(model, opt, batch, loss_fn, precision=precision, micro_batches=k, mark=mt.mark)
    return mt.peak_bytes, mt.peak_breakdown()


CONFIGS = [("fp32", False, 1), ("bf16-autocast", False, 1), ("fp32", True, 1), ("fp32", False, 2),
           ("bf16-autocast", True, 2)]
MODELS = {
    "decoder": (decoder("tiny"), token_batch(4, 32, SIZES["tiny"][0]), lm_loss),
    "mlp": (MLPNet, (torch.randn(16, 32), torch.randint(0, 10, (16,))), F.cross_entropy),
}


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("precision,checkpointing,k", CONFIGS)
def test_plan_equals_tracker_on_the_real_step(model, precision, checkpointing, k):
    model_fn, batch, loss_fn = MODELS[model]
    p = plan(model_fn, batch, loss_fn=loss_fn, precision=precision, checkpointing=checkpointing,
             micro_batches=k, device="cpu")
    peak, breakdown = tracked(model_fn, batch, loss_fn, precision, checkpointing, k)
    assert abs(p.peak_bytes - peak) <= 0.01 * peak, (p.peak_bytes, peak)
    assert p.peak_bytes == peak and p.breakdown == breakdown  # in fact exact: the same accounting
    assert sum(p.breakdown.values()) == p.peak_bytes and set(p.breakdown) == set(CATEGORIES)


def test_pure_bf16_plan_equals_tracker():
    model_fn, batch, loss_fn = MODELS["mlp"]
    p = plan(model_fn, batch, loss_fn=loss_fn, precision="bf16", device="cpu")
    assert p.peak_bytes == tracked(model_fn, (batch[0].bfloat16(), batch[1]), loss_fn, "bf16", False, 1)[0]


def test_model_state_matches_the_closed_form_unsharded():
    tr = cached_trace("tiny", 4, 32, "fp32", False, 1)  # round_to=512: per-tensor rounding on top
    n = tr.n_params
    for stage in range(4):
        for world in (1, 2, 8):
            got = tr.shard(stage, world).model_state
            ref = model_state_bytes(n, zero_stage=stage, world_size=world, precision="fp32")
            for key, ours in (("parameters", "parameters"), ("gradients", "gradients"), ("optimizer", "optimizer")):
                slack = 512 * len(tr.param_sizes) * (2 if key == "optimizer" else 1) + 4 * world * len(tr.param_sizes)
                assert ref[key] <= got[ours] + 4 * world <= ref[key] + slack, (stage, world, key, got, ref)


def test_reexports_notebook_08s_closed_form():
    assert model_state_bytes is sharding.model_state_bytes


def test_sharding_rules():
    tr = cached_trace("tiny", 4, 32, "bf16-autocast", False, 1)
    base = tr.shard(0, 1)
    for stage in range(4):
        assert tr.shard(stage, 1) == Plan(**{**base.__dict__, "config": {**base.config, "zero_stage": stage}})
        assert tr.shard(0, 8).peak_bytes == base.peak_bytes  # stage 0: a replica per rank
    for world in (2, 4, 8):
        p1, p2, p3 = (tr.shard(s, world) for s in (1, 2, 3))
        assert p2.peak_bytes <= p1.peak_bytes <= base.peak_bytes
        assert p1.model_state["optimizer"] < base.model_state["optimizer"]
        assert p2.model_state["gradients"] < p1.model_state["gradients"]
        assert p3.model_state["parameters"] < p2.model_state["parameters"]
    assert tr.shard(3, 8).peak_bytes < tr.shard(3, 2).peak_bytes


def test_step_cost_rule():
    assert step_cost(world_size=1, zero_stage=0, checkpointing=False, micro_batches=1) == 1
    assert step_cost(world_size=4, zero_stage=3, checkpointing=True, micro_batches=2) == pytest.approx(
        1 + 1 / 3 + 0.1 + 0.06 + 0.5, abs=1e-6)


def test_nothing_real_is_allocated_for_a_7b_build(monkeypatch):
    # The planner's build of Llama-2-7B's shapes would need 27 GB if real; under fake tensors it is free.
    model_fn = decoder("7B")
    from mgpu_helpers.planner_trace import FakeTensorMode, _check_fake
    with FakeTensorMode():
        m = model_fn()
        _check_fake(m)
        assert sum(p.numel() for p in m.parameters()) == 6_738_415_616


def test_bad_input_names_the_argument():
    model_fn, batch, loss_fn = MODELS["mlp"]
    real = MLPNet()
    with pytest.raises(ValueError, match="model_fn allocated real memory"):
        plan(lambda: real, batch, loss_fn=loss_fn)
    with pytest.raises(TypeError, match="model_fn must return an nn.Module"):
        plan(lambda: 3, batch, loss_fn=loss_fn)
    with pytest.raises(TypeError, match=r"batch must be a tuple \(inputs, targets\)"):
        plan(model_fn, batch[0], loss_fn=loss_fn)
    with pytest.raises(TypeError, match="batch must be a tuple"):
        plan(model_fn, (batch[0],), loss_fn=loss_fn)
    with pytest.raises(ValueError, match="batch: inputs and targets"):
        plan(model_fn, (batch[0], batch[1][:3]), loss_fn=loss_fn)
    with pytest.raises(ValueError, match="precision must be one of"):
        plan(model_fn, batch, loss_fn=loss_fn, precision="fp8")
    with pytest.raises(ValueError, match="zero_stage must be one of"):
        plan(model_fn, batch, loss_fn=loss_fn, zero_stage=4)
    with pytest.raises(ValueError, match="world_size must be an int"):
        plan(model_fn, batch, loss_fn=loss_fn, world_size=0)
    with pytest.raises(ValueError, match="micro_batches=3 does not divide"):
        plan(model_fn, batch, loss_fn=loss_fn, micro_batches=3)
    with pytest.raises(ValueError, match="optimizer must be one of"):
        plan(model_fn, batch, loss_fn=loss_fn, optimizer="lion")
    with pytest.raises(ValueError, match="size must be one of"):
        decoder("70B")
