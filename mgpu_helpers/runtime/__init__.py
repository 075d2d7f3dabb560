"""The shared runtime every notebook stands on: ``launch`` (ranks from a notebook cell, gloo or NCCL;
``launch_watch`` reports a crashed or hung rank), ``tracker`` (device-agnostic memory accounting with
``torch.cuda.memory_allocated`` semantics) and ``plots`` (memory bars and timelines)."""
