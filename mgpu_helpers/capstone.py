"""Notebook 11's face on the planner: exercise 11.1's grid of plans (:func:`candidate_plans`, at one *global*
batch that each world size splits, so "fewest ranks" compares like with like) and the memory calculator
(:func:`calculator`: ipywidgets around :func:`render`, tested without a browser). A setting is traced once
(:func:`cached_trace`); world size and ZeRO stage derive from the trace in milliseconds.
"""
import functools

from .planner import budget as db
from .planner.layouts import ZERO_STAGES
from .planner.models import SIZES, Decoder, decoder, lm_loss, token_batch
from .planner.plans import Plan, plan_from_trace
from .planner.trace import TRACED_LAYOUTS, trace_step

CAPACITY_GPUS = ("L4", "A100-80GB", "H200")  # budget.GPUS: real capacities in bytes
DEFAULTS = dict(size="1B", precision="bf16-autocast", zero_stage=0, world_size=1, checkpointing=False,
                micro_batches=1, batch_size=4, seq_len=1024)


# The check's model: two of Llama-2-7B's blocks (0.67B parameters). A fake trace costs by the ops, not the bytes,
# and its tensors are large beside what every device holds anyway (CUDA context, NCCL): ranks decide the fit.
CHECK_MODEL = "2 blocks of 7B"
SHAPES = {**SIZES, CHECK_MODEL: (32000, 4096, 2, 32, 11008)}  # (vocab, d, layers, heads, ffn), as SIZES
CHECK_BATCH = (8, 1024)  # the global batch (sequences, length): world size n gives each rank 8 / n
CHECK_GRID = dict(world_size=(1, 2, 4, 8), zero_stage=ZERO_STAGES, checkpointing=(False, True),
                  micro_batches=(1, 2))


@functools.lru_cache(maxsize=None)
def cached_trace(size, batch_size, seq_len, precision="bf16-autocast", checkpointing=False, micro_batches=1):
    """One trace per (model, one rank's batch, precision, checkpointing, micro-batches); sharding reuses it."""
    vocab = SHAPES[size][0]
    model_fn = decoder(size) if size in SIZES else functools.partial(Decoder, *SHAPES[size])
    return trace_step(model_fn, token_batch(batch_size, seq_len, vocab), loss_fn=lm_loss,
                      precision=precision, checkpointing=checkpointing, micro_batches=micro_batches,
                      device="cpu", round_to=512)


def candidate_plans(size=CHECK_MODEL, batch=CHECK_BATCH, precision="bf16-autocast", **grid) -> list[Plan]:
    """Every plan of :data:`CHECK_GRID` (entries replaced by keyword) for a decoder of ``size`` on the global
    ``batch`` = (sequences, length), but splits that do not divide and stages above 0 on one rank."""
    g = {**CHECK_GRID, **grid}
    return list(_plans(size, tuple(batch), precision, *(tuple(g[k]) for k in CHECK_GRID)))


@functools.lru_cache(maxsize=None)
def _plans(size, batch, precision, world_sizes, stages, ckpts, micro):
    sequences, length = batch
    return tuple(plan_from_trace(cached_trace(size, sequences // n, length, precision, ck, k), s, n)
                 for n in world_sizes if sequences % n == 0 for s in stages if n > 1 or s == 0
                 for ck in ckpts for k in micro if sequences // n % k == 0)


def settings_plan(settings: dict):
    """The planner's figures for one set of calculator settings (keys of :data:`DEFAULTS`)."""
    s = {**DEFAULTS, **settings}
    if unknown := set(s) - set(DEFAULTS):
        raise ValueError(f"unknown settings {sorted(unknown)}: use {sorted(DEFAULTS)}")
    if s["batch_size"] % s["micro_batches"]:
        raise ValueError(f"micro_batches={s['micro_batches']} does not divide batch_size={s['batch_size']}")
    trace = cached_trace(s["size"], s["batch_size"], s["seq_len"], s["precision"], s["checkpointing"],
                         s["micro_batches"])
    return plan_from_trace(trace, s["zero_stage"], s["world_size"])


def render(settings: dict, fig=None):
    """``(fig, plan, verdict)``: every ZeRO stage's per-rank peak by category (the chosen one outlined) and GPUs."""
    import matplotlib.pyplot as plt  # here, not at the top: importing the planner (mgpu-plan) needs no matplotlib

    from .runtime.plots import stacked_bars

    s = {**DEFAULTS, **settings}
    plans = {st: settings_plan({**s, "zero_stage": st}) for st in ZERO_STAGES}
    fig = fig or plt.figure(figsize=(9, 4.2))
    fig.clear()
    GB = 1e9
    xs = [f"ZeRO-{st}" for st in ZERO_STAGES]
    ax = stacked_bars({x: plans[st].breakdown for x, st in zip(xs, ZERO_STAGES)}, ax=fig.add_subplot(), unit=(GB, ""))
    chosen = plans[s["zero_stage"]]
    ax.bar(xs[s["zero_stage"]], chosen.peak_bytes / GB, fill=False, edgecolor="black", linewidth=2.5)
    top = max(p.peak_bytes for p in plans.values()) / GB
    for name in CAPACITY_GPUS:
        cap = db.GPUS[name][0] / GB
        if cap < 1.6 * top:
            ax.axhline(cap, color="black", linestyle="--", linewidth=1)
            ax.text(len(xs) - 0.5, cap, f"{name} ({cap:.1f} GB)", va="bottom", ha="right", fontsize=9)
    ax.set_ylabel("peak per rank (GB = 1e9 bytes)")
    n = chosen.n_params / 1e9
    ax.set_title(f"{s['size']} ({n:.2f}B params), {s['precision']}, world size {s['world_size']}, "
                 f"ckpt {'on' if s['checkpointing'] else 'off'}, {s['micro_batches']} micro-batch(es), "
                 f"batch {s['batch_size']}x{s['seq_len']}", fontsize=9)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
    fig.subplots_adjust(right=0.8)
    # "fits" as mgpu-plan decides it: the device total (context, workspaces, allocator reserve, NCCL) vs capacity
    tokens = 2 * s["batch_size"] * s["seq_len"] * 8  # int64 inputs and targets on the device
    totals = {g: db.budget(chosen.peak_bytes, batch_bytes=tokens, world_size=s["world_size"], arch=db.GPUS[g][1])
              for g in CAPACITY_GPUS}
    fits = [g for g in CAPACITY_GPUS if totals[g].fits(db.GPUS[g][0])]
    return fig, chosen, (f"ZeRO-{s['zero_stage']} on {s['world_size']} rank(s): {chosen.peak_bytes / GB:.2f} GB "
                         f"per rank, peak in {chosen.peak_phase}; on the device up to "
                         f"{max(b.total for b in totals.values()) / GB:.2f} GB; fits "
                         + (", ".join(fits) if fits else "none of the listed GPUs"))


def calculator(**defaults):
    """The interactive calculator (needs ipywidgets and a live kernel). Returns the widget box."""
    import ipywidgets as W
    import matplotlib.pyplot as plt
    from IPython.display import display

    s = {**DEFAULTS, **defaults}
    controls = {
        "size": W.Dropdown(options=list(SIZES), value=s["size"], description="model size"),
        "precision": W.Dropdown(options=list(TRACED_LAYOUTS), value=s["precision"], description="precision"),
        "zero_stage": W.IntSlider(value=s["zero_stage"], min=0, max=3, description="ZeRO stage"),
        "world_size": W.SelectionSlider(options=(1, 2, 4, 8, 16, 32, 64), value=s["world_size"],
                                        description="world size"),
        "checkpointing": W.Checkbox(value=s["checkpointing"], description="checkpointing"),
        "micro_batches": W.SelectionSlider(options=(1, 2, 4), value=s["micro_batches"],
                                           description="micro-batches"),
    }
    status, out = W.Label(), W.Output()

    def update(_change=None):
        status.value = "tracing (the first time for this model, precision, checkpointing, micro-batches)..."
        settings = {**s, **{k: w.value for k, w in controls.items()}}
        with out:
            out.clear_output(wait=True)
            fig, _, line = render(settings)
            display(fig)
            plt.close(fig)
        status.value = line

    for w in controls.values():
        w.observe(update, names="value")
    update()
    widgets = list(controls.values())
    return W.VBox([W.HBox(widgets[i:i + 2]) for i in (0, 2, 4)] + [status, out])
