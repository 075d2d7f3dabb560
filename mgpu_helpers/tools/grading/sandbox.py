"""Run nbval on one assembled notebook, out of reach of the instructor's files.

The grader starts ``unshare --mount --pid --kill-child [--net] [--map-root-user] python -m
mgpu_helpers.tools.grading.sandbox JOB_DIR JOB_FD``; this process is then pid 1 of a fresh pid namespace and:

1. builds the kernel's file system from an allowlist (mounts.py): an empty root with read-only binds of
   the interpreter, the environment, the package and the system libraries, a private /tmp, /dev and
   /proc; loopback up in a new network namespace;
2. runs ``pytest --nbval`` from /tmp/mgpu-grade/work with RLIMIT_AS, RLIMIT_NPROC, no capabilities and
   no_new_privs (so the kernel cannot undo the mounts), its per-cell records (nbplugin.py) coming back
   over a pipe. RLIMIT_NPROC counts the tasks of one user in one user namespace, and never binds root:
   a grader running as root (no user namespace) runs the kernel as a user of its own, UID_BASE + this
   process's pid on the host, so each sandbox has its own count;
3. kills everything in the namespace at the notebook timeout, and copies the results out through
   JOB_FD, a directory fd the grader opened outside the namespace (its mount stays writable).

Without namespaces (``spec["namespace"]`` false: a container as root under seccomp, as on Gradescope) step 1
is skipped. As root, the kernel still runs as a user of its own (UID_BASE + this process's pid), in a folder
it owns inside the job (``work/``), bounded by RLIMIT_NPROC; it reads only what every user may (the grader
checks its protected paths are not), its results come out as in step 3, and at the end every process of
that user is killed. Not root either: best effort, the grader warns and says so in every results.json.
Only the standard library is imported here (and execute.py, which imports no more): this process starts
once per notebook.
"""
from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import stat
import subprocess
import sys
import threading

ROOT = "/tmp/mgpu-grade"
RESULT_CAP = 64 * 2**20       # bytes per harvested results file
REPORT_CAP = 8 * 2**20        # bytes of per-cell records
_libc = ctypes.CDLL(None, use_errno=True)


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
        try:
            os.kill(-1, signal.SIGKILL)              # pid 1 of a pid namespace: everything but us
        except ProcessLookupError:
            pass
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
        try:
            import psutil
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
        except Exception:  # noqa: BLE001 - psutil missing or the tree already gone
            pass
        proc.kill()
    proc.wait()


def _copy_out(work, jobfd, names):
    for name in names:
        try:
            fd = os.open(os.path.join(work, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_size > RESULT_CAP:
                continue
            data = f.read(RESULT_CAP + 1)
        out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600, dir_fd=jobfd)
        with os.fdopen(out, "wb") as f:
            f.write(data)


def main(job, jobfd=None):
    spec = json.load(open(os.path.join(job, "job.json")))
    _libc.prctl(4, 0, 0, 0, 0)                       # PR_SET_DUMPABLE 0: the kernel cannot open our fds
    # Opened by the grader outside the namespace, so it stays writable after everything here is read-only.
    jobfd = os.open(job, os.O_RDONLY | os.O_DIRECTORY) if jobfd is None else jobfd
    names = (spec["notebook"], "mgpu_grade_in.pt", *spec.get("extra", []))  # extra: the course's assets/
    inputs = {n: open(os.path.join(job, n), "rb").read() for n in names}
    mpl = {}
    if spec.get("mpl_cache") and os.path.isdir(spec["mpl_cache"]):
        mpl = {n: open(os.path.join(spec["mpl_cache"], n), "rb").read()
               for n in os.listdir(spec["mpl_cache"]) if n.endswith(".json")}
    uid = 0
    from .execute import UID_BASE                    # standard library only, like this module
    if spec["namespace"]:
        from .mounts import isolate
        uid = UID_BASE + int(os.readlink("/proc/self")) if spec.get("setuid") else 0  # the host's proc, still
        isolate(spec, job, uid)
    elif spec.get("setuid"):
        uid = UID_BASE + os.getpid()
    work = f"{ROOT}/work" if spec["namespace"] else os.path.join(job, "work") if uid else job
    home = os.path.join(os.path.dirname(work) if spec["namespace"] or uid else work, "home")
    for d in (work, home, os.path.join(home, "mpl"), os.path.join(home, "runtime")):
        os.makedirs(d, exist_ok=True)
    for n, data in inputs.items():
        os.makedirs(os.path.dirname(os.path.join(work, n)), exist_ok=True)
        with open(os.path.join(work, n), "wb") as f:
            f.write(data)
    for n, data in mpl.items():
        with open(os.path.join(home, "mpl", n), "wb") as f:
            f.write(data)
    if uid:
        for top in (work, home):
            for d, _, files in os.walk(top):
                for p in [d, *(os.path.join(d, f) for f in files)]:
                    os.chown(p, uid, uid)
    logdir = os.path.join(ROOT, "log") if spec["namespace"] else job if uid else home
    os.makedirs(logdir, mode=0o700, exist_ok=True)
    env = dict(spec["env"], HOME=home, TMPDIR="/tmp" if spec["namespace"] else home,
               MPLCONFIGDIR=os.path.join(home, "mpl"), IPYTHONDIR=os.path.join(home, ".ipython"),
               JUPYTER_RUNTIME_DIR=os.path.join(home, "runtime"), PYTHONDONTWRITEBYTECODE="1")
    tasks = spec.get("tasks") if spec["namespace"] or uid else None
    rfd, wfd = os.pipe()
    cmd = [sys.executable, "-m", "pytest", os.path.join(work, spec["notebook"]), "--nbval", "--nbval-current-env",
           f"--nbval-cell-timeout={spec['cell_timeout']}", "--nbval-kernel-startup-timeout=60",
           "-p", "no:cacheprovider", "-p", "mgpu_helpers.tools.grading.nbplugin", f"--mgpu-report-fd={wfd}",
           f"--mgpu-output-cap={spec['output_cap']}", f"--mgpu-output-cap-total={spec['output_cap_total']}",
           *([f"--mgpu-max-tasks={tasks}"] if tasks else []),
           "-o", "addopts=", "-c", os.devnull, "--rootdir", work, "-q", "--no-header"]
    log = os.fdopen(os.open(os.path.join(logdir, "pytest.log"), os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW,
                            0o600), "w+b")
    proc = subprocess.Popen(cmd, cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                            pass_fds=(wfd,), start_new_session=True,
                            preexec_fn=lambda: _drop_privileges(spec["memory"], tasks, uid))
    os.close(wfd)
    lines: list[bytes] = []

    def read_report():
        total = 0
        with os.fdopen(rfd, "rb") as f:
            for line in f:
                total += len(line)
                if total <= REPORT_CAP:
                    lines.append(line)

    reader = threading.Thread(target=read_report, daemon=True)
    reader.start()
    timed_out = False
    try:
        rc = proc.wait(timeout=spec["notebook_timeout"])
    except subprocess.TimeoutExpired:
        timed_out, rc = True, None
    _kill_all(proc, spec["namespace"], uid)          # also whatever the learner left running
    reader.join(timeout=5)
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except ValueError:
            pass
    log.seek(0, os.SEEK_END)
    log.seek(max(0, log.tell() - 4000))
    result = {"mode": "namespace" if spec["namespace"] else "user" if uid else "fallback", "timed_out": timed_out,
              "returncode": rc, "records": records, "log": log.read().decode("utf-8", "replace")}
    if spec["namespace"] or uid:
        _copy_out(work, jobfd, [f"mgpu_grade_out_{ex}.pt" for ex in spec["exercises"]])
    out = os.open("sandbox.json", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600, dir_fd=jobfd)
    with os.fdopen(out, "w") as f:
        json.dump(result, f)
    return 0


def probe(base: str, net: bool, setuid: bool) -> int:
    """Run under the unshare prefix being tried: exit 0 when this process can build the sandbox and a
    process of the kernel's kind is held to RLIMIT_NPROC, 3 when only the latter fails (see the grader)."""
    from .execute import UID_BASE, hidden_from_kernel, needed_paths
    from .mounts import isolate
    uid = UID_BASE + int(os.readlink("/proc/self")) if setuid else 0
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
    sys.exit(main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else None))
