"""The reduced precision a lesson trains in on this device, decided in one place.

    p = training_precision()                        # this process's device: cuda if visible, else cpu
    print(p.why)                                    # one line: what was chosen and why
    scaler = torch.amp.GradScaler(p.device_type, enabled=p.needs_scaler)
    with torch.autocast(p.device_type, dtype=p.dtype):
        loss = model(x)...

A GPU of compute capability 8.0 or newer (A100, H100, L4, ...) computes bf16 natively: bf16 autocast, no loss
scaling (bf16 has fp32's exponent range). An older NVIDIA GPU (T4 = 7.5, V100 = 7.0) has no bf16 units: fp16
autocast with ``torch.amp.GradScaler``, which is then required (small fp16 gradients round to zero).
``torch.cuda.is_bf16_supported()`` answers True there, counting emulation by default (torch/cuda/__init__.py),
so this module reads the compute capability instead. ROCm GPUs and CPUs: bf16, no scaler.

``MGPU_GPU_CAPABILITY=7.5`` (``MAJOR.MINOR``) decides on a CUDA device as if the GPU had that compute
capability (the course as on a T4, on any GPU); ``why`` says so. A CPU ignores it.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

__all__ = ["CAPABILITY_ENV", "Precision", "for_gpu", "training_precision"]

CAPABILITY_ENV = "MGPU_GPU_CAPABILITY"  # "7.5": decide on a CUDA device as if it had this compute capability


@dataclass(frozen=True)
class Precision:
    device_type: str      # what torch.autocast and torch.amp.GradScaler take: "cuda" or "cpu"
    dtype: torch.dtype    # the autocast dtype
    needs_scaler: bool    # fp16: loss scaling is required
    why: str              # one line for the learner

    @property
    def name(self) -> str:
        return {torch.bfloat16: "bf16", torch.float16: "fp16"}[self.dtype]


def training_precision(device: torch.device | str | None = None) -> Precision:
    """The autocast dtype and whether a GradScaler is needed on ``device`` (default: cuda if visible);
    ``MGPU_GPU_CAPABILITY`` set, on a CUDA device as if it had that compute capability."""
    told = _told_capability()
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cpu":
        return Precision("cpu", torch.bfloat16, False, "CPU: bf16 autocast, no loss scaling (bf16 has fp32's range)")
    if device.type != "cuda":
        raise ValueError(f"training_precision: device {str(device)!r}: the course trains on 'cuda' or 'cpu'")
    index = device.index if device.index is not None else torch.cuda.current_device()
    name = torch.cuda.get_device_name(index)
    if told is not None:
        return for_gpu(name, told, source=f", from {CAPABILITY_ENV}")
    if torch.version.hip:
        return Precision("cuda", torch.bfloat16, False, f"{name} (ROCm): bf16 autocast, no loss scaling")
    return for_gpu(name, torch.cuda.get_device_capability(index))


def for_gpu(name: str, capability: tuple[int, int], source: str = "") -> Precision:
    """The choice for an NVIDIA GPU of this compute capability (what ``training_precision`` decides on it);
    ``source`` follows the capability in ``why`` (where it came from, when not the GPU)."""
    major, minor = capability
    if major >= 8:
        return Precision("cuda", torch.bfloat16, False, f"{name} (compute capability {major}.{minor}{source}): "
                                                        f"native bf16, so bf16 autocast and no loss scaling")
    return Precision("cuda", torch.float16, True,
                     f"{name} (compute capability {major}.{minor}{source}) has no native bf16: fp16 autocast with "
                     f"torch.amp.GradScaler (loss scaling is required in fp16)")


def _told_capability() -> tuple[int, int] | None:
    """``MGPU_GPU_CAPABILITY`` as (major, minor), or None when it is unset or empty."""
    raw = os.environ.get(CAPABILITY_ENV, "").strip()
    if not raw:
        return None
    m = re.fullmatch(r"(\d+)\.(\d+)", raw)
    if not m:
        raise ValueError(f"{CAPABILITY_ENV}={raw!r}: a compute capability as MAJOR.MINOR, e.g. 7.5 (a T4) or "
                         f"8.0 (an A100); unset it to use the GPU's own")
    return int(m[1]), int(m[2])
