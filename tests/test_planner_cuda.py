"""planner.cuda: the fake trace runs attention, RMSNorm, dropout and cross-entropy as a GPU does, on a CPU."""
import collections
import contextlib
import json

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from mgpu_helpers.planner import cuda as pc
from mgpu_helpers.planner import SIZES, decoder, lm_loss, plan_from_trace, token_batch
from mgpu_helpers.planner.cuda import EFFICIENT, FLASH, MATH, CudaKernels, cuda_backend
from mgpu_helpers.planner.trace import trace_step


class Ops(TorchDispatchMode):
    """Every aten op run, with its outputs' dtypes."""

    def __init__(self):
        super().__init__()
        self.seen = collections.Counter()
        self.dtypes = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.seen[str(func)] += 1
        first = out[0] if isinstance(out, (tuple, list)) else out
        if isinstance(first, torch.Tensor):
            self.dtypes[str(func)] = first.dtype
        return out


def qkv(dtype, kv_heads=16, head=64, seq=32):
    q = torch.empty(2, 16, seq, head, dtype=dtype)
    k, v = (torch.empty(2, kv_heads, seq, head, dtype=dtype) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("dtype, kv_heads, mask, head, want", [
    (torch.float32, 16, False, 64, EFFICIENT),   # fp32: no flash; memory-efficient takes it
    (torch.float32, 4, False, 64, MATH),         # fp32 with grouped heads: no fused kernel (the H200's HF row)
    (torch.bfloat16, 4, False, 64, FLASH),       # flash takes grouped heads
    (torch.bfloat16, 16, True, 64, EFFICIENT),   # a mask: not flash (sm80 rules), memory-efficient
    (torch.bfloat16, 4, True, 64, MATH),         # a mask and grouped heads: math's larger figure (safe)
    (torch.bfloat16, 16, False, 320, EFFICIENT),  # flash stops at head size 256
    (torch.float32, 16, False, 30, MATH),        # not a multiple of 4: no memory-efficient kernel
])
def test_cuda_backend_follows_torchs_sm80_rules(dtype, kv_heads, mask, head, want):
    q, k, v = qkv(dtype, kv_heads, head)
    m = torch.ones(2, 1, 32, 32, dtype=torch.bool) if mask else None
    assert cuda_backend(q, k, v, m, 0.0, not mask, kv_heads != 16) == want


def test_grouped_heads_without_enable_gqa_are_math_only():
    q, k, v = qkv(torch.bfloat16, kv_heads=4)
    assert cuda_backend(q, k, v, None, 0.0, True, enable_gqa=False) == MATH


@pytest.mark.parametrize("dtype, kv_heads, want_op", [
    (torch.float32, 16, "aten._scaled_dot_product_efficient_attention.default"),
    (torch.bfloat16, 4, "aten._scaled_dot_product_flash_attention.default"),
    (torch.float32, 4, "aten._safe_softmax.default"),
])
def test_fake_attention_runs_the_chosen_kernels_ops_forward_and_backward(dtype, kv_heads, want_op):
    with FakeTensorMode():
        q, k, v = (t.requires_grad_() for t in qkv(dtype, kv_heads))
        ops = Ops()
        with ops, CudaKernels():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv_heads != 16)
            out.sum().backward()
        assert out.shape == q.shape and out.dtype == dtype and k.grad.shape == k.shape
    assert ops.seen[want_op] == 1
    assert not any("for_cpu" in name for name in ops.seen)  # never the CPU's flash kernel


def test_math_route_computes_what_torch_computes():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 8, 16, 32), torch.randn(2, 2, 16, 32), torch.randn(2, 2, 16, 32)
    with CudaKernels():
        ours = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(ours, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))


@pytest.mark.parametrize("mask", ["bool", "float"])
def test_math_route_computes_what_torch_computes_with_a_mask(mask):
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 8, 16, 32), torch.randn(2, 2, 16, 32), torch.randn(2, 2, 16, 32)
    m = torch.rand(2, 1, 16, 16) > 0.3
    m[..., 0] = True
    m = m if mask == "bool" else torch.where(m, 0.0, float("-inf"))
    with CudaKernels():
        ours = F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)
    torch.testing.assert_close(ours, F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True))


def test_math_route_takes_inputs_without_a_heads_dimension():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 16, 8), torch.randn(2, 16, 8), torch.randn(2, 16, 8)
    with CudaKernels():
        ours = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(ours, F.scaled_dot_product_attention(q, k, v, is_causal=True))


class Sizes(TorchDispatchMode):
    """(op, bytes) of every tensor an op makes, in order."""

    def __init__(self):
        super().__init__()
        self.made = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage()._cdata for t in torch.utils._pytree.tree_leaves((args, kwargs))
                 if isinstance(t, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in given:  # a new storage
                self.made.append((str(func).split(".")[1], t.untyped_storage().nbytes()))
        return out


def test_math_route_makes_the_tensors_the_gpus_math_kernel_makes():
    """Recorded on the H200 (Qwen2, grouped heads, fp32): the scores, the softmax, a boolean of the scores'
    size and a row flag; the mask is added in place. Through the aten op a fake trace adds the mask out of
    place (one more scores-sized tensor) and sees none of _safe_softmax's temporaries."""
    b, h, s = 2, 8, 64
    scores = b * h * s * s * 4
    with FakeTensorMode():
        q, k, v = torch.empty(b, h, s, 32), torch.empty(b, 2, s, 32), torch.empty(b, 2, s, 32)
        sizes = Sizes()
        with sizes, CudaKernels():
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    big = [(op, n) for op, n in sizes.made if n in (scores, scores // 4)]
    assert big == [("bmm", scores), ("_safe_softmax", scores), ("eq", scores // 4)], big
    assert ("all", b * h * s) in sizes.made


def test_grouped_mm_backward_makes_the_weights_gradient_first_as_torch_does():
    """torch's _grouped_mm backward (derivatives.yaml) computes mat_b's gradient, then mat_a's; the trace's
    stand-in makes them in that order and in the same layout."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    a = torch.randn(64, 32, requires_grad=True)
    w = torch.randn(4, 48, 32, requires_grad=True)  # transformers' layout: (experts, out, in), used transposed
    offs = torch.tensor([16, 32, 48, 64], dtype=torch.int32)

    def grads(fn):
        out = fn(a, w.transpose(-2, -1), offs=offs)
        sizes = Sizes()
        with sizes:
            out.backward(torch.ones_like(out))
        return [n for op, n in sizes.made if op in ("_grouped_mm", "empty", "empty_like", "new_empty")]
    try:
        real = grads(torch._grouped_mm)
    except (RuntimeError, NotImplementedError) as e:  # no CPU kernel for fp32 in this torch
        pytest.skip(f"torch._grouped_mm does not run on this CPU: {str(e).splitlines()[0]}")
    a.grad = w.grad = None
    ours = grads(pc.gpu_grouped_mm)
    assert real == ours == [4 * 48 * 32 * 4, 64 * 32 * 4]
    assert w.grad.shape == w.shape and w.grad.is_contiguous()


def test_autocast_casts_attention_inputs_as_cuda_autocast_does():
    with FakeTensorMode():
        q, k, v = qkv(torch.float32)
        with torch.autocast("cpu", dtype=torch.bfloat16), CudaKernels():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.dtype == torch.bfloat16


def saved_bytes(fn, *args):
    """Bytes autograd keeps for backward of ``fn(*args)``: each storage once."""
    kept = {}

    def pack(t):
        st = t.untyped_storage()
        kept[st._cdata] = st.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return sum(kept.values()), out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_math_route_keeps_what_torchs_math_kernel_keeps(dtype):
    """Falcon's multi-query attention (one key/value head, no enable_gqa: math on a GPU) planned 17% below
    the H100's allocated peak in bf16 autocast: torch's math kernel computes half inputs in fp32 and keeps
    an fp32 softmax of (batch, heads, seq, seq), which the trace kept in bf16."""
    torch.manual_seed(0)
    b, h, s, d = 2, 8, 64, 16
    q = torch.randn(b, h, s, d, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(b, 1, s, d, dtype=dtype, requires_grad=True) for _ in range(2))
    mask = torch.ones(s, s, dtype=torch.bool).tril().expand(b, 1, s, s)
    additive = torch.where(mask, 0.0, float("-inf")).to(dtype)  # as scaled_dot_product_attention converts it
    real, want = saved_bytes(lambda: torch.ops.aten._scaled_dot_product_attention_math(
        q, k, v, additive, 0.0, False)[0])
    ours, out = saved_bytes(pc._math_sdpa, q, k, v, mask, 0.0, False, None, False)
    assert ours == real
    # fp32 whatever the inputs: the softmax, the scaled query, the key and value broadcast to every head
    assert ours == (b * h * s * s + 3 * b * h * s * d) * 4
    assert out.dtype == dtype
    torch.testing.assert_close(out, want)


class MultiQuery(torch.nn.Module):
    """Falcon's attention as transformers 5.17 runs it: one key/value head, a mask, no enable_gqa."""

    def __init__(self, width=64, heads=8, layers=2):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(width, width + 2 * width // heads) for _ in range(layers))

    def forward(self, x):
        b, s, w = x.shape
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril().expand(b, 1, s, s)
        for lin in self.qkv:
            q, k, v = lin(x).view(b, s, self.heads + 2, w // self.heads).split([self.heads, 1, 1], dim=2)
            x = x + F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                                   attn_mask=mask).transpose(1, 2).reshape(b, s, w)
        return x


def test_traced_multi_query_attention_keeps_fp32_softmaxes_under_bf16_autocast(monkeypatch):
    """The traced step's activations at the peak hold each layer's fp32 softmax: half of it was missing."""
    b, s, heads, layers = 2, 128, 8, 2
    batch = (torch.empty(b, s, 64), torch.empty(b, s, 64))

    def activations():
        tr = trace_step(lambda: MultiQuery(64, heads, layers), batch, loss_fn=lambda out, y: out.float().sum(),
                        precision="bf16-autocast", device="cpu", kernels="cuda")
        return plan_from_trace(tr, 0, 1).breakdown["activations"]
    upcast = activations()
    monkeypatch.setattr(torch.backends.cuda, "fp16_bf16_reduction_math_sdp_allowed", lambda: True)
    half = activations()  # what the plan held before: the kernel traced in bf16
    softmax_bf16 = layers * b * heads * s * s * 2
    assert upcast - half >= softmax_bf16
    assert upcast >= 2 * softmax_bf16


def test_rms_norm_keeps_what_cudas_fused_kernel_keeps():
    """CUDA's fused RMSNorm keeps the input, the weight and one fp32 rstd per row; the CPU's composite also
    keeps the normalised input."""
    rows, width = 64, 256
    with FakeTensorMode():
        x = torch.empty(rows, width, requires_grad=True)
        w = torch.empty(width, requires_grad=True)
        cpu, _ = saved_bytes(F.rms_norm, x, (width,), w, 1e-6)
        with CudaKernels():
            gpu, y = saved_bytes(F.rms_norm, x, (width,), w, 1e-6)
        assert gpu == rows * width * 4 + width * 4 + rows * 4
        assert cpu - gpu == rows * width * 4
        y.sum().backward()
        assert y.shape == x.shape and x.grad.shape == x.shape and w.grad.shape == w.shape


def test_dropout_keeps_a_boolean_mask():
    with FakeTensorMode():
        x = torch.empty(8, 8, requires_grad=True)
        ops = Ops()
        with ops, CudaKernels():
            F.dropout(x, 0.1, training=True).sum().backward()
            F.dropout(x, 0.1, training=False)  # eval: nothing dropped, nothing kept
    assert ops.seen["aten.native_dropout.default"] == 1


def test_cross_entropy_under_autocast_takes_the_log_softmax_in_bf16_as_cuda_does():
    torch.manual_seed(0)
    logits, target = torch.randn(16, 50, dtype=torch.bfloat16), torch.randint(0, 50, (16,))
    ops = Ops()
    with torch.autocast("cpu", dtype=torch.bfloat16), ops, CudaKernels():
        loss = F.cross_entropy(logits, target)
    assert ops.dtypes["aten._log_softmax.default"] == torch.bfloat16 and loss.dtype == torch.float32
    want = F.nll_loss(torch.log_softmax(logits, 1).float(), target)  # bf16 log-probabilities, an fp32 loss
    torch.testing.assert_close(loss, want, rtol=0, atol=1e-6)


def test_checkpointed_blocks_recompute_under_the_same_kernels():
    """The autograd engine does not carry function modes into backward: recompute_contexts re-enters
    CudaKernels, or checkpoint refuses the recomputation's tensors."""
    for precision in ("fp32", "bf16-autocast"):
        tr = trace_step(decoder("tiny"), token_batch(4, 32, SIZES["tiny"][0]), loss_fn=lm_loss, precision=precision,
                        checkpointing=True, device="cpu", kernels="cuda")
        assert plan_from_trace(tr, 0, 1).peak_bytes > 0


HF_ATTENTION = {  # a real step of unpadded tokens: no mask, causal; Llama with grouped heads
    "llama": ({"model_type": "llama", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}, (True, True, True, 2)),
    # OPT's model makes a padding mask of ones itself (for its learned positions): the mask code reads it
    "opt": ({"model_type": "opt", "vocab_size": 128, "hidden_size": 64, "ffn_dim": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "word_embed_proj_dim": 64, "max_position_embeddings": 64}, (True, True)),
}


@pytest.mark.parametrize("family", HF_ATTENTION)
def test_hugging_face_attention_gets_the_arguments_of_a_real_step(tmp_path, monkeypatch, family):
    """transformers cannot read a fake tensor's position ids or padding mask, and takes any fake tensor for
    a traced graph; without plan_sources' fix it builds a mask (and expands grouped heads), which a real
    step of the same tokens does not."""
    pytest.importorskip("transformers")
    from mgpu_helpers.tools.plan_sources import make_batch, output_loss, resolve
    cfg, want = HF_ATTENTION[family]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    source = resolve(str(tmp_path))
    batch = make_batch(source, 2, 16, None, None)
    calls, original = [], F.scaled_dot_product_attention

    def logged(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        calls.append((attn_mask is None, bool(is_causal), enable_gqa, k.shape[1]))
        return original(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                        enable_gqa=enable_gqa)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", logged)
    from mgpu_helpers.planner.dynamic import DynamicSizes
    with DynamicSizes():  # as mgpu-plan retraces a step that reads values (OPT's LayerDrop draws a number)
        trace_step(source.model_fn, batch, loss_fn=output_loss, device="cpu", kernels="cpu")
        calls.clear()
        trace_step(source.model_fn, batch, loss_fn=output_loss, device="cpu", kernels="cpu")
    fake = list(calls)
    calls.clear()
    model = source.model_fn()
    x, y = (torch.zeros(t.shape, dtype=t.dtype) for t in batch)
    output_loss(model(x), y).backward()
    assert fake and fake == calls and calls[0][:len(want)] == want


def test_a_plan_traced_with_cuda_kernels_differs_from_the_cpus_where_they_differ():
    batch = token_batch(4, 64, SIZES["tiny"][0])
    gpu = plan_from_trace(trace_step(decoder("tiny"), batch, loss_fn=lm_loss, device="cpu", kernels="cuda"), 0, 1)
    cpu = plan_from_trace(trace_step(decoder("tiny"), batch, loss_fn=lm_loss, device="cpu", kernels="cpu"), 0, 1)
    assert gpu.peak_bytes < cpu.peak_bytes  # fused RMSNorm keeps less
    assert pc.recompute_contexts()[1].__class__.__name__ == "nullcontext"  # outside the mode: nothing re-entered


def test_autocast_casts_as_cudas_lists_do():
    """CUDA autocast runs pow, layer_norm, softmax, sum ... in fp32; CPU autocast leaves them in bf16."""
    with FakeTensorMode():
        x = torch.empty(4, 8, dtype=torch.bfloat16)
        w = torch.empty(8, 8)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            cpu = [torch.pow(x, 3), F.layer_norm(x, (8,)), F.softmax(x, -1), x.sum(), x ** 3]
            with CudaKernels():
                gpu = [torch.pow(x, 3), F.layer_norm(x, (8,)), F.softmax(x, -1), x.sum(), x ** 3]
                linear = F.linear(x.float(), w)  # on both lists alike: bf16
                kept = torch.tanh(x)             # on neither: the input's dtype
    assert [t.dtype for t in cpu] == [torch.bfloat16] * 5
    assert [t.dtype for t in gpu] == [torch.float32] * 5
    assert linear.dtype == torch.bfloat16 and kept.dtype == torch.bfloat16


def test_cat_and_stack_promote_inside_the_kernel_as_on_cuda():
    """CPU autocast lists cat and stack (it casts every input to the widest dtype first: one more tensor);
    CUDA autocast does not, and the kernel promotes as it copies. Hugging Face's DynamicCache concatenates
    its fp32 empty start with each layer's bf16 values: on the GPU one allocation, not two."""
    from mgpu_helpers.planner.cuda import CPU_AUTOCAST_ONLY
    assert {"cat", "stack", "index_copy"} <= CPU_AUTOCAST_ONLY and not {"mm", "pow", "linear"} & CPU_AUTOCAST_ONLY
    with FakeTensorMode():
        empty, v = torch.empty(0), torch.empty(4, 8, dtype=torch.bfloat16)
        for kernels in ("cpu", "cuda"):
            ops = Ops()
            with torch.autocast("cpu", dtype=torch.bfloat16), ops, (CudaKernels() if kernels == "cuda"
                                                                     else contextlib.nullcontext()):
                out = torch.cat([empty, v]), torch.stack([v.float(), v]), torch.concat([empty, v])
            assert [t.dtype for t in out] == [torch.float32] * 3
            assert ops.seen["aten._to_copy.default"] == (4 if kernels == "cpu" else 1)  # .float() alone on CUDA
