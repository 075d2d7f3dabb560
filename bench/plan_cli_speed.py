"""``mgpu-plan`` on a Llama-2-70B-shaped Hugging Face config, on this machine's CPU: wall time and peak RSS.

    PYTHONPATH=. python3 bench/plan_cli_speed.py                 # goal: <= 60 s, <= 2 GiB peak RSS
    PYTHONPATH=. python3 bench/plan_cli_speed.py --batch 4       # 1, 2, 4 micro-batches: 6 traces
    PYTHONPATH=. python3 bench/plan_cli_speed.py --config bench/configs/llama-3-8b.json --batch 4 --seq 2048 \
        --gpus 1,2,4,8                                           # 8B, 6 traces x 13 (GPUs x ZeRO) = 78 rows

Writes Llama-2-70B's shape as a config.json (80 layers, d=8192, 64 heads, 8 KV heads, SwiGLU 28672,
vocab 32000; 69.0B parameters) and runs the command a user would, in a child process, planning 8 GPUs
(ZeRO 0-3 x checkpointing x micro-batches, bf16 autocast, Adam) against an H100 80GB. Prints the command,
its output, wall time and the child's peak RSS. Without transformers it plans the built-in Llama-shaped
decoder of the same width and depth instead (no grouped-query attention: 78B parameters) and says so.
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LLAMA_70B = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 8192, "intermediate_size": 28672,
             "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
             "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
             "torch_dtype": "bfloat16"}
ROOT = Path(__file__).resolve().parent.parent


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--config", help="plan this Hugging Face config instead of Llama-2-70B's shape")
    ap.add_argument("--gpus", default="8")
    args = ap.parse_args()
    try:
        import transformers  # noqa: F401
        have_hf = True
    except ImportError:
        have_hf = False
    with tempfile.TemporaryDirectory() as tmp:
        if args.config:
            model, env_extra = str(Path(args.config).resolve()), {}
        elif have_hf:
            model = os.path.join(tmp, "llama-70b")
            os.makedirs(model)
            Path(model, "config.json").write_text(json.dumps(LLAMA_70B, indent=1))
            env_extra = {}
        else:  # a module:function for the built-in decoder at 70B's width and depth
            Path(tmp, "llama70b_builtin.py").write_text(
                "from mgpu_helpers.planner.models import Decoder\n"
                "def build():\n    return Decoder(32000, 8192, 80, 64, 28672)\n")
            model, env_extra = "llama70b_builtin:build", {}
            print("transformers is not installed: planning the built-in decoder of 70B's shape (no GQA)")
        cmd = [sys.executable, "-m", "mgpu_helpers.tools.plan_cli", model, "--batch", str(args.batch), "--seq",
               str(args.seq), "--gpus", args.gpus, "--gpu", "H100-80GB"]
        print("$", " ".join(["mgpu-plan", *cmd[3:]]), flush=True)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), tmp, os.environ.get("PYTHONPATH", "")]),
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"), **env_extra}
        t = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        tree_rss = 0
        while proc.poll() is None:  # the command and its worker processes together, sampled every 0.2 s
            tree_rss = max(tree_rss, _tree_rss(proc.pid))
            time.sleep(0.2)
        out, err = proc.communicate()
        proc.stdout, proc.stderr = out, err
        wall = time.perf_counter() - t
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    rss, cpu = ru.ru_maxrss / 2**20, ru.ru_utime + ru.ru_stime
    load = os.getloadavg()[0]
    print(proc.stdout, end="")
    if proc.returncode not in (0, 1):
        print(proc.stderr, file=sys.stderr)
    print(f"\nexit status {proc.returncode}; wall {wall:.1f} s (goal <= 60 s), peak RSS {tree_rss / 2**30:.2f} GiB for "
          f"the command and its worker processes together (goal <= 2 GiB; largest single process {rss:.2f} GiB); "
          f"CPU {cpu:.1f} s; {os.cpu_count()} CPU cores visible, load average {load:.1f} (other processes "
          "share the cores when it exceeds their count)")


def _tree_rss(root: int) -> int:
    """Resident bytes of ``root`` and its descendants now (Linux /proc; 0 elsewhere)."""
    kids, rss = {}, {}
    for d in Path("/proc").glob("[0-9]*"):
        try:
            stat = (d / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            kids.setdefault(ppid, []).append(int(d.name))
            rss[int(d.name)] = int((d / "statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            continue
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += rss.get(pid, 0)
        todo += kids.get(pid, [])
    return total


if __name__ == "__main__":
    main()
