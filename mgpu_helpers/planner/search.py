"""The layout search at scale (``mgpu-plan CONFIG --gpus 8,64 --tp 1,2,4,8 --pp 1,2,4 --global-batch 256``).

A traced plan per layout (``planner.parallel.plan_layout``) is exact but takes seconds for a toy and much
longer for 405B; the search instead composes each rank's peak by arithmetic over the same layout, so that
50+ layouts of a 405B model plan in well under a second. Per rank of pipeline stage s (layers split as
``torch.tensor_split``: the first stages one more; the first holds the embedding, the last the final
norm, head and loss), the peak is the largest of the moments a training step can peak at -- what is alive
at each, not a bound over several -- each the sum of four terms (:class:`RankPlan`, the worst moment's):

- **state**: the stage's parameters, TP-local (q/k/v/w1/w3 split by output rows, wo/w2 by input columns,
  embedding and head by vocabulary, norms whole), then FSDP2's ``dp_shard`` chunk: fp32 parameters and
  Adam's two fp32 moments (12 B/param) always, fp32 gradients (4 B/param) once the first micro-batch's
  backward has made them (``zero_grad(set_to_none=True)`` frees them every step); under TP the
  embedding's gradient is DTensor's Partial, the whole vocabulary's rows;
- **gathered**: FSDP2's unsharded bf16 tensors: the root's own (embedding, norm, head: the root does not
  reshard after forward) from its forward to the end of its backward, in a block's backward that block
  and the prefetched next one, the gradients waiting to be reduce-scattered (none at ``dp_shard=1``);
- **activations**: what the in-flight micro-batches hold: per micro-batch the stage's input and per block
  its two residual-stream outputs (fp32), the all-gathered norm outputs ``T d``, q/k/v, the attention
  output, the SwiGLU's four ``T ffn / tp`` tensors, the norms' and attention's per-row statistics (with
  checkpointing only the block's output), and on the last stage the final norm's and the log-softmax's
  fp32 output over ``vocab / tp`` (without FSDP2, bf16 compute is ``torch.autocast`` over the fp32
  parameters, as torchtitan runs it: each linear's cast weight, and q/k/v's and w1/w3's own casts of
  the fp32 norm output, three ``T d`` more per block); micro-batches in flight -- GPipe ``m``, 1F1B
  ``min(m, pp - s)``; under interleaving (torch's ``ScheduleInterleaved1F1B``) the rank's order is walked
  op by op (``parallel.schedule_order``): at each backward, what each of its chunks holds, the gradients
  of the chunks whose first backward is done, and the sends, waited at the step's end, which keep each
  finished backward's output and gradient; the last rank holds one micro-batch's head (its last chunk's
  backward follows its forward). In a chunk's first backward the gradients made so far count beside
  the activations not yet let go: at its last block, at its second (FSDP2: the first block's parameters
  prefetched), at its first, at its end;
- **transient**: alive only inside one op or one backward: the loss's (the log-softmax's gradient and
  its input's in fp32; ``loss_parallel``'s composite keeps one more and per-token indices), the head's
  and the embedding's new weight gradient, a block's backward at its peak (beside the residual stream's
  gradient arriving: in w2's backward, its input's and its weight's gradients; or in mul's, its two
  factors' gradients and w2's new weight gradient while w2's saved input (under autocast, its cast
  weight) is gone -- kept in a chunk's first backward and under FSDP2, added to ``.grad`` at once
  after; or in the attention's, the feed-forward's activations gone; a MoE block: every gradient of the
  block beside its largest transient, a bound), the recomputed block under checkpointing (all but its
  output: checkpoint stops recomputing once backward's last tensor is saved), Adam's foreach square
  root of ``exp_avg_sq`` (4 B/param) in the step.

The moments: the first micro-batch's loss backward (no gradient yet), the first backward's blocks and its
end, a later micro-batch's loss, blocks and embedding backward (every gradient; the schedule holding
``k`` micro-batches again under 1F1B with ``m > k``, else ``k - 1``; interleaved: each backward of the
rank's order), and Adam's step.

**Context parallel** (``--cp``, as ``parallel.rank_step`` runs it: K and V all-gathered): each rank keeps
``seq / cp`` tokens of every sample, parameters are sharded over ``dp_shard x cp`` (torchtitan's
``dp_shard_cp`` mesh), each block saves every rank's K and V (``cp`` times its own) and the causal mask,
and its backward holds their gradients whole. **MoE and expert parallel** (``--ep``, a config with routed
experts): a block's feed-forward is the router and the experts (``parallel.MoE``): it saves the router's
probabilities, the top-k and the slots, and per expert ``capacity`` rows of input and SwiGLU tensors
(``experts x capacity`` rows per rank whatever ``ep`` is: each rank computes its experts' slots from every
ep rank); ``ep`` leaves the sharded state as it is (each rank's ``experts / ep`` over ``dp_shard x cp / ep``
ranks) but lets a block's backward unshard only this rank's experts, in an FSDP2 unit of their own.

Communication per rank per step (bytes on the wire, ring algorithms: a collective of ``n`` ranks moves
``(n - 1) / n`` of its buffer): TP+SP's two all-gathers and two reduce-scatters of ``T d`` bf16 per block
forward, as many in backward (and again in the recomputed forward); FSDP2's bf16 all-gather forward and
backward and fp32 reduce-scatter of the stage; HSDP's all-reduce of the shard's gradients over
``dp_replicate``; PP's activation send and gradient receive per micro-batch and boundary; CP's all-gather
of K and V per block and micro-batch and the reduce-scatter of their gradients; EP's two ``all_to_all``
of the experts' slots per block and micro-batch, forward and backward (the experts' FSDP2 traffic over
their own ``dp_shard x cp / ep`` ranks).

Held against the traced plan (``parallel.plan_layout``, itself equal to the tracker on real ranks),
like with like -- the trace computes in fp32 with the CPU's kernels, so the arithmetic with ``c=4,
kernels="cpu"`` (torch's composite RMSNorm also saves its normalised input; the CPU's flash attention
saves what a GPU's does) -- a 4-layer d=256 decoder over 17 layouts of 2 and 4 ranks (TP, PP GPipe and
1F1B with unequal stages, FSDP2, HSDP, FSDP2 x TP, PP x TP and checkpointing) and its 8-layer twin under
interleaved 1F1B (pp 2 and 4, two chunks a rank): never under, within +1%; CP and a MoE's EP (8 layouts:
cp2, cp4, cp2 x FSDP2, cp2 x TP2, ep2, ep4, ep2 x FSDP2, ep2 x cp2) within +3%. Traced with a GPU's
kernels (``planner.cuda.CudaKernels``; bf16 autocast where FSDP2 does not wrap), as ``bench/plan_layouts_gpu.py
--ranks`` runs the ranks on a GPU, the default arithmetic (``kernels="cuda"``) is within +1% too for the
layouts an H100 once found 2-8% over when the search took a bound over moments for the peak (HSDP, pp4's
stages, interleaved 1F1B, FSDP2 with checkpointing), under by a few hundred bytes at most (scalars a GPU
keeps on the CPU). tests/test_planner_search.py holds that, and the in-flight counts to the schedules the
ranks run (``parallel.schedule_order``) and the stage parameters to the model's. On one H100 (NCCL, world size 1;
``bench/plan_layouts_gpu.py``: 0.5B decoder, 4 x 2048 tokens, with and without checkpointing and with 2
and 4 micro-batches) the default bf16 arithmetic equals ``rank_step``'s ``max_memory_allocated`` under
autocast within 9 KiB (flash attention, fused RMSNorm), and ``c=4`` its fp32 step within 1 KiB where
the heads are not grouped (grouped heads in fp32 run SDPA's math kernel: refused). FSDP2's bf16 gathers
(``dp_shard > 1``) are not held against GPUs yet. CP, MoE and EP are held against CPU traces only.
"""

import itertools
from dataclasses import dataclass

from .budget import budget
from .parallel import Layout, LlamaConfig, capacity, check_layout, schedule_order, stage_layers

P32, BF16 = 4, 2


@dataclass
class RankPlan:
    stage: int
    state: int
    gathered: int
    activations: int
    transient: int

    @property
    def peak(self) -> int:
        return self.state + self.gathered + self.activations + self.transient


def ffn_params(cfg: LlamaConfig, tp: int, ep: int = 1) -> int:
    """A block's feed-forward: the SwiGLU's (TP-local), or the router's and this rank's ``experts / ep``'s."""
    if cfg.experts:
        return cfg.d * cfg.experts + cfg.experts // ep * 3 * cfg.d * cfg.expert_ffn
    return 3 * cfg.d * cfg.ffn // tp


def block_params(cfg: LlamaConfig, tp: int, ep: int = 1) -> int:
    hd = cfg.d // cfg.heads
    return (cfg.d * (cfg.heads + 2 * cfg.kv_heads) * hd + cfg.heads * hd * cfg.d) // tp + ffn_params(cfg, tp, ep) \
        + 2 * cfg.d


def ffn_activations(cfg: LlamaConfig, tp: int, tokens: int, c: int) -> int:
    """What a block's feed-forward saves for backward (its norm's output aside): the SwiGLU's four
    ``T ffn / tp`` tensors; or MoE's router probabilities (fp32), top-k weights (fp32) and indices, the
    assignments' slots and the slots' tokens (int64, with the dropped ones' slot), the experts' input
    (every slot of this rank's experts: ``experts x capacity`` rows whatever ``ep`` is), their four SwiGLU
    tensors, and the experts' outputs gathered back per assignment (``T top_k`` rows)."""
    if not cfg.experts:
        return 4 * c * tokens * cfg.ffn // tp
    slots = cfg.experts * capacity(cfg, tokens)
    return P32 * tokens * cfg.experts + (P32 + 8 + 8) * tokens * cfg.top_k + 8 * (slots + 1) + c * slots * cfg.d \
        + 4 * c * slots * cfg.expert_ffn + c * tokens * cfg.top_k * cfg.d


def stage_params(cfg: LlamaConfig, layout: Layout, stage: int) -> int:
    n = stage_layers(cfg.layers, layout.pp)[stage]
    p = n * block_params(cfg, layout.tp)
    if stage == 0:
        p += cfg.vocab * cfg.d // layout.tp
    if stage == layout.pp - 1:
        p += cfg.vocab * cfg.d // layout.tp + cfg.d
    return p


def block_activations(cfg: LlamaConfig, tp: int, tokens: int, checkpointing: bool, c: int = BF16,
                      kernels: str = "cuda", autocast: bool = False, cp: int = 1, seq: int = 0) -> int:
    """Bytes one block saves for backward per micro-batch of ``tokens`` (compute in ``c`` bytes per element,
    bf16 by default; the residual stream fp32): its two residual-stream outputs (the attention's sum, the
    block's output; its input is the previous block's output or the stage's input), the all-gathered
    norm outputs, q/k/v, the attention output, the SwiGLU's four ``T ffn / tp`` tensors. ``kernels="cpu"``:
    as a CPU runs it -- torch's composite RMSNorm also saves each norm's normalised input
    (``planner.cuda``: CUDA's fused kernel saves the input and one rstd per row). ``autocast``: the block
    runs under ``torch.autocast`` over fp32 parameters (no FSDP2 to gather bf16 copies): each linear saves
    its own cast of the weight (their bf16 copies: cast per forward, kept by the graph) and of its input --
    RMSNorm runs in fp32 under autocast, so q, k and v each keep a cast of the attention norm's output,
    w1 and w3 of the feed-forward norm's: three ``T d`` casts more than one per norm. ``cp``: context
    parallel's attention keeps every rank's keys and values (``cp`` times this rank's) and its mask over
    ``seq / cp`` queries x ``seq`` keys, converted to the compute dtype."""
    sp = tokens * cfg.d // tp
    if checkpointing:
        return P32 * sp  # the block's output, the next checkpoint's input
    hd = cfg.d // cfg.heads
    qkv = tokens * (cfg.heads + 2 * cfg.kv_heads * cp) * hd // tp
    attn_out = tokens * cfg.heads * hd // tp
    mask = c * (seq // cp) * seq if cp > 1 else 0
    norms = 2 * c * sp if kernels == "cpu" else 0
    rows = P32 * (2 * tokens + tokens * cfg.heads) // tp  # the norms' rstd, the attention's log-sum-exp
    casts = c * (3 * tokens * cfg.d + block_params(cfg, tp) - 2 * cfg.d) if autocast else 0
    return 2 * P32 * sp + 2 * c * tokens * cfg.d + c * (qkv + attn_out) + ffn_activations(cfg, tp, tokens, c) \
        + norms + rows + casts + mask


def block_backward(cfg: LlamaConfig, tp: int, tokens: int, c: int = BF16, cp: int = 1) -> int:
    """Bytes alive only inside one block's backward, at the larger of two moments, with the residual
    stream's gradient arriving and the one leaving (fp32): three ``T ffn / tp`` gradients of the SwiGLU (the
    product's, alive while ``mul``'s backward makes both factors'); the attention's gradients of its output,
    q, and the keys and values (``cp`` times this rank's under context parallel), one of those made
    contiguous for its reduce-scatter."""
    sp_grad = c * tokens * cfg.d if tp > 1 else 0  # sequence parallel's gathered gradient, before its reduce-scatter
    attention = attention_backward(cfg, tp, tokens, c, cp)
    if cfg.experts:  # with the experts' output gradient, their SwiGLU's three gradients at once; or, past
        # them, the one of w1's output with the input's gradients through w1 and w3 and their sum
        f, d = cfg.expert_ffn, cfg.d
        ffn = c * cfg.experts * capacity(cfg, tokens) * max(3 * f + d, f + 3 * d)
    else:
        ffn = 3 * c * tokens * cfg.ffn // tp
    return max(ffn, attention) + 2 * P32 * tokens * cfg.d // tp + sp_grad


def attention_backward(cfg: LlamaConfig, tp: int, tokens: int, c: int = BF16, cp: int = 1) -> int:
    """The attention's gradients alive at once in its backward: its output's, q's, and the keys' and
    values' (``cp`` times this rank's under context parallel), one of those made contiguous."""
    hd = cfg.d // cfg.heads
    return c * tokens * (2 * cfg.heads + (3 if cp > 1 else 2) * cfg.kv_heads * cp) * hd // tp


def in_flight(layout: Layout, stage: int) -> int:
    """Micro-batches of one model chunk (the stage's, or under interleaving one of its ``v`` chunks) the
    rank holds at its peak: its warm-up forwards and the first steady one (``parallel.schedule_order``)."""
    m, pp, v = layout.microbatches, layout.pp, layout.virtual_stages
    if pp == 1:
        return 1
    if layout.schedule == "gpipe":
        return m
    if layout.schedule == "1f1b":
        return min(m, pp - stage)
    return min(m * v, (v - 1) * pp + 2 * (pp - stage - 1) + 1)


def rank_plan(cfg: LlamaConfig, layout: Layout, stage: int, micro: int, seq: int, c: int = BF16,
              kernels: str = "cuda") -> RankPlan:
    """The rank's terms at its peak: the largest of the moments of the step (module docs). ``kernels``:
    "cuda", or "cpu" for the CPU's kernels (with ``c=4``: a plan traced on the CPU)."""
    tokens, tp = micro * seq // layout.cp, layout.tp
    n = stage_layers(cfg.layers, layout.pp)[stage]
    last = stage == layout.pp - 1
    params = stage_params(cfg, layout, stage)
    shards = layout.dp_shard * layout.cp  # torchtitan shards parameters over dp_shard x cp ("dp_shard_cp")
    local = -(-params // shards)
    weights, grads = local * (P32 + 2 * P32), local * P32  # fp32 parameters and Adam's moments; gradients
    # DTensor's row-wise embedding makes its gradient Partial: the whole vocabulary's rows on every TP rank
    wide = P32 * (cfg.vocab * cfg.d - cfg.vocab * cfg.d // tp) if stage == 0 and tp > 1 else 0
    grads += -(-wide // shards)
    if kernels == "cpu":  # Adam's step counters, one per parameter (a GPU's stay on the CPU), the loss's scalars
        weights += P32 * ((10 if cfg.experts else 9) * n + (stage == 0) + 2 * last + 4)
    # a block's parameters: this rank's (experts / ep of the experts), unsharded; sharded, every expert's
    # over dp_shard x cp (FSDP2 shards this rank's experts over dp_shard x cp / ep: the same bytes)
    blk, blk_all = block_params(cfg, tp, layout.ep), block_params(cfg, tp)
    root = params - n * blk_all  # the embedding, final norm and head: the root FSDP2 module's own
    # FSDP2 (shards > 1): the root's parameters stay unsharded from its forward to the end of its backward
    # (the root does not reshard after forward), their unsharded gradients wait for the root's
    # reduce-scatter at the end of the backward; in a block's backward, that block and the prefetched
    # next one are unsharded, the block's unsharded gradients wait to be reduce-scattered, and the
    # previous block's reduce-scatter input is kept until this block's (``reduce_scatter_states``,
    # ``reduce_scatter_max_input_buffers=1`` in torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py)
    fsdp = shards > 1
    at_loss = c * root * fsdp  # the loss's backward: no block is unsharded (each reshards after forward)
    # (experts sharded over ep are FSDP2 units of their own, unsharded only through their own backward: the
    # next block is prefetched without its experts)
    experts = cfg.experts // layout.ep * 3 * cfg.d * cfg.expert_ffn if layout.ep > 1 else 0
    in_block = (c * root + c * (2 * blk - experts)) * fsdp
    g, g_block = -(-blk_all // shards) * P32, P32 * blk  # a block's gradients: sharded, and as its backward makes them
    g_root = P32 * root + wide if fsdp else grads - n * g  # the root's, until the end of the backward
    g_head = P32 * (cfg.vocab * cfg.d // tp + cfg.d) if last else 0
    if not fsdp:
        g_block = g
    sp = tokens * cfg.d // tp
    cap = capacity(cfg, tokens) if cfg.experts else 0
    # bf16 compute with no FSDP2 to gather bf16 copies: torch.autocast over the fp32 parameters (as
    # torchtitan runs a model FSDP2 does not wrap); its casts are saved per micro-batch (block_activations)
    autocast = c < P32 and not fsdp
    a = block_activations(cfg, tp, tokens, layout.checkpointing, c, kernels, autocast, layout.cp, seq)
    # one micro-batch of the stage (under interleaving, of each chunk): its blocks' activations and its
    # input (the embedding's output, or received)
    v = layout.virtual_stages
    blocks = n * a + P32 * sp
    head_acts = 0
    if last:  # the final norm's gathered output and rstd (on a CPU its normalised input); log-softmax's output
        head_acts = c * tokens * cfg.d + P32 * tokens // tp + (c * sp if kernels == "cpu" else 0) \
            + P32 * tokens * cfg.vocab // tp + 2 * P32 \
            + (c * cfg.vocab * cfg.d // tp if autocast else 0)  # (the loss before and after its 1 / m; the head's cast)
    acts = blocks + head_acts
    # the block being recomputed (checkpointing) holds its activations through its backward, but its output:
    # the recomputation stops once the last tensor backward needs is saved (checkpoint's early stop)
    recomputed = block_activations(cfg, tp, tokens, False, c, kernels, autocast, layout.cp, seq) - P32 * sp \
        if layout.checkpointing else 0
    # a block's backward beyond its activations and the gradients made before it (``first_back`` in a
    # chunk's first backward, ``later_back`` after it), and ``in_blk``, its gradients counted beside them
    a_ffn = ffn_activations(cfg, tp, tokens, c) + c * tokens * cfg.d  # the feed-forward's and its norm's
    sp_grad = c * tokens * cfg.d if tp > 1 else 0  # sequence parallel's gathered gradient
    if cfg.experts:  # a bound: every gradient of the block with its backward's largest transient; later,
        # a stacked expert weight's new gradient waits to be added beside one of the experts' SwiGLU gradients
        back = block_backward(cfg, tp, tokens, c, layout.cp) + recomputed
        new, one = P32 * cfg.experts // layout.ep * cfg.d * cfg.expert_ffn, c * cfg.experts * cap * cfg.expert_ffn
        adding = 2 * P32 * sp + one + (g if fsdp else new) + sp_grad + recomputed
        in_blk = max(g_block * ffn_params(cfg, tp, layout.ep) // blk, g_block - a_ffn)
        first_back, later_back, later_held = back, max(back, adding), g_block
    else:  # a dense block's peak: in w2's backward (its output's gradient -- autocast's cast, TP's gathered --
        # its input's and its weight's, in the compute dtype under autocast before the cast to fp32), or in
        # mul's, whose two factors' gradients are made while the product's is alive and w2's saved input
        # (under autocast, its cast weight too) is gone; or in the attention's, the feed-forward's
        # activations gone, its gradients and wo's made. The residual stream's gradient arrives first.
        w2, wo, t_ffn = P32 * cfg.d * cfg.ffn // tp, P32 * cfg.d * cfg.d // tp, c * tokens * cfg.ffn // tp
        cast_w2 = c * cfg.d * cfg.ffn // tp if autocast else 0
        mm = P32 * sp + (c * sp if autocast else 0) + sp_grad + t_ffn + (cast_w2 or w2)
        # (under autocast the feed-forward's casts go too: w3's of its input, the three weights')
        a_ffn += (c * tokens * cfg.d + 3 * cast_w2) if autocast else 0
        attention = attention_backward(cfg, tp, tokens, c, layout.cp) + 2 * P32 * sp + sp_grad + wo - a_ffn
        g_ffn = g_block * ffn_params(cfg, tp) // blk + P32 * cfg.d  # the feed-forward's and its norm's gradients
        # w2's new gradient stays (a chunk's first backward, FSDP2's unsharded), or is added to .grad at once
        first_back = max(mm, P32 * sp + w2 + 2 * t_ffn - cast_w2, g_ffn + attention) + recomputed
        later_back = max(mm, P32 * sp + max(w2, w2 * fsdp + 2 * t_ffn - cast_w2), g_ffn * fsdp + attention) \
            + recomputed
        in_blk, later_held = 0, 0
    # the embedding's backward: the gradient received, the embedding output's, and the stage's output,
    # which the schedule holds until the backward returns (TP: the output's gradient all-gathered)
    out_grad = 3 * P32 * sp + (c * tokens * cfg.d if tp > 1 else 0)
    emb_new = 0 if fsdp else P32 * cfg.vocab * cfg.d // tp + wide  # a later micro-batch's, to be added
    # the loss's backward: the log-softmax's gradient and its input's in fp32 (loss_parallel's composite
    # under TP keeps one more, and per-token target masks and indices: 33 B a token); then the head's
    # backward: the logits' gradient (in the log-softmax output's place), the head's new weight gradient
    # (and its input's)
    loss = 2 * P32 * tokens * cfg.vocab // tp if tp == 1 else 3 * P32 * tokens * cfg.vocab // tp + 9 * P32 * tokens
    head = max(loss, P32 * cfg.vocab * cfg.d // tp + c * tokens * cfg.d)
    prev = g_block * fsdp  # FSDP2: the previous block's gradients wait to be reduce-scattered past its backward
    prefetched = in_block - c * root * fsdp - c * blk * fsdp  # the next block's (without experts of their own)

    def first_backward(state, others, nb, chunk, head_grads, root_grads):
        """A chunk's first backward (``nb`` blocks) beside ``others``' activations: the gradients appear as
        its activations go, the head's first, then a block's at a time, the embedding's last. Its peak: at
        the last block (whose backward comes first), at the second (the later blocks' gradients made, the
        first block's activations and its prefetched parameters held too), at the first (nothing left to
        prefetch), or at the end (every gradient of the chunk). A block's output, the next one's input, goes
        with the next one's backward; the chunk's input and output stay until its backward returns."""
        out = [(state, in_block - prefetched * (nb == 1), others + chunk + head_grads + in_blk, first_back)]
        if nb > 2:
            out.append((state, in_block, others + head_grads + (nb - 2) * g + 2 * a + in_blk + prev, first_back))
        if nb > 1:
            out.append((state, in_block - prefetched, others + head_grads + (nb - 1) * g + a + in_blk + prev,
                        first_back))
        return out + [(state, c * root * fsdp, others + nb * g + root_grads, out_grad)]

    # the moments the step can peak at: (state, gathered, activations, transient)
    m, moments = layout.microbatches, []
    if v == 1:
        k = in_flight(layout, stage)
        # once the first micro-batch's backward is done every gradient exists, and the schedule holds k
        # micro-batches again (1F1B with more micro-batches than k), or k - 1 (GPipe, or no more than k).
        # A backward's gradient, sent, lives until the stage's next receive: GPipe's last stage has none
        # between its backwards (a middle stage's next backward receives the gradient its blocks start from)
        kl = k if m > k else k - 1
        later = kl * acts + P32 * sp * (last and stage > 0 and layout.schedule == "gpipe")
        if last:  # the first micro-batch's loss (no gradient yet), a later one's (every sharded gradient)
            moments.append((weights, at_loss, k * acts, head))
            if m > 1:
                moments.append((weights + grads, at_loss, later, head))
        if m > 1:  # a later block's backward (the micro-batch in it has let go of its head's activations);
            # on the first stage, the embedding's new gradient at the end of it
            moments.append((weights + grads, in_block + (g_head + later_held) * fsdp,
                            later - head_acts, later_back))
            if stage == 0:
                moments.append((weights + grads, (c * root + g_root) * fsdp, later - acts, emb_new + out_grad))
        moments += first_backward(weights, (k - 1) * acts, n, blocks, g_head, g_root)
    else:  # interleaved: the rank's order op by op (``parallel.schedule_order``), chunk j being global
        # stage j pp + stage; sends are waited at the step's end (``parallel._P2P``), so each backward done
        # keeps its chunk's output and the gradient it sent. The last rank runs its last chunk's backward
        # right after its forward: one micro-batch holds the head's activations.
        sizes, top = stage_layers(cfg.layers, layout.pp * v), layout.pp * v - 1
        chunks = [j * layout.pp + stage for j in range(v)]
        ends = [cfg.vocab * cfg.d // tp * ((s == 0) + (s == top)) + cfg.d * (s == top) for s in chunks]
        chunk_acts = [sizes[s] * a + P32 * sp for s in chunks]
        chunk_grads = [P32 * -(-(sizes[s] * blk_all + e) // shards) + -(-wide // shards) * (s == 0)
                       for s, e in zip(chunks, ends)]
        held, done, sent = [0] * v, [False] * v, 0
        for kind, j, _ in schedule_order("interleaved", m, layout.pp, stage, v):
            s = chunks[j]
            if kind == "F":
                held[j] += 1
                continue
            state = weights + sum(gr for gr, d in zip(chunk_grads, done) if d)
            others = sum(h * x for h, x in zip(held, chunk_acts)) - chunk_acts[j] + P32 * sp * sent
            if s == top:
                moments.append((state, at_loss, others + chunk_acts[j] + head_acts, head))
            if not done[j]:
                root_grads = P32 * ends[j] + wide * (s == 0) if fsdp else chunk_grads[j] - sizes[s] * g
                moments += first_backward(state, others, sizes[s], chunk_acts[j], g_head * (s == top), root_grads)
            else:
                moments.append((state, in_block + (g_head * (s == top) + later_held) * fsdp, others + chunk_acts[j],
                                later_back))
                if s == 0:
                    moments.append((state, (c * root + g_root) * fsdp, others, emb_new + out_grad))
            held[j], done[j], sent = held[j] - 1, True, sent + (s != top) + (s > 0)
    # Adam's step (foreach): every gradient, and exp_avg_sq's square root, one fp32 tensor per parameter
    moments.append((weights + grads, 0, 0, P32 * local))
    state, gathered, activations, transient = max(moments, key=sum)
    return RankPlan(stage, state, gathered, activations, transient)


def comm_bytes(cfg: LlamaConfig, layout: Layout, stage: int, micro: int, seq: int) -> int:
    """Bytes this rank sends per step (ring collectives; module docs)."""
    tokens = micro * seq // layout.cp
    m, n = layout.microbatches, stage_layers(cfg.layers, layout.pp)[stage]
    ring = lambda k: (k - 1) / k  # noqa: E731
    total = 0.0
    if layout.tp > 1:
        per_pass = 4 * ring(layout.tp) * BF16 * tokens * cfg.d  # 2 all-gathers + 2 reduce-scatters per block
        passes = 3 if layout.checkpointing else 2
        total += m * n * passes * per_pass
    params = stage_params(cfg, layout, stage)
    shards = layout.dp_shard * layout.cp
    if shards > 1:  # each rank's experts (experts / ep of them) over dp_shard x cp / ep ranks, the rest over all
        experts = n * cfg.experts * 3 * cfg.d * cfg.expert_ffn
        total += (ring(shards) * (params - experts) + ring(shards // layout.ep) * experts / layout.ep) \
            * (2 * BF16 + P32)
    if layout.dp_replicate > 1:
        total += 2 * ring(layout.dp_replicate) * P32 * params / shards
    passes = 3 if layout.checkpointing else 2  # forward, backward, and the recomputed forward
    if layout.cp > 1:  # K and V all-gathered per block forward, dK and dV reduce-scattered in backward
        kv = BF16 * tokens * 2 * cfg.kv_heads * (cfg.d // cfg.heads) // layout.tp
        total += m * n * (layout.cp - 1) * kv * passes
    if layout.ep > 1:  # MoE: the experts' slots out and back by all_to_all per block, forward and backward
        total += m * n * 2 * passes * ring(layout.ep) * BF16 * cfg.experts * capacity(cfg, tokens) * cfg.d
    if layout.pp > 1:
        hops = (stage < layout.pp - 1) + (stage > 0) if layout.virtual_stages == 1 else 2 * layout.virtual_stages
        total += m * BF16 * tokens * cfg.d / layout.tp * hops  # interleaved: every chunk sends and receives
    return int(total)


def plan_ranks(cfg: LlamaConfig, layout: Layout, global_batch: int, seq: int, c: int = BF16,
               kernels: str = "cuda") -> list[RankPlan]:
    """One :class:`RankPlan` per pipeline stage (TP, CP and data-parallel ranks of a stage are alike);
    ``c``: bytes per element of the compute (bf16: 2); ``kernels``: "cuda", or "cpu" with ``c=4`` to
    compare with a plan traced on the CPU in fp32."""
    micro = check_layout(cfg, layout, global_batch, seq)
    if kernels == "cuda" and c == P32 and cfg.kv_heads != cfg.heads:
        # memory-efficient and cuDNN attention refuse fp32 with grouped heads: math runs, saving each
        # block's [b, heads, T, T] fp32 probabilities (H100, torch 2.11: +34% over this arithmetic)
        raise ValueError(f"c=4 on a GPU with grouped heads ({cfg.heads} query, {cfg.kv_heads} key/value) runs "
                         "SDPA's math kernel, which this arithmetic does not plan: plan bf16 compute (c=2)")
    return [rank_plan(cfg, layout, s, micro, seq, c, kernels) for s in range(layout.pp)]


def layouts(cfg: LlamaConfig, *, gpus, tp=(1,), pp=(1,), cp=(1,), ep=(1,), dp_replicate=(1,), schedules=("1f1b",),
            microbatches=None, checkpointing=(False, True), global_batch=(1,), seq=2048):
    """Every valid layout of the grid: (layout, global batch); dp_shard fills the GPUs left (ep borrows its
    ranks and cp's: it adds none)."""
    for n, t, p, c, e, r, sch, ac, gb in itertools.product(gpus, tp, pp, cp, ep, dp_replicate, schedules,
                                                           checkpointing, global_batch):
        if n % (t * p * c * r):
            continue
        shard = n // (t * p * c * r)
        # default micro-batches: pp, 2pp, 4pp (pp = 1: none) and one sample each (gradient accumulation)
        ms = microbatches or sorted(({1} if p == 1 else {p, 2 * p, 4 * p}) | {max(1, gb // (shard * r))})
        for m in ms:
            for sched in ([sch] if p > 1 else ["1f1b"]):
                L = Layout(tp=t, pp=p, cp=c, ep=e, dp_replicate=r, dp_shard=shard, schedule=sched, microbatches=m,
                           checkpointing=ac, virtual_stages=2 if sched == "interleaved" else 1)
                try:
                    check_layout(cfg, L, gb, seq)
                except ValueError:
                    continue
                yield L, gb


def on_gpu(gpu: str | None = None, allocator: str = "default"):
    """``search``'s ``device_total`` as ``mgpu-plan`` counts it: a rank's tensors plus ``planner.budget``'s lines
    for this GPU (the allocator's reserve, cuBLAS's workspaces, the CUDA context, NCCL's buffers)."""
    return lambda peak, gpus: budget(peak, world_size=gpus, allocator=allocator, gpu=gpu).total


def search(cfg: LlamaConfig, *, capacity: int, seq: int, device_total=None, **grid) -> list[dict]:
    """Rows for every layout of the grid, sorted: fewest GPUs, then most tokens per step, then least traffic.
    A layout fits when ``device_total(worst rank's tensor peak, GPUs)`` (default :func:`on_gpu`: what the device
    holds, not the tensors alone) is at most ``capacity``."""
    device_total = device_total or on_gpu()
    rows = []
    seen = set()
    for L, gb in layouts(cfg, seq=seq, **grid):
        if (L, gb) in seen:
            continue
        seen.add((L, gb))
        ranks = plan_ranks(cfg, L, gb, seq)
        worst = max(ranks, key=lambda r: r.peak)
        micro = gb // (L.dp * L.microbatches)
        comm = max(comm_bytes(cfg, L, s, micro, seq) for s in range(L.pp))
        per_stage = L.world // L.pp  # the mesh is (pp, dp_replicate, dp_shard, cp, tp): a stage's ranks are contiguous
        device = device_total(worst.peak, L.world)
        rows.append(dict(layout=L.describe(), gpus=L.world, dp_shard=L.dp_shard, device=device,
                         worst_ranks=(worst.stage * per_stage, (worst.stage + 1) * per_stage - 1), tokens=gb * seq, peak=worst.peak,
                         worst_stage=worst.stage, stage_peaks=[r.peak for r in ranks], microbatches=L.microbatches,
                         comm=comm, fits=device <= capacity, parts=worst))
    rows.sort(key=lambda r: (r["gpus"], -r["tokens"], not r["fits"], r["comm"], r["peak"]))
    return rows


def check_grid(cfg: LlamaConfig, *, gpus, tp, pp, cp, seq, ep=(1,), dp_replicate=(1,), **_):
    """Every value asked must be possible for this model: one clear line otherwise."""
    for t in tp:
        if cfg.heads % t or cfg.kv_heads % t:
            raise ValueError(f"--tp {t}: must divide the attention heads ({cfg.heads}) and key/value heads "
                             f"({cfg.kv_heads})")
        if seq % t:
            raise ValueError(f"--tp {t}: must divide --seq {seq} (sequence parallel shards the sequence)")
        if t > 1 and cfg.experts:
            raise ValueError(f"--tp {t}: the routed experts are not tensor-parallel here: use --ep")
    for p in pp:
        if p > cfg.layers:
            raise ValueError(f"--pp {p}: more stages than the model's {cfg.layers} layers")
    for c in cp:
        if seq % (2 * c * max(tp)) and c > 1:
            raise ValueError(f"--cp {c}: --seq {seq} must be divisible by 2 x cp x tp = {2 * c * max(tp)} "
                             "(context parallel's load-balanced chunks, sequence parallel's shards)")
    for e in ep:
        if e > 1 and not cfg.experts:
            raise ValueError(f"--ep {e}: the model has no routed experts (expert parallel shards a MoE's experts)")
        if cfg.experts % e:
            raise ValueError(f"--ep {e}: must divide the model's {cfg.experts} experts")
        ranks = {n // (t * p * r) for n, t, p, r in itertools.product(gpus, tp, pp, dp_replicate)
                 if n % (t * p * r) == 0}
        if e > 1 and not any(k % e == 0 and k % c == 0 and e % c == 0 for k in ranks for c in cp):
            raise ValueError(f"--ep {e}: must divide the data-parallel ranks x cp (dp_shard x cp: "
                             f"{', '.join(map(str, sorted(ranks)))} with these --gpus/--tp/--pp/--dp-replicate) "
                             "and be a multiple of --cp: ep borrows those ranks")
