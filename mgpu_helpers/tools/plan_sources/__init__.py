"""Where ``mgpu-plan`` gets a model: a built-in name, a Hugging Face config, or ``module:function``, each a
:class:`Source` whose ``model_fn`` the planner calls under ``FakeTensorMode``, with the batch it takes (shapes
and dtypes only) and a loss. Bad input is a :class:`PlanInputError`: one line saying what to fix (exit 2).
"""

import importlib
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from mgpu_helpers.planner.models import SIZES, decoder

from .base import PlanInputError, Source, first_line as _first_line, quiet
from .hf import ATTENTION, hf_source

__all__ = ["PlanInputError", "Source", "resolve", "make_batch", "output_loss", "hf_source", "function_source",
           "ATTENTION", "quiet"]


def output_loss(out, targets):
    """Cross-entropy of a model's logits: [B, C] with [B] or [B, T, V] with [B, T] (lm_loss's ops).
    Takes ``.logits`` or the first element when the model returns an object or a tuple; a 0-d tensor is a
    loss the model computed itself (a Hugging Face model given ``labels=``, ``hf.UserStep``)."""
    if not isinstance(out, torch.Tensor):
        out = out[0] if isinstance(out, (tuple, list)) else getattr(out, "logits", None)
    if not isinstance(out, torch.Tensor):
        raise PlanInputError("the model's output is not a tensor of logits (nor has .logits): give a "
                             "model_fn whose module returns logits")
    return out if out.dim() == 0 else F.cross_entropy(out.flatten(0, -2), targets.flatten())


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
        except Exception as e:
            raise PlanInputError(f"{spec} raised {type(e).__name__}: {_first_line(e)}") from None
        if not isinstance(model, nn.Module):
            raise PlanInputError(f"{spec} returned {type(model).__name__}; it must return an nn.Module")
        return model
    return Source(spec, "function", model_fn, "tensor")


def resolve(spec: str, attn: str | None = None, moe_imbalance: float = 1.0) -> Source:
    """A model from what the user typed: a path (HF config), a built-in name or module:function; ``attn``: HF only."""
    path = Path(spec)
    if path.exists():
        return hf_source(path, attn, moe_imbalance)
    if attn is not None:
        raise PlanInputError(f"--attn chooses a Hugging Face model's attention; {spec!r} is not a config")
    if spec in SIZES:
        return Source(f"{spec} (built-in Llama-shaped decoder)", "built-in", decoder(spec), "tokens")
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
        tokens = torch.empty(batch, seq or 1024, dtype=torch.long, device="meta")
        return tokens, tokens  # inputs and their next-token targets: one shape
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
