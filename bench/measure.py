"""The one way bench/ measures a step on the CUDA allocator (every *_gpu.py bench that holds a figure to it).

    peak = cuda_step_peak(step, held=lambda: [*model.parameters(), *opt_state_tensors])

``step()`` runs once as a warm-up (Adam's state, cuBLAS's workspace and autocast's kernels come into being),
then once measured: the peak statistics are reset and ``max_memory_allocated()`` is read after a
synchronize. What was allocated before the measured step beyond the storages of ``held()`` (each rounded up
to the allocator's 512-byte block) is subtracted: the cuBLAS workspace and other memory no tensor owns, which
a plan of tensors does not count (the workspace comes from the caching allocator: aten/src/ATen/cuda/
CublasHandlePool.cpp).
"""
import torch

from mgpu_helpers.runtime.tracker import CUDA_BLOCK  # the allocator's 512-byte block


def held_bytes(tensors, block=CUDA_BLOCK):
    """Bytes of the distinct CUDA storages among ``tensors``, each rounded up to the allocator's block."""
    seen = {}
    for t in tensors:
        if torch.is_tensor(t) and t.device.type == "cuda":
            s = t.untyped_storage()
            seen[s._cdata] = -(-s.nbytes() // block) * block
    return sum(seen.values())


def optimizer_state(opt):
    """The optimizer's state tensors (Adam's moments and step counters)."""
    return [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]


def cuda_step_peak(step, held, warmup=1):
    """``max_memory_allocated()`` over one ``step()`` after ``warmup`` steps, minus what no tensor in
    ``held()`` owns. Returns ``(peak, extra)``: the step's peak and the subtracted bytes."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    extra = torch.cuda.memory_allocated() - held_bytes(held())
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - extra, extra
