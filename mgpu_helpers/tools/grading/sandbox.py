"""Run nbval on one assembled notebook, out of reach of the instructor's files.

The grader starts ``unshare --mount --pid --kill-child [--net] [--map-root-user] python -m
mgpu_helpers.tools.grading.sandbox JOB_DIR JOB_FD``; as pid 1 of a fresh pid namespace this process:

1. ``isolate``: pivots into an empty tmpfs holding only read-only binds at their own paths: ``spec["keep"]``
   (the interpreter, the environment, the mgpu_helpers package directory alone, the --import-path folders),
   SYSTEM, a written /etc, /dev's DEV_NODES and GPU nodes, /sys's cpu and node folders (all of /sys with GPUs:
   the driver and NCCL read it), a new /proc and size-capped /tmp and /dev/shm. ``spec["mask"]`` (the judges'
   references) is covered by an empty tmpfs. Every mount is read-only, keeping the flags the host locked;
2. runs ``pytest --nbval`` with RLIMIT_AS, RLIMIT_NPROC, no capabilities and no_new_privs (so the kernel
   cannot undo the mounts), its per-cell records (nbplugin.py) coming back over a pipe. RLIMIT_NPROC never
   binds root: a grader running as root runs the kernel as a user of its own, UID_BASE + this process's host
   pid, so each sandbox has its own count;
3. kills everything in the namespace at the notebook timeout, and copies the results out through JOB_FD, a
   directory fd the grader opened outside the namespace (its mount stays writable).

Without namespaces (a container as root under seccomp, as on Gradescope) step 1 is skipped: as root the
kernel still runs as its own user, in a folder it owns, reading only what every user may, and every process
of that user is killed at the end. Not root either: best effort, and the grader says so.
Standard library only: this process starts once per notebook.
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import os
import platform
import resource
import signal
import socket
import stat
import subprocess
import sys
import threading
from pathlib import Path

ROOT = "/tmp/mgpu-grade"
UID_BASE = 0x70000000         # + a host pid (< 2**22): the kernel's own user where the grader is root
RESULT_CAP = 64 * 2**20       # bytes per harvested results file
REPORT_CAP = 8 * 2**20        # bytes of per-cell records
_libc = ctypes.CDLL(None, use_errno=True)


# --- the kernel's file system: an allowlist on an empty root (step 1) ---------------------------------

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

    def covered(self, path):
        return any(path == b or path.startswith(b.rstrip("/") + "/") for b in self.bound)

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
            if self.covered(cur):
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


def _pivot(new):
    nr = PIVOT_ROOT.get(platform.machine())
    if nr is None:
        raise RuntimeError(f"pivot_root: unknown syscall number on {platform.machine()}")
    os.chdir(new)
    _check(_libc.syscall(nr, b".", b"."), "pivot_root")  # new root on top, the old one stacked under it
    _check(_libc.umount2(b".", MNT_DETACH), "umount old root")
    os.chdir("/")


def _loopback_up():
    import fcntl
    import struct
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack("16sH14s", fcntl.ioctl(s, 0x8913, struct.pack("16sH14s", b"lo", 0, b"")))[1]
        fcntl.ioctl(s, 0x8914, struct.pack("16sH14s", b"lo", flags | 1, b""))  # IFF_UP


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
    _pivot(root.new)
    rw = [mp for mp, opts in _mounts() if mp not in WRITABLE and "ro" not in opts.split(",")]
    if rw:
        raise RuntimeError(f"could not make {', '.join(rw)} read-only")
    if spec.get("net"):
        _loopback_up()


# --- running nbval (steps 2 and 3) ------------------------------------------------------------------


def _drop_privileges(memory, tasks=None, uid=0):
    """preexec_fn of pytest (and so of the kernel): no capabilities, no way back, bounded address space
    and (in the namespaces) a bounded number of processes and threads."""
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
           "-p", "no:cacheprovider", "-p", "nbval", "-p", "mgpu_helpers.tools.grading.nbplugin",
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
    from .execute import hidden_from_kernel, needed_paths
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
