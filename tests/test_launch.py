"""Tests of mgpu_helpers.runtime.launch: results, failures and who is blamed, timeouts and where ranks hung,
leaks, the fall-back note, forkserver and spawn, a real kernel, torchrun."""
import inspect
import linecache
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types
import warnings
from pathlib import Path

import pytest

from testkit import run_torchrun
import torch
import torch.distributed as dist

from mgpu_helpers.runtime import launch
from mgpu_helpers.runtime.launch import RankError, RankTimeout, describe, rank_device, run_ranks

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; fork")
REPO = Path(__file__).resolve().parents[1]
CORES = len(os.sched_getaffinity(0))
DEFAULT = launch._start_method("gloo")  # fork on a CPU-only machine, forkserver where a GPU is visible


@pytest.fixture(scope="module", autouse=True)
def _servers_running():
    """Start the forkserver (and multiprocessing's resource tracker) before any test counts processes:
    they live as long as this process, like a kernel's; ranks started from them must not."""
    old = os.environ.get("MGPU_START_METHOD")
    os.environ["MGPU_START_METHOD"] = "forkserver"
    try:
        run_ranks(_sum_ranks, 2)
    finally:
        os.environ.pop("MGPU_START_METHOD") if old is None else os.environ.update(MGPU_START_METHOD=old)
    run_ranks(_sum_ranks, 2)


@pytest.fixture(params=["default", "forkserver"])
def method(request, monkeypatch):
    """Each start method a machine may use: fork (the default on CPU) and the forkserver (GPUs)."""
    if request.param != "default":
        monkeypatch.setenv("MGPU_START_METHOD", request.param)
    return DEFAULT if request.param == "default" else request.param

# Rank functions: made to look as if a notebook cell defined them (module __main__), so that the forkserver
# ships them by value, as it does a notebook's, instead of importing this file (and pytest) in every rank.

def _notebook(fn):
    copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__module__ = "__main__"
    return copy


@_notebook

def _sum_ranks(rank, world_size):
    t = torch.tensor([rank + 1.0], device=rank_device())
    dist.all_reduce(t)
    return rank, world_size, t.item()


@_notebook
def _tensors(rank, world_size):
    big = torch.arange(1_000_000, dtype=torch.float32, device=rank_device()) * (rank + 1)  # 4 MB: more than a pipe buffer
    dist.all_reduce(big)
    shared = torch.full((3,), float(rank)).share_memory_()  # would dangle if sent by torch's mp pickler
    big = big.cpu()
    return {"big": big, "view": big[10:20:2], "shared": shared, "bf16": torch.ones(4, dtype=torch.bfloat16)}


@_notebook
def _threads(rank, world_size):
    return torch.get_num_threads(), str(rank_device())


@_notebook
def _raise_on_1(rank, world_size):
    if rank == 1:
        raise ValueError("boom from rank one")
    dist.barrier()  # rank 0 waits for a peer that is gone: it must be killed, not waited for


@_notebook
def _exit_on_1(rank, world_size, how):
    if rank == 1:
        if how == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer would
    dist.barrier()


@_notebook
def _planted(rank, world_size, bad, how):
    if rank == bad:
        if how == "raise":
            raise ValueError(f"planted on rank {rank}")
        if how == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(8, device=rank_device()))  # the peers wait for the planted rank: they fail as a consequence
    dist.barrier()


@_notebook
def _same_error(rank, world_size):
    raise ValueError("every rank gets this wrong")


@_notebook
def _returns_early(rank, world_size):
    if rank == 1:
        return "done"  # rank 0 still expects rank 1 in the all_reduce below
    dist.all_reduce(torch.ones(1, device=rank_device()))


@_notebook
def _hang(rank, world_size, in_collective):
    if rank == 1:
        time.sleep(600)
    if in_collective:
        dist.barrier()
    return rank


def _line_of(fn, text):
    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, line in enumerate(lines) if text in line)


# Inspecting this process: children, fds, listening TCP sockets (psutil-free, Linux only).

def _children(pid="self"):
    """Every descendant: forkserver ranks are the server's children, our grandchildren."""
    kids = set()
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                kids.update(f.read().split())
    except FileNotFoundError:  # exited meanwhile
        return set()
    return kids.union(*(_children(k) for k in kids))


def _fds():
    return len(os.listdir("/proc/self/fd"))


def _listening_ports():
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            mine.add(link[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in mine:  # 0A: LISTEN
                    ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


SRC = '''
import torch, torch.distributed as dist
from mgpu_helpers.runtime.launch import rank_device
SCALE = 10
class Box:
    def __init__(self, v):
        self.v = v
def work(rank, world_size, offset):
    t = torch.tensor([float(rank + offset)], device=rank_device())
    dist.all_reduce(t)
    return Box(t.item() * SCALE)
def fail(rank, world_size):
    if rank == world_size - 1:
        raise KeyError("spawned rank failed")
    dist.barrier()
'''


def _main_namespace(filename="<string>"):
    """Functions whose module is __main__, as a notebook cell defines them."""
    ns = {"__name__": "__main__"}
    exec(compile(SRC, filename, "exec"), ns)
    return ns


def test_results_by_rank_and_all_reduce():
    assert run_ranks(_sum_ranks, 2) == [(0, 2, 3.0), (1, 2, 3.0)]
    assert run_ranks(_sum_ranks, 3) == [(r, 3, 6.0) for r in range(3)]


def test_tensors_come_back_intact():
    out = run_ranks(_tensors, 2)
    expected = torch.arange(1_000_000, dtype=torch.float32) * 3
    for rank, r in enumerate(out):
        assert torch.equal(r["big"], expected)
        assert torch.equal(r["view"], expected[10:20:2])
        assert torch.equal(r["shared"], torch.full((3,), float(rank)))
        assert r["bf16"].dtype == torch.bfloat16 and r["bf16"].sum().item() == 4


def test_function_defined_in_main_by_exec():
    boxes = run_ranks(_main_namespace()["work"], 2, 1)
    assert [b.v for b in boxes] == [30.0, 30.0]  # (1 + 2) * SCALE
    assert type(boxes[0]).__name__ == "Box"


def test_lambda_and_closure():
    k = 5
    assert run_ranks(lambda rank, world_size: rank * k, 2) == [0, 5]
    adders = run_ranks(lambda rank, world_size: (lambda x: x + rank + k), 2)  # unpicklable by pickle
    assert [f(1) for f in adders] == [6, 7]


def test_threads_per_rank_and_device(method):
    # Forked ranks get one thread: GNU OpenMP hangs a forked child whose parent ran a parallel op. The
    # forkserver never ran one, so its ranks share the cores.
    before = torch.get_num_threads()
    torch.set_num_threads(CORES)  # a parallel op in the parent, at torch's default (conftest: xdist gives less)
    torch.ones(512, 512).sum()
    torch.set_num_threads(before)
    n = 1 if method == "fork" else max(1, CORES // 2)
    assert run_ranks(_threads, 2, backend="gloo") == [(n, "cpu")] * 2
    assert describe(2, "gloo") == f"{method}, gloo, {n} thread{'s' * (n > 1)}/rank"
    assert run_ranks(_threads, 2, backend="gloo", threads=1) == [(1, "cpu")] * 2
    if CORES >= 2 and method == "fork":
        assert describe(1, "gloo", threads=2) == "forkserver, gloo, 2 threads/rank"
        assert run_ranks(_threads, 1, backend="gloo", threads=2) == [(2, "cpu")]
    assert str(rank_device()) == "cpu"  # outside any rank


def test_backend_choice_with_fake_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("MGPU_START_METHOD", raising=False)
    assert launch._choose_backend("auto", 1) == ("nccl", "")
    backend, note = launch._choose_backend("auto", 2)
    assert backend == "gloo" and note == ("run_ranks: 2 ranks but 1 GPU(s): using gloo on CPU "
                                          "(nccl needs one GPU per rank)")
    assert launch._start_method("nccl") == "forkserver"  # nccl ranks never fork
    assert launch._start_method("gloo") == "forkserver"  # nor do any with a GPU visible
    assert describe(2) == (f"forkserver, gloo (2 ranks but 1 GPU(s): using gloo on CPU (nccl needs one GPU "
                           f"per rank)), {max(1, CORES // 2)} thread{'s' * (CORES >= 4)}/rank")
    # a CPU backend beside NCCL where asked (dcp.async_save); several ranks on the one GPU where allowed
    assert launch._choose_backend("auto", 1, cpu_backend=True) == ("cuda:nccl,cpu:gloo", "")
    assert launch._choose_backend("nccl", 1, cpu_backend=True) == ("cuda:nccl,cpu:gloo", "")
    monkeypatch.setenv("MGPU_SHARED_GPU", "1")
    assert launch._choose_backend("auto", 2) == ("cuda:gloo", "")
    assert launch._choose_backend("auto", 2, cpu_backend=True) == ("cpu:gloo,cuda:gloo", "")
    assert launch._choose_backend("gloo", 2) == ("gloo", "")  # asked for by name: the CPU
    assert launch._choose_backend("gloo", 2, cpu_backend=True) == ("gloo", "")  # gloo has its CPU backend
    assert [launch._cuda(b) for b in ("nccl", "cuda:nccl,cpu:gloo", "cuda:gloo", "gloo")] == [True] * 3 + [False]


def test_a_cuda_build_never_forks_ranks(monkeypatch):
    # torch 2.11+cu130 on the H200 host's Xeon with CUDA_VISIBLE_DEVICES="": forked ranks failed their
    # backward once the caller had run one (autograd's fork guard)
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.delenv("MGPU_START_METHOD", raising=False)
    assert launch._start_method("gloo") == "forkserver"


def test_fall_back_note_once_and_never_on_stdout(monkeypatch, capsys):
    # Compared notebook outputs must be the same on a CPU, 1 GPU and N GPUs: the note goes to warnings.
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(launch, "_noted", False)
    monkeypatch.delenv("MGPU_FALLBACK_NOTE", raising=False)  # conftest.py silences it for nbval
    monkeypatch.setenv("MGPU_START_METHOD", "fork")  # what starts the ranks does not matter here
    with pytest.warns(UserWarning, match=r"^run_ranks: 2 ranks but 1 GPU\(s\): using gloo on CPU") as said:
        assert run_ranks(_sum_ranks, 2) == [(0, 2, 3.0), (1, 2, 3.0)]
    assert len(said) == 1 and said[0].filename == __file__  # points at the caller's line
    with warnings.catch_warnings(record=True) as later:
        warnings.simplefilter("always")
        run_ranks(_sum_ranks, 2)
        run_ranks(_sum_ranks, 3)
    assert later == []  # once per process (kernel), whatever the world size
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("fn, world, error, words", [
    (_sum_ranks, 0, ValueError, "world_size=0: the number of ranks"), (_sum_ranks, -1, ValueError, "world_size=-1"),
    (_sum_ranks, 2.0, ValueError, "world_size=2.0"), (3, 2, TypeError, "the function each rank runs, got int"),
])
def test_bad_arguments_are_said_before_any_rank_starts(fn, world, error, words):
    # world_size=0 once divided by zero inside the launcher; -1 returned [] as if the ranks had run
    with pytest.raises(error, match=words):
        run_ranks(fn, world)


def test_bad_backend():
    with pytest.raises(ValueError):
        run_ranks(_sum_ranks, 2, backend="mpi")
    if torch.cuda.device_count() < 2:
        with pytest.raises(ValueError, match="one GPU per rank"):
            run_ranks(_sum_ranks, 2, backend="nccl")


def test_rank_exception_becomes_rank_error(method):
    before = _children()
    with pytest.raises(RankError) as info:
        run_ranks(_raise_on_1, 2, timeout=30)  # the peer blocks in barrier: a TimeoutError means no kill
    e = info.value
    assert e.rank == 1 and e.exitcode is None
    msg = str(e)
    assert msg.startswith("rank 1 raised ValueError: boom from rank one")
    assert "Traceback (most recent call last)" in msg and "in _raise_on_1" in msg
    assert 'raise ValueError("boom from rank one")' in msg
    assert _children() <= before


@pytest.mark.parametrize("how, expected", [("exit", "rank 1 exited with code 3"),
                                           ("kill", "rank 1 was killed by SIGKILL")])
def test_rank_dying_without_exception(method, how, expected):
    # rank 0's gloo error about its vanished peer often arrives first: it is a consequence, not blamed.
    with pytest.raises(RankError) as info:
        run_ranks(_exit_on_1, 2, how, timeout=30)
    assert info.value.rank == 1, str(info.value)
    assert str(info.value).startswith(f"{expected} without a Python exception")
    assert info.value.exitcode == (3 if how == "exit" else -signal.SIGKILL)


def test_same_error_on_every_rank_names_the_lowest():
    for _ in range(3):  # the same first line every time, whichever rank's error came first
        with pytest.raises(RankError) as info:
            run_ranks(_same_error, 3, timeout=30)
        lines = str(info.value).splitlines()
        assert lines[:2] == ["rank 0 raised ValueError: every rank gets this wrong",
                             "(ranks 0, 1, 2 failed the same way)"]
        assert info.value.rank == 0


def test_peer_that_returned_early_is_named():
    with pytest.raises(RankError) as info:
        run_ranks(_returns_early, 2, timeout=30)
    first, *rest = str(info.value).splitlines()
    assert info.value.rank == 0 and first.startswith("rank 0 raised ") and "peer" in first
    assert "(rank(s) 1 had returned while rank 0 waited for them in a collective: do all ranks make " \
           "the same collective calls?)" in rest


@pytest.mark.slow
def test_blame_under_load_200_launches():
    """The failing rank is blamed, never a peer that failed because of it, with the CPU contended."""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    wrong, hows = [], ["raise", "exit", "kill"]
    try:
        for i in range(200):
            world, how = 2 + (i % 5 == 4), hows[i % 3]
            bad = (i // 3) % world
            with pytest.raises(RankError) as info:
                run_ranks(_planted, world, bad, how, timeout=30)
            if info.value.rank != bad:
                wrong.append(f"launch {i}, {how} on rank {bad} of {world}: {str(info.value).splitlines()[0]}")
    finally:
        busy.kill()
        busy.wait()
    assert wrong == []


@pytest.mark.parametrize("in_collective, hung", [(True, "0, 1"), (False, "1")])
def test_hung_rank_times_out_saying_where(method, in_collective, hung):
    before = _children()
    with pytest.raises(TimeoutError, match=rf"^run_ranks: timed out after 3 s; rank\(s\) {hung} still running") \
            as info:
        run_ranks(_hang, 2, in_collective, timeout=3)
    e = info.value
    assert isinstance(e, RankTimeout) and e.running == [int(r) for r in hung.split(", ")]
    sleep, barrier = _line_of(_hang, "time.sleep"), _line_of(_hang, "dist.barrier")
    where = {0: f"  rank 0 was waiting in barrier (torch/distributed/distributed_c10d.py), called from _hang, "
                f"line {barrier}: dist.barrier()",
             1: f"  rank 1 was in _hang, line {sleep}: time.sleep(600)"}
    assert e.summary.splitlines()[1:] == [where[r] for r in e.running]
    assert str(e).startswith(e.summary + "\n\n--- Python stack of rank ")
    assert f'line {sleep}, in _hang\n    time.sleep(600)' in e.stacks[1]
    assert "_rank_main" not in e.stacks[1]  # the launcher's own frames are left out
    assert _children() <= before


def test_keyboard_interrupt_kills_every_child(method):
    before = _children()
    old = signal.signal(signal.SIGINT, signal.default_int_handler)  # xdist workers may ignore SIGINT
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            run_ranks(_hang, 2, True, timeout=60)
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, old)
    assert _children() <= before


@pytest.mark.parametrize("launches", [50, pytest.param(20, id="forkserver")])
def test_many_launches_leave_nothing_behind(monkeypatch, tmp_path, launches):
    if launches == 20:
        monkeypatch.setenv("MGPU_START_METHOD", "forkserver")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the rendezvous files go
    run_ranks(_sum_ranks, 2)  # warm-up: lazy imports may open files once
    kids, fds, ports = _children(), _fds(), _listening_ports()
    for i in range(launches):
        if i % 10 == 3:
            with pytest.raises(RankError):
                run_ranks(_raise_on_1, 2)
        elif i % 10 == 7:
            with pytest.raises(RankError):
                run_ranks(_exit_on_1, 2, "exit")
        else:
            assert run_ranks(_sum_ranks, 2)[1] == (1, 2, 3.0)
    assert _children() <= kids
    assert _fds() <= fds + 2
    assert _listening_ports() <= ports
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("start", ["forkserver", pytest.param("spawn", marks=pytest.mark.slow)])
def test_main_functions_shipped_by_value(monkeypatch, start):
    monkeypatch.setenv("MGPU_START_METHOD", start)
    assert describe(2, backend="gloo").startswith(f"{start}, gloo")
    filename = "<notebook-cell-7>"  # as IPython does: source only in linecache, no file on disk
    linecache.cache[filename] = (len(SRC), None, SRC.splitlines(True), filename)
    ns = _main_namespace(filename)
    assert [b.v for b in run_ranks(ns["work"], 2, 2)] == [50.0, 50.0]  # (2 + 3) * SCALE
    world = 2 if start == "forkserver" else 1  # spawning costs an interpreter and torch per rank
    with pytest.raises(RankError, match=f"rank {world - 1} raised KeyError") as info:
        run_ranks(ns["fail"], world, timeout=60)
    assert filename in str(info.value) and 'raise KeyError("spawned rank failed")' in str(info.value)


SLOW_START = '''
import time
def restore(seconds):
    time.sleep(seconds)  # what a rank's imports of the caller's modules cost under load
    return seconds
class SlowToUnpickle:
    def __reduce__(self):
        return (restore, (3.0,))
def took(rank, world_size, seconds):
    return seconds
'''


def test_timeout_counts_from_when_the_ranks_started(monkeypatch):
    """A rank's start (imports, unpickling its job: 15+ s for dynamo under load on the H200 host) is not its
    time: a 1.5 s timeout holds for ranks that took 3 s to start, and still fires for a rank that hangs."""
    monkeypatch.setenv("MGPU_START_METHOD", "forkserver")
    ns = {"__name__": "__main__"}
    exec(compile(SLOW_START, "<slow-start>", "exec"), ns)
    assert run_ranks(ns["took"], 2, ns["SlowToUnpickle"](), timeout=1.5) == [3.0, 3.0]
    with pytest.raises(TimeoutError, match="timed out after 1.5 s; rank"):
        run_ranks(_sleep_forever, 2, timeout=1.5)


def _sleep_forever(rank, world_size):
    time.sleep(3600)


def test_forkserver_imports_module_functions(monkeypatch):
    monkeypatch.setenv("MGPU_START_METHOD", "forkserver")
    assert run_ranks(launch._demo, 2) == ["all_reduce sum over 2 ranks: 3"] * 2  # by reference, not by value


NOTEBOOK_CELLS = [
    "import sys; print(sys.executable)",
    """import torch, torch.distributed as dist
from mgpu_helpers.runtime.launch import run_ranks, rank_device
def work(rank, world_size):
    t = torch.ones(1, device=rank_device()) * (rank + 1)
    dist.all_reduce(t)
    return t.item()
print(run_ranks(work, 2))""",
    """def bad(rank, world_size):
    if rank == 1:
        raise ValueError("boom from the notebook")
    dist.barrier()
run_ranks(bad, 2, timeout=60)""",
    """import time
def hang(rank, world_size):
    if rank == 0:
        time.sleep(600)
    dist.barrier()
run_ranks(hang, 2, timeout=3)""",
    "import multiprocessing; print(len(multiprocessing.active_children()))",
    # The forkserver, as on a GPU machine: notebook functions by value, tracebacks with the cell's source.
    """import os, time
os.environ["MGPU_START_METHOD"] = "forkserver"
t0 = time.perf_counter(); first = run_ranks(work, 2); t1 = time.perf_counter(); later = run_ranks(work, 2)
print(first, later, f"{t1 - t0:.2f} s then {time.perf_counter() - t1:.2f} s")
try:
    run_ranks(bad, 2, timeout=60)
finally:
    del os.environ["MGPU_START_METHOD"]""",
]


@pytest.mark.slow
def test_through_a_real_kernel():
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in NOTEBOOK_CELLS])
    nbclient.NotebookClient(nb, kernel_name="python3", timeout=120, allow_errors=True,
                            resources={"metadata": {"path": str(REPO)}}).execute()
    outs = [c.outputs for c in nb.cells]

    def text(i):
        return "".join(o.get("text", "") for o in outs[i] if o.output_type == "stream")

    def error(i):
        (err,) = [o for o in outs[i] if o.output_type == "error"]
        return err.ename, err.evalue

    # The "python3" kernel must be this venv's interpreter (`make` installs the kernelspec into it).
    assert os.path.realpath(text(0).strip()) == os.path.realpath(sys.executable)
    assert text(1) == "[3.0, 3.0]\n"
    assert not [o for o in outs[1] if o.get("name") == "stderr"]  # ranks print no warnings
    ename, evalue = error(2)
    assert ename == "RankError" and evalue.startswith("rank 1 raised ValueError: boom from the notebook")
    assert 'raise ValueError("boom from the notebook")' in evalue
    ename, evalue = error(3)
    assert ename == "RankTimeout" and evalue.startswith(
        "run_ranks: timed out after 3 s; rank(s) 0, 1 still running (killed)\n"
        "  rank 0 was in hang, line 4: time.sleep(600)\n"
        "  rank 1 was waiting in barrier (torch/distributed/distributed_c10d.py), called from hang, line 5: "
        "dist.barrier()\n\n")
    assert text(4) == "0\n"
    assert text(5).startswith("[3.0, 3.0] [3.0, 3.0] "), text(5)
    print("forkserver in a kernel:", text(5))
    ename, evalue = error(5)
    assert ename == "RankError" and 'raise ValueError("boom from the notebook")' in evalue


@pytest.mark.slow
def test_torchrun_runs_the_module_demo():
    proc = run_torchrun("mgpu_helpers.runtime.launch", timeout=240)
    assert proc.stdout.count("all_reduce sum over 2 ranks: 3\n") == 1  # printed by rank 0 only
