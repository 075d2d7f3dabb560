"""Notebook 06 on a GPU: does the CPU tracker predict the CUDA allocator for each precision?

    PYTHONPATH=. python3 bench/amp_gpu.py            # the notebook's two MLPs + a 38M-param residual MLP
    PYTHONPATH=. python3 bench/amp_gpu.py --small    # a quick run of the same code

Prints (and writes to ``$OUT/amp_gpu.txt`` when ``OUT`` is set):
(1) CUDA's autocast op list (``amp.autocast_dtypes("cuda")``) next to the CPU's -- notebook §2 says CUDA
    also keeps softmax, layer_norm and sum in fp32;
(2) notebook §5 as it runs there: ``amp.step_memory`` (forward + backward of an MLP) for fp32, bf16 autocast
    and pure bf16, on the CPU (``MemoryTracker``, exact bytes) and on CUDA (the allocator, after a warm-up),
    for the weight-heavy and the activation-heavy model, with % differences and autocast/fp32 ratios;
(3) a full training step (forward, backward, Adam(foreach=True) step) of ``bench/tracker_vs_cuda.py``'s
    residual MLP, at many rows (activations dominate) and at few (weights dominate), in fp32, bf16
    autocast, fp16 autocast with ``GradScaler`` and pure bf16: the tracker on the CPU with ``round_to=512``
    against ``torch.cuda.max_memory_allocated()`` for the same step, measured as ``tracker_vs_cuda`` does
    (relative to the model and optimizer after a warm-up step).
Without CUDA only the CPU columns are printed.
"""
import argparse
import copy
import time

import torch
import torch.nn.functional as F

from bench.measure import cuda_step_peak, optimizer_state
from bench.tracker_vs_cuda import MiB, Net, Report, diff

from mgpu_helpers.amp import autocast_dtypes, step_memory
from mgpu_helpers.runtime.tracker import MemoryTracker

NOTEBOOK_MODELS = {"weight-heavy": ([1024] * 5, 16), "activation-heavy": ([64, 256, 256, 256, 64], 4096)}
PRECISIONS = ("fp32", "bf16 autocast", "fp16 autocast+scaler", "pure bf16")


def make(base, precision, device):
    model = copy.deepcopy(base).to(device)
    if precision == "pure bf16":
        model = model.to(torch.bfloat16)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, foreach=True)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**10) if "fp16" in precision else None
    return model, opt, scaler


def train_step(model, opt, scaler, precision, shape, device, mark=lambda label: None):
    rows, d, vocab = shape
    dtype = torch.bfloat16 if precision == "pure bf16" else torch.float32
    amp = {"bf16 autocast": torch.bfloat16, "fp16 autocast+scaler": torch.float16}.get(precision)
    mark("forward")
    x = torch.randn(rows, d, device=device, dtype=dtype)
    y = torch.randint(0, vocab, (rows,), device=device)
    with torch.autocast(device.type, dtype=amp or torch.bfloat16, enabled=amp is not None):
        logits = model(x)
    loss = F.cross_entropy(logits.float(), y)
    mark("backward")
    (scaler.scale(loss) if scaler else loss).backward()
    mark("step")
    if scaler:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    opt.zero_grad(set_to_none=True)


def cuda_peak(base, precision, shape):
    dev = torch.device("cuda")
    model, opt, scaler = make(base, precision, dev)
    peak, _ = cuda_step_peak(lambda: train_step(model, opt, scaler, precision, shape, dev),
                             held=lambda: [*model.parameters(), *model.buffers(), *optimizer_state(opt)])
    del model, opt, scaler
    torch.cuda.empty_cache()
    return peak


def tracker_peak(base, precision, shape):
    dev = torch.device("cpu")
    model, opt, scaler = make(base, precision, dev)
    for p in model.parameters():  # Adam's state without a CPU step's cost: a step on zero gradients
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    if scaler:  # GradScaler makes its scale tensor lazily: make it before measuring, as the warm-up does on CUDA
        scaler.scale(torch.ones(()))
    with MemoryTracker(model, opt, round_to=512) as mt:
        train_step(model, opt, scaler, precision, shape, dev, mt.mark)
    return mt.peak_bytes, mt.phase_peaks()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    say = Report()
    say.path = say.path and say.path.replace("tracker_vs_cuda.txt", "amp_gpu.txt")
    say(f"torch {torch.__version__}; CUDA: {torch.cuda.get_device_name() if cuda else 'unavailable -- CPU side only'}")

    say("\n(1) torch.autocast(device, bfloat16): output dtype of each op for fp32 inputs")
    cpu_ops = autocast_dtypes("cpu", "bf16")
    gpu_ops = autocast_dtypes("cuda", "bf16") if cuda else {}
    say(f"{'op':<26}{'cpu':>10}{'cuda':>10}")
    for op, dt in cpu_ops.items():
        say(f"{op:<26}{dt:>10}{gpu_ops.get(op, '-'):>10}")

    say("\n(2) notebook 06 §5: step_memory (forward + backward), tracker on the CPU (exact bytes) vs CUDA allocator")
    say(f"{'model':<17}{'precision':<10}{'CPU acts':>10}{'CUDA acts':>10}{'CPU peak':>10}{'CUDA peak':>10}"
        f"{'d peak':>20}")
    models = {k: ([w // 4 for w in v[0][:-1]] + [v[0][-1] // 4], v[1]) for k, v in NOTEBOOK_MODELS.items()} \
        if args.small else NOTEBOOK_MODELS
    for name, (widths, batch) in models.items():
        ratios = {}
        for p in ("fp32", "autocast", "bf16"):
            c = step_memory(widths, batch, p, device="cpu")
            g = step_memory(widths, batch, p, device="cuda") if cuda else None
            ratios[p] = (c["peak"], g["peak"] if g else None)
            say(f"{name:<17}{p:<10}{c['activations'] / MiB:>10.2f}"
                f"{(g['activations'] / MiB if g else float('nan')):>10.2f}{c['peak'] / MiB:>10.2f}"
                f"{(g['peak'] / MiB if g else float('nan')):>10.2f}{diff(c['peak'], g['peak']) if g else '-':>20}")
        cpu_r = ratios["autocast"][0] / ratios["fp32"][0]
        gpu_r = ratios["autocast"][1] / ratios["fp32"][1] if cuda else float("nan")
        say(f"{name:<17}autocast/fp32 peak: CPU {cpu_r:.3f}x, CUDA {gpu_r:.3f}x")

    d, layers, vocab = (256, 2, 256) if args.small else (1024, 4, 4096)
    torch.manual_seed(0)
    base = Net(d, layers, vocab)
    n = sum(p.numel() for p in base.parameters())
    say(f"\n(3) full training step, {layers} residual MLP blocks d={d} + head {vocab}: {n / 1e6:.1f}M params, "
        "Adam(foreach=True); tracker on the CPU (round_to=512) vs CUDA max_memory_allocated, MiB")
    say(f"{'rows':>6} {'precision':<22}{'tracker':>10}{'CUDA':>10}{'d (trk-CUDA)/CUDA':>22}  {'peak phase (CPU)':<16}"
        f"{'vs fp32 CPU':>12}{'vs fp32 CUDA':>13}")
    for rows in ((128, 8) if args.small else (2048, 16)):
        first = {}
        for p in PRECISIONS:
            t0 = time.perf_counter()
            try:
                tp, phases = tracker_peak(base, p, (rows, d, vocab))
                cp = cuda_peak(base, p, (rows, d, vocab)) if cuda else None
            except Exception as e:  # keep the other rows: device time is scarce
                say(f"{rows:>6} {p:<22}failed: {type(e).__name__}: {e}")
                continue
            first.setdefault("cpu", tp)
            if cp:
                first.setdefault("cuda", cp)
            say(f"{rows:>6} {p:<22}{tp / MiB:>10.2f}{(cp / MiB if cp else float('nan')):>10.2f}"
                f"{diff(tp, cp) if cp else '-':>22}  {max(phases, key=phases.get):<16}{tp / first['cpu']:>12.3f}"
                f"{(cp / first['cuda'] if cp else float('nan')):>13.3f}   ({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
