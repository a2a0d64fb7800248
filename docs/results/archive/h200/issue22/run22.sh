#!/usr/bin/env bash
# issue 22 device run: setup, GPU parity tests, ipc bench, compare serve at the given rate
# usage: bash .whl/run22.sh COMMIT RATE [tests]
set -o pipefail
COMMIT=$1; RATE=$2; TESTS=$3
export PYTHONUNBUFFERED=1
python3 -V; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [ ! -d /tmp/site/fastapi ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/spy .whl/tools/*.whl
fi
for d in compare paged kernels; do ln -sfn ../$d vmkv/$d; done
export PYTHONPATH=/tmp/site:$PWD VMKV_GIT_COMMIT=$COMMIT
mkdir -p $OUT/r
if [ -n "$TESTS" ]; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider -o addopts="-ra" tests/test_async_scheduling.py tests/test_cuda_graphs.py tests/test_review_async_mixed.py tests/test_server_core_process.py::test_served_tokens_equal_the_in_process_engine 2>&1 | tee $OUT/r/gpu_tests.log | tail -12
  python3 -m vmkv.compare.ipc_bench --out $OUT/r 2>&1 | tail -6
fi
# profile the served engine core and HTTP process 40 s into the served path (py-spy, non-blocking)
( for i in $(seq 1 200); do
    S=$(pgrep -f "vmkv.cli serve" | head -1)
    if [ -n "$S" ]; then sleep 45; C=$(pgrep -P $S -f spawn_main | tail -1)
      /tmp/spy/bin/py-spy record -p $C -d 15 -r 50 -f raw -o $OUT/r/spy_core_$RATE.txt --nonblocking >/dev/null 2>&1 &
      /tmp/spy/bin/py-spy record -p $S -d 15 -r 50 -f raw -o $OUT/r/spy_front_$RATE.txt --nonblocking >/dev/null 2>&1
      break; fi; sleep 2; done ) &
python3 -m vmkv.cli compare serve --backends paged,vmem --random-weights llama3-8b --dtype bf16 --num-requests 600 --request-rate $RATE --input-len sharegpt-in --output-len 64..512 --max-num-seqs 256 --max-num-batched-tokens 8192 --memory-gib 64 --slo ttft:1000,tpot:50 --seed 0 --timeout-s 240 --start-timeout-s 240 --out $OUT/r/serve-$RATE 2>&1 | tee $OUT/r/serve-$RATE.log | tail -40
wait
cd $OUT && tar czf serve-$RATE.tgz r && rm -rf r
