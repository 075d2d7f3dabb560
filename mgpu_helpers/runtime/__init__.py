"""The shared runtime every notebook stands on: ``launch`` (ranks from a notebook cell; ``contract`` makes gloo
CPU ranks refuse what NCCL would), ``tracker`` (``memory_allocated`` semantics on any device) and small helpers."""
