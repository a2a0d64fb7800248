#!/bin/bash
# Issue 11 final figures and issue 12's shrink on/off comparison, one call:
#  (1) the three offline workloads with --async-scheduling (out 256 twice), both backends per invocation;
#  (2) vmem alone, the 128..512 workload, shrinking on (default) and off (--kv-shrink-grace-s inf), alternating x3.
#   git rev-parse --short HEAD > COMMIT; run(command="bash docs/results/h200/issue11/run_ahead2.sh", carry=["COMMIT"])
set -u
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; R=/tmp/r; mkdir -p $O $R; T0=$(date +%s)
ln -sfn ../paged vmkv/paged; ln -sfn ../kernels vmkv/kernels; ln -sfn ../compare vmkv/compare
export PYTHONPATH=$PWD VMKV_GIT_COMMIT=$(cat COMMIT)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > $R/env.txt
C="--model llama3-8b --dtype bf16 --num-requests 256 --input-len 512..2048 --request-rate inf --max-num-seqs 256 --max-num-batched-tokens 8192 --memory-gib 64 --seed 0 --timeout-s 100"
one() {  # name, args
  mkdir -p $R/$1; { echo "# commit $VMKV_GIT_COMMIT"; echo "\$ python3 -m vmkv.cli compare engine $2"; } > $R/$1/command.txt
  timeout 110 python3 -m vmkv.cli compare engine $2 --out /tmp/$1 > $R/$1/engine.log 2>&1; echo "$1 rc=$? at $(( $(date +%s) - T0 )) s"
  cp /tmp/$1/results.json /tmp/$1/summary.md $R/$1/ 2>/dev/null
  grep -E "^\| offline \| (paged|vmem) " $R/$1/summary.md | head -2 | cut -c1-110; grep -E "^\| offline \| vmem/paged" $R/$1/summary.md | head -1
}
one out256_a "--backends paged,vmem $C --output-len 256 --async-scheduling"
one out128_512 "--backends paged,vmem $C --output-len 128..512 --async-scheduling"
one shared_prefix "--backends paged,vmem $C --workload shared-prefix --shared-prefix-len 1024 --num-prefixes 4 --num-requests 128 --input-len 1280..2048 --output-len 64..256 --async-scheduling"
one out256_b "--backends paged,vmem $C --output-len 256 --async-scheduling"
for N in on1 off1 on2 off2 on3 off3; do
  A=""; case $N in off*) A="--kv-shrink-grace-s inf" ;; esac
  one shrink_$N "--backends vmem $C --output-len 128..512 --async-scheduling $A"
done
tar czf $O/results_ahead2.tgz -C $R .
