"""The sandbox's view of the file system, built inside fresh mount/pid/net namespaces (sandbox.py).

``isolate(spec)``:
1. makes every mount private, so nothing done here leaks to the host;
2. covers /tmp with a private, size-capped tmpfs (other jobs' scratch directories disappear), and /dev
   with a minimal one: null, zero, full, random, urandom, tty and the GPU nodes, a private /dev/shm --
   a process running as root without capabilities could otherwise write to block devices;
3. covers each path to hide (solutions, hidden checks, submissions, OUT, the rest of the repository,
   HOME) with an empty tmpfs, binding back only what the kernel needs (python, the venv, the package);
4. remounts every other mount read-only, and checks that the kept paths really are;
5. brings loopback up in the new network namespace (kernel and nbval talk over 127.0.0.1).
Only the standard library: this runs once per notebook, before anything else.
"""
from __future__ import annotations

import ctypes
import os

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
DEV_NODES = ("null", "zero", "full", "random", "urandom", "tty")
DEV_GPU = ("nvidia", "dri")  # nvidia0.., nvidiactl, nvidia-uvm, nvidia-caps/, dri/
WRITABLE = ("/tmp", "/dev/shm")
_libc = ctypes.CDLL(None, use_errno=True)


def mount(src, target, fstype=None, flags=0, data=None):
    enc = (lambda s: s.encode() if s is not None else None)
    if _libc.mount(enc(src), enc(target), enc(fstype), flags, enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), target)


def tmpfs(target, size, mode="755"):
    mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},mode={mode}")


def _open_paths(paths):
    """O_PATH handles taken before anything is covered: bind sources that stay reachable afterwards."""
    return {p: (os.open(p, os.O_PATH), os.path.isdir(p)) for p in paths if os.path.exists(p)}


def _rebind(path, keeps):
    for kp, (fd, is_dir) in sorted(keeps.items()):
        if kp.startswith(path.rstrip("/") + "/"):
            os.makedirs(kp if is_dir else os.path.dirname(kp), exist_ok=True)
            if not is_dir:
                open(kp, "a").close()
            mount(f"/proc/self/fd/{fd}", kp, None, MS_BIND | MS_REC)


def mask(path, keeps):
    """Cover ``path`` with an empty tmpfs (a file with /dev/null), then bind back the kept paths below it."""
    if not os.path.lexists(path) or path == "/":
        return
    if not os.path.isdir(path):
        mount("/dev/null", path, None, MS_BIND)
        return
    tmpfs(path, "64k")
    _rebind(path, keeps)


def _private_dev():
    names = [n for n in sorted(os.listdir("/dev")) if n in DEV_NODES or n.startswith(DEV_GPU)]
    keeps = _open_paths([f"/dev/{n}" for n in names])
    mount("tmpfs", "/dev", "tmpfs", MS_NOSUID, "size=64k,mode=755")
    _rebind("/dev", keeps)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"/dev/{name}")
    os.mkdir("/dev/shm")
    tmpfs("/dev/shm", "2g", "1777")  # enough for NCCL's shared-memory transport between a few GPUs


def _readonly_everything():
    flagmap = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC}
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split() for line in f]
    for fields in mounts:
        mp = fields[4].replace("\\040", " ")
        if mp in WRITABLE or mp.startswith(("/proc", "/sys")):
            continue
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for opt in fields[5].split(","):  # keep locked flags, or the remount is refused in a user namespace
            flags |= flagmap.get(opt, 0)
        try:
            mount(None, mp, None, flags)
        except OSError:
            pass  # checked below for what matters


def _loopback_up():
    import fcntl
    import socket
    import struct
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack("16sH14s", fcntl.ioctl(s, 0x8913, struct.pack("16sH14s", b"lo", 0, b"")))[1]
        fcntl.ioctl(s, 0x8914, struct.pack("16sH14s", b"lo", flags | 1, b""))  # IFF_UP


def isolate(spec: dict) -> None:
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    keeps = _open_paths(spec["keep"])
    tmpfs("/tmp", "1g", "1777")
    _rebind("/tmp", keeps)
    _private_dev()
    for p in sorted(spec["hide"], key=len):  # parents first; a path under a covered one is gone already
        mask(p, keeps)
    _readonly_everything()
    for p in ["/", *keeps]:
        if not os.statvfs(p).f_flag & os.ST_RDONLY:
            raise RuntimeError(f"could not make {p} read-only")
    if spec.get("net"):
        _loopback_up()
