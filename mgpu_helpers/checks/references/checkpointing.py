"""What tests and benches run as 7.1's answer, and a plan runner (never for a notebook)."""
from __future__ import annotations

from torch.utils.checkpoint import checkpoint

from ...checkpointing import no_checkpointing, segments


def checkpoint_every(blocks, x, k: int, context_fn=None):
    """Each segment of k blocks under non-reentrant checkpointing.
    ``context_fn``: e.g. :func:`selective_context` for selective checkpointing."""
    for start, stop in segments(len(blocks), k):
        extra = {} if context_fn is None else {"context_fn": context_fn}
        # The segment's input is passed as an argument: it is what checkpoint keeps and recomputes from.
        x = checkpoint(no_checkpointing, blocks[start:stop], x, use_reentrant=False, **extra)
    return x


def run_plan(blocks, x, plan):
    """Run a plan of :func:`plan_for`'s form: [(blocks in the segment, checkpointed?), ...]."""
    start = 0
    for n, ck in plan:
        seg = blocks[start:start + n]
        x = checkpoint(no_checkpointing, seg, x, use_reentrant=False) if ck else no_checkpointing(seg, x)
        start += n
    return x
