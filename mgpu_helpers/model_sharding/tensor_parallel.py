"""Notebook 09, part 2 -- tensor parallelism (exercise 9.2): the Megatron-LM MLP (fc1 column-parallel, fc2
row-parallel, one ``all_reduce`` per pass), and torch's own split (``torch.distributed.tensor.parallel``).
"""
import torch
import torch._dynamo  # noqa: F401  parallelize_module imports it: 1 s in every forked rank, once here instead
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from ..memory import nbytes
from ..runtime.launch import rank_device


class DenseMLP(nn.Module):
    """fc1: Linear(d, h) → ReLU → fc2: Linear(h, d) (weights as nn.Linear keeps them: out × in)."""

    def __init__(self, d: int, h: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def make_mlp(d: int, h: int, seed: int = 0) -> DenseMLP:
    """A DenseMLP from ``seed`` on ``rank_device()``."""
    torch.manual_seed(seed)
    return DenseMLP(d, h).to(rank_device())


def param_bytes(module) -> int:
    """Parameter bytes of ``module``: whole storages (a view costs its base), a DTensor's local shard."""
    return nbytes(module.parameters())


def parameter_bytes_formula(d: int, h: int, world_size: int, element_size: int = 4) -> int:
    """Per-rank parameter bytes of the tensor-parallel MLP: W1, b1, W2 split N ways, b2 whole."""
    return element_size * (2 * d * h // world_size + h // world_size + d)


def torch_tensor_parallel(dense: DenseMLP, device_type: str | None = None):
    """``dense`` parallelized in place by torch on a 1-D mesh of every rank: fc1 Colwise, fc2 RowwiseParallel."""
    mesh = init_device_mesh(device_type or rank_device().type, (dist.get_world_size(),))
    return parallelize_module(dense, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
