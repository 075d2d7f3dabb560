"""Layouts beyond data parallelism: tensor (+sequence), pipeline, context and expert parallel, HSDP / 2-D FSDP
on one mesh.

    layout = Layout(tp=2, pp=2, dp_shard=2, schedule="1f1b", microbatches=4)
    peaks = plan_layout(LlamaConfig(512, 64, 4, 4, 2, 172), layout, global_batch=8, seq=32)  # one per rank

**One code path, run twice.** :func:`rank_step` builds rank r's part of a Llama-shaped decoder
(:class:`Llama`: torchtitan's module names), applies the layout the way torchtitan does -- TP first
(``parallelize_module``: q/k/v, w1/w3 colwise, wo/w2 rowwise with sequence parallel norms between them,
the embedding rowwise, the head colwise into ``loss_parallel``), then activation checkpointing per block,
then FSDP2 ``fully_shard`` per block + root over the data-parallel mesh dims x cp (``dp_shard`` alone: 2-D
FSDP x TP; ``dp_replicate`` x ``dp_shard``: HSDP) -- and runs steady training steps through its pipeline
stage or stages (:func:`pipeline_step`: the course's own, GPipe, 1F1B or interleaved 1F1B). Real ranks run
it over gloo under the course's ``MemoryTracker`` (:func:`measure_layout`); the plan runs the same function
on fake tensors in a fake process group under the planner's fake-storage tracker (:func:`plan_layout`), once
per rank that differs -- its pipeline stage (the first holds the embedding, the last the norm, head and loss;
stages split layers as ``torch.tensor_split``, so unequal) and, where FSDP2's ``torch.chunk`` shards are
uneven, its dp_shard and cp coordinates. Tensor-parallel and replicate ranks are symmetric: one trace serves them.
On the CPU the plan equals the tracker to the byte on every rank at 2 and 4 ranks: pipeline stages (GPipe,
1F1B, interleaved), TP, FSDP2, HSDP, FSDP2 x TP, PP x TP, CP (alone, x FSDP2, x TP) and EP (alone, x FSDP2, x CP)
(tests/test_planner_parallel.py) -- once DTensor's sharding propagation is kept out of the count as on real
ranks (:func:`_as_on_real_ranks`).

**Context parallel** (``cp``) is torchtitan's "allgather" method: each rank holds ``seq / cp`` consecutive
tokens of every sample, all-gathers K and V over ``cp`` before attention (their gradients reduce-scattered
in backward) and masks causally at global positions; each rank's loss is the mean over its tokens and
FSDP2 averages over ``dp_shard x cp``, so the loss is the mean over all tokens. **Expert parallel** (``ep``,
a config with ``experts``): every block's feed-forward is a MoE (:class:`MoE`: a router Linear, top-k,
a capacity per expert so that every shape is static and a fake-tensor trace holds exactly); ``ep`` borrows
``dp_shard x cp``'s ranks as torchtitan's ParallelDims does, each rank builds its ``experts / ep`` experts
(an FSDP2 unit of their own, sharded over the ``dp_shard x cp / ep`` ranks holding the same experts), and
tokens reach them and come back by ``all_to_all_single``.

**The schedule's in-flight micro-batches** come from running it, not from a rule: GPipe keeps all ``m``
forwards' activations before the first backward; 1F1B runs ``min(m, pp - stage - 1)`` warm-up forwards
and then alternates, so stage s holds ``min(m, pp - s)``. Interleaved 1F1B (``virtual_stages`` v: each
rank holds v chunks, chunk c being global stage ``c pp + rank``; torch's ``ScheduleInterleaved1F1B`` order)
holds ``min(m v, (v - 1) pp + 2 (pp - s - 1) + 1)`` chunk micro-batches. Point-to-point: sends are
``isend``; a rank posts its next ``irecv`` and then waits for it and for its pending sends together (no
rank blocks on a send before its peer posts the receive, so 1F1B cannot deadlock), so a sent tensor lives
until the next receive completes; under interleaving until the step's end (:class:`_P2P`) -- which the
plan counts because it runs the same code.

**Scale** (70B/405B, 50+ layouts): a full trace per layout would take minutes, so ``planner.search``
composes the per-rank peak by arithmetic over the same layout: the stage's sharded state (TP local shapes, then
FSDP2's ``dp_shard`` chunks), the schedule's in-flight micro-batches times a block's saved activations,
plus the largest transient (its terms: ``planner.search``).
"""

import contextlib
import math
import time
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass_type

SCHEDULES = ("gpipe", "1f1b", "interleaved")
STEPS = 3  # as planner.validation: the first makes Adam's state and FSDP2's storages; the third is counted


class LlamaConfig(NamedTuple):
    vocab: int
    d: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    experts: int = 0  # routed experts per block (0: the dense SwiGLU feed-forward); a MoE block has no dense one
    top_k: int = 1  # experts each token is sent to
    expert_ffn: int = 0  # each expert's SwiGLU width
    capacity_factor: float = 1.0  # slots per expert: capacity()'s rule

    def __repr__(self):  # a dense config shows the dense fields only
        shown = self._fields if self.experts else self._fields[:6]
        return f"LlamaConfig({', '.join(f'{k}={getattr(self, k)!r}' for k in shown)})"


LLAMA3 = {  # Llama-3 shapes (hidden, layers, heads, kv heads, ffn; 128256-token vocabulary)
    "llama3-8b": LlamaConfig(128256, 4096, 32, 32, 8, 14336),
    "llama3-70b": LlamaConfig(128256, 8192, 80, 64, 8, 28672),
    "llama3-405b": LlamaConfig(128256, 16384, 126, 128, 8, 53248),
}


@dataclass(frozen=True)
class Layout:
    """One point of the search: the mesh is (pp, dp_replicate, dp_shard, cp, tp), ranks numbered row-major;
    ``ep`` borrows ``dp_shard x cp``'s ranks (torchtitan's ParallelDims), adding none."""
    tp: int = 1
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    ep: int = 1
    schedule: str = "1f1b"
    microbatches: int = 1
    checkpointing: bool = False
    virtual_stages: int = 1  # interleaved: stages per rank

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp_replicate * self.dp_shard * self.cp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def coords(self, rank):
        """(pp, dp_replicate, dp_shard, cp, tp) coordinates of ``rank``."""
        out = []
        for n in (self.tp, self.cp, self.dp_shard, self.dp_replicate, self.pp):
            out.append(rank % n)
            rank //= n
        return tuple(reversed(out))

    def describe(self) -> str:
        parts = [f"tp{self.tp}", f"pp{self.pp}"]
        if self.pp > 1:
            parts.append(f"{self.schedule}{'x' + str(self.virtual_stages) if self.virtual_stages > 1 else ''}"
                         f"/m{self.microbatches}")
        elif self.microbatches > 1:
            parts.append(f"accum{self.microbatches}")
        parts.append(f"dp{self.dp_replicate}x{self.dp_shard}" if self.dp_replicate > 1 else f"fsdp{self.dp_shard}")
        if self.cp > 1:
            parts.append(f"cp{self.cp}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        if self.checkpointing:
            parts.append("ac")
        return " ".join(parts)


def check_layout(cfg: LlamaConfig, layout: Layout, global_batch: int, seq: int) -> int:
    """The micro-batch size in samples, or one clear ValueError naming what to change."""
    L = layout
    for name in ("tp", "pp", "dp_replicate", "dp_shard", "cp", "ep", "microbatches", "virtual_stages"):
        v = getattr(L, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if L.schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {L.schedule!r}")
    if cfg.heads % L.tp or cfg.kv_heads % L.tp:
        raise ValueError(f"tp={L.tp} must divide the attention heads ({cfg.heads}) and key/value heads "
                         f"({cfg.kv_heads})")
    if cfg.experts and L.tp > 1:
        raise ValueError(f"tp={L.tp} with routed experts is not planned (experts are not tensor-parallel here): "
                         "use ep")
    if L.ep > 1 and not cfg.experts:
        raise ValueError(f"ep={L.ep} needs routed experts (a MoE config: experts > 0)")
    if cfg.experts % L.ep or (L.dp_shard * L.cp) % L.ep or (L.ep > 1 and L.ep % L.cp):
        raise ValueError(f"ep={L.ep} must divide the experts ({cfg.experts}) and dp_shard x cp "
                         f"({L.dp_shard * L.cp}), and be a multiple of cp ({L.cp}): ep borrows those ranks")
    if cfg.ffn % L.tp or cfg.vocab % L.tp:
        raise ValueError(f"tp={L.tp} must divide the MLP width ({cfg.ffn}) and the vocabulary ({cfg.vocab})")
    if seq % (L.tp * L.cp):
        raise ValueError(f"seq={seq} must be divisible by tp x cp = {L.tp * L.cp} (sequence parallel shards it)")
    if L.pp * L.virtual_stages > cfg.layers:
        raise ValueError(f"pp={L.pp} x {L.virtual_stages} virtual stage(s) exceeds the model's {cfg.layers} layers")
    if L.virtual_stages > 1 and (L.schedule != "interleaved" or L.pp == 1):
        raise ValueError(f"virtual_stages={L.virtual_stages} needs schedule='interleaved' and pp > 1")
    if L.schedule == "interleaved" and L.pp > 1 and L.microbatches % L.pp:
        raise ValueError(f"interleaved 1F1B needs microbatches ({L.microbatches}) divisible by pp ({L.pp})")
    if global_batch % (L.dp * L.microbatches):
        raise ValueError(f"global batch {global_batch} is not divisible by dp ({L.dp}) x microbatches "
                         f"({L.microbatches}) = {L.dp * L.microbatches}")
    return global_batch // (L.dp * L.microbatches)


# --- the model, torchtitan's names ------------------------------------------------------------------------

class _GatherSequence(torch.autograd.Function):
    """All-gather over the cp group along the sequence (dim 1); backward reduce-scatters the gradient.
    (gloo takes the concatenated form only: chunks along dim 0.)"""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, n = group, dist.get_world_size(group)
        out = x.new_empty((n * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out.unflatten(0, (n, -1)).movedim(0, 1).flatten(1, 2)

    @staticmethod
    def backward(ctx, grad):
        n = dist.get_world_size(ctx.group)
        whole = grad.unflatten(1, (n, -1)).movedim(1, 0).flatten(0, 1).contiguous()
        out = whole.new_empty((whole.shape[0] // n, *whole.shape[1:]))
        dist.reduce_scatter_tensor(out, whole, group=ctx.group)
        return out, None


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` in equal splits along dim 0; its backward is the same exchange of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _AllToAll.apply(grad, ctx.group), None


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.head_dim = cfg.d // cfg.heads
        self.wq = nn.Linear(cfg.d, cfg.heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d, cfg.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d, cfg.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.heads * self.head_dim, cfg.d, bias=False)
        self.cp_group = None  # context parallel (apply_layout): this rank's queries, every rank's keys and values

    def forward(self, x):
        b, t = x.shape[0], x.shape[1]  # a DTensor's global shape under TP: the heads are what -1 makes local
        q = self.wq(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k, v = self.wk(x), self.wv(x)
        if self.cp_group is None:
            k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2) for z in (k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:  # torchtitan's "allgather" context parallel: K and V gathered whole, the causal mask at global positions
            k, v = (_GatherSequence.apply(z, self.cp_group).view(b, -1, z.shape[-1] // self.head_dim, self.head_dim)
                    .transpose(1, 2) for z in (k, v))
            start = dist.get_rank(self.cp_group) * t
            mask = torch.arange(k.shape[2], device=x.device) <= torch.arange(start, start + t, device=x.device)[:, None]
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1, self.w3 = nn.Linear(cfg.d, cfg.ffn, bias=False), nn.Linear(cfg.d, cfg.ffn, bias=False)
        self.w2 = nn.Linear(cfg.ffn, cfg.d, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class GroupedExperts(nn.Module):
    """This rank's experts, stacked (torchtitan's shapes): each a SwiGLU, run together by ``bmm``."""

    def __init__(self, d: int, hidden: int, n: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(n, hidden, d) / d ** 0.5)
        self.w2 = nn.Parameter(torch.randn(n, d, hidden) / hidden ** 0.5)
        self.w3 = nn.Parameter(torch.randn(n, hidden, d) / d ** 0.5)

    def forward(self, x):  # [experts, tokens, d]
        h = F.silu(torch.bmm(x, self.w1.transpose(1, 2))) * torch.bmm(x, self.w3.transpose(1, 2))
        return torch.bmm(h, self.w2.transpose(1, 2))


def capacity(cfg: LlamaConfig, tokens: int) -> int:
    """Slots per expert for ``tokens`` tokens of one rank: ceil(capacity_factor x tokens x top_k / experts)."""
    return math.ceil(cfg.capacity_factor * tokens * cfg.top_k / cfg.experts)


class MoE(nn.Module):
    """Routed experts with static shapes (GShard/Switch capacity), so that a fake-tensor trace holds exactly.

    A router Linear scores the experts per token (softmax), each token goes to its ``top_k`` best, weighted
    by their scores. Every expert takes :meth:`capacity` tokens from each rank: assignments fill its
    slots in token order (token i's choices before token i+1's), those past capacity are dropped (their
    expert adds nothing to the token's output), empty slots are zero rows that the experts compute all
    the same -- so every buffer has the same shape whatever the routing, and the padding is counted.
    Expert parallel (``ep_group``, apply_layout): this rank holds ``experts / ep`` of them; the
    ``[experts, capacity, d]`` buffer goes to the experts' ranks by ``all_to_all_single`` (equal splits)
    and the outputs come back by a second. (The experts' gradients sum over the tokens every ep rank sent;
    torchtitan rescales them by FSDP2's gradient divide factor, which moves no memory: not done here.)"""

    def __init__(self, cfg: LlamaConfig, ep: int = 1):
        super().__init__()
        self.cfg, self.n, self.top_k = cfg, cfg.experts, cfg.top_k
        self.router = nn.Linear(cfg.d, cfg.experts, bias=False)
        self.experts = GroupedExperts(cfg.d, cfg.expert_ffn, cfg.experts // ep)
        self.ep_group = None

    def forward(self, x):
        shape, d = x.shape, x.shape[-1]
        x = x.reshape(-1, d)
        cap, e = capacity(self.cfg, x.shape[0]), self.n
        weights, chosen = self.router(x).softmax(-1).topk(self.top_k, dim=-1)
        chosen = chosen.flatten()
        hits = torch.zeros(chosen.shape[0], e, dtype=torch.long, device=x.device).scatter_(1, chosen[:, None], 1)
        pos = (hits.cumsum(0) * hits).sum(-1) - 1  # each assignment's place in its expert's queue
        slot = torch.where(pos < cap, chosen * cap + pos, e * cap)  # e * cap: dropped
        token = torch.arange(x.shape[0], device=x.device).repeat_interleave(self.top_k)
        # each slot's token, or the zero row past the last token (a gather: backward keeps only indices)
        fill = torch.full((e * cap + 1,), x.shape[0], device=x.device).scatter_(0, slot, token)[:-1]
        buf = torch.cat([x, x.new_zeros(1, d)])[fill]
        if self.ep_group is None:
            out = self.experts(buf.view(e, cap, d)).view(e * cap, d)
        else:
            ep = dist.get_world_size(self.ep_group)
            mine = _AllToAll.apply(buf, self.ep_group).view(ep, e // ep, cap, d).transpose(0, 1).reshape(e // ep, -1, d)
            out = self.experts(mine).view(e // ep, ep, cap, d).transpose(0, 1).reshape(e * cap, d)
            out = _AllToAll.apply(out, self.ep_group)
        out = torch.cat([out, out.new_zeros(1, d)])[slot].view(-1, self.top_k, d)
        return (out * weights.unsqueeze(-1)).sum(1).view(shape)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig, ep: int = 1):
        super().__init__()
        self.attention_norm, self.attention = nn.RMSNorm(cfg.d), Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.d)
        self.moe = MoE(cfg, ep) if cfg.experts else None
        self.feed_forward = None if cfg.experts else FeedForward(cfg)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + (self.feed_forward if self.moe is None else self.moe)(self.ffn_norm(h))


class Llama(nn.Module):
    """One pipeline stage of a Llama-shaped decoder: ``layers`` blocks, with the embedding on the first
    stage and the final norm and head on the last (both on one stage: the whole model). RoPE is left out:
    it saves no activation a memory plan would miss at these sizes' order (two [b, t, heads, hd] tensors)."""

    def __init__(self, cfg: LlamaConfig, layers=None, first=True, last=True, ep=1):
        super().__init__()
        n = cfg.layers if layers is None else layers
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.d) if first else None
        self.layers = nn.ModuleList(TransformerBlock(cfg, ep) for _ in range(n))
        self.norm = nn.RMSNorm(cfg.d) if last else None
        self.output = nn.Linear(cfg.d, cfg.vocab, bias=False) if last else None

    def forward(self, x):
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h)) if self.output is not None else h


def stage_layers(n_layers: int, pp: int) -> list[int]:
    """Blocks per stage: as equal as can be, the first stages one more (``torch.tensor_split``'s rule)."""
    per, extra = divmod(n_layers, pp)
    return [per + (s < extra) for s in range(pp)]


# --- applying the layout: TP, then AC, then FSDP2 (torchtitan's order) -------------------------------------

def make_mesh(layout: Layout, device_type: str):
    """The layout's mesh, as torchtitan's ParallelDims builds it: (pp, dp_replicate, dp_shard, cp, tp), dims of
    size 1 left out but pp, dp_replicate, dp_shard and tp; with ep, dp_shard splits into (dp_shard_mod_ep,
    dp_shard_in_ep) and ``ep`` is (dp_shard_in_ep, cp) flattened. FSDP2 shards over ``dp_shard_cp``."""
    from torch.distributed.device_mesh import init_device_mesh
    L = layout
    if L.ep > 1:
        shard = {"dp_shard_mod_ep": L.dp_shard * L.cp // L.ep, "dp_shard_in_ep": L.ep // L.cp}
    else:
        shard = {"dp_shard": L.dp_shard}
    dims = {"pp": L.pp, "dp_replicate": L.dp_replicate, **shard, "cp": L.cp, "tp": L.tp}
    if L.cp == 1:
        del dims["cp"]
    mesh = init_device_mesh(device_type, tuple(dims.values()), mesh_dim_names=tuple(dims))
    if L.ep > 1:
        mesh[tuple(shard)]._flatten("dp_shard")
        mesh[("dp_shard_in_ep", "cp") if L.cp > 1 else ("dp_shard_in_ep",)]._flatten("ep")
    if L.cp > 1 or L.ep > 1:
        mesh[tuple(shard) + (("cp",) if L.cp > 1 else ())]._flatten("dp_shard_cp")
    return mesh


def apply_tp(model: Llama, tp_mesh):
    """torchtitan's Llama plan: sequence parallel norms, colwise q/k/v/w1/w3, rowwise wo/w2 back to
    sequence shards, rowwise embedding, colwise head kept sharded over the vocabulary for ``loss_parallel``."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    top = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.output is not None:
        top["norm"] = SequenceParallel()
        top["output"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
    parallelize_module(model, tp_mesh, top)
    for block in model.layers:
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        })
    return model


def apply_layout(model: Llama, layout: Layout, mesh):
    """TP (if tp > 1), CP's and EP's groups, then per-block checkpointing, then FSDP2 per block + root over the
    dp dims x cp (if dp x cp > 1; HSDP when dp_replicate > 1) -- the experts first, on their own, over the dp
    ranks that hold the same experts: what torchtitan's ``parallelize_llama`` / ``parallelize_qwen3`` do, in
    their order."""
    if layout.tp > 1:
        apply_tp(model, mesh["tp"])
    for block in model.layers:
        if layout.cp > 1:
            block.attention.cp_group = mesh["cp"].get_group()
        if layout.ep > 1:
            block.moe.ep_group = mesh["ep"].get_group()
    if layout.checkpointing:
        from .trace import apply_checkpointing
        apply_checkpointing(model)
    if layout.dp * layout.cp > 1:
        from torch.distributed.fsdp import fully_shard
        shard = "dp_shard_cp" if layout.cp > 1 or layout.ep > 1 else "dp_shard"
        dp_mesh = mesh[("dp_replicate", shard) if layout.dp_replicate > 1 else shard]
        # the experts' replicas: same ep coordinate (torchtitan's dp_mod_ep mesh)
        experts_mesh = mesh[("dp_replicate", "dp_shard_mod_ep") if layout.dp_replicate > 1 else "dp_shard_mod_ep"] \
            if layout.ep > 1 else None
        for block in model.layers:
            if experts_mesh is not None:
                for m in block.modules():
                    if isinstance(m, GroupedExperts):
                        fully_shard(m, mesh=experts_mesh)
            fully_shard(block, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    return model


# --- the course's own pipeline stages --------------------------------------------------------------------

class _P2P:
    """Point-to-point between stages: ``isend``; ``recv`` posts an ``irecv`` and waits for it and every
    pending send together (a sent tensor lives until then). ``hold`` (interleaved 1F1B): sends are waited
    only at the step's end, as torch's ``_PipelineScheduleRuntime`` does (its ``send_ops``,
    torch/distributed/pipelining/schedules.py), so every sent tensor lives until then: waiting at each
    receive deadlocks Megatron's order (pp=2, v=2, m=4: rank 0 waits in a backward for rank 1 to take a
    forward's activation while rank 1 waits for rank 0 to take a gradient). Activations go on tag 0,
    gradients on tag 1: under interleaving both may travel between the same two ranks, each in its own
    order. ``fake``: the same tensors made and kept, nothing moved (the plan's run in a fake process group)."""

    def __init__(self, mesh, fake, hold=False):
        self.fake, self.hold, self.pending = fake, hold, []
        if not fake and mesh is not None:
            self.group = mesh["pp"].get_group()
            self.ranks = dist.get_process_group_ranks(self.group)

    def send(self, t, peer, tag):
        self.pending.append((t, None if self.fake else dist.isend(t, self.ranks[peer], group=self.group, tag=tag)))

    def recv(self, shape, dtype, device, peer, tag):
        buf = torch.empty(shape, dtype=dtype, device=device)
        if not self.fake:
            work = dist.irecv(buf, self.ranks[peer], group=self.group, tag=tag)
            if not self.hold:
                self.flush()
            work.wait()
        if not self.hold:
            self.pending.clear()
        return buf

    def flush(self):
        for _, w in self.pending:
            if w is not None:
                w.wait()
        self.pending.clear()


def schedule_order(schedule: str, m: int, pp: int, stage: int, v: int = 1):
    """The stage's ops in order: ("F", chunk, i) / ("B", chunk, i). GPipe: every forward, then every
    backward; 1F1B (torch's ``Schedule1F1B``): ``min(m, pp - stage - 1)`` warm-up forwards, then one forward
    one backward. Interleaved (torch's ``ScheduleInterleaved1F1B``, torch/distributed/pipelining/schedules.py:
    ``_get_warmup_ops``, ``_get_1f1b_rank_ops``; Megatron's order, ``m`` a multiple of ``pp``): the rank
    holds ``v`` chunks, its forwards go through them in rounds of ``pp`` micro-batches (chunk 0, then 1, ...),
    its backwards from the last chunk back; ``min((v - 1) pp + 2 (pp - stage - 1), m v)`` warm-up forwards."""
    if schedule == "gpipe":
        return [("F", 0, i) for i in range(m)] + [("B", 0, i) for i in range(m)]
    if schedule == "1f1b":
        v, warm = 1, min(m, pp - stage - 1)
    else:
        warm = min((v - 1) * pp + 2 * (pp - stage - 1), m * v)
    # the k-th forward (backward): chunk (k // pp) % v (counted from the last), micro-batch of its round
    fwd = [("F", (k // pp) % v, k // (pp * v) * pp + k % pp) for k in range(m * v)]
    bwd = [("B", v - 1 - (k // pp) % v, k // (pp * v) * pp + k % pp) for k in range(m * v)]
    steady = [op for pair in zip(fwd[warm:], bwd) for op in pair]
    return fwd[:warm] + steady + bwd[m * v - warm:]


def pipeline_step(chunks: list, opt, tokens, targets, *, layout: Layout, pp_rank: int, p2p: _P2P, d: int,
                  act_dtype=torch.float32):
    """One training step of this rank's model chunks (one, or ``virtual_stages`` under interleaving: chunk c
    is global stage ``c pp + pp_rank``): the schedule's forwards and backwards over ``m`` micro-batches
    (each loss / m), then the optimizer step and ``zero_grad``."""
    from torch.distributed.tensor.parallel import loss_parallel
    m, pp, v = layout.microbatches, layout.pp, len(chunks)
    last = pp * v - 1
    prev, nxt = (pp_rank - 1) % pp, (pp_rank + 1) % pp
    xs, ys = tokens.tensor_split(m), targets.tensor_split(m)
    b, t = xs[0].shape
    boundary = (b, t // layout.tp if layout.tp > 1 else t, d)  # what crosses stages: sequence-sharded under SP
    device = tokens.device
    lossy = loss_parallel if layout.tp > 1 else contextlib.nullcontext
    saved = {}
    for kind, c, i in schedule_order(layout.schedule if pp > 1 else "1f1b", m, pp, pp_rank, v):
        g = c * pp + pp_rank
        if kind == "F":
            x = xs[i] if g == 0 else p2p.recv(boundary, act_dtype, device, prev, 0).requires_grad_()
            out = chunks[c](x)
            if g == last:
                with lossy():
                    out = F.cross_entropy(out.flatten(0, 1), ys[i].flatten()) / m
            else:
                p2p.send(out.detach(), nxt, 0)
            saved[c, i] = (x, out)
        else:
            x, out = saved.pop((c, i))
            if g == last:
                with lossy():
                    out.backward()
            else:
                out.backward(p2p.recv(boundary, out.dtype, device, nxt, 1))
            if g > 0:
                p2p.send(x.grad, prev, 1)
            del x, out
    p2p.flush()
    opt.step()
    opt.zero_grad(set_to_none=True)


def rank_step(cfg: LlamaConfig, layout: Layout, rank: int, tokens, targets, tracker, *, mesh, device, fake=False):
    """Build rank ``rank``'s stage under ``tracker`` (entered before the model exists, as planner.validation
    measures), apply the layout, run :data:`STEPS` steps; returns the tracker (its peak: the last step's)."""
    pp_rank = layout.coords(rank)[0]
    sizes = stage_layers(cfg.layers, layout.pp * layout.virtual_stages)  # chunk c: global stage c pp + pp_rank
    p2p = _P2P(mesh if layout.pp > 1 else None, fake, hold=layout.schedule == "interleaved")
    with tracker as mt:
        with torch.device(device):
            chunks = [Llama(cfg, sizes[g], first=g == 0, last=g == len(sizes) - 1, ep=layout.ep)
                      for g in range(pp_rank, len(sizes), layout.pp)]
        for chunk in chunks:  # each chunk its own FSDP2 root, as torchtitan parallelizes each model part
            apply_layout(chunk, layout, mesh)
        opt = torch.optim.Adam([p for chunk in chunks for p in chunk.parameters() if p.requires_grad], lr=1e-3,
                               foreach=True)
        if fake and layout.dp * layout.cp > 1:
            from .fsdp import step_on_shards
            step_on_shards(opt)  # DTensor's foreach sharding propagation is slow under fake tensors; same tensors
        for i in range(STEPS):
            if i == STEPS - 1:
                mt.reset_peak()
            pipeline_step(chunks, opt, tokens, targets, layout=layout, pp_rank=pp_rank, p2p=p2p, d=cfg.d)
    return mt


def _rank_batch(cfg, layout, global_batch, seq, rank, device):
    """This rank's share of the global batch (its dp coordinate's rows, its cp coordinate's part of the
    sequence), on ``device``: made before counting."""
    check_layout(cfg, layout, global_batch, seq)
    _, r, s, c, _ = layout.coords(rank)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab, (global_batch, seq + 1), generator=g)
    per, t = global_batch // layout.dp, seq // layout.cp
    mine = tokens[(r * layout.dp_shard + s) * per:][:per, c * t:][:, :t + 1]
    return mine[:, :-1].to(device).contiguous(), mine[:, 1:].to(device).contiguous()


# --- measured on real ranks, planned on fake ones ----------------------------------------------------------

_COLLECTIVES = ("all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor", "reduce_scatter_single",
                "all_reduce", "all_to_all_single", "broadcast")


@contextlib.contextmanager
def settled_collectives():
    """On gloo's CPU ranks, each collective returns once gloo's worker thread has let go of its tensors.
    gloo runs a collective on that thread, whose Work keeps the tensors (and views of them) until the thread
    drops it, which may be after the caller has moved on: a buffer the caller dropped meanwhile (FSDP2's
    all-gather input, a contiguous copy) is then freed there, at a moment of the thread's choosing, and a
    rank's measured peak varied by up to 64 KiB from run to run under load. Waiting here gives the figure
    the plan counts -- freed when the caller drops it, as the CUDA caching allocator frees a tensor under
    NCCL -- and costs the CPU lab only overlap it does not measure. The Work holds the very tensor objects it
    was given (torch/csrc/distributed/c10d/ProcessGroupGloo.cpp, ``runLoop``: the worker drops it after
    ``execute()`` has woken the caller), a hold their storage's use count cannot show: so each collective is given fresh aliases
    (``detach()``: the same storage, one more use while anything holds them), and returns once those uses are
    gone (an ``async_op`` collective's Work stays with the caller, tensors and all). DTensor's collectives
    (TP's) are ``_c10d_functional`` ops, not ``dist``'s: a dispatch mode settles those alike."""
    def uses(tensors):
        return [torch._C._storage_Use_Count(t.untyped_storage()._cdata) for t in tensors]

    def aliased(tree):
        return tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) and t.device.type == "cpu" else t, tree)

    def settle(tensors, held):
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(n > h for n, h in zip(uses(tensors), held)):
            time.sleep(1e-4)

    def settled(fn):
        def call(*args, **kwargs):
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.device.type == "cpu"]
            held = uses(tensors)
            work = fn(*aliased(args), **aliased(kwargs))
            if work is not None:  # async_op: the caller's Work holds the tensors for as long as the caller keeps it
                work.wait()
                return work
            settle(tensors, held)
            return None
        return call

    class Functional(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(is_traceable_wrapper_subclass_type(t) for t in types):
                return NotImplemented
            if func.namespace != "_c10d_functional" or func.__name__.startswith(("wait_tensor", "_")):
                return func(*args, **(kwargs or {}))
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            held = uses(tensors)
            out = func(*aliased(args), **aliased(kwargs or {}))
            for t in tree_leaves(out):
                torch.ops._c10d_functional.wait_tensor(t)
            settle(tensors, held)
            return out
    originals = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}
    for name, fn in originals.items():
        setattr(dist, name, settled(fn))
    try:
        with Functional():
            yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _measure_rank(rank, world, cfg, layout, global_batch, seq):
    from ..runtime.launch import rank_device
    from ..runtime.tracker import MemoryTracker
    forget_meshes()  # forked from a process that may have planned: its DTensor caches hold other meshes
    torch.manual_seed(0)
    device = rank_device()
    tokens, targets = _rank_batch(cfg, layout, global_batch, seq, rank, device)
    mesh = make_mesh(layout, device.type)  # its rank tensors before the count, as the plan makes it
    with settled_collectives() if device.type == "cpu" else contextlib.nullcontext():
        mt = rank_step(cfg, layout, rank, tokens, targets, MemoryTracker(device=device), mesh=mesh, device=device)
    return mt.peak_bytes


def measure_layout(cfg: LlamaConfig, layout: Layout, global_batch: int, seq: int, backend: str = "auto") -> list[int]:
    """Each rank's measured peak (the course's ``MemoryTracker``) of the layout's steady step, on real ranks
    (``backend``: as ``run_ranks``; "gloo" measures on CPU ranks, like the plan, on a machine with GPUs too)."""
    from ..runtime.launch import run_ranks
    return run_ranks(_measure_rank, layout.world, cfg, layout, global_batch, seq, backend=backend, timeout=600)


def distinct_ranks(cfg: LlamaConfig, layout: Layout) -> dict:
    """{representative rank: [ranks it stands for]}: ranks differ by pipeline stage and, where some
    parameter's (TP-local) dim 0 does not split evenly in FSDP2's chunks, by dp_shard and cp coordinate.
    (CP's ranks differ in their causal mask's values only, EP's in their experts' values.)"""
    dims0 = {cfg.vocab // layout.tp, cfg.d, cfg.heads * (cfg.d // cfg.heads) // layout.tp,
             cfg.kv_heads * (cfg.d // cfg.heads) // layout.tp, cfg.ffn // layout.tp, cfg.experts or cfg.d}
    even = all(n % (layout.dp_shard * layout.cp) == 0 for n in dims0) and (
        layout.ep == 1 or (cfg.experts // layout.ep) % (layout.dp_shard * layout.cp // layout.ep) == 0)
    groups = {}
    for r in range(layout.world):
        p, _, s, c, _ = layout.coords(r)
        groups.setdefault((p, 0 if even else (s, c)), []).append(r)
    return {ranks[0]: ranks for ranks in groups.values()}


def forget_meshes():
    """DTensor caches sharding decisions keyed by specs whose mesh compares equal across process groups; a
    cached spec would carry the last fake world's (destroyed) mesh into the next one: cleared per world."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import _redistribute as r
    prop = DTensor._op_dispatcher.sharding_propagator
    prop.propagate_op_sharding.cache_clear()
    prop._propagate_tensor_meta_cached.cache_clear()
    r._gen_transform_infos.cache_clear()
    r.clear_redistribute_planner_cache()
    torch._C._clear_DTensor_sharding_propagator_cache()  # the C++ fast path's own


@contextlib.contextmanager
def _as_on_real_ranks():
    """What DTensor does differently when a fake mode is already active, undone for the plan's run:
    (1) FSDP2 x TP joins the dp and tp meshes (``DeviceMesh._concatenate``), reading the mesh's real rank
    tensor: that one call runs outside the fake mode (everything FSDP2 makes stays fake, and counted);
    (2) DTensor's sharding propagation runs each op on global-shape fake tensors in the active fake mode if
    there is one, else in a fresh one (torch/distributed/tensor/_sharding_prop.py, ``detect_fake_mode() or
    FakeTensorMode()``): on real ranks a fresh one, which the tracker ignores. Under the plan's mode those
    global-shape temporaries were counted (+4% to +20% on a tensor-parallel rank); a fresh mode here too."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import _sharding_prop
    concat, detect = DeviceMesh._concatenate, _sharding_prop.detect_fake_mode

    def real(meshes):
        with unset_fake_temporarily():
            return concat(meshes)
    DeviceMesh._concatenate = staticmethod(real)
    _sharding_prop.detect_fake_mode = lambda *args: None
    try:
        yield
    finally:
        DeviceMesh._concatenate = staticmethod(concat)
        _sharding_prop.detect_fake_mode = detect


def plan_layout(cfg: LlamaConfig, layout: Layout, global_batch: int, seq: int) -> list[int]:
    """Each rank's planned peak: :func:`rank_step` on fake tensors in a fake process group of the layout's
    world, once per distinct rank (:func:`distinct_ranks`), under the planner's fake-storage tracker."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ..runtime.fake_world import fake_world
    from .accounting import FakeTracker
    peaks = [0] * layout.world
    for rep, ranks in distinct_ranks(cfg, layout).items():
        tokens, targets = _rank_batch(cfg, layout, global_batch, seq, rep, "cpu")
        forget_meshes()
        with fake_world(layout.world, rep), _as_on_real_ranks():
            mesh = make_mesh(layout, "cpu")
            with FakeTensorMode(allow_non_fake_inputs=True) as mode:
                x, y = mode.from_tensor(tokens), mode.from_tensor(targets)
                mt = rank_step(cfg, layout, rep, x, y, FakeTracker(None, None, "cpu", 1), mesh=mesh,
                               device="cpu", fake=True)
        for r in ranks:
            peaks[r] = mt.peak_bytes
    return peaks


__all__ = ["Layout", "LlamaConfig", "LLAMA3", "SCHEDULES", "check_layout", "plan_layout", "measure_layout",
           "rank_step", "pipeline_step", "schedule_order", "stage_layers", "apply_layout", "apply_tp", "Llama",
           "distinct_ranks"]
