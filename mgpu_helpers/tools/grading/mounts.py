"""The sandbox's file system: an allowlist on an empty root, built inside fresh namespaces (sandbox.py).

``isolate(spec, base)`` mounts an empty tmpfs at ``base/root``, fills it and pivots into it; the host's
tree is then detached, so no other path exists inside:

  /                      the empty tmpfs, read-only once built
  spec["keep"]           read-only binds at their own paths: the interpreter and its standard library, the
                         environment (venv or conda prefix, with its site-packages), the mgpu_helpers package
                         directory alone (never the repository around it), the --import-path directories
  spec["mask"]           an empty read-only tmpfs over each (the judges' references inside the package)
  SYSTEM                 /usr/bin, /usr/lib*, /usr/libexec read-only (/bin, /lib* as the host has them: symlinks)
  /etc                   passwd, group, hosts, nsswitch.conf written here; ld.so.cache and localtime bound
  /dev                   null, zero, full, random, urandom, tty, the GPU nodes; /dev/shm a private tmpfs
  /sys                   devices/system/{cpu,node} read-only (all of /sys with GPUs: the driver and NCCL read it)
  /proc                  a new proc: only the sandbox's own processes
  /tmp                   a private, size-capped tmpfs holding the kernel's work dir

Binds are recursive (a user namespace refuses to bind a mount without its submounts) and every mount
is then remounted read-only but /tmp, /dev/shm and /proc, keeping the flags the host locked. Loopback is
brought up in the new network namespace (kernel and nbval talk over 127.0.0.1).
Only the standard library: this runs once per notebook, before anything else.
"""
from __future__ import annotations

import ctypes
import os
import platform
import socket

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
_libc = ctypes.CDLL(None, use_errno=True)


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
        with open(self._target(path, False), "w") as f:
            f.write(text)


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
