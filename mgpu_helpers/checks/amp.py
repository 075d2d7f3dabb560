"""Notebook 06's checks: 6.1 a dynamic loss scaler against ``torch.amp.GradScaler``, 6.2 a mixed-precision step
with fp32 master weights against an fp32 model under ``torch.autocast``. The named mistakes are those torch calls
used wrongly, or GradScaler's rule with one planted slip (``_decisions``): no working scaler lives here."""

import torch
import torch.nn.functional as F

from .base import Check, CheckFailure, _matches, describe_value, expect, expect_close, expect_equal, flat, scalar
from ..memory import make_batch, make_optimizer, mlp, nbytes
from ..runtime.tracker import MemoryTracker

DTYPES16 = {"bf16": torch.bfloat16, "fp16": torch.float16}


# --- 6.1: scripted overflows --------------------------------------------------------------------------

def group_of(case, t) -> int:
    """The parameter group whose gradient step ``t``'s injected inf/nan went into (the draw's edge test asks)."""
    n = 2 * (len(case["widths"]) - 1)  # weight and bias per Linear
    return int(case["where"][t] % n >= n // 2)


def scripted_run(case, scale, step, get_scale, counter) -> dict:
    """Train a small MLP with SGD (two groups) through ``case["script"]`` ("ok", or an "inf"/"nan" put into parameter
    ``where``'s gradient after backward); record the scaler's decisions and whether the weights moved at each step."""
    widths, g = case["widths"], torch.Generator().manual_seed(case["seed"] + 1)
    model = mlp(widths, seed=case["seed"])
    params = list(model.parameters())
    half = len(params) // 2  # two groups, as real scripts have: a scaler must unscale and check every group
    opt = torch.optim.SGD([{"params": params[:half]}, {"params": params[half:], "lr": 0.02}], lr=0.05, momentum=0.9)
    rec = {"scale": [], "stepped": [], "clean_steps": [], "moved": []}
    for event, where in zip(case["script"], case["where"]):
        x, y = torch.randn(6, widths[0], generator=g), torch.randint(widths[-1], (6,), generator=g)
        opt.zero_grad(set_to_none=True)
        rec["scale"].append(scalar(get_scale()))
        scale(F.cross_entropy(model(x), y)).backward()
        if event != "ok":
            p = params[where % len(params)]
            p.grad.view(-1)[where % p.numel()] = float(event)
        before = flat(params)
        rec["stepped"].append(scalar(step(opt)))
        rec["moved"].append(not torch.equal(flat(params), before))
        rec["clean_steps"].append(scalar(counter()))
    return {**rec, "final_scale": scalar(get_scale()), "params": flat(params)}


def gradscaler_run(case, unscale=True) -> dict:
    """The reference: ``torch.amp.GradScaler("cpu")`` on the same script. ``unscale=False`` re-multiplies the unscaled
    gradients by the scale before stepping (no unscaling); ``unscale="first group"``: all groups but the first."""
    gs = torch.amp.GradScaler("cpu", init_scale=case["init_scale"], growth_factor=case["growth_factor"],
                              backoff_factor=case["backoff_factor"], growth_interval=case["growth_interval"])

    def step(opt):
        used = gs.get_scale()
        gs.unscale_(opt)
        found = sum(v.item() for v in gs._found_inf_per_device(opt).values()) > 0  # what update will consume
        if unscale is not True:
            for grp in opt.param_groups[1 if unscale == "first group" else 0:]:
                for p in grp["params"]:
                    p.grad.mul_(used)
        gs.step(opt)
        gs.update()
        return not found

    return scripted_run(case, gs.scale, step, gs.get_scale, lambda: gs.state_dict()["_growth_tracker"])


MISTAKES_61 = {
    "late": "grew one step late: the scale grows on the growth_interval-th clean step in a row "
            "(clean_steps == growth_interval, not >)",
    "no_reset": "the clean-step counter was not reset to 0 after an overflow",
    "counted_skip": "counted the skipped step as a clean one (after an overflow the counter restarts at 0)",
    "no_reset_growth": "the clean-step counter was not reset to 0 after growing",
    "nan": "a nan was not detected (torch.isinf misses nan: use torch.isfinite)",
}
FIRST_GROUP = ("only param_groups[0] was unscaled and checked: loop over every group in optimizer.param_groups "
               "(this optimizer has two)")


def _decisions(case, mistake=None) -> dict:
    """GradScaler's rule with one planted slip, to name mistakes (the expected values are GradScaler's). nan-blind:
    once a nan reached the weights every later gradient is nan too, so only injected infs count as overflows."""
    scale, count, rec = case["init_scale"], 0, {"scale": [], "clean_steps": []}
    for event in case["script"]:
        rec["scale"].append(scale)
        if event == "inf" or (event == "nan" and mistake != "nan"):
            scale *= case["backoff_factor"]
            count = count if mistake == "no_reset" else (1 if mistake == "counted_skip" else 0)
        else:
            count += 1
            if count == case["growth_interval"] + (mistake == "late"):
                scale *= case["growth_factor"]
                count = count if mistake == "no_reset_growth" else 0
            elif mistake == "no_reset_growth" and count > case["growth_interval"]:
                scale *= case["growth_factor"]
        rec["clean_steps"].append(count)
    return {**rec, "final_scale": scale}


class LossScalerCheck(Check):
    id, function = "6.1", "DynamicLossScaler"
    FIXED = [["inf", "ok", "ok", "ok", "ok"],                       # an overflow on the very first step
             ["ok", "ok", "ok", "inf", "ok", "ok", "ok", "ok"],     # growth at exactly 3, overflow right after
             ["ok", "ok", "nan", "ok", "ok", "ok", "ok"],           # a nan, mid-count
             ["ok", "inf", "inf", "ok", "ok", "ok", "ok", "ok"]]    # two in a row

    def cases(self, rng):
        scripts = [list(s) for s in self.FIXED]
        scripts.append([rng.choice(["ok", "ok", "ok", "inf", "nan"]) for _ in range(rng.randint(8, 11))])
        out = []
        for i, script in enumerate(scripts):
            widths = [rng.randint(3, 12), rng.randint(4, 16), rng.randint(2, 5)]
            where = [rng.randrange(1000) for _ in script]
            if i < 4:  # fixed cases: the first overflow lands in the second group, the nan in the first, so
                # that both "only param_groups[0]" and "nan missed" are named whatever the draw
                where = [w - w % 4 + (2 if i == 0 else 0) + w % 2 for w in where]
            out.append({"script": script, "where": where, "widths": widths,
                        "init_scale": float(2 ** rng.randint(2, 10)),
                        "growth_factor": 2.0 if i < 4 else rng.choice([2.0, 4.0]),
                        "backoff_factor": 0.5 if i < 4 else rng.choice([0.5, 0.25]),
                        "growth_interval": 3 if i < 4 else rng.randint(2, 4), "seed": rng.randrange(2**31)})
        return out

    def describe(self, case):
        return (f"script {'/'.join(case['script'])}, init_scale={case['init_scale']:g}, growth_factor="
                f"{case['growth_factor']:g}, backoff_factor={case['backoff_factor']:g}, "
                f"growth_interval={case['growth_interval']}")

    def run(self, fn, case):
        s = fn(init_scale=case["init_scale"], growth_factor=case["growth_factor"],
               backoff_factor=case["backoff_factor"], growth_interval=case["growth_interval"])
        return scripted_run(case, s.scale, s.step, s.get_scale, lambda: getattr(s, "clean_steps", "missing"))

    def judge(self, case, result):
        want, script = gradscaler_run(case), case["script"]
        for t, v in enumerate(result["stepped"]):
            if not isinstance(v, bool):
                raise CheckFailure(f"step() returned {describe_value(v)} at step {t + 1}; expected True "
                                   "(the optimizer stepped) or False (skipped)")
        # What happened to the weights first (a step on an overflow puts nan into them, after which every
        # later gradient is nan: judged by return values alone, that reads as clean steps skipped later).
        for t, (got, exp) in enumerate(zip(result["moved"], want["moved"])):
            if got != exp:
                at = f"at step {t + 1} (script {'/'.join(script[:t + 1])})"
                expect(not exp, f"the weights did not change {at}, GradScaler stepped: a clean step was skipped: "
                       "skip only when some gradient is inf or nan")
                scales = result["scale"] + [result["final_scale"]]
                numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in scales[t:t + 2])
                if numbers and scales[t + 1] < scales[t]:  # the overflow was seen (the scale backed off), stepped on
                    why = [f"the optimizer stepped although a gradient was {script[t]}: skip optimizer.step() "
                           "on an overflow"]
                else:           # not even seen
                    why = [f"the {script[t]} gradient went unnoticed (the scale did not back off)"]
                    if group_of(case, t) == 1:
                        why.append(f"it was in param_groups[1]: {FIRST_GROUP}")
                    if script[t] == "nan":
                        why.append(MISTAKES_61["nan"])
                raise CheckFailure(f"the weights changed {at}, GradScaler skipped the step: " + "; ".join(why))
        for t, (got, exp) in enumerate(zip(result["stepped"], want["stepped"])):
            if got != exp:
                raise CheckFailure(f"step() returned {got} at step {t + 1} (script {'/'.join(script[:t + 1])}), "
                                   f"but the optimizer {'did' if exp else 'did not'} step: return True exactly when "
                                   "optimizer.step() ran")
        wrong = {MISTAKES_61[m]: _decisions(case, m) for m in MISTAKES_61}
        for key, what in [("scale", "get_scale() before each step"), ("clean_steps", "clean_steps after each step")]:
            if result[key] != want[key]:
                named = [name for name, rec in wrong.items() if rec[key] == result[key]]
                t, a, b = next((t, a, b) for t, (a, b) in enumerate(zip(result[key], want[key])) if a != b)
                raise CheckFailure(f"{what} differs from GradScaler's at step {t + 1} (script "
                                   f"{'/'.join(script[:t + 1])}): {a!r}, expected {b!r}"
                                   + (f": {_matches(named)}" if named else ""))
        expect_equal(result["final_scale"], want["final_scale"], "get_scale() after the last step")
        expect(bool(torch.isfinite(result["params"]).all()), "the parameters contain inf/nan: optimizer.step() ran "
               "with non-finite gradients (skip the step when any gradient is inf or nan)")
        expect_close(result["params"], want["params"], "the parameters after the script", rtol=1e-5, atol=1e-6,
                     mistakes={"the gradients were not unscaled (divide them by the scale) before "
                               "optimizer.step()": gradscaler_run(case, unscale=False)["params"],
                               FIRST_GROUP: gradscaler_run(case, unscale="first group")["params"]},
                     hint="Hint: unscale every gradient of the optimizer's parameters, then step.")


# --- 6.2: a mixed-precision step with fp32 master weights ---------------------------------------------

def _start(case):
    """The 16-bit model, its fp32 master copy and the optimizer over the master."""
    model = mlp(case["widths"], seed=case["seed"]).to(DTYPES16[case["dtype"]])
    master = [p.detach().float().clone() for p in model.parameters()]
    return model, master, make_optimizer(case["optimizer"], master, lr=case["lr"])


def _batch8(case):
    return make_batch(8, case["widths"][0], case["widths"][-1], case["seed"] + 1)


def watch_steps(opt, params) -> list:
    """The fp32 gradients ``opt.step()`` is given, one flat tensor per call: Adam's update hides their scale."""
    seen, params = [], list(params)
    opt.register_step_pre_hook(lambda *_: seen.append(None if any(p.grad is None for p in params)
                                                      else flat(p.grad for p in params)))
    return seen


def library_step(case, mistake=None) -> dict:
    """The library way: the fp32 model under ``torch.autocast``, ``GradScaler``, ``unscale_`` → ``clip_grad_norm_`` →
    ``step``; ``mistake``: "clip first", "no unscale", "16-bit loss" or "16-bit unscale" (divided in 16 bits)."""
    model = mlp(case["widths"], seed=case["seed"]).to(DTYPES16[case["dtype"]]).float()
    opt, (x, y) = make_optimizer(case["optimizer"], model.parameters(), lr=case["lr"]), _batch8(case)
    seen = watch_steps(opt, model.parameters())
    with torch.autocast("cpu", dtype=DTYPES16[case["dtype"]]):
        logits = model(x)
    loss = F.cross_entropy(logits if mistake == "16-bit loss" else logits.float(), y)
    if mistake in ("16-bit unscale", "no unscale"):
        (loss * case["loss_scale"]).backward()
        if mistake == "16-bit unscale":
            for p in model.parameters():  # the fp32 gradients hold 16-bit values here: the cast back is exact
                p.grad = (p.grad.to(DTYPES16[case["dtype"]]) / case["loss_scale"]).float()
        torch.nn.utils.clip_grad_norm_(model.parameters(), case["max_norm"])
        opt.step()
    else:
        gs = torch.amp.GradScaler("cpu", init_scale=case["loss_scale"], growth_interval=10**6)
        gs.scale(loss).backward()
        if mistake != "clip first":
            gs.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), case["max_norm"])
        gs.step(opt)  # unscales here if unscale_ was not called
    return {"loss": loss.item(), "master": flat(model.parameters()), "step_grads": seen,
            "model": flat(p.to(DTYPES16[case["dtype"]]) for p in model.parameters())}


def _unscale16_differs(case) -> bool:
    """Whether unscaling this case's 16-bit gradients in 16 bits loses bits (a value lands among the subnormals)."""
    model = mlp(case["widths"], seed=case["seed"]).to(DTYPES16[case["dtype"]])
    x, y = _batch8(case)
    (F.cross_entropy(model(x.to(DTYPES16[case["dtype"]])).float(), y) * case["loss_scale"]).backward()
    return any(not torch.equal((p.grad / case["loss_scale"]).float(), p.grad.float() / case["loss_scale"])
               for p in model.parameters())


def _grad_norm(case) -> float:
    return library_step({**case, "max_norm": float("inf")})["step_grads"][0].norm().item()


class MixedStepCheck(Check):
    id, function = "6.2", "mixed_precision_step"

    def cases(self, rng):
        specs = [("adam", "bf16", 1, None), ("momentum", "bf16", 2 ** rng.randint(4, 10), 2.0),
                 ("momentum", rng.choice(["bf16", "fp16"]), 2 ** rng.randint(4, 10), 0.5),
                 ("adam", "fp16", 2 ** rng.randint(8, 12), rng.choice([None, 0.5]))]
        out = []
        for opt, dtype, scale, clip in specs:  # clip: max_norm as a multiple of the true gradient norm
            case = {"widths": [rng.randint(4, 16), rng.randint(8, 24), rng.randint(3, 6)], "optimizer": opt,
                    "dtype": dtype, "loss_scale": float(scale), "lr": 0.05 if opt == "momentum" else 1e-2,
                    "seed": rng.randrange(2**31)}
            if dtype == "fp16" and opt == "adam":  # a draw where unscaling in 16 bits shows (it always does,
                for _ in range(500):              # within a few seeds: small gradients become fp16 subnormals)
                    if _unscale16_differs(case):
                        break
                    case["seed"] = rng.randrange(2**31)
            case["max_norm"] = float("inf") if clip is None else clip * _grad_norm(case)
            out.append(case)
        return out

    hints = {"same dtype|expected scalar type": "the model is 16-bit and x is fp32: cast the batch to the model's "
             "dtype first (dtype = next(model.parameters()).dtype; model(x.to(dtype)))",
             "leaf Variable that requires grad.*in-place": "copying the master into the model's parameters is an "
             "in-place change of leaves that require grad: do it under torch.no_grad() (p.copy_(m))"}

    def run(self, fn, case):
        model, master, opt = _start(case)
        x, y = _batch8(case)
        seen = watch_steps(opt, master)
        with MemoryTracker(model, opt) as mt:
            loss = fn(model, master, opt, x, y, case["loss_scale"], case["max_norm"])
        b = mt.breakdown()  # the tracker files the master (the optimizer's parameters) under parameters
        counters = nbytes(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() == 0)
        return {"loss": scalar(loss), "model": flat(model.parameters()), "master": flat(master), "step_grads": seen,
                "model_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
                "bytes": {"parameters": b["parameters"] - nbytes(master), "gradients": b["gradients"],
                          "optimizer_state": b["optimizer_state"] - counters + nbytes(master)}}

    def judge(self, case, result):
        want, s = library_step(case), case["loss_scale"]
        wrong = {m: library_step(case, m) for m in ("clip first", "no unscale", "16-bit loss", "16-bit unscale")}
        names = {"clip first": "clipped the scaled gradients: unscale before clip_grad_norm_ (the norm is "
                               "loss_scale× too large, so clipping cuts too much)",
                 "no unscale": "the gradients were never divided by loss_scale: the step is loss_scale× too large",
                 "16-bit loss": "the loss was computed from 16-bit logits: cast them to fp32 (.float()) first",
                 "16-bit unscale": "unscaled in 16 bits: small gradients divided in fp16 become subnormals and lose "
                                   "bits; make them fp32 first (p.grad.float() / loss_scale)"}
        expect(isinstance(result["loss"], float), f"mixed_precision_step returned {describe_value(result['loss'])}; "
               "expected the (unscaled) loss as a Python float")
        expect_close(result["loss"], want["loss"], "the returned loss", rtol=1e-5, mistakes={
            "returned the scaled loss (loss × loss_scale): return the loss itself": want["loss"] * s,
            names["16-bit loss"]: wrong["16-bit loss"]["loss"]})
        # Bit for bit: the library way and the step by hand do the same float operations in the same order.
        steps = result["step_grads"]
        expect(isinstance(steps, list) and len(steps) == 1, f"optimizer.step() ran {len(steps)} times; expected once")
        expect(steps[0] is not None, "optimizer.step() ran while a master tensor had no .grad: set every "
               "m.grad (the model's gradient, made fp32 and unscaled) before stepping")
        expect_close(steps[0], want["step_grads"][0], "the fp32 gradients optimizer.step() was given", rtol=0,
                     atol=0, mistakes={names[m]: wrong[m]["step_grads"][0] for m in wrong},
                     hint="Hint: they must equal GradScaler's bit for bit: m.grad = p.grad.float() / loss_scale, "
                     "then torch.nn.utils.clip_grad_norm_(master, max_norm), then optimizer.step().")
        expect_close(result["master"], want["master"], "the fp32 master weights after the step", rtol=0, atol=0,
                     mistakes={names[m]: wrong[m]["master"] for m in wrong},
                     hint="Hint: fp32 gradients = 16-bit gradients / loss_scale, then clip, then optimizer.step() (it "
                     "updates the master).")
        expect_equal(result["model_dtypes"], [str(DTYPES16[case["dtype"]])], "the model's parameter dtypes",
                     hint="Hint: copy the master into the 16-bit parameters in place (p.copy_(m)).")
        start = flat(_start(case)[0].parameters())
        expect_close(result["model"], want["model"], f"the {case['dtype']} model's weights after the step",
                     rtol=0, atol=0, mistakes={
                         "the model still has its old weights: copy the master into it after optimizer.step()": start,
                         **{names[m]: wrong[m]["model"] for m in wrong}})
        from .references import measured_training_state
        row = measured_training_state(mlp(case["widths"], seed=case["seed"]), case["optimizer"], "mixed")
        n4 = 2 * row["parameters"]  # fp32 copies of the 16-bit gradients
        expect_equal(result["bytes"], row, "the training state after the step, in bytes (notebook 01's mixed row)",
                     mistakes={"kept the fp32 gradient copies on the master: they are temporaries (set .grad = None)":
                               dict(row, gradients=row["gradients"] + n4),
                               "freed the 16-bit gradients: leave them on the model as backward() does":
                               dict(row, gradients=0)})
