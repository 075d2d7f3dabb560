"""``mgpu-plan``: does my model fit on N GPUs of this size, and how? The course's planner as a command.

    mgpu-plan 7B --batch 1 --seq 4096 --gpus 8 --gpu H100-80GB
    mgpu-plan path/to/config.json --batch 4 --seq 2048 --gpus 1,2,4,8 --gpu-memory 80GB --json
    mgpu-plan mymodels:resnet --input-shape 3,224,224 --batch 64 --gpus 1 --gpu L4 --plot plan.png
    mgpu-plan llama3-70b --gpus 8,16,64 --tp 1,2,4,8 --pp 1,2,4 --global-batch 64 --seq 8192 --gpu H100-80GB

The last form searches parallel layouts (TP, PP, HSDP, CP, EP) of a Llama-shaped model at a fixed global
batch (``tools/plan_layouts.py``). The others trace the step once per (precision, checkpointing, micro-batches)
under fake tensors (``planner.trace_step``), derive every ZeRO stage and GPU count from that trace and compare
the *device total* (``planner.budget``: the peak plus batch, workspaces, allocator reserve, CUDA context, NCCL
buffers) with the GPU's capacity. The cheapest plan that fits: fewest GPUs, then the lowest ``step_cost``.

Exit status: 0 a plan fits, 1 nothing fits, 2 bad input (one line on stderr; MGPU_PLAN_DEBUG=1 shows the
traceback).
"""

import argparse
import json
import multiprocessing as mp
import os
import sys
from concurrent.futures import ProcessPoolExecutor

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook

from mgpu_helpers.planner import budget as db
from mgpu_helpers.tools import plan_layouts
from mgpu_helpers.tools.plan_sources import ATTENTION, PlanInputError, make_batch, output_loss, quiet, resolve
from mgpu_helpers.tools.plan_sources.base import first_line
from mgpu_helpers.planner import OPTIMIZERS, TRACED_LAYOUTS, ZERO_STAGES, plan_from_trace, step_cost, trace_step
from mgpu_helpers.planner.dynamic import DATA_DEPENDENT, DynamicSizes
from mgpu_helpers.runtime.launch import cores
from mgpu_helpers.runtime.plots import fmt_bytes, unit_for

COST = ("cost: the course's relative step time (1.00 = one GPU, no checkpointing, one micro-batch): +0.33 "
        "checkpointing (the forward again), +0.10 per extra micro-batch, +0.02 per ZeRO stage and +0.50 for "
        "ZeRO-3's second all-gather on several GPUs. A ranking, not seconds")


def _ints(text, what):
    try:
        vals = sorted({int(v) for v in str(text).split(",")})
    except ValueError:
        raise PlanInputError(f"{what} {text!r}: integers separated by commas, e.g. 1,2,4") from None
    if not vals or vals[0] < 1:
        raise PlanInputError(f"{what} {text!r}: each value must be >= 1")
    return vals


def parse_args(argv):
    head, epilog = __doc__.split("\n\n", 1)
    ap = argparse.ArgumentParser(prog="mgpu-plan", description=head, epilog=epilog,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    # one line, not the usage block: bad input reads like every other error
    ap.error = lambda message: ap.exit(2, f"mgpu-plan: error: {message} (mgpu-plan --help)\n")
    ap.add_argument("model", help="built-in name, Hugging Face config.json or model directory, or module:function")
    ap.add_argument("--batch", type=int, default=1, help="samples per GPU per step, split into micro-batches (1)")
    ap.add_argument("--seq", type=int, help="tokens per sample, for models that take tokens (1024)")
    ap.add_argument("--input-shape", help="shape of one sample for other models, e.g. 3,224,224")
    ap.add_argument("--input-dtype", default="float32")
    ap.add_argument("--gpus", default="1", help="GPU count, or several: 1,2,4,8 (1)")
    cap = ap.add_mutually_exclusive_group()
    cap.add_argument("--gpu", help=f"one of {', '.join(db.GPUS)}")
    cap.add_argument("--gpu-memory", help="capacity per GPU with a unit: 80GB (1e9 B) or 80GiB (2**30 B)")
    ap.add_argument("--zero", default="0,1,2,3", help="ZeRO stages to consider (0,1,2,3)")
    ap.add_argument("--checkpointing", choices=("both", "on", "off"), default="both")
    ap.add_argument("--micro-batches", help="micro-batch counts (default: 1,2,4 that divide --batch)")
    ap.add_argument("--precision", help=f"{', '.join(TRACED_LAYOUTS)}, comma-separated, or all (default: bf16-autocast; "
                    f"fp16-autocast on GPUs without native bf16: {', '.join(db.NO_NATIVE_BF16)})")
    ap.add_argument("--optimizer", choices=OPTIMIZERS,
                    help="(default: adamw for a Hugging Face model, as its users train; adam otherwise)")
    ap.add_argument("--attn", choices=ATTENTION, help="a Hugging Face model's attention implementation "
                    "(default: the one transformers picks, as on a GPU)")
    ap.add_argument("--moe-imbalance", type=float, default=1.0, metavar="F", help="mixture of experts that loop over "
                    "experts: the busiest gets F x the even share of tokens (1: balanced; experts / top-k: all)")
    ap.add_argument("--allocator", default="default", choices=("default", "expandable"),
                    help="expandable = PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
    ap.add_argument("--jobs", type=int, default=0, help="processes tracing at once (default: one per CPU core, at "
                    "most one per trace, for models of >= 1B parameters; 1: trace in this process)")
    plan_layouts.add_arguments(ap)
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    ap.add_argument("--plot", metavar="FILE", help="save a bar chart of the device totals")
    return ap.parse_args(argv)


def settings(a):
    """Validated settings, before anything is traced or a batch is built of the counts: bad input fails here, fast."""
    if a.batch < 1 or (a.seq is not None and a.seq < 1):
        raise PlanInputError("--batch and --seq must be >= 1")
    if a.jobs < 0:
        raise PlanInputError(f"--jobs {a.jobs}: a process count >= 1 (0 or left out: chosen by model size)")
    if a.gpu is None and a.gpu_memory is None:
        raise PlanInputError("give the GPU: --gpu NAME (" + ", ".join(db.GPUS) + ") or --gpu-memory SIZE (80GB, 80GiB)")
    if a.gpu:
        capacity, arch, source = db.gpu(a.gpu)
        gpu_name = gpu_key = db.gpu_name(a.gpu)
    else:
        capacity, arch, source = db.parse_memory(a.gpu_memory), "hopper", "--gpu-memory"
        gpu_name, gpu_key = a.gpu_memory, None  # unknown architecture: Hopper's larger cuBLAS workspace (the safe side)
    micro = _ints(a.micro_batches, "--micro-batches") if a.micro_batches else [k for k in (1, 2, 4) if a.batch % k == 0]
    bad = [k for k in micro if a.batch % k]
    if bad:
        raise PlanInputError(f"--micro-batches {bad[0]} does not divide --batch {a.batch}")
    no_bf16 = arch in db.NO_NATIVE_BF16
    asked = a.precision or ("fp16-autocast" if no_bf16 else "bf16-autocast")
    precisions = list(TRACED_LAYOUTS) if asked == "all" else asked.split(",")
    for p in precisions:
        if p not in TRACED_LAYOUTS:
            raise PlanInputError(f"--precision {p!r}: one of {', '.join(TRACED_LAYOUTS)} or all")
    bf16_asked = no_bf16 and any(p.startswith("bf16") for p in precisions)  # only when asked: fp16 by default there
    notes = [f"{gpu_name} ({arch}) has no native bf16: its bf16 rows run emulated, without tensor cores (train in "
             "fp16-autocast with a GradScaler there)"] if bf16_asked else []
    if any(v.strip() not in [str(z) for z in ZERO_STAGES] for v in a.zero.split(",")):
        raise PlanInputError(f"--zero {a.zero!r}: stages among 0,1,2,3")
    if a.moe_imbalance < 1:
        raise PlanInputError(f"--moe-imbalance {a.moe_imbalance:g}: a factor >= 1 of the even share (1: balanced)")
    return dict(capacity=capacity, arch=arch, capacity_source=source, gpu=gpu_name, gpu_key=gpu_key, micro=micro,
                notes=notes, precisions=precisions, stages=sorted({int(v) for v in a.zero.split(",")}),
                gpus=_ints(a.gpus, "--gpus"),
                ckpt={"both": [False, True], "on": [True], "off": [False]}[a.checkpointing])


def process_pool(workers):
    """Spawned workers, each with its share of the cores' torch threads (with one per core each, they spin-wait)."""
    return ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=torch.set_num_threads,
                               initargs=(max(1, cores() // workers),))


def _plans_of(a, s, prec, ck, k):
    """Trace one (precision, checkpointing, micro-batches), derive its plans for every GPU count and ZeRO stage
    (a job ``run`` may hand to a worker). None: a model without blocks under checkpointing "both"."""
    source = resolve(a.model, a.attn, a.moe_imbalance)
    batch = make_batch(source, a.batch, a.seq, a.input_shape, a.input_dtype)
    batch_bytes = sum(t.numel() * t.element_size() for t in batch)
    if getattr(source.model_fn, "flash", False) and prec == "fp32":
        raise PlanInputError(f"--attn {a.attn} runs in fp16/bf16 only: --precision bf16-autocast (or bf16)")
    convs = []  # each convolution's largest activation: cuDNN's workspace scales with it (planner.budget)

    def watch(mod, inp, out):
        if isinstance(mod, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            convs.append(max(t.numel() * t.element_size() for t in (*inp, out) if isinstance(t, torch.Tensor)))

    def traced():  # a GPU's plan, the same on any host (planner.cuda)
        convs.clear()
        return trace_step(source.model_fn, batch, loss_fn=output_loss, precision=prec, micro_batches=k,
                          checkpointing=ck, optimizer=a.optimizer or source.optimizer, round_to=512, device="cpu",
                          kernels="cuda")
    try:
        with quiet(), register_module_forward_hook(watch):
            try:
                trace = traced()
            except DATA_DEPENDENT:  # values decide a size: again with representative ones (planner.dynamic)
                with DynamicSizes(a.moe_imbalance):
                    trace = traced()
    except PlanInputError:
        raise
    except ValueError as e:  # checkpointing a model without blocks: drop those rows unless asked for
        if ck and ("no nn.ModuleList" in str(e) or "nothing to checkpoint" in str(e)) and a.checkpointing == "both":
            return None
        raise PlanInputError(f"{source.name}: {e}") from None
    except Exception as e:
        raise PlanInputError(f"tracing {source.name} ({prec}, checkpointing {ck}, {k} micro-batches) failed: "
                             f"{type(e).__name__}: {first_line(e)}") from None
    rep = db.replayed(trace, [t.numel() * t.element_size() for t in batch], arch=s["arch"], allocator=a.allocator)
    plans = []
    for n in s["gpus"]:
        for st in (s["stages"] if n > 1 else [0]):
            with quiet():  # ZeRO-3 traces the step again under FSDP2 (the libraries' warnings are not the plan)
                p = plan_from_trace(trace, st, n)
            b = db.budget(p.peak_bytes, batch_bytes=batch_bytes, world_size=n, arch=s["arch"], gpu=s["gpu_key"],
                          conv_activation_bytes=max(convs, default=0), allocator=a.allocator, replay=rep,
                          conv_workspace_bytes=min(trace.workspace_at_peak, p.peak_bytes),
                          activation_bytes=p.breakdown.get("activations", 0) + p.breakdown.get("other", 0))
            cat, cb = max(p.breakdown.items(), key=lambda kv: kv[1])
            # DDP (stages 0-1 on several GPUs, gradient_as_bucket_view=False) keeps a flat copy of every gradient
            buckets = p.model_state["gradients"] - plan_from_trace(trace, st, 1).model_state["gradients"] \
                if st in (0, 1) and n > 1 else 0
            plans.append(dict(precision=prec, zero_stage=st, checkpointing=ck, micro_batches=k, gpus=n,
                              tensor_peak=b.lines[0][1], peak_phase=p.peak_phase,
                              peak_set_by=f"{p.peak_phase}: {cat.replace('_', ' ')} {100 * cb / max(p.peak_bytes, 1):.0f}%",
                              breakdown=p.breakdown, ddp_buckets=buckets, model_state=p.model_state,
                              allocated=b.allocated, device_total=b.total, fits=b.fits(s["capacity"]),
                              step_cost=step_cost(world_size=n, zero_stage=st, checkpointing=ck, micro_batches=k),
                              lines=[dict(name=nm, bytes=v, source=src) for nm, v, src in b.lines]))
    return trace.n_params, plans


def run(a):
    source = resolve(a.model, a.attn, a.moe_imbalance)  # first: a wrong model is the error to see, even without --gpu
    s = settings(a)  # then the rest, before any worker starts
    batch = make_batch(source, a.batch, a.seq, a.input_shape, a.input_dtype)
    batch_bytes = sum(t.numel() * t.element_size() for t in batch)
    from tqdm.auto import tqdm
    jobs = [(a, s, p, c, k) for p in s["precisions"] for c in s["ckpt"] for k in s["micro"]]
    workers = a.jobs
    if not workers:  # processes pay ~3 s of imports each: worth it when traces take tens of s (>= 1B parameters)
        try:
            with torch.device("meta"):
                big = sum(p.numel() for p in source.model_fn().parameters()) >= 1e9
        except Exception:  # noqa: BLE001 - the trace reports a model that cannot be built
            big = False
        workers = (os.cpu_count() or 1) if big else 1
    workers = min(len(jobs), workers)
    bar = dict(total=len(jobs), desc="tracing", unit="trace", file=sys.stderr, disable=None, leave=False)
    if workers > 1:  # one trace per process: they are independent and CPU-bound
        with process_pool(workers) as pool:
            results = list(tqdm(pool.map(_plans_of, *zip(*jobs)), **bar))
    else:
        results = [_plans_of(*j) for j in tqdm(jobs, **bar)]
    results = [r for r in results if r is not None]
    n_params, traced = (results[0][0] if results else 0), len(results)
    plans = [p for _, ps in results for p in ps]
    plans.sort(key=lambda p: (p["gpus"], p["step_cost"], p["device_total"]))  # the order the rule reads them
    cheapest = next((i for i, p in enumerate(plans) if p["fits"]), None)  # fewest GPUs, then the lowest cost
    return dict(model=dict(name=source.name, kind=source.kind, parameters=n_params),
                step=source.step, optimizer_default=source.optimizer, assumptions=source.assumptions,
                batch=dict(per_gpu=a.batch, shapes=[list(t.shape) for t in batch], bytes=batch_bytes),
                gpu=dict(name=s["gpu"], capacity_bytes=s["capacity"], source=s["capacity_source"], notes=s["notes"]),
                optimizer=a.optimizer or source.optimizer, allocator=a.allocator, traces=traced, plans=plans, cheapest=cheapest)


def render_text(r):
    cap = r["gpu"]["capacity_bytes"]
    G, unit = unit_for(max(p["device_total"] for p in r["plans"]))  # MiB or GiB: a CUDA context alone is 768 MiB
    width = max(len("precision"), *(len(p["precision"]) for p in r["plans"]))
    out = [f"model: {r['model']['name']}: {r['model']['parameters']:,} trainable parameters; "
           f"optimizer {r['optimizer']}",
           f"step planned: {r['step']}",
           *(f"assumed: {x}" for x in r.get("assumptions") or ()),
           f"batch per GPU: {' + '.join('x'.join(map(str, s)) for s in r['batch']['shapes'])} (inputs + targets)",
           f"GPU: {r['gpu']['name']}, {cap:,} B = {cap / db.GiB:.2f} GiB = {cap / 1e9:.2f} GB per device "
           f"({r['gpu']['source']}); allocator {r['allocator']}; {r['traces']} trace(s)",
           *(f"note: {x}" for x in r["gpu"].get("notes") or ()), "",
           f"{'gpus':>4} {'zero':>4} {'precision':<{width}} {'ckpt':>4} {'micro':>5} | {'tensors ' + unit:>11} "
           f"{'alloc ' + unit:>9} {'device ' + unit:>10} {'fits':>4} {'cost':>5} | peak set by"]
    for i, p in enumerate(r["plans"]):
        if i and p["gpus"] != r["plans"][i - 1]["gpus"]:
            out.append("")  # one block per GPU count: 78 rows read as a few tables
        mark = "  <- cheapest that fits" if i == r["cheapest"] else ""
        out.append(f"{p['gpus']:>4} {p['zero_stage']:>4} {p['precision']:<{width}} "
                   f"{'on' if p['checkpointing'] else 'off':>4} {p['micro_batches']:>5} | {p['tensor_peak'] / G:>11.2f} "
                   f"{p['allocated'] / G:>9.2f} {p['device_total'] / G:>10.2f} {'yes' if p['fits'] else 'no':>4} "
                   f"{p['step_cost']:>5.2f} | {p['peak_set_by']}{mark}")
    out += ["", "tensors: the step's tensors at their peak; alloc: what max_memory_allocated shows; device: what "
            "the process takes on the GPU (fits compares it with the capacity)", COST, ""]
    best = r["plans"][r["cheapest"]] if r["cheapest"] is not None else min(r["plans"], key=lambda p: p["device_total"])
    what = (f"{best['gpus']} GPU(s), ZeRO-{best['zero_stage']}, {best['precision']}, checkpointing "
            f"{'on' if best['checkpointing'] else 'off'}, {best['micro_batches']} micro-batch(es)")
    fits = f"cheapest plan that fits: {what} (fewest GPUs, then the lowest cost). Per GPU:"
    out.append(fits if r["cheapest"] is not None else f"nothing fits {fmt_bytes(cap)} per GPU; the smallest plan "
               f"needs {fmt_bytes(best['device_total'])} ({what}):")
    buckets = (f"of which DDP's gradient buckets {fmt_bytes(best['ddp_buckets'])}: a flat copy of every gradient "
               f"(ZeRO-{best['zero_stage']} on {best['gpus']} GPUs, gradient_as_bucket_view=False)")
    for ln in best["lines"]:
        out.append(f"  {ln['name']:<22} {fmt_bytes(ln['bytes']):>11}   {ln['source']}")
        if ln["name"] == "allocated by tensors":  # by category; DDP's buckets count in "gradients"
            out += [f"    {cat.replace('_', ' '):<20} {fmt_bytes(b):>11}   "
                    f"{buckets if cat == 'gradients' and best['ddp_buckets'] else ''}".rstrip()
                    for cat, b in best["breakdown"].items() if b]
    out.append(f"  {'device total':<22} {fmt_bytes(best['device_total']):>11}   of {fmt_bytes(cap)} "
               f"({100 * best['device_total'] / cap:.0f}%)")
    return "\n".join(out)


def save_plot(r, path):
    """Device totals per plan, stacked by line (faded, hatched: does not fit; the title: the cheapest that fits)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgba
    plans, G = r["plans"], db.GiB
    several = len({q["precision"] for q in plans}) > 1
    labels = [f"{p['gpus']}g Z{p['zero_stage']}{' ck' if p['checkpointing'] else ''} k{p['micro_batches']}"
              f"{' ' + p['precision'] if several else ''}" for p in plans]
    fig, ax = plt.subplots(figsize=(max(6, 0.45 * len(plans) + 2), 4.8))
    bottom = [0.0] * len(plans)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for j, nm in enumerate(dict.fromkeys(ln["name"] for p in plans for ln in p["lines"])):
        vals = [next((ln["bytes"] for ln in p["lines"] if ln["name"] == nm), 0) / G for p in plans]
        ax.bar(range(len(plans)), vals, bottom=bottom, label=nm, linewidth=0.3,
               color=[to_rgba(colours[j % len(colours)], 1.0 if p["fits"] else 0.35) for p in plans],
               hatch=["" if p["fits"] else "//" for p in plans],
               edgecolor=["white" if p["fits"] else "grey" for p in plans])
        bottom = [b + v for b, v in zip(bottom, vals)]
    cap = r["gpu"]["capacity_bytes"] / G
    ax.axhline(cap, color="black", linestyle="--", linewidth=1)
    ax.text(len(plans) - 0.5, cap, f"{r['gpu']['name']}: fits below", ha="right", va="bottom", fontsize=8)
    ax.set_xticks(range(len(plans)), labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("device total per GPU (GiB)")
    best = "" if r["cheapest"] is None else f"; cheapest that fits: {labels[r['cheapest']]}"
    ax.set_title(f"{r['model']['name']}: device total per plan\n(faded, hatched: does not fit){best}", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    a = parse_args(argv)
    layouts = plan_layouts.wanted(a)
    try:
        r = plan_layouts.run(a, _ints) if layouts else run(a)
    except (PlanInputError, ValueError) as e:  # ValueError: the planner's and planner.budget's own checks
        if os.environ.get("MGPU_PLAN_DEBUG"):
            raise
        print(f"mgpu-plan: error: {e}", file=sys.stderr)
        return 2
    if layouts:
        print(plan_layouts.to_json(r) if a.json else plan_layouts.render(r))
        return 0 if any(row["fits"] for row in r["rows"]) else 1
    print(json.dumps(r, indent=1) if a.json else render_text(r))
    if a.plot:
        save_plot(r, a.plot)
    return 0 if r["cheapest"] is not None else 1


if __name__ == "__main__":
    sys.exit(main())
