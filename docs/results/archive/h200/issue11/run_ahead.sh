#!/bin/bash
# Issue 11: mixed steps planned ahead (async scheduling) and no mid-run compiles. GPU tests of what changed,
# then the three offline workloads with --async-scheduling, one invocation each (both backends).
#   git rev-parse --short HEAD > COMMIT; run(command="bash docs/results/h200/issue11/run_ahead.sh", carry=["COMMIT"])
set -u
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; R=/tmp/r; mkdir -p $O $R; T0=$(date +%s)
ln -sfn ../paged vmkv/paged; ln -sfn ../kernels vmkv/kernels; ln -sfn ../compare vmkv/compare
export PYTHONPATH=$PWD VMKV_GIT_COMMIT=$(cat COMMIT)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > $R/env.txt
T="tests/test_kernel_variants_gpu.py tests/test_cuda_graphs.py tests/test_async_scheduling.py tests/test_engine_gpu.py tests/test_vmem_cuda.py"
{ echo "# commit $VMKV_GIT_COMMIT"; echo "\$ python3 -m pytest -q -p no:cacheprovider -rfEs $T"; } > $R/pytest_gpu.log
timeout 200 python3 -m pytest -q -p no:cacheprovider -rfEs $T 2>&1 | tail -8 | tee -a $R/pytest_gpu.log
echo "tests at $(( $(date +%s) - T0 )) s"
E="python3 -m vmkv.cli compare engine --backends paged,vmem --model llama3-8b --dtype bf16 --num-requests 256 --input-len 512..2048 --request-rate inf --max-num-seqs 256 --max-num-batched-tokens 8192 --memory-gib 64 --seed 0 --timeout-s 100"
for A in "--output-len 256" "--output-len 128..512" "--workload shared-prefix --shared-prefix-len 1024 --num-prefixes 4 --num-requests 128 --input-len 1280..2048 --output-len 64..256"; do
  N=$(echo "$A" | tr -c 'a-z0-9\n' '_' | cut -c1-40)_async
  mkdir -p $R/$N; { echo "# commit $VMKV_GIT_COMMIT"; echo "\$ $E $A --async-scheduling"; } > $R/$N/command.txt
  timeout 110 $E $A --async-scheduling --out /tmp/$N > $R/$N/engine.log 2>&1; echo "$N rc=$? at $(( $(date +%s) - T0 )) s"
  cp /tmp/$N/results.json /tmp/$N/summary.md $R/$N/ 2>/dev/null; grep -E "^\| offline \| (paged|vmem)" $R/$N/summary.md | head -2 | cut -c1-150
  grep -E "^\| offline \| vmem/paged" $R/$N/summary.md | head -1
done
tar czf $O/results_ahead.tgz -C $R .
