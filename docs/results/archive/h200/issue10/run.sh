#!/bin/bash
# GPU check of a committed tree: GPU tests, then the offline engine comparison of docs/results/h200/README.md
set -u
export PYTHONUNBUFFERED=1
ln -sfn ../paged vmkv/paged; ln -sfn ../kernels vmkv/kernels; ln -sfn ../compare vmkv/compare
export PYTHONPATH=$PWD
O=${OUT:-/tmp/out}; mkdir -p "$O"
C=$(cat COMMIT)
{ echo "commit: $C"; date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > "$O/env.txt" 2>&1
T=${TESTS:-"tests/test_vmem_cuda.py tests/test_vmem_pressure_cuda.py tests/test_vmem_prefix_cuda.py tests/test_engine_gpu.py tests/test_kernels.py"}
{ echo "# commit $C"; echo "\$ python3 -m pytest -q -p no:cacheprovider -rfEs $T"; } > "$O/pytest_gpu.log"
timeout ${TEST_S:-240} python3 -m pytest -q -p no:cacheprovider -rfEs $T 2>&1 | tee -a "$O/pytest_gpu.log" | tail -25
if [ "${BENCH:-1}" = 1 ]; then
  CMD="python3 -m vmkv.cli compare engine --backends paged,vmem --model llama3-8b --dtype bf16 --num-requests 256 --input-len 512..2048 --output-len 128..512 --request-rate inf --max-num-seqs 256 --max-num-batched-tokens 8192 --memory-gib 64 --seed 0 --timeout-s 160"
  { echo "# commit $C"; echo "\$ $CMD"; } > "$O/offline.log"
  timeout ${BENCH_S:-330} $CMD --out /tmp/offline 2>&1 | tee -a "$O/offline.log" | tail -40
  cp /tmp/offline/results.json "$O/offline_results.json" 2>/dev/null
  cp /tmp/offline/summary.md "$O/offline_summary.md" 2>/dev/null
fi
if [ "${SAN:-1}" = 1 ]; then
  export PYTORCH_NO_CUDA_MEMORY_CACHING=1
  for b in paged vmem-megacache; do
    S="compute-sanitizer --tool memcheck --report-api-errors no python3 -m pytest -q -p no:cacheprovider -x -m gpu tests/test_engine_gpu.py::test_greedy_on_cuda_matches_transformers[$b]"
    { echo "# commit $C"; echo "\$ PYTORCH_NO_CUDA_MEMORY_CACHING=1 $S"; } > "$O/sanitizer_${b%%-*}.log"
    timeout 150 $S 2>&1 | tee -a "$O/sanitizer_${b%%-*}.log" | tail -4
  done
fi
