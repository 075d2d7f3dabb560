"""Check 7.1 passes the solution, fails the stub, and names planted mistakes (the first three under every
one of 20 seeds: they must not depend on the draw)."""
from pathlib import Path

import pytest

from mgpu_helpers.tools.authoring import mutant_fails_every_seed, mutant_verdict
import mgpu_helpers.checkpointing  # noqa: F401  (registers 7.1)
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
    ([(CALL, "x = checkpoint(lambda: run_segment(blocks[start:start + k], x), use_reentrant=False)")],
     "the segment's input was not passed to checkpoint"),
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
