"""Notebook 12's helpers: the collective log, the profiler's peak, the knobs' bytes, meta-device init, the
overlap arithmetic and traces; the released notebook runs past its unsolved exercises; the lesson's own
``shard`` is refused as 12.1's answer; meta-device init equals one process's; the planner's int
``reshard_after_forward``; the closing section's recipe on a Hugging Face Llama."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mgpu_helpers import fsdp_practice as fp
from mgpu_helpers.fsdp_practice.init import meta_init
from mgpu_helpers.fsdp_practice.timeline import overlap, summarize, trace
from mgpu_helpers.runtime.launch import run_ranks
from mgpu_helpers.runtime.fake_world import fake_world

ROOT = Path(__file__).resolve().parent.parent
SMALL = {"d": 32, "blocks": 3, "d_in": 8, "classes": 4}


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_profiled_peak_counts_exact_bytes_and_phases():
    from torch.profiler import record_function
    with fp.profiled_peak(baseline=100) as r:
        with record_function("## forward ##"):
            a = torch.empty(1000)                 # 4000 bytes
            b = torch.empty(500)                  # 2000 bytes
            del a
        with record_function("## backward ##"):
            c = torch.empty(250)                  # 1000 bytes
            del b, c
    assert r["peak"] == 100 + 6000
    assert r["phases"] == {"forward": 100 + 6000, "backward": 100 + 3000}
    assert r["end"] == 100


def test_mixed_precision_policy_gathers_bf16_and_reduces_fp32():
    with fake_world(2):
        fp32 = fp.measure(0, 2, {}, SMALL, categories=False)
        mp = fp.measure(0, 2, {"precision": "mp_policy"}, SMALL, categories=False)
        ac = fp.measure(0, 2, {"precision": "autocast"}, SMALL, categories=False)
    assert set(fp32["comm"]) == {"all_gather float32", "reduce_scatter float32"}
    assert set(mp["comm"]) == {"all_gather bfloat16", "reduce_scatter float32"}
    assert ac["comm"] == fp32["comm"]             # autocast changes nothing on the wire
    assert 2 * mp["comm"]["all_gather bfloat16"]["bytes_out"] == fp32["comm"]["all_gather float32"]["bytes_out"]
    assert mp["comm"]["reduce_scatter float32"] == fp32["comm"]["reduce_scatter float32"]
    assert mp["state"] == fp32["state"]           # fp32 master shards and optimizer state either way


def test_a_gpu_without_bf16_gathers_fp16_and_the_scaler_agrees_across_ranks(monkeypatch):
    """Where training_precision says fp16 + GradScaler (a T4), both 16-bit knobs follow it: MixedPrecisionPolicy
    gathers fp16, and torch.amp.GradScaler's inf check on DTensor gradients all-reduces one 4-byte found_inf per
    step (DTensor's found_inf_reduce_handler), which fp32 does not."""
    from mgpu_helpers.fsdp_practice import init, knobs
    from mgpu_helpers.runtime.precision import Precision
    for module in (knobs, init):
        monkeypatch.setattr(module, "training_precision", lambda device: Precision("cpu", torch.float16, True, "a T4"))
    with fake_world(2):
        fp32, mp, ac = (fp.measure(0, 2, k, SMALL, categories=False)["comm"]
                        for k in ({}, {"precision": "mp_policy"}, {"precision": "autocast"}))
        saved = fp.saved_for_backward(0, 2, "autocast", rows=8, model_kw=SMALL)
    assert "all_gather float16" in mp and "all_gather float32" in ac and "float16" in saved and "bfloat16" not in saved
    assert mp["all_reduce float32"] == ac["all_reduce float32"] == {"calls": 1, "bytes_in": 4, "bytes_out": 4}
    assert "all_reduce float32" not in fp32


def test_reshard_after_forward_trades_memory_for_all_gathers():
    rows = {r["reshard_after_forward"]: r for r in fp.sweep(2, [{"reshard_after_forward": True},
                                                                {"reshard_after_forward": False}], SMALL)}
    with fake_world(2):
        calls = {rf: fp.measure(0, 2, {"reshard_after_forward": rf}, SMALL, categories=False)["comm"]
                 ["all_gather float32"]["calls"] for rf in (True, False)}
    blocks = SMALL["blocks"]
    assert calls == {True: 2 * blocks + 1, False: blocks + 1}   # + the root's one all-gather
    assert rows[True]["gathered"] > rows[False]["gathered"]
    assert rows[True]["peak"] < rows[False]["peak"]


def test_sweep_is_repeatable_and_matches_real_ranks_bytes():
    grid = [{"reshard_after_forward": True, "prefetch": 1}]
    once, again = fp.sweep(2, grid, SMALL), fp.sweep(2, grid, SMALL)
    assert once == again
    real = run_ranks(lambda r, w: fp.measure(r, w, grid[0], SMALL, categories=False), 2)
    assert real[0]["gathered"] == once[0]["gathered"]     # the bytes moved do not depend on the process group
    assert real[0]["comm"] == real[1]["comm"]


def test_bad_knobs_raise_one_clear_error():
    with pytest.raises(ValueError, match="prefetch"):
        fp.shard(fp.make_model(**SMALL), mesh=object(), prefetch=-1)
    with fake_world(2):
        with pytest.raises(ValueError, match="known are"):
            fp.build({"reshard": True}, SMALL)
        with pytest.raises(ValueError, match="known are"):
            fp.build({"precision": "fp16"}, SMALL)


def test_meta_init_never_holds_the_whole_model():
    with fake_world(2):
        mi = meta_init(0, 2, SMALL)
    assert mi["on_meta"] == 0 and mi["finite"]
    assert mi["built_then_sharded"] >= mi["whole_model"]
    # init_weights draws one module's whole tensors at a time (the largest: a Linear(d, 2d)), never the model's,
    # and keeps the caller's generator state aside meanwhile (fork_rng: 5,056 bytes)
    largest = (SMALL["d"] * 2 * SMALL["d"] + 2 * SMALL["d"]) * 4
    assert mi["shard"] <= mi["meta_then_sharded"] <= mi["shard"] + largest + 8192 < mi["whole_model"]


def test_meta_init_on_gloo_equals_one_process_and_dtensor_rng_repeats_shards():
    """DTensor's RNG supports CUDA-like devices only: on a CPU mesh each rank draws the same local values
    (measured). init_weights draws what one process draws and keeps each rank's shard."""
    ours, dtensor = zip(*run_ranks(lambda r, w: (fp.meta_init_values(r, w, SMALL, seed=3),
                                                 fp.meta_init_values(r, w, SMALL, seed=3, dtensor_rng=True)), 2))
    assert all(o == {"equal_to_one_process": True, "shards_repeat": False} for o in ours)
    assert all(d["shards_repeat"] and not d["equal_to_one_process"] for d in dtensor)


def test_fused_adam_has_no_foreach_temporary():
    with fake_world(2):
        peaks = {o: fp.measure(0, 2, {"optimizer": o}, SMALL, categories=False)["phases"]["optimizer"]
                 for o in ("foreach", "fused")}
    assert peaks["fused"] < peaks["foreach"]


def test_overlap_arithmetic():
    assert overlap([(0, 10)], [(5, 15)]) == 0.5
    assert overlap([(0, 2), (4, 6)], [(1, 5)]) == 0.5
    assert overlap([(0, 1)], []) == 0.0
    assert overlap([(0, 10), (2, 3)], [(0, 10)]) == 1.0


@pytest.mark.slow
def test_traces_show_collectives_and_prefetch_order():
    def work(rank, world):
        return (trace(rank, world, "fsdp", {"rows": 16}, SMALL),
                trace(rank, world, "fsdp", {"rows": 16, "prefetch": 1, "async_unshard": True}, SMALL),
                trace(rank, world, "ddp", {"rows": 16}, SMALL))
    (implicit, prefetch, ddp), _ = run_ranks(work, 2, timeout=300)
    blocks = SMALL["blocks"]
    assert summarize([implicit])[0]["collectives"] == {"gloo:all_gather": 2 * blocks + 1,
                                                       "gloo:all_reduce": blocks + 1}
    assert implicit["forward_order"] == "m" + "Gmm" * blocks + "m"
    assert prefetch["forward_order"].startswith("mGGmm")      # block 1's all-gather before block 0 computes
    # every unit's reduce-scatter but the last (the root's) is issued while backward still computes
    assert implicit["reductions_before_last_backward_matmul"] == (blocks, blocks + 1)
    assert "gloo:all_reduce" in summarize([ddp])[0]["collectives"]
    assert 0.0 <= summarize([ddp])[0]["overlap"] <= 1.0


def test_the_lessons_own_shard_is_refused_as_an_answer_to_12_1():
    """Grading integrity: 12.1's answer is a call of fully_shard; ``fsdp_practice.shard`` makes the
    same call, so an answer that delegates to it is refused, not measured."""
    from mgpu_helpers.checks.fsdp_practice import check_12_1

    def shard_for_budget(model, mesh):
        return fp.shard(model, mesh, reshard_after_forward=2, prefetch=1)
    with pytest.raises(AssertionError, match="12.1"):
        check_12_1(shard_for_budget, seed=0)


def test_budgets_sit_between_rows():
    rows = fp.knob_sweep(4, fp.MODEL["blocks"])
    b = fp.budgets(rows)
    assert all(r["peak"] != b["memory"] and r["gathered"] != b["communication"] for r in rows)
    fit = [(r["reshard_after_forward"], r["prefetch"]) for r in rows
           if r["peak"] <= b["memory"] and r["gathered"] <= b["communication"]]
    assert fit == [(2, 0), (2, 1)], fit   # the exercise's answer is 2, with one block of forward prefetch


@pytest.mark.slow
def test_runs_under_torchrun():
    from testkit import run_torchrun
    out = run_torchrun("mgpu_helpers.fsdp_practice").stdout
    assert "rank 0 of 2" in out and "'precision': 'mp_policy'" in out and "gathered" in out


def test_planner_plans_these_knobs_to_the_byte_of_the_tracker():
    # the plan is the tracker's accounting of tensors; the profiler's peak also has what the CPU kernels
    # borrow (the bf16 -> fp32 copy of FSDP2's _chunk_cat under MixedPrecisionPolicy), which no plan promises
    from mgpu_helpers.fsdp_practice import plan_knobs
    for world, knobs in [(2, {}), (2, {"precision": "mp_policy"}), (3, {"reshard_after_forward": False}),
                         (4, {"reshard_after_forward": 2})]:
        planned = plan_knobs(world, knobs, SMALL).rank_peaks
        for rank in range(world):
            with fake_world(world, rank):
                measured = fp.measure(rank, world, knobs, SMALL)["tracker_peak"]
            assert planned[rank] == measured, (world, knobs, rank, planned[rank], measured)
    with pytest.raises(ValueError, match="an int that divides world_size=4, other than 1 and world_size"):
        plan_knobs(4, {"reshard_after_forward": 4})   # torch: a non-trivial divisor of the mesh's size


def _notebook_cell(cell_id):
    nb = json.loads((ROOT / "solutions" / "12_fsdp2_in_practice.ipynb").read_text())
    return "".join(next(c for c in nb["cells"] if c.get("id") == cell_id)["source"])


def _recipe_on_llama(tied):
    """The closing section's recipe (cell c12-43) on transformers' LlamaForCausalLM under a fake group of 2:
    apply_fsdp2, then one step of the user's loss. Returns (model, the cell's namespace) inside the group."""
    transformers = pytest.importorskip("transformers")
    ns = {"torch": torch}  # the notebook's first cell imported it
    exec(compile(_notebook_cell("c12-43"), "c12-43", "exec"), ns)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied)
    model = transformers.LlamaForCausalLM(cfg)
    ns["apply_fsdp2"](model, ns["init_device_mesh"]("cpu", (2,)))
    ids = torch.randint(0, 64, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    return model, ns


def test_on_real_gpus_recipe_shards_a_hugging_face_llama():
    """The closing section's apply_fsdp2 uses a Hugging Face causal LM's names (model.model.layers, lm_head tied
    to model.model.embed_tokens): run it on transformers' LlamaForCausalLM, as the notebook says."""
    from torch.distributed.fsdp import FSDPModule
    with fake_world(2):
        model, _ = _recipe_on_llama(tied=True)
    assert isinstance(model, FSDPModule) and all(isinstance(layer, FSDPModule) for layer in model.model.layers)
    assert model.lm_head.weight is model.model.embed_tokens.weight        # still one parameter, in the root's unit


def test_on_real_gpus_recipe_untied_is_torchtitans_layout():
    """Untied, apply_fsdp2 is torchtitan's apply_fsdp: the embedding a unit, each block, [norm, lm_head], the root."""
    from torch.distributed.fsdp import FSDPModule
    with fake_world(2):
        model, ns = _recipe_on_llama(tied=False)
        assert isinstance(model.model.embed_tokens, FSDPModule)
        assert model.model.norm._get_fsdp_state() is model.lm_head._get_fsdp_state()
        assert ns["units"](model) == 5


def test_accumulation_without_sync_holds_more_and_moves_less():
    """Skipping the sync (and the reshard after backward) until the last micro-batch: reduce-scatters only in
    the last one, fewer bytes on the wire, a higher peak; reduce-scattering every micro-batch: the reverse."""
    from mgpu_helpers.fsdp_practice import accumulation
    with fake_world(2):
        sync, nosync = (accumulation(0, 2, 3, sync_each=s) for s in (True, False))
    assert all(m.get("reduce_scatter") for m in sync["per_micro"])
    assert [bool(m.get("reduce_scatter")) for m in nosync["per_micro"]] == [False, False, True]
    assert nosync["peak"] > sync["peak"] and nosync["reduced"] * 3 == sync["reduced"]
    assert nosync["gathered"] < sync["gathered"]


def test_only_rank_0_calling_dcp_save_is_named_in_the_hint():
    """``if rank == 0: dcp.save(...)`` (collective, so the other ranks wait at the barrier until the launch
    times out, 60 s: not run here) reads as 12.2's hint says."""
    from mgpu_helpers.checks import REGISTRY
    import mgpu_helpers.checks.fsdp_practice  # noqa: F401  (registers 12.2)
    hint = REGISTRY["12.2"].hint(
        "RankTimeout: run_ranks: timed out after 60 s; rank(s) 0, 1 still running (killed)\n  rank 0 was waiting "
        "in all_gather (torch/distributed/distributed_c10d.py), called from transfer, line 19: if rank == 0: "
        "dcp.save(state, checkpoint_id=path)\n  rank 1 was waiting in barrier (torch/distributed/distributed_c10d.py)")
    assert "every rank calls them" in hint and "never only rank 0" in hint
