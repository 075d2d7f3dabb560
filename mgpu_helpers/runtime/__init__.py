"""The shared runtime every notebook stands on: ``launch`` (ranks from a notebook cell; ``contract`` makes gloo
CPU ranks refuse what NCCL would), ``tracker`` (memory accounting with ``memory_allocated`` semantics on any
device), ``plots``, ``comm_log``, ``fake_world``, ``alloc_reference`` and ``exercises``."""
