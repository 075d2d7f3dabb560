"""Notebook 01 -- where training memory goes, by formula (exercises 1.1 and 1.2, ``checks.memory``) and by
``MemoryTracker``; and the builders later faces share: ``mlp``, ``make_batch``, ``make_optimizer``, ``nbytes``.
"""
import contextlib

import torch
from torch import nn

from .runtime.launch import rank_device

BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def mlp(widths: list[int], dtype: torch.dtype = torch.float32, seed: int = 0, tie: tuple[int, int] | None = None,
        freeze: tuple[int, ...] = (), device=None, bias: bool = True) -> nn.Sequential:
    """Linear → ReLU → … → Linear from ``seed``, drawn on the CPU (the same on every rank), on ``device`` (default
    ``rank_device()``). ``tie=(i, j)``: Linear j's weight *is* Linear i's; ``freeze``: Linears frozen."""
    torch.manual_seed(seed)
    lins = [nn.Linear(a, b, bias=bias) for a, b in zip(widths[:-1], widths[1:])]
    if tie is not None:
        lins[tie[1]].weight = lins[tie[0]].weight
    for i in freeze:
        lins[i].weight.requires_grad_(False)
    model = nn.Sequential(*[m for i, lin in enumerate(lins) for m in ([nn.ReLU()] if i else []) + [lin]])
    return model.to(device or rank_device(), dtype)


def make_batch(n: int, d_in: int, classes: int, seed: int = 1, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` inputs and labels from ``seed`` by a CPU generator of their own, on ``device`` (``rank_device()``)."""
    g, device = torch.Generator().manual_seed(seed), device or rank_device()
    return torch.randn(n, d_in, generator=g).to(device), torch.randint(0, classes, (n,), generator=g).to(device)


def make_optimizer(name: str, params, lr: float = 1e-3) -> torch.optim.Optimizer:
    # foreach=True is CUDA's default; keep it on every device so CPU and GPU figures match.
    kwargs = {"sgd": {}, "momentum": {"momentum": 0.9, "foreach": True}, "adam": {"foreach": True}}
    if name not in kwargs:
        raise ValueError(f"unknown optimizer {name!r}: use 'sgd', 'momentum' or 'adam'")
    return (torch.optim.Adam if name == "adam" else torch.optim.SGD)(params, lr=lr, **kwargs[name])


def nbytes(tensors) -> int:
    """Bytes of the distinct storages of ``tensors`` (a view counts its base once; a DTensor: its local shard)."""
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    storages = [t.untyped_storage() for t in local if isinstance(t, torch.Tensor)]
    return sum({s.data_ptr(): s.nbytes() for s in storages}.values())


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's intra-op threads set to ``n`` inside, restored after. (torch.utils.benchmark's set_torch_threads
    does the same, but importing it calls torch.cuda.is_available() (torch/utils/cpp_extension.py), which
    poisons fork: CUDA then fails in every rank the forkserver forks.)"""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
