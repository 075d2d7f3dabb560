"""How exercises are checked: a check runs the learner's function on fresh random inputs, compares the result with
PyTorch, a single-process baseline or a measurement, and prints ``Exercise 4.1 ✓ average_gradients: 3/3 cases``
or raises :class:`CheckFailure` saying what differed and which known mistake it matches.

Three steps, so that a grader keeps the verdict out of the learner's kernel: ``cases(rng)`` (plain data drawn from
a seed), ``run(fn, case)`` (the learner's code on one case: plain data or CPU tensors) and ``judge(case, result)``
(raises; never calls learner code). A notebook runs all three (``check_4_1(average_gradients)``); the grader runs
``judge`` in a process that never runs learner code. What a learner sees: AUTHORING.md, "Checks".
"""

import contextlib
import copy
import os
import random
import re
import sys
import traceback
import weakref
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable
from unittest import mock

import torch

from ..memory import torch_threads
from ..runtime.exercises import STUB
from .delegation import course_code_used, refusal

REGISTRY: dict[str, "Check"] = {}
_TIMED_OUT: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # function -> {check id: message}


_PACKAGE = str(Path(__file__).resolve().parent)


def is_stub(e: BaseException | str) -> bool:
    """Whether an exception (or its "Type: message" text, as the grader records it) is a stub's: torch's own
    NotImplementedError (an nn.ModuleList called like a module, an op with no kernel) is a bug to show."""
    text = f"{type(e).__name__}: {e}" if isinstance(e, BaseException) else e
    return text.startswith("NotImplementedError: ") and bool(STUB.match(text[len("NotImplementedError: "):]))


class CheckFailure(AssertionError):
    """A check did not pass. IPython shows it through :meth:`_render_traceback_`: the message alone, after the
    traceback of the learner's exception (if it raised) without the course package's frames."""

    def _render_traceback_(self) -> list[str]:
        lines, cause = [], self.__cause__
        if cause is not None:
            frames = [f for f in traceback.extract_tb(cause.__traceback__) if not f.filename.startswith(_PACKAGE)]
            head = ["Traceback of the exception your code raised (most recent call last):"] if frames else []
            lines = head + traceback.format_list(frames) + traceback.format_exception_only(cause) + [""]
        return [x.rstrip("\n") for x in lines] + [f"\x1b[0;31m{type(self).__name__}\x1b[0m: {self}"]


class Check:
    """Base class: subclasses set ``id``, ``function`` and implement ``cases``, ``run`` (or name a ``rank_fn``)
    and ``judge``. A check's module gets it as ``check_<id>`` (``check_4_1``), the name a notebook imports."""

    id: str = ""            # "4.1": the same id in the stub, the check line, the grade row and the test marker
    function: str = ""      # the name of the learner's function, for messages
    points: int = 1
    may_use: tuple = ()     # the parts of the package the learner's answer may name (delegation.py): none
    rank_fn = None          # a distributed check's rank, rank_fn(rank, world_size, fn, case): the default run's
    hints: dict = {}        # a regular expression found in what the learner's code raised -> the hint for it

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if cls.id:
            REGISTRY[cls.id] = check = cls()
            if cls.__module__ in sys.modules:  # `from mgpu_helpers.checks.ddp import check_4_1`
                setattr(sys.modules[cls.__module__], "check_" + cls.id.replace(".", "_"), check)

    def cases(self, rng: random.Random) -> list[dict]:
        raise NotImplementedError

    def run(self, fn: Callable, case: dict) -> Any:
        return run_learner_ranks(self.rank_fn, case["world_size"], fn, case, backend="gloo", timeout=15)

    def judge(self, case: dict, result: Any) -> None:
        raise NotImplementedError

    def describe(self, case: dict) -> str:
        """A short description of a case for failure messages (default: its items)."""
        return ", ".join(f"{k}={v}" for k, v in case.items() if not k.startswith("_") and k != "seed")

    def make_cases(self, seed: int | None = None) -> list[dict]:
        # Unseeded: fresh inputs. A seed's draw is made once per process, then copied (6.2's and 11.1's draws search).
        if seed is None:
            return self.cases(random.Random(int.from_bytes(os.urandom(4), "little")))
        drawn = self.__dict__.setdefault("_drawn", {})
        if seed not in drawn:
            drawn[seed] = self.cases(random.Random(seed))
        return copy.deepcopy(drawn[seed])

    def hint(self, error: str) -> str:
        """A hint for an exception the learner's code raised, given as "Type: message" ("" if none)."""
        return next((h for pattern, h in self.hints.items() if re.search(pattern, error, re.DOTALL)), "")

    def _raised(self, error: str) -> str:
        hint = self.hint(error)
        if "ContractError" in error:  # runtime/contract.py: the answer works on gloo only
            hint = ("this works on CPU ranks (gloo) only: on GPU ranks (NCCL) every tensor that meets a collective "
                    "or send/recv must be on rank_device(). " + hint).strip()
        return f"Exercise {self.id} ✗ {self.function} raised {error}" + (f"\n  Hint: {hint}" if hint else "")

    # A function whose run timed out (a hung rank) is not run again by the same check id on the same function
    # object: that would pay the timeout twice. Re-running its cell makes a new object, which runs again.
    def _run(self, fn: Callable, case: dict) -> Any:
        try:
            timed_out = _TIMED_OUT.setdefault(fn, {})  # {check id: message}
        except TypeError:  # not weak-referenceable
            timed_out = {}
        if self.id in timed_out:
            raise TimeoutError(timed_out[self.id] + "\n  (this function timed out in an earlier run of this check "
                               "and is not run again; fix it and re-run its cell)")
        try:
            return self.run(fn, case)
        except TimeoutError as e:
            timed_out[self.id] = str(e)
            raise

    def _call(self, fn: Callable, case: dict) -> Any:
        try:
            return self._run(fn, case)
        except CheckFailure:
            raise
        except Exception as e:  # the learner's code raised: show it, with the traceback chained below
            if is_stub(e):
                raise CheckFailure(f"Exercise {self.id} ✗ {self.function}: not implemented yet ({e})") from None
            raise CheckFailure(self._raised(f"{type(e).__name__}: {e}") + f"\n  on case: {self.describe(case)}") from e

    def judge_one(self, i: int, n: int, case: dict, result: Any) -> None:
        where = f"Exercise {self.id} ✗ {self.function}, case {i + 1} of {n} ({self.describe(case)}):\n  "
        try:
            if self.rank_fn is not None:
                expect(isinstance(result, list) and len(result) == case["world_size"],
                       f"expected one result per rank ({case['world_size']})")
            self.judge(case, result)
        except CheckFailure as e:
            raise CheckFailure(where + str(e)) from None
        except Exception as e:
            # the judge could not use what the learner's function returned: not a TypeError "the learner raised"
            raise CheckFailure(
                where + f"{self.function} returned {describe_value(result)}, which the check cannot use "
                f"({type(e).__name__}: {e}); see the exercise text for what to return"
            ) from None

    def __call__(self, fn: Callable, seed: int | None = None) -> None:
        if not callable(fn):
            raise CheckFailure(f"Exercise {self.id} ✗ expected a function `{self.function}`, got {type(fn).__name__}")
        used = course_code_used(fn, self.may_use)
        if used:
            raise CheckFailure(refusal(self.id, self.function, used))
        cases = self.make_cases(seed)
        with torch_threads(1):  # small inputs: a second intra-op thread only adds overhead
            for i, case in enumerate(cases):
                self.judge_one(i, len(cases), case, self._call(fn, case))
        print(f"Exercise {self.id} ✓ {self.function}: {len(cases)}/{len(cases)} cases")

    def passes(self, fn: Callable, seed: int | None = 0) -> bool:
        """Whether ``fn`` passes this check, silently: for plots and tables that show a learner's function."""
        import io
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                self(fn, seed=seed)
        except CheckFailure:
            return False
        return True

    passed = passes  # a RemembersVerdict check answers from its last verdict on the function

    def run_all(self, fn: Callable, seed: int) -> list[dict]:
        """Results of the learner's function on the seed's cases, as plain data (for the grader)."""
        used = course_code_used(fn, self.may_use)
        if used:  # nothing of it is run: the judge reports why
            return [{"ok": False, "course_code": used}]
        out = []
        with torch_threads(1):
            for case in self.make_cases(seed):
                try:
                    out.append({"ok": True, "result": self._run(fn, case)})
                except Exception as e:  # noqa: BLE001 - any failure is the learner's, recorded as such
                    out.append({"ok": False, "error": f"{type(e).__name__}: {e}",
                                "traceback": "".join(traceback.format_exception(e))[-4000:]})
        return out

    def judge_all(self, seed: int, results: list[dict]) -> tuple[bool, str]:
        """Verdict on results from :meth:`run_all`; never runs learner code."""
        if isinstance(results, list) and results and isinstance(results[0], dict) and results[0].get("course_code"):
            return False, refusal(self.id, self.function, str(results[0]["course_code"])[:200])
        with torch_threads(1):
            cases = self.make_cases(seed)
            if not isinstance(results, list) or len(results) != len(cases):
                return False, f"Exercise {self.id} ✗ {self.function}: no results for this check"
            for i, (case, r) in enumerate(zip(cases, results)):
                if not isinstance(r, dict) or not r.get("ok"):
                    err = str(r.get("error", "no result")) if isinstance(r, dict) else "malformed result"
                    if is_stub(err):
                        return False, f"Exercise {self.id} ✗ {self.function}: not implemented yet"
                    return False, self._raised(err)
                try:
                    self.judge_one(i, len(cases), case, r.get("result"))  # any exception: a CheckFailure
                except CheckFailure as e:
                    return False, str(e)
        return True, f"Exercise {self.id} ✓ {self.function}: {len(cases)}/{len(cases)} cases"


class RemembersVerdict(Check):
    """A slow check whose ``passed(fn)`` returns its last verdict on that very function object, else runs
    quietly: later cells ask it without repeating its work (or its timeout). Grading decides elsewhere."""

    def __call__(self, fn: Callable, seed: int | None = None) -> None:
        self._last = (fn, False)        # a failure, a timeout or an interrupt leaves "not passed"
        super().__call__(fn, seed)
        self._last = (fn, True)

    def passed(self, fn: Callable) -> bool:
        last = getattr(self, "_last", None)
        return last[1] if last is not None and last[0] is fn else self.passes(fn)


def run_learner_ranks(target: Callable, world_size: int, *args, **kwargs) -> list:
    """``run_ranks`` for a check's ``run``: a learner's stub raising NotImplementedError inside a rank
    reads as "not implemented yet", like a stub called in the kernel, not as a crashed rank."""
    from ..runtime.launch import RankError, run_ranks

    try:
        return run_ranks(target, world_size, *args, **kwargs)
    except RankError as e:
        first = str(e).splitlines()[0]
        if "raised NotImplementedError: " in first:
            message = first.split("NotImplementedError: ", 1)[1]
            if STUB.match(message):  # torch's own NotImplementedError stays a crashed rank, traceback and all
                raise NotImplementedError(message) from None
        raise


def _as_tensor(x: Any) -> torch.Tensor:
    return x.detach().to("cpu", torch.float64) if isinstance(x, torch.Tensor) else torch.as_tensor(x, dtype=torch.float64)


def _close(a: Any, b: Any, rtol: float, atol: float) -> bool:
    try:
        ta, tb = _as_tensor(a), _as_tensor(b)
    except Exception:
        return False
    return ta.shape == tb.shape and bool(torch.allclose(ta, tb, rtol=rtol, atol=atol, equal_nan=False))


def expect_close(actual: Any, expected: Any, what: str, *, mistakes: dict[str, Any] | None = None,
                 hint: str = "", rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Fail unless ``actual`` ≈ ``expected``, naming each of ``mistakes`` (name → the value it gives) it matches."""
    if _close(actual, expected, rtol, atol):
        return
    named = [name for name, wrong in (mistakes or {}).items() if _close(actual, wrong, rtol, atol)]
    if named:
        raise CheckFailure(f"{what}: wrong, and {_matches(named)}. {hint}".rstrip())
    try:
        ta, tb = _as_tensor(actual), _as_tensor(expected)
    except Exception:
        raise CheckFailure(f"{what}: expected a number or tensor, got {type(actual).__name__}. {hint}".rstrip()) from None
    if ta.shape != tb.shape:
        raise CheckFailure(f"{what}: shape {tuple(ta.shape)}, expected {tuple(tb.shape)}. {hint}".rstrip())
    detail = (f"got {ta.item():.6g}, expected {tb.item():.6g}" if ta.numel() == 1 else
              f"max |difference| = {(ta - tb).abs().max().item():.3g} (tolerance {atol:g} + {rtol:g}·|expected|)")
    raise CheckFailure(f"{what}: wrong, {detail}. {hint}".rstrip())


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # e.g. a tensor compared with an int: not equal, and not the check's crash
        return False


def _matches(named: list[str]) -> str:
    if len(named) == 1:
        return f"it matches a common mistake: {named[0]}"
    return "it matches each of these common mistakes (they give the same value here): " + "; ".join(named)


def plain(x: Any, _depth: int = 0) -> Any:
    """A returned value as data a grader can ship (``torch.load(weights_only=True)``): anything but numbers,
    strings, None, CPU tensors, lists and dicts of them becomes ``{"__type__": "a Foo"}`` (:func:`describe_value`)."""
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().clone()
    if _depth < 4 and isinstance(x, (list, tuple)):
        return [plain(v, _depth + 1) for v in x]
    if _depth < 4 and isinstance(x, dict):
        return {str(k): plain(v, _depth + 1) for k, v in x.items()}
    return {"__type__": describe_value(x)}


def scalar(x: Any) -> Any:
    """A returned number as plain data (a 1-element tensor's item); other objects as their description ("a list")."""
    if isinstance(x, torch.Tensor) and x.numel() == 1:
        return x.item()
    return x if x is None or isinstance(x, (bool, int, float, str)) else describe_value(x)


def describe_value(x: Any) -> str:
    """'an int', 'a tensor of shape (3,)', 'a dict with keys [...]' -- for wrong-type messages."""
    if isinstance(x, dict) and list(x) == ["__type__"]:  # what plain() made of an object it cannot ship
        return str(x["__type__"])
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}" + (f" ({x.dtype})" if x.dtype != torch.float32 else "")
    if isinstance(x, dict):
        return f"a dict with keys {sorted(map(str, x))}"
    if x is None:
        return "None"
    name = type(x).__name__
    return f"{'an' if name[0] in 'aeiouAEIOU' else 'a'} {name}"


def expect_type(value: Any, types: type | tuple[type, ...], what: str, expected: str, *,
                keys: Any = None, hint: str = "") -> None:
    """Fail with "what returned an int; expected a dict with keys ..." unless ``value`` is one of
    ``types`` (``bool`` is never accepted as a number). With ``keys``, a dict must have exactly those."""
    ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in (
        types if isinstance(types, tuple) else (types,)))
    if ok and keys is not None and isinstance(value, dict):
        ok = sorted(map(str, value)) == sorted(map(str, keys))
    if not ok:
        raise CheckFailure(f"{what} returned {describe_value(value)}; expected {expected}. {hint}".rstrip())


def expect_equal(actual: Any, expected: Any, what: str, *, mistakes: dict[str, Any] | None = None,
                 hint: str = "") -> None:
    """Exact equality (ints, strings, byte counts), naming a matching mistake when there is one."""
    if _equal(actual, expected):
        return
    named = [name for name, wrong in (mistakes or {}).items() if _equal(actual, wrong)]
    said = f"; {_matches(named)}" if named else ""
    raise CheckFailure(f"{what}: got {actual!r}, expected {expected!r}{said}. {hint}".rstrip())


def expect(cond: bool, message: str) -> None:
    if not cond:
        raise CheckFailure(message)


def flat(tensors) -> torch.Tensor:
    """The tensors flattened into one, to compare a model's parameters or gradients at once."""
    return torch.cat([t.detach().flatten() for t in tensors])


_OPS = ("all_reduce", "broadcast", "barrier")  # what a ledger watches (a comm hook admits all_reduce)


_SKIPPED = SimpleNamespace(wait=lambda *args, **kwargs: True, is_completed=lambda: True)  # a done async_op work


class CollectiveLedger:
    """Inside each rank: before each of the learner's collectives the ranks compare (op, call number, bytes, tag: e.g.
    a micro-step) in one all_gather; once they differ, collectives return at once (no hang) and :meth:`finish` gives
    every rank's calls. ``with ledger.watching():`` watches ``dist.<op>(...)``; a comm hook calls :meth:`admit`."""

    def __init__(self):
        import torch.distributed as dist

        from ..runtime.launch import rank_device
        self.calls: list[list] = []
        self.diverged = self.finished = False
        self.device = rank_device()  # its all_gather's tensors: NCCL takes no CPU tensor
        self._dist, self._all_gather = dist, dist.all_gather

    def _agree(self, code: list[int]) -> bool:
        t = torch.tensor(code, dtype=torch.int64, device=self.device)
        out = [torch.empty_like(t) for _ in range(self._dist.get_world_size())]
        self._all_gather(out, t)
        return all(torch.equal(o, t) for o in out)

    def admit(self, op: str, nbytes: int, tag: int = 0) -> bool:
        """Record a collective about to be made; True when it may run (every rank is making this one)."""
        self.calls.append([op, int(nbytes), int(tag)])
        if self.finished:
            return True
        if not self.diverged:
            code = [_OPS.index(op) + 1, len(self.calls), int(nbytes), int(tag)]
            self.diverged = not self._agree(code)
        return not self.diverged

    def finish(self) -> list[list] | None:
        """After the learner's function, on every rank: None when all ranks made the same collectives,
        else every rank's list of calls ([op, bytes, tag], by rank)."""
        if not self.diverged:
            self.diverged = not self._agree([0, len(self.calls), 0, 0])
        self.finished = True
        if not self.diverged:
            return None
        lists: list = [None] * self._dist.get_world_size()
        self._dist.all_gather_object(lists, self.calls)
        return lists

    def watching(self):
        def wrap(op, real):
            def collective(*args, **kwargs):
                t = next((a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)), None)
                if self.admit(op, 0 if t is None else t.numel() * t.element_size()):
                    return real(*args, **kwargs)
                return _SKIPPED if kwargs.get("async_op") else None
            return collective

        return mock.patch.multiple(self._dist, **{op: wrap(op, getattr(self._dist, op)) for op in _OPS})


def collective_mismatch(per_rank: list[list], tag: str = "") -> str:
    """"rank 0 made 2 all_reduce calls, rank 1 made 4: the ranks' collectives do not match", or, when
    the counts agree, the first call that differs. ``tag`` names what a call's tag counts ("micro-step")."""
    from collections import Counter
    counts = [Counter(c[0] for c in calls) for calls in per_rank]
    why = ("the ranks' collectives do not match: every rank must make the same collectives, in the same "
           "order, on tensors of the same size (a collective inside a rank-dependent branch, or a "
           "different order, breaks that)")
    if any(c != counts[0] for c in counts):
        ops = sorted(set().union(*counts))
        if len(ops) == 1:
            op = ops[0]
            said = [f"rank 0 made {counts[0][op]} {op} call{'s' * (counts[0][op] != 1)}"]
            said += [f"rank {r} made {c[op]}" for r, c in enumerate(counts) if r]
        else:
            said = [f"rank {r} made " + ", ".join(f"{c[op]} {op}" for op in ops) for r, c in enumerate(counts)]
        return ", ".join(said) + ": " + why
    for i, calls in enumerate(zip(*per_rank)):
        if any(c != calls[0] for c in calls):
            where = [f"rank {r}'s is {op} of {b} bytes" + (f" in {tag} {t}" if tag else "")
                     for r, (op, b, t) in enumerate(calls)]
            return f"collective number {i + 1}: " + ", ".join(where) + "; " + why
    return why
