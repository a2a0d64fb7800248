#!/bin/bash
# Issue 11: where the illegal memory access after the full-budget warm-up happens (d7ed71b in .gpu_before,
# synchronous scheduling, CUDA_LAUNCH_BLOCKING=1 so the traceback names the faulting launch).
set -u
export PYTHONUNBUFFERED=1 CUDA_LAUNCH_BLOCKING=1
O=${OUT:-/tmp/out}; R=/tmp/r; mkdir -p $O $R; T0=$(date +%s)
cd .gpu_before; ln -sfn ../paged vmkv/paged; ln -sfn ../kernels vmkv/kernels; ln -sfn ../compare vmkv/compare
export PYTHONPATH=$PWD VMKV_GIT_COMMIT=$(cat COMMIT)
C="--backends paged --model llama3-8b --dtype bf16 --num-requests 256 --input-len 512..2048 --request-rate inf --max-num-seqs 256 --max-num-batched-tokens 8192 --memory-gib 64 --seed 0 --timeout-s 170 --output-len 256"
timeout 190 python3 -m vmkv.cli compare engine $C --out /tmp/ima > $R/engine.log 2>&1; echo "rc=$? at $(( $(date +%s) - T0 )) s"
cp /tmp/ima/raw/*.log $R/ 2>/dev/null
grep -h -B 40 "AcceleratorError" $R/offline-paged.log | grep -E "File|Error" | head -40 | cut -c1-220
tar czf $O/results_ima.tgz -C $R .
