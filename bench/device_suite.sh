#!/usr/bin/env bash
# pytest on the GPU host's CPU (no GPU visible), with the host's torch -- torch 2.11 there, the oldest the
# course supports (MIN_TORCH in mgpu_helpers/__init__.py) -- and Jupyter's packages carried in .jup
# (see gpu_verify.sh). Usage:
#   bash bench/device_suite.sh OUTDIR fast          # make test-fast's selection: units, checks, mutants at 2 seeds
#   bash bench/device_suite.sh OUTDIR all [PATHS]   # the whole suite (or PATHS), MGPU_SEEDS=20
set -u
out=${1:?usage: device_suite.sh OUTDIR fast|all [paths]}; tier=${2:-fast}; shift $(( $# < 2 ? $# : 2 ))
mkdir -p "$out"; out=$(cd "$out" && pwd)
export PYTHONPATH="$PWD:$PWD/.jup" CUDA_VISIBLE_DEVICES= PYTHONUNBUFFERED=1
if ! python3 -c "import nbval, nbclient, ipykernel" 2>/dev/null; then echo "device_suite.sh: carry .jup (see gpu_verify.sh)" >&2; exit 2; fi
python3 -m ipykernel install --prefix /tmp/kp --name python3 >/dev/null 2>&1; export JUPYTER_PATH=/tmp/kp/share/jupyter
start=$(date +%s)
case "$tier" in
fast) MGPU_SEEDS=2 python3 -m pytest -v -n "${JOBS:-12}" --dist loadfile --tb=short --durations=15 \
        -m "not slow and not browser and not answers" tests "$@" >"$out/fast.log" 2>&1 ;;
all)  MGPU_SEEDS=20 python3 -m pytest -v -n "${JOBS:-12}" --dist loadfile --tb=short --durations=15 "$@" >"$out/all.log" 2>&1 ;;
*) echo "device_suite.sh: tier is fast or all" >&2; exit 2 ;;
esac
rc=$?
echo "$tier ($(python3 -c 'import torch; print("torch", torch.__version__)')) rc=$rc $(( $(date +%s) - start ))s: $(grep -E '^=+ .*(passed|failed)' "$out/$tier.log" | tr -d =)" | tee -a "$out/summary.txt"
grep -E "^(FAILED|ERROR)|\] (FAILED|ERROR) " "$out/$tier.log" | sort -u | head -30
exit $rc
