#!/bin/bash
# Issue 11: the offline workload with 256 output tokens, both backends, worker logs kept (run_ahead2.sh's
# workers all exited with -6 at 4b2bbbc; this call names the cause).
#   git rev-parse --short HEAD > COMMIT; run(command="bash docs/results/h200/issue11/run_diag.sh", carry=["COMMIT"])
set -u
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
O=${OUT:-/tmp/out}; R=/tmp/r; mkdir -p $O $R; T0=$(date +%s)
ln -sfn ../paged vmkv/paged; ln -sfn ../kernels vmkv/kernels; ln -sfn ../compare vmkv/compare
export PYTHONPATH=$PWD VMKV_GIT_COMMIT=$(cat COMMIT)
C="--model llama3-8b --dtype bf16 --num-requests 256 --input-len 512..2048 --request-rate inf --max-num-seqs 256 --max-num-batched-tokens 8192 --memory-gib 64 --seed 0 --timeout-s 100"
N=out256; mkdir -p $R/$N; { echo "# commit $VMKV_GIT_COMMIT"; echo "\$ python3 -m vmkv.cli compare engine --backends paged,vmem $C --output-len 256 --async-scheduling"; } > $R/$N/command.txt
timeout 200 python3 -m vmkv.cli compare engine --backends paged,vmem $C --output-len 256 --async-scheduling --out /tmp/$N > $R/$N/engine.log 2>&1; echo "$N rc=$? at $(( $(date +%s) - T0 )) s"
cp /tmp/$N/results.json /tmp/$N/summary.md $R/$N/ 2>/dev/null; cp /tmp/$N/raw/*.log $R/$N/ 2>/dev/null
grep -E "^\| offline \| (paged|vmem)" $R/$N/summary.md | head -3 | cut -c1-110
for f in $R/$N/*.log; do echo "== $f"; grep -E "Error|what\(\)|Traceback|terminate|Fatal" $f | head -6 | cut -c1-300; done
tar czf $O/results_diag.tgz -C $R .
