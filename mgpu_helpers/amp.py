"""Notebook 06 -- mixed precision: what fp16 and bf16 can hold (``precision_table``, ``survival``), what
``torch.autocast`` runs in 16 bits (``autocast_dtypes``), and what that does to memory, measured, including
where it *raises* it (``step_memory``, ``compare_precisions``, ``saved_for_backward``). Exercises 6.1 (dynamic
loss scaling) and 6.2 (fp32 master weights) are checked in ``checks.amp``.
"""
import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

from .memory import mlp, torch_threads
from .runtime.plots import stacked_bars, unit_for
from .runtime.precision import training_precision
from .runtime.tracker import MemoryTracker

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
PRECISIONS = ("fp32", "autocast", "bf16")  # fp32 model; fp32 model under bf16 autocast; bf16 model


def dtype_of(name: str) -> torch.dtype:
    """``"fp32"``/``"fp16"``/``"bf16"`` (or a ``torch.dtype`` among them) → the ``torch.dtype``."""
    if isinstance(name, torch.dtype) and name in DTYPES.values():
        return name
    if name not in DTYPES:
        raise ValueError(f"dtype: unknown dtype {name!r}; use one of {', '.join(map(repr, DTYPES))}")
    return DTYPES[name]


def precision_table() -> list[dict]:
    """Per dtype, from ``torch.finfo``: exponent and mantissa bits, max, smallest normal and subnormal, eps."""
    rows = []
    for name, dt in DTYPES.items():
        fi = torch.finfo(dt)
        mant = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}[dt]
        rows.append({"dtype": name, "bits": fi.bits, "exponent": fi.bits - 1 - mant, "mantissa": mant,
                     "max": fi.max, "smallest normal": fi.tiny, "smallest subnormal": fi.smallest_normal * fi.eps,
                     "eps": fi.eps})
    return rows


def survival(values: torch.Tensor, dtype) -> dict[str, float]:
    """Fractions of the nonzero ``values`` that casting to ``dtype`` makes zero, inf, subnormal or keeps normal."""
    v = values.detach().flatten().double()
    v = v[v != 0]
    c = v.to(dtype_of(dtype)).double()
    tiny = torch.finfo(dtype_of(dtype)).tiny
    n = max(len(v), 1)
    zero, inf = (c == 0), c.isinf()
    sub = ~zero & ~inf & (c.abs() < tiny)
    return {"zero": zero.sum().item() / n, "inf": inf.sum().item() / n, "subnormal": sub.sum().item() / n,
            "normal": 1 - (zero | inf | sub).sum().item() / n}


def autocast_dtypes(device: str = "cpu", dtype=torch.bfloat16) -> dict[str, str]:
    """The dtype each op returns under ``torch.autocast(device, dtype)`` for fp32 inputs (CUDA's list differs)."""
    g = torch.Generator().manual_seed(0)
    a, w = torch.randn(4, 8, generator=g).to(device), torch.randn(8, 8, generator=g).to(device)
    y = torch.zeros(4, dtype=torch.long, device=device)
    with torch.autocast(device, dtype=dtype_of(dtype)):
        h = F.linear(a, w)
        ops = {"linear / matmul": h, "relu(linear)": F.relu(h), "softmax(linear)": F.softmax(h, -1),
               "layer_norm(linear)": F.layer_norm(h, (8,)), "sum(linear)": h.sum(), "linear + fp32": h + a,
               "cross_entropy(linear)": F.cross_entropy(h, y), "mse_loss(linear, fp32)": F.mse_loss(h, a)}
    return {k: str(v.dtype).replace("torch.", "") for k, v in ops.items()}


def step_memory(widths, batch: int, precision: str, device=None, seed: int = 0) -> dict:
    """Forward + backward of ``memory.mlp(widths)`` under ``MemoryTracker``: ``activations`` alive after forward,
    ``peak``, ``peak_breakdown``. No optimizer step: "fp32" and "autocast" keep the same fp32 state either way."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision: unknown precision {precision!r}; use one of {', '.join(map(repr, PRECISIONS))}")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    half = training_precision(device).dtype
    dt = half if precision == "bf16" else torch.float32
    model = mlp(list(widths), dtype=dt, seed=seed).to(device)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch, widths[0], generator=g).to(device, dt)
    y = torch.randint(widths[-1], (batch,), generator=g).to(device)
    if device.type == "cuda":  # cuBLAS's workspace and autocast's kernels exist before measuring (as in 01)
        with torch.autocast("cuda", dtype=half, enabled=precision == "autocast"):
            F.cross_entropy(model(x).float(), y).backward()
        model.zero_grad(set_to_none=True)
    with MemoryTracker(model) as mt:
        with torch.autocast(device.type, dtype=half, enabled=precision == "autocast"):
            logits = model(x)
        activations = mt.breakdown()["activations"]
        mt.mark("backward")
        F.cross_entropy(logits.float(), y).backward()  # the loss in fp32, on every row
        del logits
    return {"precision": precision, "activations": activations, "peak": mt.peak_bytes,
            "peak_breakdown": mt.peak_breakdown(), "params": sum(p.numel() for p in model.parameters())}


def saved_for_backward(widths, batch: int, seed: int = 0) -> list[dict]:
    """Per Linear of ``memory.mlp(widths)``, bytes saved for backward under CPU bf16 autocast: bf16 copies of its
    weight and the rest. Layer 0 keeps no weight copy: its input, the one the weight is needed for, has no grad."""
    model = mlp(list(widths), seed=seed)
    linears = [m for m in model if isinstance(m, torch.nn.Linear)]
    rows = [{"layer": i, "shape": tuple(m.weight.shape), "weight_copy": 0, "other": 0} for i, m in enumerate(linears)]
    current = [None]
    for i, m in enumerate(linears):
        m.register_forward_pre_hook(lambda mod, args, i=i: current.__setitem__(0, i))
    seen: set = set()

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if current[0] is not None and key not in seen:  # a storage saved twice is held once
            seen.add(key)
            row = rows[current[0]]
            is_copy = t.dtype == torch.bfloat16 and tuple(t.shape) in (row["shape"], row["shape"][::-1])
            row["weight_copy" if is_copy else "other"] += t.untyped_storage().nbytes()
        return t

    x = torch.randn(batch, widths[0], generator=torch.Generator().manual_seed(seed + 1))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        model(x)
    return rows


def compare_precisions(widths, batch: int, device=None) -> dict[str, dict]:
    """``step_memory`` for every precision, by name."""
    with torch_threads(1):  # small ops: a second thread only spin-waits on a busy machine
        return {p: step_memory(widths, batch, p, device) for p in PRECISIONS}


def plot_precisions(results: dict[str, dict[str, dict]], title: str = "Peak of forward + backward"):
    """Per model (name → ``compare_precisions``'s result), each precision's peak by category; activations: a tick."""
    fig, axes = plt.subplots(1, len(results), figsize=(4.6 * len(results), 4.8), squeeze=False)
    for ax, (name, res) in zip(axes[0], results.items()):
        div, unit = unit_for(max(r["peak"] for r in res.values()))
        stacked_bars({p: r["peak_breakdown"] for p, r in res.items()}, f"{name}\n{title}", ax, unit=(div, unit))
        ax.scatter(list(res), [r["activations"] / div for r in res.values()], marker="_", s=900, color="k",
                   label="activations after forward", zorder=3)
        ax.set_ylabel(f"peak memory ({unit})")
        ax.legend(fontsize=8, frameon=False, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=3)
    fig.tight_layout()
    return fig
