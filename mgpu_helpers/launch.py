"""Run ``fn(rank, world_size, *args)`` on N processes from a notebook cell, or as a torchrun script.

    import torch, torch.distributed as dist
    from mgpu_helpers.launch import run_ranks, rank_device
    def work(rank, world_size):
        t = torch.ones(2, device=rank_device()) * (rank + 1)
        dist.all_reduce(t)                      # the process group is already set up
        return t.cpu()
    run_ranks(work, 2)                          # -> [tensor([3., 3.]), tensor([3., 3.])]

As a script, ``torchrun_main(work)`` runs it under ``torchrun --nproc-per-node 2 -m my.module`` (try
``torchrun --nproc-per-node 2 --standalone -m mgpu_helpers.launch``). ``describe(2)`` says how 2 ranks
would start. A rank that raises becomes ``RankError`` here, with its traceback; a launch outliving
``timeout`` s raises ``TimeoutError``; every way out (Ctrl-C too) kills and joins every child.
"""
import datetime, io, linecache, multiprocessing as mp, os, pickle, signal  # noqa: E401
import sys
import tempfile
import time
import traceback
import types
import warnings
from collections import ChainMap
from multiprocessing.connection import wait

import cloudpickle
import torch
import torch.distributed as dist

__all__ = ["run_ranks", "rank_device", "torchrun_main", "RankError", "describe"]

_device = None  # the device of the rank this process runs; None in the caller


class RankError(RuntimeError):
    """A rank failed: ``rank``, ``exitcode`` (None if it raised) and ``traceback`` (text) say how."""
    def __init__(self, message, rank, exitcode=None, traceback=""):
        super().__init__(message)
        self.rank, self.exitcode, self.traceback = rank, exitcode, traceback


def _cores():
    # Affinity, not cpu_count(): containers and taskset often grant fewer cores than the host has.
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _choose_backend(backend, ranks_here, who="run_ranks"):
    """(backend, note): note is one line explaining a fall-back from GPUs to gloo/CPU, else ''."""
    # device_count() asks NVML while CUDA is uninitialised, whereas torch.cuda.is_available() calls
    # cudaGetDeviceCount, which "poisons" fork: children forked afterwards cannot use CUDA.
    gpus = torch.cuda.device_count()  # 0 on CPU-only builds
    if backend == "auto":
        if gpus >= ranks_here:
            return "nccl", ""
        return "gloo", (f"{who}: {ranks_here} ranks but {gpus} GPU(s): using gloo on CPU "
                        "(nccl needs one GPU per rank)") if gpus else ""
    if backend not in ("gloo", "nccl") or (backend == "nccl" and gpus < ranks_here):
        raise ValueError(f"backend={backend!r}: use 'auto', 'gloo', or 'nccl' with one GPU per rank "
                         f"({ranks_here} ranks, {gpus} GPU(s))")
    return backend, ""


def _start_method(backend, threads=None):
    # Fork starts 2 ranks in 0.1 s, spawn in 2.3 s (FACTS.md), and ranks see notebook globals. But forked
    # children can't use CUDA once the parent asked for it, nor run backward once a CUDA build's autograd
    # started per-GPU threads (H200): no fork with a GPU. GNU OpenMP hangs a forked child's first parallel
    # op if the parent ran one: forked ranks get 1 thread; more threads means spawn.
    if os.environ.get("MGPU_START_METHOD"):  # tests, debugging
        return os.environ["MGPU_START_METHOD"]
    fork_ok = (sys.platform.startswith("linux") and backend == "gloo" and not torch.cuda.is_initialized()
               and torch.cuda.device_count() == 0 and (threads or 1) == 1)
    return "fork" if fork_ok else "spawn"


def _threads(method, world_size, threads):
    return threads or (1 if method == "fork" else max(1, _cores() // world_size))


def describe(world_size=2, backend="auto", threads=None):
    """How ``run_ranks(fn, world_size)`` would start, e.g. 'fork, gloo, 1 thread/rank'."""
    backend, _ = _choose_backend(backend, world_size)
    method = _start_method(backend, threads)
    n = _threads(method, world_size, threads)
    return f"{method}, {backend}, {n} thread{'s' * (n > 1)}/rank"


def rank_device():
    """This rank's device: cuda:LOCAL_RANK under nccl, else cpu (also outside any rank)."""
    if _device is not None:
        return _device
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _setup_rank(local_rank, backend, threads):
    global _device
    _device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(local_rank)  # before anything touches CUDA, else every rank uses GPU 0
    torch.set_num_threads(threads) if threads else None  # all cores per rank: 4x slower (FACTS.md)


class _JobPickler(cloudpickle.Pickler):
    # cloudpickle blanks code objects' file names to '<dynamic-code>'; keep them (and ship the source
    # lines, see _ship) so that a spawned rank's traceback shows file, line and code as a forked one's.
    files = set()
    def _code(code):
        make, fields = cloudpickle.cloudpickle._code_reduce(code)
        _JobPickler.files.add(code.co_filename)
        return make, tuple(code.co_filename if f == "<dynamic-code>" else f for f in fields)
    dispatch_table = ChainMap({types.CodeType: _code}, cloudpickle.Pickler.dispatch_table)


def _ship(fn, args):
    """fn and args by value: plain pickle names notebook functions __main__.fn, unknown to a new process."""
    buf, _JobPickler.files = io.BytesIO(), set()
    try:
        _JobPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump((fn, args))
    except AttributeError:  # cloudpickle < 3 lacks _code_reduce: tracebacks then show no source
        buf = io.BytesIO(cloudpickle.dumps((fn, args)))
    return pickle.dumps((buf.getvalue(), {f: linecache.getlines(f) for f in _JobPickler.files}))


def _rank_main(rank, world_size, store_path, backend, threads, pg_timeout, conn, job, parent_pid):
    """One rank: set up, run fn, send ("ok", pickled result) or ("err", time, summary, traceback)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the caller's to handle: it kills us
    if sys.platform.startswith("linux"):
        # Die with the caller (a kernel restart SIGKILLs it): else a rank blocked in a collective would
        # outlive it until the process-group timeout. 1 = PR_SET_PDEATHSIG.
        __import__("ctypes").CDLL(None).prctl(1, signal.SIGKILL)
        os._exit(1) if os.getppid() != parent_pid else None  # the caller died before prctl took effect
    try:
        _setup_rank(rank, backend, threads)  # first: unpickling CUDA tensors in args touches CUDA
        if isinstance(job, bytes):  # spawned: see _ship
            payload, sources = pickle.loads(job)
            for f, lines in sources.items():
                linecache.cache.setdefault(f, (sum(map(len, lines)), None, lines, f))
            job = pickle.loads(payload)
        fn, args = job
        timeout, store = datetime.timedelta(seconds=pg_timeout), dist.FileStore(store_path, world_size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        # Wait until every rank's init returned: a rank whose fn did no collective could otherwise exit
        # while a peer was still connecting to it (gloo "Connection closed by peer", 1 launch in 5).
        store.set(f"mgpu/ready/{rank}", "1")
        store.wait([f"mgpu/ready/{r}" for r in range(world_size)], timeout)
        result = fn(rank, world_size, *args)
        if dist.is_initialized():
            dist.destroy_process_group()
        # Plain pickle, not the pipe's ForkingPickler: torch registers reducers there that put tensors
        # in shared memory owned by this process, gone once it exits; plain pickle copies the bytes.
        # cloudpickle takes what plain pickle refuses (lambdas, classes made inside fn).
        try:
            msg = ("ok", pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL))
        except Exception:
            msg = ("ok", cloudpickle.dumps(result))
    except BaseException as e:  # SystemExit and KeyboardInterrupt too: the caller must hear of them
        # Sent before anything is torn down, so it precedes the errors this rank's death causes in its
        # peers; the timestamp (CLOCK_MONOTONIC, system-wide) orders errors that arrive together.
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__.tb_next))
        msg = ("err", time.monotonic(), f"{type(e).__name__}: {e}", tb)
    conn.send_bytes(pickle.dumps(msg))
    conn.close()


def run_ranks(fn, world_size, *args, backend="auto", timeout=120.0, threads=None):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return their results by rank.

    The process group is initialised before ``fn`` and destroyed after it. ``backend='auto'`` picks nccl
    when there is a GPU per rank, else gloo on CPU. Each rank gets ``threads`` torch threads (default:
    1 for forked ranks, else cores // world_size). Raises RankError if a rank fails, TimeoutError after ``timeout`` s.
    """
    backend, note = _choose_backend(backend, world_size)
    if note:
        print(note)
    method = _start_method(backend, threads)
    ctx = mp.get_context(method)
    threads = _threads(method, world_size, threads)
    job = (fn, args) if method == "fork" else _ship(fn, args)  # forked ranks inherit fn and args
    # The ranks' group times out after the launch does, so our TimeoutError names the hung ranks
    # first; theirs is a backstop (gloo's default, 30 minutes, kept orphans alive).
    pg_timeout = (timeout if timeout is not None else 1800) + 5
    deadline = None if timeout is None else time.monotonic() + timeout
    # Rendezvous through a FileStore in a fresh temp file: no port to choose, hence none to race for,
    # and nothing listens here. A TCPStore here (port 0) was dropped: in 1 launch in 15 its server never
    # answered a rank's handshake (libuv and legacy backends alike), hanging the launch.
    fd, store_path = tempfile.mkstemp(prefix="mgpu-rdzv-")
    os.close(fd)
    procs, conns = [], []
    try:
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            procs.append(ctx.Process(target=_rank_main, name=f"rank{rank}", args=(
                rank, world_size, store_path, backend, threads, pg_timeout, writer, job, os.getpid())))
            conns.append(reader)
            with warnings.catch_warnings():  # Python >= 3.12 warns on any fork of a threaded kernel
                warnings.filterwarnings("ignore", message=".*fork.*", category=DeprecationWarning)
                procs[-1].start()
            writer.close()  # now only the child holds it, so the child's exit shows as EOF on reader
        return _collect(procs, conns, timeout, deadline)
    finally:
        for p in procs:
            if p.pid is not None and p.exitcode is None:
                p.kill()  # SIGKILL: a rank blocked in gloo/NCCL C++ code may not honour SIGTERM
        for p in procs:
            if p.pid is not None:
                p.join()
            p.close()
        for c in conns:
            c.close()
        if os.path.exists(store_path):  # the last rank to close the store deletes it, unless one failed
            os.unlink(store_path)


def _collect(procs, conns, timeout, deadline):
    results, pending = [None] * len(procs), set(range(len(procs)))
    while pending:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise TimeoutError(f"run_ranks: timed out after {timeout:g} s; rank(s) "
                               f"{', '.join(map(str, sorted(pending)))} still running (killed)")
        waits = {**{conns[r]: r for r in pending}, **{procs[r].sentinel: r for r in pending}}
        for r in sorted({waits[obj] for obj in wait(list(waits), timeout=left)}):
            got = _receive(procs[r], conns[r])  # None: a spurious wake-up
            if got is not None and got[0] != "ok":
                _raise_failure(procs, conns, pending, r, got)
            elif got is not None:
                results[r] = pickle.loads(got[1])
                pending.discard(r)
    for p in procs:  # all reported: let them exit on their own before `finally` kills stragglers
        p.join(5)
    return results


def _receive(proc, conn):
    """A rank's message, ("died", exitcode) if it exited without one, None while it runs silently."""
    if conn.poll():
        try:
            return pickle.loads(conn.recv_bytes())
        except EOFError:
            pass
    elif proc.exitcode is None:
        return None
    proc.join(5)  # EOF: the process is exiting; wait for its exit code
    return ("died", proc.exitcode)


def _raise_failure(procs, conns, pending, first, got):
    # More ranks may have failed by now, most because a peer vanished. Blame a rank that died without a
    # Python error (ranks catch every exception, so a death is never a consequence), else the earliest.
    failures = {first: got}
    for r in sorted(pending - {first}):
        other = _receive(procs[r], conns[r])
        if other is not None and other[0] != "ok":
            failures[r] = other
    died = [r for r, f in failures.items() if f[0] == "died"]
    rank = died[0] if died else min(failures, key=lambda r: failures[r][1])
    also = ", ".join(map(str, sorted(set(failures) - {rank})))
    also = f" (rank(s) {also} failed after it)" if also else ""
    f = failures[rank]
    if f[0] == "died":
        how = f"was killed by {signal.Signals(-f[1]).name}" if (f[1] or 0) < 0 else f"exited with code {f[1]}"
        raise RankError(f"rank {rank} {how} without a Python exception (os._exit, a crash or a kill)"
                        f"{also}", rank, exitcode=f[1])
    raise RankError(f"rank {rank} raised {f[2]}{also}\n\n--- traceback of rank {rank} ---\n{f[3]}",
                    rank, traceback=f[3])


def torchrun_main(fn, *args, backend="auto", timeout=300.0):
    """Run ``fn(rank, world_size, *args)`` in a process started by torchrun (env:// rendezvous from
    RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT; device from LOCAL_RANK, so multi-node works); print rank 0's
    result, destroy the group, return the result. Threads: torchrun sets OMP_NUM_THREADS=1 unless set.
    """
    rank, world_size, local_rank = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    backend, note = _choose_backend(backend, int(os.environ["LOCAL_WORLD_SIZE"]), "torchrun_main")
    if note and rank == 0:
        print(note)
    _setup_rank(local_rank, backend, threads=None)
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout))
    try:
        result = fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group() if dist.is_initialized() else None
    print(result, flush=True) if rank == 0 else None
    return result


def _demo(rank, world_size):
    t = torch.tensor([rank + 1.0], device=rank_device())
    dist.all_reduce(t)
    return f"all_reduce sum over {world_size} ranks: {t.item():g}"


if __name__ == "__main__":  # under torchrun (see the module docstring), or plain `python -m`
    torchrun_main(_demo) if "RANK" in os.environ else print(run_ranks(_demo, 2)[0])
