"""Accounting over fake storages: :class:`FakeTracker`, the course's ``MemoryTracker`` pointed at a fake-tensor
step, and the calibrated lines for what no tensor owns (kernels' scratch inside one op).

``MemoryTracker`` counts storages on its device, and a fake tensor's storage lives on ``meta`` whatever device
the tensor claims, so the tracker sees nothing under a fake mode (FACTS.md). ``FakeTracker`` counts meta
storages of tensors that claim the planned device -- same categories, same rules, same 512-byte rounding --
which is why the planner equals the tracker on a real step. It records the allocator's requests in order
(``events``: what ``planner.allocator.replay`` replays) and adds each convolution's scratch as a transient:
oneDNN's on the CPU (:func:`conv_scratch`), cuDNN's workspace on a GPU (:func:`cudnn_workspace`), and the CPU
``_chunk_cat`` kernel's conversion buffer under FSDP2's mixed precision (:func:`chunk_cat_scratch`).

The lowest layer of the planner: it imports only the runtime's tracker; ``trace`` and ``fsdp`` build on it.
"""
from __future__ import annotations

import math

import torch
from torch.utils._pytree import tree_leaves

from ..runtime.tracker import MemoryTracker

# --- accounting over fake storages -------------------------------------------------------------------

class FakeTracker(MemoryTracker):
    """``MemoryTracker`` over fake tensors on ``device``: counts their (meta) storages. Enter it inside the
    ``FakeTensorMode`` that made the model."""

    def __init__(self, model, optimizer, device, round_to, kernels=None):
        super().__init__(model, optimizer, device="cpu", round_to=round_to)
        self.device = torch.device("meta")  # where every fake storage lives
        self.planned = torch.device(device).type
        self.events = []  # the allocator's requests, in order: planner_allocator.replay
        # kernels' own scratch inside a convolution: cuDNN's workspace on a GPU, oneDNN's on the CPU
        self.kernels = self.planned if kernels is None else kernels
        self.workspace_at_peak, self._ws_now = 0, 0

    def _claim(self, tensors, cat, add=False):
        super()._claim([t for t in tensors if isinstance(t, torch.Tensor) and t.device.type == self.planned],
                       cat, add)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.planned != "cpu":  # ops on CPU tensors only (Adam's step counters) use no GPU memory
            devs = {t.device.type for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            if devs == {"cpu"}:
                return func(*args, **(kwargs or {}))
        out = super().__torch_dispatch__(func, types, args, kwargs)
        chunk_cat = self._active and self.kernels == "cpu" and is_chunk_cat(func)
        if self._active and (func in _CONVS or chunk_cat):
            extra = chunk_cat_scratch(func, args, kwargs) if chunk_cat else \
                (conv_scratch if self.kernels == "cpu" else cudnn_workspace)(func, args)
            extra = -(-extra // self.round_to) * self.round_to
            if extra:  # taken and given back inside the op: a transient sample, labelled "other"
                rec = _Scratch()
                rec.cat, rec.nbytes = "other", extra
                with self._lock:
                    self._ws_now = extra
                    self._change(rec, extra)
                    self._ws_now = 0
                    self._change(rec, -extra)
        return out

    def _sample(self):
        super()._sample()
        if self._peak_idx == len(self._timeline) - 1:
            self.workspace_at_peak = self._ws_now


class _Scratch:  # a kernel's scratch: bytes no tensor owns (an event key for planner_allocator)
    __slots__ = ("cat", "nbytes")


# --- what no tensor owns: oneDNN's convolution scratch on the CPU -------------------------------------

_CONVS = (torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default)


def conv_scratch(func, args) -> int:
    """Bytes oneDNN takes and frees inside one CPU convolution, beside its inputs and outputs: a calibrated
    line, because no tensor owns them (the profiler sees them: ``planner_validate``). Measured with
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


# cuDNN's workspace, taken and given back inside one convolution on a GPU, from the convolution's largest
# activation (input or output, in the dtype it runs in). Measured op by op on the H200 (torch 2.11+cu130,
# cuDNN's default heuristics; bench/planner_gpu_diag.py conv): ResNet-50's 212 convolutions at batch
# 64 x 224^2, forward and backward, fp32 and bf16 autocast + checkpointing. The workspace ranges from 0
# (1x1 convolutions on large maps) to 1.54x the largest activation (a strided 1x1's backward: 302.0 MiB
# for 196 MiB), and small convolutions add up to ~23 MiB (a 3x3's backward at 7x7: 29.5 MiB for 6.1 MiB).
# The plan takes the envelope of all 212: at least what any of them took (an under-estimate is the
# dangerous direction; the over-estimate is largest on the small ones, where it is a few MiB of a step).
CUDNN_WORKSPACE_FRACTION, CUDNN_WORKSPACE_EXTRA = 1.55, 26 * 2**20


def cudnn_workspace(func, args) -> int:
    """Bytes cuDNN takes and frees inside one GPU convolution (forward or backward): a calibrated line."""
    if func is torch.ops.aten.convolution.default:
        x, w, out = args[0], args[1], None
    else:
        x, w, out = args[1], args[2], args[0]
    biggest = max(x.numel(), out.numel() if out is not None else 0) * x.element_size()
    if out is None:  # forward: the output's size from the arguments
        stride, padding, dilation = args[3], args[4], args[5]
        spatial = [(n + 2 * p - d * (k - 1) - 1) // s + 1 for n, k, s, p, d in
                   zip(x.shape[2:], w.shape[2:], stride, padding, dilation)]
        biggest = max(biggest, x.shape[0] * w.shape[0] * math.prod(spatial) * x.element_size())
    return int(CUDNN_WORKSPACE_FRACTION * biggest) + CUDNN_WORKSPACE_EXTRA


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
