"""plan() against real steps on gloo ranks: every rank's measured peak beside the planned one.

    PYTHONPATH=. python bench/planner_ranks.py                 # the full table (~15 min on 2 cores)
    PYTHONPATH=. python bench/planner_ranks.py --quick         # fp32 only, world 2
    PYTHONPATH=. python bench/planner_ranks.py --model conv --world 4

Models: a Llama-shaped decoder (``planner.models.decoder``), a conv net with BatchNorm, a decoder with a
tied head and a frozen block. Methods: DDP, ZeroRedundancyOptimizer + DDP, FSDP2 per block + root and
root only; layouts fp32, bf16 autocast, and FSDP2's MixedPrecisionPolicy (bf16 params, fp32 reduce);
then torch's non-default options (gradient_as_bucket_view=True, reshard_after_forward=False, prefetch=2,
CPUOffloadPolicy).
The measurement: the course's ``MemoryTracker`` on each rank (``mgpu_helpers.planner.validation``), the third
step's peak; beside it what the CPU allocator saw (the profiler's events). Bar: the plan equals the tracker to
the byte on every rank. Runs on the CPU (gloo): no GPU needed or used.
"""
import argparse
import time

import torch.nn.functional as F

from mgpu_helpers.planner.models import convnet, decoder, image_batch, lm_loss, tied_frozen, token_batch
from mgpu_helpers.planner.validation import table, validate

MODELS = {
    "decoder": (decoder("tiny"), token_batch(4, 32, 512), lm_loss),
    "conv": (convnet(), image_batch(8), F.cross_entropy),
    "tied+frozen": (tied_frozen("tiny"), token_batch(4, 32, 512), lm_loss),
    "decoder-small": (decoder("small"), token_batch(4, 128, 4096), lm_loss),
}
LAYOUTS = {"fp32": ("ddp", "zero1", "fsdp2", "fsdp2-root"),
           "bf16-autocast": ("ddp", "zero1", "fsdp2", "fsdp2-root"),
           "fsdp-mixed": ("fsdp2", "fsdp2-root")}
SKIPPED = ("conv x fsdp-mixed: FSDP2's MixedPrecisionPolicy leaves BatchNorm's running stats fp32 while its "
           "weight becomes bf16, and CPU batch_norm refuses the mix (expected scalar type BFloat16 but found Float); "
           "the usual fix wraps BatchNorm in its own fully_shard with an fp32 policy")
EXTRAS = [("ddp", "ddp+view", dict(gradient_as_bucket_view=True)),
          ("fsdp2", "fsdp2+keep", dict(reshard_after_forward=False)),
          ("fsdp2", "fsdp2+pf2", dict(prefetch=2)),
          ("fsdp2", "fsdp2+offl", dict(offload=True))]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=list(MODELS), action="append")
    ap.add_argument("--world", type=int, action="append")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    models = args.model or ["decoder", "conv", "tied+frozen"]
    worlds = tuple(args.world or ((2,) if args.quick else (2, 4)))
    layouts = {"fp32": LAYOUTS["fp32"]} if args.quick else LAYOUTS
    t0, rows = time.perf_counter(), []
    for name in models:
        model_fn, batch, loss_fn = MODELS[name]
        for layout, methods in layouts.items():
            if layout == "fsdp-mixed" and name == "conv":  # see SKIPPED
                continue
            rows += validate(model_fn, batch, loss_fn=loss_fn, model=name, methods=methods, world_sizes=worlds,
                             precisions=(layout,))
        for method, tag, opts in [] if args.quick else EXTRAS:
            for r in validate(model_fn, batch, loss_fn=loss_fn, model=name, methods=(method,), world_sizes=worlds,
                              **opts):
                r["method"] = tag  # a non-default option (listed below)
                rows.append(r)
        print(table([r for r in rows if r["model"] == name]), flush=True)
        print()
    print(table(rows))
    worst = min(rows, key=lambda r: r["error"])
    print(f"\n{len(rows)} rank rows; error range {100 * min(r['error'] for r in rows):+.3f}% .. "
          f"{100 * max(r['error'] for r in rows):+.3f}%; worst under-estimate: {worst['model']} {worst['method']} "
          f"N={worst['world']} rank {worst['rank']}; equal: {all(r['held'] for r in rows)}; "
          f"steady: {all(r['steady'] for r in rows)}")
    print("options: " + "; ".join(f"{tag} = {method} with {o}" for method, tag, o in EXTRAS))
    print("not run: " + SKIPPED)
    print(f"wall {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
