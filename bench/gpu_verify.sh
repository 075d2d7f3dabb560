#!/usr/bin/env bash
# Everything the README's "Verified on" table records for one GPU, in as few device calls as possible.
#   bash bench/gpu_verify.sh notebooks [NB...]   # solution notebooks via bench/run_notebooks.py (default: all)
#   bash bench/gpu_verify.sh benches             # launch, tracker, amp, checkpointing, sharding, planner
#   bash bench/gpu_verify.sh plan                # mgpu-plan's accuracy rows (alone: device totals need an idle GPU)
#   bash bench/gpu_verify.sh ranks               # planner vs N ranks on one GPU, notebook 12's knobs, tracker
#   bash bench/gpu_verify.sh short               # plan (default allocator; four rows expandable), 2 ranks, diagnostics
#   bash bench/gpu_verify.sh shortest            # the same on the four deciding plan rows, one rank method
# Output goes to $OUT (the device tool's result folder) or test-output/gpu. On the device machine, torch is
# there but Jupyter's packages are not: carry a folder made with
#   .venv/bin/python -m pip install --target .gpu_site ipywidgets   (notebook 11's calculator imports it)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-test-output/gpu}; mkdir -p "$OUT"
export PYTHONPATH=".:${PYTHONPATH:-}" MPLBACKEND=Agg
[ -d .gpu_site ] && export PYTHONPATH="$PYTHONPATH:$PWD/.gpu_site"
# NVLink multicast stays off (the device tool's rule for shared hosts).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
what=${1:-notebooks}; shift || true
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'nccl', torch.cuda.nccl.version() if torch.cuda.is_available() else '-')"
  nproc; } | tee "$OUT/machine.txt"
case "$what" in
notebooks)
  nbs=("$@"); [ ${#nbs[@]} -eq 0 ] && nbs=(solutions/*.ipynb)
  python3 bench/run_notebooks.py --show-diff --outputs "$OUT/nb" "${nbs[@]}" 2>"$OUT/notebooks_stderr.txt" | tee "$OUT/notebooks.txt"
  ;;
benches)
  # Timings first, alone on the machine; then the memory benches side by side (each its own process and
  # allocator statistics; 4 CPU threads each).
  run() { local b=$1; local start=$(date +%s); env -u OUT timeout "${2:-300}" python3 "bench/$b" >"$OUT/${b%.py}.txt" 2>&1
          echo "=== bench/$b: exit $?, $(( $(date +%s) - start )) s" >>"$OUT/${b%.py}.txt"; }
  run launch.py 200; run rank_phases.py 120
  export OMP_NUM_THREADS=4
  for b in amp_gpu.py checkpointing_gpu.py sharding_gpu.py model_sharding_gpu.py planner_gpu.py; do run "$b" 300 & done
  wait
  for f in "$OUT"/*.txt; do echo "##### $f"; tail -c 2500 "$f"; done
  ;;
plan)
  run() { local b=$1; local start=$(date +%s); env -u OUT timeout "${2:-300}" python3 bench/$b ${3:-} >"$OUT/${b%.py}${4:-}.txt" 2>&1
          echo "=== bench/$b ${3:-}: exit $?, $(( $(date +%s) - start )) s" >>"$OUT/${b%.py}${4:-}.txt"; }
  run plan_gpu.py 300 "--allocator default"; run plan_gpu.py 300 --expandable _expandable
  for f in "$OUT"/*.txt; do echo "##### $f"; tail -c 3500 "$f"; done
  ;;
ranks)
  run() { local b=$1; local start=$(date +%s); env -u OUT timeout "${2:-300}" python3 bench/$b ${3:-} >"$OUT/${b%.py}.txt" 2>&1
          echo "=== bench/$b ${3:-}: exit $?, $(( $(date +%s) - start )) s" >>"$OUT/${b%.py}.txt"; }
  run planner_ranks_gpu.py 280; run fsdp_practice_gpu.py 120 "--world 2"; run tracker_vs_cuda.py 90; run planner_gpu.py 90
  for f in "$OUT"/*.txt; do echo "##### $f"; tail -c 2500 "$f"; done
  ;;
short)
  run() { local b=$1; local start=$(date +%s); env -u OUT timeout "$2" python3 bench/$b ${3:-} >"$OUT/${b%.py}.txt" 2>&1
          echo "=== bench/$b ${3:-}: exit $?, $(( $(date +%s) - start )) s" >>"$OUT/${b%.py}.txt"; }
  run plan_gpu.py 260 "--allocator default"
  start=$(date +%s)
  env -u OUT timeout 100 python3 bench/plan_gpu.py --allocator expandable --only "decoder fp32|hf llama (GQA, tied) fp32|conv net fp32\$|conv net bf16 autocast + ckpt" \
    >"$OUT/plan_gpu_expandable.txt" 2>&1
  echo "=== bench/plan_gpu.py expandable (four rows): exit $?, $(( $(date +%s) - start )) s" >>"$OUT/plan_gpu_expandable.txt"
  run planner_ranks_gpu.py 90 "--world 2 --model decoder --model conv --layout fp32 --layout bf16-autocast"
  run planner_gpu_diag.py 40
  for f in "$OUT"/*.txt; do echo "##### $f"; tail -c 3500 "$f"; done
  ;;
shortest)  # what 5 minutes of device time allow: the rows that decide each open question
  run() { local b=$1; local start=$(date +%s); env -u OUT timeout "$2" python3 bench/$b ${3:-} >"$OUT/${b%.py}.txt" 2>&1
          echo "=== bench/$b ${3:-}: exit $?, $(( $(date +%s) - start )) s" >>"$OUT/${b%.py}.txt"; }
  start=$(date +%s)
  env -u OUT timeout 100 python3 bench/plan_gpu.py --only "decoder fp32|tied) fp32|conv net fp32\$|conv net bf16 autocast + ckpt" \
    >"$OUT/plan_gpu.txt" 2>&1
  echo "=== bench/plan_gpu.py (four rows): exit $?, $(( $(date +%s) - start )) s" >>"$OUT/plan_gpu.txt"
  run planner_ranks_gpu.py 35 "--world 2 --model decoder --layout fp32"
  run planner_gpu_diag.py 30
  for f in "$OUT"/*.txt; do echo "##### $f"; tail -c 3500 "$f"; done
  ;;
esac
