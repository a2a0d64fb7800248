#!/bin/bash
# The next GPU call for issue 11 (not run yet): GPU tests of what was built after the last device call
# (async scheduling with graphs, prefix-aware admission prefetch, the bounded pick_slot), then the step grid
# and the offline workloads with --async-scheduling, beside the same without it (one invocation each, so both
# run on the same machine state).  Two calls (one call's 600 s limit): PART=1 the tests and the step grids,
# PART=2 the offline workloads.  Run from a `git archive` of the commit in COMMIT:
#   git archive HEAD | tar -x -C .gpu_tree && git rev-parse --short HEAD > .gpu_tree/COMMIT
#   run(command="cd .gpu_tree && PART=1 bash docs/results/h200/issue11/next_run.sh", carry=[".gpu_tree"])
set -u
export PYTHONUNBUFFERED=1
ln -sfn ../paged vmkv/paged; ln -sfn ../kernels vmkv/kernels; ln -sfn ../compare vmkv/compare
export PYTHONPATH=$PWD VMKV_GIT_COMMIT=$(cat COMMIT)
O=${OUT:-/tmp/out}; R=/tmp/r; mkdir -p $O $R; T0=$(date +%s)
PART=${PART:-1}
if [ "$PART" = 1 ]; then
T="tests/test_cuda_graphs.py tests/test_async_scheduling.py tests/test_engine_gpu.py tests/test_vmem_cuda.py tests/test_vmem_prefix_cuda.py"
{ echo "# commit $VMKV_GIT_COMMIT"; echo "\$ python3 -m pytest -q -p no:cacheprovider -rfEs $T"; } > $R/pytest_gpu.log
timeout 150 python3 -m pytest -q -p no:cacheprovider -rfEs $T 2>&1 | tail -8 | tee -a $R/pytest_gpu.log
for A in "" "--async-scheduling"; do
  N=step${A:+_async}
  S="python3 -m vmkv.cli compare step --backends paged,vmem --model llama3-8b --batch-sizes 1,64,256 --context-lens 1024,2048 $A --out /tmp/$N"
  mkdir -p $R/$N; { echo "# commit $VMKV_GIT_COMMIT"; echo "\$ $S"; } > $R/$N/command.txt
  timeout 140 $S > $R/$N/step.log 2>&1; echo "$N rc=$? at $(( $(date +%s) - T0 )) s"
  cp -r /tmp/$N/step_bench.* /tmp/$N/raw $R/$N/ 2>/dev/null; tail -14 $R/$N/step_bench.md
done
fi
if [ "$PART" = 2 ]; then
E="python3 -m vmkv.cli compare engine --backends paged,vmem --model llama3-8b --dtype bf16 --num-requests 256 --input-len 512..2048 --request-rate inf --max-num-seqs 256 --max-num-batched-tokens 8192 --memory-gib 64 --seed 0 --timeout-s 100"
for A in "--output-len 128..512" "--output-len 256" "--workload shared-prefix --shared-prefix-len 1024 --num-prefixes 4 --num-requests 128 --input-len 1280..2048 --output-len 64..256"; do
  N=$(echo "$A" | tr -c 'a-z0-9\n' '_' | cut -c1-40)_async
  mkdir -p $R/$N; { echo "# commit $VMKV_GIT_COMMIT"; echo "\$ $E $A --async-scheduling"; } > $R/$N/command.txt
  timeout 110 $E $A --async-scheduling --out /tmp/$N > $R/$N/engine.log 2>&1; echo "$N rc=$? at $(( $(date +%s) - T0 )) s"
  cp /tmp/$N/results.json /tmp/$N/summary.md $R/$N/ 2>/dev/null; grep -E "offline .*(paged|vmem)" $R/$N/engine.log | head -2
done
fi
tar czf $O/results_part$PART.tgz -C $R .    # one file: the device tool returns a limited number of files
