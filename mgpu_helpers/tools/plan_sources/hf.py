"""A Hugging Face config as ``mgpu-plan`` plans it: the step its users run, not the course's.

:class:`UserStep` is ``model(input_ids=x, labels=x).loss`` (the model's own loss, which upcasts the logits to
fp32), with the model's own ``gradient_checkpointing_enable()``, AdamW and the attention transformers picks.
"""

import contextlib
import difflib
import json
import sys
from pathlib import Path
from unittest import mock

import torch
from torch import nn

from .base import PlanInputError, Source, first_line

ATTENTION = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")
# flash-attention kernels keep what torch's own flash kernel keeps (output, one log-sum-exp per row, the
# inputs): planned as SDPA's flash kernel, which takes fp16/bf16 only, as flash-attention does
_FLASH = ("flash_attention_2", "flash_attention_3")


def read_config(path: Path):
    """``(transformers, config)``: the config as ``AutoConfig.from_pretrained`` reads it (special floats such
    as ``Infinity`` decoded, sub-configs built), with one line naming what to fix when it cannot."""
    try:
        import transformers
    except ImportError:
        raise PlanInputError("a Hugging Face config needs transformers: pip install \"mgpu-helpers[hf]\" "
                             "(or pip install transformers)") from None
    transformers.logging.set_verbosity_error()  # its advice on loading weights is not the plan's output
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise PlanInputError(f"{path}: no config.json in this directory")
    try:
        d = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise PlanInputError(f"{file}: not a readable JSON config ({e})") from None
    if not isinstance(d, dict) or "model_type" not in d:
        raise PlanInputError(f"{file}: a Hugging Face config.json has a \"model_type\" (e.g. \"llama\")")
    if d["model_type"] not in transformers.CONFIG_MAPPING:
        close = difflib.get_close_matches(str(d["model_type"]), list(transformers.CONFIG_MAPPING), n=3, cutoff=0.6)
        raise PlanInputError(f"{file}: model_type {d['model_type']!r} is not one transformers "
                             f"{transformers.__version__} knows" + (f" (closest: {', '.join(close)})" if close else
                                                                    "; upgrade transformers if it is newer"))
    try:
        return transformers, transformers.AutoConfig.from_pretrained(str(file))
    except Exception as e:  # noqa: BLE001 - the family's own validation: its message says what is wrong
        raise PlanInputError(f"{file}: this {d['model_type']} config is inconsistent: {type(e).__name__}: "
                             f"{first_line(e)}") from None


class UserStep(nn.Module):
    """``model(input_ids=x, labels=x).loss``: the model's own loss, the logits dropped with the output."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        from mgpu_helpers.planner.dynamic import active
        mode = active()
        if mode is not None:  # representative values for data-dependent ops: this step's tokens and experts
            mode.tokens, mode.seq, mode.moe = input_ids.numel(), input_ids.shape[-1], _experts(self.model.config)
        with _one_sequence_per_row():
            # as users call it: no use_cache=False, so a family that fills its cache in training (the states of
            # Mamba's mixers, attention's keys and values) holds it until the output is dropped
            return self.model(input_ids=input_ids, labels=input_ids).loss

    def gradient_checkpointing_enable(self):
        """transformers' own checkpointing, recomputing under the forward's kernels (``planner.cuda``)."""
        from mgpu_helpers.planner.cuda import recompute_contexts
        if not getattr(self.model, "supports_gradient_checkpointing", False):
            raise ValueError(f"checkpointing: {type(self.model).__name__} does not support "
                             "gradient_checkpointing_enable(): nothing to checkpoint")
        self.model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": recompute_contexts})


@contextlib.contextmanager
def _one_sequence_per_row():
    """transformers' mask code answers on fake tensors as on the planner's real tokens (one unpadded sequence per
    row: no packed sequences, a padding mask of all ones, not a traced graph); else, reading values a fake tensor
    lacks, it builds a (batch, 1, seq, seq) mask, and attention expands grouped key/value heads, skips is_causal."""
    masking = sys.modules.get("transformers.masking_utils")
    is_tracing = getattr(masking, "is_tracing", None)
    patches = {"find_packed_sequence_indices": lambda *args, **kwargs: None,
               "fast_all": lambda tensor: True,  # every padding mask of the planned batch is all ones
               # compiling, exporting or capturing still count; a fake tensor alone does not
               "is_tracing": lambda tensor=None: is_tracing(None)}
    patches = {k: v for k, v in patches.items() if hasattr(masking, k)}  # older transformers lack some
    with mock.patch.multiple(masking, **patches) if patches else contextlib.nullcontext():
        yield


UNPADDED = ("every row of the batch is one sequence of --seq tokens (no padding, no packed sequences): "
            "transformers then gives attention no mask; a padded batch adds a (batch, 1, seq, seq) mask")


def _experts(cfg):
    """(experts, experts per token) of a mixture-of-experts config, else None."""
    text = cfg.get_text_config()
    for k in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "ffn_num_experts"):
        v = getattr(text, k, None)
        if isinstance(v, int) and v > 1:
            top_k = next((getattr(text, n) for n in ("num_experts_per_tok", "top_k", "moe_topk", "moe_k")
                          if isinstance(getattr(text, n, None), int)), 1)
            return v, top_k
    return None


def hf_source(path: Path, attn: str | None = None, moe_imbalance: float = 1.0) -> Source:
    transformers, cfg = read_config(path)
    build_attn = "sdpa" if attn in _FLASH else attn  # planned as SDPA's flash kernel (planner.cuda)

    def model_fn():
        kwargs = {"attn_implementation": build_attn} if build_attn else {}
        try:  # fp32 weights (the planner's precisions cast); the attention transformers picks unless --attn
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, **kwargs)
        except (ValueError, ImportError) as e:  # an implementation this family does not offer
            if build_attn:
                raise PlanInputError(f"--attn {attn}: {cfg.model_type} cannot use it: {first_line(e)}") from None
            raise PlanInputError(f"{path}: {type(e).__name__}: {first_line(e)}") from None
        model.train()  # a training step: dropout on, checkpointing active (transformers' models check it)
        return UserStep(model)
    model_fn.flash = attn in _FLASH
    # what from_config picks without attn_implementation: sdpa where the family supports it, else eager
    cls = transformers.MODEL_FOR_CAUSAL_LM_MAPPING.get(type(cfg), None)
    default = "the one it picks" if cls is None else "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"
    picked = attn or f"{default} (transformers' default for {cfg.model_type})"
    step = (f"the model's own loss, model(input_ids=x, labels=x).loss; its own gradient_checkpointing_enable(); "
            f"AdamW; attention: {picked}" + (" (planned as torch's flash kernel)" if attn in _FLASH else ""))
    assumptions = [UNPADDED]
    experts = _experts(cfg)
    if experts:
        assumptions.append(
            f"mixture of experts ({experts[0]} experts, {experts[1]} per token): transformers' grouped matmul "
            "holds every (token, expert) row whatever the routing; where a family loops over experts, tokens are "
            + ("spread evenly over the experts" if moe_imbalance == 1 else
               f"routed {moe_imbalance:g}x the even share to the busiest expert, the others sharing the rest "
               "(--moe-imbalance)"))
    return Source(f"{path} ({cfg.model_type})", "hugging face", model_fn, "tokens", step=step,
                  optimizer="adamw", assumptions=assumptions)
