"""How much a CPU kernel borrows inside one op (planner.kernels.probe), by thread count: bf16 and
fp32 matmuls of a small decoder's shapes. Run under several ONEDNN_MAX_CPU_ISA values to compare ISAs:
    python bench/probe_threads.py"""
import os

import torch

from mgpu_helpers.planner.kernels import probe as measured_scratch

aten = torch.ops.aten
print("ISA", os.environ.get("ONEDNN_MAX_CPU_ISA", "native"), "torch", torch.__version__, "cores", os.cpu_count())
for dt in (torch.bfloat16, torch.float32):
    for m, k, n in [(256, 64, 256), (256, 256, 64), (512, 64, 4096), (64, 512, 128)]:
        a, b, c = torch.randn(m, k, dtype=dt), torch.randn(n, k, dtype=dt).t(), torch.randn(n, dtype=dt)
        row = []
        for t in (1, 2, 4, 8, 16):
            torch.set_num_threads(t)
            row.append(f"{t}:{measured_scratch(aten.addmm.default, (c, a, b), {})}/{measured_scratch(aten.mm.default, (a.t().contiguous(), a), {})}")
        print(str(dt)[6:], (m, k, n), " ".join(row), flush=True)
