"""One place decides the reduced precision on a device: bf16 from compute capability 8.0, fp16 + GradScaler
before it (T4, V100), bf16 on a CPU; and the package refuses a torch older than the course runs on."""
import importlib
import re

import pytest
import torch

from mgpu_helpers.runtime.precision import CAPABILITY_ENV, for_gpu, training_precision


@pytest.mark.parametrize("capability, name, scaler", [((7, 0), "fp16", True), ((7, 5), "fp16", True),
                                                      ((8, 0), "bf16", False), ((9, 0), "bf16", False)])
def test_gpu_precision_follows_compute_capability(capability, name, scaler):
    p = for_gpu("GPU", capability)
    assert (p.device_type, p.name, p.needs_scaler) == ("cuda", name, scaler)
    assert f"{capability[0]}.{capability[1]}" in p.why


def test_cpu_precision_is_bf16_without_scaler():
    p = training_precision("cpu")
    assert (p.dtype, p.needs_scaler) == (torch.bfloat16, False) and p.why.startswith("CPU")


def _gpu(monkeypatch, name, capability):
    """torch.cuda as it reports this NVIDIA GPU (no GPU needed)."""
    monkeypatch.delenv(CAPABILITY_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: capability)
    monkeypatch.setattr(torch.version, "hip", None)


@pytest.mark.parametrize("name, capability, want", [("Tesla T4", (7, 5), ("fp16", True)),
                                                    ("NVIDIA A100", (8, 0), ("bf16", False)),
                                                    ("NVIDIA H100", (9, 0), ("bf16", False))])
def test_cuda_asks_the_device(monkeypatch, name, capability, want):
    # a T4 as torch reports it: is_bf16_supported() (with emulation) would say True; the capability decides
    _gpu(monkeypatch, name, capability)
    p = training_precision("cuda")
    assert (p.name, p.needs_scaler) == want and name in p.why and CAPABILITY_ENV not in p.why


@pytest.mark.parametrize("told, gpu, want", [("7.5", (9, 0), ("fp16", True)), ("8.0", (7, 5), ("bf16", False)),
                                             (" 7.0 ", (8, 0), ("fp16", True))])
def test_the_setting_decides_as_if_the_gpu_had_that_capability(monkeypatch, told, gpu, want):
    _gpu(monkeypatch, "NVIDIA H100", gpu)
    monkeypatch.setenv(CAPABILITY_ENV, told)
    p = training_precision("cuda:0")
    assert (p.device_type, p.name, p.needs_scaler) == ("cuda",) + want
    assert f"compute capability {told.strip()}, from {CAPABILITY_ENV}" in p.why and "NVIDIA H100" in p.why


def test_the_setting_leaves_the_cpu_alone(monkeypatch):
    cpu = training_precision("cpu")
    monkeypatch.setenv(CAPABILITY_ENV, "7.5")
    assert training_precision("cpu") == cpu and cpu.name == "bf16" and not cpu.needs_scaler
    _gpu(monkeypatch, "NVIDIA H100", (9, 0))
    monkeypatch.setenv(CAPABILITY_ENV, "")   # empty: as unset, the GPU's own
    assert training_precision("cuda").name == "bf16"


@pytest.mark.parametrize("bad", ["7", "sm_75", "7.5.1", "T4", "-7.5"])
def test_a_bad_setting_is_one_clear_line(monkeypatch, bad):
    _gpu(monkeypatch, "Tesla T4", (7, 5))
    monkeypatch.setenv(CAPABILITY_ENV, bad)
    one_line = rf"^{CAPABILITY_ENV}='{re.escape(bad)}': a compute capability as MAJOR\.MINOR, e\.g\. 7\.5 \(a T4\)[^\n]*$"
    with pytest.raises(ValueError, match=one_line):
        training_precision("cuda")


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
    # and `make test-min-torch` installs that torch
    makefile = (Path(__file__).resolve().parent.parent / "Makefile").read_text()
    assert f"MIN_TORCH_PIN := torch=={'.'.join(map(str, mgpu_helpers.MIN_TORCH))}.0\n" in makefile
