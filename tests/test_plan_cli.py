"""mgpu-plan: sources, the device budget, the candidate table, exit statuses, bad input (one line, exit 2)."""
import json
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
import torch

from mgpu_helpers.planner import budget as db
from mgpu_helpers.planner.accounting import CUDNN_WORKSPACE_EXTRA, CUDNN_WORKSPACE_FRACTION
from mgpu_helpers.tools.plan_cli import main
from mgpu_helpers.tools.plan_sources.hf import UNPADDED
from mgpu_helpers.planner import SIZES, decoder, lm_loss, plan_from_trace, token_batch
from mgpu_helpers.planner.trace import trace_step

ROOT = Path(__file__).resolve().parent.parent
TINY = ["tiny", "--batch", "8", "--seq", "64", "--micro-batches", "1", "--checkpointing", "off"]

CONVNET = textwrap.dedent('''
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
            self.blocks = nn.ModuleList([nn.Sequential(nn.Conv2d(16, 32, 3, 2, 1), nn.BatchNorm2d(32), nn.ReLU())])
            self.head = nn.Linear(32, 10)

        def forward(self, x):
            x = self.stem(x)
            for b in self.blocks:
                x = b(x)
            return self.head(x.mean((2, 3)))

    def convnet():
        return Net()

    def broken():
        raise RuntimeError("weights missing")

    def not_a_module():
        return 42

    def flat():  # no nn.ModuleList: nothing to checkpoint
        return nn.Sequential(nn.Flatten(), nn.Linear(12, 4))
''')


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys, *argv):
    code, out, err = run(capsys, *argv, "--json")
    assert code in (0, 1), err
    return code, json.loads(out)


@pytest.fixture
def convmod(tmp_path, monkeypatch):
    (tmp_path / "plan_convnets.py").write_text(CONVNET)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "plan_convnets"
    sys.modules.pop("plan_convnets", None)


# --- planner.budget ---------------------------------------------------------------------------------

def test_memory_sizes_need_a_unit_and_gb_is_decimal():
    assert db.parse_memory("80GB") == 80 * 10**9
    assert db.parse_memory("80 GiB") == 80 * 2**30
    assert db.parse_memory("1.5gib") == 3 * 2**29
    assert db.parse_memory("512MiB") == 2**29
    for bad in ("80", "80 G", "GB", "-1GB", "eighty GB"):
        with pytest.raises(ValueError, match="needs a unit"):
            db.parse_memory(bad)


def test_gpu_table_holds_real_capacities_in_bytes():
    assert db.gpu("H200")[0] == 143771 * 2**20          # as seen on this course's H200
    assert db.gpu("a100-80gb")[0] == 81920 * 2**20      # "80GB" cards hold 81920 MiB, not 80e9 bytes
    assert db.gpu("H100 80GB")[0] == 81559 * 2**20
    assert all(b > 10 * 2**30 and src for b, _, src in db.GPUS.values())
    with pytest.raises(ValueError, match="unknown GPU 'B300'"):
        db.gpu("B300")


def test_budget_lines_add_up_and_each_names_its_source():
    one = db.budget(10 * db.GiB, batch_bytes=2**20, world_size=1)
    eight = db.budget(10 * db.GiB, batch_bytes=2**20, world_size=8, conv_activation_bytes=100 * 2**20)
    names = [n for n, _, _ in one.lines]
    assert names == ["allocated by tensors", "batch", "cuBLAS workspace", "allocator reserve", "CUDA context"]
    assert one.total == sum(b for _, b, _ in one.lines) and all(src for _, _, src in eight.lines)
    assert one.allocated == 10 * db.GiB + 2**20 + 2 * db.CUBLAS_WORKSPACE["hopper"]  # what max_memory_allocated sees
    assert {"NCCL buffers", "cuDNN conv workspace"} <= {n for n, _, _ in eight.lines}
    assert dict((n, b) for n, b, _ in eight.lines)["cuDNN conv workspace"] == int(0.6 * 100 * 2**20)
    assert db.budget(10 * db.GiB, allocator="expandable").total < db.budget(10 * db.GiB).total
    assert db.budget(1, arch="ampere").allocated == 1 + 2 * 8_519_680  # forward + backward thread
    assert one.fits(one.total) and not one.fits(one.total - 1)
    with pytest.raises(ValueError, match="allocator"):
        db.budget(1, allocator="cudaMallocAsync")


# --- the command -------------------------------------------------------------------------------------

def test_built_in_model_plans_equal_the_planner_and_fits_means_device_total(capsys):
    code, r = run_json(capsys, *TINY, "--gpus", "1,2", "--gpu", "L4")
    assert code == 0 and r["traces"] == 1 and len(r["plans"]) == 1 + 4  # world 1: stage 0 only
    batch = token_batch(8, 64, SIZES["tiny"][0])
    trace = trace_step(decoder("tiny"), batch, loss_fn=lm_loss, precision="bf16-autocast", device="cpu",
                       kernels="cuda", round_to=512)  # a GPU's kernels, traced on this CPU
    for p in r["plans"]:
        want = plan_from_trace(trace, p["zero_stage"], p["gpus"])
        assert p["tensor_peak"] == want.peak_bytes and p["peak_phase"] == want.peak_phase
        assert p["device_total"] == sum(ln["bytes"] for ln in p["lines"])
        assert ("NCCL buffers" in [ln["name"] for ln in p["lines"]]) == (p["gpus"] > 1)
        assert p["fits"] == (p["device_total"] <= db.gpu("L4")[0])
    assert r["model"]["parameters"] == sum(p.numel() for p in decoder("tiny")().parameters())
    assert r["plans"][r["cheapest"]]["gpus"] == 1


def test_capacity_between_the_tensor_peak_and_the_device_total_does_not_fit(capsys):
    _, r = run_json(capsys, *TINY, "--gpu", "H200")
    p = r["plans"][0]
    code, r2 = run_json(capsys, *TINY, "--gpu-memory", f"{p['device_total']}B")
    assert code == 0 and r2["plans"][0]["fits"]                       # exactly the device total: fits
    code, r3 = run_json(capsys, *TINY, "--gpu-memory", f"{p['device_total'] - 1}B")
    assert code == 1 and r3["cheapest"] is None                        # a byte less: the allocated peak alone would fit
    assert p["allocated"] < p["device_total"] - 1


def test_cheapest_is_fewest_gpus_then_lowest_step_cost(capsys):
    _, r = run_json(capsys, "tiny", "--batch", "8", "--seq", "64", "--gpus", "1,2", "--gpu", "H200")
    fit = [p for p in r["plans"] if p["fits"]]
    best = r["plans"][r["cheapest"]]
    assert (best["gpus"], best["step_cost"]) == min((p["gpus"], p["step_cost"]) for p in fit)
    assert r["traces"] == 2 * 3  # checkpointing off/on x micro-batches 1, 2, 4: sharding never re-traces


def test_text_table_and_plot(capsys, tmp_path):
    png = tmp_path / "plan.png"
    code, out, err = run(capsys, *TINY, "--gpus", "2", "--gpu-memory", "16GB", "--plot", str(png))
    assert code == 0 and not err
    assert "cheapest plan that fits: 2 GPU(s)" in out and "NCCL buffers" in out and "CUDA context" in out
    assert "16,000,000,000 B = 14.90 GiB = 16.00 GB" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_output_names_the_step_the_precision_the_cost_and_ddps_buckets(capsys):
    code, out, err = run(capsys, *TINY, "--gpus", "2", "--zero", "0", "--gpu-memory", "1GB")
    assert "step planned: the course's step: cross-entropy of the model's output" in out
    assert " bf16-autocast " in out and "bf16-amp" not in out  # one name for a precision everywhere
    assert "cost: the course's relative step time" in out
    # ZeRO-0 on 2 GPUs: DDP's buckets hold a flat fp32 copy of every gradient (4 B per parameter)
    code, r = run_json(capsys, *TINY, "--gpus", "2", "--zero", "0,3", "--gpu-memory", "1GB")
    params = r["model"]["parameters"]
    buckets = {p["zero_stage"]: p["ddp_buckets"] for p in r["plans"]}
    assert buckets[3] == 0 and 4 * params <= buckets[0] < 4 * params + 512 * 64  # rounded to the allocator's blocks
    assert "of which DDP's gradient buckets" in out


def test_device_lines_say_what_was_measured_on_which_gpu(capsys):
    _, r = run_json(capsys, *TINY, "--gpus", "2", "--gpu", "H200")
    h200 = {ln["name"]: ln["source"] for ln in r["plans"][-1]["lines"]}
    _, r = run_json(capsys, *TINY, "--gpus", "2", "--gpu", "A100-80GB")
    a100 = {ln["name"]: ln["source"] for ln in r["plans"][-1]["lines"]}
    assert "carried over" not in h200["CUDA context"] and "H200" in h200["CUDA context"]
    for line in ("CUDA context", "NCCL buffers"):
        assert "carried over from the H200" in a100[line] and "A100-80GB" in a100[line], a100[line]
    assert "for ampere: 8.125 MiB per handle" in a100["cuBLAS workspace"]
    assert not any("issue" in src for lines in (h200, a100) for src in lines.values())
    assert not any("issue" in src for _, _, src in db.GPUS.values())


def test_a_bad_model_is_reported_before_a_missing_gpu(capsys):
    code, out, err = run(capsys, "nosuch")
    assert code == 2 and "unknown model 'nosuch'" in err and "--gpu" not in err.split("(")[0]


def test_nothing_fits_exits_1_and_names_the_smallest_plan(capsys):
    code, out, _ = run(capsys, *TINY, "--gpu-memory", "100MB")
    assert code == 1 and "nothing fits 95.37 MiB per GPU; the smallest plan needs" in out


def test_conv_net_from_module_function_gets_a_cudnn_workspace_line(capsys, convmod):
    code, r = run_json(capsys, f"{convmod}:convnet", "--input-shape", "3,32,32", "--batch", "4",
                       "--precision", "fp32", "--micro-batches", "1", "--gpu", "L4")
    lines = {ln["name"]: ln["bytes"] for ln in r["plans"][0]["lines"]}
    largest = 4 * 16 * 16 * 16 * 4  # the stem's fp32 output (4x16x16x16) is larger than its 4x3x32x32 input
    # traced inside each convolution (planner.accounting.cudnn_workspace); this net's peak falls inside the stem's
    ws = int(CUDNN_WORKSPACE_FRACTION * largest) + CUDNN_WORKSPACE_EXTRA
    assert lines["cuDNN conv workspace"] == -(-ws // 512) * 512  # a block of the allocator
    assert lines["cuBLAS workspace"] == 2 * db.CUBLAS_WORKSPACE["other"]  # an L4 is not Hopper; two handles
    assert r["batch"]["shapes"] == [[4, 3, 32, 32], [4]]


def test_a_model_without_blocks_is_planned_without_checkpointing(capsys, convmod):
    code, r = run_json(capsys, f"{convmod}:flat", "--input-shape", "3,2,2", "--micro-batches", "1", "--gpu", "L4")
    assert code == 0 and r["traces"] == 1 and [p["checkpointing"] for p in r["plans"]] == [False]


@pytest.mark.parametrize("argv, message", [
    (["nosuch", "--gpu", "L4"], "unknown model 'nosuch': give a built-in name (tiny"),
    (["tiny", "--gpu-memory", "80"], "memory size '80' needs a unit"),
    (["tiny", "--batch", "6", "--micro-batches", "4", "--gpu", "L4"], "--micro-batches 4 does not divide --batch 6"),
    (["tiny", "--gpu", "X100"], "unknown GPU 'X100'"),
    (["tiny"], "give the GPU: --gpu NAME"),
    (["tiny", "--precision", "fp8", "--gpu", "L4"], "--precision 'fp8'"),
    (["tiny", "--zero", "4", "--gpu", "L4"], "--zero '4'"),
    (["tiny", "--batch", "-1", "--gpu", "L4"], "--batch and --seq must be >= 1"),
    (["tiny", "--seq", "-5", "--gpu", "L4"], "--batch and --seq must be >= 1"),
    (["tiny", "--jobs", "-2", "--gpu", "L4"], "--jobs -2: a process count >= 1"),
    (["missing/config.json", "--gpu", "L4"], "missing/config.json: no such file or directory"),
    (["{m}:broken", "--input-shape", "3,8,8", "--gpu", "L4"], "{m}:broken raised RuntimeError: weights missing"),
    (["{m}:not_a_module", "--input-shape", "3,8,8", "--gpu", "L4"], "returned int; it must return an nn.Module"),
    (["{m}:nope", "--gpu", "L4"], "has no function 'nope'"),
    (["{m}:flat", "--input-shape", "12", "--checkpointing", "on", "--gpu", "L4"], "no nn.ModuleList of blocks"),
    (["{m}:convnet", "--gpu", "L4"], "give the input shape of one sample"),
    (["{m}:convnet", "--input-shape", "3,32", "--gpu", "L4"], "failed: RuntimeError"),
])
def test_bad_input_is_one_line_on_stderr_and_exit_2(capsys, convmod, argv, message):
    code, out, err = run(capsys, *[a.format(m=convmod) for a in argv])
    assert code == 2 and not out
    assert err.count("\n") == 1 and err.startswith("mgpu-plan: error: ") and "Traceback" not in err
    assert message.format(m=convmod) in err


def test_a_malformed_option_is_one_line_too(capsys):
    with pytest.raises(SystemExit) as e:
        main(["tiny", "--batch", "four", "--gpu", "L4"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "--batch: invalid int value: 'four'" in err


def test_transformers_missing_names_the_extra(capsys, tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    code, _, err = run(capsys, str(tmp_path), "--gpu", "L4")
    assert code == 2 and 'pip install "mgpu-helpers[hf]"' in err


# --- Hugging Face configs (transformers is in the dev extra; skipped cleanly without it) ----------------

LLAMA = {"model_type": "llama", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 172,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "torch_dtype": "bfloat16",
         "tie_word_embeddings": False}


def test_hugging_face_config_plans_the_real_model(capsys, tmp_path):
    transformers = pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    code, r = run_json(capsys, str(tmp_path), "--batch", "2", "--seq", "32", "--precision", "fp32",
                       "--micro-batches", "1", "--gpu", "L4")
    real = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**LLAMA),
                                                         dtype=torch.float32)
    n = sum(p.numel() for p in real.parameters())
    assert code == 0 and r["model"]["parameters"] == n and r["model"]["kind"] == "hugging face"
    # fp32 Adam: parameters, gradients and two moments are alive at the step's peak at least
    assert r["plans"][0]["tensor_peak"] >= 16 * n
    assert {p["checkpointing"] for p in r["plans"]} == {False, True}  # the decoder layers are checkpointable


def test_config_transformers_cannot_build_is_one_line(capsys, tmp_path):
    """An unknown model_type names the closest ones; what transformers does is not blamed on it."""
    pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "lamma"}))
    code, _, err = run(capsys, str(tmp_path / "config.json"), "--gpu", "L4")
    assert code == 2 and "model_type 'lamma' is not one transformers" in err and "closest: llama" in err
    assert err.count("\n") == 1 and "cannot" not in err
    (tmp_path / "config.json").write_text("{not json")
    code, _, err = run(capsys, str(tmp_path), "--gpu", "L4")
    assert code == 2 and "not a readable JSON config" in err


def test_a_config_is_read_as_autoconfig_from_pretrained_reads_it(tmp_path):
    """Special floats (Infinity) and sub-configs decoded as transformers decodes them."""
    transformers = pytest.importorskip("transformers")
    from mgpu_helpers.tools.plan_sources.hf import read_config
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba2", "time_step_limit": [0.0, float("inf")]}))
    _, cfg = read_config(tmp_path)
    assert cfg == transformers.AutoConfig.from_pretrained(str(tmp_path)) and cfg.time_step_limit[1] == float("inf")


def test_the_hugging_face_step_is_the_users_own(capsys, tmp_path):
    """model(input_ids=x, labels=x).loss, the model's own checkpointing, AdamW, transformers' attention: said in
    the output; its fp32 upcast of the logits (ForCausalLMLoss) is in the bf16 plan."""
    pytest.importorskip("transformers")
    cfg = dict(LLAMA, vocab_size=32000)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    args = [str(tmp_path), "--batch", "2", "--seq", "64", "--micro-batches", "1", "--gpu", "L4", "--zero", "0"]
    _, r = run_json(capsys, *args, "--precision", "bf16-autocast")
    assert "labels=x" in r["step"] and "gradient_checkpointing_enable" in r["step"] and r["optimizer"] == "adamw"
    assert "attention: sdpa (transformers' default for llama)" in r["step"]
    assert {p["checkpointing"] for p in r["plans"]} == {False, True} and r["assumptions"] == [UNPADDED]
    # the model's own loss keeps an fp32 copy of the bf16 logits alive beside them: >= 6 B per logit
    logits = 2 * 64 * 32000
    peak = max(p["tensor_peak"] for p in r["plans"] if not p["checkpointing"])
    _, eager = run_json(capsys, *args, "--precision", "bf16-autocast", "--attn", "eager")
    assert "attention: eager" in eager["step"]
    code, _, err = run(capsys, *args, "--precision", "fp32", "--attn", "flash_attention_2")
    assert code == 2 and "fp16/bf16 only" in err
    assert peak > 6 * logits


def test_mixture_of_experts_is_planned_under_a_stated_routing(capsys, tmp_path):
    """Experts as transformers runs them (one grouped matmul) on fake tensors, stderr quiet; the routing
    assumption in the output; --moe-imbalance changes it."""
    pytest.importorskip("transformers")
    cfg = dict(LLAMA, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    args = [str(tmp_path), "--batch", "2", "--seq", "32", "--micro-batches", "1", "--gpu", "L4", "--zero", "0"]
    for precision in ("fp32", "bf16-autocast"):
        code, out, err = run(capsys, *args, "--precision", precision, "--json")
        assert code == 0 and err == "", err
        assert "evenly" in json.loads(out)["assumptions"][1]
    _, r = run_json(capsys, *args, "--moe-imbalance", "4")
    assert "4x the even share" in r["assumptions"][1]
    code, _, err = run(capsys, *args, "--moe-imbalance", "0.5")
    assert code == 2 and "--moe-imbalance 0.5" in err


def test_data_dependent_ops_get_representative_values():
    """.item() and nonzero on fake tensors: stated values, never a refusal; counts per expert add up."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from mgpu_helpers.planner.dynamic import DynamicSizes
    with DynamicSizes(moe_imbalance=3) as mode, FakeTensorMode():
        mode.tokens, mode.seq, mode.moe = 64, 32, (4, 2)
        counts = torch.zeros(64, 4, dtype=torch.long).sum(0).tolist()
        assert counts == [64, 22, 21, 21] and sum(counts) == 64 * 2
        assert torch.zeros(5, 3).nonzero().shape == (15, 2)              # every element: the largest output
        assert torch.zeros(2, 64, dtype=torch.bool).nonzero().shape[0] == 64  # one expert's share
        assert torch.zeros(3, dtype=torch.long).max().item() == 32       # a length: the sequence
        mask = torch.zeros(4, 32, dtype=torch.long)                       # the planned batch: no padding
        assert (mask == 1).all().item() is True and bool(mask.all(dim=-1).all()) is True
        assert (mask == 0).any().item() is False and bool((mask > 3).any()) is False
        assert bool((mask == 1)[0, 0]) is False                            # any other boolean


def test_console_script_declared():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["mgpu-plan"] == "mgpu_helpers.tools.plan_cli:main"
    assert any(d.startswith("transformers") for d in project["optional-dependencies"]["hf"])


def test_traces_in_worker_processes_give_the_same_plans(capsys, convmod):
    """--jobs 2: each (precision, checkpointing, micro-batches) traced in its own process (what mgpu-plan does
    for models of >= 1B parameters) gives the plans one process gives; a worker's failure is one line."""
    argv = [*TINY[:3], "--seq", "64", "--checkpointing", "both", "--micro-batches", "1", "--gpu", "L4"]
    _, one = run_json(capsys, *argv, "--jobs", "1")
    _, two = run_json(capsys, *argv, "--jobs", "2")
    assert one["traces"] == two["traces"] == 2 and one["plans"] == two["plans"]
    code, out, err = run(capsys, f"{convmod}:broken", "--input-shape", "3,8,8", "--gpu", "L4",
                         "--checkpointing", "both", "--jobs", "2")
    assert code == 2 and err.strip().count("\n") == 0 and "weights missing" in err


def test_zero3_rows_keep_the_libraries_warnings_off_stderr(capsys, tmp_path):
    """ZeRO-3 on several GPUs traces the step again under FSDP2, and transformers' gradient_checkpointing_enable
    warns there: the user's stderr gets nothing from it (it did, once per plan)."""
    pytest.importorskip("transformers")
    import warnings
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        code, out, err = run(capsys, str(tmp_path), "--batch", "2", "--seq", "32", "--gpus", "2", "--zero", "3",
                             "--micro-batches", "1", "--checkpointing", "on", "--gpu", "L4")
    assert code == 0 and err == "" and not [w for w in seen if "transformers" in w.filename], \
        [str(w.message)[:80] for w in seen]


def test_a_gpu_without_native_bf16_plans_fp16_unless_bf16_is_asked_for(capsys):
    # T4 and V100 (compute capability < 8.0): the default is fp16-autocast, and bf16 only when asked, with a note
    _, r = run_json(capsys, *TINY, "--gpus", "1", "--gpu", "T4-16GB", "--zero", "0")
    assert {p["precision"] for p in r["plans"]} == {"fp16-autocast"} and r["gpu"]["notes"] == []
    code, out, _ = run(capsys, *TINY, "--gpus", "1", "--gpu", "V100-16GB", "--zero", "0", "--precision", "bf16-autocast")
    assert code == 0 and "note: V100-16GB (volta) has no native bf16: its bf16 rows run emulated" in out
    _, r = run_json(capsys, *TINY, "--gpus", "1", "--gpu", "L4", "--zero", "0")
    assert {p["precision"] for p in r["plans"]} == {"bf16-autocast"} and r["gpu"]["notes"] == []
