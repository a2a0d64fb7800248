set -u
export PYTHONUNBUFFERED=1
ln -sfn ../paged vmkv/paged; ln -sfn ../kernels vmkv/kernels; ln -sfn ../compare vmkv/compare
export PYTHONPATH=$PWD VMKV_GIT_COMMIT=$(cat COMMIT)
O=${OUT:-/tmp/out}; mkdir -p $O; T0=$(date +%s)
E="python3 -m vmkv.cli compare engine --backends paged,vmem --model llama3-8b --dtype bf16 --request-rate inf --max-num-seqs 256 --max-num-batched-tokens 8192 --memory-gib 64 --seed 0 --timeout-s 60 --workload shared-prefix --shared-prefix-len 1024 --num-prefixes 4 --num-requests 128 --input-len 1280..2048 --output-len 64..256"
mkdir -p /tmp/r/shared_prefix; { echo "# commit $VMKV_GIT_COMMIT"; echo "\$ $E"; } > /tmp/r/shared_prefix/command.txt
timeout 70 $E --out /tmp/sp > /tmp/r/shared_prefix/engine.log 2>&1; echo "sp rc=$? at $(( $(date +%s) - T0 )) s"
cp /tmp/sp/results.json /tmp/sp/summary.md /tmp/r/shared_prefix/ 2>/dev/null; tar czf $O/r1.tgz -C /tmp/r shared_prefix
S="python3 -m vmkv.cli compare step --backends paged,vmem --model llama3-8b --batch-sizes 1,64,256 --context-lens 1024,2048 --out /tmp/s"
mkdir -p /tmp/r/step; { echo "# commit $VMKV_GIT_COMMIT"; echo "\$ $S"; } > /tmp/r/step/command.txt
timeout 125 $S > /tmp/r/step/step.log 2>&1; echo "step rc=$? at $(( $(date +%s) - T0 )) s"
cp -r /tmp/s/step_bench.* /tmp/s/raw /tmp/r/step/ 2>/dev/null; tar czf $O/r2.tgz -C /tmp/r step
tail -16 /tmp/r/step/step_bench.md
