"""Run ``fn(rank, world_size, *args)`` on N processes from a notebook cell, or as a torchrun script.

    def work(rank, world_size):
        t = torch.ones(2, device=rank_device()) * (rank + 1)
        dist.all_reduce(t)                      # the process group is already set up
        return t.cpu()
    run_ranks(work, 2)                          # -> [tensor([3., 3.]), tensor([3., 3.])]

``torchrun_main(work)`` runs it under ``torchrun --nproc-per-node 2 -m my.module``; try
``torchrun --nproc-per-node 2 --standalone -m mgpu_helpers.runtime.launch``. A failure raises ``RankError``, a
hang ``RankTimeout`` (launch_watch.py); every way out, Ctrl-C too, kills and joins every child.
``backend="auto"`` (see ``describe(2)``): NCCL with one GPU per rank (no CPU backend: results go back as Python
values or ``.cpu()`` tensors), else gloo on the CPU under ``contract.py``, which refuses what NCCL would.
``cpu_backend=True`` adds "cpu:gloo" beside NCCL (as torchtitan does) for ``dcp.async_save``; ``dist.get_backend()``
then returns the whole string: ask ``rank_device()`` for the device.
"""
import contextlib
import datetime
import faulthandler
import io
import linecache
import multiprocessing as mp
import os
import pathlib
import pickle
import signal
import sys
import tempfile
import threading
import time
import traceback
import types
import warnings
from collections import ChainMap

import cloudpickle
import torch
import torch.distributed as dist

from . import contract
from .launch_watch import DUMP_SIGNAL, RankError, RankTimeout, collect

_device = None  # the device of the rank this process runs; None in the caller
_noted = False  # whether this process has said that it falls back from GPUs to gloo


def _choose_backend(backend, ranks_here, who="run_ranks", cpu_backend=False):
    """(what init_process_group is given, one line saying why GPUs fell back to gloo on CPU, or '')."""
    # device_count() asks NVML; torch.cuda.is_available() would call cudaGetDeviceCount, which poisons fork.
    gpus = torch.cuda.device_count()  # 0 on CPU-only builds
    nccl = "cuda:nccl,cpu:gloo" if cpu_backend else "nccl"
    if backend == "auto":
        if gpus >= ranks_here:
            return nccl, ""
        if gpus and os.environ.get("MGPU_SHARED_GPU") == "1":  # tests on one GPU (send/recv, DTensor fail there)
            return "cpu:gloo,cuda:gloo" if cpu_backend else "cuda:gloo", ""
        return "gloo", (f"{who}: {ranks_here} ranks but {gpus} GPU(s): using gloo on CPU "
                        "(nccl needs one GPU per rank)") if gpus else ""
    if backend not in ("gloo", "nccl") or (backend == "nccl" and gpus < ranks_here):
        raise ValueError(f"backend={backend!r}: use 'auto', 'gloo', or 'nccl' with one GPU per rank "
                         f"({ranks_here} ranks, {gpus} GPU(s))")
    return nccl if backend == "nccl" else "gloo", ""


def _cuda(backend):
    """Whether ranks initialised with ``backend`` (what _choose_backend returned) compute on a GPU."""
    return backend == "nccl" or "cuda:" in backend


def _note(note):
    # Once per process, on stderr (stdout is the same on CPU, 1 and N GPUs); MGPU_FALLBACK_NOTE=0 for nbval.
    global _noted
    if note and not _noted and os.environ.get("MGPU_FALLBACK_NOTE", "1") != "0":
        _noted = True
        warnings.warn(note + " (said once)", stacklevel=3)


def _start_method(backend, threads=None):
    # Forked children can't use CUDA once the parent did, nor run backward once a CUDA build's autograd started
    # its threads, and GNU OpenMP hangs a forked child's first parallel op if the parent ran one: fork only on a
    # CPU build, 1 thread per rank. Otherwise a forkserver (torch imported, CUDA never touched): faster than spawn.
    if os.environ.get("MGPU_START_METHOD"):  # tests, debugging: fork, forkserver or spawn
        return os.environ["MGPU_START_METHOD"]
    if not sys.platform.startswith("linux"):
        return "spawn"  # macOS: fork and forkserver children may crash in system frameworks
    fork_ok = (backend == "gloo" and not torch.backends.cuda.is_built() and not torch.cuda.is_initialized()
               and torch.cuda.device_count() == 0 and (threads or 1) == 1)
    return "fork" if fork_ok else "forkserver"


def _context(method):
    ctx = mp.get_context(method)
    if method == "forkserver":  # what the server imports once (no effect once it runs)
        # A child re-runs the caller's __main__ by name (bar `python -m pkg`); ranks import what the server lacks.
        main = getattr(sys.modules["__main__"].__spec__, "name", None)
        extra = [main] if main and not main.endswith("__main__") else []
        extra += sorted(m for m in sys.modules if m.startswith("mgpu_helpers.")) + _RANK_MODULES
        ctx.set_forkserver_preload(["torch", "torch.distributed", "cloudpickle", __name__] + extra)
    return ctx


# Imported once by the forkserver: torch's distributed parts and the course's modules bar tooling and references.
_ROOT = pathlib.Path(__file__).parents[1]
_RANK_MODULES = ["torch._dynamo", "torch.nn.parallel", "torch.distributed.optim", "torch.distributed.fsdp",
                 "torch.distributed.tensor", "torch.distributed.tensor.parallel", "torch.utils.checkpoint",
                 "torch.utils.data"] + sorted(
    ".".join((_ROOT.name, *p.relative_to(_ROOT).with_suffix("").parts)).removesuffix(".__init__")
    for p in _ROOT.rglob("*.py") if not {"tools", "references", "__main__.py"} & set(p.relative_to(_ROOT).parts))


@contextlib.contextmanager
def _interrupt_deferred():
    """Hold Ctrl-C while ranks start (inside Process.start() it would orphan a rank of unknown pid). The handler
    is swapped, not the signal mask: a kernel's other threads would take the SIGINT and still raise here."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = []
    old = signal.signal(signal.SIGINT, lambda *a: held.append(a))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
        if held and callable(old):
            old(*held[0])


def _plan(world_size, backend, threads, cpu_backend=False):
    """(what init_process_group is given, fall-back note, start method, torch threads per rank)."""
    backend, note = _choose_backend(backend, world_size, cpu_backend=cpu_backend)
    method = _start_method(backend, threads)
    return backend, note, method, threads or (1 if method == "fork" else max(1, _cores() // world_size))


def _cores():
    # Affinity, not cpu_count(): containers and taskset often grant fewer cores than the host has.
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def describe(world_size=2, backend="auto", threads=None):
    """How ``run_ranks(fn, world_size)`` would start, e.g. 'fork, gloo, 1 thread/rank'."""
    backend, note, method, n = _plan(world_size, backend, threads)
    why = f" ({note.split(': ', 1)[1]})" if note else ""
    return f"{method}, {backend}{why}, {n} thread{'s' * (n > 1)}/rank"


def rank_device():
    """This rank's device: its GPU under NCCL (or "cuda:gloo"), else cpu (also outside any rank)."""
    if _device is not None:
        return _device
    if dist.is_available() and dist.is_initialized() and _cuda(str(dist.get_backend())):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _setup_rank(local_rank, backend, threads, cpu_backend=False):
    global _device
    if _cuda(backend):  # before anything touches CUDA; "cuda:gloo" (MGPU_SHARED_GPU=1): every rank on GPU 0
        _device = torch.device("cuda", 0 if "cuda:gloo" in backend else local_rank)
        torch.cuda.set_device(_device)
    else:
        _device = torch.device("cpu")
        contract.enable(cpu_backend)  # gloo on the CPU: refuse what NCCL would (contract.py)
    torch.set_num_threads(threads) if threads else None  # not all cores in every rank: they would contend


class _JobPickler(cloudpickle.Pickler):
    # cloudpickle blanks code objects' file names; keep them (and ship their lines): tracebacks as when forked.
    files = set()
    def _code(code):
        make, fields = cloudpickle.cloudpickle._code_reduce(code)
        _JobPickler.files.add(code.co_filename)
        return make, tuple(code.co_filename if f == "<dynamic-code>" else f for f in fields)
    dispatch_table = ChainMap({types.CodeType: _code}, cloudpickle.Pickler.dispatch_table)


def _ship(fn, args):
    """fn and args by value: plain pickle names notebook functions __main__.fn, unknown to a new process."""
    buf, _JobPickler.files = io.BytesIO(), set()
    _JobPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump((fn, args))
    return pickle.dumps((buf.getvalue(), {f: linecache.getlines(f) for f in _JobPickler.files}))


def _rank_main(rank, world_size, store_path, backend, threads, pg_timeout, conn, dump, job, parent_pid,
               cpu_backend=False):
    """One rank: set up, run fn, send its result or its error (launch_watch.collect reads them)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the caller's to handle: it kills us
    faulthandler.register(DUMP_SIGNAL, file=dump.fileno(), all_threads=True)  # a RankTimeout asks for our stack
    if sys.platform.startswith("linux"):
        # Die with our parent (caller or forkserver), or a rank blocked in a collective outlives a killed kernel.
        __import__("ctypes").CDLL(None).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
        if parent_pid is not None and os.getppid() != parent_pid:
            os._exit(1)  # the caller died before prctl took effect
    try:
        _setup_rank(rank, backend, threads, cpu_backend)  # first: unpickling CUDA tensors in args touches CUDA
        if isinstance(job, bytes):  # not forked from the caller: see _ship
            payload, sources = pickle.loads(job)
            for f, lines in sources.items():
                linecache.cache.setdefault(f, (sum(map(len, lines)), None, lines, f))
            job = pickle.loads(payload)
        fn, args = job
        for i, arg in enumerate(args):  # the caller's tensors, on the CPU on every machine (contract.py)
            contract.mark_host(arg, f"the caller: argument {i + 3} of run_ranks")
        conn.send_bytes(pickle.dumps({"kind": "go"}))  # imports done: the caller's timeout starts when all said so
        timeout, store = datetime.timedelta(seconds=pg_timeout), dist.FileStore(store_path, world_size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        # Every rank's init returns first: one with no collective could exit while a peer still connects (gloo).
        store.set(f"mgpu/ready/{rank}", "1")
        store.wait([f"mgpu/ready/{r}" for r in range(world_size)], timeout)
        result = fn(rank, world_size, *args)
        if dist.is_initialized():
            dist.destroy_process_group()
        # Plain pickle copies tensors' bytes (ForkingPickler would share memory that dies with us); cloudpickle
        # takes what it refuses (lambdas, classes made inside fn).
        try:
            msg = {"kind": "ok", "result": pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)}
        except Exception:
            msg = {"kind": "ok", "result": cloudpickle.dumps(result)}
    except BaseException as e:  # SystemExit and KeyboardInterrupt too: the caller must hear of them
        # Sent before anything is torn down; the time (CLOCK_MONOTONIC, system-wide) orders errors (launch_watch).
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__.tb_next))
        msg = {"kind": "err", "time": time.monotonic(), "what": f"{type(e).__name__}: {e}", "traceback": tb}
    conn.send_bytes(pickle.dumps(msg))
    conn.close()


def run_ranks(fn, world_size, *args, backend="auto", timeout=120.0, threads=None, cpu_backend=False):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return their results by rank. ``threads``
    per rank: 1 if forked, else cores // world_size. Raises RankError, or RankTimeout after ``timeout`` s."""
    if not callable(fn):
        raise TypeError(f"run_ranks: the first argument must be the function each rank runs, got "
                        f"{type(fn).__name__}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"run_ranks: world_size={world_size!r}: the number of ranks, an int >= 1")
    backend, note, method, threads = _plan(world_size, backend, threads, cpu_backend)
    _note(note)
    ctx = _context(method)
    job = (fn, args) if method == "fork" else _ship(fn, args)  # forked ranks inherit fn and args
    pg_timeout = (timeout if timeout is not None else 1800) + 5  # after ours: RankTimeout names the hung ranks
    # A FileStore in a fresh temp file: no port to race for (a TCPStore on port 0 sometimes never answered).
    fd, store_path = tempfile.mkstemp(prefix="mgpu-rdzv-")
    os.close(fd)
    procs, conns, dumps = [], [], []
    parent = None if method == "forkserver" else os.getpid()  # forkserver: the server is the parent
    try:
        with _interrupt_deferred(), warnings.catch_warnings():
            # Python >= 3.12 warns on any fork of a threaded kernel
            warnings.filterwarnings("ignore", message=".*fork.*", category=DeprecationWarning)
            for rank in range(world_size):
                (reader, writer), (dump_reader, dump_writer) = ctx.Pipe(duplex=False), ctx.Pipe(duplex=False)
                conns.append(reader)
                dumps.append(dump_reader)
                procs.append(ctx.Process(target=_rank_main, name=f"rank{rank}", args=(
                    rank, world_size, store_path, backend, threads, pg_timeout, writer, dump_writer, job, parent,
                    cpu_backend)))
                procs[-1].start()
                writer.close()  # now only the child holds it, so the child's exit shows as EOF on reader
                dump_writer.close()
        return collect(procs, conns, dumps, timeout)
    finally:
        for p in procs:
            if p.pid is not None and p.exitcode is None:
                p.kill()  # SIGKILL: a rank blocked in gloo/NCCL C++ code may not honour SIGTERM
        for p in procs:
            if p.pid is not None:
                p.join()
            p.close()
        for c in conns + dumps:
            c.close()
        pathlib.Path(store_path).unlink(missing_ok=True)  # the last rank to close it deletes it, unless one failed


def torchrun_main(fn):
    """Run ``fn(rank, world_size)`` in a torchrun process (device from LOCAL_RANK: multi-node works); rank 0 prints."""
    rank, world_size, local_rank = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    backend, note = _choose_backend("auto", int(os.environ["LOCAL_WORLD_SIZE"]), "torchrun_main")
    if rank == 0:
        _note(note)
    _setup_rank(local_rank, backend, None)  # threads: torchrun sets OMP_NUM_THREADS=1
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=300))
    try:
        result = fn(rank, world_size)
        dist.barrier()  # no rank tears its group down while a peer still talks to it (gloo aborted under load)
    finally:
        dist.destroy_process_group() if dist.is_initialized() else None
    print(result, flush=True) if rank == 0 else None
    return result


def script_args(doc: str, *, add=None):
    """Parse a course script's command line: ``--help`` prints ``doc``; ``add(parser)`` adds its own arguments."""
    import argparse
    name = getattr(sys.modules["__main__"].__spec__, "name", None) or "script"
    parser = argparse.ArgumentParser(prog=f"python -m {name.removesuffix('.__main__')}", description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    if add is not None:
        add(parser)
    return parser.parse_args()


def _demo(rank, world_size):
    t = torch.tensor([rank + 1.0], device=rank_device())
    dist.all_reduce(t)
    return f"all_reduce sum over {world_size} ranks: {t.item():g}"


if __name__ == "__main__":  # under torchrun (see the module docstring), or plain `python -m`
    script_args(__doc__)
    torchrun_main(_demo) if "RANK" in os.environ else print(run_ranks(_demo, 2)[0])
