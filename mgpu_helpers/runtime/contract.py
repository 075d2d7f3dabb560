"""The device contract, proved on a CPU-only machine: a rank's tensors that meet a collective or a send/recv
live on ``rank_device()``. NCCL has no CPU backend (``dist.all_reduce(torch.arange(4))`` raises "No backend type
associated with device type cpu") where gloo CPU ranks succeed; so in every gloo CPU rank (``enable``, called by
the launcher) a ``TorchFunctionMode`` judges which tensors would be *host* tensors on a GPU machine, and the
collectives refuse those with :class:`ContractError`, naming the tensor and where it was made.

Host: what the caller hands the rank; a factory's result (``torch.tensor``, ``zeros``, ``from_numpy``,
``nn.Linear``'s parameters...) with no device or a string device (``"cpu"``); ``.cpu()``, ``.to("cpu")`` (a fresh
alias: the original keeps its judgement); an op whose tensor inputs are all host; a Parameter of host data.
Device: made with a ``torch.device`` (``device=rank_device()``, ``device=x.device``); moved with
``.to(rank_device())``; an op with any device input; any tensor the mode never saw (made in C++). In place
(``x.add_()``, ``out=``, ``dist.recv`` into a buffer) a tensor keeps its judgement.

Not judged: collectives that torch's own code calls (FSDP2, DTensor, DDP). Blind spots (it may pass code that
fails on GPUs, never the reverse): other threads' tensors (a mode is per thread); a host tensor moved with
``.to(rank_device())`` (in place on the CPU); ``device=torch.device("cpu")``; collectives made in C++, through
``torch.ops._c10d_functional`` or bound before the rank started; host parameters never sent. ``dcp.async_save``
needs ``run_ranks(..., cpu_backend=True)``, as on NCCL. Off with ``MGPU_CONTRACT=0`` (one Python call per op).
"""
import contextlib
import os
import sys

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

_TORCH = os.path.dirname(torch.__file__) + os.sep
_HERE = __file__
_TAG = "_mgpu_host"  # the attribute a host tensor carries: where it was made (a string)
_active = False
_cpu_backend = False  # whether the launch asked for a CPU backend beside the GPU's (run_ranks(cpu_backend=True))

# Collectives and point-to-point calls whose tensors must be on the rank's device (those a torch lacks: skipped).
CALLS = ("all_reduce", "all_reduce_coalesced", "reduce", "broadcast", "all_gather", "all_gather_coalesced",
         "all_gather_into_tensor", "all_gather_single", "reduce_scatter", "reduce_scatter_tensor",
         "reduce_scatter_single", "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv",
         "batch_isend_irecv", "gather", "scatter", "_all_gather_base", "_reduce_scatter_base")


class ContractError(RuntimeError):
    """A host tensor (one that would be on the CPU of a GPU machine) reached a collective or send/recv."""


def _where():
    """'function (file:line)' of the first frame outside torch and this module, or 'cell line N'."""
    f = sys._getframe(2)
    while f is not None and (f.f_code.co_filename.startswith(_TORCH) or f.f_code.co_filename == _HERE):
        f = f.f_back
    if f is None:
        return "torch"
    name, line = f.f_code.co_filename, f.f_lineno
    if "ipykernel_" in name or name.startswith("<"):
        return f"{f.f_code.co_name} at cell line {line}" if f.f_code.co_name != "<module>" else f"cell line {line}"
    return f"{f.f_code.co_name} ({os.path.basename(name)}:{line})"


def _name(func):
    """torch.arange, Tensor.cpu(), ... as the learner wrote it."""
    n = getattr(func, "__name__", str(func))
    if getattr(func, "__qualname__", "").startswith(("TensorBase.", "Tensor.")):
        return f"Tensor.{n}()"
    return f"torch.{n}" if (getattr(func, "__module__", None) or "").startswith("torch") else n


def _host(t):
    return getattr(t, _TAG, None)


def _tag(t, origin):
    with contextlib.suppress(AttributeError, RuntimeError):  # some tensor subclasses refuse attributes: device
        setattr(t, _TAG, origin)


_TO, _CPU, _Tensor = torch.Tensor.to, torch.Tensor.cpu, torch.Tensor


def _on_host(device):
    """Whether a factory's device means the host: None or a "cpu" string (a torch.device is rank_device()'s)."""
    return device is None or isinstance(device, str) and device.startswith("cpu")


class _HostMode(TorchFunctionMode):
    # Runs around every torch call: the fast path reads one attribute per input and sets one on the result.
    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **kwargs) if kwargs else func(*args)
        if type(out) is not _Tensor and not isinstance(out, _Tensor):
            if isinstance(out, (tuple, list)) and out and isinstance(out[0], _Tensor):  # split, chunk...
                origin = self._origin(func, args, kwargs, out[0])
                if origin is not False:
                    for t in out:
                        _tag(t, origin)
            return out
        if func is _CPU or func is _TO and _on_host((kwargs or {}).get("device", args[1] if len(args) > 1 else 0)):
            if out is args[0]:  # on the CPU these return the same tensor; on a GPU machine a copy
                out = out.view_as(out)
            _tag(out, _host(args[0]) or f"{_name(func)} in {_where()}")
            return out
        origin = self._origin(func, args, kwargs, out)
        if origin is not False:
            _tag(out, origin)
        return out

    @staticmethod
    def _origin(func, args, kwargs, out):
        """Where ``out`` was made if it is host, None if device, False to leave it as it is (in place)."""
        if kwargs and "device" in kwargs:
            return f"{_name(func)} in {_where()}" if _on_host(kwargs["device"]) else None
        if func is _TO and len(args) > 1 and isinstance(args[1], torch.device):
            return None  # .to(rank_device()), Module.to(rank_device())
        origin = None  # the first host input's: the data, before the weights it met
        for a in (*args, *(kwargs or {}).values()):
            for t in a if isinstance(a, (list, tuple)) else (a,):  # torch.cat([...]), torch.stack([...])
                if isinstance(t, _Tensor):
                    if t is out:  # in place (x.add_(), out=): the tensor keeps its judgement
                        return False
                    tag = getattr(t, _TAG, None)
                    if tag is None:
                        return None
                    origin = origin or tag
        # all tensor inputs host; or none, no device asked for: a factory, on the default device, the CPU
        return origin or f"{_name(func)} in {_where()}"


def _guarded(name, real):
    def call(*args, **kwargs):
        caller = sys._getframe(1)
        while caller.f_code.co_filename == _HERE:  # c10d's collectives come back through the mode: see past it
            caller = caller.f_back
        if not caller.f_code.co_filename.startswith(_TORCH):  # torch's own calls: not judged
            for t in tree_leaves((args, kwargs)):
                t = t.tensor if isinstance(t, dist.P2POp) else t
                if isinstance(t, torch.Tensor) and _host(t) is not None:
                    raise ContractError(
                        f"dist.{name} got a host tensor (shape {list(t.shape)}, {t.dtype}) made by {_host(t)}: "
                        f"on GPU ranks (NCCL) a collective's and a send/recv's tensors must be on rank_device() "
                        f"-- make it with device=rank_device() or move it with .to(rank_device()) (NCCL has no "
                        f"CPU backend: 'No backend type associated with device type cpu')")
        return real(*args, **kwargs)
    call.__name__, call.__qualname__, call.__wrapped__ = real.__name__, real.__qualname__, real
    return call


def _async_save(real):
    def async_save(*args, **kwargs):
        if not _cpu_backend:
            raise ContractError(
                "dcp.async_save needs a CPU backend beside NCCL on GPU ranks ('A CPU backend must be enabled for "
                "async save', torch/distributed/checkpoint/state_dict_saver.py): launch with run_ranks(..., "
                "cpu_backend=True), which initialises the group as 'cuda:nccl,cpu:gloo'")
        return real(*args, **kwargs)
    async_save.__wrapped__ = real
    return async_save


_SAVER = "torch.distributed.checkpoint.state_dict_saver"


class _PatchSaver:
    """Wraps dcp.async_save when it is first imported (importing it in every rank would slow every launch)."""

    def find_spec(self, name, path=None, target=None):
        if name != _SAVER:
            return None
        sys.meta_path.remove(self)
        import importlib.util
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.async_save = _async_save(module.async_save)
        spec.loader.exec_module = exec_module
        return spec


def enable(cpu_backend=False):
    """Judge this gloo CPU rank's tensors and guard its collectives until it exits (the launcher calls it)."""
    global _active, _cpu_backend
    if _active or os.environ.get("MGPU_CONTRACT", "1") == "0":
        return
    _active, _cpu_backend = True, cpu_backend
    if _SAVER in sys.modules:
        saver = sys.modules[_SAVER]
        saver.async_save = _async_save(saver.async_save)  # its package is imported first: it has the name too
        sys.modules["torch.distributed.checkpoint"].async_save = saver.async_save
    else:
        sys.meta_path.insert(0, _PatchSaver())
    c10d = dist.distributed_c10d
    for name in CALLS:
        real = getattr(c10d, name, None)
        if real is not None:
            guarded = _guarded(name, real)
            setattr(c10d, name, guarded)  # c10d's own helpers (P2POp's check of isend/irecv) see the same
            if getattr(dist, name, None) is real:
                setattr(dist, name, guarded)
    real_new, real_from_numpy = torch.nn.Parameter.__new__, torch.from_numpy

    def parameter_new(cls, data=None, requires_grad=True):  # an nn.Parameter of host data is host
        p = real_new(cls, data, requires_grad)
        if _host(data) is not None:
            _tag(p, _host(data))
        return p

    def from_numpy(a):  # one of torch.overrides.get_ignored_functions(): the mode never sees it
        t = real_from_numpy(a)
        _tag(t, f"torch.from_numpy in {_where()}")
        return t
    torch.nn.Parameter.__new__, torch.from_numpy = staticmethod(parameter_new), from_numpy
    _HostMode().__enter__()  # never left: the mode lives as long as the rank


def mark_host(value, origin: str, _depth: int = 0):
    """Judge every tensor in ``value`` (tensors, modules' parameters and buffers, in lists, tuples and dicts)
    host, made by ``origin``: what the caller hands a rank is on the CPU on every machine."""
    if not _active or _depth > 4:
        return
    if isinstance(value, torch.Tensor):
        _tag(value, origin)
    elif isinstance(value, torch.nn.Module):
        for t in (*value.parameters(), *value.buffers()):
            _tag(t, origin)
    elif isinstance(value, (list, tuple, dict)):
        for v in value.values() if isinstance(value, dict) else value:
            mark_host(v, origin, _depth + 1)
