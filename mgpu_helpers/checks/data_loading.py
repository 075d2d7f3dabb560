"""Check of notebook 10: 10.1 the indices of each rank, against torch's DistributedSampler itself."""

from .base import Check, expect_equal, expect_type


class ShardIndices(Check):
    id, function = "10.1", "shard_indices"

    def cases(self, rng):
        fixed = [(10, 4, True, False), (10, 4, True, True), (7, 1, True, False), (3, 5, False, False),
                 (2, 5, True, False), (12, 3, False, True), (9, 2, False, False)]
        rnd = [(rng.randint(5, 40), rng.randint(2, 6), rng.random() < 0.8, rng.random() < 0.5) for _ in range(2)]
        cases = [{"n": n, "world_size": w, "shuffle": sh, "drop_last": dl, "seed": rng.randrange(1000),
                  "epoch": rng.randint(1, 5)} for n, w, sh, dl in fixed + rnd]
        rng.shuffle(cases)
        return cases

    def describe(self, case):
        return ", ".join(f"{k}={case[k]}" for k in ("n", "world_size", "shuffle", "drop_last", "seed", "epoch"))

    def run(self, fn, case):
        args = (case["n"], case["world_size"])
        return [fn(*args, r, shuffle=case["shuffle"], seed=case["seed"], epoch=case["epoch"],
                   drop_last=case["drop_last"]) for r in range(case["world_size"])]

    def judge(self, case, result):
        c = case
        got = [[int(i) for i in r] if isinstance(r, (list, tuple)) else r for r in result]
        for r in got:
            expect_type(r, list, self.function, "a list of ints (the indices of one rank)")
        from .references import sampler_variant, sampler_shard
        args = (c["n"], c["world_size"], c["shuffle"], c["seed"], c["epoch"])
        want = [sampler_shard(*args[:2], r, *args[2:], c["drop_last"]) for r in range(c["world_size"])]
        v = lambda drop_last=c["drop_last"], **kw: sampler_variant(*args, drop_last, **kw)  # noqa: E731
        mistakes = {"contiguous blocks per rank: DistributedSampler deals indices out round-robin "
                    "(rank, rank + world_size, ...)": v(strided=False)}
        if not c["drop_last"]:
            mistakes["no padding: ranks get different numbers of samples, so they run different numbers of "
                     "steps and the last collective hangs"] = v(pad=False)
            mistakes["padding that repeats the index list only once (fails when n < world_size / 2)"] = v(pad="once")
        if c["shuffle"]:
            mistakes["shuffled with the seed alone: set_epoch forgotten, the same order every epoch"] = v(use_epoch=False)
        if c["drop_last"] and c["n"] % c["world_size"]:
            mistakes["drop_last ignored: padded instead of dropping the tail"] = v(False)
            # neither padded nor dropped (order[rank::world_size]): named here too, so that the diagnosis
            # does not depend on whether a drop_last case happens to be the first one that fails
            mistakes["no padding (and no dropping): ranks get different numbers of samples, so they run "
                     "different numbers of steps and the last collective hangs; with drop_last=True drop the "
                     "tail instead"] = v(False, pad=False)
        expect_equal(got, want, "the indices of every rank (rank 0 first)",
                     mistakes={k: m for k, m in mistakes.items() if m != want},
                     hint="Hint: order (shuffled with seed + epoch), then pad or drop to a multiple of world_size, "
                          "then rank r takes every world_size-th index from r.")
