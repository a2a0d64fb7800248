#!/bin/bash
# Issue 11 final measurements on the lent H200 (graphs on, the default): GPU tests, compare step, offline x3.
set -u
export PYTHONUNBUFFERED=1
ln -sfn ../paged vmkv/paged; ln -sfn ../kernels vmkv/kernels; ln -sfn ../compare vmkv/compare
export PYTHONPATH=$PWD
export VMKV_GIT_COMMIT=$(cat COMMIT)
O=${OUT:-/tmp/out}; mkdir -p $O; T0=$(date +%s)
{ echo "commit: $VMKV_GIT_COMMIT"; date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > $O/env.txt 2>&1
if [ "${TESTS:-1}" = 1 ]; then
T="tests/test_cuda_graphs.py tests/test_engine_gpu.py"
{ echo "# commit $VMKV_GIT_COMMIT"; echo "\$ python3 -m pytest -q -p no:cacheprovider -rfEs $T"; } > $O/pytest_gpu.log
timeout 120 python3 -m pytest -q -p no:cacheprovider -rfEs $T 2>&1 | tail -6 | tee -a $O/pytest_gpu.log
fi
S="python3 -m vmkv.cli compare step --backends paged,vmem --model llama3-8b --batch-sizes 1,64,256 --context-lens 1024,2048 --out /tmp/s"
mkdir -p $O/step; { echo "# commit $VMKV_GIT_COMMIT"; echo "\$ $S"; } > $O/step/command.txt
timeout ${STEP_S:-200} $S > $O/step/step.log 2>&1; echo "step rc=$? at $(( $(date +%s) - T0 )) s"
cp /tmp/s/step_bench.* $O/step/ 2>/dev/null; tail -22 $O/step/step_bench.md
E="python3 -m vmkv.cli compare engine --backends paged,vmem --model llama3-8b --dtype bf16 --num-requests 256 --input-len 512..2048 --request-rate inf --max-num-seqs 256 --max-num-batched-tokens 8192 --memory-gib 64 --seed 0 --timeout-s 100"
run_engine() {  # name, extra args
  mkdir -p $O/$1; { echo "# commit $VMKV_GIT_COMMIT"; echo "\$ $E $2"; } > $O/$1/command.txt
  timeout ${ENGINE_S:-120} $E $2 --out /tmp/$1 > $O/$1/engine.log 2>&1; echo "$1 rc=$? at $(( $(date +%s) - T0 )) s"
  cp /tmp/$1/results.json /tmp/$1/summary.md $O/$1/ 2>/dev/null; grep -E "offline .*(paged|vmem)|vmem/paged" $O/$1/engine.log | head -4
}
run_engine offline "--output-len 128..512"
run_engine offline_out256 "--output-len 256"
run_engine shared_prefix "--workload shared-prefix --shared-prefix-len 1024 --num-prefixes 4 --num-requests 128 --input-len 1280..2048 --output-len 64..256"
