"""Loaded first by every pytest run from the repo root (unit tests and nbval alike)."""
import os

# run_ranks notes on stderr, once per kernel, when a machine has fewer GPUs than ranks ("using gloo on
# CPU"). nbval compares stderr as well as stdout, so on a one-GPU machine the first launching cell of each
# notebook would differ from its stored output; the kernels nbval starts inherit this and stay quiet.
os.environ.setdefault("MGPU_FALLBACK_NOTE", "0")
