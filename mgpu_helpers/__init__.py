"""Helpers, checks and grading for the course "Memory-efficient multi-GPU training in PyTorch" (AUTHORING.md):
one face per notebook (04_ddp.ipynb <-> ddp.py, or a package's ``__init__``), ``runtime`` (ranks, memory
accounting, plots), ``checks`` (one module per notebook; ``checks.references``: what judges compare against),
``planner`` (``mgpu-plan``) and ``tools`` (mgpu-course, mgpu-grade, make lab).
"""
from importlib.metadata import version as _version

__version__ = "0.1.0"

# The oldest torch the course runs on: an older one (a Colab image, say) fails later in obscure ways.
MIN_TORCH = (2, 11)
_TORCH = _version("torch")  # without torch: PackageNotFoundError, "No package metadata was found for torch"
if tuple(int(p) for p in _TORCH.split("+")[0].split(".")[:2]) < MIN_TORCH:
    raise ImportError(f"mgpu_helpers needs torch >= {'.'.join(map(str, MIN_TORCH))}, this kernel has {_TORCH}: "
                      f"run `pip install -U torch` (PyPI's Linux wheel is a CUDA build), then restart the kernel")
