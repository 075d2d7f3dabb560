"""Questions the H200 raised about the planner's fake trace, answered by listing ops (needs a GPU).

    PYTHONPATH=. python3 bench/planner_gpu_diag.py [attention] [peak] [conv] [reduce] [efficient]

1. attention: does ``planner.cuda.cuda_backend`` pick the kernel torch picks on this GPU
   (``torch._fused_sdp_choice``) over dtypes x grouped heads x mask x causal x head sizes? Every mismatch
   is printed.
2. peak: the 168M decoder in bf16 autocast, traced on the CPU with ``kernels="cuda"`` and traced on this
   GPU's fake tensors under torch's own dispatch (no ``planner.cuda`` emulation): bytes alive at the peak by the op that made them, side by side (where the two
   traces differ, the CPU trace runs some op as the GPU does not).
3. conv: the ResNet of bench/plan_gpu.py on this GPU, fp32 and bf16 autocast + checkpointing: the bytes
   each op takes beyond what it leaves behind (its workspace: max allocated during the op minus allocated
   after), against the planner's ``cudnn_workspace`` for convolutions, and where the reserve grows.
4. reduce: sums and means over shapes a training step reduces (norm weights' and biases' gradients, losses,
   row statistics): every request the allocator gets inside the op beyond its output, against the
   planner's ``reduce_workspace``. Prints each row and the count that differ.
5. efficient: every request inside the memory-efficient attention's backward (fp32 and bf16, heads, lengths,
   head sizes) beside the three gradients it returns.
"""
import collections
import contextlib
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

from mgpu_helpers.planner import trace as planner_trace  # noqa: E402
from mgpu_helpers.planner.cuda import cuda_backend  # noqa: E402
from mgpu_helpers.planner.accounting import _CONVS, cudnn_workspace, reduce_workspace  # noqa: E402
from mgpu_helpers.planner.trace import trace_step  # noqa: E402
from mgpu_helpers.planner.plans import plan_from_trace  # noqa: E402

MiB = 2 ** 20


def attention():
    from torch.nn.attention import SDPBackend
    names = {int(SDPBackend.FLASH_ATTENTION): "flash", int(SDPBackend.CUDNN_ATTENTION): "flash",
             int(SDPBackend.EFFICIENT_ATTENTION): "efficient", int(SDPBackend.MATH): "math"}
    rows = bad = 0
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        for hk in (16, 4):
            for mask in (False, True):
                for causal in (False, True):
                    for d in (64, 80, 128, 256, 320, 30):
                        if mask and causal:
                            continue
                        q = torch.randn(2, 16, 128, d, dtype=dt, device="cuda", requires_grad=True)
                        k, v = (torch.randn(2, hk, 128, d, dtype=dt, device="cuda", requires_grad=True)
                                for _ in range(2))
                        m = torch.ones(2, 1, 128, 128, dtype=torch.bool, device="cuda") if mask else None
                        gqa = hk != 16
                        real = names.get(int(torch._fused_sdp_choice(q, k, v, m, 0.0, causal, enable_gqa=gqa)), "?")
                        ours = cuda_backend(q, k, v, m, 0.0, causal, gqa)
                        rows += 1
                        if real != ours:
                            bad += 1
                            print(f"1. mismatch: {dt} heads 16/{hk} mask {mask} causal {causal} head {d}: "
                                  f"torch {real}, planner {ours}")
    print(f"1. attention kernels: {rows - bad} of {rows} cases as torch chooses")


def peak():
    from mgpu_helpers.tools.plan_sources import make_batch, output_loss, resolve
    src = resolve("plan_gpu:decoder")
    batch = make_batch(src, 4, 512, None, None)
    cls = planner_trace.FakeTracker
    orig_dispatch, orig_add, orig_sample = cls.__torch_dispatch__, cls._add, cls._sample
    state = {}

    def dispatch(self, func, types, args=(), kwargs=None):
        state["op"] = str(func)
        return orig_dispatch(self, func, types, args, kwargs)

    def add(self, st, cat):
        orig_add(self, st, cat)
        state["made"][st._cdata] = state.get("op", "?")

    def sample(self):
        before = self._peak
        orig_sample(self)
        if self._peak > before:
            state["at_peak"] = collections.Counter()
            for key, rec in self._recs.items():
                state["at_peak"][(state["made"].get(key, "before the step"), rec.cat)] += rec.nbytes
    cls.__torch_dispatch__, cls._add, cls._sample = dispatch, add, sample
    out, emulation = {}, planner_trace.CudaKernels
    try:
        for dev in ("cpu", "cuda"):
            state.clear()
            state["made"] = {}
            if dev == "cuda":  # torch's own CUDA dispatch, not the planner's emulation of it
                planner_trace.CudaKernels = contextlib.nullcontext
            tr = trace_step(src.model_fn, batch, loss_fn=output_loss, precision="bf16-autocast", device=dev,
                            kernels="cuda", round_to=512)
            out[dev] = (plan_from_trace(tr, 0, 1).peak_bytes, state.get("at_peak", collections.Counter()))
    finally:
        cls.__torch_dispatch__, cls._add, cls._sample = orig_dispatch, orig_add, orig_sample
        planner_trace.CudaKernels = emulation
    print(f"2. decoder bf16 autocast peak: traced on cpu {out['cpu'][0]:,} B, on cuda {out['cuda'][0]:,} B")
    keys = sorted(set(out["cpu"][1]) | set(out["cuda"][1]), key=lambda k: -max(out["cpu"][1][k], out["cuda"][1][k]))
    print(f"   {'made by':<58} {'category':<16} {'cpu MiB':>9} {'cuda MiB':>9}")
    for k in keys:
        a, b = out["cpu"][1][k], out["cuda"][1][k]
        if a != b or a > 50 * MiB:
            print(f"   {k[0][:58]:<58} {k[1]:<16} {a / MiB:>9.1f} {b / MiB:>9.1f}{'  <-' if a != b else ''}")


class OpWorkspace(TorchDispatchMode):
    """Each op's bytes beyond what it leaves (max allocated during it minus allocated after)."""

    def __init__(self):
        super().__init__()
        self.rows = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        r0 = torch.cuda.memory_reserved()
        torch.cuda.reset_peak_memory_stats()
        out = func(*args, **(kwargs or {}))
        ws = torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()
        grew = torch.cuda.memory_reserved() - r0
        planned = cudnn_workspace(func, args) if func in _CONVS else None
        if ws > 0 or grew > 0 or planned is not None:
            self.rows.append((str(func), ws, planned, grew, _shapes(args)))
        return out


def _shapes(args):
    return " ".join("x".join(map(str, a.shape)) for a in args[:3] if isinstance(a, torch.Tensor))


def conv():
    from plan_gpu import resnet
    from mgpu_helpers.planner.trace import apply_checkpointing, make_optimizer, train_step
    from mgpu_helpers.tools.plan_sources import output_loss
    for prec, ck in (("fp32", False), ("bf16-autocast", True)):
        torch.manual_seed(0)
        model = resnet().cuda()
        if ck:
            apply_checkpointing(model)
        opt = make_optimizer(model, "adam")
        batch = (torch.zeros(64, 3, 224, 224, device="cuda"), torch.zeros(64, dtype=torch.long, device="cuda"))
        train_step(model, opt, batch, output_loss, precision=prec)  # warm-up: Adam's state, cuDNN's plans
        mode = OpWorkspace()
        with mode:
            train_step(model, opt, batch, output_loss, precision=prec)
        print(f"3. conv net {prec}{' + ckpt' if ck else ''}: ops with a workspace, a planned one, or a reserve "
              f"that grew (MiB)")
        print(f"   {'op':<44} {'ws real':>8} {'planned':>8} {'grew':>7}  shapes")
        agg = collections.defaultdict(lambda: [0, 0, 0, 0.0, 0.0])
        for name, ws, planned, grew, shapes in mode.rows:
            print(f"   {name[:44]:<44} {ws / MiB:>8.1f} {'-' if planned is None else f'{planned / MiB:8.1f}':>8} "
                  f"{grew / MiB:>7.1f}  {shapes}")
            a = agg[name]
            a[0] += 1
            a[1] = max(a[1], ws)
            a[2] += grew
            a[3] += ws
            a[4] += planned or 0
        for name, (n, mx, grew, tot, pl) in agg.items():
            print(f"   total {name[:38]:<38} {n:>4} ops: ws max {mx / MiB:.1f}, sum {tot / MiB:.1f}, planned sum "
                  f"{pl / MiB:.1f}; reserve grew {grew / MiB:.1f}")
        del model, opt, batch
        torch.cuda.empty_cache()


def reduce():
    cases = [((4, 1024, 1024), (0, 1)), ((4, 1024, 2048), (0, 1)), ((4096, 2816), (0,)), ((4096, 50304), (0,)),
             ((8192, 1024), (0,)), ((4, 2048, 5632), (0, 1)), ((4, 1024, 1024), (2,)), ((4, 1024, 1024), None),
             ((4096, 32000), (1,)), ((16, 64, 64), (0,)), ((4, 16, 1024, 64), (0, 2)), ((2, 4096, 4096), (0, 1))]
    bad = 0
    for shape, dims in cases:
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(shape, device="cuda", dtype=dtype)
            for op in (torch.sum, torch.mean):
                torch.cuda.synchronize()
                torch.cuda.memory._record_memory_history(context=None, stacks="python")
                out = op(x) if dims is None else op(x, dims)
                torch.cuda.synchronize()
                ev = torch.cuda.memory._snapshot()["device_traces"][0]
                torch.cuda.memory._record_memory_history(enabled=None)
                outb = -(-out.numel() * out.element_size() // 512) * 512
                extra = [e["size"] for e in ev if e["action"] == "alloc"]
                if outb in extra:
                    extra.remove(outb)
                got = max([n for n in extra if n > 512], default=0)  # the semaphores' 512 B block aside
                meta = x.to("meta")
                plan = reduce_workspace(None, (meta,) if dims is None else (meta, list(dims)))
                plan = -(-plan // 512) * 512 if plan > 512 else 0
                bad += got != plan
                print(f"  {op.__name__:<4} {str(shape):<22} dims {str(dims):<8} {str(dtype)[6:]:<9} GPU {got:>12,} "
                      f"planned {plan:>12,} {'' if got == plan else '  <- differs'}")
                del out
            del x
    print(f"reduce: {bad} of {len(cases) * 4} rows differ")


def efficient():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    for dtype in (torch.float32, torch.bfloat16):
        for b, h, hk, l, d in ((4, 16, 16, 1024, 64), (4, 16, 16, 2048, 64), (2, 8, 8, 1024, 128), (4, 16, 4, 1024, 64),
                               (1, 32, 32, 4096, 128), (4, 16, 16, 1000, 64), (8, 12, 12, 512, 64)):
            q = torch.randn(b, h, l, d, device="cuda", dtype=dtype, requires_grad=True)
            k, v = (torch.randn(b, hk, l, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
            try:
                with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                         enable_gqa=hk != h)
            except RuntimeError as e:  # a shape the kernel refuses (e.g. grouped heads): say so, go on
                print(f"  {str(dtype)[6:]:<9} b{b} h{h} kv{hk} l{l} d{d}: refused ({str(e).splitlines()[0]})")
                continue
            g = torch.randn_like(o)
            torch.cuda.synchronize()
            torch.cuda.memory._record_memory_history(context=None, stacks="python")
            o.backward(g)
            torch.cuda.synchronize()
            ev = torch.cuda.memory._snapshot()["device_traces"][0]
            torch.cuda.memory._record_memory_history(enabled=None)
            sizes = [e["size"] for e in ev if e["action"] == "alloc"]
            print(f"  {str(dtype)[6:]:<9} b{b} h{h} kv{hk} l{l} d{d}: grads {q.numel() * q.element_size():,} / "
                  f"{k.numel() * k.element_size():,}; requests {[f'{n:,}' for n in sizes]}")
            del q, k, v, o, g


if __name__ == "__main__":
    print("torch", torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")
    if not torch.cuda.is_available():
        sys.exit("planner_gpu_diag.py needs a CUDA GPU")
    todo = sys.argv[1:] or ["attention", "peak", "conv", "reduce", "efficient"]
    for name in todo:
        try:
            {"attention": attention, "peak": peak, "conv": conv, "reduce": reduce, "efficient": efficient}[name]()
        except Exception as e:  # one question failing must not hide the others' answers
            import traceback
            traceback.print_exc()
            print(f"{name}: failed: {type(e).__name__}: {e}")
