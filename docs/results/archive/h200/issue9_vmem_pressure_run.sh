#!/bin/bash
# Issue 9, "vmem on the GPU under memory pressure crashes": the H200 run (one device call).
# Run from the root of an export of the commit under test: bash issue9_vmem_pressure_run.sh <commit>
# Logs go to $OUT.  Chain A: the bug's repro (compare engine, vmem), then the GPU tests.  Chain B:
# compute-sanitizer memcheck on one GPU engine test per backend, then compare engine on paged,vmem
# if time is left.  The chains run side by side, so compare's throughput shares the GPU.
set -u
COMMIT=${1:-unknown}
export PYTHONUNBUFFERED=1
ln -sfn ../paged vmkv/paged; ln -sfn ../kernels vmkv/kernels; ln -sfn ../compare vmkv/compare
export PYTHONPATH=$PWD
O=${OUT:-/tmp/out}; mkdir -p "$O"
{ echo "commit: $COMMIT"; date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  compute-sanitizer --version | tail -1; } > "$O/env.txt" 2>&1
CMP="python3 -m vmkv.cli compare engine --model llama3-8b --dtype bf16 --num-requests 96 --input-len 512..2048 --output-len 128..512 --max-num-seqs 128 --max-num-batched-tokens 8192 --memory-gib 6 --seed 2"
hdr() { echo "# commit $COMMIT; $(date -u +%FT%TZ)"; echo "\$ $*"; }
(
  hdr "$CMP --backends vmem --timeout-s 140" > "$O/compare_vmem.log"
  timeout 160 $CMP --backends vmem --timeout-s 140 --out /tmp/cmp_vmem 2>&1 | tee -a "$O/compare_vmem.log"
  echo "exit: ${PIPESTATUS[0]}" >> "$O/compare_vmem.log"
  cp /tmp/cmp_vmem/results.json "$O/compare_vmem_results.json" 2>/dev/null
  T="tests/test_vmem_pressure_cuda.py tests/test_vmem_cuda.py tests/test_engine_gpu.py"
  hdr "python3 -m pytest -q -p no:cacheprovider -rfEs $T" > "$O/pytest_gpu.log"
  timeout 210 python3 -m pytest -q -p no:cacheprovider -rfEs $T 2>&1 | tee -a "$O/pytest_gpu.log"
  echo "exit: ${PIPESTATUS[0]}" >> "$O/pytest_gpu.log"
) &
(
  export PYTORCH_NO_CUDA_MEMORY_CACHING=1
  for b in paged vmem-megacache; do
    C="compute-sanitizer --tool memcheck python3 -m pytest -q -p no:cacheprovider -x -m gpu tests/test_engine_gpu.py::test_greedy_on_cuda_matches_transformers[$b]"
    hdr "PYTORCH_NO_CUDA_MEMORY_CACHING=1 $C" > "$O/compute_sanitizer_${b%%-*}.log"
    timeout 150 $C 2>&1 | tee -a "$O/compute_sanitizer_${b%%-*}.log"
    echo "exit: ${PIPESTATUS[0]}" >> "$O/compute_sanitizer_${b%%-*}.log"
  done
  if [ $SECONDS -lt 200 ]; then
    hdr "$CMP --backends paged,vmem --timeout-s 100" > "$O/compare_paged_vmem.log"
    timeout $((360 - SECONDS)) $CMP --backends paged,vmem --timeout-s 100 --out /tmp/cmp_both 2>&1 | tee -a "$O/compare_paged_vmem.log"
    echo "exit: ${PIPESTATUS[0]}" >> "$O/compare_paged_vmem.log"
    cp /tmp/cmp_both/results.json "$O/compare_paged_vmem_results.json" 2>/dev/null
  fi
) &
wait
tail -n 3 "$O"/pytest_gpu.log "$O"/compute_sanitizer_*.log; grep -h -i "completed\|preempt\|req/s\|Traceback\|Error" "$O"/compare_*.log | tail -n 30
