#!/bin/bash
# Issue 11, the blocking-copy fix (vmkv/engine/host_copy.py): GPU test of a launch without synchronising
# operations, a host/CUDA profile of async decode steps, and the async step grid at this commit beside the
# commit before the fix (old/, same invocation).  From a `git archive` with old/ = the previous commit:
#   run(command="cd .gpu_tree && bash docs/results/h200/issue11/run_sync_fix.sh", carry=[".gpu_tree"])
set -u
export PYTHONUNBUFFERED=1
for d in . old; do (cd $d && ln -sfn ../paged vmkv/paged; ln -sfn ../kernels vmkv/kernels; ln -sfn ../compare vmkv/compare); done
export VMKV_GIT_COMMIT=$(cat COMMIT)
O=${OUT:-/tmp/out}; R=/tmp/r; mkdir -p $O $R; T0=$(date +%s)
T="tests/test_cuda_graphs.py"
{ echo "# commit $VMKV_GIT_COMMIT"; echo "\$ python3 -m pytest -q -p no:cacheprovider -rfEs $T"; } > $R/pytest_gpu.log
PYTHONPATH=$PWD timeout 120 python3 -m pytest -q -p no:cacheprovider -rfEs $T 2>&1 | tail -15 | tee -a $R/pytest_gpu.log
echo "tests at $(( $(date +%s) - T0 )) s"
{ echo "# commit $VMKV_GIT_COMMIT"; echo "\$ python3 docs/results/h200/issue11/profile_step.py /tmp/prof"; } > $R/profile.log
PYTHONPATH=$PWD timeout 150 python3 docs/results/h200/issue11/profile_step.py /tmp/prof >> $R/profile.log 2>&1
echo "profile rc=$? at $(( $(date +%s) - T0 )) s"; grep -v "^\s*$" $R/profile.log | grep -v Warning | tail -12
(cd /tmp/prof && gzip -1 *.trace.json; cp profile_step.json $R/; mkdir -p $R/traces; cp *.trace.json.gz $R/traces/)
for V in new old; do
  if [ $V = new ]; then D=$PWD C=$VMKV_GIT_COMMIT; else D=$PWD/old C=$(cat old/COMMIT); fi
  N=step_async_$V
  S="python3 -m vmkv.cli compare step --backends paged,vmem --model llama3-8b --batch-sizes 1,64,256 --context-lens 1024,2048 --async-scheduling --out /tmp/$N"
  mkdir -p $R/$N; { echo "# commit $C"; echo "\$ $S"; } > $R/$N/command.txt
  (cd $D && VMKV_GIT_COMMIT=$C PYTHONPATH=$D timeout 140 $S > $R/$N/step.log 2>&1); echo "$N rc=$? at $(( $(date +%s) - T0 )) s"
  cp -r /tmp/$N/step_bench.* /tmp/$N/raw $R/$N/ 2>/dev/null; tail -13 $R/$N/step_bench.md
done
tar czf $O/results_sync_fix.tgz -C $R .
