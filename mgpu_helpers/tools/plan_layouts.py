"""``mgpu-plan CONFIG --gpus 8,16,64 --tp 1,2,4,8 --pp 1,2,4 --global-batch 256 --seq 8192 --gpu H100-80GB``:
the layouts (TP, PP with its schedule, HSDP / FSDP2, CP, EP, on one mesh) of a Llama-shaped model that fit,
by ``planner.search``'s per-rank arithmetic. CONFIG: llama3-8b, llama3-70b, llama3-405b or a Hugging Face
config.json of a Llama-shaped model, dense or with routed experts (Mixtral's, Qwen-MoE's, DeepSeek's
names). Any of the layout flags selects this mode."""

import json
import os

from mgpu_helpers.planner import budget as db
from mgpu_helpers.planner.parallel import LLAMA3, SCHEDULES, LlamaConfig
from mgpu_helpers.planner.search import check_grid, on_gpu, search
from mgpu_helpers.tools.plan_sources import PlanInputError

FLAGS = ("tp", "pp", "cp", "ep", "dp_replicate", "dp_shard", "schedule", "microbatches", "global_batch")


def add_arguments(ap):
    lay = ap.add_argument_group("layouts (tools/plan_layouts.py: any of these searches TP x PP x HSDP layouts "
                                "of a Llama-shaped CONFIG at a fixed --global-batch)")
    for flag, what in (("--tp", "tensor-parallel degrees"), ("--pp", "pipeline stages"),
                       ("--cp", "context-parallel degrees"),
                       ("--ep", "expert-parallel degrees of a MoE CONFIG (borrow dp_shard x cp ranks)"),
                       ("--dp-replicate", "HSDP replicas"),
                       ("--dp-shard", "FSDP2 shard groups to keep (default: whatever fills the GPUs)"),
                       ("--microbatches", "pipeline micro-batches (default: pp, 2pp, 4pp)"),
                       ("--global-batch", "samples per step over all GPUs")):
        lay.add_argument(flag, help=f"{what}, comma-separated")
    lay.add_argument("--schedule", help="gpipe, 1f1b, interleaved (comma-separated; default 1f1b)")


def wanted(a) -> bool:
    return any(getattr(a, f, None) is not None for f in FLAGS)


def llama_config(name: str) -> LlamaConfig:
    if name in LLAMA3:
        return LLAMA3[name]
    path = os.path.join(name, "config.json") if os.path.isdir(name) else name
    if not os.path.isfile(path):
        raise PlanInputError(f"{name!r}: the layout search takes {', '.join(LLAMA3)} or a Llama-shaped config.json")
    c = json.load(open(path))
    # routed experts: Mixtral's names, Qwen-MoE's, DeepSeek's (every block routed; shared experts not planned)
    experts = c.get("num_local_experts") or c.get("num_experts") or c.get("n_routed_experts") or 0
    try:
        moe = dict(experts=experts, top_k=c["num_experts_per_tok"],
                   expert_ffn=c.get("moe_intermediate_size") or c["intermediate_size"]) if experts else {}
        return LlamaConfig(c["vocab_size"], c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"],
                           c.get("num_key_value_heads", c["num_attention_heads"]), c["intermediate_size"], **moe)
    except KeyError as e:
        raise PlanInputError(f"{path}: no {e.args[0]!r}; the layout search plans Llama-shaped decoders") from None


def run(a, ints) -> dict:
    """The search's rows for parsed arguments ``a``; ``ints``: mgpu-plan's parser of comma-separated counts."""
    def _ints(text, what):
        return ints(text, what) if text is not None else None

    cfg = llama_config(a.model)
    seq = a.seq or 2048
    if a.gpu is None and a.gpu_memory is None:
        raise PlanInputError("give the GPU: --gpu NAME (" + ", ".join(db.GPUS) + ") or --gpu-memory SIZE (80GB, 80GiB)")
    capacity = db.gpu(a.gpu)[0] if a.gpu else db.parse_memory(a.gpu_memory)
    schedules = (a.schedule or "1f1b").split(",")
    bad = [s for s in schedules if s not in SCHEDULES]
    if bad:
        raise PlanInputError(f"--schedule {bad[0]!r}: one of {', '.join(SCHEDULES)}")
    if a.global_batch is None:
        raise PlanInputError("--global-batch N: the samples per optimizer step over all GPUs (fixed; each layout "
                             "splits it over its data-parallel ranks and micro-batches)")
    grid = dict(gpus=_ints(a.gpus, "--gpus"), tp=_ints(a.tp or "1", "--tp"), pp=_ints(a.pp or "1", "--pp"),
                cp=_ints(a.cp or "1", "--cp"), ep=_ints(a.ep or "1", "--ep"),
                dp_replicate=_ints(a.dp_replicate or "1", "--dp-replicate"),
                schedules=schedules, microbatches=_ints(a.microbatches, "--microbatches"),
                checkpointing={"both": (False, True), "on": (True,), "off": (False,)}[a.checkpointing],
                global_batch=_ints(a.global_batch, "--global-batch"))
    try:
        check_grid(cfg, seq=seq, **grid)
    except ValueError as e:
        raise PlanInputError(str(e)) from None
    rows = search(cfg, capacity=capacity, seq=seq, **grid,  # fits: the device total, as the data-parallel plans
                  device_total=on_gpu(a.gpu if a.gpu in db.GPUS else None, a.allocator))
    shard = _ints(a.dp_shard, "--dp-shard")
    if shard:
        rows = [r for r in rows if r["dp_shard"] in shard]
    if not rows:
        raise PlanInputError(f"no layout of {grid['gpus']} GPUs splits --global-batch {a.global_batch} evenly over "
                             "its data-parallel ranks x micro-batches with these --tp/--pp: change one of them")
    return dict(model=a.model, config=cfg._asdict(), seq=seq, capacity=capacity, rows=rows)


def render(r) -> str:
    """The layouts that fit (all when none does: the closest first tells what is missing)."""
    G = 2 ** 30
    fit = [row for row in r["rows"] if row["fits"]]
    shown = fit or sorted(r["rows"], key=lambda row: row["device"])[:10]
    out = [f"model: {r['model']} {r['config']}; seq {r['seq']}; GPU {r['capacity'] / G:.1f} GiB", "",
           f"{'layout':<34} {'gpus':>4} {'tokens/step':>11} | {'tensors GiB':>11} {'device GiB':>10} "
           f"{'worst rank':>19} | {'comm GiB/rank':>13} | fits"]
    for row in shown:
        out.append(f"{row['layout']:<34} {row['gpus']:>4} {row['tokens']:>11,} | {row['peak'] / G:>11.2f} "
                   f"{row['device'] / G:>10.2f} {'stage %d (%d-%d)' % (row['worst_stage'], *row['worst_ranks']):>19} "
                   f"| {row['comm'] / G:>13.2f} | {'yes' if row['fits'] else 'no'}")
    out += ["", (f"{len(fit)} of {len(r['rows'])} layouts fit (listed: fewest GPUs, then most tokens per step, then "
                 "least traffic)" if fit else f"none of {len(r['rows'])} layouts fits: the closest {len(shown)} by device total are listed"),
            "tensors: the worst rank's tensors at its worst moment (planner.search: state, gathered FSDP2 tensors, "
            "activations, transients); device: plus the allocator's reserve, cuBLAS, the CUDA context and NCCL "
            "(planner.budget, as the data-parallel plans); comm: bytes one rank sends per step"]
    return "\n".join(out)


def to_json(r) -> str:
    rows = [{k: v for k, v in row.items() if k != "parts"} for row in r["rows"]]
    return json.dumps(dict(r, rows=rows), indent=1)
