#!/usr/bin/env bash
# The CPU-figure tests under several oneDNN ISAs on one machine, side by side (issue: the same course on every
# learner's CPU). Usage: bash bench/cpu_isa_matrix.sh OUTDIR [ISA ...]   (NATIVE = no ONEDNN_MAX_CPU_ISA)
# Where Jupyter packages are missing (the H200 host), install nbval, nbclient and ipykernel first, e.g. from
# wheels: pip install --no-index --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site:$PWD
set -u
out=${1:?usage: cpu_isa_matrix.sh OUTDIR [ISA ...]}; shift
isas=("$@"); [ ${#isas[@]} -eq 0 ] && isas=(NATIVE AVX512_CORE_AMX AVX512_CORE_BF16 AVX512_CORE AVX2)
mkdir -p "$out"; out=$(cd "$out" && pwd)
py=${PYTHON:-python3}
export CUDA_VISIBLE_DEVICES= PYTHONUNBUFFERED=1
{ $py -c "import torch, platform; print('torch', torch.__version__, 'aten', torch.backends.cpu.get_cpu_capability(), platform.machine())"
  grep -m1 "model name" /proc/cpuinfo; grep -m1 -o -w -E "avx512_bf16|amx_bf16|avx512f|avx2" /proc/cpuinfo | sort -u | tr '\n' ' '; echo; } > "$out/cpu.txt" 2>&1
for isa in "${isas[@]}"; do
  if [ "$isa" = NATIVE ]; then unset ONEDNN_MAX_CPU_ISA; else export ONEDNN_MAX_CPU_ISA=$isa; fi
  start=$(date +%s)
  rm -f "$out/$isa.figures.jsonl"; export MGPU_FIGURES_LOG="$out/$isa.figures.jsonl"
  $py -m pytest -o addopts="-p no:cacheprovider --nbval --nbval-current-env --nbval-cell-timeout=300" -q --tb=short -n "${JOBS:-8}" --dist loadfile \
      ${TESTS:-tests/test_planner_ranks.py tests/test_fsdp_practice.py tests/test_planner.py} > "$out/$isa.log" 2>&1
  rc=$?
  worst=$($py -c "import json,sys; r=[json.loads(l) for l in open(sys.argv[1])]; w=max(r,key=lambda x:abs(x['error'])); print(f\"worst planner error {100*w['error']:+.4f}% ({w['test']}) over {len(r)} figures\")" "$out/$isa.figures.jsonl" 2>/dev/null)
  echo "$isa rc=$rc $(( $(date +%s) - start ))s $(tail -1 "$out/$isa.log"); $worst" | tee -a "$out/summary.txt"
done
