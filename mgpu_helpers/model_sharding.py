"""Notebook 09 -- model sharding: pipeline parallelism, a model's layers split across ranks (exercise 9.1), and
tensor parallelism, one layer's weights split (9.2: the Megatron-LM MLP, fc1 column-parallel, fc2 row-parallel,
one ``all_reduce`` per pass; and torch's own split). Checks in ``checks.model_sharding``. The script (a GPipe
step and a tensor-parallel MLP against one process) judges with the checks' references, so it lives with them::

    torchrun --nproc-per-node 2 -m mgpu_helpers.checks model_sharding
    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint $HEAD_NODE:29500 \\
        -m mgpu_helpers.checks model_sharding   # on each of 2 nodes (tests/test_multinode.py: localhost)
    python -m mgpu_helpers.checks model_sharding   # no torchrun: 2 ranks via run_ranks
"""
import datetime
import time
import warnings

import matplotlib.pyplot as plt
import torch
import torch._dynamo  # noqa: F401  parallelize_module imports it: 1 s in every forked rank, once here instead
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn import functional as F

from .memory import make_batch, nbytes
from .runtime.launch import rank_device

P2P_TIMEOUT = 3.0  # seconds a recorded send/recv may wait: the checks' ranks exchange tiny tensors


def make_model(n_layers: int, width: int, seed: int = 0) -> nn.Sequential:
    """``n_layers`` blocks Linear(width, width) → Tanh from ``seed``, on ``rank_device()``."""
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(n_layers)])
    return model.to(rank_device())


def stage_bounds(n_layers: int, world_size: int) -> list[tuple[int, int]]:
    """(start, end) of each rank's layers: contiguous, as ``torch.tensor_split`` splits them."""
    if world_size < 1 or n_layers < world_size:
        raise ValueError(f"n_layers={n_layers} cannot be split over world_size={world_size}: every stage "
                         "needs a layer")
    return [(int(c[0]), int(c[-1]) + 1) for c in torch.arange(n_layers).tensor_split(world_size)]


def single_process_step(model: nn.Module, inputs, targets) -> float:
    """The baseline: forward and backward of the whole batch on one process (mean loss)."""
    loss = F.cross_entropy(model(inputs), targets)
    loss.backward()
    return loss.item()


class Stuck(RuntimeError):
    """A recorded send/recv waited longer than its timeout, or its peer went away."""


class StepRecorder:
    """``with StepRecorder(model, first_layer) as rec:`` around a rank's pipeline step: ``dist.send``/``recv``
    wait at most ``timeout`` s (else :class:`Stuck`, so a check tells a deadlock from a right answer) and carry a
    Lamport clock (a stage's forward or backward of a micro-batch is one step, begun once the rank and its input
    are ready): ``rec.steps`` (kind, start step), ``rec.batches`` (sizes its forward saw), the same on every run."""

    def __init__(self, model: nn.Sequential, first_layer: int, timeout: float = None):
        self.model, self.first, self.timeout = model, first_layer, timeout or P2P_TIMEOUT
        self.clock, self.steps, self.batches, self.calls = 0, [], [], []

    def _tick(self, kind):
        self.steps.append((kind, self.clock))
        self.clock += 1

    def where(self) -> str:
        n = {k: sum(c.startswith(f"dist.{k}") for c in self.calls) for k in ("send", "recv")}
        f, b = (sum(k == kind for k, _ in self.steps) for kind in "FB")
        return f"after {n['send']} send(s), {n['recv']} recv(s), {f} forward(s) and {b} backward(s) of its stage"

    def _wait(self, work, what):
        try:
            work.wait(timeout=datetime.timedelta(seconds=self.timeout))
        except RuntimeError as e:
            why = (f"waited {self.timeout:g} s in {what}" if "Timed out" in str(e) else
                   f"{what} failed: the peer closed the connection (it had returned or given up)")
            raise Stuck(f"{why}, {self.where()}") from None

    def _send(self, tensor, *args, **kw):
        what = f"dist.send(dst={kw.get('dst', args[0] if args else None)})"
        if not isinstance(tensor, torch.Tensor):  # torch would say only "Invalid function argument"
            raise TypeError(f"{what} was given {type(tensor).__name__}, not a tensor" + (
                ": x.grad is None when autograd never tracked x. A tensor filled by dist.recv is a new leaf that "
                "does not require grad: call x.requires_grad_() on it before the stage uses it, so that backward "
                "leaves d(loss)/dx in x.grad to send back" if tensor is None else ""))
        self._wait(self._isend(tensor, *args, **kw), what)
        clock = torch.tensor([self.clock], device=tensor.device)  # beside the data: NCCL has no CPU tensors
        self._wait(self._isend(clock, *args, **kw), what)  # the step it is ready at
        self.calls.append(what)

    def _recv(self, tensor, *args, **kw):
        src = kw.get("src", args[0] if args else None)
        what = f"dist.recv(src={src})"
        work = self._irecv(tensor, *args, **kw)
        self._wait(work, what)
        src = work._source_rank() if src is None else src
        stamp = torch.zeros(1, dtype=torch.long, device=tensor.device)
        self._wait(self._irecv(stamp, src, *args[1:], **{k: v for k, v in kw.items() if k != "src"}), what)
        self.clock = max(self.clock, int(stamp))
        self.calls.append(what)
        return src

    def __enter__(self):
        self._isend, self._irecv, self._real = dist.isend, dist.irecv, (dist.send, dist.recv)
        dist.send, dist.recv = self._send, self._recv
        def forward(module, args):  # a pre-hook that returns something replaces the input: return None
            self.batches.append(len(args[0]))
            self._tick("F")

        layer = self.model[self.first]
        self._hooks = [layer.register_forward_pre_hook(forward),
                       layer[0].weight.register_post_accumulate_grad_hook(lambda p: self._tick("B"))]
        return self

    def __exit__(self, *exc):
        dist.send, dist.recv = self._real
        for h in self._hooks:
            h.remove()


def step_timeline(rank: int, world_size: int, fn, n_layers: int, n_micro: int, seed: int = 0) -> dict:
    """In a rank: one step of ``fn`` (pipeline_step's signature) watched by a StepRecorder."""
    model, (x, y) = make_model(n_layers, 16, seed), make_batch(2 * n_micro, 16, 16, seed + 1)
    with StepRecorder(model, stage_bounds(n_layers, world_size)[rank][0]) as rec:
        fn(model, x, y, n_micro)
    return {"steps": rec.steps, "clock": rec.clock}


def wall_timeline(rank: int, world_size: int, fn, n_micro: int, n_layers: int = 8, repeats: int = 3) -> list:
    """In a rank: the busy intervals (kind, micro-batch, t0, t1) in s of one step of ``fn``, best of ``repeats``.
    On a GPU hooks run when kernels are *enqueued*: they record CUDA events, placed on the CPU clock after."""
    model, (x, y), best = make_model(n_layers, 384), make_batch(384, 384, 384), None
    start, end = stage_bounds(n_layers, world_size)[rank]
    first, last, timeline, began = model[start], model[end - 1], [], {}
    cuda = rank_device().type == "cuda"

    def now():  # CLOCK_MONOTONIC on Linux: one clock for every process of the machine
        if not cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def done(kind):
        timeline.append((kind, sum(k == kind for k, *_ in timeline), began[kind], now()))
    first.register_forward_pre_hook(lambda m, a: began.update(F=now()))
    last.register_forward_hook(lambda m, a, out: done("F"))
    last.register_full_backward_pre_hook(lambda m, g: began.update(B=now()))
    first.register_full_backward_hook(lambda m, gi, go: done("B"))
    for _ in range(repeats):
        dist.barrier()  # start together
        timeline.clear()
        if cuda:
            torch.cuda.synchronize()
            origin, origin_s = now(), time.perf_counter()
        model.zero_grad(set_to_none=True)
        with warnings.catch_warnings():  # rank 0's first block has no input gradient: torch says so, once
            warnings.simplefilter("ignore", UserWarning)
            fn(model, x, y, n_micro)
        if cuda:
            torch.cuda.synchronize()  # every event has happened: read them (elapsed_time is in ms)
            timeline[:] = [(k, j, origin_s + origin.elapsed_time(a) / 1e3, origin_s + origin.elapsed_time(b) / 1e3)
                           for k, j, a, b in timeline]
        span = torch.tensor([timeline[-1][3] - timeline[0][2]], device=rank_device())
        dist.all_reduce(span, op=dist.ReduceOp.MAX)  # keep the repeat that was fastest on every rank
        best = (span.item(), list(timeline)) if best is None or span.item() < best[0] else best
    return best[1]


def bubble_fraction(per_rank: list[list]) -> float:
    """Idle share of the step over ranks from their busy intervals [(kind, j, t0, t1), ...]: 1 - busy / span."""
    t0 = min(iv[2] for r in per_rank for iv in r)
    span = max(iv[3] for r in per_rank for iv in r) - t0
    return 1 - sum(iv[3] - iv[2] for r in per_rank for iv in r) / (span * len(per_rank))


def as_intervals(steps: list[tuple[str, int]]) -> list[tuple]:
    """A StepRecorder's (kind, start) list as (kind, micro-batch, start, start + 1) intervals."""
    return [(kind, sum(k == kind for k, _ in steps[:i]), s, s + 1) for i, (kind, s) in enumerate(steps)]


def plot_timeline(per_rank: list[list], title: str, unit: str = "steps", ax=None):
    """One row per rank: forward (blue) and backward (orange) busy intervals, labelled by micro-batch."""
    ax = ax or plt.subplots(figsize=(8, 0.45 * len(per_rank) + 1.1))[1]
    t0 = min(iv[2] for r in per_rank for iv in r)
    scale = 1e3 if unit == "ms" else 1
    for rank, intervals in enumerate(per_rank):
        for kind, j, a, b in intervals:
            ax.broken_barh([((a - t0) * scale, (b - a) * scale)], (rank - 0.4, 0.8),
                           color="tab:blue" if kind == "F" else "tab:orange", alpha=0.8)
            ax.text(((a + b) / 2 - t0) * scale, rank, f"{kind}{j}", ha="center", va="center", fontsize=7)
    ax.set(yticks=range(len(per_rank)), yticklabels=[f"rank {r}" for r in range(len(per_rank))],
           xlabel=f"time ({unit})", title=title)
    ax.invert_yaxis()
    ax.grid(axis="x", alpha=0.3)
    return ax


# --- tensor parallelism (9.2) ---

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
