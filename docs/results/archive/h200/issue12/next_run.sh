#!/bin/bash
# Issue 12's next GPU calls (not run yet).
# PART=1,2: "shrinking costs no throughput": the offline workload with shrinking on (default) and off
#   (--kv-shrink-grace-s inf), alternating, 3 runs each over the two parts; each invocation runs paged beside
#   vmem, so compare the vmem/paged ratios of the two settings.
# PART=3: co-location long enough that a burst needs more KV than a static split gives (the 6f38949 shape:
#   3 bursts of 192 prompts), both backends with client timings.
# From a `git archive` with COMMIT, carrying .whl (server wheels, device README) for PART=3:
#   run(command="cd .gpu_tree && PART=1 bash docs/results/h200/issue12/next_run.sh", carry=[".gpu_tree", ".whl"])
set -u
export PYTHONUNBUFFERED=1
ln -sfn ../paged vmkv/paged; ln -sfn ../kernels vmkv/kernels; ln -sfn ../compare vmkv/compare
export PYTHONPATH=$PWD VMKV_GIT_COMMIT=$(cat COMMIT)
O=${OUT:-/tmp/out}; R=/tmp/r; mkdir -p $O $R; T0=$(date +%s); PART=${PART:-1}
E="python3 -m vmkv.cli compare engine --backends paged,vmem --model llama3-8b --dtype bf16 --num-requests 256 --input-len 512..2048 --output-len 128..512 --request-rate inf --max-num-seqs 256 --max-num-batched-tokens 8192 --memory-gib 64 --seed 0 --timeout-s 100"
case $PART in
  1) RUNS="on1 off1 on2 off2" ;;
  2) RUNS="off3 on3" ;;
  3) RUNS="" ;;
esac
for N in $RUNS; do
  A=""; case $N in off*) A="--kv-shrink-grace-s inf" ;; esac
  mkdir -p $R/shrink_$N; { echo "# commit $VMKV_GIT_COMMIT"; echo "\$ $E $A"; } > $R/shrink_$N/command.txt
  timeout 120 $E $A --out /tmp/$N > $R/shrink_$N/engine.log 2>&1; echo "shrink_$N rc=$? at $(( $(date +%s) - T0 )) s"
  cp /tmp/$N/results.json /tmp/$N/summary.md $R/shrink_$N/ 2>/dev/null; grep "vmem/paged" $R/shrink_$N/summary.md | head -1
done
if [ "$PART" = 3 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../.whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
  for B in vmem paged; do
    C="python3 -m vmkv.cli compare colocate --backend $B --bursts 3 --burst-prompts 192 --input-len 1536..3072 --output-len 128 --max-num-seqs 256 --kv-shrink-grace-s 2 --idle-s 6 --weights-gib 17 --out /tmp/colo_$B"
    { echo "# commit $VMKV_GIT_COMMIT"; echo "\$ $C"; } > $R/colocate_$B.log
    timeout 270 $C >> $R/colocate_$B.log 2>&1; echo "colocate $B rc=$? at $(( $(date +%s) - T0 )) s"; tail -8 $R/colocate_$B.log
    cp /tmp/colo_$B/colocate.json $R/colocate_$B.json; cp /tmp/colo_$B/memory.png $R/colocate_$B.png
  done
fi
tar czf $O/results_issue12_part$PART.tgz -C $R .
