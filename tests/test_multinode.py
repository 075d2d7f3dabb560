"""2 nodes × 2 processes on localhost: two torchrun processes sharing a c10d rendezvous endpoint, exactly the
README's multi-node command (``torchrun --nnodes 2 --nproc-per-node N --rdzv-backend c10d --rdzv-endpoint
$HEAD_NODE:29500 -m module``), running notebook 09's script; both exit 0 and rank 0 reports world size 4 and
results equal to the single-process baseline."""
import os
import socket
import subprocess
import sys

import pytest

from testkit import ROOT


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_nodes_of_two_processes_on_localhost():
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "-m", "mgpu_helpers.checks", "model_sharding"]
    nodes = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    try:
        outs = [p.communicate(timeout=120) for p in nodes]
    finally:
        for p in nodes:
            p.kill() if p.poll() is None else None
    for p, (out, err) in zip(nodes, outs):
        assert p.returncode == 0, out[-2000:] + err[-3000:]
    printed = "".join(out for out, _ in outs)  # rank 0 prints, on whichever node it landed
    assert "world size 4" in printed, printed
    assert printed.count("equal one process: True") == 1 and "equal the dense MLP: True" in printed, printed
