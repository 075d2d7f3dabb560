"""Helpers, checks and grading for the course "Memory-efficient multi-GPU training in PyTorch".

One module per notebook (``solutions/04_ddp.ipynb`` ↔ ``mgpu_helpers/ddp.py``) plus shared machinery:
``launch`` (ranks from a notebook cell), ``tracker`` (device-agnostic memory accounting), ``checks``
(exercise checks), ``authoring``/``course`` (release pipeline), ``grading`` (instructor grading, `mgpu-grade`).
"""
__version__ = "0.1.0"
