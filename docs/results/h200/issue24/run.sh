#!/usr/bin/env bash
# Device run of issue 24 item 5 ("where memory matters"): the KV budget swept in ONE invocation of
# vmkv compare engine (2, 8, 32 GiB x paged, paged+max, paged+oracle, paged+pow2), offline, on the
# random-weight Llama-3-8B shape; H200, through the device tool, with .whl/ carried (the wheels of
# fastapi, pydantic, uvicorn, pyzmq, msgspec, gguf, openai and their dependencies for Python 3.12).
#   bash docs/results/h200/issue24/run.sh COMMIT
# A smoke run first (the tiny shape on CUDA, two budgets x two designs: wheels, imports, the budget
# table's rendering), then the budget sweep; stops at the first failure; everything under $OUT/r, tarred.
set -o pipefail
C=$1
export PYTHONUNBUFFERED=1 COLUMNS=200
python3 -V; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
for d in compare paged kernels; do ln -sfn ../$d vmkv/$d; done
export PYTHONPATH=/tmp/site:$PWD VMKV_GIT_COMMIT=$C
R=$OUT/r; mkdir -p $R
finish() { cd $OUT && tar czf issue24.tgz r && rm -rf r; exit ${1:-0}; }
S=$SECONDS
timeout 90 python3 -m vmkv.cli compare engine --backends paged,paged+max --model tiny --num-requests 6 \
  --input-len 8..24 --output-len 3..6 --max-model-len 64 --kv-memory 64KiB,1MiB --warmup-requests 1 \
  --max-num-seqs 8 --out $R/smoke > $R/smoke.log 2>&1 || { tail -40 $R/smoke.log; finish 1; }
grep -q "Budget table" $R/smoke/summary.md || { tail -40 $R/smoke.log; finish 1; }
echo "smoke ok in $((SECONDS - S)) s"; S=$SECONDS
timeout ${MAIN_TIMEOUT:-470} python3 -m vmkv.cli compare engine --backends paged,paged+max,paged+oracle,paged+pow2 \
  --model llama3-8b --dtype bf16 --num-requests 200 --input-len lognormal:98,1.0,4,1024 \
  --output-len lognormal:205,1.0,4,1024 --request-rate inf --max-model-len 2048 --memory-gib 2,8,32 \
  --max-num-seqs 256 --max-num-batched-tokens 8192 --warmup-fill-budget --seed 0 --timeout-s 120 \
  --out $R/budget-sharegpt > $R/budget-sharegpt.log 2>&1
rc=$?; echo "budget-sharegpt rc=$rc in $((SECONDS - S)) s"
sed -n '/Budget table/,/Serving/p' $R/budget-sharegpt.log | head -60
finish $rc
