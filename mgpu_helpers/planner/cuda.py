"""What a GPU runs differently from a CPU, chosen on any host (the planner's fake trace, ``kernels="cuda"``).

torch picks some kernels by device, and what a kernel saves for backward differs (a fused attention keeps a
log-sum-exp per row where the math fallback keeps every layer's fp32 softmax; CUDA's dropout keeps a one-byte
mask), so a plan traced on a CPU would follow the CPU's choices. Under :class:`CudaKernels` attention
(:func:`cuda_backend` picks the kernel), RMSNorm, dropout, cross-entropy, grouped matmuls and autocast's op
lists run as CUDA runs them (each function says what differs; ``bench/planner_gpu_diag.py`` checks them).
"""

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack
from torch.utils._pytree import tree_map_only

FLASH, EFFICIENT, MATH = "flash", "efficient", "math"
_HALF = (torch.float16, torch.bfloat16)


def cuda_backend(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, enable_gqa=False) -> str:
    """The kernel torch picks on an sm80+ GPU for dense (batch, heads, seq, head_dim) inputs (sdp_utils.cpp):
    flash (or cuDNN's, keeping the same tensors) for fp16/bf16, no mask, equal head sizes <= 256; else
    memory-efficient (any mask, head sizes divisible by 8, or 4 in fp32, no grouped heads); else math. Hopper's
    cuDNN kernel also takes a mask and grouped heads: math's larger figure there is the safe direction."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or q.is_nested or min(q.shape[-2], k.shape[-2]) == 0 \
            or any(t.stride(-1) != 1 for t in (q, k, v)):
        return MATH
    hq, hk, hv = q.shape[1], k.shape[1], v.shape[1]
    grouped = not (hq == hk == hv)
    if grouped and not (enable_gqa and hk == hv and hq % hk == 0):
        return MATH  # differing heads without enable_gqa: only math broadcasts them
    dq, dk, dv = q.shape[-1], k.shape[-1], v.shape[-1]
    half = q.dtype in _HALF
    causal_ok = not is_causal or q.shape[-2] == k.shape[-2] or q.shape[-2] == 1
    if half and attn_mask is None and dq == dk == dv <= 256 and causal_ok:
        return FLASH
    align = 8 if half else 4
    if not grouped and (half or q.dtype == torch.float32) and dq == dk and dq % align == 0 and dv % align == 0:
        return EFFICIENT
    return MATH


def _pad_last(t, multiple):
    extra = -t.shape[-1] % multiple
    return F.pad(t, (0, extra)) if extra else t


def gpu_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """``F.scaled_dot_product_attention`` as a GPU runs it: autocast's cast, then the chosen kernel's op."""
    dev = query.device.type
    if torch.is_autocast_enabled(dev):  # autocast casts scaled_dot_product_attention's inputs (on CPU and CUDA)
        dt = torch.get_autocast_dtype(dev)
        query, key, value = (t.to(dt) if t.is_floating_point() else t for t in (query, key, value))
        if attn_mask is not None and attn_mask.is_floating_point():
            attn_mask = attn_mask.to(dt)
    with torch.autocast(dev, enabled=False):  # the kernel's own ops are not autocast again
        choice = cuda_backend(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
        if choice == FLASH:  # flash pads the head size to a multiple of 8 and slices the output back
            d = query.shape[-1]
            q, k, v = (_pad_last(t, 8) for t in (query, key, value))
            sc = scale if scale is not None else d ** -0.5  # the unpadded head size's
            out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=sc)[0]
            return out[..., :d] if out.shape[-1] != d else out
        if choice == EFFICIENT:
            bias = attn_mask
            if bias is not None:
                if bias.dtype == torch.bool:  # a boolean mask becomes an additive one of the inputs' dtype
                    bias = torch.zeros(bias.shape, dtype=query.dtype, device=bias.device).masked_fill_(
                        bias.logical_not(), float("-inf"))
                if bias.shape[-1] % 8:  # the kernel reads the bias in aligned rows (preprocess_mask)
                    bias = _pad_last(bias, 8)[..., :key.shape[-2]]
                bias = bias.expand(query.shape[0], query.shape[1], query.shape[-2], key.shape[-2])
            grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
            return torch.ops.aten._scaled_dot_product_efficient_attention(
                query, key, value, bias, grad, dropout_p, is_causal, scale=scale)[0]
        return _math_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def _math_sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """torch's math attention (``_scaled_dot_product_attention_math``, attention.cpp) op by op as on real
    tensors: fake tensors would take the aten op's tensor-subclass branches (the mask added out of place, none
    of ``_safe_softmax``'s temporaries). fp16/bf16 are upcast to fp32 and cast back, the weights first."""
    if q.dim() != 4 or q.is_nested or k.dim() != 4:  # other layouts: torch's op (rare; its own branches)
        return torch.ops.aten._scaled_dot_product_attention_math(
            q, k, v, attn_mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa)[0]
    dtype = q.dtype
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # convert_boolean_attn_mask: the inputs' dtype
        attn_mask = torch.where(attn_mask, q.new_zeros(()), q.new_full((), float("-inf")))
    if dtype in _HALF and not torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed():
        q, k, v = q.float(), k.float(), v.float()
    hq, lq, d = q.shape[1:]
    sf = (scale if scale is not None else d ** -0.5) ** 0.5  # both operands scaled by its square root
    q = q * sf
    if is_causal:  # made inside the math kernel: the (upcast) query's dtype
        attn_mask = torch.ones(lq, k.shape[-2], dtype=torch.bool, device=q.device).tril()
        attn_mask = torch.where(attn_mask, q.new_zeros(()), q.new_full((), float("-inf")))
    if enable_gqa and k.shape[-3] != hq:  # repeat_interleave over the heads: expand, then a copy
        g = hq // k.shape[-3]
        k, v = (t.unsqueeze(-3).expand(*t.shape[:-2], g, *t.shape[-2:]).clone().flatten(-4, -3) for t in (k, v))
    attn = q @ (k.transpose(-2, -1) * sf)
    if attn_mask is not None:
        attn.add_(attn_mask)
    out = torch.ops.aten._safe_softmax(attn, -1)
    masked = attn.eq(float("-inf"))  # _safe_softmax's temporaries: rows that are all -inf become zeros
    rows, zero = masked.all(-1, keepdim=True), out.new_zeros(())
    del zero, rows, masked, attn
    if dropout_p > 0:
        out = torch.ops.aten.native_dropout(out, dropout_p, True)[0]
    weights = out.to(dtype)  # the op's second output (a copy when upcast), made before the first
    result = (out @ v).to(dtype)
    del weights
    return result


class _FusedRMSNorm(torch.autograd.Function):
    """CUDA's ``_fused_rms_norm`` as the allocator sees it: the output and one fp32 rstd per row; saved
    for backward: the input, the weight and rstd (its values do not matter in a fake trace)."""

    @staticmethod
    def forward(ctx, x, weight, dims):
        rstd = x.new_empty(x.shape[:x.dim() - dims] + (1,) * dims, dtype=torch.float32)
        ctx.save_for_backward(x, weight, rstd)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, grad):
        x, weight, _ = ctx.saved_tensors
        return torch.empty_like(x), (torch.empty_like(weight) if ctx.needs_input_grad[1] else None), None


def gpu_rms_norm(input, normalized_shape, weight=None, eps=None):
    """``F.rms_norm`` as a GPU runs it: autocast runs it in fp32, then one fused kernel."""
    dev = input.device.type
    if torch.is_autocast_enabled(dev):  # in fp32, as layer_norm (newer autocast lists name rms_norm too)
        input = input.float()
        weight = weight.float() if weight is not None and weight.is_floating_point() else weight
    with torch.autocast(dev, enabled=False):
        dims = len(normalized_shape) if not isinstance(normalized_shape, int) else 1
        if weight is None:
            weight = input.new_empty(())  # no weight: nothing to keep (a 0-d stand-in)
        return _FusedRMSNorm.apply(input, weight, dims)


def gpu_dropout(input, p=0.5, training=True, inplace=False):
    """``F.dropout`` as a GPU runs it: the fused kernel, which keeps a boolean mask."""
    if not training or p == 0 or p == 1 or input.numel() == 0:  # CUDA's unfused cases: as everywhere
        return F.dropout(input, p, training, inplace)  # (this mode is off inside its own handler)
    return torch.ops.aten.native_dropout(input, p, True)[0]


def gpu_cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                      reduction="mean", label_smoothing=0.0):
    """``F.cross_entropy`` under CUDA's autocast: not on CUDA's lists, so it decomposes; its log-softmax is
    asked for in the logits' own dtype (kept: bf16 log-probabilities) and ``nll_loss``, on the fp32 list,
    casts them to fp32. CPU autocast lists ``cross_entropy_loss`` itself and casts the logits first."""
    dev = input.device.type
    if (not torch.is_autocast_enabled(dev) or label_smoothing or size_average is not None or reduce is not None
            or target.is_floating_point() or not input.is_floating_point()):
        return F.cross_entropy(input, target, weight, size_average, ignore_index, reduce, reduction, label_smoothing)
    with torch.autocast(dev, enabled=False):
        logp = torch.log_softmax(input, 1 if input.dim() > 1 else 0, dtype=input.dtype)
        weight = weight.float() if weight is not None else None
        return F.nll_loss(logp.float(), target, weight, ignore_index=ignore_index, reduction=reduction)


class _GroupedMM(torch.autograd.Function):
    """``torch._grouped_mm`` (experts as one matmul over jagged groups) as CUDA's kernel holds it: the output,
    both operands saved (derivatives.yaml); ``offs`` only moves the groups' boundaries, not the tensors."""

    @staticmethod
    def forward(ctx, a, b, offs, bias, out_dtype):
        ctx.save_for_backward(a, b)
        if a.dim() == 2 and b.dim() == 2:  # (m, tokens) x (tokens, n): the weights' gradient, one per group
            shape = (offs.shape[0], a.shape[0], b.shape[-1])
        else:  # (tokens, k) x (groups, k, n), one group per expert; (groups, m, k) x (k, n) or x (groups, k, n)
            shape = (*a.shape[:-1], b.shape[-1])
        return a.new_empty(shape, dtype=out_dtype or a.dtype)

    @staticmethod
    def backward(ctx, grad):
        # As derivatives.yaml: mat_b's gradient first; for (tokens, k) x (groups, k, n) it is made (groups, n, k)
        # and handed back transposed (transformers' (groups, n, k) expert weights take it without a copy).
        a, b = ctx.saved_tensors
        gb = ga = None
        if ctx.needs_input_grad[1]:
            gb = b.new_empty((b.shape[0], b.shape[2], b.shape[1])).transpose(-2, -1) \
                if a.dim() == 2 and b.dim() == 3 else torch.empty_like(b)
        if ctx.needs_input_grad[0]:
            ga = torch.empty_like(a)
        return ga, gb, None, None, None


def gpu_grouped_mm(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """``torch._grouped_mm`` as a GPU runs it: not on autocast's lists, in the operands' own dtype."""
    with torch.autocast(mat_a.device.type, enabled=False):
        out = _GroupedMM.apply(mat_a, mat_b, offs, None, out_dtype)
        return out + bias if bias is not None else out


# CUDA autocast's lists (autocast_mode.h) where the CPU's differ: ops run in fp32, ops given an fp32 dtype=.
CUDA_AUTOCAST_FP32 = frozenset(
    "acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow softplus layer_norm "
    "group_norm frobenius_norm nuclear_norm cosine_similarity l1_loss dist pdist renorm logsumexp "
    "upsample_nearest1d upsample_nearest2d upsample_nearest3d upsample_linear1d upsample_bilinear2d "
    "upsample_trilinear3d upsample_bicubic2d".split())
CUDA_AUTOCAST_FP32_DTYPE = frozenset("prod softmax log_softmax cumprod cumsum sum".split())
# Ops CPU autocast lists and CUDA's does not (AutocastCPU kernels without an AutocastCUDA one) run on a GPU as
# they are: e.g. CPU autocast casts cat's inputs to the widest dtype first, a copy CUDA's kernel never makes.
CPU_AUTOCAST_ONLY = frozenset(
    op.split("::")[1] for op in set(torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCPU"))
    - set(torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA")) if "." not in op)
_ALIASES = {"__pow__": "pow", "__rpow__": "pow", "__rtruediv__": "reciprocal", "__rdiv__": "reciprocal",
            "concat": "cat", "concatenate": "cat"}


@functools.cache
def _listed_name(func) -> str:
    """The op's name if one of the two autocasts lists it and the other does not, else ""."""
    name = getattr(func, "__name__", "")
    name = _ALIASES.get(name, name)
    return name if name in CUDA_AUTOCAST_FP32 or name in CUDA_AUTOCAST_FP32_DTYPE or name in CPU_AUTOCAST_ONLY else ""


class CudaKernels(TorchFunctionMode):
    """Within it, attention, RMSNorm, dropout and cross-entropy run as on a GPU, and autocast casts as
    CUDA's does. Every torch call of the traced step comes through here: a dict lookup decides."""

    _ROUTES = {F.scaled_dot_product_attention: gpu_sdpa, F.rms_norm: gpu_rms_norm, torch.rms_norm: gpu_rms_norm,
               F.dropout: gpu_dropout, torch.dropout: gpu_dropout, F.cross_entropy: gpu_cross_entropy,
               **({torch._grouped_mm: gpu_grouped_mm} if hasattr(torch, "_grouped_mm") else {})}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        route = self._ROUTES.get(func)
        if route is not None:
            return route(*args, **kwargs)
        name = _listed_name(func)
        first = args[0] if args else next(iter(kwargs.values()), None)
        if isinstance(first, (list, tuple)) and first:  # cat, stack
            first = first[0]
        if not name or not isinstance(first, torch.Tensor) or first.device.type not in ("cpu", "cuda") \
                or not torch.is_autocast_enabled(first.device.type):
            return func(*args, **kwargs)
        if name in CUDA_AUTOCAST_FP32:
            args, kwargs = tree_map_only(torch.Tensor, lambda t: t.float() if t.dtype in _HALF else t, (args, kwargs))
        elif name in CPU_AUTOCAST_ONLY:
            pass  # the op as it is, below: not autocast's on CUDA
        elif first.is_floating_point() and kwargs.get("dtype") is None \
                and not any(isinstance(a, torch.dtype) for a in args):
            kwargs = {**kwargs, "dtype": torch.float32}
        else:  # CPU autocast does the same
            return func(*args, **kwargs)
        with torch.autocast(first.device.type, enabled=False):  # cast as CUDA's, not again by CPU autocast
            return func(*args, **kwargs)


def recompute_contexts():
    """``context_fn`` for ``torch.utils.checkpoint``: the recomputation runs under ``CudaKernels`` when the
    forward did (autograd does not carry function modes into backward; other kernels save other tensors)."""
    active = any(isinstance(m, CudaKernels) for m in _get_current_function_mode_stack())
    return contextlib.nullcontext(), (CudaKernels() if active else contextlib.nullcontext())
