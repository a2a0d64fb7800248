#!/bin/bash
# Issue 11's last measurement: the step grid with and without --async-scheduling (steps timed back to back,
# compare step at 8d04ed1+), then the three offline workloads with --async-scheduling.  From a `git archive`:
#   run(command="cd .gpu_tree && bash docs/results/h200/issue11/run_final.sh", carry=[".gpu_tree"])
set -u
export PYTHONUNBUFFERED=1
ln -sfn ../paged vmkv/paged; ln -sfn ../kernels vmkv/kernels; ln -sfn ../compare vmkv/compare
export PYTHONPATH=$PWD VMKV_GIT_COMMIT=$(cat COMMIT)
O=${OUT:-/tmp/out}; R=/tmp/r; mkdir -p $O $R; T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > $R/env.txt
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> $R/env.txt
for A in "--async-scheduling" ""; do
  N=step${A:+_async}
  S="python3 -m vmkv.cli compare step --backends paged,vmem --model llama3-8b --batch-sizes 1,64,256 --context-lens 1024,2048 $A --out /tmp/$N"
  mkdir -p $R/$N; { echo "# commit $VMKV_GIT_COMMIT"; echo "\$ $S"; } > $R/$N/command.txt
  timeout 140 $S > $R/$N/step.log 2>&1; echo "$N rc=$? at $(( $(date +%s) - T0 )) s"
  cp -r /tmp/$N/step_bench.* /tmp/$N/raw $R/$N/ 2>/dev/null; tail -13 $R/$N/step_bench.md
done
E="python3 -m vmkv.cli compare engine --backends paged,vmem --model llama3-8b --dtype bf16 --num-requests 256 --input-len 512..2048 --request-rate inf --max-num-seqs 256 --max-num-batched-tokens 8192 --memory-gib 64 --seed 0 --timeout-s 100"
for A in "--output-len 256" "--output-len 128..512" "--workload shared-prefix --shared-prefix-len 1024 --num-prefixes 4 --num-requests 128 --input-len 1280..2048 --output-len 64..256"; do
  N=$(echo "$A" | tr -c 'a-z0-9\n' '_' | cut -c1-40)_async
  mkdir -p $R/$N; { echo "# commit $VMKV_GIT_COMMIT"; echo "\$ $E $A --async-scheduling"; } > $R/$N/command.txt
  timeout 110 $E $A --async-scheduling --out /tmp/$N > $R/$N/engine.log 2>&1; echo "$N rc=$? at $(( $(date +%s) - T0 )) s"
  cp /tmp/$N/results.json /tmp/$N/summary.md $R/$N/ 2>/dev/null; grep -E "offline .*(paged|vmem)" $R/$N/engine.log | head -2
done
tar czf $O/results_final.tgz -C $R .
