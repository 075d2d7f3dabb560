"""Exercise 9.2's contract written out: Megatron's f and g and the tensor-parallel MLP, for the tests, the
GPU bench and the module's script (never for a notebook)."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from ...model_sharding.tensor_parallel import DenseMLP


class CopyToParallel(torch.autograd.Function):
    """Megatron's f: forward passes x through; backward sums the partial gradients of x over the ranks."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()  # never reduce a buffer autograd may hand to someone else too
        dist.all_reduce(grad)
        return grad


class ReduceFromParallel(torch.autograd.Function):
    """Megatron's g: forward sums the partial outputs over the ranks; backward passes the gradient through
    (each rank's partial output contributed with weight 1 to the sum)."""

    @staticmethod
    def forward(ctx, partial):
        total = partial.clone()
        dist.all_reduce(total)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad


def _check_split(h: int, world_size: int) -> int:
    if world_size < 1 or h % world_size:
        raise ValueError(f"hidden size {h} is not divisible by world_size={world_size}: tensor parallelism "
                         "gives every rank an equal slice of the hidden features")
    return h // world_size


class TensorParallelMLP(nn.Module):
    """Rank ``rank``'s share of ``dense`` (a DenseMLP): fc1 column-parallel, fc2 row-parallel; fc2's bias
    whole on every rank. Shards are copies: a slice of ``dense``'s weights would keep all of it alive."""

    def __init__(self, dense: DenseMLP, rank: int, world_size: int):
        super().__init__()
        d, h = dense.fc1.in_features, dense.fc1.out_features
        part = _check_split(h, world_size)
        rows = slice(rank * part, (rank + 1) * part)
        dev = dense.fc1.weight.device
        self.fc1, self.fc2 = nn.Linear(d, part, device=dev), nn.Linear(part, d, device=dev)
        with torch.no_grad():
            self.fc1.weight.copy_(dense.fc1.weight[rows])
            self.fc1.bias.copy_(dense.fc1.bias[rows])
            self.fc2.weight.copy_(dense.fc2.weight[:, rows])
            self.fc2.bias.copy_(dense.fc2.bias)

    def forward(self, x):
        x = CopyToParallel.apply(x)
        partial = F.linear(torch.relu(self.fc1(x)), self.fc2.weight)  # this rank's share of the output
        return ReduceFromParallel.apply(partial) + self.fc2.bias   # bias once, after the sum
