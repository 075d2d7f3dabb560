#!/usr/bin/env bash
# Every GPU row of RESULTS.md, by named suite, in as few device calls as possible:
#   bash bench/gpu_verify.sh notebooks [NB...]   # solution notebooks via bench/run_notebooks.py (default: all)
#   bash bench/gpu_verify.sh nbval [NB...]       # the same under nbval (needs .jup: see below)
#   bash bench/gpu_verify.sh benches             # launch, tracker, amp, checkpointing, sharding, planner
#   bash bench/gpu_verify.sh plan                # mgpu-plan's accuracy rows (alone: device totals need an idle GPU)
#   bash bench/gpu_verify.sh ranks               # planner vs N ranks on one GPU, notebook 12's knobs, tracker
#   bash bench/gpu_verify.sh short               # plan (default allocator; four rows expandable), 2 ranks, diagnostics
#   bash bench/gpu_verify.sh shortest            # the same on the four deciding plan rows, one rank method
# Output goes to $OUT (the device tool's result folder) or test-output/gpu. The device machine has torch but not
# Jupyter's packages: carry a folder .jup made with `pip install --target .jup --python-version 3.12
# --only-binary=:all: nbval nbclient ipykernel ipywidgets` (notebook 11's calculator imports ipywidgets).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-test-output/gpu}; mkdir -p "$OUT"
export PYTHONPATH=".:${PYTHONPATH:-}"
[ -d .jup ] && export PYTHONPATH="$PYTHONPATH:$PWD/.jup"
# NVLink multicast stays off (the device tool's rule for shared hosts).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
what=${1:-notebooks}; shift || true
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'nccl', torch.cuda.nccl.version() if torch.cuda.is_available() else '-')"
  nproc; } | tee "$OUT/machine.txt"
# run SECONDS SCRIPT [ARGS...]: one bench in its own process, its output and exit status in $OUT/NAME.txt
# (NAME: the script and its arguments, so two runs of one script keep both files).
run() { local limit=$1 b=$2; shift 2; local name; name=$(echo "${b%.py}$*" | tr -c 'A-Za-z0-9_\n-' _)
        local start; start=$(date +%s)
        env -u OUT MPLBACKEND=Agg timeout "$limit" python3 "bench/$b" "$@" >"$OUT/$name.txt" 2>&1
        echo "=== bench/$b $*: exit $?, $(( $(date +%s) - start )) s" >>"$OUT/$name.txt"; }
show() { for f in "$OUT"/*.txt; do echo "##### $f"; tail -c "${1:-2500}" "$f"; done; }
case "$what" in
notebooks)
  nbs=("$@"); [ ${#nbs[@]} -eq 0 ] && nbs=(solutions/*.ipynb)
  python3 bench/run_notebooks.py --show-diff --outputs "$OUT/nb" "${nbs[@]}" 2>"$OUT/notebooks_stderr.txt" | tee "$OUT/notebooks.txt"
  ;;
nbval)  # no MPLBACKEND=Agg here: nbval compares a figure's text repr, which Agg drops
  nbs=("$@"); [ ${#nbs[@]} -eq 0 ] && nbs=(solutions/*.ipynb)
  python3 -m pytest -p no:cacheprovider -q -n "${JOBS:-4}" --dist loadfile -o addopts="" --nbval \
    --nbval-current-env --nbval-cell-timeout=300 "${nbs[@]}" 2>&1 | tail -40 | tee "$OUT/nbval.txt"
  ;;
benches)
  # Timings first, alone on the machine; then the memory benches side by side (each its own process and
  # allocator statistics; 4 CPU threads each).
  run 200 launch.py; run 120 rank_phases.py
  export OMP_NUM_THREADS=4
  for b in amp_gpu.py checkpointing_gpu.py sharding_gpu.py model_sharding_gpu.py planner_gpu.py; do run 300 "$b" & done
  wait; show
  ;;
plan)
  run 300 plan_gpu.py --allocator default; run 300 plan_gpu.py --allocator expandable; show 3500
  ;;
ranks)
  run 280 planner_ranks_gpu.py; run 120 fsdp_practice_gpu.py --world 2; run 90 tracker_vs_cuda.py; run 90 planner_gpu.py
  show
  ;;
short)
  run 260 plan_gpu.py --allocator default
  run 100 plan_gpu.py --allocator expandable --only "decoder fp32|hf llama (GQA, tied) fp32|conv net fp32\$|conv net bf16 autocast + ckpt"
  run 90 planner_ranks_gpu.py --world 2 --model decoder --model conv --layout fp32 --layout bf16-autocast
  run 40 planner_gpu_diag.py; show 3500
  ;;
shortest)  # what 5 minutes of device time allow: the rows that decide each open question
  run 100 plan_gpu.py --only "decoder fp32|tied) fp32|conv net fp32\$|conv net bf16 autocast + ckpt"
  run 35 planner_ranks_gpu.py --world 2 --model decoder --layout fp32
  run 30 planner_gpu_diag.py; show 3500
  ;;
*) echo "gpu_verify.sh: unknown suite '$what' (notebooks, nbval, benches, plan, ranks, short, shortest)" >&2; exit 2 ;;
esac
