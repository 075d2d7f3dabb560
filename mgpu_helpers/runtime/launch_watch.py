"""The caller's side of ``run_ranks`` (launch.py): collect results, blame the right rank, say where a hang is.

- **Blame the cause.** Rank 0's "Connection closed by peer" can arrive *before* the exit of rank 1 that caused
  it: each rank sends its exception before it exits, stamped with CLOCK_MONOTONIC, and a peer's disconnection is
  blamed only when no cause shows up (a death without an exception is a cause). Ties name the lowest rank.
- **A hang says where.** Hung ranks dump their Python stacks with ``faulthandler`` (on ``DUMP_SIGNAL``) before
  they are killed: it writes from C, so it works while a rank waits inside a collective.
"""
import contextlib
import linecache
import os
import pickle
import re
import sys
import sysconfig
import time
import traceback
from multiprocessing.connection import wait
from signal import SIGUSR1 as DUMP_SIGNAL, Signals

import torch

# How gloo and NCCL report a vanished peer in the ranks that survive it.
_CONSEQUENCE = re.compile(r"(closed|reset) by peer|broken pipe|remote (worker|process)|ncclRemoteError|"
                          r"communicator was aborted", re.IGNORECASE)
_CAUSE_SETTLE = 0.25  # s: once a cause is known, how long its peers' errors may still arrive
_CONSEQUENCE_SETTLE = 5.0  # s: with only consequences known, how long to wait for their cause
_DUMP_WAIT, _DUMP_QUIET = 1.5, 0.1  # s: at most, and silence that ends a rank's stack dump
STARTUP_LIMIT = 300.0  # s: for the ranks' imports and unpickling, before ``timeout`` runs (dynamo's, under load)


class RankError(RuntimeError):
    """A rank failed: ``rank``, ``exitcode`` (None if it raised) and ``traceback`` (text) say how."""
    def __init__(self, message, rank, exitcode=None, traceback=""):
        super().__init__(message)
        self.rank, self.exitcode, self.traceback = rank, exitcode, traceback


class RankTimeout(TimeoutError):
    """Ranks outlived the launch's timeout. ``running``: their ranks; ``summary``: where each was (the same on
    every run of the same code); ``stacks``: rank -> its Python stack when killed (paths vary by machine)."""
    def __init__(self, summary, running, stacks):
        super().__init__(summary + "".join(f"\n\n--- Python stack of rank {r} when it was killed "
                                           f"(most recent call last) ---\n{s.rstrip()}" for r, s in stacks.items()))
        self.summary, self.running, self.stacks = summary, running, stacks


def collect(procs, conns, dumps, timeout):
    """Each rank's result, in rank order; raise RankError or RankTimeout (the caller kills what is left).
    ``timeout`` counts from every rank's "go", after its imports."""
    results, pending, failures, returned = [None] * len(procs), set(range(len(procs))), {}, []
    going = set()
    deadline = None if timeout is None else time.monotonic() + max(timeout, STARTUP_LIMIT)
    settle = None  # once something failed: when to stop waiting for the rest and judge
    while pending and (settle is None or time.monotonic() < settle):
        ends = [t for t in (deadline, settle) if t is not None]
        left = max(0.0, min(ends) - time.monotonic()) if ends else None
        if deadline is not None and time.monotonic() >= deadline:
            if failures:
                break
            started = len(going) == len(procs)
            raise _timed_out(procs, dumps, sorted(pending), timeout if started else max(timeout, STARTUP_LIMIT),
                             "" if started else f" (rank(s) {_ranks(sorted(set(pending) - going))} never started)")
        waits = {**{conns[r]: r for r in pending}, **{procs[r].sentinel: r for r in pending}}
        for r in sorted({waits[obj] for obj in wait(list(waits), timeout=left)}):
            seen, got = time.monotonic(), None
            if conns[r].poll():
                with contextlib.suppress(EOFError):
                    got = {**pickle.loads(conns[r].recv_bytes()), "seen": seen}
            elif procs[r].exitcode is None:
                continue  # a spurious wake-up
            if got is None:  # EOF: the process is exiting; wait for its exit code
                procs[r].join(5)  # a death is known only when seen: its time is an upper bound
                got = {"kind": "died", "time": seen, "what": procs[r].exitcode, "seen": seen}
            if got["kind"] == "go":
                going.add(r)
                if len(going) == len(procs) and timeout is not None:
                    deadline = time.monotonic() + timeout  # from here on the time is the ranks' own
                continue
            pending.discard(r)
            if got["kind"] == "ok":
                results[r] = pickle.loads(got["result"])
                returned.append(r)
            else:
                failures[r] = got
        if failures:
            causes = [f["seen"] for f in failures.values() if _is_cause(f)]
            settle = min(causes) + _CAUSE_SETTLE if causes else \
                min(f["seen"] for f in failures.values()) + _CONSEQUENCE_SETTLE
    if failures:
        raise _blame(failures, sorted(returned), sorted(pending))
    for p in procs:  # all reported: let them exit on their own before the caller kills stragglers
        p.join(5)
    return results


def _is_cause(f):
    return f["kind"] == "died" or not _CONSEQUENCE.search(f["what"])


def _ranks(rs):
    return ", ".join(map(str, rs))


def _blame(failures, returned, running):
    causes = {r: f for r, f in failures.items() if _is_cause(f)}
    if causes:
        first = min(causes.values(), key=lambda f: f["time"])
        same = sorted(r for r, f in causes.items() if (f["kind"], f["what"]) == (first["kind"], first["what"]))
    else:  # no cause seen: name the lowest rank, whichever error came first (they all read alike)
        same = [min(failures)]
    rank, f = same[0], failures[same[0]]
    if f["kind"] == "died":
        code = f["what"]
        how = f"was killed by {Signals(-code).name}" if (code or 0) < 0 else f"exited with code {code}"
        lines = [f"rank {rank} {how} without a Python exception (os._exit, a crash or a kill)"]
    else:
        lines = [f"rank {rank} raised {f['what']}"]
    if len(same) > 1:
        lines.append(f"(ranks {_ranks(same)} failed the same way)")
    if set(failures) - set(same):
        lines.append(f"(rank(s) {_ranks(sorted(set(failures) - set(same)))} failed after it)")
    if not causes and returned:
        lines.append(f"(rank(s) {_ranks(returned)} had returned while rank {rank} waited for them in a "
                     f"collective: do all ranks make the same collective calls?)")
    if running:
        lines.append(f"(rank(s) {_ranks(running)} still running: killed)")
    if f["kind"] == "died":
        raise RankError("\n".join(lines), rank, exitcode=f["what"])
    raise RankError("\n".join(lines) + f"\n\n--- traceback of rank {rank} ---\n{f['traceback']}",
                    rank, traceback=f["traceback"])


def _timed_out(procs, dumps, running, timeout, why=""):
    for r in running:
        with contextlib.suppress(ProcessLookupError):
            os.kill(procs[r].pid, DUMP_SIGNAL)
    # Read the dumps until every rank has written and gone quiet, or _DUMP_WAIT is up.
    texts, heard, open_ = {r: b"" for r in running}, set(), {r: dumps[r] for r in running}
    end = time.monotonic() + _DUMP_WAIT
    while open_ and time.monotonic() < end:
        ready = wait(list(open_.values()), timeout=_DUMP_QUIET)
        if not ready and heard >= set(open_):
            break
        for r in [r for r, c in open_.items() if c in ready]:
            chunk = os.read(open_[r].fileno(), 65536)
            texts[r] += chunk
            heard.add(r)
            if not chunk:  # EOF: the rank has exited
                del open_[r]
    lines = [f"run_ranks: timed out after {timeout:g} s{why}; rank(s) {_ranks(running)} still running (killed)"]
    stacks = {}
    for r in running:
        frames, launcher = _frames(texts[r].decode(errors="replace"))
        if frames:
            stacks[r] = "".join(traceback.format_list([(file, n, fn, None) for file, n, fn in frames]))
        lines.append(f"  rank {r} " + _where(frames, launcher))
    return RankTimeout("\n".join(lines), running, stacks)


_FRAME = re.compile(r'^\s*File "(.*)", line (\d+) in (.*)$')


def _frames(text):
    """(frames of fn and below, most recent call last; the launcher's frame that called them)."""
    # faulthandler: one block per Python thread, most recent call first. The rank's main thread is the
    # one running launch._rank_main; below it (older) are the frames of its start, or of a forked parent.
    for block in text.split("\n\n"):
        frames = [(m[1], int(m[2]), m[3]) for m in map(_FRAME.match, block.splitlines()) if m]
        for i, (file, _, fn) in enumerate(frames):
            if fn == "_rank_main" and os.path.basename(file) == "launch.py":
                return frames[:i][::-1], frames[i]
    return [], None


_HERE = os.path.dirname(os.path.realpath(__file__)) + os.sep
_LIBRARIES = tuple(os.path.realpath(sysconfig.get_paths()[k]) + os.sep for k in (
    "stdlib", "platstdlib", "purelib", "platlib")) + (os.path.dirname(os.path.realpath(torch.__file__)) + os.sep,)


def _is_library(file):
    real = os.path.realpath(file)
    if real.startswith(_HERE):  # the course's helpers are the learner's code, bar the launcher itself
        return os.path.basename(real).startswith("launch")
    return file.startswith("<frozen") or real.startswith(_LIBRARIES)


def _short(file):
    """A library file relative to its sys.path entry: torch/distributed/distributed_c10d.py."""
    real = os.path.realpath(file)
    roots = [os.path.realpath(p) + os.sep for p in sys.path if p and real.startswith(os.path.realpath(p) + os.sep)]
    return real[len(max(roots, key=len)):] if roots else os.path.basename(file)


def _at(frame):
    file, n, fn = frame
    src = linecache.getline(file, n).strip()
    return f"{fn}, line {n}" + (f": {src}" if src else "")


def _where(frames, launcher):
    if not frames and launcher is None:
        return "gave no Python stack (it was still starting, or had just exited)"
    if not frames:
        return f"was in run_ranks' own code ({_short(launcher[0])} {_at(launcher)})"
    user = [f for f in frames if not _is_library(f[0])]
    if user and user[-1] == frames[-1]:
        return f"was in {_at(frames[-1])}"
    caller = f"called from {_at(user[-1])}" if user else f"called from run_ranks' own {_at(launcher)}"
    return f"was waiting in {frames[-1][2]} ({_short(frames[-1][0])}), {caller}"
