"""plan() against real steps on 2 and 4 gloo ranks: every rank's measured peak within 2% (issue 18).

The reference (``planner.validation``) is the profiler's allocation events with c10's all-thread total: it
sees DDP's buckets, FSDP2's re-grown storages and oneDNN's scratch. bench/planner_ranks.py prints the
full table (three model families x four methods x three layouts x world 2 and 4); these are small rows of
it, chosen so that each of the planner's mechanisms is held to a real step at least once.
"""
import pytest
import torch
import torch.nn.functional as F

from mgpu_helpers.planner import plan
from mgpu_helpers.planner.kernels import probe
from mgpu_helpers.planner.models import convnet, decoder, image_batch, lm_loss, tied_frozen, token_batch
from mgpu_helpers.planner.validation import table, validate
from mgpu_helpers.runtime.alloc_reference import AllocationReference
from testkit import record_figure

MODELS = {
    "decoder": (decoder("tiny"), token_batch(4, 32, 512), lm_loss),
    "conv": (convnet(), image_batch(8), F.cross_entropy),
    "tied+frozen": (tied_frozen("tiny"), token_batch(4, 32, 512), lm_loss),
}
ROWS = [  # model, method, world, layout: what each row holds the planner to
    ("decoder", "ddp", 2, "fp32"),                 # DDP's buckets: a second copy of the gradients
    ("decoder", "zero1", 2, "bf16-autocast"),      # ZeroRedundancyOptimizer's uneven partition, per rank
    ("decoder", "fsdp2", 4, "fp32"),               # FSDP2 per block + root: gathered units, prefetch, root kept
    ("decoder", "fsdp2-root", 2, "fsdp-mixed"),    # MixedPrecisionPolicy's bf16 gathered copies
    ("conv", "ddp", 2, "fp32"),                    # oneDNN's convolution scratch
    ("conv", "fsdp2", 2, "fp32"),
    ("tied+frozen", "zero1", 4, "fp32"),           # a tied weight counted once, frozen ones not stepped
    ("tied+frozen", "fsdp2", 2, "fp32"),
]
# the rows whose CPU kernels differ by ISA (bf16 matmuls, oneDNN convolutions): run again by make test under a
# lower oneDNN ISA (tools/cpu_isa.py)
ISA_ROWS = [("decoder", "zero1", 2, "bf16-autocast"), ("decoder", "fsdp2-root", 2, "fsdp-mixed"), ("conv", "ddp", 2, "fp32")]


@pytest.mark.slow
@pytest.mark.parametrize("model,method,world,layout", [
    pytest.param(*r, id="-".join(map(str, r)), marks=[pytest.mark.cpu_figures] if r in ISA_ROWS else []) for r in ROWS])
def test_every_rank_within_two_percent_of_a_real_step(model, method, world, layout):
    model_fn, batch, loss_fn = MODELS[model]
    rows = validate(model_fn, batch, loss_fn=loss_fn, model=model, methods=(method,), world_sizes=(world,),
                    precisions=(layout,), remeasure=3)  # up to 3 more runs while a rank is off (gloo's threads)
    assert len(rows) == world, table(rows)
    for r in rows:
        record_figure(f"ranks {model} {method} {world} {layout} rank {r['rank']}", r["planned"], r["measured"])
        assert r["held"], "\n" + table(rows)   # within 2%, or within the worker threads' slack (validate)


@pytest.mark.slow
def test_without_the_buckets_ddp_would_be_under():
    # The bar can fail: the unwrapped step (what the planner used to give for stage 0) is far below DDP.
    model_fn, batch, loss_fn = MODELS["decoder"]
    rows = validate(model_fn, batch, loss_fn=loss_fn, model="decoder", methods=("ddp",), world_sizes=(2,))
    bare = plan(model_fn, batch, loss_fn=loss_fn, device="cpu")
    assert all(bare.peak_bytes / r["measured"] - 1 < -0.10 for r in rows), table(rows)


@pytest.mark.cpu_figures
@pytest.mark.parametrize("shape", [(8, 32, 32, 32, 3), (4, 16, 16, 64, 3), (8, 3, 32, 32, 3), (8, 32, 64, 16, 3),
                                   (8, 32, 32, 16, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_scratch_line_is_what_onednn_takes(shape, dtype):
    # The planner's figure for each convolution op (measured op by op on this CPU: planner.kernels) held
    # against the most the allocator holds across a whole forward + backward: never below what oneDNN took.
    b, cin, cout, hw, k = shape
    torch.set_num_threads(1)
    x = torch.randn(b, cin, hw, hw, dtype=dtype, requires_grad=True)
    w = torch.randn(cout, cin, k, k, dtype=dtype, requires_grad=True)
    ops = {}

    def run():
        y = torch.ops.aten.convolution.default(x, w, None, [1, 1], [k // 2] * 2, [1, 1], False, [0, 0], 1)
        ops["fwd"] = (x, w)
        y.backward(torch.ones_like(y))
        ops["y"] = y

    run()  # oneDNN's first call per shape plans its primitive
    with AllocationReference() as ref:   # every allocation, counted from here
        run()
    taken = ref.peak_bytes
    y_bytes = ops["y"].numel() * ops["y"].element_size()
    args_f = (x, w, None, [1, 1], [k // 2] * 2, [1, 1], False, [0, 0], 1)
    args_b = (ops["y"], x, w, None, [1, 1], [k // 2] * 2, [1, 1], False, [0, 0], 1, [True, True, False])
    planned = max(y_bytes + probe(torch.ops.aten.convolution.default, args_f),
                  # backward: the output and its all-ones gradient, the input and weight gradients, scratch
                  2 * y_bytes + x.numel() * x.element_size() + w.numel() * w.element_size()
                  + probe(torch.ops.aten.convolution_backward.default, args_b))
    assert planned >= taken, (planned, taken)
    assert planned <= 1.05 * taken + 4096, (planned, taken)


@pytest.mark.cpu_figures
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
def test_chunk_cat_scratch_line_is_what_the_cpu_kernel_takes(grad_dtype):
    """FSDP2 copies gradients into its fp32 reduce-scatter buffer with _chunk_cat: converting bf16 inputs, the
    CPU kernel copies each one first (the largest counts); same dtype, nothing. The profiler says how much."""
    from mgpu_helpers.planner.kernels import chunk_cat_scratch
    from mgpu_helpers.runtime.alloc_reference import AllocationReference
    grads = [torch.randn(256, 512, dtype=grad_dtype), torch.randn(1000, dtype=grad_dtype),
             torch.randn(300, 512, dtype=grad_dtype)]
    n = sum(g.numel() for g in grads)
    out = torch.empty(2, (n + 1) // 2, dtype=torch.float32)
    with AllocationReference() as ref:
        with torch.profiler.record_function("chunk_cat"):
            torch._chunk_cat(grads, 0, 2, out=out)
    measured = ref.peak_in("chunk_cat") - ref.at("chunk_cat")
    assert measured == chunk_cat_scratch(torch.ops.aten._chunk_cat.out, (grads, 0, 2), {"out": out})
    assert measured == (300 * 512 * 2 if grad_dtype == torch.bfloat16 else 0)


def _reduce_scatter_rank(rank, world, rows):
    import torch.distributed as dist
    from mgpu_helpers.runtime.alloc_reference import AllocationReference
    inp = torch.randn(rows, 512)
    out = torch.empty(rows // world, 512)
    dist.reduce_scatter_tensor(out, inp)  # a first one: gloo sets itself up
    with AllocationReference() as ref:
        with torch.profiler.record_function("reduce_scatter"):
            dist.reduce_scatter_tensor(out, inp)
    return ref.peak_in("reduce_scatter") - ref.at("reduce_scatter"), inp.numel() * inp.element_size()


@pytest.mark.cpu_figures
def test_reduce_scatter_scratch_line_is_what_gloo_takes():
    """gloo's reduce-scatter (FSDP2's on CPU ranks) reduces a copy of its whole input; the plan counts it inside
    the op (FSDP2 root-only with MixedPrecisionPolicy on 2 ranks peaked there: 0.24% under before, the 5.3M
    decoder 2.20%). Two real gloo ranks say how much; the planner's rule, read off the same op, says the same."""
    from mgpu_helpers.planner.kernels import cpu_kernel_scratch
    from mgpu_helpers.runtime.launch import run_ranks
    rows = 300
    got = run_ranks(_reduce_scatter_rank, 2, rows, timeout=300)
    inp, out = torch.randn(rows, 512), torch.empty(rows // 2, 512)
    planned = cpu_kernel_scratch(torch.ops.c10d._reduce_scatter_base_.default, (out, inp, None, None, True, -1), {})
    from mgpu_helpers.planner.kernels import fake_collectives
    with fake_collectives():  # a rank measured in one process under a fake group (notebook 12): no gloo, no copy
        assert cpu_kernel_scratch(torch.ops.c10d._reduce_scatter_base_.default, (out, inp, None, None, True, -1), {}) == 0
    for taken, input_bytes in got:
        assert planned == input_bytes
        assert input_bytes <= taken <= input_bytes + 64, (taken, input_bytes)  # the copy, and a few bytes more
