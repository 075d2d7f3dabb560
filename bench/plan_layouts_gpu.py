"""Does the layout search's arithmetic (``planner.search.plan_ranks``) hold on a GPU? One rank, or each rank of 2 and 4.

    python bench/plan_layouts_gpu.py          # one GPU: a Llama-shaped 0.5B decoder, 4 x 2048 tokens
    python bench/plan_layouts_gpu.py --cpu    # dry run of the same code path: a tiny decoder, one gloo rank
    python bench/plan_layouts_gpu.py --ranks [--jobs 4] [--only REGEX]   # 2- and 4-rank layouts on one GPU
    python bench/plan_layouts_gpu.py --ranks --cpu --only "pp2 interleaved"   # their dry run, on CPU tensors

``planner.parallel.rank_step`` (the layouts' one code path) runs at world size 1 in a NCCL group
(``run_ranks(..., 1)``) for the layouts one GPU holds: tp1 pp1 with and without activation checkpointing,
with 2 and 4 micro-batches (at pp=1 GPipe and 1F1B are the same order: gradient accumulation). Each
row's steady step (the third; ``rank_step`` resets the peak before it) is measured on the CUDA allocator:
``max_memory_allocated`` minus what was allocated before the model existed -- the batch and cuBLAS's
workspaces, made beforehand by a matmul's forward and backward (the forward's thread and autograd's
each get one; ``bench/measure.py`` subtracts the same memory no tensor of the step owns).

Two precisions per layout: ``fp32``, ``rank_step`` as it is (it has no autocast; held against
``plan_ranks(c=4, kernels="cuda")``, which refuses grouped heads in fp32: memory-efficient and cuDNN
attention refuse them, math runs; so fp32 is held on the same decoder with as many key/value heads as
query heads, ``mha``), and ``bf16``: the stage's forward under ``torch.autocast(bf16)``
with fp32 logits, as torchtitan runs a model FSDP2 does not wrap (held against the search's default,
``plan_ranks(c=2, kernels="cuda")``). FSDP2 at dp_shard=1 is no row: ``apply_layout`` wraps nothing at
dp=1, which is what ``plan_ranks`` plans there too. The traced ``plan_layout`` is left out on the GPU: it
traces the CPU's kernels in fp32 (``--cpu`` prints it beside the tracker).

``--ranks``: layouts of 2 and 4 ranks (TP 2 and 4, FSDP2 over 2 and 4, HSDP 2 x 2, TP 2 x FSDP2 2, PP 2
and 4 with GPipe, 1F1B and interleaved 1F1B (2 chunks a rank), PP 2 x TP 2; each with and without
checkpointing). NCCL refuses two ranks on one GPU and gloo has no CUDA send/recv, so each distinct rank
(``parallel.distinct_ranks``) runs in turn, in its own process, on the GPU in a fake process group of the
layout's world (``fake_world``: real CUDA tensors and allocations, collectives move no data) --
``rank_step`` as the plan runs it (``fake=True``), on ``cuda``. bf16 autocast where no FSDP2 wraps the
model; the FSDP2 layouts in fp32 on ``mha`` (``apply_layout``'s FSDP2 has no mixed-precision policy, so
under autocast it gathers fp32 parameters where the search's bf16 plans torchtitan's bf16 gathers).
With ``--cpu`` each rank runs on CPU tensors under the course's ``MemoryTracker``, printed beside the
traced ``plan_layout`` and ``plan_ranks(c=4, kernels="cpu")``.

Prints per row: layout, precision, measured peak, ``plan_ranks``' peak and its error (+: over-plans; in %
and KiB), and
the plan's terms (state / gathered / activations / transient) in MiB; on the GPU also what the steady step
starts with (parameters and Adam's state).
"""
import argparse
import contextlib

import torch

from mgpu_helpers.planner.parallel import Layout, LlamaConfig
from mgpu_helpers.planner.search import plan_ranks

GPU_CFG, GPU_BATCH, GPU_SEQ = LlamaConfig(vocab=32000, d=2048, layers=8, heads=16, kv_heads=4, ffn=5632), 4, 2048
GPU_MHA = GPU_CFG._replace(kv_heads=16)  # fp32 held on memory-efficient attention (grouped heads run math)
CPU_CFG, CPU_BATCH, CPU_SEQ = LlamaConfig(vocab=512, d=64, layers=2, heads=4, kv_heads=2, ffn=172), 4, 32
LAYOUTS = [Layout(), Layout(checkpointing=True), Layout(microbatches=2), Layout(microbatches=4),
           Layout(microbatches=4, checkpointing=True)]
CPU_RANKS_CFG = CPU_CFG._replace(layers=8, kv_heads=4)  # pp 4 x 2 chunks; tp 4 divides the key/value heads
RANK_LAYOUTS = [L for ac in (False, True) for L in (
    Layout(tp=2, checkpointing=ac), Layout(tp=4, checkpointing=ac),
    Layout(dp_shard=2, checkpointing=ac), Layout(dp_shard=4, checkpointing=ac),
    Layout(dp_replicate=2, dp_shard=2, checkpointing=ac), Layout(tp=2, dp_shard=2, checkpointing=ac),
    *(Layout(pp=pp, microbatches=4, schedule=s, virtual_stages=2 if s == "interleaved" else 1, checkpointing=ac)
      for pp in (2, 4) for s in ("gpipe", "1f1b", "interleaved")),
    Layout(pp=2, tp=2, microbatches=4, checkpointing=ac))]


class AllocatorPeak:
    """A tracker for ``rank_step`` on the CUDA allocator: its peak since ``reset_peak()``, less what was
    allocated on entry (the batch, cuBLAS's workspaces)."""

    def __enter__(self):
        torch.cuda.synchronize()
        self.base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        return self

    def reset_peak(self):
        torch.cuda.synchronize()
        self.before = torch.cuda.memory_allocated() - self.base  # what the steady step starts with
        torch.cuda.reset_peak_memory_stats()

    def __exit__(self, *exc):
        torch.cuda.synchronize()
        self.peak_bytes = torch.cuda.max_memory_allocated() - self.base


@contextlib.contextmanager
def bf16_forward():
    """The stage's forward under bf16 autocast, its logits in fp32 (torchtitan's loss takes ``pred.float()``);
    autocast is left at each forward's end, so its cast weights live as long as that micro-batch's graph."""
    from mgpu_helpers.planner import parallel
    orig = parallel.Llama.forward

    def forward(self, x):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = orig(self, x)
        return out.float() if self.output is not None else out
    parallel.Llama.forward = forward
    try:
        yield
    finally:
        parallel.Llama.forward = orig


def _warm_cublas(device):
    for dtype in (torch.float32, torch.bfloat16):  # a workspace per thread: the forward's and autograd's
        a = torch.randn(64, 64, device=device, dtype=dtype, requires_grad=True)
        (a @ a).sum().backward()


def _rank(rank, world, batch, seq, rows):
    import gc

    from mgpu_helpers.planner.parallel import forget_meshes, _rank_batch, make_mesh, rank_step
    from mgpu_helpers.runtime.launch import rank_device
    from mgpu_helpers.runtime.tracker import MemoryTracker
    device = rank_device()
    if device.type == "cuda":
        _warm_cublas(device)
    out = []
    for cfg, layout, precision in rows:
        forget_meshes()
        torch.manual_seed(0)
        tokens, targets = _rank_batch(cfg, layout, batch, seq, rank, device)
        mesh = make_mesh(layout, device.type)
        tracker = AllocatorPeak() if device.type == "cuda" else MemoryTracker(device=device)
        with bf16_forward() if precision == "bf16" else contextlib.nullcontext():
            mt = rank_step(cfg, layout, rank, tokens, targets, tracker, mesh=mesh, device=device)
        out.append((mt.peak_bytes, getattr(mt, "before", None)))
        del mt, tracker, tokens, targets, mesh
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def _one_rank(task):
    """One rank of a layout, alone in this process, in a fake process group: (peak, held before the step)."""
    cfg, layout, rank, batch, seq, precision, cpu = task
    from mgpu_helpers.planner.parallel import _rank_batch, make_mesh, rank_step
    from mgpu_helpers.runtime.fake_world import fake_world
    from mgpu_helpers.runtime.tracker import MemoryTracker
    device = torch.device("cpu" if cpu else "cuda", None if cpu else 0)
    if not cpu:
        torch.cuda.set_device(device)
        _warm_cublas(device)
    torch.manual_seed(0)
    tokens, targets = _rank_batch(cfg, layout, batch, seq, rank, device)
    try:
        with fake_world(layout.world, rank):
            mesh = make_mesh(layout, device.type)
            tracker = MemoryTracker(device=device) if cpu else AllocatorPeak()
            with bf16_forward() if precision == "bf16" else contextlib.nullcontext():
                mt = rank_step(cfg, layout, rank, tokens, targets, tracker, mesh=mesh, device=device, fake=True)
    except Exception as e:  # one row's failure (out of memory beside other ranks, say) is that row's line
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return mt.peak_bytes, getattr(mt, "before", None)


def ranks_main(cpu: bool, only: str | None, jobs: int):
    import multiprocessing as mp
    import re

    from mgpu_helpers.planner.parallel import distinct_ranks, plan_layout
    batch, seq = (CPU_BATCH, CPU_SEQ) if cpu else (GPU_BATCH, GPU_SEQ)
    rows = []  # (cfg, layout, precision, representative rank, the ranks it stands for)
    for L in RANK_LAYOUTS:
        if only and not re.search(only, L.describe()):
            continue
        prec = "fp32" if cpu or L.dp > 1 else "bf16"
        cfg = CPU_RANKS_CFG if cpu else (GPU_MHA if prec == "fp32" else GPU_CFG)
        rows += [(cfg, L, prec, rep, ranks) for rep, ranks in distinct_ranks(cfg, L).items()]
    tasks = [(cfg, L, rep, batch, seq, prec, cpu) for cfg, L, prec, rep, _ in rows]
    pool = mp.get_context("spawn").Pool(jobs, maxtasksperchild=1)  # a fresh process (allocator) per rank
    measured = pool.imap(_one_rank, tasks, chunksize=1)
    if cpu:
        print(f"CPU dry run: each rank in a fake process group on CPU tensors (MemoryTracker), {CPU_RANKS_CFG}, "
              f"batch {batch} x {seq}; beside it the traced plan_layout and plan_ranks(c=4, kernels='cpu')")
    else:
        p = torch.cuda.get_device_properties(0)
        print(f"{p.name}, torch {torch.__version__}; each rank in its own process in a fake process group on "
              f"the one GPU; {GPU_CFG}, batch {batch} x {seq}; fp32 rows on 'mha' ({GPU_MHA.kv_heads} key/value heads)")
    mib, traced = 2**20, {}
    print(f"{'layout':<34} {'prec':<5} {'ranks':<8} {'measured MiB':>13} {'plan_ranks':>11} {'err':>7} {'KiB':>9}"
          + (f" {'plan_layout':>11} {'err':>7}" if cpu else "") + "   plan: state/gathered/acts/transient MiB")
    for (cfg, L, prec, rep, ranks), (got, before) in zip(rows, measured):
        if got is None:
            print(f"{L.describe():<34} {prec:<5} {','.join(map(str, ranks)):<8} failed: {before}", flush=True)
            continue
        r = plan_ranks(cfg, L, batch, seq, c=4 if prec == "fp32" else 2, kernels="cpu" if cpu else "cuda")
        r = r[L.coords(rep)[0]]
        line = (f"{L.describe():<34} {prec:<5} {','.join(map(str, ranks)):<8} {got / mib:13.2f} {r.peak / mib:11.2f} "
                f"{100 * (r.peak / got - 1):+6.2f}% {(r.peak - got) / 1024:+9.1f}")
        if cpu:
            if L not in traced:
                traced[L] = plan_layout(cfg, L, batch, seq)
            line += f" {traced[L][rep] / mib:11.3f} {100 * (traced[L][rep] / got - 1):+6.2f}%"
        terms = "/".join(f"{t / mib:.1f}" for t in (r.state, r.gathered, r.activations, r.transient))
        print(line + "   " + terms + (f"   (held before the step: {before / mib:.1f})" if before else ""), flush=True)
    pool.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="dry run: a tiny decoder on CPU (one gloo rank, or --ranks)")
    ap.add_argument("--ranks", action="store_true", help="each rank of 2- and 4-rank layouts, in turn, on one GPU")
    ap.add_argument("--only", help="--ranks: only the layouts whose description matches this regex")
    ap.add_argument("--jobs", type=int, default=1, help="--ranks: ranks measured at once (own processes)")
    args = ap.parse_args()
    if args.ranks:
        return ranks_main(args.cpu or not torch.cuda.is_available(), args.only, args.jobs)
    from mgpu_helpers.runtime.launch import run_ranks
    cpu = args.cpu or not torch.cuda.is_available()
    cfg, batch, seq = (CPU_CFG, CPU_BATCH, CPU_SEQ) if cpu else (GPU_CFG, GPU_BATCH, GPU_SEQ)
    rows = [(cfg, L, p) for L in LAYOUTS for p in (("fp32",) if cpu else ("fp32", "bf16"))]
    rows += [] if cpu else [(GPU_MHA, L, "fp32") for L in LAYOUTS]
    measured = run_ranks(_rank, 1, batch, seq, rows, backend="gloo" if cpu else "nccl", timeout=900)[0]
    if cpu:
        from mgpu_helpers.planner.parallel import plan_layout
        print("CPU dry run (gloo, MemoryTracker; the plan with the CPU's kernels, and the traced plan_layout)")
    else:
        p = torch.cuda.get_device_properties(0)
        print(f"{p.name}, torch {torch.__version__}; NCCL at world size 1; {cfg}, batch {batch} x {seq}; "
              f"'mha': the same with {GPU_MHA.kv_heads} key/value heads")
    mib = 2**20
    print(f"{'layout':<24} {'prec':<8} {'measured MiB':>13} {'plan_ranks':>11} {'err':>7} {'KiB':>9}"
          + (f" {'plan_layout':>11} {'err':>7}" if cpu else "") + "   plan: state/gathered/acts/transient MiB")
    for (shape, L, prec), (got, before) in zip(rows, measured):
        name = prec + (" mha" if shape is GPU_MHA else "")
        try:
            r = plan_ranks(shape, L, batch, seq, c=4 if prec == "fp32" else 2, kernels="cpu" if cpu else "cuda")[0]
        except ValueError as e:  # fp32 with grouped heads: SDPA's math kernel, which the arithmetic refuses
            print(f"{L.describe():<24} {name:<8} {got / mib:13.1f}   not planned: {e}")
            continue
        line = (f"{L.describe():<24} {name:<8} {got / mib:13.1f} {r.peak / mib:11.1f} "
                f"{100 * (r.peak / got - 1):+6.2f}% {(r.peak - got) / 1024:+9.1f}")
        if cpu:
            traced = plan_layout(shape, L, batch, seq)[0]
            line += f" {traced / mib:11.3f} {100 * (traced / got - 1):+6.2f}%"
        terms = "/".join(f"{t / mib:.1f}" for t in (r.state, r.gathered, r.activations, r.transient))
        print(line + "   " + terms + (f"   (held before the step: {before / mib:.1f})" if before else ""))


if __name__ == "__main__":
    main()
