#!/bin/bash
# Issue 11, the next device call (not run: this session's device time was spent): the graph-workspace fix on the
# H200 (the regression test), then the offline workload with 256
# output tokens after the full-budget warm-up that crashed before the fix (paged, async scheduling). The
# full-budget warm-up is in commit 33cb6d8 (main went back to the old warm-up until this has run): from the
# repository root, git archive 33cb6d8 | tar -x -C .gpu_fix; echo 33cb6d8 > .gpu_fix/COMMIT, then
#   run(command="cd .gpu_fix && bash docs/results/h200/issue11/run_fix.sh", carry=[".gpu_fix"])
set -u
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; mkdir -p $O; T0=$(date +%s)
ln -sfn ../paged vmkv/paged; ln -sfn ../kernels vmkv/kernels; ln -sfn ../compare vmkv/compare
export PYTHONPATH=$PWD VMKV_GIT_COMMIT=$(cat COMMIT)
{ echo "# commit $VMKV_GIT_COMMIT"; timeout 80 python3 -m pytest -q -p no:cacheprovider -rfEs tests/test_cuda_graphs.py -k "touch_only or matches_eager" 2>&1 | tail -4; } > $O/pytest_gpu_fix.log; cat $O/pytest_gpu_fix.log
C="--backends paged --model llama3-8b --dtype bf16 --num-requests 256 --input-len 512..2048 --request-rate inf --max-num-seqs 256 --max-num-batched-tokens 8192 --memory-gib 64 --seed 0 --timeout-s 85 --output-len 256 --async-scheduling"
echo "\$ python3 -m vmkv.cli compare engine $C" > $O/out256_fix_command.txt
timeout 95 python3 -m vmkv.cli compare engine $C --out /tmp/fix > $O/out256_fix_engine.log 2>&1; echo "rc=$? at $(( $(date +%s) - T0 )) s"
cp /tmp/fix/results.json $O/out256_fix_results.json 2>/dev/null; cp /tmp/fix/summary.md $O/out256_fix_summary.md 2>/dev/null
grep -E "^\| offline \| paged" $O/out256_fix_summary.md | head -1 | cut -c1-110; grep -h AcceleratorError /tmp/fix/raw/*.log | head -1
