"""Shared test helpers: ``from testkit import ...`` (not ``conftest``: the repository root has a conftest.py
too, and two modules named conftest replace each other in sys.modules)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_torchrun(module: str, nproc: int = 2, timeout: int = 300, args=()) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node N -m module *args`` from the repo root, as the docstrings say;
    fails with the tail of stderr when it exits non-zero."""
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", str(nproc), "-m", module, *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


# --- tests/test_mutants.py: one parameter per exercise, one per planted mistake, each marked ex_N_M -------

def marked(ex: str, *values, id=None):
    """``pytest.param(ex, *values)`` with the exercise's marker (``-m ex_4_2`` runs exercise 4.2's tests)."""
    return pytest.param(ex, *values, marks=getattr(pytest.mark, f"ex_{ex.replace('.', '_')}"), id=id)
