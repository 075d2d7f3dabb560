"""Unit tests of mgpu_helpers.amp and amp_checks: dtype names and bad input, finfo table, casts of real values,
autocast lists, the memory measurements (autocast raises memory when weights dominate, lowers it when
activations do), the GradScaler reference and its plain-Python rule, and the grading split of 6.1/6.2."""
import random

import pytest
import torch
import torch.nn.functional as F

from mgpu_helpers.checks.amp import check_6_1, check_6_2
from mgpu_helpers.amp import (PRECISIONS, autocast_dtypes, compare_precisions, dtype_of,
                              precision_table, step_memory, survival)
from mgpu_helpers.checks.amp import LossScalerCheck, _decisions, gradscaler_run, library_step


def test_dtype_names_and_bad_input():
    assert dtype_of("bf16") is torch.bfloat16 and dtype_of(torch.float16) is torch.float16
    with pytest.raises(ValueError, match=r"dtype: unknown dtype 'fp8'.*'bf16'"):
        dtype_of("fp8")
    with pytest.raises(ValueError, match="dtype: unknown dtype"):
        dtype_of(torch.int8)
    with pytest.raises(ValueError, match=r"precision: unknown precision 'fp16-autocast'"):
        step_memory([4, 4], 2, "fp16-autocast")


def test_precision_table_is_finfo():
    rows = {r["dtype"]: r for r in precision_table()}
    assert rows["fp16"]["max"] == 65504.0 and rows["bf16"]["smallest normal"] == torch.finfo(torch.float32).tiny
    assert rows["fp16"]["smallest subnormal"] == 2.0**-24 and rows["bf16"]["eps"] == 2.0**-7
    assert all(r["exponent"] + r["mantissa"] + 1 == r["bits"] for r in rows.values())


def test_survival_of_values():
    v = torch.tensor([1e-9, 1e-6, 1.0, 1e5, 0.0])
    s = survival(v, "fp16")  # zero: 1e-9; subnormal: 1e-6; normal: 1; inf: 1e5 (the 0 is left out)
    assert s == {"zero": 0.25, "inf": 0.25, "subnormal": 0.25, "normal": 0.25}
    assert survival(v, "bf16")["normal"] == 1.0


def test_autocast_lists_on_cpu():
    d = autocast_dtypes("cpu", "bf16")
    assert d["linear / matmul"] == "bfloat16" and d["cross_entropy(linear)"] == "float32"
    assert d["linear + fp32"] == "float32"


def test_autocast_raises_memory_when_weights_dominate_and_lowers_it_otherwise():
    heavy = compare_precisions([256] * 4, 4)
    light = compare_precisions([16, 64, 64, 16], 2048)
    assert heavy["autocast"]["activations"] > heavy["fp32"]["activations"]  # the saved bf16 weight copies
    assert heavy["autocast"]["peak"] > heavy["fp32"]["peak"]
    assert light["autocast"]["peak"] < 0.7 * light["fp32"]["peak"]
    for res in (heavy, light):  # a pure bf16 model halves every figure (exact bytes on the CPU)
        assert res["bf16"]["peak"] * 2 == pytest.approx(res["fp32"]["peak"], rel=0.02)
        assert sum(res["bf16"]["peak_breakdown"].values()) == res["bf16"]["peak"]
    assert compare_precisions([256] * 4, 4) == heavy  # deterministic
    assert set(heavy) == set(PRECISIONS)


def test_step_memory_takes_the_devices_16_bits(monkeypatch):
    """The 16-bit rows run in training_precision(device)'s type: fp16 where it says so (a T4)."""
    import mgpu_helpers.amp as amp
    from mgpu_helpers.runtime.precision import Precision
    bf16 = compare_precisions([64] * 3, 8)
    asked, dtypes, mlp = [], [], amp.mlp
    monkeypatch.setattr(amp, "training_precision",
                        lambda device: asked.append(device) or Precision("cpu", torch.float16, True, "a T4"))
    monkeypatch.setattr(amp, "mlp", lambda widths, dtype=torch.float32, seed=0:
                        dtypes.append(dtype) or mlp(widths, dtype=dtype, seed=seed))
    fp16 = compare_precisions([64] * 3, 8)
    assert asked == [torch.device("cpu")] * 3 and dtypes == [torch.float32, torch.float32, torch.float16]
    assert fp16["autocast"]["activations"] == bf16["autocast"]["activations"]  # 2 bytes an element either way


def test_plain_python_rule_equals_gradscaler_on_random_scripts():
    for seed in range(10):
        for case in LossScalerCheck().cases(random.Random(seed)):
            ref, rule = gradscaler_run(case), _decisions(case)
            assert ref["scale"] == rule["scale"] and ref["clean_steps"] == rule["clean_steps"]
            assert ref["final_scale"] == rule["final_scale"]
            assert ref["stepped"] == [e == "ok" for e in case["script"]]


def test_library_step_mistakes_differ_from_the_right_step():
    case = check_6_2.make_cases(3)[1]  # momentum, loss_scale >= 16, max_norm twice the gradient norm
    right = library_step(case)
    for mistake in ("clip first", "no unscale", "16-bit loss"):
        assert not torch.allclose(library_step(case, mistake)["master"], right["master"], rtol=1e-4)


class Scaler:  # a reference solution of 6.1 (tests only)
    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        self.s, self.gf, self.bf, self.gi, self.clean_steps = init_scale, growth_factor, backoff_factor, growth_interval, 0

    def get_scale(self):
        return self.s

    def scale(self, loss):
        return loss * self.s

    def step(self, opt):
        grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
        torch._foreach_mul_(grads, 1 / self.s)
        if not all(torch.isfinite(g).all() for g in grads):
            self.s, self.clean_steps = self.s * self.bf, 0
            return False
        opt.step()
        self.clean_steps += 1
        if self.clean_steps == self.gi:
            self.s, self.clean_steps = self.s * self.gf, 0
        return True


def mixed_step(model, master, opt, x, y, loss_scale, max_norm):  # a reference solution of 6.2 (tests only)
    loss = F.cross_entropy(model(x.to(next(model.parameters()).dtype)).float(), y)
    (loss * loss_scale).backward()
    for m, p in zip(master, model.parameters()):
        m.grad = p.grad.float() / loss_scale
    torch.nn.utils.clip_grad_norm_(master, max_norm)
    opt.step()
    with torch.no_grad():
        for m, p in zip(master, model.parameters()):
            p.copy_(m)
            m.grad = None
    return loss.item()


@pytest.mark.parametrize("check,fn", [(check_6_1, Scaler), (check_6_2, mixed_step)], ids=["6.1", "6.2"])
def test_grading_split_round_trips_through_torch_save(check, fn, tmp_path):
    results = check.run_all(fn, seed=11)
    torch.save(results, tmp_path / "r.pt")
    ok, msg = check.judge_all(11, torch.load(tmp_path / "r.pt", weights_only=True))
    assert ok, msg
    ok, msg = check.judge_all(11, [{"ok": True, "result": {"oops": 1}}] * len(results))
    assert not ok and ("unusable result" in msg or "cannot use" in msg), msg


def test_wrong_types_get_a_message_not_a_crash():
    class NoneStep(Scaler):
        def step(self, opt):
            super().step(opt)  # GradScaler's step returns None: ours must say whether it stepped

    ok, msg = check_6_1.judge_all(5, check_6_1.run_all(NoneStep, seed=5))
    assert not ok and "step() returned None" in msg
    ok, msg = check_6_2.judge_all(5, check_6_2.run_all(lambda *a: "done", seed=5))
    assert not ok and "returned a str" in msg


def test_saved_for_backward_names_the_weight_copies():
    from mgpu_helpers.amp import saved_for_backward
    rows = saved_for_backward([32, 16, 16, 8], batch=4)
    # layer 0's input needs no gradient: its weight is never needed in backward, so no bf16 copy is kept
    assert [r["weight_copy"] for r in rows] == [0, 2 * 16 * 16, 2 * 8 * 16]
