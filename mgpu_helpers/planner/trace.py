"""Tracing one training step under fake tensors: the planner's measurement (notebook 11).

:func:`trace_step` builds the model under ``FakeTensorMode`` (shapes, dtypes and devices, no data) and runs one
steady-state :func:`train_step`, the code a real run uses, under :class:`FakeTracker`: nothing is allocated.
"""

import contextlib
from dataclasses import dataclass, field
from unittest import mock

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils.checkpoint import checkpoint

from ..runtime.fake_world import fake_world
from ..runtime.tracker import CATEGORIES, CUDA_BLOCK
from .accounting import FakeTracker
from .cuda import CudaKernels, recompute_contexts
from .fsdp import FSDPFakeTracker, apply_fsdp, largest_block_list, step_on_shards

# the memory layouts (planner.layouts.LAYOUTS) a step is traced in; the others are derived from these
TRACED_LAYOUTS = ("fp32", "bf16-autocast", "fp16-autocast", "bf16")
_AUTOCAST = {"bf16-autocast": torch.bfloat16, "fp16-autocast": torch.float16}
OPTIMIZERS = ("adam", "adamw", "sgd", "momentum")  # AdamW: Adam's two moments, the decay applied to the weights
FSDP_WARM_UP_STEPS = 1  # the second step is steady: equal to the third, to the byte (tests/test_planner_fsdp.py)


class Checkpointed(nn.Module):
    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, *args, **kwargs):
        return checkpoint(self.block, *args, use_reentrant=False, context_fn=recompute_contexts, **kwargs)


def apply_checkpointing(model: nn.Module) -> nn.Module:
    """Wrap each block of the model's largest ``nn.ModuleList`` in :class:`Checkpointed` (in place), or call a
    model's own ``gradient_checkpointing_enable()`` (Hugging Face's), as its users do."""
    own = getattr(model, "gradient_checkpointing_enable", None)
    if callable(own):
        own()
        return model
    blocks = largest_block_list(model, "checkpointing=True: the model has no nn.ModuleList of blocks to checkpoint")
    for i, block in enumerate(blocks):
        if not isinstance(block, Checkpointed):
            blocks[i] = Checkpointed(block)
    return model


def retensor(model: nn.Module, fn, recurse: bool = True) -> nn.Module:
    """Replace every parameter and buffer ``t`` by ``fn(t)`` (a dtype or device change), by reassignment:
    ``Module.to``/``to_empty`` swap tensors, which fake tensors refuse (the fake mode holds weakrefs)."""
    new = {}  # tied weights stay tied
    with torch.no_grad():
        for m in (model.modules() if recurse else [model]):
            for name, p in m._parameters.items():
                if p is not None and id(p) not in new:
                    new[id(p)] = p if (q := fn(p)) is p else nn.Parameter(q, requires_grad=p.requires_grad)
                if p is not None:
                    m._parameters[name] = new[id(p)]
            for name, b in m._buffers.items():
                if b is not None:
                    m._buffers[name] = fn(b)
    return model


def make_optimizer(model: nn.Module, optimizer: str = "adam"):
    """The optimizer the planner assumes: CUDA's default foreach implementation, whatever the machine."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    params = [p for p in model.parameters() if p.requires_grad]
    if optimizer in ("adam", "adamw"):
        return (torch.optim.Adam if optimizer == "adam" else torch.optim.AdamW)(params, lr=1e-3, foreach=True)
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9 if optimizer == "momentum" else 0.0, foreach=True)


def warm_up(model: nn.Module, opt) -> None:
    """Make the optimizer's state without a forward/backward: a step on zero gradients (Adam and SGD
    leave the weights unchanged), then gradients back to None -- the steady state a step starts from."""
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)


def train_step(model, opt, batch, loss_fn, *, precision="fp32", micro_batches=1, mark=lambda label: None):
    """One training step, exactly as the planner defines it (forward and loss under autocast for the autocast
    layouts; the output dropped once the loss exists). ``mark(label)`` is called at each phase."""
    inputs, targets = batch
    dtype = _AUTOCAST.get(precision)
    device_type = next(model.parameters()).device.type
    k = micro_batches
    for i, (x, y) in enumerate(zip(inputs.tensor_split(k), targets.tensor_split(k))):
        mark(f"forward {i + 1}" if k > 1 else "forward")
        with torch.autocast(device_type, dtype) if dtype else contextlib.nullcontext():
            loss = loss_fn(model(x), y) / k
        mark(f"backward {i + 1}" if k > 1 else "backward")
        loss.backward()
    mark("step")
    opt.step()
    mark("zero_grad")
    opt.zero_grad(set_to_none=True)
    return loss


@dataclass
class Trace:
    """One unsharded step, traced: the tracker's timeline (samples x categories), each sample's phase, and the
    sizes sharding needs. A ZeRO-3 plan needs only ``config`` and ``source``: it runs FSDP2 itself."""
    timeline: torch.Tensor = None     # int64 [samples, len(CATEGORIES)]
    phases: list = ()                  # phase label of each sample
    n_params: int = 0
    param_sizes: list = ()             # (numel, element bytes) of each trainable parameter
    state_sizes: list = ()             # (numel, element bytes) of each optimizer-state tensor on the device
    grad_bytes_per_elem: int = 4
    unit_numel: int = 0                # parameters of the largest unit (a block, or the rest)
    round_to: int = 1
    config: dict = field(default_factory=dict)
    param_state_sizes: list = field(default_factory=list)  # per trainable parameter: its state's (numel, bytes)
    events: list = field(default_factory=list, repr=False)  # every storage's size change (planner.allocator)
    workspace_at_peak: int = 0         # cuDNN's workspace at the peak, when GPU kernels were traced
    source: dict = field(default_factory=dict, repr=False)  # trace_step's arguments: what a ZeRO-3 plan runs
    fsdp_plans: dict = field(default_factory=dict, repr=False, compare=False)  # plans.plan_from_trace's ZeRO-3 plans


def check_step_args(model_fn, loss_fn, optimizer, micro_batches):
    """The step's arguments, checked before anything is built (plan() checks them before tracing too)."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches must be an int >= 1, got {micro_batches!r}")
    if not callable(model_fn) or not callable(loss_fn):
        raise TypeError(f"{'model_fn' if not callable(model_fn) else 'loss_fn'} must be callable")


def _fake_batch(batch, device):
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2
            and all(isinstance(t, torch.Tensor) for t in batch)):
        length = f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else ""
        raise TypeError(f"batch must be a tuple (inputs, targets) of two tensors, got {type(batch).__name__}{length}")
    if batch[0].dim() == 0 or batch[1].dim() == 0 or len(batch[0]) != len(batch[1]):
        raise ValueError("batch: inputs and targets need the same size along dim 0 (the samples), got "
                         f"{tuple(batch[0].shape)} and {tuple(batch[1].shape)}")
    return tuple(torch.empty(t.shape, dtype=t.dtype, device=device) for t in batch)  # shapes only: fake


def _check_fake(model):
    if not isinstance(model, nn.Module):
        raise TypeError(f"model_fn must return an nn.Module, got {type(model).__name__}")
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if not isinstance(t, FakeTensor) and t.device.type != "meta":
            raise ValueError(
                f"model_fn allocated real memory: {name!r} is a real tensor ({t.numel() * t.element_size()} "
                "bytes). model_fn must build the model when called (the planner calls it under FakeTensorMode); "
                "do not return a model built earlier or load real weights in it")


def trace_step(model_fn, batch, *, loss_fn, optimizer="adam", precision="fp32", micro_batches=1,
               checkpointing=False, device=None, round_to=None, fsdp=None, kernels=None) -> Trace:
    """Trace one steady-state training step of ``model_fn()`` on ``batch``, unsharded, under fake tensors.
    ``fsdp``: ``dict(world_size=, rank=, **apply_fsdp options)`` traces that rank's step under FSDP2 instead.
    ``kernels``: "cpu" or "cuda" (default: the device's); "cuda" plans a GPU's kernels on any host."""
    source = {k: v for k, v in locals().items() if k != "fsdp"}  # the arguments: what a ZeRO-3 plan re-traces
    layout, precision = precision, {"zero-mixed": "bf16"}.get(precision, precision)  # layouts.zero_mixed: by rule
    if kernels not in (None, "cpu", "cuda"):
        raise ValueError(f"kernels must be None, 'cpu' or 'cuda', got {kernels!r}")
    if precision not in TRACED_LAYOUTS and not (fsdp is not None and precision == "fsdp-mixed"):
        raise ValueError(f"precision must be one of {TRACED_LAYOUTS}"
                         + (" (or 'fsdp-mixed' under FSDP2)" if fsdp is None else "") + f", got {precision!r}")
    check_step_args(model_fn, loss_fn, optimizer, micro_batches)
    if fsdp is not None and torch.distributed.is_initialized():
        raise RuntimeError("plan(zero_stage=3) runs FSDP2 in a fake process group of its own; call plan() "
                           "outside an initialised process group (e.g. in the notebook, not inside ranks)")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    round_to = round_to or (CUDA_BLOCK if device.type == "cuda" else 1)
    kernels = kernels or device.type
    gpu_kernels = CudaKernels() if kernels == "cuda" else contextlib.nullcontext()
    with fake_world(fsdp["world_size"], fsdp["rank"]) if fsdp is not None else contextlib.nullcontext():
        if fsdp is not None:  # the mesh is made outside the fake mode (it reads real rank tensors)
            from torch.distributed.device_mesh import init_device_mesh
            mesh = init_device_mesh(device.type, (fsdp["world_size"],))
        with FakeTensorMode(allow_non_fake_inputs=False), gpu_kernels:
            x, y = _fake_batch(batch, device)
            if len(x) % micro_batches:
                raise ValueError(f"micro_batches={micro_batches} does not divide the batch of {len(x)} samples")
            # factories make fake tensors on ``device``; ``Module.to``/``.float()`` in a constructor (families that
            # keep a layer in fp32) reassign (retensor): ``Module._apply`` swaps tensors, which fake ones refuse
            with device, mock.patch.object(nn.Module, "_apply", lambda m, fn, recurse=True: retensor(m, fn, recurse)):
                model = model_fn()
            _check_fake(model)
            retensor(model, lambda t: torch.empty_like(t, device=device) if t.device.type == "meta" else t)
            if precision == "bf16":
                retensor(model, lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t)
                x = x.to(torch.bfloat16) if x.is_floating_point() else x
            if checkpointing:
                apply_checkpointing(model)
            step_precision, tracker = precision, FakeTracker
            if fsdp is not None:
                apply_fsdp(model, mesh, precision=precision,
                           **{k: v for k, v in fsdp.items() if k not in ("world_size", "rank")})
                step_precision = "fp32" if precision == "fsdp-mixed" else precision  # the policy casts
                tracker = FSDPFakeTracker
            opt = make_optimizer(model, optimizer)
            if fsdp is None:
                warm_up(model, opt)
            else:  # FSDP2's lazy init, its unsharded storages and Adam's state come from a real step
                step_on_shards(opt)
                for _ in range(FSDP_WARM_UP_STEPS):
                    train_step(model, opt, (x, y), loss_fn, precision=step_precision, micro_batches=micro_batches)
            params = getattr(opt, "global_params", None) or [p for g in opt.param_groups for p in g["params"]]
            with tracker(model, opt, device, round_to, kernels) as mt:
                train_step(model, opt, (x, y), loss_fn, precision=step_precision, micro_batches=micro_batches,
                           mark=mt.mark)
            blocks = largest_block_list(model)
            in_blocks = {id(p) for b in blocks for p in b.parameters()}
            unit_numel = max([sum(p.numel() for p in b.parameters()) for b in blocks]
                             + [sum(p.numel() for p in params if id(p) not in in_blocks)])
            local = [getattr(t, "_local_tensor", t) for g in opt.param_groups for t in g["params"]]  # DTensors' shards
            per_param = [[(getattr(v, "_local_tensor", v).numel(), v.element_size()) for v in opt.state[p].values()
                          if isinstance(v, torch.Tensor) and v.device.type == device.type] if p in opt.state else []
                         for g in opt.param_groups for p in g["params"]]
            sizes = dict(param_sizes=[(p.numel(), p.element_size()) for p in local],
                         state_sizes=[size for sizes in per_param for size in sizes],
                         grad_bytes_per_elem=local[0].element_size() if local else 4, param_state_sizes=per_param,
                         unit_numel=unit_numel, n_params=sum(p.numel() for p in params))  # global, also DTensors'
    return Trace(  # outside the fake mode: a real tensor
        timeline=torch.tensor([[s[2][c] for c in CATEGORIES] for s in mt.timeline], dtype=torch.int64),
        phases=[s[0] for s in mt.timeline], round_to=round_to, **sizes,
        config=dict(optimizer=optimizer, precision=precision, micro_batches=micro_batches,
                    checkpointing=checkpointing, device=device.type, layout=layout),
        events=mt.events, workspace_at_peak=mt.workspace_at_peak, source=source)
