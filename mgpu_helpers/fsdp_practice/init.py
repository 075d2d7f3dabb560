"""Notebook 12 -- a model bigger than one rank (build on the ``meta`` device, ``fully_shard``, then
``to_empty`` and initialise the shards) and what activation offload would move off the device.

``meta_init`` measures, per rank, the most bytes held while the model is built and sharded, both ways:
built whole on the device and then sharded (every rank holds the whole model for a moment), and built on
the meta device (no storage), sharded, and only then given storage -- each rank allocates its shard only.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .knobs import MODEL, Net, make_model, profiled_peak, shard, storage_bytes
from ..runtime.launch import rank_device


def init_weights(model: nn.Module, seed: int = 0) -> None:
    """Initialise every parameter (sharded DTensors too) with each module's own ``reset_parameters``. torch
    draws a DTensor's random values so that the whole tensor is the same whatever the number of ranks;
    they are not the values an unsharded ``make_model(seed)`` would draw (another RNG stream)."""
    import warnings
    torch.manual_seed(seed)
    with warnings.catch_warnings():  # "DTensor random operators may not have complete support on cpu
        warnings.simplefilter("ignore", UserWarning)  # device mesh": uniform_/normal_ on shards work here
        for m in model.modules():
            if hasattr(m, "reset_parameters") and m is not model:
                m.reset_parameters()


def meta_init(rank, world_size, model_kw=None):
    """``{"whole_model": bytes, "shard": this rank's parameter bytes, "built_then_sharded": peak,
    "meta_then_sharded": peak, "on_meta": bytes of storage the meta-built model holds before to_empty}``."""
    mkw = {**MODEL, **(model_kw or {})}
    with profiled_peak() as whole:
        model = shard(make_model(**mkw))
    del model
    with profiled_peak() as meta:
        with torch.device("meta"):
            model = Net(**mkw)
        on_meta = storage_bytes(p for p in model.parameters() if p.device.type != "meta")
        shard(model)
        model.to_empty(device=rank_device())
        init_weights(model)
    full = sum(p.numel() * p.element_size() for p in make_model(**mkw, device="meta").parameters())
    return {"whole_model": full, "shard": storage_bytes(model.parameters()), "on_meta": on_meta,
            "built_then_sharded": whole["peak"], "meta_then_sharded": meta["peak"],
            "finite": all(bool(torch.isfinite(p.full_tensor()).all()) for p in model.parameters())}


class SavedBytes:
    """``with SavedBytes() as s:`` around a forward: the bytes autograd saves for backward (distinct
    storages, by dtype) -- what ``torch.autograd.graph.save_on_cpu`` would copy to the host and back. It
    wraps torch's own hooks, so the forward runs as under ``save_on_cpu(pin_memory=False)``."""

    def __init__(self):
        self.by_dtype: dict[str, int] = {}
        self._seen: set = set()
        self._inner = torch.autograd.graph.save_on_cpu(pin_memory=False)

    def _pack(self, t):
        st = t.untyped_storage()
        if st._cdata not in self._seen and st.nbytes():
            self._seen.add(st._cdata)
            k = str(t.dtype).replace("torch.", "")
            self.by_dtype[k] = self.by_dtype.get(k, 0) + st.nbytes()
        return self._inner.pack_hook(t)

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._inner.unpack_hook)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.by_dtype.values())


def saved_for_backward(rank, world_size, precision="fp32", rows=64, model_kw=None):
    """Bytes saved for backward in one forward of the FSDP2 model on this rank, by dtype."""
    from .knobs import build
    model, _, _ = build({"precision": precision, "rows": rows}, model_kw)
    mkw = {**MODEL, **(model_kw or {})}
    x = torch.randn(rows, mkw["d_in"], device=rank_device())
    cast = torch.autocast(rank_device().type, torch.bfloat16, enabled=precision == "autocast")
    with SavedBytes() as s, cast:
        loss = model(x).float().pow(2).mean()
    loss.backward()
    dist.barrier()
    return s.by_dtype


__all__ = ["meta_init", "init_weights", "SavedBytes", "saved_for_backward"]
