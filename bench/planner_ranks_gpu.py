"""plan(device="cuda") against the CUDA allocator, N ranks sharing one GPU over gloo (needs a GPU).

    PYTHONPATH=. python bench/planner_ranks_gpu.py                  # world 2 and 4, every method
    PYTHONPATH=. python bench/planner_ranks_gpu.py --world 2 --model decoder

Each rank is a process that does ``torch.cuda.set_device(0)`` and joins a gloo group: CUDA tensors over
gloo, every process with its own caching allocator, so ``max_memory_allocated()`` is that rank's peak
(FSDP2, DDP and ZeroRedundancyOptimizer train that way on one H200: bench/RESULTS.md). The measured figure is the
third step's peak minus what was allocated before the model was built (the batch, and cuBLAS's two
workspaces -- the forward's handle and autograd's backward thread's -- made first on purpose: they are
``planner.budget``'s "cuBLAS workspace" line, not tensors; the "ws" column shows what they took, 64 MiB
expected on Hopper). Planned: ``plan(..., device="cuda")`` (512-byte blocks, CUDA's autocast rules; stage 3
runs FSDP2 on fake CUDA tensors; cuDNN's workspace traced inside each convolution,
``planner.accounting.cudnn_workspace``).
"""
import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from mgpu_helpers.planner import plan
from mgpu_helpers.planner.models import convnet, decoder, image_batch, lm_loss, tied_frozen, token_batch
from mgpu_helpers.planner.trace import train_step
from mgpu_helpers.planner.validation import METHODS, wrap

MODELS = {
    "decoder": (decoder("small"), lambda: token_batch(4, 256, 4096), lm_loss),
    "conv": (convnet(64, 4), lambda: image_batch(32, 64), F.cross_entropy),
    "tied+frozen": (tied_frozen("small"), lambda: token_batch(4, 256, 4096), lm_loss),
}
LAYOUTS = {"fp32": tuple(METHODS), "bf16-autocast": tuple(METHODS), "fsdp-mixed": ("fsdp2", "fsdp2-root")}


def _rank(r, n, store, model, method, layout, out):
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=r, world_size=n)
    dev = torch.device("cuda", 0)
    a = torch.randn(64, 64, device=dev, requires_grad=True)
    (a @ a).sum().backward()  # cuBLAS's workspaces now (forward's and backward thread's): the budget's line
    with torch.autocast("cuda", torch.bfloat16):
        (a @ a).float().sum().backward()
    del a
    torch.cuda.synchronize()
    out[("ws", r)] = torch.cuda.memory_allocated()
    model_fn, batch_fn, loss_fn = MODELS[model]
    x, y = (t.to(dev) for t in batch_fn())
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    with dev:
        m = model_fn()
    m, opt = wrap(m, method, layout, device=dev)
    step_precision = "fp32" if layout == "fsdp-mixed" else layout
    for i in range(3):
        if i == 2:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        train_step(m, opt, (x, y), loss_fn, precision=step_precision)
    torch.cuda.synchronize()
    out[r] = torch.cuda.max_memory_allocated() - base
    dist.destroy_process_group()


def measure(model, method, layout, n):
    fd, store = tempfile.mkstemp(prefix="mgpu-bench-")
    os.close(fd)
    os.unlink(store)
    out = mp.Manager().dict()
    mp.spawn(_rank, args=(n, store, model, method, layout, out), nprocs=n, join=True)
    return [out[r] for r in range(n)], [out[("ws", r)] for r in range(n)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=list(MODELS), action="append")
    ap.add_argument("--world", type=int, action="append")
    ap.add_argument("--layout", choices=list(LAYOUTS), action="append")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no GPU here: this bench compares plan(device='cuda') with the CUDA allocator; "
              "bench/planner_ranks.py is its CPU counterpart")
        return
    print(f"{'model':<12} {'method':<10} {'layout':<14} {'N':>2} {'rank':>4} | {'allocator B':>14} "
          f"{'planned B':>14} {'error':>7} | {'ws MiB':>6}")
    errors = []
    for model in args.model or list(MODELS):
        model_fn, batch_fn, loss_fn = MODELS[model]
        for layout, methods in LAYOUTS.items():
            if args.layout and layout not in args.layout:
                continue
            for method in methods:
                if layout == "fsdp-mixed" and model == "conv":
                    continue  # BatchNorm under FSDP2's bf16 policy: see bench/planner_ranks.py
                for n in args.world or (2, 4):
                    try:
                        got, ws = measure(model, method, layout, n)
                    except Exception as e:  # a method that does not run this way is a row, not a crash
                        print(f"{model:<12} {method:<10} {layout:<14} {n:>2}    - | failed: {type(e).__name__}: {e}")
                        continue
                    p = plan(model_fn, batch_fn(), loss_fn=loss_fn, precision=layout, world_size=n, device="cuda",
                             **METHODS[method])
                    for r, m in enumerate(got):
                        err = p.rank_peaks[r] / m - 1
                        errors.append(err)
                        print(f"{model:<12} {method:<10} {layout:<14} {n:>2} {r:>4} | {m:>14,} "
                              f"{p.rank_peaks[r]:>14,} {100 * err:>+6.2f}% | {ws[r] / 2**20:>6.1f}", flush=True)
    if errors:
        print(f"\n{len(errors)} rank rows; error {100 * min(errors):+.2f}% .. {100 * max(errors):+.2f}%; "
              f"within 2%: {all(abs(e) <= 0.02 for e in errors)}")


if __name__ == "__main__":
    main()
