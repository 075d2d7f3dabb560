"""Two questions the H200 raised about the planner's fake trace on CUDA, answered by listing ops (needs a GPU).

    PYTHONPATH=. python3 bench/planner_gpu_diag.py

1. ``mgpu-plan`` on a Hugging Face Llama config in fp32 planned 13.6% below ``max_memory_allocated``: which
   attention kernels does the fake trace run, and which does the real step run? (A math-attention fallback
   in the real step holds a (batch, heads, seq, seq) matrix per layer that a fused kernel does not.)
2. Traced on ``device="cuda"`` the 1B decoder's optimizer step holds 4x the parameters in temporaries
   ("other"), 1x traced on the CPU: which ops make them?
"""
import collections
import json
import sys
import tempfile
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

from mgpu_helpers import planner_trace  # noqa: E402
from mgpu_helpers.planner import SIZES, decoder, lm_loss, token_batch  # noqa: E402
from mgpu_helpers.planner_trace import trace_step  # noqa: E402


class Ops(TorchDispatchMode):
    def __init__(self, match=("attention", "softmax", "bmm", "sdp")):
        super().__init__()
        self.match, self.seen = match, collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if any(m in name for m in self.match):
            self.seen[name] += 1
        return func(*args, **(kwargs or {}))


def attention_ops():
    try:
        from mgpu_helpers.tools.plan_sources import make_batch, output_loss, resolve
        from plan_gpu import LLAMA_HF
    except ImportError as e:
        return print("1. skipped:", e)
    d = tempfile.mkdtemp()
    Path(d, "config.json").write_text(json.dumps(LLAMA_HF))
    try:
        source = resolve(d)
    except Exception as e:  # noqa: BLE001 - transformers missing: say so
        return print("1. skipped:", type(e).__name__, e)
    batch = make_batch(source, 4, 512, None, None)
    ops = Ops()
    orig = planner_trace.train_step

    def logged(*a, **k):
        with ops:
            return orig(*a, **k)
    planner_trace.train_step = logged
    try:
        trace_step(source.model_fn, batch, loss_fn=output_loss, precision="fp32", device="cuda", round_to=512)
    finally:
        planner_trace.train_step = orig
    print("1. fake trace (cuda), fp32:", dict(ops.seen))
    with torch.device("cuda"):
        model = source.model_fn()
    x, y = (torch.zeros(t.shape, dtype=t.dtype, device="cuda") for t in batch)
    real = Ops()
    torch.cuda.reset_peak_memory_stats()
    with real:
        output_loss(model(x), y).backward()
    print("1. real step (cuda), fp32:", dict(real.seen), f"peak {torch.cuda.max_memory_allocated():,} B")
    cfg = getattr(model, "config", None) or next((m.config for m in model.modules() if hasattr(m, "config")), None)
    print("   attention implementation:", getattr(cfg, "_attn_implementation", "?"))


def step_ops(devs=("cuda", "cpu")):
    log = []
    orig = planner_trace.FakeTracker.__torch_dispatch__

    def logged(self, func, types, args=(), kwargs=None):
        before = self._total
        out = orig(self, func, types, args, kwargs)
        if self._total != before and self._phase == "step":
            log.append((str(func), self._total - before))
        return out
    planner_trace.FakeTracker.__torch_dispatch__ = logged
    try:
        for dev in devs:
            log.clear()
            tr = trace_step(decoder("1B"), token_batch(4, 1024, SIZES["1B"][0]), loss_fn=lm_loss,
                            precision="bf16-autocast", device=dev, round_to=512)
            p = tr.shard(0, 1)
            c = collections.Counter()
            for f, d in log:
                c[f] += d
            n = sum(s[0] * s[1] for s in tr.param_sizes)
            print(f"2. 1B bf16-autocast traced on {dev}: peak {p.peak_bytes:,} in {p.peak_phase}, other at peak "
                  f"{p.breakdown['other'] / n:.2f} x parameters; step ops, net bytes:",
                  [(f, round(v / n, 2)) for f, v in c.most_common(6)])
    finally:
        planner_trace.FakeTracker.__torch_dispatch__ = orig


if __name__ == "__main__":
    print("torch", torch.__version__)
    attention_ops()
    step_ops()
