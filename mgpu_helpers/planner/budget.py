"""What a GPU must hold beyond a training step's tensors: the lines between "planned peak" and "fits".

Per rank: kernel workspaces (cuBLAS's, cuDNN's), which no tensor owns; the caching allocator's rounding and
reserve (replayed by ``planner.allocator``, else a calibrated fraction); the CUDA context; NCCL's buffers on
N > 1 GPUs. Each line names its source (:data:`SOURCES`); of a measured range, the upper end is used: an
under-estimate is the dangerous direction.
"""

import re
from dataclasses import dataclass, field

MiB, GiB, GB = 2**20, 2**30, 10**9

# name: (total bytes, architecture, source); nvidia-smi's "MiB" = torch.cuda.mem_get_info()[1]; vendors sell GB.
GPUS = {
    "H200": (143771 * MiB, "hopper", "measured here: NVIDIA H200, driver 580.159.04 (README, Verified on)"),
    "H100-80GB": (81559 * MiB, "hopper", "nvidia-smi of H100 80GB HBM3 and H100 PCIe: 81559MiB"),
    "A100-80GB": (81920 * MiB, "ampere", "nvidia-smi of A100 80GB: 81920MiB"),
    "A100-40GB": (40960 * MiB, "ampere", "nvidia-smi of A100-SXM4-40GB and A100-PCIE-40GB: 40960MiB"),
    "V100-16GB": (16160 * MiB, "volta", "torch.cuda.get_device_properties of Tesla V100-SXM2-16GB: "
                  "total_memory=16160MB (MiB: torch prints bytes // 2**20)"),
    "L4": (23034 * MiB, "ada", "nvidia-smi of NVIDIA L4: 23034MiB"),
    "T4-16GB": (int(14.75 * GiB), "turing", "cudaDeviceProp.totalGlobalMem of Tesla T4 as TensorFlow logs it: "
                "deviceMemorySize 14.75GiB (nvidia-smi: 15360MiB, ECC on)"),
    "RTX-4090": (24564 * MiB, "ada", "nvidia-smi of GeForce RTX 4090: 24564MiB"),
    "A10": (24564 * MiB, "ampere", "nvidia-smi of NVIDIA A10: 24564MiB"),
}

# Architectures without bf16 units (compute capability < 8.0): bf16 runs there emulated, without tensor cores.
NO_NATIVE_BF16 = ("volta", "turing")

CONTEXT_BYTES = 768 * MiB
NCCL_BYTES = 558 * MiB
CUBLAS_WORKSPACE = {"hopper": 32 * MiB, "other": 4096 * 1024 * 2 + 16 * 1024 * 8}  # per handle (torch's defaults)
CONV_WORKSPACE_FRACTION = 0.60  # of the largest convolution's largest activation, in its compute dtype
RESERVE_FRACTION = {("default", "transformer"): 0.27, ("default", "conv"): 0.48,
                    ("expandable", "transformer"): 0.02, ("expandable", "conv"): 0.02}
EXPANDABLE_PAGE = 2 * MiB
# The replay misses part of a conv net's reserve (default allocator): the first step's cuDNN workspaces make
# the segments; measured, that reserve scales with the activations at the peak.
REPLAY_MARGIN = {"default": 0.01, "expandable": 0.015}
CONV_RESERVE_OF_ACTIVATIONS = 0.20

SOURCES = {
    "allocated by tensors": "the planner's fake-tensor trace of one steady-state step (planner.plan)",
    "batch": "inputs and targets on the device: their shapes x dtypes",
    "cuBLAS workspace": "torch's default CUBLAS_WORKSPACE_CONFIG per handle: 32 MiB on Hopper, 8.125 MiB before; "
                        "two handles: forward thread + autograd's backward thread (H200: 64 MiB measured)",
    "allocator rounding": "planner.allocator: the traced requests replayed through the caching allocator's rules "
                          "(blocks not split when the rest is <= 1 MiB count whole)",
    "allocator reserve (replayed)": "planner.allocator: segments the replayed requests leave reserved above the "
                                    "allocated peak",
    "reserve margin": "the replay was up to 0.7 (default) / 1.0 (expandable) points of the allocated peak below "
                      "the H200's reserve (bench/plan_gpu.py transformer rows): 1 / 1.5 points more",
    "allocator reserve (conv nets)": "the default allocator's reserve of a conv net: 0.20 x its activations at the "
                                     "peak, where the replay finds less (H200, ResNet-50 and ConvNeXt: 0.12-0.20x; "
                                     "the first step's cuDNN workspaces make the segments)",
    "cuDNN conv workspace": f"{CONV_WORKSPACE_FRACTION:.2f} x the largest convolution activation "
                            "(H200, batch 64x224^2, ~112 MB fp32 / ~62 MB bf16)",
    "cuDNN conv workspace (traced)": "the trace takes and frees it inside each convolution: 1.55 x its largest "
                                     "activation + 26 MiB, the envelope of ResNet-50's 212 convolutions measured "
                                     "on the H200 (planner.accounting.cudnn_workspace); this much is taken at the peak",
    "allocator reserve": "caching allocator above the allocated peak (H200: transformers +2..27%, "
                         "conv nets +14..48%; upper end)",
    "allocator reserve (expandable)": "expandable_segments: 2 MiB pages + 2% (assumed; not yet measured)",
    "CUDA context": "used on the device minus reserved by the allocator after a step: 747.6-767.6 MiB over 16 "
                    "bench/plan_gpu.py rows (H200, torch 2.11+cu130, lazy module loading); 768 MiB",
    "NCCL buffers": "one NCCL process group, N > 1: 558 MiB (README notebook 02 row, H200, NCCL 2.28.9)",
}


def parse_memory(text: str) -> int:
    """``"80GB"`` -> 80_000_000_000, ``"79.5 GiB"`` -> bytes, also B, KB/KiB, MB/MiB, TB/TiB. A unit is required:
    GPU memory is sold in GB (1e9) and reported in MiB/GiB (2**20, 2**30): a bare number is ambiguous by 7%."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*((?:[KMGT]i?)?B)\s*", str(text), flags=re.IGNORECASE)
    if not m:
        raise ValueError(f"memory size {text!r} needs a unit: e.g. 80GB (decimal, 1e9 bytes) or 80GiB (2**30)")
    value, unit = float(m.group(1)), m.group(2)
    power = "BKMGT".index(unit[0].upper())
    base = 1024 if "i" in unit.lower() else 1000
    return int(round(value * base**power))


def gpu_name(name: str) -> str:
    """The key of :data:`GPUS` that ``name`` means; case and separators are forgiven."""
    key = {re.sub(r"[^a-z0-9]", "", k.lower()): k for k in GPUS}.get(re.sub(r"[^a-z0-9]", "", name.lower()))
    if key is None:
        raise ValueError(f"unknown GPU {name!r}: use one of {', '.join(GPUS)} or --gpu-memory with a unit")
    return key


def gpu(name: str) -> tuple[int, str, str]:
    """(bytes, architecture, source) of a GPU in :data:`GPUS`; case and separators are forgiven."""
    return GPUS[gpu_name(name)]


MEASURED_ON = "H200"  # the GPU whose figures the calibrated lines hold (torch 2.11.0+cu130, driver 580.159.04)


def sources_for(gpu: str | None, arch: str) -> dict:
    """:data:`SOURCES` as they hold for ``gpu``: on another GPU than the H200, the lines that depend on its
    architecture, driver or CUDA version say they are carried over."""
    out = dict(SOURCES)
    if gpu == MEASURED_ON:
        return out
    where = f"on {gpu}" if gpu else "on a GPU given by its capacity (Hopper assumed: the larger workspace)"
    out["cuBLAS workspace"] = (f"torch's default CUBLAS_WORKSPACE_CONFIG for {arch}: "
                               f"{cublas_workspaces(arch)[0] / MiB:g} MiB per handle, "
                               "two handles (forward thread + autograd's backward thread: 2 x 32 MiB measured on "
                               "the H200)")
    out["CUDA context"] = (f"carried over from the H200 (747.6-767.6 MiB, torch 2.11+cu130, lazy module loading): "
                           f"not measured {where}; a context depends on the architecture, driver and CUDA version "
                           "(bench/plan_gpu.py measures it)")
    out["NCCL buffers"] = (f"carried over from the H200 (one NCCL 2.28.9 process group, N > 1: 558 MiB): not "
                           f"measured {where}; NCCL sizes its buffers by topology (NVLink, PCIe)")
    out["reserve margin"] = SOURCES["reserve margin"] + " (the allocator's rules are the same on every GPU)"
    return out


@dataclass
class DeviceBudget:
    """A plan's per-rank device total, line by line. ``lines``: [(name, bytes, source)]."""
    lines: list = field(default_factory=list)

    @property
    def allocated(self) -> int:
        """What ``torch.cuda.max_memory_allocated`` should show: tensors + batch + kernel workspaces."""
        return sum(b for n, b, _ in self.lines if n in _ALLOCATED)

    @property
    def total(self) -> int:
        """What the process uses on the device (``mem_get_info`` before vs after, or NVML)."""
        return sum(b for _, b, _ in self.lines)

    def fits(self, capacity: int) -> bool:
        return self.total <= capacity


_ALLOCATED = ("allocated by tensors", "batch", "cuBLAS workspace", "allocator rounding", "cuDNN conv workspace")


def cublas_workspaces(arch: str = "hopper") -> tuple[int, int]:
    """The two cuBLAS workspaces of a training step (forward's handle, backward thread's handle)."""
    return (CUBLAS_WORKSPACE["hopper" if arch == "hopper" else "other"],) * 2


def replayed(trace, batch_sizes=(), *, arch: str = "hopper", allocator: str = "default") -> dict:
    """The caching allocator's ``rounding`` (of the exact allocated peak) and ``reserve`` (of the allocated
    peak) for a traced step, as fractions for :func:`budget`: sharded plans of it take the same fractions."""
    from .allocator import replay
    r = replay(trace.events, batch=batch_sizes, workspaces=cublas_workspaces(arch),
               expandable=allocator == "expandable")
    return {"rounding": r["peak_allocated"] / r["exact_peak"] - 1,
            "reserve": r["peak_reserved"] / r["peak_allocated"] - 1}


def budget(tensor_peak: int, *, batch_bytes: int = 0, world_size: int = 1, arch: str = "hopper",
           conv_activation_bytes: int = 0, allocator: str = "default", replay: dict | None = None,
           conv_workspace_bytes: int | None = None, activation_bytes: int = 0,
           gpu: str | None = MEASURED_ON) -> DeviceBudget:
    """The device total of one rank whose tensors peak at ``tensor_peak`` bytes. ``conv_activation_bytes``:
    the largest activation of any convolution in its compute dtype (0: no convolutions, a transformer's
    reserve). ``allocator``: "default" or "expandable" (``expandable_segments:True``). ``replay``:
    :func:`replayed`'s fractions (else calibrated ones). ``conv_workspace_bytes``: cuDNN's workspace at the
    peak when traced (part of ``tensor_peak``, moved to its own line). ``activation_bytes``: temporaries at
    the peak (a conv net's reserve floor). ``gpu``: a key of :data:`GPUS` or None, for the sources."""
    sources = sources_for(gpu, arch)  # SOURCES, as they hold for this GPU
    if allocator not in ("default", "expandable"):
        raise ValueError(f"allocator must be 'default' or 'expandable', got {allocator!r}")
    ws = int(conv_workspace_bytes or 0)
    lines = [("allocated by tensors", int(tensor_peak) - ws, sources["allocated by tensors"])]
    if batch_bytes:
        lines.append(("batch", int(batch_bytes), sources["batch"]))
    lines.append(("cuBLAS workspace", sum(cublas_workspaces(arch)), sources["cuBLAS workspace"]))
    exact = sum(b for _, b, _ in lines)
    if replay is not None and int(replay["rounding"] * exact) > 0:
        lines.append(("allocator rounding", int(replay["rounding"] * exact), sources["allocator rounding"]))
    if ws:
        lines.append(("cuDNN conv workspace", ws, sources["cuDNN conv workspace (traced)"]))
    elif conv_workspace_bytes is None and conv_activation_bytes:
        lines.append(("cuDNN conv workspace", int(CONV_WORKSPACE_FRACTION * conv_activation_bytes),
                      sources["cuDNN conv workspace"]))
    allocated = sum(b for _, b, _ in lines)
    if replay is not None:
        reserve, source = int(replay["reserve"] * allocated), sources["allocator reserve (replayed)"]
        if allocator == "default" and conv_activation_bytes and \
                CONV_RESERVE_OF_ACTIVATIONS * activation_bytes > reserve:
            reserve, source = int(CONV_RESERVE_OF_ACTIVATIONS * activation_bytes), \
                sources["allocator reserve (conv nets)"]
        lines.append(("allocator reserve", reserve, source))
        lines.append(("reserve margin", int(REPLAY_MARGIN[allocator] * allocated), sources["reserve margin"]))
    else:
        expandable = allocator == "expandable"
        kind = "conv" if conv_activation_bytes else "transformer"
        reserve = int(RESERVE_FRACTION[allocator, kind] * allocated) + (EXPANDABLE_PAGE if expandable else 0)
        source = sources["allocator reserve (expandable)" if expandable else "allocator reserve"]
        lines.append(("allocator reserve", reserve, source))
    lines.append(("CUDA context", CONTEXT_BYTES, sources["CUDA context"]))
    if world_size > 1:
        lines.append(("NCCL buffers", NCCL_BYTES, sources["NCCL buffers"]))
    return DeviceBudget(lines)
