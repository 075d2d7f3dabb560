"""Check 7.1 passes the solution, fails the stub, and names planted mistakes (EVERY_SEED under every seed of
``sweep_seeds()``: they must not depend on the draw)."""
from pathlib import Path

import pytest

from mgpu_helpers.tools.authoring import mutant_fails_every_seed, mutant_verdict, sweep_seeds
import mgpu_helpers.checks.checkpointing  # noqa: F401  (registers 7.1)
from testkit import solution_passes_stub_fails

NB = Path(__file__).resolve().parent.parent / "solutions" / "07_activation_checkpointing.ipynb"
FN = "checkpoint_segments"
LOOP = "    for start in range(0, len(blocks), k):\n"
CALL = "x = checkpoint(run_segment, blocks[start:start + k], x, use_reentrant=False)"
CHECK = "    if not 1 <= k <= len(blocks):\n"

EVERY_SEED = [
    ([(LOOP, "    for start in range(len(blocks)):\n"), ("blocks[start:start + k]", "blocks[start:start + 1]")],
     "checkpointed every block on its own, whatever k"),
    ([("use_reentrant=False", "use_reentrant=True")], "use_reentrant=True with an input that does not require grad"),
    ([(CALL, "x = checkpoint(lambda seg=blocks[start:start + k]: run_segment(seg, x), use_reentrant=False)")],
     "the segment's input was not passed to checkpoint"),
    # the block range read from the loop's variables: at backward time it is the last segment's (with k = 1
    # there is no CheckpointError, only wrong gradients; either way the recomputed blocks name it)
    ([(CALL, "x = checkpoint(lambda h: run_segment(blocks[start:start + k], h), x, use_reentrant=False)")],
     "the recomputation ran the wrong blocks"),
    ([("use_reentrant=False)", "use_reentrant=False, preserve_rng_state=False)")],
     "preserve_rng_state=False"),
    ([(LOOP, "    blocks.eval()\n" + LOOP)], "dropout switched off (the blocks put in eval mode)"),
    ([(CALL, CALL.replace("use_reentrant=False)", "use_reentrant=False).detach().requires_grad_()"))],
     "a detach() of the segments' outputs"),
]
ONE_SEED = [
    ([(LOOP, "    for start in range(0, len(blocks), k + 1):\n"), ("start + k]", "start + k + 1]")],
     "segments of k + 1 blocks (off by one)"),
    ([(LOOP, "    x = blocks[0](x)\n    for start in range(1, len(blocks), k):\n")],
     "block 0 left out (segments started at block 1)"),
    ([(LOOP, "    for start in range(len(blocks)):\n"),
      (CALL, "x = checkpoint(blocks[start], x, use_reentrant=False) if start % k == 0 else blocks[start](x)")],
     "checkpointed only the blocks i with i % k == 0"),
    ([(LOOP, "    for start in range(0, len(blocks), k):\n        break\n"), ("    return x", "    return run_segment(blocks, x)")],
     "no checkpointing at all"),
    ([(LOOP, "    for start in range(0, len(blocks) - len(blocks) % k, k):\n")],
     "the last, shorter segment was never run"),
    ([(CHECK, "    if False:\n")], "must raise ValueError"),
]


@pytest.mark.ex_7_1
def test_solution_passes_and_stub_fails():
    solution_passes_stub_fails(NB, "7.1", FN)


@pytest.mark.ex_7_1
@pytest.mark.parametrize("edits,named", EVERY_SEED, ids=[n[:30] for _, n in EVERY_SEED])
def test_mistake_fails_under_every_seed(edits, named):
    mutant_fails_every_seed(NB, "7.1", FN, edits, named)


@pytest.mark.ex_7_1
@pytest.mark.parametrize("edits,named", ONE_SEED, ids=[n[:30] for _, n in ONE_SEED])
def test_planted_mistake_is_named(edits, named):
    for seed in (7, 8):
        ok, msg = mutant_verdict(NB, "7.1", FN, edits, seed=seed)
        assert not ok, f"mutant {edits!r} passed the check with seed {seed}"
        assert named in msg, msg


@pytest.mark.ex_7_1
def test_both_loop_variables_read_is_named_as_what_went_wrong():
    """A closure over start and x: with several segments the wrong blocks re-run; with k = L (one segment)
    only x is wrong. Under every seed the message names one of the two, never something else."""
    edits = [(CALL, "x = checkpoint(lambda: run_segment(blocks[start:start + k], x), use_reentrant=False)")]
    for seed in sweep_seeds():
        ok, msg = mutant_verdict(NB, "7.1", FN, edits, seed=seed)
        assert not ok and ("the recomputation ran the wrong blocks" in msg
                           or "the segment's input was not passed to checkpoint" in msg), msg
