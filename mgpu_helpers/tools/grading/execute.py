"""Run one assembled notebook in a sandbox, out of reach of the instructor's files: the grader's side and inside.

The grader probes once what isolates learner code here (``sandbox()``), then per notebook ``run_job`` writes a
job directory (``job.json``: limits and the paths the kernel may see; the notebook; ``mgpu_grade_in.pt``: the
harvest's seeds and hidden cases) and starts ``unshare --mount --pid --kill-child [--net] [--map-root-user] python -m
mgpu_helpers.tools.grading.execute JOB_DIR JOB_FD`` (its own process, no --help), which as pid 1 of a new pid namespace:

1. ``isolate``: pivots into an empty tmpfs holding only read-only binds at their own paths: ``spec["keep"]``
   (the interpreter, the environment, the mgpu_helpers package directory alone, the --import-path folders),
   SYSTEM, a written /etc, /dev's DEV_NODES and GPU nodes, /sys's cpu and node folders (all of /sys with GPUs:
   the driver and NCCL read it), a new /proc and size-capped /tmp and /dev/shm. ``spec["mask"]`` (the judges'
   references) is covered by an empty tmpfs. Every mount is read-only, keeping the flags the host locked;
2. runs ``pytest --nbval`` with RLIMIT_AS, RLIMIT_NPROC, no capabilities and no_new_privs (so the kernel
   cannot undo the mounts), its per-cell records (nbplugin.py) coming back over a pipe. RLIMIT_NPROC never
   binds root: a grader running as root runs the kernel as a user of its own, UID_BASE + this process's host
   pid, so each sandbox has its own count;
3. kills everything in the namespace at the notebook timeout, and writes ``sandbox.json`` (the records) and
   the harvested ``mgpu_grade_out_<id>.pt`` files through JOB_FD, a directory fd the grader opened outside
   the namespace (its mount stays writable).

Without namespaces (a container as root under seccomp, as on Gradescope) step 1 is skipped: as root the
kernel still runs as its own user, in a folder it owns, reading only what every user may, and every process
of that user is killed at the end. Not root either: best effort, and the grader says so.
Standard library only: the sandbox process starts once per notebook.
"""

import contextlib
import ctypes
import json
import os
import platform
import resource
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

ROOT = "/tmp/mgpu-grade"
UID_BASE = 0x70000000         # + a host pid (< 2**22): the kernel's own user where the grader is root
RESULT_CAP = 64 * 2**20       # bytes per harvested results file
REPORT_CAP = 8 * 2**20        # bytes of per-cell records

UNSHARE = ["--mount", "--pid", "--kill-child", "--propagation", "private"]
ENV_KEEP = ("PATH", "LANG", "LANGUAGE", "TZ", "PYTHONPATH", "VIRTUAL_ENV", "CONDA_PREFIX", "LD_LIBRARY_PATH")
# GPU, NCCL and threading settings must reach the kernel (e.g. NCCL_NVLS_ENABLE=0 on shared GPU hosts).
ENV_KEEP_PREFIXES = ("LC_", "CUDA_", "NCCL_", "NVIDIA_", "NVSHMEM_", "TORCH_", "PYTORCH_", "OMP_", "MKL_", "OPENBLAS_")
_probed = None  # sandbox()'s Isolation
RUNNING: set = set()  # live sandbox processes, killed by the CLI on Ctrl-C
STOP = threading.Event()  # set on Ctrl-C: no new sandbox starts
_libc = ctypes.CDLL(None, use_errno=True)


# --- the grader's side ------------------------------------------------------------------------------


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
    setuid: bool              # the kernel runs as a user of its own (root without a user namespace)

    @property
    def own_user(self) -> bool:  # no namespaces, but root: the kernel can read only what every user can
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
    """"" when root can run python as an unused unprivileged user that imports the sandbox; else why not."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "not root"
    try:
        r = _as_kernel_user(["-c", "import mgpu_helpers.tools.grading.execute"], env=kernel_env([]))
    except (OSError, subprocess.SubprocessError) as e:
        return f"another user cannot run {sys.executable}: {e}"
    tail = (r.stderr.decode("utf-8", "replace").strip().splitlines() or [""])[-1]
    return "" if r.returncode == 0 else f"another user cannot import the package: {tail}"


def _as_kernel_user(args: list[str], **kw):  # python, as the kernel's own user (own_user mode)
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
                cmd = [*prefix, sys.executable, "-m", "mgpu_helpers.tools.grading.execute", "--probe", base,
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
    """The kernel's allowlist beyond SYSTEM: interpreter, stdlib, environment, package directory, import paths."""
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
    """The judges' references (the answers), inside the kept package: isolate covers each with an empty tmpfs.
    Found by path: importing them (torch and every judge) cost the sandbox's probe 3.6 s of a grading run's start."""
    return [os.path.realpath(Path(__file__).resolve().parents[2] / "checks" / "references")]


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
    """``solutions/assets/``, copied next to every notebook; nothing else there: it may be solutions."""
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
    parent = os.getpid()

    def preexec():
        _libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
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
    return f"{ROOT}/work" if iso.prefix else str(job / "work") if iso.own_user else str(job)


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
    cmd = [*(iso.prefix or []), sys.executable, "-m", "mgpu_helpers.tools.grading.execute", str(job), str(jobfd)]
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


# --- inside the sandbox: the kernel's file system, an allowlist on an empty root (step 1) ------------

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 32, 1024, 2048, 4096, 16384
MS_PRIVATE, MS_RELATIME, MS_STRICTATIME, MNT_DETACH = 1 << 18, 1 << 21, 1 << 24, 2
FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
         "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME}
SYSTEM = ("/usr/bin", "/usr/lib", "/usr/lib64", "/usr/lib32", "/usr/libx32", "/usr/libexec",
          "/bin", "/lib", "/lib64", "/lib32", "/libx32")
ETC = ("ld.so.cache", "localtime")           # bound; passwd, group, hosts, nsswitch.conf are written
DEV_NODES = ("null", "zero", "full", "random", "urandom", "tty")
DEV_GPU = ("nvidia", "dri")                   # nvidia0.., nvidiactl, nvidia-uvm, nvidia-caps/, dri/
SYS_CPU = ("/sys/devices/system/cpu", "/sys/devices/system/node")
WRITABLE = ("/tmp", "/dev/shm", "/proc")
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217}  # syscall numbers


def _check(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), what)


def mount(src, target, fstype=None, flags=0, data=None):
    enc = (lambda s: s.encode() if s is not None else None)
    _check(_libc.mount(enc(src), enc(target), enc(fstype), flags, enc(data)), target)


def tmpfs(target, size, mode="755"):
    mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},mode={mode}")


class Root:
    """The new root under construction at ``new``: ``place(path)`` makes ``path`` resolve inside as on the
    host (each symlink along it recreated, the file or directory itself bound)."""

    def __init__(self, new):
        self.new, self.bound = new, []

    def _target(self, path, is_dir):
        t = self.new + path
        os.makedirs(t if is_dir else os.path.dirname(t), exist_ok=True)
        if not is_dir and not os.path.lexists(t):
            open(t, "w").close()
        return t

    def place(self, path, depth=0):
        if depth > 40 or not os.path.lexists(path):
            return
        parts, cur = path.strip("/").split("/"), ""
        for i, part in enumerate(parts):
            cur += "/" + part
            if any(cur == b or cur.startswith(b.rstrip("/") + "/") for b in self.bound):
                return
            if os.path.islink(cur):  # recreate the link, then place what it points to
                link = os.readlink(cur)
                if not os.path.lexists(self.new + cur):
                    os.makedirs(os.path.dirname(self.new + cur), exist_ok=True)
                    os.symlink(link, self.new + cur)
                rest = parts[i + 1:]
                return self.place(os.path.normpath(os.path.join(os.path.dirname(cur), link, *rest)), depth + 1)
        self.bind(path, path)

    def bind(self, src, path):
        mount(src, self._target(path, os.path.isdir(src)), None, MS_BIND | MS_REC)
        self.bound.append(path)

    def write(self, path, text):
        Path(self._target(path, False)).write_text(text)


def _etc(root, uid):
    home = "/tmp/mgpu-grade/home"
    users = [("root", 0)] + ([("learner", uid)] if uid else [])
    root.write("/etc/passwd", "".join(f"{n}:x:{u}:{u}::{home}:/bin/sh\n" for n, u in users)
               + "nobody:x:65534:65534::/nonexistent:/usr/sbin/nologin\n")
    root.write("/etc/group", "".join(f"{n}:x:{u}:\n" for n, u in users) + "nogroup:x:65534:\n")
    root.write("/etc/hosts", f"127.0.0.1\tlocalhost {socket.gethostname()}\n::1\tlocalhost\n")
    root.write("/etc/nsswitch.conf", "passwd: files\ngroup: files\nhosts: files\n")
    for name in ETC:
        if os.path.exists(f"/etc/{name}"):
            root.bind(os.path.realpath(f"/etc/{name}"), f"/etc/{name}")


def _dev(root):
    names = [n for n in sorted(os.listdir("/dev")) if n in DEV_NODES or n.startswith(DEV_GPU)]
    os.mkdir(root.new + "/dev")
    tmpfs(root.new + "/dev", "64k")
    for n in names:
        root.bind(f"/dev/{n}", f"/dev/{n}")
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{root.new}/dev/{name}")
    os.mkdir(root.new + "/dev/shm")
    tmpfs(root.new + "/dev/shm", "2g", "1777")  # enough for NCCL's shared-memory transport between a few GPUs
    return any(n.startswith(DEV_GPU) for n in names)


def _mounts():
    with open("/proc/self/mountinfo") as f:
        return [(line.split()[4].replace("\\040", " "), line.split()[5]) for line in f]


def _readonly(new):
    for mp, opts in _mounts():
        if not (mp == new or mp.startswith(new + "/")) or mp[len(new):] in WRITABLE:
            continue
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for opt in opts.split(","):  # keep the flags the host locked, or a user namespace refuses the remount
            flags |= FLAGS.get(opt, 0)
        if not flags & (MS_NOATIME | MS_RELATIME):
            flags |= MS_STRICTATIME
        mount(None, mp, None, flags)


def isolate(spec: dict, base: str, uid: int = 0) -> None:
    """Pivot into the allowlisted root (see the module docstring); ``uid``: the kernel's user, if not root."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing done here reaches the host
    root = Root(os.path.join(base, "root"))
    os.makedirs(root.new, exist_ok=True)
    tmpfs(root.new, "16m")
    os.makedirs(root.new + "/tmp")
    tmpfs(root.new + "/tmp", "1g", "1777")  # first: a kept path under /tmp (an --import-path) is bound into it
    for p in sorted({os.path.abspath(p) for p in [*SYSTEM, *spec["keep"]]}, key=len):
        root.place(p)
    for p in spec.get("mask", ()):  # inside a kept path: hide it under an empty, read-only tmpfs
        if os.path.isdir(root.new + p):
            tmpfs(root.new + p, "4k", "555")
    _etc(root, uid)
    gpu = _dev(root)
    for p in ("/sys",) if gpu else SYS_CPU:
        root.place(p)
    os.makedirs(root.new + "/proc")
    mount("proc", root.new + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)  # of the new pid namespace
    _readonly(root.new)
    nr = PIVOT_ROOT.get(platform.machine())
    if nr is None:
        raise RuntimeError(f"pivot_root: unknown syscall number on {platform.machine()}")
    os.chdir(root.new)
    _check(_libc.syscall(nr, b".", b"."), "pivot_root")  # new root on top, the old one stacked under it
    _check(_libc.umount2(b".", MNT_DETACH), "umount old root")
    os.chdir("/")
    rw = [mp for mp, opts in _mounts() if mp not in WRITABLE and "ro" not in opts.split(",")]
    if rw:
        raise RuntimeError(f"could not make {', '.join(rw)} read-only")
    if spec.get("net"):  # the new network namespace's loopback is down: SIOCGIFFLAGS, then SIOCSIFFLAGS with IFF_UP
        import fcntl
        import struct
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            flags = struct.unpack("16sH14s", fcntl.ioctl(s, 0x8913, struct.pack("16sH14s", b"lo", 0, b"")))[1]
            fcntl.ioctl(s, 0x8914, struct.pack("16sH14s", b"lo", flags | 1, b""))


# --- inside the sandbox: running nbval (steps 2 and 3) -----------------------------------------------


def _drop_privileges(memory, tasks=None, uid=0):
    """preexec_fn of pytest and so of the kernel: no capabilities, no way back, bounded memory and tasks."""
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if tasks:
        resource.setrlimit(resource.RLIMIT_NPROC, (tasks, tasks))
    _libc.prctl(38, 1, 0, 0, 0)                      # PR_SET_NO_NEW_PRIVS
    for cap in range(64):
        _libc.prctl(24, cap, 0, 0, 0)                # PR_CAPBSET_DROP (EINVAL past the last cap)
    if uid:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)                               # drops every capability too
    _libc.prctl(47, 4, 0, 0, 0)                      # PR_CAP_AMBIENT_CLEAR_ALL
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)    # _LINUX_CAPABILITY_VERSION_3, this process
    _libc.capset(header, (ctypes.c_uint32 * 6)())    # effective = permitted = inheritable = 0


def _kill_all(proc, namespace, uid=0):
    if namespace and os.getpid() == 1:
        with contextlib.suppress(ProcessLookupError):
            os.kill(-1, signal.SIGKILL)              # pid 1 of a pid namespace: everything but us
    elif uid:                                        # every process of the kernel's own user, daemons included
        pid = os.fork()
        if pid == 0:
            try:
                os.setgid(uid)
                os.setuid(uid)
                os.kill(-1, signal.SIGKILL)          # as that user: all its processes but this one
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
    else:                                            # best effort: the process tree as it is now
        with contextlib.suppress(Exception):         # psutil missing or the tree already gone
            import psutil
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
        proc.kill()
    proc.wait()


def _write_out(jobfd, name, data: bytes):
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600, dir_fd=jobfd)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _kernel_uid(setuid):
    return UID_BASE + int(os.readlink("/proc/self")) if setuid else 0  # the host's pid: its /proc, still


def main(job, jobfd):
    """``jobfd``: opened by the grader outside the namespace, so it stays writable once all here is read-only."""
    spec = json.load(open(os.path.join(job, "job.json")))
    _libc.prctl(4, 0, 0, 0, 0)                       # PR_SET_DUMPABLE 0: the kernel cannot open our fds
    ns, uid = spec["namespace"], _kernel_uid(spec["setuid"])
    work = f"{ROOT}/work" if ns else os.path.join(job, "work") if uid else job
    home = os.path.join(os.path.dirname(work) if ns or uid else work, "home")
    files = {os.path.join(work, n): os.path.join(job, n)
             for n in (spec["notebook"], "mgpu_grade_in.pt", *spec["extra"])}  # extra: the course's assets/
    cache = spec["mpl_cache"]
    if cache and os.path.isdir(cache):
        files.update({os.path.join(home, "mpl", n): os.path.join(cache, n) for n in os.listdir(cache)
                      if n.endswith(".json")})
    files = {dst: open(src, "rb").read() for dst, src in files.items()}  # read before the root is swapped
    if ns:
        isolate(spec, job, uid)
    for d in (work, os.path.join(home, "mpl"), os.path.join(home, "runtime")):
        os.makedirs(d, exist_ok=True)
    for dst, data in files.items():
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        Path(dst).write_bytes(data)
    if uid:
        for top in (work, home):
            for d, _, names in os.walk(top):
                for p in [d, *(os.path.join(d, f) for f in names)]:
                    os.chown(p, uid, uid)
    logdir = os.path.join(ROOT, "log") if ns else job if uid else home
    os.makedirs(logdir, mode=0o700, exist_ok=True)
    env = dict(spec["env"], HOME=home, TMPDIR="/tmp" if ns else home,
               MPLCONFIGDIR=os.path.join(home, "mpl"), IPYTHONDIR=os.path.join(home, ".ipython"),
               JUPYTER_RUNTIME_DIR=os.path.join(home, "runtime"), PYTHONDONTWRITEBYTECODE="1",
               PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")  # nbval and ours alone (-p): no other installed plugin loads
    tasks = spec["processes"] if ns or uid else None
    rfd, wfd = os.pipe()
    cmd = [sys.executable, "-m", "pytest", os.path.join(work, spec["notebook"]), "--nbval", "--nbval-current-env",
           f"--nbval-cell-timeout={spec['cell_timeout']}",
           # a kernel's start (importing torch) is not the learner's: on busy cores it took over nbval's 60 s
           # default and every cell errored; the notebook's own timeout bounds it
           f"--nbval-kernel-startup-timeout={max(60, int(spec['notebook_timeout']))}",
           "-p", "no:cacheprovider", "-p", "mgpu_helpers.tools.grading.nbplugin", "-p", "nbval",
           f"--mgpu-report-fd={wfd}",
           f"--mgpu-output-cap={spec['output_cap']}", f"--mgpu-output-cap-total={spec['output_cap_total']}",
           *([f"--mgpu-max-tasks={tasks}"] if tasks else []),
           "-o", "addopts=", "-c", os.devnull, "--rootdir", work, "-q", "--no-header"]
    log = os.fdopen(os.open(os.path.join(logdir, "pytest.log"), os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW,
                            0o600), "w+b")
    proc = subprocess.Popen(cmd, cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                            pass_fds=(wfd,), start_new_session=True,
                            preexec_fn=lambda: _drop_privileges(spec["memory"], tasks, uid))
    os.close(wfd)
    records: list = []

    def read_report():
        total = 0
        with os.fdopen(rfd, "rb") as f:
            for line in f:
                total += len(line)
                if total <= REPORT_CAP:
                    with contextlib.suppress(ValueError):
                        records.append(json.loads(line))

    reader = threading.Thread(target=read_report, daemon=True)
    reader.start()
    try:
        rc, timed_out = proc.wait(timeout=spec["notebook_timeout"]), False
    except subprocess.TimeoutExpired:
        rc, timed_out = None, True
    _kill_all(proc, ns, uid)                         # also whatever the learner left running
    reader.join(timeout=5)
    log.seek(max(0, log.seek(0, os.SEEK_END) - 4000))
    result = {"mode": "namespace" if ns else "user" if uid else "fallback", "timed_out": timed_out,
              "returncode": rc, "records": records, "log": log.read().decode("utf-8", "replace")}
    if ns or uid:  # the harvested results, out of the kernel's folder: plain files, not too large
        for name in (f"mgpu_grade_out_{ex}.pt" for ex in spec["exercises"]):
            flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
            with contextlib.suppress(OSError), os.fdopen(os.open(os.path.join(work, name), flags), "rb") as f:
                st = os.fstat(f.fileno())
                if stat.S_ISREG(st.st_mode) and st.st_size <= RESULT_CAP:
                    _write_out(jobfd, name, f.read(RESULT_CAP + 1))
    _write_out(jobfd, "sandbox.json", json.dumps(result).encode())
    return 0


def probe(base: str, net: bool, setuid: bool) -> int:
    """Run under the unshare prefix being tried: exit 0 when this process can build the sandbox and a
    process of the kernel's kind is held to RLIMIT_NPROC, 3 when only the latter fails (see the grader)."""
    uid = _kernel_uid(setuid)
    isolate({"keep": needed_paths([]), "mask": hidden_from_kernel(), "net": net}, base, uid)
    pid = os.fork()
    if pid == 0:  # as the kernel would be, allowed one task: itself
        try:
            _drop_privileges(2**34, 1, uid)
            child = os.fork()
        except OSError:
            os._exit(0)
        if child == 0:
            os._exit(0)
        os._exit(3)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


if __name__ == "__main__":
    if sys.argv[1] == "--probe":
        sys.exit(probe(sys.argv[2], "--net" in sys.argv[3:], "--setuid" in sys.argv[3:]))
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
