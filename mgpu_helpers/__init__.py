"""Helpers, checks and grading for the course "Memory-efficient multi-GPU training in PyTorch".

Four parts (AUTHORING.md):
  ``mgpu_helpers.<lesson>``      what a notebook imports, one face per notebook (04_ddp.ipynb <-> ddp.py): a
                                 module, or a package whose ``__init__`` is the face (``sharding``,
                                 ``model_sharding``, ``fsdp_practice``; ``planner``: notebook 11's face and the
                                 memory planner ``mgpu-plan`` runs, trace -> plan -> budget -> report)
  ``mgpu_helpers.runtime``       launch (ranks from a notebook cell), tracker (memory accounting), plots
  ``mgpu_helpers.checks``        the exercises' checks, one module per notebook; ``checks.references`` holds
                                 what a judge compares against (no notebook imports it; grading masks it)
  ``mgpu_helpers.tools``         instructors' and authors' commands: mgpu-course, mgpu-grade, mgpu-plan, make lab
"""
__version__ = "0.1.0"
