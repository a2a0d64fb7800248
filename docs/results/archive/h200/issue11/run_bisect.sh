#!/bin/bash
# Issue 11: the illegal memory access after the full-budget warm-up (d7ed71b, in .gpu_before): is it async
# scheduling's? (a) d7ed71b without --async-scheduling; (b) this tree (warm-up reverted) with it. Paged only.
set -u
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; R=/tmp/r; mkdir -p $O $R; T0=$(date +%s)
C="--backends paged --model llama3-8b --dtype bf16 --num-requests 256 --input-len 512..2048 --request-rate inf --max-num-seqs 256 --max-num-batched-tokens 8192 --memory-gib 64 --seed 0 --timeout-s 100 --output-len 256"
one() { (cd $1 && ln -sfn ../paged vmkv/paged && ln -sfn ../kernels vmkv/kernels && ln -sfn ../compare vmkv/compare
  export PYTHONPATH=$PWD VMKV_GIT_COMMIT=$(cat COMMIT); N=$2; mkdir -p $R/$N; { echo "# commit $VMKV_GIT_COMMIT"; echo "\$ python3 -m vmkv.cli compare engine $C $3"; } > $R/$N/command.txt
  timeout 120 python3 -m vmkv.cli compare engine $C $3 --out /tmp/$N > $R/$N/engine.log 2>&1; echo "$N rc=$? at $(( $(date +%s) - T0 )) s"
  cp /tmp/$N/results.json /tmp/$N/summary.md $R/$N/ 2>/dev/null; cp /tmp/$N/raw/*.log $R/$N/ 2>/dev/null
  grep -E "^\| offline \| paged" $R/$N/summary.md | head -1 | cut -c1-110; grep -h -E "AcceleratorError" $R/$N/*.log | head -2 | cut -c1-150) }
one .gpu_before fill_sync ""
one . noflll_async "--async-scheduling"
tar czf $O/results_bisect.tgz -C $R .
