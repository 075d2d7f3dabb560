"""mgpu-plan against a real GPU: planned vs measured allocated peak and device total, rule of thumb beside.

    PYTHONPATH=. python3 bench/plan_gpu.py                  # on an idle GPU; every row, both allocators
    PYTHONPATH=. python3 bench/plan_gpu.py --allocator expandable   # only under expandable_segments:True
    PYTHONPATH=. python3 bench/plan_gpu.py --only conv      # rows whose name contains "conv" ("a|b": either)

Families: a Llama-shaped decoder (168M; bench/planner_gpu.py's), the same with its embedding frozen, a
Hugging Face Llama config (GQA; tied embeddings) when transformers is installed, and a ResNet-style conv
net with BatchNorm at batch 64 x 224^2; precisions fp32 / bf16 autocast / pure bf16, checkpointing, 4
micro-batches. Four rows are models no calibration was fitted on: Hugging Face's GPT-2 (LayerNorm, GELU,
dropout) and torchvision's ConvNeXt-Tiny (depthwise convolutions, LayerNorm), where installed. The plan is ``mgpu_helpers.tools.plan_cli.run`` -- the command's own code, one GPU, ZeRO-0.

Each row is measured in a fresh child process (nothing of an earlier row left in the allocator): batch on
the device, model built, one warm-up step (optimizer state, cuBLAS workspace), peak stats reset, one step
measured. *allocated*: ``torch.cuda.max_memory_allocated()`` over the measured step, against the plan's
allocated line (tensors + batch + cuBLAS + cuDNN workspaces); goal within 2%. *device*: what the process
uses on the device after the step (``mem_get_info`` used, minus what was used before the child started:
the GPU must be otherwise idle), against the plan's device total; goal within 5%. Also printed: the
measured workspace beyond tensors and the allocator's reserve as a fraction -- what to set in
``mgpu_helpers/planner/budget.py`` if a line is off -- the 16 bytes/parameter rule, and accelerate's
"training with Adam" estimate where accelerate is installed.
"""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

from bench.measure import cuda_step_peak, optimizer_state  # noqa: E402
from mgpu_helpers.planner import budget as db  # noqa: E402
from mgpu_helpers.runtime.plots import fmt_bytes  # noqa: E402
from mgpu_helpers.tools.plan_cli import parse_args, run  # noqa: E402
from mgpu_helpers.tools.plan_sources import make_batch, output_loss, resolve  # noqa: E402
from mgpu_helpers.planner.models import Decoder  # noqa: E402
from mgpu_helpers.planner.trace import apply_checkpointing, make_optimizer, train_step  # noqa: E402

LLAMA_HF = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816,
            "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 4,
            "tie_word_embeddings": True, "torch_dtype": "float32"}
# GPT-2 small as Hugging Face configures it: LayerNorm, GELU, learned positions, tied embeddings, dropout 0.1
GPT2_HF = {"model_type": "gpt2", "vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12,
           "n_head": 12}
HF_CONFIGS = {"HF": LLAMA_HF, "HF:gpt2": GPT2_HF}


# --- the models (module:function sources for mgpu-plan) --------------------------------------------

def decoder():
    return Decoder(32000, 1024, 8, 16, 2816)


def frozen_decoder():
    m = decoder()
    m.embed.weight.requires_grad_(False)
    return m


class Bottleneck(nn.Module):
    def __init__(self, c_in, width, stride):
        super().__init__()
        c_out = 4 * width
        self.body = nn.Sequential(
            nn.Conv2d(c_in, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, c_out, 1, bias=False), nn.BatchNorm2d(c_out))
        self.skip = (nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))
                     if stride != 1 or c_in != c_out else nn.Identity())

    def forward(self, x):
        return torch.relu(self.body(x) + self.skip(x))


class ResNet(nn.Module):
    """ResNet-50's layout (3, 4, 6, 3 bottlenecks; 25.6M parameters)."""

    def __init__(self, classes=1000):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
                                  nn.MaxPool2d(3, 2, 1))
        blocks, c = [], 64
        for width, n, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            for i in range(n):
                blocks.append(Bottleneck(c, width, stride if i == 0 else 1))
                c = 4 * width
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(c, classes)

    def forward(self, x):
        x = self.stem(x)
        for b in self.blocks:
            x = b(x)
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def resnet():
    return ResNet()


def convnext():
    """torchvision's ConvNeXt-Tiny (depthwise 7x7 convolutions, LayerNorm, GELU, stochastic depth): a conv
    net none of the planner's calibrations saw. Its rows run where torchvision is installed."""
    from torchvision.models import convnext_tiny
    return convnext_tiny()


TOKENS = ["--batch", "4", "--seq", "512"]
IMAGES = ["--batch", "64", "--input-shape", "3,224,224"]
ROWS = {  # name: (model, batch args, precision, checkpointing, micro-batches)
    "decoder fp32": ("plan_gpu:decoder", TOKENS, "fp32", "off", 1),
    "decoder bf16 autocast": ("plan_gpu:decoder", TOKENS, "bf16-autocast", "off", 1),
    "frozen-embedding decoder bf16 autocast": ("plan_gpu:frozen_decoder", TOKENS, "bf16-autocast", "off", 1),
    "hf llama (GQA, tied) fp32": ("HF", TOKENS, "fp32", "off", 1),
    "conv net fp32": ("plan_gpu:resnet", IMAGES, "fp32", "off", 1),
    "conv net bf16 autocast + ckpt": ("plan_gpu:resnet", IMAGES, "bf16-autocast", "on", 1),
    "decoder bf16 autocast + ckpt": ("plan_gpu:decoder", TOKENS, "bf16-autocast", "on", 1),
    "hf llama (GQA, tied) bf16 autocast + ckpt": ("HF", TOKENS, "bf16-autocast", "on", 1),
    "conv net bf16 autocast": ("plan_gpu:resnet", IMAGES, "bf16-autocast", "off", 1),
    "conv net fp32, 4 micro": ("plan_gpu:resnet", IMAGES, "fp32", "off", 4),
    "decoder bf16 autocast, 4 micro": ("plan_gpu:decoder", TOKENS, "bf16-autocast", "off", 4),
    "decoder pure bf16": ("plan_gpu:decoder", TOKENS, "bf16", "off", 1),
    # models the calibrations (CONTEXT, cuDNN's workspace, the conv reserve) were not fitted on
    "hf gpt2 (dropout) fp32": ("HF:gpt2", TOKENS, "fp32", "off", 1),
    "hf gpt2 (dropout) bf16 autocast": ("HF:gpt2", TOKENS, "bf16-autocast", "off", 1),
    "convnext-tiny fp32": ("plan_gpu:convnext", ["--batch", "32", "--input-shape", "3,224,224"], "fp32", "off", 1),
    "convnext-tiny bf16 autocast": ("plan_gpu:convnext", ["--batch", "32", "--input-shape", "3,224,224"],
                                    "bf16-autocast", "off", 1),
}


def cli_args(name, hf_dirs):
    model, batch, prec, ck, k = ROWS[name]
    return [hf_dirs.get(model, model), *batch, "--precision", prec, "--checkpointing", ck,
            "--micro-batches", str(k), "--zero", "0", "--gpus", "1", "--gpu-memory", "1TB"]


def measure(argv):
    """The child: the planned step for real on this GPU. Prints one JSON line."""
    a = parse_args(argv)
    source = resolve(a.model)
    dev = torch.device(os.environ.get("PLAN_GPU_DEVICE", "cuda"))  # "cpu": a dry run of this code path
    cuda = dev.type == "cuda"
    torch.manual_seed(0)
    batch = tuple(torch.zeros(t.shape, dtype=t.dtype, device=dev) for t in make_batch(
        source, a.batch, a.seq, a.input_shape, a.input_dtype))
    with dev:
        model = source.model_fn()
    prec, k = a.precision, int(a.micro_batches)
    if prec == "bf16":
        model = model.to(torch.bfloat16)
        batch = tuple(t.bfloat16() if t.is_floating_point() else t for t in batch)
    if a.checkpointing == "on":
        apply_checkpointing(model)
    opt = make_optimizer(model, a.optimizer or source.optimizer)  # the command's default: the source's
    run = lambda: train_step(model, opt, batch, output_loss, precision=prec, micro_batches=k)  # noqa: E731
    if not cuda:
        run()
        return print(json.dumps(dict(dry_run=str(dev))))
    _, extra = cuda_step_peak(run, held=lambda: [*model.parameters(), *model.buffers(), *batch,
                                                 *optimizer_state(opt)])  # extra: cuBLAS workspace & co.
    free, total = torch.cuda.mem_get_info()
    print(json.dumps(dict(allocated=torch.cuda.max_memory_allocated(), reserved=torch.cuda.max_memory_reserved(),
                          extra=extra, used=total - free)))


def accelerate_estimate(model_spec, argv):
    """accelerate's "Training using Adam" figure for the model, if accelerate is installed (else None)."""
    try:
        from accelerate.utils import calculate_maximum_sizes
    except ImportError:
        return None
    try:
        with torch.device("meta"):
            model = resolve(parse_args(argv).model).model_fn()
        total, _ = calculate_maximum_sizes(model)
    except Exception as e:  # an accelerate whose API moved: say so in the row, do not stop the bench
        return f"err:{type(e).__name__}"
    return 4 * total  # estimate-memory: weights x 4 for Adam training (model, gradients, two moments)


def _plan(argv):
    """One row's plan (a worker process: every row is traced at once, before any GPU measurement)."""
    return run(parse_args(argv))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--allocator", choices=["default", "expandable", "both"], default="both")
    ap.add_argument("--expandable", action="store_true", help="same as --allocator expandable")
    ap.add_argument("--only", default="")
    ap.add_argument("--child", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    if args.child:
        return measure(args.child)
    if not torch.cuda.is_available():
        print("plan_gpu.py needs a CUDA GPU (it compares plans with the allocator); nothing run")
        return
    import tempfile
    from concurrent.futures import ProcessPoolExecutor
    import multiprocessing as mp
    hf_dirs = {}
    for key, cfg in HF_CONFIGS.items():
        hf_dirs[key] = tempfile.mkdtemp()
        Path(hf_dirs[key], "config.json").write_text(json.dumps(cfg))
    have = {}
    for module in ("transformers", "torchvision"):
        try:
            __import__(module)
            have[module] = True
        except ImportError:
            have[module] = False
    allocs = ["expandable"] if args.expandable else ["default", "expandable"] if args.allocator == "both" \
        else [args.allocator]
    wanted = args.only.split("|")  # substrings, |-separated: a row is run if its name contains one
    names = [n for n in ROWS if any(n == w[:-1] if w.endswith("$") else w in n for w in wanted)  # "x$": exactly x
             and (not ROWS[n][0].startswith("HF") or have["transformers"])
             and (ROWS[n][0] != "plan_gpu:convnext" or have["torchvision"])]
    jobs = [(name, alloc) for name in names for alloc in allocs]  # a row under both allocators, then the next
    argvs = {j: cli_args(j[0], hf_dirs) + ["--allocator", j[1]] for j in jobs}
    # every plan first, in parallel worker processes (they hold CUDA contexts: all gone before measuring)
    with ProcessPoolExecutor(max_workers=min(8, len(jobs)), mp_context=mp.get_context("spawn")) as pool:
        plans = dict(zip(jobs, pool.map(_plan, [argvs[j] for j in jobs])))
    print(torch.cuda.get_device_name(), f"{torch.cuda.mem_get_info()[1]:,} B", "torch", torch.__version__)
    hdr = (f"{'row':<42} {'alloc':>5} | {'alloc plan':>13} {'alloc real':>13} {'err':>7} | {'device plan':>13} "
           f"{'device real':>13} {'err':>7} | {'16 B/param':>13} {'accelerate':>13} | {'ws real':>9} "
           f"{'reserve plan':>12} {'real':>6}")
    print(hdr)
    worst = {a: [0.0, 0.0] for a in allocs}
    for name, alloc in jobs:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(Path(__file__).parent)]))
        if alloc == "expandable":
            env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        argv, r = argvs[name, alloc], plans[name, alloc]
        p = r["plans"][0]
        lines = {ln["name"]: ln["bytes"] for ln in p["lines"]}
        free, total = torch.cuda.mem_get_info()
        before = total - free  # this parent's context and anything else on the GPU
        child = subprocess.run([sys.executable, __file__, "--child", *argv], env=env, capture_output=True, text=True)
        if child.returncode:
            print(f"{name:<42} child failed: {child.stderr.strip().splitlines()[-1]}")
            continue
        m = json.loads(child.stdout.strip().splitlines()[-1])
        used = m["used"] - before
        e_alloc = (p["allocated"] - m["allocated"]) / m["allocated"]
        e_dev = (p["device_total"] - used) / used
        worst[alloc] = [max(worst[alloc][0], abs(e_alloc)), max(worst[alloc][1], abs(e_dev))]
        acc = accelerate_estimate(ROWS[name][0], argv)
        acc_s = acc if isinstance(acc, str) else "-" if acc is None else f"{acc:,}"
        ws = m["allocated"] - (lines["allocated by tensors"] + lines.get("batch", 0))  # beyond planned tensors
        planned_reserve = lines["allocator reserve"] / p["allocated"]
        print(f"{name:<42} {alloc[:5]:>5} | {p['allocated']:>13,} {m['allocated']:>13,} "
              f"{100 * e_alloc:>+6.2f}% | {p['device_total']:>13,} {used:>13,} {100 * e_dev:>+6.2f}% | "
              f"{16 * r['model']['parameters']:>13,} {acc_s:>13} | {fmt_bytes(ws):>9} "
              f"{100 * planned_reserve:>+11.1f}% {100 * (m['reserved'] - m['allocated']) / m['allocated']:>+5.1f}%",
              flush=True)
        print(f"{'':<42} planned lines: " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in lines.items())
              + f"; measured: allocated beyond tensors after warm-up {fmt_bytes(m['extra'])}, "
              f"context + reserve {fmt_bytes(used - m['allocated'])}, context {fmt_bytes(used - m['reserved'])}")
    for a, (wa, wd) in worst.items():
        print(f"{a} allocator, worst |error|: allocated {100 * wa:.2f}% (goal 2%), device total {100 * wd:.2f}% "
              "(goal 5%)")
    print("ws real: allocated peak beyond planned tensors + batch (cuBLAS + cuDNN + allocator rounding); reserve: "
          "max reserved over max allocated, planned (planner.allocator's replay) and real. 16 B/param: the rule "
          "of thumb; accelerate: weights x 4 (estimate-memory's 'Training using Adam'), '-' where accelerate is "
          "not installed.")


if __name__ == "__main__":
    main()
