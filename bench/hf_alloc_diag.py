"""What the CUDA caching allocator was asked for in the step Hugging Face users run, beside what the planner
replays: the data to find why a plan's reserve differs from the GPU's.

    PYTHONPATH=. python3 bench/hf_alloc_diag.py OUTDIR --only "gemma2/bf16-autocast + ckpt|opt/fp32"

For each row (bench/hf_user_step.py's families and settings): the plan is made with the command's own code
(``plan_cli.run``) and the traced step's allocator events are saved (``OUTDIR/<row>.plan.pkl``: events,
batch sizes, the plan's lines); then the step runs on the GPU in a fresh process under
``torch.cuda.memory._record_memory_history`` (no stacks) and every allocator action of the three steps is
saved (``OUTDIR/<row>.real.json.gz``: [action, address, size] with the index where each step began, and the
segments at the end). ``python3 bench/hf_alloc_diag.py OUTDIR --compare`` (no GPU needed) replays the real
requests through ``planner.allocator`` (are the rules right?) and sets the two request streams side by side
(is the order the planner traced the order the GPU saw?).
"""
import argparse
import gzip
import json
import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]


def child(config_dir, precision, ckpt, out):
    import torch
    from hf_user_step import B, T, user_step
    torch.cuda.memory._record_memory_history(context=None, stacks="python")
    _, _, step = user_step(config_dir, precision, ckpt, "cuda", B, T)
    marks = []  # where each step, its forward's end and its backward's end fall in the record

    def mark(phase=None):
        marks.append(len(torch.cuda.memory._snapshot()["device_traces"][0]))

    for i in range(3):
        torch.cuda.synchronize()
        if i == 2:
            torch.cuda.reset_peak_memory_stats()
        mark()
        step(mark)
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    ev = [[e["action"], e["addr"], e["size"]] for e in snap["device_traces"][0]]
    segs = [[s["address"], s["total_size"], [[b["size"], b["state"]] for b in s["blocks"]]] for s in snap["segments"]]
    free, total = torch.cuda.mem_get_info()
    with gzip.open(out, "wt") as f:
        json.dump(dict(events=ev, marks=marks, segments=segs, allocated=torch.cuda.max_memory_allocated(),
                       reserved=torch.cuda.max_memory_reserved(), used=total - free, torch=torch.__version__), f)


def stacks_child(config_dir, precision, ckpt, out):
    """The measured step alone, recorded with C++ frames (the autograd node and the ATen op behind each request
    of 1 MiB or more: what the Python stack cannot show in backward)."""
    import torch
    from hf_user_step import B, T, user_step
    _, _, step = user_step(config_dir, precision, ckpt, "cuda", B, T)
    step()
    step()
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(context="alloc", stacks="all")
    step()
    torch.cuda.synchronize()
    rows = []
    for e in torch.cuda.memory._snapshot()["device_traces"][0]:
        if e["action"] in ("alloc", "free_completed") and e["size"] >= 1 << 20:
            names = [f["name"] for f in e.get("frames", [])]
            rows.append([e["action"], e["size"], [n for n in names if "Backward" in n or "at::native::" in n
                                                    or "at::_ops::" in n or n.startswith("torch::")][:8]])
    with gzip.open(out, "wt") as f:
        json.dump(rows, f)


def collect(outdir, only, stacks=False):
    import hf_user_step as h
    from mgpu_helpers.planner import budget as db
    from mgpu_helpers.tools import plan_cli
    from mgpu_helpers.tools.plan_sources import quiet
    wanted = [w.partition("/")[::2] for w in only.split("|")]  # "family/setting": setting exact, or all
    rows = [(f, s) for f in h.FAMILIES for s in h.SETTINGS if any(fw in f and sw in ("", s) for fw, sw in wanted)]
    tmp = tempfile.mkdtemp(prefix="hf_alloc_diag_")
    orig = db.replayed
    for f, s in rows:
        name = f"{h.FAMILIES[f][0]}_{s.replace(' ', '').replace('+', '_')}"
        d = os.path.join(tmp, h.FAMILIES[f][0])
        h.config(f, "full").save_pretrained(d)
        prec, ck = h.SETTINGS[s]
        seen = {}

        def spy(trace, batch_sizes=(), **kw):
            seen.update(events=list(trace.events), batch=list(batch_sizes), kw=kw)
            return orig(trace, batch_sizes, **kw)
        plan_cli.db.replayed = spy  # the traced events, as the command replays them
        try:
            with quiet():
                r = plan_cli.run(plan_cli.parse_args(h.plan_argv(d, prec, ck, h.B, h.T)))
        finally:
            plan_cli.db.replayed = orig
        seen["plan"] = r["plans"][0]
        Path(outdir, name + ".plan.pkl").write_bytes(pickle.dumps(seen))
        p = subprocess.run([sys.executable, __file__, "--stacks-child" if stacks else "--child", d, prec, ck,
                            str(Path(outdir, name + (".stacks.json.gz" if stacks else ".real.json.gz")))],
                           capture_output=True, text=True,
                           env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])))
        print(name, "child rc", p.returncode, p.stderr.strip().splitlines()[-1:] if p.returncode else "", flush=True)


def compare(outdir):
    from mgpu_helpers.planner.allocator import replay, replay_recorded
    from mgpu_helpers.planner.budget import cublas_workspaces
    for real_f in sorted(Path(outdir).glob("*.real.json.gz")):
        name = real_f.name[:-len(".real.json.gz")]
        real = json.load(gzip.open(real_f, "rt"))
        plan = pickle.loads(Path(outdir, name + ".plan.pkl").read_bytes())
        # 1. the real requests through our rules
        m = real["marks"]
        ours = replay_recorded(real["events"], reset_at=m[6])
        r = replay(plan["events"], batch=plan["batch"], workspaces=cublas_workspaces())
        lines = {ln["name"]: ln["bytes"] for ln in plan["plan"]["lines"]}
        print(f"== {name} (torch {real['torch']})")
        print(f"  GPU:                       allocated {real['allocated']:>15,} reserved {real['reserved']:>15,} "
              f"(reserve {real['reserved'] / real['allocated'] - 1:+.2%})")
        print(f"  our rules on GPU requests: allocated {ours['peak_allocated']:>15,} reserved {ours['peak_reserved']:>15,} "
              f"(reserve {ours['peak_reserved'] / max(ours['peak_allocated'], 1) - 1:+.2%})")
        print(f"  planner's replay:          allocated {r['peak_allocated']:>15,} reserved {r['peak_reserved']:>15,} "
              f"(reserve {r['peak_reserved'] / r['peak_allocated'] - 1:+.2%}); lines {lines}")
        # 2. the measured step's large requests, side by side (sizes >= 1 MiB, in order)
        big = 1 << 20
        g = [(a, s) for a, _, s in real["events"][m[6]:] if a in ("alloc", "free_completed") and s >= big]
        steady = [e for e in plan["events"] if not e[2]]
        pl = [("alloc" if d > 0 else "free", abs(d), ph) for _, d, _, ph, _ in steady if abs(d) >= big]
        print(f"  large requests in the measured step: GPU {sum(a == 'alloc' for a, _ in g)}, "
              f"plan {sum(a == 'alloc' for a, _, _ in pl)}")
        ga = [s for a, s in g if a == "alloc"]
        pa = [s for a, s, _ in pl if a == "alloc"]
        from collections import Counter
        gc, pc = Counter(ga), Counter(-(-s // 512) * 512 for s in pa)
        diff = {s: (gc[s], pc[s]) for s in set(gc) | set(pc) if gc[s] != pc[s]}
        for s, (a, b) in sorted(diff.items(), key=lambda kv: -kv[0] * abs(kv[1][0] - kv[1][1]))[:15]:
            print(f"    size {s:>14,}: GPU x{a}, plan x{b}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("outdir", nargs="?")
    ap.add_argument("--only", default="gemma2/bf16-autocast + ckpt")
    ap.add_argument("--compare", action="store_true")
    ap.add_argument("--stacks", action="store_true", help="record the measured step's C++ frames instead")
    ap.add_argument("--child", nargs=4)
    ap.add_argument("--stacks-child", nargs=4)
    a = ap.parse_args()
    if a.child:
        return child(*a.child)
    if a.stacks_child:
        return stacks_child(*a.stacks_child)
    os.makedirs(a.outdir, exist_ok=True)
    if a.compare:
        return compare(a.outdir)
    collect(a.outdir, a.only, a.stacks)


if __name__ == "__main__":
    main()
