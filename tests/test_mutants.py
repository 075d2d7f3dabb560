"""Every exercise's check against its solution, its released stub and each mistake planted in tests/mutants.py;
and every check's draw against the edge cases that tell its known mistakes from the right answer.

A mistake is tried on every seed of ``sweep_seeds()``: 2 in the fast tier (``make test-fast``), 20 in the full
one. Two suffice in the edit loop because ``test_draw_holds_its_edge_cases`` shows, on 50 draws and without
running any learner's code, that every draw holds the cases that tell each known mistake from the right answer;
the full tier's 20 seeds stay the end-to-end proof. ``-m ex_5_1`` or ``-k 5.1`` runs one exercise's tests."""
import functools
import warnings
from pathlib import Path

import nbformat
import pytest
import torch

from mgpu_helpers.checks import REGISTRY, load_checks
from mgpu_helpers.tools.authoring import (exec_cell, mgpu, exercise_source, mutant_fails_every_seed, mutant_verdict, mutate,
                                          stub_verdict, sweep_seeds)
from mutants import EXERCISES
from testkit import marked

ROOT = Path(__file__).resolve().parent.parent
ORDER = sorted(EXERCISES, key=lambda ex: tuple(map(int, ex.split("."))))


@functools.cache
def _load(notebook: Path) -> None:
    """Register the checks of one notebook only when its tests run: all of them take seconds to import, a
    lesson's edit loop (``-m ex_5_1``) needs one."""
    load_checks("mgpu_helpers." + nbformat.read(notebook, as_version=4).metadata["mgpu"]["module"])


def _nb(ex: str) -> Path:
    path = ROOT / "solutions" / f"{EXERCISES[ex].notebook}.ipynb"
    _load(path)
    return path


def _mistake(ex: str, named: str):
    return next(m for m in EXERCISES[ex].mistakes if m.named == named)


def test_every_check_has_its_mistakes_and_its_edge_cases():
    course = set()  # every exercise of the solution notebooks (other test files register made-up checks too)
    for notebook in (ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"):
        _load(notebook)
        course |= {mgpu(c).get("exercise") for c in nbformat.read(notebook, as_version=4).cells} - {None}
    assert sorted(course) == sorted(EXERCISES) == sorted(EDGES)
    assert all(ex in REGISTRY for ex in course), sorted(course - set(REGISTRY))


@pytest.mark.parametrize("ex", [marked(ex, id=ex) for ex in ORDER])
def test_solution_passes_and_stub_fails(ex):
    """Under the fast tier's two seeds and an unseeded draw; the stub says it is not done."""
    function = EXERCISES[ex].function
    for seed in (None, 0, 1):
        ok, msg = mutant_verdict(_nb(ex), ex, function, [], seed=seed)  # the solution, as written
        assert ok and msg.startswith(f"Exercise {ex} ✓ {function}: "), f"seed {seed}: {msg}"
    ok, msg = stub_verdict(_nb(ex), ex, function)
    assert not ok and "not implemented yet" in msg and f"Exercise {ex}" in msg, msg


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("ex,mistake", [marked(ex, m, id=f"{ex}-{m.named}") for ex in ORDER
                                        for m in EXERCISES[ex].mistakes])
def test_mistake_is_named(ex, mistake, monkeypatch):
    if ex == "9.1":  # a pipeline deadlock costs the recorder's timeout per seed: 0.5 s (forked ranks inherit it)
        monkeypatch.setattr("mgpu_helpers.model_sharding.P2P_TIMEOUT", 0.5)
    mutant_fails_every_seed(_nb(ex), ex, EXERCISES[ex].function, mistake.edits, mistake.named, seeds=mistake.seeds)


# --- mistakes whose verdict says more than "names these words" --------------------------------------------

@pytest.mark.ex_1_1
def test_master_copy_forgotten_is_told_apart_from_one_adam_state():
    # the two mistakes give the same bytes for Adam + mixed; an earlier case (momentum + mixed) separates them
    edits = _mistake("1.1", "forgot the fp32 master copy").edits
    for seed in range(5):
        ok, msg = mutant_verdict(_nb("1.1"), "1.1", "training_state_bytes", edits, seed=seed)
        assert not ok and "Adam keeps TWO states" not in msg, msg


@pytest.mark.ex_3_1
def test_no_warning_for_a_loss_that_requires_grad():
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # check_3_1 once printed a UserWarning from its own float(loss)
        ok, msg = mutant_verdict(_nb("3.1"), "3.1", "data_parallel_step", [("return loss.detach()", "return loss")],
                                 seed=0)
    assert ok, msg


@pytest.mark.ex_7_1
def test_both_loop_variables_read_is_named_as_what_went_wrong():
    """A closure over start and x: with several segments the wrong blocks re-run; with k = L (one segment)
    only x is wrong. Under every seed the message names one of the two, never something else."""
    call = "x = checkpoint(run_segment, blocks[start:start + k], x, use_reentrant=False)"
    edits = [(call, "x = checkpoint(lambda: run_segment(blocks[start:start + k], x), use_reentrant=False)")]
    for seed in sweep_seeds():
        ok, msg = mutant_verdict(_nb("7.1"), "7.1", "checkpoint_segments", edits, seed=seed)
        assert not ok and ("the recomputation ran the wrong blocks" in msg
                           or "the segment's input was not passed to checkpoint" in msg), msg


FITS = EXERCISES["11.1"].mistakes[:3]  # <, x world size, the allocated peak: three wrong ideas of "fits"


@pytest.mark.ex_11_1
@pytest.mark.parametrize("mistake", FITS, ids=["lt-alone", "times-world-alone", "peak-alone"])
def test_each_wrong_fit_is_named_alone(mistake):
    """`<`, "x world size" and "the allocated peak" give the same wrong answer on many capacities (the message
    then lists several); the check's first cases separate them, so each is named alone under every seed."""
    others = [m.named for m in FITS if m != mistake]
    for seed in sweep_seeds():
        ok, msg = mutant_verdict(_nb("11.1"), "11.1", "choose_plan", mistake.edits, seed=seed)
        assert not ok and mistake.named in msg and not any(o in msg for o in others), f"seed {seed}: {msg}"


@pytest.mark.ex_12_1
def test_12_1_reads_nothing_the_draw_changes():
    """What 12.1's judge reads of each rank -- peak and all-gathered bytes, the forward's issue order, which
    modules are units -- is the same under two draws, for the solution and for a policy that misses a
    budget: so a mistake named under two seeds is named under every one."""
    src = exercise_source(_nb("12.1"), "12.1")
    chk = REGISTRY["12.1"]
    for source in (src, mutate(src, "reshard_after_forward=2)", "reshard_after_forward=True)")):
        fn = exec_cell(source)["shard_for_budget"]
        (a,), (b,) = chk.make_cases(1), chk.make_cases(2)
        assert a["seed"] != b["seed"] and {**a, "seed": 0} == {**b, "seed": 0}  # only the draw differs
        ra, rb = chk.run_all(fn, 1), chk.run_all(fn, 2)  # as the check runs it (one thread)
        assert all(r["ok"] for r in ra + rb) and ra == rb, (ra, rb)


# --- every draw holds its edge cases ---------------------------------------------------------------------
# For each check: (the case that separates a known mistake from the right answer, whether a draw holds it),
# read from the draw's plain data (and, where the separation is a number, the judge's own reference for it).

def _chunks(batch, n):
    return len(torch.arange(batch).chunk(n))


def _grad_bytes(case):
    from mgpu_helpers.checks.ddp import _grad_bytes
    return _grad_bytes(case)


def _buckets(case, **kw):
    from mgpu_helpers.checks.ddp import _expected_buckets
    return _expected_buckets(_grad_bytes(case), case["cap"], **kw)


def _step_bytes_bound(case):
    """All that 2.1's step can allocate, in fp64 bytes, three times over: its widths' activations and weights."""
    w, b = case["widths"], case["batch"]
    return 8 * (3 * b * sum(w) + 3 * sum(i * o + o for i, o in zip(w, w[1:])))


def _first_bad(case):
    """(step, event) of a scaler script's first inf or nan."""
    return next(((t, e) for t, e in enumerate(case["script"]) if e != "ok"), (None, None))


def _one_owner_unbalanced(case):
    """Whether one rank owning every parameter breaks 8.1's balance bound on this case (the judge's
    ``_judge_balance``: at most total / world + the largest + the frozen bytes)."""
    from mgpu_helpers.checks.sharding import mlp, unique
    if case["kind"] != "train" or case["world_size"] == 1:
        return False
    params = unique(mlp(case["widths"], seed=case["seed"], tie=case["tie"], freeze=case["freeze"]).parameters())
    size = [p.numel() * p.element_size() for p in params if p.requires_grad]
    frozen = sum(p.numel() * p.element_size() for p in params if not p.requires_grad)
    return sum(size) > sum(size) / case["world_size"] + max(size) + frozen


@functools.lru_cache(maxsize=None)
def _picks_of(capacity, order, worst_first):
    from mgpu_helpers.checks import capstone
    plans = REGISTRY["11.1"]._plans({"capacity": capacity, "order": order, "worst_first": worst_first})
    fit = [p for p in plans if p.device_bytes <= capacity]
    right = capstone._summary(capstone._cheapest(plans, lambda p: p.device_bytes <= capacity))
    wrong = {name: capstone._cheapest(plans, lambda p, rule=rule: rule(p, capacity))
             for name, rule in capstone.WRONG_FITS.items()}
    wrong.update({"step cost first": min(fit, key=lambda p: p.step_cost, default=None),
                  "fewest ranks only": min(fit, key=lambda p: p.config["world_size"], default=None),
                  "smallest device total": min(fit, key=lambda p: p.device_bytes, default=None)})
    wrong = {name: capstone._summary(pick) for name, pick in wrong.items()}
    return right, {name: pick for name, pick in wrong.items() if pick != right}


def _picks(case):
    """11.1 on one case: the right plan, and the wrong plan of each wrong rule that errs there, as the judge
    computes them."""
    return _picks_of(case["capacity"], case["order"], case.get("worst_first", 0))


def _named_alone(cases, name):
    """Whether the first case on which the wrong fit ``name`` errs tells it from the other wrong fits (its plan is
    theirs on none): the check fails there, naming only ``name`` of them."""
    from mgpu_helpers.checks.capstone import WRONG_FITS
    wrong = next((w for _, w in map(_picks, cases) if name in w), None)
    return wrong is not None and not any(o in wrong and wrong[o] == wrong[name]
                                         for o in WRONG_FITS if o != name)


def _below_every_plan(case):
    from mgpu_helpers.capstone import candidate_plans
    return case["capacity"] < min(p.device_bytes for p in candidate_plans())


def _11_1_edges():
    from mgpu_helpers.checks.capstone import WRONG_FITS  # (the rules alone: mgpu_helpers.capstone is light)
    edges = [("a capacity below every plan (nothing fits: None)", lambda cs: any(map(_below_every_plan, cs)))]
    edges += [(f"a first capacity that names this wrong fit alone: {name[:40]}",
               lambda cs, n=name: _named_alone(cs, n)) for name in WRONG_FITS]
    edges += [(f"a capacity where '{name}' picks a wrong plan",
               lambda cs, n=name: any(n in _picks(c)[1] for c in cs))
              for name in ("step cost first", "fewest ranks only", "smallest device total")]
    return edges


def _amp(name):
    from mgpu_helpers.checks import amp
    return getattr(amp, name)


def _fsdp_lr():
    from mgpu_helpers.checks.fsdp_practice import LR  # the optimizer's own, before a case sets its lr
    return LR


def _adam_mistakes_told_apart(case):
    """12.2's judge names "Adam restarted" and "the lr was not restored" by its one-process rerun of each; both
    stay beyond its tolerance (rtol 1e-5, atol 1e-6) of the right run on this case: the mutant cannot pass."""
    from mgpu_helpers.checks.base import flat
    from mgpu_helpers.checks.fsdp_practice import _baseline
    right = flat(_baseline(case)[1])
    return all(not torch.allclose(flat(_baseline(case, optimizer=o)[1]), right, rtol=1e-5, atol=1e-6)
               for o in ("fresh", "initialised", "lr lost"))


def _12_1_same(cs):
    """12.1's budgets are the notebook's: a draw changes only the model's and the batch's seed."""
    first = REGISTRY["12.1"].make_cases(0)
    return [{**c, "seed": 0} for c in cs] == [{**c, "seed": 0} for c in first]


EDGES = {
    "1.1": [
        ("Adam without mixed precision (one Adam state)",
         lambda cs: any(c["optimizer"] == "adam" and c["precision"] != "mixed" for c in cs)),
        ("momentum + mixed before Adam + mixed (the master copy forgotten, not one Adam state)",
         lambda cs: (c := [(x["optimizer"], x["precision"]) for x in cs]).index(("momentum", "mixed"))
         < c.index(("adam", "mixed"))),
        ("a 16-bit case (fp32 bytes for 16-bit weights)", lambda cs: any(c["precision"] != "fp32" for c in cs)),
    ],
    "1.2": [
        ("a hidden layer in every case (pre-activations, logits)", lambda cs: all(len(c["widths"]) >= 3 for c in cs)),
        ("a bf16 case (4 bytes per element)", lambda cs: any(c["dtype"] == "bf16" for c in cs)),
    ],
    "2.1": [
        # (measured, the judge's own guard: its "check error" unless the earlier peak is above the step's)
        ("a baseline before the step, in every case (baseline included)",
         lambda cs: all(c["baseline"] > 0 for c in cs)),
        ("an earlier spike above all the step can allocate, in every case (peak not reset)",
         lambda cs: all(c["spike"] > _step_bytes_bound(c) for c in cs)),
    ],
    "2.2": [
        ("each kind of model: weight-heavy, activation-heavy, narrow, wide",
         lambda cs: {c["kind"] for c in cs} == {"weights", "activations", "narrow", "wide"}),
        ("a narrow model at a batch <= 64 and a wide one above (the batch-size guess)",
         lambda cs: any(c["kind"] == "narrow" and c["batch"] <= 64 for c in cs)
         and any(c["kind"] == "wide" and c["batch"] > 64 for c in cs)),
    ],
    "3.1": [
        ("a batch that divides evenly", lambda cs: any(c["batch"] % c["n_replicas"] == 0 for c in cs)),
        ("unequal chunks, n of them (per-replica mean losses)",
         lambda cs: any(c["batch"] % c["n_replicas"] and _chunks(c["batch"], c["n_replicas"]) == c["n_replicas"]
                        for c in cs)),
        ("a batch torch.chunk splits into fewer than n chunks (chunk vs tensor_split)",
         lambda cs: any(_chunks(c["batch"], c["n_replicas"]) < c["n_replicas"] for c in cs)),
    ],
    "4.1": [
        ("3 ranks (divided by 2)", lambda cs: any(c["world_size"] == 3 for c in cs)),
        ("an unused parameter on 2+ ranks", lambda cs: any(c["unused"] and c["world_size"] > 1 for c in cs)),
        ("biases on ranks with unequal shards (.bias skipped)",
         lambda cs: any(c["bias"] and len(set(c["rows"])) > 1 for c in cs)),
    ],
    "4.2": [
        ("a bucket exactly at the cap (>= instead of >)", lambda cs: any(_buckets(c) != _buckets(c, close_at_cap=True)
                                                                         for c in cs)),
        ("a bucket DDP's rule would overshoot", lambda cs: any(_buckets(c) != _buckets(c, after=True) for c in cs)),
        ("a bucket of several gradients, in every case (no bucketing)",
         lambda cs: all(len(_buckets(c)) < len(_grad_bytes(c)) for c in cs)),
        ("several buckets (the last one forgotten)", lambda cs: any(len(_buckets(c)) > 1 for c in cs)),
        ("3 ranks (not divided)", lambda cs: any(c["world_size"] == 3 for c in cs)),
        ("an unused parameter", lambda cs: any(c["unused"] for c in cs)),
    ],
    "5.1": [
        ("k > 1 micro-batches of m != k rows, no padding (not divided by k; by m)",
         lambda cs: any(c["k"] > 1 and c["micro"] != c["k"] and not c.get("pad") for c in cs)),
        ("padding over k > 1 micro-batches (1/k weighting; padding counted)",
         lambda cs: any(c.get("pad") and c["k"] > 1 for c in cs)),
        (".grad already holding gradients", lambda cs: any(c.get("prefilled") for c in cs)),
    ],
    "5.2": [
        ("2 ranks, k = 2, 3 and 4 (no_sync choices, collectives)",
         lambda cs: {c["k"] for c in cs if c["world"] == 2} == {2, 3, 4}),
        ("one rank (DDP still syncs)", lambda cs: any(c["world"] == 1 and c["k"] > 1 for c in cs)),
        ("a bucket cap below the gradients' bytes, in every case (counts tell)",
         lambda cs: all(c["bucket_cap_mb"] * 2**20 < 4 * sum((a + 1) * b for a, b in zip(c["widths"], c["widths"][1:]))
                        for c in cs)),
    ],
    "6.1": [
        ("the four fixed scripts at growth interval 3",
         lambda cs: [c["script"] for c in cs[:4]] == REGISTRY["6.1"].FIXED
         and all(c["growth_interval"] == 3 for c in cs[:4])),
        ("an overflow on the first step, in the second param group (only param_groups[0] checked)",
         lambda cs: any(_first_bad(c) == (0, "inf") and _amp("group_of")(c, 0) == 1 for c in cs)),
        ("a nan first, in the first param group (nan missed)",
         lambda cs: any(_first_bad(c)[1] == "nan" and _amp("group_of")(c, _first_bad(c)[0]) == 0 for c in cs)),
        ("growth_interval clean steps, then an overflow (grew late; not reset after growing)",
         lambda cs: any(c["script"][:c["growth_interval"] + 1] == ["ok"] * c["growth_interval"] + ["inf"]
                        for c in cs)),
        ("an overflow, then growth_interval clean steps (skipped step counted; not reset)",
         lambda cs: any(c["script"][t + 1:t + 1 + c["growth_interval"]] == ["ok"] * c["growth_interval"]
                        for c in cs for t, e in enumerate(c["script"]) if e == "inf")),
        ("two overflows in a row",
         lambda cs: any("inf" == a == b for c in cs for a, b in zip(c["script"], c["script"][1:]))),
    ],
    "6.2": [
        ("a loss scale above 1 (never unscaled; scaled loss returned)",
         lambda cs: any(c["loss_scale"] > 1 for c in cs)),
        ("a clip that binds (clipped the scaled gradients)",
         lambda cs: any(c["max_norm"] < _amp("_grad_norm")(c) for c in cs)),
        ("an fp16 case whose 16-bit unscaling loses bits (unscaled in 16 bits)",
         lambda cs: any(c["dtype"] == "fp16" and _amp("_unscale16_differs")(c) for c in cs)),
    ],
    "7.1": [
        ("several segments of k > 1 blocks (every block alone; k + 1; i % k)",
         lambda cs: any(not c.get("bad") and 1 < c["k"] < c["layers"] for c in cs)),
        ("a last, shorter segment", lambda cs: any(not c.get("bad") and c["layers"] % c["k"] for c in cs)),
        ("k = L: one segment (the closure over x)", lambda cs: any(not c.get("bad") and c["k"] == c["layers"]
                                                                    for c in cs)),
        ("k = 1", lambda cs: any(not c.get("bad") and c["k"] == 1 for c in cs)),
        ("dropout (rng state; eval mode)", lambda cs: any(c.get("dropout") for c in cs)),
        ("k = 0 and k > L (ValueError)", lambda cs: any(c.get("bad") and c["k"] == 0 for c in cs)
         and any(c.get("bad") and c["k"] > c["layers"] for c in cs)),
    ],
    "8.1": [
        ("bad input (TypeError, ValueError)", lambda cs: any(c["kind"] == "bad input" for c in cs)),
        ("SGD on 2+ ranks (gradients divided or summed over ranks)",
         lambda cs: any(c.get("optimizer") == "SGD" and c["world_size"] > 1 for c in cs)),
        ("a tie across two param groups on 2+ ranks",
         lambda cs: any(c.get("tie") and c["groups"] == "split" and c["world_size"] > 1 for c in cs)),
        ("add_param_group on 2+ ranks", lambda cs: any(c.get("add_group") and c["world_size"] > 1 for c in cs)),
        ("one where a rank owning every parameter is out of balance (unbalanced: rank 0 owns)",
         lambda cs: any(map(_one_owner_unbalanced, cs))),
        ("one rank", lambda cs: any(c["kind"] == "train" and c["world_size"] == 1 for c in cs)),
    ],
    "8.2": [
        ("2+ ranks, a size the world does not divide (padding)",
         lambda cs: any(c["world_size"] > 1 and c["n"] % c["world_size"] for c in cs)),
        ("2+ ranks, a size it divides", lambda cs: any(c["world_size"] > 1 and c["n"] % c["world_size"] == 0
                                                       for c in cs)),
        ("one rank", lambda cs: any(c["world_size"] == 1 for c in cs)),
    ],
    "9.1": [
        ("n_micro not dividing the batch (ValueError)", lambda cs: any(c["batch"] % c["n_micro"] for c in cs)),
        ("layers the stages do not divide (extra layers)",
         lambda cs: any(c["n_layers"] % c["world_size"] and c["batch"] % c["n_micro"] == 0 for c in cs)),
        ("3+ stages (overlap; messages)", lambda cs: any(c["world_size"] >= 3 and c["batch"] % c["n_micro"] == 0
                                                         for c in cs)),
        ("several micro-batches on 2+ stages (loss not divided; one forward; backward order)",
         lambda cs: any(c["n_micro"] > 1 and c["world_size"] > 1 and c["batch"] % c["n_micro"] == 0 for c in cs)),
        ("one stage", lambda cs: any(c["world_size"] == 1 for c in cs)),
    ],
    "9.2": [
        ("h not divisible by the world size (ValueError)", lambda cs: any(c["h"] % c["world_size"] for c in cs)),
        ("d divisible by the world size in every case (a wrong split shows as a shape)",
         lambda cs: all(c["d"] % c["world_size"] == 0 for c in cs)),
        ("2+ ranks, h divisible", lambda cs: any(c["world_size"] > 1 and c["h"] % c["world_size"] == 0 for c in cs)),
    ],
    "10.1": [
        ("padding: n not divisible, drop_last off", lambda cs: any(not c["drop_last"] and c["n"] % c["world_size"]
                                                                    for c in cs)),
        ("padding longer than the list (repeated once only)",
         lambda cs: any(not c["drop_last"] and -(-c["n"] // c["world_size"]) * c["world_size"] - c["n"] > c["n"]
                        for c in cs)),
        ("drop_last with n not divisible", lambda cs: any(c["drop_last"] and c["n"] % c["world_size"] for c in cs)),
        ("a shuffle (set_epoch)", lambda cs: any(c["shuffle"] for c in cs)),
        ("2+ ranks with 2+ indices each (contiguous blocks)",
         lambda cs: any(c["world_size"] > 1 and c["n"] >= 2 * c["world_size"] for c in cs)),
    ],
    "11.1": _11_1_edges(),
    "12.1": [("the notebook's budgets, only the seed drawn", _12_1_same)],
    "12.2": [
        ("an optimizer listing the parameters in reverse (state keyed by position)",
         lambda cs: any(c.get("reorder") for c in cs)),
        ("saved and loaded on different numbers of ranks, 2+ saving, in every case",
         lambda cs: all(c["save_on"] != c["load_on"] and c["save_on"] > 1 for c in cs)),
        ("steps before the save and an lr set (optimizer state; lr restored)",
         lambda cs: all(c["before"] >= 1 and c["lr"] != _fsdp_lr() for c in cs)),
        ("Adam restarted, or at the fresh lr, beyond the judge's tolerance of the right run",
         lambda cs: all(map(_adam_mistakes_told_apart, cs))),
    ],
}


# 6.2's and 11.1's draws search for their telling cases (gradients computed; every rule tried on every plan):
# 0.1-0.3 s a draw, so 10 seeds; the others' draws cost microseconds.
DRAWS = {"6.2": 10, "11.1": 10}


@pytest.mark.parametrize("ex", [marked(ex, id=ex) for ex in ORDER])
def test_draw_holds_its_edge_cases(ex):
    """For 50 seeds (see DRAWS), without running a learner's function."""
    _nb(ex)
    for seed in range(DRAWS.get(ex, 50)):
        cases = REGISTRY[ex].make_cases(seed)
        for what, holds in EDGES[ex]:
            assert holds(cases), f"Exercise {ex}, seed {seed}: no case with {what}"
