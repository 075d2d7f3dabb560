"""Notebook 12 -- a model bigger than one rank: built on the ``meta`` device, sharded, then given storage
(``to_empty``) and initialised, so each rank allocates its shard only; and what activation offload moves."""
import torch
import torch.distributed as dist
from torch import nn

from ..memory import nbytes
from .knobs import MODEL, Net, build, make_model, profiled_peak, shard
from ..runtime.launch import rank_device
from ..runtime.precision import training_precision


def init_weights(model: nn.Module, seed: int = 0) -> None:
    """Initialise a ``to_empty``'d sharded model to one process's ``make_model(seed)``: each module in turn runs
    ``reset_parameters()`` on whole plain tensors and each rank keeps its part. Not on the DTensors: DTensor's RNG
    serves CUDA-like devices only (``torch/distributed/tensor/_random.py``): CPU ranks all draw the same values."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for m in model.modules():
            own = dict(m.named_parameters(recurse=False))
            if not own or not hasattr(m, "reset_parameters"):
                continue
            full = {n: nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=p.device)) for n, p in own.items()}
            m._parameters.update(full)  # the module's own init, on whole tensors
            try:
                m.reset_parameters()
            finally:
                m._parameters.update(own)
            with torch.no_grad():
                for n, p in own.items():
                    if isinstance(p, DTensor) and len(p.placements) == 1 and isinstance(p.placements[0], Shard):
                        # fully_shard's layout: this rank's chunk of the whole tensor (a view, no copy)
                        chunks = full[n].detach().chunk(p.device_mesh.size(), dim=p.placements[0].dim)
                        i = p.device_mesh.get_local_rank()
                        if i < len(chunks):
                            p.to_local().copy_(chunks[i])
                    elif isinstance(p, DTensor):  # other layouts: DTensor slices it (no communication)
                        local = distribute_tensor(full[n].detach(), p.device_mesh, p.placements, src_data_rank=None)
                        p.to_local().copy_(local.to_local())
                    else:
                        p.copy_(full[n])
            del full  # before the next module draws its own


def meta_init(rank, world_size, model_kw=None):
    """Bytes: ``whole_model``, ``shard`` (this rank's parameters), ``on_meta`` (storage before to_empty), and the
    peaks ``built_then_sharded``, ``meta_then_sharded``."""
    mkw = {**MODEL, **(model_kw or {})}
    with profiled_peak() as whole:
        model = shard(make_model(**mkw))
    del model
    with profiled_peak() as meta:
        with torch.device("meta"):
            model = Net(**mkw)
        on_meta = nbytes(p for p in model.parameters() if p.device.type != "meta")
        shard(model).to_empty(device=rank_device())
        init_weights(model)
    full = sum(p.numel() * p.element_size() for p in make_model(**mkw, device="meta").parameters())
    return {"whole_model": full, "shard": nbytes(model.parameters()), "on_meta": on_meta,
            "built_then_sharded": whole["peak"], "meta_then_sharded": meta["peak"],
            "finite": all(bool(torch.isfinite(p.to_local()).all()) for p in model.parameters())}


def meta_init_values(rank, world_size, model_kw=None, seed=0, dtensor_rng=False):
    """Whether the meta-built model, initialised by :func:`init_weights` (``dtensor_rng``: on the DTensors), equals
    one process's ``make_model(seed)``; whether rank 0's shard of the first weight repeats on rank 1."""
    import warnings
    mkw = {**MODEL, **(model_kw or {})}
    with torch.device("meta"):
        model = Net(**mkw)
    shard(model).to_empty(device=rank_device())
    if dtensor_rng:
        torch.manual_seed(seed)
        with warnings.catch_warnings():  # "DTensor random operators may not have complete support on cpu"
            warnings.simplefilter("ignore", UserWarning)  # -- the point of this demonstration
            for m in model.modules():
                if hasattr(m, "reset_parameters") and m is not model:
                    m.reset_parameters()
    else:
        init_weights(model, seed)
    one = make_model(**mkw, seed=seed, device="cpu")
    full = [p.full_tensor().cpu() for p in model.parameters()]
    w, half = full[0], full[0].shape[0] // world_size
    return {"equal_to_one_process": all(torch.equal(a, b) for a, b in zip(full, one.parameters())),
            "shards_repeat": bool(torch.equal(w[:half], w[half:2 * half]))}


def saved_for_backward(rank, world_size, precision="fp32", rows=64, model_kw=None, weights=False):
    """Bytes autograd saves in one forward of the FSDP2 model on this rank, by dtype (distinct storages): what
    ``save_on_cpu``, whose hooks it wraps, would move. ``weights``: also the bytes that are parameters."""
    model, _, _ = build({"precision": precision, "rows": rows}, model_kw)
    x = torch.randn(rows, {**MODEL, **(model_kw or {})}["d_in"], device=rank_device())
    half = training_precision(rank_device()).dtype  # as knobs.build's step: fp16 on a GPU without bf16
    offload = torch.autograd.graph.save_on_cpu(pin_memory=False)
    by_dtype, seen, computing_with, weight_bytes = {}, set(), set(), 0

    def pack(t):
        nonlocal weight_bytes
        st = t.untyped_storage()
        if st._cdata not in seen and st.nbytes():
            seen.add(st._cdata)
            k = str(t.dtype).replace("torch.", "")
            by_dtype[k] = by_dtype.get(k, 0) + st.nbytes()
            weight_bytes += st.nbytes() if st.data_ptr() in computing_with else 0
        return offload.pack_hook(t)

    # While a module runs, its parameters (under FSDP2 the unsharded all-gathered tensors, which a matmul saves);
    # only then: once freed, their addresses are reused by activations.
    mods = [m for m in model.modules() if m._parameters]
    hooks = [m.register_forward_pre_hook(lambda m, args: computing_with.update(
        p.untyped_storage().data_ptr() for p in m.parameters(recurse=False))) for m in mods]
    hooks += [m.register_forward_hook(lambda m, args, out: computing_with.clear()) for m in mods]
    cast = torch.autocast(rank_device().type, half, enabled=precision == "autocast")
    with torch.autograd.graph.saved_tensors_hooks(pack, offload.unpack_hook), cast:
        loss = model(x).float().pow(2).mean()
    for h in hooks:
        h.remove()
    loss.backward()
    dist.barrier()
    return (by_dtype, weight_bytes) if weights else by_dtype
