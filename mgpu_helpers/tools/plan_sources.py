"""Where ``mgpu-plan`` gets a model: a built-in name, a Hugging Face config, or ``module:function``.

Each source gives a :class:`Source`: a ``model_fn`` the planner calls under ``FakeTensorMode`` (so nothing
real is allocated: a 70B config builds in a second), the batch it takes (shapes and dtypes only), and a
loss. Any failure to resolve or build a source is a :class:`PlanInputError` with one line that says what
to fix; ``mgpu-plan`` prints it and exits 2.
"""
from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from mgpu_helpers.planner.models import SIZES, Decoder


class PlanInputError(Exception):
    """Bad input to ``mgpu-plan``: the message is the one line the user sees."""


@dataclass
class Source:
    name: str
    kind: str              # "built-in", "hugging face", "function"
    model_fn: object       # called with no arguments under a fake mode
    inputs: str            # "tokens" (long [B, T]) or "tensor" (float [B, *shape])
    vocab: int = 0


def output_loss(out, targets):
    """Cross-entropy of a model's logits: [B, C] with [B] or [B, T, V] with [B, T] (lm_loss's ops).
    Takes ``.logits`` or the first element when the model returns an object or a tuple."""
    if not isinstance(out, torch.Tensor):
        out = getattr(out, "logits", None) if not isinstance(out, (tuple, list)) else out[0]
    if not isinstance(out, torch.Tensor):
        raise PlanInputError("the model's output is not a tensor of logits (nor has .logits): give a "
                             "model_fn whose module returns logits")
    return F.cross_entropy(out.flatten(0, -2), targets.flatten())


class CausalLM(nn.Module):
    """A Hugging Face causal LM as the planner's step expects: tokens in, logits out, no KV cache."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        with _one_sequence_per_row():
            return self.model(input_ids=input_ids, use_cache=False).logits


@contextlib.contextmanager
def _one_sequence_per_row():
    """Tell transformers' mask code what a real step of the planner's batch finds: no packed sequences.

    It reads the position ids' values to find sequences packed into one row; a fake tensor has no values,
    so it assumes packing and builds a (batch, 1, seq, seq) mask, which makes attention expand grouped
    key/value heads and skip ``is_causal``. The real step of the same tokens finds one sequence per row and
    passes no mask (measured on the H200: the fake trace ran a fused kernel, the real step the math one)."""
    masking = sys.modules.get("transformers.masking_utils")
    original = getattr(masking, "find_packed_sequence_indices", None)
    if original is None:  # an older transformers without packed-sequence detection
        yield
        return
    masking.find_packed_sequence_indices = lambda *args, **kwargs: None
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = original


def _hf_config(path: Path):
    try:
        import transformers
    except ImportError:
        raise PlanInputError("a Hugging Face config needs transformers: pip install \"mgpu-helpers[hf]\" "
                             "(or pip install transformers)") from None
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise PlanInputError(f"{path}: no config.json in this directory")
    try:
        d = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise PlanInputError(f"{file}: not a readable JSON config ({e})") from None
    if not isinstance(d, dict) or "model_type" not in d:
        raise PlanInputError(f"{file}: a Hugging Face config.json has a \"model_type\" (e.g. \"llama\")")
    model_type = d.pop("model_type")
    try:
        cfg = transformers.AutoConfig.for_model(model_type, **d)
    except Exception as e:  # unknown model_type, inconsistent fields
        raise PlanInputError(f"{file}: transformers {transformers.__version__} cannot read this config: "
                             f"{type(e).__name__}: {_first_line(e)}") from None
    return transformers, cfg


def hf_source(path: Path) -> Source:
    transformers, cfg = _hf_config(path)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    vocab = int(getattr(text, "vocab_size", 0) or 0)

    def model_fn():
        try:  # fp32 weights (the planner's precisions cast); SDPA attention as training uses
            model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa",
                                                                  dtype=torch.float32)
        except Exception as e:
            raise PlanInputError(f"{path}: transformers cannot build a causal LM from this config: "
                                 f"{type(e).__name__}: {_first_line(e)}") from None
        return CausalLM(model)
    model_fn.__name__ = f"hf_{getattr(cfg, 'model_type', 'model')}"
    return Source(f"{path} ({cfg.model_type})", "hugging face", model_fn, "tokens", vocab)


def function_source(spec: str) -> Source:
    module_name, _, fn_name = spec.partition(":")
    if os.getcwd() not in sys.path:  # `mgpu-plan mymodels:build` finds ./mymodels.py, as python -m would
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise PlanInputError(f"cannot import {module_name!r} for {spec!r}: {type(e).__name__}: "
                             f"{_first_line(e)}") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise PlanInputError(f"{module_name!r} has no function {fn_name!r}")

    def model_fn():
        try:
            model = fn()
        except PlanInputError:
            raise
        except Exception as e:
            raise PlanInputError(f"{spec} raised {type(e).__name__}: {_first_line(e)}") from None
        if not isinstance(model, nn.Module):
            raise PlanInputError(f"{spec} returned {type(model).__name__}; it must return an nn.Module")
        return model
    model_fn.__name__ = fn_name
    return Source(spec, "function", model_fn, "tensor")


def builtin_source(name: str) -> Source:
    def model_fn():
        return Decoder(*SIZES[name])
    model_fn.__name__ = f"decoder_{name}"
    return Source(f"{name} (built-in Llama-shaped decoder)", "built-in", model_fn, "tokens", SIZES[name][0])


def resolve(spec: str) -> Source:
    """A model from what the user typed: an existing path (HF config), a built-in name, or module:function."""
    path = Path(spec)
    if path.exists():
        return hf_source(path)
    if spec in SIZES:
        return builtin_source(spec)
    if ":" in spec and all(spec.partition(":")[::2]):
        return function_source(spec)
    if spec.endswith(".json") or os.sep in spec:
        raise PlanInputError(f"{spec}: no such file or directory")
    raise PlanInputError(f"unknown model {spec!r}: give a built-in name ({', '.join(SIZES)}), a Hugging Face "
                         "config.json or model directory, or module:function returning an nn.Module")


def make_batch(source: Source, batch: int, seq: int | None, input_shape: str | None, dtype: str = "float32"):
    """``(inputs, targets)`` on the meta device: shapes and dtypes are all the planner reads."""
    if source.inputs == "tokens" or (input_shape is None and seq is not None):
        if input_shape is not None:
            raise PlanInputError(f"{source.name} takes tokens: give --seq, not --input-shape")
        t = seq or 1024
        return (torch.empty(batch, t, dtype=torch.long, device="meta"),
                torch.empty(batch, t, dtype=torch.long, device="meta"))
    if input_shape is None:
        raise PlanInputError(f"{source.name}: give the input shape of one sample, e.g. --input-shape 3,224,224 "
                             "(or --seq T for a model that takes tokens)")
    try:
        shape = tuple(int(s) for s in input_shape.replace("x", ",").split(","))
        assert shape and min(shape) > 0
    except (ValueError, AssertionError):
        raise PlanInputError(f"--input-shape {input_shape!r}: positive integers separated by commas, "
                             "e.g. 3,224,224") from None
    dt = getattr(torch, dtype, None)
    if not isinstance(dt, torch.dtype):
        raise PlanInputError(f"--input-dtype {dtype!r} is not a torch dtype (e.g. float32, long)")
    # targets: one class per sample (cross-entropy over [B, C] logits)
    return (torch.empty(batch, *shape, dtype=dt, device="meta"), torch.empty(batch, dtype=torch.long, device="meta"))


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else "(no message)"
