set -u
export PYTHONUNBUFFERED=1
ln -sfn ../paged vmkv/paged; ln -sfn ../kernels vmkv/kernels; ln -sfn ../compare vmkv/compare
export PYTHONPATH=$PWD
O=${OUT:-/tmp/out}; mkdir -p $O
C=$(cat COMMIT)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $O/env.txt
timeout 150 python3 -m pytest -q -p no:cacheprovider -rfEs tests/test_fused_ops.py tests/test_cuda_graphs.py tests/test_engine_gpu.py 2>&1 | tail -15 | tee $O/pytest.log
timeout 150 python3 probe_step.py $O/probe.json graphs 2>&1 | grep -v Warning | tail -12
CMD="python3 -m vmkv.cli compare engine --backends paged,vmem --model llama3-8b --dtype bf16 --num-requests 256 --input-len 512..2048 --output-len 128..512 --request-rate inf --max-num-seqs 256 --max-num-batched-tokens 8192 --memory-gib 64 --seed 0 --timeout-s 160"
{ echo "# commit $C"; echo "\$ $CMD"; } > "$O/offline.log"
timeout 250 $CMD --out /tmp/offline 2>&1 | tee -a "$O/offline.log" | tail -30
cp /tmp/offline/results.json "$O/offline_results.json" 2>/dev/null; cp /tmp/offline/summary.md "$O/offline_summary.md" 2>/dev/null
