"""Accounting over fake storages: :class:`FakeTracker`, the course's ``MemoryTracker`` pointed at a fake-tensor
step, and the calibrated lines for what no tensor owns (kernels' scratch inside one op).

``MemoryTracker`` counts storages on its device, and a fake tensor's storage lives on ``meta`` whatever device
the tensor claims, so the tracker sees nothing under a fake mode (FACTS.md). ``FakeTracker`` counts meta
storages of tensors that claim the planned device -- same categories, same rules, same 512-byte rounding --
which is why the planner equals the tracker on a real step. It records the allocator's requests in order
(``events``: what ``planner.allocator.replay`` replays) and adds what a kernel borrows inside one op as a
transient: on the CPU every op's, measured on this machine (``planner.kernels``); on a GPU each convolution's
cuDNN workspace (:func:`cudnn_workspace`, calibrated on the H200).

The lowest layer of the planner but ``kernels``: it imports the runtime's tracker and ``kernels``; ``trace``
and ``fsdp`` build on it.
"""
from __future__ import annotations

import math
import weakref

import torch
from torch.utils._pytree import tree_leaves

from ..runtime.tracker import MemoryTracker
from .kernels import _CONVS, cpu_kernel_scratch, probed

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

    # torch.utils.checkpoint keeps the CPU generator's state (``torch.get_rng_state()``: 5,056 bytes with
    # torch 2.13) from each checkpointed segment's forward until its recompute has run: CPU memory, made
    # outside any op, so a real tensor even under the fake mode, which no dispatch mode sees. On a CPU plan
    # it counts: a 3-block MLP's step held 3 x 5,056 B more than its plan through the forward, and on a CPU
    # whose bf16 matmuls take scratch (AVX-512 bf16, AMX) the peak fell there: -0.70% against the profiler.
    # A GPU plan leaves it out (host memory; the CUDA generator's state is a host tensor too).
    def __enter__(self):
        super().__enter__()
        if self.planned == "cpu":
            self._real_rng_state, torch.get_rng_state = torch.get_rng_state, self._counted_rng_state
        return self

    def __exit__(self, *exc):
        if self.planned == "cpu":
            torch.get_rng_state = self._real_rng_state
        return super().__exit__(*exc)

    def _counted_rng_state(self):
        state = self._real_rng_state()
        if self._active:
            rec = _Scratch()
            rec.cat, rec.nbytes = "other", -(-state.untyped_storage().nbytes() // self.round_to) * self.round_to
            with self._lock:
                self._change(rec, rec.nbytes)
            weakref.finalize(state, self._rng_state_freed, rec)  # when checkpoint lets go of it
        return state

    def _rng_state_freed(self, rec):
        with self._lock:
            if self._active:
                self._change(rec, -rec.nbytes)

    def _claim(self, tensors, cat, add=False):
        super()._claim([t for t in tensors if isinstance(t, torch.Tensor) and t.device.type == self.planned],
                       cat, add)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.planned != "cpu":  # ops on CPU tensors only (Adam's step counters) use no GPU memory
            devs = {t.device.type for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            if devs == {"cpu"}:
                return func(*args, **(kwargs or {}))
        out = super().__torch_dispatch__(func, types, args, kwargs)
        cpu = self.kernels == "cpu"
        if self._active and (probed(func) if cpu else func in _GPU_SCRATCH):
            # measured on this CPU (planner.kernels), or the GPU kernel's own buffers (cuDNN's, flash's)
            extra = cpu_kernel_scratch(func, args, kwargs) if cpu else _GPU_SCRATCH[func](func, args)
            extra = -(-extra // self.round_to) * self.round_to
            if extra:  # taken and given back inside the op: a transient sample, labelled "other"
                rec = _Scratch()
                rec.cat, rec.nbytes = "other", extra
                with self._lock:
                    self._ws_now = extra if cpu or func in _CONVS else 0  # the plan's cuDNN line: convolutions'
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


# cuDNN's workspace, taken and given back inside one convolution on a GPU, from the convolution's largest
# activation (input or output, in the dtype it runs in). Measured op by op on the H200 (torch 2.11+cu130,
# cuDNN's default heuristics; bench/planner_gpu_diag.py conv): ResNet-50's 212 convolutions at batch
# 64 x 224^2, forward and backward, fp32 and bf16 autocast + checkpointing. The workspace ranges from 0
# (1x1 convolutions on large maps) to 1.54x the largest activation (a strided 1x1's backward: 302.0 MiB
# for 196 MiB), and small convolutions add up to ~23 MiB (a 3x3's backward at 7x7: 29.5 MiB for 6.1 MiB).
# The plan takes the envelope of all 212: at least what any of them took (an under-estimate is the
# dangerous direction; the over-estimate is largest on the small ones, where it is a few MiB of a step).
CUDNN_WORKSPACE_FRACTION, CUDNN_WORKSPACE_EXTRA = 1.55, 26 * 2**20


def flash_backward_workspace(func, args) -> int:
    """Bytes flash attention's backward takes and frees inside the op on a GPU (mha_bwd, torch's
    flash_api.cpp): dq_accum (batch, query length rounded to 128, heads, head size rounded to 32) and
    softmax_d (batch, heads, rounded length) in fp32, and with fewer key/value heads than query heads dk and
    dv at the query's head count before they are summed -- one block, as the H200 recorded it: 17,039,616 B
    at 4 x 1024 tokens, 16 heads of 64; 33,816,832 B with 2 key/value heads (bench/hf_alloc_diag.py)."""
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


_GPU_SCRATCH = {**{f: cudnn_workspace for f in _CONVS},
                torch.ops.aten._scaled_dot_product_flash_attention_backward.default: flash_backward_workspace}
