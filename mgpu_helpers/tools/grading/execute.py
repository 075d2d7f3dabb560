"""Grader side of execution: pick the sandbox, write one job, run it, read back what it produced.

A job directory holds ``job.json`` (limits, the paths the kernel may see), the assembled notebook
and ``mgpu_grade_in.pt`` (the harvest's seeds and hidden cases). ``sandbox.py`` runs it and writes
``sandbox.json`` (per-cell records) and the harvested ``mgpu_grade_out_<id>.pt`` files next to them.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

from .sandbox import UID_BASE

NS_WORK = "/tmp/mgpu-grade/work"  # the notebook's directory inside the sandbox (sandbox.ROOT + /work)
UNSHARE = ["--mount", "--pid", "--kill-child", "--propagation", "private"]
ENV_KEEP = ("PATH", "LANG", "LANGUAGE", "TZ", "PYTHONPATH", "VIRTUAL_ENV", "CONDA_PREFIX", "LD_LIBRARY_PATH")
# GPU, NCCL and threading settings must reach the kernel (e.g. NCCL_NVLS_ENABLE=0 on shared GPU hosts).
ENV_KEEP_PREFIXES = ("LC_", "CUDA_", "NCCL_", "NVIDIA_", "NVSHMEM_", "TORCH_", "PYTORCH_", "OMP_", "MKL_", "OPENBLAS_")
_probed = None  # sandbox()'s Isolation
RUNNING: set = set()  # live sandbox processes, killed by the CLI on Ctrl-C
STOP = threading.Event()  # set on Ctrl-C: no new sandbox starts


@dataclass
class Limits:
    cell_timeout: float = 120.0
    notebook_timeout: float = 900.0
    memory: int = 8 * 2**30          # RLIMIT_AS of nbval and the kernel, bytes
    output_cap: int = 1 * 2**20      # bytes of output per cell
    output_cap_total: int = 8 * 2**20
    processes: int = 0               # RLIMIT_NPROC (processes + threads) of one sandbox


def default_processes() -> int:
    """Room for the kernel, nbval and a few ranks with a thread per core each; a fork bomb stops there."""
    return 256 + 16 * (os.cpu_count() or 1)


class Isolation(NamedTuple):
    prefix: list[str] | None  # the unshare command's prefix; None: no namespaces
    net: bool                 # a network namespace too
    why: str                  # why no namespaces
    bounded: bool             # the probe saw RLIMIT_NPROC hold a process of the kernel's kind (False: warn)
    setuid: bool              # the kernel runs as a user of its own (root without a user namespace: sandbox.py)

    @property
    def own_user(self) -> bool:
        """No namespaces, but root: the kernel can read only what every user can (the grader checks that the
        protected paths are not among them)."""
        return self.prefix is None and self.setuid


def sandbox(disable: bool = False, user_only: bool = False) -> Isolation:
    """What isolates learner code here, probed once per process. ``user_only``: skip the namespaces, as on a
    host that refuses them (to test and show that mode anywhere root runs the grader)."""
    global _probed
    if disable or user_only:
        _probed = (_without_namespaces("namespaces not used (--isolation user)") if user_only
                   else Isolation(None, False, "sandbox disabled with --no-sandbox", False, False))
    if _probed is None:
        _probed = _probe()
    return _probed


def reset_sandbox() -> None:
    global _probed
    _probed = None


def _without_namespaces(why: str) -> Isolation:
    """Where namespaces are not used: the kernel's own user if root can run it, else none."""
    user = _own_user_works()
    return Isolation(None, False, why + (f"; {user}" if user else ""), not user, not user)


def _own_user_works() -> str:
    """"" when root can start python as an unused unprivileged user and it imports the sandbox (the interpreter
    and the environment are readable by every user); else why not."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "not root"
    try:
        r = _as_kernel_user(["-c", "import mgpu_helpers.tools.grading.sandbox"], env=kernel_env([]))
    except (OSError, subprocess.SubprocessError) as e:
        return f"another user cannot run {sys.executable}: {e}"
    tail = (r.stderr.decode("utf-8", "replace").strip().splitlines() or [""])[-1]
    return "" if r.returncode == 0 else f"another user cannot import the package: {tail}"


def _as_kernel_user(args: list[str], **kw):
    """``python args`` as the kernel's own user would run (own_user mode): an unused unprivileged uid."""
    uid = UID_BASE + os.getpid()
    return subprocess.run([sys.executable, *args], user=uid, group=uid, extra_groups=[], capture_output=True,
                          timeout=60, cwd="/", **kw)


def readable_by_kernel(paths: list[str]) -> list[str]:
    """Which of ``paths`` the kernel's own user (own_user mode) can open: each must be none."""
    code = "import os, sys\nfor p in sys.argv[1:]:\n    if os.access(p, os.R_OK):\n        print(p)"
    try:
        r = _as_kernel_user(["-c", code, *paths], text=True, env={"PATH": os.defpath})
    except (OSError, subprocess.SubprocessError) as e:  # unknown: say so rather than claim they are safe
        return [f"(the check failed: {e})"]
    return r.stdout.splitlines() if r.returncode == 0 else [f"(the check failed: exit {r.returncode})"]


def isolation_line() -> str:
    """What isolates learner code on this host, in one line: the instructor's log and every results.json."""
    iso = sandbox()
    bounded = "processes bounded" if iso.bounded else "processes NOT bounded (RLIMIT_NPROC does not hold)"
    if iso.prefix:
        return ("isolation: namespaces (mount, pid" + (", net" if iso.net else "") + (", user" if "--map-root-user"
                in iso.prefix else "") + f"): the kernel sees only the allowlisted files; {bounded}")
    if iso.own_user:
        return (f"isolation: container + the kernel's own unprivileged user (no namespaces here: {iso.why}): it can "
                f"read only what every user can, the protected paths checked unreadable; network open; {bounded}")
    return (f"isolation: NONE ({iso.why or 'no namespaces and not root'}): learner code runs as the grader and can "
            "read everything the grader can")


def _probe() -> Isolation:
    unshare = shutil.which("unshare")
    if not unshare or not sys.platform.startswith("linux"):
        return _without_namespaces("unshare(1) is not available")
    why = ""
    import tempfile
    for net in (True, False):
        for user in ([], ["--map-root-user"]) if os.geteuid() == 0 else (["--map-root-user"],):
            prefix = [unshare, *UNSHARE, *user, *(["--net"] if net else [])]
            setuid = os.geteuid() == 0 and not user  # RLIMIT_NPROC never binds root: the kernel gets a user
            with tempfile.TemporaryDirectory(prefix="mgpu-grade-probe-") as base:
                cmd = [*prefix, sys.executable, "-m", "mgpu_helpers.tools.grading.sandbox", "--probe", base,
                       *(["--net"] if net else []), *(["--setuid"] if setuid else [])]
                try:
                    r = subprocess.run(cmd, capture_output=True, timeout=60, env=kernel_env([]))
                except (OSError, subprocess.TimeoutExpired) as e:
                    why = str(e)
                    continue
            if r.returncode in (0, 3):
                return Isolation(prefix, net, "", r.returncode == 0, setuid)
            why = (r.stderr.decode("utf-8", "replace").strip().splitlines() or ["failed"])[-1]
    return _without_namespaces(why)  # a container as root without namespaces (Gradescope's, a cluster's)


def kernel_env(import_paths: list[str]) -> dict:
    """An allowlist of the grader's environment: the learner's output could reveal anything else."""
    env = {k: v for k, v in os.environ.items() if k in ENV_KEEP or k.startswith(ENV_KEEP_PREFIXES)}
    pp = [*import_paths, *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])]
    if pp:
        env["PYTHONPATH"] = os.pathsep.join(pp)
    env.setdefault("PATH", os.defpath)
    return env


def _repo() -> str | None:
    """The source checkout holding the package (with .git, solutions/, tests/), if it is installed editable."""
    import mgpu_helpers
    repo = Path(mgpu_helpers.__file__).resolve().parent.parent
    return str(repo) if (repo / "pyproject.toml").exists() or (repo / ".git").exists() else None


SYSTEM_PREFIXES = ("/", "/usr", "/usr/local")


def needed_paths(import_paths: list[str]) -> list[str]:
    """The allowlist of the kernel's file system beyond the system's (sandbox.isolate): the interpreter and its
    standard library, the environment, the package directory alone and the course's import paths."""
    import site
    import sysconfig

    import mgpu_helpers
    paths = {sys.executable, os.path.dirname(os.path.abspath(mgpu_helpers.__file__)), *import_paths}
    for prefix in {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}:
        if os.path.realpath(prefix) not in SYSTEM_PREFIXES:
            paths.add(prefix)        # a venv, a conda env, a pyenv or python.org build: the whole prefix
    for name in ("stdlib", "platstdlib", "purelib", "platlib"):  # a system python: only its own folders
        paths.add(sysconfig.get_path(name))
        paths.add(sysconfig.get_path(name, vars={"base": sys.base_prefix, "platbase": sys.base_exec_prefix}))
    paths.update(site.getsitepackages())
    libdir, lib = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("LDLIBRARY")
    if libdir and lib:
        paths.add(os.path.join(libdir, lib))
    paths.update(p for p in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p)
    paths.update(p for p in sys.path if p and os.path.abspath(p).startswith(tuple(  # e.g. lib-dynload, .zip
        os.path.abspath(q).rstrip("/") + "/" for q in (sys.prefix, sys.base_prefix) if q not in SYSTEM_PREFIXES)))
    # Folders of installed distributions beyond the prefix's (`pip install --user` or `--target`), which the
    # kernel needs to start: only those holding *.dist-info or *.egg-info not this package's, never a checkout.
    paths.update(p for p in sys.path if p and os.path.isdir(p) and any(
        n.endswith((".dist-info", ".egg-info")) and not n.startswith("mgpu") for n in os.listdir(p)))
    return sorted(os.path.abspath(p) for p in paths if p and os.path.lexists(p))


def hidden_from_kernel() -> list[str]:
    """Directories inside the kept package that the kernel must not see: the judges' references (the answers
    a check compares against), wherever the package is installed. sandbox.isolate covers each with an empty tmpfs."""
    from ...checks import references
    return [os.path.realpath(os.path.dirname(references.__file__))]


def protected_paths(paths: list[Path]) -> list[str]:
    """What must never be visible in the sandbox: the given paths, the repository around the package, HOME."""
    return sorted({os.path.realpath(p) for p in [*paths, _repo(), os.path.expanduser("~")] if p} - {"/"})


def check_allowlist(keep: list[str], protect: list[str]) -> None:
    """A kept path must not contain a protected one (an --import-path holding the solutions, say)."""
    for k in keep:
        for q in {os.path.abspath(k), os.path.realpath(k)}:
            for p in protect:
                if p == q or p.startswith(q.rstrip("/") + "/"):
                    raise ValueError(f"{k} would be visible to the learner's kernel and contains {p}; put course "
                                     "modules (--import-path) and the environment in folders of their own")


@dataclass
class RunResult:
    timed_out: bool = False
    records: dict[int, dict] = field(default_factory=dict)
    results: dict[str, Path] = field(default_factory=dict)   # exercise id -> harvested results file
    error: str = ""


def course_files(solutions: Path, cap: int = 64 * 2**20) -> dict[str, bytes]:
    """The course's data files (``solutions/assets/``), copied next to every notebook as ``assets/``.
    Only that directory: anything else next to the solutions may be solutions."""
    files, total = {}, 0
    for p in sorted((solutions / "assets").rglob("*")) if (solutions / "assets").is_dir() else []:
        if p.is_file() and not p.is_symlink():
            total += p.stat().st_size
            if total > cap:
                raise ValueError(f"{solutions / 'assets'} holds more than {cap >> 20} MiB")
            files[str(p.relative_to(solutions))] = p.read_bytes()
    return files


def die_with_parent():
    """preexec_fn of a child (the grader's sandboxes and judges, ``mgpu-lab``'s server): SIGKILL when the
    thread that started it dies (Linux's PR_SET_PDEATHSIG), so a parent killed outright (SLURM's time limit,
    the OOM killer) leaves nothing running; unshare --kill-child then takes a sandbox's namespace down too."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes
    parent = os.getpid()

    def preexec():
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the prctl: no signal will come
            os._exit(1)
    return preexec


def kill(proc) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def work_dir(job: Path) -> str:
    """The notebook's directory as the kernel sees it; with its own user, a folder it owns inside the job."""
    iso = sandbox()
    return NS_WORK if iso.prefix else str(job / "work") if iso.own_user else str(job)


def run_job(job: Path, notebook: str, nb_text: str, grade_in: bytes, exercises: list[str], ctx) -> RunResult:
    """Run one assembled notebook in the sandbox; ``ctx``: score.Context (limits, allowlist, files)."""
    iso = sandbox()
    if STOP.is_set():
        return RunResult(error="interrupted")
    job.mkdir(parents=True, exist_ok=True)
    spec = {**asdict(ctx.limits), "notebook": notebook, "exercises": exercises, "keep": ctx.keep,
            "mask": hidden_from_kernel(), "net": iso.net, "namespace": iso.prefix is not None, "setuid": iso.setuid,
            "env": kernel_env(ctx.import_paths), "mpl_cache": ctx.mpl_cache, "extra": sorted(ctx.extra)}
    for rel, data in ctx.extra.items():
        (job / rel).parent.mkdir(parents=True, exist_ok=True)
        (job / rel).write_bytes(data)
    for name, data in (("job.json", json.dumps(spec).encode()), (notebook, nb_text.encode("utf-8")),
                       ("mgpu_grade_in.pt", grade_in)):  # the grader's alone: other sandboxes' users cannot read them
        with os.fdopen(os.open(job / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
            f.write(data)
    jobfd = os.open(job, os.O_RDONLY | os.O_DIRECTORY)
    cmd = [*(iso.prefix or []), sys.executable, "-m", "mgpu_helpers.tools.grading.sandbox", str(job), str(jobfd)]
    try:
        with os.fdopen(os.open(job / "sandbox.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as log:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=kernel_env([]),
                                    start_new_session=True, pass_fds=(jobfd,), preexec_fn=die_with_parent())
            RUNNING.add(proc)
            try:
                proc.wait(timeout=ctx.limits.notebook_timeout + 60)
            except subprocess.TimeoutExpired:  # the sandbox hung: unshare --kill-child takes the namespace down
                kill(proc)
            finally:
                RUNNING.discard(proc)
    finally:
        os.close(jobfd)
    try:
        data = json.loads((job / "sandbox.json").read_text())
    except (OSError, ValueError):
        tail = (job / "sandbox.log").read_bytes()[-1500:].decode("utf-8", "replace")
        return RunResult(error=f"the sandbox failed (exit {proc.returncode}): {tail.strip()}")
    res = RunResult(data["timed_out"], {int(r["cell"]): r for r in data["records"]
                                        if isinstance(r, dict) and "cell" in r})
    if not res.records and data.get("log"):
        res.error = "nbval did not run: " + data["log"].strip()[-1000:]
    for ex in exercises:
        p = job / f"mgpu_grade_out_{ex}.pt"
        if p.is_file() and not p.is_symlink():
            res.results[ex] = p
    return res
