"""Every causal-LM family the installed transformers offers, as a tiny config: what ``mgpu-plan`` is held
against (tests/test_plan_catalogue.py). :func:`tiny_config` shrinks the family's own defaults field by field
name, keeping what makes the family (grouped heads, sliding windows, layer patterns, shared experts); nothing is
downloaded. A family that fails transformers' own CPU step (:func:`trains`) is skipped, not blamed on the planner.
"""

import contextlib
import io
import tempfile
from collections import Counter

import torch

from .base import first_line, quiet

WIDTH, LAYERS, HEADS, FFN, EXPERT_FFN, EXPERTS, TOP_K, VOCAB, HEAD_DIM = 64, 2, 4, 128, 32, 4, 2, 1024, 16

# field name -> tiny value: the names the installed transformers' causal-LM families use
_SIZES = {
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "embed_dim", "word_embed_proj_dim", "embedding_size",
                     "emb_dim"), WIDTH),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "encoder_layers",
                     "num_decoder_layers", "num_encoder_layers"), LAYERS),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "num_heads", "decoder_attention_heads",
                     "encoder_attention_heads"), HEADS),
    **dict.fromkeys(("head_dim", "attention_head_dim", "kv_channels", "v_head_dim", "d_head", "mamba_d_head",
                     "linear_key_head_dim", "linear_value_head_dim", "swa_head_dim"), HEAD_DIM),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "n_inner", "decoder_ffn_dim", "encoder_ffn_dim",
                     "ffn_hidden_size", "d_ff", "dense_intermediate_size"), FFN),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size", "shared_intermediate_size",
                     "moe_shared_expert_intermediate_size"), EXPERT_FFN),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), EXPERTS),
    **dict.fromkeys(("q_lora_rank", "kv_lora_rank"), 32),
    **dict.fromkeys(("qk_rope_head_dim", "qk_nope_head_dim"), HEAD_DIM),  # DeepSeek's head_dim is the rope part
    # hybrids: an attention layer among the first few (Jamba's every 8th from the 4th; Bamba's by index)
    "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1,
    "attn_layer_indices": [1], "vocab_size": VOCAB,
}
_AT_MOST = {**dict.fromkeys(("num_experts_per_tok", "moe_topk", "moe_k", "num_experts_per_token", "n_shared_experts",
                             "num_shared_experts", "moe_num_shared_experts"), TOP_K),
            **dict.fromkeys(("n_group", "topk_group"), 1),
            **dict.fromkeys(("sliding_window", "window_size"), 16),
            **dict.fromkeys(("first_k_dense_replace", "num_dense_layers", "max_window_layers"), 1)}
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "linear_num_key_heads", "linear_num_value_heads")


def _shrink(d: dict) -> dict:
    heads = next((d[k] for k in ("num_attention_heads", "n_head", "num_heads") if isinstance(d.get(k), int)), None)
    out = {}
    for k, v in d.items():
        if k == "per_layer_config" and isinstance(v, dict):  # overrides of layers beyond the tiny depth: gone
            out[k] = {i: c for i, c in v.items() if int(i) < LAYERS}
        elif isinstance(v, dict) and k not in ("rope_parameters", "rope_scaling", "id2label", "label2id"):
            out[k] = _shrink(v)
        elif v is None and k in _UNSET:  # the released checkpoints set it; the bare default leaves it None
            out[k] = _UNSET[k]
        elif k == "is_decoder":  # a causal LM is a decoder (BERT-like and Reformer families ask for it)
            out[k] = True
        elif isinstance(v, bool) or v is None:
            out[k] = v
        elif k in ("rotary_dim", "rotary_emb_base_dim") and isinstance(v, int):
            out[k] = min(v, HEAD_DIM // 2)
        elif k == "attention_types" and isinstance(v, list):  # GPT-Neo: [[["global", "local"], 12]]
            out[k] = [[v[0][0], 1]]
        elif k in _SIZES and (isinstance(v, int) or isinstance(_SIZES[k], list)):
            out[k] = _SIZES[k]
        elif k in _AT_MOST and isinstance(v, int) and v > 0:
            out[k] = min(v, _AT_MOST[k])
        elif k in _KV_HEADS and isinstance(v, int):  # keep the family's grouping: MHA stays MHA, MQA MQA
            out[k] = HEADS if heads is not None and v >= heads else (1 if v == 1 else 2)
        elif k.endswith("_token_id") and isinstance(v, int) and v >= VOCAB - 8:
            out[k] = VOCAB - 8 + (hash(k) % 8)
        elif k.endswith("_token_id") and isinstance(v, list):
            out[k] = [t if t < VOCAB - 8 else VOCAB - 1 for t in v if isinstance(t, int)]
        else:
            out[k] = v
    width = out.get("hidden_size", WIDTH)  # Mamba-2 mixers need heads x head size = expand x width (their validation)
    for heads, size, expand in (("mamba_n_heads", "mamba_d_head", "mamba_expand"), ("num_heads", "head_dim", "expand"),
                                ("mamba_num_heads", "mamba_head_dim", "mamba_expand")):
        if isinstance(out.get(heads), int) and isinstance(out.get(size), int) and isinstance(out.get(expand), int) \
                and any(k in out for k in ("ssm_state_size", "state_size", "mamba_d_state")):
            out[heads] = max(1, out[expand] * width // out[size])
            if "mamba_d_ssm" in out:  # Falcon-H1's inner width, when given
                out["mamba_d_ssm"] = out[heads] * out[size]
    return out


_UNSET = {"attn_layer_indices": [1], "head_dim": HEAD_DIM, "num_experts_per_tok": TOP_K, "n_routed_experts": EXPERTS}


def tiny_config(model_type: str):
    """The family's default config, shrunk: a model of a few hundred thousand parameters."""
    from transformers import CONFIG_MAPPING
    cls = CONFIG_MAPPING[model_type]
    full = cls().to_dict()
    d = _shrink(full)
    subs = [d, *[v for v in d.values() if isinstance(v, dict)]]
    # hybrids (attention every k-th layer, Mamba between): enough layers for one of each kind, in order
    layers = max(LAYERS, len({str(t) for sub in subs for k in ("layer_types", "layers_block_type", "block_types")
                              if isinstance(sub.get(k), list) for t in sub[k]}))
    for sub in subs:
        for k in ("layer_types", "layers_block_type", "block_types", "hybrid_override_pattern"):
            if isinstance(sub.get(k), list) and sub[k]:
                kinds = list(dict.fromkeys(sub[k]))
                sub[k] = (kinds * layers)[:max(layers, len(kinds))]
                sub.update({n: len(sub[k]) for n in ("num_hidden_layers", "num_layers", "n_layer") if n in sub})
    return cls(**_changed(d, full))  # only what shrinking changed: the family's __init__ derives the rest


def _changed(new: dict, old: dict) -> dict:
    out = {}
    for k, v in new.items():
        if isinstance(v, dict) and isinstance(old.get(k), dict) and k not in ("rope_parameters",):
            sub = _changed(v, old[k])
            if sub:
                out[k] = sub
        elif v != old.get(k):
            out[k] = v
    return out


def trains(cfg, checkpointing: bool = False) -> str | None:
    """transformers' own CPU step (its own checkpointing if ``checkpointing``): None if it trains, else why not."""
    from transformers import AutoModelForCausalLM
    try:
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable()
        vocab = int(getattr(cfg.get_text_config(), "vocab_size", VOCAB) or VOCAB)
        x = torch.randint(0, min(VOCAB, vocab) - 8, (2, 32))
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        return None if torch.isfinite(loss) else f"no finite loss ({loss})"
    except Exception as e:  # noqa: BLE001 - what transformers raises is the reason the family is skipped
        return f"{type(e).__name__}: {first_line(e)}"


def causal_lm_types() -> list:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


# --- the catalogue, planned: each family ends as planned, skipped (no tiny config, or transformers' own CPU
# step fails on it) or a planner failure by kind (failure_class) ------------------------------------------
PLAN_ARGS = ["--batch", "1", "--seq", "32", "--micro-batches", "1", "--precision", "bf16-autocast",
             "--zero", "0", "--gpus", "1", "--gpu", "H200", "--jobs", "1", "--json"]


def plan_family(model_type: str, checkpointing: str = "on") -> dict:
    """``mgpu-plan`` on the family's tiny config, as a user would run it: its class, its one stderr line.
    Checkpointing on by default (one trace: the forward, the recomputation and the backward); a family whose
    own ``gradient_checkpointing_enable()`` fails in transformers' CPU step is planned without it."""
    try:
        with quiet():  # transformers' notes on a tiny config (special tokens, unused fields) are not the plan's
            cfg = tiny_config(model_type)
    except Exception as e:  # noqa: BLE001 - the shrinking failed, not transformers nor the planner
        return dict(type=model_type, result="skipped: no tiny config", message=f"{type(e).__name__}: {e}"[:300])
    with quiet():
        why = trains(cfg)
    if why:
        return dict(type=model_type, result="skipped: transformers' own CPU step fails on the tiny config", message=why)
    with tempfile.TemporaryDirectory() as tmp:
        cfg.save_pretrained(tmp)
        r = _plan_dir(model_type, tmp, checkpointing)
        if r["result"] == "failed: checkpointing" and checkpointing != "off":
            with quiet():  # no checkpointing offered by the family, or transformers' own fails on a CPU
                own = "not offered" if "does not support" in r["message"] else trains(cfg, checkpointing=True)
            if own:  # transformers' own checkpointing fails too: the family is planned without it
                r = _plan_dir(model_type, tmp, "off")
                r["note"] = "checkpointing not planned: " + (
                    "transformers offers none for this family" if own == "not offered" else
                    f"transformers' own fails on a CPU ({own})")
    return r


def _plan_dir(model_type, directory, checkpointing):
    from mgpu_helpers.tools.plan_cli import main
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main([directory, *PLAN_ARGS, "--checkpointing", checkpointing])
    text = err.getvalue().strip()
    return dict(type=model_type, result="planned" if code in (0, 1) else failure_class(text), message=text[-400:],
                stderr_lines=len(text.splitlines()))


def failure_class(message: str) -> str:
    """The kinds of failure the catalogue counts (before/after a planner change, as a table)."""
    kinds = {"MoE grouped matmul": ("BF16 type", "grouped_mm"),
             "data-dependent": ("DataDependent", "DynamicOutputShape"),
             "attention implementation": ("attn_implementation", "sdpa", "scaled_dot_product_attention"),
             "checkpointing": ("checkpointing True", "gradient_checkpointing_enable")}
    return next((f"failed: {k}" for k, needles in kinds.items() if any(n in message for n in needles)), "failed: other")


def plan_catalogue(workers: int = 2) -> list:
    """Every family planned, ``workers`` processes at once (``plan_cli.process_pool``)."""
    from mgpu_helpers.tools.plan_cli import process_pool
    with process_pool(workers) as pool:
        return list(pool.map(plan_family, causal_lm_types(), chunksize=4))


def counts(results) -> dict:
    return dict(Counter(r["result"] for r in results).most_common())
