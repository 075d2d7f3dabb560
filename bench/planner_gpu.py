"""Planner vs the CUDA allocator: ``plan(...).peak_bytes`` against ``torch.cuda.max_memory_allocated()``.

    PYTHONPATH=. python3 bench/planner_gpu.py      # on a GPU machine (torch only; no Jupyter needed)

A 168M-parameter Llama-shaped decoder (8 blocks, d=1024, 16 heads, SwiGLU 2816, vocab 32000), batch
4 x 512 tokens, Adam foreach, six settings: fp32, bf16 autocast, fp16 autocast, bf16 autocast with
checkpointing, bf16 autocast with 4 micro-batches, pure bf16. The planner traces fake CUDA tensors
(CUDA's autocast rules, 512-byte blocks). The real step is measured as the planner defines it: the batch
exists before the model is built; after a warm-up step (Adam's state, cuBLAS's workspace) everything
allocated beyond the parameters and Adam's state is subtracted (bench/tracker_vs_cuda.py explains why),
the peak stats are reset, and one step is measured. Prints a table and the worst error.
"""
import time

import torch

from bench.measure import cuda_step_peak, optimizer_state
from mgpu_helpers.planner import lm_loss, plan, token_batch
from mgpu_helpers.planner.models import Decoder
from mgpu_helpers.planner.trace import apply_checkpointing, make_optimizer, train_step

SHAPE = (32000, 1024, 8, 16, 2816)
CONFIGS = {"fp32": dict(precision="fp32"), "bf16 autocast": dict(precision="bf16-autocast"),
           "fp16 autocast": dict(precision="fp16-autocast"),
           "bf16 autocast + checkpointing": dict(precision="bf16-autocast", checkpointing=True),
           "bf16 autocast, 4 micro-batches": dict(precision="bf16-autocast", micro_batches=4),
           "pure bf16": dict(precision="bf16")}


def model_fn():
    return Decoder(*SHAPE)


def measure(batch, precision="fp32", checkpointing=False, micro_batches=1):
    dev = torch.device("cuda")
    torch.manual_seed(0)
    with dev:
        model = model_fn()
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    if checkpointing:
        apply_checkpointing(model)
    opt = make_optimizer(model)
    kw = dict(precision=precision, micro_batches=micro_batches)
    peak, _ = cuda_step_peak(lambda: train_step(model, opt, batch, lm_loss, **kw),
                             held=lambda: [*model.parameters(), *model.buffers(), *optimizer_state(opt)])
    del model, opt
    torch.cuda.empty_cache()
    return peak


def main():
    assert torch.cuda.is_available(), "needs a GPU"
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    batch = tuple(t.cuda() for t in token_batch(4, 512, SHAPE[0]))
    worst = 0.0
    print(f"{'setting':<32} {'planned B':>15} {'allocator B':>15} {'error':>8} {'plan s':>7}")
    for name, cfg in CONFIGS.items():
        t = time.perf_counter()
        p = plan(model_fn, batch, loss_fn=lm_loss, device="cuda", **cfg)
        dt = time.perf_counter() - t
        real = measure(batch, **cfg)
        err = (p.peak_bytes - real) / real
        worst = max(worst, abs(err))
        print(f"{name:<32} {p.peak_bytes:>15,} {real:>15,} {100 * err:>+7.2f}% {dt:>7.1f}   "
              f"({p.n_params:,} params, peak in {p.peak_phase})", flush=True)
    print(f"worst |error|: {100 * worst:.2f}%")


if __name__ == "__main__":
    main()
