"""Accounting over fake storages: :class:`FakeTracker`, the course's ``MemoryTracker`` pointed at a fake-tensor
step, and, for a GPU's kernels, the calibrated lines for what no tensor owns (their scratch inside one op).

``MemoryTracker`` counts storages on its device, and a fake tensor's storage lives on ``meta`` whatever device
the tensor claims, so the tracker sees nothing under a fake mode. ``FakeTracker`` counts meta storages of
tensors that claim the planned device -- same categories, same rules, same rounding -- which is why a CPU
plan equals the tracker on a real step. It records the allocator's requests in order (``events``, for
``planner.allocator.replay``) and, planning a GPU's kernels (``kernels="cuda"``), adds what a kernel borrows
inside one op as a transient: cuDNN's workspace and flash attention's backward buffers. A CPU kernel's
scratch (oneDNN's) depends on the CPU: it is the CPU allocator's business, not the plan's.
"""
from __future__ import annotations

import math

import torch
from torch.utils._pytree import tree_leaves

from ..runtime.tracker import MemoryTracker, _Rec

class FakeTracker(MemoryTracker):
    """Enter it inside the ``FakeTensorMode`` that made the model."""

    def __init__(self, model, optimizer, device, round_to, kernels=None):
        super().__init__(model, optimizer, device="cpu", round_to=round_to)
        self.device = torch.device("meta")  # where every fake storage lives
        self.planned = torch.device(device).type
        self.events = []  # the allocator's requests, in order: planner_allocator.replay
        self.kernels = self.planned if kernels is None else kernels  # "cuda": GPU kernels' scratch is added
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
        if self._active and self.kernels == "cuda" and func in _GPU_SCRATCH:
            extra = -(-_GPU_SCRATCH[func](func, args) // self.round_to) * self.round_to
            if extra:  # taken and given back inside the op: a transient sample, labelled "other"
                rec = _Rec()  # bytes no tensor owns: an event of its own for planner.allocator
                rec.cat, rec.nbytes = "other", extra
                with self._lock:
                    self._ws_now = extra if func in _CONVS else 0  # the budget's cuDNN line: convolutions'
                    self._change(rec, extra)
                    self._ws_now = 0
                    self._change(rec, -extra)
        return out

    def _sample(self):
        super()._sample()
        if self._peak_idx == len(self._timeline) - 1:
            self.workspace_at_peak = self._ws_now


# cuDNN's workspace inside one GPU convolution, from its largest activation (input or output, in the dtype it
# runs in): the envelope of ResNet-50's convolutions measured op by op (bench/planner_gpu_diag.py conv), at
# least what any of them took (an under-estimate is the dangerous direction).
CUDNN_WORKSPACE_FRACTION, CUDNN_WORKSPACE_EXTRA = 1.55, 26 * 2**20


def flash_backward_workspace(func, args) -> int:
    """Bytes flash attention's backward takes and frees inside the op on a GPU (mha_bwd, torch's
    flash_api.cpp): dq_accum (batch, query length rounded to 128, heads, head size rounded to 32) and
    softmax_d (batch, heads, rounded length) in fp32, and with fewer key/value heads than query heads dk and
    dv at the query's head count before they are summed -- one block, as a GPU records it."""
    q, k = args[1], args[2]
    b, h, lq, d = q.shape
    lq_r, d_r = -(-lq // 128) * 128, -(-d // 32) * 32
    extra = (b * lq_r * h * d_r + b * h * lq_r) * 4 + 256  # (+256 B: in every recorded request)
    if k.shape[1] != h:
        extra += 2 * b * k.shape[2] * h * d * q.element_size()
    return extra


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


_CONVS = (torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default)
_GPU_SCRATCH = {**{f: cudnn_workspace for f in _CONVS},
                torch.ops.aten._scaled_dot_product_flash_attention_backward.default: flash_backward_workspace}
