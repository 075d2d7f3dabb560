"""Accounting over fake storages: :class:`FakeTracker`, the course's ``MemoryTracker`` pointed at a fake-tensor
step, plus the calibrated scratch a GPU's kernels take inside one op, which no tensor owns.

A fake tensor's storage lives on ``meta`` whatever device it claims, so ``FakeTracker`` counts meta storages of
tensors that claim the planned device (a CPU plan equals the tracker on a real step). With ``kernels="cuda"``
it adds GPU kernels' scratch as transients (a CPU kernel's, oneDNN's, depends on the CPU: not the plan's).
"""

import math

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass_type
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
        self._cublas = set()  # the threads whose first cuBLAS call is marked in events
        self._sum = None  # a gradient sum just made out of place: (its key, the old buffer's key, undo state)
        self._wrapped = None  # the op a tensor subclass is running on its local tensors

    def _claim(self, tensors, cat, add=False):
        super()._claim([t for t in tensors if isinstance(t, torch.Tensor) and t.device.type == self.planned],
                       cat, add)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.planned != "cpu":  # ops on CPU tensors only (Adam's step counters) use no GPU memory
            devs = {t.device.type for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            if devs == {"cpu"}:
                return func(*args, **(kwargs or {}))
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            self._wrapped = func  # a subclass's op (DTensor): the same op on its local tensors comes next
            return super().__torch_dispatch__(func, types, args, kwargs)
        undo = (len(self.events), self._peak, dict(self._peak_cats), self._peak_idx, dict(self._phase_peaks),
                self.workspace_at_peak) if self._accumulation(func, args) else None  # to count a sum in place
        self._wrapped = None
        self._sum = None
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if undo is not None and len(self.events) == undo[0] + 1:  # the sum made one storage
            self._sum = (out.untyped_storage()._cdata, args[0].untyped_storage()._cdata, undo)
        if self._active and self.kernels == "cuda" and func in _CUBLAS:
            # A cuBLAS handle (forward's thread, autograd's backward thread) takes its workspace at its first
            # matmul, after the output: where it lands decides which free block it takes.
            thread = "backward" if self._phase.startswith("backward") else "forward"
            if thread not in self._cublas:
                self._cublas.add(thread)
                self.events.append((("cuBLAS", thread), 0, False, self._phase, "cuBLAS"))
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

    # Autograd adds a gradient into a buffer in place when it holds its last reference (input_buffer.cpp,
    # ``can_accumulate_inplace``); under a dispatch mode the Python object is one more, so the sum is made anew
    # and the old buffer dropped. A CPU plan keeps that (as the tracker sees it); a GPU plan, held against the
    # user's own step, counts such a sum (a dense ``add`` of one shape in backward without grad mode, not a
    # subclass's) followed at once by the old buffer's release in place: the old bytes hold the sum.
    def _accumulation(self, func, args):
        return (self._active and self.kernels == "cuda" and func is torch.ops.aten.add.Tensor
                and self._wrapped is not func and self._phase.startswith("backward")
                and not torch.is_grad_enabled() and len(args) == 2
                and all(isinstance(a, torch.Tensor) for a in args) and args[0].shape == args[1].shape
                and args[0].dtype == args[1].dtype and args[0].is_contiguous())

    def _on_free(self, key, ref):
        made, self._sum = self._sum, None
        with self._lock:
            old = self._recs.get(key)
            new = made and key == made[1] and self._recs.get(made[0])
            if new and old is not None and old.ref is ref and new.nbytes == old.nbytes \
                    and len(self.events) == made[2][0] + 1:
                n_events, self._peak, self._peak_cats, self._peak_idx, self._phase_peaks, \
                    self.workspace_at_peak = made[2]
                del self.events[n_events:], self._timeline[-1]  # the sum's allocation and its sample, undone
                self._cats[new.cat] -= new.nbytes
                self._total -= new.nbytes
                old.ref, self._recs[made[0]] = new.ref, old  # the old buffer's bytes now hold the sum
                del self._recs[key]
                return
        super()._on_free(key, ref)


# cuDNN's workspace inside one convolution, from its largest activation in the dtype it runs in: the envelope of
# ResNet-50's convolutions measured op by op (bench/planner_gpu_diag.py conv), at least what any of them took.
CUDNN_WORKSPACE_FRACTION, CUDNN_WORKSPACE_EXTRA = 1.55, 26 * 2**20


def flash_backward_workspace(func, args) -> int:
    """Bytes flash attention's backward takes and frees inside the op (mha_bwd, flash_api.cpp): fp32 dq_accum
    and softmax_d at rounded sizes, and with grouped heads dk and dv at the query's head count; one block."""
    q, k = args[1], args[2]
    b, h, lq, d = q.shape
    lq_r, d_r = -(-lq // 128) * 128, -(-d // 32) * 32
    extra = (b * lq_r * h * d_r + b * h * lq_r) * 4 + 256  # (+256 B: in every recorded request)
    if k.shape[1] != h:
        extra += 2 * b * k.shape[2] * h * d * q.element_size()
    return extra


def cudnn_workspace(func, args) -> int:
    """Bytes cuDNN takes and frees inside one GPU convolution (forward or backward): a calibrated line."""
    if func is torch.ops.aten.convolution.default:  # forward: the output's size from the arguments
        x, w, (stride, padding, dilation) = args[0], args[1], args[3:6]
        spatial = [(n + 2 * p - d * (k - 1) - 1) // s + 1 for n, k, s, p, d in
                   zip(x.shape[2:], w.shape[2:], stride, padding, dilation)]
        out = x.shape[0] * w.shape[0] * math.prod(spatial)
    else:  # convolution_backward(grad_output, input, weight, ...)
        x, out = args[1], args[0].numel()
    return int(CUDNN_WORKSPACE_FRACTION * max(x.numel(), out) * x.element_size()) + CUDNN_WORKSPACE_EXTRA


# H100 SXM's and H200's 132 SMs of 2048 threads (A100: 108): more SMs split a reduction over more blocks.
SMS, THREADS_PER_SM = 132, 2048


def reduce_workspace(func, args) -> int:
    """Bytes a GPU reduction (sum, mean) borrows inside the op when it splits each output's inputs over thread
    blocks: their partial results (``setReduceConfig`` and ``ReduceConfig::global_memory_size``, Reduce.cuh),
    for a dense input; a norm weight's gradient, ``x.sum((0, 1))``, can borrow thousands of times its result."""
    x = args[0]
    dims = args[1] if len(args) > 1 and args[1] not in (None, []) else range(x.dim())
    dims = {d % max(x.dim(), 1) for d in ([dims] if isinstance(dims, int) else dims)}
    numel = x.numel()
    if numel == 0 or not x.is_contiguous():
        return 0
    outputs = math.prod(n for d, n in enumerate(x.shape) if d not in dims)
    inputs = numel // outputs
    if inputs == 1:
        return 0
    acc = 8 if x.dtype in (torch.float64, torch.complex64) else 4
    kept = [d for d in range(x.dim()) if d not in dims and x.shape[d] > 1]
    fastest = not kept or max(d for d in dims if x.shape[d] > 1) > max(kept)  # the innermost dim is reduced
    # lanes take neighbouring outputs, vectorised by 4 where the innermost output dim allows
    vec = 1 if fastest else math.gcd(4, x.shape[max(kept)])
    dim0, dim1 = (inputs, outputs) if fastest else (outputs // vec, inputs)
    real = [d for d in range(x.dim()) if x.shape[d] > 1]  # reduced dims next to each other merge into one
    groups = sum(1 for i, d in enumerate(real) if d in dims and (i == 0 or real[i - 1] not in dims))
    if fastest and dim0 > 128 and groups == 1:  # lanes load 4 neighbouring inputs at once
        dim0 //= 4
    most = 512 // vec

    def pow2(n):
        return most if n >= most else 1 << (max(n, 1).bit_length() - 1)
    width = min(pow2(dim0), 32)
    height = min(pow2(dim1), most // width)
    width = min(pow2(dim0), most // height)
    step_in, step_out = (width, 1) if fastest else (1, width)
    split_y = -(-inputs // step_in) >= height * 16 or -(-inputs // step_in) >= 256
    step_in, step_out = (step_in * height, step_out) if split_y else (step_in, step_out * height)
    per_thread = -(-inputs // step_in)
    grid = -(-(outputs // vec) // step_out)
    target = SMS * (THREADS_PER_SM // (width * height))
    if not split_y or per_thread < 256 or grid > target:
        return 0
    ctas = max(min(-(-target // grid), -(-per_thread // 16)), -(-per_thread // 256))
    return acc * outputs * ctas * (1 if fastest else width * vec) if ctas > 1 else 0


_CUBLAS = frozenset(getattr(torch.ops.aten, op).default for op in ("mm", "addmm", "bmm", "baddbmm", "addmv", "mv"))
_CONVS = (torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default)
_REDUCTIONS = (torch.ops.aten.sum.dim_IntList, torch.ops.aten.sum.default, torch.ops.aten.mean.dim,
               torch.ops.aten.mean.default)
_GPU_SCRATCH = {**{f: cudnn_workspace for f in _CONVS}, **{f: reduce_workspace for f in _REDUCTIONS},
                torch.ops.aten._scaled_dot_product_flash_attention_backward.default: flash_backward_workspace}
