"""``make lab``: JupyterLab on the course, for any user, with or without a screen.

    python -m mgpu_helpers.tools.lab [--port 8888] [--root notebooks] [--open 00_setup.ipynb] [--no-browser]

Unlike ``jupyter lab``: runs as root (containers); opens the system browser only with a display, never a text one;
prints one URL (token included, the port Jupyter bound); Ctrl-C, a closed terminal or its death stop JupyterLab and
its kernels (its own session: no "Shutdown this Jupyter server?"); ``overrides.json`` keeps the news pop-up away.
"""

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import webbrowser
from pathlib import Path

from .grading.execute import die_with_parent

ROOT = Path(__file__).resolve().parents[2]
OVERRIDES = {"@jupyterlab/apputils-extension:notification": {"fetchNews": "false", "checkForUpdates": False}}


def has_display() -> bool:
    return sys.platform in ("darwin", "win32") or bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


def install_overrides(prefix: str = sys.prefix) -> Path:
    """Write (or merge into) ``<prefix>/share/jupyter/lab/settings/overrides.json``."""
    path = Path(prefix) / "share" / "jupyter" / "lab" / "settings" / "overrides.json"
    current = {}
    with contextlib.suppress(OSError, ValueError):  # none yet, or not JSON: ours replaces it
        current = json.loads(path.read_text())
    merged = {**current, **{k: {**current.get(k, {}), **v} for k, v in OVERRIDES.items()}}
    if merged != current:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(merged, indent=2) + "\n")
        except OSError as e:  # a shared, read-only environment: the course still opens, with the pop-up
            print(f"note: could not write {path} ({e.strerror}); JupyterLab may ask about its news", file=sys.stderr)
    return path


def lab_command(root: Path, port: int, config: Path, extra: list[str] = ()) -> list[str]:
    """The ``jupyter lab`` command line; the token is in a private config file (mode 600): any user can read argv."""
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", f"--config={config}", f"--ServerApp.root_dir={root}",
           f"--ServerApp.port={port}", "--ServerApp.port_retries=50", "--ServerApp.ip=localhost",
           "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate", "--LabApp.news_url="]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")
    return cmd + list(extra)


def start(root: Path, port: int = 8888, extra: list[str] = (), env: dict | None = None, log: Path | None = None):
    """Start JupyterLab in the background: (process, token, info). Used by ``main`` and the browser test."""
    token = secrets.token_hex(24)
    runtime_dir = Path(tempfile.mkdtemp(prefix="mgpu-lab-"))
    env = dict(os.environ if env is None else env, JUPYTER_RUNTIME_DIR=str(runtime_dir))
    config = runtime_dir / "mgpu_lab_config.json"
    config.touch(mode=0o600)
    config.write_text(json.dumps({"IdentityProvider": {"token": token}}))
    install_overrides()
    with open(log, "ab") if log else contextlib.nullcontext() as out:  # None: its log goes to this terminal
        proc = subprocess.Popen(lab_command(root, port, config, extra), env=env, stdout=out, stderr=out,
                                start_new_session=True, preexec_fn=die_with_parent())
    deadline = time.monotonic() + 120
    try:  # the server's own record of itself (the port it bound, its URL)
        while True:
            with contextlib.suppress(OSError, ValueError):  # not written yet, or being written
                info = json.loads((runtime_dir / f"jpserver-{proc.pid}.json").read_text())
                break
            if proc.poll() is not None:
                raise RuntimeError(f"JupyterLab exited with status {proc.returncode} before it was ready")
            if time.monotonic() > deadline:
                raise TimeoutError("JupyterLab did not start within 120 s")
            time.sleep(0.2)
    except BaseException:
        stop(proc)
        shutil.rmtree(runtime_dir, ignore_errors=True)
        raise
    info["runtime_dir"] = str(runtime_dir)
    return proc, token, info


def input_problem(a) -> str | None:
    """What is wrong with the options, in one line (None: nothing); fills in the default port."""
    if a.port is None:
        env = os.environ.get("MGPU_LAB_PORT", "8888")
        if not env.isdigit():
            return f"MGPU_LAB_PORT={env!r}: a port number, e.g. 8888"
        a.port = int(env)
    if not 1 <= a.port <= 65535:
        return f"port {a.port}: a number from 1 to 65535 (8888 is Jupyter's usual)"
    if not a.root.is_dir():
        return f"--root {a.root} is not a directory"
    if not (a.root / a.open).is_file():
        return f"--open {a.open}: no such notebook in {a.root}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mgpu_helpers.tools.lab", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", type=Path, default=ROOT / "notebooks", help="folder JupyterLab serves")
    ap.add_argument("--open", default="00_setup.ipynb", help="notebook to open, relative to --root")
    ap.add_argument("--port", type=int, default=None, help="first port to try (default $MGPU_LAB_PORT or 8888)")
    ap.add_argument("--no-browser", action="store_true", help="never start a browser")
    a, extra = ap.parse_known_args(argv)
    problem = input_problem(a)
    if problem:  # one line, before JupyterLab starts (it would print a page of log and a traceback)
        print(f"make lab: error: {problem}", file=sys.stderr)
        return 2
    try:
        proc, token, info = start(a.root.resolve(), a.port, extra=extra)
    except (RuntimeError, TimeoutError) as e:  # JupyterLab's own log, above, says why
        print(f"make lab: error: {e} (JupyterLab's log above says why)", file=sys.stderr)
        return 1
    # Ctrl-C, a closed terminal or a kill: stop JupyterLab (and its kernels) too, never leave it behind.
    def _stop(signum, frame):
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # a second Ctrl-C must not cut the stop short
            signal.signal(sig, signal.SIG_IGN)
        raise KeyboardInterrupt
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _stop)
    try:
        url = f"http://localhost:{info['port']}{info.get('base_url', '/')}lab/tree/{a.open}?token={token}"
        bar = "=" * min(100, len(url) + 4)
        print(f"\n{bar}\n  The course is running. Open this URL in your browser:\n\n  {url}\n", flush=True)
        if int(info["port"]) != a.port:
            print(f"  (port {a.port} was busy: JupyterLab took {info['port']})")
        print("  On a remote machine, first run on your laptop:\n"
              f"    ssh -L {info['port']}:localhost:{info['port']} <user>@<this machine>\n"
              f"  Stop with Ctrl-C.\n{bar}\n", flush=True)
        if not a.no_browser and has_display():
            webbrowser.open(url)
        return proc.wait()
    except KeyboardInterrupt:
        return 130
    finally:
        stop(proc)  # a no-op once it has exited
        shutil.rmtree(info["runtime_dir"], ignore_errors=True)


def stop(proc, timeout: float = 5.0) -> None:
    """SIGTERM to JupyterLab's process group (it shuts its kernels down), SIGKILL if it lingers."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):  # it has just exited
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


if __name__ == "__main__":
    sys.exit(main())
