"""The shared runtime every notebook stands on: ``launch`` (ranks from a notebook cell, gloo or NCCL;
``launch_watch`` reports a crashed or hung rank; ``contract`` makes gloo CPU ranks refuse what NCCL would: a
CPU tensor in a collective or send/recv, ``dcp.async_save`` without a CPU backend -- launch.py's docstring says
which backend each machine gets, "cuda:nccl,cpu:gloo" and MGPU_SHARED_GPU=1 included), ``tracker`` (device-agnostic memory accounting with
``torch.cuda.memory_allocated`` semantics) and ``plots`` (memory bars and timelines)."""
