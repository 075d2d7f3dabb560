#!/usr/bin/env bash
# The whole pytest suite (tests/ and solutions/) on a host without Jupyter packages (the H200 host's Xeon),
# under one oneDNN ISA, with the CPU figures' planned-vs-measured log. Usage:
#   bash bench/device_suite.sh OUTDIR [ISA] [pytest args...]   (ISA: NATIVE or e.g. AVX512_CORE_BF16)
# Needs .whl/ with the Jupyter wheels (nbval, nbclient, ipykernel and their dependencies; README, Verified on).
set -u
out=${1:?usage: device_suite.sh OUTDIR [ISA] [pytest args]}; isa=${2:-NATIVE}; shift $(( $# < 2 ? $# : 2 ))
mkdir -p "$out"; out=$(cd "$out" && pwd)
py=${PYTHON:-python3}
if ! $py -c "import nbval, nbclient, ipykernel" 2>/dev/null; then
  $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
  export PYTHONPATH=/tmp/site:$PWD
  $py -m ipykernel install --prefix /tmp/kp --name python3 >/dev/null 2>&1
  export JUPYTER_PATH=/tmp/kp/share/jupyter
fi
export CUDA_VISIBLE_DEVICES= PYTHONUNBUFFERED=1 MGPU_FIGURES_LOG="$out/$isa.figures.jsonl"
rm -f "$MGPU_FIGURES_LOG"
if [ "$isa" = NATIVE ]; then unset ONEDNN_MAX_CPU_ISA; else export ONEDNN_MAX_CPU_ISA=$isa; fi
start=$(date +%s)
# --dist loadfile keeps a file's module fixtures on one worker (the planted mistakes, tests/test_mutants.py, are
# handed out test by test all the same: conftest.py). -v names every result in the log (an outer `timeout` that
# cuts pytest before its summary still leaves which test failed). LIMIT: seconds.
jobs=${JOBS:-15}; slow=${SLOW-}   # SLOW: files run apart on 4 workers, split test by test (space-separated);
# empty (the default): one run over the paths given
run() { timeout "${LIMIT:-100000}" $py -m pytest -p no:cacheprovider -v -n "$1" --dist "$2" --tb=short --durations=15 \
    -o addopts="--nbval --nbval-current-env --nbval-cell-timeout=300 -m 'not browser and not answers' -rfEs" "${@:3}"; }
rc_slow=0
if [ -n "$slow" ]; then
  run 4 load $slow > "$out/$isa.slow.log" 2>&1 &
  slow_pid=$!
  run $(( jobs > 8 ? jobs - 4 : 4 )) loadfile $(printf -- '--ignore=%s ' $slow) "$@" > "$out/$isa.log" 2>&1
  rc=$?
  wait $slow_pid; rc_slow=$?
  cat "$out/$isa.slow.log" >> "$out/$isa.log"
else
  run "$jobs" "${DIST:-loadfile}" "$@" > "$out/$isa.log" 2>&1   # DIST=load: a file's tests spread over workers
  rc=$?
fi
rc=$(( rc || rc_slow ))
worst=$($py -c "import json,sys; r=[json.loads(l) for l in open(sys.argv[1])]; w=max(r,key=lambda x:abs(x['error'])); print(f\"worst planner CPU error {100*w['error']:+.4f}% ({w['test']}) over {len(r)} figures\")" "$MGPU_FIGURES_LOG" 2>/dev/null)
echo "$isa ($($py -c 'import torch; print("torch", torch.__version__, torch.backends.cpu.get_cpu_capability())')) rc=$rc $(( $(date +%s) - start ))s: $(grep -E '^=+ .*(passed|failed)' "$out/$isa.log" | tr -d = | paste -sd+); $worst" | tee -a "$out/summary.txt"
grep -E "^(FAILED|ERROR)|\] (FAILED|ERROR) " "$out/$isa.log" | sort -u | head -30
