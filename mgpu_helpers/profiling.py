"""Notebook 02 -- measuring memory: allocated vs reserved vs peak, snapshots, the profiler (checks of 2.1 and
2.2 in ``checks.profiling``). :func:`allocator_demo` and :func:`record_step_snapshot` need a GPU: on a CPU
the notebook shows what ``bench/profiling_gpu.py`` stored from them in ``solutions/assets/02_gpu_*``.
"""
import contextlib
import itertools
import json
import pickle
from pathlib import Path

import torch
import torch.nn.functional as F

from .memory import make_batch, make_optimizer, mlp
from .runtime.tracker import MemoryTracker

MiB = 2**20
PHASES = ("forward", "backward", "optimizer")
ROOT = Path(__file__).resolve().parent.parent
FIGURES, SNAPSHOT, PNG = "02_gpu_figures.json", "02_gpu_snapshot.pickle", "02_gpu_snapshot.png"


def mib(n: float, sign: bool = False) -> str:
    return f"{n / MiB:{'+' if sign else ''},.1f} MiB"


def asset(name: str) -> Path:
    """An asset, found from solutions/ or notebooks/ (release copies notebooks only), or in the repo."""
    dirs = [Path.cwd() / "assets", Path.cwd().parent / "solutions" / "assets", ROOT / "solutions" / "assets"]
    for d in dirs:
        if (d / name).exists():
            return d / name
    raise FileNotFoundError(f"{name}: not in " + ", ".join(map(str, dirs)))


def stored_figures() -> dict:
    return json.loads(asset(FIGURES).read_text())


def stored_snapshot() -> dict:  # our own file (bench/profiling_gpu.py): plain dicts and lists
    return pickle.loads(asset(SNAPSHOT).read_bytes())


def _counters(dev) -> dict:
    free, total = torch.cuda.mem_get_info(dev)
    return {"allocated": torch.cuda.memory_allocated(dev), "reserved": torch.cuda.memory_reserved(dev),
            "peak": torch.cuda.max_memory_allocated(dev), "device_used": total - free}


def allocator_demo(device="cuda") -> dict:
    """Allocated / reserved / peak / device use after each step of a short story; needs CUDA. ``device_used``
    is ``cudaMemGetInfo``'s total - free, as nvidia-smi shows: every process, the CUDA context, the cache."""
    dev = torch.device(device)
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    out = {"start": _counters(dev)}
    a = torch.empty(256 * MiB, dtype=torch.uint8, device=dev)
    out["a = 256 MiB tensor"] = _counters(dev)  # uint8: 1 byte per element
    b = a.float()                                    # a 1 GiB temporary...
    del b                                            # ...freed, but its block stays cached
    out["b = a.float(); del b"] = _counters(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    out["reset_peak_memory_stats()"] = _counters(dev)
    torch.cuda.empty_cache()                         # unused cached segments go back to CUDA
    out["empty_cache()"] = _counters(dev)
    del a
    torch.cuda.empty_cache()
    out["del a; empty_cache()"] = _counters(dev)  # every step that changes the figures has its row
    # Fragmentation: requests of 1-10 MiB are cut from 20 MiB segments (c10/cuda/CUDACachingAllocator.cpp), so
    # 40 x 2 MiB fill 4 segments; freeing every other one leaves 2 MiB holes between live tensors.
    small = [torch.empty(2 * MiB, dtype=torch.uint8, device=dev) for _ in range(40)]
    del small[::2]
    out["40 x 2 MiB, every other one freed"] = _counters(dev)
    # What the allocator itself does before it raises out-of-memory: it frees only wholly free segments.
    torch.cuda.empty_cache()
    out["then empty_cache()"] = _counters(dev)
    big = torch.empty(4 * MiB, dtype=torch.uint8, device=dev)  # fits no 2 MiB hole
    out["then one 4 MiB tensor"] = _counters(dev)
    del big, small
    torch.cuda.empty_cache()
    out["all freed, empty_cache()"] = _counters(dev)
    return out


def print_allocator_table(rows: dict) -> None:
    print(f"{'after':38s}{'allocated':>13s}{'reserved':>13s}{'peak':>13s}{'device used':>14s}")
    for label, r in rows.items():
        print(f"{label:38s}" + "".join(f"{mib(r[k]):>13s}" for k in ("allocated", "reserved", "peak"))
              + f"{mib(r['device_used']):>14s}")


def explain_allocator(rows: dict) -> None:
    """What the table of :func:`allocator_demo` says, as differences between its rows."""
    def d(label, before, k):  # the change from row `before` to row `label`
        return mib(rows[label][k] - rows[before][k], sign=True)
    b, frag = rows["b = a.float(); del b"], rows["40 x 2 MiB, every other one freed"]
    print(f"del b:        allocated {d('b = a.float(); del b', 'a = 256 MiB tensor', 'allocated')}, reserved "
          f"{d('b = a.float(); del b', 'a = 256 MiB tensor', 'reserved')}; the peak still counts b ({mib(b['peak'])})")
    print(f"reset peak:   the peak drops to what is allocated now ({mib(rows['reset_peak_memory_stats()']['peak'])})")
    print(f"empty_cache:  reserved {d('empty_cache()', 'reset_peak_memory_stats()', 'reserved')}, device used "
          f"{d('empty_cache()', 'reset_peak_memory_stats()', 'device_used')}")
    print(f"fragmented:   {mib(frag['reserved'] - frag['allocated'])} reserved but free; empty_cache() released "
          f"{d('then empty_cache()', '40 x 2 MiB, every other one freed', 'reserved')}, and 4 MiB more grew "
          f"reserved by {d('then one 4 MiB tensor', 'then empty_cache()', 'reserved')[1:]}")
    last = rows["all freed, empty_cache()"]
    print(f"not PyTorch's: device used - reserved = {mib(last['device_used'] - last['reserved'])} "
          f"(the CUDA context, and any other process on the GPU)")


def train_step(model, opt, x, y, mark=lambda phase: None) -> None:
    """One training step in three phases; ``mark(phase)`` is called as each begins."""
    mark("forward")
    loss = F.cross_entropy(model(x), y)
    mark("backward")
    loss.backward()
    mark("optimizer")
    opt.step()
    opt.zero_grad()


def _trace_len(dev) -> int:
    return len(torch.cuda.memory._snapshot()["device_traces"][dev.index])


def record_step_snapshot(path, widths=(4096, 4096, 4096, 4096, 10), batch=16384, device="cuda") -> dict:
    """Record one Adam step of an MLP into ``path`` (for pytorch.org/memory_viz): each phase's first trace index."""
    dev = torch.device(device)
    dev = torch.device("cuda", torch.cuda.current_device()) if dev.index is None else dev
    model = mlp(list(widths)).to(dev)
    x, y = torch.randn(batch, widths[0], device=dev), torch.randint(0, widths[-1], (batch,), device=dev)
    opt, marks = make_optimizer("adam", model.parameters()), {}
    # stacks="python": Python frames only, which keeps the file small; memory_viz shows them on hover.
    torch.cuda.memory._record_memory_history(max_entries=100_000, stacks="python", device=dev)
    train_step(model, opt, x, y, mark=lambda phase: marks.__setitem__(phase, _trace_len(dev)))
    torch.cuda.synchronize(dev)
    marks["end"] = _trace_len(dev)
    torch.cuda.memory._dump_snapshot(str(path))
    torch.cuda.memory._record_memory_history(enabled=None, device=dev)
    return marks


def snapshot_series(snap: dict) -> tuple[list[int], list[int]]:
    """(allocated, reserved) bytes after each event of the first non-empty device trace: the segments hold
    the state at the dump, so undoing the trace's events from their totals gives the totals at the start."""
    trace = next((t for t in snap["device_traces"] if t), [])
    sign = {"alloc": (1, 0), "free_completed": (-1, 0), "segment_alloc": (0, 1), "segment_free": (0, -1)}
    d = [[s * e.get("size", 0) for s in sign.get(e["action"], (0, 0))] for e in trace]
    alloc = sum(s["allocated_size"] for s in snap["segments"]) - sum(a for a, _ in d)
    res = sum(s["total_size"] for s in snap["segments"]) - sum(r for _, r in d)
    return (list(itertools.accumulate((a for a, _ in d), initial=alloc))[1:],
            list(itertools.accumulate((r for _, r in d), initial=res))[1:])


def snapshot_summary(snap: dict, marks: dict) -> dict:
    """Peak allocated bytes within each phase and overall, reserved bytes at the end, event counts."""
    allocated, reserved = snapshot_series(snap)
    ends = [marks[p] for p in PHASES[1:]] + [marks["end"]]
    out = {f"peak in {p}": max(allocated[marks[p]:e], default=0) for p, e in zip(PHASES, ends)}
    out.update({"peak allocated": max(allocated), "reserved at the end": reserved[-1],
                "allocations": sum(e["action"] == "alloc" for t in snap["device_traces"] for e in t),
                "segments at the end": len(snap["segments"])})
    return out


def plot_snapshot(snap: dict, marks: dict, title: str = "", ax=None):
    """Allocated and reserved bytes over the allocator's events, phases marked: memory_viz in short."""
    import matplotlib.pyplot as plt

    allocated, reserved = snapshot_series(snap)
    ax = ax or plt.subplots(figsize=(9, 3.8))[1]
    div, unit = (2**30, "GiB") if max(reserved) > 2 * 2**30 else (MiB, "MiB")
    xs = range(len(allocated))
    ax.step(xs, [r / div for r in reserved], where="post", color="#8C8C8C", label="reserved")
    ax.fill_between(xs, [a / div for a in allocated], step="post", color="#4C72B0", alpha=0.7, label="allocated")
    for p in PHASES:
        ax.axvline(marks[p], color="k", lw=0.6, ls=":")
        ax.text(marks[p], max(reserved) / div * 0.98, f" {p}", va="top", fontsize=9)
    ax.set(xlabel="allocator events (alloc, free, cudaMalloc, cudaFree)", ylabel=unit, title=title)
    ax.legend(loc="lower right", fontsize=8, frameon=False)
    return ax


def top_memory_ops(prof, k: int = 6) -> list[tuple[str, int]]:
    """torch.profiler: the ``k`` ops that allocated the most (self CPU memory, bytes), ties by name."""
    rows = [(e.key, int(e.self_cpu_memory_usage)) for e in prof.key_averages() if e.self_cpu_memory_usage > 0]
    return sorted(rows, key=lambda r: (-r[1], r[0]))[:k]


def scenario_inputs(case):
    w = case["widths"]
    return mlp(w, seed=case["seed"]), make_batch(case["batch"], w[0], w[-1], case["seed"])


@contextlib.contextmanager
def scenario(case: dict):
    """``with scenario(case) as (step, tracker):`` a step to measure; a tracker with a baseline and a higher peak."""
    model, (x, y) = scenario_inputs(case)

    def step():
        F.cross_entropy(model(x), y).backward()  # the gradients stay allocated after the step

    with MemoryTracker() as t:
        baseline = torch.zeros(case["baseline"], dtype=torch.uint8)  # noqa: F841 - allocated before the step
        spike = torch.empty(case["spike"], dtype=torch.uint8)
        del spike                                                      # an earlier peak, above the step's
        yield step, t
