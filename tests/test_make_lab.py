"""`make lab` without a browser: root or not, no display, a busy port -- the printed URL serves notebook 00.

The browser itself is driven by tests/browser (``make test-browser``); this runs in ``make test``.
"""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from mgpu_helpers.tools import lab

ROOT = Path(__file__).resolve().parents[1]


def test_make_lab_runs_this_module():
    rule = re.search(r"^lab:.*\n\t(.+)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert "-m mgpu_helpers.tools.lab" in rule, rule


def test_allow_root_only_for_root(monkeypatch, tmp_path):
    for uid, expected in ((0, True), (1000, False)):
        monkeypatch.setattr(os, "geteuid", lambda uid=uid: uid)
        assert ("--allow-root" in lab.lab_command(tmp_path, 8888, tmp_path / "c.json")) is expected
    # the token never appears on the command line (any user of the machine can read it there)
    assert not any("token" in a.lower() for a in lab.lab_command(tmp_path, 8888, tmp_path / "c.json"))


def test_no_display_means_no_browser(monkeypatch):
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.delenv("DISPLAY", raising=False)
    monkeypatch.delenv("WAYLAND_DISPLAY", raising=False)
    assert not lab.has_display()
    monkeypatch.setenv("DISPLAY", ":0")
    assert lab.has_display()


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (Linux /proc)."""
    out = []
    for d in Path("/proc").iterdir():
        try:
            stat = (d / "stat").read_text()
        except (OSError, ValueError):
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.append(int(d.name))
    return out


def _alive(pid: int) -> bool:
    try:  # a zombie (not reaped by a container's pid 1) is gone for our purpose
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _gone_within(pids, seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if _alive(p)]


def _start_lab(tmp_path, port: int):
    """The launcher as `make lab` runs it, and the first lines it printed up to the URL."""
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY")}
    env.update(JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "ws"), JUPYTER_CONFIG_DIR=str(tmp_path / "cfg"),
               TMPDIR=str(tmp_path))  # the runtime folder a killed launcher cannot remove stays in the test's
    proc = subprocess.Popen([sys.executable, "-m", "mgpu_helpers.tools.lab", "--port", str(port)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    out, url, deadline = [], None, time.monotonic() + 120
    while url is None and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        out.append(line)
        m = re.search(r"(http://localhost:\d+/\S+)", line)
        url = m.group(1) if m else None
    return proc, out, url


def _kill(proc):
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_busy_port_printed_url_serves_notebook_00(tmp_path):
    pytest.importorskip("jupyterlab")  # make lab installs it; a bare host (the H200's) has none
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    proc, out, url = _start_lab(tmp_path, port)
    servers = []
    try:
        assert url, "no URL printed:\n" + "".join(out)
        servers = _children(proc.pid) if sys.platform.startswith("linux") else []
        assert f":{port}/" not in url, "the busy port was printed instead of the one JupyterLab took"
        assert url.endswith("00_setup.ipynb?token=" + url.rsplit("token=", 1)[1])
        assert "/lab/tree/00_setup.ipynb?token=" in url
        for _ in range(5):  # the rest of the banner: the port that was busy, the ssh -L line
            out.append(proc.stdout.readline())
        text = "".join(out)
        assert f"port {port} was busy" in text and "ssh -L" in text, text
        with urllib.request.urlopen(url, timeout=30) as r:
            assert r.status == 200 and "JupyterLab" in r.read().decode()
        # the notebook itself is served (contents API, with the same token)
        base, token = url.split("/lab/tree/")[0], url.rsplit("token=", 1)[1]
        with urllib.request.urlopen(f"{base}/api/contents/00_setup.ipynb?token={token}", timeout=30) as r:
            assert r.status == 200
        # Ctrl-C: the launcher stops JupyterLab (SIGTERM, SIGKILL 5 s later) and exits, promptly even under load
        t = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
        assert time.monotonic() - t < 60
        assert proc.returncode in (0, 130, -signal.SIGINT), proc.returncode
        assert not _gone_within(servers, 10), "JupyterLab outlived the launcher's Ctrl-C"
    finally:
        busy.close()
        _kill(proc)
        for pid in servers:  # never leave a server behind, whatever failed above
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_killed_launcher_leaves_no_server_behind(tmp_path):
    """SIGKILL cannot be caught: the server must die with its parent (PR_SET_PDEATHSIG), port and all."""
    pytest.importorskip("jupyterlab")
    proc, out, url = _start_lab(tmp_path, _free_port())
    servers = _children(proc.pid)
    try:
        assert url and servers, "no URL printed or no server:\n" + "".join(out)
        os.kill(proc.pid, signal.SIGKILL)  # the launcher alone, as the OOM killer or a test's timeout would
        proc.wait()
        assert not _gone_within(servers, 30), "JupyterLab outlived its killed launcher"
        port = int(re.search(r"localhost:(\d+)/", url).group(1))
        deadline = time.monotonic() + 30  # the kernel closes a dead process's sockets; under load, not at once
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=5).close()
            except OSError:
                break
            time.sleep(0.5)
        else:
            pytest.fail(f"port {port} still accepts connections 30 s after the launcher was killed")
    finally:
        _kill(proc)
        for pid in servers:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_overrides_merge_and_a_read_only_environment(tmp_path, capsys):
    path = lab.install_overrides(str(tmp_path))
    ours = json.loads(path.read_text())
    assert ours["@jupyterlab/apputils-extension:notification"] == {"fetchNews": "false", "checkForUpdates": False}
    path.write_text(json.dumps({"other": {"keep": 1}}))  # an instructor's own settings survive
    assert json.loads(lab.install_overrides(str(tmp_path)).read_text())["other"] == {"keep": 1}
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.access(ro, os.W_OK):  # root ignores the mode: make the target a file instead of a folder
            (ro / "share").write_text("not a folder")
        lab.install_overrides(str(ro))  # must not raise: the course opens anyway
        assert "could not write" in capsys.readouterr().err
    finally:
        ro.chmod(0o700)


@pytest.mark.parametrize("argv, env, message", [
    (["--root", "nowhere"], None, "--root nowhere is not a directory"),
    (["--open", "nope.ipynb"], None, "--open nope.ipynb: no such notebook in"),
    (["--port", "-5"], None, "port -5: a number from 1 to 65535"),
    (["--port", "70000"], None, "port 70000: a number from 1 to 65535"),
    ([], "x", "MGPU_LAB_PORT='x': a port number"),
])
def test_bad_options_are_one_line_before_jupyterlab_starts(capsys, monkeypatch, argv, env, message):
    """``make lab ARGS=...`` with a slip: one line and exit 2 (JupyterLab once printed a page of log, then a
    traceback), and no server is started."""
    if env is not None:
        monkeypatch.setenv("MGPU_LAB_PORT", env)
    monkeypatch.setattr(lab, "start", lambda *a, **k: pytest.fail("JupyterLab was started"))
    assert lab.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("make lab: error: ") and message in err, err
