#!/bin/bash
# Issue 11, the mixed-step split (decode rows through the decode kernel in steps that carry prompt chunks):
# GPU tests of the kernels and the engine, the mixed-step profile (profile_mixed.py), then the offline
# workload with 256 output tokens on the tree before the split and on this tree, in one call.
#   git rev-parse --short HEAD > COMMIT; git archive BEFORE | tar -x -C .gpu_before (docs/results removed), BEFORE > .gpu_before/COMMIT
#   run(command="bash docs/results/h200/issue11/run_mixed.sh", carry=[".gpu_before", "COMMIT"])  (from the repository root)
set -u
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; R=/tmp/r; mkdir -p $O $R; T0=$(date +%s)
setup() { ln -sfn ../paged vmkv/paged; ln -sfn ../kernels vmkv/kernels; ln -sfn ../compare vmkv/compare
          export PYTHONPATH=$PWD VMKV_GIT_COMMIT=$(cat COMMIT); }
setup
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > $R/env.txt
T="tests/test_kernels.py tests/test_engine_gpu.py tests/test_cuda_graphs.py"
{ echo "# commit $VMKV_GIT_COMMIT"; echo "\$ python3 -m pytest -q -p no:cacheprovider -rfEs $T"; } > $R/pytest_gpu.log
timeout 200 python3 -m pytest -q -p no:cacheprovider -rfEs -m "not slow" $T 2>&1 | tail -6 | tee -a $R/pytest_gpu.log
echo "tests at $(( $(date +%s) - T0 )) s"
timeout 120 python3 docs/results/h200/issue11/profile_mixed.py $R/profile paged vmem > $R/profile_mixed.log 2>&1
echo "profile rc=$? at $(( $(date +%s) - T0 )) s"; grep -E "gemm|num_prompt_steps|gpu_ms_by" $R/profile_mixed.log | cut -c1-400
E="python3 -m vmkv.cli compare engine --backends paged,vmem --model llama3-8b --dtype bf16 --num-requests 256 --input-len 512..2048 --request-rate inf --max-num-seqs 256 --max-num-batched-tokens 8192 --memory-gib 64 --seed 0 --timeout-s 100 --output-len 256 --async-scheduling"
for TREE in .gpu_before .; do
  (cd $TREE && setup && N=out256_$(cat COMMIT) && mkdir -p $R/$N && { echo "# commit $VMKV_GIT_COMMIT"; echo "\$ $E"; } > $R/$N/command.txt
   timeout 110 $E --out /tmp/$N > $R/$N/engine.log 2>&1; echo "$N rc=$? at $(( $(date +%s) - T0 )) s"
   cp /tmp/$N/results.json /tmp/$N/summary.md $R/$N/ 2>/dev/null; grep -E "^\| offline \| (paged|vmem)" $R/$N/summary.md | head -2 | cut -c1-120)
done
tar czf $O/results_mixed.tgz -C $R .
