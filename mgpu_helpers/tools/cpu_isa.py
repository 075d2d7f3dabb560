"""This CPU's instruction sets as oneDNN names them, and a lower one to test the course's CPU figures under.

    python -m mgpu_helpers.tools.cpu_isa            # e.g. "native AVX512_CORE_AMX (avx2 avx512f avx512_bf16 amx_bf16)"
    python -m mgpu_helpers.tools.cpu_isa --lower    # the ISA `make test` caps oneDNN at for its second run

Learners run the course on AVX2 laptops, AVX-512 (with bf16) AMD and Intel machines, Xeons with AMX and Apple
silicon; oneDNN picks its kernels -- and the scratch memory they borrow -- by ISA. ``ONEDNN_MAX_CPU_ISA``
caps it on a higher machine (oneDNN's documented values: SSE41, AVX, AVX2, AVX512_CORE, AVX512_CORE_BF16,
AVX512_CORE_AMX, ...), so one machine can test two: ``make test`` runs the CPU-figure tests
(``-m cpu_figures``) again under ``--lower``'s answer. Not on x86 (Apple silicon, Arm): no answer, no rerun.
"""
from __future__ import annotations

import argparse
import platform
from pathlib import Path

# highest first: (oneDNN's name, the /proc/cpuinfo flags it needs)
LEVELS = [("AVX512_CORE_AMX", {"amx_bf16", "avx512_bf16"}), ("AVX512_CORE_BF16", {"avx512_bf16"}),
          ("AVX512_CORE", {"avx512f", "avx512bw", "avx512vl"}), ("AVX2", {"avx2"}), ("AVX", {"avx"}),
          ("SSE41", {"sse4_1"})]


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text() if path.exists() else ""
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def native(flags: set[str]) -> str | None:
    """The highest oneDNN ISA these flags allow (None off x86)."""
    return next((name for name, need in LEVELS if need <= flags), None)


def lower(flags: set[str]) -> str | None:
    """A lower ISA with different kernels: AVX2 under any AVX-512, SSE4.1 under AVX2 (None if none)."""
    top = native(flags)
    if top is None or top == "SSE41":
        return None
    return "SSE41" if top in ("AVX2", "AVX") else "AVX2"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mgpu_helpers.tools.cpu_isa", description=__doc__.split("\n\n")[0])
    ap.add_argument("--lower", action="store_true", help="print the lower ISA to test under (nothing if none)")
    a = ap.parse_args(argv)
    flags = cpu_flags()
    if a.lower:
        print(lower(flags) or "")
    else:
        shown = " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags)
        print(f"native {native(flags) or platform.machine()} ({shown})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
