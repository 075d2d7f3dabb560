"""The planner at 7B scale on a laptop: Llama-2-7B shapes, ZeRO 0-3 x world 1-64, bf16 autocast.

    PYTHONPATH=. python3 bench/planner.py            # goal: <= 20 s + ~25 s per FSDP2 world, <= 2 GiB RSS
    PYTHONPATH=. python3 bench/planner.py --checkpointing

One fake-tensor trace of the unsharded step (32 blocks, d=4096, 32 heads, SwiGLU 11008, vocab 32000;
batch 1 x 4096 tokens; Adam foreach), planned as for a GPU (512-byte blocks), then the sharded plans
derived from it (stages 0-2 by rule; stage 3 runs FSDP2 on the fake model, one trace per world size in
--fsdp-worlds). Prints each plan's per-rank peak and the planner's model state beside notebook 08's
closed forms (``model_state_bytes``: "fp32" is what autocast keeps -- fp32 weights, gradients and Adam
moments; the ZeRO paper's "mixed" has the same 16 bytes/param split 2 + 2 + 12).
"""
import argparse
import resource
import time

T0 = time.perf_counter()
import torch  # noqa: E402

from mgpu_helpers.planner import decoder, lm_loss, plan_from_trace, trace_step  # noqa: E402
from mgpu_helpers.sharding import model_state_bytes  # noqa: E402

GB = 1e9


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpointing", action="store_true")
    ap.add_argument("--size", default="7B")
    ap.add_argument("--fsdp-worlds", type=int, nargs="*", default=[8],
                    help="world sizes at which stage 3 runs FSDP2 on the fake model (~25 s each for 7B here)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    t_import = time.perf_counter() - T0
    batch = (torch.zeros(1, 4096, dtype=torch.long), torch.zeros(1, 4096, dtype=torch.long))
    t = time.perf_counter()
    trace = trace_step(decoder(args.size), batch, loss_fn=lm_loss, precision="bf16-autocast",
                       checkpointing=args.checkpointing, device="cpu", round_to=512)
    t_trace = time.perf_counter() - t
    n = trace.n_params
    print(f"{args.size}: {n:,} parameters; bf16 autocast, checkpointing {args.checkpointing}, batch 1x4096, "
          f"Adam foreach; traced in {t_trace:.1f} s ({len(trace.phases)} timeline samples)")
    t = time.perf_counter()
    print(f"\n{'stage':>5} {'world':>5} | {'peak/rank GB':>12} {'peak in':>10} | {'params':>7} {'grads':>7} "
          f"{'optim':>7} {'state GB':>8} | {'closed fp32':>11} {'closed mixed':>12} {'diff':>8}")
    for stage in range(4):
        for world in (1, 2, 4, 8, 16, 32, 64):
            if stage == 3 and world not in args.fsdp_worlds:
                continue  # stage 3 is FSDP2 run on fake tensors: one trace per world size (planner.fsdp)
            p = plan_from_trace(trace, stage, world)
            ms = p.model_state
            cf = model_state_bytes(n, zero_stage=stage, world_size=world, precision="fp32")
            cm = model_state_bytes(n, zero_stage=stage, world_size=world, precision="mixed")
            print(f"{stage:>5} {world:>5} | {p.peak_bytes / GB:>12.2f} {p.peak_phase:>10} | "
                  f"{ms['parameters'] / GB:>7.2f} {ms['gradients'] / GB:>7.2f} {ms['optimizer'] / GB:>7.2f} "
                  f"{ms['total'] / GB:>8.3f} | {cf['total'] / GB:>11.3f} {cm['total'] / GB:>12.3f} "
                  f"{100 * (ms['total'] - cf['total']) / cf['total']:>+7.3f}%")
    t_shard = time.perf_counter() - t
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"\nimport {t_import:.1f} s, trace {t_trace:.1f} s, {21 + len(args.fsdp_worlds)} sharded plans {t_shard:.2f} s; "
          f"wall {time.perf_counter() - T0:.1f} s in all; peak RSS {rss:.2f} GiB; "
          f"CPU {sum(resource.getrusage(resource.RUSAGE_SELF)[:2]):.1f} s")
    print("diff: planner's model state vs the fp32 closed form (the planner counts each tensor in "
          "512-byte blocks, sharded tensor by tensor)")


if __name__ == "__main__":
    main()
