"""pyproject.toml and environment.yml must list the same dependencies with the same bounds."""
import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
CONDA_NAMES = {"pytorch": "torch"}  # conda-forge name -> PyPI name


def _split(req: str) -> tuple[str, str]:
    m = re.match(r"^\s*([A-Za-z0-9_.\-]+)\s*(.*)$", req)
    return m.group(1).lower().replace("_", "-"), m.group(2).replace(" ", "")


def test_environment_yml_matches_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    want = dict(map(_split, project["dependencies"] + project["optional-dependencies"]["dev"]))
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    got, pip = {}, []
    for dep in env["dependencies"]:
        if isinstance(dep, dict):
            pip += dep.get("pip", [])
            continue
        name, spec = _split(dep)
        if name in ("python", "pip"):
            continue
        got[CONDA_NAMES.get(name, name)] = spec
    assert got == want, f"environment.yml {got} != pyproject.toml {want}"
    assert "-e .[dev]" in pip, "environment.yml must install the package itself (pip: -e .[dev])"


def test_console_scripts_declared():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["mgpu-course"] == "mgpu_helpers.tools.course:main"
    assert scripts["mgpu-grade"] == "mgpu_helpers.tools.grading.cli:main"


def test_ci_runs_the_readme_test_command():
    assert "make test" in (ROOT / ".ci/run").read_text()
    assert "make test" in (ROOT / "README.md").read_text()
    assert "make lab" in (ROOT / "README.md").read_text()
