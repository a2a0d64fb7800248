#!/bin/bash
# Issue 11: where the illegal memory access of run_diag.sh happens (CUDA_LAUNCH_BLOCKING=1), with and
# without async scheduling, on a short run of the same engine configuration (paged).
set -u
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; R=/tmp/r; mkdir -p $O $R; T0=$(date +%s)
ln -sfn ../paged vmkv/paged; ln -sfn ../kernels vmkv/kernels; ln -sfn ../compare vmkv/compare
export PYTHONPATH=$PWD VMKV_GIT_COMMIT=$(cat COMMIT)
C="--backends paged --model llama3-8b --dtype bf16 --num-requests 8 --input-len 512..2048 --request-rate inf --max-num-seqs 256 --max-num-batched-tokens 8192 --memory-gib 64 --seed 0 --timeout-s 100 --output-len 16 --cuda-graph-sizes 1 2 4 8"
for A in "--async-scheduling" ""; do
  N=repro${A:+_async}
  CUDA_LAUNCH_BLOCKING=1 timeout 150 python3 -m vmkv.cli compare engine $C $A --out /tmp/$N > $R/$N.log 2>&1; echo "$N rc=$? at $(( $(date +%s) - T0 )) s"
  cp /tmp/$N/raw/*.log $R/$N.worker.log 2>/dev/null
  grep -B 30 "AcceleratorError\|Error:" $R/$N.worker.log | grep -E "File|Error" | head -30 | cut -c1-200
done
tar czf $O/results_repro.tgz -C $R .
