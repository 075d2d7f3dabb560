"""The reduced precision a lesson trains in on this device, decided in one place::

    p = training_precision()          # this process's device: cuda if visible, else cpu; p.why says what and why
    scaler = torch.amp.GradScaler(p.device_type, enabled=p.needs_scaler)
    with torch.autocast(p.device_type, dtype=p.dtype): ...

Compute capability 8.0 or newer (A100, H100, L4): native bf16, no loss scaling (bf16 has fp32's exponent range).
Older NVIDIA GPUs (T4 = 7.5, V100 = 7.0): fp16 autocast with the GradScaler it requires (small fp16 gradients round
to zero); ``torch.cuda.is_bf16_supported()`` says True there, counting emulation (torch/cuda/__init__.py). ROCm
GPUs and CPUs: bf16, no scaler.
"""

import os
import re
from dataclasses import dataclass

import torch

CAPABILITY_ENV = "MGPU_GPU_CAPABILITY"  # "7.5": decide on CUDA as if the GPU had it (the course as on a T4)


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
    """The autocast dtype and whether a GradScaler is needed on ``device`` (default: cuda if visible)."""
    raw = os.environ.get(CAPABILITY_ENV, "").strip()
    told = re.fullmatch(r"(\d+)\.(\d+)", raw)
    if raw and not told:
        raise ValueError(f"{CAPABILITY_ENV}={raw!r}: a compute capability as MAJOR.MINOR, e.g. 7.5 (a T4) or "
                         f"8.0 (an A100); unset it to use the GPU's own")
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cpu":
        return Precision("cpu", torch.bfloat16, False, "CPU: bf16 autocast, no loss scaling (bf16 has fp32's range)")
    if device.type != "cuda":
        raise ValueError(f"training_precision: device {str(device)!r}: the course trains on 'cuda' or 'cpu'")
    index = device.index if device.index is not None else torch.cuda.current_device()
    name = torch.cuda.get_device_name(index)
    if told:
        return for_gpu(name, (int(told[1]), int(told[2])), source=f", from {CAPABILITY_ENV}")
    if torch.version.hip:
        return Precision("cuda", torch.bfloat16, False, f"{name} (ROCm): bf16 autocast, no loss scaling")
    return for_gpu(name, torch.cuda.get_device_capability(index))


def for_gpu(name: str, capability: tuple[int, int], source: str = "") -> Precision:
    """What ``training_precision`` decides on an NVIDIA GPU of this capability (``source``: said after it)."""
    major, minor = capability
    if major >= 8:
        return Precision("cuda", torch.bfloat16, False, f"{name} (compute capability {major}.{minor}{source}): "
                                                        f"native bf16, so bf16 autocast and no loss scaling")
    return Precision("cuda", torch.float16, True,
                     f"{name} (compute capability {major}.{minor}{source}) has no native bf16: fp16 autocast with "
                     f"torch.amp.GradScaler (loss scaling is required in fp16)")
