"""One place decides the reduced precision on a device: bf16 from compute capability 8.0, fp16 + GradScaler
before it (T4, V100), bf16 on a CPU; and the package refuses a torch older than the course runs on."""
import importlib

import pytest
import torch

from mgpu_helpers.runtime.precision import for_gpu, training_precision


@pytest.mark.parametrize("capability, name, scaler", [((7, 0), "fp16", True), ((7, 5), "fp16", True),
                                                      ((8, 0), "bf16", False), ((9, 0), "bf16", False)])
def test_gpu_precision_follows_compute_capability(capability, name, scaler):
    p = for_gpu("GPU", capability)
    assert (p.device_type, p.name, p.needs_scaler) == ("cuda", name, scaler)
    assert f"{capability[0]}.{capability[1]}" in p.why


def test_cpu_precision_is_bf16_without_scaler():
    p = training_precision("cpu")
    assert (p.dtype, p.needs_scaler) == (torch.bfloat16, False) and p.why.startswith("CPU")


def test_cuda_asks_the_device(monkeypatch):
    # a T4 as torch reports it: is_bf16_supported() (with emulation) would say True; the capability decides
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "Tesla T4")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (7, 5))
    monkeypatch.setattr(torch.version, "hip", None)
    p = training_precision("cuda")
    assert (p.name, p.needs_scaler) == ("fp16", True) and "Tesla T4" in p.why


def test_unknown_device_is_refused():
    with pytest.raises(ValueError, match="'meta'"):
        training_precision("meta")


def test_old_torch_is_refused_in_one_line(monkeypatch):
    import importlib.metadata
    import mgpu_helpers
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "2.6.0+cu124")
    with pytest.raises(ImportError, match=r"needs torch >= 2\.11, this kernel has 2\.6\.0\+cu124: run `pip install -U torch`"):
        importlib.reload(mgpu_helpers)
    monkeypatch.undo()
    importlib.reload(mgpu_helpers)


def test_the_oldest_torch_is_the_one_pyproject_pins():
    import tomllib
    from pathlib import Path
    import mgpu_helpers
    deps = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"torch>={'.'.join(map(str, mgpu_helpers.MIN_TORCH))}" in deps
