"""The device contract on CPU ranks (mgpu_helpers/runtime/contract.py): a tensor that would be a host tensor
on a GPU machine and reaches a collective or send/recv fails, naming the tensor and the call; what would be
on the GPU passes."""
import re

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import importlib
import pkgutil

import mgpu_helpers.checks
from mgpu_helpers.checks.base import REGISTRY, CheckFailure

for _m in pkgutil.iter_modules(mgpu_helpers.checks.__path__):  # every lesson's checks, registered
    if _m.name not in ("base", "references", "__main__"):
        importlib.import_module(f"mgpu_helpers.checks.{_m.name}")
from mgpu_helpers.checks.references import gpipe_step
from mgpu_helpers.memory import make_batch
from mgpu_helpers.model_sharding import StepRecorder, make_model, stage_bounds
from mgpu_helpers.runtime.launch import RankError, rank_device, run_ranks


def _fails(fn, *args, world=2):
    with pytest.raises(RankError) as e:
        run_ranks(fn, world, *args, timeout=30)
    return str(e.value).splitlines()[0]


def planted(rank, world_size):  # the launcher's demo with one tensor left on the host
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return t.item()


def test_a_planted_host_tensor_fails_naming_it_and_the_call():
    line = planted.__code__.co_firstlineno + 1
    assert _fails(planted) == (
        f"rank 0 raised ContractError: dist.all_reduce got a host tensor (shape [1], torch.float32) made by "
        f"torch.tensor in planted (test_contract.py:{line}): on GPU ranks (NCCL) a collective's and a send/recv's "
        f"tensors must be on rank_device() -- make it with device=rank_device() or move it with "
        f".to(rank_device()) (NCCL has no CPU backend: 'No backend type associated with device type cpu')")


def test_off_with_mgpu_contract_0(monkeypatch):
    monkeypatch.setenv("MGPU_CONTRACT", "0")
    monkeypatch.setenv("MGPU_START_METHOD", "spawn")  # a fresh rank: the switch is read when the rank starts
    assert run_ranks(planted, 2) == [3.0, 3.0]


def show_reduce_scatter(rank, world_size, device):  # notebook 08's cell, device=None as it is written there
    grad = torch.arange(1.0, 8.0, device=device) + 10 * rank
    L = -(-grad.numel() // world_size)
    padded = F.pad(grad, (0, L * world_size - grad.numel()))
    shard = torch.empty(L, device=device)
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # as 08 does
    reduce_scatter(shard, padded)
    return shard.tolist()


def test_notebook_08_reduce_scatter():
    said = _fails(show_reduce_scatter, None, world=3)
    assert re.search(r"dist\.reduce_scatter_(single|tensor) got a host tensor \(shape \[3\], torch\.float32\) made by "
                     r"torch\.empty in show_reduce_scatter", said), said
    got = run_ranks(lambda r, w: show_reduce_scatter(r, w, rank_device()), 3)
    assert got[0] == [33.0, 36.0, 39.0]


def old_pipeline(rank, world_size):  # notebook 09 before: model and batch made on the CPU
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)])
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 8, generator=g), torch.randint(0, 8, (4,), generator=g)
    with StepRecorder(model, stage_bounds(4, world_size)[rank][0]):
        gpipe_step(model, x, y, 2)


def new_pipeline(rank, world_size):
    model, (x, y) = make_model(4, 8), make_batch(4, 8, 8)
    with StepRecorder(model, stage_bounds(4, world_size)[rank][0]) as rec:
        gpipe_step(model, x, y, 2)
    return rec.clock


def old_clock(rank, world_size):  # StepRecorder's step clock before: a CPU tensor beside device data
    if rank == 0:
        dist.send(torch.ones(2, device=rank_device()), 1)
        dist.send(torch.tensor([3]), 1)
    else:
        dist.recv(torch.empty(2, device=rank_device()), 0)
        dist.recv(torch.zeros(1, dtype=torch.long), 0)


def test_notebook_09_pipeline():
    said = _fails(old_pipeline)  # rank 0's send or rank 1's receive buffer, whichever is judged first
    assert re.search(r"dist\.i(send|recv) got a host tensor \(shape \[2, 8\], torch\.float32\) made by torch\.randn in "
                     r"old_pipeline", said), said
    said = _fails(old_clock)  # rank 0's clock or rank 1's buffer for it, whichever is judged first
    assert re.search(r"dist\.(send|recv) got a host tensor \(shape \[1\], torch\.int64\) made by torch\.(tensor|zeros) "
                     r"in old_clock", said), said
    assert all(isinstance(clock, int) for clock in run_ranks(new_pipeline, 2))


def device_code(rank, world_size):  # what would be on the GPU passes, however it got there
    dev = rank_device()
    model = nn.Linear(4, 4).to(dev)
    x = torch.randn(3, 4).to(dev)  # drawn on the host, moved
    model(x).sum().backward()
    for p in model.parameters():  # autograd's gradients (made in C++) of device parameters
        dist.all_reduce(p.grad)
    made_like = torch.zeros(2, device=x.device)  # a torch.device object: the rank's device
    dist.all_reduce(made_like)
    parts = torch.ones(6, device=dev).chunk(3)  # views of a device tensor
    dist.all_reduce(parts[1])
    buf = torch.empty(2, device=dev)
    buf.copy_(torch.tensor([1.0, 2.0]))  # an in-place copy from the host keeps the buffer on the device
    dist.broadcast(buf, 0)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    dist.all_reduce(flat)
    p = nn.Parameter(torch.ones(2, device=dev))
    dist.all_reduce(p.data)
    out = [torch.empty(2, device=dev) for _ in range(world_size)]
    dist.all_gather(out, buf)
    gathered = [None] * world_size
    dist.all_gather_object(gathered, {"rank": rank})  # torch's own tensors: not judged
    return True


def test_device_tensors_pass():
    assert run_ranks(device_code, 2) == [True, True]


def host_grads(rank, world_size):  # a model left on the host: its gradients are host tensors too
    model = nn.Linear(4, 2)
    model(torch.randn(3, 4, device=rank_device())).sum().backward()
    dist.all_reduce(model.weight.grad)


def moved_back(rank, world_size):
    t = torch.ones(2, device=rank_device())
    dist.all_reduce(t)  # the original stays on the device
    dist.all_reduce(t.cpu())


def host_parameter(rank, world_size):
    p = nn.Parameter(torch.zeros(3))
    dist.broadcast(p, 0)


@pytest.mark.parametrize("fn, words", [
    (host_grads, "dist.all_reduce got a host tensor (shape [2, 4], torch.float32) made by torch.empty in host_grads"),
    (moved_back, "made by Tensor.cpu() in moved_back"),
    (host_parameter, "dist.broadcast got a host tensor (shape [3], torch.float32) made by torch.zeros in host_parameter"),
])
def test_host_tensors_fail(fn, words):
    said = _fails(fn)
    assert words in said, said


@pytest.mark.parametrize("exercise", sorted(REGISTRY))
def test_every_check_reports_an_answer_that_raises(exercise):
    """A learner's function that raises fails its check with the learner's exception in the message, never
    with an error of the check itself (Check41/42's `hint` string once shadowed Check.hint and raised
    TypeError)."""
    check = REGISTRY[exercise]

    def answer(*args, **kwargs):
        raise RuntimeError("boom")
    answer.__name__ = check.function or "answer"
    with pytest.raises(CheckFailure) as e:
        check(answer, seed=0)
    assert "RuntimeError" in str(e.value), str(e.value)  # 8.1's first case expects a TypeError: it names the type


def reduce_argument(rank, world_size, t, move):
    t = t.to(rank_device()) if move else t
    dist.all_reduce(t)
    return t.tolist()


def test_the_callers_tensors_are_host_tensors():  # the notebook's tensors are on the CPU on every machine
    assert "dist.all_reduce got a host tensor (shape [2], torch.float32) made by the caller: argument 3 of " \
           "run_ranks" in _fails(reduce_argument, torch.ones(2), False)
    assert run_ranks(reduce_argument, 2, torch.ones(2), True) == [[2.0, 2.0]] * 2


def async_save(rank, world_size, path):
    import torch.distributed.checkpoint as dcp
    dcp.async_save({"w": torch.ones(2, device=rank_device()) * rank}, checkpoint_id=path).result()
    return True


def test_async_save_needs_a_cpu_backend(tmp_path):  # as on an NCCL-only group
    assert "dcp.async_save needs a CPU backend beside NCCL" in _fails(async_save, str(tmp_path / "a"))
    assert run_ranks(async_save, 2, str(tmp_path / "b"), cpu_backend=True) == [True, True]


def gloo_only_average(model):  # works on gloo, fails on NCCL: the sum is made on the host
    for p in model.parameters():
        if p.grad is not None:
            total = p.grad.cpu()
            dist.all_reduce(total)
            p.grad.copy_(total / dist.get_world_size())


def test_an_answer_that_works_on_gloo_only_fails_its_check_saying_why():
    with pytest.raises(CheckFailure) as e:
        REGISTRY["4.1"](gloo_only_average, seed=0)
    said = str(e.value)
    assert "ContractError: dist.all_reduce got a host tensor" in said and "made by Tensor.cpu() in gloo_only_average" \
        in said and "Hint: this works on CPU ranks (gloo) only" in said, said
