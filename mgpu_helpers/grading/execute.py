"""Grader side of execution: pick the sandbox, write one job, run it, read back what it produced.

A job directory holds ``job.json`` (limits, what to hide, what the kernel needs), the assembled notebook
and ``mgpu_grade_in.pt`` (the harvest's seeds and hidden cases). ``sandbox.py`` runs it and writes
``sandbox.json`` (per-cell records) and the harvested ``mgpu_grade_out_<id>.pt`` files next to them.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

NS_WORK = "/tmp/mgpu-grade/work"  # the notebook's directory inside the sandbox (sandbox.ROOT + /work)
UNSHARE = ["--mount", "--pid", "--kill-child", "--mount-proc", "--propagation", "private"]
ENV_KEEP = ("PATH", "LANG", "LANGUAGE", "TZ", "PYTHONPATH", "VIRTUAL_ENV", "CONDA_PREFIX", "LD_LIBRARY_PATH")
# GPU, NCCL and threading settings must reach the kernel (e.g. NCCL_NVLS_ENABLE=0 on shared GPU hosts).
ENV_KEEP_PREFIXES = ("LC_", "CUDA_", "NCCL_", "NVIDIA_", "NVSHMEM_", "TORCH_", "PYTORCH_", "OMP_", "MKL_", "OPENBLAS_")
_probed: tuple | None = None
RUNNING: set = set()  # live sandbox processes, killed by the CLI on Ctrl-C
STOP = threading.Event()  # set on Ctrl-C: no new sandbox starts
DISABLED = "sandbox disabled with --no-sandbox"


@dataclass
class Limits:
    cell_timeout: float = 120.0
    notebook_timeout: float = 900.0
    memory: int = 8 * 2**30          # RLIMIT_AS of nbval and the kernel, bytes
    output_cap: int = 1 * 2**20      # bytes of output per cell
    output_cap_total: int = 8 * 2**20


def sandbox(disable: bool = False) -> tuple[list[str] | None, bool, str]:
    """(unshare prefix or None, network namespace?, why not): probed once per process."""
    global _probed
    if disable:
        _probed = (None, False, DISABLED)
    if _probed is None:
        _probed = _probe()
    return _probed


def reset_sandbox() -> None:
    global _probed
    _probed = None


def _probe():
    unshare = shutil.which("unshare")
    if not unshare or not sys.platform.startswith("linux"):
        return None, False, "unshare(1) is not available"
    users = [[]] if os.geteuid() == 0 else [["--map-root-user"]]
    if os.geteuid() == 0:
        users.append(["--map-root-user"])
    why = ""
    for net in (True, False):
        for user in users:
            prefix = [unshare, *UNSHARE, *user, *(["--net"] if net else [])]
            cmd = [*prefix, sys.executable, "-m", "mgpu_helpers.grading.sandbox", "--probe", *(["--net"] if net else [])]
            try:
                r = subprocess.run(cmd, capture_output=True, timeout=60, env=kernel_env([]))
            except (OSError, subprocess.TimeoutExpired) as e:
                why = str(e)
                continue
            if r.returncode == 0:
                return prefix, net, ""
            why = (r.stderr.decode("utf-8", "replace").strip().splitlines() or ["failed"])[-1]
    return None, False, why


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


def needed_paths(import_paths: list[str], hide: list[str]) -> list[str]:
    """What the kernel must still see under hidden directories: python, the venv, the package."""
    import mgpu_helpers
    cands = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
             os.path.dirname(os.path.realpath(sys.executable)), os.path.dirname(sys.executable),
             os.path.dirname(os.path.abspath(mgpu_helpers.__file__)), *import_paths}
    repo = _repo()
    for p in sys.path:  # not the cwd, nor the repository's own folders (tests/ is on sys.path under pytest)
        p = os.path.abspath(p) if p else ""
        if p and os.path.isdir(p) and p != os.getcwd() and not (
                repo and (p + "/").startswith(repo + "/") and not p.startswith(os.path.abspath(sys.prefix))):
            cands.add(p)
    out = set()
    for p in cands:
        for q in {os.path.abspath(p), os.path.realpath(p)}:
            # a path that contains something to hide is not kept whole (its needed parts are listed anyway)
            if not any(h == q or h.startswith(q.rstrip("/") + "/") for h in hide):
                out.add(q)
    return [p for p in sorted(out) if not any(p.startswith(q + "/") for q in out)]  # outermost only


def hidden_paths(paths: list[Path]) -> list[str]:
    """Paths covered in the sandbox: the given ones, the repository around the package, and HOME."""
    out = {os.path.realpath(p) for p in paths if p}
    if _repo():
        out.add(_repo())
    home = os.path.realpath(os.path.expanduser("~"))
    if home != "/":
        out.add(home)
    return sorted(out)


@dataclass
class RunResult:
    mode: str = "none"
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


def kill(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def work_dir(job: Path) -> str:
    return NS_WORK if sandbox()[0] else str(job)


def run_job(job: Path, notebook: str, nb_text: str, grade_in: bytes, exercises: list[str], limits: Limits,
            hide: list[str], keep: list[str], import_paths: list[str], mpl_cache: str,
            extra: dict[str, bytes] | None = None) -> RunResult:
    prefix, net, _ = sandbox()
    if STOP.is_set():
        return RunResult(error="interrupted")
    job.mkdir(parents=True, exist_ok=True)
    spec = {"notebook": notebook, "exercises": exercises, "cell_timeout": limits.cell_timeout,
            "notebook_timeout": limits.notebook_timeout, "memory": limits.memory, "output_cap": limits.output_cap,
            "output_cap_total": limits.output_cap_total, "hide": hide, "keep": keep, "net": net,
            "namespace": prefix is not None, "env": kernel_env(import_paths), "mpl_cache": mpl_cache,
            "extra": sorted(extra or {})}
    for rel, data in (extra or {}).items():
        (job / rel).parent.mkdir(parents=True, exist_ok=True)
        (job / rel).write_bytes(data)
    (job / "job.json").write_text(json.dumps(spec))
    (job / notebook).write_text(nb_text, encoding="utf-8")
    (job / "mgpu_grade_in.pt").write_bytes(grade_in)
    jobfd = os.open(job, os.O_RDONLY | os.O_DIRECTORY)
    cmd = [*(prefix or []), sys.executable, "-m", "mgpu_helpers.grading.sandbox", str(job), str(jobfd)]
    try:
        with open(job / "sandbox.log", "wb") as log:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=kernel_env([]),
                                    start_new_session=True, pass_fds=(jobfd,))
            RUNNING.add(proc)
            try:
                proc.wait(timeout=limits.notebook_timeout + 60)
            except subprocess.TimeoutExpired:  # the sandbox hung: unshare --kill-child takes the namespace down
                kill(proc)
            finally:
                RUNNING.discard(proc)
    finally:
        os.close(jobfd)
    res = RunResult()
    try:
        data = json.loads((job / "sandbox.json").read_text())
    except (OSError, ValueError):
        tail = (job / "sandbox.log").read_bytes()[-1500:].decode("utf-8", "replace")
        res.error = f"the sandbox failed (exit {proc.returncode}): {tail.strip()}"
        return res
    res.mode, res.timed_out = data["mode"], data["timed_out"]
    res.records = {int(r["cell"]): r for r in data["records"] if isinstance(r, dict) and "cell" in r}
    if not res.records and data.get("log"):
        res.error = "nbval did not run: " + data["log"].strip()[-1000:]
    for ex in exercises:
        p = job / f"mgpu_grade_out_{ex}.pt"
        if p.is_file() and not p.is_symlink():
            res.results[ex] = p
    return res
