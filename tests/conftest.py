"""Shared test helpers."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_torchrun(module: str, nproc: int = 2, timeout: int = 300) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node N -m module`` from the repo root, as the docstrings say;
    fails with the tail of stderr when it exits non-zero."""
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", str(nproc), "-m", module],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc
