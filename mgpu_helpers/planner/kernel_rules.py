"""What no probe measures: rules for the scratch of ops the planner cannot or must not run here.

``planner.kernels`` measures each CPU kernel's scratch on this machine. What it cannot run -- an op too large
to run on a laptop, a kernel that will not run on made-up inputs, a profiler already on, a collective (it
needs the other ranks) -- gets a rule from this module: lines fitted on AVX2 (torch 2.13) for oneDNN's
convolutions, and what the CPU kernels of FSDP2's ``_chunk_cat`` and gloo's reduce-scatter copy, read from
their arguments. A rule is right on the ISA it was fitted on only where it is a fit (the convolutions'); the
copies are the same on every ISA.
"""
from __future__ import annotations

import math

import torch

aten = torch.ops.aten


def derived_scratch(func, args, kwargs) -> int:
    """The fallback of ``kernels.cpu_kernel_scratch``: convolutions' lines fitted on AVX2 (torch 2.13); the
    copies ``_chunk_cat`` and gloo's reduce-scatter make; 0 for any other op."""
    if is_chunk_cat(func):
        return chunk_cat_scratch(func, args, kwargs)
    if is_reduce_scatter(func):
        return reduce_scatter_scratch(func, args, kwargs)
    if func in (aten.convolution.default, aten.convolution_backward.default):
        return conv_scratch(func, args)
    return 0


# --- what no tensor owns: oneDNN's convolution scratch on the CPU -------------------------------------

_CONVS = (torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default)


def conv_scratch(func, args) -> int:
    """Bytes oneDNN takes and frees inside one CPU convolution, beside its inputs and outputs: a calibrated
    line, because no tensor owns them (the profiler sees them: ``planner.validation``); the fallback of
    ``kernels.cpu_kernel_scratch``. Measured with
    torch 2.13's CPU build on 2-D convolutions, groups 1 (tests/test_planner_ranks.py re-measures them):
    fp32, kernel > 1: forward the output's bytes (+ the weight's when in and out channels are equal:
    a reordered copy), backward the output's + the input's (twice the input's when the in-channels are
    not a multiple of 8, as an RGB stem: 0.73x seen); 1x1 kernels: nothing; 16-bit (autocast):
    an im2col buffer, batch x in-channels x kernel area x output positions, forward and backward.
    Other convolutions (grouped, 1-D/3-D, transposed) get the fp32 rule: a documented guess."""
    if func is torch.ops.aten.convolution.default:
        x, w, out_shape = args[0], args[1], None
    else:
        x, w, out_shape = args[1], args[2], args[0].shape
    if w.dim() < 3 or all(k == 1 for k in w.shape[2:]):
        return 0
    e, area = x.element_size(), math.prod(w.shape[2:])
    if out_shape is None:
        stride, padding, dilation = args[3], args[4], args[5]
        spatial = [(n + 2 * p - d * (k - 1) - 1) // s + 1 for n, k, s, p, d in
                   zip(x.shape[2:], w.shape[2:], stride, padding, dilation)]
        out_shape = (x.shape[0], w.shape[0], *spatial)
    out_b, in_b, w_b = math.prod(out_shape) * e, x.numel() * e, w.numel() * e
    if e < 4:
        return x.shape[0] * w.shape[1] * area * math.prod(out_shape[2:]) * e
    if func is torch.ops.aten.convolution.default:
        return out_b + (w_b if w.shape[0] == w.shape[1] else 0)
    return out_b + in_b * (2 if w.shape[1] % 8 else 1)  # in-channels off oneDNN's blocks: a padded input copy


# FSDP2 copies gradients into its reduce-scatter buffer with ``torch._chunk_cat(grads, out=buffer)``. When the
# buffer's dtype differs from the gradients' (MixedPrecisionPolicy: bf16 gradients, fp32 reduce), the CPU
# kernel first copies each gradient, one at a time, into a temporary of its own dtype: the largest input's
# bytes are taken and given back inside the op (torch 2.13's CPU build, measured with the profiler;
# same dtype: nothing). CUDA's kernel converts in place.
# FSDP2 reaches it through its own custom op, ``fsdp::chunk_cat`` (tensors, dim, num_chunks, out).
_CHUNK_CAT_OPS = ("fsdp::chunk_cat", "aten::_chunk_cat")


def is_chunk_cat(func) -> bool:
    return getattr(getattr(func, "_schema", None), "name", None) in _CHUNK_CAT_OPS


def chunk_cat_scratch(func, args, kwargs) -> int:
    """Bytes the CPU ``_chunk_cat`` kernel takes and frees converting its inputs to ``out``'s dtype."""
    out = (kwargs or {}).get("out", args[3] if len(args) > 3 else None)
    inputs = args[0] if args else ()
    if out is None or not inputs:
        return 0
    return max((t.numel() * t.element_size() for t in inputs if t.dtype != out.dtype), default=0)


# gloo's reduce-scatter (what FSDP2 calls on CPU ranks: ``dist.reduce_scatter_tensor``, the op
# ``c10d::_reduce_scatter_base_``) reduces a copy of its whole input, made inside the op and given back once
# the work has finished: FSDP2 root-only with MixedPrecisionPolicy on 2 ranks peaked inside it, 658,700 B
# above the live bytes as it began for a 658,688-B input (torch 2.13; the plan was 0.24% under), and the
# 5.3M-parameter decoder 2.20% under (a 21 MB copy). NCCL reduces in place: GPU plans leave it out.
# What the rule cannot say: once in a few runs gloo's worker thread, not the caller, lets the copy go, later
# (FSDP2 + MixedPrecisionPolicy + checkpointing, 2 ranks: in 2 of 7 runs still live 100-250 ops on, where the
# step peaked: +198,152 B); ``planner.validation`` measures such runs again.
_REDUCE_SCATTER_OPS = ("c10d::_reduce_scatter_base_",)


def is_reduce_scatter(func) -> bool:
    return getattr(getattr(func, "_schema", None), "name", None) in _REDUCE_SCATTER_OPS


def reduce_scatter_scratch(func, args, kwargs) -> int:
    """Bytes gloo's reduce-scatter copies its input into: the whole input's."""
    inp = args[1] if len(args) > 1 else (kwargs or {}).get("input_tensor")
    return inp.numel() * inp.element_size() if isinstance(inp, torch.Tensor) else 0
