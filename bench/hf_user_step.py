"""mgpu-plan against the step Hugging Face users run, on families the planner was not tuned on.

    PYTHONPATH=. python3 bench/hf_user_step.py --json hf_user_step.json          # on an idle GPU (H200)
    PYTHONPATH=. python3 bench/hf_user_step.py --only "olmoe|opt"                # rows whose name has one
    PYTHONPATH=. python3 bench/hf_user_step.py --device cpu --scale tiny         # dry run of every code path

The step, as a user writes it: ``model = AutoModelForCausalLM.from_config(cfg)`` (transformers' default
attention and experts implementation), ``model.train()``, ``model.gradient_checkpointing_enable()`` for
the checkpointing rows, ``torch.optim.AdamW`` (CUDA's default foreach), and per step
``loss = model(input_ids=x, labels=x).loss`` (inside ``torch.autocast("cuda", torch.bfloat16)`` for the
bf16 rows), ``loss.backward()``, ``opt.step()``, ``opt.zero_grad()``. Configs are built in code (no
network): a mixture of experts (OLMoE-, Qwen2-MoE-shaped), sliding-window and hybrid attention (Gemma-2 with
its 256k vocabulary, Mistral with a window shorter than the sequence), a 152k vocabulary (Qwen2) and
learned positions (OPT), multi-query attention beside the MLP (Falcon: one key/value head for 16 query
heads) and a mixture of experts with per-head q/k norms (Qwen3-MoE). Each row: fp32, bf16 autocast, bf16
autocast + checkpointing.

Every plan is made first (``mgpu_helpers.tools.plan_cli.run``, the command's own code: one GPU, ZeRO-0,
``--gpu H200``), in worker processes; then each row runs in a fresh child process (nothing of an earlier
row in the allocator): two warm-up steps, peak statistics reset, one step measured. *allocated*:
``torch.cuda.max_memory_allocated()`` against the plan's allocated line (bar: 2%); *device*: what the
child uses on the device (``mem_get_info`` used, minus what was used before it started: the GPU must be
otherwise idle) against the plan's device total (bar: 5%). ``--json PATH`` writes every row.

``--device cpu`` runs the same children on the CPU (``--scale tiny`` shrinks the models so that it takes
a minute or two): the allocated peak is the course's tracker's (``memory_allocated`` semantics), there is
no device total, and the plan's tensor peak -- a GPU's: CUDA's attention kernels and autocast lists -- is
printed beside it, not held to a bar.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

B, T = 4, 1024
# family: (model_type, config fields). Sizes fit one H200 at 4 x 1024 tokens with fp32 AdamW.
FAMILIES = {
    "olmoe (MoE 16x top-2)": ("olmoe", dict(vocab_size=50304, hidden_size=1024, intermediate_size=1024,
                                             num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=16,
                                             num_experts=16, num_experts_per_tok=2)),
    "qwen2_moe (MoE 16x top-4, shared expert)": ("qwen2_moe", dict(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=704,
        shared_expert_intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
        num_experts=16, num_experts_per_tok=4)),
    "gemma2 (sliding window, 256k vocab)": ("gemma2", dict(
        vocab_size=256000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=4, head_dim=128, sliding_window=512)),
    "mistral (window 256 < seq)": ("mistral", dict(
        vocab_size=32768, hidden_size=1024, intermediate_size=3584, num_hidden_layers=12, num_attention_heads=16,
        num_key_value_heads=4, sliding_window=256)),
    "qwen2 (152k vocab, qkv bias)": ("qwen2", dict(
        vocab_size=151936, hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16,
        num_key_value_heads=2, tie_word_embeddings=True)),
    "opt (learned positions)": ("opt", dict(
        vocab_size=50272, hidden_size=1024, ffn_dim=4096, num_hidden_layers=12, num_attention_heads=16,
        word_embed_proj_dim=1024, max_position_embeddings=2048)),
    # held out: families added after the planner's last change, planned before they were ever run
    "gpt_neox (parallel residual, partial rotary)": ("gpt_neox", dict(
        vocab_size=50432, hidden_size=1024, intermediate_size=4096, num_hidden_layers=12, num_attention_heads=16,
        rotary_pct=0.25, use_parallel_residual=True)),
    "phi3 (fused qkv and gate_up)": ("phi3", dict(
        vocab_size=32064, hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16,
        num_key_value_heads=16)),
    "falcon (multi-query, parallel attention)": ("falcon", dict(
        vocab_size=65024, hidden_size=1024, ffn_hidden_size=4096, num_hidden_layers=12, num_attention_heads=16,
        new_decoder_architecture=False, multi_query=True, parallel_attn=True, alibi=False, bias=False)),
    "qwen3_moe (MoE 16x top-4, q/k norms)": ("qwen3_moe", dict(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=704, num_hidden_layers=8,
        num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=16, num_experts_per_tok=4)),
    # held out: planned before it was ever run, after the fix that falcon's rows led to
    "bloom (ALiBi, eager attention)": ("bloom", dict(
        vocab_size=65536, hidden_size=1024, num_hidden_layers=12, num_attention_heads=16)),
}
SETTINGS = {"fp32": ("fp32", "off"), "bf16-autocast": ("bf16-autocast", "off"),
            "bf16-autocast + ckpt": ("bf16-autocast", "on")}
TINY = dict(hidden_size=64, intermediate_size=128, ffn_hidden_size=128, moe_intermediate_size=32,
            shared_expert_intermediate_size=128, ffn_dim=128, word_embed_proj_dim=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, vocab_size=1024,
            sliding_window=16)


def config(name, scale):
    from transformers import CONFIG_MAPPING
    model_type, fields = FAMILIES[name]
    fields = dict(fields)
    if scale == "tiny":  # the dry run's sizes: every field the family has, shrunk
        fields.update({k: v for k, v in TINY.items() if k in fields})
    from mgpu_helpers.tools.plan_sources import quiet
    with quiet():  # the tiny sizes' vocabulary is below the family's default special tokens: set just below
        cfg = CONFIG_MAPPING[model_type](**fields)
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):  # special tokens inside the vocabulary
        if isinstance(getattr(cfg, k, None), int) and getattr(cfg, k) >= cfg.vocab_size:
            setattr(cfg, k, cfg.vocab_size - 1)
    return cfg


def user_step(config_dir, precision, ckpt, device, batch, seq):
    """The model and one call of the user's step, as a user writes them. ``step(mark)`` calls
    ``mark("forward")`` after the loss and ``mark("backward")`` after ``loss.backward()``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    dev = torch.device(device)
    torch.manual_seed(0)
    cfg = AutoConfig.from_pretrained(config_dir)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).to(dev)
    model.train()
    if ckpt == "on":
        model.gradient_checkpointing_enable()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    x = torch.randint(0, cfg.get_text_config().vocab_size, (batch, seq), device=dev)

    def step(mark=lambda phase: None):
        with torch.autocast(dev.type, torch.bfloat16, enabled=precision == "bf16-autocast"):
            loss = model(input_ids=x, labels=x).loss
        mark("forward")
        loss.backward()
        mark("backward")
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt, step


def child(config_dir, precision, ckpt, device, batch, seq):
    """The user's step for real; prints one JSON line."""
    import torch
    cuda = torch.device(device).type == "cuda"
    model, opt, step = user_step(config_dir, precision, ckpt, device, batch, seq)
    info = dict(attn=model.config._attn_implementation,
                experts=getattr(model.config, "_experts_implementation", None))
    for _ in range(2):  # warm-up: Adam's state, cuBLAS's workspaces, the allocator's segments
        step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        info.update(allocated=torch.cuda.max_memory_allocated(), reserved=torch.cuda.max_memory_reserved(),
                    used=total - free, gpu=torch.cuda.get_device_name(), torch=torch.__version__)
    else:
        from mgpu_helpers.runtime.tracker import MemoryTracker
        with MemoryTracker(model, opt, device="cpu") as mt:
            step()
        info.update(allocated=mt.peak_bytes, reserved=None, used=None, gpu="cpu", torch=torch.__version__)
    print(json.dumps(info))


def plan_argv(config_dir, precision, ckpt, batch, seq):
    return [config_dir, "--batch", str(batch), "--seq", str(seq), "--precision", precision, "--checkpointing", ckpt,
            "--micro-batches", "1", "--zero", "0", "--gpus", "1", "--gpu", "H200", "--jobs", "1"]


def _plan(argv):
    from mgpu_helpers.tools.plan_cli import parse_args, run
    from mgpu_helpers.tools.plan_sources import quiet
    with quiet():
        r = run(parse_args(argv))
    p = r["plans"][0]
    return dict(allocated=p["allocated"], device_total=p["device_total"], tensor_peak=p["tensor_peak"],
                lines={ln["name"]: ln["bytes"] for ln in p["lines"]}, step=r["step"], assumptions=r["assumptions"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--scale", default=None, choices=("full", "tiny"), help="(default: full on cuda, tiny on cpu)")
    ap.add_argument("--only", default="", help="rows whose name contains one of these |-separated strings")
    ap.add_argument("--json", metavar="PATH", help="write every row here")
    ap.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1), help="processes planning at once")
    ap.add_argument("--child", nargs=6, metavar=("DIR", "PRECISION", "CKPT", "DEVICE", "BATCH", "SEQ"))
    a = ap.parse_args()
    if a.child:
        d, prec, ck, dev, b, t = a.child
        return child(d, prec, ck, dev, int(b), int(t))
    import torch
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("hf_user_step.py: no CUDA GPU here; --device cpu runs the dry run")
    scale = a.scale or ("full" if a.device == "cuda" else "tiny")
    batch, seq = (B, T) if scale == "full" else (2, 64)
    wanted = a.only.split("|")
    rows = [(f, s) for f in FAMILIES for s in SETTINGS if any(w in f"{f} {s}" for w in wanted)]
    tmp = tempfile.mkdtemp(prefix="hf_user_step_")
    dirs = {}
    for f in {f for f, _ in rows}:
        dirs[f] = os.path.join(tmp, FAMILIES[f][0])
        config(f, scale).save_pretrained(dirs[f])
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor
    t0 = time.time()
    argvs = [plan_argv(dirs[f], *SETTINGS[s], batch, seq) for f, s in rows]
    with ProcessPoolExecutor(max(1, min(a.workers, len(rows))), mp_context=mp.get_context("spawn")) as pool:
        plans = list(pool.map(_plan, argvs))
    print(f"planned {len(rows)} rows in {time.time() - t0:.0f} s; batch {batch} x {seq} tokens; step planned: "
          f"{plans[0]['step'] if plans else '-'}", flush=True)
    before = 0
    if a.device == "cuda":
        free, total = torch.cuda.mem_get_info()
        before = total - free  # this process's context and anything else on the GPU
    out, worst = [], [0.0, 0.0]
    print(f"{'family':<42} {'setting':<21} | {'alloc plan':>15} {'alloc real':>15} {'err':>7} | "
          f"{'device plan':>15} {'device real':>15} {'err':>7} | attn / experts")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    for (f, s), plan in zip(rows, plans):
        prec, ck = SETTINGS[s]
        r = subprocess.run([sys.executable, __file__, "--child", dirs[f], prec, ck, a.device, str(batch), str(seq)],
                           env=env, capture_output=True, text=True)
        row = dict(family=f, model_type=FAMILIES[f][0], setting=s, planned=plan)
        if r.returncode:
            row["error"] = (r.stderr.strip().splitlines() or ["(no message)"])[-1]
            print(f"{f:<42} {s:<21} | child failed: {row['error'][:200]}", flush=True)
            out.append(row)
            continue
        m = json.loads(r.stdout.strip().splitlines()[-1])
        row["measured"] = m
        if a.device == "cpu":  # the tensors' peak: the GPU's lines (cuBLAS, rounding) have no CPU counterpart
            plan = dict(plan, allocated=plan["tensor_peak"])
        e_alloc = (plan["allocated"] - m["allocated"]) / m["allocated"]
        row["allocated_error"] = e_alloc
        dev_s = f"{'-':>15} {'-':>15} {'-':>7}"
        if m["used"] is not None:
            used = m["used"] - before
            e_dev = (plan["device_total"] - used) / used
            row.update(device_used=used, device_error=e_dev)
            worst = [max(worst[0], abs(e_alloc)), max(worst[1], abs(e_dev))]
            dev_s = f"{plan['device_total']:>15,} {used:>15,} {100 * e_dev:>+6.2f}%"
        print(f"{f:<42} {s:<21} | {plan['allocated']:>15,} {m['allocated']:>15,} {100 * e_alloc:>+6.2f}% | "
              f"{dev_s} | {m['attn']} / {m['experts']}", flush=True)
        out.append(row)
    if a.device == "cuda":
        ok_a = sum(abs(r.get("allocated_error", 1)) <= 0.02 for r in out)
        ok_d = sum(abs(r.get("device_error", 1)) <= 0.05 for r in out)
        print(f"within the bars: allocated {ok_a}/{len(out)} (2%), device {ok_d}/{len(out)} (5%); worst |error| "
              f"allocated {100 * worst[0]:.2f}%, device {100 * worst[1]:.2f}%; {time.time() - t0:.0f} s in all")
    else:
        print("dry run on the CPU: the plan is a GPU's (CUDA kernels, cuBLAS, context), the measured peak the CPU "
              f"step's (the course's tracker); not held to a bar. {time.time() - t0:.0f} s in all")
    for assumption in {x for p in plans for x in p["assumptions"]}:
        print("assumed:", assumption)
    if a.json:
        Path(a.json).write_text(json.dumps(dict(device=a.device, scale=scale, batch=batch, seq=seq, rows=out),
                                           indent=1))
        print("wrote", a.json)


if __name__ == "__main__":
    main()
