"""What the judges compare against where torch itself cannot serve, by exercise (imported only inside
``Check.judge``, by the tests, the benches and the lesson scripts; masked by the grading sandbox). Nothing here is
for a notebook."""

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DistributedSampler

from ...accumulation import no_sync_context
from ...checkpointing import no_checkpointing, plan_for
from ...memory import make_optimizer, nbytes
from ...model_sharding import DenseMLP, stage_bounds
from ...profiling import scenario, scenario_inputs, train_step
from ...runtime.tracker import MemoryTracker
from ...sharding.zero import ceil_div


def measured_training_state(model: nn.Module, optimizer: str, precision: str, batch: int = 4) -> dict[str, int]:
    """1.1: the bytes one real training step leaves behind, by category. "mixed": a bf16 model and an fp32 master
    copy the optimizer updates. Adam's 0-d ``step`` counter stays on the CPU even on a GPU: not counted."""
    work = model.to(torch.bfloat16 if precision in ("bf16", "mixed") else torch.float32)
    master = [p.detach().float().clone() for p in work.parameters()] if precision == "mixed" else None
    opt = make_optimizer(optimizer, master if master is not None else work.parameters())
    x = torch.randn(batch, next(work.parameters()).shape[1], dtype=next(work.parameters()).dtype)
    work(x).float().square().mean().backward()
    if master is not None:  # the optimizer updates the fp32 master from the bf16 gradients
        for m, p in zip(master, work.parameters()):
            m.grad = p.grad.float()
    opt.step()
    if master is not None:
        for m, p in zip(master, work.parameters()):
            p.data.copy_(m)
            m.grad = None  # the fp32 gradient copy is a temporary
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0]
    return {"parameters": nbytes(work.parameters()),
            "gradients": nbytes(p.grad for p in work.parameters()),
            "optimizer_state": nbytes(state) + (nbytes(master) if master else 0)}


def peak_figures(case: dict) -> dict:
    """Before the step, the earlier peak, the step's own peak and what it left: 2.1's scenario, measured."""
    with scenario(case) as (step, t):
        before, old_peak = t.current_bytes, t.peak_bytes
        t.reset_peak()
        step()
        return {"before": before, "old_peak": old_peak, "peak": t.peak_bytes, "after": t.current_bytes}


def phase_peaks(case: dict) -> tuple[dict, dict]:
    """(peak bytes within each phase, bytes at the end of each phase) of the reference step, for 2.2."""
    model, (x, y) = scenario_inputs(case)
    opt = make_optimizer(case["optimizer"], model.parameters())
    with MemoryTracker(model, opt) as t:
        train_step(model, opt, x, y, mark=t.mark)
    return t.phase_peaks(), {phase: total for phase, total, _ in t.timeline}


def accumulate(model, loss_fn, inputs, targets, k, skip=no_sync_context) -> float:
    """5.1/5.2: forward/backward ``k`` equal micro-batches with loss/k; the first k-1 inside ``skip(model)``
    (``skip=None`` for a model with nothing to sync). Returns the accumulated loss (the big batch's)."""
    if len(inputs) % k:
        raise ValueError(f"k={k} does not divide the batch of {len(inputs)}")
    total = 0.0
    for i, (x, y) in enumerate(zip(inputs.tensor_split(k), targets.tensor_split(k))):
        last = i == k - 1
        with contextlib.nullcontext() if last or skip is None else skip(model):
            loss = loss_fn(model(x), y) / k  # mean over the micro-batch / k = its share of the big batch's mean
            loss.backward()
        total += loss.item()
    return total


def run_plan(blocks, x, plan, context_fn=None):
    """7.1: run a plan of :func:`plan_for`'s form, non-reentrant; ``context_fn``: e.g. :func:`selective_context`."""
    start, extra = 0, {} if context_fn is None else {"context_fn": context_fn}
    for n, ck in plan:
        seg = blocks[start:start + n]  # passed as an argument, with its input: what checkpoint recomputes from
        x = checkpoint(no_checkpointing, seg, x, use_reentrant=False, **extra) if ck else no_checkpointing(seg, x)
        start += n
    return x


def checkpoint_every(blocks, x, k: int, context_fn=None):
    """Each segment of k blocks under checkpointing."""
    return run_plan(blocks, x, plan_for(len(blocks), k), context_fn)


def reference_reduce_scatter(params):
    """8.2: the padded flat gradient, reduce-scattered and averaged; every p.grad freed."""
    world = dist.get_world_size()
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    n = ceil_div(flat.numel(), world)
    flat = F.pad(flat, (0, n * world - flat.numel()))
    for p in params:
        p.grad = None
    shard = flat.new_empty(n)
    dist.reduce_scatter_tensor(shard, flat)
    return shard / world


def gpipe_step(model: nn.Sequential, inputs, targets, n_micro: int):
    """9.1: GPipe forward + backward of ``model`` split over the ranks (each uses its own stage of the same model
    and batch). Leaves each stage's gradients in its parameters; returns the mean loss on the last rank, else None."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if len(inputs) % n_micro:
        raise ValueError(f"n_micro={n_micro} does not divide the batch of {len(inputs)} samples")
    start, end = stage_bounds(len(model), world)[rank]
    stage, first, last = model[start:end], rank == 0, rank == world - 1
    saved, loss = [], 0.0
    for x, y in zip(inputs.chunk(n_micro), targets.chunk(n_micro)):  # all forwards...
        if not first:
            x = torch.empty_like(x)
            dist.recv(x, src=rank - 1)
            x.requires_grad_()  # its gradient is what we send back
        out = stage(x)
        out = F.cross_entropy(out, y) / n_micro if last else out  # the micro-batch's share of the mean
        if not last:
            dist.send(out.detach(), dst=rank + 1)
        saved.append((x, out))
    for x, out in saved:  # ...then all backwards
        grad = None
        if not last:
            grad = torch.empty_like(out)
            dist.recv(grad, src=rank + 1)
        out.backward(grad)
        loss += out.item() if last else 0.0
        if not first:
            dist.send(x.grad, dst=rank - 1)
    return loss if last else None


class CopyToParallel(torch.autograd.Function):
    """9.2, Megatron's f: forward passes x through; backward sums the partial gradients of x over the ranks."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()  # never reduce a buffer autograd may hand to someone else too
        dist.all_reduce(grad)
        return grad


class ReduceFromParallel(torch.autograd.Function):
    """9.2, Megatron's g: forward sums the partial outputs over the ranks; backward passes the gradient on."""

    @staticmethod
    def forward(ctx, partial):
        total = partial.clone()
        dist.all_reduce(total)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad


class TensorParallelMLP(nn.Module):
    """Rank ``rank``'s share of ``dense`` (a DenseMLP): fc1 column-parallel, fc2 row-parallel; fc2's bias
    whole on every rank. Shards are copies: a slice of ``dense``'s weights would keep all of it alive."""

    def __init__(self, dense: DenseMLP, rank: int, world_size: int):
        super().__init__()
        d, h = dense.fc1.in_features, dense.fc1.out_features
        if world_size < 1 or h % world_size:
            raise ValueError(f"hidden size {h} is not divisible by world_size={world_size}: tensor parallelism "
                             "gives every rank an equal slice of the hidden features")
        part = h // world_size
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


def sampler_shard(n, world_size, rank, shuffle, seed, epoch, drop_last) -> list[int]:
    """What torch's DistributedSampler yields for ``rank`` in ``epoch`` (the ground truth of check 10.1)."""
    s = DistributedSampler(range(n), num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed,
                           drop_last=drop_last)
    s.set_epoch(epoch)
    return list(s)


def sampler_variant(n, world, shuffle, seed, epoch, drop_last, *, pad=True, strided=True, use_epoch=True):
    """10.1: DistributedSampler's rule written out for every rank, with one part left wrong (naming mistakes)."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch * use_epoch)).tolist() \
        if shuffle else list(range(n))
    per = ceil_div(n - world, world) if drop_last and n % world else ceil_div(n, world)
    total = per * world
    if drop_last:
        order = order[:total]
    elif pad == "once":  # the index list repeated only once: too short when n < total / 2
        order = order + order[:total - n]
    elif pad:
        order = (order * ceil_div(total, max(n, 1)))[:total]
    if strided:
        return [order[r:total:world] for r in range(world)]
    return [order[r * per:(r + 1) * per] for r in range(world)]
