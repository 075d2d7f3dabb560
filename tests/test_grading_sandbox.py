"""The grader's sandbox seen from inside a graded exercise cell.

A probe student's exercise 90.1 walks the whole file system and lists the processes it can see; its 90.2
forks sleeping children until the sandbox refuses (a bounded loop, never a real bomb). Both report through
the exception their function raises, which the outside judge puts in grades.csv. The machine meanwhile
holds a second copy of the course outside the repository and HOME (as a shared grading server might).
"""
from __future__ import annotations

import csv
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nbformat
import pytest

from mgpu_helpers.tools.authoring import mgpu, release_notebook
from mgpu_helpers.tools.grading import execute as mounts  # the allowlist lives in the sandbox
from mgpu_helpers.tools.grading.cli import main as grade_main
from mgpu_helpers.tools.grading.execute import _repo, needed_paths, sandbox

FIX = Path(__file__).parent / "grading_fixtures"
NB = "90_fixture.ipynb"
PROBE = "91_probe.ipynb"  # its own name: test_grading.py grades 90_fixture beside it under pytest -n, and ps shows both
REPO = Path(__file__).resolve().parent.parent
SANDBOXED = sandbox()[0] is not None
LIMIT = 96 + 4 * (os.cpu_count() or 1)
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not SANDBOXED, reason="no mount/pid namespaces here")]

WALK = r'''
import os
ALLOWED = @ALLOWED@
SECRETS = @SECRETS@


def _under(p, roots):
    return any(p == r or p.startswith(r.rstrip("/") + "/") for r in roots)


outside, named = [], []
for top, dirs, files in os.walk("/"):
    if top == "/":
        dirs[:] = [d for d in dirs if d not in ("proc", "sys")]  # kernel-made; /sys checked below
    for f in files:
        p = os.path.join(top, f)
        if os.access(p, os.R_OK):
            if not _under(p, ALLOWED):
                outside.append(p)
            # a notebook a third-party package ships in the environment (the H200 host's has some) is no secret
            if (p.endswith(".ipynb") and "-packages/" not in p) or any(s in p for s in SECRETS):
                named.append(p)
sys_dirs = sorted(os.listdir("/sys")) + sorted(os.listdir("/sys/devices"))
procs = []
for pid in os.listdir("/proc"):
    if pid.isdigit():
        try:
            procs.append(open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode())
        except OSError:
            pass
strangers = [c[:60] for c in procs if not any(k in c for k in ("mgpu_helpers.tools.grading.execute", "pytest", "ipykernel"))]
REPORT = (f"outside={len(outside)} {outside[:3]} named={len(named)} {named[:3]} procs={len(procs)} "
          f"strangers={strangers[:3]} sys={sys_dirs}")  # sys last: with GPUs it is long, and messages are capped


def scale(x, k):
    raise RuntimeError(REPORT)
'''

FORKS = r'''
import os
import time

kids, err = [], None
for _ in range(@LIMIT@ + 64):  # bounded: at most LIMIT + 64 sleeping children, were the limit not to hold
    try:
        pid = os.fork()
    except OSError as e:
        err = type(e).__name__
        break
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    kids.append(pid)
for pid in kids:
    os.kill(pid, 9)
    os.waitpid(pid, 0)
FORKED = f"forked={len(kids)} err={err}"


def param_bytes(model):
    raise RuntimeError(FORKED)
'''


def _exercise(nb, ex):
    return next(c for c in nb.cells if mgpu(c).get("exercise") == ex)


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sandbox")
    sol, pkg, hid, sub, out = (tmp / n for n in ("solutions", "pkg", "hidden", "submissions", "out"))
    for d in (sol, pkg, hid, sub / "probe"):
        d.mkdir(parents=True)
    shutil.copy(FIX / f"{NB}.json", sol / PROBE)
    shutil.copy(FIX / "fixture_course.py", pkg / "fixture_course.py")
    shutil.copy(FIX / "hidden_checks.py", hid / "hidden_checks.py")
    # A second checkout of the course, outside the repository and HOME, in two places.
    clones = [Path(tempfile.mkdtemp(prefix="mgpu-other-clone-"))]
    if os.access("/var/tmp", os.W_OK):
        clones.append(Path(tempfile.mkdtemp(prefix="mgpu-other-clone-", dir="/var/tmp")))
    for c in clones:
        shutil.copytree(REPO / "solutions", c / "solutions")
        shutil.copytree(FIX, c / "tests" / "grading_fixtures")
    keep = needed_paths([str(pkg)])
    # /tmp is the sandbox's own tmpfs: its work dir, nbval's kernel connection file, the kept --import-path
    allowed = sorted({*keep, *mounts.SYSTEM, "/dev", "/tmp", "/sys/devices/system",
                      *(f"/etc/{n}" for n in ("passwd", "group", "hosts", "nsswitch.conf", *mounts.ETC))})
    secrets = sorted({"/solutions/", "grading_fixtures", "hidden_checks", "mgpu-other-clone", *map(str, (sol, hid, sub, out)),
                      "checks/references/",  # the judges' references: masked inside the kept package
                      *(p.name for p in (REPO / "solutions").glob("*.ipynb"))})
    nb = release_notebook(nbformat.reads((FIX / f"{NB}.json").read_text(), as_version=4))
    _exercise(nb, "90.1").source = WALK.replace("@ALLOWED@", repr(allowed)).replace("@SECRETS@", repr(secrets))
    _exercise(nb, "90.2").source = FORKS.replace("@LIMIT@", str(LIMIT))
    (sub / "probe" / PROBE).write_text(nbformat.writes(nb))
    try:
        rc = grade_main([str(sub), "--out", str(out), "--solutions", str(sol), "--hidden", str(hid), "--import-path",
                         str(pkg), "--timeout", "120", "--key", "k", "--max-processes", str(LIMIT)])
    finally:
        for c in clones:
            shutil.rmtree(c, ignore_errors=True)
    with open(out / "grades.csv", newline="", encoding="utf-8") as f:
        rows = {r["exercise"]: r for r in csv.DictReader(f)}
    return {"rc": rc, "rows": rows, "keep": keep}


def test_allowlist_keeps_the_repository_and_home_out():
    keep = needed_paths([])
    repo, home = _repo(), os.path.realpath(os.path.expanduser("~"))
    pkg = str(REPO / "mgpu_helpers")
    assert pkg in keep
    for p in keep:  # inside the repository: only the package and the environment
        if repo and (p + "/").startswith(repo + "/"):
            assert p == pkg or p.startswith(sys.prefix), p
        if home != "/" and (p + "/").startswith(home + "/"):  # inside HOME: only the interpreter (pyenv & co)
            assert any(p.startswith(q) for q in (sys.prefix, sys.base_prefix)), p
    assert repo not in keep and home not in keep


def test_kernel_sees_only_the_allowlist(probed):
    msg = probed["rows"]["90.1"]["message"]
    m = re.search(r"outside=(\d+) (.*) named=(\d+) (.*) procs=(\d+) strangers=(.*) sys=(.*)", msg)
    assert m, msg
    assert m.group(1) == "0", f"readable outside the allowlist: {m.group(2)}"
    assert m.group(3) == "0", f"course files visible: {m.group(4)}"
    if not any(n.startswith(mounts.DEV_GPU) for n in os.listdir("/dev")):  # with GPUs all of /sys is there
        assert m.group(7) == "['devices', 'system']", m.group(7)


def test_other_processes_are_invisible(probed):
    msg = probed["rows"]["90.1"]["message"]
    m = re.search(r"procs=(\d+) strangers=(\[.*?\]) sys=", msg)
    assert m, msg
    assert m.group(2) == "[]", m.group(2)
    assert 3 <= int(m.group(1)) <= 6, msg  # the sandbox (pid 1), nbval and the kernel, maybe a helper


def test_processes_are_bounded(probed):
    if not sandbox().bounded:
        pytest.skip("RLIMIT_NPROC does not hold here (the grader warns)")
    m = re.search(r"forked=(\d+) err=(\w+)", probed["rows"]["90.2"]["message"])
    assert m, probed["rows"]["90.2"]["message"]
    assert m.group(2) == "BlockingIOError" and 0 < int(m.group(1)) < LIMIT, m.group(0)


def test_probe_cost_only_its_own_checks(probed):
    assert probed["rc"] == 0
    assert {r["status"] for r in probed["rows"].values()} == {"failed"}


def test_sandbox_process_tree_is_gone_afterwards(probed):
    """Nothing the probe started outlives its sandbox (the pid namespace dies with its pid 1). Other graders
    may run meanwhile (pytest -n: the course's class run), so only the probe's own notebook is looked for."""
    if not shutil.which("ps"):
        pytest.skip("no ps here")
    for _ in range(20):  # the kernel tears the namespace down after pid 1 exits: under load, a moment later
        ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
        if f"mgpu-grade/work/{PROBE}" not in ps:
            break
        time.sleep(0.5)
    assert f"mgpu-grade/work/{PROBE}" not in ps
