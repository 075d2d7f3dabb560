"""Notebook 09 on one GPU: the single-rank parts and the per-rank accounting at world size 1 on CUDA.

    PYTHONPATH=. python3 bench/model_sharding_gpu.py

Prints (1) a GPipe step at world size 1 (NCCL, one rank on cuda:0; 4 micro-batches) against one process:
gradients and loss equal, and its step clock; (2) the tensor-parallel MLP at world size 1 (TensorParallelMLP and
torch's parallelize_module on a CUDA DeviceMesh): outputs and gradients equal the dense MLP, parameter bytes
from the tracker (on CUDA: the allocator) beside the formula; (3) the same bytes on the CPU for comparison.
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing
from mgpu_helpers.runtime.launch import rank_device, run_ranks  # noqa: E402
from mgpu_helpers.memory import make_batch  # noqa: E402
from mgpu_helpers.model_sharding import (StepRecorder, make_mlp, make_model, param_bytes,  # noqa: E402
                                         parameter_bytes_formula, single_process_step, torch_tensor_parallel)
from mgpu_helpers.checks.references import gpipe_step  # noqa: E402
from mgpu_helpers.checks.references import TensorParallelMLP  # noqa: E402

D, H = 256, 1024


def pipeline_world1(rank, world):
    dev = rank_device()
    model, base = make_model(6, 64).to(dev), make_model(6, 64).to(dev)
    x, y = (t.to(dev) for t in make_batch(32, 64, 64))
    with StepRecorder(model, 0) as rec:
        loss = gpipe_step(model, x, y, 4)
    base_loss = single_process_step(base, x, y)
    same = all(torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6) for p, q in zip(model.parameters(), base.parameters()))
    return f"{dev}: GPipe world 1, 6 layers, 4 micro-batches: grads equal {same}, loss {loss:.6f} vs {base_loss:.6f}, " \
           f"{rec.clock} steps (2·(m+p-1) = 8)"


def tp_world1(rank, world):
    dev = rank_device()
    dense = make_mlp(D, H).to(dev)
    tp = TensorParallelMLP(dense, rank, world)
    x = torch.randn(16, D, device=dev)
    xt, xd = x.clone().requires_grad_(), x.clone().requires_grad_()
    yt, yd = tp(xt), dense(xd)
    yt.sum().backward()
    yd.sum().backward()
    ok = torch.allclose(yt, yd, rtol=1e-4, atol=1e-5) and torch.allclose(xt.grad, xd.grad, rtol=1e-4, atol=1e-5)
    try:
        ttp = torch_tensor_parallel(make_mlp(D, H).to(dev), dev.type)
        torch_ok, torch_bytes = torch.allclose(ttp(x), yd, rtol=1e-4, atol=1e-5), param_bytes(ttp)
    except Exception as e:  # report, do not hide
        torch_ok, torch_bytes = f"{type(e).__name__}: {str(e).splitlines()[0]}", None
    return (f"{dev}: tensor-parallel MLP d={D} h={H} world {world}: equal dense {ok}; parameter bytes "
            f"{param_bytes(tp)} (formula {parameter_bytes_formula(D, H, world)}); torch parallelize_module: equal "
            f"{torch_ok}, bytes {torch_bytes}")


if __name__ == "__main__":
    print("torch", torch.__version__, "| GPUs:", torch.cuda.device_count(),
          torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
    for fn in (pipeline_world1, tp_world1):
        print(run_ranks(fn, 1)[0])                         # NCCL on cuda:0 where there is a GPU
        print(run_ranks(fn, 1, backend="gloo")[0])         # the CPU figures, for comparison
