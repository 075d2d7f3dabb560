"""Each check of notebook 06 passes the solution, fails the stub, and names planted mistakes under every seed."""
from pathlib import Path

import pytest

from mgpu_helpers.tools.authoring import mutant_fails_every_seed
import mgpu_helpers.checks.amp  # noqa: F401  (registers 6.1 and 6.2)
from testkit import marked, mistake_params, solution_passes_stub_fails

NB = Path(__file__).resolve().parent.parent / "solutions" / "06_mixed_precision.ipynb"

RESET = "            self.clean_steps = 0\n            return False\n"
GROW = "            self.scale_value *= self.growth_factor\n            self.clean_steps = 0\n"
UNSCALE = "m.grad = p.grad.float() / loss_scale                   # fp32 and unscaled, BEFORE clipping\n"
CLIP = "    torch.nn.utils.clip_grad_norm_(master, max_norm)\n"
CASES = {
    "6.1": ("DynamicLossScaler", [
        ([("if self.clean_steps == self.growth_interval:", "if self.clean_steps > self.growth_interval:")],
         "grew one step late"),
        ([(RESET, "            return False\n")], "not reset to 0 after an overflow"),
        ([(RESET + "        optimizer.step()\n", "            self.clean_steps = 0\n        else:\n"
           "            optimizer.step()\n"), ("        return True", "        return not found_inf")],
         "counted the skipped step as a clean one"),
        ([(GROW, "            self.scale_value *= self.growth_factor\n")], "not reset to 0 after growing"),
        ([("not bool(torch.isfinite(p.grad).all())", "bool(torch.isinf(p.grad).any())")], "a nan was not detected"),
        ([("p.grad.div_(self.scale_value)", "p.grad")], "the gradients were not unscaled"),
        ([("            return False\n", "")], "the optimizer stepped although a gradient was inf"),
        ([("        for group in optimizer.param_groups:\n", "        for group in optimizer.param_groups[:1]:\n")],
         "only param_groups[0] was unscaled and checked"),
        # steps on an overflow but says it skipped: the weights turn nan and every later step skips; named
        # at the overflow (not as "a clean step was skipped" later)
        ([(RESET, "            self.clean_steps = 0\n"), ("        return True", "        return not found_inf")],
         "the optimizer stepped although a gradient was inf"),
    ]),
    "6.2": ("mixed_precision_step", [
        ([(UNSCALE + CLIP, "m.grad = p.grad.float()\n" + CLIP + "    for m in master:\n        m.grad /= loss_scale\n")],
         "clipped the scaled gradients"),
        ([(UNSCALE, "m.grad = p.grad.float()\n")], "never divided by loss_scale"),
        ([("model(x.to(dtype)).float()", "model(x.to(dtype))")], "computed from 16-bit logits"),
        ([("            p.copy_(m)", "            pass")], "the model still has its old weights"),
        ([("            m.grad = None", "            pass")], "kept the fp32 gradient copies"),
        ([("    return loss.item()", "    return (loss * loss_scale).item()")], "returned the scaled loss"),
        ([("            m.grad = None", "            m.grad = p.grad = None")], "freed the 16-bit gradients"),
        ([("p.grad.float() / loss_scale", "(p.grad / loss_scale).float()")], "unscaled in 16 bits"),
        ([("model(x.to(dtype))", "model(x)")], "cast the batch to the model's dtype"),
        ([("    with torch.no_grad():\n        for m, p", "    if True:\n        for m, p")],
         "do it under torch.no_grad()"),
    ]),
}


PARAMS = mistake_params(CASES)


@pytest.mark.parametrize("ex", [marked(e) for e in CASES])
def test_solution_passes_and_stub_fails(ex):
    solution_passes_stub_fails(NB, ex, CASES[ex][0], seeds=range(5))


@pytest.mark.parametrize("ex,edits,named", PARAMS)
def test_planted_mistake_is_named_under_every_seed(ex, edits, named):
    mutant_fails_every_seed(NB, ex, CASES[ex][0], edits, named)
