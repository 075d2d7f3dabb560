"""The course as a Gradescope autograder: ``mgpu-course autograder --out autograder.zip`` builds the zip,
``run_autograder`` (inside it) grades one submission with ``mgpu-grade``.

GRADING.md ("Gradescope") gives the specification this follows. The zip holds ``setup.sh`` (a venv in
/opt/mgpu-grade with CPU torch and this environment's versions, ``constraints.txt``), ``run_autograder``,
``package/`` (the source, installed not editable: the kernel sees no solutions), ``course/`` (solution
notebooks, hidden checks, ``grading.json`` with the key and limits: root's alone in the container) and
``imports/N/`` (the --import-path folders, which the kernel reads).
"""

import contextlib
import json
import os
import secrets
import shutil
import stat
import sys
import tempfile
import zipfile
from importlib import metadata
from pathlib import Path

from ..authoring import course_notebooks

VENV = "/opt/mgpu-grade"
LIMITS = ("jobs", "timeout", "notebook_timeout", "memory")  # grading.json's, from mgpu-course autograder
PINNED = ("numpy", "ipykernel", "matplotlib", "nbformat", "nbclient", "nbval", "pytest", "cloudpickle",
          "tqdm", "jupyter_client", "ipywidgets", "jupyterlab")

SETUP_SH = """#!/usr/bin/env bash
# Gradescope runs this once, as root, when it builds the autograder's image (written by mgpu-course autograder).
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends python3 python3-venv python3-pip util-linux
python3 -c 'import sys; assert sys.version_info >= (3, 10), "the course needs Python >= 3.10: pick a newer base image"'
python3 -m venv {venv}
{venv}/bin/pip install -q --no-cache-dir --upgrade pip
{venv}/bin/pip install -q --no-cache-dir --index-url https://download.pytorch.org/whl/cpu torch=={torch}
{venv}/bin/pip install -q --no-cache-dir -c /autograder/source/constraints.txt /autograder/source/package
# The solutions, hidden checks, key and the judges' references: root's alone (the kernel may run as
# another user where the container refuses namespaces).
chmod -R go-rwx /autograder/source/course
{venv}/bin/python -c 'from mgpu_helpers.tools.grading.execute import hidden_from_kernel as h; print("\\n".join(h()))' \\
    | xargs -r chmod -R go-rwx
{venv}/bin/python -c 'import torch, nbval, mgpu_helpers.checks; print("mgpu-grade ready: torch", torch.__version__)'
"""

RUN_AUTOGRADER = """#!/usr/bin/env bash
# Gradescope runs this for every submission, as root, in /autograder (written by mgpu-course autograder).
# MGPU_AUTOGRADER_ROOT and MGPU_AUTOGRADER_PYTHON exist for tests on a fake /autograder tree.
exec "${{MGPU_AUTOGRADER_PYTHON:-{venv}/bin/python}}" -m mgpu_helpers.tools.grading.gradescope \\
    "${{MGPU_AUTOGRADER_ROOT:-/autograder}}"
"""


def constraints() -> str:
    """name==version of what grading runs on here, for Gradescope to install (torch: setup.sh, CPU index)."""
    lines = []
    for name in PINNED:
        with contextlib.suppress(metadata.PackageNotFoundError):
            lines.append(f"{name}=={metadata.version(name).split('+')[0]}")  # a local build's +tag: no release
    return "\n".join(lines) + "\n"


def _add(z: zipfile.ZipFile, name: str, data: bytes, mode: int = 0o644) -> None:
    info = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))  # fixed: the same course gives the same zip
    info.external_attr = (stat.S_IFREG | mode) << 16
    info.compress_type = zipfile.ZIP_DEFLATED
    z.writestr(info, data)


def _add_tree(z: zipfile.ZipFile, src: Path, prefix: str) -> None:
    for p in sorted(src.rglob("*")):
        if p.is_file() and not p.is_symlink() and "__pycache__" not in p.parts and p.suffix != ".pyc":
            _add(z, f"{prefix}/{p.relative_to(src).as_posix()}", p.read_bytes())


def build(out: Path, solutions: Path, hidden: Path | None, import_paths: list[Path], key: str | None,
          limits: dict) -> dict:
    """Write the autograder zip; returns its grading.json (key included)."""
    import torch
    package = Path(__file__).resolve().parents[3]
    config = {"key": key or secrets.token_hex(32), "hidden": hidden is not None,
              "imports": [f"imports/{i}" for i in range(len(import_paths))], **limits}
    out.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(out, "w") as z:
        _add(z, "setup.sh", SETUP_SH.format(venv=VENV, torch=torch.__version__.split("+")[0]).encode(), 0o755)
        _add(z, "run_autograder", RUN_AUTOGRADER.format(venv=VENV).encode(), 0o755)
        _add(z, "constraints.txt", constraints().encode())
        for name in ("pyproject.toml", "README.md"):
            _add(z, f"package/{name}", (package / name).read_bytes())
        _add_tree(z, package / "mgpu_helpers", "package/mgpu_helpers")
        for p in course_notebooks(solutions):
            _add(z, f"course/solutions/{p.name}", p.read_bytes())
        if (solutions / "assets").is_dir():
            _add_tree(z, solutions / "assets", "course/solutions/assets")
        if hidden is not None:
            _add_tree(z, hidden, "course/hidden")
        for i, d in enumerate(import_paths):
            _add_tree(z, d, f"imports/{i}")
        _add(z, "course/grading.json", (json.dumps(config, indent=1) + "\n").encode(), 0o600)
    return config


def _student(root: Path) -> str:
    """Who submitted (seeds differ per student): Gradescope's user ids, else one name for all."""
    try:
        users = json.loads((root / "submission_metadata.json").read_text())["users"]
        ids = sorted(str(u.get("id") or u.get("email")) for u in users)
        return "gs-" + "-".join(ids) if ids else "submission"
    except (OSError, ValueError, KeyError, TypeError):
        return "submission"


def collect(submission: Path, names: set[str]) -> tuple[dict[str, Path], list[str]]:
    """The course's notebooks among the uploaded files, wherever they lie (a zip upload keeps its folders):
    (notebook name -> file, notes for the student)."""
    found: dict[str, list[Path]] = {}
    for p in sorted(submission.rglob("*.ipynb"), key=lambda q: (len(q.parts), str(q))):  # the shallowest first
        if p.is_file() and not p.is_symlink() and ".ipynb_checkpoints" not in p.parts:
            found.setdefault(p.name, []).append(p)
    notes = []
    for name, paths in sorted(found.items()):
        if name not in names:
            notes.append(f"{name} is not a notebook of this course: ignored")
        elif len(paths) > 1:
            notes.append(f"{name} was uploaded {len(paths)} times: graded {paths[0].relative_to(submission)}")
    return {n: ps[0] for n, ps in found.items() if n in names}, notes


def run(root: Path) -> int:
    """run_autograder: grade /autograder/submission, write /autograder/results/results.json."""
    from .cli import main as grade
    course = root / "source" / "course"
    results = root / "results"
    results.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        os.chmod(course, 0o700)  # again, should the image have lost setup.sh's modes
    config = json.loads((course / "grading.json").read_text())
    student = _student(root)
    names = {p.name for p in course_notebooks(course / "solutions")}
    with tempfile.TemporaryDirectory(prefix="mgpu-gradescope-") as tmp:
        tmp = Path(tmp)
        files, notes = collect(root / "submission", names)
        (tmp / "submissions" / student).mkdir(parents=True)
        for name, p in files.items():
            shutil.copyfile(p, tmp / "submissions" / student / name)
        if not files:
            notes.append("no notebook of this course was found in the submission (upload the .ipynb files, e.g. "
                         + ", ".join(sorted(names)[:2]) + ")")
        argv = [str(tmp / "submissions"), "--out", str(tmp / "out"), "--solutions", str(course / "solutions"),
                "--key", config["key"], *(f"--{k.replace('_', '-')}={config[k]}" for k in LIMITS),
                *(["--hidden", str(course / "hidden")] if config["hidden"] else []),
                *(f"--import-path={root / 'source' / d}" for d in config["imports"])]
        try:
            rc = grade(argv)
        except Exception as e:  # noqa: BLE001 - Gradescope needs a results.json whatever happened
            print(f"mgpu-grade failed: {e!r}", flush=True)
            rc = -1
        got = tmp / "out" / student / "results.json"
        if got.is_file():
            data = json.loads(got.read_text())
        else:
            data = {"score": 0, "output": "", "tests": []}
            notes.append(f"the grader could not grade this submission (exit {rc}): the instructor has its log")
    data["output"] = "\n".join([*notes, data.get("output", "")]).strip()
    (results / "results.json").write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"mgpu-grade: wrote {results / 'results.json'}: {data['score']} points", flush=True)
    return 0


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(prog="python -m mgpu_helpers.tools.grading.gradescope",
                                 description="run_autograder: grade ROOT/submission into ROOT/results/results.json")
    ap.add_argument("root", type=Path, nargs="?", default=Path("/autograder"), help="Gradescope's /autograder")
    sys.exit(run(ap.parse_args().root))
