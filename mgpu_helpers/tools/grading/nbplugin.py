"""pytest plugin for the sandboxed nbval process (``-p mgpu_helpers.tools.grading.nbplugin``), never the kernel.

It writes one JSON line per cell to ``--mgpu-report-fd``: pytest's outcome, the kernel's ``execute_reply``
status, the error, the bytes of output, and the first ``event`` that ended the run there: "output-limit",
"kernel-died", "timeout" or "process-limit".
It hardens nbval for untrusted code: a dead kernel is noticed at once, not at the cell timeout; output beyond
the caps, or tasks near ``--mgpu-max-tasks`` (the sandbox's RLIMIT_NPROC: a fork bomb) left after a cell, kill
the kernel; the run stops at the first such cell; the notebook file is deleted once collected (the kernel
cannot read the stored outputs) and this process is non-dumpable (the kernel cannot open its fds).
"""

import contextlib
import ctypes
import json
import os
import signal
import sys
import time
from queue import Empty

import pytest

# Imported before nbval (-p order): nbformat imports jsonschema, whose "iri" format checker imports rfc3987-syntax,
# which compiles its grammars on import -- 1.3 s of CPU in every notebook's process, for a format no notebook
# schema uses (python-jsonschema/jsonschema#1428). Without it jsonschema leaves that format unchecked.
sys.modules.setdefault("rfc3987_syntax", None)

_state: dict = {"cell": None, "total": 0, "cap": 1 << 20, "cap_total": 8 << 20, "out": None, "tasks": None}
POLL = 0.1  # seconds between liveness (and output) checks of the kernel while waiting for a message
OUTPUTS = ("stream", "display_data", "execute_result", "update_display_data", "error")


def pytest_addoption(parser):
    g = parser.getgroup("mgpu-grade")
    g.addoption("--mgpu-report-fd", type=int, default=None, help="write per-cell JSON records to this fd")
    g.addoption("--mgpu-output-cap", type=int, default=1 << 20, help="bytes of output per cell")
    g.addoption("--mgpu-output-cap-total", type=int, default=8 << 20, help="bytes of output per notebook")
    g.addoption("--mgpu-max-tasks", type=int, default=None,
                help="RLIMIT_NPROC of the sandbox (its own pid namespace): tasks near it after a cell stop the run")


def pytest_configure(config):
    fd = config.getoption("--mgpu-report-fd")
    if fd is None:
        return
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0
    _state.update(out=os.fdopen(fd, "w", buffering=1), cap=config.getoption("--mgpu-output-cap"),
                  cap_total=config.getoption("--mgpu-output-cap-total"), tasks=config.getoption("--mgpu-max-tasks"))
    _patch_nbval()


def _tasks() -> int:
    """Tasks of this user in /proc, as RLIMIT_NPROC counts them (the sandbox's pid namespace, or the host's)."""
    n, me = 0, os.getuid()
    for pid in os.listdir("/proc"):
        with contextlib.suppress(OSError):
            if pid.isdigit() and os.stat(f"/proc/{pid}").st_uid == me:
                n += len(os.listdir(f"/proc/{pid}/task"))
    return n


def _patch_nbval():
    from collections import deque

    from nbval.kernel import RunningKernel

    original_get = RunningKernel.get_message

    def _count(self, cur, msg):
        # what the cell shows (streams, displays, errors); the protocol's own messages are free
        n = len(json.dumps(msg["content"], ensure_ascii=False, default=str)) if msg["msg_type"] in OUTPUTS else 0
        cur["bytes"] += n
        _state["total"] += n
        if msg["msg_type"] == "error":
            cur["ename"] = str(msg["content"].get("ename", ""))[:100]
            cur["evalue"] = str(msg["content"].get("evalue", ""))[:300]
        if cur["bytes"] > _state["cap"] or _state["total"] > _state["cap_total"]:
            cur["event"] = cur["event"] or "output-limit"
            self.km.signal_kernel(signal.SIGKILL)  # nbval then fails the cell and the run stops
            raise Empty

    def _drain(self, cur):
        # nbval reads a cell's output only after its execute_reply: read it while waiting, so a flood is
        # counted (and stopped) as it happens instead of piling up in memory until the cell ends.
        pending = self.__dict__.setdefault("_mgpu_pending", deque())
        while cur["event"] != "output-limit":
            try:
                msg = self.kc.get_iopub_msg(timeout=0)
            except Empty:
                return
            pending.append(msg)
            _count(self, cur, msg)

    def _wait(self, getter, timeout, cur):
        # Poll in short slices so a kernel that exited (os._exit, a crash) is seen at once.
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = POLL if deadline is None else min(POLL, deadline - time.monotonic())
            try:
                return getter(timeout=max(wait, 0.001))
            except Empty:
                if getter == self.kc.get_shell_msg:
                    _drain(self, cur)
                if not self.is_alive():
                    cur["event"] = cur["event"] or "kernel-died"
                    raise
                if deadline is not None and time.monotonic() >= deadline:
                    raise

    def get_message(self, stream, timeout=None):  # nbval's await_reply reads "shell" through it too
        cur = _state["cell"]
        if cur is None:
            return original_get(self, stream, timeout=timeout)
        if stream == "shell":
            try:
                msg = _wait(self, self.kc.get_shell_msg, timeout, cur)
            except Empty:
                cur["event"] = cur["event"] or "timeout"
                raise
            if msg["msg_type"] == "execute_reply":  # the cell's: the run stops at the first one that hangs
                cur["status"] = msg["content"]["status"]
            return msg
        pending = self.__dict__.get("_mgpu_pending")
        if pending:
            return pending.popleft()  # already counted
        if cur["event"] == "output-limit":
            raise Empty
        msg = _wait(self, self.kc.get_iopub_msg, timeout, cur)
        _count(self, cur, msg)
        return msg

    RunningKernel.get_message = get_message


def pytest_collection_finish(session):
    if _state["out"] is None:
        return
    for path in {str(item.path) for item in session.items}:
        with contextlib.suppress(OSError):
            os.unlink(path)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if _state["out"] is None or not hasattr(item, "cell_num"):
        yield
        return
    cur = {"cell": item.cell_num, "status": None, "ename": None, "evalue": None, "bytes": 0, "failure": None,
           "event": None, "reports": {}}
    _state["cell"] = cur
    try:
        yield
    finally:
        _state["cell"] = None
        r = cur.pop("reports")
        setup, call = r.get("setup", "missing"), r.get("call", "missing")
        cur["outcome"] = call if setup == "passed" else ("error" if setup == "failed" else setup)
        if _state["tasks"] and _tasks() >= _state["tasks"] * 3 // 4:
            cur["event"] = cur["event"] or "process-limit"
            with contextlib.suppress(Exception):  # no kernel, or already gone
                item.parent.kernel.km.signal_kernel(signal.SIGKILL)
        _state["out"].write(json.dumps(cur, sort_keys=True) + "\n")
        if cur["event"]:
            # Nothing later in this run can count (nbval xfails every cell after a timeout): stop now, and
            # let the grader re-run the rest with this exercise stubbed.
            item.session.shouldstop = "mgpu-grade: the kernel is gone or timed out"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    kernel = getattr(item.parent, "kernel", None)
    if _state["cell"] is not None and item.cell_num > 0 and (kernel is None or not kernel.is_alive()):
        _state["cell"]["event"] = "kernel-died"  # between cells (a thread of the learner's, say)
    yield


@pytest.hookimpl(hookwrapper=True, tryfirst=True)  # outermost: the report as the skipping plugin leaves it
def pytest_runtest_makereport(item, call):
    cur, rep = _state["cell"], (yield).get_result()
    if cur is None:
        return
    # only PASSED counts: an xfail or xpass is recorded as such
    cur["reports"][rep.when] = ("xfailed" if rep.skipped else "xpassed") if hasattr(rep, "wasxfail") else rep.outcome
    if rep.failed and call.excinfo is not None and cur["failure"] is None:
        cur["failure"] = str(call.excinfo.value)[:300]
