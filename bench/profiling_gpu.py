"""Measure on a GPU the figures notebook 02 shows on machines without one.

    PYTHONPATH=. python3 bench/profiling_gpu.py [--out DIR]     # DIR: $OUT if set, else solutions/assets

Writes, into DIR:
* ``02_gpu_figures.json``   -- the CUDA context, the allocator story (allocated / reserved / peak /
  empty_cache / fragmentation), one training step's snapshot summary, and NCCL's buffers;
* ``02_gpu_snapshot.pickle`` -- ``torch.cuda.memory._dump_snapshot`` of that step (https://pytorch.org/memory_viz);
* ``02_gpu_snapshot.png``   -- the snapshot drawn by ``mgpu_helpers.profiling.plot_snapshot``.
The JSON is rewritten after every section, so a section that fails or hangs loses only itself.
Without CUDA it prints one line and exits 0.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pickle
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

from mgpu_helpers import profiling as P

LIMIT = 1_900_000  # assets stay under 2 MB


def smi_used_mib() -> int | None:
    """Device memory in use as nvidia-smi reports it (MiB), read without touching CUDA from this process."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=30).stdout
        return int(out.split()[0])
    except Exception:  # no nvidia-smi: the figure is simply missing
        return None


def section(fig: dict, out: Path, name: str, fn) -> None:
    t0 = time.time()
    try:
        fig[name] = fn()
    except Exception as e:  # record and carry on: one run of this script must bring back what it can
        fig[name] = {"error": f"{type(e).__name__}: {e}"}
    print(f"{name}: {time.time() - t0:.1f} s {'ERROR ' + fig[name]['error'] if 'error' in fig[name] else 'ok'}",
          flush=True)
    (out / P.FIGURES).write_text(json.dumps(fig, indent=1) + "\n")


def context(before_mib) -> dict:
    torch.cuda.init()
    x = torch.zeros(1, device="cuda")  # noqa: F841 - the first tensor creates the context
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return {"smi_used_before_mib": before_mib, "smi_used_after_mib": smi_used_mib(),
            "device_used": total - free, "device_total": total,
            "allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved()}


def snapshot(out: Path) -> dict:
    widths, batch = (4096, 4096, 4096, 4096, 10), 16384
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    path = out / P.SNAPSHOT
    marks = P.record_step_snapshot(path, widths, batch)
    peak = torch.cuda.max_memory_allocated()
    snap = pickle.loads(path.read_bytes())
    if path.stat().st_size > LIMIT:  # keep the asset small: memory_viz needs stacks only where tensors are made
        for e in (e for t in snap["device_traces"] for e in t if e["action"] != "alloc"):
            e["frames"] = []
        path.write_bytes(pickle.dumps(snap))
    if path.stat().st_size > LIMIT:  # still too big: shorter stacks everywhere, same events
        for f in [b for seg in snap["segments"] for b in seg.get("blocks", [])] + \
                 [e for t in snap["device_traces"] for e in t]:
            f["frames"] = f.get("frames", [])[:12]
        path.write_bytes(pickle.dumps(snap))
    summary = P.snapshot_summary(snap, marks)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ax = P.plot_snapshot(snap, marks, title=f"One Adam step, MLP {list(widths)}, batch {batch}, "
                                            f"fp32 -- {torch.cuda.get_device_name()}")
    ax.figure.tight_layout()
    ax.figure.savefig(out / P.PNG, dpi=110)
    plt.close(ax.figure)
    res = {"widths": list(widths), "batch": batch, "marks": marks, "summary": summary,
           "max_memory_allocated": peak, "allocated_before": before,
           "pickle_bytes": path.stat().st_size}
    # The course's tracker on the same step: reading the allocator on CUDA, and its own accounting
    # (on the GPU, then on the CPU with 512-byte rounding): how well the CPU figures predict this GPU.
    for dev in ("cuda", "cpu"):
        model = P.mlp(list(widths)).to(dev)
        opt = P.make_optimizer("adam", model.parameters())
        x = torch.randn(batch, widths[0], device=dev)
        y = torch.randint(0, widths[-1], (batch,), device=dev)
        with P.MemoryTracker(model, opt, round_to=512) as t:
            P.train_step(model, opt, x, y, mark=t.mark)
        res[f"tracker_{dev}"] = {"peak_bytes": t.peak_bytes, "accounted_peak_bytes": t.accounted_peak_bytes,
                                 "phase_peaks": t.phase_peaks()}
        del model, opt, x, y, t
        torch.cuda.empty_cache()
    return res


def nccl() -> dict:
    import torch.distributed as dist

    def counters():
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        return {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(),
                "device_used": total - free}

    torch.cuda.empty_cache()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = {"world_size": 1, "before": counters()}
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0), timeout=datetime.timedelta(seconds=60))
    res["after init_process_group"] = counters()
    t = torch.ones(64 * P.MiB // 4, device="cuda")
    dist.all_reduce(t)
    res["after a 64 MiB all_reduce"] = counters()
    dist.destroy_process_group()
    res["nccl_version"] = ".".join(map(str, torch.cuda.nccl.version()))
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or P.ROOT / "solutions" / "assets"))
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("profiling_gpu: no CUDA device here, nothing to measure")
        return 0
    a.out.mkdir(parents=True, exist_ok=True)
    before = smi_used_mib()  # before this process creates its CUDA context
    fig = {"made_by": "bench/profiling_gpu.py", "device": torch.cuda.get_device_name(0),
           "torch": torch.__version__, "cuda": torch.version.cuda,
           "date": datetime.date.today().isoformat()}
    section(fig, a.out, "context", lambda: context(before))
    section(fig, a.out, "allocator", P.allocator_demo)
    section(fig, a.out, "snapshot", lambda: snapshot(a.out))
    section(fig, a.out, "nccl", nccl)
    print(json.dumps(fig, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
